"""freeze_below + frozen_mask: freezing decisions, exact zeros, bad input."""

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
    (dict(warmup_steps=-1), "warmup_steps"),
    (dict(warmup_steps=1.5), "warmup_steps"),
  ],
)
def test_bad_input(kwargs, name):
  with pytest.raises(ValueError, match=name):
    grpo_optax.freeze_below(**kwargs)
