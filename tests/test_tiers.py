"""The tier lists name tests that exist, and keep the fast tier's invariants."""

import importlib.util
import pathlib
import re

HERE = pathlib.Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location(
  "slow_tests", HERE.parent / "tools" / "slow_tests.py"
)
slow_tests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(slow_tests)


def test_every_listed_slow_test_exists():
  missing = []
  for name in sorted(slow_tests.read_listed()):
    file, test = name.split("::", 1)
    function = test.split("[", 1)[0]
    path = HERE / file
    if not path.exists() or not re.search(
      rf"^def {re.escape(function)}\(", path.read_text(), re.M
    ):
      missing.append(name)
  assert not missing, missing


def test_the_fast_tier_keeps_its_invariants():
  assert not slow_tests.KEEP_FAST & slow_tests.read_listed()
  for name in slow_tests.KEEP_FAST:
    file, test = name.split("::", 1)
    assert f"def {test.split('[', 1)[0]}(" in (HERE / file).read_text(), name


def test_report_reader_picks_the_slow_cases(tmp_path):
  report = tmp_path / "r.xml"
  report.write_text(
    '<testsuites><testsuite><testcase classname="tests.test_a" '
    'name="test_x[1]" time="5.2"/><testcase classname="tests.test_a" '
    'name="test_y" time="0.3"/></testsuite></testsuites>'
  )
  assert slow_tests.slow_in_report(str(report), 4.0) == {"test_a.py::test_x[1]"}


def test_report_lists_the_slowest_first(tmp_path, capsys):
  report = tmp_path / "r.xml"
  report.write_text(
    '<testsuites><testsuite><testcase classname="tests.test_a" '
    'name="test_x" time="1.5"/><testcase classname="tests.test_b" '
    'name="test_y" time="7.0"/><testcase classname="tests.test_a" '
    'name="test_z" time="0.2"/></testsuite></testsuites>'
  )
  assert slow_tests.slowest(str(report), 2) == [
    (7.0, "test_b.py::test_y"),
    (1.5, "test_a.py::test_x"),
  ]
  slow_tests.main([str(report), "--top", "1"])
  out = capsys.readouterr().out.splitlines()
  assert out[0].split() == ["7.00", "s", "test_b.py::test_y"]
  assert out[1].split()[0] == "8.7"


# Hooks that run in an xdist worker after it has reported "finished" (its
# terminal summary and unconfigure): execnet sends the worker a SIGINT when
# they take more than 5 s, and the KeyboardInterrupt, raised inside whatever
# finalizer the worker runs then, ends a passing run with
# PytestUnraisableExceptionWarning tracebacks. Only pytest's own plugins and
# xdist's may run there (the hypothesis plugin imported its whole package).
LATE_HOOKS = ("pytest_terminal_summary", "pytest_unconfigure")
LATE_OK = ("_pytest.", "xdist.", "pluggy.")


def test_no_third_party_plugin_runs_after_a_worker_finished(pytestconfig):
  manager = pytestconfig.pluginmanager
  assert manager.is_blocked("hypothesispytest")
  late = {
    f"{hook}: {impl.plugin_name} ({getattr(impl.plugin, '__name__', '')})"
    for hook in LATE_HOOKS
    for impl in getattr(manager.hook, hook).get_hookimpls()
    if not getattr(impl.plugin, "__name__", "").startswith(LATE_OK)
    and not type(impl.plugin).__module__.startswith(LATE_OK)
  }
  assert not late, sorted(late)
