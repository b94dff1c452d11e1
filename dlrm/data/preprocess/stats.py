"""Distinct values (and frequencies) of the sparse features in the train split."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from dlrm.data.schema import NUM_SPARSE, slot_offsets
from dlrm.errors import os_errors_named


class DistinctCounter:
    """Exact distinct values (and saturating frequencies) of the 26 sparse features.

    Values are the 32-bit hashes (stored as uint32: 4 bytes per distinct value; vocabulary mode
    adds a uint32 count: 8 bytes). Chunks add their sorted unique values to a pending list that
    is merged (sort + dedup) into the feature's sorted array once it is as large as the array,
    so every value is re-sorted O(log) times and memory stays around 2-3x the final tables.
    ``count_cap``: None counts nothing (modulus hashing); otherwise counts saturate at the cap
    (the vocabulary's minimum frequency; only "count >= cap" matters).
    """

    def __init__(self, count_cap: int | None = None, min_compact: int = 1 << 22):
        self.cap = count_cap
        self.min_compact = min_compact
        self.values = [np.empty(0, np.uint32) for _ in range(NUM_SPARSE)]
        self.counts = [np.empty(0, np.uint32) for _ in range(NUM_SPARSE)] if count_cap else None
        self._pending: list[list[tuple[np.ndarray, np.ndarray | None]]] = [[] for _ in range(NUM_SPARSE)]
        self._pending_n = [0] * NUM_SPARSE

    def add(self, feature: int, values: np.ndarray, counts: np.ndarray | None = None) -> None:
        """Add a chunk's sorted distinct values (and counts) of one feature."""
        if values.size == 0:
            return
        self._pending[feature].append((values, counts))
        self._pending_n[feature] += values.size
        if self._pending_n[feature] >= max(self.values[feature].size, self.min_compact):
            self._compact(feature)

    def add_stats(self, stats: list[tuple[np.ndarray, np.ndarray | None]]) -> None:
        """Add a chunk's `sparse_stats`."""
        for f, (v, c) in enumerate(stats):
            self.add(f, v, c)

    def _compact(self, f: int) -> None:
        """Merge feature f's pending values into its sorted array (summing capped counts)."""
        if not self._pending[f]:
            return
        vals = np.concatenate([self.values[f]] + [v for v, _ in self._pending[f]])
        if self.cap is None:
            # sorted, then each run's first value: numpy >= 2.3's np.unique finds an integer array's distinct values
            # by hashing, 1-1.6 us a value on distinct 32-bit hashes (4M: 4.2 s, 40M: 64 s; numpy 2.4.6) where the
            # sort takes 0.02 s for 4M: a Criteo 1TB feature's 293M distinct values took hours to merge
            vals.sort()
            self.values[f] = vals[np.concatenate(([True], vals[1:] != vals[:-1]))] if vals.size else vals
        else:
            assert self.counts is not None
            # each value with its count below it in one uint64 key, sorted by numpy's SIMD sort: the stable argsort
            # (timsort on uint32) and its gathers took 160 ns a merged value, 30 this way (40M: 6.4 s, 1.2 s), in the
            # process that records every chunk and checkpoints: the ~1e10 values Criteo 1TB's big features add were
            # about an hour of it, which held back the workers (equal keys are equal pairs: the order is moot)
            cnts = np.concatenate([self.counts[f]] + [c for _, c in self._pending[f]])
            keys = vals.astype(np.uint64)
            del vals
            keys <<= np.uint64(32)
            keys |= cnts
            del cnts
            keys.sort()
            vals = (keys >> np.uint64(32)).astype(np.uint32)
            keys &= np.uint64(0xFFFFFFFF)
            self.values[f], self.counts[f] = _group_counts(vals, keys, self.cap)
        self._pending[f] = []
        self._pending_n[f] = 0

    def finish(self) -> None:
        for f in range(NUM_SPARSE):
            self._compact(f)

    def distinct(self) -> list[int]:
        self.finish()
        return [int(v.size) for v in self.values]

    def vocabulary(self, feature: int, min_frequency: int) -> np.ndarray:
        """The sorted int64 values seen at least ``min_frequency`` times."""
        self._compact(feature)
        v = self.values[feature]
        if self.counts is not None and min_frequency > 1:
            v = v[self.counts[feature] >= min_frequency]
        return v.astype(np.int64)

    def save(self, path: Path, covered: list[tuple[int, int]]) -> None:
        """Checkpoint the tables and the chunks they cover (atomically)."""
        self.finish()
        arrays = {f"v{f}": self.values[f] for f in range(NUM_SPARSE)}
        if self.counts is not None:
            arrays.update({f"c{f}": self.counts[f] for f in range(NUM_SPARSE)})
        arrays["covered"] = np.asarray(sorted(covered), dtype=np.int64).reshape(-1, 2)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with os_errors_named(path), open(tmp, "wb") as fh:  # (a write's error names no file)
                np.savez(fh, **arrays)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:  # a full disk, Ctrl-C: not GBs of half a checkpoint left (8 bytes a distinct value)
            tmp.unlink(missing_ok=True)
            raise

    def load(self, path: Path) -> set[tuple[int, int]]:
        """Load a checkpoint; returns the chunks it covers."""
        with np.load(path) as z:
            self.values = [z[f"v{f}"] for f in range(NUM_SPARSE)]
            if self.counts is not None:
                self.counts = [z[f"c{f}"] for f in range(NUM_SPARSE)]
            return {(int(a), int(b)) for a, b in z["covered"]}


def _group_counts(sorted_vals: np.ndarray, counts: np.ndarray | None, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct values of a sorted array and their summed counts (1 each if None), capped."""
    if sorted_vals.size == 0:
        return sorted_vals.astype(np.uint32), np.empty(0, np.uint32)
    starts = np.flatnonzero(np.concatenate(([True], sorted_vals[1:] != sorted_vals[:-1])))
    if counts is None:
        summed = np.diff(np.append(starts, sorted_vals.size))
    else:
        summed = np.add.reduceat(counts, starts)
    return sorted_vals[starts], np.minimum(summed, cap).astype(np.uint32)


def sparse_stats(sparse: np.ndarray, count_cap: int | None,
                 multi_hot_sizes: list[int] | None = None) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """Per feature: sorted distinct non-missing values (uint32) and, with a cap, their counts.
    `sparse` is (L, n) in the slots of `multi_hot_sizes` (None: one-hot, (26, n)); every value of
    a multi-hot feature counts (empty slots and missing values do not)."""
    offsets = slot_offsets(multi_hot_sizes)
    return [feature_stats(sparse[offsets[f] : offsets[f + 1]].ravel(), count_cap) for f in range(NUM_SPARSE)]


def feature_stats(col: np.ndarray, count_cap: int | None) -> tuple[np.ndarray, np.ndarray | None]:
    """Sorted distinct values >= 0 (uint32) of one feature's values and, with a cap, their counts."""
    v = col[col >= 0].astype(np.uint32)
    v.sort()
    if count_cap is None:
        keep = np.concatenate(([True], v[1:] != v[:-1])) if v.size else np.empty(0, bool)
        return v[keep], None
    return _group_counts(v, None, count_cap)
