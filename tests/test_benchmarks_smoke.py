"""Smoke test of the convergence benchmark and the claims table (tiny run)."""

import json
import math

import numpy as np

from benchmarks import claims
from benchmarks import convergence


def test_steps_to_target_and_lr_choice():
  steps = np.array([10, 20, 30])
  assert convergence.steps_to_target(steps, [0.5, 0.96, 0.97], 0.95, "max") == 20
  assert convergence.steps_to_target(steps, [0.5, 0.6, 0.7], 0.95, "max") is None
  assert convergence.steps_to_target(steps, [1.0, np.nan, 1e-4], 1e-3, "min") == 30
  run = lambda final, tie: convergence.Run(0, final, tie, None, 0.0, 0.0,
                                           (steps, steps), (steps, steps))
  # Best final metric wins; a diverged (NaN) run never does; ties -> tie-break.
  assert convergence.choose_lr({1e-3: run(0.9, 1.0), 1e-2: run(0.95, 2.0),
                                1e-1: run(math.nan, 0.0)}, "max") == 1e-2
  assert convergence.choose_lr({1e-3: run(0.9, 1.0), 1e-2: run(0.9, 0.5)},
                               "max") == 1e-2
  assert convergence.grpo_flags({"sparsify": None, "importance": False,
                                 "adam_weight": 1.0}) == [
      "--grpo-sparsify", "none", "--grpo-importance", "false",
      "--grpo-adam-weight", "1.0"]


def test_convergence_harness_writes_results(tmp_path):
  out = tmp_path / "results"
  report = convergence.main([
      "--tasks", "quadratic", "--optimizers", "grpo,adam", "--seeds", "2",
      "--steps", "30", "--ablation", "preset,no_clip", "--out", str(out),
      "--cache-dir", ""])
  data = json.loads((out / "convergence.json").read_text())
  assert data["meta"]["seeds"] == [0, 1] == report["meta"]["seeds"]
  task = data["tasks"]["quadratic"]
  assert set(task["results"]) == {"grpo", "adam"}
  for r in task["results"].values():
    assert r["lr"] in r["lr_grid"] and len(r["lr_grid"]) >= 3
    assert r["seeds"] == [0, 1] and r["final"]["n"] == 2
    assert r["final"]["mean"] is not None and r["final"]["std"] is not None
    assert 0.0 <= r["explosion_rate"]["mean"] <= 1.0
    assert len(r["loss_curve"]["steps"]) == 30
  ablation = json.loads((out / "ablation.json").read_text())
  variants = ablation["tasks"]["quadratic"]["variants"]
  assert set(variants) == {"preset", "no_clip"}
  # The preset row reuses the convergence runs of grpo.
  assert variants["preset"]["final"] == task["results"]["grpo"]["final"]
  md = (out / "convergence.md").read_text()
  assert "| grpo |" in md and "| adam |" in md and "steps to target" in md
  assert "| no_clip |" in (out / "ablation.md").read_text()
  for png in ("convergence_quadratic.png", "ablation_quadratic.png"):
    assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

  # --render-only rebuilds the same Markdown from the JSON.
  convergence.main(["--render-only", "--out", str(out)])
  assert (out / "convergence.md").read_text() == md

  text = claims.main(["--results", str(out)])
  rows = [line for line in text.splitlines() if line.startswith("| ") and
          line.split("|")[1].strip().isdigit()]
  assert len(rows) >= 10
  assert all(line.rstrip().endswith("|") for line in rows)
  assert (out / "claims.md").exists()


def test_claims_traffic_row_reads_communication_json(tmp_path):
  # The traffic row (14) is generated from communication.json.
  rows = [{"mesh": "W=8", "exchange": e, "fraction": f, "ratio_to_dense": r}
          for e, f, r in (("dense", None, 1.0), ("all_gather", 0.3, 2.41),
                          ("all_gather", 0.01, 0.082),
                          ("shared_support", 0.3, 0.331))]
  conv = [{"exchange": "dense", "fraction": None, "eval_accuracy": 0.99,
           "steps": 300},
          {"exchange": "shared_support", "fraction": 0.3,
           "eval_accuracy": 0.985, "steps": 300}]
  (tmp_path / "communication.json").write_text(json.dumps({
      "meta": {"command": "python -m benchmarks.communication"},
      "bytes": {"model": "m", "num_params": 10, "rows": rows},
      "convergence": conv}))
  text = claims.main(["--results", str(tmp_path)])
  row = [line for line in text.splitlines() if "all-reduce traffic" in line][0]
  assert "x2.41 (141.0% more" in row and "x0.331 (66.9% less)" in row
  assert "dense 99.00%, shared support 30% 98.50%" in row
  assert row.rstrip().endswith("holds with a shared index set; does not hold "
                               "for the per-replica top-30% all-gather at W "
                               "= 8 (it saves traffic only while W f < 1, "
                               "i.e. W = 2 at 30%) |")
  # A shared support that saves less than 65% does not hold.
  rows[-1]["ratio_to_dense"] = 0.5
  (tmp_path / "communication.json").write_text(json.dumps({
      "meta": {"command": "c"}, "bytes": {"model": "m", "num_params": 10,
                                          "rows": rows}}))
  row = [line for line in claims.main(["--results", str(tmp_path)])
         .splitlines() if "all-reduce traffic" in line][0]
  assert "| does not hold;" in row
