"""grpo_optax.rl losses against NumPy loop references, and their identities.

Identities checked: on-policy with one step and beta = 0 the ratio is 1 and
the gradient is REINFORCE's with the group-mean baseline; GSPO's token form
has the gradient of the sequence-level objective; padding and masking do not
change the loss; microbatches add up; KL estimators' expectations and
gradients by exact enumeration over a categorical policy.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_optax import rl

B, T, V = 6, 5, 7
GROUP = 3


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  logp = np.log(rng.uniform(0.05, 0.9, size=(B, T))).astype(np.float32)
  old = (logp + rng.normal(scale=0.5, size=(B, T))).astype(np.float32)
  ref = (logp + rng.normal(scale=0.5, size=(B, T))).astype(np.float32)
  adv = rng.normal(size=B).astype(np.float32)
  adv[GROUP:] = 0.0  # The second group has no signal.
  mask = np.ones((B, T), bool)
  for i, length in enumerate([5, 3, 1, 4, 2, 5]):
    mask[i, length:] = False
  entropy = rng.uniform(0, 2, size=(B, T)).astype(np.float32)
  return logp, old, ref, adv, mask, entropy


# ------------------------------------------------------------- references


def _ref_log_softmax(row, temperature):
  z = [x / temperature for x in row]
  top = max(z)
  lse = top + math.log(sum(math.exp(x - top) for x in z))
  return [x - lse for x in z]


def _ref_kl(logp, ref, estimator):
  delta = ref - logp
  if estimator == "k1":
    return -delta
  if estimator == "k2":
    return 0.5 * delta * delta
  return math.exp(delta) - delta - 1


def _ref_aggregate(values, mask, mode, max_length=None):
  rows = [[v for v, m in zip(vr, mr) if m] for vr, mr in zip(values, mask)]
  rows = [r for r in rows if r]
  if mode == "token-mean":
    return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
  if mode == "seq-mean-token-mean":
    return sum(sum(r) / len(r) for r in rows) / len(rows)
  if mode == "seq-mean-token-sum":
    return sum(sum(r) for r in rows) / len(rows)
  length = len(values[0]) if max_length is None else max_length
  return sum(sum(r) for r in rows) / (len(rows) * length)


def _ref_policy_loss(logp, old, adv, mask, config, ref=None, entropy=None):
  """Token by token, in float64; returns (loss, metrics)."""
  logp, old, mask = np.float64(logp), np.float64(old), np.asarray(mask)
  adv = np.float64(adv)
  if adv.ndim == 1:
    adv = np.repeat(adv[:, None], T, axis=1)
  lo, hi = 1 - config.clip_eps_low, 1 + config.clip_eps_high
  per_token = np.zeros((B, T))
  kl = np.zeros((B, T))
  ratios = np.ones((B, T))
  counts = {"low": 0, "high": 0, "dual": 0}
  for i in range(B):
    valid = [t for t in range(T) if mask[i, t]]
    if config.ratio_level == "sequence" and valid:
      seq = math.exp(sum(logp[i, t] - old[i, t] for t in valid) / len(valid))
    for t in valid:
      r = (
        seq
        if config.ratio_level == "sequence"
        else math.exp(logp[i, t] - old[i, t])
      )
      a = adv[i, t]
      loss = max(-a * r, -a * min(max(r, lo), hi))
      if config.dual_clip is not None and a < 0:
        loss = min(loss, -a * config.dual_clip)
        counts["dual"] += r > config.dual_clip
      counts["low"] += (r < lo) and (a < 0)
      counts["high"] += (r > hi) and (a > 0)
      if ref is not None:
        kl[i, t] = _ref_kl(logp[i, t], ref[i, t], config.kl_estimator)
      per_token[i, t] = loss
      ratios[i, t] = r
  agg = lambda x: _ref_aggregate(x, mask, config.aggregation, config.max_length)
  n = mask.sum()
  metrics = {
    "policy_loss": agg(per_token),
    "clip_fraction_low": counts["low"] / n,
    "clip_fraction_high": counts["high"] / n,
    "ratio_mean": ratios[mask].mean(),
    "ratio_max": ratios[mask].max(),
    "ratio_min": ratios[mask].min(),
    "num_tokens": n,
  }
  loss = metrics["policy_loss"]
  if config.dual_clip is not None:
    metrics["clip_fraction_dual"] = counts["dual"] / n
  if ref is not None:
    metrics["kl"] = kl[mask].mean()
    loss += config.beta * agg(kl)
  if entropy is not None:
    metrics["entropy"] = np.float64(entropy)[mask].mean()
  metrics["loss"] = loss
  return loss, metrics


# ------------------------------------------------------------ primitives


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_log_probs_and_entropy(temperature):
  rng = np.random.default_rng(1)
  logits = rng.normal(scale=3, size=(3, 4, V)).astype(np.float32)
  tokens = rng.integers(0, V, size=(3, 4))
  got = rl.token_log_probs(logits, tokens, temperature)
  ent = rl.token_entropy(logits, temperature)
  for b in range(3):
    for t in range(4):
      log_p = _ref_log_softmax(logits[b, t], temperature)
      assert got[b, t] == pytest.approx(log_p[tokens[b, t]], abs=2e-6)
      h = -sum(math.exp(lp) * lp for lp in log_p)
      assert ent[b, t] == pytest.approx(h, abs=2e-6)
  # bf16 logits are scored in float32.
  low = rl.token_log_probs(
    jnp.asarray(logits, jnp.bfloat16), tokens, temperature
  )
  assert low.dtype == jnp.float32


def test_completion_mask():
  tokens = np.array([[4, 1, 4, 1], [1, 3, 3, 3], [5, 6, 7, 8], [2, 9, 1, 0]])
  for eos in (1, (1, 2)):
    got = np.asarray(rl.completion_mask(tokens, eos))
    ids = {eos} if isinstance(eos, int) else set(eos)
    for b in range(4):
      seen = False
      for t in range(4):
        assert got[b, t] == (not seen)
        seen = seen or tokens[b, t] in ids


def test_kl_penalty_formulas():
  rng = np.random.default_rng(2)
  logp = np.log(rng.uniform(0.01, 1, size=(4, 3))).astype(np.float32)
  ref = np.log(rng.uniform(0.01, 1, size=(4, 3))).astype(np.float32)
  for estimator in rl.KL_ESTIMATORS:
    got = rl.kl_penalty(logp, ref, estimator)
    want = np.vectorize(
      lambda a, b, estimator=estimator: _ref_kl(float(a), float(b), estimator)
    )(logp, ref)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert np.all(np.asarray(rl.kl_penalty(logp, ref, "k3")) >= 0)


def test_kl_estimators_by_exact_enumeration():
  """E_pi[k] and E_pi[grad k] over all 5 outcomes of a categorical policy.

  k1 and k3 are unbiased for KL(pi || ref); k2 is not. The gradient (the
  samples not differentiated, as in a loss) is 0 for k1, the reverse KL's
  for k2, and the forward KL(ref || pi)'s for k3.
  """
  theta = jnp.array([0.3, -1.2, 0.8, 0.0, 1.5])
  ref_logits = jnp.array([-0.5, 0.4, 0.1, 1.0, -0.2])
  ref_logp = jax.nn.log_softmax(ref_logits)
  actions = jnp.arange(5)

  def expected(theta, estimator):
    logp = jax.nn.log_softmax(theta)
    weights = jax.lax.stop_gradient(jnp.exp(logp))  # Sampling distribution.
    return jnp.sum(
      weights * rl.kl_penalty(logp[actions], ref_logp[actions], estimator)
    )

  def reverse_kl(theta):
    logp = jax.nn.log_softmax(theta)
    return jnp.sum(jnp.exp(logp) * (logp - ref_logp))

  def forward_kl(theta):
    logp = jax.nn.log_softmax(theta)
    return jnp.sum(jnp.exp(ref_logp) * (ref_logp - logp))

  kl = reverse_kl(theta)
  assert float(expected(theta, "k1")) == pytest.approx(float(kl), rel=1e-5)
  assert float(expected(theta, "k3")) == pytest.approx(float(kl), rel=1e-5)
  assert abs(float(expected(theta, "k2")) - float(kl)) > 1e-2  # biased
  grad = lambda estimator: jax.grad(expected)(theta, estimator)
  np.testing.assert_allclose(grad("k1"), 0.0, atol=1e-6)
  np.testing.assert_allclose(
    grad("k2"), jax.grad(reverse_kl)(theta), rtol=1e-5, atol=1e-6
  )
  np.testing.assert_allclose(
    grad("k3"), jax.grad(forward_kl)(theta), rtol=1e-5, atol=1e-6
  )
  assert (
    np.max(np.abs(jax.grad(forward_kl)(theta) - jax.grad(reverse_kl)(theta)))
    > 1e-2
  )


@pytest.mark.parametrize("mode", rl.AGGREGATIONS)
def test_aggregate_matches_loops(mode):
  logp, _, _, _, mask, _ = _inputs()
  mask[3] = False  # An empty row does not count.
  for max_length in (None, 8):
    got = rl.aggregate(logp, mask, mode, max_length=max_length)
    want = _ref_aggregate(np.float64(logp), mask, mode, max_length)
    assert float(got) == pytest.approx(want, rel=1e-6)


# ----------------------------------------------------------- policy loss


_CONFIGS = {
  "grpo": rl.Config.preset("grpo"),
  "dapo": rl.Config.preset("dapo"),
  "dr_grpo": rl.Config.preset("dr_grpo"),
  "gspo": rl.Config.preset("gspo"),
  "gspo_wide_k2": rl.Config.preset(
    "gspo", clip_eps_low=0.1, clip_eps_high=0.1, beta=0.1, kl_estimator="k2"
  ),
  "dual_k1_seqsum": rl.Config(
    dual_clip=1.2, kl_estimator="k1", aggregation="seq-mean-token-sum"
  ),
  "dr_grpo_budget": rl.Config.preset("dr_grpo", max_length=9),
}


@pytest.mark.parametrize("name", sorted(_CONFIGS))
@pytest.mark.parametrize("token_advantages", [False, True])
def test_policy_loss_matches_loop_reference(name, token_advantages):
  config = _CONFIGS[name]
  logp, old, ref, adv, mask, entropy = _inputs()
  if token_advantages:
    adv = (adv[:, None] + np.linspace(-1, 1, T)[None]).astype(np.float32)
  use_ref = config.beta > 0
  loss, metrics = rl.policy_loss(
    logp,
    old,
    adv,
    mask,
    config=config,
    ref_log_probs=ref if use_ref else None,
    entropy=entropy,
  )
  want_loss, want = _ref_policy_loss(
    logp, old, adv, mask, config, ref if use_ref else None, entropy
  )
  assert float(loss) == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
  for key, value in want.items():
    assert float(metrics[key]) == pytest.approx(value, rel=1e-5, abs=1e-6), key
  if not config.dual_clip:
    assert "clip_fraction_dual" not in metrics
  if name == "grpo":  # The inputs exercise both clips.
    assert want["clip_fraction_low"] > 0 and want["clip_fraction_high"] > 0
  if name == "gspo":
    assert want["clip_fraction_low"] + want["clip_fraction_high"] > 0


def test_metrics_statistics_and_zero_signal_fraction():
  logp, old, _, adv, mask, _ = _inputs()
  _, m = rl.policy_loss(logp, old, adv, mask, config="dapo", group_size=GROUP)
  assert float(m["zero_signal_fraction"]) == 0.5
  assert float(m["advantage_mean"]) == pytest.approx(adv.mean(), abs=1e-6)
  assert float(m["advantage_std"]) == pytest.approx(adv.std(), abs=1e-6)
  assert float(m["advantage_max"]) == pytest.approx(adv.max())
  ratio = np.exp(np.float64(logp) - old)[mask]
  assert float(m["ratio_std"]) == pytest.approx(ratio.std(), rel=1e-5)
  _, m = rl.policy_loss(logp, old, adv, mask, config="dapo", group_size=1)
  assert float(m["zero_signal_fraction"]) == 0.5  # 3 of 6 rows are zero


@pytest.mark.parametrize("preset", ["grpo", "dapo", "dr_grpo"])
def test_on_policy_ratio_is_one_and_gradient_is_reinforce(preset):
  """One step per batch, beta = 0: -sum_i (R_i - mean) sum_t grad logp."""
  rng = np.random.default_rng(3)
  rewards = rng.integers(0, 2, size=(2, GROUP)).astype(np.float32)
  rewards[0] = [1, 0, 0]
  _, _, _, _, mask, _ = _inputs()
  theta = jnp.asarray(rng.normal(size=(B, T, V)), jnp.float32)
  tokens = rng.integers(0, V, size=(B, T))
  config = rl.Config.preset(
    preset,
    beta=0.0,
    advantage_estimator="none",
    aggregation="seq-mean-token-sum",
  )
  adv = rl.group_advantages(rewards, estimator="none").reshape(-1)

  def loss_fn(theta, old):
    logp = rl.token_log_probs(theta, tokens)
    return rl.policy_loss(logp, old, adv, mask, config=config)

  def reinforce(theta):
    logp = rl.token_log_probs(theta, tokens)
    baseline = rewards.mean(axis=1, keepdims=True)
    weights = jnp.asarray((rewards - baseline).reshape(-1))
    return -jnp.sum(weights[:, None] * jnp.where(mask, logp, 0)) / B

  old = rl.token_log_probs(theta, tokens)
  for old_arg in (None, old):
    (loss, m), grad = jax.value_and_grad(loss_fn, has_aux=True)(theta, old_arg)
    assert float(m["ratio_min"]) == float(m["ratio_max"]) == 1.0
    assert float(m["clip_fraction_low"]) == float(m["clip_fraction_high"]) == 0
    np.testing.assert_allclose(
      grad, jax.grad(reinforce)(theta), rtol=1e-5, atol=1e-7
    )
    assert float(loss) == pytest.approx(
      -float(jnp.sum(adv[:, None] * mask)) / B, abs=1e-6
    )


def test_gspo_token_form_has_the_sequence_objective_gradient():
  logp, old, _, adv, mask, _ = _inputs()
  config = rl.Config.preset("gspo", clip_eps_low=1.0, clip_eps_high=1e6)

  def sequence_objective(logp):
    lengths = mask.sum(axis=1)
    s = jnp.exp(jnp.sum(jnp.where(mask, logp - old, 0), axis=1) / lengths)
    return -jnp.mean(adv * s)

  grad = jax.grad(
    lambda x: rl.policy_loss(x, old, adv, mask, config=config)[0]
  )(logp)
  np.testing.assert_allclose(
    grad, jax.grad(sequence_objective)(logp), rtol=1e-5, atol=1e-7
  )
  # With the paper's narrow range, a clipped sequence has no gradient.
  narrow = rl.Config.preset("gspo")
  grad = jax.grad(
    lambda x: rl.policy_loss(x, old, adv, mask, config=narrow)[0]
  )(logp)
  s = np.exp(np.sum(np.where(mask, logp - old, 0), axis=1) / mask.sum(1))
  clipped = ((s > 1 + narrow.clip_eps_high) & (adv > 0)) | (
    (s < 1 - narrow.clip_eps_low) & (adv < 0)
  )
  assert clipped.any()
  np.testing.assert_array_equal(np.asarray(grad)[clipped], 0.0)


@pytest.mark.parametrize("name", sorted(_CONFIGS))
def test_padding_and_masked_values_do_not_change_the_loss(name):
  config = _CONFIGS[name]
  if config.aggregation == "seq-mean-token-sum-norm":
    config = rl.Config.preset("dr_grpo", max_length=T)  # A constant budget.
  logp, old, ref, adv, mask, _ = _inputs()

  def loss(logp, old, ref, adv, mask):
    return rl.policy_loss(
      logp, old, adv, mask, config=config, ref_log_probs=ref
    )[0]

  value, grad = jax.value_and_grad(loss)(logp, old, ref, adv, mask)
  # Garbage (NaN, huge) under the mask, two more padding columns and an
  # empty row.
  pad = lambda x, fill: np.pad(
    np.where(mask, x, fill), ((0, 1), (0, 2)), constant_values=fill
  )
  big_mask = np.pad(mask, ((0, 1), (0, 2)))
  args = (
    pad(logp, np.nan),
    pad(old, 1e4),
    pad(ref, -np.inf),
    np.pad(adv, (0, 1), constant_values=7.0),
    big_mask,
  )
  value2, grad2 = jax.value_and_grad(loss)(*args)
  assert float(value2) == pytest.approx(float(value), rel=1e-6)
  grad2 = np.asarray(grad2)
  np.testing.assert_allclose(grad2[:B, :T], grad, rtol=1e-6, atol=1e-9)
  assert np.all(grad2[~big_mask] == 0)


@pytest.mark.parametrize("mode", rl.AGGREGATIONS)
def test_microbatches_add_up(mode):
  logp, old, _, adv, mask, _ = _inputs()
  config = rl.Config(beta=0.0, aggregation=mode)

  def loss(logp, rows, **kwargs):
    return rl.policy_loss(
      logp, old[rows], adv[rows], mask[rows], config=config, **kwargs
    )[0]

  full, full_grad = jax.value_and_grad(loss)(logp, slice(None))
  totals = {"num_tokens": mask.sum(), "num_sequences": B}
  parts = [
    jax.value_and_grad(loss)(logp[rows], rows, **totals)
    for rows in (slice(0, 2), slice(2, 6))
  ]
  assert float(sum(p[0] for p in parts)) == pytest.approx(float(full), rel=1e-6)
  np.testing.assert_allclose(
    np.concatenate([p[1] for p in parts]), full_grad, rtol=1e-6, atol=1e-9
  )
  if mode == "token-mean":  # Without the totals, each part is its own mean.
    alone = sum(float(loss(logp[r], r)) for r in (slice(0, 2), slice(2, 6)))
    assert alone != pytest.approx(float(full), rel=1e-3)


# ------------------------------------------------------------ bad input


def test_config_validation():
  assert rl.Config() == rl.Config.preset("grpo")
  assert hash(rl.Config.preset("dapo")) == hash(rl.Config.preset("dapo"))
  for kwargs, match in [
    ({"clip_eps_low": 1.5}, "clip_eps_low"),
    ({"clip_eps_high": -0.1}, "clip_eps_high"),
    ({"dual_clip": 1.0}, "dual_clip"),
    ({"beta": -1.0}, "beta"),
    ({"temperature": 0.0}, "temperature"),
    ({"aggregation": "mean"}, "aggregation"),
    ({"kl_estimator": "k4"}, "kl_estimator"),
    ({"ratio_level": "group"}, "ratio_level"),
    ({"advantage_estimator": "ppo"}, "advantage_estimator"),
    ({"max_length": 0}, "max_length"),
  ]:
    with pytest.raises(ValueError, match=match):
      rl.Config(**kwargs)
  with pytest.raises(TypeError, match="beta"):
    rl.Config(beta=jnp.float32(0.1))
  with pytest.raises(ValueError, match="preset"):
    rl.Config.preset("ppo")
  with pytest.raises(TypeError, match="unknown Config field"):
    rl.Config.preset("grpo", clip=0.1)


def test_policy_loss_bad_input():
  logp, old, ref, adv, mask, _ = _inputs()
  call = lambda **kw: rl.policy_loss(
    kw.pop("logp", logp),
    kw.pop("old", old),
    kw.pop("adv", adv),
    kw.pop("mask", mask),
    **{"config": "dapo", **kw},
  )
  with pytest.raises(ValueError, match="ref_log_probs"):
    call(config="grpo")  # beta = 0.04 needs a reference
  with pytest.raises(ValueError, match="advantages"):
    call(adv=adv[:4])
  with pytest.raises(ValueError, match="mask"):
    call(mask=mask[:, :3])
  with pytest.raises(ValueError, match="old_log_probs"):
    call(old=old[:3])
  with pytest.raises(ValueError, match="ref_log_probs"):
    call(ref_log_probs=ref[:, :2])
  with pytest.raises(ValueError, match=r"\[B, T\]"):
    call(logp=logp[0])
  with pytest.raises(ValueError, match="group_size"):
    call(group_size=4)
  with pytest.raises(TypeError, match="config"):
    call(config={"beta": 0.0})
  with pytest.raises(ValueError, match="mode"):
    rl.aggregate(logp, mask, "sum")
  with pytest.raises(ValueError, match="estimator"):
    rl.kl_penalty(logp, ref, "k4")
  with pytest.raises(ValueError, match="temperature"):
    rl.token_log_probs(np.zeros((2, 3)), np.zeros(2, int), temperature=0.0)
  with pytest.raises(ValueError, match="tokens"):
    rl.token_log_probs(np.zeros((2, 3)), np.zeros(3, int))
  with pytest.raises(TypeError, match="integers"):
    rl.token_log_probs(np.zeros((2, 3)), np.zeros(2))
  with pytest.raises(ValueError, match=r"\[B, T\]"):
    rl.completion_mask(np.zeros(3, int), eos_id=1)


# ------------------------------------------ clipping at ties, huge ratios


@pytest.mark.parametrize(
  "eps_low, eps_high", [(0.0, 0.2), (0.2, 0.0), (0.0, 0.0)]
)
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_zero_clip_range_keeps_the_reinforce_gradient(
  eps_low, eps_high, dual_clip
):
  """On-policy the ratio is exactly 1, at the bound when eps = 0: the
  gradient is the unclipped one, -A grad(logp) under the aggregation's
  weights (jnp.clip/jnp.maximum used to give 0.75x or 0.625x of it).
  """
  logp, _, _, adv, mask, _ = _inputs(4)
  adv = np.where(np.arange(B) % 2, -1.0, 1.0).astype(np.float32) * (
    1 + np.arange(B, dtype=np.float32)
  )
  config = rl.Config(
    beta=0.0,
    clip_eps_low=eps_low,
    clip_eps_high=eps_high,
    dual_clip=dual_clip,
    aggregation="token-mean",
  )
  grad = jax.grad(
    lambda l: rl.policy_loss(l, None, adv, mask, config=config)[0]
  )(logp)
  want = jax.grad(
    lambda l: rl.aggregate(-adv[:, None] * l, mask, "token-mean")
  )(logp)
  np.testing.assert_array_equal(grad, want)
  assert np.all(np.asarray(grad)[mask] != 0)


@pytest.mark.parametrize("advantage", [1.0, -1.0, 0.0])
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_huge_log_ratio_gives_a_finite_gradient_in_float32(
  advantage, ratio_level
):
  """Log-ratio 200 (exp overflows float32): where the clip (A > 0), the dual
  clip (A < 0) or A = 0 makes the loss flat, the gradient is exactly 0 and
  finite, and the loss is the clipped constant.
  """
  log_old = jnp.full((2, 3), -201.0, jnp.float32)
  logp = jnp.full((2, 3), -1.0, jnp.float32)
  adv = jnp.full((2,), advantage, jnp.float32)
  mask = jnp.ones((2, 3), bool)
  config = rl.Config(
    beta=0.0, dual_clip=3.0, ratio_level=ratio_level, aggregation="token-mean"
  )
  loss_fn = lambda l: rl.policy_loss(l, log_old, adv, mask, config=config)[0]
  loss, grad = jax.value_and_grad(loss_fn)(logp)
  assert np.all(np.isfinite(grad)) and np.all(np.asarray(grad) == 0)
  want = {1.0: -1.2, -1.0: 3.0, 0.0: 0.0}[advantage]
  assert float(loss) == pytest.approx(want)
  # The values of the surrogate on both sides of each bound, for reference.
  config = rl.Config(
    beta=0.0,
    clip_eps_low=0.2,
    clip_eps_high=0.2,
    dual_clip=3.0,
    aggregation="token-mean",
  )
  for r, a, want in [
    (1.3, 1.0, -1.2),
    (1.1, 1.0, -1.1),
    (0.7, 1.0, -0.7),
    (0.7, -1.0, 0.8),
    (0.9, -1.0, 0.9),
    (2.0, -1.0, 2.0),
    (4.0, -1.0, 3.0),
  ]:
    got, _ = rl.policy_loss(
      jnp.full((1, 1), math.log(r), jnp.float32),
      jnp.zeros((1, 1), jnp.float32),
      jnp.array([a], jnp.float32),
      jnp.ones((1, 1), bool),
      config=config,
    )
    assert float(got) == pytest.approx(want, rel=1e-6), (r, a)
