"""Group-relative advantages from outcome rewards.

Each prompt is answered ``G`` times; the rewards of its completions form a
group ``R[p, :]``. The advantage of a completion is its reward relative to the
other completions of the same prompt, so no value network is needed. Four
estimators are offered (``n_p`` = the number of valid rewards of group ``p``,
``mu_p`` their mean):

========================  ====================================================
``"group_std"`` (GRPO)    ``(R - mu_p) / (s_p + eps)``, ``s_p`` the group's
                          Bessel-corrected standard deviation
``"batch_std"``           ``(R - mu_p) / (s + eps)``, ``s`` the
                          Bessel-corrected standard deviation of all valid
                          rewards of the batch
``"none"`` (Dr. GRPO)     ``R - mu_p``
``"rloo"``                ``R_i - mean_{j != i} R_j = n_p / (n_p - 1) * (R_i -
                          mu_p)`` (leave-one-out baseline)
========================  ====================================================

Two rules make the estimators safe on real reward batches:

* A group whose valid rewards are all equal carries no signal; its advantages
  are exactly ``0`` (not ``0 / eps`` noise from rounding in ``R - mu_p``).
  So is a group with fewer than two valid rewards.
* A NaN reward (a completion the reward function could not score) is left
  out of every statistic and gets advantage ``0``. ``+-inf`` is not treated as
  missing: every advantage of a group holding one is NaN (even a group of
  all ``+inf``, whose rewards are equal), so the bug shows; under
  ``"batch_std"`` the batch statistic is NaN too, so every group with signal
  gets NaN. Such a group is not a zero-signal group.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from grpo_optax import _common
from grpo_optax.rl.config import ADVANTAGE_ESTIMATORS

__all__ = (
  "group_advantages",
  "zero_signal_groups",
)


def _as_rewards(rewards: jax.Array) -> jax.Array:
  rewards = jnp.asarray(rewards)
  if rewards.ndim != 2:
    raise ValueError(
      f"rewards must have shape [num_prompts, group_size], got shape "
      f"{rewards.shape}; reshape flat rewards with "
      "rewards.reshape(-1, group_size)."
    )
  if rewards.shape[1] < 2:
    raise ValueError(
      f"group_size (rewards.shape[1]) must be >= 2: a group of one "
      f"completion has no relative signal; got shape {rewards.shape}."
    )
  if not jnp.issubdtype(rewards.dtype, jnp.floating):
    rewards = rewards.astype(jnp.float32)
  return rewards


def zero_signal_groups(rewards: jax.Array) -> jax.Array:
  """Which groups carry no learning signal (all valid rewards equal).

  Args:
    rewards: ``[num_prompts, group_size]`` outcome rewards; NaN = missing.

  Returns:
    bool ``[num_prompts]``: True where the group's valid rewards are all
    equal, or where it has fewer than two valid rewards, and no reward is
    ``+-inf`` (a group with an infinite reward is a bug, not a group without
    signal). Their advantages are exactly 0 under every estimator, so they
    contribute nothing to the policy gradient (DAPO's "dynamic sampling"
    filters them out).

  Examples:
    >>> import jax.numpy as jnp
    >>> from grpo_optax import rl
    >>> rl.zero_signal_groups(jnp.array([[1., 1.], [0., 1.], [0., jnp.nan]]))
    Array([ True, False,  True], dtype=bool)
  """
  rewards = _as_rewards(rewards)
  valid = ~jnp.isnan(rewards)
  high = jnp.max(jnp.where(valid, rewards, -jnp.inf), axis=-1)
  low = jnp.min(jnp.where(valid, rewards, jnp.inf), axis=-1)
  infinite = jnp.any(jnp.isinf(rewards), axis=-1)
  return ((jnp.sum(valid, axis=-1) < 2) | (high == low)) & ~infinite


def group_advantages(
  rewards: jax.Array, *, estimator: str = "group_std", eps: float = 1e-6
) -> jax.Array:
  r"""Advantages of ``G`` completions per prompt, relative to their group.

  With ``R`` the rewards of one group, ``n`` its valid (non-NaN) entries,
  :math:`\mu = \frac1n\sum_j R_j` and
  :math:`s^2 = \frac{1}{n-1}\sum_j (R_j-\mu)^2`:

  .. math::
    A_i = \begin{cases}
      (R_i-\mu)/(s+\epsilon) & \text{group\_std (GRPO)}\\
      (R_i-\mu)/(s_{batch}+\epsilon) & \text{batch\_std}\\
      R_i-\mu & \text{none (Dr. GRPO)}\\
      R_i - \frac{1}{n-1}\sum_{j\ne i} R_j & \text{rloo}
    \end{cases}

  Groups whose valid rewards are all equal (or that have fewer than two) get
  exactly 0; NaN rewards are excluded from the statistics and get 0. A group
  with a ``+-inf`` reward gets NaN everywhere (``"batch_std"``: so does
  every group with signal), so that the bad reward cannot pass unseen.

  Args:
    rewards: ``[num_prompts, group_size]`` outcome rewards (``group_size >=
      2``), one row per prompt. Integer rewards are cast to float32.
    estimator: one of ``"group_std"``, ``"batch_std"``, ``"none"``,
      ``"rloo"``.
    eps: added to the standard deviation, >= 0.

  Returns:
    Advantages with the shape of ``rewards`` (float). Flatten them with
    ``.reshape(-1)`` to match completions laid out prompt-major.

  Examples:
    >>> import jax.numpy as jnp
    >>> from grpo_optax import rl
    >>> r = jnp.array([[1., 0., 0., 1.], [1., 1., 1., 1.]])
    >>> rl.group_advantages(r, estimator="none")
    Array([[ 0.5, -0.5, -0.5,  0.5],
           [ 0. ,  0. ,  0. ,  0. ]], dtype=float32)
    >>> rl.group_advantages(r, estimator="rloo")[0]
    Array([ 0.6666667, -0.6666667, -0.6666667,  0.6666667], dtype=float32)

  References:
    Shao et al., `DeepSeekMath: Pushing the Limits of Mathematical Reasoning
    in Open Language Models <https://arxiv.org/abs/2402.03300>`_, 2024.
    Liu et al., `Understanding R1-Zero-Like Training: A Critical Perspective
    <https://arxiv.org/abs/2503.20783>`_, 2025 (Dr. GRPO).
    Ahmadian et al., `Back to Basics: Revisiting REINFORCE Style Optimization
    for Learning from Human Feedback in LLMs
    <https://arxiv.org/abs/2402.14740>`_, 2024 (RLOO).
  """
  _common.check_choice("estimator", estimator, ADVANTAGE_ESTIMATORS)
  _common.check_range("eps", eps, 0.0)
  rewards = _as_rewards(rewards)
  dtype = rewards.dtype
  valid = ~jnp.isnan(rewards)
  r0 = jnp.where(valid, rewards, 0)
  n = jnp.sum(valid, axis=-1, keepdims=True).astype(dtype)
  mean = jnp.sum(r0, axis=-1, keepdims=True) / jnp.maximum(n, 1)
  centered = jnp.where(valid, rewards - mean, 0)
  if estimator == "group_std":
    var = jnp.sum(centered**2, axis=-1, keepdims=True) / jnp.maximum(n - 1, 1)
    adv = centered / (jnp.sqrt(var) + jnp.asarray(eps, dtype))
  elif estimator == "batch_std":
    total = jnp.sum(n)
    batch_mean = jnp.sum(r0) / jnp.maximum(total, 1)
    batch_var = jnp.sum(jnp.where(valid, rewards - batch_mean, 0) ** 2) / (
      jnp.maximum(total - 1, 1)
    )
    adv = centered / (jnp.sqrt(batch_var) + jnp.asarray(eps, dtype))
  elif estimator == "rloo":
    adv = centered * (n / jnp.maximum(n - 1, 1))
  else:  # "none"
    adv = centered
  signal = ~zero_signal_groups(rewards)[:, None]
  adv = jnp.where(valid & signal, adv, 0)
  infinite = jnp.any(jnp.isinf(rewards), axis=-1, keepdims=True)
  return jnp.where(infinite, jnp.nan, adv).astype(dtype)
