"""grpo_optax.rl.group_advantages against a NumPy loop reference."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_optax import rl


def _reference(rewards, estimator, eps):
  """One group at a time, in float64, with Python loops."""
  rewards = np.asarray(rewards, np.float64)
  out = np.zeros_like(rewards)
  everything = [r for r in rewards.ravel() if not math.isnan(r)]
  batch_mean = sum(everything) / len(everything)
  batch_std = math.sqrt(
    sum((r - batch_mean) ** 2 for r in everything) / (len(everything) - 1)
  )
  for p, row in enumerate(rewards):
    valid = [r for r in row if not math.isnan(r)]
    n = len(valid)
    if n < 2 or max(valid) == min(valid):
      continue
    mean = sum(valid) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in valid) / (n - 1))
    for i, r in enumerate(row):
      if math.isnan(r):
        continue
      if estimator == "group_std":
        out[p, i] = (r - mean) / (std + eps)
      elif estimator == "batch_std":
        out[p, i] = (r - mean) / (batch_std + eps)
      elif estimator == "none":
        out[p, i] = r - mean
      else:  # rloo: the mean of the others.
        out[p, i] = r - (sum(valid) - r) / (n - 1)
  return out


def _rewards():
  rng = np.random.default_rng(0)
  r = rng.normal(size=(6, 5)).astype(np.float32)
  r[1] = 0.3  # constant group
  r[2, [0, 3]] = np.nan  # two missing rewards
  r[3, 1:] = np.nan  # a single valid reward: no signal
  r[4] = rng.integers(0, 2, size=5)  # binary rewards
  r[4, :2] = [0, 1]
  return r


@pytest.mark.parametrize("estimator", rl.ADVANTAGE_ESTIMATORS)
@pytest.mark.parametrize("eps", [0.0, 1e-2])
def test_matches_loop_reference(estimator, eps):
  rewards = _rewards()
  got = rl.group_advantages(rewards, estimator=estimator, eps=eps)
  assert got.shape == rewards.shape and got.dtype == jnp.float32
  np.testing.assert_allclose(
    got, _reference(rewards, estimator, eps), rtol=2e-6, atol=2e-6
  )
  assert not np.any(np.isnan(got))


@pytest.mark.parametrize("estimator", rl.ADVANTAGE_ESTIMATORS)
def test_equal_rewards_give_exactly_zero(estimator):
  # In float32, (7 * 0.1) / 7 - 0.1 is not 0: without the rule the group
  # would get rounding noise divided by eps.
  rewards = (
    jnp.full((2, 7), 0.1, jnp.float32)
    .at[1]
    .set(jnp.array([0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 33.0]))
  )
  naive = rewards[0] - jnp.mean(rewards[0])
  assert np.any(np.asarray(naive) != 0)
  got = rl.group_advantages(rewards, estimator=estimator, eps=0.0)
  assert np.all(np.asarray(got[0]) == 0.0)
  assert np.all(np.asarray(got[1]) != 0.0)
  np.testing.assert_array_equal(rl.zero_signal_groups(rewards), [True, False])


@pytest.mark.parametrize("estimator", rl.ADVANTAGE_ESTIMATORS)
def test_nan_rewards_are_left_out(estimator):
  full = jnp.array([[0.0, 1.0, 1.0, 0.5], [2.0, 0.0, 1.0, 1.0]])
  holey = jnp.array(
    [
      [0.0, jnp.nan, 1.0, 1.0, jnp.nan, 0.5],
      [2.0, 0.0, jnp.nan, 1.0, 1.0, jnp.nan],
    ]
  )
  want = rl.group_advantages(full, estimator=estimator)
  got = rl.group_advantages(holey, estimator=estimator)
  kept = ~np.isnan(np.asarray(holey))
  np.testing.assert_allclose(
    np.asarray(got)[kept], np.asarray(want).ravel(), rtol=1e-6
  )
  np.testing.assert_array_equal(np.asarray(got)[~kept], 0.0)


def test_estimator_identities():
  rewards = _rewards()
  none = rl.group_advantages(rewards, estimator="none")
  rloo = rl.group_advantages(rewards, estimator="rloo")
  n = np.sum(~np.isnan(rewards), axis=1, keepdims=True)
  np.testing.assert_allclose(rloo, none * n / np.maximum(n - 1, 1), rtol=1e-6)
  # Group-normalised advantages have unit sample std in each signal group.
  grpo = np.asarray(rl.group_advantages(rewards, eps=0.0))
  for p in (0, 2, 4, 5):
    valid = ~np.isnan(rewards[p])
    np.testing.assert_allclose(np.std(grpo[p, valid], ddof=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(np.mean(grpo[p, valid]), 0.0, atol=1e-6)


def test_integer_rewards_jit_and_zero_signal():
  rewards = jnp.array([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], jnp.int32)
  fn = jax.jit(lambda r: rl.group_advantages(r, estimator="group_std"))
  got = fn(rewards)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got[0], [1.5, -0.5, -0.5, -0.5], rtol=1e-5)
  np.testing.assert_array_equal(got[1:], 0.0)
  np.testing.assert_array_equal(
    rl.zero_signal_groups(rewards), [False, True, True]
  )


@pytest.mark.parametrize(
  "rewards, kwargs, error, match",
  [
    (np.zeros(8), {}, ValueError, r"\[num_prompts, group_size\]"),
    (np.zeros((4, 1)), {}, ValueError, "group_size"),
    (np.zeros((2, 4)), {"estimator": "std"}, ValueError, "estimator"),
    (np.zeros((2, 4)), {"eps": -1.0}, ValueError, "eps"),
  ],
)
def test_bad_input(rewards, kwargs, error, match):
  with pytest.raises(error, match=match):
    rl.group_advantages(rewards, **kwargs)


@pytest.mark.parametrize("estimator", ["group_std", "none", "rloo"])
def test_infinite_rewards_make_their_group_nan(estimator):
  """As the docs say: a group holding +-inf gets NaN advantages, even when
  all its rewards are +inf (equal); other groups are unaffected.
  """
  rewards = jnp.array(
    [
      [jnp.inf, jnp.inf, jnp.inf],
      [1.0, -jnp.inf, 0.0],
      [jnp.inf, jnp.nan, jnp.nan],
      [1.0, 0.0, 0.0],
    ]
  )
  adv = np.asarray(rl.group_advantages(rewards, estimator=estimator))
  assert np.all(np.isnan(adv[:3]))
  np.testing.assert_array_equal(
    adv[3], rl.group_advantages(rewards[3:], estimator=estimator)[0]
  )
  assert np.all(np.isfinite(adv[3]))
  np.testing.assert_array_equal(
    rl.zero_signal_groups(rewards), [False, False, False, False]
  )
  np.testing.assert_array_equal(
    rl.zero_signal_groups(jnp.array([[2.0, 2.0], [jnp.inf, jnp.inf]])),
    [True, False],
  )


def test_infinite_reward_under_batch_std_poisons_groups_with_signal():
  rewards = jnp.array([[jnp.inf, 0.0], [1.0, 0.0], [1.0, 1.0]])
  adv = np.asarray(rl.group_advantages(rewards, estimator="batch_std"))
  assert np.all(np.isnan(adv[:2]))
  np.testing.assert_array_equal(adv[2], [0.0, 0.0])
