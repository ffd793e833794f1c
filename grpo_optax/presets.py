"""PLACEHOLDER: the real preset is being written; the signature below is final."""
from __future__ import annotations
import optax


def grpo(learning_rate=1e-3, *, max_norm=1.0, l2=0.0,
         importance=True, importance_order=2, importance_decay=0.9,
         min_weight=0.1, max_weight=10.0,
         sparsify="topk", fraction=0.3, topk_method="sampled",
         error_feedback=True, frequency_weight=0.0, min_size=0,
         sparsify_warmup_steps=0, alpha=0.7, every=100, threshold_scale=1.0,
         b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, adam_weight=0.5,
         nesterov=True, filter_decay=None, mu_dtype=None,
         variance_coef=0.1, variance_decay=0.99, variance_reduction="leaf",
         variance_normalize=False,
         freeze_threshold=None, freeze_decay=0.9, freeze_warmup_steps=100,
         seed=0):
  # PLACEHOLDER
  return optax.chain(optax.clip_by_global_norm(max_norm or 1e30),
                     optax.scale_by_adam(b1, b2, eps),
                     optax.scale_by_learning_rate(learning_rate))
