"""Data-parallel training with a sparse gradient exchange (mechanism 10).

Each replica (a device, or a slice of a :class:`jax.sharding.Mesh` axis)
computes the gradient of its share of the global batch; the replicas then
*exchange* gradients so that all of them apply the same mean gradient to the
same replicated parameters. JAX is the distributed engine: a ``Mesh``,
:func:`jax.shard_map` and its collectives, and :func:`jax.distributed.initialize`
to span several processes (CPU: gloo collectives; GPU: NCCL).

Exchanges (``a_i = g_i + r_i`` is replica ``i``'s gradient plus its own
error-feedback residual, ``W`` replicas, ``f`` the kept fraction):

* ``"dense"``: ``pmean(g_i)``, one all-reduce of every gradient entry.
* ``"all_gather"``: each replica keeps the ``k = ceil(f n)`` entries of each
  leaf with the largest ``|a_i|``; the values (fp32) and per-leaf int32
  indices of all leaves are packed into one buffer each, all-gathered, and
  scatter-added: ``mean = (1/W) sum_i scatter(idx_i, val_i)``.
* ``"shared_support"``: one index set common to all replicas, chosen from
  replicated information: each leaf is cut into chunks of ``chunk_size``
  entries (a smaller leaf is one chunk), the chunks' squared norms ``sum_i ||a_i[c]||^2`` are all-reduced
  (``n / chunk_size`` floats), and the ``ceil(f * num_chunks)`` chunks of
  largest norm are exchanged with one psum of their values.

With error feedback the entries not sent stay in the residual
(``r_i <- a_i - sent_i``) and are added to the next gradient, so nothing is
lost: after ``T`` steps, (sum of applied mean gradients) + (mean residual)
equals the sum of the mean gradients exactly (up to float rounding).

Traffic (ring algorithms, per device; ``D`` = dense gradient bytes):

* all-reduce of ``D`` bytes sends ``2 (W-1)/W D``;
* all-gather whose result holds ``W`` blocks of ``k`` fp32 values and ``k``
  int32 indices sends ``(W-1)/W * W k (4+4)`` bytes;

so ``all_gather bytes / dense bytes = W f (value bytes + index bytes) /
(2 * 4) = W f`` for fp32 + int32. The all-gather saves traffic only while
``W f < 1``: at the articles' ``f = 0.3`` only for ``W = 2``. The shared
support sends ``f + 1/chunk_size`` of the dense bytes for any ``W``.
:func:`collective_bytes` and :func:`ring_traffic` read the bytes off a
compiled program's HLO (XLA's ``cost_analysis()`` does not report them).

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

  Stich, Cordonnier, Jaggi. Sparsified SGD with Memory. NeurIPS 2018.
  https://arxiv.org/abs/1809.07599

  Patarasuk, Yuan. Bandwidth optimal all-reduce algorithms for clusters of
  workstations. J. Parallel Distrib. Comput. 2009 (ring all-reduce).
"""

from __future__ import annotations

import math
import operator
import re
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

#: The exchanges of :func:`sparse_pmean` and :func:`data_parallel_step`.
EXCHANGES = ("dense", "all_gather", "shared_support")

#: Collective kinds reported by :func:`collective_bytes`.
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
               "collective-permute")

AxisName = Any  # A mesh axis name, or a tuple of them.


# -- argument checks ---------------------------------------------------------


def _check_exchange(exchange: Any, *, sparse_only: bool = False) -> str:
  allowed = EXCHANGES[1:] if sparse_only else EXCHANGES
  if exchange not in allowed:
    raise ValueError(f"`exchange` must be one of {allowed}, got {exchange!r}.")
  return exchange


def _check_fraction(fraction: Any) -> float:
  try:
    f = float(fraction)
  except (TypeError, ValueError):
    raise ValueError(
        f"`fraction` must be a float in (0, 1], got {fraction!r}.") from None
  if not 0.0 < f <= 1.0:
    raise ValueError(f"`fraction` must be a float in (0, 1], got {f}.")
  return f


def _check_chunk_size(chunk_size: Any) -> int:
  if isinstance(chunk_size, bool):
    raise ValueError(f"`chunk_size` must be an int >= 1, got {chunk_size!r}.")
  try:
    c = operator.index(chunk_size)
  except TypeError:
    raise ValueError(
        f"`chunk_size` must be an int >= 1, got {chunk_size!r}.") from None
  if c < 1:
    raise ValueError(f"`chunk_size` must be an int >= 1, got {c}.")
  return c


# -- the exchange ------------------------------------------------------------


def num_kept(size: int, fraction: float) -> int:
  """``ceil(fraction * size)`` entries kept by the all-gather (0 if empty)."""
  if not size:
    return 0
  return min(size, max(1, math.ceil(fraction * size - 1e-9)))


def chunk_width(size: int, chunk_size: int) -> int:
  """Entries per chunk of a leaf: ``chunk_size``, or the whole (smaller) leaf."""
  return max(1, min(chunk_size, size))


def num_chunks(size: int, chunk_size: int) -> int:
  """Chunks of :func:`chunk_width` entries covering a leaf of ``size``."""
  return -(-size // chunk_width(size, chunk_size))


def _pack_dtype(leaves: Sequence[jax.Array]) -> Any:
  return jnp.result_type(jnp.float32, *[x.dtype for x in leaves])


def _all_gather_mean(accs, axis_name, fraction):
  """Top-k per leaf and replica, packed, all-gathered, scatter-added."""
  dtype = _pack_dtype(accs)
  flats = [a.reshape(-1) for a in accs]
  ks = [num_kept(x.size, fraction) for x in flats]
  vals, idxs = [], []
  for x, k in zip(flats, ks):
    if k == 0:
      continue
    _, idx = jax.lax.top_k(jnp.abs(x), k)
    idxs.append(idx.astype(jnp.int32))
    vals.append(x[idx].astype(dtype))
  if not vals:
    return [jnp.zeros(a.shape, a.dtype) for a in accs], list(accs)
  # One buffer of values and one of indices: two collectives for the model.
  all_vals = jax.lax.all_gather(jnp.concatenate(vals), axis_name,
                                to="invarying")   # (W, sum k)
  all_idxs = jax.lax.all_gather(jnp.concatenate(idxs), axis_name,
                                to="invarying")
  replicas = all_vals.shape[0]
  means, residuals, offset, j = [], [], 0, 0
  for a, x, k in zip(accs, flats, ks):
    if k == 0:   # An empty leaf.
      means.append(jnp.zeros(a.shape, a.dtype))
      residuals.append(a)
      continue
    v = all_vals[:, offset:offset + k].reshape(-1)
    i = all_idxs[:, offset:offset + k].reshape(-1)
    total = jnp.zeros(x.shape, dtype).at[i].add(v)
    means.append((total / replicas).astype(a.dtype).reshape(a.shape))
    residuals.append(x.at[idxs[j]].set(0).reshape(a.shape))
    offset += k
    j += 1
  return means, residuals


def _shared_support_mean(accs, axis_name, fraction, chunk_size):
  """Chunks chosen from all-reduced chunk norms, exchanged by one psum."""
  dtype = _pack_dtype(accs)
  chunked, scores = [], []
  for a in accs:
    n = a.size
    if n == 0:
      chunked.append(None)
      continue
    m, width = num_chunks(n, chunk_size), chunk_width(n, chunk_size)
    c = a.reshape(-1)
    if m * width != n:
      c = jnp.pad(c, (0, m * width - n))
    c = c.reshape(m, width)
    chunked.append(c)
    scores.append(jnp.sum(jnp.square(c.astype(dtype)), axis=1))
  if not scores:
    return [jnp.zeros(a.shape, a.dtype) for a in accs], list(accs)
  # Replicated information: every replica holds the same summed norms, so
  # every replica picks the same chunks.
  scores = jax.lax.psum(jnp.concatenate(scores), axis_name)
  picks, sent, offset = [], [], 0
  for c in chunked:
    if c is None:
      picks.append(None)
      continue
    m = c.shape[0]
    kc = num_kept(m, fraction)
    _, idx = jax.lax.top_k(scores[offset:offset + m], kc)
    offset += m
    picks.append(idx)
    sent.append(c[idx].astype(dtype).reshape(-1))
  summed = jax.lax.pmean(jnp.concatenate(sent), axis_name)   # one all-reduce
  means, residuals, offset = [], [], 0
  for a, c, idx in zip(accs, chunked, picks):
    if c is None:   # An empty leaf.
      means.append(jnp.zeros(a.shape, a.dtype))
      residuals.append(a)
      continue
    kc, width = idx.shape[0], c.shape[1]
    block = summed[offset:offset + kc * width].reshape(kc, width)
    offset += kc * width
    mean = jnp.zeros(c.shape, dtype).at[idx].set(block)
    means.append(mean.reshape(-1)[:a.size].astype(a.dtype).reshape(a.shape))
    residuals.append(c.at[idx].set(0).reshape(-1)[:a.size].reshape(a.shape))
  return means, residuals


def sparse_pmean(grads: Any, residual: Any, axis_name: AxisName, *,
                 exchange: str = "all_gather", fraction: float = 0.3,
                 chunk_size: int = 64) -> tuple[Any, Any]:
  r"""Mean of the replicas' gradients through a sparse exchange.

  Call it inside :func:`jax.shard_map` (or any context where ``axis_name``
  is bound), with ``grads`` each replica's own gradient (differentiate
  parameters cast to varying, see the module docstring). With
  :math:`a_i = g_i + r_i`:

  * ``"all_gather"``: :math:`S_i` = the ``ceil(fraction * n)`` entries of
    largest :math:`|a_i|` per leaf; out :math:`= \frac1W \sum_i a_i[S_i]`
    (scattered into zeros), :math:`r_i \leftarrow a_i` with :math:`S_i`
    zeroed.
  * ``"shared_support"``: :math:`S` = the ``ceil(fraction * m)`` of the
    :math:`m` chunks of ``chunk_size`` entries (a smaller leaf is one
    chunk) with largest
    :math:`\sum_i \|a_i[c]\|^2` (all-reduced); out :math:`= \frac1W \sum_i
    a_i[S]`; :math:`r_i \leftarrow a_i` with :math:`S` zeroed.
  * ``"dense"``: out :math:`= \frac1W \sum_i a_i`, residual zero.

  Values travel in float32 (or the widest float dtype of ``grads``),
  indices in int32; outputs have each leaf's dtype and are the same on
  every replica (invariant over ``axis_name``).

  Args:
    grads: this replica's gradient (a pytree of float arrays).
    residual: this replica's error-feedback residual (same structure), or
      None for no error feedback (entries not sent are dropped).
    axis_name: the mesh axis (or tuple of axes) the replicas span.
    exchange: ``"all_gather"``, ``"shared_support"`` or ``"dense"``.
    fraction: kept fraction of each leaf (or of its chunks), in (0, 1].
    chunk_size: entries per chunk for ``"shared_support"``.

  Returns:
    ``(mean, new_residual)``; ``new_residual`` is None when ``residual`` is.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> def f(g):
    ...   return sparse_pmean({"w": g}, None, "data", fraction=0.5)[0]["w"]
    >>> jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P())(
    ...     jnp.array([3., -1., 0.5, -4.]))
    Array([ 3.,  0.,  0., -4.], dtype=float32)
  """
  exchange = _check_exchange(exchange)
  fraction = _check_fraction(fraction)
  chunk_size = _check_chunk_size(chunk_size)
  leaves, treedef = jax.tree.flatten(grads)
  if residual is not None:
    r_leaves, r_def = jax.tree.flatten(residual)
    if r_def != treedef:
      raise ValueError("`residual` must have the structure of `grads`; got "
                       f"{r_def}, grads have {treedef}.")
    leaves = [g + r.astype(g.dtype) for g, r in zip(leaves, r_leaves)]
  for x in leaves:
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"`grads` must hold float arrays, got {x.dtype}.")
    if x.size >= 2**31:
      raise ValueError(f"a `grads` leaf has {x.size} entries; int32 indices "
                       "address at most 2**31 - 1: split the leaf.")
  if exchange == "dense":
    means = jax.lax.pmean(leaves, axis_name)
    residuals = [jnp.zeros_like(x) for x in leaves]
  elif exchange == "all_gather":
    means, residuals = _all_gather_mean(leaves, axis_name, fraction)
  else:
    means, residuals = _shared_support_mean(leaves, axis_name, fraction,
                                            chunk_size)
  mean = treedef.unflatten(means)
  if residual is None:
    return mean, None
  return mean, treedef.unflatten(
      [r.astype(x.dtype) for r, x in zip(residuals, r_leaves)])


# -- the step ----------------------------------------------------------------


class DataParallelState(NamedTuple):
  """State of :func:`data_parallel_step`.

  Attributes:
    params: the parameters, replicated on every device of the mesh.
    opt_state: the ``tx`` state, replicated.
    residual: the error-feedback residuals, one per replica: each leaf has
      the parameter's shape with a leading axis of size ``W`` (the replicas
      of ``axis``), sharded along ``axis``. None for the dense exchange or
      without error feedback.
  """
  params: Any
  opt_state: Any
  residual: Any


def _to_global(x: Any, sharding: NamedSharding) -> Any:
  """``x`` as a global ``jax.Array`` with ``sharding``.

  NumPy (or host) values must hold the whole global value, the same on every
  process; each process supplies the shards of its own devices.
  """
  if isinstance(x, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  if isinstance(x, jax.Array):
    if x.sharding.is_equivalent_to(sharding, x.ndim):
      return x
    if jax.process_count() == 1 or not x.is_fully_addressable:
      return jax.device_put(x, sharding)
  if jax.process_count() == 1:
    return jax.device_put(x, sharding)
  dtype = getattr(x, "dtype", None)
  if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
    return jax.random.wrap_key_data(
        _to_global(jax.random.key_data(x), sharding),
        impl=jax.random.key_impl(x))
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


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
    exchange, fraction, error_feedback, chunk_size: as built.
  """

  def __init__(self, loss_fn, tx, mesh, *, axis, dense_axis, exchange,
               fraction, error_feedback, chunk_size, has_aux, donate):
    if not callable(loss_fn):
      raise TypeError(f"`loss_fn` must be callable, got {type(loss_fn)}.")
    if not (hasattr(tx, "init") and hasattr(tx, "update")):
      raise TypeError("`tx` must be an optax GradientTransformation (with "
                      f"init and update), got {type(tx)}.")
    if not isinstance(mesh, Mesh):
      raise TypeError(f"`mesh` must be a jax.sharding.Mesh, got {type(mesh)}.")
    names = tuple(mesh.axis_names)
    if axis not in names:
      raise ValueError(f"`axis` must be one of the mesh's axes {names}, got "
                       f"{axis!r}.")
    if dense_axis is not None and (dense_axis not in names
                                   or dense_axis == axis):
      raise ValueError(f"`dense_axis` must be None or one of the mesh's axes "
                       f"{names} other than `axis` ({axis!r}), got "
                       f"{dense_axis!r}.")
    data_axes = (axis,) if dense_axis is None else (axis, dense_axis)
    others = [n for n in names if n not in data_axes]
    if others:
      raise ValueError(
          f"the mesh's axes must all be data axes (`axis`, `dense_axis`); "
          f"got the extra axes {others} (model parallelism is not supported "
          "by this step).")
    if not isinstance(error_feedback, bool):
      raise TypeError(f"`error_feedback` must be a bool, got "
                      f"{error_feedback!r}.")
    if not isinstance(has_aux, bool):
      raise TypeError(f"`has_aux` must be a bool, got {has_aux!r}.")
    self.loss_fn, self.tx, self.mesh = loss_fn, tx, mesh
    self.axis, self.dense_axis, self.data_axes = axis, dense_axis, data_axes
    self.exchange = _check_exchange(exchange)
    self.fraction = _check_fraction(fraction)
    self.chunk_size = _check_chunk_size(chunk_size)
    self.error_feedback = error_feedback and exchange != "dense"
    self.has_aux = has_aux
    self.num_replicas = mesh.shape[axis]
    self.num_devices = math.prod(mesh.shape[a] for a in data_axes)
    self._replicated = NamedSharding(mesh, P())
    self._per_replica = NamedSharding(mesh, P(axis))
    self._batch_sharding = NamedSharding(mesh, P(data_axes))
    specs = DataParallelState(P(), P(), P(axis))
    mapped = jax.shard_map(self._local_step, mesh=mesh,
                           in_specs=(specs, P(data_axes)),
                           out_specs=(specs, P()))
    self._step = jax.jit(mapped, donate_argnums=(0,) if donate else ())

  # -- state and data -------------------------------------------------------

  def init(self, params: Any) -> DataParallelState:
    """Replicates ``params``, initialises ``tx`` and zero residuals.

    ``params`` must be the same on every process (e.g. from the same seed).
    """
    params = jax.tree.map(lambda x: _to_global(x, self._replicated), params)
    opt_state = jax.jit(self.tx.init,
                        out_shardings=self._replicated)(params)
    residual = None
    if self.error_feedback:
      w = self.num_replicas
      residual = jax.jit(
          lambda p: jax.tree.map(
              lambda x: jnp.zeros((w,) + x.shape, x.dtype), p),
          out_shardings=self._per_replica)(params)
    return DataParallelState(params, opt_state, residual)

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
            f"got a leaf of shape {shape}.")
    return jax.tree.map(lambda x: _to_global(x, self._batch_sharding), batch)

  def step(self, state: DataParallelState, batch: Any):
    """One step on the global ``batch``; ``state`` is donated."""
    return self._step(state, self.shard_batch(batch))

  __call__ = step

  def lower(self, state: DataParallelState, batch: Any) -> jax.stages.Lowered:
    """The lowered step (``.compile()``, ``.as_text()``) for ``state, batch``."""
    return self._step.lower(state, self.shard_batch(batch))

  # -- the program ----------------------------------------------------------

  def _local_step(self, state: DataParallelState, batch: Any):
    # Varying params: each replica differentiates its own loss, and no
    # implicit psum of the full gradient enters the program.
    params = jax.lax.pcast(state.params, self.data_axes, to="varying")
    value, grads = jax.value_and_grad(self.loss_fn, has_aux=self.has_aux)(
        params, batch)
    residual = state.residual
    if self.exchange == "dense":
      grads = jax.lax.pmean(grads, self.data_axes)
    else:
      if self.dense_axis is not None:   # Within a node: dense and fast.
        grads = jax.lax.pmean(grads, self.dense_axis)
      if residual is not None:
        residual = jax.tree.map(lambda r: r[0], residual)
      grads, residual = sparse_pmean(
          grads, residual, self.axis, exchange=self.exchange,
          fraction=self.fraction, chunk_size=self.chunk_size)
      if residual is not None:
        residual = jax.tree.map(lambda r: r[None], residual)
    updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    value = jax.lax.pmean(value, self.data_axes)
    return DataParallelState(new_params, opt_state, residual), value


def data_parallel_step(loss_fn: Callable[[Any, Any], Any],
                       tx: optax.GradientTransformation,
                       mesh: Mesh, *, axis: str = "data",
                       exchange: str = "dense", fraction: float = 0.3,
                       error_feedback: bool = True,
                       dense_axis: str | None = None, chunk_size: int = 64,
                       has_aux: bool = False,
                       donate: bool = True) -> DataParallelStep:
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
  gradient). ``tx`` is any optax transformation; it runs replicated, after
  the exchange.

  Hierarchical form: on a 2-D mesh, e.g. ``Mesh(devices.reshape(nodes,
  per_node), ("node", "local"))``, ``axis="node", dense_axis="local"``
  averages densely within each node first, then runs the sparse exchange
  across nodes (one residual per node).

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar`` (or ``(scalar, aux)``
      with ``has_aux``; ``aux`` is averaged over the replicas).
    tx: an optax transformation, e.g. ``grpo_optax.grpo()``.
    mesh: a :class:`jax.sharding.Mesh` whose axes are ``axis`` and, if set,
      ``dense_axis``; may span several processes (``jax.distributed``).
    axis: the mesh axis of the exchange.
    exchange: ``"dense"`` (pmean), ``"all_gather"`` or ``"shared_support"``.
    fraction: kept fraction of each leaf for the sparse exchanges, in (0, 1].
    error_feedback: keep a per-replica residual of what was not sent.
    dense_axis: a second mesh axis averaged densely before the exchange.
    chunk_size: entries per chunk of ``"shared_support"``.
    has_aux: ``loss_fn`` returns ``(loss, aux)``.
    donate: donate the state to the compiled step (in-place update).

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
  return DataParallelStep(loss_fn, tx, mesh, axis=axis, dense_axis=dense_axis,
                          exchange=exchange, fraction=fraction,
                          error_feedback=error_feedback,
                          chunk_size=chunk_size, has_aux=has_aux,
                          donate=donate)


# -- bytes in a compiled program ---------------------------------------------

_DTYPE_BYTES = {
    "pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1,
    "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "s16": 2,
    "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8,
    "u64": 8, "f64": 8, "c64": 8, "c128": 16, "token": 0,
}
_KINDS = "|".join(COLLECTIVES)
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.*?)\s+"
    rf"(?P<kind>{_KINDS})(?P<phase>-start|-done)?\((?P<rest>.*)$")
_OPERAND = re.compile(r"%([\w.\-]+)")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{(\{[0-9,]*\})")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_PARTITIONS = re.compile(r"num_partitions=(\d+)")


def _shape_bytes(shape: str) -> int:
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
    size = math.prod(int(d) for d in dims.split(",") if d)
    total += size * _DTYPE_BYTES.get(dtype, 0)
  return total


def _group_size(attrs: str, default: int) -> int:
  m = _GROUPS_IOTA.search(attrs)
  if m:
    return int(m.group(2))
  m = _GROUPS_LIST.search(attrs)
  if m and m.group(1) != "{}":
    return len(m.group(1).strip("{}").split(","))
  return default


def _hlo_text(compiled: Any) -> str:
  if isinstance(compiled, str):
    return compiled
  if isinstance(compiled, jax.stages.Lowered):
    compiled = compiled.compile()
  return compiled.as_text()


def collective_ops(compiled: Any) -> list[tuple[str, int, int]]:
  """The collectives of a compiled program: ``(kind, result bytes, group)``.

  An asynchronous pair (``all-gather-start`` / ``all-gather-done``) is one
  op: its bytes are the ``-done`` result's, its group the ``-start``'s
  ``replica_groups``. Ops inside loops or called computations count once
  (the program text is read, not executed).

  Args:
    compiled: a ``jax.stages.Compiled`` or ``Lowered`` program, or HLO text.

  Returns:
    One ``(kind, bytes, group_size)`` per collective, in program order.
  """
  text = _hlo_text(compiled)
  m = _PARTITIONS.search(text)
  default_group = int(m.group(1)) if m else 1
  starts: dict[str, str] = {}
  ops = []
  for line in text.splitlines():
    m = _INSTR.match(line)
    if m is None:
      continue
    kind, phase = m.group("kind"), m.group("phase")
    attrs = m.group("rest")
    if phase == "-start":
      starts[m.group("name")] = attrs
      continue
    if phase == "-done":
      operand = _OPERAND.search(attrs)
      attrs = starts.get(operand.group(1), "") if operand else ""
    ops.append((kind, _shape_bytes(m.group("shape")),
                _group_size(attrs, default_group)))
  return ops


def collective_bytes(compiled: Any) -> dict[str, int]:
  """Result bytes of each collective kind in a compiled program's HLO.

  XLA's ``cost_analysis()`` does not report communication; this reads the
  collectives off ``compiled.as_text()``: for each of ``"all-reduce"``,
  ``"all-gather"``, ``"reduce-scatter"``, ``"all-to-all"`` and
  ``"collective-permute"``, the sum of the result sizes (bytes per device)
  of its ops, counting an asynchronous start/done pair once.

  Args:
    compiled: a ``jax.stages.Compiled`` or ``Lowered`` program, or HLO text.

  Returns:
    A dict with every kind (0 when absent).

  Examples:
    >>> hlo = "\\n".join([
    ...     "%s = (f32[10], f32[80]) all-gather-start(%x), dimensions={0}",
    ...     "%d = f32[80]{0} all-gather-done((f32[10], f32[80]) %s)",
    ...     "%r = f32[] all-reduce(%y), replica_groups={{0,1}}, to_apply=%add"])
    >>> collective_bytes(hlo)
    {'all-reduce': 4, 'all-gather': 320, 'reduce-scatter': 0, 'all-to-all': 0, 'collective-permute': 0}
  """
  totals = dict.fromkeys(COLLECTIVES, 0)
  for kind, size, _ in collective_ops(compiled):
    totals[kind] += size
  return totals


def ring_send_bytes(kind: str, size: float, group: int) -> float:
  """Bytes one device sends for one collective under a ring algorithm.

  For result ``size`` bytes over a group of ``group`` devices: all-reduce
  ``2 (g-1)/g size``; all-gather and all-to-all ``(g-1)/g size``;
  reduce-scatter ``(g-1) size``; collective-permute ``size``. This is the
  bandwidth term of the standard ring algorithms (Patarasuk and Yuan, 2009),
  the model behind the traffic law in the module docstring.
  """
  g = max(int(group), 1)
  if kind == "all-reduce":
    return 2 * (g - 1) / g * size
  if kind in ("all-gather", "all-to-all"):
    return (g - 1) / g * size
  if kind == "reduce-scatter":
    return (g - 1) * size
  if kind == "collective-permute":
    return float(size)
  raise ValueError(f"`kind` must be one of {COLLECTIVES}, got {kind!r}.")


def ring_traffic(compiled: Any) -> dict[str, float]:
  """Bytes each device sends per collective kind, for ring algorithms.

  Sums :func:`ring_send_bytes` over the program's collectives (each with its
  own group size, from ``replica_groups``).

  Args:
    compiled: a ``jax.stages.Compiled`` or ``Lowered`` program, or HLO text.

  Returns:
    A dict with every kind of :data:`COLLECTIVES` and ``"total"``.
  """
  totals = dict.fromkeys(COLLECTIVES, 0.0)
  for kind, size, group in collective_ops(compiled):
    totals[kind] += ring_send_bytes(kind, size, group)
  totals["total"] = sum(totals[k] for k in COLLECTIVES)
  return totals
