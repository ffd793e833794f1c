"""The defaults study's transformer-shaped tasks: shapes and split (fast);
the models and the tasks' held-out scores (slow: each compiles a model).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import problems
from benchmarks import transformer_tasks as tt


def _leaves(shapes):
  return jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))


@pytest.mark.parametrize("blocks,leaves", [(4, 70), (8, 134)])
def test_gpt_has_a_transformers_leaves(blocks, leaves):
  shapes = tt.gpt_shapes(blocks, 64, 256, 96, 32)
  got = _leaves(shapes)
  assert len(got) == leaves == 16 * blocks + 6
  big = [s for s in got if math.prod(s) >= 1024]
  small = [s for s in got if math.prod(s) < 1024]
  # min_size=1024 masks every matrix and embedding, no bias or norm.
  assert all(len(s) == 2 for s in big) and all(len(s) == 1 for s in small)
  assert len(big) == 6 * blocks + 3  # q, k, v, o, fc1, fc2; 2 embeddings, head
  assert shapes["block_00"]["attn"]["q"]["w"] == (64, 64)
  assert shapes["block_00"]["mlp"]["fc1"]["w"] == (64, 256)


def test_char_corpus_holds_out_every_tenth_chunk():
  train, held, vocab = tt.char_corpus(chunk=1000, hold_every=10)
  text = problems.stdlib_text()
  assert len(train) + len(held) == len(text)
  assert vocab == len(set(text.encode("ascii", "replace")))
  # The held-out split is chunks 9, 19, ... of the text, in order.
  assert held[:1000].tolist() != train[9000:10000].tolist()
  codes = np.frombuffer(text.encode("ascii", "replace"), np.uint8)
  _, ids = np.unique(codes, return_inverse=True)
  np.testing.assert_array_equal(held[:1000], ids[9000:10000])
  np.testing.assert_array_equal(held[1000:2000], ids[19000:20000])
  np.testing.assert_array_equal(train[:9000], ids[:9000])
  np.testing.assert_array_equal(train[9000:9100], ids[10000:10100])


@pytest.mark.slow  # about 4 s on 2 cores: compiles the model
def test_gpt_is_causal_and_starts_near_uniform():
  blocks, vocab = 1, 96
  shapes = tt.gpt_shapes(blocks, 16, 32, vocab, 8)

  @jax.jit
  def run(key):
    params = tt.gpt_init(key, shapes, blocks)
    ids = jax.random.randint(jax.random.key(1), (2, 8), 0, vocab)
    changed = ids.at[:, 5].set((ids[:, 5] + 1) % vocab)
    a = tt.gpt_logits(params, ids, heads=2)
    b = tt.gpt_logits(params, changed, heads=2)
    return params, a, b, -jax.nn.log_softmax(a).mean()

  params, a, b, loss = jax.device_get(run(jax.random.key(0)))
  np.testing.assert_allclose(a[:, :5], b[:, :5], rtol=1e-6, atol=1e-6)
  assert np.max(np.abs(a[:, 5:] - b[:, 5:])) > 1e-4
  # Small initial logits: the first loss is about log(vocab).
  assert abs(float(loss) - math.log(vocab)) < 0.1 * math.log(vocab)
  # Norm scales start at one, biases at zero, residual outputs scaled down.
  blk = params["block_00"]
  np.testing.assert_array_equal(blk["ln1"]["scale"], 1.0)
  np.testing.assert_array_equal(blk["attn"]["q"]["b"], 0.0)
  assert np.std(blk["attn"]["o"]["w"]) < np.std(blk["attn"]["q"]["w"])


@pytest.mark.slow  # about 4 s on 2 cores: compiles the model
def test_gpt_task_scores_the_held_out_split():
  task = tt.gpt(1, width=16, heads=2, mlp=32, context=8, max_eval=4)
  params, state = jax.jit(task.init)(jax.random.key(0))
  batch = jax.jit(task.batch)(jax.random.key(1))
  assert batch.shape == (16, 9) and batch.dtype == jnp.int32
  loss, _ = jax.jit(task.loss)(params, state, batch)
  evaluate = jax.jit(task.evaluate)
  held = evaluate(params, state)["loss"]
  assert np.isfinite(float(loss)) and np.isfinite(float(held))
  # Evaluation is a function of the params only (a fixed held-out set).
  assert float(evaluate(params, state)["loss"]) == float(held)
  assert task.info["leaves"] == 22 and task.lrs == tt.LRS


@pytest.mark.slow  # about 7 s: builds and compiles the NNX model
def test_mlm_task_masks_held_out_windows_once():
  task = tt.mlm(1, hidden=16, heads=2, ffn=32, seq_len=16, max_eval=4)
  params, state = jax.jit(task.init)(jax.random.key(0))
  inputs, positions, targets = jax.jit(task.batch)(jax.random.key(1))
  assert inputs.shape == (8, 16) and positions.shape == targets.shape
  assert positions.shape == (8, 3)  # 15% of 16, rounded up
  # Characters are ids 2.. ([SEP] 0 and [MASK] 1 come first).
  targets = np.asarray(targets)
  assert targets.min() >= 2 and targets.max() < task.info["vocab"]
  evaluate = jax.jit(task.evaluate)
  held = float(evaluate(params, state)["loss"])
  assert held == float(evaluate(params, state)["loss"])
  assert abs(held - math.log(task.info["vocab"])) < 0.2 * held
  assert task.info["heldout_predictions"] == 4 * 3
  assert task.name == "mlm1" and task.vectorize is False
