"""Both loaders row by row against pyarrow's own reading of the files: features and labels stay together under
shuffling and rank slicing (no rank left empty), a row group that decodes short of its footer is refused, values
stored before the value that sends the device loader to int64 stay exact, and the host block's blocked transpose
keeps every row."""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dlrm.data import host_arena
from dlrm.data.batch import rank_slice
from dlrm.data.device_loader import DeviceLoader
from dlrm.data.host_arena import _HostBlock
from dlrm.data.loader import ParquetLoader, split_files
from dlrm.data.schema import (DENSE_COLUMNS, LABEL_COLUMN, NUM_SPARSE, PAD_SPARSE, SPARSE_COLUMNS, DatasetError,
                              read_metadata, sparse_columns)
from tests.conftest import write_rows
from tests.test_multihot_data import SIZES, random_lists, reference_rows, write_shard


def stored_rows(files):
    """(label [n], dense [n, 13], sparse [n, 26]) of one-hot files, straight from pyarrow, in file order."""
    tables = [pq.read_table(f) for f in files]
    label = np.concatenate([t.column(LABEL_COLUMN).to_numpy() for t in tables])
    dense = np.concatenate([np.stack([t.column(c).to_numpy() for c in DENSE_COLUMNS], axis=1) for t in tables])
    sparse = np.concatenate([np.stack([t.column(c).to_numpy() for c in SPARSE_COLUMNS], axis=1) for t in tables])
    return label, dense, sparse


def assert_rows_are_the_files(batches, files):
    """Every delivered row (found by DENSE_0, the row index) holds its file row's label, dense and sparse values."""
    label, dense, sparse = stored_rows(files)
    got_dense = torch.cat([b.dense for b in batches]).numpy()
    ids = np.expm1(got_dense[:, 0].astype(np.float64)).round().astype(np.int64)
    np.testing.assert_allclose(got_dense, np.log1p(np.maximum(dense[ids], 0)), rtol=1e-6)  # numpy's log1p, not torch's
    np.testing.assert_array_equal(torch.cat([b.sparse for b in batches]).numpy(), sparse[ids])
    np.testing.assert_array_equal(torch.cat([b.labels for b in batches]).numpy(), label[ids].astype(np.float32))
    return ids


LOADERS = {
    "stream": lambda files, batch_size, **kw: ParquetLoader(files, batch_size, shuffle_buffer_rows=30, **kw),
    "device": lambda files, batch_size, **kw: DeviceLoader(files, batch_size, "cpu", **kw),
}


@pytest.mark.parametrize("kind", list(LOADERS))
def test_shuffled_rows_keep_their_labels_and_features_every_epoch(tiny_dataset, kind):
    root, _ = tiny_dataset
    files = split_files(root, read_metadata(root), "train")
    loader = LOADERS[kind](files, 16, shuffle=True, seed=7)
    orders = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        ids = assert_rows_are_the_files(list(loader), files)
        np.testing.assert_array_equal(np.sort(ids), np.arange(100))  # every row once
        orders.append(ids)
    assert not np.array_equal(orders[0], orders[1]) and not np.array_equal(orders[0], np.arange(100))


def test_rank_slices_are_balanced_and_cover_the_batch():
    for n in range(0, 41):
        for world in (1, 2, 3, 4, 8):
            slices = [rank_slice(100, 100 + n, r, world) for r in range(world)]
            assert slices[0][0] == 100 and slices[-1][1] == 100 + n
            assert all(a1 == b0 for (_, a1), (b0, _) in zip(slices, slices[1:]))  # contiguous, in rank order
            sizes = [b - a for a, b in slices]
            assert min(sizes) >= 0 and sizes == sorted(sizes, reverse=True)
            assert max(sizes) == -(-n // world)  # no rank holds more than its share
            if n >= world:  # a batch the loaders keep: every rank gets rows (an empty rank's mean loss is NaN)
                assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("kind", list(LOADERS))
def test_rank_slices_of_labels_and_dense_join_to_the_global_batch(tiny_dataset, kind):
    root, _ = tiny_dataset
    files = split_files(root, read_metadata(root), "train")
    whole = list(LOADERS[kind](files, 12, shuffle=True, seed=3))
    world = 3
    parts = [list(LOADERS[kind](files, 12, shuffle=True, seed=3, rank=r, world_size=world)) for r in range(world)]
    assert all(len(p) == len(whole) for p in parts)
    for i, batch in enumerate(whole):
        for key in ("dense", "sparse", "labels"):
            assert torch.equal(torch.cat([getattr(p[i], key) for p in parts]), getattr(batch, key)), (i, key)
        assert all(p[i].global_len == len(batch) for p in parts)
        assert all(len(p[i]) >= 1 for p in parts)  # the last batch, 4 rows: no rank empty
        if len(batch) == 12:
            assert [len(p[i]) for p in parts] == [4, 4, 4]


@pytest.mark.parametrize("kind", list(LOADERS))
def test_a_row_group_shorter_than_its_footer_is_named(tiny_dataset, monkeypatch, kind):
    """A row group that decodes to fewer rows than the footer the plan was made from (a file changed under the
    loader) is a DatasetError naming the file and row group, not a batch of stale rows."""
    root, _ = tiny_dataset
    files = split_files(root, read_metadata(root), "train")
    read = pq.ParquetFile.read_row_group

    def short(self, i, *args, **kwargs):
        table = read(self, i, *args, **kwargs)
        return table.slice(0, table.num_rows - 1) if i == 1 else table

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", short)
    message = re.escape(f"{files[0]}: row group 1: has 6 rows, its footer said 7")
    with pytest.raises(DatasetError, match=message):
        list(LOADERS[kind](files, 8, reader_threads=1) if kind == "stream" else LOADERS[kind](files, 8))


def test_device_loader_widens_rows_stored_before_the_value_that_needs_int64(tmp_path):
    """0xFFFFFFFF in the third row group: the rows of the first two, already stored as int32 bit patterns, must come
    back as their raw values (2**31 and up, and -1) in the int64 copy."""
    rng = np.random.default_rng(0)
    sparse = rng.integers(-1, 2**32 - 1, (6, NUM_SPARSE))
    sparse[:4, :3] = [-1, 2**31, 2**32 - 2]
    sparse[5, 7] = 2**32 - 1
    write_rows(tmp_path / "p.parquet", rng.integers(0, 2, 6), rng.integers(0, 9, (6, 13)), sparse, 2)
    loader = DeviceLoader([tmp_path / "p.parquet"], 6, "cpu")
    assert loader.sparse.dtype == torch.int64
    np.testing.assert_array_equal(next(iter(loader)).sparse.numpy(), sparse)


def test_multi_hot_device_loader_keeps_padding_when_it_turns_to_int64(tmp_path):
    """Multi-hot: 0xFFFFFFFE (-2's bits) in the second row group; the first group's empty slots stay PAD_SPARSE."""
    rng = np.random.default_rng(1)
    features = random_lists(rng, 6, SIZES)
    features[0][:3] = [[], [2**31], [5, 2**32 - 3]]  # short lists in the first row group: padded slots
    features[3][4] = [0xFFFFFFFE]
    path = tmp_path / "m.parquet"
    write_shard(path, rng.integers(0, 2, 6), rng.integers(0, 9, (6, 13)), features, SIZES, 3)
    loader = DeviceLoader([path], 6, "cpu", multi_hot_sizes=SIZES)
    assert loader.sparse.dtype == torch.int64
    got = next(iter(loader)).sparse.numpy()
    np.testing.assert_array_equal(got, reference_rows([path], SIZES)[1])
    assert (got[:3, :3] == PAD_SPARSE).sum() == 3 + 2 + 1


@pytest.mark.parametrize("layout", ["one-hot", "lists", "slots"])
def test_host_block_keeps_every_row_across_transpose_blocks(tmp_path, monkeypatch, layout):
    """`_HostBlock.write` transposes in blocks of `_TRANSPOSE_ROWS` rows (16384; real row groups hold many more):
    with blocks of 3 rows, 10 rows written at row 2 land exactly where a plain column stack puts them."""
    monkeypatch.setattr(host_arena, "_TRANSPOSE_ROWS", 3)
    rng = np.random.default_rng(2)
    n = 10
    label, dense = rng.integers(0, 2, n), rng.integers(-3, 1000, (n, 13))
    sizes = None if layout == "one-hot" else SIZES
    if layout == "one-hot":
        write_rows(tmp_path / "t.parquet", label, dense, rng.integers(-1, 2**32, (n, NUM_SPARSE)), n)
    else:
        write_shard(tmp_path / "t.parquet", label, dense, random_lists(rng, n, SIZES), SIZES, n)
    table = pq.read_table(tmp_path / "t.parquet")
    sparse = reference_rows([tmp_path / "t.parquet"], sizes or [1] * NUM_SPARSE)[1]
    if layout == "slots":  # the same rows as one int64 column a slot
        slots = {c: pa.array(sparse[:, k]) for k, c in enumerate(sparse_columns(SIZES, "slots"))}
        table = pa.table({LABEL_COLUMN: table.column(LABEL_COLUMN), **{c: table.column(c) for c in DENSE_COLUMNS},
                          **slots})
    block = _HostBlock(np.zeros(n + 2, np.int8), np.zeros((n + 2, 13), np.int32),
                       np.zeros((n + 2, sparse.shape[1]), np.int64))
    block.write(table, 2, sizes, "slots" if layout == "slots" else "lists")
    np.testing.assert_array_equal(block.label[2:], label)
    np.testing.assert_array_equal(block.dense[2:], dense)
    np.testing.assert_array_equal(block.sparse[2:], sparse)
    assert not block.dense[:2].any() and not block.sparse[:2].any()  # rows before `at` untouched
