"""Noise filter + Nesterov + Adam/RMSProp mix (seed mechanism 5).

Article 004 §2.3 describes a three-stage gradient treatment: a moving-average
noise filter, Nesterov momentum, and an adaptive learning rate mixing Adam and
RMSProp. This module pins it as one transform whose limit cases are exactly
optax's Adam, NAdam and RMSProp.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from grpo_optax import _common
from grpo_optax import _mechanism
from grpo_optax import quantization

__all__ = (
  "ScaleByNesterovAdamRmsConfig",
  "ScaleByNesterovAdamRmsState",
  "scale_by_nesterov_adam_rms",
)


class ScaleByNesterovAdamRmsState(NamedTuple):
  """State of :func:`scale_by_nesterov_adam_rms`."""

  count: jax.Array  # shape=(), dtype=int32
  mu: optax.Updates  # first moment (Adam)
  nu: optax.Updates  # second moment, shared by Adam and RMSProp
  filtered: optax.Updates | None  # noise-filter EMA, None when disabled
  key: jax.Array | None = None  # stochastic rounding's key, else None

  def metrics(self) -> dict[str, jax.Array]:
    return {}


def nesterov_moment(mu, g, c_mu, c_g):
  """NAdam's look-ahead ``b1 mu / bc1_next + (1 - b1) g / bc1`` as
  ``c_mu mu + c_g g``, with the step's coefficients ``c_mu = b1 / bc1_next``
  and ``c_g = (1 - b1) / bc1`` (:func:`step_scalars`).

  ``bc1 = 1 - b1^(t+1)``, ``bc1_next = 1 - b1^(t+2)`` (``t`` = count before
  the step), as ``optax.scale_by_adam(nesterov=True)``; the scalar
  quotients are taken once per step, not once per entry (within float32
  rounding of optax's per-entry divisions).
  """
  return c_mu * mu + c_g * g


def adam_rms_mix(mu_hat, nu_hat, nu_rms, g, eps, eps_root, adam_weight):
  """``w mu_hat / (sqrt(nu_hat + eps_root) + eps) + (1 - w) g / (sqrt(nu_rms) + eps)``.

  A static ``w`` of 1 (0) leaves the other term out of the program: it
  would be multiplied by 0, which XLA cannot fold for floats.
  """
  w = _common.concrete_value(adam_weight, "adam_weight")
  adam = None
  if w != 0.0:
    root = nu_hat if _common.is_static_zero(eps_root) else nu_hat + eps_root
    adam = mu_hat / (jnp.sqrt(root) + eps)
    if w == 1.0:
      return adam
  rms = g / (jnp.sqrt(nu_rms) + eps)
  if adam is None:
    return rms
  return adam_weight * adam + (1 - adam_weight) * rms


def moment_dtype(param_dtype, requested) -> Any:
  """The storage dtype of a moment: ``requested``, else the param's dtype,
  except float16, whose range (smallest normal 6e-5) underflows a squared
  gradient: float16 params keep their moments in float32 by default.
  """
  if requested is not None:
    return jnp.dtype(requested)
  dtype = jnp.dtype(param_dtype)
  return jnp.dtype(jnp.float32) if dtype == jnp.float16 else dtype


def moments_like(params, dtype) -> Any:
  """Zero moments shaped like ``params`` in :func:`moment_dtype`."""
  # zeros_like keeps a sharded param's sharding (on Explicit meshes too).
  return jax.tree.map(
    lambda p: jnp.zeros_like(p, dtype=moment_dtype(jnp.result_type(p), dtype)),
    params,
  )


def check_format(name: str, value: Any) -> None:
  """Raises ``ValueError`` naming ``name`` unless ``value`` is a state
  format: None, a ``StateFormat`` or one of ``quantization.FORMAT_NAMES``.
  """
  if value is None or isinstance(value, quantization.StateFormat):
    return
  _common.check_choice(name, value, (*quantization.FORMAT_NAMES, None))


def update_dtypes(updates, params, *moments) -> list[Any]:
  """Per leaf of ``updates``: the dtype of the adaptive update, optax's.

  ``optax.adam``'s update is the gradient's dtype promoted with its
  moments', which follow the params unless ``mu_dtype`` says otherwise: so
  bfloat16 gradients of float32 params give float32 updates, and float32
  gradients of bfloat16 params too. Here: the gradient's dtype promoted
  with the params' and with each moment stored in a requested dtype.
  ``moments`` are ``(stored tree or None, requested dtype or None)`` pairs
  (None for a quantized format). Without ``params`` (or a tree of their
  dtypes), the stored moments stand for them (float32 for float16 params:
  :func:`moment_dtype`).
  """
  leaves, treedef = jax.tree.flatten(updates)
  dtypes = [jnp.result_type(x) for x in leaves]
  if params is not None and jax.tree.structure(params) != treedef:
    params = None  # e.g. an unfiltered Equinox model: not this stage's input
  refs = [] if params is None else [params]
  refs += [
    tree
    for tree, requested in moments
    if tree is not None and (requested is not None or params is None)
  ]
  for tree in refs:
    dtypes = [
      jnp.promote_types(d, jnp.result_type(s))
      for d, s in zip(dtypes, treedef.flatten_up_to(tree))
    ]
  return dtypes


def moment_shapes(fmt, stored):
  """A tree shaped like the params: the stored moment itself, or the shapes
  of its decoded form (``jax.eval_shape``: no operation is added).
  """
  if fmt is None:
    return stored
  return jax.eval_shape(lambda s: quantization.tree_decode(fmt, s), stored)


def decoded(fmt, stored, floor=False):
  """The float32 tree of a stored moment (as is when ``fmt`` is None)."""
  if fmt is None:
    return stored
  return quantization.tree_decode(fmt, stored, floor=floor)


@jax.jit
def adam_moments(g, mu, nu, hyper):
  """One leaf's new moments ``(mu', nu')``, in the gradient's dtype promoted
  with ``nu``'s (not cast to the stored dtype).

  ``hyper``: the step's scalars (:func:`step_scalars`). Jitted, like
  :func:`adam_update`, so that leaves of one shape share one trace and one
  lowered function (XLA inlines the calls): tracing each leaf's two dozen
  operations anew was a third of the update's compile time.
  """
  b1, b2, _, _, _, omb1, omb2, _, _, _, _ = hyper
  m = _promoted(g, nu)
  return b1 * mu + omb1 * m, b2 * nu + omb2 * _common.abs_sq(m)


@functools.partial(
  jax.jit,
  static_argnames=("nesterov", "rms_bias_correction", "out_dtype", "weight"),
)
def adam_update(
  g,
  mu,
  nu,
  hyper,
  *,
  nesterov: bool,
  rms_bias_correction: bool,
  out_dtype,
  weight: float | None,
):
  """One leaf's adaptive update from its new moments ``mu``, ``nu``.

  ``weight``: the Adam weight when it is static (a weight of 1 or 0 leaves
  the other term out of the program). Every scalar quotient and difference
  (``1 - b1``, ``1 / bc2``, ...) is taken once per step in
  :func:`step_scalars`: per leaf, each was an instruction more for XLA to
  simplify and fuse, and the instruction count is what the update's compile
  time follows.
  """
  (_, _, eps, eps_root, adam_weight, _, _, c_mu, c_g, inv_bc1, inv_bc2) = hyper
  m = _promoted(g, nu)
  if nesterov:
    mu_hat = nesterov_moment(mu, m, c_mu.astype(mu.dtype), c_g.astype(mu.dtype))
  else:
    mu_hat = mu * inv_bc1.astype(mu.dtype)
  nu_hat = nu * inv_bc2.astype(nu.dtype)
  u = adam_rms_mix(
    mu_hat,
    nu_hat,
    nu_hat if rms_bias_correction else nu,
    m,
    eps,
    eps_root,
    adam_weight if weight is None else weight,
  )
  return u.astype(out_dtype)


def _promoted(g, nu):
  """The gradient in its dtype promoted with ``nu``'s: moments stored wider
  than the gradient (float16 params) get it in their dtype before it is
  squared.
  """
  return g.astype(jnp.promote_types(g.dtype, nu.dtype))


def reads_stored(fmt) -> bool:
  """Whether the update reads a moment stored in ``fmt`` as stored (decoded)
  rather than as computed: for the 8-bit and the stochastic formats.

  Their stored value is no cheap function of the old one (a block scale, a
  random rounding), so a kernel computing the update from the old value
  reads it while another overwrites it in place: XLA then copies the old
  codes every step (26 copies of 0.75-4 MB on the 21M-parameter tree of
  ``benchmarks.step_time``). Reading what was stored orders the two kernels
  and is the update the state describes (a resumed run computes it again).
  None and the deterministic float formats keep optax's rule: the update
  from the moment before its cast (``"bfloat16"`` equals ``mu_dtype``).
  """
  return fmt is not None and (fmt.blocked or fmt.stochastic)


def adaptive_step(
  cfg,
  g_leaves,
  stored_mu,
  stored_nu,
  hyper,
  out_dtypes,
  treedef,
  *,
  scales=(None, None),
  keys=(None, None),
):
  """One step of the moments and the update: ``(updates, mu, nu)``, the
  updates a list over ``g_leaves``, ``mu`` / ``nu`` stored as ``cfg``'s
  formats say.

  Decodes the stored moments (``nu``, a denominator, with a floor), takes
  each leaf's new moments (:func:`adam_moments`), stores them
  (:func:`encode_moment`, with ``scales`` from :func:`moment_scale` and
  ``keys`` for stochastic formats) and computes each leaf's update
  (:func:`adam_update`) from the new moments, read back from what was
  stored where :func:`reads_stored`. Used by
  :func:`scale_by_nesterov_adam_rms` and by the fused core of
  :func:`grpo_optax.grpo`.
  """
  mu_fmt, nu_fmt = cfg.mu_format, cfg.nu_format
  mu_old = treedef.flatten_up_to(decoded(mu_fmt, stored_mu))
  nu_old = treedef.flatten_up_to(decoded(nu_fmt, stored_nu, True))
  news = [
    adam_moments(g, *mv, hyper) for g, mv in zip(g_leaves, zip(mu_old, nu_old))
  ]
  mus = [m.astype(o.dtype) for (m, _), o in zip(news, mu_old)]
  nus = [v.astype(o.dtype) for (_, v), o in zip(news, nu_old)]
  mu = encode_moment(mu_fmt, treedef.unflatten(mus), keys[0], scales[0])
  nu = encode_moment(nu_fmt, treedef.unflatten(nus), keys[1], scales[1])
  mu_read = [m for m, _ in news]
  nu_read = [v for _, v in news]
  if reads_stored(mu_fmt):
    mu_read = treedef.flatten_up_to(decoded(mu_fmt, mu))
  if reads_stored(nu_fmt):
    nu_read = treedef.flatten_up_to(decoded(nu_fmt, nu, True))
  weight = _common.concrete_value(cfg.adam_weight)
  outs = [
    adam_update(
      g,
      m,
      v,
      hyper,
      nesterov=cfg.nesterov,
      rms_bias_correction=cfg.rms_bias_correction,
      out_dtype=jnp.dtype(dtype),
      weight=weight,
    )
    for g, m, v, dtype in zip(g_leaves, mu_read, nu_read, out_dtypes)
  ]
  return outs, mu, nu


def step_scalars(cfg: ScaleByNesterovAdamRmsConfig, count: jax.Array):
  """``(count + 1, hyper)``: the scalars of :func:`adam_moments` and
  :func:`adam_update` for the step whose count before it is ``count``,
  float32: ``(b1, b2, eps, eps_root,
  adam_weight, 1 - b1, 1 - b2, b1 / bc1_next, (1 - b1) / bc1, 1 / bc1,
  1 / bc2)`` with ``bc = 1 - b^(count + 1)`` and ``bc1_next = 1 -
  b1^(count + 2)``.
  """
  t1 = _common.safe_increment(count)
  bc1 = _common.bias_correction(cfg.b1, t1)
  bc2 = _common.bias_correction(cfg.b2, t1)
  bc1_next = _common.bias_correction(cfg.b1, _common.safe_increment(t1))
  f = lambda x: jnp.asarray(x, jnp.float32)
  b1, b2 = f(cfg.b1), f(cfg.b2)
  omb1, omb2 = 1 - b1, 1 - b2
  hyper = (
    b1,
    b2,
    cfg.eps,
    cfg.eps_root,
    cfg.adam_weight,
    omb1,
    omb2,
    b1 / bc1_next,
    omb1 / bc1,
    1 / bc1,
    1 / bc2,
  )
  return t1, hyper


@dataclasses.dataclass(frozen=True)
class ScaleByNesterovAdamRmsConfig(_mechanism.Config):
  """The knobs of :func:`scale_by_nesterov_adam_rms`, validated (see its
  arguments); ``mu_format`` / ``nu_format`` hold
  :class:`~grpo_optax.quantization.StateFormat` or None after validation.
  """

  b1: Any = 0.9
  b2: Any = 0.999
  eps: Any = 1e-8
  eps_root: Any = 0.0
  adam_weight: Any = 0.5
  nesterov: bool = True
  filter_decay: Any = None
  mu_dtype: Any = None
  rms_bias_correction: bool = False
  nu_dtype: Any = None
  mu_format: Any = None
  nu_format: Any = None
  key: Any = None

  def __post_init__(self):
    _common.check_range("b1", self.b1, 0.0, 1.0, high_inclusive=False)
    _common.check_range("b2", self.b2, 0.0, 1.0, high_inclusive=False)
    _common.check_range("eps", self.eps, 0.0)
    _common.check_range("eps_root", self.eps_root, 0.0)
    _common.check_range("adam_weight", self.adam_weight, 0.0, 1.0)
    if self.filter_decay is not None:
      _common.check_range(
        "filter_decay", self.filter_decay, 0.0, 1.0, high_inclusive=False
      )
    _common.check_bool("nesterov", self.nesterov)
    _common.check_bool("rms_bias_correction", self.rms_bias_correction)
    mu_dtype = _common.check_dtype("mu_dtype", self.mu_dtype)
    nu_dtype = _common.check_dtype("nu_dtype", self.nu_dtype)
    check_format("mu_format", self.mu_format)
    check_format("nu_format", self.nu_format)
    if mu_dtype is not None and self.mu_format is not None:
      raise ValueError("give `mu_dtype` or `mu_format`, not both.")
    if nu_dtype is not None and self.nu_format is not None:
      raise ValueError("give `nu_dtype` or `nu_format`, not both.")
    f32 = _common.f32
    self._set(
      mu_dtype=mu_dtype,
      nu_dtype=nu_dtype,
      mu_format=_state_format(self.mu_format),
      nu_format=_state_format(self.nu_format),
      b1=f32(self.b1),
      b2=f32(self.b2),
      eps=f32(self.eps),
      eps_root=f32(self.eps_root),
      adam_weight=f32(self.adam_weight),
      filter_decay=f32(self.filter_decay),
    )

  @property
  def stochastic(self) -> bool:
    """Whether a moment's format rounds stochastically (needs the key)."""
    return any(
      f is not None and f.stochastic for f in (self.mu_format, self.nu_format)
    )

  def init(self, params) -> ScaleByNesterovAdamRmsState:
    return ScaleByNesterovAdamRmsState(
      count=jnp.zeros([], jnp.int32),
      mu=init_moment(params, self.mu_dtype, self.mu_format),
      nu=init_moment(params, self.nu_dtype, self.nu_format),
      filtered=(
        None if self.filter_decay is None else optax.tree.zeros_like(params)
      ),
      key=(
        None
        if not self.stochastic
        else jax.random.key(0)
        if self.key is None
        else self.key
      ),
    )

  def update(self, updates, state, params=None, **extra_args):
    del extra_args
    _common.check_tree_like(
      "scale_by_nesterov_adam_rms",
      updates,
      moment_shapes(self.mu_format, state.mu),
    )
    filtered, g = self._filter(updates, state)
    g_leaves, treedef = jax.tree.flatten(g)
    count_inc, hyper = step_scalars(self, state.count)
    dtypes = update_dtypes(
      updates,
      params,
      (state.mu if self.mu_format is None else None, self.mu_dtype),
      (state.nu if self.nu_format is None else None, self.nu_dtype),
    )
    new_key, mu_key, nu_key = (
      jax.random.split(state.key, 3) if self.stochastic else (None,) * 3
    )
    outs, mu, nu = adaptive_step(
      self,
      g_leaves,
      state.mu,
      state.nu,
      hyper,
      dtypes,
      treedef,
      scales=(
        moment_scale(self.mu_format, state.mu, self.b1, g_leaves, 1, treedef),
        moment_scale(self.nu_format, state.nu, self.b2, g_leaves, 2, treedef),
      ),
      keys=(mu_key, nu_key),
    )
    return treedef.unflatten(outs), ScaleByNesterovAdamRmsState(
      count=count_inc,
      mu=mu,
      nu=nu,
      filtered=filtered,
      key=new_key,
    )

  def _filter(self, updates, state):
    """The noise filter's new EMA and the filtered gradient (or as is)."""
    if self.filter_decay is None:
      return state.filtered, updates
    count_inc = _common.safe_increment(state.count)
    new_f = optax.tree.update_moment(
      updates, state.filtered, self.filter_decay, 1
    )
    g = optax.tree.bias_correction(new_f, self.filter_decay, count_inc)
    return (
      optax.tree.cast_like(new_f, state.filtered),
      optax.tree.cast_like(g, updates),
    )


def _state_format(value):
  return None if value is None else quantization.state_format(value)


def init_moment(params, dtype, fmt):
  """A moment's initial state: zeros in ``dtype`` or in format ``fmt``."""
  if fmt is None:
    return moments_like(params, dtype)
  return quantization.tree_init(fmt, params)


def encode_moment(fmt, tree, key=None, scale=None):
  """A moment tree stored in format ``fmt`` (as is when None); ``scale``:
  the 8-bit blocks' scales (:func:`moment_scale`).
  """
  if fmt is None:
    return tree
  return quantization.tree_encode(fmt, tree, key=key, scale=scale)


def leaf_names(treedef) -> list[str]:
  """``"leaf ['w']"``, ... for the leaves of ``treedef`` (error messages)."""
  paths = jax.tree_util.tree_leaves_with_path(
    treedef.unflatten([0] * treedef.num_leaves)
  )
  return [_common.leaf_name(p) for p, _ in paths]


def moment_scale(fmt, stored, decay, g_leaves, power, treedef, bounds=None):
  r"""The scales of an 8-bit moment's new blocks, from a bound (None for
  other formats).

  A moment :math:`m' = \beta m + (1-\beta) g^p` (``p = 1``: ``mu``;
  ``p = 2``: ``nu``) whose old blocks decode to at most their scale
  :math:`s` obeys, block by block,

  .. math::

    \max_i |m'_i| \le s' = \beta s + (1-\beta) (\max_i |g_i|)^p,

  so :math:`s'` is a valid scale for the new block, known before the new
  moment is: it needs only a reduction of the gradient
  (:func:`grpo_optax.quantization.block_absmax`), not of the new moment,
  and the moment is decoded, updated and encoded in one elementwise pass
  (a reduction of the new moment made XLA:CPU write it to memory in
  float32 and decode the old one three times). :math:`s'` is an
  exponential moving average of the blocks' gradient maxima: for ``nu`` it
  stays within the ratio of a block's largest squared gradient to its
  entries' (about 2 ln B for Gaussian entries); codes near 0 are what the
  power-2 code map spends most levels on.

  ``bounds``: a function of the format giving each leaf's bound on
  :math:`\max_i |g_i|` per block, for a caller that knows one from its own
  inputs (the fused core: the gradient's maxima times the clip factor, plus
  the accumulator's), so that the reduction reads arrays already in memory;
  None: :func:`~grpo_optax.quantization.block_absmax` of ``g_leaves``.
  """
  if fmt is None or not fmt.blocked:
    return None
  scales = treedef.flatten_up_to(stored.scale)
  if bounds is None:
    maxima = [
      quantization.block_absmax(fmt, g, name=n)
      for g, n in zip(g_leaves, leaf_names(treedef))
    ]
  else:
    maxima = bounds(fmt)
  decay = jnp.asarray(decay, jnp.float32)
  return treedef.unflatten(
    [decay * s + (1 - decay) * b**power for b, s in zip(maxima, scales)]
  )


def scale_by_nesterov_adam_rms(
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  eps_root: float = 0.0,
  adam_weight: float = 0.5,
  nesterov: bool = True,
  filter_decay: float | None = None,
  mu_dtype: Any | None = None,
  rms_bias_correction: bool = False,
  nu_dtype: Any | None = None,
  *,
  mu_format: quantization.FormatLike | None = None,
  nu_format: quantization.FormatLike | None = None,
  key: jax.Array | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Mixes a (Nesterov-)Adam update with an RMSProp update sharing one ``nu``.

  With ``g`` the incoming update and ``t`` the step count before this step:

  1. Noise filter (only if ``filter_decay = d_f`` is given):
     :math:`f_t = d_f f_{t-1} + (1-d_f) g`, :math:`g \leftarrow f_t / (1 - d_f^{t+1})`
     (a bias-corrected moving average, as ``optax.ema(d_f, debias=True)``).
  2. Moments: :math:`m_t = b_1 m_{t-1} + (1-b_1) g`,
     :math:`v_t = b_2 v_{t-1} + (1-b_2) g^2`.
  3. :math:`A` = Adam's update, :math:`\hat m / (\sqrt{\hat v + \epsilon_{root}} + \epsilon)`,
     with Nesterov's look-ahead :math:`\hat m = b_1 m_t / (1-b_1^{t+2}) + (1-b_1) g / (1-b_1^{t+1})`
     when ``nesterov`` (exactly ``optax.scale_by_adam(..., nesterov=nesterov)``);
     :math:`R = g / (\sqrt{v_t} + \epsilon)`, RMSProp without bias correction
     (exactly ``optax.scale_by_rms(decay=b2, eps=eps, eps_in_sqrt=False)``).
  4. Output :math:`w A + (1 - w) R` with ``w = adam_weight``.

  Storage: with ``mu_format`` / ``nu_format`` (see
  :mod:`grpo_optax.quantization`) the state keeps ``mu`` / ``nu`` in that
  format; each step decodes them to float32, updates and encodes them in
  one elementwise pass. With an 8-bit or a stochastic format, 3.-4. read
  the new moments as stored (decoded), so the update is the one the state
  describes; with None, ``"float32"`` or ``"bfloat16"``, they read them
  before the cast, as optax does with ``mu_dtype``.

  Limits: ``adam_weight=1, nesterov=False`` is ``optax.scale_by_adam``,
  ``adam_weight=1, nesterov=True`` is NAdam, ``adam_weight=0`` is RMSProp.
  Early in training, RMSProp's un-corrected ``v`` is small, so ``R`` is larger
  than ``A`` by up to ``1/sqrt(1-b2^t)``; a mix with ``w < 1`` therefore takes
  larger first steps than Adam (use a warm-up schedule if that matters).

  Args:
    b1: decay of the first moment, in [0, 1).
    b2: decay of the second moment, in [0, 1).
    eps: added to the denominator, >= 0.
    eps_root: added inside the square root of Adam's denominator, >= 0.
    adam_weight: weight ``w`` of the Adam update, in [0, 1].
    nesterov: whether Adam uses Nesterov's look-ahead (NAdam).
    filter_decay: decay of the noise filter in [0, 1), or ``None`` for no filter.
    mu_dtype: optional dtype of the first moment (e.g. ``jnp.bfloat16``);
      default: the param's dtype, float32 for float16 params.
    rms_bias_correction: divide RMSProp's ``nu`` by ``1 - b2^(t+1)`` as
      Adam does (off: exactly ``optax.scale_by_rms``).
    nu_dtype: optional dtype of the second moment; default as ``mu_dtype``.
    mu_format: storage of ``mu``: a name of
      :data:`grpo_optax.quantization.FORMAT_NAMES` (e.g. ``"int8"``) or a
      ``StateFormat``; ``None``: ``mu_dtype``. Excludes ``mu_dtype``.
    nu_format: storage of ``nu`` (e.g. ``"uint8"``); ``None``: ``nu_dtype``.
      Excludes ``nu_dtype``.
    key: PRNG key of the stochastic formats (``"bfloat16_sr"``), kept in
      the state and split every step; default ``jax.random.key(0)``.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Examples:
    >>> import jax.numpy as jnp, optax, grpo_optax
    >>> tx = optax.chain(grpo_optax.scale_by_nesterov_adam_rms(adam_weight=0.5),
    ...                  optax.scale(-1e-3))
    >>> params = {"w": jnp.ones(3)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.full(3, 0.5)}, state, params)
    >>> updates["w"].shape
    (3,)

  References:
    Kingma & Ba, `Adam: A Method for Stochastic Optimization
    <https://arxiv.org/abs/1412.6980>`_, 2015.
    Dozat, `Incorporating Nesterov Momentum into Adam
    <https://openreview.net/pdf?id=OM0jvwB8jIp57ZJjtNEZ>`_, 2016.
    Tieleman & Hinton, RMSProp, Lecture 6.5, COURSERA: Neural Networks, 2012.
    Xie et al., `Adan: Adaptive Nesterov Momentum Algorithm
    <https://arxiv.org/abs/2208.06677>`_, 2022.
  """
  return ScaleByNesterovAdamRmsConfig(
    b1,
    b2,
    eps,
    eps_root,
    adam_weight,
    nesterov,
    filter_decay,
    mu_dtype,
    rms_bias_correction,
    nu_dtype,
    mu_format,
    nu_format,
    key,
  ).transform()
