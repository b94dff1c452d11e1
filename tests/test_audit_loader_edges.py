"""Edge cases of the data path found by the loader audit (2026-11-30).

- A float dataset (``dense_format`` "float", schema version 4) with a row group of no rows (an empty file among
  others, or an empty row group inside a file) must load like a counts dataset does
  (tests/test_loader.py::test_empty_row_groups_are_harmless): the finiteness check of the float dense values
  took pyarrow's ``all`` of no values (null) for "not all finite" and failed with an IndexError (a traceback,
  not even a `DatasetError`) in both loaders and in relayout.
- A row group of no rows has no statistics; it must not keep the rest of the split from crossing the bus in the
  compact int32 form (`dlrm.data.host_arena.compact_sparse_ok`).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from dlrm.data.device_loader import DeviceLoader
from dlrm.data.host_arena import compact_sparse_ok
from dlrm.data.loader import ParquetLoader, split_files, transform_dense
from dlrm.data.relayout import relayout
from dlrm.data.schema import (
    DENSE_COLUMNS,
    LABEL_COLUMN,
    SPARSE_COLUMNS,
    SplitInfo,
    arrow_schema,
    read_metadata,
    write_metadata,
)
from dlrm.data.validation import check_table
from tests.conftest import make_dataset, write_rows


def write_float_shard(path, first: int, groups: list[int]) -> None:
    """Rows ``first ..`` in row groups of `groups` rows (0: an empty row group): label ``row % 2``, DENSE_j the
    float ``row + j / 16 - 0.5`` (exact in float32), SPARSE_f ``row * 100 + f``."""
    schema = arrow_schema(dense_format="float")
    path.parent.mkdir(parents=True, exist_ok=True)
    with pq.ParquetWriter(path, schema) as writer:
        at = first
        for n in groups:
            rows = np.arange(at, at + n)
            cols = {LABEL_COLUMN: pa.array((rows % 2).astype(np.int8))}
            cols.update({c: pa.array((rows + j / 16 - 0.5).astype(np.float32)) for j, c in enumerate(DENSE_COLUMNS)})
            cols.update({c: pa.array(rows * 100 + f, pa.int64()) for f, c in enumerate(SPARSE_COLUMNS)})
            writer.write_table(pa.table(cols, schema=schema), row_group_size=max(1, n))
            at += n


def float_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(labels, dense, sparse) `write_float_shard` stores for `rows`."""
    dense = (rows[:, None] + np.arange(13) / 16 - 0.5).astype(np.float32)
    return (rows % 2).astype(np.float32), dense, rows[:, None] * 100 + np.arange(26)


def test_a_float_dataset_with_empty_row_groups_loads_every_row(tmp_path):
    files = [tmp_path / "a.parquet", tmp_path / "empty.parquet", tmp_path / "b.parquet"]
    write_float_shard(files[0], 0, [3, 0, 2])  # rows 0-4, an empty row group between them
    write_float_shard(files[1], 5, [0])        # an empty file (one row group of no rows)
    write_float_shard(files[2], 5, [4])        # rows 5-8
    assert [pq.ParquetFile(f).metadata.num_row_groups for f in files] == [3, 1, 1]

    # the check itself: an empty row group of float values is all finite
    empty = pq.ParquetFile(files[1]).read_row_group(0)
    table, replaced = check_table(files[1], 0, 0, empty, dense_format="float")
    assert (table.num_rows, replaced) == (0, {})

    labels, dense, sparse = float_rows(np.arange(9))
    for loader in (ParquetLoader(files, 4, dense_format="float", shuffle_buffer_rows=2),
                   DeviceLoader(files, 4, "cpu", dense_format="float")):
        batches = list(loader)
        assert [len(b) for b in batches] == [4, 4, 1]
        np.testing.assert_array_equal(torch.cat([b.dense for b in batches]).numpy(), dense)
        np.testing.assert_array_equal(torch.cat([b.sparse for b in batches]).numpy(), sparse)
        np.testing.assert_array_equal(torch.cat([b.labels for b in batches]).numpy(), labels)

    shuffled = ParquetLoader(files, 4, dense_format="float", shuffle=True, seed=3, shuffle_buffer_rows=2)
    for epoch in (0, 1):
        shuffled.set_epoch(epoch)
        seen = torch.cat([b.sparse[:, 0] for b in shuffled]).numpy()
        np.testing.assert_array_equal(np.sort(seen), np.arange(9) * 100)  # every row once an epoch


def test_a_counts_dataset_with_an_empty_shard_relayouts_to_float_and_trains_as_before(tmp_path):
    """The way such a dataset comes about: a counts dataset with an empty shard (harmless there), copied with
    ``relayout --dense-format float``; the copy must deliver the original's batches, and relayout it again."""
    src = tmp_path / "counts"
    arrays = make_dataset(src, {"train": 20}, files_per_split=1, row_group_size=6)
    write_rows(src / "train" / "empty.parquet", np.zeros(0), np.zeros((0, 13)), np.zeros((0, 26)), 6)
    meta = read_metadata(src)
    meta.splits["train"] = SplitInfo(20, meta.splits["train"].positives, ["train/empty.parquet",
                                                                          *meta.splits["train"].files])
    write_metadata(src, meta)

    relayout(src, tmp_path / "float", "lists", workers=1, dense_format="float")
    relayout(tmp_path / "float", tmp_path / "float2", "lists", workers=1)  # a float dataset read by relayout
    for root in (tmp_path / "float", tmp_path / "float2"):
        meta = read_metadata(root)
        assert meta.dense_format == "float"
        loader = ParquetLoader(split_files(root, meta, "train"), 8, dense_format="float")
        batches = list(loader)
        assert [len(b) for b in batches] == [8, 8, 4]
        want = transform_dense(torch.from_numpy(arrays["train"]["dense"].astype(np.int32))).numpy()
        np.testing.assert_array_equal(torch.cat([b.dense for b in batches]).numpy(), want)
        np.testing.assert_array_equal(torch.cat([b.sparse for b in batches]).numpy(), arrays["train"]["sparse"])


def test_an_empty_row_group_does_not_keep_the_split_from_the_compact_form(tmp_path):
    from tests.test_loader import files_of

    root = tmp_path / "ds"
    arrays = make_dataset(root, {"train": 30}, files_per_split=2, row_group_size=7)
    empty = tmp_path / "empty.parquet"
    write_rows(empty, np.zeros(0), np.zeros((0, 13)), np.zeros((0, 26)), 7)
    files = [empty, *files_of(root)]
    assert pq.ParquetFile(empty).metadata.row_group(0).column(14).statistics is None  # no statistics to go by
    assert compact_sparse_ok([pq.ParquetFile(f).metadata for f in files])
    loader = ParquetLoader(files, 8, compact_sparse=True)
    assert loader._compact  # int32 sparse values on the host (what CUDA devices use by default)
    np.testing.assert_array_equal(torch.cat([b.sparse for b in loader]).numpy(), arrays["train"]["sparse"])
