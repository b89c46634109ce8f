#!/usr/bin/env bash
# The GPU evidence for the bundled kernels: run on the H200 from the repository root with
#   source .gpu/boot.sh && bash reports/bench/gpu_kernels.sh "$OUT" [check|bench|tune|host|all]
# check: the kernel test suite compiled on the GPU (CUDA tensors, no interpreter), then check_kernels.py (one launch
#        per call, no hidden copy, fusionscope::<op> in a torch.compile(fullgraph=True) graph, CUDA-graph replay equal
#        to eager; TESTS="tests/kernels/test_x.py ..." narrows the suite). bench: `fusionscope bench` over the full
#        shape sweep. tune: where the host time of a call goes
#        (host_cost.py), launch-parameter sweeps for the norms and rope (tune_norms.py, tune_rope.py), and linear_act's
#        Triton tiles and cuBLAS's launches per GEMM form (tune_linear_act.py, then its probe again without cuBLASLt's
#        workspace); SCRIPTS="host_cost tune_norms ..." narrows the list. host: only host_cost.py.
#        Results land in OUT.
set -uo pipefail
out=${1:?usage: gpu_kernels.sh OUT_DIR [check|bench|tune|host|all]}
what=${2:-all}
exec > >(tee -a "$out/gpu_kernels_$what.log") 2>&1
echo "date: $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
status=0
if [ "$what" = check ] || [ "$what" = all ]; then
  # The tests run from a copy holding only tests/, so `fusionscope` (and its `kernels` mapping) is the installed one.
  work=$(mktemp -d)
  cp -r tests "$work/"
  (cd "$work" && python3 -m pytest ${TESTS:-tests/kernels} -q -p no:cacheprovider -o pythonpath=. -W ignore::pytest.PytestUnknownMarkWarning) > "$out/pytest_kernels.log" 2>&1
  rc=$?
  tail -15 "$out/pytest_kernels.log"
  echo "pytest rc=$rc"; [ $rc = 0 ] || status=1
  python3 reports/bench/check_kernels.py "$out/check_kernels.json"
  rc=$?
  echo "check rc=$rc"; [ $rc = 0 ] || status=1
fi
if [ "$what" = host ]; then scripts="host_cost"; else scripts=${SCRIPTS:-host_cost tune_norms tune_rope tune_linear_act}; fi
if [ "$what" = tune ] || [ "$what" = host ] || [ "$what" = all ]; then
  for script in $scripts; do
    echo "== $script $(date -u +%T)"
    python3 "reports/bench/$script.py" "$out/$script.json"
    rc=$?
    echo "$script rc=$rc"; [ $rc = 0 ] || status=1
    if [ "$script" = tune_linear_act ]; then
      CUBLASLT_WORKSPACE_SIZE=0 python3 reports/bench/tune_linear_act.py "$out/tune_linear_act_no_workspace.json" --probe-only
      rc=$?
      echo "$script without workspace rc=$rc"; [ $rc = 0 ] || status=1
    fi
  done
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  # One `fusionscope bench` per kernel, each merged into OUT/bench.csv as soon as it ends: a run cut short by the
  # device call's time limit still returns every finished kernel. KERNELS (space-separated) narrows the list;
  # VARIANTS (space-separated) times only those variants; merge_bench.py replaces just their rows where it merges.
  work=$(mktemp -d)
  kernels=${KERNELS:-$(python3 -c 'from fusionscope.bench import kernel_names; print(*kernel_names())')}
  [ -n "$kernels" ] || { echo "no kernels to benchmark"; exit 1; }
  for kernel in $kernels; do
    echo "== $kernel $(date -u +%T)"
    variant_args=(); for v in ${VARIANTS:-}; do variant_args+=(--variant "$v"); done
    COLUMNS=160 fusionscope bench "$kernel" "${variant_args[@]}" --out "$work/$kernel"
    rc=$?
    echo "bench $kernel rc=$rc"; [ $rc = 0 ] || { status=1; continue; }
    python3 reports/bench/merge_bench.py "$work/$kernel" "$out" ${VARIANTS:-}
  done
fi
exit $status
