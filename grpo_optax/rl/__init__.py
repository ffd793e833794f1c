"""The real GRPO: group relative policy optimisation for RL fine-tuning.

This subpackage is DeepSeek's *Group Relative Policy Optimization*, the
reinforcement-learning loss of DeepSeekMath and DeepSeek-R1, and its
successors (DAPO, Dr. GRPO, GSPO). It is unrelated to the optimizer
:func:`grpo_optax.grpo`, which implements the optimizer family that two
articles call "GRPO"; nothing here is named ``grpo(...)``.

Everything is a pure function of arrays (core needs only jax):

* :mod:`~grpo_optax.rl.advantages` -- :func:`group_advantages` (GRPO group
  std, batch std, none = Dr. GRPO, leave-one-out = RLOO),
  :func:`zero_signal_groups`.
* :mod:`~grpo_optax.rl.losses` -- :func:`token_log_probs`,
  :func:`token_entropy`, :func:`completion_mask`, :func:`kl_penalty` (k1, k2,
  k3), :func:`aggregate` and :func:`policy_loss` (clip, clip-higher, dual
  clip, sequence ratio, KL to a reference, metrics).
* :mod:`~grpo_optax.rl.sampling` -- :func:`sample` for causal decoders (Flax
  NNX modules or callables), KV-cached for decoders that implement the cache
  protocol, keys from ``(seed, step)``, log-probs recorded.
* :mod:`~grpo_optax.rl.truncation` -- :class:`Truncation` (top-k, top-p,
  min-p) and :func:`truncated_logits`, shared by the sampler and the loss.
* :mod:`~grpo_optax.rl.batching` -- :func:`loss_normalizer` (the whole
  batch's counts, for microbatches and devices), :func:`drop_zero_signal`
  and :func:`select_groups` (DAPO's dynamic sampling with static shapes).
* :class:`Config` -- the static choices, with presets ``"grpo"``,
  ``"dapo"``, ``"dr_grpo"``, ``"gspo"``.

A training step: sample ``G`` completions per prompt, score them, turn the
rewards ``[num_prompts, G]`` into advantages, and minimise
:func:`policy_loss` of the re-scored completions with any optax optimizer.
``examples/rl_sum_to_target`` and ``examples/rl_arithmetic`` are complete,
runnable loops.
"""

from grpo_optax.rl.advantages import group_advantages
from grpo_optax.rl.advantages import zero_signal_groups
from grpo_optax.rl.batching import LossNormalizer
from grpo_optax.rl.batching import drop_zero_signal
from grpo_optax.rl.batching import group_rows
from grpo_optax.rl.batching import loss_normalizer
from grpo_optax.rl.batching import select_groups
from grpo_optax.rl.config import ADVANTAGE_ESTIMATORS
from grpo_optax.rl.config import AGGREGATIONS
from grpo_optax.rl.config import KL_ESTIMATORS
from grpo_optax.rl.config import PRESETS
from grpo_optax.rl.config import RATIO_LEVELS
from grpo_optax.rl.config import Config
from grpo_optax.rl.losses import aggregate
from grpo_optax.rl.losses import completion_mask
from grpo_optax.rl.losses import kl_penalty
from grpo_optax.rl.losses import policy_loss
from grpo_optax.rl.losses import token_entropy
from grpo_optax.rl.losses import token_log_probs
from grpo_optax.rl.sampling import Samples
from grpo_optax.rl.sampling import sample
from grpo_optax.rl.sampling import sampling_key
from grpo_optax.rl.truncation import Truncation
from grpo_optax.rl.truncation import truncated_logits

__all__ = (
  "ADVANTAGE_ESTIMATORS",
  "AGGREGATIONS",
  "Config",
  "KL_ESTIMATORS",
  "LossNormalizer",
  "PRESETS",
  "RATIO_LEVELS",
  "Samples",
  "Truncation",
  "aggregate",
  "completion_mask",
  "drop_zero_signal",
  "group_advantages",
  "group_rows",
  "kl_penalty",
  "loss_normalizer",
  "policy_loss",
  "sample",
  "sampling_key",
  "select_groups",
  "token_entropy",
  "token_log_probs",
  "truncated_logits",
  "zero_signal_groups",
)
