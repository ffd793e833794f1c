"""The one-pass grpo() (fused=True) against an independent NumPy reference.

The reference below is written from the math in ``grpo_optax/fused.py``'s
docstring, in float64 and plain loops over leaves, sharing no code with the
library (only the random start of the top-k sample is drawn with
``jax.random``, the same key the transform uses).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import grpo_optax

STEPS = 20


def _params():
  rng = np.random.default_rng(0)
  return {"big": jnp.asarray(rng.normal(size=(48, 50)), jnp.float32),
          "mid": jnp.asarray(rng.normal(size=(6, 7)) * 0.5, jnp.float32),
          "vec": jnp.asarray(rng.normal(size=(5,)) * 0.1, jnp.float32)}


def _grads(t, params):
  rng = np.random.default_rng(100 + t)
  scale = {"big": 1.0, "mid": 0.3, "vec": 3.0}
  return {k: jnp.asarray(rng.standard_t(4, size=v.shape) * scale[k]
                         * (1 + 0.1 * t), jnp.float32)
          for k, v in params.items()}


# ----------------------------------------------------------------------------
# The reference.


def strided(x, m=1024):
  flat = np.asarray(x).reshape(-1)
  return flat[::max(1, -(-flat.size // m))]


def sample_size(n):
  return min(n, max(1024, min(65536, math.ceil(0.01 * n))))


def coprime_positions(n, m, start):
  stride = max(1, n // m)
  while math.gcd(stride, n) != 1:
    stride += 1
  first = min(int(np.float32(start) * np.float32(n)), n - 1)
  return (first + (np.arange(m) * stride) % n) % n


def bisect(sample, fraction):
  if fraction >= 1:
    return -np.inf
  x = np.asarray(sample, np.float32)
  lo, hi = x.min(), x.max()
  target = np.float32(fraction) * np.float32(x.size)
  for _ in range(24):
    mid = np.float32(0.5) * (lo + hi)
    if np.sum(x >= mid) >= target:
      lo = mid
    else:
      hi = mid
  return float(lo)


class Reference:
  """NumPy implementation of the one-pass update (float64)."""

  def __init__(self, params, **kw):
    self.kw = dict(  # grpo()'s defaults
        learning_rate=1e-3, max_norm=1.0, l2=0.0, importance=False,
        importance_order=2, importance_decay=0.9, importance_placement="input",
        min_weight=0.1, max_weight=10.0, sparsify="topk", fraction=0.3,
        error_feedback=True, min_size=1024, sparsify_warmup_steps=0,
        alpha=0.7,
        every=100, threshold_scale=1.0, b1=0.9, b2=0.999, eps=1e-8,
        eps_root=0.0, adam_weight=1.0, nesterov=True,
        rms_bias_correction=False, variance_coef=None,
        variance_reduction="leaf", variance_normalize=False,
        variance_eps=1e-12, freeze_threshold=None, freeze_decay=0.9,
        freeze_warmup_steps=100, seed=0)
    self.kw.update(kw)
    # The library does its hyper-parameter arithmetic in float32 (so that
    # inject_hyperparams gives the same numbers); 1 - 0.999 in float32 is
    # 1.3e-5 off 0.001, so the reference takes the float32-rounded values.
    self.kw = {k: float(np.float32(v)) if isinstance(v, float) else v
               for k, v in self.kw.items()}
    z = lambda: {k: np.zeros(v.shape) for k, v in params.items()}
    self.mu, self.nu, self.score, self.acc = z(), z(), z(), z()
    self.thr = {k: 0.0 for k in params}
    self.tau = {k: 0.0 for k in params}
    self.fimp = {k: 0.0 for k in params}
    self.frozen = {k: False for k in params}
    self.t = 0

  def load(self, state):
    """Takes the implementation's state (so that steps are compared one at a
    time: a mask decision at a float32/float64 tie cannot drift the runs)."""
    as64 = lambda tree: {k: np.asarray(v, np.float64) for k, v in tree.items()}
    self.mu, self.nu = as64(state.mu), as64(state.nu)
    if state.score is not None:
      self.score = as64(state.score)
    if state.accumulator is not None:
      self.acc = as64(state.accumulator)
    if state.thresholds is not None:
      self.thr = {k: float(v) for k, v in state.thresholds.items()}
    if state.tau is not None:
      self.tau = {k: float(v) for k, v in state.tau.items()}
    if state.freeze is not None:
      self.fimp = {k: float(v) for k, v in state.freeze.importance.items()}
      self.frozen = {k: bool(v) for k, v in state.freeze.frozen.items()}

  def step(self, grads, params, hessian_diag=None, head_entropy=None,
           grad_variance=None):
    kw, t = self.kw, self.t
    f64 = lambda tree: {k: np.asarray(v, np.float64) for k, v in tree.items()}
    g, p = f64(grads), f64(params)
    keys = list(g)
    b1, b2, d = kw["b1"], kw["b2"], kw["importance_decay"]
    a = {k: g[k] + kw["l2"] * p[k] for k in keys}
    if kw["max_norm"] is not None:
      norm = math.sqrt(sum(np.sum(a[k] ** 2) for k in keys))
      c = min(1.0, kw["max_norm"] / norm)
      a = {k: a[k] * c for k in keys}
    bcs = 1 - d ** (t + 1)

    w = {}

    def importance(fisher):
      for k in keys:
        h = (np.asarray(hessian_diag[k], np.float64) if hessian_diag
             else fisher[k])
        s = np.abs(a[k] * p[k])
        if kw["importance_order"] == 2:
          s = s + 0.5 * h * p[k] ** 2
        self.score[k] = d * self.score[k] + (1 - d) * s
        mean = np.mean(strided(self.score[k])) / bcs
        wk = np.clip(self.score[k] / bcs / (mean + 1e-12), kw["min_weight"],
                     kw["max_weight"])
        if head_entropy is not None and head_entropy.get(k) is not None:
          e = np.asarray(head_entropy[k], np.float64)
          wk = wk * e / np.mean(e)
        w[k] = wk

    output = kw["importance_placement"] == "output"
    if kw["importance"] and not output:
      importance({k: a[k] ** 2 if t == 0 else self.nu[k] / (1 - b2 ** t)
                  for k in keys})
    x = {k: a[k] * w[k] if w and not output else a[k] for k in keys}

    m = dict(x)
    if kw["sparsify"]:
      frac = kw["fraction"]
      if kw["sparsify_warmup_steps"]:
        ws = kw["sparsify_warmup_steps"]
        frac = np.float32(frac) ** np.float32(min(t, ws) / ws)
      start = float(jax.random.uniform(jax.random.fold_in(
          jax.random.PRNGKey(kw["seed"]), t), ()))
      for k in keys:
        n = x[k].size
        if n < kw["min_size"]:
          continue
        if kw["error_feedback"]:
          old = self.acc[k]
          keep_old = ((np.abs(old).astype(np.float32) >= np.float32(self.thr[k]))
                      & (old != 0))
          self.acc[k] = x[k] + np.where(keep_old, 0.0, old)
          acc = self.acc[k]
        else:
          acc = x[k]
        if kw["sparsify"] == "topk":
          ms = sample_size(n)
          flat = acc.reshape(-1)
          smp = np.abs(flat[coprime_positions(n, ms, start)] if ms < n
                       else flat)
          thr = bisect(smp, frac)
        else:
          mean_abs = np.mean(np.abs(strided(acc, 4096)))
          if t == 0:
            self.tau[k] = mean_abs
          elif t % kw["every"] == 0:
            self.tau[k] = (kw["alpha"] * mean_abs
                           + (1 - kw["alpha"]) * self.tau[k])
          thr = kw["threshold_scale"] * self.tau[k]
        self.thr[k] = thr
        # Compared in float32, as the library does (ties at the threshold).
        keep = (np.abs(acc).astype(np.float32) >= np.float32(thr)) & (acc != 0)
        m[k] = np.where(keep, acc, 0.0)

    for k in keys:
      self.mu[k] = b1 * self.mu[k] + (1 - b1) * m[k]
      self.nu[k] = b2 * self.nu[k] + (1 - b2) * m[k] ** 2
    bc1, bc2 = 1 - b1 ** (t + 1), 1 - b2 ** (t + 1)
    if kw["importance"] and output:
      importance({k: self.nu[k] / bc2 for k in keys})

    out = {}
    for k in keys:
      mu_hat = (b1 * self.mu[k] / (1 - b1 ** (t + 2)) + (1 - b1) * m[k] / bc1
                if kw["nesterov"] else self.mu[k] / bc1)
      nu_hat = self.nu[k] / bc2
      adam = mu_hat / (np.sqrt(nu_hat + kw["eps_root"]) + kw["eps"])
      rms_nu = nu_hat if kw["rms_bias_correction"] else self.nu[k]
      rms = m[k] / (np.sqrt(rms_nu) + kw["eps"])
      u = kw["adam_weight"] * adam + (1 - kw["adam_weight"]) * rms
      if kw["importance"] and output:
        u = u * w[k]
      out[k] = u

    if kw["variance_coef"] is not None:
      def var_of(k, mu, nu):
        if grad_variance is not None:
          return np.maximum(np.asarray(grad_variance[k], np.float64), 0)
        return np.maximum(nu / bc2 - (mu / bc1) ** 2, 0)
      sizes = {k: g[k].size for k in keys}
      total = sum(sizes.values())
      red = kw["variance_reduction"]
      if red == "element":
        for k in keys:
          v = var_of(k, self.mu[k], self.nu[k])
          if grad_variance is not None:
            v = np.maximum(np.asarray(grad_variance[k], np.float64), 0)
          if kw["variance_normalize"]:
            v = v / (self.nu[k] / bc2 + kw["variance_eps"])
          out[k] = out[k] / (1 + kw["variance_coef"] * v)
      else:
        var = {}
        for k in keys:
          if grad_variance is not None:
            var[k] = np.mean(strided(np.maximum(
                np.asarray(grad_variance[k], np.float64), 0)))
          else:
            var[k] = np.mean(var_of(k, strided(self.mu[k]),
                                    strided(self.nu[k])))
        nus = {k: np.mean(strided(self.nu[k])) / bc2 for k in keys}
        if red == "global":
          gv = sum(var[k] * sizes[k] for k in keys) / total
          gn = sum(nus[k] * sizes[k] for k in keys) / total
          var = {k: gv for k in keys}
          nus = {k: gn for k in keys}
        for k in keys:
          v = var[k]
          if kw["variance_normalize"]:
            v = v / (nus[k] + kw["variance_eps"])
          out[k] = out[k] / (1 + kw["variance_coef"] * v)

    lr = kw["learning_rate"]
    lr = float(lr(t)) if callable(lr) else lr
    out = {k: -lr * v for k, v in out.items()}

    if kw["freeze_threshold"] is not None:
      fd = kw["freeze_decay"]
      for k in keys:
        cur = np.mean(np.abs(strided(a[k]) * strided(p[k])))
        self.fimp[k] = fd * self.fimp[k] + (1 - fd) * cur
      fbc = 1 - fd ** (t + 1)
      active = [k for k in keys if not self.frozen[k]]
      mean = sum(self.fimp[k] / fbc for k in active) / max(len(active), 1)
      for k in keys:
        if t >= kw["freeze_warmup_steps"] and (
            self.fimp[k] / fbc / (mean + 1e-30) < kw["freeze_threshold"]):
          self.frozen[k] = True
        if self.frozen[k]:
          out[k] = np.zeros_like(out[k])
    self.t += 1
    return out


# ----------------------------------------------------------------------------


def _extra(params):
  rng = np.random.default_rng(1)
  return dict(
      hessian_diag={k: jnp.asarray(np.abs(rng.normal(size=v.shape)), v.dtype)
                    for k, v in params.items()},
      head_entropy={"big": grpo_optax.per_head(jnp.linspace(0.5, 2.0, 48),
                                               axis=0, ndim=2),
                    "mid": None, "vec": None},
      grad_variance={k: jnp.asarray(np.abs(rng.normal(size=v.shape)) * 0.5,
                                    v.dtype) for k, v in params.items()})


MODES = {
    "dense_input": dict(sparsify=None),
    "dense_output_l2_global_freeze": dict(
        sparsify=None, importance_placement="output", l2=1e-2,
        variance_coef=0.5, variance_reduction="global",
        variance_normalize=True, freeze_threshold=0.3, freeze_warmup_steps=5,
        learning_rate=3e-2),
    "topk_input_warmup_min_size": dict(
        sparsify="topk", sparsify_warmup_steps=6, min_size=10, fraction=0.25,
        nesterov=False, importance_order=1, seed=3),
    "topk_output_no_feedback_element": dict(
        sparsify="topk", importance_placement="output", error_feedback=False,
        variance_reduction="element", variance_normalize=True,
        variance_coef=0.3, rms_bias_correction=True, adam_weight=0.7,
        max_norm=None, learning_rate=optax.linear_schedule(1e-2, 1e-3, 20)),
    "threshold_output": dict(
        sparsify="threshold", every=3, alpha=0.5, threshold_scale=0.8,
        importance_placement="output", min_weight=0.5, max_weight=3.0,
        b1=0.8, b2=0.99, eps=1e-6, eps_root=1e-10),
    "threshold_input_extra_args": dict(
        sparsify="threshold", every=4, variance_normalize=True),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_one_pass_matches_numpy_reference(mode):
  # Every mechanism on (the articles' settings), then the mode's changes.
  kw = {**grpo_optax.ARTICLE_DEFAULTS, **MODES[mode]}
  params = _params()
  extra = _extra(params) if mode.endswith("extra_args") else {}
  tx = grpo_optax.grpo(**kw)
  ref = Reference(params, **kw)
  state = tx.init(params)
  assert type(state).__name__ == "GrpoState"
  update = jax.jit(tx.update)
  # A mask compares |a| with a threshold: where the float32 and float64
  # values of an entry fall on either side of it, that entry differs. At
  # most one entry per leaf and step may do so, in the mask modes only.
  budget = 1 if kw.get("sparsify") else 0
  flips = 0
  for t in range(STEPS):
    g = _grads(t, params)
    ref.load(state)
    out, state = update(g, state, params, **extra)
    want = ref.step(g, params, **extra)

    def close(x, y, what):
      # rtol 1e-5, with an absolute floor of 1e-6 of the leaf's largest value
      # for entries that cancel to near zero (float32 against float64).
      x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
      bad = ~np.isclose(x, y, rtol=1e-5, atol=1e-6 * np.abs(y).max() + 1e-30)
      assert bad.sum() <= budget, (mode, t, what, bad.sum(),
                                   x[bad][:3], y[bad][:3])
      return int(bad.sum())

    for k in params:
      flips += close(out[k], want[k], f"update {k}")
      close(state.mu[k], ref.mu[k], f"mu {k}")
      close(state.nu[k], ref.nu[k], f"nu {k}")
      if state.score is not None:
        close(state.score[k], ref.score[k], f"score {k}")
      if state.accumulator is not None:
        close(state.accumulator[k], ref.acc[k], f"accumulator {k}")
      if state.tau is not None:
        np.testing.assert_allclose(state.tau[k], ref.tau[k], rtol=1e-5)
      if state.thresholds is not None and ref.thr[k] > -np.inf:
        np.testing.assert_allclose(state.thresholds[k], ref.thr[k], rtol=1e-5)
    params = jax.tree.map(lambda p, u: p + u, params, out)
  assert flips <= 2, flips  # ties are rare: a handful of entries in all
  if kw.get("freeze_threshold") is not None:
    assert any(ref.frozen.values())  # the scenario exercises freezing
    assert grpo_optax.frozen_mask(state) == {
        k: jnp.asarray(v) for k, v in ref.frozen.items()}


@pytest.mark.parametrize("nesterov,optimizer", [(False, optax.adam),
                                                (True, optax.nadam)])
def test_adam_and_nadam_limits(nesterov, optimizer):
  """Importance, masks, variance and clipping off: exactly Adam / NAdam."""
  params = _params()
  tx = grpo_optax.grpo(1e-2, max_norm=None, importance=False, sparsify=None,
                       variance_coef=None, adam_weight=1.0, nesterov=nesterov)
  ref = optimizer(1e-2)
  s, s_ref = tx.init(params), ref.init(params)
  for t in range(STEPS):
    g = _grads(t, params)
    u, s = tx.update(g, s, params)
    u_ref, s_ref = ref.update(g, s_ref, params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(
        a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max()), u, u_ref)
    params = optax.apply_updates(params, u)


def test_rmsprop_limit():
  params = _params()
  tx = grpo_optax.grpo(1e-2, max_norm=None, importance=False, sparsify=None,
                       variance_coef=None, adam_weight=0.0)
  ref = optax.chain(optax.scale_by_rms(decay=0.999, eps=1e-8,
                                       eps_in_sqrt=False), optax.scale(-1e-2))
  s, s_ref = tx.init(params), ref.init(params)
  for t in range(5):
    g = _grads(t, params)
    u, s = tx.update(g, s, params)
    u_ref, s_ref = ref.update(g, s_ref, params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), u,
                 u_ref)


@pytest.mark.parametrize("sparsify", ["topk", "threshold"])
def test_error_feedback_loses_nothing(sparsify):
  """With b1 = 0 Adam's first moment is the masked gradient itself, so the
  masked gradients of all steps plus the final residual must add up to the
  sum of the gradients."""
  params = _params()
  tx = grpo_optax.grpo(1e-3, max_norm=None, importance=False,
                       sparsify=sparsify, every=2, b1=0.0, variance_coef=None)
  state = tx.init(params)
  update = jax.jit(tx.update)
  sent = jax.tree.map(jnp.zeros_like, params)
  total = jax.tree.map(jnp.zeros_like, params)
  kept = []
  for t in range(STEPS):
    g = _grads(t, params)
    _, state = update(g, state, params)
    sent = jax.tree.map(jnp.add, sent, state.mu)
    total = jax.tree.map(jnp.add, total, g)
    kept.append(float(grpo_optax.fused.kept_fraction(state)))
    # b1 = 0: mu is this step's masked gradient, so the exact kept fraction
    # read from the accumulator equals the fraction of non-zero entries.
    nonzero = sum(int(jnp.sum(m != 0)) for m in jax.tree.leaves(state.mu))
    np.testing.assert_allclose(
        kept[-1], nonzero / sum(p.size for p in jax.tree.leaves(params)),
        rtol=1e-6)
  residual = grpo_optax.fused.residual(state)
  for k in params:
    np.testing.assert_allclose(sent[k] + residual[k], total[k], rtol=1e-5,
                               atol=1e-5)
  assert max(kept) < 0.95  # the mask really dropped entries
  assert float(optax.tree.norm(residual)) > 0


@pytest.mark.parametrize("kw,expected", [
    (dict(sparsify=None), 2),
    (dict(sparsify=None, importance=True), 3),
    (dict(sparsify="topk"), 3),
    (dict(sparsify="topk", importance=True), 4),
    (dict(sparsify="threshold", importance=True), 4),
    (dict(sparsify="topk", error_feedback=False, importance=True), 3),
    (dict(sparsify="threshold", freeze_threshold=0.3, importance=True), 4),
])
def test_state_holds_no_other_parameter_sized_array(kw, expected):
  params = {"w": jnp.ones((64, 32)), "b": jnp.ones((32,))}
  state = grpo_optax.grpo(**kw, variance_coef=0.1).init(params)
  sizes = [x.size for x in jax.tree.leaves(state)]
  assert sizes.count(64 * 32) == expected, sizes


def test_exact_top_k_and_noise_filter_use_the_chain():
  params = {"w": jnp.ones((4, 4))}
  for kw in (dict(topk_method="exact"), dict(filter_decay=0.5),
             dict(frequency_weight=0.1), dict(adaptive=False), dict(fused=False)):
    state = grpo_optax.grpo(**kw).init(params)
    assert isinstance(state, tuple) and not hasattr(state, "stats"), kw


def test_kept_fraction_of_the_sampled_top_k():
  params = {"w": jax.random.normal(jax.random.key(0), (400, 500))}
  tx = grpo_optax.grpo(importance=False, fraction=0.3, error_feedback=False)
  state = tx.init(params)
  g = {"w": jax.random.normal(jax.random.key(1), (400, 500))}
  out, state = jax.jit(tx.update)(g, state, params)
  frac = float(jnp.mean(out["w"] != 0))
  # A 2,000-entry sample: the quantile's standard error is ~1% absolute.
  assert abs(frac - 0.3) < 0.04, frac
  assert abs(float(state.stats.kept_fraction) - frac) < 0.05


def test_missing_params_and_bad_extra_args():
  params = {"w": jnp.ones((3, 3))}
  tx = grpo_optax.grpo(importance=True)
  state = tx.init(params)
  g = {"w": jnp.ones((3, 3))}
  with pytest.raises(ValueError, match="params"):
    tx.update(g, state)
  # The defaults read no params (no importance, L2 or freezing).
  out, _ = grpo_optax.grpo().update(g, grpo_optax.grpo().init(params))
  assert out["w"].shape == (3, 3)
  with pytest.raises(ValueError, match="hessian_diag"):
    tx.update(g, state, params, hessian_diag={"v": jnp.ones(3)})
  with pytest.raises(ValueError, match="importance_placement"):
    grpo_optax.grpo(importance_placement="after")
  with pytest.raises(TypeError, match="fused"):
    grpo_optax.grpo(fused="yes")


def test_freezing_normalises_over_the_leaves_still_trainable():
  """After a leaf froze, its importance must not drag the mean: here its
  gradient grows 10,000x once frozen, which with a mean over every leaf
  would freeze all the others."""
  params = {"a": jnp.ones((4, 4)), "b": jnp.full((4, 4), 0.01),
            "c": jnp.full((4, 4), 0.2), "d": jnp.full((4, 4), 0.5)}
  tx = grpo_optax.grpo(1e-3, max_norm=None, importance=False, sparsify=None,
                       variance_coef=None, freeze_threshold=0.3,
                       freeze_decay=0.5, freeze_warmup_steps=0)
  state = tx.init(params)
  g = jax.tree.map(jnp.ones_like, params)
  _, state = tx.update(g, state, params)
  assert {k: bool(v) for k, v in grpo_optax.frozen_mask(state).items()} == {
      "a": False, "b": True, "c": False, "d": False}
  g["b"] = g["b"] * 1e4
  for _ in range(3):
    out, state = tx.update(g, state, params)
  assert {k: bool(v) for k, v in grpo_optax.frozen_mask(state).items()} == {
      "a": False, "b": True, "c": False, "d": False}
  assert float(jnp.abs(out["b"]).max()) == 0.0
  # Normalised importance of c: 0.2 / mean(1, 0.2, 0.5) = 0.35 > 0.3.
  imp = state.freeze.importance
  np.testing.assert_allclose(float(imp["c"]) / np.mean(
      [float(imp["a"]), float(imp["c"]), float(imp["d"])]), 0.2 / (1.7 / 3),
                             rtol=1e-5)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("max_norm", [None, 1.0])
def test_complex_params_match_optax(fused, max_norm):
  """Complex leaves: |g|^2 in the clip norm and in Adam's second moment, as
  optax's clip_by_global_norm and nadam compute them (a g * g second moment
  or a float32 cast of g would differ by the size of the update)."""
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  params = {"z": (jax.random.normal(k1, (40, 40))
                  + 1j * jax.random.normal(k2, (40, 40))).astype(jnp.complex64),
            "r": jnp.linspace(-1.0, 1.0, 7)}
  ref = optax.nadam(1e-2)
  if max_norm is not None:
    ref = optax.chain(optax.clip_by_global_norm(max_norm), ref)
  tx = grpo_optax.grpo(1e-2, sparsify=None, max_norm=max_norm, fused=fused)
  s_ref, s = ref.init(params), tx.init(params)
  for t in range(4):
    g = jax.tree.map(lambda x, t=t: x * (0.3 * (t + 1)), params)
    want, s_ref = ref.update(g, s_ref, params)
    got, s = jax.jit(tx.update)(g, s, params)
    for k in params:
      assert got[k].dtype == params[k].dtype
      np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=1e-7)


def test_complex_params_with_topk_keep_the_error_feedback_invariant():
  """As test_error_feedback_loses_nothing, on a complex leaf: with b1 = 0 the
  first moment is the masked gradient; masked gradients plus the residual
  add up to the gradients, and the mask ranks entries by modulus."""
  params = {"z": (jnp.arange(1, 65.0).reshape(8, 8)
                  * (1 - 0.5j)).astype(jnp.complex64)}
  tx = grpo_optax.grpo(1e-3, max_norm=None, b1=0.0, min_size=0)
  state = tx.init(params)
  sent = jnp.zeros((8, 8), jnp.complex64)
  total = jnp.zeros((8, 8), jnp.complex64)
  for t in range(3):
    g = {"z": params["z"] * jnp.cos(jnp.arange(64.0) + t).reshape(8, 8)}
    _, state = jax.jit(tx.update)(g, state, params)
    sent = sent + state.mu["z"]
    total = total + g["z"]
    kept = state.mu["z"] != 0
    # Kept entries are the largest by modulus: every kept |g| >= every
    # dropped |g| (of this step's accumulator, here the first step's g).
    if t == 0:
      mag = jnp.abs(g["z"])
      assert float(jnp.min(jnp.where(kept, mag, jnp.inf))) >= float(
          jnp.max(jnp.where(kept, -jnp.inf, mag)))
      assert 0 < int(jnp.sum(kept)) < 64
  np.testing.assert_allclose(sent + grpo_optax.fused.residual(state)["z"],
                             total, rtol=1e-5, atol=1e-5)


def test_complex_params_refuse_the_real_valued_stages():
  params = {"z": jnp.ones((4, 4), jnp.complex64)}
  for kw, name in ((dict(importance=True), "importance"),
                   (dict(variance_coef=0.1), "variance_coef"),
                   (dict(freeze_threshold=0.5), "freeze_threshold")):
    tx = grpo_optax.grpo(1e-2, **kw)
    with pytest.raises(TypeError, match=name):
      tx.update(params, tx.init(params), params)


def test_integer_gradients_are_refused_with_a_clear_error():
  params = {"w": jnp.ones((4,)), "steps": jnp.ones((3,), jnp.int32)}
  tx = grpo_optax.grpo(1e-2)
  with pytest.raises(TypeError, match="int32.*floating-point|floating-point"
                     ".*int32"):
    tx.update(params, tx.init(params), params)
