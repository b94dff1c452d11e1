"""A stopped ``mlperf_import --overwrite`` of an existing dataset resumes, as its advice says.

The stopped import said "the N of M files finished are kept in ...: the same command without --overwrite resumes from
them (--overwrite starts over)". Without --overwrite the command was refused ("refusing to overwrite non-empty
OUT"), since OUT still held the old dataset (kept, rightly, until the new one is whole); with it the import started
over: a replacement stopped after hours of a 1TB import could not be resumed at all. The plan now records that the
import began with --overwrite, and the command without it resumes and replaces the old dataset when done."""

from __future__ import annotations

import numpy as np

from dlrm.data import mlperf_import as mi
from dlrm.data.schema import read_metadata
from tests.test_audit_mlperf_import_edges import run, src  # noqa: F401  (src: day 0, 6 rows; day 23, 4 rows)

SMALL = ("--rows-per-file", 2)  # day 0 in 3 files, validation and test one each: the test file is the last


def _set_dense(src, row, value):
    path = src / "day_23_dense.npy"
    dense = np.load(path)
    dense[row, 0] = value
    np.save(path, dense)


def test_a_stopped_replacement_resumes_without_overwrite_and_replaces_the_dataset(src, tmp_path):  # noqa: F811
    out = tmp_path / "ds"
    assert run(src, out, *SMALL).exit_code == 0
    old = read_metadata(out)
    labels = np.load(src / "day_0_labels.npy")
    labels[:, 0] = 1 - labels[:, 0]  # the new input: day 0's labels flipped
    np.save(src / "day_0_labels.npy", labels)
    _set_dense(src, 3, np.nan)  # the test split's row: the last file fails
    res = run(src, out, *SMALL, "--overwrite")
    assert res.exit_code == 2 and "row 3, column 0: nan" in res.output, res.output
    assert "the 4 of 5 files finished are kept" in res.output, res.output
    assert "the same command without --overwrite resumes from them" in res.output, res.output
    assert read_metadata(out) == old  # the old dataset whole while the new one is not

    _set_dense(src, 3, 1.0)
    res = run(src, out, *SMALL)  # as the advice says
    assert res.exit_code == 0, res.output
    assert "refusing to overwrite" not in res.output and "resuming the unfinished import" in res.output, res.output
    new = read_metadata(out)
    assert new.splits["train"].positives == 6 - old.splits["train"].positives  # the flipped labels: the new data
    assert not mi.partial_dir(out).exists() and not (out / mi.PLAN_FILE).exists()


def test_other_options_over_a_stopped_replacement_are_refused_as_such(src, tmp_path):  # noqa: F811
    out = tmp_path / "ds"
    assert run(src, out, *SMALL).exit_code == 0
    old = read_metadata(out)
    _set_dense(src, 3, np.nan)
    assert run(src, out, *SMALL, "--overwrite").exit_code == 2
    _set_dense(src, 3, 1.0)
    res = run(src, out, "--rows-per-file", 3)
    assert res.exit_code == 2, res.output
    assert "an unfinished import with other options or input" in res.output, res.output
    assert read_metadata(out) == old and mi.partial_dir(out).exists()


def test_a_plain_stopped_import_does_not_let_a_later_one_replace_a_dataset(src, tmp_path):  # noqa: F811
    """An import begun without --overwrite never replaces what --output holds: a dataset put there meanwhile (another
    import finished into it) is still refused."""
    out, other = tmp_path / "ds", tmp_path / "other"
    _set_dense(src, 3, np.nan)
    assert run(src, out, *SMALL).exit_code == 2 and mi.partial_dir(out).exists()
    _set_dense(src, 3, 1.0)
    assert run(src, other, *SMALL).exit_code == 0
    other.rename(out)
    res = run(src, out, *SMALL)
    assert res.exit_code == 2 and f"refusing to overwrite non-empty {out}" in res.output, res.output


def test_an_overwrite_into_a_new_output_replaces_nothing_put_there_later(src, tmp_path):  # noqa: F811
    """--overwrite of an --output that held nothing replaces nothing: a dataset put there after it stopped is refused
    to the command without --overwrite, as to any other."""
    out, other = tmp_path / "ds", tmp_path / "other"
    _set_dense(src, 3, np.nan)
    assert run(src, out, *SMALL, "--overwrite").exit_code == 2 and mi.partial_dir(out).exists()
    _set_dense(src, 3, 1.0)
    assert run(src, other, *SMALL).exit_code == 0
    other.rename(out)
    res = run(src, out, *SMALL)
    assert res.exit_code == 2 and f"refusing to overwrite non-empty {out}" in res.output, res.output
