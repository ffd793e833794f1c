"""The examples' ``--exchange-*`` flags (examples/common/parallel.py).

Every configuration of ``benchmarks/communication.py``'s held-out quality
runs parses for both examples and names the library exchange its label says
(the ``data_parallel_step`` keywords of parts 1-2, plus the warm-up); the
examples' own ``shard_map`` exchange with those options equals
``data_parallel_step``'s; bad combinations are argparse errors naming the
flag; a tiny ResNet run with the compact bf16 all-gather trains, checkpoints
the whole exchange state and resumes exactly.
"""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from benchmarks import communication
from examples.bert_mlm import main as bert_main
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
#: per stage for the sparse exchanges).
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
}

#: The part 1-2 (bytes, step time) label of the same exchange.
GRID_LABEL = {
  "dense": "dense",
  "shared_replicated_bf16_0.0035": "shared_support replicated bf16 f=0.0035",
  "shared_replicated_bf16_c1_0.0038": (
    "shared_support replicated bf16 c=1 f=0.0038"
  ),
  "all_gather_compact_bf16_0.0005": "all_gather bf16/compact f=0.0005",
  "powersgd_r1": "powersgd r=1",
}


def test_expectations_cover_every_config():
  assert set(EXPECTED) == set(communication.CONFIGS) == set(GRID_LABEL)


@pytest.mark.parametrize("name", sorted(communication.CONFIGS))
@pytest.mark.parametrize("task", sorted(communication.TASKS))
def test_benchmark_configs_parse_to_the_named_exchange(task, name):
  argv = ["--data-parallel", *communication.config_argv(task, name)]
  args = MAINS[task].parse_args(argv)
  kwargs = parallel.exchange_kwargs(args)
  want = {**DEFAULTS, **EXPECTED[name]}
  if want["exchange"] in ("all_gather", "shared_support"):
    want["warmup_steps"] = communication.WARMUP[task]
  assert kwargs == want
  # The same exchange as the bytes and step-time parts (but the warm-up).
  grid = {**DEFAULTS, "chunk_size": communication.CHUNK}
  grid.update(dict(communication.GRID)[GRID_LABEL[name]])
  assert {**kwargs, "warmup_steps": 0} == grid
  # The library takes them as they are.
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  dp = training.data_parallel_step(
    lambda p, b: jnp.sum(p["w"] * b), optax.sgd(0.1), mesh, **kwargs
  )
  assert (dp.exchange, dp.fraction, dp.chunk_size) == (
    want["exchange"],
    want["fraction"],
    want["chunk_size"],
  )
  # And so do the examples' replicas.
  replicas = parallel.make_replicas(args)
  assert replicas is not None
  assert (replicas.exchange, replicas.fraction, replicas.chunk_size) == (
    want["exchange"],
    want["fraction"],
    want["chunk_size"],
  )
  assert replicas.options == {
    k: want[k] for k in ("values", "indices", "support", "rank", "warmup_steps")
  }
  assert replicas.keeps_state == (
    want["warmup_steps"] > 0
    or want["support"] == "replicated"
    or want["exchange"] == "powersgd"
  )
  info = replicas.describe()
  for key in ("values", "indices", "support", "rank", "warmup_steps"):
    assert info.get(key, DEFAULTS[key]) == want[key]


@pytest.mark.parametrize("task", sorted(communication.TASKS))
def test_unset_flags_keep_the_defaults(task):
  for exchange in training.EXCHANGES:
    args = MAINS[task].parse_args(["--data-parallel", "--exchange", exchange])
    assert parallel.exchange_kwargs(args) == {**DEFAULTS, "exchange": exchange}
    replicas = parallel.make_replicas(args)
    assert replicas is not None
    # Only PowerSGD keeps state by default: its warm-started Q.
    assert replicas.keeps_state == (exchange == "powersgd")
    assert set(replicas.describe()) == {
      "replicas",
      "processes",
      "exchange",
      "fraction",
    }
  assert parallel.exchange_kwargs(MAINS[task].parse_args([])) == DEFAULTS
  # Unset, they stay None in the config: a run started before the flags
  # existed resumes.
  args = MAINS[task].parse_args(["--data-parallel", "--exchange", "all_gather"])
  new = {_attr(flag) for flag, _ in parallel.EXCHANGE_OPTIONS.values()}
  assert all(getattr(args, name) is None for name in new)
  before = {k: v for k, v in vars(args).items() if k not in new}
  workdir_lib.check_resume_config(before, vars(args), "run")


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
        "--exchange-support",
        "replicated",
      ],
      "--exchange-support does not apply to --local-steps",
    ),
  ],
)
def test_bad_exchange_flags(capsys, argv, message):
  with pytest.raises(SystemExit) as exit_info:
    resnet_main.parse_args(argv)
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err


def test_replicas_exchange_equals_data_parallel_step():
  # The examples' own shard_map step, carrying the ExchangeState (warm-up
  # stages, replicated support), against the library's step: 2 SGD steps
  # on a least-squares loss, one per warm-up stage (0.25, then 0.1).
  kwargs = {
    "exchange": "shared_support",
    "fraction": 0.1,
    "chunk_size": 2,
    "values": "bfloat16",
    "support": "replicated",
    "warmup_steps": 1,
  }
  replicas = parallel.Replicas(
    kwargs["exchange"],
    kwargs["fraction"],
    **{k: v for k, v in kwargs.items() if k not in ("exchange", "fraction")},
  )
  assert replicas.keeps_state
  w = replicas.num_replicas
  rng = np.random.default_rng(0)
  x = rng.normal(size=(4 * w, 64)).astype(np.float32)
  y = rng.normal(size=(4 * w,)).astype(np.float32)
  params = {"w": np.zeros(64, np.float32), "b": np.zeros((), np.float32)}

  def loss_fn(p, batch):
    xs, ys = batch
    return jnp.mean((xs @ p["w"] + p["b"] - ys) ** 2)

  def step(p, residual, xs, ys, key):
    del key
    grads = jax.grad(loss_fn)(replicas.varying(p), (xs, ys))
    grads, residual = replicas.exchange_grads(grads, residual)
    new = jax.tree.map(lambda a, g: a - 0.1 * g, p, grads)
    return new, residual, replicas.mean(loss_fn(p, (xs, ys)))

  run = replicas.jit(step, num_batch_args=2)
  state = replicas.replicate(params)
  residual = replicas.init_residual(params)
  assert isinstance(residual, training.ExchangeState)
  key = replicas.replicate(jax.random.key(0))
  dp = training.data_parallel_step(
    loss_fn, optax.sgd(0.1), replicas.mesh, **kwargs
  )
  dp_state = dp.init(params)
  for _ in range(2):
    state, residual, _ = run(
      state, residual, replicas.shard(x), replicas.shard(y), key
    )
    dp_state, _ = dp.step(dp_state, (x, y))
  assert int(residual.count) == int(dp_state.exchange.count) == 2
  for got, want in zip(
    jax.tree.leaves(state), jax.tree.leaves(dp_state.params)
  ):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)
  for got, want in zip(residual.support, dp_state.exchange.support):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
  mine = residual.residual
  theirs = jax.tree.leaves(dp_state.residual)
  for got, want in zip(mine, theirs):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)


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
  assert {"state", "residual", "exchange"} <= set(os.listdir(ckpt))

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
  for item in ("state", "residual", "exchange"):
    a, b = restore(full, item), restore(cut, item)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(np.testing.assert_array_equal, a, b)
  assert int(restore(full, "exchange")["count"]) == 2
