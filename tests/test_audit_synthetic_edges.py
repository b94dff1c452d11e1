"""Audit tests of the synthetic generator's edges: the recorded regenerate command, odd --out and
--multi-hot-sizes values, and generate()'s checks of its arguments (each failed before its fix)."""

from __future__ import annotations

import os
import shlex

import click
import pytest
from click.testing import CliRunner

from dlrm.data import synthetic
from dlrm.data.schema import read_metadata


def _command_args(command: str) -> dict[str, str]:
    """A recorded command's options as {option: value} (the flags this generator writes all take one value)."""
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "dlrm.data.synthetic"]
    options = argv[3:]
    assert len(options) % 2 == 0, options
    return dict(zip(options[::2], options[1::2]))


def test_the_recorded_command_keeps_the_exact_split_fractions():
    """small-real's 1/14 was written as 0.0714286 (%g: six digits), which at 17,000,005 rows splits 2 rows
    differently: the command did not regenerate the same dataset."""
    rows = 17_000_005
    command = synthetic.regenerate_command("ds", rows, 0, "kaggle", 1 / 14, 1 / 14, 10**6, "small-real")
    args = _command_args(command)
    fractions = float(args["--validation-fraction"]), float(args["--test-fraction"])
    assert fractions == (1 / 14, 1 / 14)
    assert synthetic.split_sizes(rows, *fractions) == synthetic.split_sizes(rows, 1 / 14, 1 / 14)
    # the fractions %g writes exactly are written as before (the embedded sample's command is unchanged)
    assert "--validation-fraction 0.1 --test-fraction 0 " in synthetic.regenerate_command(
        "data/sample", 200_000, 0, "tiny", 0.1, 0.0, 10**6)


def test_the_recorded_command_quotes_an_out_path_with_a_space(tmp_path):
    out = tmp_path / "my data" / "ds"
    meta = synthetic.generate(out, 20, seed=1, cardinalities="tiny")
    args = _command_args(meta.extra["command"])
    assert args["--out"] == str(out)
    assert read_metadata(out).extra["command"] == meta.extra["command"]


@pytest.mark.parametrize("name, flags", [(".", []), (".", ["--overwrite"]), ("..", ["--overwrite"])])
def test_out_dot_is_refused_before_any_work_and_leaves_nothing(tmp_path, monkeypatch, name, flags):
    """--out . or .. generated every row, then failed with "Device or resource busy" and left a hidden
    ..old-* (or ....old-*) directory in the user's working directory."""
    work = tmp_path / "parent" / "work"
    work.mkdir(parents=True)
    if flags:
        (work / "keep.txt").write_text("user data")
    monkeypatch.chdir(work)
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    res = CliRunner().invoke(synthetic.main, ["--rows", "10", "--cardinalities", "tiny", "--out", name, *flags])
    assert res.exit_code == 2, res.output
    assert f"--out {name}: name the dataset directory" in res.output and "teacher" not in res.output
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


def test_a_superscript_digit_multi_hot_size_is_one_line(tmp_path):
    """'²' passes str.isdigit() but not int(): a traceback and "this is a bug", exit 1."""
    sizes = "\u00b2" + ",1" * 25
    res = CliRunner().invoke(synthetic.main, ["--rows", "10", "--cardinalities", "tiny", "--out",
                                              str(tmp_path / "ds"), "--multi-hot-sizes", sizes])
    assert res.exit_code == 2, res.output
    assert "--multi-hot-sizes" in res.output and "is not" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "ds").exists()


@pytest.mark.parametrize("kwargs, needle", [
    ({"rows_per_file": 0}, "rows_per_file"),
    ({"validation_fraction": -0.2}, "validation_fraction"),
    ({"test_fraction": float("nan")}, "test_fraction"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**40}, "seed"),
    ({"rows": 0}, "rows"),
    ({"workers": -2}, "workers"),
])
def test_generate_refuses_bad_arguments_before_any_work(tmp_path, monkeypatch, kwargs, needle):
    """generate() says it raises click.ClickException on invalid settings; these failed only after the teacher and
    the rows were made (pyarrow's "Row group size cannot be 0", numpy's "need at least one array", "expected
    non-negative integer", an OverflowError) or, workers=-2, were taken as "one per CPU"."""
    def no_teacher(*args, **kw):
        raise AssertionError("the arguments must be checked before the teacher is made")

    monkeypatch.setattr(synthetic, "Teacher", no_teacher)
    kwargs = {"rows": 10, **kwargs}
    with pytest.raises(click.ClickException, match=needle):
        synthetic.generate(tmp_path / "ds", cardinalities="tiny", **kwargs)
    assert os.listdir(tmp_path) == []


def test_numpy_numbers_give_the_same_dataset_as_python_ones(tmp_path):
    """generate(rows=np.int64(..), seed=np.int64(..)) made every row, then failed writing metadata.json
    ("Object of type int64 is not JSON serializable", a traceback) and left nothing."""
    import numpy as np
    import pyarrow.parquet as pq

    plain = synthetic.generate(tmp_path / "plain", 40, seed=1, cardinalities="tiny", validation_fraction=0.5,
                               test_fraction=0.0, rows_per_file=15)
    numpy = synthetic.generate(tmp_path / "numpy", np.int64(40), seed=np.int64(1), cardinalities="tiny",
                               validation_fraction=np.float32(0.5), test_fraction=np.float64(0.0),
                               rows_per_file=np.int32(15))
    back = read_metadata(tmp_path / "numpy")
    assert back.extra["seed"] == 1 and back.extra["rows"] == 40 and back.extra["rows_per_file"] == 15
    assert numpy.splits == plain.splits and numpy.extra["oracle_auc"] == plain.extra["oracle_auc"]
    for split, info in plain.splits.items():
        for rel in info.files:
            assert pq.read_table(tmp_path / "numpy" / rel).equals(pq.read_table(tmp_path / "plain" / rel)), rel


def test_an_existing_fifo_as_raw_tsv_is_not_replaced_without_the_flag(tmp_path):
    """A named pipe (or a dangling link) at --raw-tsv is not "a file" to check_target, so the finished TSV's rename
    replaced it silently, without --overwrite, exit 0."""
    fifo, link = tmp_path / "raw.txt", tmp_path / "link.txt"
    os.mkfifo(fifo)
    link.symlink_to(tmp_path / "nowhere.txt")
    for target in (fifo, link):
        res = CliRunner().invoke(synthetic.main, ["--rows", "10", "--cardinalities", "tiny", "--out",
                                                  str(tmp_path / "ds"), "--raw-tsv", str(target)])
        assert res.exit_code == 2, res.output
        assert "refusing to overwrite" in res.output and str(target) in res.output
    assert fifo.is_fifo() and link.is_symlink() and not (tmp_path / "ds").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.txt", "raw.txt"]
    res = CliRunner().invoke(synthetic.main, ["--rows", "10", "--cardinalities", "tiny", "--out", str(tmp_path / "ds"),
                                              "--raw-tsv", str(fifo), "--overwrite"])
    assert res.exit_code == 0, res.output
    assert fifo.is_file() and len(fifo.read_text().splitlines()) == 10


def test_a_dangling_link_as_raw_tsv_is_named_as_one_with_its_target(tmp_path):
    """A dangling symbolic link at --raw-tsv was refused as "not a regular file", without a word of the link or where
    it points (the other dangling-link refusals name both); --overwrite still replaces the link with the TSV."""
    link, target = tmp_path / "raw.txt", tmp_path / "unmounted" / "raw.txt"
    link.symlink_to(target)
    args = ["--rows", "10", "--cardinalities", "tiny", "--out", str(tmp_path / "ds"), "--raw-tsv", str(link)]
    res = CliRunner().invoke(synthetic.main, args)
    assert res.exit_code == 2, res.output
    assert len(res.output.strip().splitlines()) == 1, res.output
    assert f"--raw-tsv {link}: it is a dangling symbolic link (to {target}); pass --overwrite" in res.output, res.output
    assert link.is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == ["raw.txt"]
    res = CliRunner().invoke(synthetic.main, [*args, "--overwrite"])
    assert res.exit_code == 0, res.output
    assert not link.is_symlink() and len(link.read_text().splitlines()) == 10 and not target.parent.exists()


def test_a_dangling_link_as_out_is_refused_before_any_work(tmp_path):
    """A dangling symbolic link at --out passed the checks (it does not exist), and the finished dataset's rename onto
    it failed after every row was written."""
    link = tmp_path / "ds"
    link.symlink_to(tmp_path / "gone")
    for flags in ([], ["--overwrite"]):
        res = CliRunner().invoke(synthetic.main, ["--rows", "10", "--cardinalities", "tiny", "--out", str(link), *flags])
        assert res.exit_code == 2, res.output
        assert f"{link} is a dangling symbolic link" in res.output and "teacher" not in res.output, res.output
    assert link.is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == ["ds"]
