"""grpo_optax: composable optax transforms for the "GRPO" optimizer family.

Each seed mechanism of the two source articles lives in one module:

* :mod:`grpo_optax.variance` -- variance-based dynamic learning rate (1).
* :mod:`grpo_optax.importance` -- Taylor importance weighting (2).
* :mod:`grpo_optax.sparsify` -- top-k and EMA-threshold masks (3, 4).
* :mod:`grpo_optax.momentum` -- noise filter + Nesterov + Adam/RMSProp (5).
* :mod:`grpo_optax.clipping` -- global-norm clipping with coupled L2 (6).
* :mod:`grpo_optax.freezing` -- dynamic freezing (9).
* :mod:`grpo_optax.adaptive_clipping` -- ZClip, clipping of gradient-norm spikes by
  their z-score (beyond the articles).
* :mod:`grpo_optax.quantization` -- storage formats of optimizer state
  (fp32, bf16, stochastic bf16, block-wise 8-bit).
* :mod:`grpo_optax.presets` -- the :func:`grpo` preset (and ``ARTICLE_DEFAULTS``).
* :mod:`grpo_optax.fused` -- its fused clip + mask + Adam core.
* :mod:`grpo_optax.diagnostics` -- :func:`metrics` and friends.
* :mod:`grpo_optax.hlo` -- what a compiled step sends between devices
  (collectives, ring traffic) and its distinct fused computations.
* :mod:`grpo_optax.training` -- program changes: hierarchical gradients (7),
  immediate updates (8), freezing that skips compute (9).
* :mod:`grpo_optax.rl` -- unrelated to the optimizer: DeepSeek's Group
  Relative Policy Optimization, the RL loss (advantages, policy loss,
  sampler).
"""

from grpo_optax import hlo  # pylint: disable=g-bad-import-order
from grpo_optax import quantization  # pylint: disable=g-bad-import-order
from grpo_optax import rl  # pylint: disable=g-bad-import-order
from grpo_optax import training  # pylint: disable=g-bad-import-order
from grpo_optax.adaptive_clipping import ZClipConfig
from grpo_optax.adaptive_clipping import ZClipState
from grpo_optax.adaptive_clipping import zclip
from grpo_optax.clipping import ClipWithL2Config
from grpo_optax.clipping import ClipWithL2State
from grpo_optax.clipping import clip_with_l2
from grpo_optax.diagnostics import frozen_mask
from grpo_optax.diagnostics import importance_converged
from grpo_optax.diagnostics import metrics
from grpo_optax.freezing import FreezeBelowConfig
from grpo_optax.freezing import FreezeBelowState
from grpo_optax.freezing import freeze_below
from grpo_optax.fused import FusedState
from grpo_optax.fused import clip_mask_adam
from grpo_optax.importance import ScaleByImportanceConfig
from grpo_optax.importance import ScaleByImportanceState
from grpo_optax.importance import per_head
from grpo_optax.importance import scale_by_importance
from grpo_optax.momentum import ScaleByNesterovAdamRmsConfig
from grpo_optax.momentum import ScaleByNesterovAdamRmsState
from grpo_optax.momentum import scale_by_nesterov_adam_rms
from grpo_optax.presets import ARTICLE_DEFAULTS
from grpo_optax.presets import WIRING
from grpo_optax.presets import GrpoState
from grpo_optax.presets import Knob
from grpo_optax.presets import grpo
from grpo_optax.sparsify import EmaThresholdMaskConfig
from grpo_optax.sparsify import EmaThresholdMaskState
from grpo_optax.sparsify import TopKMaskConfig
from grpo_optax.sparsify import TopKMaskState
from grpo_optax.sparsify import ema_threshold_mask
from grpo_optax.sparsify import top_k_mask
from grpo_optax.variance import ScaleByVarianceLrConfig
from grpo_optax.variance import ScaleByVarianceLrState
from grpo_optax.variance import scale_by_variance_lr

__version__ = "0.2.0"

__all__ = [
  "ARTICLE_DEFAULTS",
  "ClipWithL2Config",
  "ClipWithL2State",
  "EmaThresholdMaskConfig",
  "EmaThresholdMaskState",
  "FreezeBelowConfig",
  "FreezeBelowState",
  "FusedState",
  "GrpoState",
  "Knob",
  "ScaleByImportanceConfig",
  "ScaleByImportanceState",
  "ScaleByNesterovAdamRmsConfig",
  "ScaleByNesterovAdamRmsState",
  "ScaleByVarianceLrConfig",
  "ScaleByVarianceLrState",
  "TopKMaskConfig",
  "TopKMaskState",
  "WIRING",
  "ZClipConfig",
  "ZClipState",
  "clip_mask_adam",
  "clip_with_l2",
  "ema_threshold_mask",
  "freeze_below",
  "frozen_mask",
  "grpo",
  "hlo",
  "importance_converged",
  "metrics",
  "per_head",
  "quantization",
  "rl",
  "scale_by_importance",
  "scale_by_nesterov_adam_rms",
  "scale_by_variance_lr",
  "top_k_mask",
  "training",
  "zclip",
]
