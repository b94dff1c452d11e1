"""Review of the preprocessing changes at Criteo 1TB scale (helper review67c): what datascale67's tests left unasserted.
The code held (each test below fails against the mutant its docstring names); these pin it."""

import errno
from concurrent.futures import Future

import numpy as np
import pytest

from dlrm.data.preprocess import stats
from dlrm.data.preprocess.run import _bounded_map
from dlrm.data.preprocess.stats import DistinctCounter


class _InlineExecutor:
    """``submit`` runs the task at once: what `_bounded_map` submits and when, without worker processes."""

    def __init__(self):
        self.submitted: list[int] = []

    def submit(self, fn, arg):
        self.submitted.append(arg)
        fut: Future = Future()
        try:
            fut.set_result(fn(arg))
        except Exception as e:  # as a worker's exception comes back: raised by result()
            fut.set_exception(e)
        return fut


def _fail_at(bad: int):
    def fn(a: int) -> int:
        if a == bad:
            raise ValueError(f"shard {a}: bad")
        return a * 10
    return fn


def test_bounded_map_keeps_its_window_at_every_merge_and_stops_at_a_failure():
    """datascale67's test counted the submissions at the first merge only: a map that bounded its first ``window``
    tasks and then submitted all the rest (the memory of ``pool.map`` again, after one merge) passed it. Here the
    tasks in flight are counted at every merge, the results come in order, and a failing task raises its own
    exception (as ``pool.map`` did, the CLI's message unchanged) with nothing submitted past the window after it."""
    ex = _InlineExecutor()
    in_flight, got = [], []
    for r in _bounded_map(ex, _fail_at(-1), list(range(20)), 4):
        in_flight.append(len(ex.submitted) - len(got))
        got.append(r)
    assert got == [a * 10 for a in range(20)]
    assert max(in_flight) == 4 and in_flight[:3] == [4, 4, 4]

    ex = _InlineExecutor()
    got = []
    with pytest.raises(ValueError, match="shard 5: bad"):
        for r in _bounded_map(ex, _fail_at(5), list(range(20)), 4):
            got.append(r)
    assert got == [0, 10, 20, 30, 40] and ex.submitted == list(range(9))  # 5..8 in flight, none after


def test_frequency_keys_hold_full_32_bit_values_and_counts():
    """The merge packs each uint32 value over its uint32 count in one uint64 key. datascale67's test capped counts at 3,
    so a count field of 2 bits passed it; here the cap is --min-frequency's largest (2^32 - 1), counts that sum past
    32 bits before the cap, and values with the top bit set (a signed key would sort them first)."""
    cap = 2**32 - 1
    top = np.array([0, 5, 2**31 - 1, 2**31, 2**32 - 1], np.uint32)
    counter = DistinctCounter(count_cap=cap, min_compact=1)
    want: dict[int, int] = {}
    rng = np.random.default_rng(3)
    for _ in range(6):
        vals = np.unique(np.concatenate([top, rng.integers(0, 2**32, 50, dtype=np.uint64).astype(np.uint32)]))
        cnts = rng.integers(2**31, 2**32, vals.size, dtype=np.uint64).astype(np.uint32)
        cnts[vals == 5] = 1
        for v, c in zip(vals.tolist(), cnts.tolist()):
            want[v] = want.get(v, 0) + c
        counter.add(0, vals, cnts)
    counter.finish()
    keys = sorted(want)
    assert counter.values[0].dtype == np.uint32 and counter.values[0].tolist() == keys
    assert counter.counts[0].dtype == np.uint32 and counter.counts[0].tolist() == [min(want[k], cap) for k in keys]
    assert counter.counts[0][counter.values[0] == 5].tolist() == [6]  # summed, below the cap
    assert counter.vocabulary(0, cap).tolist() == [k for k in keys if want[k] >= cap]


@pytest.mark.parametrize("where", ["fsync", "replace"])
def test_an_interrupted_statistics_checkpoint_leaves_no_temporary(tmp_path, monkeypatch, where):
    """The save's cleanup names Ctrl-C (SIGTERM raises as it does) as well as a full disk; datascale67's test raised
    OSError inside np.savez only, which an ``except OSError`` passed. A Ctrl-C at the fsync or the rename leaves no
    temporary and the previous checkpoint as it was."""
    path = tmp_path / "stats.npz"
    counter = DistinctCounter(count_cap=2)
    counter.add(0, *stats.feature_stats(np.arange(100), 2))
    counter.save(path, [(0, 0)])
    before = path.read_bytes()
    counter.add(0, *stats.feature_stats(np.arange(50, 300), 2))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(stats.os, where, interrupted)
    with pytest.raises(KeyboardInterrupt):
        counter.save(path, [(0, 0), (0, 1)])
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stats.npz"] and path.read_bytes() == before
    assert DistinctCounter(count_cap=2).load(path) == {(0, 0)}


def test_a_full_disk_at_the_rename_leaves_no_temporary(tmp_path, monkeypatch):
    """(the rename's own OSError: a checkpoint directory gone read-only, or replaced under the run)"""
    counter = DistinctCounter()
    counter.add(3, np.arange(10, dtype=np.uint32))

    def replace(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(stats.os, "replace", replace)
    with pytest.raises(OSError, match="Read-only"):
        counter.save(tmp_path / "stats.npz", [])
    assert list(tmp_path.iterdir()) == []
