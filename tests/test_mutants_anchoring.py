"""tools/mutants.py finds its snippets by tokens, so a reformat keeps them."""

import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
  "mutants", ROOT / "tools" / "mutants.py"
)
mutants = importlib.util.module_from_spec(_spec)
sys.modules["mutants"] = mutants  # dataclasses look their module up
_spec.loader.exec_module(mutants)

SOURCE = '''def f(x, scale):
  """Doc."""
  y = jnp.maximum(x * scale,
                  0.0)  # keep it positive
  return g(y, 'mean')
'''
# The same function as ruff formats it at a narrower width: other breaks,
# quotes and a trailing comma.
FORMATTED = '''def f(x, scale):
  """Doc."""
  y = jnp.maximum(
    x * scale,
    0.0,
  )  # keep it positive
  return g(y, "mean")
'''


def _mutant(old, new):
  return mutants.Mutant("m", "f.py", old, new, (), "test")


def test_snippet_matches_across_layout_quotes_and_trailing_commas():
  m = _mutant(
    "jnp.maximum(x * scale,\n                  0.0)",
    "jnp.minimum(x * scale, 0.0)",
  )
  want = mutants.ast_change(SOURCE, mutants.apply_mutant(SOURCE, m))
  got = mutants.ast_change(FORMATTED, mutants.apply_mutant(FORMATTED, m))
  assert want and got == want
  assert "jnp.minimum(x * scale, 0.0)" in mutants.apply_mutant(FORMATTED, m)
  q = _mutant("return g(y, 'mean')", "return g(y, 'sum')")
  assert "'sum'" in mutants.apply_mutant(FORMATTED, q)


def test_multiline_statement_snippet_keeps_its_indentation():
  src = "def f(a):\n  b = a + 1\n  c = b * 2\n  return c\n"
  m = _mutant("  b = a + 1\n  c = b * 2", "  b = a + 1\n  c = b * 3")
  out = mutants.apply_mutant(src.replace("a + 1", "a+1  # one more"), m)
  assert "c = b * 3" in out and "c = b * 2" not in out
  compile(out, "f.py", "exec")


@pytest.mark.parametrize("old,count", [("x * scale * 2", 0), ("x", 2)])
def test_snippet_not_found_exactly_once_is_an_error(old, count):
  text = SOURCE.replace("return g(y, 'mean')", "return g(y, 'mean') + x")
  if count == 0:
    assert mutants.find_spans(text, old) == []
  else:
    assert len(mutants.find_spans(text, old)) >= count
  with pytest.raises(ValueError, match="must be exactly once"):
    mutants.apply_mutant(text, _mutant(old, "0"))


def test_every_mutant_applies_to_the_tree_and_to_a_formatted_copy():
  problems = [
    f"{m.name}: {mutants._problem(m)}"
    for m in mutants.MUTANTS
    if mutants._problem(m)
  ]
  assert not problems, problems
  assert mutants.check_reformat(mutants.MUTANTS) == []
