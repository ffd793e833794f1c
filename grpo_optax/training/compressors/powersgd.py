r"""Rank-``r`` PowerSGD: one power iteration per step, warm-started ``Q``.

Each leaf with a ``Q`` (at least 2 dimensions, and factors smaller than the
leaf: :func:`powersgd_shape`) is viewed as :math:`M_i \in \mathbb{R}^{n
\times m}` (the last axis as columns); with the replicated :math:`Q \in
\mathbb{R}^{m \times r}`:

.. math::

  P = \tfrac1W \textstyle\sum_i M_i Q,\quad \hat P = \mathrm{orth}(P),
  \quad Q' = \tfrac1W \textstyle\sum_i M_i^\top \hat P,\quad
  \mathrm{mean} = \hat P Q'^\top,\quad r_i \leftarrow M_i - \hat P Q'^\top,

and :math:`Q'` warm-starts the next step (the compressor's state: ``Q`` is
never cold-started). The collective is two all-reduces, since the second
message depends on the first: the ``P``'s of all leaves with the leaves
averaged densely (those without a ``Q``), then the ``Q``'s. A dense leaf's
mean is exact and leaves no residual (beyond bfloat16 rounding).

References:
  Vogels, Karimireddy, Jaggi. PowerSGD: Practical Low-Rank Gradient
  Compression for Distributed Optimization. NeurIPS 2019.
  https://arxiv.org/abs/1905.13727
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from grpo_optax.training.compressors import base
from grpo_optax.training.compressors import payload as pl

RANK = base.Option(
  "rank", 1, "int", low=1, help="rank of the powersgd exchange"
)


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
  (:func:`powersgd_shape`).
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


class PowerSGDState(NamedTuple):
  """PowerSGD's state, the same on every replica.

  Attributes:
    q: the warm-start ``Q`` per leaf, ``(m, r)`` float32 (None for a leaf
      exchanged densely).
  """

  q: list


class PowerSGD(base.Compressor):
  """``exchange="powersgd"``: rank-``rank`` factors, two all-reduces."""

  name = "powersgd"
  options = (RANK, base.VALUES.restrict(("float32", "bfloat16")))
  notes = {"values": "an all-reduce of 8-bit values would overflow"}
  rank: int
  values: str

  def init(self, shapes, seed=0):
    return PowerSGDState(init_powersgd(shapes, self.rank, seed))

  def compress(self, accs, state, axis_name):
    del axis_name
    mats, dense = [], []
    for a, q in zip(accs, state.q):
      if q is None:
        dense.append(a.astype(jnp.float32))
      else:
        mats.append(a.reshape(-1, a.shape[-1]).astype(jnp.float32))
    qs = [q for q in state.q if q is not None]
    ps = [mat @ q for mat, q in zip(mats, qs)]
    return base.Payload((ps, dense), mats)

  def collective(self, wire, local, axis_name):
    ps, dense = wire
    mats = local
    reduced = (
      pl.psum_packed(ps + dense, axis_name, self.values) if ps or dense else []
    )
    ps, dense = reduced[: len(ps)], reduced[len(ps) :]
    ps = [jnp.linalg.qr(p)[0] for p in ps]
    new = (
      pl.psum_packed(
        [mat.T @ p for mat, p in zip(mats, ps)], axis_name, self.values
      )
      if ps
      else []
    )
    return ps, new, dense

  def decompress(self, received, local, accs, state):
    del local
    ps, new, dense = received
    means, residuals, new_qs = [], [], []
    j = d = 0
    for a, q in zip(accs, state.q):
      if q is None:
        means.append(dense[d].astype(a.dtype))
        own = a.astype(jnp.bfloat16) if self.values == "bfloat16" else a
        residuals.append((a - own.astype(a.dtype)).astype(a.dtype))
        new_qs.append(None)
        d += 1
        continue
      approx = ps[j] @ new[j].T
      means.append(approx.reshape(a.shape).astype(a.dtype))
      residuals.append((a - approx.reshape(a.shape)).astype(a.dtype))
      new_qs.append(new[j])
      j += 1
    return base.Decompressed(means, residuals, None, PowerSGDState(new_qs))

  def payload_bytes(self, shapes, num_replicas):
    del num_replicas
    floats = 0
    for shape in shapes:
      s = powersgd_shape(shape, self.rank)
      floats += math.prod(shape) if s is None else s[2] * (s[0] + s[1])
    return pl.value_bytes(floats, self.values)


__all__ = (
  "PowerSGD",
  "PowerSGDState",
  "init_powersgd",
  "powersgd_shape",
)
