r"""The data-parallel runtime: one train step over a mesh, in two modes.

:class:`DataParallel` runs a user's loss on each replica's share of the
global batch inside :func:`jax.shard_map` and carries everything a real
training loop needs in one :class:`TrainState`:

* the parameters and the ``tx`` state (any optax transformation);
* the model's mutable state (BatchNorm statistics, Flax Linen's
  ``batch_stats`` or an NNX ``nnx.BatchStat`` state), averaged over the
  replicas after each step (in local-step mode: at each outer step);
* a PRNG key: step ``t`` of replica ``r`` draws from
  ``fold_in(fold_in(key, t), r)`` (augmentation, dropout, masking), so a
  resumed run draws what an uninterrupted one does;
* the exchange's state (:class:`~grpo_optax.training.ExchangeState`:
  residuals, DGC's velocity, the compressor's own state), for any compressor
  of the registry (:mod:`grpo_optax.training.compressors`);
* in local-step mode (DiLoCo, ``local_steps=H``): each replica's own
  parameters, ``tx`` state and model state, and the outer parameters and
  optimizer state (:class:`~grpo_optax.training.outer.OuterState`).

The loss has one signature,

.. code-block:: python

  loss_fn(params, model_state, batch, key) -> (loss, (model_state, aux))

``model_state`` and ``key`` are None when the state holds none; ``aux`` (any
pytree, e.g. metrics) is averaged over the replicas and returned.

**Every-step mode** (``local_steps=0``): each step, every replica
differentiates its loss (the parameters are cast to varying first, so no
implicit all-reduce of the full gradient enters the program), the exchange
gives every replica the same mean gradient, and ``tx`` is applied to the
parameters where they live: by every device to its copy of replicated
parameters (inside the same ``shard_map``), or on the global view to
parameters sharded FSDP-style over ``dense_axis``.

**Local-step mode** (``local_steps=H``): each step is an inner step of every
replica on its own copy, without any exchange; after every ``H``-th step the
same compiled step runs the outer step
(:func:`~grpo_optax.training.outer_exchange` in a ``lax.cond``): the
replicas' parameter changes go
through the exchange, the outer optimizer moves the outer parameters, every
replica restarts from them (less what its change did not get sent) and the
model states are averaged. :meth:`DataParallel.sync` runs an outer step now
(the end of a partial round); :meth:`DataParallel.round` runs ``H`` inner
steps and the outer step as one program.

State is saved and restored with :mod:`grpo_optax.training.checkpointing`
(orbax; every process writes its own shards).

References:
  Douillard et al. DiLoCo: Distributed Low-Communication Training of
  Language Models. 2023. https://arxiv.org/abs/2311.08105

  Lin et al. Deep Gradient Compression. ICLR 2018.
  https://arxiv.org/abs/1712.01887
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from grpo_optax import _common
from grpo_optax.training import _tree
from grpo_optax.training import exchange as exchange_lib
from grpo_optax.training import outer as outer_lib
from grpo_optax.training import placement
from grpo_optax.training.compressors import base

LossFn = Callable[[Any, Any, Any, Any], Any]


class TrainState(NamedTuple):
  """State of :class:`DataParallel` (a pytree of global arrays).

  Attributes:
    params: the parameters, replicated on every device (or sharded over
      ``dense_axis`` where ``init`` got them so); in local-step mode each
      replica's own, with a leading axis of size ``W`` sharded over
      ``axis``.
    opt_state: the ``tx`` state, laid out as the params (per replica in
      local-step mode).
    model_state: the model's mutable state (e.g. BatchNorm statistics) or
      None; replicated (per replica in local-step mode).
    exchange: the :class:`~grpo_optax.training.ExchangeState`; its
      per-replica fields (residual, velocity) have a leading axis ``W``
      sharded over ``axis``. In local-step mode its residual is each
      replica's unsent part of its last parameter change.
    key: the base PRNG key (replicated), or None.
    count: steps done (int32 scalar, replicated).
    outer: the :class:`~grpo_optax.training.outer.OuterState` of
      local-step mode, else None.
  """

  params: Any
  opt_state: Any
  model_state: Any
  exchange: exchange_lib.ExchangeState
  key: Any
  count: jax.Array
  outer: Any = None

  @property
  def residual(self) -> Any:
    """The exchange's per-replica residuals (``exchange.residual``)."""
    return self.exchange.residual


class StepOutput(NamedTuple):
  """What a step returns besides the state (the same on every device).

  Attributes:
    loss: the mean of the replicas' losses.
    aux: the mean over the replicas of the loss's ``aux``.
    norms: ``{"grad_norm", "update_norm", "param_norm"}`` (global norms of
      the applied gradient, the update and the new parameters; in
      local-step mode each replica's, averaged) when built with
      ``norms=True``, else None.
  """

  loss: jax.Array
  aux: Any
  norms: Any = None


def _lead(tree: Any) -> Any:
  return jax.tree.map(lambda x: x[None], tree)


def _first(tree: Any) -> Any:
  return jax.tree.map(lambda x: x[0], tree)


def _varying_axes(x: Any, axes: tuple[Any, ...]) -> tuple[Any, ...]:
  aval = jax.typeof(x)
  vma = getattr(aval, "vma", None)
  if vma is None:  # Newer JAX: the manual axis type.
    vma = aval.manual_axis_type.varying
  return tuple(a for a in axes if a in vma)


def replica_mean(tree: Any, axes: tuple[Any, ...]) -> Any:
  """The mean over the replicas of each leaf that varies over ``axes``.

  Float leaves are averaged; other leaves (counters) take the replicas'
  maximum; leaves already the same on every replica are returned as they
  are.
  """

  def mean(x):
    over = _varying_axes(x, axes)
    if not over:
      return x
    if jnp.issubdtype(x.dtype, jnp.inexact):
      return jax.lax.pmean(x, over)
    return jax.lax.pmax(x, over)

  return jax.tree.map(mean, tree)


_LOCAL_STEPS = base.Option("local_steps", 0, "int", low=0)
_SEED = base.Option("seed", 0, "int", low=0)


def _is_tx(tx: Any) -> bool:
  return hasattr(tx, "init") and hasattr(tx, "update")


class DataParallel:
  """The data-parallel train step over a mesh (module docstring).

  Build with :func:`data_parallel`. ``init(params, model_state=None,
  key=None)`` returns a :class:`TrainState`; ``step(state, batch) ->
  (state, StepOutput)`` donates ``state``; ``lower(state, batch)`` returns
  the ``jax.stages.Lowered`` program (``.compile()``,
  :func:`~grpo_optax.hlo.collective_bytes`). In local-step mode also
  ``sync(state)`` (an outer step now) and ``round(state, batches)`` (``H``
  inner steps and the outer step in one program, batches stacked on a
  leading axis of size ``H``).

  Attributes:
    mesh: as built (also ``axis``, ``dense_axis``, ``local_steps``, ``tx``,
      ``outer_tx``).
    exchange: the :class:`~grpo_optax.training.Exchange` (gradients every
      step, or the parameter changes of the outer step).
    data_axes: the axes the batch is split over (``axis``, ``dense_axis``).
    num_replicas: replicas of the exchange (the size of ``axis``).
    num_devices: devices of the data axes (the batch's divisor).
    batch_sharding: the sharding of a global batch (split over the data
      axes).
  """

  def __init__(
    self,
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation,
    mesh: jax.sharding.Mesh,
    *,
    exchange: Any = "dense",
    local_steps: int = 0,
    outer_tx: optax.GradientTransformation | None = None,
    axis: str = "data",
    dense_axis: str | None = None,
    extra_args: Callable[[Any, Any], dict] | None = None,
    norms: bool = False,
    donate: bool = True,
    compiler_options: dict | None = None,
    **options: Any,
  ):
    self._check_args(loss_fn, tx, mesh, axis, dense_axis, extra_args)
    _tree.check_flag("norms", norms)
    _tree.check_flag("donate", donate)
    self.local_steps = _LOCAL_STEPS.check(local_steps)
    if self.local_steps and dense_axis is not None:
      raise ValueError(
        "local-step mode (`local_steps` > 0) runs on a 1-D mesh: "
        f"`dense_axis` must be None, got {dense_axis!r}."
      )
    if outer_tx is not None and not _is_tx(outer_tx):
      raise TypeError(
        "`outer_tx` must be an optax GradientTransformation (with init and "
        f"update), got {type(outer_tx)}."
      )
    if outer_tx is not None and not self.local_steps:
      raise ValueError(
        "`outer_tx` applies to local-step mode: set `local_steps` >= 1 (got "
        "0) or leave `outer_tx` None."
      )
    self.exchange = exchange_lib.make_exchange(exchange, **options)
    self.loss_fn, self.tx, self.mesh = loss_fn, tx, mesh
    self.outer_tx = outer_tx or (
      outer_lib.default_outer_optimizer() if self.local_steps else None
    )
    self.axis, self.dense_axis = axis, dense_axis
    self.data_axes = (axis,) if dense_axis is None else (axis, dense_axis)
    self.extra_args, self.norms, self._donate = extra_args, norms, donate
    self._jit = functools.partial(
      jax.jit,
      donate_argnums=(0,) if donate else (),
      compiler_options=compiler_options,
    )
    self.num_replicas = mesh.shape[axis]
    self.num_devices = math.prod(mesh.shape[a] for a in self.data_axes)
    self.exchange.compressor.check_replicas(self.num_replicas)
    # A lossless exchange without DGC's momentum or clipping is one
    # collective over every data axis; the others average within a node
    # first, then exchange across the nodes.
    ex = self.exchange
    single = ex.compressor.lossless and not ex.momentum and ex.clip_norm is None
    self._exchange_axes = self.data_axes if single else axis
    self._pre_axis = None if single else dense_axis
    self._replicated = NamedSharding(mesh, P())
    self._per_replica = NamedSharding(mesh, P(axis))
    self.batch_sharding = NamedSharding(mesh, P(self.data_axes))
    self._round_sharding = NamedSharding(mesh, P(None, axis))
    self._programs: dict[Any, Any] = {}

  @staticmethod
  def _check_args(loss_fn, tx, mesh, axis, dense_axis, extra_args) -> None:
    if not callable(loss_fn):
      raise TypeError(f"`loss_fn` must be callable, got {type(loss_fn)}.")
    if not _is_tx(tx):
      raise TypeError(
        "`tx` must be an optax GradientTransformation (with "
        f"init and update), got {type(tx)}."
      )
    if extra_args is not None and not callable(extra_args):
      raise TypeError(
        f"`extra_args` must be None or callable, got {type(extra_args)}."
      )
    if not isinstance(mesh, Mesh):
      raise TypeError(f"`mesh` must be a jax.sharding.Mesh, got {type(mesh)}.")
    names = tuple(mesh.axis_names)
    if axis not in names:
      raise ValueError(
        f"`axis` must be one of the mesh's axes {names}, got {axis!r}."
      )
    if dense_axis is not None and (
      dense_axis not in names or dense_axis == axis
    ):
      raise ValueError(
        f"`dense_axis` must be None or one of the mesh's axes "
        f"{names} other than `axis` ({axis!r}), got "
        f"{dense_axis!r}."
      )
    others = [n for n in names if n not in (axis, dense_axis)]
    if others:
      raise ValueError(
        f"the mesh's axes must all be data axes (`axis`, `dense_axis`); "
        f"got the extra axes {others} (model parallelism is not supported "
        "by this step)."
      )

  # -- state and data -------------------------------------------------------

  def _stack(self, tree: Any) -> Any:
    w = self.num_replicas
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (w,) + x.shape), tree)

  def _init_exchange(self, params: Any, seed: int) -> Any:
    def make(p):
      p = jax.tree.map(lambda x: placement.constrain(x, self._replicated), p)
      ex = self.exchange.init(p, seed)
      return ex._replace(
        residual=self._stack(ex.residual), velocity=self._stack(ex.velocity)
      )

    # Shardings shaped like the state (_make: not the fields' types).
    shardings = exchange_lib.ExchangeState._make(
      (self._per_replica, self._per_replica, self._replicated, self._replicated)
    )
    return jax.jit(make, out_shardings=shardings)(params)

  def init(
    self, params: Any, model_state: Any = None, key: Any = None, seed: int = 0
  ) -> TrainState:
    """The initial :class:`TrainState`.

    ``params``, ``model_state`` and ``key`` must be the same on every
    process (e.g. from the same seed). A params leaf sharded over
    ``dense_axis`` (a ``jax.Array`` with a ``NamedSharding`` on this mesh:
    FSDP within a node) keeps its sharding, and so do the ``tx`` state
    leaves shaped like it; everything else is replicated (per replica in
    local-step mode). The state owns its arrays: ``jax.Array`` inputs are
    copied once, so the donated step never deletes the caller's arrays.

    Args:
      params: the parameters (a pytree of float arrays).
      model_state: the model's mutable state (e.g. BatchNorm statistics),
        or None.
      key: the base PRNG key of the steps (a typed key), or None.
      seed: seed of the exchange's random initial state (PowerSGD's ``Q``).

    Raises:
      ValueError: if a leaf of ``params`` is sharded over ``axis`` (the
        exchange's, whose replicas each hold the whole parameters) or over
        an axis this mesh lacks, or ``seed`` is not an int >= 0.
    """
    seed = _SEED.check(seed)
    rep = lambda t: jax.tree.map(lambda _: self._replicated, t)
    key = None if key is None else placement.own(key, self._replicated, True)
    count = jax.device_put(jnp.zeros((), jnp.int32), self._replicated)
    if self.local_steps:
      return self._init_local(params, model_state, key, count, seed, rep)
    shardings = jax.tree.map(
      lambda x: placement.param_sharding(
        x, self.mesh, self.axis, self.dense_axis
      ),
      params,
    )
    params = placement.own(params, shardings, self._donate)
    if all(s.is_fully_replicated for s in jax.tree.leaves(shardings)):
      state_shardings = self._replicated
    else:  # optax's recipe: param-shaped state leaves as their params
      state_shardings = optax.tree.map_params(
        self.tx,
        lambda _, sh: sh,
        jax.eval_shape(self.tx.init, params),
        shardings,
        transform_non_params=lambda _: self._replicated,
        is_leaf=lambda x: isinstance(x, NamedSharding),
      )
    opt_state = jax.jit(self.tx.init, out_shardings=state_shardings)(params)
    model_state = placement.own(model_state, rep(model_state), self._donate)
    ex = self._init_exchange(params, seed)
    return TrainState(params, opt_state, model_state, ex, key, count, None)

  def _init_local(self, params, model_state, key, count, seed, rep):
    params = placement.own(params, rep(params), self._donate)
    model_state = placement.own(model_state, rep(model_state), self._donate)
    outer_tx = self.outer_tx
    assert outer_tx is not None  # local-step mode always has one
    outer = jax.jit(
      lambda p: outer_lib.OuterState(
        jax.tree.map(jnp.copy, p), outer_tx.init(p)
      ),
      out_shardings=self._replicated,
    )(params)
    replicas = jax.jit(
      lambda p, s: (
        self._stack(p),
        self._stack(self.tx.init(p)),
        self._stack(s),
      ),
      out_shardings=self._per_replica,
    )
    p, opt, ms = replicas(params, model_state)
    ex = self._init_exchange(params, seed)
    return TrainState(p, opt, ms, ex, key, count, outer)

  def shard_batch(self, batch: Any) -> Any:
    """The global batch as arrays split along their leading axis.

    Args:
      batch: a pytree of arrays whose leading dimension (the global batch
        size) is divisible by the number of devices of the data axes: NumPy
        arrays holding the whole global batch (the same on every process),
        ``jax.Array`` values, or ``jax.ShapeDtypeStruct`` values (for
        :meth:`lower`).
    """
    return placement.split_leading(
      batch,
      self.batch_sharding,
      self.num_devices,
      f"`batch` leaves need a leading dimension divisible by the "
      f"{self.num_devices} devices of the data axes {self.data_axes}",
    )

  def participation(self, mask: Any) -> Any:
    """The participation mask as a per-replica array (None: all report)."""
    if mask is None:
      return None
    if not self.local_steps:
      raise ValueError(
        "`participation` applies to local-step mode (`local_steps` > 0)."
      )
    if isinstance(mask, jax.ShapeDtypeStruct):
      return placement.to_global(mask, self._per_replica)
    shape = np.shape(mask)
    if shape != (self.num_replicas,):
      raise ValueError(
        f"`participation` must have the shape ({self.num_replicas},) (one "
        f"entry per replica), got {shape}."
      )
    if not isinstance(mask, jax.Array):
      mask = np.asarray(mask, np.float32)
    return placement.to_global(mask, self._per_replica)

  # -- the programs ---------------------------------------------------------

  def step(self, state: TrainState, batch: Any, participation: Any = None):
    """One step on the global ``batch``; ``state`` is donated.

    Args:
      state: a :class:`TrainState`.
      batch: the global batch (:meth:`shard_batch`).
      participation: local-step mode: a ``(W,)`` 0/1 mask of the replicas
        that report at the outer step this step may end (None: all).

    Returns:
      ``(state, StepOutput)``.
    """
    mask = self.participation(participation)
    return self._program("step", state, mask)(
      state, self.shard_batch(batch), mask
    )

  __call__ = step

  def lower(
    self, state: TrainState, batch: Any, participation: Any = None
  ) -> jax.stages.Lowered:
    """The lowered :meth:`step` (``.compile()``, ``.as_text()``)."""
    mask = self.participation(participation)
    return self._program("step", state, mask).lower(
      state, self.shard_batch(batch), mask
    )

  def sync(self, state: TrainState, participation: Any = None) -> TrainState:
    """Local-step mode: the outer step now (e.g. after a partial round)."""
    self._need_local("sync")
    mask = self.participation(participation)
    return self._program("sync", state, mask)(state, mask)

  def round(self, state: TrainState, batches: Any, participation: Any = None):
    """Local-step mode: ``H`` inner steps and the outer step, one program.

    A replica that does not report loses the round's work: its ``tx`` state
    returns to the one it had at the round's start (the per-step form has
    no copy of it and keeps it).

    Args:
      state: a :class:`TrainState` at the start of a round (donated).
      batches: ``H`` global batches stacked on a leading axis.
      participation: a ``(W,)`` 0/1 mask of the replicas that report.

    Returns:
      ``(state, StepOutput)`` with the means over the ``H`` steps.
    """
    self._need_local("round")
    mask = self.participation(participation)
    return self._program("round", state, mask)(
      state, self.shard_batches(batches), mask
    )

  def lower_round(
    self, state: TrainState, batches: Any, participation: Any = None
  ) -> jax.stages.Lowered:
    """The lowered :meth:`round`."""
    self._need_local("round")
    mask = self.participation(participation)
    return self._program("round", state, mask).lower(
      state, self.shard_batches(batches), mask
    )

  def shard_batches(self, batches: Any) -> Any:
    """``H`` global batches (leaves ``(H, B, ...)``) split along ``B``."""
    for x in jax.tree.leaves(batches):
      shape = tuple(x.shape) if hasattr(x, "shape") else np.shape(x)
      if len(shape) < 2 or shape[0] != self.local_steps:
        raise ValueError(
          f"`batches` leaves need the shape (local_steps={self.local_steps},"
          f" B, ...) with B divisible by the {self.num_replicas} replicas; "
          f"got a leaf of shape {shape}."
        )
    return placement.split_leading(
      batches,
      self._round_sharding,
      self.num_replicas,
      f"`batches` leaves need the shape (local_steps={self.local_steps}, B, "
      f"...) with B divisible by the {self.num_replicas} replicas",
      axis=1,
    )

  def _need_local(self, what: str) -> None:
    if not self.local_steps:
      raise ValueError(f"`{what}` needs local-step mode (`local_steps` > 0).")

  def _state_specs(self) -> TrainState:
    ex = exchange_lib.state_specs(self.axis)
    # PartitionSpecs shaped like the state (_make: not the fields' types).
    if self.local_steps:
      per = P(self.axis)
      return TrainState._make((per, per, per, ex, P(), P(), P()))
    return TrainState._make((P(), P(), P(), ex, P(), P(), None))

  def _program(self, kind: str, state: TrainState, mask: Any):
    """The jitted program ``kind`` for the layout of ``state`` (compiled
    once each).
    """
    if self.local_steps:
      key = (kind, mask is None)
      if key not in self._programs:
        self._programs[key] = self._local_program(kind, mask is None)
      return self._programs[key]

    def layout(spec, sub):
      default = NamedSharding(self.mesh, spec)
      return jax.tree.map(
        lambda x: (
          s
          if isinstance(s := getattr(x, "sharding", None), NamedSharding)
          else default
        ),
        sub,
      )

    shardings = jax.tree.map(
      layout, self._state_specs(), state, is_leaf=lambda x: isinstance(x, P)
    )
    key = (jax.tree.structure(shardings), tuple(jax.tree.leaves(shardings)))
    if key not in self._programs:
      laid_out = (shardings.params, shardings.opt_state)
      if all(s.is_fully_replicated for s in jax.tree.leaves(laid_out)):
        body = self._replicated_step  # tx on every device's copy
      else:  # tx on the global view: FSDP-sharded params stay sharded
        body = functools.partial(self._every_step, shardings.params)
      self._programs[key] = self._jit(
        body,
        in_shardings=(shardings, self.batch_sharding, None),
        out_shardings=(shardings, self._replicated),
      )
    return self._programs[key]

  def _local_program(self, kind: str, unmasked: bool):
    specs = self._state_specs()
    mask_spec = None if unmasked else P(self.axis)
    if kind == "sync":
      fn = jax.shard_map(
        self._local_sync,
        mesh=self.mesh,
        in_specs=(specs, mask_spec),
        out_specs=specs,
      )
    else:
      body = self._local_step if kind == "step" else self._local_round
      batch_spec = P(self.data_axes) if kind == "step" else P(None, self.axis)
      fn = jax.shard_map(
        body,
        mesh=self.mesh,
        in_specs=(specs, batch_spec, mask_spec),
        out_specs=(specs, P()),
      )
    return self._jit(fn)

  # -- every-step mode --------------------------------------------------------

  def _replicated_step(self, state: TrainState, batch, mask):
    del mask  # Every-step mode has no outer step.
    specs = self._state_specs()
    return jax.shard_map(
      self._replica_step,
      mesh=self.mesh,
      in_specs=(specs, P(self.data_axes)),
      out_specs=(specs, P()),
    )(state, batch)

  def _replica_step(self, state: TrainState, batch):
    """The whole step on one replica (replicated params): the gradient, the
    exchange, then ``tx`` on this device's copy of the params.
    """
    grads, model_state, ex, loss, aux = self._replica_grads(
      state.params,
      state.model_state,
      state.exchange,
      state.key,
      state.count,
      batch,
    )
    params, opt_state, updates = self._apply(
      state.params, state.opt_state, grads, aux
    )
    count = _common.safe_increment(state.count)
    new = TrainState(params, opt_state, model_state, ex, state.key, count, None)
    return new, StepOutput(loss, aux, self._norms(grads, updates, params))

  def _every_step(self, param_shardings, state: TrainState, batch, mask):
    del mask  # Every-step mode has no outer step.
    # Sharded params are gathered for the gradient (FSDP): one all-gather
    # over dense_axis per sharded leaf, none for replicated ones.
    whole = jax.tree.map(
      lambda p: placement.constrain(p, self._replicated), state.params
    )
    specs = self._state_specs()
    grads_of = jax.shard_map(
      self._replica_grads,
      mesh=self.mesh,
      in_specs=(P(), P(), specs.exchange, P(), P(), P(self.data_axes)),
      out_specs=(P(), P(), specs.exchange, P(), P()),
    )
    grads, model_state, ex, loss, aux = grads_of(
      whole, state.model_state, state.exchange, state.key, state.count, batch
    )
    # The mean gradient (replicated) laid out as the params: a local slice.
    grads = jax.tree.map(placement.constrain, grads, param_shardings)
    params, opt_state, updates = self._apply(
      state.params, state.opt_state, grads, aux
    )
    new = TrainState(
      params,
      opt_state,
      model_state,
      ex,
      state.key,
      _common.safe_increment(state.count),
      None,
    )
    return new, StepOutput(loss, aux, self._norms(grads, updates, params))

  def _replica_grads(self, params, model_state, ex, key, count, batch):
    # Varying params: each replica differentiates its own loss, and no
    # implicit psum of the full gradient enters the program.
    params = jax.lax.pcast(params, self.data_axes, to="varying")
    (loss, (model_state, aux)), grads = jax.value_and_grad(
      self.loss_fn, has_aux=True
    )(params, model_state, batch, self._replica_key(key, count))
    if self._pre_axis is not None:  # Within a node: dense and fast.
      grads = jax.lax.pmean(grads, self._pre_axis)
    local = ex._replace(
      residual=_first(ex.residual), velocity=_first(ex.velocity)
    )
    grads, local = self.exchange(grads, local, self._exchange_axes)
    ex = local._replace(
      residual=_lead(local.residual), velocity=_lead(local.velocity)
    )
    model_state = replica_mean(model_state, self.data_axes)
    loss, aux = replica_mean((loss, aux), self.data_axes)
    return grads, model_state, ex, loss, aux

  def _replica_key(self, key: Any, count: jax.Array) -> Any:
    """Step ``count``'s key of this replica: ``fold_in(fold_in(key,
    count), replica)``.
    """
    if key is None:
      return None
    axes = self.data_axes if len(self.data_axes) > 1 else self.axis
    step_key = jax.random.fold_in(key, count)
    return jax.random.fold_in(step_key, jax.lax.axis_index(axes))

  def _apply(self, params, opt_state, grads, aux):
    extra = {} if self.extra_args is None else dict(self.extra_args(grads, aux))
    updates, opt_state = self.tx.update(grads, opt_state, params, **extra)
    return optax.apply_updates(params, updates), opt_state, updates

  def _norms(self, grads, updates, params) -> Any:
    if not self.norms:
      return None
    return {
      "grad_norm": optax.tree.norm(grads),
      "update_norm": optax.tree.norm(updates),
      "param_norm": optax.tree.norm(params),
    }

  # -- local-step mode ----------------------------------------------------------

  def _inner(self, params, opt_state, model_state, key, count, batch):
    """One inner step of this replica on its own copy (no exchange)."""
    (loss, (model_state, aux)), grads = jax.value_and_grad(
      self.loss_fn, has_aux=True
    )(params, model_state, batch, self._replica_key(key, count))
    if self.extra_args is not None:  # The optimizer reads the common aux.
      aux = replica_mean(aux, (self.axis,))
    params, opt_state, updates = self._apply(params, opt_state, grads, aux)
    norms = self._norms(grads, updates, params)
    return params, opt_state, model_state, (loss, aux, norms)

  def _sync_replica(self, parts, mask, inner_start=None):
    """The outer step on this replica's ``parts`` = ``(params, opt_state,
    model_state, exchange, outer)``.
    """
    params, opt_state, model_state, ex, outer = parts
    m = jnp.float32(1.0) if mask is None else mask[0]
    res = outer_lib.outer_exchange(
      outer,
      params,
      ex,
      self.axis,
      exchange=self.exchange,
      outer_tx=self.outer_tx,  # type: ignore[arg-type]
      participate=m,
    )
    if mask is None:
      shared = replica_mean(model_state, (self.axis,))
    else:  # The mean over the replicas that report (if any).
      k = jnp.maximum(res.reporting, 1.0)
      shared = jax.tree.map(
        lambda x: (
          jnp.where(
            res.reporting > 0,
            (jax.lax.psum(x * m.astype(x.dtype), self.axis) / k).astype(
              x.dtype
            ),
            x,
          )
          if jnp.issubdtype(x.dtype, jnp.inexact)
          else x
        ),
        model_state,
      )
    if inner_start is not None:  # A missing replica's round is lost.
      opt_state = outer_lib.where(m > 0, opt_state, inner_start)
    new = (res.start, opt_state, shared, res.exchange, res.outer)
    return _match_vma(new, parts, self.axis)

  def _unpack(self, state: TrainState):
    ex = state.exchange
    ex = ex._replace(residual=_first(ex.residual), velocity=_first(ex.velocity))
    return (
      _first(state.params),
      _first(state.opt_state),
      _first(state.model_state),
      ex,
      state.outer,
    )

  def _pack(self, parts, state: TrainState, count) -> TrainState:
    params, opt_state, model_state, ex, outer = parts
    ex = ex._replace(residual=_lead(ex.residual), velocity=_lead(ex.velocity))
    return TrainState(
      _lead(params),
      _lead(opt_state),
      _lead(model_state),
      ex,
      state.key,
      count,
      outer,
    )

  def _local_step(self, state: TrainState, batch, mask):
    params, opt_state, model_state, ex, outer = self._unpack(state)
    params, opt_state, model_state, out = self._inner(
      params, opt_state, model_state, state.key, state.count, batch
    )
    count = _common.safe_increment(state.count)
    parts = (params, opt_state, model_state, ex, outer)
    parts = jax.lax.cond(
      count % self.local_steps == 0,
      lambda p: self._sync_replica(p, mask),
      lambda p: p,
      parts,
    )
    out = replica_mean(out, (self.axis,))
    return self._pack(parts, state, count), StepOutput(*out)

  def _local_sync(self, state: TrainState, mask):
    parts = self._sync_replica(self._unpack(state), mask)
    return self._pack(parts, state, state.count)

  def _local_round(self, state: TrainState, batches, mask):
    params, opt_state, model_state, ex, outer = self._unpack(state)
    start = opt_state

    def body(carry, batch):
      params, opt_state, model_state, count = carry
      params, opt_state, model_state, out = self._inner(
        params, opt_state, model_state, state.key, count, batch
      )
      return (
        params,
        opt_state,
        model_state,
        _common.safe_increment(count),
      ), out

    carry = (params, opt_state, model_state, state.count)
    (params, opt_state, model_state, count), outs = jax.lax.scan(
      body, carry, batches
    )
    parts = self._sync_replica(
      (params, opt_state, model_state, ex, outer), mask, inner_start=start
    )
    out = jax.tree.map(lambda x: jnp.mean(x, axis=0), outs)
    out = replica_mean(out, (self.axis,))
    return self._pack(parts, state, count), StepOutput(*out)

  # -- views ----------------------------------------------------------------------

  def local_view(self, state: TrainState) -> TrainState:
    """A single-device copy of ``state`` on this process's first device.

    Every-step mode: the state itself (sharded leaves gathered). Local-step
    mode: the first replica's ``opt_state`` and ``model_state`` (the model
    states are equal after an outer step) and the *outer* parameters as
    ``params`` (the model the run has trained). ``exchange`` and ``outer``
    are dropped (None): this view is for evaluation and logging.
    """
    if self.local_steps:
      first = lambda t: jax.tree.map(lambda x: x.addressable_data(0)[0], t)
      return TrainState(
        _single(state.outer.params),
        first(state.opt_state),
        first(state.model_state),
        None,  # type: ignore[arg-type]
        None if state.key is None else _single(state.key),
        _single(state.count),
        None,
      )
    return TrainState(
      _single(state.params),
      _single(state.opt_state),
      _single(state.model_state),
      None,  # type: ignore[arg-type]
      None if state.key is None else _single(state.key),
      _single(state.count),
      None,
    )


def _single(tree: Any) -> Any:
  """``tree``'s leaves as whole arrays on this process's first device."""

  def one(x):
    if not x.is_fully_replicated:
      x = jax.jit(
        lambda v: v, out_shardings=NamedSharding(x.sharding.mesh, P())
      )(x)
    return x.addressable_data(0)

  return jax.tree.map(one, tree)


def _match_vma(new: Any, like: Any, axis: Any) -> Any:
  """``new`` cast to vary over ``axis`` where ``like`` does (the branches of
  a ``lax.cond`` must agree).
  """

  def cast(x, y):
    if _varying_axes(y, (axis,)) and not _varying_axes(x, (axis,)):
      return jax.lax.pcast(x, axis, to="varying")
    return x

  return jax.tree.map(cast, new, like)


def data_parallel(
  loss_fn: LossFn,
  tx: optax.GradientTransformation,
  mesh: Mesh,
  *,
  exchange: str | exchange_lib.Exchange = "dense",
  local_steps: int = 0,
  outer_tx: optax.GradientTransformation | None = None,
  axis: str = "data",
  dense_axis: str | None = None,
  extra_args: Callable[[Any, Any], dict] | None = None,
  norms: bool = False,
  donate: bool = True,
  compiler_options: dict | None = None,
  **options: Any,
) -> DataParallel:
  r"""The data-parallel runtime over ``mesh`` (module docstring).

  Args:
    loss_fn: ``loss_fn(params, model_state, batch, key) -> (loss,
      (model_state, aux))``, the loss of one replica's share of the batch.
    tx: the optax transformation of the parameters (in local-step mode: the
      inner optimizer of each replica).
    mesh: a :class:`jax.sharding.Mesh` whose axes are ``axis`` and, if set,
      ``dense_axis``; may span several processes (``jax.distributed``).
    exchange: a compressor name of the registry
      (:data:`~grpo_optax.training.EXCHANGES`) or an
      :class:`~grpo_optax.training.Exchange`: of the gradients every step,
      or in local-step mode of the parameter changes at the outer step.
    local_steps: 0 (exchange every step), or ``H`` >= 1 inner steps per
      outer step (DiLoCo).
    outer_tx: the outer optimizer of local-step mode (default: Nesterov SGD,
      lr 0.7, momentum 0.9).
    axis: the mesh axis of the exchange (the replicas).
    dense_axis: a second mesh axis averaged densely first (within a node);
      the params may be sharded over it (FSDP).
    extra_args: ``extra_args(grads, aux) -> dict`` of extra keyword
      arguments of ``tx.update`` (e.g. ``grpo``'s ``head_entropy``), from
      the replicas' mean ``aux``.
    norms: also return the gradient, update and parameter norms.
    donate: donate the state to the compiled step (in-place update).
    compiler_options: XLA options of the compiled programs (``jax.jit``'s).
    **options: the exchange's options
      (:func:`~grpo_optax.training.make_exchange`: ``fraction``,
      ``values``, ``momentum``, ...).

  Returns:
    A :class:`DataParallel`.

  Examples:
    >>> import jax, jax.numpy as jnp, numpy as np, optax
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> def loss_fn(p, stats, b, key):
    ...   del key
    ...   x, y = b
    ...   h = x @ p["w"]
    ...   stats = 0.9 * stats + 0.1 * jnp.mean(h)  # a running statistic
    ...   return jnp.mean((h - y) ** 2), (stats, {"mean": jnp.mean(h)})
    >>> dp = data_parallel(loss_fn, optax.sgd(0.1), mesh, exchange="dense")
    >>> state = dp.init({"w": jnp.zeros((4, 1))}, model_state=jnp.zeros(()))
    >>> x = np.ones((8 * jax.device_count(), 4), np.float32)
    >>> state, out = dp.step(state, (x, np.ones((len(x), 1), np.float32)))
    >>> float(out.loss), int(state.count)
    (1.0, 1)
  """
  return DataParallel(
    loss_fn,
    tx,
    mesh,
    exchange=exchange,
    local_steps=local_steps,
    outer_tx=outer_tx,
    axis=axis,
    dense_axis=dense_axis,
    extra_args=extra_args,
    norms=norms,
    donate=donate,
    compiler_options=compiler_options,
    **options,
  )


__all__ = (
  "DataParallel",
  "StepOutput",
  "TrainState",
  "data_parallel",
)
