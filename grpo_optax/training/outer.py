r"""The outer step of local-step (DiLoCo) training, inside ``shard_map``.

After each replica's ``H`` inner steps from the outer parameters
:math:`\theta`, replica :math:`i` holds :math:`\theta_i`. With the
participation mask :math:`m_i`, :math:`K = \sum_j m_j` and :math:`c_i = m_i
\frac{W}{K} (\theta - \theta_i)`, the exchange (any compressor of the
registry) gives every replica :math:`\bar\Delta` = the mean of the
:math:`c_i` (:math:`= \frac1K \sum_{m_i = 1} (\theta - \theta_i)` for the
dense float exchange); the outer optimizer then takes :math:`(u, s) =`
``outer_tx.update(Delta_bar, s, theta)`` and :math:`\theta \leftarrow \theta
+ u` when :math:`K > 0` (else nothing changes).

Error feedback lives in the replica's parameters: the part of its change the
exchange did not send, :math:`e_i = (c_i - \mathrm{sent}_i) K / W` (chunks
not chosen, int8 rounding), stays with it, and it starts its next round at
:math:`\theta - e_i` (its next change contains it again). A replica with
:math:`m_i = 0` sends zeros, its round's change is dropped, and it keeps its
previous :math:`e_i` (what earlier rounds did not send is sent later).

References:
  Douillard et al. DiLoCo: Distributed Low-Communication Training of
  Language Models. 2023. https://arxiv.org/abs/2311.08105
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from grpo_optax.training import _tree
from grpo_optax.training import exchange as exchange_lib


class OuterState(NamedTuple):
  """The outer half of a local-step run's state (replicated).

  Attributes:
    params: the outer parameters :math:`\\theta` (the model to evaluate).
    opt_state: the outer optimizer's state.
  """

  params: Any
  opt_state: Any


class OuterResult(NamedTuple):
  """What :func:`outer_exchange` returns (on one replica).

  Attributes:
    outer: the new :class:`OuterState` (the same on every replica).
    start: this replica's start of the next round, :math:`\\theta - e_i`.
    exchange: the new exchange state (``residual``: this replica's
      :math:`e_i`, or None).
    reporting: :math:`K`, the number of replicas that reported (float32).
  """

  outer: OuterState
  start: Any
  exchange: exchange_lib.ExchangeState
  reporting: jax.Array


def default_outer_optimizer(
  learning_rate: float = 0.7, momentum: float = 0.9
) -> optax.GradientTransformation:
  """DiLoCo's outer optimizer: Nesterov SGD (lr 0.7, momentum 0.9).

  Args:
    learning_rate: outer learning rate, > 0.
    momentum: Nesterov momentum in [0, 1); 0 gives plain SGD.

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


def where(pred: jax.Array, new: Any, old: Any) -> Any:
  """``new`` where ``pred`` else ``old``, leaf by leaf."""
  return jax.tree.map(lambda a, b: jnp.where(pred, a, b), new, old)


def outer_exchange(
  outer: OuterState,
  local_params: Any,
  state: exchange_lib.ExchangeState,
  axis_name: Any,
  *,
  exchange: exchange_lib.Exchange,
  outer_tx: optax.GradientTransformation,
  participate: Any = True,
) -> OuterResult:
  """The outer step (module docstring) on one replica, in ``shard_map``.

  Args:
    outer: the outer parameters and optimizer state (replicated).
    local_params: this replica's parameters after its inner steps
      (:math:`\\theta_i`, started at :math:`\\theta - e_i^{prev}`).
    state: this replica's exchange state; ``state.residual`` is
      :math:`e_i^{prev}` (None without error feedback).
    axis_name: the mesh axis (or axes) the replicas span.
    exchange: the :class:`~grpo_optax.training.Exchange` of the change (or
      a name of the registry: its default options).
    outer_tx: the outer optax transformation.
    participate: this replica's participation, a bool or 0/1 scalar.

  Returns:
    An :class:`OuterResult`.

  Raises:
    TypeError: ``outer`` not an :class:`OuterState`, or ``outer_tx`` not an
      optax transformation (before any collective).
    ValueError: an unknown exchange name.
  """
  # Checked before any collective (outside shard_map too).
  if not isinstance(outer, OuterState):
    raise TypeError(
      f"`outer` must be an OuterState(params, opt_state), got {type(outer)}."
    )
  if not (hasattr(outer_tx, "init") and hasattr(outer_tx, "update")):
    raise TypeError(
      "`outer_tx` must be an optax GradientTransformation (with init and "
      f"update), got {type(outer_tx)}."
    )
  exchange = exchange_lib.make_exchange(exchange)
  theta = outer.params
  m = jnp.asarray(participate).astype(jnp.float32)
  k = jax.lax.psum(m, axis_name)
  w = jax.lax.axis_size(axis_name)
  scale = jnp.where(k > 0, m * w / jnp.maximum(k, 1.0), 0.0)
  delta = jax.tree.map(
    lambda t, x: ((t - x) * scale).astype(x.dtype), theta, local_params
  )
  # Error feedback is in the parameters: the exchange starts from zeros.
  fresh = state._replace(
    residual=None
    if state.residual is None
    else jax.tree.map(jnp.zeros_like, delta)
  )
  mean, new = exchange(delta, fresh, axis_name)
  unsent = None
  if new.residual is not None:
    unsent = jax.tree.map(lambda r: (r * k / w).astype(r.dtype), new.residual)
    # A replica that does not report keeps what it has still not sent.
    unsent = where(m > 0, unsent, state.residual)
  updates, opt_state = outer_tx.update(mean, outer.opt_state, theta)
  reported = k > 0
  new_outer = where(
    reported,
    OuterState(optax.apply_updates(theta, updates), opt_state),
    outer,
  )
  # A round nobody reports changes no state of the exchange either.
  new = where(
    reported, new._replace(residual=None), state._replace(residual=None)
  )
  start = (
    new_outer.params
    if unsent is None
    else jax.tree.map(lambda p, e: p - e, new_outer.params, unsent)
  )
  return OuterResult(new_outer, start, new._replace(residual=unsent), k)


__all__ = (
  "OuterResult",
  "OuterState",
  "default_outer_optimizer",
  "outer_exchange",
)
