"""decode_attention against its float64 reference: GQA/MHA/MQA head layouts, odd cache lengths, one split and several
(flash-decoding), cache rows past `length` that must never be read, a `length` updated in place between calls (what
a CUDA graph replay does), and the public function's argument checks."""

from __future__ import annotations

import sys

import pytest
import torch
from fusionscope.kernels.decode_attention import (
    SCHEDULE,
    decode_attention,
    decode_attention_reference,
    schedule,
)
from fusionscope.kernels.tolerances import assert_close

from tests.kernels.conftest import DTYPES, device, poisoned, randn

HUGE = 1e4  # fills the cache rows past `length`: one of them in the softmax or the sum would swamp the result
SPLITS = pytest.mark.parametrize("splits", [1, 3], ids=["one-split", "three-splits"])


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """16-row tiles, so that odd cache lengths of a few dozen rows take several loop steps and a masked tail."""
    monkeypatch.setitem(SCHEDULE, "BLOCK_N", 16)


def _query(b: int, h: int, d: int, dtype: torch.dtype, seed: int | None = None) -> torch.Tensor:
    """(B, H, 1, D) as Hugging Face makes it: a (B, 1, H, D) projection viewed through `.transpose(1, 2)`."""
    q = randn(b, 1, h, d, dtype=dtype, seed=seed).transpose(1, 2)
    assert q.shape == (b, h, 1, d) and q.stride(1) == d and q.stride(2) == h * d
    return q


def _caches(
    b: int, kvh: int, s_max: int, d: int, length: int, dtype: torch.dtype, seed: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (B, KVH, S_max, D) K and V whose rows at and past `length` hold HUGE."""
    k = randn(b, kvh, s_max, d, dtype=dtype, seed=seed)
    v = randn(b, kvh, s_max, d, dtype=dtype, seed=None if seed is None else seed + 1)
    k[:, :, length:] = HUGE
    v[:, :, length:] = HUGE
    return k, v


def _length(n: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor([n], dtype=dtype, device=device())


def check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    length: torch.Tensor,
    splits: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run the kernel and compare it with the float64 reference at q's dtype's tolerance; check the launch really
    used `splits` splits."""
    b, h, _, d = q.shape
    assert schedule(b, h, k.shape[1], k.shape[2], q.device).splits == splits
    scale = d**-0.5
    got = decode_attention(q, k, v, length, scale, out=out)
    if out is not None:
        assert got is out
    else:
        assert got.is_contiguous()
    assert got.shape == (b, 1, h, d) and got.dtype == q.dtype
    assert not got.isnan().any()
    expected = decode_attention_reference(q.double(), k.double(), v.double(), length, scale)
    assert_close(got, expected, q.dtype)
    return got


# Every head layout × split count × length, the dtype rotating over the three lengths so that each (layout, splits)
# pair meets all three dtypes: 18 cases of the 54 in the full product (the interpreter costs per program and op).
MATCH_CASES = [
    pytest.param(heads, kv_heads, splits, n, DTYPES[(i + j + k) % 3],
                 id=f"{str(DTYPES[(i + j + k) % 3]).removeprefix('torch.')}-{length}-{split_id}-{layout}")
    for i, (heads, kv_heads, layout) in enumerate([(4, 2, "gqa"), (6, 6, "mha"), (8, 1, "mqa")])
    for j, (splits, split_id) in enumerate([(1, "one-split"), (3, "three-splits")])
    for k, (n, length) in enumerate([(20, "partial"), (37, "full"), (1, "first-token")])
]  # fmt: skip


@pytest.mark.parametrize(("heads", "kv_heads", "splits", "n", "dtype"), MATCH_CASES)
def test_matches_fp64_reference(
    heads: int, kv_heads: int, splits: int, n: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S_max = 37: with 16-row tiles, three splits of 16 positions, the last a 5-row tail; length 20 leaves the third
    split empty (a neutral partial) and length 1 the second and third."""
    monkeypatch.setitem(SCHEDULE, "splits", splits)
    b, d, s_max = 2, 64, 37
    q = _query(b, heads, d, dtype)
    k, v = _caches(b, kv_heads, s_max, d, n, dtype)
    check(q, k, v, _length(n), splits, out=poisoned((b, 1, heads, d), dtype))


BF16, FP16 = torch.bfloat16, torch.float16


@pytest.mark.parametrize(
    ("b", "heads", "kv_heads", "d", "n", "splits", "dtype"),
    [
        (1, 4, 2, 128, 50, 1, BF16),
        (3, 4, 2, 128, 77, 5, FP16),
        (3, 8, 1, 64, 48, 2, BF16),  # length ends on a split boundary: the second split is empty
        (1, 6, 6, 128, 1, 5, FP16),
        (2, 4, 2, 32, 41, 5, BF16),
        (2, 6, 2, 80, 77, 3, FP16),  # D = 80 masked to a 128-wide block
    ],
    ids=str,
)
def test_batches_head_dims_and_long_caches(
    b: int, heads: int, kv_heads: int, d: int, n: int, splits: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S_max = 77 (odd, 5 tiles of 16), B up to 3, D 32 / 64 / 80 / 128, each case in bf16 or fp16 (not both: the
    dtypes meet every head layout and length in test_matches_fp64_reference)."""
    monkeypatch.setitem(SCHEDULE, "splits", splits)
    q = _query(b, heads, d, dtype)
    k, v = _caches(b, kv_heads, 77, d, n, dtype)
    check(q, k, v, _length(n), splits)


def test_head_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """More query heads per kv head than one program takes: G = 32 with 16 a program; every head block writes its own
    heads."""
    monkeypatch.setitem(SCHEDULE, "max_group", 16)
    monkeypatch.setitem(SCHEDULE, "splits", 2)
    assert schedule(1, 32, 1, 37, device()).head_blocks == 2
    q = _query(1, 32, 64, torch.float32)
    k, v = _caches(1, 1, 37, 64, 29, torch.float32)
    check(q, k, v, _length(29), 2, out=poisoned((1, 1, 32, 64), torch.float32))


@SPLITS
def test_length_updated_in_place_between_calls(splits: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same tensors, `length` rewritten in place between calls (a CUDA graph replay's situation): each call reads
    the new value on the device, and rows written into the cache since count."""
    monkeypatch.setitem(SCHEDULE, "splits", splits)
    b, heads, kv_heads, d, s_max, dtype = 2, 4, 2, 64, 37, torch.float16
    q = _query(b, heads, d, dtype)
    k, v = _caches(b, kv_heads, s_max, d, 5, dtype)
    length = _length(5, torch.int32)
    out = poisoned((b, 1, heads, d), dtype)
    first = check(q, k, v, length, splits, out=out).clone()
    for n in (6, 21, 37):  # decode steps: write the new rows, bump length, call again on the same buffers
        k[:, :, n - 1] = randn(b, kv_heads, d, dtype=dtype)
        v[:, :, n - 1] = randn(b, kv_heads, d, dtype=dtype)
        length.fill_(n)
        check(q, k, v, length, splits, out=out)
        assert not torch.equal(out, first)


def test_splits_are_deterministic_and_agree_with_one_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """The combine merges partials in a fixed order: repeated calls are bit-identical; one and five splits agree at
    the dtype's tolerance."""
    q = _query(1, 4, 64, torch.float32)
    k, v = _caches(1, 2, 77, 64, 70, torch.float32)
    monkeypatch.setitem(SCHEDULE, "splits", 5)
    assert schedule(1, 4, 2, 77, device()).splits == 5
    split = decode_attention(q, k, v, _length(70), 0.125)
    assert torch.equal(split, decode_attention(q, k, v, _length(70), 0.125))
    monkeypatch.setitem(SCHEDULE, "splits", 1)
    assert_close(decode_attention(q, k, v, _length(70), 0.125), split)


@pytest.mark.parametrize("splits", [1, 2])
def test_length_outside_the_cache_is_clamped(splits: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A length past S_max reads the whole cache and nothing beyond it; length 0 gives zeros, not NaN."""
    monkeypatch.setitem(SCHEDULE, "splits", splits)
    q = _query(1, 4, 64, torch.float32)
    store_k, store_v = (torch.full((1, 2, 40, 64), HUGE, device=device()) for _ in range(2))
    store_k[:, :, :37], store_v[:, :, :37] = _caches(1, 2, 37, 64, 37, torch.float32)
    k, v = store_k[:, :, :37], store_v[:, :, :37]  # rows 37..39 of the storage lie past the cache
    full = decode_attention_reference(q, k, v, 37, 0.125)
    assert_close(decode_attention(q, k, v, _length(1000), 0.125), full)
    empty = decode_attention(q, k, v, _length(0), 0.125)
    assert torch.equal(empty, torch.zeros_like(empty))


def test_reference_matches_sdpa_over_the_valid_rows() -> None:
    """The reference is PyTorch's attention with repeated kv heads over rows 0..length-1, transposed as HF does."""
    q = _query(2, 8, 32, torch.float64)
    k, v = _caches(2, 2, 11, 32, 7, torch.float64)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k[:, :, :7].repeat_interleave(4, 1), v[:, :, :7].repeat_interleave(4, 1), scale=0.3
    )
    torch.testing.assert_close(decode_attention_reference(q, k, v, _length(7), 0.3), expected.transpose(1, 2))


def test_bad_inputs() -> None:
    dtype = torch.float32
    q = _query(1, 4, 64, dtype)
    k, v = _caches(1, 2, 8, 64, 8, dtype)
    n = _length(8)
    with pytest.raises(ValueError, match=r"q must be \(B, H, 1, D\)"):
        decode_attention(q[0], k, v, n, 1.0)
    with pytest.raises(ValueError, match=r"q must be \(B, H, 1, D\)"):
        decode_attention(randn(1, 4, 2, 64, dtype=dtype), k, v, n, 1.0)
    with pytest.raises(ValueError, match="k_cache must be"):
        decode_attention(q, k[0], v, n, 1.0)
    with pytest.raises(ValueError, match="v_cache must be"):
        decode_attention(q, k, v[..., :32], n, 1.0)
    with pytest.raises(ValueError, match="must match k_cache"):
        decode_attention(q, k, v[:, :, :4], n, 1.0)
    with pytest.raises(ValueError, match="multiple of the kv heads"):
        decode_attention(_query(1, 5, 64, dtype), k, v, n, 1.0)
    with pytest.raises(ValueError, match=r"v_cache must be torch\.float32"):
        decode_attention(q, k, v.half(), n, 1.0)
    with pytest.raises(ValueError, match="not supported"):
        decode_attention(q.to(torch.float64), k.double(), v.double(), n, 1.0)
    with pytest.raises(ValueError, match="head dim"):
        big = _query(1, 4, 512, dtype)
        decode_attention(big, *_caches(1, 2, 8, 512, 8, dtype), n, 1.0)
    with pytest.raises(ValueError, match="1-element int64 or int32 tensor"):
        decode_attention(q, k, v, 8, 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="1-element int64 or int32 tensor"):
        decode_attention(q, k, v, n.float(), 1.0)
    with pytest.raises(ValueError, match="1-element int64 or int32 tensor"):
        decode_attention(q, k, v, torch.tensor([3, 4], device=device()), 1.0)
    with pytest.raises(ValueError, match="length is on meta"):
        decode_attention(q, k, v, torch.tensor([8], device="meta"), 1.0)
    with pytest.raises(ValueError, match=r"out must be \(1, 1, 4, 64\)"):
        decode_attention(q, k, v, n, 1.0, out=poisoned((1, 4, 1, 64), dtype))


def test_short_caches_split_when_the_kv_heads_leave_most_sms_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a 132-SM GPU: batch 1 with 8 kv heads splits a 579-row cache (8 programs alone would leave 124 SMs idle),
    batch 16 splits it less, batch 64 (512 programs) not at all; a split is a whole number of BLOCK_N rows."""
    import sys

    monkeypatch.setattr(sys.modules[schedule.__module__], "sm_count", lambda index: 132)
    gpu = torch.device("cuda", 0)
    one, sixteen, many = (schedule(b, 32, 8, 579, gpu) for b in (1, 16, 64))
    assert one.splits > sixteen.splits > many.splits == 1
    assert one.chunk % one.block_n == 0 and one.chunk >= SCHEDULE["min_split_len"]
    assert one.splits * one.chunk >= 579 > (one.splits - 1) * one.chunk


@pytest.mark.parametrize(("heads", "kv_heads", "s_max"), [(32, 32, 580), (32, 8, 580), (32, 8, 4099)])
def test_the_rule_gives_at_least_the_splits_it_wants(
    heads: int, kv_heads: int, s_max: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The automatic rule on a 132-SM GPU (the schedule is computed on the host: no GPU needed): as many splits as
    fill `programs_per_sm` programs per SM, capped by `min_split_len`, and never fewer because the chunk was rounded
    up to whole tiles (Phi-3-mini's 32 heads on 580 rows wanted 9 splits and got 5 of 128 rows)."""
    module = sys.modules[schedule.__module__]  # the package exports a function of the module's name

    monkeypatch.setitem(SCHEDULE, "BLOCK_N", 64)
    monkeypatch.setattr(module, "sm_count", lambda _index: 132)
    plan = schedule(1, heads, kv_heads, s_max, torch.device("cuda", 0))
    programs = kv_heads * plan.head_blocks
    wanted = min(-(-int(SCHEDULE["programs_per_sm"]) * 132 // programs), s_max // int(SCHEDULE["min_split_len"]))
    assert plan.splits >= wanted and plan.chunk % plan.block_n == 0
    assert (plan.splits - 1) * plan.chunk < s_max <= plan.splits * plan.chunk  # every row in one split, none empty
