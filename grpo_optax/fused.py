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

MaskConfig = sparsify.TopKMaskConfig | sparsify.EmaThresholdMaskConfig


class FusedState(NamedTuple):
  """State of :func:`clip_mask_adam`: the three rooms' own states.

  Attributes:
    clip: the clipping room's state, None without clipping.
    mask: the mask's state (top-k or EMA threshold), None without a mask.
    adaptive: the Nesterov + Adam/RMSProp room's state.
  """

  clip: clipping.ClipWithL2State | None
  mask: sparsify.TopKMaskState | sparsify.EmaThresholdMaskState | None
  adaptive: momentum.ScaleByNesterovAdamRmsState


def fusable(
  mask: MaskConfig | None, adam: momentum.ScaleByNesterovAdamRmsConfig | None
) -> list[str]:
  """What keeps these rooms from the fused core (empty: nothing): the names
  of the settings only their chain computes.
  """
  blockers = []
  if isinstance(mask, sparsify.TopKMaskConfig):
    if mask.method == "exact":
      blockers.append("topk_method='exact'")
    if mask.frequency_weight is not None:
      blockers.append("frequency_weight")
  if adam is None:
    blockers.append("adaptive=False")
  else:
    if adam.filter_decay is not None:
      blockers.append("filter_decay")
    if adam.stochastic:
      blockers.append("a stochastic mu_format/nu_format")
  return blockers


def _check_gradients(g_leaves) -> None:
  for g in g_leaves:
    if not jnp.issubdtype(jnp.result_type(g), jnp.inexact):
      raise TypeError(
        f"grpo: gradients must be floating-point or complex, got a leaf "
        f"of dtype {jnp.result_type(g)} (shape {jnp.shape(g)}); leave "
        "integer arrays out of the optimized tree (e.g. "
        "nnx.Optimizer(..., wrt=nnx.Param) or optax.masked)"
      )


def _masked(a_leaves, thresholds):
  """The masked gradients (``a`` itself on a leaf that passes dense)."""
  if thresholds is None:
    return list(a_leaves)
  return [
    a if th is None else sparsify.masked_part(a, th)
    for a, th in zip(a_leaves, thresholds)
  ]


def _clipped_bounds(fmt, *, g_leaves, p_leaves, clip, norm, names):
  r"""Per leaf, each block's largest ``|x|`` of the clipped gradient
  :math:`x = c\,(g + \lambda p)` (clip factor :math:`c \ge 0`), as the
  chain's rooms compute it from ``x``: rounding is monotone, so
  :math:`\max_i |c\,y_i| = c \max_i |y_i|` exactly in floating point, and
  the reduction reads ``g`` (and ``p``) where they lie instead of ``x``,
  which XLA:CPU would write out for it when other kernels read ``x`` too.
  """
  factor = None if clip is None else clipping.clip_factor(norm, clip.max_norm)
  out = []
  for i, g in enumerate(g_leaves):
    y = g
    if p_leaves is not None and clip is not None and clip.l2_on:
      y = g + clip.l2 * p_leaves[i]  # as clipping.clip_leaves adds it
    b = quantization.block_absmax(fmt, y, name=names[i])
    if factor is not None:
      b = (b * factor).astype(g.dtype).astype(jnp.float32)
    out.append(b)
  return out


def _input_bounds(
  fmt,
  *,
  clipped,
  mask,
  accumulator,
  acc_maxima,
  thresholds,
  a_leaves,
  treedef,
  names,
):
  r"""Per leaf, each 8-bit block's largest ``|m|``, ``m`` the masked gradient
  the moments read, equal to the chain's
  :func:`~grpo_optax.quantization.block_absmax` of ``m`` but read off arrays
  in memory.

  ``m = a`` where :math:`|a| \ge \theta` (the leaf's threshold), else 0,
  so a block's largest ``|m|`` is its largest ``|a|`` when that is at least
  :math:`\theta`, else 0. A block's largest ``|a|``: on a leaf with error
  feedback, the new accumulator's (``a`` is what it stores; from the codes
  when stored in 8 bits: :func:`~grpo_optax.quantization.stored_absmax`,
  as ``acc_maxima`` holds it from the encode,
  :func:`~grpo_optax.quantization.encode_with_absmax`);
  on any other leaf ``a = x``, the clipped gradient (``clipped(fmt)``:
  ``_clipped_bounds``). One of the old accumulator would make XLA copy
  the donated buffer before overwriting it, one of ``m`` would make it
  write ``m`` out (``grpo_optax.momentum.moment_scale``).
  """
  ef = mask is not None and mask.error_feedback and accumulator is not None
  quantized = isinstance(accumulator, quantization.Quantized)
  if ef and quantized:
    acc_scales = treedef.flatten_up_to(accumulator.scale)
    acc_codes = treedef.flatten_up_to(accumulator.codes)
  elif ef:
    acc_leaves = treedef.flatten_up_to(accumulator)
  out = []
  for i, name in enumerate(names):
    th = None if thresholds is None else thresholds[i]
    d = (
      None
      if mask is None
      else sparsify.dense_leaf(a_leaves[i].size, mask.min_size)
    )
    if ef and d is not True and d is not False:
      # min_size traced: the accumulator holds 0 where a leaf passes dense.
      m = a_leaves[i] if th is None else sparsify.masked_part(a_leaves[i], th)
      out.append(quantization.block_absmax(fmt, m, name=name))
      continue
    if not ef or d is True:
      b = clipped(fmt)[i]
    elif not quantized:
      b = quantization.block_absmax(fmt, acc_leaves[i], name=name)
      b = b.astype(jnp.float32)
    else:
      acc_fmt = quantization.state_format("int8_sr")
      stored = quantization.Quantized(acc_codes[i], acc_scales[i])
      if acc_fmt.block_size == fmt.block_size:
        b = acc_maxima[i]  # stored_absmax of the new codes, from the encode
      else:
        decoded = quantization.decode(acc_fmt, stored)
        b = quantization.block_absmax(fmt, decoded, name=name)
    if th is not None:
      th = jnp.asarray(th).astype(a_leaves[i].dtype).astype(jnp.float32)
      b = jnp.where(b >= th, b, jnp.zeros_like(b))
    out.append(b)
  return out


def clip_mask_adam(
  *,
  clip: clipping.ClipWithL2Config | None,
  mask: MaskConfig | None,
  adam: momentum.ScaleByNesterovAdamRmsConfig,
) -> optax.GradientTransformationExtraArgs:
  """The fused clip + mask + error feedback + Adam transform.

  Equal to ``optax.chain(clip.transform(), mask.transform(),
  adam.transform())`` of the same configs (module docstring); a setting
  only the chain computes (``topk_method="exact"``, ``frequency_weight``,
  ``filter_decay``) raises a ``ValueError``.
  """
  blockers = fusable(mask, adam)
  if blockers:
    raise ValueError(
      f"grpo: the fused core cannot honour {', '.join(blockers)}"
    )

  def init_fn(params):
    return FusedState(
      clip=None if clip is None else clip.init(params),
      mask=None if mask is None else mask.init(params),
      adaptive=adam.init(params),
    )

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    g_leaves, treedef = jax.tree.flatten(updates)
    _check_gradients(g_leaves)
    p_leaves = None
    if clip is not None and clip.l2_on:
      _common.require_params(params, "grpo", "when l2 is on")
      _common.check_same_structure("params", params, updates, "grpo")
      p_leaves = treedef.flatten_up_to(params)
    _common.check_tree_like(
      "grpo", updates, momentum.moment_shapes(adam.mu_format, state.adaptive.mu)
    )
    x_leaves, clip_state, norm = g_leaves, None, None
    if clip is not None:
      x_leaves, norm = clipping.clip_leaves(g_leaves, p_leaves, clip)
      clip_state = clipping.next_state(state.clip, norm, clip.max_norm)
    names = momentum.leaf_names(treedef)
    clipped = functools.cache(
      functools.partial(
        _clipped_bounds,
        g_leaves=g_leaves,
        p_leaves=p_leaves,
        clip=clip,
        norm=norm,
        names=names,
      )
    )
    a_leaves, thr, mask_state, acc_maxima = x_leaves, None, None, None
    if mask is not None:
      acc_fmt = mask.accumulator_format
      a_leaves, thr, mask_state, acc_maxima = mask.threshold_phase(
        x_leaves,
        state.mask,
        treedef,
        x_bounds=clipped(acc_fmt)
        if acc_fmt is not None and acc_fmt.blocked
        else None,
      )
    bounds = functools.partial(
      _input_bounds,
      clipped=clipped,
      mask=mask,
      accumulator=None if mask_state is None else mask_state.accumulator,
      acc_maxima=acc_maxima,
      thresholds=thr,
      a_leaves=a_leaves,
      treedef=treedef,
      names=names,
    )
    ad = state.adaptive
    count, hyper = momentum.step_scalars(adam, ad.count)
    m_leaves = _masked(a_leaves, thr)
    outs, mu, nu = momentum.adaptive_step(
      adam,
      m_leaves,
      ad.mu,
      ad.nu,
      hyper,
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
      treedef,
      scales=(
        momentum.moment_scale(
          adam.mu_format, ad.mu, adam.b1, m_leaves, 1, treedef, bounds
        ),
        momentum.moment_scale(
          adam.nu_format, ad.nu, adam.b2, m_leaves, 2, treedef, bounds
        ),
      ),
    )
    return treedef.unflatten(outs), FusedState(
      clip=clip_state,
      mask=mask_state,
      adaptive=momentum.ScaleByNesterovAdamRmsState(
        count=count, mu=mu, nu=nu, filtered=None
      ),
    )

  # The state's None fields (parts that are off) are empty pytrees, which
  # optax's OptState alias (ArrayTree) does not admit.
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]
