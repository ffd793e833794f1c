"""grpo_optax: composable optax transforms for the "GRPO" optimizer family.

Each seed mechanism of the two source articles lives in one module:

* :mod:`grpo_optax.variance` -- variance-based dynamic learning rate.
* :mod:`grpo_optax.momentum` -- noise filter + Nesterov + Adam/RMSProp mix.
* :mod:`grpo_optax.clipping` -- global-norm clipping with coupled L2.
* :mod:`grpo_optax.presets` -- the :func:`grpo` chain.
"""

from grpo_optax.clipping import ClipWithL2State
from grpo_optax.clipping import clip_with_l2
from grpo_optax.momentum import ScaleByNesterovAdamRmsState
from grpo_optax.momentum import scale_by_nesterov_adam_rms
from grpo_optax.presets import grpo
from grpo_optax.variance import ScaleByVarianceLrState
from grpo_optax.variance import scale_by_variance_lr

__version__ = "0.1.0"

__all__ = [
    "ClipWithL2State",
    "ScaleByNesterovAdamRmsState",
    "ScaleByVarianceLrState",
    "clip_with_l2",
    "grpo",
    "scale_by_nesterov_adam_rms",
    "scale_by_variance_lr",
]
