"""What a trace from another program has already fused: compiled (Inductor/Triton) kernels, serving engines' kernels
and CUDA-graph replays, so `analyze` reports a catalogue entry as "active" instead of offering it again.

Three sources of evidence, all from kernel names (a trace carries nothing else that says what a kernel computes):

- **Inductor** names each generated kernel `triton_<kind>_fused_<op>_<op>_..._<n>` (torch/_inductor/codegen/triton.py,
  `define_kernel`): `<kind>` is the first three letters of its heuristic (`poi`ntwise, `red`uction, `per`sistent
  reduction, `tem`plate, `for`each, `spl`it scan, `unk`nown), the ops are the *original aten* overload packets the
  kernel's nodes came from (`torch._inductor.utils.get_fused_kernel_name`), de-duplicated and **sorted
  alphabetically** — so the name says which ops a kernel covers, never in which order, and at most
  `config.kernel_name_max_ops` (10) of them. Op names contain underscores (`native_layer_norm`, `_to_copy`); they are
  split by greedy longest match against the aten operator names the dispatcher knows.
- **Engines** ship hand-written fused kernels whose names are matched by `ENGINE_KERNELS`, a table of regular
  expressions taken from the public source names of vLLM, FlashInfer, SGLang (whose sgl-kernel mostly ships FlashInfer
  and vLLM kernels, attributed here by their C++ namespace when the name shows it), TensorRT-LLM, cuDNN, torch, Liger
  and fusionscope's own kernels. Engines rename kernels between releases: the table needs extending as they do.
- **CUDA graphs**: kernels replayed from a graph are launched by one `cudaGraphLaunch` call (see
  `graph_replay_share`).

qkv and gate_up (horizontal GEMM merges) cannot be recognised from names: a merged projection is an ordinary GEMM
kernel whose only trace is its shape.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import pandas as pd

from fusionscope.trace_events import group_rows

INDUCTOR_KINDS = {"poi": "pointwise", "red": "reduction", "per": "persistent_reduction", "tem": "template",
                  "for": "foreach", "spl": "split_scan", "unk": "unknown"}  # fmt: skip
_INDUCTOR = re.compile(r"^(?:\w+?_)?triton_(?P<kind>[a-z]{3})_(?:fused_?(?P<ops>\w*?))?(?P<suffix>(?:_\d[\dcde]*)+)$")
# Ops Inductor names kernels after that the aten dispatcher does not list (prims, higher-order operators).
_EXTRA_OPS = ("convert_element_type", "flex_attention", "flex_attention_backward", "triton_kernel_wrapper_functional")
_ACTIVATIONS = ("gelu", "silu", "relu", "tanh", "sigmoid", "hardswish", "leaky_relu", "elu")
_SDPA_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward",
             "flex_attention")  # fmt: skip
_WEAK_ADD_RMS = "the residual add and RMSNorm's ε add both name as `add`: the name cannot tell them apart"
_WEAK_ROPE = "rotate_half (neg, cat) with mul and add: rope's shape, but any rotation or concat could read the same"

STATUSES = ("active", "missing", "not applicable", "not found")


@dataclass(frozen=True)
class InductorKernel:
    """One Inductor-generated kernel read from its name. `ops` in name order (alphabetical); `covers` the catalogue
    keys it already fuses, `weak` the subset a name only suggests (`note` says why)."""

    name: str
    kind: str
    ops: tuple[str, ...]
    covers: tuple[str, ...]
    weak: tuple[str, ...] = ()
    note: str = ""


@dataclass(frozen=True)
class EngineKernel:
    """One row of the engine-kernel table: `pattern` is searched in the (demangled) kernel name; `key` is the
    catalogue entry it covers ("" when it covers none alone, e.g. a KV-cache write); `on_op` matches the launching
    aten op's name instead (torch kernels whose own names are generic)."""

    pattern: str
    key: str
    engine: str
    on_op: bool = False
    note: str = ""


def _k(pattern: str, key: str, engine: str, note: str = "") -> EngineKernel:
    return EngineKernel(pattern, key, engine, note=note)


# First match wins: specific names before the general ones they contain (FusedAddRMSNorm before RMSNorm).
ENGINE_KERNELS: tuple[EngineKernel, ...] = (
    # fusionscope's own Triton kernels (kernels/*.py `@triton.jit` names)
    _k(r"(?<!\w)_add_rms_norm_kernel\b", "add_rms_norm", "fusionscope"),
    _k(r"(?<!\w)_rms_norm_kernel\b", "rms_norm", "fusionscope"),
    _k(r"(?<!\w)_silu_and_mul_kernel\b", "silu_and_mul", "fusionscope"),
    _k(r"(?<!\w)_gelu_and_mul_kernel\b", "gelu_and_mul", "fusionscope"),
    _k(r"(?<!\w)_rope(?:_and_cache)?_kernel\b", "rope", "fusionscope"),
    _k(r"(?<!\w)_decode_attention(?:_combine)?_kernel\b", "decode_attention", "fusionscope"),
    _k(r"(?<!\w)_add_layer_norm_kernel\b", "add_layer_norm", "fusionscope"),
    _k(r"(?<!\w)_bias_gelu_kernel\b", "bias_gelu", "fusionscope"),
    _k(r"(?<!\w)_linear_act_kernel\b", "linear_act", "fusionscope"),
    _k(r"(?<!\w)_gemv_kernel\b", "gemv", "fusionscope"),
    _k(r"(?<!\w)_(?:sample|candidates|pick)_kernel\b", "sampling", "fusionscope"),
    # Liger (src/liger_kernel/ops/*.py)
    _k(r"(?<!\w)_fused_add_rms_norm_forward_kernel\b", "add_rms_norm", "liger"),
    _k(r"(?<!\w)_rms_norm_forward_kernel\b", "rms_norm", "liger"),
    _k(r"(?<!\w)_swiglu_forward_kernel\b", "silu_and_mul", "liger"),
    _k(r"(?<!\w)_geglu_tanh_forward_kernel\b", "gelu_and_mul", "liger"),
    _k(r"(?<!\w)_(?:triton_rope|rope_forward_kernel)\b", "rope", "liger"),
    # vLLM (csrc/layernorm_kernels.cu, activation_kernels.cu, pos_encoding_kernels.cu, cache_kernels.cu, attention/)
    _k(r"\bfused_add_rms_norm(?:_static_fp8_quant)?_kernel\b", "add_rms_norm", "vllm"),
    _k(r"\brms_norm(?:_static_fp8_quant)?_kernel\b", "rms_norm", "vllm"),
    _k(r"\bact_and_mul_kernel\b.*gelu", "gelu_and_mul", "vllm", "the activation is a template argument"),
    _k(r"\bact_and_mul_kernel\b", "silu_and_mul", "vllm", "the activation is a template argument"),
    _k(r"\bsilu_and_mul(?:_quant)?_kernel\b", "silu_and_mul", "vllm"),
    _k(r"\bgelu(?:_tanh)?_and_mul_kernel\b", "gelu_and_mul", "vllm"),
    _k(r"\b(?:batched_)?rotary_embedding_kernel\b", "rope", "vllm"),
    _k(r"\breshape_and_cache(?:_flash)?_kernel\b", "", "vllm", "KV-cache write: rope's optional second half, no entry"),
    _k(r"\bpaged_attention_v[12](?:_reduce)?_kernel\b", "flash_attention", "vllm"),
    _k(r"\btopk_topp_\w+", "sampling", "vllm"),
    _k(r"\bMarlin\b|\bmarlin::|\bgemm_half_q_half\w*|\bawq_gemm\w*|\bmachete\w*", "dequant_gemm", "vllm"),
    # FlashAttention 2/3 (also torch's SDPA flash backend: `pytorch_flash::flash_fwd_kernel`)
    _k(r"\bflash_fwd_\w*kernel\b|\bFlashAttnFwdSm\d+", "flash_attention", "flash-attn"),
    # FlashInfer (include/flashinfer/*.cuh)
    _k(r"\bBatch(?:Decode|Prefill)With\w*", "flash_attention", "flashinfer"),
    _k(r"\bSingle(?:Decode|Prefill)WithKVCache\w*", "flash_attention", "flashinfer"),
    _k(r"\b(?:Gemma)?FusedAddRMSNorm\w*", "add_rms_norm", "flashinfer"),
    _k(r"\b(?:Gemma|QK)?RMSNorm\w*", "rms_norm", "flashinfer"),
    _k(r"\bSiluAndMul\w*", "silu_and_mul", "flashinfer"),
    _k(r"\bGelu(?:Tanh)?AndMul\w*", "gelu_and_mul", "flashinfer"),
    _k(r"\bBatchQKApply\w*Rotary\w*", "rope", "flashinfer"),
    _k(r"\b(?:TopKTopP|TopK|TopP|MinP)?SamplingFrom(?:Probs?|Logits)\w*", "sampling", "flashinfer"),
    # torch (memory-efficient SDPA) before TensorRT-LLM's fmha names
    _k(r"\bfmha_cutlass[FB]\w*", "flash_attention", "torch"),
    # TensorRT-LLM (cpp/tensorrt_llm/kernels/)
    _k(r"\bfmha(?:_v2_\w+|Sm\d+\w*|_\w+_kernel\b)", "flash_attention", "tensorrt-llm"),
    _k(r"\bxqa_kernel\w*", "flash_attention", "tensorrt-llm", "XQA decode attention; name as its cubins are named"),
    _k(r"(?i:general_?rms_?norm)", "rms_norm", "tensorrt-llm"),
    # cuDNN SDPA (torch's cuDNN attention backend, the default for SDPA on H100/H200)
    _k(r"\bcudnn_generated_fort_native_sdpa\w*", "flash_attention", "cudnn"),
    # torch's fused ops whose kernels carry generic names: matched on the launching aten op
    EngineKernel(r"\baten::_fused_rms_norm\b", "rms_norm", "torch", on_op=True),
    EngineKernel(r"\baten::(?:" + "|".join(_SDPA_OPS[:-1]) + r")\b", "flash_attention", "torch", on_op=True),
    _k(r"\bscaled_dot_product_(?:flash|efficient|cudnn)\w*", "flash_attention", "torch"),
)
# Engine named by the kernel's C++ namespace, where the name shows one (sgl-kernel ships FlashInfer/vLLM code).
_NAMESPACES = (("flashinfer::", "flashinfer"), ("vllm::", "vllm"), ("tensorrt_llm::", "tensorrt-llm"),
               ("pytorch_flash::", "torch"), ("PyTorchMemEffAttention", "torch"),
               ("sgl_kernel", "sglang"), ("sglang", "sglang"))  # fmt: skip
_COMPILED = tuple((re.compile(e.pattern), e) for e in ENGINE_KERNELS)


@functools.cache
def aten_vocabulary() -> frozenset[str]:
    """Every aten (and prims) overload-packet name the dispatcher knows, e.g. `native_layer_norm`, `_to_copy`.
    In-place variants (trailing `_`) are left out: Inductor functionalises graphs, so they never name a kernel, and
    keeping them would let `add_` swallow the separator of `add__to_copy`."""
    import torch

    names = set(_EXTRA_OPS)
    for full in torch._C._dispatch_get_all_op_names():
        namespace, _, rest = full.partition("::")
        if namespace in ("aten", "prims"):
            names.add(rest.split(".", 1)[0])
    return frozenset(n for n in names if n and not n.endswith("_"))


def split_ops(joined: str, vocabulary: frozenset[str] | None = None) -> tuple[str, ...]:
    """`_to_copy_add_mean_mul_pow_rsqrt` → (`_to_copy`, `add`, `mean`, `mul`, `pow`, `rsqrt`): at each position the
    longest vocabulary name that ends at a `_` boundary; a token no name matches is kept as it is."""
    vocab = aten_vocabulary() if vocabulary is None else vocabulary
    ops: list[str] = []
    i = 0
    while i < len(joined):
        ends = [j for j in range(i + 1, len(joined) + 1) if j == len(joined) or joined[j] == "_"]
        match = next((j for j in reversed(ends) if joined[i:j] in vocab), None)
        if match is None:  # unknown op: take one token (an op starting with `_` keeps it)
            start = i + 1 if joined[i] == "_" else i
            nxt = joined.find("_", start)
            match = len(joined) if nxt < 0 else nxt
        ops.append(joined[i:match])
        i = match + 1
    return tuple(op for op in ops if op)


def _covers(kind: str, ops: tuple[str, ...]) -> tuple[list[str], list[str], list[str]]:
    """Catalogue keys the op set covers, the weak ones among them, and the notes that say why they are weak."""
    s = set(ops)
    covers: list[str] = []
    weak: list[str] = []
    notes: list[str] = []
    if {"pow", "mean", "rsqrt", "mul"} <= s:
        covers.append("rms_norm")
        if "add" in s:
            covers.append("add_rms_norm")
            weak.append("add_rms_norm")
            notes.append(_WEAK_ADD_RMS)
    if {"silu", "mul"} <= s:
        covers.append("silu_and_mul")
    if {"gelu", "mul"} <= s:
        covers.append("gelu_and_mul")
    if "native_layer_norm" in s and "add" in s:
        covers.append("add_layer_norm")
    if {"neg", "cat", "mul", "add"} <= s:
        covers.append("rope")
        weak.append("rope")
        notes.append(_WEAK_ROPE)
    if kind == "template" and s & {"mm", "addmm", "bmm"} and s & set(_ACTIVATIONS):
        covers.append("linear_act")
    if s & set(_SDPA_OPS):
        covers.append("flash_attention")
    return covers, weak, notes


def parse_inductor_name(name: str) -> InductorKernel | None:
    """`triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0` → InductorKernel(kind="reduction", ops=(`_to_copy`, `add`,
    `mean`, `mul`, `pow`, `rsqrt`), covers=(rms_norm, add_rms_norm), weak=(add_rms_norm,)); None for a name Inductor
    did not generate. Also reads AOTInductor's model-name prefix and older Triton's signature suffix (`_0d1d2de`)."""
    m = _INDUCTOR.match(name.strip())
    if m is None or m["kind"] not in INDUCTOR_KINDS:
        return None
    kind = INDUCTOR_KINDS[m["kind"]]
    ops = split_ops(m["ops"]) if m["ops"] else ()
    covers, weak, notes = _covers(kind, ops)
    return InductorKernel(name, kind, ops, tuple(covers), tuple(weak), "; ".join(notes))


def match_engine_kernel(name: str, op: str = "") -> EngineKernel | None:
    """The first `ENGINE_KERNELS` row whose pattern is found in `name` (or, for torch's rows, in the launching `op`),
    with its engine replaced by the one the kernel's C++ namespace names, if any."""
    for pattern, entry in _COMPILED:
        if pattern.search(op if entry.on_op else name):
            engine = next((eng for prefix, eng in _NAMESPACES if prefix in name), entry.engine)
            return dataclasses.replace(entry, engine=engine)
    return None


RECOGNISED_COLUMNS = ["name", "source", "kind", "covers", "weak", "note", "phase", "count", "steps", "count_per_step",
                      "dur_us", "dur_us_per_step"]  # fmt: skip


def _describe(name: str, op: str) -> dict | None:
    inductor = parse_inductor_name(name)
    if inductor is not None:
        return {"source": "inductor", "kind": inductor.kind, "covers": " ".join(inductor.covers),
                "weak": " ".join(inductor.weak), "note": inductor.note}  # fmt: skip
    engine = match_engine_kernel(name, op)
    if engine is not None:
        return {"source": engine.engine, "kind": "engine", "covers": engine.key, "weak": "", "note": engine.note}
    return None


def recognise(kernels: pd.DataFrame) -> pd.DataFrame:
    """Per recognised kernel name and phase: the catalogue keys it covers (space-separated, as `opportunities_table`
    joins paths), its source ("inductor" or the engine), count and µs in total and per step.

    `kernels`: `analysis.kernel_table` (needs `name`, `dur_us`; uses `phase`, `step`, `op` where present). Per step =
    total ÷ the number of steps the phase has in the whole table (a step where the kernel did not run counts as 0);
    kernels outside any step count as one step."""
    if kernels.empty:
        return pd.DataFrame(columns=RECOGNISED_COLUMNS)
    table = kernels[["name", "dur_us"]].assign(
        phase=kernels["phase"].fillna("").astype(str) if "phase" in kernels else "",
        step=kernels["step"].fillna(-1) if "step" in kernels else -1,
        op=kernels["op"].fillna("").astype(str) if "op" in kernels else "",
    )
    steps = table.groupby("phase")["step"].nunique()
    pair, first = group_rows(table, ["name", "op"])  # each distinct (name, op) once: names are long to hash
    described = {key: _describe(*key) for key in zip(*(table[c].to_numpy()[first].tolist() for c in ("name", "op")))}
    known = np.fromiter((info is not None for info in described.values()), dtype=bool, count=len(described))[pair]
    table = table if known.all() else table[known]  # a frame per recognised group only
    rows = []
    for (name, op, phase), group in table.groupby(["name", "op", "phase"], sort=False):
        info = described[(name, op)]
        n_steps = max(int(steps[phase]), 1)
        count, dur = len(group), float(group["dur_us"].sum())
        rows.append({"name": name, **info, "phase": phase, "count": count, "steps": n_steps,
                     "count_per_step": count / n_steps, "dur_us": dur, "dur_us_per_step": dur / n_steps})  # fmt: skip
    out = pd.DataFrame(rows, columns=RECOGNISED_COLUMNS)
    if out.empty:
        return out
    # The same kernel launched under several aten ops is one row.
    sums = ["count", "count_per_step", "dur_us", "dur_us_per_step"]
    keys = [c for c in RECOGNISED_COLUMNS if c not in sums]
    return out.groupby(keys, sort=False, as_index=False)[sums].sum()[RECOGNISED_COLUMNS]


def _families_by_key() -> dict[str, tuple[str, ...]]:
    from fusionscope.fusions import fusions

    return {module.KEY: tuple(module.FAMILIES) for module in fusions()}


def _opportunity_rows(opportunities: pd.DataFrame | Iterable[Mapping] | None) -> list[dict]:
    if opportunities is None:
        return []
    if isinstance(opportunities, pd.DataFrame):
        return opportunities.to_dict("records")
    return [dict(o) for o in opportunities]


def _has_key(column: pd.Series, key: str) -> pd.Series:
    return column.fillna("").astype(str).str.split().map(lambda keys: key in keys)


def _covering(recognised: pd.DataFrame, key: str) -> pd.DataFrame:
    return recognised[_has_key(recognised["covers"], key)] if len(recognised) else recognised


def catalogue_status(recognised: pd.DataFrame, opportunities: pd.DataFrame | Iterable[Mapping] | None,
                     families: str | Iterable[str] | None = None) -> list[dict]:  # fmt: skip
    """Per catalogue entry and phase, one of `STATUSES`:

    - "active": a kernel covering the entry ran in that phase (`kernels`: names, `count_per_step`, `dur_us_per_step`;
      `evidence` "weak" when every such kernel only suggests it, see `recognise`'s `weak`). Active wins over missing:
      some sites can be fused and others not (a compiled model's first-layer norm), so an opportunity found beside it
      is still carried in `opportunity`.
    - "missing": the finder reported an opportunity for it (`opportunity`: its row, figures as summarised).
    - "not applicable": neither, and the model family is known and not in the entry's `FAMILIES`.
    - "not found": neither.

    `recognised`: `recognise(...)`; `opportunities`: `summary["opportunities"]` rows or `opportunities.csv`;
    `families`: the model family (`"llama"`) or several, None when unknown. Phases are those of either input
    ("" alone when both are empty)."""
    family_set = {families} if isinstance(families, str) else set(families or ())
    allowed = _families_by_key()
    opps = _opportunity_rows(opportunities)
    phases = (
        [*recognised["phase"].astype(str), *(str(o.get("phase", "")) for o in opps)]
        if len(recognised)
        else [str(o.get("phase", "")) for o in opps]
    )
    rows = []
    for phase in list(dict.fromkeys(phases)) or [""]:
        in_phase = recognised[recognised["phase"].astype(str) == phase] if len(recognised) else recognised
        for key, entry_families in allowed.items():
            covering = _covering(in_phase, key)
            opportunity = next((o for o in opps if o.get("fusion") == key and str(o.get("phase", "")) == phase), None)
            row = {"fusion": key, "phase": phase, "status": "", "kernels": [], "count_per_step": 0.0,
                   "dur_us_per_step": 0.0, "evidence": "", "opportunity": opportunity}  # fmt: skip
            if len(covering):
                weak = _has_key(covering["weak"], key)
                row.update(status="active", kernels=sorted(set(covering["name"])),
                           count_per_step=float(covering["count_per_step"].sum()),
                           dur_us_per_step=float(covering["dur_us_per_step"].sum()),
                           evidence="weak" if weak.all() else "strong")  # fmt: skip
            elif opportunity is not None:
                row["status"] = "missing"
            elif family_set and family_set.isdisjoint(entry_families):
                row["status"] = "not applicable"
            else:
                row["status"] = "not found"
            rows.append(row)
    return rows


GRAPH_LAUNCHES = ("cudaGraphLaunch", "cudaGraphLaunch_v10000", "cuGraphLaunch", "cuGraphLaunch_ptsz", "hipGraphLaunch")


def graph_replay_share(trace: pd.DataFrame | Mapping | list[Mapping]) -> dict[str, float | int]:
    """Share of kernel time replayed from CUDA graphs: `replayed_us / kernel_us`, with the graph launches counted.

    What a Kineto trace shows of a replay: CUPTI reports each kernel of a replayed graph as its own `kernel` event,
    with the `correlation` of the one `cudaGraphLaunch` runtime call that launched the whole graph — so the kernels
    are all there (names, durations; an Inductor `triton_*` or engine name still says what each covers), but there is
    no per-kernel launch on the CPU side and no aten op above them. That is how this function tells them apart. Not
    confirmed on a real graph-replay trace on this machine (no GPU here); whether Kineto also exports a graph id per
    kernel was not checked either.

    `trace`: a Chrome-trace dict (`{"traceEvents": [...]}`) or its event list — kernels are `cat == "kernel"` events,
    runtime calls `cuda_runtime` / `cuda_driver` — or a kernel table with a `launch` column naming the runtime call
    that launched each kernel (`analysis.kernel_table` does not carry one yet)."""
    if isinstance(trace, pd.DataFrame):
        if "launch" not in trace:
            raise ValueError("kernel table has no `launch` column (the launching runtime call's name)")
        kernel_us = float(trace["dur_us"].sum())
        replayed = trace["launch"].isin(GRAPH_LAUNCHES)
        replayed_us = float(trace.loc[replayed, "dur_us"].sum())
        launches = int(trace.loc[replayed, "launch_id"].nunique()) if "launch_id" in trace else -1
        return _share(kernel_us, replayed_us, int(replayed.sum()), launches)
    events = trace.get("traceEvents", []) if isinstance(trace, Mapping) else trace
    graph_corr = {
        (e.get("args") or {}).get("correlation")
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("name") in GRAPH_LAUNCHES
    }
    graph_corr.discard(None)
    kernels = [e for e in events if e.get("cat") == "kernel"]
    replayed = [e for e in kernels if (e.get("args") or {}).get("correlation") in graph_corr]
    kernel_us = float(sum(e.get("dur", 0.0) for e in kernels))
    replayed_us = float(sum(e.get("dur", 0.0) for e in replayed))
    return _share(kernel_us, replayed_us, len(replayed), len(graph_corr))


def _share(kernel_us: float, replayed_us: float, kernels_replayed: int, graph_launches: int) -> dict[str, float | int]:
    return {"kernel_us": kernel_us, "replayed_us": replayed_us,
            "share": replayed_us / kernel_us if kernel_us > 0 else 0.0,
            "kernels_replayed": kernels_replayed, "graph_launches": graph_launches}  # fmt: skip


__all__ = ["ENGINE_KERNELS", "STATUSES", "EngineKernel", "InductorKernel", "aten_vocabulary", "catalogue_status",
           "graph_replay_share", "match_engine_kernel", "parse_inductor_name", "recognise", "split_ops"]  # fmt: skip
