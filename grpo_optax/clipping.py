"""Global-norm clipping with coupled L2 regularisation (seed mechanism 6).

Article 004 §1.3 mixes "L2 regularisation and gradient clipping" and reports
a "gradient explosion rate" (3% vs 12%). This transform adds the L2 gradient,
clips by the global norm with a single multiply, and counts clipped steps so
that the rate is measurable: ``clipped / count``.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from grpo_optax import _common
from grpo_optax import _mechanism

__all__ = (
  "ClipWithL2Config",
  "ClipWithL2State",
  "clip_with_l2",
)


class ClipWithL2State(NamedTuple):
  """State of :func:`clip_with_l2`."""

  count: jax.Array  # shape=(), dtype=int32: steps seen
  clipped: (
    jax.Array
  )  # shape=(), dtype=int32: steps whose norm exceeded max_norm
  last_norm: jax.Array  # shape=(), dtype=float32: global norm before clipping

  def metrics(self) -> dict[str, jax.Array]:
    return {
      "clip_rate": self.clipped.astype(jnp.float32)
      / jnp.maximum(self.count.astype(jnp.float32), 1.0),
      "clipped_steps": self.clipped,
      "grad_norm": self.last_norm,
    }


def clip_factor(norm: jax.Array, max_norm) -> jax.Array:
  """``min(1, max_norm / norm)``: the global-norm clip as one multiplier.

  Computed as ``max_norm / max(norm, max_norm)``, the same number (``c / c``
  is exactly 1) with the division last: XLA does not copy a division into
  each of its consumers, so every leaf's kernels read the factor as one
  scalar buffer, where ``min(1, .)`` after the division was copied into
  each of them (two instructions per kernel, 9% of the dense preset's
  instructions on a 384-leaf tree; ``docs/design.md``, "Compile time"). An
  infinite ``max_norm`` (no clipping) is the factor 1.
  """
  bound = _common.concrete_value(max_norm, "max_norm")
  if bound is None:  # traced: inf / inf would be NaN
    return jnp.minimum(1.0, max_norm / norm)
  if np.isinf(bound):
    return jnp.ones_like(norm)
  return max_norm / jnp.maximum(norm, max_norm)


def _leaf_sums(arrays: list[jax.Array]) -> list[jax.Array]:
  """Float32 sums of equally shaped arrays in one variadic reduction.

  All of a leaf's sums in one kernel, over every axis (no flattening, so a
  sharded leaf reduces shard by shard plus a scalar all-reduce): XLA:CPU
  compiles and launches every reduction separately, and the number of
  kernel instances is what the compile time of a many-leaf model grows with.
  """
  arrays = [x.astype(jnp.float32) for x in arrays]
  if len(arrays) > 1:
    # XLA's SPMD partitioner turns a variadic reduction of a sharded array
    # into an all-gather of the partial sums; separate sums all-reduce.
    return [jnp.sum(x) for x in arrays]
  zero = np.float32(0)
  return list(
    jax.lax.reduce(
      tuple(arrays),
      tuple(zero for _ in arrays),
      _common.add_pairwise,
      tuple(range(arrays[0].ndim)),
    )
  )


#: Leaves of at most this many entries have their norm summed together
#: with the other small leaves of their shape (see :func:`norm_with_l2`).
SMALL_LEAF = 16384


def _sq_sums(g, p, l2) -> jax.Array:
  """``|g|^2 + 2 l2 <g, p> + l2^2 |p|^2`` summed over every entry
  (``p=None``: ``|g|^2``).
  """
  g = g.astype(jnp.promote_types(g.dtype, jnp.float32))
  if p is None:
    return _leaf_sums([_common.abs_sq(g)])[0]
  p = jnp.asarray(p).astype(g.dtype)
  gg, gp, pp = _leaf_sums(
    [_common.abs_sq(g), jnp.real(g * jnp.conj(p)), _common.abs_sq(p)]
  )
  return gg + 2 * l2 * gp + l2 * l2 * pp


def norm_with_l2(
  g_leaves: list[jax.Array], p_leaves: list[Any] | None, l2: Any
) -> jax.Array:
  """``||g + l2 p||`` over all leaves, from reductions over the inputs only.

  ``|g|^2 + 2 l2 <g, p> + l2^2 |p|^2`` (``p_leaves=None``: ``|g|^2``): every
  reduction reads arrays already in memory, so ``g + l2 p`` is never
  materialised for its norm (on CPU that temporary costs more than the
  whole update).

  Small leaves (at most :data:`SMALL_LEAF` entries: biases, norm scales) of
  equal shape, dtype and sharding (on one device, or an Explicit mesh) are
  stacked and reduced together. XLA:CPU
  compiles the sum of a small vector as three kernels (a square, a windowed
  partial sum, a final sum) where a large leaf's is one, so per-leaf sums of
  a transformer's biases and norm scales were half of the kernels of the
  update (720 of 2,018 on 384 leaves). The stack copies only these small
  leaves, along a new leading axis, so each keeps its own sharding.
  """
  per_leaf = []
  groups: dict[Any, list[int]] = {}
  for i, g in enumerate(g_leaves):
    if g.size == 0:
      continue
    if g.size <= SMALL_LEAF:
      spec = _common.explicit_spec(g)
      key = (g.shape, jnp.dtype(g.dtype), spec)
      if spec is None and jax.device_count() > 1:
        # Several devices and no known layout (an Auto mesh): leaves of
        # one shape may be sharded differently, and their stack would
        # reshard one of them. Each is summed on its own.
        key = (i,)
      groups.setdefault(key, []).append(i)
    else:
      per_leaf.append(
        _sq_sums(g, None if p_leaves is None else p_leaves[i], l2)
      )
  for idx in groups.values():
    if len(idx) == 1:
      i = idx[0]
      per_leaf.append(
        _sq_sums(g_leaves[i], None if p_leaves is None else p_leaves[i], l2)
      )
      continue
    g = jnp.stack([g_leaves[i] for i in idx])
    p = (
      None
      if p_leaves is None
      else jnp.stack([jnp.asarray(p_leaves[i]).astype(g.dtype) for i in idx])
    )
    per_leaf.append(_sq_sums(g, p, l2))
  return jnp.sqrt(jnp.maximum(_common.total(per_leaf), 0.0))


def global_norm32(tree) -> jax.Array:
  """Global L2 norm of a tree, accumulated in float32 (0 for an empty tree)."""
  return norm_with_l2(jax.tree.leaves(tree), None, 0.0)


def next_state(
  state: ClipWithL2State, norm: jax.Array, max_norm
) -> ClipWithL2State:
  """The state after a step whose norm before clipping was ``norm``."""
  return ClipWithL2State(
    count=_common.safe_increment(state.count),
    clipped=jnp.where(
      norm > max_norm, _common.safe_increment(state.clipped), state.clipped
    ),
    last_norm=norm.astype(jnp.float32),
  )


@dataclasses.dataclass(frozen=True)
class ClipWithL2Config(_mechanism.Config):
  """The knobs of :func:`clip_with_l2`, validated (see its arguments).

  Attributes:
    max_norm: the global-norm bound ``c``, > 0 (``inf``: no clipping).
    l2: coefficient of the coupled L2 term, >= 0, or None (off).
  """

  max_norm: Any = 1.0
  l2: Any = None

  def __post_init__(self):
    _common.check_range("max_norm", self.max_norm, 0.0, low_inclusive=False)
    if self.l2 is not None:
      _common.check_range("l2", self.l2, 0.0)
    self._set(max_norm=_common.f32(self.max_norm), l2=_common.f32(self.l2))

  @property
  def l2_on(self) -> bool:
    """Whether the L2 term is on (a static 0 is off, a traced value on)."""
    return not (self.l2 is None or _common.is_static_zero(self.l2))

  def init(self, params) -> ClipWithL2State:
    del params
    return ClipWithL2State(
      count=jnp.zeros([], jnp.int32),
      clipped=jnp.zeros([], jnp.int32),
      last_norm=jnp.zeros([], jnp.float32),
    )

  def update(self, updates, state, params=None, **extra_args):
    del extra_args
    leaves, treedef = jax.tree.flatten(updates)
    p_leaves = None
    if self.l2_on:
      _common.require_params(
        params,
        "clip_with_l2",
        "when l2 is non-zero or traced (pass l2=None to switch it off)",
      )
      _common.check_same_structure("params", params, updates, "clip_with_l2")
      p_leaves = treedef.flatten_up_to(params)
    outs, norm = clip_leaves(leaves, p_leaves, self)
    return treedef.unflatten(outs), next_state(state, norm, self.max_norm)


def clip_leaves(
  g_leaves: list[jax.Array], p_leaves: list[Any] | None, cfg: ClipWithL2Config
) -> tuple[list[jax.Array], jax.Array]:
  """``a = (g + l2 p) min(1, max_norm / ||g + l2 p||)`` per leaf, and the
  norm: the mechanism's math, shared with the fused core.
  """
  l2 = cfg.l2 if p_leaves is not None else None
  norm = norm_with_l2(g_leaves, p_leaves, l2)
  scale = clip_factor(norm, cfg.max_norm)
  outs = []
  for i, g in enumerate(g_leaves):
    a = g if p_leaves is None else g + l2 * p_leaves[i]
    outs.append((a * scale).astype(g.dtype))
  return outs, norm


def clip_with_l2(
  max_norm: float = 1.0,
  l2: float | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Adds coupled L2 regularisation, then clips by the global norm.

  .. math::
    a = g + \lambda p, \qquad n = \|a\|_2 \text{ (over the whole tree)}, \qquad
    \text{out} = a \cdot \min(1, c / n)

  with ``c = max_norm`` and ``λ = l2``. The scale is one scalar multiply per
  leaf (no ``where`` over the tree), so XLA fuses it into the next elementwise
  pass. A NaN/Inf gradient gives a NaN norm, hence NaN outputs: the transform
  never hides a non-finite gradient (wrap the optimizer in
  ``optax.apply_if_finite`` to skip such steps).

  The state counts steps and clipped steps (``n > c``): the clipping rate
  ``clipped / count`` is the articles' "gradient explosion rate".

  Args:
    max_norm: the global-norm bound ``c``, > 0.
    l2: coefficient of the coupled L2 term, >= 0. When > 0 the update needs
      ``params``.

  Returns:
    An ``optax.GradientTransformationExtraArgs``. ``l2=0`` equals
    ``optax.clip_by_global_norm(max_norm)``.

  Examples:
    >>> import jax.numpy as jnp, grpo_optax
    >>> tx = grpo_optax.clip_with_l2(max_norm=1.0)
    >>> g = {"w": jnp.array([3.0, 4.0])}
    >>> out, state = tx.update(g, tx.init(g))
    >>> out["w"], int(state.clipped)
    (Array([0.6, 0.8], dtype=float32), 1)

  References:
    Pascanu et al., `On the difficulty of training recurrent neural networks
    <https://arxiv.org/abs/1211.5063>`_, 2013.
    Seetharaman et al., `AutoClip: Adaptive Gradient Clipping
    <https://arxiv.org/abs/2007.14469>`_, 2020.
  """
  return ClipWithL2Config(max_norm, l2).transform()
