"""What a JAX user meets in the first hour: debug modes, inject_hyperparams,
float16, weight decay, the learning rate's sign, Equinox trees, partitions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import grpo_optax

MODES = {
  "topk": {},
  "threshold": dict(sparsify="threshold"),
  "dense": dict(sparsify=None),
  "article": dict(grpo_optax.ARTICLE_DEFAULTS),
  "freeze": dict(freeze_threshold=0.3, freeze_warmup_steps=1),
  "chain": dict(fused=False),
}


def _params(dtype=jnp.float32):
  rng = np.random.default_rng(0)
  # A leaf above and leaves below min_size (1,024 entries).
  return {
    "w": jnp.asarray(rng.normal(size=(40, 64)), dtype),
    "b": jnp.asarray(rng.normal(size=(16,)), dtype),
    "s": jnp.asarray(0.5, dtype),
  }


def _grads(t=0, dtype=jnp.float32):
  rng = np.random.default_rng(10 + t)
  return {
    k: jnp.asarray(rng.normal(size=v.shape) * 1e-2, dtype)
    for k, v in _params().items()
  }


@pytest.mark.parametrize("debug", ["jax_debug_infs", "jax_debug_nans"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_debug_modes_and_finite_state(mode, debug):
  tx = grpo_optax.grpo(1e-3, **MODES[mode])
  params = _params()
  with (
    jax.debug_infs(True)
    if debug == "jax_debug_infs"
    else (jax.debug_nans(True))
  ):
    state = tx.init(params)
    for t in range(3):
      updates, state = tx.update(_grads(t), state, params)
      params = optax.apply_updates(params, updates)
  for x in jax.tree.leaves(state):
    assert bool(jnp.all(jnp.isfinite(x))), x
  assert np.isfinite(float(optax.tree.norm(state)))


@pytest.mark.parametrize("mode", sorted(MODES))
def test_inject_hyperparams_equals_the_plain_preset(mode):
  kw = MODES[mode]
  plain = grpo_optax.grpo(1e-3, **kw)
  injected = optax.inject_hyperparams(grpo_optax.grpo)(learning_rate=1e-3, **kw)
  params = _params()
  s_plain, s_inj = plain.init(params), injected.init(params)

  # Both updates in one jitted program: one compilation, not two.
  @jax.jit
  def both(g, s_plain, s_inj, p):
    return plain.update(g, s_plain, p), injected.update(g, s_inj, p)

  for t in range(3):
    (u1, s_plain), (u2, s_inj) = both(_grads(t), s_plain, s_inj, params)
    for a, b in zip(jax.tree.leaves(u1), jax.tree.leaves(u2)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-9)
  # Same state structure and values (optax's contrib test compares them).
  assert jax.tree.structure(s_plain) == jax.tree.structure(s_inj.inner_state)
  for a, b in zip(jax.tree.leaves(s_plain), jax.tree.leaves(s_inj.inner_state)):
    np.testing.assert_allclose(
      np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-5, atol=1e-9
    )


def test_inject_hyperparams_without_params():
  tx = optax.inject_hyperparams(grpo_optax.grpo)(learning_rate=1e-3)
  g = _grads()
  updates, _ = jax.jit(tx.update)(g, tx.init(_params()))
  assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))


def test_inject_hyperparams_with_bf16_params():
  params = _params(jnp.bfloat16)
  # optax casts hyper-parameters to the params' dtype: b2 = 0.999 rounds
  # to 1 in bfloat16, and the error says so and what to do.
  tx = optax.inject_hyperparams(grpo_optax.grpo)(learning_rate=1e-3)
  with pytest.raises(ValueError, match="hyperparam_dtype"):
    tx.init(params)
  tx = optax.inject_hyperparams(grpo_optax.grpo, hyperparam_dtype=jnp.float32)(
    learning_rate=1e-3
  )
  state = tx.init(params)
  updates, _ = tx.update(_grads(dtype=jnp.bfloat16), state, params)
  # As optax.adam's: a float32 learning rate promotes the updates.
  adam = optax.inject_hyperparams(optax.adam, hyperparam_dtype=jnp.float32)(
    learning_rate=1e-3
  )
  ref, _ = adam.update(_grads(dtype=jnp.bfloat16), adam.init(params), params)
  assert [u.dtype for u in jax.tree.leaves(updates)] == [
    u.dtype for u in jax.tree.leaves(ref)
  ]
  assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))


@pytest.mark.parametrize("fused", [None, False])
def test_float16_params_keep_float32_moments(fused):
  lr = 1e-3
  ups = {}
  for dtype in (jnp.float16, jnp.bfloat16, jnp.float32):
    tx = grpo_optax.grpo(lr, sparsify=None, fused=fused)
    params = _params(dtype)
    state = tx.init(params)
    # Gradients of 1e-4: their squares underflow float16 (min normal 6e-5).
    g = jax.tree.map(
      lambda p, dtype=dtype: jnp.full(p.shape, 1e-4, dtype), params
    )
    u, state = tx.update(g, state, params)
    ups[dtype] = u
  for u in jax.tree.leaves(ups[jnp.float16]):
    assert u.dtype == jnp.float16
    # Adam's first step is lr * sign(g) (NAdam's look-ahead: within 2x).
    assert float(jnp.max(jnp.abs(u.astype(jnp.float32)))) <= 2 * lr
  for a, b in zip(
    jax.tree.leaves(ups[jnp.float16]), jax.tree.leaves(ups[jnp.float32])
  ):
    np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=2e-3)


def test_float16_moment_dtype_defaults():
  state = grpo_optax.grpo(sparsify=None).init(_params(jnp.float16))
  moments = [x for x in jax.tree.leaves(state) if np.shape(x) == (40, 64)]
  assert len(moments) == 2 and all(x.dtype == jnp.float32 for x in moments)
  state = grpo_optax.grpo(
    sparsify=None, nu_dtype=jnp.float16, mu_dtype=jnp.float16
  ).init(_params(jnp.float16))
  moments = [x for x in jax.tree.leaves(state) if np.shape(x) == (40, 64)]
  assert all(x.dtype == jnp.float16 for x in moments)


@pytest.mark.parametrize("fused", [None, False])
def test_weight_decay_equals_adamw(fused):
  wd, lr = 0.1, 1e-2
  mask = {"w": True, "b": False, "s": True}
  tx = grpo_optax.grpo(
    lr,
    max_norm=None,
    sparsify=None,
    nesterov=False,
    weight_decay=wd,
    weight_decay_mask=mask,
    fused=fused,
  )
  ref = optax.adamw(lr, weight_decay=wd, mask=mask)
  params = p_ref = _params()
  s, s_ref = tx.init(params), ref.init(p_ref)
  for t in range(5):
    u, s = tx.update(_grads(t), s, params)
    u_ref, s_ref = ref.update(_grads(t), s_ref, p_ref)
    params, p_ref = (
      optax.apply_updates(params, u),
      optax.apply_updates(p_ref, u_ref),
    )
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(p_ref)):
    # optax rounds 1 - b2 differently: 1e-5 relative on the moments.
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  # The decay acts: without it the params differ.
  plain = grpo_optax.grpo(lr, max_norm=None, sparsify=None, nesterov=False)
  u0, _ = plain.update(_grads(0), plain.init(_params()), _params())
  u1, _ = tx.update(_grads(0), tx.init(_params()), _params())
  assert float(jnp.max(jnp.abs(u0["w"] - u1["w"]))) > 0
  np.testing.assert_array_equal(u0["b"], u1["b"])


def test_negative_learning_rate_is_refused():
  with pytest.raises(ValueError, match=r"learning_rate must be in \[0, inf\)"):
    grpo_optax.grpo(-1e-3)
  with pytest.raises(ValueError, match="weight_decay"):
    grpo_optax.grpo(weight_decay=-1.0)


def test_equinox_style_params_get_a_clear_error():
  params = dict(_params(), act=jax.nn.relu)  # a model with a non-array leaf
  grads = dict(_grads(), act=None)  # gradients filtered to arrays
  tx = grpo_optax.grpo(l2=1e-3)
  state = tx.init({k: v for k, v in params.items() if k != "act"})
  with pytest.raises(ValueError, match=r"eqx\.filter\(model, eqx\.is_array\)"):
    tx.update(grads, state, params)


def test_metrics_keys_carry_partition_labels():
  tx = optax.partition(
    {
      "a": grpo_optax.grpo(1e-3),
      "b": grpo_optax.grpo(1e-3, sparsify="threshold"),
    },
    {"w": "a", "b": "b", "s": "b"},
  )
  params = _params()
  state = tx.init(params)
  _, state = tx.update(_grads(), state, params)
  keys = set(grpo_optax.metrics(state))
  assert {
    "a:clip/clip_rate",
    "a:topk/kept_fraction",
    "b:clip/clip_rate",
    "b:threshold/tau_mean",
  } <= keys
  assert not any(k.startswith("grpo_") for k in keys)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_donated_step_runs(mode):
  """No two state leaves share a buffer (a donated step would refuse it)."""
  tx = grpo_optax.grpo(1e-3, **MODES[mode])
  params = _params()
  state = tx.init(params)
  leaves = [x for x in jax.tree.leaves(state) if isinstance(x, jax.Array)]
  assert len({id(x) for x in leaves}) == len(leaves)

  @jax.jit
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  step = jax.jit(step, donate_argnums=(0, 1))
  params, state = step(params, state, _grads())
  params, state = step(params, state, _grads(1))
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params))


def test_adamw_mask_keyword_is_refused_naming_weight_decay_mask():
  import inspect  # pylint: disable=g-import-not-at-top

  mask = {"w": True, "b": False, "s": True}
  # optax.adamw's keyword: here a "mask" is the gradient mask, so grpo()
  # refuses the word and names the keyword that takes adamw's mask.
  with pytest.raises(TypeError, match="weight_decay_mask= here") as e:
    grpo_optax.grpo(1e-3, weight_decay=1e-4, mask=mask)
  assert "unexpected keyword argument 'mask'" in str(e.value)
  with pytest.raises(TypeError, match="weight_decay_mask"):
    grpo_optax.grpo(mask=None)
  # Any other unknown keyword keeps Python's own message.
  with pytest.raises(TypeError, match="unexpected keyword argument 'masks'"):
    grpo_optax.grpo(1e-3, masks=mask)
  # The signature (read by the docs, the wiring tests and the examples'
  # flags) is grpo's own, and the keyword it names works.
  names = inspect.signature(grpo_optax.grpo).parameters
  assert "mask" not in names and "weight_decay_mask" in names
  assert names["learning_rate"].default == 1e-3
  kw = dict(weight_decay=1e-2, sparsify=None)
  tx = grpo_optax.grpo(1e-3, weight_decay_mask=mask, **kw)
  plain = grpo_optax.grpo(1e-3, **kw)
  params = _params()
  first = jax.jit(
    lambda t, p: t.update(_grads(), t.init(p), p)[0], static_argnums=0
  )
  updates, ref = first(tx, params), first(plain, params)
  # "b" does not decay under the mask: its update differs from the unmasked.
  assert not np.allclose(updates["b"], ref["b"])
  np.testing.assert_allclose(updates["w"], ref["w"], rtol=1e-6)


@pytest.mark.parametrize("sparsify", ["topk", "threshold", None])
def test_weakly_typed_params_give_a_state_whose_types_hold(sparsify):
  # Params from jnp.full(shape, python_float) are weakly typed; a state
  # built from them must keep its types through an update, or a jitted
  # step taking the state compiles again at the next step (optax.adam's mu
  # and nu do change type there).
  params = {"w": jnp.full((32, 64), 0.5), "b": jnp.full((64,), 0.1)}
  assert jax.typeof(params["w"]).weak_type
  tx = grpo_optax.grpo(1e-3, sparsify=sparsify, min_size=0)
  state = tx.init(params)
  grads = jax.tree.map(lambda x: jnp.ones(x.shape, jnp.float32), params)
  _, new_state = jax.jit(tx.update)(grads, state, params)
  types = lambda tree: jax.tree.map(jax.typeof, tree)
  assert types(new_state) == types(state)
