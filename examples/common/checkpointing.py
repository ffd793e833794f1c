"""Orbax checkpoints of ``{"model": nnx.state(model), "optimizer": nnx.state(opt)}``.

The training history (loss curves, evaluations) is saved in the same
checkpoint step as JSON, so that a resumed run reports the same curves as an
uninterrupted one. Data-parallel runs save their state as it lies on the
mesh (:meth:`Checkpointer.save_items`: every process writes its part) with
the per-replica error-feedback residuals and, with local steps, the outer
parameters and optimizer state. Typed PRNG keys (e.g. the sampling key inside the GRPO
sparsifier's state) are stored as their raw key data and re-wrapped on
restore.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx


def _is_prng_key(x: Any) -> bool:
  return hasattr(x, "dtype") and jax.dtypes.issubdtype(
    x.dtype, jax.dtypes.prng_key
  )


def _to_savable(tree: Any) -> Any:
  return jax.tree.map(
    lambda x: jax.random.key_data(x) if _is_prng_key(x) else x, tree
  )


def _from_savable(tree: Any, like: Any) -> Any:
  return jax.tree.map(
    lambda x, ref: (
      jax.random.wrap_key_data(x, impl=jax.random.key_impl(ref))
      if _is_prng_key(ref)
      else x
    ),
    tree,
    like,
  )


def train_state(model: nnx.Module, optimizer: nnx.Optimizer) -> dict[str, Any]:
  """The checkpointed state, as nested dicts of arrays."""
  return {
    "model": nnx.to_pure_dict(nnx.state(model)),
    "optimizer": nnx.to_pure_dict(nnx.state(optimizer)),
  }


class Checkpointer:
  """Saves and restores a model, its optimizer and a JSON history."""

  def __init__(self, directory: str, *, max_to_keep: int = 2):
    self._manager = ocp.CheckpointManager(
      os.path.abspath(directory),
      options=ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=True
      ),
    )

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(
    self,
    step: int,
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    history: dict[str, Any],
    extra: list[Any] | None = None,
  ) -> None:
    """Writes checkpoint ``step`` (blocking, so a crash cannot leave half of it).

    ``extra``: more arrays to keep (the error-feedback residuals), or None.
    """
    items = {
      "state": ocp.args.StandardSave(
        _to_savable(train_state(model, optimizer))
      ),
      "history": ocp.args.JsonSave(history),
    }
    if extra is not None:
      items["extra"] = ocp.args.StandardSave(list(extra))
    self._manager.save(step, args=ocp.args.Composite(**items), force=True)
    self._manager.wait_until_finished()

  def save_items(
    self, step: int, items: dict[str, Any], history: dict[str, Any]
  ) -> None:
    """Writes checkpoint ``step`` of named trees of (global) arrays.

    Data-parallel runs save the state as it lies on the mesh: in a
    multi-process run every process writes the shards of its own devices
    (one copy of a replicated array) and process 0 the metadata.
    """
    args = {
      name: ocp.args.StandardSave(_to_savable(tree))
      for name, tree in items.items()
    }
    self._manager.save(
      step,
      args=ocp.args.Composite(history=ocp.args.JsonSave(history), **args),
      force=True,
    )
    self._manager.wait_until_finished()

  def restore_items(
    self, step: int, like: dict[str, Any]
  ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The trees of checkpoint ``step``, placed as the arrays of ``like``
    (same shapes, dtypes and shardings), and the history.
    """
    targets = {
      name: ocp.args.StandardRestore(
        jax.tree.map(ocp.utils.to_shape_dtype_struct, _to_savable(tree))
      )
      for name, tree in like.items()
    }
    restored = self._manager.restore(
      step, args=ocp.args.Composite(history=ocp.args.JsonRestore(), **targets)
    )
    return (
      {name: _from_savable(restored[name], like[name]) for name in like},
      restored["history"],
    )

  def restore(
    self, model: nnx.Module, optimizer: nnx.Optimizer, step: int | None = None
  ) -> tuple[int, dict[str, Any]]:
    """Loads checkpoint ``step`` (default: the latest) into model and optimizer.

    Returns:
      ``(step, history)``.
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(
        f"no checkpoint to resume from in {self._manager.directory}"
      )
    like = train_state(model, optimizer)
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, _to_savable(like))
    restored = self._manager.restore(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target), history=ocp.args.JsonRestore()
      ),
    )
    state = _from_savable(restored["state"], like)
    nnx.update(model, _replace(nnx.state(model), state["model"]))
    nnx.update(optimizer, _replace(nnx.state(optimizer), state["optimizer"]))
    return step, restored["history"]

  def close(self) -> None:
    self._manager.close()


def _replace(state: nnx.State, pure: dict[str, Any]) -> nnx.State:
  nnx.replace_by_pure_dict(state, pure)
  return state
