"""Audit (by mutation) of the profiling benchmark scripts' arithmetic: step_profile.py (kernel categories, ms a step,
shares, idle, top kernels), step_ops.py (kernels by launching op, GEMM calls, in-step against alone), step_clocks.py
(phases, clock / power / reason shares, rates), trace_timeline.py, train_log_windows.py (windows, epoch starts,
medians), stream_timeline.py (steady-part numbers, table), stream_overlap.py (gains, shares, carve-out bookkeeping)
and autopick_report.py (cells, fastest, auto against it). Everything runs on the CPU against fake profilers, events,
clocks and samplers, with exact expected values worked out by hand (no GPU, no real timings, no sleeps)."""

from __future__ import annotations

import contextlib
import csv
import datetime
import gzip
import json
import os
import sys
import types

import pytest
import torch

from tests.test_benchmark_scripts import REPO, load_script

sp = load_script("step_profile")
so = load_script("step_ops")
sc = load_script("step_clocks")
tw = load_script("train_log_windows")
ar = load_script("autopick_report")
st = load_script("stream_timeline")
sov = load_script("stream_overlap")
tt = load_script("trace_timeline")

ENV = {"device": "GPU X", "torch": "2.x", "triton": "3.x", "python": "3.11", "date": "2026-11-30 08:00"}


def read_csv(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


class FakeClock:
    """A stand-in for the `time` module: time / perf_counter read `now`; sleep advances it."""

    def __init__(self, start: float = 100.0):
        self.now = start

    def time(self) -> float:
        return self.now

    perf_counter = time

    def sleep(self, s: float) -> None:
        self.now += s


def fake_event_class(elapsed_ms: list[float], clock: FakeClock | None = None, advance_s: float = 0.0):
    """A `torch.cuda.Event` whose successive `elapsed_time` calls return `elapsed_ms` (popped in order); each
    `synchronize` advances `clock` by `advance_s`."""

    class Event:
        def __init__(self, enable_timing=False):
            pass

        def record(self):
            pass

        def synchronize(self):
            if clock is not None:
                clock.now += advance_s

        def elapsed_time(self, end):
            return elapsed_ms.pop(0)

    return Event


# ---- step_profile.py ------------------------------------------------------------------------------------------------


def test_step_profile_category_rows_ms_per_step_shares_and_idle():
    """Kernel totals in us over `steps` steps -> ms a step per category; distinct kernels counted per category; idle
    is the step minus the kernels; longest first; shares of the timed step (not of the kernels' sum)."""
    kernels = [("nvjet_tst_gemm", 3000.0, 4), ("_pooled_fwd_kernel", 1000.0, 2), ("triton_poi_fused_0", 500.0, 2),
               ("cutlass_80_wgrad", 1000.0, 2)]
    rows = sp.category_rows(kernels, steps=2, step_ms=4.0)
    assert [(r["category"], r["ms_per_step"], r["kernels"], r["share_of_step"]) for r in rows] == [
        ("GEMMs (cuBLAS / CUTLASS)", 2.0, 2, 0.5), ("idle (step minus kernels)", 1.25, 0, 0.3125),
        ("embedding lookup", 0.5, 1, 0.125), ("Inductor fused kernels", 0.25, 1, 0.0625)]
    # kernels longer than the timed step (the profiler's overhead): no negative idle
    rows = sp.category_rows(kernels, steps=2, step_ms=2.0)
    assert rows[-1] == {"category": "idle (step minus kernels)", "ms_per_step": 0.0, "kernels": 0,
                        "share_of_step": 0.0}


def test_step_profile_categories_anchor_the_name_patterns():
    """Inductor's kernels start with ``triton_``, ours with ``_`` (a ``_`` inside a name says nothing); ATen's
    elementwise kernels are copies and fills, and a name matching nothing is "other"."""
    assert sp.category("_cross_triton_kernel") == "other Triton kernels (ours)"
    assert sp.category("void at::native::vectorized_elementwise_kernel<4, FillFunctor>") == "copies and fills"
    assert sp.category("void at::native::reduce_kernel<512, 1>") == "other"
    assert sp.category("void at::native::elementwise_kernel<128, 2>") == "copies and fills"


class FakeEvent(types.SimpleNamespace):
    pass


def test_step_profile_device_times_keeps_device_events_with_time():
    """Only CUDA events with device time are kept (CPU ops and zero-time entries dropped); torch < 2.4 names the
    field self_cuda_time_total."""
    prof = types.SimpleNamespace(key_averages=lambda: [
        FakeEvent(key="gemm", self_device_time_total=120.0, device_type="DeviceType.CUDA", count=6),
        FakeEvent(key="aten::mm", self_device_time_total=80.0, device_type="DeviceType.CPU", count=6),
        FakeEvent(key="idle_kernel", self_device_time_total=0.0, device_type="DeviceType.CUDA", count=1),
        FakeEvent(key="old_kernel", self_cuda_time_total=7.0, device_type="DeviceType.CUDA", count=3),
    ])
    assert sp.device_times(prof) == [("gemm", 120.0, 6), ("old_kernel", 7.0, 3)]


def _fake_step_profile_run(monkeypatch, kernels, timed_s: float):
    """profile_step's build / train / profile steps replaced: the timed region lasts `timed_s`, the profiler sees
    `kernels` ((name, us, calls, device type))."""
    cfg = types.SimpleNamespace(train=types.SimpleNamespace(precision="fp32"), data=types.SimpleNamespace(batch_size=0),
                                model=types.SimpleNamespace(multi_hot_sizes=None))
    monkeypatch.setattr(sp, "variant_config", lambda c, v: cfg)
    monkeypatch.setattr(sp, "validate", lambda c: None)
    monkeypatch.setattr(sp, "tables_from_config", lambda c: None)
    monkeypatch.setattr(sp, "synthetic_batches", lambda *a, **k: [None] * 8)
    monkeypatch.setattr(sp, "build_run", lambda *a, **k: None)
    monkeypatch.setattr(sp, "train_steps", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)

    class Timer:
        def __init__(self, device):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.seconds = timed_s

    monkeypatch.setattr(sp, "Timer", Timer)
    prof = types.SimpleNamespace(key_averages=lambda: [
        FakeEvent(key=n, self_device_time_total=us, device_type=d, count=c) for n, us, c, d in kernels])

    @contextlib.contextmanager
    def profile(activities):
        yield prof

    import torch.profiler as torch_profiler

    monkeypatch.setattr(torch_profiler, "profile", profile)


def test_step_profile_profile_step_times_and_tops_per_step(monkeypatch):
    """The timed region's seconds over `steps` steps -> ms a step; the top kernels longest first, in ms and calls a
    step, each with its category."""
    _fake_step_profile_run(monkeypatch, [("_pooled_fwd_kernel", 1000.0, 10, "CUDA"), ("nvjet_a", 4000.0, 20, "CUDA"),
                                         ("memcpy128", 500.0, 30, "CUDA"), ("aten::mm", 9000.0, 20, "CPU")],
                           timed_s=0.05)
    step_ms, rows, top = sp.profile_step(None, "v", 64, "fp32", steps=10, warmup=2, top_n=2)
    assert step_ms == 5.0
    assert top == [("nvjet_a", 0.4, 2, "GEMMs (cuBLAS / CUTLASS)"), ("_pooled_fwd_kernel", 0.1, 1, "embedding lookup")]
    assert [r["category"] for r in rows] == ["idle (step minus kernels)", "GEMMs (cuBLAS / CUTLASS)",
                                             "embedding lookup", "copies and fills"]
    assert [r["ms_per_step"] for r in rows] == pytest.approx([4.45, 0.4, 0.1, 0.05], rel=1e-12)


def test_step_profile_main_writes_shares_rate_and_step_ms(tmp_path, monkeypatch):
    """The Markdown's shares in percent, samples/s from the step's ms (M samples/s = batch / ms * 1e3 / 1e6), and the
    CSV's step_ms the timed step's."""
    from kernels.embedding import update

    monkeypatch.setattr(update, "CARRY_GROUP_SUMS", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sp, "environment", lambda device: dict(ENV))
    rows = sp.category_rows([("nvjet_a", 4000.0, 4), ("_pooled_fwd_kernel", 1000.0, 2)], steps=2, step_ms=4.0)
    monkeypatch.setattr(sp, "profile_step", lambda *a: (4.0, rows, [("nvjet_a", 2.0, 2, "GEMMs (cuBLAS / CUTLASS)")]))
    assert sp.main(["--config", str(REPO / "configs" / "kaggle.json"), "--variant", "auto", "--batch-size", "65536",
                    "--out", str(tmp_path), "--name", "p"]) == 0
    md = (tmp_path / "p.md").read_text()
    assert "Step time 4.00 ms (16.38M samples/s)" in md
    assert "| GEMMs (cuBLAS / CUTLASS) | 2.000 | 50.0% | 1 |" in md
    assert "| idle (step minus kernels) | 1.500 | 37.5% | 0 |" in md
    assert "| nvjet_a | 2.000 | 2 | GEMMs (cuBLAS / CUTLASS) |" in md
    out = read_csv(tmp_path / "p.csv")
    assert [(r["category"], r["ms_per_step"], r["share_of_step"]) for r in out] == [
        ("GEMMs (cuBLAS / CUTLASS)", "2.0", "0.5"), ("idle (step minus kernels)", "1.5", "0.375"),
        ("embedding lookup", "0.5", "0.125")]
    assert {r["step_ms"] for r in out} == {"4.0"}


# ---- step_ops.py ----------------------------------------------------------------------------------------------------


def _ev(name, cat, ts, dur, tid=1, **args):
    return dict(name=name, cat=cat, ph="X", ts=ts, dur=dur, pid=1, tid=tid, args=args)


def test_step_ops_launch_at_an_ops_edges_and_copies():
    """A launch at the very start or the very end of an op is inside it (both ends closed); a device memcpy is a
    device event like a kernel."""
    trace = {"traceEvents": [
        _ev("aten::matmul", "cpu_op", 0, 100),
        _ev("aten::mm", "cpu_op", 10, 10),  # ends at 20
        _ev("cudaLaunchKernel", "cuda_runtime", 20, 1, correlation=1),  # at mm's end
        _ev("aten::copy_", "cpu_op", 40, 10),
        _ev("cudaMemcpyAsync", "cuda_runtime", 40, 1, correlation=2),  # at copy_'s start
        _ev("gemm", "kernel", 30, 5, tid=7, correlation=1),
        _ev("Memcpy DtoD", "gpu_memcpy", 60, 2, tid=7, correlation=2),
    ]}
    assert [(k["kernel"], k["op"], k["us"]) for k in so.kernels_by_op(trace)] == [
        ("gemm", "aten::mm", 5.0), ("Memcpy DtoD", "aten::copy_", 2.0)]


def test_step_ops_aggregate_tflops_per_call_not_per_step():
    """A GEMM's TFLOP/s is its FLOPs over one call's time: 3 calls over 2 steps (1.5 a step)."""
    k = dict(op="aten::mm", kernel="nvjet", dims=[[64, 32], [32, 16]], strides=None, dtypes=None)
    (row,) = so.aggregate([dict(k, us=10.0), dict(k, us=20.0), dict(k, us=30.0)], steps=2)
    assert (row["calls_per_step"], row["ms_per_step"], row["ms_per_call"]) == (1.5, 0.03, 0.02)
    assert row["gflop"] == 2 * 64 * 16 * 32 / 1e9 and row["tflops"] == pytest.approx(row["gflop"] / 0.02, rel=1e-12)


def test_step_ops_gemm_alone_is_the_median_window_per_call(monkeypatch):
    """time_gemm_alone: each window's event time over its `repeats` calls, the median of the windows (on the CPU
    here, with fake CUDA events: the arithmetic only)."""
    monkeypatch.setattr(torch.cuda, "Event", fake_event_class([2.0, 8.0, 4.0]))
    ms, status = so.time_gemm_alone("aten::mm", [[4, 8], [8, 2]], None, ["float", "float"], torch.device("cpu"),
                                    repeats=2, windows=3)
    assert (ms, status) == (2.0, "ok")  # per call 1, 4, 2: the median 2 (the mean would be 2.33)


def test_step_ops_main_totals_alone_rates_and_rows(tmp_path, monkeypatch):
    """main's note: every kernel's ms a step, the GEMM ops' and the same GEMMs alone (ms a call x calls a step); the
    alone TFLOP/s = GFLOP / ms; --top rows of every kernel; the CSV holds each GEMM call once, then the other ops."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(so, "environment", lambda device: dict(ENV))
    mm = dict(op="aten::mm", dims=[[1000, 1000], [1000, 1000]], strides=None, dtypes=["float", "float"])
    kernels = [dict(mm, kernel="splitK", us=800.0), dict(mm, kernel="splitK", us=800.0),
               dict(mm, kernel="reduce", us=200.0), dict(mm, kernel="reduce", us=200.0),
               dict(op="aten::copy_", kernel="copy_a", dims=None, strides=None, dtypes=None, us=1000.0),
               dict(op="aten::fill_", kernel="fill_b", dims=None, strides=None, dtypes=None, us=100.0)]
    monkeypatch.setattr(so, "profile_ops", lambda *a: so.aggregate(kernels, 1))
    monkeypatch.setattr(so, "time_gemm_alone", lambda *a: (0.5, "ok"))
    assert so.main(["--config", str(REPO / "configs" / "kaggle.json"), "--steps", "1", "--top", "2",
                    "--out", str(tmp_path), "--name", "o"]) == 0
    md = (tmp_path / "o.md").read_text()
    # kernels 1.6 + 0.4 + 1.0 + 0.1 ms; GEMM ops 2.0 ms (two calls of 1.0 ms); alone 0.5 ms x 2 calls
    assert "Kernels 3.100 ms a step, of which GEMM ops 2.000 ms;" in md
    assert "shapes and strides) 1.000 ms." in md
    # 2 GFLOP a call: 2 TFLOP/s in the step (1 ms a call), 4 alone (0.5 ms)
    assert "| splitK + reduce | 2 | 1.000 | 2 | 0.500 | 4 |" in md
    assert "fill_b" not in md and "| aten::copy_ |  | copy_a | 1 | 1.000 |" in md
    rows = read_csv(tmp_path / "o.csv")
    assert [(r["op"], r["kernel"]) for r in rows] == [("aten::mm", "splitK + reduce"), ("aten::copy_", "copy_a"),
                                                      ("aten::fill_", "fill_b")]
    assert (rows[0]["alone_ms_per_call"], rows[0]["alone_tflops"]) == ("0.5", "4.0")


# ---- step_clocks.py -------------------------------------------------------------------------------------------------


def test_step_clocks_phases_are_half_open():
    """A sample at a phase's start belongs to it; one at its end to the next phase (or "between")."""
    samples = [dict(t=10.0), dict(t=0.0), dict(t=20.0), dict(t=15.0)]
    sc.label_phases(samples, [("a", 0.0, 10.0), ("b", 10.0, 20.0)])
    assert [s["phase"] for s in samples] == ["b", "a", "between", "b"]


def test_step_clocks_run_for_counts_calls_until_the_time_is_up(monkeypatch):
    """run_for checks the time every `check_every` calls and stops once `seconds` have passed (inclusive)."""
    clock = FakeClock(0.0)
    monkeypatch.setattr(sc, "time", clock)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)

    def fn():
        clock.now += 0.25

    assert sc.run_for(1.0, fn, "cpu", check_every=2) == 4  # 1.0 s after 4 calls: done
    assert clock.now == 1.0


class FakeTorch(types.ModuleType):
    """step_clocks' `torch` on the CPU: the real one, with "cuda" devices made CPU ones and a fake `torch.cuda`."""

    def __init__(self, event):
        super().__init__("torch")
        self.cuda = types.SimpleNamespace(is_available=lambda: True, Event=event, synchronize=lambda *a: None,
                                          empty_cache=lambda: None)

    def device(self, *a, **k):
        return torch.device("cpu")

    def __getattr__(self, name):
        return getattr(torch, name)


def _fake_step_clocks_main(monkeypatch, tmp_path, calls: list[int], samples: list[tuple], argv: list[str]) -> str:
    """step_clocks.main on fake clocks: each idle 2 s, each window of 20 steps 0.2 s on the clock (event times 100,
    140, 110 ms: 5, 7, 5.5 ms a step), each `run_for` 4 s returning the next of `calls`; the sampler's lines are
    `samples` ((s from the start, SM MHz, W, reasons)). Returns the Markdown."""
    t_start = datetime.datetime(2026, 11, 29, 10, 0, 0).timestamp()
    clock = FakeClock(t_start)
    monkeypatch.setattr(sc, "time", clock)
    monkeypatch.setattr(sc, "torch", FakeTorch(fake_event_class([100.0, 140.0, 110.0], clock, 0.2)))
    monkeypatch.setattr(sc, "environment", lambda device: dict(ENV))
    cfg = types.SimpleNamespace(train=types.SimpleNamespace(precision="bf16"),
                                data=types.SimpleNamespace(batch_size=0, max_rows_per_table=None),
                                model=types.SimpleNamespace(multi_hot_sizes=None))
    for name, fn in [("load_config", lambda p: cfg), ("variant_config", lambda c, v: c), ("validate", lambda c: None),
                     ("synthetic_batches", lambda *a, **k: [None]), ("build_run", lambda *a, **k: object()),
                     ("tables_from_config", lambda c: None), ("train_steps", lambda *a, **k: None)]:
        monkeypatch.setattr(sc, name, fn)

    def run_for(seconds, fn, device, check_every=10):
        clock.now += seconds
        return calls.pop(0)

    monkeypatch.setattr(sc, "run_for", run_for)
    monkeypatch.setattr(sc, "kernel_phase", lambda name, device: (lambda: None, 4e9 if name == "copy" else 1e9,
                                                                  0 if name == "copy" else 4e12))

    def line(t, sm, w, r):
        stamp = datetime.datetime.fromtimestamp(t_start + t).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
        return f"{stamp}, {sm}, 3201, {w}, 50, 0x{r:016x}"

    monkeypatch.setattr(sc, "start_sampler", lambda index, ms: types.SimpleNamespace(
        stop=lambda: [line(*s) for s in samples]))
    assert sc.main(["--batch-size", "65536", "--seconds", "4", "--idle", "2", "--windows", "3", "--tail-s", "1",
                    "--out", str(tmp_path), "--name", "c", *argv]) == 0
    return (tmp_path / "c.md").read_text()


def test_step_clocks_main_rates_and_shares_of_each_phase(tmp_path, monkeypatch):
    """The whole report from fake clocks, events and samples: the windows' median rate (20 steps a window), the
    sustained steps' samples/s over their own phase, the GEMM's 2MNK TFLOP/s, each kernel phase's ms a call, GB/s and
    TFLOP/s, a repeated kernel's own phase, reason shares in percent, the CSV's times from the first sample."""
    # phases (s from the start): idle before [.., 2), windows [2, 2.6), steps [2.6, 6.6), idle after [6.6, 8.6),
    # GEMM [8.6, 12.6), copy [14.6, 18.6), gemm_bf16 [20.6, 24.6), copy #2 [26.6, 30.6)
    samples = [(1.0, 345, 80, 1), (2.25, 1980, 450, 0), (3.0, 1750, 650, 4), (4.0, 1700, 700, 4), (5.0, 1800, 610, 0),
               (7.0, 400, 90, 1), (10.0, 1600, 700, 0x24), (16.0, 1900, 500, 0), (22.0, 1650, 690, 4),
               (30.0, 1900, 510, 0)]
    md = _fake_step_clocks_main(monkeypatch, tmp_path, [1000, 20000, 1000, 500, 1000], samples,
                                ["--gemm", "1000,1000,1000", "--kernels", "copy,gemm_bf16,copy"])
    assert "| idle before | 1 | 345 (345-345) | 80 (80) | 100% | 0% | 0% | 0% | 0% | 0% |  |" in md
    assert ("| windows of 20 steps | 1 | 1980 (1980-1980) | 450 (450) | 0% | 0% | 0% | 0% | 0% | 0% | 11.92M samples/s "
            "(median of 3; 13.11, 9.36, 11.92) |") in md
    assert ("| steps | 3 | 1750 (1700-1800) | 650 (700) | 0% | 67% | 0% | 0% | 0% | 0% | 16.38M samples/s (1000 steps, "
            "a host sync every 50) |") in md
    assert "| GEMM 1000x1000x1000, A normal | 1 | 1600 (1600-1600) | 700 (700) | 0% | 100% | 0% | 100% |" in md
    assert "| 10 TFLOP/s (20000 calls) |" in md  # 2 * 1e9 FLOP * 20000 calls / 4 s
    assert "| copy_ of 1 GiB (bf16) | 1 |" in md and "4.000 ms a call, 1,000 GB/s (1000 calls) |" in md
    assert "8.000 ms a call, 125 GB/s, 500 TFLOP/s (500 calls) |" in md
    assert "| copy_ of 1 GiB (bf16) #2 | 1 |" in md
    assert "not sampled" not in md  # the last sample 0.6 s before the last phase's end: within a second
    rows = read_csv(tmp_path / "c.csv")
    assert [r["t"] for r in rows] == ["0.0", "1.25", "2.0", "3.0", "4.0", "6.0", "9.0", "15.0", "21.0", "29.0"]
    assert [r["phase"] for r in rows][:3] == ["idle before", "windows of 20 steps", "steps"]


def test_step_clocks_a_repeated_gemm_operand_gets_its_own_phase(tmp_path, monkeypatch):
    """--gemm-operands normal,normal: two phases, as a kernel named twice gets (until this audit both were named
    alike, so their samples were summarized together twice and the first rate lost)."""
    # GEMM normal [8.6, 12.6), GEMM normal #2 [14.6, 18.6); the last phase's last 2.6 s not sampled
    samples = [(10.0, 1600, 700, 4), (11.0, 1700, 650, 4), (16.0, 1400, 690, 4)]
    md = _fake_step_clocks_main(monkeypatch, tmp_path, [1000, 20000, 40000], samples,
                                ["--gemm", "1000,1000,1000", "--gemm-operands", "normal,normal"])
    assert "| GEMM 1000x1000x1000, A normal | 2 | 1650 (1600-1700) | 675 (700) |" in md
    assert "| 10 TFLOP/s (20000 calls) |" in md
    assert "| GEMM 1000x1000x1000, A normal #2 | 1 | 1400 (1400-1400) | 690 (690) |" in md
    assert "| 20 TFLOP/s (40000 calls) |" in md
    assert "the last 2.6 s of the last phase not sampled" in md


# ---- trace_timeline.py ----------------------------------------------------------------------------------------------


def test_trace_timeline_top_rows_and_a_missing_trace(tmp_path):
    """summarize's `top` caps the kernel and host-call tables; a folder without a trace exits with the reason."""
    ev = lambda name, cat, ts, dur: {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur}  # noqa: E731
    trace = {"traceEvents": [ev("ProfilerStep#1", "user_annotation", 0, 100), ev("backward", "user_annotation", 10, 30),
                             ev("gemm", "kernel", 20, 10), ev("relu_bwd", "kernel", 40, 5)]}
    text = tt.summarize(trace, "t", top=1)
    assert "top 1:" in text and "| `gemm` | 1 | 0.010 |" in text and "relu_bwd" not in text
    with pytest.raises(SystemExit, match="no \\*.pt.trace.json"):
        tt.load_trace(tmp_path)


def test_trace_timeline_names_what_produced_the_trace(tmp_path, monkeypatch, capsys):
    """The report says the run's device and library versions (its summary.json), else the trace's device, and the
    trace's date, under the title."""
    ev = lambda name, cat, ts, dur: {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur}  # noqa: E731
    run = tmp_path / "run-a"
    run.mkdir()
    trace_file = run / "host.123.pt.trace.json.gz"
    with gzip.open(trace_file, "wt") as f:
        json.dump({"traceEvents": [ev("ProfilerStep#1", "user_annotation", 0, 100),
                                   ev("backward", "user_annotation", 10, 30), ev("gemm", "kernel", 20, 10)],
                   "deviceProperties": [{"id": 0, "name": "NVIDIA H200"}]}, f)
    os.utime(trace_file, (1_800_000_000, 1_800_000_000))  # 2027-01-15 08:00 UTC
    out = tmp_path / "t.png"
    monkeypatch.setattr(sys, "argv", ["trace_timeline.py", str(run), "--out", str(out), "--title", "T"])
    tt.main()
    lines = (tmp_path / "t.md").read_text().splitlines()
    assert lines[:3] == ["# T", "", f"Run: run-a on NVIDIA H200; library versions unknown (no readable "
                                    f"{run / 'summary.json'}); trace written 2027-01-15 08:00 UTC."]
    (run / "summary.json").write_text(json.dumps({"device_name": "NVIDIA H100 80GB HBM3",
                                                 "versions": {"python": "3.12.3", "torch": "2.11.0", "triton": "3.6.0"}}))
    monkeypatch.setattr(sys, "argv", sys.argv + ["--overwrite"])  # t.png and t.md exist: refused without it
    tt.main()
    assert (tmp_path / "t.md").read_text().splitlines()[2] == (
        "Run: run-a on NVIDIA H100 80GB HBM3; python 3.12.3, torch 2.11.0, triton 3.6.0; trace written 2027-01-15 "
        "08:00 UTC.")
    assert "Run: run-a on NVIDIA H100 80GB HBM3" in capsys.readouterr().out
    bare = tmp_path / "bare" / "t.pt.trace.json"  # no summary and no deviceProperties (a CPU run): said so
    bare.parent.mkdir()
    bare.write_text("{}")
    assert tt.provenance(bare, {"traceEvents": []}).startswith(
        "Run: bare on no CUDA device in the trace; library versions unknown")


# ---- train_log_windows.py -------------------------------------------------------------------------------------------


def _bar(points, total=40):
    return "".join(f"train: 50%|##   | {s}/{total} [00:01<00:01, 9.1step/s, loss=0.5, samples_s={v:,}]"
                   for s, v in points)


def _final(steps, rate, wait):
    return (f"01:01:00 INFO    validation: AUC 0.5950, logloss 2.5155, accuracy 0.7163; {steps} steps, 2,621,440 "
            f"samples, {rate:,} samples/s (waiting for data {wait}% of the time), 1.0s\n")


def test_train_log_windows_last_summary_flag_epoch_and_fastest_after_the_first(tmp_path):
    """The run's totals from its last validation line (not an earlier one); --steps-per-epoch over the log's own;
    the fastest window leaves out the first (as the medians do)."""
    log = tmp_path / "run.log"
    log.write_text("device cuda, 15 steps/epoch, 40 steps\n"
                   + _bar([(10, 9_000_000), (20, 3_000_000), (30, 2_000_000), (40, 4_000_000)]) + "\n"
                   + _final(20, 1_000_000, 50) + _final(40, 2_500_000, 12))
    assert tw.main(["--logs", str(log), "--labels", "a", "--steps-per-epoch", "10", "--out", str(tmp_path),
                    "--name", "w"]) == 0
    rows = read_csv(tmp_path / "w.csv")
    # 10 steps an epoch: epochs start at 11, 21, 31 (the log's 15 would mark 16 and 31 only)
    assert [(r["first_step"], r["end_step"], r["epoch_start"]) for r in rows] == [
        ("1", "10", "False"), ("11", "20", "True"), ("21", "30", "True"), ("31", "40", "True")]
    md = (tmp_path / "w.md").read_text()
    assert "| a | run.log | 2,500,000 | 12% | 4 | 3.00M | - | 3.00M | 4.00M |" in md
    assert "Epoch length: 10 steps." in md


def test_train_log_windows_helpers():
    """Epoch starts are the first step of each epoch after the first (1-based); "N steps/epoch" with thousands
    separators."""
    assert tw.epoch_steps("x, 1,234 steps/epoch, y") == 1234 and tw.epoch_steps("nothing") is None
    assert [tw.holds_epoch_start(s, s, 15) for s in (1, 15, 16, 30, 31)] == [False, False, True, False, True]
    assert tw.holds_epoch_start(1, 40, None) is False
    assert tw.median_m([1_000_000, 4_000_000, 2_000_000]) == "2.00M" and tw.median_m([]) == "-"


# ---- autopick_report.py ---------------------------------------------------------------------------------------------


AP_KEYS = ["variant", "precision", "batch_size", "samples_per_sec", "status", "device", "torch", "triton", "python",
           "date"]


def _cell(folder, name, rates):
    with (folder / name).open("w") as f:
        f.write(",".join(AP_KEYS) + "\n")
        for v, r, status in rates:
            env = ["GPU X", "2.x", "3.x", "3.11", "2026-11-30 08:00"]
            f.write(",".join([v, "bf16", "0", str(r), status, *env]) + "\n")


def test_autopick_report_orders_cells_skips_failed_rows_and_tags_the_model(tmp_path, capsys):
    """Cells by model, then batch as a number, then precision; a variant whose row failed takes no part (not the
    fastest even with a rate); the CSV names each row's model."""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    named = "triton-wgrad+step-graph"
    _cell(src, "auto_kaggle_bf16_b65536.csv", [("auto", 3e6, "ok"), (named, 4e6, "ok")])
    _cell(src, "auto_kaggle_tf32_b2048.csv", [("auto", 1e6, "ok"), (named, 2e6, "ok")])
    _cell(src, "auto_kaggle_bf16_b16384.csv", [("auto", 2e6, "ok"), (named, 1e6, "ok"),
                                               ("triton-fused-mlp+step-graph", 9e6, "error")])
    assert ar.main([str(src), "--call", "C", "--out", str(out)]) == 0
    lines = [line for line in (out / "autopick.md").read_text().splitlines() if line.startswith("| Kaggle")]
    assert lines == ["| Kaggle | tf32 | 2048 | 1.00M |  | **2.00M** |  | -50.0% |",
                     "| Kaggle | bf16 | 16384 | 2.00M |  | **1.00M** |  | +100.0% |",
                     "| Kaggle | bf16 | 65536 | 3.00M |  | **4.00M** |  | -25.0% |"]
    rows = read_csv(out / "autopick.csv")
    assert len(rows) == 6 and {r["model"] for r in rows} == {"kaggle"} and {r["status"] for r in rows} == {"ok"}


def test_autopick_report_a_cell_whose_named_variants_all_failed(tmp_path):
    """A cell where only ``auto`` ran ok (every named variant failed, e.g. out of memory) has no fastest: its line
    says n/a and the other cells are still reported (it raised ValueError from max() of nothing until this audit)."""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    _cell(src, "auto_kaggle_bf16_b65536.csv", [("auto", 3e6, "ok"), ("triton-wgrad+step-graph", 4e6, "ok")])
    _cell(src, "auto_mlperf_bf16_b65536.csv", [("auto", 2e6, "ok"), ("triton-wgrad+step-graph", 0, "error")])
    assert ar.main([str(src), "--call", "C", "--out", str(out)]) == 0
    md = (out / "autopick.md").read_text()
    assert "| Mlperf | bf16 | 65536 | 2.00M |  |  |  | n/a |" in md
    assert "| Kaggle | bf16 | 65536 | 3.00M |  | **4.00M** |  | -25.0% |" in md


# ---- stream_timeline.py ---------------------------------------------------------------------------------------------


def test_stream_timeline_numbers_on_uneven_steps():
    """The host's step times (median) of every step that ends in the steady part, the first one (step 21, which starts
    at step 20's end) included: it was left out until this audit. The time from each sync in the steady part to the
    next step after it (a step at the sync's very time came before it; mean), uploads and waits that start in the
    steady part (mean upload), the probe's median oversleep."""
    steps = [float(i) for i in range(20)] + [21.0, 22.0, 23.5, 30.0]  # steady: t = 19 to 30
    events = {"step": steps, "sync": [9.5, 19.0, 22.2, 23.6], "loader": [{"reader_threads": 2}],
              "decode": [[1, 20.0, 22.0, 500]],
              "wait": [[18.5, 19.5], [20.0, 20.25], [29.5, 30.0]],
              "upload": [[5.0, 5.1], [20.0, 20.001], [21.0, 21.004], [25.0, 25.010]],
              "probe": [[20.0, 0.004], [21.0, 0.001], [22.0, 0.010], [23.0, 0.002], [24.0, 0.003], [5.0, 0.5]]}
    n = st.numbers(events)
    assert n["steady_s"] == 11.0
    assert n["host_step_ms_p50"] == pytest.approx(1750.0)  # 2 (19 -> 21), 1, 1.5, 6.5 s
    assert n["after_sync_ms"] == pytest.approx(1e3 * (2.0 + 1.3 + 6.4) / 3)  # 19.0 -> 21.0, 22.2 -> 23.5, 23.6 -> 30
    assert n["upload_ms"] == pytest.approx(5.0)  # 1, 4, 10 ms
    assert (n["waits"], n["wait_s"]) == (2, pytest.approx(0.75))
    assert n["oversleep_p50_ms"] == pytest.approx(3.0) and n["oversleep_p99_ms"] == pytest.approx(10.0)
    assert n["decoded_rows_per_s"] == pytest.approx(500 / 11.0) and n["reader_busy"] == pytest.approx(2.0 / 22.0)
    assert st.steady({"step": [1.0, 2.0, 3.0]}) == (3.0, 3.0) and st.steady({"step": []}) == (0.0, 0.0)


def test_stream_timeline_table_rows_formats_and_pads_a_failed_run():
    """The Markdown row of a run (rates in M and k, shares in percent), and a failed run's row as wide as the
    header."""
    ok = dict(setting="r8", repeat=1, status="ok", samples_per_sec=3456789.4, data_wait_fraction=0.1234,
              host_step_ms_p50=17.456, after_sync_ms=2.31, decoded_rows_per_s=4_500_000, readers=8, reader_busy=0.6,
              reader_rows_per_s=123_456, waits=7, wait_s=1.234, upload_ms=0.84, oversleep_p50_ms=0.12,
              oversleep_p99_ms=3.456)
    table = st.table_rows([ok, dict(setting="base", repeat=2, status="exit 1: boom")])
    assert table[2] == ("| r8 | 1 | 3,456,789 | 12.3% | 17.46 | 2.3 | 4.50M | 8 | 60% | 123k | 7 (1.23) | 0.8 "
                        "| 0.12 / 3.46 |")
    assert table[3] == "| base | 2 | exit 1: boom |  |  |  |  |  |  |  |  |  |  |"
    assert table[3].count("|") == table[0].count("|")


# ---- stream_overlap.py ----------------------------------------------------------------------------------------------


def test_stream_overlap_measure_gain_share_and_priorities(monkeypatch):
    """Each timing goes to its column (A's stream high for par_a_hi); the gain is A then B less the best of the three
    side-by-side times, the share hidden is of the shorter part."""
    times = {"a": 2.0, "b": 1.0, ("seq",): 3.0, ("par", ""): 2.5, ("par", "a"): 2.25, ("par", "b"): 2.75}

    def tagged(tag):
        f = lambda: None  # noqa: E731
        f.tag = tag
        return f

    monkeypatch.setattr(sov, "sequential", lambda a, b: tagged(("seq",)))
    monkeypatch.setattr(sov, "concurrent", lambda a, b, high="": tagged(("par", high)))
    monkeypatch.setattr(sov, "graph_replay_ms", lambda f, calls, windows, warmup: times[f.tag])
    row = sov.measure("a||b", {"a": tagged("a"), "b": tagged("b")}, types.SimpleNamespace(calls=5, windows=7, warmup=3))
    assert row == {"pair": "a||b", "a": "a", "b": "b", "a_ms": 2.0, "b_ms": 1.0, "seq_ms": 3.0, "par_ms": 2.5,
                   "par_a_hi_ms": 2.25, "par_b_hi_ms": 2.75, "gain_ms": 0.75, "hidden_pct": 75.0}


def test_stream_overlap_gain_against_the_uncarved_run(monkeypatch):
    """gain_vs_uncarved_ms: the pair's A then B without a carve-out less this row's best side by side; none where 0
    is not among the carve-outs."""
    current = {}

    @contextlib.contextmanager
    def carveout(sms):
        current["sms"] = sms
        yield

    seq = {0: 10.0, 16: 12.0}
    par = {0: 8.0, 16: 7.0}
    monkeypatch.setattr(sov, "sm_carveout", carveout)
    monkeypatch.setattr(sov, "measure", lambda pair, fns, args: dict(
        pair=pair, a_ms=1.0, b_ms=1.0, seq_ms=seq[current["sms"]], par_ms=par[current["sms"]], par_a_hi_ms=9.0,
        par_b_hi_ms=9.0, gain_ms=0.0))
    for name in ("Tables", "Inputs", "DenseShapes"):
        monkeypatch.setattr(sov, name, lambda *a, **k: types.SimpleNamespace(rows=100))
    monkeypatch.setattr(sov, "Collectives", lambda *a, **k: types.SimpleNamespace(world=1))
    monkeypatch.setattr(sov, "parts", lambda *a: {})
    args = types.SimpleNamespace(batch=2, sm_carveouts=[0, 16])
    rows, _ = sov.run_pairs(["p||q"], [5], [1], 4, 8, 2, 1, [4, 1], 10, torch.device("cpu"), args)
    assert [(r["sm_carveout"], r["gain_vs_uncarved_ms"]) for r in rows] == [(0, 2.0), (16, 3.0)]
    args.sm_carveouts = [16]
    rows, _ = sov.run_pairs(["p||q"], [5], [1], 4, 8, 2, 1, [4, 1], 10, torch.device("cpu"), args)
    assert rows[0]["gain_vs_uncarved_ms"] is None


def test_stream_overlap_markdown_row_and_a_zero_gain():
    """The share hidden in percent; a gain against the uncarved run of exactly 0 is written (only None is blank)."""
    r = dict(pair="a||b", a="a", b="b", sm_carveout=0, a_ms=2.0, b_ms=1.0, seq_ms=3.0, par_ms=2.5, par_a_hi_ms=2.25,
             par_b_hi_ms=2.75, gain_ms=0.75, hidden_pct=75.0, gain_vs_uncarved_ms=0.0)
    lines = sov.markdown_table([r, dict(r, gain_vs_uncarved_ms=None)])
    assert lines[2] == ("| a \\|\\| b | 0 | 2.000 ms | 1.000 ms | 3.000 ms | 2.500 ms | 2.250 ms | 2.750 ms | 0.750 ms "
                        "| 75% | 0.000 ms |")
    assert lines[3].endswith("| 75% |  |")


def test_stream_overlap_collectives_round_the_served_features_up(monkeypatch):
    """Two ranks and 3 features: each rank serves ceil(3 / 2) = 2, so it sends 2 ranks x batch x 2 rows."""
    monkeypatch.setattr(sov.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(sov.dist, "get_world_size", lambda: 2)
    comm = sov.Collectives(batch=5, features=3, dim=4, params=7, device=torch.device("cpu"))
    assert comm.world == 2 and tuple(comm.send.shape) == (2 * 5 * 2, 4)
