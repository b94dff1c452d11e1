"""Data pipeline throughput: preprocessing rows/s and loader samples/s on synthetic raw data.

    python benchmarks/loader_throughput.py --rows 2000000 --repeat 4 --batch-size 65536
    python benchmarks/loader_throughput.py --rows 20000 --workers 1,2     # quick CPU check
    python benchmarks/loader_throughput.py --dataset data/mlperf-syn --reader-threads 4,8,16  # the loader alone

1. A raw Kaggle-format TSV is made with the synthetic generator (``--raw-tsv``); or pass an
   existing one with ``--raw-tsv PATH`` (it is reused, never overwritten). ``--repeat K``
   preprocesses K concatenated copies (a big input without a long generation).
2. preprocess: ``dlrm.data.preprocess.preprocess`` of that file with each worker count; rows/s is
   input lines over the wall time of the whole call (count pass, pool start, parse, parquet
   writing, tables, metadata). "parse" is the single-process parser alone on in-memory bytes (the
   per-core ceiling).
3. loader: `dlrm.data.loader.ParquetLoader` over the train split of the preprocessed dataset, one
   epoch per timed repeat (median reported), on CPU and, when available, on CUDA (batches copied
   to the GPU; the clock stops after a device sync), for each ``data.placement``: "stream"
   (ParquetLoader) and, on CUDA, "gpu" (DeviceLoader). "decode" is the streaming loader's host side
   alone (its producer decoding into the host arenas, pinned when CUDA is there, nothing
   consumed): the most the stream placement can deliver. ``--reader-threads 4,8,16`` measures
   several reader thread counts.

``--dataset DIR`` skips steps 1 and 2 and measures the loader on an existing dataset (any schema version:
MLPerf DLRM-DCNv2's multi-hot rows, 214 values a row, decode far slower than one-hot ones). The
targets are for one-hot rows; multi-hot rows are measured without one. With ``--codecs lz4,none`` it
also measures copies of the train split rewritten in those parquet codecs (same row groups and
rows, made one at a time under the scratch directory), with ``--layouts lists,slots`` copies in those
sparse layouts (`dlrm.data.relayout`; with both options, every codec in every layout);
``--arrow-threads on,off`` measures the loader with and without pyarrow's own column pool beside its reader threads. Each row records the
process's CPU time (user, system) and page faults an epoch, and the streaming loader chains epochs
as training does (``chain_epochs``).

Prints a table and writes <stem>.csv, <stem>.md and <stem>.png under --out (default
benchmarks/results/, stem loader_throughput_<device>), with the GPU name, torch / pyarrow / numpy
versions, CPU count and date. Targets (GPU machine): preprocessing >= 1M rows/s with all workers;
streaming >= 20M samples/s to the GPU; gpu placement >= 200M samples/s.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import re
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

# _common (which puts the repository first on sys.path), also when loaded by path (tests);
# appended: benchmarks/kernels.py must not shadow the kernels package
sys.path.append(str(Path(__file__).resolve().parent))

# Light imports only at module level: the preprocess worker processes are spawned and re-import this
# script, so torch / pyarrow / matplotlib are imported inside the functions that need them.
import numpy as np  # noqa: E402
from _common import date_stamp, env_line, int_list, markdown, pyplot, save_figure, write_csv  # noqa: E402
from _common import add_overwrite, claim_outputs  # noqa: E402

from dlrm.data import preprocess as pp  # noqa: E402

TARGETS = {("preprocess", None): 1e6, ("loader", "stream"): 20e6, ("loader", "gpu"): 200e6}
KEYS = ["stage", "device", "workers", "placement", "shuffle", "batch_size", "chunk_rows", "rows", "seconds",
        "rate", "unit", "target", "meets_target", "status", "codec", "layout", "arrow_threads", "cpu_user_s",
        "cpu_sys_s", "minor_faults"]


def environment() -> dict:
    import pyarrow as pa
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {
        "gpu": gpu,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "pyarrow": pa.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "date": date_stamp(),
    }


def count_lines(path: Path) -> int:
    n = 0
    with open(path, "rb") as f:
        while b := f.read(1 << 24):
            n += b.count(b"\n")
    return n


def make_raw(rows: int, raw_tsv: Path | None, work: Path) -> tuple[Path, int]:
    """The raw TSV to preprocess: an existing --raw-tsv as is, else one made by the generator."""
    if raw_tsv is not None and raw_tsv.exists():
        n = count_lines(raw_tsv)
        print(f"raw TSV: reusing {raw_tsv} ({n:,} lines)")
        return raw_tsv, n
    from dlrm.data.synthetic import generate

    target = raw_tsv or work / "raw.tsv"
    t0 = time.perf_counter()
    generate(work / "synthetic", rows, seed=0, raw_tsv=target)
    shutil.rmtree(work / "synthetic", ignore_errors=True)  # only the raw file is needed
    print(f"raw TSV: generated {rows:,} rows into {target} in {time.perf_counter() - t0:.1f} s")
    return target, rows


def row(stage, device, rows, seconds, unit, *, workers=None, placement=None, shuffle=None, batch_size=None,
        chunk_rows=None, status="ok", codec=None, arrow_threads=None, layout=None) -> dict:
    rate = rows / seconds if seconds and status == "ok" else None
    target = TARGETS.get((stage, placement if stage == "loader" else None))
    return {
        "stage": stage, "device": device, "workers": workers, "placement": placement, "shuffle": shuffle,
        "batch_size": batch_size, "chunk_rows": chunk_rows, "rows": rows, "seconds": seconds, "rate": rate,
        "unit": unit, "target": target, "meets_target": None, "status": status, "codec": codec, "layout": layout,
        "arrow_threads": arrow_threads,
    }


def bench_parse(raw: Path, max_lines: int = 500_000, repeats: int = 3) -> dict:
    """The parser alone, one process, on in-memory bytes (no I/O, no parquet)."""
    data = bytearray()
    n = 0
    with open(raw, "rb") as f:
        for line in f:
            data += line
            n += 1
            if n >= max_lines:
                break
    data = bytes(data)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        pp.parse_chunk(data, "tsv")
        times.append(time.perf_counter() - t0)
    return row("parse", "cpu", n, min(times), "rows/s", workers=1)


def bench_preprocess(raw: Path, lines: int, work: Path, workers: list[int], chunk_rows: int) -> tuple[list[dict], Path]:
    rows, last = [], None
    for w in workers:
        out = work / f"pp_w{w}"
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.perf_counter()
        try:
            pp.preprocess([raw], out, workers=w, chunk_rows=chunk_rows, progress=False)
            status = "ok"
        except Exception as e:  # reported in the table, the other measurements still run
            status = f"error: {type(e).__name__}: {e}"[:200]
        seconds = time.perf_counter() - t0
        rows.append(row("preprocess", "cpu", lines, seconds, "rows/s", workers=w, chunk_rows=chunk_rows,
                        status=status))
        if status == "ok":
            if last is not None:
                shutil.rmtree(last, ignore_errors=True)
            last = out
        print(f"  preprocess, {w} worker(s): {rows[-1]['rate'] or 0:,.0f} rows/s ({seconds:.2f} s) {status}")
    return rows, last


def _epoch(loader, device) -> tuple[int, float]:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    n = 0
    for batch in loader:
        # its rows counted by reading a tensor, as training reads them: a shuffled batch of the gpu placement
        # (`GatheredBatch`) is gathered on its first read, so `len(batch)` timed the permutation's slices alone
        n += batch.labels.shape[0]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return n, time.perf_counter() - t0


def _host_epoch(loader) -> tuple[int, float]:
    """The streaming loader's host side alone: decode one epoch into its host arenas, handing each
    arena straight back (no device, no consumer). The ceiling the consumer can reach."""
    import queue
    import threading

    from dlrm.data.loader import _END
    from dlrm.data.shuffle_seed import epoch_rng

    rng = epoch_rng(loader.seed, loader.epoch)  # the loader's own generator of the epoch
    plan = loader._plan(rng)
    q, free, stop = queue.Queue(loader.prefetch), queue.Queue(), threading.Event()
    t0 = time.perf_counter()
    flushes = loader._epoch_flushes(loader.epoch, plan, rng)  # this epoch's buffers, then its end marker
    producer = threading.Thread(target=loader._produce, args=(flushes, q, free, stop))
    producer.start()
    while (item := q.get()) is not _END:
        if isinstance(item, BaseException):
            raise item
        free.put(item)
    producer.join()
    loader._return_spares(loader._spare_arenas, loader._empty(free), keep=loader._max_arenas)
    return loader.num_rows, time.perf_counter() - t0


def dataset_codec(dataset: Path) -> str:
    """The parquet codec of a dataset's first train file (lowercase: "zstd", "lz4", "uncompressed", ...)."""
    import pyarrow.parquet as pq

    from dlrm.data.loader import split_files
    from dlrm.data.schema import read_metadata

    meta = pq.ParquetFile(split_files(dataset, read_metadata(dataset), "train")[0]).metadata
    return meta.row_group(0).column(0).compression.lower()


def dataset_layout(dataset: Path) -> str:
    """The sparse layout of a dataset's first train file ("lists" or "slots", `dlrm.data.validation.file_layout`)."""
    import pyarrow.parquet as pq

    from dlrm.data.loader import file_layout, split_files
    from dlrm.data.schema import read_metadata

    meta = read_metadata(dataset)
    return file_layout(pq.read_schema(split_files(dataset, meta, "train")[0]), meta.multi_hot_sizes)


def recode(dataset: Path, codec: str | None, work: Path, layout: str | None = None) -> Path:
    """A copy of `dataset`'s train split under `work` with every parquet file rewritten in `codec` and sparse
    `layout` (None: the file's own; the same row groups and rows; metadata.json copied), the files in parallel
    threads (pyarrow releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    from dlrm.data.loader import split_files
    from dlrm.data.relayout import relayout_file
    from dlrm.data.schema import read_metadata

    meta = read_metadata(dataset)
    layout = layout or dataset_layout(dataset)
    out = work / f"recoded-{codec or 'kept'}-{layout}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    shutil.copy2(dataset / "metadata.json", out / "metadata.json")
    files = split_files(dataset, meta, "train")
    t0 = time.perf_counter()
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(lambda src: relayout_file(src, out / src.relative_to(dataset), meta.multi_hot_sizes, layout,
                                                codec), files))
    size = sum(f.stat().st_size for f in out.rglob("*.parquet"))
    print(f"recoded {len(files)} train files to {codec or 'their codec'}, {layout}, in {time.perf_counter() - t0:.1f} s "
          f"({size / 2**30:.2f} GiB)")
    return out


def _arrow(setting: bool | None) -> dict:
    """ParquetLoader's arrow_threads argument for a --arrow-threads setting (None: the loader's default)."""
    return {} if setting is None else {"arrow_threads": setting}


def bench_loader(dataset: Path, devices: list[str], batch_size: int, repeats: int, shuffles: list[bool],
                 reader_threads: list[int | None], shuffle_buffer_rows: int,
                 arrow_threads: list[bool | None] = (None,), gpu_placement: bool = True) -> list[dict]:
    import torch

    from dlrm.data.device_loader import DeviceLoader
    from dlrm.data.loader import ParquetLoader, split_files
    from dlrm.data.schema import read_metadata

    meta = read_metadata(dataset)
    files = split_files(dataset, meta, "train")
    sizes, dense = meta.multi_hot_sizes, meta.dense_format
    codec, layout = dataset_codec(dataset), dataset_layout(dataset)
    out = []

    def measure(stage, dev, label, shuffle, threads, make, epoch_fn, arrow=None):
        try:
            loader = make()
            epoch_fn(loader)  # warm-up: file cache, CUDA context, pinned arenas, GPU upload
            runs = []
            before = resource.getrusage(resource.RUSAGE_SELF)
            for epoch in range(repeats):
                loader.set_epoch(epoch + 1)
                runs.append(epoch_fn(loader))
            after = resource.getrusage(resource.RUSAGE_SELF)
            if hasattr(loader, "close"):
                loader.close()  # a chained producer stops here
            seconds = statistics.median(s for _, s in runs)
            r = row(stage, dev, runs[0][0], seconds, "samples/s", placement=label, shuffle=shuffle,
                    batch_size=batch_size, workers=threads or getattr(loader, "reader_threads", None), codec=codec,
                    arrow_threads=getattr(loader, "arrow_threads", None), layout=layout)
            # the process's CPU time and page faults an epoch (all threads): where the cores' time went
            r["cpu_user_s"] = (after.ru_utime - before.ru_utime) / repeats
            r["cpu_sys_s"] = (after.ru_stime - before.ru_stime) / repeats
            r["minor_faults"] = (after.ru_minflt - before.ru_minflt) // repeats
        except Exception as e:
            r = row(stage, dev, meta.splits["train"].rows, None, "samples/s", placement=label, shuffle=shuffle,
                    batch_size=batch_size, workers=threads, status=f"error: {type(e).__name__}: {e}"[:200],
                    codec=codec, arrow_threads=arrow, layout=layout)
        if sum(sizes) != len(sizes):
            r["target"] = None  # the targets are for one-hot rows
        print(f"  {stage} {dev} {label} {codec} {layout} shuffle={shuffle} readers={r['workers'] or 'default'} "
              f"arrow_threads={r['arrow_threads']}: {r['rate'] or 0:,.0f} samples/s {r['status']}"
              + (f" (cpu {r['cpu_user_s']:.1f} s user, {r['cpu_sys_s']:.1f} s sys, {r['minor_faults']:,} faults an epoch)"
                 if r.get("cpu_user_s") is not None else ""))
        out.append(r)

    for shuffle in shuffles:
        # the producer alone (decode into pinned arenas when CUDA is there): what the host can feed
        pin_dev = "cuda" if any(torch.device(d).type == "cuda" for d in devices) else "cpu"
        for threads in reader_threads:
            for arrow in arrow_threads:
                measure("decode", "host", "stream", shuffle, threads,
                        lambda: ParquetLoader(files, batch_size, pin_dev, shuffle=shuffle, drop_last=False,
                                              reader_threads=threads, shuffle_buffer_rows=shuffle_buffer_rows,
                                              multi_hot_sizes=sizes, dense_format=dense, **_arrow(arrow)),
                        _host_epoch, arrow)
    for dev in devices:
        device = torch.device(dev)
        # data.placement: "stream" (ParquetLoader: decoded buffers copied to the device, batches cut there)
        # or "gpu" (DeviceLoader: the whole split in device memory, batches are index gathers).
        for shuffle in shuffles:
            for threads in reader_threads:
                for arrow in arrow_threads:
                    # chain_epochs, as training streams: the next epoch decodes while this one's last batches go
                    measure("loader", dev, "stream", shuffle, threads,
                            lambda: ParquetLoader(files, batch_size, device, shuffle=shuffle, drop_last=False,
                                                  reader_threads=threads, shuffle_buffer_rows=shuffle_buffer_rows,
                                                  multi_hot_sizes=sizes, dense_format=dense, chain_epochs=True,
                                                  **_arrow(arrow)),
                            lambda ld: _epoch(ld, device), arrow)
            if device.type == "cuda" and gpu_placement:
                measure("loader", dev, "gpu", shuffle, None,
                        lambda: DeviceLoader(files, batch_size, device, shuffle=shuffle, drop_last=False,
                                             multi_hot_sizes=sizes, dense_format=dense),
                        lambda ld: _epoch(ld, device))
    return out


def judge_targets(results: list[dict], pre: list[dict]) -> None:
    """Set meets_target where a target applies: on the GPU machine only, for the loader rows fed to CUDA and the
    preprocess run (of `pre`) with the most workers. Both paths of main judge: a one-hot --dataset keeps its verdict."""
    import torch

    # the targets are for the GPU machine: judged there only (all workers, batches to the GPU)
    best = max((r for r in pre if r["rate"]), key=lambda r: r["workers"], default=None)
    for r in results:
        if torch.cuda.is_available() and r["target"] and r["rate"] and (
            (r["stage"] == "loader" and r["device"].startswith("cuda")) or r is best
        ):
            r["meets_target"] = r["rate"] >= r["target"]


def _fmt(v, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if unit.endswith("/s"):
            return f"{v / 1e6:,.2f}M" if v >= 1e5 else f"{v:,.0f}"
        return f"{v:.3f}"
    return str(v)


def write_results(rows: list[dict], env: dict, out: Path, stem: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.csv", out / f"{stem}.md", out / f"{stem}.png"]
    write_csv(paths[0], rows, KEYS, env)
    head = ["stage", "device", "workers", "placement", "codec", "layout", "arrow threads", "shuffle", "batch", "rows", "seconds",
            "rate", "cpu user / sys s", "target", "meets", "status"]
    table = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        meets = {True: "yes", False: "NO", None: "-"}[r["meets_target"]]
        table.append(" | ".join([
            r["stage"], r["device"], _fmt(r["workers"]), _fmt(r["placement"]), _fmt(r.get("codec")),
            _fmt(r.get("layout")), _fmt(r.get("arrow_threads")), _fmt(r["shuffle"]),
            _fmt(r["batch_size"]), f"{r['rows']:,}", _fmt(r["seconds"]),
            f"{_fmt(r['rate'], r['unit'])} {r['unit']}" if r["rate"] else "-",
            f"{r['cpu_user_s']:.1f} / {r['cpu_sys_s']:.1f}" if r.get("cpu_user_s") is not None else "-",
            _fmt(r["target"], r["unit"]), meets,
            r["status"],
        ]))
    title = "Data pipeline throughput (dlrm.preprocess, ParquetLoader)"
    env_text = env_line(env)
    paths[1].write_text(markdown(title, [env_text], [f"| {t} |" for t in table]))
    print("\n" + env_text)  # the table without its outer pipes: easier to read in a terminal
    print("\n".join(table))

    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 5), gridspec_kw={"width_ratios": [1, 1.3]})
    pre = [r for r in rows if r["stage"] == "preprocess" and r["rate"]]
    if pre:
        a1.plot([r["workers"] for r in pre], [r["rate"] for r in pre], marker="o", label="preprocess (whole run)")
        for r in pre:
            a1.annotate(f"{r['rate'] / 1e6:.2f}M", (r["workers"], r["rate"]), textcoords="offset points",
                        xytext=(0, 6), ha="center", fontsize=8)
        a1.axhline(TARGETS[("preprocess", None)], color="gray", ls="--", lw=1, label="target 1M rows/s (GPU machine)")
        a1.set_xticks(sorted({r["workers"] for r in pre}))
        a1.set_ylim(bottom=0)
    parse = [r for r in rows if r["stage"] == "parse" and r["rate"]]
    if parse:
        a1.scatter([1], [parse[0]["rate"]], marker="x", color="k", label="parser only, 1 process")
    a1.set_xlabel("worker processes")
    a1.set_ylabel("rows/s")
    a1.set_title("preprocessing", fontsize=10)
    a1.grid(alpha=0.3)
    if pre or parse:  # nothing to label when only the loader was measured (--dataset)
        a1.legend(fontsize=8)
    lod = [r for r in rows if r["stage"] in ("decode", "loader") and r["rate"]]
    if lod:  # horizontal bars on a log axis: gpu placement is ~30x the stream rates
        labels = [f"{'host decode only' if r['stage'] == 'decode' else r['device'] + ' ' + r['placement']}"
                  f"{', shuffled' if r['shuffle'] else ''}" + (f", {r['workers']} readers" if r["workers"] else "")
                  + (f", {r['codec']}" if r.get("codec") and r["placement"] == "stream" else "")
                  + (f", {r['layout']}" if r.get("layout") and r["placement"] == "stream" else "")
                  + (", arrow pool" if r.get("arrow_threads") else "")
                  for r in lod]
        colors = ["tab:gray" if r["stage"] == "decode" else "tab:orange" if r["placement"] == "gpu" else "tab:blue"
                  for r in lod]
        y = list(range(len(lod)))[::-1]
        bars = a2.barh(y, [r["rate"] / 1e6 for r in lod], color=colors)
        a2.bar_label(bars, [f" {r['rate'] / 1e6:.1f}M" for r in lod], fontsize=7)
        a2.set_yticks(y, labels, fontsize=7)
        a2.set_xscale("log")
        for (_, placement), target in TARGETS.items():
            if placement and any(r["device"].startswith("cuda") and r["placement"] == placement for r in lod):
                a2.axvline(target / 1e6, color="gray", ls="--", lw=1)
                a2.annotate(f" target {placement} {target / 1e6:.0f}M", (target / 1e6, -0.9), fontsize=7,
                            color="gray", ha="left", va="bottom")
        a2.set_xlim(min(r["rate"] for r in lod) / 1e6 / 4, max(r["rate"] for r in lod) / 1e6 * 4)
        a2.set_ylim(-1, len(lod))
    a2.set_xlabel("million samples/s (median epoch, log scale)")
    a2.set_title(f"ParquetLoader (stream) and DeviceLoader (gpu), batch {lod[0]['batch_size'] if lod else '-'}",
                 fontsize=10)
    a2.grid(alpha=0.3, axis="x")
    fig.suptitle(f"{env['gpu'] if env['gpu'] != 'none' else 'no GPU'} / {env['cpu_count']} CPUs, torch {env['torch']}, pyarrow {env['pyarrow']}, "
                 f"{env['date']}", fontsize=9)
    save_figure(fig, paths[2])
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2_000_000, help="rows of the generated raw TSV")
    ap.add_argument("--dataset", type=Path, default=None,
                    help="measure the loader on this existing dataset only (no generation, no preprocessing)")
    ap.add_argument("--raw-tsv", type=Path, default=None,
                    help="raw TSV to use: reused if it exists, else generated there (kept)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="preprocess the raw TSV concatenated this many times (big inputs without a long generation)")
    ap.add_argument("--workers", default=None,
                    help="comma-separated worker counts (default 1,2,4,8,16 up to the CPU count, and the CPU count)")
    ap.add_argument("--chunk-rows", type=int, default=None,
                    help="preprocess chunk size (default: about 4 chunks per worker, 32Ki..512Ki lines)")
    ap.add_argument("--batch-size", type=int, default=65536)
    ap.add_argument("--repeats", type=int, default=3, help="timed loader epochs (median reported)")
    ap.add_argument("--devices", default="auto", help="comma-separated, or auto: cpu and cuda when available")
    ap.add_argument("--shuffle", default="false,true", help="loader shuffle settings to measure")
    ap.add_argument("--reader-threads", default=None,
                    help="comma-separated ParquetLoader reader thread counts to measure (default: its default)")
    ap.add_argument("--shuffle-buffer-rows", type=int, default=1_000_000, help="ParquetLoader shuffle_buffer_rows")
    ap.add_argument("--arrow-threads", default="default",
                    help="comma-separated ParquetLoader arrow_threads settings to measure: default, on, off")
    ap.add_argument("--codecs", default=None,
                    help="with --dataset: also measure copies of its train split rewritten in these parquet codecs "
                         "(comma-separated: lz4, none, snappy, zstd), made under the scratch directory")
    ap.add_argument("--layouts", default=None,
                    help="with --dataset: also measure copies of its train split in these sparse layouts "
                         "(comma-separated: lists, slots), in every --codecs codec")
    ap.add_argument("--work", type=Path, default=None, help="scratch directory (default: a new temp dir, removed)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--name", default=None, help="output file stem (default loader_throughput_<device>)")
    add_overwrite(ap)
    args = ap.parse_args(argv)

    import torch
    from loguru import logger

    cpus = os.cpu_count() or 1
    # the int lists parsed before the scratch directory is made: a bad value is one argparse line, no leftover
    workers = (int_list(ap, "--workers", args.workers, minimum=0) if args.workers
               else sorted({w for w in (1, 2, 4, 8, 16) if w <= cpus} | {cpus}))
    devices = (["cpu"] + (["cuda"] if torch.cuda.is_available() else [])) if args.devices == "auto" \
        else args.devices.split(",")
    shuffles = [s.strip().lower() in ("1", "true", "yes") for s in args.shuffle.split(",")]
    env = environment()
    stem = args.name or "loader_throughput_" + re.sub(r"[^A-Za-z0-9]+", "-", env["gpu"] if env["gpu"] != "none" else "cpu").strip("-").lower()
    claim_outputs(ap, args, args.out, [f"{stem}.{ext}" for ext in ("csv", "md", "png")])  # (write_results names them)

    readers = int_list(ap, "--reader-threads", args.reader_threads, minimum=0) if args.reader_threads else [None]
    arrow = []
    for a in args.arrow_threads.split(","):
        if a.strip() not in ("default", "on", "off"):
            ap.error(f"--arrow-threads: {a!r} is not one of default, on, off")
        arrow.append({"default": None, "on": True, "off": False}[a.strip()])
    created = args.work is None
    work = Path(tempfile.mkdtemp(prefix="loader_throughput_")) if created else args.work
    work.mkdir(parents=True, exist_ok=True)
    # after every option check (an argparse exit before the try left "dlrm" disabled for the rest of the process:
    # tests calling main() in-process then saw no log messages)
    logger.disable("dlrm")  # the preprocess / generator logs would drown the table
    try:
        if args.dataset is not None:
            if not (args.dataset / "metadata.json").is_file():
                ap.error(f"--dataset {args.dataset}: no metadata.json there")
            results = bench_loader(args.dataset, devices, args.batch_size, args.repeats, shuffles, readers,
                                   args.shuffle_buffer_rows, arrow)
            codecs = [c.strip() for c in args.codecs.split(",")] if args.codecs else []
            layouts = [x.strip() for x in args.layouts.split(",")] if args.layouts else []
            copies = [(c, x) for c in (codecs or [None]) for x in (layouts or [None])] if codecs or layouts else []
            for codec, layout in copies:
                copy = recode(args.dataset, codec, work, layout)  # one copy on disk at a time
                results += bench_loader(copy, devices, args.batch_size, args.repeats, shuffles, readers,
                                        args.shuffle_buffer_rows, arrow, gpu_placement=False)
                shutil.rmtree(copy, ignore_errors=True)
            judge_targets(results, [])
            paths = write_results(results, env, args.out, stem)
            print("wrote " + ", ".join(str(p) for p in paths))
            return 0
        raw, lines = make_raw(args.rows, args.raw_tsv, work)
        if args.repeat > 1:
            big = work / f"raw_x{args.repeat}.tsv"
            with open(big, "wb") as dst:
                for _ in range(args.repeat):
                    with open(raw, "rb") as src:
                        shutil.copyfileobj(src, dst, 1 << 24)
            raw, lines = big, lines * args.repeat
            print(f"raw TSV: {args.repeat} copies concatenated: {lines:,} lines")
        chunk_rows = args.chunk_rows or min(pp.DEFAULT_CHUNK_ROWS, max(32768, math.ceil(lines / (4 * max(workers)))))
        results = [bench_parse(raw)]
        print(f"  parse only, 1 process: {results[0]['rate']:,.0f} rows/s")
        pre, dataset = bench_preprocess(raw, lines, work, workers, chunk_rows)
        results += pre
        if dataset is not None:
            results += bench_loader(dataset, devices, args.batch_size, args.repeats, shuffles, readers,
                                    args.shuffle_buffer_rows, arrow)
        judge_targets(results, pre)
        paths = write_results(results, env, args.out, stem)
        print("wrote " + ", ".join(str(p) for p in paths))
    finally:
        logger.enable("dlrm")  # main() may be called in-process (tests): leave logging as it was
        if created and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        elif args.keep or not created:
            print(f"scratch kept in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
