"""Extra optimizers for the convergence suite: the preset's other settings.

``python -m benchmarks.convergence --factory benchmarks.variants:VARIANTS``
adds them to the table beside the library's defaults:

* ``grpo_article``: ``grpo(lr, **ARTICLE_DEFAULTS)``, the articles' literal
  settings (importance weighting on, half Nesterov-Adam / half RMSProp, the
  variance learning rate at rate 0.1, every leaf masked);
* ``grpo_min_size_0``: the defaults with ``min_size=0``, so that leaves under
  1,024 entries are masked too (the default leaves them dense, which keeps the
  compiled program small); it shows what that choice costs in loss.
"""

from __future__ import annotations

import grpo_optax
from grpo_optax import quantization

VARIANTS = {
  "grpo_article": lambda lr: grpo_optax.grpo(lr, **grpo_optax.ARTICLE_DEFAULTS),
  "grpo_min_size_0": lambda lr: grpo_optax.grpo(lr, min_size=0),
}

#: The preset with its state in 8 bits (issue "the update at large-model
#: scale"): ``python -m benchmarks.convergence --optimizers adam,grpo
#: --factory benchmarks.variants:EIGHT_BIT --seeds 2 --out
#: benchmarks/results/eight_bit`` compares each with ``grpo`` (fp32 state).
EIGHT_BIT = {
  # Adam's moments in block-wise 8 bits (int8 mu, uint8 nu).
  "grpo_int8": lambda lr: grpo_optax.grpo(
    lr, mu_format="int8", nu_format="uint8"
  ),
  # ... and the error-feedback accumulator too (8 bits, stochastic rounding).
  "grpo_8bit": lambda lr: grpo_optax.grpo(
    lr, mu_format="int8", nu_format="uint8", accumulator_format="int8_sr"
  ),
  # The moments of every leaf in 8 bits, also those under the formats'
  # min_size of 4,096 entries (which the two above keep in float32): what
  # the codec itself costs on the suite's small problems.
  "grpo_int8_every_leaf": lambda lr: grpo_optax.grpo(
    lr,
    mu_format=quantization.state_format("int8", min_size=0),
    nu_format=quantization.state_format("uint8", min_size=0),
  ),
}

#: The error-feedback accumulator in bf16 with stochastic rounding, for
#: top-k and the EMA threshold (issue "the update at large-model scale",
#: part 4: fewer bytes per step): ``python -m benchmarks.convergence
#: --optimizers adam,grpo --factory benchmarks.variants:ACCUMULATOR --seeds
#: 2 --out benchmarks/results/accumulator``.
ACCUMULATOR = {
  "grpo_acc_bf16": lambda lr: grpo_optax.grpo(
    lr, accumulator_format="bfloat16_sr"
  ),
  "grpo_threshold": lambda lr: grpo_optax.grpo(lr, sparsify="threshold"),
  "grpo_threshold_acc_bf16": lambda lr: grpo_optax.grpo(
    lr, sparsify="threshold", accumulator_format="bfloat16_sr"
  ),
}
