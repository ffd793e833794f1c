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
:func:`jax.distributed.initialize` (gloo collectives on CPU).
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from grpo_optax import training

AXIS = "data"


#: The exchange's options: flag, argparse arguments (default None: the
#: library's default, see grpo_optax.training.sparse_pmean).
_EXCHANGE_OPTIONS = (
    ("--exchange-values", dict(choices=("float32", "bfloat16", "int8"),
                               help="Payload values (default float32).")),
    ("--exchange-indices", dict(choices=("int32", "compact"),
                                help="all_gather indices: int32, or compact "
                                "(block-local uint16 or a bitmap).")),
    ("--exchange-support", dict(choices=("norms", "replicated"),
                                help="shared_support chunk choice: "
                                "all-reduced norms, or replicated (from the "
                                "past aggregated updates, no collective).")),
    ("--exchange-chunk-size", dict(type=int, help="shared_support chunk "
                                   "entries (default 64).")),
    ("--exchange-rank", dict(type=int, help="powersgd rank (default 1).")),
    ("--exchange-momentum", dict(type=float, help="DGC momentum correction "
                                 "factor (default 0: off).")),
    ("--exchange-no-mask", dict(action="store_const", const=True,
                                help="No DGC momentum factor masking.")),
    ("--exchange-clip", dict(type=float, help="DGC local clipping bound c "
                             "(each replica clips at c / sqrt(W)).")),
    ("--exchange-warmup-steps", dict(type=int, help="Steps per stage of "
                                     "DGC's sparsity warm-up (0: off).")),
)


def exchange_options(args: argparse.Namespace) -> dict[str, Any]:
  """The ``sparse_pmean`` keyword arguments set by the ``--exchange-*`` flags."""
  names = {"values": "exchange_values", "indices": "exchange_indices",
           "support": "exchange_support", "chunk_size": "exchange_chunk_size",
           "rank": "exchange_rank", "momentum": "exchange_momentum",
           "clip_norm": "exchange_clip",
           "warmup_steps": "exchange_warmup_steps"}
  out = {k: getattr(args, v) for k, v in names.items()
         if getattr(args, v, None) is not None}
  if getattr(args, "exchange_no_mask", None):
    out["mask_momentum"] = False
  return out


def add_parallel_flags(parser: argparse.ArgumentParser) -> None:
  """``--data-parallel``, ``--exchange``, ``--exchange-fraction`` and the
  multi-process flags."""
  group = parser.add_argument_group(
      "data parallel", "Split each batch over all devices (one replica per "
      "device) and exchange gradients; e.g. XLA_FLAGS="
      "--xla_force_host_platform_device_count=8 on CPU.")
  group.add_argument("--data-parallel", action="store_true",
                     help="Train data-parallel over all devices.")
  group.add_argument("--exchange", choices=training.EXCHANGES, default=None,
                     help="Gradient exchange between replicas (default: "
                     "dense). all_gather: each replica's top-k entries; "
                     "shared_support: the same top chunks on every replica; "
                     "powersgd: rank-r PowerSGD.")
  group.add_argument("--exchange-fraction", type=float, default=None,
                     help="Kept fraction of each gradient leaf for the sparse "
                     "exchanges (default: 0.3).")
  for flag, kwargs in _EXCHANGE_OPTIONS:
    group.add_argument(flag, default=None, **kwargs)
  group.add_argument("--coordinator-address", default=None,
                     help="host:port of process 0 for jax.distributed "
                     "(set by examples/launch_multiprocess.py).")
  group.add_argument("--num-processes", type=int, default=1)
  group.add_argument("--process-id", type=int, default=0)


def check_parallel_args(parser: argparse.ArgumentParser,
                        args: argparse.Namespace) -> None:
  """Rejects inconsistent flags; fills in the exchange defaults."""
  flags = ["exchange", "exchange_fraction"] + [
      f[0][2:].replace("-", "_") for f in _EXCHANGE_OPTIONS]
  if not args.data_parallel:
    for flag in flags:
      if getattr(args, flag) is not None:
        parser.error(f"--{flag.replace('_', '-')} needs --data-parallel")
    if args.num_processes != 1:
      parser.error("--num-processes needs --data-parallel")
  args.exchange = args.exchange or "dense"
  if args.exchange_fraction is None:
    args.exchange_fraction = 0.3
  if not 0 < args.exchange_fraction <= 1:
    parser.error(f"--exchange-fraction must be in (0, 1], got "
                 f"{args.exchange_fraction}")
  options = exchange_options(args)
  if args.exchange == "dense" and options:
    parser.error("the --exchange-* options need a compressed --exchange "
                 "(all_gather, shared_support or powersgd)")
  try:  # Surfaces the library's validation as a flag error.
    training.exchange._config(args.exchange, args.exchange_fraction,  # pylint: disable=protected-access
                              options.pop("chunk_size", 64), **{
                                  "values": "float32", "indices": "int32",
                                  "support": "norms", "rank": 1,
                                  "momentum": 0.0, "mask_momentum": True,
                                  "clip_norm": None, "warmup_steps": 0,
                                  **options})
  except ValueError as e:
    parser.error(f"invalid --exchange-* flags: {e}")
  if args.num_processes < 1:
    parser.error(f"--num-processes must be >= 1, got {args.num_processes}")
  if not 0 <= args.process_id < args.num_processes:
    parser.error(f"--process-id must be in [0, {args.num_processes}), got "
                 f"{args.process_id}")
  if args.num_processes > 1:
    if not args.coordinator_address:
      parser.error("--num-processes > 1 needs --coordinator-address")
    if args.workdir:
      parser.error("--workdir is not supported with --num-processes > 1 "
                   "(checkpoints would need every process)")


def initialize(args: argparse.Namespace) -> None:
  """Joins the other processes (``jax.distributed``), before any JAX work."""
  if args.num_processes > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator_address,
                               num_processes=args.num_processes,
                               process_id=args.process_id)


def is_primary() -> bool:
  """Whether this process prints (process 0)."""
  return jax.process_index() == 0


def _is_key(x: Any) -> bool:
  return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


class Replicas:
  """One replica per device; the pieces an NNX step needs inside shard_map.

  Inside the step: :meth:`varying` (cast the parameters before
  differentiating, so each replica gets its own gradient), :meth:`mean`
  (BatchNorm statistics, metrics), :meth:`exchange_grads` and
  :meth:`fold_key`. Outside: :meth:`jit`, :meth:`replicate`, :meth:`shard`,
  :meth:`init_residual` and :meth:`local` (a single-device copy of a
  replicated state, for evaluation and checkpoints).
  """

  def __init__(self, exchange: str, fraction: float, **options):
    self.exchange, self.fraction = exchange, fraction
    self.options = options
    self.num_replicas = jax.device_count()
    self.mesh = jax.make_mesh((self.num_replicas,), (AXIS,))

  # -- inside the step ------------------------------------------------------

  def varying(self, tree: Any) -> Any:
    return jax.lax.pcast(tree, AXIS, to="varying")

  def mean(self, tree: Any) -> Any:
    return jax.lax.pmean(tree, AXIS)

  def fold_key(self, key: jax.Array) -> jax.Array:
    """A different key per replica (augmentation, dropout, masking)."""
    return jax.random.fold_in(key, jax.lax.axis_index(AXIS))

  def exchange_grads(self, grads: Any, residual: Any):
    """``(mean gradient, new exchange state)``; the state is an
    :class:`~grpo_optax.training.ExchangeState` over the gradient's leaves,
    its per-replica fields with a leading replica axis of size 1 here."""
    leaves, treedef = jax.tree.flatten(grads)
    if self.exchange == "dense":
      return treedef.unflatten(jax.lax.pmean(leaves, AXIS)), residual
    local = residual._replace(**{
        f: jax.tree.map(lambda r: r[0], getattr(residual, f))
        for f in training.exchange.PER_REPLICA})
    mean, local = training.sparse_pmean(
        leaves, local, AXIS, exchange=self.exchange, fraction=self.fraction,
        **self.options)
    return treedef.unflatten(mean), local._replace(**{
        f: jax.tree.map(lambda r: r[None], getattr(local, f))
        for f in training.exchange.PER_REPLICA})

  # -- outside --------------------------------------------------------------

  def jit(self, step: Callable[..., Any], *, num_batch_args: int,
          compiler_options: dict | None = None):
    """``step(state, residual, *batch, key) -> (state, residual, metrics)``
    per replica, as one jitted program over the mesh; state and residual
    donated."""
    batch = (P(AXIS),) * num_batch_args
    spec = self._state_spec()
    mapped = jax.shard_map(
        step, mesh=self.mesh, in_specs=(P(), spec, *batch, P()),
        out_specs=(P(), spec, P()))
    return jax.jit(mapped, donate_argnums=(0, 1),
                   compiler_options=compiler_options)

  def _put(self, x: Any, spec: P) -> jax.Array:
    sharding = NamedSharding(self.mesh, spec)
    if jax.process_count() == 1:
      return jax.device_put(x, sharding)
    if _is_key(x):
      return jax.random.wrap_key_data(self._put(jax.random.key_data(x), spec),
                                      impl=jax.random.key_impl(x))
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda i: x[i])

  def replicate(self, tree: Any) -> Any:
    """The same value on every device (``tree`` equal on every process)."""
    return jax.tree.map(lambda x: self._put(x, P()), tree)

  def shard(self, x: np.ndarray) -> jax.Array:
    """A global batch (the same on every process), split over the replicas."""
    if len(x) % self.num_replicas:
      raise ValueError(f"the batch of {len(x)} is not divisible by the "
                       f"{self.num_replicas} replicas (devices).")
    return self._put(x, P(AXIS))

  def _state_spec(self):
    if self.exchange == "dense":
      return P()
    return training.ExchangeState(P(AXIS), P(AXIS), P(), P(), P())

  def _template(self, params: Any):
    """The global exchange state (NumPy), per-replica fields stacked."""
    leaves = jax.tree.leaves(params)
    opts = self.options
    ex = training.init_exchange(
        [jnp.zeros(x.shape, x.dtype) for x in leaves],
        exchange=self.exchange, momentum=opts.get("momentum", 0.0),
        support=opts.get("support", "norms"),
        chunk_size=opts.get("chunk_size", 64), rank=opts.get("rank", 1))
    ex = jax.tree.map(np.asarray, ex)
    w = self.num_replicas
    return ex._replace(**{
        f: jax.tree.map(lambda x: np.zeros((w,) + x.shape, x.dtype),
                        getattr(ex, f))
        for f in training.exchange.PER_REPLICA})

  def init_residual(self, params: Any, restored: list | None = None):
    """The initial exchange state (error-feedback residuals, DGC velocity,
    step count, support, PowerSGD's Q), or ``restored`` leaves (as from
    :meth:`host`); None for the dense exchange."""
    if self.exchange == "dense":
      return None
    template = self._template(params)
    leaves, treedef = jax.tree.flatten(template)
    if restored is not None:
      if len(restored) != len(leaves):
        raise ValueError(f"a restored exchange state has {len(restored)} "
                         f"arrays, expected {len(leaves)}: resume with the "
                         "same --exchange flags.")
      for r, x in zip(restored, leaves):
        if r.shape != x.shape:
          raise ValueError(f"a restored exchange state array has shape "
                           f"{r.shape}, expected {x.shape}: resume with the "
                           "same number of devices and --exchange flags.")
      template = treedef.unflatten(list(restored))
    specs = self._state_spec()
    return training.ExchangeState(*[
        jax.tree.map(lambda x, s=s: self._put(x, s), getattr(template, f))
        for f, s in zip(training.ExchangeState._fields, specs)])

  @staticmethod
  def local(tree: Any) -> Any:
    """A single-device copy of a replicated tree (this process's first
    device)."""
    return jax.tree.map(lambda x: x.addressable_data(0), tree)

  @staticmethod
  def host(residual: Any) -> list | None:
    """The exchange state's arrays as NumPy (single process), for
    checkpoints."""
    return None if residual is None else [np.asarray(r) for r in
                                          jax.tree.leaves(residual)]

  def residual_like(self, params: Any) -> list[jax.ShapeDtypeStruct]:
    """Shapes of the exchange state's arrays (for restoring a checkpoint)."""
    if self.exchange == "dense":
      return []
    return [jax.ShapeDtypeStruct(x.shape, x.dtype)
            for x in jax.tree.leaves(self._template(params))]

  def describe(self) -> dict[str, Any]:
    return {"replicas": self.num_replicas, "processes": jax.process_count(),
            "exchange": self.exchange,
            "fraction": None if self.exchange == "dense" else self.fraction,
            **({"options": dict(self.options)} if self.options else {})}


def make_replicas(args: argparse.Namespace) -> Replicas | None:
  """The :class:`Replicas` of ``--data-parallel`` (None without it)."""
  if not args.data_parallel:
    return None
  replicas = Replicas(args.exchange, args.exchange_fraction,
                      **exchange_options(args))
  if args.batch_size % replicas.num_replicas:
    raise ValueError(f"--batch-size {args.batch_size} must be divisible by "
                     f"the {replicas.num_replicas} devices of --data-parallel.")
  return replicas


def single_device(tree: Any, replicas: Replicas | None) -> Any:
  """``tree`` itself, or its single-device copy when data-parallel."""
  return tree if replicas is None else replicas.local(tree)


def jit_train_step(step: Callable[..., Any], replicas: Replicas | None, *,
                   num_batch_args: int, compiler_options=None):
  """The examples' jitted training step: over the replicas when there are
  some, else on one device with the ``(model, optimizer)`` state donated."""
  if replicas is not None:
    return replicas.jit(step, num_batch_args=num_batch_args,
                        compiler_options=compiler_options)
  return jax.jit(step, donate_argnums=0, compiler_options=compiler_options)
