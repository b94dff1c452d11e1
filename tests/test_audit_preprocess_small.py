"""Audit tests of ``python -m dlrm.preprocess``: small defects an earlier QA pass found and left (the split rule's log
line, a test split of one class, the worker pool of a resumed run) and ones found while fixing them (the plural of
"worker process").

Each test failed on the code before its fix (the failure is quoted in its docstring)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from loguru import logger

from dlrm.data import preprocess as pp
from tests.test_audit_rawprep75 import log_messages, recorded_pool_sizes
from tests.test_preprocess import assert_same_dataset, error_lines, make_fields, run_cli, write_raw
from tests.test_preprocess_cli_errors import assert_one_line_error

# -- 1. the split rule is logged with thousands separators; metadata.json keeps plain integers ----------------------


@pytest.mark.parametrize("split, logged, recorded", [
    ("sequential",
     "sequential over 1,200 lines: [0, 1,029) train, [1,029, 1,115) test, [1,115, 1,200) validation",
     "sequential over 1200 lines: [0, 1029) train, [1029, 1115) test, [1115, 1200) validation"),
    ("days",
     "days: files 0..0 train; file 1: first 1,050 lines test, the rest validation",
     "days: files 0..0 train; file 1: first 1050 lines test, the rest validation"),
])
def test_the_split_rule_is_logged_with_thousands_separators(tmp_path, split, logged, recorded):
    """The log said "split: sequential over 1200 lines: [0, 1029) train, ..." where the count pass above it said
    "1,200 data lines" and the summary "1,029" rows. The logged line now has separators; ``metadata.extra.split_rule``
    keeps the text it always had (a record: a comma inside a number would make "[1,029, 1,115)" ambiguous to a
    script reading it, and no code of this project reads it)."""
    if split == "days":
        inputs = [write_raw(tmp_path / "day_0", make_fields(100, seed=1)),
                  write_raw(tmp_path / "day_1", make_fields(2_099, seed=2))]
    else:
        inputs = [write_raw(tmp_path / "in.tsv", make_fields(1_200, seed=1))]
    messages, handle = log_messages()
    try:
        pp.preprocess(inputs, tmp_path / "ds", split=split, workers=1, progress=False)
    finally:
        logger.remove(handle)
    assert f"split: {logged}" in messages  # (f"split: {recorded}" before the fix)
    meta = json.loads((tmp_path / "ds" / "metadata.json").read_text())
    assert meta["extra"]["split_rule"] == recorded


# -- 2. a test split of one class is warned about, as a validation split of one class is -----------------------------


def test_a_test_split_of_one_class_is_warned_about(tmp_path):
    """A test split whose rows were all labelled 1 was said only as "100.00%" in the summary table, where a one-class
    validation split got a warning: train.py evaluating it (``--split test``, data.eval_split "test") has no AUC
    either. Before the fix the warnings here were []."""
    rows = make_fields(100, seed=9)  # --split sequential: lines 86-92 test, 93-99 validation
    for i, row in enumerate(rows):
        row[0] = "1" if 86 <= i < 93 else str(i % 2)
    src = write_raw(tmp_path / "in.tsv", rows)
    warnings, handle = log_messages("WARNING")
    try:
        meta = pp.preprocess([src], tmp_path / "ds", workers=1, progress=False)
        assert (meta.splits["test"].rows, meta.splits["test"].positives) == (7, 7)
        assert 0 < meta.splits["validation"].positives < meta.splits["validation"].rows
        assert warnings == [("the test split holds one class only: its 7 rows are all labelled 1 (positive), so its "
                             "AUC is undefined (train.py evaluating it, with --split test or data.eval_split 'test', "
                             "picks best.pt by logloss and refuses train.early_stopping.metric 'auc'); give more "
                             "lines")]

        # a random split: the advice adds --seed, as the validation split's does; a test split of no rows: no warning
        warnings.clear()
        src = write_raw(tmp_path / "zeros.tsv", [["0", *row[1:]] for row in rows[:40]])
        meta = pp.preprocess([src], tmp_path / "random", split="random", test_fraction=0.1, validation_fraction=0.0,
                             seed=3, workers=1, progress=False)
        assert meta.splits["test"].rows > 1 and meta.splits["test"].positives == 0
        assert [w for w in warnings if w.startswith("the test split")] == [(
            f"the test split holds one class only: its {meta.splits['test'].rows} rows are all labelled 0 (negative), "
            "so its AUC is undefined (train.py evaluating it, with --split test or data.eval_split 'test', picks "
            "best.pt by logloss and refuses train.early_stopping.metric 'auc'); give more lines or another --seed")]
    finally:
        logger.remove(handle)


# -- 3. "worker processes", not "worker processs" -------------------------------------------------------------------


def test_the_pool_size_line_says_processes(tmp_path, monkeypatch):
    """A fresh run of 3 chunks with --workers 50 logged "3 worker processs (not 50): the run has only 3 chunks"
    (`counted` adds an "s" to any noun)."""
    src = write_raw(tmp_path / "in.tsv", make_fields(120, seed=1))
    sizes = recorded_pool_sizes(monkeypatch)
    messages, handle = log_messages()
    try:
        pp.preprocess([src], tmp_path / "ds", workers=50, chunk_rows=40, progress=False)
    finally:
        logger.remove(handle)
    assert sizes == [3]
    assert "3 worker processes (not 50): the run has only 3 chunks" in messages


# -- 4. a resumed run's pool is sized to the chunks left to do ------------------------------------------------------


def test_a_resumed_run_gets_a_pool_sized_to_the_chunks_left(tmp_path, monkeypatch):
    """A resume with 3 of 12 chunks left (and 1 train shard whose statistics the checkpoint lacks) asked `start_pool`
    for 12 workers of --workers 50 (all the run's chunks: [12] before the fix), each a process importing numpy and
    pyarrow, for 3 chunks. It gets 3, logs why, and ends with the dataset of an uninterrupted run."""
    src = write_raw(tmp_path / "in.tsv", make_fields(120, seed=4))
    out = tmp_path / "ds"
    with pytest.raises(pp._Interrupted):  # (the test hook that stands for a kill after 9 chunks)
        # in this process, so that the 9 chunks are the first 9 and the checkpoint (every chunk) covers the first 8
        pp.preprocess([src], out, chunk_rows=10, workers=1, checkpoint_interval=0, progress=False, _max_new_chunks=9)
    sizes = recorded_pool_sizes(monkeypatch)
    messages, handle = log_messages()
    try:
        pp.preprocess([src], out, chunk_rows=10, workers=50, progress=False)
    finally:
        logger.remove(handle)
    assert "9 chunk(s) already done; re-reading table statistics of 1 of them" in messages
    assert sizes == [3]
    assert ("3 worker processes (not 50): the resumed run has only 3 chunks left to do (of 12) and 1 train shard to "
            "re-read") in messages
    assert "3 chunk(s) of up to 10 lines to do (3 workers)" in messages
    pp.preprocess([src], tmp_path / "ref", chunk_rows=10, workers=1, progress=False)
    assert_same_dataset(out, tmp_path / "ref")


def test_a_resume_with_more_shards_to_re_read_than_chunks_left_gets_a_pool_for_them(tmp_path, monkeypatch):
    """Without a checkpoint the resume re-reads every finished chunk's train shard in the pool: 9 shards and 3 chunks
    left get min(--workers, 9) workers, not 3."""
    src = write_raw(tmp_path / "in.tsv", make_fields(120, seed=4))
    out = tmp_path / "ds"
    with pytest.raises(pp._Interrupted):
        pp.preprocess([src], out, chunk_rows=10, workers=1, progress=False, _max_new_chunks=9)
    sizes = recorded_pool_sizes(monkeypatch)
    messages, handle = log_messages()
    try:
        pp.preprocess([src], out, chunk_rows=10, workers=50, progress=False)
    finally:
        logger.remove(handle)
    assert sizes == [9]
    assert ("9 worker processes (not 50): the resumed run has only 3 chunks left to do (of 12) and 9 train shards to "
            "re-read") in messages
    pp.preprocess([src], tmp_path / "ref", chunk_rows=10, workers=1, progress=False)
    assert_same_dataset(out, tmp_path / "ref")


# -- 5. a full disk's error names the file being written; a failure writing the vocabularies or metadata says how
#       to resume -----------------------------------------------------------------------------------------------------


def _fail_fsync_of(monkeypatch, part: str) -> None:
    """Make the fsync of a file whose path holds `part` fail as a full disk does (a write's error names no file)."""
    real = os.fsync

    def fsync(fd):
        if part in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.parametrize("part, written, kept", [
    (".part-0000-000000.parquet.", "train/part-0000-000000.parquet", False),
    (".manifest.json.", "_progress/manifest.json", False),
    ("done.jsonl", "_progress/done.jsonl", False),
    (".stats.npz.", "_progress/stats.npz", True),
    (".SPARSE_3.npy.", "vocab/SPARSE_3.npy", True),
    (".metadata.json.", "metadata.json", True),
])
def test_a_full_disk_names_the_file_written(tmp_path, monkeypatch, part, written, kept):
    """The error of a full disk said "error: [Errno 28] No space left on device" without a path, whichever file it
    was writing (a shard, a progress record, a vocabulary, metadata.json): the exception's filename was None before
    the fix. A failure after every chunk finished (the vocabularies, metadata.json) also says that the chunks are kept
    and how to resume, as a failure between chunks does; the same command then ends with the dataset of a run that
    never failed, and says that no chunk is left to do (it said "0 chunk(s) of up to 262,144 lines to do (1
    worker)")."""
    src = write_raw(tmp_path / "in.tsv", make_fields(120, seed=5))
    out = tmp_path / "ds"
    kw = dict(hashing="vocabulary", workers=1, checkpoint_interval=0, progress=False)
    _fail_fsync_of(monkeypatch, part)
    warnings, handle = log_messages("WARNING")
    try:
        with pytest.raises(OSError) as info:
            pp.preprocess([src], out, **kw)
    finally:
        logger.remove(handle)
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(out / written)
    assert any(w.startswith(f"1 finished chunk(s) kept in {out} (no metadata.json") for w in warnings) == kept
    monkeypatch.undo()
    messages, handle = log_messages()
    try:
        pp.preprocess([src], out, **kw)
    finally:
        logger.remove(handle)
    # every chunk done before the failure: said so, not "0 chunk(s) of up to 262,144 lines to do (1 worker)"
    assert ("no chunk left to do (1 chunk done)" in messages) == kept
    pp.preprocess([src], tmp_path / "ref", **kw)
    assert_same_dataset(out, tmp_path / "ref")


def test_a_full_disk_is_one_line_naming_the_shard(tmp_path, monkeypatch):
    """The same through the command line: the one error line said "error: [Errno 28] No space left on device"."""
    src = write_raw(tmp_path / "in.tsv", make_fields(120, seed=5))
    out = tmp_path / "ds"
    _fail_fsync_of(monkeypatch, ".part-0000-000000.parquet.")
    r = run_cli(["-i", str(src), "-o", str(out), "--workers", "1"])
    assert_one_line_error(r, f"error: [Errno {errno.ENOSPC}] No space left on device: "
                             f"'{out / 'train' / 'part-0000-000000.parquet'}'")
    assert not out.exists()  # no chunk finished: nothing left


# -- 6. --on-bad-line skip with no good line names the first bad line -----------------------------------------------


def test_no_good_line_in_skip_mode_names_the_first_bad_line(tmp_path):
    """``--format csv`` given for a TSV file with ``--on-bad-line skip`` ended "error: no rows to write: not one good
    line in the 1 input file(s) (120 bad line(s) or file(s) skipped)", the reason nowhere: --on-bad-line stop names
    the first bad line with its advice (a TSV file? give --format tsv). Now the skip mode's line names it too; a
    file skipped whole (an empty one) is named by its warning, as before."""
    src = write_raw(tmp_path / "in.tsv", make_fields(120, seed=7))
    r = run_cli(["-i", str(src), "-o", str(tmp_path / "ds"), "--format", "csv", "--on-bad-line", "skip"])
    assert_one_line_error(r, "error: no rows to write: not one good line in the 1 input file(s) (120 bad line(s) or "
                             f"file(s) skipped); the first: {src}:1: expected 40 fields separated by ',', found ",
                          "a TSV file? give --format tsv or auto)")
    assert not (tmp_path / "ds").exists()
    empty = tmp_path / "empty.tsv"
    empty.write_bytes(b"")
    r = run_cli(["-i", str(empty), "-o", str(tmp_path / "ds"), "--on-bad-line", "skip"])
    assert error_lines(r) == ["error: no rows to write: not one good line in the 1 input file(s) (1 bad line(s) or "
                              "file(s) skipped)"]


# -- 7. an output on a read-only file system is said to be one ------------------------------------------------------


@pytest.mark.parametrize("given", ["new", "existing"])
def test_an_output_on_a_read_only_file_system_is_named_so(tmp_path, monkeypatch, given):
    """An --output on a file system mounted read-only was "not writable (no write permission on /mnt)": a chmod then
    changed nothing (root writes anywhere, so both calls are faked here; checked for real on a read-only bind mount).
    Nothing is read or written before the line."""
    src = write_raw(tmp_path / "in.tsv", make_fields(20, seed=1))
    mount = tmp_path / "mnt"
    mount.mkdir()
    real_access, real_statvfs = os.access, os.statvfs

    def access(path, mode, *args, **kwargs):
        if Path(path) == mount and mode & os.W_OK:
            return False
        return real_access(path, mode, *args, **kwargs)

    def statvfs(path):
        result = real_statvfs(path)
        if Path(path) != mount:
            return result
        return os.statvfs_result((*result[:8], result.f_flag | os.ST_RDONLY, result.f_namemax))

    monkeypatch.setattr(os, "access", access)
    monkeypatch.setattr(os, "statvfs", statvfs)
    out = mount / "ds" if given == "new" else mount
    what = f"({mount} is on a read-only file system)" if given == "new" else "(a read-only file system)"
    assert_one_line_error(run_cli(["-i", str(src), "-o", str(out)]), f"error: {out}: not writable {what}")
    assert list(mount.iterdir()) == []
