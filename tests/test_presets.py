"""The grpo() preset: trains in every mode with one compilation; bad input."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import grpo_optax


def _data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(256, 16)).astype(np.float32)
  w_true = rng.normal(size=(16, 4)).astype(np.float32)
  y = np.argmax(x @ w_true + 0.1 * rng.normal(size=(256, 4)), axis=1)
  return jnp.asarray(x), jnp.asarray(y)


def _init():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {
    "hidden": {
      "kernel": 0.3 * jax.random.normal(k1, (16, 32)),
      "bias": jnp.zeros(32),
    },
    "out": {
      "kernel": 0.3 * jax.random.normal(k2, (32, 4)),
      "bias": jnp.zeros(4),
    },
  }


def _loss(params, x, y):
  h = jnp.tanh(x @ params["hidden"]["kernel"] + params["hidden"]["bias"])
  logits = h @ params["out"]["kernel"] + params["out"]["bias"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@pytest.mark.parametrize(
  "kwargs",
  [
    dict(sparsify="topk"),
    dict(sparsify="topk", topk_method="exact"),
    dict(sparsify="threshold", every=20),
    dict(sparsify=None),
    dict(sparsify=None, filter_decay=0.5, l2=1e-4, variance_reduction="global"),
  ],
  ids=["topk_sampled", "topk_exact", "threshold", "dense", "dense_options"],
)
def test_trains_with_one_compilation(kwargs):
  x, y = _data()
  tx = grpo_optax.grpo(1e-2, **kwargs)
  params = _init()
  state = tx.init(params)
  traces = []

  @jax.jit
  def step(params, state):
    traces.append(None)
    loss, grads = jax.value_and_grad(_loss)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  first = float(_loss(params, x, y))
  for _ in range(300):
    params, state, loss = step(params, state)
  assert len(traces) == 1
  assert float(loss) < 0.35 * first, (first, float(loss))


def test_every_stage_can_be_switched_off():
  tx = grpo_optax.grpo(
    0.1,
    max_norm=None,
    importance=False,
    sparsify=None,
    adaptive=False,
    variance_coef=None,
  )
  params = {"w": jnp.ones(3)}
  u, _ = tx.update({"w": jnp.array([1.0, 2.0, 3.0])}, tx.init(params), params)
  np.testing.assert_allclose(u["w"], [-0.1, -0.2, -0.3], rtol=1e-6)  # plain SGD


def test_schedule_and_inject_hyperparams():
  sched = optax.linear_schedule(1e-2, 0.0, 10)
  tx = grpo_optax.grpo(sched)
  params = _init()
  x, y = _data()
  g = jax.grad(_loss)(params, x, y)
  u, _ = tx.update(g, tx.init(params), params)
  assert float(optax.tree.norm(u)) > 0
  injected = optax.inject_hyperparams(grpo_optax.grpo)(learning_rate=1e-2)
  s = injected.init(params)
  u1, s = jax.jit(injected.update)(g, s, params)
  s.hyperparams["learning_rate"] = jnp.asarray(0.0)
  u2, _ = jax.jit(injected.update)(g, s, params)
  assert float(optax.tree.norm(u1)) > 0 and float(optax.tree.norm(u2)) == 0


def test_signature_says_a_schedule_is_accepted():
  # optax's contrib suite runs its schedule test only for an optimizer whose
  # learning_rate is annotated with the type optax.ScalarOrSchedule (a
  # string annotation made it skip grpo); then a constant schedule must give
  # the float's steps.
  lr = inspect.signature(grpo_optax.grpo).parameters["learning_rate"]
  assert lr.annotation in (optax.ScalarOrSchedule, optax.Schedule)
  params = _init()
  x, y = _data()
  g = jax.grad(_loss)(params, x, y)
  txs = grpo_optax.grpo(optax.constant_schedule(1e-3)), grpo_optax.grpo(1e-3)
  step = jax.jit(lambda tx_i, s, p: txs[tx_i].update(g, s, p), static_argnums=0)
  (u1, _), (u2, _) = (step(i, txs[i].init(params), params) for i in (0, 1))
  jax.tree.map(np.testing.assert_array_equal, u1, u2)


def _only(learning_rate, **stage_kwargs):
  """grpo() with every stage off except those that stage_kwargs turn on."""
  kw = dict(
    max_norm=None,
    importance=False,
    sparsify=None,
    adaptive=False,
    variance_coef=None,
  )
  return grpo_optax.grpo(learning_rate, **{**kw, **stage_kwargs})


def test_extra_args_reach_the_importance_stage():
  """hessian_diag and head_entropy, against the first step's closed form.

  With one step the bias-corrected EMAs equal the step's values:
  ``s = |g p| + h p^2 / 2``, ``w = clip(s / mean(s), 0.1, 10) * e / mean(e)``.
  """
  params = _init()
  x, y = _data()
  g = jax.grad(_loss)(params, x, y)
  rng = np.random.default_rng(3)
  hd = jax.tree.map(
    lambda p: jnp.asarray(np.abs(rng.normal(size=p.shape)) * 50, p.dtype),
    params,
  )
  ent = np.array([0.5, 1.0, 2.5, 4.0], np.float32)
  head_entropy = {
    "hidden": {"kernel": None, "bias": None},
    "out": {"kernel": grpo_optax.per_head(ent, axis=1, ndim=2), "bias": None},
  }
  tx = _only(0.5, importance=True)
  u, _ = tx.update(
    g, tx.init(params), params, hessian_diag=hd, head_entropy=head_entropy
  )
  for path in (("hidden", "kernel"), ("hidden", "bias"), ("out", "kernel")):
    gi, p, h = (
      np.asarray(t[path[0]][path[1]], np.float64) for t in (g, params, hd)
    )
    s = np.abs(gi * p) + 0.5 * h * p**2
    w = np.clip(s / (s.mean() + 1e-12), 0.1, 10.0)
    if path == ("out", "kernel"):
      w = w * ent / ent.mean()
    np.testing.assert_allclose(
      u[path[0]][path[1]],
      -0.5 * gi * w,
      rtol=2e-5,
      atol=1e-9,
      err_msg=str(path),
    )


def test_extra_arg_reaches_the_variance_stage():
  """grad_variance replaces the estimate: out = -lr * g / (1 + coef * v)."""
  params = _init()
  x, y = _data()
  g = jax.grad(_loss)(params, x, y)
  rng = np.random.default_rng(4)
  gv = jax.tree.map(
    lambda p: jnp.asarray(np.abs(rng.normal(size=p.shape)) * 3, p.dtype), params
  )
  tx = _only(0.5, variance_coef=0.7, variance_reduction="element")
  u, _ = tx.update(g, tx.init(params), params, grad_variance=gv)
  jax.tree.map(
    lambda ui, gi, vi: np.testing.assert_allclose(
      ui, -0.5 * np.asarray(gi) / (1 + 0.7 * np.asarray(vi)), rtol=1e-6
    ),
    u,
    g,
    gv,
  )


@pytest.mark.parametrize(
  "kwargs,name",
  [
    (dict(sparsify="random"), "sparsify"),
    (dict(fraction=0.0), "fraction"),
    (dict(alpha=2.0), "alpha"),
    (dict(b1=1.0), "b1"),
    (dict(max_norm=-1.0), "max_norm"),
    (dict(variance_coef=-1.0), "variance_coef"),
    (dict(variance_reduction="x"), "variance_reduction"),
    (dict(importance_order=3), "importance_order"),
    (dict(topk_method="fast"), "topk_method"),
    (dict(adam_weight=2.0), "adam_weight"),
    (dict(freeze_threshold=-1.0), "freeze_threshold"),
    (dict(every=0, sparsify=None), "every"),
    (dict(variance_decay=1.0, variance_coef=None), "variance_decay"),
  ],
)
def test_bad_input(kwargs, name):
  with pytest.raises(ValueError, match=name):
    grpo_optax.grpo(1e-3, **kwargs)
