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

The exchange of :math:`\\Delta_i` goes through
:func:`grpo_optax.training.sparse_pmean` (``"dense"``, ``"all_gather"`` or
``"shared_support"``), or, with ``quantize="int8"``, through
:func:`exchange_mean`'s int8 payload (a per-chunk scale shared by the
replicas, levels ``floor(127 / W)`` so that the int8 all-reduce is exact).
Error feedback lives in the parameters: what a compressed exchange did not
send of :math:`\\Delta_i` (chunks not chosen, rounding error), :math:`e_i`,
stays with the replica, which starts its next round at :math:`\\theta -
e_i` (so its next :math:`\\Delta_i` contains it again). To average over
the reporting replicas only, replica ``i`` sends :math:`c_i = m_i
\\frac{W}{K} \\Delta_i`: the mean of the :math:`c_i` over all ``W``
replicas is :math:`\\bar\\Delta`.

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

import operator
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
from grpo_optax.training import distributed
from grpo_optax.training import exchange as exchange_lib

AxisName = Any

_LOCAL_EXCHANGES = ("dense", "all_gather", "shared_support")


# The argument checks of the exchanges (same messages as sparse_pmean's).
def _check_exchange(exchange: Any) -> str:
  return exchange_lib._check_choice(  # pylint: disable=protected-access
    "exchange", exchange, _LOCAL_EXCHANGES
  )


_check_fraction = exchange_lib._check_fraction  # pylint: disable=protected-access


def _check_chunk_size(chunk_size: Any) -> int:
  return exchange_lib._check_int(  # pylint: disable=protected-access
    "chunk_size", chunk_size, 1
  )


def default_outer_optimizer(
  learning_rate: float = 0.7, momentum: float = 0.9
) -> optax.GradientTransformation:
  """DiLoCo's outer optimizer: Nesterov SGD (lr 0.7, momentum 0.9).

  Args:
    learning_rate: outer learning rate.
    momentum: Nesterov momentum; 0 gives plain SGD.

  Returns:
    ``optax.sgd(learning_rate, momentum, nesterov=True)`` (no momentum
    buffer when ``momentum == 0``).
  """
  _tree.check_real("learning_rate", learning_rate, "a float > 0")
  _tree.check_real("momentum", momentum, "a float in [0, 1)")
  if not learning_rate > 0:
    raise ValueError(f"`learning_rate` must be > 0, got {learning_rate}.")
  if not 0 <= momentum < 1:
    raise ValueError(f"`momentum` must be in [0, 1), got {momentum}.")
  if momentum == 0:
    return optax.sgd(learning_rate)
  return optax.sgd(learning_rate, momentum=momentum, nesterov=True)


def _where(pred: jax.Array, new: Any, old: Any) -> Any:
  return jax.tree.map(lambda a, b: jnp.where(pred, a, b), new, old)


#: Payload formats of the outer exchange: float (``None``) or ``"int8"``.
QUANTIZE = (None, "int8")


def _check_quantize(quantize: Any, exchange: str) -> Any:
  if quantize not in QUANTIZE:
    raise ValueError(f"`quantize` must be one of {QUANTIZE}, got {quantize!r}.")
  if quantize is not None and exchange == "all_gather":
    raise ValueError(
      "`quantize='int8'` needs `exchange` 'dense' or "
      "'shared_support' (a summed payload), got 'all_gather'."
    )
  return quantize


def int8_levels(num_replicas: int) -> int:
  """Levels ``L = floor(127 / W)`` of the int8 payload: ``W`` replicas'
  values in ``[-L, L]`` sum to at most 127 in magnitude, so the int8
  all-reduce is exact (no overflow, no rounding in the sum).
  """
  num_replicas = _tree.check_positive_int("num_replicas", num_replicas)
  if num_replicas > 127:
    raise ValueError(
      f"the int8 exchange supports at most 127 replicas, got {num_replicas}."
    )
  return 127 // num_replicas


def _chunks(a: jax.Array, chunk_size: int) -> jax.Array:
  n = a.size
  m = distributed.num_chunks(n, chunk_size)
  width = distributed.chunk_width(n, chunk_size)
  c = a.reshape(-1)
  if m * width != n:
    c = jnp.pad(c, (0, m * width - n))
  return c.reshape(m, width)


def _int8_pmean(accs, axis_name, num_replicas, fraction, chunk_size, select):
  """Mean of the chosen chunks, exchanged as int8 with per-chunk scales.

  Chunks as in the shared support (``select``: chosen by the all-reduced
  squared norms; else all of them). Each chosen chunk ``c`` has the shared
  scale ``s_c = max_i max|a_i[c]|`` (one all-reduce of ``k`` floats);
  replica ``i`` sends ``q_i = round(L a_i[c] / s_c)`` in int8, ``L`` =
  :func:`int8_levels`; ``sum_i q_i`` (one int8 all-reduce, exact) gives the
  mean ``s_c / (L W) sum_i q_i``. The residual keeps ``a_i - s_c q_i / L``
  (the rounding error and the chunks not chosen).
  """
  levels = int8_levels(num_replicas)
  chunked = [
    None if a.size == 0 else _chunks(a.astype(jnp.float32), chunk_size)
    for a in accs
  ]
  live = [c for c in chunked if c is not None]
  if not live:
    return [jnp.zeros(a.shape, a.dtype) for a in accs], list(accs)
  picks = [jnp.arange(c.shape[0]) for c in live]
  if select:
    scores = jax.lax.psum(
      jnp.concatenate([jnp.sum(jnp.square(c), axis=1) for c in live]), axis_name
    )
    picks, offset = [], 0
    for c in live:
      m = c.shape[0]
      _, idx = jax.lax.top_k(
        scores[offset : offset + m], distributed.num_kept(m, fraction)
      )
      picks.append(idx)
      offset += m
  sel = [c[idx] for c, idx in zip(live, picks)]
  scale = jax.lax.pmax(
    jnp.concatenate([jnp.max(jnp.abs(x), axis=1) for x in sel]), axis_name
  )
  scale = jnp.where(scale > 0, scale, 1.0)
  qs, offset = [], 0
  for x in sel:
    sc = scale[offset : offset + x.shape[0], None]
    offset += x.shape[0]
    qs.append(jnp.clip(jnp.round(x * levels / sc), -levels, levels))
  flat = jnp.concatenate([q.reshape(-1) for q in qs]).astype(jnp.int8)
  total = jax.lax.psum(flat, axis_name).astype(jnp.float32)
  means, residuals, offset, soff, j = [], [], 0, 0, 0
  for a, c in zip(accs, chunked):
    if c is None:
      means.append(jnp.zeros(a.shape, a.dtype))
      residuals.append(a)
      continue
    idx, q = picks[j], qs[j]
    j += 1
    k, width = q.shape
    sc = scale[soff : soff + k, None] / levels
    soff += k
    block = total[offset : offset + k * width].reshape(k, width)
    offset += k * width
    mean = (
      jnp.zeros(c.shape, jnp.float32).at[idx].set(block * sc / num_replicas)
    )
    res = c.at[idx].add(-q * sc)
    means.append(mean.reshape(-1)[: a.size].reshape(a.shape).astype(a.dtype))
    residuals.append(res.reshape(-1)[: a.size].reshape(a.shape).astype(a.dtype))
  return means, residuals


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
  """:func:`grpo_optax.training.sparse_pmean`, or its int8 payload form.

  With ``quantize=None`` this is ``sparse_pmean`` (float payload). With
  ``quantize="int8"``: ``a_i = x_i + r_i`` is cut into chunks of
  ``chunk_size`` entries; ``"dense"`` sends every chunk, ``"shared_support"``
  the ``ceil(fraction m)`` chunks of largest all-reduced norm; the values
  travel as int8 in ``[-L, L]``, ``L = floor(127 / W)``, on a per-chunk
  scale shared by the replicas (so the int8 all-reduce is exact), and the
  residual keeps what was not sent, rounding error included (error
  feedback). Bytes: about ``fraction / 4 + 2 / chunk_size`` of the float
  all-reduce.

  Args:
    tree: this replica's values (a pytree of float arrays).
    residual: this replica's residual (same structure) or None.
    axis_name: the mesh axis of the replicas.
    num_replicas: the size of ``axis_name`` (``W``).
    exchange, fraction, chunk_size: as in ``sparse_pmean``.
    quantize: None or ``"int8"``.

  Returns:
    ``(mean, new_residual)`` as ``sparse_pmean``.
  """
  # Checked before any collective (outside shard_map too).
  _tree.check_positive_int("num_replicas", num_replicas)
  _check_fraction(fraction)
  _check_chunk_size(chunk_size)
  quantize = _check_quantize(quantize, exchange)
  if quantize is None:
    return distributed.sparse_pmean(
      tree,
      residual,
      axis_name,
      exchange=exchange,
      fraction=fraction,
      chunk_size=chunk_size,
    )
  leaves, treedef = jax.tree.flatten(tree)
  if residual is not None:
    leaves = [
      x + r.astype(x.dtype)
      for x, r in zip(leaves, treedef.flatten_up_to(residual))
    ]
  means, residuals = _int8_pmean(
    leaves,
    axis_name,
    num_replicas,
    _check_fraction(fraction),
    _check_chunk_size(chunk_size),
    select=exchange == "shared_support",
  )
  return (
    treedef.unflatten(means),
    None if residual is None else treedef.unflatten(residuals),
  )


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

  Call it after each replica's ``H`` inner steps, with ``outer_params``
  :math:`\theta` (invariant over ``axis_name``) and this replica's
  ``local_params`` :math:`\theta_i`. With :math:`\Delta_i = \theta -
  \theta_i`, :math:`K = \sum_j m_j` and :math:`c_i = m_i \frac{W}{K}
  \Delta_i`: :math:`\bar\Delta` = the exchange's mean of the :math:`c_i`
  (:func:`exchange_mean`; :math:`= \frac1K \sum_{m_i = 1} \Delta_i` for the
  dense float exchange), then :math:`(u, s)` = ``outer_tx.update(Delta_bar,
  s, theta)`` and :math:`\theta \leftarrow \theta + u` when :math:`K > 0`
  (else unchanged).

  Error feedback lives in the replica's parameters: the part of
  :math:`\Delta_i` a compressed exchange did not send, :math:`e_i =
  (c_i - \mathrm{sent}_i) K / W` (chunks not chosen, int8 rounding), is
  returned, and the replica starts its next round at :math:`\theta - e_i`
  instead of :math:`\theta`: it keeps the progress it has not sent, and its
  next :math:`\Delta_i` contains it again. A replica with :math:`m_i = 0`
  sends zeros; its round's work is dropped and it keeps its previous
  residual :math:`e_i^{\mathrm{prev}}` (``unsent``; zeros when None), so
  it rejoins from the new :math:`\theta` less the progress it has still
  not sent. A round with :math:`K = 0` thus changes no residual.

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
    exchange, fraction, chunk_size: as in :func:`sparse_pmean`.
    quantize: None (float payload) or ``"int8"`` (see
      :func:`exchange_mean`).

  Returns:
    ``(new_outer_params, new_outer_opt_state, unsent, K)``: the first two
    and ``K`` (float32) are the same on every replica; ``unsent`` is
    :math:`e_i` (None without error feedback); the next round starts at
    ``new_outer_params - unsent``.
  """
  # Checked before any collective (outside shard_map too).
  _tree.check_flag("error_feedback", error_feedback)
  _check_exchange(exchange)
  _check_fraction(fraction)
  _check_chunk_size(chunk_size)
  m = jnp.asarray(participate).astype(jnp.float32)
  k = jax.lax.psum(m, axis_name)
  w = jax.lax.axis_size(axis_name)
  scale = jnp.where(k > 0, m * w / jnp.maximum(k, 1.0), 0.0)
  delta = jax.tree.map(
    lambda t, x: ((t - x) * scale).astype(x.dtype), outer_params, local_params
  )
  zeros = jax.tree.map(jnp.zeros_like, delta) if error_feedback else None
  mean, left = exchange_mean(
    delta,
    zeros,
    axis_name,
    num_replicas=w,
    exchange=exchange,
    fraction=fraction,
    chunk_size=chunk_size,
    quantize=quantize,
  )
  new_unsent = None
  if error_feedback:
    new_unsent = jax.tree.map(lambda r: (r * k / w).astype(r.dtype), left)
    kept = jax.tree.map(jnp.zeros_like, left) if unsent is None else unsent
    # A replica that does not report keeps what it has still not sent.
    new_unsent = _where(m > 0, new_unsent, kept)
  updates, new_state = outer_tx.update(mean, outer_opt_state, outer_params)
  new_params = optax.apply_updates(outer_params, updates)
  reported = k > 0
  return (
    _where(reported, new_params, outer_params),
    _where(reported, new_state, outer_opt_state),
    new_unsent,
    k,
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
  """

  params: Any
  outer_opt_state: Any
  inner_opt_state: Any
  unsent: Any
  round: jax.Array


def _check_local_steps(local_steps: Any) -> int:
  if isinstance(local_steps, bool):
    raise ValueError(f"`local_steps` must be an int >= 1, got {local_steps!r}.")
  try:
    h = operator.index(local_steps)
  except TypeError:
    raise ValueError(
      f"`local_steps` must be an int >= 1, got {local_steps!r}."
    ) from None
  if h < 1:
    raise ValueError(f"`local_steps` must be an int >= 1, got {h}.")
  return h


def _is_tx(tx: Any) -> bool:
  return hasattr(tx, "init") and hasattr(tx, "update")


class LocalSteps:
  """A jitted, donated local-step round over a mesh.

  Build with :func:`local_steps_step`. ``init(params)`` returns a
  :class:`LocalStepsState`; ``round(state, batches, participation=None) ->
  (state, loss)`` runs one round (``H`` inner steps per replica, one outer
  step) and donates ``state``; ``lower(...)`` returns the
  ``jax.stages.Lowered`` round (``.compile()``,
  :func:`grpo_optax.training.ring_traffic`).

  Attributes:
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
    if not isinstance(error_feedback, bool):
      raise TypeError(
        f"`error_feedback` must be a bool, got {error_feedback!r}."
      )
    _tree.check_flag("donate", donate)
    self.exchange = _check_exchange(exchange)
    self.fraction = _check_fraction(fraction)
    self.chunk_size = _check_chunk_size(chunk_size)
    self.local_steps = _check_local_steps(local_steps)
    self.quantize = _check_quantize(quantize, self.exchange)
    self.loss_fn, self.tx, self.outer_tx, self.mesh = (
      loss_fn,
      tx,
      outer_tx,
      mesh,
    )
    self.axis = axis
    self.error_feedback = error_feedback and (
      exchange != "dense" or quantize is not None
    )
    self.num_replicas = mesh.shape[axis]
    if quantize is not None:
      int8_levels(self.num_replicas)
    self._replicated = NamedSharding(mesh, P())
    self._per_replica = NamedSharding(mesh, P(axis))
    self._batch_sharding = NamedSharding(mesh, P(None, axis))
    # PartitionSpecs shaped like the state (_make: not the fields' types)
    specs = LocalStepsState._make((P(), P(), P(axis), P(axis), P()))
    mapped = jax.shard_map(
      self._replica_round,
      mesh=mesh,
      in_specs=(specs, P(None, axis), P(axis)),
      out_specs=(specs, P()),
    )
    self._donate = donate
    self._round = jax.jit(mapped, donate_argnums=(0,) if donate else ())

  # -- state and data -------------------------------------------------------

  def init(self, params: Any) -> LocalStepsState:
    """Replicates ``params``, initialises both optimizers (and zero unsent).

    ``params`` must be the same on every process (e.g. from the same seed).
    Every replica's inner state starts as ``tx.init(params)``. The state
    owns its arrays: ``jax.Array`` leaves of ``params`` are copied (once,
    here), so the donated :meth:`round` never deletes the caller's
    ``params``.
    """
    params = distributed._own(  # pylint: disable=protected-access
      params,
      jax.tree.map(lambda _: self._replicated, params),
      self._donate,
    )
    outer = jax.jit(self.outer_tx.init, out_shardings=self._replicated)(params)
    w = self.num_replicas

    def stack(p):
      return jax.tree.map(
        lambda x: jnp.broadcast_to(x, (w,) + x.shape), self.tx.init(p)
      )

    inner = jax.jit(stack, out_shardings=self._per_replica)(params)
    unsent = None
    if self.error_feedback:
      unsent = jax.jit(
        lambda p: jax.tree.map(lambda x: jnp.zeros((w,) + x.shape, x.dtype), p),
        out_shardings=self._per_replica,
      )(params)
    count = jax.device_put(jnp.zeros((), jnp.int32), self._replicated)
    return LocalStepsState(params, outer, inner, unsent, count)

  def shard_batches(self, batches: Any) -> Any:
    """``H`` global batches (leaves ``(H, B, ...)``) split along ``B``."""
    to_global = distributed._to_global  # pylint: disable=protected-access
    for x in jax.tree.leaves(batches):
      shape = tuple(x.shape) if hasattr(x, "shape") else np.shape(x)
      if (
        len(shape) < 2
        or shape[0] != self.local_steps
        or (shape[1] % self.num_replicas)
      ):
        raise ValueError(
          f"`batches` leaves need the shape (local_steps={self.local_steps},"
          f" B, ...) with B divisible by the {self.num_replicas} replicas; "
          f"got a leaf of shape {shape}."
        )
    return jax.tree.map(lambda x: to_global(x, self._batch_sharding), batches)

  def participation(self, mask: Any = None) -> jax.Array:
    """The participation mask as a per-replica array (None: all report)."""
    to_global = distributed._to_global  # pylint: disable=protected-access
    if mask is None:
      mask = np.ones(self.num_replicas, np.float32)
    if isinstance(mask, jax.ShapeDtypeStruct):
      return to_global(mask, self._per_replica)
    shape = np.shape(mask)
    if shape != (self.num_replicas,):
      raise ValueError(
        f"`participation` must have the shape "
        f"({self.num_replicas},) (one entry per replica), got "
        f"{shape}."
      )
    if not isinstance(mask, jax.Array):
      mask = np.asarray(mask, np.float32)
    return to_global(mask, self._per_replica)

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
    return self._round(
      state, self.shard_batches(batches), self.participation(participation)
    )

  __call__ = round

  def lower(
    self, state: LocalStepsState, batches: Any, participation: Any = None
  ) -> jax.stages.Lowered:
    """The lowered round for ``state, batches`` (for analysis)."""
    return self._round.lower(
      state, self.shard_batches(batches), self.participation(participation)
    )

  # -- the program ----------------------------------------------------------

  def _inner(self, params, opt_state, batches):
    def body(carry, batch):
      p, s = carry
      loss, grads = jax.value_and_grad(self.loss_fn)(p, batch)
      updates, s = self.tx.update(grads, s, p)
      return (optax.apply_updates(p, updates), s), loss

    (params, opt_state), losses = jax.lax.scan(
      body, (params, opt_state), batches
    )
    return params, opt_state, jnp.mean(losses)

  def _replica_round(self, state: LocalStepsState, batches, mask):
    inner0 = jax.tree.map(lambda x: x[0], state.inner_opt_state)
    unsent0 = (
      None
      if state.unsent is None
      else jax.tree.map(lambda x: x[0], state.unsent)
    )
    # Varying params: each replica trains its own copy; no implicit psum.
    start = jax.lax.pcast(state.params, self.axis, to="varying")
    if unsent0 is not None:  # Keep what the last exchange did not send.
      start = jax.tree.map(lambda p, e: p - e, start, unsent0)
    local, inner, loss = self._inner(start, inner0, batches)
    m = mask[0]
    params, outer, unsent, _ = outer_step(
      state.params,
      local,
      state.outer_opt_state,
      self.axis,
      outer_tx=self.outer_tx,
      participate=m,
      error_feedback=self.error_feedback,
      unsent=unsent0,
      exchange=self.exchange,
      fraction=self.fraction,
      chunk_size=self.chunk_size,
      quantize=self.quantize,
    )
    inner = _where(m > 0, inner, inner0)  # A missing replica's work is lost.
    stack = lambda tree: (
      None if tree is None else jax.tree.map(lambda x: x[None], tree)
    )
    new = LocalStepsState(
      params,
      outer,
      stack(inner),
      stack(unsent),
      _common.safe_increment(state.round),
    )
    return new, jax.lax.pmean(loss, self.axis)


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
  B_{i,h}))`, then :func:`outer_step` averages the pseudo-gradients
  :math:`\theta - \theta_i` of the reporting replicas through the exchange
  and applies ``outer_tx`` (default :func:`default_outer_optimizer`: Nesterov
  SGD, lr 0.7, momentum 0.9). The inner state persists per replica across
  rounds (DiLoCo keeps each worker's AdamW state).

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar``.
    tx: the inner optax transformation, e.g. ``grpo_optax.grpo()``.
    mesh: a 1-D :class:`jax.sharding.Mesh` with axis ``axis`` (may span
      processes).
    local_steps: inner steps per round ``H``, an int >= 1.
    outer_tx: the outer optax transformation (default: Nesterov SGD 0.7/0.9).
    axis: the mesh axis of the replicas.
    exchange, fraction, chunk_size: the exchange of the pseudo-gradients, as
      in :func:`grpo_optax.training.sparse_pmean`.
    error_feedback: keep what a compressed exchange did not send in the
      replica's next start (:func:`outer_step`).
    quantize: None (float payload) or ``"int8"`` (:func:`exchange_mean`).
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
  h = _check_local_steps(local_steps)
  return distributed.ring_traffic(compiled)["total"] / h


__all__ = (
  "LocalSteps",
  "LocalStepsState",
  "QUANTIZE",
  "default_outer_optimizer",
  "exchange_mean",
  "int8_levels",
  "local_steps_step",
  "outer_step",
  "round_traffic_per_step",
)
