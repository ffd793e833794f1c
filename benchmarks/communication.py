"""Traffic of the data-parallel exchanges (mechanism 10), from compiled HLO.

Run ``python -m benchmarks.communication [--quick] [--out DIR]`` (it forces 8
CPU devices unless ``XLA_FLAGS`` already sets a device count). Writes
``DIR/communication.json``, ``DIR/communication.md`` and
``DIR/communication_resnet.png``, and prints the tables.

1. Bytes per step. ``grpo_optax.training.data_parallel_step`` on the ResNet
   example's parameters (ResNet-20 on 8x8 digits, 0.27M parameters in 62
   leaves), lowered and compiled for a mesh of W = 8 devices and for a 2x4
   mesh (dense within the 4 devices of a "node", sparse across the 2 nodes),
   for ``dense``, ``all_gather`` and ``shared_support`` at f in {1, 0.3, 0.1,
   0.01}. Per program: the result bytes of each collective kind
   (:func:`~grpo_optax.training.collective_bytes`), the bytes a device sends
   under ring algorithms (:func:`~grpo_optax.training.ring_traffic`, using
   each op's group size), the same traffic modelled from the parameter
   counts alone, and the ratio to the dense step beside the law
   ``all_gather / dense = W f`` (``f + 1/chunk`` for the shared support).

2. Convergence at equal steps. ``python -m examples.resnet_cifar10
   --data-parallel --exchange E --exchange-fraction f`` (in-process, same
   seed, default steps and optimizer) for each exchange: held-out accuracy
   and wall time.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS",
                                                                ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8"
                             ).strip()

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse
import json
import math
import platform
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from grpo_optax import training
from grpo_optax.training import distributed

FRACTIONS = (1.0, 0.3, 0.1, 0.01)
CHUNK = 64
COMMAND = "python -m benchmarks.communication"


# --------------------------------------------------------------------------
# 1. Bytes per step.


def resnet_loss(depth: int = 20):
  """``(loss_fn, params, batch)`` of the ResNet example on 8x8 digits.

  A pure loss of the parameters: BatchNorm normalises with the batch
  statistics (training mode); its running averages are updated on a copy and
  dropped (they do not change the gradients or the exchange).
  """
  from flax import nnx
  from examples.resnet_cifar10 import models

  model = models.ResNet(depth, 10, 1, rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss_fn(p, batch):
    images, labels = batch
    m = nnx.merge(graphdef, p, jax.tree.map(jnp.array, rest))
    logits = m(images, train=True)
    return optax.softmax_cross_entropy_with_integer_labels(logits,
                                                           labels).mean()

  batch = (jax.ShapeDtypeStruct((64, 8, 8, 1), jnp.float32),
           jax.ShapeDtypeStruct((64,), jnp.int32))
  return loss_fn, params, batch


def modelled_traffic(sizes: list[int], exchange: str, fraction: float,
                     groups: tuple[int, ...]) -> dict[str, float]:
  """Ring bytes per device from the parameter counts alone.

  ``groups`` = (W,) for a flat mesh, or (nodes, per_node) for the 2-D form
  (a dense all-reduce within each node, then the exchange across nodes).
  The scalar loss adds one 4-byte all-reduce over all devices.
  """
  ring_ar = lambda g, b: distributed.ring_send_bytes("all-reduce", b, g)
  ring_ag = lambda g, b: distributed.ring_send_bytes("all-gather", b, g)
  n = sum(sizes)
  total = math.prod(groups)
  out = {"intra": 0.0, "inter": 0.0}
  loss = ring_ar(total, 4)
  if exchange == "dense":
    out["inter"] = ring_ar(total, 4 * n)
    out["total"] = out["inter"] + loss
    return out
  across = groups[0]
  if len(groups) == 2:
    out["intra"] = ring_ar(groups[1], 4 * n)
  if exchange == "all_gather":
    k = sum(distributed.num_kept(s, fraction) for s in sizes)
    out["inter"] = ring_ag(across, across * k * (4 + 4))
  else:
    chunks = [distributed.num_chunks(s, CHUNK) for s in sizes]
    kept = sum(distributed.num_kept(m, fraction) *
               distributed.chunk_width(s, CHUNK) for m, s in zip(chunks, sizes))
    out["inter"] = ring_ar(across, 4 * sum(chunks)) + ring_ar(across,
                                                              4 * kept)
  out["total"] = out["intra"] + out["inter"] + loss
  return out


def measure_bytes(fractions=FRACTIONS, depth: int = 20) -> dict[str, Any]:
  """HLO and modelled bytes for every mesh, exchange and fraction."""
  loss_fn, params, batch = resnet_loss(depth)
  sizes = [x.size for x in jax.tree.leaves(params)]
  devices = np.array(jax.devices()[:8])
  meshes = {
      "W=8": (Mesh(devices, ("data",)), {"axis": "data"}, (8,)),
      "2x4": (Mesh(devices.reshape(2, 4), ("node", "local")),
              {"axis": "node", "dense_axis": "local"}, (2, 4)),
  }
  rows = []
  for mesh_name, (mesh, axes, groups) in meshes.items():
    configs = [("dense", None)] + [(e, f) for e in ("all_gather",
                                                    "shared_support")
                                   for f in fractions]
    dense_traffic = None
    for exchange, fraction in configs:
      tick = time.time()
      dp = training.data_parallel_step(
          loss_fn, optax.sgd(0.1), mesh, exchange=exchange,
          fraction=fraction or 1.0, chunk_size=CHUNK, **axes)
      state = dp.init(params)
      # Backend optimisation off: the collectives are fixed by the HLO
      # passes before code generation, which is what takes long on CPU.
      compiled = dp.lower(state, batch).compile(
          compiler_options={"xla_backend_optimization_level": 0})
      result = training.collective_bytes(compiled)
      ops = training.collective_ops(compiled)
      traffic = training.ring_traffic(compiled)
      by_group: dict[int, float] = {}
      for kind, size, group in ops:
        by_group[group] = by_group.get(group, 0.0) + (
            distributed.ring_send_bytes(kind, size, group))
      model = modelled_traffic(sizes, exchange, fraction or 1.0,
                               groups if exchange != "dense" else (8,))
      if exchange == "dense":
        dense_traffic = traffic["total"]
        dense_gradient = result["all-reduce"] - 4   # Less the loss.
      across = groups[0]
      law = None if fraction is None else (
          across * fraction if exchange == "all_gather"
          else fraction + 1 / CHUNK)
      across_ratio = None
      if len(groups) == 2 and exchange != "dense":
        across_ratio = by_group.get(across, 0.0) / (
            distributed.ring_send_bytes("all-reduce", dense_gradient, across))
      rows.append({
          "mesh": mesh_name, "exchange": exchange, "fraction": fraction,
          "hlo_result_bytes": result,
          "hlo_ops": [list(op) for op in ops],
          "hlo_ring_bytes": traffic["total"],
          "hlo_ring_bytes_by_group": {str(g): v for g, v in
                                      sorted(by_group.items())},
          "modelled_ring_bytes": model["total"],
          "ratio_to_dense": traffic["total"] / dense_traffic,
          "law_ratio": law,
          "across_ratio": across_ratio,
          "across_law": law if len(groups) == 2 else None,
          "compile_s": time.time() - tick,
      })
      r = rows[-1]
      print(f"{mesh_name} {exchange:>14} f={fraction}: "
            f"HLO ring bytes {r['hlo_ring_bytes']:,.0f} "
            f"(model {r['modelled_ring_bytes']:,.0f}), "
            f"x{r['ratio_to_dense']:.3f} dense"
            + (f", law {law:.3f}" if law is not None else ""), flush=True)
  return {"model": f"ResNet-{depth} (example), 8x8 digits",
          "num_params": sum(sizes), "num_leaves": len(sizes),
          "dense_bytes": 4 * sum(sizes),
          "dense_hlo_gradient_bytes": dense_gradient, "chunk_size": CHUNK,
          "rows": rows}


# --------------------------------------------------------------------------
# 2. Held-out quality of the examples at equal steps.

#: The exchanges compared on the examples: name -> flags after
#: ``--data-parallel`` (the examples' defaults otherwise).
CONFIGS = {
    "dense": ["--exchange", "dense"],
    # Replicated support: no collective but the payload; bf16 values; DGC's
    # sparsity warm-up (stage length set per example below).
    "shared_replicated_bf16_0.0035": [
        "--exchange", "shared_support", "--exchange-fraction", "0.0035",
        "--exchange-support", "replicated", "--exchange-values", "bfloat16"],
    "all_gather_compact_bf16_0.0005": [
        "--exchange", "all_gather", "--exchange-fraction", "0.0005",
        "--exchange-indices", "compact", "--exchange-values", "bfloat16"],
    "powersgd_r1": ["--exchange", "powersgd", "--exchange-rank", "1"],
}

#: Steps per warm-up stage (DGC: one epoch per stage of the four; here
#: about 3% of each example's default steps per stage).
WARMUP = {"resnet": 10, "bert": 20}

TASKS = {"resnet": "examples.resnet_cifar10", "bert": "examples.bert_mlm"}


def config_argv(task: str, name: str) -> list[str]:
  argv = list(CONFIGS[name])
  if "--exchange-fraction" in argv:
    argv += ["--exchange-warmup-steps", str(WARMUP[task])]
  return argv


def run_example(task: str, name: str, seed: int, extra_argv=()):
  """One run of an example: held-out metrics, step times, the command."""
  import importlib
  main_mod = importlib.import_module(TASKS[task] + ".main")
  train_mod = importlib.import_module(TASKS[task] + ".train")
  argv = ["--data-parallel", *config_argv(task, name), "--seed", str(seed),
          "--quiet", *extra_argv]
  tick = time.time()
  summary = train_mod.train_and_evaluate(main_mod.parse_args(argv))
  return {
      "task": task, "config": name, "seed": seed,
      "command": f"python -m {TASKS[task]} " + " ".join(
          a for a in argv if a != "--quiet"),
      "eval_loss": summary["eval_loss"],
      "eval_accuracy": summary.get("eval_accuracy"),
      "eval_history": summary["eval_history"],
      "train_loss_history": summary["train_loss_history"],
      "steps": summary["steps"], "optimizer": summary["optimizer"],
      "replicas": summary["data_parallel"]["replicas"],
      "wall_time_s": time.time() - tick,
  }


def run_queue(task: str, names: list[str], seeds: list[int], path: str,
              extra_argv=()) -> list[dict[str, Any]]:
  """Runs every (seed, config) not yet in ``path``, saving after each."""
  done = []
  if os.path.exists(path):
    with open(path) as f:
      done = json.load(f)
  have = {(r["config"], r["seed"]) for r in done}
  for seed in seeds:
    for name in names:
      if (name, seed) in have:
        continue
      try:
        row = run_example(task, name, seed, extra_argv)
      except Exception as e:  # pylint: disable=broad-except
        row = {"task": task, "config": name, "seed": seed, "error": repr(e)}
      done.append(row)
      with open(path, "w") as f:
        json.dump(done, f, indent=1)
      print(f"{task} {name} seed {seed}: "
            + (f"held-out loss {row['eval_loss']:.4f}" if "eval_loss" in row
               else row["error"]), flush=True)
  return done


# --------------------------------------------------------------------------
# Report.


def _fmt_f(f):
  return "—" if f is None else f"{f:g}"


def _fmt_ratio(x):
  return "—" if x is None else f"{x:.3f}"


def markdown(data: dict[str, Any]) -> str:
  b = data["bytes"]
  flat = [r for r in b["rows"] if r["mesh"] == "W=8"]
  two_d = [r for r in b["rows"] if r["mesh"] == "2x4"]
  lines = [
      "# Communication of the data-parallel exchanges",
      "",
      f"Generated by `{data['meta']['command']}` on {data['meta']['device']}"
      f" (jax {data['meta']['jax']}).",
      "",
      f"## Bytes per step: {b['model']}, {b['num_params']:,} parameters in "
      f"{b['num_leaves']} leaves (dense gradient {b['dense_bytes']:,} bytes)",
      "",
      "`HLO ... bytes`: the collectives' result sizes in the compiled "
      "program (`collective_bytes`); `ring bytes`: what one device sends "
      "under ring algorithms (all-reduce 2(g-1)/g, all-gather (g-1)/g of "
      "the result, g = the op's group size), from the HLO ops "
      "(`ring_traffic`) and modelled from the parameter counts; `law`: W f "
      f"for the all-gather, f + 1/{b['chunk_size']} for the shared support. "
      "The dense step's all-reduce carries "
      f"{b['dense_hlo_gradient_bytes']:,} gradient bytes, not "
      f"{b['dense_bytes']:,}: XLA merges gradients that are the same "
      "expression (the two BatchNorm biases summed into each projected "
      "residual), so the model overestimates the dense step slightly.",
      "",
      "### W = 8 (one sparse axis)",
      "",
      "| exchange | f | HLO all-reduce bytes | HLO all-gather bytes "
      "| ring bytes (HLO) | ring bytes (model) | x dense | law |",
      "|---|---|---|---|---|---|---|---|",
  ]
  for r in flat:
    lines.append(
        f"| {r['exchange']} | {_fmt_f(r['fraction'])} | "
        f"{r['hlo_result_bytes']['all-reduce']:,} | "
        f"{r['hlo_result_bytes']['all-gather']:,} | "
        f"{r['hlo_ring_bytes']:,.0f} | {r['modelled_ring_bytes']:,.0f} | "
        f"{r['ratio_to_dense']:.3f} | {_fmt_ratio(r['law_ratio'])} |")
  lines += [
      "",
      "### 2x4 mesh: dense within each node of 4, sparse across 2 nodes",
      "",
      "Per device: ring bytes within a node (groups of 4) and across nodes "
      "(groups of 2; the loss' 4-byte all-reduce spans all 8). `across x "
      "dense` compares the across-node bytes with a dense all-reduce of the "
      "gradient across the 2 nodes (what a hierarchical dense step sends "
      "there); its law is W_nodes f = 2 f. The dense row is the flat step "
      "(one all-reduce over all 8 devices).",
      "",
      "| exchange | f | over all 8 | within nodes | across nodes "
      "| across x dense | law | total ring bytes (HLO) | total (model) "
      "| total x flat dense |",
      "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in two_d:
    g = r["hlo_ring_bytes_by_group"]
    lines.append(
        f"| {r['exchange']} | {_fmt_f(r['fraction'])} | "
        f"{g.get('8', 0):,.0f} | {g.get('4', 0):,.0f} | "
        f"{g.get('2', 0):,.0f} | "
        f"{_fmt_ratio(r.get('across_ratio'))} | "
        f"{_fmt_ratio(r.get('across_law'))} | {r['hlo_ring_bytes']:,.0f} | "
        f"{r['modelled_ring_bytes']:,.0f} | {r['ratio_to_dense']:.3f} |")
  conv = data.get("convergence")
  if conv:
    lines += [
        "",
        f"## Convergence at equal steps: the ResNet example on "
        f"{conv[0]['replicas']} forced CPU devices",
        "",
        "Same seed, data order and optimizer (the example's default, "
        f"{conv[0]['optimizer']}); wall time on the shared 2-core machine "
        "includes compilation.",
        "",
        "| exchange | f | held-out accuracy | held-out loss | steps | "
        "wall time (s) | command |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in conv:
      lines.append(
          f"| {r['exchange']} | {_fmt_f(r['fraction'])} | "
          f"{r['eval_accuracy']:.4f} | {r['eval_loss']:.4f} | {r['steps']} | "
          f"{r['wall_time_s']:.1f} | `{r['command']}` |")
  return "\n".join(lines) + "\n"


def plot(conv: list[dict[str, Any]], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
  for r in conv:
    label = r["exchange"] + ("" if r["fraction"] is None
                             else f" f={r['fraction']:g}")
    steps, losses = zip(*r["train_loss_history"])
    ax1.plot(steps, losses, label=label, lw=1)
    ev = np.array(r["eval_history"])
    ax2.plot(ev[:, 0], ev[:, 2], marker="o", label=label)
  ax1.set(xlabel="step", ylabel="train loss", yscale="log")
  ax2.set(xlabel="step", ylabel="held-out accuracy")
  ax2.legend(fontsize=8)
  fig.suptitle("ResNet example, data-parallel on 8 devices")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="benchmarks/results")
  parser.add_argument("--quick", action="store_true",
                      help="ResNet-8 for the bytes; 60 steps of ResNet-8 for "
                      "convergence (smoke runs).")
  parser.add_argument("--skip-convergence", action="store_true")
  args = parser.parse_args(argv)
  if jax.device_count() < 8:
    raise SystemExit(f"needs 8 devices, found {jax.device_count()}; set "
                     "XLA_FLAGS=--xla_force_host_platform_device_count=8")
  tick = time.time()
  data: dict[str, Any] = {"meta": {
      "command": COMMAND + (" --quick" if args.quick else ""),
      "device": f"{jax.devices()[0].platform} x{jax.device_count()} "
                f"({platform.machine()}, {os.cpu_count()} cpus)",
      "jax": jax.__version__}}
  data["bytes"] = measure_bytes(depth=8 if args.quick else 20)
  if not args.skip_convergence:
    extra = (["--depth", "8", "--steps", "60", "--eval-every", "20"]
             if args.quick else [])
    data["convergence"] = measure_convergence(extra_argv=extra)
  data["meta"]["wall_time_s"] = time.time() - tick
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "communication.json"), "w") as f:
    json.dump(data, f, indent=1)
  text = markdown(data)
  with open(os.path.join(args.out, "communication.md"), "w") as f:
    f.write(text)
  if data.get("convergence"):
    plot(data["convergence"], os.path.join(args.out,
                                           "communication_resnet.png"))
  print(text)
  return data


if __name__ == "__main__":
  main()
