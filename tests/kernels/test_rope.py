"""rope and rope_and_cache against Hugging Face's apply_rotary_pos_emb (within 1 ulp, in the dtype) and against the
float64 reference (at the dtype's tolerance); strided and transposed views, in-place, partial rotary, cache slots."""

from __future__ import annotations

import pytest
import torch
from fusionscope.kernels.rope import rope, rope_and_cache, rope_and_cache_reference, rope_reference
from fusionscope.kernels.tolerances import assert_close
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from tests.kernels.conftest import DTYPES, device, poisoned, randn

_MANTISSA = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}
_TINY = {torch.float32: 2.0**-149, torch.float16: 2.0**-24, torch.bfloat16: 2.0**-133}  # smallest subnormal
SENTINEL = -3.25  # exact in every dtype, far from anything rope writes by chance


def _ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of t's dtype at each value of t (its unit in the last place), as float64."""
    _, exp = torch.frexp(t.double().abs())
    ulp = torch.ldexp(torch.ones_like(exp, dtype=torch.float64), exp - 1 - _MANTISSA[t.dtype])
    return ulp.clamp(min=_TINY[t.dtype])


def assert_within_ulp(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    err = (actual.double() - expected.double()).abs()
    bad = ~(err <= _ulp(expected))  # NaN counts as bad
    assert not bad.any(), f"{int(bad.sum())} elements differ by more than 1 ulp, max error {err.max().item()}"


def _cos_sin(b: int, s: int, dr: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounded values with different halves (real cos/sin repeat their halves, which would hide an indexing bug)."""
    return randn(b, s, dr, dtype=torch.float32).tanh().to(dtype), randn(b, s, dr, dtype=torch.float32).tanh().to(dtype)


def _hf(q, k, cos, sin):
    """HF's apply_rotary_pos_emb, with Phi's split and cat when cos is narrower than the head dim."""
    dr = cos.shape[-1]
    q_rot, k_rot = apply_rotary_pos_emb(q[..., :dr], k[..., :dr], cos, sin)
    return torch.cat((q_rot, q[..., dr:]), -1), torch.cat((k_rot, k[..., dr:]), -1)


def _fp64_scale(*xs: torch.Tensor) -> float:
    """Eager (and the kernel) round each product to the dtype before the add, so when the two products nearly cancel
    the absolute error is about ulp(max |x|·|cos|), not ulp(result): widen the tolerance by the inputs' magnitude."""
    return max(1.0, *(x.abs().max().item() for x in xs))


def _heads_view(b: int, h: int, s: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, H, S, D) as HF makes it: `proj(x).view(B, S, H, D).transpose(1, 2)`, non-contiguous."""
    return randn(b, s, h * d, dtype=dtype).view(b, s, h, d).transpose(1, 2)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as a non-contiguous view (every other element of a twice-as-wide buffer)."""
    wide = torch.full((*t.shape[:-1], 2 * t.shape[-1]), float("nan"), dtype=t.dtype, device=t.device)
    wide[..., ::2] = t
    return wide[..., ::2]


SHAPES = [  # (B, Hq, Hk, S, D)
    pytest.param((1, 4, 2, 1, 64), id="decode-gqa"),
    pytest.param((2, 6, 2, 5, 128), id="prefill-gqa"),
    pytest.param((1, 3, 3, 7, 96), id="mha-d96"),
    pytest.param((1, 12, 10, 2, 128), id="several-head-blocks"),  # 8 heads a program at D = 128: 2 q and 2 k blocks
]


@pytest.mark.parametrize("shape", SHAPES)
def test_rope_matches_hf_and_fp64(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    b, hq, hk, s, d = shape
    q, k = _heads_view(b, hq, s, d, dtype), randn(b, hk, s, d, dtype=dtype)
    cos, sin = _cos_sin(b, s, d, dtype)
    q_out, k_out = rope(q, k, cos, sin)
    assert q_out.shape == q.shape and k_out.shape == k.shape and q_out.dtype == dtype
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)
    assert_within_ulp(q_out, q_hf)
    assert_within_ulp(k_out, k_hf)
    q64, k64 = rope_reference(q.double(), k.double(), cos.double(), sin.double())
    assert_close(q_out, q64, dtype, scale=_fp64_scale(q))
    assert_close(k_out, k64, dtype, scale=_fp64_scale(k))


def test_reference_is_hf() -> None:
    q, k = randn(2, 4, 3, 64, dtype=torch.bfloat16), randn(2, 2, 3, 64, dtype=torch.bfloat16)
    cos, sin = _cos_sin(2, 3, 64, torch.bfloat16)
    for mine, theirs in zip(rope_reference(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin), strict=True):
        assert torch.equal(mine, theirs)


def test_rope_with_llama_rotary_embedding() -> None:
    """cos/sin as the model makes them: (1, S, D) in the activations' dtype, shared by a batch of 2."""
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    b, s = 2, 3
    x = randn(b, s, 256, dtype=torch.bfloat16)
    cos, sin = LlamaRotaryEmbedding(config).to(device())(x, torch.arange(5, 5 + s, device=device())[None])
    assert cos.shape == (1, s, 64) and cos.dtype == torch.bfloat16
    q, k = _heads_view(b, 4, s, 64, torch.bfloat16), _heads_view(b, 2, s, 64, torch.bfloat16)
    for mine, theirs in zip(rope(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin), strict=True):
        assert_within_ulp(mine, theirs)


def test_rope_partial_rotary(dtype: torch.dtype) -> None:
    """Phi/GPT-NeoX: Dr = 32 of D = 80 rotated, the other 48 dims copied unchanged."""
    b, hq, hk, s, d, dr = 2, 3, 2, 3, 80, 32
    q, k = _heads_view(b, hq, s, d, dtype), randn(b, hk, s, d, dtype=dtype)
    cos, sin = _cos_sin(b, s, dr, dtype)
    q_out, k_out = rope(q, k, cos, sin)
    q_hf, k_hf = _hf(q, k, cos, sin)
    assert_within_ulp(q_out, q_hf)
    assert_within_ulp(k_out, k_hf)
    assert torch.equal(q_out[..., dr:], q[..., dr:]) and torch.equal(k_out[..., dr:], k[..., dr:])
    q64, k64 = rope_reference(q.double(), k.double(), cos.double(), sin.double())
    assert_close(q_out, q64, dtype, scale=_fp64_scale(q))
    assert_close(k_out, k64, dtype, scale=_fp64_scale(k))


@pytest.mark.parametrize("cos_layout", ["batch-1", "2d", "strided"])
def test_rope_strided_inputs_and_poisoned_out(cos_layout: str) -> None:
    """Every input non-contiguous (last-dim stride 2), cos/sin broadcast or strided, into NaN-poisoned outputs."""
    b, hq, hk, s, d, dtype = 2, 3, 2, 3, 64, torch.float16
    q, k = randn(b, hq, s, d, dtype=dtype, strided=True), randn(b, hk, s, d, dtype=dtype, strided=True)
    if cos_layout == "batch-1":
        cos, sin = _cos_sin(1, s, d, dtype)
    elif cos_layout == "2d":
        cos, sin = (t[0] for t in _cos_sin(1, s, d, dtype))
    else:
        cos, sin = (_strided(t) for t in _cos_sin(b, s, d, dtype))
        assert cos.stride(-1) == 2
    out = (poisoned(q.shape, dtype), poisoned(k.shape, dtype))
    result = rope(q, k, cos, sin, out=out)
    assert result[0] is out[0] and result[1] is out[1]
    hf_cos, hf_sin = (cos[None], sin[None]) if cos.dim() == 2 else (cos, sin)
    for mine, theirs in zip(result, apply_rotary_pos_emb(q, k, hf_cos, hf_sin), strict=True):
        assert_within_ulp(mine, theirs)


def test_rope_strided_out_buffers() -> None:
    """Outputs with their own layout: (B, S, H, D) memory, like the inputs HF hands over."""
    b, hq, hk, s, d, dtype = 1, 4, 2, 3, 64, torch.bfloat16
    q, k = _heads_view(b, hq, s, d, dtype), _heads_view(b, hk, s, d, dtype)
    cos, sin = _cos_sin(b, s, d, dtype)
    out = (
        poisoned((b, s, hq, d), dtype).transpose(1, 2),
        poisoned((b, s, hk, 2 * d), dtype)[..., ::2].transpose(1, 2),
    )
    result = rope(q, k, cos, sin, out=out)
    assert result[0] is out[0] and result[1] is out[1]
    for mine, theirs in zip(result, apply_rotary_pos_emb(q, k, cos, sin), strict=True):
        assert_within_ulp(mine, theirs)


@pytest.mark.parametrize("dr", [64, 32], ids=["full", "partial"])
def test_rope_in_place(dr: int) -> None:
    """out=(q, k) on HF's transposed views: every element loaded before any store, so in place equals out of place."""
    b, hq, hk, s, d, dtype = 2, 4, 2, 3, 64, torch.float32
    q, k = _heads_view(b, hq, s, d, dtype), _heads_view(b, hk, s, d, dtype)
    cos, sin = _cos_sin(b, s, dr, dtype)
    q_hf, k_hf = _hf(q, k, cos, sin)
    result = rope(q, k, cos, sin, out=(q, k))
    assert result[0] is q and result[1] is k
    assert_within_ulp(q, q_hf)
    assert_within_ulp(k, k_hf)


def test_rope_bad_inputs() -> None:
    dtype = torch.float32
    q, k = randn(1, 2, 3, 64, dtype=dtype), randn(1, 2, 3, 64, dtype=dtype)
    cos, sin = _cos_sin(1, 3, 64, dtype)
    with pytest.raises(ValueError, match="head dim"):
        rope(q, randn(1, 2, 3, 32, dtype=dtype), cos, sin)
    with pytest.raises(ValueError, match="must be even"):
        rope(q, k, cos[..., :31], sin[..., :31])
    with pytest.raises(ValueError, match="at most D"):
        rope(q, k, *_cos_sin(1, 3, 80, dtype))
    with pytest.raises(ValueError, match="S=3"):
        rope(q, k, cos[:, :2], sin[:, :2])
    with pytest.raises(ValueError, match="same shape"):
        rope(q, k, cos, sin[..., :32])
    with pytest.raises(ValueError, match="dtype"):
        rope(q, k, cos.half(), sin.half())
    with pytest.raises(ValueError, match=r"\(B, H, S, D\)"):
        rope(q[0], k[0], cos, sin)
    with pytest.raises(ValueError, match="out\\[1\\]"):
        rope(q, k, cos, sin, out=(torch.empty_like(q), torch.empty(1, 2, 3, 64, dtype=torch.float16)))


CACHE_CASES = [  # (B, Hq, Hk, S, D), S_max, positions, dtype
    pytest.param((1, 4, 2, 1, 64), 8, [5], torch.bfloat16, id="decode"),
    pytest.param((2, 6, 2, 5, 128), 8, [3, 4, 5, 6, 7], torch.float16, id="prefill-consecutive"),
    pytest.param((1, 3, 3, 7, 96), 16, [11, 0, 4, 2, 9, 15, 6], torch.float32, id="non-consecutive"),
    pytest.param((2, 12, 10, 2, 128), 8, [6, 1], torch.bfloat16, id="several-head-blocks"),
]


@pytest.mark.parametrize(("shape", "s_max", "positions", "dtype"), CACHE_CASES)
def test_rope_and_cache_writes_exactly_the_slots(
    shape: tuple[int, ...], s_max: int, positions: list[int], dtype: torch.dtype
) -> None:
    b, hq, hk, s, d = shape
    q, k, v = _heads_view(b, hq, s, d, dtype), _heads_view(b, hk, s, d, dtype), _heads_view(b, hk, s, d, dtype)
    cos, sin = _cos_sin(b, s, d, dtype)
    pos = torch.tensor(positions, dtype=torch.int64, device=device())
    k_cache = torch.full((b, hk, s_max, d), SENTINEL, dtype=dtype, device=device())
    v_cache = torch.full((b, hk, s_max, d), SENTINEL, dtype=dtype, device=device())
    out = poisoned(q.shape, dtype)
    result = rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, pos, out=out)
    assert result is out
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)
    assert_within_ulp(out, q_hf)
    assert_within_ulp(k_cache[:, :, pos], k_hf)
    assert torch.equal(v_cache[:, :, pos], v)
    untouched = torch.ones(s_max, dtype=torch.bool, device=device())
    untouched[pos] = False
    assert (k_cache[:, :, untouched] == SENTINEL).all() and (v_cache[:, :, untouched] == SENTINEL).all()
    k_ref, v_ref = (torch.full_like(k_cache, SENTINEL) for _ in range(2))
    q_ref = rope_and_cache_reference(q, k, v, cos, sin, k_ref, v_ref, pos)
    assert_within_ulp(out, q_ref)
    assert_within_ulp(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)


def test_rope_and_cache_strided_cache_partial_rotary_in_place() -> None:
    """Caches stored (B, S_max, Hk, D) and seen transposed, int32 positions, partial rotary, q rotated in place."""
    b, hq, hk, s, d, dr, s_max, dtype = 2, 4, 2, 3, 80, 32, 6, torch.bfloat16
    q, k = _heads_view(b, hq, s, d, dtype), _heads_view(b, hk, s, d, dtype)
    v = randn(b, hk, s, d, dtype=dtype, strided=True)
    cos, sin = _cos_sin(1, s, dr, dtype)
    pos = torch.tensor([4, 1, 3], dtype=torch.int32, device=device())
    k_store = torch.full((b, s_max, hk, d), SENTINEL, dtype=dtype, device=device())
    v_store = torch.full((b, s_max, hk, d), SENTINEL, dtype=dtype, device=device())
    k_cache, v_cache = k_store.transpose(1, 2), v_store.transpose(1, 2)
    q_hf, k_hf = _hf(q, k, cos, sin)
    result = rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, pos, out=q)
    assert result is q
    assert_within_ulp(q, q_hf)
    assert_within_ulp(k_cache[:, :, pos.long()], k_hf)
    assert torch.equal(v_cache[:, :, pos.long()], v)
    others = [0, 2, 5]
    assert (k_store[:, others] == SENTINEL).all() and (v_store[:, others] == SENTINEL).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(("s", "start"), [(1, 5), (3, 2)])
def test_rope_and_cache_from_a_start_slot(s: int, start: int, dtype: torch.dtype) -> None:
    """A 0-d `positions` is the first token's slot (a static cache's write counter): token i goes to start + i, as
    StaticLayer's `arange(S) + counter`; a decode step (S = 1) and a short prefill, odd head dim, GQA."""
    b, hq, hk, d, s_max = 2, 4, 2, 48, 9
    q, k, v = _heads_view(b, hq, s, d, dtype), _heads_view(b, hk, s, d, dtype), _heads_view(b, hk, s, d, dtype)
    cos, sin = _cos_sin(b, s, d, dtype)
    k_cache, v_cache = (torch.full((b, hk, s_max, d), SENTINEL, dtype=dtype, device=device()) for _ in range(2))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    out = poisoned(q.shape, dtype)
    start_slot = torch.tensor(start, device=device())
    rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, start_slot, out=out)
    slots = torch.arange(start, start + s, device=device())
    q_ref = rope_and_cache_reference(q, k, v, cos, sin, k_ref, v_ref, slots)
    assert_within_ulp(out, q_ref)
    assert_within_ulp(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)
    assert (k_cache[:, :, :start] == SENTINEL).all() and (k_cache[:, :, start + s :] == SENTINEL).all()
    assert int(start_slot) == start  # read, not advanced: the counter's own add_ stays the model's


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(("b", "hk", "s"), [(1, 2, 1), (2, 20, 3)], ids=["decode", "prefill-many-programs"])
def test_rope_and_cache_advances_its_counter(b: int, hk: int, s: int, dtype: torch.dtype) -> None:
    """`advance=True`: the kernel also adds S to the 0-d counter after every program has read it (the tickets in its
    high bits), so two steps in a row write consecutive slots and leave the counter where StaticLayer's `add_` would;
    with 20 kv heads, several head blocks per token (many programs draw tickets)."""
    hq, d, s_max, start = 2 * hk, 40, 11, 3
    cos, sin = _cos_sin(b, s, d, dtype)
    k_cache, v_cache = (torch.full((b, hk, s_max, d), SENTINEL, dtype=dtype, device=device()) for _ in range(2))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    counter, counter_ref = torch.tensor(start, device=device()), torch.tensor(start, device=device())
    for step in range(2):
        q, k, v = _heads_view(b, hq, s, d, dtype), _heads_view(b, hk, s, d, dtype), _heads_view(b, hk, s, d, dtype)
        out = poisoned(q.shape, dtype)
        rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, counter, out=out, advance=True)
        q_ref = rope_and_cache_reference(q, k, v, cos, sin, k_ref, v_ref, counter_ref, advance=True)
        assert int(counter) == int(counter_ref) == start + (step + 1) * s
        assert_within_ulp(out, q_ref)
        assert_within_ulp(k_cache, k_ref)
        assert torch.equal(v_cache, v_ref)
    assert (k_cache[:, :, :start] == SENTINEL).all() and (k_cache[:, :, start + 2 * s :] == SENTINEL).all()


def test_rope_and_cache_advance_needs_a_0d_int64_counter() -> None:
    dtype = torch.float32
    q, k, v = randn(1, 2, 1, 64, dtype=dtype), randn(1, 2, 1, 64, dtype=dtype), randn(1, 2, 1, 64, dtype=dtype)
    cos, sin = _cos_sin(1, 1, 64, dtype)
    kc, vc = torch.zeros(1, 2, 4, 64, device=device()), torch.zeros(1, 2, 4, 64, device=device())
    for positions in (torch.tensor([1], device=device()), torch.tensor(1, dtype=torch.int32, device=device())):
        with pytest.raises(ValueError, match="advance needs a 0-d int64 counter"):
            rope_and_cache(q, k, v, cos, sin, kc, vc, positions, advance=True)


def test_rope_and_cache_kernel_skips_out_of_range_slots() -> None:
    """On the GPU positions are not checked on the host (it would cost a sync): the kernel writes no slot outside
    [0, S_max) and still writes the valid ones. Called through the op to bypass the host check."""
    b, hq, hk, s, d, s_max, dtype = 1, 2, 2, 3, 64, 4, torch.float32
    q, k, v = randn(b, hq, s, d, dtype=dtype), randn(b, hk, s, d, dtype=dtype), randn(b, hk, s, d, dtype=dtype)
    cos, sin = _cos_sin(b, s, d, dtype)
    store = torch.full((2, b, hk, s_max + 2, d), SENTINEL, dtype=dtype, device=device())
    k_cache, v_cache = store[0, :, :, 1:-1], store[1, :, :, 1:-1]  # a guard slot on each side
    q_out = poisoned(q.shape, dtype)
    pos = torch.tensor([2, 4, -1], dtype=torch.int64, device=device())
    torch.ops.fusionscope.rope_and_cache(q, k, v, cos, sin, pos, q_out, k_cache, v_cache)
    assert_within_ulp(k_cache[:, :, 2], rope_reference(q, k, cos, sin)[1][:, :, 0])
    assert torch.equal(v_cache[:, :, 2], v[:, :, 0])
    assert (store[:, :, :, [0, 1, 2, 4, 5]] == SENTINEL).all()
    assert_within_ulp(q_out, apply_rotary_pos_emb(q, k, cos, sin)[0])


def test_rope_and_cache_bad_inputs() -> None:
    dtype = torch.float32
    q, k, v = randn(1, 2, 2, 64, dtype=dtype), randn(1, 2, 2, 64, dtype=dtype), randn(1, 2, 2, 64, dtype=dtype)
    cos, sin = _cos_sin(1, 2, 64, dtype)
    kc, vc = torch.zeros(1, 2, 4, 64, device=device()), torch.zeros(1, 2, 4, 64, device=device())
    pos = torch.tensor([0, 1], device=device())
    if device().type == "cpu":  # slot values are checked on the host only where reading them costs no device sync
        with pytest.raises(ValueError, match=r"\[0, S_max=4\)"):
            rope_and_cache(q, k, v, cos, sin, kc, vc, torch.tensor([3, 4], device=device()))
        with pytest.raises(ValueError, match=r"\[0, S_max=4\)"):
            rope_and_cache(q, k, v, cos, sin, kc, vc, torch.tensor([-1, 0], device=device()))
        with pytest.raises(ValueError, match="distinct"):
            rope_and_cache(q, k, v, cos, sin, kc, vc, torch.tensor([1, 1], device=device()))
    with pytest.raises(ValueError, match="positions must be"):
        rope_and_cache(q, k, v, cos, sin, kc, vc, torch.tensor([0, 1, 2], device=device()))
    with pytest.raises(ValueError, match="positions must be"):
        rope_and_cache(q, k, v, cos, sin, kc, vc, pos.float())
    with pytest.raises(ValueError, match="positions must be"):
        rope_and_cache(q, k, v, cos, sin, kc, vc, pos[None])
    if device().type == "cpu":
        with pytest.raises(ValueError, match=r"\[0, S_max=4\); got \[3, 4\]"):
            rope_and_cache(q, k, v, cos, sin, kc, vc, torch.tensor(3, device=device()))
    with pytest.raises(ValueError, match="k_cache"):
        rope_and_cache(q, k, v, cos, sin, torch.zeros(1, 2, 4, 32, device=device()), vc, pos)
    with pytest.raises(ValueError, match="v_cache"):
        rope_and_cache(q, k, v, cos, sin, kc, vc.half(), pos)
    with pytest.raises(ValueError, match="must match k"):
        rope_and_cache(q, k, v[..., :32], cos, sin, kc, vc, pos)
    with pytest.raises(ValueError, match="must be even"):
        rope_and_cache(q, k, v, cos[..., :31], sin[..., :31], kc, vc, pos)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dr", [64, 32], ids=["full", "partial"])
def test_fp32_tables_with_narrow_activations(dtype: torch.dtype, dr: int) -> None:
    """OLMo-2 keeps cos/sin in fp32 while q and k are bf16: eager promotes the products and the sum to fp32 and the
    model casts the result back (`q_embed.to(q.dtype)`), rounding once. rope and rope_and_cache do the same: within 1
    ulp of that, and within the dtype's tolerance of float64."""
    b, hq, hk, s, d, s_max = 2, 3, 2, 5, 64, 9
    q, k, v = _heads_view(b, hq, s, d, dtype), _heads_view(b, hk, s, d, dtype), _heads_view(b, hk, s, d, dtype)
    cos, sin = _cos_sin(1, s, dr, torch.float32)
    q_hf, k_hf = (t.to(dtype) for t in _hf(q.float(), k.float(), cos, sin))
    q_out, k_out = rope(q, k, cos, sin, out=(poisoned(q.shape, dtype), poisoned(k.shape, dtype)))
    assert q_out.dtype == dtype and k_out.dtype == dtype
    assert_within_ulp(q_out, q_hf)
    assert_within_ulp(k_out, k_hf)
    q64, k64 = rope_reference(q.double(), k.double(), cos.double(), sin.double())
    assert_close(q_out, q64, dtype, scale=_fp64_scale(q))
    assert_close(k_out, k64, dtype, scale=_fp64_scale(k))
    pos = torch.tensor([7, 0, 3, 8, 5], dtype=torch.int64, device=device())
    k_cache = torch.full((b, hk, s_max, d), SENTINEL, dtype=dtype, device=device())
    v_cache = torch.full((b, hk, s_max, d), SENTINEL, dtype=dtype, device=device())
    q_rot = rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, pos, out=poisoned(q.shape, dtype))
    assert_within_ulp(q_rot, q_hf)
    assert_within_ulp(k_cache[:, :, pos], k_hf)
    assert torch.equal(v_cache[:, :, pos], v)
    ref_q, ref_k = rope_reference(q, k, cos, sin)
    assert ref_q.dtype == dtype and torch.equal(ref_q, q_hf) and torch.equal(ref_k, k_hf)


def test_tables_in_a_third_dtype_are_refused() -> None:
    q, k = _heads_view(1, 2, 3, 64, torch.bfloat16), _heads_view(1, 2, 3, 64, torch.bfloat16)
    cos, sin = _cos_sin(1, 3, 64, torch.float16)
    with pytest.raises(ValueError, match="cos/sin"):
        rope(q, k, cos, sin)
