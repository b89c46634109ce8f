"""Compile the Gluon candidate and the shipped `_w4a16_gemv_kernel` for sm_90 with Triton 3.6 (no GPU), dump SASS and
count the main loop's instructions per weight.

Run: /tmp/t36/bin/python reports/w4a16/gluon/count.py   (from /work/main; a venv with the triton 3.6.0 wheel + numpy)
Writes reports/w4a16/gluon/counts.json and sass/<kernel>_<shape>_M<m>.sass.

Arguments are specialised as Triton's JIT specialises them at launch (`native_specialize_impl`: an int equal to 1
becomes a constexpr, an int divisible by 16 gets tt.divisibility 16; pointers are taken 16-byte aligned), so the
cubin is the one a launch with those values on an sm_90 GPU would build.

Main loop: the SASS basic blocks from the target of the kernel's one backward branch (the K loop) to that branch,
inclusive. Per weight = loop instructions / (weights one iteration of the loop handles per thread), i.e. per-thread
(per-warp issue slot) instructions per weight. Whole kernel per step weight: all instructions of the kernel / the
same weights (the measure the shipped docstring used).

Split-K as the shipped schedule picks it (`FILL`: 2 programs per SM at 132 SMs, at most 32 splits); for the Gluon
candidates with one block per step, a split of one block is raised to two (blocks_per_split = 1 would be specialised to
a constexpr and the loop compiled away). The Gluon kernels take group 128, K % 128 == 0 and N % BLOCK_N == 0.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import re
import subprocess
import sys
import types
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
sys.path.insert(0, HERE)

import triton  # noqa: E402
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend, GPUTarget  # noqa: E402
from triton.compiler.compiler import ASTSource  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
TARGET = GPUTarget("cuda", 90, 32)
SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]  # K -> N
SMS = 132  # H200 / H100 SXM


def load_shipped():
    """kernels/w4a16_gemm.py by path, with torch and fusionscope.kernels.dispatch stubbed (the 3.6 venv has no torch;
    the kernels use only triton). `Tunables` is stubbed to return its keywords, so TILES is the shipped dict."""
    rounding = importlib.util.spec_from_file_location(
        "fusionscope.kernels.rounding", os.path.join(ROOT, "kernels", "rounding.py")
    )
    rmod = importlib.util.module_from_spec(rounding)
    rounding.loader.exec_module(rmod)
    dispatch = types.ModuleType("fusionscope.kernels.dispatch")
    dispatch.Tunables = lambda **kw: dict(kw)
    for name in ("cdiv", "launchable", "pow2", "run", "sm_count"):
        setattr(dispatch, name, mock.MagicMock())
    torch = mock.MagicMock()
    stubs = {
        "torch": torch,
        "torch.nn": torch.nn,
        "torch.nn.functional": torch.nn.functional,
        "torch.library": torch.library,
        "fusionscope": types.ModuleType("fusionscope"),
        "fusionscope.kernels": types.ModuleType("fusionscope.kernels"),
        "fusionscope.kernels.dispatch": dispatch,
        "fusionscope.kernels.rounding": rmod,
    }
    with mock.patch.dict(sys.modules, stubs):
        spec = importlib.util.spec_from_file_location(
            "w4a16_gemm_shipped", os.path.join(ROOT, "kernels", "w4a16_gemm.py")
        )
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    return mod


def specialise(params, values, types_):
    """signature, constexprs, attrs for `params` as the JIT specialises `values` (None: a constexpr given in
    `values` as is)."""
    sig, const, attrs = {}, {}, {}
    for i, p in enumerate(params):
        v = values.get(p)
        t = types_.get(p)
        if t == "constexpr":
            sig[p] = "constexpr"
            const[p] = v
        elif t.startswith("*"):
            sig[p] = t
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            kind, spec = native_specialize_impl(BaseBackend, v, False, True, True)
            if kind == "constexpr":
                sig[p] = "constexpr"
                const[p] = spec
            else:
                sig[p] = kind
                if spec == "D":
                    attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, const, attrs


def build(fn, params, values, types_, num_warps, gluon):
    sig, const, attrs = specialise(params, values, types_)
    src = (GluonASTSource if gluon else ASTSource)(fn, sig, constexprs=const, attrs=attrs)
    opts = {"num_warps": num_warps}
    if not gluon:
        opts["num_stages"] = values.get("num_stages", 1)
    return triton.compile(src, target=TARGET, options=opts)


INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
LABEL = re.compile(r"^(\.L_x_\d+):")
BRANCH = re.compile(r"BRA\s+`?\(?(\.L_x_\d+)\)?")


def parse_sass(text):
    """[(address, opcode, operands)], {label: address of the next instruction}."""
    insns, labels, pending = [], {}, []
    for line in text.splitlines():
        m = LABEL.match(line.strip())
        if m:
            pending.append(m.group(1))
            continue
        m = INSN.search(line)
        if m:
            addr = int(m.group(1), 16)
            for lab in pending:
                labels[lab] = addr
            pending = []
            insns.append((addr, m.group(3), m.group(4)))
    return insns, labels


def main_loop(insns, labels):
    """Instructions of the outermost backward-branch loop: [target, branch]."""
    loops = []
    for addr, op, rest in insns:
        if op.startswith("BRA"):
            m = BRANCH.search(op + rest)
            if m and labels.get(m.group(1), 1 << 60) <= addr:
                loops.append((labels[m.group(1)], addr))
    if not loops:
        return [], None
    lo, hi = max(loops, key=lambda r: r[1] - r[0])
    return [i for i in insns if lo <= i[0] <= hi], (lo, hi, len(loops))


CLASSES = [
    ("HMMA", r"^HMMA"),
    ("FFMA", r"^FFMA"),
    ("FADD", r"^FADD"),
    ("FMUL", r"^FMUL"),
    ("HADD2/HFMA2/HMUL2", r"^H(ADD|FMA|MUL)2"),
    ("LOP3", r"^LOP3"),
    ("SHF/SHL/SHR", r"^(SHF|SHL|SHR|IMAD\.SHL)"),
    ("PRMT", r"^PRMT"),
    ("F2F/I2F/F2I/cvt", r"^(F2F|I2F|F2I|F2FP|I2FP)"),
    ("LDG", r"^LDG"),
    ("LDS", r"^LDS"),
    ("STS", r"^STS"),
    ("LDSM", r"^LDSM"),
    ("STG", r"^STG"),
    ("MOV", r"^(MOV|IMAD\.MOV|CS2R)"),
    (
        "int address/index",
        r"^(IADD3|IMAD|LEA|VIADD|ISETP|SEL|ISCADD|UIADD|UIMAD|ULEA|USHF|UMOV|ULDC|S2R|S2UR|P2R|R2P|PLOP3|SGXT|IABS|LDC)",
    ),
    ("branch/sync", r"^(BRA|BAR|BSYNC|BSSY|WARPSYNC|EXIT|DEPBAR|NOP)"),
]


def classify(ops):
    out = collections.Counter()
    for op in ops:
        for name, pat in CLASSES:
            if re.match(pat, op):
                out[name] += 1
                break
        else:
            out["other:" + op.split(".")[0]] += 1
    return out


def sass_of(cubin, tag):
    path = os.path.join(HERE, "sass", tag + ".cubin")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(cubin)
    text = subprocess.run(
        [os.path.join(BIN, "nvdisasm"), "-c", path], capture_output=True, text=True, check=True
    ).stdout
    res = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", path], capture_output=True, text=True).stdout
    os.remove(path)
    with open(os.path.join(HERE, "sass", tag + ".sass"), "w") as f:
        f.write(text)
    return text, res


def analyse(cc, tag, weights_per_iter_thread, weights_per_iter_cta):
    text, res = sass_of(cc.asm["cubin"], tag)
    insns, labels = parse_sass(text)
    loop, span = main_loop(insns, labels)
    ops_all = [op for _, op, _ in insns]
    ops_loop = [op for _, op, _ in loop]
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res)
    reg, stack, shared, local = (int(g) for g in m.groups())
    ptx = cc.asm["ptx"]
    cls = classify(ops_loop)
    # inline asm with pack=2 gets two elements per call; the unpacking is right only if they are the two halves (e = 0,
    # 1) of one word, i.e. both word operands (and both zero operands) of every call are the same LLVM value.
    calls = [line for line in cc.asm["llir"].splitlines() if "lop3.b32" in line and " asm " in line]
    pairs = [re.findall(r"\(i32 ([^,]+), i32 ([^,]+), i32 ([^,]+), i32 ([^)]+)\)", line) for line in calls]
    same = sum(1 for p in pairs if p and p[0][0] == p[0][1] and p[0][2] == p[0][3])
    return {
        "asm_unpack_calls": len(calls),
        "asm_calls_pairing_one_word": same,
        "registers": reg,
        "stack": stack,
        "local_bytes": local,
        "shared_static": shared,
        "shared_metadata": cc.metadata.shared,
        "spill_ld_st": len(re.findall(r"\b(LDL|STL)\b", text)),
        "loop_span": f"{span[0]:#x}-{span[1]:#x}" if span else None,
        "backward_branches": span[2] if span else 0,
        "loop_insns": len(ops_loop),
        "kernel_insns": len(ops_all),
        "weights_per_iter_thread": weights_per_iter_thread,
        "weights_per_iter_cta": weights_per_iter_cta,
        "loop_per_weight": len(ops_loop) / weights_per_iter_thread,
        "kernel_per_step_weight": len(ops_all) / weights_per_iter_thread,
        "loop_classes": dict(sorted(cls.items(), key=lambda kv: -kv[1])),
        "sts_lds_in_loop": cls.get("STS", 0) + cls.get("LDS", 0) + cls.get("LDSM", 0),
        "sts_lds_in_kernel": sum(1 for o in ops_all if re.match(r"^(STS|LDS|LDSM)", o)),
        "bar_in_loop": sum(1 for o in ops_loop if o.startswith("BAR")),
        "ldg_loop": [o for o in ops_loop if o.startswith("LDG")],
        "ptx_ld_global": collections.Counter(re.findall(r"ld\.global[.a-z0-9]*", ptx)),
    }


def splits_for(programs, steps, fill=2, max_split=32):
    split = 1
    while programs * split < fill * SMS and split * 2 <= min(steps, max_split):
        split *= 2
    per = -(-steps // min(split, steps))
    return -(-steps // per), per


def shipped_case(mod, K, N, M):
    t = mod.TILES["gemv"][1]
    BN, BK, W = t["BLOCK_N"], t["BLOCK_K"], t["num_warps"]
    sub = BK // 128
    blocks = -(-K // 128)
    steps = -(-blocks // sub)
    splits, per = splits_for(-(-N // BN) * M, steps)
    params = list(mod._w4a16_gemv_kernel.arg_names)
    values = dict(
        M=M,
        N=N,
        K=K,
        stride_xm=K,
        stride_xk=1,
        stride_qk=N,
        stride_qn=1,
        stride_sg=N,
        stride_sn=1,
        stride_zg=N,
        stride_zn=1,
        stride_b=0,
        stride_os=M * N,
        stride_om=N,
        stride_on=1,
        blocks_per_split=per * sub,
        GROUP=128,
        PLANES=8,
        HAS_BIAS=False,
        PARTIAL=splits > 1,
        UPCAST=False,
        BLOCK_M=1,
        BLOCK_N=BN,
        SUBBLOCKS=sub,
        PREFETCH=bool(t.get("PREFETCH", False)),
        num_stages=t["num_stages"],
    )
    types_ = {
        p: "constexpr"
        for p in ("GROUP", "PLANES", "HAS_BIAS", "PARTIAL", "UPCAST", "BLOCK_M", "BLOCK_N", "SUBBLOCKS", "PREFETCH")
    }
    types_.update(x_ptr="*bf16", qw_ptr="*i32", s_ptr="*bf16", z_ptr="*u8", b_ptr="*bf16", out_ptr="*fp32")
    for p in params:
        types_.setdefault(p, "i32")
    cc = build(mod._w4a16_gemv_kernel, params, values, types_, W, gluon=False)
    wpi_cta = BK * BN  # one loop step: SUBBLOCKS slabs of 128 × BLOCK_N
    meta = dict(
        kernel="shipped _w4a16_gemv_kernel (Triton)",
        tiles=f"BN{BN} BK{BK} W{W} st{t['num_stages']}",
        splits=splits,
        grid=[-(-N // BN), splits, M],
    )
    return cc, wpi_cta // (32 * W), wpi_cta, meta


CANDIDATES = {
    # name: (kernel, BLOCK_N, SUB, num_warps, PREFETCH: 0 none, 1 one block ahead, 2 ping-pong over two blocks)
    "swap": ("w4a16_swap_kernel", 256, 1, 4, 0),
    "swap-pf": ("w4a16_swap_kernel", 256, 1, 4, 1),
    "swap-b2": ("w4a16_swap_kernel", 256, 2, 4, 0),
    "swap-pp": ("w4a16_swap_kernel", 256, 2, 4, 2),
    "v1-ntile": ("w4a16_mma_kernel", 128, 2, 4, 0),
}


def candidate_case(name, K, N, M):
    import w4a16_gluon as g

    kname, BN, SUB, W, PF = CANDIDATES[name]
    fn = getattr(g, kname)
    blocks = -(-K // 128)
    steps = -(-blocks // SUB)
    splits, per = splits_for(-(-N // BN), steps)
    if per * SUB == 1:  # blocks_per_split = 1 would be specialised to a constexpr and the loop compiled away
        per = 2
        splits = -(-steps // per)
    params = list(fn.arg_names)
    values = dict(M=M, N=N, K=K, blocks_per_split=per * SUB, BLOCK_N=BN, SUB=SUB)
    types_ = dict(
        x_ptr="*bf16",
        qw_ptr="*i32",
        s_ptr="*bf16",
        z_ptr="*u8",
        out_ptr="*fp32",
        BLOCK_N="constexpr",
        SUB="constexpr",
        M="i32",
        N="i32",
        K="i32",
        blocks_per_split="i32",
    )
    if kname == "w4a16_swap_kernel":
        values.update(MT=8 if M <= 8 else 16, PREFETCH=PF)
        types_.update(MT="constexpr", PREFETCH="constexpr")
    cc = build(fn, params, values, types_, W, gluon=True)
    wpi_cta = 128 * SUB * BN
    meta = dict(
        kernel=f"candidate {kname} (Gluon, mma.sync m16n8k16)",
        tiles=f"BN{BN} BK{128 * SUB} W{W}" + ({0: "", 1: " pf", 2: " pingpong"}[PF]),
        splits=splits,
        grid=[-(-N // BN), splits],
    )
    return cc, wpi_cta // (32 * W), wpi_cta, meta


def main():
    rows = []
    mod = load_shipped()
    cases = []
    for K, N in SHAPES:
        cases.append(("shipped", K, N, 1, lambda K=K, N=N: shipped_case(mod, K, N, 1)))
        for name in CANDIDATES:
            for M in (1, 16):
                cases.append((name, K, N, M, lambda name=name, K=K, N=N, M=M: candidate_case(name, K, N, M)))
    for name, K, N, M, make in cases:
        tag = f"{name}_{K}x{N}_M{M}"
        try:
            cc, wpt, wpc, meta = make()
            r = analyse(cc, tag, wpt, wpc)
            r.update(meta)
        except Exception as e:  # a compile failure is a row
            r = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
        r.update(name=name, K=K, N=N, M=M, tag=tag)
        rows.append(r)
    hdr = (
        f"{'kernel':10} {'K->N':>12} {'M':>3} {'tiles':>19} {'split':>5} {'regs':>4} {'spill':>5} {'smem':>5} "
        f"{'loop':>5} {'w/thr':>5} {'loop/w':>7} {'kern/w':>7} {'STS+LDS':>8}  main loop classes"
    )
    print(hdr)
    for r in rows:
        if "error" in r:
            print(f"{r['name']:10} {r['K']:>5}->{r['N']:<6} {r['M']:>3}  ERROR {r['error'][:300]}")
            continue
        top = ", ".join(f"{k} {v}" for k, v in list(r["loop_classes"].items())[:8])
        print(
            f"{r['name']:10} {r['K']:>5}->{r['N']:<6} {r['M']:>3} {r['tiles']:>19} {r['splits']:>5} "
            f"{r['registers']:>4} {r['spill_ld_st']:>5} {r['shared_metadata']:>5} {r['loop_insns']:>5} "
            f"{r['weights_per_iter_thread']:>5} {r['loop_per_weight']:>7.2f} {r['kernel_per_step_weight']:>7.2f} "
            f"{r['sts_lds_in_loop']:>8}  {top}"
        )
    with open(os.path.join(HERE, "counts.json"), "w") as f:
        json.dump({"triton": triton.__version__, "target": "cuda sm_90", "rows": rows}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
