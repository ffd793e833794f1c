"""The examples' command line: the parser, its help, one-line errors.

Argparse only (no JAX, no Flax), so that the smallest example
(``examples/logistic_regression.py``) uses it without their import time.
:mod:`examples.common.flags` adds the flags the training examples share.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """Appends "(default: X)" to a flag's help unless the text gives it.

  A help text that already says what the default is ("(default: the
  example's per-optimizer default)") gets no second one, and neither does a
  flag whose default is None (the text says what unset means) or a switch.
  """

  def _get_help_string(self, action: argparse.Action) -> str | None:
    text = action.help or ""
    if (
      "default" in text.lower()
      or any(action.default is v for v in (None, False, argparse.SUPPRESS))
      or isinstance(action, argparse._StoreConstAction)  # pylint: disable=protected-access
      or not action.option_strings
    ):
      return text
    return f"{text} (default: %(default)s)".lstrip()


class ArgumentParser(argparse.ArgumentParser):
  """The examples' parser: one line of usage on an error, flags given.

  ``parse_args`` also records in :attr:`given` the destinations of the
  flags given on the command line (as opposed to left at their default), so
  that a check can refuse a flag the chosen configuration would ignore.
  """

  def __init__(self, **kwargs: Any):
    kwargs.setdefault("formatter_class", HelpFormatter)
    super().__init__(**kwargs)
    self.given: frozenset[str] = frozenset()

  def error(self, message: str):  # type: ignore[override]
    """Prints a one-line usage hint and the error; exits with code 2."""
    self.exit(
      2,
      f"usage: {self.prog} [flags]  (--help lists them)\n"
      f"{self.prog}: error: {message}\n",
    )

  def parse_args(self, args: Sequence[str] | None = None, namespace=None):  # type: ignore[override]
    parsed = super().parse_args(args, namespace)
    self.given = self._given(args)
    return parsed

  def _given(self, args: Sequence[str] | None) -> frozenset[str]:
    """Destinations of the flags on the command line (parsed again with no
    defaults, so only those given are set).
    """
    defaults = [(action, action.default) for action in self._actions]
    try:
      for action, _ in defaults:
        action.default = argparse.SUPPRESS
      found, _ = super().parse_known_args(
        list(sys.argv[1:] if args is None else args)
      )
    finally:
      for action, default in defaults:
        action.default = default
    return frozenset(vars(found))


def refuse_unless(
  parser: ArgumentParser, flag: str, condition: bool, needs: str
) -> None:
  """``parser.error`` when ``flag`` was given but ``needs`` does not hold.

  Args:
    parser: the parser (its :attr:`ArgumentParser.given`).
    flag: the flag, as typed (``"--checkpoint-every"``).
    condition: whether the configuration uses the flag.
    needs: what it needs, for the message (``"--workdir"``).
  """
  dest = flag.lstrip("-").replace("-", "_")
  if dest in getattr(parser, "given", ()) and not condition:
    parser.error(f"{flag} needs {needs}; as given it would be ignored")


def announce_compile(quiet: bool, what: str = "the training step") -> None:
  """Prints that the first step compiles (XLA takes seconds to minutes).

  Args:
    quiet: print nothing.
    what: the step about to compile, for the message.
  """
  if not quiet:
    print(f"compiling {what} (the first step waits for XLA) ...", flush=True)
