"""Top-k and EMA-threshold gradient masking with error feedback (mechanisms 3, 4).

Article 004 §1.2 and §2.2 update only a subset of the parameters: the top 30%
by a score mixing the gradient's magnitude and the parameter's update history
("adaptive sampling"), with a threshold re-estimated every 100 steps as an EMA
of the mean gradient magnitude. Both are pinned here as masks with error
feedback (the masked-out part is carried to the next step, so nothing is lost),
computed per leaf: the whole model is never concatenated or sorted at once.

This module is the masks' room: the transforms :func:`top_k_mask` and
:func:`ema_threshold_mask`, their states, and the per-leaf functions
(:func:`accumulate`, :func:`sampled_thresholds`, :func:`ema_taus`,
:func:`keep_mask`) that the fused core of :func:`grpo_optax.grpo`
(:mod:`grpo_optax.fused`) calls too, so that both compute one algorithm.

State layout (both masks): with error feedback the state keeps the last
step's *accumulated* gradient ``acc = g + r`` and its per-leaf threshold;
the residual carried to the next step is the part of ``acc`` below the
threshold (:func:`residual_of`). Storing ``acc`` rather than ``r`` lets every
consumer of the masked gradient read the freshly written ``acc``, so XLA never
copies a donated state buffer to keep an old value alive (see
``docs/design.md``). A threshold below 0 marks a leaf whose accumulator holds
its residual directly (the exact top-k and the frequency-weighted score,
whose masks are not a threshold on ``|acc|``).

Samples are grids ``x[o_0::s_0, o_1::s_1, ...]``
(:func:`grpo_optax._common.sample_strides`): no flattening and no gather, so
a sharded leaf is sampled shard by shard and the only collectives of a mask
are scalar all-reduces.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from grpo_optax import _common
from grpo_optax import _mechanism
from grpo_optax import quantization

__all__ = (
  "EmaThresholdMaskConfig",
  "TopKMaskConfig",
  "EmaThresholdMaskState",
  "TopKMaskState",
  "ema_threshold_mask",
  "top_k_mask",
)

METHODS = ("exact", "sampled")
_MIN_SAMPLE = 1024  # floor on the sample size of the sampled threshold
_MAX_SAMPLE = 65536  # cap on it (the quantile error is ~0.2% there)
_SAMPLE_RATE = 0.01  # fraction of a leaf sampled (Deep Gradient Compression)
_MEAN_SAMPLE = 4096  # grid sample of the threshold mask's mean |a|
RESIDUAL_ONLY = -1.0  # threshold of a leaf whose accumulator is its residual


# --------------------------------------------------------------------------
# Per-element formulas.


def keep_mask(a: Any, threshold: Any) -> Any:
  """Entries with ``|a| >= threshold``; exact zeros are never kept."""
  return (jnp.abs(a) >= threshold) & (a != 0)


def split_by_mask(a: Any, keep: Any) -> tuple[Any, Any]:
  """``(a where kept else 0, a where not kept else 0)``: output and residual."""
  zero = jnp.zeros_like(a)
  return jnp.where(keep, a, zero), jnp.where(keep, zero, a)


@jax.jit
def masked_part(a: Any, threshold: Any) -> Any:
  """``a`` where ``|a| >= threshold``, else 0: the kept part of
  :func:`keep_mask` (an exact zero is 0 either way). Jitted: leaves of one
  shape share one trace.
  """
  thr = jnp.asarray(threshold).astype(a.dtype)
  return jnp.where(jnp.abs(a) >= thr, a, jnp.zeros_like(a))


def residual_bound(threshold: jax.Array) -> jax.Array:
  """The magnitude from which an accumulator entry was sent: the threshold,
  or ``inf`` for :data:`RESIDUAL_ONLY` (the whole accumulator is residual).
  Taken on the thresholds' vector, once per step, so that each leaf's
  kernel compares with one scalar (``docs/design.md``, "Compile time").
  """
  return jnp.where(threshold >= 0, threshold, jnp.inf).astype(threshold.dtype)


def residual_below(acc: jax.Array, bound: jax.Array) -> jax.Array:
  """``acc`` where ``|acc| < bound``, else 0 (:func:`residual_bound`)."""
  bound = bound.astype(acc.dtype)
  return jnp.where(jnp.abs(acc) >= bound, jnp.zeros_like(acc), acc)


def residual_of(acc: jax.Array, threshold: jax.Array) -> jax.Array:
  """The residual held by an accumulator and its (last step's) threshold:
  the entries that :func:`keep_mask` did not keep (an exact zero is 0
  either way).
  """
  return residual_below(acc, residual_bound(threshold))


def accumulate(
  g: jax.Array, acc: jax.Array | None, threshold: jax.Array
) -> jax.Array:
  """``a = g + r``: the gradient plus the residual of the last step."""
  if acc is None:
    return g
  return g + residual_of(acc, threshold).astype(g.dtype)


def accumulate_leaves(
  x_leaves: list[jax.Array],
  accs: list[Any],
  thresholds: jax.Array,
  dense: list[Any],
) -> list[jax.Array]:
  """Per leaf, ``a = x + r`` (:func:`accumulate`): the residual ``r`` read
  from the accumulator and the leaf's threshold in ``thresholds``; a leaf
  that passes dense for a static ``min_size`` holds no residual (``a = x``).
  The thresholds are split for the masked leaves only (one scalar buffer
  each, :func:`grpo_optax._common.unstack`).
  """
  a_leaves = list(x_leaves)
  masked = [i for i in masked_leaves(dense) if accs[i] is not None]
  if not masked:
    return a_leaves
  old = thresholds
  if len(masked) != len(x_leaves):
    old = _common.take(thresholds, masked)
  for i, bound in zip(masked, _common.unstack(residual_bound(old))):
    a_leaves[i] = _accumulate_leaf(x_leaves[i], accs[i], bound)
  return a_leaves


@jax.jit
def _accumulate_leaf(x: jax.Array, acc: jax.Array, bound: jax.Array):
  """:func:`accumulate` in ``x``'s dtype from the residual's bound
  (:func:`residual_bound`), jitted: leaves of one shape share one trace
  and one lowered function (XLA inlines the calls).
  """
  return (x + residual_below(acc, bound).astype(x.dtype)).astype(x.dtype)


#: Storage formats of the error-feedback accumulator (``accumulator_format``):
#: None keeps the params' dtype. Only unbiased lossy formats are offered:
#: rounding to nearest makes a small gradient vanish into a large residual
#: every step (bf16 keeps 8 bits, so a gradient below 1/256 of its entry is
#: lost; an 8-bit block rounds entries below 1/32,000 of its maximum to 0).
ACCUMULATOR_FORMATS = ("float32", "bfloat16_sr", "int8_sr")
_ACC_LANE = 8  # random_words lane of the accumulator's rounding noise


def check_accumulator_format(value: Any) -> Any:
  """The accumulator's :class:`~grpo_optax.quantization.StateFormat` (None
  for the params' dtype); a ``ValueError`` names the argument otherwise.
  """
  if value is None:
    return None
  if value in ("bfloat16", "int8"):
    raise ValueError(
      f"accumulator_format must be one of {ACCUMULATOR_FORMATS} or None, got "
      f"{value!r}: rounding to nearest loses every gradient entry below half "
      "a step of its accumulated entry, at every step (the error feedback "
      f"would no longer carry it); use {value + '_sr'!r}, which rounds "
      "stochastically and loses nothing on average"
    )
  _common.check_choice(
    "accumulator_format", value, (*ACCUMULATOR_FORMATS, None)
  )
  return quantization.state_format(value)


def init_accumulator(params: Any, fmt: Any) -> Any:
  """Zeros for the accumulator, stored in ``fmt`` (None: the params').

  Of the params' dtype even when they are weakly typed (``jnp.full(shape,
  0.5)``): the update writes a strongly typed accumulator, and a state
  whose types change at the first step makes a jitted step compile twice.
  """
  if fmt is None:
    return jax.tree.map(
      lambda p: jnp.zeros_like(p, dtype=jnp.result_type(p)), params
    )
  return quantization.tree_init(fmt, params)


def _stored_format(stored: Any) -> Any:
  """The format of a stored accumulator, read off its structure: the named
  formats of :data:`ACCUMULATOR_FORMATS` all use the default layout.
  """
  if isinstance(stored, quantization.Quantized):
    return quantization.state_format("int8_sr")
  return None


def read_accumulator(stored: Any, treedef: Any) -> list[Any]:
  """The accumulator's leaves as arrays (decoded from an 8-bit form)."""
  fmt = _stored_format(stored)
  if fmt is None:
    return treedef.flatten_up_to(stored)
  return [
    quantization.decode(fmt, quantization.Quantized(c, s))
    for c, s in zip(
      treedef.flatten_up_to(stored.codes), treedef.flatten_up_to(stored.scale)
    )
  ]


def store_accumulator(
  a_leaves: list[jax.Array],
  stored: Any,
  treedef: Any,
  dense: list[Any],
  fmt: Any,
  word: jax.Array,
  bounds: list[Any] | None = None,
) -> tuple[Any, list[jax.Array], list[Any]]:
  """The new stored accumulator, the values its readers must use and, per
  leaf, the stored 8-bit blocks' largest ``|value|`` (as
  :func:`~grpo_optax.quantization.stored_absmax` of it; None on a leaf that
  is not encoded in 8 bits here).

  A leaf keeps ``a``, or 0 on a dense leaf (its threshold
  :data:`RESIDUAL_ONLY` makes the accumulator its residual; a statically
  dense leaf's is never written). In a lossy ``fmt`` the stored value is
  rounded stochastically (noise :func:`grpo_optax._common.hash_bits` of
  ``word``, unbiased), and the mask, the update and the next step's
  residual all read that stored value (returned as the second element), so
  that nothing but the rounding's zero-mean error is lost. ``bounds``: per
  leaf, the 8-bit blocks' scales (``accumulator_scales``), or None for
  the blocks' maxima. Reading ``a``
  instead would also make XLA copy the donated accumulator (it is read
  after being overwritten in place).
  """
  old = treedef.flatten_up_to(
    stored.codes if _stored_format(stored) else stored
  )
  scales = (
    treedef.flatten_up_to(stored.scale) if _stored_format(stored) else old
  )
  new_stored, new_scales, read = [], [], list(a_leaves)
  maxima: list[Any] = [None] * len(a_leaves)
  for i, (a, o, sc, d) in enumerate(zip(a_leaves, old, scales, dense)):
    if d is True:
      new_stored.append(o)
      new_scales.append(sc)
      continue
    value = a if d is False else jnp.where(d, jnp.zeros_like(a), a)
    if fmt is None or fmt.name == "float32":
      new_stored.append(value.astype(o.dtype))
      new_scales.append(sc)
      continue
    bits = _common.hash_bits(a.shape, word)
    scale = None if bounds is None else bounds[i]
    if fmt.blocked:
      # read back: the mask and the update read the stored value
      enc, maxima[i] = quantization.encode_with_absmax(
        fmt, value, bits=bits, scale=scale
      )
      new_stored.append(enc.codes)
      new_scales.append(enc.scale)
    else:
      enc = quantization.encode(fmt, value, bits=bits)
      new_stored.append(enc)
      new_scales.append(sc)
    # In blocks: the next threshold's sample reads it (see decode).
    dec = quantization.decode(fmt, enc, in_blocks=True).astype(a.dtype)
    read[i] = dec if d is False else jnp.where(d, a, dec)
  if fmt is not None and fmt.blocked:
    return (
      quantization.Quantized(
        treedef.unflatten(new_stored), treedef.unflatten(new_scales)
      ),
      read,
      maxima,
    )
  return treedef.unflatten(new_stored), read, maxima


def accumulator_word(seed: Any, count: jax.Array) -> jax.Array:
  """The step's uint32 word of the accumulator's rounding noise."""
  return random_words(seed, count, [_ACC_LANE]).reshape(())


def ema_threshold(
  tau: Any, mean_abs: Any, alpha: Any, count: Any, every: Any
) -> Any:
  """The EMA threshold after a step with count ``count`` (before the step).

  ``mean_abs`` at the first step; ``alpha * mean_abs + (1 - alpha) * tau``
  every ``every`` steps; unchanged otherwise.
  """
  refreshed = jnp.where(
    count == 0, mean_abs, alpha * mean_abs + (1 - alpha) * tau
  )
  refresh = (count == 0) | (count % jnp.asarray(every, count.dtype) == 0)
  return jnp.where(refresh, refreshed, tau)


# --------------------------------------------------------------------------
# Per-leaf reductions shared with the fused core.


def static_int(name, value, low):
  """``value`` as a Python int (validated), or None if it is traced."""
  return _common.check_int(name, value, low)


def warmup_fraction(fraction: Any, warmup_steps: Any, count: jax.Array) -> Any:
  """Deep Gradient Compression's exponential sparsity warm-up.

  ``fraction ** (min(t, T) / T)`` with ``T = warmup_steps`` (1 at ``t = 0``),
  or ``fraction`` when ``warmup_steps`` is 0.
  """
  static = static_int("warmup_steps", warmup_steps, 0)
  if static == 0:
    return fraction
  w = jnp.maximum(jnp.asarray(warmup_steps, jnp.float32), 1.0)
  frac = jnp.asarray(fraction, jnp.float32) ** (
    jnp.minimum(count.astype(jnp.float32), w) / w
  )
  if static is None:  # traced warmup_steps: 0 means no warm-up
    frac = jnp.where(jnp.asarray(warmup_steps) > 0, frac, fraction)
  return frac


def dense_leaf(size: int, min_size: Any) -> Any:
  """Whether a leaf passes dense: True/False, or a traced bool."""
  static = static_int("min_size", min_size, 0)
  if size == 0:
    return True
  if static is not None:
    return size < static
  return size < jnp.asarray(min_size)


def sample_size(n: int) -> int:
  """Size of the random sample of the sampled threshold for a leaf of ``n``."""
  return min(n, max(_MIN_SAMPLE, min(_MAX_SAMPLE, math.ceil(_SAMPLE_RATE * n))))


_OFFSET_BITS = 8  # one random word per axis position (axes >= 8 wrap)


def random_words(seed: Any, count: jax.Array, lanes) -> jax.Array:
  """Pseudo-random uint32 words drawn from ``(seed, count)``, one per lane
  of ``lanes`` (static ints; equal lanes give equal words), as a vector.

  A counter-based hash (no PRNG state, no loop, constants on the right):
  ``jax.random``'s threefry lowers to a ``while`` loop, and a loop or an
  expression XLA folds or reorders makes its simplification passes run to
  their fixed point once more over the whole update (each round costs about
  as much as compiling ``optax.adam``). One vector, not a scalar per lane:
  traced once, and one kernel that the per-leaf kernels read from
  (:func:`_random_offsets`).
  """
  if isinstance(seed, (int, np.integer)):
    with np.errstate(over="ignore"):
      s = jnp.asarray(_common.mix32(np.uint32(seed) ^ np.uint32(0x9E3779B9)))
  else:
    s = _common.mix32(
      jnp.asarray(seed).astype(jnp.uint32) ^ jnp.uint32(0x9E3779B9)
    )
  c = _common.mix32(count.astype(jnp.uint32) * jnp.uint32(0x85EBCA77) + s)
  salts = np.asarray(
    [(0xC2B2AE3D * (i + 1)) & 0xFFFFFFFF for i in lanes], np.uint32
  )
  return _common.mix32(c + jnp.asarray(salts))


def _random_offsets(seed: Any, count: jax.Array, strides_list) -> list[Any]:
  """One draw per step; axis ``d`` of every leaf reads word ``d mod 8``.

  A leaf's offsets depend on its shape and the draw only (not on which
  other leaves are sampled), and leaves of one shape share them, which keeps
  the compiled program small. Every offset of the step is computed in one
  vector (word ``d mod 8`` modulo the stride) and read back as scalars by
  :func:`grpo_optax._common.unstack`: computed as scalars, XLA fused the
  hash (about 50 instructions) into every leaf's sample kernel.
  """
  if not any(any(s > 1 for s in st) for st in strides_list):
    return [None] * len(strides_list)
  lanes, moduli, where = [], [], {}
  for strides in strides_list:
    for d, s in enumerate(strides):
      key = (d % _OFFSET_BITS, s)
      if s > 1 and key not in where:
        where[key] = len(lanes)
        lanes.append(key[0])
        moduli.append(s)
  drawn = jax.lax.rem(
    random_words(seed, count, lanes), jnp.asarray(moduli, jnp.uint32)
  ).astype(jnp.int32)
  scalars = _common.unstack(drawn)
  zero = jnp.zeros((), jnp.int32)
  out = []
  for strides in strides_list:
    if all(s == 1 for s in strides):
      out.append(None)
      continue
    out.append(
      [
        scalars[where[(d % _OFFSET_BITS, s)]] if s > 1 else zero
        for d, s in enumerate(strides)
      ]
    )
  return out


def random_samples(
  scores: list[jax.Array], seed: Any, count: jax.Array
) -> list[jax.Array]:
  """A random grid of ``max(1024, n/100)`` (at most 65,536) entries per leaf.

  The grid's strides are fixed by the leaf's shape; its offsets are drawn
  afresh every step from ``(seed, count)``, one draw for all leaves, so a
  transform and the fused core given the same seed sample the same entries.
  """
  strides = [
    _common.sample_strides(x.shape, sample_size(x.size)) for x in scores
  ]
  offsets = _random_offsets(seed, count, strides)
  return [
    _common.grid_sample(x, s, o) if o is not None else x
    for x, s, o in zip(scores, strides, offsets)
  ]


_BITS_INF = 0x7F800000  # the bits of float32 +inf


def _varying_like(value: jax.Array, *xs) -> jax.Array:
  """``value`` typed as varying over every ``shard_map`` axis one of ``xs``
  varies over (a ``lax.fori_loop`` carry must keep its type); no operation
  is added to the program.
  """
  axes: set = set()
  for x in xs:
    axes |= _common.varying_axes(x)
  if not axes:
    return value
  return jax.lax.pcast(value, tuple(sorted(axes)), to="varying")


def _group_key(x: jax.Array, j: int) -> tuple:
  """Samples of one key are stacked: same shape, dtype and layout.

  The layout is known at trace time on one device and on an Explicit mesh.
  With several devices and no explicit spec (an Auto mesh) it is not, and
  stacking samples of differently sharded leaves lets XLA's sharding
  propagation give a leaf's update the layout of another leaf's sample (an
  update sharded ``P('data', 'model')`` for a ``P('data', None)`` param):
  there each sample is a group of its own.
  """
  spec = _common.explicit_spec(x)
  if spec is None and jax.device_count() > 1:
    return (j,)
  return (x.shape, jnp.result_type(x), spec)


def bisect_thresholds(samples: list[jax.Array], fraction):
  """For each sample, the ``ceil(fraction m)``-th largest of its magnitudes:
  the largest ``t`` with ``count(|x| >= t) >= fraction m``.

  A bisection on the float32 bit patterns, which order non-negative floats
  as their values do: 31 halvings of ``[0, bits(inf)]`` find the exact
  order statistic of the sample, with no sort and no min / max pass. The
  samples of one shape (and layout) are stacked and bisected together, one
  row each: a step of the loop is one count per group of samples, a
  reduction over the samples' axes (local to each shard, plus an
  all-reduce of one int per sample on a sharded leaf). The compiled loop
  then does not grow with the number of leaves (one loop with a carry per
  sample compiled in 30 s for 1,536 leaves, against 2 s stacked).

  Args:
    samples: real float arrays of any shape (the modulus of complex ones).
    fraction: the fraction to keep, in (0, 1] (may be traced).

  Returns:
    ``(thresholds, kept)``: float32 vectors in the order of ``samples``,
    each sample's threshold (0, i.e. keep every non-zero entry, when
    ``fraction >= 1``) and the fraction of its entries at or above it.
  """
  n = len(samples)
  if not n:
    return jnp.zeros((0,), jnp.float32), jnp.zeros((0,), jnp.float32)
  groups: dict[tuple, list[int]] = {}
  for j, x in enumerate(samples):
    groups.setdefault(_group_key(x, j), []).append(j)
  thr_parts, kept_parts, order = [], [], []
  for js in groups.values():
    stacked = jnp.stack(jax.lax.optimization_barrier([samples[j] for j in js]))
    thr, kept = _bisect_rows(stacked, fraction, _flat_is_local(samples[js[0]]))
    thr_parts.append(thr)
    kept_parts.append(kept)
    order += js
  thr = jnp.concatenate(thr_parts)
  kept = jnp.concatenate(kept_parts)
  if order != list(range(n)):
    inverse = np.argsort(np.asarray(order))
    thr, kept = _common.take(thr, inverse), _common.take(kept, inverse)
  # Keeping everything (a warm-up's first step) keeps entries below the
  # sample's smallest too.
  keep_all = jnp.asarray(fraction) >= 1
  return jnp.where(keep_all, 0.0, thr), jnp.where(keep_all, 1.0, kept)


def _flat_is_local(x: jax.Array) -> bool:
  """Whether flattening ``x`` (row-major) moves no entry between devices:
  on one device, or on an Explicit mesh where only its first axis is
  sharded. A count over one flat axis runs at 1.5x the speed of one over
  the sample's grid axes on XLA:CPU (25 samples of a 21M-parameter tree,
  31 halvings: 0.90 vs 1.35 ms).
  """
  if jax.device_count() == 1:
    return True
  spec = _common.explicit_spec(x)
  return spec is not None and all(s is None for s in spec[1:])


def _bisect_rows(stacked: jax.Array, fraction, flat: bool):
  """:func:`bisect_thresholds` of each row of ``stacked`` (axis 0), counted
  over one flat axis when ``flat``.

  The loop's body is written in ``lax`` operations that XLA's loop passes
  leave as they are (a ``//`` or a ``jnp.where`` brings constants that
  they hoist and sink again, and each change makes the simplification
  passes run over the whole update once more).
  """
  # |x| in the bit domain (the sign bit cleared), on the stack: an abs of
  # each sample would be an elementwise op on a reshape, which XLA's
  # reshape-mover rewrites.
  bits = jax.lax.bitcast_convert_type(
    stacked.astype(jnp.float32), jnp.int32
  ) & jnp.int32(0x7FFFFFFF)
  if flat:
    bits = bits.reshape(bits.shape[0], -1)
  rows = bits.shape[0]
  m = bits[0].size
  axes = tuple(range(1, bits.ndim))
  target = fraction * m
  one = jnp.int32(1)

  def body(_, carry):
    lo, hi, c_lo = carry
    mid = lo + jax.lax.shift_right_logical(hi - lo, one)
    # Summed in float32, exact (a sample has at most 2^24 entries), which
    # XLA:CPU vectorizes; an int32 sum of the same mask ran 1.7x slower.
    count = jnp.sum(
      (bits >= jax.lax.broadcast_in_dim(mid, bits.shape, (0,))).astype(
        jnp.float32
      ),
      axis=axes,
    ).astype(jnp.int32)
    ok = count >= target
    return (
      jax.lax.select(ok, mid, lo),
      jax.lax.select(ok, hi, mid),
      jax.lax.select(ok, count, c_lo),
    )

  start = tuple(
    _varying_like(jnp.full((rows,), v, jnp.int32), bits, target)
    for v in (0, _BITS_INF + 1, m)
  )
  lo, _, count = jax.lax.fori_loop(0, 31, body, start)
  return (
    jax.lax.bitcast_convert_type(lo, jnp.float32),
    count.astype(jnp.float32) / m,
  )


def sampled_thresholds(
  leaves: list[jax.Array], fraction, seed: Any, count: jax.Array
):
  """Per leaf, the threshold on ``|a|`` that keeps about ``fraction``, and the
  kept fraction of its sample: two float32 vectors (:func:`bisect_thresholds`
  of :func:`random_samples`).
  """
  samples = random_samples(leaves, seed, count)
  return bisect_thresholds(
    [
      jnp.abs(x) if jnp.issubdtype(x.dtype, jnp.complexfloating) else x
      for x in samples
    ],
    fraction,
  )


def ema_taus(
  abs_leaves: list[jax.Array],
  taus: jax.Array,
  alpha,
  count: jax.Array,
  every,
) -> jax.Array:
  """The EMA thresholds ``tau`` of the leaves after this step, as a vector.

  ``mean|a|`` comes from a fixed grid of about 4,096 entries of each leaf
  (one reduction, local to each shard plus a scalar all-reduce); ``taus``
  holds the leaves' ``tau`` before the step, and the EMA is one vector
  operation over the leaves.
  """
  if not abs_leaves:
    return taus
  means = _common.stack(
    [
      jnp.mean(_common.strided_sample(x, _MEAN_SAMPLE), dtype=jnp.float32)
      for x in abs_leaves
    ]
  )
  return ema_threshold(taus, means, alpha, count, every).astype(jnp.float32)


def sampled_kept(a: jax.Array, threshold: jax.Array) -> jax.Array:
  """Kept fraction of a leaf estimated on a fixed grid of ~4,096 entries."""
  x = _common.strided_sample(a, _MEAN_SAMPLE)
  return jnp.mean(keep_mask(x, threshold.astype(x.dtype)), dtype=jnp.float32)


def exact_kept_fraction(accumulator, thresholds) -> jax.Array:
  """Exact kept fraction of the last step, from an accumulator state."""
  kept, total = jnp.zeros((), jnp.float32), 0
  leaves = read_accumulator(
    accumulator, jax.tree.structure(_plain(accumulator))
  )
  for a, th in zip(leaves, _common.unstack(thresholds)):
    n = jnp.sum(keep_mask(a, th.astype(a.dtype)) & (th >= 0), dtype=jnp.float32)
    kept = kept + jnp.where(
      th >= 0, n, a.size - jnp.sum(a != 0, dtype=jnp.float32)
    )
    total += a.size
  return kept / total if total else jnp.ones((), jnp.float32)


def _plain(accumulator):
  """The params-shaped tree of a stored accumulator (codes of an 8-bit one)."""
  if _stored_format(accumulator) is not None:
    return accumulator.codes
  return accumulator


def _residual_tree(accumulator, thresholds):
  if accumulator is None:
    return None
  treedef = jax.tree.structure(_plain(accumulator))
  leaves = read_accumulator(accumulator, treedef)
  return treedef.unflatten(
    [residual_of(a, t) for a, t in zip(leaves, _common.unstack(thresholds))]
  )


def _mask_metrics(state) -> dict[str, jax.Array]:
  kept = state.kept_fraction
  if kept is None:
    kept = jnp.where(
      state.count > 0,
      exact_kept_fraction(state.accumulator, state.thresholds),
      1.0,
    )
  out = {"kept_fraction": kept}
  res = state.residual
  if res is not None:
    out["residual_norm"] = jnp.sqrt(
      sum(
        (
          jnp.sum(_common.abs_sq(x), dtype=jnp.float32)
          for x in jax.tree.leaves(res)
        ),
        jnp.zeros((), jnp.float32),
      )
    )
  return out


# --------------------------------------------------------------------------
# States.


class TopKMaskState(NamedTuple):
  """State of :func:`top_k_mask` (and of the fused core's top-k)."""

  count: jax.Array  # shape=(), dtype=int32
  # Error feedback (None when off): the last step's a = g + r, or for leaves
  # whose threshold is < 0, the residual itself.
  accumulator: optax.Updates | None
  thresholds: jax.Array  # shape=(num_leaves,), float32, tree order
  frequency: optax.Updates | None  # EMA of the kept indicator; None off
  # shape=(), float32: kept / total at the last step, estimated on the
  # samples (exact for the exact method); None with error feedback, where
  # metrics() reads it exactly from the accumulator
  kept_fraction: jax.Array | None

  @property
  def residual(self) -> optax.Updates | None:
    """The error-feedback residual carried to the next step (None if off)."""
    return _residual_tree(self.accumulator, self.thresholds)

  def metrics(self) -> dict[str, jax.Array]:
    return _mask_metrics(self)


class EmaThresholdMaskState(NamedTuple):
  """State of :func:`ema_threshold_mask` (and of the fused core's)."""

  count: jax.Array  # shape=(), dtype=int32
  accumulator: optax.Updates | None  # as in TopKMaskState
  thresholds: jax.Array  # shape=(num_leaves,), float32: scale * tau
  tau: jax.Array  # shape=(num_leaves,), float32 EMA thresholds, tree order
  # shape=(), float32, estimated on grid samples; None with error feedback
  kept_fraction: jax.Array | None

  @property
  def residual(self) -> optax.Updates | None:
    """The error-feedback residual carried to the next step (None if off)."""
    return _residual_tree(self.accumulator, self.thresholds)

  def metrics(self) -> dict[str, jax.Array]:
    out = _mask_metrics(self)
    out["tau_mean"] = (
      jnp.mean(self.tau) if self.tau.size else jnp.zeros((), jnp.float32)
    )
    return out


def _scalars(params, value=0.0) -> jax.Array:
  return _common.leaf_scalars(params, value)


def _check_leaves(who, state, updates, leaves):
  """The updates against the state: their leaf paths and shapes against a
  params-shaped buffer of the state (if it keeps one), their count against
  the per-leaf vectors.
  """
  like = None if state.accumulator is None else _plain(state.accumulator)
  if like is None:
    like = getattr(state, "frequency", None)
  if like is not None:
    _common.check_tree_like(who, updates, like)
  state_thresholds = state.thresholds
  if state_thresholds.shape[0] != len(leaves):
    raise ValueError(
      f"{who}: the state was built for {state_thresholds.shape[0]} leaves but"
      f" the updates have {len(leaves)}"
    )


def _out_dtype(a, acc):
  """The gradient's dtype promoted with the accumulator's (which follows the
  params), as optax's stateful transforms do: float32 for bfloat16 gradients
  of float32 params.
  """
  return jnp.promote_types(a.dtype, acc.dtype)


def _flat_or_none(tree, treedef, n):
  return [None] * n if tree is None else treedef.flatten_up_to(tree)


# --------------------------------------------------------------------------
# Top-k.


def _exact_mask(score: jax.Array, fraction, static_k: int | None):
  """Boolean mask of the ``k = ceil(fraction * n)`` largest scores (exactly k)."""
  flat = score.reshape(-1)
  n = flat.shape[0]
  if static_k is not None:
    _, idx = jax.lax.top_k(flat, static_k)
    keep = jnp.zeros((n,), bool).at[idx].set(True)
  else:
    k = jnp.ceil(fraction * n).astype(jnp.int32)
    order = jnp.argsort(-flat, stable=True)
    ranks = (
      jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
    )
    keep = ranks < k
  return keep.reshape(score.shape)


def _warn_if_sharded(x: jax.Array) -> None:
  if _common.explicit_spec(x) is not None:
    raise ValueError(
      "top_k_mask(method='exact') sorts whole leaves and cannot take a "
      f"leaf sharded on an Explicit mesh (spec {_common.explicit_spec(x)});"
      " use method='sampled' (grpo's default) for sharded parameters"
    )
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is not None and not mesh.empty and x.size > 1:
    warnings.warn(
      "top_k_mask(method='exact') sorts a whole leaf: on a sharded leaf XLA "
      "gathers it onto every device. Use method='sampled' for sharded "
      "parameters.",
      UserWarning,
      stacklevel=4,
    )


def _score_masks(
  a_leaves,
  dense,
  frac,
  method,
  static_fraction,
  freq,
  frequency_weight,
  seed,
  t,
):
  """Masks of the exact or frequency-weighted top-k (not a threshold on |a|).

  ``static_fraction``: the kept fraction as a Python float when it is static
  (no warm-up, not traced), else None.
  """
  keeps, kept = [], []
  for a, d, f in zip(a_leaves, dense, freq):
    if d is True:
      keeps.append(jnp.ones(a.shape, bool))
      kept.append(jnp.ones((), jnp.float32))
      continue
    score = jnp.abs(a).astype(jnp.float32)
    if f is not None:
      score = (1 - frequency_weight) * score / (
        jnp.mean(score) + 1e-30
      ) - frequency_weight * f
    if method == "exact":
      _warn_if_sharded(a)
      static_k = (
        None if static_fraction is None else math.ceil(static_fraction * a.size)
      )
      keep = _exact_mask(score, frac, static_k) & (a != 0)
      k = jnp.sum(keep, dtype=jnp.float32) / a.size
    else:
      thr = sampled_thresholds([score - jnp.min(score)], frac, seed, t)[0][0]
      keep = (score - jnp.min(score) >= thr) & (a != 0)
      k = sampled_kept(jnp.where(keep, 1.0, 0.0), jnp.asarray(0.5))
    if d is not False:  # traced min_size
      keep = keep | d
      k = jnp.where(d, 1.0, k)
    keeps.append(keep)
    kept.append(k)
  return keeps, kept


def _score_path(leaves, accs, thresholds, dense, score_args):
  """``(a_leaves, keeps, kept)`` of the exact or frequency-weighted top-k,
  whose accumulators hold their residuals (threshold :data:`RESIDUAL_ONLY`).
  """
  a_leaves = [
    accumulate(g, acc, th).astype(g.dtype)
    for g, acc, th in zip(leaves, accs, _common.unstack(thresholds))
  ]
  keeps, kept = _score_masks(a_leaves, dense, *score_args)
  return a_leaves, keeps, _common.stack(kept)


@dataclasses.dataclass(frozen=True)
class TopKMaskConfig(_mechanism.Config):
  """The knobs of :func:`top_k_mask`, validated (see its arguments).

  Attributes:
    fraction: kept fraction, in (0, 1].
    error_feedback: carry the masked-out part to the next step.
    method: ``"exact"`` or ``"sampled"``.
    frequency_weight: ``b`` in [0, 1], or None (off, no buffer).
    min_size: leaves smaller than this pass dense, int >= 0.
    warmup_steps: length of the sparsity warm-up, int >= 0.
    frequency_decay: EMA decay of the kept indicator, in [0, 1).
    seed: seed of the sample's offsets and of the accumulator's rounding.
    accumulator_format: the accumulator's storage (a
      :class:`~grpo_optax.quantization.StateFormat`, or None).
  """

  fraction: Any = 0.3
  error_feedback: bool = True
  method: str = "exact"
  frequency_weight: Any = None
  min_size: Any = 0
  warmup_steps: Any = 0
  frequency_decay: Any = 0.9
  seed: Any = 0
  accumulator_format: Any = None
  _given_fraction: Any = dataclasses.field(
    default=None, init=False, repr=False, compare=False
  )

  def __post_init__(self):
    _common.check_range(
      "fraction", self.fraction, 0.0, 1.0, low_inclusive=False
    )
    _common.check_choice("method", self.method, METHODS)
    if self.frequency_weight is not None:
      _common.check_range("frequency_weight", self.frequency_weight, 0.0, 1.0)
    _common.check_range(
      "frequency_decay", self.frequency_decay, 0.0, 1.0, high_inclusive=False
    )
    static_int("min_size", self.min_size, 0)
    static_int("warmup_steps", self.warmup_steps, 0)
    static_int("seed", self.seed, 0)
    _common.check_bool("error_feedback", self.error_feedback)
    self._set(
      # k = ceil(fraction n) from the fraction as given: in float32, 0.3
      # is 0.30000001 and ceil(0.3f * 1000) is 301.
      _given_fraction=_common.concrete_value(self.fraction),
      accumulator_format=check_accumulator_format(self.accumulator_format),
      fraction=_common.f32(self.fraction),
      frequency_weight=_common.f32(self.frequency_weight),
      frequency_decay=_common.f32(self.frequency_decay),
    )

  @property
  def by_threshold(self) -> bool:
    """Whether the mask is a threshold on ``|a|`` (the sampled top-k)."""
    return self.method == "sampled" and self.frequency_weight is None

  @property
  def static_fraction(self) -> float | None:
    """The kept fraction as a Python float when it is static (no warm-up,
    not traced), else None.
    """
    if static_int("warmup_steps", self.warmup_steps, 0) != 0:
      return None
    return self._given_fraction

  def init(self, params):
    (error_feedback, use_frequency, by_threshold, acc_fmt) = (
      self.error_feedback,
      self.frequency_weight is not None,
      self.by_threshold,
      self.accumulator_format,
    )
    return TopKMaskState(
      count=jnp.zeros([], jnp.int32),
      accumulator=(
        init_accumulator(params, acc_fmt) if error_feedback else None
      ),
      thresholds=_scalars(params),
      frequency=(
        optax.tree.zeros_like(params, dtype=jnp.float32)
        if use_frequency
        else None
      ),
      kept_fraction=(
        None if error_feedback and by_threshold else jnp.ones([], jnp.float32)
      ),
    )

  def update(self, updates, state, params=None, **extra_args):
    del params, extra_args
    leaves, treedef = jax.tree.flatten(updates)
    _check_leaves("top_k_mask", state, updates, leaves)
    if self.by_threshold:
      a_leaves, thr, new_state, _ = self.threshold_phase(leaves, state, treedef)
      return treedef.unflatten(
        _masked_outputs(a_leaves, thr, state, treedef)
      ), new_state
    return self._score_update(leaves, state, treedef)

  def threshold_phase(self, leaves, state, treedef, x_bounds=None):
    """The sampled top-k up to its thresholds: ``(a_leaves, thresholds,
    new_state, maxima)``, with ``a`` the accumulated (and stored) gradients,
    one threshold scalar per masked leaf (None on a leaf that passes dense)
    and the 8-bit accumulator's blocks' maxima (``store_accumulator``).
    The fused core of :func:`grpo_optax.grpo` calls it too, with
    ``x_bounds`` (see ``accumulator_scales``).
    """
    t = state.count
    dense = [dense_leaf(g.size, self.min_size) for g in leaves]
    a_leaves, stored, maxima = _accumulated(
      self, leaves, state, treedef, dense, x_bounds
    )
    frac = warmup_fraction(self.fraction, self.warmup_steps, t)
    found = topk_leaf_thresholds(a_leaves, dense, frac, self.seed, t)
    return (
      a_leaves,
      found.leaves,
      TopKMaskState(
        count=_common.safe_increment(t),
        accumulator=stored,
        thresholds=found.vector + 0 * state.thresholds,
        frequency=None,
        kept_fraction=_kept(state, found.kept, leaves),
      ),
      maxima,
    )

  def _score_update(self, leaves, state, treedef):
    """The exact or frequency-weighted top-k (the accumulator holds the
    residual, threshold :data:`RESIDUAL_ONLY`).
    """
    t = state.count
    n = len(leaves)
    accs = _read_or_none(self, state, treedef, n)
    freq = _flat_or_none(state.frequency, treedef, n)
    dense = [dense_leaf(g.size, self.min_size) for g in leaves]
    frac = warmup_fraction(self.fraction, self.warmup_steps, t)
    a_leaves, keeps, kept = _score_path(
      leaves,
      accs,
      state.thresholds,
      dense,
      (
        frac,
        self.method,
        self.static_fraction,
        freq,
        self.frequency_weight,
        self.seed,
        t,
      ),
    )
    outs, residuals = [], []
    for a, keep, acc in zip(a_leaves, keeps, accs):
      out, res = split_by_mask(a, keep)
      outs.append(out if acc is None else out.astype(_out_dtype(a, acc)))
      residuals.append(res)
    stored = None
    if self.error_feedback:
      stored, _, _ = store_accumulator(
        residuals,
        state.accumulator,
        treedef,
        dense,
        self.accumulator_format,
        accumulator_word(self.seed, t),
      )
    new_freq = None
    if self.frequency_weight is not None:
      new_freq = treedef.unflatten(
        [
          _common.ema(f, k, self.frequency_decay).astype(jnp.float32)
          for f, k in zip(freq, keeps)
        ]
      )
    return treedef.unflatten(outs), TopKMaskState(
      count=_common.safe_increment(t),
      accumulator=stored,
      thresholds=0 * state.thresholds + RESIDUAL_ONLY,
      frequency=new_freq,
      kept_fraction=_kept(state, kept, leaves),
    )


def _read_or_none(cfg, state, treedef, n):
  """The accumulator's leaves (decoded), or Nones without error feedback."""
  if not cfg.error_feedback:
    return [None] * n
  return read_accumulator(state.accumulator, treedef)


def accumulator_scales(cfg, x_leaves, state, treedef, dense, x_bounds=None):
  r"""The scales of an 8-bit accumulator's new blocks, from a bound (None for
  other formats).

  The accumulator stores :math:`a = x + r`, with :math:`r` the residual of
  the old accumulator at the last step's threshold :math:`\theta`: entries
  below it in magnitude (all of it for :data:`RESIDUAL_ONLY`), each at most
  the old block's scale :math:`s`. So block by block

  .. math::

    \max_i |a_i| \le \max_i |x_i| + \min(s, \theta),

  known before ``a`` is (as for the moments,
  ``grpo_optax.momentum.moment_scale``): the new accumulator is encoded
  in the same elementwise pass that adds the gradient, instead of being
  written out in float32 for a reduction first. The bound stays within the
  threshold of the block's maximum, so the accumulator's resolution follows
  its threshold, not its history. ``x_bounds``: per leaf, a bound on the
  blocks' :math:`\max_i |x_i|` known to the caller (the fused core: the
  gradient's maxima times the clip factor); None: the maxima of ``x``.
  """
  fmt = cfg.accumulator_format
  if not cfg.error_feedback or fmt is None or not fmt.blocked:
    return None
  old = treedef.flatten_up_to(state.accumulator.scale)
  masked = masked_leaves(dense)
  out: list[Any] = [None] * len(x_leaves)
  if not masked:
    return out
  ths = state.thresholds
  if len(masked) != len(x_leaves):
    ths = _common.take(ths, masked)
  for i, th in zip(masked, _common.unstack(ths)):
    if x_bounds is not None:
      xb = x_bounds[i]
    else:
      xb = quantization.block_absmax(fmt, x_leaves[i])
    th = th.astype(jnp.float32)
    out[i] = xb + jnp.where(th >= 0, jnp.minimum(old[i], th), old[i])
  return out


def _accumulated(cfg, leaves, state, treedef, dense, x_bounds=None):
  """``(a_leaves, stored, maxima)``: the accumulated gradients as the masks
  read them, the new stored accumulator (None without error feedback) and
  its 8-bit blocks' maxima (:func:`store_accumulator`).
  """
  accs = _read_or_none(cfg, state, treedef, len(leaves))
  a_leaves = accumulate_leaves(leaves, accs, state.thresholds, dense)
  if not cfg.error_feedback:
    return a_leaves, None, [None] * len(leaves)
  stored, a_leaves, maxima = store_accumulator(
    a_leaves,
    state.accumulator,
    treedef,
    dense,
    cfg.accumulator_format,
    accumulator_word(cfg.seed, state.count),
    accumulator_scales(cfg, leaves, state, treedef, dense, x_bounds),
  )
  return a_leaves, stored, maxima


def _kept(state, kept, leaves):
  """The state's kept fraction (None where the state keeps none)."""
  if state.kept_fraction is None or kept is None:
    return None
  sizes = [g.size for g in leaves]
  return size_weighted_vector(kept, sizes) + 0 * state.kept_fraction


def _masked_outputs(a_leaves, thresholds, state, treedef):
  """The masks' outputs: ``a`` where ``|a| >= threshold`` (all of ``a`` on a
  dense leaf), in optax's dtype (the gradient's promoted with the
  accumulator's).
  """
  n = len(a_leaves)
  stored = state.accumulator
  if stored is None:
    dtypes = [None] * n
  elif _stored_format(stored) is None:
    dtypes = [jnp.result_type(x) for x in treedef.flatten_up_to(stored)]
  else:  # decoded to float32
    dtypes = [jnp.dtype(jnp.float32)] * n
  outs = []
  for a, th, d in zip(a_leaves, thresholds, dtypes):
    out = a if th is None else masked_part(a, th)
    outs.append(out if d is None else out.astype(jnp.promote_types(a.dtype, d)))
  return outs


def top_k_mask(
  fraction: float = 0.3,
  error_feedback: bool = True,
  method: str = "exact",
  frequency_weight: float | None = None,
  min_size: int = 0,
  warmup_steps: int = 0,
  *,
  frequency_decay: float = 0.9,
  seed: int = 0,
  accumulator_format: str | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Keeps the largest ``fraction`` of each leaf's entries, with error feedback.

  Per leaf of ``n`` entries, with ``r`` the error-feedback residual (zero when
  ``error_feedback=False``):

  .. math::

    a = g + r,\qquad \text{score} = |a| \;\text{ or, with } b > 0,\;
    (1-b)\,|a|/\operatorname{mean}|a| - b f

    \text{out} = a \odot \text{keep},\qquad r \leftarrow a - \text{out}

  where ``keep`` marks the ``k = ceil(fraction * n)`` largest scores
  (``method="exact"``: exactly ``k``, ties broken by position, via
  ``lax.top_k``, which sorts the whole leaf: on a sharded leaf XLA gathers
  it, so it warns when it can see a mesh) or the scores above a threshold
  bisected on a random grid sample of ``max(1024, n/100)`` entries
  (``method="sampled"``: O(n), keeps about ``k``; the grid's offsets are
  drawn every step from ``(seed, count)``; the grid is taken shard by shard
  on a sharded leaf). Exact zeros are never kept. ``f`` is the EMA (decay
  ``frequency_decay``) of the kept indicator, so with
  ``frequency_weight = b > 0`` entries updated often yield to rarely updated
  ones (the article's "update frequency" term). ``frequency_weight=None``
  (the default) switches the term off and keeps no frequency buffer.

  With error feedback nothing is lost: ``sum_t out_t + r_T == sum_t g_t``
  (``state.residual`` is ``r_T``). Leaves with ``n < min_size`` pass dense.
  During the first ``warmup_steps`` steps the kept fraction ramps
  exponentially from 1 to ``fraction``, ``fraction ** (t / warmup_steps)``
  (Deep Gradient Compression's sparsity warm-up).

  Args:
    fraction: kept fraction, in (0, 1].
    error_feedback: carry the masked-out part to the next step.
    method: ``"exact"`` or ``"sampled"``.
    frequency_weight: ``b`` in [0, 1], or ``None`` (off, no buffer).
    min_size: leaves smaller than this pass dense, int >= 0.
    warmup_steps: length of the sparsity warm-up, int >= 0.
    frequency_decay: EMA decay of the kept indicator, in [0, 1).
    seed: seed of the sample's offsets (and of the accumulator's stochastic
      rounding), int >= 0.
    accumulator_format: storage of the error-feedback accumulator: None (the
      params' dtype), ``"float32"``, ``"bfloat16_sr"`` (2 bytes) or
      ``"int8_sr"`` (block-wise 8 bits, 1 byte + 4 per 256 entries), the
      lossy ones rounded stochastically (``ACCUMULATOR_FORMATS``).

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Examples:
    >>> import jax.numpy as jnp, grpo_optax
    >>> tx = grpo_optax.top_k_mask(fraction=0.5)
    >>> g = {"w": jnp.array([0.1, -3.0, 2.0, 0.5])}
    >>> out, state = tx.update(g, tx.init(g))
    >>> out["w"], state.residual["w"]
    (Array([ 0., -3.,  2.,  0.], dtype=float32), Array([0.1, 0. , 0. , 0.5], dtype=float32))

  References:
    Lin et al., `Deep Gradient Compression
    <https://arxiv.org/abs/1712.01887>`_, ICLR 2018.
    Stich et al., `Sparsified SGD with Memory
    <https://arxiv.org/abs/1809.07599>`_, NeurIPS 2018.
    Karimireddy et al., `Error Feedback Fixes SignSGD
    <https://arxiv.org/abs/1901.09847>`_, ICML 2019.
  """
  return TopKMaskConfig(
    fraction,
    error_feedback,
    method,
    frequency_weight,
    min_size,
    warmup_steps,
    frequency_decay,
    seed,
    accumulator_format,
  ).transform()


def size_weighted_vector(values: jax.Array, sizes: list[int]) -> jax.Array:
  """``sum(n_i v_i) / sum(n_i)`` of a vector of per-leaf values."""
  total = sum(sizes)
  if not total:
    return jnp.ones((), jnp.float32)
  return jnp.sum(values * jnp.asarray([n / total for n in sizes], jnp.float32))


def size_weighted(values: list[jax.Array], sizes: list[int]) -> jax.Array:
  """``sum(n_i v_i) / sum(n_i)`` (1 for no entries), from one stacked vector."""
  total = sum(sizes)
  if not total:
    return jnp.ones((), jnp.float32)
  weights = jnp.asarray([n / total for n in sizes], jnp.float32)
  return jnp.sum(_common.stack(values) * weights)


class LeafThresholds(NamedTuple):
  """The thresholds of one step of a mask, for the state and for the leaves.

  ``vector``: every leaf's threshold in tree order (the state's
  ``thresholds``; :data:`RESIDUAL_ONLY` on a leaf that passes dense).
  ``leaves``: per leaf, its threshold as a separate scalar (None on a leaf
  that passes dense for a static ``min_size``), read by that leaf's kernels.
  ``kept``: per-leaf kept fractions (1 on a dense leaf), a vector in tree
  order, or None where the mask does not estimate them.
  """

  vector: jax.Array
  leaves: list[jax.Array | None]
  kept: jax.Array | None


def masked_leaves(dense: list[Any]) -> list[int]:
  """Indices of the leaves a mask may sparsify (not statically dense)."""
  return [i for i, d in enumerate(dense) if d is not True]


def _traced_dense(dense: list[Any], masked: list[int]) -> jax.Array | None:
  """The dense flags of ``masked`` as a bool vector when ``min_size`` is
  traced (some flag is a tracer), else None.
  """
  if all(dense[i] is False for i in masked):
    return None
  return _common.stack([dense[i] for i in masked], jnp.bool_)


def _in_tree_order(values: jax.Array, masked: list[int], fill: jax.Array):
  """A vector over all leaves: ``values[j]`` at leaf ``masked[j]``, the
  leaf's entry of ``fill`` (a vector over all leaves) elsewhere; one gather.
  """
  n = fill.shape[0]
  if masked == list(range(n)):
    return values
  index = np.arange(len(masked), len(masked) + n, dtype=np.int32)
  index[masked] = np.arange(len(masked), dtype=np.int32)
  return _common.take(jnp.concatenate([values, fill]), index)


def _split_masked(values: jax.Array, masked: list[int], n: int):
  """Per leaf, its entry of ``values`` (over ``masked``) or None."""
  out: list[jax.Array | None] = [None] * n
  for i, v in zip(masked, _common.unstack(values)):
    out[i] = v
  return out


def topk_leaf_thresholds(a_leaves, dense, frac, seed, t) -> LeafThresholds:
  """Thresholds of the sampled top-k (:func:`sampled_thresholds`).

  ``dense`` (from :func:`dense_leaf`) marks leaves that pass dense: their
  threshold is :data:`RESIDUAL_ONLY` and their kept fraction 1.
  """
  n = len(a_leaves)
  masked = masked_leaves(dense)
  thr, kept = sampled_thresholds([a_leaves[i] for i in masked], frac, seed, t)
  traced = _traced_dense(dense, masked)
  if traced is not None:
    thr = jnp.where(traced, RESIDUAL_ONLY, thr)
    kept = jnp.where(traced, 1.0, kept)
  return LeafThresholds(
    vector=_in_tree_order(thr, masked, jnp.full((n,), RESIDUAL_ONLY)),
    leaves=_split_masked(thr, masked, n),
    kept=_in_tree_order(kept, masked, jnp.ones((n,), jnp.float32)),
  )


# --------------------------------------------------------------------------
# EMA threshold.


def threshold_leaf_thresholds(
  a_leaves, dense, taus: jax.Array, alpha, t, every, scale
) -> tuple[LeafThresholds, jax.Array]:
  """The EMA threshold's :class:`LeafThresholds` (``kept`` None) and its new
  ``tau`` vector: a dense leaf keeps its ``tau``.
  """
  n = len(a_leaves)
  masked = masked_leaves(dense)
  old = taus if len(masked) == n else _common.take(taus, masked)
  tau = ema_taus([jnp.abs(a_leaves[i]) for i in masked], old, alpha, t, every)
  thr = (scale * tau).astype(jnp.float32)
  traced = _traced_dense(dense, masked)
  if traced is not None:
    tau = jnp.where(traced, old, tau)
    thr = jnp.where(traced, RESIDUAL_ONLY, thr)
  return (
    LeafThresholds(
      vector=_in_tree_order(thr, masked, jnp.full((n,), RESIDUAL_ONLY)),
      leaves=_split_masked(thr, masked, n),
      kept=None,
    ),
    _in_tree_order(tau, masked, taus),
  )


@dataclasses.dataclass(frozen=True)
class EmaThresholdMaskConfig(_mechanism.Config):
  """The knobs of :func:`ema_threshold_mask`, validated (see its arguments).

  Attributes:
    alpha: EMA weight of the new mean, in (0, 1].
    every: refresh period in steps, int >= 1.
    scale: multiplier of the threshold, >= 0.
    error_feedback: carry the masked-out part to the next step.
    min_size: leaves smaller than this pass dense, int >= 0.
    seed: seed of the accumulator's stochastic rounding, int >= 0.
    accumulator_format: the accumulator's storage (a
      :class:`~grpo_optax.quantization.StateFormat`, or None).
  """

  alpha: Any = 0.7
  every: Any = 100
  scale: Any = 1.0
  error_feedback: bool = True
  min_size: Any = 0
  seed: Any = 0
  accumulator_format: Any = None

  def __post_init__(self):
    _common.check_range("alpha", self.alpha, 0.0, 1.0, low_inclusive=False)
    static_int("every", self.every, 1)
    _common.check_range("scale", self.scale, 0.0)
    static_int("min_size", self.min_size, 0)
    static_int("seed", self.seed, 0)
    _common.check_bool("error_feedback", self.error_feedback)
    self._set(
      accumulator_format=check_accumulator_format(self.accumulator_format),
      alpha=_common.f32(self.alpha),
      scale=_common.f32(self.scale),
    )

  def init(self, params):
    error_feedback, acc_fmt = self.error_feedback, self.accumulator_format
    return EmaThresholdMaskState(
      count=jnp.zeros([], jnp.int32),
      accumulator=(
        init_accumulator(params, acc_fmt) if error_feedback else None
      ),
      thresholds=_scalars(params),
      tau=_scalars(params),
      kept_fraction=None if error_feedback else jnp.ones([], jnp.float32),
    )

  def update(self, updates, state, params=None, **extra_args):
    del params, extra_args
    leaves, treedef = jax.tree.flatten(updates)
    _check_leaves("ema_threshold_mask", state, updates, leaves)
    a_leaves, thr, new_state, _ = self.threshold_phase(leaves, state, treedef)
    return treedef.unflatten(
      _masked_outputs(a_leaves, thr, state, treedef)
    ), new_state

  def threshold_phase(self, leaves, state, treedef, x_bounds=None):
    """The EMA threshold up to its thresholds: ``(a_leaves, thresholds,
    new_state, maxima)`` as :meth:`TopKMaskConfig.threshold_phase`.
    """
    t = state.count
    dense = [dense_leaf(g.size, self.min_size) for g in leaves]
    a_leaves, stored, maxima = _accumulated(
      self, leaves, state, treedef, dense, x_bounds
    )
    found, tau = threshold_leaf_thresholds(
      a_leaves, dense, state.tau, self.alpha, t, self.every, self.scale
    )
    kept = None
    if not self.error_feedback:
      kept = _common.stack(
        [
          jnp.ones((), jnp.float32) if th is None else sampled_kept(a, th)
          for a, th in zip(a_leaves, found.leaves)
        ]
      )
    return (
      a_leaves,
      found.leaves,
      EmaThresholdMaskState(
        count=_common.safe_increment(t),
        accumulator=stored,
        thresholds=found.vector + 0 * state.thresholds,
        tau=tau + 0 * state.tau,
        kept_fraction=_kept(state, kept, leaves),
      ),
      maxima,
    )


def ema_threshold_mask(
  alpha: float = 0.7,
  every: int = 100,
  scale: float = 1.0,
  error_feedback: bool = True,
  min_size: int = 0,
  *,
  seed: int = 0,
  accumulator_format: str | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Keeps entries whose magnitude exceeds a slowly moving per-leaf threshold.

  Per leaf, with ``r`` the error-feedback residual and ``t`` the step count
  before this step:

  .. math::

    a = g + r,\qquad
    \tau \leftarrow \begin{cases}
      \operatorname{mean}|a| & t = 0\\
      \alpha \operatorname{mean}|a| + (1-\alpha)\tau & t > 0,\ t \bmod N = 0\\
      \tau & \text{otherwise}\end{cases}

    \text{out} = a \odot [\,|a| \ge c\,\tau\,],\qquad r \leftarrow a - \text{out}

  with ``N = every`` and ``c = scale``. One O(n) pass, no sort;
  ``mean|a|`` is estimated on a fixed grid of about 4,096 entries of the
  leaf. The kept fraction is whatever the threshold gives: it drifts when
  the gradient scale drifts between refreshes, so the state reports it
  (``kept_fraction``). Leaves with ``n < min_size`` pass dense.

  Args:
    alpha: EMA weight of the new mean, in (0, 1] (article: 0.7).
    every: refresh period ``N`` in steps, int >= 1 (article: 100).
    scale: multiplier ``c`` of the threshold, >= 0.
    error_feedback: carry the masked-out part to the next step.
    min_size: leaves smaller than this pass dense, int >= 0.
    seed: seed of the accumulator's stochastic rounding, int >= 0.
    accumulator_format: storage of the error-feedback accumulator, as in
      :func:`top_k_mask`.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Examples:
    >>> import jax.numpy as jnp, grpo_optax
    >>> tx = grpo_optax.ema_threshold_mask()
    >>> g = {"w": jnp.array([0.1, -3.0, 2.0, 0.5])}
    >>> out, state = tx.update(g, tx.init(g))
    >>> out["w"], state.tau
    (Array([ 0., -3.,  2.,  0.], dtype=float32), Array([1.4], dtype=float32))

  References:
    Lin et al., `Deep Gradient Compression
    <https://arxiv.org/abs/1712.01887>`_, ICLR 2018.
    Seetharaman et al., `AutoClip: Adaptive Gradient Clipping
    <https://arxiv.org/abs/2007.14469>`_, 2020.
  """
  return EmaThresholdMaskConfig(
    alpha,
    every,
    scale,
    error_feedback,
    min_size,
    seed,
    accumulator_format,
  ).transform()
