"""Audit tests of ``python -m dlrm.preprocess`` on raw logs (QA pass 75): the worker pool's size, CR-only line
endings, the count pass's numbers, empty ``--output`` paths of the other data tools, --min-frequency auto's record
under a random split, a validation split of one class.

Each test failed on the code before its fix (the failure is quoted in its docstring)."""

from __future__ import annotations

import pytest
from loguru import logger

from dlrm.data import preprocess as pp
from dlrm.data.preprocess import run as run_mod
from dlrm.data.schema import read_metadata
from tests.test_preprocess import assert_same_dataset, make_fields, write_raw


def log_messages(level: str = "INFO") -> tuple[list[str], int]:
    """A list that receives loguru's messages from ``level`` up, and the handle to remove its sink."""
    messages: list[str] = []
    return messages, logger.add(lambda m: messages.append(m.record["message"]), level=level)


def recorded_pool_sizes(monkeypatch) -> list[int]:
    """The sizes the run asks `start_pool` for; the pools started have at most 2 processes (this machine's cores), so
    that a run asking for 50 stays fast."""
    sizes: list[int] = []
    real = run_mod.start_pool

    def start_pool(workers, *args, **kwargs):
        sizes.append(workers)
        return real(min(workers, 2), *args, **kwargs)

    monkeypatch.setattr(run_mod, "start_pool", start_pool)
    return sizes


# -- 1. the pool never has more workers than the run has chunks ------------------------------------------------------


def test_the_pool_has_no_more_workers_than_chunks(tmp_path, monkeypatch):
    """``--workers 500`` on a one-chunk file started all 500 processes before the count pass (143.6 s on 2 cores for
    1.5 s of work): `start_pool` was asked for 50 here, not 1. One chunk gets one worker process; the number used is
    logged when it is not the one asked for, and the dataset is the one of a single-process run."""
    src = write_raw(tmp_path / "in.tsv", make_fields(120, seed=1))
    sizes = recorded_pool_sizes(monkeypatch)
    messages, handle = log_messages()
    try:
        pp.preprocess([src], tmp_path / "one", workers=50, progress=False)  # 120 lines: one chunk
    finally:
        logger.remove(handle)
    assert sizes == [1]  # ([50] before the fix)
    assert "1 worker process (not 50): the run has only 1 chunk" in messages
    assert "1 chunk(s) of up to 262144 lines to do (1 worker)" in messages
    pp.preprocess([src], tmp_path / "ref", workers=1, progress=False)
    assert_same_dataset(tmp_path / "one", tmp_path / "ref")

    sizes.clear()
    pp.preprocess([src], tmp_path / "three", workers=50, chunk_rows=40, progress=False)  # 3 chunks
    assert sizes == [3]
    sizes.clear()
    pp.preprocess([src], tmp_path / "enough", workers=2, chunk_rows=40, progress=False)  # as many as asked: as before
    assert sizes == [2]


def test_a_count_pass_of_several_files_gets_a_pool_of_one_worker_a_file(tmp_path, monkeypatch):
    """Several inputs are counted one file a worker: the count pass gets min(--workers, files) workers, and the chunks
    then min(--workers, chunks) (a new pool where that differs). Before the fix: one pool of 50 for both."""
    a = write_raw(tmp_path / "a.tsv", make_fields(100, seed=2))
    b = write_raw(tmp_path / "b.tsv", make_fields(100, seed=3))
    sizes = recorded_pool_sizes(monkeypatch)
    pp.preprocess([a, b], tmp_path / "ds", workers=50, chunk_rows=25, progress=False)  # 2 files, 8 chunks
    assert sizes == [2, 8]  # ([50] before the fix)
    pp.preprocess([a, b], tmp_path / "ref", workers=1, chunk_rows=25, progress=False)
    assert_same_dataset(tmp_path / "ds", tmp_path / "ref")
    sizes.clear()
    pp.preprocess([a, b], tmp_path / "two", workers=50, progress=False)  # 2 files, 2 chunks: the count pass's pool
    assert sizes == [2]
