"""`profile --nproc N` on the CPU: gloo ranks launched through torchrun, a tiny Llama sharded along its
tensor-parallel plan, one trace per rank, rank 0's run folder with the cross-rank figures; the tensor-parallel
fusion (all-reduce + residual add + RMSNorm) found on the ranks' dataflow and estimated; `--nproc 1` against a plain
run; and every bad input as one line before any rank starts."""

from __future__ import annotations

import gzip
import json
import os
import re
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.distributed as dist
from typer.testing import CliRunner

from fusionscope import distributed, models
from fusionscope.cli import app
from fusionscope.errors import UsageError
from fusionscope.fusions import Graph, find_matches
from fusionscope.fusions import allreduce_add_rms_norm as tp_fusion
from fusionscope.run import command_line

runner = CliRunner()
WORKLOAD = ["--prompt-len", "16", "--decode-steps", "3"]
LAYERS = models.PRESETS["tiny-llama"]["num_hidden_layers"]


def _profile(out: Path, *extra: str) -> Path:
    result = runner.invoke(app, ["profile", "--out", str(out), *WORKLOAD, *extra])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _profile(tmp_path_factory.mktemp("nproc") / "tp2", "--nproc", "2")


def _summary(folder: Path) -> dict:
    return json.loads((folder / "summary.json").read_text())


# --- two gloo ranks, end to end ---------------------------------------------------------------------------------


def test_two_ranks_write_one_run_folder_with_a_trace_per_rank(tp_run: Path) -> None:
    assert sorted(str(p.relative_to(tp_run)) for p in tp_run.rglob("*")) == [
        "kernels.csv", "opportunities.csv", "ops.csv", "report.html", "summary.json", "trace.json.gz", "traces",
        "traces/rank0.json.gz", "traces/rank1.json.gz",
    ]  # fmt: skip
    assert not list(tp_run.parent.glob(".*partial"))  # no staging folder (or rank scratch) left behind
    for rank in (0, 1):  # the tag HTA's regex reads, and torch's own distributedInfo after it
        with gzip.open(tp_run / "traces" / f"rank{rank}.json.gz", "rt") as f:
            head = f.read(1 << 14)
        assert re.search(r'"distributedInfo": \{"rank": (\d+)', head).group(1) == str(rank)
        assert '"backend": "gloo"' in head and '"world_size": 2' in head
    summary = _summary(tp_run)
    assert summary["model"]["nproc"] == 2
    assert summary["command"] == command_line()  # the command as typed in the CLI process, not a rank's


def test_rank0_assembles_every_rank_and_the_cross_rank_figures(tp_run: Path) -> None:
    summary = _summary(tp_run)
    ranks = summary["ranks"]
    assert ranks["count"] == 2 and ranks["ranks"] == [0, 1]
    assert {k: v["file"] for k, v in ranks["files"].items()} == {"0": "traces/rank0.json.gz",
                                                                 "1": "traces/rank1.json.gz"}  # fmt: skip
    assert all(Path(v["path"]).is_file() for v in ranks["files"].values())  # the final folder's, not the staging's
    assert ranks["phases"]["0"] == summary["phases"]
    for rank in ("0", "1"):
        phases = ranks["phases"][rank]
        assert set(phases) == {"prefill", "decode"} and phases["decode"]["steps"] == 3
        assert phases["decode"]["wall_ms_per_step_unprofiled"] > 0  # each rank's own timed pass
        comm = ranks["communication"]["per_rank"][rank]
        assert comm["comm_ms"] > 0 and comm["compute_ms"] > 0  # gloo collectives against the other ops
    assert ranks["communication"]["source"] == "cpu ops"
    assert {s["step"] for s in ranks["steps"]} == set(range(6))  # 3 prefill repeats + 3 decode steps, both ranks
    assert ranks["straggler"]["rank"] in (0, 1)
    kernels = pd.read_csv(tp_run / "kernels.csv", keep_default_na=False)
    ops = pd.read_csv(tp_run / "ops.csv", keep_default_na=False)
    assert set(kernels["rank"]) == {0, 1} and set(ops["rank"]) == {0, 1}
    for frame in (kernels, ops):  # the same workload on both ranks: the same ops, rank by rank
        counts = {rank: part["name"].value_counts().to_dict() for rank, part in frame.groupby("rank")}
        assert counts[0] == counts[1]
    assert 'id="table-ranks"' in (tp_run / "report.html").read_text()


def test_the_model_is_sharded_along_its_plan(tp_run: Path) -> None:
    tp = _summary(tp_run)["tensor_parallel"]
    assert tp["nproc"] == 2 and tp["backend"] == "gloo"
    plan = tp["plan"]
    assert plan["model.layers.*.self_attn.o_proj"] == "rowwise" and plan["model.layers.*.mlp.down_proj"] == "rowwise"
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise" and plan["model.layers.*.mlp.gate_proj"] == "colwise"
    ops = pd.read_csv(tp_run / "ops.csv", keep_default_na=False)
    rank0 = ops[(ops["rank"] == 0) & (ops["phase"] == "decode")]
    # an all-reduce after each row-sharded projection: o_proj and down_proj in every layer, every step
    per_step = rank0[rank0["name"] == "c10d::allreduce_"].groupby("step")["module"].apply(set)
    rowwise = {f"model.layers.{i}.{m}" for i in range(LAYERS) for m in ("self_attn.o_proj", "mlp.down_proj")}
    assert all(rowwise <= modules for modules in per_step)
    hidden = models.PRESETS["tiny-llama"]["hidden_size"]
    q = rank0[(rank0["name"] == "aten::mm") & (rank0["module"] == "model.layers.0.self_attn.q_proj")]
    assert q["input_dims"].iat[0].endswith(f"[{hidden}, {hidden // 2}]]")  # half of q_proj's columns on this rank


def test_the_tp_fusion_takes_the_add_and_norm_after_every_all_reduce(tp_run: Path) -> None:
    summary = _summary(tp_run)
    found = {(o["fusion"], o["phase"]): o for o in summary["opportunities"]}
    expected = sorted([f"model.layers.{i}.post_attention_layernorm" for i in range(LAYERS)]
                      + [f"model.layers.{i}.input_layernorm" for i in range(1, LAYERS)] + ["model.norm"])  # fmt: skip
    for phase in ("prefill", "decode"):
        tp = found[(tp_fusion.KEY, phase)]
        assert tp["count"] == 2 * LAYERS and tp["module_paths"] == expected
        assert (("add_rms_norm", phase)) not in found  # the TP entry comes first and claims these sites
        assert found[("rms_norm", phase)]["module_paths"] == ["model.layers.0.input_layernorm"]  # no add before it
        est = summary["tensor_parallel"]["fusion"][phase]
        assert est["sites"] == 2 * LAYERS and est["all_reduces"] >= 2 * LAYERS
        assert est["all_reduce_bytes"] > 0 and est["launches_fused"] == 2 * LAYERS
        assert est["t_now_us"] >= est["t_fused_us"] >= est["all_reduce_us"] * est["sites"] / est["all_reduces"]
        assert est["confidence"] == "low" and "gloo" in est["reason"]  # a CPU run: nothing is a kernel to fuse


# --- --nproc 1 against a plain run ---------------------------------------------------------------------------


def test_nproc_1_is_the_plain_run_through_the_launcher(tmp_path: Path) -> None:
    plain = _summary(_profile(tmp_path / "plain"))
    one_dir = _profile(tmp_path / "one", "--nproc", "1")
    one = _summary(one_dir)
    assert (one_dir / "traces" / "rank0.json.gz").is_file() and one["ranks"]["count"] == 1
    assert one["tensor_parallel"]["plan"] == {} and one["model"].pop("nproc") == 1
    assert one["model"] == plain["model"]  # same model, same parameters (nothing sharded)
    for name, ph in plain["phases"].items():
        assert one["phases"][name]["steps"] == ph["steps"]
        assert one["phases"][name]["ops_per_step"] == ph["ops_per_step"]
    assert one["dataflow"]["nodes"] == plain["dataflow"]["nodes"]

    def found(s: dict) -> list:
        return sorted((o["fusion"], o["phase"], o["count"], tuple(o["module_paths"])) for o in s["opportunities"])

    assert found(one) == found(plain) and ("add_rms_norm", "decode") in {f[:2] for f in found(plain)}
    columns = ["phase", "step", "name", "module"]
    kernels = {k: pd.read_csv(d / "kernels.csv", keep_default_na=False)[columns] for k, d in
               (("plain", tmp_path / "plain"), ("one", one_dir))}  # fmt: skip
    assert kernels["one"].equals(kernels["plain"])


# --- the shards are the slices of one model ----------------------------------------------------------------------


def _sharded_logits(rank: int, world: int, port: int, folder: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    spec = models.resolve_model("tiny-llama")
    mesh = init_device_mesh("cpu", (world,))
    model, applied, params = distributed.build_module(spec, torch.device("cpu"), torch.float32, mesh, world)
    ids = torch.arange(3, 3 + 11).reshape(1, 11) * 7 % 1000
    with torch.inference_mode():
        logits = model(ids).logits
    q = model.model.layers[0].self_attn.q_proj.weight.to_local()
    torch.save({"logits": logits, "q_shape": tuple(q.shape), "params": params, "applied": applied},
               Path(folder) / f"rank{rank}.pt")  # fmt: skip
    dist.destroy_process_group()


def test_two_shards_compute_what_the_whole_model_computes(tmp_path: Path, two_gloo_ranks) -> None:
    two_gloo_ranks(_sharded_logits, str(tmp_path))
    torch.manual_seed(0)
    spec = models.resolve_model("tiny-llama")
    whole, applied, params = distributed.build_module(spec, torch.device("cpu"), torch.float32, None, 1)
    assert applied == {}
    ids = torch.arange(3, 3 + 11).reshape(1, 11) * 7 % 1000
    with torch.inference_mode():
        reference = whole(ids).logits
    hidden = models.PRESETS["tiny-llama"]["hidden_size"]
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["q_shape"] == (hidden // 2, hidden) and got["params"] == params
        assert got["applied"]["model.layers.*.mlp.down_proj"] == "rowwise"
        torch.testing.assert_close(got["logits"], reference, atol=1e-4, rtol=1e-4)  # fp32, summed in another order
    assert reference.abs().max() > 0.1  # a real signal, not zeros


# --- bad input: one line, before any rank starts ------------------------------------------------------------


def _refused(args: list[str], message: str, tmp_path: Path) -> None:
    out = tmp_path / "never"
    result = runner.invoke(app, ["profile", *args, "--out", str(out), *WORKLOAD])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.output
    assert not out.exists() and not list(tmp_path.glob(".*partial"))


def test_bad_nproc_below_one(tmp_path: Path) -> None:
    _refused(["--nproc", "0"], "--nproc must be ≥ 1 (got 0)", tmp_path)


def test_bad_model_without_a_tensor_parallel_plan(tmp_path: Path) -> None:
    _refused(["gpt2", "--nproc", "2"], "gpt2 (gpt2) has no tensor-parallel plan in its config", tmp_path)
    factory = f"{Path(__file__).resolve().parents[1] / 'examples' / 'custom_factory.py'}:make_mlp"
    _refused([factory, "--nproc", "2"], "file.py:factory model, which has no tensor-parallel plan", tmp_path)


def test_bad_heads_not_divisible(tmp_path: Path) -> None:
    _refused(["--nproc", "3"], "--nproc 3 does not divide tiny-llama's 4 attention heads", tmp_path)
    folder = tmp_path / "model"
    folder.mkdir()
    config = {**models.PRESETS["tiny-llama"], "num_attention_heads": 8, "num_key_value_heads": 2}
    (folder / "config.json").write_text(json.dumps(config))
    _refused([str(folder), "--nproc", "4"], "--nproc 4 does not divide model's 2 KV heads", tmp_path)


def test_bad_more_ranks_than_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(UsageError, match="--nproc 4 needs 4 GPUs, but this machine has 2"):
        distributed.check_nproc(models.resolve_model("tiny-llama"), torch.device("cuda"), 4)
    assert distributed.check_nproc(models.resolve_model("tiny-llama"), torch.device("cpu"), 2)  # gloo ranks: allowed


def test_a_rank_that_refuses_its_input_is_one_line(tmp_path: Path) -> None:
    """Checks only a built model can make (here its positions) run in the ranks; the first rank's line is the
    CLI's, and nothing is written."""
    out = tmp_path / "never"
    result = runner.invoke(app, ["profile", "--nproc", "2", "--out", str(out), "--prompt-len", "4097",
                                 "--decode-steps", "1"])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[-1].startswith("fusionscope: error: rank ")
    assert "exceeds the model's 4096" in result.output
    assert not out.exists() and not list(tmp_path.glob(".*partial"))


# --- the TP fusion's parts --------------------------------------------------------------------------------------


def _graph(rows: list[tuple[int, str, tuple[int, ...]]]) -> Graph:
    consumers: dict[int, list[int]] = {r[0]: [] for r in rows}
    for node, _name, inputs in rows:
        for p in inputs:
            if p >= 0:
                consumers[p].append(node)
    return Graph(pd.DataFrame({
        "node": [r[0] for r in rows], "name": [r[1] for r in rows], "inputs": [r[2] for r in rows],
        "consumers": [tuple(consumers[r[0]]) for r in rows], "module": "model.layers.0.post_attention_layernorm",
        "phase": "decode", "step": 0, "is_view": [r[1] == "aten::view" for r in rows],
    }))  # fmt: skip


def _layer(reduce: str) -> list[tuple[int, str, tuple[int, ...]]]:
    """residual (0) + projection output (2, a view of mm 1) → add → RMSNorm; `reduce` says how 2 is all-reduced."""
    head = [(0, "aten::mul", (-1,)), (1, "aten::mm", (-1, -1)), (2, "aten::view", (1,))]
    norm = [(11, "aten::pow", (10,)), (12, "aten::mean", (11,)), (13, "aten::add", (12,)), (14, "aten::rsqrt", (13,)),
            (15, "aten::mul", (10, 14)), (16, "aten::mul", (15, -1))]  # fmt: skip
    if reduce == "in place":  # c10d::allreduce_ reads the view and hands the same tensor back: the add reads 2
        return [*head, (3, "c10d::allreduce_", (2,)), (10, "aten::add", (0, 2)), *norm]
    if reduce == "functional":  # DTensor's redistribute: all_reduce → wait_tensor → the add
        return [*head, (3, "_c10d_functional::all_reduce", (2,)), (4, "_c10d_functional::wait_tensor", (3,)),
                (10, "aten::add", (0, 4)), *norm]  # fmt: skip
    return [*head, (10, "aten::add", (0, 2)), *norm]


@pytest.mark.parametrize("reduce", ["in place", "functional"])
def test_tp_fusion_matches_the_add_and_norm_after_an_all_reduce(reduce: str) -> None:
    graph = _graph(_layer(reduce))
    (match,) = find_matches(graph)
    assert match.fusion == tp_fusion.KEY and set(match.nodes) == {10, 11, 12, 13, 14, 15, 16}
    assert tp_fusion.reduced_by(graph, graph.producers(10)[1]) == 3


def test_without_an_all_reduce_the_add_and_norm_stay_add_rms_norm() -> None:
    graph = _graph(_layer("none"))
    assert tp_fusion.find(graph) == []
    assert [m.fusion for m in find_matches(graph)] == ["add_rms_norm"]


def test_all_reduce_per_step_counts_the_collectives_and_times_their_kernels() -> None:
    ops = pd.DataFrame({
        "name": ["c10d::allreduce_", "c10d::allreduce_", "aten::add", "c10d::allreduce_", "c10d::allreduce_"],
        "phase": ["decode", "decode", "decode", "decode", "decode"], "step": [0, 0, 0, 1, 1],
        "input_dims": ["[[[1, 1, 64]], [], []]", "[[[1, 1, 64]], [], []]", "[[1, 64], [1, 64]]",
                       [[[1, 1, 64]], []], [[[1, 1, 64]], []]],
    })  # fmt: skip
    kernels = pd.DataFrame({
        "name": ["ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "ncclDevKernel_AllReduce_Sum_bf16_RING_LL",
                 "ncclDevKernel_AllGather_RING_LL", "elementwise", "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"],
        "op": ["c10d::allreduce_"] * 3 + ["aten::add", "c10d::allreduce_"],
        "phase": ["decode"] * 5, "step": [0, 0, 0, 0, 1], "dur_us": [5.0, 7.0, 100.0, 3.0, 4.0],
    })  # fmt: skip
    (row,) = tp_fusion.all_reduce_per_step(kernels, ops, "cuda", 2).to_dict("records")
    assert row == {"phase": "decode", "count": 2.0, "us": (12.0 + 4.0) / 2, "bytes": 2 * 64 * 2.0}
    (cpu,) = tp_fusion.all_reduce_per_step(kernels.assign(name=kernels["op"]), ops, "cpu", 4).to_dict("records")
    assert cpu["us"] == (5 + 7 + 100 + 4) / 2 and cpu["bytes"] == 2 * 64 * 4.0  # the ops' time on the CPU


def test_estimate_keeps_the_all_reduce_and_removes_the_read_back() -> None:
    opp = {"count": 4.0, "t_now_us": 40.0, "t_fused_us": 6.0, "launches_now": 36.0}
    comm = {"count": 5.0, "us": 50.0, "bytes": 5 * 8192.0}  # one all-reduce outside the norm sites (an embedding's)
    est = tp_fusion.estimate_phase(opp, comm, copy_gbps=4096.0, device_kind="cuda")
    site_us, read_back_us = 40.0, 4 * 8192.0 / 4096e3
    assert est["t_now_us"] == pytest.approx(site_us + 40.0)
    assert est["t_fused_us"] == pytest.approx(site_us + 6.0 - read_back_us)
    assert est["saved_us"] == pytest.approx(40.0 - 6.0 + read_back_us)
    assert est["launches_now"] == 40.0 and est["launches_fused"] == 4.0 and est["confidence"] == "medium"
    assert tp_fusion.estimate_phase(opp, {**comm, "us": 0.0}, 4096.0, "cuda")["confidence"] == "low"
    assert tp_fusion.estimate_phase(None, comm, 4096.0, "cuda")["saved_us"] is None


def test_a_rank_that_crashes_is_named_with_its_error_and_its_log_kept(tmp_path: Path) -> None:
    (tmp_path / "launch.log").write_text(
        "[rank1]: Traceback (most recent call last):\n[rank1]:   File \"x.py\", line 1\n"
        "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
    )  # fmt: skip
    error = distributed.rank_failure(tmp_path, 2, 1)
    assert isinstance(error, RuntimeError) and not isinstance(error, UsageError)
    assert "a rank failed (torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB)" in str(error)
    kept = Path(str(error).rsplit(" ", 1)[1])
    assert kept.read_text() == (tmp_path / "launch.log").read_text()
    kept.unlink()
    (tmp_path / "error-rank1.txt").write_text("rank 1: --batch and --prompt-len must be ≥ 1")
    assert str(distributed.rank_failure(tmp_path, 2, 2)) == "rank 1: --batch and --prompt-len must be ≥ 1"


def test_ranks_start_through_torchrun_with_nvlink_multicast_off() -> None:
    command = distributed.launch_command(Path("job.json"), 4)
    assert command[1:3] == ["-m", "torch.distributed.run"] and "--nproc-per-node=4" in command
    assert command[-3:] == ["-m", "fusionscope.distributed", "job.json"]
    env = distributed.rank_env()
    assert env["NCCL_NVLS_ENABLE"] == "0"
    assert str(Path(distributed.__file__).resolve().parents[1]) in env["PYTHONPATH"].split(os.pathsep)
