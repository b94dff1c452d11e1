"""A stopped MLPerf import resumed after a day's input files were replaced by others of the same shape: the finished
files of that day are written again from the new input (they were kept, mixing two inputs in one dataset), those of
the unchanged days are kept, and the finished dataset holds no bookkeeping file (`dlrm.data.input_stamps`)."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq

from dlrm.data import mlperf_import as mi
from dlrm.data.input_stamps import STAMPS_FILE
from dlrm.data.schema import read_metadata
from tests.test_mlperf_import import CARDS, ROWS, mlperf_dir, run, write_day  # noqa: F401 (mlperf_dir: a fixture)

ARGS = ["--train-days", "0-1", "--num-embeddings", ",".join(map(str, CARDS)), "--workers", 1, "--rows-per-file", 16]


def _same_dataset(a, b) -> None:
    assert read_metadata(a).splits == read_metadata(b).splits
    for split, info in read_metadata(a).splits.items():
        for rel in info.files:
            assert pq.read_table(a / rel).equals(pq.read_table(b / rel)), f"{split}: {rel} differs"


def test_a_day_replaced_before_the_resume_is_imported_again(mlperf_dir, tmp_path):
    src, _ = mlperf_dir
    members = dict(np.load(src / "day_1_sparse_multi_hot.npz"))
    good = members["4"][2, 1]
    members["4"][2, 1] = -5  # day 1 stops the import: day 0's three files are finished and kept
    np.savez(src / "day_1_sparse_multi_hot.npz", **members)
    out = tmp_path / "ds"
    first = run("--input", src, "--output", out, *ARGS)
    assert first.exit_code == 2 and "resumes" in first.output, first.output
    kept = sorted(mi.partial_dir(out).rglob("day-00-*.parquet"))
    assert len(kept) == 3

    write_day(src, 0, ROWS[0], np.random.default_rng(7))  # day 0 drawn again: the same shapes, other values
    members["4"][2, 1] = good  # day 1 mended (the documented repair)
    np.savez(src / "day_1_sparse_multi_hot.npz", **members)
    second = run("--input", src, "--output", out, *ARGS)
    assert second.exit_code == 0 and "day 0's input files changed" in second.output, second.output
    clean = run("--input", src, "--output", tmp_path / "clean", *ARGS)
    assert clean.exit_code == 0, clean.output
    _same_dataset(out, tmp_path / "clean")
    assert not (out / STAMPS_FILE).exists() and not (out / mi.PLAN_FILE).exists()


def test_unchanged_days_keep_their_finished_files(mlperf_dir, tmp_path):
    """Only the day whose files changed is written again: the unchanged day's finished files keep their bytes and
    times (the resume of a long import redoes no more than it must)."""
    src, _ = mlperf_dir
    members = dict(np.load(src / "day_1_sparse_multi_hot.npz"))
    good = members["4"][20, 1]
    members["4"][20, 1] = -5  # stops in day 1's second file: day 0's three files and day 1's first are finished
    np.savez(src / "day_1_sparse_multi_hot.npz", **members)
    out = tmp_path / "ds"
    assert run("--input", src, "--output", out, *ARGS).exit_code == 2
    work = mi.partial_dir(out)
    day0 = {p: p.stat().st_mtime_ns for p in work.rglob("day-00-*.parquet")}
    day1 = sorted(work.rglob("day-01-*.parquet"))
    assert len(day0) == 3 and len(day1) == 1
    members["4"][20, 1] = good
    np.savez(src / "day_1_sparse_multi_hot.npz", **members)  # day 1 mended: its finished file is written again
    second = run("--input", src, "--output", out, *ARGS)
    assert second.exit_code == 0 and "day 1's input files changed" in second.output, second.output
    assert "day 0's" not in second.output
    assert {out / p.relative_to(work): t for p, t in day0.items()} == {
        out / p.relative_to(work): (out / p.relative_to(work)).stat().st_mtime_ns for p in day0}
    assert run("--input", src, "--output", tmp_path / "clean", *ARGS).exit_code == 0
    _same_dataset(out, tmp_path / "clean")


def test_a_same_size_rewrite_with_its_mtime_restored_is_seen(mlperf_dir, tmp_path):
    """A day rewritten to the same size with its modification time set back (a copy that restores times, or a
    rewrite within a coarse file system's mtime step) still counts as changed (its status change time moved)."""
    import os

    from dlrm.data.input_stamps import file_stamp

    src, _ = mlperf_dir
    path = src / "day_0_labels.npy"
    before = file_stamp(path)
    st = os.stat(path)
    labels = np.load(path)
    np.save(path, 1 - labels)  # the same shape and size, other labels
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns
    assert file_stamp(path) != before


def test_the_finished_dataset_holds_no_bookkeeping_temporary(mlperf_dir, tmp_path):
    """A kill while the resume rewrote the stamps left their temporary file in the work directory, renamed into
    --output with the finished dataset."""
    src, _ = mlperf_dir
    out = tmp_path / "ds"
    work = mi.partial_dir(out)
    members = dict(np.load(src / "day_1_sparse_multi_hot.npz"))
    good = members["4"][2, 1]
    members["4"][2, 1] = -5
    np.savez(src / "day_1_sparse_multi_hot.npz", **members)
    assert run("--input", src, "--output", out, *ARGS).exit_code == 2
    (work / f".{STAMPS_FILE}.k1ll3d_a.tmp").write_text("{")
    members["4"][2, 1] = good
    np.savez(src / "day_1_sparse_multi_hot.npz", **members)
    assert run("--input", src, "--output", out, *ARGS).exit_code == 0
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []
