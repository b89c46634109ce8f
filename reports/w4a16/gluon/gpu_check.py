"""Check, then time, the Gluon W4A16 kernels of `w4a16_gluon.py` on one GPU, with the host side they lack elsewhere.

Usage, from the repository root (the project installed, torch, Triton 3.6 with Gluon, one sm_90 GPU):
    python3 reports/w4a16/gluon/gpu_check.py OUT_DIR [--budget SECONDS]     # the GPU run
    python3 reports/w4a16/gluon/gpu_check.py --cpu-check [OUT_DIR]         # what can be checked without a GPU
Writes OUT_DIR/gluon_check.jsonl (one JSON row per check or timing, flushed as written, so a run stopped at its time
limit keeps what it did) and OUT_DIR/gluon_check.json (meta and summary) at the end. Exit status: 0 all checks
passed and something was timed, 1 otherwise, 2 no CUDA device, 3 stopped by a CUDA error. --cpu-check writes
OUT_DIR/gluon_cpu_check.json and OUT_DIR/dry_run/ if OUT_DIR is given (a temporary folder otherwise).

What is here, because nothing else in the folder has it:
- `repack_mma_torch`: `PackedW4.qweight` -> the `MmaW4` words, vectorised torch (CPU or CUDA). `model.repack_mma`
  (NumPy) is the layout's definition; the torch version must equal it bit for bit (checked on both machines).
- `plan_for` / `SwapCall`: the launcher of `w4a16_swap_kernel`. Grid (N / BLOCK_N, splits); the kernel writes fp32
  partial sums to a (splits, M, N) workspace; the split sum and the bf16 rounding are torch (`torch.sum` over the
  splits, then `copy_` into the bf16 output, round to nearest even), not a fused kernel: they are included in every
  timing. Splits: whole loop steps per split, the count whose programs (N / BLOCK_N · splits) are nearest to
  FILL × SMs in ratio, for FILL 2, 4 and 8. A split of one block makes `blocks_per_split` = 1, which Triton's JIT
  specialises to a constant (the kernel's loop then runs once and is compiled without its back edge); rows say so.

The GPU run, in order (no new check or timing starts once --budget seconds are spent):
1. The torch repack on CUDA against `model.repack_mma`, per shape.
2. Correctness of every (variant, shape, M) before any timing: variants swap, swap-b2, swap-pf, swap-pp (the
   `CANDIDATES` of count.py) × FILL 2, 4, 8; shapes K -> N 4096 -> 4096, 4096 -> 14336, 14336 -> 4096; M 1, 2, 4, 8,
   16; group 128, bf16. Weights: randn(N, K) / sqrt(K) quantised by the project's `quantize_w4`; x: randn (never
   zeros); output and workspace filled with NaN before the launch. Reference: the project's `w4a16_reference` in
   float64 (`dequantize_w4` with float64 scales, then the matmul), the tolerance of tests/kernels/test_w4a16_gemm.py:
   bf16's (atol, rtol) of `tolerances.TOLERANCES`, both × max(1, sqrt(K / 64)), |got − ref| ≤ atol + rtol·|ref|
   element-wise, NaN failing. The shipped `w4a16_gemm` and bf16 cuBLAS (F.linear on the dequantised bf16 weight) are
   checked the same way. A failure is a row and that (variant, shape, M) is not timed; an exception is a row; a CUDA
   error (sticky: the context is unusable after it) writes its row and the summary, then ends the run.
3. Timing of what passed, per (shape, M), with `reports/w4a16/gpu_w4a16.py`'s functions (imported): a CUDA graph of
   ≥ 48 calls (`graph_timer`), each call on its own copy of the weights, the copies together > 160 MB so that they
   rotate past the 50 MB L2 and every call reads from HBM; each timing is the median replay ÷ calls; 3 interleaved
   rounds of all variants, bf16 cuBLAS and the shipped kernel (`time_rounds`), the median of the rounds kept. Rows:
   µs; GB/s of the weight bytes (int4 words + bf16 scales + uint8 zeros) per second; × bf16 (bf16 µs ÷ µs); × shipped.
   Copy roofs by the same graph method (`copy_gbps`, counting read + write): 1 GiB and each shape's weight bytes.
   A timing replays calls of the whole launcher: the Gluon kernel, `torch.sum` and the `copy_` (three launches).

--cpu-check (no GPU, ~25 s): the torch repack against `model.repack_mma` bit for bit on odd shapes, the plans of every
(variant, shape, M), the launcher's host side around `EmulatedKernel` (a torch stand-in reading the MmaW4 words)
against float64, the launch's keywords against the kernel's parameters, and a dry run of this GPU code on the CPU
(small shapes, the kernel emulated, the shipped kernel in Triton's interpreter, wall-clock timing). What it cannot
check: the compiled Gluon kernel's results, CUDA-graph capture of its launch, and every number the GPU run measures.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import importlib.util
import json
import math
import os
import platform
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096))  # (K, N)
ROWS = (1, 2, 4, 8, 16)
GROUP = 128  # the only group size the Gluon kernels take: one group = one 128-input block
FILLS = (2, 4, 8)  # programs per SM the split count aims at
ROUNDS = 3
BUDGET_S = 480.0  # default: leaves a 600 s command limit room for start-up and the summary
SMS_CPU = 132  # H100 / H200 SXM: the SM count the CPU check plans for
CUDA_FATAL = re.compile(
    r"CUDA error|cudaError|illegal memory access|illegal instruction|misaligned address|unspecified launch failure"
    r"|device-side assert|an illegal",
    re.IGNORECASE,
)


class Kernel(NamedTuple):
    """One compiled form of `w4a16_swap_kernel`: its constexprs and warps (count.py's `CANDIDATES`, same names)."""

    BLOCK_N: int  # output columns per program
    SUB: int  # 128-blocks per loop step
    num_warps: int
    PREFETCH: int  # 0 none, 1 next block loaded before this one's math (SUB 1), 2 ping-pong (SUB 2)


KERNELS = {
    "swap": Kernel(256, 1, 4, 0),
    "swap-b2": Kernel(256, 2, 4, 0),
    "swap-pf": Kernel(256, 1, 4, 1),
    "swap-pp": Kernel(256, 2, 4, 2),
}


def variants() -> dict[str, tuple[Kernel, int]]:
    """{label: (kernel, FILL)}: every kernel form at every FILL, e.g. "swap-pp/fill4"."""
    return {f"{name}/fill{fill}": (kernel, fill) for name, kernel in KERNELS.items() for fill in FILLS}


# (label, a call writing into the given bf16 output and returning it, the plan's fields for its check row)
CheckRun = tuple[str, Callable[[torch.Tensor], torch.Tensor], dict[str, Any]]


class MmaW4(NamedTuple):
    """The repacked weights the Gluon kernels read (README: "The repacked layout")."""

    qw: torch.Tensor  # int32 (K / 128, N, 4, 4)
    scales: torch.Tensor  # bf16 (K / 128, N), as in PackedW4
    zeros: torch.Tensor  # uint8 (K / 128, N), as in PackedW4


# ---------------------------------------------------------------------------------------------- layout (torch)


def repack_mma_torch(qweight: torch.Tensor, K: int | None = None) -> torch.Tensor:
    """`PackedW4.qweight` int32 (16·B, N) -> `MmaW4.qw` int32 (B, N, 4, 4), on qweight's device, vectorised.

    PackedW4: nibble j of word [16b + r, n] is q[128b + 16j + r, n]. MmaW4: nibble j of word [b, n, t, u] is
    q[128b + 32t + 8u + 2·(j % 4) + j // 4, n]. So the 128 inputs of a block, split as (t, u, i, e) with
    k = 32t + 8u + 2i + e, go to nibble j = i + 4e of word (t, u). Inputs ≥ K (if K is given) are set to 0, as
    `model.repack_mma(qweight, K)` does; PackedW4 already holds zeros there. The words are built in int64 (nibble 7
    reaches bit 31) and wrapped to two's-complement int32 explicitly, as the project's `pack_w4` does."""
    if qweight.dtype != torch.int32 or qweight.dim() != 2 or qweight.shape[0] % 16:
        raise ValueError(f"qweight must be int32 (16·B, N), got {tuple(qweight.shape)} {qweight.dtype}")
    rows, N = qweight.shape
    B = rows // 16
    dev = qweight.device
    shifts = 4 * torch.arange(8, dtype=torch.int32, device=dev)
    q = (qweight.reshape(B, 1, 16, N) >> shifts.view(1, 8, 1, 1)) & 0xF  # (b, j, r, n): input 16j + r of block b
    q = q.reshape(B, 128, N)
    if K is not None and K < B * 128:
        q = q * (torch.arange(B * 128, device=dev).view(B, 128, 1) < K)
    q = q.reshape(B, 4, 4, 4, 2, N).permute(0, 5, 1, 2, 4, 3)  # (b, n, t, u, e, i): nibble j = 4e + i, i fastest
    q = q.reshape(B, N, 4, 4, 8).to(torch.int64)
    words = (q << (4 * torch.arange(8, dtype=torch.int64, device=dev))).sum(-1)  # disjoint bits: the sum is the OR
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32).contiguous()


def unpack_mma_torch(qw: torch.Tensor) -> torch.Tensor:
    """`MmaW4.qw` (B, N, 4, 4) -> q (128·B, N) int32 in input order: the inverse of `repack_mma_torch`, written from
    the layout's formula (it reads the words as the kernel does), used by the CPU check's emulation of the kernel."""
    B, N = qw.shape[:2]
    nib = (qw.unsqueeze(-1) >> (4 * torch.arange(8, dtype=torch.int32, device=qw.device))) & 0xF  # (b, n, t, u, j)
    nib = nib.reshape(B, N, 4, 4, 2, 4)  # j = 4e + i -> (b, n, t, u, e, i)
    return nib.permute(0, 2, 3, 5, 4, 1).reshape(B * 128, N)  # (b, t, u, i, e, n): k = 128b + 32t + 8u + 2i + e


def to_mma(packed: Any) -> MmaW4:
    """A `PackedW4` (group 128) as the Gluon kernels read it: the words repacked, scales and zeros as they are."""
    if packed.group_size != GROUP:
        raise ValueError(f"the Gluon kernels take group {GROUP} only, got {packed.group_size}")
    return MmaW4(repack_mma_torch(packed.qweight), packed.scales.contiguous(), packed.zeros.contiguous())


# ---------------------------------------------------------------------------------------------- launcher


class Plan(NamedTuple):
    """One launch of `w4a16_swap_kernel`: a function of the shape, the kernel form, FILL and the SM count only."""

    grid: tuple[int, int]  # (N / BLOCK_N column programs, splits)
    splits: int
    blocks_per_split: int  # a multiple of SUB; the last split may hold fewer blocks (the kernel clamps to K / 128)
    programs: int
    MT: int  # tokens per mma: 8 for M ≤ 8, 16 for M ≤ 16


def plan_for(M: int, N: int, K: int, kernel: Kernel, fill: int, sms: int) -> Plan:
    """The split of K whose program count is nearest to fill × sms in ratio (ties: fewer programs), in whole loop
    steps of SUB blocks, so that every split is whole steps (the kernel's loop has no masks). ValueError for what the
    kernel does not take: K % (128·SUB), N % BLOCK_N, M outside 1..16."""
    if not 1 <= M <= 16:
        raise ValueError(f"the swap kernel takes 1 to 16 rows, got M = {M}")
    if K % (128 * kernel.SUB) or N % kernel.BLOCK_N:
        raise ValueError(f"K = {K} must be a multiple of {128 * kernel.SUB} and N = {N} of {kernel.BLOCK_N}")
    steps = K // (128 * kernel.SUB)
    cols = N // kernel.BLOCK_N
    target = fill * sms

    def miss(per: int) -> tuple[float, int]:
        return abs(math.log(cols * math.ceil(steps / per) / target)), -per

    per = min(range(1, steps + 1), key=miss)
    splits = math.ceil(steps / per)
    return Plan((cols, splits), splits, per * kernel.SUB, cols * splits, 8 if M <= 8 else 16)


def split_ranges(plan: Plan, K: int) -> list[tuple[int, int]]:
    """[first, last) blocks of each split, as the kernel computes them from program_id(1)."""
    blocks = K // 128
    return [(s * plan.blocks_per_split, min(s * plan.blocks_per_split + plan.blocks_per_split, blocks))
            for s in range(plan.splits)]  # fmt: skip


def finish(ws: torch.Tensor, acc: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The split sum and the rounding, in torch: acc (M, N) fp32 = Σ over splits of ws, then out (bf16) = acc rounded
    to nearest even by `copy_`. Two launches into preallocated buffers, so a CUDA graph captures them as they are."""
    torch.sum(ws, dim=0, out=acc)
    return out.copy_(acc)


class SwapCall:
    """One (kernel form, plan) at one (M, N, K): owns the fp32 workspace (splits, M, N) and the fp32 sum (M, N), which
    consecutive calls on one stream may share, and launches the kernel (or `emulate`, on the CPU), then `finish`."""

    def __init__(self, fn: Any, kernel: Kernel, plan: Plan, M: int, N: int, K: int, device: torch.device) -> None:
        self.fn, self.kernel, self.plan, self.M, self.N, self.K = fn, kernel, plan, M, N, K
        self.ws = torch.empty((plan.splits, M, N), dtype=torch.float32, device=device)
        self.acc = torch.empty((M, N), dtype=torch.float32, device=device)

    def launch(self, x: torch.Tensor, w: MmaW4) -> None:
        """The kernel alone, writing `ws` (the asserts are the kernel's unmasked-loop assumptions)."""
        assert x.shape == (self.M, self.K) and x.is_contiguous() and x.dtype == torch.bfloat16
        assert w.qw.shape == (self.K // 128, self.N, 4, 4) and w.qw.is_contiguous()
        self.fn[self.plan.grid](
            x, w.qw, w.scales, w.zeros, self.ws, self.M, self.N, self.K, self.plan.blocks_per_split,
            BLOCK_N=self.kernel.BLOCK_N, MT=self.plan.MT, SUB=self.kernel.SUB, PREFETCH=self.kernel.PREFETCH,
            num_warps=self.kernel.num_warps,
        )  # fmt: skip

    def __call__(self, x: torch.Tensor, w: MmaW4, out: torch.Tensor) -> torch.Tensor:
        self.launch(x, w)
        return finish(self.ws, self.acc, out)


class EmulatedKernel:
    """A torch stand-in for `w4a16_swap_kernel[grid](...)` (CPU): per 128-block the fp32 sum of x·(q − z), q read from
    the MmaW4 words by the layout's formula, times the block's scale; the blocks [s·bps, min((s + 1)·bps, K / 128))
    of split s = 0 .. grid[1] − 1 summed in fp32 into ws[s], as the kernel's program_id(1) does. It checks the host
    side (plan, workspace, finish) and the repacked words' meaning, not the kernel. `launches` counts the calls."""

    arg_names = ("x_ptr", "qw_ptr", "s_ptr", "z_ptr", "out_ptr", "M", "N", "K", "blocks_per_split", "BLOCK_N", "MT",
                 "SUB", "PREFETCH")  # fmt: skip

    def __init__(self) -> None:
        self.launches = 0

    def __getitem__(self, grid: tuple[int, int]) -> Callable[..., None]:
        def launch(x: torch.Tensor, qw: torch.Tensor, s: torch.Tensor, z: torch.Tensor, ws: torch.Tensor, M: int,
                   N: int, K: int, blocks_per_split: int, **constexprs: int) -> None:  # fmt: skip
            assert set(constexprs) == {"BLOCK_N", "MT", "SUB", "PREFETCH", "num_warps"}, constexprs
            assert grid[0] * constexprs["BLOCK_N"] == N and ws.shape == (grid[1], M, N)
            B = K // 128
            w = unpack_mma_torch(qw).float().view(B, 128, N) - z.float()[:, None, :]
            part = torch.einsum("mbk,bkn->bmn", x.float().view(M, B, 128), w) * s.float()[:, None, :]
            for sp in range(grid[1]):
                first = sp * blocks_per_split
                ws[sp] = part[first : min(first + blocks_per_split, B)].sum(0)
            self.launches += 1

        return launch


# ---------------------------------------------------------------------------------------------- helpers


def load_path(name: str, path: Path) -> ModuleType:
    """A module from a file of the reports tree (not a package)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def kernel_module() -> ModuleType:
    """The project's w4a16 module (the package attribute `w4a16_gemm` is the function, so import the module)."""
    return importlib.import_module("fusionscope.kernels.w4a16_gemm")


def gluon_module() -> ModuleType:
    """w4a16_gluon, imported by name from this folder (Triton's JIT reads the kernels' source by file)."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    return importlib.import_module("w4a16_gluon")


def tolerance(K: int) -> tuple[float, float]:
    """(atol, rtol) of tests/kernels/test_w4a16_gemm.py for bf16: the table's × max(1, sqrt(K / 64))."""
    from fusionscope.kernels.tolerances import TOLERANCES

    atol, rtol = TOLERANCES[torch.bfloat16]
    scale = max(1.0, math.sqrt(K / 64))
    return atol * scale, rtol * scale


def compare(got: torch.Tensor, exact: torch.Tensor, K: int, sum_abs: torch.Tensor | None = None) -> dict[str, Any]:
    """What assert_close would decide (|got − exact| ≤ atol + rtol·|exact|, NaN failing), as numbers for a row.

    The project's tolerance is loose next to what this arithmetic should give (model.py: within one bf16 rounding
    of the output plus fp32 accumulation), so with `sum_abs` (Σ|x|·|w| per output, float64) the row also gets
    `max_err_over_ulp`: error ÷ (2⁻⁸·|ref| + 1e-6·Σ|x·w|), model.py's bound; ≤ 1 expected for the Gluon kernels. It is
    a diagnostic (a slightly wrong layout can pass the tolerance and not this), not the pass criterion."""
    atol, rtol = tolerance(K)
    err = (got.double() - exact).abs()
    allowed = atol + rtol * exact.abs()
    bad = ~(err <= allowed)
    finite = torch.nan_to_num(err, nan=float("inf"))
    row = {
        "ok": not bool(bad.any()),
        "bad": int(bad.sum()),
        "nan": int(torch.isnan(got).sum()),
        "max_abs_err": float(finite.max()),
        "max_err_over_allowed": float((finite / allowed).max()),
        "max_abs_ref": float(exact.abs().max()),
        "atol": atol,
        "rtol": rtol,
    }
    if sum_abs is not None:
        row["max_err_over_ulp"] = float((finite / (2.0**-8 * exact.abs() + 1e-6 * sum_abs)).max())
    return row


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:2000]


# ---------------------------------------------------------------------------------------------- CPU check


def cpu_check(out_dir: Path | None) -> int:
    """The torch repack against `model.repack_mma` (bit for bit), the plan arithmetic for every variant, shape and M,
    the launcher's host side around an emulated kernel against the float64 reference, and a dry run of `gpu_run`
    (module docstring). No GPU, no Gluon launch. Returns 0 if everything passed."""
    # before the project's kernels are defined, so that the dry run's shipped kernel runs in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
    model = load_path("w4a16_gluon_model", HERE / "model.py")
    mod = kernel_module()
    gen = torch.Generator().manual_seed(0)
    report: dict[str, Any] = {"repack": [], "plans": [], "emulated": [], "kernel_signature": None}
    failures: list[str] = []

    # 1. repack: random nibbles (every nibble 0..15, nibble 7 ≥ 8 gives negative words), K inside and at the end of a
    #    block, odd N; raw random int32 words (every bit pattern); the project's quantiser's output.
    cases: list[tuple[str, torch.Tensor, int]] = []
    for K, N in ((128, 1), (256, 3), (300, 7), (1000, 33), (1024, 256), (4096, 24), (129, 5)):
        q = torch.randint(0, 16, (K, N), generator=gen)
        cases.append((f"pack_w4 K{K} N{N}", mod.pack_w4(q), K))
    raw = torch.randint(-(2**31), 2**31, (16 * 5, 9), generator=gen, dtype=torch.int64).to(torch.int32)
    cases.append(("raw int32 K640 N9", raw, 640))
    weight = torch.randn(512, 768, generator=gen) / 768**0.5
    cases.append(("quantize_w4 768->512", mod.quantize_w4(weight.to(torch.bfloat16), GROUP).qweight, 768))
    for name, qweight, K in cases:
        ref = model.repack_mma(qweight.numpy(), K)
        got = repack_mma_torch(qweight, K).numpy()
        same = got.shape == ref.shape and got.dtype == ref.dtype and np.array_equal(got, ref)
        back = bool(torch.equal(unpack_mma_torch(torch.from_numpy(got))[:K], mod.unpack_w4(qweight, K)))
        report["repack"].append({"case": name, "shape": list(got.shape), "bit_equal_model": bool(same),
                                 "inverse_equals_unpack_w4": back})  # fmt: skip
        if not (same and back):
            failures.append(f"repack {name}: model equal {same}, inverse {back}")

    # 2. plans: every split covers whole steps, the splits tile the blocks exactly once, the ping-pong loop sees an even
    #    count, the workspace and grid agree; programs near fill × SMs.
    for K, N in SHAPES:
        for label, (kernel, fill) in variants().items():
            for M in ROWS:
                plan = plan_for(M, N, K, kernel, fill, SMS_CPU)
                spans = split_ranges(plan, K)
                covered = [b for first, last in spans for b in range(first, last)]
                ok = (
                    covered == list(range(K // 128))
                    and all(last > first and (last - first) % kernel.SUB == 0 for first, last in spans)
                    and plan.blocks_per_split % kernel.SUB == 0
                    and plan.grid == (N // kernel.BLOCK_N, plan.splits)
                    and (8 if M <= 8 else 16) == plan.MT
                )
                if M == 1:
                    report["plans"].append({"K": K, "N": N, "variant": label, "grid": plan.grid,
                                            "blocks_per_split": plan.blocks_per_split,
                                            "last_split_blocks": spans[-1][1] - spans[-1][0],
                                            "programs_per_sm": plan.programs / SMS_CPU, "ok": ok})  # fmt: skip
                if not ok:
                    failures.append(f"plan {label} {K}->{N} M{M}: {plan}")
    for bad in ((17, 256, 256), (1, 200, 256), (1, 256, 100)):
        try:
            plan_for(*bad, KERNELS["swap-b2"], 2, SMS_CPU)
            failures.append(f"plan_for took {bad}")
        except ValueError:
            pass

    # 3. the launcher's host side (workspace, split sum, rounding) around an emulated kernel, against the float64
    #    reference at the GPU run's tolerance; the workspace and output start as NaN.
    for (K, N), M, label in (((512, 256), 1, "swap/fill2"), ((1024, 512), 3, "swap-pp/fill8"),
                             ((768, 256), 16, "swap-b2/fill4"), ((1280, 768), 9, "swap-pf/fill2")):  # fmt: skip
        kernel, fill = variants()[label]
        weight = torch.randn(N, K, generator=gen) / K**0.5
        p = mod.quantize_w4(weight.to(torch.bfloat16), GROUP)
        x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
        plan = plan_for(M, N, K, kernel, fill, sms=8)  # a small "GPU", so these sizes split
        call = SwapCall(EmulatedKernel(), kernel, plan, M, N, K, torch.device("cpu"))
        call.ws.fill_(float("nan"))
        out = torch.full((M, N), float("nan"), dtype=torch.bfloat16)
        got = call(x, to_mma(p), out)
        exact = mod.w4a16_reference(x.double(), p.qweight, p.scales.double(), p.zeros, GROUP)
        w64 = mod.dequantize_w4(p.qweight, p.scales.double(), p.zeros, GROUP, K)
        sum_abs = x.double().abs() @ w64.abs()
        row = {"K": K, "N": N, "M": M, "variant": label, "splits": plan.splits, **compare(got, exact, K, sum_abs)}
        report["emulated"].append(row)
        if not row["ok"] or row["max_err_over_ulp"] > 1 or got.data_ptr() != out.data_ptr():
            failures.append(f"emulated {label} {K}->{N} M{M}: {row}")

    # 4. the launch's keywords are the kernel's parameters (if this Triton has Gluon; the GPU image's 3.6 does).
    try:
        names = list(gluon_module().w4a16_swap_kernel.arg_names)
        want = ["x_ptr", "qw_ptr", "s_ptr", "z_ptr", "out_ptr", "M", "N", "K", "blocks_per_split", "BLOCK_N", "MT",
                "SUB", "PREFETCH"]  # fmt: skip
        report["kernel_signature"] = {"arg_names": names, "ok": names == want}
        if names != want:
            failures.append(f"w4a16_swap_kernel parameters {names} != the launch's {want}")
    except Exception as exc:  # no Gluon in this Triton: not checkable here
        report["kernel_signature"] = {"skipped": error_text(exc)}

    # 5. the GPU run's own code end to end on the CPU: small shapes, the kernel emulated (`EmulatedKernel`), the
    #    shipped kernel in Triton's interpreter, gpu_w4a16's wall-clock timer. Every check must pass and every
    #    (shape, M) be timed for all variants, bf16 and shipped.
    with tempfile.TemporaryDirectory() as tmp:
        dry = out_dir / "dry_run" if out_dir is not None else Path(tmp)
        fake = EmulatedKernel()
        shapes, rows = ((512, 256), (256, 512)), (1, 3, 16)
        t0 = time.monotonic()
        rc = gpu_run(dry, 600.0, torch.device("cpu"), fake, shapes, rows, quiet=True)
        summ = json.loads((dry / "gluon_check.json").read_text())["summary"]
        labels = {"bf16", "shipped", *variants()}
        dry_row = {
            "rc": rc,
            "seconds": time.monotonic() - t0,
            "checks": len(summ["checks"]),
            "checks_failed": [c for c in summ["checks"] if not c["ok"]],
            "max_err_over_ulp_gluon": max(c["max_err_over_ulp"] for c in summ["checks"] if "/fill" in c["variant"]),
            "points": len(summ["points"]),
            "points_missing_labels": [(p["K"], p["N"], p["M"]) for p in summ["points"] if set(p["rows"]) != labels],
            "emulated_launches": fake.launches,
            "stopped": summ["stopped"],
        }
        report["dry_run"] = dry_row
        if (rc != 0 or dry_row["checks"] != len(shapes) * len(rows) * len(labels) or dry_row["checks_failed"]
                or dry_row["points"] != len(shapes) * len(rows) or dry_row["points_missing_labels"]):  # fmt: skip
            failures.append(f"dry run: {dry_row}")

    report["failures"] = failures
    report["ok"] = not failures
    for r in report["repack"]:
        print(f"repack {r['case']:24} {r['shape']!s:18} model {r['bit_equal_model']} inverse "
              f"{r['inverse_equals_unpack_w4']}")  # fmt: skip
    for r in report["plans"]:
        print(
            f"plan {r['K']:>5}->{r['N']:<5} {r['variant']:14} grid {r['grid']!s:9} blocks/split "
            f"{r['blocks_per_split']:>2} (last {r['last_split_blocks']:>2}) {r['programs_per_sm']:.2f}/SM {r['ok']}"
        )
    for r in report["emulated"]:
        print(
            f"emulated {r['K']:>5}->{r['N']:<4} M {r['M']:>2} {r['variant']:14} splits {r['splits']:>2} ok "
            f"{r['ok']} max err {r['max_abs_err']:.3g} ({r['max_err_over_allowed']:.3f} of allowed, "
            f"{r['max_err_over_ulp']:.2f} of model.py's bound)"
        )
    print(f"kernel signature: {report['kernel_signature']}")
    print(f"dry run of the GPU code on the CPU: {report['dry_run']}")
    print("cpu check: " + ("all passed" if report["ok"] else "FAILED: " + "; ".join(failures)))
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "gluon_cpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    return 0 if report["ok"] else 1


# ---------------------------------------------------------------------------------------------- GPU run


class Out:
    """Rows to OUT/gluon_check.jsonl, flushed one by one; `log` prints. The `row`/`log` interface is the one
    gpu_w4a16's `time_rounds` writes to."""

    def __init__(self, folder: Path, quiet: bool = False) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.quiet = quiet
        self.jsonl = (folder / "gluon_check.jsonl").open("w", encoding="utf-8")

    def row(self, row: dict[str, Any]) -> None:
        self.jsonl.write(json.dumps(row, default=str) + "\n")
        self.jsonl.flush()

    def log(self, line: str) -> None:
        if not self.quiet:
            print(line, flush=True)


class Fatal(Exception):
    """A CUDA error: the context cannot run anything more."""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sticky_error(device: torch.device) -> str | None:
    """The CUDA error the context holds, if any: a synchronisation that fails (none off the GPU)."""
    try:
        sync(device)
    except Exception as sync_exc:
        return error_text(sync_exc)
    return None


def cuda_fatal(exc: BaseException, device: torch.device) -> str | None:
    """The sticky CUDA error behind `exc`, if any: a synchronisation that fails, or a message naming one."""
    text = error_text(exc)
    return sticky_error(device) or (text if device.type == "cuda" and CUDA_FATAL.search(text) else None)


class ShapeData(NamedTuple):
    """One shape's weights, made once: the project's PackedW4, its MmaW4 repack, the dequantised bf16 weight (N, K)
    for cuBLAS."""

    K: int
    N: int
    packed: Any
    mma: MmaW4
    bf16: torch.Tensor


class Run:
    """What one run shares: where rows go, the modules, the device and its SM count, the kernel (Gluon's on the GPU,
    `EmulatedKernel` in the CPU check's dry run), the timer, the shapes and Ms, the summary and the budget."""

    def __init__(self, out: Out, device: torch.device, sms: int, kernel_fn: Any, shapes: tuple[tuple[int, int], ...],
                 rows: tuple[int, ...], budget_s: float) -> None:  # fmt: skip
        self.out, self.device, self.sms, self.kernel_fn = out, device, sms, kernel_fn
        self.shapes, self.rows, self.budget_s = shapes, rows, budget_s
        self.bench = load_path("gpu_w4a16_bench", HERE.parent / "gpu_w4a16.py")
        self.mod = kernel_module()
        self.model = load_path("w4a16_gluon_model", HERE / "model.py")
        # the graph timer on the GPU; off it, gpu_w4a16's wall-clock stand-in (one eager call)
        self.timer = self.bench.graph_timer if device.type == "cuda" else self.bench.wall_timer
        self.summary: dict[str, Any] = {"kind": "summary", "checks": [], "points": [], "repack": [], "copy": {},
                                        "stopped": None}  # fmt: skip
        self.start = time.monotonic()

    def over(self) -> bool:
        """True once the budget is spent (then no new check or timing starts)."""
        if time.monotonic() - self.start > self.budget_s:
            self.summary["stopped"] = self.summary["stopped"] or f"time budget spent ({self.budget_s:.0f} s)"
            return True
        return False

    def free(self) -> None:
        sync(self.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def gpu_run(
    out_dir: Path,
    budget_s: float,
    device: torch.device | None = None,
    kernel_fn: Any = None,
    shapes: tuple[tuple[int, int], ...] = SHAPES,
    rows: tuple[int, ...] = ROWS,
    quiet: bool = False,
) -> int:
    """The GPU run (module docstring). Returns 0 if every check passed and something was timed, 1 if not, 3 after a
    CUDA error. `device`, `kernel_fn`, `shapes`, `rows` are for the CPU check's dry run of this same code."""
    import triton

    device = device or torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name, sms = props.name, props.multi_processor_count
    else:
        name, sms = f"{device} (dry run: kernel emulated)", SMS_CPU
    kernel_fn = kernel_fn if kernel_fn is not None else gluon_module().w4a16_swap_kernel
    run = Run(Out(out_dir, quiet), device, sms, kernel_fn, shapes, rows, budget_s)
    meta = {"kind": "meta", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "device": name,
            "sms": sms, "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "budget_s": budget_s, "rounds": ROUNDS,
            "timer": getattr(run.timer, "__name__", str(run.timer)), "min_calls": run.bench.MIN_CALLS,
            "rotate_bytes": run.bench.ROTATE_BYTES,
            "split_sum": "torch.sum over splits + copy_ to bf16 (not a fused kernel), inside every timing",
            "gbps_bytes": "int4 words + bf16 scales + uint8 zeros",
            "variants": {k: [v[0]._asdict(), v[1]] for k, v in variants().items()}}  # fmt: skip
    run.out.row(meta)
    run.out.log(json.dumps(meta))
    summary = run.summary

    def write_summary() -> None:
        summary["elapsed_s"] = time.monotonic() - run.start
        run.out.row(summary)
        text = json.dumps({"meta": meta, "summary": summary}, indent=1, default=str)
        (out_dir / "gluon_check.json").write_text(text)

    try:
        data, passed = check_all(run)
        time_all(run, data, passed)
    except Fatal as exc:
        summary["stopped"] = f"CUDA error: {exc}"
        run.out.log(f"stopped: CUDA error: {exc}")
        write_summary()
        return 3
    except Exception as exc:  # outside a check or timing (weights, repack, copies): the summary still gets written
        fatal = cuda_fatal(exc, device)
        summary["stopped"] = f"{'CUDA error' if fatal else 'exception'}: {error_text(exc)}"
        summary["trace"] = traceback.format_exc()[-3000:]
        run.out.log(f"stopped: {summary['stopped']}")
        write_summary()
        return 3 if fatal else 1
    write_summary()
    for point in summary["points"]:
        run.out.log(point["line"])
    all_ok = all(c["ok"] for c in summary["checks"]) and all(r["bit_equal_model"] for r in summary["repack"])
    return 0 if all_ok and summary["points"] else 1


def check_all(run: Run) -> tuple[list[ShapeData], set[tuple[int, int, int, str]]]:
    """Steps 1 and 2 of the module docstring; returns each shape's weights and the (K, N, M, label) that passed."""
    mod, device, out, summary = run.mod, run.device, run.out, run.summary
    data: list[ShapeData] = []
    passed: set[tuple[int, int, int, str]] = set()
    for K, N in run.shapes:
        if run.over():
            break
        gen = torch.Generator().manual_seed(K + N)
        weight = (torch.randn(N, K, generator=gen) / K**0.5).to(device, torch.bfloat16)
        packed = mod.quantize_w4(weight, GROUP)
        mma = to_mma(packed)
        same = bool(np.array_equal(mma.qw.cpu().numpy(), run.model.repack_mma(packed.qweight.cpu().numpy(), K)))
        repack = {"kind": "repack", "K": K, "N": N, "bit_equal_model": same}
        summary["repack"].append(repack)
        out.row(repack)
        w_bf16 = mod.dequantize_w4(packed.qweight, packed.scales, packed.zeros, GROUP, K).t().contiguous()  # (N, K)
        w64 = mod.dequantize_w4(packed.qweight, packed.scales.double(), packed.zeros, GROUP, K)  # (K, N) float64
        data.append(ShapeData(K, N, packed, mma, w_bf16))
        del weight
        for M in run.rows:
            if run.over():
                break
            x = torch.randn(M, K, generator=gen).to(device, torch.bfloat16)
            exact = mod.w4a16_reference(x.double(), packed.qweight, packed.scales.double(), packed.zeros, GROUP)
            sum_abs = x.double().abs() @ w64.abs()
            for label, fn, plan in point_runs(run, x, packed, mma, w_bf16):
                if run.over():
                    break
                row = {"kind": "check", "K": K, "N": N, "M": M, "variant": label, **plan}
                t0 = time.monotonic()
                try:
                    target = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=device)
                    got = fn(target)
                    sync(device)
                    row.update(compare(got, exact, K, sum_abs), same_buffer=got.data_ptr() == target.data_ptr())
                    again = fn(torch.full_like(target, float("nan")))
                    row["bit_equal_twice"] = bool(torch.equal(again, got))
                    row["ok"] = row["ok"] and row["same_buffer"]
                except Exception as exc:  # a failure is a row; a CUDA error ends the run after it
                    row.update(ok=False, error=error_text(exc), trace=traceback.format_exc()[-3000:])
                    fatal = cuda_fatal(exc, device)
                    if fatal:
                        row["fatal"] = fatal
                        out.row(row)
                        summary["checks"].append(_brief(row))
                        raise Fatal(fatal) from exc
                row["s"] = time.monotonic() - t0  # the first check of a specialisation includes its compile
                out.row(row)
                summary["checks"].append(_brief(row))
                what = (
                    row.get("error")
                    or f"{row['max_err_over_allowed']:.3f} of allowed, ulp {row['max_err_over_ulp']:.2f}"
                )
                out.log(f"check {K:>5}->{N:<5} M {M:>2} {label:14} {'ok' if row['ok'] else 'FAIL'} {what:.100}")
                if row["ok"]:
                    passed.add((K, N, M, label))
        del w64
        run.free()
    return data, passed


def point_runs(run: Run, x: torch.Tensor, packed: Any, mma: MmaW4, w_bf16: torch.Tensor) -> list[CheckRun]:
    """[(label, run into a given bf16 output, the plan's fields for the row)] of one (shape, M) for the checks: the
    shipped `w4a16_gemm`, bf16 cuBLAS (F.linear on the dequantised weight, copied into the output) and every Gluon
    variant, whose workspace is refilled with NaN before each launch."""
    M, K = x.shape
    N = mma.qw.shape[1]
    runs: list[CheckRun] = [
        ("shipped", lambda o: run.mod.w4a16_gemm(x, *packed, out=o), {}),
        ("bf16", lambda o: o.copy_(F.linear(x, w_bf16)), {}),
    ]
    for label, (kernel, fill) in variants().items():
        try:
            plan = plan_for(M, N, K, kernel, fill, run.sms)
        except ValueError as exc:  # a shape the kernel does not take: its check row says so

            def refuse(o: torch.Tensor, exc: ValueError = exc) -> torch.Tensor:
                raise exc

            runs.append((label, refuse, {}))
            continue
        call = SwapCall(run.kernel_fn, kernel, plan, M, N, K, run.device)
        fields = {"grid": plan.grid, "splits": plan.splits, "blocks_per_split": plan.blocks_per_split,
                  "programs": plan.programs, "programs_per_sm": plan.programs / run.sms, "MT": plan.MT,
                  "blocks_per_split_constexpr": plan.blocks_per_split == 1}  # fmt: skip

        def launch(o: torch.Tensor, call: SwapCall = call) -> torch.Tensor:
            call.ws.fill_(float("nan"))
            return call(x, mma, o)

        runs.append((label, launch, fields))
    return runs


def _brief(row: dict[str, Any]) -> dict[str, Any]:
    keys = ("K", "N", "M", "variant", "ok", "max_err_over_allowed", "max_err_over_ulp", "bad", "nan",
            "bit_equal_twice", "error", "fatal")  # fmt: skip
    return {k: row[k] for k in keys if k in row}


def time_all(run: Run, data: list[ShapeData], passed: set[tuple[int, int, int, str]]) -> None:
    """Step 3 of the module docstring, per shape (its weight copies made once) and M."""
    bench, device, out, summary = run.bench, run.device, run.out, run.summary
    if run.over():
        return
    size = 1 << 30 if device.type == "cuda" else 1 << 20
    roof, how = bench.copy_gbps(size, device, run.timer)
    summary["copy"]["roof"] = {"bytes": size, "gbps": roof}
    out.row({"kind": "copy", "bytes": size, "gbps": roof, **how})
    run.free()
    for shape in data:
        if run.over():
            break
        K, N = shape.K, shape.N
        wbytes = bench.nbytes(*shape.mma)
        at_size, how = bench.copy_gbps(wbytes, device, run.timer)
        summary["copy"][f"{K}x{N}"] = {"bytes": wbytes, "gbps": at_size}
        out.row({"kind": "copy", "K": K, "N": N, "bytes": wbytes, "gbps": at_size, **how})
        sets = {
            "mma": bench.rotated(shape.mma, bench.copies_for(wbytes, device)),
            "packed": bench.rotated(shape.packed, bench.copies_for(bench.set_bytes(shape.packed), device)),
            "bf16": bench.rotated((shape.bf16,), bench.copies_for(bench.nbytes(shape.bf16), device)),
        }
        gen = torch.Generator().manual_seed(K * N)
        for M in run.rows:
            if run.over():
                break
            labels = [lb for lb in ("bf16", "shipped", *variants()) if (K, N, M, lb) in passed]
            if not labels:
                continue
            x = torch.randn(M, K, generator=gen).to(device, torch.bfloat16)
            timers = {}
            for label in labels:
                if run.over():
                    break
                try:
                    timers[label] = run.timer(timed_calls(run, label, x, N, sets))
                except Exception as exc:  # graph_timer falls back to do_bench itself; what still fails is a row
                    out.row({"kind": "time", "K": K, "N": N, "M": M, "variant": label, "error": error_text(exc)})
                    fatal = cuda_fatal(exc, device)
                    if fatal:
                        raise Fatal(fatal) from exc
            medians = bench.time_rounds(out, {"K": K, "N": N, "M": M}, timers, ROUNDS, run.over)
            timing = {label: info for label, (_, info) in timers.items()}
            del timers
            fatal = sticky_error(device)
            if fatal:
                raise Fatal(fatal)
            point = summarise(K, N, M, medians, wbytes, at_size, roof)
            point["timing"] = timing
            summary["points"].append(point)
            out.row({"kind": "point", **point})
            out.log(point["line"])
        del sets
        run.free()


def timed_calls(run: Run, label: str, x: torch.Tensor, N: int, sets: dict[str, list[tuple]]) -> list[Callable[[], Any]]:
    """One call per weight copy for the timer, each into its own preallocated output (F.linear has no out); the
    Gluon variants share one workspace and fp32 sum (consecutive calls on one stream)."""
    M, K = x.shape
    dev = run.device
    if label == "bf16":
        return [lambda w=w: F.linear(x, w[0]) for w in sets["bf16"]]
    copies = sets["packed"] if label == "shipped" else sets["mma"]
    outs = [torch.empty(M, N, dtype=torch.bfloat16, device=dev) for _ in copies]
    if label == "shipped":
        return [lambda w=w, o=o: run.mod.w4a16_gemm(x, *w, out=o) for w, o in zip(copies, outs)]
    kernel, fill = variants()[label]
    call = SwapCall(run.kernel_fn, kernel, plan_for(M, N, K, kernel, fill, run.sms), M, N, K, dev)
    return [lambda w=w, o=o: call(x, w, o) for w, o in zip(copies, outs)]


def summarise(K: int, N: int, M: int, medians: dict[str, float], wbytes: int, at_size: float,
              roof: float) -> dict[str, Any]:  # fmt: skip
    """One (shape, M): per label µs, GB/s of the weight bytes, × bf16, × shipped, share of the copy roofs."""
    bf16, shipped = medians.get("bf16"), medians.get("shipped")
    rows = {}
    for label, us in medians.items():
        gbps = wbytes / us / 1e3
        rows[label] = {"us": us, "gbps": gbps, "x_bf16": bf16 / us if bf16 else None,
                       "x_shipped": shipped / us if shipped else None, "copy_share_at_size": gbps / at_size,
                       "copy_share_1gib": gbps / roof}  # fmt: skip
    gluon = {k: v for k, v in medians.items() if k not in ("bf16", "shipped")}
    best = min(gluon, key=gluon.get) if gluon else None
    b = rows.get(best, {}) if best else {}

    def f(v: float | None, spec: str = ".2f") -> str:
        return "—" if v is None else format(v, spec)

    line = (f"{K:>5} -> {N:<5} M {M:>2}: best {best} {f(b.get('us'))} µs ({f(b.get('x_bf16'))}× bf16, "
            f"{f(b.get('x_shipped'))}× shipped, {f(b.get('gbps'), '.0f')} GB/s) | shipped {f(shipped)} µs | "
            f"bf16 {f(bf16)} µs")  # fmt: skip
    return {"K": K, "N": N, "M": M, "weight_bytes": wbytes, "rows": rows, "best": best, "line": line}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Check the Gluon W4A16 kernels against float64, then time them against bf16 cuBLAS and the "
        "shipped w4a16_gemm (one GPU). --cpu-check runs what needs no GPU.",
    )
    parser.add_argument("out", type=Path, nargs="?", help="folder for gluon_check.jsonl / gluon_check.json")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help=f"seconds (default {BUDGET_S:.0f})")
    parser.add_argument("--cpu-check", action="store_true", help="repack, plans and host side on the CPU; no GPU")
    args = parser.parse_args(argv)
    if args.cpu_check:
        return cpu_check(args.out)
    if args.out is None:
        parser.error("OUT_DIR is required for the GPU run")
    if not torch.cuda.is_available():
        print("no CUDA device (use --cpu-check for the CPU part)", file=sys.stderr)
        return 2
    return gpu_run(args.out, args.budget)


if __name__ == "__main__":
    sys.exit(main())
