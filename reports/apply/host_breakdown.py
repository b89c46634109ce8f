"""Where the host time of a patched eager decode step goes: cProfile of the decode steps of one pass, per variant.

    python3 reports/apply/host_breakdown.py OUT.json [MODEL] [FUSIONS ...]

Builds MODEL (default llama-3.1-8b) in bf16 on the GPU, finds the sites with `find_sites`, and for the baseline, each
named fusion alone (default: add_rms_norm) and all fusions found together: times the workload (prompt 512, 32 decode
steps) in interleaved rounds, then runs one pass under cProfile and keeps the 25 functions with the most own time
(tottime) and the 25 with the most cumulative time. Used to tell which term of the step model missed when fusions
measured alone add up to less together.
"""

from __future__ import annotations

import cProfile
import json
import pstats
import sys
from contextlib import nullcontext
from datetime import UTC, datetime

import torch

from fusionscope import capture
from fusionscope.apply.measure import interleaved, measured_variants
from fusionscope.apply.patching import find_sites, patch
from fusionscope.models import build_workload, resolve_model


def top(stats: pstats.Stats, key: str, n: int = 25) -> list[dict]:
    stats.sort_stats(key)
    rows = []
    for func in stats.fcn_list[:n]:  # type: ignore[attr-defined]
        _cc, nc, tt, ct, _ = stats.stats[func]  # type: ignore[attr-defined]
        rows.append({"function": f"{func[0].split('site-packages/')[-1]}:{func[1]}({func[2]})", "calls": nc,
                     "tottime_ms": round(tt * 1e3, 2), "cumtime_ms": round(ct * 1e3, 2)})  # fmt: skip
    return rows


def main() -> None:
    out = sys.argv[1]
    model_name = sys.argv[2] if len(sys.argv) > 2 else "llama-3.1-8b"
    alone = sys.argv[3:] or ["add_rms_norm"]
    cuda = torch.cuda.is_available()  # a CPU run (TRITON_INTERPRET=1, tiny models) only checks the script
    workload = build_workload(resolve_model(model_name), torch.device("cuda" if cuda else "cpu"),
                              torch.bfloat16 if cuda else torch.float32, prompt_len=512 if cuda else 8,
                              decode_steps=32 if cuda else 2)  # fmt: skip
    sites = find_sites(workload.module)
    variants = {"baseline": [], **{f: [f] for f in alone}, "all found": list(sites)}

    def enter(name: str):
        fusions = variants[name]
        where = [{"fusion": f, "module_paths": sites[f]} for f in fusions]
        return patch(workload.module, where) if fusions else nullcontext()

    for name in variants:  # warm-up: compile every kernel on the timed shapes
        with enter(name):
            capture.timed_pass(workload)
    timed = interleaved(workload, measured_variants(list(variants), enter), 3)
    result = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "model": model_name,
              "versions": {"torch": torch.__version__}, "sites": {k: len(v) for k, v in sites.items()},
              "wall_ms": {n: {ph: m.wall(ph) for ph in ("prefill", "decode")} for n, m in timed.items()},
              "profiles": {}}  # fmt: skip
    for name in variants:
        with enter(name):
            profiler = cProfile.Profile()
            profiler.enable()
            capture.timed_pass(workload)
            profiler.disable()
        stats = pstats.Stats(profiler)
        result["profiles"][name] = {"tottime": top(stats, "tottime"), "cumtime": top(stats, "cumulative")}
        print(f"== {name}: decode {result['wall_ms'][name]['decode']:.2f} ms/step")
        for row in result["profiles"][name]["tottime"][:12]:
            print(f"   {row['tottime_ms']:9.1f} ms {row['calls']:7d}  {row['function']}")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
