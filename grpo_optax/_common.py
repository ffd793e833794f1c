"""Small helpers shared by the GRPO transforms (validation, reductions, casts).

Nothing here is public API. Validation helpers accept Python numbers, NumPy
scalars and concrete JAX arrays; traced values (as passed by
``optax.inject_hyperparams`` inside ``jit``) are skipped, because their value is
unknown at trace time and branching on them would break tracing.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

def concrete_value(value: Any) -> float | None:
  """Returns ``value`` as a Python float, or ``None`` if it is traced."""
  if isinstance(value, jax.core.Tracer):
    return None
  try:
    arr = np.asarray(value)
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
    return None
  if arr.shape != ():
    raise TypeError(f"expected a scalar hyper-parameter, got shape {arr.shape}")
  return float(arr)


def f32(value: Any) -> Any:
  """Python numbers become ``np.float32`` scalars; arrays and tracers pass.

  Doing the hyper-parameter arithmetic (``1 - b1``, ...) in float32 whether
  the value is a Python float or an array injected by
  ``optax.inject_hyperparams`` makes both give bit-identical results.
  """
  if isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(
      value, bool):
    return np.float32(value)
  return value


def check_range(name: str, value: Any, low: float | None = None,
                high: float | None = None, *, low_inclusive: bool = True,
                high_inclusive: bool = True) -> None:
  """Raises ``ValueError`` naming ``name`` if ``value`` lies outside the range.

  The range is written in the message in interval notation, e.g. ``[0, 1)``.
  Traced values are not checked.
  """
  v = concrete_value(value)
  if v is None:
    return
  ok = not math.isnan(v)
  if ok and low is not None:
    ok = v >= low if low_inclusive else v > low
  if ok and high is not None:
    ok = v <= high if high_inclusive else v < high
  if not ok:
    lo = "(-inf" if low is None else ("[" if low_inclusive else "(") + f"{low:g}"
    hi = "inf)" if high is None else f"{high:g}" + ("]" if high_inclusive else ")")
    raise ValueError(f"{name} must be in {lo}, {hi}; got {value!r}")


def check_choice(name: str, value: Any, choices: tuple[Any, ...]) -> None:
  if value not in choices:
    raise ValueError(
        f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


def require_params(params: Any, who: str, why: str) -> None:
  if params is None:
    raise ValueError(
        f"{who} needs `params` {why}: call `update(updates, state, params)`"
        " (or `optimizer.update(model, grads)` with Flax NNX).")


def check_same_structure(name: str, tree: Any, like: Any, who: str) -> None:
  """Raises ``ValueError`` if ``tree`` does not have the structure of ``like``."""
  s1 = jax.tree.structure(tree)
  s2 = jax.tree.structure(like)
  if s1 != s2:
    raise ValueError(
        f"{who}: `{name}` must have the same tree structure as the updates;"
        f" got {s1} vs updates {s2}")


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


def bias_correction(decay: Any, count: jax.Array) -> jax.Array:
  """``1 - decay**count`` in float32 (``count`` already incremented)."""
  return 1 - jnp.asarray(decay, jnp.float32) ** count.astype(jnp.float32)


SAMPLE_PER_LEAF = 1024


def strided_sample(x: jax.Array, max_n: int = SAMPLE_PER_LEAF) -> jax.Array:
  """At most ``max_n`` evenly strided entries of ``x`` (flattened).

  Diagnostics (means, standard deviations, kept fractions) are estimated on
  such samples, so that logging never adds a pass over a parameter-sized
  array to the update.
  """
  flat = jnp.ravel(x)
  stride = max(1, -(-flat.size // max_n))
  return flat[::stride]


class SampledMoments:
  """Accumulates size-weighted means over per-leaf samples."""

  def __init__(self):
    self.total = 0
    self.sums: dict[str, jax.Array] = {}

  def add(self, n: int, **samples: jax.Array) -> None:
    if n == 0:
      return
    self.total += n
    for k, v in samples.items():
      v = jnp.asarray(v, jnp.float32)
      contrib = jnp.mean(v) * n
      self.sums[k] = self.sums.get(k, jnp.zeros((), jnp.float32)) + contrib

  def mean(self, key: str, default: float = 0.0) -> jax.Array:
    if not self.total or key not in self.sums:
      return jnp.asarray(default, jnp.float32)
    return self.sums[key] / self.total
