"""The command line a benchmark records in its results, without machine paths.

Results under ``benchmarks/results/`` are committed and shown on the
documentation site, so the command that wrote them names paths as a reader
of the repository would type them: relative to the repository root, and a
path outside the repository by its last component (``--out /tmp/x/st1``
becomes ``--out st1``).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def portable_path(arg: str) -> str:
  """``arg`` relative to the repository if it is an absolute path.

  Args:
    arg: one command-line argument.

  Returns:
    ``arg`` unchanged unless it is an absolute path: then the path relative
    to the repository root if it lies inside it, else its last component.

  Examples:
    >>> portable_path("--quick")
    '--quick'
    >>> portable_path("/tmp/lead/st1")
    'st1'
    >>> portable_path(os.path.join(ROOT, "benchmarks", "results"))
    'benchmarks/results'
  """
  if not os.path.isabs(arg):
    return arg
  path = os.path.normpath(arg)
  rel = os.path.relpath(path, ROOT)
  if rel == os.curdir:
    return "."
  if not rel.startswith(os.pardir):
    return rel
  return os.path.basename(path) or path


def command(module: str, argv: Sequence[str] | None = ()) -> str:
  """``python -m module argv...``, shell-quoted, with :func:`portable_path`.

  Args:
    module: the benchmark's module, e.g. ``"benchmarks.step_time"``.
    argv: its arguments (``None``: none).

  Returns:
    The command as a reader would type it from the repository root.

  Examples:
    >>> command("benchmarks.step_time", ["--quick", "--compile-layers", ""])
    "python -m benchmarks.step_time --quick --compile-layers ''"
    >>> command("benchmarks.study", ["--out", "/tmp/qs"])
    'python -m benchmarks.study --out qs'
  """
  args = [portable_path(str(a)) for a in (argv or ())]
  return shlex.join(["python", "-m", module, *args])
