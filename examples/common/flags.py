"""Command-line flags common to the examples (training loop and optimizer).

Every example parses with :class:`ArgumentParser`: ``--help`` shows each
flag's default once, a bad flag prints one line of usage and the error (exit
code 2), and a flag that would be ignored in the combination given is refused
the same way, as is a ``--resume`` whose flags differ from the run's.
"""

from __future__ import annotations

import argparse
import json
import os

import grpo_optax
from examples.common import cli
from examples.common import optim
from examples.common import parallel
from examples.common import processes
from examples.common import workdir as workdir_lib

# The parser, its help format and the flag checks live in the light
# examples.common.cli (argparse only), which logistic_regression uses too.
ArgumentParser = cli.ArgumentParser
HelpFormatter = cli.HelpFormatter
refuse_unless = cli.refuse_unless
announce_compile = cli.announce_compile


def add_training_flags(
  parser: argparse.ArgumentParser,
  *,
  steps: int,
  batch_size: int,
  eval_every: int,
  default_optimizer: str = "grpo",
  data_parallel: bool = True,
) -> None:
  """Adds the loop flags (steps, batch, seed, workdir, ...) and optimizer flags.

  With ``data_parallel``, also ``--data-parallel``, ``--exchange`` and the
  multi-process flags of :mod:`examples.common.parallel`.
  """
  group = parser.add_argument_group("training loop")
  group.add_argument("--steps", type=int, default=steps, help="Training steps.")
  group.add_argument(
    "--batch-size", type=int, default=batch_size, help="Training batch size."
  )
  group.add_argument(
    "--seed",
    type=int,
    default=0,
    help="Seed of the initialisation, the data order and the "
    "per-step randomness.",
  )
  group.add_argument(
    "--workdir",
    default=None,
    help="Where metrics.json, TensorBoard events, checkpoints "
    "and the loss plot go. Default: nothing is written.",
  )
  group.add_argument(
    "--resume",
    action="store_true",
    help="Continue from the last checkpoint in --workdir; the "
    "result equals an uninterrupted run.",
  )
  group.add_argument(
    "--eval-every",
    type=int,
    default=eval_every,
    help="Evaluate every N steps (0: only at the end).",
  )
  group.add_argument(
    "--checkpoint-every",
    type=int,
    default=0,
    help="Checkpoint every N steps (0: at evaluations and at "
    "the end). Needs --workdir.",
  )
  group.add_argument(
    "--quiet",
    action="store_true",
    help="No progress bar and no printed summary.",
  )
  group.add_argument(
    "--fast-compile",
    action="store_true",
    help="Compile the steps with XLA backend optimisation "
    "level 0: about 2x faster compilation, slower steps "
    "(smoke tests).",
  )
  optim.add_optimizer_flags(parser, default_optimizer=default_optimizer)
  if data_parallel:
    parallel.add_parallel_flags(parser)


def compiler_options(args: argparse.Namespace) -> dict[str, int] | None:
  """XLA options for ``jax.jit(..., compiler_options=...)`` of the steps."""
  return {"xla_backend_optimization_level": 0} if args.fast_compile else None


def check_common_args(
  parser: argparse.ArgumentParser, args: argparse.Namespace
) -> None:
  """Rejects inconsistent common flags with ``parser.error`` (exit code 2)."""
  if args.steps < 1:
    parser.error(f"--steps must be >= 1, got {args.steps}")
  if args.batch_size < 1:
    parser.error(f"--batch-size must be >= 1, got {args.batch_size}")
  if args.eval_every < 0:
    parser.error(f"--eval-every must be >= 0, got {args.eval_every}")
  if args.lr is not None and args.lr <= 0:
    parser.error(f"--lr must be > 0, got {args.lr}")
  if args.warmup_steps is not None and args.warmup_steps < 0:
    parser.error(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
  if args.resume and not args.workdir:
    parser.error("--resume needs --workdir (the run to continue)")
  if args.checkpoint_every < 0:
    parser.error(
      f"--checkpoint-every must be >= 0, got {args.checkpoint_every}"
    )
  if args.checkpoint_every and not args.workdir:
    parser.error(
      "--checkpoint-every needs --workdir (where the checkpoints go); "
      "as given it would be ignored"
    )
  refuse_unless(
    parser, "--weight-decay", args.optimizer == "adamw", "--optimizer adamw"
  )
  if hasattr(args, "data_parallel"):
    # Refuses the data-parallel flags the configuration would ignore too.
    parallel.check_parallel_args(parser, args)
  overrides = optim.grpo_overrides(args)
  if overrides and args.optimizer != "grpo":
    parser.error(
      f"--grpo-* flags only apply to --optimizer grpo, got "
      f"--optimizer {args.optimizer} with "
      f"{', '.join('--grpo-' + k.replace('_', '-') for k in overrides)}"
    )
  if args.optimizer == "grpo":
    try:  # Surfaces grpo's own validation (fraction range, ...) as a flag error.
      grpo_optax.grpo(1e-3, **{"seed": args.seed, **overrides})
    except (TypeError, ValueError) as e:
      parser.error(f"invalid --grpo-* flags: {e}")
  check_workdir(parser, args)


def check_workdir(parser: argparse.ArgumentParser, args: argparse.Namespace):
  """The ``--workdir`` and ``--resume`` checks of the run, as flag errors.

  A workdir that holds checkpoints needs ``--resume``; resuming needs the
  flags the run was started with (``config.json``), except those of
  :data:`examples.common.workdir.RESUMABLE_FLAGS`. Checked when the flags
  are parsed, before any work (``Workdir`` checks the same again).
  """
  if not args.workdir:
    return
  steps = workdir_lib.saved_steps(args.workdir)
  if steps and not args.resume:
    parser.error(
      f"--workdir {args.workdir} already holds checkpoints (up to step "
      f"{max(steps)}): add --resume to continue that run, or choose another "
      "--workdir"
    )
  config = os.path.join(args.workdir, workdir_lib.CONFIG_FILE)
  if args.resume and steps and os.path.exists(config):
    with open(config, encoding="utf-8") as f:
      saved = json.load(f)
    try:
      workdir_lib.check_resume_config(saved, vars(args), args.workdir)
    except ValueError as e:
      parser.error(str(e))


def print_outputs(args: argparse.Namespace) -> None:
  """The last line of a run: the output folder and what it holds."""
  if args.quiet or not processes.is_primary():
    return
  print(workdir_lib.describe_outputs(args.workdir), flush=True)
