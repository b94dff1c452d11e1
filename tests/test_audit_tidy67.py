"""Audit tidy67: small defects, each test failing before its fix.

1. `StepMeter` warned, as it was built, that a resume from an old checkpoint between two logging steps cannot rebuild
   its first logging window's loss: also in a session that trains no step (a resume of a finished run,
   ``train.max_steps`` at the checkpoint's step), which logs no window. It is said when that window is logged now.
2. A sweep directory whose sweep.json was deleted, of a version that writes one, was called "a sweep made by a version
   before 2026-11-30": its trials' config.json name the swept keys (``log.sweep_keys``, since 2026-12-01), which says
   that its version wrote a sweep.json; it is told that its sweep.json is missing now.
3. The line naming a lock's holder printed the lock file's text raw: terminal escape sequences and control characters
   written there (a run directory or dataset handed over by someone else) reached the terminal.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from loguru import logger

from dlrm import checkpoint as ckpt
from dlrm.config import ConfigError, load_config
from dlrm.errors import TrainingStopped
from dlrm.file_lock import LockHeld, try_lock
from dlrm.sweep_resume import resume_sweep
from dlrm.train.meter import RunStats, StepMeter
from dlrm.train.trainer import train
from tests.conftest import REPO, make_dataset
from tests.test_audit_resume_edges import one_hot, signal_at


class Warnings:
    """The WARNING lines logged inside the block."""

    def __enter__(self):
        self.lines = []
        self._handle = logger.add(lambda m: self.lines.append(m.record["message"]), level="WARNING")
        return self

    def __exit__(self, *exc):
        logger.remove(self._handle)

    def about_the_window(self) -> list[str]:
        return [line for line in self.lines if "since the last logging step" in line]


# ---- 1. the unrebuildable window's warning ------------------------------------------------------------------------


def test_the_window_warning_comes_when_that_window_is_logged_not_at_the_start():
    """A resume at step 6 (log_every 4) from a checkpoint without the window's losses: nothing said until the window
    that lacks them is logged (at 8), then once."""
    with Warnings() as seen:
        meter = StepMeter(torch.device("cpu"), start_step=6, stats=RunStats(), window=4)
        assert seen.about_the_window() == []  # a session that stops here logs no window: nothing to say
        for _ in range(2):
            meter.step(torch.tensor(0.5), samples=8, data_wait_s=0.0)
        meter.log_window(step=8, mean_loss=0.5)
        for _ in range(4):
            meter.step(torch.tensor(0.5), samples=8, data_wait_s=0.0)
        meter.log_window(step=12, mean_loss=0.5)
    assert seen.about_the_window() == [
        "--resume at step 6: the checkpoint holds the losses of 0 of the 2 steps since the last logging step (4; one "
        "written before 2026-11-30 holds none): the loss logged at step 8 averages only the steps from here, not "
        "train.log_every's 4 as the uninterrupted run's does"]


def test_the_window_warning_names_an_off_grid_window_as_it_is():
    """The first window logged off the grid (the run's last step, 7): named, with the uninterrupted run's 3 steps."""
    with Warnings() as seen:
        meter = StepMeter(torch.device("cpu"), start_step=6, stats=RunStats(), window=4)
        meter.step(torch.tensor(0.5), samples=8, data_wait_s=0.0)
        meter.log_window(step=7, mean_loss=0.5)
    assert seen.about_the_window() == [
        "--resume at step 6: the checkpoint holds the losses of 0 of the 2 steps since the last logging step (4; one "
        "written before 2026-11-30 holds none): the loss logged at step 7 averages only the steps from here, not the "
        "3 since it as the uninterrupted run's does"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("tidy67")
    make_dataset(root / "one", {"train": 100, "validation": 32}, row_group_size=30)
    return root


def test_a_resume_that_trains_no_step_says_nothing_of_a_window(data, tmp_path, monkeypatch):
    """End to end: an old checkpoint at step 6 (no window_losses, log_every 4) resumed with train.max_steps 6 trains
    and logs nothing: no warning of a logged loss (was: the warning of a loss "logged at step 8")."""
    over = {"train.max_steps": 12, "train.log_every": 4}
    with monkeypatch.context() as m:
        signal_at(m, 6)
        with pytest.raises(TrainingStopped):
            train(one_hot(data, tmp_path, "old", **over))
    stopped = ckpt.list_checkpoints(tmp_path / "tb" / "old")[-1]
    raw = torch.load(stopped, map_location="cpu", weights_only=True)
    assert raw["position"]["step"] == 6 and raw["run_stats"].pop("window_losses")
    torch.save(raw, stopped)  # as versions before 2026-11-30 wrote it
    with Warnings() as seen:
        summary = train(one_hot(data, tmp_path, "old", **{**over, "train.max_steps": 6}), resume="latest")
    assert summary["steps"] == 6 and seen.about_the_window() == []


# ---- 2. a sweep whose sweep.json is missing -----------------------------------------------------------------------


def _trial(sweep, sweep_keys):
    """A trial's directory with the config.json a sweep's trial records (this version's: log.sweep_keys set)."""
    trial = sweep / "00-sparse.lr=0.05" / "seed-0"
    (trial / "checkpoints").mkdir(parents=True)
    cfg = load_config(REPO / "configs" / "kaggle.json", {"log.sweep_keys": sweep_keys} if sweep_keys else {})
    (trial / "config.json").write_text(json.dumps(cfg.to_dict()))
    return trial


def test_a_sweep_whose_record_was_deleted_is_not_called_older(tmp_path):
    sweep = tmp_path / "sweep"
    _trial(sweep, ["optim.sparse.lr"])  # a sweep of this version stopped in its first trial, then sweep.json deleted
    with pytest.raises(ConfigError) as e:
        resume_sweep(sweep)
    assert str(e.value) == (f"--resume: {sweep} is a sweep whose sweep.json (its grid, written when it started) is "
                            "missing: it cannot be resumed without it; put sweep.json back, or run the sweep again "
                            "under another --run-name (its trials and report stay where they are)")


def test_a_sweep_without_the_mark_is_still_called_older(tmp_path):
    """Trials that name no swept keys (versions before 2026-12-01): the older version's message, as before."""
    sweep = tmp_path / "sweep"
    _trial(sweep, None)
    with pytest.raises(ConfigError, match="made by a version before 2026-11-30"):
        resume_sweep(sweep)


# ---- 3. the lock holder's line ------------------------------------------------------------------------------------


def test_a_lock_holders_line_reaches_the_terminal_without_escape_codes(tmp_path):
    path = tmp_path / ".lock"
    held, _ = try_lock(path)
    try:
        os.pwrite(held, b"pid 7 on host\x1b[2J\x1b[H\x1b]0;pwned\x07\r\x08 since 2026-12-02\n", 0)
        with pytest.raises(LockHeld) as e:
            try_lock(path)
        assert e.value.holder == "pid 7 on host since 2026-12-02"
    finally:
        os.close(held)
    fd, previous = try_lock(path)  # a dead holder's line, as read when taking the lock over
    os.close(fd)
    assert previous == "pid 7 on host since 2026-12-02"
