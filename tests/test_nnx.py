"""Flax NNX: nnx.Optimizer(model, grpo(...), wrt=nnx.Param) with head entropies.

A small attention classifier sows its per-head attention entropy in the
forward pass; the train step turns it into the ``head_entropy`` extra argument
of the optimizer, so the importance stage weights heads by their entropy.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import grpo_optax

HEADS, DIM, SEQ, VOCAB, CLASSES = 4, 32, 8, 16, 2


class Attention(nnx.Module):
  def __init__(self, rngs):
    self.query = nnx.LinearGeneral(DIM, (HEADS, DIM // HEADS), rngs=rngs)
    self.key = nnx.LinearGeneral(DIM, (HEADS, DIM // HEADS), rngs=rngs)
    self.value = nnx.LinearGeneral(DIM, (HEADS, DIM // HEADS), rngs=rngs)
    self.out = nnx.LinearGeneral(
      (HEADS, DIM // HEADS), DIM, axis=(-2, -1), rngs=rngs
    )

  def __call__(self, x):
    q, k, v = self.query(x), self.key(x), self.value(x)  # [B, T, H, D]
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
    probs = jax.nn.softmax(logits, axis=-1)
    entropy = -jnp.sum(probs * jnp.log(probs + 1e-9), axis=-1).mean(axis=(0, 2))
    self.sow(nnx.Intermediate, "head_entropy", entropy)  # [H]
    return self.out(jnp.einsum("bhqk,bkhd->bqhd", probs, v))


class Classifier(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
    self.attn = Attention(rngs)
    self.norm = nnx.LayerNorm(DIM, rngs=rngs)
    self.head = nnx.Linear(DIM, CLASSES, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    x = self.norm(x + self.attn(x))
    return self.head(x.mean(axis=1))


def head_entropy_tree(model, entropy):
  """The ``head_entropy`` extra argument: entropies on the attention kernels."""
  params = nnx.as_pure(nnx.state(model, nnx.Param))

  def leaf(path, x):
    names = [getattr(p, "key", getattr(p, "name", p)) for p in path]
    if "attn" in names and "kernel" in names:
      axis = 0 if "out" in names else 1  # out: [H, D, DIM]; q/k/v: [DIM, H, D]
      return grpo_optax.per_head(entropy, axis=axis, ndim=x.ndim)
    return None

  return jax.tree_util.tree_map_with_path(leaf, params)


def _data():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, VOCAB, size=(128, SEQ))
  labels = (tokens == 3).any(axis=1).astype(np.int32)  # "contains token 3"
  return jnp.asarray(tokens), jnp.asarray(labels)


def test_nnx_optimizer_trains_attention_model_with_head_entropy():
  model = Classifier(nnx.Rngs(0))
  optimizer = nnx.Optimizer(
    model,
    grpo_optax.grpo(3e-3, sparsify="topk", **grpo_optax.ARTICLE_DEFAULTS),
    wrt=nnx.Param,
  )
  tokens, labels = _data()
  seen = []

  @nnx.jit
  def train_step(model, optimizer, tokens, labels):
    def loss_fn(model):
      logits, inter = nnx.capture(model, nnx.Intermediate)(tokens)
      entropy = inter["attn"]["head_entropy"]
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
      return loss.mean(), entropy

    (loss, entropy), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    entropy = jax.lax.stop_gradient(entropy[0])
    optimizer.update(
      model, grads, head_entropy=head_entropy_tree(model, entropy)
    )
    return loss, entropy

  first = None
  for _ in range(80):
    loss, entropy = train_step(model, optimizer, tokens, labels)
    first = float(loss) if first is None else first
    seen.append(np.asarray(entropy))
  assert float(loss) < 0.5 * first, (first, float(loss))
  assert seen[0].shape == (HEADS,)
  assert np.all(seen[-1] > 0)
  # BatchNorm-like statistics are not optimised; the params are
  assert "importance/weights" in grpo_optax.metrics(optimizer.opt_state)


def test_head_entropy_scales_each_heads_update():
  """Through nnx.Optimizer, head h's update is multiplied by e_h / mean(e).

  The importance stage alone (every other stage off), so the update is
  ``-lr * g * w * e / mean(e)`` and the ratio of the two runs' updates is
  exactly the entropy factor per head (Adam after it would cancel most of
  any scale).
  """
  model = Classifier(nnx.Rngs(1))
  tokens, labels = _data()

  def grads_of(model):
    def loss_fn(model):
      logits, _ = nnx.capture(model, nnx.Intermediate)(tokens)
      return optax.softmax_cross_entropy_with_integer_labels(
        logits, labels
      ).mean()

    return nnx.grad(loss_fn)(model)

  g = nnx.jit(grads_of)(model)
  ent = jnp.array([0.5, 1.0, 1.5, 2.0])

  @nnx.jit
  def update(m, opt, g, head_entropy):
    if head_entropy is None:
      opt.update(m, g)
    else:
      opt.update(m, g, head_entropy=head_entropy)

  deltas = []
  for head_entropy in (None, head_entropy_tree(model, ent)):
    m = nnx.clone(model)
    # A large rate: the parameter change is the update to float32 precision.
    tx = grpo_optax.grpo(
      1e5,
      max_norm=None,
      sparsify=None,
      adaptive=False,
      variance_coef=None,
      importance=True,
    )
    opt = nnx.Optimizer(m, tx, wrt=nnx.Param)
    update(m, opt, g, head_entropy)
    deltas.append(
      {
        name: np.asarray(getattr(m.attn, name).kernel[...])
        - np.asarray(getattr(model.attn, name).kernel[...])
        for name in ("query", "out")
      }
      | {
        "head": np.asarray(m.head.kernel[...])
        - np.asarray(model.head.kernel[...])
      }
    )
  plain, weighted = deltas
  factor = np.asarray(ent / ent.mean())
  # atol: the rounding of p + u (|p| < 2) is far below most updates.
  assert np.mean(np.abs(plain["query"]) > 1e-2) > 0.9
  np.testing.assert_allclose(
    weighted["query"],  # [DIM, H, D]
    plain["query"] * factor[None, :, None],
    rtol=1e-4,
    atol=1e-6,
  )
  np.testing.assert_allclose(
    weighted["out"],  # [H, D, DIM]
    plain["out"] * factor[:, None, None],
    rtol=1e-4,
    atol=1e-6,
  )
  np.testing.assert_array_equal(weighted["head"], plain["head"])
