"""Vendor datasheet roofs for the GPUs a trace can name, for `analyze` when no measured roofs of that GPU are cached.

A trace captured elsewhere names its GPU (Kineto's `deviceProperties[].name`, the string
`torch.cuda.get_device_name()` returns) but carries no measured roofs. The sheet's peaks are what the vendor
promises, not what a kernel reaches (H200: a device-to-device copy measures 4250–4273 of the 4800 GB/s on the sheet,
a bf16 GEMM 700–716 of 989 TFLOP/s), so kernels classified against them read as further from the roof than they
would against measured roofs; every entry says `source: "datasheet"` and the run's summary says so.

Figures are dense (the sheets' "with sparsity" numbers halved away), `gbps` is peak memory bandwidth in GB/s and
`tflops` is TFLOP/s by dtype: bf16 and fp16 on the tensor (matrix) cores, tf32 on the tensor cores, fp32 without
them (on MI300X the sheet's FP32 vector and matrix peaks are equal).
"""

from __future__ import annotations

import re


def _entry(gbps: float, bf16: float, fp16: float, tf32: float, fp32: float, sheet: str) -> dict:
    return {"gbps": gbps, "tflops": {"bfloat16": bf16, "float16": fp16, "tf32": tf32, "float32": fp32},
            "source": "datasheet", "sheet": sheet}  # fmt: skip


_H100_SXM = _entry(3350.0, 989.0, 989.0, 494.0, 67.0, "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM")
_H100_PCIE = _entry(2000.0, 756.0, 756.0, 378.0, 51.0, "NVIDIA H100 Tensor Core GPU datasheet, H100 PCIe")
_H200 = _entry(4800.0, 989.0, 989.0, 494.0, 67.0, "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM")
_A100_40 = _entry(1555.0, 312.0, 312.0, 156.0, 19.5, "NVIDIA A100 Tensor Core GPU datasheet, A100 40GB")
_A100_80_SXM = _entry(2039.0, 312.0, 312.0, 156.0, 19.5, "NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM")
_A100_80_PCIE = _entry(1935.0, 312.0, 312.0, 156.0, 19.5, "NVIDIA A100 Tensor Core GPU datasheet, A100 80GB PCIe")
_L40S = _entry(864.0, 362.05, 362.05, 183.0, 91.6, "NVIDIA L40S datasheet")
_MI300X = _entry(5300.0, 1307.4, 1307.4, 653.7, 163.4, "AMD Instinct MI300X accelerator datasheet")

# Device names as the CUDA / ROCm runtime reports them, lower-cased with runs of spaces, '-' and '_' as one space.
DATASHEETS: dict[str, dict] = {
    "nvidia h100 80gb hbm3": _H100_SXM,
    "nvidia h100 sxm5 80gb": _H100_SXM,
    "nvidia h100": _H100_SXM,
    "nvidia h100 pcie": _H100_PCIE,
    "nvidia h200": _H200,
    "nvidia a100 sxm4 40gb": _A100_40,
    "nvidia a100 pcie 40gb": _A100_40,
    "nvidia a100 sxm4 80gb": _A100_80_SXM,
    "nvidia a100 80gb pcie": _A100_80_PCIE,
    "nvidia l40s": _L40S,
    "amd instinct mi300x": _MI300X,
}


def normalize(name: str) -> str:
    """`NVIDIA A100-SXM4-80GB` → `nvidia a100 sxm4 80gb`: one spelling for the runtime's and a user's names."""
    return re.sub(r"[\s_-]+", " ", name.strip().lower())


def lookup(name: str | None) -> dict | None:
    """The datasheet entry for a device name, or None. Names match whole (after `normalize`), never by prefix:
    an H200 NVL or an H100 NVL has other figures than the SXM part whose name it starts with."""
    if not name:
        return None
    entry = DATASHEETS.get(normalize(name))
    return {**entry, "tflops": dict(entry["tflops"])} if entry else None
