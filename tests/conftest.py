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
# README's test command; about 3 minutes on 2 cores); the slow tier,
# `pytest -m slow`, runs before a release (docs/development.md). Slow: what
# trains an example, spawns processes or runs a benchmark smoke test (marked
# in its file with @pytest.mark.slow or listed here), and every single test
# that took 4 s or more in a fast-tier run (tests/slow_tests.txt, written by
# tools/slow_tests.py from a junit report). The fast tier keeps at least one
# test of each mechanism, and the invariants of tools/slow_tests.py's
# KEEP_FAST: the fused core equals its chain, no all-gather on sharded
# leaves, error feedback loses nothing.
SLOW_FILES = frozenset(
  {
    "test_examples.py",  # trains the examples (a few steps each)
    "test_rl_example.py",  # trains the RL example, resume bit for bit
    "test_benchmarks_smoke.py",  # runs every benchmark at a tiny size
  }
)
SLOW_TESTS = (  # shell globs of "file::test_name[params]"
  # spawns two processes that train over jax.distributed
  "test_training_distributed.py::test_two_processes_give_the_single_process_params",
  # the contract checks of the preset's chain form (fused=False), the
  # costliest cases to compile (about 3x the others' CPU time per test);
  # the fast tier keeps every check on each chained stage and on the
  # default preset, and test_preset_wiring.py ties the chain to its stages
  "test_contract.py::*[[]grpo_*_chain[]]",
  # the preset's other costly contract cases (30-90 s each over the suite's
  # checks): the fast tier keeps them on grpo_defaults and grpo_topk
  "test_contract.py::*[[]grpo_topk_output_no_feedback[]]",
  "test_contract.py::*[[]grpo_dense_freeze[]]",
  "test_contract.py::*[[]grpo_threshold[]]",
)


def _listed(name: str) -> frozenset[str]:
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
  with open(path, encoding="utf-8") as f:
    lines = [s.strip() for s in f]
  return frozenset(s for s in lines if s and not s.startswith("#"))


SLOW_NAMES = _listed("slow_tests.txt")

# -- compile speed -----------------------------------------------------------
# Most of a test's time is XLA:CPU compiling small programs, and most of that
# is LLVM optimizing machine code the test runs a few times. Outside the slow
# tier, LLVM runs at -O0 without its expensive passes: the HLO (fusions,
# collectives, shardings: what the tests inspect) is the same, the numerics
# are IEEE either way (no fast-math), and a file's tests take about 40% less
# CPU. The slow tier (`-m slow`, which CI also runs) and GRPO_TESTS_XLA_OPT=1
# keep XLA's default optimization, so the optimized code path is tested too.
#
# The fast tier also turns off XLA:CPU's MLIR fusion emitters: the legacy
# emitters compile the suite's small programs in about half the time
# (measured: 24 grpo/adam updates, 2.3 s -> 1.0 s of compilation). They fuse
# differently, so the tests that count fusions, copies or temporary bytes
# compile with XLA's default (`compile_options.USER_DEFAULT`).
FAST_COMPILE_FLAGS = (
  "--xla_backend_optimization_level=0",
  "--xla_llvm_disable_expensive_passes=true",
  "--xla_cpu_use_fusion_emitters=false",
  # one LLVM module per program, not split for parallel codegen: xdist's two
  # workers already use both cores (fast tier 131 s -> 120 s).
  "--xla_cpu_parallel_codegen_split_count=1",
)


def fast_compile(markexpr: str, environ=os.environ) -> bool:
  """Whether a run with this ``-m`` expression compiles at low LLVM effort."""
  if environ.get("GRPO_TESTS_XLA_OPT") == "1":
    return False
  return markexpr.strip() != "slow"


def xla_accepts(flags, environ=os.environ) -> bool:
  """Whether this jaxlib's XLA starts with ``flags`` in XLA_FLAGS.

  XLA aborts the process at backend start on a flag it does not know, and
  a later jaxlib may drop one of FAST_COMPILE_FLAGS (they are tuning
  flags): a child process tries them first.
  """
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top

  env = {**environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
  code = "import jax.numpy as jnp; jnp.zeros(2).block_until_ready()"
  run = subprocess.run(
    [sys.executable, "-c", code], env=env, capture_output=True, timeout=300
  )
  return run.returncode == 0


# Set by the first pytest_configure (the xdist controller, or a plain run)
# to the FAST_COMPILE_FLAGS this jaxlib accepts; the workers inherit it.
ACCEPTED_ENV = "GRPO_TESTS_FAST_COMPILE_FLAGS"


def usable_fast_flags(
  environ=os.environ, candidates=FAST_COMPILE_FLAGS
) -> list[str]:
  """The ``candidates`` this jaxlib accepts (probed once per run)."""
  if ACCEPTED_ENV in environ:
    return environ[ACCEPTED_ENV].split()
  flags = list(candidates)
  if not xla_accepts(flags, environ):
    flags = [f for f in candidates if xla_accepts([f], environ)]
  environ[ACCEPTED_ENV] = " ".join(flags)
  return flags


def pytest_configure(config):
  # Runs before any test module is imported (and so before XLA's backend
  # starts and reads XLA_FLAGS), in the main process and in each xdist worker.
  if fast_compile(config.getoption("markexpr") or ""):
    flags = os.environ.get("XLA_FLAGS", "").split()
    given = {f.split("=")[0] for f in flags}
    flags += [f for f in usable_fast_flags() if f.split("=")[0] not in given]
    os.environ["XLA_FLAGS"] = " ".join(flags)


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
