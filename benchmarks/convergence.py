"""Convergence suite: GRPO against optax baselines at equal tuning.

Every optimizer gets the same learning-rate sweep per task (half-decade steps,
x3 then x3.33), the same seeds and the same step budget, with a constant
learning rate. A seed fixes the initialisation and the data order, so every
optimizer and every learning rate sees the same batches.

Metric: the smoothed final training loss of a run, the mean of its batch
losses over the last 10% of the steps (each step's loss is measured on that
step's batch before the update); averaged over seeds; the best over the
learning-rate sweep is the optimizer's result on the task. A learning rate at
which a seed diverged (a non-finite loss at the end) does not count. Reported:
each optimizer's best loss divided by Adam's, per task, with the geometric
mean over tasks and the maximum; whether the best learning rate is interior to
the sweep (an edge optimum means the sweep was too narrow for it); the
held-out metrics of the tasks that have them, at the chosen learning rate;
the fraction of steps whose raw gradient norm exceeds 1 (the preset's
``max_norm``), and wall times.

Tasks: :mod:`benchmarks.problems`. Optimizers (``--optimizers``): ``sgd``
(momentum 0.9), ``adam``, ``adamw`` (weight decay 1e-4), ``nadam`` and
``grpo`` (``grpo_optax.grpo(lr)``, the library's defaults). More can be
passed as a dict ``name -> callable(lr) -> optax transform`` to
:func:`run_suite` / :func:`main`, or on the command line with
``--factory module:attribute`` naming such a dict; the callable receives a
traced scalar learning rate.

Run: ``python -m benchmarks.convergence [--quick] [--out DIR]``; writes
``DIR/convergence.json``, ``DIR/convergence.md`` and
``DIR/convergence_curves.png`` (``--quick``: ``benchmarks/results/quick``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import grpo_optax
from benchmarks import command as command_lib
from benchmarks import problems as problems_lib

Factory = Callable[[Any], optax.GradientTransformation]

ADAMW_WEIGHT_DECAY = 1e-4  # The examples' --weight-decay default.
EXPLOSION_NORM = 1.0  # The preset's max_norm.
SMOOTH_FRACTION = 0.1  # The final loss is the mean over this tail of steps.
BASELINE = "adam"

OPTIMIZERS: dict[str, Factory] = {
  "sgd": lambda lr: optax.sgd(lr, momentum=0.9),
  "adam": optax.adam,
  "adamw": lambda lr: optax.adamw(lr, weight_decay=ADAMW_WEIGHT_DECAY),
  "nadam": optax.nadam,
  "grpo": grpo_optax.grpo,
}
DESCRIPTIONS = {
  "sgd": "optax.sgd(lr, momentum=0.9)",
  "adam": "optax.adam(lr)",
  "adamw": f"optax.adamw(lr, weight_decay={ADAMW_WEIGHT_DECAY:g})",
  "nadam": "optax.nadam(lr)",
  "grpo": "grpo_optax.grpo(lr), library defaults",
}
# Columns of the ratio table, in this order, when present.
RATIO_COLUMNS = ("grpo", "nadam", "adamw", "sgd")


# --------------------------------------------------------------- helpers


def _finite_or_none(x) -> float | None:
  x = float(x)
  return x if math.isfinite(x) else None


def _stats(values: Sequence[float]) -> dict[str, Any]:
  """Mean and sample std; None when any value is not finite (diverged)."""
  v = np.asarray(values, np.float64)
  ok = bool(np.isfinite(v).all()) and v.size > 0
  return {
    "mean": float(v.mean()) if ok else None,
    "std": float(v.std(ddof=1)) if ok and v.size > 1 else (0.0 if ok else None),
    "n": int(v.size),
    "values": [_finite_or_none(x) for x in v],
  }


def _curve(
  values: np.ndarray, steps: Sequence[int], max_points: int = 200
) -> dict[str, list]:
  """Mean and std over seeds (axis 0) on at most ``max_points`` steps."""
  steps = np.asarray(steps)
  idx = np.unique(
    np.linspace(0, len(steps) - 1, min(max_points, len(steps))).astype(int)
  )
  with np.errstate(invalid="ignore"):
    mean = np.nanmean(values, 0)[idx]
    std = np.nanstd(values, 0)[idx]
  return {
    "steps": [int(s) for s in steps[idx]],
    "mean": [_finite_or_none(x) for x in mean],
    "std": [_finite_or_none(x) for x in std],
  }


def steps_to_target(
  steps: Sequence[int], values: Sequence[float], target: float, mode: str
) -> int | None:
  """The first step whose value reaches ``target`` (None if none does)."""
  values = np.asarray(values, np.float64)
  hit = (values <= target) if mode == "min" else (values >= target)
  hit &= np.isfinite(values)
  return int(np.asarray(steps)[np.argmax(hit)]) if hit.any() else None


def best_index(means: Sequence[float | None]) -> int | None:
  """Index of the smallest finite mean (ties: the smaller learning rate)."""
  finite = [(m, i) for i, m in enumerate(means) if m is not None]
  return min(finite)[1] if finite else None


def geomean(values: Sequence[float]) -> float | None:
  v = [x for x in values if x is not None]
  if not v or len(v) != len(values):
    return None
  return float(np.exp(np.mean(np.log(v))))


# ------------------------------------------------------------ measuring


def sweep_task(
  task: problems_lib.Task,
  factory: Factory,
  seeds: Sequence[int],
  steps: int,
  log=None,
  label: str = "",
  heldout: bool = True,
  select: str | None = None,
) -> dict[str, Any]:
  """Runs ``factory`` over ``task.lrs`` x ``seeds``; returns its summary
  (``heldout=False``: without the held-out evaluations).

  ``select``: a held-out metric of the task (minimised, e.g. ``"loss"``)
  whose value after the last step, mean over seeds, scores each learning
  rate and is the result's ``best``; default: the smoothed final training
  loss.
  """
  start = time.perf_counter()
  fn, eval_steps = problems_lib.make_sweep(
    task,
    factory,
    steps,
    explosion_norm=EXPLOSION_NORM,
    vectorize=task.vectorize,
    heldout=heldout,
  )
  lrs = jnp.asarray(task.lrs, jnp.float32)
  out = jax.device_get(fn(lrs, problems_lib.seed_keys(seeds)))
  seconds = time.perf_counter() - start
  finals = problems_lib.smoothed_final(out["loss"], SMOOTH_FRACTION)  # [L, S]
  if select is not None:
    finals = np.asarray(out["eval/" + select], np.float64)[..., -1]
  by_lr = [_stats(row) for row in finals]
  means = [s["mean"] for s in by_lr]
  i = best_index(means)
  result: dict[str, Any] = {
    "lrs": list(task.lrs),
    "seeds": list(seeds),
    "steps": steps,
    "metric": "train" if select is None else f"heldout/{select}",
    "final_by_lr": by_lr,
    "best_index": i,
    "best_lr": None if i is None else task.lrs[i],
    "best": by_lr[i] if i is not None else _stats([math.nan]),
    "interior": i is not None and 0 < i < len(task.lrs) - 1,
    "seconds": seconds,
    "wall_per_run_s": seconds / (len(task.lrs) * len(seeds)),
  }
  if i is not None:
    steps_axis = np.arange(1, steps + 1)
    result["loss_curve"] = _curve(out["loss"][i], steps_axis)
    result["explosion_rate"] = _stats(out["explosion"][i])
    result["grad_norm_mean"] = _stats(out["grad_norm_mean"][i])
    heldout = {}
    for key in sorted(k for k in out if k.startswith("eval/")):
      name = key[len("eval/") :]
      values = np.asarray(out[key][i], np.float64)  # [S, E]
      heldout[name] = {
        "final": _stats(values[:, -1]),
        "curve": _curve(values, eval_steps),
      }
    if heldout:
      result["heldout"] = heldout
    if task.heldout_target is not None and task.heldout_target[0] in heldout:
      metric, mode, value = task.heldout_target
      values = np.asarray(out["eval/" + metric][i], np.float64)
      hits = [steps_to_target(eval_steps, row, value, mode) for row in values]
      result["steps_to_target"] = {
        "metric": metric,
        "mode": mode,
        "target": value,
        "values": hits,
        "reached": sum(h is not None for h in hits),
      }
  if log:
    interior = "" if result["interior"] else "  (edge of the sweep)"
    log(
      f"  {task.name:11s} {label:24s} best lr {result['best_lr']!s:7s} "
      f"loss {_fmt(result['best']['mean'])} "
      f"({seconds:.0f} s){interior}"
    )
  return result


def ratio_table(
  tasks: Mapping[str, Mapping[str, Any]], baseline: str = BASELINE
) -> dict[str, Any]:
  """``{optimizer: {"per_task", "geomean", "max", "worst_task"}}``.

  ``tasks[task]["results"][opt]["best"]["mean"]`` divided by the baseline's.
  A diverged optimizer (no finite loss at any learning rate) gets None, and
  then no geometric mean.
  """
  table: dict[str, Any] = {}
  opts = []
  for task in tasks.values():
    opts += [o for o in task["results"] if o not in opts]
  for opt in opts:
    per_task = {}
    for name, task in tasks.items():
      res = task["results"]
      if opt not in res or baseline not in res:
        continue
      a, b = res[opt]["best"]["mean"], res[baseline]["best"]["mean"]
      per_task[name] = (a / b) if a is not None and b else None
    finite = {k: v for k, v in per_task.items() if v is not None}
    worst = max(finite, key=finite.get) if finite else None
    table[opt] = {
      "per_task": per_task,
      "geomean": geomean(list(per_task.values())),
      "max": (
        None if len(finite) != len(per_task) or not finite else finite[worst]
      ),
      "worst_task": worst,
    }
  return table


def task_seeds(
  task: problems_lib.Task, quick: bool, num_seeds: int | None = None
) -> list[int]:
  """Seeds 0.. of ``task``: ``num_seeds``, or the task's own count."""
  n = num_seeds or (task.quick_seeds if quick else task.seeds)
  return list(range(n))


def run_suite(
  factories: Mapping[str, Factory],
  task_names: Sequence[str],
  *,
  num_seeds: int | None = None,
  quick: bool = False,
  steps: int | None = None,
  descriptions: Mapping[str, str] | None = None,
  log=print,
  on_task=None,
) -> dict[str, Any]:
  """Measures every optimizer of ``factories`` on every task.

  Args:
    factories: ``name -> callable(lr) -> optax transform``.
    task_names: keys of :data:`benchmarks.problems.TASKS`.
    num_seeds: seeds per task (default: the task's ``seeds`` or
      ``quick_seeds``), shared by every optimizer.
    quick: the tasks' ``quick_steps`` budgets.
    steps: overrides every task's budget (smoke tests).
    descriptions: text for the report, per optimizer name.
    log: a ``print``-like callable.
    on_task: called with the report after each task (to save progress).

  Returns:
    The report: ``meta``, ``tasks`` (each with ``results[opt]``) and
    ``ratios`` (see :func:`ratio_table`).
  """
  descriptions = {**DESCRIPTIONS, **(descriptions or {})}
  report = {
    "meta": {
      "date": time.strftime("%Y-%m-%d %H:%M"),
      "device": f"{jax.devices()[0].device_kind} ({platform.machine()}, "
      f"{os.cpu_count()} cpus)",
      "python": platform.python_version(),
      "jax": jax.__version__,
      "optax": optax.__version__,
      "quick": quick,
      "num_seeds": num_seeds,
      "metric": (
        f"mean training loss over the last "
        f"{SMOOTH_FRACTION:.0%} of the steps, mean over seeds, "
        "best over the learning-rate sweep"
      ),
      "baseline": BASELINE,
      "schedule": "constant learning rate",
      "explosion_norm": EXPLOSION_NORM,
      "optimizers": {k: descriptions.get(k, k) for k in factories},
    },
    "tasks": {},
  }
  start = time.perf_counter()
  for name in task_names:
    t0 = time.perf_counter()
    task = problems_lib.TASKS[name]()
    budget = steps or (task.quick_steps if quick else task.steps)
    seeds = task_seeds(task, quick, num_seeds)
    log(
      f"task {name}: {task.description}; {budget} steps, {len(seeds)} "
      f"seeds, lrs {', '.join(f'{x:g}' for x in task.lrs)}"
    )
    entry = {
      "description": task.description,
      "steps": budget,
      "seeds": seeds,
      "lrs": list(task.lrs),
      "info": task.info,
      "heldout_target": task.heldout_target,
      "vectorized": task.vectorize,
      "results": {},
    }
    report["tasks"][name] = entry
    for opt, factory in factories.items():
      entry["results"][opt] = sweep_task(task, factory, seeds, budget, log, opt)
    entry["seconds"] = time.perf_counter() - t0
    report["ratios"] = ratio_table(report["tasks"])
    report["meta"]["total_seconds"] = time.perf_counter() - start
    if on_task:
      on_task(report)
  report["ratios"] = ratio_table(report["tasks"])
  report["meta"]["total_seconds"] = time.perf_counter() - start
  return report


# --------------------------------------------------------------- output


def _fmt(x, digits: int = 4) -> str:
  if x is None or (isinstance(x, float) and not math.isfinite(x)):
    return "n/a"
  ax = abs(x)
  if ax != 0 and (ax < 1e-3 or ax >= 1e5):
    return f"{x:.3e}"
  return f"{x:.{digits}g}"


def _ratio(x) -> str:
  return "diverged" if x is None else f"{x:.3f}"


def _json_clean(x):
  if isinstance(x, dict):
    return {str(k): _json_clean(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_json_clean(v) for v in x]
  if isinstance(x, (np.floating, float)):
    return float(x) if math.isfinite(x) else None
  if isinstance(x, np.integer):
    return int(x)
  if isinstance(x, np.bool_):
    return bool(x)
  return x


def write_json(path: str, data: dict) -> None:
  with open(path + ".tmp", "w") as f:
    json.dump(_json_clean(data), f, indent=1, allow_nan=False)
  os.replace(path + ".tmp", path)


def ratio_markdown(
  tasks: Mapping[str, Any], ratios: Mapping[str, Any], columns: Sequence[str]
) -> list[str]:
  """The table of best-loss ratios to Adam (tasks x optimizers)."""
  lines = [
    "| task | Adam's best loss | "
    + " | ".join(f"{c} / adam" for c in columns)
    + " |",
    "|---|---|" + "---|" * len(columns),
  ]
  for name, task in tasks.items():
    base = task["results"].get(BASELINE, {}).get("best", {}).get("mean")
    cells = []
    for c in columns:
      r = ratios.get(c, {}).get("per_task", {}).get(name, "absent")
      cells.append("" if r == "absent" else _ratio(r))
    lines.append(f"| {name} | {_fmt(base)} | " + " | ".join(cells) + " |")
  lines.append(
    "| **geometric mean** | | "
    + " | ".join(_ratio(ratios.get(c, {}).get("geomean")) for c in columns)
    + " |"
  )
  lines.append(
    "| **max** | | "
    + " | ".join(
      f"{_ratio(ratios.get(c, {}).get('max'))} "
      f"({ratios.get(c, {}).get('worst_task')})"
      for c in columns
    )
    + " |"
  )
  return lines


def ratio_columns(report: Mapping[str, Any]) -> list[str]:
  opts = list(report["meta"]["optimizers"])
  cols = [c for c in RATIO_COLUMNS if c in opts]
  return cols + [c for c in opts if c not in cols and c != BASELINE]


def convergence_markdown(report: dict) -> str:
  """The human-readable tables of ``convergence.json``."""
  meta = report["meta"]
  tasks = report["tasks"]
  cols = ratio_columns(report)
  lines = [
    "# Convergence: GRPO and optax baselines at equal tuning",
    "",
    f"Command: `{meta.get('command', '')}` ({meta['date']}, "
    f"{meta['device']}, Python {meta['python']}, jax {meta['jax']}, optax "
    f"{meta['optax']}); total {meta.get('total_seconds', 0):.0f} s.",
    "",
    f"Metric: {meta['metric']} (a learning rate at which any seed "
    f"diverged does not count). Seeds per task as stated; "
    f"{meta['schedule']}; every optimizer gets the task's whole sweep, "
    "seeds and budget.",
    "",
    "Optimizers: "
    + "; ".join(f"`{k}` = {v}" for k, v in meta["optimizers"].items())
    + ".",
    "",
    "## Best loss relative to Adam's (lower is better)",
    "",
  ]
  lines += ratio_markdown(tasks, report["ratios"], cols)
  lines += [
    "",
    "## Best learning rate (* = at the edge of the sweep)",
    "",
    "| task | sweep | " + " | ".join(meta["optimizers"]) + " |",
    "|---|---|" + "---|" * len(meta["optimizers"]),
  ]
  edges = []
  for name, task in tasks.items():
    cells = []
    for opt in meta["optimizers"]:
      r = task["results"].get(opt)
      if r is None:
        cells.append("")
        continue
      if not r["interior"]:
        edges.append(f"{opt} on {name}")
      cells.append(
        f"{r['best_lr']:g}{'' if r['interior'] else '*'}"
        if r["best_lr"] is not None
        else "diverged"
      )
    sweep = f"{task['lrs'][0]:g} .. {task['lrs'][-1]:g} ({len(task['lrs'])})"
    lines.append(f"| {name} | {sweep} | " + " | ".join(cells) + " |")
  lines += [
    "",
    (
      "Every best learning rate is interior to its sweep."
      if not edges
      else "At the edge of the sweep: " + ", ".join(edges) + "."
    ),
    "",
  ]
  for name, task in tasks.items():
    lines += [
      f"## {name}",
      "",
      f"{task['description']}. {task['steps']} "
      f"steps, seeds {task['seeds']}; cells: final loss (mean over "
      "seeds) per learning rate, the best in bold; seconds for the "
      f"task: {task.get('seconds', 0):.0f}.",
      "",
    ]
    lrs = task["lrs"]
    lines += [
      "| optimizer | "
      + " | ".join(f"{x:g}" for x in lrs)
      + " | explosion rate | s/run |",
      "|---|" + "---|" * (len(lrs) + 2),
    ]
    for opt, r in task["results"].items():
      cells = []
      for j, s in enumerate(r["final_by_lr"]):
        text = _fmt(s["mean"]) if s["mean"] is not None else "div."
        cells.append(f"**{text}**" if j == r["best_index"] else text)
      expl = r.get("explosion_rate", {}).get("mean")
      lines.append(
        f"| {opt} | "
        + " | ".join(cells)
        + f" | {_fmt(expl)} | {r['wall_per_run_s']:.3g} |"
      )
    held = [o for o, r in task["results"].items() if "heldout" in r]
    if held:
      metrics = list(task["results"][held[0]]["heldout"])
      lines += [
        "",
        "Held-out metrics at the chosen learning rate (mean ± "
        "std over seeds)"
        + (
          f"; steps to {task['heldout_target'][0]} "
          f"{'>=' if task['heldout_target'][1] == 'max' else '<='} "
          f"{task['heldout_target'][2]:.4g}"
          if task.get("heldout_target")
          else ""
        )
        + ":",
        "",
        "| optimizer | "
        + " | ".join(metrics)
        + (" | steps to target |" if task.get("heldout_target") else " |"),
        "|---|" + "---|" * (len(metrics) + bool(task.get("heldout_target"))),
      ]
      for opt in held:
        r = task["results"][opt]
        cells = [
          f"{_fmt(r['heldout'][m]['final']['mean'])} ± "
          f"{_fmt(r['heldout'][m]['final']['std'])}"
          for m in metrics
        ]
        if task.get("heldout_target"):
          st = r.get("steps_to_target", {})
          vals = [v for v in st.get("values", []) if v is not None]
          cells.append(
            (f"{np.mean(vals):.0f} ({st['reached']}/{len(st['values'])} seeds)")
            if vals
            else "not reached"
          )
        lines.append(f"| {opt} | " + " | ".join(cells) + " |")
    lines.append("")
  lines += [
    "![loss curves at the best learning rate](convergence_curves.png)",
    "",
  ]
  return "\n".join(lines)


def plot_curves(path: str, report: dict) -> None:
  """Training loss at each optimizer's best lr, one panel per task."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  tasks = report["tasks"]
  cols = 3
  rows = max(1, -(-len(tasks) // cols))
  fig, axes = plt.subplots(
    rows, cols, figsize=(5 * cols, 3.4 * rows), squeeze=False
  )
  for ax, (name, task) in zip(axes.ravel(), tasks.items()):
    for opt, r in task["results"].items():
      c = r.get("loss_curve")
      if not c:
        continue
      mean = np.asarray([np.nan if v is None else v for v in c["mean"]])
      # A running mean over ~2% of the steps, for readability.
      k = max(1, len(mean) // 50)
      smooth = np.convolve(mean, np.ones(k) / k, mode="valid")
      ax.plot(
        c["steps"][k - 1 :],
        smooth,
        lw=1.1,
        label=f"{opt} (lr {r['best_lr']:g})",
      )
    ax.set_yscale("log")
    ax.set_title(name, fontsize=9)
    ax.set_xlabel("step", fontsize=8)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=6)
  for ax in axes.ravel()[len(tasks) :]:
    ax.axis("off")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def save(out: str, report: dict, plot: bool = True) -> None:
  os.makedirs(out, exist_ok=True)
  write_json(os.path.join(out, "convergence.json"), report)
  with open(os.path.join(out, "convergence.md"), "w") as f:
    f.write(convergence_markdown(report))
  if plot:
    plot_curves(os.path.join(out, "convergence_curves.png"), report)


def print_ratios(report: dict) -> None:
  print(
    "\n".join(
      ratio_markdown(report["tasks"], report["ratios"], ratio_columns(report))
    ),
    flush=True,
  )


# ------------------------------------------------------------------ main


def load_factories(spec: str) -> dict[str, Factory]:
  """``module:attribute`` naming a dict ``name -> callable(lr) -> tx``."""
  module, _, attr = spec.partition(":")
  if not module or not attr:
    raise ValueError(f"--factory must be module:attribute, got {spec!r}")
  value = getattr(importlib.import_module(module), attr)
  if not isinstance(value, Mapping) or not all(
    callable(f) for f in value.values()
  ):
    raise TypeError(f"{spec} must be a dict of name -> callable(lr)")
  return dict(value)


def configure_cache(cache_dir: str) -> None:
  if cache_dir:
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks.convergence", description=__doc__.splitlines()[0]
  )
  parser.add_argument(
    "--quick",
    action="store_true",
    help="the tasks' short budgets (about half), written "
    "to benchmarks/results/quick unless --out is given",
  )
  parser.add_argument(
    "--out",
    default=None,
    help="default: benchmarks/results (quick: benchmarks/results/quick)",
  )
  parser.add_argument(
    "--tasks",
    default=",".join(problems_lib.TASKS),
    help=f"comma-separated subset of {','.join(problems_lib.TASKS)}",
  )
  parser.add_argument(
    "--optimizers",
    default=",".join(OPTIMIZERS),
    help="comma-separated subset (adam is always run: it is the reference)",
  )
  parser.add_argument(
    "--factory",
    action="append",
    default=[],
    help="module:attribute of a dict name -> callable(lr) "
    "-> optax transform, added to the optimizers "
    "(repeatable)",
  )
  parser.add_argument(
    "--seeds",
    type=int,
    default=None,
    help="number of seeds of every task (default: the "
    "task's own, 5 or 3; quick 3 or 2)",
  )
  parser.add_argument(
    "--steps",
    type=int,
    default=None,
    help="override every task's step budget (tests)",
  )
  parser.add_argument("--no-plot", action="store_true")
  parser.add_argument(
    "--render-only",
    action="store_true",
    help="only rewrite the Markdown and PNG from the JSON in --out",
  )
  parser.add_argument(
    "--cache-dir",
    default=os.path.join(
      tempfile.gettempdir(), "grpo_optax_benchmark_jax_cache"
    ),
    help="persistent XLA compilation cache ('' = off)",
  )
  args = parser.parse_args(argv)
  args.tasks = [t for t in args.tasks.split(",") if t]
  bad = set(args.tasks) - set(problems_lib.TASKS)
  if bad:
    parser.error(
      f"unknown tasks {sorted(bad)}; choose from {list(problems_lib.TASKS)}"
    )
  args.optimizers = [o for o in args.optimizers.split(",") if o]
  if args.out is None:
    args.out = os.path.join(
      "benchmarks", "results", "quick" if args.quick else ""
    )
    args.out = args.out.rstrip(os.sep)
  return args


def main(
  argv=None,
  factories: Mapping[str, Factory] | None = None,
  descriptions: Mapping[str, str] | None = None,
) -> dict:
  """Runs the suite; returns the report.

  Args:
    argv: command-line arguments (default ``sys.argv[1:]``).
    factories: extra optimizers, ``name -> callable(lr) -> optax transform``
      (e.g. a new preset), run after those of ``--optimizers``.
    descriptions: text for the report, per extra optimizer.
  """
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse_args(argv)
  if args.render_only:
    with open(os.path.join(args.out, "convergence.json")) as f:
      report = json.load(f)
    save(args.out, report, plot=not args.no_plot)
    return report
  configure_cache(args.cache_dir)
  chosen: dict[str, Factory] = {}
  extra = dict(factories or {})
  for spec in args.factory:
    extra.update(load_factories(spec))
  known = {**OPTIMIZERS, **extra}
  bad = set(args.optimizers) - set(known)
  if bad:
    raise SystemExit(
      f"unknown optimizers {sorted(bad)}; choose from {sorted(known)}"
    )
  names = [BASELINE] + [o for o in args.optimizers if o != BASELINE]
  names += [o for o in extra if o not in names]
  chosen = {n: known[n] for n in names}
  start = time.time()
  log = lambda msg: print(f"[{time.time() - start:6.0f}s] {msg}", flush=True)
  command = command_lib.command("benchmarks.convergence", argv)

  def checkpoint(report):
    report["meta"]["command"] = command.strip()
    save(args.out, report, plot=False)

  report = run_suite(
    chosen,
    args.tasks,
    num_seeds=args.seeds,
    quick=args.quick,
    steps=args.steps,
    descriptions={**{k: k for k in extra}, **(descriptions or {})},
    log=log,
    on_task=checkpoint,
  )
  report["meta"]["command"] = command.strip()
  save(args.out, report, plot=not args.no_plot)
  print_ratios(report)
  log(
    f"done; wrote {args.out}/convergence.json, .md"
    + ("" if args.no_plot else ", convergence_curves.png")
  )
  return report


if __name__ == "__main__":
  main()
