"""Audit spec66: datasets written by other pipelines from data/README.md alone (pandas, Polars, Spark, DuckDB output
emulated with pyarrow options): list column types other than ``list<int64>``, metadata.json's ``positives`` against
the labels, a directory listed as a shard, pandas' index written as a column."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dlrm.data.device_loader import DeviceLoader
from dlrm.data.loader import ParquetLoader, split_files
from dlrm.data.schema import DENSE_COLUMNS, NUM_SPARSE, SPARSE_COLUMNS, DatasetError, read_metadata
from tests.conftest import CHILD_ENV, REPO, make_dataset

SIZES = [3, 1, 1, 1, 1, 2] + [1] * 20


def _multi_hot_dataset(root, list_type, rows=40, full=False):
    """A multi-hot dataset (features 0 and 5 lists of up to 3 and 2 values; `full`: every list full) whose list
    columns have `list_type(pa.int64())` (or, for "fixed", fixed-size lists of the feature's size), written by hand
    as data/README.md describes it; the same rows whatever the type."""
    rng = np.random.default_rng(0)
    cols = {"label": pa.array(rng.integers(0, 2, rows), pa.int8())}
    cols.update({c: pa.array(rng.integers(0, 100, rows), pa.int32()) for c in DENSE_COLUMNS})
    for f, size in enumerate(SIZES):
        if size == 1:
            cols[SPARSE_COLUMNS[f]] = pa.array(rng.integers(-1, 2**32 - 2, rows), pa.int64())
            continue
        lengths = np.full(rows, size) if full else rng.integers(0, size + 1, rows)
        lists = [[int(v) for v in rng.integers(-1, 2**31 - 1, k)] for k in lengths]  # (int32 too)
        if list_type == "fixed":
            cols[SPARSE_COLUMNS[f]] = pa.FixedSizeListArray.from_arrays(pa.array(sum(lists, []), pa.int64()), size)
        else:
            cols[SPARSE_COLUMNS[f]] = pa.array(lists, list_type(pa.int64()))
    table = pa.table(cols)
    (root / "train").mkdir(parents=True)
    pq.write_table(table, root / "train" / "part-0.parquet", row_group_size=16)
    meta = {"schema_version": 2, "cardinalities": [50] * NUM_SPARSE, "multi_hot_sizes": SIZES,
            "splits": {"train": {"rows": rows, "positives": int(cols["label"].to_numpy().sum()), "files": ["train/part-0.parquet"]}}}
    (root / "metadata.json").write_text(json.dumps(meta))
    return root


def _batches(root, loader: str):
    meta = read_metadata(root)
    files = split_files(root, meta, "train")
    kinds = {"stream": lambda: ParquetLoader(files, 8, "cpu", multi_hot_sizes=meta.multi_hot_sizes),
             "compact": lambda: ParquetLoader(files, 8, "cpu", multi_hot_sizes=meta.multi_hot_sizes, compact_sparse=True),
             "gpu": lambda: DeviceLoader(files, 8, "cpu", multi_hot_sizes=meta.multi_hot_sizes)}
    batches = list(kinds[loader]())
    return [torch.cat([getattr(b, name) for b in batches]) for name in ("labels", "dense", "sparse")]


@pytest.mark.parametrize("list_type", [pa.large_list, "fixed"])
@pytest.mark.parametrize("loader", ["stream", "compact", "gpu"])
def test_large_and_fixed_size_list_columns_read_as_list_columns(tmp_path, list_type, loader):
    """Polars writes every list column as ``large_list`` (its arrow schema, which pyarrow reads back), and a numpy
    [n, k] block or a Polars Array becomes a ``fixed_size_list``: parquet stores all three as the same LIST. The
    loaders refused both ("type large_list<element: int64> is not list<item: int64>"), where data/README.md asks
    for a list of int64 values; they now deliver the rows a ``list<int64>`` column of the same values gives."""
    full = list_type == "fixed"  # a fixed-size list holds exactly the feature's size (MLPerf's full rows)
    want = _batches(_multi_hot_dataset(tmp_path / "list", pa.list_, full=full), loader)
    got = _batches(_multi_hot_dataset(tmp_path / "other", list_type, full=full), loader)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("list_type", [pa.large_list, "fixed"])
def test_large_and_fixed_size_lists_without_nulls_replace_none(tmp_path, list_type):
    """Cast to ``list<int64>``, the column replaced no null: no "0 null multi-hot lists ... replaced" warning a file."""
    from dlrm.data.validation import check_table

    root = _multi_hot_dataset(tmp_path / "ds", list_type, full=list_type == "fixed")
    table = pq.read_table(root / "train" / "part-0.parquet")
    checked, replaced = check_table(root / "train" / "part-0.parquet", 0, 0, table, SIZES)
    assert replaced == {}
    assert checked.schema.field("SPARSE_0").type == pa.list_(pa.int64())


def test_large_list_dataset_relayouts(tmp_path):
    """`python -m dlrm.data.relayout` reads such a file too, and its slot copy holds the same batches."""
    from dlrm.data.relayout import relayout

    src = _multi_hot_dataset(tmp_path / "src", pa.large_list)
    relayout(src, tmp_path / "slots", "slots")
    for g, w in zip(_batches(tmp_path / "slots", "stream"), _batches(src, "stream")):
        assert torch.equal(g, w)


def test_list_of_another_value_type_still_refused(tmp_path):
    """Only int64 values: a ``large_list<int32>`` is refused naming the file and the column."""
    root = _multi_hot_dataset(tmp_path / "ds", lambda t: pa.large_list(pa.int32()))
    with pytest.raises(DatasetError, match=r"part-0.parquet: column SPARSE_0: type large_list<.*int32>"):
        ParquetLoader(split_files(root, read_metadata(root), "train"), 8, "cpu", multi_hot_sizes=SIZES)


def _set_positives(root, split: str, positives: int) -> None:
    meta = json.loads((root / "metadata.json").read_text())
    meta["splits"][split]["positives"] = positives
    (root / "metadata.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("wrong", ["zero", "all"])
def test_positives_contradicted_by_the_label_statistics_is_refused(tmp_path, wrong):
    """A hand-written metadata.json with ``positives`` 0 (not counted) or equal to ``rows``, on a split of both
    classes: the evaluator took the split for one class ("holds one class ... its AUC is undefined"), chose best.pt by
    logloss instead of AUC, and refused AUC early stopping, without a word about the wrong key. The footers' label
    statistics show both classes: refused naming the file and the key."""
    root = tmp_path / "ds"
    make_dataset(root, {"train": 60, "validation": 30})
    rows = read_metadata(root).splits["validation"].rows
    _set_positives(root, "validation", 0 if wrong == "zero" else rows)
    with pytest.raises(DatasetError, match=r"metadata.json: splits.validation.positives: .*both classes"):
        split_files(root, read_metadata(root), "validation", check_positives=True)


def test_positives_of_a_real_one_class_split_and_without_statistics_are_kept(tmp_path):
    """A split that is one class (its statistics say so) keeps positives 0; a file without statistics proves nothing."""
    root = tmp_path / "ds"
    make_dataset(root, {"train": 20}, files_per_split=1)
    path = root / "train" / "part-00000.parquet"
    table = pq.read_table(path)
    pq.write_table(table.set_column(0, "label", pa.array(np.zeros(20, np.int8))), path, row_group_size=7)
    _set_positives(root, "train", 0)
    assert len(split_files(root, read_metadata(root), "train", check_positives=True)) == 1
    pq.write_table(table, path, write_statistics=False)  # both classes, no statistics: positives 0 is not checked
    assert len(split_files(root, read_metadata(root), "train", check_positives=True)) == 1


def test_train_py_refuses_wrong_positives_in_one_line(tmp_path):
    root = tmp_path / "ds"
    make_dataset(root, {"train": 60, "validation": 30})
    _set_positives(root, "validation", 0)
    result = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs" / "sample.json"),
                             "--data", str(root), "--device", "cpu", "--tb-dir", str(tmp_path / "tb"), "--max-steps", "1"],
                            capture_output=True, text=True, env=CHILD_ENV, cwd=tmp_path, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "splits.validation.positives" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "tb").exists()


def test_a_directory_listed_as_a_shard_is_named_as_one(tmp_path):
    """Spark (and pyarrow.dataset, Dask) write a "file" train.parquet that is a directory of part files. Listed in
    metadata.json it was reported "listed in metadata.json splits.train but missing", though it is there."""
    root = tmp_path / "ds"
    make_dataset(root, {"train": 20}, files_per_split=1)
    (root / "train.parquet").mkdir()
    (root / "train" / "part-00000.parquet").rename(root / "train.parquet" / "part-00000-c000.snappy.parquet")
    meta = json.loads((root / "metadata.json").read_text())
    meta["splits"]["train"]["files"] = ["train.parquet"]
    (root / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(DatasetError, match=r"train.parquet: listed in metadata.json splits.train, is a directory.*"
                                           r"list the parquet files inside it"):
        split_files(root, read_metadata(root), "train")


def test_pandas_index_column_says_how_to_leave_it_out(tmp_path):
    """pandas writes a DataFrame's index as a column ``__index_level_0__`` whenever it is not a plain 0..n-1 range
    (after a shuffle, a filter, a concat): the error named the column but not where it came from or what to do."""
    root = tmp_path / "ds"
    make_dataset(root, {"train": 20}, files_per_split=1)
    path = root / "train" / "part-00000.parquet"
    pq.read_table(path).to_pandas().sample(frac=1.0, random_state=0).to_parquet(path)
    assert "__index_level_0__" in pq.read_schema(path).names
    with pytest.raises(DatasetError, match=r"column __index_level_0__: .*pandas.*index=False"):
        ParquetLoader(split_files(root, read_metadata(root), "train"), 8, "cpu")


def test_a_column_of_another_type_says_which_type_to_write(tmp_path):
    """pandas writes an int64 label (``astype(int)``), a pipeline a bool label or int64 counts: the error named the
    types, not what to write; it now says which type the column must be written as."""
    root = tmp_path / "ds"
    make_dataset(root, {"train": 20}, files_per_split=1)
    path = root / "train" / "part-00000.parquet"
    frame = pq.read_table(path).to_pandas()
    frame["label"] = frame["label"].astype("int64")
    frame.to_parquet(path, index=False)
    with pytest.raises(DatasetError, match=r"part-00000.parquet: column label: type int64 is not int8 \(write the "
                                           r"column as int8"):
        ParquetLoader(split_files(root, read_metadata(root), "train"), 8, "cpu")
