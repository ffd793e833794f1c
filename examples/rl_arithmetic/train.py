"""Training loop of the addition RL example (``train_and_evaluate``).

1. Warm start: ``--warm-start-steps`` steps of teacher-forced cross-entropy
   on the answers of ``--warm-start-problems`` fixed training problems.
2. GRPO: one jitted step samples ``G`` completions per prompt with the
   KV-cached sampler (``grpo_optax.rl.sample``), rewards exact answers, turns
   the rewards into group-relative advantages, drops (or refills) the groups
   without signal, and takes one optimizer step on
   ``grpo_optax.rl.policy_loss`` with the batch's ``LossNormalizer``.

Problems and sampling keys are functions of ``(seed, step)`` and the warm
start is deterministic, so ``--resume`` continues bit for bit.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from examples.common import decoder
from examples.common import flags
from examples.common import metrics as metrics_lib
from examples.common import optim
from examples.common import workdir as workdir_lib
from examples.rl_arithmetic import main as main_lib
from examples.rl_arithmetic import models
from grpo_optax import rl

DEFAULT_LRS = {
  "grpo": 3e-3,
  "adam": 3e-3,
  "adamw": 3e-3,
  "nadam": 3e-3,
  "sgd": 0.1,
}
_EVAL_SEED = 12345
_SHUFFLE_STREAM = 2**31 - 1
_WARM_START_STREAM = 2**31 - 2


def _score(model, tokens, completions, temperature, truncation):
  """Log-probs and entropies of ``completions`` (the last tokens of
  ``tokens``) under ``model``, with the sampler's settings.
  """
  logits = model(tokens)[:, -completions.shape[1] - 1 : -1]
  return (
    rl.token_log_probs(logits, completions, temperature, truncation=truncation),
    rl.token_entropy(logits, temperature, truncation=truncation),
  )


def warm_start(
  model: decoder.Decoder, args: argparse.Namespace
) -> list[list[float]]:
  """Supervised steps on a fixed small set of problems; returns the curve."""
  if not args.warm_start_steps:
    return []
  rng = np.random.default_rng((args.seed, _WARM_START_STREAM))
  prompts, answers = models.encode(
    *models.train_problems(rng, args.warm_start_problems, args.num_digits),
    args.num_digits,
  )
  tokens = np.concatenate([prompts, answers], axis=1)
  optimizer = nnx.Optimizer(
    model, optax.adam(args.warm_start_lr), wrt=nnx.Param
  )
  num_answer = answers.shape[1]

  @nnx.jit
  def step(model, optimizer, batch):
    def loss_fn(model):
      logits = model(batch[:, :-1])[:, -num_answer:]
      return jnp.mean(
        optax.softmax_cross_entropy_with_integer_labels(
          logits, batch[:, -num_answer:]
        )
      )

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  curve = []
  for s in range(args.warm_start_steps):
    idx = data_lib.batch_indices(args.seed, s, args.batch_size, len(tokens))
    curve.append(
      [s + 1, float(step(model, optimizer, jnp.asarray(tokens[idx])))]
    )
  return curve


def _sample_groups(model, prompts, answers, step, *, args, config, truncation):
  """Samples ``G`` completions per prompt; returns samples, true rewards and
  the rewards to learn from (shuffled for the control), all ``[B]``.
  """
  group_size = args.group_size
  samples = rl.sample(
    model,
    jnp.repeat(prompts, group_size, axis=0),
    max_new_tokens=answers.shape[1],
    seed=args.seed,
    step=step,
    temperature=config.temperature,
    eos_id=models.EOS,
    pad_id=models.EOS,
    truncation=truncation,
  )
  rewards = models.rewards(
    jnp.repeat(answers, group_size, axis=0), samples.completions
  )
  learned = rewards
  if args.shuffle_rewards:
    key = jax.random.fold_in(rl.sampling_key(args.seed, step), _SHUFFLE_STREAM)
    learned = jax.random.permutation(key, rewards)
  return samples, rewards, learned


def make_train_step(
  graphdef: nnx.GraphDef,
  model_graphdef: nnx.GraphDef,
  *,
  args: argparse.Namespace,
  config: rl.Config,
  truncation: rl.Truncation,
  compiler_options: dict | None = None,
):
  """A jitted ``(state, ref_params, prompts, answers, step) -> (state,
  metrics)``; ``prompts``/``answers`` hold the pool (``--oversample`` times
  the batch under ``--dynamic-sampling refill``).
  """
  group_size, temperature = args.group_size, config.temperature

  @functools.partial(
    jax.jit, donate_argnums=0, compiler_options=compiler_options
  )
  def train_step(state, ref_params, prompts, answers, step):
    model, optimizer = nnx.merge(graphdef, state)
    samples, rewards, learned = _sample_groups(
      model,
      prompts,
      answers,
      step,
      args=args,
      config=config,
      truncation=truncation,
    )
    groups = learned.reshape(-1, group_size)
    if args.dynamic_sampling == "refill":
      kept, _ = rl.select_groups(groups, args.batch_size)
      rows = rl.group_rows(kept, group_size)
      samples = jax.tree.map(lambda x: x[rows], samples)
      rewards, groups = rewards[rows], groups[kept]
    mask = samples.mask
    if args.dynamic_sampling != "off":
      mask = rl.drop_zero_signal(mask, groups)
    advantages = rl.group_advantages(
      groups, estimator=config.advantage_estimator, eps=config.advantage_eps
    ).reshape(-1)
    ref_model = nnx.merge(model_graphdef, ref_params)
    ref_log_probs, _ = _score(
      ref_model, samples.tokens, samples.completions, temperature, truncation
    )
    normalizer = rl.loss_normalizer(mask)

    def loss_fn(model):
      log_probs, entropy = _score(
        model, samples.tokens, samples.completions, temperature, truncation
      )
      return rl.policy_loss(
        log_probs,
        None,
        advantages,
        mask,
        config=config,
        ref_log_probs=ref_log_probs,
        entropy=entropy,
        group_size=group_size,
        normalizer=normalizer,
      )

    (_, metrics), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    updates = optimizer.update(model, grads)
    metrics = dict(metrics)
    metrics["mean_reward"] = jnp.mean(rewards)
    metrics["zero_signal_fraction"] = jnp.mean(
      rl.zero_signal_groups(groups).astype(jnp.float32)
    )
    metrics["grad_norm"] = optax.tree.norm(grads)
    metrics["update_norm"] = optax.tree.norm(updates)
    return nnx.state((model, optimizer)), metrics

  return train_step


def make_eval_step(
  model_graphdef: nnx.GraphDef,
  *,
  args: argparse.Namespace,
  config: rl.Config,
  truncation: rl.Truncation,
):
  """A jitted ``params -> (sampled mean reward, greedy accuracy)`` on the
  held-out problems.
  """
  prompts, answers = models.encode(
    *models.held_out_problems(args.eval_problems, args.num_digits),
    args.num_digits,
  )

  @jax.jit
  def eval_step(params):
    model = nnx.merge(model_graphdef, params)
    kwargs = dict(
      max_new_tokens=answers.shape[1],
      seed=_EVAL_SEED,
      step=args.seed,
      eos_id=models.EOS,
      pad_id=models.EOS,
    )
    sampled = rl.sample(
      model,
      prompts,
      temperature=config.temperature,
      truncation=truncation,
      **kwargs,
    )
    greedy = rl.sample(model, prompts, greedy=True, **kwargs)
    return (
      jnp.mean(models.rewards(answers, sampled.completions)),
      jnp.mean(models.rewards(answers, greedy.completions)),
    )

  return lambda params: tuple(
    float(x) for x in jax.device_get(eval_step(params))
  )


def _pool(args: argparse.Namespace, step: int):
  size = args.batch_size * (
    args.oversample if args.dynamic_sampling == "refill" else 1
  )
  rng = np.random.default_rng((args.seed, step))
  return models.encode(
    *models.train_problems(rng, size, args.num_digits), args.num_digits
  )


def train_and_evaluate(args: argparse.Namespace) -> dict[str, Any]:
  """Warm start, then GRPO, as the flags say; returns the metrics.json dict."""
  start_time = time.time()
  workdir = workdir_lib.Workdir(
    args.workdir,
    resume=args.resume,
    checkpoint_every=args.checkpoint_every,
    config=vars(args),
  )
  config, truncation = main_lib.loss_config(args), main_lib.truncation(args)
  policy_config = models.policy_config(
    args.num_digits,
    hidden=args.hidden,
    num_layers=args.num_layers,
    num_heads=args.num_heads,
    ffn=args.ffn,
  )
  init_key, _ = data_lib.init_and_step_keys(args.seed)
  model = decoder.Decoder(policy_config, rngs=nnx.Rngs(init_key))
  if args.warm_start_steps:
    flags.announce_compile(args.quiet, "the warm start's supervised step")
  warm_curve = warm_start(model, args)  # Deterministic: rerun on resume.
  warm_time = time.time() - start_time
  ref_params = jax.tree.map(jnp.copy, nnx.state(model))
  optimizer = nnx.Optimizer(
    model, optim.make_optimizer(args, DEFAULT_LRS), wrt=nnx.Param
  )
  start_step, history = workdir.restore(model, optimizer)
  history.setdefault("train", [])
  if start_step > args.steps:
    raise ValueError(
      f"the checkpoint in {args.workdir} is at step "
      f"{start_step}, beyond --steps {args.steps}."
    )
  graphdef, state = nnx.split((model, optimizer))
  model_graphdef = nnx.graphdef(model)
  train_step = make_train_step(
    graphdef,
    model_graphdef,
    args=args,
    config=config,
    truncation=truncation,
    compiler_options=flags.compiler_options(args),
  )
  evaluate = make_eval_step(
    model_graphdef, args=args, config=config, truncation=truncation
  )
  flags.announce_compile(args.quiet)
  bar = tqdm.tqdm(
    range(start_step, args.steps),
    initial=start_step,
    total=args.steps,
    disable=args.quiet,
    desc="grpo",
    dynamic_ncols=True,
  )

  def log_eval(done, params):
    sampled, greedy = evaluate(params)
    history["eval"].append([done, sampled, greedy, time.time() - start_time])
    workdir.writer.write_scalars(
      done, {"eval/mean_reward": sampled, "eval/greedy_accuracy": greedy}
    )
    if not args.quiet:
      bar.write(
        f"step {done}: held-out mean reward {sampled:.3f}, greedy "
        f"accuracy {greedy:.3f} ({time.time() - start_time:.0f} s)"
      )

  if start_step == 0:
    log_eval(0, ref_params)
  for step in bar:
    prompts, answers = _pool(args, step)
    state, metrics = train_step(state, ref_params, prompts, answers, step)
    metrics = jax.device_get(metrics)
    done = step + 1
    history["train_loss"].append([done, float(metrics["loss"])])
    history["train"].append(
      [done]
      + [
        float(metrics[k])
        for k in ("mean_reward", "zero_signal_fraction", "entropy", "kl")
      ]
    )
    bar.set_postfix(
      reward=f"{metrics['mean_reward']:.3f}",
      zero=f"{metrics['zero_signal_fraction']:.2f}",
    )
    workdir.writer.write_scalars(
      done, {f"train/{k}": v for k, v in metrics.items()}
    )
    last = done == args.steps
    evaluated = last or bool(args.eval_every and done % args.eval_every == 0)
    if evaluated:
      log_eval(done, state[0])
    if workdir.should_checkpoint(done, evaluated=evaluated, last=last):
      nnx.update((model, optimizer), state)
      workdir.save(done, model, optimizer, history)
  bar.close()
  nnx.update((model, optimizer), state)
  if not history["eval"] or history["eval"][-1][0] != args.steps:
    log_eval(args.steps, nnx.state(model))
  summary = _summary(
    args,
    config,
    policy_config,
    model,
    optimizer,
    history,
    warm_curve=warm_curve,
    warm_time=warm_time,
    start_step=start_step,
    wall_time=time.time() - start_time,
  )
  _finish(workdir, args, summary, history)
  return summary


def _summary(
  args,
  config,
  policy_config,
  model,
  optimizer,
  history,
  *,
  warm_curve,
  warm_time,
  start_step,
  wall_time,
) -> dict[str, Any]:
  first, final = history["eval"][0], history["eval"][-1]
  return {
    "example": "rl_arithmetic",
    "config": dataclasses.asdict(policy_config),
    "loss_config": dataclasses.asdict(config),
    "truncation": dataclasses.asdict(main_lib.truncation(args)),
    "num_params": int(
      sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    ),
    "optimizer": args.optimizer,
    "learning_rate": optim.peak_learning_rate(args, DEFAULT_LRS),
    "steps": args.steps,
    "seed": args.seed,
    "shuffle_rewards": args.shuffle_rewards,
    "dynamic_sampling": args.dynamic_sampling,
    "warm_start_mean_reward": first[1] if first[0] == 0 else None,
    "warm_start_greedy_accuracy": first[2] if first[0] == 0 else None,
    "mean_reward": final[1],
    "greedy_accuracy": final[2],
    "train_loss": history["train_loss"][-1][1]
    if history["train_loss"]
    else None,
    "warm_start_time_s": warm_time,
    "wall_time_s": wall_time,
    "resumed_from_step": start_step,
    "optimizer_diagnostics": metrics_lib.scalar_optimizer_diagnostics(
      optimizer
    ),
    "warm_start_history": warm_curve,
    "train_loss_history": history["train_loss"],
    "train_history": history["train"],
    "eval_history": [row[:3] for row in history["eval"]],
    "eval_times_s": [[row[0], row[3]] for row in history["eval"]],
    "args": vars(args),
  }


def _finish(workdir, args, summary, history) -> None:
  train = history["train"]
  panels = {
    "sampled reward (train)": [[r[0], r[1]] for r in train],
    "held-out reward": [[r[0], r[1]] for r in history["eval"]],
    "zero-signal groups": [[r[0], r[2]] for r in train],
    "entropy (nats)": [[r[0], r[3]] for r in train],
    "KL to warm start": [[r[0], r[4]] for r in train],
  }
  warm = summary["warm_start_mean_reward"]
  workdir.finish(
    summary,
    panels=panels,
    panel_references=None if warm is None else {"held-out reward": warm},
    title=f"{args.num_digits}-digit addition, {args.loss} loss"
    + (", shuffled rewards" if args.shuffle_rewards else ""),
  )
  if not args.quiet:
    print(
      f"held-out mean reward {summary['mean_reward']:.3f} (warm start "
      f"{warm}), greedy accuracy {summary['greedy_accuracy']:.3f}; "
      f"{args.steps} GRPO steps, {summary['wall_time_s']:.1f} s"
    )
