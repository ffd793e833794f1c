"""The curated mutants (tools/curated_mutants.py) are found by tokens, so a
reformat keeps them; cosmic-ray applies them through the repository's plugin
(tools/mutation/grpo_mutation) exactly as the anchoring does, and runs each
one's own tests.
"""

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


def test_cosmic_ray_operator_applies_the_snippet_once_by_tokens():
  from cosmic_ray.mutating import mutate_code
  from grpo_mutation.operators import CuratedSnippet

  old, new = "jnp.maximum(x * scale, 0.0)", "jnp.minimum(x * scale, 0.0)"
  op = CuratedSnippet(name="m", old=old, new=new)
  assert mutate_code(FORMATTED, op, 0) == mutants.apply_mutant(
    FORMATTED, _mutant(old, new)
  )
  assert mutate_code(FORMATTED, op, 1) is None  # one position per module
  assert mutate_code("x = 1\n", op, 0) is None  # not in this module
  twice = CuratedSnippet(name="m", old="y", new="z")
  with pytest.raises(ValueError, match="found 2 times"):
    mutate_code(FORMATTED, twice, 0)


def test_distributor_runs_each_mutants_own_tests():
  from cosmic_ray.work_item import MutationSpec
  from cosmic_ray.work_item import WorkItem
  from grpo_mutation.distributor import test_command_for

  def item(args):
    spec = MutationSpec("f.py", "grpo/CuratedSnippet", 0, (1, 0), (1, 1), args)
    return WorkItem.single("job", spec)

  node = "tests/t.py::test_x[a-b]"
  cmd = test_command_for("pytest -x {tests}", item({"tests": [node, "u.py"]}))
  assert cmd == "pytest -x 'tests/t.py::test_x[a-b]' u.py"
  assert test_command_for("pytest {tests}", item({}), ["v.py"]) == "pytest v.py"
  with pytest.raises(ValueError, match="names no tests"):
    test_command_for("pytest {tests}", item({}))
