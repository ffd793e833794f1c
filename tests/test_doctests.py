"""The docstring examples of every public module run and print what they say."""

import doctest
import importlib

import pytest

MODULES = ["clipping", "diagnostics", "freezing", "importance", "momentum",
           "presets", "sparsify", "variance", "rl.advantages", "rl.config",
           "rl.losses", "rl.sampling", "training.distributed"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
  module = importlib.import_module(f"grpo_optax.{name}")
  result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
  assert result.failed == 0
