"""Storage formats for parameter-sized optimizer state (fp32, bf16, 8-bit).

An optimizer keeps its moments in a *stored* form and works on them in
float32: ``x = decode(fmt, stored)``, update ``x``, ``stored = encode(fmt,
x)``, all inside one elementwise pass that XLA fuses. The formats:

* ``"float32"``, ``"bfloat16"``: a plain array of that dtype (bf16 rounds to
  nearest even).
* ``"bfloat16_sr"``: bf16 with stochastic rounding (unbiased: ``E[stored] =
  x``), driven by a key the caller keeps in its state.
* ``"int8"``: block-wise dynamic quantisation of a signed array (first
  moment, error-feedback residual) after Dettmers et al. (2022): an int8
  code per entry and one float32 scale (the block's absolute maximum) per
  block of ``block_size`` entries along the last axis.
* ``"int8_sr"``: the same codes, rounded stochastically between the two
  levels around each entry (unbiased in value): for arrays that accumulate
  small increments (the error-feedback accumulator), where rounding to
  nearest would drop them.
* ``"uint8"``: the same for a non-negative array (second moment): a uint8
  code, 255 levels of magnitude instead of 127.

Code map: entry :math:`x` of a block with absolute maximum :math:`s` is
stored as the integer :math:`q \\in \\{-Q, \\dots, Q\\}` (``Q = 127`` signed,
``255`` unsigned) whose value :math:`\\mathrm{sign}(q)\\,s\\,(|q|/Q)^p` is
nearest to :math:`x`; the power :math:`p` spends the levels non-linearly
(dense near 0, where most moment entries lie). ``p = 1`` is linear
quantisation; ``p = 2`` on ``nu`` stores :math:`\\sqrt{\\nu}` linearly (a
square-root mapping). The defaults (``p = 2`` for both, blocks of 256) were
chosen by measuring the error on Adam moments (``python -m benchmarks.memory
--sections codec``; see ``docs/memory.md``). :func:`encode` stores the
block's maximum (code ``Q``, to one float32 rounding), so a block that
decays as a whole (``nu`` times ``b2``) keeps its relative values; given a
``scale`` (a bound on the block, as the optimizers pass for their moments:
``grpo_optax.momentum.moment_scale``) it stores the block relative to
that bound instead.

Denominators: ``decode(..., floor=True)`` decodes code 0 as the upper end
of the values it stands for, :math:`s (1/Q)^p / 2`, not 0; the optimizers
decode ``nu`` so, since an entry of ``nu`` rounds to 0 while the matching
``mu`` entry does not (``nu`` spans the gradient's range squared), and
Adam's step :math:`\\hat m / (\\sqrt{\\hat v} + \\epsilon)` would become
:math:`\\hat m / \\epsilon`.

Block layout: blocks run along the *last* axis only, so the codes have the
parameter's shape and the scales the parameter's rank, with shape
``x.shape[:-1] + (ceil(x.shape[-1] / B),)``. A leaf sharded along any axis
(the last one in multiples of ``B`` entries per shard) is encoded and decoded
shard by shard, with no communication and no ``reshape(-1)``; a leaf whose
shards along the last axis ``B`` does not divide (a ``(64, 768)`` leaf over 8
devices, 96 per shard, in blocks of 256) is refused by :func:`tree_init` with
an error that names it, rather than blocked across shards (a reshape error on
an Explicit mesh, an all-gather every step on an Auto one). The block size
is ``B = min(block_size, x.shape[-1])``: a vector of 10 entries is one block
of 10; a scalar is one block of 1 (stored exactly, scale of shape ``()``).
A last axis that ``B`` does not divide ends in one shorter block.

For whole trees, :func:`tree_init` / :func:`tree_encode` return
``Quantized(codes=<tree>, scale=<tree>)``: two trees with the parameters'
structure, so ``optax.tree.map_params`` maps the parameters' shardings onto
both (onto the scales when the number of blocks divides as the last axis
does).

References:
  Dettmers, Lewis, Shleifer & Zettlemoyer, `8-bit Optimizers via Block-wise
  Quantization <https://arxiv.org/abs/2110.02861>`_, ICLR 2022.
  Gupta et al., `Deep Learning with Limited Numerical Precision
  <https://arxiv.org/abs/1502.02551>`_ (stochastic rounding), 2015.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any
from typing import NamedTuple

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from grpo_optax import _common

__all__ = (
  "DEFAULT_BLOCK_SIZE",
  "DEFAULT_MIN_SIZE",
  "FORMAT_NAMES",
  "FormatLike",
  "Quantized",
  "StateFormat",
  "block_absmax",
  "bytes_per_entry",
  "decode",
  "encode",
  "encode_with_absmax",
  "init",
  "scale_shape",
  "state_format",
  "stored_absmax",
  "tree_bytes",
  "tree_decode",
  "tree_encode",
  "tree_init",
)


@dataclasses.dataclass(frozen=True)
class StateFormat:
  """How one parameter-sized state array is stored (hashable, static).

  Attributes:
    name: one of :data:`FORMAT_NAMES`.
    dtype: the stored dtype of the parameter-sized part.
    block_size: entries per block along the last axis (8-bit formats only).
    power: exponent ``p`` of the code map (8-bit formats only).
    stochastic: whether encoding rounds stochastically (needs a key).
    min_size: 8-bit formats: an array of fewer entries is stored in
      float32 (its codes are the float32 values, its scales unused): what
      8 bits would save on it is negligible beside the large arrays, and
      its blocks are too few to share a scale (a bias, a 2-parameter
      problem). Default :data:`DEFAULT_MIN_SIZE`, as bitsandbytes does.
  """

  name: str
  dtype: Any
  block_size: int = 0
  power: int = 0
  stochastic: bool = False
  min_size: int = 0

  def exact(self, shape: tuple[int, ...]) -> bool:
    """Whether an array of ``shape`` is stored in float32 (``min_size``)."""
    return self.blocked and math.prod(shape) < self.min_size

  @property
  def blocked(self) -> bool:
    """Whether the stored form is :class:`Quantized` (codes + scales)."""
    return self.block_size > 0

  @property
  def levels(self) -> int:
    """``Q``: the largest code magnitude (127 signed, 255 unsigned)."""
    return int(jnp.iinfo(self.dtype).max) if self.blocked else 0


#: The names :func:`state_format` accepts (``mu_format=``, ``nu_format=``).
FORMAT_NAMES = (
  "float32",
  "bfloat16",
  "bfloat16_sr",
  "int8",
  "int8_sr",
  "uint8",
)
#: Entries per block of the 8-bit formats, along the last axis.
DEFAULT_BLOCK_SIZE = 256
#: Arrays of fewer entries are stored in float32 by the 8-bit formats.
DEFAULT_MIN_SIZE = 4096
_DEFAULT_POWER = {"int8": 2, "int8_sr": 2, "uint8": 2}
_DTYPES = {
  "float32": jnp.float32,
  "bfloat16": jnp.bfloat16,
  "bfloat16_sr": jnp.bfloat16,
  "int8": jnp.int8,
  "int8_sr": jnp.int8,
  "uint8": jnp.uint8,
}


class Quantized(NamedTuple):
  """Stored form of the 8-bit formats (of one array, or of a whole tree).

  Attributes:
    codes: int8 / uint8 codes, the shape of the encoded array.
    scale: float32 absolute maximum of each block, shape
      ``x.shape[:-1] + (num_blocks,)`` (``()`` for a scalar).
  """

  codes: Any
  scale: Any


#: A format: one of :data:`FORMAT_NAMES` or a :class:`StateFormat`.
FormatLike = str | StateFormat


def state_format(
  name: FormatLike,
  *,
  block_size: int | None = None,
  power: int | None = None,
  min_size: int | None = None,
) -> StateFormat:
  """The :class:`StateFormat` called ``name``.

  Args:
    name: one of :data:`FORMAT_NAMES`, or a :class:`StateFormat` (returned
      as is when no override is given).
    block_size: entries per block for ``"int8"`` / ``"uint8"``, >= 1
      (default 256).
    power: code-map exponent for ``"int8"`` / ``"uint8"``, in [1, 8]
      (default 2).
    min_size: 8-bit formats: arrays of fewer entries are stored in
      float32, >= 0 (default :data:`DEFAULT_MIN_SIZE`; 0: none).

  Returns:
    The format (a :class:`StateFormat` given with overrides keeps its other
    settings).

  Raises:
    ValueError: for an unknown name, or an out-of-range ``block_size``,
      ``power`` or ``min_size``, or any of them given for a float format.
  """
  if isinstance(name, StateFormat):
    if block_size is None and power is None and min_size is None:
      return name
    if name.blocked:
      block_size = name.block_size if block_size is None else block_size
      power = name.power if power is None else power
      min_size = name.min_size if min_size is None else min_size
    name = name.name
  if name not in FORMAT_NAMES:
    raise ValueError(f"`format` must be one of {FORMAT_NAMES}, got {name!r}.")
  if name not in _DEFAULT_POWER:
    if block_size is not None or power is not None or min_size is not None:
      raise ValueError(
        f"`block_size`, `power` and `min_size` apply to the 8-bit formats "
        f"only, not to {name!r}."
      )
    return StateFormat(
      name, jnp.dtype(_DTYPES[name]), stochastic=name.endswith("_sr")
    )
  block_size = DEFAULT_BLOCK_SIZE if block_size is None else block_size
  power = _DEFAULT_POWER[name] if power is None else power
  if not isinstance(block_size, int) or block_size < 1:
    raise ValueError(f"`block_size` must be an int >= 1, got {block_size!r}.")
  if not isinstance(power, int) or not 1 <= power <= 8:
    raise ValueError(f"`power` must be an int in [1, 8], got {power!r}.")
  min_size = DEFAULT_MIN_SIZE if min_size is None else min_size
  if (
    not isinstance(min_size, int) or isinstance(min_size, bool) or min_size < 0
  ):
    raise ValueError(f"`min_size` must be an int >= 0, got {min_size!r}.")
  return StateFormat(
    name,
    jnp.dtype(_DTYPES[name]),
    block_size,
    power,
    stochastic=name.endswith("_sr"),
    min_size=min_size,
  )


def scale_shape(fmt: StateFormat, shape: tuple[int, ...]) -> tuple[int, ...]:
  """Shape of the scales of an array of ``shape``: one per block, last axis."""
  if not shape:
    return ()
  n = shape[-1]
  return tuple(shape[:-1]) + (
    math.ceil(n / min(fmt.block_size, n)) if n else 0,
  )


def bytes_per_entry(fmt: FormatLike, shape: tuple[int, ...]) -> float:
  """Stored bytes per entry of an array of ``shape`` (codes + scales)."""
  fmt = state_format(fmt)
  size = math.prod(shape)
  if not fmt.blocked:
    return float(fmt.dtype.itemsize)
  itemsize = 4 if fmt.exact(tuple(shape)) else fmt.dtype.itemsize
  return (
    size * itemsize + 4 * math.prod(scale_shape(fmt, tuple(shape)))
  ) / max(size, 1)


def init(fmt: FormatLike, like: Any, *, name: str = "an array") -> Any:
  """The stored form of zeros shaped like ``like`` (array or ShapeDtypeStruct).

  Raises:
    ValueError: if ``like`` is sharded along its last axis in shards that
      the blocks do not tile (see :func:`tree_init`); ``name`` names it.
  """
  fmt = state_format(fmt)
  _check_blocks_in_shards(fmt, like, name)
  shape = tuple(like.shape)
  if not fmt.blocked:
    return jnp.zeros(shape, fmt.dtype)
  dtype = jnp.float32 if fmt.exact(shape) else fmt.dtype
  return Quantized(
    jnp.zeros(shape, dtype), jnp.zeros(scale_shape(fmt, shape), jnp.float32)
  )


def _sharding_of(x: Any) -> Any:
  """The sharding of ``x`` where known: an array's, a ShapeDtypeStruct's,
  or a traced value's type (Explicit mesh axes only), else None.
  """
  if isinstance(x, jax.core.Tracer):
    return jax.typeof(x).sharding
  return getattr(x, "sharding", None)


def _check_blocks_in_shards(fmt: StateFormat, x: Any, name: str) -> None:
  """Raises unless every block of ``x`` lies within one shard.

  Blocks of ``B = min(block_size, n)`` entries tile the last axis (``n``
  entries) from 0; shards of ``w < n`` entries along that axis hold whole
  blocks iff ``B`` divides ``w`` (the last block may be shorter). Otherwise encoding would reshape across
  shards: a ``ShardingTypeError`` on an Explicit mesh, a silent all-gather
  on an Auto one. Checked where the sharding is known: arrays (both mesh
  kinds) and, under ``jit``, Explicit mesh axes.

  Raises:
    ValueError: naming ``name``, the sharding and the block size.
  """
  shape = tuple(x.shape)
  blocked = fmt.blocked and not fmt.exact(shape)
  sharding = _sharding_of(x) if blocked and shape and shape[-1] else None
  if sharding is None:
    return
  try:
    width = sharding.shard_shape(shape)[-1]
  except (ValueError, TypeError, AttributeError):  # unknown layouts: no check
    return
  b = min(fmt.block_size, shape[-1])
  if width < shape[-1] and width % b:
    raise ValueError(
      f"{fmt.name!r} state of {name} (shape {shape}) cannot be blocked "
      f"within its shards: sharded as {sharding}, {width} entries per "
      f"shard along the last axis, which blocks of {b} entries (block_size="
      f"{fmt.block_size}) do not tile; every block must lie within one shard "
      f"(no collective). Use a block_size that divides {width}, e.g. "
      f"quantization.state_format({fmt.name!r}, block_size={math.gcd(width, b)}), "
      "or do not shard this leaf's last axis."
    )


def _blocks(fmt: StateFormat, x: jax.Array) -> jax.Array:
  """``x`` as ``(..., num_blocks, B)``, zero-padded (for the reductions)."""
  x = x.reshape(x.shape or (1,))
  n = x.shape[-1]
  b = max(min(fmt.block_size, n), 1)
  pad = math.ceil(n / b) * b - n
  if pad:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
  return x.reshape(x.shape[:-1] + (-1, b))


def _power(q: jax.Array, power: int) -> jax.Array:
  """``q^p`` in float32 (``p`` a static int: multiplies)."""
  return jax.lax.integer_pow(q, power)


def _root(u: jax.Array, power: int) -> jax.Array:
  """``u^(1/p)``: square roots for p = 2, 4, 8 (cheaper than ``pow``)."""
  while power % 2 == 0:
    u, power = jnp.sqrt(u), power // 2
  return u if power == 1 else jnp.power(u, np.float32(1 / power))


def _per_entry(
  fmt: StateFormat, block_values: jax.Array, shape: tuple[int, ...]
) -> jax.Array:
  """``block_values`` (one per block, shaped like the scales) repeated over
  each block's entries of an array of ``shape``.

  The encode and the decode multiply the data by these in the data's own
  shape, not in blocks: a kernel that reads an array and writes its new
  codes with no reshape between them can write them in place of the old
  codes (XLA shares a buffer between a kernel's operand and its output only
  when the kernel reads it elementwise in the output's shape).
  """
  if not shape:
    return block_values.reshape(())
  n = shape[-1]
  b = max(min(fmt.block_size, n), 1)
  v = block_values.reshape(tuple(shape[:-1]) + (-1, 1))
  v = jnp.broadcast_to(v, v.shape[:-1] + (b,)).reshape(
    tuple(shape[:-1]) + (-1,)
  )
  return v[..., :n] if v.shape[-1] != n else v


def _encode_blocked(
  fmt: StateFormat,
  x: jax.Array,
  bits: jax.Array | None = None,
  scale: jax.Array | None = None,
) -> Quantized:
  """The stored array (see :func:`encode`)."""
  # In level units: y = Q^p |x| / s lies in [0, Q^p] and code k stands for
  # k^p, so the two codes around y are lo = floor(y^(1/p)) and lo + 1, and
  # the nearest in value is lo + 1 iff y > (lo^p + (lo + 1)^p) / 2. About a
  # dozen operations per entry: the encode is the 8-bit step's main cost.
  shape = tuple(x.shape)
  x = x.astype(jnp.float32)
  if scale is None:
    xb = _blocks(fmt, x)
    absmax = jnp.max(jnp.abs(xb), axis=-1).reshape(scale_shape(fmt, shape))
  else:
    absmax = jnp.asarray(scale, jnp.float32).reshape(scale_shape(fmt, shape))
  q_max = np.float32(fmt.levels)
  top = np.float32(float(fmt.levels) ** fmt.power)
  k = _per_entry(fmt, jnp.where(absmax > 0, top / absmax, 0.0), shape)
  # "uint8" stores negative entries as 0.
  mag = jnp.maximum(x, 0.0) if fmt.dtype == jnp.uint8 else jnp.abs(x)
  y = jnp.minimum(mag * k, top)
  lo = jnp.minimum(jnp.floor(_root(y, fmt.power)), q_max)
  below = _power(lo, fmt.power)
  gap = _power(lo + 1, fmt.power) - below
  if bits is None:
    up = y - below > 0.5 * gap  # nearest in value
  else:
    # Up with probability (y - below) / gap: unbiased in value.
    uniform = (bits >> np.uint32(8)).astype(jnp.float32) * np.float32(2**-24)
    up = uniform * gap < y - below
  q = jnp.where(up, lo + 1, lo)
  if fmt.dtype == jnp.int8:
    q = jnp.where(x < 0, -q, q)
  return Quantized(_kept(q.astype(fmt.dtype)), absmax)


def _kept(codes: jax.Array) -> jax.Array:
  """``codes`` themselves, computed in a kernel of their own that their
  readers read.

  XLA:CPU recomputes a cheap elementwise value in each of its readers. New
  codes are computed from the old ones (the moment's decay) and overwrite
  them in place, so a reader recomputing them (the update, the mask, the
  next threshold's sample) keeps the old codes alive: XLA then copies them
  first (26 copies of 0.75-4 MB per step with 8-bit moments on the
  21M-parameter tree of ``benchmarks.step_time``) and keeps float32
  temporaries. An integer division is not cheap to XLA, so it is computed
  once; here the divisor is the code's top bit (a logical shift) or 1,
  which is 1 for every code, which LLVM sees: no division is left in the
  program.
  """
  shift = jnp.array(jnp.iinfo(codes.dtype).bits - 1, codes.dtype)
  one = jax.lax.shift_right_logical(codes, shift) | jnp.array(1, codes.dtype)
  return jax.lax.div(codes, one)


def block_absmax(
  fmt: FormatLike, x: jax.Array, *, name: str = "an array"
) -> jax.Array:
  """The largest ``|x|`` of each block, shaped like the scales (``name``
  names ``x`` in the error of a leaf whose shards the blocks do not tile).

  Computed as ``max(max(x), -min(x))``: two reductions of ``x`` itself,
  which XLA:CPU runs on its input as it lies in memory, where a reduction of
  ``|x|`` first writes ``|x|`` to a temporary of ``x``'s size.
  """
  fmt = state_format(fmt)
  _check_blocks_in_shards(fmt, x, name)
  xb = _blocks(fmt, x)  # zero padding: below every block's maximum
  hi = jnp.max(xb, axis=-1).astype(jnp.float32)
  lo = jnp.min(xb, axis=-1).astype(jnp.float32)
  return jnp.maximum(hi, -lo).reshape(scale_shape(fmt, tuple(x.shape)))


def _decode_blocked(
  fmt: StateFormat, stored: Quantized, floor: bool, in_blocks: bool = False
) -> jax.Array:
  codes = stored.codes
  shape = tuple(codes.shape)
  # s (|q| / Q)^p as |q|^p (s / Q^p): one multiply by a per-block constant.
  unit = stored.scale / np.float32(float(fmt.levels) ** fmt.power)
  q = (_blocks(fmt, codes) if in_blocks else codes).astype(jnp.float32)
  mag = _power(jnp.abs(q), fmt.power)
  if floor:  # code 0 holds [0, s (1/Q)^p / 2]: its upper end
    mag = jnp.maximum(mag, 0.5)
  value = jnp.where(q < 0, -mag, mag) if fmt.dtype == jnp.int8 else mag
  if not in_blocks:
    return value * _per_entry(fmt, unit, shape)
  value = value * unit.reshape(q.shape[:-1])[..., None]
  value = value.reshape(value.shape[:-2] + (-1,))
  return value[..., : shape[-1]].reshape(shape) if shape else value.reshape(())


def stored_absmax(fmt: FormatLike, stored: Quantized) -> jax.Array:
  """The largest ``|decode(fmt, stored)|`` of each block, from a reduction
  of the codes (equal to it: decoding is monotone in ``|q|``), shaped like
  the scales.
  """
  fmt = state_format(fmt)
  if jnp.issubdtype(stored.codes.dtype, jnp.floating):  # stored exactly
    return block_absmax(fmt, stored.codes)
  qb = _blocks(fmt, stored.codes)
  return _largest_value(fmt, qb, stored.scale)


def _largest_value(fmt: StateFormat, qb: jax.Array, scale: jax.Array):
  """Each block's largest decoded ``|value|`` from its codes ``qb`` (blocked,
  ``(..., num_blocks, B)``) and the scales: ``(max |q|)^p s / Q^p``
  (decoding is monotone in ``|q|``).
  """
  hi = jnp.max(qb, axis=-1).astype(jnp.int32)
  if fmt.dtype == jnp.int8:
    hi = jnp.maximum(hi, -jnp.min(qb, axis=-1).astype(jnp.int32))
  unit = scale / np.float32(float(fmt.levels) ** fmt.power)
  mag = _power(hi.astype(jnp.float32), fmt.power)
  return mag.reshape(unit.shape) * unit


def _round_bf16_stochastic(x: jax.Array, bits: jax.Array) -> jax.Array:
  """bf16 rounding up or down with probabilities that make it unbiased.

  Adds a uniform 16-bit integer (the high half of ``bits``) to the low half
  of the float32 bits and truncates: ``x`` between two bf16 neighbours
  ``a < x < b`` becomes ``b`` with probability ``(x - a) / (b - a)``.
  Infinities stay infinite (their low half is 0, so the noise never
  reaches the exponent); NaN stays NaN.
  """
  x = x.astype(jnp.float32)
  word = jax.lax.bitcast_convert_type(x, jnp.uint32)
  rounded = (word + (bits >> np.uint32(16))) & np.uint32(0xFFFF0000)
  nan = (word & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
  rounded = jax.lax.select(nan, jnp.full_like(word, 0x7FC00000), rounded)
  # The rounded float32 is a bf16 value, so the final cast is exact. It is
  # the one step that makes the 2-byte array: XLA:CPU counts a float32 ->
  # bf16 conversion as expensive and does not recompute it in each reader,
  # so the readers read the stored bf16 (and widen it, which is free);
  # written as a bit cast of the upper half instead, the whole rounding is
  # recomputed in every reader, and a select between bf16 values has XLA
  # keep a float32 copy of the array in memory for them.
  return jax.lax.bitcast_convert_type(rounded, jnp.float32).astype(jnp.bfloat16)


def encode(
  fmt: FormatLike,
  x: jax.Array,
  *,
  key: jax.Array | None = None,
  bits: jax.Array | None = None,
  scale: jax.Array | None = None,
) -> Any:
  r"""Stores ``x`` in format ``fmt``.

  Float formats cast (``"bfloat16_sr"`` rounds stochastically). 8-bit
  formats: per block of ``B`` entries along the last axis, :math:`s =
  \max_i |x_i|` and :math:`q_i = \mathrm{sign}(x_i) \arg\min_{k \in 0..Q}
  |s (k/Q)^p - |x_i||` (``"uint8"`` stores negative entries as 0);
  ``"int8_sr"`` rounds :math:`|x_i|` to one of its two neighbouring levels
  at random, the upper with probability (distance to the lower) / (gap), so
  that the decoded value is unbiased: :math:`E[\hat x_i] = x_i`.

  Args:
    fmt: a format name or :class:`StateFormat`.
    x: the array (any float dtype, any shape).
    key: a PRNG key: the random bits of a stochastic format (one uint32
      drawn from it, hashed with each entry's index:
      :func:`grpo_optax._common.hash_bits`; an array of random bits of
      ``x``'s shape is what XLA:CPU keeps in memory, 4 bytes per entry).
    bits: or the random bits themselves, a uint32 array shaped like ``x``
      (e.g. :func:`grpo_optax._common.hash_bits`); ignored by
      deterministic formats.
    scale: 8-bit formats: the blocks' scales :math:`s` to store (shaped
      like :func:`scale_shape`) instead of their maxima, each at least its
      block's :math:`\max_i |x_i|` (an entry above its scale is stored as
      :math:`\pm s`). Lets a caller that knows a bound on the new array's
      blocks (an optimizer's moments: see
      ``grpo_optax.momentum.moment_scale``) encode in one elementwise
      pass, without first reducing the new array. Ignored by float formats.

  Returns:
    An array of ``fmt.dtype`` (float formats) or a :class:`Quantized`.

  Raises:
    ValueError: if ``fmt`` is stochastic and neither ``key`` nor ``bits``
      is given.
  """
  fmt = state_format(fmt)
  if fmt.stochastic and bits is None:
    if key is None:
      raise ValueError(
        f"format {fmt.name!r} rounds stochastically: `key` "
        "must be a PRNG key, got None."
      )
    bits = _common.hash_bits(
      tuple(x.shape), jax.random.bits(key, (), jnp.uint32)
    )
  if fmt.blocked and fmt.exact(tuple(x.shape)):
    unused = jnp.zeros(scale_shape(fmt, tuple(x.shape)), jnp.float32)
    return Quantized(x.astype(jnp.float32), unused)
  if fmt.blocked:
    _check_blocks_in_shards(fmt, x, "an array")
    return _encode_blocked(fmt, x, bits if fmt.stochastic else None, scale)
  if bits is not None and fmt.stochastic:
    return _round_bf16_stochastic(x, bits)
  return x.astype(fmt.dtype)


def encode_with_absmax(
  fmt: FormatLike,
  x: jax.Array,
  *,
  bits: jax.Array | None = None,
  scale: jax.Array | None = None,
) -> tuple[Quantized, jax.Array]:
  """``encode(fmt, x, bits=bits, scale=scale)`` and :func:`stored_absmax`
  of the result (8-bit formats only): what an accumulator whose readers read
  the stored value needs. The maxima are reduced from the codes that the
  encode's kernel writes (:func:`encode` computes them once for all their
  readers), so they add no parameter-sized temporary.

  Raises:
    ValueError: if ``fmt`` is not block-wise 8-bit, or is stochastic and
      ``bits`` is None.
  """
  fmt = state_format(fmt)
  if not fmt.blocked:
    raise ValueError(
      f"encode_with_absmax: fmt must be a block-wise 8-bit format "
      f"({', '.join(n for n in FORMAT_NAMES if state_format(n).blocked)}), "
      f"got {fmt.name!r}."
    )
  if fmt.stochastic and bits is None:
    raise ValueError(
      f"format {fmt.name!r} rounds stochastically: `bits` must be a uint32 "
      "array shaped like `x`, got None."
    )
  stored = encode(fmt, x, bits=bits, scale=scale)
  return stored, stored_absmax(fmt, stored)


def decode(
  fmt: FormatLike, stored: Any, *, floor: bool = False, in_blocks: bool = False
) -> jax.Array:
  r"""The float32 array of the parameter's shape that ``stored`` represents.

  Args:
    fmt: a format name or :class:`StateFormat`.
    stored: what :func:`encode` returned.
    floor: for a non-negative array that is a denominator (Adam's
      second moment ``nu``). An 8-bit code 0 in a block with maximum
      :math:`s` stands for any value in :math:`[0, s (1/Q)^p / 2]` (the
      values nearer to 0 than to the smallest non-zero level); with
      ``floor`` it decodes to the upper end of that interval,
      :math:`s (1/Q)^p / 2`, instead of 0, so that no entry decodes below
      half the value it stored (code 1 holds up to :math:`2.5 s / Q^2` for
      ``p = 2``), and none to 0 unless its block is all 0. Float formats
      are unaffected. Why: ``nu`` spans the square of the gradient's
      range, so an entry of ``nu`` rounds to 0 (below
      :math:`7.7 \cdot 10^{-6} s` for ``"uint8"``, ``p = 2``) long before
      the matching entry of ``mu`` does (below :math:`3.1 \cdot 10^{-5}`
      of its block's maximum, ``"int8"``), and Adam's
      :math:`\hat m / (\sqrt{\hat v} + \epsilon)` is then
      :math:`\hat m / \epsilon`: measured up to :math:`10^5` times the
      float32 update on one block of 256 entries.
    in_blocks: 8-bit formats: compute in blocks, ``(..., num_blocks, B)``,
      not in the array's shape; the values are the same. In the array's
      shape (the default), a kernel that decodes old codes and writes new
      ones (a state's update) can write them in place of the old codes; in
      blocks, XLA:CPU fuses the decode into a strided sample of the result
      (the top-k threshold's), which it does not for the other, and writes
      the decoded array out in float32 instead.

  Returns:
    The float32 array.
  """
  fmt = state_format(fmt)
  if fmt.blocked and jnp.issubdtype(stored.codes.dtype, jnp.floating):
    return stored.codes.astype(jnp.float32)  # stored exactly (min_size)
  if fmt.blocked:
    _check_blocks_in_shards(fmt, stored.codes, "an array")
    return _decode_blocked(fmt, stored, floor, in_blocks)
  return stored.astype(jnp.float32)


# ----------------------------------------------------------------------------
# Whole trees (what a transform's state holds).


def _check_tree(fmt: StateFormat, tree: Any) -> None:
  """:func:`_check_blocks_in_shards` on every leaf, named by its path."""
  jax.tree_util.tree_map_with_path(
    lambda path, x: _check_blocks_in_shards(fmt, x, _common.leaf_name(path)),
    tree,
  )


def tree_init(fmt: FormatLike, params: Any) -> Any:
  """Zeros for every leaf of ``params``; ``Quantized(codes, scale)`` trees
  for the 8-bit formats (built by tree maps over ``params``, so
  ``optax.tree.map_params`` finds both trees).

  Raises:
    ValueError: for an 8-bit format, if a leaf is sharded along its last
      axis in shards whose width the block size does not divide (e.g. a
      ``(64, 768)`` leaf over 8 devices, 96 entries per shard, in blocks of
      256): the error names the leaf, its sharding and the block size.
      Checked on arrays and ShapeDtypeStructs (Auto and Explicit meshes)
      and on traced leaves of Explicit meshes; a traced leaf of an Auto
      mesh carries no sharding to check.
  """
  fmt = state_format(fmt)
  if not fmt.blocked:
    return jax.tree.map(lambda p: init(fmt, p), params)
  _check_tree(fmt, params)
  return Quantized(
    jax.tree.map(lambda p: init(fmt, p).codes, params),
    jax.tree.map(lambda p: init(fmt, p).scale, params),
  )


def tree_decode(fmt: FormatLike, stored: Any, *, floor: bool = False) -> Any:
  """Float32 tree (the parameters' structure) of a :func:`tree_init` form
  (``floor``: see :func:`decode`).
  """
  fmt = state_format(fmt)
  if not fmt.blocked:
    return jax.tree.map(lambda s: decode(fmt, s), stored)
  _check_tree(fmt, stored.codes)
  return jax.tree.map(
    lambda c, s: decode(fmt, Quantized(c, s), floor=floor),
    stored.codes,
    stored.scale,
  )


def tree_encode(
  fmt: FormatLike,
  tree: Any,
  *,
  key: jax.Array | None = None,
  scale: Any = None,
) -> Any:
  """Stores every leaf of ``tree`` (leaf ``i`` rounds with
  ``fold_in(key, i)`` in stochastic formats); ``scale``: a tree of the
  leaves' scales (see :func:`encode`), or None for the blocks' maxima.
  """
  fmt = state_format(fmt)
  leaves, treedef = jax.tree.flatten(tree)
  keys = (
    [None] * len(leaves)
    if not fmt.stochastic or key is None
    else [jax.random.fold_in(key, i) for i in range(len(leaves))]
  )
  if fmt.stochastic and key is None:
    raise ValueError(
      f"format {fmt.name!r} rounds stochastically: `key` "
      "must be a PRNG key, got None."
    )
  if fmt.blocked:
    _check_tree(fmt, tree)
  scales = (
    [None] * len(leaves) if scale is None else treedef.flatten_up_to(scale)
  )
  stored = [
    encode(fmt, x, key=k, scale=sc) for x, k, sc in zip(leaves, keys, scales)
  ]
  if not fmt.blocked:
    return treedef.unflatten(stored)
  return Quantized(
    treedef.unflatten([s.codes for s in stored]),
    treedef.unflatten([s.scale for s in stored]),
  )


def tree_bytes(stored: Any) -> int:
  """Bytes of all arrays of a stored tree (codes and scales)."""
  return sum(
    int(x.size) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(stored)
  )
