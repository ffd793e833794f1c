"""Top-k and EMA-threshold gradient masking with error feedback (mechanisms 3, 4).

Article 004 §1.2 and §2.2 update only a subset of the parameters: the top 30%
by a score mixing the gradient's magnitude and the parameter's update history
("adaptive sampling"), with a threshold re-estimated every 100 steps as an EMA
of the mean gradient magnitude. Both are pinned here as masks with error
feedback (the masked-out part is carried to the next step, so nothing is lost),
computed per leaf: the whole model is never concatenated or sorted at once.

This module is the masks' room: the transforms :func:`top_k_mask` and
:func:`ema_threshold_mask`, their states, and the per-leaf functions
(:func:`accumulate`, :func:`sampled_thresholds`, :func:`ema_taus`,
:func:`keep_mask`) that the fused core of :func:`grpo_optax.grpo`
(:mod:`grpo_optax.fused`) calls too, so that both compute one algorithm.

State layout (both masks): with error feedback the state keeps the last
step's *accumulated* gradient ``acc = g + r`` and its per-leaf threshold;
the residual carried to the next step is the part of ``acc`` below the
threshold (:func:`residual_of`). Storing ``acc`` rather than ``r`` lets every
consumer of the masked gradient read the freshly written ``acc``, so XLA never
copies a donated state buffer to keep an old value alive (see
``docs/design.md``). A threshold below 0 marks a leaf whose accumulator holds
its residual directly (the exact top-k and the frequency-weighted score,
whose masks are not a threshold on ``|acc|``).

Samples are grids ``x[o_0::s_0, o_1::s_1, ...]``
(:func:`grpo_optax._common.sample_strides`): no flattening and no gather, so
a sharded leaf is sampled shard by shard and the only collectives of a mask
are scalar all-reduces.
"""

from __future__ import annotations

import math
import warnings
from typing import Any
from typing import NamedTuple
from typing import cast

import jax
import jax.numpy as jnp
import optax

from grpo_optax import _common

__all__ = (
  "EmaThresholdMaskState",
  "TopKMaskState",
  "ema_threshold_mask",
  "top_k_mask",
)

METHODS = ("exact", "sampled")
_MIN_SAMPLE = 1024  # floor on the sample size of the sampled threshold
_MAX_SAMPLE = 65536  # cap on it (the quantile error is ~0.2% there)
_SAMPLE_RATE = 0.01  # fraction of a leaf sampled (Deep Gradient Compression)
_MEAN_SAMPLE = 4096  # grid sample of the threshold mask's mean |a|
_BISECTION_STEPS = 24
RESIDUAL_ONLY = -1.0  # threshold of a leaf whose accumulator is its residual


# --------------------------------------------------------------------------
# Per-element formulas.


def keep_mask(a: Any, threshold: Any) -> Any:
  """Entries with ``|a| >= threshold``; exact zeros are never kept."""
  return (jnp.abs(a) >= threshold) & (a != 0)


def split_by_mask(a: Any, keep: Any) -> tuple[Any, Any]:
  """``(a where kept else 0, a where not kept else 0)``: output and residual."""
  zero = jnp.zeros_like(a)
  return jnp.where(keep, a, zero), jnp.where(keep, zero, a)


def residual_of(acc: jax.Array, threshold: jax.Array) -> jax.Array:
  """The residual held by an accumulator and its (last step's) threshold."""
  thr = threshold.astype(acc.dtype)
  keep = keep_mask(acc, thr) & (thr >= 0)
  return jnp.where(keep, jnp.zeros_like(acc), acc)


def accumulate(
  g: jax.Array, acc: jax.Array | None, threshold: jax.Array
) -> jax.Array:
  """``a = g + r``: the gradient plus the residual of the last step."""
  if acc is None:
    return g
  return g + residual_of(acc, threshold).astype(g.dtype)


def ema_threshold(
  tau: Any, mean_abs: Any, alpha: Any, count: Any, every: Any
) -> Any:
  """The EMA threshold after a step with count ``count`` (before the step).

  ``mean_abs`` at the first step; ``alpha * mean_abs + (1 - alpha) * tau``
  every ``every`` steps; unchanged otherwise.
  """
  refreshed = jnp.where(
    count == 0, mean_abs, alpha * mean_abs + (1 - alpha) * tau
  )
  refresh = (count == 0) | (count % jnp.asarray(every, count.dtype) == 0)
  return jnp.where(refresh, refreshed, tau)


# --------------------------------------------------------------------------
# Per-leaf reductions shared with the fused core.


def static_int(name, value, low):
  """``value`` as a Python int (validated), or None if it is traced."""
  return _common.check_int(name, value, low)


def warmup_fraction(fraction: Any, warmup_steps: Any, count: jax.Array) -> Any:
  """Deep Gradient Compression's exponential sparsity warm-up.

  ``fraction ** (min(t, T) / T)`` with ``T = warmup_steps`` (1 at ``t = 0``),
  or ``fraction`` when ``warmup_steps`` is 0.
  """
  static = static_int("warmup_steps", warmup_steps, 0)
  if static == 0:
    return fraction
  w = jnp.maximum(jnp.asarray(warmup_steps, jnp.float32), 1.0)
  frac = jnp.asarray(fraction, jnp.float32) ** (
    jnp.minimum(count.astype(jnp.float32), w) / w
  )
  if static is None:  # traced warmup_steps: 0 means no warm-up
    frac = jnp.where(jnp.asarray(warmup_steps) > 0, frac, fraction)
  return frac


def dense_leaf(size: int, min_size: Any) -> Any:
  """Whether a leaf passes dense: True/False, or a traced bool."""
  static = static_int("min_size", min_size, 0)
  if size == 0:
    return True
  if static is not None:
    return size < static
  return size < jnp.asarray(min_size)


def sample_size(n: int) -> int:
  """Size of the random sample of the sampled threshold for a leaf of ``n``."""
  return min(n, max(_MIN_SAMPLE, min(_MAX_SAMPLE, math.ceil(_SAMPLE_RATE * n))))


_OFFSET_BITS = 8  # one random word per axis position (axes >= 8 wrap)


def _random_offsets(seed: Any, count: jax.Array, strides_list) -> list[Any]:
  """One draw per step; axis ``d`` of every leaf reads word ``d mod 8``.

  A leaf's offsets depend on its shape and the draw only (not on which
  other leaves are sampled), and leaves of one shape share them, which keeps
  the compiled program small (XLA merges the identical scalar arithmetic).
  """
  if not any(any(s > 1 for s in st) for st in strides_list):
    return [None] * len(strides_list)
  key = jax.random.PRNGKey(jnp.asarray(seed, jnp.uint32))
  bits = jax.random.bits(
    jax.random.fold_in(key, count), (_OFFSET_BITS,), jnp.uint32
  )
  out = []
  for strides in strides_list:
    offs = [
      (bits[d % _OFFSET_BITS] % jnp.uint32(s)).astype(jnp.int32)
      for d, s in enumerate(strides)
    ]
    out.append(None if all(s == 1 for s in strides) else offs)
  return out


def random_samples(
  scores: list[jax.Array], seed: Any, count: jax.Array
) -> list[jax.Array]:
  """A random grid of ``max(1024, n/100)`` (at most 65,536) entries per leaf.

  The grid's strides are fixed by the leaf's shape; its offsets are drawn
  afresh every step from ``(seed, count)``, one draw for all leaves, so a
  transform and the fused core given the same seed sample the same entries.
  """
  strides = [
    _common.sample_strides(x.shape, sample_size(x.size)) for x in scores
  ]
  offsets = _random_offsets(seed, count, strides)
  return [
    _common.grid_sample(x, s, o) if o is not None else x
    for x, s, o in zip(scores, strides, offsets)
  ]


def bisect_thresholds(
  samples: list[jax.Array], fraction, with_kept: bool = False
):
  """For each sample, the value above which ``fraction`` of it lies.

  24 bisection steps between the sample's min and max, counting entries
  ``>= mid``: O(m) per step and no sort. All samples share one loop whose
  carry holds one ``(lo, hi, count at lo)`` triple per sample; each sample
  is counted by its own reduction over all of its axes, so a sharded sample
  is counted shard by shard plus a scalar all-reduce.

  Args:
    samples: float arrays of any shape.
    fraction: the fraction to keep, in (0, 1] (may be traced).
    with_kept: also return each sample's kept fraction at its threshold.

  Returns:
    One scalar threshold per sample (0, i.e. keep every non-zero entry, when
    ``fraction >= 1``); with ``with_kept``, ``(thresholds, kept fractions)``.
  """
  if not samples:
    return ([], []) if with_kept else []
  samples = [x.astype(jnp.float32) for x in samples]
  # One reduction per sample and step (stacking the samples of one shape
  # would cut the program but makes XLA reshard samples of differently
  # sharded leaves).
  targets = [fraction * x.size for x in samples]

  def body(_, bounds):
    out = []
    for x, target, (lo, hi, c_lo) in zip(samples, targets, bounds):
      mid = 0.5 * (lo + hi)
      count = jnp.sum(x >= mid, dtype=jnp.float32)
      keeps_enough = count >= target
      out.append(
        (
          jnp.where(keeps_enough, mid, lo),
          jnp.where(keeps_enough, hi, mid),
          jnp.where(keeps_enough, count, c_lo),
        )
      )
    return out

  def start(x):
    lo, hi = jnp.min(x), jnp.max(x)
    # The count at lo (all of x) as a value of x's type: inside shard_map a
    # constant would be invariant while the loop's count varies like x.
    return lo, hi, jnp.where(False, hi, jnp.float32(x.size))

  bounds = jax.lax.fori_loop(
    0, _BISECTION_STEPS, body, [start(x) for x in samples]
  )
  # Keeping everything (a warm-up's first step) must not drop the entries
  # that lie below the sample's minimum.
  keep_all = jnp.asarray(fraction) >= 1
  thresholds = [jnp.where(keep_all, 0.0, lo) for lo, _, _ in bounds]
  kept = [
    jnp.where(keep_all, 1.0, c / x.size)
    for (_, _, c), x in zip(bounds, samples)
  ]
  if not with_kept:
    return thresholds
  return thresholds, kept


def sampled_thresholds(
  abs_leaves: list[jax.Array],
  fraction,
  seed: Any,
  count: jax.Array,
  with_kept: bool = False,
):
  """Per leaf, the threshold on ``|a|`` that keeps about ``fraction``."""
  return bisect_thresholds(
    random_samples(abs_leaves, seed, count), fraction, with_kept
  )


def ema_taus(
  abs_leaves: list[jax.Array],
  taus: list[jax.Array],
  alpha,
  count: jax.Array,
  every,
) -> list[jax.Array]:
  """Per leaf, the EMA threshold ``tau`` after this step.

  ``mean|a|`` comes from a fixed grid of about 4,096 entries of the leaf (one
  reduction, local to each shard plus a scalar all-reduce).
  """
  out = []
  for x, tau in zip(abs_leaves, taus):
    mean_abs = jnp.mean(
      _common.strided_sample(x, _MEAN_SAMPLE), dtype=jnp.float32
    )
    out.append(
      ema_threshold(tau, mean_abs, alpha, count, every).astype(jnp.float32)
    )
  return out


def sampled_kept(a: jax.Array, threshold: jax.Array) -> jax.Array:
  """Kept fraction of a leaf estimated on a fixed grid of ~4,096 entries."""
  x = _common.strided_sample(a, _MEAN_SAMPLE)
  return jnp.mean(keep_mask(x, threshold.astype(x.dtype)), dtype=jnp.float32)


def exact_kept_fraction(accumulator, thresholds) -> jax.Array:
  """Exact kept fraction of the last step, from an accumulator state."""
  kept, total = jnp.zeros((), jnp.float32), 0
  for a, th in zip(jax.tree.leaves(accumulator), _common.unstack(thresholds)):
    n = jnp.sum(keep_mask(a, th.astype(a.dtype)) & (th >= 0), dtype=jnp.float32)
    kept = kept + jnp.where(
      th >= 0, n, a.size - jnp.sum(a != 0, dtype=jnp.float32)
    )
    total += a.size
  return kept / total if total else jnp.ones((), jnp.float32)


def _residual_tree(accumulator, thresholds):
  if accumulator is None:
    return None
  leaves, treedef = jax.tree.flatten(accumulator)
  return treedef.unflatten(
    [residual_of(a, t) for a, t in zip(leaves, _common.unstack(thresholds))]
  )


def _mask_metrics(state) -> dict[str, jax.Array]:
  kept = state.kept_fraction
  if kept is None:
    kept = jnp.where(
      state.count > 0,
      exact_kept_fraction(state.accumulator, state.thresholds),
      1.0,
    )
  out = {"kept_fraction": kept}
  res = state.residual
  if res is not None:
    out["residual_norm"] = jnp.sqrt(
      sum(
        (
          jnp.sum(_common.abs_sq(x), dtype=jnp.float32)
          for x in jax.tree.leaves(res)
        ),
        jnp.zeros((), jnp.float32),
      )
    )
  return out


# --------------------------------------------------------------------------
# States.


class TopKMaskState(NamedTuple):
  """State of :func:`top_k_mask` (and of the fused core's top-k)."""

  count: jax.Array  # shape=(), dtype=int32
  # Error feedback (None when off): the last step's a = g + r, or for leaves
  # whose threshold is < 0, the residual itself.
  accumulator: optax.Updates | None
  thresholds: jax.Array  # shape=(num_leaves,), float32, tree order
  frequency: optax.Updates | None  # EMA of the kept indicator; None off
  # shape=(), float32: kept / total at the last step, estimated on the
  # samples (exact for the exact method); None with error feedback, where
  # metrics() reads it exactly from the accumulator
  kept_fraction: jax.Array | None

  @property
  def residual(self) -> optax.Updates | None:
    """The error-feedback residual carried to the next step (None if off)."""
    return _residual_tree(self.accumulator, self.thresholds)

  def metrics(self) -> dict[str, jax.Array]:
    return _mask_metrics(self)


class EmaThresholdMaskState(NamedTuple):
  """State of :func:`ema_threshold_mask` (and of the fused core's)."""

  count: jax.Array  # shape=(), dtype=int32
  accumulator: optax.Updates | None  # as in TopKMaskState
  thresholds: jax.Array  # shape=(num_leaves,), float32: scale * tau
  tau: jax.Array  # shape=(num_leaves,), float32 EMA thresholds, tree order
  # shape=(), float32, estimated on grid samples; None with error feedback
  kept_fraction: jax.Array | None

  @property
  def residual(self) -> optax.Updates | None:
    """The error-feedback residual carried to the next step (None if off)."""
    return _residual_tree(self.accumulator, self.thresholds)

  def metrics(self) -> dict[str, jax.Array]:
    out = _mask_metrics(self)
    out["tau_mean"] = (
      jnp.mean(self.tau) if self.tau.size else jnp.zeros((), jnp.float32)
    )
    return out


def _scalars(params, value=0.0) -> jax.Array:
  return _common.leaf_scalars(params, value)


def _check_leaves(who, state, updates, leaves):
  """The updates against the state: their leaf paths and shapes against a
  params-shaped buffer of the state (if it keeps one), their count against
  the per-leaf vectors.
  """
  like = state.accumulator
  if like is None:
    like = getattr(state, "frequency", None)
  if like is not None:
    _common.check_tree_like(who, updates, like)
  state_thresholds = state.thresholds
  if state_thresholds.shape[0] != len(leaves):
    raise ValueError(
      f"{who}: the state was built for {state_thresholds.shape[0]} leaves but"
      f" the updates have {len(leaves)}"
    )


def _out_dtype(a, acc):
  """The gradient's dtype promoted with the accumulator's (which follows the
  params), as optax's stateful transforms do: float32 for bfloat16 gradients
  of float32 params.
  """
  return jnp.promote_types(a.dtype, acc.dtype)


def _flat_or_none(tree, treedef, n):
  return [None] * n if tree is None else treedef.flatten_up_to(tree)


# --------------------------------------------------------------------------
# Top-k.


def _exact_mask(score: jax.Array, fraction, static_k: int | None):
  """Boolean mask of the ``k = ceil(fraction * n)`` largest scores (exactly k)."""
  flat = score.reshape(-1)
  n = flat.shape[0]
  if static_k is not None:
    _, idx = jax.lax.top_k(flat, static_k)
    keep = jnp.zeros((n,), bool).at[idx].set(True)
  else:
    k = jnp.ceil(fraction * n).astype(jnp.int32)
    order = jnp.argsort(-flat, stable=True)
    ranks = (
      jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
    )
    keep = ranks < k
  return keep.reshape(score.shape)


def _warn_if_sharded(x: jax.Array) -> None:
  if _common.explicit_spec(x) is not None:
    raise ValueError(
      "top_k_mask(method='exact') sorts whole leaves and cannot take a "
      f"leaf sharded on an Explicit mesh (spec {_common.explicit_spec(x)});"
      " use method='sampled' (grpo's default) for sharded parameters"
    )
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is not None and not mesh.empty and x.size > 1:
    warnings.warn(
      "top_k_mask(method='exact') sorts a whole leaf: on a sharded leaf XLA "
      "gathers it onto every device. Use method='sampled' for sharded "
      "parameters.",
      UserWarning,
      stacklevel=4,
    )


def _score_masks(
  a_leaves,
  dense,
  frac,
  method,
  static_fraction,
  freq,
  frequency_weight,
  seed,
  t,
):
  """Masks of the exact or frequency-weighted top-k (not a threshold on |a|).

  ``static_fraction``: the kept fraction as a Python float when it is static
  (no warm-up, not traced), else None.
  """
  keeps, kept = [], []
  for a, d, f in zip(a_leaves, dense, freq):
    if d is True:
      keeps.append(jnp.ones(a.shape, bool))
      kept.append(jnp.ones((), jnp.float32))
      continue
    score = jnp.abs(a).astype(jnp.float32)
    if f is not None:
      score = (1 - frequency_weight) * score / (
        jnp.mean(score) + 1e-30
      ) - frequency_weight * f
    if method == "exact":
      _warn_if_sharded(a)
      static_k = (
        None if static_fraction is None else math.ceil(static_fraction * a.size)
      )
      keep = _exact_mask(score, frac, static_k) & (a != 0)
      k = jnp.sum(keep, dtype=jnp.float32) / a.size
    else:
      # without with_kept, a list of one threshold per sample
      thr = cast(
        jax.Array,
        sampled_thresholds([score - jnp.min(score)], frac, seed, t)[0],
      )
      keep = (score - jnp.min(score) >= thr) & (a != 0)
      k = sampled_kept(jnp.where(keep, 1.0, 0.0), jnp.asarray(0.5))
    if d is not False:  # traced min_size
      keep = keep | d
      k = jnp.where(d, 1.0, k)
    keeps.append(keep)
    kept.append(k)
  return keeps, kept


def top_k_mask(
  fraction: float = 0.3,
  error_feedback: bool = True,
  method: str = "exact",
  frequency_weight: float | None = None,
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
  ``lax.top_k``, which sorts the whole leaf: on a sharded leaf XLA gathers
  it, so it warns when it can see a mesh) or the scores above a threshold
  bisected on a random grid sample of ``max(1024, n/100)`` entries
  (``method="sampled"``: O(n), keeps about ``k``; the grid's offsets are
  drawn every step from ``(seed, count)``; the grid is taken shard by shard
  on a sharded leaf). Exact zeros are never kept. ``f`` is the EMA (decay
  ``frequency_decay``) of the kept indicator, so with
  ``frequency_weight = b > 0`` entries updated often yield to rarely updated
  ones (the article's "update frequency" term). ``frequency_weight=None``
  (the default) switches the term off and keeps no frequency buffer.

  With error feedback nothing is lost: ``sum_t out_t + r_T == sum_t g_t``
  (``state.residual`` is ``r_T``). Leaves with ``n < min_size`` pass dense.
  During the first ``warmup_steps`` steps the kept fraction ramps
  exponentially from 1 to ``fraction``, ``fraction ** (t / warmup_steps)``
  (Deep Gradient Compression's sparsity warm-up).

  Args:
    fraction: kept fraction, in (0, 1].
    error_feedback: carry the masked-out part to the next step.
    method: ``"exact"`` or ``"sampled"``.
    frequency_weight: ``b`` in [0, 1], or ``None`` (off, no buffer).
    min_size: leaves smaller than this pass dense, int >= 0.
    warmup_steps: length of the sparsity warm-up, int >= 0.
    frequency_decay: EMA decay of the kept indicator, in [0, 1).
    seed: seed of the sample's offsets, int >= 0.

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
  _common.check_range(
    "frequency_decay", frequency_decay, 0.0, 1.0, high_inclusive=False
  )
  static_int("min_size", min_size, 0)
  static_warmup = static_int("warmup_steps", warmup_steps, 0)
  static_int("seed", seed, 0)
  _common.check_bool("error_feedback", error_feedback)
  static_fraction = (
    _common.concrete_value(fraction) if static_warmup == 0 else None
  )
  use_frequency = frequency_weight is not None
  by_threshold = method == "sampled" and not use_frequency
  fraction = _common.f32(fraction)
  frequency_weight = _common.f32(frequency_weight)
  frequency_decay = _common.f32(frequency_decay)

  def init_fn(params):
    return TopKMaskState(
      count=jnp.zeros([], jnp.int32),
      accumulator=optax.tree.zeros_like(params) if error_feedback else None,
      thresholds=_scalars(params),
      frequency=(
        optax.tree.zeros_like(params, dtype=jnp.float32)
        if use_frequency
        else None
      ),
      kept_fraction=(
        None if error_feedback and by_threshold else jnp.ones([], jnp.float32)
      ),
    )

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    t = state.count
    leaves, treedef = jax.tree.flatten(updates)
    _check_leaves("top_k_mask", state, updates, leaves)
    accs = _flat_or_none(state.accumulator, treedef, len(leaves))
    freq = _flat_or_none(state.frequency, treedef, len(leaves))
    frac = warmup_fraction(fraction, warmup_steps, t)
    a_leaves = [
      accumulate(g, acc, th).astype(g.dtype)
      for g, acc, th in zip(leaves, accs, _common.unstack(state.thresholds))
    ]
    dense = [dense_leaf(g.size, min_size) for g in leaves]
    if by_threshold:
      thr, kept = topk_leaf_thresholds(
        a_leaves, dense, frac, seed, t, with_kept=not error_feedback
      )
      thresholds = _common.stack(thr, like=state.thresholds)
      keeps = [keep_mask(a, th.astype(a.dtype)) for a, th in zip(a_leaves, thr)]
    else:
      keeps, kept = _score_masks(
        a_leaves,
        dense,
        frac,
        method,
        static_fraction,
        freq,
        frequency_weight,
        seed,
        t,
      )
      thr = [jnp.asarray(RESIDUAL_ONLY, jnp.float32)] * len(leaves)
      thresholds = _common.stack(thr, like=state.thresholds)
    outs, new_acc = [], []
    for a, keep, acc in zip(a_leaves, keeps, accs):
      out, res = split_by_mask(a, keep)
      outs.append(out if acc is None else out.astype(_out_dtype(a, acc)))
      if acc is not None:
        new_acc.append((a if by_threshold else res).astype(acc.dtype))
    new_freq = None
    if use_frequency:
      new_freq = treedef.unflatten(
        [
          _common.ema(f, k, frequency_decay).astype(jnp.float32)
          for f, k in zip(freq, keeps)
        ]
      )
    return treedef.unflatten(outs), TopKMaskState(
      count=_common.safe_increment(t),
      accumulator=treedef.unflatten(new_acc) if error_feedback else None,
      thresholds=thresholds,
      frequency=new_freq,
      kept_fraction=(
        None
        if state.kept_fraction is None
        # kept is a list whenever kept_fraction is (no error feedback)
        else size_weighted(
          cast(list[jax.Array], kept), [g.size for g in leaves]
        )
        + 0 * state.kept_fraction
      ),
    )

  # The state's None fields (parts that are off) are empty pytrees, which
  # optax's OptState alias (ArrayTree) does not admit.
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]


def size_weighted(values: list[jax.Array], sizes: list[int]) -> jax.Array:
  """``sum(n_i v_i) / sum(n_i)`` as one dot product (1 for no entries)."""
  total = sum(sizes)
  if not total:
    return jnp.ones((), jnp.float32)
  return jnp.dot(
    jnp.stack([jnp.asarray(v, jnp.float32) for v in values]),
    jnp.asarray([n / total for n in sizes], jnp.float32),
    precision=jax.lax.Precision.HIGHEST,
  )


def topk_leaf_thresholds(a_leaves, dense, frac, seed, t, with_kept=False):
  """Thresholds of the sampled top-k: 0 (keep all) on dense leaves.

  Returns ``(thresholds, kept)``: ``kept`` (per-leaf kept fractions of the
  samples) is None unless ``with_kept``.
  """
  masked = [i for i, d in enumerate(dense) if d is not True]
  found, kept_found = sampled_thresholds(
    [jnp.abs(a_leaves[i]) for i in masked], frac, seed, t, with_kept=True
  )
  thr = [jnp.zeros((), jnp.float32)] * len(a_leaves)
  kept = [jnp.ones((), jnp.float32)] * len(a_leaves)
  for i, th, k in zip(masked, found, kept_found):
    thr[i] = th if dense[i] is False else jnp.where(dense[i], 0.0, th)
    kept[i] = k if dense[i] is False else jnp.where(dense[i], 1.0, k)
  return thr, (kept if with_kept else None)


# --------------------------------------------------------------------------
# EMA threshold.


def threshold_leaf_thresholds(
  a_leaves, dense, taus, alpha, t, every, scale
) -> tuple[list, list]:
  """``(thresholds, new taus)`` of the EMA threshold: 0 on dense leaves."""
  masked = [i for i, d in enumerate(dense) if d is not True]
  new = ema_taus(
    [jnp.abs(a_leaves[i]) for i in masked],
    [taus[i] for i in masked],
    alpha,
    t,
    every,
  )
  thr = [jnp.zeros((), jnp.float32)] * len(a_leaves)
  tau = list(taus)
  for i, tv in zip(masked, new):
    # A dense leaf keeps its tau (0), also when min_size is traced.
    tau[i] = tv if dense[i] is False else jnp.where(dense[i], taus[i], tv)
    th = (scale * tv).astype(jnp.float32)
    thr[i] = th if dense[i] is False else jnp.where(dense[i], 0.0, th)
  return thr, tau


def ema_threshold_mask(
  alpha: float = 0.7,
  every: int = 100,
  scale: float = 1.0,
  error_feedback: bool = True,
  min_size: int = 0,
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

  with ``N = every`` and ``c = scale``. One O(n) pass, no sort;
  ``mean|a|`` is estimated on a fixed grid of about 4,096 entries of the
  leaf. The kept fraction is whatever the threshold gives: it drifts when
  the gradient scale drifts between refreshes, so the state reports it
  (``kept_fraction``). Leaves with ``n < min_size`` pass dense.

  Args:
    alpha: EMA weight of the new mean, in (0, 1] (article: 0.7).
    every: refresh period ``N`` in steps, int >= 1 (article: 100).
    scale: multiplier ``c`` of the threshold, >= 0.
    error_feedback: carry the masked-out part to the next step.
    min_size: leaves smaller than this pass dense, int >= 0.

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
  static_int("min_size", min_size, 0)
  _common.check_bool("error_feedback", error_feedback)
  alpha = _common.f32(alpha)
  scale = _common.f32(scale)

  def init_fn(params):
    return EmaThresholdMaskState(
      count=jnp.zeros([], jnp.int32),
      accumulator=optax.tree.zeros_like(params) if error_feedback else None,
      thresholds=_scalars(params),
      tau=_scalars(params),
      kept_fraction=None if error_feedback else jnp.ones([], jnp.float32),
    )

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    t = state.count
    leaves, treedef = jax.tree.flatten(updates)
    _check_leaves("ema_threshold_mask", state, updates, leaves)
    accs = _flat_or_none(state.accumulator, treedef, len(leaves))
    a_leaves = [
      accumulate(g, acc, th).astype(g.dtype)
      for g, acc, th in zip(leaves, accs, _common.unstack(state.thresholds))
    ]
    dense = [dense_leaf(g.size, min_size) for g in leaves]
    thr, tau = threshold_leaf_thresholds(
      a_leaves, dense, _common.unstack(state.tau), alpha, t, every, scale
    )
    thresholds = _common.stack(thr, like=state.thresholds)
    thr = _common.unstack(thresholds)  # materialised (see fused.py)
    outs, new_acc, kept = [], [], []
    for a, th, acc in zip(a_leaves, thr, accs):
      keep = keep_mask(a, th.astype(a.dtype))
      out = jnp.where(keep, a, jnp.zeros_like(a))
      outs.append(out if acc is None else out.astype(_out_dtype(a, acc)))
      if not error_feedback:
        kept.append(sampled_kept(a, th))
      if acc is not None:
        new_acc.append(a.astype(acc.dtype))
    return treedef.unflatten(outs), EmaThresholdMaskState(
      count=_common.safe_increment(t),
      accumulator=treedef.unflatten(new_acc) if error_feedback else None,
      thresholds=thresholds,
      tau=_common.stack(tau, like=state.tau),
      kept_fraction=(
        None
        if error_feedback
        else size_weighted(kept, [g.size for g in leaves])
        + 0 * state.kept_fraction
      ),
    )

  # The state's None fields (parts that are off) are empty pytrees, which
  # optax's OptState alias (ArrayTree) does not admit.
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]
