"""Data-parallel training with a plain ``loss_fn(params, batch)`` (mechanism 10).

:func:`data_parallel_step` is the runtime
(:class:`~grpo_optax.training.DataParallel`) for a loss without
model state or PRNG key: each replica (a device, or a slice of a
:class:`jax.sharding.Mesh` axis) computes the gradient of its share of the
global batch, the exchange gives all of them the same mean gradient, and
each applies ``tx`` to the same parameters (replicated, or sharded
FSDP-style within a node). JAX is the distributed engine: a ``Mesh``,
:func:`jax.shard_map` and its collectives, and
:func:`jax.distributed.initialize` to span several processes (CPU: gloo
collectives; GPU: NCCL).

The exchanges are the compressors of :mod:`grpo_optax.training.compressors`
(``"dense"``, ``"all_gather"``, ``"shared_support"``, ``"powersgd"``,
``"int8"``) with error feedback and Deep Gradient Compression's momentum
correction, masking, local clipping and sparsity warm-up
(:mod:`grpo_optax.training.exchange`); their traffic laws are in
``docs/communication.md``, and :func:`~grpo_optax.hlo.collective_bytes` /
:func:`~grpo_optax.hlo.ring_traffic` read the bytes off a compiled program.

The pitfall (docs/design.md): inside ``shard_map``, the parameters are
replicated (invariant over the data axis) while the loss varies across
replicas; ``jax.grad`` then transposes the implicit broadcast into a psum of
the *full* gradient (and sums instead of averaging). The runtime casts the
parameters to varying (``jax.lax.pcast(params, axes, to="varying")``) before
differentiating, so each replica gets its own local gradient and the only
collectives are the exchange's. A user with their own ``shard_map`` step does
the same and calls :func:`~grpo_optax.training.sparse_pmean`.

References:
  Lin, Han, Mao, Wang, Dally. Deep Gradient Compression: Reducing the
  Communication Bandwidth for Distributed Training. ICLR 2018.
  https://arxiv.org/abs/1712.01887

  Vogels, Karimireddy, Jaggi. PowerSGD: Practical Low-Rank Gradient
  Compression for Distributed Optimization. NeurIPS 2019.
  https://arxiv.org/abs/1905.13727

  Patarasuk, Yuan. Bandwidth optimal all-reduce algorithms for clusters of
  workstations. J. Parallel Distrib. Comput. 2009 (ring all-reduce).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax
from jax.sharding import Mesh

from grpo_optax.training import _tree
from grpo_optax.training import exchange as exchange_lib
from grpo_optax.training import runtime

#: The state of :func:`data_parallel_step`: the runtime's
#: :class:`~grpo_optax.training.TrainState` (``residual`` reads
#: ``exchange.residual``).
DataParallelState = runtime.TrainState


class DataParallelStep:
  """A jitted, donated data-parallel train step over a mesh.

  Build with :func:`data_parallel_step`. ``init(params)`` returns a
  :class:`~grpo_optax.training.TrainState`; ``step(state, batch) -> (state,
  loss)`` (with ``has_aux``: ``(state, (loss, aux))``) donates ``state``;
  ``lower(state, batch)`` returns the ``jax.stages.Lowered`` program for
  analysis (``.compile()``, :func:`~grpo_optax.hlo.collective_bytes`).
  ``shard_batch(batch)`` places a global batch on the mesh (``step`` does it
  for NumPy inputs). A thin wrapper of
  :class:`~grpo_optax.training.DataParallel` (``runtime``).

  Attributes:
    runtime: the :class:`~grpo_optax.training.DataParallel` it wraps.
    mesh: the runtime's (also ``axis``, ``dense_axis``, ``data_axes``,
      ``num_replicas``, ``num_devices``).
    exchange: the exchange's name (its options: ``fraction``,
      ``chunk_size``, None where the compressor takes none; ``options``,
      all of them).
    error_feedback: whether the state keeps residuals.
  """

  def __init__(self, loss_fn, tx, mesh, *, has_aux, **kwargs):
    if not callable(loss_fn):
      raise TypeError(f"`loss_fn` must be callable, got {type(loss_fn)}.")
    _tree.check_flag("has_aux", has_aux)

    def canonical(params, model_state, batch, key):
      del key
      out: Any = loss_fn(params, batch)
      if has_aux:
        return out[0], (model_state, out[1])
      return out, (model_state, None)

    self.runtime = runtime.DataParallel(canonical, tx, mesh, **kwargs)
    self.has_aux = has_aux
    rt = self.runtime
    self.loss_fn, self.tx, self.mesh = loss_fn, tx, mesh
    self.axis, self.dense_axis, self.data_axes = (
      rt.axis,
      rt.dense_axis,
      rt.data_axes,
    )
    self.num_replicas, self.num_devices = rt.num_replicas, rt.num_devices
    config = rt.exchange.compressor.config
    self.exchange = rt.exchange.name
    self.fraction = config.get("fraction")
    self.chunk_size = config.get("chunk_size")
    self.options = rt.exchange.options()
    self.error_feedback = rt.exchange.keeps_residual
    self._batch_sharding = rt.batch_sharding

  def init(self, params: Any) -> runtime.TrainState:
    """Places ``params``, initialises ``tx`` and the exchange's state.

    ``params`` must be the same on every process (e.g. from the same seed).
    A leaf sharded over ``dense_axis`` keeps its sharding (FSDP within a
    node); the state owns its arrays (see
    :meth:`~grpo_optax.training.DataParallel.init`).
    """
    return self.runtime.init(params)

  def shard_batch(self, batch: Any) -> Any:
    """The global batch as arrays split along their leading axis."""
    return self.runtime.shard_batch(batch)

  def step(self, state: runtime.TrainState, batch: Any):
    """One step on the global ``batch``; ``state`` is donated."""
    state, out = self.runtime.step(state, batch)
    return state, ((out.loss, out.aux) if self.has_aux else out.loss)

  __call__ = step

  def lower(self, state: runtime.TrainState, batch: Any) -> jax.stages.Lowered:
    """The lowered step (``.compile()``, ``.as_text()``) for ``state, batch``."""
    return self.runtime.lower(state, batch)


def data_parallel_step(
  loss_fn: Callable[[Any, Any], Any],
  tx: optax.GradientTransformation,
  mesh: Mesh,
  *,
  axis: str = "data",
  exchange: str | exchange_lib.Exchange = "dense",
  dense_axis: str | None = None,
  has_aux: bool = False,
  donate: bool = True,
  **options: Any,
) -> DataParallelStep:
  r"""A data-parallel train step over ``mesh`` with a dense or sparse exchange.

  The global batch is split along its leading axis over the data axes; each
  replica computes :math:`g_i = \nabla \ell(\theta, B_i)` of its share with
  ``loss_fn``, the exchange (:func:`~grpo_optax.training.sparse_pmean`)
  gives every replica the same :math:`\bar g \approx \frac1W \sum_i g_i`
  (exact for ``"dense"``), and every replica applies ``tx`` to it:
  :math:`(u, s) =` ``tx.update(g_bar, s, theta)``, :math:`\theta
  \leftarrow \theta + u`. The returned loss is the mean of the replicas'
  losses (the global batch's loss when ``loss_fn`` is a mean over examples
  and shares are equal).

  With ``exchange="dense"`` the step equals single-device training on the
  global batch. ``tx`` is any optax transformation; it runs after the
  exchange, on the params as laid out. For model state (BatchNorm), a PRNG
  key per replica or local steps, use
  :func:`~grpo_optax.training.data_parallel` (this is that runtime with a
  plain loss).

  Hierarchical form: on a 2-D mesh, e.g. ``Mesh(devices.reshape(nodes,
  per_node), ("node", "local"))``, ``axis="node", dense_axis="local"``
  averages densely within each node first, then runs the sparse exchange
  across nodes (one residual per node). There the params may be sharded
  over ``dense_axis`` (FSDP within a node): ``init`` keeps their shardings,
  the step gathers them for the gradient and applies ``tx`` to the shards
  (its state sharded likewise); the steps equal those on replicated params.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar`` (or ``(scalar, aux)``
      with ``has_aux``; ``aux`` is averaged over the replicas).
    tx: an optax transformation, e.g. ``grpo_optax.grpo()``.
    mesh: a :class:`jax.sharding.Mesh` whose axes are ``axis`` and, if set,
      ``dense_axis``; may span several processes (``jax.distributed``).
    axis: the mesh axis of the exchange.
    exchange: a compressor name (:data:`~grpo_optax.training.EXCHANGES`) or
      an :class:`~grpo_optax.training.Exchange`.
    dense_axis: a second mesh axis averaged densely before the exchange.
    has_aux: ``loss_fn`` returns ``(loss, aux)``.
    donate: donate the state to the compiled step (in-place update).
    **options: the exchange's options
      (:func:`~grpo_optax.training.make_exchange`): the compressor's
      (``fraction``, ``values``,
      ``indices``, ``chunk_size``, ``support``, ``rank``) and
      ``error_feedback``, Deep Gradient Compression's ``momentum``,
      ``mask_momentum``, ``clip_norm`` (bound ``clip_norm / sqrt(W)``) and
      ``warmup_steps``. With momentum correction ``tx`` should carry no
      momentum (e.g. ``optax.sgd``).

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
    has_aux=has_aux,
    axis=axis,
    exchange=exchange,
    dense_axis=dense_axis,
    donate=donate,
    **options,
  )


__all__ = ("DataParallelState", "DataParallelStep", "data_parallel_step")
