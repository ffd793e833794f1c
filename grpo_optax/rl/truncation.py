r"""Truncated sampling distributions (top-k, top-p, min-p) for sampler and loss.

A sampler that draws from a truncated distribution must record the
log-probabilities of *that* distribution, and the loss must score the same
tokens with the same truncation; otherwise the importance ratio is not 1
on-policy and every token is silently reweighted (the trainer/sampler
mismatch of TRL issues #4159 and #6789). :func:`truncated_logits` is the one
place the truncation is defined; :func:`grpo_optax.rl.sample` draws from it
and :func:`grpo_optax.rl.token_log_probs` scores with it, given the same
:class:`Truncation`.

With :math:`z` the logits divided by the temperature and :math:`p =
\mathrm{softmax}(z)`, the filters are applied in this order, each to the
distribution the previous one left:

* top-k: keep the tokens whose :math:`z_v` is at least the ``k``-th largest
  value (ties at the boundary are all kept);
* top-p (nucleus): sort by probability; keep the smallest prefix whose mass
  reaches ``p`` (the most likely token is always kept), and every token tied
  with the last kept one;
* min-p: keep :math:`p_v \ge p_{min} \max_u p_u`.

Dropped tokens get the logit :math:`-\infty`; the kept ones are renormalised
by the ``log_softmax`` of the caller. Every rule is a threshold on
:math:`z`, so the kept set is a function of the logits alone and the same
logits always give the same set.

References:
  Fan et al., `Hierarchical Neural Story Generation
  <https://arxiv.org/abs/1805.04833>`_, 2018 (top-k).
  Holtzman et al., `The Curious Case of Neural Text Degeneration
  <https://arxiv.org/abs/1904.09751>`_, 2020 (top-p).
  Nguyen et al., `Turning Up the Heat: Min-p Sampling for Creative and
  Coherent LLM Outputs <https://arxiv.org/abs/2407.01082>`_, 2024 (min-p).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

__all__ = (
  "Truncation",
  "truncated_logits",
)


@dataclasses.dataclass(frozen=True)
class Truncation:
  """Static truncation settings shared by the sampler and the loss.

  Attributes:
    top_k: None, or keep the ``k >= 1`` most likely tokens.
    top_p: None, or the nucleus mass in (0, 1].
    min_p: None, or keep tokens with probability >= ``min_p`` times the
      largest, in [0, 1].
  """

  top_k: int | None = None
  top_p: float | None = None
  min_p: float | None = None

  def __post_init__(self):
    if self.top_k is not None and (
      isinstance(self.top_k, bool)
      or not isinstance(self.top_k, int)
      or self.top_k < 1
    ):
      raise ValueError(
        f"Truncation.top_k must be None or an int >= 1; got {self.top_k!r}"
      )
    for name, low_open in (("top_p", True), ("min_p", False)):
      value = getattr(self, name)
      if value is None:
        continue
      if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
          f"Truncation.{name} must be None or a Python number; "
          f"got {type(value).__name__}"
        )
      ok = (value > 0 if low_open else value >= 0) and value <= 1
      if not ok or math.isnan(value):
        bound = "(0, 1]" if low_open else "[0, 1]"
        raise ValueError(
          f"Truncation.{name} must be None or in {bound}; got {value!r}"
        )

  @property
  def active(self) -> bool:
    """Whether any filter is set."""
    return (
      self.top_k is not None or self.top_p is not None or self.min_p is not None
    )


def as_truncation(truncation: Truncation | None) -> Truncation:
  if truncation is None:
    return Truncation()
  if not isinstance(truncation, Truncation):
    raise TypeError(
      f"truncation must be a grpo_optax.rl.Truncation or None; "
      f"got {type(truncation).__name__}"
    )
  return truncation


def _top_k(z: jax.Array, k: int) -> jax.Array:
  if k >= z.shape[-1]:
    return z
  kth = jax.lax.top_k(z, k)[0][..., -1:]
  return jnp.where(z >= kth, z, -jnp.inf)


def _top_p(z: jax.Array, p: float) -> jax.Array:
  sorted_z = jnp.flip(jnp.sort(z, axis=-1), axis=-1)
  probs = jax.nn.softmax(sorted_z, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  kept = mass_before < p  # the first entry: 0 < p, always kept
  threshold = jnp.min(
    jnp.where(kept, sorted_z, jnp.inf), axis=-1, keepdims=True
  )
  return jnp.where(z >= threshold, z, -jnp.inf)


def _min_p(z: jax.Array, min_p: float) -> jax.Array:
  if min_p == 0:
    return z
  # p_v >= min_p * p_max  <=>  z_v >= z_max + log(min_p).
  threshold = jnp.max(z, axis=-1, keepdims=True) + math.log(min_p)
  return jnp.where(z >= threshold, z, -jnp.inf)


def truncated_logits(
  scaled_logits: jax.Array, truncation: Truncation | None
) -> jax.Array:
  """Sets the logits of the tokens the truncation drops to ``-inf``.

  Args:
    scaled_logits: ``[..., V]`` logits already divided by the temperature.
    truncation: a :class:`Truncation` (or None: nothing is dropped).

  Returns:
    The logits with dropped entries replaced by ``-inf``; at least one entry
    of every row (the largest) is kept. ``log_softmax`` of the result is the
    renormalised truncated distribution.

  Examples:
    >>> import jax.numpy as jnp
    >>> from grpo_optax import rl
    >>> z = jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05]))
    >>> jnp.isfinite(rl.truncated_logits(z, rl.Truncation(top_p=0.8)))
    Array([ True,  True, False, False], dtype=bool)
  """
  truncation = as_truncation(truncation)
  z = scaled_logits
  if truncation.top_k is not None:
    z = _top_k(z, truncation.top_k)
  if truncation.top_p is not None and truncation.top_p < 1:
    z = _top_p(z, truncation.top_p)
  if truncation.min_p is not None:
    z = _min_p(z, truncation.min_p)
  return z
