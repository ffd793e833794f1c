r"""The gradient exchange of data-parallel training, with DGC's recipe.

:func:`sparse_pmean` gives every replica the same approximate mean of the
replicas' gradients; :mod:`grpo_optax.training.compression` holds the
compressors (payload formats, supports, PowerSGD). With an
:class:`ExchangeState` (from :func:`init_exchange`) the exchange runs Deep
Gradient Compression's four techniques, each switchable (Lin et al. 2018,
Algorithm 1 with sections 3.1-3.3), on replica ``i``'s gradient ``g_i``:

.. math::

  g_i &\leftarrow g_i \min\!\bigl(1, \tfrac{c\, W^{-1/2}}{\|g_i\|}\bigr)
      && \text{local clipping (clip\_norm = c)}\\
  u_i &\leftarrow m\, u_i + g_i,\quad v_i \leftarrow v_i + u_i
      && \text{momentum correction (momentum = m)}\\
  \bar g &= \mathrm{exchange}_{f_t}(v_i),\quad v_i \leftarrow v_i -
      \mathrm{sent}_i && \text{error feedback}\\
  u_i &\leftarrow u_i \odot \lnot \mathrm{mask}_i
      && \text{momentum factor masking}

with :math:`f_t` the warm-up's kept fraction (:func:`~grpo_optax.training.
compression.warmup_fractions`, one stage per ``warmup_steps`` steps). Without
momentum correction ``u_i = g_i`` and ``v_i`` is the plain residual. With it,
the exchanged value already carries the momentum: the ``tx`` applied after
the exchange should have none (``optax.sgd(lr)`` reproduces DGC's update
:math:`\theta \leftarrow \theta - \eta \bar g`). Note that masking zeroes the
velocity of every sent entry: at ``fraction = 1`` (or with the dense
exchange) the momentum is gone, as in the paper's algorithm.

References:
  Lin, Han, Mao, Wang, Dally. Deep Gradient Compression: Reducing the
  Communication Bandwidth for Distributed Training. ICLR 2018.
  https://arxiv.org/abs/1712.01887

  Vogels, Karimireddy, Jaggi. PowerSGD. NeurIPS 2019.
  https://arxiv.org/abs/1905.13727
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp

from grpo_optax.training import _tree
from grpo_optax.training import compression

__all__ = (
  "EXCHANGES",
  "ExchangeState",
  "init_exchange",
)

#: The exchanges of :func:`sparse_pmean` and ``data_parallel_step``.
EXCHANGES = ("dense", "all_gather", "shared_support", "powersgd")

AxisName = Any  # A mesh axis name, or a tuple of them.


class ExchangeState(NamedTuple):
  """State of the exchange of one replica (:func:`init_exchange`).

  Attributes:
    residual: the error-feedback accumulation ``v_i`` (the gradient's
      structure), or None without error feedback. Per replica.
    velocity: the momentum-correction velocity ``u_i``, or None
      (``momentum=0``). Per replica.
    count: the number of exchanges so far (int32 scalar; the warm-up
      stage). The same on every replica.
    support: ``(rate, age)`` per chunk of the ``"replicated"`` shared
      support, or None. The same on every replica.
    q: PowerSGD's warm-start ``Q`` per leaf (None for a leaf exchanged
      densely), or None for the other exchanges. The same on every replica.
  """

  residual: Any
  velocity: Any
  count: jax.Array
  support: Any
  q: Any


#: Fields of :class:`ExchangeState` that differ between replicas.
PER_REPLICA = ("residual", "velocity")


# -- argument checks ---------------------------------------------------------


def _check_choice(name: str, value: Any, allowed) -> str:
  if value not in allowed:
    raise ValueError(
      f"`{name}` must be one of {tuple(allowed)}, got {value!r}."
    )
  return value


def _check_fraction(fraction: Any) -> float:
  _tree.check_real("fraction", fraction, "a float in (0, 1]")
  try:
    f = float(fraction)
  except (TypeError, ValueError):
    raise ValueError(
      f"`fraction` must be a float in (0, 1], got {fraction!r}."
    ) from None
  if not 0.0 < f <= 1.0:
    raise ValueError(f"`fraction` must be a float in (0, 1], got {f}.")
  return f


def _check_int(name: str, value: Any, low: int) -> int:
  if isinstance(value, bool):
    raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}.")
  try:
    v = operator.index(value)
  except TypeError:
    raise ValueError(
      f"`{name}` must be an int >= {low}, got {value!r}."
    ) from None
  if v < low:
    raise ValueError(f"`{name}` must be an int >= {low}, got {v}.")
  return v


def _check_momentum(momentum: Any) -> float:
  m = _tree.check_real("momentum", momentum, "a float in [0, 1)")
  if not 0.0 <= m < 1.0:
    raise ValueError(f"`momentum` must be a float in [0, 1), got {momentum}.")
  return m


def _check_clip(clip_norm: Any):
  if clip_norm is None:
    return None
  c = _tree.check_real("clip_norm", clip_norm, "None or a float > 0")
  if not c > 0:
    raise ValueError(
      f"`clip_norm` must be None or a float > 0, got {clip_norm}."
    )
  return c


class _Config(NamedTuple):
  exchange: str
  fraction: float
  chunk_size: int
  values: str
  indices: str
  support: str
  rank: int
  momentum: float
  mask_momentum: bool
  clip_norm: Any
  warmup_steps: int


def _config(
  exchange,
  fraction,
  chunk_size,
  values,
  indices,
  support,
  rank,
  momentum,
  mask_momentum,
  clip_norm,
  warmup_steps,
) -> _Config:
  cfg = _Config(
    _check_choice("exchange", exchange, EXCHANGES),
    _check_fraction(fraction),
    _check_int("chunk_size", chunk_size, 1),
    _check_choice("values", values, compression.VALUE_FORMATS),
    _check_choice("indices", indices, compression.INDEX_FORMATS),
    _check_choice("support", support, compression.SUPPORTS),
    _check_int("rank", rank, 1),
    _check_momentum(momentum),
    _tree.check_flag("mask_momentum", mask_momentum),
    _check_clip(clip_norm),
    _check_int("warmup_steps", warmup_steps, 0),
  )
  if cfg.values == "int8" and cfg.exchange != "all_gather":
    raise ValueError(
      "`values='int8'` needs `exchange='all_gather'` (an "
      "all-reduce of 8-bit values would overflow); got "
      f"exchange={cfg.exchange!r}."
    )
  if cfg.values != "float32" and cfg.exchange == "dense":
    raise ValueError(
      f"the dense exchange sends float32; got values={cfg.values!r}."
    )
  if cfg.warmup_steps and cfg.exchange not in ("all_gather", "shared_support"):
    raise ValueError(
      "`warmup_steps` (the sparsity warm-up) needs a sparse "
      f"exchange, got exchange={cfg.exchange!r}."
    )
  return cfg


# -- state -------------------------------------------------------------------


def init_exchange(
  params: Any,
  *,
  exchange: str = "all_gather",
  error_feedback: bool = True,
  momentum: float = 0.0,
  support: str = "norms",
  chunk_size: int = 64,
  rank: int = 1,
  seed: int = 0,
) -> ExchangeState:
  """The initial :class:`ExchangeState` of one replica.

  Args:
    params: the parameters (or gradients) whose structure the exchange sees.
    exchange: the exchange the state is for (PowerSGD holds ``Q``).
    error_feedback: keep a residual.
    momentum: DGC's momentum-correction factor (0: no velocity).
    support: ``"replicated"`` holds the shared support's chunk statistics.
    chunk_size: entries per chunk of the shared support.
    rank: PowerSGD's rank.
    seed: seed of PowerSGD's initial ``Q`` (the same on every replica).

  Returns:
    Zero residual and velocity, ``count = 0``, unexplored chunks, random
    ``Q``.
  """
  _check_choice("exchange", exchange, EXCHANGES)
  _check_momentum(momentum)
  _tree.check_flag("error_feedback", error_feedback)
  _check_choice("support", support, compression.SUPPORTS)
  _check_int("chunk_size", chunk_size, 1)
  _check_int("rank", rank, 1)
  _check_int("seed", seed, 0)
  leaves = jax.tree.leaves(params)
  zeros = lambda: jax.tree.map(jnp.zeros_like, params)
  sup = None
  if exchange == "shared_support" and support == "replicated":
    sup = compression.init_support(
      [x.size for x in leaves], _check_int("chunk_size", chunk_size, 1)
    )
  q = None
  if exchange == "powersgd":
    q = compression.init_powersgd(
      [x.shape for x in leaves], _check_int("rank", rank, 1), seed
    )
  return ExchangeState(
    zeros() if error_feedback else None,
    zeros() if momentum else None,
    jnp.zeros((), jnp.int32),
    sup,
    q,
  )


# -- the exchange ------------------------------------------------------------


def _compress(cfg: _Config, axis_name, accs, support, q, fraction):
  """``(means, residuals, sent, support, q)`` of one exchange of ``accs``."""
  if cfg.exchange == "dense":
    means = jax.lax.pmean(list(accs), axis_name)
    return (
      means,
      [jnp.zeros_like(a) for a in accs],
      [jnp.ones(a.shape, bool) for a in accs],
      support,
      q,
    )
  if cfg.exchange == "all_gather":
    means, res, sent = compression.all_gather_mean(
      accs, axis_name, fraction, cfg.values, cfg.indices
    )
    return means, res, sent, support, q
  if cfg.exchange == "shared_support":
    means, res, sent, support = compression.shared_support_mean(
      accs, axis_name, fraction, cfg.chunk_size, cfg.values, support
    )
    return means, res, sent, support, q
  # q comes from the state (init_exchange), warm-started step after step.
  means, res, q = compression.powersgd_mean(
    accs, axis_name, cfg.rank, q, cfg.values
  )
  return means, res, None, support, q


def _staged(cfg: _Config, axis_name, accs, support, q, count):
  """:func:`_compress` at the warm-up stage's fraction (``lax.switch`` over
  the stages: each has its own static payload size).
  """
  fractions = compression.warmup_fractions(cfg.fraction)
  if not cfg.warmup_steps or len(fractions) == 1:
    return _compress(cfg, axis_name, accs, support, q, cfg.fraction)
  stage = jnp.minimum(count // cfg.warmup_steps, len(fractions) - 1)
  branches = [
    functools.partial(_compress, cfg, axis_name, fraction=f) for f in fractions
  ]
  return jax.lax.switch(stage, branches, accs, support, q)


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


def _check_state(state: ExchangeState, cfg: _Config) -> None:
  if (state.velocity is None) != (cfg.momentum == 0):
    raise ValueError(
      "the ExchangeState's velocity must be present exactly "
      f"when momentum > 0 (momentum={cfg.momentum}): build it "
      "with init_exchange(..., momentum=...)."
    )
  wants_support = (
    cfg.exchange == "shared_support" and cfg.support == "replicated"
  )
  if wants_support != (state.support is not None):
    raise ValueError(
      "the ExchangeState's support must be present exactly "
      "for exchange='shared_support', support='replicated': "
      "build it with init_exchange(..., support=...)."
    )
  if (cfg.exchange == "powersgd") != (state.q is not None):
    raise ValueError(
      "the ExchangeState's q must be present exactly for "
      "exchange='powersgd': build it with init_exchange("
      "..., exchange='powersgd')."
    )


def _run(cfg: _Config, leaves, state: ExchangeState, treedef, axis_name):
  """The DGC pipeline on flat leaves; returns ``(means, new state)``."""
  residual = _flatten_like(state.residual, treedef, "residual")
  velocity = _flatten_like(state.velocity, treedef, "velocity")
  if cfg.clip_norm is not None:
    leaves = _clip(leaves, cfg.clip_norm, axis_name)
  if velocity is not None:  # Momentum correction: accumulate the velocity.
    velocity = [
      cfg.momentum * u + g.astype(u.dtype) for u, g in zip(velocity, leaves)
    ]
    leaves = [u.astype(g.dtype) for u, g in zip(velocity, leaves)]
  if residual is not None:
    leaves = [g + r.astype(g.dtype) for g, r in zip(leaves, residual)]
  means, new_res, sent, support, q = _staged(
    cfg, axis_name, leaves, state.support, state.q, state.count
  )
  if velocity is not None and cfg.mask_momentum and sent is not None:
    velocity = [
      jnp.where(s, jnp.zeros_like(u), u) for u, s in zip(velocity, sent)
    ]
  unflat = lambda xs, like: (
    None
    if like is None
    else treedef.unflatten([x.astype(y.dtype) for x, y in zip(xs, like)])
  )
  new_state = ExchangeState(
    unflat(new_res, residual),
    unflat(velocity, velocity),
    state.count + 1,
    support,
    q,
  )
  return means, new_state


def sparse_pmean(
  grads: Any,
  residual: Any,
  axis_name: AxisName,
  *,
  exchange: str = "all_gather",
  fraction: float = 0.3,
  chunk_size: int = 64,
  values: str = "float32",
  indices: str = "int32",
  support: str = "norms",
  rank: int = 1,
  momentum: float = 0.0,
  mask_momentum: bool = True,
  clip_norm: float | None = None,
  warmup_steps: int = 0,
) -> tuple[Any, Any]:
  r"""Mean of the replicas' gradients through a (compressed) exchange.

  Call it inside :func:`jax.shard_map` (or any context where ``axis_name``
  is bound), with ``grads`` each replica's own gradient (differentiate
  parameters cast to varying, see :mod:`grpo_optax.training.distributed`).
  With :math:`a_i = g_i + r_i`:

  * ``"all_gather"``: :math:`S_i` = the ``ceil(fraction * n)`` entries of
    largest :math:`|a_i|` per leaf (per block of 65,536 entries with
    ``indices="compact"``); out :math:`= \frac1W \sum_i
    \mathrm{dec}(a_i[S_i])` scattered into zeros; one all-gather of the
    packed bytes.
  * ``"shared_support"``: :math:`S` = the ``ceil(fraction * M)`` of all
    :math:`M` chunks of ``chunk_size`` entries with the largest score
    (``support="norms"``: all-reduced squared norms; ``"replicated"``: an
    estimate of each chunk's accumulated residual from the past aggregated
    updates, no collective); out :math:`= \frac1W \sum_i a_i[S]`, one psum.
  * ``"powersgd"``: rank-``rank`` PowerSGD (two all-reduces), ``Q``
    warm-started from the state (an :class:`ExchangeState` is required);
    leaves of fewer than 2 dimensions, and leaves whose factors would not
    be smaller than the leaf, are averaged densely in the first
    (:func:`~grpo_optax.training.compression.powersgd_shape`).
  * ``"dense"``: out :math:`= \frac1W \sum_i a_i`, residual zero.

  The residual keeps :math:`a_i` minus what the receivers decode of it.
  Outputs have each leaf's dtype and are the same on every replica.

  Args:
    grads: this replica's gradient (a pytree of float arrays).
    residual: this replica's error-feedback residual (same structure), None
      (no error feedback), or an :class:`ExchangeState` (then the result's
      second item is the new state; needed for ``momentum``,
      ``warmup_steps``, ``support="replicated"`` and ``"powersgd"``).
    axis_name: the mesh axis (or tuple of axes) the replicas span.
    exchange: one of :data:`EXCHANGES`.
    fraction: kept fraction, in (0, 1] (after the warm-up).
    chunk_size: entries per chunk of the shared support.
    values: payload values, ``"float32"``, ``"bfloat16"`` or ``"int8"``
      (all-gather only).
    indices: ``"int32"`` or ``"compact"`` (all-gather).
    support: ``"norms"`` or ``"replicated"`` (shared support).
    rank: PowerSGD's rank, >= 1.
    momentum: DGC's momentum correction factor in [0, 1) (0: off).
    mask_momentum: DGC's momentum factor masking (with ``momentum``).
    clip_norm: DGC's local clipping bound ``c`` (scaled by
      :math:`W^{-1/2}`), or None.
    warmup_steps: steps per stage of DGC's sparsity warm-up (0: off).

  Returns:
    ``(mean, new_residual)``: ``new_residual`` is None when ``residual`` is,
    an :class:`ExchangeState` when ``residual`` is one.

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
  cfg = _config(
    exchange,
    fraction,
    chunk_size,
    values,
    indices,
    support,
    rank,
    momentum,
    mask_momentum,
    clip_norm,
    warmup_steps,
  )
  leaves, treedef = jax.tree.flatten(grads)
  _check_leaves(leaves)
  if isinstance(residual, ExchangeState):
    _check_state(residual, cfg)
    means, state = _run(cfg, leaves, residual, treedef, axis_name)
    return treedef.unflatten(means), state
  if (
    cfg.momentum
    or cfg.warmup_steps
    or (cfg.exchange == "shared_support" and cfg.support == "replicated")
    or cfg.exchange == "powersgd"
  ):
    raise ValueError(
      "`momentum`, `warmup_steps`, support='replicated' and "
      "exchange='powersgd' (its warm-started Q) keep state: pass an "
      "ExchangeState from init_exchange as `residual`."
    )
  state = ExchangeState(residual, None, jnp.zeros((), jnp.int32), None, None)
  means, state = _run(cfg, leaves, state, treedef, axis_name)
  return treedef.unflatten(means), state.residual
