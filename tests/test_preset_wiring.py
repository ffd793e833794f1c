"""grpo(**kw) is the chain of its stages, with every keyword at its stage.

The wiring table below is the specification (docs/design.md, "The data flow of one update"): which stage
each keyword of ``grpo`` configures, under which name, and the stage order.
``test_grpo_equals_the_explicit_chain`` builds that chain by hand for a grid
of non-default knobs and compares updates and whole states bit for bit.
``check_every_knob_changes_its_stage`` (run by ``tools/mutants.py``, too
slow for the suite) shows that the grid can see every keyword: reset to the
value its stage would take by default (as if ``grpo`` had not passed it on),
each one changes its stage's output or state on the inputs that stage
receives in the grid.
"""

from __future__ import annotations

import dataclasses
import inspect
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import grpo_optax

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The form of the preset under test. When grpo() gets its one-pass form, set
# this to dict(fused=False): the chain form must stay equal to the stages.
PRESET_FORM: dict = {"fused": False}

# Stage order of the chain (docs/design.md) and the factory of each stage.
STAGES = {
  "zclip": grpo_optax.zclip,
  "clip": grpo_optax.clip_with_l2,
  "importance": grpo_optax.scale_by_importance,
  "topk": grpo_optax.top_k_mask,
  "threshold": grpo_optax.ema_threshold_mask,
  "adaptive": grpo_optax.scale_by_nesterov_adam_rms,
  "variance": grpo_optax.scale_by_variance_lr,
  "decay": optax.add_decayed_weights,
  "lr": optax.scale_by_learning_rate,
  "freeze": grpo_optax.freeze_below,
}

# keyword of grpo -> [(stage, argument of the stage factory), ...], read from
# the library's one table (grpo_optax.presets.WIRING: mechanism -> its config
# field, which is the factory's argument of the same name), plus optax's
# stages that the table lists as switches.
_STAGE_OF = {"topk": "topk", "threshold": "threshold"}
WIRING = {
  knob.keyword: [(mechanism, field) for mechanism, field in knob.fields]
  for knob in grpo_optax.presets.WIRING
  if knob.fields
}
WIRING.update(
  {
    "learning_rate": [("lr", "learning_rate")],
    "weight_decay": [("decay", "weight_decay")],
    "weight_decay_mask": [("decay", "mask")],
  }
)
# Keywords that switch stages on and off (their effect is the chain's
# structure, compared exactly by the equality test).
SWITCHES = (
  "importance",
  "sparsify",
  "adaptive",
  "importance_placement",
  "zclip",
)

# The seed defaults (the articles): grpo(**ARTICLE_DEFAULTS) must use exactly
# these (grpo()'s own defaults were then chosen by measurement).
SEED_DEFAULTS = dict(
  learning_rate=1e-3,
  zclip=None,
  zclip_alpha=0.97,
  zclip_warmup_steps=25,
  max_norm=1.0,
  l2=None,
  weight_decay=None,
  weight_decay_mask=None,
  nu_dtype=None,
  importance=True,
  importance_order=2,
  importance_decay=0.9,
  min_weight=0.1,
  max_weight=10.0,
  sparsify="topk",
  fraction=0.3,
  topk_method="sampled",
  error_feedback=True,
  frequency_weight=None,
  min_size=0,
  sparsify_warmup_steps=0,
  alpha=0.7,
  every=100,
  threshold_scale=1.0,
  adaptive=True,
  b1=0.9,
  b2=0.999,
  eps=1e-8,
  eps_root=0.0,
  adam_weight=0.5,
  nesterov=True,
  filter_decay=None,
  mu_dtype=None,
  mu_format=None,
  nu_format=None,
  accumulator_format=None,
  variance_coef=0.1,
  variance_decay=0.99,
  variance_reduction="leaf",
  variance_normalize=False,
  variance_eps=1e-12,
  importance_placement="input",
  rms_bias_correction=False,
  freeze_threshold=None,
  freeze_decay=0.9,
  freeze_warmup_steps=100,
  seed=0,
)

# grpo()'s own defaults (the base of the explicit chains below).
DEFAULTS = {
  name: p.default
  for name, p in inspect.signature(grpo_optax.grpo).parameters.items()
  if name not in PRESET_FORM
}

# Every value differs from its default and from the other knobs of the
# same kind (decays, epsilons), so a knob passed to the wrong stage shows.
GRID = {
  "topk_sampled": dict(
    zclip=2.0,
    zclip_alpha=0.9,
    zclip_warmup_steps=2,
    importance=True,
    learning_rate=optax.linear_schedule(0.05, 0.01, 4),
    max_norm=0.5,
    l2=1e-3,
    importance_decay=0.8,
    min_weight=0.3,
    max_weight=2.5,
    fraction=0.4,
    frequency_weight=0.2,
    min_size=10,
    sparsify_warmup_steps=3,
    seed=7,
    b1=0.8,
    b2=0.95,
    eps=1e-3,
    eps_root=1e-4,
    adam_weight=0.3,
    nesterov=False,
    filter_decay=0.6,
    mu_format="int8",
    nu_format="uint8",
    accumulator_format="int8_sr",
    variance_coef=0.5,
    variance_decay=0.9,
    variance_reduction="element",
    variance_normalize=True,
    freeze_threshold=0.5,
    freeze_decay=0.6,
    freeze_warmup_steps=2,
    weight_decay=0.05,
    weight_decay_mask={"big": True, "mid": False, "small": True},
  ),
  "threshold": dict(
    learning_rate=0.02,
    max_norm=None,
    l2=1e-2,
    importance=True,
    importance_order=1,
    sparsify="threshold",
    alpha=0.4,
    every=2,
    threshold_scale=0.8,
    error_feedback=False,
    adam_weight=0.8,
    mu_dtype=jnp.bfloat16,
    nu_dtype=jnp.bfloat16,
    variance_coef=2.0,
    variance_reduction="global",
    variance_eps=1e-3,
    variance_normalize=True,  # variance_eps acts only when normalising
    importance_placement="output",
    rms_bias_correction=True,
  ),
  "exact_topk_only": dict(
    learning_rate=0.1,
    max_norm=None,
    importance=False,
    topk_method="exact",
    fraction=0.25,
    error_feedback=False,
    adaptive=False,
    variance_coef=None,
  ),
  "defaults": dict(),
  "article_defaults": dict(grpo_optax.ARTICLE_DEFAULTS),
}
STEPS = 5


def _stage_kwargs(kw: dict, stage: str) -> dict:
  out = {}
  for knob, targets in WIRING.items():
    for st, arg in targets:
      if st == stage:
        out[arg] = kw[knob]
  if stage == "clip" and out["max_norm"] is None:
    out["max_norm"] = float("inf")
  if stage == "zclip" and out["z_threshold"] is None:
    del out["z_threshold"]
  return out


def explicit_stages(
  **overrides,
) -> list[tuple[str, optax.GradientTransformation]]:
  """The stages of the preset chain, built from the wiring table."""
  kw = {**DEFAULTS, **overrides}
  on = {
    "zclip": kw["zclip"] is not None,
    "clip": kw["max_norm"] is not None or kw["l2"] is not None,
    "importance": kw["importance"],
    "topk": kw["sparsify"] == "topk",
    "threshold": kw["sparsify"] == "threshold",
    "adaptive": kw["adaptive"],
    "variance": kw["variance_coef"] is not None,
    "decay": kw["weight_decay"] is not None,
    "lr": True,
    "freeze": kw["freeze_threshold"] is not None,
  }
  order = list(STAGES)
  if kw["importance_placement"] == "output":  # after the adaptive step
    order.remove("importance")
    order.insert(order.index("adaptive") + 1, "importance")
  return [
    (name, STAGES[name](**_stage_kwargs(kw, name)))
    for name in order
    if on[name]
  ]


def _params():
  rng = np.random.default_rng(0)
  # "big" is sampled by the sampled top-k (2,304 > 1,024 entries); "small"
  # is below the grid's min_size and its tiny params get it frozen; "mid"
  # freezes under the grid's threshold 0.5, not under the default 0.3.
  return {
    "big": jnp.asarray(rng.normal(size=(48, 48)), jnp.float32),
    "mid": jnp.full((4, 5), 0.1, jnp.float32),
    "small": jnp.full((6,), 1e-3, jnp.float32),
  }


def _grads(i, params):
  rng = np.random.default_rng(100 + i)
  return {
    k: jnp.asarray(rng.normal(size=v.shape) * (1 + i), jnp.float32)
    for k, v in params.items()
  }


def _extra(params):
  """Extra args for the importance and variance stages."""
  rng = np.random.default_rng(1)
  return dict(
    hessian_diag={
      k: jnp.asarray(np.abs(rng.normal(size=v.shape)), v.dtype)
      for k, v in params.items()
    },
    head_entropy={
      "big": grpo_optax.per_head(jnp.linspace(0.5, 2.0, 48), axis=0, ndim=2),
      **{k: None for k in params if k != "big"},
    },
    grad_variance={
      k: jnp.asarray(np.abs(rng.normal(size=v.shape)), v.dtype)
      for k, v in params.items()
    },
  )


def _assert_trees_equal(a, b, what):
  assert jax.tree.structure(a) == jax.tree.structure(b), what
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert jnp.asarray(x).dtype == jnp.asarray(y).dtype, what
    np.testing.assert_array_equal(x, y, err_msg=what)


def test_article_defaults_are_the_seed_defaults():
  got = {**DEFAULTS, **grpo_optax.ARTICLE_DEFAULTS}
  want = SEED_DEFAULTS
  assert got == want
  # The measured defaults differ from the articles' in these keywords only.
  assert {k for k in DEFAULTS if DEFAULTS[k] != want[k]} == set(
    grpo_optax.ARTICLE_DEFAULTS
  )


def test_grid_covers_every_keyword():
  """Every keyword is wired in the table and set off its default in the grid."""
  names = set(inspect.signature(grpo_optax.grpo).parameters) - set(PRESET_FORM)
  assert names == set(WIRING) | set(SWITCHES)
  for knob in names:
    assert any(
      knob in kw
      and kw[knob] is not DEFAULTS[knob]
      and kw[knob] != DEFAULTS[knob]
      for kw in GRID.values()
    ), knob


@pytest.mark.parametrize("name", list(GRID))
def test_grpo_equals_the_explicit_chain(name):
  kw = GRID[name]
  params = _params()
  extra = _extra(params) if name == "topk_sampled" else {}
  tx = grpo_optax.grpo(**PRESET_FORM, **kw)
  chain = optax.chain(*[s for _, s in explicit_stages(**kw)])

  @jax.jit
  def both(g, s1, s2):  # one program: XLA shares the identical work
    return (
      tx.update(g, s1, params, **extra),
      chain.update(g, s2, params, **extra),
    )

  s1, s2 = tx.init(params), chain.init(params)
  names = [n for n, _ in explicit_stages(**kw)]
  _assert_trees_equal(_as_chain(s1, names), s2, "init")
  for i in range(STEPS):
    (u1, s1), (u2, s2) = both(_grads(i, params), s1, s2)
    _assert_trees_equal(u1, u2, f"updates at step {i}")
    _assert_trees_equal(_as_chain(s1, names), s2, f"state at step {i}")
  assert float(optax.tree.norm(u1)) > 0
  # Every mechanism that is off has no state.
  assert {f for f in s1._fields if getattr(s1, f) is not None} == {
    _FIELD[n] for n in names
  }


# GrpoState's field of each stage.
_FIELD = {
  "zclip": "zclip",
  "clip": "clip",
  "importance": "importance",
  "topk": "mask",
  "threshold": "mask",
  "adaptive": "adaptive",
  "variance": "variance",
  "decay": "decay",
  "lr": "schedule",
  "freeze": "freeze",
}


def _as_chain(state, names):
  """A GrpoState as the tuple of its stages' states, in the chain's order."""
  return tuple(getattr(state, _FIELD[n]) for n in names)


def _factory_default(stage: str, arg: str):
  return inspect.signature(STAGES[stage]).parameters[arg].default


def _run_stage(tx, inputs, params, extra):
  tx = optax.with_extra_args_support(tx)
  update = jax.jit(lambda g, s: tx.update(g, s, params, **extra))
  state = tx.init(params)
  outs = []
  for g in inputs:
    u, state = update(g, state)
    outs.append(u)
  return outs, state


def _differ(a, b) -> bool:
  if jax.tree.structure(a) != jax.tree.structure(b):
    return True
  return any(
    jnp.asarray(x).dtype != jnp.asarray(y).dtype
    or not np.array_equal(np.asarray(x, np.float64), np.asarray(y, np.float64))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )


def check_every_knob_changes_its_stage(name: str) -> list[str]:
  """Each knob, set to its stage factory's own default, changes the stage.

  Not a test (it compiles every stage about 40 times, about a minute on two
  cores): ``tools/mutants.py`` runs it for the "topk_sampled" and
  "threshold" entries, which between them cover every keyword (the third
  entry's exact top-k knobs ``fraction`` and ``topk_method`` are covered by
  the first). Each stage runs alone on the inputs it receives in the chain,
  with the grid's value and with the factory's default (what the stage gets
  if ``grpo`` does not pass the knob on). Every knob whose value differs
  from that default must change the stage's updates or state; then a
  keyword that ``grpo`` dropped or sent elsewhere breaks
  ``test_grpo_equals_the_explicit_chain``.

  Returns:
    The keywords checked.

  Raises:
    AssertionError: naming a knob that does not change its stage.
  """
  kw = {**DEFAULTS, **GRID[name]}
  params = _params()
  extra = _extra(params) if name == "topk_sampled" else {}
  stages = explicit_stages(**GRID[name])
  # The inputs of every stage, step by step, as the chain passes them on.
  inputs = {st: [] for st, _ in stages}
  references = {}
  states = [tx.init(params) for _, tx in stages]
  updates = [
    jax.jit(
      lambda g, s, tx=optax.with_extra_args_support(tx): tx.update(  # noqa: B008
        g, s, params, **extra
      )
    )
    for _, tx in stages
  ]
  outs = {st: [] for st, _ in stages}
  for i in range(STEPS):
    x = _grads(i, params)
    for j, (st, _) in enumerate(stages):
      inputs[st].append(x)
      x, states[j] = updates[j](x, states[j])
      outs[st].append(x)
  references = {st: (outs[st], states[j]) for j, (st, _) in enumerate(stages)}
  checked = set()
  for knob, targets in WIRING.items():
    for stage, arg in targets:
      if stage not in references:
        continue
      default = (
        DEFAULTS[knob] if stage == "lr" else _factory_default(stage, arg)
      )
      if default is kw[knob] or default == kw[knob]:
        continue
      changed = _run_stage(
        STAGES[stage](**{**_stage_kwargs(kw, stage), arg: default}),
        inputs[stage],
        params,
        extra,
      )
      assert _differ(references[stage], changed), (knob, stage)
      checked.add(knob)
  expected = {k for k in GRID[name] if k in WIRING}
  assert expected <= checked, expected - checked
  return sorted(checked)


def check_knob_sensitivity() -> list[str]:
  """Runs the check on the two grid entries; together they cover every knob."""
  checked = set()
  for entry in ("topk_sampled", "threshold"):
    checked |= set(check_every_knob_changes_its_stage(entry))
  assert checked == set(WIRING), set(WIRING) - checked
  return sorted(checked)


if __name__ == "__main__":
  print("knobs that change their stage:", " ".join(check_knob_sensitivity()))


def test_every_keyword_of_grpo_is_a_row_of_the_library_table():
  table = [k.keyword for k in grpo_optax.presets.WIRING]
  names = list(inspect.signature(grpo_optax.grpo).parameters)
  assert names == ["learning_rate", *table]
  assert len(set(table)) == len(table)
  mechanisms = grpo_optax.presets.MECHANISMS
  for knob in grpo_optax.presets.WIRING:
    for mechanism, field in knob.fields:
      assert field in {
        f.name for f in dataclasses.fields(mechanisms[mechanism])
      }


def test_a_keyword_removed_from_the_table_is_refused(monkeypatch):
  table = grpo_optax.presets.WIRING
  for i, knob in enumerate(table):
    monkeypatch.setattr(
      grpo_optax.presets, "WIRING", table[:i] + table[i + 1 :]
    )
    with pytest.raises(TypeError, match=repr(knob.keyword)):
      grpo_optax.grpo(1e-3, **{knob.keyword: knob.default})
  monkeypatch.setattr(grpo_optax.presets, "WIRING", table)
  grpo_optax.grpo(1e-3, **{k.keyword: k.default for k in table})


def test_the_docs_table_and_the_example_flags_read_the_table(monkeypatch):
  import sys  # pylint: disable=import-outside-toplevel

  sys.path.insert(0, str(ROOT / "docs" / "_ext"))
  import wiring_table  # pylint: disable=import-outside-toplevel

  from examples.common import optim  # pylint: disable=import-outside-toplevel

  table = grpo_optax.presets.WIRING
  rows = wiring_table.markdown_table().splitlines()[2:]
  assert [r.split("`")[1] for r in rows] == [k.keyword for k in table]
  assert (
    "`TopKMaskConfig.fraction`"
    in rows[[k.keyword for k in table].index("fraction")]
  )
  flags = set(optim.grpo_knobs())
  assert flags == {k.keyword for k in table} - {"weight_decay_mask"}
  # A row removed from the library's table leaves the docs and the flags.
  monkeypatch.setattr(grpo_optax.presets, "WIRING", table[1:])
  monkeypatch.setattr(grpo_optax, "WIRING", table[1:])
  assert f"`{table[0].keyword}`" not in wiring_table.markdown_table()
  assert table[0].keyword not in optim.grpo_knobs()


# Keywords whose WIRING row names a field in both masks' configs, with the
# settings under which each changes either mask and a value off its default.
SHARED_MASK_KNOBS = {
  "error_feedback": ({}, False),
  "min_size": ({}, 10**6),  # every leaf passes dense
  "accumulator_format": ({}, "bfloat16_sr"),
  # The threshold mask reads the seed only to round a lossy accumulator.
  "seed": ({"accumulator_format": "int8_sr"}, 3),
}


def test_shared_mask_knobs_are_the_rows_with_both_masks():
  both = {
    knob.keyword
    for knob in grpo_optax.presets.WIRING
    if {"topk", "threshold"} <= {m for m, _ in knob.fields}
  }
  assert both == set(SHARED_MASK_KNOBS)


@pytest.mark.parametrize("sparsify", ["topk", "threshold"])
@pytest.mark.parametrize("knob", sorted(SHARED_MASK_KNOBS))
def test_shared_mask_keywords_reach_both_masks(knob, sparsify):
  """Each keyword of both masks changes the mask it is given to.

  ``test_grpo_equals_the_explicit_chain`` builds its chain from the
  library's WIRING table, so it cannot see a row that lost one of its
  fields; ``test_one_algorithm.py`` tries each keyword on the top-k only.
  """
  base, value = SHARED_MASK_KNOBS[knob]
  params = _params()
  if knob == "seed":  # an 8-bit accumulator stores leaves under 4,096 exactly
    params["wide"] = jnp.asarray(
      np.random.default_rng(3).normal(size=(64, 64)), jnp.float32
    )

  def run(**kw):
    tx = grpo_optax.grpo(sparsify=sparsify, fused=False, **base, **kw)
    update = jax.jit(lambda g, s: tx.update(g, s, params))
    state = tx.init(params)
    for i in range(2):
      u, state = update(_grads(i, params), state)
    return u, state.mask

  assert _differ(run(), run(**{knob: value})), (knob, sparsify)
