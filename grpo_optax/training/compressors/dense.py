r"""The dense exchange: one float32 all-reduce of every entry.

:math:`\bar a = \frac1W \sum_i a_i` exactly; nothing stays behind (the
residual is zero) and every entry counts as sent. Data-parallel training with
it equals single-device training on the global batch.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from grpo_optax.training.compressors import base


class Dense(base.Compressor):
  """``exchange="dense"``: ``pmean`` of every leaf (float32 on the wire)."""

  name = "dense"
  options = ()
  notes = {"values": "the dense exchange sends float32"}
  lossless = True

  def compress(self, accs, state, axis_name):
    del state, axis_name
    return base.Payload(list(accs), None)

  def collective(self, wire, local, axis_name):
    del local
    return jax.lax.pmean(wire, axis_name)

  def decompress(self, received, local, accs, state):
    del local
    return base.Decompressed(
      list(received),
      [jnp.zeros_like(a) for a in accs],
      [jnp.ones(a.shape, bool) for a in accs],
      state,
    )

  def payload_bytes(self, shapes, num_replicas):
    del num_replicas
    return 4 * sum(math.prod(s) for s in shapes)


__all__ = ("Dense",)
