"""The curated mutants: data only, run by ``tools/mutants.py`` (cosmic-ray).

Each mutant is one replacement of a code snippet in one library file (a
constant, an operator, a reduction, an EMA's update condition, a stage order,
a keyword routed to the wrong stage): the semantic mistakes that no generic
mutation operator makes. ``tools/mutation/grpo_mutation`` applies them as the
cosmic-ray operator ``grpo/CuratedSnippet`` and runs each one's ``tests``.

Snippets are anchored on Python tokens, not on text (see
``grpo_mutation.anchoring``): a reformat keeps them applicable. A snippet
that is not found exactly once is an error, never skipped: after a refactor,
re-target it (``python tools/mutants.py --check`` lists them all in seconds).

Mutants marked ``equivalent`` change the code but not its results (the reason
is given); they are run too, and are expected to survive.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Mutant:
  """One semantic mutation.

  Attributes:
    name: unique id (``--only`` matches it with shell globs).
    file: library file, relative to the repository root.
    old: exact snippet; must occur exactly once in ``file``.
    new: its replacement.
    tests: pytest targets (files or node ids), the likeliest killer first.
    what: the wrong math, in words.
    equivalent: non-empty if the mutant cannot be killed, with the reason.
  """

  name: str
  file: str
  old: str
  new: str
  tests: tuple[str, ...]
  what: str
  equivalent: str = ""


T_VAR = ("tests/test_variance.py",)
T_IMP = ("tests/test_importance.py",)


def sp(*names: str) -> tuple[str, ...]:
  """Node ids in tests/test_sparsify.py (its sampled tests take a minute)."""
  return tuple(f"tests/test_sparsify.py::{n}" for n in names)


T_MOM = ("tests/test_momentum.py",)
T_FUSED = ("tests/test_fused.py",)
T_CLIP = ("tests/test_clipping.py",)
T_FREEZE = ("tests/test_freezing.py",)
# tests/test_one_algorithm.py by node: the fused core against the chain of
# its rooms (the file's other tests take minutes).
T_ONE = (
  "tests/test_one_algorithm.py::test_fused_core_equals_the_chain_of_its_rooms",
)
T_WIRING = ("tests/test_preset_wiring.py",)


def knob_tests(*keywords: str) -> tuple[str, ...]:
  """Node ids of tests/test_one_algorithm.py's keyword test (slow tier), in
  both forms: grpo(kw=value) must change the update. It sees a keyword that
  a WIRING row drops or sends to another field, which the equality test of
  tests/test_preset_wiring.py cannot (its chain reads the same table).
  """
  return tuple(
    "tests/test_one_algorithm.py::test_every_keyword_changes_the_update"
    f"[{k}-{form}]"
    for k in keywords
    for form in ("False", "None")
  )


# ZClip: a NumPy reference, and the docstring example's numbers.
T_ZCLIP = (
  "tests/test_zclip.py",
  "tests/test_doctests.py::test_docstring_examples[grpo_optax.adaptive_clipping]",
)
T_METRICS = (
  "tests/test_diagnostics.py::test_metrics_match_independent_values",
  "tests/test_diagnostics.py::test_importance_converged",
  "tests/test_diagnostics.py::test_frozen_mask_through_wrappers",
)

MUTANTS: list[Mutant] = [
  # -- the four mutations of issue 14 ------------------------------------
  Mutant(
    "freeze_mean_over_all_leaves",
    "grpo_optax/freezing.py",
    "active = jnp.logical_not(state.frozen).astype(jnp.float32)",
    "active = jnp.ones_like(state.frozen, jnp.float32)",
    T_FREEZE,
    "importances normalised by the mean over all leaves, frozen ones included",
  ),
  Mutant(
    "variance_lr_scale_without_coef",
    "grpo_optax/variance.py",
    "jnp.sum(scale * weights),",
    "jnp.sum(1.0 / (1.0 + var) * weights),",
    T_VAR,
    "diagnostic lr_scale = mean 1/(1 + var), without coef",
  ),
  Mutant(
    "importance_score_std_from_clipped_weights",
    "grpo_optax/importance.py",
    '"r": r, "r2": r * r}',
    '"r": w, "r2": w * w}',
    T_IMP,
    "early-stop statistic std of the clipped weights, not of S / mean(S)",
  ),
  # -- variance.py ----------------------------------------------------------
  Mutant(
    "variance_mu_not_bias_corrected",
    "grpo_optax/variance.py",
    "- jnp.square(mu_new.astype(jnp.float32) / bc),",
    "- jnp.square(mu_new.astype(jnp.float32)),",
    T_VAR,
    "variance nu_hat - mu^2 with mu not bias-corrected",
  ),
  Mutant(
    "variance_no_clamp_at_zero",
    "grpo_optax/variance.py",
    "var = jnp.maximum(\n"
    "      nu_new.astype(jnp.float32) / bc\n"
    "      - jnp.square(mu_new.astype(jnp.float32) / bc),\n"
    "      jnp.float32(0) * bc,\n"
    "    )",
    "var = (\n"
    "      nu_new.astype(jnp.float32) / bc\n"
    "      - jnp.square(mu_new.astype(jnp.float32) / bc)\n"
    "    )",
    T_VAR,
    "no max(., 0) on nu_hat - mu_hat^2",
    equivalent="nu_hat - mu_hat^2 is the variance under the normalised EMA"
    " weights (they sum to 1 after bias correction), >= 0 up to rounding;"
    " a rounding negative is ~1e-7 of g^2 and moves 1/(1 + c var) by less"
    " than float32's resolution of the tests",
  ),
  Mutant(
    "variance_leaf_sum_not_mean",
    "grpo_optax/variance.py",
    "var = _common.stack(var_sums) / count",
    "var = _common.stack(var_sums)",
    T_VAR,
    "leaf reduction sums instead of averaging",
  ),
  Mutant(
    "variance_global_mean_over_leaves",
    "grpo_optax/variance.py",
    "var = _common.total(var_sums) / total",
    "var = _common.total(var_sums) / max(len(var_sums), 1)",
    T_VAR,
    "global reduction divides by the number of leaves",
  ),
  Mutant(
    "variance_normalize_by_sqrt",
    "grpo_optax/variance.py",
    "var = var / (denom + eps)",
    "var = var / (jnp.sqrt(denom) + eps)",
    T_VAR,
    "normalised by sqrt(E[g^2]) instead of E[g^2]",
  ),
  Mutant(
    "variance_ema_weights_swapped",
    "grpo_optax/variance.py",
    "mu_new = optax.tree.update_moment(g, mu, decay, 1)",
    "mu_new = optax.tree.update_moment(g, mu, 1 - decay, 1)",
    T_VAR,
    "first-moment EMA with 1 - decay",
  ),
  Mutant(
    "variance_grad_variance_ignored",
    "grpo_optax/variance.py",
    "if grad_variance is not None:",
    "if False:",
    (
      "tests/test_presets.py::test_extra_arg_reaches_the_variance_stage",
      *T_VAR,
    ),
    "extra arg grad_variance ignored",
  ),
  Mutant(
    "variance_scale_squared",
    "grpo_optax/variance.py",
    "scale = 1.0 / (1.0 + coef * var)\n  weights = n / total",
    "scale = 1.0 / (1.0 + coef * var) ** 2\n  weights = n / total",
    T_VAR,
    "rate 1 / (1 + c var)^2",
  ),
  # -- importance.py --------------------------------------------------------
  Mutant(
    "importance_second_order_coefficient_1",
    "grpo_optax/importance.py",
    "score = score + use_second * 0.5 * h_hat * p32 * p32",
    "score = score + use_second * h_hat * p32 * p32",
    T_IMP,
    "Taylor term h p^2 instead of h p^2 / 2",
  ),
  Mutant(
    "importance_fisher_of_previous_step",
    "grpo_optax/importance.py",
    "h_hat = h32 / bc",
    "h_hat = h_old.astype(jnp.float32) / bc",
    T_IMP,
    "Fisher EMA used before it is updated with the current g",
  ),
  Mutant(
    "importance_normaliser_max",
    "grpo_optax/importance.py",
    "scale = _ratio_scale(total / max(s.size, 1), bc)",
    "scale = _ratio_scale(jnp.max(s), bc)",
    T_IMP,
    "weights S / max(S) instead of S / mean(S)",
  ),
  Mutant(
    "importance_no_lower_clip",
    "grpo_optax/importance.py",
    "return jnp.clip(ratio, min_weight, max_weight)",
    "return jnp.clip(ratio, 0.0, max_weight)",
    T_IMP,
    "min_weight ignored",
  ),
  Mutant(
    "importance_head_entropy_over_max",
    "grpo_optax/importance.py",
    "head = ent / (jnp.mean(ent) + 1e-12)",
    "head = ent / (jnp.max(ent) + 1e-12)",
    T_IMP,
    "head factor entropy / max instead of entropy / mean",
  ),
  Mutant(
    "importance_hessian_diag_ignored",
    "grpo_optax/importance.py",
    "h_hat = jnp.asarray(hd, jnp.float32)",
    "h_hat = jnp.zeros_like(g32)",
    (
      "tests/test_presets.py::test_extra_args_reach_the_importance_stage",
      *T_IMP,
    ),
    "extra arg hessian_diag dropped",
  ),
  Mutant(
    "importance_score_ema_weights_swapped",
    "grpo_optax/importance.py",
    "decay * s_old.astype(jnp.float32) + (1 - decay) * score",
    "(1 - decay) * s_old.astype(jnp.float32) + decay * score",
    T_IMP,
    "score EMA with the weights swapped",
  ),
  Mutant(
    "importance_weight_std_without_square",
    "grpo_optax/importance.py",
    '"w2": w * w,',
    '"w2": w,',
    T_IMP,
    "weight_std from E[w] instead of E[w^2]",
  ),
  Mutant(
    "importance_score_without_abs",
    "grpo_optax/importance.py",
    "score = jnp.abs(g32 * p32)",
    "score = g32 * p32",
    T_IMP,
    "first-order term g p instead of |g p|",
  ),
  # -- momentum.py ----------------------------------------------------------
  Mutant(
    "rms_uses_bias_corrected_nu",
    "grpo_optax/momentum.py",
    "nu_hat if rms_bias_correction else nu,",
    "nu_hat,",
    T_MOM,
    "RMSProp part with bias correction (optax's has none)",
  ),
  Mutant(
    "noise_filter_not_bias_corrected",
    "grpo_optax/momentum.py",
    "g = optax.tree.bias_correction(new_f, self.filter_decay, count_inc)",
    "g = new_f",
    T_MOM,
    "noise filter EMA without bias correction",
  ),
  # -- clipping.py ----------------------------------------------------------
  Mutant(
    "clip_l2_norm_cross_term",
    "grpo_optax/clipping.py",
    "gg + 2 * l2 * gp + l2 * l2 * pp",
    "gg + l2 * gp + l2 * l2 * pp",
    T_CLIP,
    "||g + l2 p||^2 expanded with l2 <g, p> instead of 2 l2 <g, p>",
  ),
  Mutant(
    "clip_counts_unclipped_steps",
    "grpo_optax/clipping.py",
    "clipped = jnp.where(norm > max_norm,",
    "clipped = jnp.where(norm < max_norm,",
    T_CLIP,
    "the clip counter counts unclipped steps",
  ),
  # -- freezing.py ----------------------------------------------------------
  Mutant(
    "freeze_can_unfreeze",
    "grpo_optax/freezing.py",
    "frozen = state.frozen | (",
    "frozen = (",
    T_FREEZE,
    "a frozen leaf unfreezes when its importance recovers",
  ),
  Mutant(
    "freeze_warmup_strict",
    "grpo_optax/freezing.py",
    "may_freeze = t >= jnp.asarray(self.warmup_steps, t.dtype)",
    "may_freeze = t > jnp.asarray(self.warmup_steps, t.dtype)",
    T_FREEZE,
    "freezing allowed one step after warmup_steps",
  ),
  Mutant(
    "freeze_bias_correction_dropped",
    "grpo_optax/freezing.py",
    "bc = _common.bias_correction(decay, _common.safe_increment(t))",
    "bc = 1.0",
    T_FREEZE,
    "no bias correction of the importance EMA",
    equivalent="every leaf's EMA has the same bias factor 1 - d^(t+1), and"
    " the decision compares I_l / bc with the mean of I / bc: the factor"
    " cancels (up to the 1e-30 guard)",
  ),
  # -- presets.py: stage order and keyword routing --------------------------
  Mutant(
    "preset_importance_decay_gets_freeze_decay",
    "grpo_optax/presets.py",
    '"freeze_decay",\n    0.9,\n    "freeze.decay",\n',
    '"freeze_decay",\n    0.9,\n    "freeze.decay",\n    "importance.decay",\n',
    knob_tests("importance_decay"),
    "importance_decay routed from freeze_decay: freeze_decay's WIRING row"
    " also names importance.decay, and being the later row it wins (the"
    " equality test of test_preset_wiring.py reads the same table, so the"
    " keyword-changes-the-update test is the killer)",
  ),
  Mutant(
    "preset_seed_dropped",
    "grpo_optax/presets.py",
    '"topk.seed",\n    "threshold.seed",',
    '"threshold.seed",',
    (
      "tests/test_preset_wiring.py::test_shared_mask_keywords_reach_both_masks",
      *knob_tests("seed"),
    ),
    "seed not passed to the top-k: its WIRING row lost topk.seed",
  ),
  Mutant(
    "preset_eps_root_gets_eps",
    "grpo_optax/presets.py",
    '"eps_root", 0.0, "adaptive.eps_root"',
    '"eps_root", 0.0, "adaptive.eps"',
    knob_tests("eps"),
    "eps and eps_root confused in the wiring: eps_root's WIRING row names"
    " adaptive.eps (eps_root ignored, eps overwritten by eps_root's value)",
  ),
  Mutant(
    "preset_variance_reduction_dropped",
    "grpo_optax/presets.py",
    '"variance_reduction",\n    "leaf",\n    "variance.reduction",',
    '"variance_reduction",\n    "leaf",',
    T_WIRING + knob_tests("variance_reduction"),
    "variance_reduction not passed on: its WIRING row names no field (the"
    " keyword is accepted and ignored)",
  ),
  Mutant(
    "preset_default_topk_exact",
    "grpo_optax/presets.py",
    '_k("topk_method", "sampled", "topk.method"',
    '_k("topk_method", "exact", "topk.method"',
    T_WIRING,
    "the default top-k is exact (sorts every leaf)",
  ),
  # -- _common.py -----------------------------------------------------------
  Mutant(
    "bias_correction_one_step_ahead",
    "grpo_optax/_common.py",
    "return 1 - jnp.asarray(decay, jnp.float32) ** count.astype(jnp.float32)",
    "return 1 - jnp.asarray(decay, jnp.float32) ** (\n"
    "      count.astype(jnp.float32) + 1)",
    T_VAR + T_IMP,
    "bias correction 1 - d^(t+2)",
  ),
  Mutant(
    "sampled_moments_weighted_by_sample",
    "grpo_optax/_common.py",
    "self.total += n\n"
    "    for k, v in samples.items():\n"
    "      self.parts.setdefault(k, []).append((jnp.asarray(v, jnp.float32), n))",
    "self.total += min(n, SAMPLE_PER_LEAF)\n"
    "    for k, v in samples.items():\n"
    "      self.parts.setdefault(k, []).append(\n"
    "        (jnp.asarray(v, jnp.float32), min(n, SAMPLE_PER_LEAF))\n"
    "      )",
    T_IMP,
    "diagnostics weight a leaf by its sample size, not its size",
  ),
  # -- training/ ------------------------------------------------------------
  Mutant(
    "frozen_step_cache_fifo",
    "grpo_optax/training/freezing.py",
    "      self._cache.move_to_end(key)\n",
    "      pass\n",
    (
      "tests/test_training_freezing.py::"
      "test_cache_keyed_by_mask_and_device_masks",
    ),
    "the compiled-step cache evicts the oldest, not the least recent",
  ),
  Mutant(
    "hierarchical_skip_differentiates_everything",
    "grpo_optax/training/hierarchical.py",
    "_tree.value_and_grad_subset(self.loss_fn, params, mask, batch)",
    "_tree.value_and_grad_subset(self.loss_fn, params,\n"
    "                                         (True,) * len(mask), batch)",
    (
      "tests/test_training_hierarchical.py::"
      "test_skip_step_saves_exactly_the_noncore_weight_gradients",
    ),
    "the skip step differentiates every leaf, then uses the estimates",
    equivalent="the non-core gradients it computes are never used, and"
    " XLA removes the dead matmuls: cost_analysis() gives the same FLOPs"
    " as the unmutated skip step (measured); the saving needs the"
    " non-core gradients to be unused, which both forms guarantee",
  ),
  Mutant(
    "hierarchical_core_rule_inverted",
    "grpo_optax/training/hierarchical.py",
    "return _NONCORE_RE.search(path) is None",
    "return _NONCORE_RE.search(path) is not None",
    (
      "tests/test_training_hierarchical.py::"
      "test_skip_step_saves_exactly_the_noncore_weight_gradients",
    ),
    "core and non-core swapped: the skip step saves the wrong matmuls",
  ),
  Mutant(
    "hierarchical_momentum_bias_power",
    "grpo_optax/training/hierarchical.py",
    "bc = 1 - jnp.asarray(beta, jnp.float32) ** c",
    "bc = 1 - jnp.asarray(beta, jnp.float32) ** (c + 1)",
    (
      "tests/test_training_hierarchical.py::"
      "test_momentum_is_bias_corrected_ema",
      "tests/test_training_hierarchical.py::"
      "test_skip_gradient_is_exact_for_core",
    ),
    "momentum estimate corrected with 1 - beta^(k+1)",
  ),
  # -- re-targeted to the rooms (issue 18) ---------------------------------
  # Deleted with the one-pass form they mutated (its code no longer
  # exists): fused_fisher_from_last_step_at_output (Fisher from Adam's nu),
  # fused_variance_with_nesterov_correction and
  # fused_global_variance_unweighted (variance from Adam's moments),
  # fused_freeze_mean_over_all_leaves, fused_normaliser_without_bias_correction
  # and fused_output_weight_not_applied (importance and freezing inside the
  # fused form), fused_schedule_one_step_ahead (the learning rate is now
  # optax.scale_by_learning_rate in the chain), fused_residual_is_the_kept_part
  # (the fused core keeps acc = g + r, no residual split: see
  # residual_of_* and fused_update_sees_the_dropped_part),
  # topk_positions_not_coprime (coprime strides gave way to grid samples:
  # see grid_strides_not_shard_aligned), formulas_taylor_half_dropped
  # (the Taylor term lives only in importance.py:
  # importance_second_order_coefficient_1). topk_score_ignores_residual and
  # threshold_residual_not_added became accumulate_drops_the_residual (both
  # masks and the fused core now add the residual in one function).
  # -- re-targeted to the configs (issue 30) -------------------------------
  # The fused core composes the mechanisms' own config methods
  # (clipping.clip_leaves, TopKMaskConfig.threshold_phase, momentum.adam_update
  # and step_scalars), so most fused_* mutants now mutate those, shared with
  # the chain: tests/test_one_algorithm.py cannot see them there, the rooms'
  # references and tests/test_fused.py's optax limits do. grpo() reads its
  # keywords from presets.WIRING, and tests/test_preset_wiring.py builds its
  # explicit chain from the same table, so a row routing a keyword to the
  # wrong field is killed by test_shared_mask_keywords_reach_both_masks or
  # by test_one_algorithm.py's keyword test (knob_tests), not by the
  # equality test. Replaced where the old bug cannot exist any more (said
  # in their descriptions): fused_update_sees_the_unmasked_gradient (one
  # masked expression feeds Adam's moments and update),
  # preset_core_error_feedback_fixed and preset_core_seed_dropped (the fused
  # core reads the chain's own mask config).
  # -- sparsify.py ----------------------------------------------------------
  Mutant(
    "topk_sampled_087_fraction",
    "grpo_optax/sparsify.py",
    "target = fraction * m",
    "target = 0.87 * fraction * m",
    sp("test_sampled_topk_keeps_close_to_target"),
    "the sampled top-k asks for 0.87x the fraction",
  ),
  Mutant(
    "topk_sampled_087_fraction_sampled_leaves_only",
    "grpo_optax/sparsify.py",
    "target = fraction * m",
    "target = fraction * m * (0.87 if m >= 1024 else 1.0)",
    sp("test_sampled_topk_keeps_close_to_target"),
    "0.87x the fraction, only where a leaf is sampled (leaves used whole"
    " keep about k): the statistical bound alone must see it",
  ),
  Mutant(
    "topk_exact_floor_k",
    "grpo_optax/sparsify.py",
    "else math.ceil(static_fraction * a.size))",
    "else math.floor(static_fraction * a.size))",
    sp("test_exact_topk_keeps_exactly_k_largest"),
    "k = floor(f n) instead of ceil(f n)",
  ),
  Mutant(
    "topk_residual_keeps_the_kept",
    "grpo_optax/sparsify.py",
    "residuals.append(res)",
    "residuals.append(out)",
    sp(
      "test_error_feedback_loses_nothing",
      "test_exact_topk_residual_drains_after_zeros",
    ),
    "exact top-k error feedback stores the kept part",
  ),
  Mutant(
    "accumulate_drops_the_residual",
    "grpo_optax/sparsify.py",
    "return g + residual_of(acc, threshold).astype(g.dtype)",
    "return g",
    sp(
      "test_error_feedback_loses_nothing",
      "test_exact_topk_residual_drains_after_zeros",
      "test_threshold_residual_drains_after_zeros",
    ),
    "a = g: the error-feedback residual is never added back (both masks"
    " and the fused core)",
  ),
  Mutant(
    "residual_of_ignores_the_sentinel",
    "grpo_optax/sparsify.py",
    "jnp.where(threshold >= 0, threshold, jnp.inf)",
    "jnp.where(threshold >= 0, threshold, threshold)",
    sp(
      "test_error_feedback_loses_nothing",
      "test_exact_topk_residual_drains_after_zeros",
    ),
    "a threshold < 0 (the accumulator is the residual) read as a"
    " threshold: the exact top-k's residual is dropped",
  ),
  Mutant(
    "residual_of_keeps_the_kept",
    "grpo_optax/sparsify.py",
    "return jnp.where(jnp.abs(acc) >= bound, jnp.zeros_like(acc), acc)",
    "return jnp.where(jnp.abs(acc) >= bound, acc, jnp.zeros_like(acc))",
    sp("test_error_feedback_loses_nothing"),
    "the residual read from the accumulator is its kept part",
  ),
  Mutant(
    "topk_frequency_ema_swapped",
    "grpo_optax/sparsify.py",
    "_common.ema(f, k, self.frequency_decay)",
    "_common.ema(k, f, self.frequency_decay)",
    sp("test_frequency_weight_matches_numpy_reference"),
    "kept-indicator EMA with the weights swapped",
  ),
  Mutant(
    "topk_frequency_sign",
    "grpo_optax/sparsify.py",
    "- frequency_weight * f\n",
    "+ frequency_weight * f\n",
    sp(
      "test_frequency_weight_matches_numpy_reference",
      "test_frequency_weight_rotates_kept_entries",
    ),
    "frequently kept entries favoured instead of penalised",
  ),
  Mutant(
    "topk_warmup_one_step_ahead",
    "grpo_optax/sparsify.py",
    "jnp.minimum(count.astype(jnp.float32), w) / w)",
    "jnp.minimum(count.astype(jnp.float32) + 1, w) / w)",
    sp("test_warmup_ramps_from_dense_to_fraction"),
    "warm-up exponent (t + 1) / T",
  ),
  Mutant(
    "topk_warmup_exponent_inverted",
    "grpo_optax/sparsify.py",
    "jnp.minimum(count.astype(jnp.float32), w) / w)",
    "(w - jnp.minimum(count.astype(jnp.float32), w)) / w)",
    sp("test_warmup_ramps_from_dense_to_fraction"),
    "warm-up ramps from fraction to dense",
  ),
  Mutant(
    "topk_min_size_inclusive",
    "grpo_optax/sparsify.py",
    "return size < static",
    "return size <= static",
    sp("test_min_size_passes_small_leaves_dense"),
    "a leaf of exactly min_size entries passes dense",
  ),
  Mutant(
    "topk_min_size_ignored",
    "grpo_optax/sparsify.py",
    "freq = _flat_or_none(state.frequency, treedef, n)\n"
    "    dense = [dense_leaf(g.size, self.min_size) for g in leaves]",
    "freq = _flat_or_none(state.frequency, treedef, n)\n"
    "    dense = [False for g in leaves]",
    sp("test_min_size_passes_small_leaves_dense"),
    "the exact (and frequency-weighted) top-k masks leaves smaller than"
    " min_size",
  ),
  Mutant(
    "threshold_min_size_ignored",
    "grpo_optax/sparsify.py",
    "dense = [dense_leaf(g.size, self.min_size) for g in leaves]\n"
    "    a_leaves, stored, maxima = _accumulated(\n"
    "      self, leaves, state, treedef, dense, x_bounds\n"
    "    )\n"
    "    found, tau = threshold_leaf_thresholds(",
    "dense = [False for g in leaves]\n"
    "    a_leaves, stored, maxima = _accumulated(\n"
    "      self, leaves, state, treedef, dense, x_bounds\n"
    "    )\n"
    "    found, tau = threshold_leaf_thresholds(",
    sp("test_ema_threshold_min_size_passes_small_leaves_dense"),
    "ema_threshold_mask masks leaves smaller than min_size",
  ),
  Mutant(
    "keep_mask_keeps_zeros",
    "grpo_optax/sparsify.py",
    "return (jnp.abs(a) >= threshold) & (a != 0)",
    "return jnp.abs(a) >= threshold",
    sp("test_sampled_topk_zeros_carry_nothing") + T_FUSED,
    "exact zeros count as kept (kept-fraction diagnostic)",
  ),
  Mutant(
    "topk_bisection_returns_upper_bound",
    "grpo_optax/sparsify.py",
    "lo, _, count = jax.lax.fori_loop(0, 31, body, start)",
    "_, lo, count = jax.lax.fori_loop(0, 31, body, start)",
    sp("test_sampled_topk_keeps_close_to_target"),
    "threshold from the bisection's upper end (keeps < k)",
  ),
  Mutant(
    "topk_bisection_kept_over_target",
    "grpo_optax/sparsify.py",
    "count.astype(jnp.float32) / m,",
    "count.astype(jnp.float32) / target,",
    ("tests/test_fused.py::test_kept_fraction_of_the_sampled_top_k",),
    "kept fraction from the bisection's count divided by the target count,"
    " not the sample size",
  ),
  Mutant(
    "topk_keep_all_drops_below_minimum",
    "grpo_optax/sparsify.py",
    "keep_all = jnp.asarray(fraction) >= 1",
    "keep_all = jnp.asarray(fraction) > 1",
    sp("test_sampled_topk_warmup_first_step_is_dense"),
    "fraction 1 (warm-up's first step) keeps only entries >= the sample's"
    " minimum",
  ),
  Mutant(
    "random_offsets_not_advanced",
    "grpo_optax/sparsify.py",
    "c = _common.mix32(count.astype(jnp.uint32) * jnp.uint32(0x85EBCA77) + s)",
    "c = _common.mix32(s)",
    sp("test_sampled_positions_move_every_step"),
    "the sample's offsets are the same at every step (the count is not"
    " hashed into the draw)",
  ),
  Mutant(
    "grid_strides_not_shard_aligned",
    "grpo_optax/_common.py",
    "align = math.gcd(n, _SHARD_ALIGN) if n else 1",
    "align = 1",
    sp("test_grid_sample_is_local_to_every_shard")
    + (
      "tests/test_sharding.py::"
      "test_update_has_no_all_gather_and_scalar_sized_collectives"
      "[topk-auto]",
    ),
    "grid strides that do not divide a shard: the sample crosses shard"
    " boundaries",
  ),
  Mutant(
    "threshold_refresh_condition",
    "grpo_optax/sparsify.py",
    "refresh = (count == 0) | (count % jnp.asarray(every, count.dtype) == 0)",
    "refresh = (count == 0) | (count % jnp.asarray(every, count.dtype) == 1)",
    sp(
      "test_ema_threshold_matches_numpy_reference",
      "test_ema_threshold_tau_moves_only_every_n_steps",
    ),
    "tau refreshed at t % N == 1",
  ),
  Mutant(
    "threshold_refreshes_every_step",
    "grpo_optax/sparsify.py",
    "refresh = (count == 0) | (count % jnp.asarray(every, count.dtype) == 0)",
    "refresh = count >= 0",
    sp(
      "test_ema_threshold_matches_numpy_reference",
      "test_ema_threshold_tau_moves_only_every_n_steps",
    ),
    "EMA threshold moved at every step, not every N",
  ),
  Mutant(
    "threshold_tau_ema_swapped",
    "grpo_optax/sparsify.py",
    "alpha * mean_abs + (1 - alpha) * tau)",
    "(1 - alpha) * mean_abs + alpha * tau)",
    sp("test_ema_threshold_matches_numpy_reference"),
    "tau EMA with alpha on the old value",
  ),
  Mutant(
    "threshold_strict_inequality",
    "grpo_optax/sparsify.py",
    "return (jnp.abs(a) >= threshold) & (a != 0)",
    "return (jnp.abs(a) > threshold) & (a != 0)",
    sp("test_ema_threshold_keeps_entries_at_the_threshold"),
    "|a| > tau instead of |a| >= tau",
  ),
  Mutant(
    "threshold_scale_ignored",
    "grpo_optax/sparsify.py",
    "thr = (scale * tau).astype(jnp.float32)",
    "thr = tau.astype(jnp.float32)",
    sp("test_ema_threshold_matches_numpy_reference"),
    "threshold multiplier ignored",
  ),
  Mutant(
    "metrics_residual_norm_squared",
    "grpo_optax/sparsify.py",
    'out["residual_norm"] = jnp.sqrt(sum(',
    'out["residual_norm"] = (sum(',
    T_METRICS,
    "residual norm without the square root",
  ),
  Mutant(
    "metrics_tau_max",
    "grpo_optax/sparsify.py",
    'out["tau_mean"] = (jnp.mean(self.tau) if self.tau.size',
    'out["tau_mean"] = (jnp.max(self.tau) if self.tau.size',
    T_METRICS,
    "tau_mean is the largest tau",
  ),
  # -- momentum.py ----------------------------------------------------------
  Mutant(
    "nesterov_gradient_bias_correction_step",
    "grpo_optax/momentum.py",
    "omb1 / bc1,",
    "omb1 / bc1_next,",
    T_MOM + T_FUSED,
    "Nesterov's gradient term corrected with 1 - b1^(t+2)",
  ),
  Mutant(
    "mix_weights_swapped",
    "grpo_optax/momentum.py",
    "return adam_weight * adam + (1 - adam_weight) * rms",
    "return (1 - adam_weight) * adam + adam_weight * rms",
    T_MOM + T_FUSED,
    "adam_weight applied to RMSProp",
  ),
  Mutant(
    "adam_eps_root_dropped",
    "grpo_optax/momentum.py",
    "else nu_hat + eps_root",
    "else nu_hat",
    T_MOM + T_FUSED,
    "eps_root ignored",
  ),
  Mutant(
    "second_moment_decay_b1",
    "grpo_optax/momentum.py",
    "b2 * nu + omb2 * _common.abs_sq(m)",
    "b1 * nu + omb1 * _common.abs_sq(m)",
    T_MOM + T_FUSED,
    "second moment decays with b1 (adam_moments)",
  ),
  Mutant(
    "moment_dtype_float16_not_widened",
    "grpo_optax/momentum.py",
    "jnp.dtype(jnp.float32) if dtype == jnp.float16 else dtype",
    "dtype",
    (
      "tests/test_dropin.py::test_float16_params_keep_float32_moments",
      "tests/test_momentum.py::"
      "test_requested_moment_dtypes_are_kept_for_float16_params",
    ),
    "float16 params keep float16 moments (a squared 1e-4 underflows)",
  ),
  Mutant(
    "moment_dtype_request_ignored_for_float16",
    "grpo_optax/momentum.py",
    "if requested is not None:\n    return jnp.dtype(requested)",
    "if requested is not None and jnp.dtype(param_dtype) != jnp.float16:\n"
    "    return jnp.dtype(requested)",
    (
      "tests/test_momentum.py::"
      "test_requested_moment_dtypes_are_kept_for_float16_params",
    ),
    "nu_dtype / mu_dtype ignored for float16 params",
  ),
  # -- fused.py -------------------------------------------------------------
  Mutant(
    "fused_moments_see_the_unmasked_gradient",
    "grpo_optax/fused.py",
    "m_leaves = _masked(a_leaves, thr)",
    "m_leaves = list(a_leaves)",
    T_ONE + T_FUSED,
    "Adam's moments updated with the gradient before the mask (the fused"
    " core hands one masked gradient to momentum.adaptive_step, which feeds"
    " the moments and the update alike, so the update sees it too)",
  ),
  Mutant(
    "fused_update_sees_the_unmasked_gradient",
    "grpo_optax/fused.py",
    "m_leaves = _masked(a_leaves, thr)",
    "m_leaves = _masked(x_leaves, thr)",
    T_ONE + T_FUSED,
    "replaced (the moments and the update now read one masked expression,"
    " so the update cannot see another gradient than the moments): Adam"
    " reads the clipped gradient before the error-feedback residual is"
    " added, masked by the thresholds of a = g + r",
  ),
  Mutant(
    "fused_update_sees_the_dropped_part",
    "grpo_optax/fused.py",
    "a if th is None else sparsify.masked_part(a, th)",
    "a if th is None else a - sparsify.masked_part(a, th)",
    T_ONE + T_FUSED,
    "Adam's gradient (moments and update) is the masked-out part",
  ),
  Mutant(
    "fused_nesterov_next_correction_is_current",
    "grpo_optax/momentum.py",
    "bc1_next = _common.bias_correction(cfg.b1, _common.safe_increment(t1))",
    "bc1_next = _common.bias_correction(cfg.b1, t1)",
    T_FUSED + T_MOM,
    "NAdam's look-ahead corrected with 1 - b1^(t+1) (momentum.step_scalars,"
    " which the fused core and the chain share)",
  ),
  Mutant(
    "fused_mu_not_bias_corrected",
    "grpo_optax/momentum.py",
    "mu_hat = mu * inv_bc1.astype(mu.dtype)",
    "mu_hat = mu",
    T_FUSED + T_MOM,
    "plain Adam's first moment without bias correction"
    " (momentum.adam_update, the fused core's Adam)",
  ),
  Mutant(
    "fused_rms_correction_inverted",
    "grpo_optax/momentum.py",
    "nu_hat if rms_bias_correction else nu,",
    "nu if rms_bias_correction else nu_hat,",
    T_FUSED + T_MOM,
    "rms_bias_correction inverted (momentum.adam_update, the fused core's Adam)",
  ),
  Mutant(
    "fused_l2_only_in_the_norm",
    "grpo_optax/clipping.py",
    "a = g if p_leaves is None else g + l2 * p_leaves[i]",
    "a = g",
    T_CLIP + T_FUSED,
    "the clip (clipping.clip_leaves, the fused core's and the chain's)"
    " leaves the coupled L2 term out of the update: it is only in the norm",
  ),
  Mutant(
    "fused_clip_state_not_advanced",
    "grpo_optax/fused.py",
    "clip_state = clipping.next_state(state.clip, norm, clip.max_norm)",
    "clip_state = state.clip",
    T_ONE + T_FUSED,
    "the fused clip's counters never move",
  ),
  Mutant(
    "fused_mask_count_not_advanced",
    "grpo_optax/sparsify.py",
    "count=_common.safe_increment(t),\n"
    "        accumulator=stored,\n"
    "        thresholds=found.vector + 0 * state.thresholds,\n"
    "        frequency=None,",
    "count=t,\n"
    "        accumulator=stored,\n"
    "        thresholds=found.vector + 0 * state.thresholds,\n"
    "        frequency=None,",
    sp("test_sampled_topk_warmup_ramps_from_dense_to_fraction") + T_FUSED,
    "the sampled top-k's count stays 0 (warm-up and draws frozen):"
    " TopKMaskConfig.threshold_phase, which the fused core calls",
  ),
  Mutant(
    "fused_accumulator_stores_the_gradient",
    "grpo_optax/sparsify.py",
    "stored, a_leaves, maxima = store_accumulator(\n    a_leaves,",
    "stored, _, maxima = store_accumulator(\n    leaves,",
    T_FUSED + sp("test_error_feedback_loses_nothing"),
    "the accumulator holds g, not g + r (sparsify._accumulated, which the"
    " fused core's threshold_phase and both masks call)",
  ),
  Mutant(
    "fused_min_size_ignored",
    "grpo_optax/sparsify.py",
    "dense = [dense_leaf(g.size, self.min_size) for g in leaves]\n"
    "    a_leaves, stored, maxima = _accumulated(\n"
    "      self, leaves, state, treedef, dense, x_bounds\n"
    "    )\n"
    "    frac = warmup_fraction(",
    "dense = [False for g in leaves]\n"
    "    a_leaves, stored, maxima = _accumulated(\n"
    "      self, leaves, state, treedef, dense, x_bounds\n"
    "    )\n"
    "    frac = warmup_fraction(",
    sp("test_sampled_topk_min_size_passes_small_leaves_dense") + T_FUSED,
    "the sampled top-k (TopKMaskConfig.threshold_phase, the fused core's"
    " mask) masks small leaves too",
  ),
  # -- clipping.py ----------------------------------------------------------
  Mutant(
    "clip_factor_inverted",
    "grpo_optax/clipping.py",
    "return jnp.minimum(1.0, max_norm / norm)",
    "return jnp.minimum(1.0, norm / max_norm)",
    T_CLIP + T_FUSED,
    "clip factor norm / max_norm (both forms use it)",
  ),
  Mutant(
    "clip_always_rescales",
    "grpo_optax/clipping.py",
    "return jnp.minimum(1.0, max_norm / norm)",
    "return max_norm / norm",
    T_CLIP,
    "scale max_norm / n also when n < max_norm",
  ),
  Mutant(
    "clip_l2_norm_cross_term_sign",
    "grpo_optax/clipping.py",
    "gg + 2 * l2 * gp + l2 * l2 * pp",
    "gg - 2 * l2 * gp + l2 * l2 * pp",
    T_CLIP,
    "||g + l2 p||^2 expanded with - 2 l2 <g, p>",
  ),
  Mutant(
    "clip_l2_added_after_clipping",
    "grpo_optax/clipping.py",
    "outs.append((a * scale).astype(g.dtype))",
    "outs.append((g * scale + (a - g)).astype(g.dtype))",
    T_CLIP,
    "L2 term added after the clip",
  ),
  Mutant(
    "metrics_clip_rate_off_by_one",
    "grpo_optax/clipping.py",
    "self.clipped.astype(jnp.float32) / jnp.maximum(\n"
    "        self.count.astype(jnp.float32), 1.0)",
    "self.clipped.astype(jnp.float32) / (\n"
    "        self.count.astype(jnp.float32) + 1.0)",
    T_METRICS,
    "clip rate divided by steps + 1",
  ),
  # -- freezing.py, importance.py, diagnostics.py ---------------------------
  Mutant(
    "freeze_importance_without_abs",
    "grpo_optax/freezing.py",
    "_common.mean32(jnp.abs(",
    "_common.mean32((",
    T_FREEZE,
    "importance mean(g p) instead of mean|g p|",
  ),
  Mutant(
    "metrics_frozen_fraction",
    "grpo_optax/freezing.py",
    '"frozen_fraction": k.astype(jnp.float32) / max(n, 1),',
    '"frozen_fraction": k.astype(jnp.float32) / max(n + 1, 1),',
    T_METRICS,
    "frozen fraction over leaves + 1",
  ),
  Mutant(
    "metrics_weights_over_max",
    "grpo_optax/importance.py",
    "_common.mean32(s) + 1e-12) for s in jax.tree.leaves(self.score)",
    "jnp.max(s) + 1e-12) for s in jax.tree.leaves(self.score)",
    T_METRICS,
    "importance/weights = S / max(S)",
  ),
  Mutant(
    "importance_weight_unclipped",
    "grpo_optax/importance.py",
    "return jnp.clip(ratio, min_weight, max_weight)",
    "return ratio",
    T_IMP,
    "importance weights not clipped",
  ),
  Mutant(
    "converged_without_a_step",
    "grpo_optax/diagnostics.py",
    "ok = ok & (s.count > 0) & (s.score_std < std_below)",
    "ok = ok & (s.score_std < std_below)",
    T_METRICS,
    "early stop before the first step",
  ),
  # -- _common.py -----------------------------------------------------------
  Mutant(
    "ema_weights_swapped",
    "grpo_optax/_common.py",
    "return decay * old + (1 - decay) * new",
    "return (1 - decay) * old + decay * new",
    T_FUSED,
    "the shared EMA weights the new value by decay",
  ),
  Mutant(
    "abs_sq_complex_as_square",
    "grpo_optax/_common.py",
    "return jnp.real(x) ** 2 + jnp.imag(x) ** 2",
    "return jnp.real(x * x)",
    T_FUSED,
    "|x|^2 of a complex x as re(x^2)",
  ),
  Mutant(
    "stack_reverses_the_leaves",
    "grpo_optax/_common.py",
    "out = jnp.stack(jax.lax.optimization_barrier(values))",
    "out = jnp.stack(jax.lax.optimization_barrier(values[::-1]))",
    T_FREEZE + sp("test_ema_threshold_matches_numpy_reference"),
    "per-leaf scalars stacked in reverse leaf order (unstack reads them"
    " in tree order)",
  ),
  # -- presets.py: stage order and keyword routing --------------------------
  Mutant(
    "preset_variance_before_output_importance",
    "grpo_optax/presets.py",
    'if values["variance_coef"] is not None:\n'
    '    stages.append(_Stage(("variance",), cfgs["variance"].transform()))',
    'if values["variance_coef"] is not None:\n'
    '    output_imp = values["importance"] and (\n'
    '      values["importance_placement"] == "output"\n'
    "    )\n"
    "    stages.insert(\n"
    "      len(stages) - output_imp,\n"
    '      _Stage(("variance",), cfgs["variance"].transform()),\n'
    "    )",
    T_WIRING,
    "variance rate before the output-placed importance (_stages inserts it"
    " ahead of that stage; swapping the two blocks cannot be anchored across"
    " the condition that ruff parenthesises at other widths)",
  ),
  Mutant(
    "preset_freeze_before_learning_rate",
    "grpo_optax/presets.py",
    '  stages.append(_Stage(("schedule",), lr))\n'
    '  if values["freeze_threshold"] is not None:\n'
    '    stages.append(_Stage(("freeze",), cfgs["freeze"].transform()))\n',
    '  if values["freeze_threshold"] is not None:\n'
    '    stages.append(_Stage(("freeze",), cfgs["freeze"].transform()))\n'
    '  stages.append(_Stage(("schedule",), lr))\n',
    T_WIRING,
    "freezing before the learning rate (_stages' order)",
  ),
  Mutant(
    "preset_weight_decay_after_learning_rate",
    "grpo_optax/presets.py",
    '  if values["weight_decay"] is not None:\n'
    "    decay = optax.add_decayed_weights(\n"
    '      values["weight_decay"], values["weight_decay_mask"]\n'
    "    )\n"
    '    stages.append(_Stage(("decay",), decay))\n'
    '  lr = optax.scale_by_learning_rate(values["learning_rate"])\n'
    '  stages.append(_Stage(("schedule",), lr))\n',
    '  lr = optax.scale_by_learning_rate(values["learning_rate"])\n'
    '  stages.append(_Stage(("schedule",), lr))\n'
    '  if values["weight_decay"] is not None:\n'
    "    decay = optax.add_decayed_weights(\n"
    '      values["weight_decay"], values["weight_decay_mask"]\n'
    "    )\n"
    '    stages.append(_Stage(("decay",), decay))\n',
    T_WIRING,
    "decoupled weight decay added after the learning rate (_stages' order)",
  ),
  Mutant(
    "preset_threshold_error_feedback_fixed",
    "grpo_optax/presets.py",
    '"topk.error_feedback",\n    "threshold.error_feedback",',
    '"topk.error_feedback",',
    (
      "tests/test_preset_wiring.py::test_shared_mask_keywords_reach_both_masks",
    ),
    "error_feedback not passed to the threshold mask: its WIRING row lost"
    " threshold.error_feedback (the equality test reads the same row)",
  ),
  Mutant(
    "preset_core_error_feedback_fixed",
    "grpo_optax/presets.py",
    "core = fused_lib.clip_mask_adam(clip=clip, mask=mask, adam=adam)",
    "core = fused_lib.clip_mask_adam(\n"
    "      clip=clip,\n"
    "      mask=mask and (mask._set(error_feedback=True) or mask),\n"
    "      adam=adam,\n"
    "    )",
    T_ONE,
    "replaced (the fused core now reads the chain's own mask config): the"
    " fused core's mask config gets error_feedback=True after validation"
    " (set where _core_stages hands it to clip_mask_adam; the chain keeps"
    " the keyword's value)",
  ),
  Mutant(
    "preset_core_seed_dropped",
    "grpo_optax/presets.py",
    "core = fused_lib.clip_mask_adam(clip=clip, mask=mask, adam=adam)",
    "core = fused_lib.clip_mask_adam(\n"
    "      clip=clip,\n"
    "      mask=mask and (mask._set(seed=0) or mask),\n"
    "      adam=adam,\n"
    "    )",
    T_ONE,
    "replaced (the fused core now reads the chain's own mask config): the"
    " fused core's mask config gets seed=0 after validation (set where"
    " _core_stages hands it to clip_mask_adam; the chain keeps the"
    " keyword's seed)",
  ),
  Mutant(
    "preset_l2_lost_without_max_norm",
    "grpo_optax/presets.py",
    'if values["max_norm"] is not None or values["l2"] is not None',
    'if values["max_norm"] is not None',
    T_WIRING + T_ONE,
    "l2 dropped when max_norm=None: _core_stages builds the clip stage only"
    " for a max_norm (both forms: the decision is shared now)",
  ),
  Mutant(
    "preset_core_l2_lost_without_max_norm",
    "grpo_optax/presets.py",
    "core = fused_lib.clip_mask_adam(clip=clip, mask=mask, adam=adam)",
    "core = fused_lib.clip_mask_adam(\n"
    '      clip=clip if values["max_norm"] is not None else None,\n'
    "      mask=mask,\n"
    "      adam=adam,\n"
    "    )",
    (
      "tests/test_fused.py::"
      "test_coupled_l2_without_clipping_reaches_the_fused_core",
    ),
    "l2 dropped from the fused core when max_norm=None (where _core_stages"
    " hands the clip config to clip_mask_adam)",
  ),
  # -- zclip.py -------------------------------------------------------------
  Mutant(
    "zclip_ema_weights_swapped",
    "grpo_optax/adaptive_clipping.py",
    "e_mean = a * state.mean + (1 - a) * clipped_norm",
    "e_mean = (1 - a) * state.mean + a * clipped_norm",
    T_ZCLIP,
    "the norms' mean EMA weights the new norm by alpha",
  ),
  Mutant(
    "zclip_statistics_see_the_unclipped_norm",
    "grpo_optax/adaptive_clipping.py",
    "e_mean = a * state.mean + (1 - a) * clipped_norm\n"
    "  e_var = a * state.var + (1 - a) * jnp.square(clipped_norm - e_mean)",
    "e_mean = a * state.mean + (1 - a) * norm\n"
    "  e_var = a * state.var + (1 - a) * jnp.square(norm - e_mean)",
    T_ZCLIP,
    "the EMAs take the norm before clipping: a spike raises the bound it"
    " was clipped to",
  ),
  Mutant(
    "zclip_warmup_one_step_longer",
    "grpo_optax/adaptive_clipping.py",
    "warm = t < jnp.asarray(cfg.warmup_steps, t.dtype)",
    "warm = t <= jnp.asarray(cfg.warmup_steps, t.dtype)",
    T_ZCLIP,
    "warm-up of warmup_steps + 1 steps (a spike right after it passes)",
  ),
]
