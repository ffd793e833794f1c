"""A small causal transformer in Flax NNX that implements the KV-cache protocol
of ``grpo_optax.rl.sample``.

``model(tokens[B, L])`` returns logits ``[B, L, V]`` (the plain causal
decoder); ``model(tokens, cache=cache, position=p)`` treats ``tokens`` as the
positions ``p .. p + L - 1`` of a longer sequence, attends to the keys and
values already in ``cache`` (``model.init_cache(B, max_length)``: per layer a
``[B, max_length, H, Dh]`` pair of zeros) and returns ``(logits, new_cache)``.
The cache is a plain pytree passed in and out, so it can live in the carry
of a ``jax.lax.scan``; positions past ``p + L - 1`` hold zeros and are
masked out.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """Sizes of the decoder.

  Attributes:
    vocab_size: input vocabulary.
    max_length: longest sequence (learned position embeddings).
    hidden: model width, divisible by ``num_heads``.
    num_layers: transformer blocks.
    num_heads: attention heads.
    ffn: width of the feed-forward layer.
    out_vocab: size of the output layer (default ``vocab_size``).
    relative_bias: add to the attention scores a learned per-head bias of
      the distance ``q - k`` (zero at initialisation), so that a pattern
      like "look 5 tokens back" is learned once for every position.
  """

  vocab_size: int
  max_length: int
  hidden: int = 64
  num_layers: int = 2
  num_heads: int = 4
  ffn: int = 256
  out_vocab: int | None = None
  relative_bias: bool = True

  def __post_init__(self):
    for name in (
      "vocab_size",
      "max_length",
      "hidden",
      "num_layers",
      "num_heads",
      "ffn",
    ):
      if getattr(self, name) < 1:
        raise ValueError(
          f"DecoderConfig.{name} must be >= 1, got {getattr(self, name)}."
        )
    if self.hidden % self.num_heads:
      raise ValueError(
        f"hidden ({self.hidden}) must be divisible by "
        f"num_heads ({self.num_heads})."
      )


class CachedSelfAttention(nnx.Module):
  """Causal multi-head self-attention, with or without a KV cache."""

  def __init__(
    self,
    hidden: int,
    num_heads: int,
    *,
    rngs: nnx.Rngs,
    max_length: int | None = None,
  ):
    self.num_heads = num_heads
    self.rel_bias = (
      None
      if max_length is None
      else nnx.Param(jnp.zeros((num_heads, max_length), jnp.float32))
    )
    self.head_dim = hidden // num_heads
    self.qkv = nnx.LinearGeneral(
      hidden, (3, num_heads, self.head_dim), rngs=rngs
    )
    self.out = nnx.LinearGeneral(
      (num_heads, self.head_dim), hidden, axis=(-2, -1), rngs=rngs
    )

  def __call__(self, x, *, cache=None, position=None):
    q, k, v = jnp.moveaxis(self.qkv(x), 2, 0)  # each [B, L, H, Dh]
    length = x.shape[1]
    q_pos = jnp.arange(length)
    if cache is not None:
      keys, values = cache
      start = (0, position, 0, 0)
      k = jax.lax.dynamic_update_slice(keys, k.astype(keys.dtype), start)
      v = jax.lax.dynamic_update_slice(values, v.astype(values.dtype), start)
      q_pos = q_pos + position
      cache = (k, v)
    k_pos = jnp.arange(k.shape[1])
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(self.head_dim)
    distance = q_pos[:, None] - k_pos[None, :]
    if self.rel_bias is not None:
      bias = jnp.take(
        self.rel_bias[...],
        jnp.clip(distance, 0, self.rel_bias.shape[1] - 1),
        axis=1,
      )
      scores = scores + bias[None]
    scores = jnp.where(distance >= 0, scores, -jnp.inf)
    p = jax.nn.softmax(scores, axis=-1)
    return self.out(jnp.einsum("bhqk,bkhd->bqhd", p, v)), cache


class Block(nnx.Module):
  """Pre-norm transformer block."""

  def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(config.hidden, rngs=rngs)
    self.attn = CachedSelfAttention(
      config.hidden,
      config.num_heads,
      rngs=rngs,
      max_length=config.max_length if config.relative_bias else None,
    )
    self.ln2 = nnx.LayerNorm(config.hidden, rngs=rngs)
    self.fc1 = nnx.Linear(config.hidden, config.ffn, rngs=rngs)
    self.fc2 = nnx.Linear(config.ffn, config.hidden, rngs=rngs)

  def __call__(self, x, *, cache=None, position=None):
    h, cache = self.attn(self.ln1(x), cache=cache, position=position)
    x = x + h
    return x + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x)))), cache


class Decoder(nnx.Module):
  """Causal decoder ``tokens [B, L] -> logits [B, L, out_vocab]`` (float32)."""

  def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.tok_embed = nnx.Embed(config.vocab_size, config.hidden, rngs=rngs)
    self.pos_embed = nnx.Embed(config.max_length, config.hidden, rngs=rngs)
    self.layers = nnx.List(
      [Block(config, rngs=rngs) for _ in range(config.num_layers)]
    )
    self.ln_f = nnx.LayerNorm(config.hidden, rngs=rngs)
    self.head = nnx.Linear(
      config.hidden, config.out_vocab or config.vocab_size, rngs=rngs
    )

  def init_cache(self, batch_size: int, max_length: int):
    """Zero keys and values for every layer: a tuple of ``(k, v)`` pairs."""
    if max_length > self.config.max_length:
      raise ValueError(
        f"max_length {max_length} exceeds the decoder's "
        f"max_length {self.config.max_length}"
      )
    c = self.config
    shape = (batch_size, max_length, c.num_heads, c.hidden // c.num_heads)
    return tuple(
      (jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))
      for _ in range(c.num_layers)
    )

  def __call__(self, tokens, *, cache=None, position=None):
    positions = jnp.arange(tokens.shape[1])
    if cache is not None:
      positions = positions + position
    x = self.tok_embed(tokens) + self.pos_embed(positions)[None]
    new_cache = []
    for i, layer in enumerate(self.layers):
      x, layer_cache = layer(
        x, cache=None if cache is None else cache[i], position=position
      )
      new_cache.append(layer_cache)
    logits = self.head(self.ln_f(x)).astype(jnp.float32)
    return logits if cache is None else (logits, tuple(new_cache))
