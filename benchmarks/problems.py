"""The tasks of the convergence suite, as pure JAX functions.

Every :class:`Task` is a training problem with a fixed step budget and a fixed
learning-rate sweep shared by every optimizer. The training loop lives in
:func:`make_sweep`: one ``jax.lax.scan`` over the steps, ``vmap``-ed over seeds
and over learning rates, so a task's whole sweep for one optimizer is one
compiled program. A seed fixes the initialisation and the data order, so
every optimizer and every learning rate sees the same batches.

Tasks (sizes chosen for 2 CPU cores; ``quick`` budgets are half):

* ``linreg`` -- ill-conditioned linear regression: 1,024 examples with 50
  features whose covariance has eigenvalues log-spaced over four decades
  (condition 10,000), rotated; targets from a random linear teacher plus
  N(0, 0.01^2) noise; batch 32; 500 steps.
* ``teacher`` -- teacher-student MLP: a random 20-32-1 tanh teacher, a 20-64-1
  tanh student, fresh N(0, I) inputs every step, batch 64, squared error;
  1,500 steps.
* ``logistic`` -- logistic regression on scikit-learn's breast-cancer data
  (455 train / 114 held-out, standardised), batch 32; 600 steps.
* ``matfac`` -- matrix factorisation: a 100 x 80 matrix of rank 5 plus noise,
  fitted as ``U V^T`` with rank 10 on a fixed half of its entries, full
  batch; 1,000 steps.
* ``autoencoder`` -- a 64-32-8-32-64 tanh autoencoder on scikit-learn's 8x8
  digits (1,437 images), batch 64; 1,000 steps.
* ``charlm`` -- character-level MLP language model (context 16 characters,
  embedding 16, hidden 256) on the source text of five standard-library
  modules (it ships with Python), batch 64; 600 steps.
* ``rosenbrock`` -- the 10-D extended Rosenbrock function from the classic
  start (-1.2, 1, -1.2, 1, ...) plus N(0, 0.1^2), with N(0, 10^2) noise added
  to each gradient coordinate (the loss itself is exact); 1,000 steps.
* ``resnet`` -- the ResNet example's model (``examples.resnet_cifar10``:
  ResNet-8, 16/32/64 channels, BatchNorm) on scikit-learn's digits, batch 16;
  200 steps; held-out accuracy every 20 steps. 3 seeds.
* ``bert`` -- the BERT example's model and data (``examples.bert_mlm``: 2
  layers, hidden 64, 2 heads, ffn 128, BPE vocabulary 512 trained on
  CPython's pydoc topics, sequences of 32 tokens, BERT masking), batch 16;
  300 steps; held-out MLM loss every 50 steps. 3 seeds.

The other tasks run 5 seeds. Each task's learning-rate sweep is a window of
the 1-3-10 ladder wide enough that every optimizer's best is interior
(checked by :mod:`benchmarks.convergence`).

The metric of the suite is the training loss (the loss of each step's batch,
before the update); the held-out metrics are for the claims table.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import math
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

Params = Any
ModelState = Any
Batch = Any

# Half-decade steps (x3, x3.33): the sweep every task uses, cut to a window.
_LADDER = tuple(m * 10.0**e for e in range(-5, 2) for m in (1.0, 3.0))


def lr_window(low: float, high: float) -> tuple[float, ...]:
  """The values of the 1-3-10 ladder in ``[low, high]``."""
  return tuple(
    float(f"{x:.0e}") for x in _LADDER if low * 0.999 <= x <= high * 1.001
  )


@dataclasses.dataclass(frozen=True)
class Task:
  """A training problem and its budget.

  Attributes:
    name: short identifier.
    description: one line for the report.
    init: ``key -> (params, model_state)``; ``model_state`` holds what is not
      trained by the optimizer (BatchNorm statistics) or None.
    loss: ``(params, model_state, batch) -> (loss, model_state)``.
    batch: ``key -> batch`` (jittable; the key is a function of seed and step).
    steps: step budget of the full run.
    quick_steps: step budget of ``--quick``.
    lrs: the learning-rate sweep, shared by every optimizer.
    evaluate: optional ``(params, model_state) -> dict`` of held-out metrics.
    eval_every: steps between evaluations (the last step is always evaluated).
    heldout_target: optional ``(metric, "min"|"max", value)`` for steps to
      target on the held-out metric.
    vectorize: run the sweep as one ``vmap``-ed program (see
      :func:`make_sweep`).
    seeds: number of seeds of the full run (seeds 0, 1, ...).
    quick_seeds: number of seeds of ``--quick``.
    info: extra facts for the report (sizes, data).
  """

  name: str
  description: str
  init: Callable[[jax.Array], tuple[Params, ModelState]]
  loss: Callable[[Params, ModelState, Batch], tuple[jax.Array, ModelState]]
  batch: Callable[[jax.Array], Batch]
  steps: int
  quick_steps: int
  lrs: tuple[float, ...]
  evaluate: Callable[[Params, ModelState], dict[str, jax.Array]] | None = None
  eval_every: int = 0
  heldout_target: tuple[str, str, float] | None = None
  vectorize: bool = True
  seeds: int = 5
  quick_seeds: int = 3
  info: dict[str, Any] = dataclasses.field(default_factory=dict)


def _stateless(loss):
  """Lifts ``(params, batch) -> loss`` to the task signature."""
  return lambda params, state, batch: (loss(params, batch), state)


def _minibatch(data: Sequence[jax.Array], batch_size: int):
  """``key -> tuple of rows`` drawn uniformly with replacement."""
  n = data[0].shape[0]

  def batch(key):
    idx = jax.random.randint(key, (batch_size,), 0, n)
    return tuple(d[idx] for d in data)

  return batch


def _dense_init(key, n_in, n_out, gain=1.0):
  w = jax.random.normal(key, (n_in, n_out)) * gain / np.sqrt(n_in)
  return {"w": w, "b": jnp.zeros((n_out,))}


def _dense(p, x):
  return x @ p["w"] + p["b"]


# ---------------------------------------------------------------- tasks


def linreg(
  steps: int = 500,
  dim: int = 50,
  n: int = 1024,
  condition: float = 1e4,
  noise: float = 0.01,
  batch_size: int = 32,
) -> Task:
  """Ill-conditioned linear regression (squared error / 2)."""
  rng = np.random.default_rng(1234)
  q, _ = np.linalg.qr(rng.normal(size=(dim, dim)))
  scales = np.logspace(0.0, -0.5 * np.log10(condition), dim)
  x = (rng.normal(size=(n, dim)) * scales) @ q.T
  w_true = rng.normal(size=dim) / np.sqrt(np.mean(scales**2) * dim)
  y = x @ w_true + noise * rng.normal(size=n)
  data = (jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32))

  def loss(w, batch):
    xb, yb = batch
    return 0.5 * jnp.mean(jnp.square(xb @ w["w"] + w["b"] - yb))

  return Task(
    name="linreg",
    description=(
      f"linear regression, {n} examples x {dim} features, "
      f"feature covariance condition {condition:g} (rotated), "
      f"label noise {noise:g}, batch {batch_size}"
    ),
    init=lambda key: ({"w": jnp.zeros((dim,)), "b": jnp.zeros(())}, None),
    loss=_stateless(loss),
    batch=_minibatch(data, batch_size),
    steps=steps,
    quick_steps=steps // 2,
    lrs=lr_window(1e-4, 1.0),
    info={"noise_floor": 0.5 * noise**2},
  )


def teacher_student(
  steps: int = 1500,
  dim: int = 20,
  teacher_width: int = 32,
  student_width: int = 64,
  batch_size: int = 64,
) -> Task:
  """A tanh MLP student fitting a fixed random tanh MLP teacher."""
  k1, k2 = jax.random.split(jax.random.key(4321))
  teacher = {
    "l1": _dense_init(k1, dim, teacher_width, gain=2.0),
    "l2": _dense_init(k2, teacher_width, 1),
  }

  def mlp(p, x):
    return _dense(p["l2"], jnp.tanh(_dense(p["l1"], x)))[..., 0]

  def batch(key):
    x = jax.random.normal(key, (batch_size, dim))
    return x, mlp(teacher, x)

  def init(key):
    ka, kb = jax.random.split(key)
    return {
      "l1": _dense_init(ka, dim, student_width),
      "l2": _dense_init(kb, student_width, 1),
    }, None

  def loss(p, b):
    x, y = b
    return 0.5 * jnp.mean(jnp.square(mlp(p, x) - y))

  return Task(
    name="teacher",
    description=(
      f"teacher-student MLP: {dim}-{teacher_width}-1 tanh "
      f"teacher, {dim}-{student_width}-1 tanh student, fresh "
      f"Gaussian inputs, batch {batch_size}"
    ),
    init=init,
    loss=_stateless(loss),
    batch=batch,
    steps=steps,
    quick_steps=steps // 2,
    lrs=lr_window(1e-4, 1.0),
  )


def _breast_cancer():
  from sklearn import datasets  # pylint: disable=g-import-not-at-top
  from sklearn import model_selection  # pylint: disable=g-import-not-at-top

  x, y = datasets.load_breast_cancer(return_X_y=True)
  x_tr, x_te, y_tr, y_te = model_selection.train_test_split(
    x, y, test_size=0.2, random_state=0, stratify=y
  )
  mean, std = x_tr.mean(0), x_tr.std(0) + 1e-8
  to = lambda a: jnp.asarray(a, jnp.float32)
  return (to((x_tr - mean) / std), to(y_tr), to((x_te - mean) / std), to(y_te))


def logistic(steps: int = 600, batch_size: int = 32) -> Task:
  """Logistic regression on breast-cancer."""
  x_tr, y_tr, x_te, y_te = _breast_cancer()

  def nll(p, x, y):
    return jnp.mean(optax.sigmoid_binary_cross_entropy(x @ p["w"] + p["b"], y))

  def evaluate(p, state):
    del state
    logits = x_te @ p["w"] + p["b"]
    return {
      "accuracy": jnp.mean((logits > 0) == (y_te > 0.5)),
      "loss": nll(p, x_te, y_te),
    }

  return Task(
    name="logistic",
    description=(
      f"logistic regression, breast-cancer ({x_tr.shape[0]} "
      f"train / {x_te.shape[0]} held-out, 30 features), batch "
      f"{batch_size}"
    ),
    init=lambda key: (
      {"w": 0.01 * jax.random.normal(key, (30,)), "b": jnp.zeros(())},
      None,
    ),
    loss=_stateless(lambda p, b: nll(p, *b)),
    batch=_minibatch((x_tr, y_tr), batch_size),
    steps=steps,
    quick_steps=steps // 2,
    lrs=lr_window(1e-4, 1.0),
    evaluate=evaluate,
    eval_every=20,
    heldout_target=("accuracy", "max", 0.95),
  )


def matrix_factorisation(
  steps: int = 1000,
  rows: int = 100,
  cols: int = 80,
  rank: int = 5,
  model_rank: int = 10,
  noise: float = 0.1,
  observed: float = 0.5,
) -> Task:
  """Low-rank factorisation ``U V^T`` of a partly observed matrix."""
  rng = np.random.default_rng(99)
  m = (
    rng.normal(size=(rows, rank))
    @ rng.normal(size=(rank, cols))
    / np.sqrt(rank)
  )
  m = m + noise * rng.normal(size=m.shape)
  mask = rng.random(m.shape) < observed
  m, mask = jnp.asarray(m, jnp.float32), jnp.asarray(mask, jnp.float32)

  def init(key):
    ku, kv = jax.random.split(key)
    return {
      "u": 0.1 * jax.random.normal(ku, (rows, model_rank)),
      "v": 0.1 * jax.random.normal(kv, (cols, model_rank)),
    }, None

  def loss(p, batch):
    del batch
    r = (p["u"] @ p["v"].T - m) * mask
    return 0.5 * jnp.sum(r * r) / rows  # Squared error per row.

  return Task(
    name="matfac",
    description=(
      f"matrix factorisation: {rows}x{cols} matrix of rank "
      f"{rank} + noise {noise:g}, {observed:.0%} of entries "
      f"observed, fitted as U V^T with rank {model_rank}, full "
      "batch"
    ),
    init=init,
    loss=_stateless(loss),
    batch=lambda key: None,
    steps=steps,
    quick_steps=steps // 2,
    lrs=lr_window(1e-4, 10.0),
  )


def _digits():
  from sklearn import datasets  # pylint: disable=g-import-not-at-top
  from sklearn import model_selection  # pylint: disable=g-import-not-at-top

  digits = datasets.load_digits()
  x = (digits.data / 16.0).astype(np.float32)
  x_tr, _ = model_selection.train_test_split(
    x, test_size=0.2, random_state=0, stratify=digits.target
  )
  return jnp.asarray(x_tr)


def autoencoder(
  steps: int = 1000,
  batch_size: int = 64,
  widths: Sequence[int] = (64, 32, 8, 32, 64),
) -> Task:
  """A tanh MLP autoencoder on the 8x8 digits (squared error)."""
  x_tr = _digits()

  def init(key):
    keys = jax.random.split(key, len(widths) - 1)
    return [
      _dense_init(k, a, b) for k, a, b in zip(keys, widths[:-1], widths[1:])
    ], None

  def forward(p, x):
    for layer in p[:-1]:
      x = jnp.tanh(_dense(layer, x))
    return _dense(p[-1], x)

  def loss(p, batch):
    (x,) = batch
    return 0.5 * jnp.mean(jnp.sum(jnp.square(forward(p, x) - x), -1))

  return Task(
    name="autoencoder",
    description=(
      f"{'-'.join(map(str, widths))} tanh autoencoder, digits "
      f"({x_tr.shape[0]} images), batch {batch_size}"
    ),
    init=init,
    loss=_stateless(loss),
    batch=_minibatch((x_tr,), batch_size),
    steps=steps,
    quick_steps=steps // 2,
    lrs=lr_window(1e-4, 1.0),
  )


CHARLM_MODULES = ("argparse", "textwrap", "difflib", "string", "shlex")


def stdlib_text(modules: Sequence[str] = CHARLM_MODULES) -> str:
  """The source text of standard-library modules (ships with Python)."""
  return "\n".join(
    inspect.getsource(importlib.import_module(m)) for m in modules
  )


def charlm(
  steps: int = 600,
  context: int = 16,
  embed: int = 16,
  hidden: int = 256,
  batch_size: int = 64,
) -> Task:
  """Character-level MLP language model on standard-library source text."""
  text = stdlib_text()
  codes = np.frombuffer(text.encode("ascii", "replace"), np.uint8)
  vocab, ids = np.unique(codes, return_inverse=True)
  ids = jnp.asarray(ids, jnp.int32)
  v = len(vocab)

  def init(key):
    ke, k1, k2 = jax.random.split(key, 3)
    return {
      "embed": jax.random.normal(ke, (v, embed)),
      "l1": _dense_init(k1, context * embed, hidden),
      "l2": _dense_init(k2, hidden, v),
    }, None

  def batch(key):
    start = jax.random.randint(key, (batch_size,), 0, ids.shape[0] - context)
    window = start[:, None] + jnp.arange(context + 1)
    return ids[window]

  def loss(p, b):
    x = p["embed"][b[:, :-1]].reshape(b.shape[0], -1)
    logits = _dense(p["l2"], jnp.tanh(_dense(p["l1"], x)))
    return jnp.mean(
      optax.softmax_cross_entropy_with_integer_labels(logits, b[:, -1])
    )

  return Task(
    name="charlm",
    description=(
      f"character-level MLP LM (context {context}, embedding "
      f"{embed}, hidden {hidden}, {v} symbols) on the source of "
      f"Python's {', '.join(CHARLM_MODULES)} modules "
      f"({len(text):,} characters), batch {batch_size}"
    ),
    init=init,
    loss=_stateless(loss),
    batch=batch,
    steps=steps,
    quick_steps=steps // 2,
    lrs=lr_window(1e-4, 1.0),
    info={"characters": len(text), "vocab": v},
  )


def rosenbrock(steps: int = 1000, dim: int = 10, noise: float = 10.0) -> Task:
  """The extended Rosenbrock function with noisy gradients.

  The loss is ``f(x) = sum 100 (x_{i+1} - x_i^2)^2 + (1 - x_i)^2`` (minimum
  0 at (1, ..., 1)); its gradient gets N(0, noise^2) per coordinate and step.
  Without noise every good optimizer converges linearly towards 0 and the
  ratio of final losses measures little but the exponent; the noise gives a
  floor that depends on the optimizer and its learning rate.
  """

  def f(x):
    return jnp.sum(
      100.0 * jnp.square(x[1:] - x[:-1] ** 2) + jnp.square(1.0 - x[:-1])
    )

  def loss(x, batch):
    lin = jnp.vdot(batch, x)  # Gradient noise; adds 0 to the value.
    return f(x) + lin - jax.lax.stop_gradient(lin)

  start = jnp.tile(jnp.array([-1.2, 1.0]), dim // 2)
  return Task(
    name="rosenbrock",
    description=(
      f"{dim}-D extended Rosenbrock from (-1.2, 1, ...) + "
      f"N(0, 0.1^2), gradient + N(0, {noise:g}^2) noise"
    ),
    init=lambda key: (start + 0.1 * jax.random.normal(key, (dim,)), None),
    loss=_stateless(loss),
    batch=lambda key: noise * jax.random.normal(key, (dim,)),
    steps=steps,
    quick_steps=steps // 2,
    lrs=lr_window(1e-5, 1.0),
  )


# -------------------------------------------------------- Flax examples


def _nnx_functional(make_model, filters):
  """``(init, apply)`` of an NNX model as pure functions of pure dicts.

  ``init(key)`` returns one pure dict per filter (e.g. params and BatchNorm
  statistics); ``module(*dicts)`` rebuilds the module from them.
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top

  abstract = nnx.eval_shape(lambda: make_model(nnx.Rngs(0)))
  graphdef, *templates = nnx.split(abstract, *filters)

  def init(key):
    _, *states = nnx.split(make_model(nnx.Rngs(key)), *filters)
    return tuple(nnx.to_pure_dict(s) for s in states)

  def module(*pure):
    states = []
    for template, values in zip(templates, pure):
      state = jax.tree.map(lambda x: x, template)
      nnx.replace_by_pure_dict(state, values)
      states.append(state)
    return nnx.merge(graphdef, *states)

  return init, module


def resnet(steps: int = 200, batch_size: int = 16, depth: int = 8) -> Task:
  """The ResNet example's model on the digits, trained from scratch."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from examples.resnet_cifar10 import input_pipeline  # pylint: disable=g-import-not-at-top
  from examples.resnet_cifar10 import models  # pylint: disable=g-import-not-at-top

  data = input_pipeline.load_digits()
  x_tr, y_tr = jnp.asarray(data.train_images), jnp.asarray(data.train_labels)
  x_te, y_te = jnp.asarray(data.test_images), jnp.asarray(data.test_labels)
  init, module = _nnx_functional(
    lambda rngs: models.ResNet(
      depth, data.num_classes, data.image_shape[-1], rngs=rngs
    ),
    (nnx.Param, nnx.BatchStat),
  )

  def loss(params, stats, batch):
    x, y = batch
    model = module(params, stats)
    logits = model(x, train=True)
    value = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return value, nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))

  def evaluate(params, stats):
    logits = module(params, stats)(x_te, train=False)
    return {
      "accuracy": jnp.mean(jnp.argmax(logits, -1) == y_te),
      "loss": optax.softmax_cross_entropy_with_integer_labels(
        logits, y_te
      ).mean(),
    }

  return Task(
    name="resnet",
    description=(
      f"ResNet-{depth} of examples/resnet_cifar10 (16/32/64 "
      f"channels, BatchNorm) on scikit-learn's 8x8 digits "
      f"({x_tr.shape[0]:,} train / {x_te.shape[0]} held-out), "
      f"batch {batch_size}"
    ),
    init=lambda key: init(key),
    loss=loss,
    batch=_minibatch((x_tr, y_tr), batch_size),
    steps=steps,
    quick_steps=steps // 2,
    lrs=lr_window(3e-4, 0.3),
    evaluate=evaluate,
    eval_every=20,
    heldout_target=("accuracy", "max", 0.95),
    vectorize=False,
    seeds=3,
    quick_seeds=2,
  )


def bert(
  steps: int = 300,
  batch_size: int = 16,
  hidden: int = 64,
  num_layers: int = 2,
  num_heads: int = 2,
  ffn: int = 128,
  vocab_size: int = 512,
  seq_len: int = 32,
  max_eval: int = 128,
) -> Task:
  """The BERT example's masked-LM model and data, at a small size."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from examples.bert_mlm import input_pipeline  # pylint: disable=g-import-not-at-top
  from examples.bert_mlm import models  # pylint: disable=g-import-not-at-top

  text = input_pipeline.load(
    text_files=None, vocab_size=vocab_size, seq_len=seq_len, max_eval=max_eval
  )
  config = models.BertConfig(
    vocab_size=text.vocab_size,
    max_len=seq_len,
    hidden=hidden,
    num_layers=num_layers,
    num_heads=num_heads,
    ffn=ffn,
  )
  init, module = _nnx_functional(
    lambda rngs: models.BertMLM(config, rngs=rngs), (nnx.Param,)
  )
  train = jnp.asarray(text.train)
  evaluation = jnp.asarray(text.eval)
  n_pred = input_pipeline.num_predictions(seq_len, 0.15)
  masks = functools.partial(
    input_pipeline.mask_tokens,
    num_predictions=n_pred,
    vocab_size=text.vocab_size,
  )
  eval_inputs = masks(jax.random.key(12345), evaluation)

  def mlm_loss(params, inputs, positions, targets):
    logits = module(params).apply_with_entropy(inputs, positions=positions)[0]
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, targets
    ).mean()

  def batch(key):
    k_idx, k_mask = jax.random.split(key)
    rows = jax.random.randint(k_idx, (batch_size,), 0, train.shape[0])
    return masks(k_mask, train[rows])

  def loss(params, state, b):
    return mlm_loss(params[0], *b), state

  return Task(
    name="bert",
    description=(
      f"BERT MLM of examples/bert_mlm: {num_layers} layers, "
      f"hidden {hidden}, {num_heads} heads, ffn {ffn}, BPE vocab "
      f"{text.vocab_size} on CPython's pydoc topics, sequences "
      f"of {seq_len} tokens, batch {batch_size}"
    ),
    init=lambda key: (init(key), None),
    loss=loss,
    batch=batch,
    steps=steps,
    quick_steps=steps // 2,
    lrs=lr_window(3e-4, 0.1),
    evaluate=lambda p, s: {"loss": mlm_loss(p[0], *eval_inputs)},
    eval_every=50,
    vectorize=False,
    seeds=3,
    quick_seeds=2,
    heldout_target=("loss", "min", text.unigram_entropy),
    info={
      "unigram_entropy": text.unigram_entropy,
      "train_sequences": int(train.shape[0]),
    },
  )


TASKS: dict[str, Callable[[], Task]] = {
  "linreg": linreg,
  "teacher": teacher_student,
  "logistic": logistic,
  "matfac": matrix_factorisation,
  "autoencoder": autoencoder,
  "charlm": charlm,
  "rosenbrock": rosenbrock,
  "resnet": resnet,
  "bert": bert,
}


# ------------------------------------------------------------- the loop


def smoothed_final(losses: np.ndarray, fraction: float = 0.1) -> np.ndarray:
  """Mean of the last ``fraction`` of the steps (last axis), NaN if any is
  not finite (a run that diverged at the end counts as diverged).
  """
  losses = np.asarray(losses, np.float64)
  k = max(1, int(round(fraction * losses.shape[-1])))
  tail = losses[..., -k:]
  out = tail.mean(-1)
  return np.where(np.isfinite(tail).all(-1), out, np.nan)


def make_sweep(
  task: Task,
  make_tx: Callable[[jax.Array], optax.GradientTransformation],
  steps: int,
  *,
  explosion_norm: float = 1.0,
  vectorize: bool = True,
  heldout: bool = True,
):
  """``(lrs [L], keys [S]) -> dict``: trains every (lr, seed) pair.

  ``make_tx(lr)`` builds the optimizer from a traced scalar learning rate.
  With ``vectorize`` the loop is ``vmap``-ed over seeds and learning rates,
  so the whole sweep is one compiled program; without it, one compiled run
  is called for each pair (faster for convolutions on CPU, where ``vmap``
  over per-run kernels becomes a slow grouped convolution). ``heldout=False``
  skips the task's held-out evaluation. Returns arrays with leading axes ``[L, S]``:
  ``loss [T]`` (each step's batch loss, before the update), ``explosion``
  (fraction of steps whose raw gradient global norm exceeds
  ``explosion_norm``), ``grad_norm_mean``, and when the task evaluates,
  ``eval_steps [E]`` (same for every run) and ``eval/<metric> [E]``.
  """
  evals = heldout and task.evaluate is not None and task.eval_every > 0
  chunk = math.gcd(task.eval_every, steps) if evals else steps
  n_chunks = steps // chunk

  def run_one(lr, key):
    init_key, data_key = jax.random.split(key)
    params, mstate = task.init(init_key)
    tx = make_tx(lr)
    opt_state = tx.init(params)

    def step(carry, t):
      params, mstate, opt_state = carry
      batch = task.batch(jax.random.fold_in(data_key, t))
      (loss, mstate), grads = jax.value_and_grad(task.loss, has_aux=True)(
        params, mstate, batch
      )
      updates, opt_state = tx.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      return (params, mstate, opt_state), (loss, optax.tree.norm(grads))

    def run_chunk(carry, c):
      ts = c * chunk + jnp.arange(chunk)
      carry, (loss, norm) = jax.lax.scan(step, carry, ts)
      metrics = task.evaluate(carry[0], carry[1]) if evals else {}
      return carry, (loss, norm, metrics)

    _, (loss, norm, metrics) = jax.lax.scan(
      run_chunk, (params, mstate, opt_state), jnp.arange(n_chunks)
    )
    loss, norm = loss.reshape(-1), norm.reshape(-1)
    out = {
      "loss": loss,
      "explosion": jnp.mean((norm > explosion_norm).astype(jnp.float32)),
      "grad_norm_mean": jnp.mean(norm),
    }
    out.update({f"eval/{k}": v for k, v in metrics.items()})
    return out

  if vectorize:
    fn = jax.jit(
      jax.vmap(jax.vmap(run_one, in_axes=(None, 0)), in_axes=(0, None))
    )
    sweep = lambda lrs, keys: fn(lrs, _wrap(keys))
  else:
    one = jax.jit(run_one)

    def sweep(lrs, keys):
      runs = [[one(lr, k) for k in _wrap(keys)] for lr in lrs]
      return jax.tree.map(
        lambda *x: jnp.stack(x).reshape((len(lrs), keys.shape[0]) + x[0].shape),
        *[r for row in runs for r in row],
      )

  return sweep, [(c + 1) * chunk for c in range(n_chunks)]


def _wrap(keys):
  return jax.vmap(jax.random.wrap_key_data)(keys)


def seed_keys(seeds: Sequence[int]) -> jax.Array:
  return jnp.stack([jax.random.key_data(jax.random.key(s)) for s in seeds])
