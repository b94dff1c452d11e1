"""`python -m dlrm.data.mlperf_import` as an MLPerf user runs it, found by an audit (each test failed before its fix):

1. ``--sparse-layout`` given for a one-hot input (every npz member one id a row) was accepted and did nothing: the
   same files, "lists" recorded, exit 0. It is refused in one line before any work, as the other data tools refuse it.
2. ``--output .`` (or ``..``) imported every row, then failed renaming the dataset onto the working directory
   ("Device or resource busy"), leaving ``..import-partial`` and ``..old-*`` in it; now refused before any work.
3. With stderr in a log file (nohup, SLURM) the import's progress bar was disabled: an import of hours logged nothing
   between its first and last lines. It is drawn there too, redrawn once a minute as the preprocessor's.
4. A resumed import's closing rate counted the rows of the files kept from the stopped run, which took no time: a
   resume that wrote one day of 24 reported ~24x the rate it had. Only the rows written now count, and the kept ones
   are said so.
"""

from __future__ import annotations

import re
import types

import numpy as np
import pytest
from click.testing import CliRunner

from dlrm.data import mlperf_import as mi
from dlrm.data.schema import NUM_SPARSE, read_metadata
from tests.test_mlperf_import import CARDS, ROWS, write_day

ARGS = ["--train-days", "0-1", "--num-embeddings", ",".join(map(str, CARDS)), "--workers", "1"]


def run(*args):
    return CliRunner().invoke(mi.main, [str(a) for a in args])


@pytest.fixture
def mlperf_dir(tmp_path):
    """MLPerf's multi-hot days 0, 1 and 23, as the reference writes them."""
    rng = np.random.default_rng(0)
    src = tmp_path / "in"
    src.mkdir()
    for i, n in ROWS.items():
        write_day(src, i, n, rng)
    return src


@pytest.fixture
def one_hot_dir(tmp_path):
    """Days 0, 1 and 23 whose npz members all hold one id a row."""
    rng = np.random.default_rng(1)
    src = tmp_path / "one-hot"
    src.mkdir()
    for i, n in ROWS.items():
        np.save(src / f"day_{i}_labels.npy", rng.integers(0, 2, (n, 1)).astype(np.int32))
        np.save(src / f"day_{i}_dense.npy", np.log(rng.integers(0, 100, (n, 13)) + 3.0).astype(np.float32))
        np.savez(src / f"day_{i}_sparse_multi_hot.npz",
                 **{str(f): rng.integers(0, CARDS[f], (n, 1)).astype(np.int32) for f in range(NUM_SPARSE)})
    return src


@pytest.mark.parametrize("layout", ["slots", "lists"])
def test_sparse_layout_for_a_one_hot_input_is_refused_before_any_work(one_hot_dir, tmp_path, layout):
    out = tmp_path / "ds"
    res = run("--input", one_hot_dir, "--output", out, *ARGS, "--sparse-layout", layout)
    assert res.exit_code == 2, res.output
    assert (f"--sparse-layout {layout}: applies to multi-hot features only (every member of "
            f"{one_hot_dir / 'day_0_sparse_multi_hot.npz'} holds one id a row); leave the option out") in res.output
    assert "Traceback" not in res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one-hot"]  # no output, partial import or lock left
    # without the option the same input imports, one-hot (the layout recorded is the one-hot datasets' "lists")
    res = run("--input", one_hot_dir, "--output", out, *ARGS)
    assert res.exit_code == 0, res.output
    meta = read_metadata(out)
    assert meta.multi_hot_sizes == [1] * NUM_SPARSE and meta.sparse_layout == "lists"
    assert meta.splits["train"].rows == ROWS[0] + ROWS[1]


def test_sparse_layout_for_a_multi_hot_input_still_acts(mlperf_dir, tmp_path):
    res = run("--input", mlperf_dir, "--output", tmp_path / "ds", *ARGS, "--sparse-layout", "lists")
    assert res.exit_code == 0, res.output
    assert read_metadata(tmp_path / "ds").sparse_layout == "lists"


@pytest.mark.parametrize("output", [".", ".."])
def test_the_working_directory_as_output_is_refused_before_any_work(mlperf_dir, tmp_path, monkeypatch, output):
    cwd = tmp_path / "a" / "b"
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    res = run("--input", mlperf_dir, "--output", output, *ARGS, "--overwrite")
    assert res.exit_code == 2, res.output
    assert f"--output {output}: name the dataset directory itself, not . or .." in res.output
    assert "importing" not in res.output  # before any work
    assert list(cwd.iterdir()) == [] and [p.name for p in cwd.parent.iterdir()] == ["b"]


def test_the_progress_bar_is_drawn_into_a_log_file(mlperf_dir, tmp_path):
    """CliRunner's stderr is no terminal, as a log file is not: the bar (disabled there before) ends at 100%."""
    res = run("--input", mlperf_dir, "--output", tmp_path / "ds", *ARGS)
    assert res.exit_code == 0, res.output
    total = sum(ROWS.values())
    assert re.search(rf"import: 100%\S* {total}\.0/{total}\.0 ", res.output), res.output  # unit_scale: 87.0


def test_a_resumes_rate_counts_the_rows_it_wrote_not_those_kept(mlperf_dir, tmp_path, monkeypatch):
    """Day 23 stops the first run (a NaN dense value): days 0 and 1 are kept. Mended, the resume writes day 23 alone in
    (a clock made to read) 2 s: its rate is day 23's rows / 2, and the kept rows are named as such."""
    dense = np.load(mlperf_dir / "day_23_dense.npy")
    good = dense.copy()
    dense[3, 4] = np.nan
    np.save(mlperf_dir / "day_23_dense.npy", dense)
    out = tmp_path / "ds"
    res = run("--input", mlperf_dir, "--output", out, *ARGS)
    assert res.exit_code == 2 and "row 3, column 4: nan is not a finite value" in res.output, res.output
    np.save(mlperf_dir / "day_23_dense.npy", good)
    clock = iter([100.0, 102.0])
    monkeypatch.setattr(mi, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    res = run("--input", mlperf_dir, "--output", out, *ARGS)
    assert res.exit_code == 0, res.output
    kept = ROWS[0] + ROWS[1]
    assert f"in 2.0s ({ROWS[23] / 2:,.0f} rows/s; {kept:,} rows kept from the unfinished import)" in res.output
    assert read_metadata(out).splits["train"].rows == kept


def test_a_fresh_imports_rate_counts_every_row(mlperf_dir, tmp_path, monkeypatch):
    clock = iter([10.0, 14.0])
    monkeypatch.setattr(mi, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    res = run("--input", mlperf_dir, "--output", tmp_path / "ds", *ARGS)
    assert res.exit_code == 0, res.output
    assert f"in 4.0s ({sum(ROWS.values()) / 4:,.0f} rows/s): train" in res.output
    assert "kept" not in res.output


@pytest.mark.parametrize("text, shown", [("0-22", "0-22"), ("0,5", "0,5"), ("7-9,0,1,2,5", "0-2,5,7-9"), ("3", "3")])
def test_the_log_names_the_days_imported(text, shown):
    """`--train-days 0,5` was logged as "train days 0-5 (2 days)": the first and last day joined by a dash."""
    assert mi.days_text(mi.parse_days(text)) == shown
    assert mi.parse_days(mi.days_text(mi.parse_days(text))) == mi.parse_days(text)


def test_a_day_range_typo_is_refused_at_once():
    """`--train-days 0-2000000000` built a set of two billion days before the first missing day's error."""
    import click

    with pytest.raises(click.BadParameter, match=r"day 2000000000 is past 9999"):
        mi.parse_days("0-2000000000")
    assert mi.parse_days("9990-9999")[-1] == 9999
