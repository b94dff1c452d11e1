"""A run's ``.lock`` goes when its holder lets go of a directory marked as a run's otherwise (summary.json,
checkpoints/, a comparison's compare.md): every finished run, sweep trial, --eval-only and --compare directory kept an
empty one for good. Removed while still held, and taken only as the file ``.lock`` names after the flock
(`dlrm.file_lock.try_lock_named`), so a process that opened the old file just before the removal never holds it beside
the next taker's new one. A directory with no other mark (a run stopped before its first checkpoint) keeps it: it is
what `dlrm.data.output_dirs.is_run_directory` knows it by."""

import json
import os

import pytest

import dlrm.file_lock as file_lock
from dlrm.config import ConfigError, load_config
from dlrm.data.output_dirs import is_run_directory
from dlrm.train.run_dir import RunLock, lock_holder
from dlrm.train.trainer import train
from tests.conftest import make_dataset

BASE = {
    "data": {"batch_size": 8, "shuffle": True},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "optim": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.05}},
    "train": {"epochs": 1, "max_steps": 4, "log_every": 2, "device": "cpu", "seed": 3, "baseline": False},
    "checkpoint": {"every": 2},
}


def test_a_finished_run_leaves_no_lock_and_resumes(tmp_path):
    make_dataset(tmp_path / "ds", {"train": 64, "validation": 16})
    raw = {**BASE, "data": {**BASE["data"], "path": str(tmp_path / "ds")},
           "log": {"tb_dir": str(tmp_path / "tb"), "run_name": "r"}}
    (tmp_path / "c.json").write_text(json.dumps(raw))
    run = tmp_path / "tb" / "r"
    train(load_config(tmp_path / "c.json"))
    assert not os.path.lexists(run / ".lock") and (run / "summary.json").is_file()
    assert is_run_directory(run)  # (still known for a run's: no --tb-dir inside it)
    summary = train(load_config(tmp_path / "c.json", {"train.max_steps": 6}), resume="latest")  # takes it again
    assert summary["steps"] == 6 and not os.path.lexists(run / ".lock")


def test_a_directory_without_another_mark_keeps_its_emptied_lock(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"log": {}, "data": {}}))
    RunLock.acquire(tmp_path).release()
    assert (tmp_path / ".lock").read_text() == "" and is_run_directory(tmp_path)
    (tmp_path / "checkpoints").mkdir()  # a stopped run's
    RunLock.acquire(tmp_path).release()
    assert not os.path.lexists(tmp_path / ".lock") and is_run_directory(tmp_path)


def test_a_taker_that_opened_the_file_before_its_removal_takes_the_new_one(tmp_path, monkeypatch):
    """The holder releases (removing .lock) between a taker's open and its flock: that flock succeeds on the removed
    file; had the taker kept it, a third process would make a new .lock and hold it too (two writers of one run)."""
    (tmp_path / "summary.json").write_text("{}")
    holder = RunLock.acquire(tmp_path)
    real_open, opened = file_lock._open_lock, []

    def open_then_holder_releases(path):
        fd = real_open(path)
        opened.append(path)
        if len(opened) == 1:
            holder.release()
        return fd

    monkeypatch.setattr(file_lock, "_open_lock", open_then_holder_releases)
    taker = RunLock.acquire(tmp_path)
    monkeypatch.undo()
    try:
        assert len(opened) == 2  # the removed file, then the new one (an inode number may be reused: not compared)
        assert os.fstat(taker.fd).st_ino == os.stat(tmp_path / ".lock").st_ino
        assert lock_holder(tmp_path) is not None
        with pytest.raises(ConfigError, match=r"in use by pid \d+"):
            RunLock.acquire(tmp_path)
    finally:
        taker.release()
    assert not os.path.lexists(tmp_path / ".lock")


def test_a_release_never_removes_another_holders_file(tmp_path):
    """.lock removed by hand during a run and made again by a second process: the first one's release leaves it."""
    (tmp_path / "summary.json").write_text("{}")
    first = RunLock.acquire(tmp_path)
    (tmp_path / ".lock").unlink()
    second = RunLock.acquire(tmp_path)
    first.release()
    try:
        assert os.fstat(second.fd).st_ino == os.stat(tmp_path / ".lock").st_ino
    finally:
        second.release()
