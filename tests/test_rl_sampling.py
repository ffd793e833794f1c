"""grpo_optax.rl.sample: recorded log-probs, keys from (seed, step), EOS."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_optax import rl

VOCAB, PROMPT, NEW = 6, 2, 4


class TinyDecoder(nnx.Module):
  """Causal by construction: position t sees the mean of embeddings <= t."""

  def __init__(self, *, rngs):
    self.embed = nnx.Embed(VOCAB, 8, rngs=rngs)
    self.pos = nnx.Embed(PROMPT + NEW, 8, rngs=rngs)
    self.out = nnx.Linear(8, VOCAB, rngs=rngs)

  def __call__(self, tokens):
    length = tokens.shape[1]
    x = self.embed(tokens) + self.pos(jnp.arange(length))[None]
    h = jnp.cumsum(x, axis=1) / jnp.arange(1, length + 1)[None, :, None]
    return 3.0 * self.out(jnp.tanh(h))


@pytest.fixture(scope="module")
def model():
  return TinyDecoder(rngs=nnx.Rngs(0))


def _prompts(batch=8):
  return jnp.asarray(
    np.random.default_rng(0).integers(0, VOCAB, (batch, PROMPT))
  )


def test_recorded_log_probs_equal_the_loss_scoring(model):
  """Re-scored by the loss's own function, the ratio is 1."""
  temperature = 0.8

  @nnx.jit
  def sample_and_score(model, prompts):
    samples = rl.sample(
      model,
      prompts,
      max_new_tokens=NEW,
      seed=3,
      step=5,
      temperature=temperature,
      eos_id=5,
    )
    logits = model(samples.tokens)[:, PROMPT - 1 : -1]
    log_probs = rl.token_log_probs(logits, samples.completions, temperature)
    _, metrics = rl.policy_loss(
      log_probs,
      samples.log_probs,
      jnp.ones(samples.mask.shape[0]),
      samples.mask,
      config=rl.Config(beta=0.0),
    )
    return samples, log_probs, metrics

  samples, log_probs, metrics = sample_and_score(model, _prompts())
  mask = np.asarray(samples.mask)
  assert samples.tokens.shape == (8, PROMPT + NEW)
  np.testing.assert_array_equal(samples.tokens[:, :PROMPT], _prompts())
  np.testing.assert_array_equal(samples.tokens[:, PROMPT:], samples.completions)
  np.testing.assert_allclose(
    np.asarray(log_probs)[mask], np.asarray(samples.log_probs)[mask], atol=1e-6
  )
  assert abs(float(metrics["ratio_max"]) - 1) < 1e-6
  assert abs(float(metrics["ratio_min"]) - 1) < 1e-6
  assert np.all(np.asarray(samples.log_probs)[~mask] == 0)
  assert np.all(np.asarray(samples.log_probs)[mask] < 0)


def test_keys_are_a_function_of_seed_and_step(model):
  prompts = _prompts(16)
  draw = nnx.jit(
    lambda model, seed, step: (
      rl.sample(
        model, prompts, max_new_tokens=NEW, seed=seed, step=step
      ).completions
    )
  )
  first = draw(model, 0, 7)
  np.testing.assert_array_equal(draw(model, 0, 7), first)
  assert not np.array_equal(draw(model, 0, 8), first)
  assert not np.array_equal(draw(model, 1, 7), first)
  # Eagerly, with Python ints, the same numbers as traced inside jit.
  np.testing.assert_array_equal(
    rl.sample(model, prompts, max_new_tokens=NEW, seed=0, step=7).completions,
    first,
  )


def test_greedy_equals_a_loop_over_growing_prefixes(model):
  prompts = _prompts()
  got = rl.sample(
    model,
    prompts,
    max_new_tokens=NEW,
    seed=0,
    step=0,
    greedy=True,
    temperature=0.5,
  )
  tokens = np.asarray(prompts)
  log_probs = []
  for _ in range(NEW):  # No padding, no buffer: the plain definition.
    logits = model(jnp.asarray(tokens))[:, -1]
    new = np.argmax(np.asarray(logits), axis=-1)
    log_probs.append(rl.token_log_probs(logits, new, 0.5))
    tokens = np.concatenate([tokens, new[:, None]], axis=1)
  np.testing.assert_array_equal(got.tokens, tokens)
  np.testing.assert_allclose(got.log_probs, np.stack(log_probs, 1), atol=1e-6)


def test_eos_pads_and_masks():
  # A bigram decoder: token 2 is always followed by EOS (3) with p = 1.
  table = jnp.log(
    jnp.array(
      [
        [0.2, 0.2, 0.6, 0.0],
        [0.5, 0.0, 0.5, 0.0],
        [1e-9, 1e-9, 1e-9, 1.0],
        [0.25, 0.25, 0.25, 0.25],
      ]
    )
  )
  decoder = lambda tokens: table[tokens]
  out = rl.sample(
    decoder,
    jnp.zeros((64, 1), jnp.int32),
    max_new_tokens=5,
    seed=0,
    step=0,
    eos_id=3,
    pad_id=1,
  )
  completions, mask = np.asarray(out.completions), np.asarray(out.mask)
  np.testing.assert_array_equal(mask, rl.completion_mask(completions, 3))
  for row, keep, logp in zip(completions, mask, np.asarray(out.log_probs)):
    eos = np.nonzero(row == 3)[0]
    if eos.size:
      assert np.all(row[eos[0] + 1 :] == 1) and keep.sum() == eos[0] + 1
      assert np.all(logp[eos[0] + 1 :] == 0)
  assert (completions == 3).any(axis=1).mean() > 0.5


def test_temperature_shapes_the_sampling_distribution():
  logits = jnp.array([[2.0, 0.0, -1.0, 0.5]])
  decoder = lambda tokens: jnp.broadcast_to(logits, tokens.shape + (4,))
  n, temperature = 20000, 2.0
  out = rl.sample(
    decoder,
    jnp.zeros((n, 1), jnp.int32),
    max_new_tokens=1,
    seed=0,
    step=0,
    temperature=temperature,
  )
  freq = np.bincount(np.asarray(out.completions[:, 0]), minlength=4) / n
  p = np.asarray(jax.nn.softmax(logits[0] / temperature))
  assert np.all(np.abs(freq - p) < 4 * np.sqrt(p * (1 - p) / n))
  np.testing.assert_allclose(
    np.exp(out.log_probs[:, 0]), p[np.asarray(out.completions[:, 0])], rtol=1e-6
  )


def test_bad_input(model):
  good = dict(max_new_tokens=2, seed=0, step=0)
  with pytest.raises(ValueError, match=r"\[B, P\]"):
    rl.sample(model, jnp.zeros(3, jnp.int32), **good)
  with pytest.raises(TypeError, match="integer"):
    rl.sample(model, jnp.zeros((2, 2)), **good)
  with pytest.raises(ValueError, match="max_new_tokens"):
    rl.sample(model, _prompts(), max_new_tokens=0, seed=0, step=0)
  with pytest.raises(ValueError, match="temperature"):
    rl.sample(model, _prompts(), temperature=0.0, **good)
  with pytest.raises(TypeError, match="callable"):
    rl.sample("gpt", _prompts(), **good)
  with pytest.raises(ValueError, match="logits"):
    rl.sample(lambda t: jnp.zeros((2, 3)), _prompts(), **good)


def test_import_grpo_optax_stays_flax_free():
  code = (
    "import sys, grpo_optax; from grpo_optax import rl; "
    "assert grpo_optax.rl is rl and 'rl' in grpo_optax.__all__; "
    "assert not any(m == 'flax' or m.startswith('flax.') "
    "for m in sys.modules), 'flax imported'"
  )
  subprocess.run(
    [sys.executable, "-c", code],
    check=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
