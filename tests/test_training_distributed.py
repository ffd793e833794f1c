"""Tests of grpo_optax.training.distributed (data parallel, sparse exchange).

Eight forced CPU devices (conftest); the multi-process test starts two local
processes of two devices each (gloo over localhost).
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import grpo_optax
from grpo_optax import hlo
from grpo_optax import training
from grpo_optax.training import compression
from grpo_optax.training.compressors import payload

sys.path.insert(0, os.path.dirname(__file__))
import dp_worker  # noqa: E402  pylint: disable=g-import-not-at-top

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
W = 8


def _mesh(n=W, names=("data",), shape=None):
  devices = np.array(jax.devices()[:n]).reshape(shape or (n,))
  return Mesh(devices, names)


def _params():
  rng = np.random.default_rng(0)
  return {
    "w1": (rng.normal(size=(16, 48)) / 4).astype(np.float32),
    "b1": np.zeros(48, np.float32),
    "w2": (rng.normal(size=(48, 4)) / 7).astype(np.float32),
  }


def _loss(params, batch):
  x, y = batch
  return jnp.mean(
    (jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] - y) ** 2
  )


def _batches(n=3, size=32, seed=1):
  rng = np.random.default_rng(seed)
  return [
    (
      rng.normal(size=(size, 16)).astype(np.float32),
      rng.normal(size=(size, 4)).astype(np.float32),
    )
    for _ in range(n)
  ]


def _run(dp, batches):
  state = dp.init(_params())
  losses = []
  for batch in batches:
    state, loss = dp.step(state, batch)
    losses.append(float(loss))
  return state, losses


def _reference(tx, batches):
  params, losses = _params(), []
  opt_state = tx.init(params)
  for batch in batches:
    loss, grads = jax.value_and_grad(_loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    losses.append(float(loss))
  return params, losses


def _assert_trees_close(a, b, atol):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=0)


def test_dense_step_equals_single_device_full_batch():
  tx = optax.adam(1e-2)
  batches = _batches()
  state, losses = _run(training.data_parallel_step(_loss, tx, _mesh()), batches)
  want_params, want_losses = _reference(tx, batches)
  _assert_trees_close(state.params, want_params, 1e-5)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  assert state.residual is None
  leaf = jax.tree.leaves(state.params)[0]
  assert leaf.sharding.is_fully_replicated and len(leaf.devices()) == W


@pytest.mark.parametrize("exchange", ["all_gather", "shared_support"])
def test_sparse_exchange_with_fraction_one_equals_dense(exchange):
  tx = optax.adam(1e-2)
  batches = _batches()
  dense, _ = _run(training.data_parallel_step(_loss, tx, _mesh()), batches)
  sparse, _ = _run(
    training.data_parallel_step(
      _loss, tx, _mesh(), exchange=exchange, fraction=1.0
    ),
    batches,
  )
  _assert_trees_close(sparse.params, dense.params, 1e-5)
  for r in jax.tree.leaves(sparse.residual):  # Everything was sent.
    assert r.shape[0] == W and float(jnp.max(jnp.abs(r))) == 0.0


def _linear_loss(params, batch):
  # The gradient is the batch mean of (x, z): it does not depend on params.
  x, z = batch
  return jnp.mean(x @ params["w"]) + jnp.mean(
    jnp.sum(z * params["m"], axis=(1, 2))
  )


@pytest.mark.parametrize("exchange", ["all_gather", "shared_support"])
def test_error_feedback_loses_nothing(exchange):
  params = {"w": np.zeros(300, np.float32), "m": np.zeros((7, 9), np.float32)}
  rng = np.random.default_rng(2)
  batches = [
    (
      rng.normal(size=(16, 300)).astype(np.float32),
      rng.standard_t(3, size=(16, 7, 9)).astype(np.float32),
    )
    for _ in range(4)
  ]
  # chunk_size: the shared support's option (all_gather takes none).
  chunks = {"chunk_size": 8} if exchange == "shared_support" else {}
  dp = training.data_parallel_step(
    _linear_loss,
    optax.sgd(1.0),
    _mesh(),
    exchange=exchange,
    fraction=0.1,
    **chunks,
  )
  state = dp.init(params)
  for batch in batches:
    state, _ = dp.step(state, batch)
  applied = jax.tree.map(lambda p: -np.asarray(p), state.params)
  mean_residual = jax.tree.map(lambda r: np.asarray(r).mean(0), state.residual)
  want = {
    "w": sum(x.mean(0) for x, _ in batches),
    "m": sum(z.mean(0) for _, z in batches),
  }
  for k in want:
    np.testing.assert_allclose(
      applied[k] + mean_residual[k], want[k], atol=1e-5, rtol=0
    )
    # Sparse: most of it is still in the residual after 4 steps at 10%.
    assert np.abs(mean_residual[k]).sum() > 0.1 * np.abs(want[k]).sum()
  # Without error feedback the unsent part is gone.
  lossy = training.data_parallel_step(
    _linear_loss,
    optax.sgd(1.0),
    _mesh(),
    exchange=exchange,
    fraction=0.1,
    error_feedback=False,
    **chunks,
  )
  state = lossy.init(params)
  assert state.residual is None
  state, _ = lossy.step(state, batches[0])
  sent = -np.asarray(state.params["w"])
  bound = (
    W * payload.num_kept(300, 0.1)
    if exchange == "all_gather"
    else 8 * payload.num_kept(payload.num_chunks(300, 8), 0.1)
  )
  assert np.count_nonzero(sent) <= bound
  lost = batches[0][0].mean(0) - sent
  assert np.abs(lost).sum() > 0.2 * np.abs(batches[0][0].mean(0)).sum()


def _sizes():
  return [x.size for x in jax.tree.leaves(_params())]


@pytest.mark.parametrize("exchange", ["all_gather", "shared_support"])
def test_sparse_program_has_no_dense_all_reduce(exchange):
  chunks = {"chunk_size": 16} if exchange == "shared_support" else {}
  dp = training.data_parallel_step(
    _loss, optax.adam(1e-2), _mesh(), exchange=exchange, fraction=0.1, **chunks
  )
  state = dp.init(_params())
  compiled = dp.lower(state, _batches(1)[0]).compile()
  ops = training.collective_ops(compiled)
  got = training.collective_bytes(compiled)
  dense_bytes = 4 * sum(_sizes())
  assert 4 * max(_sizes()) > 2 * 1024  # A dense psum would show.
  if exchange == "all_gather":
    assert all(size <= 1024 for kind, size, _ in ops if kind == "all-reduce")
    k = sum(payload.num_kept(n, 0.1) for n in _sizes())
    assert got["all-gather"] == W * k * (4 + 4)  # fp32 values, int32 indices.
  else:
    # Rows of 16 entries over all leaves; the top 10% of them are sent.
    chunks = compression.chunk_rows(_sizes(), 16)
    kept = compression.num_kept(sum(chunks), 0.1) * 16
    # Chunk norms, the kept values (one psum each) and the scalar loss (XLA
    # may combine the last two).
    reduces = [size for kind, size, _ in ops if kind == "all-reduce"]
    assert sum(reduces) == 4 * (sum(chunks) + kept + 1)
    assert len(reduces) <= 3 and max(reduces) <= 4 * (kept + 1)
    assert got["all-gather"] == 0
  assert all(group == W for _, _, group in ops)
  traffic = training.ring_traffic(compiled)["total"]
  dense_traffic = 2 * (W - 1) / W * dense_bytes
  assert traffic < (0.9 if exchange == "all_gather" else 0.2) * dense_traffic


def test_the_pitfall_grad_of_replicated_params_psums_the_full_gradient():
  # What the step avoids: differentiating the replicated params inside
  # shard_map adds a psum of the whole gradient (and sums, not averages).
  mesh = _mesh()

  def naive(params, batch):
    return jax.grad(_loss)(params, batch)

  f = jax.jit(
    jax.shard_map(naive, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
  )
  params = jax.device_put(_params(), jax.NamedSharding(mesh, P()))
  batch = jax.device_put(_batches(1)[0], jax.NamedSharding(mesh, P("data")))
  got = training.collective_bytes(f.lower(params, batch).compile())
  assert got["all-reduce"] >= 4 * sum(_sizes())
  summed = f(params, batch)
  mean = jax.grad(_loss)(_params(), _batches(1)[0])
  _assert_trees_close(jax.tree.map(lambda g: g / W, summed), mean, 1e-5)


def test_two_dimensional_mesh_dense_within_sparse_across():
  mesh = _mesh(names=("node", "local"), shape=(2, 4))
  tx = optax.adam(1e-2)
  batches = _batches()
  dense, _ = _run(training.data_parallel_step(_loss, tx, _mesh()), batches)
  dp = training.data_parallel_step(
    _loss,
    tx,
    mesh,
    axis="node",
    dense_axis="local",
    exchange="all_gather",
    fraction=1.0,
  )
  state, _ = _run(dp, batches)
  _assert_trees_close(state.params, dense.params, 1e-5)
  assert jax.tree.leaves(state.residual)[0].shape[0] == 2  # One per node.
  sparse = training.data_parallel_step(
    _loss,
    tx,
    mesh,
    axis="node",
    dense_axis="local",
    exchange="all_gather",
    fraction=0.1,
  )
  state = sparse.init(_params())
  ops = training.collective_ops(sparse.lower(state, batches[0]).compile())
  groups = {(kind, group) for kind, _, group in ops}
  assert ("all-gather", 2) in groups  # Sparse across the 2 nodes.
  assert ("all-reduce", 4) in groups  # Dense within each node of 4.
  assert max(size for kind, size, group in ops if group == 2) < 4 * sum(
    _sizes()
  )


def test_grpo_preset_as_tx_and_aux():

  def loss_with_aux(params, batch):
    loss = _loss(params, batch)
    return loss, {"loss_copy": loss}

  dp = training.data_parallel_step(
    loss_with_aux,
    grpo_optax.grpo(1e-2),
    _mesh(),
    exchange="shared_support",
    fraction=0.3,
    has_aux=True,
  )
  state = dp.init(_params())
  losses, before = [], None
  for batch in _batches(2):
    old = jax.tree.leaves(state.params)[0]
    state, (loss, aux) = dp.step(state, batch)
    assert old.is_deleted()  # Donated.
    before = before or jax.tree.map(np.array, state.params)
    np.testing.assert_allclose(float(aux["loss_copy"]), float(loss), rtol=1e-6)
    losses.append(float(loss))
  assert all(np.isfinite(losses))
  assert any(
    not np.allclose(a, b)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.params))
  )


def test_sharded_jax_array_batch_is_accepted_as_is():
  dp = training.data_parallel_step(_loss, optax.sgd(0.1), _mesh())
  batch = dp.shard_batch(_batches(1)[0])
  assert batch[0].sharding.spec == P(("data",))
  assert dp.shard_batch(batch)[0] is batch[0]
  _, loss = dp.step(dp.init(_params()), batch)
  np.testing.assert_allclose(
    float(loss), float(_loss(_params(), _batches(1)[0])), rtol=1e-5
  )


@pytest.mark.parametrize("exchange", ["dense", "all_gather"])
def test_one_device_mesh_accepts_jax_array_batches(exchange):
  # jax.make_mesh((1,), ("data",)) on one device (the default CPU set-up):
  # a jax.Array on that device has a sharding *equivalent* to the mesh's,
  # and the Explicit mesh's shard_map still needs the spec P("data").
  mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
  kept = {} if exchange == "dense" else {"fraction": 1.0}
  dp = training.data_parallel_step(
    _loss, optax.sgd(0.1), mesh, exchange=exchange, **kept
  )
  x, y = _batches(1)[0]
  batch = (jnp.asarray(x), jnp.asarray(y))
  assert batch[0].sharding.is_equivalent_to(dp._batch_sharding, 2)  # pylint: disable=protected-access
  state, loss = dp.step(dp.init(_params()), batch)
  np.testing.assert_allclose(
    float(loss), float(_loss(_params(), (x, y))), rtol=1e-5
  )
  want = jax.tree.map(
    lambda p, g: p - 0.1 * g, _params(), jax.grad(_loss)(_params(), (x, y))
  )
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("exchange", ["dense", "shared_support"])
def test_donated_step_leaves_the_callers_params_alive(exchange):
  dp = training.data_parallel_step(
    _loss, optax.sgd(0.1), _mesh(), exchange=exchange
  )
  mine = jax.device_put(_params(), jax.NamedSharding(_mesh(), P()))
  state = dp.init(mine)
  for batch in _batches(2):
    state, _ = dp.step(state, batch)
  for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(_params())):
    assert not a.is_deleted()
    np.testing.assert_array_equal(a, b)
  assert not np.allclose(state.params["w1"], mine["w1"])


def test_sparse_pmean_in_a_users_own_shard_map():
  mesh = _mesh()
  g = np.random.default_rng(3).normal(size=(W, 40)).astype(np.float32)

  def local(g, r):
    mean, r = training.sparse_pmean(
      {"g": g[0]}, {"g": r[0]}, "data", exchange="all_gather", fraction=0.25
    )
    return mean["g"], r["g"][None]

  f = jax.jit(
    jax.shard_map(
      local,
      mesh=mesh,
      in_specs=(P("data"), P("data")),
      out_specs=(P(), P("data")),
    )
  )
  mean, r = f(g, np.zeros_like(g))
  # Reference: each row's 10 largest |g| entries, averaged over rows.
  want = np.zeros(40)
  for row in g:
    keep = np.argsort(-np.abs(row))[:10]
    want[keep] += row[keep] / W
  np.testing.assert_allclose(mean, want, atol=1e-6)
  np.testing.assert_allclose(np.asarray(r).mean(0) + mean, g.mean(0), atol=1e-6)


@pytest.mark.parametrize("exchange", ["all_gather", "shared_support"])
def test_sparse_pmean_odd_leaves(exchange):
  # An empty leaf, a scalar and a bf16 vector.
  mesh = _mesh()
  rng = np.random.default_rng(4)
  g = {
    "e": np.zeros((W, 0, 3), np.float32),
    "s": rng.normal(size=(W,)).astype(np.float32),
    "v": rng.normal(size=(W, 5)).astype(jnp.bfloat16),
  }

  def local(g):
    g = jax.tree.map(lambda x: x[0], g)
    r = jax.tree.map(jnp.zeros_like, g)
    mean, r = training.sparse_pmean(
      g, r, "data", exchange=exchange, fraction=1.0
    )
    return mean, jax.tree.map(lambda x: x[None], r)

  f = jax.jit(
    jax.shard_map(
      local, mesh=mesh, in_specs=P("data"), out_specs=(P(), P("data"))
    )
  )
  mean, r = f(g)
  assert mean["e"].shape == (0, 3) and mean["v"].dtype == jnp.bfloat16
  np.testing.assert_allclose(mean["s"], g["s"].mean(), rtol=1e-6)
  np.testing.assert_allclose(
    np.asarray(mean["v"], np.float32),
    np.asarray(g["v"], np.float32).mean(0),
    rtol=1e-2,
  )
  assert all(
    float(jnp.max(jnp.abs(x), initial=0)) == 0 for x in jax.tree.leaves(r)
  )


_ASYNC_HLO = """
HloModule m, num_partitions=8
%a.1 = (f32[4,10]{1,0}, f32[32,10]{1,0}) all-gather-start(f32[4,10]{1,0} %p), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}
%a.2 = f32[32,10]{1,0} all-gather-done((f32[4,10]{1,0}, f32[32,10]{1,0}) %a.1)
%r.1 = (f32[100]{0}, bf16[8]{0}) all-reduce-start(f32[100]{0} %x, bf16[8]{0} %y), replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
%r.2 = (f32[100]{0}, bf16[8]{0}) all-reduce-done((f32[100]{0}, bf16[8]{0}) %r.1)
ROOT %s = s32[5]{0} reduce-scatter(s32[40]{0} %z), replica_groups={}, dimensions={0}, to_apply=%add
%c = u8[16]{0} collective-permute(u8[16]{0} %q), source_target_pairs={{0,1},{1,0}}
"""


def test_collective_bytes_counts_async_pairs_once():
  got = training.collective_bytes(_ASYNC_HLO)
  assert got == {
    "all-reduce": 400 + 16,
    "all-gather": 32 * 10 * 4,
    "reduce-scatter": 20,
    "all-to-all": 0,
    "collective-permute": 16,
  }
  ops = training.collective_ops(_ASYNC_HLO)
  assert [(k, g) for k, _, g in ops] == [
    ("all-gather", 4),
    ("all-reduce", 2),
    ("reduce-scatter", 8),
    ("collective-permute", 8),
  ]
  traffic = training.ring_traffic(_ASYNC_HLO)
  assert traffic["all-gather"] == pytest.approx(3 / 4 * 1280)
  assert traffic["all-reduce"] == pytest.approx(2 * 1 / 2 * 416)
  assert traffic["reduce-scatter"] == pytest.approx(7 * 20)
  assert traffic["total"] == pytest.approx(960 + 416 + 140 + 16)


# One all-reduce of f32[256] (1,024 B) per line, in each form of
# replica_groups that XLA (jax 0.10.2) prints, on a 2x4 mesh of 8 devices.
_GROUP_FORMS = {
  "explicit lists": ("replica_groups={{0,4},{1,5},{2,6},{3,7}}", 2),
  "explicit lists of 4": ("replica_groups={{0,1,2,3},{4,5,6,7}}", 4),
  "empty list (all)": ("replica_groups={}", 8),
  "iota": ("replica_groups=[2,4]<=[8]", 4),
  "iota of pairs": ("replica_groups=[4,2]<=[8]", 2),
  "transposed iota": ("replica_groups=[4,2]<=[2,4]T(1,0)", 2),
  "transposed 3-d iota": ("replica_groups=[4,2]<=[2,2,2]T(0,2,1)", 2),
  "mesh": ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", 2),
  "mesh, other axis": (
    "replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}",
    4,
  ),
  "mesh, unit axis": (
    "replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}",
    2,
  ),
  "mesh, two axes": (
    "replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2] {'axis_0','axis_2'}",
    4,
  ),
  "mesh with device_ids": (
    "replica_groups=mesh['axis_0'=8,'axis_1'=1], "
    "device_ids=([2,4]T(1,0)) {'axis_0'}",
    8,
  ),
  "mesh, sub-axis": (
    "replica_groups=mesh['axis_0'=4,'axis_1'=2], "
    "device_ids=([2,2,2]T(0,2,1)) {'axis_0':(2)2}",
    2,
  ),
}


@pytest.mark.parametrize("form", list(_GROUP_FORMS))
def test_group_size_of_every_replica_groups_form(form):
  groups, size = _GROUP_FORMS[form]
  text = (
    "HloModule m, num_partitions=8\n"
    "ROOT %all-reduce = f32[256]{0} all-reduce(%bitcast), channel_id=1, "
    f"{groups}, use_global_device_ids=true, to_apply=%region_0.0.clone"
  )
  assert training.collective_ops(text) == [("all-reduce", 1024, size)]
  assert training.ring_traffic(text)["total"] == pytest.approx(
    2 * (size - 1) / size * 1024
  )
  assert hlo.group_size(groups, 8) == size


def test_group_size_of_an_async_mesh_form_all_gather():
  text = (
    "HloModule m, num_partitions=8\n"
    "%ag = (f32[32]{0}, f32[64]{0}) all-gather-start(%x), channel_id=2, "
    "replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, dimensions={0}\n"
    "%d = f32[64]{0} all-gather-done((f32[32]{0}, f32[64]{0}) %ag)"
  )
  assert training.collective_ops(text) == [("all-gather", 256, 2)]


def test_ring_traffic_of_a_compiled_all_reduce_over_one_axis_of_a_2x4_mesh():
  # XLA's partitioner prints this all-reduce in the mesh form,
  # replica_groups=mesh['axis_0'=2,...] {'axis_0'}: 2 devices per group, so
  # 2 (2-1)/2 * 1,024 B = 1,024 B sent (not 2 (8-1)/8 * 1,024 = 1,792 B).
  mesh = _mesh(8, ("data", "model"), (2, 4))
  x = jax.device_put(
    np.ones((2, 256), np.float32), jax.NamedSharding(mesh, P("data", None))
  )
  f = jax.jit(
    lambda x: jnp.sum(x, 0), out_shardings=jax.NamedSharding(mesh, P())
  )
  compiled = f.lower(x).compile()
  assert "replica_groups=mesh[" in compiled.as_text()
  assert training.collective_ops(compiled) == [("all-reduce", 1024, 2)]
  assert training.ring_traffic(compiled)["total"] == 1024
  # The same reduction written with shard_map (explicit lists).
  g = jax.jit(
    jax.shard_map(
      lambda x: jax.lax.psum(x, "data"),
      mesh=mesh,
      in_specs=P("data", None),
      out_specs=P(None, None),
    )
  )
  compiled = g.lower(x).compile()
  assert training.collective_ops(compiled) == [("all-reduce", 1024, 2)]
  np.testing.assert_array_equal(f(x), 2.0)


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    ({"exchange": "sparse"}, ValueError, "`exchange` must be one of"),
    ({"fraction": 0.0}, ValueError, r"`fraction` must be a float in \(0, 1\]"),
    ({"fraction": 1.5}, ValueError, r"`fraction` must be a float in \(0, 1\]"),
    ({"fraction": "x"}, TypeError, "`fraction` must be a float in"),
    ({"axis": "batch"}, ValueError, "`axis` must be one of the mesh's axes"),
    ({"dense_axis": "data"}, ValueError, "`dense_axis`"),
    ({"chunk_size": 0}, ValueError, "`chunk_size` must be an int >= 1"),
    ({"error_feedback": 1}, TypeError, "`error_feedback` must be a bool"),
  ],
)
def test_bad_arguments(kwargs, error, match):
  with pytest.raises(error, match=match):
    training.data_parallel_step(_loss, optax.sgd(0.1), _mesh(), **kwargs)


def test_bad_mesh_tx_batch_and_residual():
  with pytest.raises(TypeError, match="`mesh` must be a jax.sharding.Mesh"):
    training.data_parallel_step(_loss, optax.sgd(0.1), jax.devices())
  with pytest.raises(TypeError, match="`tx` must be an optax"):
    training.data_parallel_step(_loss, lambda g: g, _mesh())
  with pytest.raises(ValueError, match="extra axes"):
    training.data_parallel_step(
      _loss, optax.sgd(0.1), _mesh(names=("data", "model"), shape=(4, 2))
    )
  dp = training.data_parallel_step(_loss, optax.sgd(0.1), _mesh())
  x, y = _batches(1, size=12)[0]
  with pytest.raises(ValueError, match="divisible by the 8 devices"):
    dp.step(dp.init(_params()), (x, y))
  with pytest.raises(ValueError, match="`residual` must have the structure"):
    training.sparse_pmean({"a": jnp.ones(3)}, {"b": jnp.ones(3)}, "data")


@pytest.mark.slow
def test_two_processes_give_the_single_process_params(tmp_path):
  out = str(tmp_path / "params.npz")
  cmd = [
    sys.executable,
    "-m",
    "examples.launch_multiprocess",
    "--num-processes",
    "2",
    "--devices-per-process",
    "2",
    "--timeout",
    "150",
    "--",
    sys.executable,
    os.path.join(_ROOT, "tests", "dp_worker.py"),
    "--out",
    out,
    "--exchange",
    "all_gather",
  ]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  done = subprocess.run(
    cmd, cwd=_ROOT, env=env, capture_output=True, text=True, timeout=180
  )
  assert done.returncode == 0, done.stdout + done.stderr
  assert "[1] process 1 of 2: 4 devices, done" in done.stdout
  got = dict(np.load(out))
  want = dp_worker.train(_mesh(4), "all_gather")
  assert got.keys() == want.keys()
  for k in want:
    np.testing.assert_allclose(got[k], want[k], atol=1e-6, rtol=0)
  assert not np.allclose(want["w1"], dp_worker.init_params()["w1"])


#: DGC's recipe on the replicated shared support with bf16 values: every
#: piece of state (velocity, residual, count, support) crosses processes.
_DGC = {
  "support": "replicated",
  "values": "bfloat16",
  "momentum": 0.9,
  "clip_norm": 1.0,
  "warmup_steps": 1,
  "chunk_size": 16,
}
#: Steps of the DGC run: after the warm-up (5, 2, then 1 of the 20 chunks a
#: step, chosen in leaf order at first) every entry of every leaf has moved
#: by step 16 (w2, the last leaf, first moves at step 10).
_DGC_STEPS = 16


@pytest.mark.slow
def test_two_processes_with_dgc_give_the_eight_device_params(tmp_path):
  out = str(tmp_path / "params.npz")
  cmd = [
    sys.executable,
    "-m",
    "examples.launch_multiprocess",
    "--num-processes",
    "2",
    "--devices-per-process",
    "4",
    "--timeout",
    "150",
    "--",
    sys.executable,
    os.path.join(_ROOT, "tests", "dp_worker.py"),
    "--out",
    out,
    "--exchange",
    "shared_support",
    "--fraction",
    "0.05",
    "--steps",
    str(_DGC_STEPS),
    "--options",
    json.dumps(_DGC),
  ]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  done = subprocess.run(
    cmd, cwd=_ROOT, env=env, capture_output=True, text=True, timeout=180
  )
  assert done.returncode == 0, done.stdout + done.stderr
  assert "[1] process 1 of 2: 8 devices, done" in done.stdout
  got = dict(np.load(out))
  want = dp_worker.train(
    _mesh(8), "shared_support", 0.05, steps=_DGC_STEPS, **_DGC
  )
  assert got.keys() == want.keys() == {"w1", "b1", "w2"}
  init = dp_worker.init_params()
  for k in want:
    # Every entry of every leaf has moved, so the comparison covers them all.
    assert np.all(want[k] != init[k]), k
    np.testing.assert_allclose(got[k], want[k], atol=1e-6, rtol=0)
