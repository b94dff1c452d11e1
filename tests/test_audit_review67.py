"""Review of session 67's profiling and meter changes (audit helper, review67): the steps marked profiled are the
ones the profiler slowed, no more and no fewer: not a warm-up step's mark carried into the first steady window, and
the profiler's start-up (kineto's prepare, run by the ``prof.step()`` after a cycle's last wait step) not counted as
an unprofiled window's training."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.profiler import schedule

from dlrm.config import load_config
from dlrm.train import meter as meter_mod
from dlrm.train import profiling
from dlrm.train.meter import RunStats, StepMeter
from dlrm.train.trainer import train
from tests.conftest import REPO, make_dataset


def test_a_profiled_warmup_does_not_take_the_first_steady_windows_rate(monkeypatch):
    """profile.wait 0, warmup 1, active 2: the profiler's steps are the warm-up's 3. The window of steps 4-10 ran
    unprofiled; it kept the warm-up's mark (the warm-up's end resets the window's samples, not the mark), got no rate,
    and a run of that one window reported "the profiler's" samples/s."""
    clock = [100.0]
    monkeypatch.setattr(meter_mod.time, "perf_counter", lambda: clock[0])
    m = StepMeter(torch.device("cpu"), 0, RunStats(), window=10, warmup_steps=3)
    rates = []
    for i in range(1, 21):
        clock[0] += 1.0 if i <= 3 else 0.1
        m.step(torch.tensor(0.5), samples=100, data_wait_s=0.0)
        if i <= 3:
            m.mark_profiled()
        if i % 10 == 0:
            rates.append(m.log_window(i, 0.5)[0])
    m.finish()
    assert rates == [pytest.approx(1000.0), pytest.approx(1000.0)]  # 7 and 10 unprofiled steps of 0.1 s
    assert m.samples_per_sec == pytest.approx(1000.0) and m.profiled_s == 0


def test_a_steady_profiled_step_still_marks_its_window(monkeypatch):
    """The mark is kept from the first steady step on (the other side of the warm-up's edge)."""
    clock = [100.0]
    monkeypatch.setattr(meter_mod.time, "perf_counter", lambda: clock[0])
    m = StepMeter(torch.device("cpu"), 0, RunStats(), window=4, warmup_steps=3)
    for i in range(1, 9):
        clock[0] += 0.1
        m.step(torch.tensor(0.5), samples=100, data_wait_s=0.0)
        if i == 4:
            m.mark_profiled()
        if i % 4 == 0:
            m.log_window(i, 0.5)
    assert m.rates == [pytest.approx(1000.0)] and m.profiled_samples == 100  # steps 5-8 rated; step 4's window not


def _prof(step_num: int, **sched) -> SimpleNamespace:
    fn = schedule(**sched)
    return SimpleNamespace(step_num=step_num, current_action=fn(step_num), schedule=fn)


@pytest.mark.filterwarnings("ignore:Profiler won't be using warmup")
def test_the_step_whose_prof_step_starts_the_profiler_is_profiled():
    """wait 2, warmup 1, active 1: step 0 and 1 wait; the ``prof.step()`` after step 1 prepares kineto (0.9 s on the
    CPU in a fresh process), inside step 1's window. Steps after the cycle stay unprofiled."""
    marks = [profiling.profiles_step(_prof(n, wait=2, warmup=1, active=1, repeat=1)) for n in range(6)]
    assert marks == [False, True, True, True, False, False]
    # warmup 0: the step before the first recorded one starts the recording
    assert [profiling.profiles_step(_prof(n, wait=1, warmup=0, active=1, repeat=1)) for n in range(3)] == \
        [True, True, False]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("review67") / "ds"
    make_dataset(root, {"train": 640, "validation": 64}, row_group_size=80)
    return root


def test_the_profilers_start_up_is_in_no_rated_window(dataset, tmp_path, monkeypatch):
    """profile.wait 4 with train.log_every 4: the profiler's start-up (here 0.5 s more) runs after step 4, which ends a
    window. That window (steps 4, after the 3 warm-up steps) was rated at 32 samples over the start-up, in TensorBoard
    and in summary.json's samples/s."""
    real_prepare = profiling._StepProfile.prepare_trace

    def slow_prepare(self):
        time.sleep(0.5)  # kineto's / CUPTI's set-up, as the loop times it
        return real_prepare(self)

    monkeypatch.setattr(profiling._StepProfile, "prepare_trace", slow_prepare)
    cfg = load_config(REPO / "configs" / "sample.json", {
        "data.path": str(dataset), "log.tb_dir": str(tmp_path), "log.run_name": "p", "data.batch_size": 32,
        "train.max_steps": 20, "train.log_every": 4, "train.eval_every": None, "train.device": "cpu",
        "train.baseline": False, "profile.enabled": True, "profile.wait": 4, "profile.warmup": 1,
        "profile.active": 2})
    s = train(cfg)
    ea = EventAccumulator(str(tmp_path / "p"))
    ea.Reload()
    rates = {e.step: e.value for e in ea.Scalars("train/samples_per_sec")}
    assert set(rates) == {12, 16, 20}, rates  # steps 4 (the start-up) and 5-8 (warmup, recording): no point
    expected = 3 * 128 / sum(128 / r for r in rates.values())
    assert s["samples_per_sec"] == pytest.approx(expected, rel=1e-5)
    assert json.loads((tmp_path / "p" / "summary.json").read_text())["samples_per_sec"] == s["samples_per_sec"]
