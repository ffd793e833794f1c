"""KV-cached against uncached sampling of ``grpo_optax.rl.sample``, in one process.

A 4-layer NNX decoder (``examples.common.decoder``, hidden 128, 4 heads, FFN
512) samples ``--new-tokens`` tokens after ``--prompt-len``-token prompts for
a batch of ``--batch`` rows, once with the KV cache (prefill, then one
length-1 pass per token against a fixed cache in the scan carry) and once
without (``kv_cache=False``: the whole ``[B, P + N]`` buffer at every
position, the sampler before the cache). Both are jitted and compiled
first; the rounds interleave the two so that the machine's drift hits both
alike, and the tokens of the two are checked equal. Reports the median wall
time of a call and the ratio uncached / cached.

Run: ``python -m benchmarks.sampler [--rounds 5] [--new-tokens 32]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import jax
import numpy as np
from flax import nnx

from benchmarks import command as command_lib
from examples.common import decoder
from grpo_optax import rl


def bench(args) -> dict:
  config = decoder.DecoderConfig(
    vocab_size=args.vocab,
    max_length=args.prompt_len + args.new_tokens,
    hidden=args.hidden,
    num_layers=args.num_layers,
    num_heads=4,
    ffn=4 * args.hidden,
  )
  model = decoder.Decoder(config, rngs=nnx.Rngs(0))
  prompts = jax.numpy.asarray(
    np.random.default_rng(0).integers(
      0, args.vocab, (args.batch, args.prompt_len)
    ),
    jax.numpy.int32,
  )
  graphdef, state = nnx.split(model)
  fns = {}
  for name, kv in (("cached", True), ("uncached", False)):
    fns[name] = jax.jit(
      lambda state, step, kv=kv: (
        rl.sample(
          nnx.merge(graphdef, state),
          prompts,
          max_new_tokens=args.new_tokens,
          seed=0,
          step=step,
          kv_cache=kv,
        ).tokens
      )
    )
  compile_s, first = {}, {}
  for name, fn in fns.items():
    start = time.perf_counter()
    first[name] = np.asarray(fn(state, 0))
    compile_s[name] = time.perf_counter() - start
  tokens_equal = bool(np.array_equal(first["cached"], first["uncached"]))
  times = {name: [] for name in fns}
  for r in range(args.rounds):
    for name, fn in fns.items():
      start = time.perf_counter()
      fn(state, r + 1).block_until_ready()
      times[name].append(time.perf_counter() - start)
  median = {name: statistics.median(t) for name, t in times.items()}
  return dict(
    config=dict(vars(args)),
    num_params=int(
      sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    ),
    median_s=median,
    times_s=times,
    compile_and_first_s=compile_s,
    speedup=median["uncached"] / median["cached"],
    tokens_equal=tokens_equal,
  )


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--new-tokens", type=int, default=32)
  parser.add_argument("--prompt-len", type=int, default=16)
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--hidden", type=int, default=128)
  parser.add_argument("--num-layers", type=int, default=4)
  parser.add_argument("--vocab", type=int, default=256)
  parser.add_argument("--out", default="benchmarks/results")
  args = parser.parse_args(argv)
  out = args.out
  del args.out
  result = bench(args)
  meta = dict(
    device=f"{jax.devices()[0].device_kind} ({platform.machine()},"
    f" {os.cpu_count()} cpus)",
    jax=jax.__version__,
    date=time.strftime("%Y-%m-%d"),
    load_average=os.getloadavg(),
    command=command_lib.command("benchmarks.sampler", argv),
  )
  os.makedirs(out, exist_ok=True)
  stem = os.path.join(out, "sampler")
  with open(stem + ".json", "w") as f:
    json.dump({"meta": meta, **result}, f, indent=1)
  m = result["median_s"]
  lines = [
    f"# KV-cached sampling ({meta['device']}, {meta['date']})",
    "",
    f"Command: `{meta['command']}`",
    "",
    f"{args.num_layers}-layer decoder, hidden {args.hidden}, "
    f"{result['num_params']:,} parameters; batch {args.batch}, prompt "
    f"{args.prompt_len}, {args.new_tokens} new tokens; median of "
    f"{args.rounds} interleaved rounds; load average "
    f"{meta['load_average'][0]:.1f} (shared machine).",
    "",
    "| sampler | median s | compile + first call s |",
    "|---|---|---|",
    f"| uncached | {m['uncached']:.4f} | "
    f"{result['compile_and_first_s']['uncached']:.1f} |",
    f"| KV-cached | {m['cached']:.4f} | "
    f"{result['compile_and_first_s']['cached']:.1f} |",
    "",
    f"Speed-up (uncached / cached): **{result['speedup']:.1f}x**; "
    f"same tokens: {result['tokens_equal']}.",
  ]
  with open(stem + ".md", "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))
  return result


if __name__ == "__main__":
  main()
