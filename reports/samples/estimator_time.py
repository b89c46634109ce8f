"""How long the fusion finder and estimator take on a run, trace loading excluded, and how that grows with ops.

python3 reports/samples/estimator_time.py capture MODEL RUN_DIR OUT.pkl.gz [profile options as key=value ...]
    runs `fusionscope.profile` and saves the estimator's inputs (the joined dataflow, the ops and kernels
    tables, the roofs, the phase summary) as they are handed over (the GPU machine does this for llama-3.1-8b)
python3 reports/samples/estimator_time.py time IN.pkl.gz [IN2.pkl.gz ...]
    times `find_matches` + `estimate_matches` + `summarize_opportunities` on each (median of 3), and on the
    first 1/4, 1/2 and all of the decode steps of each, to show the cost per node stays flat
python3 reports/samples/estimator_time.py rescore IN.pkl.gz RUN_DIR
    recomputes a run folder's `opportunities` and `cumulative` from its saved inputs with the current catalogue and
    Amdahl model (its micro-measured figures, timed on the GPU, are kept), restores `kernels.csv` from the inputs to
    re-render `report.html`, then removes it again — how an estimate fixed after a GPU run reaches its sample
"""

from __future__ import annotations

import gzip
import pickle
import statistics
import sys
import time
from pathlib import Path


def capture(model: str, run_dir: Path, out: Path, options: list[str]) -> None:
    import fusionscope
    from fusionscope import opportunities

    kwargs = {k: (int(v) if v.isdigit() else v) for k, v in (o.split("=", 1) for o in options)}
    saved: dict = {}
    estimate, summarize = opportunities.estimate_matches, opportunities.summarize_opportunities

    def keep_estimate(matches, joined, ops, kernels, roofs):
        saved.update(joined=joined, ops=ops, kernels=kernels, roofs=roofs)
        return estimate(matches, joined, ops, kernels, roofs)

    def keep_summary(per_match, phases, roofs):
        saved["phases"] = phases
        return summarize(per_match, phases, roofs)

    opportunities.estimate_matches, opportunities.summarize_opportunities = keep_estimate, keep_summary
    t0 = time.perf_counter()
    run = fusionscope.profile(model, out=run_dir, **kwargs)
    print(f"profile {model}: {time.perf_counter() - t0:.1f} s (the API call, run folder {run.out_dir})")
    with gzip.open(out, "wb", compresslevel=6) as f:
        pickle.dump(saved, f, protocol=pickle.HIGHEST_PROTOCOL)
    print(f"saved {out} ({out.stat().st_size / 1e6:.1f} MB, {len(saved['joined'])} nodes)")


def _restricted(saved: dict, share: float) -> dict:
    """The prefill steps and the first `share` of the decode steps (nodes, ops and kernels alike)."""
    joined = saved["joined"]
    decode = sorted(joined.loc[joined["phase"] == "decode", "step"].unique())
    keep = set(joined.loc[joined["phase"] != "decode", "step"]) | set(decode[: max(1, round(len(decode) * share))])
    ops = saved["ops"]
    step_col = "step" if "step" in ops else None
    kept_ops = ops[ops[step_col].isin(keep)] if step_col else ops
    kernels = saved["kernels"]
    kept_kernels = kernels[kernels["op_id"].isin(set(kept_ops["op_id"]))] if "op_id" in kernels else kernels
    return {**saved, "joined": joined[joined["step"].isin(keep)], "ops": kept_ops, "kernels": kept_kernels}


def time_once(saved: dict) -> tuple[float, int, int]:
    from fusionscope import opportunities
    from fusionscope.fusions import Graph, find_matches

    t0 = time.perf_counter()
    matches = find_matches(Graph(saved["joined"]))
    per_match = opportunities.estimate_matches(matches, saved["joined"], saved["ops"], saved["kernels"], saved["roofs"])
    opportunities.summarize_opportunities(per_match, saved["phases"], saved["roofs"])
    return time.perf_counter() - t0, len(saved["joined"]), len(matches)


def rescore(path: Path, run_dir: Path) -> None:
    import json

    from fusionscope import opportunities, run
    from fusionscope.fusions import Graph, find_matches

    with gzip.open(path, "rb") as f:
        saved = pickle.load(f)
    summary = json.loads((run_dir / "summary.json").read_text())
    micro = {(o["fusion"], o["phase"]): o for o in summary["opportunities"]}
    matches = find_matches(Graph(saved["joined"]))
    per_match = opportunities.estimate_matches(matches, saved["joined"], saved["ops"], saved["kernels"], saved["roofs"])
    summary["opportunities"], summary["cumulative"] = opportunities.summarize_opportunities(
        per_match, summary["phases"], summary["roofs"]
    )
    for opp in summary["opportunities"]:
        old = micro.get((opp["fusion"], opp["phase"]), {})
        opp.update({k: old.get(k) for k in ("micro_now_us", "micro_fused_us", "micro_note")})
    summary["rescored"] = "opportunities and cumulative recomputed on the CPU from the run's saved estimator inputs"
    run.write_json(run_dir / "summary.json", summary)
    opportunities.opportunities_table(summary["opportunities"]).to_csv(
        run_dir / "opportunities.csv", index=False, float_format="%.6g"
    )
    saved["kernels"].to_csv(run_dir / "kernels.csv", index=False, float_format="%.6g")
    run.rerender(run_dir)
    (run_dir / "kernels.csv").unlink()  # 15 MB: the committed sample keeps the summary and the report
    print(f"rescored {run_dir}")


def main(argv: list[str]) -> int:
    if argv[:1] == ["capture"]:
        capture(argv[1], Path(argv[2]), Path(argv[3]), argv[4:])
        return 0
    if argv[:1] == ["rescore"]:
        rescore(Path(argv[1]), Path(argv[2]))
        return 0
    for path in argv[1:]:
        with gzip.open(path, "rb") as f:
            saved = pickle.load(f)
        for share in (0.25, 0.5, 1.0):
            part = _restricted(saved, share)
            runs = [time_once(part) for _ in range(3)]
            seconds = statistics.median(r[0] for r in runs)
            nodes, matches = runs[0][1], runs[0][2]
            print(f"{Path(path).name} decode share {share:.2f}: {nodes} nodes, {len(part['ops'])} ops, "
                  f"{matches} matches: {seconds:.2f} s ({1e6 * seconds / nodes:.1f} µs per node)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
