"""Batch-split invariance of grpo_optax.rl.policy_loss, and dynamic sampling.

With the whole batch's LossNormalizer, the losses and gradients of the parts
of a batch (microbatches with accumulation, or the shards of 8 devices in a
data-parallel step) sum to the whole batch's, for every preset.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from grpo_optax import rl

B, T, V, F, G = 16, 6, 5, 4, 4


def _batch(seed=0):
  """A linear softmax policy logits = x @ w and a batch of its completions,
  with off-policy old log-probs (ratios != 1, clips binding) and a
  reference for the KL term.
  """
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(B, T, F)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(F, V)), jnp.float32)
  tokens = jnp.asarray(rng.integers(0, V, size=(B, T)), jnp.int32)
  logp = lambda w: rl.token_log_probs(x @ w, tokens)
  old = logp(w + 0.3 * jnp.asarray(rng.normal(size=(F, V)), jnp.float32))
  ref = logp(w + 0.3 * jnp.asarray(rng.normal(size=(F, V)), jnp.float32))
  lengths = rng.integers(1, T + 1, size=B)
  lengths[3] = 0  # a row without tokens
  mask = jnp.asarray(np.arange(T)[None] < lengths[:, None])
  rewards = rng.integers(0, 3, size=(B // G, G)).astype(np.float32)
  rewards[1] = 1.0  # a zero-signal group
  adv = rl.group_advantages(rewards).reshape(-1)
  return dict(x=x, tokens=tokens, old=old, ref=ref, mask=mask, adv=adv), w


def _loss(w, batch, config, normalizer):
  logp = rl.token_log_probs(batch["x"] @ w, batch["tokens"])
  loss, _ = rl.policy_loss(
    logp,
    batch["old"],
    batch["adv"],
    batch["mask"],
    config=config,
    ref_log_probs=batch["ref"],
    normalizer=normalizer,
  )
  return loss


# The loss and its gradient, jitted once for the module: the data-parallel
# test's whole-batch reference reuses the microbatch test's compilation of
# the same preset and shapes.
_value_and_grad = jax.jit(jax.value_and_grad(_loss), static_argnums=2)


def _config(preset):
  # Dual clip on, so every branch of the surrogate is exercised.
  return rl.Config.preset(preset, dual_clip=2.0, beta=0.05)


def _split(batch, num_parts):
  return [
    jax.tree.map(
      lambda a, i=i: a[i * B // num_parts : (i + 1) * B // num_parts], batch
    )
    for i in range(num_parts)
  ]


@pytest.mark.parametrize("preset", rl.PRESETS)
def test_microbatches_with_the_global_normalizer_sum_to_the_batch(preset):
  batch, w = _batch()
  config = _config(preset)
  norm = rl.loss_normalizer(batch["mask"])
  grad_fn = _value_and_grad
  whole, whole_grad = grad_fn(w, batch, config, norm)
  default, _ = grad_fn(w, batch, config, None)
  assert float(default) == pytest.approx(float(whole), rel=1e-6)
  loss, grad = 0.0, jnp.zeros_like(w)
  for part in _split(batch, 4):
    part_loss, part_grad = grad_fn(w, part, config, norm)
    loss, grad = loss + part_loss, grad + part_grad
  np.testing.assert_allclose(loss, whole, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(grad, whole_grad, rtol=1e-6, atol=1e-7)
  # The microbatches' own counts do not give the batch's loss.
  own = sum(
    float(grad_fn(w, part, config, None)[0]) / 4 for part in _split(batch, 4)
  )
  assert abs(own - float(whole)) > 1e-4


@pytest.mark.parametrize("preset", rl.PRESETS)
def test_data_parallel_step_on_8_devices_equals_the_batch(preset):
  assert jax.device_count() == 8
  batch, w = _batch(1)
  config = _config(preset)
  mesh = Mesh(np.array(jax.devices()), ("data",))

  def local(w, batch):
    norm = rl.loss_normalizer(batch["mask"], axis_name="data")
    loss, grad = jax.value_and_grad(_loss)(w, batch, config, norm)
    return jax.lax.psum((loss, grad), "data")

  step = jax.jit(
    jax.shard_map(
      local,
      mesh=mesh,
      in_specs=(P(), P("data")),
      out_specs=P(),
      check_vma=False,
    )
  )
  loss, grad = step(w, batch)
  whole, whole_grad = _value_and_grad(
    w, batch, config, rl.loss_normalizer(batch["mask"])
  )
  np.testing.assert_allclose(loss, whole, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(grad, whole_grad, rtol=1e-6, atol=1e-7)


def test_loss_normalizer_counts():
  mask = jnp.array([[1, 1, 0], [0, 0, 0], [1, 0, 0]], bool)
  norm = rl.loss_normalizer(mask)
  assert float(norm.num_sequences) == 2 and float(norm.num_tokens) == 3
  with pytest.raises(ValueError, match=r"mask must have shape \[B, T\]"):
    rl.loss_normalizer(jnp.ones(3, bool))
  logp = jnp.zeros((3, 3))
  with pytest.raises(ValueError, match="not both"):
    rl.policy_loss(
      logp,
      None,
      jnp.ones(3),
      mask,
      config="dapo",
      normalizer=norm,
      num_tokens=3.0,
    )


def test_drop_zero_signal_removes_the_groups_from_loss_and_counts():
  """Dropping the zero-signal groups equals a batch of the other groups."""
  batch, w = _batch(2)
  rewards = np.asarray(
    jax.device_get(
      jnp.stack(
        [
          jnp.arange(G, dtype=jnp.float32),
          jnp.ones(G),
          jnp.arange(G, dtype=jnp.float32)[::-1],
          jnp.zeros(G),
        ]
      )
    )
  )
  batch["adv"] = rl.group_advantages(rewards).reshape(-1)
  config = rl.Config.preset("dapo", beta=0.05)
  dropped = dict(batch, mask=rl.drop_zero_signal(batch["mask"], rewards))
  keep = np.repeat([True, False, True, False], G)
  np.testing.assert_array_equal(
    np.asarray(dropped["mask"]), np.asarray(batch["mask"]) & keep[:, None]
  )
  sub = jax.tree.map(lambda a: a[keep], batch)
  got = _loss(w, dropped, config, rl.loss_normalizer(dropped["mask"]))
  want = _loss(w, sub, config, None)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  # Kept in the denominators, the zero-signal groups dilute the loss.
  assert abs(float(_loss(w, batch, config, None)) - float(want)) > 1e-4
  with pytest.raises(ValueError, match="mask must have shape"):
    rl.drop_zero_signal(batch["mask"][:5], rewards)


def test_select_groups_prefers_signal_and_has_static_shapes():
  pool = jnp.array([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [1.0, 0.0], [2.0, 2.0]])
  idx, has_signal = jax.jit(rl.select_groups, static_argnums=1)(pool, 3)
  np.testing.assert_array_equal(idx, [1, 3, 0])
  np.testing.assert_array_equal(has_signal, [True, True, False])
  np.testing.assert_array_equal(rl.group_rows(idx, 2), [2, 3, 6, 7, 0, 1])
  for bad in (0, 6, 2.0):
    with pytest.raises(ValueError, match=r"num_groups must be an int in \[1, "):
      rl.select_groups(pool, bad)
