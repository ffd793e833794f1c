r"""The same chunks on every replica, exchanged by one all-reduce.

The leaves are cut into :math:`M` chunks of ``chunk_size`` entries (a leaf's
last chunk, or a smaller leaf, zero-padded); the :math:`K = \lceil f M
\rceil` chunks of largest score are chosen over the whole model and their
values summed by one all-reduce (``values`` float32 or bfloat16; a bfloat16
sum rounds, and that rounding is not fed back). Scores:

* ``support="norms"``: :math:`\sum_i \|a_i[c]\|^2`, one all-reduce of
  :math:`M` floats (``1/chunk_size`` of the dense bytes).
* ``support="replicated"``: :math:`\rho_c \tau_c`, where :math:`\tau_c`
  counts the steps chunk :math:`c` has accumulated since it was last sent
  and :math:`\rho_c = \|\bar m[c]\| / \tau_c` is its aggregated update's norm
  per step when it was last sent (:math:`+\infty` before: unexplored chunks
  go first). Both are functions of the aggregated updates only, the same on
  every replica: the choice costs no collective. The state holds
  :math:`(\rho, \tau)`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from grpo_optax.training.compressors import base
from grpo_optax.training.compressors import payload as pl

SUPPORT = base.Option(
  "support",
  "norms",
  "choice",
  choices=("norms", "replicated"),
  help="how shared_support chooses its chunks: norms (all-reduced chunk "
  "norms) or replicated (an estimate from the past aggregated updates, no "
  "collective)",
)


class SupportState(NamedTuple):
  """The replicated support's statistics, per chunk of the model.

  Attributes:
    rate: the aggregated update's norm per step when the chunk was last
      sent (``+inf`` before).
    age: steps the chunk has accumulated since it was last sent.
  """

  rate: jax.Array
  age: jax.Array


def initial_support(sizes: Sequence[int], chunk_size: int) -> SupportState:
  """The replicated support's ``(rate, age)`` for leaves of ``sizes``
  entries: every chunk unexplored.
  """
  m = sum(pl.chunk_rows(list(sizes), chunk_size))
  return SupportState(
    jnp.full((m,), jnp.inf, jnp.float32), jnp.ones((m,), jnp.float32)
  )


class SharedSupport(base.Compressor):
  """``exchange="shared_support"``: top chunks of the model, one psum."""

  name = "shared_support"
  options = (
    base.FRACTION,
    base.CHUNK_SIZE,
    base.VALUES.restrict(("float32", "bfloat16")),
    SUPPORT,
  )
  notes = {"values": "an all-reduce of 8-bit values would overflow"}
  fraction: float
  chunk_size: int
  values: str
  support: str

  def init(self, shapes, seed=0):
    del seed
    if self.support != "replicated":
      return None
    return initial_support([math.prod(s) for s in shapes], self.chunk_size)

  def compress(self, accs, state, axis_name):
    matrix = pl.chunk_matrix(accs, self.chunk_size)
    if matrix is None:
      return base.Payload(None, None)
    if state is None:
      scores = jax.lax.psum(jnp.sum(jnp.square(matrix), axis=1), axis_name)
    else:
      scores = state.rate * state.age
    _, idx = jax.lax.top_k(scores, pl.num_kept(matrix.shape[0], self.fraction))
    wire = matrix[idx]
    if self.values == "bfloat16":
      wire = wire.astype(jnp.bfloat16)
    return base.Payload(wire, (matrix, idx))

  def collective(self, wire, local, axis_name):
    del local
    if wire is None:
      return None
    return pl.replica_mean(wire.astype(jnp.float32), axis_name, self.values)

  def decompress(self, received, local, accs, state):
    if local is None:
      return base.Decompressed(
        [jnp.zeros(a.shape, a.dtype) for a in accs],
        list(accs),
        [jnp.zeros(a.shape, bool) for a in accs],
        state,
      )
    matrix, idx = local
    m = matrix.shape[0]
    decoded = matrix[idx]
    if self.values == "bfloat16":
      decoded = decoded.astype(jnp.bfloat16)
    decoded = decoded.astype(jnp.float32)
    mean = jnp.zeros(matrix.shape, jnp.float32).at[idx].set(received)
    residual = matrix.at[idx].add(-decoded)
    chosen = jnp.zeros((m,), bool).at[idx].set(True)
    sent = jnp.broadcast_to(chosen[:, None], matrix.shape)
    if state is not None:
      norms = jnp.sqrt(jnp.sum(jnp.square(received), axis=1))
      rate = state.rate.at[idx].set(norms / state.age[idx])
      state = SupportState(rate, jnp.where(chosen, 1.0, state.age + 1.0))
    c = self.chunk_size
    return base.Decompressed(
      pl.unchunk(mean, accs, c),
      pl.unchunk(residual, accs, c),
      pl.unchunk(sent, accs, c, dtype_of=False),
      state,
    )

  def payload_bytes(self, shapes, num_replicas):
    del num_replicas
    m = sum(pl.chunk_rows([math.prod(s) for s in shapes], self.chunk_size))
    if not m:
      return 0
    k = pl.num_kept(m, self.fraction)
    values = pl.value_bytes(k * self.chunk_size, self.values)
    return values + (4 * m if self.support == "norms" else 0)


__all__ = (
  "SharedSupport",
  "SupportState",
)
