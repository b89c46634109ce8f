"""Inductor's reasons for running a reduce-overhead compile without CUDA graphs reach the graph stage's rows."""

import torch
from torch._inductor import cudagraph_utils

from fusionscope.apply.cudagraph_skips import cudagraph_skips, skip_lines


def test_a_logged_reason_is_collected_only_while_entered():
    reason = "skipping cudagraphs due to mutated inputs (2 instances). Found from : \n  File model.py, line 3"
    with cudagraph_skips() as seen:
        cudagraph_utils.log_cudagraph_skip_and_bump_counter(reason)
    cudagraph_utils.log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to cpu device")
    assert seen == [reason]
    lines = skip_lines({"variants": {"torch.compile": {"cudagraph_skips": seen}, "graph": {}}})
    assert len(lines) == 1
    assert lines[0].startswith("torch.compile: Inductor ran 1 graph(s) without CUDA graphs")
    assert "mutated inputs (2 instances)" in lines[0] and "model.py" not in lines[0]


def test_a_compile_on_no_cuda_device_is_counted_as_a_skip():
    """Inductor skips CUDA graphs for a CPU graph and counts it without a log line: the count still shows."""
    torch._dynamo.reset()
    step = torch.compile(lambda x: x * 2 + 1, mode="reduce-overhead")
    with cudagraph_skips() as seen:
        step(torch.randn(7))
    assert len(seen) == 1 and "without CUDA graphs" in seen[0]


def test_no_line_when_every_compiled_step_was_graphed():
    assert skip_lines({"variants": {"torch.compile": {"cudagraph_skips": []}, "fused + compile": {}}}) == []
