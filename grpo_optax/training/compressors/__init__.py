"""The compressors of the gradient exchange, and their one registry.

Every exchange of :mod:`grpo_optax.training` (``exchange="..."`` of
:func:`~grpo_optax.training.sparse_pmean`,
:func:`~grpo_optax.training.data_parallel_step`, the runtime
:class:`~grpo_optax.training.DataParallel`, local steps' outer exchange, the
examples' ``--exchange`` flag) is a :class:`Compressor` registered here.
:data:`REGISTRY` is the single list of their names; :func:`options` gathers
the options they take (each declared once, in its compressor's module);
:func:`make` validates a name and options and builds the compressor.

Adding a compressor: one module here with a ``Compressor`` subclass, and in
this file its import, its line in :data:`REGISTRY` and its name in
``__all__`` (docs/design.md, "Adding a compressor").
"""

from __future__ import annotations

from typing import Any

from grpo_optax.training.compressors.all_gather import AllGather
from grpo_optax.training.compressors.base import CHUNK_SIZE
from grpo_optax.training.compressors.base import FRACTION
from grpo_optax.training.compressors.base import VALUES
from grpo_optax.training.compressors.base import Compressor
from grpo_optax.training.compressors.base import Decompressed
from grpo_optax.training.compressors.base import Option
from grpo_optax.training.compressors.base import Payload
from grpo_optax.training.compressors.dense import Dense
from grpo_optax.training.compressors.int8 import Int8
from grpo_optax.training.compressors.powersgd import PowerSGD
from grpo_optax.training.compressors.powersgd import PowerSGDState
from grpo_optax.training.compressors.shared_support import SharedSupport
from grpo_optax.training.compressors.shared_support import SupportState

#: name -> compressor class: the exchanges, in the order the docs list them.
REGISTRY: dict[str, type[Compressor]] = {
  c.name: c for c in (Dense, AllGather, SharedSupport, PowerSGD, Int8)
}

#: The exchange names (``exchange=`` values).
NAMES: tuple[str, ...] = tuple(REGISTRY)


def options() -> dict[str, Option]:
  """Every option of every compressor, by name (choices: their union).

  The default of an option is the same in every compressor that takes it.
  """
  out: dict[str, Option] = {}
  for cls in REGISTRY.values():
    for o in cls.options:
      if o.name in out:
        merged = out[o.name].choices + tuple(
          c for c in o.choices if c not in out[o.name].choices
        )
        out[o.name] = out[o.name].restrict(merged)
      else:
        out[o.name] = o
  return out


def takers(name: str, value: Any = None) -> tuple[str, ...]:
  """The compressors that take option ``name`` (with ``value``, if given)."""
  return tuple(
    c.name
    for c in REGISTRY.values()
    for o in c.options
    if o.name == name and (value is None or not o.choices or value in o.choices)
  )


def make(exchange: Any, **given: Any) -> Compressor:
  """The compressor ``exchange`` with the options ``given``.

  Every option is first checked against its declaration (its range or
  choices). An option the compressor does not take is accepted at its
  default and refused otherwise; a value outside the compressor's own
  choices is refused, naming the compressors that take it.

  Raises:
    ValueError: naming the argument, what is allowed and the value given.
    TypeError: for a keyword no compressor takes.
  """
  if exchange not in REGISTRY:
    raise ValueError(f"`exchange` must be one of {NAMES}, got {exchange!r}.")
  cls = REGISTRY[exchange]
  known = options()
  mine = {o.name: o for o in cls.options}
  kwargs = {}
  for name, value in given.items():
    if name not in known:
      raise TypeError(
        f"no exchange takes the option `{name}`; options: {tuple(known)}."
      )
    value = known[name].check(value)
    ok = name in mine and (
      not mine[name].choices or value in mine[name].choices
    )
    if ok:
      kwargs[name] = value
      continue
    if name not in mine and value == known[name].default:
      continue
    who = takers(name, value)
    need = f"`exchange={who[0]!r}`" if len(who) == 1 else f"`exchange` in {who}"
    note = cls.notes.get(name)
    raise ValueError(
      f"`{name}={value!r}` needs {need}"
      + (f" ({note})" if note else "")
      + f"; got exchange={exchange!r}."
    )
  return cls(**kwargs)


def markdown_table() -> str:
  """The exchanges and their options as Markdown (``docs/communication.md``
  includes it, via :func:`grpo_optax.training.exchange.options_table`; a
  test checks the page against the registry).
  """
  rows = ["| exchange | module | options (default) |", "|---|---|---|"]
  for name, cls in REGISTRY.items():
    opts = ", ".join(f"`{o.name}` ({o.default!r})" for o in cls.options)
    module = cls.__module__.replace(".", "/") + ".py"
    rows.append(f"| `{name}` | `{module}` | {opts or '—'} |")
  rows += ["", "| option | allowed | taken by | what |", "|---|---|---|---|"]
  for name, o in options().items():
    who = []
    for cls in REGISTRY.values():
      for mine in cls.options:
        if mine.name == name:
          only = mine.choices != o.choices
          who.append(f"`{cls.name}`" + (f" {mine.choices}" if only else ""))
    rows.append(f"| `{name}` | {o.allowed()} | {', '.join(who)} | {o.help} |")
  return "\n".join(rows) + "\n"


__all__ = (
  "CHUNK_SIZE",
  "FRACTION",
  "NAMES",
  "REGISTRY",
  "VALUES",
  "AllGather",
  "Compressor",
  "Decompressed",
  "Dense",
  "Int8",
  "Option",
  "Payload",
  "PowerSGD",
  "PowerSGDState",
  "SharedSupport",
  "SupportState",
  "make",
  "markdown_table",
  "options",
  "takers",
)
