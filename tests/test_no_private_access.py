"""No module of grpo_optax reads another's private names.

A helper another module calls is public within the package (no leading
underscore, not in ``__all__``: ``sparsify.keep_mask``); its private names
are its own. The test walks ``grpo_optax/**/*.py`` with :mod:`ast` and fails
on ``X._name`` where ``X`` is a grpo_optax module the file imports, on
``from grpo_optax.x import _name`` (a private name, not a private module
such as ``_tree``) and on a ``protected-access`` pylint switch. A
NamedTuple's own API (``_make``, ``_replace``, ``_fields``, ``_asdict``) is
public despite its underscore.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "grpo_optax"
FILES = sorted(PACKAGE.rglob("*.py"))
NAMEDTUPLE_API = {"_make", "_replace", "_fields", "_asdict", "_field_defaults"}


def _is_private(name: str) -> bool:
  return (
    name.startswith("_")
    and not name.startswith("__")
    and name not in NAMEDTUPLE_API
  )


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def _is_module(name: str) -> bool:
  try:
    return importlib.util.find_spec(name) is not None
  except ModuleNotFoundError:
    return False


def _absolute(node: ast.ImportFrom, here: str, is_package: bool) -> str:
  """The absolute module of ``from <module> import ...`` in module ``here``."""
  if not node.level:
    return node.module or ""
  base = here.split(".")
  if not is_package:
    base = base[:-1]
  base = base[: len(base) - (node.level - 1)]
  return ".".join(base + ([node.module] if node.module else []))


def _dotted(node: ast.expr) -> str | None:
  if isinstance(node, ast.Name):
    return node.id
  if isinstance(node, ast.Attribute):
    inner = _dotted(node.value)
    return None if inner is None else f"{inner}.{node.attr}"
  return None


def private_accesses(path: pathlib.Path) -> list[str]:
  """``file:line: what`` for each read of another module's private name."""
  here = _module_name(path)
  tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
  modules: dict[str, str] = {}  # local name -> grpo_optax module
  found = []
  rel = path.relative_to(ROOT)
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.split(".")[0] != "grpo_optax":
          continue
        if alias.asname:
          modules[alias.asname] = alias.name
        else:  # `import grpo_optax.x` binds `grpo_optax`
          modules["grpo_optax"] = "grpo_optax"
    elif isinstance(node, ast.ImportFrom):
      source = _absolute(node, here, path.name == "__init__.py")
      if source.split(".")[0] != "grpo_optax":
        continue
      for alias in node.names:
        full = f"{source}.{alias.name}"
        if _is_module(full):
          modules[alias.asname or alias.name] = full
        elif _is_private(alias.name) and source != here:
          found.append(
            f"{rel}:{node.lineno}: from {source} import {alias.name}"
          )
  for node in ast.walk(tree):
    if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
      continue
    owner = _dotted(node.value)
    if owner is None:
      continue
    head, _, rest = owner.partition(".")
    if head not in modules:
      continue
    module = modules[head] + (f".{rest}" if rest else "")
    if _is_module(module) and module != here:
      found.append(f"{rel}:{node.lineno}: {owner}.{node.attr}")
  return found


@pytest.mark.parametrize(
  "path", FILES, ids=[str(p.relative_to(PACKAGE)) for p in FILES]
)
def test_no_private_name_of_another_module(path):
  assert not private_accesses(path)
  assert "protected-access" not in path.read_text(encoding="utf-8")


def test_the_walk_sees_a_private_access(monkeypatch):
  # The checker itself: a file inside the package reading sparsify's
  # private name, through each import form, is caught; NamedTuple API and
  # private modules are not.
  fake = PACKAGE / "training" / "_probe_for_the_test.py"
  monkeypatch.setattr(
    pathlib.Path,
    "read_text",
    lambda self, encoding=None: (
      "import grpo_optax.sparsify as sp\n"
      "from grpo_optax import presets\n"
      "from grpo_optax.training import _tree\n"
      "from grpo_optax.presets import _values\n"
      "from .. import _common\n"
      "import grpo_optax\n"
      "sp._private(presets._stages, _tree.check_flag, _common._x)\n"
      "grpo_optax.quantization._y\n"
      "presets.GrpoState._make(()), presets.GrpoState._fields\n"
    ),
  )
  found = [line.split(": ", 1)[1] for line in private_accesses(fake)]
  assert sorted(found) == sorted(
    [
      "from grpo_optax.presets import _values",
      "sp._private",
      "presets._stages",
      "_common._x",
      "grpo_optax.quantization._y",
    ]
  )
  assert len(FILES) > 40
