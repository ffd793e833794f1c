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

from grpo_optax import _formulas as F
from grpo_optax import _common
from grpo_optax.clipping import ClipWithL2State
from grpo_optax import fused
from grpo_optax.freezing import FreezeBelowState
from grpo_optax.fused import GrpoState
from grpo_optax.importance import ScaleByImportanceState
from grpo_optax.momentum import ScaleByNesterovAdamRmsState
from grpo_optax.sparsify import EmaThresholdMaskState
from grpo_optax.sparsify import TopKMaskState
from grpo_optax.variance import ScaleByVarianceLrState

_STATE_TYPES = (ClipWithL2State, ScaleByImportanceState, TopKMaskState,
                EmaThresholdMaskState, ScaleByNesterovAdamRmsState,
                ScaleByVarianceLrState, FreezeBelowState, GrpoState)
_PREFIX = {
    ClipWithL2State: "clip",
    ScaleByImportanceState: "importance",
    TopKMaskState: "topk",
    EmaThresholdMaskState: "threshold",
    ScaleByNesterovAdamRmsState: "adaptive",
    ScaleByVarianceLrState: "variance_lr",
    FreezeBelowState: "freeze",
    GrpoState: "grpo",
}


def _is_variable(x) -> bool:
  # Flax NNX wraps optimizer-state arrays in Variables (OptArray).
  return hasattr(x, "get_value") and not isinstance(x, (jax.Array, np.ndarray))


def _unwrap(opt_state):
  return jax.tree.map(lambda x: x.get_value() if _is_variable(x) else x,
                      opt_state, is_leaf=_is_variable)


def find_states(opt_state, state_type=_STATE_TYPES) -> list[Any]:
  """All GRPO states of ``state_type`` inside ``opt_state``, in tree order."""
  opt_state = _unwrap(opt_state)
  return [x for x in jax.tree.leaves(
      opt_state, is_leaf=lambda x: isinstance(x, _STATE_TYPES))
          if isinstance(x, state_type)]


def _score_ratios(score) -> list[tuple[int, jax.Array]]:
  """Per leaf: (size, strided sample of S / mean(S)), the mean from the sample."""
  out = []
  for s in jax.tree.leaves(score):
    if s.size:
      smp = _common.strided_sample(s).astype(jnp.float32)
      out.append((s.size, smp / (jnp.mean(smp) + 1e-12)))
  return out


def _weight_sample(state: ScaleByImportanceState) -> jax.Array:
  """Up to 1,024 normalised importance scores per leaf (strided), for histograms."""
  parts = [_common.strided_sample(s).astype(jnp.float32) / (
      _common.mean32(s) + 1e-12) for s in jax.tree.leaves(state.score) if s.size]
  return jnp.concatenate(parts) if parts else jnp.zeros((0,), jnp.float32)


def _size_weighted(pairs, fn) -> jax.Array:
  total = sum(n for n, _ in pairs)
  return sum((n * jnp.mean(fn(x)) for n, x in pairs),
             jnp.zeros((), jnp.float32)) / max(total, 1)


def _grpo_metrics(state: GrpoState) -> dict[str, jax.Array]:
  """Metrics of the one-pass preset, under the chain stages' keys."""
  st = state.stats
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  out = {}
  if st.clipped is not None:
    out.update({"clip/clip_rate": f32(st.clipped) / jnp.maximum(
        f32(state.count), 1.0), "clip/clipped_steps": st.clipped,
                "clip/grad_norm": st.grad_norm})
  if state.score is not None:
    # Computed here, not in the update: S / mean(S) (bias corrections cancel)
    # on strided samples, clipped to the weight range.
    pairs = _score_ratios(state.score)
    lo, hi = st.weight_bounds[0], st.weight_bounds[1]
    w_mean = _size_weighted(pairs, lambda r: jnp.clip(r, lo, hi))
    w_sq = _size_weighted(pairs, lambda r: jnp.clip(r, lo, hi) ** 2)
    r_mean = _size_weighted(pairs, lambda r: r)
    r_sq = _size_weighted(pairs, lambda r: r * r)
    out.update({
        "importance/weight_mean": jnp.where(state.count > 0, w_mean, 1.0),
        "importance/weight_std": jnp.sqrt(jnp.maximum(w_sq - w_mean ** 2, 0.)),
        "importance/score_std": jnp.sqrt(jnp.maximum(r_sq - r_mean ** 2, 0.)),
        "importance/weights": (jnp.concatenate([r for _, r in pairs]) if pairs
                               else jnp.zeros((0,), jnp.float32))})
  if state.thresholds is not None:
    prefix = "threshold" if state.tau is not None else "topk"
    out[f"{prefix}/kept_fraction"] = fused.kept_fraction(state)
    res = fused.residual(state)
    if res is not None:
      out[f"{prefix}/residual_norm"] = jnp.sqrt(sum(
          (jnp.sum(F.abs_sq(x).astype(jnp.float32))
           for x in jax.tree.leaves(res)), jnp.zeros((), jnp.float32)))
    if st.tau_mean is not None:
      out["threshold/tau_mean"] = st.tau_mean
  if st.variance is not None:
    out.update({"variance_lr/variance": st.variance,
                "variance_lr/lr_scale": st.lr_scale})
  if state.freeze is not None:
    out.update({f"freeze/{k}": v
                for k, v in _stage_metrics(state.freeze).items()})
  return out


def _stage_metrics(state) -> dict[str, jax.Array]:
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  if isinstance(state, GrpoState):
    return _grpo_metrics(state)
  if isinstance(state, ClipWithL2State):
    return {"clip_rate": f32(state.clipped) / jnp.maximum(f32(state.count), 1.0),
            "clipped_steps": state.clipped, "grad_norm": state.last_norm}
  if isinstance(state, ScaleByImportanceState):
    return {"weight_mean": state.weight_mean, "weight_std": state.weight_std,
            "score_std": state.score_std,
            "weights": _weight_sample(state)}
  if isinstance(state, (TopKMaskState, EmaThresholdMaskState)):
    out = {"kept_fraction": state.kept_fraction}
    if state.residual is not None:
      leaves = jax.tree.leaves(state.residual)
      out["residual_norm"] = jnp.sqrt(sum(
          (jnp.sum(F.abs_sq(x).astype(jnp.float32)) for x in leaves),
          jnp.zeros((), jnp.float32)))
    if isinstance(state, EmaThresholdMaskState):
      out["tau_mean"] = (jnp.mean(state.tau) if state.tau.size
                         else jnp.zeros((), jnp.float32))
    return out
  if isinstance(state, ScaleByVarianceLrState):
    return {"variance": state.variance, "lr_scale": state.lr_scale}
  if isinstance(state, FreezeBelowState):
    frozen = jax.tree.leaves(state.frozen)
    n = len(frozen)
    k = sum((f.astype(jnp.int32) for f in frozen), jnp.zeros((), jnp.int32))
    return {"frozen_leaves": k,
            "frozen_fraction": f32(k) / max(n, 1),
            "importance": jnp.stack([f32(i) for i in jax.tree.leaves(
                state.importance)]) if n else jnp.zeros((0,), jnp.float32)}
  return {}


def metrics(opt_state) -> dict[str, jax.Array]:
  """Diagnostics of every GRPO stage found in ``opt_state``.

  Keys are ``"<stage>/<name>"`` (``"clip/clip_rate"``, ``"importance/weight_std"``,
  ``"topk/kept_fraction"``, ``"threshold/tau_mean"``, ``"variance_lr/lr_scale"``,
  ``"freeze/frozen_leaves"``, ...), with ``"<stage>_<i>/..."`` when a stage
  occurs more than once. Scalars, except ``importance/weights`` (a strided
  sample of the current normalised importance scores, for histograms) and
  ``freeze/importance`` (per-leaf importance). Works inside ``jax.jit``.

  Args:
    opt_state: any optimizer state containing GRPO states.

  Returns:
    A flat ``dict[str, jax.Array]``.
  """
  states = find_states(opt_state)
  seen: dict[str, int] = {}
  for s in states:
    seen[_PREFIX[type(s)]] = seen.get(_PREFIX[type(s)], 0) + 1
  counter: dict[str, int] = {}
  out = {}
  for s in states:
    prefix = _PREFIX[type(s)]
    if seen[prefix] > 1:
      prefix = f"{prefix}_{counter.get(prefix, 0)}"
      counter[_PREFIX[type(s)]] = counter.get(_PREFIX[type(s)], 0) + 1
    for k, v in _stage_metrics(s).items():
      # The one-pass preset reports under the chain stages' own prefixes.
      key = (f"{prefix}:{k}" if seen[_PREFIX[type(s)]] > 1 else k) if (
          isinstance(s, GrpoState)) else f"{prefix}/{k}"
      out[key] = v
  return out


def frozen_mask(opt_state) -> Any:
  """The boolean tree of frozen leaves from the ``freeze_below`` stage.

  Args:
    opt_state: an optimizer state containing exactly one
      :class:`~grpo_optax.FreezeBelowState` (possibly wrapped).

  Returns:
    A tree with the params' structure and boolean scalar leaves (``True`` =
    frozen), for ``grpo_optax.training.frozen_step``.

  Raises:
    ValueError: if the state has no or several ``freeze_below`` stages.
  """
  states = [s.freeze if isinstance(s, GrpoState) else s
            for s in find_states(opt_state, (FreezeBelowState, GrpoState))
            if not (isinstance(s, GrpoState) and s.freeze is None)]
  if len(states) != 1:
    raise ValueError(
        "frozen_mask: expected exactly one freeze_below stage in opt_state,"
        f" found {len(states)}")
  return states[0].frozen


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
  if not std_below > 0:
    raise ValueError(f"std_below must be in (0, inf); got {std_below!r}")
  states = [s for s in find_states(opt_state, (ScaleByImportanceState,
                                                GrpoState))
            if not (isinstance(s, GrpoState) and s.score is None)]
  if not states:
    raise ValueError("importance_converged: no scale_by_importance stage (or"
                     " grpo with importance) in opt_state")
  ok = jnp.asarray(True)
  for s in states:
    std = (s.score_std if isinstance(s, ScaleByImportanceState)
           else _grpo_metrics(s)["importance/score_std"])
    ok = ok & (s.count > 0) & (std < std_below)
  return ok
