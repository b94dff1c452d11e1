"""The training loop's throughput bookkeeping (`dlrm.train.meter.StepMeter`) against a fake clock: what summary.json's
samples_per_sec and data_wait_fraction say about a run."""

import time

import pytest
import torch

from dlrm.train import meter as meter_mod
from dlrm.train.meter import RunStats, StepMeter


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


def run_window(m, clock, steps, step_s, wait_s, batch=1000, paused_s=0.0):
    """``steps`` steps of ``step_s`` seconds each, ``wait_s`` of it waiting for data; an evaluation of ``paused_s``
    inside the window; then the window is closed."""
    for i in range(steps):
        clock.t += step_s
        m.step(torch.tensor(0.5), samples=batch, data_wait_s=wait_s)
        if paused_s and i == 0:
            with m.paused():
                clock.t += paused_s
    return m.log_window(step=m.steps_done, mean_loss=0.5)


def test_a_starving_loader_is_reported_as_the_whole_steady_state_not_the_median_window(clock):
    """A loader that keeps up for a window from its read-ahead and then starves the step for two (as the stream
    loader did with MLPerf DLRM-DCNv2's multi-hot rows on an H200): samples over seconds of all steady windows, and
    the waiting share of those seconds; the median window would have said 10,000 samples/s and 0% waiting."""
    m = StepMeter(torch.device("cpu"), 0, RunStats(), window=10, warmup_steps=2)
    assert run_window(m, clock, 2, 5.0, 0.0) == (None, None)  # warm-up (compile): not a window
    rates = []
    for _ in range(3):  # fast, slow, fast, slow, ... : 3 fast windows, 2 slow ones
        rates.append(run_window(m, clock, 10, 0.1, 0.0)[0])
    for _ in range(2):
        rates.append(run_window(m, clock, 10, 1.0, 0.9)[0])
    assert rates == pytest.approx([10_000] * 3 + [1_000] * 2)
    # 50 steps of 1,000 samples in 3 x 1 s + 2 x 10 s
    assert m.samples_per_sec == pytest.approx(50_000 / 23.0)
    assert m.data_wait_fraction == pytest.approx(18.0 / 23.0)
    assert m.warmup_s == pytest.approx(10.0)


def test_evaluations_inside_a_window_are_left_out(clock):
    m = StepMeter(torch.device("cpu"), 0, RunStats(), window=10, warmup_steps=1)
    run_window(m, clock, 1, 3.0, 0.0)
    rate, wait = run_window(m, clock, 10, 0.1, 0.05, paused_s=30.0)
    assert rate == pytest.approx(10_000) and wait == pytest.approx(0.5)
    assert m.samples_per_sec == pytest.approx(10_000)
    # a pause during the warm-up does not shorten the first window
    m = StepMeter(torch.device("cpu"), 0, RunStats(), window=10, warmup_steps=2)
    m.step(torch.tensor(0.5), samples=1000, data_wait_s=0.0)
    with m.paused():
        clock.t += 50.0
    m.step(torch.tensor(0.5), samples=1000, data_wait_s=0.0)
    assert run_window(m, clock, 4, 0.5, 0.0)[0] == pytest.approx(2_000)


def test_the_warm_up_steps_are_the_meters_own(clock):
    """A captured step's warm-up and capture (`GraphedTrainStep.warmup_steps` + 1) stay out of the first window."""
    m = StepMeter(torch.device("cpu"), 0, RunStats(), window=11, warmup_steps=4)
    assert run_window(m, clock, 3, 2.0, 0.0) == (None, None)
    clock.t += 9.0  # the capture
    m.step(torch.tensor(0.5), samples=1000, data_wait_s=0.0)
    assert run_window(m, clock, 10, 0.1, 0.0)[0] == pytest.approx(10_000)
    # no steady window yet: the session's average, no waiting share
    m = StepMeter(torch.device("cpu"), 0, RunStats(), window=10, warmup_steps=4)
    run_window(m, clock, 2, 1.0, 0.0)
    assert m.samples_per_sec == pytest.approx(1_000) and m.data_wait_fraction is None



def test_on_the_cpu_the_hosts_wait_is_the_idle_time():
    timer = meter_mod.DataWaitTimer(torch.device("cpu"))
    batch, waited = timer.fetch(lambda: (time.sleep(0.02), "batch")[1])
    assert batch == "batch" and 0.02 <= waited < 1.0 and timer.take() == 0.0


@pytest.mark.gpu
def test_a_wait_costs_the_device_only_what_it_had_not_queued():
    """The host waits 50 ms for a batch: the device, idle, loses ~50 ms; the device, still running ~300 ms of queued
    work, loses nothing. The host's clock says 50 ms both times (what summary.json said before 2026-11-29)."""
    device = torch.device("cuda")
    timer = meter_mod.DataWaitTimer(device)
    torch.cuda.synchronize()
    _, host = timer.fetch(lambda: time.sleep(0.05))
    torch.cuda.synchronize()
    idle = timer.take()
    assert host == 0.0 and 0.045 <= idle < 0.2
    torch.cuda._sleep(1_000_000_000)  # ~0.3-0.6 s of spinning on one SM (clock-dependent)
    timer.fetch(lambda: time.sleep(0.05))
    torch.cuda.synchronize()
    assert timer.take() < 0.005
    timer.fetch(lambda: None)  # a fetch that does not block the host is not timed at all
    torch.cuda.synchronize()
    assert timer.take() == 0.0


def test_a_window_read_one_step_late_keeps_its_own_samples_and_ends_at_the_read(clock):
    """The trainer cuts a window at its logging step and closes it after the next step is queued: the next step's
    samples belong to the next window, whose time starts where this one's read ended."""
    m = StepMeter(torch.device("cpu"), 0, RunStats(), window=10, warmup_steps=1)
    run_window(m, clock, 1, 1.0, 0.0)  # warm-up
    for _ in range(10):
        clock.t += 0.1
        m.step(torch.tensor(0.5), samples=1000, data_wait_s=0.01)
    cut = m.cut_window(step=11)
    assert (cut.step, cut.steps, cut.samples, cut.host_wait) == (11, 10, 10_000, pytest.approx(0.1))
    clock.t += 0.1
    m.step(torch.tensor(0.5), samples=1000, data_wait_s=0.02)  # the next step, queued before the read
    rate, wait = m.close_window(cut, mean_loss=0.5)
    assert rate == pytest.approx(10_000 / 1.1) and wait == pytest.approx(0.1 / 1.1)
    assert m.stats.train_losses[-1] == [11, 0.5]
    for _ in range(9):
        clock.t += 0.1
        m.step(torch.tensor(0.5), samples=1000, data_wait_s=0.02)
    rate, wait = m.log_window(step=21, mean_loss=0.5)  # read at once (an evaluation step): 10 steps in 0.9 s
    assert rate == pytest.approx(10_000 / 0.9) and wait == pytest.approx(0.2 / 0.9)
    assert m.samples_per_sec == pytest.approx(20_000 / 2.0)


def test_device_read_passes_numbers_and_copies_tensors():
    t = torch.tensor([2.5])
    read = meter_mod.DeviceRead(t, 7, torch.tensor(-1))
    t.fill_(9.0)  # a later in-place update (the next step's) does not reach the values read
    assert read.ready() and read.get() == [2.5, 7, -1]


@pytest.mark.gpu
def test_a_device_read_waits_for_its_own_step_not_the_next():
    """The logging window's values are copied behind its last step; reading them waits for that step only, while
    the next step (queued after the copy) still runs: the device does not drain at a logging step."""
    value = torch.zeros((), device="cuda")
    torch.cuda._sleep(200_000_000)  # the window's last step: ~0.1 s of spinning
    value.add_(3.0)
    read = meter_mod.DeviceRead(value, 1.5)
    value.add_(1.0)  # the next step changes the value after the copy
    torch.cuda._sleep(1_000_000_000)  # the next step: ~0.5 s
    after = torch.cuda.Event()
    after.record()
    assert read.get() == [3.0, 1.5]
    assert not after.query(), "the read waited for the next step as well"
    torch.cuda.synchronize()
    assert value.item() == 4.0
