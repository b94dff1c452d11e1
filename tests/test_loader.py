"""Loader: batch boundaries, partial batch, dense transform, seeded shuffle, errors."""

import json
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dlrm.data.device_loader import DeviceLoader
from dlrm.data.loader import Batch, ParquetLoader, split_files, transform_dense
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
    # 10-row buffers: the producer is still decoding (or waiting for a free buffer) when the loop breaks
    loader = ParquetLoader(files_of(root), 1, prefetch=1, shuffle_buffer_rows=10)
    others = {t for t in threading.enumerate() if t.name == "parquet-loader"}
    for i, _ in enumerate(loader):
        if i == 2:
            running = [t for t in threading.enumerate() if t.name == "parquet-loader" and t not in others]
            break
    assert len(running) == 1, "no producer thread while iterating"
    assert not running[0].is_alive()  # the break stopped and joined it
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


def test_row_counts_metadata_and_shards_disagree_on_are_named(tiny_dataset):
    """metadata.json's rows against the shards' footers: a shard replaced by another one, or the count edited."""
    root, _ = tiny_dataset
    meta_path = root / "metadata.json"
    meta = json.loads(meta_path.read_text())
    rows = meta["splits"]["train"]["rows"]
    meta["splits"]["train"]["rows"] = 999_999
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(DatasetError, match=rf"metadata.json: splits.train.rows is 999,999 but its \d+ file\(s\) hold "
                                           rf"{rows:,} rows"):
        files_of(root)
    meta["splits"]["train"]["rows"] = rows
    meta_path.write_text(json.dumps(meta))
    (root / "train" / "part-00001.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DatasetError, match=r"part-00001.parquet: not a readable parquet file"):
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
    with pytest.raises(DatasetError, match="schema_version: 9 is not a supported version"):
        read_metadata(tmp_path)


# -- the threaded pipeline against a plain sequential reference ---------------------------------------


def reference_batches(files, batch_size, *, shuffle=False, seed=0, epoch=0, drop_last=False,
                      shuffle_buffer_rows=1_000_000, start_batch=0):
    """The loader's batches as a plain sequential loop (what ParquetLoader did before it was threaded).

    Row groups in file order, or permuted by ``default_rng([seed, epoch])``; decoded row groups
    pile up until they hold >= shuffle_buffer_rows rows, then (rows carried over first) are
    concatenated, permuted by the same generator and cut into batches; the leftover rows are
    carried into the next buffer, and after the last one form the partial batch.
    """
    groups = [(f, g) for f in files for g in range(pq.ParquetFile(f).num_row_groups)]
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(groups)) if shuffle else np.arange(len(groups))
    out, pending, carry = [], [], None

    def flush(final):
        nonlocal carry
        blocks = ([carry] if carry is not None else []) + pending
        if not blocks:
            return
        buf = tuple(np.concatenate([b[i] for b in blocks]) for i in range(3))
        n = len(buf[0])
        idx = rng.permutation(n) if shuffle else np.arange(n)
        full = n // batch_size * batch_size
        out.extend(tuple(a[idx[s:s + batch_size]] for a in buf) for s in range(0, full, batch_size))
        carry = tuple(a[idx[full:]] for a in buf) if full < n else None
        if final and carry is not None:
            if not drop_last:
                out.append(carry)
            carry = None

    for k in order:
        f, g = groups[k]
        t = pq.ParquetFile(f).read_row_group(g)
        pending.append((t.column("label").to_numpy(),
                        np.stack([t.column(f"DENSE_{i}").to_numpy() for i in range(13)], axis=1),
                        np.stack([t.column(f"SPARSE_{i}").to_numpy() for i in range(26)], axis=1)))
        if sum(len(b[0]) for b in pending) >= shuffle_buffer_rows:
            flush(final=False)
            pending.clear()
    flush(final=True)
    return out[start_batch:]


def assert_same_batches(batches, expected, transform_on="cpu"):
    """Exact equality; the reference's dense transform runs on `transform_on`, where the loader's
    did (CUDA's log1p may differ from the CPU's in the last bit)."""
    assert len(batches) == len(expected)
    for b, (label, dense, sparse) in zip(batches, expected):
        np.testing.assert_array_equal(b.sparse.numpy(), sparse)
        np.testing.assert_array_equal(b.labels.numpy(), label.astype(np.float32))
        want = transform_dense(torch.from_numpy(dense).to(transform_on)).cpu().numpy()
        np.testing.assert_array_equal(b.dense.numpy(), want)


@pytest.fixture
def uneven_dataset(tmp_path):
    """Three shards of 70-71 rows in row groups of 13 (the last ones shorter)."""
    from tests.conftest import make_dataset

    root = tmp_path / "uneven"
    make_dataset(root, {"train": 211}, files_per_split=3, row_group_size=13, seed=5)
    return files_of(root)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("batch_size,buffer_rows", [(1, 10), (7, 1), (7, 30), (32, 100), (64, 1_000_000), (50, 40),
                                                    (300, 50)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_batches_equal_the_sequential_reference(uneven_dataset, shuffle, batch_size, buffer_rows, drop_last):
    files = uneven_dataset
    for seed, epoch, compact in [(0, 0, False), (3, 2, True)]:  # compact: int32 sparse on the host (CUDA default)
        loader = ParquetLoader(files, batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last,
                               shuffle_buffer_rows=buffer_rows, prefetch=1, compact_sparse=compact)
        assert loader._compact == compact
        loader.set_epoch(epoch)
        batches = list(loader)  # all held at once: slots are reused, batches must not be
        assert len(batches) == len(loader)
        expected = reference_batches(files, batch_size, shuffle=shuffle, seed=seed, epoch=epoch, drop_last=drop_last,
                                     shuffle_buffer_rows=buffer_rows)
        assert_same_batches(batches, expected)
        ids = np.concatenate([b[1][:, 0] for b in expected]) if expected else np.array([], int)
        if not drop_last:  # every row exactly once
            np.testing.assert_array_equal(np.sort(ids), np.arange(211))


@pytest.mark.parametrize("reader_threads,prefetch", [(1, 1), (8, 3)])
def test_thread_counts_do_not_change_the_batches(uneven_dataset, reader_threads, prefetch):
    loader = ParquetLoader(uneven_dataset, 16, shuffle=True, seed=9, shuffle_buffer_rows=60,
                           reader_threads=reader_threads, prefetch=prefetch)
    for epoch in range(3):
        loader.set_epoch(epoch)
        assert_same_batches(list(loader), reference_batches(uneven_dataset, 16, shuffle=True, seed=9, epoch=epoch,
                                                            shuffle_buffer_rows=60))
    # the loader keeps its host arenas across epochs, never more than it can use at once
    assert 1 <= len(loader._spare_arenas) <= loader._max_arenas == prefetch + 1


@pytest.mark.gpu  # skipped without CUDA by the hook in tests/conftest.py
@pytest.mark.parametrize("shuffle", [False, True])
def test_cuda_batches_equal_the_reference_and_shard_by_rank(uneven_dataset, shuffle):
    """On CUDA: pinned arenas, side-stream uploads, device-side cuts. Same batches as the reference,
    with buffers that carry rows over, a partial last batch, a resume point and rank slices."""
    files, B, rows = uneven_dataset, 16, 30
    expected = reference_batches(files, B, shuffle=shuffle, seed=6, epoch=1, shuffle_buffer_rows=rows)
    loader = ParquetLoader(files, B, "cuda", shuffle=shuffle, seed=6, shuffle_buffer_rows=rows, prefetch=2)
    assert loader._compact  # int32 sparse across the bus: the dataset has no 0xFFFFFFFF
    for start in (0, 5):
        loader.set_epoch(1, start_batch=start)
        batches = list(loader)
        assert all(b.dense.is_cuda and b.sparse.dtype == torch.int64 for b in batches)
        assert_same_batches([_to_cpu(b) for b in batches], expected[start:], "cuda")
    world = 3
    ranks = [ParquetLoader(files, B, "cuda", shuffle=shuffle, seed=6, shuffle_buffer_rows=rows, rank=r,
                           world_size=world) for r in range(world)]
    for r in ranks:
        r.set_epoch(1)
    for parts, (label, dense, sparse) in zip(zip(*ranks), expected):
        assert all(p.global_len == len(label) for p in parts)
        joined = Batch(*(torch.cat([getattr(p, k) for p in parts]).cpu() for k in ("dense", "sparse", "labels")))
        assert_same_batches([joined], [(label, dense, sparse)], "cuda")


def _to_cpu(b):
    return Batch(b.dense.cpu(), b.sparse.cpu(), b.labels.cpu())


@pytest.mark.parametrize("shuffle,buffer_rows", [(False, 50), (True, 50), (True, 1_000_000)])
def test_resume_yields_the_rest_of_the_epoch(uneven_dataset, shuffle, buffer_rows):
    make = lambda: ParquetLoader(uneven_dataset, 24, shuffle=shuffle, seed=4, shuffle_buffer_rows=buffer_rows)
    full = reference_batches(uneven_dataset, 24, shuffle=shuffle, seed=4, epoch=1, shuffle_buffer_rows=buffer_rows)
    for start in (0, 1, 5, len(full) - 1, len(full), len(full) + 3):
        loader = make()
        loader.set_epoch(1, start_batch=start)
        assert_same_batches(list(loader), full[start:])


def test_early_break_then_concurrent_iterations_stay_exact(uneven_dataset):
    loader = ParquetLoader(uneven_dataset, 10, shuffle=True, seed=1, shuffle_buffer_rows=40, prefetch=1)
    expected = reference_batches(uneven_dataset, 10, shuffle=True, seed=1, shuffle_buffer_rows=40)
    for i, _ in enumerate(loader):  # abandoned mid-epoch, with gathers and decodes in flight
        if i == 3:
            break
    assert_same_batches(list(loader), expected)
    pairs = list(zip(loader, loader))  # two iterations at once share the pools, not the buffers or slots
    assert_same_batches([a for a, _ in pairs], expected)
    assert_same_batches([b for _, b in pairs], expected)


@pytest.mark.parametrize("shuffle,buffer_rows", [(False, 1), (True, 1), (True, 20), (True, 1_000_000)])
def test_empty_row_groups_are_harmless(uneven_dataset, tmp_path, shuffle, buffer_rows):
    from tests.conftest import write_rows

    empty = tmp_path / "empty.parquet"
    write_rows(empty, np.zeros(0), np.zeros((0, 13)), np.zeros((0, 26)), 7)
    assert pq.ParquetFile(empty).metadata.num_row_groups == 1
    files = [empty, uneven_dataset[0], empty, uneven_dataset[1]]
    loader = ParquetLoader(files, 9, shuffle=shuffle, seed=2, shuffle_buffer_rows=buffer_rows)
    assert_same_batches(list(loader), reference_batches(files, 9, shuffle=shuffle, seed=2,
                                                        shuffle_buffer_rows=buffer_rows))


def test_unreadable_row_group_raises_dataset_error_naming_it(tiny_dataset):
    root, _ = tiny_dataset
    files = files_of(root)
    loader = ParquetLoader(files, 8)  # footers read here; now the data pages of the second shard go bad
    data = bytearray(files[1].read_bytes())
    data[4 : len(data) // 2] = b"\xff" * (len(data) // 2 - 4)
    files[1].write_bytes(bytes(data))
    with pytest.raises(DatasetError, match=r"part-00001.parquet: row group \d+: cannot be read"):
        list(loader)


def test_unreadable_file_is_named(tmp_path):
    bad = tmp_path / "junk.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(DatasetError, match=r"junk.parquet: not a readable parquet file"):
        ParquetLoader([bad], 4)


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


def test_device_permutation_hash_matches_uint64_splitmix_and_is_a_permutation():
    from dlrm.data.device_loader import device_permutation, splitmix64
    from dlrm.data.preprocess import _splitmix64

    x = np.array([0, 1, 2**31, 2**32 + 7, 2**63 - 1, 2**63, 2**64 - 1, 0x9E3779B97F4A7C15], dtype=np.uint64)
    x = np.concatenate([x, np.random.default_rng(0).integers(0, 2**64 - 1, 1000, dtype=np.uint64)])
    with np.errstate(over="ignore"):
        ref = _splitmix64(x)
    got = splitmix64(torch.from_numpy(x.view(np.int64))).numpy().view(np.uint64)
    np.testing.assert_array_equal(got, ref)
    p = device_permutation(1001, seed=3, epoch=2, device="cpu")
    assert torch.equal(torch.sort(p).values, torch.arange(1001))
    assert torch.equal(p, device_permutation(1001, 3, 2, "cpu"))
    assert not torch.equal(p, device_permutation(1001, 3, 1, "cpu"))
    assert not torch.equal(p, device_permutation(1001, 4, 2, "cpu"))


@pytest.mark.parametrize("shuffle", [False, True])
def test_stream_loader_moves_sparse_compactly_and_exactly(tmp_path, shuffle):
    """Sparse values cross the host buffers (and the bus) as int32 bit patterns when the footers
    show no 0xFFFFFFFF, and come out as the exact int64 raw values either way."""
    from tests.conftest import write_rows

    edge = [-1, 0, 1, 2**31 - 1, 2**31, 2**32 - 2]
    sparse = np.array([(edge * 5)[:26], (edge[::-1] * 5)[:26], [7] * 26], dtype=np.int64)
    write_rows(tmp_path / "a.parquet", np.zeros(3), np.zeros((3, 13)), sparse, 2)
    assert not ParquetLoader([tmp_path / "a.parquet"], 3)._compact  # not by default on the CPU
    loader = ParquetLoader([tmp_path / "a.parquet"], 3, shuffle=shuffle, seed=1, compact_sparse=True)
    assert loader._compact
    got = next(iter(loader)).sparse
    assert got.dtype == torch.int64
    if shuffle:  # the same rows, in the shuffled order
        assert sorted(got.numpy().tolist()) == sorted(sparse.tolist())
    else:
        np.testing.assert_array_equal(got.numpy(), sparse)

    sparse[1, 4] = 2**32 - 1  # its low 32 bits equal -1's: the loader must keep int64
    write_rows(tmp_path / "b.parquet", np.zeros(3), np.zeros((3, 13)), sparse, 2)
    loader = ParquetLoader([tmp_path / "b.parquet"], 3, compact_sparse=True)
    assert not loader._compact
    np.testing.assert_array_equal(next(iter(loader)).sparse.numpy(), sparse)
