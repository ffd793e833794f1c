"""Training loop of the RL example (``train_and_evaluate``).

One jitted step does a whole GRPO iteration: sample ``G`` completions for each
prompt of the batch (``grpo_optax.rl.sample``), score them, turn the rewards
into group-relative advantages, re-score the completions with the policy (and
the frozen reference when ``beta > 0``) and take ``--inner-steps`` optimizer
steps on ``grpo_optax.rl.policy_loss``. Prompts and sampling keys are
functions of ``(seed, step)``, so ``--resume`` continues bit for bit.
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
from examples.common import flags
from examples.common import metrics as metrics_lib
from examples.common import optim
from examples.common import workdir as workdir_lib
from examples.rl_sum_to_target import main as main_lib
from examples.rl_sum_to_target import models
from grpo_optax import rl

# Peak learning rates per optimizer (cosine schedule with 5% warm-up).
DEFAULT_LRS = {
  "grpo": 3e-3,
  "adam": 3e-3,
  "adamw": 3e-3,
  "nadam": 3e-3,
  "sgd": 0.1,
}
# Evaluation samples use their own stream: rl.sample(seed=_EVAL_SEED,
# step=run seed), the same at every evaluation of a run.
_EVAL_SEED = 12345
# fold_in data of the reward-shuffling key (distinct from the positions
# 0..2 that rl.sample folds into the same step key).
_SHUFFLE_STREAM = 2**31 - 1


def _log_probs_and_entropy(model, tokens, completions, temperature):
  """Re-scores ``completions`` (the last 3 tokens of ``tokens``).

  The model runs on the whole ``[B, 4]`` sequence, the shape the sampler
  used, so the log-probabilities match the recorded ones (to a few ulps:
  XLA compiles the sampler's scan body and this call separately).
  """
  logits = model(tokens)[:, :-1]  # position i predicts digit i + 1
  return (
    rl.token_log_probs(logits, completions, temperature),
    rl.token_entropy(logits, temperature),
  )


def make_train_step(
  graphdef: nnx.GraphDef,
  model_graphdef: nnx.GraphDef,
  *,
  config: rl.Config,
  group_size: int,
  inner_steps: int,
  shuffle_rewards: bool,
  seed: int,
  compiler_options: dict | None = None,
):
  """A jitted ``(state, ref_params, targets, step) -> (state, metrics)``.

  ``state`` = ``nnx.state((model, optimizer))`` is donated; ``ref_params``
  (the reference policy's state, or None when ``config.beta == 0``) is not.
  """
  temperature = config.temperature

  @functools.partial(
    jax.jit, donate_argnums=0, compiler_options=compiler_options
  )
  def train_step(state, ref_params, targets, step):
    model, optimizer = nnx.merge(graphdef, state)
    targets = jnp.repeat(targets, group_size)  # prompt-major groups
    samples = rl.sample(
      model,
      models.prompt_tokens(targets),
      max_new_tokens=models.NUM_DIGITS,
      seed=seed,
      step=step,
      temperature=temperature,
    )
    rewards = models.rewards(targets, samples.completions)
    learned = rewards
    if shuffle_rewards:
      key = jax.random.fold_in(rl.sampling_key(seed, step), _SHUFFLE_STREAM)
      learned = jax.random.permutation(key, rewards)
    advantages = rl.group_advantages(
      learned.reshape(-1, group_size),
      estimator=config.advantage_estimator,
      eps=config.advantage_eps,
    ).reshape(-1)
    ref_log_probs = None
    if ref_params is not None:
      ref_model = nnx.merge(model_graphdef, ref_params)
      ref_log_probs, _ = _log_probs_and_entropy(
        ref_model, samples.tokens, samples.completions, temperature
      )

    # One step per batch is on-policy: old = stop_gradient(new), ratio
    # exactly 1. With more, the sampler's log-probs are the old policy's.
    old_log_probs = samples.log_probs if inner_steps > 1 else None

    def loss_fn(model):
      log_probs, entropy = _log_probs_and_entropy(
        model, samples.tokens, samples.completions, temperature
      )
      return rl.policy_loss(
        log_probs,
        old_log_probs,
        advantages,
        samples.mask,
        config=config,
        ref_log_probs=ref_log_probs,
        entropy=entropy,
        group_size=group_size,
      )

    for _ in range(inner_steps):  # Metrics are those of the last one.
      (_, metrics), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
      updates = optimizer.update(model, grads)
    metrics = dict(metrics)
    metrics["mean_reward"] = jnp.mean(rewards)
    metrics["grad_norm"] = optax.tree.norm(grads)
    metrics["update_norm"] = optax.tree.norm(updates)
    return nnx.state((model, optimizer)), metrics

  return train_step


def make_eval_step(
  graphdef: nnx.GraphDef,
  *,
  temperature: float,
  samples_per_target: int,
  seed: int,
  compiler_options: dict | None = None,
):
  """A jitted ``state -> (sampled mean reward, greedy rewards [28])``."""

  @functools.partial(jax.jit, compiler_options=compiler_options)
  def eval_step(state):
    model, _ = nnx.merge(graphdef, state)
    targets = jnp.arange(models.NUM_TARGETS)
    repeated = jnp.repeat(targets, samples_per_target)
    sampled = rl.sample(
      model,
      models.prompt_tokens(repeated),
      max_new_tokens=models.NUM_DIGITS,
      seed=_EVAL_SEED,
      step=seed,
      temperature=temperature,
    )
    greedy = rl.sample(
      model,
      models.prompt_tokens(targets),
      max_new_tokens=models.NUM_DIGITS,
      seed=_EVAL_SEED,
      step=seed,
      greedy=True,
    )
    return (
      jnp.mean(models.rewards(repeated, sampled.completions)),
      models.rewards(targets, greedy.completions),
    )

  return eval_step


def evaluate(eval_step, state) -> tuple[float, int, list[int]]:
  """Sampled mean reward over all targets, greedy solved count and targets."""
  mean_reward, greedy = jax.device_get(eval_step(state))
  solved = [int(t) for t in np.nonzero(greedy > 0)[0]]
  return float(mean_reward), len(solved), solved


def train_and_evaluate(args: argparse.Namespace) -> dict[str, Any]:
  """Trains the policy as the flags say; returns the dict of metrics.json."""
  start_time = time.time()
  workdir = workdir_lib.Workdir(
    args.workdir,
    resume=args.resume,
    checkpoint_every=args.checkpoint_every,
    config=vars(args),
  )
  config = main_lib.loss_config(args)
  policy_config = models.PolicyConfig(
    hidden=args.hidden,
    num_layers=args.num_layers,
    num_heads=args.num_heads,
    ffn=args.ffn,
    value_embedding=args.value_embedding,
  )
  init_key, _ = data_lib.init_and_step_keys(args.seed)
  make_model = lambda rngs: models.SumPolicy(policy_config, rngs=rngs)
  model, optimizer = optim.create_model_and_optimizer(
    make_model, optim.make_optimizer(args, DEFAULT_LRS), init_key
  )
  ref_params = None
  if config.beta > 0:  # The reference: a copy of the initial policy.
    ref_params = jax.tree.map(jnp.copy, nnx.state(model))
  start_step, history = workdir.restore(model, optimizer)
  history.setdefault("train", [])
  if start_step > args.steps:
    raise ValueError(
      f"the checkpoint in {args.workdir} is at step "
      f"{start_step}, beyond --steps {args.steps}."
    )

  graphdef, state = nnx.split((model, optimizer))
  model_graphdef = nnx.graphdef(model)
  options = flags.compiler_options(args)
  train_step = make_train_step(
    graphdef,
    model_graphdef,
    config=config,
    group_size=args.group_size,
    inner_steps=args.inner_steps,
    shuffle_rewards=args.shuffle_rewards,
    seed=args.seed,
    compiler_options=options,
  )
  eval_step = make_eval_step(
    graphdef,
    temperature=config.temperature,
    samples_per_target=args.eval_samples,
    seed=args.seed,
    compiler_options=options,
  )
  chance = models.chance_reward()

  def log_eval(done):
    mean_reward, num_solved, _ = evaluate(eval_step, state)
    history["eval"].append([done, mean_reward, num_solved])
    workdir.writer.write_scalars(
      done, {"eval/mean_reward": mean_reward, "eval/greedy_solved": num_solved}
    )
    if not args.quiet:
      bar.write(
        f"step {done}: sampled mean reward {mean_reward:.3f} "
        f"(chance {chance:.3f}), greedy solves {num_solved}/"
        f"{models.NUM_TARGETS} targets"
      )

  flags.announce_compile(args.quiet)
  bar = tqdm.tqdm(
    range(start_step, args.steps),
    initial=start_step,
    total=args.steps,
    disable=args.quiet,
    desc="train",
    dynamic_ncols=True,
  )
  if start_step == 0:
    log_eval(0)
  for step in bar:
    targets = data_lib.batch_indices(
      args.seed, step, args.batch_size, models.NUM_TARGETS
    ).astype(np.int32)
    state, metrics = train_step(state, ref_params, targets, step)
    metrics = jax.device_get(metrics)
    done = step + 1
    history["train_loss"].append([done, float(metrics["loss"])])
    history["train"].append(
      [
        done,
        float(metrics["mean_reward"]),
        float(metrics["zero_signal_fraction"]),
        float(metrics["entropy"]),
      ]
    )
    bar.set_postfix(
      reward=f"{metrics['mean_reward']:.3f}",
      entropy=f"{metrics['entropy']:.3f}",
    )
    workdir.writer.write_scalars(
      done, {f"train/{k}": v for k, v in metrics.items()}
    )
    last = done == args.steps
    evaluated = last or (args.eval_every and done % args.eval_every == 0)
    if evaluated:
      log_eval(done)
    if workdir.should_checkpoint(done, evaluated=evaluated, last=last):
      nnx.update((model, optimizer), state)
      workdir.log_optimizer(done, optimizer)
      workdir.save(done, model, optimizer, history)
  bar.close()

  nnx.update((model, optimizer), state)
  mean_reward, num_solved, solved = evaluate(eval_step, state)
  if not history["eval"] or history["eval"][-1][0] != args.steps:
    history["eval"].append([args.steps, mean_reward, num_solved])
  first = history["eval"][0]
  summary = {
    "example": "rl_sum_to_target",
    "config": dataclasses.asdict(policy_config),
    "loss_config": dataclasses.asdict(config),
    "num_params": int(
      sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    ),
    "optimizer": args.optimizer,
    "learning_rate": optim.peak_learning_rate(args, DEFAULT_LRS),
    "steps": args.steps,
    "batch_size": args.batch_size,
    "group_size": args.group_size,
    "inner_steps": args.inner_steps,
    "seed": args.seed,
    "shuffle_rewards": args.shuffle_rewards,
    "chance_reward": chance,
    "initial_mean_reward": first[1] if first[0] == 0 else None,
    "mean_reward": mean_reward,
    "greedy_solved": num_solved,
    "num_targets": models.NUM_TARGETS,
    "greedy_solved_targets": solved,
    "train_loss": history["train_loss"][-1][1]
    if history["train_loss"]
    else None,
    "wall_time_s": time.time() - start_time,
    "resumed_from_step": start_step,
    "optimizer_diagnostics": metrics_lib.scalar_optimizer_diagnostics(
      optimizer
    ),
    "train_loss_history": history["train_loss"],
    "train_history": history["train"],
    "eval_history": history["eval"],
    "args": vars(args),
  }
  panels = {
    "mean reward": [[s, r] for s, r, _, _ in history["train"]],
    "zero-signal groups": [[s, z] for s, _, z, _ in history["train"]],
    "entropy (nats)": [[s, e] for s, _, _, e in history["train"]],
  }
  workdir.finish(
    summary,
    panels=panels,
    panel_references={
      "mean reward": chance,
      "entropy (nats)": float(np.log(models.DIGIT_VOCAB)),
    },
    title=f"sum to target, {args.loss} loss, {args.optimizer}"
    + (", shuffled rewards" if args.shuffle_rewards else ""),
  )
  if not args.quiet:
    print(
      f"sampled mean reward {mean_reward:.3f} (chance {chance:.3f}); "
      f"greedy solves {num_solved}/{models.NUM_TARGETS} targets; "
      f"{args.steps} steps of {args.optimizer}, {args.loss} loss, "
      f"{summary['wall_time_s']:.1f} s"
    )
  return summary
