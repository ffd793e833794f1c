"""Metrics output: TensorBoard events (tensorboardX) and ``metrics.json``."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

import grpo_optax

# grpo_optax.metrics, compiled (eagerly it would dispatch op by op). Guarded:
# older grpo_optax versions have no metrics().
_grpo_metrics = (
  jax.jit(grpo_optax.metrics) if hasattr(grpo_optax, "metrics") else None
)

#: The folder of a run's workdir that holds its TensorBoard events.
EVENTS_DIR = "tensorboard"


def optimizer_diagnostics(optimizer: nnx.Optimizer) -> dict[str, np.ndarray]:
  """``grpo_optax.metrics`` of the optimizer state, as NumPy arrays.

  Empty when grpo_optax has no ``metrics`` function (yet) or when the state
  holds no GRPO stage (e.g. plain Adam).
  """
  if _grpo_metrics is None:
    return {}
  opt_state = (getattr(nnx, "as_pure", None) or nnx.pure)(
    optimizer.opt_state
  )  # The plain optax state.
  return {
    name: np.asarray(value) for name, value in _grpo_metrics(opt_state).items()
  }


def scalar_optimizer_diagnostics(optimizer: nnx.Optimizer) -> dict[str, float]:
  """The scalar entries of :func:`optimizer_diagnostics`, as Python floats
  (what the examples write into ``metrics.json``).
  """
  return {
    name: float(value)
    for name, value in optimizer_diagnostics(optimizer).items()
    if value.size == 1
  }


class MetricsWriter:
  """Writes scalars and histograms to TensorBoard; a no-op without a workdir."""

  def __init__(self, workdir: str | None):
    self._writer = None
    if workdir:
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top

      self._writer = SummaryWriter(os.path.join(workdir, EVENTS_DIR))

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    if self._writer is None:
      return
    for name, value in scalars.items():
      self._writer.add_scalar(name, float(value), step)

  def write_arrays(
    self, step: int, arrays: Mapping[str, np.ndarray], prefix: str = ""
  ) -> None:
    """Scalars as scalars, other arrays as histograms."""
    if self._writer is None:
      return
    for name, value in arrays.items():
      value = np.asarray(value, dtype=np.float64)
      if value.size == 1:
        self._writer.add_scalar(prefix + name, float(value.reshape(())), step)
      elif value.size:
        self._writer.add_histogram(prefix + name, value.ravel(), step)

  def close(self) -> None:
    if self._writer is not None:
      self._writer.close()


def _jsonable(value: Any) -> Any:
  if isinstance(value, Mapping):
    return {str(k): _jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  if isinstance(value, (np.generic, np.ndarray, jax.Array)):
    return _jsonable(np.asarray(value).tolist())
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)  # JSON has no NaN/Inf.
  return value


def write_json(path: str, data: Mapping[str, Any]) -> None:
  """Writes ``data`` as indented JSON, atomically."""
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(_jsonable(data), f, indent=2)
  os.replace(tmp, path)
