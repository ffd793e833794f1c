"""Convergence benchmark: the GRPO preset against optax baselines, plus an ablation.

Optimizers: ``grpo`` (``grpo_optax.grpo(lr)``, default knobs), ``sgd`` (optax
SGD, momentum 0.9), ``adam``, ``adamw`` (weight decay 1e-4) and ``nadam``.

Tasks: three standard problems (:mod:`benchmarks.problems`: Rosenbrock, an
ill-conditioned quadratic, logistic regression on breast-cancer), trained by
a jitted ``lax.scan`` loop with a constant learning rate, and the two Flax
examples (ResNet-8 on scikit-learn's digits, a small BERT MLM on CPython's
docs), called in-process through ``parse_args`` + ``train_and_evaluate`` with
their default cosine schedule (5% warm-up), at benchmark sizes stated in the
output.

Protocol (the same for every optimizer):

1. Learning rate: a small log-spaced grid per task (the adaptive optimizers
   share one grid; SGD gets a grid of the same size and spacing at its own
   scale). Each value trains seed 0 for the full budget; the value with the
   best final metric wins (ties: the task's tie-break, e.g. held-out loss).
2. The chosen learning rate trains every seed (5, or 2 with ``--quick``).
3. Reported: final metric mean and standard deviation over seeds, steps to
   the task's target (first evaluation that reaches it; mean over the seeds
   that reach it, with the count), wall time, and the "gradient explosion
   rate": the fraction of steps whose raw gradient global norm exceeds 1.0
   (the preset's ``max_norm``), measured the same way for every optimizer.

Ablation: the preset at its chosen learning rate with one mechanism switched
off (or, for the noise filter, on) at a time.

Run: ``python -m benchmarks.convergence [--quick] [--out DIR]``; writes
``DIR/convergence.json``, ``DIR/convergence.md``, ``DIR/ablation.json``,
``DIR/ablation.md`` and ``DIR/convergence_<task>.png`` /
``DIR/ablation_<task>.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import platform
import struct
import sys
import tempfile
import textwrap
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import grpo_optax
from benchmarks import problems as problems_lib

OPTIMIZERS = ("grpo", "sgd", "adam", "adamw", "nadam")
ADAMW_WEIGHT_DECAY = 1e-4  # The examples' --weight-decay default.
EXPLOSION_NORM = 1.0  # The preset's max_norm.

# name -> (grpo keyword overrides, what the row shows).
ABLATIONS = {
    "preset": ({}, "grpo(lr), default knobs"),
    "no_importance": ({"importance": False}, "importance weighting off"),
    "no_sparsify": ({"sparsify": None}, "top-k mask off (dense)"),
    "threshold_mask": ({"sparsify": "threshold"},
                       "EMA-threshold mask instead of top-k"),
    "no_clip": ({"max_norm": None}, "clipping off"),
    "no_variance_lr": ({"variance_coef": None}, "variance-based lr off"),
    "pure_nadam_step": ({"adam_weight": 1.0},
                        "adam_weight=1 (NAdam step, no RMSProp mix)"),
    "plus_noise_filter": ({"filter_decay": 0.9},
                          "moving-average noise filter on (0.9)"),
    "all_off": ({"importance": False, "sparsify": None, "max_norm": None,
                 "variance_coef": None, "adam_weight": 1.0},
                "every mechanism off (= optax NAdam)"),
}


def make_tx(name: str, lr: Any, **grpo_kwargs) -> optax.GradientTransformation:
  """The optimizer ``name`` at learning rate ``lr`` (a float or a tracer)."""
  if name == "grpo":
    return grpo_optax.grpo(lr, **grpo_kwargs)
  if grpo_kwargs:
    raise ValueError(f"GRPO knobs given to {name}: {grpo_kwargs}")
  if name == "sgd":
    return optax.sgd(lr, momentum=0.9)
  if name == "adam":
    return optax.adam(lr)
  if name == "adamw":
    return optax.adamw(lr, weight_decay=ADAMW_WEIGHT_DECAY)
  if name == "nadam":
    return optax.nadam(lr)
  raise ValueError(f"unknown optimizer {name!r}; expected one of {OPTIMIZERS}")


@dataclasses.dataclass
class Run:
  """One seed's training run."""
  seed: int
  final: float  # The task's metric after the last step.
  tiebreak: float  # Lower is better; breaks ties of ``final``.
  steps_to_target: Optional[int]  # None: never reached.
  wall_time_s: float
  explosion_rate: float  # Fraction of steps with grad norm > EXPLOSION_NORM.
  loss_curve: tuple[np.ndarray, np.ndarray]  # (steps, training loss)
  metric_curve: tuple[np.ndarray, np.ndarray]  # (steps, metric)
  extra: dict[str, float] = dataclasses.field(default_factory=dict)


def steps_to_target(steps: np.ndarray, values: np.ndarray, target: float,
                    mode: str) -> Optional[int]:
  """The first step whose metric reaches ``target`` (None if none does)."""
  values = np.asarray(values, dtype=np.float64)
  hit = values <= target if mode == "min" else values >= target
  hit &= np.isfinite(values)
  return int(steps[np.argmax(hit)]) if hit.any() else None


def _num(x) -> float:
  x = float(x)
  return x if math.isfinite(x) else float("nan")


# ----------------------------------------------------------------- tasks


class ProblemTask:
  """A standard problem from :mod:`benchmarks.problems` (jitted scan loop).

  All seeds of one learning rate run in one vmapped call; the step loop is
  compiled once per optimizer configuration (the learning rate is traced).
  Wall time is the compiled call's time divided by the number of seeds.
  """
  kind = "problem"
  sweep_all_seeds = True  # Cheap: every grid value runs all seeds at once.

  def __init__(self, problem: problems_lib.Problem, steps: Optional[int] = None):
    self.problem = problem
    self.name = problem.name
    self.steps = steps or problem.steps
    self.metric = problem.metric
    self.mode = problem.mode
    self.target = problem.target
    self.target_text = f"{problem.metric} {'<=' if problem.mode == 'min' else '>='} {problem.target:g}"
    self.description = problem.description
    self.settings = {"steps": self.steps, "schedule": "constant",
                     "loop": "jax.lax.scan, vmapped over seeds",
                     "metric_evaluated": "after every step"}
    self._compiled = {}

  def lr_grid(self, optimizer: str, quick: bool) -> tuple[float, ...]:
    del quick  # Cheap enough to sweep in full.
    return (self.problem.sgd_lr_grid if optimizer == "sgd"
            else self.problem.lr_grid)

  def run(self, optimizer: str, lr: float, seeds: Sequence[int],
          grpo_kwargs: Optional[dict] = None) -> list[Run]:
    grpo_kwargs = dict(grpo_kwargs or {})
    keys = jnp.stack([jax.random.key_data(jax.random.key(s)) for s in seeds])
    cache_key = (optimizer, tuple(sorted(grpo_kwargs.items())), len(seeds))
    if cache_key not in self._compiled:
      runner = problems_lib.make_runner(
          self.problem, lambda lr_: make_tx(optimizer, lr_, **grpo_kwargs),
          steps=self.steps, explosion_norm=EXPLOSION_NORM)
      fn = jax.jit(lambda lr_, k: runner(lr_, jax.vmap(jax.random.wrap_key_data)(k)))
      self._compiled[cache_key] = fn.lower(jnp.float32(lr), keys).compile()
    start = time.perf_counter()
    out = jax.device_get(self._compiled[cache_key](jnp.float32(lr), keys))
    per_seed = (time.perf_counter() - start) / len(seeds)
    steps = np.arange(1, self.steps + 1)
    runs = []
    for i, seed in enumerate(seeds):
      final = out["final"]
      runs.append(Run(
          seed=int(seed), final=_num(final[self.metric][i]),
          tiebreak=_num(final[self.problem.tiebreak][i]),
          steps_to_target=steps_to_target(steps, out["metric"][i],
                                          self.target, self.mode),
          wall_time_s=per_seed,
          explosion_rate=_num(out["explosion_rate"][i]),
          loss_curve=(steps, np.asarray(out["loss"][i])),
          metric_curve=(steps, np.asarray(out["metric"][i]))))
    return runs


def read_tensorboard_scalars(logdir: str, tag: str) -> dict[int, float]:
  """``{step: value}`` of scalar ``tag`` in the TensorBoard event files of
  ``logdir`` (TFRecord framing: u64 length, u32 crc, payload, u32 crc)."""
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  values = {}
  for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents*"))):
    with open(path, "rb") as f:
      data = f.read()
    pos = 0
    while pos + 12 <= len(data):
      (length,) = struct.unpack("<Q", data[pos:pos + 8])
      event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
      pos += 12 + length + 4
      for value in event.summary.value:
        if value.tag == tag:
          values[int(event.step)] = float(value.simple_value)
  return values


@dataclasses.dataclass(frozen=True)
class ExampleSpec:
  """How to call one Flax example and read its result."""
  name: str
  module: str  # examples.<module>.main / .train
  description: str
  argv: tuple[str, ...]  # Benchmark-size flags (besides optimizer/lr/seed/steps).
  steps: int
  quick_steps: int
  metric: str  # Key of the summary: the reported final metric.
  eval_index: int  # Index of the metric in eval_history rows (step, loss, acc).
  mode: str
  tiebreak: str  # Summary key, lower is better.
  lr_grid: tuple[float, ...]
  sgd_lr_grid: tuple[float, ...]
  target: Optional[float]  # None: the summary's ``target_key``.
  target_key: Optional[str] = None
  extra_keys: tuple[str, ...] = ()


EXAMPLES = {
    "resnet": ExampleSpec(
        name="resnet", module="resnet_cifar10",
        description="ResNet-8 (16/32/64 channels) on scikit-learn's 8x8 digits "
        "(1,437 train / 360 held-out), batch 64",
        argv=("--depth", "8", "--batch-size", "64", "--eval-every", "10"),
        steps=200, quick_steps=100, metric="eval_accuracy", eval_index=2,
        mode="max", tiebreak="eval_loss", lr_grid=(1e-3, 3e-3, 1e-2, 3e-2),
        sgd_lr_grid=(0.03, 0.1, 0.3, 1.0), target=0.95,
        extra_keys=("eval_loss",)),
    "bert": ExampleSpec(
        name="bert", module="bert_mlm",
        description="BERT MLM, 2 layers, hidden 64, 2 heads, ffn 256, BPE "
        "vocab 512, sequences of 32 tokens, batch 32, on CPython's pydoc "
        "topics (256 held-out sequences)",
        argv=("--hidden", "64", "--num-layers", "2", "--num-heads", "2",
              "--ffn", "256", "--vocab-size", "512", "--seq-len", "32",
              "--batch-size", "32", "--max-eval-examples", "256",
              "--eval-every", "25"),
        steps=300, quick_steps=150, metric="eval_loss", eval_index=1,
        mode="min", tiebreak="eval_loss", lr_grid=(1e-3, 3e-3, 1e-2, 3e-2),
        sgd_lr_grid=(0.1, 0.3, 1.0, 3.0), target=None,
        target_key="unigram_entropy",
        extra_keys=("eval_masked_accuracy", "unigram_entropy")),
}

_FLAG_VALUES = {True: "true", False: "false", None: "none"}
# grpo_optax.metrics keys kept from the examples' final optimizer state.
_DIAGNOSTICS = {"clip/clip_rate": "grpo_clip_rate",
                "topk/kept_fraction": "grpo_kept_fraction",
                "threshold/kept_fraction": "grpo_kept_fraction",
                "variance_lr/lr_scale": "grpo_lr_scale"}


def grpo_flags(grpo_kwargs: dict) -> list[str]:
  """``{"sparsify": None}`` -> ``["--grpo-sparsify", "none"]``."""
  flags = []
  for name, value in grpo_kwargs.items():
    text = (_FLAG_VALUES[value] if value is None or isinstance(value, bool)
            else str(value))
    flags += [f"--grpo-{name.replace('_', '-')}", text]
  return flags


class ExampleTask:
  """A Flax example run in-process (``parse_args`` + ``train_and_evaluate``).

  Each run gets a temporary ``--workdir`` so that the gradient norm of every
  step can be read back from the run's TensorBoard events (the explosion
  rate). Wall time is the example's own ``wall_time_s`` (data, compilation,
  training and evaluation); with the persistent compilation cache, runs after
  the first of a configuration skip most of the compilation.
  """
  kind = "example"
  sweep_all_seeds = False

  def __init__(self, spec: ExampleSpec, quick: bool, steps: Optional[int] = None):
    import importlib  # pylint: disable=g-import-not-at-top
    self.spec = spec
    self.name = spec.name
    self.main = importlib.import_module(f"examples.{spec.module}.main")
    self.train = importlib.import_module(f"examples.{spec.module}.train")
    self.steps = steps or (spec.quick_steps if quick else spec.steps)
    self.metric = spec.metric
    self.mode = spec.mode
    self.target = spec.target  # Filled from the first run when data-defined.
    self.target_text = (f"{spec.metric} >= {spec.target:g}" if spec.target
                        is not None and spec.mode == "max" else
                        f"{spec.metric} < {spec.target_key}")
    self.description = spec.description
    self.settings = {"steps": self.steps, "argv": list(spec.argv),
                     "schedule": "cosine, 5% linear warm-up (example default)",
                     "command": f"python -m examples.{spec.module} "
                     + " ".join(spec.argv) + f" --steps {self.steps}"
                     " --optimizer OPT --lr LR --seed SEED"}

  def lr_grid(self, optimizer: str, quick: bool) -> tuple[float, ...]:
    grid = self.spec.sgd_lr_grid if optimizer == "sgd" else self.spec.lr_grid
    return (grid[(len(grid) - 1) // 2],) if quick else grid

  def run(self, optimizer: str, lr: float, seeds: Sequence[int],
          grpo_kwargs: Optional[dict] = None) -> list[Run]:
    return [self._run_one(optimizer, lr, s, grpo_kwargs or {}) for s in seeds]

  def _run_one(self, optimizer, lr, seed, grpo_kwargs) -> Run:
    spec = self.spec
    with tempfile.TemporaryDirectory() as workdir:
      argv = list(spec.argv) + [
          "--steps", str(self.steps), "--optimizer", optimizer, "--lr",
          repr(lr), "--seed", str(seed), "--quiet", "--workdir", workdir,
          "--checkpoint-every", str(self.steps)] + grpo_flags(grpo_kwargs)
      summary = self.train.train_and_evaluate(self.main.parse_args(argv))
      norms = read_tensorboard_scalars(os.path.join(workdir, "tensorboard"),
                                       "train/grad_norm")
    if self.target is None:
      self.target = float(summary[spec.target_key])
      self.target_text += f" ({self.target:.4f})"
    evals = np.asarray(summary["eval_history"], dtype=np.float64)
    losses = np.asarray(summary["train_loss_history"], dtype=np.float64)
    metric_curve = (evals[:, 0].astype(int), evals[:, spec.eval_index])
    norm_values = np.asarray(list(norms.values()), dtype=np.float64)
    extra = {k: _num(summary[k]) for k in spec.extra_keys}
    extra["grad_norm_steps_logged"] = float(len(norm_values))
    diagnostics = summary.get("optimizer_diagnostics", {})
    for key, name in _DIAGNOSTICS.items():
      if key in diagnostics:
        extra[name] = _num(diagnostics[key])
    return Run(
        seed=seed, final=_num(summary[spec.metric]),
        tiebreak=_num(summary[spec.tiebreak]),
        steps_to_target=steps_to_target(metric_curve[0], metric_curve[1],
                                        self.target, self.mode),
        wall_time_s=float(summary["wall_time_s"]),
        explosion_rate=(float(np.mean(norm_values > EXPLOSION_NORM))
                        if norm_values.size else float("nan")),
        loss_curve=(losses[:, 0].astype(int), losses[:, 1]),
        metric_curve=metric_curve, extra=extra)


# ------------------------------------------------------------ protocol


def _rank_key(run: Run, mode: str, lr: float):
  """Sort key: better final metric first, then tie-break, then smaller lr."""
  final = run.final if math.isfinite(run.final) else math.inf * (
      1 if mode == "min" else -1)
  primary = final if mode == "min" else -final
  tie = run.tiebreak if math.isfinite(run.tiebreak) else math.inf
  return (primary, tie, lr)


def choose_lr(sweep: dict[float, Run], mode: str) -> float:
  """The learning rate whose seed-0 run is best (see ``_rank_key``)."""
  return min(sweep, key=lambda lr: _rank_key(sweep[lr], mode, lr))


def _stats(values: Sequence[Optional[float]]) -> dict[str, Any]:
  finite = [float(v) for v in values if v is not None and math.isfinite(v)]
  return {"mean": float(np.mean(finite)) if finite else None,
          "std": float(np.std(finite, ddof=1)) if len(finite) > 1 else
          (0.0 if finite else None),
          "n": len(finite), "values": [None if v is None or not math.isfinite(v)
                                       else float(v) for v in values]}


def _curve(runs: Sequence[Run], which: str, max_points: int = 200) -> dict:
  """Mean and std over seeds of a curve, on at most ``max_points`` steps."""
  steps = getattr(runs[0], which)[0]
  values = np.stack([getattr(r, which)[1] for r in runs])
  idx = np.unique(np.linspace(0, len(steps) - 1, min(max_points, len(steps)))
                  .astype(int))
  with np.errstate(invalid="ignore"):
    mean, std = np.nanmean(values, 0), np.nanstd(values, 0)
  clean = lambda a: [None if not math.isfinite(x) else float(x) for x in a]
  return {"steps": [int(s) for s in steps[idx]], "mean": clean(mean[idx]),
          "std": clean(std[idx])}


def summarize(runs: Sequence[Run], lr: float, task) -> dict[str, Any]:
  """Per-optimizer (or per-variant) statistics over seeds."""
  stt = [r.steps_to_target for r in runs]
  out = {
      "lr": lr,
      "seeds": [r.seed for r in runs],
      "final": _stats([r.final for r in runs]),
      "steps_to_target": _stats([None if s is None else float(s) for s in stt]),
      "reached_target": sum(s is not None for s in stt),
      "wall_time_s": _stats([r.wall_time_s for r in runs]),
      "wall_time_warm_s": _stats([r.wall_time_s for r in runs[1:]] if
                                 task.kind == "example" and len(runs) > 1
                                 else [r.wall_time_s for r in runs]),
      "explosion_rate": _stats([r.explosion_rate for r in runs]),
      "final_train_loss": _stats([float(np.mean(r.loss_curve[1][-10:]))
                                  for r in runs]),
      "loss_curve": _curve(runs, "loss_curve"),
      "metric_curve": _curve(runs, "metric_curve"),
  }
  for key in sorted({k for r in runs for k in r.extra}):
    out[key] = _stats([r.extra.get(key) for r in runs])
  return out


def benchmark_task(task, optimizers: Sequence[str], seeds: Sequence[int],
                   quick: bool, log) -> tuple[dict, dict[str, list[Run]]]:
  """The learning-rate sweep and the seed runs of every optimizer on ``task``."""
  results, all_runs = {}, {}
  for opt in optimizers:
    grid = task.lr_grid(opt, quick)
    sweep_seeds = seeds if task.sweep_all_seeds else seeds[:1]
    sweep = {lr: task.run(opt, lr, sweep_seeds) for lr in grid}
    lr = choose_lr({lr: runs[0] for lr, runs in sweep.items()}, task.mode)
    runs = sweep[lr] if task.sweep_all_seeds else (
        sweep[lr] + task.run(opt, lr, seeds[1:]))
    all_runs[opt] = runs
    results[opt] = summarize(runs, lr, task)
    results[opt]["lr_grid"] = list(grid)
    results[opt]["sweep_seed0"] = {repr(g): {"final": sweep[g][0].final,
                                             "tiebreak": sweep[g][0].tiebreak}
                                   for g in grid}
    r = results[opt]
    log(f"  {task.name:10s} {opt:6s} lr={lr:<7g} {task.metric}="
        f"{_fmt(r['final']['mean'])}+-{_fmt(r['final']['std'])} "
        f"steps->target {_fmt(r['steps_to_target']['mean'])} "
        f"({r['reached_target']}/{len(seeds)}) "
        f"explode {_fmt(r['explosion_rate']['mean'])} "
        f"wall {_fmt(r['wall_time_s']['mean'])}s")
  return results, all_runs


def ablate_task(task, lr: float, preset_runs: Sequence[Run],
                seeds: Sequence[int], variants: Sequence[str], log) -> dict:
  """Each ablation variant of the preset at the preset's learning rate."""
  results = {}
  for name in variants:
    kwargs, _ = ABLATIONS[name]
    runs = (list(preset_runs[:len(seeds)]) if name == "preset"
            else task.run("grpo", lr, seeds, kwargs))
    results[name] = summarize(runs, lr, task)
    results[name]["grpo_kwargs"] = {k: v for k, v in kwargs.items()}
    r = results[name]
    log(f"  {task.name:10s} {name:18s} {task.metric}="
        f"{_fmt(r['final']['mean'])}+-{_fmt(r['final']['std'])} "
        f"steps->target {_fmt(r['steps_to_target']['mean'])} "
        f"({r['reached_target']}/{len(seeds)}) "
        f"wall {_fmt(r['wall_time_s']['mean'])}s")
  return results


# --------------------------------------------------------------- output


def _fmt(x, digits: int = 4) -> str:
  if x is None or (isinstance(x, float) and not math.isfinite(x)):
    return "n/a"
  if isinstance(x, (int, np.integer)) or float(x).is_integer() and abs(x) >= 1:
    return f"{x:.0f}" if abs(x) >= 1 else f"{x:g}"
  ax = abs(x)
  if ax != 0 and (ax < 1e-3 or ax >= 1e5):
    return f"{x:.2e}"
  return f"{x:.{digits}g}"


def _pm(stats: dict) -> str:
  if stats["mean"] is None:
    return "diverged" if stats["values"] else "n/a"
  bad = sum(v is None for v in stats["values"])
  text = f"{_fmt(stats['mean'])} ± {_fmt(stats['std'])}"
  return text + (f" ({bad} diverged)" if bad else "")


def _stt(r: dict, n: int, task_steps: int) -> str:
  if not r["reached_target"]:
    return f"not reached in {task_steps}"
  text = _pm(r["steps_to_target"]).split(" (")[0]
  return text + ("" if r["reached_target"] == n else
                 f" ({r['reached_target']}/{n} reached)")


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


def convergence_markdown(report: dict) -> str:
  """The human-readable tables of ``convergence.json``."""
  meta = report["meta"]
  lines = ["# Convergence: GRPO preset vs optax baselines", "",
           f"Command: `{meta['command']}` ({meta['date']}, {meta['device']}, "
           f"jax {meta['jax']}, optax {meta['optax']}); total "
           f"{meta['total_seconds']:.0f} s.", "",
           f"Seeds: {meta['seeds']}. Learning rate: the best final metric of "
           "seed 0 over the grid (ties: tie-break metric), then every seed at "
           "that rate. Mean ± sample std over seeds. Steps to target: first "
           "evaluation that reaches it, mean over the seeds that do. "
           f"Explosion rate: fraction of steps with raw gradient global norm "
           f"> {EXPLOSION_NORM:g}. Wall time: per seed; for the examples it is "
           "the example's `wall_time_s` (data, compile, train, eval), "
           "averaged over seeds 1.. (compilation cached).", ""]
  for name, task in report["tasks"].items():
    n = len(meta["seeds"])
    lines += [f"## {name}", "", f"{task['description']}. Budget "
              f"{task['settings']['steps']} steps; schedule "
              f"{task['settings']['schedule']}. Target: {task['target_text']}.",
              ""]
    if "command" in task["settings"]:
      lines += [f"Example command: `{task['settings']['command']}`", ""]
    lines += [f"| optimizer | lr grid | chosen lr | final {task['metric']} | "
              "steps to target | explosion rate | wall s |",
              "|---|---|---|---|---|---|---|"]
    for opt, r in task["results"].items():
      lines.append(
          f"| {opt} | {', '.join(_fmt(g) for g in r['lr_grid'])} | "
          f"{_fmt(r['lr'])} | {_pm(r['final'])} | "
          f"{_stt(r, n, task['settings']['steps'])} | "
          f"{_pm(r['explosion_rate'])} | {_fmt(r['wall_time_warm_s']['mean'], 3)} |")
    extras = [k for k in next(iter(task["results"].values()))
              if k in ("eval_loss", "eval_masked_accuracy", "grpo_clip_rate")]
    extras += [k for k in ("grpo_kept_fraction", "grpo_lr_scale")
               if k in task["results"].get("grpo", {})]
    if extras or "grpo_clip_rate" in task["results"].get("grpo", {}):
      lines += ["", "| optimizer | " + " | ".join(extras) + " |",
                "|---|" + "---|" * len(extras)]
      for opt, r in task["results"].items():
        lines.append(f"| {opt} | " + " | ".join(
            _pm(r[k]) if k in r else "" for k in extras) + " |")
      if "grpo_clip_rate" in task["results"].get("grpo", {}):
        lines += ["", "GRPO's own clip rate (`grpo_optax.metrics(opt_state)"
                  "['clip/clip_rate']`): "
                  + _pm(task["results"]["grpo"]["grpo_clip_rate"]) + "."]
    lines += ["", f"![{name}](convergence_{name}.png)", ""]
  return "\n".join(lines)


def ablation_markdown(report: dict) -> str:
  """The human-readable tables of ``ablation.json``."""
  meta = report["meta"]
  lines = ["# Ablation of the GRPO preset", "",
           f"Command: `{meta['command']}`. Each row is the preset at the "
           "learning rate chosen for it in the convergence benchmark, with "
           "one mechanism changed. Δ = variant − preset (final metric means). "
           "Wall time: per seed; on the examples with one seed it includes "
           "compiling each variant's step.",
           ""]
  for name, task in report["tasks"].items():
    preset = task["variants"].get("preset")
    n = len(task["seeds"])
    lines += [f"## {name}", "", f"lr {_fmt(task['lr'])}, seeds "
              f"{task['seeds']}, target {task['target_text']}.", "",
              f"| variant | change | final {task['metric']} | Δ vs preset | "
              "steps to target | wall s |", "|---|---|---|---|---|---|"]
    for var, r in task["variants"].items():
      delta = (r["final"]["mean"] - preset["final"]["mean"]
               if preset and r["final"]["mean"] is not None
               and preset["final"]["mean"] is not None else None)
      lines.append(
          f"| {var} | {ABLATIONS[var][1]} | {_pm(r['final'])} | "
          f"{'' if var == 'preset' else _fmt(delta)} | "
          f"{_stt(r, n, task['steps'])} | {_fmt(r['wall_time_s']['mean'], 3)} |")
    lines += ["", f"![{name}](ablation_{name}.png)", ""]
  return "\n".join(lines)


def plot_curves(path: str, title: str, series: dict[str, dict], metric: str,
                log_loss: bool, log_metric: bool, target: Optional[float]) -> None:
  """Two panels: training loss and metric (mean ± std over seeds)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for ax, key, ylabel, log in ((axes[0], "loss_curve", "training loss", log_loss),
                               (axes[1], "metric_curve", metric, log_metric)):
    for name, r in series.items():
      c = r[key]
      steps = np.asarray(c["steps"])
      mean = np.asarray([np.nan if v is None else v for v in c["mean"]])
      std = np.asarray([np.nan if v is None else v for v in c["std"]])
      line, = ax.plot(steps, mean, label=name, lw=1.2)
      ax.fill_between(steps, mean - std, mean + std, alpha=0.15,
                      color=line.get_color())
    if key == "metric_curve" and target is not None:
      ax.axhline(target, color="k", ls=":", lw=1, label="target")
    if log:
      ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
  axes[1].legend(fontsize=7)
  fig.suptitle(textwrap.fill(title, 100), fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


# ------------------------------------------------------------------ main


def _log_metric(task) -> bool:
  """Log-scale metric axis for the minimised objectives of the problems."""
  return task.mode == "min" and task.kind == "problem"


def build_tasks(names: Sequence[str], quick: bool, steps: Optional[int]):
  problems = problems_lib.all_problems(quick)
  tasks = []
  for name in names:
    if name in problems:
      tasks.append(ProblemTask(problems[name], steps))
    elif name in EXAMPLES:
      tasks.append(ExampleTask(EXAMPLES[name], quick, steps))
    else:
      raise ValueError(f"unknown task {name!r}; choose from "
                       f"{sorted(problems) + sorted(EXAMPLES)}")
  return tasks


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog="python -m benchmarks.convergence",
      description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="2 seeds, halved problem budgets, shorter example "
                      "runs at one learning rate each, no example ablation "
                      "(< 10 min on 2 CPU cores)")
  parser.add_argument("--out", default="benchmarks/results")
  parser.add_argument("--tasks", default="rosenbrock,quadratic,logistic,resnet,bert",
                      help="comma-separated subset")
  parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
  parser.add_argument("--seeds", type=int, default=None,
                      help="number of seeds (default 5, quick 2)")
  parser.add_argument("--steps", type=int, default=None,
                      help="override every task's step budget (tests)")
  parser.add_argument("--ablation", default=None,
                      help="comma-separated variants, 'none', or default: all "
                      f"({','.join(ABLATIONS)})")
  parser.add_argument("--example-ablation-seeds", type=int, default=None,
                      help="seeds of the example-task ablation (default 1, "
                      "quick 0 = skipped)")
  parser.add_argument("--render-only", action="store_true",
                      help="only rewrite the Markdown and PNG files from the "
                      "JSON already in --out")
  parser.add_argument("--cache-dir", default=os.path.join(
      tempfile.gettempdir(), "grpo_optax_benchmark_jax_cache"),
                      help="persistent XLA compilation cache ('' = off)")
  args = parser.parse_args(argv)
  args.tasks = [t for t in args.tasks.split(",") if t]
  args.optimizers = [o for o in args.optimizers.split(",") if o]
  bad = set(args.optimizers) - set(OPTIMIZERS)
  if bad:
    parser.error(f"unknown optimizers {sorted(bad)}; choose from {OPTIMIZERS}")
  if args.ablation is None:
    args.ablation = list(ABLATIONS)
  elif args.ablation == "none":
    args.ablation = []
  else:
    args.ablation = [v for v in args.ablation.split(",") if v]
    bad = set(args.ablation) - set(ABLATIONS)
    if bad:
      parser.error(f"unknown ablation variants {sorted(bad)}")
  if args.ablation and "grpo" not in args.optimizers:
    parser.error("the ablation needs grpo among --optimizers")
  if args.seeds is None:
    args.seeds = 2 if args.quick else 5
  if args.example_ablation_seeds is None:
    args.example_ablation_seeds = 0 if args.quick else 1
  return args


def render(out: str) -> dict:
  """Rewrites the Markdown and PNG files from the JSON files in ``out``."""
  with open(os.path.join(out, "convergence.json")) as f:
    report = json.load(f)
  with open(os.path.join(out, "convergence.md"), "w") as f:
    f.write(convergence_markdown(report))
  for name, task in report["tasks"].items():
    log_metric = task["mode"] == "min" and task["kind"] == "problem"
    plot_curves(os.path.join(out, f"convergence_{name}.png"),
                f"{name}: {task['description']}", task["results"],
                task["metric"], log_loss=True, log_metric=log_metric,
                target=task["target"])
  path = os.path.join(out, "ablation.json")
  if os.path.exists(path):
    with open(path) as f:
      ablation = json.load(f)
    with open(os.path.join(out, "ablation.md"), "w") as f:
      f.write(ablation_markdown(ablation))
    for name, task in ablation["tasks"].items():
      kind = report["tasks"].get(name, {}).get("kind", "problem")
      plot_curves(os.path.join(out, f"ablation_{name}.png"),
                  f"ablation on {name} (grpo lr {task['lr']:g})",
                  task["variants"], task["metric"], log_loss=True,
                  log_metric=task["mode"] == "min" and kind == "problem",
                  target=report["tasks"].get(name, {}).get("target"))
  return report


def main(argv=None) -> dict:
  """Runs the benchmark; returns the convergence report."""
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse_args(argv)
  if args.render_only:
    return render(args.out)
  if args.cache_dir:
    jax.config.update("jax_compilation_cache_dir", args.cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  start = time.time()
  log = lambda msg: print(f"[{time.time() - start:6.0f}s] {msg}", flush=True)
  os.makedirs(args.out, exist_ok=True)
  seeds = list(range(args.seeds))
  meta = {
      "command": "python -m benchmarks.convergence " + " ".join(argv),
      "date": time.strftime("%Y-%m-%d %H:%M"),
      "device": f"{jax.devices()[0].device_kind} ({platform.machine()}, "
                f"{os.cpu_count()} cpus)",
      "backend": jax.default_backend(), "jax": jax.__version__,
      "optax": optax.__version__, "quick": args.quick, "seeds": seeds,
      "optimizers": {"grpo": "grpo_optax.grpo(lr), default knobs",
                     "sgd": "optax.sgd(lr, momentum=0.9)",
                     "adam": "optax.adam(lr)",
                     "adamw": f"optax.adamw(lr, weight_decay={ADAMW_WEIGHT_DECAY})",
                     "nadam": "optax.nadam(lr)"},
      "explosion_norm": EXPLOSION_NORM,
  }
  report = {"meta": meta, "tasks": {}}
  ablation = {"meta": meta, "tasks": {}}
  def save():
    # Written after every stage, so an interrupted run keeps what it measured.
    meta["total_seconds"] = time.time() - start
    write_json(os.path.join(args.out, "convergence.json"), report)
    with open(os.path.join(args.out, "convergence.md"), "w") as f:
      f.write(convergence_markdown(report))
    if ablation["tasks"]:
      write_json(os.path.join(args.out, "ablation.json"), ablation)
      with open(os.path.join(args.out, "ablation.md"), "w") as f:
        f.write(ablation_markdown(ablation))

  tasks = build_tasks(args.tasks, args.quick, args.steps)
  grpo_runs = {}
  for task in tasks:  # Phase 1: every optimizer on every task.
    log(f"task {task.name}: {task.description}")
    task_start = time.time()
    results, runs = benchmark_task(task, args.optimizers, seeds, args.quick, log)
    grpo_runs[task.name] = runs.get("grpo")
    report["tasks"][task.name] = {
        "kind": task.kind, "description": task.description,
        "settings": task.settings, "metric": task.metric, "mode": task.mode,
        "target": task.target, "target_text": task.target_text,
        "results": results, "seconds": time.time() - task_start}
    plot_curves(os.path.join(args.out, f"convergence_{task.name}.png"),
                f"{task.name}: {task.description}", results, task.metric,
                log_loss=True, log_metric=_log_metric(task), target=task.target)
    save()
  for task in tasks:  # Phase 2: the ablation of the preset.
    ab_seeds = (seeds[:args.example_ablation_seeds] if task.kind == "example"
                else seeds)
    if not (args.ablation and ab_seeds):
      continue
    log(f"ablation on {task.name}")
    ab_start = time.time()
    lr = report["tasks"][task.name]["results"]["grpo"]["lr"]
    variants = ablate_task(task, lr, grpo_runs[task.name], ab_seeds,
                           args.ablation, log)
    ablation["tasks"][task.name] = {
        "description": task.description, "metric": task.metric,
        "mode": task.mode, "target_text": task.target_text, "lr": lr,
        "seeds": ab_seeds, "steps": task.steps, "variants": variants,
        "seconds": time.time() - ab_start}
    plot_curves(os.path.join(args.out, f"ablation_{task.name}.png"),
                f"ablation on {task.name} (grpo lr {lr:g})", variants,
                task.metric, log_loss=True, log_metric=_log_metric(task),
                target=task.target)
    save()
  log(f"done in {time.time() - start:.0f} s; wrote {args.out}/convergence.json,"
      " .md, .png" + (" and ablation.*" if ablation["tasks"] else ""))
  return report


if __name__ == "__main__":
  main()
