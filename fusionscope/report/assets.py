"""The page's stylesheet and its one small script, kept as module strings.

Keeping them in Python (instead of .css/.js package data) means the report needs no package-data entry and no file
reads at render time; both are short enough to review here.
"""

from __future__ import annotations

CSS = """
:root { --fg: #1f2933; --muted: #61707d; --line: #e3e8ee; --card: #ffffff; --bg: #f4f6f8; --accent: #2f6fb3; }
* { box-sizing: border-box; }
body { margin: 0; background: var(--bg); color: var(--fg);
       font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; }
header { background: #1f2933; color: #f5f7fa; padding: 20px 32px 16px; }
header h1 { margin: 0 0 4px; font-size: 22px; font-weight: 600; }
header .sub { color: #c3ccd5; }
header code { background: rgba(255,255,255,.1); padding: 1px 6px; border-radius: 4px; color: #f5f7fa; }
.chips { margin-top: 10px; display: flex; flex-wrap: wrap; gap: 6px; }
.chip { background: rgba(255,255,255,.1); border-radius: 10px; padding: 1px 9px; font-size: 12px; color: #dde3e9; }
main { max-width: 1520px; margin: 0 auto; padding: 8px 32px 48px; }
section { margin-top: 28px; }
h2 { font-size: 18px; font-weight: 600; margin: 0 0 4px; }
h3 { font-size: 15px; font-weight: 600; margin: 0 0 6px; }
.lead { color: var(--muted); margin: 0 0 12px; max-width: 900px; }
/* auto-fill, not auto-fit: figures are drawn while the page is still parsing, and with auto-fit the first panel
   would briefly span the whole row and be drawn at that width. */
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(560px, 1fr)); gap: 16px; }
.grid.single { grid-template-columns: 1fr; }
.cards { display: grid; grid-template-columns: repeat(auto-fit, minmax(320px, 1fr)); gap: 16px; }
.card { background: var(--card); border: 1px solid var(--line); border-radius: 8px; padding: 14px 16px; min-width: 0; }
.card dl { display: grid; grid-template-columns: auto 1fr; gap: 3px 14px; margin: 0; }
.card dt { color: var(--muted); }
.card dd { margin: 0; font-variant-numeric: tabular-nums; }
.regime { margin: 10px 0 0; padding: 8px 10px; border-radius: 6px; background: #eef4fb;
          border-left: 3px solid var(--accent); }
.regime.host-bound { background: #fff4e5; border-color: #d97706; }
.regime.gpu-bound { background: #e8f6f0; border-color: #1b9e77; }
/* the colour follows what paces the step in the step model when the run has one, like the sentence's advice */
.regime.paced-host { background: #fff4e5; border-color: #d97706; }
.regime.paced-gpu { background: #e8f6f0; border-color: #1b9e77; }
.note { color: var(--muted); font-size: 13px; margin: 6px 0 0; }
.empty { padding: 40px 0; text-align: center; color: var(--muted); }
.table-wrap { overflow-x: auto; }
table.sortable { border-collapse: collapse; width: 100%; font-size: 12.5px; font-variant-numeric: tabular-nums; }
table.sortable th, table.sortable td { padding: 4px 6px; border-bottom: 1px solid var(--line); text-align: left;
                                       white-space: nowrap; }
table.sortable th { position: sticky; top: 0; background: #f9fafb; cursor: pointer; user-select: none; }
table.sortable th:hover { background: #eef2f6; }
table.sortable th[aria-sort="ascending"]::after { content: " ▲"; font-size: 10px; }
table.sortable th[aria-sort="descending"]::after { content: " ▼"; font-size: 10px; }
table.sortable td.num { text-align: right; position: relative; }
table.sortable td.name, table.sortable td.op, table.sortable td.module { overflow: hidden; text-overflow: ellipsis; }
table.sortable td.name { max-width: 260px; font-family: ui-monospace, SFMono-Regular, Menlo, monospace;
                         font-size: 12px; }
table.sortable td.op { max-width: 150px; }
table.sortable td.module { max-width: 200px; }
table.sortable tbody tr:hover { background: #f6f9fc; }
.bar { position: absolute; left: 0; top: 3px; bottom: 3px; background: #d7e6f5; border-radius: 2px; }
.bar-text { position: relative; }
.dot { display: inline-block; width: 9px; height: 9px; border-radius: 50%; margin-right: 5px; }
footer { color: var(--muted); font-size: 12px; text-align: center; padding: 0 0 24px; }
"""

# Sorts every ``table.sortable`` by the clicked column.  Cells carry their sort key in ``data-v``; numeric columns
# start descending (biggest first is what one looks for), text columns ascending, and rows with no value stay last.
SORT_JS = """
(function () {
  "use strict";
  function sortTable(table, index, th) {
    var numeric = th.getAttribute("data-type") === "num";
    var current = th.getAttribute("aria-sort");
    var dir = current === "none" ? (numeric ? "descending" : "ascending")
                                 : (current === "ascending" ? "descending" : "ascending");
    var sign = dir === "ascending" ? 1 : -1;
    var body = table.tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    rows.sort(function (a, b) {
      var x = a.cells[index].getAttribute("data-v"), y = b.cells[index].getAttribute("data-v");
      if (x === "" || y === "") { return (x === "") - (y === ""); }
      if (numeric) { return sign * (parseFloat(x) - parseFloat(y)); }
      return sign * x.localeCompare(y);
    });
    rows.forEach(function (row) { body.appendChild(row); });
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (cell) {
      cell.setAttribute("aria-sort", "none");
    });
    th.setAttribute("aria-sort", dir);
  }
  // Figures are drawn as the page parses; once layout has settled, fit each one to its final panel width.
  window.addEventListener("load", function () {
    if (!window.Plotly) { return; }
    document.querySelectorAll(".plotly-graph-div").forEach(function (div) { window.Plotly.Plots.resize(div); });
  });
  document.querySelectorAll("table.sortable").forEach(function (table) {
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th, index) {
      th.addEventListener("click", function () { sortTable(table, index, th); });
      th.addEventListener("keydown", function (event) {
        if (event.key === "Enter" || event.key === " ") { event.preventDefault(); sortTable(table, index, th); }
      });
    });
  });
})();
"""
