"""Memory of optimizer state and of a training step: fp32, bf16 and 8-bit state.

Run ``python -m benchmarks.memory [--dry-run] [--out DIR] [--sections ...]``.
Writes ``DIR/memory.json`` and ``DIR/memory.md``. Sections:

* ``codec``: error of each storage format (:mod:`grpo_optax.quantization`)
  on the Adam moments of a small GPT-style decoder trained with Adam, for
  code-map powers and block sizes (the measurement behind the defaults), and
  the final loss of the same training with each stored format.
* ``state``: optimizer-state bytes per parameter of every optimizer of
  :data:`FACTORIES` (from ``jax.eval_shape``, nothing allocated).
* ``peak``: peak bytes of the training step of a GPT-style decoder (XLA's
  ``compile().memory_analysis()``: arguments + outputs - aliased + temps),
  plain donated step and layer-wise fused update, as a ratio to Adam's
  donated step.
* ``capacity``: the deepest decoder of the family whose step fits the bytes
  of Adam's donated step at the reference depth, and its parameter count.
* ``time``: update + apply time of each optimizer at ``--time-params``
  parameters, interleaved in one process as ``benchmarks.step_time`` does,
  with the bandwidth reached (and its fraction of ``--peak-gbps``).

Add an optimizer by adding an entry ``name -> callable(lr) -> tx`` to
:data:`FACTORIES`; every section picks it up. ``--dry-run`` runs every
section at tiny sizes (seconds on a CPU) through the same code.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import grpo_optax
from benchmarks import command as command_lib
from benchmarks import step_time
from grpo_optax import quantization
from grpo_optax import training


def _adam_chain(lr, **formats):
  return optax.chain(
    optax.clip_by_global_norm(1.0),
    grpo_optax.scale_by_nesterov_adam_rms(adam_weight=1.0, **formats),
    optax.scale_by_learning_rate(lr),
  )


# name -> callable(lr) -> tx. The first entry is the baseline of every ratio.
FACTORIES: dict[str, Callable[[float], optax.GradientTransformation]] = {
  "adam_fp32": _adam_chain,
  "adam_bf16": lambda lr: _adam_chain(
    lr, mu_format="bfloat16", nu_format="bfloat16"
  ),
  "adam_int8": lambda lr: _adam_chain(lr, mu_format="int8", nu_format="uint8"),
  # The preset with its defaults (sampled top-k with an fp32 accumulator),
  # and with Adam's moments in 8 bits.
  "grpo_fp32": lambda lr: grpo_optax.grpo(lr),
  "grpo_int8": lambda lr: grpo_optax.grpo(
    lr, mu_format="int8", nu_format="uint8"
  ),
  # ... and the error-feedback accumulator in 8 bits too: all of the state.
  "grpo_8bit": lambda lr: grpo_optax.grpo(
    lr, mu_format="int8", nu_format="uint8", accumulator_format="int8_sr"
  ),
}
BASELINE = "adam_fp32"

# GPT-2 small's width and vocabulary; depth 10 is ~150M parameters (article
# 000's baseline model). Dry run: the same code at toy sizes.
FULL = dict(
  vocab=50257,
  seq=256,
  d=768,
  batch=1,
  ref_depth=10,
  codec_d=128,
  codec_depth=2,
  codec_steps=300,
  time_params=2e7,
)
DRY = dict(
  vocab=256,
  seq=16,
  d=64,
  batch=2,
  ref_depth=2,
  codec_d=32,
  codec_depth=2,
  codec_steps=20,
  time_params=2e5,
)

# Peak HBM bandwidth (GB/s) by jax device_kind, for the fraction reached.
PEAK_GBPS = {
  "NVIDIA H200": 4800.0,
  "NVIDIA H100 80GB HBM3": 3350.0,
  "NVIDIA A100-SXM4-80GB": 2039.0,
}


# --------------------------------------------------------------------------
# A GPT-style decoder as StackedParams (embed, stacked layers, head).


def _norm(x, scale):
  x = x - jnp.mean(x, -1, keepdims=True)
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5) * scale


def gpt_layer(p, h):
  """Pre-norm block: causal multi-head attention (heads of 64) + 4x MLP."""
  b, s, d = h.shape
  heads = max(1, d // 64)
  q, k, v = jnp.split(_norm(h, p["ln1"]) @ p["qkv"], 3, axis=-1)
  q, k, v = (x.reshape(b, s, heads, d // heads) for x in (q, k, v))
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads)
  logits = jnp.where(jnp.tril(jnp.ones((s, s), bool)), logits, -1e9)
  att = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, -1), v)
  h = h + att.reshape(b, s, d) @ p["proj"]
  return h + jax.nn.gelu(_norm(h, p["ln2"]) @ p["fc1"]) @ p["fc2"]


def gpt_embed(p, tokens):
  s = tokens.shape[1] - 1
  return p["tok"][tokens[:, :-1]] + p["pos"][:s]


def gpt_head(p, h, tokens):
  logits = _norm(h, p["ln"]) @ p["out"]
  logp = jax.nn.log_softmax(logits, -1)
  return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))


def gpt_params(key, vocab, seq, d, depth) -> training.StackedParams:
  k = jax.random.split(key, 7)
  n = lambda i, shape, fan: jax.random.normal(k[i], shape) / np.sqrt(fan)
  return training.StackedParams(
    embed={"tok": n(0, (vocab, d), 50.0), "pos": n(1, (seq, d), 50.0)},
    layers={
      "ln1": jnp.ones((depth, d)),
      "qkv": n(2, (depth, d, 3 * d), d),
      "proj": n(3, (depth, d, d), d * 2 * depth),
      "ln2": jnp.ones((depth, d)),
      "fc1": n(4, (depth, d, 4 * d), d),
      "fc2": n(5, (depth, 4 * d, d), 4 * d * 2 * depth),
    },
    head={"ln": jnp.ones((d,)), "out": n(6, (d, vocab), d)},
  )


def gpt_shapes(cfg, depth):
  return jax.eval_shape(
    lambda: gpt_params(
      jax.random.key(0), cfg["vocab"], cfg["seq"], cfg["d"], depth
    )
  )


def num_params(tree) -> int:
  return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def peak_bytes(jitted, *args) -> int:
  """Arguments + outputs - donated (aliased) + temporaries of the compiled step."""
  m = jitted.lower(*args).compile().memory_analysis()
  return int(
    m.argument_size_in_bytes
    + m.output_size_in_bytes
    - m.alias_size_in_bytes
    + m.temp_size_in_bytes
  )


def step_peak(cfg, depth, tx, layerwise: bool) -> int:
  """Peak bytes of one donated training step of the decoder of ``depth``."""
  params = gpt_shapes(cfg, depth)
  tokens = jax.ShapeDtypeStruct((cfg["batch"], cfg["seq"] + 1), jnp.int32)
  if layerwise:
    fused = training.layerwise_train_step(
      gpt_embed, gpt_layer, gpt_head, tx, max_norm=1.0
    )
    return peak_bytes(
      fused.step, params, jax.eval_shape(fused.init, params), tokens
    )
  loss_fn = training.stacked_loss_fn(gpt_embed, gpt_layer, gpt_head)
  return peak_bytes(
    training.train_step(loss_fn, tx),
    params,
    jax.eval_shape(tx.init, params),
    tokens,
  )


# --------------------------------------------------------------------------
# Sections.


def state_section(cfg) -> dict[str, Any]:
  params = gpt_shapes(cfg, cfg["ref_depth"])
  n = num_params(params)
  out = {}
  for name, make in FACTORIES.items():
    state = jax.eval_shape(make(1e-3).init, params)
    out[name] = round(quantization.tree_bytes(state) / n, 4)
    print(f"state  {name:>12s} {out[name]:.3f} B/param", flush=True)
  return {"n_params": n, "bytes_per_param": out}


def peak_section(cfg) -> list[dict]:
  rows = []
  for name, make in FACTORIES.items():
    for layerwise in (False, True):
      peak = step_peak(cfg, cfg["ref_depth"], make(1e-3), layerwise)
      rows.append(dict(optimizer=name, layerwise=layerwise, peak_bytes=peak))
  base = next(
    r["peak_bytes"]
    for r in rows
    if r["optimizer"] == BASELINE and not r["layerwise"]
  )
  for r in rows:
    r["ratio_to_adam"] = round(r["peak_bytes"] / base, 4)
    print(
      f"peak   {r['optimizer']:>12s} layerwise={r['layerwise']!s:5s} "
      f"{r['peak_bytes'] / 2**20:9.1f} MiB  x{r['ratio_to_adam']:.3f}",
      flush=True,
    )
  return rows


def capacity_section(cfg, peaks: list[dict]) -> dict[str, Any]:
  """Deepest decoder within the budget of Adam's donated step at ref depth.

  Peak bytes are affine in depth (each layer adds the same parameters,
  state, gradients and stored activations), so the depth is extrapolated
  from the peaks at ``ref_depth`` (the peak section) and ``2 ref_depth``,
  then the step at that depth is compiled to check that it fits.
  """
  ref = cfg["ref_depth"]
  budget = next(
    r["peak_bytes"]
    for r in peaks
    if r["optimizer"] == BASELINE and not r["layerwise"]
  )
  base_n = num_params(gpt_shapes(cfg, ref))
  rows = []
  for r in peaks:
    tx = FACTORIES[r["optimizer"]](1e-3)
    slope = (
      step_peak(cfg, 2 * ref, tx, r["layerwise"]) - r["peak_bytes"]
    ) / ref
    depth = ref + math.floor((budget - r["peak_bytes"]) / slope)
    check = step_peak(cfg, depth, tx, r["layerwise"])
    n = num_params(gpt_shapes(cfg, depth))
    rows.append(
      dict(
        optimizer=r["optimizer"],
        layerwise=r["layerwise"],
        depth=depth,
        n_params=n,
        capacity_ratio=round(n / base_n, 3),
        bytes_per_layer=int(slope),
        peak_at_depth=check,
        fits=check <= budget,
      )
    )
    print(
      f"fits   {r['optimizer']:>12s} layerwise={r['layerwise']!s:5s} depth "
      f"{depth:3d} {n / 1e6:8.1f}M params  x{n / base_n:.2f} "
      f"(checked: {check <= budget})",
      flush=True,
    )
  return {
    "budget_bytes": budget,
    "ref_depth": ref,
    "ref_params": base_n,
    "rows": rows,
  }


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def markov_tokens(key, vocab, batch, seq):
  """Tokens t_{i+1} = 7 t_i + 3 (mod V), a random token 10% of the time."""
  k1, k2, k3 = jax.random.split(key, 3)
  start = jax.random.randint(k1, (batch,), 0, vocab)
  noise = jax.random.randint(k2, (batch, seq + 1), 0, vocab)
  flip = jax.random.uniform(k3, (batch, seq + 1)) < 0.1

  def body(t, xs):
    n, f = xs
    t = jnp.where(f, n, (7 * t + 3) % vocab)
    return t, t

  _, toks = jax.lax.scan(body, start, (noise.T, flip.T))
  return toks.T.astype(jnp.int32)


def train_decoder(cfg, tx, steps, seed=0):
  """Trains the small decoder; returns (final losses, params, opt_state)."""
  vocab, seq = 256, 32
  params = gpt_params(
    jax.random.key(seed), vocab, seq, cfg["codec_d"], cfg["codec_depth"]
  )
  step = training.train_step(
    training.stacked_loss_fn(gpt_embed, gpt_layer, gpt_head), tx
  )
  state = tx.init(params)
  losses = []
  for i in range(steps):
    toks = markov_tokens(jax.random.key(1000 + i), vocab, 16, seq)
    params, state, loss = step(params, state, toks)
    losses.append(float(loss))
  return losses, params, state


def _rel(a, b) -> float:
  num = sum(
    float(jnp.sum((x - y) ** 2))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )
  den = sum(float(jnp.sum(y**2)) for y in jax.tree.leaves(b))
  return math.sqrt(num / max(den, 1e-30))


def codec_errors(mu, nu, count) -> list[dict]:
  """Relative RMS error of stored moments and of Adam's direction."""
  bc1, bc2 = 1 - 0.9**count, 1 - 0.999**count
  direction = lambda m, v: jax.tree.map(
    lambda a, b: (a / bc1) / (jnp.sqrt(b / bc2) + 1e-8), m, v
  )
  exact = direction(mu, nu)
  candidates = [("bfloat16", {}, "bfloat16", {})]
  candidates += [("int8", dict(power=p), None, {}) for p in (1, 2, 3, 4)]
  candidates += [(None, {}, "uint8", dict(power=p)) for p in (1, 2, 3, 4, 5)]
  candidates += [
    ("int8", dict(block_size=b), "uint8", dict(block_size=b))
    for b in (64, 256, 1024, 2048)
  ]
  rows = []
  for mf, mkw, nf, nkw in candidates:
    fm = mf and quantization.state_format(mf, **mkw)
    fn = nf and quantization.state_format(nf, **nkw)
    rt = lambda f, t: (
      t
      if not f
      else jax.jit(
        lambda x: quantization.tree_decode(f, quantization.tree_encode(f, x))
      )(t)
    )
    m2, v2 = rt(fm, mu), rt(fn, nu)
    rows.append(
      dict(
        mu_format=fm and f"{fm.name}(p={fm.power},B={fm.block_size})",
        nu_format=fn and f"{fn.name}(p={fn.power},B={fn.block_size})",
        mu_rel_err=round(_rel(m2, mu), 5),
        nu_rel_err=round(_rel(v2, nu), 5),
        direction_rel_err=round(_rel(direction(m2, v2), exact), 5),
      )
    )
    print(
      "codec  " + "  ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True
    )
  return rows


def codec_section(cfg) -> dict[str, Any]:
  steps = cfg["codec_steps"]
  _, _, state = train_decoder(cfg, FACTORIES[BASELINE](1e-3), steps)
  adam = state[1]
  errors = codec_errors(adam.mu, adam.nu, int(adam.count))
  final = {}
  for name, make in FACTORIES.items():
    losses, _, _ = train_decoder(cfg, make(1e-3), steps)
    final[name] = round(float(np.mean(losses[-20:])), 5)
    print(
      f"train  {name:>12s} mean loss of the last 20 of {steps} steps "
      f"{final[name]:.4f}",
      flush=True,
    )
  return {"steps": steps, "errors": errors, "final_loss": final}


def time_section(
  n_params: float, rounds: int, iters: int, peak_gbps: float | None
) -> list[dict]:
  """Update + apply time of every factory, interleaved in one process."""
  shapes = step_time.transformer_tree(n_params)
  keys = jax.random.split(jax.random.key(0), len(jax.tree.leaves(shapes)))
  grads = jax.tree.structure(shapes).unflatten(
    [
      1e-2 * jax.random.normal(k, s.shape, s.dtype)
      for k, s in zip(keys, jax.tree.leaves(shapes))
    ]
  )
  runs = {}
  for name, make in FACTORIES.items():
    tx = make(1e-3)
    params = jax.tree.map(lambda g: jnp.full_like(g, 0.02), grads)
    state = tx.init(params)
    nbytes = 3 * quantization.tree_bytes(params) + 2 * quantization.tree_bytes(
      state
    )
    stepf = step_time._make_step(tx)  # pylint: disable=protected-access
    params, state = stepf(params, state, grads)
    jax.block_until_ready(params)
    runs[name] = dict(
      step=stepf, params=params, state=state, times=[], bytes=nbytes
    )
  step_time._time_interleaved(list(runs.values()), grads, rounds, iters)  # pylint: disable=protected-access
  n = num_params(grads)
  base = statistics.median(runs[BASELINE]["times"])
  rows = []
  for name, r in runs.items():
    s = statistics.median(r["times"])
    gbps = r["bytes"] / s / 1e9
    rows.append(
      dict(
        optimizer=name,
        n_params=n,
        median_ms=round(s * 1e3, 3),
        ratio_to_adam=round(s / base, 3),
        bytes_per_step=int(r["bytes"]),
        achieved_gbps=round(gbps, 1),
        hbm_fraction=(round(gbps / peak_gbps, 3) if peak_gbps else None),
      )
    )
    print(
      f"time   {name:>12s} {s * 1e3:9.3f} ms  x{s / base:.3f}  "
      f"{gbps:7.1f} GB/s"
      + (f" ({gbps / peak_gbps:.1%} of peak)" if peak_gbps else ""),
      flush=True,
    )
  return rows


# --------------------------------------------------------------------------
# Report.


def _gb(x: float) -> str:
  return f"{x / 2**30:.2f} GiB" if x >= 2**30 else f"{x / 2**20:.1f} MiB"


def to_markdown(res: dict[str, Any]) -> str:
  meta = res["meta"]
  out = [
    f"# Optimizer-state memory ({meta['device']}, {meta['date']})",
    "",
    f"Command: `{meta['command']}`",
    "",
  ]
  if "state" in res:
    s = res["state"]
    out += [
      f"## State bytes per parameter ({s['n_params'] / 1e6:.1f}M-param "
      "decoder)",
      "",
      "| optimizer | bytes/param |",
      "|---|---|",
    ]
    out += [f"| {k} | {v:.3f} |" for k, v in s["bytes_per_param"].items()]
    out.append("")
  if "peak" in res:
    out += [
      "## Peak bytes of a training step (XLA memory_analysis)",
      "",
      f"Decoder: {meta['config']}, depth {meta['config']['ref_depth']}.",
      "",
      "| optimizer | layer-wise | peak | x Adam's donated step |",
      "|---|---|---|---|",
    ]
    out += [
      f"| {r['optimizer']} | {r['layerwise']} | {_gb(r['peak_bytes'])} | "
      f"{r['ratio_to_adam']:.3f} |"
      for r in res["peak"]
    ]
    out.append("")
  if "capacity" in res:
    c = res["capacity"]
    out += [
      "## Largest decoder within Adam's budget",
      "",
      f"Budget: {_gb(c['budget_bytes'])}, the peak of {BASELINE}'s "
      f"donated step at depth {c['ref_depth']} "
      f"({c['ref_params'] / 1e6:.1f}M params).",
      "",
      "| optimizer | layer-wise | MiB per layer | depth | params | "
      "x params | compiled peak at that depth fits |",
      "|---|---|---|---|---|---|---|",
    ]
    out += [
      f"| {r['optimizer']} | {r['layerwise']} | "
      f"{r['bytes_per_layer'] / 2**20:.1f} | {r['depth']} | "
      f"{r['n_params'] / 1e6:.1f}M | {r['capacity_ratio']:.2f} | "
      f"{r['fits']} |"
      for r in c["rows"]
    ]
    out.append("")
  if "codec" in res:
    c = res["codec"]
    out += [
      f"## Codec error on Adam moments ({c['steps']} Adam steps)",
      "",
      "| mu format | nu format | mu rel. err | nu rel. err | "
      "Adam direction rel. err |",
      "|---|---|---|---|---|",
    ]
    out += [
      f"| {r['mu_format'] or 'fp32'} | {r['nu_format'] or 'fp32'} | "
      f"{r['mu_rel_err']:.4f} | {r['nu_rel_err']:.4f} | "
      f"{r['direction_rel_err']:.4f} |"
      for r in c["errors"]
    ]
    if c.get("final_loss"):
      out += [
        "",
        "| optimizer | final loss (mean of last 20 steps) |",
        "|---|---|",
      ]
      out += [f"| {k} | {v:.4f} |" for k, v in c["final_loss"].items()]
    out.append("")
  if "time" in res:
    out += [
      "## Update + apply time (interleaved, one process)",
      "",
      "| optimizer | params | median ms | x Adam fp32 | GB/s | "
      "fraction of peak HBM |",
      "|---|---|---|---|---|---|",
    ]
    out += [
      f"| {r['optimizer']} | {r['n_params'] / 1e6:.0f}M | "
      f"{r['median_ms']:.2f} | {r['ratio_to_adam']:.3f} | "
      f"{r['achieved_gbps']:.1f} | "
      f"{'' if r['hbm_fraction'] is None else r['hbm_fraction']} |"
      for r in res["time"]
    ]
    out.append("")
  return "\n".join(out)


SECTIONS = ("state", "peak", "capacity", "codec", "time")


def main(argv=None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--dry-run",
    action="store_true",
    help="tiny sizes, same code paths (seconds on a CPU)",
  )
  parser.add_argument("--sections", default=",".join(SECTIONS))
  parser.add_argument("--time-params", type=float, default=None)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--iters", type=int, default=5)
  parser.add_argument(
    "--peak-gbps",
    type=float,
    default=None,
    help="peak memory bandwidth (default: by device kind)",
  )
  parser.add_argument("--out", default="benchmarks/results")
  parser.add_argument("--name", default="memory", help="output file stem")
  args = parser.parse_args(argv)
  cfg = dict(DRY if args.dry_run else FULL)
  sections = args.sections.split(",")
  unknown = set(sections) - set(SECTIONS)
  if unknown:
    parser.error(f"--sections: unknown {sorted(unknown)}; allowed {SECTIONS}")
  kind = jax.devices()[0].device_kind
  res: dict[str, Any] = {
    "meta": dict(
      device=f"{kind} ({platform.machine()}, {os.cpu_count()} cpus)",
      jax=jax.__version__,
      date=time.strftime("%Y-%m-%d"),
      command=command_lib.command("benchmarks.memory", argv),
      config={k: cfg[k] for k in ("vocab", "seq", "d", "batch", "ref_depth")},
      block_size=quantization.DEFAULT_BLOCK_SIZE,
    )
  }
  runners = {
    "state": lambda: state_section(cfg),
    "peak": lambda: peak_section(cfg),
    "capacity": lambda: capacity_section(
      cfg, res.get("peak") or peak_section(cfg)
    ),
    "codec": lambda: codec_section(cfg),
    "time": lambda: time_section(
      args.time_params or cfg["time_params"],
      args.rounds,
      args.iters,
      args.peak_gbps or PEAK_GBPS.get(kind),
    ),
  }
  for name in sections:
    res[name] = runners[name]()
  os.makedirs(args.out, exist_ok=True)
  stem = os.path.join(args.out, args.name)
  with open(stem + ".json", "w") as f:
    json.dump(res, f, indent=1)
  with open(stem + ".md", "w") as f:
    f.write(to_markdown(res) + "\n")
  print(f"wrote {stem}.json, {stem}.md")
  return res


if __name__ == "__main__":
  import sys  # pylint: disable=g-import-not-at-top

  main(sys.argv[1:])
