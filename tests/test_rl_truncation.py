"""grpo_optax.rl truncated sampling: NumPy references, the kept set, and an
on-policy ratio of exactly 1 when the loss scores with the same truncation.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_optax import rl


def _ref_keep(z, top_k=None, top_p=None, min_p=None):
  """The kept set of one row, with Python loops over sorted probabilities."""
  keep = [True] * len(z)
  if top_k is not None:
    kth = sorted(z, reverse=True)[min(top_k, len(z)) - 1]
    keep = [k and x >= kth for k, x in zip(keep, z)]

  def probs():
    top = max(x for x, k in zip(z, keep) if k)
    e = [math.exp(x - top) if k else 0.0 for x, k in zip(z, keep)]
    return [v / sum(e) for v in e]

  if top_p is not None and top_p < 1:
    p = probs()
    order = sorted(range(len(z)), key=lambda i: -z[i])
    mass, threshold = 0.0, None
    for i in order:
      if not keep[i]:
        continue
      if mass < top_p:
        threshold = z[i]
      mass += p[i]
    keep = [k and x >= threshold for k, x in zip(keep, z)]
  if min_p is not None:
    p = probs()
    keep = [k and pv >= min_p * max(p) for k, pv in zip(keep, p)]
  return keep


@pytest.mark.parametrize(
  "settings",
  [
    dict(top_k=1),
    dict(top_k=3),
    dict(top_k=50),
    dict(top_p=0.5),
    dict(top_p=0.9),
    dict(top_p=1.0),
    dict(min_p=0.1),
    dict(min_p=0.0),
    dict(top_k=4, top_p=0.8, min_p=0.05),
  ],
)
def test_truncated_logits_match_a_loop_reference(settings):
  z = (
    np.random.default_rng(0).normal(scale=2.0, size=(16, 9)).astype(np.float32)
  )
  got = np.asarray(
    rl.truncated_logits(jnp.asarray(z), rl.Truncation(**settings))
  )
  for row, out in zip(z, got):
    keep = _ref_keep(list(row), **settings)
    np.testing.assert_array_equal(np.isfinite(out), keep)
    np.testing.assert_array_equal(out[keep], row[keep])
    assert any(keep)


def test_ties_at_the_boundary_are_all_kept():
  z = jnp.array([[2.0, 1.0, 1.0, 0.0]])
  np.testing.assert_array_equal(
    jnp.isfinite(rl.truncated_logits(z, rl.Truncation(top_k=2))),
    [[True, True, True, False]],
  )
  p = jax.nn.softmax(z)[0]
  np.testing.assert_array_equal(
    jnp.isfinite(
      rl.truncated_logits(z, rl.Truncation(top_p=float(p[0]) + 1e-3))
    ),
    [[True, True, True, False]],
  )


def test_scored_log_probs_are_the_renormalised_truncated_distribution():
  z = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
  trunc = rl.Truncation(top_p=0.8)
  logp = rl.token_log_probs(
    jnp.repeat(z, 4, 0), jnp.arange(4), truncation=trunc
  )
  np.testing.assert_allclose(np.exp(logp[:2]), [0.625, 0.375], rtol=1e-6)
  assert np.all(np.asarray(logp[2:]) == -np.inf)
  np.testing.assert_allclose(
    rl.token_entropy(z, truncation=trunc),
    [-(0.625 * math.log(0.625) + 0.375 * math.log(0.375))],
    rtol=1e-6,
  )
  assert np.isfinite(rl.token_entropy(z, truncation=rl.Truncation(top_k=1)))


@pytest.mark.parametrize(
  "trunc",
  [
    rl.Truncation(top_k=2),
    rl.Truncation(top_p=0.7),
    rl.Truncation(min_p=0.3),
    rl.Truncation(top_k=3, top_p=0.9),
  ],
)
def test_on_policy_ratio_is_exactly_one_with_the_same_truncation(trunc):
  """A bigram decoder (the same logits for the sampler and the re-scoring):
  every sampled token is in the kept set; recorded and re-scored log-probs
  agree to float rounding (the scan body and the re-scoring are compiled
  apart), so the ratio is 1 to 1e-6, and exactly 1.0 with
  ``old_log_probs=None``. Scored without the truncation (the sampler/trainer
  mismatch) the ratio is < 1 on most tokens, by far more.
  """
  table = jnp.asarray(
    np.random.default_rng(1).normal(size=(6, 6)) * 1.5, jnp.float32
  )
  decoder = lambda tokens: table[tokens]
  temperature = 0.7
  out = rl.sample(
    decoder,
    jnp.zeros((256, 1), jnp.int32),
    max_new_tokens=5,
    seed=0,
    step=1,
    temperature=temperature,
    truncation=trunc,
  )
  logits = table[out.tokens[:, :-1]]
  rescored = rl.token_log_probs(
    logits, out.completions, temperature, truncation=trunc
  )
  np.testing.assert_allclose(rescored, out.log_probs, rtol=0, atol=1e-6)
  assert np.all(np.isfinite(out.log_probs))
  kept = np.isfinite(
    np.asarray(rl.truncated_logits(logits / temperature, trunc))
  )
  assert np.all(
    np.take_along_axis(kept, np.asarray(out.completions)[..., None], -1)
  )
  adv = jnp.asarray(np.random.default_rng(2).normal(size=256), jnp.float32)
  config = rl.Config(beta=0.0)
  _, m = rl.policy_loss(rescored, out.log_probs, adv, out.mask, config=config)
  assert abs(float(m["ratio_min"]) - 1) < 1e-6
  assert abs(float(m["ratio_max"]) - 1) < 1e-6
  _, m = rl.policy_loss(rescored, None, adv, out.mask, config=config)
  assert float(m["ratio_min"]) == float(m["ratio_max"]) == 1.0
  plain = np.asarray(rl.token_log_probs(logits, out.completions, temperature))
  recorded = np.asarray(out.log_probs)
  assert np.all(plain < recorded + 1e-6)
  assert np.mean(plain < recorded - 1e-2) > 0.5


def test_truncated_sampling_frequencies():
  z = jnp.array([2.0, 1.5, 0.5, 0.0, -1.0])
  trunc = rl.Truncation(top_k=3)
  decoder = lambda tokens: jnp.broadcast_to(z, tokens.shape + (5,))
  n = 20000
  out = rl.sample(
    decoder,
    jnp.zeros((n, 1), jnp.int32),
    max_new_tokens=1,
    seed=3,
    step=0,
    truncation=trunc,
  )
  freq = np.bincount(np.asarray(out.completions[:, 0]), minlength=5) / n
  p = np.asarray(jax.nn.softmax(rl.truncated_logits(z, trunc)))
  assert np.all(np.abs(freq - p) < 4 * np.sqrt(p * (1 - p) / n) + 1e-12)
  assert freq[3] == freq[4] == 0


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    (dict(top_k=0), ValueError, "top_k"),
    (dict(top_k=2.0), ValueError, "top_k"),
    (dict(top_p=0.0), ValueError, r"top_p must be None or in \(0, 1\]"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(min_p=-0.1), ValueError, r"min_p must be None or in \[0, 1\]"),
    (dict(min_p="0.1"), TypeError, "min_p"),
  ],
)
def test_truncation_validation(kwargs, error, match):
  with pytest.raises(error, match=match):
    rl.Truncation(**kwargs)


def test_truncation_argument_type():
  with pytest.raises(TypeError, match="Truncation"):
    rl.token_log_probs(
      jnp.zeros((1, 3)), jnp.zeros(1, jnp.int32), truncation={"top_k": 2}
    )
