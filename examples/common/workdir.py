"""The outputs of a run in ``--workdir``: checkpoints, events, metrics, plot."""

from __future__ import annotations

import os
from typing import Any

from flax import nnx

from examples.common import checkpointing
from examples.common import metrics as metrics_lib
from examples.common import plotting

METRICS_FILE = "metrics.json"
PLOT_FILE = "loss_curves.png"


def new_history() -> dict[str, list]:
  """Training curves: ``train_loss`` [(step, loss)], ``eval`` [(step, loss, acc)]."""
  return {"train_loss": [], "eval": []}


class Workdir:
  """Writes checkpoints, TensorBoard events, ``metrics.json`` and a PNG.

  With ``path=None`` every method is a no-op (nothing is written) and a run
  always starts from step 0.
  """

  def __init__(self, path: str | None, *, resume: bool,
               checkpoint_every: int = 0):
    self.path = path
    self.checkpoint_every = checkpoint_every
    self._resume = resume
    self._checkpointer = None
    if path:
      os.makedirs(path, exist_ok=True)
      self._checkpointer = checkpointing.Checkpointer(
          os.path.join(path, "checkpoints"))
      latest = self._checkpointer.latest_step()
      if latest is not None and not resume:
        raise FileExistsError(
            f"{path} already holds checkpoints (up to step {latest}); pass "
            "--resume to continue that run, or choose another --workdir.")
    self.writer = metrics_lib.MetricsWriter(path)

  def restore(self, model: nnx.Module, optimizer: nnx.Optimizer
              ) -> tuple[int, dict[str, list]]:
    """Loads the latest checkpoint when resuming; returns (step, history)."""
    if not self._resume or self._checkpointer is None:
      return 0, new_history()
    if self._checkpointer.latest_step() is None:
      print(f"--resume: no checkpoint in {self.path}, starting from step 0.")
      return 0, new_history()
    step, history = self._checkpointer.restore(model, optimizer)
    return step, history

  def should_checkpoint(self, step: int, *, evaluated: bool,
                        last: bool) -> bool:
    if self._checkpointer is None:
      return False
    if self.checkpoint_every:
      return last or step % self.checkpoint_every == 0
    return last or evaluated

  def save(self, step: int, model: nnx.Module, optimizer: nnx.Optimizer,
           history: dict[str, list], extra: list | None = None) -> None:
    if self._checkpointer is not None:
      self._checkpointer.save(step, model, optimizer, history, extra=extra)

  def restore_extra(self, step: int, like: list) -> list | None:
    """The residuals saved with checkpoint ``step`` (None: none, or a fresh
    run)."""
    if not step or self._checkpointer is None:
      return None
    return self._checkpointer.restore_extra(step, like)

  def log_optimizer(self, step: int, optimizer: nnx.Optimizer) -> None:
    """TensorBoard scalars/histograms of ``grpo_optax.metrics`` (if any)."""
    if self.path:
      self.writer.write_arrays(step, metrics_lib.optimizer_diagnostics(
          optimizer), prefix="optimizer/")

  def finish(self, summary: dict[str, Any], *, title: str,
             reference: float | None = None,
             reference_label: str = "", log_y: bool = False) -> None:
    """Writes ``metrics.json`` and the loss plot; closes writers."""
    self.writer.close()
    if self._checkpointer is not None:
      self._checkpointer.close()
    if not self.path:
      return
    metrics_lib.write_json(os.path.join(self.path, METRICS_FILE), summary)
    plotting.plot_loss_curves(
        summary["train_loss_history"], summary["eval_history"],
        os.path.join(self.path, PLOT_FILE), title=title, reference=reference,
        reference_label=reference_label, log_y=log_y)
