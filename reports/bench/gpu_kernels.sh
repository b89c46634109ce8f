#!/usr/bin/env bash
# The GPU evidence for the bundled kernels: run on the H200 from the repository root with
#   source .gpu/boot.sh && bash reports/bench/gpu_kernels.sh "$OUT" [check|bench|all]
# check: the kernel test suite compiled on the GPU (CUDA tensors, no interpreter), then check_kernels.py (one launch
#        per call, no hidden copy, fusionscope::<op> in a torch.compile(fullgraph=True) graph, CUDA-graph replay equal
#        to eager). bench: `fusionscope bench` over the full shape sweep. Results land in OUT.
set -uo pipefail
out=${1:?usage: gpu_kernels.sh OUT_DIR [check|bench|all]}
what=${2:-all}
exec > >(tee -a "$out/gpu_kernels_$what.log") 2>&1
echo "date: $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
if [ "$what" != bench ]; then
  python3 -m pytest tests/kernels -q -p no:cacheprovider -x 2>&1 | tail -25
  echo "pytest rc=${PIPESTATUS[0]}"
  python3 reports/bench/check_kernels.py "$out/check_kernels.json"
  echo "check rc=$?"
fi
if [ "$what" != check ]; then
  work=$(mktemp -d)
  fusionscope bench --out "$work/bench"
  echo "bench rc=$?"
  cp "$work"/bench/bench.* "$out/" 2>/dev/null
fi
