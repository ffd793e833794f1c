"""The outputs of a run in ``--workdir``: checkpoints, events, metrics, plot."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx

from examples.common import checkpointing
from examples.common import metrics as metrics_lib
from examples.common import plotting
from grpo_optax.training import checkpointing as checkpointing_lib

METRICS_FILE = "metrics.json"
PLOT_FILE = "loss_curves.png"
CONFIG_FILE = "config.json"

# Flags that may change when a run is resumed: where and how often it writes,
# evaluates and prints. Every other flag (steps, learning rate, schedule,
# warm-up, optimizer and its knobs, batch size, seed, data, model, compiler
# options) defines the run: the learning-rate schedule is built from --steps,
# so resuming with another value would give a run that matches neither.
RESUMABLE_FLAGS = frozenset(
  {
    "workdir",
    "resume",
    "eval_every",
    "checkpoint_every",
    "quiet",
    "max_eval_examples",
    "eval_batch_size",
    "data_dir",
    "download",
    # Where a process finds the others (a restarted job gets new ones).
    "coordinator_address",
    "process_id",
    "distributed",
  }
)


def _flag(name: str) -> str:
  return "--" + name.replace("_", "-")


def check_resume_config(
  saved: Mapping[str, Any], current: Mapping[str, Any], path: str
) -> None:
  """Raises ``ValueError`` if a run-defining flag differs from the checkpoint's.

  Args:
    saved: the flags the run was started with (``config.json``).
    current: the flags of the resumed invocation.
    path: the workdir, for the message.
  """
  names = sorted((set(saved) | set(current)) - RESUMABLE_FLAGS)
  diffs = [n for n in names if saved.get(n) != current.get(n)]
  if not diffs:
    return
  changes = ", ".join(
    f"{_flag(n)} {saved.get(n)!r} -> {current.get(n)!r}" for n in diffs
  )
  raise ValueError(
    f"--resume: the run in {path} was started with other values of flags "
    f"that define it ({changes}). Its learning-rate schedule and data order "
    "were fixed by those flags at step 0, so continuing with new values "
    "would match neither run. Resume with the original flags (see "
    f"{os.path.join(path, CONFIG_FILE)}); to train longer, start a new "
    "--workdir with the larger --steps."
  )


PANELS_FILE = "curves.png"
CHECKPOINTS = "checkpoints"


def saved_steps(path: str) -> list[int]:
  """The steps of the checkpoints in ``path/checkpoints`` (orbax's step
  folders; none when the folder is missing).
  """
  folder = os.path.join(path, CHECKPOINTS)
  if not os.path.isdir(folder):
    return []
  return sorted(
    int(name)
    for name in os.listdir(folder)
    if name.isdigit() and os.path.isdir(os.path.join(folder, name))
  )


def describe_outputs(path: str | None) -> str:
  """One line naming the output folder of a run and the files in it.

  Args:
    path: the ``--workdir`` (None: nothing was written).

  Returns:
    e.g. "outputs in runs/a: metrics.json, config.json, loss_curves.png,
    tensorboard/ (TensorBoard events), checkpoints/ (steps 50, 100)".
  """
  if not path:
    return (
      "no files written (add --workdir DIR for metrics.json, TensorBoard "
      "events, checkpoints and a plot of the loss)"
    )
  names = sorted(os.listdir(path)) if os.path.isdir(path) else []
  order = [METRICS_FILE, CONFIG_FILE, PLOT_FILE, PANELS_FILE]
  shown = [n for n in order if n in names]
  if metrics_lib.EVENTS_DIR in names:
    shown.append(f"{metrics_lib.EVENTS_DIR}/ (TensorBoard events)")
  steps = saved_steps(path)
  if steps:
    shown.append(
      f"{CHECKPOINTS}/ (step{'s' if len(steps) > 1 else ''} "
      f"{', '.join(map(str, steps))})"
    )
  known = set(order) | {CHECKPOINTS, metrics_lib.EVENTS_DIR}
  shown += [n for n in names if n not in known]
  return f"outputs in {path}: {', '.join(shown) or 'nothing yet'}"


def new_history() -> dict[str, list]:
  """Training curves: ``train_loss`` [(step, loss)], ``eval`` [(step, loss, acc)]."""
  return {"train_loss": [], "eval": []}


class Workdir:
  """Writes checkpoints, TensorBoard events, ``metrics.json`` and a PNG.

  With ``path=None`` every method is a no-op (nothing is written) and a run
  always starts from step 0. ``config`` (the parsed flags) is written to
  ``config.json`` when a run starts; resuming with a run-defining flag that
  differs from it raises ``ValueError`` (see :data:`RESUMABLE_FLAGS`).
  """

  def __init__(
    self,
    path: str | None,
    *,
    resume: bool,
    checkpoint_every: int = 0,
    config: Mapping[str, Any] | None = None,
  ):
    self.path = path
    self.checkpoint_every = checkpoint_every
    self._resume = resume
    self._checkpointer = None
    if path:
      os.makedirs(path, exist_ok=True)
      self._checkpointer = checkpointing.Checkpointer(
        os.path.join(path, CHECKPOINTS)
      )
      latest = self._checkpointer.latest_step()
      if latest is not None and not resume:
        raise FileExistsError(
          f"{path} already holds checkpoints (up to step {latest}); pass "
          "--resume to continue that run, or choose another --workdir."
        )
      if config is not None:
        self._check_or_write_config(dict(config), resuming=latest is not None)
    # Several processes: process 0 writes the metrics, events and plots.
    self._primary = jax.process_index() == 0
    self.writer = metrics_lib.MetricsWriter(path if self._primary else None)

  def _check_or_write_config(
    self, config: dict[str, Any], *, resuming: bool
  ) -> None:
    config_path = os.path.join(self.path, CONFIG_FILE)
    if resuming and os.path.exists(config_path):
      with open(config_path) as f:
        check_resume_config(json.load(f), config, self.path)
      return
    if jax.process_index() != 0:
      return
    with open(config_path, "w") as f:
      json.dump(config, f, indent=1, sort_keys=True)

  def restore(
    self, model: nnx.Module, optimizer: nnx.Optimizer
  ) -> tuple[int, dict[str, list]]:
    """Loads the latest checkpoint when resuming; returns (step, history)."""
    if not self._resume or self._checkpointer is None:
      return 0, new_history()
    if self._checkpointer.latest_step() is None:
      print(f"--resume: no checkpoint in {self.path}, starting from step 0.")
      return 0, new_history()
    step, history = self._checkpointer.restore(model, optimizer)
    return step, history

  def should_checkpoint(
    self, step: int, *, evaluated: bool, last: bool
  ) -> bool:
    if self._checkpointer is None:
      return False
    if self.checkpoint_every:
      return last or step % self.checkpoint_every == 0
    return last or evaluated

  def save(
    self,
    step: int,
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    history: dict[str, list],
  ) -> None:
    if self._checkpointer is not None:
      self._checkpointer.save(step, model, optimizer, history)

  def save_items(
    self, step: int, items: dict[str, Any], history: dict[str, list]
  ) -> None:
    """Checkpoint of a data-parallel run (every process calls it)."""
    if self._checkpointer is not None:
      self._checkpointer.save_items(step, items, history)

  def restore_items(
    self, like: dict[str, Any]
  ) -> tuple[int, dict[str, list], dict[str, Any]]:
    """``(step, history, items)`` of the latest checkpoint when resuming
    (items placed like ``like``), else ``(0, new history, like)``.
    """
    if not self._resume or self._checkpointer is None:
      return 0, new_history(), like
    step = self._checkpointer.latest_step()
    if step is None:
      if jax.process_index() == 0:
        print(f"--resume: no checkpoint in {self.path}, starting from step 0.")
      return 0, new_history(), like
    items, history = self._checkpointer.restore_items(step, like)
    return step, history, items

  def save_state(self, step: int, state: Any, history: dict) -> None:
    """Checkpoint ``step`` of a data-parallel runtime's whole state
    (:mod:`grpo_optax.training.checkpointing`; every process writes the
    shards of its devices).
    """
    self.save_items(
      step, {"state": checkpointing_lib.to_savable(state)}, history
    )

  def restore_state(self, state: Any) -> tuple[int, dict[str, list], Any]:
    """``(step, history, state)`` of the latest checkpoint when resuming,
    laid out as ``state`` (a fresh ``init``), else ``(0, new, state)``.
    """
    like = {"state": checkpointing_lib.to_savable(state)}
    step, history, items = self.restore_items(like)
    if step:
      state = checkpointing_lib.from_savable(dict(items["state"]), state)
    return step, history, state

  def log_optimizer(self, step: int, optimizer: nnx.Optimizer) -> None:
    """TensorBoard scalars/histograms of ``grpo_optax.metrics`` (if any)."""
    if self.path and self._primary:
      self.writer.write_arrays(
        step, metrics_lib.optimizer_diagnostics(optimizer), prefix="optimizer/"
      )

  def finish(
    self,
    summary: dict[str, Any],
    *,
    title: str,
    reference: float | None = None,
    reference_label: str = "",
    log_y: bool = False,
    panels: dict[str, list] | None = None,
    panel_references: dict[str, float] | None = None,
  ) -> None:
    """Writes ``metrics.json`` and the plot; closes writers.

    The plot is the loss curves (``PLOT_FILE``), or, when ``panels``
    (``{name: [(step, value), ...]}``) is given, one panel per curve
    (``PANELS_FILE``).
    """
    self.writer.close()
    if self._checkpointer is not None:
      self._checkpointer.close()
    if not self.path or not self._primary:
      return
    metrics_lib.write_json(os.path.join(self.path, METRICS_FILE), summary)
    if panels is not None:
      plotting.plot_panels(
        panels,
        os.path.join(self.path, PANELS_FILE),
        title=title,
        references=panel_references,
      )
      return
    plotting.plot_loss_curves(
      summary["train_loss_history"],
      summary["eval_history"],
      os.path.join(self.path, PLOT_FILE),
      title=title,
      reference=reference,
      reference_label=reference_label,
      log_y=log_y,
    )
