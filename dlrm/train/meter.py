"""Throughput, data wait and loss bookkeeping of the training loop, without per-step host syncs.

The loss is summed on the device every step and read once per logging interval (the intended
host sync), one step late: the window's sums are copied to the host behind its last step and read
after the next step is queued (`DeviceRead`), so the device has work while the host waits.
Throughput is measured in windows between logging steps after the warm-up steps
(compilation, autotuning, allocator growth, the CUDA graph's capture), with evaluations and
checkpoints inside a window left out (`StepMeter.paused`). The summary reports the steady state as
all those windows' samples over all their seconds, and the share of those seconds the device sat idle
waiting for data (`DataWaitTimer`). Not the median window: a loader that keeps up for a few windows
from its read-ahead and then starves the step for the next ones makes the windows' rates bimodal, and
their median reported MLPerf DLRM-DCNv2 on an H200 at 1.75M samples/s and 2.5% waiting where the
run's steady state was 0.7M (twenty-fifth run).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from dlrm.logging_setup import counted, run_logger

WARMUP_STEPS = 3
"""Ordinary steps before the CUDA graph's capture (`dlrm.train.graphed_step`), and the steps timed apart as warm-up
before the throughput windows start in a run without one (a run with one also leaves its capture step out)."""


@dataclass
class RunStats:
    """What a run has done so far, across resumes (stored in every checkpoint as ``run_stats``).

    Args:
        samples: training samples consumed.
        train_s: seconds spent in the training loop.
        train_losses: ``[step, mean loss of the logging window]`` pairs.
        best: the best evaluation so far (`dlrm.train.evaluator.Evaluator`), or None.
        evals_since_best: evaluations since `best` (early stopping's patience counter; of the grid's best, below).
        grid_best: None when `best` is an evaluation on the ``train.eval_every`` grid; else (`best` is a session's last
            evaluation off it) the best of the grid's evaluations ({}: none yet), which early stopping compares with,
            as a longer uninterrupted run (which makes no evaluation off the grid) does.
        window_losses: the losses of the steps since the last step that is a multiple of ``train.log_every``, one a
            step (`StepMeter.snapshot`): a run resumed between two logging steps puts them back in its first logging
            window, which then logs the mean the uninterrupted run logs.
    """

    samples: int = 0
    train_s: float = 0.0
    train_losses: list[list[float]] = field(default_factory=list)
    best: Optional[dict] = None
    evals_since_best: int = 0
    window_losses: list[float] = field(default_factory=list)
    grid_best: Optional[dict] = None

    def to_dict(self) -> dict:
        out = {"samples": int(self.samples), "train_s": float(self.train_s),
               "train_losses": [[int(s), float(l)] for s, l in self.train_losses],
               "evals_since_best": int(self.evals_since_best)}
        if self.best is not None:
            out["best"] = dict(self.best)
        if self.window_losses:
            out["window_losses"] = [float(x) for x in self.window_losses]
        if self.grid_best is not None:
            out["grid_best"] = dict(self.grid_best)
        return out

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> "RunStats":
        if not d:
            return cls()
        best = d.get("best")
        return cls(int(d["samples"]), float(d["train_s"]), [[int(s), float(l)] for s, l in d["train_losses"]],
                   dict(best) if isinstance(best, dict) else None, int(d.get("evals_since_best", 0)),
                   [float(x) for x in d.get("window_losses") or []],
                   dict(d["grid_best"]) if isinstance(d.get("grid_best"), dict) else None)


_FIRST_SLOTS = 1024
"""Slots `LossWindow` allocates at first (4 KB); a longer logging window grows its buffer as it fills."""


class LossWindow:
    """The losses of the current logging window, one slot a step in a device buffer.

    One small copy a step (no host sync, no arithmetic launches); at a logging step the window's sum and its first
    non-finite step are reduced on the device and read in one go (`DeviceRead`), at a checkpoint step its first
    non-finite step.

    Args:
        device: where the losses live.
        capacity: the most steps a window holds (``train.log_every``).
        first_step: the step number before the window's first loss.

    Example:
        >>> w = LossWindow(torch.device("cpu"), capacity=4, first_step=10)
        >>> for x in (0.5, float("nan"), 0.7): w.add(torch.tensor(x))
        >>> int(w.first_nonfinite_step())  # the 12th step (first_step + 2) gave NaN
        12
    """

    def __init__(self, device: torch.device, capacity: int, first_step: int) -> None:
        # Slots for the first steps only, grown (doubled) as a window fills them: `capacity` is train.log_every, which
        # has no upper bound, and a run that logs only at its end sets it beyond its length (one float32 a step of it
        # up front: 4 GB of device memory at 1e9, and at 1e12 a run stopped before its first step as "out of memory").
        self.capacity = capacity
        self._hold(torch.zeros(min(capacity, _FIRST_SLOTS), device=device))
        self.n, self.first_step = 0, first_step

    def _hold(self, buf: torch.Tensor) -> None:
        """Keep the losses in `buf`, with a view of each of its first `_FIRST_SLOTS` slots made now, in one call: made
        by `add` as ``buf[n]``, each step's view was a select op of its own (host time of every step, which a
        CUDA-graphed step waits for). At most that many (unbind made 1024 in ~1 ms on a 2-core CPU, once a buffer): a
        window of millions of steps would hold as many tensors."""
        self.buf = buf
        self._slots = buf[:_FIRST_SLOTS].unbind()

    def _reserve(self, n: int) -> None:
        """Room for `n` losses (at most `capacity`; a copy of the ones held, no host sync)."""
        if n > self.buf.numel():
            grown = torch.zeros(min(self.capacity, max(n, 2 * self.buf.numel())), device=self.buf.device)
            grown[: self.n].copy_(self.buf[: self.n])
            self._hold(grown)

    def add(self, loss: torch.Tensor) -> None:
        n = self.n
        if n < len(self._slots):  # (within the buffer: no room to make)
            slot = self._slots[n]
        else:
            self._reserve(n + 1)
            slot = self.buf[n]
        slot.copy_(loss)  # a view of one slot: one copy, in stream order with the step
        self.n = n + 1

    def total(self) -> torch.Tensor:
        """Sum of the window's losses (0-dim device tensor)."""
        return self.buf[: self.n].sum()

    def first_nonfinite_step(self) -> torch.Tensor:
        """The step of the window's first NaN/Inf loss, or -1 (0-dim int64 device tensor)."""
        # x * 0 is 0 for every finite x (and -0.0 for a negative one, equal to 0), NaN for NaN and +-Inf (IEEE 754):
        # two kernels, where ``~torch.isfinite(x)`` is five (isfinite is composite: abs, !=, ==, *; then the not).
        # Launched at every logging step, and the step number added as one number (it was two adds)
        bad = (self.buf[: self.n] * 0).ne(0)
        first = bad.to(torch.int64).argmax() + (self.first_step + 1) if self.n else torch.zeros((), dtype=torch.int64,
                                                                                                device=self.buf.device)
        return torch.where(bad.any(), first, torch.full_like(first, -1))

    def reset(self, step: int) -> None:
        self.n, self.first_step = 0, step

    def values(self) -> list[float]:
        """The window's losses as Python floats (a host sync: checkpoint steps only)."""
        return self.buf[: self.n].tolist()

    def preload(self, values: list[float], step: int) -> None:
        """Start the window at `step` holding `values`, the losses of the steps just before it (a resumed run's)."""
        self.n = 0
        self._reserve(len(values))
        self.buf[: len(values)].copy_(torch.tensor(values, dtype=self.buf.dtype))
        self.n, self.first_step = len(values), step - len(values)


class DeviceRead:
    """Values on the device copied to the host without a sync, read later: the logging window's numbers are read one
    step late, after the next step is queued behind them, so the device never drains at a logging step.

    Tensors go through pinned host memory with a non-blocking copy and an event; `get` waits for that event only,
    which completes when the work queued before it has (the next step, queued after it, keeps the device busy).
    Plain numbers pass through. On the CPU the copy is immediate.

    Args:
        values: 0-dim tensors (on any device) and Python numbers.

    Example:
        >>> DeviceRead(torch.tensor(0.25), 3, torch.tensor(-1)).get()
        [0.25, 3, -1]
    """

    def __init__(self, *values) -> None:
        self.values = list(values)
        self.event: Optional[torch.cuda.Event] = None
        for i, v in enumerate(self.values):
            if isinstance(v, torch.Tensor):
                if v.is_cuda:
                    host = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
                    host.copy_(v.detach(), non_blocking=True)
                    self.values[i] = host
                    if self.event is None:
                        self.event = torch.cuda.Event()
                else:
                    self.values[i] = v.detach().clone()
        if self.event is not None:
            self.event.record()  # after every copy above, in the current stream's order

    def ready(self) -> bool:
        """True once `get` would not wait."""
        return self.event is None or self.event.query()

    def get(self) -> list:
        """The values as Python numbers (waits for the copies: intended host sync, at logging steps only)."""
        if self.event is not None:
            self.event.synchronize()
        return [v.item() if isinstance(v, torch.Tensor) else v for v in self.values]


@dataclass
class WindowCut:
    """A logging window's host-side numbers, taken at its last step (`StepMeter.cut_window`) and turned into its rate
    when its device values have been read (`StepMeter.close_window`), possibly a step later.

    Args:
        step: the window's last step.
        steps: steps in the window (the losses summed).
        samples: samples trained in it.
        host_wait: seconds the host waited for batches (the CPU's idle time; 0 on CUDA).
        paused: seconds of evaluations and checkpoints inside it.
        spans: the device's idle spans in it (`DataWaitTimer.cut`), read once its events completed.
        steady: the window closes after the warm-up (it gets a rate).
        done: the session's steps trained when it was cut (`StepMeter.finish`: whether its close ended the training).
        at: the host's clock when it was cut: on the CPU, which runs each step as it is launched, the end of the
            window's last step (its close comes after the next step ran; `StepMeter.close_window`).
        profiled: some of its steps ran under the profiler (`StepMeter.mark_profiled`): no rate of its own, left out
            of the steady state.
    """

    step: int
    steps: int
    samples: int
    host_wait: float
    paused: float
    spans: list = field(default_factory=list)
    steady: bool = True
    done: int = -1
    at: Optional[float] = None
    profiled: bool = False


BLOCKED_FETCH_S = 2.5e-4
"""A batch fetch that held the host longer than this is timed on the device as well (cutting a batch from data
already on the device takes the host ~0.1 ms)."""


class DataWaitTimer:
    """The seconds the device sat idle because the training loop waited for its next batch.

    The host's own wait overstates it: with the step queued asynchronously the host runs ahead of the device,
    and a fetch that blocks it (a loader waiting for its decoding threads, or the launch queue full because
    the device is behind) costs the device nothing while queued steps still run. Measured as the 2026-11-29
    run showed: MLPerf DLRM-DCNv2 from device memory at the same 3.31M samples/s as streamed from parquet,
    and 80% "waiting" by the host's clock (the host blocked in the loader's first launch with the device 100
    steps behind). On CUDA a timing event is recorded before every fetch; a fetch that held the host longer
    than `BLOCKED_FETCH_S` gets a second one after it, and the device time between the two is the idle time:
    the first completes when the queued work does, the second when the host released it. Read at logging
    steps, after their sync (no extra host sync). On the CPU, which runs each step as it is launched, the
    host's wait is the idle time.

    Args:
        device: the training device.

    Example:
        >>> timer = DataWaitTimer(torch.device("cpu"))
        >>> batch, waited = timer.fetch(lambda: "batch")
        >>> batch, waited >= 0.0, timer.take()
        ('batch', True, 0.0)
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        # the events are recorded in the current stream of this device, named by its index: `Event.record()` without
        # a stream asks `torch.cuda.current_stream()`, whose device lookup calls `torch.cuda.is_available()`, a device
        # count from the driver (~8 us of host a fetch on an H200, in a step of ~200 us at batch 256)
        self._index = (device.index if device.index is not None else torch.cuda.current_device()) if self.cuda else None
        self._start: Optional[torch.cuda.Event] = None
        self._spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def fetch(self, get):
        """``(get(), host seconds waited)``; on CUDA the seconds are 0 and the device's idle time goes to `take`."""
        if self.cuda:
            if self._start is None:
                self._start = torch.cuda.Event(enable_timing=True)
            self._start.record(torch.cuda.current_stream(self._index))
        t = time.perf_counter()
        item = get()
        waited = time.perf_counter() - t
        if not self.cuda:
            return item, waited
        if waited > BLOCKED_FETCH_S:
            end = torch.cuda.Event(enable_timing=True)
            end.record(torch.cuda.current_stream(self._index))
            self._spans.append((self._start, end))
            self._start = None  # kept with its span; the next fetch records a new one
        return item, 0.0

    def cut(self) -> list:
        """The idle spans recorded since the last cut, to be read by `seconds` once the device has passed them."""
        spans, self._spans = self._spans, []
        return spans

    @staticmethod
    def seconds(spans: list) -> float:
        """Device seconds idle in `spans` (call after a sync or an event that covers them)."""
        return sum(a.elapsed_time(b) for a, b in spans) / 1e3

    def take(self) -> float:
        """Device seconds idle in the fetches since the last call (call after a sync that covers them)."""
        return self.seconds(self.cut())


class StepMeter:
    """Counts steps, samples, the device-side loss sum and the device's time idle waiting for data.

    Args:
        device: where the loss sum lives.
        start_step: the step the run (re)starts at.
        stats: the run's totals so far (from a checkpoint when resuming).
        window: the most steps a logging window holds (``train.log_every``).
        warmup_steps: steps before the first throughput window (a captured step's warm-up and capture).

    Example:
        >>> meter = StepMeter(torch.device("cpu"), start_step=0, stats=RunStats(), window=10)
        >>> meter.step(torch.tensor(0.7), samples=256, data_wait_s=0.001)
        >>> meter.log_window(step=1, mean_loss=0.7)  # no steady window during warm-up
        (None, None)
        >>> meter.stats.samples, meter.stats.train_losses
        (256, [[1, 0.7]])
    """

    def __init__(self, device: torch.device, start_step: int, stats: RunStats, window: int = 50,
                 warmup_steps: int = WARMUP_STEPS) -> None:
        self.device, self.start_step, self.stats = device, start_step, stats
        self.warmup_steps = warmup_steps
        self.steps_done = 0
        self.session_samples = 0
        self.window = window
        self.losses = LossWindow(device, window, start_step)  # read at logging steps only
        # a run resumed between two logging steps: the losses since the last one (at most those since the last
        # multiple of `window`, which may differ from the interrupted session's) go on in this window
        carried = stats.window_losses[max(len(stats.window_losses) - start_step % window, 0):] \
            if start_step % window else []
        if carried:
            self.losses.preload(carried, start_step)
        held, since = len(carried), start_step % window
        # a checkpoint written before 2026-11-30 kept none (or train.log_every changed): said when that window is
        # logged (`cut_window`), as the one logged loss that is not the uninterrupted run's (the training itself
        # resumes exactly). Said here, it also came in a session that trains no step and logs no window (a resume
        # of a finished run, --max-steps at the checkpoint's step)
        self._missing: Optional[tuple[int, int]] = (held, since) if held < since else None
        stats.window_losses = []
        self._tail: list[float] = []  # a window cut off the logging grid (a run's last step): its losses
        self.wait_timer = DataWaitTimer(device)  # the trainer fetches batches through it
        self.window_samples, self.data_wait, self.window_paused = 0, 0.0, 0.0
        self.rates: list[float] = []
        self.wait_fractions: list[float] = []
        self.steady_samples, self.steady_s, self.steady_wait = 0, 0.0, 0.0  # the closed windows' totals
        # the windows holding profiled steps (`mark_profiled`): apart, the rate only of a session with no other window
        self.profiled_samples, self.profiled_s, self.profiled_wait = 0, 0.0, 0.0
        self._profiled = False  # the current window holds a profiled step
        self.warmup_s = float("nan")
        self.prior_train_s, self._finished = stats.train_s, False  # earlier sessions' training time
        self.loop_start = self.window_start = time.perf_counter()
        # this session's paused seconds and its loop's end (`finish`): the rate of a session without a steady window
        self.session_paused, self.loop_end = 0.0, None
        self._end_paused = 0.0  # the seconds of `session_paused` before `loop_end`
        self._last_close: tuple[float, int, float] = (0.0, -1, 0.0)  # (time, steps then, seconds paused then)

    def step(self, loss: torch.Tensor, samples: int, data_wait_s: float) -> None:
        self.losses.add(loss)
        self.steps_done += 1
        self.stats.samples += samples
        self.session_samples += samples
        self.window_samples += samples
        self.data_wait += data_wait_s
        if self.steps_done == self.warmup_steps:
            self._first_read()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # intended sync, once: separates warm-up from steady state
            self.wait_timer.take()  # the warm-up's
            self.window_start = time.perf_counter()
            self.warmup_s = self.window_start - self.loop_start
            self.window_samples, self.data_wait, self.window_paused = 0, 0.0, 0.0

    def _first_read(self) -> None:
        """A logging window's reductions and read, once, inside the warm-up, their result dropped (intended sync, once).
        Their first use loads their kernels (CUDA loads a module at its first launch): 53-99 ms of host time on an
        H200 (sixty-eighth session, `benchmarks/results/first_window_h200.md`), which, spent at the first logging
        step, made the first steady window 11-17x slower than the others and summary.json's samples/s 53-65% of the
        windows' median in short runs; spent here, it is the warm-up's. The window's losses stay (a NaN in the warm-up
        is found and named at the logging step's read). No collective runs here, only this rank's reductions: whether
        the logging step's first all-reduces (`dlrm.train.windows`, under torchrun) cost a first use too is not
        measured."""
        DeviceRead(self.losses.total(), self.losses.first_nonfinite_step()).get()

    @contextlib.contextmanager
    def paused(self):
        """Leave the time inside (an evaluation, a checkpoint) out of the current throughput window. The device is
        synchronized first (intended sync, at evaluation and checkpoint steps only): the steps already queued finish
        inside the window, not inside the pause."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t = time.perf_counter()
        try:
            yield
        finally:
            paused = time.perf_counter() - t
            self.window_paused += paused
            self.session_paused += paused

    def mark_profiled(self) -> None:
        """The step just trained ran under the profiler (its warmup or recording: on a CPU run 2-50x slower, the
        recorded ops and ranges its overhead; the trace's save is `paused` apart): its window gets no rate and stays
        out of the steady state. Counted in, a --profile run's summary.json samples/s, its TensorBoard curve and its
        bar showed the profiler's cost as the model's (the sample's first window: 25k samples/s against 63k). A warm-up
        step's is not its window's: that window gets no rate anyway, and kept (the warm-up's end resets the window, not
        the mark), it took the rate of the first steady window, whose steps ran unprofiled (`profile.wait` 0 and a cycle
        within the warm-up: that window missing from samples/s, and a run of one steady window said to report "the
        profiler's" rate)."""
        if self.steps_done > self.warmup_steps:
            self._profiled = True

    def log_window(self, step: int, mean_loss: float) -> tuple[Optional[float], Optional[float]]:
        """Close the logging window at `step` with its (already reduced) mean loss; returns
        (samples/s, data-wait fraction) of the window, or Nones during warm-up."""
        return self.close_window(self.cut_window(step), mean_loss)

    def cut_window(self, step: int) -> WindowCut:
        """End the logging window at `step` on the host's side (its samples, waits and pauses; the loss window starts
        again): the steps after it count towards the next window. Launch the device reductions of `losses` first."""
        if self._missing is not None:  # the first window logged: the one a resume could not rebuild (`__init__`)
            (held, since), self._missing = self._missing, None
            last = self.start_step - since
            # the uninterrupted run's window at `step`: train.log_every's steps, or fewer off the grid (a last step)
            whole = f"train.log_every's {self.window}" if step - last == self.window else f"the {step - last} since it"
            run_logger.warning(f"--resume at step {self.start_step}: the checkpoint holds the losses of {held} of the "
                               f"{counted(since, 'step')} since the last logging step ({last}; one written before "
                               f"2026-11-30 holds none): the loss logged at step {step} averages only the steps from "
                               f"here, not {whole} as the uninterrupted run's does")
        cut = WindowCut(step, self.losses.n, self.window_samples, self.data_wait, self.window_paused,
                        self.wait_timer.cut(), steady=self.steps_done > self.warmup_steps, done=self.steps_done,
                        at=time.perf_counter(), profiled=self._profiled)
        self.window_samples, self.data_wait, self.window_paused, self._profiled = 0, 0.0, 0.0, False
        # off the grid of multiples of `window` (a run's last step): a longer resumed run logs again at the next
        # multiple, over these steps too (a host sync, once a run)
        self._tail = self._tail + self.losses.values() if step % self.window else []
        self.losses.reset(step)
        return cut

    def snapshot(self) -> None:
        """Put the losses since the last multiple of `window` into ``stats.window_losses`` (a host sync: before a
        checkpoint or an evaluation, which checkpoint `stats`)."""
        self.stats.window_losses = self._tail + self.losses.values()

    def close_window(self, cut: WindowCut, mean_loss: float) -> tuple[Optional[float], Optional[float]]:
        """The window `cut`, whose device work has just been waited for: on CUDA its time runs to now (the device
        finished its last step now, or earlier if the host was behind), on the CPU to its cut (`WindowCut.at`), and
        the next window's starts there. Returns (samples/s, data-wait fraction), or Nones during warm-up."""
        self.stats.train_losses.append([cut.step, mean_loss])
        # On the CPU the step after the cut ran before this read. Ended at the read, a window after one read late was
        # timed from its second step: read late itself, up to the next window's first step, read at once (an
        # evaluation, a checkpoint, the run's last step), one step short; a last window of 2 steps showed twice the
        # run's samples/s in TensorBoard and on the bar (the steady total was right, the windows were not)
        read_now = self.device.type == "cuda" or cut.at is None
        now = time.perf_counter() if read_now else cut.at
        # Timed to its read, a steady window also spans the pauses between its cut and that read (the trace a profiler
        # saves at the step after a logging step, paused before the loop reads the window): they are left out of it,
        # and not again out of the next window, which starts at the read, after them. Subtracted from the next one
        # instead, on CUDA a window ran a trace's save longer and the next one as much shorter (a 10 s save: no rate,
        # its samples dropped from the steady state, summary.json's samples/s 58 where every step ran at 100)
        between = 0.0
        if read_now and cut.steady:
            between, self.window_paused = self.window_paused, 0.0
        rate = wait = None
        seconds = now - self.window_start - cut.paused - between
        waited = cut.host_wait + self.wait_timer.seconds(cut.spans)  # the device's idle time: its events completed
        if cut.steady and cut.profiled and cut.samples and seconds > 0:  # the profiler's rate: kept apart
            self.profiled_samples += cut.samples
            self.profiled_s += seconds
            self.profiled_wait += waited
        elif cut.steady and cut.samples and seconds > 0:
            rate = cut.samples / seconds
            # the share of the window the device sat idle waiting for batches: the loader starving the step
            wait = waited / seconds
            self.rates.append(rate)
            self.wait_fractions.append(wait)
            self.steady_samples += cut.samples
            self.steady_s += seconds
            self.steady_wait += waited
        if cut.steady:
            self.window_start = now
        self._last_close = (now, cut.done, self.session_paused)  # (`finish`: the end of the session's training)
        # A warm-up window's close does not start the next window: the warm-up's end does (`step`). Read a step late,
        # at the warm-up's last step (train.log_every 1 or 3) that close comes after the first steady step ran (on the
        # CPU, which runs each step as it is launched), and restarting there left that step's seconds out of every
        # window while its samples counted (summary.json's samples/s 1/8 too high over 12 steps at log_every 3).
        return rate, wait

    def update_train_s(self) -> None:
        """Bring ``stats.train_s`` up to now: earlier sessions' time plus this session's loop so far (frozen once the
        loop ended, `finish`). The checkpointer calls it before it stores `stats`: a checkpoint records the training
        time up to its step (grown only at the loop's end, a run killed after a mid-run checkpoint lost that
        session's time from train_s and from the time to target)."""
        if not self._finished:
            self.stats.train_s = self.prior_train_s + (time.perf_counter() - self.loop_start)

    def finish(self) -> None:
        """Add this session's loop time to the run's total (and stop its clock: the last evaluation is not in it)."""
        self.update_train_s()
        self._finished = True
        # the last window's read when it covered every step (the trainer reads the last step's at once): after it the
        # loop asked for one more batch, which stopped the train loader (its producer decoding ahead), and, on an
        # early stop, evaluated; counted, a session without a steady window averaged that shutdown in as training
        closed, done, paused = self._last_close
        if done == self.steps_done:
            self.loop_end, self._end_paused = closed, paused
        else:
            self.loop_end, self._end_paused = time.perf_counter(), self.session_paused
        if not self.steady_s and self.profiled_s:
            run_logger.warning("samples/s: every logging window after the warm-up held profiled steps (profile.repeat "
                               "0, or a run too short for an unprofiled window): this session's samples/s is the "
                               "profiler's, slower than training alone")

    @property
    def samples_per_sec(self) -> Optional[float]:
        """This session's steady state: the closed windows' samples over their seconds, those holding profiled steps
        left out unless all are (the whole session's
        average if no window closed after the warm-up: its loop's seconds up to `finish`, evaluations and
        checkpoints left out, as in the windows; read after the loop ended, it counted the final evaluation,
        checkpoint and profile summary too, and a 2-step run reported 54 samples/s for 370). None for a session that
        trained no step (a run resumed at its end, for its last evaluation and summary): it has no rate, and "0
        samples/s" was summary.json's and the final line's throughput of a run that trained at its own."""
        if self.steady_s > 0:
            return self.steady_samples / self.steady_s
        if self.profiled_s > 0:  # every steady window was profiled (said by `finish`): theirs, not the warm-up's too
            return self.profiled_samples / self.profiled_s
        if self.steps_done == 0:
            return None
        if self.loop_end is not None:
            elapsed = self.loop_end - self.loop_start - self._end_paused
        else:
            elapsed = time.perf_counter() - self.loop_start - self.session_paused
        return self.session_samples / elapsed if elapsed > 0 else 0.0

    @property
    def data_wait_fraction(self) -> Optional[float]:
        """The share of the steady-state seconds the device sat idle waiting for batches (None before a window
        closed; `DataWaitTimer`)."""
        if self.steady_s > 0:
            return self.steady_wait / self.steady_s
        return self.profiled_wait / self.profiled_s if self.profiled_s > 0 else None
