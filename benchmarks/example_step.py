"""Whole training step of the examples: grpo against Adam, in one process.

For the ResNet and BERT examples at their default sizes, builds the model and
``nnx.Optimizer`` with each optimizer exactly as the example does (its flags'
defaults, ``examples.common.optim.make_optimizer``), jits the example's own
training step (forward, backward, update; state donated), and times the
steps on the same batches, optimizers interleaved round by round so that
the machine's drift hits all alike. Reports the median step time and its
ratio to Adam's.

Run: ``python -m benchmarks.example_step [--rounds 5] [--steps 10]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import jax
from flax import nnx

import grpo_optax
from benchmarks import command as command_lib
from examples.bert_mlm import input_pipeline as bert_pipeline
from examples.bert_mlm import main as bert_main
from examples.bert_mlm import models as bert_models
from examples.bert_mlm import train as bert_train
from examples.common import data as data_lib
from examples.common import optim
from examples.resnet_cifar10 import main as resnet_main
from examples.resnet_cifar10 import models as resnet_models
from examples.resnet_cifar10 import train as resnet_train

OPTIMIZERS = {
  "adam": [],
  "grpo": [],
  "grpo_chain": ["--grpo-fused", "false"],
  # grpo(lr, **ARTICLE_DEFAULTS): the articles' settings, one-pass.
  "grpo_article": [
    item
    for key, value in grpo_optax.ARTICLE_DEFAULTS.items()
    for item in ("--grpo-" + key.replace("_", "-"), str(value).lower())
  ],
}


def _resnet(flags):
  args = resnet_main.parse_args(flags)
  dataset = resnet_train.load_dataset(args)
  init_key, step_base = data_lib.init_and_step_keys(args.seed)
  model, optimizer = optim.create_model_and_optimizer(
    lambda rngs: resnet_models.ResNet(
      args.depth, dataset.num_classes, dataset.image_shape[-1], rngs=rngs
    ),
    optim.make_optimizer(args, resnet_train.DEFAULT_LRS),
    init_key,
  )
  graphdef, state = nnx.split((model, optimizer))
  step_fn = resnet_train.make_train_step(graphdef, augment=False)
  n = len(dataset.train_labels)

  def batch(step):
    idx = data_lib.batch_indices(args.seed, step, args.batch_size, n)
    return (
      dataset.train_images[idx],
      dataset.train_labels[idx],
      data_lib.step_key(step_base, step),
    )

  def step(state, inputs):
    state, metrics = step_fn(state, *inputs)
    return state, metrics["loss"]

  return state, step, batch


def _bert(flags):
  args = bert_main.parse_args(flags)
  data = bert_pipeline.load(
    text_files=args.text_files, vocab_size=args.vocab_size, seq_len=args.seq_len
  )
  config = bert_models.BertConfig(
    vocab_size=data.vocab_size,
    max_len=args.seq_len,
    hidden=args.hidden,
    num_layers=args.num_layers,
    num_heads=args.num_heads,
    ffn=args.ffn,
    dropout=args.dropout,
  )
  init_key, step_base = data_lib.init_and_step_keys(args.seed)
  model, optimizer = optim.create_model_and_optimizer(
    lambda rngs: bert_models.BertMLM(config, rngs=rngs),
    optim.make_optimizer(args, bert_train.DEFAULT_LRS),
    init_key,
  )
  graphdef, state = nnx.split((model, optimizer))
  step_fn = bert_train.make_train_step(
    graphdef,
    num_predictions=bert_pipeline.num_predictions(args.seq_len, args.mask_rate),
    vocab_size=data.vocab_size,
    pass_head_entropy=bert_train.uses_head_entropy(args),
  )
  n = len(data.train)

  def batch(step):
    idx = data_lib.batch_indices(args.seed, step, args.batch_size, n)
    return data.train[idx], data_lib.step_key(step_base, step)

  def step(state, inputs):
    state, metrics = step_fn(state, *inputs)
    return state, metrics["loss"]

  return state, step, batch


EXAMPLES = {"resnet": _resnet, "bert": _bert}


def bench(example: str, rounds: int, steps: int) -> list[dict]:
  runs = {}
  for name, extra in OPTIMIZERS.items():
    flags = [
      "--optimizer",
      "grpo" if name.startswith("grpo") else name,
      "--quiet",
    ] + extra
    state, step, batch = EXAMPLES[example](flags)
    t0 = time.perf_counter()
    state, loss = step(state, batch(0))
    jax.block_until_ready(loss)
    runs[name] = dict(
      state=state,
      step=step,
      batch=batch,
      times=[],
      first_s=time.perf_counter() - t0,
    )
  for r in range(rounds):
    for run in runs.values():
      for i in range(steps):
        inputs = run["batch"](1 + r * steps + i)
        t0 = time.perf_counter()
        run["state"], loss = run["step"](run["state"], inputs)
        jax.block_until_ready(loss)
        run["times"].append(time.perf_counter() - t0)
  adam = statistics.median(runs["adam"]["times"])
  adam_first = runs["adam"]["first_s"]
  rows = []
  for name, run in runs.items():
    ms = statistics.median(run["times"])
    rows.append(
      dict(
        example=example,
        optimizer=name,
        median_ms=round(ms * 1e3, 2),
        ratio_to_adam=round(ms / adam, 3),
        first_step_s=round(run["first_s"], 2),
        first_step_ratio=round(run["first_s"] / adam_first, 3),
        samples=len(run["times"]),
      )
    )
    print(
      f"{example:>7s} {name:>11s} {ms * 1e3:8.2f} ms  x{ms / adam:.3f} "
      f"Adam  (first step incl. compile {run['first_s']:.1f} s, "
      f"x{run['first_s'] / adam_first:.2f} Adam's)",
      flush=True,
    )
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument(
    "--steps", type=int, default=10, help="steps per optimizer per round"
  )
  parser.add_argument("--examples", default="resnet,bert")
  parser.add_argument("--out", default="benchmarks/results")
  args = parser.parse_args(argv)
  rows = []
  for example in args.examples.split(","):
    rows.extend(bench(example, args.rounds, args.steps))
  meta = dict(
    device=f"{jax.devices()[0].device_kind} ({platform.machine()},"
    f" {os.cpu_count()} cpus)",
    jax=jax.__version__,
    date=time.strftime("%Y-%m-%d"),
    command=command_lib.command("benchmarks.example_step", argv),
  )
  os.makedirs(args.out, exist_ok=True)
  stem = os.path.join(args.out, "example_step")
  with open(stem + ".json", "w") as f:
    json.dump({"meta": meta, "rows": rows}, f, indent=1)
  lines = [
    f"# Examples' training step ({meta['device']}, {meta['date']})",
    "",
    f"Command: `{meta['command']}`",
    "",
    "| example | optimizer | median ms | x Adam | first step (s) |"
    " first step x Adam |",
    "|---|---|---|---|---|---|",
  ]
  lines += [
    f"| {r['example']} | {r['optimizer']} | {r['median_ms']:.2f} | "
    f"{r['ratio_to_adam']:.3f} | {r['first_step_s']:.1f} |"
    f" {r['first_step_ratio']:.2f} |"
    for r in rows
  ]
  with open(stem + ".md", "w") as f:
    f.write("\n".join(lines) + "\n")
  print(f"wrote {stem}.json, {stem}.md")
  return rows


if __name__ == "__main__":
  import sys  # pylint: disable=g-import-not-at-top

  main(sys.argv[1:])
