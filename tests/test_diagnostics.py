"""metrics / frozen_mask / importance_converged: values, and every optax wrapper."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import grpo_optax


def _params():
  # "tiny" has parameters 1e-4: its importance mean|u * p| is about 1e-4 of
  # the others', so it freezes at the first step allowed. Float32, not weak
  # float: a state built from weakly typed params would change type at the
  # first step, and the jitted steps would compile twice.
  return {
    "w": jnp.ones((6, 4), jnp.float32),
    "b": jnp.full((4,), 0.5, jnp.float32),
    "tiny": jnp.full((3,), 1e-4, jnp.float32),
  }


def _grads(i):
  rng = np.random.default_rng(i)
  return {
    "w": jnp.asarray(rng.normal(size=(6, 4)), jnp.float32) * 3,
    "b": jnp.asarray(rng.normal(size=4), jnp.float32),
    "tiny": jnp.asarray(rng.normal(size=3), jnp.float32),
  }


def _inner():
  return grpo_optax.grpo(
    1e-2,
    sparsify="threshold",
    every=2,
    freeze_threshold=0.01,
    freeze_warmup_steps=1,
    **grpo_optax.ARTICLE_DEFAULTS,
  )


_ALL = {"w": True, "b": True, "tiny": True}
WRAPPERS = {
  "chain": lambda: _inner(),
  "inject_hyperparams": lambda: optax.inject_hyperparams(grpo_optax.grpo)(
    learning_rate=1e-2,
    sparsify="threshold",
    every=2,
    freeze_threshold=0.01,
    freeze_warmup_steps=1,
    **grpo_optax.ARTICLE_DEFAULTS,
  ),
  "multisteps": lambda: optax.MultiSteps(_inner(), every_k_schedule=1),
  "masked": lambda: optax.masked(_inner(), _ALL),
  "partition": lambda: optax.partition(
    {"all": _inner()}, {"w": "all", "b": "all", "tiny": "all"}
  ),
  "nested_chain": lambda: optax.chain(optax.identity(), _inner()),
}


@functools.cache
def _wrapped_states(steps=4):
  """Each wrapper's state after ``steps`` steps (computed once per worker).

  One jitted function steps every wrapper: one compilation instead of six
  (XLA dedupes the inner transform's identical kernels), same values.
  """
  txs = {name: make() for name, make in WRAPPERS.items()}
  params = _params()
  states = {name: tx.init(params) for name, tx in txs.items()}

  @jax.jit
  def update(states, grads, params):
    return {
      name: tx.update(grads, states[name], params)[1]
      for name, tx in txs.items()
    }

  for i in range(steps):
    states = update(states, _grads(i), params)
  return states


def _wrapped_state(name):
  return _wrapped_states()[name]


def test_metrics_identical_through_every_wrapper():
  ref = grpo_optax.metrics(_wrapped_state("chain"))
  expected_keys = {
    "clip/clip_rate",
    "clip/clipped_steps",
    "clip/grad_norm",
    "importance/weight_mean",
    "importance/weight_std",
    "importance/score_std",
    "importance/weights",
    "threshold/kept_fraction",
    "threshold/residual_norm",
    "threshold/tau_mean",
    "variance_lr/variance",
    "variance_lr/lr_scale",
    "freeze/frozen_leaves",
    "freeze/frozen_fraction",
    "freeze/importance",
  }
  assert set(ref) == expected_keys
  assert 0 < float(ref["clip/clip_rate"]) <= 1
  assert float(ref["clip/clipped_steps"]) == 4 * float(ref["clip/clip_rate"])
  for name in WRAPPERS:
    got = grpo_optax.metrics(_wrapped_state(name))
    if name == "partition":  # keys carry the partition's label
      assert all(k.startswith("all:") for k in got), name
      got = {k[len("all:") :]: v for k, v in got.items()}
    assert set(got) == expected_keys, name
    for k in expected_keys:
      np.testing.assert_allclose(
        got[k], ref[k], rtol=2e-5, atol=1e-7, err_msg=f"{name}: {k}"
      )


def test_frozen_mask_through_wrappers():
  for name in WRAPPERS:
    assert len(grpo_optax.frozen_mask(_wrapped_state(name))) == 3
    mask = grpo_optax.frozen_mask(_wrapped_state(name), _params())
    assert jax.tree.structure(mask) == jax.tree.structure(_params()), name
    assert {k: bool(v) for k, v in mask.items()} == {
      "w": False,
      "b": False,
      "tiny": True,
    }, name


def _numpy_ema_mean(xs, d):
  """Bias-corrected EMA of a sequence (the last value)."""
  m = 0.0
  for x in xs:
    m = d * m + (1 - d) * np.asarray(x, np.float64)
  return m / (1 - d ** len(xs))


def test_metrics_match_independent_values():
  """Every metric against a value computed here from the stages' inputs."""
  names = (
    "clip",
    "importance",
    "threshold",
    "adaptive",
    "variance",
    "lr",
    "freeze",
  )
  stages = [
    grpo_optax.clip_with_l2(max_norm=13.0),
    grpo_optax.scale_by_importance(order=1, decay=0.8),
    grpo_optax.ema_threshold_mask(alpha=0.6, every=2),
    grpo_optax.scale_by_nesterov_adam_rms(),
    grpo_optax.scale_by_variance_lr(coef=50.0, decay=0.7),
    optax.scale(-1e-2),
    grpo_optax.freeze_below(threshold=0.01, decay=0.5, warmup_steps=1),
  ]
  params = _params()
  states = [tx.init(params) for tx in stages]
  updates = [jax.jit(tx.update) for tx in stages]
  steps = 5
  ins = {n: [] for n in names}
  outs = {n: [] for n in names}
  for i in range(steps):
    x = _grads(i)
    for j, n in enumerate(names):
      ins[n].append(jax.tree.map(np.asarray, x))
      x, states[j] = updates[j](x, states[j], params)
      outs[n].append(jax.tree.map(np.asarray, x))
  m = grpo_optax.metrics(tuple(states))
  keys = sorted(params)  # the order of jax.tree.leaves
  n_total = sum(params[k].size for k in keys)
  flat = lambda tree: np.concatenate([np.ravel(tree[k]) for k in keys])
  p64 = {k: np.asarray(params[k], np.float64) for k in keys}

  # Clipping: global norms of the raw gradients, 2 of the 5 above 13.
  norms = [np.linalg.norm(flat(g).astype(np.float64)) for g in ins["clip"]]
  clipped = sum(nm > 13.0 for nm in norms)
  assert 0 < clipped < steps
  np.testing.assert_allclose(m["clip/grad_norm"], norms[-1], rtol=1e-6)
  assert int(m["clip/clipped_steps"]) == clipped
  np.testing.assert_allclose(m["clip/clip_rate"], clipped / steps, rtol=1e-6)

  # Importance (order 1): S = EMA of |g p|; weights = out / in.
  s_hat = {
    k: _numpy_ema_mean([np.abs(g[k] * p64[k]) for g in ins["importance"]], 0.8)
    for k in keys
  }
  ratio = np.concatenate([np.ravel(s_hat[k] / s_hat[k].mean()) for k in keys])
  w = flat(outs["importance"][-1]) / flat(ins["importance"][-1])
  np.testing.assert_allclose(w, np.clip(ratio, 0.1, 10.0), rtol=1e-5)
  np.testing.assert_allclose(m["importance/weight_mean"], w.mean(), rtol=1e-5)
  np.testing.assert_allclose(m["importance/weight_std"], w.std(), rtol=1e-4)
  np.testing.assert_allclose(m["importance/score_std"], ratio.std(), rtol=1e-4)
  np.testing.assert_allclose(m["importance/weights"], ratio, rtol=1e-5)

  # Threshold: error feedback keeps sum(in) - sum(out) as the residual; tau
  # moves at steps 0, 2, 4 (alpha 0.6) from mean |in + residual|.
  tau, residual = {}, {k: 0.0 for k in keys}
  for t, (g, o) in enumerate(zip(ins["threshold"], outs["threshold"])):
    for k in keys:
      a = np.abs(g[k] + residual[k]).mean()
      if t == 0:
        tau[k] = a
      elif t % 2 == 0:
        tau[k] = 0.6 * a + 0.4 * tau[k]
      residual[k] = residual[k] + g[k].astype(np.float64) - o[k]
  np.testing.assert_allclose(
    m["threshold/tau_mean"], np.mean([tau[k] for k in keys]), rtol=1e-5
  )
  np.testing.assert_allclose(
    m["threshold/residual_norm"], np.linalg.norm(flat(residual)), rtol=1e-5
  )
  kept = np.count_nonzero(flat(outs["threshold"][-1])) / n_total
  assert 0 < kept < 1
  np.testing.assert_allclose(m["threshold/kept_fraction"], kept, rtol=1e-6)

  # Variance rate (leaf reduction): per-leaf mean of nu_hat - mu_hat^2.
  var = {}
  for k in keys:
    mu = _numpy_ema_mean([g[k] for g in ins["variance"]], 0.7)
    nu = _numpy_ema_mean(
      [np.square(g[k].astype(np.float64)) for g in ins["variance"]], 0.7
    )
    var[k] = np.maximum(nu - mu**2, 0).mean()
  sizes = {k: params[k].size for k in keys}
  mean_var = sum(sizes[k] * var[k] for k in keys) / n_total
  mean_scale = sum(sizes[k] / (1 + 50.0 * var[k]) for k in keys) / n_total
  assert mean_scale < 0.9
  np.testing.assert_allclose(m["variance_lr/variance"], mean_var, rtol=1e-4)
  np.testing.assert_allclose(m["variance_lr/lr_scale"], mean_scale, rtol=1e-5)

  # Freezing: I = EMA of mean |u p| (not bias-corrected in the state); only
  # "tiny" falls below 0.01 of the mean.
  imp = {k: 0.0 for k in keys}
  for u in ins["freeze"]:
    for k in keys:
      imp[k] = 0.5 * imp[k] + 0.5 * np.abs(u[k] * p64[k]).mean()
  np.testing.assert_allclose(
    m["freeze/importance"], [imp[k] for k in keys], rtol=1e-5
  )
  assert int(m["freeze/frozen_leaves"]) == 1
  np.testing.assert_allclose(m["freeze/frozen_fraction"], 1 / 3, rtol=1e-6)
  np.testing.assert_array_equal(outs["freeze"][-1]["tiny"], np.zeros(3))


def test_metrics_inside_jit_and_repeated_stages():
  tx = optax.chain(
    grpo_optax.clip_with_l2(1.0),
    grpo_optax.clip_with_l2(0.5),
    grpo_optax.top_k_mask(0.5),
  )
  state = tx.init(_params())
  _, state = tx.update(_grads(0), state, _params())
  m = jax.jit(grpo_optax.metrics)(state)
  assert {"clip_0/clip_rate", "clip_1/clip_rate", "topk/kept_fraction"} <= set(
    m
  )
  sizes = [x.size for x in jax.tree.leaves(_params())]
  np.testing.assert_allclose(
    m["topk/kept_fraction"], sum(math.ceil(0.5 * n) for n in sizes) / sum(sizes)
  )


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
  _, state = tx.update(
    {"w": jnp.asarray(rng.normal(size=(10, 10)) * 100, jnp.float32)},
    state,
    params,
  )
  assert not bool(grpo_optax.importance_converged(state, std_below=0.05))
  with pytest.raises(ValueError, match="std_below"):
    grpo_optax.importance_converged(state, std_below=0.0)
  with pytest.raises(ValueError, match="no scale_by_importance"):
    grpo_optax.importance_converged(optax.adam(1.0).init(params))


def test_metrics_from_nnx_optimizer_state():
  from flax import nnx  # pylint: disable=g-import-not-at-top

  model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(
    model,
    grpo_optax.grpo(1e-2, sparsify="topk", **grpo_optax.ARTICLE_DEFAULTS),
    wrt=nnx.Param,
  )
  grads = nnx.grad(lambda m: jnp.sum(m(jnp.ones((2, 4))) ** 2))(model)
  opt.update(model, grads)
  m = grpo_optax.metrics(opt.opt_state)
  assert "topk/kept_fraction" in m and "importance/weights" in m
  assert float(m["clip/grad_norm"]) > 0
