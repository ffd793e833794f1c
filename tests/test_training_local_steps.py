"""Tests of grpo_optax.training.local_steps (DiLoCo rounds, participation).

Eight forced CPU devices (conftest). NumPy references for the rounds of a
linear least-squares model.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import grpo_optax
from grpo_optax import training

W, H, B, D = 8, 3, 32, 5


def _mesh(n=W):
  return Mesh(np.array(jax.devices()[:n]), ("data",))


def _loss(params, batch):
  x, y = batch
  return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def _params():
  rng = np.random.default_rng(0)
  return {
    "w": rng.normal(size=(D, 2)).astype(np.float32),
    "b": np.zeros(2, np.float32),
  }


def _batches(rounds, h=H, seed=1):
  rng = np.random.default_rng(seed)
  return [
    (
      rng.normal(size=(h, B, D)).astype(np.float32),
      rng.normal(size=(h, B, 2)).astype(np.float32),
    )
    for _ in range(rounds)
  ]


def _np_grads(p, x, y):
  r = 2 * (x @ p["w"] + p["b"] - y) / y.size
  return {"w": x.T @ r, "b": r.sum(0)}


def _np_rounds(batches, masks, lr, outer_lr, mu, w=W):
  """NumPy DiLoCo: inner SGD, outer Nesterov SGD, masked mean."""
  theta = {k: v.astype(np.float64) for k, v in _params().items()}
  trace = {k: np.zeros_like(v) for k, v in theta.items()}
  for (xs, ys), mask in zip(batches, masks):
    deltas = []
    for i in range(w):
      p = dict(theta)
      sl = slice(i * B // w, (i + 1) * B // w)
      for h in range(len(xs)):
        g = _np_grads(p, xs[h][sl], ys[h][sl])
        p = {k: p[k] - lr * g[k] for k in p}
      deltas.append({k: theta[k] - p[k] for k in p})
    if not mask.any():
      continue
    mean = {
      k: sum(d[k] * m for d, m in zip(deltas, mask)) / mask.sum() for k in theta
    }
    trace = {k: mean[k] + mu * trace[k] for k in theta}
    theta = {k: theta[k] - outer_lr * (mean[k] + mu * trace[k]) for k in theta}
  return theta


def _run(ls, batches, masks=None):
  state = ls.init(_params())
  losses = []
  for r, batch in enumerate(batches):
    state, loss = ls.round(state, batch, None if masks is None else masks[r])
    losses.append(float(loss))
  return state, losses


@pytest.mark.parametrize("masked", [False, True])
def test_rounds_match_numpy_diloco(masked):
  batches = _batches(3)
  rng = np.random.default_rng(2)
  masks = [
    np.ones(W, np.float32)
    if not masked
    else (rng.random(W) > 0.3).astype(np.float32)
    for _ in batches
  ]
  if masked:
    masks[1] = np.zeros(W, np.float32)  # A round nobody reports.
  ls = training.local_steps_step(_loss, optax.sgd(0.05), _mesh(), local_steps=H)
  state, _ = _run(ls, batches, masks)
  want = _np_rounds(batches, masks, 0.05, 0.7, 0.9)
  for k in want:
    np.testing.assert_allclose(
      np.asarray(state.params[k]), want[k], rtol=2e-5, atol=2e-6
    )
  assert int(state.round) == 3


def test_one_local_step_with_outer_sgd_one_is_data_parallel():
  batches = _batches(3, h=1)
  ls = training.local_steps_step(
    _loss, optax.sgd(0.1), _mesh(), local_steps=1, outer_tx=optax.sgd(1.0)
  )
  state, losses = _run(ls, batches)
  dp = training.data_parallel_step(_loss, optax.sgd(0.1), _mesh())
  dstate = dp.init(_params())
  dlosses = []
  for x, y in batches:
    dstate, loss = dp.step(dstate, (x[0], y[0]))
    dlosses.append(float(loss))
  for k in ("w", "b"):
    np.testing.assert_allclose(
      state.params[k], dstate.params[k], rtol=1e-6, atol=1e-7
    )
  np.testing.assert_allclose(losses, dlosses, rtol=1e-6)


def test_one_device_mesh_accepts_jax_array_batches_and_mask():
  # jax.make_mesh((1,), ("data",)) on one device (the default CPU set-up):
  # jax.Array inputs there have a sharding equivalent to the mesh's, and the
  # Explicit mesh's shard_map still needs their specs.
  mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
  ls = training.local_steps_step(_loss, optax.sgd(0.05), mesh, local_steps=H)
  x, y = _batches(1)[0]
  state = ls.init(_params())
  state, _ = ls.round(
    state, (jnp.asarray(x), jnp.asarray(y)), jnp.ones(1, jnp.float32)
  )
  want = _np_rounds([(x, y)], [np.ones(1, np.float32)], 0.05, 0.7, 0.9, w=1)
  for k in want:
    np.testing.assert_allclose(
      np.asarray(state.params[k]), want[k], rtol=2e-5, atol=2e-6
    )


def test_donated_round_leaves_the_callers_params_alive():
  ls = training.local_steps_step(_loss, optax.sgd(0.05), _mesh(), local_steps=H)
  mine = jax.device_put(_params(), jax.NamedSharding(_mesh(), P()))
  state = ls.init(mine)
  state, _ = ls.round(state, _batches(1)[0])
  for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(_params())):
    assert not a.is_deleted()
    np.testing.assert_array_equal(a, b)
  assert not np.allclose(state.params["w"], mine["w"])


def test_missing_replica_keeps_its_inner_state_and_rejoins():
  ls = training.local_steps_step(
    _loss, optax.adam(0.01), _mesh(), local_steps=H, donate=False
  )
  mask = np.ones(W, np.float32)
  mask[[2, 5]] = 0
  first, second = _batches(2)
  state1, _ = ls.round(ls.init(_params()), first)
  state2, _ = ls.round(state1, second, mask)
  counts = np.asarray(state2.inner_opt_state[0].count)
  want = np.full(W, 2 * H)
  want[[2, 5]] = H  # Their second round was lost.
  np.testing.assert_array_equal(counts, want)
  mu1 = np.asarray(state1.inner_opt_state[0].mu["w"])
  mu2 = np.asarray(state2.inner_opt_state[0].mu["w"])
  np.testing.assert_array_equal(mu2[[2, 5]], mu1[[2, 5]])
  assert not np.allclose(mu2[0], mu1[0])
  # Everyone starts the next round from the new outer params: a round in
  # which only replica 2 reports moves them by replica 2's own change.
  only = np.zeros(W, np.float32)
  only[2] = 1
  state3, _ = ls.round(state2, first, only)
  assert not np.allclose(state3.params["w"], state2.params["w"])


def test_round_nobody_reports_changes_nothing_outer():
  ls = training.local_steps_step(
    _loss, optax.sgd(0.1), _mesh(), local_steps=H, donate=False
  )
  state, _ = _run(ls, _batches(1))
  after, _ = ls.round(state, _batches(1, seed=5)[0], np.zeros(W))
  for a, b in zip(
    jax.tree.leaves(
      (after.params, after.outer_opt_state, after.inner_opt_state)
    ),
    jax.tree.leaves(
      (state.params, state.outer_opt_state, state.inner_opt_state)
    ),
  ):
    np.testing.assert_array_equal(a, b)
  assert int(after.round) == 2


def test_absent_replicas_keep_their_unsent_progress():
  # Error feedback: what the compressed exchange did not send stays with
  # the replica (its next start subtracts it). A replica that does not
  # report, or a round nobody reports, must not drop it.
  ls = training.local_steps_step(
    _loss,
    optax.sgd(0.1),
    _mesh(),
    local_steps=H,
    exchange="shared_support",
    fraction=0.3,
    chunk_size=2,
    donate=False,
  )
  first, second, third = _batches(3)
  state1, _ = ls.round(ls.init(_params()), first)
  unsent1 = jax.tree.map(np.asarray, state1.unsent)
  assert all(np.abs(x).max() > 0 for x in jax.tree.leaves(unsent1))
  # Nobody reports: params, outer state and every residual unchanged.
  state2, _ = ls.round(state1, second, np.zeros(W, np.float32))
  np.testing.assert_array_equal(state2.params["w"], state1.params["w"])
  for a, b in zip(jax.tree.leaves(state2.unsent), jax.tree.leaves(unsent1)):
    np.testing.assert_array_equal(a, b)
  # Replicas 2 and 5 miss a round: they keep their residuals; the others'
  # change.
  mask = np.ones(W, np.float32)
  mask[[2, 5]] = 0
  state3, _ = ls.round(state2, third, mask)
  for a, b in zip(jax.tree.leaves(state3.unsent), jax.tree.leaves(unsent1)):
    np.testing.assert_array_equal(np.asarray(a)[[2, 5]], b[[2, 5]])
    assert not np.allclose(np.asarray(a)[0], b[0])


@pytest.mark.parametrize(
  "exchange, quantize",
  [
    ("shared_support", None),
    ("all_gather", None),
    ("dense", "int8"),
    ("shared_support", "int8"),
  ],
)
def test_outer_step_keeps_what_it_did_not_send(exchange, quantize):
  """Mean sent + (1/K) sum unsent = the reporting replicas' mean change."""
  rng = np.random.default_rng(3)
  theta = {"w": rng.normal(size=(300,)).astype(np.float32)}
  local = {"w": rng.normal(size=(W, 300)).astype(np.float32)}
  mask = np.array([1, 1, 0, 1, 1, 1, 0, 1], np.float32)
  tx = optax.sgd(1.0)
  tx_state = tx.init(theta)

  def f(theta, local, m):
    local = jax.tree.map(lambda x: x[0], local)
    new, _, e, k = training.outer_step(
      theta,
      local,
      tx_state,
      "data",
      outer_tx=tx,
      participate=m[0],
      exchange=exchange,
      fraction=0.1,
      chunk_size=16,
      quantize=quantize,
    )
    return new, jax.tree.map(lambda x: x[None], e), k

  new, unsent, k = jax.jit(
    jax.shard_map(
      f,
      mesh=_mesh(),
      in_specs=(P(), P("data"), P("data")),
      out_specs=(P(), P("data"), P()),
    )
  )(theta, local, mask)
  assert float(k) == 6
  sent = theta["w"] - np.asarray(new["w"])
  unsent = np.asarray(unsent["w"])
  delta = theta["w"] - local["w"]
  np.testing.assert_allclose(
    sent + unsent.sum(0) / 6, delta[mask > 0].mean(0), rtol=1e-5, atol=1e-5
  )
  np.testing.assert_array_equal(unsent[mask == 0], 0)
  if quantize is None:
    assert np.count_nonzero(sent) < 0.5 * sent.size  # It was sparse.
  else:
    assert np.abs(unsent).max() > 0


def test_grpo_inner_and_shared_support_outer_train():
  ls = training.local_steps_step(
    _loss,
    grpo_optax.grpo(0.01),
    _mesh(),
    local_steps=H,
    exchange="shared_support",
    fraction=0.5,
    chunk_size=4,
  )
  state, losses = _run(ls, _batches(4, seed=1) * 2)
  assert all(np.isfinite(losses))
  assert losses[-1] < losses[0]
  assert state.unsent is not None
  assert np.asarray(state.unsent["w"]).shape == (W, D, 2)


def test_grpo_inner_with_masked_leaves_keeps_the_scan_carry_types():
  # min_size=0: every leaf is masked, so the sampled top-k's bisection loop
  # runs inside the round's shard_map (its carry must vary like the leaf).
  ls = training.local_steps_step(
    _loss, grpo_optax.grpo(0.01, min_size=0), _mesh(), local_steps=H
  )
  _, losses = _run(ls, _batches(2, seed=1))
  assert all(np.isfinite(losses))


def test_round_sends_the_exchange_once():
  """Dense round traffic = one dense DP step's; per step it is 1/H."""
  ls = training.local_steps_step(_loss, optax.sgd(0.1), _mesh(), local_steps=H)
  dp = training.data_parallel_step(_loss, optax.sgd(0.1), _mesh())
  state = ls.init(_params())
  ((x, y),) = _batches(1)
  compiled = ls.lower(state, (x, y)).compile()
  ring = training.ring_traffic(compiled)
  dense = training.ring_traffic(
    dp.lower(dp.init(_params()), (x[0], y[0])).compile()
  )
  params_bytes = 4 * (D * 2 + 2)
  np.testing.assert_allclose(
    dense["total"], 2 * (W - 1) / W * (params_bytes + 4), rtol=1e-6
  )  # Params and the loss.
  # The round adds the participation count (psum of a scalar).
  assert dense["total"] <= ring["total"] <= dense["total"] + 2 * 2 * 4
  assert training.round_traffic_per_step(compiled, H) == ring["total"] / H


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    ({"local_steps": 0}, ValueError, "`local_steps` must be an int >= 1"),
    ({"local_steps": 2.5}, ValueError, "`local_steps` must be an int >= 1"),
    ({"local_steps": True}, ValueError, "`local_steps` must be an int >= 1"),
    ({"local_steps": 2, "outer_tx": "sgd"}, TypeError, "`outer_tx` must be"),
    ({"local_steps": 2, "exchange": "ring"}, ValueError, "`exchange`"),
    ({"local_steps": 2, "fraction": 0.0}, ValueError, "`fraction`"),
    ({"local_steps": 2, "axis": "batch"}, ValueError, "single axis"),
    ({"local_steps": 2, "error_feedback": 1}, TypeError, "`error_feedback`"),
  ],
)
def test_bad_arguments(kwargs, error, match):
  with pytest.raises(error, match=match):
    training.local_steps_step(_loss, optax.sgd(0.1), _mesh(), **kwargs)


def test_bad_batches_and_participation():
  ls = training.local_steps_step(_loss, optax.sgd(0.1), _mesh(), local_steps=H)
  state = ls.init(_params())
  ((x, y),) = _batches(1)
  with pytest.raises(ValueError, match=r"shape \(local_steps=3, B, ...\)"):
    ls.round(state, (x[:2], y[:2]))
  with pytest.raises(ValueError, match="divisible by the 8 replicas"):
    ls.round(state, (x[:, :12], y[:, :12]))
  with pytest.raises(ValueError, match=r"`participation` must have the shape"):
    ls.round(state, (x, y), np.ones(4))
  with pytest.raises(ValueError, match="`learning_rate` must be > 0"):
    training.default_outer_optimizer(0.0)
  with pytest.raises(ValueError, match=r"`momentum` must be in \[0, 1\)"):
    training.default_outer_optimizer(0.7, 1.0)


def _exchange(tree, res, **kwargs):
  def f(x, r):
    x = jax.tree.map(lambda a: a[0], x)
    r = jax.tree.map(lambda a: a[0], r)
    mean, new = training.exchange_mean(x, r, "data", num_replicas=W, **kwargs)
    return mean, jax.tree.map(lambda a: a[None], new)

  return jax.jit(
    jax.shard_map(
      f, mesh=_mesh(), in_specs=(P("data"),) * 2, out_specs=(P(), P("data"))
    )
  )(tree, res)


@pytest.mark.parametrize("exchange", ["dense", "shared_support"])
def test_int8_exchange_matches_numpy_and_conserves(exchange):
  rng = np.random.default_rng(4)
  x = {
    "a": rng.normal(size=(W, 70)).astype(np.float32),
    "b": rng.normal(size=(W, 3)).astype(np.float32),
  }
  r = jax.tree.map(lambda v: 0.1 * v[::-1].copy(), x)
  mean, new = _exchange(
    x, r, exchange=exchange, fraction=0.5, chunk_size=8, quantize="int8"
  )
  levels = training.int8_levels(W)
  assert levels == 15
  for k, width in (("a", 8), ("b", 3)):
    acc = x[k] + r[k]
    m = -(-acc.shape[1] // width)
    c = np.pad(acc, ((0, 0), (0, m * width - acc.shape[1]))).reshape(
      W, m, width
    )
    keep = np.arange(m)
    if exchange == "shared_support":
      keep = np.sort(np.argsort(-(c**2).sum(axis=(0, 2)))[: -(-m // 2)])
    scale = np.abs(c[:, keep]).max(axis=(0, 2))[None, :, None]
    q = np.clip(np.round(c[:, keep] * levels / scale), -levels, levels)
    want = np.zeros((m, width))
    want[keep] = q.sum(0) * scale[0] / levels / W
    want = want.reshape(-1)[: acc.shape[1]]
    np.testing.assert_allclose(mean[k], want, rtol=1e-5, atol=1e-6)
    # Error feedback: the mean plus the mean residual is the exact mean.
    np.testing.assert_allclose(
      np.asarray(mean[k]) + np.asarray(new[k]).mean(0),
      acc.mean(0),
      rtol=1e-5,
      atol=1e-5,
    )
  # Rounding to 15 levels: the mean is close to, not equal to, the truth.
  err = np.abs(np.asarray(mean["a"]) - (x["a"] + r["a"]).mean(0))
  if exchange == "dense":
    assert 0 < err.max() < 0.1


def test_int8_round_sends_int8():
  ls = training.local_steps_step(
    _loss, optax.sgd(0.1), _mesh(), local_steps=H, quantize="int8", chunk_size=4
  )
  state = ls.init(_params())
  hlo = ls.lower(state, _batches(1)[0]).compile().as_text()
  ops = training.collective_ops(hlo)
  # The payload: w (10 entries) in 3 chunks of 4 (padded to 12) and b (2)
  # in one chunk: one all-reduce of 14 int8 values; the 4 chunk scales
  # (pmax, 16 bytes); the loss and the participation count (8 bytes).
  assert sorted(ops) == [
    ("all-reduce", 8, W),
    ("all-reduce", 14, W),
    ("all-reduce", 16, W),
  ]
  assert any(
    "s8[14]" in line and "all-reduce" in line for line in hlo.splitlines()
  )
  state, loss = ls.round(state, _batches(1)[0])
  assert np.isfinite(float(loss))


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"quantize": "int4"}, "`quantize` must be one of"),
    ({"quantize": "int8", "exchange": "all_gather"}, "needs `exchange`"),
  ],
)
def test_bad_quantize(kwargs, match):
  with pytest.raises(ValueError, match=match):
    training.local_steps_step(
      _loss, optax.sgd(0.1), _mesh(), local_steps=2, **kwargs
    )
  with pytest.raises(ValueError, match="at most 127 replicas"):
    training.int8_levels(128)
