"""Every ```python block of README.md and docs/ runs as written.

Each block is a complete program (imports, data, small arrays) executed in a
fresh namespace; pseudo-code is fenced as ```text. Docstring examples of the
library are ``tests/test_doctests.py``'s.
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FILES = [f for f in FILES if "_build" not in f.parts]
BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def _blocks():
  for path in FILES:
    text = path.read_text(encoding="utf-8")
    for m in BLOCK.finditer(text):
      line = text.count("\n", 0, m.start()) + 1
      yield pytest.param(
        path, line, m.group(1), id=f"{path.relative_to(ROOT)}:{line}"
      )


BLOCKS = list(_blocks())


def test_blocks_are_found():
  names = {p.values[0].name for p in BLOCKS}
  assert {"README.md", "getting_started.md", "data_parallel.md"} <= names
  # Any other fence of Python is also a python block (not skipped here).
  for path in FILES:
    for line in path.read_text(encoding="utf-8").splitlines():
      fence = line.strip()
      assert fence not in ("```py", "```python3", "```pycon"), (path, line)


@pytest.mark.parametrize("path, line, code", BLOCKS)
def test_block_runs(path, line, code):
  namespace = {"__name__": f"doc_block_{path.stem}_{line}"}
  exec(compile(code, f"{path}:{line}", "exec"), namespace)  # noqa: S102
