"""The parameter table of ``grpo()``, rendered from ``presets.WIRING``.

The docs build writes it to ``docs/_generated/grpo_parameters.md`` (included
by ``docs/mechanisms/preset.md``), so the table cannot drift from the
keywords the library accepts.
"""

from __future__ import annotations


def _code(value) -> str:
  return f"`{value!r}`"


def markdown_table() -> str:
  """One row per keyword: default, the config fields it sets, what it does."""
  from grpo_optax import presets  # pylint: disable=import-outside-toplevel

  rows = [
    "| keyword | default | sets | what it does |",
    "|---|---|---|---|",
  ]
  for knob in presets.WIRING:
    sets = ", ".join(
      f"`{presets.MECHANISMS[m].__name__}.{f}`" for m, f in knob.fields
    )
    rows.append(
      f"| `{knob.keyword}` | {_code(knob.default)} | "
      f"{sets or 'the preset itself'} | {knob.help} |"
    )
  return "\n".join(rows) + "\n"
