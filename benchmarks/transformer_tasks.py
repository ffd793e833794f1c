"""Transformer-shaped tasks of the defaults study, scored on held-out loss.

The convergence suite (:mod:`benchmarks.problems`) is small models where the
preset's mask rarely applies (most leaves are under ``min_size=1,024``
entries). These tasks have a transformer's parameter tree: token and position
embeddings, per block separate attention q/k/v/o projections with biases, an
MLP, two layer norms; matrices of 4,096 entries and more (so ``min_size=1024``
masks them), vectors of 64-256 (so it does not). Nothing is downloaded:

* ``gpt4`` -- a decoder-only, pre-norm, causal character-level LM in plain
  JAX: 4 blocks, width 64, 4 heads, MLP 256, context 32, learned positions,
  an untied output layer; 70 leaves, 214,496 parameters for the 96-symbol
  vocabulary of the corpus below. Data: the source text of the five
  standard-library modules of ``charlm`` (228k characters, ships with
  Python), cut into 2,048-character chunks of which every tenth is held out
  (205,388 train / 22,528 held-out characters). Batch 16 windows of 33
  characters; the loss is the mean next-character cross-entropy over every
  position. Held-out: 256 fixed windows of the held-out chunks (8,192
  predictions).
* ``gpt8`` -- the same at 8 blocks: 134 leaves, 414,432 parameters.
* ``mlm4`` -- the BERT example's encoder (``examples.bert_mlm``: 3-D
  attention kernels, ``nnx.LinearGeneral``) at 4 layers, width 64, 4 heads,
  MLP 256, on the same characters (98 ids with ``[SEP]`` and ``[MASK]``):
  batch 8 windows of 64 with BERT masking (10 positions each); 70 leaves,
  216,802 parameters. Held-out: the MLM loss of 256 held-out windows masked
  once with a fixed key (2,560 predictions).

Budgets (:data:`STEPS`): 400 steps each (``quick``: 200); the study's
sweep is 4 learning rates (:data:`LRS`) x 3 seeds. The metric is the
held-out loss after the last step (``Task.evaluate``'s ``"loss"``). Each task
compiles one program per optimizer (``vectorize=False``: a learning rate is a
traced argument, so the 12 runs of a sweep reuse it).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import problems as problems_lib

# Held-out split of the character corpus: chunk i is held out if i % 10 == 9.
CHUNK = 2048
HOLD_EVERY = 10
STEPS = 400
# The learning rates of the study (the 1-3-10 ladder around Adam's usual
# best for small transformers at a constant rate).
LRS = (3e-4, 1e-3, 3e-3, 1e-2)


def gpt_shapes(
  blocks: int, width: int, mlp: int, vocab: int, context: int
) -> dict:
  """The decoder's parameter shapes: 16 leaves a block plus 6.

  Per block: ``ln1``/``ln2`` (scale, bias), ``attn`` q/k/v/o (``w`` [d, d],
  ``b`` [d]), ``mlp`` fc1 (``w`` [d, mlp], ``b``) and fc2 (``w`` [mlp, d],
  ``b``); then ``tok_embed`` [vocab, d], ``pos_embed`` [context, d],
  ``ln_f`` and ``head`` (``w`` [d, vocab], ``b`` [vocab]).
  """
  d = width
  norm = {"scale": (d,), "bias": (d,)}
  dense = lambda n_in, n_out: {"w": (n_in, n_out), "b": (n_out,)}
  shapes: dict = {"tok_embed": (vocab, d), "pos_embed": (context, d)}
  for i in range(blocks):
    shapes[f"block_{i:02d}"] = {
      "ln1": dict(norm),
      "attn": {name: dense(d, d) for name in ("q", "k", "v", "o")},
      "ln2": dict(norm),
      "mlp": {"fc1": dense(d, mlp), "fc2": dense(mlp, d)},
    }
  shapes["ln_f"] = dict(norm)
  shapes["head"] = dense(d, vocab)
  return shapes


def _is_shape(x) -> bool:
  return isinstance(x, tuple)


def gpt_init(key: jax.Array, shapes: Mapping, blocks: int) -> dict:
  """GPT-2's initialisation: N(0, 0.02) matrices and embeddings (the
  residual outputs ``o`` and ``fc2`` scaled by ``1/sqrt(2 blocks)``), zero
  biases, unit norm scales.
  """
  paths, treedef = jax.tree_util.tree_flatten_with_path(
    shapes, is_leaf=_is_shape
  )
  keys = jax.random.split(key, len(paths))
  out = []
  for (path, shape), k in zip(paths, keys):
    names = [getattr(p, "key", "") for p in path]
    if names[-1] == "scale":
      out.append(jnp.ones(shape))
    elif names[-1] == "bias" or (names[-1] == "b" and len(shape) == 1):
      out.append(jnp.zeros(shape))
    else:
      residual = len(names) > 1 and names[-2] in ("o", "fc2")
      std = 0.02 / (np.sqrt(2 * blocks) if residual else 1)
      out.append(std * jax.random.normal(k, shape))
  return treedef.unflatten(out)


def _layer_norm(p, x, eps=1e-5):
  mean = x.mean(-1, keepdims=True)
  var = jnp.square(x - mean).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def _dense(p, x):
  return x @ p["w"] + p["b"]


def gpt_logits(params: Mapping, ids: jax.Array, heads: int) -> jax.Array:
  """Causal pre-norm decoder: ``ids`` [B, T] -> logits [B, T, vocab]."""
  _, t = ids.shape
  x = params["tok_embed"][ids] + params["pos_embed"][:t]
  d = x.shape[-1]
  causal = jnp.tril(jnp.ones((t, t), bool))
  for name in sorted(k for k in params if k.startswith("block_")):
    blk = params[name]
    h = _layer_norm(blk["ln1"], x)
    q, k, v = (
      _dense(blk["attn"][n], h).reshape(*h.shape[:2], heads, d // heads)
      for n in ("q", "k", "v")
    )
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads)
    a = jax.nn.softmax(jnp.where(causal, s, -1e9), axis=-1)
    y = jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(h.shape)
    x = x + _dense(blk["attn"]["o"], y)
    h = _layer_norm(blk["ln2"], x)
    x = x + _dense(blk["mlp"]["fc2"], jax.nn.gelu(_dense(blk["mlp"]["fc1"], h)))
  return _dense(params["head"], _layer_norm(params["ln_f"], x))


def char_corpus(
  chunk: int = CHUNK, hold_every: int = HOLD_EVERY
) -> tuple[np.ndarray, np.ndarray, int]:
  """``(train ids, held-out ids, vocab)`` of the standard-library text.

  The text is cut into ``chunk``-character pieces; piece ``i`` is held out
  when ``i % hold_every == hold_every - 1`` (interleaved, so both splits
  cover every module); each split is its pieces joined in order.
  """
  text = problems_lib.stdlib_text()
  codes = np.frombuffer(text.encode("ascii", "replace"), np.uint8)
  vocab, ids = np.unique(codes, return_inverse=True)
  ids = ids.astype(np.int32)
  pieces = [ids[i : i + chunk] for i in range(0, len(ids), chunk)]
  held = [p for i, p in enumerate(pieces) if i % hold_every == hold_every - 1]
  train = [p for i, p in enumerate(pieces) if i % hold_every != hold_every - 1]
  return np.concatenate(train), np.concatenate(held), len(vocab)


def gpt(
  blocks: int = 4,
  *,
  steps: int = STEPS,
  width: int = 64,
  heads: int = 4,
  mlp: int = 256,
  context: int = 32,
  batch_size: int = 16,
  max_eval: int = 256,
) -> problems_lib.Task:
  """A decoder-only character LM with ``blocks`` blocks (see the module)."""
  train_np, held_np, vocab = char_corpus()
  train = jnp.asarray(train_np)
  n_eval = min(max_eval, len(held_np) // (context + 1))
  held = jnp.asarray(
    held_np[: n_eval * (context + 1)].reshape(n_eval, context + 1)
  )
  shapes = gpt_shapes(blocks, width, mlp, vocab, context)

  def nll(params, windows):
    logits = gpt_logits(params, windows[:, :-1], heads)
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, windows[:, 1:]
    ).mean()

  def batch(key):
    start = jax.random.randint(
      key, (batch_size,), 0, train.shape[0] - context - 1
    )
    return train[start[:, None] + jnp.arange(context + 1)]

  n_params = sum(int(np.prod(s)) for s in jax.tree.leaves(shapes, _is_shape))
  return problems_lib.Task(
    name=f"gpt{blocks}",
    description=(
      f"decoder-only char LM, {blocks} blocks, width {width}, {heads} heads, "
      f"MLP {mlp}, context {context} ({n_params:,} parameters, "
      f"{len(jax.tree.leaves(shapes, _is_shape))} leaves) on the stdlib "
      f"text ({len(train_np):,} train / {len(held_np):,} held-out "
      f"characters), batch {batch_size}"
    ),
    init=lambda key: (gpt_init(key, shapes, blocks), None),
    loss=lambda p, s, b: (nll(p, b), s),
    batch=batch,
    steps=steps,
    quick_steps=steps // 2,
    lrs=LRS,
    evaluate=lambda p, s: {"loss": nll(p, held)},
    eval_every=100,
    vectorize=False,
    seeds=3,
    quick_seeds=3,
    info={
      "parameters": n_params,
      "leaves": len(jax.tree.leaves(shapes, _is_shape)),
      "vocab": vocab,
      "heldout_predictions": n_eval * context,
    },
  )


def mlm(
  layers: int = 4,
  *,
  steps: int = STEPS,
  hidden: int = 64,
  heads: int = 4,
  ffn: int = 256,
  seq_len: int = 64,
  batch_size: int = 8,
  max_eval: int = 256,
) -> problems_lib.Task:
  """The BERT example's MLM encoder on the character corpus (see the module).

  Ids 0 and 1 are the example's ``[SEP]`` and ``[MASK]``; characters follow.
  A batch is ``batch_size`` windows of ``seq_len`` training characters with
  the example's BERT masking (``input_pipeline.mask_tokens``: 15% of the
  positions, 80% of them ``[MASK]``, 10% a random character, 10% kept);
  the held-out set is ``max_eval`` windows of the held-out chunks, masked
  once with a fixed key.
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from examples.bert_mlm import input_pipeline  # pylint: disable=g-import-not-at-top
  from examples.bert_mlm import models  # pylint: disable=g-import-not-at-top

  special = len(input_pipeline.SPECIAL_TOKENS)
  train_np, held_np, chars = char_corpus()
  vocab = chars + special
  train = jnp.asarray(train_np + special)
  n_eval = min(max_eval, len(held_np) // seq_len)
  held = jnp.asarray(held_np[: n_eval * seq_len] + special).reshape(
    n_eval, seq_len
  )
  config = models.BertConfig(
    vocab_size=vocab,
    max_len=seq_len,
    hidden=hidden,
    num_layers=layers,
    num_heads=heads,
    ffn=ffn,
  )
  init, module = problems_lib._nnx_functional(  # pylint: disable=protected-access
    lambda rngs: models.BertMLM(config, rngs=rngs), (nnx.Param,)
  )
  masks = lambda key, tokens: input_pipeline.mask_tokens(
    key,
    tokens,
    num_predictions=input_pipeline.num_predictions(seq_len, 0.15),
    vocab_size=vocab,
  )
  held_inputs = masks(jax.random.key(12345), held)

  def nll(params, inputs, positions, targets):
    logits = module(params).apply_with_entropy(inputs, positions=positions)[0]
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, targets
    ).mean()

  def batch(key):
    k_start, k_mask = jax.random.split(key)
    start = jax.random.randint(
      k_start, (batch_size,), 0, train.shape[0] - seq_len
    )
    return masks(k_mask, train[start[:, None] + jnp.arange(seq_len)])

  leaves = jax.tree.leaves(jax.eval_shape(lambda: init(jax.random.key(0))))
  n_params = sum(x.size for x in leaves)
  return problems_lib.Task(
    name=f"mlm{layers}",
    description=(
      f"BERT MLM of examples/bert_mlm, {layers} layers, hidden {hidden}, "
      f"{heads} heads, ffn {ffn} ({n_params:,} parameters, {len(leaves)} "
      f"leaves) on the stdlib text as characters ({vocab} ids), windows of "
      f"{seq_len}, BERT masking, batch {batch_size}"
    ),
    init=lambda key: (init(key), None),
    loss=lambda p, s, b: (nll(p[0], *b), s),
    batch=batch,
    steps=steps,
    quick_steps=steps // 2,
    lrs=LRS,
    evaluate=lambda p, s: {"loss": nll(p[0], *held_inputs)},
    eval_every=100,
    vectorize=False,
    seeds=3,
    quick_seeds=3,
    info={
      "parameters": n_params,
      "leaves": len(leaves),
      "vocab": vocab,
      "heldout_predictions": int(held_inputs[1].size),
    },
  )


TASKS = {
  "gpt4": lambda: gpt(4),
  "gpt8": lambda: gpt(8),
  "mlm4": lambda: mlm(4),
}
