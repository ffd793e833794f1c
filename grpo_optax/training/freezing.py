"""Freezing that saves compute: a train step that never differentiates frozen leaves.

``grpo_optax.freeze_below`` zeroes the *updates* of frozen leaves, but the
gradient has been computed by then. :func:`frozen_train_step` takes the mask
itself (e.g. ``grpo_optax.frozen_mask(opt_state)``) and compiles a step in
which the frozen leaves enter the loss as constants: JAX emits no cotangent
for them, so XLA drops their weight-gradient matmuls, and when a whole bottom
part of the network is frozen (embeddings and the first layers) the backward
pass stops where the last trainable parameter is, saving the input-gradient
work below it too.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from grpo_optax.training import _tree

__all__ = (
  "FrozenStep",
  "frozen_train_step",
)


class FrozenStep:
  """Train steps compiled per freezing mask.

  Build with :func:`frozen_train_step`. Call ``.step(params, opt_state,
  batch, frozen)``; ``.compiled(frozen, params)`` returns the jitted step of
  one mask, ``(params, opt_state, batch) -> (params, opt_state, loss)``.
  """

  def __init__(
    self,
    loss_fn: Callable[[Any, Any], jax.Array],
    tx: optax.GradientTransformation,
    *,
    donate: bool,
    max_cached: int,
  ):
    self.loss_fn = loss_fn
    self.tx = tx
    self.donate = _tree.check_flag("donate", donate)
    self.max_cached = _tree.check_positive_int("max_cached", max_cached)
    self._cache: collections.OrderedDict = collections.OrderedDict()

  @property
  def num_compiled(self) -> int:
    """Number of masks with a cached step."""
    return len(self._cache)

  def _make(self, trainable: tuple[bool, ...]):
    def step(params, opt_state, batch):
      leaves, treedef = jax.tree.flatten(params)
      loss, g = _tree.value_and_grad_subset(
        self.loss_fn, params, trainable, batch
      )
      # Frozen leaves get a constant zero gradient: no compute, and a global
      # norm over the tree equals the norm over the trainable leaves.
      g = [
        gi if t else jnp.zeros(x.shape, x.dtype)
        for gi, x, t in zip(g, leaves, trainable)
      ]
      updates, opt_state = self.tx.update(
        treedef.unflatten(g), opt_state, params
      )
      new = jax.tree.leaves(optax.apply_updates(params, updates))
      # Frozen parameters are passed through untouched (bit-identical).
      new = [n if t else x for n, x, t in zip(new, leaves, trainable)]
      return treedef.unflatten(new), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1) if self.donate else ())

  def compiled(self, frozen: Any, params: Any):
    """The jitted step for mask ``frozen`` (built on first use, then cached).

    Raises:
      ValueError: if ``frozen`` is not a tree of booleans shaped like
        ``params``.
    """
    mask = _tree.resolve_mask(frozen, params, name="frozen")
    key = (jax.tree.structure(params), mask)
    fn = self._cache.get(key)
    if fn is None:
      fn = self._make(tuple(not m for m in mask))
      self._cache[key] = fn
      if len(self._cache) > self.max_cached:
        self._cache.popitem(last=False)
    else:
      self._cache.move_to_end(key)
    return fn

  def step(self, params: Any, opt_state: Any, batch: Any, frozen: Any):
    """One step that updates only the leaves where ``frozen`` is False.

    Args:
      params: the parameters (donated when built with ``donate=True``).
      opt_state: ``tx.init(params)`` of the full tree (donated likewise).
      batch: passed to ``loss_fn``.
      frozen: a tree of booleans shaped like ``params`` (Python bools, NumPy
        or concrete JAX scalars; read on the host, so a device mask costs one
        transfer). A new mask compiles a new step.

    Returns:
      ``(params, opt_state, loss)``.
    """
    return self.compiled(frozen, params)(params, opt_state, batch)


def frozen_train_step(
  loss_fn: Callable[[Any, Any], jax.Array],
  tx: optax.GradientTransformation,
  *,
  donate: bool = True,
  max_cached: int = 8,
) -> FrozenStep:
  r"""A train step that does not compute gradients of frozen parameters.

  With a static mask :math:`F` (True = frozen) the step computes

  .. math::

    g = \nabla_{\theta_{\lnot F}} L(\theta_{\lnot F}, \theta_F), \qquad
    (u, s) = \mathrm{tx.update}((g, 0_F), s, \theta), \qquad
    \theta_{\lnot F} \leftarrow \theta_{\lnot F} + u_{\lnot F}, \quad
    \theta_F \text{ unchanged (bit-identical)}.

  The optimizer sees the full tree with constant zero gradients at frozen
  leaves, so a global-norm clip measures the trainable leaves only, and the
  trainable leaves move exactly as in a plain step on the trainable subset
  (for transforms that do not couple leaves through anything but sums of
  squares). The frozen leaves' optimizer state is updated with zero
  gradients (Adam's moments decay), which matters only if they are unfrozen
  later. Each distinct mask compiles its own program, keyed by the tuple of
  bools; the ``max_cached`` most recent ones are kept.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar``.
    tx: any optax transformation, initialised on the full params.
    donate: donate ``params`` and ``opt_state``.
    max_cached: how many compiled masks to keep.

  Returns:
    A :class:`FrozenStep` with ``.step(params, opt_state, batch, frozen)``.

  References:
    Brock et al., "FreezeOut: Accelerate Training by Progressively Freezing
    Layers", 2017, https://arxiv.org/abs/1706.04983

    Liu et al., "AutoFreeze: Automatically Freezing Model Blocks to
    Accelerate Fine-tuning", 2021, https://arxiv.org/abs/2102.01386
  """
  return FrozenStep(loss_fn, tx, donate=donate, max_cached=max_cached)
