"""Sampling completions from a decoder, with the log-probabilities recorded.

:func:`sample` decodes ``max_new_tokens`` tokens after equal-length prompts in
one ``jax.lax.scan`` over a fixed ``[B, P + N]`` token buffer, so it compiles
once and runs inside a jitted training step. Two ways to run the decoder:

* uncached: the decoder is called on the whole buffer at every position,
  ``N`` forward passes of length ``P + N``; exact for any causal decoder.
* KV-cached, for a decoder that implements the cache protocol below: one
  forward pass over the prompt (prefill), then one pass of length 1 per new
  token against a fixed-size cache that travels in the scan carry. Same
  tokens for the same keys, log-probabilities equal up to float rounding
  (the attention is computed with other matrix shapes; so a draw that lands
  within rounding of the boundary between two tokens could in principle
  differ, with probability of the order of 1e-7 per token).

The cache protocol: ``model.init_cache(batch_size, max_length)`` returns a
pytree of arrays (for example ``[B, max_length, H, Dh]`` keys and values per
layer), and ``model(tokens[B, L], cache=cache, position=p)`` returns
``(logits[B, L, V], new_cache)`` for tokens at absolute positions
``p .. p + L - 1`` (``p`` a traced int32 scalar). The cache is a value, not
module state, so the scan stays a pure function.

Randomness is a pure function of ``(seed, step)``: the key of position ``t``
is ``fold_in(fold_in(key(seed), step), t)``, so a run resumed at training
step ``s`` samples exactly what an uninterrupted run samples, whatever was
drawn before, and the cached and uncached samplers draw the same tokens.

The token of each position is drawn from the distribution the loss scores:
:func:`grpo_optax.rl.token_log_probs` of the same logits, temperature and
:class:`~grpo_optax.rl.Truncation` (top-k, top-p, min-p: the truncated,
renormalised distribution), and that log-probability is recorded. Re-scoring
the completions with the same parameters and settings gives the same
numbers up to float rounding (a few ulps, as XLA compiles the scan body and
the re-scoring separately), so the loss's importance ratio starts at 1. With
one optimizer step per batch pass ``old_log_probs=None`` to
:func:`~grpo_optax.rl.policy_loss` instead, which makes it exactly 1.

The decoder runs in inference mode: state it updates while decoding (an
RNG counter, BatchNorm statistics) is discarded.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple
from typing import cast

import jax
import jax.numpy as jnp

from grpo_optax import _common
from grpo_optax.rl import losses
from grpo_optax.rl import truncation as truncation_lib

__all__ = (
  "Samples",
  "sample",
  "sampling_key",
)


class Samples(NamedTuple):
  """Output of :func:`sample` (``B`` rows, ``P`` prompt and ``N`` new tokens)."""

  tokens: jax.Array  # [B, P + N] int32: the prompt, then the completion
  completions: jax.Array  # [B, N] int32: pad_id after the first EOS
  log_probs: (
    jax.Array
  )  # [B, N] float32: log p(token) at the temperature; 0 when masked
  mask: jax.Array  # [B, N] bool: up to and including the first EOS


def sampling_key(seed: int | jax.Array, step: int | jax.Array) -> jax.Array:
  """The key of training step ``step`` of a run seeded with ``seed``."""
  return jax.random.fold_in(jax.random.key(seed), step)


def _decoder_fn(model: Any) -> Callable[[jax.Array], jax.Array]:
  """``tokens -> logits`` for a Flax NNX module or a plain callable.

  Flax is never imported here: a model can only be an NNX module if
  ``flax.nnx`` has already been imported by whoever built it.
  """
  nnx = sys.modules.get("flax.nnx")
  if nnx is not None and isinstance(model, nnx.Module):
    graphdef, state = nnx.split(model)
    return lambda tokens: nnx.merge(graphdef, state)(tokens)
  if callable(model):
    return cast(Callable[[jax.Array], jax.Array], model)
  raise TypeError(
    f"model must be a Flax NNX module or a callable tokens -> "
    f"logits; got {type(model).__name__}"
  )


def _cached_decoder_fn(model: Any) -> Callable[..., tuple[jax.Array, Any]]:
  """``(tokens, cache, position) -> (logits, cache)`` of a cache-aware model."""
  nnx = sys.modules.get("flax.nnx")
  if nnx is not None and isinstance(model, nnx.Module):
    graphdef, state = nnx.split(model)
    return lambda tokens, cache, position: nnx.merge(graphdef, state)(
      tokens, cache=cache, position=position
    )
  return lambda tokens, cache, position: model(
    tokens, cache=cache, position=position
  )


def _use_cache(model: Any, kv_cache: bool | None) -> bool:
  has_cache = callable(getattr(model, "init_cache", None))
  if kv_cache is None:
    return has_cache
  if kv_cache and not has_cache:
    raise TypeError(
      f"kv_cache=True needs a model with init_cache(batch_size, "
      f"max_length) and __call__(tokens, cache=, position=); "
      f"{type(model).__name__} has no init_cache"
    )
  return bool(kv_cache)


def _check_logits(logits: jax.Array, batch: int, length: int) -> None:
  if logits.ndim != 3 or logits.shape[:2] != (batch, length):
    raise ValueError(
      f"model(tokens[{batch}, {length}]) must return logits "
      f"[{batch}, {length}, V]; got {logits.shape}"
    )


def _draw(
  logits: jax.Array,
  key: jax.Array,
  t: jax.Array,
  *,
  temperature: float,
  truncation: truncation_lib.Truncation,
  greedy: bool,
) -> tuple[jax.Array, jax.Array]:
  """The token of position ``t`` and its log-probability, from ``[B, V]``."""
  scaled = truncation_lib.truncated_logits(
    losses.scaled_logits(logits, temperature), truncation
  )
  if greedy:
    new = jnp.argmax(scaled, axis=-1)
  else:
    new = jax.random.categorical(jax.random.fold_in(key, t), scaled)
  new = new.astype(jnp.int32)
  return new, losses.token_log_probs(
    logits, new, temperature, truncation=truncation
  )


def sample(
  model: Any,
  prompts: jax.Array,
  *,
  max_new_tokens: int,
  seed: int | jax.Array,
  step: int | jax.Array,
  temperature: float = 1.0,
  greedy: bool = False,
  eos_id: int | Sequence[int] | None = None,
  pad_id: int = 0,
  truncation: truncation_lib.Truncation | None = None,
  kv_cache: bool | None = None,
) -> Samples:
  r"""Samples ``max_new_tokens`` tokens after each prompt.

  At position ``t`` the token is drawn from
  :math:`\mathrm{softmax}(\mathrm{trunc}(z_t / \tau))`, ``z_t`` the decoder's
  logits at the previous position and ``trunc`` the ``truncation``
  (:func:`~grpo_optax.rl.truncated_logits`), with the key
  ``fold_in(sampling_key(seed, step), t)`` (``greedy=True``: the argmax, same
  recorded log-probabilities). After a row's first EOS its tokens are
  ``pad_id``, its log-probabilities 0 and its mask False.

  Args:
    model: a causal decoder, ``model(tokens[B, L]) -> logits[B, L, V]`` (a
      Flax NNX module or any callable). It must be causal: the not yet
      generated positions of the buffer hold ``pad_id``.
    prompts: ``[B, P]`` integer prompts, all of length ``P >= 1``
      (left-pad shorter ones with a token the model ignores).
    max_new_tokens: ``N >= 1``.
    seed: the run's seed (int or int array).
    step: the training step (int or int array; traced inside ``jit``).
    temperature: ``tau > 0``; use the same value in the loss.
    greedy: take the most likely token instead of sampling.
    eos_id: id(s) that end a completion; None: completions run to ``N``.
    pad_id: token written after EOS.
    truncation: top-k / top-p / min-p settings
      (:class:`~grpo_optax.rl.Truncation`), or None; pass the same to
      :func:`~grpo_optax.rl.token_log_probs` in the loss.
    kv_cache: None: use the KV cache when the model implements the cache
      protocol (``init_cache``); True: require it; False: the uncached
      decoder, ``N`` full passes.

  Returns:
    :class:`Samples`.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from grpo_optax import rl
    >>> bigram = jnp.log(jnp.array([[0.1, 0.9], [0.8, 0.2]]))
    >>> model = lambda tokens: bigram[tokens]  # A causal decoder.
    >>> out = rl.sample(model, jnp.zeros((2, 1), jnp.int32), max_new_tokens=3,
    ...                 seed=0, step=0, greedy=True)
    >>> out.completions
    Array([[1, 0, 1],
           [1, 0, 1]], dtype=int32)
    >>> jnp.exp(out.log_probs[0])
    Array([0.9, 0.8, 0.9], dtype=float32)
  """
  if (
    isinstance(max_new_tokens, bool)
    or not isinstance(max_new_tokens, int)
    or max_new_tokens < 1
  ):
    raise ValueError(
      f"max_new_tokens must be an int >= 1; got {max_new_tokens!r}"
    )
  _common.check_range("temperature", temperature, 0.0, low_inclusive=False)
  prompts = jnp.asarray(prompts)
  if prompts.ndim != 2 or prompts.shape[1] < 1:
    raise ValueError(
      f"prompts must have shape [B, P] with P >= 1; got {prompts.shape}"
    )
  if not jnp.issubdtype(prompts.dtype, jnp.integer):
    raise TypeError(f"prompts must be integer tokens; got {prompts.dtype}")
  truncation = truncation_lib.as_truncation(truncation)
  prompts = prompts.astype(jnp.int32)
  batch, prompt_len = prompts.shape
  length = prompt_len + max_new_tokens
  eos = None if eos_id is None else jnp.asarray(eos_id, jnp.int32).reshape(-1)
  buffer = jnp.concatenate(
    [prompts, jnp.full((batch, max_new_tokens), pad_id, jnp.int32)], axis=1
  )
  key = sampling_key(seed, step)
  draw = functools.partial(
    _draw,
    key=key,
    temperature=temperature,
    truncation=truncation,
    greedy=greedy,
  )

  def finish(new, log_prob, done):
    new = jnp.where(done, pad_id, new)
    log_prob = jnp.where(done, 0.0, log_prob)
    if eos is not None:
      done = done | jnp.any(new[:, None] == eos, axis=-1)
    return new, log_prob, done

  if _use_cache(model, kv_cache):
    decode = _cached_decoder_fn(model)
    logits, cache = decode(
      prompts, model.init_cache(batch, length), jnp.zeros((), jnp.int32)
    )
    _check_logits(logits, batch, prompt_len)

    def cached_body(carry, t):
      tokens, done, logits, cache = carry
      new, log_prob, done = finish(*draw(logits, t=t), done)
      tokens = jax.lax.dynamic_update_slice_in_dim(
        tokens, new[:, None], prompt_len + t, axis=1
      )
      next_logits, cache = decode(new[:, None], cache, prompt_len + t)
      return (tokens, done, next_logits[:, -1], cache), (new, log_prob)

    carry = (buffer, jnp.zeros((batch,), bool), logits[:, -1], cache)
    (tokens, *_), (new, log_probs) = jax.lax.scan(
      cached_body, carry, jnp.arange(max_new_tokens, dtype=jnp.int32)
    )
  else:
    decode = _decoder_fn(model)

    def body(carry, t):
      tokens, done = carry
      logits = decode(tokens)
      _check_logits(logits, batch, length)
      logits = jax.lax.dynamic_index_in_dim(
        logits, prompt_len + t - 1, axis=1, keepdims=False
      )
      new, log_prob, done = finish(*draw(logits, t=t), done)
      tokens = jax.lax.dynamic_update_slice_in_dim(
        tokens, new[:, None], prompt_len + t, axis=1
      )
      return (tokens, done), (new, log_prob)

    (tokens, _), (new, log_probs) = jax.lax.scan(
      body,
      (buffer, jnp.zeros((batch,), bool)),
      jnp.arange(max_new_tokens, dtype=jnp.int32),
    )
  completions = new.T
  mask = (
    jnp.ones(completions.shape, bool)
    if eos is None
    else losses.completion_mask(completions, eos)
  )
  return Samples(
    tokens=tokens, completions=completions, log_probs=log_probs.T, mask=mask
  )
