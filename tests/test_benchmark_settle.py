"""benchmarks/_common.settle: untimed steps for a number of seconds before timed windows (a GPU's power-capped
clock), and the MLPerf benchmark's use of it."""

from __future__ import annotations

import sys

import torch

from tests.test_benchmark_scripts import REPO, load_script

sys.path.append(str(REPO / "benchmarks"))

import _common  # noqa: E402


def test_settle_steps_until_the_time_is_up_in_blocks_and_counts_from_start(monkeypatch):
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    calls, now = [], [100.0]  # binary-exact times: 0.25 s a step

    class Clock:  # each step takes 0.25 s of this clock, whatever the machine's load (a sleep can take longer)
        @staticmethod
        def perf_counter():
            return now[0]

    monkeypatch.setattr(_common, "time", Clock)

    def step(i):
        calls.append(i)
        now[0] += 0.25

    dev = torch.device("cuda")  # only its type is read; synchronize is stubbed above
    n = _common.settle(step, 6.25, dev, start=7, check_every=5)
    assert n == len(calls) == 25  # blocks of 5 calls (1.25 s) until 6.25 s have passed, checked after each block
    assert calls == list(range(7, 7 + n)) and len(syncs) == n // 5 and syncs[0] == dev


def test_settle_does_nothing_on_the_cpu_or_for_zero_seconds(monkeypatch):
    calls = []
    assert _common.settle(calls.append, 5.0, torch.device("cpu")) == 0
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    assert _common.settle(calls.append, 0.0, torch.device("cuda")) == 0 and calls == []


def test_mlperf_benchmark_settles_by_default_and_not_in_smoke_runs(tmp_path, monkeypatch):
    md2 = load_script("mlperf_dcnv2")
    seen = []
    monkeypatch.setattr(md2, "measure_baseline", lambda *a, **k: seen.append(a[-1]) or {"status": "skipped: test"})
    monkeypatch.setattr(md2, "measure", lambda *a, **k: seen.append(a[-1]) or {"status": "skipped: test"})
    # nothing to free after the stubs (free_device: dynamo's reset and a full gc.collect after every case, ~0.1-0.4 s
    # each in a test process's heap)
    monkeypatch.setattr(md2, "free_device", lambda device: None)
    assert md2.main(["--smoke", "--variants", "eager", "--out", str(tmp_path / "smoke")]) == 0
    assert seen == [0.0, 0.0]  # the baseline and the variant, no settling in a smoke run
    # a full run (on the CPU, also on a GPU machine: small tables, the floor's rates at CPU sizes, no settling of
    # its own) passes the 3 s default on
    seen.clear()
    args = ["--variants", "eager", "--max-rows", "100", "--batch-sizes", "64", "--device", "cpu",
            "--out", str(tmp_path / "full")]
    assert md2.main(args) == 0 and seen == [3.0, 3.0]
    assert md2.main([*args, "--settle-s", "0.5", "--overwrite"]) == 0 and seen[2:] == [0.5, 0.5]  # (the last run's)
    assert "untimed steps" not in (tmp_path / "full" / "mlperf_dcnv2.md").read_text()  # the CPU does not settle
