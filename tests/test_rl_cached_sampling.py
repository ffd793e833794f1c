"""The KV-cached sampler equals the uncached one for the same keys."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from examples.common import decoder as decoder_lib
from grpo_optax import rl

VOCAB, PROMPT, NEW = 11, 5, 7


@pytest.fixture(scope="module")
def model():
  config = decoder_lib.DecoderConfig(
    vocab_size=VOCAB,
    max_length=PROMPT + NEW,
    hidden=32,
    num_layers=2,
    num_heads=4,
    ffn=64,
  )
  return decoder_lib.Decoder(config, rngs=nnx.Rngs(0))


def _prompts(batch=12):
  return jnp.asarray(
    np.random.default_rng(0).integers(0, VOCAB, (batch, PROMPT))
  )


def test_cached_forward_equals_the_full_forward(model):
  """Prefill 3 tokens, then one at a time: the logits of every position."""
  tokens = _prompts()
  full = model(tokens)
  cache = model.init_cache(tokens.shape[0], PROMPT + NEW)
  logits, cache = model(tokens[:, :3], cache=cache, position=0)
  parts = [logits]
  for p in range(3, PROMPT):
    logits, cache = model(tokens[:, p : p + 1], cache=cache, position=p)
    parts.append(logits)
  np.testing.assert_allclose(jnp.concatenate(parts, axis=1), full, atol=2e-5)


@pytest.mark.parametrize(
  "kwargs",
  [
    dict(),
    dict(temperature=0.6, eos_id=3, pad_id=0),
    dict(truncation=rl.Truncation(top_k=4)),
    dict(truncation=rl.Truncation(top_p=0.8, min_p=0.05), temperature=1.3),
    dict(greedy=True),
  ],
)
def test_cached_sampler_equals_the_uncached_sampler(model, kwargs):
  draw = nnx.jit(
    lambda model, prompts, kv: rl.sample(
      model, prompts, max_new_tokens=NEW, seed=4, step=9, kv_cache=kv, **kwargs
    ),
    static_argnums=2,
  )
  cached, uncached = (
    draw(model, _prompts(), True),
    draw(model, _prompts(), False),
  )
  np.testing.assert_array_equal(cached.tokens, uncached.tokens)
  np.testing.assert_array_equal(cached.mask, uncached.mask)
  np.testing.assert_allclose(cached.log_probs, uncached.log_probs, atol=1e-5)
  # The default (None) picks the cache for a model that has one.
  auto = draw(model, _prompts(), None)
  np.testing.assert_array_equal(auto.tokens, cached.tokens)
  np.testing.assert_array_equal(auto.log_probs, cached.log_probs)


class _CachedBigram:
  """The cache protocol on a callable: the cache counts the calls."""

  def __init__(self, table):
    self.table = table

  def init_cache(self, batch_size, max_length):
    return jnp.zeros((batch_size,), jnp.int32)

  def __call__(self, tokens, *, cache=None, position=None):
    logits = self.table[tokens]
    return logits if cache is None else (logits, cache + tokens.shape[1])


def test_cache_protocol_on_a_callable_is_exact():
  table = jnp.asarray(np.random.default_rng(0).normal(size=(5, 5)), jnp.float32)
  model = _CachedBigram(table)
  prompts = jnp.zeros((64, 2), jnp.int32)
  kwargs = dict(
    max_new_tokens=6, seed=0, step=0, truncation=rl.Truncation(top_p=0.9)
  )
  cached = rl.sample(model, prompts, kv_cache=True, **kwargs)
  uncached = rl.sample(model, prompts, kv_cache=False, **kwargs)
  np.testing.assert_array_equal(cached.tokens, uncached.tokens)
  np.testing.assert_array_equal(cached.log_probs, uncached.log_probs)


def test_kv_cache_true_needs_the_protocol():
  with pytest.raises(TypeError, match="init_cache"):
    rl.sample(
      lambda t: jnp.zeros(t.shape + (3,)),
      jnp.zeros((2, 1), jnp.int32),
      max_new_tokens=2,
      seed=0,
      step=0,
      kv_cache=True,
    )


def test_decoder_rejects_a_cache_longer_than_its_positions(model):
  with pytest.raises(ValueError, match="max_length"):
    model.init_cache(2, PROMPT + NEW + 1)
