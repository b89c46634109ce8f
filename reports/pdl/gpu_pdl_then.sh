#!/usr/bin/env bash
# On the GPU host, from the repository root: source .gpu/boot.sh && bash reports/pdl/gpu_pdl_then.sh "$OUT" SET
# The PDL A/B on the replayed decode chain (gpu_pdl.py, ~1 min); then, only if PDL's outputs are bit-equal to the
# eager chain's and it is faster, `reports/apply/gpu_apply.sh "$OUT" SET` (whole models, PDL on as shipped).
set -uo pipefail
out=${1:?usage: gpu_pdl_then.sh OUT SET}
set_name=${2:?usage: gpu_pdl_then.sh OUT SET}
mkdir -p "$out/pdl"
timeout 240 python3 reports/pdl/gpu_pdl.py "$out/pdl" > "$out/pdl/gpu_pdl.log" 2>&1
tail -2 "$out/pdl/gpu_pdl.log"
python3 - "$out/pdl/pdl.json" <<'PY' || { echo "PDL: no gain or a failed check: the apply runs are skipped"; exit 0; }
import json, sys
s = json.load(open(sys.argv[1]))
ok = all(c["bit_equal_to_eager"] and not c["nan"] for c in s["check"].values())
print("PDL check", ok, "on vs off", s["on_vs_off_single"], s["on_vs_off_batched"])
sys.exit(0 if ok and s["on_vs_off_single"] > 1.003 else 1)
PY
bash reports/apply/gpu_apply.sh "$out" "$set_name" > /dev/null 2>&1
grep -E "│ (graph|fused \+ graph|torch.compile|fused \+ compile|liger) |floor|vs torch.compile|WALL" "$out/gpu_apply_${set_name}.log" | cut -c1-260 | head -24
