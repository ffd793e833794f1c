"""The fused core of :func:`grpo_optax.grpo`: clip + mask + Adam in one pass.

One transform that computes exactly what the chain

.. code-block:: python

  optax.chain(clip_with_l2(max_norm, l2),                 # optional
              top_k_mask(method="sampled", ...)            # or
              | ema_threshold_mask(...),                   # optional
              scale_by_nesterov_adam_rms(...))

computes, with the same state (a :class:`FusedState` holding each room's own
state), the same random draws and the same formulas: it calls the rooms'
functions (:func:`grpo_optax.clipping.norm_with_l2`,
:func:`grpo_optax.sparsify.accumulate`,
:func:`~grpo_optax.sparsify.topk_leaf_thresholds`,
:func:`~grpo_optax.momentum.nesterov_moment`, ...).
``tests/test_fused.py`` checks the two against each other. It exists because
XLA:CPU runs the chain's masked Adam at about 3x ``optax.adam`` and this
layout at about 1.8x (``docs/design.md``, "Where fusion happens"):

* Every state array is written in place into its donated buffer, so any
  other kernel that reads its old value must run before that write; XLA's
  copy insertion only trusts data dependencies for that order, and copies a
  whole array otherwise. With error feedback the state keeps
  ``acc = g + r`` (not ``r``): the new ``acc`` is computed first and every
  consumer of the masked gradient reads it.
* The masked gradient reaches Adam's moments and the update as one
  expression of the new ``acc`` and the leaf's threshold, which XLA copies
  into each of their kernels (no parameter-sized temporary: 0.05 bytes of
  temporaries per parameter on a 2M-parameter tree; an earlier form wrote
  it as two expressions of equal value to force that).
* The clip norm is one reduction per leaf and one sum of their stack, so
  that the value reaches each leaf's kernel as one scalar.
* Compile time (``docs/design.md``, "Compile time"): per-leaf scalars are
  split from their vectors by reductions (``_common.unstack``), the
  samples of one shape are stacked and bisected together, and each leaf's
  Adam math is one jitted function that leaves of one shape share.
"""

from __future__ import annotations

import functools
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from grpo_optax import _common
from grpo_optax import clipping
from grpo_optax import momentum
from grpo_optax import quantization
from grpo_optax import sparsify

__all__ = (
  "FusedState",
  "clip_mask_adam",
)

MASKS = ("topk", "threshold")


class FusedState(NamedTuple):
  """State of :func:`clip_mask_adam`: the three rooms' own states."""

  clip: clipping.ClipWithL2State | None  # None without clipping
  # None without a mask
  mask: sparsify.TopKMaskState | sparsify.EmaThresholdMaskState | None
  adaptive: momentum.ScaleByNesterovAdamRmsState  # Adam / RMSProp moments


class _Clip(NamedTuple):
  max_norm: Any
  l2: Any  # None: no L2 term


class _Mask(NamedTuple):
  kind: str  # "topk" or "threshold"
  fraction: Any
  error_feedback: bool
  min_size: Any
  warmup_steps: Any
  seed: Any  # a Python int, or traced under optax.inject_hyperparams
  alpha: Any
  every: Any
  scale: Any
  accumulator_format: Any = None  # a StateFormat, or None (params' dtype)


class _Adam(NamedTuple):
  b1: Any
  b2: Any
  eps: Any
  eps_root: Any
  adam_weight: Any
  nesterov: bool
  rms_bias_correction: bool
  mu_dtype: Any
  nu_dtype: Any
  mu_format: Any = None  # a deterministic quantization.StateFormat, or None
  nu_format: Any = None


def _init_mask(params, cfg: _Mask):
  acc = (
    sparsify.init_accumulator(params, cfg.accumulator_format)
    if cfg.error_feedback
    else None
  )
  zeros = _common.leaf_scalars(params)
  tau = _common.leaf_scalars(params)  # its own buffer (state is donated)
  one = None if cfg.error_feedback else jnp.ones([], jnp.float32)
  if cfg.kind == "topk":
    return sparsify.TopKMaskState(
      count=jnp.zeros([], jnp.int32),
      accumulator=acc,
      thresholds=zeros,
      frequency=None,
      kept_fraction=one,
    )
  return sparsify.EmaThresholdMaskState(
    count=jnp.zeros([], jnp.int32),
    accumulator=acc,
    thresholds=zeros,
    tau=tau,
    kept_fraction=one,
  )


def _clip_phase(g_leaves, p_leaves, cfg: _Clip | None, state):
  """``a = (g + l2 p) * min(1, max_norm / ||g + l2 p||)`` and the clip state."""
  if cfg is None:
    return list(g_leaves), None
  norm = clipping.norm_with_l2(g_leaves, p_leaves, cfg.l2)
  scale = clipping.clip_factor(norm, cfg.max_norm)
  out = []
  for i, g in enumerate(g_leaves):
    a = g if p_leaves is None else g + cfg.l2 * p_leaves[i]
    out.append((a * scale).astype(g.dtype))
  return out, clipping.next_state(state, norm, cfg.max_norm)


def _mask_phase(x_leaves, cfg: _Mask | None, state, treedef):
  """Accumulated gradients, per-leaf thresholds and the new mask state.

  Returns ``(a_leaves, thresholds, new_state)``; ``thresholds`` is None
  without a mask, else a list with one scalar per masked leaf and None for
  a leaf that passes dense. With error feedback ``a_leaves`` are the new
  accumulator's arrays themselves, so every later reader reads the value
  being written.
  """
  if cfg is None:
    return x_leaves, None, None
  t = state.count
  n = len(x_leaves)
  accs = (
    sparsify.read_accumulator(state.accumulator, treedef)
    if cfg.error_feedback
    else [None] * n
  )
  dense = [sparsify.dense_leaf(x.size, cfg.min_size) for x in x_leaves]
  a_leaves = sparsify.accumulate_leaves(x_leaves, accs, state.thresholds, dense)
  stored = None
  if cfg.error_feedback:
    stored, a_leaves = sparsify.store_accumulator(
      a_leaves,
      state.accumulator,
      treedef,
      dense,
      cfg.accumulator_format,
      sparsify.accumulator_word(cfg.seed, t),
    )
  sizes = [a.size for a in a_leaves]
  kept = None
  if cfg.kind == "topk":
    frac = sparsify.warmup_fraction(cfg.fraction, cfg.warmup_steps, t)
    found = sparsify.topk_leaf_thresholds(a_leaves, dense, frac, cfg.seed, t)
    extra = {"frequency": None}
    if not cfg.error_feedback:
      kept = found.kept
  else:
    found, tau = sparsify.threshold_leaf_thresholds(
      a_leaves, dense, state.tau, cfg.alpha, t, cfg.every, cfg.scale
    )
    extra = {"tau": tau + 0 * state.tau}
    if not cfg.error_feedback:
      kept = _common.stack(
        [
          jnp.ones((), jnp.float32)
          if th is None
          else sparsify.sampled_kept(a, th)
          for a, th in zip(a_leaves, found.leaves)
        ]
      )
  new_state = type(state)(
    count=_common.safe_increment(t),
    accumulator=stored,
    thresholds=found.vector + 0 * state.thresholds,
    kept_fraction=(
      None
      if kept is None
      else sparsify.size_weighted_vector(kept, sizes) + 0 * state.kept_fraction
    ),
    **extra,
  )
  return a_leaves, found.leaves, new_state


def _masked(a, thr):
  """The masked gradient (``a`` itself on a leaf that passes dense)."""
  if thr is None:
    return a
  return sparsify.masked_part(a, thr)


@functools.partial(
  jax.jit,
  static_argnames=(
    "nesterov",
    "rms_bias_correction",
    "masked",
    "out_dtype",
    "weight",
  ),
)
def _adam_leaf(
  a,
  threshold,
  mu,
  nu,
  hyper,
  *,
  nesterov: bool,
  rms_bias_correction: bool,
  masked: bool,
  out_dtype,
  weight: float | None,
):
  """One leaf's moments and adaptive update (``hyper``: the step's scalars;
  ``weight``: the Adam weight when it is static, so that a weight of 1 or 0
  leaves the other term out of the program).

  Jitted, so that leaves of one shape share one trace and one lowered
  function (XLA inlines the calls): tracing each leaf's two dozen
  operations anew was a third of the update's compile time.
  """
  b1, b2, eps, eps_root, adam_weight, bc1, bc2, bc1_next = hyper
  th = threshold if masked else None
  wide = lambda x: x.astype(jnp.promote_types(x.dtype, nu.dtype))
  m = wide(_masked(a, th))
  mu_new = _common.ema(mu, m, b1)
  nu_new = _common.ema(nu, _common.abs_sq(m), b2)
  g = m
  if nesterov:
    mu_hat = momentum.nesterov_moment(
      mu_new, g, b1, bc1.astype(mu_new.dtype), bc1_next.astype(mu_new.dtype)
    )
  else:
    mu_hat = mu_new / bc1.astype(mu_new.dtype)
  nu_hat = nu_new / bc2.astype(nu_new.dtype)
  u = momentum.adam_rms_mix(
    mu_hat,
    nu_hat,
    nu_hat if rms_bias_correction else nu_new,
    g,
    eps,
    eps_root,
    adam_weight if weight is None else weight,
  )
  return mu_new.astype(mu.dtype), nu_new.astype(nu.dtype), u.astype(out_dtype)


def _adam_phase(a_leaves, thr, cfg: _Adam, state, u_dtypes):
  """Adam's moments from the masked gradient and the adaptive update."""
  t1 = _common.safe_increment(state.count)
  bc1 = _common.bias_correction(cfg.b1, t1)
  bc2 = _common.bias_correction(cfg.b2, t1)
  bc1_next = _common.bias_correction(cfg.b1, _common.safe_increment(t1))
  hyper = (
    cfg.b1,
    cfg.b2,
    cfg.eps,
    cfg.eps_root,
    cfg.adam_weight,
    bc1,
    bc2,
    bc1_next,
  )
  thr = [None] * len(a_leaves) if thr is None else thr
  mus, nus, outs = [], [], []
  for a, th, mu, nu, dtype in zip(a_leaves, thr, state.mu, state.nu, u_dtypes):
    mu_new, nu_new, u = _adam_leaf(
      a,
      jnp.zeros((), jnp.float32) if th is None else th,
      mu,
      nu,
      hyper,
      nesterov=cfg.nesterov,
      rms_bias_correction=cfg.rms_bias_correction,
      masked=th is not None,
      out_dtype=jnp.dtype(dtype),
      weight=_common.concrete_value(cfg.adam_weight),
    )
    mus.append(mu_new)
    nus.append(nu_new)
    outs.append(u)
  return outs, mus, nus, t1


def _init_moment(params, dtype, fmt):
  if fmt is None:
    return momentum.moments_like(params, dtype)
  return quantization.tree_init(fmt, params)


def _decode(fmt, stored, floor=False):
  if fmt is None:
    return stored
  return quantization.tree_decode(fmt, stored, floor=floor)


def _encode(fmt, tree):
  return tree if fmt is None else quantization.tree_encode(fmt, tree)


def clip_mask_adam(
  *, clip: _Clip | None, mask: _Mask | None, adam: _Adam
) -> optax.GradientTransformationExtraArgs:
  """The fused clip + mask + error feedback + Adam transform.

  Built by :func:`grpo_optax.grpo` (arguments validated there); equal to the
  chain of the same rooms (module docstring).
  """

  def init_fn(params):
    return FusedState(
      clip=(
        clipping.ClipWithL2State(
          count=jnp.zeros([], jnp.int32),
          clipped=jnp.zeros([], jnp.int32),
          last_norm=jnp.zeros([], jnp.float32),
        )
        if clip is not None
        else None
      ),
      mask=_init_mask(params, mask) if mask is not None else None,
      adaptive=momentum.ScaleByNesterovAdamRmsState(
        count=jnp.zeros([], jnp.int32),
        mu=_init_moment(params, adam.mu_dtype, adam.mu_format),
        nu=_init_moment(params, adam.nu_dtype, adam.nu_format),
        filtered=None,
      ),
    )

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    g_leaves, treedef = jax.tree.flatten(updates)
    for g in g_leaves:
      if not jnp.issubdtype(jnp.result_type(g), jnp.inexact):
        raise TypeError(
          f"grpo: gradients must be floating-point or complex, got a leaf "
          f"of dtype {jnp.result_type(g)} (shape {jnp.shape(g)}); leave "
          "integer arrays out of the optimized tree (e.g. "
          "nnx.Optimizer(..., wrt=nnx.Param) or optax.masked)"
        )
    p_leaves = None
    if clip is not None and clip.l2 is not None:
      _common.require_params(params, "grpo", "when l2 is on")
      _common.check_same_structure("params", params, updates, "grpo")
      p_leaves = treedef.flatten_up_to(params)
    _common.check_tree_like(
      "grpo", updates, momentum.moment_shapes(adam.mu_format, state.adaptive.mu)
    )
    x_leaves, clip_state = _clip_phase(g_leaves, p_leaves, clip, state.clip)
    a_leaves, thr, mask_state = _mask_phase(x_leaves, mask, state.mask, treedef)
    ad = state.adaptive
    mu_old = _decode(adam.mu_format, ad.mu)
    nu_old = _decode(adam.nu_format, ad.nu, True)  # a denominator: floored
    outs, mus, nus, t1 = _adam_phase(
      a_leaves,
      thr,
      adam,
      ad._replace(
        mu=treedef.flatten_up_to(mu_old), nu=treedef.flatten_up_to(nu_old)
      ),
      momentum.update_dtypes(  # optax's (the accumulator: the params')
        updates,
        params
        if params is not None
        or mask is None
        or mask.accumulator_format is not None
        else state.mask.accumulator,
        (ad.mu if adam.mu_format is None else None, adam.mu_dtype),
        (ad.nu if adam.nu_format is None else None, adam.nu_dtype),
      ),
    )
    new_state = FusedState(
      clip=clip_state,
      mask=mask_state,
      adaptive=momentum.ScaleByNesterovAdamRmsState(
        count=t1,
        mu=_encode(adam.mu_format, treedef.unflatten(mus)),
        nu=_encode(adam.nu_format, treedef.unflatten(nus)),
        filtered=None,
      ),
    )
    return treedef.unflatten(outs), new_state

  # The state's None fields (parts that are off) are empty pytrees, which
  # optax's OptState alias (ArrayTree) does not admit.
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]
