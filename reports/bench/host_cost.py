"""Where the host time of one eager kernel call goes, on the GPU machine.

Usage (on the GPU machine): python3 reports/bench/host_cost.py OUT.json

Per kernel, at its first decode shape (bf16): host µs per call of our public function (a back-to-back loop, as in
`bench`), of the same call with Triton's `JITFunction.run` replaced by a no-op (our Python: checks, allocation,
launch parameters, dispatch), hence Triton's launch path for this kernel (the difference), beside an empty Triton
kernel launched the usual way with 1 and with 24 arguments. Then a cProfile of 500 calls of the slowest one.
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import sys
from pathlib import Path

import torch
import triton
from triton.runtime.jit import JITFunction

from fusionscope.bench.cases import CASES
from fusionscope.bench.timing import host_and_call_us

DEVICE = "cuda"


@triton.jit
def _empty1(a):
    pass


@triton.jit
def _empty24(a, b, c, d, e, f, g, h, i0, i1, i2, i3, i4, i5, i6, i7, i8, i9, i10, i11, i12, i13, i14, i15):
    pass


def host_us(fn, calls: int = 2000) -> float:
    for _ in range(50):  # warm: compiled, cached, allocator primed
        fn()
    return host_and_call_us(fn, calls)[0]


def main(path: Path) -> None:
    dev = torch.device(DEVICE)
    x = torch.empty(16, device=dev)
    ptrs = [torch.empty(16, device=dev) for _ in range(8)]
    ints = [17 + i for i in range(16)]
    result = {
        "empty_launch_1_arg_us": host_us(lambda: _empty1[(1,)](x)),
        "empty_launch_24_args_us": host_us(lambda: _empty24[(1,)](*ptrs, *ints)),
        "kernels": {},
    }
    print({k: round(v, 1) for k, v in result.items() if k != "kernels"}, flush=True)
    real_run = JITFunction.run
    calls = {}
    for name, make in CASES.items():
        if name in ("qkv", "linear_act"):  # no Triton launch on these paths (cuBLAS)
            continue
        case = make()[0]
        inputs = case.build(dev, torch.bfloat16)
        fn = case.variants["fusionscope"]
        full = host_us(lambda fn=fn, i=inputs: fn(i))
        JITFunction.run = lambda self, *a, **k: None
        try:
            python_only = host_us(lambda fn=fn, i=inputs: fn(i))
        finally:
            JITFunction.run = real_run
        result["kernels"][name] = {
            "case": case.label,
            "host_us": full,
            "python_us": python_only,
            "triton_launch_us": full - python_only,
        }
        calls[name] = (fn, inputs)
        print(f"{name:15s} {case.label:30s} host {full:6.1f}  our python {python_only:6.1f}  "
              f"triton launch {full - python_only:6.1f} µs", flush=True)  # fmt: skip
    slowest = max(result["kernels"], key=lambda k: result["kernels"][k]["host_us"])
    fn, inputs = calls[slowest]
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(500):
        fn(inputs)
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
    result["profile_of"] = slowest
    result["profile"] = text.getvalue()
    print(text.getvalue())
    result["meta"] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
