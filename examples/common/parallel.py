"""Data-parallel plumbing of the examples (``--data-parallel``).

The examples keep their own Flax NNX train step (BatchNorm statistics,
metrics, ``nnx.Optimizer``) and run it per replica inside
:func:`jax.shard_map`, calling the library's exchange,
:func:`grpo_optax.training.sparse_pmean`: the "own ``shard_map`` step" path.
A pure ``loss_fn(params, batch)`` would use
:func:`grpo_optax.training.data_parallel_step` instead.

One replica per device of a 1-D mesh over every device of every process
(``jax.devices()``): with ``--num-processes N`` (see
``examples/launch_multiprocess.py``) the processes first join through
:func:`jax.distributed.initialize` (gloo collectives on CPU); with
``--distributed auto`` (a SLURM, Kubernetes or Cloud TPU job) through
``jax.distributed.initialize()`` without arguments.

``--local-steps H`` (DiLoCo): each replica keeps its own copy of the model
and optimizer state (a leading replica axis, sharded over the devices), takes
``H`` ordinary steps on its share of the batches without any exchange, and
every ``H`` steps :func:`grpo_optax.training.outer_step` averages the
replicas' parameter changes through the exchange and applies the outer
Nesterov SGD (``--outer-lr``, ``--outer-momentum``); BatchNorm statistics are
averaged at the same time.

The ``--exchange-*`` flags are the keyword arguments of
:func:`grpo_optax.training.data_parallel_step` (:func:`exchange_kwargs`):
``--exchange-values``, ``--exchange-indices``, ``--exchange-support``,
``--exchange-rank`` and ``--exchange-warmup-steps`` name ``values``,
``indices``, ``support``, ``rank`` and ``warmup_steps``, with the library's
defaults when unset. The sparsity warm-up, the replicated support and
PowerSGD keep state beyond the residuals (the step count, the support's
statistics, PowerSGD's warm-started ``Q``): the examples then carry a
:class:`~grpo_optax.training.ExchangeState` and checkpoint all of it.
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from grpo_optax import training
from grpo_optax.training import compression

AXIS = "data"

#: The ``--exchange-*`` options: ``data_parallel_step`` keyword -> (flag,
#: the exchanges it applies to).
EXCHANGE_OPTIONS = {
  "values": ("--exchange-values", ("all_gather", "shared_support", "powersgd")),
  "indices": ("--exchange-indices", ("all_gather",)),
  "support": ("--exchange-support", ("shared_support",)),
  "rank": ("--exchange-rank", ("powersgd",)),
  "warmup_steps": (
    "--exchange-warmup-steps",
    ("all_gather", "shared_support"),
  ),
}
#: The library's defaults of those options (what an unset flag means).
EXCHANGE_DEFAULTS = {
  name: inspect.signature(training.data_parallel_step).parameters[name].default
  for name in EXCHANGE_OPTIONS
}


def _attr(flag: str) -> str:
  return flag[2:].replace("-", "_")


def add_parallel_flags(parser: argparse.ArgumentParser) -> None:
  """``--data-parallel``, ``--exchange``, ``--exchange-fraction`` and the
  multi-process flags.
  """
  group = parser.add_argument_group(
    "data parallel",
    "Split each batch over all devices (one replica per "
    "device) and exchange gradients; e.g. XLA_FLAGS="
    "--xla_force_host_platform_device_count=8 on CPU.",
  )
  group.add_argument(
    "--data-parallel",
    action="store_true",
    help="Train data-parallel over all devices.",
  )
  group.add_argument(
    "--exchange",
    choices=training.EXCHANGES,
    default=None,
    help="Gradient exchange between replicas (default: "
    "dense). all_gather: each replica's top-k entries; "
    "shared_support: top chunks of the summed norms.",
  )
  group.add_argument(
    "--exchange-fraction",
    type=float,
    default=None,
    help="Kept fraction of each gradient leaf for the sparse "
    "exchanges (default: 0.3).",
  )
  group.add_argument(
    "--exchange-chunk-size",
    type=int,
    default=64,
    help="Entries per chunk of the shared_support exchange "
    "and of the int8 payload.",
  )
  add_exchange_option_flags(group)
  group.add_argument(
    "--local-steps",
    type=int,
    default=0,
    metavar="H",
    help="Local-step (DiLoCo) training: H steps per replica "
    "between outer exchanges of the parameter change (0: "
    "exchange gradients every step).",
  )
  group.add_argument(
    "--outer-lr",
    type=float,
    default=0.7,
    help="Learning rate of the outer Nesterov SGD (--local-steps).",
  )
  group.add_argument(
    "--outer-momentum",
    type=float,
    default=0.9,
    help="Momentum of the outer Nesterov SGD (--local-steps).",
  )
  group.add_argument(
    "--outer-quantize",
    choices=("none", "int8"),
    default="none",
    help="Payload of the outer exchange (--local-steps): "
    "float, or int8 with error feedback.",
  )
  group.add_argument(
    "--distributed",
    choices=("flags", "auto"),
    default="flags",
    help="flags: join the processes given by "
    "--coordinator-address/--num-processes/--process-id; "
    "auto: jax.distributed.initialize() without arguments "
    "(SLURM, Kubernetes, Cloud TPU).",
  )
  group.add_argument(
    "--coordinator-address",
    default=None,
    help="host:port of process 0 for jax.distributed "
    "(set by examples/launch_multiprocess.py).",
  )
  group.add_argument(
    "--num-processes",
    type=int,
    default=1,
    help="Processes of a multi-process run (each runs this command).",
  )
  group.add_argument(
    "--process-id",
    type=int,
    default=0,
    help="This process's index in [0, --num-processes).",
  )


def add_exchange_option_flags(group: Any) -> None:
  """The payload and compressor options of the exchange (``values``,
  ``indices``, ``support``, ``rank``, ``warmup_steps`` of
  :func:`grpo_optax.training.data_parallel_step`); each flag needs an
  ``--exchange`` it applies to.
  """
  group.add_argument(
    "--exchange-values",
    choices=compression.VALUE_FORMATS,
    default=None,
    help="Payload values of a compressed exchange: float32, bfloat16 "
    "(all_gather, shared_support, powersgd) or int8 (all_gather only; "
    "a per-leaf scale beside) (default: float32).",
  )
  group.add_argument(
    "--exchange-indices",
    choices=compression.INDEX_FORMATS,
    default=None,
    help="Indices of the all_gather payload: int32, or compact (blocks of "
    "65,536 entries, uint16 offsets or a bitmap, whichever is smaller) "
    "(default: int32).",
  )
  group.add_argument(
    "--exchange-support",
    choices=compression.SUPPORTS,
    default=None,
    help="How shared_support chooses its chunks: norms (all-reduced chunk "
    "norms) or replicated (an estimate from the past aggregated updates, "
    "no collective) (default: norms).",
  )
  group.add_argument(
    "--exchange-rank",
    type=int,
    default=None,
    metavar="R",
    help="Rank of the powersgd exchange, >= 1 (default: 1).",
  )
  group.add_argument(
    "--exchange-warmup-steps",
    type=int,
    default=None,
    metavar="N",
    help="Steps per stage of Deep Gradient Compression's sparsity warm-up "
    "(all_gather, shared_support): kept fractions 0.25, 0.0625, ... down "
    "to --exchange-fraction, N steps each (default: 0, off).",
  )


def check_parallel_args(
  parser: argparse.ArgumentParser, args: argparse.Namespace
) -> None:
  """Rejects inconsistent flags; fills in the exchange defaults."""
  if not args.data_parallel:
    names = ["exchange", "exchange_fraction"] + [
      _attr(flag) for flag, _ in EXCHANGE_OPTIONS.values()
    ]
    for flag in names:
      if getattr(args, flag) is not None:
        parser.error(f"--{flag.replace('_', '-')} needs --data-parallel")
    if args.num_processes != 1 or args.distributed != "flags":
      parser.error("--num-processes and --distributed need --data-parallel")
    if args.local_steps:
      parser.error("--local-steps needs --data-parallel")
  args.exchange = args.exchange or "dense"
  if args.exchange_fraction is None:
    args.exchange_fraction = 0.3
  if not 0 < args.exchange_fraction <= 1:
    parser.error(
      f"--exchange-fraction must be in (0, 1], got {args.exchange_fraction}"
    )
  check_exchange_option_args(parser, args)
  if args.num_processes < 1:
    parser.error(f"--num-processes must be >= 1, got {args.num_processes}")
  if not 0 <= args.process_id < args.num_processes:
    parser.error(
      f"--process-id must be in [0, {args.num_processes}), got "
      f"{args.process_id}"
    )
  if args.num_processes > 1 and not args.coordinator_address:
    parser.error("--num-processes > 1 needs --coordinator-address")
  check_local_step_args(parser, args)


def check_exchange_option_args(
  parser: argparse.ArgumentParser, args: argparse.Namespace
) -> None:
  """Each ``--exchange-*`` option given needs an ``--exchange`` it applies
  to (int8 values: all_gather) and no ``--local-steps`` (the outer exchange
  takes none of them). Unset ones stay None in ``args`` (a run started
  before these flags existed resumes with the same config);
  :func:`exchange_kwargs` reads them as the library's defaults.
  """
  for name, (flag, exchanges) in EXCHANGE_OPTIONS.items():
    value = getattr(args, _attr(flag))
    if value is None:
      continue
    if args.local_steps:
      parser.error(
        f"{flag} does not apply to --local-steps (the outer exchange "
        "takes no payload or compressor options)"
      )
    if name == "values" and value == "int8":
      exchanges = ("all_gather",)
    if args.exchange not in exchanges:
      parser.error(
        f"{flag} {value} needs --exchange {' or '.join(exchanges)}, got "
        f"--exchange {args.exchange}"
      )
  if args.exchange_rank is not None and args.exchange_rank < 1:
    parser.error(f"--exchange-rank must be >= 1, got {args.exchange_rank}")
  if args.exchange_warmup_steps is not None and args.exchange_warmup_steps < 0:
    parser.error(
      f"--exchange-warmup-steps must be >= 0, got {args.exchange_warmup_steps}"
    )


def exchange_kwargs(args: argparse.Namespace) -> dict[str, Any]:
  """The exchange the (checked) flags name, as keyword arguments of
  :func:`grpo_optax.training.data_parallel_step` (and of
  :func:`~grpo_optax.training.sparse_pmean`): ``exchange``, ``fraction``,
  ``chunk_size`` and the :data:`EXCHANGE_OPTIONS` (the library's defaults
  where unset).
  """
  options = {}
  for name, (flag, _) in EXCHANGE_OPTIONS.items():
    value = getattr(args, _attr(flag))
    options[name] = EXCHANGE_DEFAULTS[name] if value is None else value
  return {
    "exchange": args.exchange,
    "fraction": args.exchange_fraction,
    "chunk_size": args.exchange_chunk_size,
    **options,
  }


def check_local_step_args(
  parser: argparse.ArgumentParser, args: argparse.Namespace
) -> None:
  """``--local-steps`` and its outer optimizer; evaluations and checkpoints
  fall on the outer steps (every ``H`` steps, and the last).
  """
  h = args.local_steps
  if h < 0:
    parser.error(f"--local-steps must be >= 0, got {h}")
  if args.exchange_chunk_size < 1:
    parser.error(
      f"--exchange-chunk-size must be >= 1, got {args.exchange_chunk_size}"
    )
  if not h:
    if args.outer_quantize != "none":
      parser.error("--outer-quantize needs --local-steps")
    return
  if not args.outer_lr > 0:
    parser.error(f"--outer-lr must be > 0, got {args.outer_lr}")
  if not 0 <= args.outer_momentum < 1:
    parser.error(
      f"--outer-momentum must be in [0, 1), got {args.outer_momentum}"
    )
  if args.outer_quantize == "int8" and args.exchange == "all_gather":
    parser.error(
      "--outer-quantize int8 needs --exchange dense or shared_support"
    )
  for flag in ("eval_every", "checkpoint_every"):
    value = getattr(args, flag)
    if value % h:
      parser.error(
        f"--{flag.replace('_', '-')} must be a multiple of "
        f"--local-steps {h} (evaluations and checkpoints fall on "
        f"outer steps), got {value}"
      )


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


def _is_key(x: Any) -> bool:
  return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


class Replicas:
  """One replica per device; the pieces an NNX step needs inside shard_map.

  Inside the step: :meth:`varying` (cast the parameters before
  differentiating, so each replica gets its own gradient), :meth:`mean`
  (metrics), :meth:`sync_stats` (BatchNorm statistics), :meth:`exchange_grads`
  and :meth:`fold_key`. Outside: :meth:`jit`, :meth:`place_state`,
  :meth:`replicate`, :meth:`shard`, :meth:`init_residual`, :meth:`init_outer`,
  :meth:`outer_sync` and :meth:`local` (a single-device copy of the state,
  for evaluation).

  With ``local_steps`` (DiLoCo) the train state holds one copy per replica
  (leading axis ``W``, sharded over the devices), the step exchanges
  nothing, and :meth:`outer_sync` runs the outer step every ``H`` steps.

  ``values``, ``indices``, ``support``, ``rank`` and ``warmup_steps`` are
  :func:`~grpo_optax.training.sparse_pmean`'s (not with ``local_steps``).
  The residual the step carries is a list of per-replica leaves, or (when
  :attr:`keeps_state`: the sparsity warm-up, the replicated support,
  PowerSGD) an :class:`~grpo_optax.training.ExchangeState` holding that
  list, the step count, the support and PowerSGD's ``Q`` (warm-started from
  step to step, as in ``data_parallel_step``).
  """

  def __init__(
    self,
    exchange: str,
    fraction: float,
    *,
    chunk_size: int = 64,
    values: str = "float32",
    indices: str = "int32",
    support: str = "norms",
    rank: int = 1,
    warmup_steps: int = 0,
    local_steps: int = 0,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    outer_quantize: str | None = None,
  ):
    self.exchange, self.fraction = exchange, fraction
    self.chunk_size = chunk_size
    self.options = {
      "values": values,
      "indices": indices,
      "support": support,
      "rank": rank,
      "warmup_steps": warmup_steps,
    }
    if local_steps and self.options != EXCHANGE_DEFAULTS:
      raise ValueError(
        "the outer exchange of local steps takes none of "
        f"{tuple(EXCHANGE_OPTIONS)}; got {self.options}"
      )
    self.local_steps = local_steps
    self.outer_lr, self.outer_momentum = outer_lr, outer_momentum
    self.outer_quantize = outer_quantize
    self.num_replicas = jax.device_count()
    self.mesh = jax.make_mesh((self.num_replicas,), (AXIS,))
    self._sync = None
    self._graphdef = None

  @property
  def _state_spec(self) -> P:
    return P(AXIS) if self.local_steps else P()

  @property
  def has_residual(self) -> bool:
    if self.local_steps:
      return self.exchange != "dense" or self.outer_quantize is not None
    return self.exchange != "dense"

  @property
  def keeps_state(self) -> bool:
    """Whether the exchange keeps state beyond the residuals (an
    :class:`~grpo_optax.training.ExchangeState`: the warm-up's step count,
    the replicated support's statistics, PowerSGD's ``Q``).
    """
    if self.local_steps or self.exchange == "dense":
      return False
    return (
      bool(self.options["warmup_steps"])
      or self.exchange == "powersgd"
      or (
        self.exchange == "shared_support"
        and self.options["support"] == "replicated"
      )
    )

  @property
  def _residual_spec(self) -> Any:
    if self.keeps_state:  # Residuals per replica, the rest replicated.
      return training.ExchangeState._make((P(AXIS), P(AXIS), P(), P(), P()))
    return P(AXIS)

  # -- inside the step ------------------------------------------------------

  def varying(self, tree: Any) -> Any:
    if self.local_steps:  # The per-replica state is varying already.
      return tree
    return jax.lax.pcast(tree, AXIS, to="varying")

  def mean(self, tree: Any) -> Any:
    return jax.lax.pmean(tree, AXIS)

  def sync_stats(self, tree: Any) -> Any:
    """BatchNorm statistics: averaged every step, or (local steps) kept per
    replica until the outer step.
    """
    return tree if self.local_steps else jax.lax.pmean(tree, AXIS)

  def fold_key(self, key: jax.Array) -> jax.Array:
    """A different key per replica (augmentation, dropout, masking)."""
    return jax.random.fold_in(key, jax.lax.axis_index(AXIS))

  def exchange_grads(self, grads: Any, residual: Any):
    """``(mean gradient, new residual)``; the residual is a list of the
    gradient's leaves, each with a leading replica axis of size 1 here (or
    an :class:`~grpo_optax.training.ExchangeState` holding that list).
    With local steps: the replica's own gradient, residual untouched.
    """
    leaves, treedef = jax.tree.flatten(grads)
    if self.local_steps:
      return grads, residual
    if self.exchange == "dense":
      return treedef.unflatten(jax.lax.pmean(leaves, AXIS)), residual
    state = isinstance(residual, training.ExchangeState)
    own = residual.residual if state else residual
    local = [r[0] for r in own]
    if state:
      local = residual._replace(residual=local)
    mean, local = training.sparse_pmean(
      leaves,
      local,
      AXIS,
      exchange=self.exchange,
      fraction=self.fraction,
      chunk_size=self.chunk_size,
      **self.options,
    )
    if state:
      return treedef.unflatten(mean), local._replace(
        residual=[r[None] for r in local.residual]
      )
    return treedef.unflatten(mean), [r[None] for r in local]

  # -- outside --------------------------------------------------------------

  def jit(
    self,
    step: Callable[..., Any],
    *,
    num_batch_args: int,
    compiler_options: dict | None = None,
  ):
    """``step(state, residual, *batch, key) -> (state, residual, metrics)``
    per replica, as one jitted program over the mesh; state and residual
    donated.
    """
    if self.local_steps:
      inner = step

      def step(state, residual, *args):  # pylint: disable=function-redefined
        state, residual, metrics = inner(_unstack(state), residual, *args)
        return _stack(state), residual, jax.tree.map(_replica_mean, metrics)

    batch = (P(AXIS),) * num_batch_args
    spec, residual = self._state_spec, self._residual_spec
    mapped = jax.shard_map(
      step,
      mesh=self.mesh,
      in_specs=(spec, residual, *batch, P()),
      out_specs=(spec, residual, P()),
    )
    return jax.jit(
      mapped, donate_argnums=(0, 1), compiler_options=compiler_options
    )

  def build_outer_sync(self, graphdef: Any, compiler_options=None) -> None:
    """Compiles the outer step of ``--local-steps`` for ``graphdef``."""
    outer_tx = training.default_outer_optimizer(
      self.outer_lr, self.outer_momentum
    )
    self._graphdef = graphdef

    def sync(state, unsent, outer):
      model, optimizer = nnx.merge(graphdef, _unstack(state))
      local = nnx.state(model, nnx.Param)
      leaves, treedef = jax.tree.flatten(nnx.to_pure_dict(local))
      params, opt_state, unsent, _ = training.outer_step(
        outer["params"],
        leaves,
        outer["opt_state"],
        AXIS,
        outer_tx=outer_tx,
        error_feedback=unsent is not None,
        exchange=self.exchange,
        fraction=self.fraction,
        chunk_size=self.chunk_size,
        quantize=self.outer_quantize,
      )
      # The next round starts at the new outer parameters, less what this
      # replica's change did not get sent (error feedback).
      start = (
        params if unsent is None else [p - e for p, e in zip(params, unsent)]
      )
      nnx.replace_by_pure_dict(local, treedef.unflatten(start))
      nnx.update(model, local)
      nnx.update(model, jax.lax.pmean(nnx.state(model, nnx.BatchStat), AXIS))
      unsent = None if unsent is None else [e[None] for e in unsent]
      outer = {"params": params, "opt_state": opt_state}
      return _stack(nnx.state((model, optimizer))), unsent, outer

    mapped = jax.shard_map(
      sync,
      mesh=self.mesh,
      in_specs=(P(AXIS), P(AXIS), P()),
      out_specs=(P(AXIS), P(AXIS), P()),
    )
    self._sync = jax.jit(
      mapped, donate_argnums=(0, 1, 2), compiler_options=compiler_options
    )

  def is_outer_step(self, done: int, total: int) -> bool:
    """Whether step ``done`` (1-based) ends a round (every ``H``, and the
    last).
    """
    return bool(self.local_steps) and (
      done % self.local_steps == 0 or done == total
    )

  def outer_sync(self, state, residual, outer):
    """The outer step: ``(state, unsent, outer)`` with every replica at the
    new outer parameters (less its unsent part).
    """
    return self._sync(state, residual, outer)

  def init_outer(self, params: Any) -> dict[str, Any] | None:
    """The outer parameters (leaves of ``params``) and the outer optimizer
    state, replicated; None without local steps.
    """
    if not self.local_steps:
      return None
    leaves = [jnp.asarray(x) for x in jax.tree.leaves(nnx.to_pure_dict(params))]
    tx = training.default_outer_optimizer(self.outer_lr, self.outer_momentum)
    tree = {"params": leaves, "opt_state": tx.init(leaves)}
    return self.replicate(jax.device_get(tree))

  def _put(self, x: Any, spec: P) -> jax.Array:
    sharding = NamedSharding(self.mesh, spec)
    if jax.process_count() == 1:
      return jax.device_put(x, sharding)
    if _is_key(x):
      return jax.random.wrap_key_data(
        self._put(jax.random.key_data(x), spec), impl=jax.random.key_impl(x)
      )
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda i: x[i])

  def replicate(self, tree: Any) -> Any:
    """The same value on every device (``tree`` equal on every process)."""
    return jax.tree.map(lambda x: self._put(x, P()), tree)

  def place_state(self, state: Any) -> Any:
    """The train state on the mesh: replicated, or (local steps) one copy
    per replica along a leading axis.
    """
    if not self.local_steps:
      return self.replicate(state)
    w = self.num_replicas

    def stack(x):
      if _is_key(x):
        return jax.random.wrap_key_data(
          stack(jax.random.key_data(x)), impl=jax.random.key_impl(x)
        )
      return np.broadcast_to(np.asarray(x), (w,) + tuple(x.shape))

    return jax.tree.map(lambda x: self._put(stack(x), P(AXIS)), state)

  def shard(self, x: np.ndarray) -> jax.Array:
    """A global batch (the same on every process), split over the replicas."""
    if len(x) % self.num_replicas:
      raise ValueError(
        f"the batch of {len(x)} is not divisible by the "
        f"{self.num_replicas} replicas (devices)."
      )
    return self._put(x, P(AXIS))

  def init_residual(self, params: Any):
    """Zero error-feedback residuals per replica (with local steps: the
    unsent parts of the parameter change); None for the dense exchange
    (float payload). When :attr:`keeps_state`: an
    :class:`~grpo_optax.training.ExchangeState` of those residuals, a zero
    step count and the initial support, replicated.
    """
    if not self.has_residual:
      return None
    leaves = jax.tree.leaves(params)
    residual = [
      self._put(np.zeros((self.num_replicas,) + x.shape, x.dtype), P(AXIS))
      for x in leaves
    ]
    if not self.keeps_state:
      return residual
    rest = training.init_exchange(
      [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves],
      exchange=self.exchange,
      error_feedback=False,
      support=self.options["support"],
      chunk_size=self.chunk_size,
      rank=self.options["rank"],
    )
    return self.replicate(jax.device_get(rest))._replace(residual=residual)

  def local(self, tree: Any) -> Any:
    """A single-device copy of the state (this process's first device; with
    local steps its replica's copy, equal to the others' after an outer
    step except for the inner optimizer state).
    """
    if self.local_steps:
      return jax.tree.map(lambda x: x.addressable_data(0)[0], tree)
    return jax.tree.map(lambda x: x.addressable_data(0), tree)

  def outer_copy(self, state: Any, outer: dict[str, Any]) -> Any:
    """A single-device copy of the state whose parameters are the outer
    ones (the model the local-step run has trained; each replica's own
    differs by its unsent part).
    """
    model, optimizer = nnx.merge(self._graphdef, self.local(state))
    params = nnx.state(model, nnx.Param)
    treedef = jax.tree.structure(nnx.to_pure_dict(params))
    nnx.replace_by_pure_dict(
      params,
      treedef.unflatten([x.addressable_data(0) for x in outer["params"]]),
    )
    nnx.update(model, params)
    return nnx.state((model, optimizer))

  def describe(self) -> dict[str, Any]:
    info = {
      "replicas": self.num_replicas,
      "processes": jax.process_count(),
      "exchange": self.exchange,
      "fraction": None if self.exchange == "dense" else self.fraction,
    }
    if self.local_steps:
      info.update(
        local_steps=self.local_steps,
        outer_lr=self.outer_lr,
        outer_momentum=self.outer_momentum,
        outer_quantize=self.outer_quantize,
        chunk_size=self.chunk_size,
      )
    info.update(
      (name, value)
      for name, value in self.options.items()
      if value != EXCHANGE_DEFAULTS[name]
    )
    return info


def _replica_mean(x: jax.Array) -> jax.Array:
  """The mean over the replicas of a per-replica (or already common) value."""
  aval = jax.typeof(x)
  varying = getattr(aval, "vma", None)
  if varying is None:  # Newer JAX: the manual axis type.
    varying = aval.manual_axis_type.varying
  if AXIS not in varying:
    return x
  return jax.lax.pmean(x, AXIS)


def _unstack(tree: Any) -> Any:
  return jax.tree.map(lambda x: x[0], tree)


def _stack(tree: Any) -> Any:
  return jax.tree.map(lambda x: x[None], tree)


def make_replicas(args: argparse.Namespace) -> Replicas | None:
  """The :class:`Replicas` of ``--data-parallel`` (None without it)."""
  if not args.data_parallel:
    return None
  kwargs = exchange_kwargs(args)
  replicas = Replicas(
    kwargs.pop("exchange"),
    kwargs.pop("fraction"),
    **kwargs,
    local_steps=args.local_steps,
    outer_lr=args.outer_lr,
    outer_momentum=args.outer_momentum,
    outer_quantize=None
    if args.outer_quantize == "none"
    else args.outer_quantize,
  )
  if args.batch_size % replicas.num_replicas:
    raise ValueError(
      f"--batch-size {args.batch_size} must be divisible by "
      f"the {replicas.num_replicas} devices of --data-parallel."
    )
  return replicas


def checkpoint_items(
  state: Any, residual: Any, outer: dict | None
) -> dict[str, Any]:
  """The trees a data-parallel checkpoint holds, as they lie on the mesh:
  ``state`` ({"model", "optimizer"}: replicated, or per replica with local
  steps), ``residual`` (per replica), ``exchange`` (the rest of an
  :class:`~grpo_optax.training.ExchangeState`: the step count, the
  replicated support, PowerSGD's ``Q`` of the leaves that have one) and
  ``outer`` (local steps).
  """
  pure = nnx.to_pure_dict(state)
  items = {"state": {"model": pure[0], "optimizer": pure[1]}}
  if isinstance(residual, training.ExchangeState):
    items["exchange"] = {"count": residual.count}
    if residual.support is not None:
      items["exchange"]["support"] = list(residual.support)
    if residual.q is not None:
      items["exchange"]["q"] = [q for q in residual.q if q is not None]
    residual = residual.residual
  if residual is not None:
    items["residual"] = list(residual)
  if outer is not None:
    items["outer"] = outer
  return items


def save(
  workdir: Any,
  step: int,
  history: dict,
  state: Any,
  residual: Any,
  outer: dict | None,
) -> None:
  """Checkpoint ``step`` of a data-parallel run; every process calls it and
  writes the shards of its own devices.
  """
  workdir.save_items(step, checkpoint_items(state, residual, outer), history)


def place(workdir: Any, replicas: Replicas, model: nnx.Module, state: Any):
  """The train state on the mesh with zero residuals (and the outer state
  of local steps), or, when resuming, the latest checkpoint's onto the same
  mesh: ``(step, history, (state, residual, outer))``.
  """
  params = nnx.state(model, nnx.Param)
  state = replicas.place_state(state)
  residual = replicas.init_residual(params)
  outer = replicas.init_outer(params)
  step, history, items = workdir.restore_items(
    checkpoint_items(state, residual, outer)
  )
  if step:
    nnx.replace_by_pure_dict(
      state, {0: items["state"]["model"], 1: items["state"]["optimizer"]}
    )
    outer = items.get("outer")
    if isinstance(residual, training.ExchangeState):
      rest = items["exchange"]
      support = rest.get("support")
      q = residual.q
      if q is not None:  # The saved Q's fill the leaves that have one.
        saved = iter(rest["q"])
        q = [None if x is None else next(saved) for x in q]
      residual = residual._replace(
        residual=list(items["residual"]),
        count=rest["count"],
        support=None if support is None else tuple(support),
        q=q,
      )
    else:
      residual = items.get("residual")
  return step, history, (state, residual, outer)


def single_device(
  tree: Any, replicas: Replicas | None, outer: dict | None = None
) -> Any:
  """``tree`` itself, or its single-device copy when data-parallel (with
  local steps: with the outer parameters).
  """
  if replicas is None:
    return tree
  if outer is not None:
    return replicas.outer_copy(tree, outer)
  return replicas.local(tree)


def jit_train_step(
  step: Callable[..., Any],
  replicas: Replicas | None,
  *,
  num_batch_args: int,
  compiler_options=None,
):
  """The examples' jitted training step: over the replicas when there are
  some, else on one device with the ``(model, optimizer)`` state donated.
  """
  if replicas is not None:
    return replicas.jit(
      step, num_batch_args=num_batch_args, compiler_options=compiler_options
    )
  return jax.jit(step, donate_argnums=0, compiler_options=compiler_options)
