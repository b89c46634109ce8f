#!/usr/bin/env bash
# The GPU evidence for `fusionscope apply`: run on the H200 from the repository root with
#   source .gpu/boot.sh && bash reports/apply/gpu_apply.sh "$OUT" SET
# SET picks the runs, comma-separated (each a `fusionscope apply` command line, bf16): see the case list below;
# `agree` adds `analyze` of the first run's trace compared with its profile (reports/analyze/agree.py), `w4a16apply`
# `apply --quantize w4 --graphs` (reports/w4a16/gpu_apply_w4a16.py; W4A16_RUNS picks its runs, W4A16_BUDGET_S its
# seconds: the 8B w4 run alone takes about 490 s). Each run's terminal
# output, summary.json, apply.csv and opportunities.csv (and report.html for the first run of a set) are packed into
# $OUT/apply-<SET>.tgz as they finish, so a call stopped at its time limit still returns what was done.
set -uo pipefail
out=${1:?usage: gpu_apply.sh OUT_DIR SET}
set_name=${2:?usage: gpu_apply.sh OUT_DIR SET}
work=$(mktemp -d)
repo=$(cd "$(dirname "$0")/../.." && pwd)
log=$out/gpu_apply_${set_name//,/-}.log
exec > >(tee "$log") 2>&1
echo "date: $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
python3 -c 'import torch, triton, transformers, pandas; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, "pandas", pandas.__version__)'
# msgspec decodes the traces (without it, `json`: about 2.5x slower); .gpu/ carries it (prepare.sh msgspec==0.23.0)
python3 -c 'import msgspec, os; print("msgspec", msgspec.__version__, "cores", len(os.sched_getaffinity(0)))' || echo "msgspec: not installed"

runs=()
for one in ${set_name//,/ }; do
  case $one in
    smoke) runs+=("tiny-llama --prompt-len 64 --decode-steps 8 --repeats 2"
                  "llama-3.2-1b --prompt-len 128 --decode-steps 16 --repeats 2") ;;
    llama8b) runs+=("llama-3.1-8b --prompt-len 512 --decode-steps 32 --repeats 3") ;;
    prefill8) runs+=("llama-3.1-8b --batch 8 --prompt-len 512 --decode-steps 0 --repeats 3") ;;
    small) runs+=("gpt2 --prompt-len 512 --decode-steps 32 --repeats 3"
                  "gemma-2-2b --prompt-len 512 --decode-steps 32 --repeats 3") ;;
    large) runs+=("qwen2.5-7b --prompt-len 512 --decode-steps 32 --repeats 3"
                  "mistral-7b --prompt-len 512 --decode-steps 32 --repeats 3") ;;
    graphs1b) runs+=("llama-3.2-1b --prompt-len 128 --decode-steps 16 --repeats 2 --graphs") ;;
    graphs8b) runs+=("llama-3.1-8b --prompt-len 512 --decode-steps 64 --repeats 5 --graphs --graphs-only") ;;
    graphs8b16) runs+=("llama-3.1-8b --batch 16 --prompt-len 512 --decode-steps 64 --repeats 3 --graphs --graphs-only --graphs-together") ;;
    graphsqwen) runs+=("qwen2.5-7b --prompt-len 512 --decode-steps 64 --repeats 3 --graphs --graphs-only --graphs-together") ;;
    graphsgemma) runs+=("gemma-2-2b --prompt-len 512 --decode-steps 64 --repeats 3 --graphs --graphs-only --graphs-together") ;;
    mistral) runs+=("mistral-7b --prompt-len 512 --decode-steps 32 --repeats 3") ;;
    graphs1bt) runs+=("llama-3.2-1b --prompt-len 128 --decode-steps 16 --repeats 2 --graphs --graphs-only --graphs-together") ;;
    famphi3) runs+=("tiny-phi3 --prompt-len 64 --decode-steps 8 --repeats 2 --graphs --graphs-only --graphs-together") ;;
    famtiny) runs+=("tiny-phi3 --prompt-len 64 --decode-steps 8 --repeats 2 --graphs --graphs-only --graphs-together"
                    "tiny-neox --prompt-len 64 --decode-steps 8 --repeats 2 --graphs --graphs-only --graphs-together") ;;
    graphsphi3) runs+=("phi-3-mini --prompt-len 512 --decode-steps 64 --repeats 3 --graphs --graphs-only --graphs-together") ;;
    graphsolmo2) runs+=("olmo-2-7b --prompt-len 512 --decode-steps 64 --repeats 3 --graphs --graphs-only --graphs-together") ;;
    graphsqwen3) runs+=("qwen3-8b --prompt-len 512 --decode-steps 64 --repeats 3 --graphs --graphs-only --graphs-together") ;;
    graphsneox) runs+=("pythia-6.9b --prompt-len 512 --decode-steps 64 --repeats 3 --graphs --graphs-only --graphs-together") ;;
    graphsstarcoder2) runs+=("starcoder2-7b --prompt-len 512 --decode-steps 64 --repeats 3 --graphs --graphs-only --graphs-together") ;;
    graphsllama) runs+=("llama-3.1-8b --prompt-len 512 --decode-steps 64 --repeats 3 --graphs --graphs-only --graphs-together") ;;
    # a GELU MLP stack of the user's own (not a transformers model: one forward, no decode step, so no graphs)
    gelu) runs+=("$repo/examples/gelu_mlp.py:factory_large --repeats 3") ;;
    tests|kerneltests|gated|host|silu|w4a16|w4a16apply|dabench|agree|nproc1) ;;
    *) echo "unknown set $one"; exit 2 ;;
  esac
done

if [[ ",$set_name," == *",tests,"* ]]; then
  # The patch tests compiled on the GPU (CUDA tensors, no interpreter), from a copy holding only tests/, so the
  # installed fusionscope is the one tested.
  tests=$(mktemp -d)
  cp -r tests "$tests/"
  (cd "$tests" && timeout 240 python3 -m pytest tests/test_patch_norms.py tests/test_patch_mlp_attention.py \
     tests/test_patch_gpt2_sampling.py -q -p no:cacheprovider -o pythonpath=. -x) > "$out/pytest_patch.log" 2>&1
  echo "patch tests rc=$?"; tail -5 "$out/pytest_patch.log"
fi

if [[ ",$set_name," == *",kerneltests,"* ]]; then
  # The rope_and_cache kernel (its counter advanced by tickets, `kernels/rope.py: _slot`) and the PDL kernels
  # compiled for this GPU and checked against their references, before the model runs use them.
  tests=$(mktemp -d)
  cp -r tests "$tests/"
  (cd "$tests" && timeout 150 python3 -m pytest tests/kernels/test_rope.py tests/kernels/test_pdl.py -q \
     -p no:cacheprovider -o pythonpath=. -x -k "advance or start_slot or pdl or PDL") > "$out/pytest_kernels.log" 2>&1
  echo "kernel tests rc=$?"; tail -5 "$out/pytest_kernels.log"
fi

if [[ ",$set_name," == *",gated,"* ]]; then
  # silu_and_mul folded into the down_proj GEMV against the pair (reports/gemv/gpu_gated.py); where the fold does
  # not beat the pair on every shape, this call's model runs leave the pairs apart (FUSIONSCOPE_GEMV_PROLOGUE=0).
  (cd "$work" && timeout 150 python3 "$repo/reports/gemv/gpu_gated.py" "$out/gated") > "$out/gated.log" 2>&1
  grep -E '"kind": "(point|error)"|GATED' "$out/gated.log" | cut -c1-400
  grep -q "GATED shipped beats the pair on every shape: True" "$out/gated.log" || export FUSIONSCOPE_GEMV_PROLOGUE=0
  echo "FUSIONSCOPE_GEMV_PROLOGUE=${FUSIONSCOPE_GEMV_PROLOGUE:-1}"
fi

if [[ ",$set_name," == *",host,"* ]]; then
  # Where a patched eager decode step spends its host time (cProfile per variant), for the note on prediction misses.
  (cd "$work" && timeout 200 python3 "$repo/reports/apply/host_breakdown.py" "$out/host_breakdown.json") 2>&1 | tail -60
fi

if [[ ",$set_name," == *",silu,"* ]]; then
  # silu_and_mul's flat schedule for two contiguous tensors against its row schedule, torch.compile and eager.
  (cd "$work" && timeout 150 python3 "$repo/reports/bench/tune_silu.py" "$out/tune_silu.json") 2>&1 | tail -50
fi

if [[ ",$set_name," == *",w4a16,"* ]]; then
  # The W4A16 kernel checked and timed against dequant + cuBLAS and bf16 cuBLAS (reports/w4a16/).
  (cd "$work" && timeout 210 python3 "$repo/reports/w4a16/gpu_w4a16.py" "$out") 2>&1 | tail -40
fi

if [[ ",$set_name," == *",w4a16apply,"* ]]; then
  # apply --quantize w4 --graphs on llama-3.2-1b and llama-3.1-8b beside the bf16 8B (reports/w4a16/README.md).
  (cd "$work" && W4A16_RUNS=${W4A16_RUNS:-} W4A16_BUDGET_S=${W4A16_BUDGET_S:-420} timeout $((${W4A16_BUDGET_S:-420} + 20)) python3 "$repo/reports/w4a16/gpu_apply_w4a16.py" "$work/w4a16apply") 2>&1 | tail -40
  cp "$work/w4a16apply/w4a16_apply.json" "$out/" 2>/dev/null
  (cd "$work/w4a16apply" && tar czf "$out/w4a16apply.tgz" --exclude='*.html' --exclude='*.json.gz' --exclude=kernels.csv --exclude=ops.csv .) 2>/dev/null
fi

if [[ ",$set_name," == *",nproc1,"* ]]; then
  # profile --nproc 1 beside a plain profile on one GPU (reports/nproc/gpu_nproc.py; NPROC_CASES picks cases).
  (cd "$work" && NPROC_BUDGET_S=${NPROC_BUDGET_S:-200} timeout $((${NPROC_BUDGET_S:-200} + 30)) python3 "$repo/reports/nproc/gpu_nproc.py" "$work/nproc" ${NPROC_CASES:-}) 2>&1 | tail -30
  (cd "$work/nproc" && tar czf "$out/nproc1.tgz" --exclude='*.html' --exclude='*.json.gz' --exclude=kernels.csv --exclude=ops.csv .) 2>/dev/null
fi

if [[ ",$set_name," == *",dabench,"* ]]; then
  # decode_attention checked against its float64 reference and timed against HF's static-cache path, torch.compile
  # of it and SDPA with enable_gqa (fusionscope bench's variants), before the model runs use it.
  (cd "$work" && COLUMNS=200 timeout 150 python3 -m fusionscope bench decode_attention --out "$work/bench-da") 2>&1 | tail -40
  cp "$work/bench-da/bench.json" "$out/bench_decode_attention.json" 2>/dev/null
fi

pack() {
  (cd "$work" && find . -maxdepth 2 \( -name summary.json -o -name apply.csv -o -name opportunities.csv \
     -o -name '*.log' -o -name report.html \) -print0 | tar czf "$out/apply-${set_name//,/-}.tgz" --null -T -)
}
first=1
for run in "${runs[@]}"; do
  name=${run%% *}
  [[ $name == */* ]] && name=$(basename "$name" | tr ':.' '--')  # a factory: its file and function name the folder
  tag="$name$(echo "${run#* }" | grep -o -- '--batch [0-9]*' | tr -d ' -')"
  [[ $run == *--graphs* ]] && tag="$tag-graphs"
  folder=$work/$tag
  echo "=== fusionscope apply $run"
  t0=$(date +%s.%N)
  # From the work folder, not the checkout: there `python3 -m fusionscope` would import the source tree, which lacks
  # the installed `fusionscope.kernels` mapping.
  (cd "$work" && COLUMNS=200 timeout 540 python3 -m fusionscope apply $run --out "$folder") 2>&1 | tee "$work/$tag.log"
  echo "WALL $tag $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s"
  [ $first = 1 ] || rm -f "$folder/report.html"
  pack  # before the trace-load probe: a call that reaches its limit there still returns the run
  # profile's trace loading alone, after the run, on this host (issue 23's target): apply's stage of the same name
  # also holds the join, and shares the host with the run's other work.
  for trace in "$folder"/trace.json.gz; do
    [ -e "$trace" ] || continue
    (cd "$work" && python3 -c 'import sys, time
from pathlib import Path
from fusionscope import trace_pool
p = Path(sys.argv[1]); times = []
for _ in range(3):
    t = time.perf_counter(); tl = trace_pool.load_timeline(p); times.append(time.perf_counter() - t); del tl
print(f"TRACELOAD {p.name} {p.stat().st_size / 2**20:.0f} MiB: " + " ".join(f"{t:.2f}" for t in times) + " s")' "$trace")
  done
  first=0
  pack
done
if [[ ",$set_name," == *",agree,"* ]] && [ ${#runs[@]} -gt 0 ]; then
  # `analyze` of the first run's own trace against what its profile reported (reports/analyze/agree.py).
  name=${runs[0]%% *}
  first_folder=$(find "$work" -maxdepth 1 -type d -name "$name*" | head -1)
  (cd "$work" && timeout 240 python3 "$repo/reports/analyze/agree.py" "$work/agree" "$first_folder") 2>&1 | tail -40
  cp "$work/agree/agree.json" "$out/agree.json" 2>/dev/null
  cp "$work/agree/agree.log" "$out/agree.log" 2>/dev/null
fi
ls -la "$out"
