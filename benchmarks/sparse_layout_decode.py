"""One MLPerf-shaped row group decoded into the loader's slots, single-threaded: list columns against slot columns.

    python benchmarks/sparse_layout_decode.py                      # 131,072 rows, lz4 and zstd
    python benchmarks/sparse_layout_decode.py --rows 16384 --codecs lz4 --repeats 3

What one reader thread of the streaming loader does with a row group, timed apart from threads, the
GPU and the file system: the row group (MLPerf DLRM-DCNv2's 214 ids a row, uniform over its table
sizes, every list full) is written in memory in each sparse layout (`dlrm.data.schema`: "lists", one
``list<int64>`` column a multi-hot feature; "slots", one int64 column a slot), with pyarrow's
default dictionaries (1 MB pages), with the writers' 64 KB pages, and with none on the sparse columns, in each codec; then read back (`read_row_group`, pyarrow's own
threads off) and its ids copied into a column-major int32 arena as `dlrm.data.host_arena._write_columns`
does. Reported: bytes, the read alone and read + arena copy in microseconds a row (best of
``--repeats``). ``--ids zipf`` draws the ids from a Zipf law truncated to each table (`draw_ids`;
heavy-headed like the synthetic generator's) instead of uniformly (MLPerf's extra multi-hot ids are
uniform, real Criteo ids are Zipf-like). The writers use what this measures to choose: slot columns, 64 KB dictionary pages
(`dlrm.data.schema.write_options`).

Prints a table and writes <name>.csv, .md and .png under --out (default benchmarks/results/,
name sparse_layout_decode_<host>), with the CPU, versions and date.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from _common import date_stamp, markdown, md_row, pyplot, save_figure, write_csv  # noqa: E402
from _common import add_overwrite, claim_outputs  # noqa: E402

KEYS = ["codec", "layout", "dictionary", "rows", "mbytes", "read_us_per_row", "total_us_per_row"]


def draw_ids(rng: np.random.Generator, card: int, shape: tuple[int, int], ids: str) -> np.ndarray:
    """Ids below `card`: "uniform", or "zipf" (rank r < card drawn with probability ~ 1 / (r + 1)^1.1, ranks
    scattered over the table by a fixed odd multiplier, as heavy-headed as Criteo's categories)."""
    if ids == "uniform":
        return rng.integers(0, card, shape)
    ranks = rng.zipf(1.1, shape) - 1
    # A rank past the table is drawn again (the law truncated to the table): clamped, the whole tail (16% of a
    # 40M-row table's draws, 86% of a 3-row one's) landed on one id, above rank 0's share.
    while (over := ranks >= card).any():
        ranks[over] = rng.zipf(1.1, int(over.sum())) - 1
    return (ranks * 2654435761) % card


def mlperf_table(rows: int, layout: str, ids: str = "uniform", seed: int = 0):
    """A table of the dataset schema in `layout` with MLPerf's table and multi-hot sizes (`ids`: `draw_ids`)."""
    import pyarrow as pa

    from dlrm.data.schema import MLPERF_CARDINALITIES, MLPERF_MULTI_HOT_SIZES, NUM_DENSE, arrow_schema, feature_columns

    rng = np.random.default_rng(seed)
    cols = [pa.array(rng.integers(0, 2, rows).astype(np.int8))]
    cols += [pa.array(rng.integers(0, 100, rows).astype(np.int32)) for _ in range(NUM_DENSE)]
    for size, card in zip(MLPERF_MULTI_HOT_SIZES, MLPERF_CARDINALITIES):
        cols += feature_columns(draw_ids(rng, card, (rows, size), ids), layout)
    return pa.Table.from_arrays(cols, schema=arrow_schema(MLPERF_MULTI_HOT_SIZES, layout))


MODES = {"default": "pyarrow's default (1 MB dictionary pages)", "writers'": "64 KB dictionary pages (the writers')",
         "dense": "no dictionary on sparse columns"}


def writer_options(mode: str, layout: str) -> dict:
    """pyarrow writer arguments for a `mode` (`MODES`): pyarrow's "default"; the "writers'" choice
    (`dlrm.data.schema.write_options`); or "dense": dictionaries on the label and dense columns only (a
    list column cannot be named by its column name: pyarrow matches leaf paths)."""
    from dlrm.data.schema import DENSE_COLUMNS, LABEL_COLUMN, MLPERF_MULTI_HOT_SIZES, write_options

    return {"default": {}, "writers'": write_options(MLPERF_MULTI_HOT_SIZES, layout),
            "dense": {"use_dictionary": [LABEL_COLUMN, *DENSE_COLUMNS]}}[mode]


def measure(table, codec: str, layout: str, dictionary: str, repeats: int) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dlrm.data.host_arena import _write_columns
    from dlrm.data.schema import MLPERF_MULTI_HOT_SIZES, NUM_DENSE, sparse_width

    n = table.num_rows
    buf = io.BytesIO()
    pq.write_table(table, buf, compression=None if codec == "none" else codec, row_group_size=n,
                   **writer_options(dictionary, layout))
    data = buf.getvalue()
    out = (np.empty(n, np.int8), np.empty((NUM_DENSE, n), np.int32),
           np.empty((sparse_width(MLPERF_MULTI_HOT_SIZES), n), np.int32))
    read, total = float("inf"), float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        decoded = pq.ParquetFile(pa.BufferReader(data)).read_row_group(0, use_threads=False)
        t1 = time.perf_counter()
        _write_columns(decoded, out, 0, MLPERF_MULTI_HOT_SIZES, layout)
        t2 = time.perf_counter()
        read, total = min(read, t1 - t0), min(total, t2 - t0)
    return {"codec": codec, "layout": layout, "dictionary": dictionary, "rows": n, "mbytes": len(data) / 1e6,
            "read_us_per_row": read / n * 1e6, "total_us_per_row": total / n * 1e6}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=131072, help="rows of the row group (the writers' row group)")
    ap.add_argument("--codecs", default="lz4,zstd", help="comma-separated parquet codecs (lz4, zstd, snappy, none)")
    ap.add_argument("--ids", choices=("uniform", "zipf"), default="uniform", help="how ids are drawn (see draw_ids)")
    ap.add_argument("--repeats", type=int, default=6, help="reads of each file; the best is reported")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--name", default=None)
    add_overwrite(ap)
    args = ap.parse_args(argv)
    if args.rows < 1 or args.repeats < 1:
        ap.error(f"--rows and --repeats must be at least 1 (got {args.rows}, {args.repeats})")
    name = args.name or f"sparse_layout_decode_{platform.node() or 'host'}"
    outputs = claim_outputs(ap, args, args.out, [f"{name}.{ext}" for ext in ("csv", "md", "png")])
    import pyarrow as pa

    env = {"cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(), "pyarrow": pa.__version__,
           "numpy": np.__version__, "python": platform.python_version(), "host": platform.node(), "date": date_stamp()}
    tables = {layout: mlperf_table(args.rows, layout, args.ids) for layout in ("lists", "slots")}
    rows = []
    env["ids"] = args.ids
    for codec in args.codecs.split(","):
        for layout in ("lists", "slots"):
            for dictionary in (("default", "dense") if layout == "lists" else ("default", "writers'", "dense")):
                r = measure(tables[layout], codec.strip(), layout, dictionary, args.repeats)
                rows.append(r)
                print(f"{r['codec']:5} {layout:5} dictionary={dictionary:8} {r['mbytes']:7.1f} MB  read "
                      f"{r['read_us_per_row']:.2f} us/row  read + arena {r['total_us_per_row']:.2f} us/row")
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / f"{name}.csv", rows, KEYS, env)
    line = ", ".join(f"{k}: {v}" for k, v in env.items())
    head = ["codec", "layout", "dictionaries", "MB", "read us/row", "read + arena us/row"]
    table = [md_row(head), md_row("---" for _ in head)]
    table += [md_row([r["codec"], r["layout"], MODES[r["dictionary"]], f"{r['mbytes']:.1f}",
                      f"{r['read_us_per_row']:.2f}", f"{r['total_us_per_row']:.2f}"]) for r in rows]
    (args.out / f"{name}.md").write_text(markdown(
        "One MLPerf-shaped row group decoded single-threaded: list columns against slot columns", [
            line, f"`python benchmarks/sparse_layout_decode.py --rows {args.rows} --codecs {args.codecs} --ids {args.ids}` "
            f"(best of {args.repeats}); {args.rows:,} rows of 214 ids ({args.ids}), written in memory and read back with pyarrow's "
            "threads off, then copied into the loader's int32 arena."], table))
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r['codec']} {r['layout']}, dictionary: {r['dictionary']}" for r in rows]
    y = np.arange(len(rows))[::-1]
    ax.barh(y, [r["total_us_per_row"] for r in rows], color=["tab:blue" if r["layout"] == "slots" else "tab:gray"
                                                              for r in rows])
    ax.set_yticks(y, labels, fontsize=8)
    ax.set_xlabel("us a row, read + arena copy (one thread)")
    ax.set_title(f"MLPerf rows ({args.ids} ids), {args.rows:,} a row group ({env['cpu_count']} cores host, one used)", fontsize=9)
    save_figure(fig, args.out / f"{name}.png")
    outputs.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
