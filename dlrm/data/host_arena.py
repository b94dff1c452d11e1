"""Decoded rows on the host: the row-major `_HostBlock` and the column-major `_Arena`.

Reader threads copy a decoded row group's columns into these buffers (numpy releases the GIL for
the copies, so several threads fill disjoint row ranges at once). `compact_sparse_ok` decides from
the footers whether sparse values may travel as int32 bit patterns (see `widen_sparse`).

Sparse values land in L = ``sum(multi_hot_sizes)`` slots a row (`dlrm.data.schema.slot_offsets`):
a one-hot column fills its one slot, a multi-hot list column its ``size`` slots, values first and
`PAD_SPARSE` after them (`list_slots`, vectorized over the rows: no Python loop per row).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from dlrm.data.batch import _LOW32
from dlrm.data.schema import (
    DENSE_COLUMNS,
    LABEL_COLUMN,
    NUM_DENSE,
    NUM_SPARSE,
    PAD_SPARSE,
    SPARSE_COLUMNS,
    is_multi_hot,
    slot_offsets,
)
from dlrm.data.validation import list_lengths

_COLUMNS = [LABEL_COLUMN, *DENSE_COLUMNS, *SPARSE_COLUMNS]


def compact_sparse_ok(footers: list[pq.FileMetaData], limit: int = _LOW32) -> bool:
    """Whether every sparse value fits the compact int32 form (all below `limit`: 0xFFFFFFFF, or
    `compact_limit(True)` for multi-hot data), from the footers' max statistics alone; False when
    any row group lacks them. A list column's statistics are those of its values' leaf column."""
    sparse = set(SPARSE_COLUMNS)
    for meta in footers:
        for g in range(meta.num_row_groups):
            rg = meta.row_group(g)
            for i in range(rg.num_columns):
                column = rg.column(i)
                if column.path_in_schema.split(".")[0] not in sparse:
                    continue
                stats = column.statistics
                if stats is None or not stats.has_min_max or stats.max >= limit:
                    return False
    return True


def list_slots(column: pa.Array | pa.ChunkedArray, size: int) -> np.ndarray:
    """A multi-hot column (``list<int64>``, each list at most `size` long, no nulls: what
    `check_table` returns) as int64 [n, size]: row r's values in its first slots, `PAD_SPARSE`
    in the rest. Vectorized: one scatter of all values, whatever their lengths."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    lengths = list_lengths(column)
    values = column.flatten().to_numpy(zero_copy_only=False)
    n = lengths.size
    if values.size == n * size:  # every list full (fixed fill): a reshape, no scatter
        return values.reshape(n, size)
    out = np.full((n, size), PAD_SPARSE, dtype=np.int64)
    full = lengths == size
    if values.size == int(np.count_nonzero(full)) * size:
        # every list full or empty (fixed fill with missing features, as MLPerf-style data holds): the full rows'
        # values are consecutive, one row-block copy instead of the scatter below (4x faster on a 100-slot column)
        out[full] = values.reshape(-1, size)
        return out
    rows = np.repeat(np.arange(n), lengths)
    starts = np.cumsum(lengths) - lengths  # each list's first value within `values`
    out[rows, np.arange(values.size) - np.repeat(starts, lengths)] = values
    return out


# Rows per block of the column -> row-major transpose. Writing 26 int64 columns into a [n, 26] array
# one whole column at a time touches every cache line of the destination 26 times; in blocks of
# 16384 rows (3.4 MB of sparse) the destination block stays in cache while all columns land in it
# (measured ~25% faster than np.stack, and it writes straight into a reused buffer).
_TRANSPOSE_ROWS = 16384


def _column_array(table: pa.Table, name: str) -> np.ndarray:
    """One column as numpy: zero-copy for the usual single chunk, concatenated otherwise."""
    return table.column(name).to_numpy()


class _HostBlock:
    """Decoded rows on the host, row-major: label int8 [n], dense int32 [n, 13], sparse int64 [n, L]
    (how `dlrm.data.device_loader` stages a row group; L = 26 when one-hot)."""

    __slots__ = ("label", "dense", "sparse")

    def __init__(self, label: np.ndarray, dense: np.ndarray, sparse: np.ndarray):
        self.label, self.dense, self.sparse = label, dense, sparse

    def __len__(self) -> int:
        return len(self.label)

    @staticmethod
    def from_table(table: pa.Table, multi_hot_sizes: list[int] | None = None) -> "_HostBlock":
        n, offsets = table.num_rows, slot_offsets(multi_hot_sizes)
        block = _HostBlock(np.empty(n, np.int8), np.empty((n, NUM_DENSE), np.int32), np.empty((n, offsets[-1]), np.int64))
        block.write(table, 0, multi_hot_sizes)
        return block

    def write(self, table: pa.Table, at: int, multi_hot_sizes: list[int] | None = None) -> None:
        """Copy `table`'s rows into rows [at, at + table.num_rows) (column-major -> row-major, no temporaries).

        Releases the GIL for the copies (numpy does for large plain-dtype assignments), so several
        threads can fill disjoint row ranges of one block at once. Multi-hot columns land in their
        slots through `list_slots` (one temporary [n, size] per list column).
        """
        n = table.num_rows
        self.label[at : at + n] = _column_array(table, LABEL_COLUMN)
        if is_multi_hot(multi_hot_sizes):
            self._write_dense(table, at)
            offsets = slot_offsets(multi_hot_sizes)
            for f, name in enumerate(SPARSE_COLUMNS):
                lo, hi = offsets[f], offsets[f + 1]
                column = table.column(name)
                self.sparse[at : at + n, lo:hi] = (list_slots(column, hi - lo) if hi - lo > 1
                                                   else _column_array(table, name)[:, None])
            return
        for dst, names in ((self.dense, DENSE_COLUMNS), (self.sparse, SPARSE_COLUMNS)):
            cols = [_column_array(table, c) for c in names]
            for r0 in range(0, n, _TRANSPOSE_ROWS):
                r1 = min(n, r0 + _TRANSPOSE_ROWS)
                block = dst[at + r0 : at + r1]
                for j, col in enumerate(cols):
                    block[:, j] = col[r0:r1]

    def _write_dense(self, table: pa.Table, at: int) -> None:
        """The dense columns of `write`, by the same cache-blocked transpose."""
        n = table.num_rows
        cols = [_column_array(table, c) for c in DENSE_COLUMNS]
        for r0 in range(0, n, _TRANSPOSE_ROWS):
            r1 = min(n, r0 + _TRANSPOSE_ROWS)
            block = self.dense[at + r0 : at + r1]
            for j, col in enumerate(cols):
                block[:, j] = col[r0:r1]


class _Arena:
    """The new rows of one shuffle buffer on the host, column-major, and the buffer's permutation.

    label int8 [n], dense int32 [13, n] and sparse int32|int64 [L, n] (L = `width`, 26 when
    one-hot; sparse int32 holds the compact form, see `widen_sparse`): every column contiguous, so a reader thread lands a row
    group's column with one ``memcpy`` (numpy releases the GIL for it), and the whole buffer
    crosses the bus in three copies. perm int64 [carry + n]: the buffer's row permutation when
    shuffling. Pinned on CUDA, so those copies are asynchronous; `released` is then the event
    after which the device no longer reads the arena, and the producer waits on it before
    writing the next buffer into it. Arenas are reused buffer after buffer and epoch after epoch.
    """

    __slots__ = ("label", "dense", "sparse", "perm", "columns", "perm_array", "released", "width")

    def __init__(self, new_rows: int, rows: int, pin: bool, sparse_dtype: torch.dtype, width: int = NUM_SPARSE):
        self.width = width
        self.label = torch.empty(new_rows, dtype=torch.int8, pin_memory=pin)
        self.dense = torch.empty(NUM_DENSE * new_rows, dtype=torch.int32, pin_memory=pin)
        self.sparse = torch.empty(width * new_rows, dtype=sparse_dtype, pin_memory=pin)
        self.perm = torch.empty(rows, dtype=torch.int64, pin_memory=pin)
        self.columns = tuple(t.numpy() for t in (self.label, self.dense, self.sparse))  # the same memory
        self.perm_array = self.perm.numpy()
        self.released: Optional[torch.cuda.Event] = None

    def tensors(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(label [n], dense [13, n], sparse [L, n]) of a buffer with `n` new rows (views)."""
        dense, sparse = self.dense[: NUM_DENSE * n], self.sparse[: self.width * n]
        return self.label[:n], dense.view(NUM_DENSE, n), sparse.view(self.width, n)

    def arrays(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The same views as numpy arrays, for the reader threads."""
        label, dense, sparse = self.columns
        return label[:n], dense[: NUM_DENSE * n].reshape(NUM_DENSE, n), sparse[: self.width * n].reshape(self.width, n)

    def wait_released(self) -> None:
        if self.released is not None:
            self.released.synchronize()
            self.released = None


def _write_columns(table: pa.Table, out: tuple[np.ndarray, np.ndarray, np.ndarray], at: int,
                   multi_hot_sizes: list[int] | None = None) -> None:
    """Copy `table`'s columns into column-major arrays at rows ``[at, at + num_rows)``; a
    multi-hot column fills its ``size`` slot rows (`list_slots`, transposed on the copy)."""
    label, dense, sparse = out
    n = table.num_rows
    label[at : at + n] = _column_array(table, LABEL_COLUMN)
    for j, name in enumerate(DENSE_COLUMNS):
        dense[j, at : at + n] = _column_array(table, name)
    offsets = slot_offsets(multi_hot_sizes)
    for f, name in enumerate(SPARSE_COLUMNS):
        lo, hi = offsets[f], offsets[f + 1]
        if hi - lo == 1:
            sparse[lo, at : at + n] = _column_array(table, name)  # int64 -> int32 (compact) keeps the low 32 bits
        else:
            sparse[lo:hi, at : at + n] = list_slots(table.column(name), hi - lo).T

