"""Flags of the ResNet example; ``python -m examples.resnet_cifar10 --help``.

With no flags: ResNet-20 on scikit-learn's 8x8 digits, trained with
``grpo_optax.grpo``; prints the held-out accuracy.
"""

from __future__ import annotations

import argparse

from examples.common import flags
from examples.resnet_cifar10 import input_pipeline
from examples.resnet_cifar10 import models


def make_parser() -> flags.ArgumentParser:
  """The flags of the example (``--help``)."""
  parser = flags.ArgumentParser(
    prog="python -m examples.resnet_cifar10",
    description="Train a ResNet with Flax NNX and the GRPO optax chain.",
  )
  data = parser.add_argument_group("data and model")
  data.add_argument(
    "--dataset",
    choices=input_pipeline.DATASETS,
    default="digits",
    help="digits: scikit-learn's bundled 8x8 digits (no "
    "download); cifar10: read from --data-dir.",
  )
  data.add_argument(
    "--data-dir",
    default=None,
    help="CIFAR-10: the cifar-10-python.tar.gz archive, the "
    "cifar-10-batches-py folder, or a folder holding either.",
  )
  data.add_argument(
    "--download",
    action="store_true",
    help="Download CIFAR-10 into --data-dir if it is missing (MD5-checked).",
  )
  data.add_argument(
    "--image-size",
    type=int,
    default=8,
    help="digits only: enlarge the 8x8 images to this size (a multiple of 8).",
  )
  data.add_argument(
    "--augment",
    action=argparse.BooleanOptionalAction,
    default=None,
    help="Random 4-pixel crops and horizontal flips "
    "(default: on for cifar10, off for digits).",
  )
  data.add_argument(
    "--max-train-examples",
    type=int,
    default=None,
    help="Use only the first N training examples.",
  )
  data.add_argument(
    "--max-eval-examples",
    type=int,
    default=None,
    help="Evaluate on the first N held-out examples only.",
  )
  data.add_argument(
    "--eval-batch-size",
    type=int,
    default=512,
    help="Batch size of the held-out evaluation.",
  )
  data.add_argument(
    "--depth",
    type=int,
    choices=models.DEPTHS,
    default=20,
    help="ResNet-8/20/32 (CIFAR, 16-64 channels) or ResNet-18.",
  )
  flags.add_training_flags(parser, steps=300, batch_size=64, eval_every=50)
  return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  """Parses and checks the flags (``argv=None`` reads ``sys.argv``)."""
  parser = make_parser()
  args = parser.parse_args(argv)
  flags.check_common_args(parser, args)
  if args.dataset == "cifar10" and not args.data_dir:
    parser.error(
      "--dataset cifar10 needs --data-dir (add --download to fetch it)"
    )
  if args.dataset == "cifar10" and not args.download:
    try:
      input_pipeline.find_cifar10(args.data_dir)
    except FileNotFoundError as e:
      parser.error(str(e))
  if args.download and args.dataset != "cifar10":
    parser.error("--download only applies to --dataset cifar10")
  flags.refuse_unless(
    parser, "--data-dir", args.dataset == "cifar10", "--dataset cifar10"
  )
  flags.refuse_unless(
    parser, "--image-size", args.dataset == "digits", "--dataset digits"
  )
  if args.image_size < 8 or args.image_size % 8:
    parser.error(f"--image-size must be a multiple of 8, got {args.image_size}")
  for name in ("max_train_examples", "max_eval_examples"):
    value = getattr(args, name)
    if value is not None and value < 1:
      parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
  if args.eval_batch_size < 1:
    parser.error("--eval-batch-size must be >= 1")
  return args


def main(argv: list[str] | None = None) -> dict:
  """Parses flags, trains, evaluates; returns the metrics dict."""
  from examples.resnet_cifar10 import train  # pylint: disable=g-import-not-at-top

  args = parse_args(argv)
  summary = train.train_and_evaluate(args)
  flags.print_outputs(args)
  return summary
