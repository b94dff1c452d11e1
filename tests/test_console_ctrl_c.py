"""Ctrl-C pressed on a real (pseudo-)terminal during training: the terminal echoes `^C` where the cursor is (the end of
the training bar's line), and the screen keeps no stale copy of the bar.

The screen is rebuilt from the bytes the terminal's master side read (the program's output and the line discipline's
own echo, in the order a terminal shows them), with a terminal's line wrapping at its width."""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time

import pytest

from dlrm.logging_setup import ProgressBar
from tests.conftest import CHILD_ENV, REPO, make_dataset

COLUMNS, ROWS = 160, 40  # wider than the SIGINT warning: what it does not cover of the bar's line shows


def wrapped_screen(text: str, columns: int) -> list[str]:
    """The lines a terminal `columns` wide shows for `text`: newline (next line, column 0: onlcr), `\\r`, cursor-up,
    erase-line; colours dropped; a character written past the last column wraps to the next line first (a VT100's
    pending wrap: the cursor rests on the last column after filling it, and `\\r` there stays on the same line)."""
    lines: list[list[str]] = [[]]
    row = col = 0
    for token in re.findall(r"\x1b\[[0-9;]*[A-Za-z]|.", re.sub(r"\x1b\[[0-9;]*m", "", text), re.S):
        if token == "\n":
            row, col = row + 1, 0
        elif token == "\r":
            col = 0
        elif token == "\x1b[A":
            row = max(row - 1, 0)
        elif token == "\x1b[2K":
            lines[row] = []
        elif not token.startswith("\x1b"):
            if col == columns:  # the pending wrap
                row, col = row + 1, 0
            while len(lines) <= row:
                lines.append([])
            line = lines[row]
            line.extend(" " * (col - len(line) + 1))
            line[col] = token
            col += 1
        while len(lines) <= row:
            lines.append([])
    shown = ["".join(line).rstrip() for line in lines]
    while shown and not shown[-1]:
        shown.pop()
    return shown


def test_wrapped_screen_wraps_at_the_width_and_keeps_the_pending_wrap():
    assert wrapped_screen("abcd\rxy", 4) == ["xycd"]  # filled to the last column, `\r` stays on the line
    assert wrapped_screen("abcd^C\n", 4) == ["abcd", "^C"]
    assert wrapped_screen("abc^C", 4) == ["abc^", "C"]
    assert wrapped_screen("ab^C\r\x1b[2Kok\n", 4) == ["ok"]


def test_a_bar_leaves_two_columns_of_a_terminal_free(monkeypatch):
    """tqdm's own width is the terminal's less one column; ProgressBar's leaves one more, for the 2 characters of
    `^C`: the cursor then rests on the last column and the next `\\r` (the bar's redraw, a record's clearing) is on the
    bar's line. In a file there is no width, and none is made up."""

    class Terminal:
        def __init__(self):
            self.text = ""

        def write(self, s):
            self.text += s

        def flush(self):
            pass

        def isatty(self):
            return True

        def fileno(self):
            return 99

    monkeypatch.setattr(os, "get_terminal_size", lambda fd=None: os.terminal_size((57, 20)))
    out = Terminal()
    with ProgressBar(total=10, desc="train", file=out, dynamic_ncols=True, mininterval=0) as bar:
        bar.update(3)
    assert wrapped_screen(out.text, 57) == [re.split(r"[\r\n]", out.text.rstrip("\n"))[-1]]  # one line, not wrapped
    assert max(len(line) for line in re.split(r"[\r\n]", out.text)) == 57 - 2, repr(out.text)

    class File(Terminal):
        def isatty(self):
            return False

        def fileno(self):
            raise OSError("not a terminal")

    def no_terminal(fd=None):
        raise OSError("not a terminal")

    monkeypatch.setattr(os, "get_terminal_size", no_terminal)
    out = File()
    with ProgressBar(total=10, desc="train", file=out, dynamic_ncols=True, mininterval=0) as bar:
        bar.update(3)
        assert bar.format_dict["ncols"] is None  # tqdm's own fixed bar, not a width made up
    assert "3/10" in out.text, repr(out.text)


@pytest.mark.slow
def test_ctrl_c_on_a_terminal_leaves_no_stale_bar(tmp_path):
    """`train.py` on a pseudo-terminal of 160 columns, Ctrl-C typed into it while the training bar is drawn: the
    terminal echoes `^C` after the bar. A bar as wide as tqdm draws it (the width less one column) put `^` in the last
    column and wrapped `C` to the next line; the bar's next redraw and the SIGINT warning went there, and the bar's
    half of the line stayed on the screen for good, above the warning. Now one bar is on the screen, and no `^C`."""
    make_dataset(tmp_path / "ds", {"train": 60000, "validation": 40}, files_per_split=1, row_group_size=4096)
    cfg = {"data": {"path": str(tmp_path / "ds"), "batch_size": 4},
           "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
           "train": {"epochs": 1, "log_every": 50, "device": "cpu", "seed": 0, "baseline": False},
           "log": {"tb_dir": str(tmp_path / "tb")}}
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    env = {k: v for k, v in CHILD_ENV.items() if k not in ("NO_COLOR",)}
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLUMNS, 0, 0))

    def controlling_terminal():  # (in the child, after setsid) the pty: Ctrl-C's SIGINT reaches its foreground group
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    chunks: list[bytes] = []
    sent = False
    try:
        proc = subprocess.Popen([sys.executable, str(REPO / "train.py"), "--config", str(tmp_path / "c.json"),
                                 "--run-name", "c"], cwd=tmp_path, env=env, stdin=slave, stdout=slave, stderr=slave,
                                start_new_session=True, preexec_fn=controlling_terminal)
        os.close(slave)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer gone, everything read
                break
            if not chunk:
                break
            chunks.append(chunk)
            # the bar drawn at least a few times past its first step: Ctrl-C, typed into the terminal
            if not sent and len(re.findall(rb"train: +\d+%\|", b"".join(chunks))) > 20:
                os.write(master, b"\x03")
                sent = True
        rc = proc.wait(timeout=120)
    finally:
        os.close(master)
    text = b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")
    shown = wrapped_screen(text, COLUMNS)
    assert sent and "^C" in text, "\n".join(shown)
    assert rc != 0 and any("SIGINT" in line for line in shown), (rc, "\n".join(shown))
    bars = [line for line in shown if "train:" in line]
    assert len(bars) == 1, "\n".join(shown)
    assert not any("^" in line or line == "C" or line.startswith("C ") for line in shown), "\n".join(shown)
