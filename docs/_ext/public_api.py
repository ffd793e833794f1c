"""Sphinx extension: descriptions for the API reference's fields and constants.

The reference documents every public name under the path users import
(``grpo_optax.grpo``, as optax documents ``optax.adam``). Two kinds of entry
get no useful text from autodoc there:

* A ``NamedTuple`` field: its docstring is "Alias for field number N". It
  gets the field's entry of the class docstring's ``Attributes:`` section
  (which is then removed from the class text, so that it is not shown twice),
  or else the comments beside the field in the source
  (``count: jax.Array  # shape=(), dtype=int32: steps seen``).
* A constant re-exported by a package (``grpo_optax.training.EXCHANGES``,
  defined in ``grpo_optax.training.exchange``): autodoc reads ``#:`` comments
  of the documented module only, so the constant gets the comment above (or
  beside) its assignment in the module that defines it.

:func:`field_descriptions` and :func:`constant_description` are also what
``tests/test_api_reference.py`` checks every public field and constant with.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import io
import re
import sys
import textwrap
import tokenize
from typing import Any

_ALIAS = re.compile(r"^Alias for field number \d+$")
_ENTRY = re.compile(r"^(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def _comments(source: str) -> dict[int, str]:
  """Line number -> text of the comment on that line (without ``#``/``#:``)."""
  out = {}
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type == tokenize.COMMENT:
      text = tok.string.lstrip("#").lstrip(":").strip()
      if not text.startswith(("pylint:", "noqa", "type:", "pyright:")):
        out[tok.start[0]] = text
  return out


def _escape(text: str) -> str:
  """A source comment as reStructuredText that shows it as written.

  Comments are plain text (``|g p|``, ``g**2``, ``mu_``): the characters
  reStructuredText gives a meaning are escaped.
  """
  text = text.replace("\\", "\\\\")
  for ch in "*|`":
    text = text.replace(ch, "\\" + ch)
  return re.sub(r"(\w)_(?=\W|$)", r"\1\\_", text)


def _comment_of(node: ast.stmt, lines: list[str], comments: dict[int, str]):
  """The comment block right above ``node`` and those on its own lines."""
  above = []
  i = node.lineno - 1
  while i >= 1 and lines[i - 1].strip().startswith("#") and i in comments:
    above.insert(0, comments[i])
    i -= 1
  end = node.end_lineno or node.lineno
  beside = [comments[j] for j in range(node.lineno, end + 1) if j in comments]
  text = " ".join(t for t in above + beside if t)
  return text or None


def attributes_section(doc: str) -> tuple[dict[str, str], tuple[int, int]]:
  """The ``Attributes:`` entries of a Google-style docstring, and its lines.

  Returns ``({name: text}, (first, end))`` where ``first:end`` are the lines
  of ``doc.splitlines()`` the section spans (``(0, 0)`` when absent). An
  entry (``name: text`` or ``name (type): text``) starts at the indentation
  of the section's first line; deeper lines continue it.
  """
  lines = doc.splitlines()
  width = lambda s: len(s) - len(s.lstrip())
  first = next(
    (i for i, line in enumerate(lines) if line.strip() == "Attributes:"), None
  )
  if first is None:
    return {}, (0, 0)
  entries: dict[str, str] = {}
  entry_width, name, end = None, None, first + 1
  while end < len(lines):
    line = lines[end]
    if line.strip():
      if width(line) <= width(lines[first]):
        break  # the next section or paragraph
      entry_width = entry_width or width(line)
      m = _ENTRY.match(line.strip())
      if m and width(line) == entry_width:
        name = m.group(1)
        entries[name] = m.group(2).strip()
      elif name is not None:
        entries[name] += " " + line.strip()
    end += 1
  while end > first + 1 and not lines[end - 1].strip():
    end -= 1
  return entries, (first, end)


@functools.cache
def field_descriptions(cls: type) -> dict[str, str]:
  """``{field: description}`` of a ``NamedTuple`` class.

  From the class docstring's ``Attributes:`` section, else from the comments
  beside (or right above) the field's annotation in the class body. Fields
  with neither are absent.
  """
  described, _ = attributes_section(inspect.getdoc(cls) or "")
  out = {f: described[f] for f in cls._fields if f in described}
  try:
    source = textwrap.dedent(inspect.getsource(cls))
  except (OSError, TypeError):
    return out
  tree = ast.parse(source)
  lines = source.splitlines()
  comments = _comments(source)
  body = tree.body[0].body if tree.body else []
  for node in body:
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
      name = node.target.id
      if name in cls._fields and name not in out:
        text = _comment_of(node, lines, comments)
        if text:
          out[name] = _escape(text)
  return out


def _defining_modules(package: str, name: str, obj: Any) -> list[Any]:
  """Loaded modules under ``package`` that bind ``name`` to ``obj``."""
  return [
    m
    for key, m in sorted(sys.modules.items())
    if m is not None
    and (key == package or key.startswith(package + "."))
    and getattr(m, name, None) is obj
  ]


@functools.cache
def constant_description(module: str, name: str) -> str | None:
  """The comment of the assignment of ``module.name`` where it is defined.

  ``module`` is the public path (e.g. ``grpo_optax.training``); the comment
  (``#:`` or ``#``, above or beside the assignment) is read from the module
  that assigns the name.
  """
  mod = importlib.import_module(module)
  obj = getattr(mod, name)
  top = module.split(".")[0]
  for candidate in _defining_modules(top, name, obj):
    try:
      source = inspect.getsource(candidate)
    except (OSError, TypeError):
      continue
    tree = ast.parse(source)
    lines = source.splitlines()
    comments = _comments(source)
    for node in tree.body:
      targets = (
        node.targets
        if isinstance(node, ast.Assign)
        else [node.target]
        if isinstance(node, ast.AnnAssign)
        else []
      )
      if any(isinstance(t, ast.Name) and t.id == name for t in targets):
        text = _comment_of(node, lines, comments)
        if text:
          return text
  return None


def _resolve(path: str) -> Any:
  """The object at a dotted path (a module, then attributes)."""
  parts = path.split(".")
  for i in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:i]))
    except ImportError:
      continue
    for part in parts[i:]:
      obj = getattr(obj, part)
    return obj
  raise ImportError(path)


def _process_docstring(app, what, name, obj, options, lines) -> None:
  """Both hooks below, in order (for tests)."""
  _drop_attributes_section(app, what, name, obj, options, lines)
  _describe(app, what, name, obj, options, lines)


def _drop_attributes_section(app, what, name, obj, options, lines) -> None:
  """A NamedTuple's ``Attributes:`` section: shown on the fields instead."""
  del app, name, options  # unused
  if what == "class" and hasattr(obj, "_fields"):
    _, (first, end) = attributes_section("\n".join(lines))
    if end > first:
      del lines[first:end]


def _describe(app, what, name, obj, options, lines) -> None:
  """A field's or a re-exported constant's description, as reStructuredText."""
  del app, options  # unused
  if what == "attribute" and lines and _ALIAS.match(" ".join(lines).strip()):
    parent, field = name.rsplit(".", 1)
    text = field_descriptions(_resolve(parent)).get(field)
    if text:
      lines[:] = [text]
  elif what == "data":
    module, const = name.rsplit(".", 1)
    text = constant_description(module, const)
    type_doc = (type(obj).__doc__ or "").strip()
    if text:
      lines[:] = [text]
    elif type_doc and " ".join(lines).strip().startswith(type_doc[:40]):
      lines[:] = []  # the docstring of ``tuple`` or ``dict``, not the value's


@functools.cache
def _public_paths() -> dict[int, str]:
  """``id(obj) -> public path`` of every public name (and public module).

  Public modules are ``grpo_optax`` and every module a public module lists
  in its ``__all__``; the first public path found wins.
  """
  paths: dict[int, str] = {}
  todo = [importlib.import_module("grpo_optax")]
  while todo:
    module = todo.pop(0)
    paths.setdefault(id(module), module.__name__)
    for name in module.__all__:
      value = getattr(module, name)
      if inspect.ismodule(value):
        if id(value) not in paths:
          todo.append(value)
      else:
        paths.setdefault(id(value), f"{module.__name__}.{name}")
  return paths


def _candidates(node) -> list[str]:
  """Dotted paths a reference may name: as written, in its module or class."""
  target = node["reftarget"].lstrip(".~")
  out = [target]
  module, cls = node.get("py:module"), node.get("py:class")
  if module and cls:
    out.append(f"{module}.{cls}.{target}")
  if module:
    out.append(f"{module}.{target}")
    package = module.rsplit(".", 1)[0]
    out.append(f"{package}.{target}")
  return out


def _unique_public(name: str) -> str | None:
  """The public path of the one public object called ``name``, if one."""
  found = {p for p in _public_paths().values() if p.rsplit(".", 1)[-1] == name}
  objects = {id(_resolve(p)) for p in found}
  return sorted(found)[0] if len(objects) == 1 else None


def _missing_reference(app, env, node, contnode):
  """Links a reference to a defining path (``grpo_optax.fused.clip_mask_adam``,
  or ``sparse_pmean`` in the text of ``grpo_optax.training.distributed``) to
  the public entry of the same object. A reference to an internal helper
  (no public path) stays plain text, without a link and without a warning.
  """
  if node.get("refdomain") != "py":
    return None
  public = None
  for path in _candidates(node):
    if not path.startswith("grpo_optax"):
      continue
    try:
      obj = _resolve(path)
    except (ImportError, AttributeError):
      continue
    public = _public_paths().get(id(obj))
    if public is None:
      return contnode  # an internal helper: named, not linked
    break
  inside = node.get("py:module", "").startswith("grpo_optax")
  if public is None and inside:
    # A name of another module of the package (``group_size`` in the text
    # of ``collective_ops``, documented as grpo_optax.training's).
    public = _unique_public(node["reftarget"].lstrip(".~"))
  if public is None:
    return None
  domain = env.get_domain("py")
  return domain.resolve_xref(
    env, node["refdoc"], app.builder, node["reftype"], public, node, contnode
  )


def setup(app):
  # Napoleon (priority 500) would turn the class's ``Attributes:`` into
  # fields of the class text, and read a field's "text: more" as "type:
  # description": the section goes before it, the descriptions after.
  app.connect(
    "autodoc-process-docstring", _drop_attributes_section, priority=400
  )
  app.connect("autodoc-process-docstring", _describe, priority=600)
  app.connect("missing-reference", _missing_reference)
  return {"parallel_read_safe": True, "parallel_write_safe": True}
