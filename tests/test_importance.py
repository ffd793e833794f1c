"""scale_by_importance: NumPy reference (order 1 and 2), extra args, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import grpo_optax


def _seq(steps=25, seed=0):
  rng = np.random.default_rng(seed)
  params = {
    "w": rng.normal(size=(6, 5)).astype(np.float32),
    "b": rng.normal(size=(5,)).astype(np.float32) * 0.1,
  }
  grads = [
    {
      k: rng.normal(size=v.shape).astype(np.float32) * (1 + i % 3)
      for k, v in params.items()
    }
    for i in range(steps)
  ]
  return params, grads


def _numpy_reference(params, grads, order, d, lo, hi, hessians=None):
  h = {k: np.zeros_like(v, np.float64) for k, v in params.items()}
  s_ema = {k: np.zeros_like(v, np.float64) for k, v in params.items()}
  outs = []
  for t, g in enumerate(grads):
    bc = 1 - d ** (t + 1)
    out, ratio = {}, {}
    for k in g:
      gk = g[k].astype(np.float64)
      p = params[k].astype(np.float64)
      if hessians is None:
        h[k] = d * h[k] + (1 - d) * gk**2
        h_hat = h[k] / bc
      else:
        h_hat = hessians[t][k]
      s = np.abs(gk * p) + (0.5 * h_hat * p**2 if order == 2 else 0.0)
      s_ema[k] = d * s_ema[k] + (1 - d) * s
      s_hat = s_ema[k] / bc
      ratio[k] = s_hat / (np.mean(s_hat) + 1e-12)
      out[k] = gk * np.clip(ratio[k], lo, hi)
    outs.append(out)
  return outs, ratio


@pytest.mark.parametrize("order", [1, 2])
def test_matches_numpy_reference(order):
  params, grads = _seq()
  tx = grpo_optax.scale_by_importance(
    order=order, decay=0.8, min_weight=0.2, max_weight=3.0
  )
  state = tx.init(params)
  update = jax.jit(tx.update)
  ref, ratio = _numpy_reference(params, grads, order, 0.8, 0.2, 3.0)
  for g, r in zip(grads, ref):
    out, state = update(g, state, params)
    for k in r:
      np.testing.assert_allclose(out[k], r[k], rtol=2e-4, atol=1e-6)
  assert (state.hessian is None) == (order == 1)
  # Diagnostics over all elements (each leaf is its own sample here): the
  # clipped weights, and the early-stop statistic std(S / mean(S)), which
  # is taken before clipping (some ratios lie outside [0.2, 3]).
  r = np.concatenate([ratio[k].ravel() for k in params])
  w = np.clip(r, 0.2, 3.0)
  assert np.any(r != w)
  np.testing.assert_allclose(state.weight_mean, w.mean(), rtol=1e-5)
  np.testing.assert_allclose(state.weight_std, w.std(), rtol=1e-4)
  np.testing.assert_allclose(state.score_std, r.std(), rtol=1e-4)


def test_order_matters():
  params, grads = _seq(3)
  o1 = grpo_optax.scale_by_importance(order=1)
  o2 = grpo_optax.scale_by_importance(order=2)
  u1, _ = o1.update(grads[0], o1.init(params), params)
  u2, _ = o2.update(grads[0], o2.init(params), params)
  assert not np.allclose(u1["w"], u2["w"])


def test_hessian_diag_extra_arg_replaces_fisher():
  params, grads = _seq(10)
  rng = np.random.default_rng(1)
  hessians = [
    {
      k: np.abs(rng.normal(size=v.shape)).astype(np.float32) * 5
      for k, v in params.items()
    }
    for _ in grads
  ]
  tx = grpo_optax.scale_by_importance(decay=0.9)
  state = tx.init(params)
  ref, _ = _numpy_reference(params, grads, 2, 0.9, 0.1, 10.0, hessians)
  for g, hd, r in zip(grads, hessians, ref):
    out, state = jax.jit(tx.update)(g, state, params, hessian_diag=hd)
    for k in r:
      np.testing.assert_allclose(out[k], r[k], rtol=2e-4, atol=1e-6)
  # the Fisher EMA is left untouched when a Hessian estimate is given
  np.testing.assert_array_equal(state.hessian["w"], np.zeros((6, 5)))


def test_head_entropy_multiplies_weights_per_head():
  params = {
    "q": jnp.ones((4, 3, 2)),
    "o": jnp.ones((3, 2, 4)),
    "b": jnp.ones(4),
  }
  g = jax.tree.map(jnp.ones_like, params)
  ent = jnp.array([1.0, 2.0, 3.0])
  tx = grpo_optax.scale_by_importance()
  base, _ = tx.update(g, tx.init(params), params)
  tree = {
    "q": grpo_optax.per_head(ent, axis=1, ndim=3),
    "o": grpo_optax.per_head(ent, axis=0, ndim=3),
    "b": None,
  }
  out, _ = jax.jit(tx.update)(g, tx.init(params), params, head_entropy=tree)
  factor = np.asarray(ent / ent.mean())
  np.testing.assert_allclose(
    out["q"], base["q"] * factor[None, :, None], rtol=1e-6
  )
  np.testing.assert_allclose(
    out["o"], base["o"] * factor[:, None, None], rtol=1e-6
  )
  np.testing.assert_allclose(out["b"], base["b"], rtol=1e-6)  # jit vs eager


def test_head_entropy_wrong_structure():
  params = {"q": jnp.ones((4, 3)), "b": jnp.ones(4)}
  tx = grpo_optax.scale_by_importance()
  with pytest.raises(ValueError, match="head_entropy"):
    tx.update(params, tx.init(params), params, head_entropy={"q": None})


def test_per_head_validates():
  with pytest.raises(ValueError, match="axis"):
    grpo_optax.per_head(jnp.ones(3), axis=3, ndim=3)
  with pytest.raises(ValueError, match="vector"):
    grpo_optax.per_head(jnp.ones((3, 1)), axis=0, ndim=3)


def test_diagnostics_follow_the_weights():
  params, grads = _seq(5)
  tx = grpo_optax.scale_by_importance()
  state = tx.init(params)
  for g in grads:
    out, state = tx.update(g, state, params)
  # weights = out / g, the diagnostics are estimated from a sample (all of it here)
  w = np.concatenate(
    [(np.asarray(out[k]) / grads[-1][k]).ravel() for k in params]
  )
  np.testing.assert_allclose(state.weight_mean, w.mean(), rtol=1e-4)
  np.testing.assert_allclose(state.weight_std, w.std(), rtol=1e-3)
  assert float(state.score_std) > 0


def test_diagnostics_of_large_leaves_are_size_weighted_samples():
  """A leaf over 1,024 entries contributes its strided sample, weighted by n.

  "big" has 4,096 entries (sampled on the grid of every 2nd row and column,
  1,024 entries: ``_common.sample_strides``), "flat" 600 (all of them,
  all weights 1); the estimates are the size-weighted means of the sample
  means, 4,096 : 600, not 1,024 : 600.
  """
  rng = np.random.default_rng(2)
  params = {
    "big": rng.normal(size=(64, 64)).astype(np.float32),
    "flat": np.full(600, 0.5, np.float32),
  }
  g = {
    "big": rng.normal(size=(64, 64)).astype(np.float32),
    "flat": np.full(600, -2.0, np.float32),
  }
  tx = grpo_optax.scale_by_importance(order=1)
  out, state = tx.update(g, tx.init(params), params)
  w = {k: np.asarray(out[k], np.float64) / g[k] for k in g}
  r = {k: np.abs(g[k] * params[k]).astype(np.float64) for k in g}
  r = {k: v / v.mean() for k, v in r.items()}
  assert grpo_optax._common.sample_strides((64, 64), 1024) == (2, 2)
  samples_w = {"big": w["big"][::2, ::2], "flat": w["flat"]}
  samples_r = {"big": r["big"][::2, ::2], "flat": r["flat"]}

  def mean(x, n):
    return sum(n[k] * x[k].mean() for k in n) / sum(n.values())

  n = {"big": 4096, "flat": 600}
  w_mean = mean(samples_w, n)
  np.testing.assert_allclose(state.weight_mean, w_mean, rtol=1e-5)
  np.testing.assert_allclose(
    state.weight_std,
    np.sqrt(mean({k: v**2 for k, v in samples_w.items()}, n) - w_mean**2),
    rtol=1e-4,
  )
  np.testing.assert_allclose(
    state.score_std,
    np.sqrt(
      mean({k: v**2 for k, v in samples_r.items()}, n) - mean(samples_r, n) ** 2
    ),
    rtol=1e-4,
  )
  # Weighting by the sample sizes instead would be off by far more.
  by_sample = mean(samples_w, {"big": 1024, "flat": 600})
  assert abs(by_sample - w_mean) > 1e-3, (by_sample, w_mean)


def test_needs_params():
  tx = grpo_optax.scale_by_importance()
  g = {"w": jnp.ones(3)}
  with pytest.raises(ValueError, match="needs `params`"):
    tx.update(g, tx.init(g))


def test_params_structure_mismatch():
  tx = grpo_optax.scale_by_importance()
  g = {"w": jnp.ones(3)}
  with pytest.raises(
    ValueError, match=r"`updates` has leaves that `params` lack: \['w'\]"
  ):
    tx.update(g, tx.init(g), {"v": jnp.ones(3)})


@pytest.mark.parametrize(
  "kwargs,name",
  [
    (dict(order=3), "order"),
    (dict(order=0), "order"),
    (dict(decay=1.0), "decay"),
    (dict(min_weight=-1.0), "min_weight"),
    (dict(max_weight=-1.0), "max_weight"),
    (dict(min_weight=2.0, max_weight=1.0), "max_weight"),
  ],
)
def test_bad_input(kwargs, name):
  with pytest.raises(ValueError, match=name):
    grpo_optax.scale_by_importance(**kwargs)


def test_weights_are_bounded_and_nan_is_not_hidden():
  params = {"w": jnp.array([0.0, 1e-6, 1.0, 1e6])}
  tx = grpo_optax.scale_by_importance(min_weight=0.5, max_weight=2.0)
  g = {"w": jnp.ones(4)}
  out, _ = tx.update(g, tx.init(params), params)
  assert float(jnp.min(out["w"])) >= 0.5 and float(jnp.max(out["w"])) <= 2.0
  out, _ = tx.update(
    {"w": jnp.array([1.0, jnp.nan, 1.0, 1.0])}, tx.init(params), params
  )
  assert bool(jnp.isnan(out["w"]).any())
  safe = optax.apply_if_finite(tx, 2)
  s = safe.init(params)
  u, s = safe.update({"w": jnp.array([1.0, jnp.nan, 1.0, 1.0])}, s, params)
  np.testing.assert_array_equal(u["w"], np.zeros(4))
