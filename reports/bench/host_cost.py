"""Where the host time of one eager kernel call goes, on the GPU machine.

Usage (on the GPU machine): python3 reports/bench/host_cost.py OUT.json

Per kernel, at its first decode shape (bf16), host µs per call of our public function (a back-to-back loop, as in
`bench`) along each launch path of `kernels/dispatch.py`:
- `replay_us`: the default — a call whose metadata was seen before launches the recorded kernels directly;
- `lean_launch_us`: replays off, the launcher runs and `LeanKernel` launches its compiled kernel;
- `triton_launch_us`: both off, Triton's usual `kernel[grid](...)`;
- `python_us`: the replay with the final launch call stubbed out (checks, allocation, key, lookup: our Python),
  so `replay_us - python_us` is what the compiled kernel's launcher itself costs;
beside an empty Triton kernel launched the usual way with 1 and with 24 arguments, and launched straight through
its compiled kernel's launcher (the floor for any Python launch of that kernel). Every figure is from this one
process: the host's speed varies between device calls (an empty launch measured 10–19 µs on different calls).
Then a cProfile of 2000 replayed calls of the kernel with the most arguments (rope).
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
from fusionscope.kernels import dispatch

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
    for _ in range(50):  # warm: compiled, recorded, allocator primed
        fn()
    return host_and_call_us(fn, calls)[0]


def paths(fn) -> dict[str, float]:
    """Host µs per call of `fn` along each launch path (module docstring)."""
    result = {"replay_us": host_us(fn)}
    real_launch = dispatch._launch_compiled
    dispatch._launch_compiled = lambda *a: None
    try:
        result["python_us"] = host_us(fn)
    finally:
        dispatch._launch_compiled = real_launch
    lean = dict(dispatch.LEAN)
    dispatch.LEAN["replay"] = False
    try:
        result["lean_launch_us"] = host_us(fn)
        dispatch.LEAN["enabled"] = False
        result["triton_launch_us"] = host_us(fn)
    finally:
        dispatch.LEAN.update(lean)
    return result


def main(path: Path) -> None:
    dev = torch.device(DEVICE)
    x = torch.empty(16, device=dev)
    ptrs = [torch.empty(16, device=dev) for _ in range(8)]
    ints = [17 + i for i in range(16)]
    compiled = _empty1[(1,)](x)
    result = {
        "empty_launch_1_arg_us": host_us(lambda: _empty1[(1,)](x)),
        "empty_launch_24_args_us": host_us(lambda: _empty24[(1,)](*ptrs, *ints)),
        "empty_compiled_launch_1_arg_us": host_us(lambda: dispatch._launch_compiled(compiled, (1, 1, 1), (x,), 0)),
        "kernels": {},
    }
    print({k: round(v, 1) for k, v in result.items() if k != "kernels"}, flush=True)
    calls = {}
    for name, make in CASES.items():
        if name in ("qkv", "linear_act"):  # no Triton launch on these paths (cuBLAS)
            continue
        case = make()[0]
        inputs = case.build(dev, torch.bfloat16)
        fn = case.variants["fusionscope"]
        row = {"case": case.label, **paths(lambda fn=fn, i=inputs: fn(i))}
        row["replayed"] = any(plan is not None for plan in dispatch._PLANS.values())
        dispatch.forget_plans()
        result["kernels"][name] = row
        calls[name] = (fn, inputs)
        empty = result["empty_launch_1_arg_us"]
        print(f"{name:15s} {case.label:30s} " + "  ".join(
            f"{k.removesuffix('_us')} {v:6.1f}" for k, v in row.items() if k.endswith("_us")
        ) + f"  replay/empty {row['replay_us'] / empty:4.2f}x  replayed {row['replayed']}", flush=True)  # fmt: skip
    fn, inputs = calls["rope"]
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(2000):
        fn(inputs)
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
    result["profile_of"] = "rope"
    result["profile"] = text.getvalue()
    print(text.getvalue())
    result["meta"] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
