"""The frontier report of ``benchmarks.communication``: steps to a target,
claim 15's efficiency, break-even bandwidths (pure functions of the runs).
"""

import math

import pytest

from benchmarks import communication as comm


def test_steps_to_interpolates_between_evaluations():
  hist = [[100, 5.0, 0.1], [200, 4.0, 0.2], [300, 3.5, 0.3]]
  assert comm.steps_to(hist, 4.5) == pytest.approx(150.0)
  assert comm.steps_to(hist, 4.0) == pytest.approx(200.0)
  assert comm.steps_to(hist, 6.0) == 100.0  # at the first evaluation
  assert math.isinf(comm.steps_to(hist, 3.0))


def _run(config, seed, history, steps=400):
  return {
    "config": config,
    "seed": seed,
    "steps": steps,
    "eval_history": history,
    "eval_loss": history[-1][1],
    "command": f"python -m examples.bert_mlm ({config})",
  }


def test_claim15_efficiency_is_steps_to_the_no_fault_target():
  base = [[100, 6.0], [200, 5.0], [300, 4.0], [400, 3.5]]
  # The faulty run reaches 4.0 (the no-fault loss at 75% = step 300) at 350.
  slow = [[100, 6.2], [200, 5.4], [300, 4.4], [400, 3.6]]
  runs = {
    "bert": [
      _run(comm.CLAIM15[0], 0, base),
      _run(comm.CLAIM15[1], 0, slow),
      _run(comm.CLAIM15[0], 1, base),  # no faulty run of seed 1: left out
      # A longer no-fault run with no faulty run of its length: not a pair.
      _run(comm.CLAIM15[0], 0, [[800, 2.0]], steps=800),
    ]
  }
  c = comm.claim15(runs)
  assert c["steps"] == 400
  assert [r["seed"] for r in c["rows"]] == [0]
  r = c["rows"][0]
  assert r["target"] == 4.0
  assert r["no_fault_steps"] == pytest.approx(300.0)
  assert r["faulty_steps"] == pytest.approx(300 + 100 * 0.4 / 0.8)
  assert c["efficiency_mean"] == pytest.approx(300 / 350)
  assert comm.claim15({"bert": [_run(comm.CLAIM15[0], 0, base)]}) is None


def test_frontier_rows_break_even_and_local_steps():
  quality = [
    {"task": "bert", "config": "dense", "x_dense_bytes": 1.0},
    {
      "task": "bert",
      "config": "powersgd_r1",
      "x_dense_bytes": 0.01,
    },
    {"task": "bert", "config": "local_h16_dense", "x_dense_bytes": 1 / 16},
    {"task": "bert", "config": "powersgd_r2", "x_dense_bytes": 0.02},
  ]
  for q in quality:
    q["steps"] = 1800
  times = {"bert": {"dense": 1.0, "powersgd r=1": 1.5}}
  rows = {r["config"]: r for r in comm.frontier_rows(quality, times)}
  dense_bytes = comm.dense_ring_bytes("bert")
  assert rows["powersgd_r1"]["compute_ratio"] == pytest.approx(1.5)
  assert rows["powersgd_r1"]["break_even_bps"] == pytest.approx(
    8 * 0.99 * dense_bytes / 0.5
  )
  # Local steps: a plain step between outer steps (compute taken as dense's).
  assert rows["local_h16_dense"]["compute_ratio"] == 1.0
  assert math.isinf(rows["local_h16_dense"]["break_even_bps"])
  # Not timed: no compute ratio, no break-even.
  assert rows["powersgd_r2"]["compute_ratio"] is None
  assert rows["powersgd_r2"]["break_even_bps"] is None
  assert rows["dense"]["break_even_bps"] is None
  paper = {r["config"]: r for r in comm.paper_break_even(list(rows.values()))}
  assert set(paper) == {"powersgd_r1", "local_h16_dense"}
  assert math.isinf(paper["local_h16_dense"]["break_even_bps"])
  p = paper["powersgd_r1"]
  assert p["break_even_bps"] == pytest.approx(
    8 * 0.99 * p["dense_bytes"] / (0.5 * p["compute_s"])
  )


def test_run_bytes_count_the_warmup_stages():
  """Averaged over a run, the bytes include each warm-up stage's payload for
  its steps; with no warm-up they are the steady state's.
  """
  name, steps = "all_gather_compact_bf16_0.00045_long_warmup", 3600
  steady = comm.bytes_ratio("bert", name)
  per = comm.warmup_steps("bert", name, steps)
  argv = comm.config_argv("bert", name, steps)
  assert argv[argv.index("--exchange-warmup-steps") + 1] == str(per)
  fractions = comm.exchange_lib.warmup_fractions(0.00045)
  assert fractions[0] == 0.25 and fractions[-1] == 0.00045
  kw = dict(comm.GRID)[comm.GRID_OF[name]]
  dense = comm.dense_ring_bytes("bert")
  stage = [
    comm.modelled_traffic(
      comm._task_shapes("bert"), {**kw, "fraction": f}, (8,)
    )
    / dense
    for f in fractions[:-1]
  ]
  warm = per * len(stage)
  want = (per * sum(stage) + (steps - warm) * steady) / steps
  got = comm.run_bytes_ratio("bert", name, steps)
  assert got == pytest.approx(want, rel=1e-12)
  assert got > 20 * steady  # the 25% stage alone: over 2% of the run's steps
  none = "all_gather_compact_bf16_0.00045_no_warmup"
  assert comm.warmup_steps("bert", none, steps) == 0
  assert comm.run_bytes_ratio("bert", none, steps) == steady
  assert comm.run_bytes_ratio("bert", "powersgd_r1", steps) == (
    comm.bytes_ratio("bert", "powersgd_r1")
  )
