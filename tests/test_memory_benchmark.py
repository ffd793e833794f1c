"""benchmarks.memory (state bytes, decoder) and benchmarks/gpu.sh --dry-run."""

import json
import math
import os
import subprocess
import sys

import jax
import pytest

from benchmarks import claims
from benchmarks import memory


def test_state_bytes_per_param():
  cfg = memory.DRY
  params = memory.gpt_shapes(cfg, cfg["ref_depth"])
  leaves = jax.tree.leaves(params)
  n = sum(math.prod(x.shape) for x in leaves)
  # 8-bit: mu and nu, 1 byte per entry (4 under 4,096 entries: stored
  # exactly) + one fp32 scale per block of min(256, last dim) entries along
  # the last axis.
  want = (
    sum(
      2 * math.prod(x.shape) * (1 if math.prod(x.shape) >= 4096 else 4)
      + 2
      * 4
      * math.prod(x.shape[:-1])
      * math.ceil(x.shape[-1] / min(256, x.shape[-1]))
      for x in leaves
    )
    / n
  )
  got = memory.state_section(cfg)["bytes_per_param"]
  assert got["adam_fp32"] == 8.0 and got["adam_bf16"] == 4.0
  assert got["adam_int8"] == pytest.approx(want, abs=1e-4)
  assert list(memory.FACTORIES)[0] == memory.BASELINE


def test_decoder_loss_is_finite_and_layers_stack():
  cfg = memory.DRY
  params = memory.gpt_params(
    jax.random.key(0), cfg["vocab"], cfg["seq"], cfg["d"], 3
  )
  assert params.layers["qkv"].shape == (3, cfg["d"], 3 * cfg["d"])
  tokens = memory.markov_tokens(jax.random.key(1), cfg["vocab"], 2, cfg["seq"])
  assert tokens.shape == (2, cfg["seq"] + 1)
  loss = memory.training.stacked_loss_fn(
    memory.gpt_embed, memory.gpt_layer, memory.gpt_head
  )(params, tokens)
  # Near log(vocab) at initialisation (small logits).
  assert abs(float(loss) - math.log(cfg["vocab"])) < 0.5


@pytest.mark.slow  # spawns the benchmarks and four example runs
def test_gpu_script_dry_run(tmp_path):
  env = dict(os.environ, PYTHON=sys.executable, GPU_SH_OUT=str(tmp_path))
  env.pop("XLA_FLAGS", None)  # one CPU device, as a user's shell has
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run(
    ["bash", "benchmarks/gpu.sh", "--dry-run"],
    cwd=root,
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  out = tmp_path / "gpu-dry-run"
  with open(out / "memory.json") as f:
    mem = json.load(f)
  assert set(memory.SECTIONS) <= set(mem)
  assert {r["optimizer"] for r in mem["time"]} == set(memory.FACTORIES)
  assert all(r["fits"] for r in mem["capacity"]["rows"])
  with open(out / "examples_throughput.json") as f:
    assert len(json.load(f)) == 4
  assert any(
    name.startswith("step_time") and name.endswith(".json")
    for name in os.listdir(out)
  )
  # Claims rows 7 and 11 are built from memory.json.
  table, found = claims.build(str(out))
  assert found["memory"]
  rows = [r for r in table.rows if r[4] == claims.MEMORY]
  assert len(rows) == 2 and all("pending" not in r[5] for r in rows)
  assert table.rows[6][0].startswith("35% less memory")
  assert table.rows[10][0].startswith("38% less GPU memory")
