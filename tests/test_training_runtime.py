"""The data-parallel runtime (grpo_optax.training.runtime) and the compressor
interface it runs (grpo_optax.training.compressors).

Eight forced CPU devices (conftest). Each compressor is driven through the
interface's parts (compress, collective, decompress, payload bytes) and
checked against a NumPy re-implementation; the runtime carries BatchNorm
statistics (Flax Linen and NNX, averaged over the replicas), a key per
replica, error feedback for every lossy compressor, local steps as a mode,
and a checkpoint of all of it.
"""

import ast
import dataclasses
import math
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from grpo_optax import training
from grpo_optax.training import checkpointing
from grpo_optax.training import compression
from grpo_optax.training import compressors
from grpo_optax.training import exchange as exchange_lib

W = 8
AXIS = "data"
ROOT = pathlib.Path(__file__).resolve().parent.parent


def _mesh():
  return Mesh(np.array(jax.devices()[:W]), (AXIS,))


def _randn(*shape, seed=0):
  return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def _leaves_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      x, y = jax.random.key_data(x), jax.random.key_data(y)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# -- every compressor through the one interface, against NumPy ---------------

#: One configuration per registered compressor (float32 payloads).
CONFIGS = {
  "dense": {},
  "all_gather": {"fraction": 0.1},
  "shared_support": {"fraction": 0.2, "chunk_size": 8},
  "powersgd": {"rank": 2},
  "int8": {"fraction": 0.5, "chunk_size": 8},
}


def _interface_mean(compressor, accs_w):
  """``(mean, residuals)`` of one exchange through the interface's three
  parts, on per-replica leaves ``(W, ...)``.
  """
  shapes = [x.shape[1:] for x in accs_w]
  state = compressor.init(shapes)

  def f(*xs):
    accs = [x[0] for x in xs]
    payload = compressor.compress(accs, state, AXIS)
    received = compressor.collective(payload.wire, payload.local, AXIS)
    out = compressor.decompress(received, payload.local, accs, state)
    return out.means, [r[None] for r in out.residuals]

  n = len(accs_w)
  fn = jax.shard_map(
    f, mesh=_mesh(), in_specs=(P(AXIS),) * n, out_specs=(P(), P(AXIS))
  )
  mean, res = jax.jit(fn)(*accs_w)
  return [np.asarray(m) for m in mean], [np.asarray(r) for r in res], state


def _topk(x, k):
  return np.sort(np.argsort(-np.abs(x), kind="stable")[:k])


def _ref_dense(accs, state, cfg):
  del state, cfg
  return [a.mean(0) for a in accs], [0 * a for a in accs]


def _ref_all_gather(accs, state, cfg):
  del state
  means, res = [], []
  for a in accs:
    flat = a.reshape(W, -1)
    k = math.ceil(cfg["fraction"] * flat.shape[1])
    mean, r = np.zeros(flat.shape[1], np.float32), flat.copy()
    for i in range(W):
      idx = _topk(flat[i], k)
      mean[idx] += flat[i, idx] / W
      r[i, idx] = 0
    means.append(mean.reshape(a.shape[1:]))
    res.append(r.reshape(a.shape))
  return means, res


def _ref_shared_support(accs, state, cfg):
  del state
  c = cfg["chunk_size"]
  rows, sizes = [], []
  for a in accs:
    flat = a.reshape(W, -1)
    m = -(-flat.shape[1] // c)
    sizes.append(flat.shape[1])
    rows.append(np.pad(flat, ((0, 0), (0, m * c - flat.shape[1]))))
  mat = np.concatenate([r.reshape(W, -1, c) for r in rows], axis=1)
  chosen = np.argsort(-(mat**2).sum(axis=(0, 2)), kind="stable")
  chosen = chosen[: math.ceil(cfg["fraction"] * mat.shape[1])]
  mean = np.zeros(mat.shape[1:], np.float32)
  mean[chosen] = mat[:, chosen].mean(0)
  left = mat.copy()
  left[:, chosen] = 0
  means, res, off = [], [], 0
  for a, n in zip(accs, sizes):
    m = -(-n // c)
    means.append(mean[off : off + m].reshape(-1)[:n].reshape(a.shape[1:]))
    res.append(left[:, off : off + m].reshape(W, -1)[:, :n].reshape(a.shape))
    off += m
  return means, res


def _ref_powersgd(accs, state, cfg):
  del cfg
  means, res = [], []
  for a, q in zip(accs, state.q):
    if q is None:  # Sent densely (fewer than 2 dimensions, or too small).
      means.append(a.mean(0))
      res.append(0 * a)
      continue
    mats = a.reshape(W, -1, a.shape[-1]).astype(np.float64)
    p_hat = np.linalg.qr((mats @ np.asarray(q)).mean(0))[0]
    q_new = (np.swapaxes(mats, 1, 2) @ p_hat).mean(0)
    approx = p_hat @ q_new.T
    means.append(approx.reshape(a.shape[1:]))
    res.append((mats - approx).reshape(a.shape))
  return means, res


def _ref_int8(accs, state, cfg):
  del state
  levels = 127 // W
  means, res = [], []
  for a in accs:
    flat = a.reshape(W, -1)
    n = flat.shape[1]
    width = min(cfg["chunk_size"], n)
    m = -(-n // width)
    c = np.pad(flat, ((0, 0), (0, m * width - n))).reshape(W, m, width)
    keep = np.sort(
      np.argsort(-(c**2).sum(axis=(0, 2)))[: math.ceil(cfg["fraction"] * m)]
    )
    scale = np.abs(c[:, keep]).max(axis=(0, 2))[None, :, None]
    q = np.clip(np.round(c[:, keep] * levels / scale), -levels, levels)
    mean = np.zeros((m, width), np.float32)
    mean[keep] = q.sum(0) * scale[0] / levels / W
    left = c.copy()
    left[:, keep] -= q * scale / levels
    means.append(mean.reshape(-1)[:n].reshape(a.shape[1:]))
    res.append(left.reshape(W, -1)[:, :n].reshape(a.shape))
  return means, res


#: The NumPy reference of each compressor (a new compressor needs one).
REFERENCES = {
  "dense": _ref_dense,
  "all_gather": _ref_all_gather,
  "shared_support": _ref_shared_support,
  "powersgd": _ref_powersgd,
  "int8": _ref_int8,
}


def test_every_registered_compressor_has_a_reference():
  assert set(REFERENCES) == set(CONFIGS) == set(compressors.NAMES)


@pytest.mark.parametrize("name", compressors.NAMES)
def test_compressor_through_the_interface_matches_its_reference(name):
  accs = [_randn(W, 12, 10, seed=1), _randn(W, 10, seed=2)]
  compressor = compressors.make(name, **CONFIGS[name])
  mean, res, state = _interface_mean(compressor, accs)
  want_mean, want_res = REFERENCES[name](accs, state, CONFIGS[name])
  for got, want in zip(mean, want_mean, strict=True):
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
  for got, want in zip(res, want_res, strict=True):
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
  # Error feedback loses nothing in one exchange: mean + mean residual is
  # the exact mean (int8 rounding and unsent entries stay behind).
  for m, r, a in zip(mean, res, accs):
    np.testing.assert_allclose(m + r.mean(0), a.mean(0), atol=2e-5)


@pytest.mark.parametrize("name", compressors.NAMES)
def test_payload_bytes_are_the_compiled_collectives(name):
  # The interface's fifth part, against the compiled program's collectives.
  shapes = [(64, 48), (48,), (48, 4)]
  compressor = compressors.make(name, **CONFIGS[name])
  state = compressor.init(shapes)

  def f(*xs):
    return compressor.mean([x[0] for x in xs], state, AXIS).means

  args = [jax.ShapeDtypeStruct((W,) + s, jnp.float32) for s in shapes]
  fn = jax.jit(
    jax.shard_map(
      f, mesh=_mesh(), in_specs=(P(AXIS),) * len(shapes), out_specs=P()
    )
  )
  ops = training.collective_ops(fn.lower(*args).compile())
  bytes_of = lambda kind: sum(b for k, b, _ in ops if k == kind)
  want = compressor.payload_bytes(shapes, W)
  # An all-gather's result holds every replica's payload; an all-reduce's
  # is the size of one.
  gathered, reduced = bytes_of("all-gather"), bytes_of("all-reduce")
  assert gathered % W == 0 and gathered // W + reduced == want
  assert want < 4 * sum(math.prod(s) for s in shapes) or name == "dense"


# -- the registry is the one source of the names -------------------------------


def test_registry_is_the_one_source_of_exchange_and_option_names():
  from examples.common import parallel  # pylint: disable=g-import-not-at-top

  assert training.EXCHANGES is compressors.NAMES
  values = compressors.options()["values"]
  assert values.choices == compression.VALUE_FORMATS
  # The documentation's table is rendered from the registry.
  page = (ROOT / "docs" / "communication.md").read_text(encoding="utf-8")
  begin, end = "<!-- registry:begin -->\n", "<!-- registry:end -->"
  table = page[page.index(begin) + len(begin) : page.index(end)]
  assert table == exchange_lib.options_table()
  # The examples' flags: one per declared option, choices from the registry.
  assert set(parallel.option_specs()) == set(compressors.options()) | {
    "warmup_steps"
  }


def _name_tuples(path):
  """Tuples/lists of 2+ string literals that are all exchange names."""
  names = set(compressors.NAMES)
  for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
      strs = [
        e.value
        for e in node.elts
        if isinstance(e, ast.Constant) and isinstance(e.value, str)
      ]
      if len(strs) >= 2 and set(strs) <= names:
        yield node.lineno, strs


def test_no_module_lists_the_exchange_names_again():
  # The registry (compressors/__init__.py) lists them; local steps' int8
  # payload names the two float exchanges it replaces (INT8_OUTER).
  allowed = {
    ("grpo_optax/training/local_steps.py", ("dense", "shared_support"))
  }
  found = set()
  for path in [
    *(ROOT / "grpo_optax").rglob("*.py"),
    *(ROOT / "examples").rglob("*.py"),
  ]:
    rel = str(path.relative_to(ROOT))
    found |= {(rel, tuple(s)) for _, s in _name_tuples(path)}
  assert found <= allowed, found - allowed


# -- model state: BatchNorm statistics, Linen and NNX --------------------------


class _LinenNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(6)(x)
    x = nn.BatchNorm(use_running_average=False, momentum=0.9)(x)
    return nn.Dense(1)(nn.relu(x))


def _batch(seed=0, n=4 * W):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 5)).astype(np.float32) * (1 + np.arange(n)[:, None])
  return x, rng.normal(size=(n, 1)).astype(np.float32)


def _replicas_equal(tree):
  for x in jax.tree.leaves(tree):
    shards = [np.asarray(s.data) for s in x.addressable_shards]
    assert len(shards) == W
    for s in shards[1:]:
      np.testing.assert_array_equal(s, shards[0])


def test_linen_batch_stats_are_the_mean_of_the_replicas():
  net = _LinenNet()
  x, y = _batch()
  variables = net.init(jax.random.key(0), x[:2])

  def loss_fn(params, stats, batch, key):
    del key
    xs, ys = batch
    out, new = net.apply(
      {"params": params, "batch_stats": stats}, xs, mutable=["batch_stats"]
    )
    return jnp.mean((out - ys) ** 2), (new["batch_stats"], None)

  dp = training.data_parallel(loss_fn, optax.sgd(0.1), _mesh())
  state = dp.init(variables["params"], variables["batch_stats"])
  state, _ = dp.step(state, (x, y))
  _replicas_equal(state.model_state)
  # Each replica's own update of the statistics, averaged (as the
  # examples' BatchNorm did): the mean of the shards' statistics.
  per = [
    loss_fn(
      variables["params"],
      variables["batch_stats"],
      (x[i * 4 : (i + 1) * 4], y[i * 4 : (i + 1) * 4]),
      None,
    )[1][0]
    for i in range(W)
  ]
  want = jax.tree.map(lambda *s: np.mean(np.stack(s), 0), *per)
  for got, ref in zip(
    jax.tree.leaves(state.model_state), jax.tree.leaves(want)
  ):
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-6)
  # Not one replica's: the shards differ, and so do their statistics.
  assert not np.allclose(jax.tree.leaves(per[0])[0], jax.tree.leaves(per[1])[0])


class _NnxNet(nnx.Module):
  def __init__(self, rngs):
    self.dense = nnx.Linear(5, 6, rngs=rngs)
    self.bn = nnx.BatchNorm(6, momentum=0.9, rngs=rngs)
    self.head = nnx.Linear(6, 1, rngs=rngs)

  def __call__(self, x):
    return self.head(nnx.relu(self.bn(self.dense(x))))


def _nnx_split():
  def forward(model, batch, key):
    del key
    xs, ys = batch
    return jnp.mean((model(xs) - ys) ** 2), {"out": jnp.mean(model(xs))}

  return training.split_model_with_state(_NnxNet(nnx.Rngs(0)), forward)


@pytest.mark.parametrize("local_steps", [0, 2])
def test_nnx_batch_stats_are_the_mean_of_the_replicas(local_steps):
  sm = _nnx_split()
  x, y = _batch(1)
  dp = training.data_parallel(
    sm.loss_fn, optax.sgd(0.1), _mesh(), local_steps=local_steps
  )
  state = dp.init(sm.params, sm.model_state)
  per = [
    sm.loss_fn(
      sm.params,
      sm.model_state,
      (x[i * 4 : (i + 1) * 4], y[i * 4 : (i + 1) * 4]),
      None,
    )[1][0]
    for i in range(W)
  ]
  state, _ = dp.step(state, (x, y))
  stats = state.model_state
  if local_steps:
    # Kept per replica between outer steps: each replica has its own.
    first = jax.tree.leaves(stats)[0]
    assert first.shape[0] == W and not np.allclose(first[0], first[1])
    for i in range(W):
      for got, ref in zip(jax.tree.leaves(stats), jax.tree.leaves(per[i])):
        np.testing.assert_allclose(np.asarray(got)[i], ref, rtol=1e-5)
    state, _ = dp.step(state, _batch(2))  # The outer step averages them.
    first = np.asarray(jax.tree.leaves(state.model_state)[0])
    np.testing.assert_allclose(first, np.broadcast_to(first[0], first.shape))
    return
  _replicas_equal(stats)
  want = jax.tree.map(lambda *s: np.mean(np.stack(s), 0), *per)
  for got, ref in zip(jax.tree.leaves(stats), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-6)
  # The evaluation view merges into a model holding them.
  view = dp.local_view(state)
  model = sm.merge(view.params, view.model_state)
  np.testing.assert_allclose(
    np.asarray(model.bn.mean[...]),
    np.asarray(jax.tree.leaves(want)[0]),
    rtol=1e-5,
    atol=1e-6,
  )


def test_aux_is_averaged_and_keys_differ_per_replica():
  # The replica's key of step t: fold_in(fold_in(key, t), replica).
  def loss_fn(params, model_state, batch, key):
    draw = jax.random.uniform(key)
    return jnp.sum(params["w"] * batch), (model_state, {"draw": draw})

  dp = training.data_parallel(loss_fn, optax.sgd(0.1), _mesh())
  key = jax.random.key(7)
  state = dp.init({"w": jnp.zeros(3)}, key=key)
  for t in range(2):
    state, out = dp.step(state, np.ones((W, 3), np.float32))
    draws = [
      float(
        jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, t), r))
      )
      for r in range(W)
    ]
    assert len(set(draws)) == W  # Every replica draws its own.
    np.testing.assert_allclose(
      float(out.aux["draw"]), np.mean(draws), rtol=1e-6
    )
  assert int(state.count) == 2


# -- error feedback: nothing is lost, whatever the compressor -------------------


def _linear_loss(params, model_state, batch, key):
  # The gradient is the batch mean of (x, z): it does not depend on params.
  del key
  x, z = batch
  loss = jnp.mean(x @ params["w"]) + jnp.mean(jnp.sum(z * params["m"], (1, 2)))
  return loss, (model_state, None)


@pytest.mark.parametrize(
  "name", [n for n in compressors.NAMES if not compressors.REGISTRY[n].lossless]
)
def test_error_feedback_loses_nothing_through_the_runtime(name):
  params = {"w": np.zeros(300, np.float32), "m": np.zeros((7, 9), np.float32)}
  rng = np.random.default_rng(2)
  batches = [
    (
      rng.normal(size=(16, 300)).astype(np.float32),
      rng.standard_t(3, size=(16, 7, 9)).astype(np.float32),
    )
    for _ in range(4)
  ]
  dp = training.data_parallel(
    _linear_loss, optax.sgd(1.0), _mesh(), exchange=name, **CONFIGS[name]
  )
  state = dp.init(params)
  for batch in batches:
    state, _ = dp.step(state, batch)
  applied = jax.tree.map(lambda p: -np.asarray(p), state.params)
  left = jax.tree.map(lambda r: np.asarray(r).mean(0), state.exchange.residual)
  want = {
    "w": sum(x.mean(0) for x, _ in batches),
    "m": sum(z.mean(0) for _, z in batches),
  }
  for k in want:
    np.testing.assert_allclose(applied[k] + left[k], want[k], atol=2e-5)
    if name != "powersgd" or k == "m":  # PowerSGD sends 1-D leaves dense.
      assert np.abs(left[k]).sum() > 0  # Something was held back.


# -- local steps: a mode of the same step ---------------------------------------


def _quad_loss(params, model_state, batch, key):
  del key
  x, y = batch
  return jnp.mean((x @ params["w"] - y) ** 2), (model_state, None)


def _quad_batches(h, seed=0):
  rng = np.random.default_rng(seed)
  return (
    rng.normal(size=(h, 2 * W, 4)).astype(np.float32),
    rng.normal(size=(h, 2 * W, 1)).astype(np.float32),
  )


def _wide_loss(params, model_state, batch, key):
  del key
  x, y = batch
  return jnp.mean((x @ params["w"] + params["b"] - y) ** 2), (model_state, None)


@pytest.mark.parametrize("exchange", ["dense", "powersgd"])
def test_steps_of_the_local_mode_equal_its_round(exchange):
  # H steps (the outer step in the H-th) = one round of H inner steps.
  h = 3
  make = lambda: training.data_parallel(
    _wide_loss, optax.adam(0.05), _mesh(), local_steps=h, exchange=exchange
  )
  params = {"w": _randn(4, 3, seed=4), "b": np.zeros(3, np.float32)}
  rng = np.random.default_rng(6)
  xs = rng.normal(size=(h, 2 * W, 4)).astype(np.float32)
  ys = rng.normal(size=(h, 2 * W, 3)).astype(np.float32)
  by_step, by_round = make(), make()
  a = by_step.init(params)
  for i in range(h):
    a, _ = by_step.step(a, (xs[i], ys[i]))
  b, _ = by_round.round(by_round.init(params), (xs, ys))
  assert int(a.count) == int(b.count) == h
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(
      np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7
    )
  # The outer parameters moved, and every replica restarted from them (less
  # its unsent part: none for the dense float exchange).
  assert not np.allclose(np.asarray(a.outer.params["w"]), params["w"])
  if exchange == "dense":
    for mine, outer in zip(
      jax.tree.leaves(a.params), jax.tree.leaves(a.outer.params)
    ):
      np.testing.assert_array_equal(np.asarray(mine)[3], np.asarray(outer))


def test_sync_ends_a_partial_round_and_one_local_step_is_data_parallel():
  # H = 1, SGD inside, outer SGD(1): each step is a data-parallel step.
  xs, ys = _quad_batches(2, seed=3)
  params = {"w": np.zeros((4, 1), np.float32)}
  local = training.data_parallel(
    _quad_loss, optax.sgd(0.1), _mesh(), local_steps=1, outer_tx=optax.sgd(1.0)
  )
  every = training.data_parallel(_quad_loss, optax.sgd(0.1), _mesh())
  a, b = local.init(params), every.init(params)
  for i in range(2):
    a, _ = local.step(a, (xs[i], ys[i]))
    b, _ = every.step(b, (xs[i], ys[i]))
  np.testing.assert_allclose(
    np.asarray(a.outer.params["w"]), np.asarray(b.params["w"]), rtol=1e-6
  )
  # H = 4 after one step: sync() runs the outer step now.
  partial = training.data_parallel(
    _quad_loss, optax.sgd(0.1), _mesh(), local_steps=4, outer_tx=optax.sgd(1.0)
  )
  c, _ = partial.step(partial.init(params), (xs[0], ys[0]))
  np.testing.assert_array_equal(np.asarray(c.outer.params["w"]), 0)
  c = partial.sync(c)
  b = every.init(params)
  b, _ = every.step(b, (xs[0], ys[0]))
  np.testing.assert_allclose(
    np.asarray(c.outer.params["w"]), np.asarray(b.params["w"]), rtol=1e-6
  )


def test_outer_step_averages_the_model_state_of_the_reporting_replicas():
  # Local steps with a participation mask: the BatchNorm statistics after
  # the outer step are the mean over the replicas that report (all get it),
  # and the outer parameters move by the reporting replicas' changes only.
  sm = _nnx_split()
  x, y = _batch(3)
  dp = training.data_parallel(
    sm.loss_fn, optax.sgd(0.1), _mesh(), local_steps=1, outer_tx=optax.sgd(1.0)
  )
  mask = np.zeros(W, np.float32)
  mask[[1, 4, 6]] = 1
  state, _ = dp.step(dp.init(sm.params, sm.model_state), (x, y), mask)
  shard = lambda i: (x[i * 4 : (i + 1) * 4], y[i * 4 : (i + 1) * 4])
  per = [
    sm.loss_fn(sm.params, sm.model_state, shard(i), None) for i in range(W)
  ]
  want = jax.tree.map(
    lambda *s: np.mean(np.stack([s[i] for i in (1, 4, 6)]), 0),
    *[p[1][0] for p in per],
  )
  for got, ref in zip(
    jax.tree.leaves(state.model_state), jax.tree.leaves(want), strict=True
  ):
    got = np.asarray(got)
    for i in range(W):
      np.testing.assert_allclose(got[i], ref, rtol=1e-5, atol=1e-6)
  # Outer SGD(1) of the mean change of replicas 1, 4, 6 (inner SGD 0.1).
  grads = [
    jax.grad(lambda p, i=i: sm.loss_fn(p, sm.model_state, shard(i), None)[0])(
      sm.params
    )
    for i in (1, 4, 6)
  ]
  step = jax.tree.map(lambda *g: 0.1 * np.mean(np.stack(g), 0), *grads)
  moved = jax.tree.map(lambda p, d: np.asarray(p) - d, sm.params, step)
  for got, ref in zip(
    jax.tree.leaves(state.outer.params), jax.tree.leaves(moved), strict=True
  ):
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-6)


# -- checkpoint of the whole state ------------------------------------------------


def _noisy_loss(params, model_state, batch, key):
  x, y = batch
  noise = 0.01 * jax.random.normal(key, y.shape)
  pred = x @ params["w"]
  stats = 0.9 * model_state + 0.1 * jnp.mean(pred)
  return jnp.mean((pred - y - noise) ** 2), (stats, {"pred": jnp.mean(pred)})


@pytest.mark.parametrize(
  "kwargs",
  [
    dict(
      exchange="shared_support",
      fraction=0.25,
      chunk_size=4,
      support="replicated",
      momentum=0.5,
      warmup_steps=1,
    ),
    dict(exchange="powersgd", rank=1),
    dict(exchange="int8", fraction=0.5, chunk_size=4, local_steps=2),
  ],
  ids=["dgc-replicated", "powersgd", "local-int8"],
)
def test_checkpoint_restore_then_steps_equal_the_uninterrupted_run(
  tmp_path, kwargs
):
  make = lambda: training.data_parallel(
    _noisy_loss, optax.adam(0.05), _mesh(), **kwargs
  )
  rng = np.random.default_rng(5)
  batches = [
    (
      rng.normal(size=(2 * W, 6)).astype(np.float32),
      rng.normal(size=(2 * W, 2)).astype(np.float32),
    )
    for _ in range(6)
  ]
  init = lambda dp: dp.init(
    {"w": np.zeros((6, 2), np.float32)},
    np.zeros((), np.float32),
    key=jax.random.key(3),
  )
  dp = make()
  state = init(dp)
  for batch in batches[:2]:
    state, _ = dp.step(state, batch)
  checkpointing.save(str(tmp_path), 2, state)
  for batch in batches[2:]:
    state, _ = dp.step(state, batch)
  # A new process: a new runtime, its fresh state as the layout to fill.
  resumed = make()
  step, again = checkpointing.restore(str(tmp_path), init(resumed))
  assert step == 2 and int(again.count) == 2
  for batch in batches[2:]:
    again, _ = resumed.step(again, batch)
  _leaves_equal(again, state)
  assert jax.tree.structure(again) == jax.tree.structure(state)


# -- arguments ---------------------------------------------------------------------


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    ({"local_steps": -1}, ValueError, r"`local_steps` must be an int >= 0"),
    ({"local_steps": 2, "dense_axis": "x"}, ValueError, "`dense_axis`"),
    ({"outer_tx": "sgd"}, TypeError, "`outer_tx` must be an optax"),
    ({"outer_tx": optax.sgd(1.0)}, ValueError, "`outer_tx` applies to"),
    ({"norms": 1}, TypeError, "`norms` must be a bool"),
    ({"extra_args": 3}, TypeError, "`extra_args` must be None or callable"),
    ({"exchange": "topk"}, ValueError, "`exchange` must be one of"),
    ({"rank": 2}, ValueError, r"`rank=2` needs `exchange='powersgd'`"),
    (
      {"exchange": "all_gather", "fraction": 2},
      ValueError,
      r"`fraction` must be a float in \(0, 1\], got 2",
    ),
    (
      {"exchange": "int8", "values": "bfloat16"},
      ValueError,
      "needs `exchange`",
    ),
    ({"exchange": "dense", "warmup_steps": 2}, ValueError, "sparse exchange"),
    ({"exchange": "int8", "unknown": 1}, TypeError, "no exchange takes"),
  ],
)
def test_bad_runtime_arguments(kwargs, error, match):
  with pytest.raises(error, match=match):
    training.data_parallel(_quad_loss, optax.sgd(0.1), _mesh(), **kwargs)


def test_participation_and_modes_are_checked():
  every = training.data_parallel(_quad_loss, optax.sgd(0.1), _mesh())
  state = every.init({"w": np.zeros((4, 1), np.float32)})
  batch = tuple(x[0] for x in _quad_batches(1))
  with pytest.raises(ValueError, match="applies to local-step mode"):
    every.step(state, batch, participation=np.ones(W))
  with pytest.raises(ValueError, match="needs local-step mode"):
    every.sync(state)
  local = training.data_parallel(
    _quad_loss, optax.sgd(0.1), _mesh(), local_steps=2
  )
  with pytest.raises(ValueError, match=r"`participation` must have the shape"):
    local.step(
      local.init({"w": np.zeros((4, 1), np.float32)}), batch, np.ones(3)
    )
  with pytest.raises(ValueError, match="at most 127 replicas"):
    compressors.make("int8").check_replicas(128)


def test_exchange_is_immutable_and_hashable():
  a = training.make_exchange("all_gather", fraction=0.1, momentum=0.9)
  b = training.make_exchange("all_gather", fraction=0.1, momentum=0.9)
  assert a == b and hash(a) == hash(b)
  assert a != dataclasses.replace(a, momentum=0.5)
  with pytest.raises(AttributeError):
    a.compressor.fraction = 0.5  # type: ignore[misc]
  assert training.make_exchange(a) is a
