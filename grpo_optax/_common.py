"""Small helpers shared by the GRPO transforms (validation, reductions, casts).

Nothing here is public API. Validation helpers accept Python numbers, NumPy
scalars and concrete JAX arrays; traced values (as passed by
``optax.inject_hyperparams`` inside ``jit``) have their type checked but not
their value, because it is unknown at trace time and branching on it would
break tracing. Anything else (a string, ``None``, a bool where a number is
expected) is refused at construction with a ``TypeError`` naming the
argument, the expected type and the value, rather than failing later inside
``update`` (``docs/design.md``, "Numerics and input checks").
"""

from __future__ import annotations

import functools
import math
from typing import Any
from typing import cast

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
import optax

NUMBER = "a number (a Python int or float, a NumPy scalar or a scalar array)"


def _describe(value: Any) -> str:
  """``repr(value)`` with its type, for error messages."""
  text = repr(value)
  if len(text) > 80:
    text = text[:77] + "..."
  return f"{text} ({type(value).__name__})"


def check_number(name: str, value: Any, *, kind: str = NUMBER) -> None:
  """Raises ``TypeError`` naming ``name`` unless ``value`` is a real number.

  Accepted: Python ints and floats, NumPy scalars and 0-d arrays, and scalar
  JAX arrays, concrete or traced (``optax.inject_hyperparams`` passes those),
  of an integer or floating dtype. Refused: strings, ``None``, bools (a
  keyword that switches something is a bool, never a number), complex
  numbers, sequences and arrays of more than one entry. ``kind`` is the
  expected type as the message words it.
  """
  dtype = getattr(value, "dtype", None)
  if isinstance(value, (bool, np.bool_)) or (
    dtype is not None and jnp.dtype(dtype) == jnp.bool_
  ):
    ok = False
  elif isinstance(value, (int, float, np.integer, np.floating)):
    ok = True
  elif isinstance(value, (jax.Array, np.ndarray, jax.core.Tracer)):
    dtype = jnp.dtype(value.dtype)
    ok = jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(
      dtype, jnp.floating
    )
    if ok and jnp.shape(value) != ():
      raise TypeError(
        f"{name} must be a scalar, got an array of shape "
        f"{jnp.shape(value)}: {_describe(value)}"
      )
  else:
    ok = False
  if not ok:
    raise TypeError(f"{name} must be {kind}; got {_describe(value)}")


def check_bool(name: str, value: Any, *, allow_none: bool = False) -> None:
  """Raises ``TypeError`` naming ``name`` unless ``value`` is a Python bool.

  Switches decide the structure of the transform at construction, so they
  are Python bools (``optax.inject_hyperparams`` leaves bools static); a
  string such as ``"no"`` would be truthy.
  """
  if isinstance(value, bool) or (allow_none and value is None):
    return
  kind = "None or a bool" if allow_none else "a bool"
  raise TypeError(
    f"{name} must be {kind} (True or False); got {_describe(value)}"
  )


def check_dtype(name: str, value: Any, *, allow_none: bool = True) -> Any:
  """The floating-point (or complex) dtype named by ``value``, or None.

  Raises ``TypeError`` naming ``name`` for anything NumPy does not know as a
  dtype (e.g. ``"float8"``: the 8-bit floats are ``"float8_e4m3fn"``, ...)
  and ``ValueError`` for a dtype that cannot hold a moment (ints, bools).
  """
  if value is None and allow_none:
    return None
  try:
    dtype = jnp.dtype(value)
  except (TypeError, ValueError):
    raise TypeError(
      f"{name} must be {'None or ' if allow_none else ''}a floating-point "
      f"dtype (e.g. jnp.float32 or 'bfloat16'); got {_describe(value)}"
    ) from None
  if not jnp.issubdtype(dtype, jnp.inexact):
    raise ValueError(
      f"{name} must be a floating-point dtype (e.g. jnp.float32 or "
      f"'bfloat16'); got {_describe(value)}, an {dtype.name} dtype"
    )
  return dtype


def check_int(name: str, value: Any, low: int) -> int | None:
  """``value`` as a Python int (validated), or None if it is traced.

  A number with an integral value (``100``, ``100.0``, an int32 array as
  ``optax.inject_hyperparams`` passes it) is accepted; anything else raises
  an error naming ``name``, the expected type and the value.
  """
  check_number(name, value, kind=f"an int >= {low}")
  v = concrete_value(value, name)
  if v is None:
    return None
  if v != int(v) or v < low:
    raise ValueError(f"{name} must be an int >= {low}; got {value!r}")
  return int(v)


def concrete_value(value: Any, name: str = "value") -> float | None:
  """Returns ``value`` as a Python float, or ``None`` if it is traced.

  ``value`` must pass :func:`check_number` (``name`` names it in the error).
  """
  check_number(name, value)
  if isinstance(value, jax.core.Tracer):
    return None
  try:
    arr = np.asarray(value)
  except (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
  ):
    return None
  return float(arr)


def f32(value: Any) -> Any:
  """Python numbers become ``np.float32`` scalars; arrays and tracers pass.

  Doing the hyper-parameter arithmetic (``1 - b1``, ...) in float32 whether
  the value is a Python float or an array injected by
  ``optax.inject_hyperparams`` makes both give bit-identical results.
  """
  if isinstance(
    value, (int, float, np.floating, np.integer)
  ) and not isinstance(value, bool):
    return np.float32(value)
  return value


def check_range(
  name: str,
  value: Any,
  low: float | None = None,
  high: float | None = None,
  *,
  low_inclusive: bool = True,
  high_inclusive: bool = True,
) -> None:
  """Raises ``ValueError`` naming ``name`` if ``value`` lies outside the range.

  The range is written in the message in interval notation, e.g. ``[0, 1)``.
  Raises ``TypeError`` (:func:`check_number`) for anything but a real
  number. Traced values have their type checked, not their value.
  """
  v = concrete_value(value, name)
  if v is None:
    return
  ok = not math.isnan(v)
  if ok and low is not None:
    ok = v >= low if low_inclusive else v > low
  if ok and high is not None:
    ok = v <= high if high_inclusive else v < high
  if not ok:
    lo = (
      "(-inf" if low is None else ("[" if low_inclusive else "(") + f"{low:g}"
    )
    hi = (
      "inf)" if high is None else f"{high:g}" + ("]" if high_inclusive else ")")
    )
    hint = ""
    dtype = getattr(value, "dtype", None)
    if (
      dtype is not None
      and jnp.issubdtype(dtype, jnp.floating)
      and (jnp.finfo(dtype).bits < 32)
    ):
      hint = (
        f" ({name} arrived as a {jnp.dtype(dtype).name} array, which "
        "rounds it: optax.inject_hyperparams casts hyper-parameters to "
        "the params' dtype; pass hyperparam_dtype=jnp.float32)"
      )
    raise ValueError(f"{name} must be in {lo}, {hi}; got {value!r}{hint}")


def check_choice(name: str, value: Any, choices: tuple[Any, ...]) -> None:
  """Raises ``ValueError`` naming ``name`` unless ``value`` is in ``choices``.

  Compared by type and value, so an array or a number never matches a
  string choice (and never compares element-wise).
  """
  if not any(
    value is c or (isinstance(value, type(c)) and value == c) for c in choices
  ):
    raise ValueError(
      f"{name} must be one of {', '.join(map(repr, choices))}; got "
      f"{_describe(value)}"
    )


def require_params(params: Any, who: str, why: str) -> None:
  if params is None:
    raise ValueError(
      f"{who} needs `params` {why}: call `update(updates, state, params)`"
      " (or `optimizer.update(model, grads)` with Flax NNX)."
    )


def _path_list(paths: list[str], limit: int = 3) -> str:
  shown = ", ".join(paths[:limit])
  more = len(paths) - limit
  return shown + (f" (and {more} more)" if more > 0 else "")


def _short(s: Any) -> str:
  return str(s) if len(str(s)) <= 160 else str(s)[:150] + " ..."


def _paths(tree: Any) -> list[str]:
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return [jax.tree_util.keystr(k) or "(the root)" for k, _ in flat]


def leaf_name(path: Any) -> str:
  """``"leaf ['w']"``: a leaf named by its tree path, in error messages."""
  return f"leaf {jax.tree_util.keystr(path) or '<root>'}"


def check_tree_like(
  who: str, tree: Any, like: Any, *, name: str = "updates", ref: str = "state"
) -> None:
  """Raises ``ValueError`` naming the first leaf where ``tree`` differs from
  ``like``: a leaf path only one of them has, or a shape.

  ``ref="state"``: ``like`` is a tree of the state, built from the params
  by ``init``; otherwise ``ref`` names the argument ``like`` is (e.g.
  ``"params"``). Only Python runs here, at trace time: nothing is added to
  the compiled program. A message reads e.g. "grpo: `updates` leaf
  ['layer']['w'] has shape (3, 4) but the state was built for (4, 4)".
  """
  leaves, s1 = jax.tree.flatten(tree)
  ref_leaves, s2 = jax.tree.flatten(like)
  state = ref == "state"
  if s1 == s2:
    for i, (x, r) in enumerate(zip(leaves, ref_leaves)):
      if np.shape(x) != np.shape(r):
        where = "the state was built for" if state else f"`{ref}` has"
        raise ValueError(
          f"{who}: `{name}` leaf {_paths(tree)[i]} has shape {np.shape(x)} "
          f"but {where} {np.shape(r)}"
        )
    return
  p1, p2 = _paths(tree), _paths(like)
  extra = [p for p in p1 if p not in set(p2)]
  missing = [p for p in p2 if p not in set(p1)]
  of = "the params the state was built for" if state else f"`{ref}`"
  if extra:
    detail = f"has leaves that {of} lack: {_path_list(extra)}"
  elif missing:
    detail = f"lacks leaves of {of}: {_path_list(missing)}"
  else:
    detail = (
      f"has the leaves of {of} in another structure: {_short(s1)} vs "
      f"{_short(s2)}"
    )
  raise ValueError(
    f"{who}: `{name}` {detail} ({_leaves(s1.num_leaves)} vs "
    f"{_leaves(s2.num_leaves)})"
  )


def _leaves(n: int) -> str:
  return f"{n} leaf" if n == 1 else f"{n} leaves"


def check_same_structure(name: str, tree: Any, like: Any, who: str) -> None:
  """Raises ``ValueError`` unless ``tree`` has the structure and the leaf
  shapes of ``like`` (the updates), naming the first leaf that differs.
  """
  if jax.tree.structure(tree) != jax.tree.structure(like):
    extra = [
      x
      for x in jax.tree.leaves(tree)
      if not isinstance(
        x, (jax.Array, np.ndarray, np.generic, int, float, complex)
      )
    ]
    if extra:
      raise ValueError(
        f"{who}: `{name}` must have the same tree structure as the updates."
        " It has non-array leaves (e.g. "
        f"{type(extra[0]).__name__}): with Equinox pass "
        "`eqx.filter(model, eqx.is_array)` as params, the same filter as "
        "the gradients."
      )
  check_tree_like(who, like, tree, name="updates", ref=name)


def is_static_zero(value: Any) -> bool:
  """True if ``value`` is a concrete number equal to 0."""
  v = concrete_value(value)
  return v is not None and v == 0.0


def mean32(x: jax.Array) -> jax.Array:
  """Mean of all elements, accumulated in float32 (at least); 0 for empty."""
  if x.size == 0:
    return jnp.zeros((), jnp.float32)
  return jnp.mean(x, dtype=jnp.promote_types(x.dtype, jnp.float32))


def sum32(x: jax.Array) -> jax.Array:
  return jnp.sum(x, dtype=jnp.promote_types(x.dtype, jnp.float32))


def safe_increment(count: jax.Array) -> jax.Array:
  """``optax.safe_increment(count)``, typed as the array it returns.

  optax annotates its result ``ArrayLike``; for an array ``count`` it is the
  ``jax.Array`` of a ``jnp.where``.
  """
  return cast(jax.Array, optax.safe_increment(count))


def bias_correction(decay: Any, count: jax.Array) -> jax.Array:
  """``1 - decay**count`` in float32 (``count`` already incremented)."""
  return 1 - jnp.asarray(decay, jnp.float32) ** count.astype(jnp.float32)


def ema(old: Any, new: Any, decay: Any) -> Any:
  """Exponential moving average ``decay * old + (1 - decay) * new``."""
  return decay * old + (1 - decay) * new


def abs_sq(x: Any) -> Any:
  """``|x|^2``, real: ``x * x``, or ``re(x)^2 + im(x)^2`` for complex ``x``."""
  if jnp.iscomplexobj(x):
    return jnp.real(x) ** 2 + jnp.imag(x) ** 2
  return x * x


SAMPLE_PER_LEAF = 1024
# Every axis of a sample keeps a multiple of min(16, the axis's power-of-two
# factor) entries, so that a sample of an axis sharded over up to 16 devices
# (any power-of-two count dividing the axis) takes only local entries.
_SHARD_ALIGN = 16


def _divisors(n: int) -> list[int]:
  small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
  return sorted(set(small + [n // d for d in small]))


def sample_strides(shape: tuple[int, ...], max_n: int) -> tuple[int, ...]:
  """Per-axis strides of a grid sample of about ``max_n`` entries.

  The sample of a leaf is the grid ``x[o_0::s_0, o_1::s_1, ...]``: no
  flattening and no gather, so a sharded leaf is sampled shard by shard
  without any collective. Each stride ``s_d`` divides ``N_d / A_d`` where
  ``A_d = min(16, largest power of two dividing N_d)``: every shard of an
  axis split evenly over up to 16 devices then holds whole periods of the
  grid. Strides grow on the axis with the most sampled entries first, until
  the grid holds at most ``max_n`` entries (or no axis can grow: a leaf
  whose axes have no such divisors is sampled more densely).
  """
  strides = [1] * len(shape)
  options = []
  for n in shape:
    align = math.gcd(n, _SHARD_ALIGN) if n else 1
    options.append(_divisors(n // align) if n else [1])

  def size(st):
    return math.prod(-(-n // s) for n, s in zip(shape, st))

  while size(strides) > max_n:
    order = sorted(range(len(shape)), key=lambda d: -(shape[d] // strides[d]))
    for d in order:
      bigger = [s for s in options[d] if s > strides[d]]
      if bigger:
        strides[d] = bigger[0]
        break
    else:
      break
  return tuple(strides)


def grid_sample(
  x: jax.Array, strides: tuple[int, ...], offsets: Any = None
) -> jax.Array:
  """The grid ``x[o_0::s_0, o_1::s_1, ...]`` (``offsets`` may be traced).

  With static zero offsets this is a strided slice; with traced offsets each
  axis ``d`` is viewed as ``(N_d / s_d, s_d)`` and the offset is a dynamic
  index into the minor part, which a shard holds whole (see
  :func:`sample_strides`): both are local on every shard.
  """
  if offsets is None:
    # lax.slice, not x[::s]: NumPy indexing of a concrete sharded array
    # (outside jit) becomes a gather, which an Explicit mesh refuses.
    return jax.lax.slice(x, (0,) * x.ndim, x.shape, strides)
  return _offset_grid(x, tuple(strides), list(offsets))


@functools.partial(jax.jit, static_argnums=1)
def _offset_grid(x: jax.Array, strides: tuple[int, ...], offsets) -> jax.Array:
  """:func:`grid_sample` with traced offsets, jitted: leaves of one shape
  share one trace.
  """
  shape, starts, sizes = [], [], []
  for d, (n, s) in enumerate(zip(x.shape, strides)):
    shape += [n // s, s]
    starts += [jnp.zeros((), jnp.int32), offsets[d]]
    sizes += [n // s, 1]
  spec = explicit_spec(x)
  if spec is None:
    y = x.reshape(shape)
  else:  # an Explicit mesh: each axis's sharding goes to its major part
    y = jax.lax.reshape(
      x,
      shape,
      out_sharding=jax.sharding.NamedSharding(
        jax.typeof(x).sharding.mesh,
        jax.sharding.PartitionSpec(*[e for axis in spec for e in (axis, None)]),
      ),
    )
  # The offsets are non-negative: no wrapping of negative indices (four
  # traced operations per axis at trace time and in every sample kernel).
  y = jax.lax.dynamic_slice(y, starts, sizes, allow_negative_indices=False)
  return jax.lax.squeeze(y, tuple(range(1, 2 * x.ndim, 2)))


def varying_axes(x: Any) -> frozenset:
  """The ``shard_map`` axes ``x`` varies over (empty outside one).

  JAX up to 0.9 keeps them in the abstract value's ``vma``; later versions
  in ``manual_axis_type.varying``.
  """
  aval = jax.typeof(x)
  vma = getattr(aval, "vma", None)
  if vma is None:
    vma = getattr(getattr(aval, "manual_axis_type", None), "varying", ())
  return frozenset(vma or ())


def explicit_spec(x: Any) -> Any:
  """The PartitionSpec of ``x`` on an Explicit mesh axis, else None."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is None or all(s is None for s in spec):
    return None
  return tuple(spec) + (None,) * (jnp.ndim(x) - len(spec))


def leaf_scalars(params: Any, value: Any = 0.0, dtype: Any = jnp.float32):
  """One scalar per leaf of ``params``, as one ``(num_leaves,)`` vector.

  A vector, not a tree shaped like the params, so that sharding recipes
  (``optax.tree.map_params``) treat it as a non-param leaf and replicate it.
  """
  return jnp.full((len(jax.tree.leaves(params)),), value, dtype)


def add_pairwise(xs: tuple[Any, ...], ys: tuple[Any, ...]) -> tuple[Any, ...]:
  """The computation of a variadic sum by ``jax.lax.reduce``.

  One function, not a lambda per call: ``lax.reduce`` caches its jaxpr by
  the function, so equal reductions are one primitive (outside ``jit``,
  one compilation, not one per call).
  """
  return tuple(x + y for x, y in zip(xs, ys))


def _split_reduce(x: jax.Array) -> list[jax.Array]:
  """The ``m`` columns of ``x`` (shape ``(..., m)``) as ``m`` arrays, by one
  variadic sum over the last axis: output ``j`` sums column ``j`` and
  ``-0.0`` (or 0) elsewhere, which is column ``j`` exactly. Not jitted: as
  a jitted call, the 8-bit preset's temporaries grew from 2.60 to 3.04
  B/param (21M-parameter tree), for about 0.1 s less tracing at 384
  leaves.
  """
  m = x.shape[-1]
  zero = jnp.asarray(
    -0.0 if jnp.issubdtype(x.dtype, jnp.floating) else 0, x.dtype
  )
  col = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  ops = tuple(jnp.where(col == j, x, zero) for j in range(m))
  return list(
    jax.lax.reduce(
      ops,
      (zero,) * m,
      add_pairwise,
      (x.ndim - 1,),
    )
  )


def unstack(vector: jax.Array) -> list[jax.Array]:
  """The per-leaf scalars of a :func:`leaf_scalars` vector, as separate arrays.

  Written as variadic reductions (:func:`_split_reduce`), never as slices:
  XLA does not fuse a reduction into its consumers, so each leaf's kernels
  read a scalar buffer of their own. With ``vector[i]`` (or behind an
  optimization barrier, which XLA:CPU removes before fusion) the slice
  ``[i:i+1]`` is fused into every leaf's kernels, which then all differ,
  and XLA compiles each of them separately: compile time grew with the
  number of leaves (``docs/design.md``, "Compile time"). A vector of ``n``
  entries is padded and viewed as a ``(w, w)`` matrix, ``w = ceil(sqrt
  n)``, whose ``w`` columns are split by one reduction, then each column by
  one more: ``w + 1`` reductions of ``w`` outputs, whose kernels are
  identical within each level (measured: 1,536 scalars for about 2 s of
  compile time on 2 CPU cores, against 6 s for levels of 32).
  """
  n = vector.shape[0]
  if n == 0:
    return []
  if vector.dtype == jnp.bool_:
    return [x.astype(jnp.bool_) for x in unstack(vector.astype(jnp.int32))]
  if n == 1:
    return [vector.reshape(())]
  width = math.isqrt(n - 1) + 1
  if n <= width:
    return _split_reduce(vector)
  rows = -(-n // width)
  padded = jnp.pad(vector, (0, rows * width - n))
  columns = _split_reduce(padded.reshape(rows, width))
  # parts[j][r] = vector[r * width + j]
  parts = [_split_reduce(c) if rows > 1 else [c.reshape(())] for c in columns]
  return [parts[i % width][i // width] for i in range(n)]


def stack(
  values: list[Any], dtype: Any = jnp.float32, like: Any = None
) -> jax.Array:
  """Per-leaf scalars into one vector, behind an optimization barrier (XLA
  would otherwise fuse every leaf's reduction into one stacking kernel).

  ``like`` (the vector this one replaces) makes the result vary over the
  same ``shard_map`` axes as the state it replaces, even where some entries
  are constants (a ``lax.scan`` carry must keep its type).
  """
  if not values:
    return jnp.zeros((0,), dtype) if like is None else like
  values = [jnp.asarray(v, dtype) for v in values]
  out = jnp.stack(jax.lax.optimization_barrier(values))
  if like is not None:
    out = out + (0 * like).astype(dtype)
  return out


def mix32(x: Any) -> Any:
  """MurmurHash3's 32-bit finaliser: a bijection of uint32 that spreads every
  input bit over the output (NumPy or JAX values).
  """
  u32: Any = (
    np.uint32 if isinstance(x, (np.ndarray, np.generic)) else jnp.uint32
  )
  x = x ^ (x >> u32(16))
  x = x * u32(0x85EBCA6B)
  x = x ^ (x >> u32(13))
  x = x * u32(0xC2B2AE35)
  return x ^ (x >> u32(16))


def hash_bits(shape: tuple[int, ...], word: jax.Array) -> jax.Array:
  """A pseudo-random uint32 per entry of an array of ``shape``, from one
  uint32 ``word``: the Weyl sequence ``i K + mix32(word)`` over the entries'
  flat indices ``i`` (``K`` = 2^32 / golden ratio, odd).

  For a uniformly random word every entry's value is uniform on the uint32
  range, which is all that unbiased stochastic rounding needs (``E[round(x)]
  = x`` entry by entry); within one draw the entries are equidistributed
  (a low-discrepancy sequence) rather than independent. Measured on 16.7M
  entries (XLA:CPU, 2 cores): the bf16 rounding kernel of the
  error-feedback accumulator took 2.85 ms with this noise, 3.72 ms with
  :func:`mix32` of every entry's index, 2.50 ms with rounding to nearest.
  The word is mixed once (a scalar), so that consecutive words (a counter)
  give unrelated offsets. No PRNG key and no loop (``jax.random``'s
  threefry is a ``while`` loop, which makes XLA's simplification passes run
  over the whole update once more); an iota, so a sharded array gets its
  shard's entries.
  """
  index = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for d in reversed(range(len(shape))):
    iota = jax.lax.broadcasted_iota(jnp.uint32, shape, d)
    index = index + iota * jnp.uint32(stride & 0xFFFFFFFF)
    stride *= shape[d]
  return index * jnp.uint32(0x9E3779B1) + mix32(jnp.asarray(word, jnp.uint32))


def take(vector: jax.Array, indices: Any) -> jax.Array:
  """``vector[indices]`` for constant integer ``indices``, as the gather XLA
  would rewrite it into (a ``(k, 1)`` slice per index, then a reshape): a
  gather it rewrites makes its simplification passes run once more over
  the whole program.
  """
  idx = np.asarray(indices, np.int32).reshape(-1, 1)
  out = jax.lax.gather(
    vector,
    jnp.asarray(idx),
    jax.lax.GatherDimensionNumbers(
      offset_dims=(1,), collapsed_slice_dims=(), start_index_map=(0,)
    ),
    slice_sizes=(1,),
    mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS,
  )
  return out.reshape(idx.shape[0])


def total(values: list[Any]) -> jax.Array:
  """The float32 sum of per-leaf scalars, as one reduction of their
  :func:`stack`.

  A value that depends on every leaf must reach the per-leaf kernels as one
  materialised scalar. Written as a chain of scalar additions, or as a sum
  (or dot product) of the plain stack, XLA's simplifier rewrites it into a
  chain that it copies into every consumer: measured on 1,536 leaves, about
  8 s of compile time against 1 s behind the barrier of :func:`stack`.
  """
  if not values:
    return jnp.zeros((), jnp.float32)
  if len(values) > 8:
    # Through a sort, which XLA does not fuse: otherwise XLA:CPU fuses every
    # value's producer (a leaf's reduction, its sample's arithmetic) and the
    # sum into one kernel with an input per value, whose fusion time grows
    # faster than quadratically with the number of values.
    return jnp.sum(jnp.sort(stack(values)))
  return jnp.sum(stack(values))


def strided_sample(x: jax.Array, max_n: int = SAMPLE_PER_LEAF) -> jax.Array:
  """A fixed grid of at most about ``max_n`` entries of ``x`` (any shape).

  Diagnostics (means, standard deviations, kept fractions) are estimated on
  such samples, so that logging never adds a pass over a parameter-sized
  array to the update; the grid is taken shard by shard on sharded leaves.
  """
  x = jnp.asarray(x)
  if x.ndim == 0:
    return x.reshape(1)
  return grid_sample(x, sample_strides(x.shape, max_n))


def flat_sample(x: jax.Array) -> jax.Array:
  """A sample (:func:`strided_sample`) as a vector, to be concatenated with
  other leaves' samples.

  On an Explicit mesh the sample is replicated first: flattening an axis
  sharded behind another one, and concatenating differently sharded
  vectors, have no local result. This moves the sample (about
  ``SAMPLE_PER_LEAF`` entries), never the leaf; an Auto mesh gathers the
  same entries.
  """
  if explicit_spec(x) is not None:
    mesh = jax.typeof(x).sharding.mesh
    x = jax.sharding.reshard(
      x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    )
  return x.reshape(-1)


class SampledMoments:
  """Accumulates size-weighted means over per-leaf samples.

  ``add`` takes each leaf's sample arrays (e.g. :func:`strided_sample`);
  ``mean`` stacks the samples of equal shape, dtype and layout and reduces
  each stack at once, then sums the few per-group results (:func:`total`).
  One reduction per leaf, summed over the leaves, is what XLA:CPU fused
  into a single kernel of every leaf's sample computation and a chain of
  scalar additions (772 inputs on 384 leaves), whose fusion grew faster
  than quadratically with the leaves: 25 s of the fusion pass alone at 768
  leaves.
  """

  def __init__(self):
    self.total = 0
    self.parts: dict[str, list[tuple[jax.Array, int]]] = {}

  def add(self, n: int, **samples: jax.Array) -> None:
    if n == 0:
      return
    self.total += n
    for k, v in samples.items():
      self.parts.setdefault(k, []).append((jnp.asarray(v, jnp.float32), n))

  def mean(self, key: str, default: float = 0.0) -> jax.Array:
    return self.means(lambda d, _: {key: d[key]}, key, **{key: default})[key]

  def means(
    self, fn: Any, *keys: str, **defaults: float
  ) -> dict[str, jax.Array]:
    """Size-weighted means of samples derived from the stacked ones.

    ``fn`` maps a dict of the stacks of ``keys`` (each ``(k, ...)``: the
    samples of ``k`` leaves of one shape and layout) and the leaves' sizes
    (a ``(k,)`` NumPy array) to a dict of derived arrays with the same
    leading axis; each derived key's mean over the
    tree is returned (``defaults`` gives every derived key and its value
    when nothing was added). A derived sample computed on the stack is one
    kernel per group, where computing it leaf by leaf before :meth:`add`
    is one (or more) per leaf.
    """
    if not self.total or any(k not in self.parts for k in keys):
      return {k: jnp.asarray(v, jnp.float32) for k, v in defaults.items()}
    groups: dict[Any, list[int]] = {}
    multi = jax.device_count() > 1
    for j, (v, _) in enumerate(self.parts[keys[0]]):
      spec = explicit_spec(v)
      # As the bisected samples (sparsify._group_key): without a known
      # layout on several devices, stacking could give one leaf's sample
      # another's sharding.
      gkey = (j,) if spec is None and multi else (v.shape, spec)
      groups.setdefault(gkey, []).append(j)
    sums: dict[str, list[Any]] = {k: [] for k in defaults}
    singles: dict[str, list[Any]] = {k: [] for k in defaults}
    for idx in groups.values():
      weights = np.asarray([self.parts[keys[0]][j][1] for j in idx], np.float32)
      derived = fn(
        {k: jnp.stack([self.parts[k][j][0] for j in idx]) for k in keys},
        weights,
      )
      for k in defaults:
        d = derived[k]
        if len(idx) == 1:
          singles[k].append(jnp.mean(d[0]) * weights[0])
          continue
        means = jnp.mean(d, axis=tuple(range(1, d.ndim)))
        sums[k].append(jnp.sum(means * weights))
    # Leaves reduced one by one (several devices, layouts unknown) are
    # summed by total(), whose sort keeps each reduction its own kernel.
    return {k: total(sums[k] + singles[k]) / self.total for k in defaults}
