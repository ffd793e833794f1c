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
# The fast tier, `pytest -m "not slow"`, is the edit loop (at most 3 minutes on
# 2 cores); CI runs both tiers. Slow: whatever trains an example, spawns
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


def pytest_collection_modifyitems(config, items):
  del config  # unused
  import fnmatch  # pylint: disable=g-import-not-at-top

  import pytest  # pylint: disable=g-import-not-at-top

  for item in items:
    file = item.path.name
    name = f"{file}::{item.name}"
    if file in SLOW_FILES or any(
      fnmatch.fnmatchcase(name, p) for p in SLOW_TESTS
    ):
      item.add_marker(pytest.mark.slow)
