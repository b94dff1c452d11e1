"""Audit of the throughput accounting of runs that end before their last step (dlrm/train/trainer.py,
dlrm/train/windows.py, dlrm/train/meter.py): early stopping, a SIGINT/SIGTERM stop, a loader that runs out; and of
the other non-training time inside the loop (a checkpoint's weight check, a profiler's trace save).

The non-training work is made artificially slow here (`SLOW` seconds: the training loader's shutdown, joining the
producer thread that decodes ahead; the weight check; the trace save); none of the numbers a user reads (a window's
samples/s in the log and TensorBoard, summary.json's samples_per_sec and train_s) may count it. Tiny CPU runs: 100
train rows, batch 16.

"Slow" is a jump of the clock the run reads (`time.perf_counter`, through the `time` module in every clock read of
dlrm/train), not a real sleep: the code under test sees the same SLOW seconds pass at the same point, and the six
tests no longer sleep 21 s between them (22.4 s of CI test time, 2026-12-01)."""

from __future__ import annotations

import json
import signal
import time

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dlrm.config import load_config
from dlrm.data.parquet_loader import ParquetLoader
from dlrm.errors import TrainingStopped
from dlrm.train.trainer import Trainer, train
from tests.conftest import make_dataset

BATCH = 16
# seconds the training loader takes to stop (its producer thread's join): far more than the real steps beside it on
# any machine (at 3 s, CI's 2 loaded cores trained the 8 profiled steps of the trace-save test in more than 3 s)
SLOW = 1000.0


BASE = {
    "data": {"batch_size": BATCH, "shuffle": True, "drop_last": True},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "optim": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.05}},
    "train": {"epochs": 3, "log_every": 4, "eval_every": None, "device": "cpu", "seed": 3, "baseline": False},
    "checkpoint": {"every": None},
}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("audit_earlystop") / "ds"
    make_dataset(root, {"train": 100, "validation": 32}, row_group_size=16)
    return root


@pytest.fixture
def slow_shutdown(monkeypatch, clock):
    """The training loader (the one that decodes the next epoch ahead) takes SLOW seconds to stop; records when."""
    original, stops = ParquetLoader._stop_run, []

    def stop_run(self, run):
        if self.chain_epochs:
            clock(SLOW)
            stops.append(time.perf_counter())
        return original(self, run)

    monkeypatch.setattr(ParquetLoader, "_stop_run", stop_run)
    return stops


def config(tmp_path, dataset, name, **sections):
    raw = json.loads(json.dumps(BASE))
    raw["data"]["path"] = str(dataset)
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    (tmp_path / f"{name}.json").write_text(json.dumps(raw))
    return load_config(tmp_path / f"{name}.json", {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": name})


def scalars(run_dir, tag):
    events = EventAccumulator(str(run_dir))
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)}


def window_seconds(run_dir, steps):
    """Each logged window's seconds, from its samples/s in TensorBoard and its samples (`steps`: step -> samples)."""
    rates = scalars(run_dir, "train/samples_per_sec")
    return {step: samples / rates[step] for step, samples in steps.items()}


# A target any evaluation reaches: early stopping ends the run at its first evaluation (train.eval_every).
REACHED = {"metric": "logloss", "patience": None, "target": 100.0}


def test_an_early_stops_last_window_leaves_the_loaders_shutdown_out(tmp_path, dataset, slow_shutdown):
    """Early stopping at step 6, between the logging steps 4 and 8: the steps 5-6 are the last window, read after
    the loop. It was read after the loader had stopped: its 2 steps 'took' SLOW seconds (its samples/s point
    ~1/300 of the window before's on an idle CPU), and summary.json's samples_per_sec and train_s counted it too."""
    cfg = config(tmp_path, dataset, "early", train={"eval_every": 6, "early_stopping": REACHED})
    trainer = Trainer(cfg)
    summary = trainer.fit()
    assert summary["early_stopped"] and summary["steps"] == 6
    assert slow_shutdown, "the training loader was stopped"
    seconds = window_seconds(tmp_path / "tb" / "early", {4: BATCH, 6: 2 * BATCH})  # step 4: after 3 warm-up steps
    assert seconds[6] < SLOW / 2, seconds
    assert trainer.meter.steady_s < SLOW / 2
    assert summary["samples_per_sec"] > 3 * BATCH / (SLOW / 2)
    # the loader's shutdown is this session's wall time, not the run's training time
    assert summary["train_s"] + SLOW <= summary["wall_s"]
    assert trainer.meter.loop_end < slow_shutdown[0] - SLOW


def test_a_signal_stops_last_window_leaves_the_loaders_shutdown_out(tmp_path, dataset, slow_shutdown, monkeypatch):
    """A SIGTERM during step 8 (a logging step): its window, queued at 8, was read after the loader stopped."""
    original = Trainer._stop_requested

    def stop_requested(self, stop):
        if self.pos.step == 8 and stop.signum is None:
            stop.signum = signal.SIGTERM
        return original(self, stop)

    monkeypatch.setattr(Trainer, "_stop_requested", stop_requested)
    cfg = config(tmp_path, dataset, "signal")
    with pytest.raises(TrainingStopped):
        train(cfg)
    seconds = window_seconds(tmp_path / "tb" / "signal", {4: BATCH, 8: 4 * BATCH})
    assert seconds[8] < SLOW / 2, seconds


def test_a_short_early_stops_rate_leaves_the_loaders_shutdown_out(tmp_path, dataset, slow_shutdown):
    """Early stopping at step 2, inside the warm-up: no steady window, samples_per_sec is the session's loop
    average (evaluations left out), which counted the loader's shutdown (loop_end came after it)."""
    cfg = config(tmp_path, dataset, "short", train={"eval_every": 2, "early_stopping": REACHED})
    summary = train(cfg)
    assert summary["steps"] == 2 and summary["early_stopped"]
    assert summary["samples_per_sec"] > 2 * BATCH / (SLOW / 2)
    assert summary["train_s"] + SLOW <= summary["wall_s"]


def test_a_loader_that_runs_out_logs_its_last_steps_and_leaves_its_shutdown_out(tmp_path, dataset, slow_shutdown,
                                                                               monkeypatch):
    """A training loader that yields fewer batches than its length says (7 an epoch said, 6 given): the run ends at
    step 6, off the logging grid (4). The steps 5-6 were queued by no logging step: their loss was in no log line,
    TensorBoard point or final_train_loss (the window at 4's), and the loop's clock ran through the loader's shutdown.
    Now they are the run's last window, the end is said, and the shutdown is left out."""
    from loguru import logger

    length = ParquetLoader.__len__
    monkeypatch.setattr(ParquetLoader, "__len__", lambda self: length(self) + (1 if self.chain_epochs else 0))
    lines = []
    sink = logger.add(lambda m: lines.append(str(m)), level="WARNING")
    try:
        summary = train(config(tmp_path, dataset, "short_data", train={"epochs": 1}))
    finally:
        logger.remove(sink)
    assert summary["steps"] == 6 and summary["samples"] == 6 * BATCH
    assert [s for s, _ in summary["train_losses"]] == [4, 6]
    assert summary["final_train_loss"] == summary["train_losses"][-1][1]
    run_dir = tmp_path / "tb" / "short_data"
    assert sorted(scalars(run_dir, "train/loss")) == [4, 6]
    assert window_seconds(run_dir, {6: 2 * BATCH})[6] < SLOW / 2
    assert summary["train_s"] + SLOW <= summary["wall_s"]
    assert any("training loader ended at step 6" in line and "7 steps" in line for line in lines), lines


def test_a_checkpoints_weight_check_is_left_out_of_the_throughput_window(tmp_path, dataset, monkeypatch, clock):
    """A checkpoint step scans every weight for NaN/Inf before saving (`nonfinite_weight`: a read of every table, and
    an all-reduce with several ranks); it ran outside `meter.paused()`, so the window after a checkpoint counted it as
    training. Made slow here (SLOW a call): the window 5-6, after the checkpoint at 4, must not hold it."""
    from dlrm.train import windows

    original = windows.nonfinite_weight

    def slow_check(model, env):
        clock(SLOW)
        return original(model, env)

    monkeypatch.setattr(windows, "nonfinite_weight", slow_check)
    summary = train(config(tmp_path, dataset, "ckpt", train={"epochs": 1}, checkpoint={"every": 4}))
    assert summary["steps"] == 6
    seconds = window_seconds(tmp_path / "tb" / "ckpt", {4: BATCH, 6: 2 * BATCH})
    assert seconds[6] < SLOW / 2, seconds


def test_a_profilers_trace_save_is_left_out_of_the_throughput_window(tmp_path, dataset, monkeypatch, clock):
    """--profile: the step after the recorded ones saves the trace (a gzip JSON file: 1 s for this tiny CPU model,
    seconds for a GPU run's kernels) inside the training loop, outside `meter.paused()`: that logging window's
    samples/s point, and summary.json's samples_per_sec, counted it as training. Made slow here (SLOW): every second
    step is recorded and saved (profile.repeat 0), so every window after the warm-up holds profiled steps, which get
    no samples/s point of their own (audit profile67); summary.json's rate is theirs, without the saves."""
    from dlrm.train import profiling

    real = profiling.trace_handler

    def slow_handler(*args, **kwargs):
        handler = real(*args, **kwargs)

        def save(prof):
            clock(SLOW)
            return handler(prof)
        return save

    monkeypatch.setattr(profiling, "trace_handler", slow_handler)
    cfg = config(tmp_path, dataset, "prof", train={"epochs": 2},
                 profile={"enabled": True, "wait": 0, "warmup": 1, "active": 1, "repeat": 0})
    summary = train(cfg)
    assert summary["steps"] == 12
    assert list((tmp_path / "tb" / "prof").glob("*.pt.trace.json.gz")), "the trace was saved"
    events = EventAccumulator(str(tmp_path / "tb" / "prof"))
    events.Reload()
    assert "train/samples_per_sec" not in events.Tags()["scalars"]  # every window held profiled steps
    # windows 5-8 and 9-12: 128 samples, 4 saves of SLOW seconds among them (counted: under 128 / (4 SLOW))
    assert summary["samples_per_sec"] > 128 / SLOW, summary["samples_per_sec"]
