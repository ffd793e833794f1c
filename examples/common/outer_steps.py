"""Local steps' (DiLoCo) flags of the examples: their checks and the
replicas that report at each outer step (``--outer-absent``).
"""

from __future__ import annotations

import argparse

import numpy as np

from grpo_optax import training


def errors(args: argparse.Namespace) -> list[str]:
  """The errors of the local-step flags (``--local-steps`` and
  ``--outer-*``), one line each.
  """
  h = args.local_steps
  if h < 0:
    return [f"--local-steps must be >= 0, got {h}"]
  if not h:
    return []
  errors = []
  if not args.outer_lr > 0:
    errors.append(f"--outer-lr must be > 0, got {args.outer_lr}")
  if not 0 <= args.outer_momentum < 1:
    errors.append(
      f"--outer-momentum must be in [0, 1), got {args.outer_momentum}"
    )
  if not 0 <= args.outer_absent < 1:
    errors.append(f"--outer-absent must be in [0, 1), got {args.outer_absent}")
  int8 = args.outer_quantize == "int8"
  if int8 and args.exchange not in training.INT8_OUTER:
    errors.append(
      "--outer-quantize int8 needs --exchange dense or shared_support"
    )
  for name in ("eval_every", "checkpoint_every"):
    if getattr(args, name) % h:
      errors.append(
        f"--{name.replace('_', '-')} must be a multiple of --local-steps {h} "
        f"(evaluations and checkpoints fall on outer steps), got "
        f"{getattr(args, name)}"
      )
  return errors


def participation(args: argparse.Namespace, done: int, replicas: int):
  """The 0/1 mask of the replicas that report at the outer step of the
  round holding step ``done`` (1-based), or None (all report): each misses
  it with probability ``--outer-absent``, from a generator seeded by
  ``--seed`` and the round, so every process (and a resumed run) draws the
  same mask.
  """
  if not args.local_steps or not args.outer_absent:
    return None
  rnd = (done - 1) // args.local_steps
  rng = np.random.default_rng([args.seed, rnd])
  return (rng.random(replicas) >= args.outer_absent).astype(np.float32)
