"""Packaging facts that a release depends on, checked on the source tree."""

import pathlib
import re
import tomllib

import grpo_optax

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))
PROJECT = PYPROJECT["project"]


def _lower_bounds(requirements):
  """{name: version} of the ``name>=version`` requirements."""
  out = {}
  for req in requirements:
    m = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9][0-9A-Za-z.]*)", req.strip())
    if m:
      out[m.group(1).lower()] = m.group(2)
  return out


def _pins():
  pins = {}
  for line in (ROOT / ".ci" / "lowest-versions.txt").read_text().splitlines():
    line = line.split("#", 1)[0].strip()
    if line:
      name, version = line.split("==")
      pins[name.strip().lower()] = version.strip()
  return pins


def test_license_file_is_the_declared_apache_2():
  assert PROJECT["license"] == "Apache-2.0"
  assert PROJECT["license-files"] == ["LICENSE"]
  text = (ROOT / "LICENSE").read_text("utf-8")
  assert "Apache License" in text and "Version 2.0, January 2004" in text
  assert "END OF TERMS AND CONDITIONS" in text


def test_version_has_one_source():
  assert "version" not in PROJECT and PROJECT["dynamic"] == ["version"]
  dynamic = PYPROJECT["tool"]["setuptools"]["dynamic"]["version"]
  assert dynamic == {"attr": "grpo_optax.__version__"}
  assert re.fullmatch(r"\d+\.\d+\.\d+", grpo_optax.__version__)
  changelog = (ROOT / "CHANGELOG.md").read_text("utf-8")
  assert f"## {grpo_optax.__version__} - " in changelog


def test_lowest_versions_file_pins_the_declared_lower_bounds():
  bounds = _lower_bounds(PROJECT["dependencies"])
  bounds.update(_lower_bounds(PROJECT["optional-dependencies"]["examples"]))
  pins = _pins()
  assert set(pins) == {"jax", "jaxlib", "optax", "numpy", "flax"}
  for name in ("jax", "optax", "numpy", "flax"):
    # A bound "2.0" is pinned as "2.0.0": compare as release tuples.
    want = tuple(int(x) for x in bounds[name].split("."))
    got = tuple(int(x) for x in pins[name].split("."))
    assert got[: len(want)] == want and not any(got[len(want) :]), name
  assert pins["jaxlib"] == pins["jax"]


def test_python_bound_matches_the_lowest_jax():
  # jax 0.10.0 (the lowest bound) requires Python 3.11.
  assert PROJECT["requires-python"] == ">=3.11"
  assert "Programming Language :: Python :: 3.11" in PROJECT["classifiers"]
  assert "Typing :: Typed" in PROJECT["classifiers"]


def test_package_is_typed():
  assert (ROOT / "grpo_optax" / "py.typed").is_file()
  data = PYPROJECT["tool"]["setuptools"]["package-data"]["grpo_optax"]
  assert "py.typed" in data


def test_readme_quick_start_has_two_commands_install_then_test():
  # .ci/run runs the second line of this block as CI's test command.
  text = (ROOT / "README.md").read_text("utf-8")
  block = text.split("## Quick start", 1)[1].split("```", 2)[1]
  lines = [
    l
    for l in block.splitlines()[1:]
    if l.strip() and not l.lstrip().startswith("#")
  ]
  assert len(lines) == 2, lines
  assert "pip install" in lines[0] and "python -m examples." in lines[0]
  assert "pip install" in lines[1] and "python -m pytest" in lines[1]
  assert len(text.splitlines()) <= 250
