"""The Flax NNX examples: a few steps on tiny data, flags, exact resume.

Runs are tiny (ResNet-8 on 64 digits, a 1-layer BERT with hidden 16) because
compilation dominates; GRPO runs double as the resume-exactness checks.
"""

import contextlib
import io
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from examples.bert_mlm import input_pipeline as text_pipeline
from examples.bert_mlm import main as bert_main
from examples.bert_mlm import models as bert_models
from examples.bert_mlm import train as bert_train
from examples.common import data as data_lib
from examples.common import optim
from examples.common import workdir as workdir_lib
from examples.resnet_cifar10 import main as resnet_main
from examples.resnet_cifar10 import models as resnet_models
from examples.resnet_cifar10 import train as resnet_train

# Restoring checkpoints without a target (to compare them) makes orbax warn.
pytestmark = pytest.mark.filterwarnings(
  "ignore:Sharding info not provided:UserWarning"
)

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
_TINY_BERT = [
  "--hidden",
  "16",
  "--num-layers",
  "1",
  "--num-heads",
  "2",
  "--ffn",
  "32",
  "--vocab-size",
  "300",
  "--seq-len",
  "16",
  "--batch-size",
  "4",
  "--max-train-examples",
  "32",
  "--max-eval-examples",
  "4",
  "--quiet",
  "--fast-compile",
]


def _run(main_module, train_module, argv):
  return train_module.train_and_evaluate(main_module.parse_args(argv))


def _check_workdir(workdir, summary, accuracy_key):
  with open(os.path.join(workdir, "metrics.json")) as f:
    written = json.load(f)
  for key in (
    "optimizer",
    "steps",
    "train_loss",
    "eval_loss",
    "wall_time_s",
    accuracy_key,
    "train_loss_history",
    "eval_history",
  ):
    assert key in written, key
  assert written["steps"] == 2
  assert [s for s, _ in written["train_loss_history"]] == [1, 2]
  assert written["eval_history"][-1][0] == 2
  assert np.isfinite(written["eval_loss"])
  assert written["eval_loss"] == summary["eval_loss"]
  assert os.path.getsize(os.path.join(workdir, "loss_curves.png")) > 0
  events = os.listdir(os.path.join(workdir, "tensorboard"))
  assert any(name.startswith("events.out.tfevents") for name in events)
  mngr = ocp.CheckpointManager(os.path.join(workdir, "checkpoints"))
  assert mngr.latest_step() == 2
  mngr.close()


def test_resnet_two_steps_adam(tmp_path):
  workdir = str(tmp_path / "run")
  summary = _run(
    resnet_main,
    resnet_train,
    _TINY_RESNET
    + ["--steps", "2", "--optimizer", "adam", "--workdir", workdir],
  )
  assert summary["optimizer"] == "adam"
  assert 0.0 <= summary["eval_accuracy"] <= 1.0
  _check_workdir(workdir, summary, "eval_accuracy")


def _flag_error(run) -> str:
  """What ``run`` printed to stderr when it exited with a flag error."""
  err = io.StringIO()
  with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as info:
    run()
  assert info.value.code == 2
  return err.getvalue()


def _final_state(workdir, step):
  path = os.path.join(workdir, "checkpoints", str(step), "state")
  return ocp.PyTreeCheckpointer().restore(path)


def _two_steps_then_resume(
  tmp_path, main_module, train_module, argv, optimizer, accuracy_key
):
  """Two steps with a checkpoint after each; then the run is cut back to
  checkpoint 1 (as if it had died there) and resumed to step 2. Everything
  -- curves, evaluations, parameters, BatchNorm statistics, optimizer state,
  PRNG keys -- must equal the uninterrupted run bit for bit.
  """
  full = str(tmp_path / "full")
  argv = argv + [
    "--optimizer",
    optimizer,
    "--steps",
    "2",
    "--checkpoint-every",
    "1",
    "--eval-every",
    "1",
  ]
  want = _run(main_module, train_module, argv + ["--workdir", full])
  _check_workdir(full, want, accuracy_key)
  assert want["optimizer"] == optimizer

  cut = str(tmp_path / "cut")
  shutil.copytree(full, cut)
  mngr = ocp.CheckpointManager(os.path.join(cut, "checkpoints"))
  mngr.delete(2)
  mngr.close()
  # A flag error (one line of usage, exit code 2), before any work.
  assert "add --resume" in _flag_error(
    lambda: _run(main_module, train_module, argv + ["--workdir", cut])
  )
  # Extending a run would rebuild its cosine schedule for more steps: refused
  # before anything is trained, naming the flag (issue 13).
  assert re.search(
    r"--steps 2 -> 4.*new --workdir",
    _flag_error(
      lambda: _run(
        main_module,
        train_module,
        argv + ["--workdir", cut, "--resume", "--steps", "4"],
      )
    ),
  )
  got = _run(main_module, train_module, argv + ["--workdir", cut, "--resume"])
  assert got["resumed_from_step"] == 1
  assert got["train_loss_history"] == want["train_loss_history"]
  assert got["eval_history"] == want["eval_history"]
  want_state, got_state = _final_state(full, 2), _final_state(cut, 2)
  assert jax.tree.structure(want_state) == jax.tree.structure(got_state)
  jax.tree.map(np.testing.assert_array_equal, got_state, want_state)


def test_resnet_grpo_two_steps_and_exact_resume(tmp_path):
  # GRPO (its state holds residuals and a PRNG key), BatchNorm statistics,
  # a cosine schedule with warm-up and random crops/flips from (seed, step).
  _two_steps_then_resume(
    tmp_path,
    resnet_main,
    resnet_train,
    _TINY_RESNET + ["--augment"],
    "grpo",
    "eval_accuracy",
  )


def test_resnet_data_parallel_sparse_exchange_and_exact_resume(tmp_path):
  # 8 forced devices, one example per replica; the runtime's state (the
  # all-gather exchange's per-replica residuals included) is checkpointed,
  # so the resumed run is exact.
  _two_steps_then_resume(
    tmp_path,
    resnet_main,
    resnet_train,
    _TINY_RESNET
    + [
      "--data-parallel",
      "--exchange",
      "all_gather",
      "--exchange-fraction",
      "0.1",
    ],
    "adam",
    "eval_accuracy",
  )
  # The checkpoint holds the runtime's whole state, the residuals included.
  saved = _final_state(os.path.join(tmp_path, "full"), 2)
  assert any("exchange_residual" in name for name in saved)
  with open(os.path.join(tmp_path, "full", "metrics.json")) as f:
    assert json.load(f)["data_parallel"] == {
      "replicas": 8,
      "processes": 1,
      "exchange": "all_gather",
      "fraction": 0.1,
    }


@pytest.mark.slow
def test_resnet_local_steps_int8_outer_and_exact_resume(tmp_path):
  # One local step per round (checkpoints fall on outer steps): every
  # replica's state, its unsent part and the outer Nesterov state are
  # checkpointed, so the resumed run is exact.
  _two_steps_then_resume(
    tmp_path,
    resnet_main,
    resnet_train,
    _TINY_RESNET
    + [
      "--data-parallel",
      "--local-steps",
      "1",
      "--exchange",
      "shared_support",
      "--exchange-fraction",
      "0.5",
      "--exchange-chunk-size",
      "16",
      "--outer-quantize",
      "int8",
    ],
    "adam",
    "eval_accuracy",
  )
  # Every replica's state, its unsent part and the outer state.
  saved = _final_state(os.path.join(tmp_path, "full"), 2)
  for part in ("exchange_residual", "outer_params", "outer_opt_state"):
    assert any(part in name for name in saved), part
  with open(os.path.join(tmp_path, "full", "metrics.json")) as f:
    info = json.load(f)["data_parallel"]
  assert info["local_steps"] == 1 and info["outer_quantize"] == "int8"


def test_bert_adam_two_steps_and_exact_resume(tmp_path):
  # Dropout and masks come from (seed, step), not from consumed RNG state.
  _two_steps_then_resume(
    tmp_path,
    bert_main,
    bert_train,
    _TINY_BERT + ["--dropout", "0.1"],
    "adam",
    "eval_masked_accuracy",
  )


def test_bert_grpo_two_steps_on_text_files_without_workdir(
  tmp_path, monkeypatch
):
  # GRPO with head_entropy, a corpus from --text-files, nothing written.
  text = tmp_path / "corpus.txt"
  rng = np.random.default_rng(0)
  words = ["alpha", "beta", "gamma", "delta", "kernel", "tensor", "grad"]
  text.write_text(
    "\n\n".join(" ".join(rng.choice(words, 40)) for _ in range(30))
  )
  run_dir = tmp_path / "cwd"
  run_dir.mkdir()
  monkeypatch.chdir(run_dir)
  summary = _run(
    bert_main,
    bert_train,
    _TINY_BERT
    + [
      "--steps",
      "2",
      "--optimizer",
      "grpo",
      "--grpo-importance",
      "true",
      "--text-files",
      str(text),
    ],
  )
  assert summary["corpus"] == "files" and summary["optimizer"] == "grpo"
  assert [s for s, _ in summary["train_loss_history"]] == [1, 2]
  assert np.isfinite(summary["eval_loss"])
  assert not os.listdir(run_dir)  # No --workdir: nothing written.


def test_bert_grpo_data_parallel_shared_support():
  summary = _run(
    bert_main,
    bert_train,
    _TINY_BERT
    + [
      "--steps",
      "2",
      "--batch-size",
      "8",
      "--data-parallel",
      "--exchange",
      "shared_support",
    ],
  )
  assert summary["data_parallel"]["exchange"] == "shared_support"
  assert summary["data_parallel"]["fraction"] == 0.3
  assert np.isfinite(summary["eval_loss"])
  assert all(np.isfinite(loss) for _, loss in summary["train_loss_history"])


def test_head_entropy_reaches_grpo_only_with_importance_weighting():
  uses = lambda *argv: bert_train.uses_head_entropy(
    bert_main.parse_args(list(argv))
  )
  assert not uses()  # the library's default: importance off
  assert uses("--grpo-importance", "true")
  assert not uses("--grpo-importance", "true", "--no-head-entropy")
  assert not uses("--optimizer", "adam")


def test_grpo_flags_follow_the_signature():
  args = resnet_main.parse_args([])
  assert args.optimizer == "grpo"
  parser_dests = set(
    vars(
      resnet_main.parse_args(
        [
          f"--grpo-{name.replace('_', '-')}={'none' if value is None else value}"
          for name, value in optim.grpo_knobs().items()
        ]
      )
    )
  )
  for name in optim.grpo_knobs():
    assert "grpo_" + name in parser_dests, name
  args = bert_main.parse_args(
    [
      "--grpo-sparsify",
      "none",
      "--grpo-fraction",
      "0.5",
      "--grpo-nesterov",
      "false",
      "--grpo-filter-decay",
      "0.9",
      "--grpo-freeze-threshold",
      "none",
      "--grpo-every",
      "7",
    ]
  )
  assert optim.grpo_overrides(args) == {
    "sparsify": None,
    "fraction": 0.5,
    "nesterov": False,
    "filter_decay": 0.9,
    "freeze_threshold": None,
    "every": 7,
  }
  assert optim.grpo_overrides(bert_main.parse_args([])) == {}


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--optimizer", "lion"], "invalid choice"),
    (["--optimizer", "adam", "--grpo-fraction", "0.5"], "only apply"),
    (["--grpo-nesterov", "maybe"], "boolean"),
    (["--grpo-every", "1.5"], "invalid int"),
    (["--steps", "0"], "--steps"),
    (["--resume"], "--workdir"),
    (["--dataset", "cifar10"], "--data-dir"),
    (["--dataset", "cifar10", "--data-dir", "/nonexistent"], "--download"),
    (["--download"], "only applies"),
    (["--depth", "50"], "invalid choice"),
    (["--image-size", "12"], "multiple of 8"),
    (["--exchange", "all_gather"], "needs --data-parallel"),
    (["--data-parallel", "--exchange", "topk"], "invalid choice"),
    (["--data-parallel", "--exchange-fraction", "0"], "--exchange-fraction"),
    (["--data-parallel", "--num-processes", "2"], "--coordinator-address"),
    (
      [
        "--data-parallel",
        "--num-processes",
        "2",
        "--process-id",
        "2",
        "--coordinator-address",
        "127.0.0.1:1",
      ],
      "--process-id",
    ),
    (["--local-steps", "4"], "--local-steps needs --data-parallel"),
    (["--data-parallel", "--local-steps", "-1"], "--local-steps must be"),
    (
      ["--data-parallel", "--local-steps", "4", "--eval-every", "6"],
      "--eval-every must be a multiple of --local-steps 4",
    ),
    (
      [
        "--data-parallel",
        "--local-steps",
        "5",
        "--eval-every",
        "10",
        "--checkpoint-every",
        "3",
        "--workdir",
        "never_written",  # checked at parse time only
      ],
      "--checkpoint-every must be a multiple",
    ),
    (
      [
        "--data-parallel",
        "--local-steps",
        "2",
        "--eval-every",
        "50",
        "--outer-momentum",
        "1",
      ],
      "--outer-momentum must be in [0, 1)",
    ),
    (
      [
        "--data-parallel",
        "--local-steps",
        "2",
        "--eval-every",
        "50",
        "--outer-lr",
        "0",
      ],
      "--outer-lr must be > 0",
    ),
    (
      ["--data-parallel", "--outer-quantize", "int8"],
      "--outer-quantize needs --local-steps",
    ),
    (
      [
        "--data-parallel",
        "--local-steps",
        "2",
        "--eval-every",
        "50",
        "--exchange",
        "all_gather",
        "--outer-quantize",
        "int8",
      ],
      "needs --exchange dense or shared_support",
    ),
    (["--distributed", "auto"], "need --data-parallel"),
  ],
)
def test_bad_resnet_flags(capsys, argv, message):
  with pytest.raises(SystemExit) as exit_info:
    resnet_main.parse_args(argv)
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--hidden", "30", "--num-heads", "4"], "divisible"),
    (["--mask-rate", "0"], "--mask-rate"),
    (["--text-files", "/nonexistent/file.txt"], "no such file"),
    (["--vocab-size", "100"], "--vocab-size"),
  ],
)
def test_bad_bert_flags(capsys, argv, message):
  with pytest.raises(SystemExit) as exit_info:
    bert_main.parse_args(argv)
  assert exit_info.value.code == 2  # argparse's usage error
  assert message in capsys.readouterr().err


def test_batch_indices_are_a_function_of_seed_and_step():
  n, batch = 10, 4
  epoch = np.concatenate(
    [data_lib.batch_indices(3, s, batch, n) for s in range(5)]
  )  # 20 = two epochs.
  assert sorted(epoch[:10]) == list(range(10))
  assert sorted(epoch[10:]) == list(range(10))
  np.testing.assert_array_equal(
    data_lib.batch_indices(3, 2, batch, n), epoch[8:12]
  )
  assert not np.array_equal(data_lib.batch_indices(4, 0, batch, n), epoch[:4])


@pytest.mark.parametrize(
  "depth, params", [(8, 78_000), (20, 272_000), (32, 467_000), (18, 11_170_000)]
)
def test_resnet_depths(depth, params):
  model = nnx.eval_shape(
    lambda: resnet_models.ResNet(
      depth, num_classes=10, in_channels=3, rngs=nnx.Rngs(0)
    )
  )
  graphdef, state = nnx.split(model)
  logits = jax.eval_shape(
    lambda s, x: nnx.merge(graphdef, s)(x, train=False),
    state,
    jax.ShapeDtypeStruct((2, 32, 32, 3), jnp.float32),
  )
  assert logits.shape == (2, 10) and logits.dtype == jnp.float32
  count = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert abs(count - params) < 0.01 * params
  assert nnx.state(model, nnx.BatchStat)  # Kept apart from nnx.Param.


def test_bert_interface_and_head_entropy_tree():
  config = bert_models.BertConfig(
    vocab_size=64, max_len=8, hidden=16, num_layers=2, num_heads=4, ffn=32
  )
  model = nnx.jit(lambda: bert_models.BertMLM(config, rngs=nnx.Rngs(0)))()
  tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
  assert nnx.jit(lambda m, t: m(t))(model, tokens).shape == (2, 8, 64)
  for block in model.layers:  # The attribute names others rely on.
    for module in (
      block.ln1,
      block.attn.query,
      block.attn.key,
      block.attn.value,
      block.attn.out,
      block.ln2,
      block.mlp.fc1,
      block.mlp.fc2,
    ):
      assert isinstance(module, nnx.Module)
  assert model.tok_embed and model.pos_embed and model.ln_f and model.mlm_head

  def loss(model):
    logits, entropies = model.apply_with_entropy(tokens)
    return logits.mean(), entropies

  grads, entropies = nnx.jit(nnx.grad(loss, has_aux=True))(model)
  assert len(entropies) == 2 and entropies[0].shape == (4,)
  assert bool(jnp.all((entropies[0] > 0) & (entropies[0] <= jnp.log(8.0))))
  tree = bert_train.head_entropy_tree(grads, entropies)
  pure = (getattr(nnx, "as_pure", None) or nnx.pure)(grads)
  with_entropy = 0
  for (path, g), h in zip(
    jax.tree_util.tree_leaves_with_path(pure),
    jax.tree.leaves(tree, is_leaf=lambda x: x is None),
  ):
    names = [getattr(k, "key", None) for k in path]
    if h is None:
      assert "attn" not in names or names[-2:] == ["out", "bias"]
      continue
    with_entropy += 1
    assert jnp.broadcast_shapes(g.shape, h.shape) == g.shape
    assert h.size == 4
  assert with_entropy == 2 * 7  # q/k/v kernel+bias, out kernel, per layer.


def test_mask_tokens():
  tokens = jnp.arange(2, 66, dtype=jnp.int32).reshape(2, 32)
  inputs, positions, targets = text_pipeline.mask_tokens(
    jax.random.key(0), tokens, num_predictions=5, vocab_size=100
  )
  assert positions.shape == targets.shape == (2, 5)
  np.testing.assert_array_equal(
    targets, np.take_along_axis(np.asarray(tokens), positions, axis=1)
  )
  changed = np.asarray(inputs != tokens)
  for row in range(2):  # Only chosen positions may change.
    assert set(np.nonzero(changed[row])[0]) <= set(np.asarray(positions[row]))


def test_resume_config_check_names_run_defining_flags():
  saved = {
    "steps": 6,
    "lr": 0.1,
    "eval_every": 2,
    "workdir": "a",
    "grpo_fraction": 0.3,
  }
  # Where and how often a run writes or evaluates may change.
  workdir_lib.check_resume_config(
    saved, {**saved, "eval_every": 5, "workdir": "b", "resume": True}, "w"
  )
  with pytest.raises(ValueError, match=r"--steps 6 -> 12") as e:
    workdir_lib.check_resume_config(saved, {**saved, "steps": 12}, "w")
  assert "--lr" not in str(e.value)
  # A knob given at the start and dropped later differs too.
  with pytest.raises(ValueError, match=r"--grpo-fraction 0.3 -> None"):
    workdir_lib.check_resume_config(
      saved, {k: v for k, v in saved.items() if k != "grpo_fraction"}, "w"
    )
