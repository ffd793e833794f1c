"""Collectives and temporaries of one optimizer update on sharded parameters.

On 8 forced CPU devices arranged as a 2x4 mesh ``("data", "model")``, the
parameters are laid out as a large model would lay them out: an embedding
sharded along its rows (FSDP over ``data``), a kernel sharded along its
columns, a tensor-parallel kernel sharded along both axes, a 3-D stack of
layers with its last axis sharded, and small replicated leaves (a vector and
a scalar). For each optimizer the update ``tx.update(grads, state, params)``
is compiled once (not run), for parameters and gradients laid out so and the
state ``tx.init(params)`` builds from them, and the compiled HLO is read:

* ``collective_bytes``: bytes each device sends per update under the ring
  model (:func:`grpo_optax.training.ring_traffic`), and the same as a
  fraction of the parameter bytes held by one device; ``result_bytes``: the
  collectives' result sizes summed
  (:func:`grpo_optax.training.collective_bytes`);
* ``all_gathers``: number of all-gather ops (a whole leaf gathered);
* ``temp_bytes``: ``compiled.memory_analysis().temp_size_in_bytes`` per
  device;
* ``error``: the exception, when the update does not trace or compile.

Each optimizer is measured on an ``Auto`` and an ``Explicit`` mesh
(``jax.sharding.AxisType``), under ``jax.set_mesh``.

Run (8 forced CPU devices are set here, before jax is imported)::

  python -m benchmarks.sharding            # 4.2M params
  python -m benchmarks.sharding --quick    # 0.72M params (the layout shrunk)

Writes ``benchmarks/results/sharding.{json,md}`` (``--out`` to change).
"""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " " + _FLAG
  ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse
import json
import math
import pathlib
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import grpo_optax
from grpo_optax import training

AXES = ("data", "model")
MESH_SHAPE = (2, 4)
AXIS_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}

# name -> (shape at full size, spec); the leading dimensions are divided by
# ``shrink`` in the quick layout (every sharded dimension stays divisible).
_LAYOUT = {
  "embed_rows": ((8192, 256), P("data", None)),  # FSDP over rows
  "kernel_cols": ((256, 4096), P(None, "model")),  # columns sharded
  "kernel_tp": ((1024, 512), P("data", "model")),  # tensor parallel
  "stacked": ((4, 256, 512), P(None, None, "model")),  # stacked layers
  "bias": ((512,), P()),  # small, replicated
  "scale": ((), P()),  # scalar, replicated
}

# The grpo modes of issue 19 (keywords of grpo_optax.grpo).
GRPO_MODES = {
  "grpo(sparsify=None)": dict(sparsify=None),
  "grpo()": {},
  "grpo(sparsify='threshold')": dict(sparsify="threshold"),
  "grpo(**ARTICLE_DEFAULTS)": dict(grpo_optax.ARTICLE_DEFAULTS),
  "grpo(freeze_threshold=0.3)": dict(
    freeze_threshold=0.3, freeze_warmup_steps=2
  ),
  "grpo(topk_method='exact')": dict(topk_method="exact"),
}


def optimizers(lr: float = 1e-3) -> dict[str, Callable[[], Any]]:
  """Name -> factory of every optimizer measured (baselines first)."""
  out = {
    "adam": lambda: optax.adam(lr),
    "clip_by_global_norm+nadam": lambda: optax.chain(
      optax.clip_by_global_norm(1.0), optax.nadam(lr)
    ),
  }
  for name, kw in GRPO_MODES.items():
    out[name] = lambda kw=kw: grpo_optax.grpo(lr, **kw)
  return out


def layout(quick: bool = False) -> dict[str, tuple[tuple[int, ...], P]]:
  """The parameter layout: name -> (shape, PartitionSpec)."""
  if not quick:
    return dict(_LAYOUT)
  shrink = {
    "embed_rows": (8, 1),
    "kernel_cols": (1, 4),
    "kernel_tp": (4, 2),
    "stacked": (1, 2, 2),
  }
  out = {}
  for name, (shape, spec) in _LAYOUT.items():
    s = shrink.get(name, (1,) * len(shape))
    out[name] = (tuple(d // k for d, k in zip(shape, s)), spec)
  return out


def make_mesh(
  axis_type: str = "auto", devices=None, shape: tuple[int, int] = MESH_SHAPE
) -> jax.sharding.Mesh:
  """A ``("data", "model")`` mesh whose axes are all of ``axis_type``."""
  t = AXIS_TYPES[axis_type]
  return jax.make_mesh(shape, AXES, axis_types=(t, t), devices=devices)


def make_params(mesh, lay) -> dict[str, jax.Array]:
  """float32 zeros of the layout, placed with their shardings."""
  return {
    k: jax.device_put(np.zeros(shape, np.float32), NamedSharding(mesh, spec))
    for k, (shape, spec) in lay.items()
  }


def param_bytes_per_device(params) -> int:
  """Bytes of parameters one device holds (its shard of every leaf)."""
  return sum(
    math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
    for x in jax.tree.leaves(params)
  )


def compile_update(tx, params) -> jax.stages.Compiled:
  """``tx.update(grads, state, params)`` compiled for laid-out inputs.

  The state is ``tx.init(params)`` run eagerly, as a training loop builds
  it (a jitted ``init`` without ``out_shardings`` would replicate the
  moments of Adam on an Auto mesh: zeros carry no sharding to propagate);
  the gradients are laid out as the params.
  """
  state = tx.init(params)
  return jax.jit(tx.update).lower(params, state, params).compile()


def measure(tx, params) -> dict[str, Any]:
  """Collectives and temporaries of one compiled update (or its error)."""
  start = time.perf_counter()
  try:
    compiled = compile_update(tx, params)
  except Exception as e:  # pylint: disable=broad-except
    return {
      "compiles": False,
      "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
    }
  ops = training.collective_ops(compiled)
  traffic = training.ring_traffic(compiled)
  per_device = param_bytes_per_device(params)
  return {
    "compiles": True,
    "collective_bytes": traffic["total"],
    "collective_fraction": traffic["total"] / per_device,
    "result_bytes": sum(size for _, size, _ in ops),
    "all_gathers": sum(1 for kind, _, _ in ops if kind == "all-gather"),
    "collectives": len(ops),
    "by_kind": {k: v for k, v in traffic.items() if k != "total" and v},
    "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
    "compile_s": time.perf_counter() - start,
  }


def run(quick: bool = False, names=None) -> dict[str, Any]:
  """Measures every optimizer on both mesh types."""
  lay = layout(quick)
  results: dict[str, Any] = {}
  facs = optimizers()
  for axis_type in AXIS_TYPES:
    mesh = make_mesh(axis_type)
    with jax.set_mesh(mesh):
      params = make_params(mesh, lay)
      for name, factory in facs.items():
        if names and name not in names:
          continue
        results.setdefault(name, {})[axis_type] = measure(factory(), params)
  params = make_params(make_mesh("auto"), lay)
  return {
    "jax": jax.__version__,
    "optax": optax.__version__,
    "devices": jax.device_count(),
    "mesh": dict(zip(AXES, MESH_SHAPE)),
    "layout": {
      k: {"shape": list(s), "spec": str(p)} for k, (s, p) in lay.items()
    },
    "num_params": sum(math.prod(s) for s, _ in lay.values()),
    "param_bytes_per_device": param_bytes_per_device(params),
    "results": results,
  }


def _cell(r: dict[str, Any]) -> list[str]:
  if not r["compiles"]:
    return ["fails", "-", "-", "-", "-"]
  return [
    f"{r['collective_bytes']:,.0f}",
    f"{r['result_bytes']:,}",
    f"{100 * r['collective_fraction']:.3f}%",
    str(r["all_gathers"]),
    f"{r['temp_bytes'] / 1e6:,.2f}",
  ]


def markdown(report: dict[str, Any], command: str) -> str:
  """The report as a Markdown table (one row per optimizer and mesh type)."""
  lines = [
    "# Collectives of one update on sharded parameters",
    "",
    f"`{command}` (jax {report['jax']}, optax {report['optax']}, "
    f"{report['devices']} forced CPU devices, mesh {report['mesh']}, "
    f"{report['num_params']:,} params, "
    f"{report['param_bytes_per_device']:,} parameter bytes per device).",
    "",
    "Collective B: bytes each device sends per update (ring model, from "
    "the compiled HLO); result B: the collectives' result sizes summed "
    "(`collective_bytes`); % params: collective B over the parameter bytes"
    " one device holds; temp MB: `memory_analysis().temp_size_in_bytes` "
    "(the update is not donated).",
    "",
    "| optimizer | mesh | collective B | result B | % params | all-gathers "
    "| temp MB |",
    "|---|---|---|---|---|---|---|",
  ]
  errors = []
  for name, by_mesh in report["results"].items():
    for axis_type, r in by_mesh.items():
      lines.append(
        "| " + " | ".join([f"`{name}`", axis_type] + _cell(r)) + " |"
      )
      if not r["compiles"]:
        errors.append(f"- `{name}`, {axis_type}: {r['error']}")
  if errors:
    lines += ["", "Errors:", ""] + errors
  return "\n".join(lines) + "\n"


def main(argv=None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--quick", action="store_true", help="the layout shrunk to 0.72M params"
  )
  parser.add_argument(
    "--out",
    default="benchmarks/results",
    help="directory of sharding.{json,md}",
  )
  parser.add_argument(
    "--name", default="sharding", help="file name stem of the results"
  )
  args = parser.parse_args(argv)
  report = run(quick=args.quick)
  command = (
    "python -m benchmarks.sharding"
    + (" --quick" if args.quick else "")
    + (f" --name {args.name}" if args.name != "sharding" else "")
  )
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / f"{args.name}.json").write_text(json.dumps(report, indent=1) + "\n")
  table = markdown(report, command)
  (out / f"{args.name}.md").write_text(table)
  print(table)
  return report


if __name__ == "__main__":
  main()
