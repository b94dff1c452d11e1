"""Streamed training's throughput window by window, from train.py logs: where the step waits for data.

    python benchmarks/train_log_windows.py --logs r/train_counts_3.log r/train_float_3.log \
        --labels counts,float --machine "one H200, 16 cores" --out benchmarks/results --name dense_format_windows

train.py's progress bar shows the samples/s of the last ``train.log_every`` steps (``samples_s=`` in its
postfix, updated at each logging step). This reads every window from a log (a window ends at the step where
a new value first appears), marks the windows that hold the first step of an epoch after the first (the
epoch length from the log's "N steps/epoch", or ``--steps-per-epoch``), and reports per log: the run's own
overall rate and waiting share (its final "validation: ..." line), the median window after the first (which
holds compilation and the graph capture), the median of those without an epoch start and of those with one,
and the fastest. A small dataset's epochs are short (2.08M MLPerf-shaped training rows: 31 steps at batch
65536), so how much of the waiting an epoch boundary causes decides what a large dataset would see.
Writes ``NAME.csv`` (one row a window), ``NAME.md`` and ``NAME.png`` (rate against step, epoch starts dashed).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))
from _common import date_stamp, markdown, md_row, pyplot, save_figure, write_csv  # noqa: E402
from _common import add_overwrite, claim_outputs  # noqa: E402

_WINDOW = re.compile(r"\|\s*(\d+)/(\d+) \[[^\]]*samples_s=([\d,]+)\]")
_SUMMARY = re.compile(r"validation: AUC [\d.]+.*?; (\d+) steps?, ([\d,]+) samples?, ([\d,]+) samples/s "
                      r"\(waiting for data (\d+)% of the time\)")
KEYS = ["log", "label", "first_step", "end_step", "samples_per_s", "epoch_start"]


def windows(text: str) -> list[tuple[int, int, int]]:
    """(first step, last step, samples/s) of every logging window in a train.py log, in order."""
    out, last_value, last_step = [], None, 0
    for step, _, value in _WINDOW.findall(text):
        step, value = int(step), int(value.replace(",", ""))
        if value != last_value and step > last_step:
            out.append((last_step + 1, step, value))
            last_value, last_step = value, step
    return out


def summary(text: str) -> dict:
    """The run's own totals from its final "validation: ..." line (empty if the run did not get there)."""
    found = _SUMMARY.findall(text)
    if not found:
        return {}
    steps, samples, rate, wait = found[-1]
    return {"steps": int(steps), "samples": int(samples.replace(",", "")), "rate": int(rate.replace(",", "")),
            "wait_pct": int(wait)}


def holds_epoch_start(first: int, last: int, per_epoch: int | None) -> bool:
    """Whether steps ``first..last`` (1-based) hold the first step of an epoch after the first one."""
    if not per_epoch:
        return False
    return any(first <= e * per_epoch + 1 <= last for e in range(1, last // per_epoch + 1))


def epoch_steps(text: str) -> int | None:
    """Steps an epoch, from the log's "N steps/epoch" ("1 step/epoch": train.py says the count's own plural; None if
    it does not say)."""
    m = re.search(r"([\d,]+) steps?/epoch", text)
    return int(m.group(1).replace(",", "")) if m else None


def median_m(values: list[int]) -> str:
    return f"{statistics.median(values) / 1e6:.2f}M" if values else "-"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--logs", nargs="+", type=Path, required=True, help="train.py logs (stdout and stderr)")
    ap.add_argument("--labels", default=None, help="comma list, one per log (default: the file names)")
    ap.add_argument("--steps-per-epoch", type=int, default=None, help="default: each log's own 'N steps/epoch'")
    ap.add_argument("--machine", default="", help="where the logs were written (the GPU machine), for the Markdown")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--name", default="train_log_windows")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    outputs = claim_outputs(ap, args, args.out, [f"{args.name}.csv", f"{args.name}.md", f"{args.name}.png"])
    labels = args.labels.split(",") if args.labels else [p.stem for p in args.logs]
    if len(labels) != len(args.logs):
        ap.error(f"--labels: {len(labels)} labels for {len(args.logs)} logs")
    rows = []
    table = ["| run | log | overall samples/s | waiting | windows | median window | without an epoch start | with one "
             "| fastest |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    lengths = set()
    for path, label in zip(args.logs, labels):
        try:
            text = path.read_text(errors="replace")
        except OSError as e:
            ap.error(f"--logs: {path}: cannot be read ({e.strerror})")
        found, total = windows(text), summary(text)
        if not found:
            ap.error(f"--logs: {path}: no progress-bar windows (samples_s=) in it")
        per_epoch = args.steps_per_epoch or epoch_steps(text)
        lengths.add(per_epoch)
        marked = [(first, last, value, holds_epoch_start(first, last, per_epoch)) for first, last, value in found]
        rows += [{"log": str(path), "label": label, "first_step": first, "end_step": last, "samples_per_s": value,
                  "epoch_start": start} for first, last, value, start in marked]
        later = marked[1:]  # the first window holds compilation and the graph capture
        table.append(md_row([
            label, path.name, f"{total['rate']:,}" if total else "n/a (no final line)",
            f"{total['wait_pct']}%" if total else "n/a", len(found), median_m([w[2] for w in later]),
            median_m([w[2] for w in later if not w[3]]), median_m([w[2] for w in later if w[3]]),
            f"{max(w[2] for w in later) / 1e6:.2f}M" if later else "-"]))
        ax.plot([w[1] for w in found], [w[2] / 1e6 for w in found], marker=".", linewidth=0.8, label=label)
    per_epoch = lengths.pop() if len(lengths) == 1 else None
    if per_epoch:
        for e in range(1, max(r["end_step"] for r in rows) // per_epoch + 1):
            ax.axvline(e * per_epoch + 0.5, color="gray", linestyle="--", linewidth=0.7)
    ax.set_xlabel("step (window end)")
    ax.set_ylabel("M samples/s over the window")
    ax.set_title(f"train.py, streamed: throughput by logging window (dashed: epoch starts)\n{args.machine}", fontsize=9)
    ax.legend(fontsize=8)
    write_csv_to = args.out / f"{args.name}.csv"
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(write_csv_to, rows, KEYS, {"machine": args.machine, "parsed": date_stamp()})
    note = (f"Logs written on {args.machine or 'an unnamed machine'}; parsed {date_stamp()} by "
            "benchmarks/train_log_windows.py. A window is train.log_every steps; the first (compilation, graph "
            f"capture) is left out of the medians. Epoch length: {per_epoch or 'per log'} steps.")
    text = markdown("Streamed training by logging window", [note], table)
    (args.out / f"{args.name}.md").write_text(text)
    save_figure(fig, args.out / f"{args.name}.png")
    print(text, end="")
    outputs.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
