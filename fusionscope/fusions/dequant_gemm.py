"""dequant_gemm: a weight-only quantised Linear that dequantises in its forward (unpack packed int4/int8 with shifts and
masks, cast, subtract the zero point, multiply by the scales) and then runs a plain matmul → one dequantising GEMM that
reads the packed weight and dequantises in registers. Its kernel comes later (KERNEL None).

Pattern, on the dataflow: a matmul (`aten::mm` / `addmm` / `bmm`) whose weight operand, walked up through views and
dequantisation ops (`bitwise_and`, `bitwise_right_shift`/`__rshift__`, `stack`/`cat`, `_to_copy`, `sub`, `mul`, ...),
reaches at least one bitwise op: that walk plus the matmul is the group. Per forward: one match per such Linear.
Bytes for an out×in weight packed at b bits (s = activation size, x of m rows): unfused ≈ out·in·(b/8 read + several
uint8 temporaries + 2·s per float op, read and written) + the matmul reading the out·in·s dequantised weight; fused
out·in·b/8 + the scales + (m·in + m·out)·s: the dequantised weight never reaches memory.

Not in the group (misses): weights dequantised once and cached (nothing to fuse per step), library kernels that already
dequantise inside (`aten::_weight_int4pack_mm`, `_weight_int8pack_mm`, bitsandbytes, GPTQ/AWQ extensions — one op
already), and scale/zero-point preparation computed from parameters outside the weight's walk.
"""

from __future__ import annotations

from fusionscope.fusions.base import Graph, Match

KEY = "dequant_gemm"
KERNEL = None  # its kernel comes later
NO_PATCH = "no bundled kernel yet: the W4A16 dequant + GEMM kernel is not shipped, so there is nothing to patch in"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2")
TITLE = "dequantise (unpack, shift, mask, scale) + GEMM → one kernel (kernel to come)"

_MATMULS = frozenset({"aten::mm", "aten::addmm", "aten::bmm"})
_BITWISE = frozenset({"aten::bitwise_and", "aten::bitwise_or", "aten::bitwise_right_shift", "aten::bitwise_left_shift",
                      "aten::__rshift__", "aten::__lshift__", "aten::__and__", "aten::__or__"})  # fmt: skip
_DEQUANT = _BITWISE | frozenset({
    "aten::_to_copy", "aten::sub", "aten::mul", "aten::add", "aten::div", "aten::stack", "aten::cat", "aten::view",
    "aten::reshape", "aten::_unsafe_view", "aten::unsqueeze", "aten::expand", "aten::t", "aten::transpose",
    "aten::permute", "aten::clone", "aten::repeat_interleave", "aten::index_select", "aten::_reshape_alias",
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
