"""Logistic regression on scikit-learn's bundled breast-cancer data.

The smallest end-to-end use of the GRPO transforms: a jitted training loop
with ``grpo_optax.grpo`` on real data that ships with scikit-learn (no
download). Prints the loss falling and the held-out accuracy.

Run: ``python -m examples.logistic_regression``
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

import grpo_optax
from examples.common import cli


def load_data(seed: int = 0):
  from sklearn.datasets import load_breast_cancer  # pylint: disable=g-import-not-at-top

  x, y = load_breast_cancer(return_X_y=True)
  x = (x - x.mean(0)) / (x.std(0) + 1e-8)
  perm = np.random.default_rng(seed).permutation(len(x))
  x, y = x[perm].astype(np.float32), y[perm].astype(np.float32)
  n_train = int(0.8 * len(x))
  return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])


def loss_fn(params, x, y):
  logits = x @ params["w"] + params["b"]
  return optax.sigmoid_binary_cross_entropy(logits, y).mean()


def make_parser() -> cli.ArgumentParser:
  """The flags of the example (``--help``)."""
  parser = cli.ArgumentParser(
    prog="python -m examples.logistic_regression",
    description=__doc__.splitlines()[0],
  )
  parser.add_argument(
    "--steps", type=int, default=300, help="Full-batch training steps."
  )
  parser.add_argument(
    "--lr", type=float, default=3e-2, help="Learning rate of grpo_optax.grpo."
  )
  parser.add_argument(
    "--seed", type=int, default=0, help="Seed of the train / held-out split."
  )
  return parser


def parse_args(argv=None) -> argparse.Namespace:
  """Parses and checks the flags (``argv=None`` reads ``sys.argv``)."""
  parser = make_parser()
  args = parser.parse_args(argv)
  if args.steps < 1:
    parser.error(f"--steps must be >= 1, got {args.steps}")
  if not args.lr > 0:
    parser.error(f"--lr must be > 0, got {args.lr}")
  if args.seed < 0:
    parser.error(f"--seed must be >= 0, got {args.seed}")
  return args


def main(argv=None):
  args = parse_args(argv)
  (x_tr, y_tr), (x_te, y_te) = load_data(args.seed)
  params = {"w": jnp.zeros(x_tr.shape[1]), "b": jnp.zeros(())}
  tx = grpo_optax.grpo(args.lr)
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state):
    loss, grads = jax.value_and_grad(loss_fn)(params, x_tr, y_tr)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  cli.announce_compile(quiet=False)
  for i in range(args.steps):
    params, opt_state, loss = step(params, opt_state)
    if i % 50 == 0 or i == args.steps - 1:
      print(f"step {i:4d}  train loss {float(loss):.4f}")
  acc = float(
    jnp.mean(((x_te @ params["w"] + params["b"]) > 0) == (y_te > 0.5))
  )
  print(f"held-out accuracy {acc:.4f}")
  return acc


if __name__ == "__main__":
  main()
