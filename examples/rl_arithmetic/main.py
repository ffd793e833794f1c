"""Flags of the addition RL example; ``python -m examples.rl_arithmetic --help``.

With no flags: a small causal transformer (2 layers, hidden 64, KV-cached
sampling) is warm-started by ``--warm-start-steps`` supervised steps on
``--warm-start-problems`` fixed problems (a tiny fraction of the 10^8
4-digit additions), then trained by group relative policy optimisation
(``grpo_optax.rl``, the ``"dapo"`` preset: clip 0.2 / 0.28, token-mean, no KL
term, zero-signal groups dropped from the denominators) from the exact-answer
reward only. Evaluated on held-out problems (never drawn in training):
the sampled mean reward at the training temperature and the greedy
accuracy. ``--shuffle-rewards`` is the control: rewards permuted across the
batch carry no information.
"""

from __future__ import annotations

import argparse

from examples.common import flags
from grpo_optax import rl

DYNAMIC_SAMPLING = ("off", "drop", "refill")


def make_parser() -> flags.ArgumentParser:
  """The flags of the example (``--help``)."""
  parser = flags.ArgumentParser(
    prog="python -m examples.rl_arithmetic",
    description="RL fine-tuning with grpo_optax.rl (group relative policy "
    "optimisation): multi-digit addition, exact-answer reward.",
  )
  task = parser.add_argument_group("task and RL")
  task.add_argument(
    "--num-digits",
    type=int,
    default=4,
    help="Digits per operand D; the policy writes D + 2 "
    "tokens (D + 1 sum digits and EOS).",
  )
  task.add_argument(
    "--group-size",
    type=int,
    default=8,
    help="Completions sampled per prompt (G).",
  )
  task.add_argument(
    "--loss",
    choices=rl.PRESETS,
    default="dapo",
    help="grpo_optax.rl.Config preset.",
  )
  task.add_argument(
    "--beta",
    type=float,
    default=None,
    help="KL coefficient to the warm-started policy (default: "
    "the preset's). The KL is reported either way.",
  )
  task.add_argument(
    "--temperature",
    type=float,
    default=1.0,
    help="Sampling temperature (the loss uses the same).",
  )
  task.add_argument(
    "--top-k",
    type=int,
    default=None,
    help="Sample from the k most likely tokens (the loss "
    "scores with the same truncation).",
  )
  task.add_argument(
    "--top-p", type=float, default=None, help="Nucleus sampling mass in (0, 1]."
  )
  task.add_argument(
    "--min-p",
    type=float,
    default=None,
    help="Min-p sampling threshold in [0, 1].",
  )
  task.add_argument(
    "--dynamic-sampling",
    choices=DYNAMIC_SAMPLING,
    default="drop",
    help="Zero-signal groups: off (kept in the denominators), "
    "drop (masked out), refill (sample --oversample times "
    "more prompts, keep groups with signal first).",
  )
  task.add_argument(
    "--oversample",
    type=int,
    default=2,
    help="Pool size factor of --dynamic-sampling refill.",
  )
  task.add_argument(
    "--shuffle-rewards",
    action="store_true",
    help="Control: permute the rewards across the batch "
    "before the advantages, so they carry no information.",
  )
  task.add_argument(
    "--warm-start-steps",
    type=int,
    default=120,
    help="Supervised steps before RL (0: none).",
  )
  task.add_argument(
    "--warm-start-problems",
    type=int,
    default=2000,
    help="Fixed training problems the warm start sees.",
  )
  task.add_argument(
    "--warm-start-lr",
    type=float,
    default=3e-3,
    help="Learning rate of the supervised warm start (Adam).",
  )
  task.add_argument(
    "--eval-problems",
    type=int,
    default=512,
    help="Held-out problems per evaluation.",
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
    default=256,
    help="Width of each layer's feed-forward block.",
  )
  flags.add_training_flags(
    parser,
    steps=300,
    batch_size=32,
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
  for name in (
    "num_digits",
    "group_size",
    "oversample",
    "eval_problems",
    "warm_start_problems",
    "hidden",
    "num_layers",
    "num_heads",
    "ffn",
  ):
    if getattr(args, name) < 1:
      parser.error(
        f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
      )
  flags.refuse_unless(
    parser,
    "--oversample",
    args.dynamic_sampling == "refill",
    "--dynamic-sampling refill",
  )
  for flag in ("--warm-start-lr", "--warm-start-problems"):
    flags.refuse_unless(
      parser, flag, args.warm_start_steps > 0, "--warm-start-steps > 0"
    )
  if args.warm_start_steps < 0:
    parser.error(
      f"--warm-start-steps must be >= 0, got {args.warm_start_steps}"
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
  try:
    truncation(args)
  except (TypeError, ValueError) as e:
    parser.error(f"invalid truncation flags: {e}")
  return args


def truncation(args: argparse.Namespace) -> rl.Truncation:
  """The sampler's (and loss's) ``grpo_optax.rl.Truncation``."""
  return rl.Truncation(top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)


def loss_config(args: argparse.Namespace) -> rl.Config:
  """The ``grpo_optax.rl.Config`` selected by the flags."""
  overrides = {"temperature": args.temperature}
  if args.beta is not None:
    overrides["beta"] = args.beta
  return rl.Config.preset(args.loss, **overrides)


def main(argv: list[str] | None = None) -> dict:
  """Parses flags, trains, evaluates; returns the metrics dict."""
  from examples.rl_arithmetic import train  # pylint: disable=g-import-not-at-top

  args = parse_args(argv)
  summary = train.train_and_evaluate(args)
  flags.print_outputs(args)
  return summary
