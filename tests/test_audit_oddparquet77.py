"""Datasets users write themselves with pandas or pyarrow, run through train.py (helper oddparquet77; each test failed
before its fix)."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

import dlrm.cli as cli
from dlrm.data.loader import split_files
from dlrm.data.schema import DatasetError, read_metadata
from dlrm.logging_setup import configure_logging
from tests.test_audit_review52 import tiny_config


@pytest.fixture(autouse=True)
def _restore_logging():
    """main() points loguru at CliRunner's stderr, which is closed afterwards: point it back."""
    yield
    configure_logging()


def _edit_splits(data, edit) -> None:
    path = data / "metadata.json"
    meta = json.loads(path.read_text())
    edit(meta["splits"])
    path.write_text(json.dumps(meta))


def _train_error(tmp_path, config) -> str:
    """train.py's one ERROR line, its exit status 2 checked, no traceback, no run directory left."""
    result = CliRunner().invoke(cli.main, ["--config", str(config), "--tb-dir", str(tmp_path / "tb")])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output, result.output
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1, result.output
    assert not (tmp_path / "tb").exists() or not any((tmp_path / "tb").iterdir())
    return errors[0]


@pytest.mark.parametrize("how", ["same name", "symbolic link", "hard link"])
def test_a_train_file_also_listed_in_the_validation_split_is_refused(tmp_path, how):
    """A user with one file listed it in both splits (or a link to it): the run trained on the rows it evaluated, its
    AUC, best.pt and early stopping measured on training data, and nothing said so."""
    config = tiny_config(tmp_path)
    data = tmp_path / "ds"
    name = "train/part-00000.parquet"
    if how != "same name":
        (data / "validation" / "mine.parquet").unlink(missing_ok=True)
        (os.symlink if how == "symbolic link" else os.link)(data / name, data / "validation" / "mine.parquet")
        name = "validation/mine.parquet"

    def edit(splits):
        splits["validation"] = {**splits["train"], "files": [name, *splits["train"]["files"][1:]]}

    _edit_splits(data, edit)
    line = _train_error(tmp_path, config)
    assert f"{data / 'metadata.json'}: splits.validation.files[0]: '{name}' is the same file as " \
           "splits.train.files[0] 'train/part-00000.parquet'" in line
    assert "evaluate on rows it trains on" in line


def test_a_link_to_a_file_of_the_same_split_is_refused(tmp_path):
    """A symbolic link beside the file it names, both listed (a `glob("train/*")` of the folder): every row of the
    file counted twice in training; the check of the listed names could not see it."""
    tiny_config(tmp_path)
    data = tmp_path / "ds"
    os.symlink("part-00000.parquet", data / "train" / "copy.parquet")

    def edit(splits):
        first = 20  # make_dataset's first train file: 40 rows over 2 files
        splits["train"]["files"].append("train/copy.parquet")
        splits["train"]["rows"] += first

    _edit_splits(data, edit)
    with pytest.raises(DatasetError, match=r"splits\.train\.files\[2\]: 'train/copy\.parquet' is the same file as "
                                           r"splits\.train\.files\[0\] 'train/part-00000\.parquet': its rows would "
                                           "count twice"):
        split_files(data, read_metadata(data), "train")


def test_files_a_file_system_numbers_alike_are_not_taken_for_one(tmp_path, monkeypatch):
    """Some network and FUSE file systems give every file inode 0 (or reuse numbers): a dataset of two shards there
    must not read as one file listed twice. Only a file of several hard links is told by its inode."""
    from pathlib import Path

    tiny_config(tmp_path)
    data = tmp_path / "ds"
    real = Path.stat

    def alike(self, *args, **kwargs):
        st = real(self, *args, **kwargs)
        return os.stat_result((st.st_mode, 0, st.st_dev, 1, *tuple(st)[4:]))

    monkeypatch.setattr(Path, "stat", alike)
    assert len(split_files(data, read_metadata(data), "train")) == 2


def test_a_train_split_of_empty_files_says_so_not_to_lower_the_batch_size(tmp_path):
    """A split of 0-row files (a filter that kept nothing, written as it was) read "data.batch_size: 8 is more than the
    0 rows of DIR/train": no batch size helps."""
    import pyarrow.parquet as pq

    config = tiny_config(tmp_path)
    data = tmp_path / "ds"
    for name in ("part-00000.parquet", "part-00001.parquet"):
        path = data / "train" / name
        pq.write_table(pq.read_table(path).slice(0, 0), path)
    _edit_splits(data, lambda splits: splits["train"].update(rows=0, positives=0))
    line = _train_error(tmp_path, config)
    assert f"{data / 'metadata.json'}: splits.train: its 2 file(s) hold no rows; nothing to train on" in line
    assert "batch_size" not in line


@pytest.mark.parametrize("rename, folder, hint", [
    ({"label": "Label"}, "train", "(the file has Label: column names are case-sensitive)"),
    ({"DENSE_3": "dense_3"}, "train", "(the file has dense_3: column names are case-sensitive)"),
    (None, "train/label=1", ("(its values are in the folder name label=1, a partition key: write the column into "
                             "every file)")),
])
def test_a_missing_column_says_where_it_went(tmp_path, rename, folder, hint):
    """"column label: missing" was all a file said whose column is named Label, or whose label pyarrow.dataset or
    pandas' partition_cols wrote into the folder's name (train/label=1/...) instead of the file."""
    import pyarrow as pa

    from dlrm.data.schema import arrow_schema
    from dlrm.data.validation import check_schema

    names = arrow_schema().names
    if rename:
        names = [rename.get(n, n) for n in names]
    else:
        names.remove("label")
    schema = pa.schema([(n, arrow_schema().field(n).type if n in arrow_schema().names else pa.int8()) for n in names])
    path = tmp_path / folder / "part-0.parquet"
    missing = "DENSE_3" if rename and "DENSE_3" in rename else "label"
    with pytest.raises(DatasetError) as error:
        check_schema(path, schema)
    assert str(error.value) == f"{path}: column {missing}: missing {hint}"


def test_a_glob_pattern_listed_as_a_file_says_it_is_one(tmp_path):
    """``"files": ["train/*.parquet"]`` (a pattern where metadata.json lists files) read "listed in metadata.json
    splits.train but missing", as if the user's files had gone."""
    tiny_config(tmp_path)
    data = tmp_path / "ds"
    _edit_splits(data, lambda splits: splits["train"].update(files=["train/*.parquet"]))
    with pytest.raises(DatasetError) as error:
        split_files(data, read_metadata(data), "train")
    assert str(error.value) == (f"{data / 'train/*.parquet'}: listed in metadata.json splits.train but missing (a "
                                "pattern, which metadata.json does not expand: list the 2 files it matches)")


def _with_ids(data, feature: int, ids) -> None:
    """Rewrite `feature`'s column of every train and validation file with values cycling through `ids`."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    for path in sorted(data.glob("*/part-*.parquet")):
        table = pq.read_table(path)
        values = pa.array(np.resize(np.asarray(ids, dtype=np.int64), table.num_rows))
        pq.write_table(table.set_column(table.schema.get_field_index(f"SPARSE_{feature}"), f"SPARSE_{feature}", values),
                       path)


@pytest.mark.parametrize("ids, warned", [
    (range(-1, 11), True),  # cat.codes of 11 categories, -1 missing, in 11 rows: id 10 shares row 0 with -1
    (range(0, 11), False),  # the same ids without a missing value: 11 rows, 11 values
    (range(-1, 10), False),  # ids 0..9 and -1: 11 values in 11 rows, each its own
    ([-1, 5, 4_000_000_000], False),  # a hash: shared rows are hashing's, by choice
])
def test_ids_a_row_too_many_for_their_table_are_warned_of(tmp_path, ids, warned):
    """pandas' cat.codes (ids 0..n-1, -1 for missing) with cardinalities n: modulus hashing puts id n-1 on row
    (n-1+1) mod n = 0, the missing values' row; the two categories trained as one and nothing said so."""
    from loguru import logger

    from dlrm.config import load_config
    from dlrm.train.trainer import train

    config = tiny_config(tmp_path, train={"max_steps": 1})  # make_dataset: tables of 11 rows
    _with_ids(tmp_path / "ds", 4, ids)
    notes = []
    handle = logger.add(lambda m: notes.append(m.record["message"]), level="WARNING")
    try:
        train(load_config(config))
    finally:
        logger.remove(handle)
    said = [n for n in notes if "cardinalities: SPARSE_4 holds -1..10 in 11 rows" in n]
    assert len(said) == (1 if warned else 0), notes
    assert not [n for n in notes if "cardinalities:" in n and "SPARSE_4" not in n], notes
