"""Heads per program and warps for the rope kernel, against torch.compile and Liger, on the GPU.

Usage (on the GPU machine): python3 reports/bench/tune_rope.py OUT.json

`rope._blocks` puts about 512 elements of each half in a program (8 heads of D = 128) at 4 warps. In the bench rope
reached 77% of copy bandwidth at B8 S4096 where torch.compile reached 100%: this times BLOCK_H × num_warps at
prefill and decode shapes (GPU time by CUDA-graph replay, median), everything else as `_blocks` chooses.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tune_norms import gpu_us, patched, write_rows  # this folder is on sys.path when run as a script

from fusionscope.bench.cases import ROPE_HEADS, kernel_module, rope_case

SHAPES = [(8, 4096), (1, 4096), (64, 1)]
BLOCK_H = (1, 2, 4, 8, 16, 32)
WARPS = (1, 2, 4, 8)
PEERS = ("compile", "liger")
DEVICE = "cuda"


def main(path: Path) -> None:
    torch._dynamo.config.recompile_limit = 64
    mod = kernel_module("rope")
    blocks = mod._blocks
    rows = []
    for batch, seq in SHAPES:
        case = rope_case(batch, seq, *ROPE_HEADS)
        inputs = case.build(torch.device(DEVICE), torch.bfloat16)
        configs = [(p, None, None) for p in PEERS if p in case.variants]
        configs += [("fusionscope", None, None)] + [("fusionscope", h, w) for h in BLOCK_H for w in WARPS]
        for variant, block_h, warps in configs:
            patch = {}
            if block_h is not None:
                patch["_blocks"] = lambda *a, h=block_h: {**blocks(*a), "BLOCK_H": h}
                patch["_num_warps"] = lambda *a, w=warps: w
            with patched(mod, **patch):
                us = gpu_us(lambda v=variant, i=inputs, c=case: c.variants[v](i))
            label = variant if block_h is None else f"{variant} BLOCK_H={block_h} warps={warps}"
            rows.append({"shape": case.label, "variant": label, "gpu_us": us, "traffic": case.traffic(inputs)})
            print(f"{case.label:22s} {label:40s} {us:8.2f} µs", flush=True)
        del inputs
        torch.cuda.empty_cache()
    write_rows(path, rows)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
