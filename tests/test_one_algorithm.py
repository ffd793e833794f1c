"""One algorithm per name: grpo()'s fused core equals the chain of its rooms.

For a grid that sets every keyword of ``grpo()`` off its default, the default
form (the fused clip + mask + Adam core where the settings allow it) and
``fused=False`` (the chain of the same rooms) give the same updates over 20
steps, masks and random draws included, and the same room states. And every
keyword changes the update, or raises, in every form that accepts it.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import grpo_optax

SHAPES = {"w": (64, 48), "v": (3, 40, 16), "b": (8,), "s": ()}


def _params():
  rng = np.random.default_rng(0)
  return {
    k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in SHAPES.items()
  }


def _grads(t):
  rng = np.random.default_rng(100 + t)
  # Heavy-tailed and drifting in scale, so masks and thresholds move.
  return {
    k: jnp.asarray(rng.standard_t(3, size=s) * (1 + 0.1 * t), jnp.float32)
    for k, s in SHAPES.items()
  }


def _run_both(tx_a, tx_b, steps):
  """Each transform's updates over ``steps`` steps and its last state.

  Both step in one jitted program, each on its own params: one
  compilation, not two (XLA dedupes the kernels they share).
  """
  txs = (tx_a, tx_b)
  params = (_params(), _params())
  states = tuple(tx.init(p) for tx, p in zip(txs, params))

  @jax.jit
  def step(grads, states, params):
    out = []
    for tx, s, p in zip(txs, states, params):
      u, s = tx.update(grads, s, p)
      out.append((u, s, optax.apply_updates(p, u)))
    return tuple(out)

  outs = ([], [])
  for t in range(steps):
    out = step(_grads(t), states, params)
    states = tuple(s for _, s, _ in out)
    params = tuple(p for _, _, p in out)
    for form, (u, _, _) in zip(outs, out):
      form.append(u)
  return (outs[0], states[0]), (outs[1], states[1])


# Grids of settings the fused core honours; together they set every keyword
# of grpo() off its default (checked below).
GRID = {
  "topk": dict(
    learning_rate=optax.linear_schedule(0.05, 0.01, 10),
    zclip=1.5,
    zclip_alpha=0.8,
    zclip_warmup_steps=3,
    accumulator_format="int8_sr",
    max_norm=0.5,
    l2=1e-3,
    weight_decay=1e-2,
    weight_decay_mask={"w": True, "v": False, "b": True, "s": False},
    fraction=0.4,
    min_size=100,
    sparsify_warmup_steps=5,
    seed=7,
    b1=0.8,
    b2=0.95,
    eps=1e-3,
    eps_root=1e-4,
    adam_weight=0.3,
    nesterov=False,
    rms_bias_correction=True,
    mu_dtype=jnp.float32,
    nu_dtype=jnp.float32,
    variance_coef=0.5,
    variance_decay=0.9,
    variance_reduction="element",
    variance_normalize=True,
    variance_eps=1e-6,
    freeze_threshold=0.5,
    freeze_decay=0.6,
    freeze_warmup_steps=3,
  ),
  "threshold_importance_input": dict(
    learning_rate=0.02,
    max_norm=None,
    l2=1e-2,
    importance=True,
    importance_order=1,
    importance_decay=0.8,
    min_weight=0.3,
    max_weight=2.5,
    sparsify="threshold",
    alpha=0.4,
    every=3,
    threshold_scale=0.8,
    error_feedback=False,
    min_size=0,
    variance_coef=0.2,
    variance_reduction="global",
  ),
  "dense_importance_output": dict(
    sparsify=None,
    importance=True,
    importance_placement="output",
    max_norm=2.0,
    adam_weight=0.0,
    mu_format="int8",
    nu_format="uint8",
  ),
  "topk_article": dict(grpo_optax.ARTICLE_DEFAULTS, fraction=0.2),
  # All state in 8 bits: the fused core reads its blocks' bounds off the
  # gradient, the params (l2) and the new accumulator's codes; the chain
  # reduces the clipped and the masked gradients themselves.
  "topk_8bit": dict(
    max_norm=0.05,
    l2=1e-2,
    fraction=0.3,
    min_size=100,
    mu_format="int8",
    nu_format="uint8",
    accumulator_format="int8_sr",
  ),
  # The threshold mask without error feedback, 8-bit moments: the moments'
  # bound is the clipped gradient's, cut at the leaf's threshold.
  "threshold_int8_no_feedback": dict(
    sparsify="threshold",
    error_feedback=False,
    min_size=0,
    mu_format="int8",
    nu_format="uint8",
  ),
}


def _close(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(
      np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7
    )


def _mask_states(state):
  return grpo_optax.diagnostics.find_states(
    state, (grpo_optax.TopKMaskState, grpo_optax.EmaThresholdMaskState)
  )


@pytest.mark.parametrize("name", sorted(GRID))
def test_fused_core_equals_the_chain_of_its_rooms(name):
  kw = GRID[name]
  fused_tx = grpo_optax.grpo(**kw)
  chain_tx = grpo_optax.grpo(**kw, fused=False)
  (u_f, s_f), (u_c, s_c) = _run_both(fused_tx, chain_tx, 20)
  # The default form really is the fused core; the chain really is not.
  assert any(s.startswith("fused") for s in grpo_optax.presets.describe(**kw))
  assert not any(
    s.startswith("fused")
    for s in grpo_optax.presets.describe(**kw, fused=False)
  )
  # One state layout for both forms.
  assert jax.tree.structure(s_f) == jax.tree.structure(s_c)
  for t, (a, b) in enumerate(zip(u_f, u_c)):
    try:
      _close(a, b)
    except AssertionError as e:
      raise AssertionError(f"step {t}: {e}") from None
  # Same room states: thresholds, accumulators, Adam's moments.
  for a, b in zip(_mask_states(s_f), _mask_states(s_c)):
    _close(a, b)
  m_f, m_c = grpo_optax.metrics(s_f), grpo_optax.metrics(s_c)
  assert set(m_f) == set(m_c)
  _close(m_f, m_c)


def test_the_grid_sets_every_keyword_off_its_default():
  defaults = {
    n: p.default
    for n, p in inspect.signature(grpo_optax.grpo).parameters.items()
  }
  changed = {
    k
    for kw in GRID.values()
    for k, v in kw.items()
    if v is not defaults[k]
    and not (
      isinstance(v, (int, float, str, bool, type(None))) and v == defaults[k]
    )
  }
  # Keywords whose other values the fused core refuses (tested below).
  chain_only = {
    "topk_method",
    "frequency_weight",
    "filter_decay",
    "adaptive",
    "fused",
  }
  assert set(defaults) - changed - chain_only == set()


@pytest.mark.parametrize(
  "kw",
  [
    dict(topk_method="exact"),
    dict(frequency_weight=0.2),
    dict(filter_decay=0.5),
    dict(adaptive=False),
  ],
)
def test_fused_true_refuses_what_it_cannot_honour(kw):
  with pytest.raises(ValueError, match=list(kw)[0]):
    grpo_optax.grpo(**kw, fused=True)
  # The default picks the chain for these settings, which honours them.
  assert not any(
    s.startswith("fused") for s in grpo_optax.presets.describe(**kw)
  )


# keyword -> (base settings under which it acts, another value).
KNOBS = {
  "learning_rate": ({}, 0.05),
  "max_norm": ({}, 0.3),
  "l2": ({}, 0.1),
  "weight_decay": ({}, 0.5),
  "weight_decay_mask": (
    {"weight_decay": 0.5},
    {"w": False, "v": True, "b": True, "s": True},
  ),
  "importance": ({}, True),
  "importance_order": ({"importance": True}, 1),
  "importance_decay": ({"importance": True}, 0.5),
  "importance_placement": ({"importance": True}, "output"),
  "min_weight": ({"importance": True}, 0.9),
  "max_weight": ({"importance": True}, 1.1),
  "sparsify": ({}, "threshold"),
  "fraction": ({}, 0.1),
  "topk_method": ({}, "exact"),
  "error_feedback": ({}, False),
  "frequency_weight": ({}, 0.5),
  "min_size": ({}, 0),
  "sparsify_warmup_steps": ({}, 3),
  "alpha": ({"sparsify": "threshold", "every": 1}, 0.2),
  "every": ({"sparsify": "threshold", "alpha": 0.5}, 1),
  "threshold_scale": ({"sparsify": "threshold"}, 1.5),
  "adaptive": ({}, False),
  "b1": ({}, 0.5),
  "b2": ({}, 0.9),
  "eps": ({}, 1.0),
  "eps_root": ({}, 1.0),
  "adam_weight": ({}, 0.3),
  "nesterov": ({}, False),
  "rms_bias_correction": ({"adam_weight": 0.5}, True),
  "filter_decay": ({}, 0.5),
  "mu_dtype": ({}, jnp.bfloat16),
  "nu_dtype": ({}, jnp.bfloat16),
  # The test's leaves are under the 8-bit formats' min_size (stored in
  # float32 by default), so the 8-bit codec is asked for explicitly.
  "mu_format": ({}, grpo_optax.quantization.state_format("int8", min_size=0)),
  "nu_format": ({}, grpo_optax.quantization.state_format("uint8", min_size=0)),
  "variance_coef": ({}, 0.5),
  "variance_decay": ({"variance_coef": 100.0}, 0.5),
  "variance_reduction": ({"variance_coef": 100.0}, "element"),
  "variance_normalize": ({"variance_coef": 100.0}, True),
  "variance_eps": ({"variance_coef": 100.0, "variance_normalize": True}, 10.0),
  "freeze_threshold": ({"freeze_warmup_steps": 0}, 0.9),
  "freeze_decay": ({"freeze_threshold": 0.9, "freeze_warmup_steps": 1}, 0.0),
  "freeze_warmup_steps": ({"freeze_threshold": 0.9}, 0),
  "seed": ({"min_size": 0}, 3),
  # bf16: "int8_sr" stores these small leaves exactly (min_size).
  "accumulator_format": ({}, "bfloat16_sr"),
  "zclip": ({"zclip_warmup_steps": 1}, 0.5),
  # Two warm-up steps give the statistics a spread; a tiny threshold clips
  # the next norms to a bound the EMA weight moves.
  "zclip_alpha": ({"zclip": 0.01, "zclip_warmup_steps": 2}, 0.2),
  "zclip_warmup_steps": ({"zclip": 0.5}, 1),
}


def test_knob_table_covers_every_keyword():
  names = set(inspect.signature(grpo_optax.grpo).parameters) - {"fused"}
  assert set(KNOBS) == names


@pytest.mark.slow
@pytest.mark.parametrize("fused", [None, False])
@pytest.mark.parametrize("name", sorted(KNOBS))
def test_every_keyword_changes_the_update(name, fused):
  base, value = KNOBS[name]
  steps = 4
  (u0, _), (u1, _) = _run_both(
    grpo_optax.grpo(**base, fused=fused),
    grpo_optax.grpo(**{**base, name: value}, fused=fused),
    steps,
  )
  diff = max(
    float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
    for x, y in zip(u0, u1)
    for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y))
  )
  assert diff > 0, f"{name}={value!r} did not change the update"
