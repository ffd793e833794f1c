"""metrics / frozen_mask / importance_converged through every optax wrapper."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import grpo_optax


def _params():
  return {"w": jnp.ones((6, 4)), "b": jnp.full((4,), 0.5)}


def _grads(i):
  rng = np.random.default_rng(i)
  return {"w": jnp.asarray(rng.normal(size=(6, 4)), jnp.float32) * 3,
          "b": jnp.asarray(rng.normal(size=4), jnp.float32)}


def _inner():
  return grpo_optax.grpo(1e-2, sparsify="threshold", every=2,
                         freeze_threshold=0.01, freeze_warmup_steps=1)


WRAPPERS = {
    "chain": lambda: _inner(),
    "inject_hyperparams": lambda: optax.inject_hyperparams(grpo_optax.grpo)(
        learning_rate=1e-2, sparsify="threshold", every=2, freeze_threshold=0.01,
        freeze_warmup_steps=1),
    "multisteps": lambda: optax.MultiSteps(_inner(), every_k_schedule=1),
    "masked": lambda: optax.masked(_inner(), {"w": True, "b": True}),
    "partition": lambda: optax.partition(
        {"all": _inner()}, {"w": "all", "b": "all"}),
    "nested_chain": lambda: optax.chain(optax.identity(), _inner()),
}


def _run(tx, steps=4):
  params = _params()
  state = tx.init(params)
  update = jax.jit(tx.update)
  for i in range(steps):
    _, state = update(_grads(i), state, params)
  return state


def test_metrics_identical_through_every_wrapper():
  ref = grpo_optax.metrics(_run(WRAPPERS["chain"]()))
  expected_keys = {
      "clip/clip_rate", "clip/clipped_steps", "clip/grad_norm",
      "importance/weight_mean", "importance/weight_std", "importance/score_std",
      "importance/weights", "threshold/kept_fraction", "threshold/residual_norm",
      "threshold/tau_mean", "variance_lr/variance", "variance_lr/lr_scale",
      "freeze/frozen_leaves", "freeze/frozen_fraction", "freeze/importance"}
  assert set(ref) == expected_keys
  assert 0 < float(ref["clip/clip_rate"]) <= 1
  assert float(ref["clip/clipped_steps"]) == 4 * float(ref["clip/clip_rate"])
  for name, make in WRAPPERS.items():
    got = grpo_optax.metrics(_run(make()))
    assert set(got) == expected_keys, name
    for k in expected_keys:
      np.testing.assert_allclose(got[k], ref[k], rtol=2e-5, atol=1e-7,
                                 err_msg=f"{name}: {k}")


def test_frozen_mask_through_wrappers():
  for name, make in WRAPPERS.items():
    mask = grpo_optax.frozen_mask(_run(make()))
    assert jax.tree.structure(mask) == jax.tree.structure(_params()), name


def test_metrics_inside_jit_and_repeated_stages():
  tx = optax.chain(grpo_optax.clip_with_l2(1.0), grpo_optax.clip_with_l2(0.5),
                   grpo_optax.top_k_mask(0.5))
  state = tx.init(_params())
  _, state = tx.update(_grads(0), state, _params())
  m = jax.jit(grpo_optax.metrics)(state)
  assert {"clip_0/clip_rate", "clip_1/clip_rate", "topk/kept_fraction"} <= set(m)
  np.testing.assert_allclose(m["topk/kept_fraction"], 0.5)


def test_metrics_of_a_non_grpo_state_is_empty():
  assert grpo_optax.metrics(optax.adam(1e-3).init(_params())) == {}


def test_importance_converged():
  params = {"w": jnp.ones((10, 10))}
  tx = grpo_optax.scale_by_importance()
  state = tx.init(params)
  assert not bool(grpo_optax.importance_converged(state))  # no step yet
  _, state = tx.update({"w": jnp.ones((10, 10))}, state, params)
  assert bool(grpo_optax.importance_converged(state))  # uniform scores
  rng = np.random.default_rng(0)
  _, state = tx.update({"w": jnp.asarray(rng.normal(size=(10, 10)) * 100,
                                         jnp.float32)}, state, params)
  assert not bool(grpo_optax.importance_converged(state, std_below=0.05))
  with pytest.raises(ValueError, match="std_below"):
    grpo_optax.importance_converged(state, std_below=0.0)
  with pytest.raises(ValueError, match="no scale_by_importance"):
    grpo_optax.importance_converged(optax.adam(1.0).init(params))


def test_metrics_from_nnx_optimizer_state():
  from flax import nnx  # pylint: disable=g-import-not-at-top
  model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(model, grpo_optax.grpo(1e-2, sparsify="topk"),
                      wrt=nnx.Param)
  grads = nnx.grad(lambda m: jnp.sum(m(jnp.ones((2, 4))) ** 2))(model)
  opt.update(model, grads)
  m = grpo_optax.metrics(opt.opt_state)
  assert "topk/kept_fraction" in m and "importance/weights" in m
  assert float(m["clip/grad_norm"]) > 0
