r"""Per-replica top-k, one all-gather of the packed bytes, scatter-add.

Deep Gradient Compression's exchange (Lin et al. 2018): per leaf (or per
block of a leaf with ``indices="compact"``) each replica keeps its ``k``
entries of largest :math:`|a_i|`; the mean is
:math:`\frac1W \sum_i \mathrm{scatter}(S_i, \mathrm{dec}(\mathrm{enc}(
a_i[S_i])))`. The residual keeps :math:`a_i - \mathrm{dec}(\mathrm{enc}(
a_i))` on the sent entries (rounding is fed back like the entries not sent)
and :math:`a_i` elsewhere.

Payload per replica and leaf: the kept values (``values``: float32, bfloat16,
or int8 with a 4-byte scale) and their indices: ``"int32"`` (4 bytes, one
top-k per leaf) or ``"compact"``: the leaf is cut into blocks of at most
:data:`BLOCK` = 65,536 entries with a top-k in each, and an index is then
block-local (``uint16``, 2 bytes) or the block's bitmap is sent (``ceil(b /
8)`` bytes), whichever is smaller (the bitmap wins above a kept fraction of
1/16). All parts of all leaves are bit-cast to bytes and packed into one
``uint8`` buffer: one all-gather per step whose size is exactly the payload.

References:
  Lin, Han, Mao, Wang, Dally. Deep Gradient Compression: Reducing the
  Communication Bandwidth for Distributed Training. ICLR 2018.
  https://arxiv.org/abs/1712.01887
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from grpo_optax.training.compressors import base
from grpo_optax.training.compressors import payload as pl

#: Entries per block of the ``"compact"`` indices (``uint16`` addresses).
BLOCK = 65536

INDICES = base.Option(
  "indices",
  "int32",
  "choice",
  choices=("int32", "compact"),
  help="indices of the all_gather payload: int32, or compact (blocks of "
  "65,536 entries, uint16 offsets or a bitmap, whichever is smaller)",
)


class Layout:
  """Static layout of one leaf's all-gather payload.

  Attributes:
    size: entries of the leaf.
    block: entries per block.
    blocks: blocks per leaf.
    kept: entries kept per block.
    index: ``"int32"``, ``"uint16"`` or ``"bitmap"``.
    value_bytes: bytes of the kept values.
    index_bytes: bytes of their indices.
    nbytes: the payload's bytes in all.
  """

  def __init__(self, size: int, fraction: float, values: str, indices: str):
    self.size = size
    self.block = min(size, BLOCK) if indices == "compact" else size
    self.blocks = -(-size // self.block)
    self.kept = pl.num_kept(self.block, fraction)  # Per block.
    count = self.blocks * self.kept
    self.value_bytes = pl.value_bytes(count, values)
    if indices == "int32":
      self.index, self.index_bytes = "int32", 4 * count
    else:
      bitmap = self.blocks * (-(-self.block // 8))
      self.index = "bitmap" if bitmap < 2 * count else "uint16"
      self.index_bytes = min(bitmap, 2 * count)
    self.nbytes = self.value_bytes + self.index_bytes


def _encode_indices(idx: jax.Array, layout: Layout) -> jax.Array:
  """Bytes of the sorted kept indices ``idx`` ``(blocks, kept)``."""
  if layout.index == "int32":
    return pl.to_bytes(idx.astype(jnp.int32))
  if layout.index == "uint16":
    return pl.to_bytes(idx.astype(jnp.uint16))
  rows = jnp.arange(layout.blocks)[:, None]
  bits = (
    jnp.zeros((layout.blocks, layout.block), jnp.bool_).at[rows, idx].set(True)
  )
  return jnp.packbits(bits, axis=1).reshape(-1)


def _decode_indices(b: jax.Array, layout: Layout) -> jax.Array:
  """Kept indices ``(W, blocks, kept)`` from the gathered bytes ``(W, .)``."""
  w = b.shape[0]
  if layout.index == "int32":
    out = pl.from_bytes(b, jnp.int32)
  elif layout.index == "uint16":
    out = pl.from_bytes(b, jnp.uint16).astype(jnp.int32)
  else:
    bits = jnp.unpackbits(b.reshape(w, layout.blocks, -1), axis=2)[
      ..., : layout.block
    ]
    # The set bits in ascending order: the largest keys block - position.
    key = bits.astype(jnp.int32) * (layout.block - jnp.arange(layout.block))
    out = jnp.sort(jax.lax.top_k(key, layout.kept)[1], axis=-1)
  return out.reshape(w, layout.blocks, layout.kept)


def _select_leaf(x: jax.Array, layout: Layout, values: str):
  """One leaf: ``(bytes, decoded, idx, blocks)`` of the top entries."""
  blocks = jnp.pad(x, (0, layout.blocks * layout.block - x.size)).reshape(
    layout.blocks, layout.block
  )
  _, idx = jax.lax.top_k(jnp.abs(blocks), layout.kept)
  idx = jnp.sort(idx, axis=1)
  parts, decoded = pl.encode_values(jnp.take_along_axis(blocks, idx, 1), values)
  payload = jnp.concatenate(parts + [_encode_indices(idx, layout)])
  return payload, decoded.reshape(idx.shape), idx, blocks


class AllGather(base.Compressor):
  """``exchange="all_gather"``: each replica's top-k, one all-gather."""

  name = "all_gather"
  options = (base.FRACTION, base.VALUES, INDICES)
  fraction: float
  values: str
  indices: str

  def layout(self, size: int) -> Layout:
    """The payload layout of a leaf of ``size`` entries."""
    return Layout(size, self.fraction, self.values, self.indices)

  def compress(self, accs, state, axis_name):
    del state, axis_name
    layouts, wire, kept = [], [], []
    for a in accs:
      if a.size == 0:
        layouts.append(None)
        kept.append(None)
        continue
      layout = self.layout(a.size)
      payload, decoded, idx, blocks = _select_leaf(
        a.reshape(-1).astype(jnp.float32), layout, self.values
      )
      layouts.append(layout)
      wire.append(payload)
      kept.append((decoded, idx, blocks))
    return base.Payload(
      jnp.concatenate(wire) if wire else None, (layouts, kept)
    )

  def collective(self, wire, local, axis_name):
    del local
    if wire is None:
      return None
    return jax.lax.all_gather(wire, axis_name, to="invarying")  # (W, bytes)

  def decompress(self, received, local, accs, state):
    layouts, kept = local
    means, residuals, sent, offset = [], [], [], 0
    for a, layout, k in zip(accs, layouts, kept):
      if layout is None:
        means.append(jnp.zeros(a.shape, a.dtype))
        residuals.append(a)
        sent.append(jnp.zeros(a.shape, bool))
        continue
      mean, offset = self._leaf_mean(received, offset, layout, a)
      means.append(mean)
      decoded, own, blocks = k
      own_rows = jnp.arange(layout.blocks)[:, None]
      unpad = lambda m, a=a: m.reshape(-1)[: a.size].reshape(a.shape)
      residuals.append(
        unpad(blocks.at[own_rows, own].add(-decoded)).astype(a.dtype)
      )
      sent.append(
        unpad(jnp.zeros(blocks.shape, bool).at[own_rows, own].set(True))
      )
    return base.Decompressed(means, residuals, sent, state)

  def _leaf_mean(self, gathered, offset, layout, a):
    w = gathered.shape[0]
    count = layout.blocks * layout.kept
    vb = gathered[:, offset : offset + layout.value_bytes]
    ib = gathered[:, offset + layout.value_bytes : offset + layout.nbytes]
    vals = pl.decode_values(vb, count, self.values).reshape(
      w, layout.blocks, layout.kept
    )
    idx = _decode_indices(ib, layout)
    rows = jnp.arange(layout.blocks)[None, :, None]
    total = (
      jnp.zeros((layout.blocks, layout.block), jnp.float32)
      .at[jnp.broadcast_to(rows, idx.shape), idx]
      .add(vals)
    )
    mean = (total / w).reshape(-1)[: a.size].reshape(a.shape).astype(a.dtype)
    return mean, offset + layout.nbytes

  def payload_bytes(self, shapes, num_replicas):
    del num_replicas
    return sum(self.layout(math.prod(s)).nbytes for s in shapes if math.prod(s))


__all__ = (
  "BLOCK",
  "AllGather",
  "Layout",
)
