#!/usr/bin/env python
"""Runs optax's own contrib test suite (``optax/contrib/_common_test.py``,
shipped with optax) on ``grpo()`` in its three sparsify modes.

The suite is copied from the installed optax, its optimizer list is replaced
by the three ``grpo()`` modes (with the defaults otherwise; ``min_size=0`` so
that the suite's small parameters are masked too), and ``contrib.<name>``
resolves to them. Usage: ``python tools/optax_contrib_suite.py [pytest args]``.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import tempfile

import optax

ENTRIES = """[
    {'opt_name': 'grpo_topk', 'opt_kwargs': {'learning_rate': 1e-2}},
    {'opt_name': 'grpo_threshold', 'opt_kwargs': {'learning_rate': 1e-2}},
    {'opt_name': 'grpo_dense', 'opt_kwargs': {'learning_rate': 1e-2}},
]
"""

SHIM = '''
import functools as _functools
import grpo_optax as _grpo_optax
from optax import contrib as _optax_contrib


class _Contrib:
  """optax.contrib plus the three grpo() modes under test."""

  # partials keep grpo's signature (optax.inject_hyperparams reads it).
  grpo_topk = staticmethod(_functools.partial(_grpo_optax.grpo, min_size=0))
  grpo_threshold = staticmethod(_functools.partial(
      _grpo_optax.grpo, sparsify="threshold", min_size=0))
  grpo_dense = staticmethod(_functools.partial(_grpo_optax.grpo,
                                               sparsify=None))

  def __getattr__(self, name):
    return getattr(_optax_contrib, name)


contrib = _Contrib()
'''


def main(argv: list[str]) -> int:
  source = pathlib.Path(optax.__file__).parent / "contrib" / "_common_test.py"
  text = source.read_text()
  text = re.sub(
    r"_MAIN_OPTIMIZERS_UNDER_TEST = \[.*?\n\]\n",
    "_MAIN_OPTIMIZERS_UNDER_TEST = " + ENTRIES,
    text,
    count=1,
    flags=re.S,
  )
  # The wrapper tests keep optax's own base optimizers: only ours are new.
  text = text.replace("from optax import contrib\n", SHIM, 1)
  with tempfile.TemporaryDirectory() as tmp:
    path = pathlib.Path(tmp) / "grpo_contrib_common_test.py"
    path.write_text(text)
    return subprocess.call(
      [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-k",
        "grpo",
        str(path),
        *argv,
      ]
    )


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
