"""The contract every transform of the package passes (see test_contract.py).

Each entry of :data:`CASES` names a factory and its keyword arguments. Later
transforms add an entry here; ``test_contract.py`` runs the whole matrix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import optax

import grpo_optax

ARTICLE = grpo_optax.ARTICLE_DEFAULTS


@dataclasses.dataclass(frozen=True)
class Case:
  """One transform under the contract.

  Attributes:
    name: test id.
    factory: the public factory.
    kwargs: arguments for the factory (floats are injected by
      ``optax.inject_hyperparams`` in the injection test).
    static_args: arguments that ``inject_hyperparams`` must keep static.
    lr: learning rate of the convergence tests.
    optimizer: builds a full optimizer from the transform and ``lr``; by
      default ``chain(transform, scale(-lr))``.
    steps: convergence steps.
    param_trees: how many param-shaped trees the state holds (moments,
      residuals, per-leaf statistics), i.e. what ``optax.tree.map_params``
      must reach; counted by hand from the state types.
  """

  name: str
  factory: Callable[..., optax.GradientTransformation]
  kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
  static_args: tuple[str, ...] = ()
  lr: float = 0.05
  optimizer: (
    Callable[
      [optax.GradientTransformation, float], optax.GradientTransformation
    ]
    | None
  ) = None
  steps: int = 3000
  param_trees: int = 0

  def make(self, **overrides) -> optax.GradientTransformation:
    return self.factory(**{**self.kwargs, **overrides})

  def make_optimizer(self) -> optax.GradientTransformation:
    tx = self.make()
    if self.optimizer is not None:
      return self.optimizer(tx, self.lr)
    return optax.chain(tx, optax.scale(-self.lr))

  def __str__(self):
    return self.name


def _then_sgd(tx, lr):
  return optax.chain(tx, optax.sgd(lr, momentum=0.9))


def _then_adam(tx, lr):
  # Masks with error feedback release the accumulated residual in bursts; on
  # Rosenbrock's stiff valley an adaptive step keeps those bounded.
  return optax.chain(tx, optax.adam(lr))


CASES: list[Case] = [
  Case(
    "zclip",
    grpo_optax.zclip,
    dict(z_threshold=2.0, warmup_steps=5),
    lr=2e-3,
    optimizer=_then_sgd,
    steps=4000,
  ),
  Case(
    "clip_with_l2",
    grpo_optax.clip_with_l2,
    dict(max_norm=1.0, l2=1e-4),
    lr=2e-3,
    optimizer=_then_sgd,
    steps=4000,
  ),
  Case(
    "clip_no_l2",
    grpo_optax.clip_with_l2,
    dict(max_norm=0.5),
    lr=2e-3,
    optimizer=_then_sgd,
    steps=4000,
  ),
  Case(
    "variance_lr_leaf",
    grpo_optax.scale_by_variance_lr,
    dict(coef=0.1, decay=0.9),
    lr=2e-3,
    optimizer=_then_sgd,
    steps=4000,
    param_trees=2,
  ),  # mu, nu
  Case(
    "variance_lr_element_normalized",
    grpo_optax.scale_by_variance_lr,
    dict(coef=0.5, decay=0.9, reduction="element", normalize=True),
    lr=2e-3,
    optimizer=_then_sgd,
    steps=4000,
    param_trees=2,
  ),
  Case(
    "variance_lr_global",
    grpo_optax.scale_by_variance_lr,
    dict(coef=0.1, reduction="global"),
    lr=2e-3,
    optimizer=_then_sgd,
    steps=4000,
    param_trees=2,
  ),
  Case(
    "nesterov_adam_rms",
    grpo_optax.scale_by_nesterov_adam_rms,
    dict(adam_weight=0.5),
    lr=0.02,
    param_trees=2,
  ),  # mu, nu
  Case(
    "nesterov_adam_rms_filtered",
    grpo_optax.scale_by_nesterov_adam_rms,
    dict(adam_weight=0.7, nesterov=False, filter_decay=0.5),
    lr=0.02,
    param_trees=3,
  ),  # mu, nu, filtered
  Case(
    "importance_order2",
    grpo_optax.scale_by_importance,
    dict(),
    lr=8e-4,
    optimizer=_then_sgd,
    steps=4000,
    param_trees=2,
  ),  # hessian, score
  Case(
    "importance_order1",
    grpo_optax.scale_by_importance,
    dict(order=1, decay=0.5, min_weight=0.5, max_weight=2.0),
    static_args=("order",),
    lr=2e-3,
    optimizer=_then_sgd,
    steps=4000,
    param_trees=1,
  ),  # score
  Case(
    "topk_exact",
    grpo_optax.top_k_mask,
    dict(fraction=0.5),
    lr=1e-2,
    optimizer=_then_adam,
    steps=4000,
    param_trees=1,
  ),  # residual
  Case(
    "topk_sampled_freq_warmup",
    grpo_optax.top_k_mask,
    dict(
      fraction=0.3,
      method="sampled",
      frequency_weight=0.3,
      warmup_steps=5,
      min_size=9,
    ),
    lr=1e-2,
    optimizer=_then_adam,
    steps=4000,
    param_trees=2,
  ),  # residual, frequency
  Case(
    "topk_no_feedback",
    grpo_optax.top_k_mask,
    dict(fraction=0.7, error_feedback=False),
    lr=1e-2,
    optimizer=_then_adam,
    steps=4000,
  ),
  Case(
    "ema_threshold",
    grpo_optax.ema_threshold_mask,
    dict(every=3),
    lr=1e-3,
    optimizer=_then_sgd,
    steps=4000,
    param_trees=1,
  ),  # residual
  Case(
    "freeze_below",
    grpo_optax.freeze_below,
    dict(threshold=0.3, warmup_steps=2),
    lr=2e-3,
    optimizer=_then_sgd,
    steps=4000,
    param_trees=0,
  ),  # per-leaf scalars are vectors
  # The preset with its defaults (the fused core): mu, nu and the
  # error-feedback accumulator (per-leaf thresholds are one vector).
  Case(
    "grpo_defaults",
    grpo_optax.grpo,
    dict(learning_rate=0.02),
    optimizer=lambda tx, lr: tx,
    param_trees=3,
  ),
  # With the articles' settings (every mechanism on): + the importance
  # room's score and Fisher EMA, + the variance room's two EMAs.
  Case(
    "grpo_topk",
    grpo_optax.grpo,
    dict(learning_rate=0.02, **ARTICLE),
    optimizer=lambda tx, lr: tx,
    param_trees=7,
  ),
  Case(
    "grpo_threshold",
    grpo_optax.grpo,
    dict(learning_rate=0.02, sparsify="threshold", every=10, **ARTICLE),
    optimizer=lambda tx, lr: tx,
    param_trees=7,
  ),
  Case(
    "grpo_dense_freeze",
    grpo_optax.grpo,
    dict(
      learning_rate=0.02,
      sparsify=None,
      freeze_threshold=0.05,
      freeze_warmup_steps=10,
      importance_placement="output",
      variance_reduction="global",
      l2=1e-3,
      **ARTICLE,
    ),
    optimizer=lambda tx, lr: tx,
    param_trees=6,
  ),
  Case(
    "grpo_topk_output_no_feedback",
    grpo_optax.grpo,
    dict(
      learning_rate=0.02,
      importance_placement="output",
      error_feedback=False,
      variance_normalize=True,
      variance_reduction="element",
      rms_bias_correction=True,
      **{**ARTICLE, "fraction": 0.7},
    ),
    optimizer=lambda tx, lr: tx,
    param_trees=6,
  ),
  # The chain (fused=False, or a setting the fused core does not cover):
  # importance 2, accumulator 1, adaptive 2 (3 with the noise filter),
  # variance 2, freezing 0 (vectors).
  Case(
    "grpo_topk_chain",
    grpo_optax.grpo,
    dict(learning_rate=0.02, fused=False, **ARTICLE),
    optimizer=lambda tx, lr: tx,
    param_trees=7,
  ),
  Case(
    "grpo_threshold_chain",
    grpo_optax.grpo,
    dict(
      learning_rate=0.02, sparsify="threshold", every=10, fused=False, **ARTICLE
    ),
    optimizer=lambda tx, lr: tx,
    param_trees=7,
  ),
  Case(
    "grpo_dense_freeze_filter_chain",
    grpo_optax.grpo,
    dict(
      learning_rate=0.02,
      sparsify=None,
      freeze_threshold=0.05,
      freeze_warmup_steps=10,
      filter_decay=0.5,
      **ARTICLE,
    ),
    optimizer=lambda tx, lr: tx,
    param_trees=7,
  ),
]
