"""Every reference in the library's docstrings and docs resolves."""

from __future__ import annotations

import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = sorted(
  list((ROOT / "grpo_optax").rglob("*.py")) + list((ROOT / "docs").glob("*.md"))
)
ROLE = re.compile(r":(?:func|mod|class|meth|attr):`~?([\w.]+)`")
FILE = re.compile(
  r"``?((?:grpo_optax|docs|benchmarks|examples|tests|tools)/"
  r"[\w/.-]+\.(?:py|md|sh))`"
)


def _resolve(name: str, module: str) -> bool:
  parts = module.split(".")
  candidates = (
    [name]
    if name.startswith("grpo_optax")
    else [".".join(parts[:i] + [name]) for i in range(len(parts), 0, -1)]
    + [name]
  )
  if "." not in name and module.startswith("grpo_optax"):
    # A method named from inside its class (``:meth:`lower```).
    mod = importlib.import_module(module)
    if any(
      isinstance(v, type) and hasattr(v, name) for v in vars(mod).values()
    ):
      return True
  for cand in candidates:
    parts = cand.split(".")
    for i in range(len(parts), 0, -1):
      try:
        obj = importlib.import_module(".".join(parts[:i]))
      except ImportError:
        continue
      try:
        for attr in parts[i:]:
          obj = getattr(obj, attr)
      except AttributeError:
        break
      return True
  return False


@pytest.mark.parametrize(
  "path", SOURCES, ids=lambda p: str(p.relative_to(ROOT))
)
def test_references_resolve(path):
  text = path.read_text()
  module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
  bad = [n for n in ROLE.findall(text) if not _resolve(n, module)]
  bad += [
    f for f in FILE.findall(text) if not (ROOT / f).exists() and "<" not in f
  ]
  assert not bad, f"unresolved references in {path.name}: {sorted(set(bad))}"


def test_nothing_cites_the_spec_outside_the_repository():
  for path in SOURCES:
    assert "SPEC.md" not in path.read_text(), path
