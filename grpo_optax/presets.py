"""The ``grpo`` preset: the articles' mechanisms in one optimizer.

``grpo()`` is built from one table, :data:`WIRING`: each keyword is one
field of one mechanism's config (or a switch of the preset). It builds every
mechanism's config from it (validated, also those switched off), then runs
the mechanisms that are on in their fixed order, either one by one (the
chain of their public transforms, ``fused=False``) or with clipping, the mask
and the Adam step in one transform (:func:`grpo_optax.fused.clip_mask_adam`,
the default where the settings allow), which computes the same updates from
the same state. The state is a :class:`GrpoState` with one field per
mechanism in both forms. ``docs/design.md`` describes the mechanisms and
how to add one.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import numpy as np
import optax

from grpo_optax import _common
from grpo_optax import _mechanism
from grpo_optax import fused as fused_lib
from grpo_optax.adaptive_clipping import ZClipConfig
from grpo_optax.adaptive_clipping import ZClipState
from grpo_optax.clipping import ClipWithL2Config
from grpo_optax.clipping import ClipWithL2State
from grpo_optax.freezing import FreezeBelowConfig
from grpo_optax.freezing import FreezeBelowState
from grpo_optax.importance import ScaleByImportanceConfig
from grpo_optax.importance import ScaleByImportanceState
from grpo_optax.momentum import ScaleByNesterovAdamRmsConfig
from grpo_optax.momentum import ScaleByNesterovAdamRmsState
from grpo_optax.sparsify import EmaThresholdMaskConfig
from grpo_optax.sparsify import EmaThresholdMaskState
from grpo_optax.sparsify import TopKMaskConfig
from grpo_optax.sparsify import TopKMaskState
from grpo_optax.variance import ScaleByVarianceLrConfig
from grpo_optax.variance import ScaleByVarianceLrState

__all__ = (
  "ARTICLE_DEFAULTS",
  "GrpoState",
  "Knob",
  "WIRING",
  "grpo",
)

SPARSIFIERS = ("topk", "threshold", None)
PLACEMENTS = ("input", "output")

# The articles' literal settings, where grpo()'s measured defaults differ:
# ``grpo(lr, **ARTICLE_DEFAULTS)`` is the optimizer as the articles describe
# it (Taylor importance weighting, the 50/50 Adam/RMSProp mix, the variance
# rate with coefficient 0.1, every leaf sparsified, the top 30% kept). See
# the docs, "Defaults chosen by measurement", for why the defaults differ.
ARTICLE_DEFAULTS = {
  "importance": True,
  "adam_weight": 0.5,
  "variance_coef": 0.1,
  "min_size": 0,
  "fraction": 0.3,
}

#: The mechanisms' configs, by the name :data:`WIRING` uses.
MECHANISMS: dict[str, type[_mechanism.Config]] = {
  "zclip": ZClipConfig,
  "clip": ClipWithL2Config,
  "importance": ScaleByImportanceConfig,
  "topk": TopKMaskConfig,
  "threshold": EmaThresholdMaskConfig,
  "adaptive": ScaleByNesterovAdamRmsConfig,
  "variance": ScaleByVarianceLrConfig,
  "freeze": FreezeBelowConfig,
}


def _inf_if_none(value):
  return np.inf if value is None else value


def _zero_if_none(value):
  return 0.0 if value is None else value


def _z_or_default(value):
  return ZClipConfig.z_threshold if value is None else value


@dataclasses.dataclass(frozen=True)
class Knob:
  """One keyword of :func:`grpo`.

  Attributes:
    keyword: the keyword.
    default: its default.
    fields: the ``(mechanism, config field)`` pairs it sets (empty for a
      switch of the preset itself: ``sparsify``, ``fused``, ...).
    convert: maps the keyword's value to the fields' (e.g. ``max_norm=None``,
      no clipping, is the clip config's ``inf``), or None.
    help: one line for the docs' table and the examples' flags.
    annotation: the type it takes, as :func:`grpo`'s signature shows it.
  """

  keyword: str
  default: Any
  fields: tuple[tuple[str, str], ...] = ()
  convert: Callable[[Any], Any] | None = None
  help: str = ""
  annotation: str = "Any"


# A keyword that may be None says so; the others take their default's type.
_OPTIONAL = {
  "zclip": "float | None",
  "max_norm": "float | None",
  "l2": "float | None",
  "weight_decay": "float | None",
  "sparsify": "str | None",
  "frequency_weight": "float | None",
  "filter_decay": "float | None",
  "mu_dtype": "jax.typing.DTypeLike | None",
  "nu_dtype": "jax.typing.DTypeLike | None",
  "weight_decay_mask": "Any | Callable[[Any], Any] | None",
  "mu_format": "str | None",
  "nu_format": "str | None",
  "accumulator_format": "str | None",
  "variance_coef": "float | None",
  "freeze_threshold": "float | None",
  "fused": "bool | None",
}


def _k(keyword, default, *fields, convert=None, help=""):  # noqa: A002
  pairs = tuple(tuple(f.split(".")) for f in fields)
  annotation = _OPTIONAL.get(keyword) or (
    type(default).__name__ if default is not None else "Any"
  )
  return Knob(keyword, default, pairs, convert, help, annotation)  # pyright: ignore[reportArgumentType]


#: Every keyword of :func:`grpo`, in the order of its signature: the one
#: source of the preset's wiring (its signature, the docs' parameter table
#: and the examples' ``--grpo-*`` flags are built from it).
WIRING: tuple[Knob, ...] = (
  _k(
    "zclip",
    None,
    "zclip.z_threshold",
    convert=_z_or_default,
    help="ZClip's z-score threshold, or None (off)",
  ),
  _k(
    "zclip_alpha", 0.97, "zclip.alpha", help="EMA weight of ZClip's statistics"
  ),
  _k(
    "zclip_warmup_steps",
    25,
    "zclip.warmup_steps",
    help="steps whose norms only build ZClip's statistics",
  ),
  _k(
    "max_norm",
    1.0,
    "clip.max_norm",
    convert=_inf_if_none,
    help="global-norm bound, or None (no clipping)",
  ),
  _k("l2", None, "clip.l2", help="coupled L2 coefficient, or None (off)"),
  _k(
    "weight_decay", None, help="decoupled weight decay (optax.adamw's), or None"
  ),
  _k("weight_decay_mask", None, help="leaves that decay (optax.adamw's mask)"),
  _k("importance", False, help="Taylor importance weighting on/off"),
  _k(
    "importance_order",
    2,
    "importance.order",
    help="1 or 2 (with the Fisher diagonal)",
  ),
  _k(
    "importance_decay",
    0.9,
    "importance.decay",
    help="EMA decay of the importance",
  ),
  _k(
    "importance_placement",
    "input",
    help="'input' (before the adaptive step) or 'output' (after it)",
  ),
  _k(
    "min_weight", 0.1, "importance.min_weight", help="lower clip of the weights"
  ),
  _k(
    "max_weight",
    10.0,
    "importance.max_weight",
    help="upper clip of the weights",
  ),
  _k("sparsify", "topk", help="'topk', 'threshold' or None (dense)"),
  _k("fraction", 0.5, "topk.fraction", help="kept fraction of the top-k mask"),
  _k("topk_method", "sampled", "topk.method", help="'sampled' or 'exact'"),
  _k(
    "error_feedback",
    True,
    "topk.error_feedback",
    "threshold.error_feedback",
    help="carry the masked-out part to the next step",
  ),
  _k(
    "frequency_weight",
    None,
    "topk.frequency_weight",
    help="weight of the update-frequency term of the score, or None",
  ),
  _k(
    "min_size",
    1024,
    "topk.min_size",
    "threshold.min_size",
    help="leaves smaller than this are not sparsified",
  ),
  _k(
    "sparsify_warmup_steps",
    0,
    "topk.warmup_steps",
    help="exponential warm-up of the kept fraction",
  ),
  _k("alpha", 0.7, "threshold.alpha", help="EMA weight of the threshold mask"),
  _k("every", 100, "threshold.every", help="refresh period of the threshold"),
  _k(
    "threshold_scale",
    1.0,
    "threshold.scale",
    help="multiplier of the threshold",
  ),
  _k("adaptive", True, help="the Nesterov + Adam/RMSProp step on/off"),
  _k("b1", 0.9, "adaptive.b1", help="first-moment decay"),
  _k("b2", 0.999, "adaptive.b2", help="second-moment decay"),
  _k("eps", 1e-8, "adaptive.eps", help="denominator epsilon"),
  _k(
    "eps_root", 0.0, "adaptive.eps_root", help="epsilon inside the square root"
  ),
  _k(
    "adam_weight",
    1.0,
    "adaptive.adam_weight",
    help="weight of Adam in the Adam/RMSProp mix",
  ),
  _k("nesterov", True, "adaptive.nesterov", help="Nesterov look-ahead"),
  _k(
    "rms_bias_correction",
    False,
    "adaptive.rms_bias_correction",
    help="bias-correct the RMSProp part",
  ),
  _k(
    "filter_decay",
    None,
    "adaptive.filter_decay",
    help="decay of the noise filter, or None",
  ),
  _k("mu_dtype", None, "adaptive.mu_dtype", help="dtype of the first moment"),
  _k("nu_dtype", None, "adaptive.nu_dtype", help="dtype of the second moment"),
  _k(
    "mu_format",
    None,
    "adaptive.mu_format",
    help="storage of the first moment ('int8', 'bfloat16', ...)",
  ),
  _k(
    "nu_format",
    None,
    "adaptive.nu_format",
    help="storage of the second moment ('uint8', 'bfloat16', ...)",
  ),
  _k(
    "accumulator_format",
    None,
    "topk.accumulator_format",
    "threshold.accumulator_format",
    help="storage of the error-feedback accumulator ('int8_sr', ...)",
  ),
  _k(
    "variance_coef",
    None,
    "variance.coef",
    convert=_zero_if_none,
    help="coefficient of the variance rate, or None (off)",
  ),
  _k(
    "variance_decay", 0.99, "variance.decay", help="EMA decay of the variance"
  ),
  _k(
    "variance_reduction",
    "leaf",
    "variance.reduction",
    help="'element', 'leaf' or 'global'",
  ),
  _k(
    "variance_normalize",
    False,
    "variance.normalize",
    help="divide the variance by the second moment",
  ),
  _k("variance_eps", 1e-12, "variance.eps", help="added to that normaliser"),
  _k(
    "freeze_threshold",
    None,
    "freeze.threshold",
    convert=_zero_if_none,
    help="freezing threshold, or None (off)",
  ),
  _k(
    "freeze_decay",
    0.9,
    "freeze.decay",
    help="EMA decay of the freezing importance",
  ),
  _k(
    "freeze_warmup_steps",
    100,
    "freeze.warmup_steps",
    help="steps before any leaf may freeze",
  ),
  _k(
    "seed",
    0,
    "topk.seed",
    "threshold.seed",
    help="seed of the sampled top-k and of the accumulator's rounding",
  ),
  _k("fused", None, help="None (the fused core where possible), True or False"),
)


class GrpoState(NamedTuple):
  """State of :func:`grpo`: each mechanism's own state (None when off), in
  the order they act; the same structure for ``fused=True`` and
  ``fused=False``.

  Attributes:
    zclip: :class:`ZClipState` (``zclip=``), or None.
    clip: :class:`ClipWithL2State` (``max_norm=`` or ``l2=``), or None.
    importance: :class:`ScaleByImportanceState` (``importance=True``), or
      None.
    mask: :class:`TopKMaskState` or :class:`EmaThresholdMaskState`
      (``sparsify=``), or None.
    adaptive: :class:`ScaleByNesterovAdamRmsState` (``adaptive=True``), or
      None.
    variance: :class:`ScaleByVarianceLrState` (``variance_coef=``), or None.
    decay: ``optax.add_decayed_weights``' state (``weight_decay=``), or None.
    schedule: ``optax.scale_by_learning_rate``'s state (a step count with a
      schedule).
    freeze: :class:`FreezeBelowState` (``freeze_threshold=``), or None.
  """

  zclip: ZClipState | None
  clip: ClipWithL2State | None
  importance: ScaleByImportanceState | None
  mask: TopKMaskState | EmaThresholdMaskState | None
  adaptive: ScaleByNesterovAdamRmsState | None
  variance: ScaleByVarianceLrState | None
  decay: Any
  schedule: Any
  freeze: FreezeBelowState | None


def _signature() -> inspect.Signature:
  keyword_only = inspect.Parameter.KEYWORD_ONLY
  return inspect.Signature(
    [
      inspect.Parameter(
        "learning_rate",
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        default=1e-3,
        # The type object, not a string: optax's contrib tests (and other
        # tools) read it to learn that a schedule is accepted.
        annotation=optax.ScalarOrSchedule,
      )
    ]
    + [
      inspect.Parameter(
        k.keyword, keyword_only, default=k.default, annotation=k.annotation
      )
      for k in WIRING
    ],
    return_annotation=optax.GradientTransformationExtraArgs,
  )


def _configs(values: dict[str, Any]) -> dict[str, _mechanism.Config]:
  """Every mechanism's config from the keywords' values (validated; an
  error names the preset's keyword, not the config's field).
  """
  fields: dict[str, dict[str, tuple[str, Any]]] = {m: {} for m in MECHANISMS}
  for knob in WIRING:
    value = values[knob.keyword]
    if knob.convert is not None:
      value = knob.convert(value)
    for mechanism, field in knob.fields:
      fields[mechanism][field] = (knob.keyword, value)
  return {
    name: _build(config_class, fields[name])
    for name, config_class in MECHANISMS.items()
  }


def _build(config_class, named: dict[str, tuple[str, Any]]):
  """``config_class(**values)``; errors name the preset's keyword."""
  try:
    return config_class(**{f: v for f, (_, v) in named.items()})
  except (ValueError, TypeError) as e:
    msg = str(e)
    for field, (keyword, _) in named.items():
      if msg.startswith(field + " ") and field != keyword:
        msg = keyword + msg[len(field) :]
        break
    raise type(e)(f"grpo: {msg}") from None


def _check_switches(values: dict[str, Any]) -> None:
  _common.check_choice("grpo: sparsify", values["sparsify"], SPARSIFIERS)
  _common.check_choice(
    "grpo: importance_placement", values["importance_placement"], PLACEMENTS
  )
  for name in ("importance", "adaptive"):
    _common.check_bool(f"grpo: {name}", values[name])
  _common.check_bool("grpo: fused", values["fused"], allow_none=True)
  lr = values["learning_rate"]
  if not callable(lr):
    _common.check_number(
      "grpo: learning_rate",
      lr,
      kind=f"{_common.NUMBER} or an optax schedule",
    )
    v = _common.concrete_value(lr)
    if v is not None and not v >= 0:
      raise ValueError(
        f"grpo: learning_rate must be in [0, inf) (a positive step size; "
        f"the sign is applied inside); got {lr!r}"
      )
  if values["weight_decay"] is not None:
    _common.check_range("grpo: weight_decay", values["weight_decay"], 0.0)


@dataclasses.dataclass(frozen=True)
class _Stage:
  """A transform of the preset and the :class:`GrpoState` fields it owns (a
  single field, or the fused core's three).
  """

  fields: tuple[str | None, ...]
  tx: Any

  def __post_init__(self):
    # optax's own transforms take no extra arguments (optax.chain wraps them
    # the same way).
    object.__setattr__(self, "tx", optax.with_extra_args_support(self.tx))

  @property
  def name(self) -> str:
    """The field of a one-field stage; ``"fused(clip, mask, adaptive)"``
    (the fields it holds) for the fused core.
    """
    if len(self.fields) == 1 and self.fields[0]:
      return self.fields[0]
    return f"fused({', '.join(f for f in self.fields if f)})"


def _core_stages(values, cfgs) -> list[_Stage]:
  """Clip, importance (input), mask and Adam: fused where allowed."""
  clip = (
    cfgs["clip"]
    if values["max_norm"] is not None or values["l2"] is not None
    else None
  )
  imp_in = values["importance"] and values["importance_placement"] == "input"
  mask = cfgs[values["sparsify"]] if values["sparsify"] is not None else None
  adam = cfgs["adaptive"] if values["adaptive"] else None
  blockers = fused_lib.fusable(mask, adam)
  if values["fused"] and blockers:
    raise ValueError(
      f"grpo: fused=True cannot honour {', '.join(blockers)} (the fused "
      "core covers clipping, the sampled top-k / EMA threshold and the Adam "
      "step); use fused=None or fused=False"
    )
  stages = []
  if not blockers and values["fused"] is not False:
    assert adam is not None  # no blocker: adaptive is on
    if imp_in:  # the fused core cannot span the importance weights
      if clip is not None:
        stages.append(_Stage(("clip",), clip.transform()))
      stages.append(_Stage(("importance",), cfgs["importance"].transform()))
      clip = None
    core = fused_lib.clip_mask_adam(clip=clip, mask=mask, adam=adam)
    owned = ("clip" if clip is not None else None, "mask", "adaptive")
    return stages + [_Stage(owned, core)]
  for field, cfg in (
    ("clip", clip),
    ("importance", cfgs["importance"] if imp_in else None),
    ("mask", mask),
    ("adaptive", adam),
  ):
    if cfg is not None:
      stages.append(_Stage((field,), cfg.transform()))
  return stages


def _stages(values: dict[str, Any]) -> list[_Stage]:
  cfgs = _configs(values)
  stages = []
  if values["zclip"] is not None:
    stages.append(_Stage(("zclip",), cfgs["zclip"].transform()))
  stages += _core_stages(values, cfgs)
  if values["importance"] and values["importance_placement"] == "output":
    stages.append(_Stage(("importance",), cfgs["importance"].transform()))
  if values["variance_coef"] is not None:
    stages.append(_Stage(("variance",), cfgs["variance"].transform()))
  if values["weight_decay"] is not None:
    decay = optax.add_decayed_weights(
      values["weight_decay"], values["weight_decay_mask"]
    )
    stages.append(_Stage(("decay",), decay))
  lr = optax.scale_by_learning_rate(values["learning_rate"])
  stages.append(_Stage(("schedule",), lr))
  if values["freeze_threshold"] is not None:
    stages.append(_Stage(("freeze",), cfgs["freeze"].transform()))
  return stages


def _compose(stages: list[_Stage]) -> optax.GradientTransformationExtraArgs:
  """The stages in order over one :class:`GrpoState` (a fused stage owns the
  non-None names of its ``fields``, aligned with ``FusedState``'s).
  """
  empty = dict.fromkeys(GrpoState._fields)

  def _write(fields, stage, state):
    if len(stage.fields) == 1:
      fields[stage.fields[0]] = state
    else:
      fields.update((f, x) for f, x in zip(stage.fields, state) if f)

  def init_fn(params):
    fields = dict(empty)
    for stage in stages:
      _write(fields, stage, stage.tx.init(params))
    return GrpoState(**fields)

  def update_fn(updates, state, params=None, **extra_args):
    fields = state._asdict()
    for stage in stages:
      if len(stage.fields) == 1:
        sub = fields[stage.fields[0]]
      else:
        sub = fused_lib.FusedState._make(
          fields[f] if f else None for f in stage.fields
        )
      updates, sub = stage.tx.update(updates, sub, params, **extra_args)
      _write(fields, stage, sub)
    return updates, GrpoState(**fields)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]


def grpo(learning_rate=1e-3, **kwargs) -> optax.GradientTransformationExtraArgs:
  r"""The GRPO optimizer: the articles' mechanisms as one optax transform.

  The mechanisms, in the order they act (each can be switched off):

  .. code-block:: text

    zclip(z_threshold, alpha, warmup_steps)          # zclip=None: off
    -> clip_with_l2(max_norm, l2)                    # None: off (l2 = 0)
    -> scale_by_importance(order, decay, ...)        # importance=False: off
    -> top_k_mask | ema_threshold_mask               # sparsify=None: off
    -> scale_by_nesterov_adam_rms(b1, b2, ...)       # adaptive=False: off
    -> [importance here with importance_placement="output"]
    -> scale_by_variance_lr(coef, decay, ...)        # variance_coef=None: off
    -> scale_by_learning_rate(learning_rate)
    -> freeze_below(threshold, ...)                  # freeze_threshold=None: off

  Every keyword is one field of one mechanism's config
  (:data:`grpo_optax.presets.WIRING`, the one table that the docs'
  parameter table and the examples' flags also read). The state is a
  :class:`GrpoState` with one field per mechanism (None when off), the same
  for both forms below, so a run checkpointed with one continues with the
  other.

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

  Defaults, chosen by measurement (``python -m benchmarks.study``, its
  transformer phase since 0.2.0; docs/benchmarks/defaults.md): clipping at
  norm 1, the sampled top-k with error feedback keeping 50% of each leaf of
  at least 1,024 entries,
  and Nesterov's Adam (``adam_weight=1``); Taylor importance weighting, the
  RMSProp half of the mix and the variance rate are off, because each made
  the loss worse than the tuned baselines on the benchmark suite. The
  articles' literal settings are ``grpo(lr, **ARTICLE_DEFAULTS)``
  (importance on, ``adam_weight=0.5``, ``variance_coef=0.1``, every leaf
  sparsified, 30% kept). The default top-k estimates its threshold from a sample
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
    seed: seed of the sampled top-k threshold (and of the accumulator's
      stochastic rounding).
    zclip: z-score threshold of ZClip (:func:`grpo_optax.zclip`), or None
      (off): gradient-norm spikes above ``mean + zclip * std`` of the
      norms' EMAs are scaled down to that bound, before clipping.
    zclip_alpha: EMA weight of ZClip's statistics.
    zclip_warmup_steps: steps whose norms only build ZClip's statistics.
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
  return _compose(_stages(_values(learning_rate, kwargs)))


def _values(learning_rate, kwargs: dict[str, Any]) -> dict[str, Any]:
  """Every keyword's value (the given or the default), checked: a keyword
  that is not in :data:`WIRING` is refused.
  """
  known = {k.keyword for k in WIRING}
  unknown = sorted(set(kwargs) - known)
  if "mask" in unknown:
    raise TypeError(
      "grpo() got an unexpected keyword argument 'mask': optax.adamw's "
      "mask (which leaves decay) is weight_decay_mask= here, beside "
      "weight_decay=; the gradient mask is sparsify= / min_size="
    )
  if unknown:
    raise TypeError(
      f"grpo() got an unexpected keyword argument {unknown[0]!r} (the "
      "keywords are grpo_optax.presets.WIRING's)"
    )
  values = {k.keyword: kwargs.get(k.keyword, k.default) for k in WIRING}
  values["learning_rate"] = learning_rate
  _check_switches(values)
  return values


def describe(learning_rate=1e-3, **kwargs) -> tuple[str, ...]:
  """The stages ``grpo(learning_rate, **kwargs)`` runs, in order: the
  :class:`GrpoState` field of each mechanism, or ``"fused(clip, mask,
  adaptive)"`` for the fused core (with the fields it holds).

  Examples:
    >>> import grpo_optax
    >>> grpo_optax.presets.describe()
    ('fused(clip, mask, adaptive)', 'schedule')
    >>> grpo_optax.presets.describe(fused=False)
    ('clip', 'mask', 'adaptive', 'schedule')
  """
  return tuple(stage.name for stage in _stages(_values(learning_rate, kwargs)))


grpo.__signature__ = _signature()  # pyright: ignore[reportFunctionMemberAccess]
