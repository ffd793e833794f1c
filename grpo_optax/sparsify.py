"""Top-k and EMA-threshold gradient masking with error feedback (mechanisms 3, 4).

Article 004 §1.2 and §2.2 update only a subset of the parameters: the top 30%
by a score mixing the gradient's magnitude and the parameter's update history
("adaptive sampling"), with a threshold re-estimated every 100 steps as an EMA
of the mean gradient magnitude. Both are pinned here as masks with error
feedback (the masked-out part is carried to the next step, so nothing is lost),
computed per leaf: the whole model is never concatenated or sorted at once.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from grpo_optax import _common

METHODS = ("exact", "sampled")
_MIN_SAMPLE = 1024  # floor on the sample size of the sampled threshold
_MAX_SAMPLE = 65536  # cap on it (the quantile error is ~0.2% there)
_KEPT_SAMPLE = 4096  # strided sample of the kept-fraction diagnostic
_SAMPLE_RATE = 0.01  # fraction of a leaf sampled (Deep Gradient Compression)
_BISECTION_STEPS = 24


class TopKMaskState(NamedTuple):
  """State of :func:`top_k_mask`."""

  count: jax.Array  # shape=(), dtype=int32
  residual: Optional[optax.Updates]  # error-feedback memory; None when off
  frequency: Optional[optax.Updates]  # EMA of the kept indicator; None when off
  key: jax.Array  # shape=(2,), dtype=uint32: PRNG key of the sampled threshold
  # shape=(), float32: kept / total at the last step (exact for the exact
  # method, estimated on a strided sample of 4,096 entries per leaf otherwise)
  kept_fraction: jax.Array


class EmaThresholdMaskState(NamedTuple):
  """State of :func:`ema_threshold_mask`."""

  count: jax.Array  # shape=(), dtype=int32
  residual: Optional[optax.Updates]  # error-feedback memory; None when off
  tau: jax.Array  # shape=(num_leaves,), float32: per-leaf thresholds
  # shape=(), float32: kept / total at the last step, estimated on a strided
  # sample of 4,096 entries per leaf
  kept_fraction: jax.Array


def static_int(name, value, low):
  """``value`` as a Python int (validated), or None if it is traced."""
  v = _common.concrete_value(value)
  if v is None:
    return None
  if v != int(v) or v < low:
    raise ValueError(f"{name} must be an int >= {low}; got {value!r}")
  return int(v)


def sample_size(n: int) -> int:
  """Size of the random sample of the sampled threshold for a leaf of ``n``."""
  return min(n, max(_MIN_SAMPLE, min(_MAX_SAMPLE, math.ceil(_SAMPLE_RATE * n))))


def draw_sample(score: jax.Array, key: Optional[jax.Array] = None, *,
                uniform: Optional[jax.Array] = None) -> jax.Array:
  """``max(1024, n/100)`` (at most 65,536) random entries of a flat ``score``.

  Small leaves (``n <= 1024``) are used whole. The positions come from
  ``key``, or from ``uniform``: ``m`` uniform [0, 1) numbers (so that one
  random draw can serve all leaves).
  """
  n = score.shape[0]
  m = sample_size(n)
  if m == n:
    return score
  if uniform is None:
    uniform = jax.random.uniform(key, (m,))
  return score[sample_positions(n, uniform)]


def strided_positions(n: int, m: int, start: jax.Array) -> jax.Array:
  """``m`` distinct positions in ``[0, n)``: every s-th from a random start.

  ``s`` is the smallest integer >= n / m that is coprime with ``n``, so the
  positions wrap around without repeating and visit every residue class of
  any divisor of ``n`` (every column of a row-major matrix) about equally.

  Args:
    n: the leaf's size.
    m: the sample size, ``m <= n``.
    start: a uniform [0, 1) scalar; the first position is ``floor(start n)``.
  """
  stride = max(1, n // m)
  while math.gcd(stride, n) != 1:
    stride += 1
  first = jnp.minimum((start * n).astype(jnp.int32), n - 1)
  steps = jnp.arange(m, dtype=jnp.int32) * stride % n
  return (first + steps) % n


def sample_positions(n: int, uniform: jax.Array) -> jax.Array:
  """Positions in ``[0, n)`` from uniform [0, 1) numbers (one per sample)."""
  return jnp.minimum((uniform * n).astype(jnp.int32), n - 1)


def bisect_thresholds(samples: list[jax.Array], fraction) -> list[jax.Array]:
  """For each sample, the value above which ``fraction`` of it lies.

  24 bisection steps between the sample's min and max, counting entries
  ``>= mid``: O(m) per step and no sort. All samples share one loop whose
  carry holds one ``(lo, hi)`` pair per sample, and each sample is counted by
  its own reduction: the compiled kernels then depend on the samples' sizes
  only, so XLA compiles one per size, not one per leaf (slicing per-leaf
  values out of a stacked vector would make every leaf's kernels distinct).

  Args:
    samples: flat float arrays.
    fraction: the fraction to keep, in (0, 1] (may be traced).

  Returns:
    One scalar threshold per sample (-inf when ``fraction >= 1``).
  """
  if not samples:
    return []
  samples = [x.astype(jnp.float32) for x in samples]
  targets = [fraction * x.shape[0] for x in samples]

  def body(_, bounds):
    out = []
    for x, target, (lo, hi) in zip(samples, targets, bounds):
      mid = 0.5 * (lo + hi)
      keeps_enough = jnp.sum(x >= mid, dtype=jnp.float32) >= target
      out.append((jnp.where(keeps_enough, mid, lo),
                  jnp.where(keeps_enough, hi, mid)))
    return out

  bounds = jax.lax.fori_loop(0, _BISECTION_STEPS, body,
                             [(jnp.min(x), jnp.max(x)) for x in samples])
  # Keeping everything (a warm-up's first step) must not drop the entries
  # that lie below the sample's minimum.
  keep_all = jnp.asarray(fraction) >= 1
  return [jnp.where(keep_all, -jnp.inf, lo) for lo, _ in bounds]


def sampled_threshold(score: jax.Array, fraction, key: jax.Array) -> jax.Array:
  """Estimates the ``1 - fraction`` quantile of ``score`` from a sample.

  Draws ``max(1024, 1% of n)`` entries, at most 65,536 (all of them for small
  leaves), and bisects 24 times on the sample for the value above which
  ``fraction`` of it lies: O(n) work, no sort.

  Args:
    score: a flat array of scores.
    fraction: the fraction to keep, in (0, 1].
    key: a PRNG key (``uint32[2]``).

  Returns:
    A scalar threshold; ``score >= threshold`` keeps about ``fraction`` of it.
  """
  return bisect_thresholds([draw_sample(score, key)], fraction)[0]


def _exact_mask(score: jax.Array, fraction, static_k: Optional[int]):
  """Boolean mask of the ``k = ceil(fraction * n)`` largest scores (exactly k)."""
  n = score.shape[0]
  if static_k is not None:
    _, idx = jax.lax.top_k(score, static_k)
    return jnp.zeros((n,), bool).at[idx].set(True)
  k = jnp.ceil(fraction * n).astype(jnp.int32)
  order = jnp.argsort(-score, stable=True)
  ranks = jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
  return ranks < k


def top_k_mask(
    fraction: float = 0.3,
    error_feedback: bool = True,
    method: str = "exact",
    frequency_weight: Optional[float] = None,
    min_size: int = 0,
    warmup_steps: int = 0,
    *,
    frequency_decay: float = 0.9,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
  r"""Keeps the largest ``fraction`` of each leaf's entries, with error feedback.

  Per leaf of ``n`` entries, with ``r`` the error-feedback residual (zero when
  ``error_feedback=False``):

  .. math::
    a = g + r,\qquad \text{score} = |a| \;\text{ or, with } b > 0,\;
    (1-b)\,|a|/\operatorname{mean}|a| - b f

    \text{out} = a \odot \text{keep},\qquad r \leftarrow a - \text{out}

  where ``keep`` marks the ``k = ceil(fraction * n)`` largest scores
  (``method="exact"``: exactly ``k``, ties broken by position, via
  ``lax.top_k``, which sorts the leaf) or the scores above a threshold
  estimated from a random sample of ``max(1024, n/100)`` entries by bisection
  (``method="sampled"``: O(n), keeps about ``k``; the key lives in the state).
  ``f`` is the EMA (decay ``frequency_decay``) of the kept indicator, so with
  ``frequency_weight = b > 0`` entries updated often yield to rarely updated
  ones (the article's "update frequency" term). ``frequency_weight=None`` (the
  default) switches the term off and keeps no frequency buffer; any number,
  0 included, keeps one (so that ``optax.inject_hyperparams``, which turns
  numbers into arrays, gives the same state as the plain transform).

  With error feedback nothing is lost: ``sum_t out_t + r_T == sum_t g_t``.
  Leaves with ``n < min_size`` pass dense. During the first ``warmup_steps``
  steps the kept fraction ramps exponentially from 1 to ``fraction``,
  ``fraction ** (t / warmup_steps)`` (Deep Gradient Compression's sparsity
  warm-up).

  Args:
    fraction: kept fraction, in (0, 1].
    error_feedback: carry the masked-out part to the next step.
    method: ``"exact"`` or ``"sampled"``.
    frequency_weight: ``b`` in [0, 1], or ``None`` (off, no buffer).
    min_size: leaves smaller than this pass dense, int >= 0.
    warmup_steps: length of the sparsity warm-up, int >= 0.
    frequency_decay: EMA decay of the kept indicator, in [0, 1).
    seed: seed of the sampling key.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Examples:
    >>> import jax.numpy as jnp, grpo_optax
    >>> tx = grpo_optax.top_k_mask(fraction=0.5)
    >>> g = {"w": jnp.array([0.1, -3.0, 2.0, 0.5])}
    >>> out, state = tx.update(g, tx.init(g))
    >>> out["w"], state.residual["w"]
    (Array([ 0., -3.,  2.,  0.], dtype=float32), Array([0.1, 0. , 0. , 0.5], dtype=float32))

  References:
    Lin et al., `Deep Gradient Compression
    <https://arxiv.org/abs/1712.01887>`_, ICLR 2018.
    Stich et al., `Sparsified SGD with Memory
    <https://arxiv.org/abs/1809.07599>`_, NeurIPS 2018.
    Karimireddy et al., `Error Feedback Fixes SignSGD
    <https://arxiv.org/abs/1901.09847>`_, ICML 2019.
  """
  _common.check_range("fraction", fraction, 0.0, 1.0, low_inclusive=False)
  _common.check_choice("method", method, METHODS)
  if frequency_weight is not None:
    _common.check_range("frequency_weight", frequency_weight, 0.0, 1.0)
  _common.check_range("frequency_decay", frequency_decay, 0.0, 1.0,
                      high_inclusive=False)
  static_min_size = static_int("min_size", min_size, 0)
  static_warmup = static_int("warmup_steps", warmup_steps, 0)
  static_int("seed", seed, 0)
  if not isinstance(error_feedback, bool):
    raise TypeError("error_feedback must be a bool")
  static_fraction = _common.concrete_value(fraction)
  # Structural choice from a static value (None or not), never from a number.
  use_frequency = frequency_weight is not None
  fraction = _common.f32(fraction)
  frequency_weight = _common.f32(frequency_weight)
  frequency_decay = _common.f32(frequency_decay)

  def init_fn(params):
    return TopKMaskState(
        count=jnp.zeros([], jnp.int32),
        residual=optax.tree.zeros_like(params) if error_feedback else None,
        frequency=(optax.tree.zeros_like(params, dtype=jnp.float32)
                   if use_frequency else None),
        key=jax.random.PRNGKey(seed),
        kept_fraction=jnp.ones([], jnp.float32))

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    use_frequency = state.frequency is not None
    t = state.count
    if static_warmup == 0:
      frac = fraction
    else:
      w = jnp.maximum(jnp.asarray(warmup_steps, jnp.float32), 1.0)
      frac = jnp.asarray(fraction, jnp.float32) ** (
          jnp.minimum(t.astype(jnp.float32), w) / w)
      if static_warmup is None:  # traced warmup_steps: 0 means no warm-up
        frac = jnp.where(jnp.asarray(warmup_steps) > 0, frac, fraction)
    dynamic_frac = static_warmup != 0 or static_fraction is None

    leaves, treedef = jax.tree.flatten(updates)
    res = (treedef.flatten_up_to(state.residual) if error_feedback
           else [None] * len(leaves))
    freq = (treedef.flatten_up_to(state.frequency) if use_frequency
            else [None] * len(leaves))
    key, sample_key = jax.random.split(state.key)
    # One random draw for every sampled leaf (a draw per leaf would multiply
    # the compiled program by the number of leaves).
    sizes = [sample_size(g.size) for g in leaves]
    offsets = [0]
    for g, m in zip(leaves, sizes):
      offsets.append(offsets[-1] + (m if method == "sampled" and m < g.size else 0))
    uniform = (jax.random.uniform(sample_key, (offsets[-1],))
               if offsets[-1] else None)

    # Phase 1: scores, and the samples of the leaves that use a threshold.
    entries = []
    for i, (g, r, f) in enumerate(zip(leaves, res, freq)):
      n = g.size
      a = g if r is None else (g + r).astype(g.dtype)
      dense = n == 0 or (static_min_size is not None and n < static_min_size)
      score = sample = None
      if not dense:
        score = jnp.abs(a.reshape(-1)).astype(jnp.float32)
        if use_frequency:
          score = ((1 - frequency_weight) * score / (jnp.mean(score) + 1e-30)
                   - frequency_weight * f.reshape(-1))
        if method == "sampled":
          sample = draw_sample(score, uniform=(
              None if offsets[i + 1] == offsets[i]
              else uniform[offsets[i]:offsets[i + 1]]))
      entries.append((g, r, f, a, dense, score, sample))
    sampled = [e[6] for e in entries if e[6] is not None]
    thresholds = iter(bisect_thresholds(sampled, frac) if sampled else [])

    # Phase 2: masks, outputs and residuals.
    outs, new_res, new_freq = [], [], []
    kept = jnp.zeros((), jnp.float32)
    total = 0
    for g, r, f, a, dense, score, sample in entries:
      n = g.size
      total += n
      if dense:
        keep = jnp.ones(g.shape, bool)
        kept_n = jnp.asarray(n, jnp.float32)
      else:
        if method == "exact":
          static_k = None if dynamic_frac else math.ceil(static_fraction * n)
          keep = _exact_mask(score, frac, static_k)
          kept_n = (jnp.asarray(static_k, jnp.float32) if static_k is not None
                    else jnp.ceil(frac * n))
        else:
          thr = next(thresholds)
          # Entries that are exactly zero carry nothing: a mass of zeros (e.g.
          # unused embedding rows) must not drag the threshold to 0 and be
          # "kept" wholesale.
          nonzero = a.reshape(-1) != 0
          keep = (score >= thr) & nonzero
          # Estimated on a strided sample: no extra pass over the leaf.
          kept_n = n * jnp.mean(
              (_common.strided_sample(score, _KEPT_SAMPLE) >= thr)
              & (_common.strided_sample(nonzero, _KEPT_SAMPLE)),
              dtype=jnp.float32)
        keep = keep.reshape(g.shape)
        if static_min_size is None:  # traced min_size
          is_small = n < jnp.asarray(min_size)
          keep = keep | is_small
          kept_n = jnp.where(is_small, n, kept_n)
      out = jnp.where(keep, a, jnp.zeros_like(a))
      outs.append(out)
      if r is not None:
        new_res.append(jnp.where(keep, jnp.zeros_like(a), a).astype(r.dtype))
      if f is not None:
        new_freq.append(frequency_decay * f + (1 - frequency_decay) * keep)
      kept = kept + kept_n

    new_state = TopKMaskState(
        count=optax.safe_increment(t),
        residual=treedef.unflatten(new_res) if error_feedback else None,
        frequency=(treedef.unflatten([x.astype(jnp.float32) for x in new_freq])
                   if use_frequency else None),
        key=key,
        kept_fraction=kept / max(total, 1) if total else jnp.ones([], jnp.float32))
    return treedef.unflatten(outs), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def ema_threshold_mask(
    alpha: float = 0.7,
    every: int = 100,
    scale: float = 1.0,
    error_feedback: bool = True,
) -> optax.GradientTransformationExtraArgs:
  r"""Keeps entries whose magnitude exceeds a slowly moving per-leaf threshold.

  Per leaf, with ``r`` the error-feedback residual and ``t`` the step count
  before this step:

  .. math::
    a = g + r,\qquad
    \tau \leftarrow \begin{cases}
      \operatorname{mean}|a| & t = 0\\
      \alpha \operatorname{mean}|a| + (1-\alpha)\tau & t > 0,\ t \bmod N = 0\\
      \tau & \text{otherwise}\end{cases}

    \text{out} = a \odot [\,|a| \ge c\,\tau\,],\qquad r \leftarrow a - \text{out}

  with ``N = every`` and ``c = scale``. One O(n) pass, no sort; the mean is
  only computed on the steps that move ``τ`` (a ``lax.cond``). The kept
  fraction is whatever the threshold gives: it drifts when the gradient scale
  drifts between refreshes, so the state reports it (``kept_fraction``).

  Args:
    alpha: EMA weight of the new mean, in (0, 1] (article: 0.7).
    every: refresh period ``N`` in steps, int >= 1 (article: 100).
    scale: multiplier ``c`` of the threshold, >= 0.
    error_feedback: carry the masked-out part to the next step.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Examples:
    >>> import jax.numpy as jnp, grpo_optax
    >>> tx = grpo_optax.ema_threshold_mask()
    >>> g = {"w": jnp.array([0.1, -3.0, 2.0, 0.5])}
    >>> out, state = tx.update(g, tx.init(g))
    >>> out["w"], state.tau
    (Array([ 0., -3.,  2.,  0.], dtype=float32), Array([1.4], dtype=float32))

  References:
    Lin et al., `Deep Gradient Compression
    <https://arxiv.org/abs/1712.01887>`_, ICLR 2018.
    Seetharaman et al., `AutoClip: Adaptive Gradient Clipping
    <https://arxiv.org/abs/2007.14469>`_, 2020.
  """
  _common.check_range("alpha", alpha, 0.0, 1.0, low_inclusive=False)
  static_int("every", every, 1)
  _common.check_range("scale", scale, 0.0)
  if not isinstance(error_feedback, bool):
    raise TypeError("error_feedback must be a bool")
  alpha = _common.f32(alpha)
  scale = _common.f32(scale)

  def init_fn(params):
    n_leaves = len(jax.tree.leaves(params))
    return EmaThresholdMaskState(
        count=jnp.zeros([], jnp.int32),
        residual=optax.tree.zeros_like(params) if error_feedback else None,
        tau=jnp.zeros((n_leaves,), jnp.float32),
        kept_fraction=jnp.ones([], jnp.float32))

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    t = state.count
    leaves, treedef = jax.tree.flatten(updates)
    if state.tau.shape != (len(leaves),):
      raise ValueError(
          f"ema_threshold_mask: the state was built for {state.tau.shape[0]}"
          f" leaves but the updates have {len(leaves)}")
    res = (treedef.flatten_up_to(state.residual) if error_feedback
           else [None] * len(leaves))
    a_leaves = [g if r is None else (g + r).astype(g.dtype)
                for g, r in zip(leaves, res)]
    refresh = (t == 0) | (t % jnp.asarray(every, t.dtype) == 0)

    old_tau = [state.tau[i] for i in range(len(leaves))]

    def new_tau(a_leaves):
      # Per-leaf scalars, not one stacked vector: XLA would otherwise fuse the
      # vector's computation (all leaves' means) into every leaf's mask.
      return tuple(
          jnp.where(t == 0, m, alpha * m + (1 - alpha) * old).astype(jnp.float32)
          for m, old in zip((_common.mean32(jnp.abs(a)) for a in a_leaves),
                            old_tau))

    tau = jax.lax.cond(refresh, new_tau, lambda _: tuple(old_tau), a_leaves)
    outs, new_res = [], []
    kept = jnp.zeros((), jnp.float32)
    total = 0
    for i, (a, r) in enumerate(zip(a_leaves, res)):
      thr = (scale * tau[i]).astype(a.dtype)
      keep = (jnp.abs(a) >= thr) & (a != 0)  # zeros carry nothing
      outs.append(jnp.where(keep, a, jnp.zeros_like(a)))
      if r is not None:
        new_res.append(jnp.where(keep, jnp.zeros_like(a), a).astype(r.dtype))
      # Estimated on a strided sample: no extra pass over the leaf.
      a_s = _common.strided_sample(a, _KEPT_SAMPLE)
      kept = kept + a.size * jnp.mean((jnp.abs(a_s) >= thr) & (a_s != 0),
                                      dtype=jnp.float32)
      total += a.size
    new_state = EmaThresholdMaskState(
        count=optax.safe_increment(t),
        residual=treedef.unflatten(new_res) if error_feedback else None,
        tau=(jnp.stack(tau) if tau else state.tau),
        kept_fraction=kept / max(total, 1) if total else jnp.ones([], jnp.float32))
    return treedef.unflatten(outs), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
