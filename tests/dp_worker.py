"""A small data-parallel run, shared by the tests and the 2-process check.

``python tests/dp_worker.py --out FILE --exchange E`` with the distributed
flags of ``examples.launch_multiprocess`` trains :func:`mlp_loss` for
:data:`STEPS` steps (``--steps``) on a mesh of every device of every process and writes the
final parameters (process 0) to ``FILE`` (``.npz``).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

STEPS = 3
GLOBAL_BATCH = 16


def init_params(seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  return {
    "w1": (rng.normal(size=(6, 32)) / 3).astype(np.float32),
    "b1": np.zeros(32, np.float32),
    "w2": (rng.normal(size=(32, 3)) / 6).astype(np.float32),
  }


def batches(
  seed: int = 1, steps: int = STEPS
) -> list[tuple[np.ndarray, np.ndarray]]:
  rng = np.random.default_rng(seed)
  return [
    (
      rng.normal(size=(GLOBAL_BATCH, 6)).astype(np.float32),
      rng.normal(size=(GLOBAL_BATCH, 3)).astype(np.float32),
    )
    for _ in range(steps)
  ]


def mlp_loss(params, batch):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  x, y = batch
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  return jnp.mean((h @ params["w2"] - y) ** 2)


def train(
  mesh, exchange: str, fraction: float = 0.3, steps: int = STEPS, **options
):
  """Final params (as NumPy) of ``steps`` steps of Adam with ``exchange``
  and the exchange's ``options`` (``sparse_pmean`` keywords).
  """
  import jax  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  from grpo_optax import training  # pylint: disable=g-import-not-at-top

  dp = training.data_parallel_step(
    mlp_loss,
    optax.adam(1e-2),
    mesh,
    exchange=exchange,
    fraction=fraction,
    **options,
  )
  state = dp.init(init_params())
  for batch in batches(steps=steps):
    state, _ = dp.step(state, batch)
  return {
    k: np.asarray(v.addressable_data(0))
    for k, v in jax.tree.map(lambda x: x, state.params).items()
  }


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", required=True)
  parser.add_argument("--exchange", default="all_gather")
  parser.add_argument("--fraction", type=float, default=0.3)
  parser.add_argument("--steps", type=int, default=STEPS)
  parser.add_argument(
    "--options", default="{}", help="The exchange's options as JSON."
  )
  parser.add_argument("--coordinator-address", required=True)
  parser.add_argument("--num-processes", type=int, required=True)
  parser.add_argument("--process-id", type=int, required=True)
  args = parser.parse_args(argv)
  import jax  # pylint: disable=g-import-not-at-top

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_default_matmul_precision", "highest")
  jax.distributed.initialize(
    args.coordinator_address,
    num_processes=args.num_processes,
    process_id=args.process_id,
  )
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  params = train(
    mesh,
    args.exchange,
    args.fraction,
    args.steps,
    **json.loads(args.options),
  )
  if jax.process_index() == 0:
    np.savez(args.out, **params)
  print(
    f"process {jax.process_index()} of {jax.process_count()}: "
    f"{jax.device_count()} devices, done"
  )
  jax.distributed.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
