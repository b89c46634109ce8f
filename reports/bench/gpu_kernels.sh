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
  # One `fusionscope bench` per kernel, each merged into OUT/bench.csv as soon as it ends: a run cut short by the
  # device call's time limit still returns every finished kernel. KERNELS (space-separated) narrows the list.
  work=$(mktemp -d)
  kernels=${KERNELS:-$(python3 -c 'from fusionscope.bench import kernel_names; print(*kernel_names())')}
  [ -n "$kernels" ] || { echo "no kernels to benchmark"; exit 1; }
  for kernel in $kernels; do
    echo "== $kernel $(date -u +%T)"
    COLUMNS=160 fusionscope bench "$kernel" --out "$work/$kernel"
    rc=$?
    echo "bench $kernel rc=$rc"; [ $rc = 0 ] || { status=1; continue; }
    python3 - "$work/$kernel" "$out" <<'PY'
import sys
from pathlib import Path
import pandas as pd
from fusionscope.bench.page import render_bench_page
import json
src, out = Path(sys.argv[1]), Path(sys.argv[2])
rows = pd.read_csv(src / "bench.csv")
if (out / "bench.csv").exists():  # a rerun of a kernel replaces its earlier rows
    rows = pd.concat([pd.read_csv(out / "bench.csv"), rows], ignore_index=True)
    rows = rows.drop_duplicates(["kernel", "case", "variant", "dtype"], keep="last")
meta = json.loads((src / "bench.json").read_text())
for name, text in (("bench.csv", rows.to_csv(index=False, float_format="%.6g")),
                   ("bench.json", json.dumps(meta, indent=1) + "\n"), ("bench.html", render_bench_page(rows, meta))):
    (out / f".{name}.partial").write_text(text, encoding="utf-8")
    (out / f".{name}.partial").replace(out / name)  # whole files only, even if the call is cut short here
PY
  done
fi
exit $status
