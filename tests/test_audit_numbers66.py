"""The numbers a user reads (audit helper, session 66): each logging window's samples/s and data-wait share on the
CPU, in TensorBoard and on the bar, against a fake clock that runs one second a step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dlrm.config import load_config
from dlrm.train import meter as meter_mod
from dlrm.train.meter import RunStats, StepMeter
from dlrm.train.trainer import train
from tests.conftest import REPO, make_dataset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("numbers66") / "ds"
    make_dataset(root, {"train": 320, "validation": 64}, row_group_size=80)
    return root


def scalars(run_dir, tag):
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


# ---- a logging window's rate on the CPU -------------------------------------------------------------


def test_on_the_cpu_a_window_read_late_or_at_once_is_its_own_steps_seconds(monkeypatch):
    """The trainer's order on the CPU: the step runs, the last window is read, a logging step cuts the next; an
    evaluation step reads its window at once. Every step takes 1 s: every window is one batch a second (a window read a
    step late ran to the end of the next step, 10 steps' samples over 11 s; one read at once over 9 s)."""
    clock = [100.0]
    monkeypatch.setattr(meter_mod, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    m = StepMeter(torch.device("cpu"), 0, RunStats(), window=10, warmup_steps=1)
    rates, pending = [], None
    for step in range(1, 32):
        clock[0] += 1.0
        m.step(torch.tensor(0.5), samples=100, data_wait_s=0.25)
        if pending is not None:
            rates.append(m.close_window(pending, 0.5))
            pending = None
        if step % 10 == 0 or step == 31:
            pending = m.cut_window(step)
        if step in (20, 31):  # an evaluation step, the run's last: read at once
            rates.append(m.close_window(pending, 0.5))
            pending = None
    # the first window holds steps 2-10 (step 1 the warm-up); then 11-20, 21-30, and the last step alone
    assert rates == [(pytest.approx(100.0), pytest.approx(0.25))] * 4
    assert m.samples_per_sec == pytest.approx(100.0) and m.data_wait_fraction == pytest.approx(0.25)


def test_a_cpu_runs_tensorboard_rates_are_each_windows_own(dataset, tmp_path, monkeypatch):
    """A real run whose steps take 1 s of the meter's clock (and everything else none): every train/samples_per_sec
    point is one batch (32 samples) a second, summary.json's too. Each window ran to the end of the next step: the
    first (steps 4-5 after the warm-up) was 21.3/s, one read at once at an evaluation step 40/s, the one after it
    26.7/s, and the last (steps 26-27, off the grid) 64/s, twice the run's rate, the bar's last samples_s."""
    clock = [0.0]
    monkeypatch.setattr(meter_mod, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    real_step = StepMeter.step

    def step(self, *args, **kwargs):  # called right after the step ran: it took 1 s
        clock[0] += 1.0
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(StepMeter, "step", step)
    cfg = load_config(REPO / "configs" / "sample.json", {
        "data.path": str(dataset), "log.tb_dir": str(tmp_path), "log.run_name": "clocked", "data.batch_size": 32,
        "train.epochs": 3, "train.max_steps": 27, "train.log_every": 5, "train.eval_every": 10, "train.device": "cpu",
        "train.baseline": False})
    summary = train(cfg)
    rates = scalars(tmp_path / "clocked", "train/samples_per_sec")
    assert [s for s, _ in rates] == [5, 10, 15, 20, 25, 27]
    assert [r for _, r in rates] == [pytest.approx(32.0)] * 6
    assert summary["samples_per_sec"] == pytest.approx(32.0)


# ---- the baseline's curve is one split's ----------------------------------------------------------------


def test_a_resume_on_another_eval_split_logs_its_baseline_as_its_own_curve(tmp_path):
    """A run on 'validation' logs baseline/* at its end; a resume in place on 'test' logs its evaluations as
    eval/test/* (the run's eval/* stay one split's), and its baseline's AUC and logloss went on baseline/*: one curve
    from the validation baseline's AUC to the test baseline's. Now they are baseline/test/*, as its eval/test/*."""
    make_dataset(tmp_path / "ds", {"train": 40, "validation": 16, "test": 16})
    base = {"data.path": str(tmp_path / "ds"), "log.tb_dir": str(tmp_path / "tb"), "log.run_name": "r",
            "data.batch_size": 8, "train.epochs": 1, "train.log_every": 1, "train.eval_every": 5,
            "train.device": "cpu", "train.baseline": True}
    first = train(load_config(REPO / "configs" / "sample.json", base))
    later = train(load_config(REPO / "configs" / "sample.json", {**base, "data.eval_split": "test", "train.epochs": 2}),
                  resume="latest", allow_config_change=["train.epochs"])
    run = tmp_path / "tb" / "r"
    assert [s for s, _ in scalars(run, "eval/auc")] == [5] and [s for s, _ in scalars(run, "eval/test/auc")] == [10]
    assert scalars(run, "baseline/auc") == [(5, pytest.approx(first["baseline"]["auc"]))]
    assert scalars(run, "baseline/logloss") == [(5, pytest.approx(first["baseline"]["logloss"]))]
    assert scalars(run, "baseline/test/auc") == [(10, pytest.approx(later["baseline"]["auc"]))]
    assert scalars(run, "baseline/test/logloss") == [(10, pytest.approx(later["baseline"]["logloss"]))]
