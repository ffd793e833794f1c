"""Variance-based dynamic learning rate (seed mechanism 1).

Article 000 §2.1 scales the learning rate by ``1 / (1 + 0.1 * variance)``: high
gradient variance (noisy, unstable updates) shrinks the step, low variance lets
it grow back. This module pins the variance estimate (bias-corrected EMAs of
``g`` and ``g²``, or an external estimate) and its reduction.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from grpo_optax import _common

__all__ = (
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


def _reduce(values, sizes, reduction):
  """Reduces a list of per-leaf arrays: element (none), leaf or global mean."""
  if reduction == "element":
    return values
  if reduction == "leaf":
    return [_common.mean32(v) for v in values]
  total = sum(sizes)
  s = sum((_common.sum32(v) for v in values), jnp.zeros((), jnp.float32))
  g = s / max(total, 1)
  return [g for _ in values]


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
  _common.check_range("coef", coef, 0.0)
  _common.check_range("decay", decay, 0.0, 1.0, high_inclusive=False)
  _common.check_range("eps", eps, 0.0)
  _common.check_choice("reduction", reduction, REDUCTIONS)
  _common.check_bool("normalize", normalize)

  coef = _common.f32(coef)
  decay = _common.f32(decay)
  eps = _common.f32(eps)

  def init_fn(params):
    return ScaleByVarianceLrState(
      count=jnp.zeros([], jnp.int32),
      mu=optax.tree.zeros_like(params),
      nu=optax.tree.zeros_like(params),
      variance=jnp.zeros([], jnp.float32),
      lr_scale=jnp.ones([], jnp.float32),
    )

  def update_fn(
    updates,
    state,
    params=None,
    *,
    grad_variance: optax.Updates | None = None,
    **extra_args,
  ):
    del params, extra_args
    _common.check_tree_like("scale_by_variance_lr", updates, state.mu)
    count_inc = _common.safe_increment(state.count)
    mu = optax.tree.update_moment(updates, state.mu, decay, 1)
    nu = optax.tree.update_moment_per_elem_norm(updates, state.nu, decay, 2)
    bc = _common.bias_correction(decay, count_inc)

    g_leaves, treedef = jax.tree.flatten(updates)
    mu_leaves = treedef.flatten_up_to(mu)
    nu_leaves = treedef.flatten_up_to(nu)
    if grad_variance is not None:
      _common.check_same_structure(
        "grad_variance", grad_variance, updates, "scale_by_variance_lr"
      )
      var = [
        jnp.maximum(jnp.asarray(v, jnp.float32), 0.0)
        for v in treedef.flatten_up_to(grad_variance)
      ]
    else:
      var = [
        jnp.maximum(
          n.astype(jnp.float32) / bc - jnp.square(m.astype(jnp.float32) / bc),
          0.0,
        )
        for m, n in zip(mu_leaves, nu_leaves)
      ]
    sizes = [g.size for g in g_leaves]
    var = _reduce(var, sizes, reduction)
    if normalize:
      nu_hat = [n.astype(jnp.float32) / bc for n in nu_leaves]
      denom = _reduce(nu_hat, sizes, reduction)
      var = [v / (d + eps) for v, d in zip(var, denom)]

    scales = [1.0 / (1.0 + coef * v) for v in var]
    # In the params' dtype as optax's moments give it (bfloat16 gradients of
    # float32 params: float32), the gradient's promoted with the EMAs'.
    out = [
      (g * s).astype(jnp.promote_types(g.dtype, m.dtype))
      for g, s, m in zip(g_leaves, scales, treedef.flatten_up_to(state.mu))
    ]

    # Diagnostics: exact for per-leaf/global rates, on a strided sample for
    # per-element rates (no extra pass over the leaf).
    stats = _common.SampledMoments()
    for v, sc, n in zip(var, scales, sizes):
      stats.add(
        n, var=_common.strided_sample(v), scale=_common.strided_sample(sc)
      )

    return treedef.unflatten(out), ScaleByVarianceLrState(
      count=count_inc,
      mu=optax.tree.cast_like(mu, state.mu),
      nu=optax.tree.cast_like(nu, state.nu),
      variance=stats.mean("var"),
      lr_scale=stats.mean("scale", 1.0),
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
