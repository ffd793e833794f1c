r"""Token log-probabilities, masks, KL estimators and the clipped policy loss.

Shapes: ``B`` completions (prompt-major: the ``G`` completions of a prompt are
consecutive rows), ``T`` completion positions (padded), ``V`` vocabulary.
Every per-token quantity is ``[B, T]`` and goes with a boolean ``mask[B, T]``
(True = a real completion token); masked positions may hold anything (padding
garbage, NaN) and never reach the loss, its gradient or the metrics.

The policy loss per token, with :math:`r = \exp(\ell - \ell_{old})`,

.. math::
  L_t = -\min\big(r A,\ \mathrm{clip}(r, 1-\epsilon_{low}, 1+\epsilon_{high})
        A\big) \;[\text{capped at } -cA \text{ if } A<0 \text{ (dual clip)}]
        \;+\; \beta\, \mathrm{KL}_t,

is aggregated to a scalar by :func:`aggregate`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from grpo_optax import _common
from grpo_optax.rl.config import AGGREGATIONS
from grpo_optax.rl.config import KL_ESTIMATORS
from grpo_optax.rl.config import Config
from grpo_optax.rl.truncation import Truncation
from grpo_optax.rl.truncation import truncated_logits

__all__ = (
  "aggregate",
  "completion_mask",
  "kl_penalty",
  "policy_loss",
  "token_entropy",
  "token_log_probs",
)


def _float32(x: jax.Array) -> jax.Array:
  """Promotes low-precision floats to float32 (keeps float64)."""
  x = jnp.asarray(x)
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def scaled_logits(logits: jax.Array, temperature) -> jax.Array:
  _common.check_range("temperature", temperature, 0.0, low_inclusive=False)
  logits = _float32(logits)
  if logits.ndim < 1:
    raise ValueError(
      f"logits must have a vocabulary axis; got shape {logits.shape}"
    )
  return logits / jnp.asarray(temperature, logits.dtype)


def token_log_probs(
  logits: jax.Array,
  tokens: jax.Array,
  temperature: float = 1.0,
  *,
  truncation: Truncation | None = None,
) -> jax.Array:
  r"""Log-probabilities of ``tokens`` under ``softmax(logits / temperature)``.

  .. math::
    \ell_t = z_{t, y_t}/\tau - \log\sum_{v \in K_t} \exp(z_{t,v}/\tau)

  computed in (at least) float32, with :math:`K_t` the tokens kept by
  ``truncation`` (:func:`truncated_logits`; all of them by default) and
  :math:`-\infty` for a token outside :math:`K_t`. The sampler records
  exactly this value for the same settings, so the on-policy importance
  ratio is 1. Score with the sampler's ``truncation``: scored without it,
  the ratio to a truncated sampler's records is :math:`p/p_{trunc} < 1` on
  every token.

  Args:
    logits: ``[..., V]`` scores (any float dtype).
    tokens: ``[...]`` integer ids in ``[0, V)``.
    temperature: the sampling temperature, > 0.
    truncation: the sampler's :class:`Truncation` (top-k, top-p, min-p), or
      None.

  Returns:
    ``[...]`` float32 (float64 for float64 logits) log-probabilities.

  Examples:
    >>> import jax.numpy as jnp
    >>> from grpo_optax import rl
    >>> logits = jnp.log(jnp.array([[0.25, 0.75]]))
    >>> jnp.exp(rl.token_log_probs(logits, jnp.array([1])))
    Array([0.75], dtype=float32)
  """
  scaled = truncated_logits(scaled_logits(logits, temperature), truncation)
  tokens = jnp.asarray(tokens)
  if tokens.shape != scaled.shape[:-1]:
    raise ValueError(
      f"tokens must have shape logits.shape[:-1] = "
      f"{scaled.shape[:-1]}; got {tokens.shape}"
    )
  if not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise TypeError(f"tokens must be integers; got {tokens.dtype}")
  picked = jnp.take_along_axis(scaled, tokens[..., None], axis=-1)[..., 0]
  return picked - jax.nn.logsumexp(scaled, axis=-1)


def token_entropy(
  logits: jax.Array,
  temperature: float = 1.0,
  *,
  truncation: Truncation | None = None,
) -> jax.Array:
  r"""Entropy of ``softmax(logits / temperature)`` at each position (nats).

  .. math:: H_t = -\sum_{v \in K_t} p_{t,v} \log p_{t,v}

  Args:
    logits: ``[..., V]`` scores.
    temperature: the sampling temperature, > 0.
    truncation: entropy of the truncated, renormalised distribution
      (:func:`truncated_logits`; dropped tokens contribute 0), or None.

  Returns:
    ``[...]`` entropies, float32 or wider.

  Examples:
    >>> import jax.numpy as jnp
    >>> from grpo_optax import rl
    >>> rl.token_entropy(jnp.zeros((1, 4)))  # uniform over 4: log 4
    Array([1.3862944], dtype=float32)
  """
  log_p = jax.nn.log_softmax(
    truncated_logits(scaled_logits(logits, temperature), truncation), axis=-1
  )
  kept = jnp.isfinite(log_p)
  log_p = jnp.where(kept, log_p, 0)  # 0 * -inf would be NaN
  return -jnp.sum(jnp.where(kept, jnp.exp(log_p) * log_p, 0), axis=-1)


def completion_mask(
  completions: jax.Array, eos_id: int | Sequence[int] | jax.Array
) -> jax.Array:
  """True up to and including the first end-of-sequence token of each row.

  Args:
    completions: ``[B, T]`` integer tokens of the completions (no prompt).
    eos_id: an id, or a sequence of ids, that ends a completion.

  Returns:
    bool ``[B, T]``: position ``t`` is kept iff no EOS occurs before ``t``
    (the EOS itself is kept, so its probability is trained too). A row
    without EOS (truncated) is kept whole.

  Examples:
    >>> import jax.numpy as jnp
    >>> from grpo_optax import rl
    >>> rl.completion_mask(jnp.array([[5, 2, 7, 2], [5, 6, 7, 8]]), eos_id=2)
    Array([[ True,  True, False, False],
           [ True,  True,  True,  True]], dtype=bool)
  """
  completions = jnp.asarray(completions)
  if completions.ndim != 2:
    raise ValueError(
      f"completions must have shape [B, T]; got {completions.shape}"
    )
  ids = jnp.asarray(eos_id).reshape(-1)
  if ids.size == 0:
    raise ValueError("eos_id must name at least one token id.")
  is_eos = jnp.any(completions[..., None] == ids, axis=-1)
  eos_before = jnp.cumsum(is_eos, axis=-1) - is_eos
  return eos_before == 0


def kl_penalty(
  log_probs: jax.Array, ref_log_probs: jax.Array, estimator: str = "k3"
) -> jax.Array:
  r"""Per-token estimate of :math:`\mathrm{KL}(\pi_\theta \| \pi_{ref})`.

  With :math:`\delta = \ell_{ref} - \ell` at tokens sampled from
  :math:`\pi_\theta`:

  =========  ===============================  ================================
  estimator  value                            expectation / gradient
  =========  ===============================  ================================
  ``k1``     :math:`-\delta`                  unbiased for KL; its gradient
                                              has expectation 0
  ``k2``     :math:`\delta^2/2`               biased; its gradient is exactly
                                              :math:`\nabla\mathrm{KL}(\pi\|
                                              \pi_{ref})`
  ``k3``     :math:`e^{\delta} - \delta - 1`  unbiased for KL, >= 0, low
                                              variance; its gradient is
                                              :math:`\nabla\mathrm{KL}(
                                              \pi_{ref}\|\pi)`, the
                                              *forward* KL's
  =========  ===============================  ================================

  "Gradient" means the expectation over samples of the gradient of the
  estimate, the samples themselves not differentiated (as in a loss). k3 is
  the estimator of DeepSeekMath's GRPO loss: note that it pulls towards the
  reference with the gradient of the forward KL, not the reverse KL it
  estimates.

  Args:
    log_probs: ``[...]`` log-probabilities under the current policy.
    ref_log_probs: the same tokens under the reference policy.
    estimator: ``"k1"``, ``"k2"`` or ``"k3"``.

  Returns:
    The per-token estimates, shaped like ``log_probs``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from grpo_optax import rl
    >>> rl.kl_penalty(jnp.log(jnp.array([0.5])), jnp.log(jnp.array([0.25])))
    Array([0.19314718], dtype=float32)

  References:
    Schulman, `Approximating KL Divergence
    <http://joschu.net/blog/kl-approx.html>`_, 2020.
  """
  _common.check_choice("estimator", estimator, KL_ESTIMATORS)
  log_probs, ref_log_probs = _float32(log_probs), _float32(ref_log_probs)
  if log_probs.shape != ref_log_probs.shape:
    raise ValueError(
      f"ref_log_probs must have the shape of log_probs "
      f"{log_probs.shape}; got {ref_log_probs.shape}"
    )
  delta = ref_log_probs - log_probs
  if estimator == "k1":
    return -delta
  if estimator == "k2":
    return 0.5 * delta**2
  return jnp.exp(delta) - delta - 1


def aggregate(
  values: jax.Array,
  mask: jax.Array,
  mode: str = "seq-mean-token-mean",
  *,
  max_length: int | None = None,
  num_sequences: jax.Array | float | None = None,
  num_tokens: jax.Array | float | None = None,
) -> jax.Array:
  r"""Reduces per-token values ``[B, T]`` to a scalar.

  With :math:`x_{it}` the values, :math:`m_{it}` the mask, :math:`n_i =
  \sum_t m_{it}`, :math:`S` the number of sequences with :math:`n_i > 0` and
  :math:`N = \sum_i n_i`:

  ===========================  ==============================================
  mode                         value
  ===========================  ==============================================
  ``seq-mean-token-mean``      :math:`\frac1S\sum_i \frac{1}{n_i}\sum_t m x`
                               (GRPO)
  ``token-mean``               :math:`\frac1N\sum_{i,t} m x` (DAPO)
  ``seq-mean-token-sum-norm``  :math:`\frac{1}{S L}\sum_{i,t} m x`, ``L`` a
                               constant (Dr. GRPO)
  ``seq-mean-token-sum``       :math:`\frac1S\sum_{i,t} m x`
  ===========================  ==============================================

  Rows with no valid token do not count in ``S``, so padding rows change
  nothing. For gradient accumulation over microbatches pass the *whole*
  batch's ``num_tokens`` (token-mean) or ``num_sequences`` (the other modes):
  the microbatch losses then add up to the batch loss exactly.

  Args:
    values: ``[B, T]`` per-token values.
    mask: ``[B, T]`` booleans (or 0/1).
    mode: one of the four modes above.
    max_length: ``L`` of ``seq-mean-token-sum-norm``; default ``T``.
    num_sequences: overrides ``S`` (e.g. the full batch's count).
    num_tokens: overrides ``N`` (e.g. the full batch's count).

  Returns:
    A scalar.

  Examples:
    >>> import jax.numpy as jnp
    >>> from grpo_optax import rl
    >>> x = jnp.array([[1., 1., 1.], [4., 0., 0.]])
    >>> m = jnp.array([[1, 1, 1], [1, 0, 0]], bool)
    >>> rl.aggregate(x, m, "seq-mean-token-mean"), rl.aggregate(x, m, "token-mean")
    (Array(2.5, dtype=float32), Array(1.75, dtype=float32))
  """
  _common.check_choice("mode", mode, AGGREGATIONS)
  values, mask = _float32(values), jnp.asarray(mask)
  if values.ndim != 2 or mask.shape != values.shape:
    raise ValueError(
      f"values and mask must both have shape [B, T]; got "
      f"{values.shape} and {mask.shape}"
    )
  if max_length is not None and (
    isinstance(max_length, bool)
    or not isinstance(max_length, int)
    or max_length < 1
  ):
    raise ValueError(
      f"max_length must be None or an int >= 1; got {max_length!r}"
    )
  mask = mask.astype(bool)
  x = jnp.where(mask, values, 0)
  lengths = jnp.sum(mask, axis=-1).astype(values.dtype)
  seq_sums = jnp.sum(x, axis=-1)
  if num_sequences is None:
    num_sequences = jnp.sum(lengths > 0).astype(values.dtype)
  if num_tokens is None:
    num_tokens = jnp.sum(lengths)
  num_sequences = jnp.maximum(jnp.asarray(num_sequences, values.dtype), 1)
  num_tokens = jnp.maximum(jnp.asarray(num_tokens, values.dtype), 1)
  if mode == "token-mean":
    return jnp.sum(seq_sums) / num_tokens
  if mode == "seq-mean-token-mean":
    return jnp.sum(seq_sums / jnp.maximum(lengths, 1)) / num_sequences
  if mode == "seq-mean-token-sum":
    return jnp.sum(seq_sums) / num_sequences
  length = values.shape[1] if max_length is None else max_length
  return jnp.sum(seq_sums) / (num_sequences * length)


def _masked_stats(
  x: jax.Array, mask: jax.Array, prefix: str
) -> dict[str, jax.Array]:
  count = jnp.maximum(jnp.sum(mask), 1).astype(x.dtype)
  mean = jnp.sum(jnp.where(mask, x, 0)) / count
  var = jnp.sum(jnp.where(mask, (x - mean) ** 2, 0)) / count
  any_valid = jnp.any(mask)
  return {
    f"{prefix}_mean": mean,
    f"{prefix}_std": jnp.sqrt(var),
    f"{prefix}_min": jnp.where(
      any_valid, jnp.min(jnp.where(mask, x, jnp.inf)), 0
    ),
    f"{prefix}_max": jnp.where(
      any_valid, jnp.max(jnp.where(mask, x, -jnp.inf)), 0
    ),
  }


def _clipped_surrogate(
  log_ratio: jax.Array, adv: jax.Array, config: Config
) -> tuple[jax.Array, jax.Array]:
  r"""Per-token clipped loss and the ratio, with the unclipped gradient at ties.

  :math:`\max(-Ar, -A\,\mathrm{clip}(r, lo, hi))` equals the constant
  :math:`-A\,hi` where :math:`A > 0, r > hi`, the constant :math:`-A\,lo`
  where :math:`A < 0, r < lo`, and :math:`-Ar` elsewhere; the dual clip
  replaces :math:`-Ar` by :math:`-cA` where :math:`A < 0, r > c`. Written
  with ``jnp.where`` on these *strict* comparisons, the gradient at a tie
  (``r`` exactly at a bound, as on-policy with ``eps = 0``) is the unclipped
  one, where ``jnp.clip``/``jnp.maximum`` would split it in halves. Where a
  constant is selected (and where ``A = 0``), ``exp`` is evaluated at 0, so a
  huge log-ratio there gives no ``inf * 0 = NaN`` in the gradient.
  """
  low, high = 1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high
  # The branch choice only needs the ratio's value; log-space comparisons
  # would round differently at the bounds, so compare the ratio itself.
  ratio_value = jnp.exp(jax.lax.stop_gradient(log_ratio))
  clip_high = (adv > 0) & (ratio_value > high)
  clip_low = (adv < 0) & (ratio_value < low)
  constant = jnp.where(clip_high, high, low)
  if config.dual_clip is not None:
    dual = (adv < 0) & (ratio_value > config.dual_clip)
    constant = jnp.where(dual, config.dual_clip, constant)
    clip_low = clip_low | dual
  flat = clip_high | clip_low | (adv == 0)
  ratio = jnp.exp(jnp.where(flat, 0.0, log_ratio))
  per_token = jnp.where(flat, -adv * constant, -adv * ratio)
  return jnp.where(adv == 0, 0.0, per_token), ratio_value


def _check_shape(name: str, x: jax.Array, shape: tuple[int, ...]) -> None:
  if x.shape != shape:
    raise ValueError(
      f"{name} must have shape {shape} (that of log_probs); got {x.shape}"
    )


def policy_loss(
  log_probs: jax.Array,
  old_log_probs: jax.Array | None,
  advantages: jax.Array,
  mask: jax.Array,
  *,
  config: Config | str = "grpo",
  ref_log_probs: jax.Array | None = None,
  entropy: jax.Array | None = None,
  group_size: int | None = None,
  num_sequences: jax.Array | float | None = None,
  num_tokens: jax.Array | float | None = None,
  normalizer: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  r"""The clipped group-relative policy loss (GRPO, DAPO, Dr. GRPO, GSPO).

  Per token, with :math:`\ell` = ``log_probs``, :math:`A` the advantage of
  the token's completion (or of the token) and the ratio

  .. math::
    r_t = \exp(\ell_t - \ell^{old}_t)\ \text{(token)}, \qquad
    r_t = \exp\big(\ell_t - \mathrm{sg}(\ell_t) + \mathrm{sg}(\tfrac{1}{n_i}
          \textstyle\sum_s (\ell_s - \ell^{old}_s))\big)\ \text{(sequence)},

  the loss is :math:`L_t = \max(-A r_t, -A\,\mathrm{clip}(r_t, 1-\epsilon_{low},
  1+\epsilon_{high}))`, with :math:`L_t \leftarrow \min(L_t, -cA)` where
  :math:`A<0` under a dual clip ``c``, plus :math:`\beta\,\mathrm{KL}_t` (see
  :func:`kl_penalty`), reduced by :func:`aggregate` with
  ``config.aggregation``. The clip is selected by strict comparisons, so at
  a tie (``r`` exactly on a bound, as on-policy with ``clip_eps_low=0``) the
  gradient is the unclipped one, and where the loss is flat a huge
  log-ratio cannot make the gradient NaN. The sequence ratio (GSPO) has the value of the
  geometric mean of the completion's token ratios on every token, and the
  gradient of that value times :math:`\nabla\ell_t`.

  On-policy with one optimisation step per batch (``old_log_probs=None``, or
  equal to ``log_probs``) the ratio is exactly 1, clipping is inactive, and
  with ``beta=0`` the gradient is REINFORCE's with the group baseline:
  :math:`-\sum A \nabla\ell` under the aggregation's weights.

  This is DeepSeek's RL loss; it is unrelated to the optimizer
  :func:`grpo_optax.grpo`.

  Args:
    log_probs: ``[B, T]`` log-probabilities of the completion tokens under the
      policy being trained (:func:`token_log_probs`), differentiable.
    old_log_probs: ``[B, T]`` the same under the policy that sampled them
      (recorded by the sampler), or None for on-policy (``stop_gradient`` of
      ``log_probs``).
    advantages: ``[B]`` per completion (e.g. ``group_advantages(r).reshape(-
      1)``) or ``[B, T]`` per token.
    mask: ``[B, T]`` booleans, True for real completion tokens
      (:func:`completion_mask`).
    config: a :class:`Config` or a preset name.
    ref_log_probs: ``[B, T]`` log-probabilities under the reference policy;
      required when ``config.beta > 0``.
    entropy: optional ``[B, T]`` token entropies (:func:`token_entropy`),
      reported in the metrics (not added to the loss).
    group_size: completions per prompt; when given, the metrics include
      ``zero_signal_fraction``, the fraction of groups whose advantages are
      all 0.
    num_sequences: forwarded to :func:`aggregate` (microbatching).
    num_tokens: forwarded to :func:`aggregate` (microbatching).
    normalizer: a :class:`~grpo_optax.rl.LossNormalizer` of the whole batch
      (:func:`~grpo_optax.rl.loss_normalizer`), the explicit form of
      ``(num_sequences, num_tokens)``: with it, the losses and gradients of
      the microbatches or devices of a batch *sum* to the whole batch's.

  Returns:
    ``(loss, metrics)``: the scalar loss and a dict of scalar arrays:
    ``policy_loss``, ``clip_fraction_low`` (tokens where the lower clip binds:
    ``r < 1 - eps_low`` and ``A < 0``), ``clip_fraction_high`` (``r > 1 +
    eps_high`` and ``A > 0``), ``ratio_{mean,std,min,max}``,
    ``advantage_{mean,std,min,max}`` (over completions for ``[B]``
    advantages, over tokens for ``[B, T]``), ``num_tokens``; and when
    available ``clip_fraction_dual``, ``kl`` (token mean of the estimator),
    ``kl_loss``, ``entropy`` (token mean) and ``zero_signal_fraction``.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from grpo_optax import rl
    >>> logp = jnp.log(jnp.full((4, 3), 0.5))
    >>> adv = rl.group_advantages(jnp.array([[1., 0.], [0., 0.]])).reshape(-1)
    >>> loss, m = rl.policy_loss(logp, None, adv, jnp.ones((4, 3), bool),
    ...                          config="dapo", group_size=2)
    >>> float(loss), float(m["ratio_mean"]), float(m["zero_signal_fraction"])
    (0.0, 1.0, 0.5)

  References:
    Shao et al., `DeepSeekMath <https://arxiv.org/abs/2402.03300>`_, 2024.
    Yu et al., `DAPO: An Open-Source LLM Reinforcement Learning System at
    Scale <https://arxiv.org/abs/2503.14476>`_, 2025.
    Liu et al., `Understanding R1-Zero-Like Training: A Critical Perspective
    <https://arxiv.org/abs/2503.20783>`_, 2025 (Dr. GRPO).
    Zheng et al., `Group Sequence Policy Optimization
    <https://arxiv.org/abs/2507.18071>`_, 2025.
    Ye et al., `Mastering Complex Control in MOBA Games with Deep
    Reinforcement Learning <https://arxiv.org/abs/1912.09729>`_, 2020 (dual
    clip).
  """
  if isinstance(config, str):
    config = Config.preset(config)
  if not isinstance(config, Config):
    raise TypeError(
      f"config must be a grpo_optax.rl.Config or a preset name; "
      f"got {type(config).__name__}"
    )
  log_probs = _float32(log_probs)
  if log_probs.ndim != 2:
    raise ValueError(f"log_probs must have shape [B, T]; got {log_probs.shape}")
  shape = log_probs.shape
  mask = jnp.asarray(mask)
  _check_shape("mask", mask, shape)
  mask = mask.astype(bool)
  if old_log_probs is None:
    old_log_probs = jax.lax.stop_gradient(log_probs)
  old_log_probs = _float32(old_log_probs)
  _check_shape("old_log_probs", old_log_probs, shape)
  advantages = _float32(advantages)
  if advantages.shape == shape[:1]:
    per_sequence_adv = True
    adv = jnp.broadcast_to(advantages[:, None], shape)
  elif advantages.shape == shape:
    per_sequence_adv = False
    adv = advantages
  else:
    raise ValueError(
      f"advantages must have shape [B] = {shape[:1]} or "
      f"[B, T] = {shape}; got {advantages.shape}"
    )
  if config.beta > 0 and ref_log_probs is None:
    raise ValueError(
      f"config.beta = {config.beta} > 0 needs ref_log_probs "
      "(log-probabilities under the reference policy); pass "
      "them or use beta=0."
    )
  if group_size is not None:  # noqa: SIM102
    if (
      isinstance(group_size, bool)
      or not isinstance(group_size, int)
      or group_size < 1
      or shape[0] % group_size
    ):
      raise ValueError(
        f"group_size must be an int >= 1 dividing the batch "
        f"size {shape[0]}; got {group_size!r}"
      )

  # Masked positions are replaced before any arithmetic, so that padding
  # garbage (NaN, huge values) cannot reach the loss or its gradient.
  logp = jnp.where(mask, log_probs, 0)
  old = jnp.where(mask, old_log_probs, 0)
  adv = jnp.where(mask, adv, 0)
  log_ratio = logp - old
  if config.ratio_level == "sequence":
    lengths = jnp.maximum(jnp.sum(mask, axis=-1, keepdims=True), 1)
    seq_log_ratio = jnp.sum(log_ratio, axis=-1, keepdims=True) / lengths
    log_ratio = (
      logp - jax.lax.stop_gradient(logp) + jax.lax.stop_gradient(seq_log_ratio)
    )
  per_token, ratio = _clipped_surrogate(log_ratio, adv, config)
  low, high = 1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high
  metrics = {}
  if config.dual_clip is not None:
    metrics["clip_fraction_dual"] = (adv < 0) & (ratio > config.dual_clip)
  if normalizer is not None:
    if num_sequences is not None or num_tokens is not None:
      raise ValueError(
        "pass either normalizer or num_sequences/num_tokens, not both"
      )
    num_sequences, num_tokens = normalizer
  agg = lambda x: aggregate(
    x,
    mask,
    config.aggregation,
    max_length=config.max_length,
    num_sequences=num_sequences,
    num_tokens=num_tokens,
  )
  pg_loss = agg(per_token)
  loss = pg_loss
  if ref_log_probs is not None:
    ref = _float32(ref_log_probs)
    _check_shape("ref_log_probs", ref, shape)
    ref = jnp.where(mask, ref, 0)
    kl = kl_penalty(logp, ref, config.kl_estimator)
    kl_loss = agg(kl)
    loss = loss + config.beta * kl_loss
    metrics["kl"] = kl
    metrics["kl_loss"] = kl_loss

  # Metrics: no gradient, token means over the mask.
  sg = jax.lax.stop_gradient
  ratio, adv = sg(ratio), sg(adv)
  count = jnp.maximum(jnp.sum(mask), 1).astype(ratio.dtype)
  token_mean = lambda x: jnp.sum(jnp.where(mask, x, 0)) / count
  metrics["clip_fraction_low"] = (ratio < low) & (adv < 0)
  metrics["clip_fraction_high"] = (ratio > high) & (adv > 0)
  if entropy is not None:
    entropy = _float32(entropy)
    _check_shape("entropy", entropy, shape)
    metrics["entropy"] = entropy
  out = {
    name: token_mean(sg(value).astype(ratio.dtype))
    for name, value in metrics.items()
    if name != "kl_loss"
  }
  if "kl_loss" in metrics:
    out["kl_loss"] = sg(metrics["kl_loss"])
  out["loss"] = sg(loss)
  out["policy_loss"] = sg(pg_loss)
  out["num_tokens"] = jnp.sum(mask).astype(ratio.dtype)
  out.update(_masked_stats(ratio, mask, "ratio"))
  if per_sequence_adv:
    has_tokens = jnp.any(mask, axis=-1)
    out.update(_masked_stats(sg(advantages), has_tokens, "advantage"))
  else:
    out.update(_masked_stats(adv, mask, "advantage"))
  if group_size is not None:
    silent = jnp.all(adv == 0, axis=-1).reshape(-1, group_size)
    out["zero_signal_fraction"] = jnp.mean(
      jnp.all(silent, axis=-1).astype(ratio.dtype)
    )
  return loss, out
