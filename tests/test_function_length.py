"""No function in grpo_optax/ has a body longer than 120 lines of code (the
signature, the docstring, blank and comment-only lines excluded).
"""

from __future__ import annotations

import ast
import io
import pathlib
import tokenize

ROOT = pathlib.Path(__file__).resolve().parents[1] / "grpo_optax"
LIMIT = 120


def _code_lines(source: str) -> set[int]:
  lines = set()
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type not in (
      tokenize.COMMENT,
      tokenize.NL,
      tokenize.NEWLINE,
      tokenize.INDENT,
      tokenize.DEDENT,
      tokenize.ENDMARKER,
    ):
      lines.update(range(tok.start[0], tok.end[0] + 1))
  return lines


def _long_functions():
  for path in sorted(ROOT.rglob("*.py")):
    source = path.read_text()
    code = _code_lines(source)
    for node in ast.walk(ast.parse(source)):
      if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        continue
      body = set(range(node.body[0].lineno, node.end_lineno + 1)) & code
      doc = node.body[0] if node.body else None
      if (
        isinstance(doc, ast.Expr)
        and isinstance(doc.value, ast.Constant)
        and isinstance(doc.value.value, str)
      ):
        body -= set(range(doc.lineno, doc.end_lineno + 1))
      if len(body) > LIMIT:
        yield (
          f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name} "
          f"({len(body)} lines)"
        )


def test_no_function_is_longer_than_120_lines():
  assert list(_long_functions()) == []
