"""grpo_optax.quantization: NumPy reference, error bounds, layout, sharding, SR."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from grpo_optax import quantization as qz


def _np_encode(x, block, power, levels, signed):
  """Brute force: per block along the last axis, the nearest of all codes."""
  x = np.asarray(x, np.float64).reshape(np.shape(x) or (1,))
  n = x.shape[-1]
  b = min(block, n)
  nb = -(-n // b)
  xp = np.zeros(x.shape[:-1] + (nb * b,))
  xp[..., :n] = x
  xb = xp.reshape(x.shape[:-1] + (nb, b))
  scale = np.abs(xb).max(-1)
  ks = np.arange(levels + 1)
  table = (ks / levels) ** power  # magnitudes of codes 0..Q
  values = np.concatenate([-table[:0:-1], table]) if signed else table
  codes = np.arange(-levels, levels + 1) if signed else ks
  u = xb / np.where(scale > 0, scale, 1)[..., None]
  if not signed:
    u = np.maximum(u, 0)
  idx = np.abs(u[..., None] - values).argmin(-1)
  q = codes[idx].reshape(x.shape[:-1] + (nb * b,))[..., :n]
  return q, scale


def _np_decode(q, scale, block, power, levels):
  q = np.asarray(q, np.float64)
  shape = q.shape
  q = q.reshape(shape or (1,))
  n = q.shape[-1]
  b = min(block, n)
  s = np.repeat(
    np.asarray(scale, np.float64).reshape(q.shape[:-1] + (-1,)), b, axis=-1
  )[..., :n]
  return (np.sign(q) * (np.abs(q) / levels) ** power * s).reshape(shape)


def _moments(shape, seed=0):
  """Adam-like moments: heavy-tailed mu, squares spanning decades for nu."""
  rng = np.random.default_rng(seed)
  g = rng.standard_t(3, size=shape) * np.exp(rng.normal(size=shape))
  return g.astype(np.float32), (g.astype(np.float32) ** 2)


@pytest.mark.parametrize("name,signed", [("int8", True), ("uint8", False)])
@pytest.mark.parametrize(
  "shape,block", [((3, 700), 256), ((2, 3, 50), 256), ((10,), 4)]
)
def test_matches_numpy_reference(name, signed, shape, block):
  fmt = qz.state_format(name, block_size=block, min_size=0)
  mu, nu = _moments(shape)
  x = mu if signed else nu
  stored = qz.encode(fmt, jnp.asarray(x))
  q_ref, s_ref = _np_encode(x, block, fmt.power, fmt.levels, signed)
  np.testing.assert_array_equal(stored.scale, s_ref.astype(np.float32))
  codes = np.asarray(stored.codes, np.int64)
  # Same code wherever the nearest level is not a near-tie in float32.
  assert np.mean(codes == q_ref) > 0.999
  dec = np.asarray(qz.decode(fmt, stored), np.float64)
  ref_err = np.abs(_np_decode(q_ref, s_ref, block, fmt.power, fmt.levels) - x)
  scale_each = _np_decode(
    np.full(shape, fmt.levels), s_ref, block, 1, fmt.levels
  )
  assert np.all(np.abs(dec - x) <= ref_err + 1e-6 * scale_each)
  np.testing.assert_allclose(
    dec,
    _np_decode(codes, s_ref, block, fmt.power, fmt.levels),
    rtol=1e-6,
    atol=1e-30,
  )


@pytest.mark.parametrize(
  "name,power", [("int8", 1), ("int8", 3), ("uint8", 2), ("uint8", 4)]
)
def test_round_trip_error_bound(name, power):
  # Largest gap between levels: between the top two, s (1 - ((Q-1)/Q)^p).
  fmt = qz.state_format(name, power=power, block_size=128)
  mu, nu = _moments((6, 1000), seed=power)
  x = mu if name == "int8" else nu
  dec = np.asarray(qz.decode(fmt, qz.encode(fmt, jnp.asarray(x))))
  q = fmt.levels
  _, scale = _np_encode(x, 128, power, q, name == "int8")
  s = _np_decode(
    np.full(x.shape, q), scale, 128, 1, q
  )  # each entry's block max
  bound = 0.5 * s * (1 - ((q - 1) / q) ** power) * (1 + 1e-5)
  assert np.all(np.abs(dec - x) <= bound)
  # The block maximum is stored (to one float32 rounding).
  np.testing.assert_allclose(
    np.abs(dec).max(-1), np.abs(x).max(-1), rtol=2e-7, atol=0
  )


def test_bfloat16_round_trip_and_float32_identity():
  x = jnp.asarray(_moments((5, 33))[0])
  assert qz.encode("float32", x).dtype == jnp.float32
  np.testing.assert_array_equal(
    qz.decode("float32", qz.encode("float32", x)), x
  )
  dec = qz.decode("bfloat16", qz.encode("bfloat16", x))
  assert dec.dtype == jnp.float32
  np.testing.assert_array_less(np.abs(dec - x), 2.0**-8 * np.abs(x) + 1e-38)


@pytest.mark.parametrize(
  "shape,want",
  [
    ((), ()),
    ((1,), (1,)),
    ((10,), (1,)),
    ((3, 256), (3, 1)),
    ((3, 257), (3, 2)),
    ((2, 4, 1024), (2, 4, 4)),
    ((5, 0), (5, 0)),
  ],
)
def test_shapes_and_dtypes(shape, want):
  fmt = qz.state_format("int8", min_size=0)
  x = jnp.linspace(-1, 2, math.prod(shape)).reshape(shape)
  stored = qz.encode(fmt, x)
  assert stored.codes.shape == shape and stored.codes.dtype == jnp.int8
  assert stored.scale.shape == want == qz.scale_shape(fmt, shape)
  assert stored.scale.dtype == jnp.float32
  init = qz.init(fmt, jax.ShapeDtypeStruct(shape, jnp.float32))
  assert jax.tree.map(jnp.shape, init) == jax.tree.map(jnp.shape, stored)
  assert qz.decode(fmt, stored).shape == shape
  if shape == ():  # a scalar is one block of one entry: exact
    assert float(qz.decode(fmt, stored)) == float(x)


def test_uint8_stores_negative_entries_as_zero():
  x = jnp.array([[-1.0, 0.5, 2.0, -3.0]])
  fmt = qz.state_format("uint8", min_size=0)
  stored = qz.encode(fmt, x)
  assert stored.codes.dtype == jnp.uint8
  dec = qz.decode(fmt, stored)
  assert float(dec[0, 0]) == 0.0 and float(dec[0, 3]) == 0.0
  q_ref, _ = _np_encode(x, 256, qz.state_format("uint8").power, 255, False)
  np.testing.assert_array_equal(stored.codes, q_ref)
  assert float(stored.scale[0, 0]) == 3.0  # |x| max, negatives included


def test_bytes_per_entry():
  assert qz.bytes_per_entry("float32", (64, 64)) == 4
  assert qz.bytes_per_entry("bfloat16_sr", (64, 64)) == 2
  assert qz.bytes_per_entry("int8", (1024, 1024)) == 1 + 4 / 256
  assert (
    qz.bytes_per_entry(qz.state_format("uint8", block_size=2048), (4, 4096))
    == 1 + 4 / 2048
  )
  assert qz.bytes_per_entry(qz.state_format("int8", min_size=0), (10,)) == (
    1 + 4 / 10
  )
  # Under min_size (4,096 entries by default) an array is stored in float32.
  assert qz.bytes_per_entry("int8", (10,)) == 4 + 4 / 10
  assert qz.bytes_per_entry("int8", (16, 256)) == 1 + 4 / 256
  assert qz.bytes_per_entry("int8", (15, 256)) == 4 + 4 / 256


@pytest.mark.parametrize("name", ["int8", "int8_sr", "uint8"])
def test_small_arrays_are_stored_exactly(name):
  fmt = qz.state_format(name)
  assert fmt.min_size == qz.DEFAULT_MIN_SIZE == 4096
  rng = np.random.default_rng(0)
  small = jnp.asarray(np.abs(rng.normal(size=(15, 273))).astype(np.float32))
  large = jnp.asarray(np.abs(rng.normal(size=(16, 256))).astype(np.float32))
  bits = jnp.zeros((15, 273), jnp.uint32)
  for x, exact in ((small, True), (large, False)):
    stored = qz.encode(fmt, x, bits=bits if x is small else bits[:1, :1])
    want = jnp.float32 if exact else fmt.dtype
    assert stored.codes.dtype == want, (x.shape, stored.codes.dtype)
    assert qz.init(fmt, x).codes.dtype == want
    assert stored.scale.shape == qz.scale_shape(fmt, x.shape)
    dec = qz.decode(fmt, stored)
    if exact:
      np.testing.assert_array_equal(dec, x)
    else:
      assert not np.array_equal(dec, x)
  assert qz.state_format(name, min_size=0).exact((15, 273)) is False
  # A format given with an override keeps its other settings.
  f = qz.state_format(qz.state_format(name, block_size=64), min_size=0)
  assert (f.block_size, f.min_size) == (64, 0)


@pytest.mark.parametrize("bad", [-1, 2.5, True, "4096"])
def test_min_size_refused(bad):
  with pytest.raises(ValueError, match=r"`min_size` must be an int >= 0"):
    qz.state_format("int8", min_size=bad)
  with pytest.raises(ValueError, match="apply to the 8-bit formats"):
    qz.state_format("bfloat16", min_size=0)


def test_jit_does_not_recompile():
  fmt = qz.state_format("int8")
  f = jax.jit(lambda x: qz.decode(fmt, qz.encode(fmt, x)))
  x = jnp.ones((4, 300))
  f(x)
  f(3 * x - 1)
  assert f._cache_size() == 1  # pylint: disable=protected-access


def test_stochastic_rounding_is_unbiased():
  spacing = 2.0**-7  # bf16 neighbours of 1: 1 and 1 + 2^-7
  x = 1.0 + 0.3 * spacing
  n = 200_000
  stored = qz.encode(
    "bfloat16_sr", jnp.full((n,), x, jnp.float32), key=jax.random.key(0)
  )
  vals = np.asarray(qz.decode("bfloat16_sr", stored), np.float64)
  assert set(np.unique(vals)) <= {1.0, 1.0 + spacing}
  sigma = spacing * math.sqrt(0.3 * 0.7 / n)
  assert abs(vals.mean() - x) < 4 * sigma  # nearest rounding: 290 sigma off
  assert float(qz.encode("bfloat16", jnp.float32(x))) == 1.0
  # Non-finite entries round to nearest; another key, other roundings.
  inf = qz.encode(
    "bfloat16_sr", jnp.array([jnp.inf, -jnp.inf]), key=jax.random.key(1)
  )
  assert np.all(np.isinf(np.asarray(inf, np.float32)))
  other = qz.encode(
    "bfloat16_sr", jnp.full((n,), x, jnp.float32), key=jax.random.key(1)
  )
  assert not np.array_equal(np.asarray(other, np.float32), vals)


@pytest.mark.parametrize(
  "kwargs,match",
  [
    (dict(name="int4"), "format"),
    (dict(name="int8", block_size=0), "block_size"),
    (dict(name="uint8", power=9), "power"),
    (dict(name="bfloat16", block_size=64), "8-bit formats only"),
  ],
)
def test_bad_input(kwargs, match):
  with pytest.raises(ValueError, match=match):
    qz.state_format(**kwargs)


def test_stochastic_needs_key():
  with pytest.raises(ValueError, match="key"):
    qz.encode("bfloat16_sr", jnp.ones(3))
  with pytest.raises(ValueError, match="key"):
    qz.tree_encode("bfloat16_sr", {"a": jnp.ones(3)})


def test_tree_forms_and_map_params():
  params = {"w": jnp.ones((4, 512)), "b": jnp.ones((3,))}
  stored = qz.tree_init("int8", params)
  assert isinstance(stored, qz.Quantized)
  assert jax.tree.structure(stored.codes) == jax.tree.structure(params)
  tree = {"w": jnp.linspace(-1, 1, 2048).reshape(4, 512), "b": jnp.arange(3.0)}
  dec = qz.tree_decode("int8", qz.tree_encode("int8", tree))
  for a, b in zip(jax.tree.leaves(dec), jax.tree.leaves(tree)):
    np.testing.assert_allclose(a, b, atol=0.02)
  # map_params reaches codes and scales (both trees mirror the params).
  init = lambda p: qz.tree_init("uint8", p)
  ranks = optax.tree.map_params(
    init, lambda x, spec: (x.ndim, spec), stored, {"w": "W", "b": "B"}
  )
  assert ranks.codes == {"w": (2, "W"), "b": (1, "B")}
  assert ranks.scale == {"w": (2, "W"), "b": (1, "B")}


def test_sharded_round_trip_keeps_sharding_without_collectives():
  assert jax.device_count() == 8
  mesh = jax.make_mesh((2, 4), ("a", "b"))
  param = NamedSharding(mesh, P("a", "b"))
  x = jax.device_put(jnp.asarray(_moments((8, 4 * 512))[0]), param)
  fmt = qz.state_format("int8", block_size=256)
  enc = jax.jit(lambda v: qz.encode(fmt, v))
  stored = enc(x)
  assert stored.codes.sharding.is_equivalent_to(param, 2)
  assert stored.scale.sharding.is_equivalent_to(param, 2)
  assert stored.scale.shape == (8, 8)
  text = (
    enc.lower(x).compile().as_text()
    + jax.jit(lambda s: qz.decode(fmt, s)).lower(stored).compile().as_text()
  )
  for op in ("all-gather", "all-to-all", "collective-permute", "all-reduce"):
    assert op not in text
  dec = jax.jit(lambda s: qz.decode(fmt, s))(stored)
  assert dec.sharding.is_equivalent_to(param, 2)
  # The same values as one device's round trip (to 1 ulp: jax 0.10.0's
  # fused program rounds the rescaling differently from the eager one).
  np.testing.assert_allclose(
    dec, qz.decode(fmt, qz.encode(fmt, np.asarray(x))), rtol=1e-6, atol=0
  )


@pytest.mark.parametrize("name", ["int8", "int8_sr", "uint8"])
@pytest.mark.parametrize("shape", [(6, 700), (3, 4096), (2, 100)])
def test_encode_with_absmax_is_encode_and_stored_absmax(name, shape):
  # (6, 700): a padded last block; (2, 100): small, stored exactly; the
  # maxima must equal those of the decoded codes.
  fmt = qz.state_format(name)
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_t(2, size=shape).astype(np.float32))
  x = x.at[0, :256].set(0.0)  # an all-zero block: scale and maxima 0
  bits = jnp.asarray(rng.integers(0, 2**32, size=shape, dtype=np.uint32))
  scale = qz.block_absmax(fmt, x) * 1.5  # a bound, as the optimizer passes
  for s in (None, scale):
    got, maxima = jax.jit(
      lambda x, b, s: qz.encode_with_absmax(fmt, x, bits=b, scale=s)
    )(x, bits, s)
    want = qz.encode(fmt, x, bits=bits, scale=s)
    np.testing.assert_array_equal(got.codes, want.codes)
    np.testing.assert_array_equal(got.scale, want.scale)
    # Equal up to one float32 rounding of the per-block scale factor: jax
    # 0.10.0's XLA folds the jitted product differently from the eager one.
    np.testing.assert_allclose(
      maxima, qz.stored_absmax(fmt, want), rtol=3e-7, atol=0
    )
    assert maxima.shape == qz.scale_shape(fmt, shape)
    dec = np.abs(np.asarray(qz.decode(fmt, want)))
    np.testing.assert_allclose(np.max(maxima), dec.max(), rtol=3e-7)


def test_encode_with_absmax_refuses_float_formats_and_missing_bits():
  x = jnp.ones((4, 4096))
  with pytest.raises(ValueError, match="block-wise 8-bit format.*'bfloat16'"):
    qz.encode_with_absmax("bfloat16", x)
  with pytest.raises(ValueError, match="'int8_sr' rounds stochastically"):
    qz.encode_with_absmax("int8_sr", x)
