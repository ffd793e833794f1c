"""Savings of the training-program mechanisms, measured by XLA's own analyses.

Run ``python -m benchmarks.savings [--quick] [--out DIR]``. Writes
``DIR/savings.json`` and ``DIR/savings.md`` and prints the table.

* FLOPs: ``jax.jit(f).lower(...).compile().cost_analysis()["flops"]``.
* Peak bytes: from ``compile().memory_analysis()``, ``argument_size_in_bytes
  + output_size_in_bytes - alias_size_in_bytes + temp_size_in_bytes`` (the
  buffers live at once; donated arguments aliased to outputs count once).

The FLOP and donation ratios use the BERT example model
(``examples.bert_mlm.models``); the layer-wise ratio uses a deep stack of
residual MLP layers with a small batch, where parameters dominate memory.
The convergence costs compare held-out losses after the same number of steps
against the exact step, on a small BERT trained by masked-language modelling
on synthetic Markov-chain text and on a synthetic regression with the stacked
MLP.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from grpo_optax import training

# --------------------------------------------------------------------------
# XLA analyses.


def flops(jitted, *args) -> float:
  return float(jitted.lower(*args).compile().cost_analysis()["flops"])


def peak_bytes(jitted, *args) -> int:
  m = jitted.lower(*args).compile().memory_analysis()
  return int(
    m.argument_size_in_bytes
    + m.output_size_in_bytes
    - m.alias_size_in_bytes
    + m.temp_size_in_bytes
  )


# --------------------------------------------------------------------------
# The BERT example.


def bert(config_kwargs: dict[str, int], seed: int = 0):
  """Returns ``(PureModel, config)`` for an MLM loss on the example BERT."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from examples.bert_mlm.models import BertConfig  # pylint: disable=g-import-not-at-top
  from examples.bert_mlm.models import BertMLM  # pylint: disable=g-import-not-at-top

  config = BertConfig(**config_kwargs)
  model = BertMLM(config, rngs=nnx.Rngs(seed))

  def mlm_loss(m, batch):
    logits = m(batch["inputs"])
    ce = optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["targets"]
    )
    w = batch["weights"]
    return jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1.0)

  return training.split_model(model, mlm_loss), config


def markov_tokens(
  rng: np.random.Generator, table: np.ndarray, n: int, length: int
) -> np.ndarray:
  """Sequences from a first-order Markov chain (tokens 1..V-1)."""
  vocab = table.shape[0]
  out = np.empty((n, length), np.int32)
  out[:, 0] = rng.integers(1, vocab, n)
  cdf = np.cumsum(table, axis=1)
  for t in range(1, length):
    u = rng.random(n)[:, None]
    out[:, t] = np.minimum((u > cdf[out[:, t - 1]]).sum(1), vocab - 1)
  return out


def mlm_batch(
  rng: np.random.Generator, tokens: np.ndarray, mask_rate: float = 0.15
) -> dict[str, jax.Array]:
  """Masks ``mask_rate`` of the positions with token 0 ([MASK])."""
  masked = rng.random(tokens.shape) < mask_rate
  return {
    "inputs": jnp.asarray(np.where(masked, 0, tokens)),
    "targets": jnp.asarray(tokens),
    "weights": jnp.asarray(masked, jnp.float32),
  }


def markov_table(rng: np.random.Generator, vocab: int, fanout: int = 4):
  table = np.zeros((vocab, vocab))
  for i in range(vocab):
    nxt = rng.choice(np.arange(1, vocab), fanout, replace=False)
    table[i, nxt] = rng.dirichlet(np.ones(fanout))
  return table


def bottom_half_frozen(
  params: Any, num_layers: int, *, embeddings: bool = True
) -> Any:
  """Bool tree: the first ``num_layers // 2`` blocks (and the embeddings)."""
  half = num_layers // 2

  def rule(path, _):
    p = jax.tree_util.keystr(path, simple=True, separator="/")
    if p.startswith(("tok_embed", "pos_embed")):
      return embeddings
    if p.startswith("layers/"):
      return int(p.split("/")[1]) < half
    return False

  return jax.tree_util.tree_map_with_path(rule, params)


def bert_analyses(cfg: dict[str, int], batch_size: int) -> dict[str, Any]:
  pm, config = bert(cfg)
  params = pm.params
  tx = optax.adam(1e-3)
  tokens = np.zeros((batch_size, config.max_len), np.int32)
  batch = mlm_batch(np.random.default_rng(0), tokens)
  out: dict[str, Any] = {}

  # Hierarchical: default rule (MLP, norms, dense head non-core) and MLP+norms.
  for key, rule in [
    ("default", training.default_is_core),
    (
      "mlp_norm_only",
      lambda p, _: not any(s in p for s in ("/mlp/", "/ln", "ln_f")),
    ),
  ]:
    hs = training.hierarchical_step(pm.loss_fn, tx, is_core=rule)
    args = (params, tx.init(params), hs.init(params), batch)
    full, skip = flops(hs.full_step, *args), flops(hs.skip_step, *args)
    mask = jax.tree.leaves(hs.core_mask(params))
    sizes = [x.size for x in jax.tree.leaves(params)]
    out[f"hierarchical_{key}"] = {
      "full_flops": full,
      "skip_flops": skip,
      "ratio": skip / full,
      "noncore_param_fraction": sum(s for s, c in zip(sizes, mask) if not c)
      / sum(sizes),
    }

  # Freezing: none vs bottom half (embeddings + first half of the blocks).
  fs = training.frozen_train_step(pm.loss_fn, tx)
  none = jax.tree.map(lambda _: False, params)
  f_none = flops(fs.compiled(none, params), params, tx.init(params), batch)
  for key, emb in [("bottom_half", True), ("bottom_half_layers_only", False)]:
    mask = bottom_half_frozen(params, config.num_layers, embeddings=emb)
    f = flops(fs.compiled(mask, params), params, tx.init(params), batch)
    out[f"freeze_{key}"] = {
      "none_flops": f_none,
      "frozen_flops": f,
      "ratio": f / f_none,
    }

  # Donation: the same Adam step, donated or not.
  donated = training.train_step(pm.loss_fn, tx, donate=True)
  kept = training.train_step(pm.loss_fn, tx, donate=False)
  pd = peak_bytes(donated, params, tx.init(params), batch)
  pk = peak_bytes(kept, params, tx.init(params), batch)
  out["donation"] = {
    "donated_peak_bytes": pd,
    "not_donated_peak_bytes": pk,
    "ratio": pd / pk,
  }
  out["num_params"] = int(sum(x.size for x in jax.tree.leaves(params)))
  return out


# --------------------------------------------------------------------------
# The stacked MLP (layer-wise fused update).


def mlp_layer(p, h):
  return h + jnp.tanh(h @ p["w1"] + p["b1"]) @ p["w2"]


def mlp_embed(p, batch):
  return batch[0] @ p["w"]


def mlp_head(p, h, batch):
  return jnp.mean((h @ p["w"] - batch[1]) ** 2)


def stacked_params(key, d_in, d, f, num_layers, d_out):
  k = jax.random.split(key, 4)
  return training.StackedParams(
    embed={"w": jax.random.normal(k[0], (d_in, d)) / np.sqrt(d_in)},
    layers={
      "w1": jax.random.normal(k[1], (num_layers, d, f)) / np.sqrt(d),
      "b1": jnp.zeros((num_layers, f)),
      "w2": jax.random.normal(k[2], (num_layers, f, d))
      / np.sqrt(f)
      / num_layers,
    },
    head={"w": jax.random.normal(k[3], (d, d_out)) / np.sqrt(d)},
  )


def layerwise_analyses(d, f, num_layers, batch_size) -> dict[str, Any]:
  params = stacked_params(jax.random.key(0), 16, d, f, num_layers, 1)
  batch = (jnp.zeros((batch_size, 16)), jnp.zeros((batch_size, 1)))
  out: dict[str, Any] = {}
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  for name, tx in [
    ("adam", optax.adam(1e-3)),
    ("sgd_momentum", optax.sgd(1e-2, momentum=0.9)),
    ("sgd", optax.sgd(1e-2)),
  ]:
    fused = training.layerwise_train_step(mlp_embed, mlp_layer, mlp_head, tx)
    plain = training.train_step(fused.loss_fn, tx)
    plain_remat = training.train_step(
      training.stacked_loss_fn(mlp_embed, mlp_layer, mlp_head, remat=True), tx
    )
    pf = peak_bytes(fused.step, params, fused.init(params), batch)
    pp = peak_bytes(plain, params, tx.init(params), batch)
    pr = peak_bytes(plain_remat, params, tx.init(params), batch)
    out[name] = {
      "fused_peak_bytes": pf,
      "plain_peak_bytes": pp,
      "plain_remat_peak_bytes": pr,
      "ratio": pf / pp,
      "ratio_vs_remat": pf / pr,
      "saved_bytes_over_param_bytes": (pp - pf) / param_bytes,
    }
  out["param_bytes"] = int(param_bytes)
  return out


# --------------------------------------------------------------------------
# Convergence costs.


def bert_convergence(
  cfg: dict[str, int],
  steps: int,
  batch_size: int,
  refresh_every: int,
  lr: float,
) -> dict[str, Any]:
  rng = np.random.default_rng(0)
  pm, config = bert(cfg, seed=1)
  table = markov_table(rng, config.vocab_size)
  eval_batches = [
    mlm_batch(rng, markov_tokens(rng, table, 64, config.max_len))
    for _ in range(4)
  ]
  train_tokens = markov_tokens(rng, table, steps * batch_size, config.max_len)
  train_batches = [
    mlm_batch(
      np.random.default_rng(t),
      train_tokens[t * batch_size : (t + 1) * batch_size],
    )
    for t in range(steps)
  ]
  eval_loss = jax.jit(pm.loss_fn)
  tx = optax.adam(lr)

  def held_out(params):
    return float(np.mean([eval_loss(params, b) for b in eval_batches]))

  def run(kind):
    params = jax.tree.map(jnp.array, pm.params)
    opt_state = tx.init(params)
    t0 = time.perf_counter()
    if kind.startswith("hierarchical"):
      hs = training.hierarchical_step(
        pm.loss_fn, tx, refresh_every=refresh_every, approx=kind.split("_")[1]
      )
      h = hs.init(params)
      for t, b in enumerate(train_batches):
        params, opt_state, h, _ = hs.step(params, opt_state, h, b, t)
    elif kind == "freeze":
      fs = training.frozen_train_step(pm.loss_fn, tx)
      none = jax.tree.map(lambda _: False, params)
      half = bottom_half_frozen(params, config.num_layers)
      for t, b in enumerate(train_batches):
        params, opt_state, _ = fs.step(
          params, opt_state, b, none if t < steps // 2 else half
        )
    else:
      step = training.train_step(pm.loss_fn, tx, donate=kind != "not_donated")
      for b in train_batches:
        params, opt_state, _ = step(params, opt_state, b)
    jax.block_until_ready(params)
    return held_out(params), time.perf_counter() - t0

  init_loss = held_out(pm.params)
  res = {"initial_held_out_loss": init_loss}
  for kind in [
    "exact",
    "not_donated",
    "hierarchical_last",
    "hierarchical_momentum",
    "hierarchical_zero",
    "freeze",
  ]:
    loss, secs = run(kind)
    res[kind] = {"held_out_loss": loss, "seconds": secs}
  exact = res["exact"]["held_out_loss"]
  for kind in res:
    if isinstance(res[kind], dict):
      res[kind]["delta_vs_exact"] = res[kind]["held_out_loss"] - exact
  res["settings"] = {
    "config": cfg,
    "steps": steps,
    "batch": batch_size,
    "refresh_every": refresh_every,
    "optimizer": f"adam({lr})",
    "data": "masked LM (15%) on a synthetic "
    "first-order Markov chain, 4 successors per token",
    "freeze": "embeddings + bottom half of the blocks frozen "
    "for the second half of the steps",
  }
  return res


def layerwise_convergence(steps: int) -> dict[str, Any]:
  """Regression with the stacked MLP: fused vs plain, exact and clipped."""
  key = jax.random.key(0)
  teacher = stacked_params(jax.random.key(42), 16, 32, 64, 4, 1)
  teacher_fn = training.stacked_loss_fn(
    mlp_embed, mlp_layer, lambda p, h, b: h @ p["w"]
  )

  def data(k, n):
    x = jax.random.normal(k, (n, 16))
    return x, teacher_fn(teacher, (x, None))

  test = data(jax.random.key(7), 1024)
  res = {}
  for name, clip in [("unclipped", None), ("clipped", 0.5)]:
    if clip is None:
      tx_plain = tx_fused = optax.adam(3e-3)
    else:  # plain: global clip; fused: previous step's global norm.
      tx_plain = optax.chain(optax.clip_by_global_norm(clip), optax.adam(3e-3))
      tx_fused = optax.adam(3e-3)
    fused = training.layerwise_train_step(
      mlp_embed, mlp_layer, mlp_head, tx_fused, max_norm=clip
    )
    plain = training.train_step(fused.loss_fn, tx_plain)
    p0 = stacked_params(key, 16, 32, 64, 8, 1)
    pf, sf = jax.tree.map(jnp.array, p0), fused.init(p0)
    pp, sp = jax.tree.map(jnp.array, p0), tx_plain.init(p0)
    for t in range(steps):
      b = data(jax.random.fold_in(key, t), 64)
      pf, sf, _ = fused.step(pf, sf, b)
      pp, sp, _ = plain(pp, sp, b)
    lf, lp = float(fused.loss_fn(pf, test)), float(fused.loss_fn(pp, test))
    res[name] = {
      "fused_held_out_loss": lf,
      "plain_held_out_loss": lp,
      "delta": lf - lp,
    }
  res["settings"] = {
    "model": "8 residual tanh-MLP layers, d=32, ffn=64",
    "task": "regression onto a random 4-layer teacher",
    "steps": steps,
    "batch": 64,
    "optimizer": "adam(3e-3)",
    "clipped": "plain: clip_by_global_norm(0.5) + adam; "
    "fused: max_norm=0.5 on the previous step's "
    "global norm",
  }
  return res


# --------------------------------------------------------------------------
# Report.


def table(results: dict[str, Any]) -> str:
  a, lw, conv = results["bert"], results["layerwise"], results["convergence"]
  bc = conv["bert"]
  rows = [
    (
      "hierarchical_flops_ratio",
      results["hierarchical_flops_ratio"],
      "skip/full step FLOPs; MLP, norms and dense MLM head non-core "
      f"({a['hierarchical_default']['noncore_param_fraction']:.0%} of params)",
    ),
    (
      "  MLP + norms only non-core",
      a["hierarchical_mlp_norm_only"]["ratio"],
      "same, head kept core",
    ),
    (
      "freeze_flops_ratio",
      results["freeze_flops_ratio"],
      "embeddings + bottom half of blocks frozen / none frozen",
    ),
    (
      "  bottom half blocks only",
      a["freeze_bottom_half_layers_only"]["ratio"],
      "embeddings trainable (backward must reach them)",
    ),
    (
      "donation_peak_bytes_ratio",
      results["donation_peak_bytes_ratio"],
      "Adam step, donated / not donated",
    ),
    (
      "layerwise_peak_bytes_ratio",
      results["layerwise_peak_bytes_ratio"],
      "fused / plain (donated) step, Adam, "
      f"{lw['settings']['layers']} x d={lw['settings']['d']} "
      f"ffn={lw['settings']['ffn']}, batch {lw['settings']['batch']}",
    ),
    (
      "  vs plain with remat",
      lw["adam"]["ratio_vs_remat"],
      "plain step with jax.checkpoint per layer",
    ),
    ("  sgd+momentum", lw["sgd_momentum"]["ratio"], "fused / plain"),
    ("  sgd", lw["sgd"]["ratio"], "fused / plain"),
  ]
  lines = ["| metric | value | setting |", "|---|---|---|"]
  lines += [f"| {k} | {v:.3f} | {s} |" for k, v, s in rows]
  lines += [
    "",
    f"Held-out MLM loss after {bc['settings']['steps']} steps "
    f"(initial {bc['initial_held_out_loss']:.3f}):",
    "",
    "| run | held-out loss | vs exact | seconds |",
    "|---|---|---|---|",
  ]
  for k in [
    "exact",
    "not_donated",
    "hierarchical_last",
    "hierarchical_momentum",
    "hierarchical_zero",
    "freeze",
  ]:
    r = bc[k]
    lines.append(
      f"| {k} | {r['held_out_loss']:.4f} | "
      f"{r['delta_vs_exact']:+.4f} | {r['seconds']:.1f} |"
    )
  lc = conv["layerwise"]
  lines += [
    "",
    f"Layer-wise fused vs plain step, held-out MSE after "
    f"{lc['settings']['steps']} steps:",
    "",
    "| run | fused | plain | fused - plain |",
    "|---|---|---|---|",
  ]
  for k in ["unclipped", "clipped"]:
    r = lc[k]
    lines.append(
      f"| {k} | {r['fused_held_out_loss']:.5f} | "
      f"{r['plain_held_out_loss']:.5f} | {r['delta']:+.2e} |"
    )
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument(
    "--quick",
    action="store_true",
    help="short convergence runs (the XLA ratios are the same)",
  )
  parser.add_argument("--out", default="benchmarks/results")
  args = parser.parse_args(argv)
  t0 = time.perf_counter()
  bert_cfg = dict(
    vocab_size=8192, max_len=64, hidden=256, num_layers=4, num_heads=4, ffn=1024
  )
  lw_cfg = dict(d=256, f=1024, num_layers=32, batch_size=8)
  a = bert_analyses(bert_cfg, batch_size=8)
  lw = layerwise_analyses(**lw_cfg)
  lw["settings"] = {
    "layers": lw_cfg["num_layers"],
    "d": lw_cfg["d"],
    "ffn": lw_cfg["f"],
    "batch": lw_cfg["batch_size"],
  }
  small = dict(
    vocab_size=256, max_len=32, hidden=64, num_layers=2, num_heads=2, ffn=256
  )
  conv = {
    "bert": bert_convergence(
      small,
      steps=40 if args.quick else 400,
      batch_size=32,
      refresh_every=4,
      lr=3e-3,
    ),
    "layerwise": layerwise_convergence(30 if args.quick else 400),
  }
  results = {
    "hierarchical_flops_ratio": a["hierarchical_default"]["ratio"],
    "freeze_flops_ratio": a["freeze_bottom_half"]["ratio"],
    "donation_peak_bytes_ratio": a["donation"]["ratio"],
    "layerwise_peak_bytes_ratio": lw["adam"]["ratio"],
    "bert": a,
    "layerwise": lw,
    "convergence": conv,
    "settings": {
      "bert": dict(
        bert_cfg, batch=8, seq=bert_cfg["max_len"], optimizer="adam"
      ),
      "flops": "compile().cost_analysis()['flops']",
      "peak_bytes": "memory_analysis(): argument_size_in_bytes + "
      "output_size_in_bytes - alias_size_in_bytes + "
      "temp_size_in_bytes",
      "quick": args.quick,
    },
    "environment": {
      "jax": jax.__version__,
      "optax": optax.__version__,
      "backend": jax.default_backend(),
      "machine": platform.machine(),
      "seconds": round(time.perf_counter() - t0, 1),
    },
  }
  md = table(results)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "savings.json"), "w") as fp:
    json.dump(results, fp, indent=2)
  with open(os.path.join(args.out, "savings.md"), "w") as fp:
    fp.write(
      "# Training-program savings (XLA analyses)\n\n"
      f"`python -m benchmarks.savings{' --quick' if args.quick else ''}`"
      f", jax {jax.__version__}, {jax.default_backend()}.\n\n" + md + "\n"
    )
  print(md)
  print(
    f"\nwrote {args.out}/savings.json and savings.md "
    f"({results['environment']['seconds']} s)"
  )
  return results


if __name__ == "__main__":
  main()
