"""GEMV: one row of activations times a Linear's weight, streamed at the copy roof — the decode step's matrix work.

At batch-1 decode every Linear is a matrix-vector product: `out = x @ W.T (+ b)` with x: (1, K), W: (N, K). Its
FLOPs are nothing (2·N·K); its cost is reading W once, N·K·s bytes, so its floor is N·K·s at the copy bandwidth.
cuBLAS picks a GEMM kernel for it by shape: on the H200 (torch 2.11, bf16) the 4096-wide and 3072-wide projections of
Llama-3.1-8B and Phi-3-mini got `64x8` split-K tiles plus a second launch that sums the splits, which read at 62–77%
of copy bandwidth in the replayed decode step (`reports/apply/rewrite/README.md`). Per call, element size s:
    cuBLAS split-K = N·K·s + (K + N)·s + 2·splits·N·4 (partial sums out and back)      2 launches
    this kernel    = N·K·s + (K + N)·s (+ N·s bias)                                     1 launch
so what this kernel adds is bytes in flight where cuBLAS's tiles leave the memory system idle, and one launch less.

Schedule: a program owns BLOCK_N consecutive output columns (rows of W, each a contiguous run of K elements) and walks
K in BLOCK_K steps, loading a (BLOCK_N, BLOCK_K) tile of W and BLOCK_K of x, and accumulating their products in a
(BLOCK_N, BLOCK_K) fp32 tile that is summed over K once, after the loop, so the loop holds no reduction and no
shuffle. PREFETCH loads the next tile before working on this one (Triton's pipeliner stages only loads that feed a
dot, so the bytes in flight come from the tile size, the resident programs and this). No split of K: N / BLOCK_N
programs fill the GPU at decode widths (3072 / 4 = 768 programs), and one launch writes the rounded output.

Numerics: fp32 products and sums, the bias added in fp32, one rounding to the output dtype — what cuBLAS does, in
another summation order, so outputs differ from F.linear by the order of fp32 sums (a few units in the last place of
the dtype), and both are compared with a float64 reference in the tests.

Only one row, at most WIDEST outputs: more rows (batched decode, prefill) and wider outputs (the LM head, a fused
gate_up) go to `F.linear`, whose kernels are what those shapes want.

Gated (`gemv_gated`): a GLU MLP's down_proj reads x = act(gate) * up, which `silu_and_mul` / `gelu_and_mul` write in
a launch of their own just before it (~1.5–2 µs per layer of an H200 decode step in a CUDA graph). With `ACT` the
kernel reads gate and up where it read x and computes x in its loop with those kernels' arithmetic and roundings (the
activation in fp32, rounded to the dtype; times up, rounded again), so x is bit for bit what they write and the sums
are the plain GEMV's, in its order: the fold changes no output. Its cost: each program computes the x it reads (the
activation runs N / BLOCK_N times over, as every program reads all of x) and reads gate and up, twice x's bytes,
mostly from L2; from HBM the pair's 4·I·s (gate, up in; x out and back) become 2·I·s. Not yet timed on a GPU.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from fusionscope.kernels.dispatch import Tunables, cdiv, launchable, run
from fusionscope.kernels.gelu_and_mul import _gelu, gelu_and_mul_reference
from fusionscope.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options
from fusionscope.kernels.rounding import round_to
from fusionscope.kernels.silu_and_mul import silu_and_mul_reference
from torch.library import triton_op

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# `gemv_gated`'s activations -> the kernel's ACT (0: no prologue, x is read as it is); names as
# `fusionscope.fusions.silu_and_mul.GLU_KERNELS` names them
ACTIVATIONS = {"silu": 1, "gelu": 2, "gelu_tanh": 3}
_APPROXIMATE = {"gelu": "none", "gelu_tanh": "tanh"}  # F.gelu's `approximate` of each GELU


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` in float64: x (..., K), weight (N, K), bias (N,) → (..., N) float64."""
    out = x.double() @ weight.double().T
    return out + bias.double() if bias is not None else out


def gemv_gated_reference(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         activation: str = "silu") -> torch.Tensor:  # fmt: skip
    """`gemv_reference` of x = act(gate) * up, all in float64 (no rounding of x): gate, up (..., K) → (..., N)."""
    g = gate.double()
    act = F.silu(g) if activation == "silu" else F.gelu(g, approximate=_APPROXIMATE[activation])
    return gemv_reference(act * up.double(), weight, bias)


def glu_in_dtype(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """x = act(gate) * up in eager torch, rounded as silu_and_mul and gelu_and_mul round it (the activation, then the
    product, each to the dtype): `gemv_gated`'s x where its kernel does not run."""
    if activation == "silu":
        return silu_and_mul_reference(gate, up)
    return gelu_and_mul_reference(gate, up, _APPROXIMATE[activation])


@triton.jit
def _glu(g, u, ACT: tl.constexpr, dtype: tl.constexpr):
    """act(g) * u of fp32 `g` and `u` (dtype values), as silu_and_mul and gelu_and_mul compute and round it: the
    activation in fp32 (silu as aten's x / (1 + exp(-x)), gelu as `_gelu`) rounded to `dtype`, times u, rounded again;
    kept in fp32 (exact: a `dtype` value)."""
    act = g / (1.0 + tl.exp(-g)) if ACT == 1 else _gelu(g, ACT == 3)
    return round_to(round_to(act, dtype) * u, dtype)


@triton.jit
def _gemv_kernel(
    x_ptr,  # (K,) activations, stride stride_xk; with ACT, the gate
    w_ptr,  # (N, K) weight, strides stride_wn, stride_wk
    b_ptr,  # (N,) bias, stride stride_b; read only if HAS_BIAS
    out_ptr,  # (N,) output, stride stride_on
    up_ptr,  # (K,) with ACT: up, stride stride_uk; else not read
    N,
    K,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_b,
    stride_on,
    stride_uk,
    ACT: tl.constexpr,  # 0: x as read; else x = act(gate) * up computed on the fly (`ACTIVATIONS`, `_glu`)
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter: round the output to bf16 by hand
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr,  # load the next tile of W before working on this one
    PDL: tl.constexpr,  # launched to overlap the kernel before (`pdl`): wait for it before reading x
    EARLY_W: tl.constexpr,  # under PDL with PREFETCH, W's first tile loads before the wait (no kernel writes W)
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn  # (BLOCK_N, 1)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if PDL and not (PREFETCH and EARLY_W):
        gdc_wait()
        gdc_launch_dependents()
    if PREFETCH:
        w = tl.load(w_rows + rk[None, :] * stride_wk, mask=n_ok[:, None] & (rk < K)[None, :], other=0.0)
        if PDL and EARLY_W:  # W is a weight that no kernel writes: only x (gate and up) waits for the kernel before
            gdc_wait()
            gdc_launch_dependents()
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            ahead = k + BLOCK_K  # past K: masked, no memory traffic
            w_next = tl.load(w_rows + ahead[None, :] * stride_wk, mask=n_ok[:, None] & (ahead < K)[None, :],
                             other=0.0)  # fmt: skip
            xk = tl.load(x_ptr + k * stride_xk, mask=k < K, other=0.0).to(tl.float32)
            if ACT != 0:  # another kernel's output, like x: read after the wait
                uk = tl.load(up_ptr + k * stride_uk, mask=k < K, other=0.0).to(tl.float32)
                xk = _glu(xk, uk, ACT, out_ptr.dtype.element_ty)
            acc += w.to(tl.float32) * xk[None, :]
            w = w_next
    else:
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            w = tl.load(w_rows + k[None, :] * stride_wk, mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
            xk = tl.load(x_ptr + k * stride_xk, mask=k < K, other=0.0).to(tl.float32)
            if ACT != 0:
                uk = tl.load(up_ptr + k * stride_uk, mask=k < K, other=0.0).to(tl.float32)
                xk = _glu(xk, uk, ACT, out_ptr.dtype.element_ty)
            acc += w.to(tl.float32) * xk[None, :]
    total = tl.sum(acc, axis=1)
    if HAS_BIAS:
        total += tl.load(b_ptr + rn * stride_b, mask=n_ok, other=0.0).to(tl.float32)
    if UPCAST:  # the interpreter truncates fp32 → bf16: round to nearest by hand (`rounding`)
        total = round_to(total, out_ptr.dtype.element_ty)
    tl.store(out_ptr + rn * stride_on, total.to(out_ptr.dtype.element_ty), mask=n_ok)


# The schedules, (columns per program, inputs per step, warps, prefetch), chosen on the H200 by
# `reports/gemv/gpu_gemv.py` (2026-12-04 18:44, bf16, weights L2-cold, 16 decode projections of six families, 16
# schedules; reports/gemv/README.md):
# up to `narrow_max` outputs, 4 columns with prefetch (1.05–1.39× cuBLAS: more programs keep more loads in flight);
# wider, 8 columns without (0.98–1.17×; with prefetch the wide ones lost up to 14%). `force` (a schedule) overrides
# both: the sweep's handle.
TILES = Tunables(narrow=(4, 512, 4, 1), wide=(8, 512, 4, 0), narrow_max=4608, force=None)
# The Triton interpreter's cost of a launch, fitted on 2 CPU cores (SmolLM2's and the tiny models' shapes, 30 tiles
# each): ~2.4 ms a program, ~1.7 ms a step of the K loop, ~32 ns an element of every tile loaded, masked ones too.
# `interpreter_tiles` picks the tile that costs least by it: on SmolLM2's o_proj (576 × 576) and down_proj (576 × 1536)
# 36 and 53 ms a call against 47 and 110 with the largest tile, 1024 × 1024 (which pads 576 to 1024).
INTERPRETER_COST_MS = {"program": 2.4, "step": 1.7, "element": 32e-6}
INTERPRETER_MAX_TILE = 1 << 20  # Triton's limit on a block's elements


@functools.lru_cache(maxsize=256)
def interpreter_tiles(N: int, K: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of least cost under the interpreter (`INTERPRETER_COST_MS`) for an (N, K) weight."""
    cost = INTERPRETER_COST_MS

    def estimate(block_n: int, block_k: int) -> float:
        programs, steps = cdiv(N, block_n), cdiv(K, block_k)
        return (programs * cost["program"] + programs * steps * cost["step"]
                + programs * steps * block_n * block_k * cost["element"])  # fmt: skip

    sizes_n = [1 << b for b in range(4, max(4, (N - 1).bit_length()) + 1)]
    sizes_k = [1 << b for b in range(4, max(4, (K - 1).bit_length()) + 1)]
    tiles = [(n, k) for n in sizes_n for k in sizes_k if n * k <= INTERPRETER_MAX_TILE]
    return min(tiles, key=lambda t: (estimate(*t), -t[0] * t[1]))


def schedule(N: int, K: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, PREFETCH) for an (N, K) weight."""
    if TILES["force"] is not None:
        return TILES["force"]
    if os.environ.get("TRITON_INTERPRET") == "1":
        return (*interpreter_tiles(N, K), 4, 0)
    narrow = N <= TILES["narrow_max"]  # noqa: SIM300
    return TILES["narrow"] if narrow else TILES["wide"]


def _launch(x: torch.Tensor, up: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
            out: torch.Tensor, constant_weight: bool, act: int) -> None:  # fmt: skip
    """The one launch of both ops: `act` 0 reads x as it is, else x is the gate and `up` is read beside it."""
    N, K = weight.shape
    block_n, block_k, num_warps, prefetch = schedule(N, K)
    block_k = min(block_k, max(16, 1 << (K - 1).bit_length()))
    block_n = min(block_n, max(16, 1 << (N - 1).bit_length()))
    pdl = launch_options(out)
    launchable(_gemv_kernel)[(cdiv(N, block_n),)](
        x, weight, bias if bias is not None else out, out, up if up is not None else x, N, K, x.stride(0),
        weight.stride(0), weight.stride(1), bias.stride(0) if bias is not None else 0, out.stride(0),
        up.stride(0) if up is not None else 0, ACT=act, HAS_BIAS=bias is not None,
        UPCAST=os.environ.get("TRITON_INTERPRET") == "1" and out.dtype == torch.bfloat16, BLOCK_N=block_n,
        BLOCK_K=block_k, PREFETCH=prefetch, EARLY_W=constant_weight and pdl["PDL"], num_warps=num_warps, **pdl,
    )  # fmt: skip


def _gemv_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, constant_weight: bool
) -> None:
    """Writes x @ weight.T (+ bias) into out; x: (K,) any stride, weight: (N, K) any strides, out: (N,).
    `constant_weight`: no kernel writes the weight (a Parameter), so under PDL its first tile loads before the wait."""
    _launch(x, None, weight, bias, out, constant_weight, 0)


def _gemv_gated_op(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   out: torch.Tensor, constant_weight: bool, activation: str) -> None:  # fmt: skip
    """Writes (act(gate) * up) @ weight.T (+ bias) into out, x rounded as the GLU kernels write it; gate, up: (K,)
    any strides; the rest as `_gemv_op`."""
    _launch(gate, up, weight, bias, out, constant_weight, ACTIVATIONS[activation])


triton_op("fusionscope::gemv", mutates_args={"out"})(_gemv_op)
triton_op("fusionscope::gemv_gated", mutates_args={"out"})(_gemv_gated_op)


# The widest output the kernel serves: from 16384 outputs on, cuBLAS streams the weight at the copy roof too
# (0.98–1.01× at 16384–28672 in the sweep), and `gemv` leaves them to it. `fusionscope.fusions.gemv.WIDEST` is the same
# bound on the finder's side (tests check that they agree).
WIDEST = 12288


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `gemv` runs its kernel for these operands (one row of x, at most WIDEST outputs unless a schedule is
    forced, on a GPU or under the interpreter, a dtype it takes); otherwise it calls F.linear. Interpreted kernels
    cannot be traced by torch.compile (a CPU tensor in a compiled graph), so there it is F.linear too."""
    return (
        math.prod(x.shape[:-1]) == 1
        and (weight.shape[0] <= WIDEST or TILES["force"] is not None)
        and x.dtype == weight.dtype
        and x.dtype in _DTYPES
        and (x.is_cuda or (os.environ.get("TRITON_INTERPRET") == "1" and not torch.compiler.is_compiling()))
    )


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for one row of x in one streaming launch: x (..., K) with one row in all, weight
    (N, K), bias (N,) or None, one dtype (fp32/fp16/bf16) and device. Any other input (several rows, more than
    WIDEST outputs, mixed dtypes, a CPU tensor outside the interpreter) is `F.linear`'s. Returns (..., N)."""
    if not takes(x, weight):
        return F.linear(x, weight, bias)
    out, constant = _checked_output("gemv", "x", x, weight, bias)
    N, K = weight.shape
    run("gemv", _gemv_op, x.reshape(K), weight, bias, out.view(N), constant)
    return out


def _checked_output(name: str, what: str, x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> tuple[torch.Tensor, bool]:  # fmt: skip
    """`gemv`'s and `gemv_gated`'s operand checks (x, or the gate, named `what`), their output (..., N), and whether
    the weight is constant: a Parameter no kernel of the step writes (`_gemv_op`; compiled launches take no PDL)."""
    N, K = weight.shape
    if x.shape[-1] != K:
        raise ValueError(f"{name}: {what} has {x.shape[-1]} inputs, the weight {K}")
    if bias is not None and (bias.shape != (N,) or bias.dtype != x.dtype):
        raise ValueError(f"{name}: bias must be ({N},) {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    constant = not torch.compiler.is_compiling() and type(weight) is torch.nn.Parameter
    return x.new_empty((*x.shape[:-1], N)), constant


def gemv_gated(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               activation: str = "silu") -> torch.Tensor:  # fmt: skip
    """`gemv(act(gate) * up, weight, bias)` in one launch: a GLU MLP's down_proj with the `silu_and_mul` (activation
    "silu") or `gelu_and_mul` ("gelu": erf, "gelu_tanh") before it folded into its loop. gate, up (..., K), one row,
    any strides (the two halves of a gate_up output are views); x is computed and rounded exactly as that kernel
    writes it and summed as `gemv` sums, so the result is the pair's bit for bit (the tests check it in the
    interpreter). Where `gemv` would call F.linear (`takes`), this is F.linear of x computed in eager torch with the
    same roundings (`glu_in_dtype`: aten's activation, which may sit an ulp from the kernel's at a rounding tie, as
    silu_and_mul's docstring says). Returns (..., N)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"gemv_gated: activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    if up.shape != gate.shape or up.dtype != gate.dtype or up.device != gate.device:
        raise ValueError(f"gemv_gated: gate and up must have one shape, dtype and device, got {tuple(gate.shape)} "
                         f"{gate.dtype} on {gate.device} and {tuple(up.shape)} {up.dtype} on {up.device}")  # fmt: skip
    if not takes(gate, weight):
        return F.linear(glu_in_dtype(gate, up, activation), weight, bias)
    out, constant = _checked_output("gemv_gated", "gate", gate, weight, bias)
    N, K = weight.shape
    run("gemv_gated", _gemv_gated_op, gate.reshape(K), up.reshape(K), weight, bias, out.view(N), constant, activation)
    return out
