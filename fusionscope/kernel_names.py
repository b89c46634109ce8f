"""Short kernel names for tables and charts, as Nsight Systems and Perfetto show them: the full name stays in the
CSV and JSON files (and in the report's tooltips).

`void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul> >(int,
at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>)` becomes `vectorized_elementwise_kernel<add>`: the
return type, the namespaces and the argument list are dropped, and of the template arguments only the functor that
says what the kernel computes is kept, as a short lower-case word:

- `CUDAFunctor_add`, `CUDAFunctorOnSelf_add` → `add`; `MulFunctor` (inside `BinaryFunctor`, `AUnaryFunctor`…) →
  `mul`; `AbsFunctor` → `abs`; `AdamFunctor` → `adam`; `std::plus` → `add`;
- a reduction's op: `MeanOps` → `mean`, `ArgMaxOps` → `argmax`, `sum_functor` → `sum`;
- the function a lambda kernel was written in: `cos_kernel_cuda(…)::{lambda()#2}` → `cos`, `silu_kernel` → `silu`,
  `launch_clamp_scalar` → `clamp_scalar`, `direct_copy_kernel_cuda` → `direct_copy`.

Kernels named after a generic template (`cutlass::Kernel<cutlass_80_tensorop_…>`) take their first template
argument's name. Names that are no C++ signature stay as they are (`Memcpy HtoD (Host -> Device)`, `nvjet_…`,
Triton's, and the aten ops a CPU run lists as its kernels: `aten::mm`); NCCL's lose their argument list. A name this
cannot read is returned whole: it never raises.
"""

from __future__ import annotations

import re
from functools import lru_cache

ANONYMOUS = "(anonymous namespace)::"
NOT_SIGNATURES = ("Memcpy", "Memset")  # the runtime's copies and memsets: "Memcpy HtoD (Host -> Device)"
GENERIC_KERNELS = ("Kernel", "Kernel2", "device_kernel")  # cutlass's wrappers: the first template argument names it
# functor wrappers whose own name says nothing: the op is inside them
WRAPPERS = {"binary", "aunary", "bunary", "unary", "binaryoplistalpha", "binaryoplist", "binaryopscalar",
            "binaryopscalarlist", "unaryop", "pointwiseopscalar", "pointwiseoplist", "ternaryop", "opaque"}  # fmt: skip
# functions whose name says nothing (the kernel templates themselves, C++ syntax)
GENERIC_FUNCTIONS = {"gpu_kernel_impl", "gpu_kernel_impl_nocast", "gpu_kernel", "gpu_kernel_with_scalars",
                     "operator", "decltype", "lambda", "sizeof", "alignof", "opmath_gpu_kernel_with_scalars",
                     "opmath_symmetric_gpu_kernel_with_scalars", "gpu_reduce_kernel"}  # fmt: skip
STD_FUNCTORS = {"plus": "add", "minus": "sub", "multiplies": "mul", "divides": "div", "maximum": "max",
                "minimum": "min", "logical_and": "logical_and", "logical_or": "logical_or"}  # fmt: skip
_TEMPLATE = r"(?:<[^<>()]*(?:<[^<>()]*(?:<[^<>()]*>[^<>()]*)*>[^<>()]*)*>)?"  # up to three levels of <…>
_HINT = re.compile(
    r"(?<!\w)(?:"
    r"CUDAFunctor(?:OnSelf|OnOther)?_(?P<cuda>\w+?)<"  # CUDAFunctor_add<float>
    r"|std::(?P<std>plus|minus|multiplies|divides|maximum|minimum|logical_and|logical_or)\b"
    r"|(?P<ops>\w+)Ops<"  # MeanOps<…>, ArgMaxOps<…>
    r"|(?P<sfun>[a-z]\w*?)_functor<"  # sum_functor<…>
    r"|(?P<functor>\w+?)Functor\b"  # MulFunctor, AbsFunctor; BinaryFunctor is a wrapper
    r"|(?P<function>\w+)(?=" + _TEMPLATE + r"\())"  # cos_kernel_cuda(at::TensorIteratorBase&); the word alone
)
_SUFFIXES = re.compile(r"(?:_cuda_kernel|_kernel_cuda|_kernel_impl|_cuda_out|_out|_kernel|_impl|_cuda)+$")


@lru_cache(maxsize=4096)
def short_kernel_name(full: object) -> str:
    """The short name of a kernel (module docstring); the name itself when it cannot be read."""
    text = "" if full is None else str(full)
    try:
        return _short(text) or text
    except (ValueError, IndexError):  # unbalanced brackets in a cut name: keep it whole
        return text


def _short(text: str) -> str:
    name = text.strip()
    if name.startswith(NOT_SIGNATURES) or ("(" not in name and "<" not in name):
        return name  # a copy, a plain symbol (nvjet_…, triton_…) or an op of a CPU run (`aten::mm`): as it is
    name = name.replace(ANONYMOUS, "")
    head = name[: _argument_list(name)].strip()
    head = _split_top(head, " ")[-1]  # the return type (`void`) and qualifiers before the name
    open_at = _find_top(head, "<")
    base, template = (head, "") if open_at < 0 else (head[:open_at], head[open_at + 1 : _closing(head, open_at)])
    base = base.rsplit("::", 1)[-1]
    arguments = _split_top(template, ",") if template else []
    if base in GENERIC_KERNELS and arguments:
        first = re.sub(r"<.*", "", arguments[0].strip()).rsplit("::", 1)[-1]
        return first or base
    hint = _hint(template)
    return f"{base}<{hint}>" if hint else base


def _hint(template: str) -> str | None:
    """The first word in the template arguments that says what the kernel computes, or None."""
    for m in _HINT.finditer(template):
        kind = m.lastgroup
        word = m.group(kind)
        if kind == "std":
            return STD_FUNCTORS[word]
        if kind in ("cuda", "sfun"):
            return word.lower()
        if kind in ("ops", "functor"):
            word = word.rsplit("::", 1)[-1].lower()
            if word not in WRAPPERS:
                return word
            continue
        if word in GENERIC_FUNCTIONS or word.startswith(("gpu_kernel", "launch_kernel", "lambda")):
            continue
        word = _SUFFIXES.sub("", word.removeprefix("launch_"))
        if word and not word[0].isdigit():
            return word
    return None


def _argument_list(name: str) -> int:
    """Where the top-level argument list starts (the first `(` outside `<…>` after the name), else len(name)."""
    depth = 0
    for i, ch in enumerate(name):
        if ch == "<":
            depth += 1
        elif ch == ">" and depth and name[i - 1] != "-":
            depth -= 1
        elif ch == "(" and depth == 0 and i > 0:
            return i
    return len(name)


def _closing(text: str, open_at: int) -> int:
    """The index of the `>` closing the `<` at `open_at` (parentheses inside skipped)."""
    depth = 0
    for i in range(open_at, len(text)):
        ch = text[i]
        if ch in "<(":
            depth += 1
        elif ch in ">)" and not (ch == ">" and text[i - 1] == "-"):
            depth -= 1
            if depth == 0:
                return i
    raise ValueError("unbalanced template brackets")


def _find_top(text: str, target: str) -> int:
    """The first `target` outside parentheses, or -1."""
    depth = 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == target and depth == 0:
            return i
    return -1


def _split_top(text: str, sep: str) -> list[str]:
    """`text` split at each `sep` outside `<…>` and `(…)`."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "<(":
            depth += 1
        elif ch in ">)" and depth and not (ch == ">" and i and text[i - 1] == "-"):
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in (p.strip() for p in parts) if p] or [text]
