"""ZClip against a NumPy reference (``docs/mechanisms/zclip.md``)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import grpo_optax


def _reference(norm_scales, z, alpha, warmup):
  """The factor each step's gradient is multiplied by, in float64: the
  running mean / variance over the warm-up, then the EMAs of the clipped
  norm (Kumar et al. 2025, Algorithm 1, with the mean updated first).
  """
  mean = var = 0.0
  factors, clipped = [], 0
  for t, n in enumerate(norm_scales):
    if t < warmup:
      delta = n - mean
      mean_new = mean + delta / (t + 1)
      var = (var * t + delta * (n - mean_new)) / (t + 1)
      mean = mean_new
      factors.append(1.0)
      continue
    std = np.sqrt(var)
    nc = n
    if n - mean > z * std:
      nc, clipped = mean + z * std, clipped + 1
    factors.append(nc / n)
    mean = alpha * mean + (1 - alpha) * nc
    var = alpha * var + (1 - alpha) * (nc - mean) ** 2
  return np.array(factors), clipped


@pytest.mark.parametrize("z, alpha, warmup", [(2.5, 0.97, 25), (1.0, 0.5, 3)])
def test_zclip_matches_the_numpy_reference(z, alpha, warmup):
  rng = np.random.default_rng(0)
  scales = np.exp(rng.normal(0, 0.3, 80))
  scales[[30, 31, 55, 70]] *= [20.0, 8.0, 50.0, 0.1]  # spikes and a dip
  base = {
    "w": rng.normal(size=(7, 5)).astype(np.float32),
    "b": rng.normal(size=(5,)).astype(np.float32),
  }
  base_norm = np.sqrt(
    sum(float(np.sum(x.astype(np.float64) ** 2)) for x in base.values())
  )
  tx = grpo_optax.zclip(z, alpha, warmup)
  update = jax.jit(tx.update)
  state = tx.init(base)
  got = []
  for s in scales:
    g = {k: jnp.asarray(x * np.float32(s)) for k, x in base.items()}
    out, state = update(g, state)
    got.append(float(out["w"][0, 0]) / float(g["w"][0, 0]))
  want, clipped = _reference(scales * base_norm, z, alpha, warmup)
  np.testing.assert_allclose(got, want, rtol=2e-5)
  assert int(state.clipped) == clipped > 0
  assert int(state.count) == len(scales)
  assert float(state.metrics()["rate"]) == pytest.approx(clipped / len(scales))


def test_zclip_keeps_dtypes_and_passes_a_zero_gradient():
  tx = grpo_optax.zclip(warmup_steps=1)
  params = {"h": jnp.ones((3,), jnp.bfloat16), "f": jnp.ones((2,), jnp.float16)}
  state = tx.init(params)
  zeros = jax.tree.map(jnp.zeros_like, params)
  for g in (params, zeros, params):
    out, state = tx.update(g, state)
    assert jax.tree.map(lambda x: x.dtype, out) == jax.tree.map(
      lambda x: x.dtype, params
    )
    assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(out))


def test_grpo_zclip_is_the_zclip_stage_before_clipping():
  params = {"w": jnp.ones((4, 4))}
  grads = [{"w": jnp.full((4, 4), v)} for v in (1.0, 1.1, 0.9, 40.0)]
  kw = dict(zclip=1.5, zclip_warmup_steps=3, sparsify=None)
  chain = optax.chain(
    grpo_optax.zclip(1.5, 0.97, 3),
    grpo_optax.grpo(1e-2, sparsify=None, fused=False),
  )
  for fused in (True, False):
    tx = grpo_optax.grpo(1e-2, fused=fused, **kw)
    s, c = tx.init(params), chain.init(params)
    for g in grads:
      u, s = tx.update(g, s, params)
      v, c = chain.update(g, c, params)
      np.testing.assert_allclose(u["w"], v["w"], rtol=1e-6)
    assert int(s.zclip.clipped) == 1
    assert grpo_optax.metrics(s)["zclip/rate"] == pytest.approx(0.25)


# The statistics themselves (mean, variance, clipped count), on a short run
# with a warm-up of 3 and two spikes.
# Norm multipliers of the gradient: a warm-up of 3 steps, then two spikes
# (steps 5 and 8) among norms that vary around their mean.
SCALES = [1.0, 1.3, 0.8, 1.1, 0.9, 6.0, 1.0, 1.2, 5.0, 1.05, 0.95]
Z, ALPHA, WARMUP = 2.0, 0.8, 3


def _gradient(scale):
  rng = np.random.default_rng(0)
  return {
    "w": jnp.asarray(rng.normal(size=(6, 5)) * scale, jnp.float32),
    "b": jnp.asarray(rng.normal(size=(5,)) * scale, jnp.float32),
  }


def _global_norm(tree):
  return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))


def _reference_statistics(norms):
  """``(clipped norms, mean, var, clipped steps)`` in float64."""
  mean = var = 0.0
  clipped = 0
  out = []
  for t, n in enumerate(norms):
    if t < WARMUP:
      seen = np.asarray(norms[: t + 1], np.float64)
      mean, var = float(np.mean(seen)), float(np.var(seen))
      out.append(n)
      continue
    std = np.sqrt(var)
    n_c = n
    if (n - mean) / std > Z:
      n_c = mean + Z * std
      clipped += 1
    mean = ALPHA * mean + (1 - ALPHA) * n_c
    var = ALPHA * var + (1 - ALPHA) * (n_c - mean) ** 2
    out.append(n_c)
  return out, mean, var, clipped


def test_zclip_statistics_match_the_numpy_reference():
  tx = grpo_optax.zclip(z_threshold=Z, alpha=ALPHA, warmup_steps=WARMUP)
  grads = [_gradient(s) for s in SCALES]
  norms = [float(_global_norm(g)) for g in grads]
  want, mean, var, clipped = _reference_statistics(norms)
  state = tx.init(grads[0])
  update = jax.jit(tx.update)
  for t, g in enumerate(grads):
    out, state = update(g, state)
    # The direction is kept, the norm is the clipped one.
    for k in g:
      np.testing.assert_allclose(
        out[k], g[k] * (want[t] / norms[t]), rtol=2e-5, err_msg=f"step {t}"
      )
  assert clipped == 2  # both spikes, nothing else
  assert int(state.clipped) == clipped
  assert int(state.count) == len(SCALES)
  np.testing.assert_allclose(float(state.mean), mean, rtol=1e-5)
  np.testing.assert_allclose(float(state.var), var, rtol=1e-4)


def test_no_clipping_during_the_warmup():
  """A spike inside the warm-up passes and enters the statistics."""
  tx = grpo_optax.zclip(z_threshold=Z, alpha=ALPHA, warmup_steps=WARMUP)
  g = _gradient(1.0)
  state = tx.init(g)
  for s in (1.0, 50.0, 1.0):
    out, state = tx.update(jax.tree.map(lambda x, s=s: x * s, g), state)
  np.testing.assert_allclose(out["w"], g["w"], rtol=1e-6)
  assert int(state.clipped) == 0
  n = float(_global_norm(g))
  np.testing.assert_allclose(float(state.mean), n * 52 / 3, rtol=1e-5)
