"""The API reference lists every public name under the path users import.

Public modules are ``grpo_optax`` and every module a public module lists in
its ``__all__`` (``grpo_optax.training``, ``grpo_optax.rl``, ...); their
public names are their ``__all__``. The reference (``docs/api/``) documents
each under that path (``grpo_optax.grpo``, as optax documents
``optax.adam``), a ``NamedTuple``'s fields with their descriptions, and no
internal helper. The fast tier builds the API pages alone and reads their
``objects.inv``; the slow tier builds the whole site as CI does (``-W``) and
reads the site's.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import pkgutil
import re
import shutil
import sys

import pytest
from sphinx.application import Sphinx
from sphinx.util.docutils import docutils_namespace
from sphinx.util.inventory import InventoryFile

import grpo_optax

# The docs build runs myst-parser and Sphinx, whose deprecation warnings
# about each other are theirs to fix.
pytestmark = pytest.mark.filterwarnings(
  "ignore::DeprecationWarning", "ignore::PendingDeprecationWarning"
)

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "_ext"))
import public_api  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


def _public_modules() -> dict[str, object]:
  """``grpo_optax`` and the modules listed by a public module's ``__all__``."""
  found, todo = {}, [grpo_optax]
  while todo:
    module = todo.pop()
    found[module.__name__] = module
    for name in module.__all__:
      value = getattr(module, name)
      if inspect.ismodule(value) and value.__name__ not in found:
        todo.append(value)
  return found


PUBLIC = _public_modules()
# Every public name, by its public path: "grpo_optax.training.sparse_pmean".
NAMES = {
  f"{path}.{name}": getattr(module, name)
  for path, module in PUBLIC.items()
  for name in module.__all__
  if not inspect.ismodule(getattr(module, name))
}
NAMEDTUPLES = {
  path: obj
  for path, obj in NAMES.items()
  if inspect.isclass(obj) and hasattr(obj, "_fields")
}
# A second public name of a class (grpo_optax.training.DataParallelState is
# TrainState): autodoc documents it as "alias of ..." (an attribute entry),
# its fields under the class's own name.
ALIASES = {
  path
  for path, obj in NAMES.items()
  if inspect.isclass(obj)
  and obj.__name__ != path.rsplit(".", 1)[1]
  and any(other is obj and p != path for p, other in NAMES.items())
}
CONSTANTS = {
  path: obj
  for path, obj in NAMES.items()
  if not callable(obj) and not inspect.isclass(obj)
}
ALL_MODULES = sorted(
  m.name
  for m in pkgutil.walk_packages(grpo_optax.__path__, prefix="grpo_optax.")
  if not any(part.startswith("_") for part in m.name.split("."))
)
# Helpers other modules call; never API (issue 33 found them in the reference).
HELPERS = {
  "static_int",
  "keep_mask",
  "split_by_mask",
  "bisect_thresholds",
  "chunk_rows",
  "check_number",
  "split_leaves",
}


def test_the_public_modules():
  assert set(PUBLIC) == {
    "grpo_optax",
    "grpo_optax.hlo",
    "grpo_optax.quantization",
    "grpo_optax.rl",
    "grpo_optax.training",
    "grpo_optax.training.checkpointing",
    "grpo_optax.training.compression",
    "grpo_optax.training.compressors",
    "grpo_optax.training.exchange",
  }
  assert len(NAMES) > 110
  assert {"grpo_optax.training.DataParallelState"} == ALIASES


@pytest.mark.parametrize("name", ALL_MODULES)
def test_every_module_has_an_explicit_all(name):
  module = importlib.import_module(name)
  assert "__all__" in vars(module), f"{name} has no __all__"
  missing = [n for n in module.__all__ if not hasattr(module, n)]
  assert not missing, missing
  assert len(set(module.__all__)) == len(module.__all__)


@pytest.mark.parametrize("name", ALL_MODULES)
def test_every_exported_name_has_a_public_path(name):
  # A name a defining module exports is re-exported by a public module (so
  # the reference, which documents public paths only, shows it).
  module = importlib.import_module(name)
  public = {id(obj) for obj in NAMES.values()}
  orphans = [
    n
    for n in module.__all__
    if not inspect.ismodule(getattr(module, n))
    and id(getattr(module, n)) not in public
  ]
  assert not orphans, f"{name}: {orphans} are in no public module's __all__"


def test_helpers_are_not_exported():
  for name in ALL_MODULES + ["grpo_optax"]:
    exported = set(importlib.import_module(name).__all__) & HELPERS
    assert not exported, (name, exported)
  # They still exist where other modules call them.
  from grpo_optax import sparsify  # pylint: disable=g-import-not-at-top

  assert callable(sparsify.static_int) and callable(sparsify.keep_mask)


@pytest.mark.parametrize("path", sorted(NAMEDTUPLES))
def test_every_field_of_a_public_namedtuple_is_described(path):
  cls = NAMEDTUPLES[path]
  described = public_api.field_descriptions(cls)
  missing = [f for f in cls._fields if not described.get(f, "").strip()]
  assert not missing, f"{path}: fields without a description: {missing}"


@pytest.mark.parametrize("path", sorted(CONSTANTS))
def test_every_public_constant_is_described(path):
  module, name = path.rsplit(".", 1)
  text = public_api.constant_description(module, name)
  assert text and len(text) > 10, f"{path} has no #: comment where defined"


def test_field_descriptions_come_from_attributes_or_comments():
  from grpo_optax import training  # pylint: disable=g-import-not-at-top

  fields = public_api.field_descriptions(grpo_optax.ClipWithL2State)
  assert fields["count"] == "shape=(), dtype=int32: steps seen"
  fields = public_api.field_descriptions(grpo_optax.FreezeBelowState)
  assert r"\|g p\|" in fields["importance"]  # escaped for reStructuredText
  fields = public_api.field_descriptions(training.DataParallelState)
  assert fields["params"].startswith("the parameters, replicated")
  doc = (
    "Doc.\n\nAttributes:\n  a: one\n    more.\n  b (int): two\n\nReturns:\n  x"
  )
  entries, (first, end) = public_api.attributes_section(doc)
  assert entries == {"a": "one more.", "b": "two"}
  assert doc.splitlines()[first:end] == [
    "Attributes:",
    "  a: one",
    "    more.",
    "  b (int): two",
  ]


# -- the built reference -------------------------------------------------------


def _build(
  srcdir: pathlib.Path, out: pathlib.Path, builder="html", **overrides
):
  """Builds ``srcdir`` with docs/conf.py (warnings are errors); returns the
  ``py`` entries of its ``objects.inv`` as ``{name: (role, uri)}``.

  The ``dummy`` builder reads and resolves the pages without writing them;
  its inventory is then written as the html builder writes it (URIs without
  the page).
  """
  with docutils_namespace():
    app = Sphinx(
      str(srcdir),
      str(DOCS),
      str(out / builder),
      str(out / "doctrees"),
      builder,
      confoverrides=overrides,
      status=None,
      warningiserror=True,
      keep_going=True,
    )
    app.build()
    assert app.statuscode == 0, "the docs build reported warnings"
    path = out / builder / "objects.inv"
    if builder != "html":
      InventoryFile.dump(path, app.env, app.builder)
  with open(path, "rb") as f:
    inventory = InventoryFile.load(f, "", lambda base, uri: uri)
  return {
    name: (role, item.uri)
    for role, items in inventory.items()
    if role.startswith("py:")
    for name, item in items.items()
  }


def _without_docstrings(app) -> dict:
  """A Sphinx extension: autodoc entries without their docstrings.

  Parsing the docstrings is most of the build; the names in the inventory do
  not depend on them (the slow test builds the whole site with them).
  """

  def clear(app, what, name, obj, options, lines):
    del app, what, name, obj, options  # unused
    lines[:] = []

  app.connect("autodoc-process-docstring", clear, priority=900)
  return {"parallel_read_safe": True}


@pytest.fixture(scope="module")
def api_inventory(tmp_path_factory):
  """The inventory of the API pages alone, built with docs/conf.py.

  The pages that document objects are all in docs/api/
  (:func:`test_objects_are_documented_in_the_api_pages_only`), so their
  inventory is the site's, less the modules of the mechanism pages. Built
  without docstrings and without writing the pages to stay fast (about
  3 s); warnings (an entry autodoc cannot import) are errors.
  """
  stub = type(sys)("_api_reference_without_docstrings")
  stub.setup = _without_docstrings
  sys.modules[stub.__name__] = stub
  tmp = tmp_path_factory.mktemp("api_docs")
  src = tmp / "src"
  shutil.copytree(DOCS / "api", src / "api")
  (src / "index.md").write_text("# API\n\n```{toctree}\napi/index\n```\n")
  extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "public_api",
    stub.__name__,
  ]
  return _build(
    src,
    tmp,
    "dummy",
    extensions=",".join(extensions),
    exclude_patterns="_generated",
    # Links from the API index to the mechanism pages, which are not built.
    suppress_warnings="myst.xref_missing",
  )


def _check_inventory(inventory: dict, *, allowed_modules=()) -> None:
  documented = set(inventory)
  missing = sorted(set(NAMES) - documented)
  assert not missing, f"public names without an entry: {missing}"
  missing = sorted(set(PUBLIC) - documented)
  assert not missing, f"public modules without an entry: {missing}"
  classes = {p for p, obj in NAMES.items() if inspect.isclass(obj)}
  # A class's defining path (grpo_optax.sparsify.TopKMaskState) is an alias
  # autodoc records for the public entry: it links to the same anchor.
  extra = sorted(
    name
    for name, (_, uri) in inventory.items()
    if name not in NAMES
    and name not in PUBLIC
    and name not in allowed_modules
    and name.rsplit(".", 1)[0] not in classes
    and uri.rpartition("#")[2] not in NAMES
  )
  assert not extra, f"entries outside the public paths: {extra}"
  for path, obj in NAMES.items():
    role = inventory[path][0]
    if path in ALIASES:
      assert role == "py:attribute", (path, role)
    elif inspect.isclass(obj):
      assert role == "py:class", (path, role)
    elif callable(obj):
      assert role == "py:function", (path, role)
    else:
      assert role == "py:data", (path, role)
  for path, cls in NAMEDTUPLES.items():
    if path in ALIASES:
      continue
    for field in cls._fields:
      entry = inventory.get(f"{path}.{field}")
      assert entry and entry[0] == "py:attribute", (path, field)


def test_the_reference_holds_every_public_name_and_nothing_else(
  api_inventory,
):
  _check_inventory(api_inventory)


def test_fields_read_their_description_not_their_position():
  # What docs/_ext/public_api.py does to autodoc's entries.
  def processed(what, name, obj, lines):
    lines = list(lines)
    public_api._process_docstring(None, what, name, obj, {}, lines)
    return lines

  alias = ["Alias for field number 1"]
  assert processed(
    "attribute", "grpo_optax.ClipWithL2State.clipped", None, alias
  ) == ["shape=(), dtype=int32: steps whose norm exceeded max_norm"]
  from grpo_optax import training  # pylint: disable=g-import-not-at-top

  doc = training.DataParallelState.__doc__.splitlines()
  lines = processed(
    "class",
    "grpo_optax.training.DataParallelState",
    training.DataParallelState,
    [line.strip() for line in doc],
  )
  assert "Attributes:" not in lines  # shown once, on the fields
  assert processed(
    "attribute", "grpo_optax.training.DataParallelState.exchange", None, alias
  )[0].startswith("the :class:`~grpo_optax.training.ExchangeState`; its")
  assert processed(
    "data", "grpo_optax.training.EXCHANGES", ("dense",), ["tuple doc"]
  ) == [public_api.constant_description("grpo_optax.training", "EXCHANGES")]
  assert processed("data", "grpo_optax.rl.PRESETS", (), [])[0].startswith(
    "The names"
  )


def test_objects_are_documented_in_the_api_pages_only():
  # Elsewhere only a module's text (automodule with :no-members:), so that
  # the API pages' inventory is the site's.
  directive = re.compile(r"^\.\. (auto\w+):: (\S+)\n((?:   .*\n)*)", re.M)
  for page in sorted(DOCS.rglob("*.md")):
    if {"_build", "_generated", "api"} & set(page.relative_to(DOCS).parts):
      continue
    for kind, target, options in directive.findall(page.read_text()):
      where = f"{page.relative_to(ROOT)}: {kind}:: {target}"
      assert kind == "automodule" and ":no-members:" in options, where


# -- the site's structure --------------------------------------------------


def _pages():
  return sorted(
    p
    for p in DOCS.rglob("*.md")
    if not {"_build", "_generated", "_ext"} & set(p.relative_to(DOCS).parts)
  )


INCLUDE = re.compile(r"^```\{include\} (\S+)", re.M)


def _title(page: pathlib.Path) -> str:
  text = page.read_text(encoding="utf-8")
  m = re.search(r"^# (.+)$", text, re.M)
  if m:
    return m.group(1).strip()
  included = INCLUDE.search(text)
  assert included, f"{page} has no title"
  return _title((page.parent / included.group(1)).resolve())


def test_no_two_pages_share_a_title():
  titles = {}
  for page in _pages():
    titles.setdefault(_title(page), []).append(
      page.relative_to(DOCS).as_posix()
    )
  repeated = {t: p for t, p in titles.items() if len(p) > 1}
  assert not repeated, repeated


def _included_results() -> set[str]:
  out = set()
  for page in _pages():
    for target in INCLUDE.findall(page.read_text(encoding="utf-8")):
      path = (page.parent / target).resolve()
      if path.is_relative_to(ROOT / "benchmarks" / "results"):
        out.add(path.relative_to(ROOT).as_posix())
  return out


def test_every_committed_result_is_on_the_site():
  # claims.md is on the site as docs/benchmarks/claims.md, regenerated from
  # the JSON files at each build (docs/conf.py).
  on_site = _included_results() | {"benchmarks/results/claims.md"}
  committed = {
    p.relative_to(ROOT).as_posix()
    for p in (ROOT / "benchmarks" / "results").rglob("*.md")
  }
  assert committed - on_site == set()
  quoted = set()
  for page in [ROOT / "README.md", *_pages()]:
    quoted |= set(
      re.findall(r"benchmarks/results/[\w./-]+?\.md", page.read_text())
    )
  assert "benchmarks/results/step_time_2026-12-01_run2.md" in quoted
  assert quoted <= on_site, sorted(quoted - on_site)


@pytest.mark.slow
def test_the_site_inventory(tmp_path):
  # The whole site, as CI builds it (sphinx-build -W; furo, viewcode), with
  # the docstrings.
  inventory = _build(DOCS, tmp_path)
  rooms = {
    name
    for name in ALL_MODULES
    if importlib.import_module(name) is not None and name not in PUBLIC
  }
  _check_inventory(inventory, allowed_modules=rooms)
  html = tmp_path / "html"
  for page in html.rglob("*.html"):
    assert "Alias for field number" not in page.read_text(encoding="utf-8")
  text = (html / "api" / "grpo_optax.html").read_text(encoding="utf-8")
  assert "steps whose norm exceeded max_norm" in text  # a field's comment
