"""Tests of grpo_optax.training.freezing."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from grpo_optax import training


def _params(d=8, num_layers=4, seed=0):
  k = jax.random.split(jax.random.key(seed), num_layers + 2)
  return {
    "embed": jax.random.normal(k[0], (5, d)),
    "layers": [
      {"w": jax.random.normal(k[i + 1], (d, d)) / np.sqrt(d), "b": jnp.zeros(d)}
      for i in range(num_layers)
    ],
    "head": jax.random.normal(k[-1], (d, 3)) / np.sqrt(d),
  }


def _loss(params, batch):
  x, y = batch
  h = x @ params["embed"]
  for p in params["layers"]:
    h = h + jnp.tanh(h @ p["w"] + p["b"])
  return jnp.mean((h @ params["head"] - y) ** 2)


def _batch(seed, n=16):
  kx, ky = jax.random.split(jax.random.key(seed))
  return jax.random.normal(kx, (n, 5)), jax.random.normal(ky, (n, 3))


def _copy(tree):
  return jax.tree.map(jnp.array, tree)


def _bottom_frozen(params, num_frozen):
  """Embedding and the first ``num_frozen`` layers frozen."""
  return {
    "embed": True,
    "layers": [
      {"w": i < num_frozen, "b": i < num_frozen}
      for i in range(len(params["layers"]))
    ],
    "head": False,
  }


def test_frozen_bit_identical_and_others_like_restricted_plain_step():
  tx = optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2))
  params = _params()
  frozen = _bottom_frozen(params, 2)
  fs = training.frozen_train_step(_loss, tx)
  p, s = _copy(params), tx.init(params)
  # The plain step restricted to the trainable leaves: the frozen ones are
  # closed over as constants.
  trainable = {"layers": params["layers"][2:], "head": params["head"]}

  def restricted_loss(tp, batch):
    full = {
      "embed": params["embed"],
      "layers": params["layers"][:2] + tp["layers"],
      "head": tp["head"],
    }
    return _loss(full, batch)

  plain = training.train_step(restricted_loss, tx)
  tp, ts = _copy(trainable), tx.init(trainable)
  for t in range(3):
    p, s, l1 = fs.step(p, s, _batch(t), frozen)
    tp, ts, l2 = plain(tp, ts, _batch(t))
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
  np.testing.assert_array_equal(p["embed"], params["embed"])
  for i in range(2):
    np.testing.assert_array_equal(p["layers"][i]["w"], params["layers"][i]["w"])
    np.testing.assert_array_equal(p["layers"][i]["b"], params["layers"][i]["b"])
  for a, b in zip(
    jax.tree.leaves({"layers": p["layers"][2:], "head": p["head"]}),
    jax.tree.leaves(tp),
  ):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  assert not np.allclose(p["head"], params["head"])


def test_freezing_lowers_compiled_flops():
  tx = optax.adam(1e-3)
  params = _params(d=64)
  fs = training.frozen_train_step(_loss, tx)
  batch = _batch(0, n=64)
  flops = []
  for k in (0, 2):
    mask = _bottom_frozen(params, k)
    if k == 0:
      mask["embed"] = False
    fn = fs.compiled(mask, params)
    flops.append(
      fn.lower(params, tx.init(params), batch)
      .compile()
      .cost_analysis()["flops"]
    )
  assert flops[1] < 0.8 * flops[0]


def test_cache_keyed_by_mask_and_device_masks():
  tx = optax.sgd(0.1)
  traced = []

  def loss(params, batch):
    traced.append(None)  # once per compilation of a mask's step
    return _loss(params, batch)

  fs = training.frozen_train_step(loss, tx, max_cached=2)
  params = _params()
  p, s = _copy(params), tx.init(params)
  m1, m2, m3 = (_bottom_frozen(params, k) for k in (1, 3, 0))
  m1_device = jax.tree.map(jnp.asarray, m1)  # e.g. from frozen_mask(state)
  p, s, _ = fs.step(p, s, _batch(0), m1)
  p, s, _ = fs.step(p, s, _batch(1), m1_device)
  assert fs.num_compiled == 1 and len(traced) == 1
  p, s, _ = fs.step(p, s, _batch(2), m2)
  p, s, _ = fs.step(p, s, _batch(3), m1)  # m1 is now the most recent
  assert len(traced) == 2
  p, s, _ = fs.step(p, s, _batch(4), m3)  # evicts m2, the least recent
  assert fs.num_compiled == 2 and len(traced) == 3
  p, s, _ = fs.step(p, s, _batch(5), m1)  # still cached (FIFO would evict it)
  assert len(traced) == 3
  p, s, _ = fs.step(p, s, _batch(6), m2)  # compiled again
  assert fs.num_compiled == 2 and len(traced) == 4
  np.testing.assert_array_equal(p["embed"], params["embed"])


def test_donation():
  tx = optax.adam(1e-2)
  fs = training.frozen_train_step(_loss, tx)
  params = _params()
  s = tx.init(params)
  fs.step(params, s, _batch(0), _bottom_frozen(params, 1))
  assert all(x.is_deleted() for x in jax.tree.leaves((params, s)))


def test_bad_masks():
  tx = optax.sgd(0.1)
  fs = training.frozen_train_step(_loss, tx)
  params = _params()
  s = tx.init(params)
  with pytest.raises(ValueError, match="frozen"):
    fs.step(params, s, _batch(0), {"embed": True, "head": False})
  bad = _bottom_frozen(params, 1)
  bad["head"] = jnp.zeros(3, bool)
  with pytest.raises(ValueError, match="frozen"):
    fs.step(params, s, _batch(0), bad)
  with pytest.raises(ValueError, match="max_cached"):
    training.frozen_train_step(_loss, tx, max_cached=0)
