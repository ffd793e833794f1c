"""Optimizer flags shared by the examples.

``add_optimizer_flags`` adds ``--optimizer``, ``--lr`` and schedule flags, and
one ``--grpo-<knob>`` flag per keyword of ``grpo_optax.grpo``, generated from
the library's wiring table (``grpo_optax.WIRING``) so that the flags never
drift from the library.
``make_optimizer`` turns the parsed namespace into an optax transformation.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx

import grpo_optax

OPTIMIZERS = ("grpo", "adam", "adamw", "nadam", "sgd")
SCHEDULES = ("constant", "cosine")
_GRPO_PREFIX = "grpo_"
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def _parse_bool(text: str) -> bool:
  if text.lower() in _TRUE:
    return True
  if text.lower() in _FALSE:
    return False
  raise argparse.ArgumentTypeError(
    f"expected a boolean ({'/'.join(_TRUE)} or {'/'.join(_FALSE)}), "
    f"got {text!r}"
  )


def _parse_any(text: str) -> Any:
  """Parses 'none', a boolean, an int, a float, or else keeps the string."""
  if text.lower() == "none":
    return None
  if text.lower() in ("true", "false"):
    return text.lower() == "true"
  for cast in (int, float):
    try:
      return cast(text)
    except ValueError:
      pass
  return text


def _with_none(parse: Callable[[str], Any]) -> Callable[[str], Any]:
  def parse_or_none(text: str) -> Any:
    return None if text.lower() == "none" else parse(text)

  parse_or_none.__name__ = parse.__name__  # argparse uses it in messages.
  return parse_or_none


def _flag_type(default: Any) -> Callable[[str], Any]:
  """The parser of a GRPO knob flag, chosen from the knob's default.

  Booleans accept true/false, numbers are parsed as their default's type,
  strings keep their value and also accept 'none' (e.g. ``sparsify``), and
  knobs whose default is None accept 'none', a number or a string.
  """
  if default is None:
    return _parse_any
  if isinstance(default, bool):
    return _parse_bool
  if isinstance(default, int):
    return _with_none(int)
  if isinstance(default, float):
    return _with_none(float)
  return _with_none(str)


def grpo_knobs() -> dict[str, Any]:
  """The keywords of ``grpo_optax.grpo`` (``grpo_optax.WIRING``) and their
  defaults.
  """
  # A tree-valued keyword has no command-line form.
  return {
    k.keyword: k.default
    for k in grpo_optax.WIRING
    if k.keyword != "weight_decay_mask"
  }


_HELP = {k.keyword: k.help for k in grpo_optax.WIRING}


def add_optimizer_flags(
  parser: argparse.ArgumentParser, default_optimizer: str = "grpo"
) -> None:
  """Adds the optimizer, learning-rate and GRPO knob flags to ``parser``."""
  group = parser.add_argument_group("optimizer")
  group.add_argument(
    "--optimizer",
    choices=OPTIMIZERS,
    default=default_optimizer,
    help="grpo (grpo_optax.grpo), adam, adamw, nadam, or sgd (momentum 0.9).",
  )
  group.add_argument(
    "--lr",
    type=float,
    default=None,
    help="Peak learning rate (default: the example's per-optimizer default).",
  )
  group.add_argument(
    "--schedule",
    choices=SCHEDULES,
    default="cosine",
    help="Learning-rate schedule after warm-up.",
  )
  group.add_argument(
    "--warmup-steps",
    type=int,
    default=None,
    help="Linear warm-up steps (default: 5%% of --steps).",
  )
  group.add_argument(
    "--weight-decay",
    type=float,
    default=1e-4,
    help="Decoupled weight decay of adamw.",
  )
  knobs = parser.add_argument_group(
    "GRPO knobs",
    "Overrides of grpo_optax.grpo's keyword arguments "
    "(default: the library's default; 'none' passes None).",
  )
  for name, default in grpo_knobs().items():
    help_text = f"{_HELP[name]} (grpo's {name}=; default {default!r})."
    if name == "seed":
      help_text += " Unset: follows --seed."
    knobs.add_argument(
      f"--grpo-{name.replace('_', '-')}",
      dest=_GRPO_PREFIX + name,
      type=_flag_type(default),
      default=argparse.SUPPRESS,
      metavar=type(default).__name__ if default is not None else "VALUE",
      help=help_text,
    )


def grpo_overrides(args: argparse.Namespace) -> dict[str, Any]:
  """The GRPO knobs given on the command line, as keyword arguments."""
  return {
    name: getattr(args, _GRPO_PREFIX + name)
    for name in grpo_knobs()
    if hasattr(args, _GRPO_PREFIX + name)
  }


def grpo_knob(args: argparse.Namespace, name: str) -> Any:
  """A GRPO knob's value for this run: the flag if given, else the library's
  default.
  """
  return grpo_overrides(args).get(name, grpo_knobs()[name])


def peak_learning_rate(
  args: argparse.Namespace, default_lrs: dict[str, float]
) -> float:
  """``--lr``, or the example's default for ``--optimizer``."""
  return args.lr if args.lr is not None else default_lrs[args.optimizer]


def learning_rate_schedule(
  args: argparse.Namespace, default_lrs: dict[str, float]
) -> optax.Schedule:
  """Linear warm-up to the peak lr, then constant or cosine decay to zero."""
  peak = peak_learning_rate(args, default_lrs)
  warmup = (
    args.warmup_steps
    if args.warmup_steps is not None
    else max(1, args.steps // 20)
  )
  warmup = min(warmup, args.steps - 1)
  if args.schedule == "constant":
    after = optax.constant_schedule(peak)
  else:
    after = optax.cosine_decay_schedule(peak, args.steps - warmup)
  if not warmup:
    return after
  return optax.join_schedules(
    [optax.linear_schedule(0.0, peak, warmup), after], [warmup]
  )


def make_optimizer(
  args: argparse.Namespace, default_lrs: dict[str, float]
) -> optax.GradientTransformation:
  """Builds the optax transformation selected by ``args.optimizer``."""
  lr = learning_rate_schedule(args, default_lrs)
  if args.optimizer == "grpo":
    kwargs = {"seed": args.seed, **grpo_overrides(args)}
    return grpo_optax.grpo(lr, **kwargs)
  if args.optimizer == "adam":
    return optax.adam(lr)
  if args.optimizer == "adamw":
    return optax.adamw(lr, weight_decay=args.weight_decay)
  if args.optimizer == "nadam":
    return optax.nadam(lr)
  if args.optimizer == "sgd":
    return optax.sgd(lr, momentum=0.9)
  raise ValueError(
    f"unknown optimizer {args.optimizer!r}; expected one of {OPTIMIZERS}."
  )


def create_model_and_optimizer(
  make_model: Callable[[nnx.Rngs], nnx.Module],
  tx: optax.GradientTransformation,
  key: jax.Array,
) -> tuple[nnx.Module, nnx.Optimizer]:
  """Builds the model and ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` in one
  jitted call (one compilation instead of one per initializer), so BatchNorm
  statistics and other non-``Param`` state stay out of the optimizer.
  """

  @nnx.jit
  def create(key):
    model = make_model(nnx.Rngs(key))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

  return create(key)
