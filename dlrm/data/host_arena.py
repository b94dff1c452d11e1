"""Decoded rows on the host: the row-major `_HostBlock` and the column-major `_Arena`.

Reader threads copy a decoded row group's columns into these buffers (numpy releases the GIL for
the copies, so several threads fill disjoint row ranges at once). `compact_sparse_ok` decides from
the footers whether sparse values may travel as int32 bit patterns (see `widen_sparse`).

Sparse values land in L = ``sum(multi_hot_sizes)`` slots a row (`dlrm.data.schema.slot_offsets`):
a one-hot column fills its one slot, a multi-hot list column its ``size`` slots, values first and
`PAD_SPARSE` after them (`list_slots_into`, vectorized over blocks of rows: no Python loop per row);
in the "slots" layout every one of the L columns is already one slot, copied as it is.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from dlrm.data.arrow_numpy import numpy_of
from dlrm.data.batch import _LOW32
from dlrm.data.schema import (
    DENSE_COLUMNS,
    LABEL_COLUMN,
    MISSING_SPARSE,
    NUM_DENSE,
    NUM_SPARSE,
    PAD_SPARSE,
    SPARSE_COLUMNS,
    SparseLayout,
    is_multi_hot,
    slot_offsets,
    sparse_columns,
)
from dlrm.data.validation import list_lengths

def compact_sparse_ok(footers: list[pq.FileMetaData], bounds: tuple[int, int] = (MISSING_SPARSE, _LOW32)) -> bool:
    """Whether every sparse value fits the compact int32 form (all in ``bounds``, ``[lo, hi)``: -1 to 0xFFFFFFFF,
    or `dlrm.data.batch.compact_range` (True) for multi-hot data), from the footers' min and max statistics alone;
    False when any row group that holds rows lacks them (a row group of no rows has none). A list column's
    statistics are those of its values' leaf column, a slot column's (``SPARSE_<f>_<j>``) its own. The statistics
    are untrusted: the loader checks every decoded row group against the same bounds
    (`dlrm.data.validation.check_table`'s ``compact``)."""
    lo, hi = bounds
    for meta in footers:
        for g in range(meta.num_row_groups):
            rg = meta.row_group(g)
            if rg.num_rows == 0:  # no values, so no statistics either: nothing to rule out
                continue
            for i in range(rg.num_columns):
                column = rg.column(i)
                if not column.path_in_schema.startswith("SPARSE_"):  # the schema is checked: sparse columns only
                    continue
                stats = column.statistics
                if stats is None or not stats.has_min_max or stats.min < lo or stats.max >= hi:
                    return False
    return True


def list_slots(column: pa.Array | pa.ChunkedArray, size: int) -> np.ndarray:
    """A multi-hot column (``list<int64>``, each list at most `size` long, no nulls: what
    `check_table` returns) as int64 [n, size]: row r's values in its first slots, `PAD_SPARSE`
    in the rest (`list_slots_into` a new row-major array)."""
    n = len(column)
    out = np.empty((n, size), dtype=np.int64)
    list_slots_into(column, size, out.T)
    return out


# Bytes of one row block's int64 slots in `list_slots_into`: the block is laid out in cache and then copied into
# the destination's layout, instead of whole-column temporaries (a 131,072-row group of MLPerf's 100-value column
# made 105 MB of them: fresh pages, faulted in by every reader thread at once).
_SLOT_BLOCK_BYTES = 1 << 20


def list_slots_into(column: pa.Array | pa.ChunkedArray, size: int, out: np.ndarray,
                    block_rows: Optional[int] = None) -> None:
    """`list_slots` written into `out`, a [size, n] array of any layout and integer dtype (int32 keeps the values'
    low 32 bits): the column-major arena's slot rows, or a row-major array's transpose.

    Row block by row block (`block_rows`, default ~1 MB of int64 slots): every list full (fixed fill) is a
    transposing copy of the values; full or empty (fixed fill with missing features, as MLPerf-style data holds)
    places the full rows' consecutive values by a mask; anything else scatters each value to its slot. No
    temporary larger than a block, whatever the column's length."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    lengths = list_lengths(column)
    values = numpy_of(column.flatten())
    n = lengths.size
    if out.shape != (size, n):
        raise ValueError(f"out has shape {out.shape}, the column needs ({size}, {n})")
    step = block_rows or max(256, _SLOT_BLOCK_BYTES // (8 * size))
    if values.size == n * size:  # every list full: the values are the rows' slots already
        rows = values.reshape(n, size)
        for r0 in range(0, n, step):
            out[:, r0 : r0 + step] = rows[r0 : r0 + step].T
        return
    ends = np.cumsum(lengths)  # each row's last value + 1, within `values`
    scratch = np.empty((min(step, n), size), dtype=np.int64)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        v0, v1 = (int(ends[r0 - 1]) if r0 else 0), int(ends[r1 - 1])
        block, lens = scratch[: r1 - r0], lengths[r0:r1]
        block.fill(PAD_SPARSE)
        full = lens == size
        if v1 - v0 == int(np.count_nonzero(full)) * size:  # full or empty rows only: their values are consecutive
            block[full] = values[v0:v1].reshape(-1, size)
        elif v1 > v0:
            starts = np.repeat(ends[r0:r1] - lens - v0, lens)  # each value's row's first value, within the block
            block[np.repeat(np.arange(r1 - r0), lens), np.arange(v1 - v0) - starts] = values[v0:v1]
        out[:, r0:r1] = block.T


# Rows per block of the column -> row-major transpose. Writing 26 int64 columns into a [n, 26] array
# one whole column at a time touches every cache line of the destination 26 times; in blocks of
# 16384 rows (3.4 MB of sparse) the destination block stays in cache while all columns land in it
# (measured ~25% faster than np.stack, and it writes straight into a reused buffer).
_TRANSPOSE_ROWS = 16384


def _column_array(table: pa.Table, name: str) -> np.ndarray:
    """One column as numpy: zero-copy for the usual single chunk, concatenated otherwise. A float32 dense
    column (``dense_format`` "float") comes as its bit patterns, int32, for the int32 dense buffers: the
    bytes cross the bus as they are, and `dlrm.data.batch.transform_dense` reads them as floats."""
    array = numpy_of(table.column(name))
    return array.view(np.int32) if array.dtype == np.float32 else array


class _HostBlock:
    """Decoded rows on the host, row-major: label int8 [n], dense int32 [n, 13] (counts, or float32 values'
    bits), sparse int64 [n, L] (how `dlrm.data.device_loader` stages a row group; L = 26 when one-hot)."""

    __slots__ = ("label", "dense", "sparse")

    def __init__(self, label: np.ndarray, dense: np.ndarray, sparse: np.ndarray):
        self.label, self.dense, self.sparse = label, dense, sparse

    def __len__(self) -> int:
        return len(self.label)

    @staticmethod
    def from_table(table: pa.Table, multi_hot_sizes: list[int] | None = None,
                   layout: SparseLayout = "lists") -> "_HostBlock":
        n, offsets = table.num_rows, slot_offsets(multi_hot_sizes)
        block = _HostBlock(np.empty(n, np.int8), np.empty((n, NUM_DENSE), np.int32), np.empty((n, offsets[-1]), np.int64))
        block.write(table, 0, multi_hot_sizes, layout)
        return block

    def write(self, table: pa.Table, at: int, multi_hot_sizes: list[int] | None = None,
              layout: SparseLayout = "lists") -> None:
        """Copy `table`'s rows into rows [at, at + table.num_rows) (column-major -> row-major, no temporaries).

        Releases the GIL for the copies (numpy does for large plain-dtype assignments), so several
        threads can fill disjoint row ranges of one block at once. Multi-hot list columns land in their
        slots through `list_slots_into` (no temporary larger than a row block); slot columns ("slots"
        `layout`, the file's) by the same blocked transpose as one-hot ones.
        """
        n = table.num_rows
        self.label[at : at + n] = _column_array(table, LABEL_COLUMN)
        if is_multi_hot(multi_hot_sizes) and layout == "lists":
            self._write_dense(table, at)
            offsets = slot_offsets(multi_hot_sizes)
            for f, name in enumerate(SPARSE_COLUMNS):
                lo, hi = offsets[f], offsets[f + 1]
                column = table.column(name)
                if hi - lo > 1:
                    list_slots_into(column, hi - lo, self.sparse[at : at + n, lo:hi].T)
                else:
                    self.sparse[at : at + n, lo] = _column_array(table, name)
            return
        for dst, names in ((self.dense, DENSE_COLUMNS), (self.sparse, sparse_columns(multi_hot_sizes, layout))):
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

    label int8 [n], dense int32 [13, n] (counts, or float32 values' bits) and sparse int32|int64 [L, n]
    (L = `width`, 26 when one-hot; sparse int32 holds the compact form, see `widen_sparse`): every column contiguous, so a reader thread lands a row
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
                   multi_hot_sizes: list[int] | None = None, layout: SparseLayout = "lists") -> None:
    """Copy `table`'s columns into column-major arrays at rows ``[at, at + num_rows)``; a
    multi-hot list column fills its ``size`` slot rows (`list_slots_into`); in the "slots" `layout`
    (the file's) each of the L sparse columns is one slot row, one copy each."""
    label, dense, sparse = out
    n = table.num_rows
    label[at : at + n] = _column_array(table, LABEL_COLUMN)
    for j, name in enumerate(DENSE_COLUMNS):
        dense[j, at : at + n] = _column_array(table, name)
    if layout == "slots":
        for k, name in enumerate(sparse_columns(multi_hot_sizes, layout)):
            sparse[k, at : at + n] = _column_array(table, name)  # int64 -> int32 (compact) keeps the low 32 bits
        return
    offsets = slot_offsets(multi_hot_sizes)
    for f, name in enumerate(SPARSE_COLUMNS):
        lo, hi = offsets[f], offsets[f + 1]
        if hi - lo == 1:
            sparse[lo, at : at + n] = _column_array(table, name)  # int64 -> int32 (compact) keeps the low 32 bits
        else:
            list_slots_into(table.column(name), hi - lo, sparse[lo:hi, at : at + n])

