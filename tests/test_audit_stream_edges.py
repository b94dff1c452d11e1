"""Audit tests of the loaders' parallel and streaming machinery: rank sharding, epoch chaining, errors that reach the
consumer as one named line."""

from __future__ import annotations

import pytest

from dlrm.data.device_loader import DeviceLoader
from dlrm.data.loader import ParquetLoader, split_files
from dlrm.data.schema import DatasetError, read_metadata
from dlrm.errors import ConfigError
from tests.conftest import make_dataset


def _train_files(tmp_path, rows=40, **kw):
    root = tmp_path / "ds"
    make_dataset(root, {"train": rows, "validation": 10}, **kw)
    return split_files(root, read_metadata(root), "train")


@pytest.mark.parametrize("kind", ["stream", "gpu"])
def test_a_global_batch_smaller_than_the_ranks_is_refused_in_training(tmp_path, kind):
    """Batch 2 on 3 ranks left rank 2 without a row in every batch (not only the last): its mean loss was NaN, and a
    three-process run stopped at step 1 with "loss became NaN". Refused in one line naming data.batch_size; an
    evaluation (pad_ranks) pads the empty rank instead, and a batch of as many rows as ranks is fine."""
    files = _train_files(tmp_path, rows=10)
    make = (lambda **kw: ParquetLoader(files, device="cpu", **kw)) if kind == "stream" else \
        (lambda **kw: DeviceLoader(files, device="cpu", **kw))
    with pytest.raises(ConfigError, match=r"^data\.batch_size: 2 is less than the 3 ranks"):
        make(batch_size=2, rank=2, world_size=3)
    padded = make(batch_size=2, rank=2, world_size=3, pad_ranks=True)
    assert [(len(b), b.pad) for b in padded] == [(1, 1)] * 5  # a copy of each batch's last row, left out of metrics
    rows = [[len(b) for b in make(batch_size=3, rank=r, world_size=3)] for r in range(3)]
    assert rows == [[1, 1, 1]] * 3  # 3 full batches of one row a rank; the 10th row (fewer than ranks) dropped


@pytest.mark.parametrize("failure", [DatasetError("part-00000.parquet: column SPARSE_3: bad"), KeyboardInterrupt()])
def test_relayout_stops_at_the_first_failure_instead_of_rewriting_every_other_file(tmp_path, monkeypatch, failure):
    """A bad first file (or a Ctrl-C, which reaches the main thread the same way) used to be reported only after the
    thread pool's exit had rewritten every other queued file of the dataset (hours on a large one; Ctrl-C seemed to
    hang). The queued files are now dropped, and no temporary directory is left."""
    import time

    from dlrm.data import relayout as relayout_module

    root = tmp_path / "ds"
    make_dataset(root, {"train": 60, "validation": 20}, files_per_split=4)
    started = []

    def fake(src, *args, **kwargs):
        started.append(src.name)
        if len(started) == 1:
            raise failure
        time.sleep(0.2)
        return 0

    monkeypatch.setattr(relayout_module, "relayout_file", fake)
    out = tmp_path / "out"
    begin = time.monotonic()
    with pytest.raises(type(failure)):
        relayout_module.relayout(root, out, "slots", workers=1)
    # the one worker may have taken the next file before the main thread saw the failure; the 6 others are dropped
    # (all 7 were rewritten after the failure before the fix)
    assert started[0] == "part-00000.parquet" and len(started) <= 2, started
    assert time.monotonic() - begin < 1.0
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


def test_the_device_loader_keeps_no_file_open_per_shard(tmp_path):
    """`DeviceLoader` kept every shard's reader (an open file) until the whole split was loaded: a split of more
    shards than the open-file limit (1024 by default on many hosts) failed with a DatasetError calling a sound
    shard unreadable ("Too many open files"). Here the limit is set a few files above those already open, and a
    split of 40 one-row-group shards loads, as the stream loader's does (it opens a file for each read)."""
    import os
    import resource

    import numpy as np

    from tests.conftest import write_rows

    files = []
    for i in range(40):
        files.append(tmp_path / f"part-{i:05d}.parquet")
        write_rows(files[-1], np.full(2, i % 2), np.full((2, 13), i), np.full((2, 26), i), 2)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard))
    try:
        loader = DeviceLoader(files, 8, "cpu")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert loader.num_rows == 80
    np.testing.assert_array_equal(loader.sparse[:, 0].numpy(), np.repeat(np.arange(40), 2))


def test_a_failure_decoding_the_next_epoch_ahead_does_not_fail_the_epoch_being_cut(tmp_path):
    """With chain_epochs the producer decodes the next epoch while this one's last buffer is cut. A read that failed
    there (a shard gone or damaged after this epoch read it) was raised at once, inside this epoch: its remaining
    batches were lost (all of them when the split is one shuffle buffer), and a run in its last epoch failed on data
    it never needed. The error now comes with the next epoch's first batch, the one that needs that buffer."""
    import threading

    from tests.test_loader import assert_same_batches, reference_batches

    files = _train_files(tmp_path, rows=200, row_group_size=13)
    loader = ParquetLoader(files, 16, shuffle=True, seed=1, chain_epochs=True, prefetch=2)
    groups, calls = len(loader.row_groups), []
    decode = loader._decode

    def failing_after_epoch_0(k, out, at):
        calls.append(k)
        if len(calls) > groups:  # epoch 1's reads
            raise DatasetError(f"{files[0]}: row group 0: cannot be read (gone)")
        decode(k, out, at)

    loader._decode = failing_after_epoch_0
    batches, others = [], set(threading.enumerate())
    try:
        for batch in loader:  # epoch 0
            if not batches:  # let the producer fail on epoch 1 before the rest of epoch 0 is cut
                for t in set(threading.enumerate()) - others:
                    if t.name == "parquet-loader":
                        t.join(timeout=10)
            batches.append(batch)
        assert_same_batches(batches, reference_batches(files, 16, shuffle=True, seed=1, epoch=0))
        loader.set_epoch(1)
        with pytest.raises(DatasetError, match=r"part-00000\.parquet: row group 0: cannot be read \(gone\)$"):
            next(iter(loader))
    finally:
        loader.close()


def test_relayout_counts_the_nulls_it_replaces_in_a_warning(tmp_path):
    """The loaders replace null dense values by 0 and null categories by -1 "counted in a warning" (README); relayout
    replaced them by the same policy but said nothing, and its copy holds no nulls, so no loader warns about it
    either: the replaced values became silent data. It now logs the loaders' warning for the file it rewrites."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from loguru import logger

    from dlrm.data.relayout import relayout

    root = tmp_path / "ds"
    make_dataset(root, {"train": 30, "validation": 10})
    shard = root / "train" / "part-00000.parquet"
    table = pq.read_table(shard)
    schema = pa.schema([pa.field(f.name, f.type, nullable=True) for f in table.schema])
    dense = table.column("DENSE_1").to_numpy()
    table = table.set_column(2, "DENSE_1", pa.array(dense, mask=np.arange(len(dense)) % 3 == 0)).cast(schema)
    pq.write_table(table, shard, row_group_size=7)
    logger.enable("dlrm")
    messages: list[str] = []
    handle = logger.add(lambda m: messages.append(m.record["message"]), level="WARNING")
    try:
        relayout(root, tmp_path / "out", "slots", workers=1)
    finally:
        logger.remove(handle)
    out = pq.read_table(tmp_path / "out" / "train" / "part-00000.parquet").column("DENSE_1").to_numpy()
    assert (out[::3] == 0).all()  # the nulls, replaced as the loaders replace them
    assert [m for m in messages if "null" in m] == [f"{shard}: 5 null dense values replaced by 0 (DENSE_1 5)"]
