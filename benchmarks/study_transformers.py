"""Defaults on transformers: which ``grpo()`` configuration earns its cost.

The phase ``python -m benchmarks.study --phase transformers`` of the defaults
study (issue 34). Every candidate below and three optax baselines run on the
transformer-shaped tasks (:mod:`benchmarks.transformer_tasks`: ``gpt4``,
``gpt8``, ``mlm4``) and on the convergence suite
(:mod:`benchmarks.problems`), each at 4 learning rates (:data:`SUITE_LRS`,
:data:`benchmarks.transformer_tasks.LRS`) x 3 seeds, constant rate, the
tasks' full budgets. A task's score of an optimizer is its best, over the
learning rates, mean over seeds of the held-out loss after the last step
(``gpt4``, ``gpt8``, ``mlm4``, ``bert``, ``resnet``, ``logistic``) or, where
the task has no held-out split, of the smoothed final training loss (the
mean over the last 10% of the steps; ``teacher`` draws fresh data every
step); a learning rate at which a seed diverged does not count. The ratio of
a score to the best baseline's score on the task (the lowest of Adam, NAdam
and AdamW) is the candidate's quality on that task.

Candidates (:data:`CANDIDATES`, ``grpo(lr, **kwargs)`` in the form it picks):
dense (clipping at norm 1 + the NAdam room, ``sparsify=None``); the sampled
top-k with error feedback at fractions 0.1, 0.3 (today's default) and 0.5,
each with ``min_size`` 1,024 (today) and 0 (every leaf); the EMA threshold
mask; importance weighting and the variance rate, each on top of dense and
of today's top-k. Baselines: ``optax.adam``, ``optax.nadam``,
``optax.adamw(lr, weight_decay=1e-4)``.

Costs, per optimizer, measured in one process on a transformer-shaped tree
(:func:`benchmarks.transformer_tasks.gpt_shapes`, by default 8 blocks of
width 256, vocabulary 4,096: 134 leaves, 8.4M float32 parameters):

* step time: the jitted, donated ``update`` + ``apply_updates``, median over
  interleaved rounds with an ``optax.adam`` run set up beside it; reported as
  the ratio to that Adam;
* compile time: trace + lower + compile of the same step, persistent
  compilation cache off and in-memory caches cleared, minimum of two, as a
  ratio to Adam's measured in turn with it;
* state bytes per parameter: every array of ``jax.tree.leaves(tx.init(params))``
  (param-sized or not, keys and counters included), over the parameter count.

Decision rule (stated before the runs; :func:`choose` applies it):

1. A candidate is eligible if it has a score on every task (at least one
   learning rate at which no seed diverged).
2. Its quality is the geometric mean, over all tasks, of its ratio to the
   best baseline on the task.
3. The candidates whose geometric mean is within 0.5% of the best one
   (``g <= 1.005 g_best``) are tied; among them the one with the fewest state
   bytes per parameter (rounded to 0.1 byte) wins, then the lowest step-time
   ratio to Adam, then the lower geometric mean.
4. The winner's keywords are ``grpo()``'s defaults. If they differ from
   today's, the change is a breaking one (CHANGELOG, version bump, the
   README's quick start and examples re-measured); the study does not
   change the library itself.

Run (results under ``--out``, default ``benchmarks/results``:
``defaults_transformers.json``, ``.md`` and ``.png``)::

  python -m benchmarks.study --phase transformers [--quick] [--resume]

``--tasks``, ``--candidates``, ``--seeds`` and ``--steps`` narrow the run
(smoke tests); ``--resume`` reuses the runs already in the JSON when their
settings match; ``--render-only`` rewrites the Markdown and PNG.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

import grpo_optax
from benchmarks import command as command_lib
from benchmarks import convergence
from benchmarks import problems as problems_lib
from benchmarks import transformer_tasks

TIE = 0.005  # Geometric means within 0.5% of the best are tied.
STATE_ROUND = 0.1  # State bytes per parameter compared to 0.1 byte.
SEEDS = 3
STEM = "defaults_transformers"

BASELINES: dict[str, Callable] = {
  "adam": optax.adam,
  "nadam": optax.nadam,
  "adamw": lambda lr: optax.adamw(
    lr, weight_decay=convergence.ADAMW_WEIGHT_DECAY
  ),
}
BASELINE_TEXT = {
  "adam": "optax.adam(lr)",
  "nadam": "optax.nadam(lr)",
  "adamw": f"optax.adamw(lr, weight_decay={convergence.ADAMW_WEIGHT_DECAY:g})",
}

# name -> (grpo() keywords, what it is).
CANDIDATES: dict[str, tuple[dict[str, Any], str]] = {
  "dense": ({"sparsify": None}, "clip at norm 1 + NAdam, no mask"),
  "topk_0.1": ({"fraction": 0.1}, "top-k 10% + error feedback"),
  "topk_0.3": ({}, "top-k 30% + error feedback: today's grpo()"),
  "topk_0.5": ({"fraction": 0.5}, "top-k 50% + error feedback"),
  "topk_0.1_all": (
    {"fraction": 0.1, "min_size": 0},
    "top-k 10%, every leaf masked",
  ),
  "topk_0.3_all": ({"min_size": 0}, "top-k 30%, every leaf masked"),
  "topk_0.5_all": (
    {"fraction": 0.5, "min_size": 0},
    "top-k 50%, every leaf masked",
  ),
  "threshold": ({"sparsify": "threshold"}, "EMA threshold mask"),
  "dense_importance": (
    {"sparsify": None, "importance": True},
    "dense + Taylor importance weighting",
  ),
  "dense_variance": (
    {"sparsify": None, "variance_coef": 0.1},
    "dense + the variance rate (coef 0.1)",
  ),
  "topk_importance": (
    {"importance": True},
    "top-k 30% + Taylor importance weighting",
  ),
  "topk_variance": (
    {"variance_coef": 0.1},
    "top-k 30% + the variance rate (coef 0.1)",
  ),
}

# 4 learning rates per task of the convergence suite: the 1-3-10 ladder
# around the best rates (by training loss) of Adam, NAdam and grpo() in
# benchmarks/results/convergence.json, every one of them inside the window.
SUITE_LRS = {
  "linreg": (3e-3, 1e-2, 3e-2, 1e-1),
  "teacher": (3e-3, 1e-2, 3e-2, 1e-1),
  "logistic": (1e-2, 3e-2, 1e-1, 3e-1),
  "matfac": (1e-2, 3e-2, 1e-1, 3e-1),
  "autoencoder": (1e-3, 3e-3, 1e-2, 3e-2),
  "charlm": (1e-3, 3e-3, 1e-2, 3e-2),
  "rosenbrock": (1e-2, 3e-2, 1e-1, 3e-1),
  "resnet": (1e-3, 3e-3, 1e-2, 3e-2),
  "bert": (3e-4, 1e-3, 3e-3, 1e-2),
}
TASKS: dict[str, Callable[[], problems_lib.Task]] = {
  **transformer_tasks.TASKS,
  **{name: problems_lib.TASKS[name] for name in SUITE_LRS},
}


def task(name: str) -> problems_lib.Task:
  """The task with the study's 4 learning rates."""
  t = TASKS[name]()
  if name in SUITE_LRS:
    t = dataclasses.replace(t, lrs=SUITE_LRS[name])
  return t


def heldout_metric(t: problems_lib.Task) -> str | None:
  """``"loss"`` if the task evaluates a held-out loss, else None."""
  if t.evaluate is None or t.eval_every <= 0:
    return None
  metrics = jax.eval_shape(
    lambda key: t.evaluate(*t.init(key)), jax.random.key(0)
  )
  return "loss" if "loss" in metrics else None


def factories(candidates) -> dict[str, Callable]:
  """``name -> lr -> transform`` of the baselines and the candidates."""
  out = dict(BASELINES)
  for name in candidates:
    kwargs = CANDIDATES[name][0]
    out[name] = lambda lr, kw=kwargs: grpo_optax.grpo(lr, **kw)
  return out


# ------------------------------------------------------------- the rule


def summarise(
  scores: Mapping[str, Mapping[str, float | None]],
  baselines=tuple(BASELINES),
) -> dict[str, dict[str, Any]]:
  """Ratios to the best baseline per task, and their geometric mean.

  Args:
    scores: ``optimizer -> task -> score`` (lower is better; None: diverged
      at every learning rate).
    baselines: the optimizers whose best score per task is the reference.

  Returns:
    ``optimizer -> {"ratios": {task: ratio | None}, "geomean", "max",
    "worst_task"}``; ``geomean`` and ``max`` are None unless every task has a
    ratio.
  """
  tasks = sorted({t for per in scores.values() for t in per})
  reference = {}
  for t in tasks:
    values = [scores[b].get(t) for b in baselines if b in scores]
    values = [v for v in values if v is not None]
    reference[t] = min(values) if values else None
  out = {}
  for opt, per in scores.items():
    ratios = {
      t: (per[t] / reference[t])
      if per.get(t) is not None and reference[t]
      else None
      for t in tasks
    }
    finite = {t: r for t, r in ratios.items() if r is not None}
    complete = len(finite) == len(tasks)
    worst = max(finite, key=finite.get) if finite else None
    out[opt] = {
      "ratios": ratios,
      "geomean": convergence.geomean(list(ratios.values())),
      "max": finite[worst] if complete and worst else None,
      "worst_task": worst,
    }
  return out


def choose(
  candidates: Mapping[str, Mapping[str, Any]], tie: float = TIE
) -> dict[str, Any]:
  """The decision rule of the module docstring, applied to measured results.

  Args:
    candidates: ``name -> {"geomean": float | None,
      "state_bytes_per_param": float, "step_ratio": float}`` (other keys are
      ignored); only ``grpo()`` candidates, not the baselines.
    tie: relative width of a tie on the geometric mean.

  Returns:
    ``{"name": winner, "tied": [names, best first], "eligible": [...],
    "best_geomean": float}``.

  Raises:
    ValueError: when no candidate is eligible.
  """
  eligible = {
    n: c
    for n, c in candidates.items()
    if c.get("geomean") is not None and math.isfinite(c["geomean"])
  }
  if not eligible:
    raise ValueError("no candidate has a score on every task")
  best = min(c["geomean"] for c in eligible.values())

  def cost(n):
    c = eligible[n]
    state = round(c["state_bytes_per_param"] / STATE_ROUND) * STATE_ROUND
    return (state, c["step_ratio"], c["geomean"], n)

  tied = sorted(
    (n for n, c in eligible.items() if c["geomean"] <= best * (1 + tie)),
    key=cost,
  )
  return {
    "name": tied[0],
    "tied": tied,
    "eligible": sorted(eligible),
    "best_geomean": best,
  }


# ---------------------------------------------------------------- costs


def cost_tree(blocks: int = 8, width: int = 256, vocab: int = 4096):
  """Float32 params shaped like ``gpt_shapes`` (values 0.02)."""
  shapes = transformer_tasks.gpt_shapes(
    blocks, width, 4 * width, vocab, context=width
  )
  return jax.tree.map(
    lambda s: jnp.full(s, 0.02, jnp.float32),
    shapes,
    is_leaf=lambda x: isinstance(x, tuple),
  )


def state_bytes(tx: optax.GradientTransformation, params) -> int:
  """Bytes of every array of ``tx.init(params)`` (keys: their key data)."""
  total = 0
  for x in jax.tree.leaves(jax.eval_shape(tx.init, params)):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      data = jax.eval_shape(
        jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype)
      )
      total += data.size * data.dtype.itemsize
    else:
      total += x.size * x.dtype.itemsize
  return total


def _donated_step(tx):
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=(0, 1))


def _compile_seconds(tx, params, grads) -> float:
  jax.clear_caches()
  state = jax.eval_shape(tx.init, params)
  t0 = time.perf_counter()
  _donated_step(tx).lower(params, state, grads).compile()
  return time.perf_counter() - t0


def _timed_runs(txs, params, grads, rounds: int, iters: int):
  """Median seconds of each transform's step, interleaved round-robin."""
  runs = []
  for tx in txs:
    step = _donated_step(tx)
    p = jax.tree.map(jnp.copy, params)
    s = tx.init(p)
    p, s = step(p, s, grads)  # Compiles; not timed.
    jax.block_until_ready(p)
    runs.append({"step": step, "p": p, "s": s, "times": []})
  for _ in range(rounds):
    for r in runs:
      for _ in range(iters):
        t0 = time.perf_counter()
        r["p"], r["s"] = r["step"](r["p"], r["s"], grads)
        jax.block_until_ready(r["p"])
        r["times"].append(time.perf_counter() - t0)
  return [statistics.median(r["times"]) for r in runs]


def measure_costs(
  makers: Mapping[str, Callable],
  params,
  *,
  rounds: int = 5,
  iters: int = 4,
  log=print,
) -> dict[str, dict[str, float]]:
  """Step time, compile time and state bytes of each ``lr -> tx``.

  Each optimizer is paired with its own ``optax.adam``: step times
  interleaved round by round, compile times measured in turn (twice each,
  the minimum kept); the ratios are to that Adam.
  """
  n = sum(x.size for x in jax.tree.leaves(params))
  p_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  grads = jax.tree.map(lambda x: 1e-2 * jnp.cos(x + 0.1), params)
  out = {}
  for name, make in makers.items():
    tx, adam = make(1e-3), optax.adam(1e-3)
    compiles = {"tx": [], "adam": []}
    for _ in range(2):
      compiles["adam"].append(_compile_seconds(adam, params, grads))
      compiles["tx"].append(_compile_seconds(tx, params, grads))
    ms, adam_ms = _timed_runs([tx, adam], params, grads, rounds, iters)
    sb = state_bytes(tx, params)
    out[name] = {
      "step_ms": ms * 1e3,
      "adam_step_ms": adam_ms * 1e3,
      "step_ratio": ms / adam_ms,
      "compile_s": min(compiles["tx"]),
      "adam_compile_s": min(compiles["adam"]),
      "compile_ratio": min(compiles["tx"]) / min(compiles["adam"]),
      "state_bytes_per_param": sb / n,
      "state_x_params": sb / p_bytes,
    }
    c = out[name]
    log(
      f"  cost {name:18s} step x{c['step_ratio']:.2f} adam, compile "
      f"x{c['compile_ratio']:.2f}, state {c['state_bytes_per_param']:.2f} "
      "B/param"
    )
  return out


# ------------------------------------------------------------------ runs


def run_tasks(args, report: dict, save: Callable[[], None], log) -> None:
  """Sweeps every optimizer on every task (task by task), saving as it goes;
  a run already in ``report`` with the same learning rates, seeds and steps
  is kept.
  """
  runs = report.setdefault("runs", {})
  makers = factories(args.candidates)
  for tname in args.tasks:
    t = task(tname)
    steps = args.steps or (t.quick_steps if args.quick else t.steps)
    seeds = list(range(args.seeds))
    metric = heldout_metric(t)
    report["tasks"][tname] = {
      "description": t.description,
      "steps": steps,
      "seeds": seeds,
      "lrs": list(t.lrs),
      "metric": "training loss" if metric is None else f"held-out {metric}",
      "info": t.info,
    }
    log(f"task {tname}: {t.description}; {steps} steps, seeds {seeds}")
    for opt, make in makers.items():
      prev = runs.get(opt, {}).get(tname)
      if prev and (prev["lrs"], prev["seeds"], prev["steps"]) == (
        list(t.lrs),
        seeds,
        steps,
      ):
        continue
      result = convergence.sweep_task(
        t,
        make,
        seeds,
        steps,
        log,
        opt,
        heldout=metric is not None,
        select=metric,
      )
      result.pop("loss_curve", None)  # Kept small: the scores are the point.
      runs.setdefault(opt, {})[tname] = result
      save()


def analyse(report: dict, candidates) -> None:
  """Adds ``summary`` (ratios, geometric means, costs) and ``decision``."""
  tasks = list(report["tasks"])
  scores = {
    opt: {t: per[t]["best"]["mean"] for t in tasks if t in per}
    for opt, per in report["runs"].items()
    if opt in BASELINES or opt in candidates
  }
  summary = summarise(scores)
  for opt, entry in summary.items():
    entry.update(report.get("costs", {}).get(opt, {}))
    entry["edge"] = [
      t for t in tasks if not report["runs"][opt].get(t, {}).get("interior")
    ]
    if opt in candidates:
      entry["grpo_kwargs"] = CANDIDATES[opt][0]
  report["summary"] = summary
  costed = {
    n: summary[n]
    for n in candidates
    if n in summary and "state_bytes_per_param" in summary[n]
  }
  try:
    report["decision"] = choose(costed)
  except ValueError as e:
    report["decision"] = {"name": None, "reason": str(e)}
  else:
    report["decision"]["grpo_kwargs"] = CANDIDATES[report["decision"]["name"]][
      0
    ]
    report["decision"]["changes_defaults"] = bool(
      report["decision"]["grpo_kwargs"]
    )


# --------------------------------------------------------------- output

RULE_TEXT = (
  "eligible: a score on every task; quality: the geometric mean over the "
  "tasks of the ratio to the best baseline's score; the candidates within "
  f"{TIE:.1%} of the best geometric mean are tied, and the one with the "
  f"fewest state bytes per parameter (to {STATE_ROUND:g} byte) wins, then "
  "the lowest step-time ratio to Adam, then the lower geometric mean"
)


def _kwargs_text(kwargs: Mapping[str, Any]) -> str:
  return "grpo(lr" + "".join(f", {k}={v!r}" for k, v in kwargs.items()) + ")"


def _cost_cells(entry: Mapping[str, Any]) -> list[str]:
  if "state_bytes_per_param" not in entry:
    return [""] * 4
  return [
    f"{entry['state_bytes_per_param']:.2f}",
    f"{entry['state_x_params']:.2f}",
    f"{entry['step_ratio']:.2f}",
    f"{entry['compile_ratio']:.2f}",
  ]


def quality_table(report: dict) -> list[str]:
  """One row per optimizer: ratio per task, geometric mean, max, costs."""
  tasks = list(report["tasks"])
  # The transformer-shaped tasks' own geometric mean (not the rule's).
  shaped = [t for t in tasks if t in transformer_tasks.TASKS]
  lines = [
    "| optimizer | "
    + " | ".join(tasks)
    + " | geomean (transformers) | **geomean** | max (task) | state B/param"
    " | state / params | step x Adam | compile x Adam |",
    "|---|" + "---|" * (len(tasks) + 7),
  ]
  for opt, e in report["summary"].items():
    cells = [
      convergence._ratio(e["ratios"].get(t)) + ("*" if t in e["edge"] else "")
      for t in tasks
    ]
    worst = f"{convergence._ratio(e['max'])} ({e['worst_task']})"
    mark = "**" if opt == report.get("decision", {}).get("name") else ""
    part = convergence.geomean([e["ratios"].get(t) for t in shaped])
    lines.append(
      f"| {mark}{opt}{mark} | "
      + " | ".join(cells)
      + f" | {convergence._ratio(part) if shaped else ''}"
      + f" | **{convergence._ratio(e['geomean'])}** | {worst} | "
      + " | ".join(_cost_cells(e))
      + " |"
    )
  return lines


def decision_text(report: dict) -> list[str]:
  d = report.get("decision", {})
  if not d.get("name"):
    return [f"No decision: {d.get('reason', 'no results')}."]
  s = report["summary"]
  tied = ", ".join(f"`{n}` ({s[n]['geomean']:.4f})" for n in d["tied"])
  out = [
    f"Best geometric mean: {d['best_geomean']:.4f}. Tied within "
    f"{TIE:.1%}: {tied}. Chosen by the rule: `{d['name']}` = "
    f"`{_kwargs_text(d['grpo_kwargs'])}`.",
    "",
  ]
  if d["changes_defaults"]:
    out.append(
      "This differs from today's `grpo()` defaults (`topk_0.3`): adopting "
      "it is a breaking change (CHANGELOG entry, version bump, the README's "
      "quick start and the examples' numbers re-measured)."
    )
  else:
    out.append("Today's `grpo()` defaults (`topk_0.3`) stay.")
  return out


def markdown(report: dict) -> str:
  meta = report["meta"]
  cm = meta["costs"]
  lines = [
    "# Defaults on transformers: quality and cost of grpo()'s candidates",
    "",
    f"Command: `{meta['command']}` ({meta['date']}, {meta['device']}, jax "
    f"{meta['jax']}, optax {meta['optax']}); total "
    f"{meta.get('total_seconds', 0):.0f} s.",
    "",
    "Each cell: the optimizer's best score on the task (over the learning "
    "rates, mean over seeds; held-out loss where the task has a held-out "
    "split, else the smoothed final training loss) divided by the best "
    "baseline's (Adam, NAdam, AdamW); lower is better; * = the best learning "
    "rate is at the edge of the sweep. Costs on a transformer-shaped tree "
    f"({cm['leaves']} leaves, {cm['parameters']:,} float32 parameters): "
    "every state array's bytes per parameter and over the parameters' "
    "bytes, the donated update + apply step's time and its compile time as "
    "ratios to `optax.adam` measured beside it.",
    "",
    f"The rule, stated before the runs: {RULE_TEXT}.",
    "",
    "## Quality and cost",
    "",
    *quality_table(report),
    "",
    "Optimizers: "
    + "; ".join(f"`{k}` = {v}" for k, v in BASELINE_TEXT.items())
    + "; "
    + "; ".join(
      f"`{n}` = `{_kwargs_text(CANDIDATES[n][0])}` ({CANDIDATES[n][1]})"
      for n in report["summary"]
      if n in CANDIDATES
    )
    + ".",
    "",
    "## Decision",
    "",
    *decision_text(report),
    "",
    "## Tasks",
    "",
    "| task | what | steps | seeds | learning rates | score | s per run |",
    "|---|---|---|---|---|---|---|",
  ]
  for name, t in report["tasks"].items():
    per_run = [
      r[name]["wall_per_run_s"] for r in report["runs"].values() if name in r
    ]
    lines.append(
      f"| {name} | {t['description']} | {t['steps']} | {len(t['seeds'])} | "
      + ", ".join(f"{x:g}" for x in t["lrs"])
      + f" | {t['metric']} | {statistics.median(per_run):.2f} |"
    )
  lines += [
    "",
    "Seconds per run: the median over the optimizers of a sweep's wall "
    "time (compilation included) over its runs.",
    "",
    "## Best learning rates (* = at the edge of the sweep)",
    "",
    *best_lr_table(report),
    "",
    f"![quality against cost]({STEM}.png)",
    "",
  ]
  return "\n".join(lines)


def best_lr_table(report: dict) -> list[str]:
  tasks = list(report["tasks"])
  lines = [
    "| optimizer | " + " | ".join(tasks) + " |",
    "|---|" + "---|" * len(tasks),
  ]
  for opt in report["summary"]:
    cells = []
    for t in tasks:
      r = report["runs"][opt].get(t, {})
      lr = r.get("best_lr")
      edge = "" if r.get("interior") else "*"
      cells.append("diverged" if lr is None else f"{lr:g}{edge}")
    lines.append(f"| {opt} | " + " | ".join(cells) + " |")
  return lines


def plot(report: dict, path: str) -> None:
  """Geometric-mean ratio against each cost, one point per optimizer."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  axes_keys = (
    ("state_bytes_per_param", "optimizer state, bytes per parameter"),
    ("step_ratio", "step time / Adam's"),
    ("compile_ratio", "compile time / Adam's"),
  )
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.6), sharey=True)
  chosen = report.get("decision", {}).get("name")
  for ax, (key, label) in zip(axes, axes_keys):
    for opt, e in report["summary"].items():
      if e.get("geomean") is None or key not in e:
        continue
      color = "tab:gray" if opt in BASELINES else "tab:blue"
      color = "tab:red" if opt == chosen else color
      ax.scatter(e[key], e["geomean"], color=color, s=22)
      ax.annotate(opt, (e[key], e["geomean"]), fontsize=6.5, alpha=0.85)
    ax.axhline(1.0, color="k", lw=0.6, alpha=0.5)
    ax.set_xlabel(label, fontsize=9)
    ax.grid(True, alpha=0.3)
  axes[0].set_ylabel("geometric mean of score / best baseline's", fontsize=9)
  fig.suptitle(
    "grpo() candidates (blue; red: chosen) and baselines (gray): lower is "
    "better on both axes",
    fontsize=10,
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def save(out: str, report: dict, plot_png: bool = True) -> None:
  os.makedirs(out, exist_ok=True)
  convergence.write_json(os.path.join(out, STEM + ".json"), report)
  if "summary" in report:
    with open(os.path.join(out, STEM + ".md"), "w") as f:
      f.write(markdown(report))
    if plot_png:
      plot(report, os.path.join(out, STEM + ".png"))


# ------------------------------------------------------------------ main


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks.study --phase transformers",
    description=__doc__.splitlines()[0],
  )
  parser.add_argument("--phase", default="transformers")
  parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
  parser.add_argument(
    "--tasks",
    default=",".join(TASKS),
    help=f"comma-separated subset of {','.join(TASKS)}",
  )
  parser.add_argument(
    "--candidates",
    default=",".join(CANDIDATES),
    help=f"comma-separated subset of {','.join(CANDIDATES)}",
  )
  parser.add_argument("--seeds", type=int, default=SEEDS)
  parser.add_argument("--steps", type=int, default=None, help="smoke tests")
  parser.add_argument(
    "--quick", action="store_true", help="the tasks' half budgets"
  )
  parser.add_argument("--resume", action="store_true")
  parser.add_argument("--render-only", action="store_true")
  parser.add_argument("--no-plot", action="store_true")
  parser.add_argument("--cost-blocks", type=int, default=8)
  parser.add_argument("--cost-width", type=int, default=256)
  parser.add_argument("--cost-vocab", type=int, default=4096)
  parser.add_argument("--cost-rounds", type=int, default=5)
  parser.add_argument("--cost-iters", type=int, default=4)
  args = parser.parse_args(argv)
  args.tasks = [t for t in args.tasks.split(",") if t]
  args.candidates = [c for c in args.candidates.split(",") if c]
  for flag, got, known in (
    ("--tasks", args.tasks, TASKS),
    ("--candidates", args.candidates, CANDIDATES),
  ):
    bad = sorted(set(got) - set(known))
    if bad:
      parser.error(f"{flag}: unknown {bad}; choose from {list(known)}")
  return args


def _cost_settings(args) -> dict[str, int]:
  return {
    "blocks": args.cost_blocks,
    "width": args.cost_width,
    "vocab": args.cost_vocab,
    "rounds": args.cost_rounds,
    "iters": args.cost_iters,
  }


def _costs(args, previous: dict | None, log) -> tuple[dict, dict]:
  """The cost table (reused from ``previous`` when its settings match)."""
  params = cost_tree(args.cost_blocks, args.cost_width, args.cost_vocab)
  leaves = jax.tree.leaves(params)
  meta = {
    **_cost_settings(args),
    "leaves": len(leaves),
    "parameters": int(sum(x.size for x in leaves)),
  }
  costs = {}
  if previous and previous["meta"].get("costs") == meta:
    costs = dict(previous.get("costs", {}))
  makers = {
    k: v for k, v in factories(args.candidates).items() if k not in costs
  }
  log(f"costs on {meta['leaves']} leaves, {meta['parameters']:,} parameters")
  costs.update(
    measure_costs(
      makers, params, rounds=args.cost_rounds, iters=args.cost_iters, log=log
    )
  )
  return costs, meta


def main(argv=None) -> dict:
  argv = list(argv or [])
  args = parse_args(argv)
  path = os.path.join(args.out, STEM + ".json")
  if args.render_only:
    with open(path) as f:
      report = json.load(f)
    analyse(report, report["meta"]["candidates"])
    save(args.out, report, plot_png=not args.no_plot)
    return report
  # Compile times are measured: the persistent cache would serve them from
  # disk, so this process never reads it.
  jax.config.update("jax_enable_compilation_cache", False)
  previous = None
  if args.resume and os.path.exists(path):
    with open(path) as f:
      previous = json.load(f)
  start = time.time()
  log = lambda msg: print(f"[{time.time() - start:6.0f}s] {msg}", flush=True)
  costs, cost_meta = _costs(args, previous, log)
  report = {
    "meta": {
      "command": command_lib.command("benchmarks.study", argv),
      "date": time.strftime("%Y-%m-%d %H:%M"),
      "device": f"{jax.devices()[0].device_kind} ({platform.machine()}, "
      f"{os.cpu_count()} cpus)",
      "python": platform.python_version(),
      "jax": jax.__version__,
      "optax": optax.__version__,
      "candidates": args.candidates,
      "baselines": BASELINE_TEXT,
      "rule": RULE_TEXT,
      "costs": cost_meta,
    },
    "costs": costs,
    "tasks": {},
    "runs": dict((previous or {}).get("runs", {})),
  }
  before = (previous or {}).get("meta", {}).get("total_seconds", 0.0)

  def checkpoint():
    report["meta"]["total_seconds"] = time.time() - start + before
    convergence.write_json(path, report)

  os.makedirs(args.out, exist_ok=True)
  checkpoint()
  run_tasks(args, report, checkpoint, log)
  analyse(report, args.candidates)
  report["meta"]["total_seconds"] = time.time() - start + before
  save(args.out, report, plot_png=not args.no_plot)
  print("\n".join(quality_table(report) + [""] + decision_text(report)))
  log(f"done; wrote {os.path.join(args.out, STEM)}.json, .md, .png")
  return report
