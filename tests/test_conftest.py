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
  for flag in conftest.FAST_COMPILE_FLAGS:
    assert (flag in flags) == want, (flag, flags)
  assert "--xla_force_host_platform_device_count=8" in flags
