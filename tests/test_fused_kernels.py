"""Recognising kernels that are already fused: Inductor names, engine kernels, CUDA-graph replays, and the per-entry
status `analyze` reports (active / missing / not applicable / not found)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from fusionscope import analysis, trace
from fusionscope.fused_kernels import (
    ENGINE_KERNELS,
    STATUSES,
    catalogue_status,
    graph_replay_share,
    match_engine_kernel,
    parse_inductor_name,
    recognise,
    split_ops,
)
from fusionscope.fusions import _MODULES

REPO = Path(__file__).resolve().parents[1]

# Names as Inductor emits them (torch 2.x, descriptive_names="original_aten": ops sorted alphabetically).
INDUCTOR = [
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "reduction",
     ("_to_copy", "add", "mean", "mul", "pow", "rsqrt"), {"rms_norm", "add_rms_norm"}, {"add_rms_norm"}),
    ("triton_red_fused__to_copy_add_embedding_mean_mul_pow_rsqrt_0", "reduction",
     ("_to_copy", "add", "embedding", "mean", "mul", "pow", "rsqrt"), {"rms_norm", "add_rms_norm"}, {"add_rms_norm"}),
    ("triton_per_fused__to_copy_mean_mul_pow_rsqrt_3", "persistent_reduction",
     ("_to_copy", "mean", "mul", "pow", "rsqrt"), {"rms_norm"}, set()),
    ("triton_poi_fused_mul_silu_1", "pointwise", ("mul", "silu"), {"silu_and_mul"}, set()),
    ("triton_poi_fused_gelu_mul_4", "pointwise", ("gelu", "mul"), {"gelu_and_mul"}, set()),
    ("triton_per_fused_native_layer_norm_2", "persistent_reduction", ("native_layer_norm",), set(), set()),
    ("triton_per_fused_add_native_layer_norm_5", "persistent_reduction", ("add", "native_layer_norm"),
     {"add_layer_norm"}, set()),
    ("triton_poi_fused_add_cat_mul_neg_slice_6", "pointwise", ("add", "cat", "mul", "neg", "slice"), {"rope"},
     {"rope"}),
    ("triton_tem_fused_addmm_gelu_7", "template", ("addmm", "gelu"), {"linear_act"}, set()),
    ("triton_tem_fused_mm_8", "template", ("mm",), set(), set()),
    ("triton_red_fused__softmax_amax_exp_sub_sum_9", "reduction", ("_softmax", "amax", "exp", "sub", "sum"), set(),
     set()),
    ("triton_poi_fused__to_copy_convert_element_type_10", "pointwise", ("_to_copy", "convert_element_type"), set(),
     set()),
    ("triton_for_fused_11", "foreach", (), set(), set()),
    ("triton_poi_fused_mul_silu_1_0d1d2de", "pointwise", ("mul", "silu"), {"silu_and_mul"}, set()),  # older Triton
    ("llama_triton_poi_fused_mul_silu_12", "pointwise", ("mul", "silu"), {"silu_and_mul"}, set()),  # AOTInductor
]  # fmt: skip


@pytest.mark.parametrize(("name", "kind", "ops", "covers", "weak"), INDUCTOR, ids=[row[0] for row in INDUCTOR])
def test_parse_inductor_name(name: str, kind: str, ops: tuple, covers: set, weak: set) -> None:
    parsed = parse_inductor_name(name)
    assert parsed is not None
    assert (parsed.kind, parsed.ops, set(parsed.covers), set(parsed.weak)) == (kind, ops, covers, weak)
    assert bool(parsed.note) == bool(weak)  # a weak claim always says why


@pytest.mark.parametrize(
    "name",
    ["triton_poi_fused_mul_silu", "triton_xyz_fused_mul_0", "_rms_norm_kernel", "triton_", "my_triton_kernel_0",
     "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>(int)"],
)  # fmt: skip
def test_parse_inductor_name_rejects_other_kernels(name: str) -> None:
    assert parse_inductor_name(name) is None


def test_split_ops_longest_match_and_unknown_tokens() -> None:
    vocab = frozenset({"native_layer_norm", "native", "layer_norm", "add", "_to_copy", "to"})
    assert split_ops("add_native_layer_norm", vocab) == ("add", "native_layer_norm")
    assert split_ops("_to_copy_add", vocab) == ("_to_copy", "add")
    assert split_ops("add_frobnicate_add", vocab) == ("add", "frobnicate", "add")


# One real-looking name per engine pattern: (name, launching op, key, engine).
ENGINE = [
    ("_add_rms_norm_kernel", "", "add_rms_norm", "fusionscope"),
    ("_rms_norm_kernel", "", "rms_norm", "fusionscope"),
    ("_silu_and_mul_kernel", "", "silu_and_mul", "fusionscope"),
    ("_gelu_and_mul_kernel", "", "gelu_and_mul", "fusionscope"),
    ("_rope_and_cache_kernel", "", "rope", "fusionscope"),
    ("_decode_attention_kernel", "", "decode_attention", "fusionscope"),
    ("_decode_attention_combine_kernel", "", "decode_attention", "fusionscope"),
    ("_add_layer_norm_kernel", "", "add_layer_norm", "fusionscope"),
    ("_bias_gelu_kernel", "", "bias_gelu", "fusionscope"),
    ("_linear_act_kernel", "", "linear_act", "fusionscope"),
    ("_gemv_kernel", "", "gemv", "fusionscope"),
    ("_sample_kernel", "", "sampling", "fusionscope"),
    ("_fused_add_rms_norm_forward_kernel", "", "add_rms_norm", "liger"),
    ("_rms_norm_forward_kernel", "", "rms_norm", "liger"),
    ("_swiglu_forward_kernel", "", "silu_and_mul", "liger"),
    ("_geglu_tanh_forward_kernel", "", "gelu_and_mul", "liger"),
    ("_triton_rope", "", "rope", "liger"),
    ("void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>(c10::BFloat16*, c10::BFloat16*, c10::BFloat16 const*, "
     "float, int, int)", "", "add_rms_norm", "vllm"),
    ("void vllm::rms_norm_kernel<c10::BFloat16>(c10::BFloat16*, c10::BFloat16 const*, long, c10::BFloat16 const*, "
     "float, int, int)", "", "rms_norm", "vllm"),
    ("void vllm::act_and_mul_kernel<c10::BFloat16, &(c10::BFloat16 vllm::gelu_tanh_kernel<c10::BFloat16>(c10::BFloat16"
     " const&)), true>(c10::BFloat16*, c10::BFloat16 const*, int)", "", "gelu_and_mul", "vllm"),
    ("void vllm::act_and_mul_kernel<c10::BFloat16, &(c10::BFloat16 vllm::silu_kernel<c10::BFloat16>(c10::BFloat16 "
     "const&)), true>(c10::BFloat16*, c10::BFloat16 const*, int)", "", "silu_and_mul", "vllm"),
    ("void vllm::silu_and_mul_quant_kernel<c10::BFloat16>(c10::Float8_e4m3fn*, c10::BFloat16 const*, float const*, "
     "int)", "", "silu_and_mul", "vllm"),
    ("void vllm::gelu_and_mul_kernel<c10::Half>(c10::Half*, c10::Half const*, int)", "", "gelu_and_mul", "vllm"),
    ("void vllm::rotary_embedding_kernel<c10::BFloat16, true>(long const*, c10::BFloat16*, c10::BFloat16*, "
     "c10::BFloat16 const*, int, long, long, int, int, int)", "", "rope", "vllm"),
    ("void vllm::batched_rotary_embedding_kernel<c10::Half, false>(long const*, c10::Half*, c10::Half*)", "", "rope",
     "vllm"),
    ("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, __nv_bfloat16, (vllm::Fp8KVCacheDataType)0>(...)", "",
     "", "vllm"),
    ("void vllm::paged_attention_v2_kernel<unsigned short, unsigned short, 128, 16, 128, "
     "(vllm::Fp8KVCacheDataType)0, false, 512>(float*, float*, unsigned short*)", "", "flash_attention", "vllm"),
    ("topk_topp_sampling_kernel", "", "sampling", "vllm"),
    ("void marlin::Marlin<__nv_bfloat16, 4, 256, 1, 8, 8, true, 4, 8, false>(int4 const*, int4 const*)", "",
     "dequant_gemm", "vllm"),
    ("void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4, false, false, cutlass::bfloat16_t, "
     "Flash_kernel_traits<128, 64, 128, 4, cutlass::bfloat16_t>>, true, false, false, false, true, true, false, "
     "false>(Flash_fwd_params)", "", "flash_attention", "flash-attn"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::half_t>, "
     "false, true, false, false, false, true, false, false>(Flash_fwd_params)", "", "flash_attention", "torch"),
    ("void flashinfer::BatchDecodeWithPagedKVCacheKernel<(flashinfer::PosEncodingMode)0, 2u, 4u, 8u, 16u, 1u, 8u, "
     "(flashinfer::PageStorage)0, __nv_bfloat16>(...)", "", "flash_attention", "flashinfer"),
    ("void flashinfer::SinglePrefillWithKVCacheKernel<...>(...)", "", "flash_attention", "flashinfer"),
    ("void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>(__nv_bfloat16*, __nv_bfloat16*, "
     "__nv_bfloat16*, unsigned int, unsigned int, float)", "", "add_rms_norm", "flashinfer"),
    ("void flashinfer::norm::GemmaRMSNormKernel<8u, __nv_bfloat16>(...)", "", "rms_norm", "flashinfer"),
    ("SiluAndMulKernel", "", "silu_and_mul", "flashinfer"),
    ("GeluTanhAndMulKernel", "", "gelu_and_mul", "flashinfer"),
    ("void flashinfer::BatchQKApplyRotaryPosIdsCosSinCacheKernel<true, 128u, 8u, 16u, __nv_bfloat16, long>(...)", "",
     "rope", "flashinfer"),
    ("void flashinfer::sampling::TopKTopPSamplingFromProbKernel<1024u, (cub::BlockScanAlgorithm)0, "
     "(cub::BlockReduceAlgorithm)2, 4u, false, float, int>(...)", "", "sampling", "flashinfer"),
    ("void flashinfer::activation::act_and_mul_kernel<__nv_bfloat16, &silu>(__nv_bfloat16*, __nv_bfloat16 const*, int)",
     "", "silu_and_mul", "flashinfer"),  # a vLLM-table name, attributed by its namespace
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, "
     "cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)", "", "flash_attention", "torch"),
    ("fmha_v2_flash_attention_fp16_64_128_S_qkv_128_sm90_kernel", "", "flash_attention", "tensorrt-llm"),
    ("xqa_kernel_dt_bf16_d_128_beam_1_kvt_bf16_nqpkv_8_m_8_sm_90", "", "flash_attention", "tensorrt-llm"),
    ("void tensorrt_llm::kernels::generalRmsNorm<__nv_bfloat16, float, true>(...)", "", "rms_norm", "tensorrt-llm"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64_4x1x1_cga1x1x1_kernel0_0", "",
     "flash_attention", "cudnn"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float, true>(...)",
     "aten::_fused_rms_norm", "rms_norm", "torch"),
    ("void at::native::elementwise_kernel<128, 4>(int)", "aten::_scaled_dot_product_efficient_attention",
     "flash_attention", "torch"),
    ("scaled_dot_product_flash_attention_kernel", "", "flash_attention", "torch"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "op", "key", "engine"), ENGINE, ids=[f"{r[3]}-{r[2]}-{i}" for i, r in
                                                                        enumerate(ENGINE)])  # fmt: skip
def test_engine_kernel_matches(name: str, op: str, key: str, engine: str) -> None:
    found = match_engine_kernel(name, op)
    assert found is not None
    assert (found.key, found.engine) == (key, engine)


def test_every_engine_pattern_has_a_real_looking_name() -> None:
    hit = {match_engine_kernel(name, op).pattern for name, op, _, _ in ENGINE}
    assert [e.pattern for e in ENGINE_KERNELS if e.pattern not in hit] == []
    assert {e.key for e in ENGINE_KERNELS} - {""} <= set(_MODULES)


@pytest.mark.parametrize(
    ("name", "op"),
    [
        ("my_rms_norm_kernel", ""),  # no word boundary before the vLLM name
        ("_rms_norm_kernel_backward", ""),
        ("rms_norm_kernel_ref", ""),
        ("fused_add_rms_norm", ""),  # the op, not its kernel
        ("act_and_mul", ""),
        ("rotary_embedding", ""),
        ("reshape_and_cache", ""),
        ("void vllm::paged_attention_v3_kernel<float>(float*)", ""),
        ("void flash::flash_bwd_dq_dk_dv_loop_kernel<Flash_bwd_kernel_traits<128>>(Flash_bwd_params)", ""),
        ("_swiglu_backward_kernel", ""),
        ("fmhalf_kernel", ""),
        ("xqa_reference", ""),
        ("cudnn_generated_fort_native_conv_sm90_kernel0_0", ""),
        ("void flashinfer::BatchMatMulKernel<float>(float*)", ""),
        ("MarlinPlanner", ""),
        ("topk_kernel", ""),
        ("TopKSoftmaxKernel", ""),
        ("GeneralLayerNorm", ""),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off", ""),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>(int)", "aten::add"),
        (
            "void at::native::(anonymous namespace)::softmax_warp_forward<float, float, float, 10>(float*)",
            "aten::_scaled_dot_product_attention_math",
        ),  # SDPA's unfused fallback
    ],
)
def test_engine_kernel_near_misses(name: str, op: str) -> None:
    assert match_engine_kernel(name, op) is None


def _kernel_table() -> pd.DataFrame:
    rows = []
    for step in (0, 1):  # prefill: steps 0-1, two norms and one MLP each
        rows += [("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "prefill", step, 4.0, "")] * 2
        rows += [("triton_poi_fused_mul_silu_1", "prefill", step, 3.0, ""),
                 ("sm90_xmma_gemm_bf16bf16_bf16f32", "prefill", step, 20.0, "aten::mm")]  # fmt: skip
    for step in (2, 3, 4, 5):  # decode: steps 2-5; the norm kernel under two different launching ops
        rows += [("_rms_norm_kernel", "decode", step, 1.0, "fusionscope::rms_norm"),
                 ("_rms_norm_kernel", "decode", step, 1.0, "")]  # fmt: skip
    rows.append(("void vllm::rotary_embedding_kernel<c10::BFloat16, true>(long const*)", "decode", 5, 2.0, ""))
    return pd.DataFrame(rows, columns=["name", "phase", "step", "dur_us", "op"])


def test_recognise_counts_per_phase_and_step() -> None:
    got = recognise(_kernel_table()).set_index(["name", "phase"])
    assert "sm90_xmma_gemm_bf16bf16_bf16f32" not in got.index.get_level_values("name")
    norm = got.loc[("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "prefill")]
    assert (norm["source"], norm["kind"], norm["covers"], norm["weak"]) == (
        "inductor", "reduction", "rms_norm add_rms_norm", "add_rms_norm")  # fmt: skip
    assert (norm["count"], norm["steps"], norm["count_per_step"], norm["dur_us_per_step"]) == (4, 2, 2.0, 8.0)
    ours = got.loc[("_rms_norm_kernel", "decode")]  # two launching ops merged into one row
    assert (ours["source"], ours["covers"], ours["count"], ours["count_per_step"]) == ("fusionscope", "rms_norm", 8, 2)
    rope = got.loc[("void vllm::rotary_embedding_kernel<c10::BFloat16, true>(long const*)", "decode")]
    assert (rope["source"], rope["count_per_step"], rope["dur_us_per_step"]) == ("vllm", 0.25, 0.5)
    assert len(got) == 4


def test_recognise_empty_and_unknown() -> None:
    assert recognise(pd.DataFrame(columns=["name", "phase", "step", "dur_us"])).empty
    assert recognise(pd.DataFrame({"name": ["gemm_kernel"], "dur_us": [1.0]})).empty


def _status(rows: list[dict]) -> dict[tuple[str, str], dict]:
    return {(r["fusion"], r["phase"]): r for r in rows}


OPPORTUNITIES = [
    {"fusion": "rms_norm", "phase": "prefill", "count": 1.0, "saved_us": 3.0, "t_now_us": 5.0},  # beside an active one
    {"fusion": "silu_and_mul", "phase": "decode", "count": 2.0, "saved_us": 4.0, "t_now_us": 9.0},
    {"fusion": "add_layer_norm", "phase": "decode", "count": 2.0, "saved_us": 1.0, "t_now_us": 2.0},
]


def test_catalogue_status_active_missing_not_applicable_not_found() -> None:
    rows = catalogue_status(recognise(_kernel_table()), OPPORTUNITIES, families="llama")
    assert {r["status"] for r in rows} <= set(STATUSES)
    assert len(rows) == 2 * len(_MODULES)  # every entry in both phases
    got = _status(rows)
    norm = got[("rms_norm", "prefill")]
    assert (norm["status"], norm["evidence"], norm["count_per_step"]) == ("active", "strong", 2.0)
    assert norm["kernels"] == ["triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0"]
    assert norm["opportunity"]["saved_us"] == 3.0  # active, and still carries what remains unfused
    assert (got[("add_rms_norm", "prefill")]["status"], got[("add_rms_norm", "prefill")]["evidence"]) == (
        "active", "weak")  # fmt: skip
    assert got[("silu_and_mul", "prefill")]["status"] == "active"
    silu = got[("silu_and_mul", "decode")]
    assert (silu["status"], silu["opportunity"]["saved_us"], silu["kernels"]) == ("missing", 4.0, [])
    assert got[("add_layer_norm", "decode")]["status"] == "missing"  # found beats the family table
    assert got[("add_layer_norm", "prefill")]["status"] == "not applicable"  # llama is not a GPT-2/BERT family
    assert got[("gelu_and_mul", "decode")]["status"] == "not applicable"
    assert got[("rope", "decode")]["status"] == "active"
    assert got[("rms_norm", "decode")]["kernels"] == ["_rms_norm_kernel"]
    assert got[("qkv", "decode")]["status"] == "not found"


def test_catalogue_status_without_family_or_kernels() -> None:
    empty = recognise(pd.DataFrame(columns=["name", "phase", "step", "dur_us"]))
    rows = catalogue_status(empty, pd.DataFrame(OPPORTUNITIES))
    got = _status(rows)
    assert got[("gelu_and_mul", "decode")]["status"] == "not found"  # family unknown: never "not applicable"
    assert got[("silu_and_mul", "decode")]["status"] == "missing"
    assert {r["phase"] for r in rows} == {"prefill", "decode"}
    assert {r["status"] for r in catalogue_status(empty, None, families=["gpt2"])} == {"not found", "not applicable"}


def test_real_trace_sdpa_runs_on_cudnn() -> None:
    """fusionscope's own H200 trace of tiny-llama: SDPA dispatched to cuDNN's flash kernel in both phases."""
    kernels = analysis.kernel_table(trace.load_timeline(REPO / "tests" / "data" / "tiny-llama-cuda.trace.json.gz"))
    got = _status(catalogue_status(recognise(kernels), [], families="llama"))
    for phase in ("prefill", "decode"):
        flash = got[("flash_attention", phase)]
        assert (flash["status"], flash["count_per_step"]) == ("active", 2.0)  # two layers
        assert flash["kernels"][0].startswith("cudnn_generated_fort_native_sdpa")
        assert got[("rms_norm", phase)]["status"] == "not found"  # eager HF norms


def _events() -> list[dict]:
    runtime = [{"cat": "cuda_runtime", "name": "cudaGraphLaunch", "args": {"correlation": 10}},
               {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "args": {"correlation": 11}},
               {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "args": {"correlation": 5}}]  # fmt: skip
    kernels = [{"cat": "kernel", "name": "triton_poi_fused_mul_silu_1", "dur": 3.0, "args": {"correlation": 10}},
               {"cat": "kernel", "name": "_rms_norm_kernel", "dur": 2.0, "args": {"correlation": 10}},
               {"cat": "kernel", "name": "_rms_norm_kernel", "dur": 2.0, "args": {"correlation": 11}},
               {"cat": "kernel", "name": "gemm", "dur": 13.0, "args": {"correlation": 5}}]  # fmt: skip
    return [*runtime, *kernels, {"cat": "cpu_op", "name": "aten::mm", "dur": 40.0}]


def test_graph_replay_share_from_events() -> None:
    share = graph_replay_share({"traceEvents": _events()})
    assert share == {"kernel_us": 20.0, "replayed_us": 7.0, "share": 0.35, "kernels_replayed": 3, "graph_launches": 2}
    assert graph_replay_share([e for e in _events() if e["name"] != "cudaGraphLaunch"])["share"] == 0.0
    assert graph_replay_share([])["share"] == 0.0


def test_graph_replay_share_from_a_kernel_table() -> None:
    table = pd.DataFrame({"dur_us": [3.0, 1.0], "launch": ["cudaGraphLaunch", "cuLaunchKernel"]})
    assert graph_replay_share(table)["share"] == 0.75
    with pytest.raises(ValueError, match="launch"):
        graph_replay_share(table.drop(columns=["launch"]))


def test_importable_and_usable_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import pandas as pd\n"
        "from fusionscope.fused_kernels import catalogue_status, recognise\n"
        "t = pd.DataFrame({'name': ['triton_poi_fused_mul_silu_1'], 'phase': ['decode'], 'step': [0],\n"
        "                  'dur_us': [1.0]})\n"
        "rows = catalogue_status(recognise(t), [], families='llama')\n"
        "assert [r['status'] for r in rows if r['fusion'] == 'silu_and_mul'] == ['active'], rows\n"
        "assert not any(m == 'triton' or m.startswith('triton.') for m in sys.modules if sys.modules[m] is not None)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
