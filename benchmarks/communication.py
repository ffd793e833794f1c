"""Traffic and quality of the data-parallel exchanges (mechanism 10).

Run ``python -m benchmarks.communication [--quick] [--out DIR] [--runs DIR]``
(it forces 8 CPU devices unless ``XLA_FLAGS`` already sets a device count).
Writes ``DIR/communication.json`` and ``DIR/communication.md`` and prints the
tables.

1. Bytes per step. ``grpo_optax.training.data_parallel_step`` on the ResNet
   example's parameters (ResNet-20 on 8x8 digits, 0.27M parameters) and on
   the BERT example's (the default 2-layer encoder), lowered and compiled for
   a mesh of W = 8 devices and for a 2x4 mesh (dense within the 4 devices of
   a "node", the exchange across the 2 nodes), for every exchange, payload
   format and density of :data:`GRID`. Per program: the collectives' result
   bytes (:func:`~grpo_optax.training.collective_bytes`), the bytes a device
   sends under ring algorithms (:func:`~grpo_optax.training.ring_traffic`,
   each op with its group size), the same modelled from the payload layout
   alone (:func:`modelled_traffic`), and the ratio to the dense fp32 step.

2. Step compute time (ResNet, W = 8, the example's batch of 64) of each
   exchange in :data:`TIMED`, the configurations interleaved in one process,
   and from it and the bytes the link bandwidth below which each exchange
   beats the dense step (:func:`crossover`).

3. Held-out quality at equal steps: the examples run with
   ``--data-parallel`` and each exchange of :data:`CONFIGS` (the examples'
   defaults otherwise; ResNet 3 seeds), by :func:`run_queue`, which saves a
   JSON file after every run (``python -m benchmarks.communication --queue
   resnet --seeds 0 1 2 --runs DIR``); the report reads those files.
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
import functools
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

from benchmarks import command as command_lib
from grpo_optax import hlo
from grpo_optax import training
from grpo_optax.training import compression
from grpo_optax.training import exchange as exchange_lib

COMMAND = "python -m benchmarks.communication"

#: Exchanges whose bytes are measured: (label, data_parallel_step keywords).
GRID = (
  ("dense", dict(exchange="dense")),
  # The articles' 30% (claims row 14).
  ("all_gather fp32/int32 f=0.3", dict(exchange="all_gather", fraction=0.3)),
  (
    "shared_support norms fp32 f=0.3",
    dict(exchange="shared_support", fraction=0.3),
  ),
  ("all_gather fp32/int32 f=0.01", dict(exchange="all_gather", fraction=0.01)),
  (
    "all_gather fp32/int32 f=0.001",
    dict(exchange="all_gather", fraction=0.001),
  ),
  (
    "all_gather bf16/compact f=0.001",
    dict(
      exchange="all_gather",
      fraction=0.001,
      values="bfloat16",
      indices="compact",
    ),
  ),
  (
    "all_gather bf16/compact f=0.0005",
    dict(
      exchange="all_gather",
      fraction=0.0005,
      values="bfloat16",
      indices="compact",
    ),
  ),
  (
    "all_gather bf16/compact f=0.00028",
    dict(
      exchange="all_gather",
      fraction=0.00028,
      values="bfloat16",
      indices="compact",
    ),
  ),
  (
    "all_gather bf16/compact f=0.00045",
    dict(
      exchange="all_gather",
      fraction=0.00045,
      values="bfloat16",
      indices="compact",
    ),
  ),
  (
    "all_gather int8/compact f=0.0005",
    dict(
      exchange="all_gather", fraction=0.0005, values="int8", indices="compact"
    ),
  ),
  (
    "all_gather bf16/compact f=0.1 (bitmap)",
    dict(
      exchange="all_gather", fraction=0.1, values="bfloat16", indices="compact"
    ),
  ),
  (
    "shared_support norms fp32 f=0.01",
    dict(exchange="shared_support", fraction=0.01),
  ),
  (
    "shared_support replicated fp32 f=0.01",
    dict(exchange="shared_support", fraction=0.01, support="replicated"),
  ),
  (
    "shared_support replicated bf16 f=0.01",
    dict(
      exchange="shared_support",
      fraction=0.01,
      support="replicated",
      values="bfloat16",
    ),
  ),
  (
    "shared_support replicated bf16 f=0.0035",
    dict(
      exchange="shared_support",
      fraction=0.0035,
      support="replicated",
      values="bfloat16",
    ),
  ),
  (
    "shared_support replicated bf16 c=1 f=0.0038",
    dict(
      exchange="shared_support",
      fraction=0.0038,
      support="replicated",
      values="bfloat16",
      chunk_size=1,
    ),
  ),
  ("powersgd r=1", dict(exchange="powersgd", rank=1)),
  ("powersgd r=2", dict(exchange="powersgd", rank=2)),
  ("powersgd r=4", dict(exchange="powersgd", rank=4)),
  ("powersgd r=1 bf16", dict(exchange="powersgd", rank=1, values="bfloat16")),
)
#: The subset measured on the 2x4 mesh and on the BERT example.
SUBSET = (
  "dense",
  "all_gather fp32/int32 f=0.001",
  "all_gather bf16/compact f=0.0005",
  "shared_support norms fp32 f=0.01",
  "shared_support replicated bf16 f=0.0035",
  "shared_support replicated bf16 c=1 f=0.0038",
  "powersgd r=1",
)
#: The exchanges whose step compute time is measured.
TIMED = (
  "dense",
  "all_gather bf16/compact f=0.0005",
  "shared_support replicated bf16 f=0.0035",
  "shared_support replicated bf16 c=1 f=0.0038",
  "powersgd r=1",
)
#: The exchanges timed for the frontier's break-even table, per model.
FRONTIER_TIMED = {
  "resnet": (
    "dense",
    "all_gather bf16/compact f=0.00028",
    "all_gather bf16/compact f=0.0005",
    "shared_support replicated bf16 f=0.0035",
    "powersgd r=1",
    "powersgd r=2",
    "powersgd r=4",
  ),
  "bert": (
    "dense",
    "all_gather bf16/compact f=0.00028",
    "all_gather bf16/compact f=0.00045",
    "powersgd r=1",
    "powersgd r=2",
    "powersgd r=4",
  ),
}
#: Link bandwidths of the crossover table, Gbit/s.
LINKS = (10, 25, 100)
CHUNK = 64


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
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, labels
    ).mean()

  batch = (
    jax.ShapeDtypeStruct((64, 8, 8, 1), jnp.float32),
    jax.ShapeDtypeStruct((64,), jnp.int32),
  )
  return loss_fn, params, batch


def bert_loss():
  """``(loss_fn, params, batch)`` of the BERT example's default encoder.

  The vocabulary is the example's default tokenizer's (trained on the
  default corpus); the loss is the MLM cross-entropy at 8 fixed positions
  (the exchange's collectives depend only on the parameters' shapes).
  """
  from flax import nnx

  from examples.bert_mlm import input_pipeline
  from examples.bert_mlm import models

  data = input_pipeline.load(
    text_files=None, vocab_size=4096, seq_len=64, max_train=None, max_eval=None
  )
  config = models.BertConfig(vocab_size=data.vocab_size, max_len=64)
  model = models.BertMLM(config, rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss_fn(p, tokens):
    m = nnx.merge(graphdef, p, jax.tree.map(jnp.array, rest))
    positions = jnp.broadcast_to(jnp.arange(8), (tokens.shape[0], 8))
    logits, _ = m.apply_with_entropy(
      tokens, deterministic=True, positions=positions
    )
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, tokens[:, :8]
    ).mean()

  batch = jax.ShapeDtypeStruct((32, 64), jnp.int32)
  return loss_fn, params, batch


def payload_bytes(
  shapes: list[tuple[int, ...]], kw: dict[str, Any], across: int
) -> list[tuple[str, float]]:
  """The exchange's collectives ``(kind, result bytes)`` from the layout.

  ``across`` = replicas of the exchange. all_gather: ``across`` blocks of
  the packed payload; shared_support: ``K`` rows of ``chunk`` values (plus
  ``M`` chunk norms for ``"norms"``); PowerSGD: the ``P``'s with the 1-D
  leaves, then the ``Q``'s; dense: every entry in float32.
  """
  sizes = [math.prod(s) for s in shapes]
  ex, f = kw["exchange"], kw.get("fraction", 0.3)
  values = kw.get("values", "float32")
  if ex == "dense":
    return [("all-reduce", 4 * sum(sizes))]
  if ex == "all_gather":
    per = sum(
      compression.Layout(n, f, values, kw.get("indices", "int32")).nbytes
      for n in sizes
      if n
    )
    return [("all-gather", across * per)]

  def mean(count):  # compression.replica_mean of `count` values.
    if values == "float32":
      return [("all-reduce", 4 * count)]
    padded = 2 * (count + -count % across)
    return [("all-to-all", padded), ("all-gather", padded)]

  if ex == "shared_support":
    chunk = kw.get("chunk_size", CHUNK)
    rows = sum(compression.chunk_rows(sizes, chunk))
    out = mean(chunk * compression.num_kept(rows, f))
    if kw.get("support", "norms") == "norms":
      out.append(("all-reduce", 4 * rows))
    return out
  p = q = 0
  for s in shapes:
    dims = compression.powersgd_shape(s, kw.get("rank", 1))
    if dims is None:
      p += math.prod(s)
    else:
      p, q = p + dims[0] * dims[2], q + dims[1] * dims[2]
  return mean(p) + mean(q)


def modelled_traffic(shapes, kw, groups: tuple[int, ...]) -> float:
  """Ring bytes per device from the layout alone (+ the 4-byte loss).

  ``groups`` = (W,) for a flat mesh, or (nodes, per_node): a dense fp32
  all-reduce within each node, then the exchange across nodes.
  """
  ring = hlo.ring_send_bytes
  total = ring("all-reduce", 4, math.prod(groups))
  if kw["exchange"] == "dense":
    return total + ring(
      "all-reduce", 4 * sum(math.prod(s) for s in shapes), math.prod(groups)
    )
  if len(groups) == 2:
    total += ring(
      "all-reduce", 4 * sum(math.prod(s) for s in shapes), groups[1]
    )
  return total + sum(
    ring(kind, b, groups[0]) for kind, b in payload_bytes(shapes, kw, groups[0])
  )


def _meshes():
  devices = np.array(jax.devices()[:8])
  return {
    "W=8": (Mesh(devices, ("data",)), {"axis": "data"}, (8,)),
    "2x4": (
      Mesh(devices.reshape(2, 4), ("node", "local")),
      {"axis": "node", "dense_axis": "local"},
      (2, 4),
    ),
  }


def _compile(loss_fn, params, batch, mesh, axes, kw, backend_opt=False):
  dp = training.data_parallel_step(
    loss_fn, optax.sgd(0.1), mesh, **axes, **{"chunk_size": CHUNK, **kw}
  )
  state = dp.init(params)
  # The bytes are read off the program's HLO as JAX emits it (compiling
  # every configuration takes long on the shared CPU); the timed
  # configurations are compiled, and their compiled HLO is reported beside.
  lowered = dp.lower(state, batch)
  if not backend_opt:  # The HLO before XLA's passes: no compilation.
    return dp, state, lowered.compiler_ir("hlo").as_hlo_text()
  return dp, state, lowered.compile()


def measure_bytes(
  model: str, loss_fn, params, batch, labels, meshes
) -> list[dict[str, Any]]:
  """HLO and modelled bytes for every mesh and labelled exchange."""
  shapes = [tuple(x.shape) for x in jax.tree.leaves(params)]
  grid = dict(GRID)
  rows = []
  for mesh_name in meshes:
    mesh, axes, groups = _meshes()[mesh_name]
    dense_ring = None
    for label in labels:
      kw = grid[label]
      tick = time.time()
      # The dense baseline is the flat step (one all-reduce over all 8).
      use_mesh, use_axes = (
        (mesh, axes)
        if kw["exchange"] != "dense"
        else (_meshes()["W=8"][0], {"axis": "data"})
      )
      _, _, compiled = _compile(loss_fn, params, batch, use_mesh, use_axes, kw)
      ops = training.collective_ops(compiled)
      traffic = training.ring_traffic(compiled)["total"]
      by_group: dict[str, float] = {}
      for kind, size, group in ops:
        by_group[str(group)] = by_group.get(str(group), 0.0) + (
          hlo.ring_send_bytes(kind, size, group)
        )
      model_ring = modelled_traffic(
        shapes, kw, groups if kw["exchange"] != "dense" else (8,)
      )
      if kw["exchange"] == "dense":
        dense_ring = traffic
      across = groups[0]
      dense_across = hlo.ring_send_bytes(
        "all-reduce", 4 * sum(math.prod(s) for s in shapes), across
      )
      rows.append(
        {
          "model": model,
          "mesh": mesh_name,
          "label": label,
          "options": kw,
          "hlo_ops": [list(op) for op in ops],
          "hlo_ring_bytes": traffic,
          "modelled_ring_bytes": model_ring,
          "hlo_ring_bytes_by_group": by_group,
          "ratio_to_dense": traffic / dense_ring,
          "across_ratio": (
            None
            if len(groups) == 1 or kw["exchange"] == "dense"
            else by_group.get(str(across), 0.0) / dense_across
          ),
          "compile_s": time.time() - tick,
        }
      )
      r = rows[-1]
      print(
        f"{model} {mesh_name} {label}: ring bytes {traffic:,.0f} "
        f"(model {model_ring:,.0f}), x{r['ratio_to_dense']:.5f} dense"
        + (
          ""
          if r["across_ratio"] is None
          else f", across nodes x{r['across_ratio']:.5f}"
        ),
        flush=True,
      )
  return rows


# --------------------------------------------------------------------------
# 2. Step compute time and the bandwidth crossover.


def measure_step_time(
  loss_fn, params, labels=TIMED, rounds: int = 3, steps: int = 10, batch=None
):
  """Median seconds per compiled step (W = 8; ResNet: batch 64 of digits,
  or ``batch``: a ``ShapeDtypeStruct`` of token ids, filled at random), the
  configurations interleaved over ``rounds`` rounds of ``steps`` steps, and
  the ring bytes of each compiled step's HLO.
  """
  mesh, axes, _ = _meshes()["W=8"]
  rng = np.random.default_rng(0)
  if batch is None:
    batch = (
      rng.normal(size=(64, 8, 8, 1)).astype(np.float32),
      rng.integers(0, 10, size=64).astype(np.int32),
    )
  else:
    batch = rng.integers(0, 100, size=batch.shape).astype(batch.dtype)
  grid, progs, compiled_ring = dict(GRID), {}, {}
  for label in labels:
    dp = training.data_parallel_step(
      loss_fn,
      optax.sgd(0.01),
      mesh,
      **axes,
      **{"chunk_size": CHUNK, **grid[label]},
    )
    state = dp.init(jax.tree.map(np.asarray, params))
    state, loss = dp.step(state, batch)  # Compiles.
    loss.block_until_ready()
    progs[label] = [dp, state]
    compiled_ring[label] = training.ring_traffic(
      dp.lower(state, batch).compile()
    )["total"]
  times: dict[str, list[float]] = {label: [] for label in labels}
  for _ in range(rounds):
    for label in labels:
      dp, state = progs[label]
      for _ in range(steps):
        tick = time.perf_counter()
        state, loss = dp.step(state, batch)
        loss.block_until_ready()
        times[label].append(time.perf_counter() - tick)
      progs[label][1] = state
  return (
    {label: float(np.median(t)) for label, t in times.items()},
    compiled_ring,
  )


def crossover(
  dense_s: float, dense_bytes: float, ex_s: float, ex_bytes: float
) -> float | None:
  r"""Link bandwidth (bit/s) below which the exchange's step is faster.

  With a step time of compute + bytes / bandwidth (no overlap),
  :math:`t_e + 8 B_e / b < t_d + 8 B_d / b \iff b < 8 (B_d - B_e) / (t_e -
  t_d)` when the exchange computes longer (``t_e > t_d``); ``inf`` when it
  computes no longer (it wins at every bandwidth), None when it sends no
  fewer bytes and computes no less.
  """
  if ex_bytes >= dense_bytes and ex_s >= dense_s:
    return None
  if ex_s <= dense_s:
    return math.inf
  return 8 * (dense_bytes - ex_bytes) / (ex_s - dense_s)


# --------------------------------------------------------------------------
# 2. Held-out quality of the examples at equal steps.


def _compact_bf16_all_gather(fraction: str) -> list[str]:
  """Flags of DGC's per-replica top-k all-gather, bf16 values, compact
  indices, keeping ``fraction`` of each leaf's entries.
  """
  return [
    "--exchange",
    "all_gather",
    "--exchange-fraction",
    fraction,
    "--exchange-indices",
    "compact",
    "--exchange-values",
    "bfloat16",
  ]


#: The exchanges compared on the examples: name -> flags after
#: ``--data-parallel`` (the examples' defaults otherwise).
CONFIGS = {
  "dense": ["--exchange", "dense"],
  # Replicated support: no collective but the payload; bf16 values; DGC's
  # sparsity warm-up (stage length set per example below).
  "shared_replicated_bf16_0.0035": [
    "--exchange",
    "shared_support",
    "--exchange-fraction",
    "0.0035",
    "--exchange-support",
    "replicated",
    "--exchange-values",
    "bfloat16",
  ],
  # The same with chunks of one entry: each entry chosen by the replicated
  # estimate of its own accumulated residual.
  "shared_replicated_bf16_c1_0.0038": [
    "--exchange",
    "shared_support",
    "--exchange-fraction",
    "0.0038",
    "--exchange-support",
    "replicated",
    "--exchange-values",
    "bfloat16",
    "--exchange-chunk-size",
    "1",
  ],
  "all_gather_compact_bf16_0.0005": _compact_bf16_all_gather("0.0005"),
  "powersgd_r1": ["--exchange", "powersgd", "--exchange-rank", "1"],
  "powersgd_r2": ["--exchange", "powersgd", "--exchange-rank", "2"],
  "powersgd_r4": ["--exchange", "powersgd", "--exchange-rank", "4"],
  # DGC all-gather under 0.2% of the dense bytes (bf16 values, compact
  # indices; modelled: ResNet 0.193%, BERT 0.123%), with the default warm-up
  # stages and with stages 2.5x longer (WARMUP_SCALE).
  "all_gather_compact_bf16_0.00028": _compact_bf16_all_gather("0.00028"),
  "all_gather_compact_bf16_0.00028_long_warmup": _compact_bf16_all_gather(
    "0.00028"
  ),
  # BERT's 38 leaves allow more per leaf under 0.2%: 0.190% (ResNet's
  # 65 leaves: 0.26%).
  "all_gather_compact_bf16_0.00045_long_warmup": _compact_bf16_all_gather(
    "0.00045"
  ),
  # The same with no sparsity warm-up: under 0.2% of the bytes over the
  # whole run (the warm-up's dense early stages average 8% over the run).
  "all_gather_compact_bf16_0.00045_no_warmup": _compact_bf16_all_gather(
    "0.00045"
  ),
}

#: Local steps (DiLoCo, the examples' ``--local-steps``): name -> (H, the
#: outer exchange's flags, the ``local_steps.json`` program whose
#: HLO-measured bytes per round it sends, evaluation period). Evaluations
#: fall on outer steps: every 576 steps (a multiple of each H), or every 72
#: for the pair of claim 15 (steps to a target read off the held-out curve).
_DENSE_OUTER = "local_steps_step, dense float outer"
LOCAL = {
  f"local_h{h}_{outer}": (h, flags, program, 576)
  for h in (4, 16, 64)
  for outer, flags, program in (
    ("dense", ["--exchange", "dense"], _DENSE_OUTER),
    (
      "int8_shared_0.1",
      [
        "--exchange",
        "shared_support",
        "--exchange-fraction",
        "0.1",
        "--exchange-chunk-size",
        "512",
        "--outer-quantize",
        "int8",
      ],
      "local_steps_step, int8 shared_support f=0.1 chunk=512",
    ),
  )
}
#: Plain averaging as the outer step (outer lr 1, no momentum: local SGD /
#: FedAvg) instead of DiLoCo's Nesterov 0.7 / 0.9, which is tuned for
#: H = 500 steps on large local batches.
LOCAL["local_h4_dense_avg"] = (
  4,
  ["--exchange", "dense", "--outer-lr", "1.0", "--outer-momentum", "0.0"],
  _DENSE_OUTER,
  576,
)
LOCAL["local_h16_int8_shared_0.1_avg"] = (
  16,
  [
    *LOCAL["local_h16_int8_shared_0.1"][1],
    "--outer-lr",
    "1.0",
    "--outer-momentum",
    "0.0",
  ],
  LOCAL["local_h16_int8_shared_0.1"][2],
  576,
)
LOCAL["local_h64_int8_shared_0.1_avg"] = (
  64,
  [
    *LOCAL["local_h64_int8_shared_0.1"][1],
    "--outer-lr",
    "1.0",
    "--outer-momentum",
    "0.0",
  ],
  LOCAL["local_h64_int8_shared_0.1"][2],
  576,
)
#: Outer SGD at lr 2, no momentum. With W replicas on 1/W of the batch each,
#: a replica's Adam-like step is normalized by the second moment of its own
#: noisier gradient, so the mean of the replicas' steps is shorter than the
#: step on the mean gradient (H = 1 with averaging, 1,200 steps: 6.06 held-out
#: loss against dense's 4.94); an outer lr above 1 gives that length back.
for _h, _outer in (
  (4, "dense"),
  (16, "int8_shared_0.1"),
  (32, "dense"),
  (32, "int8_shared_0.1"),
  (64, "int8_shared_0.1"),
):
  _, _flags, _program, _ = LOCAL[f"local_h64_{_outer}"]
  LOCAL[f"local_h{_h}_{_outer}_olr2"] = (
    _h,
    [*_flags, "--outer-lr", "2.0", "--outer-momentum", "0.0"],
    _program,
    576,
  )
#: Claim 15 ("15% of the nodes lost keeps 92% efficiency"): H = 4, dense
#: outer exchange, each replica absent from each outer step with
#: probability 0.15 (seeded per round), against none absent. The first
#: pair (DiLoCo's outer Nesterov, 1,800 steps) sat on the local-steps
#: runs' unigram plateau, where steps-to-target is noise; CLAIM15 is the
#: outer-lr-2 pair, run to 3,600 steps, whose loss still falls at 75%.
CLAIM15_NESTEROV = ("local_h4_dense_e72", "local_h4_dense_absent_0.15")
LOCAL[CLAIM15_NESTEROV[0]] = (4, ["--exchange", "dense"], _DENSE_OUTER, 72)
LOCAL[CLAIM15_NESTEROV[1]] = (
  4,
  ["--exchange", "dense", "--outer-absent", "0.15"],
  _DENSE_OUTER,
  72,
)
CLAIM15 = ("local_h4_dense_olr2_e144", "local_h4_dense_olr2_absent_0.15")
LOCAL[CLAIM15[0]] = (4, LOCAL["local_h4_dense_olr2"][1], _DENSE_OUTER, 144)
LOCAL[CLAIM15[1]] = (
  4,
  [*LOCAL["local_h4_dense_olr2"][1], "--outer-absent", "0.15"],
  _DENSE_OUTER,
  144,
)
CONFIGS.update(
  {
    name: ["--local-steps", str(h), *flags, "--eval-every", str(every)]
    for name, (h, flags, _, every) in LOCAL.items()
  }
)

#: Steps per warm-up stage (DGC: one epoch per stage of the four; here
#: about 3% of each example's default steps per stage).
WARMUP = {"resnet": 10, "bert": 20}

#: Configs whose warm-up stages are longer than WARMUP's: DGC tunes the
#: warm-up to the run (its four stages then take a third of the ResNet run).
WARMUP_SCALE = {
  "all_gather_compact_bf16_0.00028_long_warmup": 2.5,
  "all_gather_compact_bf16_0.00045_long_warmup": 2.5,
  "all_gather_compact_bf16_0.00045_no_warmup": 0.0,
}

TASKS = {"resnet": "examples.resnet_cifar10", "bert": "examples.bert_mlm"}

#: The examples' default number of steps (their cosine schedules span the
#: run); WARMUP is set for these, and scales with ``--steps``.
DEFAULT_STEPS = {"resnet": 300, "bert": 600}

#: The GRID label (parts 1-2: bytes, step time) of each config's exchange.
GRID_OF = {
  "dense": "dense",
  "shared_replicated_bf16_0.0035": "shared_support replicated bf16 f=0.0035",
  "shared_replicated_bf16_c1_0.0038": (
    "shared_support replicated bf16 c=1 f=0.0038"
  ),
  "all_gather_compact_bf16_0.0005": "all_gather bf16/compact f=0.0005",
  "powersgd_r1": "powersgd r=1",
  "powersgd_r2": "powersgd r=2",
  "powersgd_r4": "powersgd r=4",
  "all_gather_compact_bf16_0.00028": "all_gather bf16/compact f=0.00028",
  "all_gather_compact_bf16_0.00028_long_warmup": (
    "all_gather bf16/compact f=0.00028"
  ),
  "all_gather_compact_bf16_0.00045_long_warmup": (
    "all_gather bf16/compact f=0.00045"
  ),
  "all_gather_compact_bf16_0.00045_no_warmup": (
    "all_gather bf16/compact f=0.00045"
  ),
}


@functools.cache
def _task_shapes(task: str) -> list[tuple[int, ...]]:
  _, params, _ = {"resnet": resnet_loss, "bert": bert_loss}[task]()
  return [x.shape for x in jax.tree.leaves(params)]


def local_round_ratios(path: str) -> dict[str, float]:
  """Ring bytes of one local-steps round over a dense step's, per outer
  program, from ``benchmarks.local_steps``' HLO measurement (BERT).
  """
  with open(path) as f:
    rows = json.load(f)["bytes"]["rows"]
  return {r["program"]: r["ratio_to_dense_dp"] * r["local_steps"] for r in rows}


LOCAL_BYTES = os.path.join(
  os.path.dirname(__file__), "results", "local_steps.json"
)


def bytes_ratio(task: str, name: str) -> float | None:
  """Ring bytes per device per step of a config over dense's, on the task's
  parameters (W = 8): modelled from the payload layout (equal to the HLO's
  in part 1's tables); for local steps, the HLO-measured bytes of a round
  (``benchmarks.local_steps``, BERT only) over its H inner steps.
  """
  if name in LOCAL:
    h, _, program, _ = LOCAL[name]
    if task != "bert" or not os.path.exists(LOCAL_BYTES):
      return None
    return local_round_ratios(LOCAL_BYTES)[program] / h
  return _modelled_ratio(task, dict(GRID)[GRID_OF[name]])


def _modelled_ratio(task: str, kw: dict[str, Any]) -> float:
  """Modelled ring bytes of exchange ``kw`` on the task (W = 8) over
  dense's.
  """
  return modelled_traffic(_task_shapes(task), kw, (8,)) / dense_ring_bytes(task)


def _has_warmup(name: str) -> bool:
  """Whether a config runs DGC's sparsity warm-up (a sparse exchange that
  is not a local-steps outer exchange).
  """
  return name not in LOCAL and "--exchange-fraction" in CONFIGS[name]


def run_bytes_ratio(task: str, name: str, steps: int) -> float | None:
  """Ring bytes per device per step over dense's, averaged over a run of
  ``steps``, the sparsity warm-up included.

  :func:`bytes_ratio` is the steady state (after the warm-up). During the
  warm-up, stage ``s`` sends the payload of
  :func:`~grpo_optax.training.exchange.warmup_fractions`' ``f_s`` for
  :func:`warmup_steps` steps; the rest of the run sends the final
  fraction's. Equal to :func:`bytes_ratio` for configs without a warm-up.
  """
  steady = bytes_ratio(task, name)
  if steady is None or not _has_warmup(name):
    return steady
  kw = dict(GRID)[GRID_OF[name]]
  per_stage = warmup_steps(task, name, steps)
  total, left = 0.0, steps
  for f in exchange_lib.warmup_fractions(kw["fraction"])[:-1]:
    n = min(per_stage, left)
    total += n * _modelled_ratio(task, {**kw, "fraction": f})
    left -= n
  return (total + left * steady) / steps


def warmup_steps(task: str, name: str, steps: int | None = None) -> int:
  """Steps per warm-up stage of a sparse config on ``task``: the same
  fraction of a run of ``steps`` (default: the example's) as of the
  example's default run.
  """
  scale = (steps or DEFAULT_STEPS[task]) / DEFAULT_STEPS[task]
  return round(WARMUP[task] * WARMUP_SCALE.get(name, 1.0) * scale)


def config_argv(task: str, name: str, steps: int | None = None) -> list[str]:
  argv = list(CONFIGS[name])
  if _has_warmup(name):
    argv += ["--exchange-warmup-steps", str(warmup_steps(task, name, steps))]
  if steps is not None:
    argv += ["--steps", str(steps)]
  return argv


def run_example(
  task: str, name: str, seed: int, extra_argv=(), steps: int | None = None
):
  """One run of an example: held-out metrics, step times, the command."""
  import importlib

  main_mod = importlib.import_module(TASKS[task] + ".main")
  train_mod = importlib.import_module(TASKS[task] + ".train")
  argv = [
    "--data-parallel",
    *config_argv(task, name, steps),
    "--seed",
    str(seed),
    "--quiet",
    *extra_argv,
  ]
  tick = time.time()
  summary = train_mod.train_and_evaluate(main_mod.parse_args(argv))
  return {
    "task": task,
    "config": name,
    "seed": seed,
    "command": command_lib.command(
      TASKS[task], [a for a in argv if a != "--quiet"]
    ),
    "eval_loss": summary["eval_loss"],
    "eval_accuracy": summary.get("eval_accuracy"),
    "eval_history": summary["eval_history"],
    "train_loss_history": summary["train_loss_history"],
    "steps": summary["steps"],
    "optimizer": summary["optimizer"],
    "replicas": summary["data_parallel"]["replicas"],
    "wall_time_s": time.time() - tick,
  }


def run_queue(
  task: str,
  names: list[str],
  seeds: list[int],
  path: str,
  extra_argv=(),
  steps: int | None = None,
) -> list[dict[str, Any]]:
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
        row = run_example(task, name, seed, extra_argv, steps)
      except Exception as e:  # pylint: disable=broad-except
        row = {"task": task, "config": name, "seed": seed, "error": repr(e)}
      done.append(row)
      with open(path, "w") as f:
        json.dump(done, f, indent=1)
      print(
        f"{task} {name} seed {seed}: "
        + (
          f"held-out loss {row['eval_loss']:.4f}"
          if "eval_loss" in row
          else row["error"]
        ),
        flush=True,
      )
  return done


# --------------------------------------------------------------------------
# Report.


def load_runs(runs_dir: str | None) -> dict[str, list[dict[str, Any]]]:
  """The runs of ``runs_dir/**/<task>*.json`` (several queues may run at
  once, each into its own file or folder).
  """
  import glob

  out = {}
  for task in TASKS:
    for path in (
      sorted(
        glob.glob(
          os.path.join(runs_dir or "", "**", f"{task}*.json"), recursive=True
        )
      )
      if runs_dir
      else []
    ):
      with open(path) as f:
        out.setdefault(task, []).extend(
          r for r in json.load(f) if "error" not in r
        )
  return out


def summarize_runs(runs: dict[str, list[dict[str, Any]]]) -> list[dict]:
  """Per task, run length and config: mean (and spread) of the held-out
  metric, against dense's at the same number of steps.
  """
  rows = []
  for task, all_items in runs.items():
    key = "eval_accuracy" if task == "resnet" else "eval_loss"
    for steps in sorted({r["steps"] for r in all_items}):
      items = [r for r in all_items if r["steps"] == steps]
      dense = [r[key] for r in items if r["config"] == "dense"]
      for name in CONFIGS:
        mine = [r for r in items if r["config"] == name]
        if not mine:
          continue
        vals = [r[key] for r in mine]
        row = {
          "task": task,
          "config": name,
          "metric": key,
          "seeds": sorted(r["seed"] for r in mine),
          "values": vals,
          "mean": float(np.mean(vals)),
          "spread": float(np.max(vals) - np.min(vals)),
          "x_dense_bytes": bytes_ratio(task, name),
          "x_dense_bytes_run": run_bytes_ratio(task, name, steps),
          "steps": steps,
          "command": mine[0]["command"],
          "wall_time_s": float(np.mean([r["wall_time_s"] for r in mine])),
        }
        if dense and name != "dense":
          d = float(np.mean(dense))
          row["vs_dense"] = (
            row["mean"] - d if task == "resnet" else row["mean"] / d - 1
          )
        rows.append(row)
  return rows


def measure_frontier_times() -> dict[str, dict[str, float]]:
  """Step compute seconds (W = 8, interleaved) of :data:`FRONTIER_TIMED`,
  per model: the break-even table's compute times.
  """
  out = {}
  for task, labels in FRONTIER_TIMED.items():
    loss_fn, params, batch = {"resnet": resnet_loss, "bert": bert_loss}[task]()
    times, _ = measure_step_time(
      loss_fn, params, labels, batch=None if task == "resnet" else batch
    )
    out[task] = times
  return out


def dense_ring_bytes(task: str) -> float:
  return modelled_traffic(_task_shapes(task), {"exchange": "dense"}, (8,))


def frontier_rows(quality: list[dict], times: dict | None) -> list[dict]:
  """The quality rows with each point's compute time over dense's and its
  break-even link bandwidth (:func:`crossover`, bit/s): measured step
  compute of its exchange (``times``), modelled bytes averaged over the run
  (:func:`run_bytes_ratio`: the sparsity warm-up included). A local-steps point
  computes an ordinary step between outer steps: its compute per step is
  taken as dense's (the outer step, once per H steps, is not timed).
  """
  rows = []
  for r in quality:
    row = dict(r)
    task_times = (times or {}).get(r["task"], {})
    dense_t = task_times.get("dense")
    ratio = r.get("x_dense_bytes_run", r.get("x_dense_bytes"))
    t = None
    if r["config"] in LOCAL:
      t = dense_t
    elif GRID_OF.get(r["config"]) in task_times:
      t = task_times[GRID_OF[r["config"]]]
    row["compute_ratio"] = None if t is None or not dense_t else t / dense_t
    row["break_even_bps"] = None
    if t is not None and dense_t and ratio is not None and ratio < 1:
      db = dense_ring_bytes(r["task"])
      row["break_even_bps"] = crossover(dense_t, db, t, ratio * db)
    rows.append(row)
  return rows


#: The seeds' 175B model on paper (assumptions of the table below it).
PAPER = {
  "params": 175e9,
  "replicas": 64,  # data-parallel replicas, each a model-parallel group
  "tokens_per_step": 3.2e6,  # GPT-3's batch
  "gpus_per_replica": 8,
  "gpu_flops": 312e12,  # bf16 dense peak of an A100
  "mfu": 0.4,
}


def paper_break_even(rows: list[dict]) -> list[dict]:
  """Per BERT frontier point: the break-even bandwidth at :data:`PAPER`'s
  scale, with the point's measured bytes ratio and compute ratio.
  """
  p = PAPER
  w = p["replicas"]
  dense_bytes = 2 * (w - 1) / w * 4 * p["params"]
  compute_s = (
    6
    * p["params"]
    * p["tokens_per_step"]
    / (w * p["gpus_per_replica"] * p["gpu_flops"] * p["mfu"])
  )
  out = []
  for r in rows:
    if r["task"] != "bert" or r["config"] == "dense":
      continue
    if r.get("compute_ratio") is None or r.get("x_dense_bytes") is None:
      continue
    t = compute_s * r["compute_ratio"]
    out.append(
      {
        "config": r["config"],
        "steps": r["steps"],
        "x_dense_bytes": r["x_dense_bytes"],
        "compute_ratio": r["compute_ratio"],
        "dense_bytes": dense_bytes,
        "compute_s": compute_s,
        "break_even_bps": crossover(
          compute_s, dense_bytes, t, r["x_dense_bytes"] * dense_bytes
        ),
      }
    )
  return out


def steps_to(history: list, target: float) -> float:
  """First step (linearly interpolated between evaluations) at which the
  held-out loss is at most ``target``; ``inf`` if never.
  """
  prev_step, prev = 0, None
  for step, loss, *_ in history:
    if loss <= target:
      if prev is None:
        return float(step)
      return prev_step + (step - prev_step) * (prev - target) / (prev - loss)
    prev_step, prev = step, loss
  return float("inf")


def claim15(runs: dict[str, list[dict]]) -> dict | None:
  """Claim 15 on BERT: per seed, efficiency = steps the no-fault run needs
  to reach its own held-out loss at 75% of its steps over the steps the run
  with absent replicas needs (the claims table's definition, per seed).
  """
  items = runs.get("bert", [])
  base = {
    (r["steps"], r["seed"]): r for r in items if r["config"] == CLAIM15[0]
  }
  faulty = {
    (r["steps"], r["seed"]): r for r in items if r["config"] == CLAIM15[1]
  }
  pairs = set(base) & set(faulty)
  if not pairs:
    return None
  steps = max(s for s, _ in pairs)  # The longest run of the pair.
  seeds = sorted(seed for s, seed in pairs if s == steps)
  base = {seed: base[steps, seed] for seed in seeds}
  faulty = {seed: faulty[steps, seed] for seed in seeds}
  rows = []
  for seed in seeds:
    hist = base[seed]["eval_history"]
    at = 0.75 * base[seed]["steps"]
    target = min((h for h in hist if h[0] <= at), key=lambda h: abs(h[0] - at))[
      1
    ]
    t0 = steps_to(hist, target)
    t1 = steps_to(faulty[seed]["eval_history"], target)
    rows.append(
      {
        "seed": seed,
        "target": target,
        "no_fault_steps": t0,
        "faulty_steps": t1,
        "efficiency": t0 / t1,
        "final_loss": base[seed]["eval_loss"],
        "final_loss_faulty": faulty[seed]["eval_loss"],
      }
    )
  eff = [r["efficiency"] for r in rows]
  return {
    "configs": list(CLAIM15),
    "steps": steps,
    "rows": rows,
    "efficiency_mean": float(np.mean(eff)),
    "efficiency_min": float(np.min(eff)),
    "command": faulty[seeds[0]]["command"],
  }


def _gbps(bps) -> str:
  if bps is None:
    return "—"
  return "inf" if math.isinf(bps) else f"{bps / 1e9:.3g}"


def frontier_markdown(data: dict[str, Any]) -> list[str]:
  rows = data.get("frontier") or []
  if not rows:
    return []
  lines = [
    "## The frontier: bytes against held-out quality, and break-even links",
    "",
    "Every run of the quality table, grouped by example and run length: "
    "bytes per device per step over dense's (local steps: per inner step) "
    "after the sparsity warm-up (`steady`) and averaged over the whole run, "
    "the warm-up's denser stages included (`run`), "
    "the held-out metric (mean over the seeds; spread = largest minus "
    "smallest), its distance to dense at the same steps, the step's "
    "compute time over dense's (measured on the 8 forced CPU devices, "
    "interleaved, `measure_frontier_times`; local steps: taken as dense's) "
    "and the link bandwidth below which the point's step (compute + the "
    "run's mean ring bytes / bandwidth, no overlap) is faster than dense's "
    "(`inf`: at any "
    "bandwidth; `—`: compute not measured).",
    "",
    "![The frontier](communication_frontier.png)",
    "",
    "| example | steps | exchange | x dense bytes (steady) | x dense bytes "
    "(run) | mean | spread | seeds | vs dense | x dense compute | "
    "break-even (Gbit/s) |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in sorted(
    rows,
    key=lambda r: (r["task"], r["steps"], -(r.get("x_dense_bytes") or 2)),
  ):
    vs = r.get("vs_dense")
    vs = (
      "—"
      if vs is None
      else f"{100 * vs:+.2f} pts"
      if r["task"] == "resnet"
      else f"{100 * vs:+.2f}%"
    )
    ratio = r.get("x_dense_bytes")
    run = r.get("x_dense_bytes_run")
    cr = r.get("compute_ratio")
    lines.append(
      f"| {r['task']} | {r['steps']} | {r['config']} | "
      + ("—" if ratio is None else f"{ratio:.5f}")
      + " | "
      + ("—" if run is None else f"{run:.5f}")
      + f" | {r['mean']:.4f} | {r['spread']:.4f} | {len(r['seeds'])} | {vs}"
      + " | "
      + ("—" if cr is None else f"{cr:.2f}")
      + f" | {_gbps(r.get('break_even_bps'))} |"
    )
  paper = data.get("paper") or []
  if paper:
    p = PAPER
    lines += [
      "",
      "### On paper: the seeds' 175B-parameter model",
      "",
      f"Assumptions: {p['params']:.3g} parameters, fp32 gradients, "
      f"{p['replicas']} data-parallel replicas (each a model-parallel "
      f"group of {p['gpus_per_replica']} GPUs at "
      f"{p['gpu_flops'] / 1e12:.0f} TFLOP/s and {p['mfu']:.0%} utilisation), "
      f"{p['tokens_per_step']:.3g} tokens per step, 6 FLOPs per parameter "
      "and token: "
      f"{paper[0]['compute_s']:.1f} s of compute and "
      f"{paper[0]['dense_bytes'] / 1e12:.2f} TB of dense ring bytes per "
      "device per step. Each point keeps its bytes ratio after the warm-up "
      "(the `steady` column: a warm-up as long a share of the run as here "
      "would add what the `run` column adds) and its compute ratio "
      "as measured on the BERT example (the CPU's compute ratio overstates "
      "a GPU's, where the compression is a smaller share of the step).",
      "",
      "| exchange | steps | x dense bytes | x dense compute | "
      "break-even (Gbit/s) |",
      "|---|---|---|---|---|",
    ]
    for r in paper:
      lines.append(
        f"| {r['config']} | {r['steps']} | {r['x_dense_bytes']:.5f} | "
        f"{r['compute_ratio']:.2f} | {_gbps(r['break_even_bps'])} |"
      )
  c15 = data.get("claim15")
  if c15:
    lines += [
      "",
      "### Claim 15 on the BERT example",
      "",
      f"Local steps (H = 4, dense outer exchange, outer SGD at lr 2, {c15['steps']} steps), each replica absent from "
      "each outer step with probability 0.15 (its round's work dropped), "
      "against none absent, same seed. Efficiency: steps the no-fault run "
      "needs to reach its own held-out loss at 75% of its steps, over the "
      f"steps the faulty run needs. Command: `{c15['command']}`.",
      "",
      "| seed | target loss | no-fault steps | faulty steps | efficiency | "
      "final loss (no fault) | final loss (15% absent) |",
      "|---|---|---|---|---|---|---|",
    ]
    for r in c15["rows"]:
      lines.append(
        f"| {r['seed']} | {r['target']:.4f} | {r['no_fault_steps']:.0f} | "
        f"{r['faulty_steps']:.0f} | {r['efficiency']:.1%} | "
        f"{r['final_loss']:.4f} | {r['final_loss_faulty']:.4f} |"
      )
    lines.append(
      f"\nEfficiency mean {c15['efficiency_mean']:.1%}, min "
      f"{c15['efficiency_min']:.1%} (claim: 92%)."
    )
  return lines + [""]


def plot_frontier(rows: list[dict], path: str) -> str | None:
  """Bytes ratio (log) against the held-out metric, one panel per example
  and run length; bars from the smallest to the largest seed.
  """
  groups = sorted({(r["task"], r["steps"]) for r in rows})
  groups = [
    g
    for g in groups
    if sum(1 for r in rows if (r["task"], r["steps"]) == g) > 1
  ]
  if not groups:
    return None
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, axes = plt.subplots(
    1, len(groups), figsize=(5.5 * len(groups), 4.2), squeeze=False
  )
  colors = {
    "dense": "k",
    "all_gather": "tab:blue",
    "shared": "tab:orange",
    "powersgd": "tab:green",
    "local": "tab:red",
  }
  for ax, (task, steps) in zip(axes[0], groups):
    for r in rows:
      if (r["task"], r["steps"]) != (task, steps) or not r.get("x_dense_bytes"):
        continue
      family = next((k for k in colors if r["config"].startswith(k)), "dense")
      vals = r["values"]
      run = r.get("x_dense_bytes_run") or r["x_dense_bytes"]
      if run != r["x_dense_bytes"]:  # the warm-up's bytes: steady -> run
        ax.plot(
          [r["x_dense_bytes"], run],
          [r["mean"], r["mean"]],
          ":",
          color=colors[family],
          lw=0.8,
        )
        ax.plot(
          r["x_dense_bytes"],
          r["mean"],
          "o",
          mfc="none",
          color=colors[family],
        )
      ax.errorbar(
        run,
        r["mean"],
        yerr=[[r["mean"] - min(vals)], [max(vals) - r["mean"]]],
        fmt="o",
        color=colors[family],
        capsize=3,
      )
      ax.annotate(
        r["config"].replace("all_gather_compact_", "ag_"),
        (run, r["mean"]),
        fontsize=6,
        xytext=(3, 3),
        textcoords="offset points",
      )
    ax.set_xscale("log")
    ax.set_xlabel(
      "bytes per device per step / dense, over the run "
      "(hollow: after the warm-up)"
    )
    ax.set_ylabel(
      "held-out accuracy" if task == "resnet" else "held-out MLM loss"
    )
    ax.set_title(f"{task}, {steps} steps, 8 replicas")
    ax.grid(True, which="both", alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def _bytes_table(rows, with_across=False) -> list[str]:
  lines = [
    "| exchange | HLO collectives (kind, result bytes, group) | ring "
    "bytes/device (HLO) | ring bytes (model) | x dense fp32 |"
    + (" across nodes x dense |" if with_across else ""),
    "|---|---|---|---|---|" + ("---|" if with_across else ""),
  ]
  for r in rows:
    ops = "; ".join(f"{k} {b:,} ({g})" for k, b, g in r["hlo_ops"])
    if len(r["hlo_ops"]) > 6:  # The dense step: one all-reduce per leaf.
      ops = (
        f"{len(r['hlo_ops'])} all-reduces, "
        f"{sum(b for _, b, _ in r['hlo_ops']):,} bytes"
      )
    line = (
      f"| {r['label']} | {ops} | {r['hlo_ring_bytes']:,.0f} | "
      f"{r['modelled_ring_bytes']:,.0f} | {r['ratio_to_dense']:.5f} |"
    )
    if with_across:
      line += (
        "—" if r["across_ratio"] is None else f" {r['across_ratio']:.5f}"
      ) + " |"
    lines.append(line)
  return lines


def markdown(data: dict[str, Any]) -> str:
  meta = data["meta"]
  lines = [
    "# Communication of the data-parallel exchanges",
    "",
    f"Generated by `{meta['command']}` on {meta['device']} "
    f"(jax {meta['jax']})"
    + (
      f"; quality refreshed by `{meta['quality_command']}`"
      if meta.get("quality_command")
      else ""
    )
    + ".",
    "",
    "Ring bytes: what one device sends per step under ring algorithms "
    "(all-reduce 2(g-1)/g of the result, all-gather (g-1)/g, g = the op's "
    "group), read off the compiled step's HLO (`ring_traffic`) and "
    "modelled from the payload layout; `x dense fp32`: over the dense "
    "step's (one fp32 all-reduce of the gradient over all 8 devices, "
    "plus the 4-byte loss in both).",
    "",
  ]
  for model in data["bytes"]:
    b = data["bytes"][model]
    lines += [
      f"## {b['name']}: {b['num_params']:,} parameters in "
      f"{b['num_leaves']} leaves",
      "",
    ]
    for mesh in ("W=8", "2x4"):
      rows = [r for r in b["rows"] if r["mesh"] == mesh]
      if not rows:
        continue
      lines += (
        [
          f"### {mesh}"
          + (
            ": dense within each node of 4, the "
            "exchange across 2 nodes (across x dense: over a dense fp32 "
            "all-reduce across the 2 nodes)"
            if mesh == "2x4"
            else ""
          ),
          "",
        ]
        + _bytes_table(rows, mesh == "2x4")
        + [""]
      )
  st = data.get("step_time")
  if st:
    lines += [
      "## Step compute time and the bandwidth crossover (ResNet, W = 8)",
      "",
      "Median seconds per compiled step on the forced CPU devices (batch "
      "64, the configurations interleaved in one process; the devices "
      "share 2 cores, so the collectives cost no network time here). "
      "`crossover`: the link bandwidth below which the exchange's step "
      "(compute + ring bytes / bandwidth, no overlap) beats the dense "
      "step's (`inf`: it computes no longer, so it wins at any "
      "bandwidth). The last columns: modelled step time over dense's at "
      + ", ".join(f"{g} Gbit/s" for g in LINKS)
      + ".",
      "",
      "| exchange | step (s) | x dense compute | ring bytes (as emitted) | "
      "ring bytes (compiled) | crossover (Gbit/s) | "
      + " | ".join(f"{g} Gbit/s" for g in LINKS)
      + " |",
      "|---|---|---|---|---|---|" + "---|" * len(LINKS),
    ]
    for r in st["rows"]:
      cross = r["crossover_bps"]
      cross = (
        "—"
        if cross is None
        else "inf"
        if math.isinf(cross)
        else f"{cross / 1e9:.2f}"
      )
      lines.append(
        f"| {r['label']} | {r['step_s']:.4f} | {r['compute_ratio']:.2f} | "
        f"{r['ring_bytes']:,.0f} | {r['compiled_ring_bytes']:,.0f} | "
        f"{cross} | "
        + " | ".join(f"{x:.3f}" for x in r["time_ratio_at_links"])
        + " |"
      )
    lines.append("")
  quality = data.get("quality")
  if quality:
    lines += [
      "## Held-out quality at equal steps (8 forced CPU devices)",
      "",
      "The examples with `--data-parallel` and the exchange's flags, "
      "their defaults otherwise (optimizer grpo, ResNet 300 steps, BERT "
      "600). ResNet: held-out accuracy (mean over the seeds; `vs dense` "
      "in points x 100); BERT: held-out MLM loss (`vs dense` relative). "
      "`spread`: largest minus smallest value over the seeds; `x dense "
      "bytes`: ring bytes per device per step over the dense step's "
      "(modelled from the payload layout, W = 8), after the sparsity "
      "warm-up and (`run`) averaged over the run, the warm-up included.",
      "",
      "| example | steps | exchange | x dense bytes | x dense bytes (run) "
      "| seeds | values | mean | spread | vs dense | command |",
      "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in quality:
      vs = r.get("vs_dense")
      vs = (
        "—"
        if vs is None
        else (
          f"{100 * vs:+.2f} pts"
          if r["task"] == "resnet"
          else f"{100 * vs:+.2f}%"
        )
      )
      ratio = r.get("x_dense_bytes")
      run = r.get("x_dense_bytes_run")
      lines.append(
        f"| {r['task']} | {r['steps']} | {r['config']} | "
        + ("—" if ratio is None else f"{ratio:.5f}")
        + " | "
        + ("—" if run is None else f"{run:.5f}")
        + f" | {r['seeds']} | "
        + ", ".join(f"{v:.4f}" for v in r["values"])
        + f" | {r['mean']:.4f} | {r.get('spread', 0.0):.4f} | {vs} | "
        f"`{r['command']}` |"
      )
    lines.append("")
  lines += frontier_markdown(data)
  return "\n".join(lines) + "\n"


def measure_traffic(args) -> dict[str, Any]:
  """Parts 1 and 2: bytes of every exchange, step times, crossovers."""
  data: dict[str, Any] = {
    "meta": {
      "command": COMMAND
      + (" --quick" if args.quick else "")
      + (
        f" --runs {command_lib.portable_path(args.runs)}" if args.runs else ""
      ),
      "device": f"{jax.devices()[0].platform} x{jax.device_count()} "
      f"({platform.machine()}, {os.cpu_count()} cpus)",
      "jax": jax.__version__,
    },
    "bytes": {},
  }
  labels = SUBSET if args.quick else [label for label, _ in GRID]
  models = {
    "resnet": (
      f"ResNet-{8 if args.quick else 20} (example), 8x8 digits",
      resnet_loss(8 if args.quick else 20),
    )
  }
  if not args.quick:
    models["bert"] = ("BERT example (default encoder)", bert_loss())
  for key, (name, (loss_fn, params, batch)) in models.items():
    rows = measure_bytes(
      key,
      loss_fn,
      params,
      batch,
      labels if key == "resnet" else SUBSET,
      ("W=8", "2x4") if key == "resnet" else ("W=8",),
    )
    if key == "resnet" and not args.quick:  # 2x4: the subset only.
      rows = [r for r in rows if r["mesh"] == "W=8" or r["label"] in SUBSET]
    data["bytes"][key] = {
      "name": name,
      "rows": rows,
      "num_params": int(sum(x.size for x in jax.tree.leaves(params))),
      "num_leaves": len(jax.tree.leaves(params)),
    }
  loss_fn, params, _ = models["resnet"][1]
  times, compiled_ring = measure_step_time(loss_fn, params)
  ring = {
    r["label"]: r["hlo_ring_bytes"]
    for r in data["bytes"]["resnet"]["rows"]
    if r["mesh"] == "W=8"
  }
  st_rows = []
  for label, t in times.items():
    dt, db = times["dense"], ring["dense"]
    st_rows.append(
      {
        "label": label,
        "step_s": t,
        "compute_ratio": t / dt,
        "ring_bytes": ring[label],
        "compiled_ring_bytes": compiled_ring[label],
        "crossover_bps": crossover(dt, db, t, ring[label]),
        "time_ratio_at_links": [
          (t + 8 * ring[label] / (g * 1e9)) / (dt + 8 * db / (g * 1e9))
          for g in LINKS
        ],
      }
    )
  data["step_time"] = {"rows": st_rows, "links_gbps": list(LINKS)}
  return data


def main(argv=None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="benchmarks/results")
  parser.add_argument(
    "--quick",
    action="store_true",
    help="ResNet-8, the subset, no BERT (smoke run).",
  )
  parser.add_argument(
    "--runs",
    default=None,
    help="Directory of the run_queue JSON files "
    "(resnet.json, bert.json) to report.",
  )
  parser.add_argument(
    "--queue",
    choices=tuple(TASKS),
    default=None,
    help="Run the example runs of this task into --runs instead of the report.",
  )
  parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
  parser.add_argument("--seeds", nargs="+", type=int, default=[0])
  parser.add_argument(
    "--steps",
    type=int,
    default=None,
    help="With --queue: steps per run (default: the example's); the "
    "warm-up stages scale with it, the runs go to <task>_<steps>.json.",
  )
  parser.add_argument(
    "--frontier-times",
    action="store_true",
    help="Measure the step compute times of the frontier's break-even "
    "table (FRONTIER_TIMED; a quiet machine); with --reuse, the last "
    "measurement is kept otherwise.",
  )
  parser.add_argument(
    "--reuse",
    action="store_true",
    help="Keep the bytes and step times of --out's "
    "communication.json; refresh the quality from --runs.",
  )
  args = parser.parse_args(argv)
  if jax.device_count() < 8:
    raise SystemExit(
      f"needs 8 devices, found {jax.device_count()}; set "
      "XLA_FLAGS=--xla_force_host_platform_device_count=8"
    )
  if args.queue:
    os.makedirs(args.runs, exist_ok=True)
    return run_queue(
      args.queue,
      args.configs,
      args.seeds,
      os.path.join(
        args.runs,
        f"{args.queue}.json"
        if args.steps is None
        else f"{args.queue}_{args.steps}.json",
      ),
      steps=args.steps,
    )
  tick = time.time()
  path = os.path.join(args.out, "communication.json")
  if args.reuse and os.path.exists(path):  # Refresh the quality only.
    with open(path) as f:
      data = json.load(f)
    data["meta"]["quality_command"] = (
      f"{COMMAND} --reuse --out {command_lib.portable_path(args.out)} "
      f"--runs {command_lib.portable_path(args.runs)}"
    )
  else:
    data = measure_traffic(args)
  if args.frontier_times:
    data["frontier_times"] = measure_frontier_times()
    data["meta"]["frontier_times_command"] = (
      f"{COMMAND} --reuse --frontier-times --out "
      f"{command_lib.portable_path(args.out)}"
    )
  runs = load_runs(args.runs)
  data["quality"] = summarize_runs(runs)
  data["runs"] = runs
  data["frontier"] = frontier_rows(data["quality"], data.get("frontier_times"))
  data["paper"] = paper_break_even(data["frontier"])
  data["claim15"] = claim15(runs)
  data["meta"]["wall_time_s"] = time.time() - tick
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "communication.json"), "w") as f:
    json.dump(data, f, indent=1, default=lambda x: None)
  plot_frontier(
    data["frontier"], os.path.join(args.out, "communication_frontier.png")
  )
  text = markdown(data)
  with open(os.path.join(args.out, "communication.md"), "w") as f:
    f.write(text)
  print(text)
  return data


if __name__ == "__main__":
  main()
