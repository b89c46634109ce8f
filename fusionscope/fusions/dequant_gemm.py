"""dequant_gemm: a weight-only quantised Linear that dequantises in its forward (unpack packed int4/int8 with shifts and
masks, cast, subtract the zero point, multiply by the scales) and then runs a plain matmul → one
`fusionscope.kernels.w4a16_gemm` launch that reads the packed weight and dequantises in registers (W4A16).

Pattern, on the dataflow: a matmul (`aten::mm` / `addmm` / `bmm`) whose weight operand, walked up through views and
dequantisation ops (`bitwise_and`, `bitwise_right_shift`/`__rshift__`, `stack`/`cat`, `slice`, `permute`,
`_to_copy`, `sub`, `mul`, ...), reaches at least one bitwise op: that walk plus the matmul is the group. Per forward:
one match per such Linear.
Bytes for an out×in weight packed at b bits (s = activation size, x of m rows, groups of g inputs): unfused ≈
out·in·(b/8 read + several uint8/int32 temporaries + 2·s per float op, read and written) + the matmul reading the
out·in·s dequantised weight (≈ 38.5·out·in in bf16 for `PlainW4Linear`, counted op by op in
`fusionscope.kernels.w4a16_gemm`); fused out·in·b/8 + out·(in/g)·(s + 1) for the scales and zeros + (m·in +
m·out)·s: the dequantised weight never reaches memory.

Estimate. The finder prices the fused kernel generically (`fusionscope.opportunities`): the group's external inputs
read once — here exactly the kernel's operands: the packed int32 weight, the scales, the uint8 zeros and x (plus the
8-element shift constant) — and its output written once, at the measured copy bandwidth, plus one launch floor; the
FLOPs at the tensor cores' peak never bind at decode. That is the bytes-at-the-roof model of the W4A16 kernel above:
0.5 + (s + 1)/g bytes per weight. It missed by +166% on llama-3.1-8b (2026-12-02) because the kernel it prices — a
CUDA-core GEMV at 6–8 instructions per weight — runs well below that roof (reports/w4a16/README.md).
Not counted: a decode call split along K also writes and reads back splits·m·out fp32 partial sums (≈ 3% of the
weight bytes at m = 1 on Llama-3-8B's shapes), and the weights' K is padded to a multiple of 128.

Not in the group (misses): weights dequantised once and cached (nothing to fuse per step), library kernels that already
dequantise inside (`aten::_weight_int4pack_mm`, `_weight_int8pack_mm`, bitsandbytes, GPTQ/AWQ extensions — one op
already), and scale/zero-point preparation computed from parameters outside the weight's walk.

Patching (`patch`): a `PlainW4Linear` (`fusionscope.apply.quantize`, what `quantize_model` puts in a float model) gets
a forward that calls the kernel on its own `qweight`, `scales`, `zeros` and bias — the same tensors, read at call
time: that module holds fusionscope's packed layout already (packed once by `quantize_w4`, `from_gptq` or `from_awq`),
so nothing is converted or copied, and restoring the forward
restores the model exactly. Any other module the finder matched is refused with the
reason: its forward's layout is not one the patch can vouch for (a GPTQ or AWQ checkpoint converts once, at load time,
with `from_gptq` / `from_awq` into a `PlainW4Linear`). In training mode the class's forward runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from fusionscope.apply.patcher import Support
from fusionscope.apply.source import forward_replaced, unless_training
from fusionscope.fusions.base import Graph, Match

if TYPE_CHECKING:
    import torch
    from torch import nn

    from fusionscope.apply.patcher import Patcher
    from fusionscope.bench.cases import Case

KEY = "dequant_gemm"
KERNEL = "w4a16_gemm"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2")
TITLE = "dequantise (unpack, shift, mask, scale) + GEMM → one W4A16 kernel"

_MATMULS = frozenset({"aten::mm", "aten::addmm", "aten::bmm"})
_BITWISE = frozenset({"aten::bitwise_and", "aten::bitwise_or", "aten::bitwise_right_shift", "aten::bitwise_left_shift",
                      "aten::__rshift__", "aten::__lshift__", "aten::__and__", "aten::__or__"})  # fmt: skip
_DEQUANT = _BITWISE | frozenset({
    "aten::_to_copy", "aten::sub", "aten::mul", "aten::add", "aten::div", "aten::stack", "aten::cat", "aten::view",
    "aten::reshape", "aten::_unsafe_view", "aten::unsqueeze", "aten::expand", "aten::t", "aten::transpose",
    "aten::permute", "aten::clone", "aten::repeat_interleave", "aten::index_select", "aten::_reshape_alias",
    "aten::slice", "aten::alias",
})  # fmt: skip


def weight_walk(graph: Graph, node: int) -> set[int]:
    """`node` and every dequantisation op above it (views included), stopping at leaves and at other ops."""
    found: set[int] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if n < 0 or n in found or graph.name.get(n) not in _DEQUANT:
            continue
        found.add(n)
        todo.extend(graph.producers(n))
    return found


def find(graph: Graph) -> list[Match]:
    matches = []
    for mm in (n for n, op in graph.name.items() if op in _MATMULS):
        for operand in graph.producers(mm):
            walk = weight_walk(graph, operand)
            if not any(graph.name[n] in _BITWISE for n in walk):
                continue
            group = walk | {mm}
            phase, step = graph.where(mm)
            matches.append(Match(KEY, phase, step, tuple(sorted(group)), graph.module[mm],
                                 escaping=graph.escaping(group, {mm})))  # fmt: skip
            break
    return matches


def micro_case(graph: Graph, match: Match) -> Case | None:
    """The unfused dequantise + cuBLAS chain vs `w4a16_gemm` on this match's (M, K) × (K, N), at the group size the
    chain expands its scales by (the `clone` of an (G, g, N) expansion); 128 when the match shows none."""
    from fusionscope.bench.cases import w4a16_case

    shapes = graph.column("input_shapes")
    mm = next((n for n in match.nodes if graph.name.get(n) in _MATMULS), None)
    operands = shapes.get(mm, ()) if mm is not None else ()
    x, w = operands[-2:] if len(operands) >= 2 else ((), ())
    if len(x) != 2 or len(w) != 2:
        return None
    expansions = [shapes.get(n, ((),))[0] for n in sorted(match.nodes) if graph.name.get(n) == "aten::clone"]
    groups = [e[1] for e in expansions if len(e) == 3 and e[2] == w[1]]
    return w4a16_case(x[0], x[1], w[1], groups[0] if groups else 128)


def patch(patcher: Patcher, paths: list[str]) -> dict[str, Support]:
    """Put `w4a16_gemm` into each `PlainW4Linear` at `paths`; one Support per path."""
    try:
        from fusionscope.kernels.w4a16_gemm import w4a16_gemm as kernel
    except ImportError as error:
        return {path: Support.no(f"the w4a16_gemm kernel does not load here: {error}") for path in paths}
    from fusionscope.apply.quantize import PlainW4Linear

    supports = {}
    for path in paths:
        module = patcher.module(path)
        if module is None:
            supports[path] = Support.no("the model has no module at this path")
        elif type(module) is not PlainW4Linear:
            supports[path] = Support.no(
                f"{type(module).__name__} is not a PlainW4Linear: the kernel serves fusionscope's packed int4 layout "
                "and that module's forward only (GPTQ/AWQ tensors convert with from_gptq / from_awq)"
            )
        elif reason := forward_replaced(module, patcher):
            supports[path] = Support.no(reason)
        else:
            patcher.set_forward(module, unless_training(_fused_forward(kernel)), owner=KEY)
            supports[path] = Support.yes()
    return supports


def _fused_forward(kernel: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """PlainW4Linear's forward in one kernel launch on the module's own packed tensors."""

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return kernel(x, self.qweight, self.scales, self.zeros, self.group_size, self.bias)

    return forward
