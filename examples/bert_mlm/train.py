"""Training loop of the BERT masked-LM example (``train_and_evaluate``)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm
from flax import nnx

import grpo_optax
from examples.bert_mlm import input_pipeline
from examples.bert_mlm import models
from examples.common import data as data_lib
from examples.common import flags
from examples.common import metrics as metrics_lib
from examples.common import optim
from examples.common import parallel
from examples.common import processes
from examples.common import workdir as workdir_lib

# Peak learning rates per optimizer (cosine schedule with 5% warm-up).
DEFAULT_LRS = {
  "grpo": 2e-3,
  "adam": 2e-3,
  "adamw": 2e-3,
  "nadam": 2e-3,
  "sgd": 0.3,
}
# Held-out masks are the same for every run (any seed, any optimizer).
_EVAL_MASK_SEED = 12345
_ATTENTION_PROJECTIONS = ("query", "key", "value", "out")


def uses_head_entropy(args: argparse.Namespace) -> bool:
  """Whether the step passes per-head entropies to the optimizer: grpo with
  importance weighting on (the only stage that reads ``head_entropy=``) and
  ``--head-entropy``.
  """
  return (
    args.optimizer == "grpo"
    and args.head_entropy
    and bool(optim.grpo_knob(args, "importance"))
  )


def head_entropy_tree(
  grads: nnx.State, entropies: Sequence[jax.Array]
) -> nnx.State:
  """The ``head_entropy`` extra argument of ``grpo_optax.grpo``.

  A tree shaped like the gradients (pure arrays, as the optimizer sees them)
  whose attention-projection leaves hold the layer's per-head entropies,
  reshaped to broadcast over the leaf's head axis, and whose other leaves are
  None. Kernels: query/key/value ``(D, H, Dh)`` -> ``(1, H, 1)``, out
  ``(H, Dh, D)`` -> ``(H, 1, 1)``; query/key/value biases ``(H, Dh)`` ->
  ``(H, 1)``; the out bias has no head axis (None).

  Args:
    grads: gradients w.r.t. ``nnx.Param`` of a ``BertMLM``.
    entropies: per layer, the ``[H]`` entropies from ``apply_with_entropy``.
  """

  def leaf(path, x):
    keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    if len(keys) < 5 or keys[-5] != "layers" or keys[-3] != "attn":
      return None
    layer, projection, kind = keys[-4], keys[-2], keys[-1]
    if projection not in _ATTENTION_PROJECTIONS or (
      projection == "out" and kind == "bias"
    ):
      return None
    # The head axis: 0 for out's kernel and for q/k/v biases, 1 for q/k/v
    # kernels (D, H, Dh).
    head_axis = 1 if projection != "out" and kind == "kernel" else 0
    return grpo_optax.per_head(entropies[int(layer)], head_axis, x.ndim)

  return jax.tree_util.tree_map_with_path(
    leaf, (getattr(nnx, "as_pure", None) or nnx.pure)(grads)
  )


def _mlm_metrics(logits, targets):
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  correct = jnp.argmax(logits, -1) == targets
  return loss, correct


def _entropy_metrics(entropies) -> dict[str, jax.Array]:
  return {
    f"head_entropy/layer{i}_head{h}": entropy[h]
    for i, entropy in enumerate(entropies)
    for h in range(entropy.shape[0])
  }


def make_forward(*, num_predictions: int, vocab_size: int):
  """The loss of one replica's share, ``forward(model, tokens, key) ->
  (loss, {"masked_accuracy", "entropies"})``, for the data-parallel runtime
  (the replica's key draws the masks and the dropout).
  """

  def forward(model, tokens, key):
    mask_key, dropout_key = jax.random.split(key)
    inputs, positions, targets = input_pipeline.mask_tokens(
      mask_key, tokens, num_predictions=num_predictions, vocab_size=vocab_size
    )
    logits, entropies = model.apply_with_entropy(
      inputs,
      deterministic=False,
      dropout_key=dropout_key,
      positions=positions,
    )
    loss, correct = _mlm_metrics(logits, targets)
    return loss.mean(), {
      "masked_accuracy": correct.mean(),
      "entropies": entropies,
    }

  return forward


def head_entropy_args(grads, aux) -> dict[str, Any]:
  """``tx.update``'s ``head_entropy`` from the replicas' mean entropies."""
  return {"head_entropy": head_entropy_tree(grads, aux["entropies"])}


def make_train_step(
  graphdef: nnx.GraphDef,
  *,
  num_predictions: int,
  vocab_size: int,
  pass_head_entropy: bool,
  compiler_options: dict | None = None,
):
  """A jitted single-device step ``(state, tokens, key) -> (state,
  metrics)``.

  ``key`` (a function of seed and step) draws the masks and the dropout;
  ``state`` = ``nnx.state((model, optimizer))`` is donated.
  (``--data-parallel`` runs :func:`make_forward` in the library's runtime.)
  """
  forward = make_forward(num_predictions=num_predictions, vocab_size=vocab_size)

  def train_step(state, tokens, key):
    model, optimizer = nnx.merge(graphdef, state)
    (loss, aux), grads = nnx.value_and_grad(
      lambda m: forward(m, tokens, key), has_aux=True
    )(model)
    extra = head_entropy_args(grads, aux) if pass_head_entropy else {}
    updates = optimizer.update(model, grads, **extra)
    metrics = {
      "loss": loss,
      "masked_accuracy": aux["masked_accuracy"],
      "grad_norm": optax.tree.norm(grads),
      "update_norm": optax.tree.norm(updates),
      "param_norm": optax.tree.norm(nnx.state(model, nnx.Param)),
      **_entropy_metrics(aux["entropies"]),
    }
    return nnx.state((model, optimizer)), metrics

  return jax.jit(
    train_step, donate_argnums=0, compiler_options=compiler_options
  )


def make_eval_step(
  graphdef: nnx.GraphDef,
  *,
  num_predictions: int,
  vocab_size: int,
  compiler_options: dict | None = None,
):
  """A jitted ``(state, tokens, mask, key) -> (loss sum, correct sum, count)``."""

  @functools.partial(jax.jit, compiler_options=compiler_options)
  def eval_step(state, tokens, mask, key):
    model, _ = nnx.merge(graphdef, state)
    inputs, positions, targets = input_pipeline.mask_tokens(
      key, tokens, num_predictions=num_predictions, vocab_size=vocab_size
    )
    logits, _ = model.apply_with_entropy(
      inputs, deterministic=True, positions=positions
    )
    loss, correct = _mlm_metrics(logits, targets)
    weight = mask[:, None].astype(jnp.float32)
    return (
      jnp.sum(loss * weight),
      jnp.sum(correct * weight),
      jnp.sum(jnp.broadcast_to(weight, loss.shape)),
    )

  return eval_step


def evaluate(
  eval_step, state, sequences: np.ndarray, batch_size: int
) -> tuple[float, float]:
  """Held-out MLM loss (nats per masked token) and masked-token accuracy."""
  base = jax.random.key(_EVAL_MASK_SEED)
  loss_sum = correct_sum = count = 0.0
  num = len(sequences)
  for i, (idx, mask) in enumerate(
    data_lib.eval_batches(num, min(batch_size, num))
  ):
    loss, correct, n = eval_step(
      state, sequences[idx], mask, jax.random.fold_in(base, i)
    )
    loss_sum += float(loss)
    correct_sum += float(correct)
    count += float(n)
  return loss_sum / count, correct_sum / count


def train_and_evaluate(args: argparse.Namespace) -> dict[str, Any]:
  """Trains BERT as the flags say; returns the dict written to metrics.json."""
  processes.initialize(args)  # Before any JAX work (multi-process runs).
  start_time = time.time()
  quiet = args.quiet or not processes.is_primary()
  workdir = workdir_lib.Workdir(
    args.workdir,
    resume=args.resume,
    checkpoint_every=args.checkpoint_every,
    config=vars(args),
  )
  data = input_pipeline.load(
    text_files=args.text_files,
    vocab_size=args.vocab_size,
    seq_len=args.seq_len,
    max_train=args.max_train_examples,
    max_eval=args.max_eval_examples,
  )
  config = models.BertConfig(
    vocab_size=data.vocab_size,
    max_len=args.seq_len,
    hidden=args.hidden,
    num_layers=args.num_layers,
    num_heads=args.num_heads,
    ffn=args.ffn,
    dropout=args.dropout,
  )
  init_key, step_base = data_lib.init_and_step_keys(args.seed)
  tx = optim.make_optimizer(args, DEFAULT_LRS)
  model, optimizer = optim.create_model_and_optimizer(
    lambda rngs: models.BertMLM(config, rngs=rngs), tx, init_key
  )
  num_predictions = input_pipeline.num_predictions(args.seq_len, args.mask_rate)
  options = flags.compiler_options(args)
  dp, start = parallel.make_runtime(
    args,
    workdir,
    model,
    make_forward(num_predictions=num_predictions, vocab_size=data.vocab_size),
    tx,
    step_base,
    extra_args=head_entropy_args if uses_head_entropy(args) else None,
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
    graphdef,
    num_predictions=num_predictions,
    vocab_size=data.vocab_size,
    pass_head_entropy=uses_head_entropy(args),
    compiler_options=options,
  )
  eval_step = make_eval_step(
    graphdef,
    num_predictions=num_predictions,
    vocab_size=data.vocab_size,
    compiler_options=options,
  )
  num_train = len(data.train)

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
    tokens, done = data.train[idx], step + 1
    if dp is None:
      key = data_lib.step_key(step_base, step)
      state, metrics = train_step(state, tokens, key)
    else:
      state, metrics = parallel.train_step(dp, state, tokens, done, args)
      metrics.update(_entropy_metrics(metrics.pop("entropies")))
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
        data.eval,
        args.eval_batch_size,
      )
      history["eval"].append([done, eval_loss, eval_acc])
      workdir.writer.write_scalars(
        done, {"eval/mlm_loss": eval_loss, "eval/masked_accuracy": eval_acc}
      )
      if not quiet:
        bar.write(
          f"step {done}: held-out MLM loss {eval_loss:.4f} "
          f"(unigram entropy {data.unigram_entropy:.4f}), masked "
          f"accuracy {eval_acc:.4f}"
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
    history["eval"].append(
      [args.steps, *evaluate(eval_step, state, data.eval, args.eval_batch_size)]
    )
  _, eval_loss, eval_acc = history["eval"][-1]
  recent = [loss for _, loss in history["train_loss"][-10:]]
  summary = {
    "example": "bert_mlm",
    "corpus": "files" if args.text_files else "pydoc_data.topics",
    "config": dataclasses.asdict(config),
    "num_params": int(
      sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    ),
    "optimizer": args.optimizer,
    "learning_rate": optim.peak_learning_rate(args, DEFAULT_LRS),
    "steps": args.steps,
    "batch_size": args.batch_size,
    "seed": args.seed,
    "data_parallel": dp and parallel.describe(args, dp),
    "num_train_sequences": num_train,
    "num_eval_sequences": len(data.eval),
    "train_loss": float(np.mean(recent)) if recent else None,
    "eval_loss": eval_loss,
    "eval_masked_accuracy": eval_acc,
    "unigram_entropy": data.unigram_entropy,
    "below_unigram_entropy": eval_loss < data.unigram_entropy,
    "wall_time_s": time.time() - start_time,
    "resumed_from_step": start_step,
    "optimizer_diagnostics": metrics_lib.scalar_optimizer_diagnostics(
      optimizer
    ),
    "train_loss_history": history["train_loss"],
    "eval_history": history["eval"],
    "args": vars(args),
  }
  if args.workdir:
    data.tokenizer.save(os.path.join(args.workdir, "tokenizer.json"))
  workdir.finish(
    summary,
    title=f"BERT MLM, {args.optimizer}",
    reference=data.unigram_entropy,
    reference_label="unigram entropy",
  )
  if not quiet:
    print(
      f"held-out MLM loss {eval_loss:.4f} nats vs unigram entropy "
      f"{data.unigram_entropy:.4f} nats; masked accuracy {eval_acc:.4f}; "
      f"{args.steps} steps of {args.optimizer}, "
      f"{summary['wall_time_s']:.1f} s"
    )
  return summary
