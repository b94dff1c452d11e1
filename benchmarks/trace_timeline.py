"""Draw one profiled training step as a timeline PNG: the step's named ranges on the host and,
on CUDA, the device kernels under them.

    python benchmarks/trace_timeline.py tb_logs/<run>/ --out benchmarks/results/profile_timeline.png

Reads the gzipped Chrome trace that ``--profile`` writes into the run directory (the file the
TensorBoard PyTorch Profiler tab and Perfetto open) and draws the last complete ProfilerStep:
one lane for the step's ranges (data, SparseArch, DenseArch, InteractionArch, OverArch, loss,
backward, optimizer), one for the device time attributed to each range (``gpu_user_annotation``),
and one for the kernels themselves. A picture that needs no browser and no network.

Also writes ``<out>.md`` (and prints it): the same step in numbers, the host and device
milliseconds of each range, the device's busy time, and the host calls that took the most time
(CUDA runtime calls included: a step whose host time far exceeds its device busy time is bound
by launches, not by the GPU).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

# _common (which puts the repository first on sys.path), also when loaded by path (tests);
# appended: benchmarks/kernels.py must not shadow the kernels package
sys.path.append(str(Path(__file__).resolve().parent))

from _common import pyplot, save_figure  # noqa: E402

plt = pyplot()

RANGES = ("data", "SparseArch", "DenseArch", "InteractionArch", "OverArch", "loss", "backward", "optimizer")
COLORS = dict(zip(RANGES, plt.get_cmap("tab10").colors))


def load_trace(path: Path) -> dict:
    """The trace JSON: `path` itself, or the newest *.pt.trace.json(.gz) under a run directory."""
    if path.is_dir():
        found = sorted(path.rglob("*.pt.trace.json*"), key=lambda p: p.stat().st_mtime)
        if not found:
            raise SystemExit(f"{path}: no *.pt.trace.json(.gz) here; train with --profile first")
        path = found[-1]
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def last_step(events: list[dict]) -> dict:
    steps = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")
             and e.get("cat") == "user_annotation"]
    if not steps:
        raise SystemExit("the trace holds no ProfilerStep ranges")
    # the last step range may be the tail after training (evaluation, profiler exit): take the last
    # one that holds a training step's backward
    backward = [e["ts"] for e in events if e.get("cat") == "user_annotation" and e.get("name") == "backward"]
    for step in sorted(steps, key=lambda e: -e["ts"]):
        if any(step["ts"] <= t < step["ts"] + step["dur"] for t in backward):
            return step
    return max(steps, key=lambda e: e["ts"])


def within(events: list[dict], cat: str, lo: float, hi: float) -> list[dict]:
    return [e for e in events if e.get("cat") == cat and e.get("ph") == "X" and lo <= e["ts"] < hi]


def draw(trace: dict, out: Path, title: str) -> None:
    events = trace["traceEvents"]
    step = last_step(events)
    t0, t1 = step["ts"], step["ts"] + step["dur"]
    host = [e for e in within(events, "user_annotation", t0, t1) if e["name"] in RANGES]
    # Device work launched in this step may finish after the host range ends: allow the next step's length.
    gpu_ranges = [e for e in within(events, "gpu_user_annotation", t0, t1 + step["dur"]) if e["name"] in RANGES]
    kernels = within(events, "kernel", t0, t1 + step["dur"])
    lanes = [("host ranges", host), ("device time per range", gpu_ranges), ("device kernels", kernels)]
    lanes = [(n, evs) for n, evs in lanes if evs]
    fig, ax = plt.subplots(figsize=(14, 1.2 + 0.9 * len(lanes)))
    for row, (_, evs) in enumerate(lanes):
        for e in evs:
            color = COLORS.get(e["name"], "0.45")
            ax.broken_barh([((e["ts"] - t0) / 1e3, e["dur"] / 1e3)], (row - 0.4, 0.8), facecolors=color,
                           edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(lanes)), [n for n, _ in lanes])
    ax.invert_yaxis()
    ax.set_xlabel(f"ms since the start of {step['name']} (host step {step['dur'] / 1e3:.2f} ms)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[r]) for r in RANGES]
    ax.legend(handles, RANGES, ncol=len(RANGES), loc="lower center", bbox_to_anchor=(0.5, 1.0), fontsize=8,
              frameon=False)
    fig.suptitle(title)
    save_figure(fig, out, dpi=120, bbox_inches="tight")
    print(f"wrote {out}: {step['name']}, {len(host)} host ranges, {len(gpu_ranges)} device ranges, "
          f"{len(kernels)} kernels")


def summarize(trace: dict, title: str, top: int = 15) -> str:
    """Markdown: per-range host/device ms of the last step, device busy ms, the top host calls."""
    events = trace["traceEvents"]
    step = last_step(events)
    t0, t1 = step["ts"], step["ts"] + step["dur"]
    host = within(events, "user_annotation", t0, t1)
    gpu = within(events, "gpu_user_annotation", t0, t1 + step["dur"])
    kernels = within(events, "kernel", t0, t1 + step["dur"])
    busy = sum(e["dur"] for e in kernels) / 1e3
    lines = [f"# {title}", "", f"{step['name']}: host {step['dur'] / 1e3:.3f} ms, device kernels busy {busy:.3f} ms "
             f"({len(kernels)} kernels)", "", "| range | host ms | device ms |", "| --- | ---: | ---: |"]  # fmt: skip
    for name in RANGES:
        h = sum(e["dur"] for e in host if e["name"] == name) / 1e3
        d = sum(e["dur"] for e in gpu if e["name"] == name) / 1e3
        if h or d:
            lines.append(f"| {name} | {h:.3f} | {d:.3f} |")
    calls: dict[str, list[float]] = {}
    for cat in ("cpu_op", "cuda_runtime", "cuda_driver", "python_function"):
        for e in within(events, cat, t0, t1):
            calls.setdefault(e["name"], []).append(e["dur"] / 1e3)
    ranked = sorted(calls.items(), key=lambda kv: -sum(kv[1]))[:top]
    lines += ["", f"Host calls in the step by total time (inclusive: nested calls count in their callers too), top {top}:",
              "", "| host call | calls | total ms |", "| --- | ---: | ---: |"]  # fmt: skip
    lines += [f"| `{name[:80]}` | {len(d)} | {sum(d):.3f} |" for name, d in ranked]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path, help="a run directory written with --profile, or a trace file")
    ap.add_argument("--out", type=Path, default=Path("profile_timeline.png"))
    ap.add_argument("--title", default="one training step")
    args = ap.parse_args()
    trace = load_trace(args.trace)
    draw(trace, args.out, args.title)
    text = summarize(trace, args.title)
    args.out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
