"""Bad data never trains (issue #17): metadata.json, vocabularies and parquet values are checked.

Every defect is a one-line `DatasetError` naming the file and the field (column, row, key); nulls
in features follow the documented policy (dense -> 0, sparse -> the missing value -1, logged once
per file); a null or out-of-range label is an error, at open when the footer shows it and
otherwise when its row group is decoded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlrm.config import config_from_dict
from dlrm.data.device_loader import DeviceLoader
from dlrm.data.loader import ParquetLoader, split_files
from dlrm.data.schema import (
    ALL_COLUMNS,
    LABEL_COLUMN,
    NUM_SPARSE,
    DatasetError,
    Metadata,
    SplitInfo,
    arrow_schema,
    read_metadata,
    write_metadata,
)
from dlrm.data.vocabulary import read_vocabulary, vocab_path
from dlrm.train.setup import dataset_tables
from tests.conftest import REPO, make_dataset

LOADERS = {
    "stream": lambda files: ParquetLoader(files, 8, shuffle_buffer_rows=16),
    "device": lambda files: DeviceLoader(files, 8, "cpu"),
}


# -- helpers --------------------------------------------------------------------------------------


def shard_columns(path: Path) -> dict[str, list]:
    """A shard's columns as Python lists."""
    return pq.read_table(path).to_pydict()


def rewrite(path: Path, columns: dict[str, list], *, nullable: bool = False, statistics: bool = True,
            row_group_size: int = 7) -> None:
    """Write `columns` (name -> values, None for null) over `path` with the dataset's column types."""
    schema = pa.schema([pa.field(f.name, f.type, nullable=nullable) for f in arrow_schema()])
    table = pa.table({name: pa.array(columns[name], schema.field(name).type) for name in ALL_COLUMNS}, schema=schema)
    pq.write_table(table, path, row_group_size=row_group_size, write_statistics=statistics)


def set_values(path: Path, column: str, rows: dict[int, object], **kw) -> None:
    """Rewrite shard `path` with `column`'s values at `rows` replaced (None: a null)."""
    cols = shard_columns(path)
    for row, value in rows.items():
        cols[column][row] = value
    rewrite(path, cols, **kw)


def read_all(make, files: list[Path]):
    """Every batch of one epoch, concatenated: (dense, sparse, labels) in file order."""
    batches = list(make(files))
    return (torch.cat([b.dense for b in batches]), torch.cat([b.sparse for b in batches]),
            torch.cat([b.labels for b in batches]))


@pytest.fixture
def warnings_logged():
    from loguru import logger

    logger.enable("dlrm")
    messages: list[str] = []
    handle = logger.add(lambda m: messages.append(m.record["message"]), level="WARNING")
    yield messages
    logger.remove(handle)


@pytest.fixture
def dataset(tmp_path):
    root = tmp_path / "ds"
    make_dataset(root, {"train": 40, "validation": 20})
    return root


# -- labels ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("loader", sorted(LOADERS))
@pytest.mark.parametrize("split", ["train", "validation"])
@pytest.mark.parametrize("bad", [-1, 2])
def test_a_label_outside_0_1_names_file_column_and_row(dataset, loader, split, bad):
    shard = dataset / split / "part-00001.parquet"
    set_values(shard, LABEL_COLUMN, {9: bad})
    files = split_files(dataset, read_metadata(dataset), split)
    with pytest.raises(DatasetError, match=rf"part-00001.parquet: column label: row index 9 \(row group 1\) "
                                           rf"holds {bad}; labels must be 0 or 1"):
        read_all(LOADERS[loader], files)


@pytest.mark.parametrize("bad", [-1, 2])
def test_without_statistics_the_reader_thread_raises_the_same_error(dataset, bad):
    """The footer cannot show it: the row group's decode finds it, on a reader thread, and the
    consumer gets that DatasetError itself."""
    shard = dataset / "train" / "part-00000.parquet"
    set_values(shard, LABEL_COLUMN, {15: bad}, statistics=False)
    loader = ParquetLoader(split_files(dataset, read_metadata(dataset), "train"), 4, reader_threads=2)
    with pytest.raises(DatasetError, match=rf"part-00000.parquet: column label: row index 15 \(row group 2\) holds {bad}"):
        list(loader)


@pytest.mark.parametrize("loader", sorted(LOADERS))
@pytest.mark.parametrize("statistics", [True, False])
def test_a_null_label_is_an_error(dataset, loader, statistics):
    shard = dataset / "train" / "part-00000.parquet"
    set_values(shard, LABEL_COLUMN, {3: None}, nullable=True, statistics=statistics)
    with pytest.raises(DatasetError, match=r"part-00000.parquet: column label: row index 3 \(row group 0\) is null"):
        read_all(LOADERS[loader], split_files(dataset, read_metadata(dataset), "train"))


# -- nulls in features ----------------------------------------------------------------------------


@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_null_features_train_as_0_and_missing_and_are_logged_once_per_file(dataset, loader, warnings_logged):
    shard = dataset / "train" / "part-00000.parquet"
    cols = shard_columns(shard)
    cols["DENSE_3"][2] = cols["DENSE_3"][11] = None
    cols["SPARSE_5"][4] = None
    cols["DENSE_7"][5] = 250  # a plain value next to the nulls stays as it is
    rewrite(shard, cols, nullable=True)
    files = split_files(dataset, read_metadata(dataset), "train")
    make = LOADERS[loader]
    dense, sparse, _ = read_all(make, files)
    rows = {int(i): k for k, i in enumerate(torch.expm1(dense[:, 0]).round().long())}  # DENSE_0 == row id
    assert dense[rows[2], 3] == 0 and dense[rows[11], 3] == 0  # log1p(0): the stored missing count
    assert sparse[rows[4], 5] == -1  # the missing category, not -2^63
    assert dense[rows[5], 7] == pytest.approx(np.log1p(250))
    assert int((dense[:, 3] == 0).sum()) >= 2 and int((sparse == -1).sum()) >= 1
    null_warnings = [m for m in warnings_logged if "null" in m]
    assert null_warnings == [f"{shard}: 2 null dense values replaced by 0 (DENSE_3 2); "
                             f"1 null categories (the missing value) replaced by -1 (SPARSE_5 1)"]
    again = make(files)
    for _ in range(2):  # two epochs of a new loader of the same files (a baseline's): said once per process
        list(again)
    assert len([m for m in warnings_logged if "null" in m]) == 1


# -- schema ---------------------------------------------------------------------------------------


def test_device_loader_names_a_column_of_the_wrong_type(dataset):
    shard = dataset / "train" / "part-00000.parquet"
    table = pq.read_table(shard)
    table = table.set_column(table.schema.get_field_index("DENSE_4"), "DENSE_4", table.column("DENSE_4").cast(pa.int64()))
    pq.write_table(table, shard)
    with pytest.raises(DatasetError, match=r"part-00000.parquet: column DENSE_4: type int64 is not int32"):
        DeviceLoader(split_files(dataset, read_metadata(dataset), "train"), 8, "cpu")


@pytest.mark.parametrize("loader", sorted(LOADERS))
@pytest.mark.parametrize("change,message", [
    ("swap", r"column SPARSE_1: at position 14, where SPARSE_0 belongs \(columns out of order\)"),
    ("extra", r"column note: not part of the dataset schema"),
])
def test_column_order_and_extra_columns_are_errors(dataset, loader, change, message):
    shard = dataset / "validation" / "part-00000.parquet"
    table = pq.read_table(shard)
    if change == "swap":
        names = list(table.column_names)
        names[14], names[15] = names[15], names[14]
        table = table.select(names)
    else:
        table = table.append_column("note", pa.array(["x"] * table.num_rows))
    pq.write_table(table, shard)
    with pytest.raises(DatasetError, match="part-00000.parquet: " + message):
        LOADERS[loader](split_files(dataset, read_metadata(dataset), "validation"))


def test_a_corrupt_shard_is_a_dataset_error_in_the_device_loader(dataset):
    shard = dataset / "train" / "part-00001.parquet"
    shard.write_bytes(b"PAR1 and then nothing useful")
    with pytest.raises(DatasetError, match=r"part-00001.parquet: not a readable parquet file"):
        DeviceLoader(split_files(dataset, read_metadata(dataset), "train"), 8, "cpu")


# -- vocabularies ---------------------------------------------------------------------------------


def vocabulary_dataset(root: Path, size: int = 5) -> Path:
    """A dataset with hashing "vocabulary": every feature's vocabulary is 10, 20, ... (`size` values)."""
    make_dataset(root, {"train": 10, "validation": 5}, files_per_split=1)
    meta = read_metadata(root)
    meta.hashing, meta.cardinalities = "vocabulary", [size + 1] * NUM_SPARSE
    write_metadata(root, meta)
    for f in range(NUM_SPARSE):
        vocab_path(root, f).parent.mkdir(exist_ok=True)
        np.save(vocab_path(root, f), np.arange(1, size + 1, dtype=np.int64) * 10)
    return root


def tables_of(root: Path):
    cfg = config_from_dict({"data": {"path": str(root)}})
    return dataset_tables(cfg, read_metadata(root), root)


def test_a_valid_vocabulary_loads(tmp_path):
    root = vocabulary_dataset(tmp_path / "ds")
    np.save(vocab_path(root, 3), np.array([10, 20, 30, 40, 50], dtype=">u4"))  # any integer dtype and byte order
    tables = tables_of(root)
    assert tables.hashing == "vocabulary" and tables.cardinalities == [6] * NUM_SPARSE
    assert all(v.dtype == torch.int64 and v.tolist() == [10, 20, 30, 40, 50] for v in tables.vocabs)
    np.save(vocab_path(root, 0), np.zeros(0, np.int64))  # an empty vocabulary: only the out-of-vocabulary row
    assert read_vocabulary(root, 0, 1).tolist() == []


def _pickled(path: Path) -> None:
    np.save(path, np.array([10, 20, "x", 40, 50], dtype=object), allow_pickle=True)


VOCAB_DEFECTS = {
    "unsorted": (lambda p: np.save(p, np.array([10, 30, 20, 40, 50])), r"not strictly increasing .* at index 2: 30 then 20"),
    "duplicate": (lambda p: np.save(p, np.array([10, 20, 20, 40, 50])), r"not strictly increasing .* at index 2: 20 then 20"),
    "short": (lambda p: np.save(p, np.array([10, 20, 30, 40])), r"holds 4 values but metadata.json cardinalities\[7\] is 6"),
    "long": (lambda p: np.save(p, np.arange(6) * 10), r"holds 6 values but metadata.json cardinalities\[7\] is 6"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:-9]), r"is \d+ bytes, its header promises \d+ \(truncated"),
    "header only": (lambda p: p.write_bytes(p.read_bytes()[:20]), r"not a readable .npy array"),
    "pickled objects": (_pickled, r"must hold a 1-D integer array, holds object"),
    "floats": (lambda p: np.save(p, np.arange(5) * 10.0), r"must hold a 1-D integer array, holds float64"),
    "2-D": (lambda p: np.save(p, np.arange(10).reshape(5, 2)), r"must hold a 1-D integer array, holds int64 of shape \(5, 2\)"),
    "junk": (lambda p: p.write_bytes(b"\x80\x04 not numpy at all"), r"not a readable .npy array"),
    "missing": (lambda p: p.unlink(), r"vocabulary file missing"),
    "too big for int64": (lambda p: np.save(p, np.array([1, 2, 3, 4, 2**64 - 1], np.uint64)), r"value 18446744073709551615 does not fit int64"),
}


@pytest.mark.parametrize("defect", sorted(VOCAB_DEFECTS))
def test_a_bad_vocabulary_is_a_dataset_error_naming_the_file(tmp_path, defect):
    root = vocabulary_dataset(tmp_path / "ds")
    damage, message = VOCAB_DEFECTS[defect]
    damage(vocab_path(root, 7))
    with pytest.raises(DatasetError, match=r"SPARSE_7.npy: " + message):
        tables_of(root)


# -- metadata.json --------------------------------------------------------------------------------


def valid_metadata() -> dict:
    meta = Metadata(cardinalities=[5] * NUM_SPARSE, splits={
        "train": SplitInfo(rows=10, positives=3, files=["train/a.parquet", "train/b.parquet"]),
        "validation": SplitInfo(rows=4, positives=4, files=["validation/a.parquet"])},
        extra={"oracle_auc": {"train": 0.8, "validation": None}, "note": [1, {"x": 2.5}]})
    return meta.to_json()


def write_raw(root: Path, text: str | bytes) -> None:
    root.mkdir(parents=True, exist_ok=True)
    data = text.encode() if isinstance(text, str) else text
    (root / "metadata.json").write_bytes(data)


def with_value(key_path: tuple, value) -> dict:
    raw = valid_metadata()
    node = raw
    for k in key_path[:-1]:
        node = node[k]
    node[key_path[-1]] = value
    return raw


METADATA_DEFECTS = [
    (with_value(("splits",), [1, 2]), r"splits: must be a JSON object, got list"),
    (with_value(("splits",), None), r"splits: must be a JSON object, got NoneType"),
    (with_value(("splits", "train"), [10, 3, []]), r"splits.train: must be a JSON object"),
    (with_value(("splits", "train", "rows"), -1), r"splits.train.rows: -1 is not a non-negative integer"),
    (with_value(("splits", "train", "rows"), True), r"splits.train.rows: True is not a non-negative integer"),
    (with_value(("splits", "train", "rows"), 10.0), r"splits.train.rows: 10.0 is not a non-negative integer"),
    (with_value(("splits", "train", "rows"), 2**70), r"splits.train.rows: \d+ is not a non-negative integer below 2\^63"),
    (with_value(("splits", "train", "positives"), 11), r"splits.train.positives: 11 is more than the split's 10 rows"),
    (with_value(("splits", "train", "positives"), "3"), r"splits.train.positives: '3' is not a non-negative integer"),
    (with_value(("splits", "validation", "files"), "validation/a.parquet"), r"splits.validation.files: must be a list"),
    (with_value(("splits", "validation", "files"), ["/etc/passwd"]), r"splits.validation.files\[0\]: '/etc/passwd' is absolute"),
    (with_value(("splits", "validation", "files"), ["../other/a.parquet"]), r"splits.validation.files\[0\]: '../other/a.parquet' leaves the"),
    (with_value(("splits", "validation", "files"), ["a/../../b"]), r"splits.validation.files\[0\]: 'a/../../b' leaves the dataset directory"),
    (with_value(("splits", "validation", "files"), [3]), r"splits.validation.files\[0\]: 3 is not a non-empty string"),
    (with_value(("splits", "validation", "files"), [""]), r"splits.validation.files\[0\]: '' is not a non-empty string"),
    (with_value(("splits", "validation", "files"), ["a\x00b"]), r"splits.validation.files\[0\]: .* is not a valid file name \(NUL"),
    (with_value(("splits", "validation", "files"), ["a", "./a"]), r"splits.validation.files\[1\]: './a' is listed twice"),
    (with_value(("splits", "validation"), {"rows": 1, "files": []}), r"splits.validation.positives: missing"),
    (with_value(("extra",), "provenance"), r"extra: must be a JSON object, got str"),
    (with_value(("extra",), None), r"extra: must be a JSON object, got NoneType"),
    (with_value(("extra", "oracle_auc"), 0.8), r"extra.oracle_auc: must be a JSON object"),
    (with_value(("extra", "oracle_auc", "validation"), "0.8"), r"extra.oracle_auc.validation: '0.8' is not null or a number"),
    (with_value(("extra", "oracle_auc", "validation"), 1.5), r"extra.oracle_auc.validation: 1.5 is not null or a number"),
    (with_value(("missing_sparse",), "x"), r"missing_sparse: 'x' is not -1"),
    (with_value(("missing_sparse",), 0), r"missing_sparse: 0 is not -1"),
    (with_value(("num_sparse",), 27), r"num_sparse: 27 is not 26"),
    (with_value(("schema_version",), True), r"schema_version: True is not a supported version"),
    (with_value(("schema_version",), 1.0), r"schema_version: 1.0 is not a supported version"),
    (with_value(("cardinalities", 4), 2**64), r"cardinalities\[4\]: \d+ is not a positive integer below 2\^63"),
]

RAW_DEFECTS = [
    (b'{"schema_version": 1, \xff}', r"not UTF-8 text \(byte 0xff at line 1 column 23\)"),
    (b"[" * 100_000 + b"]" * 100_000, r"invalid JSON: nested too deeply"),
    (b'{"schema_version": 1, "extra": {"x": NaN}}', r"invalid JSON: NaN is not a valid JSON number"),
    (b'{"schema_version": 1, "extra": {"x": -Infinity}}', r"invalid JSON: -Infinity is not a valid JSON number"),
    (b'{"schema_version": 1, "extra": {"x": 1e999}}', r"invalid JSON: 1e999 is out of the range of a double"),
    (b'{"schema_version": 1, "extra": {"x": ' + b"9" * 5000 + b"}}", r"invalid JSON: .*integer string conversion"),
    (b'{"schema_version": 1, "schema_version": 1}', r"invalid JSON: key 'schema_version' appears twice"),
    (b'{"schema_version": 1,', r"invalid JSON at line 1 column 22"),
]


@pytest.mark.parametrize("raw,message", METADATA_DEFECTS, ids=range(len(METADATA_DEFECTS)))
def test_metadata_defects_name_the_key(tmp_path, raw, message):
    write_raw(tmp_path, json.dumps(raw))
    with pytest.raises(DatasetError, match=r"metadata.json: " + message):
        read_metadata(tmp_path)


@pytest.mark.parametrize("data,message", RAW_DEFECTS, ids=range(len(RAW_DEFECTS)))
def test_malformed_metadata_bytes_are_one_dataset_error(tmp_path, data, message):
    write_raw(tmp_path, data)
    with pytest.raises(DatasetError, match=r"metadata.json: " + message):
        read_metadata(tmp_path)


def test_a_file_name_with_a_lone_surrogate_is_refused(tmp_path):
    raw = with_value(("splits", "validation", "files"), ["\ud800.parquet"])
    write_raw(tmp_path, json.dumps(raw))  # ASCII JSON: the escape \ud800 parses to an unpaired surrogate
    with pytest.raises(DatasetError, match=r"splits.validation.files\[0\]: .* is not a valid file name \(unpaired"):
        read_metadata(tmp_path)


def test_valid_metadata_round_trips(tmp_path):
    write_raw(tmp_path, "\ufeff" + json.dumps(valid_metadata()))  # a BOM is harmless
    meta = read_metadata(tmp_path)
    assert meta.to_json() == valid_metadata()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _key_paths(node, prefix=()):
    """Every (container path, key) of a JSON tree, to substitute a value at."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    for k, v in items:
        yield prefix + (k,)
        yield from _key_paths(v, prefix + (k,))


_PATHS = list(_key_paths(valid_metadata()))


@settings(max_examples=150, deadline=None)
@given(where=st.sampled_from(_PATHS), value=json_values, drop=st.booleans())
def test_fuzzed_metadata_values_give_metadata_or_dataset_error(tmp_path_factory, where, value, drop):
    raw = with_value(where, value)
    if drop and len(where) == 1:
        del raw[where[0]]  # a top-level key left out instead
    root = tmp_path_factory.mktemp("fuzz")
    write_raw(root, json.dumps(raw))
    try:
        meta = read_metadata(root)
    except DatasetError as e:
        assert str(e).startswith(str(root / "metadata.json")) and "\n" not in str(e)
        return
    assert isinstance(meta, Metadata) and len(meta.cardinalities) == NUM_SPARSE
    for info in meta.splits.values():
        assert 0 <= info.positives <= info.rows and all(isinstance(f, str) for f in info.files)


@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=200) | st.builds(lambda s, cut: s[:cut], st.just(json.dumps(valid_metadata()).encode()),
                                                 st.integers(0, 3000)))
def test_fuzzed_metadata_bytes_give_metadata_or_dataset_error(tmp_path_factory, data):
    root = tmp_path_factory.mktemp("fuzz")
    write_raw(root, data)
    try:
        assert isinstance(read_metadata(root), Metadata)
    except DatasetError as e:
        assert str(e).startswith(str(root / "metadata.json")) and "\n" not in str(e)


# -- end to end -----------------------------------------------------------------------------------


@pytest.mark.parametrize("split,statistics", [("train", True), ("validation", False)])
def test_cli_bad_label_exits_2_with_one_line_naming_the_file(tmp_path, split, statistics):
    """Train split: caught when the file is opened (footer statistics). Validation split without
    statistics: caught by a reader thread at the first evaluation, after the training steps."""
    root = tmp_path / "ds"
    make_dataset(root, {"train": 600, "validation": 300}, row_group_size=100)
    shard = root / split / "part-00001.parquet"
    set_values(shard, LABEL_COLUMN, {123: 2}, statistics=statistics, row_group_size=100)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "train.py", "--config", "configs/sample.json", "--data", str(root), "--max-steps", "2",
         "--batch-size", "64", "--device", "cpu", "--tb-dir", str(tmp_path / "tb")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "Traceback" not in output
    naming = [line for line in output.splitlines() if str(shard) in line]
    assert len(naming) == 1, output
    assert "column label: row index 123 (row group 1) holds 2; labels must be 0 or 1" in naming[0]
