"""A run lock held for a moment under no live holder's name is waited for, not refused (`dlrm.file_lock`).

`dlrm.train.run_dir.lock_holder` probes a run directory's lock by taking it for a moment (a refusal's advice, a
sweep's --resume). A run that tried to take that lock just then was refused as "in use by" the line of the run that
had last held it, a process long gone. The probe here is a real flock held on another open file description, released
by the taker's first wait: no timing involved.
"""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import sys

import pytest

from dlrm import file_lock
from dlrm.errors import ConfigError
from dlrm.train.run_dir import LOCK_NAME, RunLock, lock_holder


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _probe(lock: os.PathLike) -> int:
    """A prober's hold: the file's lock taken on a descriptor of its own, nothing written (as `lock_holder`)."""
    fd = os.open(lock, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


@pytest.fixture
def waits(monkeypatch):
    """The taker's waits, counted; the first releases the `held` descriptors (the prober's moment ends)."""
    held: list[int] = []
    count = []

    def sleep(seconds):
        count.append(seconds)
        while held:
            os.close(held.pop())

    monkeypatch.setattr(file_lock, "_pause", sleep)
    return held, count


@pytest.mark.parametrize("line", ["dead", "empty"])
def test_run_lock_taken_after_a_probe_of_a_stale_or_empty_lock(tmp_path, waits, line):
    held, count = waits
    lock = tmp_path / LOCK_NAME
    stale = f"pid {_dead_pid()} on {socket.gethostname()} since 2026-12-01 10:00:00\n"
    lock.write_text(stale if line == "dead" else "")
    held.append(_probe(lock))
    run = RunLock.acquire(tmp_path)  # before the fix: ConfigError "in use by pid <dead> ..."
    try:
        assert count, "the taker never waited: the probe was not in its way"
        assert lock.read_text().startswith(f"pid {os.getpid()} on ")
    finally:
        run.release()


def test_live_holder_refused_without_waiting(tmp_path, waits):
    _, count = waits
    holder = RunLock.acquire(tmp_path)  # names this (live) process
    try:
        with pytest.raises(ConfigError, match=f"in use by pid {os.getpid()} on "):
            RunLock.acquire(tmp_path)
        assert lock_holder(tmp_path).startswith(f"pid {os.getpid()} on ")
        assert count == []
    finally:
        holder.release()


def test_holder_of_another_host_refused_without_waiting(tmp_path, waits):
    held, count = waits
    lock = tmp_path / LOCK_NAME
    lock.write_text("pid 1 on some-other-host since 2026-12-01 10:00:00\n")  # a shared disk: its liveness unknown
    fd = _probe(lock)
    try:
        with pytest.raises(ConfigError, match="in use by pid 1 on some-other-host"):
            RunLock.acquire(tmp_path)
        assert count == []
    finally:
        os.close(fd)


def test_unnamed_hold_that_lasts_is_refused_after_the_wait(tmp_path, monkeypatch):
    """A holder that never names itself (a forked child keeping a dead run's descriptor) is still refused, once the
    wait is over, naming the line the file holds."""
    lock = tmp_path / LOCK_NAME
    dead = _dead_pid()
    lock.write_text(f"pid {dead} on {socket.gethostname()}\n")
    clock = iter(range(0, 100))
    monkeypatch.setattr(file_lock, "_clock", lambda: float(next(clock)) * file_lock.UNNAMED_HOLD_WAIT_S / 4)
    monkeypatch.setattr(file_lock, "_pause", lambda s: None)
    fd = _probe(lock)
    try:
        with pytest.raises(ConfigError, match=f"in use by pid {dead} on "):
            RunLock.acquire(tmp_path)
    finally:
        os.close(fd)
