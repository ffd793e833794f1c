"""Flags of the RL example; ``python -m examples.rl_sum_to_target --help``.

With no flags: a tiny causal transformer (2 layers, hidden 64) learns, by
group relative policy optimisation (``grpo_optax.rl``, DeepSeek's RL loss,
the ``"grpo"`` preset: group-normalised advantages, clip 0.2, k3 KL to the
initial policy with beta 0.04) from a binary reward only, to write 3 digits
that sum to a target 0..27 given as the prompt. Each step takes
``--batch-size`` 56 prompts (every target twice) and samples ``--group-size``
16 completions for each; 200 steps of Adam (lr 3e-3, cosine). Prints the
sampled mean reward (chance: 1/28) and how many of the 28 targets greedy
decoding solves.

Adam is the default optimizer: any of ``--optimizer grpo|adam|...`` works
(``grpo`` is this package's unrelated optimizer preset).
"""

from __future__ import annotations

import argparse

from examples.common import flags
from grpo_optax import rl


def make_parser() -> flags.ArgumentParser:
  """The flags of the example (``--help``)."""
  parser = flags.ArgumentParser(
    prog="python -m examples.rl_sum_to_target",
    description="RL fine-tuning with grpo_optax.rl (group relative policy "
    "optimisation): 3 digits that sum to a target.",
  )
  task = parser.add_argument_group("RL")
  task.add_argument(
    "--group-size",
    type=int,
    default=16,
    help="Completions sampled per prompt (G).",
  )
  task.add_argument(
    "--loss",
    choices=rl.PRESETS,
    default="grpo",
    help="grpo_optax.rl.Config preset.",
  )
  task.add_argument(
    "--beta",
    type=float,
    default=None,
    help="KL coefficient (default: the preset's; > 0 builds a "
    "frozen reference policy, the initial one).",
  )
  task.add_argument(
    "--kl-estimator",
    choices=rl.KL_ESTIMATORS,
    default=None,
    help="Default: the preset's (k3).",
  )
  task.add_argument(
    "--temperature",
    type=float,
    default=1.0,
    help="Sampling temperature (the loss uses the same).",
  )
  task.add_argument(
    "--inner-steps",
    type=int,
    default=1,
    help="Optimizer steps per sampled batch (mu); > 1 makes "
    "the ratio and its clipping matter.",
  )
  task.add_argument(
    "--shuffle-rewards",
    action="store_true",
    help="Control: permute the rewards across the batch "
    "before the advantages, so they carry no information.",
  )
  task.add_argument(
    "--eval-samples",
    type=int,
    default=16,
    help="Sampled completions per target at evaluation.",
  )
  model = parser.add_argument_group("model")
  model.add_argument(
    "--hidden",
    type=int,
    default=64,
    help="Width of the model (embedding and attention).",
  )
  model.add_argument(
    "--num-layers",
    type=int,
    default=2,
    help="Transformer layers.",
  )
  model.add_argument(
    "--num-heads",
    type=int,
    default=4,
    help="Attention heads per layer (must divide --hidden).",
  )
  model.add_argument(
    "--ffn",
    type=int,
    default=128,
    help="Width of each layer's feed-forward block.",
  )
  model.add_argument(
    "--value-embedding",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="Add to each token's embedding a learned vector "
    "times the number it stands for.",
  )
  flags.add_training_flags(
    parser,
    steps=200,
    batch_size=56,
    eval_every=50,
    data_parallel=False,
    default_optimizer="adam",
  )
  return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  """Parses and checks the flags (``argv=None`` reads ``sys.argv``)."""
  parser = make_parser()
  args = parser.parse_args(argv)
  flags.check_common_args(parser, args)
  positive = (
    "group_size",
    "inner_steps",
    "eval_samples",
    "hidden",
    "num_layers",
    "num_heads",
    "ffn",
  )
  for name in positive:
    if getattr(args, name) < 1:
      parser.error(
        f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
      )
  if args.group_size < 2:
    parser.error(
      f"--group-size must be >= 2 (advantages are relative to the "
      f"group), got {args.group_size}"
    )
  if args.hidden % args.num_heads:
    parser.error(
      f"--hidden ({args.hidden}) must be divisible by --num-heads "
      f"({args.num_heads})"
    )
  if not args.temperature > 0:
    parser.error(f"--temperature must be > 0, got {args.temperature}")
  if args.beta is not None and not args.beta >= 0:
    parser.error(f"--beta must be >= 0, got {args.beta}")
  return args


def loss_config(args: argparse.Namespace) -> rl.Config:
  """The ``grpo_optax.rl.Config`` selected by the flags."""
  overrides = {"temperature": args.temperature}
  if args.beta is not None:
    overrides["beta"] = args.beta
  if args.kl_estimator is not None:
    overrides["kl_estimator"] = args.kl_estimator
  return rl.Config.preset(args.loss, **overrides)


def main(argv: list[str] | None = None) -> dict:
  """Parses flags, trains, evaluates; returns the metrics dict."""
  from examples.rl_sum_to_target import train  # pylint: disable=g-import-not-at-top

  args = parse_args(argv)
  summary = train.train_and_evaluate(args)
  flags.print_outputs(args)
  return summary
