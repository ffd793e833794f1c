"""freeze_below + frozen_mask: freezing decisions, exact zeros, bad input;
the metrics, the defaults, the boundary ratio, one trainable leaf, tiny
importances, the importance EMA at another decay and the leaf-count check
(survivors of cosmic-ray's operators, tools/mutants.py --broad freezing).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import grpo_optax


def _setup():
  params = {
    "important": jnp.ones((8, 8)),
    "unimportant": jnp.full((8,), 1e-3),
    "medium": jnp.full((4, 4), 0.5),
  }
  return params


def test_freezes_unimportant_leaf_and_keeps_it_frozen():
  params = _setup()
  tx = grpo_optax.freeze_below(threshold=0.3, decay=0.5, warmup_steps=3)
  state = tx.init(params)
  update = jax.jit(tx.update)
  g = jax.tree.map(jnp.ones_like, params)
  for _ in range(3):  # warm-up: nothing freezes
    out, state = update(g, state, params)
    assert not any(
      bool(x) for x in jax.tree.leaves(grpo_optax.frozen_mask(state, params))
    )
    np.testing.assert_array_equal(out["unimportant"], g["unimportant"])
  out, state = update(g, state, params)
  mask = grpo_optax.frozen_mask(state, params)
  assert bool(mask["unimportant"]) and not bool(mask["important"])
  assert not bool(mask["medium"])
  np.testing.assert_array_equal(out["unimportant"], np.zeros(8))
  np.testing.assert_array_equal(out["important"], g["important"])
  # its gradient grows a millionfold: it stays frozen, updates exactly zero
  big = dict(g, unimportant=jnp.full((8,), 1e6))
  for _ in range(5):
    out, state = update(big, state, params)
    np.testing.assert_array_equal(out["unimportant"], np.zeros(8))
    # A frozen leaf no longer counts in the normaliser: the others stay put.
    mask = grpo_optax.frozen_mask(state, params)
    assert {k: bool(v) for k, v in mask.items()} == {
      "important": False,
      "unimportant": True,
      "medium": False,
    }
    np.testing.assert_array_equal(out["important"], g["important"])


def _numpy_freeze(
  grads, params, threshold, decay, warmup_steps, active_only=True
):
  """Per-step (importance, frozen) of freeze_below, in float64."""
  imp = {k: 0.0 for k in params}
  frozen = {k: False for k in params}
  history = []
  for t, g in enumerate(grads):
    bc = 1 - decay ** (t + 1)
    for k in params:
      imp[k] = decay * imp[k] + (1 - decay) * np.mean(
        np.abs(np.float64(g[k]) * np.float64(params[k]))
      )
    pool = [k for k in params if not frozen[k] or not active_only]
    mean = np.mean([imp[k] / bc for k in pool]) if pool else 0.0
    frozen = {
      k: frozen[k]
      or (t >= warmup_steps and (imp[k] / bc) / (mean + 1e-30) < threshold)
      for k in params
    }
    history.append((dict(imp), dict(frozen)))
  return history


def test_normalised_by_the_mean_over_trainable_leaves_only():
  """Leaf importances 1, 0.01, 0.15, 0.5 against a 0.3 threshold.

  Step 0: "b" freezes (0.01 / 0.415). Step 1: the mean over the trainable
  leaves a, c, d is 0.55, so "c" (0.15 / 0.55 = 0.27) freezes too, though it
  is 0.36 of the mean over all leaves. Steps 2-3: the frozen "b" gets a
  gradient 10,000 times larger; it must not drag the normaliser, so "a" and
  "d" stay trainable (a mean over all leaves would freeze every leaf).
  """
  params = {
    "a": np.full((2, 2), 2.0, np.float32),
    "b": -np.ones(3, np.float32),
    "c": np.ones(5, np.float32),
    "d": np.full(2, 0.25, np.float32),
  }
  g0 = {
    "a": np.full((2, 2), 0.5, np.float32),
    "b": np.full(3, 0.01, np.float32),
    "c": np.array([0.15, -0.15, 0.15, -0.15, 0.15], np.float32),
    "d": np.full(2, -2.0, np.float32),
  }
  g2 = dict(g0, b=np.full(3, 100.0, np.float32))
  grads = [g0, g0, g2, g2]
  ref = _numpy_freeze(grads, params, 0.3, 0.5, 0)
  # The scenario separates the two normalisers at steps 1, 2 and 3.
  wrong = _numpy_freeze(grads, params, 0.3, 0.5, 0, active_only=False)
  assert [f for _, f in ref[1:]] != [f for _, f in wrong[1:]]
  assert ref[-1][1] == {"a": False, "b": True, "c": True, "d": False}

  tx = grpo_optax.freeze_below(threshold=0.3, decay=0.5, warmup_steps=0)
  state = tx.init(params)
  update = jax.jit(tx.update)
  for g, (imp, frozen) in zip(grads, ref):
    out, state = update(g, state, params)
    assert {
      k: bool(v) for k, v in grpo_optax.frozen_mask(state, params).items()
    } == (frozen)
    for k in params:
      importance = dict(zip(sorted(params), state.importance))
      np.testing.assert_allclose(importance[k], imp[k], rtol=1e-6)
      np.testing.assert_array_equal(out[k], 0 * g[k] if frozen[k] else g[k])


@pytest.mark.parametrize(
  "form",
  [dict(fused=False), dict(fused=True, adam_weight=1.0)],
  ids=["chain", "fused"],
)
def test_frozen_leaf_stays_put_in_a_full_grpo_chain(form):
  params = _setup()
  tx = grpo_optax.grpo(
    1e-2, sparsify=None, freeze_threshold=0.3, freeze_warmup_steps=2, **form
  )
  state = tx.init(params)
  step = jax.jit(
    lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(
      *tx.update(g, s, p)
    )
  )
  g = jax.tree.map(jnp.ones_like, params)
  for _ in range(3):
    params, state = step(params, state, g)
  frozen_value = params["unimportant"]
  assert bool(grpo_optax.frozen_mask(state, params)["unimportant"])
  for _ in range(5):
    params, state = step(params, state, g)
  np.testing.assert_array_equal(params["unimportant"], frozen_value)


def test_frozen_mask_needs_exactly_one_stage():
  with pytest.raises(ValueError, match="found 0"):
    grpo_optax.frozen_mask(optax.adam(1e-3).init({"w": jnp.ones(2)}))
  tx = optax.chain(grpo_optax.freeze_below(), grpo_optax.freeze_below())
  with pytest.raises(ValueError, match="found 2"):
    grpo_optax.frozen_mask(tx.init({"w": jnp.ones(2)}))


def test_needs_params():
  tx = grpo_optax.freeze_below()
  g = {"w": jnp.ones(2)}
  with pytest.raises(ValueError, match="needs `params`"):
    tx.update(g, tx.init(g))


@pytest.mark.parametrize(
  "kwargs,name",
  [
    (dict(threshold=-0.1), "threshold"),
    (dict(decay=1.0), "decay"),
    (dict(decay=-0.5), "decay"),
    (dict(warmup_steps=-1), "warmup_steps"),
    (dict(warmup_steps=1.5), "warmup_steps"),
  ],
)
def test_bad_input(kwargs, name):
  with pytest.raises(ValueError, match=name):
    grpo_optax.freeze_below(**kwargs)


def _frozen(state, params):
  return {k: bool(v) for k, v in grpo_optax.frozen_mask(state, params).items()}


def test_metrics_count_the_frozen_leaves():
  params = _setup()  # importances 1, 1e-3, 0.5: "unimportant" freezes
  tx = grpo_optax.freeze_below(threshold=0.3, decay=0.5, warmup_steps=0)
  g = jax.tree.map(jnp.ones_like, params)
  _, state = tx.update(g, tx.init(params), params)
  m = state.metrics()
  assert int(m["frozen_leaves"]) == 1
  np.testing.assert_allclose(m["frozen_fraction"], 1 / 3, rtol=1e-6)
  np.testing.assert_allclose(m["importance"], state.importance)
  assert float(tx.init({}).metrics()["frozen_fraction"]) == 0.0  # not 0 / 0


def test_a_single_trainable_leaf_is_its_own_mean():
  # Its normalised importance is 1: it freezes under a threshold above 1.
  params = {"w": jnp.ones(3)}
  tx = grpo_optax.freeze_below(threshold=1.5, decay=0.5, warmup_steps=0)
  _, state = tx.update({"w": jnp.ones(3)}, tx.init(params), params)
  assert _frozen(state, params) == {"w": True}
  np.testing.assert_allclose(state.metrics()["frozen_fraction"], 1.0)


def test_a_leaf_at_the_threshold_is_not_frozen():
  # decay 0: the importances are exactly 1 and 3, their mean 2, so "a" sits
  # exactly at 0.5 of the mean: frozen only below the threshold.
  params = {"a": jnp.ones(2), "b": jnp.full(2, 3.0)}
  g = {"a": jnp.ones(2), "b": jnp.ones(2)}
  tx = grpo_optax.freeze_below(threshold=0.5, decay=0.0, warmup_steps=0)
  _, state = tx.update(g, tx.init(params), params)
  assert _frozen(state, params) == {"a": False, "b": False}


def test_tiny_importances_are_compared_by_their_ratio():
  # |g p| of 1e-30 and 3e-30: the ratio 0.5 of the mean decides, not the
  # 1e-30 guard of the division.
  params = {"a": jnp.full(2, 1e-15), "b": jnp.full(2, 3e-15)}
  g = {"a": jnp.full(2, 1e-15), "b": jnp.full(2, 1e-15)}
  tx = grpo_optax.freeze_below(threshold=0.6, decay=0.0, warmup_steps=0)
  _, state = tx.update(g, tx.init(params), params)
  assert _frozen(state, params) == {"a": True, "b": False}


def test_importance_is_an_ema_at_any_decay():
  params = _setup()
  rng = np.random.default_rng(4)
  grads = [
    {k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()}
    for _ in range(3)
  ]
  ref = _numpy_freeze(grads, params, 0.0, 0.8, 0)
  tx = grpo_optax.freeze_below(threshold=0.0, decay=0.8, warmup_steps=0)
  state = tx.init(params)
  for g, (imp, _) in zip(grads, ref):
    _, state = tx.update(g, state, params)
    got = dict(zip(sorted(params), np.asarray(state.importance)))
    for k in params:
      np.testing.assert_allclose(got[k], imp[k], rtol=1e-5)


def test_defaults_and_a_frozen_config():
  cfg = grpo_optax.FreezeBelowConfig()
  np.testing.assert_allclose([cfg.threshold, cfg.decay], [0.3, 0.9], rtol=1e-6)
  assert cfg.warmup_steps == 100
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.threshold = 0.5
  # freeze_below(): threshold 0.3 (the "medium" leaf, at 1.0 of the mean,
  # stays) after 100 warm-up steps.
  params = _setup()
  tx = grpo_optax.freeze_below()
  update = jax.jit(tx.update)
  g = jax.tree.map(jnp.ones_like, params)
  state = tx.init(params)
  for _ in range(100):
    _, state = update(g, state, params)
  assert not any(_frozen(state, params).values())
  _, state = update(g, state, params)
  assert _frozen(state, params) == {
    "important": False,
    "unimportant": True,
    "medium": False,
  }


@pytest.mark.parametrize("n_state,n_updates", [(2, 3), (3, 2), (300, 300)])
def test_the_state_must_be_built_for_the_updates_leaves(n_state, n_updates):
  # 300: leaf counts beyond CPython's cached small ints compare by value.
  tree = lambda n: {f"w{i:03d}": jnp.ones(1) for i in range(n)}
  tx = grpo_optax.freeze_below(warmup_steps=0)
  state = tx.init(tree(n_state))
  if n_state == n_updates:
    tx.update(tree(n_updates), state, tree(n_updates))
    return
  with pytest.raises(ValueError, match=f"built for {n_state} leaves"):
    tx.update(tree(n_updates), state, tree(n_updates))
