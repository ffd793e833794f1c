"""scale_by_variance_lr: identity limit, NumPy reference, extra arg, bad input;
the defaults, eps, reduction names, a negative grad_variance and the metrics
of an empty tree (survivors of cosmic-ray's operators, tools/mutants.py
--broad variance).
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from compile_options import USER_DEFAULT

import grpo_optax


def _seq(steps=30, seed=2):
  rng = np.random.default_rng(seed)
  return [
    {
      "w": (rng.normal(size=(4, 5)) * 2 + 0.5).astype(np.float32),
      "b": rng.normal(size=(5,)).astype(np.float32),
      "s": np.float32(rng.normal()),
    }
    for _ in range(steps)
  ]


def _run(tx, grads, **extra):
  params = jax.tree.map(jnp.zeros_like, grads[0])
  state = tx.init(params)
  update = jax.jit(tx.update)
  outs = []
  for g in grads:
    u, state = update(g, state, params, **extra)
    outs.append(u)
  return outs, state


def test_coef_zero_is_identity():
  grads = _seq()
  outs, _ = _run(grpo_optax.scale_by_variance_lr(coef=0.0), grads)
  for u, g in zip(outs, grads):
    jax.tree.map(np.testing.assert_array_equal, u, g)


def _numpy_reference(grads, coef, d, eps, reduction, normalize):
  mu = nu = None
  outs, variances = [], []
  for t, g in enumerate(grads):
    g = {k: np.asarray(x, np.float64) for k, x in g.items()}
    if mu is None:
      mu = {k: np.zeros_like(x) for k, x in g.items()}
      nu = {k: np.zeros_like(x) for k, x in g.items()}
    bc = 1 - d ** (t + 1)
    var, nuh = {}, {}
    for k in g:
      mu[k] = d * mu[k] + (1 - d) * g[k]
      nu[k] = d * nu[k] + (1 - d) * g[k] ** 2
      var[k] = np.maximum(nu[k] / bc - (mu[k] / bc) ** 2, 0)
      nuh[k] = nu[k] / bc
    if reduction == "leaf":
      var = {k: np.mean(v) for k, v in var.items()}
      nuh = {k: np.mean(v) for k, v in nuh.items()}
    elif reduction == "global":
      n = sum(v.size for v in var.values())
      gv = sum(np.sum(v) for v in var.values()) / n
      gn = sum(np.sum(v) for v in nuh.values()) / n
      var = {k: gv for k in var}
      nuh = {k: gn for k in nuh}
    if normalize:
      var = {k: var[k] / (nuh[k] + eps) for k in var}
    outs.append({k: g[k] / (1 + coef * var[k]) for k in g})
    variances.append({k: np.broadcast_to(var[k], g[k].shape) for k in g})
  return outs, variances


@pytest.mark.parametrize("reduction", ["element", "leaf", "global"])
@pytest.mark.parametrize("normalize", [False, True])
def test_matches_numpy_reference(reduction, normalize):
  grads = _seq()
  tx = grpo_optax.scale_by_variance_lr(
    coef=0.7, decay=0.9, eps=1e-8, reduction=reduction, normalize=normalize
  )
  outs, state = _run(tx, grads)
  ref, variances = _numpy_reference(grads, 0.7, 0.9, 1e-8, reduction, normalize)
  for u, r in zip(outs, ref):
    for k in r:
      np.testing.assert_allclose(u[k], r[k], rtol=2e-4, atol=1e-7)
  # Diagnostics: means over all elements (every leaf is its own sample here)
  # of the variance and of the rate 1 / (1 + coef * variance).
  var = np.concatenate([np.ravel(v) for v in variances[-1].values()])
  np.testing.assert_allclose(state.variance, var.mean(), rtol=1e-4)
  np.testing.assert_allclose(
    state.lr_scale, np.mean(1 / (1 + 0.7 * var)), rtol=1e-5
  )
  assert float(state.lr_scale) < 0.9  # the variance is not negligible


def test_grad_variance_extra_arg_replaces_estimate():
  grads = _seq(3)
  gv = {
    "w": np.full((4, 5), 2.0, np.float32),
    "b": np.zeros(5, np.float32),
    "s": np.float32(4.0),
  }
  tx = grpo_optax.scale_by_variance_lr(coef=0.5, reduction="element")
  outs, _ = _run(tx, grads, grad_variance=gv)
  for u, g in zip(outs, grads):
    np.testing.assert_allclose(u["w"], g["w"] / 2.0, rtol=1e-6)
    np.testing.assert_allclose(u["b"], g["b"], rtol=1e-6)
    np.testing.assert_allclose(u["s"], g["s"] / 3.0, rtol=1e-6)


def test_grad_variance_structure_mismatch():
  tx = grpo_optax.scale_by_variance_lr()
  g = {"w": jnp.ones(3)}
  with pytest.raises(ValueError, match="grad_variance"):
    tx.update(g, tx.init(g), grad_variance={"v": jnp.ones(3)})


def test_high_variance_shrinks_low_variance_keeps():
  rng = np.random.default_rng(0)
  tx = grpo_optax.scale_by_variance_lr(coef=0.1, decay=0.9)
  noisy = [
    {
      "a": rng.normal(size=100).astype(np.float32) * 10,
      "b": np.full(100, 10.0, np.float32),
    }
    for _ in range(50)
  ]
  outs, _ = _run(tx, noisy)
  last = outs[-1]
  np.testing.assert_allclose(
    last["b"], noisy[-1]["b"], rtol=1e-5
  )  # no variance
  ratio = np.abs(last["a"]).sum() / np.abs(noisy[-1]["a"]).sum()
  assert ratio < 0.2  # variance ~100: rate ~1/11


def test_nan_gradient_is_reported_not_hidden():
  tx = grpo_optax.scale_by_variance_lr()
  g = {"w": jnp.array([1.0, jnp.nan])}
  u, state = tx.update(g, tx.init(g))
  assert bool(jnp.isnan(u["w"]).any())
  assert bool(jnp.isnan(state.variance))
  safe = optax.apply_if_finite(tx, max_consecutive_errors=2)
  s = safe.init(g)
  u, s = safe.update(g, s)
  np.testing.assert_array_equal(u["w"], np.zeros(2))
  jax.tree.map(np.testing.assert_array_equal, s.inner_state, tx.init(g))


@pytest.mark.parametrize(
  "kwargs,name",
  [
    (dict(coef=-0.1), "coef"),
    (dict(decay=1.0), "decay"),
    (dict(decay=-0.5), "decay"),
    (dict(eps=-1.0), "eps"),
  ],
)
def test_bad_input(kwargs, name):
  with pytest.raises(ValueError, match=name + r" must be in"):
    grpo_optax.scale_by_variance_lr(**kwargs)


def test_unknown_reduction():
  with pytest.raises(ValueError, match="reduction must be one of"):
    grpo_optax.scale_by_variance_lr(reduction="mean")


def test_defaults_match_the_reference_and_the_config_is_frozen():
  cfg = grpo_optax.ScaleByVarianceLrConfig()
  np.testing.assert_allclose(
    [cfg.coef, cfg.decay, cfg.eps], [0.1, 0.99, 1e-12], rtol=1e-6
  )
  assert cfg.reduction == "leaf" and cfg.normalize is False
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.coef = 0.2
  grads = _seq(5)
  outs, _ = _run(grpo_optax.scale_by_variance_lr(normalize=True), grads)
  ref, _ = _numpy_reference(grads, 0.1, 0.99, 1e-12, "leaf", True)
  for u, r in zip(outs, ref):
    for k in r:
      np.testing.assert_allclose(u[k], r[k], rtol=2e-6, atol=1e-7)


def test_eps_is_added_to_the_normaliser():
  grads = _seq(5)
  tx = grpo_optax.scale_by_variance_lr(
    coef=0.7, decay=0.9, eps=0.5, normalize=True
  )
  outs, _ = _run(tx, grads)
  ref, _ = _numpy_reference(grads, 0.7, 0.9, 0.5, "leaf", True)
  for u, r in zip(outs, ref):
    for k in r:
      np.testing.assert_allclose(u[k], r[k], rtol=2e-4, atol=1e-7)


@pytest.mark.parametrize("reduction", ["element", "leaf", "global"])
def test_reduction_names_are_compared_by_value(reduction):
  # A name built at run time is an equal string but another object. Shapes
  # of this test only: a jit cache hit would reuse another test's trace.
  name = "".join(list(reduction))
  assert name == reduction and name is not reduction
  rng = np.random.default_rng(5)
  grads = [
    {
      "a": rng.normal(size=(3, 11)).astype(np.float32),
      "z": rng.normal(size=(11,)).astype(np.float32),
    }
    for _ in range(4)
  ]
  tx = grpo_optax.scale_by_variance_lr(coef=0.7, decay=0.9, reduction=name)
  outs, _ = _run(tx, grads)
  ref, _ = _numpy_reference(grads, 0.7, 0.9, 0.0, reduction, False)
  for u, r in zip(outs, ref):
    for k in r:
      np.testing.assert_allclose(u[k], r[k], rtol=2e-4, atol=1e-7)


def test_global_mean_of_a_one_element_tree():
  grads = [{"s": np.float32(x)} for x in (1.0, -2.0, 3.0)]
  tx = grpo_optax.scale_by_variance_lr(coef=0.7, decay=0.9, reduction="global")
  outs, _ = _run(tx, grads)
  ref, _ = _numpy_reference(grads, 0.7, 0.9, 0.0, "global", False)
  for u, r in zip(outs, ref):
    np.testing.assert_allclose(u["s"], r["s"], rtol=2e-4)
  assert abs(float(outs[-1]["s"]) - 3.0) > 0.1  # the variance matters


def test_a_negative_grad_variance_counts_as_zero():
  g = {"w": jnp.array([1.0, -2.0])}
  tx = grpo_optax.scale_by_variance_lr(coef=0.5, reduction="element")
  u, _ = tx.update(g, tx.init(g), grad_variance={"w": jnp.array([-0.5, -0.25])})
  np.testing.assert_allclose(u["w"], g["w"], rtol=1e-6)


@pytest.mark.parametrize("tree", [{}, {"w": jnp.zeros((0,))}])
def test_metrics_of_a_tree_without_elements(tree):
  tx = grpo_optax.scale_by_variance_lr()
  _, state = tx.update(tree, tx.init(tree))
  assert float(state.lr_scale) == 1.0 and float(state.variance) == 0.0


@pytest.mark.parametrize("preset", [False, True])
def test_no_parameter_sized_constant_array_in_the_compiled_update(preset):
  # The variance's floor max(., 0) inside each leaf's reduction: XLA:CPU's
  # reduction fusion took the broadcast 0 as an array operand, so one zeros
  # array per leaf shape (shared by the leaves of that shape) was written
  # out and read every step.
  params = {
    "a": jnp.ones((64, 256)),
    "b": jnp.ones((64, 256)),
    "c": jnp.ones((256,)),
  }
  tx = (
    grpo_optax.grpo(1e-3, **grpo_optax.ARTICLE_DEFAULTS)
    if preset
    else optax.chain(grpo_optax.scale_by_variance_lr(), optax.sgd(1e-3))
  )
  state = tx.init(params)
  text = (
    jax.jit(tx.update)
    .lower(params, state, params)
    .compile(compiler_options=USER_DEFAULT)
    .as_text()
  )
  filled = re.findall(r"= f32\[64,256\]\{1,0\} fusion\(%constant[^)]*\)", text)
  assert not filled, filled
