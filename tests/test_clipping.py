"""clip_with_l2: optax limit case, NumPy reference, counters, NaN, bad input;
the metrics, empty and one-element leaves, the boundary norm and the defaults
(survivors of cosmic-ray's operators, tools/mutants.py --broad clipping).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import grpo_optax


def _seq(steps=30, seed=1):
  rng = np.random.default_rng(seed)
  return [
    {
      "w": rng.normal(size=(4, 6)).astype(np.float32) * 10 ** (i % 3 - 1),
      "b": rng.normal(size=(6,)).astype(np.float32),
    }
    for i in range(steps)
  ]


def test_l2_zero_equals_clip_by_global_norm():
  ours = grpo_optax.clip_with_l2(max_norm=1.5)
  ref = optax.clip_by_global_norm(1.5)
  s1, s2 = ours.init({}), ref.init({})
  for g in _seq():
    u1, s1 = jax.jit(ours.update)(g, s1)
    u2, s2 = ref.update(g, s2)
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), u1, u2
    )


def test_matches_numpy_reference_and_counts_clipped_steps():
  tx = grpo_optax.clip_with_l2(max_norm=2.0, l2=0.05)
  rng = np.random.default_rng(3)
  params = {
    "w": rng.normal(size=(4, 6)).astype(np.float32),
    "b": rng.normal(size=(6,)).astype(np.float32),
  }
  state = tx.init(params)
  update = jax.jit(tx.update)
  expected_clipped = 0
  for g in _seq():
    u, state = update(g, state, params)
    a = {k: g[k].astype(np.float64) + 0.05 * params[k] for k in g}
    n = np.sqrt(sum(np.sum(x**2) for x in a.values()))
    expected_clipped += int(n > 2.0)
    for k in g:
      np.testing.assert_allclose(
        u[k], a[k] * min(1.0, 2.0 / n), rtol=2e-4, atol=1e-7
      )
    np.testing.assert_allclose(state.last_norm, n, rtol=1e-5)
  assert int(state.count) == 30
  assert int(state.clipped) == expected_clipped
  assert 0 < expected_clipped < 30


def test_zero_gradient_is_not_nan():
  tx = grpo_optax.clip_with_l2()
  u, state = tx.update({"w": jnp.zeros(3)}, tx.init({}))
  np.testing.assert_array_equal(u["w"], np.zeros(3))
  assert int(state.clipped) == 0


def test_nan_gradient_propagates_and_apply_if_finite_skips_it():
  tx = grpo_optax.clip_with_l2()
  g = {"w": jnp.array([1.0, jnp.nan])}
  u, _ = tx.update(g, tx.init({}))
  assert bool(jnp.all(jnp.isnan(u["w"])))  # never silently finite
  safe = optax.apply_if_finite(optax.chain(tx, optax.sgd(0.1)), 3)
  params = {"w": jnp.ones(2)}
  state = safe.init(params)
  u, state = safe.update(g, state, params)
  np.testing.assert_array_equal(u["w"], np.zeros(2))
  assert int(state.notfinite_count) == 1


def test_needs_params_when_l2_positive():
  tx = grpo_optax.clip_with_l2(l2=0.1)
  with pytest.raises(ValueError, match="needs `params`"):
    tx.update({"w": jnp.ones(2)}, tx.init({}))


def test_mismatched_params_tree():
  tx = grpo_optax.clip_with_l2(l2=0.1)
  with pytest.raises(
    ValueError, match=r"`updates` has leaves that `params` lack: \['w'\]"
  ):
    tx.update({"w": jnp.ones(2)}, tx.init({}), {"v": jnp.ones(2)})


@pytest.mark.parametrize(
  "kwargs,name",
  [
    (dict(max_norm=0.0), "max_norm"),
    (dict(max_norm=-1.0), "max_norm"),
    (dict(l2=-1e-4), "l2"),
    (dict(max_norm=float("nan")), "max_norm"),
  ],
)
def test_bad_input(kwargs, name):
  with pytest.raises(ValueError, match=name + r" must be in"):
    grpo_optax.clip_with_l2(**kwargs)


def test_metrics_are_the_clip_rate_the_clipped_steps_and_the_last_norm():
  tx = grpo_optax.clip_with_l2(max_norm=1.0)
  state = tx.init({})
  fresh = state.metrics()
  assert float(fresh["clip_rate"]) == 0.0  # no step yet: 0, not 0 / 0
  rates = []
  for w in ([3.0, 4.0], [0.3, 0.4], [0.0, 0.5]):  # norms 5, 0.5, 0.5
    _, state = tx.update({"w": jnp.array(w)}, state)
    rates.append(float(state.metrics()["clip_rate"]))
  np.testing.assert_allclose(rates, [1.0, 1 / 2, 1 / 3], rtol=1e-6)
  m = state.metrics()
  assert int(m["clipped_steps"]) == 1
  np.testing.assert_allclose(m["grad_norm"], 0.5, rtol=1e-6)


def test_norm_skips_only_empty_leaves():
  # Leaves in key order: an empty leaf first must not end the sum, and a
  # one-element leaf counts.
  g = {"a": jnp.zeros((0,)), "b": jnp.array(3.0), "c": jnp.array([0.0, 4.0])}
  tx = grpo_optax.clip_with_l2(max_norm=1.0)
  u, state = tx.update(g, tx.init({}))
  np.testing.assert_allclose(state.last_norm, 5.0, rtol=1e-6)
  np.testing.assert_allclose(u["b"], 0.6, rtol=1e-6)
  np.testing.assert_allclose(u["c"], [0.0, 0.8], rtol=1e-6)
  assert u["a"].shape == (0,)


def test_a_norm_below_one_is_reported_and_left_unclipped():
  tx = grpo_optax.clip_with_l2(max_norm=1.0)
  g = {"w": jnp.array([0.03, 0.04])}
  u, state = tx.update(g, tx.init({}))
  np.testing.assert_allclose(state.last_norm, 0.05, rtol=1e-6)
  np.testing.assert_allclose(u["w"], g["w"], rtol=1e-6)


def test_a_norm_equal_to_max_norm_is_not_counted_as_clipped():
  tx = grpo_optax.clip_with_l2(max_norm=5.0)
  g = {"w": jnp.array([3.0, 4.0])}  # norm exactly 5 in float32
  u, state = tx.update(g, tx.init({}))
  assert int(state.clipped) == 0
  np.testing.assert_allclose(u["w"], g["w"], rtol=1e-6)


def test_defaults_and_a_frozen_config():
  u, state = grpo_optax.clip_with_l2().update(
    {"w": jnp.array([3.0, 4.0])}, grpo_optax.clip_with_l2().init({})
  )
  np.testing.assert_allclose(u["w"], [0.6, 0.8], rtol=1e-6)  # max_norm 1
  assert int(state.clipped) == 1
  cfg = grpo_optax.ClipWithL2Config()
  assert float(cfg.max_norm) == 1.0 and cfg.l2 is None and not cfg.l2_on
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.max_norm = 2.0


def test_an_l2_term_that_cancels_the_gradient_gives_zeros_not_nan():
  # g = -l2 p: |g|^2 + 2 l2 <g, p> + l2^2 |p|^2 cancels, and rounding may
  # leave the sum slightly negative: the norm is 0, not the NaN of its root.
  rng = np.random.default_rng(7)
  tx = grpo_optax.clip_with_l2(max_norm=1.0, l2=0.1)
  update = jax.jit(tx.update)
  l2 = np.float32(0.1)
  for _ in range(20):
    p = {"w": rng.normal(size=(8,)).astype(np.float32)}
    g = {"w": -l2 * p["w"]}
    u, state = update(g, tx.init(p), p)
    assert np.isfinite(float(state.last_norm))
    np.testing.assert_allclose(u["w"], g["w"] + l2 * p["w"], atol=1e-6)
