"""The recorded dataflow on tiny-llama (prompt 8, 2 decode steps: steps 0–2 prefill, 3–4 decode) and on the example
factory, and its join to a real CPU capture of the same workloads."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

from fusionscope import capture, dataflow, models, trace

REPO = Path(__file__).resolve().parents[1]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DECODE_STEPS = (3, 4)


def llama() -> models.Workload:
    spec = models.resolve_model("tiny-llama")
    return models.build_workload(spec, torch.device("cpu"), torch.float32, prompt_len=8, decode_steps=2)


def mlp() -> models.Workload:
    spec = models.resolve_model(f"{REPO / 'examples' / 'custom_factory.py'}:make_mlp")
    return models.build_workload(spec, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def nodes() -> pd.DataFrame:
    return dataflow.record_dataflow(llama())


def only(frame: pd.DataFrame) -> pd.Series:
    assert len(frame) == 1, frame[["node", "module", "name"]]
    return frame.iloc[0]


def test_columns_and_steps(nodes: pd.DataFrame) -> None:
    assert list(nodes.columns) == dataflow.NODE_COLUMNS
    assert list(nodes["node"]) == list(range(len(nodes)))
    per_step = nodes.groupby("step")["phase"].agg(set)
    assert per_step.to_dict() == {0: {"prefill"}, 1: {"prefill"}, 2: {"prefill"}, 3: {"decode"}, 4: {"decode"}}
    assert nodes["name"].str.startswith("aten::").all()
    # Composites are recorded as the ops eager execution decomposes them into, which is where kernels hang.
    assert not nodes["name"].isin(["aten::linear", "aten::matmul", "aten::to", "aten::reshape"]).any()
    # Every producer precedes its consumer, and `consumers` is exactly the inverse of `inputs`.
    edges = {(p, n) for n, ins in zip(nodes["node"], nodes["inputs"]) for p in ins if p >= 0}
    assert all(p < n for p, n in edges)
    assert edges == {(n, c) for n, cs in zip(nodes["node"], nodes["consumers"]) for c in cs}


def test_rmsnorm_chain_is_connected(nodes: pd.DataFrame) -> None:
    for step in DECODE_STEPS:
        norm = nodes[(nodes["step"] == step) & (nodes["module"] == "model.layers.0.input_layernorm")]
        rsqrt = only(norm[norm["name"] == "aten::rsqrt"])
        chain = [rsqrt]
        while chain[0]["name"] != "aten::pow":  # walk up through first inputs
            chain.insert(0, nodes.loc[chain[0]["inputs"][0]])
        (consumer,) = rsqrt["consumers"]
        chain.append(nodes.loc[consumer])
        assert [n["name"] for n in chain] == ["aten::pow", "aten::mean", "aten::add", "aten::rsqrt", "aten::mul"]
        assert chain[2]["scalars"] == ("1e-06",)  # eps
        assert {n["module"] for n in chain} == {"model.layers.0.input_layernorm"}


def test_residual_has_consumers_outside_its_module(nodes: pd.DataFrame) -> None:
    """The attention residual add feeds the post-attention norm and the MLP residual add: an intermediate read outside
    any group made of the norm alone, which is what adjacency cannot see."""
    layer = nodes[(nodes["step"] == 4) & (nodes["module"] == "model.layers.0")]
    first, second = layer[layer["name"] == "aten::add"]["node"]
    readers = nodes.loc[list(nodes.at[first, "consumers"])]
    assert len(readers) >= 2
    assert second in set(readers["node"])
    in_norm = readers[readers["module"] == "model.layers.0.post_attention_layernorm"]
    assert set(in_norm["name"]) == {"aten::pow", "aten::mul"}  # fp32: the norm's `.to(float32)` is a no-op


def test_swiglu(nodes: pd.DataFrame) -> None:
    for layer in (0, 1):
        prefix = f"model.layers.{layer}.mlp"
        step = nodes[nodes["step"] == 4]
        silu = only(step[(step["module"] == f"{prefix}.act_fn") & (step["name"] == "aten::silu")])
        (mul_id,) = silu["consumers"]
        mul = nodes.loc[mul_id]
        assert (mul["name"], mul["module"]) == ("aten::mul", prefix)
        (other,) = [p for p in mul["inputs"] if p != silu["node"]]
        up = nodes.loc[dataflow.through_views(nodes, other)]  # `_unsafe_view` closes matmul's decomposition
        assert (up["name"], up["module"]) == ("aten::mm", f"{prefix}.up_proj")
        gate = nodes.loc[dataflow.through_views(nodes, silu["inputs"][0])]
        assert (gate["name"], gate["module"]) == ("aten::mm", f"{prefix}.gate_proj")


def test_one_mm_per_projection(nodes: pd.DataFrame) -> None:
    for step in DECODE_STEPS:
        mm = nodes[(nodes["step"] == step) & (nodes["name"] == "aten::mm")]
        assert len(mm) == 2 * 7 + 1
        assert sorted(mm["module"]) == sorted(
            [f"model.layers.{i}.{'mlp' if p.endswith(('gate_proj', 'up_proj', 'down_proj')) else 'self_attn'}.{p}"
             for i in range(2) for p in PROJECTIONS] + ["lm_head"]
        )  # fmt: skip
        # The weight reaches mm through `aten::t` of a parameter: a leaf.
        for weight in mm["inputs"].str[1]:
            assert nodes.at[weight, "name"] == "aten::t" and nodes.at[weight, "inputs"] == (dataflow.LEAF,)


def test_kv_cache_chains_across_steps(nodes: pd.DataFrame) -> None:
    """DynamicCache grows by `torch.cat([cache, new], -2)`: each decode step's cat reads the previous step's cat."""
    for step in DECODE_STEPS:
        attn = nodes[(nodes["step"] == step) & (nodes["module"] == "model.layers.0.self_attn")]
        cache_cats = attn[(attn["name"] == "aten::cat") & (attn["scalars"] == ("-2",))]
        assert len(cache_cats) == 2  # keys, values
        for cat in cache_cats.itertuples():
            previous = nodes.loc[cat.inputs[0]]
            assert previous["name"] == "aten::cat" and previous["step"] == step - 1
            assert previous["module"] == "model.layers.0.self_attn"
            assert cat.input_shapes[0][2] + 1 == cat.output_shapes[0][2]  # one more position
            sdpa = nodes.loc[cat.consumers[0]]
            assert sdpa["name"].startswith("aten::_scaled_dot_product")


def test_inplace_write_through_a_view_becomes_the_producer() -> None:
    """A static cache written through a slice (`copy_`) and read through its base: the read must see the write."""

    class StaticCache(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("cache", torch.zeros(4, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.cache[1:2].copy_(x * 2)
            self.cache.add_(1)
            return self.cache.sum()

    spec = models.ModelSpec(name="static", source="factory")
    x = torch.ones(1, 8)
    wl = models.Workload(spec, StaticCache(), torch.device("cpu"), torch.float32, ("forward",), inputs=(x,))
    got = dataflow.record_dataflow(wl)
    first = got[got["step"] == 0].set_index("name")
    assert first.at["aten::copy_", "inplace"] and first.at["aten::slice", "is_view"]
    assert first.at["aten::copy_", "inputs"] == (first.at["aten::slice", "node"], first.at["aten::mul", "node"])
    assert first.at["aten::add_", "inputs"] == (first.at["aten::copy_", "node"],)  # the base, read after the write
    assert first.at["aten::sum", "inputs"] == (first.at["aten::add_", "node"],)
    second = got[got["step"] == 1].set_index("name")
    assert second.at["aten::slice", "inputs"] == (first.at["aten::add_", "node"],)  # state from the step before


def test_no_tensor_kept_alive() -> None:
    """Weak references to every MLP activation die as soon as the model drops them, during the pass — the recorder
    holds no strong reference (it keys by weak reference) — and the result holds only plain Python values."""
    wl = llama()
    refs: list[weakref.ref] = []
    alive_at_step_start: list[int] = []

    def keep_ref(_m: torch.nn.Module, _args: Any, out: torch.Tensor) -> None:
        refs.append(weakref.ref(out))

    def count_alive(_m: torch.nn.Module, _args: Any) -> None:
        alive_at_step_start.append(sum(r() is not None for r in refs))

    hooks = [
        wl.module.model.layers[0].mlp.act_fn.register_forward_hook(keep_ref),
        wl.module.register_forward_pre_hook(count_alive),
    ]
    try:
        got = dataflow.record_dataflow(wl)
    finally:
        for h in hooks:
            h.remove()
    gc.collect()
    assert len(refs) == 5 and alive_at_step_start == [0] * 5
    assert all(r() is None for r in refs)
    cells = [v for col in ("inputs", "input_shapes", "output_shapes", "scalars", "consumers") for v in got[col]]
    assert not any(isinstance(x, torch.Tensor) for cell in cells for x in _flatten(cell))


def _flatten(value: Any) -> list[Any]:
    return [y for x in value for y in _flatten(x)] if isinstance(value, tuple) else [value]


def _timed_shapes(dims: list) -> list[tuple[int, ...]]:
    """The profiler's `input_dims` as the recorder's non-scalar tensor shapes: tensor lists flattened, [] dropped."""
    out: list[tuple[int, ...]] = []
    for d in dims:
        if d and isinstance(d[0], list):
            out += [tuple(x) for x in d if x]
        elif d:
            out.append(tuple(d))
    return out


@pytest.mark.parametrize("build", [llama, mlp], ids=["tiny-llama", "factory"])
def test_join_to_the_timed_pass(build: Any, tmp_path: Path) -> None:
    wl = build()
    ops = trace.load_timeline(capture.capture(wl, tmp_path).trace_path).ops
    joined = dataflow.join_dataflow(dataflow.record_dataflow(wl), ops)
    assert joined.attrs["join_rate"] == dataflow.join_rate(joined) >= 0.95
    matched = joined[joined["op_id"] >= 0].merge(ops, on="op_id", suffixes=("", "_timed"))
    assert matched["op_id"].is_unique and len(matched) == (joined["op_id"] >= 0).sum()
    timed_name = matched["name_timed"].map(lambda n: dataflow.PROFILER_ALIASES.get(n, n))
    assert (matched["name"] == timed_name).all()
    for col in ("step", "phase", "module"):
        assert (matched[col] == matched[col + "_timed"]).all(), col
    # Shapes play no part in the join, so agreeing on every input shape says each pair is the same op instance.
    shapes = [
        [s for s in mine if s] == _timed_shapes(dims)
        for mine, dims in zip(matched["input_shapes"], matched["input_dims"])
    ]
    assert all(shapes)
    # The matched gemm is the one that did the work, not the `aten::linear` around it.
    assert (matched[matched["name"] == "aten::mm"]["self_us"] > 0).all()

    owners = dataflow.op_owners(joined, ops)
    assert (owners[matched["op_id"]].to_numpy() == matched["node"].to_numpy()).all()
    inner = ops[ops["parent_op"].isin(matched["op_id"])]  # kernel-internal calls: owned by the node around them
    assert len(inner) and (owners[inner["op_id"]].to_numpy() == owners[inner["parent_op"]].to_numpy()).all()
    composites = ops[ops["name"].isin(["aten::linear", "aten::matmul"])]  # above any node: nobody's
    assert len(composites) and (owners[composites["op_id"]] == dataflow.LEAF).all()


def test_cuda_kernels_reach_their_nodes() -> None:
    """Against the H200 fixture (bf16, prompt 32, 4 decode steps; torch 2.11): a CPU recording of the same workload
    joins although a few ops decompose differently per device (rotary's matmul, the SDPA backend), and nearly all
    kernel time lands on a node through `op_owners` — kernels hang off ops the recorder never sees, like the
    `aten::copy_` inside `aten::_to_copy`."""
    spec = models.resolve_model("tiny-llama")
    wl = models.build_workload(spec, torch.device("cpu"), torch.bfloat16, prompt_len=32, decode_steps=4)
    timeline = trace.load_timeline(REPO / "tests" / "data" / "tiny-llama-cuda.trace.json.gz")
    joined = dataflow.join_dataflow(dataflow.record_dataflow(wl), timeline.ops)
    assert joined.attrs["join_rate"] >= 0.9
    owners = dataflow.op_owners(joined, timeline.ops)
    node = timeline.kernels["op_id"].map(owners).fillna(dataflow.LEAF).astype("int64")
    owned = timeline.kernels[node >= 0]
    assert owned["dur_us"].sum() >= 0.9 * timeline.kernels["dur_us"].sum()
    direct = timeline.kernels["op_id"].isin(joined["op_id"])
    assert (node >= 0).sum() > direct.sum()  # `op_owners` reaches kernels that the direct op_id does not
    gemm_nodes = joined.set_index("node").loc[node[timeline.kernels["op"] == "aten::mm"]]
    assert len(gemm_nodes) and (gemm_nodes["name"] == "aten::mm").all()
    assert gemm_nodes["module"].str.endswith((*PROJECTIONS, "lm_head")).all()


def test_align_skips_extra_ops_on_either_side() -> None:
    a = ["t", "view", "mm", "add", "view", "mul"]
    b = ["t", "view", "mm", "extra", "add", "mul"]
    assert dataflow._align(a, b) == [(0, 0), (1, 1), (2, 2), (3, 4), (5, 5)]
    assert dataflow._align(a, a) == [(i, i) for i in range(len(a))]
    assert dataflow._align([], b) == []
