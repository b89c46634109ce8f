"""`analyze` of a trace fusionscope did not capture finds what `profile` finds on the same model and workload.

GIVEN each tiny preset (and a tiny GPT-2 from a config folder), in fp32 and in bf16 on this CPU, profiled by
`fusionscope profile` (module ranges, phase ranges, the recorded dataflow) and, separately, run by a plain script —
`torch.profiler.profile(activities=[CPU], record_shapes=True, with_stack=True)` around a prefill and greedy decode
steps, `prof.step()` after each forward, `torch.no_grad()`, none of fusionscope's hooks — WHEN `analyze` infers the
dataflow from that trace alone (op order, shapes, and the module nesting the Python tracer records as
`nn.Module: <Class>_<N>` calls), THEN per fusion:

- per step, by phase (the plain trace's step 0 is the prefill, its later steps the decode steps; the trace is one
  phase, `trace`, so the phase is told by step here): the groups, the ops and launches they hold, and their bytes now
  and fused equal `profile`'s row of that phase (medians over the phase's steps, as `profile` gives them) — the same
  groups, not only as many;
- the rows `analyze` writes (fp32): the same fusions, each row's `count` (groups per step: the median over the steps
  that hold one) what `profile`'s rows give over the same steps;
- without `ProfilerStep` markers (a plain `with profile(...)`; tiny-llama, fp32) the whole trace is one step, holding
  the prefill's groups and every decode step's.

What is not compared: module paths (a foreign trace names the Python tracer's class instances,
`LlamaModel_0.LlamaDecoderLayer_1.LlamaMLP_1`, not attribute paths) and times (two runs).

One known difference: GPT-NeoX's parallel block normalises each residual sum twice, the MLP's norm after the
attention has run. Op order reads that norm's input as the attention's output, unread at that point and of the same
shape (`fusionscope.order_graph`, rule 2), so `analyze` finds the add and the attention's norm, where `profile`'s
recorded dataflow gives the add and both norms (`add_layer_norm`'s pair): the same groups per step, each holding one
LayerNorm fewer. A second: Phi-3's partial-rotary split and re-join, which rope's binding takes on the recorded
dataflow (`Match.bound`), so `profile` counts them in rope's launches, and op order does not show them to it."""

from __future__ import annotations

import json
import statistics
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, schedule

import fusionscope
from fusionscope import models
from fusionscope.analyze import (
    analyze,
    classify,
    fill_steps_and_phases,
    kernel_table,
    match_catalogue,
    parse_rank,
    parse_trace,
    resolve_roofs,
)

PROMPT, DECODE = 8, 2
GPT2 = {**models.PRESETS["gpt2"], "n_embd": 64, "n_head": 4, "vocab_size": 300, "n_positions": 64, "n_layer": 2}
PRESETS = ["tiny-llama", "tiny-phi3", "tiny-olmo2", "tiny-qwen3", "tiny-neox", "tiny-starcoder2", "tiny-gpt2"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # profile's CPU default, and what inference runs in
COMPARED = ("count", "ops_now", "launches_now", "bytes_now", "bytes_fused")  # per group set and step


def model_argument(name: str, folder: Path) -> str:
    """A preset name, or (tiny-gpt2) a config folder, which `profile` and `build_workload` both take."""
    if name != "tiny-gpt2":
        return name
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(GPT2))
    return str(folder)


def plain_capture(model_name: str, path: Path, dtype: torch.dtype = torch.float32, steps: bool = True) -> None:
    """What a user's script does: a prefill and greedy decode steps under torch.profiler, no fusionscope hooks (the
    model is only built through fusionscope.models, with `profile`'s seed). `steps`: a schedule and `prof.step()`
    after each forward (`ProfilerStep#N` ranges), else one plain `with profile(...)`."""
    workload = models.build_workload(models.resolve_model(model_name), torch.device("cpu"), dtype,
                                     prompt_len=PROMPT, decode_steps=DECODE)  # fmt: skip
    model, (ids,) = workload.module, workload.inputs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "won't be using warmup", transformers' deprecations
        plan = schedule(wait=0, warmup=0, active=1 + DECODE, repeat=1) if steps else None
        with (
            torch.no_grad(),
            profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True, schedule=plan,
                    on_trace_ready=(lambda p: p.export_chrome_trace(str(path))) if steps else None) as prof,
        ):  # fmt: skip
            out = model(ids, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            if steps:
                prof.step()
            cache = out.past_key_values
            for _ in range(DECODE):
                out = model(token, past_key_values=cache, use_cache=True)
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                if steps:
                    prof.step()
    if not steps:
        prof.export_chrome_trace(str(path))


def per_step_matches(path: Path) -> dict[str, dict[int, dict[str, float]]]:
    """fusion → step → the groups' count, ops, launches and bytes, as `analyze` finds them on the trace (its own
    stages: parse, steps and phases, kernels, the catalogue on the inferred dataflow)."""
    facts, doc = parse_trace(path)
    timeline, _missing = fill_steps_and_phases(parse_rank(facts, doc).timeline)
    roofs, _ = resolve_roofs(None, "cpu", "cpu")
    found = match_catalogue(timeline, classify(kernel_table(timeline), roofs), roofs, None, {})
    assert found.basis == "op order"
    per_match = found.per_match.assign(count=1)
    sums = per_match.groupby(["fusion", "step"])[list(COMPARED)].sum()
    out: dict[str, dict[int, dict[str, float]]] = {}
    for (fusion, step), row in sums.iterrows():
        out.setdefault(fusion, {})[int(step)] = {k: float(row[k]) for k in COMPARED}
    return out


def by_phase(steps: dict[int, dict[str, float]]) -> dict[str, dict[str, float]]:
    """The plain trace's steps as profile's phases (step 0: prefill, later ones: decode), medians over each."""
    phases = {"prefill": [0], "decode": list(range(1, 1 + DECODE))}
    out = {}
    for phase, numbers in phases.items():
        held = [steps[s] for s in numbers if s in steps]
        if held:
            out[phase] = {k: statistics.median(h[k] for h in held) for k in COMPARED}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], dict]:
    """`runs(preset, dtype)`: profile's rows and the plain trace of that preset in that dtype, made once."""
    made: dict[tuple[str, str], dict] = {}

    def get(name: str, dtype: str) -> dict:
        if (name, dtype) not in made:
            folder = tmp_path_factory.mktemp(f"{name}-{dtype}")
            model = model_argument(name, folder / "model")
            run = fusionscope.profile(model, out=folder / "profile", prompt_len=PROMPT, decode_steps=DECODE,
                                      warmup=0, device="cpu", dtype=dtype)  # fmt: skip
            rows = {(o["fusion"], o["phase"]): o for o in run.summary["opportunities"]}
            assert {o["basis"] for o in rows.values()} == {"dataflow"}
            plain_capture(model, folder / "plain.trace.json", DTYPES[dtype])
            made[(name, dtype)] = {"rows": rows, "trace": folder / "plain.trace.json", "model": model}
        return made[(name, dtype)]

    return get


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", PRESETS)
def test_foreign_trace_gives_profiles_groups_per_phase(name: str, dtype: str, runs: Callable) -> None:
    run = runs(name, dtype)
    rows, got = run["rows"], per_step_matches(run["trace"])
    want = {(fusion, phase): {k: float(row[k]) for k in COMPARED} for (fusion, phase), row in rows.items()}
    inferred = {(fusion, phase): figures for fusion, steps in got.items() for phase, figures in by_phase(steps).items()}
    differ = {key: (want.get(key), inferred.get(key)) for key in {*want, *inferred}}
    if name == "tiny-neox":  # op order cannot tell GPT-NeoX's parallel block apart (module docstring, last paragraph)
        for key in [k for k in differ if k[0] == "add_layer_norm"]:
            pair, single = differ.pop(key)
            assert single["count"] == pair["count"] and single["ops_now"] < pair["ops_now"], (key, pair, single)
            assert single["bytes_now"] < pair["bytes_now"], (key, pair, single)
    if name == "tiny-phi3":  # partial rotary's re-join: bound to rope by the recorded dataflow only (rope.py)
        for key in [k for k in differ if k[0] == "rope"]:
            bound, inferred = differ.pop(key)
            assert inferred["count"] == bound["count"] and inferred["bytes_fused"] == bound["bytes_fused"], key
            assert inferred["ops_now"] < bound["ops_now"] and inferred["launches_now"] < bound["launches_now"], key
    assert all(w == g for w, g in differ.values()), {k: v for k, v in differ.items() if v[0] != v[1]}
    assert len(want) >= 3  # every preset has at least three fusions to find
    assert sorted({s for steps in got.values() for s in steps}) == list(range(1 + DECODE))


@pytest.mark.parametrize("name", PRESETS)
def test_foreign_trace_rows_count_what_profile_counts(name: str, runs: Callable, tmp_path: Path) -> None:
    """`analyze`'s rows end to end: one phase, `trace`, each count the median groups per step over the steps that
    hold the fusion — profile's prefill count for the prefill step and its decode count for each decode step."""
    rows = runs(name, "fp32")["rows"]
    run = analyze(runs(name, "fp32")["trace"], out=tmp_path / "run", device="cpu")
    got = {o["fusion"]: o["count"] for o in run.summary["opportunities"]}
    assert {o["phase"] for o in run.summary["opportunities"]} == {"trace"}
    want = {}
    for fusion in {f for f, _phase in rows}:
        per_step = [rows[(fusion, "prefill")]["count"]] if (fusion, "prefill") in rows else []
        per_step += [rows[(fusion, "decode")]["count"]] * DECODE if (fusion, "decode") in rows else []
        want[fusion] = statistics.median(per_step)
    assert got == want
    s = run.summary
    assert s["trace"]["recorded"] == {"shapes": True, "stacks": True, "modules": True}
    assert any(line.startswith("nn.Module ranges: module paths are the Python tracer's") for line in s["missing"])
    assert all(o["module_paths"] and o["basis"] == "op order" for o in s["opportunities"])


def test_foreign_trace_without_step_markers_is_one_step(runs: Callable, tmp_path: Path) -> None:
    """A plain `with profile(...)` and no schedule: the whole trace is one step holding the prefill's groups and
    every decode step's."""
    rows, model = runs("tiny-llama", "fp32")["rows"], runs("tiny-llama", "fp32")["model"]
    plain_capture(model, tmp_path / "whole.trace.json", steps=False)
    run = analyze(tmp_path / "whole.trace.json", out=tmp_path / "run", device="cpu")
    got = {o["fusion"]: o["count"] for o in run.summary["opportunities"]}
    want = {}
    for (fusion, phase), row in rows.items():
        want[fusion] = want.get(fusion, 0.0) + row["count"] * (1 if phase == "prefill" else DECODE)
    assert got == want
    assert got["add_rms_norm"] == 4 * (1 + DECODE)  # the case: every residual add joined to its norm
