"""GEMM + bias + activation with the bias and activation applied in the GEMM's epilogue (GPT-2 / BERT-style MLPs:
`act(x @ W.T + b)`).

Eager PyTorch runs `nn.Linear` (cuBLAS, bias folded into the GEMM) and then the activation as a separate elementwise
kernel, which reads the GEMM's output back from memory and writes it again. Per call with x: (M, K), weight: (N, K),
dtype size s:
    unfused, linear then act         = (M·K + N·K + N + M·N)·s + 2·M·N·s                  2 launches
    unfused, matmul + bias + act     = (M·K + N·K + M·N)·s + (2·M·N + N)·s + 2·M·N·s      3 launches
    fused                            = (M·K + N·K + N + M·N)·s                            1 launch
(the three-launch chain is `linear_act_unfused`, what `bench` compares with).
The saving is 2·M·N·s bytes (4·M·N·s against the three-kernel chain) and one or two launches. When the GEMM is
compute-bound (prefill: M in the thousands) the elementwise pass costs 2·M·N·s / bandwidth against 2·M·N·K / FLOP/s,
i.e. a share of ≈ (s·FLOP/s) / (K·bandwidth) of the GEMM: on an H200 in bf16 (≈ 700 TFLOP/s, ≈ 4.3 TB/s) that is
≈ 330/K — ≈ 40% for GPT-2's K = 768, ≈ 10% for K = 3072. At decode (M small) the weight read dominates and the gain
is the launch.

Two implementations behind one op:
- cuBLASLt epilogues, where torch exposes them: `torch._addmm_activation(bias, x, W.T, use_gelu=...)` (bias + ReLU, or
  bias + GELU) and `torch.addmm` (bias only). What `use_gelu=True` computes depends on the device: on CUDA it is the
  tanh-approximate GELU (cuBLASLt's GELU epilogue, and the fallback `gelu_(..., "tanh")` when Lt is not used); on the
  CPU torch computes the exact erf GELU (measured: torch 2.13 CPU, max |difference| 0 against `F.gelu`, 4.7e-4
  against `F.gelu(approximate="tanh")` in fp32). So the epilogue serves "gelu_tanh" on CUDA and "gelu" on the CPU, and
  only there. It needs a bias, unit stride along K for x and W, and a contiguous bias and output; otherwise cuBLAS
  would copy an operand or run a second kernel.
- a Triton matmul (tiles by M from `TRITON_TILES`, grouped tile order for L2 reuse) with the bias and any of the five
  activations in its epilogue, for everything else: silu, exact gelu on CUDA, no bias, strided inputs or outputs.
  Operands go to `tl.dot` in their own dtype on the GPU (tensor cores; fp32 inputs use TF32 only when
  `torch.get_float32_matmul_precision()` allows it, as `F.linear` does) and are upcast to fp32 first under the
  interpreter, which computes `tl.dot` on bf16 wrongly: the launcher sets the constexpr `UPCAST` from
  `TRITON_INTERPRET == "1"`, since the kernel itself cannot know. Accumulation is fp32; the output is rounded once.

Measured on an H200 (torch 2.11, triton 3.6, bf16, GPU time by CUDA-graph replay; `reports/bench/tune_linear_act.py`):
- cuBLASLt's tanh-GELU epilogue against eager `gelu(linear)`: 34 against 36 µs at 1×4096→16384, 37 against 40 at
  64 rows, 209 against 229 at 1024 rows, 868 against 892 at 4096 rows, 36 against 51 at 4096×768→3072, 28 against 34
  at 4096×3072→768.
- the Triton path (exact GELU) with the tiles above: 34.4, 41.6, 283, 1127, 64 and 50 µs at those shapes. It matches
  cuBLAS at M = 1 but takes 1.3–1.8× its time at prefill sizes (Triton 3.6's non-persistent matmul): where cuBLASLt has
  the epilogue, that is the faster fused kernel, and for exact GELU or SiLU at large M the unfused cuBLAS GEMM plus a
  separate activation can still be faster than the fused Triton kernel.
- cuBLAS itself issues a device memset (of its workspace) before the GEMM at some shapes — 1024 and 4096 rows at
  4096→16384, 4096×768→3072 — for the epilogue, `addmm`, `F.linear` and `mm` alike; with `CUBLASLT_WORKSPACE_SIZE=0`
  the Lt forms pick a variant without it (824 against 838 µs at 4096 rows, 228 against 211 µs at 1024 rows). It is a
  driver memset, not a kernel launch, and with the default workspace no form of this GEMM avoids it at those shapes;
  this module leaves the workspace setting to the user.

`backend="auto"` picks the cuBLASLt epilogue on CUDA when it applies and Triton otherwise (always Triton on the CPU,
where torch's "epilogue" is addmm followed by a second pass); "triton" and "cublaslt" force one (on the CPU
"cublaslt" runs torch's CPU implementation of the same op, which is how the tests check the `use_gelu` mapping).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from fusionscope.kernels.dispatch import Tunables, cdiv, launchable, plain_eager, run
from torch.library import triton_op

ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu", "none")
BACKENDS = ("auto", "triton", "cublaslt")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_ACT_CODE = {name: code for code, name in enumerate(ACTIVATIONS)}
# Activations that torch's fused epilogue computes, by device type: name -> use_gelu (None: plain addmm/mm).
_EPILOGUE = {
    "cuda": {"relu": False, "gelu_tanh": True, "none": None},
    "cpu": {"relu": False, "gelu": True, "none": None},
}


def _activation_reference(h: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "gelu":
        return F.gelu(h)
    if activation == "gelu_tanh":
        return F.gelu(h, approximate="tanh")
    if activation == "relu":
        return F.relu(h)
    if activation == "silu":
        return F.silu(h)
    return h


def linear_act_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str
) -> torch.Tensor:
    """What a model does in eager mode: `act(F.linear(x, weight, bias))`, the GEMM output rounded to x's dtype before
    the activation. x: (..., K); weight: (N, K); bias: (N,) or None."""
    h = F.linear(x, weight, bias)  # read (M·K + N·K + N)·s, write M·N·s (bias in cuBLAS's epilogue)
    return _activation_reference(h, activation)  # read M·N·s, write M·N·s


def linear_act_unfused(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str
) -> torch.Tensor:
    """The GEMM, then the bias and the activation as separate kernels: the chain `bench` compares with."""
    h = torch.matmul(x, weight.t())  # read (M·K + N·K)·s, write M·N·s
    if bias is not None:
        h = h + bias  # read (M·N + N)·s, write M·N·s
    return _activation_reference(h, activation)  # read M·N·s, write M·N·s


@triton.jit
def _linear_act_kernel(
    x_ptr,  # (M, K) input; row stride stride_xm, element stride stride_xk
    w_ptr,  # (N, K) weight in nn.Linear layout; strides stride_wn, stride_wk
    b_ptr,  # (N,) bias, element stride stride_b; unused unless HAS_BIAS
    out_ptr,  # (M, N) output; strides stride_om, stride_on
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_b,
    stride_om,
    stride_on,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,  # index into ACTIVATIONS: gelu, gelu_tanh, relu, silu, none
    UPCAST: tl.constexpr,  # interpreter: feed tl.dot fp32 tiles
    PRECISION: tl.constexpr,  # "ieee" or "tf32": how tl.dot treats fp32 operands
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Grouped tile order (triton tutorial 03): GROUP_M row-tiles share each column-tile's weights while in L2.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    group_size = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size)
    pid_n = (pid % (GROUP_M * tiles_n)) // group_size

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :] * stride_xk  # (BLOCK_M, BLOCK_K)
    w_ptrs = w_ptr + rn[None, :].to(tl.int64) * stride_wn + rk[:, None] * stride_wk  # (BLOCK_K, BLOCK_N): Wᵀ tile
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(x_ptrs, mask=(rm[:, None] < M) & (rk[None, :] + k < K), other=0.0)
        b = tl.load(w_ptrs, mask=(rk[:, None] + k < K) & (rn[None, :] < N), other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    # Epilogue, in fp32 on the accumulator: bias, activation, one rounding at the store.
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn * stride_b, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION == 0:  # gelu (erf)
        acc = 0.5 * acc * (1.0 + tl.erf(acc * 0.7071067811865476))
    elif ACTIVATION == 1:  # gelu_tanh: 0.5·h·(1 + tanh(z)) = h·sigmoid(2z), z = √(2/π)·(h + 0.044715·h³)
        acc = acc * tl.sigmoid(1.5957691216057308 * (acc + 0.044715 * acc * acc * acc))
    elif ACTIVATION == 2:  # relu
        acc = tl.maximum(acc, 0.0)
    elif ACTIVATION == 3:  # silu
        acc = acc * tl.sigmoid(acc)
    out_ptrs = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


# Triton tiles by the number of rows M: (largest M, config); the first entry whose bound M does not exceed applies.
# Measured on an H200 (bf16, exact GELU; `reports/bench/tune_linear_act.py`, results in reports/bench/): a decode-sized
# M wastes most of a tall tile, so a 16-row tile with long K steps streams the weight at cuBLAS's speed at M = 1; at
# prefill sizes wide 128×256 tiles re-read the operands least. M between 65 and 1023 was not measured, nor fp32 (whose
# K step the launcher halves: 128×256×64 fp32 tiles in 4 stages need 288 KiB of shared memory, the H200 has 227).
# On a GPU with less shared memory `fit_shared_memory` takes stages, then K step, away until a tile fits.
TRITON_TILES = Tunables(
    decode=(16, {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4}),
    small=(256, {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 4}),
    large=(None, {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 4}),
)


def triton_tiles(M: int) -> dict[str, int]:
    """The tile configuration of `TRITON_TILES` for M rows."""
    for bound, config in TRITON_TILES.values():
        if bound is None or bound >= M:
            return config
    raise ValueError("TRITON_TILES needs a last entry without a bound")


def fit_shared_memory(tiles: dict[str, int], element_size: int, limit: int) -> dict[str, int]:
    """`tiles` with fewer pipeline stages, then a shorter K step, until its operand buffers fit in `limit` bytes of
    shared memory. Triton keeps num_stages - 1 buffers of an x tile (BLOCK_M × BLOCK_K) and a weight tile
    (BLOCK_K × BLOCK_N): 288 KiB for 128×256×64 fp32 in 4 stages, the figure it reported on the H200."""
    fitted = dict(tiles)

    def need() -> int:
        block_k = fitted["BLOCK_K"]
        return (fitted["num_stages"] - 1) * (fitted["BLOCK_M"] + fitted["BLOCK_N"]) * block_k * element_size

    while need() > limit and fitted["num_stages"] > 2:
        fitted["num_stages"] -= 1
    while need() > limit and fitted["BLOCK_K"] > 16:
        fitted["BLOCK_K"] //= 2
    return fitted


@functools.cache
def _shared_memory_limit(device: int) -> int | None:
    """Bytes of shared memory a program may use on this GPU, as Triton checks it (the query Triton's compiler makes);
    None where this Triton has no such query, and the tiles go unfitted."""
    try:
        return triton.runtime.driver.active.utils.get_device_properties(device)["max_shared_mem"]
    except (AttributeError, KeyError):
        return None


def _epilogue_applies(
    x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str, out2d: torch.Tensor | None
) -> str | None:
    """None when torch's fused epilogue (cuBLASLt on CUDA) computes this call in one kernel, else the reason not.
    out2d None: the output is fresh (contiguous)."""
    table = _EPILOGUE.get(x2d.device.type, {})
    if activation not in table:
        return f"torch has no fused {activation!r} epilogue on {x2d.device.type}"
    if bias is None and activation != "none":
        return "the activation epilogue needs a bias"
    # cuBLAS takes the weight in either layout: nn.Linear's (N, K) rows, or GPT-2 Conv1D's (K, N) seen as its
    # transpose (`weight.t()` is then contiguous, exactly the operand Conv1D's own addmm passes).
    if x2d.stride(1) != 1 or (weight.stride(1) != 1 and weight.stride(0) != 1):
        return "x needs unit stride along K, and the weight unit stride along one of its dims"
    if (bias is not None and bias.stride(0) != 1) or (out2d is not None and not out2d.is_contiguous()):
        return "bias and out must be contiguous"
    return None


def _launch_triton(
    x2d: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    out2d: torch.Tensor,
    fp32_precision: str,
) -> None:
    M, K = x2d.shape
    N = weight.shape[0]
    tiles = triton_tiles(M)
    if x2d.element_size() == 4:  # fp32: twice the bytes per element (the large tile would overflow shared memory)
        tiles = {**tiles, "BLOCK_K": tiles["BLOCK_K"] // 2}
    limit = _shared_memory_limit(x2d.device.index) if x2d.is_cuda else None  # the interpreter has none to fit
    if limit is not None:
        tiles = fit_shared_memory(tiles, x2d.element_size(), limit)
    # fp32 operands: full precision unless torch allows TF32 for matmuls, as F.linear would use it.
    full_fp32 = x2d.dtype == torch.float32 and fp32_precision == "highest"
    precision = "ieee" if full_fp32 else "tf32"
    grid = (cdiv(M, tiles["BLOCK_M"]) * cdiv(N, tiles["BLOCK_N"]),)
    launchable(_linear_act_kernel)[grid](
        x2d,
        weight,
        bias if bias is not None else weight,
        out2d,
        M,
        N,
        K,
        x2d.stride(0),
        x2d.stride(1),
        weight.stride(0),
        weight.stride(1),
        bias.stride(0) if bias is not None else 0,
        out2d.stride(0),
        out2d.stride(1),
        HAS_BIAS=bias is not None,
        ACTIVATION=_ACT_CODE[activation],
        UPCAST=os.environ.get("TRITON_INTERPRET") == "1",
        PRECISION=precision,
        **tiles,
    )


def _launch_epilogue(
    x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str, out2d: torch.Tensor | None
) -> torch.Tensor:
    """The call through torch's epilogue op, into out2d, or into a fresh (M, N) tensor when out2d is None (torch
    allocates it in C++: cheaper than an `out=` argument). Returns the result."""
    use_gelu = _EPILOGUE[x2d.device.type][activation]
    if use_gelu is None and bias is None:
        return torch.mm(x2d, weight.t(), out=out2d)
    if use_gelu is None:
        return torch.addmm(bias, x2d, weight.t(), out=out2d)
    return torch._addmm_activation(bias, x2d, weight.t(), use_gelu=use_gelu, out=out2d)


def _linear_act_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    backend: str,
    out: torch.Tensor,
    fp32_precision: str,
) -> None:
    """`fp32_precision` is `torch.get_float32_matmul_precision()` of the caller: an argument, not read here, since
    a launcher may only depend on its arguments (`dispatch` replays it)."""
    if x.shape[0] == 0 or weight.shape[0] == 0:
        return
    auto_epilogue = backend == "auto" and x.is_cuda and _epilogue_applies(x, weight, bias, activation, out) is None
    if backend == "cublaslt" or auto_epilogue:
        _launch_epilogue(x, weight, bias, activation, out)
    else:
        _launch_triton(x, weight, bias, activation, out, fp32_precision)


triton_op("fusionscope::linear_act", mutates_args={"out"})(_linear_act_op)


@torch.compiler.assume_constant_result
def _fp32_matmul_precision() -> str:
    """torch's matmul precision setting; a constant to torch.compile, which cannot trace the getter (it returns a
    string) and would otherwise break the graph here."""
    return torch.get_float32_matmul_precision()


def linear_act(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """`act(x @ weight.T + bias)` in one kernel: the bias and activation run in the GEMM's epilogue.

    x: (..., K), fp32/fp16/bf16, any strides as long as the leading dims flatten to rows without a copy;
    weight: (N, K) (nn.Linear layout), any strides; bias: (N,) or None; all one dtype and device.
    activation: "gelu" (erf), "gelu_tanh", "relu", "silu" or "none".
    Returns (..., N) in x's dtype, into `out` if given (any strides whose leading dims flatten to rows).
    backend: "auto" (cuBLASLt epilogue where it applies, see the module docstring, else Triton), "triton" or
    "cublaslt" (ValueError where torch has no such epilogue).
    For inference: like every fusionscope kernel, the result carries no autograd history.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x must be (..., K) and weight (N, K), got x {tuple(x.shape)} and weight {tuple(weight.shape)}"
        )
    N, K = weight.shape
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != N):
        raise ValueError(f"bias must be ({N},) or None, got {tuple(bias.shape)}")
    tensors = [x, weight] + ([bias] if bias is not None else [])
    if x.dtype not in _DTYPES or any(t.dtype != x.dtype for t in tensors):
        raise ValueError(f"x, weight and bias must share one dtype of fp32/fp16/bf16, got {[t.dtype for t in tensors]}")
    if any(t.device != x.device for t in tensors):
        raise ValueError(f"x, weight and bias must be on one device, got {[str(t.device) for t in tensors]}")
    try:
        x2d = x.view(math.prod(x.shape[:-1]), K)
    except RuntimeError:
        raise ValueError(
            f"x's leading dims must flatten to rows without a copy (shape {tuple(x.shape)}, strides {x.stride()})"
        ) from None
    out_shape = (*x.shape[:-1], N)
    out2d = None
    if out is not None:
        if tuple(out.shape) != out_shape or out.dtype != x.dtype or out.device != x.device:
            raise ValueError(
                f"out must be {out_shape} {x.dtype} on {x.device}, got {tuple(out.shape)} {out.dtype} on {out.device}"
            )
        try:
            out2d = out.view(x2d.shape[0], N)
        except RuntimeError:
            raise ValueError(
                f"out's leading dims must flatten to rows without a copy (strides {out.stride()})"
            ) from None
    epilogue = backend != "triton" and (x.is_cuda or backend == "cublaslt")  # auto on the CPU: always Triton
    reason = _epilogue_applies(x2d, weight, bias, activation, out2d) if epilogue else "the Triton path was chosen"
    if backend == "cublaslt" and reason is not None:
        raise ValueError(f"backend='cublaslt' cannot run this call: {reason}")
    if reason is None and plain_eager((x2d, weight, bias, out2d)):
        # One torch op already: in eager mode the registered op's dispatch would only add host time (the op is for
        # torch.compile's graph, where it stays visible as fusionscope::linear_act).
        records = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        with torch.no_grad() if records else contextlib.nullcontext():  # no history, as on every other path
            result = _launch_epilogue(x2d, weight, bias, activation, out2d)
        return out if out is not None else result.view(out_shape)
    if out is None:
        out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
        out2d = out.view(x2d.shape[0], N)
    run("linear_act", _linear_act_op, x2d, weight, bias, activation, backend, out2d, _fp32_matmul_precision())
    return out
