"""Hierarchical gradient estimation: exact core gradients, stale non-core ones.

Parameters are labelled *core* or *non-core* by a rule over their paths. Every
``refresh_every`` steps a *full* step computes the exact gradient of every
parameter; in between, a *skip* step differentiates the loss with respect to
the core parameters only and re-uses an estimate of the non-core gradient.

The skip step is a different program, not a masked one: the non-core leaves
enter the loss as constants, so JAX emits no cotangent for them and XLA never
sees the matmuls that would produce their weight gradients. Input gradients
(the backward pass through activations) still flow through every non-core
layer that lies between the loss and a core parameter, so the saving is the
non-core *weight*-gradient work: for a dense layer ``y = x W`` that is the
``x^T dy`` matmul, one third of the layer's forward+backward FLOPs.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from grpo_optax import _common
from grpo_optax.training import _tree

__all__ = (
  "DEFAULT_NONCORE_PATTERN",
  "HierarchicalState",
  "HierarchicalStep",
  "default_is_core",
  "hierarchical_step",
)

#: Path components of the parameters that are non-core by default: MLP /
#: feed-forward / dense blocks, normalisation layers and dense output heads.
#: Matched against whole path components (``layers/0/mlp/fc1/kernel``).
DEFAULT_NONCORE_PATTERN = (
  r"(^|/)(mlp|ffn|feed_?forward|fc\d*|dense\w*|mlm_head|lm_head|head"
  r"|ln(_?\w+)?|\w*norm\w*)(/|$)"
)

_NONCORE_RE = re.compile(DEFAULT_NONCORE_PATTERN, re.IGNORECASE)

_APPROX = ("last", "momentum", "zero")


def default_is_core(path: str, leaf: Any = None) -> bool:
  """The default core rule: everything not matched by the non-core pattern.

  With the default pattern, attention projections (``query``, ``key``,
  ``value``, ``out``) and embeddings are core; MLP blocks, layer norms and the
  dense output head are non-core.

  Args:
    path: the leaf's path, e.g. ``"layers/0/attn/query/kernel/value"``.
    leaf: the leaf (unused).

  Returns:
    True if the leaf is core.
  """
  del leaf
  return _NONCORE_RE.search(path) is None


class HierarchicalState(NamedTuple):
  """State of :func:`hierarchical_step`.

  Attributes:
    count: number of full (refresh) steps taken so far.
    estimate: params-shaped; at non-core leaves the last exact non-core
      gradient (``approx="last"``) or its EMA before bias correction
      (``approx="momentum"``); ``optax.MaskedNode()`` at core leaves (and at
      every leaf for ``approx="zero"``), so it holds no memory there.
  """

  count: jax.Array  # shape=(), dtype=int32.
  estimate: Any


class HierarchicalStep:
  """Two compiled train steps, full and skip, selected by the step number.

  Build with :func:`hierarchical_step`. Attributes ``full_step`` and
  ``skip_step`` are the jitted steps, with signature
  ``(params, opt_state, h_state, batch) -> (params, opt_state, h_state,
  loss)``; both donate ``params``, ``opt_state`` and ``h_state``. Lower them
  (``.lower(...).compile()``) to inspect XLA's cost and memory analyses.
  """

  def __init__(
    self,
    loss_fn: Callable[[Any, Any], jax.Array],
    tx: optax.GradientTransformation,
    *,
    is_core: _tree.Rule,
    refresh_every: int,
    approx: str,
    momentum: float,
  ):
    if approx not in _APPROX:
      raise ValueError(f"`approx` must be one of {_APPROX}, got {approx!r}.")
    self.loss_fn = loss_fn
    self.tx = tx
    self.is_core = is_core
    self.refresh_every = _tree.check_positive_int(
      "refresh_every", refresh_every
    )
    self.approx = approx
    self.momentum = _tree.check_fraction("momentum", momentum)
    donate = (0, 1, 2)
    self.full_step = jax.jit(
      self._make_train(refresh=True), donate_argnums=donate
    )
    self.skip_step = jax.jit(
      self._make_train(refresh=False), donate_argnums=donate
    )

  # -- labels ---------------------------------------------------------------

  def _mask(self, params: Any) -> tuple[bool, ...]:
    return _tree.resolve_mask(self.is_core, params, name="is_core")

  def core_mask(self, params: Any) -> Any:
    """The labels as a bool tree shaped like ``params`` (True = core)."""
    return jax.tree.unflatten(jax.tree.structure(params), self._mask(params))

  def _stores(self, mask: tuple[bool, ...]) -> list[bool]:
    """Which leaves have an estimate in the state."""
    return [(not c) and self.approx != "zero" for c in mask]

  # -- state ----------------------------------------------------------------

  def init(self, params: Any) -> HierarchicalState:
    """Zero estimates for the non-core leaves; works on ShapeDtypeStructs."""
    leaves, treedef = jax.tree.flatten(params)
    stores = self._stores(self._mask(params))
    est = [
      jnp.zeros(x.shape, x.dtype) if s else optax.MaskedNode()
      for x, s in zip(leaves, stores)
    ]
    return HierarchicalState(
      count=jnp.zeros((), jnp.int32), estimate=treedef.unflatten(est)
    )

  # -- gradients ------------------------------------------------------------

  def gradient(
    self, params: Any, h_state: HierarchicalState, batch: Any, *, refresh: bool
  ) -> tuple[jax.Array, Any, HierarchicalState]:
    """The gradient the optimizer sees, and the new state (pure, traceable).

    Args:
      params: the parameters.
      h_state: a :class:`HierarchicalState`.
      batch: passed to ``loss_fn``.
      refresh: a Python bool; True computes every gradient exactly (full
        step), False only the core ones (skip step).

    Returns:
      ``(loss, grads, new_h_state)``; ``grads`` is shaped like ``params``.
    """
    leaves, treedef = jax.tree.flatten(params)
    mask = self._mask(params)
    stores = self._stores(mask)
    est = jax.tree.leaves(h_state.estimate)  # MaskedNodes have no leaves.
    if len(est) != sum(stores):
      raise ValueError(
        "`h_state` does not match params: build it with"
        " .init(params) of the same HierarchicalStep."
      )
    beta = self.momentum
    if refresh:
      loss, grads = jax.value_and_grad(self.loss_fn)(params, batch)
      g = jax.tree.leaves(grads)
      new_est, it = [], iter(est)
      for gi, s in zip(g, stores):
        if not s:
          new_est.append(optax.MaskedNode())
        elif self.approx == "last":
          next(it)
          new_est.append(gi)
        else:  # momentum: EMA of the exact non-core gradients.
          m = next(it)
          new_est.append((beta * m + (1 - beta) * gi).astype(m.dtype))
      count = _common.safe_increment(h_state.count)
      return loss, grads, HierarchicalState(count, treedef.unflatten(new_est))

    loss, g = _tree.value_and_grad_subset(self.loss_fn, params, mask, batch)
    if self.approx == "momentum":
      c = jnp.maximum(h_state.count, 1).astype(jnp.float32)
      bc = 1 - jnp.asarray(beta, jnp.float32) ** c
      est = [(m / bc).astype(m.dtype) for m in est]
    it = iter(est)
    filled = []
    for gi, x, core, s in zip(g, leaves, mask, stores):
      if core:
        filled.append(gi)
      elif s:
        filled.append(next(it))
      else:
        filled.append(jnp.zeros(x.shape, x.dtype))
    return loss, treedef.unflatten(filled), h_state

  def _make_train(self, *, refresh: bool):
    def train(params, opt_state, h_state, batch):
      loss, grads, h_state = self.gradient(
        params, h_state, batch, refresh=refresh
      )
      updates, opt_state = self.tx.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      return params, opt_state, h_state, loss

    return train

  # -- stepping -------------------------------------------------------------

  def is_refresh(self, step: int) -> bool:
    """True if ``step`` (a Python int) runs the full step."""
    try:
      step = operator.index(step)
    except TypeError:
      raise TypeError(
        "`step` must be a Python int (the step number), got"
        f" {type(step).__name__}; a traced step cannot select"
        " between the two compiled programs."
      ) from None
    return step % self.refresh_every == 0

  def step(
    self,
    params: Any,
    opt_state: Any,
    h_state: HierarchicalState,
    batch: Any,
    step: int,
  ):
    """Runs the full step if ``step % refresh_every == 0``, else the skip step.

    The inputs ``params``, ``opt_state`` and ``h_state`` are donated: do not
    use them after the call.

    Returns:
      ``(params, opt_state, h_state, loss)``.
    """
    fn = self.full_step if self.is_refresh(step) else self.skip_step
    return fn(params, opt_state, h_state, batch)


def hierarchical_step(
  loss_fn: Callable[[Any, Any], jax.Array],
  tx: optax.GradientTransformation,
  *,
  is_core: _tree.Rule = default_is_core,
  refresh_every: int = 4,
  approx: str = "last",
  momentum: float = 0.9,
) -> HierarchicalStep:
  r"""Train step with exact core gradients and periodically refreshed others.

  Let :math:`\theta = (\theta_c, \theta_n)` be the core and non-core
  parameters and :math:`t` the step number. With :math:`R` = ``refresh_every``
  the optimizer receives

  .. math::

    \hat g_t = \big(\nabla_{\theta_c} L(\theta_t),\ \tilde g_{n,t}\big),
    \qquad
    \tilde g_{n,t} = \begin{cases}
      \nabla_{\theta_n} L(\theta_t) & t \bmod R = 0 \text{ (full step)} \\
      e_t & \text{otherwise (skip step)}
    \end{cases}

  where the estimate :math:`e_t` is, by ``approx``:

  * ``"last"``: the last exact non-core gradient, :math:`e_t = g_{n,s}` with
    :math:`s` the last full step;
  * ``"momentum"``: the bias-corrected EMA of the exact non-core gradients of
    the full steps, :math:`m_k = \beta m_{k-1} + (1-\beta) g_{n,s_k}`,
    :math:`e_t = m_k / (1-\beta^k)` after :math:`k` full steps;
  * ``"zero"``: :math:`e_t = 0` (no memory; the optimizer's own momentum
    keeps moving the non-core parameters, as in DropBP's dropped layers).

  Trade-off: a skip step saves the non-core weight-gradient matmuls (about a
  third of those layers' forward+backward FLOPs) but the non-core direction
  is up to :math:`R-1` steps stale; ``"last"``/``"momentum"`` also keep one
  gradient-sized buffer per non-core leaf. On a full step the cost is that of
  a plain step. Averaged, the FLOPs are
  :math:`(1 + (R-1)\,r)/R` of a plain step, with :math:`r` the skip/full
  ratio from ``skip_step.lower(...).compile().cost_analysis()``.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar``.
    tx: any optax transformation; it sees the whole gradient tree every step.
    is_core: the labelling rule: a regex searched in each leaf's path string
      (``"layers/0/attn/query/kernel"``; True = core), a callable
      ``(path, leaf) -> bool``, or a bool tree shaped like the params.
      Default: :func:`default_is_core`.
    refresh_every: full step every this many steps (``R >= 1``; 1 = always
      exact).
    approx: ``"last"``, ``"momentum"`` or ``"zero"``, see above.
    momentum: :math:`\beta` of ``approx="momentum"``, in [0, 1).

  Returns:
    A :class:`HierarchicalStep` with ``.init(params)`` and
    ``.step(params, opt_state, h_state, batch, step)``.

  Raises:
    ValueError: for an unknown ``approx``, ``refresh_every < 1``, ``momentum``
      outside [0, 1), or (at ``init``/first step) an ``is_core`` tree that
      does not match the params.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> params = {"attn": jnp.ones(3), "mlp": jnp.ones(3)}
    >>> loss = lambda p, x: jnp.sum((p["attn"] * p["mlp"] - x) ** 2)
    >>> hs = hierarchical_step(loss, optax.sgd(0.1), refresh_every=2)
    >>> opt_state, h_state = hs.tx.init(params), hs.init(params)
    >>> for t in range(4):
    ...   params, opt_state, h_state, l = hs.step(params, opt_state, h_state,
    ...                                            jnp.zeros(3), t)
    >>> int(h_state.count)
    2

  References:
    Teng et al., "DropBP: Accelerating Fine-Tuning of Large Language Models
    by Dropping Backward Propagation", 2024, https://arxiv.org/abs/2402.17812

    Sun et al., "meProp: Sparsified Back Propagation for Accelerated Deep
    Learning with Reduced Overfitting", ICML 2017,
    https://arxiv.org/abs/1706.06197
  """
  return HierarchicalStep(
    loss_fn,
    tx,
    is_core=is_core,
    refresh_every=refresh_every,
    approx=approx,
    momentum=momentum,
  )
