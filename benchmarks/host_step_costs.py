"""Where a training run's host time goes a step: each per-step call of the loop timed inside real train.py runs.

    python benchmarks/host_step_costs.py --config configs/sample.json --runs 3 --out benchmarks/results \
        --name host_step_costs_h200 -- --epochs 6

On a GPU the default run (`configs/sample.json`, batch 256, the step one CUDA graph) is bound by the host's time a
step or by the graph's device time, whichever is longer; this says which, and what the host spends. Each run is a
child process that wraps the loop's per-step calls (the step, the schedulers, the meter, the batch's fetch, the
logging window's calls, ...) with ``time.perf_counter`` and then runs ``train.py`` with the given arguments
(evaluations and the baseline off unless the arguments turn them on; the run's directory is a temporary one). Per run
and call it reports calls a step, the median and mean microseconds a call (over the calls made in the last four
fifths of the run's steps: past the warm-up and the capture) and microseconds a step (mean x calls a step), and the
loop's step-to-step interval: its median is the host's own pace, its mean the run's (a mean far above the median is
the host waiting for the device). The wrappers cost ~0.3 us a call. Writes ``NAME.csv`` (a row a run and call),
``NAME.md`` and ``NAME.png`` (microseconds a step by call, a bar a run).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))
from _common import add_overwrite, claim_outputs, env_line, environment, markdown, md_row  # noqa: E402
from _common import pyplot, save_figure, write_csv  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# (dotted path of a per-step callable, its label): what the training loop calls every step or every logging window
CALLS = [
    ("dlrm.train.graphed_step.GraphedTrainStep.__call__", "graphed step"),
    ("dlrm.train.step.TrainStep.__call__", "ordinary step"),
    ("dlrm.train.step.TrainStep.load_lrs", "load_lrs"),
    ("torch.cuda.graphs.CUDAGraph.replay", "graph replay"),
    ("dlrm.train.optim.ScheduledLR.step", "scheduler step"),
    ("dlrm.train.meter.StepMeter.step", "meter step"),
    ("dlrm.train.meter.DataWaitTimer.fetch", "fetch"),
    ("dlrm.logging_setup.ProgressBar.update", "bar update"),
    ("dlrm.train.trainer.Trainer._read_window", "read window"),
    ("dlrm.train.trainer.Trainer._queue_window", "queue window"),
    ("torch.utils.tensorboard.writer.SummaryWriter.add_scalar", "add_scalar"),
]
KEYS = ["run", "call", "calls", "later_calls", "calls_per_step", "median_us", "mean_us", "us_per_step",
        "interval_median_us", "interval_mean_us", "samples_per_s"]


def _owner(path: str):
    """The module or class holding the last name of a dotted path."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:-1]:
            owner = getattr(owner, name)
        return owner, parts[-1]
    raise ImportError(path)


def child(result: Path, train_args: list[str]) -> None:
    """Wrap `CALLS`, run train.py with `train_args` in this process, write the timings to `result`."""
    durations: dict[str, list[tuple[float, float]]] = {}  # label -> (start, seconds) a call
    for path, label in CALLS:
        owner, name = _owner(path)
        fn, record = getattr(owner, name), durations.setdefault(label, [])

        def timed(*a, _fn=fn, _record=record, **k):
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                _record.append((t, time.perf_counter() - t))

        setattr(owner, name, timed)
    meter = importlib.import_module("dlrm.train.meter")
    stamps: list[float] = []
    step = meter.StepMeter.step

    def stamped(self, *a, **k):
        step(self, *a, **k)
        stamps.append(time.perf_counter())

    meter.StepMeter.step = stamped
    sys.argv = ["train.py", *train_args]
    os.chdir(REPO)
    try:
        runpy.run_path(str(REPO / "train.py"), run_name="__main__")
    except SystemExit as e:  # train.py's exit: the timings are written only for a run that succeeded
        if e.code not in (None, 0):
            raise
    json.dump({"steps": len(stamps), "stamps": stamps, "durations": durations}, open(result, "w"))


def summarize(raw: dict) -> tuple[dict, list[dict]]:
    """The loop's interval and each call's row, over the calls made in the last four fifths of the run's steps.

    Cut by time, not by each call's own count: a call made only in the warm-up (on CUDA the ordinary step, which
    warms up and captures the graph) has no later calls, rather than a tail of compile-long warm-up calls counted as
    if spread over every step."""
    n, stamps = raw["steps"], raw["stamps"]
    later = stamps[n // 5:]
    cut = stamps[n // 5 - 1] if n >= 5 else float("-inf")  # the end of the first fifth's last step
    gaps = [b - a for a, b in zip(later, later[1:])]
    loop = {"interval_median_us": statistics.median(gaps) * 1e6 if gaps else float("nan"),
            "interval_mean_us": statistics.fmean(gaps) * 1e6 if gaps else float("nan")}
    rows = []
    for label, d in raw["durations"].items():
        if not d:
            continue
        tail = [seconds for start, seconds in d if start >= cut]
        per_step = len(tail) / max(n - n // 5, 1)
        mean = statistics.fmean(tail) * 1e6 if tail else float("nan")
        rows.append({"call": label, "calls": len(d), "later_calls": len(tail), "calls_per_step": round(per_step, 3),
                     "median_us": round(statistics.median(tail) * 1e6, 2) if tail else float("nan"),
                     "mean_us": round(mean, 2), "us_per_step": round(mean * per_step, 2) if tail else 0.0})
    return loop, rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="arguments after -- go to train.py (after --config)")
    ap.add_argument("--config", default="configs/sample.json", help="train.py's --config")
    ap.add_argument("--runs", type=int, default=3, help="train.py runs, one after another")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--name", default="host_step_costs")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    add_overwrite(ap)
    args, rest = ap.parse_known_args(argv)
    rest = rest[1:] if rest[:1] == ["--"] else rest
    if args.child:
        return child(args.child, rest)
    if args.runs < 1:
        ap.error(f"--runs: {args.runs} must be at least 1")
    if not Path(args.config).is_file():
        ap.error(f"--config: {args.config} does not exist")
    outputs = claim_outputs(ap, args, args.out, [f"{args.name}.{x}" for x in ("csv", "md", "png")])
    import torch

    env = environment(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    rows, table = [], []
    with tempfile.TemporaryDirectory() as tmp:
        config = json.load(open(args.config))
        config.setdefault("train", {}).setdefault("eval_every", None)  # the loop alone, unless asked for
        config["train"].setdefault("baseline", False)
        conf = Path(tmp) / "config.json"
        json.dump(config, open(conf, "w"))
        for r in range(1, args.runs + 1):
            result = Path(tmp) / f"run{r}.json"
            train_args = ["--config", str(conf), "--tb-dir", tmp, "--run-name", f"run{r}", *rest]
            done = subprocess.run([sys.executable, __file__, "--child", str(result), "--", *train_args],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"run {r}: train.py failed (exit {done.returncode}): {done.stderr.strip()[-800:]}")
            loop, calls = summarize(json.load(open(result)))
            summary = json.load(open(Path(tmp) / f"run{r}" / "summary.json"))
            for row in calls:
                rows.append({"run": r, **row, **loop, "samples_per_s": summary.get("samples_per_sec")})
            table.append(md_row([r, f"{loop['interval_median_us']:.0f}", f"{loop['interval_mean_us']:.0f}",
                                 f"{summary.get('samples_per_sec') or float('nan'):,.0f}"]
                                + [f"{c['us_per_step']:.1f}" if c["later_calls"] else "-" for c in calls]))
            header = ["run", "interval median us", "interval mean us", "samples/s"] + [c["call"] for c in calls]
            print(f"run {r}: step interval median {loop['interval_median_us']:.0f} us, mean "
                  f"{loop['interval_mean_us']:.0f} us; " + ", ".join(f"{c['call']} {c['us_per_step']:.1f}"
                                                                    for c in calls) + " us/step", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / f"{args.name}.csv", rows, KEYS, env)
    cmd = f"python benchmarks/host_step_costs.py --config {args.config} --runs {args.runs} " + " ".join(["--", *rest])
    text = markdown(f"Host time a training step: {args.config}", [
        env_line(env), f"`{cmd}`",
        "Per call: mean microseconds a call times calls a step, over the calls made in the last four fifths of each "
        "run's steps (`-`: none then, e.g. a graphed run's ordinary step, which only warms up and captures). "
        "Interval: the loop's time from one step to the next; its median is the host's pace, its mean the run's (far "
        "above the median: the host waited for the device, inside `read window` or the step's launch)."],
        [md_row(header), md_row(["---"] * len(header)), *table])
    (args.out / f"{args.name}.md").write_text(text)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = sorted({row["call"] for row in rows}, key=lambda c: -max(r["us_per_step"] for r in rows if r["call"] == c))
    width = 0.8 / args.runs
    for r in range(1, args.runs + 1):
        per = {row["call"]: row["us_per_step"] for row in rows if row["run"] == r}
        ax.bar([i + (r - 1) * width for i in range(len(labels))], [per.get(c, 0.0) for c in labels], width,
               label=f"run {r}")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))], labels, rotation=30, ha="right")
    ax.set_ylabel("host us per step (log)")
    ax.set_yscale("log")  # the step itself is 10-100x the rest
    ax.set_title(f"{args.config}: host time a step by call ({env['device']})")
    ax.legend()
    save_figure(fig, args.out / f"{args.name}.png")
    outputs.report()


if __name__ == "__main__":
    main()
