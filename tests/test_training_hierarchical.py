"""Tests of grpo_optax.training.hierarchical."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from grpo_optax import training


def _params(d=8, f=16, seed=0):
  k = iter(jax.random.split(jax.random.key(seed), 16))
  n = lambda *s: jax.random.normal(next(k), s) / np.sqrt(s[0])
  layer = lambda: {
    "attn": {"query": n(d, d), "out": n(d, d)},
    "ln": {"scale": jnp.ones(d), "bias": jnp.zeros(d)},
    "mlp": {"fc1": n(d, f), "fc2": n(f, d)},
  }
  return {"embed": n(5, d), "layers": [layer(), layer()], "head": n(d, 3)}


def _forward(params, x):
  h = x @ params["embed"]
  for p in params["layers"]:
    a = jnp.tanh(h @ p["attn"]["query"]) @ p["attn"]["out"]
    h = h + a
    z = (h - h.mean(-1, keepdims=True)) * p["ln"]["scale"] + p["ln"]["bias"]
    h = h + jax.nn.gelu(z @ p["mlp"]["fc1"]) @ p["mlp"]["fc2"]
  return h @ params["head"]


def _loss(params, batch):
  x, y = batch
  return jnp.mean((_forward(params, x) - y) ** 2)


def _batch(seed, n=16):
  kx, ky = jax.random.split(jax.random.key(seed))
  return jax.random.normal(kx, (n, 5)), jax.random.normal(ky, (n, 3))


def _copy(tree):
  return jax.tree.map(jnp.array, tree)


def _core(tree_mask, tree):
  return [
    x for x, m in zip(jax.tree.leaves(tree), jax.tree.leaves(tree_mask)) if m
  ]


def test_default_rule_labels():
  hs = training.hierarchical_step(_loss, optax.sgd(0.1))
  mask = hs.core_mask(_params())
  assert mask["embed"] and mask["layers"][0]["attn"]["query"]
  assert mask["layers"][1]["attn"]["out"]
  assert not mask["layers"][0]["mlp"]["fc1"]
  assert not mask["layers"][0]["ln"]["scale"]
  assert not mask["head"]


@pytest.mark.parametrize("approx", ["last", "momentum", "zero"])
def test_skip_gradient_is_exact_for_core(approx):
  params = _params()
  hs = training.hierarchical_step(
    _loss, optax.sgd(0.1), approx=approx, refresh_every=3
  )
  h = hs.init(params)
  _, g_full, h = hs.gradient(params, h, _batch(1), refresh=True)
  batch = _batch(2)
  _, g_skip, h2 = hs.gradient(params, h, batch, refresh=False)
  exact = jax.grad(_loss)(params, batch)
  mask = hs.core_mask(params)
  for a, b in zip(_core(mask, g_skip), _core(mask, exact)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  noncore = jax.tree.map(lambda m: not m, mask)
  expected = {
    "last": _core(noncore, g_full),
    "momentum": _core(noncore, g_full),  # one refresh: m/(1-b) = g
    "zero": [jnp.zeros_like(x) for x in _core(noncore, g_full)],
  }
  for a, b in zip(_core(noncore, g_skip), expected[approx]):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  assert int(h2.count) == 1


def test_momentum_is_bias_corrected_ema():
  params = _params()
  beta = 0.5
  hs = training.hierarchical_step(
    _loss, optax.sgd(0.1), approx="momentum", momentum=beta
  )
  h = hs.init(params)
  _, g1, h = hs.gradient(params, h, _batch(1), refresh=True)
  _, g2, h = hs.gradient(params, h, _batch(2), refresh=True)
  _, g, _ = hs.gradient(params, h, _batch(3), refresh=False)
  want = jax.tree.map(
    lambda a, b: (beta * (1 - beta) * a + (1 - beta) * b) / (1 - beta**2),
    g1,
    g2,
  )
  np.testing.assert_allclose(g["head"], want["head"], rtol=1e-6)
  np.testing.assert_allclose(
    g["layers"][1]["mlp"]["fc2"], want["layers"][1]["mlp"]["fc2"], rtol=1e-6
  )


def test_refresh_every_one_equals_plain_step():
  tx = optax.adam(1e-2)
  hs = training.hierarchical_step(_loss, tx, refresh_every=1)
  plain = training.train_step(_loss, tx)
  p1, p2 = _params(), _params()
  s1, s2, h = tx.init(p1), tx.init(p2), hs.init(p1)
  for t in range(3):
    p1, s1, h, _ = hs.step(p1, s1, h, _batch(t), t)
    p2, s2, _ = plain(p2, s2, _batch(t))
  for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
    np.testing.assert_array_equal(a, b)


def test_step_schedule_counts_refreshes_and_donates():
  hs = training.hierarchical_step(_loss, optax.adam(1e-2), refresh_every=3)
  params = _params()
  opt_state, h = hs.tx.init(params), hs.init(params)
  losses = []
  for t in range(7):
    old = params
    params, opt_state, h, loss = hs.step(params, opt_state, h, _batch(0), t)
    assert all(x.is_deleted() for x in jax.tree.leaves(old))
    losses.append(float(loss))
  assert int(h.count) == 3  # steps 0, 3, 6
  assert losses[-1] < losses[0]
  with pytest.raises(TypeError, match="step"):
    hs.step(params, opt_state, h, _batch(0), 1.5)


def test_skip_step_saves_exactly_the_noncore_weight_gradients():
  """XLA's FLOP counts: the skip step drops the non-core ``x^T dy`` matmuls.

  Non-core here: both layers' MLP (``fc1`` d x f, ``fc2`` f x d), the layer
  norms and the head (d x 3); their weight gradients cost ``2 n a b`` FLOPs
  per (a x b) matrix on a batch of n. XLA counts matmul FLOPs exactly; the
  rest of the saving is the norms' elementwise scale/bias gradients (0.8%
  more, measured with jax 0.10.2). Measured skip / full = 0.756; the ratio
  can move only through XLA's elementwise counts, hence 0.01.
  """
  n, d, f, num_layers = 64, 32, 128, 2
  hs = training.hierarchical_step(_loss, optax.adam(1e-3))
  params = _params(d=d, f=f)
  args = (params, hs.tx.init(params), hs.init(params), _batch(0, n=n))
  full = hs.full_step.lower(*args).compile().cost_analysis()["flops"]
  skip = hs.skip_step.lower(*args).compile().cost_analysis()["flops"]
  matmuls = num_layers * (2 * n * d * f + 2 * n * f * d) + 2 * n * d * 3
  assert matmuls <= full - skip <= 1.02 * matmuls, (full, skip, matmuls)
  np.testing.assert_allclose(skip / full, 0.756, atol=0.01)


def test_custom_rules_regex_callable_tree():
  params = _params()
  by_regex = training.hierarchical_step(_loss, optax.sgd(0.1), is_core="mlp")
  by_call = training.hierarchical_step(
    _loss, optax.sgd(0.1), is_core=lambda path, leaf: "mlp" in path
  )
  tree = jax.tree_util.tree_map_with_path(
    lambda p, _: "mlp" in jax.tree_util.keystr(p), params
  )
  by_tree = training.hierarchical_step(_loss, optax.sgd(0.1), is_core=tree)
  masks = [
    jax.tree.leaves(h.core_mask(params)) for h in (by_regex, by_call, by_tree)
  ]
  assert masks[0] == masks[1] == masks[2] and sum(masks[0]) == 4


@pytest.mark.parametrize(
  "kwargs, name",
  [
    (dict(approx="ema"), "approx"),
    (dict(refresh_every=0), "refresh_every"),
    (dict(refresh_every=2.5), "refresh_every"),
    (dict(momentum=1.0), "momentum"),
  ],
)
def test_bad_arguments(kwargs, name):
  with pytest.raises(ValueError, match=name):
    training.hierarchical_step(_loss, optax.sgd(0.1), **kwargs)


def test_mask_structure_mismatch():
  params = _params()
  bad = {"embed": True, "head": False}
  hs = training.hierarchical_step(_loss, optax.sgd(0.1), is_core=bad)
  with pytest.raises(ValueError, match="is_core"):
    hs.init(params)


def test_nnx_model():
  from flax import nnx  # pylint: disable=g-import-not-at-top

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.attn = nnx.Linear(4, 4, rngs=rngs)
      self.mlp = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
      x = x + self.attn(x)
      return x + self.mlp(x)

  model = Block(nnx.Rngs(0))
  pm = training.split_model(model, lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2))
  hs = training.hierarchical_step(pm.loss_fn, optax.sgd(0.1), refresh_every=2)
  mask = hs.core_mask(pm.params)
  assert [bool(m) for m in jax.tree.leaves(mask)] == [True, True, False, False]
  params, opt_state, h = _copy(pm.params), hs.tx.init(pm.params), None
  h = hs.init(params)
  batch = (jnp.ones((2, 4)), jnp.zeros((2, 4)))
  l0 = pm.loss_fn(pm.params, batch)
  for t in range(4):
    params, opt_state, h, _ = hs.step(params, opt_state, h, batch, t)
  pm.update_model(params)
  assert float(jnp.mean((model(batch[0]) - batch[1]) ** 2)) < float(l0)
