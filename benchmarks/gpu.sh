#!/usr/bin/env bash
# The GPU subset of the benchmarks, for one GPU (sized for one H200: < 11 min).
#
#   bash benchmarks/gpu.sh             # from anywhere; runs in the repo root
#   bash benchmarks/gpu.sh --dry-run   # CPU, tiny sizes, the same code paths
#
# Needs only what the lent machine has: jax (with its GPU backend), flax,
# optax, orbax under ${PYTHON:-python3}; nothing is installed or downloaded.
#
# 1. Optimizer step time at 1e8, 3e8 and 1e9 parameters (benchmarks.step_time).
# 2. Memory: state bytes/param, peak bytes of a GPT-style decoder's step,
#    the largest decoder within Adam's budget, and the fp32 / bf16 / 8-bit
#    update at 1e9 parameters with the fraction of peak HBM bandwidth
#    (benchmarks.memory).
# 3. ResNet-18 (CIFAR-style, digits enlarged to 32x32) throughput, Adam vs GRPO.
# 4. BERT MLM (4 layers, hidden 256, seq 128) throughput, Adam vs GRPO.
#
# Everything goes to benchmarks/results/gpu-<date>-<device>/ (dry run: under
# ${GPU_SH_OUT:-a temporary directory}). Each part has its own time limit; a
# part that fails or times out is reported and the script goes on, exiting
# non-zero at the end if any part failed.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
export PYTHONPATH=".${PYTHONPATH:+:${PYTHONPATH}}"

dry=0
case "${1:-}" in
  --dry-run) dry=1 ;;
  "") ;;
  *) echo "usage: bash benchmarks/gpu.sh [--dry-run]" >&2; exit 2 ;;
esac

if (( dry )); then
  export JAX_PLATFORMS=cpu
  out="${GPU_SH_OUT:-$(mktemp -d)}/gpu-dry-run"
else
  export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
  if ! "$PY" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' \
      >/dev/null 2>&1; then
    echo "no GPU backend in $("$PY" -c 'import jax; print("jax", jax.__version__)' 2>&1);" \
      "this script installs nothing (use --dry-run on a CPU)" >&2
    exit 1
  fi
  device=$("$PY" -c 'import jax, re; print(re.sub(r"[^A-Za-z0-9]+", "_", jax.devices()[0].device_kind).strip("_"))')
  out="benchmarks/results/gpu-$(date +%Y%m%d-%H%M)-${device}"
fi
"$PY" -c 'import jax; print(jax.__version__, jax.devices())'
mkdir -p "$out"
echo "results: $out"

failed=()
# run_part NAME SECONDS COMMAND...: runs COMMAND under `timeout`, logs to
# $out/NAME.log, records a failure instead of stopping the script.
# The dry run checks the code paths, not the time: on a loaded CPU (the
# test suite runs it beside other tests) its limits are five times longer.
limit_scale=1
if (( dry )); then limit_scale=5; fi
run_part() {
  local name=$1 seconds=$(( $2 * limit_scale ))
  shift 2
  echo "== ${name} (limit ${seconds} s): $*"
  local start=$SECONDS status=0
  timeout "$seconds" "$@" 2>&1 | tee "$out/${name}.log" || status=$?
  echo "== ${name}: exit ${status} after $((SECONDS - start)) s"
  if [[ $status -ne 0 ]]; then failed+=("${name}(exit ${status})"); fi
}

if (( dry )); then
  sizes=1e5; memory=(--dry-run); steps=2; resnet_depth=8; image=8; batch=8
  step_opts=(--optimizers adam,grpo_dense --rounds 1 --iters 2)
  bert=(--hidden 32 --num-layers 1 --num-heads 2 --ffn 64 --seq-len 16)
else
  sizes=1e8,3e8,1e9; memory=(--time-params 1e9); steps=300; resnet_depth=18
  step_opts=(--optimizers adam,nadam,sgd_momentum,grpo_dense,grpo_threshold,grpo_topk)
  image=32; batch=256
  bert=(--hidden 256 --num-layers 4 --num-heads 4 --ffn 1024 --seq-len 128)
fi

run_part step_time 200 "$PY" -m benchmarks.step_time --sizes "$sizes" \
  "${step_opts[@]}" --compile-layers "" --out "$out"

run_part memory 300 "$PY" -m benchmarks.memory "${memory[@]}" --out "$out"

for opt in adam grpo; do
  run_part "resnet_${opt}" 60 "$PY" -m examples.resnet_cifar10 \
    --depth "$resnet_depth" --image-size "$image" --batch-size "$batch" \
    --steps "$steps" --eval-every 0 --optimizer "$opt" --quiet \
    --workdir "$out/resnet_${opt}"
  run_part "bert_${opt}" 60 "$PY" -m examples.bert_mlm "${bert[@]}" \
    --batch-size "$(( batch / 4 ))" --steps "$steps" --eval-every 0 \
    --optimizer "$opt" --quiet --workdir "$out/bert_${opt}"
done

# Throughput summary from the examples' metrics.json (wall time includes
# data loading and compilation, so it is a lower bound on steady throughput).
"$PY" - "$out" <<'EOF' || failed+=("throughput_summary")
import json, os, sys
out = sys.argv[1]
rows = {}
for name in sorted(os.listdir(out)):
  path = os.path.join(out, name, "metrics.json")
  if os.path.isfile(path):
    with open(path) as f:
      m = json.load(f)
    rows[name] = {"steps": m["steps"], "batch_size": m["batch_size"],
                  "wall_time_s": m["wall_time_s"], "num_params": m["num_params"],
                  "examples_per_s": m["steps"] * m["batch_size"] / m["wall_time_s"]}
    print(f"{name:12s} {rows[name]['examples_per_s']:10.0f} examples/s "
          f"({m['num_params'] / 1e6:.1f}M params, {m['wall_time_s']:.1f} s)")
with open(os.path.join(out, "examples_throughput.json"), "w") as f:
  json.dump(rows, f, indent=1)
EOF

if (( ${#failed[@]} )); then
  echo "failed parts: ${failed[*]}" >&2
  exit 1
fi
echo "all parts done: $out"
