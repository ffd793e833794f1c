"""Data-parallel training with a sparse gradient exchange (mechanism 10).

Each replica (a device, or a slice of a :class:`jax.sharding.Mesh` axis)
computes the gradient of its share of the global batch; the replicas then
*exchange* gradients so that all of them apply the same mean gradient to the
same parameters (replicated, or sharded FSDP-style within a node). JAX is
the distributed engine: a ``Mesh``, :func:`jax.shard_map` and its
collectives, and :func:`jax.distributed.initialize` to span several
processes (CPU: gloo collectives; GPU: NCCL).

Exchanges (:func:`sparse_pmean`, in :mod:`grpo_optax.training.exchange`;
the compressors in :mod:`grpo_optax.training.compression`): ``"dense"`` (one
all-reduce), ``"all_gather"`` (each replica's top-k, packed bytes, one
all-gather), ``"shared_support"`` (the same chunks on every replica, one
all-reduce; chosen from all-reduced norms or from replicated statistics at no
collective) and ``"powersgd"`` (rank-r, two all-reduces), with bf16/int8
values, compact indices, error feedback and Deep Gradient Compression's
momentum correction, masking, local clipping and sparsity warm-up. The
traffic law of each is in ``docs/communication.md``: under ring algorithms
an all-reduce of ``D`` bytes sends ``2 (W-1)/W D`` per device and an
all-gather ``(W-1)/W`` of its result, so the per-replica all-gather grows
with ``W`` and the shared support does not. :func:`collective_bytes` and
:func:`ring_traffic` read the bytes off a compiled program's HLO (XLA's
``cost_analysis()`` does not report them).

The pitfall (docs/design.md): inside ``shard_map``, the parameters are
replicated (invariant over the data axis) while the loss varies across
replicas; ``jax.grad`` then transposes the implicit broadcast into a psum of
the *full* gradient (and sums instead of averaging). The step below casts the
parameters to varying (``jax.lax.pcast(params, axes, to="varying")``) before
differentiating, so each replica gets its own local gradient and the only
collectives are the exchange's. A user with their own ``shard_map`` step does
the same and calls :func:`sparse_pmean`.

References:
  Lin, Han, Mao, Wang, Dally. Deep Gradient Compression: Reducing the
  Communication Bandwidth for Distributed Training. ICLR 2018.
  https://arxiv.org/abs/1712.01887

  Vogels, Karimireddy, Jaggi. PowerSGD: Practical Low-Rank Gradient
  Compression for Distributed Optimization. NeurIPS 2019.
  https://arxiv.org/abs/1905.13727

  Stich, Cordonnier, Jaggi. Sparsified SGD with Memory. NeurIPS 2018.
  https://arxiv.org/abs/1809.07599

  Patarasuk, Yuan. Bandwidth optimal all-reduce algorithms for clusters of
  workstations. J. Parallel Distrib. Comput. 2009 (ring all-reduce).
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

from grpo_optax.hlo import COLLECTIVES  # noqa: F401  (re-exported)
from grpo_optax.hlo import collective_bytes  # noqa: F401  (re-exported)
from grpo_optax.hlo import collective_ops  # noqa: F401  (re-exported)
from grpo_optax.hlo import ring_send_bytes  # noqa: F401  (re-exported)
from grpo_optax.hlo import ring_traffic  # noqa: F401  (re-exported)
from grpo_optax.training import exchange as exchange_lib
from grpo_optax.training.compression import num_kept  # noqa: F401  (re-exported)
from grpo_optax.training.exchange import EXCHANGES  # noqa: F401  (re-exported)
from grpo_optax.training.exchange import ExchangeState
from grpo_optax.training.exchange import init_exchange
from grpo_optax.training.exchange import sparse_pmean

__all__ = (
  "DataParallelState",
  "DataParallelStep",
  "EXCHANGES",
  "data_parallel_step",
  "sparse_pmean",
)

AxisName = Any  # A mesh axis name, or a tuple of them.


# -- chunk arithmetic (the benchmarks' traffic model) -------------------------


def chunk_width(size: int, chunk_size: int) -> int:
  """Entries per chunk of a leaf: ``chunk_size``, or the whole (smaller) leaf."""
  return max(1, min(chunk_size, size))


def num_chunks(size: int, chunk_size: int) -> int:
  """Chunks of :func:`chunk_width` entries covering a leaf of ``size``."""
  return -(-size // chunk_width(size, chunk_size))


# -- the step ----------------------------------------------------------------


class DataParallelState(NamedTuple):
  """State of :func:`data_parallel_step`.

  Attributes:
    params: the parameters, replicated on every device of the mesh, or
      sharded over ``dense_axis`` where :meth:`DataParallelStep.init` got
      them so.
    opt_state: the ``tx`` state, laid out as the params (replicated leaves
      that are not shaped like a parameter).
    residual: the error-feedback residuals, one per replica: each leaf has
      the parameter's shape with a leading axis of size ``W`` (the replicas
      of ``axis``), sharded along ``axis``. None for the dense exchange or
      without error feedback.
    exchange: the rest of the exchange's state (an :class:`ExchangeState`
      with ``residual=None``: the velocity of momentum correction, per
      replica like ``residual``; the step count, the replicated support,
      PowerSGD's ``Q``, replicated), or None for the dense exchange.
  """

  params: Any
  opt_state: Any
  residual: Any
  exchange: Any = None


def _to_global(x: Any, sharding: NamedSharding) -> Any:
  """``x`` as a global ``jax.Array`` with ``sharding``.

  NumPy (or host) values must hold the whole global value, the same on every
  process; each process supplies the shards of its own devices.
  """
  if isinstance(x, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  if isinstance(x, jax.Array):
    if x.sharding == sharding:
      return x
    # An equivalent sharding (the same devices and shards, e.g. one device's
    # SingleDeviceSharding on a 1-device mesh) is still put: on an Explicit
    # mesh the spec is part of the array's type, and shard_map checks it.
    if (
      jax.process_count() == 1
      or not x.is_fully_addressable
      or x.sharding.is_equivalent_to(sharding, x.ndim)
    ):
      return jax.device_put(x, sharding)
  if jax.process_count() == 1:
    return jax.device_put(x, sharding)
  dtype = getattr(x, "dtype", None)
  if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
    return jax.random.wrap_key_data(
      _to_global(jax.random.key_data(x), sharding), impl=jax.random.key_impl(x)
    )
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def _own(given: Any, shardings: Any, donate: bool) -> Any:
  """``given`` placed with ``shardings``, in buffers the caller does not hold.

  A donated step deletes the buffers of its state; a ``jax.Array`` that
  :func:`_to_global` kept (already laid out so) or re-wrapped (an equivalent
  sharding) is therefore copied, in one jitted program, so that the
  caller's arrays stay alive. NumPy values are placed into new buffers
  anyway.
  """
  placed = jax.tree.map(_to_global, given, shardings)
  if not donate or not any(
    isinstance(x, jax.Array) for x in jax.tree.leaves(given)
  ):
    return placed
  copy = lambda t: jax.tree.map(jnp.copy, t)
  return jax.jit(copy, out_shardings=shardings)(placed)


class DataParallelStep:
  """A jitted, donated data-parallel train step over a mesh.

  Build with :func:`data_parallel_step`. ``init(params)`` returns a
  :class:`DataParallelState`; ``step(state, batch) -> (state, loss)`` (with
  ``has_aux``: ``(state, (loss, aux))``) donates ``state``; ``lower(state,
  batch)`` returns the ``jax.stages.Lowered`` program for analysis
  (``.compile()``, :func:`collective_bytes`). ``shard_batch(batch)`` places
  a global batch on the mesh (``step`` does it for NumPy inputs).

  Attributes:
    mesh: the mesh.
    axis: the axis of the (sparse) exchange.
    dense_axis: the axis averaged densely first, or None.
    data_axes: the axes the batch is split over (``axis`` and
      ``dense_axis``).
    num_replicas: replicas of the sparse exchange (the size of ``axis``).
    exchange: as built (also ``fraction``, ``error_feedback``,
      ``chunk_size``).
  """

  def __init__(
    self,
    loss_fn,
    tx,
    mesh,
    *,
    axis,
    dense_axis,
    exchange,
    fraction,
    error_feedback,
    chunk_size,
    has_aux,
    donate,
    **options,
  ):
    if not callable(loss_fn):
      raise TypeError(f"`loss_fn` must be callable, got {type(loss_fn)}.")
    if not (hasattr(tx, "init") and hasattr(tx, "update")):
      raise TypeError(
        "`tx` must be an optax GradientTransformation (with "
        f"init and update), got {type(tx)}."
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
    data_axes = (axis,) if dense_axis is None else (axis, dense_axis)
    others = [n for n in names if n not in data_axes]
    if others:
      raise ValueError(
        f"the mesh's axes must all be data axes (`axis`, `dense_axis`); "
        f"got the extra axes {others} (model parallelism is not supported "
        "by this step)."
      )
    if not isinstance(error_feedback, bool):
      raise TypeError(
        f"`error_feedback` must be a bool, got {error_feedback!r}."
      )
    if not isinstance(has_aux, bool):
      raise TypeError(f"`has_aux` must be a bool, got {has_aux!r}.")
    if not isinstance(donate, bool):
      raise TypeError(f"`donate` must be a bool, got {donate!r}.")
    # Validates every exchange option (the same checks as sparse_pmean).
    cfg = exchange_lib._config(exchange, fraction, chunk_size, **options)  # pylint: disable=protected-access
    self.loss_fn, self.tx, self.mesh = loss_fn, tx, mesh
    self.axis, self.dense_axis, self.data_axes = axis, dense_axis, data_axes
    self.exchange, self.fraction = cfg.exchange, cfg.fraction
    self.chunk_size, self.options = cfg.chunk_size, dict(options)
    self.error_feedback = error_feedback and exchange != "dense"
    self.has_aux = has_aux
    self.num_replicas = mesh.shape[axis]
    self.num_devices = math.prod(mesh.shape[a] for a in data_axes)
    self._replicated = NamedSharding(mesh, P())
    self._per_replica = NamedSharding(mesh, P(axis))
    self._batch_sharding = NamedSharding(mesh, P(data_axes))
    # PartitionSpecs shaped like the state (_make: not the fields' types)
    ex_spec = (
      None
      if exchange == "dense"
      else ExchangeState._make((None, P(axis), P(), P(), P()))
    )
    # The default layout of the state; params (and their opt_state) may
    # also be sharded over dense_axis (FSDP within a node, see init).
    self._specs = DataParallelState(P(), P(), P(axis), ex_spec)
    # The gradient and the exchange per replica; tx runs after it on the
    # laid-out params (global view), so FSDP-sharded params and their state
    # stay sharded. Params enter replicated (_global_step gathers them).
    self._grads = jax.shard_map(
      self._local_grads,
      mesh=mesh,
      in_specs=(P(), P(axis), ex_spec, P(data_axes)),
      out_specs=(P(), P(axis), ex_spec, P()),
    )
    self._donate = donate
    self._steps: dict[Any, Any] = {}  # the jitted step per state layout

  # -- state and data -------------------------------------------------------

  def init(self, params: Any) -> DataParallelState:
    """Places ``params``, initialises ``tx`` and zero residuals.

    ``params`` must be the same on every process (e.g. from the same seed).
    A leaf sharded over ``dense_axis`` (a ``jax.Array`` with a
    ``NamedSharding`` on this mesh's axes: FSDP within a node) keeps its
    sharding, and so do the ``tx`` state leaves shaped like it; every
    other leaf is replicated. The step gathers such a leaf for the
    gradient and applies ``tx`` to the shards.

    The state owns its arrays: ``jax.Array`` leaves of ``params`` are
    copied (once, here), so the donated :meth:`step` never deletes the
    caller's ``params``.

    Raises:
      ValueError: if a leaf of ``params`` is sharded over ``axis`` (the
        exchange's, whose replicas each hold the whole parameters) or over
        an axis this mesh lacks.
    """
    shardings = jax.tree.map(self._param_sharding, params)
    params = _own(params, shardings, self._donate)
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
    if self.exchange == "dense":
      return DataParallelState(params, opt_state, None, None)
    w = self.num_replicas
    stack = lambda t: jax.tree.map(
      lambda x: jnp.broadcast_to(x, (w,) + x.shape), t
    )

    def make(p):
      # Replicated as in the step (the residuals are whole per replica).
      p = jax.tree.map(lambda x: _constrain(x, self._replicated), p)
      ex = init_exchange(
        p,
        exchange=self.exchange,
        error_feedback=self.error_feedback,
        momentum=self.options.get("momentum", 0.0),
        support=self.options.get("support", "norms"),
        chunk_size=self.chunk_size,
        rank=self.options.get("rank", 1),
      )
      return stack(ex.residual), ex._replace(
        residual=None, velocity=stack(ex.velocity)
      )

    shardings = (
      self._per_replica,
      # shardings shaped like the state (_make: not the fields' types)
      ExchangeState._make(
        (
          None,
          self._per_replica,
          self._replicated,
          self._replicated,
          self._replicated,
        )
      ),
    )
    residual, ex = jax.jit(make, out_shardings=shardings)(params)
    return DataParallelState(params, opt_state, residual, ex)

  def shard_batch(self, batch: Any) -> Any:
    """The global batch as arrays split along their leading axis.

    Args:
      batch: a pytree of arrays whose leading dimension (the global batch
        size) is divisible by the number of devices of the data axes: NumPy
        arrays holding the whole global batch (the same on every process),
        ``jax.Array`` values, or ``jax.ShapeDtypeStruct`` values (for
        :meth:`lower`).
    """
    for x in jax.tree.leaves(batch):
      shape = tuple(x.shape) if hasattr(x, "shape") else np.shape(x)
      if not shape or shape[0] % self.num_devices:
        raise ValueError(
          f"`batch` leaves need a leading dimension divisible by the "
          f"{self.num_devices} devices of the data axes {self.data_axes}; "
          f"got a leaf of shape {shape}."
        )
    return jax.tree.map(lambda x: _to_global(x, self._batch_sharding), batch)

  def step(self, state: DataParallelState, batch: Any):
    """One step on the global ``batch``; ``state`` is donated."""
    return self._compiled(state)(state, self.shard_batch(batch))

  __call__ = step

  def lower(self, state: DataParallelState, batch: Any) -> jax.stages.Lowered:
    """The lowered step (``.compile()``, ``.as_text()``) for ``state, batch``."""
    return self._compiled(state).lower(state, self.shard_batch(batch))

  # -- the program ----------------------------------------------------------

  def _param_sharding(self, x: Any) -> NamedSharding:
    """Where :meth:`init` puts a leaf of the params (see there)."""
    sharding = getattr(x, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if not isinstance(sharding, NamedSharding) or spec is None:
      return self._replicated
    used = {
      a
      for entry in spec
      if entry is not None
      for a in (entry if isinstance(entry, tuple) else (entry,))
    }
    if not used:
      return self._replicated
    if not used <= {self.dense_axis}:
      allowed = (
        "must be replicated (no `dense_axis` to shard them over)"
        if self.dense_axis is None
        else f"may be sharded over `dense_axis` ({self.dense_axis!r}) only"
      )
      raise ValueError(
        f"`params` has a leaf of shape {tuple(x.shape)} sharded as {spec} "
        f"on the mesh {dict(self.mesh.shape)}: params {allowed}, not over "
        f"`axis` ({self.axis!r}, the axis of the exchange, whose replicas "
        "each hold the whole parameters) or another axis."
      )
    return NamedSharding(self.mesh, spec)

  def _compiled(self, state: DataParallelState):
    """The jitted step for the layout of ``state`` (compiled once each)."""

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
      layout, self._specs, state, is_leaf=lambda x: isinstance(x, P)
    )
    key = (jax.tree.structure(shardings), tuple(jax.tree.leaves(shardings)))
    if key not in self._steps:
      self._steps[key] = jax.jit(
        functools.partial(self._global_step, shardings.params),
        in_shardings=(shardings, self._batch_sharding),
        out_shardings=(shardings, self._replicated),
        donate_argnums=(0,) if self._donate else (),
      )
    return self._steps[key]

  def _global_step(self, param_shardings, state: DataParallelState, batch):
    # Sharded params are gathered for the gradient (FSDP): one all-gather
    # over dense_axis per sharded leaf, none for replicated ones.
    whole = jax.tree.map(
      lambda p: _constrain(p, self._replicated), state.params
    )
    grads, residual, ex, value = self._grads(
      whole, state.residual, state.exchange, batch
    )
    # The mean gradient (replicated) laid out as the params: a local slice.
    grads = jax.tree.map(_constrain, grads, param_shardings)
    updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    return DataParallelState(new_params, opt_state, residual, ex), value

  def _local_grads(self, params, residual, ex, batch):
    # Varying params: each replica differentiates its own loss, and no
    # implicit psum of the full gradient enters the program.
    params = jax.lax.pcast(params, self.data_axes, to="varying")
    value, grads = jax.value_and_grad(self.loss_fn, has_aux=self.has_aux)(
      params, batch
    )
    if self.exchange == "dense":
      grads = jax.lax.pmean(grads, self.data_axes)
    else:
      if self.dense_axis is not None:  # Within a node: dense and fast.
        grads = jax.lax.pmean(grads, self.dense_axis)
      local = lambda t: jax.tree.map(lambda r: r[0], t)
      ex = ex._replace(residual=local(residual), velocity=local(ex.velocity))
      grads, ex = sparse_pmean(
        grads,
        ex,
        self.axis,
        exchange=self.exchange,
        fraction=self.fraction,
        chunk_size=self.chunk_size,
        **self.options,
      )
      stacked = lambda t: jax.tree.map(lambda r: r[None], t)
      residual = stacked(ex.residual)
      ex = ex._replace(residual=None, velocity=stacked(ex.velocity))
    value = jax.lax.pmean(value, self.data_axes)
    return grads, residual, ex, value


def _constrain(x: Any, sharding: NamedSharding) -> Any:
  """``x`` laid out with ``sharding`` (a reshard on an Explicit mesh)."""
  explicit = jax.sharding.AxisType.Explicit
  if any(t == explicit for t in sharding.mesh.axis_types):
    return jax.sharding.reshard(x, sharding)
  return jax.lax.with_sharding_constraint(x, sharding)


def data_parallel_step(
  loss_fn: Callable[[Any, Any], Any],
  tx: optax.GradientTransformation,
  mesh: Mesh,
  *,
  axis: str = "data",
  exchange: str = "dense",
  fraction: float = 0.3,
  error_feedback: bool = True,
  dense_axis: str | None = None,
  chunk_size: int = 64,
  has_aux: bool = False,
  donate: bool = True,
  values: str = "float32",
  indices: str = "int32",
  support: str = "norms",
  rank: int = 1,
  momentum: float = 0.0,
  mask_momentum: bool = True,
  clip_norm: float | None = None,
  warmup_steps: int = 0,
) -> DataParallelStep:
  r"""A data-parallel train step over ``mesh`` with a dense or sparse exchange.

  The global batch is split along its leading axis over the data axes; each
  replica computes :math:`g_i = \nabla \ell(\theta, B_i)` of its share with
  ``loss_fn``, the exchange (:func:`sparse_pmean`) gives every replica the
  same :math:`\bar g \approx \frac1W \sum_i g_i` (exact for ``"dense"``),
  and every replica applies ``tx`` to it: :math:`(u, s) = `
  ``tx.update(g_bar, s, theta)``, :math:`\theta \leftarrow \theta + u`.
  The returned loss is the mean of the replicas' losses (the global batch's
  loss when ``loss_fn`` is a mean over examples and shares are equal).

  With ``exchange="dense"`` the step equals single-device training on the
  global batch (the mean of equal shares' mean gradients is the global mean
  gradient). ``tx`` is any optax transformation; it runs after the exchange,
  on the params as laid out.

  Hierarchical form: on a 2-D mesh, e.g. ``Mesh(devices.reshape(nodes,
  per_node), ("node", "local"))``, ``axis="node", dense_axis="local"``
  averages densely within each node first, then runs the sparse exchange
  across nodes (one residual per node). There the params may be sharded
  over ``dense_axis`` (FSDP within a node): :meth:`DataParallelStep.init`
  keeps their shardings, the step gathers them for the gradient and applies
  ``tx`` to the shards (its state sharded likewise); the steps equal those
  on replicated params.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar`` (or ``(scalar, aux)``
      with ``has_aux``; ``aux`` is averaged over the replicas).
    tx: an optax transformation, e.g. ``grpo_optax.grpo()``.
    mesh: a :class:`jax.sharding.Mesh` whose axes are ``axis`` and, if set,
      ``dense_axis``; may span several processes (``jax.distributed``).
    axis: the mesh axis of the exchange.
    exchange: ``"dense"`` (pmean), ``"all_gather"``, ``"shared_support"``
      or ``"powersgd"``.
    fraction: kept fraction of each leaf for the sparse exchanges, in (0, 1].
    error_feedback: keep a per-replica residual of what was not sent.
    dense_axis: a second mesh axis averaged densely before the exchange.
    chunk_size: entries per chunk of ``"shared_support"``.
    has_aux: ``loss_fn`` returns ``(loss, aux)``.
    donate: donate the state to the compiled step (in-place update).
    values, indices, support, rank: the payload and compressor options of
      :func:`sparse_pmean`.
    momentum, mask_momentum, clip_norm, warmup_steps: Deep Gradient
      Compression's momentum correction, momentum factor masking, local
      clipping (bound ``clip_norm / sqrt(W)``) and sparsity warm-up (steps
      per stage), see :mod:`grpo_optax.training.exchange`. With momentum
      correction ``tx`` should carry no momentum (e.g. ``optax.sgd``).

  Returns:
    A :class:`DataParallelStep` with ``init``, ``step``, ``lower``.

  Examples:
    >>> import jax, jax.numpy as jnp, numpy as np, optax
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> loss_fn = lambda p, b: jnp.mean((b[0] @ p["w"] - b[1]) ** 2)
    >>> dp = data_parallel_step(loss_fn, optax.sgd(0.1), mesh,
    ...                         exchange="all_gather", fraction=0.5)
    >>> state = dp.init({"w": jnp.zeros((4, 1))})
    >>> x = np.ones((8 * jax.device_count(), 4), np.float32)
    >>> state, loss = dp.step(state, (x, np.ones((len(x), 1), np.float32)))
    >>> float(loss)
    1.0

  References:
    Lin et al., Deep Gradient Compression, ICLR 2018,
    https://arxiv.org/abs/1712.01887
  """
  return DataParallelStep(
    loss_fn,
    tx,
    mesh,
    axis=axis,
    dense_axis=dense_axis,
    exchange=exchange,
    fraction=fraction,
    error_feedback=error_feedback,
    chunk_size=chunk_size,
    has_aux=has_aux,
    donate=donate,
    values=values,
    indices=indices,
    support=support,
    rank=rank,
    momentum=momentum,
    mask_momentum=mask_momentum,
    clip_norm=clip_norm,
    warmup_steps=warmup_steps,
  )
