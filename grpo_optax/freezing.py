"""Dynamic parameter freezing (seed mechanism 9, the transform half).

Article 004 §3.2 sets ``layer.trainable = False`` for layers whose importance
score falls below a threshold. As a gradient transformation this zeroes the
updates of unimportant leaves for good; :func:`frozen_mask` exposes the
decision so that a training step can also stop computing those gradients
(:func:`grpo_optax.training.frozen_train_step`), which is where compute is saved.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from grpo_optax import _common
from grpo_optax import _mechanism

__all__ = (
  "FreezeBelowConfig",
  "FreezeBelowState",
  "freeze_below",
)


class FreezeBelowState(NamedTuple):
  """State of :func:`freeze_below`.

  ``importance`` and ``frozen`` hold one scalar per parameter leaf, as
  ``(num_leaves,)`` vectors in the params' leaf order (not trees shaped like
  the params, so that sharding recipes such as ``optax.tree.map_params``
  replicate them).
  """

  count: jax.Array  # shape=(), dtype=int32
  importance: jax.Array  # shape=(num_leaves,), float32: EMA of mean |g p|
  frozen: jax.Array  # shape=(num_leaves,), bool

  def metrics(self) -> dict[str, jax.Array]:
    n = self.frozen.shape[0]
    k = jnp.sum(self.frozen, dtype=jnp.int32)
    return {
      "frozen_leaves": k,
      "frozen_fraction": k.astype(jnp.float32) / max(n, 1),
      "importance": self.importance.astype(jnp.float32),
    }


@dataclasses.dataclass(frozen=True)
class FreezeBelowConfig(_mechanism.Config):
  """The knobs of :func:`freeze_below`, validated (see its arguments).

  Attributes:
    threshold: freeze a leaf whose normalised importance falls below it,
      >= 0.
    decay: EMA decay of the importance, in [0, 1).
    warmup_steps: steps before any leaf may freeze, int >= 0.
  """

  threshold: Any = 0.3
  decay: Any = 0.9
  warmup_steps: Any = 100

  def __post_init__(self):
    _common.check_range("threshold", self.threshold, 0.0)
    _common.check_range("decay", self.decay, 0.0, 1.0, high_inclusive=False)
    _common.check_int("warmup_steps", self.warmup_steps, 0)
    self._set(
      threshold=_common.f32(self.threshold), decay=_common.f32(self.decay)
    )

  def init(self, params) -> FreezeBelowState:
    return FreezeBelowState(
      count=jnp.zeros([], jnp.int32),
      importance=_common.leaf_scalars(params),
      frozen=_common.leaf_scalars(params, False, bool),
    )

  def update(self, updates, state, params=None, **extra_args):
    del extra_args
    _common.require_params(
      params, "freeze_below", "(importance is mean |g * p| per leaf)"
    )
    _common.check_same_structure("params", params, updates, "freeze_below")
    t = state.count
    leaves, treedef = jax.tree.flatten(updates)
    p_leaves = treedef.flatten_up_to(params)
    if state.importance.shape[0] != len(leaves):
      raise ValueError(
        f"freeze_below: the state was built for {state.importance.shape[0]} "
        f"leaves but the updates have {len(leaves)}"
      )
    decay = self.decay
    bc = _common.bias_correction(decay, _common.safe_increment(t))
    # mean |g p| on a fixed grid sample of each leaf (local to each shard),
    # then one vector operation over the leaves.
    score = _common.stack(
      [
        _common.mean32(
          jnp.abs(
            _common.strided_sample(g).astype(jnp.float32)
            * _common.strided_sample(p).astype(jnp.float32)
          )
        )
        for g, p in zip(leaves, p_leaves)
      ]
    )
    imp = decay * state.importance + (1 - decay) * score
    # Mean over the leaves that are still trainable: a frozen leaf's gradient
    # may no longer be computed (frozen_train_step), so it must not drag it.
    active = jnp.logical_not(state.frozen).astype(jnp.float32)
    mean_imp = jnp.sum(imp / bc * active) / jnp.maximum(jnp.sum(active), 1.0)
    may_freeze = t >= jnp.asarray(self.warmup_steps, t.dtype)
    frozen = state.frozen | (
      may_freeze & ((imp / bc) / (mean_imp + 1e-30) < self.threshold)
    )
    flags = _common.unstack(frozen)
    outs = [jnp.where(f, jnp.zeros_like(g), g) for g, f in zip(leaves, flags)]
    return treedef.unflatten(outs), FreezeBelowState(
      count=_common.safe_increment(t), importance=imp, frozen=frozen
    )


def freeze_below(
  threshold: float = 0.3,
  decay: float = 0.9,
  warmup_steps: int = 100,
) -> optax.GradientTransformationExtraArgs:
  r"""Freezes leaves whose normalised importance stays below a threshold.

  Per leaf ``l`` with ``t`` the count before the step:

  .. math::
    I_l \leftarrow d I_l + (1-d)\operatorname{mean}|g_l \odot p_l|, \qquad
    \tilde I_l = \frac{I_l}{\operatorname{mean}_{l' \text{ not frozen}} I_{l'} + 10^{-30}}

  Once ``t >= warmup_steps``, a leaf with :math:`\tilde I_l <` ``threshold``
  becomes frozen, and a frozen leaf stays frozen: its updates are exactly 0
  from then on, whatever its gradient does. Put this transform last in a chain
  (after momentum), otherwise later stateful transforms can still move a
  frozen leaf.

  Args:
    threshold: freezing threshold on the normalised importance, >= 0
      (article: start at 0.3, raise towards 0.5).
    decay: EMA decay ``d`` in [0, 1).
    warmup_steps: steps before any leaf may freeze, int >= 0.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; its update needs ``params``.

  Examples:
    >>> import jax.numpy as jnp, grpo_optax
    >>> tx = grpo_optax.freeze_below(threshold=0.3, warmup_steps=0)
    >>> params = {"big": jnp.ones(3), "tiny": jnp.full(3, 1e-3)}
    >>> g = {"big": jnp.ones(3), "tiny": jnp.ones(3)}
    >>> out, state = tx.update(g, tx.init(params), params)
    >>> grpo_optax.frozen_mask(state, params)
    {'big': Array(False, dtype=bool), 'tiny': Array(True, dtype=bool)}

  References:
    Brock et al., `FreezeOut: Accelerate Training by Progressively Freezing
    Layers <https://arxiv.org/abs/1706.04983>`_, 2017.
    Liu et al., `AutoFreeze: Automatically Freezing Model Blocks to Accelerate
    Fine-tuning <https://arxiv.org/abs/2102.01386>`_, 2021.
  """
  return FreezeBelowConfig(threshold, decay, warmup_steps).transform()
