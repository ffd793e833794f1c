"""The compressed exchanges and DGC's recipe against NumPy references.

Each test runs :func:`grpo_optax.training.sparse_pmean` inside ``shard_map``
over W = 8 forced CPU devices (conftest) on per-replica inputs, and compares
what it sends, the mean and the new state with a NumPy re-implementation of
the algorithm (Lin et al. 2018, Algorithm 1; Vogels et al. 2019, Algorithm 1).
"""

import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from grpo_optax import training
from grpo_optax.training import compression

W = 8
AXIS = "data"
_STATE_SPEC = training.ExchangeState(P(AXIS), P(AXIS), P(), P())


def _mesh():
  return Mesh(np.array(jax.devices()[:W]), (AXIS,))


def _sharded(*specs):
  """NamedShardings for ``jax.jit(in_shardings=...)`` of the specs."""
  mesh = _mesh()
  to = lambda s: None if s is None else NamedSharding(mesh, s)
  out = []
  for s in specs:
    if isinstance(s, training.ExchangeState):
      out.append(training.ExchangeState(*[to(x) for x in s]))
    else:
      out.append(to(s))
  return tuple(out)


@functools.cache
def _exchange_fn(with_residual, kw_items):
  kw = dict(kw_items)

  def f(g, r):
    g = jax.tree.map(lambda x: x[0], g)
    r = None if r is None else jax.tree.map(lambda x: x[0], r)
    if kw.get("exchange") == "powersgd":  # Q lives in the state.
      st = training.init_exchange(
        g, exchange="powersgd", rank=kw.get("rank", 1)
      )._replace(residual=r)
      mean, st = training.sparse_pmean(g, st, AXIS, **kw)
      r = st.residual
    else:
      mean, r = training.sparse_pmean(g, r, AXIS, **kw)
    return mean, None if r is None else jax.tree.map(lambda x: x[None], r)

  spec = P(AXIS) if with_residual else None
  fn = jax.shard_map(
    f, mesh=_mesh(), in_specs=(P(AXIS), spec), out_specs=(P(), spec)
  )
  return jax.jit(fn, in_shardings=_sharded(P(AXIS), spec))


def _exchange(grads_w, residual_w, **kw):
  """One exchange of per-replica inputs ``(W, ...)``: ``(mean, residual_w)``
  (one compiled program per set of options and shapes).
  """
  fn = _exchange_fn(residual_w is not None, tuple(sorted(kw.items())))
  mean, res = fn(grads_w, residual_w)
  return (
    jax.tree.map(np.asarray, mean),
    None if res is None else jax.tree.map(np.asarray, res),
  )


def _state_steps(grads_tw, state, **kw):
  """``T`` stateful exchanges; ``grads_tw`` a list of ``(W, n)`` arrays of one
  leaf. Returns the means and the final state (per-replica fields stacked).
  """

  def f(g, st):
    st = st._replace(
      residual=jax.tree.map(lambda x: x[0], st.residual),
      velocity=jax.tree.map(lambda x: x[0], st.velocity),
    )
    mean, st = training.sparse_pmean([g[0]], st, AXIS, **kw)
    return mean[0], st._replace(
      residual=jax.tree.map(lambda x: x[None], st.residual),
      velocity=jax.tree.map(lambda x: x[None], st.velocity),
    )

  step = jax.jit(
    jax.shard_map(
      f,
      mesh=_mesh(),
      in_specs=(P(AXIS), _STATE_SPEC),
      out_specs=(P(), _STATE_SPEC),
    ),
    in_shardings=_sharded(P(AXIS), _STATE_SPEC),
  )
  means = []
  for g in grads_tw:
    mean, state = step(jnp.asarray(g), state)
    means.append(np.asarray(mean))
  return means, state


def _stacked_state(n, **kw):
  st = training.init_exchange([jnp.zeros(n)], **kw)
  w = lambda t: jax.tree.map(lambda x: jnp.broadcast_to(x, (W,) + x.shape), t)
  return st._replace(residual=w(st.residual), velocity=w(st.velocity))


def _randn(*shape, seed=0):
  return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def _topk(x, k):
  return np.sort(np.argsort(-np.abs(x), kind="stable")[:k])


def _bf16(x):
  return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def _int8(v):
  scale = np.float32(np.max(np.abs(v)) / np.float32(127))
  return np.clip(np.round(v / scale), -127, 127).astype(np.float32) * scale


# -- which entries each exchange sends -----------------------------------------


@pytest.mark.parametrize("values", ["float32", "bfloat16", "int8"])
def test_all_gather_sends_each_replicas_top_k(values):
  a = _randn(W, 300)
  r = _randn(W, 300, seed=1) * 0.1
  mean, res = _exchange(
    {"a": a}, {"a": r}, exchange="all_gather", fraction=0.05, values=values
  )
  acc = a + r
  k = math.ceil(0.05 * 300)
  decode = {"float32": lambda v: v, "bfloat16": _bf16, "int8": _int8}[values]
  want_mean, want_res = np.zeros(300, np.float32), acc.copy()
  for i in range(W):
    idx = _topk(acc[i], k)
    sent = decode(acc[i, idx])
    want_mean[idx] += sent
    want_res[i, idx] -= sent
  np.testing.assert_allclose(mean["a"], want_mean / W, atol=1e-6, rtol=1e-6)
  np.testing.assert_allclose(res["a"], want_res, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("fraction,index", [(0.001, "uint16"), (0.2, "bitmap")])
def test_compact_indices_are_block_local_top_k(fraction, index):
  n = compression.BLOCK + 4000  # Two blocks; the second is zero-padded.
  a = _randn(W, n)
  layout = compression.Layout(n, fraction, "bfloat16", "compact")
  assert layout.index == index and layout.blocks == 2
  mean, res = _exchange(
    [a],
    [np.zeros_like(a)],
    exchange="all_gather",
    fraction=fraction,
    values="bfloat16",
    indices="compact",
  )
  kb = math.ceil(fraction * compression.BLOCK)
  want = np.zeros(n, np.float32)
  for i in range(W):
    for start in (0, compression.BLOCK):
      block = a[i, start : start + compression.BLOCK]
      idx = start + _topk(block, kb)
      want[idx] += _bf16(a[i, idx])
      np.testing.assert_allclose(
        res[0][i, idx], a[i, idx] - _bf16(a[i, idx]), atol=1e-7
      )
  np.testing.assert_allclose(mean[0], want / W, atol=1e-6)
  # Payload: 2-byte values + (2-byte indices | bitmap), one gather of bytes.
  bytes_per_replica = 2 * 2 * kb + (
    4 * kb if index == "uint16" else 2 * compression.BLOCK // 8
  )
  assert layout.nbytes == bytes_per_replica


def _chunk_ref(leaves, c):
  rows = []
  for x in leaves:  # (W, n) each.
    m = -(-x.shape[1] // c)
    rows.append(np.pad(x, ((0, 0), (0, m * c - x.shape[1]))).reshape(W, m, c))
  return np.concatenate(rows, axis=1)  # (W, M, c)


def _unchunk_ref(matrix, sizes, c):
  out, off = [], 0
  for n in sizes:
    m = -(-n // c)
    out.append(
      matrix[..., off : off + m, :].reshape(matrix.shape[:-2] + (-1,))[..., :n]
    )
    off += m
  return out


def test_shared_support_sends_the_chunks_of_largest_summed_norm():
  sizes, c, f = [200, 40, 130], 16, 0.2
  leaves = [_randn(W, n, seed=s) * (s + 1) for s, n in enumerate(sizes)]
  mean, res = _exchange(
    leaves,
    [np.zeros_like(x) for x in leaves],
    exchange="shared_support",
    fraction=f,
    chunk_size=c,
  )
  m = _chunk_ref(leaves, c)
  scores = np.sum(m**2, axis=(0, 2))
  kc = math.ceil(f * m.shape[1])
  chosen = np.argsort(-scores, kind="stable")[:kc]
  want = np.zeros(m.shape[1:], np.float32)
  want[chosen] = m[:, chosen].mean(0)
  keep = m.copy()
  keep[:, chosen] = 0
  for got, w, r, rr in zip(
    mean, _unchunk_ref(want, sizes, c), res, _unchunk_ref(keep, sizes, c)
  ):
    np.testing.assert_allclose(got, w, atol=1e-6)
    np.testing.assert_allclose(r, rr, atol=1e-6)
  # Not the smallest: the largest-norm chunk is sent, the smallest is not.
  assert np.argmax(scores) in chosen and np.argmin(scores) not in chosen


def test_replicated_support_follows_rate_times_age():
  n, c, f, steps = 256, 16, 0.125, 6
  grads = [
    _randn(W, n, seed=t) * np.linspace(0.1, 3, n, dtype=np.float32)
    for t in range(steps)
  ]
  state = _stacked_state(
    n, exchange="shared_support", support="replicated", chunk_size=c
  )
  means, state = _state_steps(
    grads,
    state,
    exchange="shared_support",
    fraction=f,
    chunk_size=c,
    support="replicated",
  )
  m_chunks, kc = n // c, math.ceil(f * n // c)
  rate, age = np.full(m_chunks, np.inf), np.ones(m_chunks)
  res = np.zeros((W, n), np.float32)
  for t, g in enumerate(grads):
    acc = (res + g).reshape(W, m_chunks, c)
    order = np.lexsort((np.arange(m_chunks), -(rate * age)))
    chosen = order[:kc]
    want = np.zeros((m_chunks, c), np.float32)
    want[chosen] = acc[:, chosen].mean(0)
    np.testing.assert_allclose(means[t], want.reshape(-1), atol=1e-5)
    acc[:, chosen] = 0
    res = acc.reshape(W, n)
    rate[chosen] = np.linalg.norm(want[chosen], axis=1) / age[chosen]
    age = np.where(np.isin(np.arange(m_chunks), chosen), 1, age + 1)
  np.testing.assert_allclose(np.asarray(state.support[0]), rate, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(state.support[1]), age)
  # The first 2 steps explore (every chunk once), then the largest go first.
  assert (means[0] != 0).sum() == kc * c


# -- DGC's techniques ------------------------------------------------------------


def _dgc_reference(
  grads, fraction, momentum=0.0, mask=True, clip=None, warmup_steps=0
):
  """Lin et al. 2018, Algorithm 1 (+ 3.2 clipping, 3.3 warm-up), all-gather
  top-k per replica.
  """
  n = grads[0].shape[1]
  u, v, means = np.zeros((W, n)), np.zeros((W, n)), []
  stages = compression.warmup_fractions(fraction)
  for t, g in enumerate(grads):
    g = g.astype(np.float64)
    if clip is not None:
      norm = np.linalg.norm(g, axis=1, keepdims=True)
      g = g * np.minimum(1.0, clip / math.sqrt(W) / norm)
    if momentum:
      u = momentum * u + g
      v = v + u
    else:
      v = v + g
    f = (
      stages[min(t // warmup_steps, len(stages) - 1)]
      if warmup_steps
      else fraction
    )
    k = compression.num_kept(n, f)
    sent = np.zeros((W, n), bool)
    for i in range(W):
      sent[i, _topk(v[i], k)] = True
    means.append((v * sent).sum(0) / W)
    v = v * ~sent
    if momentum and mask:
      u = u * ~sent
  return means, v, u


@pytest.mark.parametrize(
  "kw",
  [
    dict(momentum=0.9),  # correction
    dict(momentum=0.9, mask_momentum=False),  # no masking
    dict(clip_norm=0.5),  # local clipping
    dict(warmup_steps=2),  # warm-up
    dict(momentum=0.8, clip_norm=1.0, warmup_steps=1),  # all of them
  ],
  ids=["momentum", "no-mask", "clip", "warmup", "all"],
)
def test_dgc_technique_matches_numpy_reference(kw):
  n, f, steps = 512, 0.002, 7
  grads = [_randn(W, n, seed=10 + t) for t in range(steps)]
  state = _stacked_state(
    n, exchange="all_gather", momentum=kw.get("momentum", 0.0)
  )
  means, state = _state_steps(
    grads, state, exchange="all_gather", fraction=f, **kw
  )
  want, v, u = _dgc_reference(
    grads,
    f,
    kw.get("momentum", 0.0),
    kw.get("mask_momentum", True),
    kw.get("clip_norm"),
    kw.get("warmup_steps", 0),
  )
  for got, w in zip(means, want):
    np.testing.assert_allclose(got, w, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(state.residual[0]), v, atol=1e-5)
  if "momentum" in kw:
    np.testing.assert_allclose(np.asarray(state.velocity[0]), u, atol=1e-5)
  assert int(state.count) == steps
  if "warmup_steps" in kw:  # 25% of the entries at first, then fewer.
    assert (means[0] != 0).sum() > (means[-1] != 0).sum()


def test_warmup_fractions_are_dgcs_schedule():
  assert compression.warmup_fractions(0.001) == (
    0.25,
    0.0625,
    0.015625,
    0.00390625,
    0.001,
  )
  assert compression.warmup_fractions(0.3) == (0.3,)


# -- error feedback and PowerSGD ---------------------------------------------------


@pytest.mark.parametrize(
  "kw,atol",
  [
    (dict(exchange="all_gather", values="bfloat16", indices="compact"), 1e-5),
    (dict(exchange="all_gather", values="int8", indices="compact"), 1e-5),
    (dict(exchange="all_gather", values="float32", indices="int32"), 1e-5),
    (dict(exchange="shared_support", values="float32"), 1e-5),
    # A bfloat16 all-reduce rounds the sum (not fed back): 2^-8 relative.
    (dict(exchange="shared_support", values="bfloat16"), 3e-2),
    (dict(exchange="powersgd", rank=1), 1e-5),
    # The matrices' error is fed back exactly (every replica subtracts the
    # same approximation); the 1-D leaf's bfloat16 sum rounds.
    (
      dict(exchange="powersgd", rank=2, values="bfloat16"),
      {"m": 1e-5, "v": 3e-2},
    ),
  ],
  ids=[
    "ag-bf16-compact",
    "ag-int8-compact",
    "ag-fp32",
    "ss-fp32",
    "ss-bf16",
    "powersgd",
    "powersgd-bf16",
  ],
)
def test_error_feedback_loses_nothing(kw, atol):
  grads = [
    {"m": _randn(W, 12, 10, seed=t), "v": _randn(W, 10, seed=50 + t)}
    for t in range(4)
  ]
  res = {
    "m": np.zeros((W, 12, 10), np.float32),
    "v": np.zeros((W, 10), np.float32),
  }
  applied = {"m": 0.0, "v": 0.0}
  # fraction and chunk_size where the compressor takes them.
  shared = {
    k: v
    for k, v in dict(fraction=0.1, chunk_size=8).items()
    if kw["exchange"] in training.compressors.takers(k)
  }
  for g in grads:
    mean, res = _exchange(g, res, **shared, **kw)
    applied = {k: applied[k] + mean[k] for k in applied}
  for k in applied:
    want = sum(g[k].mean(0) for g in grads)
    tol = atol[k] if isinstance(atol, dict) else atol
    np.testing.assert_allclose(applied[k] + res[k].mean(0), want, atol=tol)
    assert np.abs(res[k]).sum() > 0 or kw["exchange"] == "powersgd"


def test_powersgd_full_rank_equals_dense():
  g = {
    "m": _randn(W, 6, 5),
    "t": _randn(W, 2, 3, 4, seed=1),
    "v": _randn(W, 7, seed=2),
  }
  mean, res = _exchange(
    g, jax.tree.map(np.zeros_like, g), exchange="powersgd", rank=5
  )
  for k in g:
    np.testing.assert_allclose(mean[k], g[k].mean(0), atol=2e-5)
    # At full rank the factors are as large as the leaf: every leaf is
    # averaged densely (nothing left behind).
    np.testing.assert_allclose(res[k], 0 * g[k], atol=2e-5)


def test_powersgd_rank_one_matches_numpy_and_warm_starts():
  n, m, steps = 9, 7, 3
  grads = [_randn(W, n * m, seed=t) for t in range(steps)]
  state = training.init_exchange([jnp.zeros((n, m))], exchange="powersgd")
  q = np.asarray(state.q[0])
  w = lambda t: jax.tree.map(lambda x: jnp.broadcast_to(x, (W,) + x.shape), t)
  state = state._replace(residual=w(state.residual))

  def f(g, st):
    st = st._replace(residual=jax.tree.map(lambda x: x[0], st.residual))
    mean, st = training.sparse_pmean([g[0]], st, AXIS, exchange="powersgd")
    return mean[0], st._replace(
      residual=jax.tree.map(lambda x: x[None], st.residual)
    )

  step = jax.jit(
    jax.shard_map(
      f,
      mesh=_mesh(),
      in_specs=(P(AXIS), _STATE_SPEC),
      out_specs=(P(), _STATE_SPEC),
    ),
    in_shardings=_sharded(P(AXIS), _STATE_SPEC),
  )
  res = np.zeros((W, n, m))
  for g in grads:
    mean, state = step(jnp.asarray(g.reshape(W, n, m)), state)
    mats = g.reshape(W, n, m) + res
    p = np.mean(mats @ q, axis=0)
    p_hat = np.linalg.qr(p)[0]
    q = np.mean(np.swapaxes(mats, 1, 2) @ p_hat, axis=0)
    approx = p_hat @ q.T
    np.testing.assert_allclose(np.asarray(mean), approx, atol=1e-4)
    res = mats - approx
  np.testing.assert_allclose(
    np.abs(np.asarray(state.q[0])), np.abs(q), atol=1e-4
  )


# -- the compiled step's collectives ---------------------------------------------


def _big_params():
  rng = np.random.default_rng(0)
  return {
    "w1": (rng.normal(size=(16, 512)) / 4).astype(np.float32),
    "b1": np.zeros(512, np.float32),
    "w2": (rng.normal(size=(512, 4)) / 20).astype(np.float32),
  }


def _big_loss(params, batch):
  x, y = batch
  return jnp.mean(
    (jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] - y) ** 2
  )


@pytest.mark.slow
@pytest.mark.parametrize(
  "kw",
  [
    dict(
      exchange="all_gather", fraction=0.01, values="bfloat16", indices="compact"
    ),
    dict(
      exchange="shared_support",
      fraction=0.05,
      support="replicated",
      values="bfloat16",
    ),
    dict(exchange="powersgd", rank=1),
  ],
  ids=["all_gather", "shared_support", "powersgd"],
)
def test_compiled_step_sends_only_its_payload(kw):
  dp = training.data_parallel_step(_big_loss, optax.sgd(0.1), _mesh(), **kw)
  batch = (
    jax.ShapeDtypeStruct((32, 16), jnp.float32),
    jax.ShapeDtypeStruct((32, 4), jnp.float32),
  )
  compiled = dp.lower(dp.init(_big_params()), batch).compile(
    compiler_options={"xla_backend_optimization_level": 0}
  )
  ops = training.collective_ops(compiled)
  sizes = {k: v.size for k, v in _big_params().items()}
  if kw["exchange"] == "all_gather":
    payload = W * sum(
      compression.Layout(s, 0.01, "bfloat16", "compact").nbytes
      for s in sizes.values()
    )
    assert ("all-gather", payload, W) in ops
  elif kw["exchange"] == "shared_support":
    # bf16 as uint16: an all-to-all of the shares, an all-gather of the sums.
    rows = sum(compression.chunk_rows(list(sizes.values()), 64))
    payload = 2 * 64 * compression.num_kept(rows, 0.05)
    assert ("all-to-all", payload, W) in ops
    assert ("all-gather", payload, W) in ops
  else:  # P's (with the dense bias), then Q's, float32.
    payload = 4 * (16 * 1 + 512 * 1 + 512)
    assert ("all-reduce", payload, W) in ops
    q_bytes = next(
      b for k, b, _ in ops if b in (4 * (512 + 4), 4 * (512 + 4) + 4)
    )  # +loss
    assert q_bytes and ("all-reduce", q_bytes, W) in ops
  others = [op for op in ops if op[1] != payload]
  if kw["exchange"] == "powersgd":
    others.remove(("all-reduce", q_bytes, W))
  assert len(others) < len(ops)
  assert all(size <= 1024 for _, size, _ in others), ops
  bound = 0.2 if kw["exchange"] == "powersgd" else 0.1  # Bias sent dense.
  assert sum(s for _, s, _ in ops) < bound * 4 * sum(sizes.values())


@pytest.mark.slow
def test_dgc_step_trains_and_keeps_the_state_per_replica():
  rng = np.random.default_rng(3)
  batch = (
    rng.normal(size=(32, 16)).astype(np.float32),
    rng.normal(size=(32, 4)).astype(np.float32),
  )
  dp = training.data_parallel_step(
    _big_loss,
    optax.sgd(0.05),
    _mesh(),
    exchange="shared_support",
    fraction=0.05,
    support="replicated",
    values="bfloat16",
    momentum=0.9,
    clip_norm=1.0,
    warmup_steps=2,
  )
  state = dp.init(_big_params())
  losses = []
  for _ in range(8):
    state, loss = dp.step(state, batch)
    losses.append(float(loss))
  assert losses[-1] < losses[0]
  assert jax.tree.leaves(state.exchange.velocity)[0].shape[0] == W
  assert int(state.exchange.count) == 8


# -- bad arguments -----------------------------------------------------------------


@pytest.mark.parametrize(
  "kw,match",
  [
    (dict(values="int4"), "`values` must be one of"),
    (dict(indices="int16"), "`indices` must be one of"),
    (dict(support="random"), "`support` must be one of"),
    (dict(exchange="shared_support", values="int8"), "needs `exchange='all_"),
    (dict(exchange="dense", values="bfloat16"), "dense exchange sends"),
    (dict(exchange="powersgd", warmup_steps=3), "needs a sparse exchange"),
    (dict(rank=0), "`rank` must be an int >= 1"),
    (dict(momentum=1.0), r"`momentum` must be a float in \[0, 1\)"),
    (dict(clip_norm=0.0), "`clip_norm` must be None or a float > 0"),
    (dict(warmup_steps=-1), "`warmup_steps` must be an int >= 0"),
    (dict(momentum=0.9), "keep state: pass an ExchangeState"),
  ],
)
def test_bad_exchange_arguments(kw, match):
  with pytest.raises(ValueError, match=match):
    training.sparse_pmean([jnp.ones(4)], [jnp.zeros(4)], AXIS, **kw)


def test_powersgd_needs_its_state():
  # No cold start from a fixed Q: PowerSGD's Q is warm-started from the
  # ExchangeState, so a bare residual (or None) is refused.
  for residual in ([jnp.zeros((8, 6))], None):
    with pytest.raises(ValueError, match="keep state: pass an ExchangeState"):
      training.sparse_pmean(
        [jnp.ones((8, 6))], residual, AXIS, exchange="powersgd"
      )


def test_powersgd_sends_a_leaf_densely_unless_its_factors_are_smaller():
  # (2, 3) at rank 2: P (2x2) and Q (3x2) are 10 floats for a 6-float leaf.
  assert compression.powersgd_shape((2, 3), 2) is None
  assert compression.powersgd_shape((2, 3), 1) == (2, 3, 1)  # 5 < 6
  assert compression.powersgd_shape((4, 4), 2) is None  # 16 >= 16
  assert compression.powersgd_shape((12, 10), 2) == (12, 10, 2)
  params = {"a": jnp.zeros((2, 3)), "m": jnp.zeros((12, 10))}
  st = training.init_exchange(params, exchange="powersgd", rank=2)
  assert st.q[0] is None and st.q[1].shape == (10, 2)
  g = {"a": _randn(W, 2, 3), "m": _randn(W, 12, 10, seed=1)}
  mean, res = _exchange(
    g, jax.tree.map(np.zeros_like, g), exchange="powersgd", rank=2
  )
  np.testing.assert_allclose(mean["a"], g["a"].mean(0), atol=1e-6)
  np.testing.assert_array_equal(res["a"], 0 * g["a"])
  # The compiled exchange sends the 6 floats of "a" beside P (12x2), then
  # Q (10x2): 120 + 80 bytes in two all-reduces.
  st = training.init_exchange(params, exchange="powersgd", rank=2)

  def f(g, st):
    st = st._replace(residual=jax.tree.map(lambda x: x[0], st.residual))
    g = jax.tree.map(lambda x: x[0], g)
    return training.sparse_pmean(g, st, AXIS, exchange="powersgd", rank=2)[0]

  fn = jax.jit(
    jax.shard_map(
      f,
      mesh=_mesh(),
      in_specs=(P(AXIS), training.ExchangeState(P(AXIS), None, P(), P())),
      out_specs=P(),
    )
  )
  w = lambda t: jax.tree.map(lambda x: jnp.broadcast_to(x, (W,) + x.shape), t)
  compiled = fn.lower(g, st._replace(residual=w(st.residual))).compile()
  ops = training.collective_ops(compiled)
  assert sorted(b for k, b, _ in ops if k == "all-reduce") == [80, 120], ops


def test_state_must_match_the_options():
  st = training.init_exchange([jnp.zeros(4)], exchange="all_gather")
  with pytest.raises(ValueError, match="velocity must be present"):
    training.sparse_pmean([jnp.ones(4)], st, AXIS, momentum=0.5)
  with pytest.raises(ValueError, match="compressor state .* must be present"):
    training.sparse_pmean([jnp.ones(4)], st, AXIS, exchange="powersgd")
