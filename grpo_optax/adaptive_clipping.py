"""ZClip: adaptive clipping of gradient-norm spikes by their z-score.

A fixed clipping bound is either too tight early in training or too loose
late. ZClip keeps exponential moving averages of the global gradient norm's
mean and variance and clips only the norms that stand out from them: when the
norm's z-score ``(n - mean) / std`` exceeds a threshold, the gradient is
scaled down to the norm ``mean + threshold * std``. The averages are
updated with the clipped norm, so a spike does not raise the bound it was
clipped to.

This module is the mechanism's room: :class:`ZClipConfig` (its knobs,
validated), :class:`ZClipState`, and the optax factory :func:`zclip`.
``grpo(zclip=2.5)`` puts it first in the preset (``docs/design.md``).
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
from grpo_optax import clipping

__all__ = (
  "ZClipConfig",
  "ZClipState",
  "zclip",
)


class ZClipState(NamedTuple):
  """State of :func:`zclip`."""

  count: jax.Array  # shape=(), dtype=int32: steps seen
  mean: jax.Array  # shape=(), float32: mean of the (clipped) norms
  var: jax.Array  # shape=(), float32: their variance
  clipped: jax.Array  # shape=(), dtype=int32: steps whose norm was clipped

  #: ``grpo_optax.metrics`` reports this state as ``zclip/...``.
  metrics_prefix = "zclip"

  def metrics(self) -> dict[str, jax.Array]:
    """``rate`` (the fraction of steps clipped), ``norm_mean``, ``norm_std``."""
    return {
      "rate": self.clipped.astype(jnp.float32)
      / jnp.maximum(self.count.astype(jnp.float32), 1.0),
      "norm_mean": self.mean,
      "norm_std": jnp.sqrt(self.var),
    }


def statistics(
  state: ZClipState, norm: jax.Array, cfg: ZClipConfig
) -> tuple[jax.Array, ZClipState]:
  """``(clipped norm, new state)`` after a step whose norm is ``norm``.

  During the first ``warmup_steps`` steps the norm passes and the statistics
  are its running mean and (population) variance; afterwards the clipped
  norm ``min(n, mean + z std)`` (when the z-score exceeds ``z``) and the
  EMAs ``mean <- a mean + (1 - a) n_c``, ``var <- a var + (1 - a) (n_c -
  mean)^2`` with ``a = alpha``.
  """
  t = state.count
  tf = t.astype(jnp.float32)
  warm = t < jnp.asarray(cfg.warmup_steps, t.dtype)
  std = jnp.sqrt(state.var)
  bound = state.mean + cfg.z_threshold * std
  spike = jnp.logical_and(
    jnp.logical_not(warm), (norm - state.mean) > cfg.z_threshold * std
  )
  clipped_norm = jnp.where(spike, bound, norm)
  # Running mean and variance over the warm-up (Welford's update) ...
  delta = norm - state.mean
  w_mean = state.mean + delta / (tf + 1.0)
  w_var = (state.var * tf + delta * (norm - w_mean)) / (tf + 1.0)
  # ... then the EMAs of the clipped norm.
  a = cfg.alpha
  e_mean = a * state.mean + (1 - a) * clipped_norm
  e_var = a * state.var + (1 - a) * jnp.square(clipped_norm - e_mean)
  return clipped_norm, ZClipState(
    count=_common.safe_increment(t),
    mean=jnp.where(warm, w_mean, e_mean).astype(jnp.float32),
    var=jnp.where(warm, w_var, e_var).astype(jnp.float32),
    clipped=jnp.where(
      spike, _common.safe_increment(state.clipped), state.clipped
    ),
  )


@dataclasses.dataclass(frozen=True)
class ZClipConfig(_mechanism.Config):
  """The knobs of :func:`zclip`, validated (see its arguments).

  Attributes:
    z_threshold: the z-score above which a norm is clipped, > 0.
    alpha: EMA weight of the past statistics, in [0, 1).
    warmup_steps: steps whose norms only build the statistics, int >= 1.
  """

  z_threshold: Any = 2.5
  alpha: Any = 0.97
  warmup_steps: Any = 25

  def __post_init__(self):
    _common.check_range(
      "z_threshold", self.z_threshold, 0.0, low_inclusive=False
    )
    _common.check_range("alpha", self.alpha, 0.0, 1.0, high_inclusive=False)
    _common.check_int("warmup_steps", self.warmup_steps, 1)
    self._set(
      z_threshold=_common.f32(self.z_threshold), alpha=_common.f32(self.alpha)
    )

  def init(self, params) -> ZClipState:
    del params
    zero = jnp.zeros([], jnp.float32)
    return ZClipState(
      count=jnp.zeros([], jnp.int32),
      mean=zero,
      var=zero,
      clipped=jnp.zeros([], jnp.int32),
    )

  def update(self, updates, state, params=None, **extra_args):
    del params, extra_args
    leaves, treedef = jax.tree.flatten(updates)
    norm = clipping.norm_with_l2(leaves, None, None)
    clipped_norm, new_state = statistics(state, norm, self)
    # One multiply per leaf; a zero norm passes as is.
    scale = jnp.where(norm > 0, clipped_norm / jnp.where(norm > 0, norm, 1), 1)
    outs = [(g * scale.astype(g.dtype)).astype(g.dtype) for g in leaves]
    return treedef.unflatten(outs), new_state


def zclip(
  z_threshold: float = 2.5,
  alpha: float = 0.97,
  warmup_steps: int = 25,
) -> optax.GradientTransformationExtraArgs:
  r"""Clips gradient-norm spikes by their z-score (ZClip).

  With ``n`` the global norm of the incoming updates, ``t`` the step count
  before the step and ``W = warmup_steps``: for ``t < W`` the updates pass
  and ``mean``, ``var`` are the running mean and variance of the norms seen;
  afterwards

  .. math::
    z = \frac{n - \mu}{\sigma},\qquad
    n_c = \begin{cases}\mu + z_{thr}\,\sigma & z > z_{thr}\\ n & \text{else}
    \end{cases},\qquad \text{out} = g\,\frac{n_c}{n}

    \mu \leftarrow \alpha\mu + (1-\alpha) n_c,\qquad
    \sigma^2 \leftarrow \alpha\sigma^2 + (1-\alpha)(n_c - \mu)^2

  (``mu`` on the right of the second line is the new mean). The state
  counts clipped steps (``grpo_optax.metrics``: ``zclip/rate``).

  Args:
    z_threshold: ``z_thr``, > 0 (the paper's default 2.5).
    alpha: ``alpha``, in [0, 1) (the paper's 0.97).
    warmup_steps: ``W``, int >= 1 (the paper's 25).

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Examples:
    >>> import jax.numpy as jnp, grpo_optax
    >>> tx = grpo_optax.zclip(z_threshold=2.0, warmup_steps=3)
    >>> state = tx.init({"w": jnp.zeros(2)})
    >>> for g in (1.0, 1.2, 0.8, 1.1, 50.0):
    ...   out, state = tx.update({"w": jnp.array([g, 0.0])}, state)
    >>> round(float(out["w"][0]), 3), int(state.clipped)
    (1.326, 1)

  References:
    Kumar et al., `ZClip: Adaptive Spike Mitigation for LLM Pre-Training
    <https://arxiv.org/abs/2504.02507>`_, 2025.
  """
  return ZClipConfig(z_threshold, alpha, warmup_steps).transform()
