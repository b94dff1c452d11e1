"""Refusals of the data tools found by a QA pass on 2026-12-04: `--overwrite` of a folder that holds no dataset, an
MLPerf day file whose header has a negative dimension, the import's advice after a stopped `--overwrite` run, and
click's usage errors as one line in every tool."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from dlrm.data import mlperf_import as mi
from tests.conftest import REPO
from tests.test_audit_mlperf_import_edges import CARDS, assert_refused, run, src, write_day  # noqa: F401 - fixture


def test_mlperf_import_overwrite_refuses_a_folder_that_holds_no_dataset(src, tmp_path):
    """--overwrite replaced any non-empty --output whole: a project folder named by mistake lost its files."""
    out = tmp_path / "project"
    (out / "sub").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    res = run(src, out, "--overwrite")
    assert res.exit_code == 2, res.output
    assert (f"--output {out}: refusing to replace it: it holds no dataset (no metadata.json; it has notes.txt, sub/)"
            in res.output), res.output
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "sub"]
    assert not mi.partial_dir(out).exists()


def test_mlperf_import_overwrite_replaces_a_dataset(src, tmp_path):
    out = tmp_path / "ds"
    assert run(src, out).exit_code == 0
    res = run(src, out, "--overwrite", "--dense", "counts")
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("file, shape", [("day_0_sparse_multi_hot.npz", (6, -3)), ("day_23_labels.npy", (-4, 1)),
                                         ("day_23_labels.npy", (-4, -1))])
def test_a_negative_dimension_in_a_header_is_one_line(src, tmp_path, file, shape):
    """A damaged header declaring a negative dimension: np.memmap's OverflowError ("memory mapped length must be
    positive") or ValueError reached the user as a traceback and "this is a bug", exit 1."""
    import io
    import zipfile

    def damaged(a: np.ndarray) -> bytes:
        buf = io.BytesIO()
        np.lib.format.write_array_header_1_0(buf, {"descr": a.dtype.str, "fortran_order": False, "shape": shape})
        return buf.getvalue() + a.tobytes()

    path = src / file
    if file.endswith(".npz"):
        with np.load(path) as z:
            members = {name: z[name] for name in z.files}
        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
            for name, a in members.items():
                buf = io.BytesIO()
                np.lib.format.write_array(buf, a)
                z.writestr(f"{name}.npy", damaged(a) if name == "4" else buf.getvalue())
        needle = f"{path}: member 4.npy: shape {shape} is not a valid array shape"
    else:
        path.write_bytes(damaged(np.load(path)))
        needle = f"{path}: not a readable .npy array"
    out = tmp_path / "ds"
    assert_refused(run(src, out), out, needle)


def test_a_stopped_overwrite_import_says_to_resume_without_overwrite(src, tmp_path):
    """An --overwrite import stopped by an id outside its table after some files: "the same command resumes" was
    wrong, as the same command (--overwrite) starts over."""
    out = tmp_path / "ds"
    assert run(src, out).exit_code == 0
    write_day(src, 1, 6)
    ids = dict(np.load(src / "day_1_sparse_multi_hot.npz"))
    ids["0"][2, 0] = CARDS[0]  # one past feature 0's table, in the last day imported
    np.savez(src / "day_1_sparse_multi_hot.npz", **ids)
    res = run(src, out, "--train-days", "0,1", "--rows-per-file", 2, "--overwrite")
    assert res.exit_code == 2 and "is outside feature 0's table" in res.output, res.output
    assert "the same command without --overwrite resumes from them" in res.output, res.output


@pytest.mark.parametrize("module, args", [
    ("dlrm.data.synthetic", ["--rows", "0", "--out", "x"]),
    ("dlrm.data.mlperf_import", ["--input", ".", "--output", "x", "--workers", "0"]),
    ("dlrm.data.relayout", ["--bogus"]),
    ("dlrm.sweep", ["--seeds", "1"]),
    ("dlrm.distributed.merge", []),
    ("dlrm.preprocess", ["--bogus"]),
])
def test_usage_errors_are_one_line(module, args):
    """click's usage errors were four lines (Usage, Try, a blank line, Error) in every tool but the preprocessor."""
    r = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and lines[0].endswith(f"(see python -m {module} --help)"), \
        r.stderr


def test_train_usage_error_is_one_line():
    r = subprocess.run([sys.executable, "train.py", "--config", "configs/sample.json", "--batch-size", "x"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.splitlines() == ["error: Invalid value for '--batch-size': 'x' is not a valid integer. "
                                     "(see train.py --help)"], r.stderr


def test_a_usage_error_under_clirunner_is_one_line():
    res = CliRunner().invoke(mi.main, ["--workers", "0"])
    assert res.exit_code == 2 and res.output.count("\n") == 1 and res.output.startswith("error: "), res.output


def test_a_dataset_without_validation_rows_is_said_at_preprocessing_and_refused_with_the_reason(tmp_path):
    """A 7-line input's sequential split leaves validation empty: the preprocessor said it only by a table line, and
    train.py refused the dataset as "splits.validation: lists no files", which reads like a damaged dataset."""
    from loguru import logger

    import dlrm.data.preprocess as pp
    from dlrm.data.schema import read_metadata
    from dlrm.data.validation import split_files
    from dlrm.errors import DatasetError
    from tests.test_preprocess import FAST, make_fields, write_raw

    src = write_raw(tmp_path / "a.tsv", make_fields(7, seed=1))
    out = tmp_path / "ds"
    warnings: list[str] = []
    handle = logger.add(lambda m: warnings.append(m.record["message"]), level="WARNING")
    try:
        meta = pp.preprocess([src], out, **FAST)
    finally:
        logger.remove(handle)
    assert meta.splits["validation"].rows == 0 and meta.splits["train"].rows > 0
    assert warnings[0] == ("the validation split has no rows: train.py trains on train and evaluates on validation, "
                           "and refuses this dataset; --split sequential takes validation from the second half of the "
                           "input's last seventh, empty for 7 lines: give 14 lines or more, or use --split random"), \
        warnings
    # (and the test split's one row is one class: tests/test_audit_preprocess_small.py)
    assert len(warnings) == 2 and warnings[1].startswith("the test split holds one class only: its one row is "), \
        warnings
    with pytest.raises(DatasetError, match=r"splits.validation: lists no files \(the split has no rows: preprocess "
                                           r"again: --split sequential takes validation from the second half of the "
                                           r"input's last seventh, empty for 7 lines: give 14 lines or more"):
        split_files(out, read_metadata(out), "validation")


def test_a_comma_in_a_one_value_field_points_at_multi_hot_sizes(tmp_path):
    """A multi-hot input preprocessed without --multi-hot-sizes: the line named the value as "not a hexadecimal
    category hash" alone, where its comma is the cause."""
    from tests.test_preprocess import make_fields, run_cli, write_raw

    rows = make_fields(20, seed=2)
    rows[4][15] = "1a,2b"  # C2 of line 5
    src = write_raw(tmp_path / "a.tsv", rows)
    r = run_cli(["-i", str(src), "-o", str(tmp_path / "ds"), "--workers", "1"])
    assert r.exit_code == 2
    assert r.stderr.strip() == (f"error: {src}:5: column C2: '1a,2b' is not a hexadecimal category hash (1 to 8 hex "
                                "digits) (',' separates a multi-hot field's values: this column's --multi-hot-sizes "
                                "size is 1, or none given)"), r.stderr
