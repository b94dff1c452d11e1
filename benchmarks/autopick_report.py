"""Table and chart of `gpu_suite.sh autopick`: the variant ``auto`` against the named variants it picks between.

    python benchmarks/autopick_report.py SUITE_RESULTS_DIR --call NAME --out benchmarks/results/autopick

``SUITE_RESULTS_DIR`` holds the part's ``auto_<model>_<precision>_b<batch>.csv`` files (one per cell, written by
``benchmarks/train_throughput.py``; the variants of a cell ran in one process). Writes ``autopick.csv`` (every row,
tagged with the model and ``--call``), ``autopick.md`` (one line per cell: each variant's samples/s, the fastest in
bold, and how far ``auto`` is from the fastest) and ``autopick.png`` (``auto`` relative to the fastest, per cell).
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))

from _common import md_row, pyplot, save_figure  # noqa: E402
from _common import add_overwrite, claim_outputs  # noqa: E402

COLUMNS = ["triton-embedding-interaction+step-graph", "triton-wgrad+step-graph", "triton-fused-mlp+step-graph"]
HEADERS = ["PyTorch MLPs (`triton-embedding-interaction+step-graph`)", "`triton-wgrad+step-graph`",
           "`triton-fused-mlp+step-graph`"]
CELL = re.compile(r"auto_(?P<model>[a-z]+)_(?P<precision>[a-z0-9]+)_b(?P<batch>\d+)\.csv$")


def read_cells(folder: Path) -> list[tuple[dict, list[dict]]]:
    """``[(cell, rows)]`` sorted by model, batch, precision; ``ValueError`` names a file without an ``auto`` row."""
    cells = []
    for path in sorted(folder.glob("auto_*.csv")):
        m = CELL.search(path.name)
        if not m:
            continue
        with path.open(newline="") as f:
            rows = [r for r in csv.DictReader(f) if r.get("status") == "ok"]
        if not any(r["variant"] == "auto" for r in rows):
            raise ValueError(f"{path}: no 'auto' row with status ok")
        cells.append(({"model": m["model"], "precision": m["precision"], "batch": int(m["batch"])}, rows))
    if not cells:
        raise ValueError(f"{folder}: no auto_<model>_<precision>_b<batch>.csv files")
    cells.sort(key=lambda c: (c[0]["model"], c[0]["batch"], c[0]["precision"]))
    return cells


def summarize(cells) -> list[dict]:
    """Per cell: samples/s per variant, the fastest named variant, and ``auto`` against it (percent)."""
    out = []
    for cell, rows in cells:
        rate = {r["variant"]: float(r["samples_per_sec"]) for r in rows}
        named = {k: v for k, v in rate.items() if k != "auto"}
        fastest = max(named, key=named.get) if named else None  # None: no named variant of the cell ran ok
        out.append({**cell, "rate": rate, "fastest": fastest,
                    "auto_vs_fastest_pct": 100.0 * (rate["auto"] / named[fastest] - 1.0) if fastest else float("nan")})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path, help="the autopick part's results folder")
    ap.add_argument("--call", required=True, help="a name for the device call, kept in the CSV")
    ap.add_argument("--out", type=Path, required=True, help="output folder")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    outputs = claim_outputs(ap, args, args.out, ["autopick.csv", "autopick.md", "autopick.png"])
    try:
        cells = read_cells(args.results)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = summarize(cells)
    args.out.mkdir(parents=True, exist_ok=True)
    keys = ["call", "model"] + list(cells[0][1][0].keys())
    with (args.out / "autopick.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for cell, rows in cells:
            for r in rows:
                w.writerow({"call": args.call, "model": cell["model"], **r})
    first = cells[0][1][0]
    lines = [f"device: {first['device']}, torch: {first['torch']}, triton: {first['triton']}, "
             f"python: {first['python']}, date: {first['date']}, call {args.call}", "",
             "| model | precision | batch | `auto` | " + " | ".join(HEADERS) + " | `auto` vs the fastest |",
             "| --- | --- | ---: | ---: | " + " | ".join("---:" for _ in HEADERS) + " | ---: |"]
    for s in summary:
        cells_text = []
        for v in COLUMNS:
            if v not in s["rate"]:
                cells_text.append("")
            else:
                text = f"{s['rate'][v] / 1e6:.2f}M"
                cells_text.append(f"**{text}**" if v == s["fastest"] else text)
        lines.append(md_row([s["model"].capitalize(), s["precision"], s["batch"], f"{s['rate']['auto'] / 1e6:.2f}M",
                             *cells_text, f"{s['auto_vs_fastest_pct']:+.1f}%" if s["fastest"] else "n/a"]))
    (args.out / "autopick.md").write_text("\n".join(lines) + "\n")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{s['model']} {s['precision']} {s['batch']}" for s in summary]
    ax.barh(range(len(summary)), [s["auto_vs_fastest_pct"] for s in summary], color="tab:blue")
    ax.axvline(0, color="black", lw=0.8)
    ax.set_yticks(range(len(summary)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("`auto` against the fastest named variant of the cell, %")
    ax.set_title(f"What the defaults pick ({first['device']}, torch {first['torch']}, triton {first['triton']}, "
                 f"{first['date'][:10]})", fontsize=9)
    ax.grid(True, axis="x", alpha=0.3)
    save_figure(fig, args.out / "autopick.png")
    for line in lines[2:]:
        print(line)
    outputs.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
