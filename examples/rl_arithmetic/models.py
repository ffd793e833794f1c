"""The addition task and its policy (the KV-cached decoder of examples/common).

Task: add two ``D``-digit numbers (``D = 4`` by default), written as the
columns of a sum on paper: the prompt holds one token per column, the pair of
digits ``(a_i, b_i)`` of place ``i``, least significant first, then ``=``;
the policy writes the ``D + 1`` digits of the sum (zero-padded), least
significant first, then EOS:

  prompt      (a_0 b_0) (a_1 b_1) .. (a_{D-1} b_{D-1})  =      (D + 1 tokens)
  completion  s_0 s_1 .. s_D  EOS                              (D + 2 tokens)

With ``D = 4`` the policy writes 6 tokens. Each digit is a function of its
column, the column before and the digit written before (which tells the
carry), so a small decoder can learn the algorithm; it must still get all 6
tokens right. The reward is 1 for the exact answer, else 0: a uniformly
random policy over the 12 output tokens is rewarded with probability
``12**-(D + 2)``.

Problems are the pairs ``(a, b)``, numbered ``i = a * 10**D + b``. The
held-out problems are those with ``i % HELD_OUT_EVERY == 0``: training never
draws them (neither the warm start nor GRPO).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from examples.common import decoder

EOS, EQUALS = 10, 11
COLUMN_OFFSET = 12  # token of the column (a_i, b_i): 12 + 10 a_i + b_i
VOCAB = COLUMN_OFFSET + 100
OUT_VOCAB = COLUMN_OFFSET  # the policy writes digits, EOS (and "=")
HELD_OUT_EVERY = 50


def prompt_length(num_digits: int) -> int:
  return num_digits + 1


def answer_length(num_digits: int) -> int:
  return num_digits + 2


def _digits(x: np.ndarray, n: int) -> np.ndarray:
  """``[B]`` ints -> ``[B, n]`` digits, least significant first."""
  return (x[:, None] // 10 ** np.arange(n)) % 10


def encode(
  a: np.ndarray, b: np.ndarray, num_digits: int
) -> tuple[np.ndarray, np.ndarray]:
  """Prompts ``[B, D + 1]`` and answers ``[B, D + 2]`` (int32) of ``a + b``."""
  a, b = np.asarray(a, np.int64), np.asarray(b, np.int64)
  n = len(a)
  columns = COLUMN_OFFSET + 10 * _digits(a, num_digits) + _digits(b, num_digits)
  prompts = np.concatenate([columns, np.full((n, 1), EQUALS)], axis=1)
  answers = np.concatenate(
    [_digits(a + b, num_digits + 1), np.full((n, 1), EOS)], axis=1
  )
  return prompts.astype(np.int32), answers.astype(np.int32)


def train_problems(
  rng: np.random.Generator, n: int, num_digits: int
) -> tuple[np.ndarray, np.ndarray]:
  """``n`` random training problems ``(a, b)`` (never a held-out one)."""
  space = 10 ** (2 * num_digits)
  i = rng.integers(0, space, n)
  i = np.where(i % HELD_OUT_EVERY == 0, (i + 1) % space, i)
  return i // 10**num_digits, i % 10**num_digits


def held_out_problems(
  n: int, num_digits: int, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
  """``n`` held-out problems, a fixed function of ``seed``."""
  space = 10 ** (2 * num_digits)
  rng = np.random.default_rng((seed, 7))
  i = rng.integers(0, space // HELD_OUT_EVERY, n) * HELD_OUT_EVERY
  return i // 10**num_digits, i % 10**num_digits


def rewards(answers: jnp.ndarray, completions: jnp.ndarray) -> jnp.ndarray:
  """1.0 where the completion is exactly the answer (digits and EOS)."""
  return jnp.all(completions == answers, axis=-1).astype(jnp.float32)


def policy_config(
  num_digits: int, *, hidden: int, num_layers: int, num_heads: int, ffn: int
) -> decoder.DecoderConfig:
  return decoder.DecoderConfig(
    vocab_size=VOCAB,
    max_length=prompt_length(num_digits) + answer_length(num_digits),
    hidden=hidden,
    num_layers=num_layers,
    num_heads=num_heads,
    ffn=ffn,
    out_vocab=OUT_VOCAB,
  )
