"""Data-parallel flags and wiring of the examples (``--data-parallel``).

The training step is the library's runtime, :func:`grpo_optax.training.
data_parallel`: BatchNorm statistics, metrics, a PRNG key per replica, the
exchange and local steps (``--local-steps H``, DiLoCo) all live there. This
module only turns flags into it: ``--exchange`` takes the registry's names
and one ``--exchange-<option>`` flag exists per option the compressors
declare (:func:`grpo_optax.training.compressors.options`), plus the sparsity
warm-up. One replica per device of a 1-D mesh over every device of every
process; ``--num-processes N`` joins the processes first
(:func:`jax.distributed.initialize`, gloo collectives on CPU; see
``examples/launch_multiprocess.py``), ``--distributed auto`` without
arguments (SLURM, Kubernetes, Cloud TPU).
"""

from __future__ import annotations

import argparse
from typing import Any

import jax
from flax import nnx

from grpo_optax import training
from grpo_optax.training import checkpointing
from grpo_optax.training import compressors

AXIS = "data"
#: The exchange's own options given a flag, beside the compressors'.
PIPELINE_FLAGS = ("warmup_steps",)


def _flag(name: str) -> str:
  return "--exchange-" + name.replace("_", "-")


def option_specs() -> dict[str, compressors.Option]:
  """The ``--exchange-*`` options: the compressors' and :data:`PIPELINE_FLAGS`."""
  pipeline = {o.name: o for o in training.exchange.PIPELINE_OPTIONS}
  return {**compressors.options(), **{n: pipeline[n] for n in PIPELINE_FLAGS}}


def add_parallel_flags(parser: argparse.ArgumentParser) -> None:
  """``--data-parallel``, ``--exchange*``, ``--local-steps``, processes."""
  group = parser.add_argument_group(
    "data parallel",
    "Split each batch over all devices (one replica per device) and "
    "exchange gradients; e.g. XLA_FLAGS="
    "--xla_force_host_platform_device_count=8 on CPU.",
  )
  add = group.add_argument
  add("--data-parallel", action="store_true", help="Train over all devices.")
  add(
    "--exchange",
    choices=compressors.NAMES,
    default=None,
    help="Exchange between replicas (default: dense); docs/communication.md.",
  )
  for name, o in option_specs().items():
    kind = {"int": int, "float": float}.get(o.kind, str)
    choices = o.choices or None
    add(_flag(name), type=kind, choices=choices, default=None,
        help=f"{o.help} (default: {o.default}).")  # fmt: skip
  add("--local-steps", type=int, default=0, metavar="H",
      help="Local-step (DiLoCo) training: H steps per replica between outer "
      "exchanges of the parameter change (0: exchange every step).")  # fmt: skip
  add("--outer-lr", type=float, default=0.7, help="Outer Nesterov SGD lr.")
  add("--outer-momentum", type=float, default=0.9, help="Its momentum.")
  add("--outer-quantize", choices=("none", "int8"), default="none",
      help="Payload of the outer exchange: float, or int8.")  # fmt: skip
  add("--distributed", choices=("flags", "auto"), default="flags",
      help="flags: --coordinator-address/--num-processes/--process-id; "
      "auto: jax.distributed.initialize() without arguments.")  # fmt: skip
  add("--coordinator-address", default=None, help="host:port of process 0.")
  add("--num-processes", type=int, default=1)
  add("--process-id", type=int, default=0)


def _compressor(args: argparse.Namespace) -> str:
  """The compressor the exchange runs (local steps' int8 payload: int8)."""
  return "int8" if args.local_steps and args.outer_quantize == "int8" else (
    args.exchange
  )


def given_options(args: argparse.Namespace) -> dict[str, Any]:
  """The ``--exchange-*`` options given on the command line."""
  out = {n: getattr(args, "exchange_" + n) for n in option_specs()}
  return {n: v for n, v in out.items() if v is not None}


def check_parallel_args(
  parser: argparse.ArgumentParser, args: argparse.Namespace
) -> None:
  """Rejects inconsistent flags with ``parser.error``, naming the flag."""
  given = given_options(args)
  if not args.data_parallel:
    for flag in ["--exchange"] * (args.exchange is not None) + [
      _flag(n) for n in given
    ]:
      parser.error(f"{flag} needs --data-parallel")
    if args.num_processes != 1 or args.distributed != "flags":
      parser.error("--num-processes and --distributed need --data-parallel")
    if args.local_steps:
      parser.error("--local-steps needs --data-parallel")
  args.exchange = args.exchange or "dense"
  _check_local_steps(parser, args)
  name, specs = _compressor(args), option_specs()
  for opt, value in given.items():
    try:
      specs[opt].check(value)
    except ValueError:
      parser.error(f"{_flag(opt)} must be {specs[opt].allowed()}, got {value}")
    alts = compressors.takers("fraction" if opt in PIPELINE_FLAGS else opt, value)
    if name not in alts:
      via = " (the int8 outer exchange)" if name != args.exchange else ""
      parser.error(
        f"{_flag(opt)} {value} needs --exchange {' or '.join(alts)}, got "
        f"--exchange {name}{via}"
      )
  if args.num_processes < 1:
    parser.error(f"--num-processes must be >= 1, got {args.num_processes}")
  if not 0 <= args.process_id < args.num_processes:
    parser.error(
      f"--process-id must be in [0, {args.num_processes}), got "
      f"{args.process_id}"
    )
  if args.num_processes > 1 and not args.coordinator_address:
    parser.error("--num-processes > 1 needs --coordinator-address")
  try:
    exchange_of(args)
  except (TypeError, ValueError) as e:
    parser.error(f"invalid --exchange flags: {e}")


def _check_local_steps(parser, args) -> None:
  h = args.local_steps
  if h < 0:
    parser.error(f"--local-steps must be >= 0, got {h}")
  if not h:
    if args.outer_quantize != "none":
      parser.error("--outer-quantize needs --local-steps")
    return
  if not args.outer_lr > 0:
    parser.error(f"--outer-lr must be > 0, got {args.outer_lr}")
  if not 0 <= args.outer_momentum < 1:
    parser.error(f"--outer-momentum must be in [0, 1), got {args.outer_momentum}")
  if args.outer_quantize == "int8" and args.exchange not in (
    "dense",
    "shared_support",
  ):
    parser.error("--outer-quantize int8 needs --exchange dense or shared_support")
  for flag in ("eval_every", "checkpoint_every"):
    if getattr(args, flag) % h:
      parser.error(
        f"--{flag.replace('_', '-')} must be a multiple of --local-steps {h} "
        f"(evaluations and checkpoints fall on outer steps), got "
        f"{getattr(args, flag)}"
      )


def exchange_of(args: argparse.Namespace) -> training.Exchange:
  """The :class:`~grpo_optax.training.Exchange` the (checked) flags name."""
  options = given_options(args)
  if _compressor(args) == "int8":  # dense: every chunk; else the top ones.
    if args.exchange == "dense":
      options["fraction"] = 1.0
    return training.make_exchange("int8", **options)
  return training.make_exchange(args.exchange, **options)


def initialize(args: argparse.Namespace) -> None:
  """Joins the other processes (``jax.distributed``), before any JAX work."""
  if args.num_processes > 1 or args.distributed == "auto":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if args.distributed == "auto":
    jax.distributed.initialize()
  elif args.num_processes > 1:
    jax.distributed.initialize(
      args.coordinator_address,
      num_processes=args.num_processes,
      process_id=args.process_id,
    )


def is_primary() -> bool:
  """Whether this process prints (process 0)."""
  return jax.process_index() == 0


def make_runtime(args, model, forward, tx, *, extra_args=None, options=None):
  """``(runtime, split)`` of ``--data-parallel``, or ``(None, None)``.

  ``forward(model, batch, key) -> (loss, aux)`` is the example's loss on a
  replica's share; ``split`` is its :class:`~grpo_optax.training._nnx.
  StatefulModel` (the parameters and the BatchNorm statistics).
  """
  if not args.data_parallel:
    return None, None
  w = jax.device_count()
  if args.batch_size % w:
    raise ValueError(
      f"--batch-size {args.batch_size} must be divisible by the {w} devices "
      "of --data-parallel."
    )
  split = training.split_model_with_state(model, forward)
  outer = training.default_outer_optimizer(args.outer_lr, args.outer_momentum)
  dp = training.data_parallel(
    split.loss_fn,
    tx,
    jax.make_mesh((w,), (AXIS,)),
    exchange=exchange_of(args),
    local_steps=args.local_steps,
    outer_tx=outer if args.local_steps else None,
    extra_args=extra_args,
    norms=True,
    compiler_options=options,
  )
  return dp, split


def place(workdir, dp, split, key):
  """``(step, history, state)``: a fresh runtime state, or when resuming the
  latest checkpoint's, laid out the same on the mesh.
  """
  state = dp.init(split.params, split.model_state, key=key)
  like = {"state": checkpointing.to_savable(state)}
  step, history, items = workdir.restore_items(like)
  if step:
    state = checkpointing.from_savable(dict(items["state"]), state)
  return step, history, state


def save(workdir, step: int, history: dict, state) -> None:
  """Checkpoint ``step``: the whole runtime state (every process writes the
  shards of its devices).
  """
  workdir.save_items(step, {"state": checkpointing.to_savable(state)}, history)


def train_step(dp, state, batch, done: int, args: argparse.Namespace):
  """Step ``done`` (1-based): ``(state, metrics)``; with local steps the
  last step of a partial round also runs the outer step.
  """
  state, out = dp.step(state, batch)
  if dp.local_steps and done == args.steps and done % dp.local_steps:
    state = dp.sync(state)
  return state, {"loss": out.loss, **out.aux, **out.norms}


def single_device(dp, state, model, optimizer) -> Any:
  """``state`` itself, or (data-parallel) the runtime's trained model
  written into ``model`` and ``optimizer`` (the outer parameters with local
  steps), as ``nnx.state((model, optimizer))`` on one device.
  """
  if dp is None:
    return state
  view = dp.local_view(state)
  nnx.update(model, view.params)
  nnx.update(model, view.model_state)
  variables = jax.tree.leaves(
    optimizer.opt_state, is_leaf=lambda x: isinstance(x, nnx.Variable)
  )
  for var, value in zip(variables, jax.tree.leaves(view.opt_state), strict=True):
    var.value = value
  return nnx.state((model, optimizer))


def describe(args: argparse.Namespace, dp) -> dict[str, Any]:
  """The data-parallel configuration for ``metrics.json``."""
  config = dp.exchange.options()
  info = {
    "replicas": dp.num_replicas,
    "processes": jax.process_count(),
    "exchange": args.exchange,
    "fraction": None if args.exchange == "dense" else config.get("fraction"),
  }
  if args.local_steps:
    info.update(
      local_steps=args.local_steps,
      outer_lr=args.outer_lr,
      outer_momentum=args.outer_momentum,
      outer_quantize=None if args.outer_quantize == "none" else "int8",
      chunk_size=config.get("chunk_size", 64),
    )
  specs = option_specs()
  info.update(
    (k, v)
    for k, v in config.items()
    if k in specs and k not in ("fraction", "chunk_size")
    and v != specs[k].default
  )  # fmt: skip
  return info
