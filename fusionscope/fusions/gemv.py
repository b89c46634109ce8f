"""gemv: a Linear applied to one row (batch-1 decode) → one `fusionscope.kernels.gemv` launch, its bias in the epilogue.

Not a fusion of several ops so much as the right kernel for one: at decode every projection is a matrix-vector
product whose whole cost is streaming the weight, and cuBLAS's choice for the narrower ones (the `64x8` split-K tiles
and their second, summing launch) reads at 62–77% of copy bandwidth in the H200's replayed decode steps. The GEMV
kernel reads them at 2.7–4.1 TB/s: 1.05–1.39× cuBLAS on the narrow projections of six families, a wash on the wide
ones (`reports/gemv/`).

Pattern, on the dataflow, outside prefill (decode steps, a captured graph): `aten::mm(x, t(W))` or
`aten::addmm(b, x, t(W))` — a Linear: W a parameter reaching the GEMM through its own `t` — whose activation operand x
has one row, in fp32/fp16/bf16 like W; with its output views and, after an `mm`, an `aten::add` of a bias parameter.
Not matched:
- GEMMs an earlier catalogue entry takes (`dequant_gemm`, `linear_act`'s epilogue, `qkv` and `gate_up`);
- a weight that is not a Linear's (GPT-2's `Conv1D` hands W as (K, N), which the kernel would read across rows);
- outputs wider than `WIDEST`: there cuBLAS streams the weight at the copy roof already (0.98–1.01× at 16384–28672
  outputs), so the match would promise nothing, and the LM head stays cuBLAS's.
Per step: the projections the horizontal fusions leave (o_proj, down_proj; Phi-3's fused qkv_proj and down_proj;
GPT-NeoX's query_key_value, dense, dense_4h_to_h), L or more.

Bytes, x (1, K), W (N, K), element size s: cuBLAS split-K reads N·K·s + K·s and writes and re-reads fp32 partial sums
(2·splits·N·4) in 2 launches; the GEMV N·K·s + K·s + N·s (+ N·s bias) in 1. The estimate (`opportunities`) charges
the fused kernel its bytes at the copy roof plus one launch, against the measured cuBLAS kernels of the site.

Patching: on the captured graph (`bind`), the GEMM, its views and its bias add become one `gemv(x, W, b)` call; the
layout patch (`patch`) binds a forward on each matched `nn.Linear` instance that calls `gemv`, which hands any call
of more than one row back to `F.linear` (prefill runs cuBLAS, decode the GEMV).
A GLU before it (`PROLOGUES`, opt-in: FUSIONSCOPE_GEMV_PROLOGUE=1): where the x of a bound `gemv` call is the output
of a bound `silu_and_mul` or `gelu_and_mul` call that nothing else reads (a GLU MLP's down_proj at decode), the
rewrite's `fold_prologues` makes the two one `gemv_gated(gate, up, W, b)`, which computes x in the GEMV's loop, bit for
bit as the GLU kernel writes it: one launch less per MLP and decode step, but measured slower than the pair (below).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from fusionscope.apply.patcher import Support
from fusionscope.apply.source import forward_replaced, kernel_dtypes, unless_training
from fusionscope.dataflow_nodes import LEAF
from fusionscope.fusions.base import Binding, Graph, In, Match, leaf_input
from fusionscope.fusions.gelu_and_mul import fused_gelu_and_mul
from fusionscope.fusions.silu_and_mul import fused_silu_and_mul

if TYPE_CHECKING:
    import torch
    from torch import nn

    from fusionscope.apply.patcher import Patcher
    from fusionscope.bench.cases import Case

KEY = "gemv"
KERNEL = "gemv"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo2", "gpt_neox", "starcoder2")
TITLE = "one-row Linear (decode) → one streaming GEMV, bias in its epilogue"
GEMMS = {"aten::mm": (0, 1), "aten::addmm": (1, 2)}  # operand index of the activation and of the weight
DTYPES = ("float32", "float16", "bfloat16")
WIDEST = 12288  # outputs; wider ones are cuBLAS's (module docstring)


def _output_chain(graph: Graph, gemm: int) -> list[int]:
    """The GEMM, its output views in its module, and a bias `add` of a parameter after an `mm`, in order."""
    is_view = graph.column("is_view", False)
    module = graph.module.get(gemm)
    chain = [gemm]
    for _ in range(4):
        after = graph.only_consumer(chain[-1])
        if graph.module.get(after) != module:
            break
        bias_add = (graph.name.get(gemm) == "aten::mm" and graph.name.get(after) == "aten::add"
                    and sorted(graph.inputs.get(after, ())) == [LEAF, chain[-1]])  # fmt: skip
        if not (is_view.get(after, False) or bias_add):
            break
        chain.append(after)
        if bias_add:
            break
    return chain


def _linear_operands(graph: Graph, gemm: int) -> tuple[tuple, tuple, str] | None:
    """(x's shape, W's (K, N) shape as the GEMM reads it, dtype) of a GEMM whose weight is a Linear's `t` of a
    parameter; None for any other GEMM or a trace without shapes."""
    xi, wi = GEMMS[graph.name[gemm]]
    weight_t = graph.producer(gemm, wi)
    if graph.name.get(weight_t) != "aten::t" or graph.producer(weight_t) != LEAF:
        return None
    shapes = graph.column("input_shapes", ()).get(gemm) or ()
    dtypes = graph.column("input_dtypes", ()).get(gemm) or ()
    if len(shapes) <= wi or len(dtypes) <= wi or len(shapes[xi]) != 2 or len(shapes[wi]) != 2:
        return None
    if dtypes[xi] != dtypes[wi]:
        return None
    return tuple(shapes[xi]), tuple(shapes[wi]), str(dtypes[xi])


def find(graph: Graph) -> list[Match]:
    matches = []
    for gemm, name in graph.name.items():
        if name not in GEMMS or (operands := _linear_operands(graph, gemm)) is None:
            continue
        (rows, _k), (_k2, width), dtype = operands
        if rows != 1 or dtype not in DTYPES or width > WIDEST:
            continue
        phase, step = graph.where(gemm)
        if phase == "prefill":  # a prompt's one-row GEMM (the LM head on its last position) runs once per prompt
            continue
        chain = _output_chain(graph, gemm)
        matches.append(Match(KEY, phase, step, tuple(sorted(chain)), graph.module[gemm],
                             escaping=graph.escaping(set(chain), {chain[-1]})))  # fmt: skip
    return matches


def micro_case(graph: Graph, match: Match) -> Case | None:
    """cuBLAS (`F.linear`) vs the GEMV on this match's (1, K) × (K, N), with its bias if it has one."""
    from fusionscope.bench.cases import gemv_case

    gemm = next((n for n in match.nodes if graph.name.get(n) in GEMMS), -1)
    operands = _linear_operands(graph, gemm) if gemm >= 0 else None
    if operands is None:
        return None
    (_rows, hidden), (_k, width), _dtype = operands
    has_bias = graph.name[gemm] == "aten::addmm" or any(graph.name.get(n) == "aten::add" for n in match.nodes)
    return gemv_case(hidden, width, has_bias)


def bind(graph: Graph, match: Match) -> Binding | str:
    """One `gemv(x, W, b)` in place of the Linear's GEMM, its output views and its bias add; the result keeps x's
    leading dims, so a group whose views regroup the GEMM's columns is refused."""
    gemm = next((n for n in match.nodes if graph.name.get(n) in GEMMS), -1)
    if gemm < 0:
        return "the group has no GEMM"
    xi, wi = GEMMS[graph.name[gemm]]
    scalars = graph.column("scalars", ()).get(gemm) or ()
    if any(t.startswith(("beta=", "alpha=")) and float(t.split("=")[1]) != 1.0 for t in scalars):
        return "the GEMM scales its terms (addmm's beta/alpha)"
    bias: Any = In(gemm, 0) if graph.name[gemm] == "aten::addmm" else None
    adds = [n for n in match.nodes if graph.name.get(n) == "aten::add"]
    if adds:
        bias = In(adds[0], leaf_input(graph, adds[0]))
    end = max(match.nodes)
    columns = (graph.column("output_shapes", ()).get(gemm) or ((),))[0]
    out_shape = (graph.column("output_shapes", ()).get(end) or ((),))[0]
    if not columns or not out_shape or out_shape[-1] != columns[-1]:
        return "views after the GEMM regroup its columns; the kernel's result keeps x's leading dims"
    weight = In(graph.producer(gemm, wi), 0)  # the parameter under the Linear's `t`
    return Binding(fused_gemv, (In(gemm, xi, through_views=True), weight, bias), (end,), match.nodes)


def fused_gemv(x: Any, weight: Any, bias: Any) -> Any:
    from fusionscope.kernels import gemv

    return gemv(x, weight, bias)


def fused_gemv_silu(gate: Any, up: Any, weight: Any, bias: Any) -> Any:
    """`fused_gemv(fused_silu_and_mul(gate, up), weight, bias)` in one launch, the same result bit for bit."""
    from fusionscope.kernels import gemv_gated

    return gemv_gated(gate, up, weight, bias, "silu")


def fused_gemv_gelu(gate: Any, up: Any, approximate: str, weight: Any, bias: Any) -> Any:
    """`fused_gemv(fused_gelu_and_mul(gate, up, approximate), weight, bias)` in one launch, the same bit for bit."""
    from fusionscope.kernels import gemv_gated

    return gemv_gated(gate, up, weight, bias, "gelu_tanh" if approximate == "tanh" else "gelu")


# (this entry's call, the call that makes its x) -> the one call doing both, on the producer's arguments followed by
# this call's after x (`fusionscope.apply.rewrite.fold_prologues`)
GATED_PROLOGUES = {(fused_gemv, fused_silu_and_mul): fused_gemv_silu, (fused_gemv, fused_gelu_and_mul): fused_gemv_gelu}
# Off unless FUSIONSCOPE_GEMV_PROLOGUE=1: on an H100 (2026-12-06, `reports/gemv/gated.json`) the folded kernel took
# 46.2 µs against the pair's 41.8 at llama-3.1-8b's down_proj (0.90×; 0.89–0.99× on qwen3-8b, olmo-2-7b, phi-3-mini):
# each program evaluates the activation over all of K, and the instructions cost more than the launch saved.
PROLOGUES = GATED_PROLOGUES if os.environ.get("FUSIONSCOPE_GEMV_PROLOGUE", "0") == "1" else {}


# ------------------------------------------------------------------------------------------------------------ patch


def linear_forward(kernel: Any) -> Any:
    """An nn.Linear's forward through `kernel` (gemv: one row streams, more rows go to F.linear); the class's forward
    in training mode (the kernel keeps no autograd history)."""

    def forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
        return kernel(input, self.weight, self.bias)

    return unless_training(forward)


def patch(patcher: Patcher, paths: list[str]) -> dict[str, Support]:
    """Each `nn.Linear` at `paths` (the finder's GEMM modules) → a forward that calls `gemv`; one Support each."""
    try:
        from fusionscope.kernels import gemv
    except ImportError as error:
        return {path: Support.no(f"the gemv kernel does not load here: {error}") for path in paths}
    from torch import nn

    results = {}
    for path in paths:
        linear = patcher.module(path)
        if linear is None:
            results[path] = Support.no("the model has no module at this path")
        elif not isinstance(linear, nn.Linear) or type(linear).forward is not nn.Linear.forward:
            results[path] = Support.no(f"{type(linear).__name__} is not a plain nn.Linear")
        elif replaced := forward_replaced(linear, patcher):
            results[path] = Support.no(replaced)
        elif linear.weight.dtype not in kernel_dtypes():
            results[path] = Support.no(f"the gemv kernel takes fp32, fp16 or bf16 weights; this one is "
                                       f"{linear.weight.dtype}")  # fmt: skip
        else:
            patcher.set_forward(linear, linear_forward(gemv), owner=KEY)
            results[path] = Support.yes()
    return results
