"""Sparse values outside the compact int32 form's range ([-1, 2^32), multi-hot [-2, 2^32)) reach the model as they
are on every path: the loaders used to hand -5 over as 0xFFFFFFFB where they sent int32 bit patterns (the device
loader; the stream loader on CUDA) and as -5 elsewhere (the stream loader on the CPU), another embedding row for the
same file by placement. And footer statistics that promise the range falsely are a named error, not truncation.
"""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from dlrm.data import parquet_loader
from dlrm.data.batch import compact_range
from dlrm.data.device_loader import DeviceLoader
from dlrm.data.host_arena import compact_sparse_ok
from dlrm.data.loader import ParquetLoader
from dlrm.data.schema import DatasetError, NUM_SPARSE, sparse_width
from tests.conftest import write_rows
from tests.test_multihot_data import write_shard

OUTSIDE = [-5, -(2**40), 2**32, 2**32 + 5, 2**62]


def one_hot_file(path, value: int, row: int = 4, column: int = 3):
    """Six rows in row groups of 4, every sparse value 7 except `value` at (`row`, `column`)."""
    sparse = np.full((6, NUM_SPARSE), 7, dtype=np.int64)
    sparse[row, column] = value
    write_rows(path, np.zeros(6), np.arange(78).reshape(6, 13), sparse, 4)
    return sparse


def test_the_compact_range_is_minus_one_or_minus_two_up_to_the_reserved_bit_patterns():
    assert compact_range(False) == (-1, 0xFFFFFFFF) and compact_range(True) == (-2, 0xFFFFFFFE)


@pytest.mark.parametrize("value", OUTSIDE)
def test_footers_showing_a_value_outside_the_range_keep_int64(tmp_path, value):
    one_hot_file(tmp_path / "a.parquet", value)
    footer = pq.ParquetFile(tmp_path / "a.parquet").metadata
    assert not compact_sparse_ok([footer])
    one_hot_file(tmp_path / "b.parquet", -1)
    assert compact_sparse_ok([pq.ParquetFile(tmp_path / "b.parquet").metadata])


@pytest.mark.parametrize("value", OUTSIDE)
def test_every_loader_hands_a_value_outside_the_range_over_as_it_is(tmp_path, value):
    sparse = one_hot_file(tmp_path / "a.parquet", value)
    for compact in (False, True):
        got = np.concatenate([b.sparse.numpy() for b in ParquetLoader([tmp_path / "a.parquet"], 4,
                                                                       compact_sparse=compact)])
        assert np.array_equal(got, sparse), compact
    loader = DeviceLoader([tmp_path / "a.parquet"], 4, "cpu")
    got = np.concatenate([b.sparse.numpy() for b in loader])
    assert np.array_equal(got, sparse)


def test_the_device_loader_keeps_multi_hot_values_below_minus_two(tmp_path):
    sizes = [3] + [1] * (NUM_SPARSE - 1)
    features = [[[5, -9], [], [0xFFFFFFFD]]] + [[1, -1, 2] for _ in range(NUM_SPARSE - 1)]
    write_shard(tmp_path / "m.parquet", np.zeros(3), np.zeros((3, 13)), features, sizes, 3)
    got = np.concatenate([b.sparse.numpy() for b in DeviceLoader([tmp_path / "m.parquet"], 3, "cpu",
                                                                 multi_hot_sizes=sizes)])
    assert got.shape == (3, sparse_width(sizes))
    assert got[:, :3].tolist() == [[5, -9, -2], [-2, -2, -2], [0xFFFFFFFD, -2, -2]]
    assert got[:, 3].tolist() == [1, -1, 2]


@pytest.mark.parametrize("value, row", [(-5, 4), (2**32 + 5, 1), (0xFFFFFFFF, 5)])
def test_statistics_that_promise_the_range_falsely_are_a_named_error(tmp_path, monkeypatch, value, row):
    """The footers chose the compact form (here they are made to: statistics a writer got wrong); the decoded row
    group then names file, column, row and value instead of sending 2^32 + 5 as 5, or 0xFFFFFFFF as missing."""
    one_hot_file(tmp_path / "a.parquet", value, row=row)
    monkeypatch.setattr(parquet_loader, "compact_sparse_ok", lambda footers, bounds: True)
    loader = ParquetLoader([tmp_path / "a.parquet"], 4, compact_sparse=True)
    group, in_group = divmod(row, 4)
    with pytest.raises(DatasetError) as err:
        list(loader)
    assert str(err.value) == (f"{tmp_path / 'a.parquet'}: column SPARSE_3: row index {row} (row group {group}) holds "
                              f"{value}, outside [-1, 4294967295) its footer's statistics promised (wrong statistics, "
                              "or the file changed since it was opened)")
    assert in_group == row - 4 * group


def test_a_list_columns_value_outside_the_range_names_its_row(tmp_path, monkeypatch):
    sizes = [3] + [1] * (NUM_SPARSE - 1)
    features = [[[5], [], [1, 2], [0, 2**33]]] + [[1, -1, 2, 3] for _ in range(NUM_SPARSE - 1)]
    write_shard(tmp_path / "m.parquet", np.zeros(4), np.zeros((4, 13)), features, sizes, 4)
    monkeypatch.setattr(parquet_loader, "compact_sparse_ok", lambda footers, bounds: True)
    loader = ParquetLoader([tmp_path / "m.parquet"], 4, compact_sparse=True, multi_hot_sizes=sizes)
    with pytest.raises(DatasetError, match=r"m\.parquet: column SPARSE_0: row index 3 \(row group 0\) holds "
                                           r"8589934592, outside \[-2, 4294967294\)"):
        list(loader)
    monkeypatch.undo()  # the true statistics keep int64: the value arrives as it is
    got = next(iter(ParquetLoader([tmp_path / "m.parquet"], 4, compact_sparse=True, multi_hot_sizes=sizes)))
    assert got.sparse[3, :3].tolist() == [0, 2**33, -2]
