r"""Batch-split invariance and dynamic sampling, with static shapes.

**The normaliser.** Every aggregation of :func:`~grpo_optax.rl.aggregate`
divides a sum over the batch by a count: the number of sequences :math:`S`
or of tokens :math:`N`. A loss computed on part of a batch (a microbatch of
gradient accumulation, or a device's shard in a data-parallel step) with its
*own* counts is not a part of the batch's loss, and the sum (or mean) of the
parts has another gradient than the whole. :class:`LossNormalizer` makes the
counts explicit: compute it once for the whole batch (:func:`loss_normalizer`
of the whole mask, or of the local mask with ``axis_name`` inside
``shard_map``/``pmap``, which sums the counts over devices), pass it to
:func:`~grpo_optax.rl.policy_loss` for every part, and *sum* the parts' losses
and gradients. Then loss and gradients equal the whole batch's, up to float
rounding of the sums, for every aggregation and preset: the per-sequence
terms (token means, GSPO's sequence ratio) only ever involve one row.

**Dynamic sampling** (DAPO). A group whose rewards are all equal has
advantage 0 on every completion: it adds nothing to the policy gradient but
still counts in the denominators (and in a KL term). DAPO samples more
prompts and keeps only groups with signal. Inside ``jit`` shapes are static,
so two forms are offered:

* :func:`drop_zero_signal`: clear the mask of the zero-signal groups' rows;
  the loss, its KL term and the :func:`loss_normalizer` counts then ignore
  them, as if the batch were only the groups with signal.
* :func:`select_groups`: from an over-sampled pool of groups keep a fixed
  number, groups with signal first (in pool order), and report which of the
  kept ones have signal (to be dropped with :func:`drop_zero_signal` when
  the pool had too few).

References:
  Yu et al., `DAPO: An Open-Source LLM Reinforcement Learning System at
  Scale <https://arxiv.org/abs/2503.14476>`_, 2025 (dynamic sampling,
  token-level normalisation).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from grpo_optax.rl.advantages import zero_signal_groups

__all__ = (
  "LossNormalizer",
  "drop_zero_signal",
  "group_rows",
  "loss_normalizer",
  "select_groups",
)


class LossNormalizer(NamedTuple):
  """The denominators of :func:`~grpo_optax.rl.aggregate`, for a whole batch.

  ``num_sequences`` is :math:`S` (rows with at least one valid token) and
  ``num_tokens`` :math:`N` (valid tokens).
  """

  num_sequences: jax.Array  # shape=(), float32
  num_tokens: jax.Array  # shape=(), float32


def loss_normalizer(
  mask: jax.Array, *, axis_name: str | tuple[str, ...] | None = None
) -> LossNormalizer:
  r"""Counts of sequences and tokens of the whole batch.

  .. math:: S = \sum_i [\textstyle\sum_t m_{it} > 0], \qquad
            N = \sum_{i,t} m_{it}

  Args:
    mask: ``[B, T]`` booleans (True = a valid completion token) of the whole
      batch, or of this device's shard when ``axis_name`` is given.
    axis_name: None, or the mapped axis (or axes) of ``shard_map``/``pmap``
      over which the batch is split: the counts are summed over it
      (``lax.psum``), so every device gets the global counts.

  Returns:
    A :class:`LossNormalizer` of float32 scalars.

  Examples:
    >>> import jax.numpy as jnp
    >>> from grpo_optax import rl
    >>> rl.loss_normalizer(jnp.array([[1, 1, 0], [0, 0, 0]], bool))
    LossNormalizer(num_sequences=Array(1., dtype=float32), num_tokens=Array(2., dtype=float32))
  """
  mask = jnp.asarray(mask)
  if mask.ndim != 2:
    raise ValueError(f"mask must have shape [B, T]; got {mask.shape}")
  mask = mask.astype(bool)
  num_sequences = jnp.sum(jnp.any(mask, axis=-1)).astype(jnp.float32)
  num_tokens = jnp.sum(mask).astype(jnp.float32)
  if axis_name is not None:
    num_sequences, num_tokens = jax.lax.psum(
      (num_sequences, num_tokens), axis_name
    )
  return LossNormalizer(num_sequences, num_tokens)


def _group_size(rewards: jax.Array, mask: jax.Array) -> int:
  if rewards.ndim != 2:
    raise ValueError(
      f"rewards must have shape [num_prompts, group_size]; got {rewards.shape}"
    )
  if mask.ndim != 2 or mask.shape[0] != rewards.size:
    raise ValueError(
      f"mask must have shape [num_prompts * group_size, T] = "
      f"[{rewards.size}, T]; got {mask.shape}"
    )
  return rewards.shape[1]


def drop_zero_signal(mask: jax.Array, rewards: jax.Array) -> jax.Array:
  """Clears the mask of every completion of a zero-signal group.

  Args:
    mask: ``[B, T]`` completion mask, prompt-major (``B = num_prompts * G``).
    rewards: ``[num_prompts, G]`` the rewards the advantages are computed
      from (NaN = missing; see :func:`~grpo_optax.rl.zero_signal_groups`).

  Returns:
    bool ``[B, T]``: ``mask`` with the rows of groups whose valid rewards are
    all equal set to False. Shapes do not change; pass the result to
    :func:`loss_normalizer` and :func:`~grpo_optax.rl.policy_loss`.

  Examples:
    >>> import jax.numpy as jnp
    >>> from grpo_optax import rl
    >>> m = jnp.ones((4, 2), bool)
    >>> rl.drop_zero_signal(m, jnp.array([[1., 1.], [0., 1.]]))[:, 0]
    Array([False, False,  True,  True], dtype=bool)
  """
  mask = jnp.asarray(mask).astype(bool)
  rewards = jnp.asarray(rewards)
  group_size = _group_size(rewards, mask)
  keep = jnp.repeat(~zero_signal_groups(rewards), group_size)
  return mask & keep[:, None]


def select_groups(
  rewards: jax.Array, num_groups: int
) -> tuple[jax.Array, jax.Array]:
  """Picks ``num_groups`` groups of an over-sampled pool, signal first.

  Args:
    rewards: ``[pool_size, G]`` rewards of the pool's groups.
    num_groups: how many to keep, ``1 <= num_groups <= pool_size`` (static).

  Returns:
    ``(indices, has_signal)``: int32 ``[num_groups]`` indices into the pool
    (the groups with signal in pool order, then zero-signal ones to fill)
    and bool ``[num_groups]``, False for a kept group without signal. Gather
    the completions of group ``indices[j]`` (rows ``indices[j] * G + g``)
    and drop the groups without signal with :func:`drop_zero_signal`.

  Examples:
    >>> import jax.numpy as jnp
    >>> from grpo_optax import rl
    >>> pool = jnp.array([[1., 1.], [0., 1.], [0., 0.], [1., 0.]])
    >>> rl.select_groups(pool, 2)
    (Array([1, 3], dtype=int32), Array([ True,  True], dtype=bool))
  """
  rewards = jnp.asarray(rewards)
  if rewards.ndim != 2:
    raise ValueError(
      f"rewards must have shape [pool_size, group_size]; got {rewards.shape}"
    )
  pool = rewards.shape[0]
  if (
    isinstance(num_groups, bool)
    or not isinstance(num_groups, int)
    or not 1 <= num_groups <= pool
  ):
    raise ValueError(
      f"num_groups must be an int in [1, pool_size = {pool}]; "
      f"got {num_groups!r}"
    )
  signal = ~zero_signal_groups(rewards)
  order = jnp.argsort(~signal, stable=True)[:num_groups].astype(jnp.int32)
  return order, signal[order]


def group_rows(indices: jax.Array, group_size: int) -> jax.Array:
  """Row indices ``[num_groups * G]`` of the completions of the groups
  ``indices`` in a prompt-major batch (for ``x[group_rows(idx, G)]``).
  """
  indices = jnp.asarray(indices)
  return (
    indices[:, None] * group_size + jnp.arange(group_size, dtype=indices.dtype)
  ).reshape(-1)
