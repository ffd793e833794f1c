"""Test configuration: 8 forced host devices (set before jax is imported)."""

import os

_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " " + _flag
  ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  pylint: disable=g-import-not-at-top

jax.config.update("jax_default_matmul_precision", "highest")


# -- test tiers ---------------------------------------------------------------
# The fast tier, `pytest -m "not slow"`, is the edit loop and what CI runs (the
# README's test command; about 8 minutes on 2 cores); the slow tier,
# `pytest -m slow`, runs before a release (docs/development.md). Slow: whatever trains an example, spawns
# processes, runs a benchmark or convergence smoke test, or takes more than
# about 10 s. A test can also be marked in its file with @pytest.mark.slow;
# these lists mark whole files and single tests in one place.
SLOW_FILES = frozenset(
  {
    "test_examples.py",  # trains the examples (a few steps each)
    "test_rl_example.py",  # trains the RL example, resume bit for bit
    "test_benchmarks_smoke.py",  # runs every benchmark at a tiny size
    "test_study.py",  # the study's greedy search on tiny tasks
  }
)
SLOW_TESTS = (  # shell globs of "file::test_name[params]"
  # spawns two processes that train over jax.distributed
  "test_training_distributed.py::test_two_processes_give_the_single_process_params",
  # the contract checks of the preset's chain form (fused=False), the
  # costliest cases to compile (about 3x the others' CPU time per test);
  # the fast tier keeps every check on each chained stage and on the
  # one-pass preset, and test_preset_wiring.py ties the chain to its stages
  "test_contract.py::*[[]grpo_*_chain[]]",
)


# Single tests of the fast tier that took 7 s or more of CPU time each
# (junit times of `pytest -n 2 -m "not slow"` on 2 cores, 2026-12-01): they
# run in the slow tier. The fast tier keeps at least one test of each
# mechanism and the three invariants named above each file's tests: the
# fused core equals its chain (top-k), no all-gather on sharded leaves
# (top-k, Auto mesh), error feedback loses nothing.
SLOW_NAMES = frozenset(
  {
    "test_diagnostics.py::test_metrics_from_nnx_optimizer_state",
    "test_diagnostics.py::test_metrics_identical_through_every_wrapper",
    "test_diagnostics.py::test_metrics_match_independent_values",
    "test_doctests.py::test_docstring_examples[grpo_optax.rl.losses]",
    "test_doctests.py::test_docstring_examples[grpo_optax.training.exchange]",
    "test_dropin.py::test_debug_modes_and_finite_state[article-jax_debug_infs]",
    "test_dropin.py::test_inject_hyperparams_equals_the_plain_preset[article]",
    "test_dropin.py::test_inject_hyperparams_with_bf16_params",
    "test_fused.py::test_complex_params_match_optax[None-None]",
    "test_fused.py::test_complex_params_with_topk_keep_the_error_feedback_invariant",
    "test_importance.py::test_head_entropy_multiplies_weights_per_head",
    "test_memory_benchmark.py::test_decoder_loss_is_finite_and_layers_stack",
    "test_nnx.py::test_head_entropy_scales_each_heads_update",
    "test_nnx.py::test_nnx_optimizer_trains_attention_model_with_head_entropy",
    "test_one_algorithm.py::test_fused_core_equals_the_chain_of_its_rooms[dense_importance_output]",
    "test_one_algorithm.py::test_fused_core_equals_the_chain_of_its_rooms[threshold_importance_input]",
    "test_one_algorithm.py::test_fused_core_equals_the_chain_of_its_rooms[topk_article]",
    "test_preset_wiring.py::test_grpo_equals_the_explicit_chain[article_defaults]",
    "test_preset_wiring.py::test_grpo_equals_the_explicit_chain[threshold]",
    "test_preset_wiring.py::test_grpo_equals_the_explicit_chain[topk_sampled]",
    "test_presets.py::test_schedule_and_inject_hyperparams",
    "test_presets.py::test_trains_with_one_compilation[topk_sampled]",
    "test_rl_batching.py::test_data_parallel_step_on_8_devices_equals_the_batch[grpo]",
    "test_rl_cached_sampling.py::test_cache_protocol_on_a_callable_is_exact",
    "test_rl_cached_sampling.py::test_cached_forward_equals_the_full_forward",
    "test_rl_cached_sampling.py::test_cached_sampler_equals_the_uncached_sampler[kwargs0]",
    "test_rl_cached_sampling.py::test_cached_sampler_equals_the_uncached_sampler[kwargs1]",
    "test_rl_cached_sampling.py::test_cached_sampler_equals_the_uncached_sampler[kwargs2]",
    "test_rl_cached_sampling.py::test_cached_sampler_equals_the_uncached_sampler[kwargs3]",
    "test_rl_cached_sampling.py::test_cached_sampler_equals_the_uncached_sampler[kwargs4]",
    "test_rl_truncation.py::test_on_policy_ratio_is_exactly_one_with_the_same_truncation[trunc0]",
    "test_sharding.py::test_exact_topk_warns_or_refuses_on_a_sharded_leaf[auto]",
    "test_sharding.py::test_map_params_recipe_lays_out_the_state[topk-auto]",
    "test_sharding.py::test_mask_stage_on_sharded_leaves_loses_nothing[top_k_mask-auto]",
    "test_sharding.py::test_masked_sharded_kept_fraction_matches_unsharded[topk-explicit]",
    "test_sparsify.py::test_error_feedback_loses_nothing[<lambda>2]",
    "test_sparsify.py::test_exact_topk_residual_drains_after_zeros",
    "test_training_distributed.py::test_two_dimensional_mesh_dense_within_sparse_across",
    "test_training_exchange.py::test_dgc_technique_matches_numpy_reference[all]",
    "test_training_exchange.py::test_dgc_technique_matches_numpy_reference[warmup]",
    "test_training_freezing.py::test_freezing_lowers_compiled_flops",
    "test_training_freezing.py::test_frozen_bit_identical_and_others_like_restricted_plain_step",
    "test_training_hierarchical.py::test_custom_rules_regex_callable_tree",
    "test_training_hierarchical.py::test_skip_gradient_is_exact_for_core[last]",
    "test_training_hierarchical.py::test_skip_step_saves_exactly_the_noncore_weight_gradients",
    "test_training_immediate.py::test_donated_step_deletes_inputs_and_lowers_peak",
    "test_training_immediate.py::test_layerwise_donates_and_lowers_peak_memory",
    "test_training_immediate.py::test_layerwise_grad_norm_and_previous_step_clipping",
    "test_training_immediate.py::test_layerwise_matches_plain_step[sgd]",
  }
)
# The preset's costliest contract cases (30-90 s each over the suite's
# checks): the fast tier keeps the checks on grpo_defaults and grpo_topk.
SLOW_TESTS += (
  "test_contract.py::*[[]grpo_topk_output_no_feedback[]]",
  "test_contract.py::*[[]grpo_dense_freeze[]]",
  "test_contract.py::*[[]grpo_threshold[]]",
)


def pytest_collection_modifyitems(config, items):
  del config  # unused
  import fnmatch  # pylint: disable=g-import-not-at-top

  import pytest  # pylint: disable=g-import-not-at-top

  for item in items:
    file = item.path.name
    name = f"{file}::{item.name}"
    if (
      file in SLOW_FILES
      or name in SLOW_NAMES
      or any(fnmatch.fnmatchcase(name, p) for p in SLOW_TESTS)
    ):
      item.add_marker(pytest.mark.slow)
