r"""The int8 exchange: chunks on a shared scale, summed exactly in int8.

The payload of local steps' outer exchange (``--outer-quantize int8``), and a
compressor like any other. Each leaf is cut into chunks of ``chunk_size``
entries; with ``fraction < 1`` only the :math:`\lceil f m \rceil` chunks of
each leaf with the largest all-reduced squared norm are sent (one all-reduce
of a float per chunk), else all of them. Each sent chunk :math:`c` gets the
scale shared by all replicas :math:`s_c = \max_i \max|a_i[c]|` (one
all-reduce of a float per sent chunk), and replica :math:`i` sends

.. math::  q_i = \mathrm{round}(L\, a_i[c] / s_c) \in [-L, L],
  \qquad L = \lfloor 127 / W \rfloor

as int8 (:func:`int8_levels`): the :math:`W` values sum to at most 127 in
magnitude, so the int8 all-reduce is exact (no overflow, no rounding in the
sum). The mean is :math:`\frac{s_c}{L W} \sum_i q_i`; the residual keeps
:math:`a_i - s_c q_i / L` (the rounding error) and the chunks not sent.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from grpo_optax.training import _tree
from grpo_optax.training.compressors import base
from grpo_optax.training.compressors import payload as pl


def int8_levels(num_replicas: int) -> int:
  """Levels ``L = floor(127 / W)`` of the int8 payload: ``W`` replicas'
  values in ``[-L, L]`` sum to at most 127 in magnitude, so the int8
  all-reduce is exact (no overflow, no rounding in the sum).

  Raises:
    ValueError: unless ``num_replicas`` is an int in [1, 127].
  """
  num_replicas = _tree.check_positive_int("num_replicas", num_replicas)
  if num_replicas > 127:
    raise ValueError(
      f"the int8 exchange supports at most 127 replicas, got {num_replicas}."
    )
  return 127 // num_replicas


class Int8(base.Compressor):
  """``exchange="int8"``: int8 chunks on shared scales, one exact psum."""

  name = "int8"
  options = (base.FRACTION, base.CHUNK_SIZE)
  fraction: float
  chunk_size: int

  def check_replicas(self, num_replicas):
    int8_levels(num_replicas)

  def _selects(self, sizes) -> bool:
    """Whether some leaf sends fewer than all its chunks."""
    return any(
      pl.num_kept(m, self.fraction) < m
      for m in (pl.num_chunks(n, self.chunk_size) for n in sizes if n)
    )

  def compress(self, accs, state, axis_name):
    del state
    w = jax.lax.axis_size(axis_name)
    levels = int8_levels(w)
    chunked = [
      None
      if a.size == 0
      else pl.leaf_chunks(a.astype(jnp.float32), self.chunk_size)
      for a in accs
    ]
    live = [c for c in chunked if c is not None]
    if not live:
      return base.Payload(None, (chunked, [], [], None, w))
    picks = [jnp.arange(c.shape[0]) for c in live]
    if self._selects([a.size for a in accs]):
      scores = jax.lax.psum(
        jnp.concatenate([jnp.sum(jnp.square(c), axis=1) for c in live]),
        axis_name,
      )
      picks, offset = [], 0
      for c in live:
        m = c.shape[0]
        _, idx = jax.lax.top_k(
          scores[offset : offset + m], pl.num_kept(m, self.fraction)
        )
        picks.append(idx)
        offset += m
    sel = [c[idx] for c, idx in zip(live, picks)]
    scale = jax.lax.pmax(
      jnp.concatenate([jnp.max(jnp.abs(x), axis=1) for x in sel]), axis_name
    )
    scale = jnp.where(scale > 0, scale, 1.0)
    qs, offset = [], 0
    for x in sel:
      sc = scale[offset : offset + x.shape[0], None]
      offset += x.shape[0]
      qs.append(jnp.clip(jnp.round(x * levels / sc), -levels, levels))
    wire = jnp.concatenate([q.reshape(-1) for q in qs]).astype(jnp.int8)
    return base.Payload(wire, (chunked, picks, qs, scale / levels, w))

  def collective(self, wire, local, axis_name):
    del local
    if wire is None:
      return None
    return jax.lax.psum(wire, axis_name).astype(jnp.float32)

  def decompress(self, received, local, accs, state):
    chunked, picks, qs, scale, w = local
    means, residuals, sent = [], [], []
    offset = soff = j = 0
    for a, c in zip(accs, chunked):
      if c is None:
        means.append(jnp.zeros(a.shape, a.dtype))
        residuals.append(a)
        sent.append(jnp.zeros(a.shape, bool))
        continue
      idx, q = picks[j], qs[j]
      j += 1
      k, width = q.shape
      sc = scale[soff : soff + k, None]
      soff += k
      block = received[offset : offset + k * width].reshape(k, width)
      offset += k * width
      mean = jnp.zeros(c.shape, jnp.float32).at[idx].set(block * sc / w)
      res = c.at[idx].add(-q * sc)
      mask = jnp.zeros(c.shape, bool).at[idx].set(True)
      back = lambda m, a=a: m.reshape(-1)[: a.size].reshape(a.shape)
      means.append(back(mean).astype(a.dtype))
      residuals.append(back(res).astype(a.dtype))
      sent.append(back(mask))
    return base.Decompressed(means, residuals, sent, state)

  def payload_bytes(self, shapes, num_replicas):
    del num_replicas
    sizes = [math.prod(s) for s in shapes if math.prod(s)]
    chunks = [pl.num_chunks(n, self.chunk_size) for n in sizes]
    kept = [pl.num_kept(m, self.fraction) for m in chunks]
    widths = [pl.chunk_width(n, self.chunk_size) for n in sizes]
    values = sum(k * w for k, w in zip(kept, widths))
    norms = 4 * sum(chunks) if self._selects(sizes) else 0
    return values + 4 * sum(kept) + norms


__all__ = ("Int8", "int8_levels")
