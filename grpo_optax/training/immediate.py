"""Immediate updates: donated (in-place) steps and a layer-wise fused update.

Two programs that change *where* the update happens:

* :func:`train_step` donates the parameters and the optimizer state to the
  compiled step, so XLA writes the new values into the old buffers instead
  of allocating a second copy of both (``jax.jit(..., donate_argnums)``).

* :func:`layerwise_train_step` fuses the backward pass and the update of a
  stack of identical layers (parameters stacked on a leading axis, forward
  with ``lax.scan``). A reverse loop over the layers computes one layer's
  weight gradient with ``jax.vjp``, hands it to the optimizer with that
  layer's slice of the optimizer state and applies it at once, so at most one
  layer's gradient exists at a time (cf. LOMO).

What the fused update saves, and what it does not:

* Saved: the gradient buffers. A plain step holds the whole gradient tree
  (one parameter-sized buffer) between the backward pass and the update; the
  fused step holds one layer's gradient. Peak memory drops by about one
  parameter-sized buffer, which matters when parameters and optimizer state
  dominate memory (large models, small batches).
* Not saved: activations. The forward pass still stores each layer's input
  (``L`` activation-sized buffers), so activation memory stays O(depth); the
  claim "memory O(depth) -> O(1)" holds only for the gradient buffers. The
  fused step stores only the layer *inputs* and recomputes each layer's
  forward inside its backward (per-layer rematerialisation): that costs one
  extra forward pass of the stack (about +1/3 FLOPs) and stores less than
  plain backprop, which keeps every residual of every layer.
* Global-norm clipping needs every gradient before any update, which
  contradicts the fused order. Here ``tx`` is applied per layer, so
  ``optax.clip_by_global_norm`` inside ``tx`` clips each layer separately;
  ``max_norm=`` instead scales all gradients by ``min(1, max_norm / n)``
  with ``n`` the global gradient norm of the *previous* step (accumulated
  during the backward pass and kept in the state; no clipping on the first
  step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from grpo_optax.training import _tree

__all__ = (
  "LayerwiseState",
  "LayerwiseStep",
  "StackedParams",
  "layerwise_train_step",
  "stacked_loss_fn",
  "train_step",
)


def train_step(
  loss_fn: Callable[[Any, Any], jax.Array],
  tx: optax.GradientTransformation,
  *,
  donate: bool = True,
  has_aux: bool = False,
):
  """A jitted ``(params, opt_state, batch) -> (params, opt_state, loss)``.

  With ``donate=True`` the step donates ``params`` and ``opt_state``
  (``donate_argnums=(0, 1)``): their buffers are reused for the outputs and
  the caller's arrays are deleted (``x.is_deleted()``), so the update is in
  place and the step needs no second copy of the parameters and optimizer
  state.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar`` (or ``(scalar, aux)``).
    tx: an optax transformation; it receives ``params``.
    donate: donate ``params`` and ``opt_state``.
    has_aux: ``loss_fn`` returns ``(loss, aux)``; the step then returns
      ``(params, opt_state, (loss, aux))``.

  Returns:
    The jitted step.
  """
  _tree.check_flag("donate", donate)
  _tree.check_flag("has_aux", has_aux)

  def step(params, opt_state, batch):
    value, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return jax.jit(step, donate_argnums=(0, 1) if donate else ())


class StackedParams(NamedTuple):
  """Parameters of ``head(layers^L(embed(batch)))``.

  Attributes:
    embed: parameters of ``embed_fn`` (any pytree, may be empty).
    layers: parameters of one layer, each leaf stacked on a leading axis of
      size ``L`` (the number of layers).
    head: parameters of ``head_fn`` (any pytree, may be empty).
  """

  embed: Any
  layers: Any
  head: Any


class LayerwiseState(NamedTuple):
  """Optimizer state of :func:`layerwise_train_step`.

  Attributes:
    embed: ``tx`` state of the embedding parameters.
    layers: ``tx`` state of one layer, stacked on a leading axis of size
      ``L`` (``jax.vmap(tx.init)``), so layer ``l`` owns slice ``l``.
    head: ``tx`` state of the head parameters.
    grad_norm: global gradient norm of the last step (before clipping).
  """

  embed: Any
  layers: Any
  head: Any
  grad_norm: jax.Array  # shape=(), dtype=float32.


def stacked_loss_fn(
  embed_fn: Callable[[Any, Any], jax.Array],
  layer_fn: Callable[[Any, jax.Array], jax.Array],
  head_fn: Callable[[Any, jax.Array, Any], jax.Array],
  *,
  remat: bool = False,
):
  """The plain ``loss_fn(params: StackedParams, batch)`` of a layer stack.

  ``h_0 = embed_fn(embed, batch)``, ``h_{l+1} = layer_fn(layers[l], h_l)``
  by ``lax.scan``, ``loss = head_fn(head, h_L, batch)``. Use it with
  :func:`train_step` for the exact step the fused one is compared with.
  ``remat=True`` wraps ``layer_fn`` in ``jax.checkpoint`` (stores only layer
  inputs, like the fused step).
  """
  body = (
    jax.checkpoint(layer_fn) if _tree.check_flag("remat", remat) else layer_fn
  )

  def loss_fn(params: StackedParams, batch: Any) -> jax.Array:
    h = embed_fn(params.embed, batch)
    h, _ = jax.lax.scan(lambda h, p: (body(p, h), None), h, params.layers)
    return head_fn(params.head, h, batch)

  return loss_fn


def _sum_squares(tree: Any) -> jax.Array:
  return sum(
    (jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)),
    jnp.zeros((), jnp.float32),
  )


def _index(tree: Any, i: jax.Array) -> Any:
  return jax.tree.map(
    lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), tree
  )


def _set_index(tree: Any, value: Any, i: jax.Array) -> Any:
  return jax.tree.map(
    lambda x, v: jax.lax.dynamic_update_index_in_dim(
      x, v.astype(x.dtype), i, 0
    ),
    tree,
    value,
  )


class LayerwiseStep:
  """Fused backward + update for :class:`StackedParams`.

  Build with :func:`layerwise_train_step`. ``step`` is jitted with signature
  ``(params, state, batch) -> (params, state, loss)`` and donates ``params``
  and ``state`` when built with ``donate=True``.
  """

  def __init__(self, embed_fn, layer_fn, head_fn, tx, *, max_norm, donate):
    _tree.check_flag("donate", donate)
    if max_norm is not None:
      _tree.check_real("max_norm", max_norm, "None or a float > 0")
    if max_norm is not None and not float(max_norm) > 0:
      raise ValueError(f"`max_norm` must be > 0 or None, got {max_norm!r}.")
    self.embed_fn, self.layer_fn, self.head_fn = embed_fn, layer_fn, head_fn
    self.tx = tx
    self.max_norm = None if max_norm is None else float(max_norm)
    self.loss_fn = stacked_loss_fn(embed_fn, layer_fn, head_fn)
    self.step = jax.jit(self._step, donate_argnums=(0, 1) if donate else ())

  def init(self, params: StackedParams) -> LayerwiseState:
    """Per-part optimizer states; the layers' state is vmapped over layers."""
    if not isinstance(params, StackedParams):
      raise TypeError("`params` must be a StackedParams(embed, layers, head).")
    return LayerwiseState(
      embed=self.tx.init(params.embed),
      layers=jax.vmap(self.tx.init)(params.layers),
      head=self.tx.init(params.head),
      grad_norm=jnp.zeros((), jnp.float32),
    )

  def _scale(self, prev_norm: jax.Array) -> jax.Array:
    if self.max_norm is None:
      return jnp.ones((), jnp.float32)
    # min(1, c / n), and 1 while n == 0 (first step).
    return jnp.minimum(1.0, self.max_norm / jnp.maximum(prev_norm, 1e-30))

  def _apply(self, grads, opt_state, params, scale):
    grads = jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)
    updates, opt_state = self.tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def _step(self, params: StackedParams, state: LayerwiseState, batch: Any):
    scale = self._scale(state.grad_norm)
    # Forward: keep only each layer's input.
    h0, embed_vjp = jax.vjp(lambda e: self.embed_fn(e, batch), params.embed)
    h_last, inputs = jax.lax.scan(
      lambda h, p: (self.layer_fn(p, h), h), h0, params.layers
    )
    # Head: gradient, then update at once.
    loss, head_vjp = jax.vjp(
      lambda hp, h: self.head_fn(hp, h, batch), params.head, h_last
    )
    g_head, dh = head_vjp(jnp.ones_like(loss))
    sq = _sum_squares(g_head)
    head, head_state = self._apply(g_head, state.head, params.head, scale)
    del g_head
    # Layers, top to bottom: recompute the layer, backprop, update in place.
    num_layers = jax.tree.leaves(params.layers)[0].shape[0]

    def body(i, carry):
      dh, layers, layer_states, sq = carry
      l = num_layers - 1 - i
      p, s = _index(layers, l), _index(layer_states, l)
      _, vjp = jax.vjp(self.layer_fn, p, inputs[l])
      g, dh = vjp(dh)
      # The update runs inside a conditional whose predicate XLA cannot fold
      # (always true at run time): its operands and results are materialised,
      # so every read of the old slices happens before the in-place writes
      # below. Without it XLA fuses the optimizer arithmetic into the writes,
      # reading whole stacks of state there, and keeps a copy of each stack.
      p, s = jax.lax.cond(
        l >= 0,
        lambda a: self._apply(*a),
        lambda a: (a[2], a[1]),
        (g, s, p, scale),
      )
      return (
        dh,
        _set_index(layers, p, l),
        _set_index(layer_states, s, l),
        sq + _sum_squares(g),
      )

    dh, layers, layer_states, sq = jax.lax.fori_loop(
      0, num_layers, body, (dh, params.layers, state.layers, sq)
    )
    # Embedding last.
    (g_embed,) = embed_vjp(dh)
    sq = sq + _sum_squares(g_embed)
    embed, embed_state = self._apply(g_embed, state.embed, params.embed, scale)
    new_state = LayerwiseState(
      embed_state, layer_states, head_state, jnp.sqrt(sq)
    )
    return StackedParams(embed, layers, head), new_state, loss


def layerwise_train_step(
  embed_fn: Callable[[Any, Any], jax.Array],
  layer_fn: Callable[[Any, jax.Array], jax.Array],
  head_fn: Callable[[Any, jax.Array, Any], jax.Array],
  tx: optax.GradientTransformation,
  *,
  max_norm: float | None = None,
  donate: bool = True,
) -> LayerwiseStep:
  r"""Fused backward + per-layer update for a stack of identical layers.

  The model is :math:`L = \mathrm{head}(f_{L-1} \circ \dots \circ f_0(
  \mathrm{embed}(x)))` with :math:`f_l = ` ``layer_fn(layers[l], .)``. The
  step runs the forward pass with ``lax.scan`` storing the layer inputs
  :math:`h_l`, then

  1. :math:`(g_\mathrm{head}, \delta_L) = \mathrm{vjp}_\mathrm{head}(1)`;
     update the head;
  2. for :math:`l = L-1, \dots, 0`: :math:`(g_l, \delta_l) =
     \mathrm{vjp}_{f_l}(\theta_l, h_l)(\delta_{l+1})` (recomputing
     :math:`f_l`), then at once :math:`(u_l, s_l) = ` ``tx.update(c g_l,
     s_l, theta_l)``, :math:`\theta_l \leftarrow \theta_l + u_l`, written in
     place into the stacked parameters and state;
  3. :math:`g_\mathrm{embed} = \mathrm{vjp}_\mathrm{embed}(\delta_0)`;
     update the embedding.

  Every gradient is taken at the parameters of the start of the step, so for
  a transformation that acts per leaf (sgd, momentum, adam, adamw, ...) the
  result equals the plain step's up to float rounding. :math:`c` is 1, or
  :math:`\min(1, \mathrm{max\_norm}/\|g^{(t-1)}\|)` with the previous step's
  global norm when ``max_norm`` is set. A transformation that couples leaves
  (``clip_by_global_norm``) sees one part at a time: it acts per layer.

  Memory: at most one layer's gradient is alive, instead of the whole
  gradient tree (about one parameter-sized buffer less at peak). Activations
  are not saved: the layer inputs (:math:`L` activation buffers) stay stored.
  Compute: one extra forward pass of the stack (per-layer recomputation).

  Args:
    embed_fn: ``embed_fn(embed_params, batch) -> h_0``.
    layer_fn: ``layer_fn(layer_params, h) -> h`` (same shape and dtype).
    head_fn: ``head_fn(head_params, h_L, batch) -> scalar loss``.
    tx: an elementwise / per-leaf optax transformation.
    max_norm: clip by the previous step's global gradient norm, or None.
    donate: donate ``params`` and ``state`` (the in-place update needs it).

  Returns:
    A :class:`LayerwiseStep` with ``.init(params)``, the jitted
    ``.step(params, state, batch) -> (params, state, loss)`` and the plain
    ``.loss_fn(params, batch)``.

  References:
    Lv et al., "Full Parameter Fine-tuning for Large Language Models with
    Limited Resources" (LOMO), 2023, https://arxiv.org/abs/2306.09782
  """
  return LayerwiseStep(
    embed_fn, layer_fn, head_fn, tx, max_norm=max_norm, donate=donate
  )
