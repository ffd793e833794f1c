"""ZClip against a NumPy reference of its statistics and clipping.

The reference follows the paper's description (Kumar et al., 2025) as the
docstring of :func:`grpo_optax.zclip` states it: during the warm-up the
norms pass and the statistics are the plain mean and variance of the norms
seen; afterwards a norm whose z-score exceeds the threshold is scaled down
to ``mean + z * std``, and the EMAs are updated with the clipped norm (the
variance around the new mean).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import grpo_optax

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


def _norm(tree):
  return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))


def _reference(norms):
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


def test_zclip_matches_numpy_reference():
  tx = grpo_optax.zclip(z_threshold=Z, alpha=ALPHA, warmup_steps=WARMUP)
  grads = [_gradient(s) for s in SCALES]
  norms = [float(_norm(g)) for g in grads]
  want, mean, var, clipped = _reference(norms)
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
  n = float(_norm(g))
  np.testing.assert_allclose(float(state.mean), n * 52 / 3, rtol=1e-5)
