"""Diagnostics: read the GRPO stages' statistics out of any optimizer state.

``metrics``, ``frozen_mask`` and ``importance_converged`` take the whole
optimizer state however it is wrapped (``optax.chain``, ``inject_hyperparams``,
``MultiSteps``, ``masked``, ``partition``, Flax NNX's ``Optimizer.opt_state``):
they search the state tree for the GRPO state types.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from grpo_optax import _common
from grpo_optax.clipping import ClipWithL2State
from grpo_optax.freezing import FreezeBelowState
from grpo_optax.importance import ScaleByImportanceState
from grpo_optax.momentum import ScaleByNesterovAdamRmsState
from grpo_optax.sparsify import EmaThresholdMaskState
from grpo_optax.sparsify import TopKMaskState
from grpo_optax.variance import ScaleByVarianceLrState

__all__ = (
  "frozen_mask",
  "importance_converged",
  "metrics",
)

# The name of each room's state in metrics() keys. A room's state answers
# the protocol by a ``metrics(self) -> dict[str, jax.Array]`` method; a state
# type not named here reports under its ``metrics_prefix`` class attribute
# (a new mechanism's room names itself), else its class name.
PREFIXES = {
  ClipWithL2State: "clip",
  ScaleByImportanceState: "importance",
  TopKMaskState: "topk",
  EmaThresholdMaskState: "threshold",
  ScaleByNesterovAdamRmsState: "adaptive",
  ScaleByVarianceLrState: "variance_lr",
  FreezeBelowState: "freeze",
}


def _is_variable(x) -> bool:
  # Flax NNX wraps optimizer-state arrays in Variables (OptArray).
  return hasattr(x, "get_value") and not isinstance(x, (jax.Array, np.ndarray))


def _unwrap(opt_state):
  return jax.tree.map(
    lambda x: x.get_value() if _is_variable(x) else x,
    opt_state,
    is_leaf=_is_variable,
  )


def _is_room(x) -> bool:
  return (
    isinstance(x, tuple)
    and hasattr(x, "_fields")
    and callable(getattr(type(x), "metrics", None))
  )


def _label(path) -> str | None:
  """The innermost dict key on ``path`` (``optax.partition``'s labels)."""
  for entry in reversed(path):
    if isinstance(entry, jax.tree_util.DictKey):
      return str(entry.key)
  return None


def find_states(opt_state, state_type=None) -> list[Any]:
  """All room states (of ``state_type``) inside ``opt_state``, tree order."""
  opt_state = _unwrap(opt_state)
  found = [
    x for x in jax.tree.leaves(opt_state, is_leaf=_is_room) if _is_room(x)
  ]
  return [x for x in found if state_type is None or isinstance(x, state_type)]


def metrics(opt_state) -> dict[str, jax.Array]:
  """Diagnostics of every GRPO room found in ``opt_state``.

  Keys are ``"<room>/<name>"`` (``"clip/clip_rate"``, ``"importance/weight_std"``,
  ``"topk/kept_fraction"``, ``"threshold/tau_mean"``, ``"variance_lr/lr_scale"``,
  ``"freeze/frozen_leaves"``, ...). A room found under a dict key (e.g. an
  ``optax.partition`` label) is prefixed by it (``"<label>:topk/..."``);
  a room that still occurs more than once is numbered (``"clip_0/..."``).
  Each room's state reports through its own ``metrics()`` method, so a new
  room joins by defining one. Scalars, except ``importance/weights`` (a
  strided sample of the normalised importance scores, for histograms) and
  ``freeze/importance`` (per-leaf importance). Works inside ``jax.jit``.

  Args:
    opt_state: any optimizer state containing GRPO states.

  Returns:
    A flat ``dict[str, jax.Array]``.
  """
  opt_state = _unwrap(opt_state)
  named = []
  for path, s in jax.tree_util.tree_flatten_with_path(
    opt_state, is_leaf=_is_room
  )[0]:
    if not _is_room(s):
      continue
    room = PREFIXES.get(type(s)) or getattr(
      type(s), "metrics_prefix", type(s).__name__
    )
    label = _label(path)
    named.append((f"{label}:{room}" if label is not None else room, s))
  seen: dict[str, int] = {}
  for name, _ in named:
    seen[name] = seen.get(name, 0) + 1
  counter: dict[str, int] = {}
  out = {}
  for name, s in named:
    prefix = name
    if seen[name] > 1:
      prefix = f"{name}_{counter.get(name, 0)}"
      counter[name] = counter.get(name, 0) + 1
    for k, v in s.metrics().items():
      out[f"{prefix}/{k}"] = v
  return out


def frozen_mask(opt_state, like: Any = None) -> Any:
  """The frozen leaves decided by the ``freeze_below`` room.

  Args:
    opt_state: an optimizer state containing exactly one
      :class:`~grpo_optax.FreezeBelowState` (possibly wrapped).
    like: the params (or any tree of their structure); the result then has
      that structure. Without it, a ``(num_leaves,)`` bool vector in the
      params' leaf order.

  Returns:
    Boolean scalars (``True`` = frozen), for
    ``grpo_optax.training.frozen_train_step``.

  Raises:
    ValueError: if the state has no or several ``freeze_below`` rooms.
  """
  states = find_states(opt_state, FreezeBelowState)
  if len(states) != 1:
    raise ValueError(
      "frozen_mask: expected exactly one freeze_below stage in opt_state,"
      f" found {len(states)}"
    )
  frozen = states[0].frozen
  if like is None:
    return frozen
  n = jax.tree.structure(like).num_leaves
  if n != frozen.shape[0]:
    raise ValueError(
      f"frozen_mask: `like` has {n} leaves but the freeze_below state was "
      f"built for {frozen.shape[0]}"
    )
  return jax.tree.unflatten(
    jax.tree.structure(like), [frozen[i] for i in range(frozen.shape[0])]
  )


def importance_converged(opt_state, std_below: float = 0.05) -> jax.Array:
  """Article 004 §4.3's early stop: importance scores have flattened out.

  True when every ``scale_by_importance`` stage has taken at least one step
  and the standard deviation of its normalised scores ``S / mean(S)`` (over
  all elements) is below ``std_below``.

  Args:
    opt_state: an optimizer state containing ``scale_by_importance`` stages.
    std_below: the threshold, > 0 (article: 0.05).

  Returns:
    A boolean scalar array (usable inside ``jit``).

  Raises:
    ValueError: if there is no importance stage or ``std_below <= 0``.
  """
  _common.check_range("std_below", std_below, 0.0, low_inclusive=False)
  states = find_states(opt_state, ScaleByImportanceState)
  if not states:
    raise ValueError(
      "importance_converged: no scale_by_importance stage (or"
      " grpo with importance) in opt_state"
    )
  ok = jnp.asarray(True)
  for s in states:
    ok = ok & (s.count > 0) & (s.score_std < std_below)
  return ok
