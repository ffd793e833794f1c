r"""The gradient exchange: any compressor, with error feedback and DGC's recipe.

An :class:`Exchange` wraps a compressor of the registry
(:mod:`grpo_optax.training.compressors`) in the steps that do not depend on
it: error feedback and Deep Gradient Compression's four techniques, each
switchable (Lin et al. 2018, Algorithm 1 with sections 3.1-3.3), on replica
``i``'s gradient ``g_i``:

.. math::

  g_i &\leftarrow g_i \min\!\bigl(1, \tfrac{c\, W^{-1/2}}{\|g_i\|}\bigr)
      && \text{local clipping (clip\_norm = c)}\\
  u_i &\leftarrow m\, u_i + g_i,\quad v_i \leftarrow v_i + u_i
      && \text{momentum correction (momentum = m)}\\
  \bar g &= \mathrm{compressor}_{f_t}(v_i),\quad v_i \leftarrow v_i -
      \mathrm{sent}_i && \text{error feedback}\\
  u_i &\leftarrow u_i \odot \lnot \mathrm{mask}_i
      && \text{momentum factor masking}

with :math:`f_t` the warm-up's kept fraction (:func:`warmup_fractions`, one
stage per ``warmup_steps`` steps; a compressor with a ``fraction`` only).
Without momentum correction ``u_i = g_i`` and ``v_i`` is the plain residual.
With it, the exchanged value already carries the momentum: the ``tx`` applied
after the exchange should have none (``optax.sgd(lr)`` reproduces DGC's
update :math:`\theta \leftarrow \theta - \eta \bar g`). Masking zeroes the
velocity of every sent entry: at ``fraction = 1`` (or with the dense
exchange) the momentum is gone, as in the paper's algorithm.

The state is always one :class:`ExchangeState` (residual, velocity, step
count, the compressor's own state), whatever the compressor: the fields a
configuration does not use are None. :func:`sparse_pmean` and
:func:`init_exchange` are the function forms (``sparse_pmean`` also takes a
bare residual tree or None, for the stateless configurations).

References:
  Lin, Han, Mao, Wang, Dally. Deep Gradient Compression: Reducing the
  Communication Bandwidth for Distributed Training. ICLR 2018.
  https://arxiv.org/abs/1712.01887

  Stich, Cordonnier, Jaggi. Sparsified SGD with Memory. NeurIPS 2018.
  https://arxiv.org/abs/1809.07599
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from grpo_optax.training import compressors
from grpo_optax.training.compressors import base

AxisName = Any  # A mesh axis name, or a tuple of them.

#: The exchange names (the registry's: ``compressors.NAMES``).
EXCHANGES = compressors.NAMES


class ExchangeState(NamedTuple):
  """State of the exchange of one replica (:meth:`Exchange.init`).

  Attributes:
    residual: the error-feedback accumulation ``v_i`` (the gradient's
      structure), or None (no error feedback, or a lossless compressor).
      Per replica.
    velocity: the momentum-correction velocity ``u_i``, or None
      (``momentum=0``). Per replica.
    count: the number of exchanges so far (int32 scalar; the warm-up
      stage). The same on every replica.
    compressor: the compressor's own state (PowerSGD's ``Q``, the
      replicated support's statistics), or None. The same on every replica.
  """

  residual: Any
  velocity: Any
  count: jax.Array
  compressor: Any = None

  @property
  def support(self) -> Any:
    """The replicated support's ``(rate, age)``, or None."""
    return self.compressor if hasattr(self.compressor, "age") else None

  @property
  def q(self) -> Any:
    """PowerSGD's ``Q`` per leaf, or None."""
    return getattr(self.compressor, "q", None)


#: Fields of :class:`ExchangeState` that differ between replicas.
PER_REPLICA = ("residual", "velocity")


def state_specs(axis: AxisName, replica: Any = None) -> ExchangeState:
  """PartitionSpecs shaped like an :class:`ExchangeState` whose per-replica
  fields have a leading replica axis over ``axis`` (``replica``: the spec of
  those fields, default ``P(axis)``) and whose other fields are replicated.
  """
  per = P(axis) if replica is None else replica
  return ExchangeState._make((per, per, P(), P()))


# -- the pipeline's options ------------------------------------------------------

ERROR_FEEDBACK = base.Option(
  "error_feedback",
  True,
  "bool",
  help="keep a per-replica residual of what was not sent",
)
MOMENTUM = base.Option(
  "momentum",
  0.0,
  "float",
  low=0.0,
  high=1.0,
  high_open=True,
  help="Deep Gradient Compression's momentum correction factor (0: off)",
)
MASK_MOMENTUM = base.Option(
  "mask_momentum",
  True,
  "bool",
  help="momentum factor masking (with momentum)",
)
CLIP_NORM = base.Option(
  "clip_norm",
  None,
  "optional_float",
  low=0.0,
  low_open=True,
  help="local clipping of each replica's gradient at clip_norm / sqrt(W)",
)
WARMUP_STEPS = base.Option(
  "warmup_steps",
  0,
  "int",
  low=0,
  help="steps per stage of the sparsity warm-up: kept fractions 0.25, "
  "0.0625, ... down to fraction (0: off)",
)
#: The options of the exchange around the compressor.
PIPELINE_OPTIONS = (
  ERROR_FEEDBACK,
  MOMENTUM,
  MASK_MOMENTUM,
  CLIP_NORM,
  WARMUP_STEPS,
)


def options_table() -> str:
  """The registry's exchanges and options, then :data:`PIPELINE_OPTIONS`, as
  the Markdown tables of ``docs/communication.md``.
  """
  rows = ["", "| option of every exchange | allowed | default | what |"]
  rows.append("|---|---|---|---|")
  for o in PIPELINE_OPTIONS:
    rows.append(f"| `{o.name}` | {o.allowed()} | {o.default!r} | {o.help} |")
  return compressors.markdown_table() + "\n".join(rows) + "\n"


def warmup_fractions(fraction: float) -> tuple[float, ...]:
  r"""The kept fractions of Deep Gradient Compression's sparsity warm-up.

  :math:`f_s = 4^{-(s+1)}` while it exceeds ``fraction``, then ``fraction``:
  for ``fraction = 0.001``, densities 25%, 6.25%, 1.5625%, 0.39%, 0.1%
  (sparsity 75% -> 93.75% -> 98.4375% -> 99.6% -> 99.9%, the paper's
  schedule over its first four epochs).
  """
  out, d = [], 0.25
  while d > fraction:
    out.append(d)
    d /= 4
  return tuple(out) + (fraction,)


@dataclasses.dataclass(frozen=True)
class Exchange:
  """A compressor with error feedback and DGC's techniques (module docstring).

  Build with :func:`make_exchange`. Immutable and hashable (a compiled step
  closes over it).

  Attributes:
    compressor: the compressor (:mod:`grpo_optax.training.compressors`).
    error_feedback: keep a per-replica residual of what was not sent.
    momentum: Deep Gradient Compression's momentum correction factor (0:
      off).
    mask_momentum: momentum factor masking (with momentum).
    clip_norm: local clipping at ``clip_norm / sqrt(W)``, or None.
    warmup_steps: steps per stage of the sparsity warm-up (0: off); the
      last five are the options of :data:`PIPELINE_OPTIONS`.
  """

  compressor: base.Compressor
  error_feedback: bool = True
  momentum: float = 0.0
  mask_momentum: bool = True
  clip_norm: float | None = None
  warmup_steps: int = 0

  def __post_init__(self):
    for o in PIPELINE_OPTIONS:
      object.__setattr__(self, o.name, o.check(getattr(self, o.name)))
    if self.warmup_steps and not self.compressor.sparse:
      raise ValueError(
        "`warmup_steps` (the sparsity warm-up) needs a sparse exchange (one "
        f"with a `fraction`: {compressors.takers('fraction')}), got "
        f"exchange={self.name!r}."
      )

  @property
  def name(self) -> str:
    """The compressor's registry name."""
    return self.compressor.name

  @property
  def keeps_residual(self) -> bool:
    """Whether the state holds a residual (error feedback of a lossy
    compressor).
    """
    return self.error_feedback and not self.compressor.lossless

  def options(self) -> dict[str, Any]:
    """The compressor's and the pipeline's option values, by name."""
    out = dict(self.compressor.config)
    out.update((o.name, getattr(self, o.name)) for o in PIPELINE_OPTIONS)
    return out

  def init(self, params: Any, seed: int = 0) -> ExchangeState:
    """The initial state of one replica for gradients shaped like ``params``.

    Zero residual (with error feedback) and velocity (with momentum),
    ``count = 0``, the compressor's initial state (``seed``: PowerSGD's
    initial ``Q``, the same on every replica).
    """
    zeros = lambda: jax.tree.map(jnp.zeros_like, params)
    shapes = [tuple(x.shape) for x in jax.tree.leaves(params)]
    return ExchangeState(
      zeros() if self.keeps_residual else None,
      zeros() if self.momentum else None,
      jnp.zeros((), jnp.int32),
      self.compressor.init(shapes, seed),
    )

  def payload_bytes(self, params: Any, num_replicas: int) -> int:
    """Bytes one replica sends per exchange for gradients like ``params``
    (after the warm-up).
    """
    shapes = [tuple(x.shape) for x in jax.tree.leaves(params)]
    return self.compressor.payload_bytes(shapes, num_replicas)

  def __call__(
    self, grads: Any, state: ExchangeState, axis_name: AxisName
  ) -> tuple[Any, ExchangeState]:
    """``(mean, new state)``, inside ``shard_map`` over ``axis_name``."""
    leaves, treedef = jax.tree.flatten(grads)
    _check_leaves(leaves)
    self._check_state(state)
    means, state = self.run_leaves(leaves, state, treedef, axis_name)
    return treedef.unflatten(means), state

  # -- the pipeline ---------------------------------------------------------

  def _check_state(self, state: ExchangeState) -> None:
    if not isinstance(state, ExchangeState):
      raise TypeError(
        f"the exchange state must be an ExchangeState, got {type(state)}."
      )
    for field, want in (
      ("residual", self.keeps_residual),
      ("velocity", bool(self.momentum)),
    ):
      if (getattr(state, field) is not None) != want:
        raise ValueError(
          f"the ExchangeState's {field} must be present exactly when the "
          f"exchange keeps one ({field} {'needed' if want else 'not kept'} "
          f"by {self}): build it with this exchange's init."
        )
    if (state.compressor is None) == self.compressor.stateful:
      raise ValueError(
        "the ExchangeState's compressor state (the replicated support, "
        "PowerSGD's Q) must be present exactly when the compressor keeps "
        f"state ({self.compressor} keeps "
        f"{'some' if self.compressor.stateful else 'none'}): build it with "
        "init_exchange(...) for this exchange."
      )

  def _staged(self, accs, cstate, count, axis_name) -> base.Decompressed:
    """The compressor at the warm-up stage's fraction (``lax.switch`` over
    the stages: each has its own static payload size).
    """
    c = self.compressor
    fractions = (
      warmup_fractions(c.config["fraction"]) if self.warmup_steps else ()
    )
    if len(fractions) <= 1:
      return c.mean(accs, cstate, axis_name)
    stage = jnp.minimum(count // self.warmup_steps, len(fractions) - 1)
    branches = [
      functools.partial(c.replace(fraction=f).mean, axis_name=axis_name)
      for f in fractions
    ]
    return jax.lax.switch(stage, branches, accs, cstate)

  def run_leaves(self, leaves, state: ExchangeState, treedef, axis_name):
    """The DGC pipeline on flat leaves; returns ``(means, new state)``."""
    residual = _flatten_like(state.residual, treedef, "residual")
    velocity = _flatten_like(state.velocity, treedef, "velocity")
    if self.clip_norm is not None:
      leaves = _clip(leaves, self.clip_norm, axis_name)
    if velocity is not None:  # Momentum correction: accumulate the velocity.
      velocity = [
        self.momentum * u + g.astype(u.dtype) for u, g in zip(velocity, leaves)
      ]
      leaves = [u.astype(g.dtype) for u, g in zip(velocity, leaves)]
    if residual is not None:
      leaves = [g + r.astype(g.dtype) for g, r in zip(leaves, residual)]
    out = self._staged(leaves, state.compressor, state.count, axis_name)
    if velocity is not None and self.mask_momentum and out.sent is not None:
      velocity = [
        jnp.where(s, jnp.zeros_like(u), u) for u, s in zip(velocity, out.sent)
      ]
    unflat = lambda xs, like: (
      None
      if like is None
      else treedef.unflatten([x.astype(y.dtype) for x, y in zip(xs, like)])
    )
    new_state = ExchangeState(
      unflat(out.residuals, residual),
      unflat(velocity, velocity),
      state.count + 1,
      out.state,
    )
    return out.means, new_state


def _clip(leaves, clip_norm, axis_name):
  """DGC's local clipping: global norm at most ``clip_norm / sqrt(W)``."""
  bound = clip_norm / math.sqrt(jax.lax.axis_size(axis_name))
  norm = jnp.sqrt(
    sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves)
  )
  scale = jnp.minimum(1.0, bound / jnp.maximum(norm, 1e-30))
  return [(x * scale).astype(x.dtype) for x in leaves]


def _check_leaves(leaves):
  for x in leaves:
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"`grads` must hold float arrays, got {x.dtype}.")
    if x.size >= 2**31:
      raise ValueError(
        f"a `grads` leaf has {x.size} entries; int32 indices "
        "address at most 2**31 - 1: split the leaf."
      )


def _flatten_like(tree, treedef, name):
  if tree is None:
    return None
  leaves, tdef = jax.tree.flatten(tree)
  if tdef != treedef:
    raise ValueError(
      f"`{name}` must have the structure of `grads`; got "
      f"{tdef}, grads have {treedef}."
    )
  return leaves


def make_exchange(
  exchange: str | Exchange = "dense", **options: Any
) -> Exchange:
  """The :class:`Exchange` named ``exchange`` with ``options``.

  Args:
    exchange: a name of the registry (:data:`EXCHANGES`), or an
      :class:`Exchange` (returned as it is; then no options).
    **options: the compressor's options (e.g. ``fraction``, ``values``,
      ``indices``, ``chunk_size``, ``support``, ``rank``: see
      ``compressors.options()`` and ``docs/communication.md``) and the
      pipeline's (:data:`PIPELINE_OPTIONS`). An option the compressor does
      not take is accepted at its default and refused otherwise.

  Returns:
    The validated :class:`Exchange`.

  Raises:
    ValueError: an unknown exchange, an option out of range or not taken by
      the exchange, a warm-up without a sparse exchange.
  """
  if isinstance(exchange, Exchange):
    if options:
      raise TypeError(
        f"an Exchange takes no further options, got {sorted(options)}."
      )
    return exchange
  pipeline = {o.name for o in PIPELINE_OPTIONS}
  mine = {k: v for k, v in options.items() if k in pipeline}
  compressor = compressors.make(
    exchange, **{k: v for k, v in options.items() if k not in pipeline}
  )
  return Exchange(compressor, **mine)


_SEED = base.Option("seed", 0, "int", low=0)


def init_exchange(
  params: Any,
  *,
  exchange: str | Exchange = "all_gather",
  seed: int = 0,
  **options: Any,
) -> ExchangeState:
  """The initial :class:`ExchangeState` of one replica.

  Args:
    params: the parameters (or gradients) whose structure the exchange sees.
    exchange: the exchange the state is for (a name or an :class:`Exchange`).
    seed: seed of PowerSGD's initial ``Q`` (the same on every replica).
    **options: as :func:`make_exchange` (``error_feedback``, ``momentum``,
      the compressor's options).

  Returns:
    Zero residual and velocity, ``count = 0``, the compressor's initial
    state.
  """
  ex = make_exchange(exchange, **options)
  return ex.init(params, _SEED.check(seed))


def sparse_pmean(
  grads: Any,
  residual: Any,
  axis_name: AxisName,
  *,
  exchange: str | Exchange = "all_gather",
  **options: Any,
) -> tuple[Any, Any]:
  r"""Mean of the replicas' gradients through a (compressed) exchange.

  Call it inside :func:`jax.shard_map` (or any context where ``axis_name``
  is bound), with ``grads`` each replica's own gradient (differentiate
  parameters cast to varying: ``jax.lax.pcast(params, axis, to="varying")``).
  With :math:`a_i = g_i + r_i` the compressor (``exchange``, see
  ``docs/communication.md`` for each) gives every replica the same
  approximate :math:`\frac1W \sum_i a_i` and keeps in :math:`r_i` what the
  receivers did not decode of :math:`a_i`. Outputs have each leaf's dtype.

  Args:
    grads: this replica's gradient (a pytree of float arrays).
    residual: an :class:`ExchangeState` (the result's second item is then
      the new state), or, for the configurations that keep no other state,
      this replica's residual tree (same structure as ``grads``) or None (no
      error feedback).
    axis_name: the mesh axis (or tuple of axes) the replicas span.
    exchange: a name of :data:`EXCHANGES` or an :class:`Exchange`.
    **options: as :func:`make_exchange`.

  Returns:
    ``(mean, new_residual)``, ``new_residual`` of the kind of ``residual``.

  Raises:
    ValueError: for bad options (:func:`make_exchange`), a residual of
      another structure, or a stateful configuration (momentum, warm-up,
      the replicated support, PowerSGD's warm-started ``Q``) without an
      :class:`ExchangeState`.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> def f(g):
    ...   return sparse_pmean({"w": g}, None, "data", fraction=0.5)[0]["w"]
    >>> jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P())(
    ...     jnp.array([3., -1., 0.5, -4.]))
    Array([ 3.,  0.,  0., -4.], dtype=float32)
  """
  if isinstance(residual, ExchangeState):
    if "error_feedback" not in options:  # As the state was built.
      options["error_feedback"] = residual.residual is not None
    ex = make_exchange(exchange, **options)
    return ex(grads, residual, axis_name)
  ex = make_exchange(exchange, **options)
  if ex.momentum or ex.warmup_steps or ex.compressor.stateful:
    raise ValueError(
      "`momentum`, `warmup_steps`, support='replicated' and "
      "exchange='powersgd' (its warm-started Q) keep state: pass an "
      "ExchangeState from init_exchange as `residual`."
    )
  leaves, treedef = jax.tree.flatten(grads)
  _check_leaves(leaves)
  state = ExchangeState(residual, None, jnp.zeros((), jnp.int32), None)
  # A residual tree is added and returned whatever the compressor (a
  # lossless one returns zeros).
  means, state = ex.run_leaves(leaves, state, treedef, axis_name)
  return treedef.unflatten(means), state.residual


__all__ = (
  "EXCHANGES",
  "PER_REPLICA",
  "PIPELINE_OPTIONS",
  "Exchange",
  "ExchangeState",
  "init_exchange",
  "make_exchange",
  "options_table",
  "sparse_pmean",
  "state_specs",
  "warmup_fractions",
)
