"""Smoke test of the convergence suite, the study and the claims table."""

import dataclasses
import json
import math

import numpy as np
import pytest

from benchmarks import claims
from benchmarks import convergence
from benchmarks import problems
from benchmarks import study


def test_helpers():
  steps = np.array([10, 20, 30])
  assert (
    convergence.steps_to_target(steps, [0.5, 0.96, 0.97], 0.95, "max") == 20
  )
  assert (
    convergence.steps_to_target(steps, [0.5, 0.6, 0.7], 0.95, "max") is None
  )
  assert (
    convergence.steps_to_target(steps, [1.0, np.nan, 1e-4], 1e-3, "min") == 30
  )
  # The smallest finite mean wins; ties go to the smaller learning rate.
  assert convergence.best_index([None, 0.3, 0.2, 0.2, None]) == 2
  assert convergence.best_index([None, None]) is None
  assert math.isclose(convergence.geomean([0.5, 2.0, 1.0]), 1.0)
  assert convergence.geomean([1.0, None]) is None
  # Mean of the last 10% of the steps; a non-finite tail counts as diverged.
  losses = np.array([[1.0] * 18 + [2.0, 4.0], [1.0] * 19 + [np.inf]])
  np.testing.assert_allclose(problems.smoothed_final(losses), [3.0, np.nan])
  assert problems.lr_window(1e-3, 0.1) == (1e-3, 3e-3, 1e-2, 3e-2, 0.1)
  tasks = {
    "a": {
      "results": {"adam": {"best": {"mean": 2.0}}, "x": {"best": {"mean": 1.0}}}
    },
    "b": {
      "results": {"adam": {"best": {"mean": 1.0}}, "x": {"best": {"mean": 4.0}}}
    },
  }
  table = convergence.ratio_table(tasks)
  assert table["x"]["per_task"] == {"a": 0.5, "b": 4.0}
  assert math.isclose(table["x"]["geomean"], math.sqrt(2.0))
  assert table["x"]["max"] == 4.0 and table["x"]["worst_task"] == "b"
  assert study.score({"geomean": 0.9, "max": 1.2}) > study.score(
    {"geomean": 1.1, "max": 1.0}
  )


def test_sweep_is_the_same_vectorized_or_not():
  task = problems.linreg(steps=12)
  seeds = [0, 1]
  a = convergence.sweep_task(task, convergence.OPTIMIZERS["adam"], seeds, 12)
  task_loop = dataclasses.replace(task, vectorize=False)
  b = convergence.sweep_task(
    task_loop, convergence.OPTIMIZERS["adam"], seeds, 12
  )
  np.testing.assert_allclose(
    [s["mean"] for s in a["final_by_lr"]],
    [s["mean"] for s in b["final_by_lr"]],
    rtol=1e-5,
  )


def test_convergence_study_and_claims_write_results(tmp_path):
  out = tmp_path / "results"
  report = convergence.main(
    [
      "--tasks",
      "logistic",
      "--optimizers",
      "grpo,adam,nadam,adamw",
      "--seeds",
      "2",
      "--steps",
      "20",
      "--out",
      str(out),
      "--cache-dir",
      "",
    ]
  )
  data = json.loads((out / "convergence.json").read_text())
  assert set(data["tasks"]) == {"logistic"}
  for task in data["tasks"].values():
    assert list(task["results"]) == ["adam", "grpo", "nadam", "adamw"]
    for r in task["results"].values():
      assert r["best_lr"] in r["lrs"] and len(r["lrs"]) >= 5
      assert r["seeds"] == [0, 1] and r["best"]["n"] == 2
      assert len(r["final_by_lr"]) == len(r["lrs"])
      assert 0.0 <= r["explosion_rate"]["mean"] <= 1.0
      assert len(r["loss_curve"]["steps"]) == 20
  assert "accuracy" in data["tasks"]["logistic"]["results"]["adam"]["heldout"]
  ratios = data["ratios"]
  assert ratios["adam"]["geomean"] == 1.0
  assert math.isclose(
    ratios["grpo"]["per_task"]["logistic"],
    data["tasks"]["logistic"]["results"]["grpo"]["best"]["mean"]
    / data["tasks"]["logistic"]["results"]["adam"]["best"]["mean"],
  )
  assert report["ratios"]["grpo"]["geomean"] == ratios["grpo"]["geomean"]
  md = (out / "convergence.md").read_text()
  assert "| **geometric mean** |" in md and "grpo / adam" in md
  assert (out / "convergence_curves.png").read_bytes()[
    :8
  ] == b"\x89PNG\r\n\x1a\n"
  convergence.main(["--render-only", "--no-plot", "--out", str(out)])
  assert (out / "convergence.md").read_text() == md

  rep = study.main(
    [
      "--tasks",
      "logistic",
      "--steps",
      "20",
      "--seeds",
      "2",
      "--variants",
      "no_clip",
      "--no-greedy",
      "--out",
      str(out),
      "--cache-dir",
      "",
    ]
  )
  assert set(rep["variants"]) == {"today", "no_clip"}
  # The baselines came from convergence.json (same settings), not new runs.
  for opt in study.BASELINES:
    assert (
      rep["baselines"]["logistic"][opt]
      == data["tasks"]["logistic"]["results"][opt]
    )
  today = rep["variants"]["today"]
  assert today["ratios"]["logistic"] == today["geomean"] == today["max"]
  assert "## One change at a time" in (out / "study.md").read_text()

  text = claims.main(["--results", str(out)])
  rows = [
    line
    for line in text.splitlines()
    if line.startswith("| ") and line.split("|")[1].strip().isdigit()
  ]
  assert len(rows) >= 10
  assert all(line.rstrip().endswith("|") for line in rows)
  assert (out / "claims.md").exists()


def test_claims_traffic_row_reads_communication_json(tmp_path):
  # The traffic row (14) is generated from communication.json.
  best = claims.BEST_EXCHANGE
  rows = [
    {"mesh": "W=8", "label": label, "ratio_to_dense": r, "across_ratio": None}
    for label, r in (
      ("dense", 1.0),
      ("all_gather fp32/int32 f=0.3", 2.41),
      ("shared_support norms fp32 f=0.3", 0.331),
      (best[1], 0.0019),
    )
  ]
  rows.append(
    {
      "mesh": "2x4",
      "label": best[1],
      "ratio_to_dense": 0.9,
      "across_ratio": 0.0018,
    }
  )
  quality = [
    {
      "task": "resnet",
      "config": best[0],
      "mean": 0.985,
      "vs_dense": -0.003,
      "seeds": [0, 1, 2],
      "steps": 300,
    },
    {
      "task": "bert",
      "config": best[0],
      "mean": 6.0,
      "vs_dense": 0.015,
      "seeds": [0],
      "steps": 600,
    },
  ]
  comm = {
    "meta": {"command": "python -m benchmarks.communication"},
    "bytes": {"resnet": {"name": "m", "num_params": 10, "rows": rows}},
    "quality": quality,
  }
  (tmp_path / "communication.json").write_text(json.dumps(comm))
  text = claims.main(["--results", str(tmp_path)])
  row = [line for line in text.splitlines() if "all-reduce traffic" in line][0]
  assert "x2.41 (141.0% more" in row and "x0.331 (66.9% less)" in row
  assert "x0.0019 (1/526), across the nodes of a 2x4 mesh x0.0018" in row
  assert "98.50% (-0.30 points vs dense, mean of 3 seeds" in row
  assert "loss 6.000 (+1.5% vs dense, 600 steps)" in row
  assert row.rstrip().endswith(
    "holds with a shared index set; does not hold "
    "for the per-replica top-30% all-gather at W "
    "= 8 (it saves traffic only while W f < 1, "
    "i.e. W = 2 at 30%) |"
  )
  # A shared support that saves less than 65% does not hold.
  rows[2]["ratio_to_dense"] = 0.5
  comm["quality"] = []
  (tmp_path / "communication.json").write_text(json.dumps(comm))
  row = [
    line
    for line in claims.main(["--results", str(tmp_path)]).splitlines()
    if "all-reduce traffic" in line
  ][0]
  assert "| does not hold;" in row and "With it" not in row


class _FakeStudy:
  """Scores configurations by a table instead of training (greedy logic)."""

  def __init__(self, table):
    self.table = table  # frozenset of changed fields -> (geomean, max)
    self.variants = {}

  def evaluate(self, name, config, description):
    key = frozenset(config.changes())
    g, m = self.table.get(key, (2.0, 2.0))
    entry = {"geomean": g, "max": m}
    self.variants[name] = entry
    return entry


def test_greedy_keeps_only_changes_that_help_in_combination():
  singles = {
    "today": {"geomean": 1.2, "max": 1.5},
    "no_clip": {"geomean": 1.1, "max": 1.4},
    "no_sparsify": {"geomean": 1.0, "max": 1.3},
    "no_variance_lr": {"geomean": 1.15, "max": 1.4},
    "no_nesterov": {"geomean": 1.3, "max": 1.6},
    "threshold_mask": {"geomean": 1.3, "max": 1.6},
    "max_norm_10": {"geomean": 1.25, "max": 1.5},
  }
  fake = _FakeStudy(
    {
      frozenset({"sparsify"}): (1.0, 1.3),
      frozenset({"sparsify", "max_norm"}): (0.95, 1.04),  # kept
      frozenset({"sparsify", "max_norm", "variance"}): (0.97, 1.03),  # worse
      # The neighbourhood search finds a better one: Nesterov off as well.
      frozenset({"sparsify", "max_norm", "nesterov"}): (0.9, 1.0),
    }
  )
  result = study.greedy(fake, singles, rounds=2)
  tried = [s["try"] for s in result["steps"]]
  # Best single first; no_nesterov did not improve alone, so pass 1 skips it.
  assert tried == ["no_sparsify", "no_clip", "no_variance_lr"]
  assert [s["kept"] for s in result["steps"]] == [True, True, False]
  first = result["search"][0]
  assert first["center"] == "cfg:max_norm=None+sparsify=None"
  # Each mechanism is flipped: on ones off, off ones on in their best form
  # (clipping as today's max_norm 1, which scored better than max_norm 10).
  assert set(first["neighbours"]) == {
    "+clip (as in today)",
    "-importance",
    "+topk (as in today)",
    "+threshold (as in threshold_mask)",
    "-variance_lr",
    "-nesterov",
    "-rmsprop_mix",
  }
  assert result["winner_config"]["nesterov"] is False
  assert result["winner_config"]["sparsify"] is None
  assert result["winner_config"]["max_norm"] is None
  # Round 2 looked around the new winner and found nothing better.
  assert len(result["search"]) == 2
  assert result["end"] == "cfg:max_norm=None+nesterov=False+sparsify=None"


def test_claims_fault_row_reads_local_steps_json(tmp_path):
  # The fault row (15) is generated from local_steps.json.
  def row_text():
    text = claims.main(["--results", str(tmp_path)])
    return [line for line in text.splitlines() if "nodes failing" in line][0]

  assert "pending" in row_text()
  rows = [
    {
      "dropout": p,
      "efficiency_mean": e,
      "efficiency_min": e - 0.02,
      "measured_missing": p,
      "seeds": 5,
    }
    for p, e in ((0.0, 1.0), (0.15, 0.95), (0.3, 0.88))
  ]
  data = {
    "dropout": {"replicas": 8, "local_steps": 10, "rounds": 60, "rows": rows}
  }
  (tmp_path / "local_steps.json").write_text(json.dumps(data))
  row = row_text()
  assert (
    "| 95.0% (min 93.0% over 5 mask seeds; 15.0% of replica-rounds "
    "missing); 30% missing: 88.0% |" in row
  )
  assert row.rstrip().endswith("| holds |")
  # With the BERT example's measurement (communication.json): both must
  # hold.
  import pathlib

  committed = pathlib.Path(__file__).parents[1] / "benchmarks" / "results"
  comm = json.loads((committed / "communication.json").read_text())
  comm["claim15"] = {
    "rows": [{"efficiency": 0.97}, {"efficiency": 0.95}],
    "efficiency_mean": 0.96,
    "efficiency_min": 0.95,
  }
  (tmp_path / "communication.json").write_text(json.dumps(comm))
  row = row_text()
  assert "BERT example: 96.0% (min 95.0% over 2 seeds)" in row
  assert row.rstrip().endswith("| holds |")
  comm["claim15"]["rows"][1]["efficiency"] = 0.80
  (tmp_path / "communication.json").write_text(json.dumps(comm))
  assert row_text().rstrip().endswith("| does not hold |")
  (tmp_path / "communication.json").unlink()
  rows[1]["efficiency_mean"] = 0.91
  (tmp_path / "local_steps.json").write_text(json.dumps(data))
  assert row_text().rstrip().endswith("| does not hold |")


@pytest.mark.slow
def test_example_step_runs_every_optimizer_on_both_examples(tmp_path):
  # The examples' train steps are the benchmark's (their signatures changed
  # once without it noticing).
  from benchmarks import example_step

  example_step.main(["--rounds", "1", "--steps", "1", "--out", str(tmp_path)])
  rows = json.loads((tmp_path / "example_step.json").read_text())["rows"]
  assert {(r["example"], r["optimizer"]) for r in rows} == {
    (e, o) for e in example_step.EXAMPLES for o in example_step.OPTIMIZERS
  }
  assert all(r["median_ms"] > 0 and r["first_step_s"] > 0 for r in rows)
