"""Find a snippet in a module by its Python tokens, and replace it.

A snippet matches where the file's tokens, with whitespace, line breaks,
comments, quote style and trailing commas normalised away, equal the
snippet's (an exact text match is tried first). So a reformat (``ruff
format``) keeps a curated mutant applicable. Standard library only: the
validation of the curated mutants (``tools/mutants.py --check``) runs
without cosmic-ray.
"""

from __future__ import annotations

import ast
import difflib
import functools
import io
import tokenize

_LAYOUT = {
  tokenize.NL,
  tokenize.NEWLINE,
  tokenize.INDENT,
  tokenize.DEDENT,
  tokenize.COMMENT,
  tokenize.ENCODING,
  tokenize.ENDMARKER,
}
_CLOSING = {")", "]", "}"}


def _norm_string(s: str) -> str:
  """A string literal in one spelling (quotes, escapes, prefixes)."""
  try:
    return repr(ast.literal_eval(s))
  except (ValueError, SyntaxError):  # f-strings: only the quotes vary
    return s.replace("'", '"')


def _raw_tokens(text: str):
  """The (type, string, start, end) of text's tokens.

  A partial snippet may end inside brackets: the tokenizer's end-of-input
  error then ends the list.
  """
  out = []
  try:
    for t in tokenize.generate_tokens(io.StringIO(text).readline):
      out.append((t.type, t.string, t.start, t.end))
  except tokenize.TokenError:
    pass
  return out


_Token = tuple[str, tuple[int, int], tuple[int, int]]  # string, start, end


def _code_tokens(text: str) -> list[_Token]:
  """The tokens that carry code, normalised, with their (row, col) spans.

  Layout (line breaks, indentation, comments) is dropped, string literals are
  spelled one way, and a comma right before a closing bracket (a formatter's
  "magic trailing comma") is dropped.
  """
  toks = [
    (s if ty != tokenize.STRING else _norm_string(s), a, b)
    for ty, s, a, b in _raw_tokens(text)
    if ty not in _LAYOUT
  ]
  return [
    t
    for i, t in enumerate(toks)
    if not (t[0] == "," and i + 1 < len(toks) and toks[i + 1][0] in _CLOSING)
  ]


def _snippet_tokens(snippet: str) -> list[str]:
  """Normalised code tokens of a snippet (it may start mid-statement)."""
  lines = snippet.strip("\n").splitlines()
  # Statement lines of a multi-line snippet keep their relative indentation;
  # the tokenizer needs the first one at column 0.
  indent = len(lines[0]) - len(lines[0].lstrip()) if lines else 0
  body = "\n".join(
    l[indent:] if l[:indent].isspace() else l.lstrip() for l in lines
  )
  try:
    return [t[0] for t in _code_tokens(body)]
  except (IndentationError, SyntaxError):
    return [t[0] for line in lines for t in _code_tokens(line.strip())]


def _offsets(text: str) -> list[int]:
  starts, pos = [], 0
  for line in text.splitlines(keepends=True):
    starts.append(pos)
    pos += len(line)
  starts.append(pos)
  return starts


@functools.lru_cache(maxsize=64)
def _text_tokens(text: str) -> tuple[list[_Token], list[int]]:
  """A module's code tokens and line offsets (cached: the curated mutants
  look many snippets up in the same file).
  """
  return _code_tokens(text), _offsets(text)


def find_spans(text: str, snippet: str) -> list[tuple[int, int]]:
  """Character spans of text where snippet occurs.

  The exact text if it occurs at all; otherwise every run of code tokens
  equal to the snippet's (see :func:`_code_tokens`).
  """
  n = text.count(snippet)
  if n:
    spans, start = [], 0
    for _ in range(n):
      i = text.index(snippet, start)
      spans.append((i, i + len(snippet)))
      start = i + 1
    return spans
  want = _snippet_tokens(snippet)
  if not want:
    return []
  toks, line_start = _text_tokens(text)
  at = lambda rc: line_start[rc[0] - 1] + rc[1]
  k = len(want)
  return [
    (at(toks[i][1]), at(toks[i + k - 1][2]))
    for i in range(len(toks) - k + 1)
    if [t[0] for t in toks[i : i + k]] == want
  ]


def position(text: str, offset: int) -> tuple[int, int]:
  """The (1-based line, column) of a character offset, as parso counts."""
  line = text.count("\n", 0, offset) + 1
  return line, offset - (text.rfind("\n", 0, offset) + 1)


def apply_snippet(text: str, old: str, new: str, where: str = "") -> str:
  """The text with ``old`` replaced by ``new``.

  Raises:
    ValueError: unless ``old`` is found exactly once (``where`` names the
      file in the message).
  """
  spans = find_spans(text, old)
  if len(spans) != 1:
    raise ValueError(
      f"snippet found {len(spans)} times in {where or 'the text'}"
      " (must be exactly once)"
    )
  ((a, b),) = spans
  if text[a:b] != old:
    # Matched on tokens: the span starts at the first token and ends at the
    # last, so drop the snippet's own surrounding whitespace from the
    # replacement.
    lead = old[: len(old) - len(old.lstrip())]
    trail = old[len(old.rstrip()) :]
    if lead and new.startswith(lead):
      new = new[len(lead) :]
    if trail and new.endswith(trail):
      new = new[: len(new) - len(trail)]
  return text[:a] + new + text[b:]


# The fields that hold statements (and the handlers and cases whose bodies
# do): only statements start a block with a docstring-like string, and no
# expression holds one, so these reach every node that ast.walk would find
# with a list ``body``, without visiting the expressions.
_BLOCK_FIELDS = ("body", "orelse", "finalbody", "handlers", "cases")


def _statements(tree: ast.AST):
  """The tree's root and every statement, handler and case below it."""
  stack = [tree]
  while stack:
    node = stack.pop()
    yield node
    for field in _BLOCK_FIELDS:
      children = getattr(node, field, None)
      if isinstance(children, list):
        stack.extend(children)


def _tree(text: str) -> ast.Module:
  """The module's AST, with docstrings' layout normalised.

  A formatter may re-indent docstrings: the tree is equal for a file and its
  reformatted copy.
  """
  tree = ast.parse(text)
  for node in _statements(tree):
    body = getattr(node, "body", None)
    if (
      isinstance(body, list)
      and body
      and isinstance(body[0], ast.Expr)
      and isinstance(body[0].value, ast.Constant)
      and isinstance(body[0].value.value, str)
    ):
      doc = body[0].value.value
      body[0].value.value = "\n".join(
        l.strip() for l in doc.splitlines()
      ).strip()
  return tree


@functools.lru_cache(maxsize=64)
def _unparsed(text: str) -> tuple[str, ...]:
  """The lines ``ast.unparse`` prints for the module (cached: the checks of
  the curated mutants compare many mutants with the same unmutated file).
  """
  return tuple(ast.unparse(_tree(text)).splitlines())


def ast_change(before: str, after: str) -> list[str]:
  """The edits between two versions of a module, free of layout.

  Compared as ``ast.unparse`` prints them: ``'old' -> 'new'`` per edited run
  of characters.
  """
  diff = list(
    difflib.unified_diff(_unparsed(before), _unparsed(after), lineterm="", n=0)
  )
  old = [l for l in diff if l.startswith("-") and not l.startswith("---")]
  new = [l for l in diff if l.startswith("+") and not l.startswith("+++")]
  # Only the edited characters: the lines around them may differ between a
  # file and its linted copy (``Optional[x]`` against ``x | None``).
  x, y = "\n".join(l[1:] for l in old), "\n".join(l[1:] for l in new)
  ops = difflib.SequenceMatcher(None, x, y, autojunk=False).get_opcodes()
  edits = [
    f"{x[i1:i2]!r} -> {y[j1:j2]!r}"
    for tag, i1, i2, j1, j2 in ops
    if tag != "equal"
  ]
  return edits or old + new  # lines moved (a stage order): the moves
