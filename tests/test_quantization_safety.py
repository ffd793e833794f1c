"""8-bit Adam state: no step far above float32's; blocks stay within shards.

``nu`` spans the square of the gradient's range, so with block-wise 8-bit
state an entry of ``nu`` rounds to 0 long before the matching entry of
``mu`` does; on a step where that entry's gradient is 0 (an inactive ReLU,
the top-k mask) Adam's step would be ``mu_hat / eps``, 10^3-10^5 times the
float32 one. ``nu`` is therefore decoded with a floor
(``quantization.decode(..., floor=True)``). The second part: a leaf whose
shards along the last axis the block size does not tile is refused at
``init``, naming the leaf, its sharding and the block size.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import grpo_optax
from grpo_optax import quantization as qz
from grpo_optax import training

EIGHT_BIT = dict(mu_format="int8", nu_format="uint8")


def _max_updates(tx, grads, start):
  """Max |update| over steps ``start..`` of ``tx`` fed each of ``grads``."""
  params = jnp.zeros(grads[0].shape[1:])

  @jax.jit
  def run(g_steps):
    def step(state, g):
      u, state = tx.update(g, state, params)
      return state, jnp.max(jnp.abs(u))

    return jnp.max(jax.lax.scan(step, tx.init(params), g_steps)[1][start:])

  return np.array([float(run(jnp.asarray(g))) for g in grads])


@pytest.mark.parametrize("fused", [True, False])
def test_one_block_of_rare_small_entries(fused):
  # One block of 256: one large entry, 255 at scale c that are 0 every
  # other step. Before the floor (max |update| over steps 50-300, fp32
  # 1.29): c = 3e-3 -> 1.6e5, 1e-4 -> 1.1e4, 1e-5 -> 2.0e3.
  rng = np.random.default_rng(0)
  steps = 300
  noise = rng.normal(size=(steps, 256)).astype(np.float32)
  noise[1::2, 1:] = 0.0
  noise[:, 0] = rng.normal(size=steps)
  cs = (1e-2, 3e-3, 1e-4, 1e-5)
  grads = [noise * np.float32(c) for c in cs]
  for g in grads:
    g[:, 0] = noise[:, 0]
  kw = dict(max_norm=None, sparsify=None, fused=fused)
  fp32 = _max_updates(grpo_optax.grpo(1.0, **kw), grads, 50)
  q8 = _max_updates(grpo_optax.grpo(1.0, **kw, **EIGHT_BIT), grads, 50)
  assert np.all(q8 <= 2 * fp32), (cs, q8, fp32)


def test_stochastic_bf16_moments_on_rare_small_entries():
  # The same block with the moments in bf16, rounded stochastically from
  # one random word per leaf (quantization.encode(key=)): no step far
  # larger than float32's.
  rng = np.random.default_rng(1)
  steps = 300
  noise = rng.normal(size=(steps, 256)).astype(np.float32)
  noise[1::2, 1:] = 0.0
  grads = [noise * np.float32(c) for c in (1e-2, 1e-4)]
  for g in grads:
    g[:, 0] = noise[:, 0]
  kw = dict(max_norm=None, sparsify=None)
  fp32 = _max_updates(grpo_optax.grpo(1.0, **kw), grads, 50)
  bf16 = _max_updates(
    grpo_optax.grpo(
      1.0, mu_format="bfloat16_sr", nu_format="bfloat16_sr", **kw
    ),
    grads,
    50,
  )
  assert np.all(bf16 <= 2 * fp32), (bf16, fp32)


def _digits_big_steps(steps, lr, **kw):
  """Entry-steps with |update| > 10 lr training a 64-512-10 ReLU MLP on
  sklearn's digits (minibatches of 128), and the largest |update|.
  """
  datasets = pytest.importorskip("sklearn.datasets")
  x, y = datasets.load_digits(return_X_y=True)
  x = jnp.asarray(x / 16.0, jnp.float32)
  rng = np.random.default_rng(0)
  idx = jnp.asarray(
    np.stack([rng.choice(len(y), 128, replace=False) for _ in range(steps)])
  )
  k1, k2 = jax.random.split(jax.random.key(0))
  params = {
    "w1": jax.random.normal(k1, (64, 512)) / 8,
    "b1": jnp.zeros(512),
    "w2": jax.random.normal(k2, (512, 10)) / np.sqrt(512),
    "b2": jnp.zeros(10),
  }
  tx = grpo_optax.grpo(lr, **kw)

  def loss(p, xb, yb):
    h = jax.nn.relu(xb @ p["w1"] + p["b1"])
    logits = h @ p["w2"] + p["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

  @jax.jit
  def run(params, idx):
    def step(carry, i):
      p, state = carry
      u, state = tx.update(jax.grad(loss)(p, x[i], y[i]), state, p)
      mags = [jnp.abs(v) for v in jax.tree.leaves(u)]
      big = sum(jnp.sum(m > 10 * lr) for m in mags)
      top = jnp.max(jnp.stack([jnp.max(m) for m in mags]))
      return (optax.apply_updates(p, u), state), (big, top)

    return jax.lax.scan(step, (params, tx.init(params)), idx)[1]

  y = jnp.asarray(y)
  big, top = run(params, idx)
  return int(jnp.sum(big)), float(jnp.max(top))


def test_digits_mlp_no_step_above_10x_lr():
  # float32 state: no entry-step above 10 lr (max 3.3 lr over 500 steps);
  # 8-bit before the floor: 6,187 in these 40 steps (the first at step 1),
  # up to 1,400 lr; over 500 steps the first-layer weights grew to 40.
  lr = 3e-3
  big8, top8 = _digits_big_steps(40, lr, sparsify=None, **EIGHT_BIT)
  assert big8 == 0, (big8, top8 / lr)


def test_floor_decodes_code_zero_to_its_upper_end():
  fmt = qz.state_format("uint8", min_size=0)
  rng = np.random.default_rng(1)
  nu = rng.standard_t(3, (4, 512)) * np.exp(3 * rng.normal(size=(4, 512)))
  nu = jnp.asarray(nu.astype(np.float32) ** 2)
  nu = nu.at[0].set(0.0)  # a row of all-zero blocks stays 0
  stored = qz.encode(fmt, nu)
  plain = qz.decode(fmt, stored)
  floored = qz.decode(fmt, stored, floor=True)
  zero = np.asarray(stored.codes) == 0
  assert zero[1:].any()  # some positive entries round to 0 ...
  np.testing.assert_array_equal(floored[~zero], plain[~zero])
  scale = np.repeat(np.asarray(stored.scale), 256, axis=-1)
  np.testing.assert_allclose(
    np.asarray(floored)[zero], (scale * 0.5 / 255**2)[zero], rtol=1e-6
  )
  assert np.all(np.asarray(floored)[0] == 0)
  # ... and none decodes below 1/2.5 of its value with the floor (code 1
  # holds up to 2.5 s / Q^2), against 0 without.
  x = np.asarray(nu)
  assert np.all(np.asarray(floored) >= x / 2.5 * (1 - 1e-6))
  assert not np.all(np.asarray(plain) >= x / 2.5 * (1 - 1e-6))
  # The same on a tree, and float formats ignore the floor.
  tree = qz.tree_decode(fmt, qz.tree_encode(fmt, {"v": nu}), floor=True)
  np.testing.assert_array_equal(tree["v"], floored)
  np.testing.assert_array_equal(qz.decode("float32", nu, floor=True), nu)


def _mesh(kind):
  return jax.make_mesh((8,), ("x",), axis_types=(kind,))


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize("fused", [True, False])
def test_blocks_across_shards_are_refused_at_init(kind, fused):
  # (64, 768) over 8 devices: 96 entries per shard, blocks of 256.
  mesh = _mesh(kind)
  w = jax.device_put(jnp.ones((64, 768)), NamedSharding(mesh, P(None, "x")))
  params = {"w": w, "b": jnp.ones(10)}
  tx = grpo_optax.grpo(1e-3, fused=fused, **EIGHT_BIT)
  with pytest.raises(ValueError, match=r"leaf \['w'\]") as err:
    tx.init(params)
  msg = str(err.value)
  assert "96 entries per shard" in msg and "256" in msg
  assert "PartitionSpec(None, 'x')" in msg or "P(None, 'x')" in msg
  # Under jit, an Explicit mesh's types carry the sharding: refused too,
  # at init and at update (a state built from unsharded params), where the
  # reshape raised a ShardingTypeError.
  if kind == AxisType.Explicit:
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="96 entries"):
      jax.jit(tx.init)(params)
    state = tx.init({"w": jnp.ones((64, 768)), "b": jnp.ones(10)})
    with (
      jax.set_mesh(mesh),
      pytest.raises(ValueError, match=r"leaf \['w'\].*96 entries"),
    ):
      jax.jit(tx.update)(params, state, params)


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit])
def test_blocks_that_tile_the_shards_need_no_collective(kind):
  # The remedy the error names: a block size that divides the shard.
  mesh = _mesh(kind)
  sharding = NamedSharding(mesh, P(None, "x"))
  w = jax.device_put(jnp.ones((64, 768)), sharding)
  g = jax.device_put(jax.random.normal(jax.random.key(0), (64, 768)), sharding)
  tx = grpo_optax.grpo(
    1e-3,
    max_norm=None,  # the clipping norm's all-reduce is not the codec's
    sparsify=None,
    mu_format=qz.state_format("int8", block_size=96),
    nu_format=qz.state_format("uint8", block_size=32),
  )
  state = tx.init(w)
  step = jax.jit(tx.update)
  compiled = step.lower(g, state, w).compile()
  assert not training.collective_ops(compiled)  # no all-gather, no other
  u, state = step(g, state, w)
  assert u.sharding.is_equivalent_to(sharding, 2)
