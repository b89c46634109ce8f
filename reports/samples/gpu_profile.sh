#!/usr/bin/env bash
# The GPU evidence for `fusionscope profile`: run on the H200 from the repository root with
#   source .gpu/boot.sh && bash reports/samples/gpu_profile.sh "$OUT"
# It profiles llama-3.1-8b and llama-3.2-1b (bf16, batch 1, prompt 512, 32 decode steps), timing each whole
# command, records small CUDA traces of tiny-llama and llama-3.2-1b as test fixtures, and packs the results.
set -uo pipefail
out=${1:?usage: gpu_profile.sh OUT_DIR}
work=$(mktemp -d)
log=$out/gpu_profile.log
exec > >(tee "$log") 2>&1
echo "date: $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
python3 -c 'import torch, triton, transformers, pandas, hta, plotly; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, "pandas", pandas.__version__, "plotly", plotly.__version__)'

# Raw CUDA traces first, with no analysis, so a later failure still leaves the test fixtures.
python3 - "$out" <<'PY'
import sys, torch
from pathlib import Path
from fusionscope import capture, models
out = Path(sys.argv[1])
for name, prompt, decode in (("tiny-llama", 32, 4), ("llama-3.2-1b", 64, 2)):
    w = models.build_workload(models.resolve_model(name), torch.device("cuda"), torch.bfloat16, prompt_len=prompt,
                              decode_steps=decode)
    folder = out / f"{name}-fixture"
    folder.mkdir()
    capture.capture(w, folder)
    (folder / "trace.json.gz").rename(out / f"{name}-cuda.trace.json.gz")
    folder.rmdir()
    print("fixture", name, (out / f"{name}-cuda.trace.json.gz").stat().st_size, "bytes")
PY

timed() {  # timed NAME fusionscope ARGS... : wall time of the whole command, model build and roofs included
  local name=$1; shift
  local t0=$(date +%s.%N)
  "$@"
  local t1=$(date +%s.%N)
  echo "WALL $name $(python3 -c "print(round($t1 - $t0, 1))") s"
}

# The first command measures the roofs (cached afterwards); its time is reported on its own line.
timed tiny-llama-first fusionscope profile tiny-llama --out "$work/tiny-llama-first" || echo FAILED tiny-llama-first
timed llama-3.1-8b fusionscope profile llama-3.1-8b --batch 1 --prompt-len 512 --decode-steps 32 --out "$work/llama-3.1-8b" || echo FAILED 8b
timed llama-3.2-1b fusionscope profile llama-3.2-1b --batch 1 --prompt-len 512 --decode-steps 32 --out "$work/llama-3.2-1b" || echo FAILED 1b
timed tiny-llama-cached-roofs fusionscope profile tiny-llama --out "$work/tiny-llama" || echo FAILED tiny
timed report-8b fusionscope report "$work/llama-3.1-8b" || echo FAILED report

cp "$work/llama-3.1-8b/trace.json.gz" "$out/llama-3.1-8b.trace.json.gz" || true
ls -la "$work"/*/
tar -C "$work" -czf "$out/samples.tar.gz" --exclude trace.json.gz --exclude ops.csv . || true
tar -C "$work" -czf "$out/ops.tar.gz" llama-3.1-8b/ops.csv || true
ls -la "$out"
