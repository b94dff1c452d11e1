"""tests/shared_once.py: a fixture's directory made once per test run, shared by the pytest-xdist workers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.shared_once import computed_once


def test_made_once_then_read(tmp_path_factory):
    calls = []

    def make(d: Path) -> None:
        calls.append(d)
        (d / "out.txt").write_text("made")

    first = computed_once(tmp_path_factory, f"t-once-{os.getpid()}", make)
    again = computed_once(tmp_path_factory, f"t-once-{os.getpid()}", make)
    assert first == again and len(calls) == 1 and (first / "out.txt").read_text() == "made"


def test_a_failed_make_is_started_over_from_an_empty_directory(tmp_path_factory):
    key = f"t-fail-{os.getpid()}"

    def broken(d: Path) -> None:
        (d / "half.txt").write_text("half")
        raise RuntimeError("make failed")

    with pytest.raises(RuntimeError, match="make failed"):
        computed_once(tmp_path_factory, key, broken)
    seen = []
    done = computed_once(tmp_path_factory, key, lambda d: seen.append(sorted(p.name for p in d.iterdir())))
    assert seen == [[]] and done.is_dir()  # the half-made file is gone before the second make


def test_the_root_is_shared_by_the_workers_of_one_run(tmp_path_factory, monkeypatch):
    base = tmp_path_factory.getbasetemp()
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw7")
    key = f"t-root-{os.getpid()}"
    assert computed_once(tmp_path_factory, key, lambda d: None).parent == base.parent
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    assert computed_once(tmp_path_factory, key, lambda d: None).parent == base
