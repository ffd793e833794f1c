"""Compressors of the gradient exchange: payload formats, supports, PowerSGD.

The functions here run inside :func:`jax.shard_map` (``axis_name`` bound) on
lists of per-replica accumulated gradients ``a_i`` (a float leaf each) and
return ``(means, residuals, sent)``: the mean over the replicas of what was
sent (the same on every replica), what stays behind in this replica's
error-feedback residual (``a_i`` minus what the receivers decode of it), and a
boolean mask of the entries sent (None where the compressor sends no entries
as such: PowerSGD). :func:`grpo_optax.training.sparse_pmean` is the entry
point; the traffic law of each payload is in ``docs/communication.md``.

Payloads (``W`` replicas, ``k`` entries kept per replica):

* values ``"float32"`` (4 bytes), ``"bfloat16"`` (2 bytes: the top 16 bits
  of a float32, round to nearest even) or ``"int8"`` (1 byte: ``round(v /
  s)`` with ``s = max|v| / 127`` per leaf and replica, the scale travelling
  beside the values). The residual keeps ``a_i - decode(encode(a_i))`` on the
  sent entries, so rounding is fed back like the entries not sent.
* indices ``"int32"`` (4 bytes, one top-k per leaf) or ``"compact"``: the
  leaf is cut into blocks of at most :data:`BLOCK` = 65,536 entries with a
  top-k in each; an index is then block-local (``uint16``, 2 bytes) or the
  block's bitmap is sent (``ceil(b / 8)`` bytes), whichever is smaller
  (the bitmap wins above a kept fraction of 1/16).

All the per-replica parts of the all-gather are bit-cast to bytes and packed
into one ``uint8`` buffer: one collective per step, whose size is exactly the
payload.

References:
  Lin, Han, Mao, Wang, Dally. Deep Gradient Compression: Reducing the
  Communication Bandwidth for Distributed Training. ICLR 2018.
  https://arxiv.org/abs/1712.01887

  Vogels, Karimireddy, Jaggi. PowerSGD: Practical Low-Rank Gradient
  Compression for Distributed Optimization. NeurIPS 2019.
  https://arxiv.org/abs/1905.13727

  Karimireddy, Rebjock, Stich, Jaggi. Error Feedback Fixes SignSGD and other
  Gradient Compression Schemes. ICML 2019. https://arxiv.org/abs/1901.09847
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

__all__ = (
  "BLOCK",
  "INDEX_FORMATS",
  "SUPPORTS",
  "VALUE_FORMATS",
  "all_gather_mean",
  "init_powersgd",
  "init_support",
  "num_kept",
  "powersgd_mean",
  "powersgd_shape",
  "replica_mean",
  "shared_support_mean",
  "value_bytes",
  "warmup_fractions",
)

#: Value formats of the payloads.
VALUE_FORMATS = ("float32", "bfloat16", "int8")
#: Index formats of the all-gather.
INDEX_FORMATS = ("int32", "compact")
#: How the shared support is chosen: all-reduced chunk norms, or a replicated
#: estimate of each chunk's accumulated residual (no collective).
SUPPORTS = ("norms", "replicated")
#: Entries per block of the ``"compact"`` indices (``uint16`` addresses).
BLOCK = 65536

_VALUE_BYTES = {"float32": 4, "bfloat16": 2, "int8": 1}


def num_kept(size: int, fraction: float) -> int:
  """``ceil(fraction * size)`` entries kept (at least 1; 0 if empty)."""
  if not size:
    return 0
  return min(size, max(1, math.ceil(fraction * size - 1e-9)))


def warmup_fractions(fraction: float) -> tuple[float, ...]:
  r"""The kept fractions of Deep Gradient Compression's sparsity warm-up.

  :math:`f_s = 4^{-(s+1)}` while it exceeds ``fraction``, then ``fraction``:
  for ``fraction = 0.001``, densities 25%, 6.25%, 1.5625%, 0.39%, 0.1%
  (sparsity 75% -> 93.75% -> 98.4375% -> 99.6% -> 99.9%, the paper's
  schedule over its first four epochs).
  """
  out, d = [], 0.25
  while d > fraction:
    out.append(d)
    d /= 4
  return tuple(out) + (fraction,)


# -- bytes --------------------------------------------------------------------


def _to_bytes(x: jax.Array) -> jax.Array:
  """The bits of ``x`` as a flat ``uint8`` vector."""
  x = x.reshape(-1)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint8)
  return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


def _from_bytes(b: jax.Array, dtype: Any) -> jax.Array:
  """Inverse of :func:`_to_bytes` along the last axis of ``b``."""
  size = jnp.dtype(dtype).itemsize
  if size == 1:
    return jax.lax.bitcast_convert_type(b, dtype)
  return jax.lax.bitcast_convert_type(
    b.reshape(b.shape[:-1] + (b.shape[-1] // size, size)), dtype
  )


def _encode_values(v: jax.Array, values: str):
  """``(parts, decoded)``: byte parts of ``v``'s payload and what it decodes
  to (float32), for one replica's kept values of one leaf.
  """
  v = v.astype(jnp.float32)
  if values == "float32":
    return [_to_bytes(v)], v
  if values == "bfloat16":
    q = v.astype(jnp.bfloat16)
    return [_to_bytes(q)], q.astype(jnp.float32)
  scale = jnp.max(jnp.abs(v)) / 127.0
  safe = jnp.where(scale > 0, scale, 1.0)
  q = jnp.clip(jnp.round(v / safe), -127, 127).astype(jnp.int8)
  return [_to_bytes(scale), _to_bytes(q)], q.astype(jnp.float32) * scale


def _decode_values(b: jax.Array, count: int, values: str) -> jax.Array:
  """Values (float32, ``(W, count)``) from the gathered bytes ``(W, .)``."""
  if values == "float32":
    return _from_bytes(b, jnp.float32)
  if values == "bfloat16":
    return _from_bytes(b, jnp.bfloat16).astype(jnp.float32)
  scale = _from_bytes(b[:, :4], jnp.float32)  # (W, 1)
  q = _from_bytes(b[:, 4 : 4 + count], jnp.int8).astype(jnp.float32)
  return q * scale


def value_bytes(count: int, values: str) -> int:
  """Bytes of ``count`` values in format ``values`` (int8: + a 4-byte scale)."""
  return count * _VALUE_BYTES[values] + (4 if values == "int8" and count else 0)


# -- all-gather ---------------------------------------------------------------


class _Layout:
  """Static layout of one leaf's all-gather payload."""

  def __init__(self, size: int, fraction: float, values: str, indices: str):
    self.size = size
    self.block = min(size, BLOCK) if indices == "compact" else size
    self.blocks = -(-size // self.block)
    self.kept = num_kept(self.block, fraction)  # Per block.
    count = self.blocks * self.kept
    self.value_bytes = value_bytes(count, values)
    if indices == "int32":
      self.index, self.index_bytes = "int32", 4 * count
    else:
      bitmap = self.blocks * (-(-self.block // 8))
      self.index = "bitmap" if bitmap < 2 * count else "uint16"
      self.index_bytes = min(bitmap, 2 * count)
    self.nbytes = self.value_bytes + self.index_bytes


def _encode_indices(idx: jax.Array, layout: _Layout) -> jax.Array:
  """Bytes of the sorted kept indices ``idx`` ``(blocks, kept)``."""
  if layout.index == "int32":
    return _to_bytes(idx.astype(jnp.int32))
  if layout.index == "uint16":
    return _to_bytes(idx.astype(jnp.uint16))
  rows = jnp.arange(layout.blocks)[:, None]
  bits = (
    jnp.zeros((layout.blocks, layout.block), jnp.bool_).at[rows, idx].set(True)
  )
  return jnp.packbits(bits, axis=1).reshape(-1)


def _decode_indices(b: jax.Array, layout: _Layout) -> jax.Array:
  """Kept indices ``(W, blocks, kept)`` from the gathered bytes ``(W, .)``."""
  w = b.shape[0]
  if layout.index == "int32":
    out = _from_bytes(b, jnp.int32)
  elif layout.index == "uint16":
    out = _from_bytes(b, jnp.uint16).astype(jnp.int32)
  else:
    bits = jnp.unpackbits(b.reshape(w, layout.blocks, -1), axis=2)[
      ..., : layout.block
    ]
    # The set bits in ascending order: the largest keys block - position.
    key = bits.astype(jnp.int32) * (layout.block - jnp.arange(layout.block))
    out = jnp.sort(jax.lax.top_k(key, layout.kept)[1], axis=-1)
  return out.reshape(w, layout.blocks, layout.kept)


def _select_leaf(x: jax.Array, layout: _Layout, values: str):
  """One leaf: ``(bytes, decoded, idx, blocks)`` of the top entries."""
  blocks = jnp.pad(x, (0, layout.blocks * layout.block - x.size)).reshape(
    layout.blocks, layout.block
  )
  _, idx = jax.lax.top_k(jnp.abs(blocks), layout.kept)
  idx = jnp.sort(idx, axis=1)
  parts, decoded = _encode_values(jnp.take_along_axis(blocks, idx, 1), values)
  payload = jnp.concatenate(parts + [_encode_indices(idx, layout)])
  return payload, decoded.reshape(idx.shape), idx, blocks


def all_gather_mean(
  accs: Sequence[jax.Array],
  axis_name: Any,
  fraction: float,
  values: str = "float32",
  indices: str = "int32",
):
  r"""Per-replica top-k, one all-gather of the packed bytes, scatter-add.

  Per leaf (or per block of a leaf with ``indices="compact"``) each replica
  keeps its ``k`` entries of largest :math:`|a_i|`; the mean is
  :math:`\frac1W \sum_i \mathrm{scatter}(S_i, \mathrm{dec}(\mathrm{enc}(
  a_i[S_i])))`.

  Returns:
    ``(means, residuals, sent)`` lists (see the module docstring).
  """
  layouts, payloads, kept = [], [], []
  for a in accs:
    if a.size == 0:
      layouts.append(None)
      kept.append(None)
      continue
    layout = _Layout(a.size, fraction, values, indices)
    payload, decoded, idx, blocks = _select_leaf(
      a.reshape(-1).astype(jnp.float32), layout, values
    )
    layouts.append(layout)
    payloads.append(payload)
    kept.append((decoded, idx, blocks))
  if not payloads:
    return (
      [jnp.zeros(a.shape, a.dtype) for a in accs],
      list(accs),
      [jnp.zeros(a.shape, bool) for a in accs],
    )
  gathered = jax.lax.all_gather(
    jnp.concatenate(payloads), axis_name, to="invarying"
  )  # (W, bytes): one op.
  w = gathered.shape[0]
  means, residuals, sent, offset = [], [], [], 0
  for a, layout, k in zip(accs, layouts, kept):
    if layout is None:
      means.append(jnp.zeros(a.shape, a.dtype))
      residuals.append(a)
      sent.append(jnp.zeros(a.shape, bool))
      continue
    count = layout.blocks * layout.kept
    vb = gathered[:, offset : offset + layout.value_bytes]
    ib = gathered[:, offset + layout.value_bytes : offset + layout.nbytes]
    offset += layout.nbytes
    vals = _decode_values(vb, count, values).reshape(
      w, layout.blocks, layout.kept
    )
    idx = _decode_indices(ib, layout)
    rows = jnp.arange(layout.blocks)[None, :, None]
    total = (
      jnp.zeros((layout.blocks, layout.block), jnp.float32)
      .at[jnp.broadcast_to(rows, idx.shape), idx]
      .add(vals)
    )
    unpad = lambda m, a=a: m.reshape(-1)[: a.size].reshape(a.shape)
    means.append(unpad(total / w).astype(a.dtype))
    decoded, own, blocks = k
    own_rows = jnp.arange(layout.blocks)[:, None]
    residuals.append(
      unpad(blocks.at[own_rows, own].add(-decoded)).astype(a.dtype)
    )
    sent.append(
      unpad(jnp.zeros(blocks.shape, bool).at[own_rows, own].set(True))
    )
  return means, residuals, sent


# -- the mean of a float payload ------------------------------------------------


def replica_mean(x: jax.Array, axis_name: Any, values: str) -> jax.Array:
  r"""Mean over the replicas of ``x`` (float32), sent as ``values``.

  ``"float32"``: one all-reduce. ``"bfloat16"``: the two halves of a ring
  all-reduce written out, so that only bfloat16 travels and the sum is
  accumulated in float32: an all-to-all gives each replica its ``1/W``
  share of everyone's bfloat16 values, which it sums in float32, and an
  all-gather of the rounded bfloat16 shares returns the mean to everyone;
  ``2 (W-1)/W`` of the bfloat16 bytes per device, as for a ring all-reduce.
  (XLA's CPU backend widens a bfloat16 ``psum`` to float32, and moves a
  float convert across a collective: the bfloat16 bits travel as uint16.)
  The one rounding of the mean to bfloat16 is not fed back.
  """
  w = jax.lax.axis_size(axis_name)
  if values == "float32" or w == 1:
    out = jax.lax.psum(
      x.astype(jnp.bfloat16 if values == "bfloat16" else jnp.float32), axis_name
    )
    return out.astype(jnp.float32) / w
  shape, n = x.shape, x.size
  x = jnp.pad(x.reshape(-1), (0, -n % w))
  # Bit-cast to uint16 on the wire: XLA would move a float convert across
  # the collective and send float32.
  bits = lambda v: jax.lax.bitcast_convert_type(
    v.astype(jnp.bfloat16), jnp.uint16
  )
  unbits = lambda v: jax.lax.bitcast_convert_type(v, jnp.bfloat16).astype(
    jnp.float32
  )
  got = jax.lax.all_to_all(bits(x).reshape(w, -1), axis_name, 0, 0)
  mine = jnp.sum(unbits(got), axis=0) / w  # Row j: from j.
  full = jax.lax.all_gather(
    bits(mine), axis_name, axis=0, tiled=True, to="invarying"
  )
  return unbits(full)[:n].reshape(shape)


# -- shared support -----------------------------------------------------------


def chunk_rows(sizes: Sequence[int], chunk_size: int) -> list[int]:
  """Chunks of ``chunk_size`` entries per leaf (a smaller leaf is one chunk)."""
  return [-(-n // chunk_size) if n else 0 for n in sizes]


def _chunk_matrix(accs, chunk_size):
  """All leaves as rows of ``chunk_size`` entries (each leaf zero-padded)."""
  rows = []
  for a, m in zip(accs, chunk_rows([a.size for a in accs], chunk_size)):
    if m:
      rows.append(
        jnp.pad(
          a.reshape(-1).astype(jnp.float32), (0, m * chunk_size - a.size)
        ).reshape(m, chunk_size)
      )
  return jnp.concatenate(rows) if rows else None


def _unchunk(matrix, accs, chunk_size, dtype_of=True):
  out, offset = [], 0
  for a, m in zip(accs, chunk_rows([a.size for a in accs], chunk_size)):
    leaf = matrix[offset : offset + m].reshape(-1)[: a.size].reshape(a.shape)
    out.append(leaf.astype(a.dtype) if dtype_of else leaf)
    offset += m
  return out


def init_support(sizes: Sequence[int], chunk_size: int):
  """``(rate, age)`` of the replicated support: every chunk unexplored."""
  m = sum(chunk_rows(sizes, chunk_size))
  return (jnp.full((m,), jnp.inf, jnp.float32), jnp.ones((m,), jnp.float32))


def shared_support_mean(
  accs: Sequence[jax.Array],
  axis_name: Any,
  fraction: float,
  chunk_size: int,
  values: str = "float32",
  support=None,
):
  r"""The same chunks on every replica, exchanged by one all-reduce.

  The leaves are cut into :math:`M` chunks of ``chunk_size`` entries (a
  leaf's last chunk, or a smaller leaf, zero-padded); the
  :math:`K = \lceil f M \rceil` chunks of largest score are chosen over the
  whole model and their values summed by one ``psum`` (``values`` float32 or
  bfloat16; a bfloat16 sum rounds, and that rounding is not fed back).
  Scores:

  * ``support=None`` (``"norms"``): :math:`\sum_i \|a_i[c]\|^2`, one
    all-reduce of :math:`M` floats (``1/chunk_size`` of the dense bytes).
  * ``support=(rate, age)`` (``"replicated"``): :math:`\rho_c \tau_c`, where
    :math:`\tau_c` counts the steps chunk :math:`c` has accumulated since it
    was last sent and :math:`\rho_c = \|\bar m[c]\| / \tau_c` is its
    aggregated update's norm per step when it was last sent (:math:`+\infty`
    before: unexplored chunks go first). Both are functions of the
    aggregated updates only, the same on every replica: no collective.

  Returns:
    ``(means, residuals, sent, support)``, ``support`` the new ``(rate,
    age)`` (None for ``"norms"``).
  """
  if values not in ("float32", "bfloat16"):
    raise ValueError(
      "`values` of the shared support must be 'float32' or "
      f"'bfloat16' (an all-reduce sums them), got {values!r}."
    )
  matrix = _chunk_matrix(accs, chunk_size)
  if matrix is None:
    return (
      [jnp.zeros(a.shape, a.dtype) for a in accs],
      list(accs),
      [jnp.zeros(a.shape, bool) for a in accs],
      support,
    )
  m = matrix.shape[0]
  kc = num_kept(m, fraction)
  if support is None:
    scores = jax.lax.psum(jnp.sum(jnp.square(matrix), axis=1), axis_name)
  else:
    rate, age = support
    scores = rate * age
  _, idx = jax.lax.top_k(scores, kc)
  payload = matrix[idx]
  if values == "bfloat16":
    payload = payload.astype(jnp.bfloat16)
  summed = replica_mean(payload.astype(jnp.float32), axis_name, values)
  decoded = payload.astype(jnp.float32)
  mean = jnp.zeros(matrix.shape, jnp.float32).at[idx].set(summed)
  residual = matrix.at[idx].add(-decoded)
  chosen = jnp.zeros((m,), bool).at[idx].set(True)
  sent = jnp.broadcast_to(chosen[:, None], matrix.shape)
  if support is not None:
    norms = jnp.sqrt(jnp.sum(jnp.square(summed), axis=1))
    rate = rate.at[idx].set(norms / age[idx])
    age = jnp.where(chosen, 1.0, age + 1.0)
    support = (rate, age)
  return (
    _unchunk(mean, accs, chunk_size),
    _unchunk(residual, accs, chunk_size),
    _unchunk(sent, accs, chunk_size, dtype_of=False),
    support,
  )


# -- PowerSGD -----------------------------------------------------------------


def powersgd_shape(shape: Sequence[int], rank: int):
  r"""``(n, m, r)`` of a leaf's matrix view, or None (the leaf is sent dense).

  A leaf of shape ``(..., m)`` is viewed as :math:`n \times m` with
  :math:`n` the product of its other dimensions, and compressed at rank
  :math:`r = \min(\mathrm{rank}, n, m)` only when its factors are smaller
  than the leaf, :math:`(n + m) r < n m`: ``P`` (:math:`n r` entries) and
  ``Q`` (:math:`m r`) are what PowerSGD sends in its place. Otherwise (and
  for leaves of fewer than 2 dimensions, or empty ones) the leaf is averaged
  densely, as torch's PowerSGD communication hook does for tensors below its
  ``min_compression_rate`` (here a rate of 1: any saving compresses). A
  ``(2, 3)`` leaf at rank 2 thus sends its 6 entries, not 4 + 6 = 10.
  """
  if len(shape) < 2 or not math.prod(shape):
    return None
  n, m = math.prod(shape[:-1]), shape[-1]
  r = min(rank, n, m)
  if (n + m) * r >= n * m:
    return None
  return n, m, r


def init_powersgd(shapes: Sequence[Sequence[int]], rank: int, seed: int = 0):
  """PowerSGD's initial ``Q`` per leaf (``(m, r)`` standard normal, the same
  on every replica), None for the leaves exchanged densely
  (:func:`powersgd_shape`). Every later step warm-starts from the last
  ``Q`` (kept in :class:`~grpo_optax.training.ExchangeState`).
  """
  key = jax.random.key(seed)
  out = []
  for i, shape in enumerate(shapes):
    s = powersgd_shape(shape, rank)
    out.append(
      None
      if s is None
      else jax.random.normal(
        jax.random.fold_in(key, i), (s[1], s[2]), jnp.float32
      )
    )
  return out


def _psum_packed(parts: list[jax.Array], axis_name, values: str):
  """Mean over replicas of the concatenated flat ``parts``, one all-reduce."""
  sizes = [p.size for p in parts]
  flat = replica_mean(
    jnp.concatenate([p.reshape(-1) for p in parts]), axis_name, values
  )
  out, offset = [], 0
  for p, n in zip(parts, sizes):
    out.append(flat[offset : offset + n].reshape(p.shape))
    offset += n
  return out


def powersgd_mean(
  accs: Sequence[jax.Array],
  axis_name: Any,
  rank: int,
  qs: Sequence[Any],
  values: str = "float32",
):
  r"""Rank-``r`` PowerSGD: one power iteration per step, warm-started.

  Each leaf with a ``Q`` (at least 2 dimensions, and factors smaller than
  the leaf: :func:`powersgd_shape`) is viewed as :math:`M_i \in
  \mathbb{R}^{n \times m}` (the last axis as columns); with the replicated
  :math:`Q \in \mathbb{R}^{m \times r}`:

  .. math::

    P = \tfrac1W \textstyle\sum_i M_i Q,\quad \hat P = \mathrm{orth}(P),
    \quad Q' = \tfrac1W \textstyle\sum_i M_i^\top \hat P,\quad
    \mathrm{mean} = \hat P Q'^\top,\quad r_i \leftarrow M_i - \hat P
    Q'^\top,

  and :math:`Q'` warm-starts the next step. Two all-reduces (the ``P``'s
  of all leaves with the dense leaves, those without a ``Q``, then the
  ``Q``'s). A dense leaf's mean is exact and leaves no residual (beyond
  bfloat16 rounding).

  Returns:
    ``(means, residuals, new_qs)``.
  """
  if values not in ("float32", "bfloat16"):
    raise ValueError(
      "`values` of PowerSGD must be 'float32' or 'bfloat16' "
      f"(an all-reduce sums them), got {values!r}."
    )
  mats, dense = [], []
  for a, q in zip(accs, qs):
    if q is None:
      dense.append(a.astype(jnp.float32))
    else:
      mats.append(a.reshape(-1, a.shape[-1]).astype(jnp.float32))
  ps = [mat @ q for mat, q in zip(mats, [q for q in qs if q is not None])]
  reduced = _psum_packed(ps + dense, axis_name, values) if ps + dense else []
  ps, dense = reduced[: len(ps)], reduced[len(ps) :]
  ps = [jnp.linalg.qr(p)[0] for p in ps]
  new = (
    _psum_packed([mat.T @ p for mat, p in zip(mats, ps)], axis_name, values)
    if ps
    else []
  )
  means, residuals, new_qs = [], [], []
  j = d = 0
  for a, q in zip(accs, qs):
    if q is None:
      means.append(dense[d].astype(a.dtype))
      own = a.astype(jnp.bfloat16) if values == "bfloat16" else a
      residuals.append((a - own.astype(a.dtype)).astype(a.dtype))
      new_qs.append(None)
      d += 1
      continue
    approx = ps[j] @ new[j].T
    means.append(approx.reshape(a.shape).astype(a.dtype))
    residuals.append((a - approx.reshape(a.shape)).astype(a.dtype))
    new_qs.append(new[j])
    j += 1
  return means, residuals, new_qs
