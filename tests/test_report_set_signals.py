"""A report written as a set (`dlrm.checkpoint.write_files_atomic`: --compare's, a sweep's) is all new or all old
when a Ctrl-C or SIGTERM arrives while it is published: the files were renamed into place one by one, and a signal
between two renames stopped there, leaving the new first file beside the older others."""

from __future__ import annotations

import os
import signal

import pytest

from dlrm.checkpoint import write_files_atomic


class Stopped(Exception):
    pass


@pytest.fixture
def sigterm_raises():
    def handler(signum, frame):
        raise Stopped(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_a_signal_while_a_set_is_renamed_leaves_the_whole_new_set(tmp_path, monkeypatch, sigterm_raises):
    write_files_atomic(tmp_path, {"a.csv": "old a", "b.md": "old b", "c.md": "old c"})
    real_replace, renamed = os.replace, []

    def replace_then_signal(src, dst):
        real_replace(src, dst)
        renamed.append(os.path.basename(dst))
        if len(renamed) == 1:  # the signal arrives right after the first file is in place
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(os, "replace", replace_then_signal)
    with pytest.raises(Stopped):  # the signal still acts, once the set is published
        write_files_atomic(tmp_path, {"a.csv": "new a", "b.md": "new b", "c.md": "new c"})
    assert renamed == ["a.csv", "b.md", "c.md"]
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {"a.csv": "new a", "b.md": "new b", "c.md": "new c"}


def test_the_handlers_are_back_after_the_set(tmp_path, sigterm_raises):
    before = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    write_files_atomic(tmp_path, {"a.csv": "a"})
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    with pytest.raises(Stopped):  # and act at once again
        os.kill(os.getpid(), signal.SIGTERM)
