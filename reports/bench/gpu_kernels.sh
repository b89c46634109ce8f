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
status=0
if [ "$what" != bench ]; then
  # The tests run from a copy holding only tests/, so `fusionscope` (and its `kernels` mapping) is the installed one.
  work=$(mktemp -d)
  cp -r tests "$work/"
  (cd "$work" && python3 -m pytest tests/kernels -q -p no:cacheprovider -o pythonpath=. -W ignore::pytest.PytestUnknownMarkWarning) > "$out/pytest_kernels.log" 2>&1
  rc=$?
  tail -15 "$out/pytest_kernels.log"
  echo "pytest rc=$rc"; [ $rc = 0 ] || status=1
  python3 reports/bench/check_kernels.py "$out/check_kernels.json"
  rc=$?
  echo "check rc=$rc"; [ $rc = 0 ] || status=1
fi
if [ "$what" != check ]; then
  work=$(mktemp -d)
  fusionscope bench --out "$work/bench"
  rc=$?
  echo "bench rc=$rc"; [ $rc = 0 ] || status=1
  cp "$work"/bench/bench.* "$out/" 2>/dev/null
fi
exit $status
