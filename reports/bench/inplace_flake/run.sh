#!/usr/bin/env bash
# How the logs here were produced (H200, 2026-11-29), from the repository root with .gpu/ carried:
#   source .gpu/boot.sh && bash reports/bench/inplace_flake/run.sh "$OUT"
# The compiled GPU suite once failed test_inplace_writes_into_x_and_residual_only[3x1000-fp32-llama]. This reruns the
# kernel's tests in the suite's order (diag_order), alone (diag_lean / diag_nolean) and the in-place tests four
# times with, then four times without the lean launch path (diag_repeat_* / diag_nolean_repeat_*; fresh random inputs each time).
set -uo pipefail
out=${1:?usage: run.sh OUT_DIR}
work=$(mktemp -d) && cp -r tests "$work/" && cd "$work" || exit 1
pytest() { python3 -m pytest "$@" -q -p no:cacheprovider -o pythonpath=. -W ignore::pytest.PytestUnknownMarkWarning; }
pytest tests/kernels/test_add_rms_norm.py tests/kernels/test_dispatch.py > "$out/diag_lean.log" 2>&1
FUSIONSCOPE_LEAN_LAUNCH=0 pytest tests/kernels/test_add_rms_norm.py > "$out/diag_nolean.log" 2>&1
pytest tests/kernels/test_add_layer_norm.py tests/kernels/test_add_rms_norm.py -x > "$out/diag_order.log" 2>&1
for i in 1 2 3 4; do pytest tests/kernels/test_add_rms_norm.py -k inplace > "$out/diag_repeat_$i.log" 2>&1; done
# (the fourth run without the lean path was cut off by the session's device time: three logs)
for i in 1 2 3 4; do
  FUSIONSCOPE_LEAN_LAUNCH=0 pytest tests/kernels/test_add_rms_norm.py -k inplace > "$out/diag_nolean_repeat_$i.log" 2>&1
done
