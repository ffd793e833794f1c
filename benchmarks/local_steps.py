"""Local steps (DiLoCo): traffic per step, partial participation, quality.

Run ``python -m benchmarks.local_steps [--quick] [--out DIR]`` (it forces 8
CPU devices unless ``XLA_FLAGS`` already sets a device count); as 2
processes of 4 devices: ``python -m examples.launch_multiprocess
--num-processes 2 --devices-per-process 4 -- python -m
benchmarks.local_steps --parts bytes --out DIR/two_process``. Writes
``DIR/local_steps.json`` and ``DIR/local_steps.md`` and prints the tables.

1. Bytes per training step, from compiled HLO (ring model,
   :func:`grpo_optax.training.ring_traffic`), on the BERT example's
   parameters (1.46M in its default configuration): one step of
   :func:`~grpo_optax.training.data_parallel_step` (dense), against one
   round of :func:`~grpo_optax.training.local_steps_step` divided by its
   ``H`` inner steps, for the float dense outer exchange and for the int8
   shared-support one (:func:`~grpo_optax.training.exchange_mean`).

2. Partial participation. ``W = 8`` replicas train an MLP on scikit-learn's
   digits (inner Adam, ``H`` steps per round, outer Nesterov SGD 0.7/0.9);
   in each round every replica independently fails to report with
   probability ``p`` in {0, 0.15, 0.3} (its round's work is lost, it
   rejoins from the new outer parameters). Efficiency is a steps-to-target
   ratio: the target is the held-out loss the no-fault run reaches after
   75% of its rounds; efficiency = (rounds the no-fault run needs to reach
   it) / (rounds the faulty run needs), per mask seed, reported as mean and
   minimum over seeds. The held-out loss ratio at the end is reported too.

3. Quality at equal steps and tokens on the digits MLP: dense data
   parallelism against local steps with the float dense and the int8
   shared-support outer exchange (held-out loss ratio).

4. Quality at equal tokens (``--bert-dense``, ``--bert-local``): reads two
   ``metrics.json`` of the BERT example (same flags, batch and steps; one
   with ``--local-steps``) and reports their held-out losses.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get(
  "XLA_FLAGS", ""
):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
  ).strip()

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse
import json
import platform
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from grpo_optax import training

COMMAND = "python -m benchmarks.local_steps"
LOCAL_STEPS = 40
FRACTION = 0.1
CHUNK = 512
DROPOUTS = (0.0, 0.15, 0.3)


# --------------------------------------------------------------------------
# 1. Bytes per step.


def bert_loss(surrogate: bool = False):
  """``(loss_fn, params, batch)``: the BERT example's MLM loss, pure.

  With ``surrogate``, the same parameters with a quadratic loss (a batch of
  one scalar): the collectives of a step depend only on the parameter
  shapes, and this compiles in seconds on a loaded machine.
  """
  from flax import nnx

  from examples.bert_mlm import models

  config = models.BertConfig(vocab_size=4096)  # The example's defaults.
  model = models.BertMLM(config, rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  b, t, k = 32, 64, 10  # The example's batch, length, predictions.
  if surrogate:

    def quadratic(p, batch):
      return sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(p)) * (
        jnp.mean(batch)
      )

    return quadratic, params, jax.ShapeDtypeStruct((b,), jnp.float32)

  def loss_fn(p, batch):
    tokens, positions, targets = batch
    m = nnx.merge(graphdef, p, jax.tree.map(jnp.array, rest))
    logits, _ = m.apply_with_entropy(tokens, positions=positions)
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, targets
    ).mean()

  batch = (
    jax.ShapeDtypeStruct((b, t), jnp.int32),
    jax.ShapeDtypeStruct((b, k), jnp.int32),
    jax.ShapeDtypeStruct((b, k), jnp.int32),
  )
  return loss_fn, params, batch


def _stack(batch, h):
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct((h,) + x.shape, x.dtype), batch
  )


def measure_bytes(
  local_steps: int = LOCAL_STEPS, surrogate: bool = False
) -> dict[str, Any]:
  """Ring bytes per step: dense DP, local float, local int8 shared."""
  loss_fn, params, batch = bert_loss(surrogate)
  mesh = Mesh(np.array(jax.devices()), ("data",))
  w = mesh.size
  n = sum(x.size for x in jax.tree.leaves(params))
  rows = []
  dp = training.data_parallel_step(loss_fn, optax.adam(1e-3), mesh)
  state = dp.init(params)
  compiled = dp.lower(state, batch).compile()
  dense = training.ring_traffic(compiled)["total"]
  rows.append(
    {
      "program": "data_parallel_step, dense",
      "local_steps": 1,
      "ring_bytes_per_round": dense,
      "ring_bytes_per_step": dense,
      "collectives": training.collective_bytes(compiled),
    }
  )
  for name, kwargs in (
    ("local_steps_step, dense float outer", {}),
    (
      f"local_steps_step, int8 shared_support f={FRACTION} chunk={CHUNK}",
      {
        "exchange": "shared_support",
        "fraction": FRACTION,
        "chunk_size": CHUNK,
        "quantize": "int8",
      },
    ),
  ):
    ls = training.local_steps_step(
      loss_fn, optax.adam(1e-3), mesh, local_steps=local_steps, **kwargs
    )
    lstate = ls.init(params)
    compiled = ls.lower(
      lstate,
      _stack(batch, local_steps),
      jax.ShapeDtypeStruct((w,), jnp.float32),
    ).compile()
    total = training.ring_traffic(compiled)["total"]
    rows.append(
      {
        "program": name,
        "local_steps": local_steps,
        "ring_bytes_per_round": total,
        "ring_bytes_per_step": total / local_steps,
        "collectives": training.collective_bytes(compiled),
      }
    )
  for r in rows:
    r["ratio_to_dense_dp"] = r["ring_bytes_per_step"] / dense
  return {
    "num_params": n,
    "replicas": w,
    "processes": jax.process_count(),
    "loss": "quadratic surrogate" if surrogate else "BERT MLM",
    "dense_model_bytes": 2 * (w - 1) / w * 4 * n,
    "rows": rows,
  }


# --------------------------------------------------------------------------
# 2. Partial participation.


def _digits():
  from sklearn import datasets

  d = datasets.load_digits()
  x = (d.data / 16.0).astype(np.float32)
  y = d.target.astype(np.int32)
  order = np.random.default_rng(0).permutation(len(x))
  x, y = x[order], y[order]
  return (x[:1440], y[:1440]), (x[1440:], y[1440:])


def _mlp_init(seed=0):
  rng = np.random.default_rng(seed)
  return {
    "w1": (rng.normal(size=(64, 64)) / 8).astype(np.float32),
    "b1": np.zeros(64, np.float32),
    "w2": (rng.normal(size=(64, 10)) / 8).astype(np.float32),
    "b2": np.zeros(10, np.float32),
  }


def _mlp_loss(p, batch):
  x, y = batch
  logits = jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _rounds_to(curve: np.ndarray, target: float) -> float:
  """First round (linearly interpolated) at which ``curve <= target``."""
  below = np.nonzero(curve <= target)[0]
  if not len(below):
    return float("inf")
  i = below[0]
  if i == 0:
    return 1.0
  a, b = curve[i - 1], curve[i]
  return float(i + (a - target) / (a - b))  # curve[j] is after round j+1.


def measure_dropout(
  rounds: int = 40, local_steps: int = 10, seeds: int = 3, batch: int = 64
) -> dict[str, Any]:
  """Held-out curves with each replica missing a round with prob. p."""
  (xt, yt), (xe, ye) = _digits()
  mesh = Mesh(np.array(jax.devices()), ("data",))
  w = mesh.size
  ls = training.local_steps_step(
    _mlp_loss, optax.adam(3e-3), mesh, local_steps=local_steps
  )
  held_out = jax.jit(_mlp_loss)
  idx_rng = np.random.default_rng(1)
  order = [
    idx_rng.integers(0, len(xt), size=(local_steps, batch))
    for _ in range(rounds)
  ]
  curves: dict[str, list[list[float]]] = {}
  missing: dict[str, float] = {}
  start = time.time()
  for p in DROPOUTS:
    runs, absent = [], 0.0
    for seed in range(seeds if p else 1):
      mask_rng = np.random.default_rng(100 + seed)
      state = ls.init(_mlp_init())
      curve = []
      for r in range(rounds):
        mask = (mask_rng.random(w) >= p).astype(np.float32)
        absent += 1 - mask.mean()
        state, _ = ls.round(state, (xt[order[r]], yt[order[r]]), mask)
        params = jax.tree.map(
          lambda a: np.asarray(a.addressable_data(0)), state.params
        )
        curve.append(float(held_out(params, (xe, ye))))
      runs.append(curve)
    curves[str(p)] = runs
    missing[str(p)] = float(absent) / (rounds * len(runs))
  base = np.asarray(curves["0.0"][0])
  target = float(base[int(0.75 * rounds) - 1])
  t0 = _rounds_to(base, target)
  rows = []
  for p in DROPOUTS:
    eff = [t0 / _rounds_to(np.asarray(c), target) for c in curves[str(p)]]
    final = [base[-1] / c[-1] for c in curves[str(p)]]
    rows.append(
      {
        "dropout": p,
        "measured_missing": missing[str(p)],
        "efficiency_mean": float(np.mean(eff)),
        "efficiency_min": float(np.min(eff)),
        "final_loss_mean": float(np.mean([c[-1] for c in curves[str(p)]])),
        "final_loss_ratio_mean": float(np.mean(final)),
        "seeds": len(curves[str(p)]),
      }
    )
  return {
    "replicas": w,
    "rounds": rounds,
    "local_steps": local_steps,
    "batch": batch,
    "target_loss": target,
    "no_fault_rounds": t0,
    "rows": rows,
    "curves": curves,
    "wall_time_s": time.time() - start,
  }


def measure_mlp_quality(
  rounds: int = 40, local_steps: int = 10, batch: int = 64
) -> dict[str, Any]:
  """Held-out loss at equal steps and tokens: dense DP against local steps
  (float dense outer; int8 shared-support outer) on the digits MLP.
  """
  (xt, yt), (xe, ye) = _digits()
  mesh = Mesh(np.array(jax.devices()), ("data",))
  held_out = jax.jit(_mlp_loss)
  idx_rng = np.random.default_rng(1)
  order = [
    idx_rng.integers(0, len(xt), size=(local_steps, batch))
    for _ in range(rounds)
  ]
  local = lambda tree: jax.tree.map(
    lambda a: np.asarray(a.addressable_data(0)), tree
  )
  dp = training.data_parallel_step(_mlp_loss, optax.adam(3e-3), mesh)
  state = dp.init(_mlp_init())
  for r in range(rounds):
    for h in range(local_steps):
      state, _ = dp.step(state, (xt[order[r][h]], yt[order[r][h]]))
  out = {
    "steps": rounds * local_steps,
    "batch": batch,
    "rows": [
      {
        "run": "data_parallel_step dense",
        "held_out_loss": float(held_out(local(state.params), (xe, ye))),
      }
    ],
  }
  for name, kwargs in (
    ("local steps, dense float outer", {}),
    (
      "local steps, int8 shared_support f=0.1 chunk=64",
      {
        "exchange": "shared_support",
        "fraction": 0.1,
        "chunk_size": 64,
        "quantize": "int8",
      },
    ),
  ):
    ls = training.local_steps_step(
      _mlp_loss, optax.adam(3e-3), mesh, local_steps=local_steps, **kwargs
    )
    lstate = ls.init(_mlp_init())
    for r in range(rounds):
      lstate, _ = ls.round(lstate, (xt[order[r]], yt[order[r]]))
    out["rows"].append(
      {
        "run": name,
        "held_out_loss": float(held_out(local(lstate.params), (xe, ye))),
      }
    )
  dense = out["rows"][0]["held_out_loss"]
  for r in out["rows"]:
    r["ratio_to_dense_dp"] = r["held_out_loss"] / dense
  return out


# --------------------------------------------------------------------------
# 4. Quality of the example runs.


def read_quality(dense_path: str, local_path: str) -> dict[str, Any]:
  out = {}
  for name, path in (("dense", dense_path), ("local", local_path)):
    with open(path) as f:
      m = json.load(f)
    out[name] = {
      "path": path,
      "eval_loss": m["eval_loss"],
      "eval_masked_accuracy": m.get("eval_masked_accuracy"),
      "steps": m["steps"],
      "batch_size": m["batch_size"],
      "data_parallel": m["data_parallel"],
      "wall_time_s": m["wall_time_s"],
    }
  out["loss_ratio"] = out["local"]["eval_loss"] / out["dense"]["eval_loss"]
  return out


# --------------------------------------------------------------------------


def markdown(data: dict[str, Any]) -> str:
  lines = [f"# Local steps (`{data.get('command', COMMAND)}`)", ""]
  for b in (data.get("bytes"), data.get("bytes_two_process")):
    if not b:
      continue
    lines += [
      f"Bytes per training step, compiled HLO, ring model; BERT "
      f"example parameters ({b['num_params']:,}; loss: "
      f"{b.get('loss', 'BERT MLM')}), W = "
      f"{b['replicas']} devices in {b['processes']} process(es).",
      "",
      "| program | H | bytes/round | bytes/step | x dense DP |",
      "|---|---|---|---|---|",
    ]
    for r in b["rows"]:
      lines.append(
        f"| {r['program']} | {r['local_steps']} | "
        f"{r['ring_bytes_per_round']:,.0f} | "
        f"{r['ring_bytes_per_step']:,.0f} | "
        f"{100 * r['ratio_to_dense_dp']:.4f}% |"
      )
    lines.append("")
  d = data.get("dropout")
  if d:
    lines += [
      f"Partial participation: W = {d['replicas']}, H = "
      f"{d['local_steps']}, {d['rounds']} rounds; target = held-out "
      f"loss {d['target_loss']:.4f} (the no-fault run at 75% of its "
      f"rounds, reached after {d['no_fault_rounds']:.2f} rounds); "
      "efficiency = no-fault rounds to target / faulty rounds to "
      "target.",
      "",
      "| p(miss) | missing (measured) | efficiency mean | min | "
      "final loss | final loss ratio |",
      "|---|---|---|---|---|---|",
    ]
    for r in d["rows"]:
      lines.append(
        f"| {r['dropout']} | {100 * r['measured_missing']:.1f}% | "
        f"{100 * r['efficiency_mean']:.1f}% | "
        f"{100 * r['efficiency_min']:.1f}% | "
        f"{r['final_loss_mean']:.4f} | "
        f"{100 * r['final_loss_ratio_mean']:.1f}% |"
      )
    lines.append("")
  mq = data.get("mlp_quality")
  if mq:
    lines += [
      f"Digits MLP at equal steps and tokens ({mq['steps']} steps of "
      f"a global batch of {mq['batch']}, inner/DP Adam 3e-3):",
      "",
      "| run | held-out loss | x dense DP |",
      "|---|---|---|",
    ]
    for r in mq["rows"]:
      lines.append(
        f"| {r['run']} | {r['held_out_loss']:.4f} | "
        f"{r['ratio_to_dense_dp']:.4f} |"
      )
    lines.append("")
  q = data.get("quality")
  if q:
    lines += [
      "BERT example at equal tokens (same batch and steps):",
      "",
      "| run | held-out MLM loss | masked acc | wall s |",
      "|---|---|---|---|",
    ]
    for name in ("dense", "local"):
      r = q[name]
      lines.append(
        f"| {name} {r['data_parallel']} | {r['eval_loss']:.4f} | "
        f"{r['eval_masked_accuracy']:.4f} | "
        f"{r['wall_time_s']:.0f} |"
      )
    lines += ["", f"Loss ratio local / dense: {q['loss_ratio']:.4f}", ""]
  return "\n".join(lines)


def main(argv=None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="benchmarks/results")
  parser.add_argument(
    "--quick",
    action="store_true",
    help="Fewer rounds and seeds (a smoke test).",
  )
  parser.add_argument(
    "--parts",
    default="bytes,dropout,mlp_quality,quality",
    help="Comma-separated parts to measure; the others "
    "are kept from an existing DIR/local_steps.json.",
  )
  parser.add_argument(
    "--bert-dense",
    default=None,
    help="metrics.json of the dense data-parallel run.",
  )
  parser.add_argument(
    "--bert-local", default=None, help="metrics.json of the --local-steps run."
  )
  parser.add_argument(
    "--surrogate-loss",
    action="store_true",
    help="Bytes: the BERT parameters with a quadratic loss "
    "(same collectives, fast compile).",
  )
  parser.add_argument(
    "--include",
    action="append",
    default=[],
    metavar="KEY=PATH",
    help="Store the 'bytes' part of another "
    "local_steps.json (e.g. a 2-process run's) as KEY.",
  )
  parser.add_argument("--coordinator-address", default=None)
  parser.add_argument("--num-processes", type=int, default=1)
  parser.add_argument("--process-id", type=int, default=0)
  args = parser.parse_args(argv)
  if args.num_processes > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
      args.coordinator_address,
      num_processes=args.num_processes,
      process_id=args.process_id,
    )
  parts = set(args.parts.split(","))
  path = os.path.join(args.out, "local_steps.json")
  data: dict[str, Any] = {}
  if os.path.exists(path) and parts != {
    "bytes",
    "dropout",
    "mlp_quality",
    "quality",
  }:
    with open(path) as f:
      data = json.load(f)
  data.update(
    command=COMMAND + (" --quick" if args.quick else ""),
    platform=platform.platform(),
    devices=jax.device_count(),
  )
  if "bytes" in parts:
    data["bytes"] = measure_bytes(
      4 if args.quick else LOCAL_STEPS, surrogate=args.surrogate_loss
    )
  if "dropout" in parts:
    data["dropout"] = (
      measure_dropout(rounds=8, local_steps=2, seeds=2)
      if args.quick
      else measure_dropout()
    )
  if "mlp_quality" in parts:
    data["mlp_quality"] = (
      measure_mlp_quality(rounds=4, local_steps=2)
      if args.quick
      else measure_mlp_quality()
    )
  for item in args.include:
    key, other = item.split("=", 1)
    with open(other) as f:
      data[key] = json.load(f)["bytes"]
  if "quality" in parts and args.bert_dense and args.bert_local:
    data["quality"] = read_quality(args.bert_dense, args.bert_local)
  text = markdown(data)
  if jax.process_index() == 0:
    os.makedirs(args.out, exist_ok=True)
    with open(path, "w") as f:
      json.dump(data, f, indent=1)
    with open(os.path.join(args.out, "local_steps.md"), "w") as f:
      f.write(text + "\n")
    print(text)
  return data


if __name__ == "__main__":
  main()
