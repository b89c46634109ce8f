#!/usr/bin/env bash
# The GPU evidence for the fusion catalogue: run on the H200 from the repository root with
#   source .gpu/boot.sh && bash reports/samples/gpu_catalogue.sh "$OUT"
# - llama-3.1-8b (bf16, batch 1, prompt 512, 32 decode steps): the prefill and decode estimates with the
#   micro-measured column, and the estimator's inputs saved for timing it on the 2-core CPU (estimator_time.py);
# - llama-3.2-1b, same workload: estimates, and the recall check against TorchInductor on
#   its prefill (inductor_recall.py).
set -uo pipefail
out=${1:?usage: gpu_catalogue.sh OUT_DIR}
work=$(mktemp -d)
exec > >(tee "$out/gpu_catalogue.log") 2>&1
echo "date: $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
status=0
step() {  # step NAME COMMAND...: run it, print its wall time, remember a failure
  local name=$1; shift
  local t0=$(date +%s.%N)
  "$@" || { echo "FAILED $name"; status=1; }
  echo "WALL $name $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s"
}
workload=(--batch 1 --prompt-len 512 --decode-steps 32)
step 8b python3 reports/samples/estimator_time.py capture llama-3.1-8b "$work/llama-3.1-8b" \
  "$out/llama-3.1-8b-estimator-inputs.pkl.gz" batch=1 prompt_len=512 decode_steps=32
step 1b fusionscope profile llama-3.2-1b "${workload[@]}" --out "$work/llama-3.2-1b"
step recall python3 reports/samples/inductor_recall.py "$work/llama-3.2-1b" "$out/inductor_recall.json"
step 8b-estimator-on-gpu-host python3 reports/samples/estimator_time.py time "$out/llama-3.1-8b-estimator-inputs.pkl.gz"
tar -C "$work" -czf "$out/catalogue_runs.tar.gz" --exclude trace.json.gz --exclude ops.csv --exclude kernels.csv . || status=1
ls -la "$out"
exit $status
