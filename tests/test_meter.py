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


def test_a_window_read_one_step_late_keeps_its_own_samples_and_ends_at_its_cut_on_the_cpu(clock):
    """The trainer cuts a window at its logging step and closes it after the next step is queued: the next step's
    samples belong to the next window, and so do its seconds, on the CPU, which ran that step before the read (the
    window ends at its cut; ended at the read, it held 10 steps' samples over 11 steps' seconds, and the next one, read
    at once, over 9)."""
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
    assert rate == pytest.approx(10_000 / 1.0) and wait == pytest.approx(0.1 / 1.0)
    assert m.stats.train_losses[-1] == [11, 0.5]
    for _ in range(9):
        clock.t += 0.1
        m.step(torch.tensor(0.5), samples=1000, data_wait_s=0.02)
    rate, wait = m.log_window(step=21, mean_loss=0.5)  # read at once (an evaluation step): 10 steps in 1.0 s
    assert rate == pytest.approx(10_000 / 1.0) and wait == pytest.approx(0.2 / 1.0)
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


def test_the_first_nonfinite_step_is_numbered_from_the_runs_and_the_windows_start():
    """NonFiniteLoss names the step: the first NaN or Inf of the window (not the last one), counted from the step the
    session resumed at and, after a logging step, from that step."""
    m = StepMeter(torch.device("cpu"), start_step=100, stats=RunStats(), window=4)
    for loss in (0.5, float("inf"), float("nan")):
        m.step(torch.tensor(loss), samples=10, data_wait_s=0.0)
    assert int(m.losses.first_nonfinite_step()) == 102
    m.cut_window(step=103)
    assert int(m.losses.first_nonfinite_step()) == -1
    for loss in (0.25, 0.5, float("-inf")):
        m.step(torch.tensor(loss), samples=10, data_wait_s=0.0)
    assert int(m.losses.first_nonfinite_step()) == 106
    m.cut_window(step=106)
    for loss in (0.25, 0.5):  # fewer steps than the window before: its slots are not summed again
        m.step(torch.tensor(loss), samples=10, data_wait_s=0.0)
    assert m.losses.total().item() == 0.75 and int(m.losses.first_nonfinite_step()) == -1


def test_an_evaluation_and_a_checkpoint_at_one_step_are_both_left_out_and_only_of_their_window(clock):
    """Two pauses in one window (evaluation and checkpoint at the same step) both come off its seconds; the next
    window, without a pause, keeps all of its own."""
    m = StepMeter(torch.device("cpu"), 0, RunStats(), window=10, warmup_steps=1)
    run_window(m, clock, 1, 1.0, 0.0)
    for _ in range(10):
        clock.t += 0.1
        m.step(torch.tensor(0.5), samples=1000, data_wait_s=0.0)
    for pause_s in (20.0, 7.0):
        with m.paused():
            clock.t += pause_s
    assert m.log_window(step=11, mean_loss=0.5)[0] == pytest.approx(10_000)
    assert run_window(m, clock, 10, 0.2, 0.0)[0] == pytest.approx(5_000)
    assert m.rates == pytest.approx([10_000, 5_000])


def test_a_resumed_session_reports_its_own_samples_and_adds_its_time_to_the_runs(clock):
    """Resumed from a checkpoint whose RunStats hold 10^6 samples and 50 s: without a steady window the rate is this
    session's samples over its time, and the run's train_s grows by this session's loop time."""
    stats = RunStats(samples=10**6, train_s=50.0, train_losses=[[1000, 0.4]])
    m = StepMeter(torch.device("cpu"), 1000, stats, window=10, warmup_steps=4)
    run_window(m, clock, 3, 2.0, 0.0)
    assert m.samples_per_sec == pytest.approx(3_000 / 6.0) and stats.samples == 10**6 + 3_000
    clock.t += 1.0
    m.step(torch.tensor(0.5), samples=1000, data_wait_s=0.0)  # the warm-up ends: the windows' clock restarts
    assert run_window(m, clock, 9, 0.1, 0.0)[0] == pytest.approx(10_000)
    m.finish()
    assert stats.train_s == pytest.approx(50.0 + 6.0 + 1.0 + 0.9)
    assert stats.train_losses[0] == [1000, 0.4] and len(stats.train_losses) == 3


def test_run_stats_survive_the_checkpoints_dict():
    stats = RunStats(samples=123, train_s=4.5, train_losses=[[10, 0.7], [20, 0.6]],
                     best={"step": 20, "metric": "logloss", "auc": 0.7, "logloss": 0.6, "checkpoint": "b.pt"},
                     evals_since_best=2)
    back = RunStats.from_dict(stats.to_dict())
    assert back == stats and back.best is not stats.best
    assert RunStats.from_dict(RunStats().to_dict()) == RunStats() == RunStats.from_dict(None)


class FakeSpan:
    """A pair of device timing events `ms` apart (what `DataWaitTimer.cut` hands over on CUDA)."""

    def __init__(self, ms):
        self.ms = ms

    def elapsed_time(self, end):
        return end.ms - self.ms


def test_the_devices_idle_spans_count_as_waiting(clock, monkeypatch):
    """On CUDA the waiting is the device's idle spans (host wait 0): they make each window's share and the total."""
    m = StepMeter(torch.device("cpu"), 0, RunStats(), window=10, warmup_steps=1)
    run_window(m, clock, 1, 1.0, 0.0)
    spans = [(FakeSpan(0.0), FakeSpan(250.0)), (FakeSpan(5.0), FakeSpan(55.0))]  # 0.3 s idle a window
    monkeypatch.setattr(m.wait_timer, "cut", lambda: list(spans))
    assert run_window(m, clock, 10, 0.1, 0.0)[1] == pytest.approx(0.3)  # 0.3 s of 1 s
    assert run_window(m, clock, 10, 0.2, 0.01)[1] == pytest.approx(0.4 / 2.0)
    assert m.wait_fractions == pytest.approx([0.3, 0.2]) and m.data_wait_fraction == pytest.approx(0.7 / 3.0)


def test_the_logging_windows_reductions_are_first_used_in_the_warm_up(clock, monkeypatch):
    """Their first use loads their kernels (53-99 ms once on an H200): spent in the warm-up, before the first steady
    window's clock starts, not inside that window. The window's losses are kept (the read is dropped)."""
    used = []
    for name in ("total", "first_nonfinite_step"):
        orig = getattr(meter_mod.LossWindow, name)
        monkeypatch.setattr(meter_mod.LossWindow, name,
                            lambda self, orig=orig, name=name: (used.append((name, clock.t)), orig(self))[1])

    def slow_get(self, orig=meter_mod.DeviceRead.get):
        clock.t += 0.08  # the kernels' first load
        return orig(self)
    monkeypatch.setattr(meter_mod.DeviceRead, "get", slow_get)
    m = StepMeter(torch.device("cpu"), start_step=0, stats=RunStats(), window=6, warmup_steps=2)
    for i in range(2):
        clock.t += 0.01
        m.step(torch.tensor(0.25 * (i + 1)), samples=100, data_wait_s=0.0)
    assert [n for n, _ in used] == ["total", "first_nonfinite_step"]
    assert m.losses.n == 2 and float(m.losses.total()) == pytest.approx(0.75)
    assert m.window_start == pytest.approx(100.1)  # after the 0.02 s of steps and the 0.08 s read
    assert m.warmup_s == pytest.approx(0.1)
    for _ in range(4):
        clock.t += 0.01
        m.step(torch.tensor(0.5), samples=100, data_wait_s=0.0)
    rate, _ = m.log_window(step=6, mean_loss=0.5)
    assert rate == pytest.approx(400 / 0.04)  # the steady steps only: the first read is not in it
