"""Multi-rank analysis: `fusionscope.ranks`' interval figures, and `analyze` on a folder of per-rank traces.

Fixture: `tests/data/traces/gloo-2ranks/`, two gloo processes on the CPU written by
`tests/data/make_trace_fixtures.py`; rank 1 runs 12x the matmuls of rank 0 per step, so it is the straggler."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path
from statistics import median

import pandas as pd
import pytest
from test_analyze import _bad  # the one check of a refused analyze: one line, exit 2, nothing written

from fusionscope import ranks
from fusionscope.analyze import HTA_NO_KERNELS, analyze, hta_figures

DATA = Path(__file__).resolve().parent / "data"
GLOO = DATA / "traces" / "gloo-2ranks"
GPU_TRACE = DATA / "tiny-llama-cuda.trace.json.gz"


def events_of(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _x(name: str, ts: float, dur: float, cat: str = "cpu_op") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


# --- pure figures ----------------------------------------------------------------------------------------------


def test_merge_and_intersect_count_nested_and_overlapping_time_once() -> None:
    merged = ranks.merge([(5, 8), (0, 10), (2, 3), (12, 15), (14, 16)])
    assert merged == [(0, 10), (12, 16)] and ranks.total(merged) == 14
    assert ranks.intersect(merged, [(9, 13), (15, 20)]) == [(9, 10), (12, 13), (15, 16)]
    assert ranks.clip(merged, (4, 13)) == [(4, 10), (12, 13)]


def test_cpu_intervals_split_collectives_from_ops_per_step() -> None:
    events = [
        _x("ProfilerStep#7", 0, 100, "user_annotation"),
        _x("aten::matmul", 0, 30),
        _x("aten::mm", 1, 28),  # nested: counted once
        _x("c10d::allreduce_", 40, 10),
        _x("gloo:all_reduce", 45, 35, "user_annotation"),  # on the gloo thread, overlapping the op above
        _x("my_range", 0, 100, "user_annotation"),  # a record_function range is no work of its own
        _x("aten::add", 70, 20),  # overlaps the gloo range by 10
    ]
    ri = ranks.rank_intervals(3, events)
    assert ri.source == "cpu ops" and ri.steps == {7: (0.0, 100.0)}
    fig = ranks.step_figures(ri)[7]
    assert fig == pytest.approx({"step_ms": 0.1, "compute_ms": 0.04, "comm_ms": 0.04, "overlap_ms": 0.01})


def test_gpu_intervals_take_nccl_kernels_and_ignore_cpu_ops() -> None:
    events = [
        _x("aten::mm", 0, 500),
        _x("sm90_xmma_gemm", 10, 50, "kernel"),
        _x("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 40, 40, "kernel"),
        _x("ncclKernel_AllGather_RING_LL_Sum_int8_t", 100, 20, "kernel"),
    ]
    ri = ranks.rank_intervals(0, events)
    assert ri.source == "kernels" and ri.steps == {0: (10.0, 120.0)}  # no markers: one step over the kernels
    fig = ranks.step_figures(ri)[0]
    assert fig == pytest.approx({"step_ms": 0.11, "compute_ms": 0.03, "comm_ms": 0.06, "overlap_ms": 0.02})


def test_straggler_is_the_rank_with_most_time_outside_communication() -> None:
    per_rank = {
        r: {s: {"step_ms": 5.0, "compute_ms": c, "comm_ms": 5.0 - c, "overlap_ms": 0.0} for s, c in steps.items()}
        for r, steps in {0: {1: 1.0, 2: 1.0}, 1: {1: 3.0, 2: 1.5}, 2: {1: 2.0, 2: 2.5}}.items()
    }
    cross = ranks.cross_rank(per_rank, "kernels")
    first, second = (s["straggler"] for s in cross["steps"])
    assert first == {"rank": 1, "excess_ms": 1.0, "excess_pct": 50.0}  # median 2.0
    assert second == {"rank": 2, "excess_ms": 1.0, "excess_pct": pytest.approx(100 / 1.5)}
    assert cross["straggler"]["rank"] == 1 and cross["straggler"]["steps"] == 1  # a tie goes to the lower rank
    assert cross["communication"]["per_rank"]["2"]["comm_ms"] == pytest.approx(5.5)


# --- the gloo folder analysed ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    base = tmp_path_factory.mktemp("ranks")
    run = analyze(GLOO, out=base / "folder")
    singles = {r: analyze(GLOO / f"rank{r}.trace.json.gz", out=base / f"rank{r}") for r in (0, 1)}
    return run, singles


def _compute_ms(path: Path) -> dict[int, float]:
    """Per step, the time of the rank's top-level aten ops (matmul, tanh: disjoint, on one thread), from the file."""
    events = [e for e in events_of(path) if e.get("ph") == "X"]
    steps = {int(e["name"].split("#")[1]): e for e in events if e["name"].startswith("ProfilerStep#")}
    out = {}
    for step, marker in steps.items():
        lo, hi = marker["ts"], marker["ts"] + marker["dur"]
        ops = [e for e in events if e["name"] in ("aten::matmul", "aten::tanh") and lo <= e["ts"] < hi]
        out[step] = sum(e["dur"] for e in ops) / 1e3
    return out


def test_gloo_folder_has_two_ranks_and_rank_columns(gloo_run: tuple) -> None:
    run, singles = gloo_run
    assert run.summary["ranks"]["count"] == 2 and run.summary["ranks"]["ranks"] == [0, 1]
    assert run.summary["ranks"]["communication"]["source"] == "cpu ops"
    for table in ("kernels.csv", "ops.csv"):
        frame = pd.read_csv(run.out_dir / table)
        assert sorted(frame["rank"].unique()) == [0, 1], table
        for r in (0, 1):  # each rank's rows are the single-file analysis' rows
            assert (frame["rank"] == r).sum() == len(pd.read_csv(singles[r].out_dir / table)), (table, r)
    assert (run.out_dir / "trace.json.gz").read_bytes() == (GLOO / "rank0.trace.json.gz").read_bytes()
    assert (run.out_dir / "trace-rank1.json.gz").read_bytes() == (GLOO / "rank1.trace.json.gz").read_bytes()
    assert json.loads((run.out_dir / "summary.json").read_text())["ranks"]["straggler"]["rank"] == 1


def test_gloo_per_rank_phases_are_the_single_rank_analyses(gloo_run: tuple) -> None:
    run, singles = gloo_run
    for r in (0, 1):
        assert run.summary["ranks"]["phases"][str(r)] == singles[r].summary["phases"], r
    assert run.summary["phases"] == singles[0].summary["phases"]
    # Step times per rank: each step's ProfilerStep range, as the single-rank timeline has it.
    for r in (0, 1):
        steps = {s["step"]: s["step_ms"][str(r)] for s in run.summary["ranks"]["steps"]}
        single = singles[r].summary["phases"]["trace"]
        assert len(steps) == single["steps"] == 4
        # rel 1e-6: these are end minus start of µs timestamps near 5e12, the timeline's are HTA's durations
        assert median(steps.values()) == pytest.approx(single["wall_ms_per_step"], rel=1e-6)


def test_gloo_straggler_is_rank_1_by_its_measured_excess(gloo_run: tuple) -> None:
    run, _ = gloo_run
    measured = {r: _compute_ms(GLOO / f"rank{r}.trace.json.gz") for r in (0, 1)}
    cross = run.summary["ranks"]
    for step in cross["steps"]:
        s = step["step"]
        # abs 10 ns: the figures are end minus start of µs timestamps near 5e12, float64 keeps ~1 ns of them
        assert step["compute_ms"] == pytest.approx({str(r): measured[r][s] for r in (0, 1)}, abs=1e-5)
        mid = (measured[0][s] + measured[1][s]) / 2
        straggler = step["straggler"]
        assert straggler["rank"] == 1 and straggler["excess_ms"] == pytest.approx(measured[1][s] - mid, abs=1e-5)
        assert straggler["excess_pct"] == pytest.approx(100 * (measured[1][s] - mid) / mid, rel=1e-4)
    overall = cross["straggler"]
    assert overall["rank"] == 1 and overall["steps"] == overall["of_steps"] == 4
    assert overall["mean_excess_ms"] > 0.5 and overall["mean_excess_pct"] > 50  # 12x the matmuls
    for r in ("0", "1"):
        assert cross["hta"][r] == {
            "idle_time": {"source": HTA_NO_KERNELS},
            "kernel_launches": {"source": HTA_NO_KERNELS},
        }


def test_report_has_a_ranks_table(gloo_run: tuple) -> None:
    run, singles = gloo_run
    page = (run.out_dir / "report.html").read_text()
    table = page[page.index('<table id="table-ranks">') : page.index("</table>", page.index('id="table-ranks"'))]
    rows = table.split("<tr>")[2:]  # after the head row
    assert len(rows) == 2 and "<td>1</td>" in rows[1] and "4 of 4 steps" in rows[1] and "0 of 4 steps" in rows[0]
    assert HTA_NO_KERNELS in rows[0]
    assert 'id="table-ranks"' not in (singles[0].out_dir / "report.html").read_text()


def test_a_list_of_files_is_the_folder(tmp_path: Path, gloo_run: tuple) -> None:
    run, _ = gloo_run
    listed = analyze([GLOO / "rank1.trace.json.gz", GLOO / "rank0.trace.json.gz"], out=tmp_path / "run")
    assert listed.summary["model"]["name"] == "rank1-2ranks"
    assert listed.summary["ranks"]["steps"] == run.summary["ranks"]["steps"]


def test_gpu_folder_counts_kernels_and_takes_hta_figures(tmp_path: Path) -> None:
    """Two copies of one GPU trace as ranks 0 and 1: identical ranks, no NCCL kernels, HTA's figures per rank."""
    folder = tmp_path / "ranks"
    folder.mkdir()
    with gzip.open(GPU_TRACE, "rt") as f:
        doc = json.load(f)
    for rank in (0, 1):
        with gzip.open(folder / f"rank{rank}.trace.json.gz", "wt") as f:
            json.dump({**doc, "distributedInfo": {"rank": rank}}, f)
    cross = analyze(folder, out=tmp_path / "run").summary["ranks"]
    assert cross["ranks"] == [0, 1] and cross["communication"]["source"] == "kernels"
    assert cross["phases"]["0"] == cross["phases"]["1"]
    for rank in ("0", "1"):
        assert cross["communication"]["per_rank"][rank]["comm_ms"] == 0.0
        assert cross["hta"][rank]["idle_time"]["source"] == cross["hta"][rank]["kernel_launches"]["source"] == "hta"
    assert all(step["straggler"]["excess_ms"] == 0.0 for step in cross["steps"])


def test_hta_figures_on_a_gpu_trace_and_on_a_file_it_cannot_load(tmp_path: Path) -> None:
    figures = hta_figures({0: GPU_TRACE}, {0: True})["0"]
    assert figures["idle_time"]["source"] == "hta" and figures["idle_time"]["idle_ms"]["host_wait"] > 0
    launches = figures["kernel_launches"]
    kernels = sum(1 for e in events_of(GPU_TRACE) if e.get("cat") == "kernel")
    assert launches["source"] == "hta" and 0 < launches["launches"] <= kernels and launches["median_gpu_us"] > 0
    broken = hta_figures({0: tmp_path / "absent.trace.json.gz"}, {0: True})["0"]
    assert broken["idle_time"]["source"].startswith("unavailable: HTA could not load the traces")


# --- bad folders ---------------------------------------------------------------------------------------------


def test_bad_folder_without_traces(tmp_path: Path) -> None:
    (tmp_path / "ranks").mkdir()
    (tmp_path / "ranks" / "notes.txt").write_text("rank 0 and rank 1")
    _bad([str(tmp_path / "ranks")], "holds no .json or .json.gz trace files", tmp_path)


def test_bad_ranks_from_different_devices(tmp_path: Path) -> None:
    folder = tmp_path / "ranks"
    folder.mkdir()
    shutil.copyfile(GLOO / "rank1.trace.json.gz", folder / "rank1.trace.json.gz")
    shutil.copyfile(GPU_TRACE, folder / "rank0.trace.json.gz")  # no distributedInfo: rank 0, on an H200
    _bad([str(folder)], "the ranks ran on different devices (rank 0 on NVIDIA H200, rank 1 on the CPU)", tmp_path)


def test_bad_two_files_claiming_one_rank(tmp_path: Path) -> None:
    folder = tmp_path / "ranks"
    folder.mkdir()
    for name in ("a.trace.json.gz", "b.trace.json.gz"):
        shutil.copyfile(GLOO / "rank0.trace.json.gz", folder / name)
    _bad([str(folder)], "both claim rank 0", tmp_path)


def test_bad_damaged_rank_in_a_folder(tmp_path: Path) -> None:
    folder = tmp_path / "ranks"
    folder.mkdir()
    shutil.copyfile(GLOO / "rank0.trace.json.gz", folder / "rank0.trace.json.gz")
    (folder / "rank1.trace.json").write_text("not json")
    _bad([str(folder)], "is not JSON", tmp_path)


def test_cli_takes_several_trace_files_as_ranks(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from fusionscope.cli import app

    files = sorted(GLOO.glob("*.trace.json.gz"))
    result = CliRunner().invoke(app, ["analyze", *map(str, files), "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["ranks"]["count"] == 2 and set(summary["ranks"]["phases"]) == {"0", "1"}
    assert set(pd.read_csv(tmp_path / "run" / "kernels.csv")["rank"]) == {0, 1}


def test_execution_traces_in_a_folder_are_not_ranks(tmp_path: Path) -> None:
    folder = tmp_path / "ranks"
    shutil.copytree(GLOO, folder)
    (folder / "rank0.et.json").write_text('{"schema": "1.1.1", "nodes": []}')
    run = analyze(folder, out=tmp_path / "run")
    assert run.summary["ranks"]["count"] == 2


# --- one file holding several ranks ----------------------------------------------------------------------------

MERGED = DATA / "traces" / "gloo-2ranks-merged.trace.json.gz"


def test_a_merged_file_splits_back_into_each_ranks_own_trace(tmp_path: Path) -> None:
    """TraceFuse's offsets undone: each rank's events come back with the ids its process wrote and nothing else."""
    from fusionscope import merged_ranks

    files = merged_ranks.split(MERGED, tmp_path)
    assert files is not None and [f.name for f in files] == ["rank0.trace.json.gz", "rank1.trace.json.gz"]
    for rank, file in enumerate(files):
        with gzip.open(file, "rt") as f:
            doc = json.load(f)
        assert doc["distributedInfo"]["rank"] == rank
        assert doc["traceEvents"] == events_of(GLOO / f"rank{rank}.trace.json.gz")
    assert merged_ranks.split(GLOO / "rank0.trace.json.gz", tmp_path / "plain") is None  # one rank: left alone


def test_analyze_takes_a_merged_file_as_the_folder_of_its_ranks(tmp_path: Path) -> None:
    """Per-rank figures, the cross-rank section and the catalogue come out as for the two rank files; the run is
    named after the merged file, which every rank's path points to."""
    folder = analyze(GLOO, out=tmp_path / "folder").summary
    merged = analyze(MERGED, out=tmp_path / "merged").summary
    assert merged["ranks"]["count"] == 2 and merged["ranks"]["merged_from"] == str(MERGED.resolve())
    assert merged["ranks"]["phases"] == folder["ranks"]["phases"]
    for key in ("steps", "straggler"):
        assert merged["ranks"].get(key) == folder["ranks"].get(key), key
    assert merged["phases"] == folder["phases"] and merged["opportunities"] == folder["opportunities"]
    assert {e["path"] for e in merged["ranks"]["files"].values()} == {str(MERGED.resolve())}
    assert merged["model"]["name"] == "gloo-2ranks-merged"
    assert (tmp_path / "merged" / "trace-rank1.json.gz").is_file()
