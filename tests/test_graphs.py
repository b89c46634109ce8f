"""`apply --graphs` on the CPU: the static-cache decode step every graph variant captures on a GPU, run eagerly here
(teacher-forced against the eager model with the same patches), the cache-counter trap it avoids, and the
weight-streaming floor."""

from __future__ import annotations

import json
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

import fusionscope
from fusionscope.apply import graphs, numerics
from fusionscope.cli import app
from fusionscope.floor import weight_floor
from fusionscope.models import build_workload, resolve_model


@pytest.fixture(scope="module")
def tiny() -> tuple[torch.nn.Module, torch.Tensor]:
    workload = build_workload(resolve_model("tiny-llama"), torch.device("cpu"), torch.float32, prompt_len=8,
                              decode_steps=4)  # fmt: skip
    return workload.module, workload.inputs[0]


def test_apply_graphs_checks_every_variant_teacher_forced_on_the_cpu(tmp_path, monkeypatch) -> None:
    """Also: every eager reference of the run, the graph stage's included, runs on the run's cache (static under
    --graphs), where a patched forward's graphs captured for the eager check serve the next (on a dynamic cache the
    patched forward was captured twice more for the growing cache)."""
    caches: list[str] = []
    plain = numerics.reference

    def spied(*args, **kwargs):
        caches.append(kwargs.get("cache", "dynamic"))
        return plain(*args, **kwargs)

    monkeypatch.setattr(numerics, "reference", spied)
    run = fusionscope.apply("tiny-llama", out=tmp_path / "r", prompt_len=8, decode_steps=3, warmup=0, repeats=1,
                            graphs=True)  # fmt: skip
    assert caches and set(caches) == {"static"}, caches
    result = json.loads((tmp_path / "r" / "summary.json").read_text())["apply"]["graphs"]
    variants = result["variants"]
    passing = [r["fusion"] for r in run.apply["fusions"] if r["status"] == "passed"]
    assert list(variants)[:1] == [graphs.GRAPH] and graphs.FUSED_GRAPH in variants
    assert {f"{f} + graph" for f in passing} <= set(variants)
    assert variants[graphs.FUSED_GRAPH]["fusions"] == passing
    for name in (graphs.GRAPH, graphs.FUSED_GRAPH, *(f"{f} + graph" for f in passing)):
        row = variants[name]
        assert row["passed"], (name, row["reason"])
        assert row["numerics"]["max_abs"] < 1e-4 and row["free_running"]["tokens_equal"] == 1.0
        assert row["ms_per_token"] is None  # no timing on a CPU
    assert variants[graphs.LIGER]["passed"] is False and variants[graphs.LIGER]["reason"]
    assert "need a GPU" in result["timing_note"]
    assert result["floor"]["bytes"] > 0 and run.summary["phases"]["decode"]["weight_floor"]["ms"] > 0
    report = (tmp_path / "r" / "report.html").read_text()
    assert "table-apply-graphs" in report and "the decode step in a CUDA graph" in report


def test_the_static_caches_own_write_counter_is_why_a_capture_puts_it_back(tiny) -> None:
    """transformers' StaticLayer writes where its own counter says, not where `cache_position` does: two warm-up
    steps leave it two rows ahead, and the next step's K/V land where its mask does not look — logits off. Putting
    the counters `cache_state` copied back (what `capture` does after its warm-up) makes the step exact again."""
    model, ids = tiny
    ref = numerics.reference(model, ids, 4)
    decoder = graphs.StaticDecoder(model, ids, 4)

    def first_step_error(restore: bool) -> float:
        decoder.prefill()
        state, position = graphs.cache_state(decoder.cache), decoder.position.clone()
        with torch.inference_mode():  # the decoder's tensors are inference tensors, as the eager runs' are
            for _ in range(graphs.WARMUP_CALLS):
                decoder._body()
            decoder.position.copy_(position)
            if restore:
                graphs.restore_state(decoder.cache, state)
            decoder.token.copy_(ref.tokens[:, :1])
        return float((decoder.step() - ref.decode_logits[:, 0]).abs().max())

    assert first_step_error(restore=True) < 1e-4
    assert first_step_error(restore=False) > 1e-2


def test_the_graph_stage_reuses_the_graphs_a_patch_captured_for_the_eager_check(tiny, monkeypatch) -> None:
    """The decoder hands the model what the eager static-cache runs hand it (inference tensors, a cache of prompt +
    steps rows), and a patched forward's captured graphs are guarded on both: the graphs captured for the eager check
    serve the graph variant, where each whole-model capture again cost the H200 runs seconds. One is left: the
    decoder's second prefill (its free-running pass) finds the cache's tensors made, where every eager check's
    prefill starts a new cache, and transformers' forward branches on that."""
    from fusionscope.apply import rewrite
    from fusionscope.apply.patching import patch

    torch._dynamo.reset()  # counted from dynamo's initial state: code compiled by an earlier test would be reused
    model, ids = tiny
    captures: list[int] = []
    backend = rewrite.Rewriter.__call__

    def counted(self, gm, inputs):
        captures.append(1)
        return backend(self, gm, inputs)

    monkeypatch.setattr(rewrite.Rewriter, "__call__", counted)
    with patch(model, ["rms_norm"], example=lambda m: numerics.reference(m, ids, 4, cache="static")) as result:
        assert result.rewritten == ["rms_norm"]
        ref = numerics.reference(model, ids, 4, cache="static")
        before = len(captures)
        decoder = graphs.StaticDecoder(model, ids, 4)
        graphs.teacher_forced(decoder, ref)
    assert before >= 1 and len(captures) - before <= 1  # (3 before the decoder matched them)
    assert decoder.token.is_inference() and decoder.position.is_inference()


def test_a_variant_is_profiled_within_its_cache_after_the_checks_filled_it(tiny, monkeypatch) -> None:
    """The cache holds prompt + steps rows, and the teacher-forced check's free-running pass writes all of them: the
    profiled replay and eager step that follow it write beyond the cache unless they start from a prefill. (On the
    H200 that was a device-side assert in `index_copy_`; on the CPU it is an IndexError.)"""
    model, ids = tiny
    steps = 4
    decoder = graphs.StaticDecoder(model, ids, steps)
    graphs.teacher_forced(decoder, numerics.reference(model, ids, steps))

    def eager_step() -> None:
        with torch.inference_mode():
            decoder._body()

    decoder.graph = SimpleNamespace(replay=eager_step)  # a "replay": the eager step, as on the CPU
    calls: list[str] = []

    def profiled(replay, eager, _model, _roofs) -> dict:
        replay()
        calls.append("replay")
        if eager is not None:
            eager()
            calls.append("eager")
        return {}

    monkeypatch.setattr(graphs.replay, "replay_profile", profiled)
    graphs.profile_variant(graphs.GRAPH, decoder)
    assert calls == ["replay", "eager"]


def test_the_weight_floor_counts_each_weight_once_and_the_kv_cache_read(tiny) -> None:
    model, _ = tiny
    config = model.config
    floor = weight_floor(model, batch=2, kv_len=10, copy_gbps=1000.0)
    params = {id(p): p for p in model.parameters()}.values()
    embed = model.get_input_embeddings().weight
    tied = embed is model.get_output_embeddings().weight
    expected = sum(p.numel() * 4 for p in params) - (0 if tied else embed.numel() * 4 - 2 * embed.shape[1] * 4)
    head_dim = config.hidden_size // config.num_attention_heads
    kv = 2 * config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 10 * 4
    assert floor["weight_bytes"] == expected and floor["kv_bytes"] == kv
    assert floor["ms"] == pytest.approx((expected + kv) / 1e9)  # 1000 GB/s = 1e9 bytes per ms


def test_graphs_without_decode_steps_is_one_line(tmp_path) -> None:
    result = CliRunner().invoke(app, ["apply", "--graphs", "--decode-steps", "0", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "--graphs" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "x").exists()


def test_rope_under_a_static_cache_rotates_and_writes_the_cache_in_one_launch(tiny, monkeypatch) -> None:
    """Under a static cache the rope patch writes the rotated k and v straight into the cache rows
    (`rope_and_cache`) once the first write allocated them; every step computes what eager computes."""
    import fusionscope.kernels as kernels

    from fusionscope.apply.patching import patch

    model, ids = tiny
    ref = numerics.reference(model, ids, 4)
    calls = []
    real = kernels.rope_and_cache
    monkeypatch.setattr(kernels, "rope_and_cache", lambda *a, **k: calls.append(1) or real(*a, **k))
    with patch(model, ["rope"], rewrite=False) as result:  # the layout patcher's rope_and_cache
        assert result.applied["rope"]
        forced, own = graphs.teacher_forced(graphs.StaticDecoder(model, ids, 4), ref)
    layers = model.config.num_hidden_layers
    # every layer of every decode step of both passes, and of the second prefill: only the first prefill, which
    # allocates the cache, goes through StaticLayer.update
    assert len(calls) == (2 * 4 + 1) * layers
    fig = numerics.compare(forced, graphs.last_position(ref))
    assert fig["max_abs"] < 1e-4 and torch.equal(own, ref.tokens)


def test_graphs_only_times_the_eager_model_unpatched_and_all_together(monkeypatch, tmp_path) -> None:
    """`--graphs-only` keeps the eager baseline and all passing fusions together (the graph table's eager row and
    the fused step), and leaves out each fusion alone; without it each fusion is timed alone too."""
    from types import SimpleNamespace

    from fusionscope.apply import measure, run

    sets: list[list[str]] = []

    def timed(workload, variants, enter, sampler, repeats, note):
        sets.append(list(variants))
        return {n: measure.Measurement(wall_ms={"decode": [10.0 if n == run.BASELINE else 8.0]}) for n in variants}

    monkeypatch.setattr(run, "_timed_set", timed)
    monkeypatch.setattr(measure, "gpu_figures", lambda *a, **k: {"decode": {"gpu_ms": 1.0, "kernels": 10}})
    workload = SimpleNamespace(phases=("decode",))
    summary = {"phases": {"decode": {}}, "opportunities": []}
    for alone, first in ((False, [run.BASELINE, run.ALL_FOUND]),
                         (True, [run.BASELINE, "rope", "qkv", run.ALL_FOUND])):  # fmt: skip
        sets.clear()
        out = run.measure_variants(workload, summary, ["rope", "qkv"], lambda f: nullcontext(), None, 1, tmp_path,
                                   lambda _: None, together_ok=True, alone=alone)  # fmt: skip
        assert sets == [first]
        assert out["all_together"] == {"decode": run.ALL_TOGETHER}
        assert out["variants"][run.ALL_TOGETHER]["fusions"] == ["rope", "qkv"]


@pytest.mark.parametrize("each", [True, False])
def test_graphs_together_captures_the_graph_alone_and_fused_only(monkeypatch, each: bool) -> None:
    """`--graphs-together` leaves out each fusion + graph; the graph alone and fused + graph stay, the sampler's
    fusion takes no part in either way."""
    from fusionscope.apply import run

    captured: list[dict[str, list[str]]] = []

    def fake_run_graphs(workload, variants, *args):
        captured.append(dict(variants))
        return {"variants": {}}

    monkeypatch.setattr(graphs, "run_graphs", fake_run_graphs)
    summary = {"phases": {"decode": {}}, "opportunities": []}
    out = run.graph_variants(None, summary, ["rope", "qkv", "sampling"], None, None, None, {}, False, 1,
                             lambda _: None, each, None, timing=None)  # fmt: skip
    alone = {"rope + graph": ["rope"], "qkv + graph": ["qkv"]} if each else {}
    assert captured == [{graphs.GRAPH: [], **alone, graphs.FUSED_GRAPH: ["rope", "qkv"]}]
    said = "not measured (--graphs-together): rope + graph, qkv + graph"
    assert (said in (out.get("timing_note") or "")) is not each  # the run says which were left out


def test_graphs_together_without_graphs_is_one_line(tmp_path) -> None:
    result = CliRunner().invoke(app, ["apply", "--graphs-together", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "--graphs-together" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "x").exists()


def test_graphs_only_without_graphs_is_one_line(tmp_path) -> None:
    result = CliRunner().invoke(app, ["apply", "--graphs-only", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "--graphs-only" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "x").exists()


def gemma2_tiny(window: int) -> tuple[torch.nn.Module, torch.Tensor]:
    from fusionscope import models
    from fusionscope.models import ModelSpec

    config = {**models.PRESETS["gemma-2-2b"], "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 96, "vocab_size": 300,
              "sliding_window": window}  # fmt: skip
    workload = build_workload(ModelSpec(name="gemma2-tiny", source="config", config=config), torch.device("cpu"),
                              torch.float32, prompt_len=12, decode_steps=6)  # fmt: skip
    return workload.module, workload.inputs[0]


@pytest.mark.parametrize("window", [64, 8])
def test_a_sliding_window_cache_starts_over_at_every_prefill(window: int) -> None:
    """Gemma-2's StaticSlidingWindowLayer keeps a Python int twin of its write counter that picks its branch: a
    decoder prefilled a second time (as every variant is: once when built, again when checked) must reset it with
    the device counter, or every later step writes and reads the wrong rows."""
    model, ids = gemma2_tiny(window)
    ref = numerics.reference(model, ids, 6)
    with graphs.built(lambda: graphs.StaticDecoder(model, ids, 6), capture=False) as (decoder, _):
        # a window that holds the whole run is a plain static layer; one that could roll is transformers' own
        assert any(getattr(layer, "is_sliding", False) for layer in decoder.cache.layers) is (window == 8)
        forced, own = graphs.teacher_forced(decoder, ref)
    fig = numerics.compare(forced, graphs.last_position(ref))
    assert fig["max_abs"] < 1e-4 and torch.equal(own, ref.tokens)


def test_a_graph_that_would_roll_a_sliding_window_is_refused_with_its_reason() -> None:
    model, ids = gemma2_tiny(8)
    decoder = graphs.StaticDecoder(model, ids, 6)
    decoder.prefill()
    assert "sliding-window" in graphs.window_overrun(decoder.cache, 18)
    assert graphs.window_overrun(decoder.cache, 8) == ""
    model, ids = gemma2_tiny(64)
    decoder = graphs.StaticDecoder(model, ids, 6)
    decoder.prefill()
    assert graphs.window_overrun(decoder.cache, 18) == ""


def test_a_sliding_window_layer_that_never_rolls_becomes_a_plain_static_layer() -> None:
    """Gemma-2 takes its decode positions, sliding mask sizes and write branch from a sliding-window layer's Python
    int, which a captured graph would freeze and torch.compile guards on. The static cache made here holds a plain
    `StaticLayer` wherever the window holds the whole run, and the decode it drives gives the logits of the model
    run on the whole prefix; a window that would roll keeps transformers' own layer."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    from transformers.cache_utils import StaticLayer

    config = Gemma2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=16, intermediate_size=64, vocab_size=97, sliding_window=64,
                          query_pre_attn_scalar=16)  # fmt: skip
    model = Gemma2ForCausalLM(config).eval()
    ids = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(0))
    kinds = [layer.is_sliding for layer in graphs.static_cache(model, max_len=100).layers]
    assert True in kinds and False in kinds  # a window of 64 rows would roll within 100: transformers' layers stay
    decoder = graphs.StaticDecoder(model, ids, decode_steps=3)
    assert all(type(layer) is StaticLayer for layer in decoder.cache.layers)
    prefix = ids
    with torch.no_grad():
        logits = decoder.prefill()
        for _ in range(3):
            whole = model(prefix).logits[:, -1].float()
            torch.testing.assert_close(logits.reshape(whole.shape), whole, rtol=1e-4, atol=1e-4)
            prefix = torch.cat([prefix, decoder.token.clone()], dim=1)
            logits = decoder.step()
            assert int(decoder.cache.layers[0].get_seq_length()) == prefix.shape[1]


def test_torch_compile_of_a_gemma2_decode_on_this_cache_compiles_once() -> None:
    """transformers' sliding-window layer keeps a Python int that its mask sizes and write branch read; torch.compile
    guarded on it and compiled a new graph at every decode step (gemma-2-2b hit the recompile limit on the H200 and
    ran slower than eager, 2026-12-02). On the cache made here, six steps are one graph."""
    import torch._dynamo as dynamo
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=16, intermediate_size=64, vocab_size=97, sliding_window=64,
                          query_pre_attn_scalar=16)  # fmt: skip
    model = Gemma2ForCausalLM(config).eval()
    ids = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(0))
    dynamo.reset()
    dynamo.utils.counters.clear()
    compiled = torch.compile(model.forward, backend="eager", dynamic=False)
    decoder = graphs.StaticDecoder(model, ids, decode_steps=6, forward=compiled)
    decoder.prefill()
    for _ in range(6):
        decoder.step()
    assert dynamo.utils.counters["stats"]["unique_graphs"] == 1
    dynamo.reset()


def test_a_subclass_of_the_sliding_window_layer_keeps_its_own_state(monkeypatch) -> None:
    """Only transformers' plain sliding-window layer becomes a static layer: a subclass (a hybrid layer that also
    holds linear-attention state, as transformers has) would lose what it adds."""
    import transformers
    from transformers import Gemma2Config
    from transformers.cache_utils import StaticSlidingWindowLayer

    class Hybrid(StaticSlidingWindowLayer):
        pass

    made = transformers.StaticCache

    def with_a_hybrid(**kwargs):
        cache = made(**kwargs)
        first = cache.layers[0]
        cache.layers[0] = Hybrid(max_cache_len=kwargs["max_cache_len"], sliding_window=first.max_cache_len)
        return cache

    monkeypatch.setattr(transformers, "StaticCache", with_a_hybrid)
    config = Gemma2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=16, intermediate_size=64, vocab_size=97, sliding_window=64,
                          query_pre_attn_scalar=16)  # fmt: skip
    cache = graphs.static_cache(SimpleNamespace(config=config), max_len=20)
    assert type(cache.layers[0]) is Hybrid  # kept, though its window holds the run
    assert [type(layer).__name__ for layer in cache.layers[1:]] == ["StaticLayer"]
