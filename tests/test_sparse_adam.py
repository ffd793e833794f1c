"""The sparse-delivery model of ``benchmarks.sparse_adam``."""

import math

import numpy as np
import optax

import grpo_optax
from benchmarks import sparse_adam


def test_deliveries_carry_the_same_sum_as_the_dense_gradient():
  for k in (1, 4, 16):
    d = sparse_adam.delivered(k, steps=64)
    assert d.sum() == 64 and np.count_nonzero(d) == 64 // k
    assert d[k - 1] == k and not d[64:].any()


def test_momentum_sgd_moves_as_far_and_adam_about_sqrt_k_less():
  dense = sparse_adam.delivered(1, steps=1024)
  sparse = sparse_adam.delivered(16, steps=1024)
  sgd = optax.sgd(1.0, momentum=0.9)
  assert math.isclose(
    sparse_adam.total_movement(sgd, dense),
    sparse_adam.total_movement(sgd, sparse),
    rel_tol=1e-4,
  )
  for tx in (
    optax.adam(1.0),
    grpo_optax.grpo(1.0, max_norm=None, sparsify=None),
  ):
    ratio = sparse_adam.total_movement(tx, dense) / sparse_adam.total_movement(
      tx, sparse
    )
    assert 3.6 < ratio < 4.4, ratio  # sqrt(16) = 4
