"""examples/rl_arithmetic: the task encoding, flags, a few steps, exact resume."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from examples.rl_arithmetic import main as ar_main
from examples.rl_arithmetic import models
from examples.rl_arithmetic import train as ar_train

pytestmark = pytest.mark.filterwarnings(
  "ignore:Sharding info not provided:UserWarning"
)

_TINY = [
  "--num-digits",
  "2",
  "--hidden",
  "16",
  "--num-layers",
  "1",
  "--num-heads",
  "2",
  "--ffn",
  "16",
  "--batch-size",
  "4",
  "--group-size",
  "4",
  "--eval-problems",
  "8",
  "--warm-start-steps",
  "2",
  "--warm-start-problems",
  "16",
  "--quiet",
  "--fast-compile",
]


def _run(argv):
  return ar_train.train_and_evaluate(ar_main.parse_args(argv))


def test_encoding_rewards_and_held_out_split():
  prompts, answers = models.encode(
    np.array([1234, 9999]), np.array([8765, 1]), 4
  )
  # Columns (a_i, b_i), least significant first: 4+5, 3+6, 2+7, 1+8, "=".
  np.testing.assert_array_equal(
    prompts[0], [12 + 45, 12 + 36, 12 + 27, 12 + 18, models.EQUALS]
  )
  np.testing.assert_array_equal(answers[0], [9, 9, 9, 9, 0, models.EOS])
  np.testing.assert_array_equal(answers[1], [0, 0, 0, 0, 1, models.EOS])
  assert prompts.shape == (2, models.prompt_length(4))
  assert answers.shape == (2, models.answer_length(4)) == (2, 6)
  r = models.rewards(
    jnp.asarray(answers),
    jnp.asarray([[9, 9, 9, 9, 0, models.EOS], [0, 0, 0, 0, 1, 0]]),
  )
  np.testing.assert_array_equal(r, [1.0, 0.0])
  a, b = models.train_problems(np.random.default_rng(0), 20000, 2)
  assert np.all((a * 100 + b) % models.HELD_OUT_EVERY != 0)
  a, b = models.held_out_problems(64, 2)
  assert np.all((a * 100 + b) % models.HELD_OUT_EVERY == 0)


@pytest.mark.slow
def test_two_steps_and_exact_resume(tmp_path):
  argv = _TINY + [
    "--steps",
    "2",
    "--checkpoint-every",
    "1",
    "--eval-every",
    "1",
  ]
  full = str(tmp_path / "full")
  want = _run(argv + ["--workdir", full])
  with open(os.path.join(full, "metrics.json")) as f:
    written = json.load(f)
  assert written["loss_config"]["aggregation"] == "token-mean"
  assert [row[0] for row in written["eval_history"]] == [0, 1, 2]
  assert [row[0] for row in written["train_history"]] == [1, 2]
  assert len(written["warm_start_history"]) == 2
  assert 0 <= written["mean_reward"] <= 1
  assert os.path.getsize(os.path.join(full, "curves.png")) > 0
  cut = str(tmp_path / "cut")
  shutil.copytree(full, cut)
  mngr = ocp.CheckpointManager(os.path.join(cut, "checkpoints"))
  mngr.delete(2)
  mngr.close()
  got = _run(argv + ["--workdir", cut, "--resume"])
  assert got["resumed_from_step"] == 1
  for key in (
    "train_loss_history",
    "train_history",
    "eval_history",
    "mean_reward",
    "greedy_accuracy",
  ):
    assert got[key] == want[key], key
  restore = lambda d: ocp.PyTreeCheckpointer().restore(
    os.path.join(d, "checkpoints", "2", "state")
  )
  jax.tree.map(np.testing.assert_array_equal, restore(cut), restore(full))


@pytest.mark.slow
def test_refill_truncation_and_shuffled_rewards(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  summary = _run(
    _TINY
    + [
      "--dynamic-sampling",
      "refill",
      "--top-k",
      "5",
      "--shuffle-rewards",
      "--loss",
      "grpo",
      "--steps",
      "1",
    ]
  )
  assert summary["shuffle_rewards"] and summary["dynamic_sampling"] == "refill"
  assert summary["truncation"]["top_k"] == 5
  assert summary["loss_config"]["beta"] == 0.04
  assert np.isfinite(summary["train_loss"])
  assert not os.listdir(tmp_path)


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--group-size", "1"], "--group-size"),
    (["--top-p", "0"], "top_p"),
    (["--warm-start-steps", "-1"], "--warm-start-steps"),
    (["--dynamic-sampling", "maybe"], "invalid choice"),
    (["--hidden", "30", "--num-heads", "4"], "divisible"),
  ],
)
def test_bad_flags(capsys, argv, message):
  with pytest.raises(SystemExit) as exit_info:
    ar_main.parse_args(argv)
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err
