"""Smoke test of ``python -m benchmarks.sharding --quick``."""

import json
import math

import pytest

from benchmarks import sharding


@pytest.mark.slow
def test_quick_benchmark_writes_json_and_markdown(tmp_path):
  report = sharding.main(["--quick", "--out", str(tmp_path)])
  data = json.loads((tmp_path / "sharding.json").read_text())
  assert set(data["results"]) == set(sharding.optimizers())
  for by_mesh in data["results"].values():
    assert set(by_mesh) == {"auto", "explicit"}
  # The baselines compile on both meshes and move no whole leaf.
  for name in ("adam", "clip_by_global_norm+nadam"):
    for r in data["results"][name].values():
      assert r["compiles"] and r["all_gathers"] == 0, (name, r)
  # Adam's update is elementwise: it has no collective at all.
  assert data["results"]["adam"]["auto"]["collective_bytes"] == 0
  # Quick layout: every sharded dimension still divides the mesh axes.
  assert data["num_params"] == sum(
    math.prod(v["shape"]) for v in data["layout"].values()
  )
  assert data["param_bytes_per_device"] < 4 * data["num_params"]
  table = (tmp_path / "sharding.md").read_text()
  for name in sharding.optimizers():
    assert f"`{name}`" in table
  assert report["results"] == data["results"]
