"""Where streamed training waits: train.py runs with the parquet loader's work timed, one run per setting.

    python benchmarks/stream_timeline.py --config configs/mlperf-dcnv2.json --data DIR [--epochs 24] [--repeat 2] \
        --setting base --setting r8:reader_threads=8 --setting noarrow:arrow_threads=0 --setting pf4:prefetch=4

Each run is train.py (the config with ``data.placement: "stream"`` and ``train.log_every`` 10 unless the setting
says ``placement`` or ``log_every``) in a child process that, as a measurement only, sets the training loader's
``reader_threads``, ``arrow_threads`` and ``prefetch`` (`dlrm.data.parquet_loader.ParquetLoader`'s arguments),
``reader_nice`` (the reader threads' nice value), ``switch_interval_ms`` (``sys.setswitchinterval``) and
``read_late=0`` (each logging window read at its own step, so the GPU drains there, as the trainer did before
2026-11-29, instead of after the next step is queued) where the setting names them (``base`` keeps every
default), skips the checkpoints (for MLPerf's tables each is a 52 GB write that says nothing about the loader), and
records with ``time.perf_counter``:

- every row group's decode on its reader thread (start, end, rows),
- every blocking wait of the training thread for the next decoded buffer, and every buffer upload's host time,
- a probe thread that sleeps 1 ms at a time and records how late it wakes: the contention for the interpreter lock
  and the cores that the training thread, which launches the step, meets too,
- the host time of every step (at the trainer's `StepMeter.step`) and of every logging window's read (the sync:
  after it the GPU has finished the window's last step; the trainer reads a window after the next step is
  queued, so the GPU has that step to run, where until 2026-11-29 its queue was empty until the next launch).

Per run, over its steady part (from step 20, the end of the second logging window at log_every 10, to the last
step): samples/s and the waiting share from summary.json (the trainer's own), the host's median time a step and its
mean time from a logging sync to the next step launched after it, rows decoded a second, the readers' busy share, each
reader's rows a second while it decodes (contention slows it), the seconds the training thread waited for a
buffer, the mean host time of an upload, and the probe's median and 99th-percentile oversleep. Settings run
interleaved (base, r8, ..., base, r8, ...), so drift of the machine spreads over all of them. Writes NAME.csv / .md
(with the GPU, versions and date) and NAME.png (every run's rate, then the timeline of each setting's first run:
decodes by reader thread, waits, the rate between logging syncs, the probe); ``--from-csv NAME.csv`` redraws the
rates alone.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

sys.path.append(str(Path(__file__).resolve().parent))
from _common import REPO, date_stamp, markdown, md_row, pyplot, save_figure, write_csv  # noqa: E402
from _common import add_overwrite, claim_outputs  # noqa: E402

KNOBS = {"reader_threads": int, "arrow_threads": lambda v: bool(int(v)), "prefetch": int,
         "switch_interval_ms": float, "log_every": int, "placement": str, "reader_nice": int,
         "read_late": lambda v: bool(int(v))}
LOADER_KNOBS = ("reader_threads", "arrow_threads", "prefetch")
KEYS = ["setting", "repeat", "samples_per_sec", "data_wait_fraction", "decoded_rows_per_s", "readers",
        "reader_busy", "reader_rows_per_s", "waits", "wait_s", "upload_ms", "oversleep_p50_ms", "oversleep_p99_ms",
        "host_step_ms_p50", "after_sync_ms", "steady_s", "status"]
STEADY_AFTER_STEP = 20  # the first two logging windows hold compilation, the graph capture and the first buffers


def parse_setting(text: str) -> tuple[str, dict]:
    """``name[:knob=value,...]`` -> (name, knobs); knobs among `KNOBS`."""
    name, _, rest = text.partition(":")
    knobs = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in KNOBS or not value:
            raise argparse.ArgumentTypeError(f"--setting {text}: {item!r} is not one of {', '.join(KNOBS)} = value")
        knobs[key] = KNOBS[key](value)
    if not name:
        raise argparse.ArgumentTypeError(f"--setting {text}: no name")
    return name, knobs


# -- the child: train.py with the loader instrumented --------------------------------------------------------------


def child(knobs: dict, events_path: Path, train_args: list[str]) -> int:
    """Run train.py's command line in this process with the training loader's work recorded into `events_path`."""
    import dlrm.data.parquet_loader as pl
    from dlrm.train import checkpointer, meter, trainer

    events: dict[str, list] = {"decode": [], "wait": [], "upload": [], "step": [], "sync": [], "probe": [],
                               "loader": []}
    train_ids: set[int] = set()
    init, decode, receive, upload = (pl.ParquetLoader.__init__, pl.ParquetLoader._decode,
                                     pl.ParquetLoader._receive, pl.ParquetLoader._upload)

    def patched_init(self, *a, **k):
        if k.get("chain_epochs"):  # the training loader; evaluation loaders keep the defaults
            k.update({key: v for key, v in knobs.items() if key in LOADER_KNOBS})
        init(self, *a, **k)
        if k.get("chain_epochs"):
            train_ids.add(id(self))
            events["loader"].append({"reader_threads": self.reader_threads, "arrow_threads": self.arrow_threads,
                                     "prefetch": self.prefetch})

    def patched_decode(self, k, out, at):
        t0 = time.perf_counter()
        decode(self, k, out, at)
        if id(self) in train_ids:
            events["decode"].append([threading.get_ident(), t0, time.perf_counter(), self.row_groups[k][2]])

    def patched_receive(q, block, end=False):
        t0 = time.perf_counter()
        item = receive(q, block, end)
        if block:
            events["wait"].append([t0, time.perf_counter()])
        return item

    def patched_upload(self, *a, **k):
        t0 = time.perf_counter()
        out = upload(self, *a, **k)
        events["upload"].append([t0, time.perf_counter()])
        return out

    step = meter.StepMeter.step

    def patched_step(self, *a, **k):
        step(self, *a, **k)
        events["step"].append(time.perf_counter())

    log_window = trainer.Trainer._log_window

    def patched_log_window(self, bar):
        log_window(self, bar)
        events["sync"].append(time.perf_counter())  # the host is level with the device here

    trainer.Trainer._log_window = patched_log_window
    if knobs.get("read_late") is False:  # each logging window read at its own step, as before 2026-11-29
        queue = trainer.Trainer._queue_window

        def patched_queue(self, stop):
            queue(self, stop)
            self._log_window(SimpleNamespace(set_postfix=lambda **_: None))  # the device drains here

        trainer.Trainer._queue_window = patched_queue
    if "reader_nice" in knobs:  # the reader threads below the training thread in the scheduler's eyes
        def nice():
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), knobs["reader_nice"])

        def patched_pool(self):
            with self._lock:
                if self._readers is None:
                    self._readers = ThreadPoolExecutor(self.reader_threads, thread_name_prefix="parquet-read",
                                                       initializer=nice)
                return self._readers

        pl.ParquetLoader._pool = patched_pool
    pl.ParquetLoader.__init__, pl.ParquetLoader._decode = patched_init, patched_decode
    pl.ParquetLoader._receive, pl.ParquetLoader._upload = staticmethod(patched_receive), patched_upload
    meter.StepMeter.step = patched_step
    checkpointer.Checkpointer.save = lambda self, run, pos, stats: self.run_dir / "checkpoints" / "not-written"
    checkpointer.Checkpointer.save_best = lambda self, run, pos, stats: None
    if "switch_interval_ms" in knobs:  # how long a thread may hold the interpreter lock while another waits
        sys.setswitchinterval(knobs["switch_interval_ms"] / 1e3)

    stop = threading.Event()

    def probe():
        while not stop.is_set():
            t0 = time.perf_counter()
            time.sleep(0.001)
            events["probe"].append([t0, time.perf_counter() - t0 - 0.001])

    threading.Thread(target=probe, daemon=True, name="oversleep-probe").start()
    from dlrm.cli import main

    sys.argv = ["train.py", *train_args]
    try:
        main()
    except SystemExit as e:
        return int(e.code or 0)
    finally:
        stop.set()
        events_path.write_text(json.dumps(events))
    return 0


# -- the parent: runs, numbers, timeline ----------------------------------------------------------------------------


def steady(events: dict) -> tuple[float, float]:
    """(start, end) of a run's steady part: after step `STEADY_AFTER_STEP` to its last step."""
    steps = events["step"]
    return (steps[min(STEADY_AFTER_STEP, len(steps)) - 1], steps[-1]) if steps else (0.0, 0.0)


def clipped(spans: list, t0: float, t1: float) -> float:
    """Seconds of `spans` ([start, end, ...]) inside [t0, t1]."""
    return sum(max(0.0, min(s[1], t1) - max(s[0], t0)) for s in spans)


def numbers(events: dict) -> dict:
    """One run's loader numbers over its steady part (see the module docstring)."""
    t0, t1 = steady(events)
    steps = events["step"]
    # every step that ends in the steady part, from the one after step `STEADY_AFTER_STEP` (which starts it)
    host = [b - a for a, b in zip(steps[STEADY_AFTER_STEP - 1:], steps[STEADY_AFTER_STEP:])]
    # from a logging window's read to the next step launched after it (the host's time to get back to launching)
    after_sync = [steps[i] - synced for synced in events["sync"]
                  if (i := bisect.bisect_right(steps, synced)) < len(steps) and steps[i] >= t0]
    span = max(t1 - t0, 1e-9)
    decodes = [(t, a, b, n) for t, a, b, n in events["decode"]]
    rows = sum(n * clipped([(a, b)], t0, t1) / max(b - a, 1e-9) for _, a, b, n in decodes)
    busy = clipped([(a, b) for _, a, b, _ in decodes], t0, t1)
    readers = events["loader"][0]["reader_threads"] if events["loader"] else 0
    waits = [(a, b) for a, b in events["wait"] if t0 <= a <= t1]
    uploads = [b - a for a, b in events["upload"] if t0 <= a <= t1]
    late = sorted(x for t, x in events["probe"] if t0 <= t <= t1)
    # nearest rank: the q-quantile is the ceil(q * n)-th smallest (1-based). int(q * n) as a 0-based index was one
    # rank high whenever q * n is whole: the "p99" of 100 samples was their maximum
    pct = lambda q: (1e3 * late[max(0, math.ceil(round(q * len(late), 9)) - 1)]  # noqa: E731
                     if late else float("nan"))
    return {"decoded_rows_per_s": rows / span, "readers": readers, "reader_busy": busy / (span * max(readers, 1)),
            "reader_rows_per_s": rows / max(busy, 1e-9), "waits": len(waits),
            "wait_s": sum(b - a for a, b in waits), "upload_ms": 1e3 * statistics.mean(uploads) if uploads else 0.0,
            "oversleep_p50_ms": pct(0.5), "oversleep_p99_ms": pct(0.99), "steady_s": span,
            "host_step_ms_p50": 1e3 * statistics.median(host) if host else float("nan"),
            "after_sync_ms": 1e3 * statistics.mean(after_sync) if after_sync else float("nan")}


def run_one(args, name: str, knobs: dict, repeat: int, raw: dict, work: Path) -> tuple[dict, dict]:
    tag = f"{name}_{repeat}"
    raw = json.loads(json.dumps(raw))
    raw["data"]["placement"] = knobs.get("placement", "stream")
    raw["train"]["log_every"] = knobs.get("log_every", 10)
    cfg_path = work / f"{tag}.json"
    cfg_path.write_text(json.dumps(raw))
    events_path, log = work / f"{tag}.events.json", work / f"{tag}.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(knobs), "--events", str(events_path),
           "--", "--config", str(cfg_path), "--data", str(args.data), "--epochs", str(args.epochs),
           "--tb-dir", str(work / "tb"), "--run-name", tag]
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO).returncode
    summary_path = work / "tb" / tag / "summary.json"
    row = {"setting": name, "repeat": repeat}
    if args.keep_logs:  # failed runs' too
        (args.out / f"{args.name}_logs").mkdir(parents=True, exist_ok=True)
        for path in (log, events_path):
            if path.exists():
                (args.out / f"{args.name}_logs" / path.name).write_bytes(path.read_bytes())
    if rc != 0 or not summary_path.exists() or not events_path.exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return {**row, "status": f"exit {rc}: {tail[0][:160]}"}, {}
    summary, events = json.loads(summary_path.read_text()), json.loads(events_path.read_text())
    row.update(samples_per_sec=summary["samples_per_sec"], data_wait_fraction=summary["data_wait_fraction"],
               **numbers(events), status="ok")
    return row, {"events": events, "summary": summary, "log": log.read_text(errors="replace")}


def plot_timeline(ax, events: dict, batch: int, log_every: int, title: str) -> None:
    """One run: reader threads' decodes (one lane each), the training thread's waits, the probe, the step rate."""
    t0, t1 = steady(events)
    start = events["step"][0] if events["step"] else 0.0
    lanes = {t: i for i, t in enumerate(sorted({d[0] for d in events["decode"]}))}
    for t, a, b, _ in events["decode"]:
        if a <= t1:
            ax.broken_barh([(a - start, b - a)], (lanes[t] + 0.1, 0.8), color="tab:blue", linewidth=0)
    waits = [(a - start, b - a) for a, b in events["wait"] if a <= t1]
    ax.broken_barh(waits, (-1.9, 1.6), color="tab:red", linewidth=0)
    ax.set_yticks([-1.1] + [i + 0.5 for i in range(len(lanes))], ["waits"] + [f"r{i}" for i in range(len(lanes))],
                  fontsize=5)
    rate = ax.twinx()
    syncs = events["sync"]  # after each logging step's sync: the device's own progress
    rate.plot([b - start for b in syncs[1:]], [log_every * batch / (b - a) / 1e6 for a, b in zip(syncs, syncs[1:])],
              color="black", linewidth=0.8)
    late = [(t - start, 1e3 * x) for t, x in events["probe"] if t <= t1]
    rate.plot([t for t, _ in late], [min(x, 20) / 5 for _, x in late], color="tab:orange", linewidth=0.4, alpha=0.7)
    rate.set_ylabel("M samples/s (black); oversleep ms / 5 (orange)", fontsize=6)
    ax.axvline(t0 - start, color="gray", linestyle="--", linewidth=0.7)
    ax.set_xlim(0, t1 - start)
    ax.set_title(title, fontsize=8)


def plot_rates(ax, rows: list[dict]) -> None:
    """Every run's samples/s by setting (one bar a run, in run order)."""
    ok = [r for r in rows if r["status"] == "ok"]
    names = list(dict.fromkeys(r["setting"] for r in ok))
    for i, name in enumerate(names):
        runs = [float(r["samples_per_sec"]) / 1e6 for r in ok if r["setting"] == name]
        xs = [i + (j - (len(runs) - 1) / 2) * 0.8 / len(runs) for j in range(len(runs))]
        bars = ax.bar(xs, runs, width=0.8 / len(runs) * 0.9, color=f"C{i}")
        ax.bar_label(bars, [f"{v:.2f}" for v in runs], fontsize=6)
    ax.set_xticks(range(len(names)), names, fontsize=7)
    ax.set_ylabel("M samples/s (steady state)")
    ax.set_title("samples/s, one bar a run", fontsize=8)


def table_rows(rows: list[dict]) -> list[str]:
    table = ["| setting | run | samples/s | waiting | host ms a step (p50) | after a sync (ms) | decoded rows/s "
             "| readers | busy | rows/s a reader | waits (s) | upload ms | oversleep p50 / p99 ms |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if r["status"] != "ok":
            table.append(md_row([r["setting"], r["repeat"], r["status"]] + [""] * 10))
            continue
        table.append(md_row([
            r["setting"], r["repeat"], f"{r['samples_per_sec']:,.0f}", f"{r['data_wait_fraction']:.1%}",
            f"{r['host_step_ms_p50']:.2f}", f"{r['after_sync_ms']:.1f}", f"{r['decoded_rows_per_s'] / 1e6:.2f}M",
            r["readers"], f"{r['reader_busy']:.0%}", f"{r['reader_rows_per_s'] / 1e3:,.0f}k",
            f"{r['waits']} ({r['wait_s']:.2f})", f"{r['upload_ms']:.1f}",
            f"{r['oversleep_p50_ms']:.2f} / {r['oversleep_p99_ms']:.2f}"]))
    return table


def figure(rows: list[dict], firsts: dict, batch: int, log_every: dict, machine: str, path: Path) -> None:
    """The runs' rates, then the timeline of each setting's first run (when its events are at hand)."""
    plt = pyplot()
    fig, axes = plt.subplots(1 + len(firsts), 1, figsize=(11, 3 + 2.6 * len(firsts)), squeeze=False)
    plot_rates(axes[0, 0], rows)
    for ax, (name, run) in zip(axes[1:, 0], firsts.items()):
        s = run["summary"]
        plot_timeline(ax, run["events"], batch, log_every[name],
                      f"{name}: {s['samples_per_sec'] / 1e6:.2f}M samples/s, waiting {s['data_wait_fraction']:.0%}")
    if firsts:
        axes[-1, 0].set_xlabel("seconds since the first step (dashed: steady part starts); decodes by reader thread "
                               "(blue), waits for a buffer (red)")
    fig.suptitle(f"Streamed training\n{machine}", fontsize=8)
    save_figure(fig, path)


def replot(csv_path: Path) -> int:
    """Redraw NAME.png's rates from NAME.csv alone (the runs' events are not kept there)."""
    import csv

    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise SystemExit(f"--from-csv: {csv_path}: no rows")
    machine = rows[0].get("machine", "")
    figure(rows, {}, 0, {}, machine, csv_path.with_suffix(".png"))
    print(f"wrote {csv_path.with_suffix('.png')}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=REPO / "configs" / "mlperf-dcnv2.json")
    ap.add_argument("--data", type=Path, help="the parquet dataset to stream")
    ap.add_argument("--epochs", type=int, default=24)
    ap.add_argument("--setting", action="append", type=parse_setting, default=None,
                    help="name[:knob=value,...], knobs: " + ", ".join(KNOBS) + " (repeatable; default: base)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no run after this many seconds (the report covers the runs made)")
    ap.add_argument("--machine", default="", help="the machine, for the Markdown (the GPU is read from summary.json)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--name", default="stream_timeline")
    ap.add_argument("--keep-logs", action="store_true", help="copy each run's log and events under OUT/NAME_logs/")
    ap.add_argument("--from-csv", type=Path, help="only redraw this CSV's figure (its rates) next to it")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--events", type=Path, help=argparse.SUPPRESS)
    add_overwrite(ap)  # (--from-csv redraws the PNG beside the CSV, as asked: not refused)
    argv = sys.argv[1:] if argv is None else argv
    if "--child" in argv:
        split = argv.index("--")
        args = ap.parse_args(argv[:split])
        return child(json.loads(args.child), args.events, argv[split + 1:])
    args = ap.parse_args(argv)
    if args.from_csv is not None:
        return replot(args.from_csv)
    if args.data is None:
        ap.error("--data: required")
    outputs = claim_outputs(ap, args, args.out,
                            [f"{args.name}.{ext}" for ext in ("csv", "md", "png")] + [f"{args.name}_logs"] * args.keep_logs)
    settings = args.setting or [("base", {})]
    raw = json.loads(args.config.read_text())
    raw["train"]["eval_every"] = None
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    rows, firsts = [], {}
    with tempfile.TemporaryDirectory(prefix="stream_timeline_") as tmp:
        work = Path(tmp)
        for repeat, (name, knobs) in ((r, s) for r in range(1, args.repeat + 1) for s in settings):
            if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
                print(f"--budget-s {args.budget_s:g}: no more runs after {len(rows)}", flush=True)
                break
            row, run = run_one(args, name, knobs, repeat, raw, work)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if run and name not in firsts:
                firsts[name] = run
    ok = next(iter(firsts.values()), None)
    gpu = ok["summary"].get("device_name", "?") if ok else "?"
    versions = ok["summary"].get("versions", {}) if ok else {}
    machine = f"{gpu}{', ' + args.machine if args.machine else ''}; " + ", ".join(f"{k} {v}" for k, v in
                                                                                 versions.items())
    write_csv(args.out / f"{args.name}.csv", rows, KEYS, {"machine": machine, "date": date_stamp()})
    settings_text = "; ".join(f"{n}: {k or 'the defaults'}" for n, k in settings)
    note = (f"{machine}; {date_stamp()}. `python benchmarks/stream_timeline.py --config {args.config.name} --data DIR "
            f"--epochs {args.epochs} --repeat {args.repeat}` with settings {settings_text}. Steady part: from step "
            f"{STEADY_AFTER_STEP} to the last. Checkpoints not written (measurement only).")
    text = markdown("Streamed training, the loader's work timed", [note], table_rows(rows))
    (args.out / f"{args.name}.md").write_text(text)
    print(text, end="")
    if any(r["status"] == "ok" for r in rows):
        figure(rows, firsts, raw["data"]["batch_size"], {n: k.get("log_every", 10) for n, k in settings}, machine,
               args.out / f"{args.name}.png")
    outputs.report()
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
