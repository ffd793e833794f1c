"""Checkpoints of the data-parallel runtime's state (orbax, multi-process).

A :class:`~grpo_optax.training.TrainState` is a pytree of global arrays laid
out on a mesh (replicated, per replica, or FSDP-sharded), with None fields,
optax's ``NamedTuple`` states and typed PRNG keys. :func:`to_savable` turns
it into a flat dict of arrays named by their path (keys as their raw key
data), which orbax's ``StandardSave`` writes shard by shard: in a
multi-process run every process writes the shards of its own devices and
process 0 the metadata. :func:`from_savable` puts the restored arrays back
into the structure of a state built the same way (``like``, e.g. a fresh
``init``), with its shardings, so a resumed run continues bit for bit.

:func:`save` and :func:`restore` do both with an ``orbax.checkpoint``
``CheckpointManager`` over a directory; a training loop with its own manager
(the examples save their history beside) calls :func:`save_args` and
:func:`restore_args`. Orbax is imported lazily: ``grpo_optax`` does not
depend on it.
"""

from __future__ import annotations

import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_UNSAFE = re.compile(r"[^0-9A-Za-z_]+")


def _check_directory(directory: Any) -> str:
  if not isinstance(directory, (str, os.PathLike)):
    raise TypeError(
      f"`directory` must be a str or os.PathLike path, got {directory!r}."
    )
  return os.path.abspath(directory)


def _check_step(step: Any) -> int:
  message = f"`step` must be an int >= 0, got {step!r}."
  if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
    raise TypeError(message)
  if step < 0:
    raise ValueError(message)
  return int(step)


def _is_key(x: Any) -> bool:
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _names(tree: Any) -> list[str]:
  """A unique, file-system-safe name per leaf, from its path."""
  paths = jax.tree_util.tree_flatten_with_path(tree)[0]
  out = []
  for i, (path, _) in enumerate(paths):
    text = jax.tree_util.keystr(tuple(path), simple=True, separator=".")
    out.append(f"{i:05d}_{_UNSAFE.sub('_', text).strip('_')}"[:200])
  return out


def to_savable(state: Any) -> dict[str, Any]:
  """``state``'s leaves in a flat dict named by path (PRNG keys as data)."""
  leaves = jax.tree.leaves(state)
  return {
    name: jax.random.key_data(x) if _is_key(x) else x
    for name, x in zip(_names(state), leaves)
  }


def from_savable(flat: dict[str, Any], like: Any) -> Any:
  """The state of ``like``'s structure holding the arrays of ``flat``.

  Raises:
    ValueError: if ``flat`` does not hold exactly ``like``'s leaves.
  """
  names = _names(like)
  if sorted(flat) != sorted(names):
    missing = sorted(set(names) - set(flat))[:3]
    extra = sorted(set(flat) - set(names))[:3]
    raise ValueError(
      "the checkpoint does not hold the leaves of `like` (a state built "
      f"another way?): missing {missing}, unexpected {extra}."
    )
  leaves = [
    jax.random.wrap_key_data(flat[n], impl=jax.random.key_impl(ref))
    if _is_key(ref)
    else flat[n]
    for n, ref in zip(names, jax.tree.leaves(like))
  ]
  return jax.tree.unflatten(jax.tree.structure(like), leaves)


def save_args(state: Any) -> Any:
  """``ocp.args.StandardSave`` of :func:`to_savable` of ``state``."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  return ocp.args.StandardSave(to_savable(state))


def restore_args(like: Any) -> Any:
  """``ocp.args.StandardRestore`` placing the arrays as ``like``'s."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  target = jax.tree.map(ocp.utils.to_shape_dtype_struct, to_savable(like))
  return ocp.args.StandardRestore(target)


def save(directory: str, step: int, state: Any) -> None:
  """Writes checkpoint ``step`` of ``state`` under ``directory`` (blocking;
  every process calls it).

  Raises:
    TypeError: ``directory`` not a path, or ``step`` not an int.
    ValueError: a negative ``step``.
  """
  path, step = _check_directory(directory), _check_step(step)
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  with ocp.CheckpointManager(path) as manager:
    manager.save(
      step, args=ocp.args.Composite(state=save_args(state)), force=True
    )
    manager.wait_until_finished()


def restore(directory: str, like: Any, step: int | None = None):
  """``(step, state)`` of checkpoint ``step`` (default: the latest) under
  ``directory``, laid out as ``like`` (every process calls it).

  Raises:
    FileNotFoundError: if ``directory`` holds no checkpoint.
    TypeError: ``directory`` not a path, or ``step`` neither None nor an
      int.
    ValueError: a negative ``step``.
  """
  path = _check_directory(directory)
  step = None if step is None else _check_step(step)
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  with ocp.CheckpointManager(path) as manager:
    step = manager.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {directory}.")
    restored = manager.restore(
      step, args=ocp.args.Composite(state=restore_args(like))
    )
  return step, from_savable(dict(restored["state"]), like)


__all__ = (
  "from_savable",
  "restore",
  "restore_args",
  "save",
  "save_args",
  "to_savable",
)
