"""The examples' command line, as a new user meets it.

* ``--help``: every flag has a text, and its default once (no "(default:
  ...). (default: None)").
* A flag error prints one line of usage and the error (exit code 2), not the
  whole usage; so does a flag the given combination would ignore, a
  ``--resume`` whose run-defining flags differ from the run's, and a workdir
  that already holds a run without ``--resume`` (no traceback).
* A run says that the first step compiles before it, and its last line names
  the output folder and the files in it.

Parse-only tests, the logistic regression (3 steps) and a one-step ResNet run
in the slow tier.
"""

from __future__ import annotations

import argparse
import json
import os
import re

import pytest

from examples import logistic_regression
from examples.bert_mlm import main as bert_main
from examples.common import cli
from examples.common import workdir as workdir_lib
from examples.resnet_cifar10 import main as resnet_main
from examples.rl_arithmetic import main as arithmetic_main
from examples.rl_sum_to_target import main as sum_main

MAINS = {
  "resnet_cifar10": resnet_main,
  "bert_mlm": bert_main,
  "rl_arithmetic": arithmetic_main,
  "rl_sum_to_target": sum_main,
  "logistic_regression": logistic_regression,
}


def _help_lines(parser: argparse.ArgumentParser) -> dict[str, str]:
  """Each flag's help text as ``--help`` prints it (defaults filled in)."""
  formatter = parser._get_formatter()  # pylint: disable=protected-access
  out = {}
  for action in parser._actions:  # pylint: disable=protected-access
    if isinstance(action, argparse._HelpAction):  # pylint: disable=protected-access
      continue
    text = formatter._expand_help(action)  # pylint: disable=protected-access
    out[action.option_strings[0]] = " ".join(text.split())
  return out


@pytest.mark.parametrize("example", sorted(MAINS))
def test_every_flag_has_a_help_text_with_one_default(example):
  parser = MAINS[example].make_parser()
  assert isinstance(parser, cli.ArgumentParser)
  lines = _help_lines(parser)
  assert "--steps" in lines or example == "logistic_regression"
  for flag, text in lines.items():
    assert text.strip(), f"{flag} has no help text"
    assert len(re.findall(r"default:", text, re.I)) <= 1, f"{flag}: {text}"
    assert "(default: None)" not in text, f"{flag}: {text}"
  assert "(default: None)" not in parser.format_help()


def test_the_help_formatter_adds_a_default_only_where_none_is_said():
  parser = cli.ArgumentParser(prog="p")
  parser.add_argument("--a", type=int, default=3, help="A number.")
  parser.add_argument("--b", default=None, help="B (default: the best).")
  parser.add_argument("--c", type=int, default=0, help="Zero is a value.")
  parser.add_argument("--d", action="store_true", help="A switch.")
  lines = _help_lines(parser)
  assert lines["--a"] == "A number. (default: 3)"
  assert lines["--b"] == "B (default: the best)."
  assert lines["--c"] == "Zero is a value. (default: 0)"
  assert lines["--d"] == "A switch."


def _error(capsys, example, argv) -> str:
  with pytest.raises(SystemExit) as info:
    MAINS[example].parse_args(argv)
  assert info.value.code == 2
  err = capsys.readouterr().err
  lines = err.strip().splitlines()
  assert len(lines) == 2, err  # one line of usage, one of error
  assert lines[0].startswith("usage: python -m examples.") and (
    "--help lists them" in lines[0]
  ), lines[0]
  assert ": error: " in lines[1], lines[1]
  return lines[1]


BAD = [
  ("resnet_cifar10", ["--steps", "-1"], "--steps must be >= 1, got -1"),
  ("resnet_cifar10", ["--steps", "x"], "argument --steps: invalid int value"),
  ("resnet_cifar10", ["--no-such-flag"], "unrecognized arguments"),
  ("bert_mlm", ["--lr", "-1"], "--lr must be > 0"),
  ("rl_arithmetic", ["--group-size", "1"], "--group-size must be >= 2"),
  ("rl_sum_to_target", ["--temperature", "0"], "--temperature must be > 0"),
  ("logistic_regression", ["--steps", "-1"], "--steps must be >= 1, got -1"),
  ("logistic_regression", ["--steps", "0"], "--steps must be >= 1, got 0"),
  ("logistic_regression", ["--lr", "-1"], "--lr must be > 0, got -1.0"),
  ("logistic_regression", ["--seed", "-2"], "--seed must be >= 0, got -2"),
  ("logistic_regression", ["--lr", "fast"], "invalid float value: 'fast'"),
  # An option the chosen exchange does not take (dense has no chunks).
  (
    "resnet_cifar10",
    ["--data-parallel", "--exchange-chunk-size", "8"],
    "--exchange-chunk-size 8 needs --exchange shared_support or int8, got --exchange dense",
  ),
]


@pytest.mark.parametrize(
  "example, argv, message", BAD, ids=[" ".join(a) for _, a, _ in BAD]
)
def test_a_flag_error_is_one_line_of_usage_and_the_error(
  capsys, example, argv, message
):
  assert message in _error(capsys, example, argv)


# Flags the given combination would ignore (they were silently dropped).
IGNORED = [
  ("resnet_cifar10", ["--checkpoint-every", "10"], "--checkpoint-every needs --workdir"),
  ("bert_mlm", ["--checkpoint-every", "5"], "--checkpoint-every needs --workdir"),
  ("resnet_cifar10", ["--weight-decay", "0.1"], "--weight-decay needs --optimizer adamw"),
  ("resnet_cifar10", ["--data-dir", "cifar"], "--data-dir needs --dataset cifar10"),
  (
    "resnet_cifar10",
    ["--dataset", "cifar10", "--data-dir", "c", "--download", "--image-size", "16"],
    "--image-size needs --dataset digits",
  ),
  ("resnet_cifar10", ["--outer-lr", "0.5"], "--outer-lr needs --local-steps"),
  ("bert_mlm", ["--outer-momentum", "0.5"], "--outer-momentum needs --local-steps"),
  ("resnet_cifar10", ["--exchange-chunk-size", "8"], "--exchange-chunk-size needs --data-parallel"),
  ("bert_mlm", ["--head-entropy"], "--head-entropy needs --optimizer grpo with importance"),
  ("bert_mlm", ["--optimizer", "adam", "--no-head-entropy"], "--head-entropy needs"),
  ("rl_arithmetic", ["--oversample", "3"], "--oversample needs --dynamic-sampling refill"),
  ("rl_arithmetic", ["--warm-start-steps", "0", "--warm-start-lr", "0.01"], "--warm-start-lr needs --warm-start-steps > 0"),
  ("rl_sum_to_target", ["--weight-decay", "0.01"], "--weight-decay needs --optimizer adamw"),
]  # fmt: skip


@pytest.mark.parametrize(
  "example, argv, message", IGNORED, ids=[" ".join(a) for _, a, _ in IGNORED]
)
def test_a_flag_the_combination_ignores_is_refused(
  capsys, example, argv, message
):
  line = _error(capsys, example, argv)
  assert message in line and "would be ignored" in line, line


@pytest.mark.parametrize(
  "example, argv",
  [
    ("resnet_cifar10", ["--workdir", "{tmp}", "--checkpoint-every", "10"]),
    ("resnet_cifar10", ["--optimizer", "adamw", "--weight-decay", "0.1"]),
    (
      "resnet_cifar10",
      [
        "--data-parallel",
        "--exchange",
        "shared_support",
        "--exchange-chunk-size",
        "8",
      ],
    ),
    ("resnet_cifar10", ["--image-size", "16"]),
    ("bert_mlm", ["--grpo-importance", "true", "--no-head-entropy"]),
    ("rl_arithmetic", ["--dynamic-sampling", "refill", "--oversample", "3"]),
    # A flag given at its default value is still a flag given; unused, it
    # is refused (above), used, it parses.
    ("rl_arithmetic", ["--warm-start-lr", "0.003"]),
  ],
)
def test_the_combinations_that_use_the_flag_parse(tmp_path, example, argv):
  argv = [a.replace("{tmp}", str(tmp_path / "run")) for a in argv]
  args = MAINS[example].parse_args(argv)
  assert isinstance(args, argparse.Namespace)


def _started_run(tmp_path, example, argv, step=4):
  """A workdir as a run leaves it: config.json and a checkpoint folder."""
  path = tmp_path / "run"
  args = MAINS[example].parse_args(["--workdir", str(path), *argv])
  os.makedirs(path / workdir_lib.CHECKPOINTS / str(step))
  with open(path / workdir_lib.CONFIG_FILE, "w") as f:
    json.dump(vars(args), f)
  return str(path)


def test_resume_with_other_run_defining_flags_is_a_flag_error(tmp_path, capsys):
  path = _started_run(tmp_path, "resnet_cifar10", ["--steps", "10"])
  line = _error(
    capsys, "resnet_cifar10", ["--workdir", path, "--resume", "--steps", "20"]
  )
  assert "--steps 10 -> 20" in line
  assert "start a new --workdir with the larger --steps" in line
  # The flags that may change on a resume do not count.
  args = resnet_main.parse_args(
    ["--workdir", path, "--resume", "--steps", "10", "--eval-every", "5"]
  )
  assert args.resume and args.eval_every == 5


def test_a_workdir_holding_a_run_needs_resume(tmp_path, capsys):
  path = _started_run(tmp_path, "rl_sum_to_target", [], step=7)
  line = _error(capsys, "rl_sum_to_target", ["--workdir", path])
  assert "already holds checkpoints (up to step 7)" in line
  assert "add --resume" in line


def test_a_resume_mismatch_found_at_run_time_reads_the_same(tmp_path):
  # Workdir (what train_and_evaluate builds) checks the same, for a caller
  # that skips parse_args.
  path = _started_run(tmp_path, "resnet_cifar10", ["--steps", "10"])
  with open(os.path.join(path, workdir_lib.CONFIG_FILE)) as f:
    saved = json.load(f)
  with pytest.raises(ValueError, match=r"--steps 10 -> 20"):
    workdir_lib.check_resume_config(saved, {**saved, "steps": 20}, path)


def test_the_outputs_line_names_the_folder_and_its_files(tmp_path):
  assert workdir_lib.describe_outputs(None).startswith("no files written")
  run = tmp_path / "run"
  (run / "checkpoints" / "2").mkdir(parents=True)
  (run / "checkpoints" / "4").mkdir()
  (run / "checkpoints" / "tmp.orbax-checkpoint-tmp").mkdir()
  (run / "tensorboard").mkdir()
  for name in ("metrics.json", "config.json", "loss_curves.png", "notes.txt"):
    (run / name).write_text("x")
  assert workdir_lib.describe_outputs(str(run)) == (
    f"outputs in {run}: metrics.json, config.json, loss_curves.png, "
    "tensorboard/ (TensorBoard events), checkpoints/ (steps 2, 4), notes.txt"
  )
  assert workdir_lib.saved_steps(str(run)) == [2, 4]


def test_logistic_regression_says_it_compiles_before_its_first_step(capsys):
  accuracy = logistic_regression.main(["--steps", "3"])
  out = capsys.readouterr().out.splitlines()
  assert out[0].startswith("compiling the training step"), out
  assert out[1].startswith("step    0"), out
  assert out[-1] == f"held-out accuracy {accuracy:.4f}"
  assert 0.5 < accuracy <= 1.0


_TINY_RESNET = [
  "--depth",
  "8",
  "--batch-size",
  "8",
  "--max-train-examples",
  "64",
  "--max-eval-examples",
  "16",
  "--eval-batch-size",
  "16",
  "--fast-compile",
  "--steps",
  "1",
  "--eval-every",
  "0",
]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Sharding info not provided:UserWarning")
def test_a_run_announces_compiling_and_ends_naming_its_outputs(
  tmp_path, capsys
):
  run = tmp_path / "run"
  resnet_main.main([*_TINY_RESNET, "--workdir", str(run)])
  captured = capsys.readouterr()
  out = captured.out.splitlines()
  first = next(i for i, s in enumerate(out) if s.startswith("compiling"))
  step = next(i for i, s in enumerate(out) if s.startswith("step 1:"))
  assert first < step
  assert "the training step" in out[first]
  assert out[-1].startswith(f"outputs in {run}: metrics.json, config.json")
  assert re.search(r"checkpoints/ \(step 1\)$", out[-1]), out[-1]
  assert "tensorboard/ (TensorBoard events)" in out[-1]
  # Without --workdir the last line says nothing was written.
  resnet_main.main(_TINY_RESNET)
  assert (
    capsys.readouterr()
    .out.splitlines()[-1]
    .startswith("no files written (add --workdir DIR")
  )
