"""Sphinx configuration of the grpo_optax documentation site.

Build: ``sphinx-build -W --keep-going -b html docs docs/_build/html``.
The claims table is regenerated from ``benchmarks/results/*.json`` on every
build (``benchmarks.claims``), so the site never shows a copied table.
"""

import logging
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)
sys.path.insert(
  0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ext")
)

import grpo_optax  # noqa: E402

project = "grpo_optax"
author = "The grpo_optax authors"
copyright = "the grpo_optax authors"  # noqa: A001
release = grpo_optax.__version__
version = release

extensions = [
  "myst_parser",
  "sphinx.ext.autodoc",
  "sphinx.ext.autosummary",
  "sphinx.ext.napoleon",
  "sphinx.ext.mathjax",
  "sphinx.ext.viewcode",
  # NamedTuple fields and re-exported constants described (docs/_ext).
  "public_api",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "_ext", "Thumbs.db", ".DS_Store"]
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

# The API reference (docs/api/) documents every public name under the path
# users import (grpo_optax.grpo, not grpo_optax.presets.grpo); its
# autosummary tables link to those entries (no generated stub pages).
autosummary_generate = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# Attributes sections as :ivar: fields. A NamedTuple's fields are documented
# once, by autodoc: docs/_ext/public_api.py moves each field's entry of the
# Attributes section (or its source comment) to the field, in place of
# "Alias for field number N".
napoleon_use_ivar = True

# Every reference to a name of this package links (or, for an internal
# helper, is plain text: docs/_ext/public_api.py); the other packages' names
# are not linked (no intersphinx: the build needs no network).
nitpicky = True
nitpick_ignore_regex = [
  (r"py:.*", r"(abc|jax|jaxlib|optax|numpy|np|flax|collections|typing)(\..*)?"),
]

html_theme = "furo"
html_title = f"grpo_optax {release}"

# Pages other work streams add (design document, communication, local steps,
# multi-process training, memory, RL guide). The toctree names them with a
# one-character glob class ("[d]esign") so that a page that has not landed
# yet is left out instead of failing the build; once it lands it is listed.
PENDING_PAGES = (
  "design",
  "communication",
  "local_steps",
  "multiprocess",
  "memory",
  "rl",
)


class _PendingPageFilter(logging.Filter):
  """Drops the "glob pattern didn't match" warning of the pending pages only."""

  def filter(self, record: logging.LogRecord) -> bool:
    msg = record.getMessage()
    return not (
      "didn't match any documents" in msg
      and any(f"[{p[0]}]{p[1:]}" in msg for p in PENDING_PAGES)
    )


def _write_claims(app) -> None:
  """Regenerates the claims table from the benchmark JSON files."""
  from benchmarks import claims  # pylint: disable=import-outside-toplevel

  out_dir = os.path.join(app.srcdir, "_generated")
  os.makedirs(out_dir, exist_ok=True)
  out = os.path.join(out_dir, "claims.md")
  import contextlib  # pylint: disable=import-outside-toplevel
  import io  # pylint: disable=import-outside-toplevel

  with contextlib.chdir(ROOT), contextlib.redirect_stdout(io.StringIO()):
    claims.main(["--results", "benchmarks/results", "--out", out])


def _write_wiring(app) -> None:
  """Renders grpo()'s parameter table from presets.WIRING."""
  import wiring_table  # pylint: disable=import-outside-toplevel

  out_dir = os.path.join(app.srcdir, "_generated")
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "grpo_parameters.md"), "w") as f:
    f.write(wiring_table.markdown_table())


def setup(app):
  logging.getLogger("sphinx.sphinx.directives.other").addFilter(
    _PendingPageFilter()
  )
  missing = [
    p
    for p in PENDING_PAGES
    if not os.path.exists(os.path.join(app.srcdir, p + ".md"))
  ]
  if missing:
    print(
      "docs: pages not written yet (left out of the toctree): "
      + ", ".join(missing)
    )
  app.connect("builder-inited", _write_claims)
  app.connect("builder-inited", _write_wiring)
