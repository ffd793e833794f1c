"""freeze_below + frozen_mask: freezing decisions, exact zeros, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import grpo_optax


def _setup():
  params = {"important": jnp.ones((8, 8)), "unimportant": jnp.full((8,), 1e-3),
            "medium": jnp.full((4, 4), 0.5)}
  return params


def test_freezes_unimportant_leaf_and_keeps_it_frozen():
  params = _setup()
  tx = grpo_optax.freeze_below(threshold=0.3, decay=0.5, warmup_steps=3)
  state = tx.init(params)
  update = jax.jit(tx.update)
  g = jax.tree.map(jnp.ones_like, params)
  for t in range(3):  # warm-up: nothing freezes
    out, state = update(g, state, params)
    assert not any(bool(x) for x in jax.tree.leaves(grpo_optax.frozen_mask(state)))
    np.testing.assert_array_equal(out["unimportant"], g["unimportant"])
  out, state = update(g, state, params)
  mask = grpo_optax.frozen_mask(state)
  assert bool(mask["unimportant"]) and not bool(mask["important"])
  assert not bool(mask["medium"])
  np.testing.assert_array_equal(out["unimportant"], np.zeros(8))
  np.testing.assert_array_equal(out["important"], g["important"])
  # its gradient grows a millionfold: it stays frozen, updates exactly zero
  big = dict(g, unimportant=jnp.full((8,), 1e6))
  for _ in range(5):
    out, state = update(big, state, params)
    np.testing.assert_array_equal(out["unimportant"], np.zeros(8))
    assert bool(grpo_optax.frozen_mask(state)["unimportant"])


def test_frozen_leaf_stays_put_in_a_full_grpo_chain():
  params = _setup()
  tx = grpo_optax.grpo(1e-2, sparsify=None, freeze_threshold=0.3,
                       freeze_warmup_steps=2)
  state = tx.init(params)
  step = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(
      *tx.update(g, s, p)))
  g = jax.tree.map(jnp.ones_like, params)
  for _ in range(3):
    params, state = step(params, state, g)
  frozen_value = params["unimportant"]
  assert bool(grpo_optax.frozen_mask(state)["unimportant"])
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


@pytest.mark.parametrize("kwargs,name", [
    (dict(threshold=-0.1), "threshold"), (dict(decay=1.0), "decay"),
    (dict(warmup_steps=-1), "warmup_steps"), (dict(warmup_steps=1.5), "warmup_steps")])
def test_bad_input(kwargs, name):
  with pytest.raises(ValueError, match=name):
    grpo_optax.freeze_below(**kwargs)
