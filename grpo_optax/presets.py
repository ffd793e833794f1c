"""The ``grpo`` preset: the articles' mechanisms chained in one optimizer.

``grpo()`` is literally a chain of the mechanism rooms (each a public optax
transform); the three rooms that pay for fusion -- clipping, the mask with
error feedback and the Adam step -- run as one transform
(:func:`grpo_optax.fused.clip_mask_adam`) that computes exactly what their
chain computes (same state, same random draws). ``docs/design.md`` describes
the rooms and how to add one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any
from typing import TypeVar
from typing import cast

import numpy as np
import optax

from grpo_optax import _common
from grpo_optax import fused as fused_lib
from grpo_optax import quantization
from grpo_optax.clipping import clip_with_l2
from grpo_optax.freezing import freeze_below
from grpo_optax.importance import scale_by_importance
from grpo_optax.momentum import scale_by_nesterov_adam_rms
from grpo_optax.sparsify import ema_threshold_mask
from grpo_optax.sparsify import top_k_mask
from grpo_optax.variance import scale_by_variance_lr

__all__ = (
  "ARTICLE_DEFAULTS",
  "grpo",
)

SPARSIFIERS = ("topk", "threshold", None)
PLACEMENTS = ("input", "output")

# The articles' literal settings, where grpo()'s measured defaults differ:
# ``grpo(lr, **ARTICLE_DEFAULTS)`` is the optimizer as the articles describe
# it (Taylor importance weighting, the 50/50 Adam/RMSProp mix, the variance
# rate with coefficient 0.1, every leaf sparsified). See the docs,
# "Defaults chosen by measurement", for why the defaults differ.
ARTICLE_DEFAULTS = {
  "importance": True,
  "adam_weight": 0.5,
  "variance_coef": 0.1,
  "min_size": 0,
}

_F = TypeVar("_F", bound=Callable[..., Any])


def _refuse_adamw_mask(fn: _F) -> _F:
  """Refuses ``mask=`` with a ``TypeError`` that names ``weight_decay_mask``.

  ``optax.adamw`` calls its weight-decay mask ``mask``; here a "mask" is the
  gradient mask (``sparsify``, ``min_size``), so ``grpo`` does not take the
  word as an alias and says which keyword is meant. The signature is
  ``fn``'s (``functools.wraps``).
  """

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    if "mask" in kwargs:
      raise TypeError(
        "grpo() got an unexpected keyword argument 'mask': optax.adamw's "
        "mask (which leaves decay) is weight_decay_mask= here, beside "
        "weight_decay=; the gradient mask is sparsify= / min_size="
      )
    return fn(*args, **kwargs)

  return cast(_F, wrapper)


@_refuse_adamw_mask
def grpo(
  learning_rate: float | optax.Schedule = 1e-3,
  *,
  max_norm: float | None = 1.0,
  l2: float | None = None,
  weight_decay: float | None = None,
  weight_decay_mask: Any = None,
  importance: bool = False,
  importance_order: int = 2,
  importance_decay: float = 0.9,
  importance_placement: str = "input",
  min_weight: float = 0.1,
  max_weight: float = 10.0,
  sparsify: str | None = "topk",
  fraction: float = 0.3,
  topk_method: str = "sampled",
  error_feedback: bool = True,
  frequency_weight: float | None = None,
  min_size: int = 1024,
  sparsify_warmup_steps: int = 0,
  alpha: float = 0.7,
  every: int = 100,
  threshold_scale: float = 1.0,
  adaptive: bool = True,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  eps_root: float = 0.0,
  adam_weight: float = 1.0,
  nesterov: bool = True,
  rms_bias_correction: bool = False,
  filter_decay: float | None = None,
  mu_dtype: Any | None = None,
  nu_dtype: Any | None = None,
  mu_format: Any | None = None,
  nu_format: Any | None = None,
  accumulator_format: str | None = None,
  variance_coef: float | None = None,
  variance_decay: float = 0.99,
  variance_reduction: str = "leaf",
  variance_normalize: bool = False,
  variance_eps: float = 1e-12,
  freeze_threshold: float | None = None,
  freeze_decay: float = 0.9,
  freeze_warmup_steps: int = 100,
  seed: int = 0,
  fused: bool | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""The GRPO optimizer: the articles' mechanisms as one optax transform.

  The mechanisms, in the order they act (each can be switched off):

  .. code-block:: text

    clip_with_l2(max_norm, l2)                       # None: off (l2 = 0)
    -> scale_by_importance(order, decay, ...)        # importance=False: off
    -> top_k_mask | ema_threshold_mask               # sparsify=None: off
    -> scale_by_nesterov_adam_rms(b1, b2, ...)       # adaptive=False: off
    -> [importance here with importance_placement="output"]
    -> scale_by_variance_lr(coef, decay, ...)        # variance_coef=None: off
    -> scale_by_learning_rate(learning_rate)
    -> freeze_below(threshold, ...)                  # freeze_threshold=None: off

  It is one algorithm whatever the form: with ``fused=None`` (default)
  clipping, the mask and the Adam step run as one transform
  (:func:`grpo_optax.fused.clip_mask_adam`, about 1.35x ``optax.adam``
  dense and 1.8x masked, against 1.45x / 3x for their chain) whenever the
  settings allow, which is every setting except ``topk_method="exact"``,
  ``frequency_weight``, ``filter_decay`` and ``adaptive=False``; the chain
  of the same rooms otherwise. Both compute the same updates from the same
  state (tested to 1e-5, random draws included). ``fused=True`` insists on
  the fused core (a ``ValueError`` names the keyword it cannot honour);
  ``fused=False`` builds the chain.

  Decoupled weight decay (``weight_decay``, ``weight_decay_mask``) is added
  after the adaptive step and the variance rate, before the learning rate,
  as in ``optax.adamw``; ``l2`` is the coupled (article) form, added to the
  gradient before clipping.

  Clipping comes first so that it bounds what the error-feedback residual can
  accumulate (Deep Gradient Compression's local clipping); article 004's
  pseudo-code clips after sampling. The variance rate comes after the adaptive
  step, because Adam's normalisation would cancel any per-leaf scale applied
  before it. Freezing comes last so that a frozen leaf's update is exactly 0
  even though Adam's momentum is still non-zero.

  Defaults, chosen by measurement (``python -m benchmarks.study``, README
  "Defaults chosen by measurement"): clipping at norm 1, the sampled top-k
  with error feedback keeping 30% of each leaf of at least 1,024 entries,
  and Nesterov's Adam (``adam_weight=1``); Taylor importance weighting, the
  RMSProp half of the mix and the variance rate are off, because each made
  the loss worse than the tuned baselines on the benchmark suite. The
  articles' literal settings are ``grpo(lr, **ARTICLE_DEFAULTS)``
  (importance on, ``adam_weight=0.5``, ``variance_coef=0.1``, every leaf
  sparsified). The default top-k estimates its threshold from a sample
  (``topk_method="sampled"``): an exact top-k sorts every leaf, about 200
  Adam updates on a CPU.

  Extra arguments of ``update`` reach the stages: ``hessian_diag=`` and
  ``head_entropy=`` (importance), ``grad_variance=`` (variance rate).

  Args:
    learning_rate: a float or an optax schedule.
    max_norm: global-norm bound, or None for no clipping.
    l2: coupled L2 coefficient (added to the gradient before clipping), or
      None (off).
    weight_decay: decoupled weight decay as in ``optax.adamw``, or None.
    weight_decay_mask: a tree of bools (or a callable of params returning
      one) choosing the leaves that decay, as ``optax.adamw``'s ``mask``
      (``mask=`` itself raises a ``TypeError`` naming this keyword: a
      "mask" here is the gradient mask).
    importance: enable Taylor importance weighting.
    importance_placement: ``"input"`` (the articles' order: the weights
      scale the gradient before the adaptive step) or ``"output"`` (they
      scale the adaptive step's output, where Adam's normalisation cannot
      cancel them).
    importance_order: 1 or 2 (second-order term with a Fisher diagonal).
    importance_decay: EMA decay of the importance statistics.
    min_weight: lower clip of the importance weights.
    max_weight: upper clip of the importance weights.
    sparsify: ``"topk"``, ``"threshold"`` or None.
    fraction: kept fraction of the top-k mask.
    topk_method: ``"sampled"`` (default, O(n)) or ``"exact"``.
    error_feedback: carry the masked-out part to the next step.
    frequency_weight: weight of the update-frequency term of the top-k score,
      or None (off: no frequency buffer).
    min_size: leaves smaller than this are not sparsified.
    sparsify_warmup_steps: exponential warm-up of the kept fraction.
    alpha: EMA weight of the threshold mask.
    every: refresh period of the threshold, in steps.
    threshold_scale: multiplier of the threshold.
    adaptive: enable the Nesterov + Adam/RMSProp step.
    b1: first-moment decay.
    b2: second-moment decay.
    eps: denominator epsilon.
    eps_root: epsilon inside Adam's square root.
    adam_weight: weight of Adam in the Adam/RMSProp mix (1: Adam/NAdam only).
    nesterov: Nesterov look-ahead for the Adam part.
    rms_bias_correction: divide the RMSProp part's second moment by
      ``1 - b2^t`` as Adam does (off: the article's plain RMSProp).
    filter_decay: decay of the moving-average noise filter, or None.
    mu_dtype: dtype of the first moment (default: the param's; float32 for
      float16 params).
    nu_dtype: dtype of the second moment (same default).
    mu_format: storage format of the first moment (``"bfloat16"``,
      ``"bfloat16_sr"``, ``"int8"``: block-wise 8-bit, see
      :mod:`grpo_optax.quantization`), or None (``mu_dtype``).
    nu_format: the same for the second moment (``"uint8"`` for 8-bit).
    accumulator_format: storage of the mask's error-feedback accumulator:
      None (the params' dtype), ``"float32"``, ``"bfloat16_sr"`` or
      ``"int8_sr"`` (block-wise 8 bits), the lossy ones rounded
      stochastically (unbiased); the mask, the update and the next
      residual all read the stored value.
    variance_coef: coefficient of the variance rate, or None for off.
    variance_decay: EMA decay of the variance estimate.
    variance_reduction: ``"element"``, ``"leaf"`` or ``"global"``.
    variance_normalize: divide the variance by the second moment.
    variance_eps: added to that normaliser.
    freeze_threshold: freezing threshold, or None for no freezing.
    freeze_decay: EMA decay of the freezing importance.
    freeze_warmup_steps: steps before any leaf may freeze.
    seed: seed of the sampled top-k threshold.
    fused: None (default: the fused core where the settings allow), True
      (require it) or False (the chain of the rooms); same updates.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; its update needs ``params``
    when importance, L2 or freezing is on.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, grpo_optax
    >>> params = {"w": jnp.ones((4, 4))}
    >>> tx = grpo_optax.grpo(1e-2, sparsify="threshold")
    >>> state = tx.init(params)
    >>> grads = jax.grad(lambda p: jnp.sum(p["w"] ** 2))(params)
    >>> updates, state = tx.update(grads, state, params)
    >>> params = optax.apply_updates(params, updates)

  References:
    See the stages' docstrings.
  """
  _common.check_choice("grpo: sparsify", sparsify, SPARSIFIERS)
  _common.check_choice(
    "grpo: importance_placement", importance_placement, PLACEMENTS
  )
  for name, value in (
    ("importance", importance),
    ("adaptive", adaptive),
    ("rms_bias_correction", rms_bias_correction),
  ):
    _common.check_bool(f"grpo: {name}", value)
  _common.check_bool("grpo: fused", fused, allow_none=True)
  _check_learning_rate(learning_rate)
  if weight_decay is not None:
    _common.check_range("grpo: weight_decay", weight_decay, 0.0)
  rooms = _rooms(**locals())
  blockers = [
    name
    for name, on in (
      ("topk_method='exact'", sparsify == "topk" and topk_method == "exact"),
      ("frequency_weight", sparsify == "topk" and frequency_weight is not None),
      ("filter_decay", filter_decay is not None),
      (
        "a stochastic mu_format/nu_format",
        any(
          f is not None and quantization.state_format(f).stochastic
          for f in (mu_format, nu_format)
        ),
      ),
      ("adaptive=False", not adaptive),
    )
    if on
  ]
  if fused and blockers:
    raise ValueError(
      f"grpo: fused=True cannot honour {', '.join(blockers)} (the fused "
      "core covers clipping, the sampled top-k / EMA threshold and the Adam "
      "step); use fused=None or fused=False"
    )
  use_core = not blockers and fused is not False
  clip_on = max_norm is not None or l2 is not None
  # The fused core's arguments after its clip settings (_core's order).
  core_args = (
    sparsify,
    fraction,
    error_feedback,
    min_size,
    sparsify_warmup_steps,
    seed,
    alpha,
    every,
    threshold_scale,
    b1,
    b2,
    eps,
    eps_root,
    adam_weight,
    nesterov,
    rms_bias_correction,
    mu_dtype,
    nu_dtype,
    mu_format,
    nu_format,
    accumulator_format,
  )
  stages = []
  if use_core and not (importance and importance_placement == "input"):
    stages.append(_core(max_norm, l2, *core_args))
  else:
    if clip_on:
      stages.append(rooms["clip"])
    if importance and importance_placement == "input":
      stages.append(rooms["importance"])
    if use_core:
      stages.append(_core(None, None, *core_args))
    else:
      if sparsify is not None:
        stages.append(rooms[sparsify])
      if adaptive:
        stages.append(rooms["adaptive"])
  if importance and importance_placement == "output":
    stages.append(rooms["importance"])
  if variance_coef is not None:
    stages.append(rooms["variance"])
  if weight_decay is not None:
    stages.append(optax.add_decayed_weights(weight_decay, weight_decay_mask))
  stages.append(optax.scale_by_learning_rate(learning_rate))
  if freeze_threshold is not None:
    stages.append(rooms["freeze"])
  return optax.chain(*stages)


def _check_learning_rate(learning_rate) -> None:
  if callable(learning_rate):
    return
  _common.check_number(
    "grpo: learning_rate",
    learning_rate,
    kind=f"{_common.NUMBER} or an optax schedule",
  )
  v = _common.concrete_value(learning_rate)
  if v is not None and not v >= 0:
    raise ValueError(
      f"grpo: learning_rate must be in [0, inf) (a positive step size; "
      f"the sign is applied inside); got {learning_rate!r}"
    )


def _rooms(
  *,
  max_norm,
  l2,
  importance_order,
  importance_decay,
  min_weight,
  max_weight,
  fraction,
  error_feedback,
  topk_method,
  frequency_weight,
  min_size,
  sparsify_warmup_steps,
  seed,
  alpha,
  every,
  threshold_scale,
  b1,
  b2,
  eps,
  eps_root,
  adam_weight,
  nesterov,
  rms_bias_correction,
  filter_decay,
  mu_dtype,
  nu_dtype,
  mu_format,
  nu_format,
  accumulator_format,
  variance_coef,
  variance_decay,
  variance_eps,
  variance_reduction,
  variance_normalize,
  freeze_threshold,
  freeze_decay,
  freeze_warmup_steps,
  **_,
):
  """Every room, validated (also those switched off), by name."""
  return {
    "clip": _stage(
      clip_with_l2,
      max_norm=("max_norm", np.inf if max_norm is None else max_norm),
      l2=("l2", l2),
    ),
    "importance": _stage(
      scale_by_importance,
      order=("importance_order", importance_order),
      decay=("importance_decay", importance_decay),
      min_weight=("min_weight", min_weight),
      max_weight=("max_weight", max_weight),
    ),
    "topk": _stage(
      top_k_mask,
      fraction=("fraction", fraction),
      error_feedback=("error_feedback", error_feedback),
      method=("topk_method", topk_method),
      frequency_weight=("frequency_weight", frequency_weight),
      min_size=("min_size", min_size),
      warmup_steps=("sparsify_warmup_steps", sparsify_warmup_steps),
      seed=("seed", seed),
      accumulator_format=("accumulator_format", accumulator_format),
    ),
    "threshold": _stage(
      ema_threshold_mask,
      alpha=("alpha", alpha),
      every=("every", every),
      scale=("threshold_scale", threshold_scale),
      error_feedback=("error_feedback", error_feedback),
      min_size=("min_size", min_size),
      seed=("seed", seed),
      accumulator_format=("accumulator_format", accumulator_format),
    ),
    "adaptive": _stage(
      scale_by_nesterov_adam_rms,
      b1=("b1", b1),
      b2=("b2", b2),
      eps=("eps", eps),
      eps_root=("eps_root", eps_root),
      adam_weight=("adam_weight", adam_weight),
      nesterov=("nesterov", nesterov),
      rms_bias_correction=("rms_bias_correction", rms_bias_correction),
      filter_decay=("filter_decay", filter_decay),
      mu_dtype=("mu_dtype", mu_dtype),
      nu_dtype=("nu_dtype", nu_dtype),
      mu_format=("mu_format", mu_format),
      nu_format=("nu_format", nu_format),
    ),
    "variance": _stage(
      scale_by_variance_lr,
      coef=("variance_coef", 0.0 if variance_coef is None else variance_coef),
      decay=("variance_decay", variance_decay),
      eps=("variance_eps", variance_eps),
      reduction=("variance_reduction", variance_reduction),
      normalize=("variance_normalize", variance_normalize),
    ),
    "freeze": _stage(
      freeze_below,
      threshold=(
        "freeze_threshold",
        0.0 if freeze_threshold is None else freeze_threshold,
      ),
      decay=("freeze_decay", freeze_decay),
      warmup_steps=("freeze_warmup_steps", freeze_warmup_steps),
    ),
  }


def _core(
  max_norm,
  l2,
  sparsify,
  fraction,
  error_feedback,
  min_size,
  warmup_steps,
  seed,
  alpha,
  every,
  threshold_scale,
  b1,
  b2,
  eps,
  eps_root,
  adam_weight,
  nesterov,
  rms_bias_correction,
  mu_dtype,
  nu_dtype,
  mu_format=None,
  nu_format=None,
  accumulator_format=None,
) -> optax.GradientTransformationExtraArgs:
  """The fused clip + mask + Adam core (arguments validated by _rooms)."""
  f32 = _common.f32
  clip = None
  if max_norm is not None or l2 is not None:
    l2_on = l2 is not None and not _common.is_static_zero(l2)
    clip = fused_lib._Clip(  # pylint: disable=protected-access
      max_norm=f32(np.inf if max_norm is None else max_norm),
      l2=f32(l2) if l2_on else None,
    )
  mask = None
  if sparsify is not None:
    mask = fused_lib._Mask(  # pylint: disable=protected-access
      kind=sparsify,
      fraction=f32(fraction),
      error_feedback=error_feedback,
      min_size=min_size,
      warmup_steps=warmup_steps,
      seed=seed,
      alpha=f32(alpha),
      every=every,
      scale=f32(threshold_scale),
      accumulator_format=(
        None
        if accumulator_format is None
        else quantization.state_format(accumulator_format)
      ),
    )
  adam = fused_lib._Adam(  # pylint: disable=protected-access
    b1=f32(b1),
    b2=f32(b2),
    eps=f32(eps),
    eps_root=f32(eps_root),
    adam_weight=f32(adam_weight),
    nesterov=nesterov,
    rms_bias_correction=rms_bias_correction,
    mu_dtype=mu_dtype,
    nu_dtype=nu_dtype,
    mu_format=None
    if mu_format is None
    else quantization.state_format(mu_format),
    nu_format=None
    if nu_format is None
    else quantization.state_format(nu_format),
  )
  return fused_lib.clip_mask_adam(clip=clip, mask=mask, adam=adam)


def _stage(factory, **named_args):
  """Builds a stage; errors name the preset's argument, not the stage's."""
  kwargs = {k: v for k, (_, v) in named_args.items()}
  try:
    return factory(**kwargs)
  except (ValueError, TypeError) as e:
    msg = str(e)
    for inner, (outer, _) in named_args.items():
      if msg.startswith(inner + " ") and inner != outer:
        msg = outer + msg[len(inner) :]
        break
    raise type(e)(f"grpo: {msg}") from None
