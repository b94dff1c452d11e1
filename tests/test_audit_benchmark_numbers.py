"""Audit (by mutation) of the benchmark scripts' arithmetic: samples/s, ms a step, floors, efficiencies, shares and
the CSV / Markdown fields they write, checked against fake clocks and timers (exact values, no real timings)."""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import json
import sys
import types

import pytest
import torch

from tests.test_benchmark_scripts import REPO, load_script

sys.path.append(str(REPO / "benchmarks"))

import _common  # noqa: E402


class FakeClock:
    """A stand-in for the `time` module: perf_counter / time read `now`, advanced by the test's steps."""

    def __init__(self, start: float = 100.0):
        self.now = start

    def perf_counter(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now


def fake_timer(seconds: list[float]):
    """A `Timer` class whose successive regions last `seconds` (popped in order); `used` counts them."""

    class FakeTimer:
        used = 0

        def __init__(self, device):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            FakeTimer.used += 1
            self.seconds = seconds.pop(0)

    return FakeTimer


def fake_event_class(clock: list[float]):
    """A `torch.cuda.Event` class whose events record `clock[0]` (ms) and measure the difference."""

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = clock[0]

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return end.t - self.t

    return Event


def read_csv(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# ---- _common --------------------------------------------------------------------------------------------------------


def test_common_timer_wall_windows_and_wall_ms_units(monkeypatch):
    """Timer.seconds in seconds; wall_windows in ms per call (not per window); wall_ms in ms."""
    clock = FakeClock()
    monkeypatch.setattr(_common, "time", clock)
    with _common.Timer(torch.device("cpu")) as t:
        clock.now += 0.5
    assert t.seconds == 0.5

    calls = []

    def step():
        calls.append(1)
        clock.now += 0.25  # 250 ms a call

    times, n = _common.wall_windows(step, 4, windows=3, warmup=2)
    assert n == 4 and len(calls) == 2 + 3 * 4 and times == [250.0, 250.0, 250.0]
    assert _common.wall_ms(step) == 250.0


def test_common_graph_replay_ms_is_the_median_window(monkeypatch):
    """The reported ms a call is the median of the windows (one slow window does not move it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_common, "graph_replay_windows", lambda *a, **k: ([1.0, 1.5, 30.0], 8))
    assert _common.graph_replay_ms(lambda: None, 8, 3, warmup=1) == 1.5


def test_common_graph_replay_windows_ms_per_call_with_a_fake_cuda(monkeypatch):
    """ms per call of each replayed window (a window's time / the graph's calls), and the automatic count: about
    20 ms of work a window from one call's replay time. torch.cuda's pieces are fakes: a call takes 0.5 ms."""
    clock, capturing = [0.0], []

    Event = fake_event_class(clock)

    class Graph:
        def __init__(self):
            self.calls = 0

        def replay(self):
            clock[0] += 0.5 * self.calls

    class Capture:
        def __init__(self, graph):
            self.graph = graph

        def __enter__(self):
            capturing.append(self.graph)

        def __exit__(self, *exc):
            capturing.pop()

    def step():
        if capturing:
            capturing[-1].calls += 1

    stream = types.SimpleNamespace(wait_stream=lambda s: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", Capture)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    times, n = _common.graph_replay_windows(step, 4, windows=3, warmup=2)
    assert n == 4 and times == [0.5, 0.5, 0.5]
    times, n = _common.graph_replay_windows(step, 0, windows=2, warmup=0)
    assert n == 40 and times == [0.5, 0.5]  # 20 ms / 0.5 ms a call


def test_common_environment_csv_and_markdown_fields(monkeypatch, tmp_path):
    """The date as every results file writes it, the environment's keys (GPU/CPU name, versions, date), the
    environment line, CSV rows with the environment on every row and the Markdown layout."""
    fixed = datetime.datetime(2026, 3, 4, 9, 5, 59)
    monkeypatch.setattr(_common, "datetime", types.SimpleNamespace(datetime=types.SimpleNamespace(now=lambda: fixed)))
    assert _common.date_stamp() == "2026-03-04 09:05"
    env = _common.environment(torch.device("cpu"))
    assert list(env) == ["device", "torch", "triton", "python", "date"]
    assert env["date"] == "2026-03-04 09:05" and env["torch"] == torch.__version__ and env["device"]
    assert _common.env_line({"device": "H200", "date": "2026-03-04 09:05"}) == "device: H200, date: 2026-03-04 09:05"
    _common.write_csv(tmp_path / "x.csv", [{"a": 1, "b": 2.5}, {"a": 3}], ["a", "b"], {"device": "H200", "date": "d"})
    assert read_csv(tmp_path / "x.csv") == [{"a": "1", "b": "2.5", "device": "H200", "date": "d"},
                                            {"a": "3", "b": "", "device": "H200", "date": "d"}]
    assert _common.md_row([1, "x", 2.5]) == "| 1 | x | 2.5 |"
    assert _common.markdown("T", ["p1", "p2"], ["| a |"]) == "# T\n\np1\n\np2\n\n| a |\n"


# ---- train_throughput ---------------------------------------------------------------------------------------------


def test_train_throughput_measure_rates_from_fake_windows(monkeypatch):
    """samples/s per window = steps x batch / the window's seconds; the median reported with min and max; step ms =
    batch / median samples/s; only the `windows` timed windows count (not the warm-up); warmup_s is the untimed time."""
    tt = load_script("train_throughput")
    clock = FakeClock()
    monkeypatch.setattr(tt, "time", clock)
    timer = fake_timer([0.5, 0.25, 1.0])  # 3 windows of 2 steps of 32 rows: 128, 256 and 64 samples/s
    monkeypatch.setattr(tt, "Timer", timer)
    monkeypatch.setattr(tt, "build_run", lambda *a, **k: types.SimpleNamespace())
    monkeypatch.setattr(tt, "tables_from_config", lambda cfg: None)
    monkeypatch.setattr(tt, "synthetic_batches", lambda *a, **k: [None] * 8)
    steps_run = []

    def train_steps(run, batches, n, start=0):
        steps_run.append((start, n))
        clock.now += 2.0 * n  # 2 s a step on the host clock
        return torch.tensor(0.75)

    monkeypatch.setattr(tt, "train_steps", train_steps)
    cfg = tt.load_config(REPO / "configs" / "sample.json")
    r = tt.measure(cfg, "eager", "fp32", 32, torch.device("cpu"), warmup=3, steps=2, windows=3, settle_s=5.0)
    assert timer.used == 3 and steps_run == [(0, 3), (0, 2), (2, 2), (4, 2)]
    assert (r["samples_per_sec"], r["min_samples_per_sec"], r["max_samples_per_sec"]) == (128.0, 64.0, 256.0)
    assert r["step_ms"] == 250.0 and r["final_loss"] == 0.75 and r["batch_size"] == 32
    assert r["warmup_s"] == 6.0  # 3 warm-up steps of 2 s; no settling on the CPU
    assert r["windows_t1"] - r["windows_t0"] == 12.0 and r["peak_memory_mb"] is None and r["status"] == "ok"


def test_train_throughput_markdown_shows_the_median():
    tt = load_script("train_throughput")
    row = {"variant": "eager", "precision": "bf16", "batch_size": 2048, "samples_per_sec": 1234567.8,
           "min_samples_per_sec": 1e6, "max_samples_per_sec": 2e6, "step_ms": 1.6589, "warmup_s": 12.34,
           "peak_memory_mb": 4096.4, "status": "ok"}
    lines = tt.markdown_table([row, {"variant": "triton", "precision": "bf16", "batch_size": 2048, "status": "skipped: x"}])
    assert lines[2] == "| eager | bf16 | 2048 | 1,234,568 | 1.659 | 12.3 | 4,096 | ok |"
    assert lines[3] == "| triton | bf16 | 2048 | n/a | n/a | n/a | n/a | skipped: x |"


# ---- mlperf_dcnv2 -------------------------------------------------------------------------------------------------


def test_mlperf_work_per_sample_exact():
    """The MLPerf model's work per sample, by hand from its shapes (26 features, 214 lookups, D = 128)."""
    md2 = load_script("mlperf_dcnv2")
    w = md2.work_per_sample(md2.load_config(md2.CONFIG))
    assert (w["lookups"], w["features"], w["width"]) == (214, 26, 3456)
    assert w["bottom_macs"] == 13 * 512 + 512 * 256 + 256 * 128
    assert w["cross_macs"] == 3 * 2 * 3456 * 512
    assert w["top_macs"] == 3456 * 1024 + 1024 * 1024 + 1024 * 512 + 512 * 256 + 256
    assert w["flop"] == 6 * 16030464 == 96182784
    # bf16 rows read fwd (214 x 256 B), read + written by the update, fp32 row state r+w (214 x 8 B), 26 x D bf16 grad
    assert w["emb_bytes"] == 214 * 256 + 2 * 214 * 256 + 214 * 8 + 26 * 128 * 2 == 172720


def test_mlperf_floors_in_series_and_millions():
    md2 = load_script("mlperf_dcnv2")
    work = {"flop": 100e6, "emb_bytes": 200e3}
    fl = md2.floors(work, {"gemm_tflops": 800.0, "gemm_tflops_sustained": None, "copy_gbps": 4000.0})
    assert fl["floor_sps"] == pytest.approx(1 / (1 / 8e6 + 1 / 20e6))  # 5.71M: the two in series, not the lower
    assert md2.millions(1.14e6) == "1.14M" and md2.millions(250000.0) == "0.25M" and md2.millions(99999.0) == "99,999"
    assert md2.millions(None) == "n/a" and md2.millions(0) == "n/a"


def test_mlperf_device_peaks_rates_from_fake_timers(monkeypatch):
    """GEMM TFLOP/s = 2 n^3 x reps / s (burst, then sustained: its own timing) and copy GB/s = 2 x bytes x reps / s."""
    md2 = load_script("mlperf_dcnv2")
    timer = fake_timer([0.5, 0.25, 2.0])  # burst GEMM, sustained GEMM, copy
    monkeypatch.setattr(md2, "Timer", timer)
    monkeypatch.setattr(md2, "free_device", lambda device: None)
    p = md2.device_peaks(torch.device("cpu"), smoke=True, settle_s=1e-9)
    assert timer.used == 3 and (p["gemm_n"], p["copy_bytes"]) == (512, 2**24)
    assert p["gemm_tflops"] == pytest.approx(2 * 512**3 * 3 / 0.5 / 1e12)
    assert p["gemm_tflops_sustained"] == pytest.approx(2 * 512**3 * 3 / 0.25 / 1e12)
    assert p["copy_gbps"] == pytest.approx(2 * 2**24 * 3 / 2.0 / 1e9)


def test_mlperf_baseline_rates_from_fake_windows(monkeypatch):
    """The baseline's samples/s: steps x batch / window seconds, median of the windows; step ms = batch / median."""
    md2 = load_script("mlperf_dcnv2")
    timer = fake_timer([0.5, 0.25, 1.0])  # 2 steps of 8 rows: 32, 64, 16 samples/s
    monkeypatch.setattr(md2, "Timer", timer)
    cfg = md2.load_config(md2.CONFIG)
    cfg.model.bottom_mlp, cfg.model.top_mlp, cfg.model.cross_rank = [8, 128], [8, 1], 4  # small dense part
    r = md2.measure_baseline(cfg, 8, torch.device("cpu"), "fp32", 20, warmup=1, steps=2, windows=3)
    assert timer.used == 3
    assert (r["samples_per_sec"], r["min_samples_per_sec"], r["max_samples_per_sec"]) == (32.0, 16.0, 64.0)
    assert r["step_ms"] == 250.0 and r["table_rows"] == sum(min(c, 20) for c in cfg.model.cardinalities)


def test_mlperf_run_case_peak_memory_in_gib(monkeypatch):
    md2 = load_script("mlperf_dcnv2")
    monkeypatch.setattr(md2, "measure", lambda *a, **k: {
        "samples_per_sec": 1.5e6, "step_ms": 43.69, "peak_memory_mb": 3072.0, "windows_t0": 0.0, "windows_t1": 1.0,
        "status": "ok", "variant": "eager"})
    args = argparse.Namespace(max_rows=100, dense_optim=None, precision="fp32", warmup=1, steps=1, windows=1,
                              settle_s=0.0, clocks=False)
    row = md2.run_case("eager", md2.load_config(md2.CONFIG), 64, torch.device("cpu"), args)
    assert row["peak_memory_gib"] == 3.0 and row["samples_per_sec"] == 1.5e6 and row["status"] == "ok"


def test_mlperf_comparisons_and_their_table_cells():
    """Speed-up = ours / the baseline's of the same batch; of target only at the target's batch (65536)."""
    md2 = load_script("mlperf_dcnv2")
    rows = [{"impl": "baseline", "batch_size": 65536, "samples_per_sec": 1e6, "status": "ok"},
            {"impl": "auto", "batch_size": 65536, "samples_per_sec": 3e6, "status": "ok"},
            {"impl": "baseline", "batch_size": 16384, "samples_per_sec": 2e6, "status": "ok"},
            {"impl": "auto", "batch_size": 16384, "samples_per_sec": 3e6, "status": "ok"}]
    md2.add_comparisons(rows)
    assert [r["speedup_vs_baseline"] for r in rows] == [1.0, 3.0, 1.0, 1.5]
    assert [r["of_target"] for r in rows] == [0.25, 0.75, None, None]
    table = md2.markdown_table(rows)
    assert "| 3.00x | 75% |" in table[3] and "| 1.50x | n/a |" in table[5]


# ---- scaling ------------------------------------------------------------------------------------------------------


def test_scaling_measure_global_rate_of_two_ranks(monkeypatch):
    """Global samples/s = steps x batch per GPU x ranks / window seconds (median, with min and max); step ms from it."""
    sc = load_script("scaling")
    timer = fake_timer([0.5, 0.25, 1.0])  # 2 steps x 16 rows x 2 ranks = 64 samples: 128, 256, 64 samples/s
    monkeypatch.setattr(sc, "Timer", timer)
    env = types.SimpleNamespace(world_size=2, distributed=True, rank=0, is_main=True,
                                all_gather_object=lambda obj: [obj, obj])
    monkeypatch.setattr(sc, "init_distributed", lambda dist, device: (env, torch.device("cpu")))
    monkeypatch.setattr(sc, "build_run", lambda *a, **k: types.SimpleNamespace(train_step=lambda b: None))
    monkeypatch.setattr(sc, "tables_from_config", lambda cfg: None)
    monkeypatch.setattr(sc, "rank_batches", lambda *a, **k: [None] * 4)
    monkeypatch.setattr(sc, "train_steps", lambda *a, **k: None)
    monkeypatch.setattr(sc, "fill_cardinalities", lambda cfg: None)
    monkeypatch.setattr(sc, "environment", lambda device: {"device": "D", "torch": "t", "triton": "x", "date": "d"})
    from kernels import heuristics
    from kernels.embedding import update

    monkeypatch.setattr(heuristics, "PER_GPU_LAUNCHES", heuristics.PER_GPU_LAUNCHES)
    monkeypatch.setattr(update, "SR_RNG", update.SR_RNG)
    from dlrm.distributed import owner_exchange

    monkeypatch.setattr(owner_exchange, "SORT_OVERLAP", owner_exchange.SORT_OVERLAP)
    args = argparse.Namespace(config=str(REPO / "configs" / "sample.json"), precision="fp32", batch_per_gpu=16,
                              sharding=None, balance=None, cuda_graph=None, sort_overlap="on", sr_rng=None,
                              per_gpu_launches="on", warmup=1, steps=2, windows=3, profile=False)
    r = sc.measure(args)
    assert timer.used == 3 and r["gpus"] == 2 and r["batch_per_gpu"] == 16
    assert (r["samples_per_sec"], r["min_samples_per_sec"], r["max_samples_per_sec"]) == (128.0, 64.0, 256.0)
    assert r["step_ms"] == 250.0 and r["date"] == "d" and r["device"] == "D"


def test_scaling_efficiency_against_the_same_device_and_table_cells():
    """A 1-GPU row of another device (even closer in time) is not the reference; the table writes the efficiency
    to two places and each row's own date."""
    sc = load_script("scaling")

    def row(gpus, rate, date, device):
        return {"gpus": gpus, "config": "m.json", "precision": "bf16", "sharding": "auto", "batch_per_gpu": 64,
                "device": device, "samples_per_sec": rate, "step_ms": 1.0, "date": date}

    rows = [row(1, 100.0, "2026-11-28 09:00", "A"), row(1, 400.0, "2026-11-28 10:00", "B"),
            row(2, 150.0, "2026-11-28 10:01", "A")]
    sc.add_efficiency(rows)
    assert [r["efficiency"] for r in rows] == [1.0, 1.0, 0.75]
    table = sc.markdown_table(rows)
    assert table[4].endswith("| 0.75 | n/a | 2026-11-28 10:01 |")


# ---- user_path ----------------------------------------------------------------------------------------------------


def test_user_path_train_py_reads_the_summary(monkeypatch, tmp_path):
    """A train.py run's row: samples/s, the share of time waiting for data, steps and what "auto" chose, from
    its summary.json."""
    up = load_script("user_path")

    def run(cmd, **kw):
        name = cmd[cmd.index("--run-name") + 1]
        d = tmp_path / "tb" / name
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({
            "samples_per_sec": 1.25e6, "data_wait_fraction": 0.125, "data_wait_s": 9.0, "steps": 300,
            "device_name": "NVIDIA H200", "versions": {"torch": "2.9"},
            "resolved": {"placement": "gpu", "kernels": {"embedding": "triton", "mlp": "torch"}, "compile": True,
                         "cuda_graph": False}}))
        return types.SimpleNamespace(returncode=0)

    monkeypatch.setattr(up.subprocess, "run", run)
    r = up.train_py(REPO / "configs" / "sample.json", tmp_path, 512, 1, 10, "b512", tmp_path)
    assert r == {"samples_per_sec": 1.25e6, "data_wait_fraction": 0.125, "steps": 300, "placement": "gpu",
                 "kernels": "embedding=triton,mlp=torch", "compile": True, "cuda_graph": False, "status": "ok",
                 "device_name": "NVIDIA H200", "versions": {"torch": "2.9"}}


def test_user_path_write_table_and_csv_fields(monkeypatch, tmp_path):
    """The Markdown's millions, the share of the device-resident rate and of the time waiting for data; the CSV's
    GPU name (from the train.py runs) and date on every row."""
    up = load_script("user_path")
    monkeypatch.setattr(up, "date_stamp", lambda: "2026-11-30 07:00")
    rows = [{"batch_size": 2048, "run": "device-resident (auto)", "samples_per_sec": 2.5e6, "status": "ok"},
            {"batch_size": 2048, "run": "train.py (defaults)", "samples_per_sec": 1.25e6, "ratio": 0.5,
             "data_wait_fraction": 0.125, "steps": 300, "placement": "gpu", "compile": True, "cuda_graph": False,
             "status": "ok", "device_name": "NVIDIA H200", "versions": {"torch": "2.9"}}]
    args = argparse.Namespace(out=str(tmp_path), data="/d/sample", epochs=2, set=[], config="configs/kaggle.json")
    up.write(rows, args, "up")
    md = (tmp_path / "up.md").read_text()
    assert "gpu: NVIDIA H200; torch 2.9; date: 2026-11-30 07:00; dataset sample, 2 epochs" in md
    assert "| 2048 | device-resident (auto) | 2.50M | - | - |" in md
    assert "| 2048 | train.py (defaults) | 1.25M | 50% | 12.5% | gpu | True | False | ok |" in md
    csv_rows = read_csv(tmp_path / "up.csv")
    assert [(r["gpu"], r["date"], r["config"]) for r in csv_rows] == [("NVIDIA H200", "2026-11-30 07:00",
                                                                      "configs/kaggle.json")] * 2
    assert (csv_rows[1]["ratio"], csv_rows[1]["data_wait_fraction"]) == ("0.5", "0.125")
