"""The 8-bit state's step: scales from bounds, and no float32 temporaries.

Each block of an 8-bit moment (or accumulator) is encoded against a scale
known before the new array (``momentum.moment_scale``,
``sparsify.accumulator_scales``), so the step decodes, updates and encodes
in one pass instead of writing the new array out in float32 for its block
maxima. These tests check that the bound holds (no entry is clipped) and
that the compiled step keeps no parameter-sized float32 temporary.
"""

from __future__ import annotations

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


@pytest.mark.parametrize("sparsify", [None, "topk", "threshold"])
def test_eight_bit_moments_keep_no_float32_temporary(sparsify):
  # Encoding against a block's maximum made XLA:CPU write the new moments
  # out in float32 (8-9 bytes per parameter of temporaries measured on one
  # (2048, 4096) leaf); with the bounds, what is left is at most a copy of
  # each moment's codes (1 byte per parameter each: the old codes are read
  # by the update and by the encode that overwrites them in place).
  params = {"w": jnp.zeros((64, 4096)), "b": jnp.zeros((4096,))}
  tx = grpo_optax.grpo(
    1e-3, sparsify=sparsify, mu_format="int8", nu_format="uint8"
  )
  # jax 0.10.0's XLA (the lowest supported) keeps one moment in float32 too:
  # measured 5.0-6.0 B/param there (8-9 before the bounds), 0.85-2.05 on
  # jax 0.10.2.
  limit = 2.5 if jax.__version_info__ >= (0, 10, 2) else 7.0
  assert _temp_bytes_per_param(tx, params) < limit


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
  # codes come out of one kernel (through an exact bf16 cast), which they
  # read, instead of each reader recomputing the stochastic rounding while
  # XLA:CPU keeps its float32 input in memory for them (5.07 bytes per
  # parameter of temporaries before, 2.04 after; a float32 accumulator
  # keeps 0.06).
  params = {"w": jnp.zeros((64, 4096)), "b": jnp.zeros((4096,))}
  tx = grpo_optax.grpo(1e-3, accumulator_format="int8_sr")
  # jax 0.10.0's XLA keeps a float32 array more: 4.02 there.
  limit = 2.5 if jax.__version_info__ >= (0, 10, 2) else 4.5
  assert _temp_bytes_per_param(tx, params) < limit


def test_stochastic_bf16_moments_draw_no_parameter_sized_random_array():
  # encode(key=...) hashes one random word per leaf into its bits
  # (_common.hash_bits) instead of drawing jax.random.bits of the leaf's
  # shape, which XLA:CPU materialised (with float32 copies of the moments):
  # 26.0 bytes per parameter of temporaries before, 2.03 after.
  params = {"w": jnp.zeros((64, 4096)), "b": jnp.zeros((4096,))}
  tx = grpo_optax.grpo(1e-3, mu_format="bfloat16_sr", nu_format="bfloat16_sr")
  # jax 0.10.0's XLA keeps a float32 moment more: 5.95 there.
  limit = 3.0 if jax.__version_info__ >= (0, 10, 2) else 7.0
  assert _temp_bytes_per_param(tx, params) < limit
