"""Data-parallel flags and wiring of the examples (``--data-parallel``).

The training step is the library's runtime,
:func:`grpo_optax.training.data_parallel`: BatchNorm statistics, metrics, a
PRNG key per replica, the exchange and local steps (``--local-steps H``,
DiLoCo) live there. This module turns flags into it: ``--exchange`` takes the
registry's names, and one ``--exchange-<option>`` flag exists per option the
compressors declare (:func:`grpo_optax.training.compressors.options`), plus
the sparsity warm-up. One replica per device of a 1-D mesh over every device
of every process (:mod:`examples.common.processes` joins them first).
Checkpoints hold the runtime's whole state (``Workdir.save_state``). A flag
the configuration would ignore is a one-line flag error (``cli``).
"""

from __future__ import annotations

import argparse
from typing import Any

import jax
from flax import nnx

from examples.common import cli
from examples.common import outer_steps
from examples.common import processes
from grpo_optax import training
from grpo_optax.training import compressors

AXIS = "data"
#: The exchange's own options given a flag, beside the compressors'.
PIPELINE_FLAGS = ("warmup_steps",)
#: The other flags: name -> argparse keywords.
_FLAGS = {
  "--data-parallel": dict(action="store_true", help="Train over all devices."),
  "--local-steps": dict(
    type=int,
    default=0,
    help="DiLoCo: H steps per replica between outer exchanges (0: none).",
  ),
  "--outer-lr": dict(type=float, default=0.7, help="Outer Nesterov SGD lr."),
  "--outer-momentum": dict(type=float, default=0.9, help="Its momentum."),
  "--outer-quantize": dict(
    choices=("none", "int8"),
    default="none",
    help="Payload of the outer exchange (--local-steps): float or int8.",
  ),
  "--outer-absent": dict(
    type=float,
    default=0.0,
    help="Local steps: probability that a replica misses an outer step "
    "(its round's work is dropped; it rejoins from the new outer "
    "parameters), drawn per replica and round from --seed.",
  ),
}


def _flag(name: str) -> str:
  return "--exchange-" + name.replace("_", "-")


def option_specs() -> dict[str, compressors.Option]:
  """The ``--exchange-*`` options: the compressors' and the warm-up."""
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
  group.add_argument(
    "--exchange",
    choices=compressors.NAMES,
    default=None,
    help="Exchange between the replicas (default: dense); see "
    "docs/communication.md.",
  )
  for name, o in option_specs().items():
    group.add_argument(
      _flag(name),
      type={"int": int, "float": float}.get(o.kind, str),
      choices=o.choices or None,
      default=None,
      help=f"{o.help} (default: {o.default}).",
    )
  for flag, kwargs in _FLAGS.items():
    group.add_argument(flag, **kwargs)
  processes.add_flags(group)


def _compressor(args: argparse.Namespace) -> str:
  """The compressor the exchange runs (local steps' int8 payload: int8)."""
  if args.local_steps and args.outer_quantize == "int8":
    return "int8"
  return args.exchange


def given_options(args: argparse.Namespace) -> dict[str, Any]:
  """The ``--exchange-*`` options given on the command line."""
  out = {n: getattr(args, "exchange_" + n) for n in option_specs()}
  return {n: v for n, v in out.items() if v is not None}


def check_parallel_args(
  parser: argparse.ArgumentParser, args: argparse.Namespace
) -> None:
  """Rejects inconsistent flags with ``parser.error``, naming the flag."""
  given = given_options(args)
  for flag in ["--exchange", "--local-steps", *(_flag(n) for n in given)]:
    cli.refuse_unless(parser, flag, args.data_parallel, "--data-parallel")
  for flag in (
    "--outer-lr",
    "--outer-momentum",
    "--outer-quantize",
    "--outer-absent",
  ):
    cli.refuse_unless(parser, flag, args.local_steps > 0, "--local-steps")
  args.exchange = args.exchange or "dense"
  for error in processes.errors(args) + outer_steps.errors(args):
    parser.error(error)
  name, specs = _compressor(args), option_specs()
  for opt, value in given.items():
    try:
      specs[opt].check(value)
    except ValueError:
      parser.error(f"{_flag(opt)} must be {specs[opt].allowed()}, got {value}")
    alts = compressors.takers(
      "fraction" if opt in PIPELINE_FLAGS else opt, value
    )
    if name not in alts:
      via = " (the int8 outer exchange)" if name != args.exchange else ""
      parser.error(
        f"{_flag(opt)} {value} needs --exchange {' or '.join(alts)}, got "
        f"--exchange {name}{via}"
      )
  try:
    exchange_of(args)
  except (TypeError, ValueError) as e:
    parser.error(f"invalid --exchange flags: {e}")


def exchange_of(args: argparse.Namespace) -> training.Exchange:
  """The :class:`~grpo_optax.training.Exchange` the (checked) flags name."""
  options = given_options(args)
  if _compressor(args) == "int8" and args.exchange == "dense":
    options["fraction"] = 1.0  # Every chunk (else the top ones of a leaf).
  return training.make_exchange(_compressor(args), **options)


def make_runtime(args, workdir, model, forward, tx, key, **kwargs):
  """``(runtime, (step, history, state))`` of ``--data-parallel`` (else
  ``(None, None)``): ``forward(model, batch, key) -> (loss, aux)`` on a
  replica's share runs in the runtime (``kwargs``: its ``extra_args`` and
  ``compiler_options``); the state is fresh, or when resuming the latest
  checkpoint's, laid out the same on the mesh.
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
    norms=True,
    **kwargs,
  )
  state = dp.init(split.params, split.model_state, key=key)
  return dp, workdir.restore_state(state)


def train_step(dp, state, batch, done: int, args: argparse.Namespace):
  """Step ``done`` (1-based): ``(state, metrics)``; with local steps the
  last step of a partial round also runs the outer step.
  """
  state, out = dp.step(
    state, batch, outer_steps.participation(args, done, dp.num_replicas)
  )
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
  for var, value in zip(variables, jax.tree.leaves(view.opt_state)):
    var.set_value(value)
  return nnx.state((model, optimizer))


def describe(args: argparse.Namespace, dp) -> dict[str, Any]:
  """The data-parallel configuration for ``metrics.json``."""
  config, specs = dp.exchange.options(), option_specs()
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
      outer_absent=args.outer_absent,
      chunk_size=config.get("chunk_size", specs["chunk_size"].default),
    )
  skip = ("fraction", "chunk_size")
  for k, v in config.items():
    if k in specs and k not in skip and v != specs[k].default:
      info[k] = v
  return info
