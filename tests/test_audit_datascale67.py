"""Audit of preprocessing at Criteo 1TB scale (helper datascale67): the table statistics the main process merges,
checkpoints and re-reads; numpy >= 2.3's hashing np.unique in the generator's table sizes."""

import collections
import errno

import numpy as np
import pytest

from dlrm.data import preprocess as pp
from dlrm.data.preprocess import stats
from dlrm.data.preprocess.stats import DistinctCounter, feature_stats
from tests.test_preprocess import FAST, assert_same_dataset, make_fields, write_raw


def test_frequency_merge_does_not_argsort(monkeypatch):
    """Vocabulary hashing merged each feature's (value, count) pairs with a stable argsort (timsort on uint32) and two
    gathers: 160 ns a merged value against 30 for one SIMD sort of value-count keys (40M values: 6.4 s, 1.2 s). The
    main process merges and checkpoints every chunk's statistics, ~1e10 values for Criteo 1TB's big features: about an
    hour there, holding back the workers. The argsort is refused while merging (no clock in a test); the values and
    their capped counts are what a plain count gives."""
    rng = np.random.default_rng(0)
    cap = 3
    chunks = [rng.integers(-1, 2000, 5000) for _ in range(12)] + [rng.integers(0, 2**32, 3000) for _ in range(3)]
    stats = [feature_stats(c, cap) for c in chunks]
    counter = DistinctCounter(count_cap=cap, min_compact=4000)

    def argsort(*args, **kwargs):
        raise AssertionError("np.argsort merged the frequencies (160 ns a value: an hour of Criteo 1TB)")

    monkeypatch.setattr(np, "argsort", argsort)
    for values, counts in stats:
        counter.add(7, values, counts)
    counter.finish()
    vocab = counter.vocabulary(7, 2)
    monkeypatch.undo()

    seen = collections.Counter(int(v) for c in chunks for v in c if v >= 0)
    want = sorted(seen)
    assert counter.values[7].dtype == np.uint32 and counter.values[7].tolist() == want
    assert counter.counts[7].dtype == np.uint32 and counter.counts[7].tolist() == [min(seen[v], cap) for v in want]
    assert vocab.dtype == np.int64 and vocab.tolist() == [v for v in want if seen[v] >= 2]
    assert counter.distinct()[7] == len(want) and counter.distinct()[0] == 0


def test_a_failed_statistics_checkpoint_leaves_no_temporary(tmp_path, monkeypatch):
    """A checkpoint of the statistics is 4-8 bytes a distinct value (3.5-7 GB for Criteo 1TB). One a full disk or a
    Ctrl-C cut short stayed in _progress/ under its temporary name, holding the space the run then lacked."""
    counter = DistinctCounter(count_cap=2)
    counter.add(0, *feature_stats(np.arange(1000), 2))

    def savez(fh, **arrays):
        fh.write(b"\0" * 4096)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(stats.np, "savez", savez)
    with pytest.raises(OSError, match="No space"):
        counter.save(tmp_path / "stats.npz", [(0, 0)])
    assert list(tmp_path.iterdir()) == []


def test_a_killed_checkpoints_temporary_is_removed_when_the_run_resumes(tmp_path):
    """A kill during a checkpoint of the statistics (tens of seconds each at Criteo 1TB's ~8.8e8 distinct values)
    left its temporary file in _progress/ until the run finished: GBs more with each such kill."""
    src = write_raw(tmp_path / "in.tsv", make_fields(400, seed=3))
    out = tmp_path / "out"
    kw = dict(chunk_rows=50, checkpoint_interval=0, hashing="vocabulary", min_frequency=2, **FAST)
    with pytest.raises(pp._Interrupted):
        pp.preprocess([src], out, _max_new_chunks=2, **kw)
    stale = out / pp.PROGRESS_DIR / ".stats.npz.99999.tmp"  # as a killed save leaves it (another pid)
    stale.write_bytes(b"PK\3\4" + b"\0" * 4096)
    with pytest.raises(pp._Interrupted):
        pp.preprocess([src], out, _max_new_chunks=2, **kw)
    assert not stale.exists() and (out / pp.PROGRESS_DIR / "stats.npz").is_file()
    pp.preprocess([src], out, **kw)
    pp.preprocess([src], tmp_path / "ref", **kw)
    assert_same_dataset(out, tmp_path / "ref")


def test_a_resume_rereads_shards_a_few_at_a_time(tmp_path, monkeypatch):
    """A resume re-reads the train shards of the finished chunks its checkpoint does not cover (every one when the
    checkpoint cannot be used). ``pool.map`` submitted them all at once, and the statistics the workers read faster
    than this process merged them waited in memory: 4-8 MB a chunk, tens of GB for Criteo 1TB's 16,000 train chunks.
    At most two a worker are now read ahead of the merge, as when the chunks are parsed."""
    from dlrm.data.preprocess import run as run_mod
    from dlrm.data.preprocess.worker import _stats_from_shard

    src = write_raw(tmp_path / "in.tsv", make_fields(700, seed=5))
    out = tmp_path / "out"
    kw = dict(chunk_rows=50, hashing="vocabulary", min_frequency=2, progress=False)
    with pytest.raises(pp._Interrupted):  # 10 train chunks done, no checkpoint: all of them are re-read
        pp.preprocess([src], out, workers=1, checkpoint_interval=1e9, _max_new_chunks=10, **kw)

    submitted: list[int] = []
    at_first_merge: list[int] = []
    real_start_pool = run_mod.start_pool

    def start_pool(workers, *args, **kwargs):
        pool = real_start_pool(workers, *args, **kwargs)
        submit = pool.submit

        def counting_submit(fn, *a, **k):
            # (``pool.map`` submits ``partial(_process_chunk, fn)`` of a batch of args, here one each)
            if fn is _stats_from_shard or getattr(fn, "args", (None,))[0] is _stats_from_shard:
                submitted.append(1)
            return submit(fn, *a, **k)

        pool.submit = counting_submit
        return pool

    add_stats = DistinctCounter.add_stats

    def counting_add_stats(self, chunk_stats):
        if not at_first_merge:
            at_first_merge.append(len(submitted))
        return add_stats(self, chunk_stats)

    monkeypatch.setattr(run_mod, "start_pool", start_pool)
    monkeypatch.setattr(DistinctCounter, "add_stats", counting_add_stats)
    pp.preprocess([src], out, workers=2, **kw)
    monkeypatch.undo()
    assert len(submitted) == 10 and at_first_merge == [4]  # (10: all of them, before the fix)
    pp.preprocess([src], tmp_path / "ref", workers=1, **kw)
    assert_same_dataset(out, tmp_path / "ref")


def test_small_real_tables_are_counted_without_hashing_unique(tmp_path, monkeypatch):
    """The generator's small-real regime sizes its tables by the distinct train values, which it merged block by block
    with np.union1d: numpy >= 2.3 finds an integer array's distinct values by hashing (3.2 s to add 50k values to 3M,
    0.03 s sorted), every feature, every block, again over all the values so far (2M rows: 21 s, 13 s sorted).
    np.union1d and np.unique's hashing form are refused while it generates; the tables are still the distinct train
    values + 1."""
    import pyarrow.parquet as pq

    from dlrm.data.schema import SPARSE_COLUMNS, read_metadata
    from dlrm.data.synthetic import generate

    real_unique = np.unique

    def hashed(ar, *args, **kwargs):  # the plain form hashes integers (numpy 2.4: 4.7 s for 4M; with counts 0.07 s)
        if args or any(kwargs.get(k) for k in ("return_index", "return_inverse", "return_counts")):
            return real_unique(ar, *args, **kwargs)  # sorted (the oracle AUC's ranks)
        raise AssertionError("np.unique / np.union1d sized the tables (hashing on numpy >= 2.3)")

    monkeypatch.setattr(np, "union1d", hashed)
    monkeypatch.setattr(np, "unique", hashed)
    generate(tmp_path / "syn", rows=3000, regime="small-real", workers=1)
    monkeypatch.undo()
    root = tmp_path / "syn"
    meta = read_metadata(root)
    for f, name in enumerate(SPARSE_COLUMNS):
        col = np.concatenate([pq.read_table(root / p, columns=[name]).column(0).to_numpy()
                              for p in meta.splits["train"].files])
        assert meta.cardinalities[f] == len(set(col[col >= 0].tolist())) + 1
