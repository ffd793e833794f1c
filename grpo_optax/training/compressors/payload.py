"""Payload helpers shared by the compressors: bytes, value formats, chunks.

* Bytes: any array bit-cast to a flat ``uint8`` vector and back, so that the
  parts of a payload (values, scales, indices) travel in one buffer.
* Values ``"float32"`` (4 bytes), ``"bfloat16"`` (2 bytes: the top 16 bits of
  a float32, round to nearest even) or ``"int8"`` (1 byte: ``round(v / s)``
  with ``s = max|v| / 127``, the 4-byte scale travelling beside).
* :func:`replica_mean`: the mean over the replicas of a summable payload,
  sent as float32 or bfloat16.
* Chunks: leaves cut into rows of ``chunk_size`` entries (the shared support,
  the int8 payload).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

_VALUE_BYTES = {"float32": 4, "bfloat16": 2, "int8": 1}


def num_kept(size: int, fraction: float) -> int:
  """``ceil(fraction * size)`` entries kept (at least 1; 0 if empty)."""
  if not size:
    return 0
  return min(size, max(1, math.ceil(fraction * size - 1e-9)))


# -- bytes ----------------------------------------------------------------------


def to_bytes(x: jax.Array) -> jax.Array:
  """The bits of ``x`` as a flat ``uint8`` vector."""
  x = x.reshape(-1)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint8)
  return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


def from_bytes(b: jax.Array, dtype: Any) -> jax.Array:
  """Inverse of :func:`to_bytes` along the last axis of ``b``."""
  size = jnp.dtype(dtype).itemsize
  if size == 1:
    return jax.lax.bitcast_convert_type(b, dtype)
  return jax.lax.bitcast_convert_type(
    b.reshape(b.shape[:-1] + (b.shape[-1] // size, size)), dtype
  )


# -- value formats ----------------------------------------------------------------


def encode_values(v: jax.Array, values: str):
  """``(parts, decoded)``: byte parts of ``v``'s payload and what it decodes
  to (float32), for one replica's kept values of one leaf.
  """
  v = v.astype(jnp.float32)
  if values == "float32":
    return [to_bytes(v)], v
  if values == "bfloat16":
    q = v.astype(jnp.bfloat16)
    return [to_bytes(q)], q.astype(jnp.float32)
  scale = jnp.max(jnp.abs(v)) / 127.0
  safe = jnp.where(scale > 0, scale, 1.0)
  q = jnp.clip(jnp.round(v / safe), -127, 127).astype(jnp.int8)
  return [to_bytes(scale), to_bytes(q)], q.astype(jnp.float32) * scale


def decode_values(b: jax.Array, count: int, values: str) -> jax.Array:
  """Values (float32, ``(W, count)``) from the gathered bytes ``(W, .)``."""
  if values == "float32":
    return from_bytes(b, jnp.float32)
  if values == "bfloat16":
    return from_bytes(b, jnp.bfloat16).astype(jnp.float32)
  scale = from_bytes(b[:, :4], jnp.float32)  # (W, 1)
  q = from_bytes(b[:, 4 : 4 + count], jnp.int8).astype(jnp.float32)
  return q * scale


def value_bytes(count: int, values: str) -> int:
  """Bytes of ``count`` values in format ``values`` (int8: + a 4-byte scale)."""
  return count * _VALUE_BYTES[values] + (4 if values == "int8" and count else 0)


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


def psum_packed(parts: list[jax.Array], axis_name: Any, values: str):
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


# -- chunks -----------------------------------------------------------------------


def chunk_width(size: int, chunk_size: int) -> int:
  """Entries per chunk of a leaf: ``chunk_size``, or the whole (smaller) leaf."""
  return max(1, min(chunk_size, size))


def num_chunks(size: int, chunk_size: int) -> int:
  """Chunks of :func:`chunk_width` entries covering a leaf of ``size``."""
  return -(-size // chunk_width(size, chunk_size))


def chunk_rows(sizes: Sequence[int], chunk_size: int) -> list[int]:
  """Chunks of ``chunk_size`` entries per leaf (a smaller leaf is one chunk)."""
  return [-(-n // chunk_size) if n else 0 for n in sizes]


def chunk_matrix(accs: Sequence[jax.Array], chunk_size: int):
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


def unchunk(matrix, accs, chunk_size, dtype_of=True):
  """The leaves of ``accs``' shapes from the rows of :func:`chunk_matrix`."""
  out, offset = [], 0
  for a, m in zip(accs, chunk_rows([a.size for a in accs], chunk_size)):
    leaf = matrix[offset : offset + m].reshape(-1)[: a.size].reshape(a.shape)
    out.append(leaf.astype(a.dtype) if dtype_of else leaf)
    offset += m
  return out


def leaf_chunks(a: jax.Array, chunk_size: int) -> jax.Array:
  """One leaf as ``(num_chunks, chunk_width)`` rows (zero-padded)."""
  n = a.size
  m = num_chunks(n, chunk_size)
  width = chunk_width(n, chunk_size)
  c = a.reshape(-1)
  if m * width != n:
    c = jnp.pad(c, (0, m * width - n))
  return c.reshape(m, width)


# The helpers the compressors share stay unexported; these three are public
# as grpo_optax.training.compression's.
__all__ = (
  "num_kept",
  "replica_mean",
  "value_bytes",
)
