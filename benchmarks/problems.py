"""Standard optimisation problems for the convergence benchmark.

Each :class:`Problem` is a pure-JAX objective with a fixed step budget, a
metric with a target (for "steps to target"), and learning-rate grids. The
training loop lives in :func:`make_runner`: one ``jax.lax.scan`` over the steps,
``vmap``-ed over seeds, with the learning rate as a traced argument so that a
whole learning-rate sweep compiles once per optimizer.

Problems:

* ``rosenbrock`` -- the 2-D Rosenbrock valley ``(1-x)^2 + 100 (y-x^2)^2`` from
  the classic start (-1.2, 1) plus N(0, 0.1^2) per seed. Deterministic.
* ``quadratic`` -- ``0.5 x^T A x`` in 50 dimensions, ``A = Q diag(l) Q^T``
  with eigenvalues log-spaced in [0.01, 10] (condition number 1,000) and a
  fixed random rotation ``Q``; start ``x0 ~ N(0, I)`` per seed.
  Metric: suboptimality relative to the start, ``f(x)/f(x0)``. Deterministic.
* ``logistic`` -- binary logistic regression on scikit-learn's bundled
  breast-cancer data (569 x 30, standardised, stratified 80/20 split, seed
  0), minibatches of 32 drawn with replacement. Metric: held-out accuracy.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

Params = Any
Batch = Any


@dataclasses.dataclass(frozen=True)
class Problem:
  """An objective, its metric and its budget.

  Attributes:
    name: short identifier (used in file names).
    description: one line for the report.
    init: ``key -> params`` (the seed's starting point).
    loss: ``(params, batch) -> scalar`` training loss; ``batch`` is None for
      deterministic problems.
    sample_batch: ``key -> batch`` or None (full-batch, deterministic).
    evaluate: ``(params, params0) -> dict`` of scalar metrics; must hold
      ``metric`` and ``tiebreak``.
    metric: the reported metric (selection, target, final value).
    mode: ``"min"`` or ``"max"``: whether lower or higher ``metric`` is better.
    tiebreak: a lower-is-better metric that breaks ties of ``metric`` in the
      learning-rate selection (e.g. held-out loss when accuracies tie).
    target: the value of ``metric`` that counts as "reached".
    steps: step budget.
    lr_grid: learning rates tried for the adaptive optimizers (Adam, AdamW,
      NAdam, GRPO).
    sgd_lr_grid: the same number of log-spaced values for SGD + momentum,
      whose learning rate has the scale of 1/curvature instead.
  """
  name: str
  description: str
  init: Callable[[jax.Array], Params]
  loss: Callable[[Params, Batch], jax.Array]
  sample_batch: Optional[Callable[[jax.Array], Batch]]
  evaluate: Callable[[Params, Params], dict[str, jax.Array]]
  metric: str
  mode: str
  tiebreak: str
  target: float
  steps: int
  lr_grid: tuple[float, ...]
  sgd_lr_grid: tuple[float, ...]


def rosenbrock(steps: int = 2000) -> Problem:
  """The 2-D Rosenbrock function; metric: f(x) (minimum 0 at (1, 1))."""

  def f(p, batch=None):
    del batch
    x, y = p[0], p[1]
    return (1.0 - x) ** 2 + 100.0 * (y - x ** 2) ** 2

  def init(key):
    return jnp.array([-1.2, 1.0]) + 0.1 * jax.random.normal(key, (2,))

  return Problem(
      name="rosenbrock",
      description="2-D Rosenbrock from (-1.2, 1) + N(0, 0.1^2), full gradient",
      init=init, loss=f, sample_batch=None,
      evaluate=lambda p, p0: {"f": f(p), "distance": jnp.linalg.norm(p - 1.0)},
      metric="f", mode="min", tiebreak="distance", target=1e-3, steps=steps,
      lr_grid=(3e-3, 1e-2, 3e-2, 1e-1),
      sgd_lr_grid=(1e-4, 3e-4, 1e-3, 3e-3))


def quadratic(steps: int = 1000, dim: int = 50,
              condition: float = 1e3) -> Problem:
  """An ill-conditioned convex quadratic; metric: f(x) / f(x0)."""
  eig = jnp.logspace(-2.0, -2.0 + np.log10(condition), dim)
  q, _ = jnp.linalg.qr(jax.random.normal(jax.random.key(1234), (dim, dim)))
  a = (q * eig) @ q.T

  def f(x, batch=None):
    del batch
    return 0.5 * x @ (a @ x)

  return Problem(
      name="quadratic",
      description=(f"0.5 x^T A x, {dim} dims, eigenvalues log-spaced in "
                   f"[0.01, {0.01 * condition:g}] (condition {condition:g}), "
                   "rotated; x0 ~ N(0, I)"),
      init=lambda key: jax.random.normal(key, (dim,)), loss=f,
      sample_batch=None,
      evaluate=lambda x, x0: {"rel_f": f(x) / f(x0),
                              "rel_f_tiebreak": f(x) / f(x0)},
      metric="rel_f", mode="min", tiebreak="rel_f_tiebreak", target=1e-3,
      steps=steps, lr_grid=(3e-3, 1e-2, 3e-2, 1e-1),
      sgd_lr_grid=(1e-2, 3e-2, 1e-1, 3e-1))


def _breast_cancer():
  from sklearn import datasets, model_selection  # pylint: disable=g-import-not-at-top
  x, y = datasets.load_breast_cancer(return_X_y=True)
  x_tr, x_te, y_tr, y_te = model_selection.train_test_split(
      x, y, test_size=0.2, random_state=0, stratify=y)
  mean, std = x_tr.mean(0), x_tr.std(0) + 1e-8
  to = lambda a: jnp.asarray(a, jnp.float32)
  return (to((x_tr - mean) / std), to(y_tr), to((x_te - mean) / std),
          to(y_te))


def logistic(steps: int = 400, batch_size: int = 32) -> Problem:
  """Logistic regression on breast-cancer; metric: held-out accuracy."""
  x_tr, y_tr, x_te, y_te = _breast_cancer()

  def nll(p, x, y):
    logits = x @ p["w"] + p["b"]
    return jnp.mean(optax.sigmoid_binary_cross_entropy(logits, y))

  def sample_batch(key):
    idx = jax.random.randint(key, (batch_size,), 0, x_tr.shape[0])
    return x_tr[idx], y_tr[idx]

  def evaluate(p, p0):
    del p0
    logits = x_te @ p["w"] + p["b"]
    return {"accuracy": jnp.mean((logits > 0) == (y_te > 0.5)),
            "heldout_loss": nll(p, x_te, y_te)}

  def init(key):
    return {"w": 0.01 * jax.random.normal(key, (x_tr.shape[1],)),
            "b": jnp.zeros(())}

  return Problem(
      name="logistic",
      description=(f"logistic regression, breast-cancer ({x_tr.shape[0]} "
                   f"train / {x_te.shape[0]} held-out, 30 features), batch "
                   f"{batch_size}"),
      init=init, loss=lambda p, b: nll(p, *b), sample_batch=sample_batch,
      evaluate=evaluate, metric="accuracy", mode="max",
      tiebreak="heldout_loss", target=0.95, steps=steps,
      lr_grid=(3e-3, 1e-2, 3e-2, 1e-1), sgd_lr_grid=(1e-2, 3e-2, 1e-1, 3e-1))


def all_problems(quick: bool = False) -> dict[str, Problem]:
  """The standard problems, with halved budgets when ``quick``."""
  scale = 2 if quick else 1
  return {p.name: p for p in (rosenbrock(2000 // scale),
                              quadratic(1000 // scale),
                              logistic(400 // scale))}


def make_runner(problem: Problem,
                make_tx: Callable[[Any], optax.GradientTransformation],
                *, steps: Optional[int] = None,
                explosion_norm: float = 1.0):
  """A jitted ``(lr, keys) -> dict of per-seed arrays`` training loop.

  ``make_tx(lr)`` builds the optimizer from a traced learning rate. Each seed
  (one key per seed, vmapped) trains for ``steps`` steps in one
  ``lax.scan``; after every step the metric is evaluated.

  Returns (arrays with a leading seed axis): ``loss`` [steps] (training loss
  before each update), ``metric`` [steps] (after each update), ``grad_norm``
  [steps] (global norm of the raw gradient), ``explosion_rate`` (fraction of
  steps with ``grad_norm > explosion_norm``), and ``final`` (the dict of
  ``problem.evaluate`` on the last params).
  """
  steps = problem.steps if steps is None else steps

  def run_one(lr, key):
    init_key, data_key = jax.random.split(key)
    params0 = problem.init(init_key)
    tx = make_tx(lr)

    def step(carry, t):
      params, state = carry
      batch = (problem.sample_batch(jax.random.fold_in(data_key, t))
               if problem.sample_batch is not None else None)
      loss, grads = jax.value_and_grad(problem.loss)(params, batch)
      updates, state = tx.update(grads, state, params)
      params = optax.apply_updates(params, updates)
      metric = problem.evaluate(params, params0)[problem.metric]
      return (params, state), (loss, metric, optax.tree.norm(grads))

    (params, _), (losses, metrics, norms) = jax.lax.scan(
        step, (params0, tx.init(params0)), jnp.arange(steps))
    return {"loss": losses, "metric": metrics, "grad_norm": norms,
            "explosion_rate": jnp.mean(norms > explosion_norm),
            "final": problem.evaluate(params, params0)}

  return jax.jit(jax.vmap(run_one, in_axes=(None, 0)))
