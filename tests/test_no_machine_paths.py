"""No committed result or page names a path of the machine that wrote it.

The benchmark results under ``benchmarks/results/`` are shown on the site
with the command that printed them; that command, the pages and the README
name paths as a reader of the repository types them (``benchmarks.command``).
"""

import doctest
import pathlib
import re

import pytest

from benchmarks import command as command_lib

ROOT = pathlib.Path(__file__).resolve().parent.parent
# An absolute path into a home, scratch or work folder (POSIX or Windows).
MACHINE_PATH = re.compile(
  r"(?<![\w.~-])(?:/(?:work|root|home|tmp|Users|mnt|scratch|private/var)/"
  r"|[A-Za-z]:\\(?:Users|tmp|work)\\)"
)
TEXT = {".md", ".json", ".txt", ".csv", ".rst", ".yaml", ".toml", ".py"}


def _committed_text_files():
  # (CONTRIBUTING.md may suggest a scratch folder for a throw-away venv.)
  files = [ROOT / "README.md", ROOT / "CHANGELOG.md"]
  for folder in ("docs", "benchmarks/results"):
    files += sorted(
      p
      for p in (ROOT / folder).rglob("*")
      if p.is_file()
      and p.suffix in TEXT
      and not {"_build", "_generated"} & set(p.parts)
    )
  return files


FILES = _committed_text_files()


def test_the_results_are_scanned():
  names = {p.relative_to(ROOT).as_posix() for p in FILES}
  assert "benchmarks/results/communication.json" in names
  assert "benchmarks/results/quick/study.md" in names
  assert "docs/multiprocess.md" in names


@pytest.mark.parametrize(
  "path", FILES, ids=lambda p: p.relative_to(ROOT).as_posix()
)
def test_no_absolute_machine_path(path):
  text = path.read_text(encoding="utf-8")
  hits = [
    f"{text.count(chr(10), 0, m.start()) + 1}: "
    f"{text[max(0, m.start() - 40) : m.end() + 40]!r}"
    for m in MACHINE_PATH.finditer(text)
  ]
  assert not hits, "\n".join(hits)


def test_the_pattern_catches_the_paths_that_were_committed():
  for bad in (
    "--runs /work/wt/dgc/.runs",
    "`--out /tmp/lead/st1`",
    "wrote /root/x.json",
    "C:\\Users\\me\\run",
  ):
    assert MACHINE_PATH.search(bad), bad
  for good in (
    "--out st1",
    "docs/_build/html",
    "~/tmp/x",
    "a/tmp/b",
    "/dev/null",
  ):
    assert not MACHINE_PATH.search(good), good


def test_benchmark_commands_are_written_relative_to_the_repository():
  assert command_lib.command(
    "benchmarks.step_time", ["--out", "/tmp/lead/st1", "--compile-layers", ""]
  ) == ("python -m benchmarks.step_time --out st1 --compile-layers ''")
  inside = str(ROOT / "benchmarks" / "results")
  assert command_lib.command("benchmarks.study", ["--out", inside]) == (
    "python -m benchmarks.study --out benchmarks/results"
  )
  assert command_lib.portable_path(str(ROOT)) == "."
  assert command_lib.portable_path("relative/dir") == "relative/dir"
  assert not MACHINE_PATH.search(
    command_lib.command("benchmarks.communication", ["--runs", "/work/wt/r"])
  )


def test_the_command_helper_examples_run():
  result = doctest.testmod(command_lib)
  assert result.failed == 0 and result.attempted >= 5
