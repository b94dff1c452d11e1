"""One profiled training step, read from a torch.profiler trace: where its time went per named range
(host and device), the kernels (or, on a CPU run, the CPU ops) that took it, and a timeline picture.

Reads the gzipped Chrome trace that ``--profile`` writes into the run directory (the file the
PyTorch Profiler tab and Perfetto open). Used at the end of a profiled run by
`dlrm.train.reporting.log_profile` (TensorBoard text and image summaries, ``profile_step.md``,
``profile_timeline.png``) and by ``benchmarks/trace_timeline.py``.

Device time is attributed through the trace's correlation ids: a kernel (or memcpy/memset) counts
in the named range that was open on the host when its launch call (``cudaLaunchKernel``,
``cudaGraphLaunch``, ...) ran. Launches are matched to ranges by time, whatever their thread: the
autograd engine launches the backward kernels from its own device thread while the ``backward``
range is open on the main thread. A CPU trace has no device activity: its tables give host time
per range and the CPU ops by self time instead of columns of zeros.

Example, on a hand-made trace of one step on the CPU:

    >>> ev = lambda name, cat, ts, dur: {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "tid": 1}
    >>> trace = {"traceEvents": [ev("ProfilerStep#1", "user_annotation", 0, 1000),
    ...     ev("DenseArch", "user_annotation", 0, 600), ev("aten::addmm", "cpu_op", 10, 500),
    ...     ev("aten::copy_", "cpu_op", 20, 100), ev("backward", "user_annotation", 600, 300)]}
    >>> s = summarize_step(trace)
    >>> [(r.name, r.host_ms) for r in s.ranges], s.on_device
    ([('DenseArch', 0.6), ('backward', 0.3), ('other', 0.1)], False)
    >>> [(t.name, t.ms) for t in s.top]  # self time: addmm's 0.5 ms less the copy nested in it
    [('aten::addmm', 0.4), ('aten::copy_', 0.1)]
"""

from __future__ import annotations

import gzip
import io
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

# The step's named ranges (record_function in the model, the step and the trainer's loop), in order.
RANGES = ("data", "SparseArch", "DenseArch", "InteractionArch", "OverArch", "loss", "backward", "optimizer")
OTHER = "other"  # step time outside every named range
# the trainer's ranges around an evaluation and a checkpoint inside the loop: a profiled step holding one (the
# evaluation the step after an eval_every step ran in, with the next step's training) is no training step to report
AWAY = ("evaluation", "checkpoint")
COMPILED_REGION = "Torch-Compiled Region"  # the host op a torch.compile'd function runs its graph in
COMPILED_RANGES = ("DenseArch", "InteractionArch", "OverArch", "loss")  # always inside a compiled step's graph
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
HOST_CALL_CATS = ("cpu_op", "cuda_runtime", "cuda_driver", "python_function")
OTHER_COLOR = "0.7"
NAME_WIDTH = 90  # kernel names run to hundreds of characters (templates); a table cell shows this many


class TraceError(ValueError):
    """No trace to read, or a trace without a profiled step."""


@dataclass(frozen=True)
class Timed:
    """An op or kernel name with its number of calls and total milliseconds in the step."""

    name: str
    calls: int
    ms: float


@dataclass(frozen=True)
class RangeTime:
    """A named range's host milliseconds and device milliseconds (None on a CPU trace)."""

    name: str
    host_ms: float
    device_ms: Optional[float]


@dataclass
class StepSummary:
    """The numbers of one profiled step (see `summarize_step`)."""

    step: str  # the ProfilerStep range's name, e.g. "ProfilerStep#7"
    host_ms: float
    device_busy_ms: Optional[float]  # summed kernel time; None on a CPU trace
    kernels: int
    copy_ms: float  # memcpy/memset time (counted in the ranges' device ms, not in the kernels' busy time)
    ranges: list[RangeTime]  # the named ranges present, in RANGES order, then OTHER
    top: list[Timed]  # device kernels by total time, or on a CPU trace CPU ops by self time
    host_calls: list[Timed] = field(default_factory=list)  # host calls by inclusive time
    graph_launches: int = 0  # cudaGraphLaunch calls in the step (a captured step replays its kernels at once)
    compiled_regions: int = 0  # torch.compile's "Torch-Compiled Region" calls in the step (its graphs run there)
    # the run's step it trained (`dlrm.train.reporting.log_profile`, which knows the session's first step); None for
    # a trace read alone (benchmarks/trace_timeline.py): the trace counts its ProfilerStep#N from 0 in every session
    run_step: Optional[int] = None

    @property
    def on_device(self) -> bool:
        return self.device_busy_ms is not None

    @property
    def label(self) -> str:
        """The step as the tables name it: the run's step where known, with the trace's range to find it there
        (a resumed session's ProfilerStep#3 read as the first session's).

        >>> StepSummary("ProfilerStep#3", 1.0, None, 0, 0.0, [], [], run_step=24).label
        "step 24 (the trace's ProfilerStep#3)"
        """
        return self.step if self.run_step is None else f"step {self.run_step} (the trace's {self.step})"


# ---- reading ------------------------------------------------------------------------------------


def find_trace(path: Path) -> Path:
    """`path` itself when it is a file, else the newest ``*.pt.trace.json(.gz)`` under that directory.

    >>> find_trace(Path("/nonexistent-run"))
    Traceback (most recent call last):
    ...
    dlrm.train.trace_summary.TraceError: /nonexistent-run: no *.pt.trace.json(.gz) here; train with --profile first
    """
    path = Path(path)
    if path.is_file():
        return path
    # the traces TensorBoard's profiler plugin reads, not a trace's temporary file while it is saved
    # (`dlrm.train.profiling.trace_handler`: ".<name>.<random>.tmp.gz", the newest then)
    found = sorted((p for p in path.rglob("*.pt.trace.json*") if p.name.endswith((".pt.trace.json", ".pt.trace.json.gz"))
                    and not p.name.startswith(".")), key=lambda p: p.stat().st_mtime) if path.is_dir() else []
    if not found:
        raise TraceError(f"{path}: no *.pt.trace.json(.gz) here; train with --profile first")
    return found[-1]


def load_trace(path: Path) -> dict:
    """The trace JSON (a dict with ``traceEvents``) of `path` or of the newest trace under it. A file that is no
    Chrome trace (empty, cut off while written, not JSON, no event list) is a `TraceError` naming it: the callers
    (`dlrm.train.reporting.log_profile`, ``benchmarks/trace_timeline.py``) say one line, not a traceback. Chrome's
    JSON Array Format (the events alone) is read as the object format."""
    path = find_trace(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt") as f:
            trace = json.load(f)
    except (OSError, EOFError, ValueError) as e:  # BadGzipFile is an OSError; JSON and UTF-8 errors ValueErrors
        raise TraceError(f"{path}: not a readable Chrome trace ({type(e).__name__}: {e})") from None
    if isinstance(trace, list):
        trace = {"traceEvents": trace}
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise TraceError(f"{path}: not a Chrome trace (no list of event objects under 'traceEvents')")
    for i, e in enumerate(events):  # what the summary reads: another tool's file was a KeyError/TypeError traceback
        if e.get("ph") == "X" and not (isinstance(e.get("name", ""), str)
                                       and all(_number(e.get(k)) for k in ("ts", "dur"))):
            raise TraceError(f"{path}: event {i} ({e.get('name')!r}): a complete ('X') event needs a string name and "
                             f"numeric ts and dur; not a torch.profiler trace")
        if not isinstance(e.get("args") or {}, dict):
            raise TraceError(f"{path}: event {i} ({e.get('name')!r}): its args are not an object; not a "
                             f"torch.profiler trace")
    return trace


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def within(events: list[dict], cats, lo: float, hi: float) -> list[dict]:
    """The complete ("X") events of category `cats` (a name or a tuple) starting in [lo, hi) µs.

    >>> within([{"name": "k", "cat": "kernel", "ph": "X", "ts": 5, "dur": 1}], "kernel", 0, 10)[0]["name"]
    'k'
    """
    cats = (cats,) if isinstance(cats, str) else cats
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in cats and lo <= e["ts"] < hi]


def session_step(name: str) -> Optional[int]:
    """N of a ``ProfilerStep#N`` range: the profiler's step count when the range opened, from 0 at the profiler's
    start (the session's first training step; the loop calls ``prof.step()`` once a step), or None for another name.

    >>> session_step("ProfilerStep#7"), session_step("evaluation")
    (7, None)
    """
    head, _, n = name.rpartition("#")
    return int(n) if head == "ProfilerStep" and n.isdigit() else None


def profiled_step(events: list[dict]) -> dict:
    """Of the ProfilerStep ranges without an evaluation or checkpoint (`AWAY`; all of them if none is), the last that
    holds a training step's ``backward`` (the last step range may be
    the tail after training: evaluation, profiler exit), else the last that holds a named range (a captured CUDA
    graph step shows only the trainer's ``data``: the last step range alone was the tail then), else the last step
    range.

    >>> ev = lambda n, ts, dur: {"name": n, "cat": "user_annotation", "ph": "X", "ts": ts, "dur": dur}
    >>> profiled_step([ev("ProfilerStep#1", 0, 10), ev("backward", 2, 3), ev("ProfilerStep#2", 10, 5)])["name"]
    'ProfilerStep#1'
    """
    steps = [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
             and str(e.get("name", "")).startswith("ProfilerStep#")]
    if not steps:
        raise TraceError("the trace holds no ProfilerStep ranges (the run ended before a profiled step completed)")
    # (an evaluation in the profiled steps was one "training step" of 380 ms, its forwards counted as the model's)
    away = [e["ts"] for e in events if e.get("cat") == "user_annotation" and e.get("name") in AWAY]
    steps = [st for st in steps if not any(st["ts"] <= t < st["ts"] + st["dur"] for t in away)] or steps
    ranges = [e for e in events if e.get("cat") == "user_annotation" and e.get("name") in RANGES]
    for names in (("backward",), RANGES):
        starts = [e["ts"] for e in ranges if e["name"] in names]
        for step in sorted(steps, key=lambda e: -e["ts"]):
            if any(step["ts"] <= t < step["ts"] + step["dur"] for t in starts):
                return step
    return max(steps, key=lambda e: e["ts"])


# ---- attribution --------------------------------------------------------------------------------


@dataclass
class StepEvents:
    """The events of one step, sorted out: what `summarize_step` counts and `timeline_figure` draws."""

    step: dict
    host_ranges: list[dict]  # named-range events (RANGES) in the step
    device: list[tuple[dict, str]]  # (device op, the named range that launched it or OTHER)
    annotations: list[dict]  # gpu_user_annotation ranges (the profiler's own device spans), if any
    linked: bool  # device ops carry correlation ids (else they are matched to the step by time)
    has_device: bool  # the trace holds any device activity at all
    cpu_ops: list[dict]

    @property
    def t0(self) -> float:
        return self.step["ts"]


def range_at(ranges: list[dict], ts: float) -> str:
    """The name of the innermost range containing time `ts`, or OTHER.

    >>> range_at([{"name": "loss", "ts": 0, "dur": 10}], 4), range_at([{"name": "loss", "ts": 0, "dur": 10}], 12)
    ('loss', 'other')
    """
    inside = [r for r in ranges if r["ts"] <= ts < r["ts"] + r["dur"]]
    return max(inside, key=lambda r: r["ts"])["name"] if inside else OTHER


def _correlation(e: dict) -> Optional[int]:
    return (e.get("args") or {}).get("correlation")


def collect(trace: dict) -> StepEvents:
    """Sort the profiled step's events out (see `profiled_step` for which step)."""
    events = trace["traceEvents"]
    step = profiled_step(events)
    t0, t1 = step["ts"], step["ts"] + step["dur"]
    host = [e for e in within(events, "user_annotation", t0, t1) if e["name"] in RANGES]
    all_device = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS]
    launched = {_correlation(e): range_at(host, e["ts"]) for e in within(events, LAUNCH_CATS, t0, t1)
                if _correlation(e) is not None}
    linked = any(_correlation(e) is not None for e in all_device)
    if linked:
        device = [(e, launched[_correlation(e)]) for e in all_device if _correlation(e) in launched]
    else:  # no correlation ids: the device work that starts in the step or up to a step's length after it
        device = [(e, OTHER) for e in within(all_device, DEVICE_CATS, t0, t1 + step["dur"])]
    annotations = [e for e in within(events, "gpu_user_annotation", t0, t1 + step["dur"]) if e["name"] in RANGES]
    return StepEvents(step, host, sorted(device, key=lambda d: d[0]["ts"]), annotations, linked, bool(all_device),
                      within(events, "cpu_op", t0, t1))


def covered_us(intervals: list[tuple[float, float]]) -> float:
    """Microseconds covered by the union of (start, duration) intervals (nested ranges count once).

    >>> covered_us([(0, 10), (2, 3), (20, 5)])
    15
    """
    total, end = 0, float("-inf")
    for start, dur in sorted(intervals):
        lo, hi = max(start, end), start + dur
        if hi > lo:
            total += hi - lo
        end = max(end, hi)
    return total


def self_times(ops: list[dict]) -> dict[int, float]:
    """Each op's own microseconds (its duration less that of the ops nested in it on the same thread),
    keyed by the op's index in `ops`.

    >>> ops = [{"ts": 0, "dur": 10, "tid": 1}, {"ts": 2, "dur": 3, "tid": 1}, {"ts": 2, "dur": 9, "tid": 2}]
    >>> self_times(ops)
    {0: 7, 1: 3, 2: 9}
    """
    own = {i: e["dur"] for i, e in enumerate(ops)}
    by_thread = defaultdict(list)
    for i, e in enumerate(ops):
        by_thread[(e.get("pid"), e.get("tid"))].append(i)
    for indices in by_thread.values():
        stack: list[int] = []  # the open ops, outermost first
        for i in sorted(indices, key=lambda i: (ops[i]["ts"], -ops[i]["dur"])):
            while stack and ops[i]["ts"] >= ops[stack[-1]]["ts"] + ops[stack[-1]]["dur"]:
                stack.pop()
            if stack:
                own[stack[-1]] -= ops[i]["dur"]
            stack.append(i)
    return dict(sorted(own.items()))


def ranked(named_us: list[tuple[str, float]], top: int) -> list[Timed]:
    """(name, µs) pairs grouped by name, largest total first, in milliseconds.

    >>> ranked([("a", 1000), ("b", 3000), ("a", 500)], top=5)
    [Timed(name='b', calls=1, ms=3.0), Timed(name='a', calls=2, ms=1.5)]
    """
    groups: dict[str, list[float]] = defaultdict(list)
    for name, us in named_us:
        groups[name].append(us)
    order = sorted(groups.items(), key=lambda kv: (-sum(kv[1]), kv[0]))[:top]
    return [Timed(name, len(us), sum(us) / 1e3) for name, us in order]


def range_times(s: StepEvents) -> list[RangeTime]:
    """Host and device ms per named range present in the step, in RANGES order, then OTHER."""
    host = defaultdict(float)
    for e in s.host_ranges:
        host[e["name"]] += e["dur"]
    device = defaultdict(float)
    if s.linked:
        for e, name in s.device:
            device[name] += e["dur"]
    else:  # without correlation ids, the profiler's own device spans per range (they include idle gaps)
        for e in s.annotations:
            device[e["name"]] += e["dur"]
    present = [n for n in RANGES if host[n] or device[n]]
    dev = (lambda n: device[n] / 1e3) if s.has_device else (lambda n: None)
    rows = [RangeTime(n, host[n] / 1e3, dev(n)) for n in present]
    other_host = s.step["dur"] - covered_us([(e["ts"], e["dur"]) for e in s.host_ranges])
    other_device = (device[OTHER] / 1e3 if s.linked else None) if s.has_device else None
    if other_host > 0.5 or (other_device or 0) > 0.0005:  # more than half a microsecond
        rows.append(RangeTime(OTHER, other_host / 1e3, other_device))
    return rows


def summarize_step(trace: dict, top: int = 15, start_step: Optional[int] = None) -> StepSummary:
    """The profiled step's numbers: per-range host/device ms, the top kernels (CPU ops by self time on a
    CPU trace) and the top host calls, `top` rows each. `start_step`: the run's step the session that wrote the trace
    started at, which makes its ``ProfilerStep#N`` (the session's step N, from 0) the run's step
    ``start_step + N + 1`` as the training loop counts it (`StepSummary.run_step`). Example in the module docstring."""
    s = collect(trace)
    kernels = [e for e, _ in s.device if e.get("cat") == "kernel"]
    copy_ms = sum(e["dur"] for e, _ in s.device if e.get("cat") != "kernel") / 1e3
    if s.has_device:
        busy = sum(e["dur"] for e in kernels) / 1e3
        top_ops = ranked([(e["name"], e["dur"]) for e in kernels], top)
    else:
        busy = None
        own = self_times(s.cpu_ops)
        top_ops = ranked([(e["name"], own[i]) for i, e in enumerate(s.cpu_ops)], top)
    t0, t1 = s.t0, s.t0 + s.step["dur"]
    calls = [(e["name"], e["dur"]) for e in within(trace["traceEvents"], HOST_CALL_CATS, t0, t1)]
    n = session_step(s.step["name"])
    return StepSummary(s.step["name"], s.step["dur"] / 1e3, busy, len(kernels), copy_ms, range_times(s), top_ops,
                       ranked(calls, top), sum(1 for name, _ in calls if name == "cudaGraphLaunch"),
                       sum(1 for name, _ in calls if name.startswith(COMPILED_REGION)),
                       None if start_step is None or n is None else start_step + n + 1)


# ---- Markdown -----------------------------------------------------------------------------------


def cell(name: str) -> str:
    """An op or kernel name as a Markdown table cell: code, cut to NAME_WIDTH, pipes escaped.

    >>> cell("a|b")
    '`a\\\\|b`'
    """
    short = name if len(name) <= NAME_WIDTH else name[: NAME_WIDTH - 1] + "…"
    return "`" + short.replace("`", "'").replace("|", "\\|") + "`"


def step_line(s: StepSummary) -> str:
    """The step's one-line total, e.g. ``ProfilerStep#7: host 3.393 ms, device kernels busy 0.300 ms (78 kernels)``."""
    if not s.on_device:
        return f"{s.label}: host {s.host_ms:.3f} ms (a CPU run: no device activity, host time only)"
    copies = f", memcpy/memset {s.copy_ms:.3f} ms" if s.copy_ms else ""
    return f"{s.label}: host {s.host_ms:.3f} ms, device kernels busy {s.device_busy_ms:.3f} ms ({s.kernels} kernels){copies}"


def step_table(s: StepSummary) -> str:
    """The step line and a Markdown table of host ms (and device ms on a GPU run) per named range."""
    share = lambda ms: f"{100 * ms / s.host_ms:.1f}" if s.host_ms else "n/a"
    if s.on_device:
        head = ["| range | host ms | device ms | host % of step |", "| --- | ---: | ---: | ---: |"]
        body = [f"| {r.name} | {r.host_ms:.3f} | {'n/a' if r.device_ms is None else f'{r.device_ms:.3f}'} | "
                f"{share(r.host_ms)} |" for r in s.ranges]
    else:
        head = ["| range | host ms | host % of step |", "| --- | ---: | ---: |"]
        body = [f"| {r.name} | {r.host_ms:.3f} | {share(r.host_ms)} |" for r in s.ranges]
    return "\n".join([step_line(s), "", *head, *body, *(graph_note(s) or compiled_note(s))]) + "\n"


def graph_note(s: StepSummary) -> list[str]:
    """A line under the table of a step replayed from a CUDA graph that names no model range: its kernels were
    launched by one ``cudaGraphLaunch``, outside every range, so the table alone said only "other".

    >>> graph_note(StepSummary("ProfilerStep#3", 1.0, 0.5, 9, 0.0, [RangeTime("other", 1.0, 0.5)], [], [], 1))[1][:28]
    'The step ran as a CUDA graph'
    """
    if not s.graph_launches or any(r.name not in ("data", OTHER) for r in s.ranges):
        return []
    return ["", f"The step ran as a CUDA graph replay ({s.graph_launches} `cudaGraphLaunch`): its kernels run outside "
                "every named range, in \"other\"; the kernels below are its work. For the per-range breakdown, "
                "profile with `train.cuda_graph` false (and `train.compile` false)."]


def compiled_note(s: StepSummary) -> list[str]:
    """A line under the table of a compiled step whose model ranges are missing: torch.compile leaves out the
    record_function ranges inside its graphs ("Profiler record function ... will be ignored"), so the model's
    forward and loss were "other", unexplained.

    >>> step = StepSummary("ProfilerStep#3", 1.0, None, 0, 0.0, [RangeTime("other", 1.0, None)], [], [], 0, 1)
    >>> compiled_note(step)[1][:24]
    'The step ran compiled (1'
    """
    if not s.compiled_regions or any(r.name in COMPILED_RANGES for r in s.ranges):
        return []
    return ["", f"The step ran compiled ({s.compiled_regions} `{COMPILED_REGION}`): torch.compile leaves out the named "
                "ranges inside its graphs, so the model's forward and loss are in \"other\"; the "
                f"{'kernels' if s.on_device else 'ops'} below are its work. For the per-range breakdown, profile with "
                "`train.compile` false."]


def top_table(s: StepSummary) -> str:
    """A Markdown table of the step's top device kernels (on a CPU run: CPU ops by self time)."""
    if s.on_device:
        title = f"Device kernels in {s.label} by total time, top {len(s.top)}:"
        head = ["| kernel | calls | total ms | % of device busy |", "| --- | ---: | ---: | ---: |"]
        whole = s.device_busy_ms
    else:
        title = (f"CPU ops in {s.label} by self time (a CPU run: no device kernels; self time excludes the ops "
                 f"nested in each), top {len(s.top)}:")
        head = ["| CPU op | calls | self ms | % of step |", "| --- | ---: | ---: | ---: |"]
        whole = s.host_ms
    body = [f"| {cell(t.name)} | {t.calls} | {t.ms:.3f} | {100 * t.ms / whole if whole else 0:.1f} |" for t in s.top]
    return "\n".join([title, "", *head, *body]) + "\n"


def host_calls_table(s: StepSummary) -> str:
    """A Markdown table of the step's host calls by inclusive time (CUDA runtime calls included: a step
    whose host time far exceeds its device busy time is bound by launches, not by the GPU)."""
    head = [f"Host calls in the step by total time (inclusive: nested calls count in their callers too), "
            f"top {len(s.host_calls)}:", "", "| host call | calls | total ms |", "| --- | ---: | ---: |"]
    return "\n".join([*head, *(f"| {cell(t.name)} | {t.calls} | {t.ms:.3f} |" for t in s.host_calls)]) + "\n"


def report(s: StepSummary, title: str) -> str:
    """The whole step as one Markdown document: title, per-range table, top kernels/ops, host calls."""
    return "\n".join([f"# {title}", "", step_table(s), top_table(s), host_calls_table(s)])


# ---- the picture --------------------------------------------------------------------------------


def _colors() -> dict[str, tuple]:
    from matplotlib import colormaps

    # tab10 without its grey (index 7), which is OTHER's colour
    palette = [c for i, c in enumerate(colormaps["tab10"].colors) if i != 7]
    return dict(zip(RANGES, palette))


def outermost(ops: list[dict]) -> list[dict]:
    """The ops not nested in another op of the list (one thread's ops).

    >>> [e["ts"] for e in outermost([{"ts": 0, "dur": 10}, {"ts": 2, "dur": 3}, {"ts": 12, "dur": 1}])]
    [0, 12]
    """
    out, end = [], float("-inf")
    for e in sorted(ops, key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] >= end:
            out.append(e)
            end = e["ts"] + e["dur"]
    return out


def lanes(s: StepEvents) -> list[tuple[str, list[tuple[dict, str]]]]:
    """The timeline's rows: (label, [(event, range name for its colour)]), empty rows left out."""
    host = [(e, e["name"]) for e in s.host_ranges]
    if s.has_device:
        rows = [("host: named ranges", host),
                ("device: profiler spans per range", [(e, e["name"]) for e in s.annotations]),
                ("device: kernels, by launching range" if s.linked else "device: kernels", s.device)]
    else:  # the outermost ops on the step's thread show how busy the host is inside each range
        outer = outermost([e for e in s.cpu_ops if e.get("tid") == s.step.get("tid")])
        rows = [("host: named ranges", host), ("host: CPU ops (outermost)",
                                              [(e, range_at(s.host_ranges, e["ts"])) for e in outer])]
    return [(label, evs) for label, evs in rows if evs]


def timeline_figure(trace: dict, title: str):
    """A matplotlib Figure (Agg canvas, no pyplot state) of the profiled step: one row per lane, bars
    coloured by named range, x in ms since the step began. About 1400 px wide at 100 dpi."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    s, colors = collect(trace), _colors()
    rows = lanes(s)
    fig = Figure(figsize=(14, 1.4 + 0.8 * len(rows)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for row, (_, evs) in enumerate(rows):
        for e, name in evs:
            ax.broken_barh([((e["ts"] - s.t0) / 1e3, e["dur"] / 1e3)], (row - 0.4, 0.8),
                           facecolors=colors.get(name, OTHER_COLOR), edgecolor="white", linewidth=0.3)
    for e in s.host_ranges:  # the wide bars carry their name and ms: readable without the legend
        if e["dur"] >= 0.07 * s.step["dur"]:
            ax.text((e["ts"] - s.t0 + e["dur"] / 2) / 1e3, 0, f"{e['name']}\n{e['dur'] / 1e3:.2f} ms", ha="center",
                    va="center", fontsize=8, color="white")
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlabel(f"ms since the start of {s.step['name']} (host step {s.step['dur'] / 1e3:.2f} ms)")
    present = [n for n in RANGES if any(e["name"] == n for e in s.host_ranges)]
    handles = [Patch(color=colors[n]) for n in present] + [Patch(color=OTHER_COLOR)]
    ax.legend(handles, present + [OTHER], ncol=len(handles), loc="lower center", bbox_to_anchor=(0.5, 1.0),
              fontsize=8, frameon=False)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def timeline_png(trace: dict, title: str, dpi: int = 100) -> bytes:
    """`timeline_figure` as PNG bytes (what the run dir's profile_timeline.png and TensorBoard show)."""
    buf = io.BytesIO()
    timeline_figure(trace, title).savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    return buf.getvalue()
