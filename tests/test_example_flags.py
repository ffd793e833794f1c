"""The examples' ``--exchange-*`` flags (examples/common/parallel.py).

The flags are the compressor registry's options (one flag per declared
option, ``--exchange``'s choices the registry's names); every configuration
of ``benchmarks/communication.py``'s held-out quality runs parses for both
examples and names the library exchange its label says (the
``data_parallel_step`` keywords of parts 1-2, plus the warm-up); bad
combinations are argparse errors naming the flag; a tiny ResNet run with the
compact bf16 all-gather trains, checkpoints the whole runtime state and
resumes exactly.
"""

import argparse
import dataclasses
import os
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from benchmarks import communication
from benchmarks import local_steps
from examples.bert_mlm import main as bert_main
from examples.common import outer_steps
from examples.common import parallel
from examples.common import workdir as workdir_lib
from examples.resnet_cifar10 import main as resnet_main
from examples.resnet_cifar10 import train as resnet_train
from grpo_optax import training

MAINS = {"resnet": resnet_main, "bert": bert_main}

#: data_parallel_step's keywords when no --exchange-* flag is given.
DEFAULTS = {
  "exchange": "dense",
  "fraction": 0.3,
  "chunk_size": 64,
  "values": "float32",
  "indices": "int32",
  "support": "norms",
  "rank": 1,
  "warmup_steps": 0,
}

#: What each CONFIGS entry names, besides the warm-up (WARMUP[task] steps
#: per stage for the sparse exchanges, 2.5 times that for "_long_warmup",
#: none for "_no_warmup").
EXPECTED = {
  "dense": {},
  "shared_replicated_bf16_0.0035": {
    "exchange": "shared_support",
    "fraction": 0.0035,
    "support": "replicated",
    "values": "bfloat16",
  },
  "shared_replicated_bf16_c1_0.0038": {
    "exchange": "shared_support",
    "fraction": 0.0038,
    "support": "replicated",
    "values": "bfloat16",
    "chunk_size": 1,
  },
  "all_gather_compact_bf16_0.0005": {
    "exchange": "all_gather",
    "fraction": 0.0005,
    "indices": "compact",
    "values": "bfloat16",
  },
  "powersgd_r1": {"exchange": "powersgd", "rank": 1},
  "powersgd_r2": {"exchange": "powersgd", "rank": 2},
  "powersgd_r4": {"exchange": "powersgd", "rank": 4},
  "all_gather_compact_bf16_0.00028": {
    "exchange": "all_gather",
    "fraction": 0.00028,
    "indices": "compact",
    "values": "bfloat16",
  },
  "all_gather_compact_bf16_0.00028_long_warmup": {
    "exchange": "all_gather",
    "fraction": 0.00028,
    "indices": "compact",
    "values": "bfloat16",
  },
  "all_gather_compact_bf16_0.00045_long_warmup": {
    "exchange": "all_gather",
    "fraction": 0.00045,
    "indices": "compact",
    "values": "bfloat16",
  },
  "all_gather_compact_bf16_0.00045_no_warmup": {
    "exchange": "all_gather",
    "fraction": 0.00045,
    "indices": "compact",
    "values": "bfloat16",
  },
}

GRID_LABEL = communication.GRID_OF


def test_expectations_cover_every_config():
  exchanges = set(communication.CONFIGS) - set(communication.LOCAL)
  assert set(EXPECTED) == exchanges == set(GRID_LABEL)


def _options(ex):
  """The exchange's name and option values (the flags' view)."""
  return {"exchange": ex.name, **ex.options()}


def _runtime(ex):
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  return training.data_parallel(
    lambda p, s, b, k: (jnp.sum(p["w"] * b), (s, None)),
    optax.sgd(0.1),
    mesh,
    exchange=ex,
  )


@pytest.mark.parametrize("name", sorted(EXPECTED))
@pytest.mark.parametrize("task", sorted(communication.TASKS))
def test_benchmark_configs_parse_to_the_named_exchange(task, name):
  argv = ["--data-parallel", *communication.config_argv(task, name)]
  args = MAINS[task].parse_args(argv)
  ex = parallel.exchange_of(args)
  want = {**DEFAULTS, **EXPECTED[name]}
  if want["exchange"] in ("all_gather", "shared_support"):
    scale = (
      0
      if name.endswith("_no_warmup")
      else 2.5
      if name.endswith("_long_warmup")
      else 1
    )
    want["warmup_steps"] = round(communication.WARMUP[task] * scale)
  got = _options(ex)
  # Every option the exchange takes as named; the others at their default.
  for key, value in want.items():
    assert got.get(key, DEFAULTS[key]) == value, key
    if key not in got:
      assert value == DEFAULTS[key], key
  # The same exchange as the bytes and step-time parts (but the warm-up).
  grid = dict(communication.GRID)[GRID_LABEL[name]]
  same = training.make_exchange(
    **{"chunk_size": communication.CHUNK, **grid}
    if grid["exchange"] == "shared_support"
    else grid
  )
  assert dataclasses.replace(ex, warmup_steps=0) == same
  # The library's data_parallel_step takes the flags' keywords as they are.
  kwargs = {k: v for k, v in got.items() if k != "exchange"}
  dp = training.data_parallel_step(
    lambda p, b: jnp.sum(p["w"] * b),
    optax.sgd(0.1),
    jax.make_mesh((jax.device_count(),), ("data",)),
    exchange=ex.name,
    **kwargs,
  )
  assert dp.runtime.exchange == ex
  # State beyond the residuals: the warm-up's count, the replicated
  # support, PowerSGD's Q.
  assert ex.compressor.stateful == (
    want["support"] == "replicated" or want["exchange"] == "powersgd"
  )
  info = parallel.describe(args, _runtime(ex))
  for key in ("values", "indices", "support", "rank", "warmup_steps"):
    assert info.get(key, DEFAULTS[key]) == want[key]


@pytest.mark.parametrize("name", sorted(communication.LOCAL))
def test_local_step_configs_run_the_measured_outer_exchange(name):
  h, _, program, every = communication.LOCAL[name]
  args = MAINS["bert"].parse_args(
    ["--data-parallel", *communication.config_argv("bert", name, 1800)]
  )
  assert args.local_steps == h
  assert args.eval_every == every and every % h == 0
  assert args.outer_absent == (0.15 if name.endswith("absent_0.15") else 0)
  ex = parallel.exchange_of(args)
  assert ex.warmup_steps == 0  # No DGC warm-up on the outer exchange.
  # The outer exchange is the one whose round bytes local_steps.py measured.
  if "int8" in program:
    assert args.outer_quantize == "int8"
    assert ex.name == "int8"
    opts = ex.options()
    assert (opts["fraction"], opts["chunk_size"]) == (
      local_steps.FRACTION,
      local_steps.CHUNK,
    )
  else:
    assert args.outer_quantize == "none" and ex.name == "dense"
  ratio = communication.bytes_ratio("bert", name)
  round_ratio = communication.local_round_ratios(communication.LOCAL_BYTES)
  assert ratio == pytest.approx(round_ratio[program] / h)
  assert communication.bytes_ratio("resnet", name) is None


@pytest.mark.parametrize("task", sorted(communication.TASKS))
def test_longer_runs_scale_the_warm_up_with_the_steps(task):
  name = "all_gather_compact_bf16_0.00028_long_warmup"
  steps = 3 * communication.DEFAULT_STEPS[task]
  args = MAINS[task].parse_args(
    ["--data-parallel", *communication.config_argv(task, name, steps)]
  )
  assert args.steps == steps
  ex = parallel.exchange_of(args)
  assert ex.warmup_steps == round(communication.WARMUP[task] * 2.5 * 3)
  # Dense takes the steps and no warm-up flag.
  dense = communication.config_argv(task, "dense", steps)
  assert dense[-2:] == ["--steps", str(steps)]
  assert "--exchange-warmup-steps" not in dense


@pytest.mark.parametrize("task", sorted(communication.TASKS))
def test_unset_flags_keep_the_defaults(task):
  for exchange in training.EXCHANGES:
    args = MAINS[task].parse_args(["--data-parallel", "--exchange", exchange])
    ex = parallel.exchange_of(args)
    assert ex == training.make_exchange(exchange)
    assert parallel.given_options(args) == {}
    # Only PowerSGD keeps compressor state by default: its warm-started Q.
    assert ex.compressor.stateful == (exchange == "powersgd")
    assert set(parallel.describe(args, _runtime(ex))) == {
      "replicas",
      "processes",
      "exchange",
      "fraction",
    }
  # Unset, they stay None in the config: a run started before the flags
  # existed resumes.
  args = MAINS[task].parse_args(["--data-parallel", "--exchange", "all_gather"])
  new = {_attr(parallel._flag(n)) for n in parallel.option_specs()}  # pylint: disable=protected-access
  assert all(getattr(args, name) is None for name in new)
  before = {k: v for k, v in vars(args).items() if k not in new}
  workdir_lib.check_resume_config(before, vars(args), "run")


def test_flags_are_the_registrys_options():
  # One --exchange-<option> flag per option a compressor declares (and the
  # warm-up), --exchange's choices the registry's names: read, not listed.
  parser = argparse.ArgumentParser()
  parallel.add_parallel_flags(parser)
  actions = {a.dest: a for a in parser._actions}  # pylint: disable=protected-access
  assert tuple(actions["exchange"].choices) == training.compressors.NAMES
  options = training.compressors.options()
  for name, option in options.items():
    action = actions["exchange_" + name]
    assert action.default is None
    assert (tuple(action.choices) if action.choices else ()) == option.choices
  flags = {d for d in actions if d.startswith("exchange_")}
  assert flags == {"exchange_" + n for n in [*options, "warmup_steps"]}


def _attr(flag):
  return flag[2:].replace("-", "_")


@pytest.mark.parametrize(
  "argv, message",
  [
    (
      ["--exchange-values", "bfloat16"],
      "--exchange-values needs --data-parallel",
    ),
    (["--exchange-rank", "2"], "--exchange-rank needs --data-parallel"),
    (
      ["--data-parallel", "--exchange-rank", "2"],
      "--exchange-rank 2 needs --exchange powersgd, got --exchange dense",
    ),
    (
      ["--data-parallel", "--exchange", "all_gather", "--exchange-rank", "1"],
      "--exchange-rank 1 needs --exchange powersgd",
    ),
    (
      ["--data-parallel", "--exchange", "powersgd", "--exchange-rank", "0"],
      "--exchange-rank must be >= 1",
    ),
    (
      [
        "--data-parallel",
        "--exchange",
        "all_gather",
        "--exchange-support",
        "replicated",
      ],
      "--exchange-support replicated needs --exchange shared_support",
    ),
    (
      [
        "--data-parallel",
        "--exchange",
        "shared_support",
        "--exchange-indices",
        "compact",
      ],
      "--exchange-indices compact needs --exchange all_gather",
    ),
    (
      [
        "--data-parallel",
        "--exchange",
        "shared_support",
        "--exchange-values",
        "int8",
      ],
      "--exchange-values int8 needs --exchange all_gather",
    ),
    (
      ["--data-parallel", "--exchange-values", "bfloat16"],
      "--exchange-values bfloat16 needs --exchange all_gather or "
      "shared_support or powersgd",
    ),
    (
      ["--data-parallel", "--exchange-values", "float16"],
      "invalid choice",
    ),
    (
      [
        "--data-parallel",
        "--exchange",
        "powersgd",
        "--exchange-warmup-steps",
        "5",
      ],
      "--exchange-warmup-steps 5 needs --exchange all_gather or shared_support",
    ),
    (
      [
        "--data-parallel",
        "--exchange",
        "all_gather",
        "--exchange-warmup-steps",
        "-1",
      ],
      "--exchange-warmup-steps must be >= 0",
    ),
    (
      [
        "--data-parallel",
        "--local-steps",
        "2",
        "--eval-every",
        "50",
        "--exchange",
        "shared_support",
        "--outer-quantize",
        "int8",
        "--exchange-support",
        "replicated",
      ],
      "--exchange-support replicated needs --exchange shared_support, got "
      "--exchange int8 (the int8 outer exchange)",
    ),
  ],
)
def test_bad_exchange_flags(capsys, argv, message):
  with pytest.raises(SystemExit) as exit_info:
    resnet_main.parse_args(argv)
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err


_TINY_RESNET = [
  "--depth",
  "8",
  "--batch-size",
  "8",
  "--max-train-examples",
  "64",
  "--max-eval-examples",
  "16",
  "--quiet",
  "--fast-compile",
]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Sharding info not provided:UserWarning")
def test_resnet_all_gather_compact_bf16_trains_and_resumes(tmp_path):
  # The benchmark's all_gather compact bf16 configuration (with its sparsity
  # warm-up: an ExchangeState) at tiny size, 2 steps with a checkpoint after
  # each; resumed from step 1 it ends where the uninterrupted run did.
  full = str(tmp_path / "full")
  argv = [
    "--data-parallel",
    *communication.config_argv("resnet", "all_gather_compact_bf16_0.0005"),
    *_TINY_RESNET,
    "--steps",
    "2",
    "--checkpoint-every",
    "1",
    "--eval-every",
    "1",
  ]
  run = lambda *extra: resnet_train.train_and_evaluate(
    resnet_main.parse_args(argv + list(extra))
  )
  want = run("--workdir", full)
  assert np.isfinite(want["eval_loss"])
  assert 0.0 <= want["eval_accuracy"] <= 1.0
  assert all(np.isfinite(loss) for _, loss in want["train_loss_history"])
  assert want["data_parallel"] == {
    "replicas": 8,
    "processes": 1,
    "exchange": "all_gather",
    "fraction": 0.0005,
    "values": "bfloat16",
    "indices": "compact",
    "warmup_steps": communication.WARMUP["resnet"],
  }
  ckpt = os.path.join(full, "checkpoints", "2")
  assert "state" in set(os.listdir(ckpt))

  cut = str(tmp_path / "cut")
  shutil.copytree(full, cut)
  mngr = ocp.CheckpointManager(os.path.join(cut, "checkpoints"))
  mngr.delete(2)
  mngr.close()
  got = run("--workdir", cut, "--resume")
  assert got["resumed_from_step"] == 1
  assert got["train_loss_history"] == want["train_loss_history"]
  assert got["eval_history"] == want["eval_history"]
  restore = lambda d, item: ocp.PyTreeCheckpointer().restore(
    os.path.join(d, "checkpoints", "2", item)
  )
  a, b = restore(full, "state"), restore(cut, "state")
  assert jax.tree.structure(a) == jax.tree.structure(b)
  jax.tree.map(np.testing.assert_array_equal, a, b)
  # The whole runtime state: the exchange's residuals and step count too.
  assert any("exchange_residual" in k for k in a)
  (count,) = [v for k, v in a.items() if k.endswith("exchange_count")]
  assert int(count) == 2


def test_parallel_module_is_flags_and_wiring():
  # The examples' data parallelism is the library's runtime: their module
  # holds flags and wiring (<= 250 lines), no step of its own.
  source = pathlib.Path(parallel.__file__).read_text(encoding="utf-8")
  assert len(source.splitlines()) <= 250
  for own_step in ("shard_map", "pmean", "psum", "pcast", "sparse_pmean"):
    assert own_step not in source, own_step


@pytest.mark.parametrize("task", sorted(communication.TASKS))
def test_outer_absent_draws_one_mask_per_round(task):
  argv = ["--data-parallel", "--local-steps", "4", "--outer-absent", "0.15"]
  argv += ["--eval-every", "100"]
  args = MAINS[task].parse_args(argv + ["--seed", "3"])
  masks = [outer_steps.participation(args, done, 8) for done in range(1, 4001)]
  # One mask per round of 4 steps, the same on every step of the round.
  for r in range(1000):
    for m in masks[4 * r + 1 : 4 * r + 4]:
      np.testing.assert_array_equal(m, masks[4 * r])
  rounds = np.stack(masks[::4])
  assert rounds.shape == (1000, 8)
  assert set(np.unique(rounds)) <= {0.0, 1.0}
  assert abs((1 - rounds.mean()) - 0.15) < 0.02  # 8,000 draws
  # Seeded: the same seed draws the same masks, another seed others.
  again = MAINS[task].parse_args(argv + ["--seed", "3"])
  other = MAINS[task].parse_args(argv + ["--seed", "4"])
  np.testing.assert_array_equal(
    outer_steps.participation(again, 9, 8), masks[8]
  )
  assert any(
    not np.array_equal(outer_steps.participation(other, d, 8), masks[d - 1])
    for d in range(1, 400, 4)
  )
  # Off: no mask (every replica reports).
  plain = MAINS[task].parse_args(argv[:3] + ["--eval-every", "100"])
  assert outer_steps.participation(plain, 1, 8) is None


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--data-parallel", "--outer-absent", "0.1"], "needs --local-steps"),
    (
      ["--data-parallel", "--local-steps", "4", "--outer-absent", "1.0"],
      r"--outer-absent must be in \[0, 1\), got 1.0",
    ),
  ],
)
def test_outer_absent_is_checked(argv, message, capsys):
  with pytest.raises(SystemExit):
    MAINS["bert"].parse_args(argv)
  assert re.search(message, capsys.readouterr().err)
