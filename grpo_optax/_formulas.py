"""Per-element formulas of the GRPO mechanisms, written once.

The chain stages (:mod:`grpo_optax.clipping`, :mod:`~grpo_optax.importance`,
:mod:`~grpo_optax.sparsify`, :mod:`~grpo_optax.momentum`,
:mod:`~grpo_optax.variance`) and the one-pass preset (:mod:`grpo_optax.fused`)
both build their updates from these small pure functions, so each formula
lives in one place and the chain is the one-pass form's reference.

Every function is elementwise on arrays (scalars broadcast) and does no
reduction: reductions (norms, means, quantiles) are the callers' business,
because where they are computed decides how many passes over memory a step
makes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

Array = Any  # jax.Array or a scalar


def ema(old: Array, new: Array, decay: Array) -> Array:
  """Exponential moving average ``decay * old + (1 - decay) * new``."""
  return decay * old + (1 - decay) * new


def abs_sq(x: Array) -> Array:
  """``|x|^2``, real: ``x * x``, or ``re(x)^2 + im(x)^2`` for complex ``x``."""
  if jnp.iscomplexobj(x):
    return jnp.real(x) ** 2 + jnp.imag(x) ** 2
  return x * x


def clip_factor(norm: Array, max_norm: Array) -> Array:
  """``min(1, max_norm / norm)``: the global-norm clip as one multiplier."""
  return jnp.minimum(1.0, max_norm / norm)


def taylor_score(g: Array, p: Array, h: Array | None = None,
                 second: Array = 1.0) -> Array:
  """Taylor importance ``|g p| + second * h p^2 / 2`` (``h``: diagonal Hessian)."""
  s = jnp.abs(g * p)
  if h is not None:
    s = s + second * 0.5 * h * p * p
  return s


def importance_weight(s_hat: Array, inv_mean: Array, min_weight: Array,
                      max_weight: Array) -> Array:
  """``clip(s_hat * inv_mean, min_weight, max_weight)``.

  ``inv_mean`` is ``1 / (mean(s_hat) + 1e-12)`` over the leaf, computed once
  per leaf by the caller.
  """
  return jnp.clip(s_hat * inv_mean, min_weight, max_weight)


def inverse_mean(mean: Array) -> Array:
  """``1 / (mean + 1e-12)``, the normaliser of :func:`importance_weight`."""
  return 1.0 / (mean + 1e-12)


def keep_mask(a: Array, score: Array, threshold: Array) -> Array:
  """Entries whose score reaches the threshold; exact zeros are never kept."""
  return (score >= threshold) & (a != 0)


def split_by_mask(a: Array, keep: Array) -> tuple[Array, Array]:
  """``(a where kept else 0, a where not kept else 0)``: output and residual."""
  zero = jnp.zeros_like(a)
  return jnp.where(keep, a, zero), jnp.where(keep, zero, a)


def ema_threshold(tau: Array, mean_abs: Array, alpha: Array, count: Array,
                  every: Array) -> Array:
  """The EMA threshold after a step with count ``count`` (before the step).

  ``mean_abs`` at the first step; ``alpha * mean_abs + (1 - alpha) * tau``
  every ``every`` steps; unchanged otherwise.
  """
  refreshed = jnp.where(count == 0, mean_abs,
                        alpha * mean_abs + (1 - alpha) * tau)
  refresh = (count == 0) | (count % jnp.asarray(every, count.dtype) == 0)
  return jnp.where(refresh, refreshed, tau)


def nesterov_moment(mu: Array, g: Array, b1: Array, bc1: Array,
                    bc1_next: Array) -> Array:
  """NAdam's look-ahead ``b1 mu / bc1_next + (1 - b1) g / bc1``.

  ``bc1 = 1 - b1^(t+1)``, ``bc1_next = 1 - b1^(t+2)`` (``t`` = count before
  the step), as ``optax.scale_by_adam(nesterov=True)``.
  """
  return b1 * (mu / bc1_next) + (1 - b1) * (g / bc1)


def adam_rms_mix(mu_hat: Array, nu_hat: Array, nu_rms: Array, g: Array,
                 eps: Array, eps_root: Array, adam_weight: Array) -> Array:
  """``w * mu_hat / (sqrt(nu_hat + eps_root) + eps) + (1 - w) * g / (sqrt(nu_rms) + eps)``."""
  adam = mu_hat / (jnp.sqrt(nu_hat + eps_root) + eps)
  rms = g / (jnp.sqrt(nu_rms) + eps)
  return adam_weight * adam + (1 - adam_weight) * rms


def moment_variance(mu_hat: Array, nu_hat: Array) -> Array:
  """``max(nu_hat - mu_hat^2, 0)``: the gradient variance from two moments."""
  return jnp.maximum(nu_hat - mu_hat * mu_hat, 0.0)


def variance_scale(variance: Array, coef: Array) -> Array:
  """The variance-based rate ``1 / (1 + coef * variance)``."""
  return 1.0 / (1.0 + coef * variance)


def bias_correction(decay: Array, count: jax.Array) -> jax.Array:
  """``1 - decay ** count`` in float32 (``count`` already incremented)."""
  return 1 - jnp.asarray(decay, jnp.float32) ** count.astype(jnp.float32)
