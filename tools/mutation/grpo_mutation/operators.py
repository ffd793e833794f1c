"""The cosmic-ray operator that applies one curated snippet replacement."""

from __future__ import annotations

import parso
from cosmic_ray.operators.operator import Argument
from cosmic_ray.operators.operator import Example
from cosmic_ray.operators.operator import Operator

from grpo_mutation import anchoring


class CuratedSnippet(Operator):
  """Replaces the snippet ``old`` of a module with ``new``.

  The operator mutates the module's root node: it has one position in a
  module that holds ``old`` exactly once (found by tokens, see
  :mod:`grpo_mutation.anchoring`), none in a module without it, and it raises
  ``ValueError`` where ``old`` is ambiguous. ``name``, ``tests``, ``what``
  and ``equivalent`` ride along in the work item for the distributor and the
  report; they do not change the mutation.
  """

  def __init__(
    self,
    name: str,
    old: str,
    new: str,
    tests: tuple[str, ...] = (),
    what: str = "",
    equivalent: str = "",
  ):
    self.name = name
    self.old = old
    self.new = new
    self.tests = tuple(tests)
    self.what = what
    self.equivalent = equivalent

  @classmethod
  def arguments(cls):
    return (
      Argument("name", "the curated mutant's id"),
      Argument("old", "the snippet to replace, found exactly once by tokens"),
      Argument("new", "its replacement"),
      Argument("tests", "pytest targets that must fail on the mutant"),
      Argument("what", "the wrong math, in words"),
      Argument("equivalent", "why the mutant cannot be killed, if it cannot"),
    )

  def mutation_positions(self, node):
    if node.type != "file_input":
      return
    text = node.get_code()
    spans = anchoring.find_spans(text, self.old)
    if len(spans) > 1:
      raise ValueError(
        f"{self.name}: snippet found {len(spans)} times (must be exactly once)"
      )
    for a, b in spans:
      yield anchoring.position(text, a), anchoring.position(text, b)

  def mutate(self, node, index):
    del index  # one position per module
    text = node.get_code()
    return parso.parse(anchoring.apply_snippet(text, self.old, self.new))

  @classmethod
  def examples(cls):
    return (
      Example(
        "y = jnp.maximum(x,\n                0.0)\n",
        "y = jnp.minimum(x, 0.0)\n",
        operator_args={
          "name": "example",
          "old": "jnp.maximum(x, 0.0)",
          "new": "jnp.minimum(x, 0.0)",
        },
      ),
    )


class OperatorProvider:
  """The ``grpo`` provider: ``grpo/CuratedSnippet``."""

  _OPERATORS = {"CuratedSnippet": CuratedSnippet}

  def __iter__(self):
    return iter(self._OPERATORS)

  def __getitem__(self, name):
    return self._OPERATORS[name]
