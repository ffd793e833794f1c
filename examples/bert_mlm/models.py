"""A small pre-norm BERT encoder with a masked-language-model head, in Flax NNX.

The attention is written out by hand (query/key/value/out projections as
``nnx.LinearGeneral``) so that it can report the entropy of each head's
attention distribution. ``BertMLM.apply_with_entropy`` returns those entropies
next to the logits; the training loop turns them into the ``head_entropy``
extra argument of ``grpo_optax.grpo`` (see ``train.head_entropy_tree``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx


@dataclasses.dataclass
class BertConfig:
  """Size of the encoder. The defaults are a CPU-friendly 1.5M-parameter model."""

  vocab_size: int = 8192
  max_len: int = 64
  hidden: int = 128
  num_layers: int = 2
  num_heads: int = 2
  ffn: int = 512
  dropout: float = 0.0

  def __post_init__(self):
    for name in (
      "vocab_size",
      "max_len",
      "hidden",
      "num_layers",
      "num_heads",
      "ffn",
    ):
      if getattr(self, name) < 1:
        raise ValueError(
          f"BertConfig.{name} must be >= 1, got {getattr(self, name)}."
        )
    if self.hidden % self.num_heads:
      raise ValueError(
        f"hidden ({self.hidden}) must be divisible by "
        f"num_heads ({self.num_heads})."
      )
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f"dropout must be in [0, 1), got {self.dropout}.")


def _split_key(key: jax.Array | None, n: int) -> list[jax.Array | None]:
  """Splits an optional key into ``n`` optional keys."""
  if key is None:
    return [None] * n
  return list(jax.random.split(key, n))


class SelfAttention(nnx.Module):
  """Multi-head self-attention that also returns its per-head entropy."""

  def __init__(
    self, hidden: int, num_heads: int, dropout: float, *, rngs: nnx.Rngs
  ):
    head_dim = hidden // num_heads
    self.num_heads = num_heads
    self.head_dim = head_dim
    proj = lambda: nnx.LinearGeneral(hidden, (num_heads, head_dim), rngs=rngs)
    self.query = proj()
    self.key = proj()
    self.value = proj()
    self.out = nnx.LinearGeneral(
      (num_heads, head_dim), hidden, axis=(-2, -1), rngs=rngs
    )
    self.dropout = nnx.Dropout(dropout)

  def __call__(self, x, *, deterministic: bool, dropout_key=None):
    """Returns ``(y [B,T,D], entropy [H])``.

    ``entropy[h]`` is ``-sum_k p log p`` over the keys of head ``h``, averaged
    over the batch and the query positions (nats). It is a statistic for the
    optimizer, so no gradient flows through it.
    """
    q, k, v = self.query(x), self.key(x), self.value(x)  # [B, T, H, Dh]
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(
      jnp.asarray(self.head_dim, x.dtype)
    )
    log_p = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    p = jnp.exp(log_p)
    entropy = jax.lax.stop_gradient(-(p * log_p).sum(-1).mean(axis=(0, 2)))
    p = self.dropout(
      p.astype(x.dtype), deterministic=deterministic, rngs=dropout_key
    )
    y = jnp.einsum("bhqk,bkhd->bqhd", p, v)
    return self.out(y), entropy


class Mlp(nnx.Module):
  """Two-layer GELU feed-forward block."""

  def __init__(self, hidden: int, ffn: int, *, rngs: nnx.Rngs):
    self.fc1 = nnx.Linear(hidden, ffn, rngs=rngs)
    self.fc2 = nnx.Linear(ffn, hidden, rngs=rngs)

  def __call__(self, x):
    return self.fc2(jax.nn.gelu(self.fc1(x)))


class Block(nnx.Module):
  """Pre-norm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

  def __init__(self, config: BertConfig, *, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(config.hidden, rngs=rngs)
    self.attn = SelfAttention(
      config.hidden, config.num_heads, config.dropout, rngs=rngs
    )
    self.ln2 = nnx.LayerNorm(config.hidden, rngs=rngs)
    self.mlp = Mlp(config.hidden, config.ffn, rngs=rngs)
    self.dropout = nnx.Dropout(config.dropout)

  def __call__(self, x, *, deterministic: bool, dropout_key=None):
    k_attn, k1, k2 = _split_key(dropout_key, 3)
    y, entropy = self.attn(
      self.ln1(x), deterministic=deterministic, dropout_key=k_attn
    )
    x = x + self.dropout(y, deterministic=deterministic, rngs=k1)
    y = self.mlp(self.ln2(x))
    x = x + self.dropout(y, deterministic=deterministic, rngs=k2)
    return x, entropy


class BertMLM(nnx.Module):
  """BERT-style encoder with learned positions and a masked-LM output layer.

  Sequences are fixed-length (no padding mask): the input pipeline packs text
  into blocks of ``config.max_len`` tokens.
  """

  def __init__(self, config: BertConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.tok_embed = nnx.Embed(config.vocab_size, config.hidden, rngs=rngs)
    self.pos_embed = nnx.Embed(config.max_len, config.hidden, rngs=rngs)
    self.embed_dropout = nnx.Dropout(config.dropout)
    self.layers = nnx.List(
      [Block(config, rngs=rngs) for _ in range(config.num_layers)]
    )
    self.ln_f = nnx.LayerNorm(config.hidden, rngs=rngs)
    self.mlm_head = nnx.Linear(config.hidden, config.vocab_size, rngs=rngs)

  def apply_with_entropy(
    self,
    tokens,
    *,
    deterministic: bool = True,
    dropout_key: jax.Array | None = None,
    positions: jax.Array | None = None,
  ):
    """Returns ``(logits float32, entropies: tuple of [H] per layer)``.

    Args:
      tokens: int32 token ids, shape ``[B, T]`` with ``T <= config.max_len``.
      deterministic: disables dropout when True.
      dropout_key: PRNG key for dropout; required when ``deterministic`` is
        False and ``config.dropout > 0``.
      positions: optional int32 ``[B, P]``: compute the output layer only at
        these positions (the masked ones), as BERT pre-training does; the
        logits are then ``[B, P, V]`` instead of ``[B, T, V]``.
    """
    if not deterministic and self.config.dropout > 0 and dropout_key is None:
      raise ValueError(
        "BertMLM needs `dropout_key` when deterministic=False "
        "and config.dropout > 0."
      )
    _, seq_len = tokens.shape
    if seq_len > self.config.max_len:
      raise ValueError(
        f"sequence length {seq_len} exceeds max_len {self.config.max_len}."
      )
    keys = _split_key(dropout_key, len(self.layers) + 1)
    x = self.tok_embed(tokens) + self.pos_embed(jnp.arange(seq_len))[None]
    x = self.embed_dropout(x, deterministic=deterministic, rngs=keys[0])
    entropies = []
    for layer, key in zip(self.layers, keys[1:]):
      x, entropy = layer(x, deterministic=deterministic, dropout_key=key)
      entropies.append(entropy)
    if positions is not None:
      x = jnp.take_along_axis(x, positions[..., None], axis=1)
    logits = self.mlm_head(self.ln_f(x))
    return logits.astype(jnp.float32), tuple(entropies)

  def __call__(
    self,
    tokens,
    *,
    deterministic: bool = True,
    dropout_key: jax.Array | None = None,
  ):
    """Returns the MLM logits, float32 ``[B, T, vocab_size]``."""
    return self.apply_with_entropy(
      tokens, deterministic=deterministic, dropout_key=dropout_key
    )[0]
