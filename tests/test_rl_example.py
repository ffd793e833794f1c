"""examples/rl_sum_to_target: the task, a few steps, flags, exact resume."""

import contextlib
import io
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from examples.rl_sum_to_target import main as rl_main
from examples.rl_sum_to_target import models
from examples.rl_sum_to_target import train as rl_train

pytestmark = pytest.mark.filterwarnings(
  "ignore:Sharding info not provided:UserWarning"
)

_TINY = [
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
  "--eval-samples",
  "2",
  "--quiet",
  "--fast-compile",
]


def _run(argv):
  return rl_train.train_and_evaluate(rl_main.parse_args(argv))


def _final_state(workdir, step):
  return ocp.PyTreeCheckpointer().restore(
    os.path.join(workdir, "checkpoints", str(step), "state")
  )


def test_task_rewards_and_chance():
  digits = np.stack(
    np.meshgrid(*[np.arange(10)] * 3, indexing="ij"), -1
  ).reshape(-1, 3)
  counts = [int(np.sum(digits.sum(1) == s)) for s in range(28)]
  assert counts[0] == counts[27] == 1 and max(counts) == 75
  assert models.chance_reward() == pytest.approx(np.mean(counts) / 1000)
  assert models.chance_reward() == pytest.approx(1 / 28)
  r = models.rewards(
    jnp.array([5, 5, 27]), jnp.array([[1, 2, 2], [1, 2, 3], [9, 9, 9]])
  )
  np.testing.assert_array_equal(r, [1.0, 0.0, 1.0])
  np.testing.assert_array_equal(
    models.prompt_tokens(jnp.array([0, 27])), [[10], [37]]
  )


@pytest.mark.slow
def test_two_steps_and_exact_resume(tmp_path):
  """The defaults (grpo loss preset: a frozen reference, beta > 0; Adam):
  cut back to step 1 and resumed, the run equals the uninterrupted one bit
  for bit (samples, rewards, curves, parameters, optimizer state).
  """
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
  for key in (
    "mean_reward",
    "greedy_solved",
    "chance_reward",
    "train_history",
    "eval_history",
    "wall_time_s",
  ):
    assert key in written, key
  assert written["loss_config"]["beta"] == 0.04
  assert written["optimizer"] == "adam" and written["batch_size"] == 4
  assert 0 <= written["mean_reward"] <= 1
  assert 0 <= written["greedy_solved"] <= 28
  assert [row[0] for row in written["eval_history"]] == [0, 1, 2]
  assert [row[0] for row in written["train_history"]] == [1, 2]
  assert os.path.getsize(os.path.join(full, "curves.png")) > 0
  assert any(
    name.startswith("events.out.tfevents")
    for name in os.listdir(os.path.join(full, "tensorboard"))
  )

  cut = str(tmp_path / "cut")
  shutil.copytree(full, cut)
  mngr = ocp.CheckpointManager(os.path.join(cut, "checkpoints"))
  mngr.delete(2)
  mngr.close()
  err = io.StringIO()
  with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
    _run(argv + ["--workdir", cut])  # a flag error, before any work
  assert "add --resume" in err.getvalue()
  got = _run(argv + ["--workdir", cut, "--resume"])
  assert got["resumed_from_step"] == 1
  for key in (
    "train_loss_history",
    "train_history",
    "eval_history",
    "mean_reward",
    "greedy_solved",
  ):
    assert got[key] == want[key], key
  want_state, got_state = _final_state(full, 2), _final_state(cut, 2)
  assert jax.tree.structure(want_state) == jax.tree.structure(got_state)
  jax.tree.map(np.testing.assert_array_equal, got_state, want_state)


@pytest.mark.slow
def test_other_loss_optimizer_inner_steps_and_shuffled_rewards(
  tmp_path, monkeypatch
):
  """Dapo loss, SGD, two optimizer steps per batch, shuffled rewards; no
  --workdir: nothing is written.
  """
  monkeypatch.chdir(tmp_path)
  summary = _run(
    _TINY
    + [
      "--loss",
      "dapo",
      "--optimizer",
      "sgd",
      "--inner-steps",
      "2",
      "--shuffle-rewards",
      "--steps",
      "1",
    ]
  )
  assert summary["shuffle_rewards"] and summary["optimizer"] == "sgd"
  assert summary["loss_config"]["aggregation"] == "token-mean"
  assert summary["loss_config"]["beta"] == 0.0
  assert len(summary["train_history"]) == 1
  assert np.isfinite(summary["train_loss"])
  assert not os.listdir(tmp_path)


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--group-size", "1"], "--group-size"),
    (["--loss", "ppo"], "invalid choice"),
    (["--temperature", "0"], "--temperature"),
    (["--beta", "-1"], "--beta"),
    (["--hidden", "30", "--num-heads", "4"], "divisible"),
    (["--inner-steps", "0"], "--inner-steps"),
  ],
)
def test_bad_flags(capsys, argv, message):
  with pytest.raises(SystemExit) as exit_info:
    rl_main.parse_args(argv)
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err
