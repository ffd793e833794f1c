"""Adapters from a Flax NNX model to the pure loss forms of the steps.

:func:`split_model` gives ``loss_fn(params, batch)`` (the steps of
:mod:`grpo_optax.training` that take a plain loss); :func:`split_model_with_state`
gives the runtime's ``loss_fn(params, model_state, batch, key)``, with the
BatchNorm statistics as the model state.

Flax is imported lazily, inside the function: ``grpo_optax`` does not depend
on it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple


class PureModel(NamedTuple):
  """A model split into a pure loss, its parameters and a write-back.

  Attributes:
    loss_fn: ``loss_fn(params, batch) -> scalar``; merges ``params`` with the
      model's other state (held constant) and calls the user's loss.
    params: the ``nnx.State`` of the selected variables (a pytree).
    update_model: ``update_model(params)`` writes parameters back into the
      model (``nnx.update``) and returns the model.
  """

  loss_fn: Callable[[Any, Any], Any]
  params: Any
  update_model: Callable[[Any], Any]


def split_model(
  model: Any, loss_fn: Callable[[Any, Any], Any], *, wrt: Any = None
) -> PureModel:
  """Splits an NNX ``model`` for the steps of :mod:`grpo_optax.training`.

  Args:
    model: a ``flax.nnx.Module``.
    loss_fn: ``loss_fn(model, batch) -> scalar``.
    wrt: the NNX filter of the trained variables (default ``nnx.Param``, so
      batch statistics and RNG state stay out of the optimizer; they are held
      constant inside the step).

  Returns:
    A :class:`PureModel` ``(loss_fn, params, update_model)``. Parameter paths
    look like ``"layers/0/attn/query/kernel/value"``.

  Examples:
    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> lin = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> pm = split_model(lin, lambda m, x: jnp.sum(m(x) ** 2))
    >>> float(pm.loss_fn(pm.params, jnp.zeros((1, 2))))
    0.0
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top

  wrt = nnx.Param if wrt is None else wrt
  graphdef, params, rest = nnx.split(model, wrt, ...)

  def pure_loss(p, batch):
    return loss_fn(nnx.merge(graphdef, p, rest), batch)

  def update_model(p):
    nnx.update(model, p)
    return model

  return PureModel(pure_loss, params, update_model)


class StatefulModel(NamedTuple):
  """A model split for the data-parallel runtime (:func:`split_model_with_state`).

  Attributes:
    loss_fn: ``loss_fn(params, model_state, batch, key) -> (loss,
      (model_state, aux))``, the runtime's signature.
    params: the trained variables' values (a pure ``nnx.State``, as
      ``nnx.Optimizer`` hands them to optax).
    model_state: the values of the mutable variables the loss updates (e.g.
      ``nnx.BatchStat``), a pure ``nnx.State``.
    merge: ``merge(params, model_state)`` returns a model holding them (for
      evaluation).
  """

  loss_fn: Callable[[Any, Any, Any, Any], Any]
  params: Any
  model_state: Any
  merge: Callable[[Any, Any], Any]


def split_model_with_state(
  model: Any,
  loss_fn: Callable[[Any, Any, Any], Any],
  *,
  wrt: Any = None,
  mutable: Any = None,
) -> StatefulModel:
  """Splits an NNX ``model`` for :func:`grpo_optax.training.data_parallel`.

  Args:
    model: a ``flax.nnx.Module``.
    loss_fn: ``loss_fn(model, batch, key) -> (loss, aux)``; it may update
      the ``mutable`` variables (BatchNorm in training mode does).
    wrt: the NNX filter of the trained variables (default ``nnx.Param``).
    mutable: the NNX filter of the model state the loss updates, averaged
      over the replicas by the runtime (default ``nnx.BatchStat``). Other
      variables are held constant.

  Returns:
    A :class:`StatefulModel` ``(loss_fn, params, model_state, merge)``.

  Examples:
    >>> from flax import nnx
    >>> import jax, jax.numpy as jnp
    >>> bn = nnx.BatchNorm(2, rngs=nnx.Rngs(0))
    >>> sm = split_model_with_state(bn, lambda m, x, k: (jnp.sum(m(x)), None))
    >>> loss, (stats, _) = sm.loss_fn(sm.params, sm.model_state,
    ...                               jnp.ones((4, 2)), None)
    >>> [round(float(v), 6) for v in stats["mean"]]  # 0.99 * 0 + 0.01 * 1
    [0.01, 0.01]
  """
  if not callable(loss_fn):
    raise TypeError(f"`loss_fn` must be callable, got {loss_fn!r}.")
  from flax import nnx  # pylint: disable=g-import-not-at-top

  wrt = nnx.Param if wrt is None else wrt
  mutable = nnx.BatchStat if mutable is None else mutable
  graphdef, params, state, rest = nnx.split(model, wrt, mutable, ...)
  # Pure states (arrays, no Variable objects): what optax sees, and merged
  # into fresh variables at the trace level of each call.
  # flax 0.12.2 (the lowest supported) names it nnx.pure.
  as_pure = getattr(nnx, "as_pure", None) or nnx.pure
  params, state, rest = (as_pure(t) for t in (params, state, rest))

  def pure_loss(p, s, batch, key):
    m = nnx.merge(graphdef, p, s, rest)
    loss, aux = loss_fn(m, batch, key)
    return loss, (as_pure(nnx.state(m, mutable)), aux)

  def merge(p, s):
    return nnx.merge(graphdef, p, s, rest)

  return StatefulModel(pure_loss, params, state, merge)
