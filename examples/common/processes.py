"""Several processes (``jax.distributed``) for the examples' data parallelism.

``--num-processes N --process-id I --coordinator-address HOST:PORT`` (set by
``examples/launch_multiprocess.py``) join the processes through
:func:`jax.distributed.initialize` with gloo collectives on CPU;
``--distributed auto`` calls it without arguments (SLURM, Kubernetes, Cloud
TPU). Every process then sees every device of every process.
"""

from __future__ import annotations

import argparse
from typing import Any

import jax


def add_flags(group: Any) -> None:
  """``--distributed``, ``--coordinator-address``, ``--num-processes``,
  ``--process-id``.
  """
  group.add_argument(
    "--distributed",
    choices=("flags", "auto"),
    default="flags",
    help="flags: --coordinator-address/--num-processes/--process-id; auto: "
    "jax.distributed.initialize() without arguments.",
  )
  group.add_argument(
    "--coordinator-address", default=None, help="host:port of process 0."
  )
  group.add_argument(
    "--num-processes",
    type=int,
    default=1,
    help="Processes of a multi-process run (each runs this command).",
  )
  group.add_argument(
    "--process-id",
    type=int,
    default=0,
    help="This process's index in [0, --num-processes).",
  )


def errors(args: argparse.Namespace) -> list[str]:
  """What is wrong with the process flags (empty: nothing)."""
  n, i = args.num_processes, args.process_id
  if not args.data_parallel and (n != 1 or args.distributed != "flags"):
    return [
      "--num-processes and --distributed need --data-parallel; as given "
      "they would be ignored"
    ]
  if n < 1:
    return [f"--num-processes must be >= 1, got {n}"]
  if not 0 <= i < n:
    return [f"--process-id must be in [0, {n}), got {i}"]
  if n > 1 and not args.coordinator_address:
    return ["--num-processes > 1 needs --coordinator-address"]
  return []


def initialize(args: argparse.Namespace) -> None:
  """Joins the other processes (``jax.distributed``), before any JAX work."""
  if args.num_processes > 1 or args.distributed == "auto":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if args.distributed == "auto":
    jax.distributed.initialize()
  elif args.num_processes > 1:
    jax.distributed.initialize(
      args.coordinator_address,
      num_processes=args.num_processes,
      process_id=args.process_id,
    )


def is_primary() -> bool:
  """Whether this process prints (process 0)."""
  return jax.process_index() == 0
