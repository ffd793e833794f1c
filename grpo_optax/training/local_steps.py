"""Local-step data parallelism (DiLoCo): H inner steps, one outer exchange.

Each of the ``W`` replicas starts a *round* from the shared outer parameters
:math:`\\theta`, runs ``H`` steps of an inner optimizer (any optax
transformation, ``grpo()`` included) on its own shard of the data, and ends
at :math:`\\theta_i`. The replicas then exchange their *pseudo-gradients*

.. math::  \\Delta_i = \\theta - \\theta_i ,

average them over the replicas that report in this round (:math:`M`, the
set with participation mask :math:`m_i = 1`, :math:`K = |M|`),

.. math::  \\bar\\Delta = \\frac1K \\sum_{i \\in M} \\Delta_i ,

and apply an *outer* optimizer to :math:`\\bar\\Delta` as if it were a
gradient: :math:`(u, s) =` ``outer_tx.update(Delta_bar, s, theta)``,
:math:`\\theta \\leftarrow \\theta + u`; the default is Nesterov SGD with
learning rate 0.7 and momentum 0.9, as in DiLoCo. Every replica then starts
the next round from the new :math:`\\theta` (less what it did not get sent,
below), so a replica that missed a round rejoins from the new outer
parameters; its inner optimizer state is the one it had before the round it
missed (its work of that round is lost, as when a worker dies mid-round),
and so is its error-feedback residual (what earlier rounds did not send is
kept for a later round, not dropped). A round in which no replica reports
leaves :math:`\\theta`, the outer state and every residual as they were.

With ``outer_tx = sgd(1)`` (no momentum), ``H = 1``, every replica reporting
and ``tx = sgd(lr)``, a round is exactly one step of synchronous data
parallelism (:math:`\\bar\\Delta = lr\\, \\bar g`).

The exchange of :math:`\\Delta_i` is any compressor of the registry
(:mod:`grpo_optax.training.compressors`); ``quantize="int8"`` names the int8
one (a per-chunk scale shared by the replicas, levels ``floor(127 / W)`` so
that the int8 all-reduce is exact). Error feedback lives in the parameters:
what a compressed exchange did not send of :math:`\\Delta_i` (chunks not
chosen, rounding error), :math:`e_i`, stays with the replica, which starts
its next round at :math:`\\theta - e_i` (so its next :math:`\\Delta_i`
contains it again). To average over the reporting replicas only, replica
``i`` sends :math:`c_i = m_i \\frac{W}{K} \\Delta_i`: the mean of the
:math:`c_i` over all ``W`` replicas is :math:`\\bar\\Delta`.

The round is the runtime's (:meth:`grpo_optax.training.DataParallel.round`
in local-step mode, :mod:`grpo_optax.training.outer` for the outer step);
this module keeps the function forms of the first version
(:func:`local_steps_step`, :func:`outer_step`, :func:`exchange_mean`) and
their state.

Traffic: one round sends the exchange's bytes once (``D`` the dense
parameter bytes: ``2 (W-1)/W D`` for ``"dense"``, about ``f + 1/chunk`` of
that for ``"shared_support"``, about ``fraction / 4 + 2 / chunk`` with the
int8 payload), so per *training step* the local-step run
sends ``1/H`` of a round's bytes; :func:`grpo_optax.training.ring_traffic`
reads them off the compiled round.

References:
  Douillard, Feng, Rusu, Chhaparia, Donchev, Kuncoro, Ranzato, Szlam, Shen.
  DiLoCo: Distributed Low-Communication Training of Language Models. 2023.
  https://arxiv.org/abs/2311.08105

  Douillard, Donchev, Rush, et al. Streaming DiLoCo with overlapping
  communication. 2025. https://arxiv.org/abs/2501.18512

  Lin, Stich, Patel, Jaggi. Don't Use Large Mini-Batches, Use Local SGD.
  ICLR 2020. https://arxiv.org/abs/1808.07217
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from grpo_optax import hlo
from grpo_optax.training import _tree
from grpo_optax.training import compressors
from grpo_optax.training import exchange as exchange_lib
from grpo_optax.training import outer as outer_lib
from grpo_optax.training import runtime
from grpo_optax.training.compressors.int8 import int8_levels
from grpo_optax.training.outer import default_outer_optimizer

AxisName = Any

#: Payload formats of the outer exchange: float (``None``) or ``"int8"``.
QUANTIZE = (None, "int8")
#: The float exchanges ``quantize="int8"`` replaces by the int8 compressor
#: (over every chunk, or the top chunks of each leaf).
INT8_OUTER = ("dense", "shared_support")


def outer_exchange_of(
  exchange: Any,
  fraction: Any = 0.3,
  chunk_size: Any = 64,
  quantize: Any = None,
  error_feedback: bool = True,
) -> exchange_lib.Exchange:
  """The :class:`~grpo_optax.training.Exchange` of the local-step keywords.

  ``fraction`` and ``chunk_size`` are checked, and passed to the compressor
  where it takes them (the first version's keywords apply "where the
  exchange has them"). ``quantize="int8"`` with ``exchange="dense"`` is the
  int8 compressor over every chunk, with ``"shared_support"`` over the
  ``fraction`` of each leaf's chunks of largest all-reduced norm.

  Raises:
    ValueError: an unknown ``quantize``, ``quantize="int8"`` with another
      exchange, or the checks of :func:`~grpo_optax.training.make_exchange`.
  """
  if quantize not in QUANTIZE:
    raise ValueError(f"`quantize` must be one of {QUANTIZE}, got {quantize!r}.")
  known = compressors.options()
  fraction = known["fraction"].check(fraction)
  chunk_size = known["chunk_size"].check(chunk_size)
  if quantize is not None:
    if exchange not in INT8_OUTER:
      raise ValueError(
        "`quantize='int8'` needs `exchange` 'dense' or "
        f"'shared_support' (a summed payload), got {exchange!r}."
      )
    return exchange_lib.make_exchange(
      "int8",
      fraction=1.0 if exchange == "dense" else fraction,
      chunk_size=chunk_size,
      error_feedback=error_feedback,
    )
  if exchange not in compressors.REGISTRY:
    return exchange_lib.make_exchange(exchange)  # Raises, naming the choices.
  takes = {o.name for o in compressors.REGISTRY[exchange].options}
  given = {"fraction": fraction, "chunk_size": chunk_size}
  return exchange_lib.make_exchange(
    exchange,
    error_feedback=error_feedback,
    **{k: v for k, v in given.items() if k in takes},
  )


def exchange_mean(
  tree: Any,
  residual: Any,
  axis_name: AxisName,
  *,
  num_replicas: int,
  exchange: str = "dense",
  fraction: float = 0.3,
  chunk_size: int = 64,
  quantize: Any = None,
) -> tuple[Any, Any]:
  """:func:`~grpo_optax.training.sparse_pmean` of the local-step keywords.

  With ``quantize=None`` the compressor ``exchange``; with
  ``quantize="int8"`` the int8 compressor:
  ``a_i = x_i + r_i`` cut into chunks of ``chunk_size`` entries, all of them
  (``"dense"``) or the ``ceil(fraction m)`` of largest all-reduced norm per
  leaf (``"shared_support"``), sent as int8 in ``[-L, L]``, ``L = floor(127
  / W)``, on a per-chunk scale shared by the replicas; the residual keeps
  what was not sent, rounding error included.

  Args:
    tree: this replica's values (a pytree of float arrays).
    residual: this replica's residual (same structure) or None.
    axis_name: the mesh axis of the replicas.
    num_replicas: the size of ``axis_name`` (``W``).
    exchange: the exchange of the pseudo-gradients: a compressor name of
      the registry (:data:`~grpo_optax.training.EXCHANGES`); with
      ``quantize="int8"``, ``"dense"`` or ``"shared_support"``.
    fraction: kept fraction of a compressor that takes one (checked, and
      ignored by the others).
    chunk_size: entries per chunk of a compressor that takes one (likewise).
    quantize: None (float payloads) or ``"int8"``: the int8 compressor over
      every chunk (``"dense"``) or the ``fraction`` of each leaf's chunks of
      largest all-reduced norm (``"shared_support"``).

  Returns:
    ``(mean, new_residual)`` as ``sparse_pmean``.
  """
  # Checked before any collective (outside shard_map too).
  _tree.check_positive_int("num_replicas", num_replicas)
  ex = outer_exchange_of(exchange, fraction, chunk_size, quantize)
  if quantize is not None:
    int8_levels(num_replicas)
  return exchange_lib.sparse_pmean(tree, residual, axis_name, exchange=ex)


def outer_step(
  outer_params: Any,
  local_params: Any,
  outer_opt_state: Any,
  axis_name: AxisName,
  *,
  outer_tx: optax.GradientTransformation,
  participate: Any = True,
  error_feedback: bool = True,
  unsent: Any = None,
  exchange: str = "dense",
  fraction: float = 0.3,
  chunk_size: int = 64,
  quantize: Any = None,
) -> tuple[Any, Any, Any, jax.Array]:
  r"""The outer step of a local-step round, inside :func:`jax.shard_map`.

  :func:`grpo_optax.training.outer.outer_exchange` (the math is there)
  for a stateless exchange: each call starts the exchange afresh (PowerSGD
  and the replicated support, which carry state from round to round, need
  the runtime, :func:`~grpo_optax.training.data_parallel` with
  ``local_steps``).

  Args:
    outer_params: the outer parameters, the same on every replica.
    local_params: this replica's parameters after its inner steps.
    outer_opt_state: the ``outer_tx`` state (replicated).
    axis_name: the mesh axis (or axes) the replicas span.
    outer_tx: the outer optax transformation, e.g.
      :func:`default_outer_optimizer`.
    participate: this replica's participation in the round, a bool or 0/1
      scalar (may vary over the replicas).
    error_feedback: return :math:`e_i` (else None: what was not sent is
      dropped).
    unsent: this replica's residual of its previous round,
      :math:`e_i^{\mathrm{prev}}` (the one its start subtracted), kept as
      the new :math:`e_i` when the replica does not report; None: zeros.
    exchange: the exchange of the pseudo-gradients: a compressor name of
      the registry (:data:`~grpo_optax.training.EXCHANGES`); with
      ``quantize="int8"``, ``"dense"`` or ``"shared_support"``.
    fraction: kept fraction of a compressor that takes one (checked, and
      ignored by the others).
    chunk_size: entries per chunk of a compressor that takes one (likewise).
    quantize: None (float payloads) or ``"int8"``: the int8 compressor over
      every chunk (``"dense"``) or the ``fraction`` of each leaf's chunks of
      largest all-reduced norm (``"shared_support"``).

  Returns:
    ``(new_outer_params, new_outer_opt_state, unsent, K)``: the first two
    and ``K`` (float32) are the same on every replica; ``unsent`` is
    :math:`e_i` (None without error feedback or for a lossless exchange);
    the next round starts at ``new_outer_params - unsent``.
  """
  # Checked before any collective (outside shard_map too).
  _tree.check_flag("error_feedback", error_feedback)
  ex = outer_exchange_of(
    exchange, fraction, chunk_size, quantize, error_feedback
  )
  if ex.compressor.stateful:
    raise ValueError(
      f"outer_step starts each exchange afresh; the {ex.name!r} exchange "
      f"({ex.compressor}) keeps state from round to round: use "
      "training.data_parallel(..., local_steps=H)."
    )
  residual = None
  if ex.keeps_residual:
    residual = (
      jax.tree.map(jnp.zeros_like, local_params) if unsent is None else unsent
    )
  state = exchange_lib.ExchangeState(
    residual, None, jnp.zeros((), jnp.int32), None
  )
  res = outer_lib.outer_exchange(
    outer_lib.OuterState(outer_params, outer_opt_state),
    local_params,
    state,
    axis_name,
    exchange=ex,
    outer_tx=outer_tx,
    participate=participate,
  )
  return (
    res.outer.params,
    res.outer.opt_state,
    res.exchange.residual,
    res.reporting,
  )


class LocalStepsState(NamedTuple):
  """State of :func:`local_steps_step`.

  Attributes:
    params: the outer parameters, replicated on every device.
    outer_opt_state: the ``outer_tx`` state, replicated.
    inner_opt_state: each replica's ``tx`` state: every leaf has a leading
      axis of size ``W``, sharded over the replicas.
    unsent: per replica (leading axis ``W``), the part of its last
      parameter change the compressed exchange did not send; the replica's
      next round starts at ``params - unsent`` (:func:`outer_step`). None
      for the dense float exchange, or without error feedback.
    round: completed rounds (``shape=(), dtype=int32``), replicated.
    exchange: the rest of the outer exchange's state (an
      :class:`~grpo_optax.training.ExchangeState` without residual: its
      count, and the compressor's state), replicated.
  """

  params: Any
  outer_opt_state: Any
  inner_opt_state: Any
  unsent: Any
  round: jax.Array
  exchange: Any = None


_LOCAL_STEPS = compressors.Option("local_steps", 1, "int", low=1)


def _is_tx(tx: Any) -> bool:
  return hasattr(tx, "init") and hasattr(tx, "update")


class LocalSteps:
  """A jitted, donated local-step round over a mesh.

  Build with :func:`local_steps_step`. ``init(params)`` returns a
  :class:`LocalStepsState`; ``round(state, batches, participation=None) ->
  (state, loss)`` runs one round (``H`` inner steps per replica, one outer
  step) and donates ``state``; ``lower(...)`` returns the
  ``jax.stages.Lowered`` round (``.compile()``,
  :func:`grpo_optax.training.ring_traffic`). A thin wrapper of the runtime
  in local-step mode (``runtime``, whose
  :meth:`~grpo_optax.training.DataParallel.round` it runs).

  Attributes:
    runtime: the :class:`~grpo_optax.training.DataParallel` it wraps.
    mesh: as built (also ``axis``, ``local_steps``, ``exchange``,
      ``fraction``, ``chunk_size``, ``quantize``).
    num_replicas: the size of ``axis`` (``W``).
    error_feedback: whether the state holds the unsent parts.
  """

  def __init__(
    self,
    loss_fn,
    tx,
    mesh,
    *,
    local_steps,
    outer_tx,
    axis,
    exchange,
    fraction,
    error_feedback,
    chunk_size,
    quantize,
    donate,
  ):
    if not callable(loss_fn):
      raise TypeError(f"`loss_fn` must be callable, got {type(loss_fn)}.")
    for name, t in (("tx", tx), ("outer_tx", outer_tx)):
      if not _is_tx(t):
        raise TypeError(
          f"`{name}` must be an optax GradientTransformation "
          f"(with init and update), got {type(t)}."
        )
    if not isinstance(mesh, Mesh):
      raise TypeError(f"`mesh` must be a jax.sharding.Mesh, got {type(mesh)}.")
    if tuple(mesh.axis_names) != (axis,):
      raise ValueError(
        f"`mesh` must have the single axis `axis` ({axis!r}), "
        f"got the axes {tuple(mesh.axis_names)}."
      )
    _tree.check_flag("error_feedback", error_feedback)
    _tree.check_flag("donate", donate)
    self.local_steps = _LOCAL_STEPS.check(local_steps)
    ex = outer_exchange_of(
      exchange, fraction, chunk_size, quantize, error_feedback
    )

    def canonical(params, model_state, batch, key):
      del key
      return loss_fn(params, batch), (model_state, None)

    self.runtime = runtime.DataParallel(
      canonical,
      tx,
      mesh,
      exchange=ex,
      local_steps=self.local_steps,
      outer_tx=outer_tx,
      axis=axis,
      donate=donate,
    )
    self.loss_fn, self.tx, self.outer_tx, self.mesh = (
      loss_fn,
      tx,
      outer_tx,
      mesh,
    )
    self.axis, self.exchange, self.quantize = axis, exchange, quantize
    self.fraction, self.chunk_size = fraction, chunk_size
    self._donate = donate
    self.error_feedback = ex.keeps_residual
    self.num_replicas = mesh.shape[axis]
    rep = NamedSharding(mesh, P())
    per = NamedSharding(mesh, P(axis))
    # Shardings shaped like the state (_make: not the fields' types).
    exchange = exchange_lib.ExchangeState._make((per, per, rep, rep))
    train = runtime.TrainState._make((per, per, None, exchange, None, rep, rep))
    self._to_train = {
      d: jax.jit(
        self._train_of, out_shardings=train, donate_argnums=(0,) if d else ()
      )
      for d in (False, True)
    }
    self._from_train = jax.jit(
      self._state_of, donate_argnums=(0,) if donate else ()
    )

  # -- conversions between the first version's state and the runtime's --------

  def _train_of(self, state: LocalStepsState) -> runtime.TrainState:
    w = self.num_replicas
    theta = state.params
    start = jax.tree.map(lambda x: jnp.broadcast_to(x, (w,) + x.shape), theta)
    if state.unsent is not None:
      start = jax.tree.map(lambda p, e: p - e, start, state.unsent)
    ex = state.exchange
    if ex is None:  # A state of the first version: a fresh exchange.
      shapes = [tuple(x.shape) for x in jax.tree.leaves(theta)]
      ex = exchange_lib.ExchangeState(
        None,
        None,
        jnp.zeros((), jnp.int32),
        self.runtime.exchange.compressor.init(shapes),
      )
    ex = ex._replace(residual=state.unsent)
    return runtime.TrainState(
      start,
      state.inner_opt_state,
      None,
      ex,
      None,
      state.round * self.local_steps,
      outer_lib.OuterState(theta, state.outer_opt_state),
    )

  def _state_of(self, train: runtime.TrainState) -> LocalStepsState:
    return LocalStepsState(
      train.outer.params,
      train.outer.opt_state,
      train.opt_state,
      train.exchange.residual,
      train.count // self.local_steps,
      train.exchange._replace(residual=None),
    )

  # -- the first version's interface -----------------------------------------

  def init(self, params: Any) -> LocalStepsState:
    """Replicates ``params``, initialises both optimizers (and zero unsent).

    ``params`` must be the same on every process (e.g. from the same seed).
    Every replica's inner state starts as ``tx.init(params)``. The state
    owns its arrays: ``jax.Array`` leaves of ``params`` are copied (once,
    here), so the donated :meth:`round` never deletes the caller's
    ``params``.
    """
    return self._from_train(self.runtime.init(params))

  def shard_batches(self, batches: Any) -> Any:
    """``H`` global batches (leaves ``(H, B, ...)``) split along ``B``."""
    return self.runtime.shard_batches(batches)

  def participation(self, mask: Any = None) -> Any:
    """The participation mask as a per-replica array (None: all report)."""
    return self.runtime.participation(mask)

  def round(
    self, state: LocalStepsState, batches: Any, participation: Any = None
  ):
    """One round on ``batches`` (leaves ``(H, global batch, ...)``).

    Args:
      state: a :class:`LocalStepsState` (donated).
      batches: ``H`` global batches stacked on a leading axis.
      participation: ``(W,)`` 0/1 mask of the replicas that report this
        round (None: all).

    Returns:
      ``(new_state, loss)``, ``loss`` the mean inner loss of all replicas.
    """
    batches = self.shard_batches(batches)
    mask = self.participation(participation)
    train = self._to_train[self._donate](state)
    train, out = self.runtime.round(train, batches, mask)
    return self._from_train(train), out.loss

  __call__ = round

  def lower(
    self, state: LocalStepsState, batches: Any, participation: Any = None
  ) -> jax.stages.Lowered:
    """The lowered round for ``state, batches`` (for analysis)."""
    return self.runtime.lower_round(
      self._to_train[False](state), batches, participation
    )


def local_steps_step(
  loss_fn: Callable[[Any, Any], Any],
  tx: optax.GradientTransformation,
  mesh: Mesh,
  *,
  local_steps: int,
  outer_tx: optax.GradientTransformation | None = None,
  axis: str = "data",
  exchange: str = "dense",
  fraction: float = 0.3,
  error_feedback: bool = True,
  chunk_size: int = 64,
  quantize: Any = None,
  donate: bool = True,
) -> LocalSteps:
  r"""Local-step (DiLoCo) data parallelism over ``mesh``.

  One *round* per call: every replica :math:`i` starts from the outer
  parameters :math:`\theta`, runs ``local_steps`` (``H``) steps of ``tx``
  on its shares :math:`B_{i,1..H}` of the ``H`` global batches,
  :math:`\theta_i \leftarrow \theta_i + \mathrm{tx}(\nabla\ell(\theta_i,
  B_{i,h}))`, then the outer step averages the pseudo-gradients
  :math:`\theta - \theta_i` of the reporting replicas through the exchange
  and applies ``outer_tx`` (default :func:`default_outer_optimizer`: Nesterov
  SGD, lr 0.7, momentum 0.9). The inner state persists per replica across
  rounds (DiLoCo keeps each worker's AdamW state). The runtime's
  :func:`~grpo_optax.training.data_parallel` with ``local_steps=H`` is the
  same round with model state, keys and a step-by-step interface.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar``.
    tx: the inner optax transformation, e.g. ``grpo_optax.grpo()``.
    mesh: a 1-D :class:`jax.sharding.Mesh` with axis ``axis`` (may span
      processes).
    local_steps: inner steps per round ``H``, an int >= 1.
    outer_tx: the outer optax transformation (default: Nesterov SGD 0.7/0.9).
    axis: the mesh axis of the replicas.
    exchange: the exchange of the pseudo-gradients: a compressor name of
      the registry (:data:`~grpo_optax.training.EXCHANGES`); with
      ``quantize="int8"``, ``"dense"`` or ``"shared_support"``.
    fraction: kept fraction of a compressor that takes one (checked, and
      ignored by the others).
    chunk_size: entries per chunk of a compressor that takes one (likewise).
    quantize: None (float payloads) or ``"int8"``: the int8 compressor over
      every chunk (``"dense"``) or the ``fraction`` of each leaf's chunks of
      largest all-reduced norm (``"shared_support"``).
    error_feedback: keep what a compressed exchange did not send in the
      replica's next start (:func:`outer_step`).
    donate: donate the state to the compiled round.

  Returns:
    A :class:`LocalSteps` with ``init``, ``round``, ``lower``.

  Examples:
    >>> import jax, jax.numpy as jnp, numpy as np, optax
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> loss_fn = lambda p, b: jnp.mean((b[0] @ p["w"] - b[1]) ** 2)
    >>> ls = local_steps_step(loss_fn, optax.sgd(0.1), mesh, local_steps=2)
    >>> state = ls.init({"w": jnp.zeros((4, 1))})
    >>> x = np.ones((2, 8 * jax.device_count(), 4), np.float32)
    >>> state, loss = ls.round(state, (x, np.ones(x.shape[:2] + (1,),
    ...                                            np.float32)))
    >>> int(state.round), round(float(loss), 4)
    (1, 0.52)

  References:
    Douillard et al., DiLoCo, 2023, https://arxiv.org/abs/2311.08105
  """
  if outer_tx is None:
    outer_tx = default_outer_optimizer()
  return LocalSteps(
    loss_fn,
    tx,
    mesh,
    local_steps=local_steps,
    outer_tx=outer_tx,
    axis=axis,
    exchange=exchange,
    fraction=fraction,
    error_feedback=error_feedback,
    chunk_size=chunk_size,
    quantize=quantize,
    donate=donate,
  )


def round_traffic_per_step(compiled: Any, local_steps: int) -> float:
  """Ring-model bytes one device sends per training step of a round.

  Args:
    compiled: the compiled (or lowered) round, or its HLO text.
    local_steps: the round's inner steps ``H``.

  Returns:
    :func:`grpo_optax.training.ring_traffic` ``["total"] / H``.
  """
  h = _LOCAL_STEPS.check(local_steps)
  return hlo.ring_traffic(compiled)["total"] / h


__all__ = (
  "INT8_OUTER",
  "QUANTIZE",
  "LocalSteps",
  "LocalStepsState",
  "default_outer_optimizer",
  "exchange_mean",
  "int8_levels",
  "local_steps_step",
  "outer_step",
  "round_traffic_per_step",
)
