"""The one-pass GRPO preset: every mechanism in one transform, shared statistics.

:func:`grpo_optax.grpo` builds this transform by default (``fused=True``).
It runs the chain's mechanisms -- clipping with L2, Taylor importance, top-k
or EMA-threshold masking with error feedback, the Nesterov + Adam/RMSProp mix,
the variance-based rate, the learning rate and freezing -- as one
elementwise pass per leaf, with statistics shared instead of kept per stage
(``SPEC.md`` section 1b):

* The Fisher diagonal of the importance score is Adam's own bias-corrected
  second moment ``nu_hat`` (this step's when importance acts on the
  adaptive step's output, the previous step's when it acts on its input;
  the squared gradient at the first step), not a second EMA of ``g^2``.
* The gradient variance of the variance rate is ``max(nu_hat - mu_hat^2, 0)``
  from Adam's moments (AdaBelief's "belief"), not a second pair of EMAs.
* Reductions over a leaf (importance normaliser, variance, freezing
  importance, the threshold mask's mean ``|a|``) come from strided samples
  of at most 1,024 entries (4,096 for the threshold mask), all of a leaf's
  statistics in one reduction. The top-k threshold is bisected on
  ``max(1024, n/100)`` (at most 65,536) entries taken every ``s``-th from a
  random start, ``s`` coprime with the leaf's size. The global-norm clip is
  exact.
* Parameter-sized state: ``mu``, ``nu``, the importance EMA ``score`` (when
  importance is on) and the error-feedback ``accumulator`` (when a mask with
  error feedback is on). Per-leaf scalars (thresholds, tau, freezing) are
  trees of scalars shaped like the params. Nothing else.

Every per-element formula comes from :mod:`grpo_optax._formulas`, shared
with the chain stages.

How it is laid out for XLA (measured on XLA:CPU, see ``benchmarks/``):

* Every state array is written in place into its donated buffer, so any
  other kernel that reads its old value must run before that write. XLA's
  copy insertion only trusts data dependencies for that order; a read of an
  old state array that nothing downstream of the write depends on makes XLA
  copy the whole array first. Statistics are read from the *new* state, and
  with error feedback the state keeps ``acc = a + r`` (not ``r``): the new
  ``acc`` is written first and everything else reads it.
* A value with two full-size inputs that feeds both a state write and the
  update is kept in memory as a parameter-sized temporary unless each
  consumer gets its own copy of the expression: the masked gradient reaches
  Adam's moments and the update as two different (equal-valued)
  expressions.
* Compile time grows with the number of kernel instances and of distinct
  kernels: per-leaf scalars are never sliced out of a stacked vector (that
  makes every leaf's kernels distinct), values that depend on every leaf
  reach the leaves' kernels as one materialised scalar, and a leaf's
  statistics share one reduction.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from grpo_optax import _common
from grpo_optax import _formulas as F
from grpo_optax import sparsify as sparsify_lib
from grpo_optax.freezing import FreezeBelowState

_STRIDED = _common.SAMPLE_PER_LEAF  # strided sample per leaf for statistics
_THRESHOLD_SAMPLE = 4096  # strided sample of the threshold mask's mean |a|
PLACEMENTS = ("output", "input")


class GrpoStats(NamedTuple):
  """Scalar diagnostics of :class:`GrpoState` (read by :func:`grpo_optax.metrics`).

  Fields of stages that are off are None. The importance weights'
  statistics are not computed by the update: :func:`grpo_optax.metrics`
  derives them from ``score`` and ``weight_bounds`` when asked, so that the
  step pays nothing for them.
  """

  clipped: Optional[jax.Array]  # shape=(), int32: steps with norm > max_norm
  grad_norm: Optional[jax.Array]  # shape=(), float32: norm before clipping
  # shape=(), float32: kept / total (masks without error feedback; with it,
  # :func:`kept_fraction` reads it exactly from the accumulator)
  kept_fraction: Optional[jax.Array]
  tau_mean: Optional[jax.Array]  # shape=(), float32: mean threshold
  variance: Optional[jax.Array]  # shape=(), float32: mean gradient variance
  lr_scale: Optional[jax.Array]  # shape=(), float32: mean 1/(1 + coef var)
  weight_bounds: Optional[jax.Array]  # shape=(2,): min_weight, max_weight


class GrpoState(NamedTuple):
  """State of the one-pass :func:`grpo_optax.grpo`."""

  count: jax.Array  # shape=(), dtype=int32
  mu: optax.Updates  # Adam's first moment
  nu: optax.Updates  # second moment (Adam, RMSProp, Fisher, variance)
  score: Optional[optax.Updates]  # importance EMA S; None when off
  # Error feedback (None when off): the last step's accumulated gradient
  # a + r; the residual carried to the next step is
  # ``where(|acc| >= thr and acc != 0, 0, acc)`` (see :func:`residual`).
  accumulator: Optional[optax.Updates]
  thresholds: Optional[optax.Updates]  # per-leaf float32 scalars (masks)
  tau: Optional[optax.Updates]  # per-leaf float32 scalars: threshold mask
  freeze: Optional[FreezeBelowState]  # per-leaf freezing; None when off
  stats: GrpoStats


def _initial_stats(*, clip, mask, threshold, variance, importance,
                   min_weight, max_weight) -> GrpoStats:
  z = jnp.zeros([], jnp.float32)
  one = jnp.ones([], jnp.float32)
  return GrpoStats(
      clipped=jnp.zeros([], jnp.int32) if clip else None,
      grad_norm=z if clip else None,
      kept_fraction=one if mask == "no_feedback" else None,
      tau_mean=z if threshold else None,
      variance=z if variance else None,
      lr_scale=one if variance else None,
      weight_bounds=(jnp.stack([jnp.asarray(min_weight, jnp.float32),
                                jnp.asarray(max_weight, jnp.float32)])
                     if importance else None))


def kept_fraction(state: GrpoState) -> Optional[jax.Array]:
  """Fraction of the entries the last step's mask kept (None without a mask).

  Exact, from the state: with error feedback, the entries of the accumulator
  at or above their leaf's threshold (leaves left dense by ``min_size`` have
  a threshold of -inf and count whole); without it, the update's estimate
  from strided samples.
  """
  if state.stats.kept_fraction is not None or state.thresholds is None:
    return state.stats.kept_fraction
  kept, total = jnp.zeros((), jnp.float32), 0
  for a, th in zip(jax.tree.leaves(state.accumulator),
                   jax.tree.leaves(state.thresholds)):
    n = jnp.sum(F.keep_mask(a, jnp.abs(a), th.astype(a.dtype)),
                dtype=jnp.float32)
    kept = kept + jnp.where(th == -jnp.inf, a.size, n)
    total += a.size
  return kept / total if total else jnp.ones((), jnp.float32)


def _compute_dtype(dtype) -> Any:
  return jnp.promote_types(dtype, jnp.float32)


def _check_dtypes(leaves, *, importance: bool, variance: bool,
                  freeze: bool) -> None:
  """Floating-point or complex gradients only; complex without the stages
  whose per-element statistics are defined for real values."""
  for x in leaves:
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.inexact):
      raise TypeError(
          f"grpo: gradients must be floating-point or complex, got a leaf of "
          f"dtype {dtype} (shape {jnp.shape(x)}); leave integer arrays out "
          f"of the optimized tree (e.g. nnx.Optimizer(..., wrt=nnx.Param) or "
          f"optax.masked)")
    if jnp.issubdtype(dtype, jnp.complexfloating):
      off = [name for name, on in (("importance", importance),
                                   ("variance_coef", variance),
                                   ("freeze_threshold", freeze)) if on]
      if off:
        raise TypeError(
            f"grpo: complex gradients (a leaf of dtype {dtype}) are "
            f"supported with clipping, the masks and the Adam step only; "
            f"switch off {', '.join(off)} (importance=False, "
            f"variance_coef=None, freeze_threshold=None)")


def _identity(x):
  return x


def _traced_once(fn):
  """Memoises ``fn(i)`` (the full leaf, ``take`` left at identity).

  Several kernels read the same per-leaf expression; tracing it once keeps
  the program that XLA compiles small (compile time grows with it).
  """
  cache = {}

  def wrapper(i, take=_identity):
    if take is not _identity:
      return fn(i, take)
    if i not in cache:
      cache[i] = fn(i)
    return cache[i]

  return wrapper


def _strided(x):
  return _common.strided_sample(x, _STRIDED)


def residual(state: GrpoState) -> Optional[optax.Updates]:
  """The error-feedback residual held by a one-pass state (None if off)."""
  if state.accumulator is None:
    return None
  return jax.tree.map(
      lambda a, th: F.split_by_mask(a, F.keep_mask(a, jnp.abs(a), th.astype(
          a.dtype)))[1], state.accumulator, state.thresholds)


def _sums(arrays: list[jax.Array]) -> list[jax.Array]:
  """Float32 sums of equally shaped arrays in one variadic reduction.

  One kernel per leaf for all of a leaf's statistics: XLA:CPU compiles and
  launches every reduction separately, and the number of kernel instances,
  not their size, is what the compile time of a many-leaf model grows with.
  """
  arrays = [x.astype(jnp.float32).reshape(-1) for x in arrays]
  zero = np.float32(0)
  return list(jax.lax.reduce(
      tuple(arrays), tuple(zero for _ in arrays),
      lambda xs, ys: tuple(x + y for x, y in zip(xs, ys)), (0,)))


def _means(arrays: list[jax.Array]) -> list[jax.Array]:
  """Float32 means of equally shaped arrays in one variadic reduction."""
  n = arrays[0].size
  return [x / n for x in _sums(arrays)]


def _weighted_sum(values: list[jax.Array], weights: np.ndarray) -> jax.Array:
  """``sum_i weights[i] * values[i]`` as one dot product.

  A value that depends on every leaf must reach the per-leaf kernels as one
  materialised scalar: written as a chain of scalar additions, XLA copies
  the whole chain into every leaf's kernel, and compile time grows with the
  square of the number of leaves.
  """
  if not values:
    return jnp.zeros((), jnp.float32)
  return jnp.dot(jnp.stack([v.astype(jnp.float32) for v in values]),
                 jnp.asarray(weights, jnp.float32),
                 precision=jax.lax.Precision.HIGHEST)


def one_pass(
    learning_rate: Union[float, optax.Schedule],
    *,
    max_norm: Optional[float],
    l2: float,
    importance: bool,
    importance_order: int,
    importance_decay: float,
    importance_placement: str,
    min_weight: float,
    max_weight: float,
    sparsify: Optional[str],
    fraction: float,
    error_feedback: bool,
    min_size: int,
    sparsify_warmup_steps: int,
    alpha: float,
    every: int,
    threshold_scale: float,
    b1: float,
    b2: float,
    eps: float,
    eps_root: float,
    adam_weight: float,
    nesterov: bool,
    rms_bias_correction: bool,
    mu_dtype: Optional[Any],
    variance_coef: Optional[float],
    variance_reduction: str,
    variance_normalize: bool,
    variance_eps: float,
    freeze_threshold: Optional[float],
    freeze_decay: float,
    freeze_warmup_steps: int,
    seed: int,
) -> optax.GradientTransformationExtraArgs:
  """The one-pass transform behind ``grpo(..., fused=True)``.

  Arguments are validated by :func:`grpo_optax.grpo`; see its docstring for
  their meaning and this module's docstring for the shared statistics.
  The update, per leaf, with ``t`` the count before the step and ``_hat``
  Adam's bias corrections:

  .. code-block:: text

    a    = (g + l2 p) * min(1, max_norm / ||g + l2 p||)       # exact clip
    h    = hessian_diag, or nu_hat (placement "output": this step's;
           "input": the last step's, a^2 at t = 0)
    S    = ema(S, |a p| + [order 2] h p^2 / 2, importance_decay)
    w    = clip(S_hat / mean_sample(S_hat), min_weight, max_weight) * head
    x    = a * w (placement "input") or a
    acc  = x + residual                                       # error feedback
    keep = |acc| >= threshold (top-k quantile or EMA tau of a sample), != 0
    m    = acc * keep;  residual = acc - m
    mu   = ema(mu, m, b1);  nu = ema(nu, m^2, b2)
    u    = adam_weight * mu_hat / (sqrt(nu_hat + eps_root) + eps)
           + (1 - adam_weight) * m / (sqrt(nu, or nu_hat) + eps)
    var  = reduce(max(nu_hat - (mu / bc1)^2, 0)) [/ (reduce(nu_hat) + eps)]
    out  = -lr(t) * u * [w, placement "output"] / (1 + coef * var)
    out  = 0 on frozen leaves
  """
  clip_on = max_norm is not None
  l2_on = not _common.is_static_zero(l2)
  mask_on = sparsify is not None
  variance_on = variance_coef is not None
  freeze_on = freeze_threshold is not None
  use_residual = mask_on and error_feedback
  placement_output = importance_placement == "output"
  weight_input = importance and not placement_output
  weight_output = importance and placement_output
  static_min_size = sparsify_lib.static_int("min_size", min_size, 0)
  static_warmup = sparsify_lib.static_int("sparsify_warmup_steps",
                                          sparsify_warmup_steps, 0)
  mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)

  f32 = _common.f32
  max_norm = f32(max_norm)
  l2 = f32(l2)
  importance_decay = f32(importance_decay)
  min_weight = f32(min_weight)
  max_weight = f32(max_weight)
  fraction = f32(fraction)
  alpha = f32(alpha)
  threshold_scale = f32(threshold_scale)
  b1, b2, eps, eps_root = f32(b1), f32(b2), f32(eps), f32(eps_root)
  adam_weight = f32(adam_weight)
  variance_coef = f32(variance_coef)
  variance_eps = f32(variance_eps)
  freeze_threshold = f32(freeze_threshold)
  freeze_decay = f32(freeze_decay)

  def init_fn(params):
    zeros = lambda: optax.tree.zeros_like(params)
    # Per-leaf scalars live in trees shaped like params (one buffer per leaf):
    # a leaf's kernels then read their own scalar instead of slicing a shared
    # vector at a leaf-specific index, so XLA compiles one kernel per leaf
    # shape, not one per leaf.
    vector = lambda: jax.tree.map(lambda _: jnp.zeros([], jnp.float32),
                                  params)
    # Leaves that a static min_size leaves dense keep a threshold of -inf.
    thresholds = lambda: jax.tree.map(
        lambda p: jnp.asarray(-jnp.inf if static_min_size is not None and (
            math.prod(jnp.shape(p)) < static_min_size) else 0.0,
        jnp.float32), params)
    return GrpoState(
        count=jnp.zeros([], jnp.int32),
        mu=optax.tree.zeros_like(params, dtype=mu_dtype),
        nu=zeros(),
        score=zeros() if importance else None,
        accumulator=zeros() if use_residual else None,
        thresholds=thresholds() if mask_on else None,
        tau=vector() if sparsify == "threshold" else None,
        freeze=FreezeBelowState(
            count=jnp.zeros([], jnp.int32),
            importance=jax.tree.map(lambda _: jnp.zeros([], jnp.float32),
                                    params),
            frozen=jax.tree.map(lambda _: jnp.zeros([], bool), params),
        ) if freeze_on else None,
        stats=_initial_stats(
            clip=clip_on,
            mask=("no_feedback" if mask_on and not use_residual else None),
            threshold=sparsify == "threshold",
            variance=variance_on, importance=importance,
            min_weight=min_weight, max_weight=max_weight))

  def update_fn(updates, state, params=None, *, hessian_diag=None,
                head_entropy=None, grad_variance=None, **extra_args):
    del extra_args
    if importance or l2_on or freeze_on:
      _common.require_params(
          params, "grpo", "(importance weighting, L2 and freezing read them)")
      _common.check_same_structure("params", params, updates, "grpo")
    g_leaves, treedef = jax.tree.flatten(updates)
    n_leaves = len(g_leaves)
    _check_dtypes(g_leaves, importance=importance, variance=variance_on,
                  freeze=freeze_on)
    none = [None] * n_leaves
    flat = lambda tree: treedef.flatten_up_to(tree) if tree is not None else none
    p_leaves = flat(params)
    mu_leaves, nu_leaves = flat(state.mu), flat(state.nu)
    s_leaves, acc_leaves = flat(state.score), flat(state.accumulator)
    hd_leaves = _extra_leaves("hessian_diag", hessian_diag, treedef,
                              n_leaves, updates)
    ent_leaves = _extra_leaves("head_entropy", head_entropy, treedef,
                               n_leaves, None)
    gv_leaves = _extra_leaves("grad_variance", grad_variance, treedef,
                              n_leaves, updates)
    # Leaves with entries; empty leaves pass through as zeros.
    live = [i for i in range(n_leaves) if g_leaves[i].size]
    total = sum(g_leaves[i].size for i in live)
    size_share = np.array([g_leaves[i].size / max(total, 1) for i in live])

    t = state.count
    t1 = optax.safe_increment(t)
    bc1 = F.bias_correction(b1, t1)
    bc1_next = F.bias_correction(b1, optax.safe_increment(t1))
    inv_bc2 = 1.0 / F.bias_correction(b2, t1)
    inv_bcs = 1.0 / F.bias_correction(importance_decay, t1)
    lr = learning_rate(t) if callable(learning_rate) else learning_rate
    neg_lr = -jnp.asarray(lr)
    stats = state.stats
    casts = {}

    def cast(name, x, dtype):
      """A scalar in a leaf's compute dtype, cast once per dtype."""
      if (name, dtype) not in casts:
        casts[name, dtype] = jnp.asarray(x).astype(dtype)
      return casts[name, dtype]

    # 1. The exact global-norm clip of g + l2 p.
    def with_l2(i, take):
      g = take(g_leaves[i])
      a = g.astype(_compute_dtype(g.dtype))
      if l2_on:
        a = a + l2 * take(p_leaves[i]).astype(a.dtype)
      return a

    clip = None
    if clip_on:
      # ||g + l2 p||^2 = |g|^2 + 2 l2 <g, p> + l2^2 |p|^2 from the inputs, so
      # that g + l2 p is never materialised for its norm.
      def sq_norm(i):
        g = g_leaves[i].astype(_compute_dtype(g_leaves[i].dtype))
        if not l2_on:
          return _sums([F.abs_sq(g)])[0]
        p = p_leaves[i].astype(g.dtype)
        gg, gp, pp = _sums([F.abs_sq(g), jnp.real(g * jnp.conj(p)),
                            F.abs_sq(p)])
        return gg + 2 * l2 * gp + l2 * l2 * pp
      norm = jnp.sqrt(jnp.maximum(_weighted_sum(
          [sq_norm(i) for i in live], np.ones(len(live))), 0.0))
      clip = F.clip_factor(norm, max_norm)
      stats = stats._replace(
          grad_norm=norm,
          clipped=jnp.where(norm > max_norm,
                            optax.safe_increment(stats.clipped),
                            stats.clipped))

    @_traced_once
    def clipped(i, take=_identity):
      a = with_l2(i, take)
      return a if clip is None else a * cast("clip", clip, a.dtype)

    # 2. Importance: S, then its per-leaf mean from a sample of the new S.
    score_new = list(s_leaves)
    inv_mean = list(none)
    heads = list(none)

    def update_score(fisher):
      for i in live:
        a = clipped(i)
        p = p_leaves[i].astype(a.dtype)
        h = (jnp.asarray(hd_leaves[i], a.dtype) if hd_leaves[i] is not None
             else fisher(i, a))
        second = cast("second", jnp.asarray(importance_order) == 2, a.dtype)
        s_old = s_leaves[i]
        score_new[i] = F.ema(s_old.astype(a.dtype),
                             F.taylor_score(a, p, h, second),
                             importance_decay).astype(s_old.dtype)
        if ent_leaves[i] is not None:
          ent = jnp.asarray(ent_leaves[i], jnp.float32)
          heads[i] = ent / (jnp.mean(ent) + 1e-12)

    @_traced_once
    def weight(i, take=_identity):
      s = take(score_new[i])
      ct = _compute_dtype(s.dtype)
      w = F.importance_weight(s.astype(ct) * cast("inv_bcs", inv_bcs, ct),
                              inv_mean[i].astype(ct), min_weight, max_weight)
      if heads[i] is not None:
        w = w * take(jnp.broadcast_to(heads[i], g_leaves[i].shape)).astype(ct)
      return w

    if weight_input:
      inv_bc2_prev = 1.0 / jnp.maximum(F.bias_correction(b2, t), 1e-30)
      update_score(lambda i, a: jnp.where(
          t == 0, a * a, nu_leaves[i].astype(a.dtype) * inv_bc2_prev))
      for i in live:
        inv_mean[i] = F.inverse_mean(
            _means([_strided(score_new[i])])[0] * inv_bcs)

    @_traced_once
    def weighted(i, take=_identity):
      a = clipped(i, take)
      return a * weight(i, take).astype(a.dtype) if weight_input else a

    # 3. Masks. With error feedback the state keeps acc = x + r of the last
    #    step and its threshold; the residual is the part of acc the threshold
    #    dropped. The new acc is written first, the sample that sets this
    #    step's threshold is read from it, and every consumer of the masked
    #    gradient reads acc alone.
    acc_new = list(acc_leaves)
    thr = list(none)
    thr_old, tau_old = flat(state.thresholds), flat(state.tau)
    new_thresholds, new_tau = state.thresholds, state.tau

    @_traced_once
    def accumulated(i, take=_identity):
      if use_residual:
        x = take(acc_new[i])
        return x.astype(_compute_dtype(x.dtype))
      return weighted(i, take)

    if mask_on:
      if static_warmup == 0:
        frac = fraction
      else:
        wsteps = jnp.maximum(jnp.asarray(sparsify_warmup_steps, jnp.float32),
                             1.0)
        frac = jnp.asarray(fraction, jnp.float32) ** (
            jnp.minimum(t.astype(jnp.float32), wsteps) / wsteps)
        if static_warmup is None:
          frac = jnp.where(jnp.asarray(sparsify_warmup_steps) > 0, frac,
                           fraction)
      masked = [i for i in live if static_min_size is None
                or g_leaves[i].size >= static_min_size]
      if use_residual:
        for i in masked:
          old = acc_leaves[i]
          x = weighted(i)
          _, r_prev = F.split_by_mask(old, F.keep_mask(
              old, jnp.abs(old), thr_old[i].astype(old.dtype)))
          acc_new[i] = (x + r_prev.astype(x.dtype)).astype(old.dtype)

      if sparsify == "topk":
        # One random start per step; each leaf samples every s-th entry
        # from it, s coprime with the leaf's size (so rows and columns are
        # all visited), a kernel that is the same for every leaf of a shape.
        start = jax.random.uniform(jax.random.fold_in(
            jax.random.PRNGKey(seed), t), ())
        samples = []
        for i in masked:
          n = g_leaves[i].size
          m = sparsify_lib.sample_size(n)
          if m < n:
            idx = sparsify_lib.strided_positions(n, m, start)
            take = lambda x, idx=idx: x.reshape(-1)[idx]
          else:
            take = lambda x: x.reshape(-1)
          samples.append(jnp.abs(accumulated(i, take)).astype(jnp.float32))
        for i, th in zip(masked, sparsify_lib.bisect_thresholds(samples,
                                                                frac)):
          thr[i] = th
      else:
        tau = list(tau_old)
        take = lambda x: _common.strided_sample(x, _THRESHOLD_SAMPLE)
        for i in masked:
          mean_abs = _means([jnp.abs(accumulated(i, take))])[0]
          tau[i] = F.ema_threshold(tau[i], mean_abs, alpha, t,
                                   every).astype(jnp.float32)
          thr[i] = threshold_scale * tau[i]
        new_tau = treedef.unflatten(tau)
      if static_min_size is None:
        # A traced min_size: small leaves keep everything, and their stored
        # threshold says so (the residual is derived from it next step).
        for i in masked:
          thr[i] = jnp.where(g_leaves[i].size < jnp.asarray(min_size),
                             -jnp.inf, thr[i])
      new_thresholds = treedef.unflatten([
            thr[i].astype(jnp.float32) if thr[i] is not None else thr_old[i]
            for i in range(n_leaves)])

    @_traced_once
    def keep(i, take=_identity):
      a = accumulated(i, take)
      return F.keep_mask(a, jnp.abs(a), thr[i].astype(a.dtype))

    def masked_grad(i, for_moments=False):
      """The gradient entering Adam's moments and the update.

      The moments (``for_moments=True``) and the update get the same values
      (for finite inputs) written as two different XLA expressions (the kept
      part, or all minus the dropped part; the weight on the left or the
      right), so that XLA fuses each into its consumers: one value feeding
      both an in-place state write and the update is otherwise kept in
      memory as a parameter-sized temporary.
      """
      if thr[i] is None:
        a = clipped(i)
        if weight_input:
          w = weight(i).astype(a.dtype)
          a = w * a if for_moments else a * w
        return a
      a = accumulated(i)
      kept_part, dropped = F.split_by_mask(a, keep(i))
      return kept_part if for_moments else a - dropped

    # 4. Adam's moments.
    mu_new, nu_new = list(mu_leaves), list(nu_leaves)
    for i in live:
      m = masked_grad(i, for_moments=True)
      mu_new[i] = F.ema(mu_leaves[i].astype(m.dtype), m, b1).astype(
          mu_leaves[i].dtype)
      nu_new[i] = F.ema(nu_leaves[i].astype(m.dtype), F.abs_sq(m), b2).astype(
          nu_leaves[i].dtype)

    if weight_output:
      update_score(
          lambda i, a: nu_new[i].astype(a.dtype) * cast("inv_bc2", inv_bc2,
                                                        a.dtype))

    # 5. Per-leaf statistics of the new state, all of a leaf's in one
    #    reduction over strided samples: the importance normaliser, the
    #    variance (and second moment), the freezing importance, the kept
    #    fraction.
    def elem_var(i, take):
      if gv_leaves[i] is not None:
        return jnp.maximum(
            jnp.asarray(take(jnp.asarray(gv_leaves[i])), jnp.float32), 0.0)
      return F.moment_variance(
          take(mu_new[i]).astype(jnp.float32) / bc1,
          take(nu_new[i]).astype(jnp.float32) * inv_bc2)

    def elem_nu(i, take):
      return take(nu_new[i]).astype(jnp.float32) * inv_bc2

    def elem_scale(i, take):
      v = elem_var(i, take)
      if variance_normalize:
        v = v / (elem_nu(i, take) + variance_eps)
      return v, F.variance_scale(v, variance_coef)

    leaf_stats = {}
    for i in live:
      named = {}
      if weight_output:
        named["score"] = _strided(score_new[i])
      if variance_on:
        if variance_reduction == "element":
          named["var"], named["scale"] = elem_scale(i, _strided)
        else:
          named["var"] = elem_var(i, _strided)
          if variance_normalize:
            named["nu"] = elem_nu(i, _strided)
      if freeze_on:
        named["freeze"] = jnp.abs(clipped(i, _strided) * _strided(
            p_leaves[i]).astype(jnp.float32))
      if thr[i] is not None and not use_residual:
        named["kept"] = keep(i, _strided).astype(jnp.float32)
      if named:
        leaf_stats[i] = dict(zip(named, _means(list(named.values()))))

    if weight_output:
      for i in live:
        inv_mean[i] = F.inverse_mean(leaf_stats[i]["score"] * inv_bcs)
    if mask_on:
      stats = stats._replace(
          kept_fraction=None if use_residual else (_weighted_sum(
              [leaf_stats[i].get("kept", jnp.ones((), jnp.float32))
               if i in leaf_stats else jnp.ones((), jnp.float32)
               for i in live], size_share) if live
                         else jnp.ones([], jnp.float32)),
          tau_mean=(_weighted_sum(jax.tree.leaves(new_tau),
                                  np.full(n_leaves, 1.0 / max(n_leaves, 1)))
                    if new_tau is not None else stats.tau_mean))

    # 6. The variance rate.
    var_scale = list(none)
    if variance_on:
      var_leaf = {i: leaf_stats[i]["var"] for i in live}
      if variance_reduction == "element":
        scale_leaf = {i: leaf_stats[i]["scale"] for i in live}
        for i in live:
          var_scale[i] = lambda i=i: elem_scale(i, _identity)[1]
      else:
        if variance_reduction == "global":
          gvar = _weighted_sum([var_leaf[i] for i in live], size_share)
          var_leaf = {i: gvar for i in live}
        if variance_normalize:
          nu_leaf = {i: leaf_stats[i]["nu"] for i in live}
          if variance_reduction == "global":
            gnu = _weighted_sum([nu_leaf[i] for i in live], size_share)
            nu_leaf = {i: gnu for i in live}
          var_leaf = {i: var_leaf[i] / (nu_leaf[i] + variance_eps)
                      for i in live}
        scale_leaf = {i: F.variance_scale(var_leaf[i], variance_coef)
                      for i in live}
        for i in live:
          var_scale[i] = lambda sc=scale_leaf[i]: sc
      stats = stats._replace(
          variance=_weighted_sum([var_leaf[i] for i in live], size_share),
          lr_scale=(_weighted_sum([scale_leaf[i] for i in live], size_share)
                    if live else jnp.ones([], jnp.float32)))

    # 7. Freezing: per-leaf EMA of mean |a p| (sampled), normalised over the
    #    leaves still trainable.
    new_freeze, frozen = state.freeze, none
    if freeze_on:
      fz = state.freeze
      imp_old = treedef.flatten_up_to(fz.importance)
      frozen_old = treedef.flatten_up_to(fz.frozen)
      fbc = F.bias_correction(freeze_decay, optax.safe_increment(fz.count))
      imp = [F.ema(imp_old[i], leaf_stats[i]["freeze"] if i in leaf_stats
                   else jnp.zeros((), jnp.float32),
                   freeze_decay).astype(jnp.float32)
             for i in range(n_leaves)]
      active = [jnp.logical_not(f).astype(jnp.float32) for f in frozen_old]
      ones = np.ones(n_leaves)
      mean_imp = (_weighted_sum([v / fbc * a for v, a in zip(imp, active)],
                                ones)
                  / jnp.maximum(_weighted_sum(active, ones), 1.0))
      may_freeze = fz.count >= jnp.asarray(freeze_warmup_steps, fz.count.dtype)
      frozen = [f | (may_freeze & ((v / fbc) / (mean_imp + 1e-30)
                                   < freeze_threshold))
                for f, v in zip(frozen_old, imp)]
      new_freeze = FreezeBelowState(
          count=optax.safe_increment(fz.count),
          importance=treedef.unflatten(imp),
          frozen=treedef.unflatten(frozen))

    # 8. The update: one fusion per leaf, reading the new moments.
    outs = [jnp.zeros_like(g) for g in g_leaves]
    for i in live:
      m = masked_grad(i)
      ct = m.dtype
      mu_, nu_ = mu_new[i].astype(ct), nu_new[i].astype(ct)
      mu_hat = (F.nesterov_moment(mu_, m, b1, cast("bc1", bc1, ct),
                                  cast("bc1_next", bc1_next, ct)) if nesterov
                else mu_ / cast("bc1", bc1, ct))
      nu_hat = nu_ * cast("inv_bc2", inv_bc2, ct)
      u = F.adam_rms_mix(mu_hat, nu_hat, nu_hat if rms_bias_correction
                         else nu_, m, eps, eps_root, adam_weight)
      if weight_output:
        u = u * weight(i).astype(ct)
      if var_scale[i] is not None:
        u = u * var_scale[i]().astype(ct)
      u = u * cast("neg_lr", neg_lr, ct)
      if frozen[i] is not None:
        u = jnp.where(frozen[i], jnp.zeros_like(u), u)
      outs[i] = u.astype(g_leaves[i].dtype)

    new_state = GrpoState(
        count=t1,
        mu=treedef.unflatten(mu_new),
        nu=treedef.unflatten(nu_new),
        score=treedef.unflatten(score_new) if importance else None,
        accumulator=treedef.unflatten(acc_new) if use_residual else None,
        thresholds=new_thresholds,
        tau=new_tau,
        freeze=new_freeze,
        stats=jax.tree.map(lambda x, ref: jnp.asarray(x).astype(ref.dtype),
                           stats, state.stats))
    return treedef.unflatten(outs), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _extra_leaves(name, tree, treedef, n_leaves, like):
  if tree is None:
    return [None] * n_leaves
  if like is not None:
    _common.check_same_structure(name, tree, like, "grpo")
  try:
    return treedef.flatten_up_to(tree)
  except (ValueError, TypeError) as e:
    raise ValueError(
        f"grpo: `{name}` must have the updates' tree structure (None for"
        f" leaves without one): {e}") from None
