"""The fused clip + mask + Adam core: optax limits, invariants, state size.

That the core computes the same updates as the chain of its rooms is
``tests/test_one_algorithm.py``; the rooms have NumPy references of their
own (``tests/test_sparsify.py``, ``tests/test_clipping.py``,
``tests/test_momentum.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import grpo_optax
from grpo_optax.diagnostics import find_states

STEPS = 20


def _params():
  rng = np.random.default_rng(0)
  return {
    "big": jnp.asarray(rng.normal(size=(48, 50)), jnp.float32),
    "mid": jnp.asarray(rng.normal(size=(6, 7)) * 0.5, jnp.float32),
    "vec": jnp.asarray(rng.normal(size=(5,)) * 0.1, jnp.float32),
  }


def _grads(t, params):
  rng = np.random.default_rng(1000 + t)
  return {
    k: jnp.asarray(
      rng.standard_t(3, size=v.shape) * (1 + 0.05 * t), jnp.float32
    )
    for k, v in params.items()
  }


def _adam_state(state):
  return find_states(state, grpo_optax.ScaleByNesterovAdamRmsState)[0]


def _mask_state(state):
  return find_states(
    state, (grpo_optax.TopKMaskState, grpo_optax.EmaThresholdMaskState)
  )[0]


def test_the_default_is_the_fused_core():
  assert grpo_optax.presets.describe()[0] == "fused(clip, mask, adaptive)"
  # One state layout for both forms.
  fused = grpo_optax.grpo().init(_params())
  chain = grpo_optax.grpo(fused=False).init(_params())
  assert jax.tree.structure(fused) == jax.tree.structure(chain)


@pytest.mark.parametrize(
  "nesterov,optimizer", [(False, optax.adam), (True, optax.nadam)]
)
def test_adam_and_nadam_limits(nesterov, optimizer):
  """Importance, masks, variance and clipping off: exactly Adam / NAdam."""
  params = _params()
  tx = grpo_optax.grpo(
    1e-2,
    max_norm=None,
    importance=False,
    sparsify=None,
    variance_coef=None,
    adam_weight=1.0,
    nesterov=nesterov,
  )
  ref = optimizer(1e-2)
  s, s_ref = tx.init(params), ref.init(params)
  for t in range(STEPS):
    g = _grads(t, params)
    u, s = tx.update(g, s, params)
    u_ref, s_ref = ref.update(g, s_ref, params)
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(
        a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max()
      ),
      u,
      u_ref,
    )
    params = optax.apply_updates(params, u)


def test_rmsprop_limit():
  params = _params()
  tx = grpo_optax.grpo(
    1e-2,
    max_norm=None,
    importance=False,
    sparsify=None,
    variance_coef=None,
    adam_weight=0.0,
  )
  ref = optax.chain(
    optax.scale_by_rms(decay=0.999, eps=1e-8, eps_in_sqrt=False),
    optax.scale(-1e-2),
  )
  s, s_ref = tx.init(params), ref.init(params)
  for t in range(5):
    g = _grads(t, params)
    u, s = tx.update(g, s, params)
    u_ref, s_ref = ref.update(g, s_ref, params)
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), u, u_ref
    )


@pytest.mark.parametrize("sparsify", ["topk", "threshold"])
def test_error_feedback_loses_nothing(sparsify):
  """With b1 = 0 Adam's first moment is the masked gradient itself, so the
  masked gradients of all steps plus the final residual must add up to the
  sum of the gradients.
  """
  params = _params()
  tx = grpo_optax.grpo(
    1e-3,
    max_norm=None,
    importance=False,
    sparsify=sparsify,
    every=2,
    b1=0.0,
    variance_coef=None,
    min_size=0,
  )
  state = tx.init(params)
  update = jax.jit(tx.update)
  sent = jax.tree.map(jnp.zeros_like, params)
  total = jax.tree.map(jnp.zeros_like, params)
  kept = []
  for t in range(STEPS):
    g = _grads(t, params)
    _, state = update(g, state, params)
    mu = _adam_state(state).mu
    sent = jax.tree.map(jnp.add, sent, mu)
    total = jax.tree.map(jnp.add, total, g)
    mask = _mask_state(state)
    kept.append(
      float(
        grpo_optax.sparsify.exact_kept_fraction(
          mask.accumulator, mask.thresholds
        )
      )
    )
    # b1 = 0: mu is this step's masked gradient, so the exact kept fraction
    # read from the accumulator equals the fraction of non-zero entries.
    nonzero = sum(int(jnp.sum(m != 0)) for m in jax.tree.leaves(mu))
    np.testing.assert_allclose(
      kept[-1],
      nonzero / sum(p.size for p in jax.tree.leaves(params)),
      rtol=1e-6,
    )
  residual = _mask_state(state).residual
  for k in params:
    np.testing.assert_allclose(
      sent[k] + residual[k], total[k], rtol=1e-5, atol=1e-5
    )
  assert max(kept) < 0.95  # the mask really dropped entries
  assert float(optax.tree.norm(residual)) > 0


@pytest.mark.parametrize(
  "kw,expected",
  [
    (dict(sparsify=None), 2),  # mu, nu
    (dict(sparsify="topk"), 3),  # + the accumulator
    (dict(sparsify="threshold"), 3),
    (dict(sparsify="topk", error_feedback=False), 2),
    (dict(sparsify="topk", importance=True), 5),  # + S and its Fisher EMA
    (dict(sparsify="topk", variance_coef=0.1), 5),  # + the rate's two EMAs
    (dict(sparsify="threshold", freeze_threshold=0.3), 3),  # scalars only
  ],
)
def test_state_holds_no_other_parameter_sized_array(kw, expected):
  params = {"w": jnp.ones((64, 32)), "b": jnp.ones((32,))}
  state = grpo_optax.grpo(**kw, min_size=0).init(params)
  sizes = [x.size for x in jax.tree.leaves(state)]
  assert sizes.count(64 * 32) == expected, sizes


def test_kept_fraction_of_the_sampled_top_k():
  params = {"w": jax.random.normal(jax.random.key(0), (400, 500))}
  kw = dict(importance=False, fraction=0.3, error_feedback=False)
  tx = grpo_optax.grpo(**kw)
  assert grpo_optax.presets.describe(**kw)[0] == "fused(clip, mask, adaptive)"
  state = tx.init(params)
  g = {"w": jax.random.normal(jax.random.key(1), (400, 500))}
  out, state = jax.jit(tx.update)(g, state, params)
  frac = float(jnp.mean(out["w"] != 0))
  # A 2,000-entry sample: the quantile's standard error is ~1% absolute.
  assert abs(frac - 0.3) < 0.04, frac
  assert (
    abs(float(grpo_optax.metrics(state)["topk/kept_fraction"]) - frac) < 0.05
  )


def test_missing_params_and_bad_extra_args():
  params = {"w": jnp.ones((3, 3))}
  tx = grpo_optax.grpo(importance=True)
  state = tx.init(params)
  g = {"w": jnp.ones((3, 3))}
  with pytest.raises(ValueError, match="params"):
    tx.update(g, state)
  # The defaults read no params (no importance, L2 or freezing).
  out, _ = grpo_optax.grpo().update(g, grpo_optax.grpo().init(params))
  assert out["w"].shape == (3, 3)
  with pytest.raises(ValueError, match="hessian_diag"):
    tx.update(g, state, params, hessian_diag={"v": jnp.ones(3)})
  with pytest.raises(ValueError, match="importance_placement"):
    grpo_optax.grpo(importance_placement="after")
  with pytest.raises(TypeError, match="fused"):
    grpo_optax.grpo(fused="yes")
  with pytest.raises(ValueError, match="params"):
    grpo_optax.grpo(l2=1e-3).update(g, grpo_optax.grpo(l2=1e-3).init(params))


def test_freezing_normalises_over_the_leaves_still_trainable():
  """After a leaf froze, its importance must not drag the mean: here its
  gradient grows 10,000x once frozen, which with a mean over every leaf
  would freeze all the others.
  """
  params = {
    "a": jnp.ones((4, 4)),
    "b": jnp.full((4, 4), 0.01),
    "c": jnp.full((4, 4), 0.2),
    "d": jnp.full((4, 4), 0.5),
  }
  tx = grpo_optax.grpo(
    1e-3,
    max_norm=None,
    importance=False,
    sparsify=None,
    variance_coef=None,
    freeze_threshold=0.3,
    freeze_decay=0.5,
    freeze_warmup_steps=0,
  )
  state = tx.init(params)
  g = jax.tree.map(jnp.ones_like, params)
  _, state = tx.update(g, state, params)
  assert {
    k: bool(v) for k, v in grpo_optax.frozen_mask(state, params).items()
  } == {"a": False, "b": True, "c": False, "d": False}
  g["b"] = g["b"] * 1e4
  for _ in range(3):
    out, state = tx.update(g, state, params)
  assert {
    k: bool(v) for k, v in grpo_optax.frozen_mask(state, params).items()
  } == {"a": False, "b": True, "c": False, "d": False}
  assert float(jnp.abs(out["b"]).max()) == 0.0
  # Normalised importance of c: 0.2 / mean(1, 0.2, 0.5) = 0.35 > 0.3.
  imp = dict(
    zip(
      sorted(params),
      find_states(state, grpo_optax.FreezeBelowState)[0].importance,
    )
  )
  np.testing.assert_allclose(
    float(imp["c"])
    / np.mean([float(imp["a"]), float(imp["c"]), float(imp["d"])]),
    0.2 / (1.7 / 3),
    rtol=1e-5,
  )


@pytest.mark.parametrize("fused", [None, False])
@pytest.mark.parametrize("max_norm", [None, 1.0])
def test_complex_params_match_optax(fused, max_norm):
  """Complex leaves: |g|^2 in the clip norm and in Adam's second moment, as
  optax's clip_by_global_norm and nadam compute them (a g * g second moment
  or a float32 cast of g would differ by the size of the update).
  """
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  params = {
    "z": (
      jax.random.normal(k1, (40, 40)) + 1j * jax.random.normal(k2, (40, 40))
    ).astype(jnp.complex64),
    "r": jnp.linspace(-1.0, 1.0, 7),
  }
  ref = optax.nadam(1e-2)
  if max_norm is not None:
    ref = optax.chain(optax.clip_by_global_norm(max_norm), ref)
  tx = grpo_optax.grpo(1e-2, sparsify=None, max_norm=max_norm, fused=fused)
  s_ref, s = ref.init(params), tx.init(params)
  for t in range(4):
    g = jax.tree.map(lambda x, t=t: x * (0.3 * (t + 1)), params)
    want, s_ref = ref.update(g, s_ref, params)
    got, s = jax.jit(tx.update)(g, s, params)
    for k in params:
      assert got[k].dtype == params[k].dtype
      np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=1e-7)


def test_complex_params_with_topk_keep_the_error_feedback_invariant():
  """As test_error_feedback_loses_nothing, on a complex leaf: with b1 = 0 the
  first moment is the masked gradient; masked gradients plus the residual
  add up to the gradients, and the mask ranks entries by modulus.
  """
  params = {
    "z": (jnp.arange(1, 65.0).reshape(8, 8) * (1 - 0.5j)).astype(jnp.complex64)
  }
  tx = grpo_optax.grpo(1e-3, max_norm=None, b1=0.0, min_size=0)
  state = tx.init(params)
  sent = jnp.zeros((8, 8), jnp.complex64)
  total = jnp.zeros((8, 8), jnp.complex64)
  for t in range(3):
    g = {"z": params["z"] * jnp.cos(jnp.arange(64.0) + t).reshape(8, 8)}
    _, state = jax.jit(tx.update)(g, state, params)
    sent = sent + _adam_state(state).mu["z"]
    total = total + g["z"]
    kept = _adam_state(state).mu["z"] != 0
    # Kept entries are the largest by modulus: every kept |g| >= every
    # dropped |g| (of this step's accumulator, here the first step's g).
    if t == 0:
      mag = jnp.abs(g["z"])
      assert float(jnp.min(jnp.where(kept, mag, jnp.inf))) >= float(
        jnp.max(jnp.where(kept, -jnp.inf, mag))
      )
      assert 0 < int(jnp.sum(kept)) < 64
  np.testing.assert_allclose(
    sent + _mask_state(state).residual["z"], total, rtol=1e-5, atol=1e-5
  )


def test_integer_gradients_are_refused_with_a_clear_error():
  params = {"w": jnp.ones((4,)), "steps": jnp.ones((3,), jnp.int32)}
  tx = grpo_optax.grpo(1e-2)
  with pytest.raises(
    TypeError, match="int32.*floating-point|floating-point.*int32"
  ):
    tx.update(params, tx.init(params), params)


def test_coupled_l2_without_clipping_reaches_the_fused_core():
  """max_norm=None with l2: the fused core adds l2 p (and clips nothing)."""
  params = {"w": jnp.linspace(-1.0, 1.0, 64).reshape(8, 8)}
  g = {"w": jnp.full((8, 8), 0.01)}
  outs = []
  for fused in (None, False):
    tx = grpo_optax.grpo(
      1e-2, max_norm=None, l2=0.5, sparsify=None, fused=fused
    )
    state = tx.init(params)
    u, state = tx.update(g, state, params)
    u, state = tx.update(g, state, params)
    outs.append(np.asarray(u["w"]))
  assert grpo_optax.presets.describe(max_norm=None, l2=0.5)[0] == (
    "fused(clip, mask, adaptive)"
  )
  np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-8)
