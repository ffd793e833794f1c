"""The 8-bit state's step: scales from bounds, and no float32 temporaries.

Each block of an 8-bit moment (or accumulator) is encoded against a scale
known before the new array (``momentum.moment_scale``,
``sparsify.accumulator_scales``), so the step decodes, updates and encodes
in one pass instead of writing the new array out in float32 for its block
maxima. These tests check that the bound holds (no entry is clipped) and
that the compiled step keeps no parameter-sized float32 temporary.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from compile_options import USER_DEFAULT

import grpo_optax
from grpo_optax import quantization as qz

INT8 = qz.state_format("int8", min_size=0)
UINT8 = qz.state_format("uint8", min_size=0)


def _blocks_max(x, block=256):
  x = np.abs(np.asarray(x, np.float64))
  return x.reshape(x.shape[:-1] + (-1, block)).max(-1)


def test_moment_scales_bound_the_new_moments():
  # Gradients whose scale swings by 100x between steps and whose signs
  # cancel in mu: the stored scale must stay at or above each block's
  # largest new entry (an entry above it would be clipped to the scale).
  tx = grpo_optax.scale_by_nesterov_adam_rms(
    b1=0.9, b2=0.99, mu_format=INT8, nu_format=UINT8
  )
  params = {"w": jnp.zeros((8, 512))}
  state = tx.init(params)
  update = jax.jit(tx.update)
  rng = np.random.default_rng(0)
  for t in range(12):
    g = rng.standard_t(3, (8, 512)) * (100.0 if t % 3 == 0 else 1.0)
    g = {"w": jnp.asarray(g * (-1) ** t, jnp.float32)}
    mu_old = qz.decode(
      INT8, qz.Quantized(state.mu.codes["w"], state.mu.scale["w"])
    )
    nu_old = qz.decode(
      UINT8, qz.Quantized(state.nu.codes["w"], state.nu.scale["w"]), floor=True
    )
    _, state = update(g, state)
    gw = np.asarray(g["w"], np.float64)
    mu_new = 0.9 * np.asarray(mu_old, np.float64) + 0.1 * gw
    nu_new = 0.99 * np.asarray(nu_old, np.float64) + 0.01 * gw**2
    for new, scale in (
      (mu_new, state.mu.scale["w"]),
      (nu_new, state.nu.scale["w"]),
    ):
      s = np.asarray(scale, np.float64)
      assert np.all(_blocks_max(new) <= s * (1 + 1e-5)), t
      # ... and within the bound's own slack: at most the old scale's
      # decay plus the new gradient's share (not a runaway).
      assert np.all(s <= 1e6 * (np.abs(gw).max() ** 2 + 1)), t


def test_accumulator_scales_bound_the_new_accumulator():
  tx = grpo_optax.top_k_mask(
    fraction=0.2, method="sampled", accumulator_format="int8_sr"
  )
  g0 = {"w": jnp.zeros((16, 512))}  # 8,192 entries: stored in 8 bits
  state = tx.init(g0)
  update = jax.jit(tx.update)
  rng = np.random.default_rng(1)
  for t in range(10):
    g = {
      "w": jnp.asarray(
        rng.normal(size=(16, 512)) * (1 + 3 * (t % 2)), jnp.float32
      )
    }
    _, state = update(g, state)
    acc = state.accumulator
    assert acc.codes["w"].dtype == jnp.int8
    # The residual left after the step is below the threshold; the scale
    # covers every stored entry and follows the threshold, not the history.
    dec = qz.decode("int8_sr", qz.Quantized(acc.codes["w"], acc.scale["w"]))
    s = np.asarray(acc.scale["w"], np.float64)
    assert np.all(_blocks_max(dec) <= s * (1 + 1e-6))
    assert np.all(
      s
      <= 2
      * (np.abs(np.asarray(g["w"])).max() + float(state.thresholds[0]) + 1e-6)
      + 10
    ), t


def _temp_bytes_per_param(tx, params):
  grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  state = tx.init(params)
  compiled = (
    jax.jit(step, donate_argnums=(0, 1))
    .lower(params, state, grads)
    .compile(compiler_options=USER_DEFAULT)
  )
  n = sum(x.size for x in jax.tree.leaves(params))
  return compiled.memory_analysis().temp_size_in_bytes / n


def _codes_copies(tx, params):
  """The ``copy`` instructions of 8-bit arrays in the compiled donated step."""
  grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  text = (
    jax.jit(step, donate_argnums=(0, 1))
    .lower(params, tx.init(params), grads)
    .compile(compiler_options=USER_DEFAULT)
    .as_text()
  )
  return re.findall(r"= [su]8\[[\d,]*\]\S* copy\(", text)


_EIGHT_BIT = dict(mu_format="int8", nu_format="uint8")


@pytest.mark.parametrize(
  "sparsify,accumulator",
  [
    (None, None),
    ("topk", None),
    ("threshold", None),
    ("topk", "int8_sr"),
    ("threshold", "int8_sr"),
  ],
)
def test_eight_bit_state_keeps_no_temporary_and_no_copy(sparsify, accumulator):
  # Encoding against a block's maximum made XLA:CPU write the new moments
  # out in float32 (8-9 bytes per parameter of temporaries measured on one
  # (2048, 4096) leaf). With the scales from bounds, XLA still copied each
  # moment's codes (the update recomputed the new moments from the old
  # codes while the encode overwrote them in place: 0.85-2.05 B/param, and
  # 2.04 more for an 8-bit accumulator's bf16 image). Now the update and
  # the mask read the codes the encode wrote (momentum.reads_stored,
  # quantization._kept): no copy of any 8-bit array, and the temporaries
  # of the float32 state (jax 0.10.0's XLA keeps a float32 array of the
  # fused update in both: 4.0 B/param there).
  params = {"w": jnp.zeros((64, 4096)), "b": jnp.zeros((4096,))}
  acc = {} if sparsify is None else {"accumulator_format": accumulator}
  tx = grpo_optax.grpo(1e-3, sparsify=sparsify, **_EIGHT_BIT, **acc)
  plain = grpo_optax.grpo(1e-3, sparsify=sparsify)
  assert _codes_copies(tx, params) == []
  eight = _temp_bytes_per_param(tx, params)
  assert eight <= _temp_bytes_per_param(plain, params) + 0.15, eight


def test_eight_bit_chain_keeps_no_copy():
  # The chain's moments (scale_by_nesterov_adam_rms) as the fused core's.
  params = {"w": jnp.zeros((64, 4096)), "b": jnp.zeros((4096,))}
  tx = grpo_optax.scale_by_nesterov_adam_rms(**_EIGHT_BIT)
  assert _codes_copies(tx, params) == []
  assert _temp_bytes_per_param(tx, params) < 0.3


@pytest.mark.parametrize("sparsify", ["topk", "threshold"])
def test_bf16_accumulator_keeps_no_float32_copy(sparsify):
  # The stochastically rounded accumulator is the stored bf16 array, and the
  # mask and the moments read it there: XLA:CPU kept a float32 copy of it
  # in memory for them (4 bytes per parameter of temporaries, which a step
  # then page-faults in anew: 2.4x the float32 accumulator's step on a
  # 12.6M-parameter tree) when the rounding ended in a select between bf16
  # values.
  params = {"w": jnp.zeros((64, 4096)), "b": jnp.zeros((4096,))}
  plain = _temp_bytes_per_param(
    grpo_optax.grpo(1e-3, sparsify=sparsify), params
  )
  bf16 = _temp_bytes_per_param(
    grpo_optax.grpo(1e-3, sparsify=sparsify, accumulator_format="bfloat16_sr"),
    params,
  )
  assert bf16 <= plain + 0.1, (bf16, plain)


def test_int8_accumulator_readers_read_the_codes_kernel():
  # The mask and the moments read the stored (rounded) accumulator: its
  # codes come out of one kernel, which they read, instead of each reader
  # recomputing the stochastic rounding while XLA:CPU keeps its float32
  # input in memory for them (5.07 bytes per parameter of temporaries
  # before; 2.04 through an exact bf16 image of the codes; now as the
  # float32 accumulator's, 0.07).
  params = {"w": jnp.zeros((64, 4096)), "b": jnp.zeros((4096,))}
  tx = grpo_optax.grpo(1e-3, accumulator_format="int8_sr")
  plain = _temp_bytes_per_param(grpo_optax.grpo(1e-3), params)
  assert _temp_bytes_per_param(tx, params) <= plain + 0.1
  assert _codes_copies(tx, params) == []


def test_stochastic_bf16_moments_draw_no_parameter_sized_random_array():
  # encode(key=...) hashes one random word per leaf into its bits
  # (_common.hash_bits) instead of drawing jax.random.bits of the leaf's
  # shape, which XLA:CPU materialised (with float32 copies of the moments):
  # 26.0 bytes per parameter of temporaries before, 2.03 after.
  params = {"w": jnp.zeros((64, 4096)), "b": jnp.zeros((4096,))}
  # 2.03 after, as the update still recomputed the rounded moments; now
  # the update reads them (momentum.reads_stored): 0.08, as the float32
  # state's.
  tx = grpo_optax.grpo(1e-3, mu_format="bfloat16_sr", nu_format="bfloat16_sr")
  plain = _temp_bytes_per_param(grpo_optax.grpo(1e-3), params)
  assert _temp_bytes_per_param(tx, params) <= plain + 0.1
