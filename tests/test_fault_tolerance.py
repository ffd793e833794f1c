"""A process killed mid-run: the launcher restarts all, the run resumes.

Two processes of two CPU devices each train the ResNet example with local
steps (int8 shared-support outer exchange) and checkpoint to ``--workdir``;
process 1 is killed with SIGKILL once the step-2 checkpoint exists;
``examples.launch_multiprocess --max-restarts 1`` restarts both from the last
checkpoint, and the run ends with the metrics of an uninterrupted run.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_RUN = [
  "-m",
  "examples.resnet_cifar10",
  "--data-parallel",
  "--local-steps",
  "2",
  "--exchange",
  "shared_support",
  "--exchange-fraction",
  "0.25",
  "--outer-quantize",
  "int8",
  "--depth",
  "8",
  "--steps",
  "8",
  "--batch-size",
  "16",
  "--max-train-examples",
  "128",
  "--max-eval-examples",
  "64",
  "--eval-every",
  "0",
  "--checkpoint-every",
  "2",
  "--fast-compile",
  "--resume",
  "--quiet",
]


def _launcher(workdir, max_restarts=0):
  return [
    sys.executable,
    "-m",
    "examples.launch_multiprocess",
    "--num-processes",
    "2",
    "--devices-per-process",
    "2",
    "--timeout",
    "1200",
    "--max-restarts",
    str(max_restarts),
    "--",
    sys.executable,
    *_RUN,
    "--workdir",
    str(workdir),
  ]


def _env():
  return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def _metrics(workdir):
  with open(os.path.join(workdir, "metrics.json")) as f:
    return json.load(f)


@pytest.mark.slow
def test_killed_process_is_restarted_and_ends_as_uninterrupted(tmp_path):
  ref = tmp_path / "uninterrupted"
  done = subprocess.run(
    _launcher(ref),
    cwd=_ROOT,
    env=_env(),
    capture_output=True,
    text=True,
    timeout=1300,
  )
  assert done.returncode == 0, done.stdout[-3000:]

  killed = tmp_path / "killed"
  proc = subprocess.Popen(
    _launcher(killed, max_restarts=1),
    cwd=_ROOT,
    env=_env(),
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  lines = []
  reader = threading.Thread(
    target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True
  )
  reader.start()
  victim = None
  deadline = time.monotonic() + 1200
  while proc.poll() is None and victim is None:
    assert time.monotonic() < deadline
    pids = [
      line.split()[-1]
      for line in list(lines)
      if line.startswith("[launcher] process 1: pid")
    ]
    if pids and os.path.isdir(killed / "checkpoints" / "2"):
      victim = int(pids[0])
      os.kill(victim, signal.SIGKILL)
    time.sleep(0.05)
  assert proc.wait(timeout=1300) == 0, "".join(lines)[-3000:]
  reader.join(timeout=10)
  out = "".join(lines)
  assert victim is not None, "the run ended before process 1 was killed"
  assert "[launcher] a process died (exit -9): restart 1 of 1" in out, out
  got, want = _metrics(killed), _metrics(ref)
  assert got["resumed_from_step"] in (2, 4, 6)
  assert want["resumed_from_step"] == 0
  assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-5)
  assert got["eval_accuracy"] == want["eval_accuracy"]
  assert [s for s, _ in got["train_loss_history"]] == list(range(1, 9))
  for (_, a), (_, b) in zip(
    got["train_loss_history"], want["train_loss_history"]
  ):
    assert a == pytest.approx(b, rel=1e-5)


_FLAKY = """
import os, sys, time
i = sys.argv[sys.argv.index("--process-id") + 1]
marker = os.path.join(sys.argv[1], "ran" + i)
first = not os.path.exists(marker)
open(marker, "a").write("x")
if i == "1" and first:
    # Die only once process 0 has run (under load it may start later).
    other = os.path.join(sys.argv[1], "ran0")
    deadline = time.time() + 30
    while not os.path.exists(other) and time.time() < deadline:
        time.sleep(0.05)
    os.kill(os.getpid(), 9)
print("attempt", open(marker).read().count("x"), "process", i)
"""


def test_launcher_restarts_all_processes_after_one_dies(tmp_path):
  from examples import launch_multiprocess  # pylint: disable=g-import-not-at-top

  log = tmp_path / "out.txt"
  with open(log, "w") as out:
    code = launch_multiprocess.launch(
      [sys.executable, "-c", _FLAKY, str(tmp_path)],
      2,
      timeout=60,
      out=out,
      max_restarts=2,
    )
  text = log.read_text()
  assert code == 0, text
  assert text.count("[launcher] a process died (exit -9): restart") == 1
  assert "[1] attempt 2 process 1" in text
  assert "[0] attempt 2 process 0" in text  # Process 0 ran again too.


def test_launcher_gives_up_after_max_restarts(tmp_path):
  from examples import launch_multiprocess  # pylint: disable=g-import-not-at-top

  with open(tmp_path / "out.txt", "w") as out:
    code = launch_multiprocess.launch(
      [sys.executable, "-c", "import sys; sys.exit(3)"],
      2,
      timeout=60,
      out=out,
      max_restarts=1,
    )
  assert code == 3
  assert (tmp_path / "out.txt").read_text().count("restart 1 of 1") == 1
  with pytest.raises(ValueError, match="`max_restarts` must be >= 0"):
    launch_multiprocess.launch(["true"], 1, max_restarts=-1)


def test_launcher_reports_the_first_failure_not_the_processes_it_killed(
  tmp_path,
):
  # Process 0 fails at once; process 1 would run a minute and is killed
  # (-9). The exit code is the cause's, 3.
  from examples import launch_multiprocess  # pylint: disable=g-import-not-at-top

  script = (
    "import sys, time\n"
    "pid = int(sys.argv[sys.argv.index('--process-id') + 1])\n"
    "sys.exit(3) if pid == 0 else time.sleep(60)\n"
  )
  with open(tmp_path / "out.txt", "w") as out:
    code = launch_multiprocess.launch(
      [sys.executable, "-c", script], 2, timeout=120, out=out
    )
  assert code == 3
  text = (tmp_path / "out.txt").read_text()
  assert "exit codes {0: 3, 1: -9}" in text, text
