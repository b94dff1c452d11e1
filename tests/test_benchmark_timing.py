"""benchmarks/_common's timers: `graph_replay_windows` (CUDA graphs, what the kernel benchmarks time with),
`wall_windows` and `wall_ms` (the CPU smoke runs) and `graph_replay_ms` (the median, or one wall call on the CPU)."""

from __future__ import annotations

import sys
import time

import pytest
import torch

from tests.test_benchmark_scripts import REPO

sys.path.append(str(REPO / "benchmarks"))

import _common  # noqa: E402


def test_wall_windows_runs_warmup_then_windows_of_calls_and_gives_ms_per_call():
    calls = []

    def step():
        calls.append(1)
        time.sleep(0.002)

    times, n = _common.wall_windows(step, 3, windows=2, warmup=1)
    assert n == 3 and len(calls) == 1 + 2 * 3 and len(times) == 2
    assert all(2.0 <= t < 200.0 for t in times)  # each call sleeps 2 ms
    times, n = _common.wall_windows(step, 0, windows=1, warmup=0)  # at least one call a window
    assert n == 1 and len(times) == 1 and len(calls) == 8


def test_wall_ms_times_one_call():
    calls = []
    ms = _common.wall_ms(lambda: (calls.append(1), time.sleep(0.003)))
    assert calls == [1] and 3.0 <= ms < 300.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback; the GPU path is the gpu test below")
def test_graph_replay_ms_on_the_cpu_is_one_wall_call():
    calls = []
    ms = _common.graph_replay_ms(lambda: (calls.append(1), time.sleep(0.002)), 10, 5, warmup=3)
    assert calls == [1] and ms >= 2.0


@pytest.mark.gpu
def test_graph_replay_windows_captures_the_calls_once_and_replays_them():
    x = torch.zeros(1 << 20, device="cuda")
    python_calls = []

    def step():
        python_calls.append(1)
        x.add_(1.0)

    times, n = _common.graph_replay_windows(step, 4, windows=3, warmup=2)
    # warm-up calls and one capture of 4 run the Python; the replays (upload + 3 windows) only the graph
    assert n == 4 and len(times) == 3 and len(python_calls) == 2 + 4 and all(t > 0 for t in times)
    torch.cuda.synchronize()
    assert x[0].item() == 2 + 4 * (1 + 3)  # the capture itself runs nothing; 4 replays of 4 adds
    # count from one call's time: a 4 MB add takes microseconds, so 20 ms of work is more than the cap of 200
    times, n = _common.graph_replay_windows(step, 0, windows=2, warmup=0)
    assert n == 200 and len(times) == 2 and len(python_calls) == 6 + 1 + 200
    before = len(python_calls)
    assert _common.graph_replay_ms(step, 4, 3, warmup=1) > 0 and len(python_calls) == before + 1 + 4
