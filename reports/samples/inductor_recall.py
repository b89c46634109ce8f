"""Recall of the fusion catalogue against TorchInductor: which groups does torch.compile fuse on a model's prefill,
and does fusionscope find each one (or name why not)?

Inductor names each generated kernel after the aten ops it fused (`triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_3`
on CUDA, `cpp_fused_...` on the CPU). This script compiles the model's prefill forward, reads those names and their
launch counts from the generated wrapper code (one call site per launch: the wrapper is unrolled over layers), sorts
every fused kernel into the catalogue entry it corresponds to or into a named miss with its reason, and compares with
the matches fusionscope found on the same workload (`summary.json` of a `fusionscope profile` run). It also lists
what Inductor leaves alone and the catalogue does not: the GEMMs it calls one by one (horizontal q/k/v and gate/up)
and their epilogues.

    python3 reports/samples/inductor_recall.py RUN_DIR OUT.json [--model llama-3.2-1b --prompt-len 512]

RUN_DIR is a `fusionscope profile` run folder of the same model and workload; --device cpu debugs the script on a
small model (Inductor then emits C++ kernels, named the same way).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

import torch

# What Inductor fused, recognised from the op tokens in the kernel name: (test, catalogue entries, or a named miss).
# Tested in order; the first rule that holds wins.
RULES: list[tuple[str, object, tuple[str, ...] | None, str]] = [
    (
        "norm",
        lambda t: {"rsqrt", "mean"} <= t,
        ("add_rms_norm", "rms_norm"),
        "RMSNorm (with the residual add when "
        "Inductor fused it in: its name cannot tell the ε add from the residual add)",
    ),
    ("silu_and_mul", lambda t: {"silu", "mul"} <= t, ("silu_and_mul",), "SwiGLU gate"),
    (
        "gelu_and_mul",
        lambda t: bool({"gelu", "tanh", "erf"} & t) and "mul" in t,
        ("gelu_and_mul", "linear_act"),
        "GELU (gated or after a GEMM)",
    ),
    ("rope", lambda t: {"neg", "cat"} <= t, ("rope",), "rotate_half rotation of q or k"),
    (
        "rotary_tables",
        lambda t: bool({"cos", "sin"} & t),
        None,
        "miss: the rotary cos/sin tables (model.rotary_emb) — computed once per step and shared by every layer; "
        "not worth a catalogue entry",
    ),
    ("embedding", lambda t: "embedding" in t, None, "miss: the embedding gather — one read per token, nothing to fuse"),
    ("softmax", lambda t: {"amax", "exp"} <= t or "softmax" in t, ("flash_attention",), "eager attention softmax"),
    (
        "mask",
        lambda t: bool({"arange", "le", "lt", "ge", "gt", "bitwise", "logical", "where", "eq", "ne"} & t),
        None,
        "miss: position ids / causal mask (arange, compares, where) — once per step, outside the layers",
    ),
    (
        "cache_write",
        lambda t: bool({"index", "put", "scatter", "copy"} & t) and "cat" in t,
        ("rope",),
        "KV-cache write",
    ),
    (
        "copy",
        lambda t: (
            t
            <= {
                "to",
                "copy",
                "clone",
                "view",
                "unsafe",
                "reshape",
                "permute",
                "transpose",
                "expand",
                "unsqueeze",
                "squeeze",
                "slice",
                "select",
                "cat",
            }
        ),
        None,
        "miss: a materialised cast or layout copy (for a GEMM, the cache or attention) — no fused kernel "
        "replaces it; fusionscope's rope+cache kernel writes the cache layout directly",
    ),
]
KERNEL = re.compile(r"(?<!def )\b((?:triton_[a-z]+|cpp)_fused_\w+?_\d+)(?:\.run)?\(")
EXTERN = re.compile(r"\bextern_kernels\.(\w+)\(")
ATTENTION = re.compile(r"\baten\.(_scaled_dot_product_\w+?)\.default\(")  # calls, not the comments


def tokens(kernel: str) -> set[str]:
    ops = re.sub(r"^(?:triton_[a-z]+|cpp)_fused_", "", kernel)
    ops = re.sub(r"_\d+$", "", ops)
    return {t for t in ops.split("_") if t}


def classify(kernel: str) -> tuple[str, tuple[str, ...] | None, str]:
    toks = tokens(kernel)
    for name, test, entries, what in RULES:
        if test(toks):
            return name, entries, what
    return "unmapped", None, "not recognised by this script's rules"


def compile_and_read(model: str, prompt_len: int, device: str) -> tuple[Counter, Counter, Counter, str]:
    """Launch counts per Inductor kernel, extern calls (GEMMs), attention calls, for one compiled prefill."""
    from torch._inductor.utils import run_and_get_code

    from fusionscope import models

    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    workload = models.build_workload(models.resolve_model(model), dev, dtype, prompt_len=prompt_len, decode_steps=1)
    ids = workload.inputs["input_ids"] if isinstance(workload.inputs, dict) else workload.inputs[0]
    compiled = torch.compile(workload.module)
    with torch.no_grad():
        _, codes = run_and_get_code(lambda: compiled(ids, use_cache=True))
    kernels, extern, attention = Counter(), Counter(), Counter()
    for code in codes:
        kernels.update(KERNEL.findall(code))
        extern.update(EXTERN.findall(code))
        attention.update(ATTENTION.findall(code))
    return kernels, extern, attention, f"{len(codes)} compiled graph(s)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    summary = json.loads((args.run_dir / "summary.json").read_text())
    found = {o["fusion"]: o["count"] for o in summary["opportunities"] if o["phase"] == "prefill"}
    kernels, extern, attention, graphs = compile_and_read(args.model, args.prompt_len, args.device)

    groups: dict[str, dict] = {}
    for kernel, launches in sorted(kernels.items()):
        name, entries, what = classify(kernel)
        group = groups.setdefault(name, {"what": what, "entries": entries, "launches": 0, "kernels": []})
        group["launches"] += launches
        group["kernels"].append({"name": kernel, "launches": launches})
    rows = []
    for name, group in groups.items():
        entries = group["entries"]
        matched = [e for e in entries or () if found.get(e)]
        verdict = ("matched: " + " + ".join(f"{e} ×{found[e]:g}" for e in matched) if matched
                   else "MISSED by fusionscope" if entries else group["what"].split(" — ")[0])  # fmt: skip
        rows.append({"inductor_group": name, "launches": group["launches"], "kernels": len(group["kernels"]),
                     "catalogue": list(entries or ()), "fusionscope_matches": sum(found[e] for e in matched),
                     "verdict": verdict, "what": group["what"], "names": group["kernels"]})  # fmt: skip
    in_catalogue = [r for r in rows if r["catalogue"]]
    recalled = [r for r in in_catalogue if not r["verdict"].startswith("MISSED")]
    alone = {e: found[e] for e in ("qkv", "gate_up", "linear_act") if found.get(e)}
    result = {
        "model": args.model, "prompt_len": args.prompt_len, "device": torch.cuda.get_device_name()
        if args.device == "cuda" else args.device, "torch": torch.__version__, "graphs": graphs,
        "inductor_fused_kernels": sum(kernels.values()), "inductor_distinct_kernels": len(kernels),
        "extern_calls": dict(extern), "attention_calls": dict(attention), "groups": rows,
        "recall_groups": f"{len(recalled)}/{len(in_catalogue)}",
        # a group is recalled when fusionscope finds its entry at all; its launches and fusionscope's matches per step
        # stand side by side in `groups` (Inductor may split one fused group into several kernels, e.g. rope)
        "launches_in_recalled_groups": sum(r["launches"] for r in recalled)
        / max(sum(r["launches"] for r in in_catalogue), 1),
        "fusionscope_prefill_matches_per_step": found,
        "left_alone_by_inductor": alone,
    }  # fmt: skip
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{args.model} prefill ({args.prompt_len} tokens) on {result['device']}, torch {torch.__version__}: {graphs}")
    print(f"Inductor: {result['inductor_fused_kernels']} fused-kernel launches ({len(kernels)} distinct kernels); "
          f"extern calls {dict(extern)}; attention {dict(attention)}")  # fmt: skip
    for r in sorted(rows, key=lambda r: -r["launches"]):
        print(f"  {r['inductor_group']:<14} {r['launches']:>5} launches  {r['verdict']}")  # matches are per step
        for k in r["names"][:3]:
            print(f"      {k['name']} ×{k['launches']}")
    share = result["launches_in_recalled_groups"]
    print(f"recall: {result['recall_groups']} catalogue groups; {share:.0%} of their launches are in recalled groups")
    print(f"fusionscope matches Inductor leaves alone (per step): {alone}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
