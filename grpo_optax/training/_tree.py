"""Tree helpers shared by the training-program mechanisms (not public API).

The mechanisms of this package all differentiate a loss with respect to a
*subset* of the parameter leaves. The subset is a static list of Python bools
(one per leaf, in ``jax.tree.leaves`` order), so that it can key a compilation
cache and be closed over by ``jax.jit`` without becoming a traced value.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.core
import numpy as np

# A rule selecting leaves: a regex (searched in the leaf's path string), a
# callable ``(path: str, leaf) -> bool``, or a tree of bools shaped like params.
Rule = Any


def path_str(path: Sequence[Any]) -> str:
  """Renders a key path as ``"layers/0/attn/query/kernel"``.

  Flax NNX states add a trailing ``value`` key to every variable; it is kept,
  so a rule can match it or ignore it.
  """
  return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def leaf_paths(tree: Any) -> list[str]:
  """Path strings of the leaves of ``tree``, in ``jax.tree.leaves`` order."""
  return [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _as_bool(value: Any, name: str) -> bool:
  if isinstance(value, jax.core.Tracer):
    raise ValueError(
      f"`{name}` must hold concrete booleans, got a traced value;"
      " compute the mask outside jit."
    )
  arr = np.asarray(value)
  if arr.shape != () or arr.dtype != np.bool_:
    raise ValueError(
      f"`{name}` must be a tree of scalar booleans; got a leaf of"
      f" dtype {arr.dtype} and shape {arr.shape}."
    )
  return bool(arr)


def resolve_mask(rule: Rule, params: Any, *, name: str) -> tuple[bool, ...]:
  """Evaluates ``rule`` on every leaf of ``params``.

  Args:
    rule: a regex (``str`` or compiled pattern; a leaf is selected when
      ``re.search`` finds it in the leaf's path), a callable
      ``(path: str, leaf) -> bool``, or a tree of scalar booleans with the
      structure of ``params``.
    params: the parameter tree (arrays or ``jax.ShapeDtypeStruct``).
    name: the argument's name, for error messages.

  Returns:
    A tuple of Python bools, one per leaf of ``params``.

  Raises:
    ValueError: if a bool tree does not match ``params`` or holds non-bools.
  """
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  if isinstance(rule, (str, re.Pattern)):
    pattern = re.compile(rule)
    return tuple(bool(pattern.search(path_str(p))) for p, _ in flat)
  if callable(rule):
    return tuple(bool(rule(path_str(p), x)) for p, x in flat)
  mask_leaves, mask_def = jax.tree.flatten(rule)
  if mask_def != treedef:
    raise ValueError(
      f"`{name}` must have the structure of the params; got {mask_def},"
      f" params have {treedef}."
    )
  return tuple(_as_bool(m, name) for m in mask_leaves)


def check_real(name: str, value: Any, kind: str) -> float:
  """``value`` as a float; ``TypeError`` naming ``name`` unless a real number.

  Strings (``float("0.5")`` would parse them), None, bools and sequences are
  refused; ``kind`` words what is expected (``"a float in [0, 1)"``).
  """
  if isinstance(value, (bool, np.bool_)) or not (
    isinstance(value, (int, float, np.integer, np.floating))
    or (isinstance(value, (np.ndarray, jax.Array)) and np.ndim(value) == 0)
  ):
    raise TypeError(f"`{name}` must be {kind}, got {value!r}.")
  return float(value)


def check_flag(name: str, value: Any) -> bool:
  """``value``; ``TypeError`` naming ``name`` unless it is a Python bool."""
  if not isinstance(value, bool):
    raise TypeError(f"`{name}` must be a bool (True or False), got {value!r}.")
  return value


def check_positive_int(name: str, value: Any) -> int:
  """Returns ``value`` as an int, raising ``ValueError`` unless it is >= 1."""
  if isinstance(value, bool):
    raise ValueError(f"`{name}` must be an int >= 1, got {value!r}.")
  try:
    v = operator.index(value)
  except TypeError:
    raise ValueError(f"`{name}` must be an int >= 1, got {value!r}.") from None
  if v < 1:
    raise ValueError(f"`{name}` must be an int >= 1, got {v}.")
  return v


def check_fraction(name: str, value: Any) -> float:
  """Returns ``value`` as a float, raising ``ValueError`` unless in [0, 1)."""
  check_real(name, value, "a float in [0, 1)")
  try:
    v = float(value)
  except (TypeError, ValueError):
    raise ValueError(
      f"`{name}` must be a float in [0, 1), got {value!r}."
    ) from None
  if not 0.0 <= v < 1.0:
    raise ValueError(f"`{name}` must be a float in [0, 1), got {v}.")
  return v


def split_leaves(
  leaves: Sequence[Any], mask: Sequence[bool]
) -> tuple[list[Any], list[Any]]:
  """Splits ``leaves`` into ``(selected, rest)`` by the static ``mask``."""
  sel = [x for x, m in zip(leaves, mask) if m]
  rest = [x for x, m in zip(leaves, mask) if not m]
  return sel, rest


def merge_leaves(
  selected: Sequence[Any], rest: Sequence[Any], mask: Sequence[bool]
) -> list[Any]:
  """Inverse of :func:`split_leaves`."""
  it_sel, it_rest = iter(selected), iter(rest)
  return [next(it_sel) if m else next(it_rest) for m in mask]


def value_and_grad_subset(
  loss_fn: Callable[..., Any],
  params: Any,
  mask: Sequence[bool],
  *args: Any,
  has_aux: bool = False,
):
  """Value and gradient of ``loss_fn(params, *args)`` w.r.t. the masked leaves.

  The unselected leaves enter the loss as constants (closed over), so the
  program JAX builds contains no cotangent computation for them: XLA never
  sees the matmuls that would produce their weight gradients. Input
  gradients still flow through every layer that lies between the loss and a
  selected leaf.

  Args:
    loss_fn: ``loss_fn(params, *args) -> scalar`` (or ``(scalar, aux)``).
    params: the parameter tree.
    mask: static bools, one per leaf of ``params``; True = differentiate.
    *args: passed to ``loss_fn`` (not differentiated).
    has_aux: as in ``jax.value_and_grad``.

  Returns:
    ``(value, grads)`` where ``grads`` is a list with one entry per leaf of
    ``params``: the gradient for selected leaves, ``None`` for the others.
  """
  leaves, treedef = jax.tree.flatten(params)
  if len(mask) != len(leaves):
    raise ValueError(
      f"mask has {len(mask)} entries, params have {len(leaves)} leaves."
    )
  selected, rest = split_leaves(leaves, mask)

  def partial_loss(sel):
    return loss_fn(treedef.unflatten(merge_leaves(sel, rest, mask)), *args)

  value, g_sel = jax.value_and_grad(partial_loss, has_aux=has_aux)(selected)
  grads = merge_leaves(g_sel, [None] * len(rest), mask)
  return value, grads
