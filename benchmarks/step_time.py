"""Step time of optimizer update + apply, against optax and the memory roofline.

Measures the jitted ``update`` + ``apply_updates`` of each optimizer on a
transformer-like parameter tree, with params and optimizer state donated (the
update is in place, as in a real training step). All optimizers of one size
are timed in the same process, interleaved round-robin, so that the ratios
to Adam are robust to a noisy machine.

For each row: ``optimizer``, ``n_params``, ``median_ms``, ``ratio_to_adam``,
``bytes_per_step`` (the minimum a step must move: read the gradient, read and
write the params and every param-sized state array), ``bytes_per_param``,
``achieved_gbps`` (``bytes_per_step / median``) and ``roofline_fraction``
(against the bandwidth of a donated in-place ``x += s * y`` measured in the
same run).

Run: ``python -m benchmarks.step_time [--quick] [--out DIR] [--sizes 1e6,2e7]``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import grpo_optax
from benchmarks import command as command_lib


def transformer_tree(n_params: float, d_model: int | None = None):
  """A tree shaped like a transformer's params with about ``n_params`` entries.

  Per layer: fused qkv (d, 3d), out (d, d), mlp (d, 4d) and (4d, d), two norm
  scales and biases; plus an embedding (vocab, d) with vocab = 8d.
  """
  if d_model is None:
    d_model = 256 if n_params < 5e6 else 512 if n_params < 5e7 else 1024
  d = d_model
  per_layer = 12 * d * d + 9 * d
  embed = 8 * d * d
  n_layers = max(1, round((n_params - embed) / per_layer))
  shapes = {"embed": (8 * d, d)}
  for i in range(n_layers):
    shapes[f"layer_{i:02d}"] = {
      "qkv": (d, 3 * d),
      "qkv_bias": (3 * d,),
      "out": (d, d),
      "out_bias": (d,),
      "mlp_in": (d, 4 * d),
      "mlp_in_bias": (4 * d,),
      "mlp_out": (4 * d, d),
      "ln1": (d,),
      "ln2": (d,),
    }
  return jax.tree.map(
    lambda s: jax.ShapeDtypeStruct(s, jnp.float32),
    shapes,
    is_leaf=lambda x: isinstance(x, tuple),
  )


def optimizers(
  lr: float = 1e-3,
) -> dict[str, Callable[[], optax.GradientTransformation]]:
  g = grpo_optax
  return {
    "sgd_momentum": lambda: optax.sgd(lr, momentum=0.9),
    "adam": lambda: optax.adam(lr),
    "adamw": lambda: optax.adamw(lr),
    "nadam": lambda: optax.nadam(lr),
    # optax's own NAdam with global-norm clipping: what grpo()'s defaults
    # are without the mask.
    "clip_nadam": lambda: optax.chain(
      optax.clip_by_global_norm(1.0), optax.nadam(lr)
    ),
    "clip_with_l2": lambda: optax.chain(
      g.clip_with_l2(1.0, 1e-4), optax.sgd(lr)
    ),
    "scale_by_importance": lambda: optax.chain(
      g.scale_by_importance(), optax.sgd(lr)
    ),
    "top_k_mask_sampled": lambda: optax.chain(
      g.top_k_mask(method="sampled"), optax.sgd(lr)
    ),
    "ema_threshold_mask": lambda: optax.chain(
      g.ema_threshold_mask(), optax.sgd(lr)
    ),
    "scale_by_nesterov_adam_rms": lambda: optax.chain(
      g.scale_by_nesterov_adam_rms(), optax.scale(-lr)
    ),
    "scale_by_variance_lr": lambda: optax.chain(
      g.scale_by_variance_lr(), optax.sgd(lr)
    ),
    "freeze_below": lambda: optax.chain(g.freeze_below(), optax.sgd(lr)),
    # The preset with the library's defaults in each sparsify mode: the
    # fused core and the chain of the same rooms (fused=False).
    "grpo_dense": lambda: g.grpo(lr, sparsify=None),
    "grpo_threshold": lambda: g.grpo(lr, sparsify="threshold"),
    "grpo_topk": lambda: g.grpo(lr, sparsify="topk"),
    # Adam's moments in block-wise 8 bits (grpo_optax.quantization).
    "grpo_topk_int8": lambda: g.grpo(
      lr, sparsify="topk", mu_format="int8", nu_format="uint8"
    ),
    # The error-feedback accumulator stored compactly (accumulator_format).
    "grpo_topk_acc_bf16": lambda: g.grpo(
      lr, sparsify="topk", accumulator_format="bfloat16_sr"
    ),
    "grpo_threshold_acc_bf16": lambda: g.grpo(
      lr, sparsify="threshold", accumulator_format="bfloat16_sr"
    ),
    "grpo_topk_moments_bf16_sr": lambda: g.grpo(
      lr, mu_format="bfloat16_sr", nu_format="bfloat16_sr"
    ),
    "grpo_topk_acc_int8": lambda: g.grpo(
      lr, sparsify="topk", accumulator_format="int8_sr"
    ),
    "grpo_topk_8bit": lambda: g.grpo(
      lr,
      sparsify="topk",
      mu_format="int8",
      nu_format="uint8",
      accumulator_format="int8_sr",
    ),
    "grpo_dense_chain": lambda: g.grpo(lr, sparsify=None, fused=False),
    "grpo_threshold_chain": lambda: g.grpo(
      lr, sparsify="threshold", fused=False
    ),
    "grpo_topk_chain": lambda: g.grpo(lr, sparsify="topk", fused=False),
    # The articles' settings (importance weighting, the Adam/RMSProp mix,
    # the variance rate, every leaf masked), one-pass.
    "grpo_article_dense": lambda: g.grpo(
      lr, sparsify=None, **g.ARTICLE_DEFAULTS
    ),
    "grpo_article_topk": lambda: g.grpo(
      lr, sparsify="topk", **g.ARTICLE_DEFAULTS
    ),
  }


QUICK = (
  "sgd_momentum",
  "adam",
  "nadam",
  "clip_nadam",
  "grpo_dense",
  "grpo_threshold",
  "grpo_topk",
  "grpo_topk_int8",
  "grpo_topk_acc_bf16",
  "grpo_threshold_acc_bf16",
  "grpo_topk_acc_int8",
  "grpo_topk_8bit",
  "grpo_topk_moments_bf16_sr",
  "grpo_dense_chain",
  "grpo_threshold_chain",
  "grpo_topk_chain",
  "grpo_article_dense",
  "grpo_article_topk",
)
COMPILE = (
  "adam",
  "clip_nadam",
  "grpo_dense",
  "grpo_topk",
  "grpo_threshold",
  "grpo_article_topk",
)


def _param_sized_arrays(state, n_leaves_params: int, param_sizes: set) -> int:
  """Bytes of state arrays that have the size of some parameter leaf."""
  total = 0
  for x in jax.tree.leaves(state):
    if np.size(x) in param_sizes and np.size(x) > 1:
      total += np.size(x) * jnp.asarray(x).dtype.itemsize
  return total


def minimal_bytes(params, state) -> int:
  """Bytes a step must move: read grads, r/w params, r/w param-sized state."""
  p_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  sizes = {x.size for x in jax.tree.leaves(params)}
  s_bytes = _param_sized_arrays(state, len(jax.tree.leaves(params)), sizes)
  return p_bytes * 3 + 2 * s_bytes


def _make_step(tx):
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=(0, 1))


def copy_bandwidth(n: int, repeats: int = 10) -> float:
  """GB/s of a donated in-place ``x += s * y`` on ``n`` float32 (3 x 4n bytes)."""
  f = jax.jit(lambda x, y: x + 0.5 * y, donate_argnums=0)
  x = jnp.zeros((n,), jnp.float32)
  y = jnp.ones((n,), jnp.float32)
  x = f(x, y).block_until_ready()
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    x = f(x, y)
    x.block_until_ready()
    times.append(time.perf_counter() - t0)
  return 12 * n / statistics.median(times) / 1e9


def param_sized_arrays(params, state) -> int:
  """How many state arrays have the size of a (non-scalar) parameter leaf."""
  sizes = {x.size for x in jax.tree.leaves(params) if x.size > 1}
  return sum(1 for x in jax.tree.leaves(state) if np.size(x) in sizes) // max(
    1, len([x for x in jax.tree.leaves(params) if x.size > 1])
  )


def analyse(step, params, state, grads) -> dict:
  """XLA's temporaries and copies of the donated, compiled step."""
  compiled = step.lower(params, state, grads).compile()
  text = compiled.as_text()
  n = sum(x.size for x in jax.tree.leaves(params))
  big_copies = [b for b in grpo_optax.hlo.copy_bytes(text) if b >= 1 << 20]
  return dict(
    temp_bytes_per_param=round(
      compiled.memory_analysis().temp_size_in_bytes / n, 3
    ),
    big_copies=len(big_copies),
  )


def _setup(name, grads):
  tx = optimizers()[name]()
  params = jax.tree.map(lambda g: jnp.ones_like(g) * 0.02, grads)
  state = tx.init(params)
  nbytes = minimal_bytes(params, state)
  step = _make_step(tx)
  info = analyse(step, params, state, grads)
  info["state_arrays"] = param_sized_arrays(params, state)
  t0 = time.perf_counter()
  params, state = step(params, state, grads)
  jax.block_until_ready(params)
  return dict(
    step=step,
    params=params,
    state=state,
    times=[],
    bytes=nbytes,
    compile_s=time.perf_counter() - t0,
    **info,
  )


def _minor_faults() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _time_interleaved(runs, grads, rounds, iters):
  """Times each step; also counts the process's minor page faults during
  it. A step whose XLA temporaries exceed glibc's mmap threshold (32 MB at
  most) gets them from fresh pages every step, each page faulted in (and
  zeroed) on first touch: with 4 bytes per parameter of temporaries on 12.6M
  parameters that was 12,400 faults and about 28 ms a step.
  """
  for _ in range(rounds):  # round-robin: the machine's drift hits all alike
    for r in runs:
      for _ in range(iters):
        f0 = _minor_faults()
        t0 = time.perf_counter()
        r["params"], r["state"] = r["step"](r["params"], r["state"], grads)
        jax.block_until_ready(r["params"])
        r["times"].append(time.perf_counter() - t0)
        r.setdefault("faults", []).append(_minor_faults() - f0)


def bench_size(n_params: float, names, *, rounds: int, iters: int, seed=0):
  """Times every optimizer against Adam at one size.

  Each optimizer is timed in a pair with its own Adam run, interleaved round
  by round, and its ``ratio_to_adam`` is against that paired Adam: only two
  optimizers hold memory at a time (100M parameters fit in 24 GB), and the
  ratio is immune to the machine's drift between pairs. Adam's own row is the
  median over its pairs.
  """
  shapes = transformer_tree(n_params)
  n = sum(math.prod(s.shape) for s in jax.tree.leaves(shapes))
  key = jax.random.key(seed)
  keys = jax.random.split(key, len(jax.tree.leaves(shapes)))
  treedef = jax.tree.structure(shapes)
  grads = treedef.unflatten(
    [
      1e-2 * jax.random.normal(k, s.shape, s.dtype)
      for k, s in zip(keys, jax.tree.leaves(shapes))
    ]
  )
  bw = copy_bandwidth(n)
  results = {}
  adam_times, adam_info = [], None
  for name in [x for x in names if x != "adam"] or ["adam"]:
    adam = _setup("adam", grads)
    other = _setup(name, grads) if name != "adam" else None
    _time_interleaved([adam] + ([other] if other else []), grads, rounds, iters)
    adam_ms = statistics.median(adam["times"]) * 1e3
    adam_times.extend(adam["times"])
    adam_info = adam
    if other:
      ms = statistics.median(other["times"]) * 1e3
      results[name] = (ms, ms / adam_ms, other)
    del adam["params"], adam["state"]
    if other:
      del other["params"], other["state"]
  adam_ms = statistics.median(adam_times) * 1e3
  results["adam"] = (adam_ms, 1.0, dict(adam_info, times=adam_times))
  rows = []
  for name in names:
    ms, ratio, r = results[name]
    gbps = r["bytes"] / (ms / 1e3) / 1e9
    rows.append(
      dict(
        optimizer=name,
        n_params=int(n),
        median_ms=round(ms, 3),
        ratio_to_adam=round(ratio, 3),
        bytes_per_step=int(r["bytes"]),
        bytes_per_param=round(r["bytes"] / n, 2),
        achieved_gbps=round(gbps, 2),
        copy_gbps=round(bw, 2),
        roofline_fraction=round(gbps / bw, 3),
        compile_s=round(r["compile_s"], 2),
        temp_bytes_per_param=r["temp_bytes_per_param"],
        page_faults_per_step=int(statistics.median(r["faults"])),
        big_copies=r["big_copies"],
        state_arrays=r["state_arrays"],
        samples=len(r["times"]),
      )
    )
  return rows


def to_markdown(rows, meta) -> str:
  lines = [
    f"# Step time ({meta['device']}, {meta['date']})",
    "",
    f"Command: `{meta['command']}`",
    "",
    "| optimizer | params | median ms | x Adam | bytes/param | GB/s |"
    " roofline | param-sized state arrays | XLA temp bytes/param |"
    " page faults/step | copies >= 1 MB |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    lines.append(
      f"| {r['optimizer']} | {r['n_params'] / 1e6:.1f}M | {r['median_ms']:.2f}"
      f" | {r['ratio_to_adam']:.2f} | {r['bytes_per_param']:.0f}"
      f" | {r['achieved_gbps']:.1f} | {r['roofline_fraction']:.2f}"
      f" | {r.get('state_arrays', '')} | {r.get('temp_bytes_per_param', '')}"
      f" | {r.get('page_faults_per_step', '')} | {r.get('big_copies', '')} |"
    )
  return "\n".join(lines) + "\n"


def layered_tree(n_layers: int, d: int = 64):
  """16 leaves per layer (attention, MLP, norms and biases), d = 64."""
  layer = {
    "q": (d, d),
    "k": (d, d),
    "v": (d, d),
    "o": (d, d),
    "qb": (d,),
    "kb": (d,),
    "vb": (d,),
    "ob": (d,),
    "w1": (d, 4 * d),
    "b1": (4 * d,),
    "w2": (4 * d, d),
    "b2": (d,),
    "ln1_scale": (d,),
    "ln1_bias": (d,),
    "ln2_scale": (d,),
    "ln2_bias": (d,),
  }
  return {
    f"layer_{i:02d}": {
      k: jnp.full(s, 0.01, jnp.float32) for k, s in layer.items()
    }
    for i in range(n_layers)
  }


def _compile_once(name: str, params) -> tuple[float, float, dict]:
  """(wall s, CPU s, fused-computation counts) of one trace + lower +
  compile of ``name``'s donated update + apply, caches cleared first.
  """
  jax.clear_caches()
  tx = optimizers()[name]()
  state = tx.init(params)
  wall, cpu = time.perf_counter(), time.process_time()
  compiled = _make_step(tx).lower(params, state, params).compile()
  wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
  return wall, cpu, grpo_optax.hlo.fused_computations(compiled)


def _compile_in_subprocess(name: str, n_layers: int) -> tuple:
  """:func:`_compile_once` in a fresh Python process: a process that has
  compiled large programs compiles the next ones slower (its heap and the
  garbage collector's work grow), which would charge one optimizer for
  another's compile.
  """
  code = (
    "import json, sys; from benchmarks import step_time as s; "
    f"w, c, f = s._compile_once({name!r}, s.layered_tree({n_layers})); "
    "print('RESULT' + json.dumps([w, c, f]))"
  )
  out = subprocess.run(
    [sys.executable, "-c", code],
    capture_output=True,
    text=True,
    check=True,
    cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
  ).stdout
  wall, cpu, counts = json.loads(out.split("RESULT", 1)[1])
  return wall, cpu, counts


def compile_times(names, layers=(6, 24, 96), repeats=3) -> list[dict]:
  """Compile cost of the donated update + apply, per tree size.

  Every compile runs in a fresh process (:func:`_compile_in_subprocess`),
  in ``repeats`` rounds that compile every optimizer once in turn (Adam
  first), so that a slow stretch of the machine weighs on every optimizer
  of a round; the ratio to Adam is the median over rounds of the ratio
  within a round, in process CPU time (XLA's compile threads included),
  which a busy machine disturbs less than wall time. Also the number of
  fused computations in the compiled program, and of distinct ones (bodies
  compared after renaming: :func:`grpo_optax.hlo.fused_computations`), which
  is what XLA's compile time follows.
  """
  names = ["adam"] + [n for n in names if n != "adam"]
  rows = []
  for n_layers in layers:
    runs = {n: [] for n in names}
    for _ in range(repeats):
      for name in names:
        runs[name].append(_compile_in_subprocess(name, n_layers))
    for name in names:
      ratios = [
        r[1] / a[1] for r, a in zip(runs[name], runs["adam"], strict=True)
      ]
      counts = runs[name][0][2]
      rows.append(
        dict(
          optimizer=name,
          leaves=16 * n_layers,
          compile_s=round(statistics.median(r[0] for r in runs[name]), 2),
          compile_cpu_s=round(statistics.median(r[1] for r in runs[name]), 2),
          ratio_to_adam=round(statistics.median(ratios), 2),
          ratio_min=round(min(ratios), 2),
          ratio_max=round(max(ratios), 2),
          fusions=counts["fusions"],
          distinct_fusions=counts["distinct"],
        )
      )
      r = rows[-1]
      print(
        f"compile {name:>20s} {r['leaves']:5d} leaves "
        f"{r['compile_cpu_s']:7.2f} s CPU  x{r['ratio_to_adam']:.2f} adam "
        f"({r['ratio_min']:.2f}-{r['ratio_max']:.2f})  fused computations "
        f"{r['distinct_fusions']} distinct / {r['fusions']}",
        flush=True,
      )
  return rows


def compile_markdown(rows) -> str:
  leaves = sorted({r["leaves"] for r in rows})
  names = list(dict.fromkeys(r["optimizer"] for r in rows))
  cell = {(r["optimizer"], r["leaves"]): r for r in rows}
  lines = [
    "",
    "## Compile time of the update step (trace + lower + compile)",
    "",
    "CPU seconds (median of the rounds), the median over rounds of the ratio"
    " to optax.adam within a round (min-max), and the distinct / all fused"
    " computations of the compiled program.",
    "",
    "| optimizer | " + " | ".join(f"{n} leaves" for n in leaves) + " |",
    "|---|" + "---|" * len(leaves),
  ]
  for name in names:
    cells = []
    for n in leaves:
      r = cell.get((name, n))
      cells.append(
        ""
        if r is None
        else f"{r['compile_cpu_s']:.2f} s x{r['ratio_to_adam']:.2f}"
        f" ({r['ratio_min']:.2f}-{r['ratio_max']:.2f});"
        f" {r['distinct_fusions']} / {r['fusions']}"
      )
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def plot(rows, path):
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  fig, ax = plt.subplots(figsize=(6, 4))
  for name in sorted({r["optimizer"] for r in rows}):
    pts = sorted(
      (r["n_params"], r["median_ms"]) for r in rows if r["optimizer"] == name
    )
    if len(pts) > 1:
      ax.loglog(*zip(*pts), marker="o", label=name)
  ax.set_xlabel("parameters")
  ax.set_ylabel("median ms per update + apply")
  if ax.get_lines():
    ax.legend(fontsize=7)
  ax.grid(True, which="both", alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--quick",
    action="store_true",
    help="one 20M size, the preset modes and optax baselines",
  )
  parser.add_argument("--out", default="benchmarks/results")
  parser.add_argument(
    "--sizes",
    default=None,
    help="comma-separated parameter counts, e.g. 1e6,2e7; 'none': no"
    " step-time table (the compile-time table only)",
  )
  parser.add_argument(
    "--optimizers",
    default=None,
    help="comma-separated names (default: all, or the quick set)",
  )
  parser.add_argument("--rounds", type=int, default=None)
  parser.add_argument("--iters", type=int, default=None)
  parser.add_argument("--tag", default="", help="suffix of the output files")
  parser.add_argument(
    "--compile-layers",
    default="6,24,96",
    help="layers of the compile-time tree (16 leaves each);"
    " empty: no compile-time table",
  )
  parser.add_argument(
    "--compile-repeats",
    type=int,
    default=3,
    help="rounds of the compile-time table (median ratio over rounds)",
  )
  args = parser.parse_args(argv)

  if args.sizes == "none":  # the compile-time table only
    sizes = []
  elif args.sizes:
    sizes = [float(s) for s in args.sizes.split(",")]
  else:
    sizes = [2e7] if args.quick else [1e6, 1e7, 2e7, 5e7, 1e8]
  names = (
    args.optimizers.split(",")
    if args.optimizers
    else list(QUICK)
    if args.quick
    else list(optimizers())
  )
  unknown = set(names) - set(optimizers())
  if unknown:
    parser.error(
      f"--optimizers: unknown {sorted(unknown)}; "
      f"choose from {sorted(optimizers())}"
    )
  if "adam" not in names:
    names.insert(0, "adam")
  rounds = args.rounds or (5 if args.quick else 5)
  iters = args.iters or (4 if args.quick else 3)

  rows = []
  for size in sizes:
    size_rows = bench_size(size, names, rounds=rounds, iters=iters)
    for r in size_rows:
      print(
        f"{r['optimizer']:>28s} {r['n_params'] / 1e6:7.1f}M "
        f"{r['median_ms']:9.2f} ms  x{r['ratio_to_adam']:.2f} Adam  "
        f"{r['bytes_per_param']:5.0f} B/param  {r['achieved_gbps']:6.1f} GB/s "
        f"({r['roofline_fraction']:.2f} of copy {r['copy_gbps']:.1f}) "
        f"state {r['state_arrays']} temp {r['temp_bytes_per_param']} B/param "
        f"faults {r['page_faults_per_step']}/step "
        f"copies {r['big_copies']}",
        flush=True,
      )
    rows.extend(size_rows)

  compile_rows = []
  if args.compile_layers:
    layers = [int(x) for x in args.compile_layers.split(",")]
    compile_rows = compile_times(
      [n for n in COMPILE if n in names or n == "adam"],
      layers,
      repeats=args.compile_repeats,
    )

  meta = dict(
    device=f"{jax.devices()[0].device_kind} x{jax.device_count()}"
    f" ({platform.machine()}, {os.cpu_count()} cpus)",
    backend=jax.default_backend(),
    jax=jax.__version__,
    optax=optax.__version__,
    date=time.strftime("%Y-%m-%d"),
    command=command_lib.command("benchmarks.step_time", argv),
    rounds=rounds,
    iters=iters,
  )
  os.makedirs(args.out, exist_ok=True)
  stem = os.path.join(
    args.out, "step_time" + (f"_{args.tag}" if args.tag else "")
  )
  with open(stem + ".json", "w") as f:
    json.dump(
      {"meta": meta, "rows": rows, "compile": compile_rows}, f, indent=1
    )
  with open(stem + ".md", "w") as f:
    f.write(to_markdown(rows, meta))
    if compile_rows:
      f.write(compile_markdown(compile_rows))
  if rows:
    plot(rows, stem + ".png")
  print(f"wrote {stem}.json, {stem}.md")
  return rows


if __name__ == "__main__":
  import sys  # pylint: disable=g-import-not-at-top

  main(sys.argv[1:])
