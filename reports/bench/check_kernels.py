"""GPU-only checks of the bundled kernels, run on the H200 by reports/bench/gpu_kernels.sh.

For each kernel, on one decode and one prefill shape of its bench cases (bf16):
- launches per call: kernels the profiler sees for one eager call (expected: 1; `sample`: its seed draw plus one
  launch for top_k = 1, two for the candidates path; `w4a16_gemm`: two where a decode shape splits K, the partial sums
  and their fixed-order sum);
- no hidden copy: no memcpy and no copy/cast kernel besides ours for contiguous inputs;
- no memset of ours: device memsets (a driver operation, not a kernel launch) are allowed only where cuBLAS issues
  them for its own workspace, i.e. no more of them than the case's unfused eager call (whose GEMM is cuBLAS's too)
  issues in the same run (`reports/bench/tune_linear_act.py` lists which GEMM forms issue one at which shapes);
- `fusionscope::<op>` appears in the graph torch.compile(fullgraph=True) traces, and the compiled call equals eager;
- CUDA-graph replay equals eager;
- a second eager call with fresh inputs of the same metadata replays the recorded launches (see
  `kernels/dispatch.py`; required of the kernels in REPLAYED, reported for the others) and its result equals the same
  call through Triton's usual launch path.
Writes a JSON list of results to the path given as the first argument and exits non-zero if any check fails.
(torch.compile cannot run these kernels on a CPU, which is why these checks live here and not in the CPU suite.)
"""

from __future__ import annotations

import json
import sys

import torch
from fusionscope.kernels import dispatch
from torch.profiler import ProfilerActivity, profile

from fusionscope.bench.cases import CASES

# sample's forms: (top_k, top_p, launches). Every call first draws its Philox seed on the device (a 1-element
# `torch.randint`, so that CUDA-graph replays draw fresh numbers), then runs the one-launch kernel (top_k = 1: argmax)
# or the two-launch path (1 < top_k <= 64).
SAMPLE_FORMS = {"": (1, 1.0, 2), " top-k 50 top-p 0.9": (50, 0.9, 3)}
# kernels that may launch more than once per call: w4a16_gemm's split-K decode schedule writes fp32 partial sums, then
# a second launch adds them in a fixed order (`kernels/w4a16_gemm.py`, `schedule`)
MAX_LAUNCHES = {"w4a16_gemm": 2}
OP_NAMES = {"qkv": None, "linear_act": "linear_act"}  # qkv is one cuBLAS GEMM: no custom op to find
# launchers that only compute launch parameters and launch: a repeated call must replay. (linear_act's cuBLASLt
# path and sample's two-launch path allocate or call torch ops, so they run their launcher on every call.)
REPLAYED = {"rms_norm", "add_rms_norm", "silu_and_mul", "gelu_and_mul", "rope", "rope_and_cache", "add_layer_norm",
            "bias_gelu"}  # fmt: skip


def device_work(fn) -> tuple[list[str], list[str]]:
    """What one call puts on the GPU, as the profiler names it: (kernels and memcpys, memsets)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return [n for n in names if not n.startswith("Memset")], [n for n in names if n.startswith("Memset")]


def compiled_ops(fn) -> tuple[set[str], object]:
    seen: set[str] = set()

    def backend(gm: torch.fx.GraphModule, _inputs):
        seen.update(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, fullgraph=True, backend=backend)()
    return seen, out


def same(a, b) -> bool:
    a = a if isinstance(a, (tuple, list)) else (a,)
    b = b if isinstance(b, (tuple, list)) else (b,)
    return all(torch.equal(x, y) for x, y in zip(a, b) if isinstance(x, torch.Tensor))


def graph_replay(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return static_out


def make_call(name: str, case, form: str, inputs: dict):
    """The call to check and the most launches it may make: our variant of the case (sample in a deterministic form,
    so that compiled, replayed and eager results can be equal)."""
    if name != "sample":
        return (lambda f=case.variants["fusionscope"], i=inputs: f(i)), MAX_LAUNCHES.get(name, 1)
    from fusionscope.kernels.sample import sample

    k, p, max_launches = SAMPLE_FORMS[form]
    if k > 1:  # one token per row far above the rest: top-p keeps it alone
        rows = torch.arange(inputs["logits"].shape[0], device="cuda")
        inputs["logits"][rows, inputs["logits"].argmax(-1)] += 1000.0
    return (lambda i=inputs, k=k, p=p: sample(i["logits"], 1.0, k, p)), max_launches


def replay_check(name: str, case, form: str) -> tuple[bool, bool]:
    """Call on fresh inputs after earlier calls of the same metadata: (replayed, equal to Triton's usual launch)."""
    replays = []
    real_replay = dispatch._replay
    dispatch._replay = lambda *a: (replays.append(1), real_replay(*a))
    try:
        torch.manual_seed(1234)
        fresh, _ = make_call(name, case, form, case.build(torch.device("cuda"), torch.bfloat16))
        replayed_out = fresh()
    finally:
        dispatch._replay = real_replay
    lean = dict(dispatch.LEAN)
    dispatch.LEAN["enabled"] = False
    try:
        torch.manual_seed(1234)
        same_inputs, _ = make_call(name, case, form, case.build(torch.device("cuda"), torch.bfloat16))
        usual_out = same_inputs()
    finally:
        dispatch.LEAN.update(lean)
    return bool(replays), same(replayed_out, usual_out)


def main(path: str) -> int:
    results, failed = [], 0
    for name, make_cases in CASES.items():
        cases = make_cases()
        picked = [cases[0], *[c for c in cases if c.phase != cases[0].phase][:1]]
        for case, form in [(c, f) for c in picked for f in (SAMPLE_FORMS if name == "sample" else [""])]:
            inputs = case.build(torch.device("cuda"), torch.bfloat16)
            fn, max_launches = make_call(name, case, form, inputs)
            eager = fn()
            row = {"kernel": name, "case": case.label + form}
            try:
                row["kernel_names"], memsets = device_work(fn)
                row["launches"], row["memsets"] = len(row["kernel_names"]), len(memsets)
                copies = [k for k in row["kernel_names"] if "copy" in k.lower() or "Memcpy" in k]
                row["hidden_copies"] = len(copies)
                if memsets:  # only cuBLAS's own: the unfused call's GEMM issues as many
                    row["eager_memsets"] = len(device_work(lambda c=case, i=inputs: c.variants["eager"](i))[1])
                row["memsets_ok"] = row["memsets"] <= row.get("eager_memsets", 0)
                row["launch_ok"] = row["launches"] <= max_launches and not copies and row["memsets_ok"]
                op = OP_NAMES.get(name, name)
                ops, compiled_out = compiled_ops(fn)
                row["compiled_graph_ops"] = sorted(o for o in ops if "fusionscope" in o)
                row["op_in_compiled_graph"] = op is None or any(f"fusionscope.{op}" in o for o in ops)
                row["compiled_equals_eager"] = same(compiled_out, eager)
                row["cuda_graph_equals_eager"] = same(graph_replay(fn), eager)
                row["replayed"], row["replay_equals_usual_launch"] = replay_check(name, case, form)
                row["replay_ok"] = row["replay_equals_usual_launch"] and (row["replayed"] or name not in REPLAYED)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            ok = all(
                row.get(k, False)
                for k in (
                    "launch_ok",
                    "op_in_compiled_graph",
                    "compiled_equals_eager",
                    "cuda_graph_equals_eager",
                    "replay_ok",
                )
            )
            row["ok"] = ok
            failed += not ok
            results.append(row)
            print(("PASS " if ok else "FAIL ") + json.dumps(row), flush=True)
            del inputs
            torch.cuda.empty_cache()
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}, f, indent=1)
    print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
