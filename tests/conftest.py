"""Test configuration: 8 forced host devices (set before jax is imported)."""

import os

_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  pylint: disable=g-import-not-at-top

jax.config.update("jax_default_matmul_precision", "highest")
