"""Patching on the captured graph (`fusionscope.apply.rewrite`): on every tiny family each fusion that can `bind` a
match is patched at every site the finder found, whatever the family's layout; the graph really calls the bundled
kernels (counted per forward); the logits match the unpatched model on prefill and on a decode step with the cache;
leaving the patch puts the model back exactly. A forward that dynamo cannot capture whole falls back to the layout
patchers and says why in one line; `rewrite=False` is the layout path."""

from __future__ import annotations

import collections
import inspect
from collections.abc import Callable

import fusionscope.kernels
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusionscope import dataflow
from fusionscope.apply.patching import PatchResult, find_sites, fusion_modules, patch, sites_by_fusion
from fusionscope.fusions import Graph, find_matches
from fusionscope.models import ModelSpec, Workload, build_workload, resolve_model

FAMILIES = ["tiny-llama", "tiny-phi3", "tiny-olmo2", "tiny-qwen3", "tiny-neox", "tiny-starcoder2"]
# the fusions patched on the captured graph: those whose module can bind a match
BIND = {name for name, module in fusion_modules().items() if hasattr(module, "bind")}
# words of the layout patchers' refusals: a graph patch never gives up because of a forward's source
LAYOUT_WORDS = ("layout", "differs from", "is not a layout", "Llama-shape")
KERNELS = ["rms_norm", "add_rms_norm", "silu_and_mul", "gelu_and_mul", "rope", "rope_and_cache", "linear_act",
           "add_layer_norm", "add_layer_norm_pair", "decode_attention", "gemv_gated"]  # fmt: skip


def test_the_catalogue_binds_the_documented_fusions() -> None:
    assert {"rms_norm", "add_rms_norm", "silu_and_mul", "gelu_and_mul", "rope", "linear_act", "add_layer_norm",
            "decode_attention"} <= BIND  # fmt: skip
    assert not {"qkv", "gate_up"} & BIND  # these keep their layout patchers


# ------------------------------------------------------------------------------------------------------------ helpers


def lm(name: str) -> tuple[nn.Module, torch.Tensor]:
    """A tiny preset (eval mode) and its 8-token prompt. Norm weights are drawn away from 1 (and biases from 0), so
    that a kernel handed the wrong weight, or none, shows in the logits."""
    torch.manual_seed(0)
    workload = build_workload(resolve_model(name), torch.device("cpu"), torch.float32, prompt_len=8, decode_steps=2)
    model = workload.module.eval()
    with torch.no_grad():
        for module in model.modules():
            if "Norm" in type(module).__name__:
                for pname, p in module.named_parameters(recurse=False):
                    p.uniform_(0.5, 1.5) if pname == "weight" else p.normal_(0.0, 0.1)
    return model, workload.inputs[0]


def prefill_and_decode(
    model: nn.Module, ids: torch.Tensor, token: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prompt logits, logits of one more token through the cache the prompt filled, that token): the token is the
    prompt's argmax unless given (pass the unpatched model's, so that both decode the same token)."""
    params = inspect.signature(type(model).forward).parameters
    cache_kw = "cache" if "cache" in params else "past_key_values"  # transformers ≥5.24 renamed it
    with torch.inference_mode():
        out = model(ids, use_cache=True)
        cache = getattr(out, "cache", None)
        cache = out.past_key_values if cache is None else cache
        token = out.logits[:, -1:].argmax(-1) if token is None else token
        step = model(token, use_cache=True, **{cache_kw: cache})
    return out.logits, step.logits, token


def decoding(ids: torch.Tensor, token: torch.Tensor) -> Callable[[nn.Module], object]:
    """`patch`'s example call: the prefill and decode step a test then compares (`prefill_and_decode` of `token`), so
    that the graphs made when the patch is made are the ones the test runs. The default example's graphs (a 4-token
    prompt, three prefills and a decode step) are not, and the test's calls would be captured and rewritten again."""
    return lambda model: prefill_and_decode(model, ids, token)


def assert_logits_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32 kernels against eager fp32: 1e-4 of the logits' scale."""
    scale = max(1.0, want.abs().max().item())
    torch.testing.assert_close(got, want, atol=1e-4 * scale, rtol=0)


def instance_forwards(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if "forward" in vars(m)]


def assert_consistent(r: PatchResult) -> None:
    """A site is applied or skipped with a reason, never both; every skipped fusion says why."""
    for fusion, paths in r.skipped_paths.items():
        assert not set(paths) & set(r.applied.get(fusion, [])), fusion
        assert all(reason.strip() for reason in paths.values()), fusion
        assert fusion in r.skipped and r.skipped[fusion].strip()
    assert set(r.skipped) == set(r.skipped_paths)
    assert set(r.rewritten) <= set(r.applied)


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    """Each test starts from dynamo's initial state: compiled code and automatic-dynamic decisions are kept per code
    object, and transformers' models share their forward's decorator code, so one test's graphs would otherwise
    steer the next one's capture (`test_patching_a_second_model_of_the_same_class_still_captures` pins that down)."""
    torch._dynamo.reset()


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> collections.Counter:
    """Counts calls of the bundled kernels. The graph's fused_* functions import their kernel from
    `fusionscope.kernels` at call time (the binding holds the fused_* function, not the kernel), so wrapping the
    package's attribute counts every launch the rewritten graph makes. An rms_norm launch that also adds a residual
    (a post-norm's add, taken with the norm) counts under "rms_norm" and again under "rms_norm+residual"; an
    add_layer_norm_pair launch that also makes the sum's first add, under "add_layer_norm_pair+addend". A GLU folded
    into the down_proj's GEMV (`rewrite.fold_prologues`) counts under "gemv_gated"."""
    counts: collections.Counter = collections.Counter()
    for name in KERNELS:
        kernel = getattr(fusionscope.kernels, name)

        def counted(*args, _kernel: Callable = kernel, _name: str = name, **kwargs):
            counts[_name] += 1
            for extra in ("residual", "addend"):
                if kwargs.get(extra) is not None:
                    counts[f"{_name}+{extra}"] += 1
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(fusionscope.kernels, name, counted)
    return counts


# ------------------------------------------------------------------------------------------------------------ families


@pytest.mark.parametrize("family", FAMILIES)
def test_graph_patch_covers_every_bind_site_on_each_family(family: str) -> None:
    model, ids = lm(family)
    sites = find_sites(model)
    found = BIND & set(sites)
    assert found, f"the finder found no bindable fusion in {family}"
    ref_prefill, ref_decode, token = prefill_and_decode(model, ids)

    with patch(model, example=decoding(ids, token)) as r:
        assert r.capture == ""
        assert_consistent(r)
        # decode_attention reads a static cache; under the DynamicCache of this run it is skipped, for that reason
        if "decode_attention" in found:
            assert "static cache" in r.skipped["decode_attention"], r.skipped
            found = found - {"decode_attention"}
        assert set(r.rewritten) == found
        for fusion in sorted(found):
            skipped = r.skipped_paths.get(fusion, {})
            for path, reason in skipped.items():
                assert not any(w in reason for w in LAYOUT_WORDS), f"{fusion} at {path}: {reason}"
            applied = r.applied.get(fusion, [])
            assert applied, fusion
            assert set(applied) | set(skipped) == set(sites[fusion]), fusion
        assert instance_forwards(model), "the captured module's forward is bound on its instance"
        prefill, decode, _ = prefill_and_decode(model, ids, token)
        assert_logits_close(prefill, ref_prefill)
        assert_logits_close(decode, ref_decode)

    assert instance_forwards(model) == []
    prefill, decode, _ = prefill_and_decode(model, ids, token)
    assert torch.equal(prefill, ref_prefill)
    assert torch.equal(decode, ref_decode)


@pytest.mark.parametrize("family", FAMILIES)
def test_what_the_rewrite_removes_is_what_the_estimate_counts(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The estimate counts, per match, the nodes the rewrite of a captured graph removes (`Match.counted`): the group,
    what its binding takes beyond it (a partial rotary's re-join, a static cache's writes) and what is then left
    without a reader (the attention's mask). On every family's prefill and decode graphs under a static cache, every
    node counted is one the rewrite removed, and what it removed without counting is at most the two `arange`s whose
    readers the recorder cannot see (a captured graph's `detach` of the mask's positions, read by nobody recorded)."""
    from fusionscope.apply import numerics, rewrite

    seen: list[tuple[set[int], set[int], Graph]] = []
    original = rewrite.rewrite_graph

    def recording(gm, fakes, prefix, sites, results, root=""):
        traced = rewrite.trace_dataflow(gm, fakes, prefix, root)
        graph = Graph(traced.nodes)
        matches = [m for m in find_matches(graph, among=sites) if not m.rejected]
        original(gm, fakes, prefix, sites, results, root)
        alive, ids = set(gm.graph.nodes), traced.nodes["node"].tolist()
        views = graph.column("is_view", False)
        removed = {ids[row] for row, node in traced.row_fx.items() if node is not None and node not in alive}
        counted = {n for m in matches if not sites[m.fusion] or m.anchor_module in sites[m.fusion] for n in m.counted}
        seen.append(({n for n in removed if not views[n]}, {n for n in counted if not views[n]}, graph))

    monkeypatch.setattr(rewrite, "rewrite_graph", recording)
    torch.manual_seed(0)
    workload = build_workload(resolve_model(family), torch.device("cpu"), torch.float32, prompt_len=8,
                              decode_steps=2, cache="static")  # fmt: skip
    model, ids = workload.module.eval(), workload.inputs[0]
    sites = find_sites(model)
    where = [{"fusion": f, "module_paths": sites[f]} for f in BIND & set(sites)]
    with patch(model, where, example=lambda patched: numerics.reference(patched, ids, 2, cache="static")) as r:
        assert r.capture == "" and r.skipped == {}, (r.capture, r.skipped)
    assert len(seen) == 2  # the prompt's graph and the decode step's
    beyond = 0
    for removed, counted, graph in seen:
        assert counted and counted <= removed, collections.Counter(graph.name[n] for n in counted - removed)
        missed = collections.Counter(graph.name[n] for n in removed - counted)
        assert set(missed) <= {"aten::arange"} and missed["aten::arange"] <= 2, missed
        matched = {n for m in find_matches(graph) if not m.rejected for n in m.nodes}
        beyond += len(counted - matched)
    assert beyond > 0  # what the matches alone would have left out, counted now


@pytest.mark.parametrize("family", FAMILIES)
def test_every_bind_fusion_including_decode_attention_on_a_static_cache(family: str, calls) -> None:
    """Under transformers' static cache (what `apply --graphs` runs) decode_attention joins the graph patch too: every
    fusion the finder found that can bind is patched at every site, one decode_attention launch per layer and decode
    step, and the prompt and decode logits are those of the unpatched model on the same cache. The patch's example
    makes the checked run's calls, so the graphs it captures are the ones the count then runs."""
    from fusionscope.apply import numerics

    torch.manual_seed(0)
    workload = build_workload(resolve_model(family), torch.device("cpu"), torch.float32, prompt_len=8,
                              decode_steps=2, cache="static")  # fmt: skip
    model = workload.module.eval()
    ids = workload.inputs[0]
    ref = numerics.reference(model, ids, 2, cache="static")
    sites = find_sites(model)
    found = BIND & set(sites)
    assert "decode_attention" in found, sites

    def example(patched: nn.Module) -> None:
        numerics.reference(patched, ids, 2, cache="static")

    where = [{"fusion": f, "module_paths": sites[f]} for f in found]
    slots: list[tuple[int, bool]] = []  # each rope_and_cache call's positions' dims (0: the cache's write counter)
    # and whether the kernel advances that counter
    counted = fusionscope.kernels.rope_and_cache

    def recording(*args, **kwargs):
        slots.append((args[7].dim(), kwargs.get("advance", False)))
        return counted(*args, **kwargs)

    with patch(model, where, example=example) as r, pytest.MonkeyPatch.context() as mp:
        assert r.capture == "" and r.skipped == {}, (r.capture, r.skipped)
        assert set(r.rewritten) == found
        assert all(set(r.applied[f]) == set(sites[f]) for f in found)
        calls.clear()
        mp.setattr(fusionscope.kernels, "rope_and_cache", recording)
        test = numerics.reference(model, ids, 2, cache="static")
        layers = len(sites["decode_attention"])
        assert calls["decode_attention"] == 2 * layers  # two decode steps, one launch per attention layer
        # rope takes the static cache's writes of k and v: one rope_and_cache per layer and forward (prefill too)
        assert calls["rope_and_cache"] == 3 * layers and calls["rope"] == 0, calls
        # ... the slots read from the cache's write counter (a 0-d `positions`), which the kernel advances:
        # StaticLayer's arange and add that make them per layer and forward, and its add_, are replaced too
        assert slots == [(0, True)] * 3 * layers, slots
        # OLMo-2's post-norms take their residual add (all but the last, whose add feeds the final norm): 3 a forward
        assert calls["rms_norm+residual"] == (3 * (2 * layers - 1) if family == "tiny-olmo2" else 0), calls
    fig = numerics.compare(test, ref)
    assert fig["max_abs"] <= 1e-4 * max(1.0, fig["ref_scale"]) and fig["tokens_equal"] == 1.0, fig


def test_rewritten_llama_graph_calls_the_kernels(calls: collections.Counter) -> None:
    # tiny-llama has 2 decoder layers: x += attn(input_layernorm(x)); x += mlp(post_attention_layernorm(x)), then
    # model.norm(x). The first input_layernorm has no add before it: one rms_norm. Every other norm follows a residual
    # add: layer 0's post-attention norm, layer 1's input and post-attention norms, and the final norm — 2·2 - 1 + 1
    # = 4 add_rms_norm. One silu_and_mul per MLP and one rope per attention: 2 each. Prefill and decode alike.
    # No rms_norm takes a residual ("rms_norm+residual" absent): a pre-norm's output feeds the projections, not an add.
    per_forward = {"rms_norm": 1, "add_rms_norm": 4, "silu_and_mul": 2, "rope": 2}
    model, ids = lm("tiny-llama")
    ref_prefill, ref_decode, token = prefill_and_decode(model, ids)
    assert sum(calls.values()) == 0  # the unpatched model launches none

    def example(patched: nn.Module) -> None:  # the calls counted below, so that their graphs are captured here
        with torch.inference_mode():
            patched(ids)
        decoding(ids, token)(patched)

    with patch(model, example=example) as r:
        assert set(per_forward) <= set(r.rewritten)
        for phase in ("prefill", "decode"):
            calls.clear()
            with torch.inference_mode():
                if phase == "prefill":
                    logits = model(ids).logits
                    assert_logits_close(logits, ref_prefill)
                else:
                    prefill_and_decode(model, ids, token)  # counted twice: a prefill, then a decode step
            want = per_forward if phase == "prefill" else {k: 2 * v for k, v in per_forward.items()}
            assert dict(calls) == want, phase
        calls.clear()
        model.train()  # the kernels keep no autograd history: a training-mode forward takes the class's forward
        try:
            with torch.no_grad():
                model(ids)
        finally:
            model.eval()
        assert sum(calls[k] for k in per_forward) == 0

    calls.clear()
    prefill, decode, _ = prefill_and_decode(model, ids, token)
    assert sum(calls.values()) == 0
    assert torch.equal(prefill, ref_prefill) and torch.equal(decode, ref_decode)


def test_neoxs_two_norms_of_one_residual_are_one_launch(calls: collections.Counter) -> None:
    """GPT-NeoX's parallel block normalises the sum closing a layer twice (the next layer's attention and MLP norms,
    each with its own weight and bias): one add_layer_norm_pair launch replaces the add and both, and the sum's
    first add (`mlp + attention`, then `+ hidden`) too. tiny-neox, per forward: layer 1's pair; the final norm's
    single add_layer_norm; layer 0's two norms read the embeddings, no add, and stay aten's."""
    model, ids = lm("tiny-neox")
    ref_prefill, ref_decode, token = prefill_and_decode(model, ids)
    with patch(model, ["add_layer_norm"], example=decoding(ids, token)) as r:
        assert r.rewritten == ["add_layer_norm"]
        assert set(r.applied["add_layer_norm"]) == {"gpt_neox.layers.1.input_layernorm", "gpt_neox.final_layer_norm"}
        prefill, decode, _ = prefill_and_decode(model, ids, token)  # on the graphs the example captured
        calls.clear()
        with torch.profiler.profile() as prof:
            prefill_and_decode(model, ids, token)
        assert calls["add_layer_norm_pair"] == 2 and calls["add_layer_norm"] == 2, calls  # prefill and decode
        assert calls["add_layer_norm_pair+addend"] == 2, calls
        norms = [e for e in prof.events() if e.name == "aten::native_layer_norm"]
        assert len(norms) == 4, len(norms)  # layer 0's two norms, in the prompt's forward and the decode step's
        assert_logits_close(prefill, ref_prefill)
        assert_logits_close(decode, ref_decode)


def test_patch_without_where_patches_every_fusion_found() -> None:
    model, ids = lm("tiny-llama")
    sites = find_sites(model)
    with torch.inference_mode():
        ref = model(ids).logits
    with patch(model) as r:  # no `where`: the finder runs on the model itself
        # the default example decodes on a DynamicCache, which decode_attention does not read (a static cache does)
        assert set(r.skipped) == {"decode_attention"} and "static cache" in r.skipped["decode_attention"], r.skipped
        del sites["decode_attention"]
        assert {f: sorted(p) for f, p in r.applied.items()} == {f: sorted(p) for f, p in sites.items()}
        with torch.inference_mode():
            assert_logits_close(model(ids).logits, ref)


# ------------------------------------------------------------------------------------------------------------ factory


def test_gelu_factory_patches_linear_act_and_add_layer_norm_on_the_graph(calls: collections.Counter) -> None:
    torch.manual_seed(0)
    workload = build_workload(
        resolve_model("examples/gelu_mlp.py:factory"), torch.device("cpu"), torch.float32, prompt_len=8,
        decode_steps=2,
    )  # fmt: skip
    assert workload.phases == ("forward",)
    model, inputs = workload.module.eval(), workload.inputs
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0.0, 0.1)
    nodes = dataflow.record_dataflow(workload)
    matches = [m for m in find_matches(Graph(nodes.assign(op_id=-1))) if not m.rejected]
    sites = sites_by_fusion(matches)
    # c_fc + GELU in each block; the residual add of block 0 into block 1's LayerNorm, and of block 1 into ln_f
    # (block 0's LayerNorm has no add before it)
    assert sorted(sites.get("linear_act", [])) == ["blocks.0.c_fc", "blocks.1.c_fc"]
    assert sorted(sites.get("add_layer_norm", [])) == ["blocks.1.ln", "ln_f"]
    with torch.inference_mode():
        ref = model(*inputs)

    where = [{"fusion": f, "module_paths": sites[f]} for f in ("linear_act", "add_layer_norm")]
    with torch.inference_mode(), patch(model, where=where, example=lambda m: m(*inputs)) as r:
        assert r.capture == ""
        assert_consistent(r)
        assert sorted(r.rewritten) == ["add_layer_norm", "linear_act"]
        assert r.skipped == {}
        for fusion in ("linear_act", "add_layer_norm"):
            assert sorted(r.applied[fusion]) == sorted(sites[fusion])
        calls.clear()
        got = model(*inputs)
        assert dict(calls) == {"linear_act": 2, "add_layer_norm": 2}
        assert_logits_close(got, ref)

    assert instance_forwards(model) == []
    with torch.inference_mode():
        assert torch.equal(model(*inputs), ref)


def test_a_factorys_forward_beside_torch_compile_and_fused_compile(calls: collections.Counter) -> None:
    """A one-forward workload (no decode step for --graphs) is set beside torch.compile and fused + compile
    (`apply.forward_compile`): each compiled forward stands in for the instance's forward only while it is checked
    and timed, passes the eager model's numerics, and is timed with the eager baseline in the same rounds; fused +
    compile runs the bundled kernels inside the compiled graph. On the CPU the path runs without Inductor ("eager")."""
    from fusionscope.apply import numerics
    from fusionscope.apply.forward_compile import BASELINE, COMPILE, FUSED_COMPILE, compare_compiled

    torch.manual_seed(0)
    workload = build_workload(resolve_model("examples/gelu_mlp.py:factory"), torch.device("cpu"), torch.float32)
    model, inputs = workload.module.eval(), workload.inputs
    nodes = dataflow.record_dataflow(workload)
    sites = sites_by_fusion(m for m in find_matches(Graph(nodes.assign(op_id=-1))) if not m.rejected)
    fused_sites = {f: sites[f] for f in ("linear_act", "add_layer_norm")}
    ref = numerics.forward_reference(model, inputs)
    with torch.inference_mode():
        before = model(*inputs)
    calls.clear()
    result = compare_compiled(workload, fused_sites, ref, ref, numerics.compare(ref, ref), False, 2,
                              lambda _msg: None, mode="eager")  # fmt: skip
    rows = result["variants"]
    assert set(rows) == {BASELINE, COMPILE, FUSED_COMPILE}
    for name, row in rows.items():
        assert row["passed"], (name, row)
        assert len(row["wall_ms_rounds"]) == 2 and row["wall_ms"] > 0 and row["speedup_vs_eager"] > 0
    assert rows[FUSED_COMPILE]["fusions"] == ["add_layer_norm", "linear_act"]
    assert calls["linear_act"] >= 2 and calls["add_layer_norm"] >= 2, calls  # inside the compiled forward
    assert result["fused_compile_vs_compile"] == rows[COMPILE]["wall_ms"] / rows[FUSED_COMPILE]["wall_ms"]
    assert "forward" not in vars(model)  # the instance as it was
    with torch.inference_mode():
        assert torch.equal(model(*inputs), before)
    from fusionscope.cli import out, print_compiled
    from fusionscope.report.apply import compiled_table

    page = compiled_table(result)
    assert page.count("passed: ") == 3 and "fused + compile vs torch.compile" in page
    with out.capture() as terminal:
        print_compiled(result)
    assert "fused + compile vs torch.compile" in terminal.get() and "torch.compile" in terminal.get()

    torch._dynamo.reset()
    nothing = compare_compiled(workload, {}, ref, ref, numerics.compare(ref, ref), False, 1, lambda _msg: None,
                               mode="eager")  # fmt: skip
    assert not nothing["variants"][FUSED_COMPILE]["passed"] and "binds" in nothing["variants"][FUSED_COMPILE]["reason"]
    assert nothing["variants"][COMPILE]["wall_ms"] > 0 and nothing["fused_compile_vs_compile"] is None


# ------------------------------------------------------------------------------------------------------------ fallback


class ChainNorm(nn.Module):
    """An RMSNorm written out (fp32, pow, mean, + ε, rsqrt, ×, × weight): a copy of LlamaRMSNorm.forward, which the
    layout patcher knows."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(hidden) + 0.5)
        self.variance_epsilon = 1e-6

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class OtherChainNorm(ChainNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # the same chain, a signature no layout table has
        dtype = x.dtype
        h = x.to(torch.float32)
        var = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(var + self.variance_epsilon)
        return self.weight * h.to(dtype)


class Branchy(nn.Module):
    """A forward with data-dependent Python control flow: dynamo cannot capture it as one graph."""

    def __init__(self, norm: type[ChainNorm], hidden: int = 32) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)
        self.norm = norm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        if x.sum() > 0:
            x = x * 2
        return self.norm(x)


@pytest.mark.parametrize("norm", [ChainNorm, OtherChainNorm])
def test_uncapturable_forward_falls_back_and_says_why(norm: type[ChainNorm]) -> None:
    torch.manual_seed(0)
    model = Branchy(norm).eval()
    x = torch.randn(2, 4, 32)
    workload = Workload(spec=ModelSpec(name="branchy", source="module"), module=model, device=torch.device("cpu"),
                        dtype=torch.float32, phases=("forward",), inputs=(x,))  # fmt: skip
    matches = [m for m in find_matches(Graph(dataflow.record_dataflow(workload).assign(op_id=-1))) if not m.rejected]
    assert sites_by_fusion(matches) == {"rms_norm": ["norm"]}  # the finder sees the chain
    with torch.inference_mode():
        ref = model(x)

    where = [{"fusion": "rms_norm", "module_paths": ["norm"]}]
    with torch.inference_mode(), patch(model, where=where, example=lambda m: m(x)) as r:
        assert r.capture, "the failed capture is reported"
        assert "\n" not in r.capture and "Branchy" in r.capture, r.capture
        assert r.rewritten == []
        assert_consistent(r)
        applied, skipped = r.applied.get("rms_norm", []), r.skipped_paths.get("rms_norm", {})
        assert sorted(applied + list(skipped)) == ["norm"]  # the layout patcher either patched the site or said why
        if norm is ChainNorm:
            assert applied == ["norm"]  # a copy of LlamaRMSNorm.forward: the layout patcher takes it
        assert "forward" not in vars(model), "the failed capture's forward is rolled back"
        assert_logits_close(model(x), ref)

    assert instance_forwards(model) == []
    with torch.inference_mode():
        assert torch.equal(model(x), ref)


# ------------------------------------------------------------------------------------------------------------ layout


def test_rewrite_false_takes_the_layout_path() -> None:
    # OLMo-2 normalises after the branches: the layout patchers refuse its norms and attention, the graph does not
    model, ids = lm("tiny-olmo2")
    with torch.inference_mode():
        ref = model(ids).logits
    with patch(model, rewrite=False) as r:
        assert r.rewritten == [] and r.capture == ""
        assert_consistent(r)
        assert "rms_norm" in r.skipped and any(w in r.skipped["rms_norm"] for w in LAYOUT_WORDS), r.skipped
        assert "forward" not in vars(model.model), "nothing captured"
        with torch.inference_mode():
            assert_logits_close(model(ids).logits, ref)
    assert instance_forwards(model) == []


# ------------------------------------------------------------------------------------------------------------ state


class EpsNet(nn.Module):
    def __init__(self, eps: float, hidden: int = 32) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)
        self.norm = ChainNorm(hidden)
        self.norm.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x))


def test_patching_a_second_model_of_the_same_class_still_captures() -> None:
    # Two models of one class (one forward code object) whose norms' ε differ, patched one after the other (as
    # tiny-phi3, ε 1e-5, then tiny-qwen3, ε 1e-6: their forwards share transformers' decorator code). The second
    # capture must not depend on the first: ε stays a constant of the graph the finder and bind read it from.
    torch.manual_seed(0)
    x = torch.randn(2, 4, 32)
    where = [{"fusion": "rms_norm", "module_paths": ["norm"]}]
    for eps in (1e-5, 1e-6):
        model = EpsNet(eps).eval()
        with torch.inference_mode():
            ref = model(x)
        with torch.inference_mode(), patch(model, where=where, example=lambda m: m(x)) as r:
            assert r.capture == "", f"ε={eps}: {r.capture}"
            assert r.rewritten == ["rms_norm"] and r.applied == {"rms_norm": ["norm"]}
            assert_logits_close(model(x), ref)
        assert instance_forwards(model) == []


def test_patching_many_models_of_one_class_keeps_capturing(calls: collections.Counter) -> None:
    # A long process (a test session, a sweep) patches model after model; those of one class share their forward's
    # code object, on which dynamo keeps each patch's compiled graphs. More models than the recompile limit allows
    # graphs must each still be captured and rewritten (or, at the least, fall back with a reason; never raise).
    from fusionscope.apply import rewrite

    limit = max(torch._dynamo.config.recompile_limit, getattr(rewrite, "RECOMPILE_LIMIT", 0))
    x = torch.randn(1, 2, 16)
    where = [{"fusion": "rms_norm", "module_paths": ["norm"]}]
    for i in range(limit + 4):
        model = EpsNet(1e-6, hidden=16).eval()
        with torch.inference_mode(), patch(model, where=where, example=lambda m: m(x)) as r:
            assert r.capture == "", f"model {i}: {r.capture}"
            calls.clear()
            model(x)
            assert calls["rms_norm"] == 1, f"model {i}"


# ------------------------------------------------------------------------------------------------------- edge cases


def graph_patch(model: nn.Module, x: torch.Tensor) -> tuple[PatchResult, torch.Tensor, torch.Tensor]:
    """(what the graph patch of every site the finder finds in `model` did, the unpatched output, the patched one)."""
    model.eval()
    workload = Workload(spec=ModelSpec(name="toy", source="module"), module=model, device=torch.device("cpu"),
                        dtype=x.dtype, phases=("forward",), inputs=(x,))  # fmt: skip
    found = [m for m in find_matches(Graph(dataflow.record_dataflow(workload).assign(op_id=-1))) if not m.rejected]
    where = [{"fusion": f, "module_paths": p} for f, p in sites_by_fusion(found).items()]
    with torch.inference_mode():
        ref = model(x)
    with torch.inference_mode(), patch(model, where, example=lambda m: m(x)) as r:
        got = model(x)
    return r, ref, got


class Glu(nn.Module):
    """A GLU MLP; `write_gate`: the gate written in place after SiLU read it (eager multiplies the pre-write SiLU)."""

    def __init__(self, write_gate: bool = False) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(32, 64), nn.Linear(32, 64), nn.Linear(64, 32)
        self.write_gate = write_gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate(x), self.up(x)
        a = F.silu(g)
        if self.write_gate:
            g.mul_(2.0)
            return self.down(a * u) + self.down(g)
        return self.down(a * u)


class RootGlu(Glu):
    """The GLU written in the model's own forward: the profile names its site by the class name."""


def test_a_glu_in_the_models_own_forward_is_patched() -> None:
    r, ref, got = graph_patch(RootGlu(), torch.randn(2, 4, 32))
    assert r.applied == {"silu_and_mul": ["RootGlu"]} and r.rewritten == ["silu_and_mul"], r.skipped
    assert_logits_close(got, ref)


def test_an_in_place_write_between_the_groups_ops_keeps_it_unfused() -> None:
    model = nn.Sequential(Glu(write_gate=True), nn.Linear(32, 32))
    r, ref, got = graph_patch(model, torch.randn(2, 4, 32))
    assert "in-place write" in r.skipped.get("silu_and_mul", ""), r.skipped
    assert torch.equal(got, ref)


class ParallelNorms(nn.Module):
    """GPT-NeoX's two LayerNorms of one residual sum, with `p` written in place between them: the pair's group (the
    add and both norms) spans that write to one of its inputs, the add and the first norm alone do not."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.ln1, self.ln2 = nn.Linear(32, 32), nn.LayerNorm(32), nn.LayerNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.proj(x)
        h = x + p
        a = self.ln1(h)
        p.mul_(2.0)
        return a + self.ln2(h) + p


def test_a_pair_the_graph_refuses_falls_back_to_its_first_norm(calls: collections.Counter) -> None:
    model = ParallelNorms()
    for norm in (model.ln1, model.ln2):
        nn.init.normal_(norm.weight, 1.0, 0.2), nn.init.normal_(norm.bias, 0.0, 0.2)
    r, ref, got = graph_patch(model, torch.randn(2, 4, 32))
    assert r.applied == {"add_layer_norm": ["ln1"]}, (r.applied, r.skipped)
    assert calls["add_layer_norm"] == 2 and calls["add_layer_norm_pair"] == 0, calls  # the example call, then ours
    assert_logits_close(got, ref)


class RotaryBSHD(nn.Module):
    """q and k as (B, S, H, D), cos/sin unsqueezed on dim 2: a layout the rope kernel does not take."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k = x.view(b, s, 4, 8), (2 * x).view(b, s, 4, 8)
        angles = torch.arange(s, dtype=x.dtype)[:, None] * torch.arange(8, dtype=x.dtype)[None, :]
        cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]

        def half(t: torch.Tensor) -> torch.Tensor:
            return torch.cat((-t[..., 4:], t[..., :4]), dim=-1)

        q_embed = (q * cos) + (half(q) * sin)
        k_embed = (k * cos) + (half(k) * sin)
        return (q_embed + k_embed).reshape(b, s, -1)


def test_rope_on_positions_by_heads_is_refused_not_misread() -> None:
    model = nn.Sequential(RotaryBSHD(), nn.Linear(32, 32))
    r, ref, got = graph_patch(model, torch.randn(2, 4, 32))  # S == H == 4: a misread layout would still run
    assert "rope" not in r.applied and "positions" in r.skipped.get("rope", ""), (r.applied, r.skipped)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("family", ["tiny-phi3", "tiny-neox"])
def test_partial_rotarys_split_and_rejoin_go_with_the_rope(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Phi-3 (Dr = D, an empty pass-through) and GPT-NeoX (Dr = D/4) split q and k, rotate the first part and `cat`
    the rest back on. The rope call takes the whole q and k, so per layer its 4 cats go (rotate_half's two and the
    two re-joins), where a rope that left the re-join would take only 2; the DynamicCache's appends and the rotary
    table's cat stay."""
    from fusionscope.apply import rewrite

    counts: list[tuple[int, int]] = []
    original = rewrite.rewrite_graph

    def cats(gm: torch.fx.GraphModule) -> int:
        return sum(n.op == "call_function" and n.target in (torch.cat, torch.concat) for n in gm.graph.nodes)

    def counted(gm: torch.fx.GraphModule, *args, **kwargs) -> None:
        before = cats(gm)
        original(gm, *args, **kwargs)
        counts.append((before, cats(gm)))

    monkeypatch.setattr(rewrite, "rewrite_graph", counted)
    model, ids = lm(family)
    ref_prefill, ref_decode, token = prefill_and_decode(model, ids)
    sites = find_sites(model)["rope"]
    layers = len(sites)
    with patch(model, example=decoding(ids, token)) as r:
        assert set(r.applied["rope"]) == set(sites)
        prefill, decode, _ = prefill_and_decode(model, ids, token)
    assert counts and all(before - after == 4 * layers for before, after in counts), (counts, layers)
    assert_logits_close(prefill, ref_prefill)
    assert_logits_close(decode, ref_decode)


def test_olmo2s_fp32_rotary_tables_in_bf16(calls: collections.Counter) -> None:
    """OLMo-2 keeps cos/sin in fp32: with bf16 activations its rotation runs in fp32 and is cast back
    (`q_embed.to(q_type)`). rope's binding takes that cast with the chain (the kernel rounds once, as the cast does),
    so a bf16 OLMo-2 is patched at every rope site, one launch per layer, and decodes as the unpatched model does."""
    model, ids = lm("tiny-olmo2")
    model = model.to(torch.bfloat16)
    sites = find_sites(model)["rope"]
    ref_prefill, ref_decode, token = prefill_and_decode(model, ids)
    with patch(model, [{"fusion": "rope", "module_paths": sites}], example=decoding(ids, token)) as r:
        assert r.applied.get("rope") and set(r.applied["rope"]) == set(sites), r.skipped
        calls.clear()
        prefill, decode, _ = prefill_and_decode(model, ids, token)
        assert calls["rope"] == 2 * len(sites)  # the prompt and one decode step
    for got, want in ((prefill, ref_prefill), (decode, ref_decode)):
        scale = max(1.0, want.float().abs().max().item())
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2 * scale, rtol=0)


def _two_cast_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, dtype: str,
                   upcast: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """`fused_rms_norm` as the upcast binding was before the kernel's weight_in_fp32 mode: the kernel on `x.float()`,
    its fp32 result cast back (the baseline of the count below); a post-norm's residual added after, as aten adds."""
    assert upcast, "every OLMo-2 norm multiplies by its weight before the cast"
    out = fusionscope.kernels.rms_norm(x.float(), weight, eps, offset).to(getattr(torch, dtype))
    return out if residual is None else residual + out


def test_olmo2s_norms_in_bf16_dispatch_no_casts(calls: collections.Counter, monkeypatch: pytest.MonkeyPatch) -> None:
    """OLMo-2's norm ends `(weight * x̂).to(dtype)`, x̂ in fp32 (`norm_operands`' upcast): the binding runs the kernel's
    weight_in_fp32 mode on x as it is, one launch, where it used to run the kernel on `x.float()` and cast the result
    back: two copy kernels around each of the 128 norms of OLMo-2-7B's decode step on the H200. On a bf16 tiny OLMo-2
    with every rms_norm and add_rms_norm site patched, a prefill and a decode step dispatch 2 `aten::_to_copy` fewer
    per site and forward than the same captured graph with that two-cast binding, with the same logits bit for bit,
    and decode as the unpatched model does. (The unpatched model is no baseline for the count: on the CPU its eager
    norms also cast scalars and the weight, which the captured graph does not.)"""
    from fusionscope.fusions import add_rms_norm as add_rms_norm_fusion
    from fusionscope.fusions import rms_norm as rms_norm_fusion

    model, ids = lm("tiny-olmo2")
    model = model.to(torch.bfloat16)
    sites = find_sites(model)
    where = [{"fusion": f, "module_paths": sites[f]} for f in ("rms_norm", "add_rms_norm")]
    n_sites = len(sites["rms_norm"]) + len(sites["add_rms_norm"])
    assert len(sites["rms_norm"]) == 8 and n_sites == 9  # q_norm, k_norm and the two post-norms of 2 layers; final
    ref_prefill, ref_decode, token = prefill_and_decode(model, ids)

    def casts_per_run() -> tuple[int, tuple[torch.Tensor, torch.Tensor]]:
        torch._dynamo.reset()  # the other binding's graphs must not be reused
        with patch(model, where, example=decoding(ids, token)) as r:  # the captures and rewrites: not counted
            for fusion in ("rms_norm", "add_rms_norm"):
                assert set(r.applied.get(fusion, [])) == set(sites[fusion]), r.skipped
            calls.clear()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                prefill, decode, _ = prefill_and_decode(model, ids, token)
        assert calls["rms_norm"] == 2 * n_sites and calls["add_rms_norm"] == 0  # one launch a site and forward
        return sum(e.name == "aten::_to_copy" for e in prof.events()), (prefill, decode)

    casts, got = casts_per_run()
    with monkeypatch.context() as m:
        m.setattr(rms_norm_fusion, "fused_rms_norm", _two_cast_norm)
        m.setattr(add_rms_norm_fusion, "fused_rms_norm", _two_cast_norm)
        casts_before, got_before = casts_per_run()
    assert casts_before - casts == 2 * n_sites * 2, (casts_before, casts, n_sites)  # 2 per site, 2 forwards
    for new, old in zip(got, got_before):
        assert torch.equal(new, old)  # one rounding of the same fp32 product either way
    for new, want in zip(got, (ref_prefill, ref_decode)):
        scale = max(1.0, want.float().abs().max().item())
        torch.testing.assert_close(new.float(), want.float(), atol=2e-2 * scale, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_olmo2s_post_norms_take_their_residual_add(dtype: torch.dtype, calls: collections.Counter,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """OLMo-2 normalises after each sublayer, `h = residual + post_attention_layernorm(attn_out)`: the rms_norm binding
    takes that add, one launch writes `residual + norm`. On the tiny OLMo-2 (2 layers, 4 post-norms) with the rms_norm
    and add_rms_norm sites patched, per forward: 3 post-norms launch with the residual (the last post-feedforward
    norm's add feeds the final norm, and add_rms_norm takes an add before a norm), every site is still one rms_norm
    launch, and 3 `aten::add` fewer run than in the same captured graph with the adds left to aten
    (`absorbed_add` off) — with logits bit for bit equal to that graph's (the same two roundings, in the same order)
    and close to the unpatched model's."""
    from fusionscope.fusions import rms_norm as rms_norm_fusion

    model, ids = lm("tiny-olmo2")
    model = model.to(dtype)
    sites = find_sites(model)
    where = [{"fusion": f, "module_paths": sites[f]} for f in ("rms_norm", "add_rms_norm")]
    n_sites = len(sites["rms_norm"]) + len(sites["add_rms_norm"])
    ref_prefill, ref_decode, token = prefill_and_decode(model, ids)

    def run() -> tuple[int, collections.Counter, tuple[torch.Tensor, torch.Tensor]]:
        torch._dynamo.reset()  # the other binding's graphs must not be reused
        with patch(model, where, example=decoding(ids, token)) as r:  # the captures and rewrites: not counted
            for fusion in ("rms_norm", "add_rms_norm"):
                assert set(r.applied.get(fusion, [])) == set(sites[fusion]), r.skipped
            calls.clear()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                prefill, decode, _ = prefill_and_decode(model, ids, token)
        return sum(e.name == "aten::add" for e in prof.events()), collections.Counter(calls), (prefill, decode)

    adds, launched, got = run()
    with monkeypatch.context() as m:
        m.setattr(rms_norm_fusion, "absorbed_add", lambda *args: None)
        adds_before, launched_before, got_before = run()
    forwards = 2  # the prompt and one decode step
    assert launched["rms_norm+residual"] == 3 * forwards and launched_before["rms_norm+residual"] == 0, launched
    launches = launched["rms_norm"] + launched["add_rms_norm"]
    assert launches == launched_before["rms_norm"] + launched_before["add_rms_norm"] == n_sites * forwards
    assert adds_before - adds == 3 * forwards, (adds_before, adds)
    for new, old in zip(got, got_before):
        assert torch.equal(new, old)
    for new, want in zip(got, (ref_prefill, ref_decode)):
        if dtype == torch.float32:
            assert_logits_close(new, want)
        else:
            scale = max(1.0, want.float().abs().max().item())
            torch.testing.assert_close(new.float(), want.float(), atol=2e-2 * scale, rtol=0)


class Weightless(ChainNorm):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return (hidden_states * torch.rsqrt(variance + self.variance_epsilon)).to(input_dtype)


def test_a_weightless_norm_and_a_bias_add_before_a_norm() -> None:
    """A norm without a weight is refused (its input is not a weight); a bias add before a norm is no residual add,
    so the site stays the plain norm the profile found."""

    class Net(nn.Module):
        def __init__(self, weight: bool) -> None:
            super().__init__()
            self.proj, self.norm = nn.Linear(32, 32), ChainNorm(32) if weight else Weightless(32)
            self.bias = nn.Parameter(torch.randn(32))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(self.proj(x) + self.bias)

    r, ref, got = graph_patch(Net(weight=True), torch.randn(2, 4, 32))
    assert r.applied == {"rms_norm": ["norm"]}, r.skipped
    assert_logits_close(got, ref)
    r, ref, got = graph_patch(Net(weight=False), torch.randn(2, 4, 32))
    assert "no weight" in r.skipped.get("rms_norm", ""), r.skipped


class PostNorm(nn.Module):
    """`residual + norm(proj(x))`, OLMo-2's post-norm, in the forms the rms_norm binding must or must not take the
    add of: "plain" (taken), "read-twice" (the norm's output also read elsewhere), "broadcast" (a (1, 1, N) residual),
    "alpha" (`torch.add(r, n, alpha=2)`), "to-norm" (the sum feeds another norm: add_rms_norm's)."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.proj, self.norm, self.after = nn.Linear(32, 32), ChainNorm(32), ChainNorm(32)
        self.bias = nn.Parameter(torch.randn(1, 1, 32))
        self.form = form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.norm(self.proj(x))
        if self.form == "read-twice":
            return (x + n) * n
        if self.form == "broadcast":
            return 2 * (self.proj(self.bias) + n)  # the residual: a computed (1, 1, N) tensor
        if self.form == "alpha":
            return 2 * torch.add(x, n, alpha=2)
        if self.form == "to-norm":
            return self.after(x + n)
        return 2 * (x + n)


@pytest.mark.parametrize("form", ["plain", "read-twice", "broadcast", "alpha", "to-norm"])
def test_a_post_norms_add_is_taken_only_when_safe(form: str, calls: collections.Counter) -> None:
    """The rms_norm binding takes the residual add after a norm only where one kernel writes exactly what the add
    did: the norm's output read by the add alone, a plain add (alpha 1) of one shape, and a sum no other norm reads
    (there add_rms_norm takes the add with that norm). Either way the norm is patched and the output is the model's."""
    r, ref, got = graph_patch(PostNorm(form), torch.randn(2, 4, 32))
    assert "norm" in r.applied.get("rms_norm", []), (r.applied, r.skipped)
    if form == "to-norm":
        assert r.applied.get("add_rms_norm") == ["after"], (r.applied, r.skipped)
    assert calls["rms_norm+residual"] == (2 if form == "plain" else 0), calls  # the example call, then ours
    assert_logits_close(got, ref)


def test_inside_compile_the_gemv_takes_the_linears_qkv_and_gate_up_would_fuse(monkeypatch: pytest.MonkeyPatch) -> None:
    # qkv and gate_up build a fused weight, which no compiled graph holds: fused + compile rewrites with the gemv
    # entry at every site, and the finder, asked for gemv alone, leaves q/k/v and gate/up to it (the whole catalogue
    # gives those GEMMs to qkv and gate_up). tiny-llama's decode step: 7 one-row Linears per layer and the LM head.
    from fusionscope.apply import rewrite

    model, ids = lm("tiny-llama")
    ref_prefill, ref_decode, token = prefill_and_decode(model, ids)
    widths: collections.Counter = collections.Counter()
    gemv = fusionscope.kernels.gemv

    def counted(x, weight, bias=None):
        widths[tuple(weight.shape)] += 1
        return gemv(x, weight, bias)

    monkeypatch.setattr(fusionscope.kernels, "gemv", counted)
    forward, results = rewrite.compile_fused(model, {"gemv": []}, mode="eager")
    cache_kw = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    with torch.inference_mode():
        out = forward(ids, use_cache=True)
        assert not widths  # a prompt of 8 rows is cuBLAS's
        decode = forward(token, use_cache=True, **{cache_kw: getattr(out, cache_kw)}).logits
    assert_logits_close(out.logits, ref_prefill)
    assert_logits_close(decode, ref_decode)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 7 * model.config.num_hidden_layers + 1
    assert widths == collections.Counter(tuple(m.weight.shape) for m in linears), widths  # each once a decode step
    patched = {path.rsplit(".", 1)[-1] for path, why in results["gemv"].items() if why == ""}
    assert {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "o_proj", "down_proj"} <= patched, results
    workload = build_workload(resolve_model("tiny-llama"), torch.device("cpu"), torch.float32, prompt_len=8,
                              decode_steps=2)  # fmt: skip
    graph = Graph(dataflow.record_dataflow(workload).assign(op_id=-1))

    def gemv_linears(matches: list) -> set[str]:
        return {m.anchor_module.rsplit(".", 1)[-1] for m in matches if m.fusion == "gemv"}

    assert {"q_proj", "gate_proj"} <= gemv_linears(find_matches(graph, among={"gemv"}))
    assert not {"q_proj", "gate_proj"} & gemv_linears(find_matches(graph))  # the catalogue's are qkv's and gate_up's


def test_gpt2s_conv1d_mlp_is_patched_on_the_graph() -> None:
    """GPT-2's Conv1D hands its (K, N) weight straight to addmm: linear_act binds it as its transpose."""
    workload = build_workload(resolve_model("gpt2"), torch.device("cpu"), torch.float32, prompt_len=8, decode_steps=1)
    model = workload.module.eval()
    model.transformer.h = model.transformer.h[:2]
    model.config.n_layer = 2
    ref = prefill_and_decode(model, workload.inputs[0])
    with patch(model, ["linear_act"]) as r:
        assert r.rewritten == ["linear_act"] and len(r.applied["linear_act"]) == 2, r.skipped
        got = prefill_and_decode(model, workload.inputs[0], ref[2])
    assert_logits_close(got[0], ref[0])
    assert_logits_close(got[1], ref[1])


# ------------------------------------------------------------------------------------------------------- real weights


def test_smollm2_greedy_tokens_are_the_unpatched_models_for_32_tokens(smollm2: tuple) -> None:
    """Real weights (SmolLM2-135M, fp32): with every fusion the finder finds patched — the bindable ones on the
    captured graph, the kernels in the interpreter — greedy decoding of an English prompt picks the same 32 tokens as
    the unpatched model, and the logits at each of them pass `apply`'s numerics rule against it.

    The patched decode is the patch's example call: run while the patch is made, with every patch already on, it
    captures the graphs it runs on (the prompt's prefill, the first decode step, then decode of any length) once.
    After the default example (three prefills of a 4-token prompt and a decode step, each ~11 s in the interpreter),
    this prompt and cache length would be captured again (~30 s a capture)."""
    from fusionscope.apply import numerics

    model, tokenizer = smollm2
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    ref = numerics.reference(model, ids, decode_steps=31)
    decoded: list[numerics.Reference] = []
    with patch(model, example=lambda m: decoded.append(numerics.reference(m, ids, decode_steps=31))) as r:
        assert r.capture == "" and {"add_rms_norm", "rms_norm", "silu_and_mul", "rope"} <= set(r.rewritten), r
        assert len(r.applied["add_rms_norm"]) == 60  # 30 layers × 2, less the first input norm, plus the final one
    (fused,) = decoded
    assert ref.tokens.shape[1] == 32
    assert torch.equal(fused.tokens, ref.tokens), (tokenizer.decode(fused.tokens[0]), tokenizer.decode(ref.tokens[0]))
    # the logits of all 32 positions by the rule `apply` judges a fusion with (real weights: top-1 and KL; the model
    # is fp32, so the unpatched model is also the fp32 reference)
    fig = numerics.compare(fused, ref)
    ok, why = numerics.judge(fig, fig, numerics.compare(ref, ref), torch.float32, real_weights=True)
    assert ok, why


def test_a_module_reached_through_a_global_counts_as_the_enclosing_module() -> None:
    """transformers ≥ 5.25 with Hugging Face's `kernels` installed makes `apply_rotary_pos_emb` a module-level
    `nn.Module`: dynamo's module stack then ends in `G[...]`, a module outside the model's tree that the profile's
    hooks never saw, so the rope's ops belong to the attention module the finder named."""
    from torch import fx

    from fusionscope.apply.rewrite import module_path

    node = fx.Graph().placeholder("x")
    node.meta["nn_module_stack"] = {
        "a": ("L['self'].layers.0", nn.Module),
        "b": ("L['self'].layers.0.self_attn", nn.Module),
        "c": ("G['__import_transformers_dot_models_dot_llama_dot_modeling_llama'].apply_rotary_pos_emb", nn.Module),
    }
    assert module_path(node, "model") == "model.layers.0.self_attn"
    node.meta["nn_module_stack"] = {"c": ("G['mod'].rotary", nn.Module)}
    assert module_path(node, "model") == "model"


# --------------------------------------------------------------------------------------------------------------- folds


@pytest.fixture
def rewrites(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, dict[str, str]]]:
    """The `results` of each graph rewrite made while the test runs (with FOLDED, which a PatchResult leaves out)."""
    from fusionscope.apply import rewrite

    seen: list[dict[str, dict[str, str]]] = []
    original = rewrite.rewrite_graph

    def recorded(gm: torch.fx.GraphModule, fakes, prefix, sites, results, root="") -> None:
        original(gm, fakes, prefix, sites, results, root)
        seen.append(results)

    monkeypatch.setattr(rewrite, "rewrite_graph", recorded)
    return seen


@pytest.fixture
def folding(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GLU folds switched on (they are opt-in: `fusionscope.fusions.gemv.PROLOGUES`)."""
    from fusionscope.fusions import gemv as gemv_fusion

    monkeypatch.setattr(gemv_fusion, "PROLOGUES", gemv_fusion.GATED_PROLOGUES)


def folded_sites(rewrites: list[dict[str, dict[str, str]]]) -> dict[str, str]:
    from fusionscope.apply.rewrite import FOLDED

    return {site: how for results in rewrites for site, how in results.get(FOLDED, {}).items()}


def test_llamas_silu_and_mul_folds_into_the_down_proj_gemv_at_decode(
    calls: collections.Counter, rewrites: list, monkeypatch: pytest.MonkeyPatch, folding: None
) -> None:
    """tiny-llama, silu_and_mul and gemv patched: at decode each MLP's silu_and_mul, whose output only down_proj reads,
    and down_proj's GEMV become one gemv_gated call (found on the graph's dataflow); the prompt's MLPs (8 rows: no
    GEMV) keep their silu_and_mul. Both sites stay patched, the rewrite lists the fold under FOLDED, and the logits
    are those of the same patch without the fold, bit for bit."""
    from fusionscope.fusions import gemv as gemv_fusion

    model, ids = lm("tiny-llama")
    ref_prefill, ref_decode, token = prefill_and_decode(model, ids)
    sites = find_sites(model)
    where = [{"fusion": f, "module_paths": sites[f]} for f in ("silu_and_mul", "gemv")]
    mlps = sorted(sites["silu_and_mul"])
    assert mlps == ["model.layers.0.mlp", "model.layers.1.mlp"]

    def run() -> tuple[dict[str, str], collections.Counter, tuple[torch.Tensor, torch.Tensor]]:
        torch._dynamo.reset()  # the other run's graphs must not be reused
        rewrites.clear()
        with patch(model, where, example=decoding(ids, token)) as r:
            assert r.skipped == {} and r.applied["silu_and_mul"] == mlps, r.skipped
            assert sorted(r.applied["gemv"]) == sorted(sites["gemv"])
            assert r.folded == folded_sites(rewrites)  # what `patch` tells its caller (apply's site rows)
            calls.clear()
            prefill, decode, _ = prefill_and_decode(model, ids, token)
            launched = collections.Counter(calls)
        return folded_sites(rewrites), launched, (prefill, decode)

    folded, launched, got = run()
    assert folded == {m: f"silu_and_mul folded into the gemv call at {m}.down_proj" for m in mlps}, folded
    assert launched["silu_and_mul"] == 2 and launched["gemv_gated"] == 2, launched  # the prompt's; the decode step's
    monkeypatch.setattr(gemv_fusion, "PROLOGUES", {})
    unfolded, launched, want = run()
    assert unfolded == {} and launched["silu_and_mul"] == 4 and launched["gemv_gated"] == 0, launched
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert_logits_close(got[0], ref_prefill)
    assert_logits_close(got[1], ref_decode)


class GluMlp(nn.Module):
    """A GLU MLP on odd sizes (hidden 32, intermediate 40, 24 out) with SiLU, or Gemma's tanh GELU; `second_reader`:
    the GLU's output is also read by a second Linear."""

    def __init__(self, act: str = "silu", second_reader: bool = False) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(32, 40), nn.Linear(32, 40)
        self.down, self.side = nn.Linear(40, 24), nn.Linear(40, 24)
        self.act, self.second_reader = act, second_reader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.gate(x)
        a = (F.silu(g) if self.act == "silu" else F.gelu(g, approximate="tanh")) * self.up(x)
        y = self.down(a)
        return y + self.side(a) if self.second_reader else y


@pytest.mark.parametrize(("act", "glu"), [("silu", "silu_and_mul"), ("gelu_tanh", "gelu_and_mul")])
def test_a_glu_read_by_one_gemv_folds_into_it(act: str, glu: str, calls: collections.Counter, rewrites: list,
                                              folding: None, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """One row through a GLU MLP: the GLU kernel's call (SiLU's or GELU's) goes into the down projection's GEMV, one
    gemv_gated launch; the output is the model's, and the unfolded patch's bit for bit."""
    from fusionscope.fusions import gemv as gemv_fusion

    torch.manual_seed(0)
    model, x = GluMlp(act), torch.randn(1, 1, 32)
    r, ref, got = graph_patch(model, x)
    assert r.applied.get(glu) == ["GluMlp"] and "down" in r.applied.get("gemv", []), (r.applied, r.skipped)
    assert folded_sites(rewrites) == {"GluMlp": f"{glu} folded into the gemv call at down"}
    assert calls[glu] == 0 and calls["gemv_gated"] == 2, calls  # the example call, then ours
    assert_logits_close(got, ref)
    torch._dynamo.reset()
    monkeypatch.setattr(gemv_fusion, "PROLOGUES", {})
    _, _, unfolded = graph_patch(model, x)
    assert calls[glu] == 2, calls
    assert torch.equal(got, unfolded)


def test_a_glu_output_with_two_readers_is_not_folded(calls: collections.Counter, rewrites: list, folding: None) -> None:
    """The GLU's output read by two GEMVs must be written once for both: no fold, the GLU kernel runs."""
    torch.manual_seed(0)
    r, ref, got = graph_patch(GluMlp("silu", second_reader=True), torch.randn(1, 1, 32))
    assert r.applied.get("silu_and_mul") == ["GluMlp"], (r.applied, r.skipped)
    assert {"down", "side"} <= set(r.applied.get("gemv", [])), (r.applied, r.skipped)
    assert folded_sites(rewrites) == {}
    assert calls["silu_and_mul"] == 2 and calls["gemv_gated"] == 0, calls
    assert_logits_close(got, ref)


@pytest.mark.parametrize("write", [False, True], ids=["fold", "in-place-write-between"])
def test_the_fold_on_a_hand_built_graph_and_across_an_in_place_write(write: bool, folding: None) -> None:
    """`fold_prologues` alone: a GLU call whose output only a GEMV call reads becomes one call of both, computing the
    same; with a write in place to the gate between them (`g.mul_(2)`) the one call would read the gate after the
    write where the GLU read it before, so the pair stays."""
    from fusionscope.apply import rewrite
    from fusionscope.fusions import gemv as gemv_fusion
    from fusionscope.fusions.silu_and_mul import fused_silu_and_mul

    graph = torch.fx.Graph()
    g, u, w = graph.placeholder("g"), graph.placeholder("u"), graph.placeholder("w")
    x = graph.call_function(fused_silu_and_mul, (g, u))
    if write:
        graph.call_method("mul_", (g, 2.0))
    y = graph.call_function(gemv_fusion.fused_gemv, (x, w, None))
    graph.output(y)
    gm = torch.fx.GraphModule(nn.Module(), graph)
    results: dict[str, dict[str, str]] = {}
    rewrite.fold_prologues(gm, {x: ("silu_and_mul", "mlp"), y: ("gemv", "mlp.down_proj")}, results)
    gm.graph.lint()
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    if write:
        assert targets == [fused_silu_and_mul, gemv_fusion.fused_gemv] and results == {}, targets
        return
    assert targets == [gemv_fusion.fused_gemv_silu], targets
    assert results == {rewrite.FOLDED: {"mlp": "silu_and_mul folded into the gemv call at mlp.down_proj"}}
    torch.manual_seed(0)
    h, weight = torch.randn(1, 80), torch.randn(24, 40) * 40**-0.5
    gate, up = h[:, :40], h[:, 40:]
    assert torch.equal(gm(gate, up, weight), gemv_fusion.fused_gemv(fused_silu_and_mul(gate, up), weight, None))
