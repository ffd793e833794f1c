"""The first version's compression module, kept for its public names.

The compressors now live one per module in
:mod:`grpo_optax.training.compressors` (with their one registry); this module
keeps the names that code written against the first version imports: the
function forms of three compressors (:func:`all_gather_mean`,
:func:`shared_support_mean`, :func:`powersgd_mean`: each builds the
compressor and runs its ``mean``), their state and sizes
(``init_support``, ``init_powersgd``, ``num_kept``, ``powersgd_shape``,
``warmup_fractions``, ...). The option choices (``VALUE_FORMATS``,
``INDEX_FORMATS``, ``SUPPORTS``) are read from the registry's declarations.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from grpo_optax.training import compressors
from grpo_optax.training.compressors.all_gather import BLOCK
from grpo_optax.training.compressors.all_gather import AllGather
from grpo_optax.training.compressors.all_gather import Layout
from grpo_optax.training.compressors.payload import chunk_rows  # noqa: F401  (a helper, not exported)
from grpo_optax.training.compressors.payload import num_kept
from grpo_optax.training.compressors.payload import replica_mean
from grpo_optax.training.compressors.payload import value_bytes
from grpo_optax.training.compressors.powersgd import PowerSGD
from grpo_optax.training.compressors.powersgd import PowerSGDState
from grpo_optax.training.compressors.powersgd import init_powersgd
from grpo_optax.training.compressors.powersgd import powersgd_shape
from grpo_optax.training.compressors.shared_support import SharedSupport
from grpo_optax.training.compressors.shared_support import SupportState
from grpo_optax.training.compressors.shared_support import initial_support
from grpo_optax.training.exchange import warmup_fractions

__all__ = (
  "BLOCK",
  "INDEX_FORMATS",
  "SUPPORTS",
  "VALUE_FORMATS",
  "Layout",
  "all_gather_mean",
  "init_powersgd",
  "init_support",
  "num_kept",
  "powersgd_mean",
  "powersgd_shape",
  "replica_mean",
  "shared_support_mean",
  "value_bytes",
  "warmup_fractions",
)

_OPTIONS = compressors.options()
#: Value formats of the payloads (the ``values`` option's choices).
VALUE_FORMATS = _OPTIONS["values"].choices
#: Index formats of the all-gather (the ``indices`` option's choices).
INDEX_FORMATS = _OPTIONS["indices"].choices
#: How the shared support is chosen (the ``support`` option's choices).
SUPPORTS = _OPTIONS["support"].choices


def all_gather_mean(
  accs: Sequence[jax.Array],
  axis_name: Any,
  fraction: float,
  values: str = "float32",
  indices: str = "int32",
) -> tuple[list[Any], list[Any], list[Any]]:
  r"""Per-replica top-k, one all-gather of the packed bytes, scatter-add.

  The ``"all_gather"`` compressor
  (:class:`~grpo_optax.training.compressors.AllGather`) on a list of
  leaves, inside ``shard_map`` over ``axis_name``: per leaf (or per block
  of a leaf with ``indices="compact"``) each replica keeps its ``k``
  entries of largest :math:`|a_i|`; the mean is :math:`\frac1W \sum_i
  \mathrm{scatter}(S_i, \mathrm{dec}(\mathrm{enc}(a_i[S_i])))`.

  Returns:
    ``(means, residuals, sent)`` lists, one entry per leaf.

  Raises:
    TypeError, ValueError: for an option of the wrong type or out of range,
      naming it.
  """
  c = AllGather(fraction=fraction, values=values, indices=indices)
  out = c.mean(list(accs), None, axis_name)
  return out.means, out.residuals, list(out.sent or ())


def init_support(sizes: Sequence[int], chunk_size: int) -> SupportState:
  """``(rate, age)`` of the replicated support: every chunk unexplored."""
  c = SharedSupport(chunk_size=chunk_size, support="replicated")
  return initial_support([int(n) for n in sizes], c.chunk_size)


def shared_support_mean(
  accs: Sequence[jax.Array],
  axis_name: Any,
  fraction: float,
  chunk_size: int,
  values: str = "float32",
  support: Any = None,
) -> tuple[list[Any], list[Any], list[Any], Any]:
  r"""The same chunks on every replica, exchanged by one all-reduce.

  The ``"shared_support"`` compressor
  (:class:`~grpo_optax.training.compressors.SharedSupport`) on a list of
  leaves, inside ``shard_map`` over ``axis_name``: the :math:`\lceil f M
  \rceil` chunks of largest score are summed by one ``psum``. Scores: the
  all-reduced chunk norms (``support=None``), or the replicated estimate
  ``support=(rate, age)`` (:func:`init_support`; no collective).

  Returns:
    ``(means, residuals, sent, support)``, ``support`` the new ``(rate,
    age)`` (None for ``support=None``).

  Raises:
    TypeError, ValueError: for an option of the wrong type or out of range,
      naming it.
  """
  c = SharedSupport(
    fraction=fraction,
    chunk_size=chunk_size,
    values=values,
    support="norms" if support is None else "replicated",
  )
  state = None if support is None else SupportState(*support)
  out = c.mean(list(accs), state, axis_name)
  return out.means, out.residuals, list(out.sent or ()), out.state


def powersgd_mean(
  accs: Sequence[jax.Array],
  axis_name: Any,
  rank: int,
  qs: Sequence[Any],
  values: str = "float32",
) -> tuple[list[Any], list[Any], list[Any]]:
  r"""Rank-``r`` PowerSGD: one power iteration per step, warm-started.

  The ``"powersgd"`` compressor
  (:class:`~grpo_optax.training.compressors.PowerSGD`) on a list of leaves,
  inside ``shard_map`` over ``axis_name``, with ``qs`` the warm-start ``Q``
  per leaf (:func:`init_powersgd`; None for a leaf exchanged densely).

  Returns:
    ``(means, residuals, new_qs)``.

  Raises:
    TypeError, ValueError: for an option of the wrong type or out of range,
      naming it.
  """
  c = PowerSGD(rank=rank, values=values)
  out = c.mean(list(accs), PowerSGDState(list(qs)), axis_name)
  return out.means, out.residuals, list(out.state.q)
