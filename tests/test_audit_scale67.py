"""Audit of host-side behaviour at scale (helper scale67): what grows with the shards, steps and sessions of a long run."""

import gc

import pyarrow.parquet as pq
import pytest
import torch

from dlrm.data.loader import ParquetLoader, split_files
from dlrm.data.schema import read_metadata
from tests.conftest import make_dataset


def _live_footers() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is pq.FileMetaData)


def _batches(loader: ParquetLoader, epoch: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    loader.set_epoch(epoch)
    return [(b.labels.clone(), b.dense.clone(), b.sparse.clone()) for b in loader]


@pytest.mark.parametrize("shuffle", [True, False])
def test_streaming_loader_keeps_a_bounded_number_of_parsed_footers(tmp_path, monkeypatch, shuffle):
    """A parsed footer is ~8x its bytes on disk (1.65 MB for a file of MLPerf's import: 8 row groups x 228 columns),
    and the loader held every file's for the whole run: 6.5 GB of host memory for MLPerf's ~4,000 train files, in each
    loader of each rank. Only FOOTER_CACHE_BYTES of them are kept; the others are parsed again at each read, and the
    batches are the same."""
    from dlrm.data import footer_cache

    root = tmp_path / "ds"
    make_dataset(root, {"train": 240, "validation": 20}, files_per_split=12, row_group_size=5)
    files = split_files(root, read_metadata(root), "train")
    one = pq.ParquetFile(files[0]).metadata.serialized_size
    reference = ParquetLoader(files, 16, "cpu", shuffle=shuffle, seed=3, shuffle_buffer_rows=50)
    expected = _batches(reference, 0) + _batches(reference, 1)
    del reference

    monkeypatch.setattr(footer_cache, "FOOTER_CACHE_BYTES", 2 * one)  # two files' footers
    # (these tiny row groups cost less to read than their footers to parse: kept past the budget, unless told)
    monkeypatch.setattr(footer_cache, "REPARSE_BYTES_PER_VALUE", float("inf"))
    before = _live_footers()
    loader = ParquetLoader(files, 16, "cpu", shuffle=shuffle, seed=3, shuffle_buffer_rows=50)
    assert _live_footers() - before <= 2  # (12 before the fix)
    got = _batches(loader, 0) + _batches(loader, 1)
    assert _live_footers() - before <= 2
    assert len(got) == len(expected) == 30
    for a, b in zip(got, expected):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    assert loader.num_rows == 240 and loader.codecs == {"SNAPPY"}


def test_a_file_whose_footer_was_not_kept_and_is_gone_is_named(tmp_path, monkeypatch):
    """A footer parsed again at a read: a file removed since the loader opened it stops the run in one line naming it,
    as a kept footer's read did."""
    from dlrm.data import footer_cache
    from dlrm.data.schema import DatasetError

    root = tmp_path / "ds"
    make_dataset(root, {"train": 40, "validation": 20}, files_per_split=2, row_group_size=5)
    files = split_files(root, read_metadata(root), "train")
    monkeypatch.setattr(footer_cache, "FOOTER_CACHE_BYTES", 0)
    loader = ParquetLoader(files, 8, "cpu")
    files[1].unlink()
    with pytest.raises(DatasetError, match="part-00001.parquet"):
        list(loader)


def _planner(row_groups: list[tuple[int, int, int]], batch_size: int, drop_last: bool, shuffle_buffer_rows: int,
             world_size: int = 1, pad_ranks: bool = False) -> ParquetLoader:
    """A ParquetLoader with only what `_plan` reads (a split's row groups from its footers; no files)."""
    loader = object.__new__(ParquetLoader)
    loader.row_groups, loader.shuffle, loader.batch_size = row_groups, True, batch_size
    loader.shuffle_buffer_rows, loader.drop_last, loader.world_size, loader.pad_ranks = \
        shuffle_buffer_rows, drop_last, world_size, pad_ranks
    loader.epoch_ranks = world_size  # (the constructor's: `TrainData` may raise it for a resumed run's epochs)
    return loader


def test_an_epochs_plan_does_not_hold_every_batch(monkeypatch):
    """The plan of an epoch held a (lo, hi) tuple per batch, drawn for each epoch and, chained, for the next one too:
    2.1M tuples (260 MB, 4 s) at batch 2048 over MLPerf's 4.2e9 rows (32,768 row groups of 131,072 rows). Here 1/4 of
    that split's row groups at batch 8192: 131,072 batches in a plan of a few hundred KB."""
    import tracemalloc

    import numpy as np

    loader = _planner([(i // 8, i % 8, 131_072) for i in range(8192)], 8192, True, 1_000_000)
    tracemalloc.start()
    try:
        plan = loader._plan(np.random.default_rng(0))
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert sum(len(f.cuts) for f in plan) == 8192 * 131_072 // 8192
    assert held < 4 << 20, held  # (~16 MB before: a tuple a batch)


@pytest.mark.parametrize("drop_last,world_size,pad_ranks", [(True, 1, False), (False, 1, False), (False, 4, False),
                                                            (False, 4, True)])
def test_the_plans_batches_are_the_ones_it_cut_before(drop_last, world_size, pad_ranks):
    """Every buffer cut as before: its full batches, then the split's last, partial batch where it is delivered."""
    import numpy as np

    from dlrm.data.batch import keeps_last_batch

    sizes = [7, 3, 11, 2, 9, 5, 1, 6]
    loader = _planner([(0, g, n) for g, n in enumerate(sizes)], 4, drop_last, 10, world_size, pad_ranks)
    for seed in range(5):
        carry = 0
        for flush in loader._plan(np.random.default_rng(seed)):
            full = flush.rows // 4 * 4
            want = [(s, s + 4) for s in range(0, full, 4)]
            if flush.final and keeps_last_batch(flush.rows - full, drop_last, world_size, pad_ranks):
                want.append((full, flush.rows))
            assert list(flush.cuts) == want and len(flush.cuts) == len(want)
            assert [flush.cuts[i] for i in range(-len(want), len(want))] == want + want
            assert flush.carry == carry
            carry = flush.rows - full


def test_distinct_counter_merges_by_sorting(monkeypatch):
    """The preprocessor's distinct values (modulus hashing, its default) were merged by np.unique, which numpy >= 2.3
    does by hashing for integers: 1-1.6 us a distinct 32-bit value (4M values: 4.2 s where sorting them takes 0.02 s;
    20M in 20 chunks: 67 s, 0.8 s by sorting; numpy 2.4.6): merging a Criteo 1TB feature's 293M distinct values
    (merged again at each checkpoint of the statistics) took hours in the process that records every chunk."""
    import numpy as np

    from dlrm.data.preprocess.stats import DistinctCounter, feature_stats

    rng = np.random.default_rng(0)
    chunks = [feature_stats(rng.integers(-1, 2**32, 1_000_000), None)[0] for _ in range(4)]
    counter = DistinctCounter(count_cap=None, min_compact=1 << 20)

    def hashed_unique(*args, **kwargs):
        raise AssertionError("np.unique merged the distinct values (hashing on numpy >= 2.3: hours for 293M)")

    # what is slow is np.unique itself (~5 s here by it, ~0.1 s sorted): refused while merging, no clock in a test
    monkeypatch.setattr(np, "unique", hashed_unique)
    for values in chunks:
        counter.add(3, values)
    counter.finish()
    monkeypatch.undo()
    merged = np.sort(np.concatenate(chunks))
    want = merged[np.concatenate(([True], merged[1:] != merged[:-1]))]
    assert counter.values[3].dtype == np.uint32 and np.array_equal(counter.values[3], want)
    assert counter.distinct()[3] == want.size and counter.distinct()[0] == 0

    small = DistinctCounter(count_cap=None, min_compact=2)
    for values in ([5, 9], [1, 5], [9, 12, 30], [], [0]):
        small.add(0, np.asarray(values, np.uint32))
    assert small.vocabulary(0, 1).tolist() == [0, 1, 5, 9, 12, 30]
