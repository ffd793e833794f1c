"""The docstring examples of every library module run and print what they say."""

import doctest
import importlib
import pkgutil

import pytest

import grpo_optax

# Every module of the package, found by walking it: a new module's examples
# run without being listed here.
MODULES = sorted(
  m.name
  for m in pkgutil.walk_packages(grpo_optax.__path__, prefix="grpo_optax.")
)


def test_modules_with_examples_are_found():
  with_examples = {
    "grpo_optax.training.hierarchical",
    "grpo_optax.training._nnx",
    "grpo_optax.presets",
  }
  assert with_examples <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
  module = importlib.import_module(name)
  with open(module.__file__, encoding="utf-8") as f:
    source = f.read()
  result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
  assert result.failed == 0
  # Every ">>>" in the file is an example that ran (none hidden from doctest).
  assert result.attempted == source.count(">>> "), name
