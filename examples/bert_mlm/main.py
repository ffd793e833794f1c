"""Flags of the BERT example; ``python -m examples.bert_mlm --help``.

With no flags: a 2-layer BERT (hidden 128, 2 heads, sequences of 64 tokens)
learns masked-language modelling on CPython's bundled documentation with
``grpo_optax.grpo`` and per-head attention entropy; prints the held-out MLM
loss next to the corpus' unigram entropy.
"""

from __future__ import annotations

import argparse
import os

from examples.common import flags
from examples.common import optim


def make_parser() -> flags.ArgumentParser:
  """The flags of the example (``--help``)."""
  parser = flags.ArgumentParser(
    prog="python -m examples.bert_mlm",
    description="Masked-LM training of a small BERT with Flax NNX and the "
    "GRPO optax chain.",
  )
  data = parser.add_argument_group("data")
  data.add_argument(
    "--text-files",
    nargs="+",
    default=None,
    metavar="FILE",
    help="Local UTF-8 text files to train on (default: "
    "CPython's pydoc_data topics, shipped with Python).",
  )
  data.add_argument(
    "--vocab-size",
    type=int,
    default=4096,
    help="Byte-level BPE vocabulary size (trained at start).",
  )
  data.add_argument(
    "--seq-len",
    type=int,
    default=64,
    help="Tokens per sequence (also the model's max_len).",
  )
  data.add_argument(
    "--mask-rate",
    type=float,
    default=0.15,
    help="Fraction of positions predicted per sequence.",
  )
  data.add_argument(
    "--max-train-examples",
    type=int,
    default=None,
    help="Use only the first N training sequences.",
  )
  data.add_argument(
    "--max-eval-examples",
    type=int,
    default=None,
    help="Evaluate on the first N held-out sequences only.",
  )
  data.add_argument(
    "--eval-batch-size",
    type=int,
    default=64,
    help="Batch size of the held-out evaluation.",
  )
  model = parser.add_argument_group("model")
  model.add_argument(
    "--hidden",
    type=int,
    default=128,
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
    default=2,
    help="Attention heads per layer (must divide --hidden).",
  )
  model.add_argument(
    "--ffn",
    type=int,
    default=512,
    help="Width of each layer's feed-forward block.",
  )
  model.add_argument(
    "--dropout",
    type=float,
    default=0.0,
    help="Dropout rate in [0, 1).",
  )
  model.add_argument(
    "--head-entropy",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="grpo with importance weighting only (e.g. "
    "--grpo-importance true): pass per-head attention "
    "entropies to the optimizer (head_entropy=...).",
  )
  flags.add_training_flags(parser, steps=600, batch_size=32, eval_every=200)
  return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  """Parses and checks the flags (``argv=None`` reads ``sys.argv``)."""
  parser = make_parser()
  args = parser.parse_args(argv)
  flags.check_common_args(parser, args)
  flags.refuse_unless(
    parser,
    "--head-entropy",
    args.optimizer == "grpo" and bool(optim.grpo_knob(args, "importance")),
    "--optimizer grpo with importance weighting (--grpo-importance true)",
  )
  for path in args.text_files or ():
    if not os.path.isfile(path):
      parser.error(f"--text-files: no such file: {path}")
  positive = (
    "vocab_size",
    "seq_len",
    "hidden",
    "num_layers",
    "num_heads",
    "ffn",
    "eval_batch_size",
  )
  for name in positive:
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be >= 1")
  if args.vocab_size < 260:
    parser.error("--vocab-size must be >= 260 (256 bytes + special tokens)")
  if args.hidden % args.num_heads:
    parser.error(
      f"--hidden ({args.hidden}) must be divisible by --num-heads "
      f"({args.num_heads})"
    )
  if not 0 < args.mask_rate <= 1:
    parser.error(f"--mask-rate must be in (0, 1], got {args.mask_rate}")
  if not 0 <= args.dropout < 1:
    parser.error(f"--dropout must be in [0, 1), got {args.dropout}")
  for name in ("max_train_examples", "max_eval_examples"):
    value = getattr(args, name)
    if value is not None and value < 1:
      parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
  return args


def main(argv: list[str] | None = None) -> dict:
  """Parses flags, trains, evaluates; returns the metrics dict."""
  from examples.bert_mlm import train  # pylint: disable=g-import-not-at-top

  args = parse_args(argv)
  summary = train.train_and_evaluate(args)
  flags.print_outputs(args)
  return summary
