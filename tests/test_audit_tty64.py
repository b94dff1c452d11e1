"""Audit of the console on a terminal (a pseudo-terminal, its screen rebuilt from what was written to it): a record
written while the evaluation bar is open under the training bar, the profiler's own lines (kineto's, written to fd 2
by C++ behind the console) and a Python warning beside the training bar."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import warnings

import pytest
from tqdm import tqdm

from dlrm.logging_setup import ConsoleStream, RecordSink, configure_logging
from tests.conftest import CHILD_ENV, REPO, make_dataset
from tests.test_console_ctrl_c import wrapped_screen

RECORD = re.compile(r"\d\d:\d\d:\d\d (INFO|WARNING|ERROR) ")


@pytest.fixture(autouse=True)
def _restore_logging():
    yield
    configure_logging()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def screen(text: str) -> list[str]:
    """The lines a terminal shows for `text` (newline: next line, column 0, as a terminal with onlcr; `\\r`, cursor-up,
    erase-line; colours dropped), trailing blanks stripped: enough of a terminal for tqdm's and loguru's output."""
    return wrapped_screen(text, sys.maxsize)  # (no width: nothing wraps)


def test_screen_helper():
    assert screen("a\rb\nccc\x1b[Ad\n\x1b[32me\x1b[0m\n\x1b[2Kf\n") == ["b  d", "ecc", "f"]


# -- (1) a record while the evaluation bar is open: an empty line above it -----------------------------------------


def test_a_record_while_two_bars_are_open_leaves_no_empty_line():
    """The evaluation bar is drawn under the training bar (position 1; tqdm reaches it with a newline and comes back
    with the cursor-up code). A record then (Ctrl-C's "SIGINT: finishing the current step ...", a warning) cleared both
    bars, which leaves the cursor at the start of the training bar's line, but the console took the cursor-up code
    that ended the clearing for an unfinished line and started the record with a newline: an empty line stayed on the
    screen above it."""
    console = ConsoleStream(_Terminal())
    with tqdm(total=100, desc="train", file=console, mininterval=0, ncols=60) as train:
        train.update(40)
        with tqdm(total=20, desc="eval", file=console, mininterval=0, ncols=60, leave=False) as ev:
            ev.update(5)
            RecordSink(console).write("12:00:00 WARNING SIGINT: finishing the current step\n")
            ev.update(5)
        train.update(1)
        RecordSink(console).write("12:00:01 INFO    step 41\n")
    shown = screen(console.stream.getvalue())
    assert "" not in shown, shown
    assert shown[0].startswith("12:00:00 WARNING SIGINT") and shown[1].startswith("12:00:01 INFO    step 41"), shown
    assert len(shown) == 3 and shown[2].startswith("train:") and "41/100" in shown[2], shown


# -- (2) --profile: kineto's lines glued to the training bar, a stale copy of the bar above them ---------------------


def test_profiler_lines_on_a_terminal_start_their_own_line_and_leave_no_bar_behind(tmp_path):
    """`train.py --profile` on a terminal: kineto (C++, torch's profiler) writes `USDT:... profiler_start` and
    `profiler_stop` straight to fd 2 as its trace starts and stops. They were glued to the end of the training bar's
    line (`train:   2%|█   | 6/300 [...]USDT:...`), and that half-finished copy of the bar stayed on the screen above
    them for good. Now the bars are cleared first (as for a record) and drawn again below the lines."""
    import fcntl
    import pty
    import struct
    import termios

    make_dataset(tmp_path / "ds", {"train": 400, "validation": 40})
    cfg = {"data": {"path": str(tmp_path / "ds"), "batch_size": 10},
           "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
           "train": {"epochs": 1, "log_every": 5, "device": "cpu", "seed": 0, "baseline": False},
           "profile": {"wait": 2, "warmup": 1, "active": 2},
           "log": {"tb_dir": str(tmp_path / "tb")}}
    (tmp_path / "p.json").write_text(json.dumps(cfg))
    env = {k: v for k, v in CHILD_ENV.items() if k not in ("NO_COLOR", "KINETO_LOG_LEVEL")}
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 100, 0, 0))  # 40 rows, 100 columns
    chunks = []
    try:
        proc = subprocess.Popen([sys.executable, str(REPO / "train.py"), "--config", str(tmp_path / "p.json"),
                                 "--profile", "--run-name", "p"], cwd=tmp_path, env=env,
                                stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
        os.close(slave)
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer gone, everything read
                break
            if not chunk:
                break
            chunks.append(chunk)
        rc = proc.wait(timeout=300)
    finally:
        os.close(master)
    text = b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")
    shown = screen(text)
    assert rc == 0, "\n".join(shown)
    bars = [i for i, line in enumerate(shown) if "train:" in line]
    # one bar on the screen, its last copy (40/40), nothing after it on its line; no half-drawn copy above
    assert len(bars) == 1 and "40/40" in shown[bars[0]] and shown[bars[0]].endswith("]"), "\n".join(shown)
    for line in shown:
        if "profiler_start" in line or "profiler_stop" in line:
            assert line.startswith("USDT:"), "\n".join(shown)


# -- (3) a Python warning (torch's UserWarnings, ...) during training: glued to the bar's line ------------------------


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "file"])
def test_a_python_warning_during_training_starts_its_own_line(monkeypatch, terminal):
    """`warnings.warn` (torch's UserWarnings, a library's DeprecationWarning) was written by Python after the training
    bar's text: `train:  50%|█████  | 149/300 [...]/path/x.py:5: UserWarning: ...`, the half-drawn bar left above it on
    a terminal, glued to it for good in a log file. It is a record now: the bar cleared and drawn again below it on a
    terminal, its line ended first in a file."""
    console = ConsoleStream(_Terminal() if terminal else io.StringIO())
    monkeypatch.setattr(sys, "stderr", console)
    configure_logging()
    with tqdm(total=10, desc="train", file=sys.stderr, mininterval=0, ncols=60) as bar:
        bar.update(3)
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("a library's warning", UserWarning)
        bar.update(7)
    text = console.stream.getvalue()
    if terminal:
        shown = screen(text)
        warned = [line for line in shown if "UserWarning: a library's warning" in line]
        assert len(warned) == 1 and warned[0].startswith(__file__), shown
        assert [line for line in shown if "train:" in line] == [shown[-1]] and "10/10" in shown[-1], shown
    else:
        lines = text.split("\n")
        warned = [line for line in lines if "UserWarning: a library's warning" in line]
        assert len(warned) == 1 and warned[0].startswith(__file__), repr(text)
        assert "train:" not in text.split("UserWarning")[0].split("\n")[-1], repr(text)
