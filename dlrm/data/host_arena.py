"""Decoded rows on the host: the row-major `_HostBlock` and the column-major `_Arena`.

Reader threads copy a decoded row group's columns into these buffers (numpy releases the GIL for
the copies, so several threads fill disjoint row ranges at once). `compact_sparse_ok` decides from
the footers whether sparse values may travel as int32 bit patterns (see `widen_sparse`).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from dlrm.data.batch import _LOW32
from dlrm.data.schema import DENSE_COLUMNS, LABEL_COLUMN, NUM_DENSE, NUM_SPARSE, SPARSE_COLUMNS

_COLUMNS = [LABEL_COLUMN, *DENSE_COLUMNS, *SPARSE_COLUMNS]


def compact_sparse_ok(footers: list[pq.FileMetaData]) -> bool:
    """Whether every sparse value fits the compact int32 form (no 0xFFFFFFFF), from the footers'
    max statistics alone; False when any row group lacks them."""
    for meta in footers:
        names = meta.schema.names
        idx = [names.index(c) for c in SPARSE_COLUMNS]
        for g in range(meta.num_row_groups):
            rg = meta.row_group(g)
            for i in idx:
                stats = rg.column(i).statistics
                if stats is None or not stats.has_min_max or stats.max >= _LOW32:
                    return False
    return True


# Rows per block of the column -> row-major transpose. Writing 26 int64 columns into a [n, 26] array
# one whole column at a time touches every cache line of the destination 26 times; in blocks of
# 16384 rows (3.4 MB of sparse) the destination block stays in cache while all columns land in it
# (measured ~25% faster than np.stack, and it writes straight into a reused buffer).
_TRANSPOSE_ROWS = 16384


def _column_array(table: pa.Table, name: str) -> np.ndarray:
    """One column as numpy: zero-copy for the usual single chunk, concatenated otherwise."""
    return table.column(name).to_numpy()


class _HostBlock:
    """Decoded rows on the host, row-major: label int8 [n], dense int32 [n, 13], sparse int64 [n, 26]
    (how `dlrm.data.device_loader` stages a row group)."""

    __slots__ = ("label", "dense", "sparse")

    def __init__(self, label: np.ndarray, dense: np.ndarray, sparse: np.ndarray):
        self.label, self.dense, self.sparse = label, dense, sparse

    def __len__(self) -> int:
        return len(self.label)

    @staticmethod
    def from_table(table: pa.Table) -> "_HostBlock":
        n = table.num_rows
        block = _HostBlock(np.empty(n, np.int8), np.empty((n, NUM_DENSE), np.int32), np.empty((n, NUM_SPARSE), np.int64))
        block.write(table, 0)
        return block

    def write(self, table: pa.Table, at: int) -> None:
        """Copy `table`'s rows into rows [at, at + table.num_rows) (column-major -> row-major, no temporaries).

        Releases the GIL for the copies (numpy does for large plain-dtype assignments), so several
        threads can fill disjoint row ranges of one block at once.
        """
        n = table.num_rows
        self.label[at : at + n] = _column_array(table, LABEL_COLUMN)
        for dst, names in ((self.dense, DENSE_COLUMNS), (self.sparse, SPARSE_COLUMNS)):
            cols = [_column_array(table, c) for c in names]
            for r0 in range(0, n, _TRANSPOSE_ROWS):
                r1 = min(n, r0 + _TRANSPOSE_ROWS)
                block = dst[at + r0 : at + r1]
                for j, col in enumerate(cols):
                    block[:, j] = col[r0:r1]


class _Arena:
    """The new rows of one shuffle buffer on the host, column-major, and the buffer's permutation.

    label int8 [n], dense int32 [13, n] and sparse int32|int64 [26, n] (sparse int32 holds the
    compact form, see `widen_sparse`): every column contiguous, so a reader thread lands a row
    group's column with one ``memcpy`` (numpy releases the GIL for it), and the whole buffer
    crosses the bus in three copies. perm int64 [carry + n]: the buffer's row permutation when
    shuffling. Pinned on CUDA, so those copies are asynchronous; `released` is then the event
    after which the device no longer reads the arena, and the producer waits on it before
    writing the next buffer into it. Arenas are reused buffer after buffer and epoch after epoch.
    """

    __slots__ = ("label", "dense", "sparse", "perm", "columns", "perm_array", "released")

    def __init__(self, new_rows: int, rows: int, pin: bool, sparse_dtype: torch.dtype):
        self.label = torch.empty(new_rows, dtype=torch.int8, pin_memory=pin)
        self.dense = torch.empty(NUM_DENSE * new_rows, dtype=torch.int32, pin_memory=pin)
        self.sparse = torch.empty(NUM_SPARSE * new_rows, dtype=sparse_dtype, pin_memory=pin)
        self.perm = torch.empty(rows, dtype=torch.int64, pin_memory=pin)
        self.columns = tuple(t.numpy() for t in (self.label, self.dense, self.sparse))  # the same memory
        self.perm_array = self.perm.numpy()
        self.released: Optional[torch.cuda.Event] = None

    def tensors(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(label [n], dense [13, n], sparse [26, n]) of a buffer with `n` new rows (views)."""
        dense, sparse = self.dense[: NUM_DENSE * n], self.sparse[: NUM_SPARSE * n]
        return self.label[:n], dense.view(NUM_DENSE, n), sparse.view(NUM_SPARSE, n)

    def arrays(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The same views as numpy arrays, for the reader threads."""
        label, dense, sparse = self.columns
        return label[:n], dense[: NUM_DENSE * n].reshape(NUM_DENSE, n), sparse[: NUM_SPARSE * n].reshape(NUM_SPARSE, n)

    def wait_released(self) -> None:
        if self.released is not None:
            self.released.synchronize()
            self.released = None


def _write_columns(table: pa.Table, out: tuple[np.ndarray, np.ndarray, np.ndarray], at: int) -> None:
    """Copy `table`'s columns into column-major arrays at rows ``[at, at + num_rows)``."""
    label, dense, sparse = out
    n = table.num_rows
    label[at : at + n] = _column_array(table, LABEL_COLUMN)
    for dst, names in ((dense, DENSE_COLUMNS), (sparse, SPARSE_COLUMNS)):
        for j, name in enumerate(names):
            dst[j, at : at + n] = _column_array(table, name)  # int64 -> int32 (compact) keeps the low 32 bits

