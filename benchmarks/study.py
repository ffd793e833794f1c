"""Which of the preset's choices pay: one change at a time, then combined.

Starting from the preset as it stood before the study (:data:`TODAY`: the
articles' settings, ``grpo(lr, **ARTICLE_DEFAULTS, fused=False)``, with
clipping at norm 1 and the sampled top-k), each variant changes one choice; every variant runs on the
convergence suite (:mod:`benchmarks.problems`) with the same learning-rate
sweep, seeds, budgets and metric as :mod:`benchmarks.convergence` (best over
the sweep of the mean-over-seeds smoothed final training loss), and is scored
by its ratio to Adam's best loss per task: geometric mean over tasks and
maximum.

The choices studied:

* each mechanism on/off: clipping (``max_norm`` 1, 10 or off), importance
  weighting, the sparsifier (top-k, EMA threshold, none), the variance
  learning rate, Nesterov;
* ``adam_weight`` in {0, 0.5, 1} (RMSProp / the mix / NAdam);
* bias correction of the RMSProp part (today it is not corrected, so its
  first steps are up to ``1/sqrt(1-b2) ~ 32x`` Adam's): emulated by
  :func:`scale_by_nesterov_adam_rms_corrected`, a benchmark-local transform
  over the library's state;
* the importance weight range ``[min_weight, max_weight]``: [0.1, 10] (today),
  [0.5, 2], [0.8, 1.25];
* where the importance scale acts: before the adaptive step (today; Adam's
  per-element normalisation cancels a slowly varying per-element scale
  applied before it), after it by chaining the public transforms in the other
  order (``scale_by_nesterov_adam_rms -> scale_by_importance``, whose score
  then reads the normalised update), or after it with the weights computed
  from the raw gradient (:func:`importance_after`, benchmark-local);
* the variance learning rate per leaf (today) or per element.

Then the winners are combined greedily (:func:`greedy`): the single changes
that improved the score, best first, each kept only if the combination
improves; the score (:func:`score`) prefers configurations with no task above
1.05, then the lower geometric mean. Then a neighbourhood search: each
mechanism of the winner switched off, or on in its best single form; the best
neighbour becomes the winner if it scores better (two rounds by default). The
last round's table shows what each mechanism costs or gains in the winner.

A second phase, ``python -m benchmarks.study --phase transformers``
(:mod:`benchmarks.study_transformers`), decides ``grpo()``'s defaults on
transformer-shaped tasks beside this suite, by a rule stated before the runs.

Run: ``python -m benchmarks.study [--quick] [--resume]``; writes
``benchmarks/results/study.json`` and ``study.md`` (``--quick``: under
``benchmarks/results/quick``). Adam, NAdam and AdamW are taken from
``convergence.json`` in the same folder when its settings match, else run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Mapping
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

import grpo_optax
from benchmarks import command as command_lib
from benchmarks import convergence
from benchmarks import problems as problems_lib

MAX_RATIO = 1.05  # No task may be worse than this multiple of Adam's loss.
BASELINES = ("adam", "nadam", "adamw")


@dataclasses.dataclass(frozen=True)
class Config:
  """A GRPO variant: ``grpo(...)`` keywords plus the two structural choices.

  Attributes:
    max_norm, importance, min_weight, max_weight, sparsify, adam_weight,
    nesterov, variance_reduction: as ``grpo_optax.grpo``'s keywords.
    variance: whether the variance learning rate is on (``variance_coef``
      0.1) or off (``variance_coef=None``).
    importance_where: ``"before"`` the adaptive step (the library today),
      ``"after_chain"`` (public transforms chained after the adaptive step)
      or ``"after_raw"`` (weights from the raw gradient, applied after).
    rms_bias_correction: bias-correct the RMSProp part's second moment.
  """

  max_norm: float | None = 1.0
  importance: bool = True
  importance_where: str = "before"
  min_weight: float = 0.1
  max_weight: float = 10.0
  sparsify: str | None = "topk"
  adam_weight: float = 0.5
  nesterov: bool = True
  rms_bias_correction: bool = False
  variance: bool = True
  variance_reduction: str = "leaf"

  def normalized(self) -> Config:
    """The same optimizer with the fields that have no effect reset."""
    c = self
    if not c.importance:
      c = dataclasses.replace(
        c,
        importance_where=TODAY.importance_where,
        min_weight=TODAY.min_weight,
        max_weight=TODAY.max_weight,
      )
    if c.adam_weight == 1.0:
      c = dataclasses.replace(c, rms_bias_correction=False)
    if not c.variance:
      c = dataclasses.replace(c, variance_reduction=TODAY.variance_reduction)
    return c

  def changes(self) -> dict[str, Any]:
    """The fields that differ from :data:`TODAY`."""
    return {
      f.name: getattr(self, f.name)
      for f in dataclasses.fields(self)
      if getattr(self, f.name) != getattr(TODAY, f.name)
    }

  def grpo_kwargs(self) -> dict[str, Any]:
    """The ``grpo_optax.grpo`` keywords (structural choices excluded)."""
    kw = {
      "max_norm": self.max_norm,
      "importance": self.importance,
      "min_weight": self.min_weight,
      "max_weight": self.max_weight,
      "sparsify": self.sparsify,
      "adam_weight": self.adam_weight,
      "nesterov": self.nesterov,
      "variance_coef": 0.1 if self.variance else None,
      "variance_reduction": self.variance_reduction,
      # As the study ran: the top 30% of every leaf masked, separate stages.
      "fraction": 0.3,
      "min_size": 0,
      "fused": False,
    }
    return kw

  def library_changes(self) -> list[str]:
    """What ``grpo()`` would have to change to express this configuration."""
    out = []
    if self.importance and self.importance_where != "before":
      out.append(
        "importance weighting after the adaptive step ("
        + (
          "public transforms chained: scale_by_nesterov_adam_rms -> "
          "scale_by_importance"
          if self.importance_where == "after_chain"
          else "weights from the raw gradient, applied to the adaptive update"
        )
        + ")"
      )
    if self.rms_bias_correction and self.adam_weight < 1:
      out.append("bias-corrected second moment in the RMSProp part")
    return out


TODAY = Config()

# What the study chose (``python -m benchmarks.study --quick``, README
# "Defaults chosen by measurement"): grpo()'s defaults are these choices, run
# in the one-pass form and with leaves under 1,024 entries left dense (both
# measured by ``python -m benchmarks.convergence``).
WINNER = Config(importance=False, adam_weight=1.0, variance=False)


# ------------------------------------------------ benchmark-local pieces


class _WrappedState(NamedTuple):
  inner: Any


def scale_by_nesterov_adam_rms_corrected(
  adam_weight: float = 0.5,
  nesterov: bool = True,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
) -> optax.GradientTransformation:
  r"""``grpo_optax.scale_by_nesterov_adam_rms`` with a bias-corrected RMSProp.

  Out = ``w A + (1 - w) g / (sqrt(nu / (1 - b2^t)) + eps)``, where ``A`` and
  ``nu`` are those of the library's transform with ``adam_weight=1`` (its
  state is reused as is). Benchmark-local: it emulates a library change.
  """
  inner = grpo_optax.scale_by_nesterov_adam_rms(
    b1=b1, b2=b2, eps=eps, adam_weight=1.0, nesterov=nesterov
  )

  def init_fn(params):
    return _WrappedState(inner.init(params))

  def update_fn(updates, state, params=None, **extra):
    adam, inner_state = inner.update(updates, state.inner, params, **extra)
    bc = 1 - jnp.float32(b2) ** inner_state.count.astype(jnp.float32)
    out = jax.tree.map(
      lambda a, g, nu: (
        adam_weight * a + (1 - adam_weight) * g / (jnp.sqrt(nu / bc) + eps)
      ),
      adam,
      updates,
      inner_state.nu,
    )
    return out, _WrappedState(inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class _AfterState(NamedTuple):
  importance: Any
  inner: Any


def importance_after(
  inner: optax.GradientTransformation,
  *,
  decay: float = 0.9,
  min_weight: float = 0.1,
  max_weight: float = 10.0,
) -> optax.GradientTransformation:
  """Runs ``inner`` on the raw gradient and multiplies its output by the
  importance weights computed from the raw gradient.

  The library's ``scale_by_importance`` updates the importance state from the
  raw gradient (its own output is discarded); the weights are read back from
  that state with the library's formula
  ``clip(S_hat / (mean_leaf(S_hat) + 1e-12), min_weight, max_weight)``.
  Benchmark-local: it emulates moving the per-element scale after the
  adaptive step while keeping the score of the raw gradient.
  """
  imp = grpo_optax.scale_by_importance(
    decay=decay, min_weight=min_weight, max_weight=max_weight
  )

  def init_fn(params):
    return _AfterState(imp.init(params), inner.init(params))

  def update_fn(updates, state, params=None, **extra):
    _, imp_state = imp.update(updates, state.importance, params, **extra)
    out, inner_state = inner.update(updates, state.inner, params, **extra)
    bc = 1 - jnp.float32(decay) ** imp_state.count.astype(jnp.float32)

    def weight(s, u):
      s_hat = s.astype(jnp.float32) / bc
      denom = jnp.mean(s.astype(jnp.float32)) / bc + 1e-12
      return (u * jnp.clip(s_hat / denom, min_weight, max_weight)).astype(
        u.dtype
      )

    return (
      jax.tree.map(weight, imp_state.score, out),
      _AfterState(imp_state, inner_state),
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def chain(config: Config, lr) -> optax.GradientTransformation:
  """The configuration as a chain of the library's stages (+ the local ones).

  For the configurations ``grpo()`` can express, this chain equals
  ``grpo_optax.grpo(lr, **config.grpo_kwargs())`` (tested).
  """
  config = config.normalized()
  if config.rms_bias_correction:
    adaptive = scale_by_nesterov_adam_rms_corrected(
      adam_weight=config.adam_weight, nesterov=config.nesterov
    )
  else:
    adaptive = grpo_optax.scale_by_nesterov_adam_rms(
      adam_weight=config.adam_weight, nesterov=config.nesterov
    )
  sparsifier = {
    "topk": lambda: grpo_optax.top_k_mask(fraction=0.3, method="sampled"),
    "threshold": grpo_optax.ema_threshold_mask,
    None: lambda: None,
  }[config.sparsify]()
  importance = grpo_optax.scale_by_importance(
    min_weight=config.min_weight, max_weight=config.max_weight
  )
  core = [s for s in (sparsifier, adaptive) if s is not None]
  stages = []
  if config.max_norm is not None:
    stages.append(grpo_optax.clip_with_l2(max_norm=config.max_norm))
  if not config.importance:
    stages += core
  elif config.importance_where == "before":
    stages += [importance] + core
  elif config.importance_where == "after_chain":
    stages += core + [importance]
  else:
    stages.append(
      importance_after(
        optax.chain(*core),
        min_weight=config.min_weight,
        max_weight=config.max_weight,
      )
    )
  if config.variance:
    stages.append(
      grpo_optax.scale_by_variance_lr(
        coef=0.1, reduction=config.variance_reduction
      )
    )
  stages.append(optax.scale_by_learning_rate(lr))
  return optax.chain(*stages)


def build(config: Config) -> convergence.Factory:
  """``lr -> optax transform`` of a configuration: ``grpo_optax.grpo`` when
  the library can express it, else :func:`chain`.
  """
  config = config.normalized()
  if config.importance_where == "before" and not config.rms_bias_correction:
    return lambda lr: grpo_optax.grpo(lr, **config.grpo_kwargs())
  return lambda lr: chain(config, lr)


def replace(config: Config, **changes) -> Config:
  return dataclasses.replace(config, **changes)


# One change at a time from TODAY: name -> (assignments, what changes). The
# assignments switch the mechanism they refine on, so that the greedy phase
# can apply them to any configuration.
SINGLE = {
  "today": (
    {},
    "the preset before the study (the articles' settings, chain form)",
  ),
  "no_clip": ({"max_norm": None}, "clipping off"),
  "max_norm_10": ({"max_norm": 10.0}, "max_norm 10"),
  "no_importance": ({"importance": False}, "importance weighting off"),
  "importance_after_chain": (
    {"importance": True, "importance_where": "after_chain"},
    "importance after the adaptive step (public transforms chained)",
  ),
  "importance_after_raw": (
    {"importance": True, "importance_where": "after_raw"},
    "importance after the adaptive step, weights from the raw gradient",
  ),
  "weights_0.5_2": (
    {"importance": True, "min_weight": 0.5, "max_weight": 2.0},
    "importance weights clipped to [0.5, 2]",
  ),
  "weights_0.8_1.25": (
    {"importance": True, "min_weight": 0.8, "max_weight": 1.25},
    "importance weights clipped to [0.8, 1.25]",
  ),
  "no_sparsify": ({"sparsify": None}, "no mask (dense)"),
  "threshold_mask": (
    {"sparsify": "threshold"},
    "EMA-threshold mask instead of top-k",
  ),
  "no_variance_lr": ({"variance": False}, "variance lr off"),
  "variance_per_element": (
    {"variance": True, "variance_reduction": "element"},
    "variance lr per element",
  ),
  "no_nesterov": ({"nesterov": False}, "Nesterov off"),
  "adam_weight_0": ({"adam_weight": 0.0}, "adam_weight 0 (RMSProp part only)"),
  "adam_weight_1": ({"adam_weight": 1.0}, "adam_weight 1 (NAdam part only)"),
  "rms_bias_corrected": (
    {"adam_weight": 0.5, "rms_bias_correction": True},
    "RMSProp part bias-corrected",
  ),
  "all_off": (
    {
      "max_norm": None,
      "importance": False,
      "sparsify": None,
      "variance": False,
      "adam_weight": 1.0,
    },
    "every mechanism off (= NAdam)",
  ),
}
DEFAULT_SINGLES = [n for n in SINGLE if n != "all_off"]  # all_off = NAdam.

# Switching a mechanism back on in the winner (the last phase): its options,
# as single variants whose assignments switch it on; the option whose single
# variant scored best is used. None: the mechanism as in TODAY.
MECHANISMS = {
  "clip": [("today", {"max_norm": 1.0}), ("max_norm_10", None)],
  "importance": [
    (
      "today",
      {
        "importance": True,
        "importance_where": "before",
        "min_weight": 0.1,
        "max_weight": 10.0,
      },
    ),
    ("importance_after_chain", None),
    ("importance_after_raw", None),
    ("weights_0.5_2", None),
    ("weights_0.8_1.25", None),
  ],
  "topk": [("today", {"sparsify": "topk"})],
  "threshold": [("threshold_mask", None)],
  "variance_lr": [
    ("today", {"variance": True, "variance_reduction": "leaf"}),
    ("variance_per_element", None),
  ],
  "nesterov": [("today", {"nesterov": True})],
  "rmsprop_mix": [
    ("today", {"adam_weight": 0.5, "rms_bias_correction": False}),
    ("rms_bias_corrected", None),
    ("adam_weight_0", None),
  ],
}


MECHANISMS_OFF = {
  "clip": {"max_norm": None},
  "importance": {"importance": False},
  "topk": {"sparsify": None},
  "threshold": {"sparsify": None},
  "variance_lr": {"variance": False},
  "nesterov": {"nesterov": False},
  "rmsprop_mix": {"adam_weight": 1.0},
}


def single_config(name: str) -> Config:
  return replace(TODAY, **SINGLE[name][0]).normalized()


# ------------------------------------------------------------ measuring


def score(entry: Mapping[str, Any]) -> tuple:
  """Sort key: no task above MAX_RATIO first, then the geometric mean."""
  g, m = entry.get("geomean"), entry.get("max")
  if g is None or m is None:
    return (True, float("inf"))
  return (m > MAX_RATIO, g)


class Study:
  """Runs configurations on the suite, remembering every result."""

  def __init__(
    self,
    task_names,
    num_seeds,
    quick,
    steps,
    baselines,
    log,
    save_fn,
    previous: dict | None = None,
  ):
    self.task_names = list(task_names)
    self.num_seeds = num_seeds
    self.quick = quick
    self.steps = steps
    self.log = log
    self.save_fn = save_fn
    self.tasks = {}
    self.baselines = baselines  # {task: {opt: result}}
    self.variants: dict[str, dict] = dict((previous or {}).get("variants", {}))

  def task(self, name):
    if name not in self.tasks:
      self.tasks[name] = problems_lib.TASKS[name]()
    return self.tasks[name]

  def budget(self, task):
    return self.steps or (task.quick_steps if self.quick else task.steps)

  def seeds(self, task):
    return convergence.task_seeds(task, self.quick, self.num_seeds)

  def ensure_baselines(self):
    for name in self.task_names:
      have = self.baselines.setdefault(name, {})
      task = self.task(name)
      for opt in BASELINES:
        r = have.get(opt)
        if r is None or (r.get("lrs"), r.get("seeds"), r.get("steps")) != (
          list(task.lrs),
          self.seeds(task),
          self.budget(task),
        ):
          have[opt] = convergence.sweep_task(
            task,
            convergence.OPTIMIZERS[opt],
            self.seeds(task),
            self.budget(task),
            self.log,
            opt,
          )
          self.save_fn()

  def evaluate(self, name: str, config: Config, description: str) -> dict:
    """The configuration's results on every task.

    Cached by configuration: a configuration measured before (under any
    name, e.g. by ``--resume``) is not run again; ``name`` then becomes an
    alias of that entry.
    """
    want = dataclasses.asdict(config)
    for other in [name] + list(self.variants):
      cached = self.variants.get(other)
      if (
        cached
        and cached["config"] == want
        and set(cached["tasks"]) >= set(self.task_names)
      ):
        self.variants[name] = cached
        return cached
    start = time.perf_counter()
    entry = {
      "config": dataclasses.asdict(config),
      "changes": config.changes(),
      "description": description,
      "grpo_kwargs": config.grpo_kwargs(),
      "library_changes": config.library_changes(),
      "tasks": {},
    }
    for tname in self.task_names:
      task = self.task(tname)
      entry["tasks"][tname] = convergence.sweep_task(
        task,
        build(config),
        self.seeds(task),
        self.budget(task),
        self.log,
        name,
        heldout=False,
      )
    self.summarise(entry)
    entry["seconds"] = time.perf_counter() - start
    self.variants[name] = entry
    self.log(
      f"{name}: geomean {convergence._ratio(entry['geomean'])}, max "
      f"{convergence._ratio(entry['max'])} ({entry['worst_task']}); "
      f"{entry['seconds']:.0f} s"
    )
    self.save_fn()
    return entry

  def summarise(self, entry):
    ratios = {}
    for tname, r in entry["tasks"].items():
      a = self.baselines[tname]["adam"]["best"]["mean"]
      b = r["best"]["mean"]
      ratios[tname] = b / a if b is not None and a else None
    entry["ratios"] = ratios
    entry["geomean"] = convergence.geomean(list(ratios.values()))
    finite = {k: v for k, v in ratios.items() if v is not None}
    entry["worst_task"] = max(finite, key=finite.get) if finite else None
    entry["max"] = (
      finite[entry["worst_task"]]
      if finite and len(finite) == len(ratios)
      else None
    )
    entry["interior"] = all(r["interior"] for r in entry["tasks"].values())


def config_name(config: Config) -> str:
  """``cfg:`` + the changes from TODAY (the name of a combined variant)."""
  changes = config.changes()
  return "cfg:" + (
    "+".join(f"{k}={v}" for k, v in sorted(changes.items())) or "today"
  )


def neighbours(
  config: Config, singles: Mapping[str, dict]
) -> dict[str, Config]:
  """Each mechanism flipped in ``config``: switched off if on; if off,
  switched on in the form whose single change scored best.
  """
  out = {}
  for mech, options in MECHANISMS.items():
    is_on = {
      "clip": config.max_norm is not None,
      "importance": config.importance,
      "topk": config.sparsify == "topk",
      "threshold": config.sparsify == "threshold",
      "variance_lr": config.variance,
      "nesterov": config.nesterov,
      "rmsprop_mix": config.adam_weight < 1.0,
    }[mech]
    if is_on:
      flipped = replace(config, **MECHANISMS_OFF[mech]).normalized()
      out[f"-{mech}"] = flipped
    else:
      scored = [
        (score(singles[n]), n, ch if ch is not None else SINGLE[n][0])
        for n, ch in options
        if n in singles
      ]
      if scored:
        _, option, changes = min(scored, key=lambda x: x[0])
        out[f"+{mech} (as in {option})"] = replace(
          config, **changes
        ).normalized()
  return {k: v for k, v in out.items() if v != config}


def greedy(
  study: Study, singles: Mapping[str, dict], rounds: int = 2
) -> dict[str, Any]:
  """Combines the single changes, then searches the winner's neighbourhood.

  Pass 1: the single changes that improved on TODAY, best first, each kept
  if the combination scores better (:func:`score`). Then the neighbourhood
  search: every mechanism of the current configuration flipped
  (:func:`neighbours`); the best neighbour replaces it if it scores better,
  at most ``rounds`` times. The last round's table shows what each mechanism
  costs or gains around the end point.
  """
  base = singles["today"]
  gains = sorted(
    (score(e), n)
    for n, e in singles.items()
    if n not in ("today", "all_off") and score(e) < score(base)
  )
  current, best = TODAY, base
  steps = []
  for _, name in gains:
    candidate = replace(current, **SINGLE[name][0]).normalized()
    if candidate == current:
      steps.append({"try": name, "kept": False, "reason": "already in"})
      continue
    cname = config_name(candidate)
    entry = study.evaluate(cname, candidate, f"greedy: + {name}")
    kept = score(entry) < score(best)
    steps.append(
      {
        "try": name,
        "variant": cname,
        "kept": kept,
        "geomean": entry["geomean"],
        "max": entry["max"],
      }
    )
    if kept:
      current, best = candidate, entry
  search = []
  for r in range(rounds + 1):
    study.evaluate(config_name(current), current, "winner so far")
    around, candidates = {}, neighbours(current, singles)
    for label, candidate in candidates.items():
      around[label] = config_name(candidate)
      study.evaluate(around[label], candidate, f"neighbour: {label}")
    search.append({"center": config_name(current), "neighbours": around})
    top = min(
      around, key=lambda k: score(study.variants[around[k]]), default=None
    )
    if (
      r == rounds
      or top is None
      or not score(study.variants[around[top]]) < score(best)
    ):
      break
    current, best = candidates[top], study.variants[around[top]]
  return {
    "steps": steps,
    "search": search,
    "end": config_name(current),
    "winner_config": dataclasses.asdict(current),
  }


# --------------------------------------------------------------- output


def study_markdown(report: dict) -> str:
  meta = report["meta"]
  variants = report["variants"]
  tnames = meta["tasks"]
  base = report["baselines"]
  lines = [
    "# Study of the GRPO preset's choices",
    "",
    f"Command: `{meta['command']}` ({meta['date']}, {meta['device']}, jax "
    f"{meta['jax']}); total {meta.get('total_seconds', 0):.0f} s.",
    "",
    "Suite, sweep, seeds and metric as in `convergence.md`. Each cell is "
    "the variant's best loss over the sweep divided by Adam's best loss on the task (lower is better); target: "
    f"geometric mean <= 1 and no task above {MAX_RATIO}. * = the best "
    "learning rate is at the edge of the sweep.",
    "",
  ]

  def row(name, entry):
    cells = []
    for t in tnames:
      r = entry["ratios"].get(t)
      edge = "" if entry["tasks"][t]["interior"] else "*"
      cells.append(convergence._ratio(r) + edge)
    return (
      f"| {name} | "
      + " | ".join(cells)
      + f" | **{convergence._ratio(entry['geomean'])}** | "
      f"{convergence._ratio(entry['max'])} |"
    )

  head = [
    "| variant | " + " | ".join(tnames) + " | geomean | max |",
    "|---|" + "---|" * (len(tnames) + 2),
  ]
  lines += ["## Baselines", ""] + head
  for opt in BASELINES:
    lines.append(row(opt, _baseline_entry(base, tnames, opt)))
  lines += ["", "## One change at a time from today's grpo()", ""] + head
  for name in SINGLE:
    if name in variants:
      lines.append(row(name, variants[name]))
  lines += [
    "",
    "Changes: "
    + "; ".join(f"`{n}` = {d}" for n, (_, d) in SINGLE.items())
    + ".",
    "",
  ]
  g = report.get("greedy")
  if g:
    lines += [
      "## Greedy combination",
      "",
      "The single changes that improved on today's preset, best "
      "first; each is kept if the combination scores better (no task "
      f"above {MAX_RATIO} first, then the lower geometric mean).",
      "",
    ]
    lines += head
    for step in g["steps"]:
      if "variant" in step:
        lines.append(
          row(
            f"+ {step['try']} ({'kept' if step['kept'] else 'dropped'})",
            variants[step["variant"]],
          )
        )
    for i, rnd in enumerate(g["search"], 1):
      lines += [
        "",
        f"### Neighbourhood search, round {i}: each mechanism "
        f"of `{rnd['center']}` switched off (-) or on (+)",
        "",
      ] + head
      lines.append(row("center", variants[rnd["center"]]))
      for label, name in rnd["neighbours"].items():
        lines.append(row(label, variants[name]))
    w = report["winner"]
    lines += [
      "",
      "## Result",
      "",
      f"Winner (the best-scoring configuration measured): "
      f"`{w['name']}`: geometric mean "
      f"{convergence._ratio(w['geomean'])}, max "
      f"{convergence._ratio(w['max'])} ({w['worst_task']}); target "
      f"(geometric mean <= 1, no task above {MAX_RATIO}) "
      f"{'met' if w['meets_target'] else 'NOT met'}.",
      "",
      "As `grpo(...)` keywords: `grpo(lr, "
      + ", ".join(f"{k}={v!r}" for k, v in w["grpo_kwargs"].items())
      + ")`"
      + (
        " plus: " + "; ".join(w["library_changes"]) + "."
        if w["library_changes"]
        else " (no other library change)."
      ),
      "",
      "Side by side (ratios to Adam's best loss):",
      "",
    ] + head
    lines.append(row("winner", variants[w["name"]]))
    lines.append(row("today", variants["today"]))
    for opt in ("nadam", "adamw"):
      lines.append(row(opt, _baseline_entry(base, tnames, opt)))
    end = report.get("search_end")
    if end and end["name"] != w["name"]:
      lines += [
        "",
        f"The search ended at `{end['name']}` (geometric mean "
        f"{convergence._ratio(end['geomean'])}, max "
        f"{convergence._ratio(end['max'])}); the winner is its "
        "neighbour that scored best in the last round.",
      ]
    lines.append("")
  return "\n".join(lines)


def _baseline_entry(base, tnames, opt) -> dict:
  entry = {"ratios": {}, "tasks": {}}
  for t in tnames:
    r = base[t][opt]
    a = base[t]["adam"]["best"]["mean"]
    entry["ratios"][t] = (
      r["best"]["mean"] / a if r["best"]["mean"] is not None and a else None
    )
    entry["tasks"][t] = r
  vals = list(entry["ratios"].values())
  entry["geomean"] = convergence.geomean(vals)
  entry["max"] = max(vals) if all(v is not None for v in vals) else None
  return entry


PHASES = ("preset", "transformers")


def _phase(argv) -> str:
  parser = argparse.ArgumentParser(add_help=False)
  parser.add_argument("--phase", choices=PHASES, default="preset")
  return parser.parse_known_args(argv)[0].phase


def parse_args(argv=None):
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks.study", description=__doc__.splitlines()[0]
  )
  parser.add_argument(
    "--phase",
    choices=PHASES,
    default="preset",
    help="preset: this module's one-change-at-a-time study; transformers: "
    "the defaults on transformers (benchmarks.study_transformers, its own "
    "flags)",
  )
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--out", default=None)
  parser.add_argument("--tasks", default=",".join(problems_lib.TASKS))
  parser.add_argument(
    "--variants",
    default=",".join(DEFAULT_SINGLES),
    help="single-change variants to run (today is always run)",
  )
  parser.add_argument("--no-greedy", action="store_true")
  parser.add_argument(
    "--rounds",
    type=int,
    default=2,
    help="moves of the neighbourhood search (default 2)",
  )
  parser.add_argument("--seeds", type=int, default=None)
  parser.add_argument("--steps", type=int, default=None)
  parser.add_argument(
    "--resume",
    action="store_true",
    help="reuse the variants already in study.json (same settings)",
  )
  parser.add_argument(
    "--cache-dir",
    default=os.path.join(
      convergence.tempfile.gettempdir(), "grpo_optax_benchmark_jax_cache"
    ),
  )
  args = parser.parse_args(argv)
  args.tasks = [t for t in args.tasks.split(",") if t]
  args.variants = ["today"] + [
    v for v in args.variants.split(",") if v and v != "today"
  ]
  bad = set(args.variants) - set(SINGLE)
  if bad:
    parser.error(f"unknown variants {sorted(bad)}; choose from {list(SINGLE)}")
  if args.out is None:
    args.out = (
      os.path.join("benchmarks", "results", "quick")
      if args.quick
      else os.path.join("benchmarks", "results")
    )
  return args


def _settings(args) -> dict:
  return {
    "tasks": args.tasks,
    "num_seeds": args.seeds,
    "quick": args.quick,
    "steps": args.steps,
  }


def _baselines_from_convergence(path: str, args) -> dict:
  """Adam/NAdam/AdamW results from ``convergence.json`` if it matches."""
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    conv = json.load(f)
  if (
    conv["meta"].get("num_seeds") != args.seeds
    or conv["meta"]["quick"] != args.quick
  ):
    return {}
  out = {}
  for name in args.tasks:
    task = conv["tasks"].get(name)
    if task is None or (args.steps is not None and task["steps"] != args.steps):
      continue
    out[name] = {
      o: task["results"][o] for o in BASELINES if o in task["results"]
    }
  return out


def _describe(name: str, variants: Mapping[str, dict]) -> dict:
  w = variants[name]
  cfg = Config(**w["config"])
  return {
    "name": name,
    "geomean": w["geomean"],
    "max": w["max"],
    "worst_task": w["worst_task"],
    "ratios": w["ratios"],
    "meets_target": (
      w["geomean"] is not None
      and w["geomean"] <= 1.0
      and w["max"] is not None
      and w["max"] <= MAX_RATIO
    ),
    "config": w["config"],
    "grpo_kwargs": cfg.grpo_kwargs(),
    "changes": cfg.changes(),
    "library_changes": cfg.library_changes(),
  }


def main(argv=None) -> dict:
  argv = sys.argv[1:] if argv is None else list(argv)
  if _phase(argv) == "transformers":
    from benchmarks import study_transformers  # pylint: disable=g-import-not-at-top

    return study_transformers.main(argv)
  args = parse_args(argv)
  convergence.configure_cache(args.cache_dir)
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "study.json")
  previous = None
  if args.resume and os.path.exists(path):
    with open(path) as f:
      previous = json.load(f)
    if previous["meta"].get("settings") != _settings(args):
      previous = None
  start = time.time()
  log = lambda msg: print(f"[{time.time() - start:6.0f}s] {msg}", flush=True)
  report = {
    "meta": {
      "command": command_lib.command("benchmarks.study", argv),
      "date": time.strftime("%Y-%m-%d %H:%M"),
      "device": f"{jax.devices()[0].device_kind} ({os.cpu_count()} cpus)",
      "jax": jax.__version__,
      "optax": optax.__version__,
      "num_seeds": args.seeds,
      "tasks": args.tasks,
      "settings": _settings(args),
      "max_ratio": MAX_RATIO,
      "metric": "as benchmarks.convergence",
    }
  }
  baselines = (previous or {}).get("baselines") or _baselines_from_convergence(
    os.path.join(args.out, "convergence.json"), args
  )

  def save_fn():
    report["meta"]["total_seconds"] = (
      time.time()
      - start
      + ((previous or {}).get("meta", {}).get("total_seconds", 0.0))
    )
    report["baselines"] = study.baselines
    report["variants"] = study.variants
    convergence.write_json(path, report)
    if all(
      t in study.baselines and all(o in study.baselines[t] for o in BASELINES)
      for t in args.tasks
    ):
      with open(os.path.join(args.out, "study.md"), "w") as f:
        f.write(study_markdown(report))

  study = Study(
    args.tasks,
    args.seeds,
    args.quick,
    args.steps,
    baselines,
    log,
    save_fn,
    previous,
  )
  study.ensure_baselines()
  singles = {}
  for name in args.variants:
    singles[name] = study.evaluate(name, single_config(name), SINGLE[name][1])
  if not args.no_greedy:
    report["greedy"] = greedy(study, singles, rounds=args.rounds)
    # The answer: the best-scoring GRPO configuration measured (the search's
    # end point, or one of its last neighbours).
    ranked = sorted(
      (score(e), n) for n, e in study.variants.items() if n != "all_off"
    )
    report["winner"] = _describe(ranked[0][1], study.variants)
    report["search_end"] = _describe(report["greedy"]["end"], study.variants)
  save_fn()
  print(study_markdown(report), flush=True)
  return report


if __name__ == "__main__":
  main()
