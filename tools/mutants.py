#!/usr/bin/env python
"""Mutation check: do the tests fail when the library's math is wrong?

Two sets of mutants, both run by cosmic-ray (``pip install -e
tools/mutation``, which installs cosmic-ray and this repository's plugins):

- *curated*: the semantic mutants of ``tools/curated_mutants.py`` (a
  keyword routed to the wrong stage, a wrong EMA condition: what no generic
  operator makes). Each is one work item of the operator
  ``grpo/CuratedSnippet``; the ``grpo-curated`` distributor runs that
  mutant's covering tests (``pytest -x``). Equivalent mutants are run too
  and expected to survive.
- *broad* (``--broad clipping,variance``): cosmic-ray's own operators over
  ``grpo_optax/<module>.py``, killed by ``tests/test_<module>.py``.

A run works on a copy of the repository's files under ``.mutants/<set>/``
(cosmic-ray mutates files in place; the working tree is never touched), with
the cosmic-ray config and session there: ``--resume`` runs what an
interrupted session left pending, ``--rerun-survivors`` runs a session's
survivors again against the current tests, and ``cr-report`` reads it.
Before the mutants, the covering tests run on the unmutated copy (a mutant
is only killed by a test that passed without it).

Usage (from the repository root, in the dev environment)::

  python tools/mutants.py                   # every curated mutant
  python tools/mutants.py --only 'freeze_*,topk_sampled_*'
  python tools/mutants.py --broad clipping,variance
  python tools/mutants.py --broad clipping --rerun-survivors  # after new tests
  python tools/mutants.py --broad clipping --report  # the session's report
  python tools/mutants.py --list            # names, files, snippet status
  python tools/mutants.py --check           # only validate the snippets
  python tools/mutants.py --check-reformat  # ... also on a ruff-formatted copy
  python tools/mutants.py --out tools/mutants_result.txt

Exit status: 0 when every non-equivalent mutant is killed and nothing
errored, 1 otherwise. ``--check`` and ``--check-reformat`` need neither
cosmic-ray nor the plugins (``tests/test_mutants_anchoring.py`` runs them in
the fast tier); a run is not part of CI (minutes).
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT / "tools", ROOT / "tools" / "mutation"):
  if str(_path) not in sys.path:
    sys.path.insert(0, str(_path))

from curated_mutants import MUTANTS  # noqa: E402
from curated_mutants import Mutant  # noqa: E402
from grpo_mutation.anchoring import apply_snippet  # noqa: E402
from grpo_mutation.anchoring import ast_change  # noqa: E402
from grpo_mutation.anchoring import find_spans  # noqa: E402
from grpo_mutation.anchoring import position  # noqa: E402

# Not copied: large results that no covering test reads.
EXCLUDE = ("benchmarks/results/",)
# This interpreter's pytest (a bare "python" may be another environment's).
PYTEST = shlex.join([sys.executable, "-m", "pytest", "-x", "-q"])
PYTEST += " -p no:cacheprovider"
OPERATOR = "grpo/CuratedSnippet"
# Left out of the broad set (marked "skipped" by cr-filter-operators): an
# arithmetic operator replaced by a bitwise or shift operator. On the float
# arrays these modules compute with it raises a TypeError where the line
# runs, so it measures coverage, not assertions, and it doubles the run.
BROAD_EXCLUDE = (
  r"core/ReplaceBinaryOperator_\w+_(BitOr|BitAnd|BitXor|LShift|RShift)$",
)


def apply_mutant(text: str, m: Mutant) -> str:
  """The text with m's snippet replaced; ValueError unless found once."""
  return apply_snippet(text, m.old, m.new, m.file)


def _select(patterns: str | None) -> list[Mutant]:
  if not patterns:
    return list(MUTANTS)
  pats = [p.strip() for p in patterns.split(",") if p.strip()]
  chosen = [m for m in MUTANTS if any(fnmatch.fnmatch(m.name, p) for p in pats)]
  if not chosen:
    raise SystemExit(f"--only {patterns!r} matches no mutant (see --list)")
  return chosen


def check_reformat(mutants: list[Mutant], root: Path = ROOT) -> list[str]:
  """Problems of the mutants on a formatted copy of their files.

  Copies the mutated files and pyproject.toml to a temporary folder, runs
  ``ruff check --fix`` and ``ruff format --line-length 60`` there (the
  project's settings at a narrower width, so the line breaks move),
  and requires every mutant to apply exactly once to the formatted file and
  to change its AST exactly as it changes the unformatted file's.
  """
  files = sorted({m.file for m in mutants})
  problems = []
  with tempfile.TemporaryDirectory(prefix="grpo_mutants_fmt_") as tmp_name:
    tmp = Path(tmp_name)
    shutil.copy2(root / "pyproject.toml", tmp / "pyproject.toml")
    for f in files:
      (tmp / f).parent.mkdir(parents=True, exist_ok=True)
      shutil.copy2(root / f, tmp / f)
    ruff = [sys.executable, "-m", "ruff"]
    for cmd in (
      ruff + ["check", "--fix", "--exit-zero", "--quiet", *files],
      # Narrower than the project's 80 columns: the tree is already
      # formatted, so only another width moves its line breaks.
      ruff + ["format", "--quiet", "--line-length", "60", *files],
    ):
      subprocess.run(cmd, cwd=tmp, check=True, capture_output=True)
    changed = sum(
      (tmp / f).read_text(encoding="utf-8")
      != (root / f).read_text(encoding="utf-8")
      for f in files
    )
    if not changed:
      problems.append("ruff changed none of the files: nothing was tested")
    for m in mutants:
      raw = (root / m.file).read_text(encoding="utf-8")
      fmt = (tmp / m.file).read_text(encoding="utf-8")
      try:
        want = ast_change(raw, apply_mutant(raw, m))
        got = ast_change(fmt, apply_mutant(fmt, m))
      except (ValueError, SyntaxError) as e:
        problems.append(f"{m.name}: {type(e).__name__}: {e}")
        continue
      if not want:
        problems.append(f"{m.name}: changes no code")
      elif got != want:
        problems.append(
          f"{m.name}: after the reformat it edits "
          + "; ".join(got)
          + " instead of "
          + "; ".join(want)
        )
  return problems


def snippet_count(m: Mutant, root: Path = ROOT) -> int:
  path = root / m.file
  if not path.is_file():
    return -1
  return len(find_spans(path.read_text(encoding="utf-8"), m.old))


def _problem(m: Mutant, root: Path = ROOT) -> str:
  n = snippet_count(m, root)
  if n == -1:
    return f"file {m.file} not found"
  if n != 1:
    return f"snippet found {n} times in {m.file} (must be exactly once)"
  if m.old == m.new:
    return "old and new snippets are equal"
  return ""


# -- a run: a copy of the repository, a cosmic-ray config and session --------


def _files_to_copy() -> list[str]:
  out = subprocess.run(
    ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
    cwd=ROOT,
    check=True,
    capture_output=True,
  ).stdout.decode()
  return [
    f
    for f in out.split("\0")
    if f and not f.startswith(EXCLUDE) and (ROOT / f).is_file()
  ]


def _make_copy(tree: Path) -> None:
  if tree.exists():
    shutil.rmtree(tree)
  for f in _files_to_copy():
    dst = tree / f
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(ROOT / f, dst)


def _env(tree: Path) -> dict[str, str]:
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
    [str(tree)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
  )
  env["PYTHONDONTWRITEBYTECODE"] = "1"
  env.setdefault("JAX_PLATFORMS", "cpu")
  return env


def _run(cmd: list[str], tree: Path, timeout: float | None = None):
  """Runs cmd in the copy; returns (returncode, output)."""
  try:
    p = subprocess.run(
      cmd,
      cwd=tree,
      env=_env(tree),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      timeout=timeout,
    )
  except subprocess.TimeoutExpired as e:
    return None, (e.output or b"").decode(errors="replace")
  return p.returncode, p.stdout.decode(errors="replace")


def _cosmic_ray(tree: Path, *args: str) -> None:
  """Runs a cosmic-ray command (``init``, ``exec``) in the copy."""
  rc, out = _run([sys.executable, "-m", "cosmic_ray.cli", *args], tree)
  if rc != 0:
    raise SystemExit(f"cosmic-ray {' '.join(args)} failed:\n{out}")


def _check_import(tree: Path) -> None:
  rc, out = _run(
    [sys.executable, "-c", "import grpo_optax; print(grpo_optax.__file__)"],
    tree,
    120,
  )
  if rc != 0 or not Path(out.strip().splitlines()[-1]).resolve().is_relative_to(
    tree.resolve()
  ):
    raise SystemExit("the copy does not import its own grpo_optax:\n" + out)


def _toml_str(s: str) -> str:
  return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _config(
  modules: list[str], test_command: str, timeout: float, distributor: str
) -> str:
  """A cosmic-ray config (TOML)."""
  return "\n".join(
    [
      "[cosmic-ray]",
      "module-path = [" + ", ".join(map(_toml_str, modules)) + "]",
      f"timeout = {timeout:.1f}",
      "excluded-modules = []",
      f"test-command = {_toml_str(test_command)}",
      "",
      "[cosmic-ray.distributor]",
      f"name = {_toml_str(distributor)}",
      "",
      "[cosmic-ray.filters.operators-filter]",
      "exclude-operators = [" + ", ".join(map(_toml_str, BROAD_EXCLUDE)) + "]",
      "",
    ]
  )


def _curated_session(mutants: list[Mutant], tree: Path, session: Path) -> None:
  """A session with one work item per mutant, its job id the mutant's name."""
  from cosmic_ray.work_db import WorkDB
  from cosmic_ray.work_db import use_db
  from cosmic_ray.work_item import MutationSpec
  from cosmic_ray.work_item import WorkItem

  items = []
  for m in mutants:
    text = (tree / m.file).read_text(encoding="utf-8")
    ((a, b),) = find_spans(text, m.old)
    args = {
      "name": m.name,
      "old": m.old,
      "new": m.new,
      "tests": list(m.tests),
      "what": m.what,
      "equivalent": m.equivalent,
    }
    spec = MutationSpec(
      module_path=m.file,
      operator_name=OPERATOR,
      occurrence=0,
      start_pos=position(text, a),
      end_pos=position(text, b),
      operator_args=args,
      definition_name=m.name,
    )
    items.append(WorkItem.single(m.name, spec))
  with use_db(str(session), WorkDB.Mode.create) as db:
    db.clear()
    db.add_work_items(items)


def _baseline(
  targets: list[list[str]], tree: Path, timeout: float, log
) -> bool:
  """Each list of pytest targets on the unmutated copy."""
  ok = True
  for ts in targets:
    start = time.monotonic()
    rc, out = _run(shlex.split(PYTEST) + ts, tree, timeout)
    took = time.monotonic() - start
    name = " ".join(ts)
    if rc == 0:
      last = out.strip().splitlines()[-1] if out.strip() else ""
      log(f"  baseline ok    {name}  ({took:.0f} s)  {last}")
    else:
      ok = False
      log(f"  baseline FAIL  {name}  (exit {rc}):\n" + out[-3000:])
  return ok


def _sensitivity(tree: Path, timeout: float, log) -> bool:
  """``check_knob_sensitivity`` of tests/test_preset_wiring.py: every keyword
  of ``grpo`` changes its stage in that file's grid, so the equality test
  there can see a keyword that is dropped or sent to the wrong stage.
  """
  rc, out = _run([sys.executable, "tests/test_preset_wiring.py"], tree, timeout)
  last = out.strip().splitlines()[-1] if out.strip() else ""
  if rc == 0:
    log(f"  baseline ok    grpo keyword sensitivity  {last}")
    return True
  log(f"  baseline FAIL  grpo keyword sensitivity  (exit {rc}):\n{out[-3000:]}")
  return False


def _curated_targets(mutants: list[Mutant]) -> list[list[str]]:
  """Each covering file once: whole, or only the node ids that mutants use."""
  targets: dict[str, set[str]] = {}
  for t in (t for m in mutants for t in m.tests):
    targets.setdefault(t.split("::")[0], set()).add(t)
  return [[f] if f in ts else sorted(ts) for f, ts in sorted(targets.items())]


def _results(session: Path):
  """(work item, result) of every completed item of a session."""
  from cosmic_ray.work_db import WorkDB
  from cosmic_ray.work_db import use_db

  with use_db(str(session), WorkDB.Mode.open) as db:
    return list(db.completed_work_items), db.num_work_items


def _first_failure(output: str) -> str:
  for line in (output or "").splitlines():
    if line.startswith(("FAILED ", "ERROR ")):
      return line.split(" - ")[0].split(" ", 1)[1]
  return ""


def _outcome(result) -> str:
  """A WorkResult as killed, timeout, survived, skipped or error."""
  worker = str(result.worker_outcome.value)
  test = result.test_outcome and str(result.test_outcome.value)
  if worker == "skipped":
    return "skipped"
  if worker != "normal" or test == "incompetent":
    return "error"
  if test == "killed":
    return "timeout" if result.output == "timeout" else "killed"
  return "survived"


def _line(tag: str, name: str, detail: str) -> str:
  return f"{tag:10} {name}" + (f" {detail}" if detail else "")


def _curated_report(session: Path, log) -> bool:
  """Logs each curated mutant's outcome and the totals; True if all good."""
  done, total = _results(session)
  by = {m.name: m for m in MUTANTS}
  counts = {k: 0 for k in ("killed", "survived", "equivalent", "error")}
  survived, equivalent = [], []
  for item, result in sorted(done, key=lambda d: d[0].job_id):
    m, outcome = by[item.job_id], _outcome(result)
    if outcome == "killed":
      # cosmic-ray counts any failing exit as killed: name the failing test,
      # or say that there is none (a mutant that breaks the import).
      first = _first_failure(result.output)
      detail = f"by {first}" if first else "(no failing test in the output)"
    elif outcome == "timeout":
      detail = "(timeout)"
    elif outcome == "error":
      detail = ": " + " | ".join(
        (result.output or "").strip().splitlines()[-3:]
      )
    else:
      detail = ""
    tag = {"timeout": "killed", "survived": "SURVIVED", "error": "ERROR"}
    tag = tag.get(outcome, outcome)
    if m.equivalent:
      equivalent.append(f"  {m.name}: {m.equivalent} [{outcome}]")
      tag = "equivalent" if outcome == "survived" else tag
      counts["equivalent"] += 1
    elif outcome == "survived":
      survived.append(m.name)
    log("  " + _line(tag, m.name, detail))
    if outcome == "error":
      counts["error"] += 1
    elif not m.equivalent:
      counts["survived" if outcome == "survived" else "killed"] += 1
  log("")
  log("equivalent mutants (cannot be killed):")
  for line in equivalent:
    log(line)
  if survived:
    log("SURVIVED: " + ", ".join(survived))
  real = counts["killed"] + counts["survived"]
  log(
    f"result: killed {counts['killed']}/{real} mutants; "
    f"{counts['equivalent']} equivalent; {counts['survived']} survived; "
    f"{counts['error']} errors; {total - len(done)} not run"
  )
  return not survived and not counts["error"] and len(done) == total


def _broad_report(module: str, session: Path, log) -> bool:
  """Logs the broad session's totals and each survivor with its diff."""
  done, total = _results(session)
  outcomes = [(item, result, _outcome(result)) for item, result in done]
  count = {
    k: sum(o == k for _, _, o in outcomes)
    for k in ("killed", "timeout", "survived", "skipped", "error")
  }
  run = total - count["skipped"]
  for item, result, outcome in sorted(
    outcomes, key=lambda d: d[0].mutations[0].start_pos
  ):
    if outcome in ("survived", "error"):
      spec = item.mutations[0]
      diff = [
        l
        for l in (result.diff or "").splitlines()
        if l.startswith(("+", "-")) and not l.startswith(("+++", "---"))
      ]
      log(
        f"  {outcome.upper():9} {spec.operator_name} #{spec.occurrence}"
        f" line {spec.start_pos[0]} ({item.job_id[:8]}): "
        + " / ".join(l.strip() for l in diff)
      )
  log(
    f"result {module}: {total} mutants, {count['skipped']} skipped by the"
    f" operators filter; of the {run} run: killed"
    f" {count['killed'] + count['timeout']} ({count['timeout']} by timeout),"
    f" survived {count['survived']}, incompetent {count['error']},"
    f" not run {total - len(done)}"
  )
  return not count["survived"] and not count["error"] and len(done) == total


def _rel(path: Path) -> str:
  """A path as the report shows it: relative to the repository if inside."""
  path = path.resolve()
  return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _forget_survivors(session: Path) -> int:
  """Drops the results of the survived and incompetent items of a session,
  so that ``cosmic-ray exec`` runs them again; returns how many.
  """
  import sqlite3

  with contextlib.closing(sqlite3.connect(session)) as db, db:
    return db.execute(
      "DELETE FROM work_results WHERE worker_outcome != 'SKIPPED'"
      " AND (test_outcome IS NULL OR test_outcome != 'KILLED')"
    ).rowcount


def _prepare(work: Path, args, log) -> tuple[Path, bool]:
  """The copy under work/; (its path, whether an earlier session is kept).

  ``--resume`` keeps the session and copies the repository again (an
  interrupted run may have left a mutated file in the copy);
  ``--rerun-survivors`` also forgets the survivors' results.
  """
  tree, session = work / "tree", work / "session.sqlite"
  if (args.resume or args.rerun_survivors) and session.is_file():
    _make_copy(tree)
    _check_import(tree)
    if args.rerun_survivors:
      log(f"  {_forget_survivors(session)} survivors to run again")
    return tree, True
  work.mkdir(parents=True, exist_ok=True)
  session.unlink(missing_ok=True)
  _make_copy(tree)
  _check_import(tree)
  return tree, False


def run_curated(mutants, work: Path, args, log) -> bool:
  """The curated mutants through cosmic-ray (see the module docstring)."""
  runnable = []
  for m in mutants:
    problem = _problem(m)
    if problem:
      log("  " + _line("ERROR", m.name, ": " + problem))
    else:
      runnable.append(m)
  tree, resumed = _prepare(work, args, log)
  config, session = work / "config.toml", work / "session.sqlite"
  config.write_text(
    _config(
      sorted({m.file for m in runnable}),
      PYTEST + " {tests}",
      args.timeout,
      "grpo-curated",
    ),
    encoding="utf-8",
  )
  if not resumed:
    _curated_session(runnable, tree, session)
  if not args.no_baseline:
    log("baseline (unmutated copy):")
    if not _baseline(_curated_targets(runnable), tree, args.timeout, log):
      log("baseline failed: fix the tests before judging mutants")
      return False
    if not args.only and not _sensitivity(tree, args.timeout, log):
      return False
  log(f"mutants (cosmic-ray exec {_rel(config)} {_rel(session)}):")
  _cosmic_ray(tree, "exec", str(config), str(session))
  return _curated_report(session, log) and len(runnable) == len(mutants)


def run_broad(module: str, work: Path, args, log) -> bool:
  """cosmic-ray's operators over grpo_optax/<module>.py."""
  test_file = f"tests/test_{module}.py"
  tree, resumed = _prepare(work, args, log)
  config, session = work / "config.toml", work / "session.sqlite"
  config.write_text(
    _config(
      [f"grpo_optax/{module}.py"],
      f"{PYTEST} {test_file}",
      args.timeout,
      "local",
    ),
    encoding="utf-8",
  )
  if not resumed:
    _cosmic_ray(tree, "init", str(config), str(session))
    rc, out = _run(
      [
        sys.executable,
        "-m",
        "cosmic_ray.tools.filters.operators_filter",
        str(session),
        str(config),
      ],
      tree,
    )
    if rc != 0:
      raise SystemExit("cr-filter-operators failed:\n" + out)
  if not args.no_baseline and not _baseline(
    [[test_file]], tree, args.timeout, log
  ):
    return False
  log(f"{module} (cosmic-ray exec {_rel(config)} {_rel(session)}):")
  _cosmic_ray(tree, "exec", str(config), str(session))
  return _broad_report(module, session, log)


def _check(mutants, args) -> int:
  if args.check_reformat:
    problems = check_reformat(mutants)
    for line in problems:
      print("ERROR  " + line)
    print(
      f"{len(mutants)} mutants on a ruff-formatted copy,"
      f" {len(problems)} problems"
    )
    return 1 if problems else 0
  bad = 0
  for m in mutants:
    problem = _problem(m)
    bad += bool(problem)
    tag = "equivalent" if m.equivalent else "mutant"
    print(
      f"{'ERROR' if problem else 'ok':5}  {tag:10}  {m.name:48} {m.file}"
      + (f"\n       {problem}" if problem else "")
      + (f"\n       {m.what}; tests: {' '.join(m.tests)}" if args.list else "")
    )
  print(f"{len(mutants)} mutants, {bad} with a snippet problem")
  return 1 if bad else 0


def _parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument(
    "--list",
    action="store_true",
    help="list the mutants and whether each snippet is found",
  )
  ap.add_argument(
    "--check",
    action="store_true",
    help="only validate the snippets (exit 1 on a problem)",
  )
  ap.add_argument(
    "--check-reformat",
    action="store_true",
    help="validate the snippets on a ruff-formatted copy too",
  )
  ap.add_argument("--only", help="comma-separated shell globs of mutant names")
  ap.add_argument(
    "--broad",
    help="comma-separated modules of grpo_optax/ (clipping,variance): run"
    " cosmic-ray's operators on them instead of the curated mutants",
  )
  ap.add_argument(
    "--timeout", type=float, default=300, help="seconds per mutant's test run"
  )
  ap.add_argument(
    "--no-baseline",
    action="store_true",
    help="skip the unmutated run of the covering tests",
  )
  ap.add_argument(
    "--resume",
    action="store_true",
    help="run what the session in .mutants/ left pending",
  )
  ap.add_argument(
    "--report",
    action="store_true",
    help="only print the report of the session in .mutants/ (with --broad:"
    " of those modules' sessions)",
  )
  ap.add_argument(
    "--rerun-survivors",
    action="store_true",
    help="run the survivors of the session in .mutants/ again, against the"
    " working tree's current tests",
  )
  ap.add_argument(
    "--workdir",
    default=str(ROOT / ".mutants"),
    help="where the copies, configs and sessions go",
  )
  ap.add_argument("--out", help="also write the report to this file")
  return ap


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  names = [m.name for m in MUTANTS]
  dupes = {n for n in names if names.count(n) > 1}
  if dupes:
    raise SystemExit(f"duplicate mutant names: {sorted(dupes)}")
  if args.list or args.check or args.check_reformat:
    return _check(_select(args.only), args)

  lines: list[str] = []

  def log(line: str = "") -> None:
    print(line, flush=True)
    lines.append(line)

  started = time.monotonic()
  load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
  log(f"# tools/mutants.py  {time.strftime('%Y-%m-%d %H:%M:%S')}")
  log(
    f"# python {platform.python_version()}, {os.cpu_count()} CPUs (load"
    f" average {load:.1f} at start), cosmic-ray, one mutant at a time,"
    f" timeout {args.timeout:.0f} s per mutant"
  )
  work = Path(args.workdir)
  if args.report:
    modules = [s.strip() for s in (args.broad or "").split(",") if s.strip()]
    ok = True
    for module in modules:
      ok &= _broad_report(
        module, work / f"broad-{module}" / "session.sqlite", log
      )
    if not modules:
      ok = _curated_report(work / "curated" / "session.sqlite", log)
  elif args.broad:
    ok = True
    for module in [s.strip() for s in args.broad.split(",") if s.strip()]:
      ok &= run_broad(module, work / f"broad-{module}", args, log)
  else:
    ok = run_curated(_select(args.only), work / "curated", args, log)
  load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
  log(
    f"# {(time.monotonic() - started) / 60:.1f} min"
    f" (load average {load:.1f} at the end)"
  )
  if args.out:
    Path(args.out).write_text("\n".join(lines) + "\n", encoding="utf-8")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
