"""Placing values on a mesh for the data-parallel steps (sharding placement).

* :func:`to_global`: NumPy values (the same on every process) or
  ``jax.Array`` values as global arrays with a given sharding; each process
  supplies the shards of its own devices.
* :func:`own`: the same, in buffers the caller does not hold (a donated step
  deletes its inputs' buffers).
* :func:`constrain`: a layout constraint inside a jitted program (a reshard
  on an Explicit mesh).
* :func:`param_sharding`: where a data-parallel step keeps a parameter leaf
  (replicated, or sharded over the dense axis within a node: FSDP).
* :func:`split_leading`: a global batch split along its leading axis.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding


def to_global(x: Any, sharding: NamedSharding) -> Any:
  """``x`` as a global ``jax.Array`` with ``sharding``.

  NumPy (or host) values must hold the whole global value, the same on every
  process; each process supplies the shards of its own devices. Typed PRNG
  keys keep their implementation. ``jax.ShapeDtypeStruct`` values get the
  sharding (for lowering).
  """
  if isinstance(x, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  if isinstance(x, jax.Array):
    if x.sharding == sharding:
      return x
    # An equivalent sharding (the same devices and shards, e.g. one device's
    # SingleDeviceSharding on a 1-device mesh) is still put: on an Explicit
    # mesh the spec is part of the array's type, and shard_map checks it.
    if (
      jax.process_count() == 1
      or not x.is_fully_addressable
      or x.sharding.is_equivalent_to(sharding, x.ndim)
    ):
      return jax.device_put(x, sharding)
  if jax.process_count() == 1:
    return jax.device_put(x, sharding)
  dtype = getattr(x, "dtype", None)
  if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
    return jax.random.wrap_key_data(
      to_global(jax.random.key_data(x), sharding), impl=jax.random.key_impl(x)
    )
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def own(given: Any, shardings: Any, donate: bool) -> Any:
  """``given`` placed with ``shardings``, in buffers the caller does not hold.

  A donated step deletes the buffers of its state; a ``jax.Array`` that
  :func:`to_global` kept (already laid out so) or re-wrapped (an equivalent
  sharding) is therefore copied, in one jitted program, so that the
  caller's arrays stay alive. NumPy values are placed into new buffers
  anyway.
  """
  placed = jax.tree.map(to_global, given, shardings)
  if not donate or not any(
    isinstance(x, jax.Array) for x in jax.tree.leaves(given)
  ):
    return placed
  copy = lambda t: jax.tree.map(jnp.copy, t)
  return jax.jit(copy, out_shardings=shardings)(placed)


def constrain(x: Any, sharding: NamedSharding) -> Any:
  """``x`` laid out with ``sharding`` (a reshard on an Explicit mesh)."""
  explicit = jax.sharding.AxisType.Explicit
  if any(t == explicit for t in sharding.mesh.axis_types):
    return jax.sharding.reshard(x, sharding)
  return jax.lax.with_sharding_constraint(x, sharding)


def param_sharding(
  x: Any, mesh: Mesh, axis: Any, dense_axis: Any
) -> NamedSharding:
  """Where a data-parallel step keeps the parameter leaf ``x``.

  Replicated, unless ``x`` is a ``jax.Array`` with a ``NamedSharding`` over
  ``dense_axis`` only (FSDP within a node), which is kept.

  Raises:
    ValueError: for a leaf sharded over ``axis`` (the exchange's, whose
      replicas each hold the whole parameters) or another axis.
  """
  replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())
  sharding = getattr(x, "sharding", None)
  spec = getattr(sharding, "spec", None)
  if not isinstance(sharding, NamedSharding) or spec is None:
    return replicated
  used = {
    a
    for entry in spec
    if entry is not None
    for a in (entry if isinstance(entry, tuple) else (entry,))
  }
  if not used:
    return replicated
  if not used <= {dense_axis}:
    allowed = (
      "must be replicated (no `dense_axis` to shard them over)"
      if dense_axis is None
      else f"may be sharded over `dense_axis` ({dense_axis!r}) only"
    )
    raise ValueError(
      f"`params` has a leaf of shape {tuple(x.shape)} sharded as {spec} "
      f"on the mesh {dict(mesh.shape)}: params {allowed}, not over "
      f"`axis` ({axis!r}, the axis of the exchange, whose replicas "
      "each hold the whole parameters) or another axis."
    )
  return NamedSharding(mesh, spec)


def split_leading(
  tree: Any, sharding: NamedSharding, divisor: int, what: str, axis: int = 0
) -> Any:
  """``tree``'s leaves as global arrays split along dimension ``axis``.

  Raises:
    ValueError: naming ``what`` when a leaf's dimension ``axis`` is missing
      or not divisible by ``divisor``.
  """
  for x in jax.tree.leaves(tree):
    shape = tuple(x.shape) if hasattr(x, "shape") else np.shape(x)
    if len(shape) <= axis or shape[axis] % divisor:
      raise ValueError(f"{what}; got a leaf of shape {shape}.")
  return jax.tree.map(lambda x: to_global(x, sharding), tree)


# Helpers of the runtime: nothing public here.
__all__ = ()
