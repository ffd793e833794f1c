"""Writes tests/slow_tests.txt: the fast tier's single tests that are slow.

Usage: run the fast tier with a junit report, then this script::

  python -m pytest -q -n 2 -m "not slow" --junitxml=/tmp/fast.xml
  python tools/slow_tests.py /tmp/fast.xml --seconds 4

Every test of the report that took ``--seconds`` or more is added to the
list (tests already listed stay listed), except the invariants of
``KEEP_FAST``, which the fast tier always runs. ``tests/conftest.py`` marks
the listed tests ``slow``.

``--top 20`` only prints the 20 slowest tests of the report (seconds, name)
and the report's total, and writes nothing::

  python tools/slow_tests.py /tmp/fast.xml --top 20
"""

from __future__ import annotations

import argparse
import pathlib
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIST = ROOT / "tests" / "slow_tests.txt"

# One test per invariant the fast tier must not lose, whatever it costs.
KEEP_FAST = frozenset(
  {
    # the fused core equals the chain of its rooms (default top-k)
    "test_one_algorithm.py::test_fused_core_equals_the_chain_of_its_rooms[topk]",
    # no all-gather on sharded leaves (default top-k, Auto mesh)
    "test_sharding.py::test_update_has_no_all_gather_and_scalar_sized_collectives[topk-auto]",
    # error feedback loses nothing
    "test_sparsify.py::test_error_feedback_loses_nothing[<lambda>0]",
  }
)

HEADER = """\
# Single tests of the fast tier that took {seconds:g} s or more of CPU time
# each (junit times of `pytest -n 2 -m "not slow"` on 2 cores); they run in
# the slow tier. Written by tools/slow_tests.py; one "file::test[id]" a line.
"""


def read_listed(path: pathlib.Path = LIST) -> set[str]:
  """The names listed in ``path`` (comments and blank lines skipped)."""
  if not path.exists():
    return set()
  lines = path.read_text(encoding="utf-8").splitlines()
  return {s.strip() for s in lines if s.strip() and not s.startswith("#")}


def slow_in_report(report: str, seconds: float) -> set[str]:
  """``file::name`` of every test case of a junit report over ``seconds``."""
  out = set()
  for case in ET.parse(report).iter("testcase"):
    if float(case.get("time", 0)) >= seconds:
      module = case.get("classname", "").rsplit(".", 1)[-1]
      out.add(f"{module}.py::{case.get('name')}")
  return out


def slowest(report: str, top: int) -> list[tuple[float, str]]:
  """The ``top`` slowest test cases of a junit report, slowest first."""
  cases = [
    (
      float(case.get("time", 0)),
      f"{case.get('classname', '').rsplit('.', 1)[-1]}.py::{case.get('name')}",
    )
    for case in ET.parse(report).iter("testcase")
  ]
  return sorted(cases, reverse=True)[:top]


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("report", help="junit xml of a test run")
  parser.add_argument("--seconds", type=float, default=4.0)
  parser.add_argument(
    "--top", type=int, default=0, help="only print the N slowest tests"
  )
  args = parser.parse_args(argv)
  if args.top:
    total = sum(
      float(c.get("time", 0)) for c in ET.parse(args.report).iter("testcase")
    )
    for seconds, name in slowest(args.report, args.top):
      print(f"{seconds:7.2f} s  {name}")
    print(f"{total:7.1f} s  all tests of the report (CPU-seconds, summed)")
    return
  names = (read_listed() | slow_in_report(args.report, args.seconds)) - (
    KEEP_FAST
  )
  LIST.write_text(
    HEADER.format(seconds=args.seconds)
    + "".join(f"{n}\n" for n in sorted(names)),
    encoding="utf-8",
  )
  print(f"{len(names)} tests listed in {LIST.relative_to(ROOT)}")


if __name__ == "__main__":
  main()
