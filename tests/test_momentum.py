"""scale_by_nesterov_adam_rms: optax limit cases, NumPy reference, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import grpo_optax
from grpo_optax import quantization

STEPS = 30


def _grad_seq(steps=STEPS, seed=0):
  rng = np.random.default_rng(seed)
  return [
    {
      "w": rng.normal(size=(5, 3)).astype(np.float32) * (1 + i % 4),
      "b": rng.normal(size=(3,)).astype(np.float32),
    }
    for i in range(steps)
  ]


def _updates(tx, grads):
  params = jax.tree.map(jnp.zeros_like, grads[0])
  state = tx.init(params)
  update = jax.jit(tx.update)
  outs = []
  for g in grads:
    u, state = update(g, state, params)
    outs.append(u)
  return outs


def _assert_trees_close(xs, ys, rtol):
  for x, y in zip(xs, ys):
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-7), x, y
    )


@pytest.mark.parametrize("eps_root", [0.0, 0.1])  # 0.1: as large as v
def test_adam_limit(eps_root):
  grads = _grad_seq()
  ours = grpo_optax.scale_by_nesterov_adam_rms(
    b1=0.8,
    b2=0.95,
    eps=1e-6,
    eps_root=eps_root,
    adam_weight=1.0,
    nesterov=False,
  )
  ref = optax.scale_by_adam(b1=0.8, b2=0.95, eps=1e-6, eps_root=eps_root)
  _assert_trees_close(_updates(ours, grads), _updates(ref, grads), 1e-5)


def test_nadam_limit():
  grads = _grad_seq()
  ours = grpo_optax.scale_by_nesterov_adam_rms(adam_weight=1.0, nesterov=True)
  ref = optax.nadam(learning_rate=-1.0)  # scale by +1: the raw NAdam direction
  _assert_trees_close(_updates(ours, grads), _updates(ref, grads), 1e-5)


def test_rmsprop_limit():
  grads = _grad_seq()
  for nesterov in (True, False):
    ours = grpo_optax.scale_by_nesterov_adam_rms(
      b2=0.9, eps=1e-7, adam_weight=0.0, nesterov=nesterov
    )
    ref = optax.scale_by_rms(decay=0.9, eps=1e-7, eps_in_sqrt=False)
    _assert_trees_close(_updates(ours, grads), _updates(ref, grads), 1e-5)


def test_noise_filter_is_ema_then_adam():
  grads = _grad_seq()
  ours = grpo_optax.scale_by_nesterov_adam_rms(
    adam_weight=1.0, nesterov=False, filter_decay=0.7
  )
  ref = optax.chain(optax.ema(0.7, debias=True), optax.scale_by_adam())
  _assert_trees_close(_updates(ours, grads), _updates(ref, grads), 1e-5)


def _numpy_reference(grads, b1, b2, eps, eps_root, w, nesterov, fd):
  f = m = v = None
  outs = []
  for t, g in enumerate(grads):
    g = {k: x.astype(np.float64) for k, x in g.items()}
    if f is None:
      f = {k: np.zeros_like(x) for k, x in g.items()}
      m = {k: np.zeros_like(x) for k, x in g.items()}
      v = {k: np.zeros_like(x) for k, x in g.items()}
    out = {}
    for k in g:
      gk = g[k]
      if fd is not None:
        f[k] = fd * f[k] + (1 - fd) * gk
        gk = f[k] / (1 - fd ** (t + 1))
      m[k] = b1 * m[k] + (1 - b1) * gk
      v[k] = b2 * v[k] + (1 - b2) * gk**2
      if nesterov:
        m_hat = b1 * m[k] / (1 - b1 ** (t + 2)) + (1 - b1) * gk / (
          1 - b1 ** (t + 1)
        )
      else:
        m_hat = m[k] / (1 - b1 ** (t + 1))
      v_hat = v[k] / (1 - b2 ** (t + 1))
      adam = m_hat / (np.sqrt(v_hat + eps_root) + eps)
      rms = gk / (np.sqrt(v[k]) + eps)
      out[k] = w * adam + (1 - w) * rms
    outs.append(out)
  return outs


@pytest.mark.parametrize(
  "w,nesterov,fd", [(0.5, True, None), (0.3, False, 0.6), (0.8, True, 0.9)]
)
def test_matches_numpy_reference(w, nesterov, fd):
  grads = _grad_seq()
  kw = dict(b1=0.85, b2=0.97, eps=1e-6, eps_root=1e-9)
  ours = grpo_optax.scale_by_nesterov_adam_rms(
    adam_weight=w, nesterov=nesterov, filter_decay=fd, **kw
  )
  ref = _numpy_reference(
    grads, kw["b1"], kw["b2"], kw["eps"], kw["eps_root"], w, nesterov, fd
  )
  _assert_trees_close(_updates(ours, grads), ref, 2e-4)


def test_mu_dtype():
  tx = grpo_optax.scale_by_nesterov_adam_rms(mu_dtype=jnp.bfloat16)
  params = {"w": jnp.ones(4)}
  state = tx.init(params)
  u, state = tx.update({"w": jnp.ones(4)}, state, params)
  assert state.mu["w"].dtype == jnp.bfloat16
  assert state.nu["w"].dtype == jnp.float32
  assert u["w"].dtype == jnp.float32


def test_requested_moment_dtypes_are_kept_for_float16_params():
  """float16 params default to float32 moments; a requested dtype wins."""
  params = {"w": jnp.ones(4, jnp.float16)}
  tx = grpo_optax.scale_by_nesterov_adam_rms(
    mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16
  )
  state = tx.init(params)
  assert state.mu["w"].dtype == jnp.bfloat16
  assert state.nu["w"].dtype == jnp.bfloat16
  state = grpo_optax.scale_by_nesterov_adam_rms().init(params)
  assert state.mu["w"].dtype == jnp.float32
  assert state.nu["w"].dtype == jnp.float32


@pytest.mark.parametrize(
  "kwargs,name",
  [
    (dict(b1=1.0), "b1"),
    (dict(b1=-0.1), "b1"),
    (dict(b2=1.0), "b2"),
    (dict(b2=float("nan")), "b2"),
    (dict(eps=-1.0), "eps"),
    (dict(eps_root=-1e-3), "eps_root"),
    (dict(adam_weight=1.5), "adam_weight"),
    (dict(adam_weight=-0.1), "adam_weight"),
    (dict(filter_decay=1.0), "filter_decay"),
  ],
)
def test_bad_input(kwargs, name):
  with pytest.raises(ValueError, match=name + r" must be in [\[(]"):
    grpo_optax.scale_by_nesterov_adam_rms(**kwargs)


def test_nesterov_must_be_bool():
  with pytest.raises(TypeError, match="nesterov"):
    grpo_optax.scale_by_nesterov_adam_rms(nesterov="yes")


# --- Stored formats (grpo_optax.quantization) -------------------------------


def _trajectory(tx, grads):
  params = jax.tree.map(jnp.zeros_like, grads[0])
  state = tx.init(params)
  update = jax.jit(tx.update)
  outs = []
  for g in grads:
    u, state = update(g, state, params)
    outs.append(u)
  assert update._cache_size() == 1  # pylint: disable=protected-access
  return outs, state


@pytest.mark.parametrize("nesterov,fd", [(True, None), (False, 0.6)])
def test_float32_format_is_bit_identical(nesterov, fd):
  grads = _grad_seq(8)
  kw = dict(adam_weight=0.7, nesterov=nesterov, filter_decay=fd)
  ref, ref_state = _trajectory(
    grpo_optax.scale_by_nesterov_adam_rms(**kw), grads
  )
  out, state = _trajectory(
    grpo_optax.scale_by_nesterov_adam_rms(
      mu_format="float32", nu_format="float32", **kw
    ),
    grads,
  )
  assert jax.tree.structure(state) == jax.tree.structure(ref_state)
  for a, b in zip(
    jax.tree.leaves((out, state)), jax.tree.leaves((ref, ref_state))
  ):
    np.testing.assert_array_equal(a, b)


def test_bfloat16_format_equals_mu_dtype():
  grads = _grad_seq(6)
  ref, _ = _trajectory(
    grpo_optax.scale_by_nesterov_adam_rms(mu_dtype=jnp.bfloat16), grads
  )
  out, state = _trajectory(
    grpo_optax.scale_by_nesterov_adam_rms(mu_format="bfloat16"), grads
  )
  assert state.mu["w"].dtype == jnp.bfloat16 and state.key is None
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
    np.testing.assert_array_equal(a, b)


def test_stochastic_format_keeps_and_splits_its_key():
  tx = grpo_optax.scale_by_nesterov_adam_rms(
    mu_format="bfloat16_sr", nu_format="bfloat16_sr", key=jax.random.key(3)
  )
  params = {"w": jnp.zeros((4, 5))}
  s0 = tx.init(params)
  _, s1 = tx.update({"w": jnp.ones((4, 5))}, s0, params)
  assert s1.mu["w"].dtype == s1.nu["w"].dtype == jnp.bfloat16
  assert not np.array_equal(
    jax.random.key_data(s0.key), jax.random.key_data(s1.key)
  )


def test_int8_state_tracks_fp32_adam():
  # Least squares with a badly scaled design; 8-bit moments vs fp32 moments.
  rng = np.random.default_rng(0)
  a = (rng.normal(size=(256, 64)) * np.exp(rng.normal(size=64))).astype(
    np.float32
  )
  w_true = rng.normal(size=(64, 4)).astype(np.float32)
  y = a @ w_true
  loss = lambda w: jnp.mean((a @ w["w"] - y) ** 2)

  def run(**formats):
    tx = optax.chain(
      grpo_optax.scale_by_nesterov_adam_rms(adam_weight=1.0, **formats),
      optax.scale(-1e-2),
    )
    w = {"w": jnp.zeros((64, 4))}
    state = tx.init(w)

    @jax.jit
    def step(w, state):
      u, state = tx.update(jax.grad(loss)(w), state, w)
      return optax.apply_updates(w, u), state

    for _ in range(300):
      w, state = step(w, state)
    return float(loss(w)), state[0], w["w"]

  l32, _, w32 = run()
  # 256 entries: under the formats' min_size, so asked for explicitly.
  l8, state, w8 = run(
    mu_format=quantization.state_format("int8", min_size=0),
    nu_format=quantization.state_format("uint8", min_size=0),
  )
  assert state.mu.codes["w"].dtype == jnp.int8
  assert state.nu.codes["w"].dtype == jnp.uint8
  start = float(loss({"w": jnp.zeros((64, 4))}))
  assert l32 < 0.01 * start  # fp32 Adam makes progress
  # Measured: losses 2.006 (fp32) and 2.028 (8-bit), weights 4.1% apart.
  assert abs(l8 - l32) <= 0.05 * l32
  assert jnp.linalg.norm(w8 - w32) <= 0.1 * jnp.linalg.norm(w32)


def test_mu_dtype_and_mu_format_exclusive():
  with pytest.raises(ValueError, match="mu_dtype"):
    grpo_optax.scale_by_nesterov_adam_rms(
      mu_dtype=jnp.bfloat16, mu_format="int8"
    )
  with pytest.raises(ValueError, match="format"):
    grpo_optax.scale_by_nesterov_adam_rms(nu_format="int3")


@pytest.mark.parametrize("fused", [False, True])
def test_eight_bit_update_is_the_one_the_stored_moments_give(fused):
  # The update reads the moments as stored (momentum.reads_stored): Adam's
  # step from the decoded new codes (nu with its floor), not from the
  # moments before rounding, which differ by up to half a code. Three steps
  # of gradients with swings, so that the old codes matter too.
  mu_fmt = quantization.state_format("int8", min_size=0)
  nu_fmt = quantization.state_format("uint8", min_size=0)
  b1, b2, eps = 0.9, 0.99, 1e-8
  adam = dict(b1=b1, b2=b2, eps=eps, adam_weight=1.0, nesterov=False)
  formats = dict(mu_format=mu_fmt, nu_format=nu_fmt)
  if fused:
    tx = grpo_optax.grpo(1.0, max_norm=None, sparsify=None, **adam, **formats)
  else:
    tx = grpo_optax.scale_by_nesterov_adam_rms(**adam, **formats)
  params = {"w": jnp.zeros((4, 512))}
  state = tx.init(params)
  rng = np.random.default_rng(5)
  for t in range(1, 4):
    g = {"w": jnp.asarray(rng.standard_t(2, (4, 512)) * 10.0 ** (t % 2))}
    u, state = jax.jit(tx.update)(g, state, params)
    adaptive = state.adaptive if fused else state
    mu = quantization.decode(
      mu_fmt,
      quantization.Quantized(adaptive.mu.codes["w"], adaptive.mu.scale["w"]),
    )
    nu = quantization.decode(
      nu_fmt,
      quantization.Quantized(adaptive.nu.codes["w"], adaptive.nu.scale["w"]),
      floor=True,
    )
    mu_hat = np.asarray(mu, np.float64) / (1 - b1**t)
    nu_hat = np.asarray(nu, np.float64) / (1 - b2**t)
    want = mu_hat / (np.sqrt(nu_hat) + eps)
    if fused:
      want = -want  # grpo() applies its learning rate (1.0) as a descent
    np.testing.assert_allclose(u["w"], want, rtol=2e-5, atol=1e-7)
