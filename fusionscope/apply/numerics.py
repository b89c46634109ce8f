"""Are the logits still right? One model's outputs on the run's inputs, two of them compared, and a verdict.

`reference(model, ids, decode_steps)` runs a prefill and greedy decode steps with the model's own KV cache and keeps
its logits; `compare(test, ref)` gives the figures (max absolute and relative logit error, mean KL divergence of the
next-token distributions, top-1/top-5 agreement, where greedy decoding first differs); `judge(...)` decides whether a
fused model is as close to an fp32 copy as the unpatched model in the run's dtype already is (`fp32_copy`), by the
per-dtype `TOLERANCES`.

Why "against fp32, relative to eager": a bf16 model is itself ~1e-3 in KL away from its fp32 twin (SmolLM2-135M on
English), and a correct kernel that rounds once instead of twice moves the logits by about as much again, in no
particular direction. So the fused model is not held to eager's exact logits but to eager's *distance* from the exact
(fp32) answer: no further than a ratio of it, plus a floor for fp32 runs, where eager's own distance is zero and a
kernel's reduction order still shows.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# Prefill logits kept per Reference, in elements: 2**26 fp32 = 256 MiB. Llama-3.1-8B at batch 1 × 512 positions
# (V = 128256) is 65.7M elements and keeps every position; at batch 8 the last 65 positions of each sequence are kept.
MAX_LOGITS = 2**26
# Rows of (V,) logits turned into fp64 distributions at once while comparing: 2**24 elements = 128 MiB per temporary.
_CHUNK_ELEMENTS = 2**24


@dataclass(frozen=True)
class Reference:
    """What one model computed on the run's inputs, all logits in float32 on the model's device.

    prefill_logits: (B, P, V), the last P of the S prompt positions (P = S unless `MAX_LOGITS` bounds it).
    tokens: (B, T + 1) int64, the greedy decode: column 0 is picked from the prefill's last position, column t + 1
        by decode step t (T = decode steps, each one cached forward over the previous token).
    decode_logits: (B, T, V), the logits of each decode step (column t + 1 of `tokens` is their argmax when greedy).
    """

    prefill_logits: torch.Tensor
    tokens: torch.Tensor
    decode_logits: torch.Tensor


Picker = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def kept_positions(batch: int, seq: int, vocab: int, max_logits: int = MAX_LOGITS) -> int:
    """How many (last) prompt positions of each sequence a Reference keeps: all of them, unless B·S·V logits would
    pass `max_logits`; at least one (the last, which picks the first token)."""
    return max(1, min(seq, max_logits // max(1, batch * vocab)))


def reference(
    model: nn.Module,
    ids: torch.Tensor,
    decode_steps: int,
    sampler: Picker | None = None,
    max_logits: int = MAX_LOGITS,
    cache: str = "dynamic",
) -> Reference:
    """Run `model` (a causal LM) on ids: (B, S): one prefill forward, then `decode_steps` cached forwards of one token
    each, every next token picked greedily (or by `sampler(ids_so_far, logits)` → (B, 1), e.g. the run's `Sampler`,
    which is reset first so that two References draw from the same seed). Under inference_mode, with the model's
    own cache (`use_cache=True`, passed back under the keyword the installed transformers takes).

    Memory: the prefill keeps the last `kept_positions(B, S, V, max_logits)` positions, asked of the model through
    `logits_to_keep` where its forward takes it (so the LM head runs only on them); decode keeps B·T·V fp32.

    `cache="static"`: on a transformers StaticCache of S + T positions made for this call, each row placed by its
    position (what `--cache static` profiles and times, so a fusion's kernel for the static path is the one checked).
    """
    from fusionscope.capture import _forward_kwargs
    from fusionscope.static_cache import static_cache

    names = _forward_kwargs(model)
    device = _device_of(model)
    ids = ids.to(device)
    batch, seq = ids.shape
    vocab = _vocab_size(model)
    keep = kept_positions(batch, seq, vocab, max_logits) if vocab else seq
    extra = {names["logits_to_keep"]: keep} if names["logits_to_keep"] and keep < seq else {}
    pick: Picker = sampler if sampler is not None else _greedy
    if hasattr(sampler, "reset"):
        sampler.reset()
    with torch.inference_mode():
        static = static_cache(model, seq + decode_steps) if cache == "static" else None

        def placed(position: int, length: int) -> dict[str, Any]:
            """With the static cache: the positions this call writes (the mask and the rotary embedding follow them)."""
            if static is None:
                return {}
            return {"cache_position": torch.arange(position, position + length, device=device)}

        first = {names["cache"]: static} if static is not None else {}
        out = model(ids, use_cache=True, **extra, **first, **placed(0, seq))
        prefill = out.logits[:, -keep:].float()
        token = pick(ids, out.logits[:, -1:])
        tokens, decode, seen = [token], [], ids
        kv = static if static is not None else _cache_of(out, None)
        for step in range(decode_steps):
            seen = torch.cat([seen, token], dim=1)
            out = model(token, use_cache=True, **{names["cache"]: kv}, **placed(seq + step, 1))
            kv = kv if static is not None else _cache_of(out, kv)
            decode.append(out.logits[:, -1].float())
            token = pick(seen, out.logits[:, -1:])
            tokens.append(token)
        empty = prefill.new_empty((batch, 0, prefill.shape[-1]))
        return Reference(
            prefill_logits=prefill,
            tokens=torch.cat(tokens, dim=1).long(),
            decode_logits=torch.stack(decode, dim=1) if decode else empty,
        )


def forward_reference(model: nn.Module, inputs: tuple | dict) -> Reference:
    """What a factory model (`path/to/file.py:factory`, one forward phase) computes on its inputs, as a Reference:
    its output's last dim taken as the logits of (1, N, D) positions, no decode. The output is the forward's tensor,
    its `.logits`, or the first tensor of a tuple. KL and top-1 then read the last dim as a distribution, which fits
    a classifier or LM head and means little for hidden states; max_abs and max_rel hold for any output."""
    with torch.inference_mode():
        out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    tensor = getattr(out, "logits", out)
    if isinstance(tensor, (tuple, list)):
        tensor = next((t for t in tensor if isinstance(t, torch.Tensor)), None)
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or tensor.dim() == 0:
        raise ValueError(f"the forward returned {type(out).__name__}, not a floating-point tensor to compare")
    logits = tensor.detach().float().reshape(1, -1, tensor.shape[-1])
    return Reference(prefill_logits=logits, tokens=logits[:, -1:].argmax(-1), decode_logits=logits[:, :0])


def check_draws(sampler: Any, ref: Reference, draws: int = 512) -> dict[str, Any]:
    """The sampling fusion's check: the logits do not change (the model is not patched), the draws do, and a fused
    draw uses its own random stream, so tokens cannot be compared one for one. Instead `draws` picks by the
    sampler's current `pick` (the fused one while patched) from the first sequence's last prefill logits must all
    fall in Hugging Face's kept set (temperature → top-k → top-p), and the most likely token's frequency must match
    its kept probability within 4 standard errors + 1/draws."""
    from fusionscope.kernels import kept_probs_reference

    logits = ref.prefill_logits[:1, -1].float()
    probs = kept_probs_reference(logits, sampler.temperature, sampler.top_k, sampler.top_p)[0]
    ids = torch.zeros((1, 1), dtype=torch.long, device=logits.device)
    with torch.inference_mode():
        picks = torch.cat([sampler.pick(ids, logits) for _ in range(draws)]).reshape(-1)
    inside = float((probs[picks] > 0).float().mean())
    top = int(probs.argmax())
    p_top = float(probs[top])
    freq = float((picks == top).float().mean())
    limit = 4 * math.sqrt(max(p_top * (1 - p_top), 1e-12) / draws) + 1 / draws
    passed = inside == 1.0 and abs(freq - p_top) <= limit
    verdict = "draws" if passed else "draws off"
    reason = f"{verdict}: {inside:.3f} in the kept set, top token drawn {freq:.3f} vs p {p_top:.3f} (±{limit:.3f})"
    return {"draws": draws, "in_kept_set": inside, "top_freq": freq, "top_prob": p_top, "passed": passed,
            "reason": reason}  # fmt: skip


def _greedy(_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1].argmax(-1, keepdim=True)


def _cache_of(out: Any, previous: Any) -> Any:
    """The cache a forward returned (5.24: `cache`, 5.17: `past_key_values`), else the one passed in. Tested against
    None, not for truth: a cache object may define `__len__`."""
    for name in ("cache", "past_key_values"):
        found = getattr(out, name, None)
        if found is not None:
            return found
    return previous


def _device_of(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _vocab_size(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None) if config is not None else None
    if not vocab and hasattr(model, "get_output_embeddings") and model.get_output_embeddings() is not None:
        vocab = model.get_output_embeddings().weight.shape[0]
    return int(vocab or 0)


def fp32_copy(model: nn.Module, device: torch.device | str | None = None) -> nn.Module:
    """A float32 deep copy of `model` on `device` (default: the model's own), the exact answer the run's dtype is
    measured against. Take it of the unpatched model.

    Memory: 4 bytes per parameter on `device` (Llama-3.1-8B: 32 GB beside the 16 GB bf16 model; pass device="cpu"
    when the accelerator lacks it), and nothing more: the module tree is copied with its parameters and buffers
    standing in as meta tensors, then each is filled straight from the original in fp32, so no second full-dtype copy
    is ever made. Tied parameters (an LM head sharing the embedding) stay tied."""
    device = torch.device(device) if device is not None else _device_of(model)
    originals: dict[int, torch.Tensor] = {}
    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in memo:
            continue
        stand_in = torch.empty_like(tensor, device="meta")
        if isinstance(tensor, nn.Parameter):
            stand_in = nn.Parameter(stand_in, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = stand_in
        originals[id(stand_in)] = tensor
    clone = copy.deepcopy(model, memo)
    filled: dict[int, torch.Tensor] = {}
    for module in clone.modules():
        for store in (module._parameters, module._buffers):
            for name, stand_in in store.items():
                if stand_in is None or id(stand_in) not in originals:
                    continue
                if id(stand_in) not in filled:
                    filled[id(stand_in)] = _to_fp32(originals[id(stand_in)], device)
                store[name] = filled[id(stand_in)]
    for tensor in [*clone.parameters(), *clone.buffers()]:
        if tensor.device.type == "meta":
            raise RuntimeError("fp32_copy left a meta tensor: the model holds a tensor outside its parameters")
    config = getattr(clone, "config", None)
    if config is not None and hasattr(config, "dtype"):
        config.dtype = torch.float32  # the copy's own config (deep-copied), for code that reads the dtype from it
    return clone


def _to_fp32(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    data = tensor.detach().to(device=device, dtype=torch.float32 if tensor.is_floating_point() else tensor.dtype)
    data = data.clone() if data.data_ptr() == tensor.data_ptr() else data  # an fp32 original on the same device
    return nn.Parameter(data, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else data


def compare(test: Reference, ref: Reference) -> dict[str, Any]:
    """The figures of `test` against `ref` (same shapes; test is moved to ref's device), JSON-ready.

    Positions compared: every kept prefill position, and each decode step whose inputs were the same for both models
    (step t was fed columns 0..t of `tokens`; past the first difference the inputs differ, and so do the logits,
    rightly). Over them:
    - max_abs: max |test − ref| of the logits; ref_scale: max |ref| (the logits' scale).
    - max_rel: max_abs / ref_scale. Not elementwise |Δ| / |ref|: logits near zero would make that explode on a
      harmless error, and the softmax is shift-invariant, so what an error means is set by the logits' scale.
    - kl_mean, kl_max: KL(ref ‖ test) of the next-token distributions (softmax, in fp64), mean and max.
    - top1: fraction of positions whose argmaxes agree, ties counted as agreement (bf16 logits tie often: at |logit|
      ~10 they step by 1/16).
    - top5: mean of |top5(ref) ∩ top5(test)| / 5 — set overlap: a swap inside the top five costs nothing, a token
      leaving it costs 0.2 (stricter than "ref's top-1 is among test's top five").
    - positions: how many were compared; decode_compared: how many of them were decode steps.
    - decode_max_abs, decode_kl_mean: the same over the decode steps alone (None when none compared): a fault in the
      cached path (KV cache writes, rotary offsets) shows there first.
    Tokens:
    - first_divergence: the first column of `tokens` (0: the prefill's pick) where any sequence differs; None if never.
    - tokens_equal: fraction of equal entries of `tokens`.
    """
    _check_shapes(test, ref)
    device = ref.prefill_logits.device
    with torch.no_grad():
        prefill = _accumulate(test.prefill_logits.to(device).flatten(0, -2), ref.prefill_logits.flatten(0, -2))
        same = test.tokens.to(device) == ref.tokens
        steps = ref.decode_logits.shape[1]
        fed_same = same[:, :steps].long().cumprod(dim=1).bool()  # decode step t was fed columns 0..t
        decode = _accumulate(test.decode_logits.to(device)[fed_same], ref.decode_logits[fed_same])
        figures = _finish(_merge(prefill, decode))
        decode_figures = _finish(decode) if decode["n"] else None
        differs = (~same).any(dim=0).nonzero()
        figures.update(
            decode_compared=decode["n"],
            decode_max_abs=decode_figures["max_abs"] if decode_figures else None,
            decode_kl_mean=decode_figures["kl_mean"] if decode_figures else None,
            first_divergence=int(differs[0, 0]) if differs.numel() else None,
            tokens_equal=float(same.float().mean()) if same.numel() else 1.0,
        )
    return figures


def _check_shapes(test: Reference, ref: Reference) -> None:
    for name in ("prefill_logits", "tokens", "decode_logits"):
        a, b = getattr(test, name), getattr(ref, name)
        if a.shape != b.shape:
            raise ValueError(f"cannot compare References: {name} is {tuple(a.shape)} against {tuple(b.shape)}")


def _accumulate(test: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Running sums and maxima over rows test, ref: (N, V), taken in row chunks so that the fp64 distributions of
    a 128k vocabulary never exist for more than `_CHUNK_ELEMENTS` logits at once."""
    acc = {"n": 0, "max_abs": 0.0, "ref_scale": 0.0, "kl_sum": 0.0, "kl_max": 0.0, "top1": 0.0, "top5": 0.0}
    vocab = ref.shape[-1]
    k = min(5, vocab)
    rows = max(1, _CHUNK_ELEMENTS // max(1, vocab))
    for start in range(0, ref.shape[0], rows):
        t, r = test[start : start + rows], ref[start : start + rows]
        delta = torch.where(t == r, 0.0, t - r).abs()  # equal infinities are no error
        acc["max_abs"] = _max(acc["max_abs"], float(delta.max()))
        finite = r[r.isfinite()]
        acc["ref_scale"] = _max(acc["ref_scale"], float(finite.abs().max()) if finite.numel() else 0.0)
        kl = _kl(r, t)
        acc["kl_sum"] += float(kl.sum())
        acc["kl_max"] = _max(acc["kl_max"], float(kl.max()))
        acc["top1"] += float(_top1_agrees(t, r).sum())
        top_t, top_r = t.topk(k, dim=-1).indices, r.topk(k, dim=-1).indices
        acc["top5"] += float((top_t[:, :, None] == top_r[:, None, :]).any(-1).sum()) / k
        acc["n"] += r.shape[0]
    return acc


def _merge(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    sums = ("n", "kl_sum", "top1", "top5")
    return {key: a[key] + b[key] if key in sums else _max(a[key], b[key]) for key in a}


def _finish(acc: dict[str, float]) -> dict[str, Any]:
    n = max(1, acc["n"])
    max_abs, scale = acc["max_abs"], acc["ref_scale"]
    return {
        "max_abs": max_abs,
        "max_rel": max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf),
        "ref_scale": scale,
        "kl_mean": acc["kl_sum"] / n,
        "kl_max": acc["kl_max"],
        "top1": acc["top1"] / n,
        "top5": acc["top5"] / n,
        "positions": int(acc["n"]),
    }


def _top1_agrees(test: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per row: the argmaxes are equal, or one side's argmax ties for the other side's maximum."""
    a, b = ref.argmax(-1, keepdim=True), test.argmax(-1, keepdim=True)
    ties_t = test.gather(-1, a) >= test.max(-1, keepdim=True).values
    ties_r = ref.gather(-1, b) >= ref.max(-1, keepdim=True).values
    return ((a == b) | ties_t | ties_r).squeeze(-1)


def _max(a: float, b: float) -> float:
    """max that keeps a NaN (Python's `max(0.0, nan)` is 0.0: a NaN logit must not read as no error)."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def _kl(ref: torch.Tensor, test: torch.Tensor) -> torch.Tensor:
    """KL(softmax(ref) ‖ softmax(test)) per row, in fp64: between fp32 runs it is ~1e-12, below fp32's resolution of
    log-probabilities (~1e-7 each). A token ref gives no probability contributes nothing (0 · log 0 = 0)."""
    log_r = torch.log_softmax(ref.double(), dim=-1)
    log_t = torch.log_softmax(test.double(), dim=-1)
    p = log_r.exp()
    return torch.where(p > 0, p * (log_r - log_t), 0.0).sum(-1).clamp_min(0.0)


@dataclass(frozen=True)
class Tolerance:
    """How far a fused model may be from the fp32 copy, given how far the unpatched model in the same dtype is.

    Passes when, on the positions `compare` pools (prefill and matching decode steps):
        kl_mean(fused, fp32) ≤ kl_ratio · kl_mean(eager, fp32) + kl_floor
        max_abs(fused, fp32) ≤ max_abs_ratio · max_abs(eager, fp32) + max_abs_floor · max |fp32 logit|
        top1(fused, eager)   ≥ top1_min          (real weights only: see `judge`)
    The floors carry fp32 accumulation-order noise, which every kernel has whatever its output dtype; they decide
    fp32 runs, where eager's own distance is zero."""

    kl_ratio: float
    kl_floor: float
    max_abs_ratio: float
    max_abs_floor: float  # a fraction of the fp32 logits' scale (max |logit|), so it means the same at any scale
    top1_min: float


# Measured 2026-12-01 on the CPU (transformers 5.24, torch CPU build), figures over prefill + matching decode steps;
# "legit" = numerically valid rewrites that round differently from eager: the Triton rms_norm kernel (interpreter),
# RMSNorm's weight product in fp32 rounded once, SwiGLU's silu·up in fp32 rounded once, every GEMM split in two
# halves along K (fp32) or run in fp64 (fp32). "Broken" = an RMSNorm with eps ×2 / ×10 or weight ×1.001 / ×1.01.
# Ratios are fused-vs-fp32 over eager-vs-fp32; the fp32 reference is `fp32_copy` of the model built in the dtype.
#
# SmolLM2-135M (real weights, 4 English paragraphs of 37-60 tokens, 8 decode steps; B=2×16 tokens, 2 steps for fp32):
#   fp32  eager vs fp32 copy: 0. legit: rms_norm kernel KL 4.7e-12, max_rel 1.2e-6; GEMMs split-K KL 5.4e-12 /
#         9.0e-12, max_rel 1.1e-6 / 2.0e-6; GEMMs in fp64 KL 6.3e-12 / 8.1e-12, max_rel 1.3e-6 / 1.7e-6.
#         broken: eps×2 KL 2.8e-7, max_rel 3.8e-4; weight×1.001 KL 9.3e-6, max_rel 2.2e-3; eps×10 KL 2.2e-5.
#   bf16  eager vs fp32: KL 1.0e-3 – 2.5e-3, max_rel 0.019 – 0.084, top1 0.985 – 1.0.
#         legit (12 runs): KL ratio 0.59 – 1.18, max_abs ratio 0.58 – 1.32, top1 vs eager 0.977 – 1.0.
#         broken weight×1.01: KL ratio 0.93 – 2.37; eps×10: 0.59 – 1.41 (bf16 cannot see these in all texts).
#   fp16  eager vs fp32: KL 1.6e-5 – 3.7e-5, max_rel 0.0019 – 0.0042, top1 1.0.
#         legit (12 runs): KL ratio 0.43 – 1.13, max_abs ratio 0.64 – 2.04, top1 vs eager 1.0.
#         broken weight×1.01: KL ratio 46 – 82, max_abs ratio 4.4 – 9.2; eps×10: KL ratio 0.93 – 2.6.
# Random weights (B=2×32 tokens, 8 decode steps unless noted):
#   tiny-llama preset (h256, V1000): fp32 rms_norm kernel KL 8.6e-15, max_rel 4.7e-7; eps×2 KL 2.1e-8, max_rel
#         7.4e-4. bf16 eager vs fp32 KL 1.8e-6, legit ratio ≤ 1.0; fp16 eager KL 2.7e-8, legit ratio ≤ 1.0.
#   llama h64 V128 (test size): fp32 kernel KL 4.8e-16, max_rel 2.5e-7; eps×2 KL 1.9e-8, max_rel 1.6e-3.
#   gemma2 h64 V1000: fp32 kernel KL 1.6e-15, max_rel 3.8e-7; eps×2 KL 1.1e-5, max_rel 0.032.
#   llama-3.2-1b dims (16 layers, B=1×128, 4 steps), bf16: eager vs fp32 KL 5.8e-4, top1 0.945; SwiGLU rounded
#         once: KL ratio 0.98, top1 vs eager 0.969; weight×1.01: KL ratio 2.35, top1 vs eager 0.922.
# Hence: KL within 1.5× eager (the product's target; legit ≤ 1.18 measured); max_abs, an extreme value over ~10^6
# logits, within 3× (legit reached 2.04 in fp16); floors KL 1e-9 (100× the fp32 kernels' ~1e-11; eps×2 is 280×
# above it on SmolLM2, 19× on the test-size llama) and max_abs 1e-4 of the logit scale (50× the fp32 kernels' 2e-6;
# eps×2 is 4× above it on SmolLM2, 16× on the test-size llama); top-1 with
# eager ≥ 0.99 / 0.95 / 0.9 (fp32 / fp16 / bf16; legit measured 1.0 / 1.0 / ≥ 0.977).
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(kl_ratio=1.5, kl_floor=1e-9, max_abs_ratio=3.0, max_abs_floor=1e-4, top1_min=0.99),
    torch.float16: Tolerance(kl_ratio=1.5, kl_floor=1e-9, max_abs_ratio=3.0, max_abs_floor=1e-4, top1_min=0.95),
    torch.bfloat16: Tolerance(kl_ratio=1.5, kl_floor=1e-9, max_abs_ratio=3.0, max_abs_floor=1e-4, top1_min=0.9),
}


def tolerance(dtype: torch.dtype) -> Tolerance:
    if dtype not in TOLERANCES:
        known = ", ".join(str(d).removeprefix("torch.") for d in TOLERANCES)
        raise ValueError(f"no numerics tolerance for {dtype}; the table has {known}")
    return TOLERANCES[dtype]


def tolerance_table() -> list[dict[str, Any]]:
    """The table as rows (dtype name first), for the terminal and the report."""
    return [{"dtype": str(d).removeprefix("torch."), **vars(t)} for d, t in TOLERANCES.items()]


def judge(
    fused_vs_ref: dict[str, Any],
    fused_vs_fp32: dict[str, Any],
    eager_vs_fp32: dict[str, Any],
    dtype: torch.dtype,
    real_weights: bool = True,
) -> tuple[bool, str]:
    """Whether a fused model's numerics pass, with a one-line reason naming the figure that failed (or the margins).

    fused_vs_ref: `compare(fused, eager)` in the run's dtype; fused_vs_fp32 / eager_vs_fp32: each against the
    `fp32_copy` reference. The rule is `Tolerance`'s. With random weights (`real_weights=False`) top-1 is not judged:
    their next-token distributions are nearly flat, so argmaxes flip on rounding noise (llama-3.2-1b dims, bf16:
    eager vs fp32 agrees on 0.945 of positions) and only the logit figures mean anything."""
    tol = tolerance(dtype)
    for name, figures in (("fused vs eager", fused_vs_ref), ("fused vs fp32", fused_vs_fp32)):
        for key in ("max_abs", "kl_mean"):
            if not math.isfinite(figures[key]):
                return False, f"{key} {name} is {figures[key]} (a NaN or infinite logit)"
    kl, kl_eager = fused_vs_fp32["kl_mean"], eager_vs_fp32["kl_mean"]
    kl_limit = tol.kl_ratio * kl_eager + tol.kl_floor
    if not kl <= kl_limit:
        return False, (
            f"kl_mean {kl:.3g} from fp32 > {tol.kl_ratio:g} × eager's {kl_eager:.3g} + {tol.kl_floor:g} "
            f"= {kl_limit:.3g}"
        )
    abs_, abs_eager, scale = fused_vs_fp32["max_abs"], eager_vs_fp32["max_abs"], fused_vs_fp32["ref_scale"]
    abs_limit = tol.max_abs_ratio * abs_eager + tol.max_abs_floor * scale
    if not abs_ <= abs_limit:
        return False, (
            f"max_abs {abs_:.3g} from fp32 > {tol.max_abs_ratio:g} × eager's {abs_eager:.3g} + "
            f"{tol.max_abs_floor:g} × logit scale {scale:.3g} = {abs_limit:.3g}"
        )
    top1 = fused_vs_ref["top1"]
    if real_weights and not top1 >= tol.top1_min:
        return False, f"top1 agreement with eager {top1:.3f} < {tol.top1_min:g}"
    top1_note = f"top1 {top1:.3f} " + (f"≥ {tol.top1_min:g}" if real_weights else "(random weights: not judged)")
    return True, f"kl_mean {kl:.3g} ≤ {kl_limit:.3g}, max_abs {abs_:.3g} ≤ {abs_limit:.3g}, {top1_note}"


# A fixed English paragraph for real-weight models (written for this table's measurements).
PARAGRAPH = (
    "The old lighthouse stood at the edge of the cliff, its white paint peeling in the salt wind. Every evening the "
    "keeper climbed the narrow stairs to light the lamp, and every morning he wrote the weather in a small book. "
    "Ships passed far out at sea, and none of them knew his name. In winter the storms came from the north, and the "
    "waves broke so high against the rocks that the spray reached the windows of the lamp room. He did not mind. He "
    "had a stove, a shelf of books, and a cat that slept on the warm stones by the chimney. Once a month a boat "
    "brought flour, oil, coffee and letters from his sister, who lived in the city and asked every time when he "
    "would come home. He always answered that the ships still needed the light, and that he would come in the "
    "spring. When spring came, the sea turned blue again, the birds returned to nest on the cliffs, and the keeper "
    "painted the tower white, as he did every year."
)


def text_ids(tokenizer: Any, length: int, batch: int = 1, text: str = PARAGRAPH, stride: int = 17) -> torch.Tensor:
    """(batch, length) int64 ids of real English for real-weight models: row b is `length` tokens of `text` from
    token b·stride, the text repeated (blank line between) when it is too short. `tokenizer`: the model's own, e.g.
    `AutoTokenizer.from_pretrained(spec.path, gguf_file=spec.weights)` for a GGUF model."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    gap = tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    need = (batch - 1) * stride + length
    sequence = list(ids)
    while len(sequence) < need:
        sequence += gap + ids
    return torch.tensor([sequence[b * stride : b * stride + length] for b in range(batch)], dtype=torch.long)


def json_safe(figures: dict) -> dict:
    """Figures with every non-finite float (a NaN logit, an infinite relative error) as None and `non_finite` set:
    summary.json is strict JSON, and a failed fusion's figures must still be written."""
    import math

    out, bad = {}, False
    for key, value in figures.items():
        if isinstance(value, float) and not math.isfinite(value):
            out[key], bad = None, True
        else:
            out[key] = value
    if bad:
        out["non_finite"] = True
    return out
