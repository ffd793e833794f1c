"""Training loop of the ResNet example (``train_and_evaluate``)."""

from __future__ import annotations

import argparse
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm
from flax import nnx

from examples.common import data as data_lib
from examples.common import flags
from examples.common import metrics as metrics_lib
from examples.common import optim
from examples.common import parallel
from examples.common import processes
from examples.common import workdir as workdir_lib
from examples.resnet_cifar10 import input_pipeline
from examples.resnet_cifar10 import models

# Peak learning rates per optimizer (cosine schedule with 5% warm-up).
DEFAULT_LRS = {
  "grpo": 3e-3,
  "adam": 3e-3,
  "adamw": 3e-3,
  "nadam": 3e-3,
  "sgd": 0.1,
}


def load_dataset(args: argparse.Namespace) -> input_pipeline.Dataset:
  if args.dataset == "digits":
    return input_pipeline.load_digits(
      image_size=args.image_size,
      max_train=args.max_train_examples,
      max_test=args.max_eval_examples,
    )
  return input_pipeline.load_cifar10(
    args.data_dir,
    download=args.download,
    max_train=args.max_train_examples,
    max_test=args.max_eval_examples,
  )


def _loss_and_logits(model, images, labels):
  logits = model(images, train=True)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  return loss.mean(), logits


def make_forward(augment: bool):
  """The loss of one replica's share, ``forward(model, (images, labels),
  key) -> (loss, {"accuracy"})``, for the data-parallel runtime (the key is
  the replica's: random crops and flips).
  """

  def forward(model, batch, key):
    images, labels = batch
    if augment:
      images = input_pipeline.random_crop_flip(key, images)
    loss, logits = _loss_and_logits(model, images, labels)
    return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == labels)}

  return forward


def make_train_step(
  graphdef: nnx.GraphDef,
  *,
  augment: bool,
  compiler_options: dict | None = None,
):
  """A jitted single-device step ``(state, images, labels, key) -> (state,
  metrics)``.

  ``state`` is ``nnx.state((model, optimizer))``; it is donated, so XLA
  updates parameters, BatchNorm statistics and optimizer state in place.
  (``--data-parallel`` runs :func:`make_forward` in the library's runtime.)
  """

  def train_step(state, images, labels, key):
    model, optimizer = nnx.merge(graphdef, state)
    if augment:
      images = input_pipeline.random_crop_flip(key, images)
    (loss, logits), grads = nnx.value_and_grad(
      lambda m: _loss_and_logits(m, images, labels), has_aux=True
    )(model)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
    updates = optimizer.update(model, grads)
    metrics = {
      "loss": loss,
      "accuracy": accuracy,
      "grad_norm": optax.tree.norm(grads),
      "update_norm": optax.tree.norm(updates),
      "param_norm": optax.tree.norm(nnx.state(model, nnx.Param)),
    }
    return nnx.state((model, optimizer)), metrics

  return jax.jit(
    train_step, donate_argnums=0, compiler_options=compiler_options
  )


def make_eval_step(
  graphdef: nnx.GraphDef, compiler_options: dict | None = None
):
  """A jitted ``(state, images, labels, mask) -> (loss sum, correct sum)``."""

  @functools.partial(jax.jit, compiler_options=compiler_options)
  def eval_step(state, images, labels, mask):
    model, _ = nnx.merge(graphdef, state)
    logits = model(images, train=False)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    correct = jnp.argmax(logits, -1) == labels
    return jnp.sum(loss * mask), jnp.sum(correct * mask)

  return eval_step


def evaluate(
  eval_step, state, dataset: input_pipeline.Dataset, batch_size: int
) -> tuple[float, float]:
  """Held-out mean loss and accuracy over the whole test split."""
  num = len(dataset.test_labels)
  loss_sum, correct_sum = 0.0, 0.0
  for idx, mask in data_lib.eval_batches(num, min(batch_size, num)):
    loss, correct = eval_step(
      state, dataset.test_images[idx], dataset.test_labels[idx], mask
    )
    loss_sum += float(loss)
    correct_sum += float(correct)
  return loss_sum / num, correct_sum / num


def train_and_evaluate(args: argparse.Namespace) -> dict[str, Any]:
  """Trains a ResNet as the flags say; returns the dict written to metrics.json."""
  processes.initialize(args)  # Before any JAX work (multi-process runs).
  start_time = time.time()
  quiet = args.quiet or not processes.is_primary()
  workdir = workdir_lib.Workdir(
    args.workdir,
    resume=args.resume,
    checkpoint_every=args.checkpoint_every,
    config=vars(args),
  )
  dataset = load_dataset(args)
  augment = (
    (args.dataset == "cifar10") if args.augment is None else args.augment
  )
  init_key, step_base = data_lib.init_and_step_keys(args.seed)
  tx = optim.make_optimizer(args, DEFAULT_LRS)
  model, optimizer = optim.create_model_and_optimizer(
    lambda rngs: models.ResNet(
      args.depth, dataset.num_classes, dataset.image_shape[-1], rngs=rngs
    ),
    tx,
    init_key,
  )
  options = flags.compiler_options(args)
  dp, start = parallel.make_runtime(
    args,
    workdir,
    model,
    make_forward(augment),
    tx,
    step_base,
    compiler_options=options,
  )
  graphdef, state = nnx.split((model, optimizer))
  if dp is None:
    start_step, history = workdir.restore(model, optimizer)
    state = nnx.state((model, optimizer))
  else:
    start_step, history, state = start
  if start_step > args.steps:
    raise ValueError(
      f"the checkpoint in {args.workdir} is at step "
      f"{start_step}, beyond --steps {args.steps}."
    )
  train_step = make_train_step(
    graphdef, augment=augment, compiler_options=options
  )
  eval_step = make_eval_step(graphdef, compiler_options=options)
  num_train = len(dataset.train_labels)

  flags.announce_compile(quiet)
  bar = tqdm.tqdm(
    range(start_step, args.steps),
    initial=start_step,
    total=args.steps,
    disable=quiet,
    desc="train",
    dynamic_ncols=True,
  )
  tick = time.time()
  for step in bar:
    idx = data_lib.batch_indices(args.seed, step, args.batch_size, num_train)
    images, labels = dataset.train_images[idx], dataset.train_labels[idx]
    done = step + 1
    if dp is None:
      key = data_lib.step_key(step_base, step)
      state, metrics = train_step(state, images, labels, key)
    else:
      state, metrics = parallel.train_step(
        dp, state, (images, labels), done, args
      )
    metrics = jax.device_get(metrics)
    history["train_loss"].append([done, float(metrics["loss"])])
    now = time.time()
    bar.set_postfix(
      loss=f"{metrics['loss']:.4f}",
      ex_per_s=f"{args.batch_size / (now - tick):.0f}",
    )
    tick = now
    workdir.writer.write_scalars(
      done, {f"train/{k}": v for k, v in metrics.items()}
    )

    last = done == args.steps
    evaluated = last or (args.eval_every and done % args.eval_every == 0)
    if evaluated:
      eval_loss, eval_acc = evaluate(
        eval_step,
        parallel.single_device(dp, state, model, optimizer),
        dataset,
        args.eval_batch_size,
      )
      history["eval"].append([done, eval_loss, eval_acc])
      workdir.writer.write_scalars(
        done, {"eval/loss": eval_loss, "eval/accuracy": eval_acc}
      )
      if not quiet:
        bar.write(
          f"step {done}: held-out loss {eval_loss:.4f}, accuracy {eval_acc:.4f}"
        )
    if workdir.should_checkpoint(done, evaluated=evaluated, last=last):
      nnx.update(
        (model, optimizer), parallel.single_device(dp, state, model, optimizer)
      )
      workdir.log_optimizer(done, optimizer)
      if dp is None:
        workdir.save(done, model, optimizer, history)
      else:
        workdir.save_state(done, state, history)
  bar.close()

  state = parallel.single_device(dp, state, model, optimizer)
  nnx.update((model, optimizer), state)
  if not history["eval"] or history["eval"][-1][0] != args.steps:
    # Resumed from a finished run: evaluate the restored model once.
    eval_loss, eval_acc = evaluate(
      eval_step, state, dataset, args.eval_batch_size
    )
    history["eval"].append([args.steps, eval_loss, eval_acc])
  _, eval_loss, eval_acc = history["eval"][-1]
  recent = [loss for _, loss in history["train_loss"][-10:]]
  summary = {
    "example": "resnet_cifar10",
    "dataset": dataset.name,
    "model": f"resnet{args.depth}",
    "num_params": int(
      sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    ),
    "optimizer": args.optimizer,
    "learning_rate": optim.peak_learning_rate(args, DEFAULT_LRS),
    "steps": args.steps,
    "batch_size": args.batch_size,
    "seed": args.seed,
    "data_parallel": dp and parallel.describe(args, dp),
    "num_train_examples": num_train,
    "num_eval_examples": len(dataset.test_labels),
    "train_loss": float(np.mean(recent)) if recent else None,
    "eval_loss": eval_loss,
    "eval_accuracy": eval_acc,
    "wall_time_s": time.time() - start_time,
    "resumed_from_step": start_step,
    "optimizer_diagnostics": metrics_lib.scalar_optimizer_diagnostics(
      optimizer
    ),
    "train_loss_history": history["train_loss"],
    "eval_history": history["eval"],
    "args": vars(args),
  }
  workdir.finish(
    summary,
    title=f"ResNet-{args.depth} on {dataset.name}, {args.optimizer}",
    log_y=True,
  )
  if not quiet:
    print(
      f"{dataset.name}: held-out accuracy {eval_acc:.4f} "
      f"(loss {eval_loss:.4f}) after {args.steps} steps of "
      f"{args.optimizer}, {summary['wall_time_s']:.1f} s"
    )
  return summary
