"""Tests of grpo_optax.training.immediate (donation and layer-wise fusion)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from compile_options import USER_DEFAULT

from grpo_optax import training


def _layer(p, h):
  return h + jnp.tanh(h @ p["w1"] + p["b1"]) @ p["w2"]


def _embed(p, batch):
  return batch[0] @ p["w"]


def _head(p, h, batch):
  return jnp.mean((h @ p["w"] + p["b"] - batch[1]) ** 2)


def _params(d=8, f=16, num_layers=3, seed=0):
  k = jax.random.split(jax.random.key(seed), 4)
  return training.StackedParams(
    embed={"w": jax.random.normal(k[0], (4, d)) / 2},
    layers={
      "w1": jax.random.normal(k[1], (num_layers, d, f)) / np.sqrt(d),
      "b1": jnp.zeros((num_layers, f)),
      "w2": jax.random.normal(k[2], (num_layers, f, d)) / f,
    },
    head={"w": jax.random.normal(k[3], (d, 2)) / np.sqrt(d), "b": jnp.zeros(2)},
  )


def _batch(seed, n=8):
  kx, ky = jax.random.split(jax.random.key(seed))
  return jax.random.normal(kx, (n, 4)), jax.random.normal(ky, (n, 2))


def _copy(tree):
  return jax.tree.map(jnp.array, tree)


def _peak(compiled):
  m = compiled.memory_analysis()
  return (
    m.temp_size_in_bytes
    + m.argument_size_in_bytes
    + m.output_size_in_bytes
    - m.alias_size_in_bytes
  )


def test_donated_step_deletes_inputs_and_lowers_peak():
  loss_fn = training.stacked_loss_fn(_embed, _layer, _head)
  tx = optax.adam(1e-3)
  params = _params(d=32, f=64)
  opt_state = tx.init(params)
  donated = training.train_step(loss_fn, tx)
  kept = training.train_step(loss_fn, tx, donate=False)
  batch = _batch(0)
  p_d = _peak(
    donated.lower(params, opt_state, batch).compile(
      compiler_options=USER_DEFAULT
    )
  )
  p_k = _peak(
    kept.lower(params, opt_state, batch).compile(compiler_options=USER_DEFAULT)
  )
  assert p_d < 0.8 * p_k
  new_params, new_state, _ = kept(params, opt_state, batch)
  assert not any(x.is_deleted() for x in jax.tree.leaves(params))
  donated(params, opt_state, batch)
  assert all(x.is_deleted() for x in jax.tree.leaves((params, opt_state)))
  del new_params, new_state


@pytest.mark.parametrize(
  "tx",
  [
    optax.sgd(0.1),
    optax.sgd(0.1, momentum=0.9),
    optax.adam(1e-2),
    optax.adamw(1e-2),
  ],
  ids=["sgd", "momentum", "adam", "adamw"],
)
def test_layerwise_matches_plain_step(tx):
  fused = training.layerwise_train_step(_embed, _layer, _head, tx)
  plain = training.train_step(fused.loss_fn, tx)
  p1, p2 = _params(), _params()
  s1, s2 = fused.init(p1), tx.init(p2)
  for t in range(4):
    p1, s1, l1 = fused.step(p1, s1, _batch(t))
    p2, s2, l2 = plain(p2, s2, _batch(t))
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_layerwise_grad_norm_and_previous_step_clipping():
  lr, c = 0.1, 1e-3
  fused = training.layerwise_train_step(
    _embed, _layer, _head, optax.sgd(lr), max_norm=c
  )
  loss_fn = fused.loss_fn
  params = _params()
  p, s = _copy(params), fused.init(params)
  # Step 1: no previous norm, so no clipping: a plain SGD step.
  g1 = jax.grad(loss_fn)(params, _batch(0))
  p, s, _ = fused.step(p, s, _batch(0))
  n1 = optax.tree.norm(g1)
  np.testing.assert_allclose(s.grad_norm, n1, rtol=1e-5)
  want = jax.tree.map(lambda x, g: x - lr * g, params, g1)
  # Step 2: scaled by min(1, c / n1) from the previous step.
  g2 = jax.grad(loss_fn)(want, _batch(1))
  want = jax.tree.map(
    lambda x, g: x - lr * g * min(1.0, c / float(n1)), want, g2
  )
  p, s, _ = fused.step(p, s, _batch(1))
  for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(s.grad_norm, optax.tree.norm(g2), rtol=1e-5)


def test_layerwise_donates_and_lowers_peak_memory():
  tx = optax.adam(1e-3)
  fused = training.layerwise_train_step(_embed, _layer, _head, tx)
  plain = training.train_step(fused.loss_fn, tx)
  params = _params(d=64, f=256, num_layers=8)
  batch = _batch(0, n=2)
  peak_fused = _peak(
    fused.step.lower(params, fused.init(params), batch).compile(
      compiler_options=USER_DEFAULT
    )
  )
  peak_plain = _peak(
    plain.lower(params, tx.init(params), batch).compile(
      compiler_options=USER_DEFAULT
    )
  )
  assert peak_fused < 0.85 * peak_plain
  state = fused.init(params)
  fused.step(params, state, batch)
  assert all(
    x.is_deleted()
    for x in jax.tree.leaves((params, state.embed, state.layers, state.head))
  )


def test_layerwise_bad_input():
  with pytest.raises(ValueError, match="max_norm"):
    training.layerwise_train_step(
      _embed, _layer, _head, optax.sgd(0.1), max_norm=0.0
    )
  fused = training.layerwise_train_step(_embed, _layer, _head, optax.sgd(0.1))
  with pytest.raises(TypeError, match="StackedParams"):
    fused.init(dict(_params()._asdict()))


@pytest.mark.slow  # four compiled steps
def test_layerwise_with_quantized_state():
  import grpo_optax  # pylint: disable=g-import-not-at-top

  make = lambda **f: optax.chain(
    grpo_optax.scale_by_nesterov_adam_rms(adam_weight=1.0, **f),
    optax.scale(-1e-2),
  )
  # A layer's slices (8 x 300) are under the formats' min_size: asked for
  # in 8 bits explicitly, so that both forms quantize every layer.
  int8 = grpo_optax.quantization.state_format("int8", min_size=0)
  uint8 = grpo_optax.quantization.state_format("uint8", min_size=0)
  tx = make(mu_format=int8, nu_format=uint8)
  fused = training.layerwise_train_step(_embed, _layer, _head, tx)
  plain = training.train_step(fused.loss_fn, tx)
  p1, p2 = _params(d=8, f=300), _params(d=8, f=300)
  s1, s2 = fused.init(p1), tx.init(p2)
  codes = s1.layers[0].mu.codes
  assert codes["w1"].dtype == jnp.int8 and codes["w1"].shape == (3, 8, 300)
  assert s1.layers[0].mu.scale["w1"].shape == (3, 8, 2)  # blocks of 256
  for t in range(3):
    p1, s1, l1 = fused.step(p1, s1, _batch(t))
    p2, s2, l2 = plain(p2, s2, _batch(t))
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  # Layer l's slice of the stacked state is that layer's own encoding.
  layer0 = jax.tree.map(lambda x: x[0], s1.layers[0].nu)
  np.testing.assert_allclose(
    grpo_optax.quantization.tree_decode(uint8, layer0)["w2"],
    grpo_optax.quantization.tree_decode(uint8, s2[0].nu).layers["w2"][0],
    rtol=1e-4,
    atol=1e-9,
  )
  # Memory: 8-bit state + layer-wise update below the fp32 layer-wise step.
  params = _params(d=64, f=256, num_layers=8)
  batch = _batch(0, n=2)
  peaks = {}
  for name, t in [("fp32", make()), ("int8", tx)]:
    lw = training.layerwise_train_step(_embed, _layer, _head, t)
    peaks[name] = _peak(
      lw.step.lower(params, lw.init(params), batch).compile(
        compiler_options=USER_DEFAULT
      )
    )
  assert peaks["int8"] < 0.8 * peaks["fp32"]
