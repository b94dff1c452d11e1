"""Draw one profiled training step as a timeline PNG: the step's named ranges on the host and,
on CUDA, the device kernels under them.

    python benchmarks/trace_timeline.py tb_logs/<run>/ --out benchmarks/results/profile_timeline.png

Reads the gzipped Chrome trace that ``--profile`` writes into the run directory (the file the
TensorBoard PyTorch Profiler tab and Perfetto open) and draws the last complete ProfilerStep:
one lane for the step's ranges (data, SparseArch, DenseArch, InteractionArch, OverArch, loss,
backward, optimizer), one for the device time the profiler attributes to each range
(``gpu_user_annotation``), and one for the kernels themselves, coloured by the range that launched
them. A picture that needs no browser and no network.

Also writes ``<out>.md`` (and prints it): under its title what produced the trace (the run's device and
library versions from the ``summary.json`` beside it, and the trace's date), then the same step in numbers, the host
and device milliseconds of each range, the device's busy time, the top kernels, and the host calls that took
the most time (CUDA runtime calls included: a step whose host time far exceeds its device busy time
is bound by launches, not by the GPU).

The analysis lives in ``dlrm/train/trace_summary.py``; a profiled training run writes the same
tables and picture into its TensorBoard events (``profile/*``) and run directory by itself.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

# _common (which puts the repository first on sys.path), also when loaded by path (tests);
# appended: benchmarks/kernels.py must not shadow the kernels package
sys.path.append(str(Path(__file__).resolve().parent))

import _common  # noqa: E402,F401  (the repository on sys.path, for dlrm)
from _common import add_overwrite, claim_outputs  # noqa: E402

from dlrm.train import trace_summary  # noqa: E402

RANGES = trace_summary.RANGES
last_step = trace_summary.profiled_step


def load_trace(path: Path) -> dict:
    """The trace JSON: `path` itself, or the newest *.pt.trace.json(.gz) under a run directory."""
    try:
        return trace_summary.load_trace(path)
    except trace_summary.TraceError as e:
        raise SystemExit(str(e)) from None


def draw(trace: dict, out: Path, title: str) -> None:
    """Write the step's timeline PNG to `out` (see dlrm.train.trace_summary.timeline_figure)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(trace_summary.timeline_png(trace, title, dpi=120))


def step_line(trace: dict) -> str:
    """The step drawn, in one line: its name and how many host ranges, device ranges and kernels it holds."""
    s = trace_summary.collect(trace)
    return (f"{s.step['name']}, {len(s.host_ranges)} host ranges, {len(s.annotations)} device ranges, "
            f"{sum(e.get('cat') == 'kernel' for e, _ in s.device)} kernels")


def summarize(trace: dict, title: str, top: int = 15) -> str:
    """Markdown: per-range host/device ms of the step, device busy ms, top kernels, the top host calls."""
    return trace_summary.report(trace_summary.summarize_step(trace, top), title)


def provenance(trace_file: Path, trace: dict) -> str:
    """What produced the trace, in one line: the run's device and library versions from the ``summary.json`` that a
    finished run writes beside its trace (else the device the trace itself names), and when the trace was written."""
    written = datetime.datetime.fromtimestamp(trace_file.stat().st_mtime, datetime.timezone.utc)
    when = f"trace written {written:%Y-%m-%d %H:%M} UTC"
    summary = trace_file.parent / "summary.json"
    try:
        run = json.loads(summary.read_text())
        made = ", ".join(f"{name} {version}" for name, version in run["versions"].items())
        return f"Run: {trace_file.parent.name} on {run['device_name']}; {made}; {when}."
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        devices = sorted({d["name"] for d in trace.get("deviceProperties", []) if isinstance(d, dict) and "name" in d})
        device = ", ".join(devices) or "no CUDA device in the trace"
        return f"Run: {trace_file.parent.name} on {device}; library versions unknown (no readable {summary}); {when}."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path, help="a run directory written with --profile, or a trace file")
    ap.add_argument("--out", type=Path, default=Path("profile_timeline.png"))
    ap.add_argument("--title", default="one training step")
    add_overwrite(ap)
    args = ap.parse_args()
    md = args.out.with_suffix(".md")
    if md == args.out:  # the numbers would be written over the picture
        ap.error(f"--out {args.out}: the timeline's PNG path, not {md.name} (the numbers go to <out>.md)")
    # the PNG and the Markdown beside it: refused where either exists, unless --overwrite (both were replaced silently)
    outputs = claim_outputs(ap, args, args.out.parent, [args.out.name, md.name])
    trace = load_trace(args.trace)
    try:
        text = summarize(trace, args.title)  # before anything is written: a foreign trace leaves no PNG without its .md
        line = step_line(trace)
        draw(trace, args.out, args.title)
    except trace_summary.TraceError as e:
        raise SystemExit(f"{args.trace}: {e}") from None
    title, rest = text.split("\n", 1)  # the provenance under the title
    text = f"{title}\n\n{provenance(trace_summary.find_trace(args.trace), trace)}\n{rest}"
    md.write_text(text)
    print(text)
    print(f"{line}; ", end="")
    outputs.report()


if __name__ == "__main__":
    main()
