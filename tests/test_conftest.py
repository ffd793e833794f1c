"""The test configuration's own switches (tests/conftest.py)."""

from __future__ import annotations

import os

import conftest


def test_fast_compile_everywhere_but_the_slow_tier():
  assert conftest.fast_compile("not slow", {})
  assert conftest.fast_compile("", {})
  assert conftest.fast_compile("not slow and not sharding", {})
  assert not conftest.fast_compile("slow", {})
  assert not conftest.fast_compile(" slow ", {})
  assert not conftest.fast_compile("not slow", {"GRPO_TESTS_XLA_OPT": "1"})


def test_this_run_compiles_as_configured(request):
  flags = os.environ.get("XLA_FLAGS", "").split()
  want = conftest.fast_compile(request.config.getoption("markexpr") or "")
  usable = os.environ.get(conftest.ACCEPTED_ENV, "").split()
  for flag in conftest.FAST_COMPILE_FLAGS:
    assert (flag in flags) == (want and flag in usable), (flag, flags)
  assert "--xla_force_host_platform_device_count=8" in flags


def test_a_flag_xla_does_not_know_is_left_out():
  # XLA aborts on an unknown flag; usable_fast_flags keeps the known ones.
  assert not conftest.xla_accepts(["--xla_grpo_no_such_flag=true"])
  environ = dict(os.environ)
  environ.pop(conftest.ACCEPTED_ENV, None)
  known = conftest.FAST_COMPILE_FLAGS[0]
  candidates = (known, "--xla_grpo_no_such_flag=true")
  assert conftest.usable_fast_flags(environ, candidates) == [known]
  assert environ[conftest.ACCEPTED_ENV] == known
  # Probed once: the next call (an xdist worker) reads the environment.
  assert conftest.usable_fast_flags(environ, ("--xla_grpo_other=1",)) == [known]
