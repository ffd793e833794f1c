"""The error-feedback accumulator stored compactly (``accumulator_format``).

The accumulator holds ``a = g + r`` between steps; stored in 2 or 1 bytes it
is rounded stochastically (unbiased), and the mask, the update and the next
residual all read the stored value, so the error feedback loses nothing on
average; both forms of ``grpo()`` store and read it the same way.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import grpo_optax
from grpo_optax import quantization as qz
from grpo_optax import sparsify

FORMATS = (None, "float32", "bfloat16_sr", "int8_sr")


def _params():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {
    "w": 0.1 * jax.random.normal(k1, (64, 256)),
    "v": 0.1 * jax.random.normal(k2, (32, 64)),
    "b": jnp.zeros(64),
  }


def _grads(step):
  keys = jax.random.split(jax.random.key(step + 1), 3)
  p = _params()
  return {
    k: jax.random.normal(key, p[k].shape) * (1.0 + 0.1 * step)
    for k, key in zip(sorted(p), keys)
  }


@functools.cache
def _both_forms(fmt, sparsify_mode, steps=5):
  """Updates and states of each step of the fused core and of the chain.

  Both forms step in one jitted program: one compilation, not two (XLA
  dedupes the kernels they share). Computed once per worker.
  """
  kw = dict(sparsify=sparsify_mode, accumulator_format=fmt)
  txs = (
    grpo_optax.grpo(1e-2, fused=True, **kw),
    grpo_optax.grpo(1e-2, fused=False, **kw),
  )
  params = _params()
  states = tuple(tx.init(params) for tx in txs)

  @jax.jit
  def update(grads, states, params):
    return tuple(tx.update(grads, s, params) for tx, s in zip(txs, states))

  outs = ([], [])
  for t in range(steps):
    steps_out = update(_grads(t), states, params)
    states = tuple(s for _, s in steps_out)
    for form, o in zip(outs, steps_out):
      form.append(o)
  return outs  # per form: [(updates, state) of each step]


@pytest.mark.parametrize("sparsify_mode", ["topk", "threshold"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_core_equals_the_chain(fmt, sparsify_mode):
  fused_steps, chain_steps = _both_forms(fmt, sparsify_mode)
  fused, chain = [u for u, _ in fused_steps], [u for u, _ in chain_steps]
  s_fused, s_chain = fused_steps[-1][1], chain_steps[-1][1]
  for a, b in zip(fused, chain):
    for k in a:
      np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-9)
  # One GrpoState for both forms.
  acc_f = s_fused.mask.accumulator
  acc_c = s_chain.mask.accumulator
  assert jax.tree.structure(acc_f) == jax.tree.structure(acc_c)
  for x, y in zip(jax.tree.leaves(acc_f), jax.tree.leaves(acc_c)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_int8_state_fits_three_bytes_per_parameter():
  # A decoder-shaped tree; every state array counted (codes, scales,
  # per-leaf vectors, counters).
  from benchmarks.step_time import transformer_tree

  params = jax.tree.map(
    lambda s: jnp.zeros(s.shape, s.dtype), transformer_tree(4e6)
  )
  n = sum(x.size for x in jax.tree.leaves(params))
  tx = grpo_optax.grpo(
    1e-3, mu_format="int8", nu_format="uint8", accumulator_format="int8_sr"
  )
  state = tx.init(params)
  stored = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
  assert stored / n <= 3.1, stored / n
  fp32 = grpo_optax.grpo(1e-3).init(params)
  assert sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(fp32)) / n == (
    pytest.approx(12.0, abs=0.01)
  )


def _between_levels(fmt: str, k: int) -> float:
  """A value a quarter of the way between two neighbouring levels of
  ``fmt`` (block maximum 1): rounding to nearest is off by a quarter gap.
  """
  if fmt == "bfloat16_sr":  # 8 significant bits: spacing 2^-7 on [1, 2)
    return float((1 + 2.0**-9) * 2.0 ** -(k % 12))
  lo, hi = (k / 127) ** 2, ((k + 1) / 127) ** 2
  return float(lo + 0.25 * (hi - lo))


@pytest.mark.parametrize("fmt", ["bfloat16_sr", "int8_sr"])
@pytest.mark.parametrize("k", [3, 20, 90])
def test_stochastic_rounding_is_unbiased(fmt, k):
  x = _between_levels(fmt, k) * (-1 if k % 2 else 1)
  # A block of one 1.0 (its maximum) and 255 copies of x, rounded with 100
  # words: 25,500 draws of x, whose mean is x to within 4 standard errors,
  # where rounding to nearest is off by a fixed fraction of a gap.
  from grpo_optax import _common

  block = jnp.full((256,), x, jnp.float32).at[0].set(1.0)
  # One block of 256 entries: under the 8-bit formats' min_size (stored
  # exactly), so their codec is asked for explicitly.
  kw = {"min_size": 0} if fmt == "int8_sr" else {}
  f = qz.state_format(fmt, **kw)
  nearest = qz.state_format(fmt.removesuffix("_sr"), **kw)

  @jax.jit
  def draws(words):
    def one(w):
      bits = _common.hash_bits(block.shape, w)
      return qz.decode(f, qz.encode(f, block, bits=bits))[1:]

    return jax.vmap(one)(words)

  d = np.asarray(draws(jnp.arange(100, dtype=jnp.uint32) * 7919)).ravel()
  se = d.std() / np.sqrt(d.size)
  assert abs(d.mean() - x) <= 4 * se + 1e-7 * abs(x), (d.mean(), x, se)
  assert d.std() > 0  # it does round both ways
  rn = float(qz.decode(nearest, qz.encode(nearest, block))[1])
  assert abs(rn - x) > 10 * abs(d.mean() - x)


@pytest.mark.parametrize("fmt", ["bfloat16_sr", "int8_sr"])
def test_error_feedback_loses_nothing_on_average(fmt):
  # top_k_mask alone: sum of outputs + the stored residual == sum of the
  # gradients, up to the rounding noise (zero mean, so the gap stays at the
  # scale of one rounding, not of the steps taken).
  tx = sparsify.top_k_mask(
    fraction=0.1, method="sampled", accumulator_format=fmt
  )
  g0 = _grads(0)
  state = tx.init(g0)
  total_in = jax.tree.map(jnp.zeros_like, g0)
  total_out = jax.tree.map(jnp.zeros_like, g0)
  update = jax.jit(tx.update)
  for t in range(30):
    g = _grads(t)
    out, state = update(g, state)
    total_in = jax.tree.map(jnp.add, total_in, g)
    total_out = jax.tree.map(jnp.add, total_out, out)
  res = state.residual
  for k in g0:
    gap = np.asarray(total_out[k] + res[k] - total_in[k])
    scale = float(np.abs(np.asarray(total_in[k])).mean())
    assert np.abs(gap.mean()) < 0.01 * scale, (k, gap.mean(), scale)


def test_metrics_read_an_8bit_accumulator():
  # grpo(1e-2, accumulator_format="int8_sr") after 3 steps (its default
  # form, the fused core, is topk), from the run of the test above.
  _, state = _both_forms("int8_sr", "topk")[0][2]
  m = grpo_optax.metrics(state)
  kept = [v for k, v in m.items() if "kept_fraction" in k]
  assert kept and 0.2 < float(kept[0]) < 0.5
  assert any("residual_norm" in k for k in m)


@pytest.mark.parametrize("bad", ["bfloat16", "int8"])
def test_rounding_to_nearest_is_refused(bad):
  with pytest.raises(ValueError, match="accumulator_format.*_sr"):
    grpo_optax.grpo(1e-3, accumulator_format=bad)


@pytest.mark.parametrize("bad", ["int4", 3, "uint8"])
def test_unknown_formats_are_refused(bad):
  with pytest.raises((ValueError, TypeError), match="accumulator_format"):
    grpo_optax.grpo(1e-3, accumulator_format=bad)


def test_optax_wrappers_and_the_dtype_of_updates():
  # bf16 gradients of float32 params give float32 updates (optax's rule).
  tx = grpo_optax.grpo(1e-2, accumulator_format="int8_sr")
  params = _params()
  g = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _grads(0))
  # Dtypes are decided when tracing: no need to compile and run.
  u, _ = jax.eval_shape(tx.update, g, tx.init(params), params)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(u))
  ms = optax.MultiSteps(tx, 2)
  state = ms.init(params)
  u, state = jax.jit(ms.update)(_grads(0), state, params)
  assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree.leaves(u))


@pytest.mark.parametrize("sparsify_mode", ["topk", "threshold"])
@pytest.mark.parametrize("fmt", ["bfloat16_sr", "int8_sr"])
def test_no_step_far_larger_than_the_float32_accumulators(fmt, sparsify_mode):
  # The same gradients through grpo() with a float32 and a compact
  # accumulator: the compact one's largest |update| over 12 steps stays
  # within 1.5x of the float32 run's (the rounding is unbiased; a lost
  # scale or a saturated code would release a burst).
  def largest(acc_format):
    tx = grpo_optax.grpo(
      1e-2, sparsify=sparsify_mode, every=3, accumulator_format=acc_format
    )
    params = _params()
    state = tx.init(params)
    update = jax.jit(tx.update)
    out = 0.0
    for t in range(12):
      u, state = update(_grads(t), state, params)
      out = max(
        out, max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(u))
      )
    return out

  reference = largest("float32")
  assert 0 < largest(fmt) <= 1.5 * reference
