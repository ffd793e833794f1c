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


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--lr", type=float, default=3e-2)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  (x_tr, y_tr), (x_te, y_te) = load_data(args.seed)
  params = {"w": jnp.zeros(x_tr.shape[1]), "b": jnp.zeros(())}
  tx = grpo_optax.grpo(args.lr)
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state):
    loss, grads = jax.value_and_grad(loss_fn)(params, x_tr, y_tr)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

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
