"""Starts one command as N cooperating JAX processes on this machine.

    python -m examples.launch_multiprocess --num-processes 2 \\
        --devices-per-process 4 -- \\
        python -m examples.resnet_cifar10 --data-parallel --exchange all_gather

Each process runs the command with ``--coordinator-address 127.0.0.1:PORT
--num-processes N --process-id I`` appended (the examples pass these to
``jax.distributed.initialize``, with gloo collectives on CPU), and with
``XLA_FLAGS=--xla_force_host_platform_device_count=D`` when
``--devices-per-process D`` is given, so the processes form one mesh of
``N * D`` CPU devices. Output lines are prefixed with ``[I]``. If a process
fails or the time limit passes, the others are stopped.

``--max-restarts R``: when a process dies (a non-zero exit, a signal), the
others are stopped and all ``N`` are started again, up to ``R`` times, on a
fresh coordinator port. A command that checkpoints to a ``--workdir`` and is
given ``--resume`` (which starts from step 0 when there is no checkpoint yet)
then continues from its last checkpoint, and ends as an uninterrupted run
would:

    python -m examples.launch_multiprocess --num-processes 2 \\
        --devices-per-process 4 --max-restarts 3 -- \\
        python -m examples.bert_mlm --data-parallel --local-steps 50 \\
        --workdir /tmp/bert --checkpoint-every 100 --resume

This is the one-machine tool (and the tests' stand-in for a cluster
scheduler). On a cluster the scheduler starts and restarts the processes
(SLURM ``srun`` with ``--requeue``, a Kubernetes indexed Job's
``backoffLimit``), the examples join with ``--distributed auto``
(``jax.distributed.initialize()`` without arguments) and resume from a shared
``--workdir``: see ``docs/multiprocess.md``.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
  """A TCP port that was free a moment ago on localhost."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _pump(stream, prefix: str, out) -> None:
  for line in iter(stream.readline, ""):
    out.write(prefix + line)
    out.flush()
  stream.close()


def _run_once(
  command: list[str],
  num_processes: int,
  env: dict,
  *,
  deadline: float | None,
  port: int | None,
  out,
) -> int:
  """One start of all the processes; the worst exit code (124: timed out)."""
  address = f"127.0.0.1:{port or free_port()}"
  procs, pumps = [], []
  for i in range(num_processes):
    argv = command + [
      "--coordinator-address",
      address,
      "--num-processes",
      str(num_processes),
      "--process-id",
      str(i),
    ]
    p = subprocess.Popen(
      argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    out.write(f"[launcher] process {i}: pid {p.pid}\n")
    out.flush()
    t = threading.Thread(
      target=_pump, args=(p.stdout, f"[{i}] ", out), daemon=True
    )
    t.start()
    procs.append(p)
    pumps.append(t)
  codes: dict[int, int] = {}
  first_failure = None  # the exit code of the process that died first
  killed = False
  while len(codes) < num_processes:
    for i, p in enumerate(procs):
      if i not in codes and p.poll() is not None:
        codes[i] = p.returncode
        if p.returncode != 0 and first_failure is None:
          first_failure = p.returncode
    timed_out = deadline is not None and time.monotonic() > deadline
    if first_failure is not None or timed_out:
      # The others are killed: their -9 is our doing, not the cause.
      for i, p in enumerate(procs):
        if i not in codes:
          p.kill()
          p.wait()
          codes[i] = p.returncode
          killed = True
      break
    time.sleep(0.05)
  for t in pumps:
    t.join(timeout=5)
  if any(c != 0 for c in codes.values()):
    out.write(f"[launcher] exit codes {dict(sorted(codes.items()))}\n")
  if first_failure is not None:
    return first_failure
  return 124 if killed else 0


def launch(
  command: list[str],
  num_processes: int,
  *,
  devices_per_process: int | None = None,
  timeout: float | None = None,
  port: int | None = None,
  out=None,
  max_restarts: int = 0,
) -> int:
  """Runs ``command`` as ``num_processes`` processes; returns the worst exit code.

  Args:
    command: the program and its arguments (the distributed flags are
      appended).
    num_processes: how many processes.
    devices_per_process: forced CPU devices per process (None: leave
      ``XLA_FLAGS`` as it is).
    timeout: seconds before all processes are killed (exit code 124), over
      all restarts.
    port: the coordinator's port of the first start (default: a free one;
      restarts always take a free one).
    out: where the prefixed output goes (default: ``sys.stdout``).
    max_restarts: how many times to restart all processes after one died.
  """
  if num_processes < 1:
    raise ValueError(f"`num_processes` must be >= 1, got {num_processes}.")
  if max_restarts < 0:
    raise ValueError(f"`max_restarts` must be >= 0, got {max_restarts}.")
  out = sys.stdout if out is None else out
  env = dict(os.environ)
  if devices_per_process is not None:
    flags = [
      f
      for f in env.get("XLA_FLAGS", "").split()
      if not f.startswith("--xla_force_host_platform_device_count")
    ]
    flags.append(
      f"--xla_force_host_platform_device_count={devices_per_process}"
    )
    env["XLA_FLAGS"] = " ".join(flags)
    env.setdefault("JAX_PLATFORMS", "cpu")
  deadline = None if timeout is None else time.monotonic() + timeout
  for attempt in range(max_restarts + 1):
    code = _run_once(
      command,
      num_processes,
      env,
      deadline=deadline,
      port=port if attempt == 0 else None,
      out=out,
    )
    if code in (0, 124):
      return code
    if attempt < max_restarts:
      out.write(
        f"[launcher] a process died (exit {code}): restart "
        f"{attempt + 1} of {max_restarts}, all {num_processes} "
        "processes\n"
      )
      out.flush()
  return code


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m examples.launch_multiprocess",
    description="Run a command as N JAX processes on this machine "
    "(jax.distributed over localhost).",
  )
  parser.add_argument("--num-processes", type=int, default=2)
  parser.add_argument(
    "--devices-per-process",
    type=int,
    default=None,
    help="Forced CPU devices per process.",
  )
  parser.add_argument(
    "--timeout",
    type=float,
    default=None,
    help="Seconds before every process is killed.",
  )
  parser.add_argument(
    "--max-restarts",
    type=int,
    default=0,
    help="Restart all processes up to N times when one "
    "dies (give the command --workdir and --resume to "
    "continue from its last checkpoint).",
  )
  parser.add_argument(
    "command", nargs=argparse.REMAINDER, help="The command, after '--'."
  )
  args = parser.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not command:
    parser.error("give the command to run after '--'")
  if args.num_processes < 1:
    parser.error(f"--num-processes must be >= 1, got {args.num_processes}")
  if args.devices_per_process is not None and args.devices_per_process < 1:
    parser.error("--devices-per-process must be >= 1")
  if args.max_restarts < 0:
    parser.error(f"--max-restarts must be >= 0, got {args.max_restarts}")
  return launch(
    command,
    args.num_processes,
    devices_per_process=args.devices_per_process,
    timeout=args.timeout,
    max_restarts=args.max_restarts,
  )


if __name__ == "__main__":
  sys.exit(main())
