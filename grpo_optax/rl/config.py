"""The static choices of a group-relative policy-optimisation loss.

One frozen (hashable) dataclass holds every choice that changes the computed
function: the advantage estimator, the clipping, the ratio level, the
aggregation, the KL penalty and the sampling temperature. It can be closed
over or passed as a static argument of ``jax.jit``. :meth:`Config.preset`
gives the published recipes:

==============  ==========  ============  ==========  ===================  ====
preset          advantages  clip (low,    ratio       aggregation          beta
                            high)
==============  ==========  ============  ==========  ===================  ====
``"grpo"``      group_std   0.2, 0.2      token       seq-mean-token-mean  0.04
``"dapo"``      group_std   0.2, 0.28     token       token-mean           0
``"dr_grpo"``   none        0.2, 0.2      token       seq-mean-token-sum-  0
                                                      norm
``"gspo"``      group_std   3e-4, 4e-4    sequence    seq-mean-token-mean  0
==============  ==========  ============  ==========  ===================  ====
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = (
  "ADVANTAGE_ESTIMATORS",
  "AGGREGATIONS",
  "Config",
  "KL_ESTIMATORS",
  "PRESETS",
  "RATIO_LEVELS",
)

#: The ``estimator`` choices of :func:`~grpo_optax.rl.group_advantages` (and
#: ``Config.advantage_estimator``): group std (GRPO), batch std, none
#: (Dr. GRPO) and leave-one-out (RLOO).
ADVANTAGE_ESTIMATORS = ("group_std", "batch_std", "none", "rloo")
#: The ``mode`` choices of :func:`~grpo_optax.rl.aggregate` (and
#: ``Config.aggregation``): how per-token losses become one number.
AGGREGATIONS = (
  "seq-mean-token-mean",
  "token-mean",
  "seq-mean-token-sum-norm",
  "seq-mean-token-sum",
)
#: The ``estimator`` choices of :func:`~grpo_optax.rl.kl_penalty` (and
#: ``Config.kl_estimator``): Schulman's k1, k2, k3.
KL_ESTIMATORS = ("k1", "k2", "k3")
#: Where the importance ratio is taken (``Config.ratio_level``): per token
#: (GRPO, DAPO) or per sequence (GSPO).
RATIO_LEVELS = ("token", "sequence")
#: The names :meth:`Config.preset` (and ``policy_loss(config=...)``) accept.
PRESETS = ("grpo", "dapo", "dr_grpo", "gspo")

_PRESET_OVERRIDES: dict[str, dict[str, Any]] = {
  # DeepSeekMath: group-normalised advantages, PPO clip 0.2, per-sequence
  # token mean, KL to the reference with the k3 estimator, beta = 0.04.
  "grpo": {},
  # DAPO: clip-higher (0.2 / 0.28), token-level loss, no KL term.
  "dapo": {"clip_eps_high": 0.28, "aggregation": "token-mean", "beta": 0.0},
  # Dr. GRPO: no std normalisation, no 1/|o| length normalisation (sum over
  # tokens divided by a constant budget), no KL term.
  "dr_grpo": {
    "advantage_estimator": "none",
    "aggregation": "seq-mean-token-sum-norm",
    "beta": 0.0,
  },
  # GSPO: sequence-level (length-normalised) importance ratio with a narrow
  # clip range, no KL term.
  "gspo": {
    "ratio_level": "sequence",
    "clip_eps_low": 3e-4,
    "clip_eps_high": 4e-4,
    "beta": 0.0,
  },
}


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
  if value not in choices:
    raise ValueError(
      f"Config.{name} must be one of "
      f"{', '.join(map(repr, choices))}; got {value!r}"
    )


def _check_number(
  name: str, value: Any, *, low: float, low_open: bool, high: float = math.inf
) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise TypeError(
      f"Config.{name} must be a Python number (the config is "
      f"static); got {type(value).__name__}"
    )
  ok = (value > low if low_open else value >= low) and value <= high
  if not ok or math.isnan(value):
    bound = f"({low:g}" if low_open else f"[{low:g}"
    raise ValueError(
      f"Config.{name} must be in {bound}, {high:g}]; got {value!r}"
    )


@dataclasses.dataclass(frozen=True)
class Config:
  """Static choices of the loss; defaults are DeepSeekMath's GRPO.

  Attributes:
    advantage_estimator: ``"group_std"`` (GRPO), ``"batch_std"``, ``"none"``
      (Dr. GRPO) or ``"rloo"``; see :func:`group_advantages`.
    advantage_eps: added to the standard deviation of the advantages, >= 0.
    clip_eps_low: the ratio is clipped below at ``1 - clip_eps_low``, in
      [0, 1].
    clip_eps_high: the ratio is clipped above at ``1 + clip_eps_high``, >= 0.
    dual_clip: ``None`` or ``c > 1``: for negative advantages the per-token
      loss is capped at ``-c * A`` (dual-clip PPO), so a huge ratio on a bad
      token cannot blow up the loss.
    ratio_level: ``"token"`` (PPO/GRPO) or ``"sequence"`` (GSPO: the
      geometric mean of the token ratios of a completion, in its token form).
    aggregation: how per-token losses become a scalar: ``"seq-mean-token-
      mean"`` (GRPO), ``"token-mean"`` (DAPO), ``"seq-mean-token-sum-norm"``
      (Dr. GRPO: token sums divided by a constant ``max_length``) or
      ``"seq-mean-token-sum"``; see :func:`aggregate`.
    max_length: the constant of ``"seq-mean-token-sum-norm"`` (the generation
      budget); ``None`` uses the padded completion length ``T``.
    beta: coefficient of the KL penalty to the reference policy, >= 0. When
      > 0 the loss needs ``ref_log_probs``.
    kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (DeepSeekMath); see
      :func:`kl_penalty`.
    temperature: sampling temperature, > 0. Log-probabilities are taken from
      ``logits / temperature`` by both the sampler and the loss, so the
      on-policy ratio is exactly 1.
  """

  advantage_estimator: str = "group_std"
  advantage_eps: float = 1e-6
  clip_eps_low: float = 0.2
  clip_eps_high: float = 0.2
  dual_clip: float | None = None
  ratio_level: str = "token"
  aggregation: str = "seq-mean-token-mean"
  max_length: int | None = None
  beta: float = 0.04
  kl_estimator: str = "k3"
  temperature: float = 1.0

  def __post_init__(self):
    _check_choice(
      "advantage_estimator", self.advantage_estimator, ADVANTAGE_ESTIMATORS
    )
    _check_choice("ratio_level", self.ratio_level, RATIO_LEVELS)
    _check_choice("aggregation", self.aggregation, AGGREGATIONS)
    _check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
    _check_number("advantage_eps", self.advantage_eps, low=0.0, low_open=False)
    _check_number(
      "clip_eps_low", self.clip_eps_low, low=0.0, low_open=False, high=1.0
    )
    _check_number("clip_eps_high", self.clip_eps_high, low=0.0, low_open=False)
    _check_number("beta", self.beta, low=0.0, low_open=False)
    _check_number("temperature", self.temperature, low=0.0, low_open=True)
    if self.dual_clip is not None:
      _check_number("dual_clip", self.dual_clip, low=1.0, low_open=True)
    if self.max_length is not None and (
      isinstance(self.max_length, bool)
      or not isinstance(self.max_length, int)
      or self.max_length < 1
    ):
      raise ValueError(
        f"Config.max_length must be None or an int >= 1; got "
        f"{self.max_length!r}"
      )

  @classmethod
  def preset(cls, name: str, **overrides: Any) -> Config:
    """A published recipe (``"grpo"``, ``"dapo"``, ``"dr_grpo"``, ``"gspo"``),
    with any field overridden by keyword.

    Examples:
      >>> from grpo_optax import rl
      >>> rl.Config.preset("dapo").clip_eps_high
      0.28
      >>> rl.Config.preset("gspo", beta=0.01).ratio_level
      'sequence'
    """
    if name not in _PRESET_OVERRIDES:
      raise ValueError(
        f"preset must be one of {', '.join(map(repr, PRESETS))}; got {name!r}"
      )
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
      raise TypeError(
        f"unknown Config field(s) {unknown}; fields are {sorted(fields)}"
      )
    return cls(**{**_PRESET_OVERRIDES[name], **overrides})
