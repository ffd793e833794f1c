"""The first version's compression module, kept for its public names.

The compressors now live one per module in
:mod:`grpo_optax.training.compressors` (with their one registry); this module
re-exports the helpers that code written against the first version imports
(``compression.num_kept``, ``powersgd_shape``, ``warmup_fractions``, ...).
The option choices (``VALUE_FORMATS``, ``INDEX_FORMATS``, ``SUPPORTS``) are
read from the registry's declarations.
"""

from __future__ import annotations

from grpo_optax.training import compressors
from grpo_optax.training.compressors.all_gather import BLOCK
from grpo_optax.training.compressors.all_gather import Layout
from grpo_optax.training.compressors.payload import chunk_rows
from grpo_optax.training.compressors.payload import num_kept
from grpo_optax.training.compressors.payload import replica_mean
from grpo_optax.training.compressors.payload import value_bytes
from grpo_optax.training.compressors.powersgd import init_powersgd
from grpo_optax.training.compressors.powersgd import powersgd_shape
from grpo_optax.training.exchange import warmup_fractions

_OPTIONS = compressors.options()
#: Value formats of the payloads (the ``values`` option's choices).
VALUE_FORMATS = _OPTIONS["values"].choices
#: Index formats of the all-gather (the ``indices`` option's choices).
INDEX_FORMATS = _OPTIONS["indices"].choices
#: How the shared support is chosen (the ``support`` option's choices).
SUPPORTS = _OPTIONS["support"].choices

__all__ = (
  "BLOCK",
  "INDEX_FORMATS",
  "SUPPORTS",
  "VALUE_FORMATS",
  "Layout",
  "chunk_rows",
  "init_powersgd",
  "num_kept",
  "powersgd_shape",
  "replica_mean",
  "value_bytes",
  "warmup_fractions",
)
