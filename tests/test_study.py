"""The study's benchmark-local variants against the library, and the
transformers phase's decision rule on synthetic results (fast); the phase's
smoke test (slow).
"""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import grpo_optax
from benchmarks import study
from benchmarks import study_transformers as st


def _grads(step):
  k = jax.random.fold_in(jax.random.key(0), step)
  k1, k2 = jax.random.split(k)
  return {"a": jax.random.normal(k1, (6, 5)), "b": jax.random.normal(k2, (7,))}


def _run(tx, steps=4):
  params = {
    "a": jnp.linspace(-1.0, 1.0, 30).reshape(6, 5),
    "b": jnp.linspace(0.5, 2.0, 7),
  }

  def step(carry, g):
    params, state = carry
    updates, state = tx.update(g, state, params)
    return (optax.apply_updates(params, updates), state), updates

  grads = jax.tree.map(
    lambda *x: jnp.stack(x), *[_grads(t) for t in range(steps)]
  )
  _, outs = jax.jit(lambda p: jax.lax.scan(step, (p, tx.init(p)), grads))(
    params
  )
  return [jax.tree.map(lambda x, t=t: x[t], outs) for t in range(steps)]


@pytest.mark.parametrize(
  "changes",
  [
    {},
    {"max_norm": None, "sparsify": "threshold"},
    {
      "importance": False,
      "variance_reduction": "element",
      "nesterov": False,
      "adam_weight": 1.0,
    },
  ],
)
def test_chain_equals_grpo_where_expressible(changes):
  config = dataclasses.replace(study.TODAY, **changes)
  got = _run(study.chain(config, 1e-2))
  want = _run(grpo_optax.grpo(1e-2, **config.grpo_kwargs()))
  for g, w in zip(got, want):
    for k in g:
      np.testing.assert_allclose(g[k], w[k], rtol=1e-6, atol=1e-8)


def test_today_is_the_articles_preset():
  # TODAY is the preset the study started from: the articles' settings in
  # the chain form, every leaf masked.
  got = _run(study.build(study.TODAY)(1e-2))
  want = _run(grpo_optax.grpo(1e-2, **grpo_optax.ARTICLE_DEFAULTS, fused=False))
  for g, w in zip(got, want):
    for k in g:
      np.testing.assert_array_equal(g[k], w[k])


def test_library_defaults_are_the_study_winner():
  # grpo()'s defaults are the study's choices; only the form (fused=None:
  # the fused core wherever the settings allow it) and min_size (leaves
  # under 1,024 entries dense) differ, both measured by the convergence
  # suite.
  import inspect  # pylint: disable=g-import-not-at-top

  defaults = {
    n: p.default
    for n, p in inspect.signature(grpo_optax.grpo).parameters.items()
  }
  for key, value in study.WINNER.grpo_kwargs().items():
    if key in ("min_size", "fused", "fraction"):
      continue
    assert defaults[key] == value, key
  assert defaults["min_size"] == 1024 and defaults["fused"] is None
  # The transformer phase (benchmarks/study_transformers.py) chose the kept
  # fraction: its decision is in benchmarks/results/defaults_transformers.json.
  results = os.path.join(
    os.path.dirname(__file__), "..", "benchmarks", "results"
  )
  with open(os.path.join(results, "defaults_transformers.json")) as f:
    decision = json.load(f)["decision"]
  assert decision["grpo_kwargs"] == {"fraction": defaults["fraction"]}
  # The articles' settings are exactly what the study switched off.
  article = study.TODAY.grpo_kwargs()
  for key, value in grpo_optax.ARTICLE_DEFAULTS.items():
    assert article[key] == value, key


def test_corrected_rms_matches_numpy():
  w, b1, b2, eps = 0.5, 0.9, 0.999, 1e-8
  tx = study.scale_by_nesterov_adam_rms_corrected(
    adam_weight=w, b1=b1, b2=b2, eps=eps
  )
  nadam = optax.scale_by_adam(b1=b1, b2=b2, eps=eps, nesterov=True)
  params = {"a": jnp.zeros((6, 5)), "b": jnp.zeros(7)}
  s, s_ref = tx.init(params), nadam.init(params)
  nu = {k: np.zeros(v.shape) for k, v in params.items()}
  for t in range(1, 5):
    g = _grads(t)
    out, s = tx.update(g, s, params)
    a, s_ref = nadam.update(g, s_ref, params)
    for k in g:
      gk = np.asarray(g[k], np.float64)
      nu[k] = b2 * nu[k] + (1 - b2) * gk**2
      rms = gk / (np.sqrt(nu[k] / (1 - b2**t)) + eps)
      np.testing.assert_allclose(
        out[k], w * np.asarray(a[k]) + (1 - w) * rms, rtol=2e-5, atol=1e-6
      )
  # The first step's RMSProp part is Adam-sized (|g|/|g| = 1), not up to
  # 1/sqrt(1-b2) ~ 32x larger as in the library's uncorrected mix.
  first, _ = tx.update(_grads(0), tx.init(params), params)
  a0, _ = nadam.update(_grads(0), nadam.init(params), params)
  np.testing.assert_allclose(
    first["a"], w * a0["a"] + (1 - w) * jnp.sign(_grads(0)["a"]), rtol=1e-5
  )
  lib = grpo_optax.scale_by_nesterov_adam_rms(adam_weight=w)
  uncorrected, _ = lib.update(_grads(0), lib.init(params), params)
  assert float(jnp.min(jnp.abs(uncorrected["a"]))) > 10.0


def test_importance_after_with_identity_is_scale_by_importance():
  after = study.importance_after(
    optax.identity(), min_weight=0.5, max_weight=2.0
  )
  before = grpo_optax.scale_by_importance(min_weight=0.5, max_weight=2.0)
  for g, w in zip(_run(after), _run(before)):
    for k in g:
      np.testing.assert_allclose(g[k], w[k], rtol=1e-6, atol=1e-8)


def test_normalized_drops_fields_without_effect():
  c = dataclasses.replace(
    study.TODAY, importance=False, importance_where="after_raw", min_weight=0.5
  )
  assert c.normalized() == dataclasses.replace(study.TODAY, importance=False)
  assert dataclasses.replace(
    study.TODAY, adam_weight=1.0, rms_bias_correction=True
  ).normalized().changes() == {"adam_weight": 1.0}


# ------------------------------------------- the transformers phase's rule


def _cand(geomean, state, step):
  return {
    "geomean": geomean,
    "state_bytes_per_param": state,
    "step_ratio": step,
  }


def test_summarise_divides_by_the_best_baseline_per_task():
  scores = {
    "adam": {"a": 2.0, "b": 1.0},
    "nadam": {"a": 1.0, "b": 2.0},
    "adamw": {"a": None, "b": 4.0},  # diverged on a: ignored there
    "x": {"a": 0.5, "b": 1.0},
    "y": {"a": None, "b": 0.5},
  }
  s = st.summarise(scores)
  assert s["x"]["ratios"] == {"a": 0.5, "b": 1.0}
  assert np.isclose(s["x"]["geomean"], np.sqrt(0.5))
  assert s["x"]["max"] == 1.0 and s["x"]["worst_task"] == "b"
  assert s["adam"]["ratios"] == {"a": 2.0, "b": 1.0}
  # A task without a score leaves no geometric mean (not a partial one).
  assert s["y"]["ratios"] == {"a": None, "b": 0.5}
  assert s["y"]["geomean"] is None and s["y"]["max"] is None


def test_choose_takes_the_best_geomean_outside_the_tie():
  got = st.choose(
    {"mask": _cand(0.950, 12.0, 2.0), "dense": _cand(0.9549, 8.0, 1.3)}
  )
  # 0.9549 / 0.950 = 1.0052: not within 0.5%, so cost does not decide.
  assert got["name"] == "mask" and got["tied"] == ["mask"]
  assert got["best_geomean"] == 0.950


def test_choose_breaks_a_tie_by_state_bytes_then_step_time():
  got = st.choose(
    {
      "a": _cand(0.950, 12.0, 1.2),
      "b": _cand(0.954, 8.0, 1.9),
      "c": _cand(0.9545, 8.0, 1.4),  # 1.0047 x the best: tied
      "d": _cand(0.9548, 4.0, 1.0),  # 1.0051 x the best: not tied
    }
  )
  assert got["name"] == "c"
  assert got["tied"] == ["c", "b", "a"]  # by cost, the winner first
  assert got["eligible"] == ["a", "b", "c", "d"]


def test_choose_compares_state_bytes_to_a_tenth_of_a_byte():
  # 8.04 and 8.00 bytes per parameter are the same two param-sized arrays
  # (plus scalars): the step time decides.
  got = st.choose({"a": _cand(1.0, 8.04, 1.2), "b": _cand(1.0, 8.00, 1.3)})
  assert got["name"] == "a"
  got = st.choose({"a": _cand(1.0, 8.06, 1.2), "b": _cand(1.0, 8.00, 1.3)})
  assert got["name"] == "b"


def test_choose_excludes_candidates_without_a_score_on_every_task():
  got = st.choose(
    {"diverged": _cand(None, 4.0, 0.5), "ok": _cand(1.2, 12.0, 2.0)}
  )
  assert got["name"] == "ok" and got["eligible"] == ["ok"]
  with pytest.raises(ValueError, match="every task"):
    st.choose({"diverged": _cand(None, 4.0, 0.5)})


def _fake_report(scores, costs):
  runs = {
    opt: {
      t: {"best": {"mean": v}, "interior": True, "best_lr": 1e-3}
      for t, v in per.items()
    }
    for opt, per in scores.items()
  }
  tasks = {t: {} for t in next(iter(scores.values()))}
  return {"runs": runs, "costs": costs, "tasks": tasks}


def test_analyse_applies_the_rule_to_measured_runs():
  base = {"t1": 2.0, "t2": 1.0}
  scores = {
    "adam": base,
    "nadam": base,
    "adamw": base,
    "dense": {"t1": 1.8, "t2": 1.0},
    "topk_0.3": {"t1": 1.79, "t2": 1.0},  # 0.28% better: tied
    "topk_0.1": {"t1": 3.0, "t2": 1.0},
  }
  costs = {
    "dense": {"state_bytes_per_param": 8.0, "step_ratio": 1.3},
    "topk_0.3": {"state_bytes_per_param": 12.0, "step_ratio": 1.8},
    "topk_0.1": {"state_bytes_per_param": 12.0, "step_ratio": 1.8},
  }
  report = _fake_report(scores, costs)
  st.analyse(report, ["dense", "topk_0.3", "topk_0.1"])
  d = report["decision"]
  assert d["name"] == "dense" and d["tied"] == ["dense", "topk_0.3"]
  assert d["grpo_kwargs"] == {"sparsify": None} and d["changes_defaults"]
  assert np.isclose(report["summary"]["dense"]["geomean"], np.sqrt(0.9))
  # Without the dense candidate today's defaults win and stay.
  report = _fake_report(scores, costs)
  st.analyse(report, ["topk_0.3", "topk_0.1"])
  assert report["decision"]["name"] == "topk_0.3"
  assert not report["decision"]["changes_defaults"]
  assert "stay" in "\n".join(st.decision_text(report))


def test_candidates_are_distinct_grpo_configurations():
  assert st.CANDIDATES["topk_0.3"][0] == {}  # today's defaults
  seen = set()
  params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros(32)}
  for name, (kwargs, _) in st.CANDIDATES.items():
    key = tuple(sorted(kwargs.items()))
    assert key not in seen, name
    seen.add(key)
    jax.eval_shape(grpo_optax.grpo(1e-3, **kwargs).init, params)
  assert not set(st.CANDIDATES) & set(st.BASELINES)


def test_state_bytes_counts_every_state_array():
  params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros(32)}
  n = 64 * 32 + 32
  # Adam: mu and nu (4 bytes each) and an int32 count.
  assert st.state_bytes(optax.adam(1e-3), params) == 8 * n + 4
  dense = st.state_bytes(grpo_optax.grpo(1e-3, sparsify=None), params)
  masked = st.state_bytes(grpo_optax.grpo(1e-3, min_size=0), params)
  # The mask's error-feedback buffer: one more param-sized array (and the
  # sampled top-k's key and counters).
  assert 8 * n <= dense < 8 * n + 64
  assert masked >= dense + 4 * n


@pytest.mark.slow
def test_transformers_phase_writes_results_and_resumes(tmp_path, monkeypatch):
  import json  # pylint: disable=g-import-not-at-top

  from benchmarks import transformer_tasks  # pylint: disable=g-import-not-at-top

  tiny = lambda: transformer_tasks.gpt(
    1, width=16, heads=2, mlp=32, context=8, batch_size=4, max_eval=8
  )
  monkeypatch.setitem(st.TASKS, "gpt_tiny", tiny)
  out = tmp_path / "results"
  argv = [
    "--phase",
    "transformers",
    "--tasks",
    "gpt_tiny,linreg",
    "--candidates",
    "dense,topk_0.3",
    "--steps",
    "3",
    "--seeds",
    "1",
    "--cost-blocks",
    "1",
    "--cost-width",
    "16",
    "--cost-vocab",
    "32",
    "--cost-rounds",
    "1",
    "--cost-iters",
    "1",
    "--out",
    str(out),
  ]
  report = study.main(argv)
  data = json.loads((out / "defaults_transformers.json").read_text())
  assert data["meta"]["command"].startswith(
    "python -m benchmarks.study --phase transformers --tasks gpt_tiny"
  )
  assert data["meta"]["command"].endswith("--out results")
  opts = ["adam", "nadam", "adamw", "dense", "topk_0.3"]
  assert list(data["summary"]) == opts
  assert data["tasks"]["gpt_tiny"]["metric"] == "held-out loss"
  assert data["tasks"]["linreg"]["metric"] == "training loss"
  assert data["tasks"]["linreg"]["lrs"] == list(st.SUITE_LRS["linreg"])
  for opt in opts:
    gpt = data["runs"][opt]["gpt_tiny"]
    assert gpt["metric"] == "heldout/loss" and len(gpt["lrs"]) == 4
    # The score is the held-out loss after the last step at the best lr.
    assert gpt["best"]["mean"] == min(
      s["mean"] for s in gpt["final_by_lr"] if s["mean"] is not None
    )
    assert np.isclose(
      gpt["best"]["mean"], gpt["heldout"]["loss"]["final"]["mean"]
    )
    assert data["runs"][opt]["linreg"]["metric"] == "train"
  costs = data["costs"]
  assert costs["adam"]["state_bytes_per_param"] == pytest.approx(8.0, 1e-2)
  assert costs["topk_0.3"]["state_bytes_per_param"] > 11.5
  assert all(
    c["step_ratio"] > 0 and c["compile_ratio"] > 0 for c in costs.values()
  )
  assert report["decision"]["name"] in ("dense", "topk_0.3")
  md = (out / "defaults_transformers.md").read_text()
  assert "## Decision" in md and "| **geomean** |" in md
  png = (out / "defaults_transformers.png").read_bytes()
  assert png[:8] == b"\x89PNG\r\n\x1a\n"

  # --resume measures nothing again when the settings match.
  def refuse(*args, **kwargs):
    raise AssertionError("ran again")

  monkeypatch.setattr(st.convergence, "sweep_task", refuse)
  monkeypatch.setattr(
    st, "measure_costs", lambda makers, *a, **k: {} if not makers else refuse()
  )
  again = study.main(argv + ["--resume"])
  assert again["runs"] == report["runs"]
  assert again["decision"] == report["decision"]
