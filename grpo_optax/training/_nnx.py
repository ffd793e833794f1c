"""Adapter from a Flax NNX model to the pure ``loss_fn(params, batch)`` form.

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
