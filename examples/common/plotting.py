"""Loss-curve plot (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top,wrong-import-position


def plot_loss_curves(
  train_history: Sequence[Sequence[float]],
  eval_history: Sequence[Sequence[float]],
  path: str,
  *,
  title: str = "",
  reference: float | None = None,
  reference_label: str = "",
  log_y: bool = False,
) -> None:
  """Saves train loss (per step) and eval loss (per evaluation) to ``path``.

  Args:
    train_history: ``[(step, loss), ...]``.
    eval_history: ``[(step, eval_loss, ...), ...]``.
    path: output PNG.
    title: figure title.
    reference: optional horizontal line (e.g. the unigram entropy).
    reference_label: its legend entry.
    log_y: logarithmic loss axis (for losses that fall by decades).
  """
  fig, ax = plt.subplots(figsize=(6, 4))
  if train_history:
    steps, losses = zip(*[(h[0], h[1]) for h in train_history])
    ax.plot(steps, losses, lw=0.8, alpha=0.8, label="train loss")
  if eval_history:
    steps, losses = zip(*[(h[0], h[1]) for h in eval_history])
    ax.plot(steps, losses, "o-", lw=1.5, label="held-out loss")
  if reference is not None:
    ax.axhline(reference, color="gray", ls="--", lw=1, label=reference_label)
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats)")
  if log_y:
    ax.set_yscale("log")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def plot_panels(
  curves: Mapping[str, Sequence[Sequence[float]]],
  path: str,
  *,
  title: str = "",
  references: Mapping[str, float] | None = None,
) -> None:
  """Saves one panel per curve, stacked, sharing the step axis.

  Args:
    curves: ``{name: [(step, value), ...]}``, one panel each, in order.
    path: output PNG.
    title: figure title.
    references: optional ``{name: value}`` dashed horizontal lines (e.g. the
      reward of a random policy), drawn in the panel of that name.
  """
  references = references or {}
  fig, axes = plt.subplots(
    len(curves), 1, figsize=(6, 2.2 * len(curves)), sharex=True, squeeze=False
  )
  for ax, (name, points) in zip(axes[:, 0], curves.items()):
    if points:
      steps, values = zip(*[(p[0], p[1]) for p in points])
      ax.plot(steps, values, lw=1.0)
    if name in references:
      ax.axhline(references[name], color="gray", ls="--", lw=1)
    ax.set_ylabel(name)
    ax.grid(alpha=0.3)
  axes[-1, 0].set_xlabel("step")
  axes[0, 0].set_title(title)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
