"""Every ```python block a reader meets runs as written.

The files: README.md, CONTRIBUTING.md, CHANGELOG.md, every page of docs/ and
the benchmark results the site includes. Each block is a complete program
(imports, data, small arrays) executed in a fresh namespace, in an empty
folder; pseudo-code is fenced as ```text. Any other fence of Python (```py,
```python3, ```{code-block} python, an rST ``.. code-block:: python``) would
not run here, so it is refused. Docstring examples of the library are
``tests/test_doctests.py``'s.
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FILES = [
  ROOT / "README.md",
  ROOT / "CONTRIBUTING.md",
  ROOT / "CHANGELOG.md",
  *sorted((ROOT / "docs").rglob("*.md")),
  *sorted((ROOT / "benchmarks" / "results").rglob("*.md")),
]
FILES = [f for f in FILES if not {"_build", "_generated"} & set(f.parts)]
BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
# A fence (``` or ~~~, possibly indented) or an rST directive naming Python.
OTHER_PYTHON = re.compile(
  r"^[ \t]*(?:(?:```|~~~)[ \t]*(?:\{[\w-]+\}[ \t]*)?"
  r"(?:py|python\d?|pycon|ipython\d?)\b"
  r"|\.\. (?:code-block|code|sourcecode|code-cell)::[ \t]*"
  r"(?:py|python\d?|pycon)\b)",
  re.M | re.I,
)


def _blocks():
  for path in FILES:
    text = path.read_text(encoding="utf-8")
    for m in BLOCK.finditer(text):
      line = text.count("\n", 0, m.start()) + 1
      yield pytest.param(
        path, line, m.group(1), id=f"{path.relative_to(ROOT)}:{line}"
      )


BLOCKS = list(_blocks())


def test_every_block_is_found():
  names = {p.values[0].relative_to(ROOT).as_posix() for p in BLOCKS}
  assert {
    "README.md",
    "docs/getting_started.md",
    "docs/data_parallel.md",
    "docs/rl_module.md",
    "docs/memory.md",
  } <= names
  for path in FILES:
    text = path.read_text(encoding="utf-8")
    fences = [line for line in text.splitlines() if line.strip() == "```python"]
    found = [p for p in BLOCKS if p.values[0] == path]
    # Every ```python line opens a block the test runs (none indented,
    # none left open).
    assert len(fences) == len(found), path
    assert all(f == "```python" for f in fences), path


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_is_fenced_as_python(path):
  text = path.read_text(encoding="utf-8")
  others = [
    m.group(0)
    for m in OTHER_PYTHON.finditer(text)
    if m.group(0) != "```python"  # at the start of its line: a block
  ]
  assert not others, f"{path.name}: fence these as ```python: {others}"


def test_the_fence_check_catches_the_other_spellings():
  for fence in (
    "```py",
    "```python3",
    "```pycon",
    "~~~python",
    "  ```python",
    "```{code-block} python",
    "```{code-cell} ipython3",
    ".. code-block:: python",
  ):
    m = OTHER_PYTHON.search(fence)
    assert m and m.group(0) != "```python", fence
  assert OTHER_PYTHON.search("```python").group(0) == "```python"
  assert not OTHER_PYTHON.search("```text\n```bash\n```\npython -m x")


@pytest.mark.parametrize("path, line, code", BLOCKS)
def test_block_runs(path, line, code, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # as a reader runs it: from any folder
  namespace = {"__name__": f"doc_block_{path.stem}_{line}"}
  exec(compile(code, f"{path}:{line}", "exec"), namespace)  # noqa: S102
