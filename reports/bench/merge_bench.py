"""Merge bench results from SRC into the results folder OUT (bench.csv, bench.json, bench.html).

Usage: python3 reports/bench/merge_bench.py SRC OUT [VARIANT ...]

SRC is one `fusionscope bench --out` folder (VARIANT names the variants it timed, if it was narrowed) or an OUT
folder of another session. A full rerun of a kernel replaces all its rows (variants since renamed included); a
narrowed one replaces only the rows it timed and keeps the rest. Each run's meta (date, versions, measured roofs) is
kept under `runs` in bench.json, keyed by kernel (and variants), since rows from different runs were measured
against different roofs. Files are replaced whole, never half-written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd

from fusionscope.bench.page import render_bench_page

KEY = ["kernel", "case", "variant", "dtype"]


def merge(src: Path, out: Path, variants: list[str]) -> None:
    new = pd.read_csv(src / "bench.csv")
    meta = json.loads((src / "bench.json").read_text())
    if "measured_at" not in new:  # which run each row comes from: rows of several runs sit side by side
        new = new.assign(measured_at=meta.get("date"))
    new_runs = meta.pop("runs", None) or {
        kernel + (f" [{' '.join(variants)}]" if variants else ""): meta for kernel in new["kernel"].unique()
    }
    rows, runs = new, {}
    if (out / "bench.csv").exists():
        old = pd.read_csv(out / "bench.csv")
        rerun = {k for k in new_runs if "[" not in k}  # kernels timed with all their variants
        old = old[~old["kernel"].isin(rerun)]
        rows = pd.concat([old, new], ignore_index=True)
        first_seen = rows.groupby(KEY, sort=False).ngroup()  # a replaced row keeps its place in the table
        rows = rows.assign(_order=first_seen).drop_duplicates(KEY, keep="last")
        rows = rows.sort_values("_order", kind="stable").drop(columns="_order")
        runs = json.loads((out / "bench.json").read_text()).get("runs", {})
    for key in new_runs:  # a full rerun supersedes the kernel's narrowed runs too
        runs = {k: v for k, v in runs.items() if not (("[" not in key) and k.split(" [")[0] == key)}
    meta = {**meta, "runs": {**runs, **new_runs}}
    texts = {
        "bench.csv": rows.to_csv(index=False, float_format="%.6g"),
        "bench.json": json.dumps(meta, indent=1) + "\n",
        "bench.html": render_bench_page(rows, meta),
    }
    for name, text in texts.items():
        partial = out / f".{name}.partial"
        partial.write_text(text, encoding="utf-8")
        partial.replace(out / name)


if __name__ == "__main__":
    merge(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])
