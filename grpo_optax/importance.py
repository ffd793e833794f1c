"""Importance weighting by Taylor expansion (seed mechanism 2).

Article 004 §1.1 and §2.1 weight each parameter's update by its contribution to
the loss, estimated with a second-order Taylor expansion whose Hessian is
approximated by its diagonal, and weight attention heads by the entropy of
their attention. This module pins that as a per-element weight built from the
first- and second-order terms of the loss change caused by removing the
parameter (Molchanov et al., 2019).
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
  "ScaleByImportanceConfig",
  "ScaleByImportanceState",
  "per_head",
  "scale_by_importance",
)


class ScaleByImportanceState(NamedTuple):
  """State of :func:`scale_by_importance`."""

  count: jax.Array  # shape=(), dtype=int32
  hessian: (
    optax.Updates | None
  )  # EMA of g**2 (Fisher diagonal); None if order 1
  score: optax.Updates  # EMA of the Taylor score s
  weight_mean: jax.Array  # shape=(), float32: mean weight over all elements
  weight_std: jax.Array  # shape=(), float32: std of the weights
  score_std: jax.Array  # shape=(), float32: std of S/mean(S) over all elements

  def metrics(self) -> dict[str, jax.Array]:
    parts = [
      _common.strided_sample(s).astype(jnp.float32)
      / (_common.mean32(s) + 1e-12)
      for s in jax.tree.leaves(self.score)
      if s.size
    ]
    return {
      "weight_mean": self.weight_mean,
      "weight_std": self.weight_std,
      "score_std": self.score_std,
      "weights": (
        jnp.concatenate([_common.flat_sample(x) for x in parts])
        if parts
        else jnp.zeros((0,), jnp.float32)
      ),
    }


def per_head(entropy: jax.Array, axis: int, ndim: int) -> jax.Array:
  """Reshapes a vector of per-head entropies to broadcast along ``axis``.

  Args:
    entropy: shape ``(num_heads,)``.
    axis: the head axis of the parameter (negative values count from the end).
    ndim: the parameter's number of dimensions.

  Returns:
    ``entropy`` with shape ``(1, ..., num_heads, ..., 1)``, ready to be a leaf
    of the ``head_entropy`` extra argument of :func:`scale_by_importance`.
  """
  for name, value in (("axis", axis), ("ndim", ndim)):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
      raise TypeError(
        f"{name} must be an int; got {value!r} ({type(value).__name__})"
      )
  axis, ndim = int(axis), int(ndim)
  entropy = jnp.asarray(entropy)
  if entropy.ndim != 1:
    raise ValueError(f"entropy must be a vector, got shape {entropy.shape}")
  if not -ndim <= axis < ndim:
    raise ValueError(f"axis must be in [{-ndim}, {ndim}); got {axis}")
  shape = [1] * ndim
  shape[axis % ndim] = entropy.shape[0]
  return entropy.reshape(shape)


def _static_order(order: Any) -> int | None:
  """``order`` as a Python int if given as a number, ``None`` for an array.

  The order is structural (order 1 keeps no Fisher buffer), so it is decided
  from Python numbers only: an array (e.g. injected by
  ``optax.inject_hyperparams``, concrete or traced) keeps the buffer and is
  read at run time, so that jitted and plain ``init`` give the same state.
  """
  v = _common.concrete_value(order, "order")
  if v is not None and v not in (1.0, 2.0):
    raise ValueError(f"order must be in {{1, 2}}; got {order!r}")
  if isinstance(order, (int, np.integer)) and not isinstance(order, bool):
    return int(order)
  return None


def _extra_leaves(treedef, n, hessian_diag, head_entropy):
  """The leaves of the ``hessian_diag`` and ``head_entropy`` extra args."""
  hd_leaves = (
    treedef.flatten_up_to(hessian_diag)
    if hessian_diag is not None
    else [None] * n
  )
  if head_entropy is None:
    return hd_leaves, [None] * n
  try:
    return hd_leaves, treedef.flatten_up_to(head_entropy)
  except (ValueError, TypeError) as e:
    raise ValueError(
      "scale_by_importance: `head_entropy` must have the updates' tree"
      f" structure with None for unweighted leaves: {e}"
    ) from None


def _ratio_scale(mean, bc):
  """``1 / (bc (mean / bc + 1e-12))``: the normalised score is ``S`` times
  this scalar, ``S_hat / (mean S_hat + 1e-12)`` with ``S_hat = S / bc``.

  A product, not ``(S / bc) / denom``: XLA counts an array division as
  expensive and writes it out once for its readers (the moments, the
  update), a kernel and a buffer per leaf.
  """
  return 1.0 / (bc * (mean / bc + 1e-12))


def _weight(ratio, min_weight, max_weight):
  return jnp.clip(ratio, min_weight, max_weight)


def _sample_moments(stats, bc, min_weight, max_weight):
  """Mean of the sampled weights and of their squares, and the same of the
  normalised score ``r`` (:func:`_ratio_scale`), over the tree, computed on the
  stacked samples of the leaves (:meth:`_common.SampledMoments.means`).
  """

  def derive(d, sizes):
    # From the stacked sums (each one a reduction's output), not from
    # stacked means or denominators: computed leaf by leaf, those would be
    # a kernel per leaf.
    shape = d["s"].shape[:1] + (1,) * (d["s"].ndim - 1)
    r = d["s"] * _ratio_scale(
      d["sum"].reshape(shape) / sizes.reshape(shape), bc
    )
    w = _weight(r, min_weight, max_weight)
    if "head" in d:
      w = w * d["head"]
    return {"w": w, "w2": w * w, "r": r, "r2": r * r}

  keys = ("s", "sum") + (("head",) if "head" in stats.parts else ())
  return stats.means(derive, *keys, w=1.0, w2=0.0, r=0.0, r2=0.0)


@jax.jit
def _importance_leaf(g, p, s_old, h_old, hd, ent, hyper):
  """One leaf of :func:`scale_by_importance`: ``(out, S, h, samples)``.

  ``h_old`` is None for order 1; ``hd`` (a given Hessian diagonal) and
  ``ent`` (per-head entropies) are None when not given; ``samples`` are
  the leaf's score on its strided grid, its sum and (with ``ent``)
  its head factors there, from which :func:`_sample_moments` computes the
  diagnostics. Jitted, so that leaves of one shape share one trace and one
  lowered function (XLA inlines the calls).
  """
  decay, bc, use_second, min_weight, max_weight = hyper
  g32 = g.astype(jnp.float32)
  p32 = p.astype(jnp.float32)
  score = jnp.abs(g32 * p32)
  h = None
  if h_old is not None:
    if hd is None:
      h32 = decay * h_old.astype(jnp.float32) + (1 - decay) * g32 * g32
      h = h32.astype(h_old.dtype)
      h_hat = h32 / bc
    else:
      h = h_old
      h_hat = jnp.asarray(hd, jnp.float32)
    score = score + use_second * 0.5 * h_hat * p32 * p32
  s = decay * s_old.astype(jnp.float32) + (1 - decay) * score
  total = _common.sum32(s)
  scale = _ratio_scale(total / max(s.size, 1), bc)

  w = _weight(s * scale, min_weight, max_weight)
  head = 1.0
  if ent is not None:
    ent = jnp.asarray(ent, jnp.float32)
    head = ent / (jnp.mean(ent) + 1e-12)
    w = w * head
  # The params' dtype as optax's stateful transforms give it: the gradient's
  # promoted with the score's (which follows the params).
  out = (g32 * w).astype(jnp.promote_types(g.dtype, s_old.dtype))
  # Diagnostics on a strided sample: no extra pass over the leaf. The
  # weights of the sample are computed on the stack of every leaf's sample
  # (_sample_moments), not here: that is one kernel per group of leaves of
  # one shape instead of several per leaf.
  samples = {"s": _common.strided_sample(s), "sum": total.reshape(1)}
  if ent is not None:
    samples["head"] = _common.strided_sample(jnp.broadcast_to(head, s.shape))
  return out, s.astype(s_old.dtype), h, samples


@dataclasses.dataclass(frozen=True)
class ScaleByImportanceConfig(_mechanism.Config):
  """The knobs of :func:`scale_by_importance`, validated (see its arguments).

  Attributes:
    order: 1 (first-order Taylor term) or 2 (with the diagonal Hessian).
    decay: EMA decay of the statistics, in [0, 1).
    min_weight: lower clip of the weights, >= 0.
    max_weight: upper clip of the weights, >= min_weight.
  """

  order: Any = 2
  decay: Any = 0.9
  min_weight: Any = 0.1
  max_weight: Any = 10.0

  def __post_init__(self):
    _static_order(self.order)
    _common.check_range("decay", self.decay, 0.0, 1.0, high_inclusive=False)
    _common.check_range("min_weight", self.min_weight, 0.0)
    _common.check_range("max_weight", self.max_weight, 0.0)
    lo, hi = (
      _common.concrete_value(self.min_weight, "min_weight"),
      _common.concrete_value(self.max_weight, "max_weight"),
    )
    if lo is not None and hi is not None and hi < lo:
      raise ValueError(
        f"max_weight must be >= min_weight; got {self.max_weight!r} < "
        f"{self.min_weight!r}"
      )
    self._set(
      decay=_common.f32(self.decay),
      min_weight=_common.f32(self.min_weight),
      max_weight=_common.f32(self.max_weight),
    )

  @property
  def static_order(self) -> int | None:
    """The order as a Python int, or None when traced."""
    return _static_order(self.order)

  def init(self, params):
    static_order = self.static_order
    return ScaleByImportanceState(
      count=jnp.zeros([], jnp.int32),
      hessian=None if static_order == 1 else optax.tree.zeros_like(params),
      score=optax.tree.zeros_like(params),
      weight_mean=jnp.ones([], jnp.float32),
      weight_std=jnp.zeros([], jnp.float32),
      score_std=jnp.zeros([], jnp.float32),
    )

  def update(
    self,
    updates,
    state,
    params=None,
    *,
    hessian_diag=None,
    head_entropy=None,
    **extra_args,
  ):
    del extra_args
    order, decay, min_weight, max_weight = (
      self.order,
      self.decay,
      self.min_weight,
      self.max_weight,
    )
    static_order = self.static_order
    _common.require_params(
      params, "scale_by_importance", "(the Taylor score is |g * p| + h p^2 / 2)"
    )
    _common.check_tree_like("scale_by_importance", updates, state.score)
    _common.check_same_structure(
      "params", params, updates, "scale_by_importance"
    )
    if hessian_diag is not None:
      _common.check_same_structure(
        "hessian_diag", hessian_diag, updates, "scale_by_importance"
      )
    count_inc = _common.safe_increment(state.count)
    bc = _common.bias_correction(decay, count_inc)
    second = state.hessian is not None
    # With a traced `order` (inject_hyperparams) the state still has `hessian`.
    use_second = (
      (jnp.asarray(order) == 2).astype(jnp.float32)
      if (static_order is None)
      else 1.0
    )

    g_leaves, treedef = jax.tree.flatten(updates)
    p_leaves = treedef.flatten_up_to(params)
    s_leaves = treedef.flatten_up_to(state.score)
    h_leaves = (
      treedef.flatten_up_to(state.hessian) if second else [None] * len(g_leaves)
    )
    hd_leaves, ent_leaves = _extra_leaves(
      treedef, len(g_leaves), hessian_diag, head_entropy
    )

    new_h, new_s, outs = [], [], []
    stats = _common.SampledMoments()
    hyper = (decay, bc, use_second, min_weight, max_weight)
    with_head = any(e is not None for e in ent_leaves)
    for g, p, s_old, h_old, hd, ent in zip(
      g_leaves, p_leaves, s_leaves, h_leaves, hd_leaves, ent_leaves
    ):
      out, s, h, samples = _importance_leaf(
        g, p, s_old, h_old if second else None, hd, ent, hyper
      )
      outs.append(out)
      new_s.append(s)
      if second:
        new_h.append(h)
      if with_head and "head" not in samples:
        samples["head"] = jnp.ones_like(samples["s"])  # no head weighting
      stats.add(g.size, **samples)
    m = _sample_moments(stats, bc, min_weight, max_weight)
    w_mean = m["w"]
    new_state = ScaleByImportanceState(
      count=count_inc,
      hessian=treedef.unflatten(new_h) if second else None,
      score=treedef.unflatten(new_s),
      weight_mean=w_mean,
      weight_std=jnp.sqrt(jnp.maximum(m["w2"] - w_mean**2, 0.0)),
      score_std=jnp.sqrt(jnp.maximum(m["r2"] - m["r"] ** 2, 0.0)),
    )
    return treedef.unflatten(outs), new_state


def scale_by_importance(
  order: int = 2,
  decay: float = 0.9,
  min_weight: float = 0.1,
  max_weight: float = 10.0,
) -> optax.GradientTransformationExtraArgs:
  r"""Weights each update element by its Taylor importance.

  Removing parameter :math:`p` changes the loss by about
  :math:`-g p + \tfrac12 H_{pp} p^2` (first- and second-order Taylor terms with
  a diagonal Hessian). With ``d = decay`` and ``t`` the count before the step:

  .. math::
    h_t = d h_{t-1} + (1-d) g^2,\quad \hat h = h_t / (1-d^{t+1})
    \quad\text{(Fisher diagonal, or the ``hessian_diag`` extra arg)}

    s = |g p| + [\text{order}=2]\,\tfrac12 \hat h p^2,\quad
    S_t = d S_{t-1} + (1-d) s,\quad \hat S = S_t/(1-d^{t+1})

    w = \operatorname{clip}\!\big(\hat S / (\operatorname{mean}_{leaf}\hat S
        + 10^{-12}),\ w_{min},\ w_{max}\big),\qquad \text{out} = g\,w

  The mean is over each leaf, so weights redistribute the step inside a tensor
  (mean weight about 1) without changing the overall scale between tensors.

  Extra arguments (keyword, optional):

  * ``hessian_diag``: a tree like the updates with a diagonal-Hessian estimate
    (e.g. Hutchinson's or Gauss-Newton-Bartlett's, as Sophia computes them); it
    replaces :math:`\hat h` and the Fisher EMA is left untouched.
  * ``head_entropy``: a tree with the updates' structure whose leaves are
    ``None`` (no head weighting) or per-head attention entropies that broadcast
    against the leaf (see :func:`per_head`); that leaf's weights are multiplied
    by ``entropy / mean(entropy)``.

  The state keeps the mean and standard deviation of the weights and the
  standard deviation of the normalised score :math:`\hat S/\operatorname{mean}\hat S`
  (the article's early-stop signal, see :func:`grpo_optax.importance_converged`),
  estimated on a strided sample of at most 1,024 entries per leaf so that
  logging adds no pass over the parameters.

  Args:
    order: 1 (first-order term only, no Hessian state) or 2. Structural: an
      array value (as ``optax.inject_hyperparams`` passes it) keeps the
      Fisher buffer; pass ``static_args=("order",)`` to inject the rest.
    decay: EMA decay ``d`` in [0, 1).
    min_weight: lower clip of the weights, >= 0.
    max_weight: upper clip of the weights, >= ``min_weight``.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; its update needs ``params``.

  Examples:
    >>> import jax.numpy as jnp, grpo_optax
    >>> tx = grpo_optax.scale_by_importance()
    >>> params = {"w": jnp.array([0.0, 1.0, 2.0])}
    >>> g = {"w": jnp.ones(3)}
    >>> out, _ = tx.update(g, tx.init(params), params)
    >>> [round(float(x), 2) for x in out["w"]]
    [0.1, 0.82, 2.18]

  References:
    Molchanov et al., `Importance Estimation for Neural Network Pruning
    <https://arxiv.org/abs/1906.10771>`_, CVPR 2019.
    Liu et al., `Sophia: A Scalable Stochastic Second-order Optimizer
    <https://arxiv.org/abs/2305.14342>`_, 2023.
    Michel et al., `Are Sixteen Heads Really Better than One?
    <https://arxiv.org/abs/1905.10650>`_, 2019.
  """
  return ScaleByImportanceConfig(
    order, decay, min_weight, max_weight
  ).transform()
