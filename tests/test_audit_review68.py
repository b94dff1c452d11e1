"""Review of session 68: `StepMeter._first_read` (the logging window's reductions and read used once at the warm-up's
end) and `profiling.detach_cupti_after_cycles` (``TEARDOWN_CUPTI=1`` for a CUDA run's --profile)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from dlrm.config import load_config
from dlrm.errors import NonFiniteLoss
from dlrm.train import meter as meter_mod
from dlrm.train import profiling
from dlrm.train.meter import RunStats, StepMeter
from dlrm.train.trainer import train
from tests.conftest import make_dataset
from tests.test_audit_numerics import BASE, poison_at


@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    monkeypatch.delenv("DISABLE_CUPTI_LAZY_REINIT", raising=False)
    return monkeypatch


def said(call) -> list[str]:
    """The lines `call()` logs through the profiling module's logger."""
    lines = []
    handle = profiling.logger.add(lines.append, format="{message}")
    try:
        call()
    finally:
        profiling.logger.remove(handle)
    return lines


def test_a_user_disabling_cuptis_lazy_reinit_gets_no_teardown(env):
    """``DISABLE_CUPTI_LAZY_REINIT`` alone: with ``TEARDOWN_CUPTI=1`` added, Kineto tears CUPTI down and re-inits it
    eagerly at the next cycle, the combination torch's own comment says crashes with CUDA graphs on CUDA 12 (torch
    sets the two together, teardown off). The variable was set regardless."""
    env.setenv("DISABLE_CUPTI_LAZY_REINIT", "1")
    env.setattr(torch.version, "cuda", "13.0")
    lines = said(profiling.detach_cupti_after_cycles)
    assert "TEARDOWN_CUPTI" not in os.environ
    assert len(lines) == 1 and "DISABLE_CUPTI_LAZY_REINIT is set" in lines[0] and "stays attached" in lines[0]


def test_a_rocm_build_is_told_nothing_about_cupti(env):
    """On ROCm ``torch.version.cuda`` is None (the device is still "cuda"): the log said "CUDA None (before 12.6):
    CUPTI stays attached", of a library that build does not have."""
    env.setattr(torch.version, "cuda", None)
    env.setattr(torch.version, "hip", "6.2.41133", raising=False)
    assert said(profiling.detach_cupti_after_cycles) == []
    assert "TEARDOWN_CUPTI" not in os.environ


@pytest.mark.parametrize("cuda", ["unknown", "12", "12.x", "13.0a"])
def test_an_unread_cuda_version_is_named_as_unread_not_as_old(env, cuda):
    """A version string that is not MAJOR.MINOR was logged as "CUDA 12 (before 12.6)", "CUDA unknown (before
    12.6)": said as not read, the variable left to the user, who is told what to set."""
    env.setattr(torch.version, "cuda", cuda)
    lines = said(profiling.detach_cupti_after_cycles)
    assert "TEARDOWN_CUPTI" not in os.environ
    assert len(lines) == 1
    assert f"CUDA version {cuda!r} not read as MAJOR.MINOR" in lines[0] and "before 12.6" not in lines[0]
    assert "set TEARDOWN_CUPTI=1" in lines[0]


@pytest.mark.parametrize("cuda", ["12.6.85", "12.10", "14.1"])
def test_patch_and_two_digit_minor_versions_detach(env, cuda):
    """Compared as numbers: 12.10 is after 12.6 (as a string it sorts before it)."""
    env.setattr(torch.version, "cuda", cuda)
    assert said(profiling.detach_cupti_after_cycles) == []
    assert os.environ["TEARDOWN_CUPTI"] == "1"


def test_a_second_profiled_run_in_the_process_keeps_the_first_runs_setting_silently(env):
    """The variable is the process's: a sweep's or `--compare`'s next --profile run finds it and keeps it."""
    env.setattr(torch.version, "cuda", "12.8")
    profiling.detach_cupti_after_cycles()
    assert os.environ["TEARDOWN_CUPTI"] == "1"
    assert said(profiling.detach_cupti_after_cycles) == []
    assert os.environ["TEARDOWN_CUPTI"] == "1"


# ---- StepMeter._first_read ----------------------------------------------------------------------------------------


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(meter_mod.time, "perf_counter", c)
    return c


@pytest.mark.parametrize("log_every", [1, 2, 3, 4])
def test_the_first_read_is_warm_up_time_when_logging_steps_meet_the_warm_up(clock, monkeypatch, log_every):
    """Warm-up 3, logging every 1-4 steps (a logging step at the warm-up's end, or not): the read's 0.08 s goes into
    warmup_s and no steady window's rate; every window's mean loss is its own steps'."""
    reads = []

    def slow_get(self, orig=meter_mod.DeviceRead.get):
        reads.append(clock.t)
        clock.t += 0.08
        return orig(self)
    monkeypatch.setattr(meter_mod.DeviceRead, "get", slow_get)
    m = StepMeter(torch.device("cpu"), start_step=0, stats=RunStats(), window=log_every, warmup_steps=3)
    losses = [0.1 * (i + 1) for i in range(12)]
    means = {}
    for i, loss in enumerate(losses, 1):
        clock.t += 0.01
        m.step(torch.tensor(loss), samples=100, data_wait_s=0.0)
        if i % log_every == 0:
            means[i] = float(m.losses.total()) / m.losses.n
            m.log_window(step=i, mean_loss=means[i])
    assert len(reads) == 1 and m.warmup_s == pytest.approx(0.03 + 0.08)
    assert m.rates and all(r == pytest.approx(100 / 0.01) for r in m.rates)
    assert m.samples_per_sec == pytest.approx(100 / 0.01)
    for step, mean in means.items():
        own = losses[step - log_every:step]
        assert mean == pytest.approx(sum(own) / len(own)), step


def test_a_resumed_sessions_preloaded_window_survives_the_first_read_and_no_collective_runs(clock, monkeypatch):
    """A session resumed at step 7 with log_every 5: its window holds steps 6-7's losses from the checkpoint. The
    warm-up's read drops its result and keeps the window; it calls no collective (under torchrun a collective here
    would be one more agreement point that the logging steps do not need)."""
    def no_collective(*args, **kwargs):
        raise AssertionError("a collective at the warm-up's end")
    monkeypatch.setattr(torch.distributed, "all_reduce", no_collective)
    monkeypatch.setattr(torch.distributed, "barrier", no_collective)
    m = StepMeter(torch.device("cpu"), start_step=7, stats=RunStats(window_losses=[9.0, 0.6, 0.7]), window=5,
                  warmup_steps=2)
    for loss in (0.8, 0.9):  # steps 8, 9: the warm-up, and its read
        clock.t += 0.01
        m.step(torch.tensor(loss), samples=10, data_wait_s=0.0)
    clock.t += 0.01
    m.step(torch.tensor(1.0), samples=10, data_wait_s=0.0)  # step 10, a logging step
    assert m.losses.values() == pytest.approx([0.6, 0.7, 0.8, 0.9, 1.0])
    assert float(m.losses.total()) == pytest.approx(4.0) and int(m.losses.first_nonfinite_step()) == -1


def test_a_nan_loss_inside_the_warm_up_still_stops_the_run_naming_its_step(tmp_path, monkeypatch):
    """Step 2 of a 3-step warm-up turns the model NaN; the warm-up's read (step 3) sees it and drops it; the logging
    step 4's read names step 2, as without that read."""
    firsts = []
    original = StepMeter._first_read

    def counted(self):
        firsts.append(int(self.losses.first_nonfinite_step()))
        original(self)
    monkeypatch.setattr(StepMeter, "_first_read", counted)
    make_dataset(tmp_path / "ds", {"train": 100, "validation": 40}, row_group_size=16)
    raw = json.loads(json.dumps(BASE))
    raw["data"]["path"] = str(tmp_path / "ds")
    raw["train"]["log_every"] = 4
    (tmp_path / "c.json").write_text(json.dumps(raw))
    poison_at(monkeypatch, 2)
    with pytest.raises(NonFiniteLoss, match=r"loss became NaN or Inf at step 2; stopped"):
        train(load_config(tmp_path / "c.json", {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": "nan"}))
    assert firsts == [2]  # the read ran inside the warm-up, with the NaN already in the window
