#!/usr/bin/env bash
# The GPU subset of the benchmarks, for one GPU (sized for one H200: < 8 min).
#
#   bash benchmarks/gpu.sh            # from anywhere; runs in the repo root
#
# 1. Optimizer step time at 1e8, 3e8 and 1e9 parameters (benchmarks.step_time).
# 2. ResNet-18 (CIFAR-style, digits enlarged to 32x32) throughput, Adam vs GRPO.
# 3. BERT MLM (4 layers, hidden 256, seq 128) throughput, Adam vs GRPO.
#
# Everything goes to benchmarks/results/gpu-<date>-<device>/. Each part has its
# own time limit; a part that fails or times out is reported and the script
# goes on, exiting non-zero at the end if any part failed.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}

has_gpu() {
  "$PY" -c 'import jax, sys; sys.exit(0 if jax.default_backend() == "gpu" else 1)' \
    >/dev/null 2>&1
}

if ! has_gpu; then
  version=$("$PY" -c 'import jax; print(jax.__version__)')
  echo "jax ${version} has no GPU backend: installing jax[cuda12]==${version}"
  timeout 240 "$PY" -m pip install --quiet "jax[cuda12]==${version}"
  has_gpu || { echo "still no GPU backend after installing jax[cuda12]" >&2; exit 1; }
fi
"$PY" -c 'import jax; print(jax.devices())'

device=$("$PY" -c 'import jax, re; print(re.sub(r"[^A-Za-z0-9]+", "_", jax.devices()[0].device_kind).strip("_"))')
out="benchmarks/results/gpu-$(date +%Y%m%d-%H%M)-${device}"
mkdir -p "$out"
echo "results: $out"

failed=()
# run_part NAME SECONDS COMMAND...: runs COMMAND under `timeout`, logs to
# $out/NAME.log, records a failure instead of stopping the script.
run_part() {
  local name=$1 seconds=$2
  shift 2
  echo "== ${name} (limit ${seconds} s): $*"
  local start=$SECONDS status=0
  timeout "$seconds" "$@" 2>&1 | tee "$out/${name}.log" || status=$?
  echo "== ${name}: exit ${status} after $((SECONDS - start)) s"
  if [[ $status -ne 0 ]]; then failed+=("${name}(exit ${status})"); fi
}

run_part step_time 270 "$PY" -m benchmarks.step_time --sizes 1e8,3e8,1e9 \
  --optimizers adam,nadam,sgd_momentum,grpo_dense,grpo_threshold,grpo_topk \
  --out "$out"

for opt in adam grpo; do
  run_part "resnet_${opt}" 60 "$PY" -m examples.resnet_cifar10 --depth 18 \
    --image-size 32 --batch-size 256 --steps 300 --eval-every 0 \
    --optimizer "$opt" --quiet --workdir "$out/resnet_${opt}"
  run_part "bert_${opt}" 60 "$PY" -m examples.bert_mlm --hidden 256 \
    --num-layers 4 --num-heads 4 --ffn 1024 --seq-len 128 --batch-size 64 \
    --steps 300 --eval-every 0 --optimizer "$opt" --quiet \
    --workdir "$out/bert_${opt}"
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
