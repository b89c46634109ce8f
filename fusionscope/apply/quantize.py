"""Weight-only int4 for any float model: its Linears swapped, on the instance, for a Linear that holds packed int4
weights and dequantises them in plain PyTorch on every forward.

That module, `PlainW4Linear`, is the unfused chain the `dequant_gemm` fusion is about — unpack with shifts and masks,
subtract the zero, multiply by the scale, then a GEMM on the full-precision weight it has just written — so that any
bf16 model can be tried with W4A16: `quantize_model` turns it into one whose Linears the finder matches and the
`dequant_gemm` patcher serves with `fusionscope.kernels.w4a16_gemm` on the same packed tensors. The quantisation is
round-to-nearest (`quantize_w4`): its own error against the float model is a property of the weights, not of the
kernel, and is reported apart from the fusion's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fusionscope.errors import UsageError
from fusionscope.kernels.w4a16_gemm import PackedW4, check_group_size, quantize_w4, w4a16_reference

DEFAULT_GROUP = 128


class PlainW4Linear(nn.Module):
    """(..., in_features) → (..., out_features), the weight held as int4 in fusionscope's packed layout (buffers
    `qweight`, `scales`, `zeros` and the int `group_size`: a `PackedW4`, see `fusionscope.kernels.w4a16_gemm`) and
    dequantised on every forward in plain PyTorch by `w4a16_reference`, the one copy of that chain: a quantised
    Linear as people write it."""

    def __init__(self, in_features: int, out_features: int, packed: PackedW4, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = packed.group_size
        self.register_buffer("qweight", packed.qweight)
        self.register_buffer("scales", packed.scales)
        self.register_buffer("zeros", packed.zeros)
        self.bias = bias if isinstance(bias, nn.Parameter) or bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = DEFAULT_GROUP, symmetric: bool = False) -> PlainW4Linear:
        """`linear` quantised by `quantize_w4` (round to nearest), keeping its bias Parameter."""
        packed = quantize_w4(linear.weight, group_size, symmetric)
        return cls(linear.in_features, linear.out_features, packed, linear.bias)

    def packed(self) -> PackedW4:
        return PackedW4(self.qweight, self.scales, self.zeros, self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return w4a16_reference(x, self.qweight, self.scales, self.zeros, self.group_size, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"bias={self.bias is not None}")  # fmt: skip


def parse_quantize(text: str) -> int:
    """The group size asked for by `w4` (128), `w4:<group>` (a power of two ≥ 16) or `w4:channel` (-1: one group per
    output channel); UsageError for anything else."""
    kind, _, group = text.strip().partition(":")
    if kind != "w4":
        raise UsageError(f"--quantize takes w4 or w4:<group size> (e.g. w4:128, w4:channel), got {text!r}")
    if not group:
        return DEFAULT_GROUP
    if group == "channel":
        return -1
    if not group.isdigit() or int(group) < 16 or int(group) & (int(group) - 1):
        raise UsageError(
            f"--quantize w4:<group>: the group size must be a power of two >= 16 or 'channel', got {group!r}"
        )
    return int(group)


def _weight_bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def quantize_model(
    model: nn.Module, group_size: int = DEFAULT_GROUP, include_lm_head: bool = False, symmetric: bool = False
) -> dict[str, Any]:
    """Swap every `nn.Linear` of `model` (its exact class) for a `PlainW4Linear` quantised by `quantize_w4`, in place
    on the instance (no class is touched); not the LM head (`get_output_embeddings()`) unless `include_lm_head`. The
    embedding is no Linear and stays. A Linear reached by two paths becomes one PlainW4Linear at both.

    Returns {"group_size", "swapped": {path: {"in_features", "out_features", "group_size"}}, "skipped": {path:
    reason}, "weight_bytes_before", "weight_bytes_after"} (weights and biases of the swapped Linears)."""
    if group_size != -1 and (group_size < 16 or group_size & (group_size - 1)):
        raise UsageError(f"group_size must be a power of two >= 16, or -1 (per channel), got {group_size}")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    swapped: dict[str, dict[str, int]] = {}
    skipped: dict[str, str] = {}
    made: dict[int, PlainW4Linear] = {}
    before = after = 0
    for parent_path, parent in list(model.named_modules(remove_duplicate=False)):
        for name, child in list(parent.named_children()):
            path = f"{parent_path}.{name}" if parent_path else name
            if not isinstance(child, nn.Linear):
                continue
            reason = _why_not(child, head, include_lm_head)
            if reason:
                skipped[path] = reason
                continue
            if id(child) not in made:
                made[id(child)] = PlainW4Linear.from_linear(child, group_size, symmetric).train(child.training)
                before += _weight_bytes(child.weight, child.bias)
                after += _weight_bytes(*made[id(child)].packed()[:3], child.bias)
            new = made[id(child)]
            setattr(parent, name, new)
            swapped[path] = {"in_features": new.in_features, "out_features": new.out_features,
                             "group_size": check_group_size(group_size, new.in_features)}  # fmt: skip
    return {"group_size": group_size, "swapped": swapped, "skipped": skipped, "weight_bytes_before": before,
            "weight_bytes_after": after}  # fmt: skip


def _why_not(linear: nn.Linear, head: nn.Module | None, include_lm_head: bool) -> str:
    """'' when `linear` is quantised, else why not."""
    if type(linear) is not nn.Linear:
        return f"{type(linear).__name__} subclasses nn.Linear: its forward may compute something else"
    if linear is head and not include_lm_head:
        return "the LM head (include_lm_head=True quantises it too)"
    if linear.weight.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"its weight is {linear.weight.dtype}; quantize_w4 takes fp32, fp16 and bf16 weights"
    return ""


def quantize_workload(workload: Any, group_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Quantise `workload.module` in place (`quantize_model`: its Linears, not the embedding or the LM head) and
    measure what the quantisation alone costs: the float model's logits are taken first, then the quantised model's
    (unpatched: the plain dequantise + GEMM chain) on the same ids and decode steps, greedy, by `numerics.reference`
    (`forward_reference` for a model of one forward). That error belongs to round-to-nearest int4 on these weights,
    not to any kernel; a fusion's error is judged apart, against this quantised model.

    Returns (quantize_model's report, `numerics.compare(quantised, float)`)."""
    from fusionscope.apply import numerics

    def reference(model: nn.Module) -> numerics.Reference:
        if workload.phases == ("forward",):
            return numerics.forward_reference(model, workload.inputs)
        return numerics.reference(model, workload.inputs[0], workload.decode_steps)

    before = reference(workload.module)
    report = quantize_model(workload.module, group_size)
    if workload.device.type == "cuda":
        torch.cuda.empty_cache()  # the float weights just replaced
    return report, numerics.compare(reference(workload.module), before)
