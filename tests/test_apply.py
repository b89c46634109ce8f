"""`fusionscope apply` end to end on the CPU (kernels in the Triton interpreter): the run folder, the numerics per
fusion, rollback of a fusion that fails on purpose, skipped-with-reason, `--from`, and the bad inputs."""

from __future__ import annotations

import json
from contextlib import contextmanager, nullcontext
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import fusionscope
from fusionscope.cli import app
from fusionscope.errors import UsageError

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
WORKLOAD = dict(prompt_len=8, decode_steps=2, warmup=0, repeats=1)


@pytest.fixture(scope="module")
def applied(tmp_path_factory: pytest.TempPathFactory) -> fusionscope.run.Run:
    out = tmp_path_factory.mktemp("apply") / "tiny"
    return fusionscope.apply("tiny-llama", out=out, **WORKLOAD)


def test_apply_writes_profile_files_and_apply_results(applied) -> None:
    names = {p.name for p in applied.out_dir.iterdir()}
    assert {"trace.json.gz", "kernels.csv", "ops.csv", "opportunities.csv", "summary.json", "report.html",
            "apply.csv"} <= names  # fmt: skip
    assert not [n for n in names if n.endswith(".partial") or n.startswith(".profile")]
    summary = json.loads((applied.out_dir / "summary.json").read_text())
    assert summary["apply"]["timing"] is None and "interpreter" in summary["apply"]["timing_note"]
    html = (applied.out_dir / "report.html").read_text()
    assert 'id="apply-numerics"' in html and "table-apply-numerics" in html


def test_every_found_fusion_is_patched_or_says_why(applied) -> None:
    rows = {row["fusion"]: row for row in applied.apply["fusions"]}
    found = {o["fusion"] for o in applied.summary["opportunities"]}
    assert found <= set(rows)
    for row in rows.values():
        assert row["status"] in ("passed", "failed", "skipped")
        if row["status"] == "skipped":
            assert row["reason"]
        else:
            assert row["sites_patched"] >= 1 and row["numerics"]["top1"] is not None
    # the 2·L add_rms_norm sites of a 2-layer Llama, all patched, and passing in fp32
    assert rows["add_rms_norm"]["sites_patched"] == rows["add_rms_norm"]["sites_found"] == 4
    assert rows["add_rms_norm"]["status"] == "passed"
    assert applied.apply["eager_vs_fp32"]["max_abs"] == 0.0  # an fp32 run is its own fp32 reference


def test_model_is_restored_after_apply(tmp_path) -> None:
    """The same process can apply twice: nothing of a patch is left on transformers' classes or module globals."""
    from transformers.models.llama import modeling_llama

    def snapshot() -> dict:
        classes = {name: dict(vars(cls)) for name, cls in vars(modeling_llama).items() if isinstance(cls, type)}
        return {"globals": {name: id(value) for name, value in vars(modeling_llama).items()}, "classes": classes}

    fusionscope.apply("tiny-llama", out=tmp_path / "warm", fusions="rms_norm", **WORKLOAD)  # transformers' own lazy
    before = snapshot()  # class caches (`_can_set_experts_implementation_cached_value`) are filled by any first use
    run = fusionscope.apply("tiny-llama", out=tmp_path / "a", **WORKLOAD)
    assert {row["fusion"] for row in run.apply["fusions"] if row["status"] == "passed"} >= {
        "add_rms_norm", "rms_norm", "rope", "qkv", "gate_up", "silu_and_mul"}  # fmt: skip
    assert snapshot() == before


def test_sampling_fusion_is_judged_on_its_draws(tmp_path, monkeypatch) -> None:
    """The draws check with 64 draws instead of its 512: each is one launch of the fused sampler (two kernels at
    top_k = 20) in the interpreter, ~0.2 s. 64 draws from the kept set of a near-flat distribution (top 20 of 1000
    tokens) are enough to see a sampler that ignores top-k or top-p: it would draw outside the set almost every time."""
    from functools import partial

    from fusionscope.apply import numerics

    monkeypatch.setattr(numerics, "check_draws", partial(numerics.check_draws, draws=64))
    run = fusionscope.apply("tiny-llama", out=tmp_path / "s", fusions="sampling", sample=True, top_k=20, **WORKLOAD)
    (row,) = [r for r in run.apply["fusions"] if r["fusion"] == "sampling"]
    assert row["status"] == "passed", row["reason"]
    draws = row["numerics"]["draws"]
    assert draws["draws"] == 64 and draws["in_kept_set"] == 1.0 and "kept set" in row["reason"]


def test_a_fusion_that_breaks_the_logits_is_rolled_back(tmp_path, monkeypatch) -> None:
    import fusionscope.kernels as kernels

    real = kernels.silu_and_mul

    def broken(gate: torch.Tensor, up: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        return real(gate, up) * 1.5

    monkeypatch.setattr(kernels, "silu_and_mul", broken)
    run = fusionscope.apply("tiny-llama", out=tmp_path / "r", fusions="silu_and_mul,rms_norm", **WORKLOAD)
    rows = {row["fusion"]: row for row in run.apply["fusions"]}
    assert rows["silu_and_mul"]["status"] == "failed"
    assert rows["silu_and_mul"]["reason"]
    assert rows["rms_norm"]["status"] == "passed"
    assert not run.apply["together_numerics"]  # one passing fusion: nothing to put together


def test_unknown_fusion_is_one_line_and_writes_nothing(tmp_path) -> None:
    result = CliRunner().invoke(app, ["apply", "--fusions", "nope", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2
    assert "unknown fusion(s) nope" in result.output
    assert not (tmp_path / "x").exists()


def test_fusion_not_found_or_not_patchable_is_skipped_with_reason(tmp_path) -> None:
    """A float model has no dequantise + GEMM chain: dequant_gemm asked for is skipped as not found; and a plain
    Linear handed to its patcher is refused with the reason (the kernel serves PlainW4Linear's layout only)."""
    run = fusionscope.apply("tiny-llama", out=tmp_path / "d", fusions="dequant_gemm,rms_norm", **WORKLOAD)
    rows = {row["fusion"]: row for row in run.apply["fusions"]}
    assert rows["dequant_gemm"]["status"] == "skipped" and "no match" in rows["dequant_gemm"]["reason"]
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with fusionscope.patch(model, [{"fusion": "dequant_gemm", "module_paths": ["0"]}]) as p:
        assert not p.applied
        assert p.skipped_paths["dequant_gemm"]["0"].startswith("Linear is not a PlainW4Linear")


def test_nothing_to_apply_is_a_usage_error(tmp_path) -> None:
    with pytest.raises(UsageError, match="nothing to apply"):
        fusionscope.apply("tiny-llama", out=tmp_path / "n", fusions="dequant_gemm", **WORKLOAD)
    assert not (tmp_path / "n").exists()
    assert not list(tmp_path.iterdir())


def test_from_an_earlier_run(applied, tmp_path) -> None:
    run = fusionscope.apply("tiny-llama", out=tmp_path / "f", from_run=applied.out_dir, fusions="rms_norm",
                            **WORKLOAD)  # fmt: skip
    assert run.summary["predictions_from"] == str(applied.out_dir)
    assert (run.out_dir / "trace.json.gz").is_file()
    result = CliRunner().invoke(app, ["apply", "--from", str(applied.out_dir), "--prompt-len", "9",
                                      "--decode-steps", "2", "--out", str(tmp_path / "g")])  # fmt: skip
    assert result.exit_code == 2
    assert "prompt_len 8 there, 9 here" in result.output
    assert not (tmp_path / "g").exists()


def test_patch_by_fusion_name_on_a_model_of_your_own() -> None:
    from fusionscope.models import build_workload, resolve_model

    workload = build_workload(resolve_model("tiny-llama"), torch.device("cpu"), torch.float32, prompt_len=4,
                              decode_steps=1)  # fmt: skip
    model = workload.module
    ids = torch.randint(0, 1000, (1, 5))
    with torch.inference_mode():
        before = model(ids).logits
        with fusionscope.patch(model, ["rms_norm", "add_rms_norm", "dequant_gemm"]) as p:
            patched = model(ids).logits
        after = model(ids).logits
    assert p.applied["rms_norm"] == ["model.layers.0.input_layernorm"]
    assert len(p.applied["add_rms_norm"]) == 4
    assert "dequant_gemm" in p.skipped
    assert torch.equal(before, after)
    torch.testing.assert_close(patched, before, atol=1e-4, rtol=1e-4)


def test_the_timing_path_runs_and_sets_every_measured_figure_beside_its_prediction(applied, tmp_path) -> None:
    """`apply` times only on a GPU; the same code path is driven here on the CPU (interpreter timings, meaningless as
    figures) so that its bookkeeping is checked: one interleaved set, all found labelled all together, every ratio
    against the baseline of its own set, predictions beside measurements."""
    from contextlib import nullcontext

    from fusionscope.apply.patching import patch
    from fusionscope.apply.run import measure_variants, sites_to_patch
    from fusionscope.models import build_workload, resolve_model

    workload = build_workload(resolve_model("tiny-llama"), torch.device("cpu"), torch.float32, prompt_len=8,
                              decode_steps=2)  # fmt: skip
    sites, _ = sites_to_patch(applied.summary["opportunities"], ["rms_norm", "silu_and_mul"])

    def enter(fusions: list[str]):
        where = [{"fusion": f, "module_paths": sites[f]} for f in fusions]
        return patch(workload.module, where) if fusions else nullcontext()

    timing = measure_variants(workload, applied.summary, ["rms_norm", "silu_and_mul"], enter, None, 2, tmp_path,
                              lambda _m: None, together_ok=True)  # fmt: skip
    assert timing["sets"][0][:3] == ["baseline", "rms_norm", "silu_and_mul"]
    assert set(timing["all_together"]) == {"prefill", "decode"}
    assert set(timing["all_together"].values()) <= {*timing["variants"], "baseline"}
    for name, variant in timing["variants"].items():
        for phase in ("prefill", "decode"):
            f = variant["phases"][phase]
            assert f["wall_ms"] > 0 and f["baseline_wall_ms"] > 0
            assert len(f["wall_ms_rounds"]) == len(f["baseline_wall_ms_rounds"]) == 2
            expected = min(f["baseline_wall_ms_rounds"]) / min(f["wall_ms_rounds"])
            assert f["measured_speedup_wall"] == pytest.approx(expected)
            if name != "baseline":
                assert f["predicted_speedup_wall"] is not None
                assert f["error_wall"] == pytest.approx(f["measured_speedup_wall"] / f["predicted_speedup_wall"] - 1)
    assert not list(tmp_path.iterdir())  # the profiled passes' traces are removed


FACTORY = """
import torch
from transformers import AutoConfig, AutoModelForCausalLM


def tiny_llama(device="cpu", dtype=torch.float32):
    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype)
    return model, {"input_ids": torch.randint(0, 128, (2, 7), device=device)}
"""


def test_apply_on_a_factory_model_checks_its_forward(tmp_path) -> None:
    """A factory's module is patched where the finder found its fusions, and its forward's output is the logits the
    numerics compare (one forward phase, no decode)."""
    factory = tmp_path / "factory.py"
    factory.write_text(FACTORY)
    run = fusionscope.apply(f"{factory}:tiny_llama", out=tmp_path / "run", warmup=0, repeats=1)
    rows = {row["fusion"]: row for row in run.apply["fusions"]}
    assert rows["add_rms_norm"]["status"] == "passed" and rows["add_rms_norm"]["sites_patched"] == 4
    assert rows["silu_and_mul"]["status"] == "passed"
    assert rows["add_rms_norm"]["numerics"]["positions"] == 14  # 2 sequences × 7 positions, no decode


def test_a_factorys_own_mlp_is_patched_on_the_captured_graph(tmp_path) -> None:
    """A user's SwiGLU MLP in a layout no layout patcher knows: the graph patch follows the finder's match."""
    result = CliRunner().invoke(app, ["apply", f"{EXAMPLES / 'custom_factory.py'}:make_mlp", "--warmup", "0",
                                      "--repeats", "1", "--out", str(tmp_path / "x")])  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = {r["fusion"]: r for r in json.loads((tmp_path / "x" / "summary.json").read_text())["apply"]["fusions"]}
    assert rows["silu_and_mul"]["status"] == "passed" and rows["silu_and_mul"]["patched_by"] == "graph", rows


def test_apply_on_a_local_config_folder(tmp_path) -> None:
    folder = tmp_path / "tiny"
    folder.mkdir()
    config = dict(model_type="qwen2", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    run = fusionscope.apply(str(folder), out=tmp_path / "run", **WORKLOAD)
    rows = {row["fusion"]: row for row in run.apply["fusions"]}
    assert run.summary["model"]["family"] == "qwen2"
    assert rows["qkv"]["status"] == "passed"  # q/k/v with biases: one GEMM over the concatenated weights and biases
    assert rows["add_rms_norm"]["sites_patched"] == 4


def _measured(walls: dict[str, list[float]]):
    from fusionscope.apply.measure import Measurement

    return Measurement(wall_ms={phase: list(values) for phase, values in walls.items()})


@pytest.mark.parametrize("slow_in_decode", [False, True], ids=["none-slower", "silu-slower-in-decode"])
def test_all_together_leaves_out_a_fusion_clearly_slower_in_a_phase(applied, monkeypatch, slow_in_decode) -> None:
    """Crafted interleaved sets: a fusion clearly slower alone in decode (median and fastest round slower than the
    baseline) is left out of decode's all together, which is then timed in a second set and compared with that set's
    own baseline; prefill's all together stays all found."""
    from fusionscope.apply import measure, run

    first = {"baseline": {"prefill": [10.0, 10.5, 9.5], "decode": [10.0, 10.2, 9.8]},
             "rms_norm": {"prefill": [9.0, 9.1, 8.9], "decode": [9.0, 9.3, 8.8]},
             "silu_and_mul": {"prefill": [9.5, 9.6, 9.4], "decode": [11.5, 11.0, 12.0] if slow_in_decode else
                              [10.1, 9.0, 10.4]},
             "all found": {"prefill": [8.0, 8.1, 7.9], "decode": [8.5, 8.6, 8.4]}}  # fmt: skip
    second = {"baseline": {"prefill": [20.0, 20.0, 20.0], "decode": [20.0, 20.0, 20.0]},
              "all together (decode)": {"prefill": [18.0, 18.0, 18.0], "decode": [10.0, 10.0, 10.0]}}  # fmt: skip
    sets = iter([first, second])

    def timed_set(_workload, variants, *_args):
        crafted = next(sets)
        assert list(variants) == list(crafted)
        return {name: _measured(walls) for name, walls in crafted.items()}

    monkeypatch.setattr(run, "_timed_set", timed_set)
    monkeypatch.setattr(measure, "gpu_figures", lambda *_a, **_k: {})

    class Stub:
        phases = ("prefill", "decode")

    timing = run.measure_variants(Stub(), applied.summary, ["rms_norm", "silu_and_mul"], lambda _f: nullcontext(),
                                  None, 3, None, lambda _m: None, together_ok=True)  # fmt: skip
    if not slow_in_decode:
        assert timing["all_together"] == {"prefill": "all together", "decode": "all together"}
        assert list(timing["variants"]) == ["baseline", "rms_norm", "silu_and_mul", "all together"]
        return
    assert timing["all_together"] == {"prefill": "all found", "decode": "all together (decode)"}
    assert timing["variants"]["all together (decode)"]["fusions"] == ["rms_norm"]
    decode = timing["variants"]["all together (decode)"]["phases"]["decode"]
    assert decode["baseline_wall_ms"] == 20.0 and decode["measured_speedup_wall"] == pytest.approx(2.0)
    found = timing["variants"]["all found"]["phases"]["decode"]
    assert found["baseline_wall_ms"] == 10.0
    assert found["measured_speedup_wall"] == pytest.approx(9.8 / 8.4)  # the fastest rounds
    assert timing["sets"] == [["baseline", "rms_norm", "silu_and_mul", "all found"],
                              ["baseline", "all together (decode)"]]  # fmt: skip


def test_from_a_folder_without_predictions_is_one_line(tmp_path) -> None:
    folder = tmp_path / "notarun"
    folder.mkdir()
    (folder / "summary.json").write_text("[1, 2]")
    (folder / "kernels.csv").write_text("name\n")
    result = CliRunner().invoke(app, ["apply", "--from", str(folder), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert "holds no profile predictions" in result.output
    assert not (tmp_path / "o").exists()


def test_a_fusion_whose_patched_forward_raises_or_returns_nan_fails_without_losing_the_run(tmp_path, monkeypatch):
    import fusionscope.kernels as kernels

    def raising(*_args, **_kwargs):
        raise RuntimeError("kernel exploded")

    real = kernels.silu_and_mul
    monkeypatch.setattr(kernels, "rms_norm", raising)
    monkeypatch.setattr(kernels, "silu_and_mul", lambda g, u=None, out=None: real(g, u) * float("nan"))
    run = fusionscope.apply("tiny-llama", out=tmp_path / "r", fusions="rms_norm,silu_and_mul,rope", **WORKLOAD)
    rows = {row["fusion"]: row for row in run.apply["fusions"]}
    assert rows["rms_norm"]["status"] == "failed" and "RuntimeError: kernel exploded" in rows["rms_norm"]["reason"]
    assert rows["silu_and_mul"]["status"] == "failed" and rows["silu_and_mul"]["numerics"]["non_finite"]
    assert rows["rope"]["status"] == "passed"
    assert json.loads((run.out_dir / "summary.json").read_text())["apply"]["fusions"]


def test_rounds_alternate_their_order_and_speedups_take_the_fastest_rounds(monkeypatch) -> None:
    """A host that slows down steadily through the run favours whoever runs first in every round; reversing every
    other round evens that out. A slow spell only adds time: the fastest rounds are compared."""
    from types import SimpleNamespace

    from fusionscope import capture
    from fusionscope.apply import measure

    order: list[str] = []
    monkeypatch.setattr(capture, "timed_pass", lambda *_a, **_k: {"decode": [1.0 + len(order)]})

    def enter(name: str):
        @contextmanager
        def entered():
            order.append(name)
            yield

        return entered

    workload = SimpleNamespace(device=torch.device("cpu"))
    results = measure.interleaved(workload, {n: enter(n) for n in ("a", "b", "c")}, repeats=4)
    assert order == ["a", "b", "c", "c", "b", "a", "a", "b", "c", "c", "b", "a"]
    assert results["a"].wall_ms["decode"] == [2.0, 7.0, 8.0, 13.0]
    spells = measure.Measurement(wall_ms={"decode": [30.0, 10.0, 28.0]})
    twice_as_fast = measure.Measurement(wall_ms={"decode": [5.0, 15.0, 14.0]})
    assert measure.fastest_speedup(spells, twice_as_fast, "decode") == pytest.approx(2.0)
    assert measure.fastest_speedup(spells, measure.Measurement(), "decode") is None


def record_notes(monkeypatch) -> list[str]:
    """The stage notes `run_apply` gives, in order, kept in the returned list."""
    from fusionscope.apply import run as apply_run

    notes: list[str] = []
    real_apply = apply_run.run_apply

    def recording(workload, summary, wanted, repeats, tmp, note, *rest):
        def noted(text: str) -> None:
            notes.append(text)
            note(text)

        return real_apply(workload, summary, wanted, repeats, tmp, noted, *rest)

    monkeypatch.setattr(apply_run, "run_apply", recording)
    return notes


@pytest.mark.parametrize("broken", [False, True])
def test_graphs_together_checks_all_together_first_and_alone_if_that_fails(tmp_path, monkeypatch, broken) -> None:
    """With --graphs-together nothing is timed alone, so one patch and one teacher-forced run check every fusion
    found; a failure there falls back to checking each alone, so the fusion at fault is named and the rest go on."""
    import fusionscope.kernels as kernels

    from fusionscope.apply import run as apply_run

    notes = record_notes(monkeypatch)
    monkeypatch.setattr(apply_run, "graph_variants", lambda *_a, **_k: {})  # the numerics stage is what is tested
    if broken:
        real = kernels.silu_and_mul
        monkeypatch.setattr(kernels, "silu_and_mul", lambda g, u=None, out=None: real(g, u) * float("nan"))
    run = fusionscope.apply("tiny-llama", out=tmp_path / "t", fusions="rms_norm,silu_and_mul,rope", graphs=True,
                            graphs_only=True, graphs_together=True, **WORKLOAD)  # fmt: skip
    rows = {row["fusion"]: row for row in run.apply["fusions"]}
    checks = [n for n in notes if n.startswith("numerics: ") and "unpatched" not in n]
    assert checks[0] == "numerics: every fusion found together"
    if not broken:
        assert checks == ["numerics: every fusion found together"]
        assert all(row["status"] == "passed" and row["checked"] == "together" for row in rows.values())
        assert run.apply["together_numerics"]["fusions"] == ["rms_norm", "silu_and_mul", "rope"]
    else:
        assert checks[1:] == ["numerics: rms_norm alone", "numerics: silu_and_mul alone", "numerics: rope alone",
                              "numerics: all passing fusions together"]  # fmt: skip
        assert rows["silu_and_mul"]["status"] == "failed" and rows["silu_and_mul"]["numerics"]["non_finite"]
        assert rows["rms_norm"]["status"] == rows["rope"]["status"] == "passed" and "checked" not in rows["rope"]
        assert run.apply["together_numerics"]["fusions"] == ["rms_norm", "rope"]


def test_graphs_together_with_nothing_patchable_says_why_once(tmp_path, monkeypatch) -> None:
    """Nothing patched by the together check leaves nothing to check alone: the usage error names each reason."""
    from fusionscope.apply import patching

    notes = record_notes(monkeypatch)
    monkeypatch.setattr(patching, "kernels_unavailable", lambda _model: "no device for the kernels here")
    with pytest.raises(UsageError, match=r"nothing could be patched.*rms_norm: no device for the kernels here"):
        fusionscope.apply("tiny-llama", out=tmp_path / "z", fusions="rms_norm,rope", graphs=True, graphs_only=True,
                          graphs_together=True, **WORKLOAD)  # fmt: skip
    assert not (tmp_path / "z").exists()
    assert not [n for n in notes if n.endswith(" alone")]
