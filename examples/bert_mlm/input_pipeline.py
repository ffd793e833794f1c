"""Text for masked-language modelling: corpus, tokenizer, packed sequences, masks.

The default corpus is the CPython documentation that ships with every Python
(``pydoc_data.topics.topics``), so nothing is downloaded. The text is split
into paragraphs; a fixed 10% of them (seed 0) is held out. A byte-level BPE
tokenizer (Hugging Face ``tokenizers``) is trained on the training paragraphs
in a second or two, and each split is encoded into one token stream that is
cut into fixed-length sequences (no padding).
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np

SPECIAL_TOKENS = ("[SEP]", "[MASK]")  # Ids 0 and 1.
SEP_ID, MASK_ID = 0, 1


@dataclasses.dataclass(frozen=True)
class TextData:
  """Packed token sequences and what the report needs about them."""

  train: np.ndarray  # int32 [N_train, seq_len]
  eval: np.ndarray  # int32 [N_eval, seq_len]
  vocab_size: int
  unigram_entropy: float  # Nats per held-out token under the train unigram.
  tokenizer: object  # tokenizers.Tokenizer


def load_documents(text_files: list[str] | None = None) -> list[str]:
  """The default corpus (CPython's pydoc topics) or the given text files."""
  if not text_files:
    from pydoc_data import topics  # pylint: disable=g-import-not-at-top

    return [topics.topics[name] for name in sorted(topics.topics)]
  documents = []
  for path in text_files:
    with open(path, encoding="utf-8", errors="replace") as f:
      documents.append(f.read())
  return documents


def split_paragraphs(
  documents: list[str], *, held_out: float = 0.1, seed: int = 0
) -> tuple[list[str], list[str]]:
  """Splits documents at blank lines; holds out a fixed random ``held_out``
  fraction of the paragraphs (each split keeps the original order).
  """
  paragraphs = [
    p.strip()
    for doc in documents
    for p in re.split(r"\n\s*\n", doc)
    if p.strip()
  ]
  if len(paragraphs) < 2:
    raise ValueError(
      "the corpus needs at least two paragraphs (blank-line "
      "separated) to hold one out."
    )
  num_held_out = max(1, round(held_out * len(paragraphs)))
  held = set(
    np.random.default_rng(seed)
    .permutation(len(paragraphs))[:num_held_out]
    .tolist()
  )
  train = [p for i, p in enumerate(paragraphs) if i not in held]
  evaluation = [p for i, p in enumerate(paragraphs) if i in held]
  return train, evaluation


def train_tokenizer(texts: list[str], vocab_size: int):
  """Trains a byte-level BPE tokenizer (no unknown tokens) on ``texts``."""
  import tokenizers  # pylint: disable=g-import-not-at-top

  pre_tokenizers = tokenizers.pre_tokenizers
  tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
    vocab_size=vocab_size,
    special_tokens=list(SPECIAL_TOKENS),
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tokenizer.train_from_iterator(texts, trainer=trainer)
  assert tokenizer.token_to_id("[SEP]") == SEP_ID
  assert tokenizer.token_to_id("[MASK]") == MASK_ID
  return tokenizer


def encode_and_pack(
  tokenizer, paragraphs: list[str], seq_len: int, limit: int | None = None
) -> np.ndarray:
  """Encodes paragraphs into one stream (``[SEP]`` between paragraphs) and
  cuts it into ``[N, seq_len]`` sequences, dropping the incomplete tail.
  """
  stream = []
  for encoding in tokenizer.encode_batch(paragraphs):
    stream.extend(encoding.ids)
    stream.append(SEP_ID)
  num = len(stream) // seq_len
  if limit is not None:
    num = min(num, limit)
  if num == 0:
    raise ValueError(
      f"not enough text for one sequence of {seq_len} tokens "
      f"({len(stream)} tokens)."
    )
  return np.asarray(stream[: num * seq_len], np.int32).reshape(num, seq_len)


def unigram_entropy(
  train: np.ndarray, evaluation: np.ndarray, vocab_size: int
) -> float:
  """Cross-entropy (nats/token) of the held-out tokens under the training
  split's unigram distribution, add-one smoothed over the non-special vocab.

  This is the loss of the best context-free predictor one can estimate from
  the training data; a masked LM that uses context must go below it.
  """
  counts = np.bincount(train.ravel(), minlength=vocab_size).astype(np.float64)
  counts[MASK_ID] = 0.0  # Never a target.
  counts[len(SPECIAL_TOKENS) :] += 1.0
  counts[SEP_ID] += 1.0
  log_q = np.log(np.maximum(counts, 1e-300) / counts.sum())
  return float(-log_q[evaluation.ravel()].mean())


def load(
  *,
  text_files: list[str] | None,
  vocab_size: int,
  seq_len: int,
  max_train: int | None = None,
  max_eval: int | None = None,
) -> TextData:
  """Corpus -> paragraphs -> tokenizer -> packed train/held-out sequences."""
  train_text, eval_text = split_paragraphs(load_documents(text_files))
  tokenizer = train_tokenizer(train_text, vocab_size)
  train = encode_and_pack(tokenizer, train_text, seq_len, max_train)
  evaluation = encode_and_pack(tokenizer, eval_text, seq_len, max_eval)
  # The trained vocabulary can be smaller than asked for on tiny corpora.
  actual_vocab = tokenizer.get_vocab_size()
  return TextData(
    train,
    evaluation,
    actual_vocab,
    unigram_entropy(train, evaluation, actual_vocab),
    tokenizer,
  )


def num_predictions(seq_len: int, mask_rate: float) -> int:
  """Masked positions per sequence (fixed, so shapes are static)."""
  return max(1, min(seq_len, math.ceil(mask_rate * seq_len)))


def mask_tokens(
  key: jax.Array, tokens: jax.Array, *, num_predictions: int, vocab_size: int
):
  """BERT masking of exactly ``num_predictions`` positions per sequence.

  Of the chosen positions, 80% become ``[MASK]``, 10% a random non-special
  token and 10% stay unchanged (Devlin et al., 2019). Jittable; a function of
  ``key`` only, so the masks follow the step's key.

  Returns:
    ``(inputs [B,T], positions [B,P], targets [B,P])``.
  """
  k_pos, k_kind, k_rand = jax.random.split(key, 3)
  batch = tokens.shape[0]
  _, positions = jax.lax.top_k(
    jax.random.uniform(k_pos, tokens.shape), num_predictions
  )
  targets = jnp.take_along_axis(tokens, positions, axis=1)
  kind = jax.random.uniform(k_kind, positions.shape)
  random_tokens = jax.random.randint(
    k_rand, positions.shape, len(SPECIAL_TOKENS), vocab_size
  )
  replacement = jnp.where(
    kind < 0.8, MASK_ID, jnp.where(kind < 0.9, random_tokens, targets)
  )
  rows = jnp.arange(batch)[:, None]
  inputs = tokens.at[rows, positions].set(replacement.astype(tokens.dtype))
  return inputs, positions, targets
