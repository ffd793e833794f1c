"""The task and a tiny causal transformer policy, in Flax NNX.

Task: the prompt is one token naming a target ``s`` in ``0..27``; the policy
writes ``3`` digits; the reward is 1 if they sum to ``s``, else 0. Of the
1,000 digit triples, ``c(s)`` sum to ``s`` (1 for 0 and 27, 75 for 13 and
14), so a uniformly random policy is rewarded with probability
``mean_s c(s) / 1000 = 1/28 = 0.0357``.

Tokens: digits are ``0..9`` (the policy's only outputs), target ``s`` is
token ``10 + s``. A sequence is ``[10 + s, d1, d2, d3]``; the logits at
position ``i`` give the distribution of digit ``i + 1``.

Each token's embedding is a learned vector plus a learned vector times the
number the token stands for (``token_values``: ``d / 9`` or ``s / 27``), so
targets start out ordered and a target that is rarely rewarded borrows from
its neighbours. Without it (``value_embedding=False``) the targets 0 and 27,
whose only solutions are 000 and 999, were often left unsolved: greedy
decoding solved 27, 26 and 27 of 28 targets for seeds 3-5 against 28, 28, 28
with it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

NUM_DIGITS = 3
NUM_TARGETS = 9 * NUM_DIGITS + 1  # 0..27
DIGIT_VOCAB = 10
TARGET_OFFSET = DIGIT_VOCAB
INPUT_VOCAB = TARGET_OFFSET + NUM_TARGETS


def prompt_tokens(targets: jax.Array) -> jax.Array:
  """``[B]`` targets -> ``[B, 1]`` int32 prompt tokens."""
  return (jnp.asarray(targets, jnp.int32) + TARGET_OFFSET)[:, None]


def token_values(tokens: jax.Array) -> jax.Array:
  """The number a token stands for, scaled to [0, 1]: digit d -> d / 9,
  target s -> s / 27.
  """
  tokens = jnp.asarray(tokens)
  is_digit = tokens < TARGET_OFFSET
  return jnp.where(
    is_digit,
    tokens / (DIGIT_VOCAB - 1),
    (tokens - TARGET_OFFSET) / (NUM_TARGETS - 1),
  ).astype(jnp.float32)


def rewards(targets: jax.Array, completions: jax.Array) -> jax.Array:
  """1.0 where the ``[B, 3]`` digits sum to the ``[B]`` targets, else 0.0."""
  return (jnp.sum(completions, axis=-1) == targets).astype(jnp.float32)


def chance_reward() -> float:
  """Expected reward of the uniform policy over targets and digit triples."""
  digits = np.arange(DIGIT_VOCAB)
  sums = (
    digits[:, None, None] + digits[None, :, None] + digits[None, None, :]
  ).ravel()
  counts = np.bincount(sums, minlength=NUM_TARGETS)
  return float(np.mean(counts / DIGIT_VOCAB**NUM_DIGITS))


@dataclasses.dataclass
class PolicyConfig:
  """Size of the decoder (defaults: about 60k parameters)."""

  hidden: int = 64
  num_layers: int = 2
  num_heads: int = 4
  ffn: int = 128
  value_embedding: bool = True

  def __post_init__(self):
    for name in ("hidden", "num_layers", "num_heads", "ffn"):
      if getattr(self, name) < 1:
        raise ValueError(
          f"PolicyConfig.{name} must be >= 1, got {getattr(self, name)}."
        )
    if self.hidden % self.num_heads:
      raise ValueError(
        f"hidden ({self.hidden}) must be divisible by "
        f"num_heads ({self.num_heads})."
      )


class CausalSelfAttention(nnx.Module):
  """Multi-head self-attention where position ``i`` sees positions ``<= i``."""

  def __init__(self, hidden: int, num_heads: int, *, rngs: nnx.Rngs):
    self.head_dim = hidden // num_heads
    self.qkv = nnx.LinearGeneral(
      hidden, (3, num_heads, self.head_dim), rngs=rngs
    )
    self.out = nnx.LinearGeneral(
      (num_heads, self.head_dim), hidden, axis=(-2, -1), rngs=rngs
    )

  def __call__(self, x):
    q, k, v = jnp.moveaxis(self.qkv(x), 2, 0)  # each [B, T, H, Dh]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(self.head_dim)
    length = x.shape[1]
    causal = jnp.tril(jnp.ones((length, length), bool))
    scores = jnp.where(causal, scores, -jnp.inf)
    p = jax.nn.softmax(scores, axis=-1)
    return self.out(jnp.einsum("bhqk,bkhd->bqhd", p, v))


class Block(nnx.Module):
  """Pre-norm transformer block."""

  def __init__(self, config: PolicyConfig, *, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(config.hidden, rngs=rngs)
    self.attn = CausalSelfAttention(config.hidden, config.num_heads, rngs=rngs)
    self.ln2 = nnx.LayerNorm(config.hidden, rngs=rngs)
    self.fc1 = nnx.Linear(config.hidden, config.ffn, rngs=rngs)
    self.fc2 = nnx.Linear(config.ffn, config.hidden, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.ln1(x))
    return x + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x))))


class SumPolicy(nnx.Module):
  """Decoder ``tokens [B, T] -> digit logits [B, T, 10]`` (float32), causal.

  The output layer starts at zero, so the initial policy is exactly uniform
  over the digits (reward = chance).
  """

  def __init__(self, config: PolicyConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.tok_embed = nnx.Embed(INPUT_VOCAB, config.hidden, rngs=rngs)
    self.value_embed = (
      nnx.Linear(1, config.hidden, use_bias=False, rngs=rngs)
      if config.value_embedding
      else None
    )
    self.pos_embed = nnx.Embed(NUM_DIGITS + 1, config.hidden, rngs=rngs)
    self.layers = nnx.List(
      [Block(config, rngs=rngs) for _ in range(config.num_layers)]
    )
    self.ln_f = nnx.LayerNorm(config.hidden, rngs=rngs)
    self.head = nnx.Linear(
      config.hidden, DIGIT_VOCAB, kernel_init=nnx.initializers.zeros, rngs=rngs
    )

  def __call__(self, tokens):
    length = tokens.shape[1]
    x = self.tok_embed(tokens) + self.pos_embed(jnp.arange(length))[None]
    if self.value_embed is not None:
      x = x + self.value_embed(token_values(tokens)[..., None])
    for layer in self.layers:
      x = layer(x)
    return self.head(self.ln_f(x)).astype(jnp.float32)
