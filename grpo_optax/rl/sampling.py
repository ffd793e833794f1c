"""Sampling completions from a decoder, with the log-probabilities recorded.

:func:`sample` decodes ``max_new_tokens`` tokens after equal-length prompts in
one ``jax.lax.scan`` over a fixed ``[B, P + N]`` token buffer, so it compiles
once and runs inside a jitted training step. The decoder is called on the
whole buffer at every position (no KV cache): ``N`` forward passes of length
``P + N``, which is exact for any causal decoder and cheap for small models.

Randomness is a pure function of ``(seed, step)``: the key of position ``t``
is ``fold_in(fold_in(key(seed), step), t)``, so a run resumed at training
step ``s`` samples exactly what an uninterrupted run samples, whatever was
drawn before.

The log-probability of each sampled token is computed by
:func:`grpo_optax.rl.token_log_probs` from the same logits divided by the
same temperature; re-scoring the completions with the same parameters gives
the same numbers up to float rounding (a few ulps, as XLA compiles the scan
body and the re-scoring separately), so the loss's importance ratio starts
at 1. With one optimizer step per batch pass ``old_log_probs=None`` to
:func:`~grpo_optax.rl.policy_loss` instead, which makes it exactly 1.

The decoder runs in inference mode: state it updates while decoding (an
RNG counter, BatchNorm statistics) is discarded.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from grpo_optax import _common
from grpo_optax.rl import losses


class Samples(NamedTuple):
  """Output of :func:`sample` (``B`` rows, ``P`` prompt and ``N`` new tokens)."""

  tokens: jax.Array  # [B, P + N] int32: the prompt, then the completion
  completions: jax.Array  # [B, N] int32: pad_id after the first EOS
  log_probs: jax.Array  # [B, N] float32: log p(token) at the temperature; 0 when masked
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
    return model
  raise TypeError(f"model must be a Flax NNX module or a callable tokens -> "
                  f"logits; got {type(model).__name__}")


def sample(model: Any, prompts: jax.Array, *, max_new_tokens: int,
           seed: int | jax.Array, step: int | jax.Array,
           temperature: float = 1.0, greedy: bool = False,
           eos_id: int | Sequence[int] | None = None,
           pad_id: int = 0) -> Samples:
  r"""Samples ``max_new_tokens`` tokens after each prompt.

  At position ``t`` the token is drawn from
  :math:`\mathrm{softmax}(z_t / \tau)`, ``z_t`` the decoder's logits at the
  previous position, with the key ``fold_in(sampling_key(seed, step), t)``
  (``greedy=True``: the argmax, same recorded log-probabilities). After a
  row's first EOS its tokens are ``pad_id``, its log-probabilities 0 and its
  mask False.

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
  if (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int)
      or max_new_tokens < 1):
    raise ValueError(f"max_new_tokens must be an int >= 1; got "
                     f"{max_new_tokens!r}")
  _common.check_range("temperature", temperature, 0.0, low_inclusive=False)
  prompts = jnp.asarray(prompts)
  if prompts.ndim != 2 or prompts.shape[1] < 1:
    raise ValueError(f"prompts must have shape [B, P] with P >= 1; got "
                     f"{prompts.shape}")
  if not jnp.issubdtype(prompts.dtype, jnp.integer):
    raise TypeError(f"prompts must be integer tokens; got {prompts.dtype}")
  decode = _decoder_fn(model)
  prompts = prompts.astype(jnp.int32)
  batch, prompt_len = prompts.shape
  length = prompt_len + max_new_tokens
  eos = None if eos_id is None else jnp.asarray(eos_id, jnp.int32).reshape(-1)
  buffer = jnp.concatenate(
      [prompts, jnp.full((batch, max_new_tokens), pad_id, jnp.int32)], axis=1)
  key = sampling_key(seed, step)

  def body(carry, t):
    tokens, done = carry
    logits = decode(tokens)
    if logits.ndim != 3 or logits.shape[:2] != (batch, length):
      raise ValueError(f"model(tokens[{batch}, {length}]) must return logits "
                       f"[{batch}, {length}, V]; got {logits.shape}")
    logits = jax.lax.dynamic_index_in_dim(logits, prompt_len + t - 1, axis=1,
                                          keepdims=False)
    if greedy:
      new = jnp.argmax(logits, axis=-1)
    else:
      scaled = losses._scaled_logits(logits, temperature)  # pylint: disable=protected-access
      new = jax.random.categorical(jax.random.fold_in(key, t), scaled)
    new = new.astype(jnp.int32)
    log_prob = losses.token_log_probs(logits, new, temperature)
    new = jnp.where(done, pad_id, new)
    log_prob = jnp.where(done, 0.0, log_prob)
    tokens = jax.lax.dynamic_update_slice_in_dim(
        tokens, new[:, None], prompt_len + t, axis=1)
    if eos is not None:
      done = done | jnp.any(new[:, None] == eos, axis=-1)
    return (tokens, done), (new, log_prob)

  (tokens, _), (new, log_probs) = jax.lax.scan(
      body, (buffer, jnp.zeros((batch,), bool)),
      jnp.arange(max_new_tokens, dtype=jnp.int32))
  completions = new.T
  mask = (jnp.ones(completions.shape, bool) if eos is None
          else losses.completion_mask(completions, eos))
  return Samples(tokens=tokens, completions=completions, log_probs=log_probs.T,
                 mask=mask)
