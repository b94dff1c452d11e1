"""A resume whose statistics checkpoint covers a chunk whose shard was damaged or removed since.

The checkpoint was thrown away whole when it covered one chunk no longer recorded as done (`_load_done` drops a
chunk whose shard is missing or whose footer is gone), and every covered chunk's train shard was read again: ~16,000
for Criteo 1TB, 10+ minutes, for one damaged shard. The chunk's statistics are in the checkpoint and the redo reads the
same input: it is redone for its shards only, and its statistics are not added a second time (in vocabulary mode the
counts are summed, saturating at the cap: a second add would lift a value seen once in it to the minimum frequency;
a subtraction cannot be made, the counts being capped and the damaged shard unreadable).
"""

from __future__ import annotations

import pytest

from dlrm.data import preprocess as pp
from dlrm.data.preprocess import run as run_mod
from tests.test_preprocess import FAST, assert_same_dataset, make_fields, write_raw


def _reread_counter(monkeypatch) -> list:
    """Calls of `_stats_from_shard` (the re-read of a train shard) in this process (``workers=1``)."""
    calls: list = []
    real = run_mod._stats_from_shard

    def counting(args):
        calls.append(args)
        return real(args)

    monkeypatch.setattr(run_mod, "_stats_from_shard", counting)
    return calls


@pytest.mark.parametrize(("hashing", "damage"), [("vocabulary", "truncated"), ("vocabulary", "removed"),
                                                   ("modulus", "removed")])
def test_damaged_shard_costs_only_its_chunk(tmp_path, monkeypatch, hashing, damage):
    # a wide pool: values seen once in the train split, which min_frequency 2 leaves out unless counted twice
    src = write_raw(tmp_path / "a.tsv", make_fields(900, seed=67, pool=400))
    kw = dict(chunk_rows=100, hashing=hashing, checkpoint_interval=0.0, **FAST)
    if hashing == "vocabulary":
        kw["min_frequency"] = 2
    pp.preprocess([src], tmp_path / "ref", **kw)
    out = tmp_path / "ds"
    with pytest.raises(pp._Interrupted):
        pp.preprocess([src], out, _max_new_chunks=4, **kw)
    shard = out / "train" / "part-0000-000001.parquet"
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:100])
    else:
        shard.unlink()
    calls = _reread_counter(monkeypatch)
    pp.preprocess([src], out, **kw)
    # the checkpoint (chunks 0-2: the stop comes before the 4th chunk's) kept: only chunk 3's shard re-read
    assert [a[1:3] for a in calls] == [(0, 3)]
    assert_same_dataset(out, tmp_path / "ref")


def test_damaged_shard_with_a_pool(tmp_path):
    """The same with 2 workers (the chunks recorded from the pool's results, the re-reads by `_bounded_map`)."""
    src = write_raw(tmp_path / "a.tsv", make_fields(900, seed=69, pool=400))
    kw = dict(chunk_rows=100, hashing="vocabulary", min_frequency=2, checkpoint_interval=0.0, progress=False)
    pp.preprocess([src], tmp_path / "ref", workers=1, **kw)
    out = tmp_path / "ds"
    with pytest.raises(pp._Interrupted):
        pp.preprocess([src], out, _max_new_chunks=5, workers=1, **kw)
    (out / "train" / "part-0000-000002.parquet").unlink()
    pp.preprocess([src], out, workers=2, **kw)
    assert_same_dataset(out, tmp_path / "ref")


def test_checkpoint_of_chunks_the_run_lacks_is_still_ignored(tmp_path, monkeypatch):
    """A checkpoint covering a chunk that is no chunk of this run's inputs (never redone) is not trusted: its
    statistics could not be matched by any shard, and the finished chunks' shards are re-read instead."""
    import numpy as np

    src = write_raw(tmp_path / "a.tsv", make_fields(500, seed=68))
    kw = dict(chunk_rows=100, hashing="vocabulary", min_frequency=2, checkpoint_interval=0.0, **FAST)
    pp.preprocess([src], tmp_path / "ref", **kw)
    out = tmp_path / "ds"
    with pytest.raises(pp._Interrupted):
        pp.preprocess([src], out, _max_new_chunks=2, **kw)
    ckpt = out / pp.PROGRESS_DIR / "stats.npz"
    with np.load(ckpt) as z:
        arrays = dict(z)
    arrays["covered"] = np.concatenate([arrays["covered"], [[0, 99]]]).astype(np.int64)
    with open(ckpt, "wb") as fh:
        np.savez(fh, **arrays)
    calls = _reread_counter(monkeypatch)
    pp.preprocess([src], out, **kw)
    assert len(calls) == 2
    assert_same_dataset(out, tmp_path / "ref")
