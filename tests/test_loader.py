"""Loader: batch boundaries, partial batch, dense transform, seeded shuffle, errors."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dlrm.data.device_loader import DeviceLoader
from dlrm.data.loader import ParquetLoader, split_files, transform_dense
from dlrm.data.schema import DatasetError, read_metadata


def files_of(root, split="train"):
    return split_files(root, read_metadata(root), split)


def collect(loader):
    batches = list(loader)
    ids = np.concatenate([b.dense[:, 0].numpy() for b in batches])
    return batches, np.expm1(ids).round().astype(int)  # DENSE_0 == row index, undone from log1p


@pytest.mark.parametrize("batch_size,drop_last", [(1, False), (7, False), (7, True), (32, True), (32, False), (100, True), (128, False)])
def test_batch_boundaries_and_partial_batch(tiny_dataset, batch_size, drop_last):
    root, arrays = tiny_dataset
    loader = ParquetLoader(files_of(root), batch_size, drop_last=drop_last)
    batches, ids = collect(loader)
    n = 100
    assert len(batches) == len(loader)
    sizes = [len(b) for b in batches]
    full, rest = divmod(n, batch_size)
    assert sizes == [batch_size] * full + ([rest] if rest and not drop_last else [])
    # Without shuffling, rows come in file order.
    np.testing.assert_array_equal(ids, np.arange(sum(sizes)))


def test_values_dtypes_and_transform(tiny_dataset):
    root, arrays = tiny_dataset
    (batch,) = list(ParquetLoader(files_of(root, "validation"), 30))
    a = arrays["validation"]
    assert batch.dense.dtype == torch.float32 and batch.dense.shape == (30, 13)
    assert batch.sparse.dtype == torch.int64 and batch.sparse.shape == (30, 26)
    assert batch.labels.dtype == torch.float32 and batch.labels.shape == (30,)
    expected_dense = np.log1p(np.maximum(a["dense"], 0)).astype(np.float32)
    np.testing.assert_allclose(batch.dense.numpy(), expected_dense, rtol=1e-6)
    np.testing.assert_array_equal(batch.sparse.numpy(), a["sparse"])
    np.testing.assert_array_equal(batch.labels.numpy(), a["label"])


def test_transform_dense_clamps_negatives():
    out = transform_dense(torch.tensor([[-3, 0, 1, 9]], dtype=torch.int32))
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.0, np.log(2.0), np.log(10.0)]], dtype=torch.float32))


@pytest.mark.parametrize("buffer_rows", [10, 1_000_000])
def test_shuffle_is_seeded_and_covers_every_row_once(tiny_dataset, buffer_rows):
    root, _ = tiny_dataset
    make = lambda seed: ParquetLoader(files_of(root), 8, shuffle=True, seed=seed, shuffle_buffer_rows=buffer_rows)
    _, a = collect(make(1))
    _, b = collect(make(1))
    _, c = collect(make(2))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert sorted(a) == list(range(100))  # every row exactly once (drop_last False)
    loader = make(1)
    loader.set_epoch(1)
    _, next_epoch = collect(loader)
    assert not np.array_equal(a, next_epoch) and sorted(next_epoch) == list(range(100))


def test_early_break_stops_the_producer(tiny_dataset):
    root, _ = tiny_dataset
    loader = ParquetLoader(files_of(root), 1, prefetch=1)
    for i, _ in enumerate(loader):
        if i == 2:
            break
    assert len(list(loader)) == 100  # a fresh iteration still works


def test_wrong_schema_names_file_and_column(tmp_path):
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"label": pa.array([1], pa.int8())}), bad)
    with pytest.raises(DatasetError, match=r"bad.parquet: column DENSE_0: missing"):
        ParquetLoader([bad], 4)


def test_missing_listed_file_is_named(tiny_dataset):
    root, _ = tiny_dataset
    (root / "train" / "part-00001.parquet").unlink()
    with pytest.raises(DatasetError, match=r"part-00001.parquet: listed in metadata.json splits.train but missing"):
        files_of(root)


def test_metadata_errors_name_the_key(tmp_path):
    with pytest.raises(DatasetError, match="metadata.json: missing"):
        read_metadata(tmp_path)
    (tmp_path / "metadata.json").write_text('{"schema_version": 1, "cardinalities": [3, 0]}')
    with pytest.raises(DatasetError, match="cardinalities: must be a list of 26"):
        read_metadata(tmp_path)
    (tmp_path / "metadata.json").write_text('{"schema_version": 1, "cardinalities": ' + str([3] * 25 + [0]) + "}")
    with pytest.raises(DatasetError, match=r"cardinalities\[25\]: 0 is not a positive integer"):
        read_metadata(tmp_path)
    (tmp_path / "metadata.json").write_text('{"schema_version": 9}')
    with pytest.raises(DatasetError, match="schema_version: 9 is not the supported version 1"):
        read_metadata(tmp_path)


# -- the device-resident loader (data.placement "gpu"); on CPU here, the same code runs on CUDA --------


@pytest.mark.parametrize("batch_size,drop_last", [(1, False), (7, True), (32, False), (128, False)])
def test_device_loader_matches_the_stream_loader_in_file_order(tiny_dataset, batch_size, drop_last):
    root, _ = tiny_dataset
    stream = list(ParquetLoader(files_of(root), batch_size, drop_last=drop_last))
    resident = DeviceLoader(files_of(root), batch_size, "cpu", drop_last=drop_last)
    batches = list(resident)
    assert len(batches) == len(resident) == len(stream)
    for a, b in zip(stream, batches):
        assert b.sparse.dtype == torch.int64 and b.dense.dtype == torch.float32 and b.labels.dtype == torch.float32
        torch.testing.assert_close(b.dense, a.dense, rtol=0, atol=0)
        torch.testing.assert_close(b.sparse, a.sparse, rtol=0, atol=0)
        torch.testing.assert_close(b.labels, a.labels, rtol=0, atol=0)


def test_device_loader_keeps_32_bit_values_exactly_in_int32(tmp_path):
    from tests.conftest import write_rows
    from dlrm.data.schema import Metadata, SplitInfo, write_metadata

    sparse = np.array([[-1, 0, 1, 2**31 - 1, 2**31, 2**32 - 2] * 4 + [5, 6]] * 3, dtype=np.int64)
    write_rows(tmp_path / "train/p.parquet", np.zeros(3), np.zeros((3, 13)), sparse, 2)
    write_metadata(tmp_path, Metadata(cardinalities=[5] * 26, splits={"train": SplitInfo(3, 0, ["train/p.parquet"])}))
    loader = DeviceLoader(files_of(tmp_path), 3, "cpu")
    assert loader.sparse.dtype == torch.int32  # 4 bytes a value
    np.testing.assert_array_equal(next(iter(loader)).sparse.numpy(), sparse)

    sparse[1, 4] = 2**32 - 1  # its bits equal -1's: the loader must keep int64 to stay exact
    write_rows(tmp_path / "train/p.parquet", np.zeros(3), np.zeros((3, 13)), sparse, 2)
    loader = DeviceLoader(files_of(tmp_path), 3, "cpu")
    assert loader.sparse.dtype == torch.int64
    np.testing.assert_array_equal(next(iter(loader)).sparse.numpy(), sparse)


def test_device_loader_shuffles_every_row_once_per_epoch_and_resumes(tiny_dataset):
    root, _ = tiny_dataset
    loader = DeviceLoader(files_of(root), 8, "cpu", shuffle=True, seed=3, drop_last=False)
    orders = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        _, ids = collect(loader)
        np.testing.assert_array_equal(np.sort(ids), np.arange(100))
        orders.append(ids)
    assert not np.array_equal(orders[0], orders[1]) and not np.array_equal(orders[0], np.arange(100))
    # the same (seed, epoch) repeats; starting at batch 5 yields exactly the rest of that epoch
    loader.set_epoch(1, start_batch=5)
    _, rest = collect(loader)
    np.testing.assert_array_equal(rest, orders[1][5 * 8:])


def test_placement_gpu_trains_through_the_trainer(tiny_dataset, tmp_path):
    from dlrm.config import load_config
    from dlrm.train.trainer import train
    from tests.conftest import REPO

    root, _ = tiny_dataset
    runs = {}
    for placement in ("stream", "gpu"):
        cfg = load_config(REPO / "configs/sample.json", {
            "data.path": str(root), "data.placement": placement, "data.batch_size": 16, "data.shuffle": False,
            "train.epochs": 1, "train.device": "cpu", "log.tb_dir": str(tmp_path), "log.run_name": placement,
        })
        runs[placement] = train(cfg)
    # without shuffling both loaders deliver the same batches, so training is identical
    assert runs["gpu"]["train_losses"] == runs["stream"]["train_losses"]
    assert runs["gpu"]["auc"] == pytest.approx(runs["stream"]["auc"], abs=1e-6)
