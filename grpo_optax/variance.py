"""Variance-based dynamic learning rate (seed mechanism 1).

Article 000 §2.1 scales the learning rate by ``1 / (1 + 0.1 * variance)``: high
gradient variance (noisy, unstable updates) shrinks the step, low variance lets
it grow back. This module pins the variance estimate (bias-corrected EMAs of
``g`` and ``g²``, or an external estimate) and its reduction.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from grpo_optax import _common
from grpo_optax import _mechanism

__all__ = (
  "ScaleByVarianceLrConfig",
  "ScaleByVarianceLrState",
  "scale_by_variance_lr",
)

REDUCTIONS = ("element", "leaf", "global")


class ScaleByVarianceLrState(NamedTuple):
  """State of :func:`scale_by_variance_lr`."""

  count: jax.Array  # shape=(), dtype=int32
  mu: optax.Updates  # EMA of g
  nu: optax.Updates  # EMA of g**2
  variance: jax.Array  # shape=(), dtype=float32: mean variance (diagnostic)
  lr_scale: (
    jax.Array
  )  # shape=(), dtype=float32: mean 1/(1+coef*var) (diagnostic)

  def metrics(self) -> dict[str, jax.Array]:
    return {"variance": self.variance, "lr_scale": self.lr_scale}


@functools.partial(jax.jit, static_argnames=("reduction", "normalize"))
def _moments_leaf(g, mu, nu, gv, decay, bc, *, reduction, normalize):
  """One leaf's EMAs and its variance: ``(mu, nu, var, nu_hat)``.

  ``var`` (and ``nu_hat`` when ``normalize``) per element for the
  ``"element"`` reduction, the leaf's sum for ``"leaf"`` and ``"global"``
  (:func:`_per_leaf_scales` divides them on the stack of every leaf's);
  ``nu_hat`` is None without ``normalize``. ``gv``: the ``grad_variance``
  leaf, or None. Jitted, so that leaves of one shape share one trace.
  """
  mu_new = optax.tree.update_moment(g, mu, decay, 1)
  nu_new = optax.tree.update_moment_per_elem_norm(g, nu, decay, 2)
  if gv is not None:
    var = jnp.maximum(jnp.asarray(gv, jnp.float32), 0.0)
  else:
    # The floor 0 as ``0 * bc``, a runtime scalar: XLA:CPU's reduction
    # fusion takes a broadcast constant as an array operand, and one zeros
    # array per leaf shape (shared by its leaves) was written out and read
    # every step (4 bytes per parameter, and a kernel per shape).
    var = jnp.maximum(
      nu_new.astype(jnp.float32) / bc
      - jnp.square(mu_new.astype(jnp.float32) / bc),
      jnp.float32(0) * bc,
    )
  nu_hat = nu_new.astype(jnp.float32) / bc if normalize else None
  if reduction != "element":
    var = _common.sum32(var)
    nu_hat = None if nu_hat is None else _common.sum32(nu_hat)
  return mu_new.astype(mu.dtype), nu_new.astype(nu.dtype), var, nu_hat


def _per_leaf_scales(var_sums, nu_sums, sizes, reduction, coef, eps):
  """The ``"leaf"`` and ``"global"`` scales ``1 / (1 + coef var)`` from the
  leaves' sums: ``(scales, mean variance, mean scale)``.

  The per-leaf arithmetic runs on the stack of the sums, one kernel for all
  leaves, and reaches each leaf as one scalar of :func:`_common.unstack`:
  leaf by leaf, each leaf's division and scale were kernels of their own.
  The means are over the parameters (each leaf weighted by its size).
  """
  n = np.asarray(sizes, np.float32)
  if not n.sum():  # no elements: no variance, the scale 1
    one = jnp.ones((), jnp.float32)
    return [one] * len(var_sums), jnp.zeros((), jnp.float32), one
  total = float(n.sum())
  if reduction == "global":
    var = _common.total(var_sums) / total
    if nu_sums is not None:
      var = var / (_common.total(nu_sums) / total + eps)
    scale = 1.0 / (1.0 + coef * var)
    return [scale] * len(var_sums), var, scale
  count = np.maximum(n, 1.0)
  var = _common.stack(var_sums) / count
  if nu_sums is not None:
    var = var / (_common.stack(nu_sums) / count + eps)
  scale = 1.0 / (1.0 + coef * var)
  weights = n / total
  return (
    _common.unstack(scale),
    jnp.sum(var * weights),
    jnp.sum(scale * weights),
  )


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def _scale_leaf(g, var, denom, coef, eps, *, out_dtype):
  """``g / (1 + coef var)`` (``var / (denom + eps)`` when ``denom`` is given)
  per element, in the params' dtype, and samples of the variance and the
  scale.
  """
  if denom is not None:
    var = var / (denom + eps)
  scale = 1.0 / (1.0 + coef * var)
  return _apply_scale(g, scale, out_dtype), {
    "var": _common.strided_sample(var),
    "scale": _common.strided_sample(scale),
  }


def _apply_scale(g, scale, out_dtype):
  """``g`` times its leaf's scale, in the params' dtype."""
  return (g * scale).astype(jnp.promote_types(g.dtype, out_dtype))


@dataclasses.dataclass(frozen=True)
class ScaleByVarianceLrConfig(_mechanism.Config):
  """The knobs of :func:`scale_by_variance_lr`, validated (see its arguments).

  Attributes:
    coef: the coefficient ``c``, >= 0.
    decay: EMA decay ``d`` in [0, 1).
    eps: added to the normaliser when ``normalize``, >= 0.
    reduction: ``"element"``, ``"leaf"`` or ``"global"``.
    normalize: divide the variance by the mean second moment.
  """

  coef: Any = 0.1
  decay: Any = 0.99
  eps: Any = 1e-12
  reduction: str = "leaf"
  normalize: bool = False

  def __post_init__(self):
    _common.check_range("coef", self.coef, 0.0)
    _common.check_range("decay", self.decay, 0.0, 1.0, high_inclusive=False)
    _common.check_range("eps", self.eps, 0.0)
    _common.check_choice("reduction", self.reduction, REDUCTIONS)
    _common.check_bool("normalize", self.normalize)
    self._set(
      coef=_common.f32(self.coef),
      decay=_common.f32(self.decay),
      eps=_common.f32(self.eps),
    )

  def init(self, params):
    return ScaleByVarianceLrState(
      count=jnp.zeros([], jnp.int32),
      mu=optax.tree.zeros_like(params),
      nu=optax.tree.zeros_like(params),
      variance=jnp.zeros([], jnp.float32),
      lr_scale=jnp.ones([], jnp.float32),
    )

  def update(
    self,
    updates,
    state,
    params=None,
    *,
    grad_variance: optax.Updates | None = None,
    **extra_args,
  ):
    del params, extra_args
    coef, decay, eps, reduction, normalize = (
      self.coef,
      self.decay,
      self.eps,
      self.reduction,
      self.normalize,
    )
    _common.check_tree_like("scale_by_variance_lr", updates, state.mu)
    count_inc = _common.safe_increment(state.count)
    bc = _common.bias_correction(decay, count_inc)
    g_leaves, treedef = jax.tree.flatten(updates)
    gv_leaves = [None] * len(g_leaves)
    if grad_variance is not None:
      _common.check_same_structure(
        "grad_variance", grad_variance, updates, "scale_by_variance_lr"
      )
      gv_leaves = treedef.flatten_up_to(grad_variance)
    sizes = [g.size for g in g_leaves]
    mus, nus, var, nu_hat = [], [], [], []
    for g, mu, nu, gv in zip(
      g_leaves,
      treedef.flatten_up_to(state.mu),
      treedef.flatten_up_to(state.nu),
      gv_leaves,
    ):
      m, n, v, h = _moments_leaf(
        g, mu, nu, gv, decay, bc, reduction=reduction, normalize=normalize
      )
      mus.append(m)
      nus.append(n)
      var.append(v)
      nu_hat.append(h)
    dtypes = [m.dtype for m in treedef.flatten_up_to(state.mu)]
    if reduction == "element":
      out, stats = [], _common.SampledMoments()
      for g, v, d, dt in zip(g_leaves, var, nu_hat, dtypes):
        o, moments = _scale_leaf(g, v, d, coef, eps, out_dtype=dt)
        out.append(o)
        stats.add(g.size, **moments)
      mean_var, mean_scale = stats.mean("var"), stats.mean("scale", 1.0)
    else:
      scales, mean_var, mean_scale = _per_leaf_scales(
        var, nu_hat if normalize else None, sizes, reduction, coef, eps
      )
      out = [
        _apply_scale(g, c, dt) for g, c, dt in zip(g_leaves, scales, dtypes)
      ]
    return treedef.unflatten(out), ScaleByVarianceLrState(
      count=count_inc,
      mu=treedef.unflatten(mus),
      nu=treedef.unflatten(nus),
      variance=mean_var,
      lr_scale=mean_scale,
    )


def scale_by_variance_lr(
  coef: float = 0.1,
  decay: float = 0.99,
  eps: float = 1e-12,
  reduction: str = "leaf",
  normalize: bool = False,
) -> optax.GradientTransformationExtraArgs:
  r"""Divides updates by ``1 + coef * variance`` of the gradient.

  With ``d = decay`` and ``t`` the count before the step:

  .. math::
    \mu_t = d\mu_{t-1} + (1-d) g, \quad \nu_t = d\nu_{t-1} + (1-d) g^2,
    \quad \hat\mu = \mu_t/(1-d^{t+1}), \quad \hat\nu = \nu_t/(1-d^{t+1})

    \sigma^2 = \operatorname{R}\big(\max(\hat\nu - \hat\mu^2, 0)\big), \qquad
    \text{out} = g / (1 + c\,\sigma^2)

  where ``R`` is the ``reduction``: ``"element"`` (none, a per-coordinate
  rate), ``"leaf"`` (mean over each leaf) or ``"global"`` (mean over all
  elements of the tree). With ``normalize=True`` the variance is divided by
  ``R(ν̂) + eps`` (per element for ``"element"``), making the scale invariant
  to the gradient's magnitude: ``σ²/E[g²]`` is the noise-to-signal ratio of
  McCandlish et al.'s gradient noise scale. Without it, raw variances of small
  gradients (say 1e-6) make the rate 1; put the transform after an adaptive
  step (as :func:`grpo_optax.grpo` does) or normalise.

  The extra argument ``grad_variance=`` (a tree like the updates, e.g. the
  across-example variance of per-example gradients from ``jax.vmap``) replaces
  the temporal estimate; the EMAs are still updated.

  ``coef=0`` is the identity. The state records the mean variance and the mean
  rate ``1/(1 + c σ²)`` for logging (:func:`grpo_optax.metrics`).

  Args:
    coef: the coefficient ``c`` (article default 0.1), >= 0.
    decay: EMA decay ``d`` in [0, 1).
    eps: added to the normaliser when ``normalize``, >= 0.
    reduction: ``"element"``, ``"leaf"`` or ``"global"``.
    normalize: divide the variance by the mean second moment.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Examples:
    >>> import jax.numpy as jnp, optax, grpo_optax
    >>> tx = optax.chain(optax.scale_by_adam(),
    ...                  grpo_optax.scale_by_variance_lr(coef=0.1),
    ...                  optax.scale(-1e-3))
    >>> params = {"w": jnp.zeros(4)}
    >>> updates, state = tx.update({"w": jnp.ones(4)}, tx.init(params))

  References:
    McCandlish et al., `An Empirical Model of Large-Batch Training
    <https://arxiv.org/abs/1812.06162>`_, 2018.
    Zhuang et al., `AdaBelief Optimizer
    <https://arxiv.org/abs/2010.07468>`_, 2020.
  """
  return ScaleByVarianceLrConfig(
    coef, decay, eps, reduction, normalize
  ).transform()
