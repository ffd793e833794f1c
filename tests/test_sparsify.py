"""top_k_mask and ema_threshold_mask: exactness, error feedback, sampling, bad input."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import grpo_optax


def _tree(seed=0, shapes=((50, 20), (37,), (3, 4, 5))):
  rng = np.random.default_rng(seed)
  return {
    f"l{i}": jnp.asarray(rng.normal(size=s), jnp.float32)
    for i, s in enumerate(shapes)
  }


@pytest.mark.parametrize("fraction", [0.01, 0.3, 0.5, 1.0])
def test_exact_topk_keeps_exactly_k_largest(fraction):
  tx = grpo_optax.top_k_mask(fraction=fraction, error_feedback=False)
  g = _tree()
  out, state = jax.jit(tx.update)(g, tx.init(g))
  for name, leaf in g.items():
    x = np.asarray(leaf).ravel()
    kept = np.asarray(out[name]).ravel() != 0
    k = math.ceil(fraction * x.size)
    assert kept.sum() == k
    # the kept ones are the k largest magnitudes
    assert np.min(np.abs(x[kept])) >= np.max(np.abs(x[~kept]), initial=0.0)
    np.testing.assert_array_equal(np.asarray(out[name]).ravel()[kept], x[kept])
  total = sum(x.size for x in g.values())
  expected = sum(math.ceil(fraction * x.size) for x in g.values()) / total
  np.testing.assert_allclose(state.kept_fraction, expected, rtol=1e-6)


def test_exact_topk_ties_keep_exactly_k():
  tx = grpo_optax.top_k_mask(fraction=0.5, error_feedback=False)
  g = {"w": jnp.ones(10)}
  out, _ = tx.update(g, tx.init(g))
  assert int(jnp.sum(out["w"] != 0)) == 5


@pytest.mark.parametrize(
  "make",
  [
    lambda: grpo_optax.top_k_mask(0.2),
    lambda: grpo_optax.top_k_mask(0.2, method="sampled"),
    lambda: grpo_optax.top_k_mask(0.2, frequency_weight=0.5),
    lambda: grpo_optax.top_k_mask(0.2, warmup_steps=4),
    lambda: grpo_optax.ema_threshold_mask(every=3),
  ],
)
def test_error_feedback_loses_nothing(make):
  tx = make()
  params = _tree()
  state = tx.init(params)
  update = jax.jit(tx.update)
  sum_g = jax.tree.map(jnp.zeros_like, params)
  sum_out = jax.tree.map(jnp.zeros_like, params)
  for i in range(20):
    g = _tree(seed=i + 1)
    out, state = update(g, state)
    sum_g = jax.tree.map(jnp.add, sum_g, g)
    sum_out = jax.tree.map(jnp.add, sum_out, out)
  recovered = jax.tree.map(jnp.add, sum_out, state.residual)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, atol=1e-4), recovered, sum_g
  )
  # the masks did drop something at every step, so the residual is not empty
  assert float(optax.tree.norm(state.residual)) > 0


def test_exact_topk_residual_drains_after_zeros():
  tx = grpo_optax.top_k_mask(0.25)
  g = _tree()
  update = jax.jit(tx.update)  # one compilation: g and zeros are alike
  out, state = update(g, tx.init(g))
  zeros = jax.tree.map(jnp.zeros_like, g)
  for _ in range(4):  # ceil(1 / 0.25) steps flush every entry
    out, state = update(zeros, state)
  assert float(optax.tree.norm(state.residual)) == 0.0
  out, state = update(zeros, state)
  assert float(optax.tree.norm(out)) == 0.0


def test_threshold_residual_drains_after_zeros():
  tx = grpo_optax.ema_threshold_mask(alpha=0.7, every=1)
  g = _tree()
  update = jax.jit(tx.update)  # one compilation: g and zeros are alike
  _, state = update(g, tx.init(g))
  start = float(optax.tree.norm(state.residual))
  zeros = jax.tree.map(jnp.zeros_like, g)
  for _ in range(60):
    _, state = update(zeros, state)
  assert float(optax.tree.norm(state.residual)) < 1e-3 * start


def test_no_error_feedback_has_no_residual_state():
  tx = grpo_optax.top_k_mask(0.3, error_feedback=False)
  assert tx.init(_tree()).residual is None
  tx = grpo_optax.ema_threshold_mask(error_feedback=False)
  assert tx.init(_tree()).residual is None


@pytest.mark.parametrize("dist", ["gaussian", "student_t3"])
@pytest.mark.parametrize("fraction", [0.1, 0.3])
def test_sampled_topk_keeps_close_to_target(dist, fraction):
  """Kept fractions within the sampled quantile's error, exact when unsampled.

  The threshold is the ``fraction`` quantile of a random sample of ``m``
  entries, so the kept share of the leaf is the share above a sample order
  statistic: Beta-distributed whatever the scores' distribution, with
  standard deviation ``sigma = sqrt(f (1 - f) / m)``. Measured over 200 steps
  (n = 400,000, m = 4,000, both distributions, both fractions): std 0.93-1.1
  sigma, largest deviation 3.1 sigma. Asked for 0.87 f, it would sit 2.7
  sigma (f = 0.1) to 5.4 sigma (f = 0.3) away per step, and its mean over 8
  steps 7.7 to 15 standard errors away (the bound is 3).
  """
  rng = np.random.default_rng(7)
  n, steps = 400_000, 8
  x = rng.normal(size=n) if dist == "gaussian" else rng.standard_t(3, size=n)
  g = {
    "w": jnp.asarray(x, jnp.float32),
    "small": jnp.asarray(rng.normal(size=300), jnp.float32),
  }
  m = 4_000  # 1% of n (the floor is 1,024)
  sigma = math.sqrt(fraction * (1 - fraction) / m)
  tx = grpo_optax.top_k_mask(
    fraction, method="sampled", error_feedback=False, seed=3
  )
  state = tx.init(g)
  update = jax.jit(tx.update)
  kept_w = []
  for _ in range(steps):  # fresh samples each step
    out, state = update(g, state)
    kept_w.append(float(jnp.mean(out["w"] != 0)))
    assert abs(kept_w[-1] - fraction) <= 4 * sigma, kept_w
    # A leaf of at most 1,024 entries is its own sample: exactly k kept.
    assert int(jnp.sum(out["small"] != 0)) == math.ceil(fraction * 300)
    actual = sum(float(jnp.sum(out[k] != 0)) for k in g) / (n + 300)
    # The diagnostic is estimated on a strided sample of 4,096 per leaf.
    diag_sigma = math.sqrt(fraction * (1 - fraction) / 4096)
    assert abs(float(state.kept_fraction) - actual) <= 4 * diag_sigma
    # it keeps the largest: everything kept is above everything dropped
    w = np.abs(np.asarray(g["w"]))
    kept_mask = np.asarray(out["w"]) != 0
    assert w[kept_mask].min() >= w[~kept_mask].max()
  assert abs(np.mean(kept_w) - fraction) <= 3 * sigma / math.sqrt(steps), kept_w


def test_sampled_topk_zeros_carry_nothing():
  """A leaf that is mostly zeros: the threshold falls to 0, zeros stay out.

  2,000 entries (sampled for the threshold, whole for the diagnostic), 1,200
  of them exactly zero, 70% asked: every non-zero entry is kept, and the
  kept-fraction diagnostic counts only them (0.4, not 1.0).
  """
  rng = np.random.default_rng(0)
  x = np.zeros(2000, np.float32)
  x[rng.permutation(2000)[:800]] = rng.normal(size=800).astype(np.float32)
  g = {"w": jnp.asarray(x)}
  tx = grpo_optax.top_k_mask(0.7, method="sampled")
  out, state = jax.jit(tx.update)(g, tx.init(g))
  np.testing.assert_array_equal(out["w"], x)
  np.testing.assert_array_equal(state.residual["w"], np.zeros(2000))
  # With error feedback the state keeps no estimate: metrics() reads the
  # kept fraction exactly from the accumulator and its threshold.
  assert state.kept_fraction is None
  np.testing.assert_allclose(
    grpo_optax.metrics(state)["topk/kept_fraction"], 0.4, rtol=1e-6
  )


def test_sampled_positions_move_every_step():
  # 256 x 256: shard-aligned strides of 8 on both axes give 1,024 entries.
  x = jnp.arange(256 * 256, dtype=jnp.float32).reshape(256, 256)
  samples = [
    grpo_optax.sparsify.random_samples([x], 0, jnp.asarray(t))[0]
    for t in range(4)
  ]
  # A grid of ~1,024 entries, taken at other offsets at every step, and
  # always a grid (constant strides along each axis).
  assert 512 <= samples[0].size <= 2048
  assert len({tuple(np.asarray(s).ravel()[:3]) for s in samples}) > 1
  for s in samples:
    rows = np.diff(np.asarray(s) // 256, axis=0)
    assert np.all(rows == rows[0, 0])
  # Another seed, other positions.
  other = grpo_optax.sparsify.random_samples([x], 1, jnp.asarray(0))[0]
  assert not np.array_equal(other, samples[0])


def test_warmup_ramps_from_dense_to_fraction():
  tx = grpo_optax.top_k_mask(0.1, warmup_steps=4, error_feedback=False)
  g = {
    "w": jnp.asarray(np.random.default_rng(0).normal(size=1000), jnp.float32)
  }
  state = tx.init(g)
  kept = []
  for _ in range(6):
    out, state = jax.jit(tx.update)(g, state)
    kept.append(int(jnp.sum(out["w"] != 0)))
  expected = [math.ceil(0.1 ** (min(t, 4) / 4) * 1000) for t in range(6)]
  assert kept == expected
  assert kept[0] == 1000 and kept[-1] == 100


def test_min_size_passes_small_leaves_dense():
  tx = grpo_optax.top_k_mask(0.1, min_size=100)
  g = {"big": jnp.arange(1.0, 1001.0), "small": jnp.arange(1.0, 51.0)}
  out, _ = tx.update(g, tx.init(g))
  np.testing.assert_array_equal(out["small"], g["small"])
  assert int(jnp.sum(out["big"] != 0)) == 100
  # a leaf of exactly min_size entries is sparsified
  tx = grpo_optax.top_k_mask(0.1, min_size=50)
  out, _ = tx.update(g, tx.init(g))
  assert int(jnp.sum(out["small"] != 0)) == 5


def test_sampled_topk_warmup_first_step_is_dense():
  """At t = 0 the warm-up keeps everything, also below the sample's minimum.

  A leaf of 200,000 entries is sampled (about 2,000 of them): keeping
  "everything above the sample's minimum" would drop the entries below it.
  """
  g = {
    "w": jnp.asarray(np.random.default_rng(0).normal(size=200_000), jnp.float32)
  }
  tx = grpo_optax.top_k_mask(0.1, method="sampled", warmup_steps=3)
  out, state = jax.jit(tx.update)(g, tx.init(g))
  np.testing.assert_array_equal(out["w"], g["w"])
  np.testing.assert_array_equal(state.residual["w"], np.zeros(200_000))


def test_sampled_topk_warmup_ramps_from_dense_to_fraction():
  """The sampled top-k (grpo's default, the fused core's mask) ramps as the
  exact one does: a leaf of 1,000 entries is its own sample, so the kept
  counts are exact.
  """
  tx = grpo_optax.top_k_mask(
    0.1, method="sampled", warmup_steps=4, error_feedback=False
  )
  g = {
    "w": jnp.asarray(np.random.default_rng(0).normal(size=1000), jnp.float32)
  }
  state = tx.init(g)
  update = jax.jit(tx.update)
  kept = []
  for _ in range(6):
    out, state = update(g, state)
    kept.append(int(jnp.sum(out["w"] != 0)))
  expected = [math.ceil(0.1 ** (min(t, 4) / 4) * 1000) for t in range(6)]
  assert kept == expected


def test_sampled_topk_min_size_passes_small_leaves_dense():
  g = {"big": jnp.arange(1.0, 1001.0), "small": jnp.arange(1.0, 51.0)}
  tx = grpo_optax.top_k_mask(0.1, method="sampled", min_size=100)
  out, _ = tx.update(g, tx.init(g))
  np.testing.assert_array_equal(out["small"], g["small"])
  assert int(jnp.sum(out["big"] != 0)) == 100
  # a leaf of exactly min_size entries is sparsified
  tx = grpo_optax.top_k_mask(0.1, method="sampled", min_size=50)
  out, _ = tx.update(g, tx.init(g))
  assert int(jnp.sum(out["small"] != 0)) == 5


def test_ema_threshold_min_size_passes_small_leaves_dense():
  g = {"big": jnp.arange(1.0, 1001.0), "small": jnp.arange(1.0, 51.0)}
  tx = grpo_optax.ema_threshold_mask(min_size=100)
  out, state = tx.update(g, tx.init(g))
  np.testing.assert_array_equal(out["small"], g["small"])
  np.testing.assert_array_equal(state.residual["small"], np.zeros(50))
  # The big leaf keeps |a| >= mean|a| (500.5): entries 501..1000.
  assert int(jnp.sum(out["big"] != 0)) == 500
  # A leaf of exactly min_size entries is masked like the others.
  tx = grpo_optax.ema_threshold_mask(min_size=50)
  out, _ = tx.update(g, tx.init(g))
  assert int(jnp.sum(out["small"] != 0)) == 25


def test_frequency_weight_rotates_kept_entries():
  """With b > 0, entries kept often yield to entries kept rarely."""
  g = {"w": jnp.asarray([1.0, 0.99, 0.98, 0.97])}
  plain = grpo_optax.top_k_mask(0.5, error_feedback=False)
  freq = grpo_optax.top_k_mask(0.5, error_feedback=False, frequency_weight=0.5)
  s_plain, s_freq = plain.init(g), freq.init(g)
  kept_plain, kept_freq = set(), set()
  for _ in range(4):
    o1, s_plain = plain.update(g, s_plain)
    o2, s_freq = freq.update(g, s_freq)
    kept_plain |= set(np.flatnonzero(np.asarray(o1["w"])))
    kept_freq |= set(np.flatnonzero(np.asarray(o2["w"])))
  assert kept_plain == {0, 1}
  assert kept_freq == {0, 1, 2, 3}
  assert s_freq.frequency["w"].dtype == jnp.float32


def test_frequency_weight_matches_numpy_reference():
  """Score = (1-b)|a|/mean|a| - b f, f = EMA of the kept indicator (exact top-k)."""
  b, d, fraction = 0.4, 0.7, 0.3
  rng = np.random.default_rng(5)
  grads = [{"w": rng.normal(size=20).astype(np.float32)} for _ in range(8)]
  tx = grpo_optax.top_k_mask(fraction, frequency_weight=b, frequency_decay=d)
  state = tx.init(grads[0])
  update = jax.jit(tx.update)
  r = np.zeros(20)
  f = np.zeros(20)
  k = math.ceil(fraction * 20)
  for g in grads:
    out, state = update(g, state)
    a = g["w"] + r
    score = (1 - b) * np.abs(a) / np.abs(a).mean() - b * f
    keep = np.zeros(20, bool)
    keep[np.argsort(-score, kind="stable")[:k]] = True
    np.testing.assert_allclose(out["w"], np.where(keep, a, 0), rtol=1e-6)
    r = np.where(keep, 0, a)
    f = d * f + (1 - d) * keep
    np.testing.assert_allclose(state.frequency["w"], f, rtol=1e-6)
    np.testing.assert_allclose(state.residual["w"], r, rtol=1e-6, atol=1e-7)


def _numpy_ema_threshold(grads, alpha, every, scale):
  r = tau = None
  outs = []
  for t, g in enumerate(grads):
    g = {k: np.asarray(v, np.float64) for k, v in g.items()}
    if r is None:
      r = {k: np.zeros_like(v) for k, v in g.items()}
      tau = {}
    out = {}
    for k in sorted(g):
      a = g[k] + r[k]
      if t == 0:
        tau[k] = np.mean(np.abs(a))
      elif t % every == 0:
        tau[k] = alpha * np.mean(np.abs(a)) + (1 - alpha) * tau[k]
      keep = np.abs(a) >= scale * tau[k]
      out[k] = np.where(keep, a, 0.0)
      r[k] = a - out[k]
    outs.append(out)
  return outs, tau


def test_ema_threshold_matches_numpy_reference():
  grads = []
  for i in range(25):
    tr = _tree(seed=100 + i)
    grads.append(jax.tree.map(lambda x, s=(1 + 0.1 * i): x * s, tr))
  tx = grpo_optax.ema_threshold_mask(alpha=0.7, every=4, scale=1.2)
  state = tx.init(grads[0])
  update = jax.jit(tx.update)
  ref, tau = _numpy_ema_threshold(grads, 0.7, 4, 1.2)
  for g, r in zip(grads, ref):
    out, state = update(g, state)
    for k in r:
      np.testing.assert_allclose(out[k], r[k], rtol=2e-4, atol=1e-6)
  np.testing.assert_allclose(
    state.tau, [tau[k] for k in sorted(tau)], rtol=2e-4
  )
  assert int(state.count) == 25


def test_ema_threshold_tau_moves_only_every_n_steps():
  tx = grpo_optax.ema_threshold_mask(alpha=0.5, every=3)
  state = tx.init(_tree())
  taus = []
  for i in range(7):
    _, state = tx.update(_tree(seed=i), state)
    taus.append(np.asarray(state.tau))
  np.testing.assert_array_equal(taus[0], taus[1])
  np.testing.assert_array_equal(taus[1], taus[2])
  assert not np.array_equal(taus[2], taus[3])
  np.testing.assert_array_equal(taus[3], taus[5])
  assert not np.array_equal(taus[5], taus[6])


def test_ema_threshold_keeps_entries_at_the_threshold():
  """|a| >= tau: a leaf of equal magnitudes (tau = mean|a|) is kept whole."""
  tx = grpo_optax.ema_threshold_mask(min_size=0)
  g = {"w": jnp.array([1.0, -1.0, 1.0, -1.0])}
  out, state = tx.update(g, tx.init(g))
  np.testing.assert_array_equal(out["w"], g["w"])
  np.testing.assert_array_equal(state.tau, [1.0])
  # Nothing was held back: the next step sends g again, not g + a residual
  # (the accumulator's residual is read with the same |a| >= tau).
  out, state = tx.update(g, state)
  np.testing.assert_array_equal(out["w"], g["w"])


def test_ema_threshold_leaf_count_mismatch():
  tx = grpo_optax.ema_threshold_mask()
  state = tx.init({"a": jnp.ones(3)})
  with pytest.raises(ValueError, match="leaves"):
    tx.update({"a": jnp.ones(3), "b": jnp.ones(2)}, state)


@pytest.mark.parametrize(
  "kwargs,name",
  [
    (dict(fraction=0.0), "fraction"),
    (dict(fraction=1.5), "fraction"),
    (dict(fraction=-0.1), "fraction"),
    (dict(frequency_weight=2.0), "frequency_weight"),
    (dict(min_size=-1), "min_size"),
    (dict(warmup_steps=-3), "warmup_steps"),
    (dict(warmup_steps=2.5), "warmup_steps"),
    (dict(frequency_decay=1.0), "frequency_decay"),
  ],
)
def test_topk_bad_input(kwargs, name):
  with pytest.raises(ValueError, match=name):
    grpo_optax.top_k_mask(**kwargs)


def test_topk_unknown_method():
  with pytest.raises(ValueError, match="method must be one of"):
    grpo_optax.top_k_mask(method="approx")


@pytest.mark.parametrize(
  "kwargs,name",
  [
    (dict(alpha=0.0), "alpha"),
    (dict(alpha=1.2), "alpha"),
    (dict(every=0), "every"),
    (dict(every=1.5), "every"),
    (dict(scale=-1.0), "scale"),
  ],
)
def test_threshold_bad_input(kwargs, name):
  with pytest.raises(ValueError, match=name):
    grpo_optax.ema_threshold_mask(**kwargs)


def test_traced_fraction_with_exact_method_keeps_exactly_k():
  tx = optax.inject_hyperparams(grpo_optax.top_k_mask)(
    fraction=0.3, error_feedback=False
  )
  g = _tree()
  out, state = jax.jit(tx.update)(g, tx.init(g))
  for name, leaf in g.items():
    assert int(jnp.sum(out[name] != 0)) == math.ceil(0.3 * leaf.size)
  state.hyperparams["fraction"] = jnp.asarray(0.5)
  out, _ = jax.jit(tx.update)(g, state)
  for name, leaf in g.items():
    assert int(jnp.sum(out[name] != 0)) == math.ceil(0.5 * leaf.size)


def test_nan_in_gradient_is_not_hidden():
  tx = grpo_optax.top_k_mask(0.5)
  g = {"w": jnp.array([1.0, jnp.nan, 3.0, 0.1])}
  out, state = tx.update(g, tx.init(g))
  assert bool(jnp.isnan(out["w"]).any() | jnp.isnan(state.residual["w"]).any())


@pytest.mark.parametrize(
  "shape", [(4096,), (200, 256), (64, 48), (3, 40, 16), (96, 1000)]
)
def test_grid_sample_is_local_to_every_shard(shape):
  """Split an axis into up to 16 equal shards: sampling each shard with the
  leaf's strides and offsets gives the leaf's sample (no collective needed).
  """
  strides = grpo_optax._common.sample_strides(shape, 64)
  assert math.prod(-(-n // s) for n, s in zip(shape, strides)) < math.prod(
    shape
  )
  x = np.arange(math.prod(shape)).reshape(shape)
  offsets = [s - 1 for s in strides]
  whole = np.asarray(
    grpo_optax._common.grid_sample(
      jnp.asarray(x), strides, [jnp.asarray(o, jnp.int32) for o in offsets]
    )
  )
  for d, n in enumerate(shape):
    shards = math.gcd(n, 16)
    parts = [
      np.asarray(
        grpo_optax._common.grid_sample(
          jnp.asarray(part),
          strides,
          [jnp.asarray(o, jnp.int32) for o in offsets],
        )
      )
      for part in np.split(x, shards, axis=d)
    ]
    np.testing.assert_array_equal(np.concatenate(parts, axis=d), whole)
