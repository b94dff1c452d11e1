"""Batched parquet loader: shuffle buffers decoded by background threads, cut into batches on the device.

Never per-row Python, and no per-batch host work beyond launching a gather. Reader threads decode
row groups with pyarrow (GIL released) and copy their columns into a column-major host arena
(pinned on CUDA); each decoded shuffle buffer is copied to the device on a side stream as soon as
it is ready, transformed there once (``log1p(max(x, 0))`` for the dense counts: ints cross the
bus, floats come out), and every batch is a device-side gather by a slice of the buffer's seeded
permutation. Which rows form which batch depends only on the arguments and ``(seed, epoch)``,
never on thread timing. `dlrm.data.device_loader` keeps a whole split in GPU memory instead.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from loguru import logger

from dlrm.data.schema import (
    DENSE_COLUMNS,
    LABEL_COLUMN,
    MISSING_DENSE,
    MISSING_SPARSE,
    NUM_DENSE,
    NUM_SPARSE,
    SPARSE_COLUMNS,
    DatasetError,
    Metadata,
    arrow_schema,
)


@dataclass
class Batch:
    """One batch on the target device.

    dense: float32 [B, 13], already log1p(max(x, 0)); sparse: int64 [B, 26] raw hash values;
    labels: float32 [B]. In a distributed run B is this rank's slice and `global_size` the rows
    of the whole global batch (see `rank_slice`).
    """

    dense: torch.Tensor
    sparse: torch.Tensor
    labels: torch.Tensor
    global_size: Optional[int] = None

    def __len__(self) -> int:
        return self.labels.shape[0]

    @property
    def global_len(self) -> int:
        """Rows of the global batch this batch is a slice of (its own length when not sharded)."""
        return len(self) if self.global_size is None else self.global_size


def keeps_last_batch(rows: int, drop_last: bool, world_size: int) -> bool:
    """Whether an epoch's last, partial batch of `rows` rows is delivered: not with `drop_last`,
    and not when it has fewer rows than ranks (every rank must get at least one row)."""
    return 0 < rows and not drop_last and rows >= world_size


def batches_per_epoch(num_rows: int, batch_size: int, drop_last: bool, world_size: int = 1) -> int:
    full, rest = divmod(num_rows, batch_size)
    return full + int(keeps_last_batch(rest, drop_last, world_size))


def rank_slice(lo: int, hi: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank `rank`'s rows of the global batch ``[lo, hi)``: consecutive blocks of
    ``ceil((hi - lo) / world_size)`` rows, so every rank but the last ones gets the same count
    (a short last batch may leave some ranks empty). The slices concatenated in rank order are
    the global batch, which is what makes an N-process run equal a one-process run."""
    per = -(-(hi - lo) // world_size)
    return min(lo + rank * per, hi), min(lo + (rank + 1) * per, hi)


def transform_dense(counts: torch.Tensor) -> torch.Tensor:
    """Criteo's dense transform: ``log1p(max(x, 0))`` in float32."""
    return torch.log1p(counts.clamp_min(0).to(torch.float32))


def split_files(dataset_dir: str | Path, meta: Metadata, split: str) -> list[Path]:
    """The parquet files of `split`, checked to exist."""
    if split not in meta.splits:
        raise DatasetError(f"{Path(dataset_dir) / 'metadata.json'}: splits: has no '{split}' split")
    files = [Path(dataset_dir) / f for f in meta.splits[split].files]
    for f in files:
        if not f.is_file():
            raise DatasetError(f"{f}: listed in metadata.json splits.{split} but missing")
    if not files:
        raise DatasetError(f"{Path(dataset_dir) / 'metadata.json'}: splits.{split}: lists no files")
    return files


def check_schema(path: Path, schema: pa.Schema) -> None:
    """`schema` must have exactly `arrow_schema()`'s columns, in its order and with its types
    (nullable fields are accepted: nulls follow `check_table`'s policy); raises `DatasetError`
    naming the file and the first offending column."""
    expected = arrow_schema()
    names = schema.names
    for fld in expected:
        count = names.count(fld.name)
        if count == 0:
            raise DatasetError(f"{path}: column {fld.name}: missing")
        if count > 1:
            raise DatasetError(f"{path}: column {fld.name}: appears {count} times")
        actual = schema.field(fld.name).type
        if actual != fld.type:
            raise DatasetError(f"{path}: column {fld.name}: type {actual} is not {fld.type}")
    for name in names:
        if expected.get_field_index(name) < 0:
            raise DatasetError(f"{path}: column {name}: not part of the dataset schema (expected exactly "
                               f"{LABEL_COLUMN}, DENSE_0..{NUM_DENSE - 1}, SPARSE_0..{NUM_SPARSE - 1})")
    for i, (name, want) in enumerate(zip(names, expected.names)):
        if name != want:
            raise DatasetError(f"{path}: column {name}: at position {i}, where {want} belongs (columns out of order)")


# The null policy (data/README.md): a null category is the missing category, a null count is a
# missing count (stored as 0); a null label has no meaning, so it is an error, never a guess.
_NULL_FILL = {**{c: MISSING_DENSE for c in DENSE_COLUMNS}, **{c: MISSING_SPARSE for c in SPARSE_COLUMNS}}


def _label_error(path: Path, group: int, first_row: int, label: pa.ChunkedArray) -> DatasetError:
    """The error for the first null or out-of-range label of a row group (the error path only)."""
    null = pc.is_null(label).to_numpy()
    values = pc.fill_null(label, 0).to_numpy()
    i = int(np.flatnonzero(null | ((values != 0) & (values != 1)))[0])
    where = f"{path}: column {LABEL_COLUMN}: row index {first_row + i} (row group {group})"
    if null[i]:
        return DatasetError(f"{where} is null; every row needs a label 0 or 1")
    return DatasetError(f"{where} holds {int(values[i])}; labels must be 0 or 1")


def check_labels(path: Path, group: int, first_row: int, label: pa.ChunkedArray) -> None:
    """Raise `DatasetError` naming file, column and row unless every label is 0 or 1 (vectorized:
    a null count and one `min_max` over the column)."""
    if label.null_count:
        raise _label_error(path, group, first_row, label)
    if len(label):
        bounds = pc.min_max(label)
        if bounds["min"].as_py() < 0 or bounds["max"].as_py() > 1:
            raise _label_error(path, group, first_row, label)


def check_table(path: Path, group: int, first_row: int, table: pa.Table) -> tuple[pa.Table, dict[str, int]]:
    """A decoded row group checked against the contract, and its nulls replaced by policy.

    Labels must be 0 or 1 and not null (else `DatasetError` naming file, column and row); a null
    dense count becomes 0 (`MISSING_DENSE`), a null category the missing value -1
    (`MISSING_SPARSE`). Returns the table to use and the number of nulls replaced per column
    (empty for the usual table without nulls, which costs one `min_max` and 40 null counts).
    `first_row`: the row group's first row within the file (for the messages).
    """
    check_labels(path, group, first_row, table.column(LABEL_COLUMN))
    replaced: dict[str, int] = {}
    for name, fill in _NULL_FILL.items():
        column = table.column(name)
        if column.null_count:
            replaced[name] = column.null_count
            filled = pc.fill_null(column, pa.scalar(fill, column.type))
            table = table.set_column(table.schema.get_field_index(name), name, filled)
    return table, replaced


def footer_label_check(path: Path, footer: pq.FileMetaData) -> None:
    """Fail at open, not mid-epoch, on a label the footer's statistics show to be null or out of
    range: only then is that row group's label column read, and `check_labels` names the row.

    Statistics may be missing or wrong (the file is untrusted), so this only moves errors
    earlier; the check of every decoded row group (`check_table`) is the one that guarantees it.
    """
    first_row = 0
    for g in range(footer.num_row_groups):
        try:
            rg = footer.row_group(g)
            stats = rg.column(0).statistics  # the label is column 0 (`check_schema`)
            nulls = stats is not None and stats.has_null_count and stats.null_count > 0
            outside = stats is not None and stats.has_min_max and (stats.min < 0 or stats.max > 1)
            label = None
            if nulls or outside:
                with pq.ParquetFile(path, metadata=footer) as reader:
                    label = reader.read_row_group(g, columns=[LABEL_COLUMN]).column(LABEL_COLUMN)
        except (OSError, pa.ArrowException) as e:
            raise DatasetError(f"{path}: row group {g}: cannot be read ({e})") from None
        if label is not None:
            check_labels(path, g, first_row, label)
        first_row += rg.num_rows


def open_footer(path: Path) -> pq.FileMetaData:
    """The parquet footer of `path`, its schema checked (`check_schema`) and its labels
    pre-checked from the statistics (`footer_label_check`); unreadable -> `DatasetError`."""
    try:
        footer = pq.ParquetFile(path).metadata
        schema = footer.schema.to_arrow_schema()
    except (OSError, pa.ArrowException) as e:
        raise DatasetError(f"{path}: not a readable parquet file ({e})") from None
    check_schema(path, schema)
    footer_label_check(path, footer)
    return footer


def first_rows(row_groups: list[tuple[int, int, int]]) -> list[int]:
    """For each (file, group, rows) entry, in file order, the group's first row within its file."""
    starts, at, current = [], 0, None
    for fi, _, n in row_groups:
        if fi != current:
            at, current = 0, fi
        starts.append(at)
        at += n
    return starts


class NullTally:
    """Counts the nulls `check_table` replaced, per file, and logs them once per file (a loguru
    warning) when every row group of the file has been checked; thread-safe (reader threads)."""

    def __init__(self, files: list[Path], groups_per_file: list[int]):
        self._files = files
        self._left = [set(range(n)) for n in groups_per_file]
        self._counts: list[dict[str, int]] = [{} for _ in files]
        self._lock = threading.Lock()

    def add(self, file_index: int, group: int, replaced: dict[str, int]) -> None:
        """Record row group `group` of file `file_index` as checked, with its replaced nulls."""
        left = self._left[file_index]
        with self._lock:
            if group not in left:  # checked in an earlier epoch: nothing new
                return
            left.discard(group)
            counts = self._counts[file_index]
            for name, n in replaced.items():
                counts[name] = counts.get(name, 0) + n
            if left or not counts:
                return
        self._report(file_index, counts)

    def _report(self, file_index: int, counts: dict[str, int]) -> None:
        """One warning for the file: how many nulls of each kind were replaced, and by what."""
        parts = []
        for names, fill, what in ((DENSE_COLUMNS, MISSING_DENSE, "dense counts"),
                                  (SPARSE_COLUMNS, MISSING_SPARSE, "categories (the missing value)")):
            hit = [f"{c} {counts[c]:,}" for c in names if c in counts]
            if hit:
                total = sum(counts[c] for c in names if c in counts)
                parts.append(f"{total:,} null {what} replaced by {fill} ({', '.join(hit)})")
        logger.warning(f"{self._files[file_index]}: {'; '.join(parts)}")


_COLUMNS = [LABEL_COLUMN, *DENSE_COLUMNS, *SPARSE_COLUMNS]
_LOW32 = 0xFFFFFFFF


def widen_sparse(sparse: torch.Tensor) -> torch.Tensor:
    """Raw sparse values as int64 from their compact int32 bit patterns (a new tensor either way).

    Raw values lie in [-1, 2^32): stored in 32 bits, -1 (missing) and 0xFFFFFFFF share a bit
    pattern, so the compact form is only used where 0xFFFFFFFF does not occur; the pattern then
    means -1, and every other value is its low 32 bits read unsigned.
    """
    if sparse.dtype == torch.int64:
        return sparse.clone()
    wide = sparse.to(torch.int64)
    return torch.where(wide == -1, wide, wide & _LOW32)


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


@dataclass
class _Flush:
    """One shuffle buffer of an epoch: the rows carried over from the previous buffer, then `groups`.

    rows = carry + rows of `groups`; its rows are permuted together and cut into `cuts` (row ranges
    in permuted order; the first is the epoch's batch number `first_batch`); the rows from `keep`
    on (in permuted order) are carried into the next buffer, unless it is the final one.
    """

    groups: list[int]  # indexes into ParquetLoader.row_groups, in read order
    carry: int
    rows: int
    final: bool
    cuts: list[tuple[int, int]]
    first_batch: int
    keep: int


@dataclass
class _Resident:
    """A shuffle buffer as the consumer cuts it: row-major tensors on the target device.

    dense float32 [rows, 13] (transformed), sparse int64 [rows, 26], labels float32 [rows], perm
    int64 [rows] or None (no shuffle); `ready`: the event after which they hold their values
    (CUDA); `streams`: the streams already made to wait on it.
    """

    dense: torch.Tensor
    sparse: torch.Tensor
    labels: torch.Tensor
    perm: Optional[torch.Tensor]
    ready: Optional[torch.cuda.Event]
    streams: set = field(default_factory=set)

    def rows(self, lo: int, hi: int) -> torch.Tensor | slice:
        return self.perm[lo:hi] if self.perm is not None else slice(lo, hi)

    def take(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows ``[lo, hi)`` in permuted order: gathers (new tensors), or views without shuffling."""
        rows = self.rows(lo, hi)
        if isinstance(rows, slice):
            return self.dense[rows], self.sparse[rows], self.labels[rows]
        return self.dense.index_select(0, rows), self.sparse.index_select(0, rows), self.labels.index_select(0, rows)


_END = object()


class ParquetLoader:
    """Iterates batches of one split, epoch by epoch.

    Args:
        files: parquet shards of the split (schema of `dlrm.data.schema.arrow_schema`).
        batch_size: B.
        device: where batches are delivered.
        shuffle: shuffle row-group order and rows within `shuffle_buffer_rows` (seeded by
            ``(seed, epoch)``, so every epoch differs and every run repeats).
        seed: base seed of the shuffle.
        drop_last: drop the last partial batch of an epoch (True keeps shapes fixed).
        prefetch: shuffle buffers decoded ahead of the one being cut (at least 1; each is at
            least `shuffle_buffer_rows` rows, i.e. many batches).
        shuffle_buffer_rows: rows shuffled together; also the rows decoded and copied as one unit.
        reader_threads: row groups decoded at once (default: from the CPU count).
        rank, world_size: in a distributed run, deliver only rank `rank`'s slice of every global
            batch (`rank_slice`); every rank plans, decodes and uploads the same buffers (the
            global batches must be identical everywhere) but cuts only its own rows.
        compact_sparse: move sparse values as int32 bit patterns on the host (exact only without
            0xFFFFFFFF, which the footers' statistics must rule out); None: on CUDA devices.

    Example:
        >>> loader = ParquetLoader(files, batch_size=512, device="cpu")
        >>> for batch in loader: ...   # Batch(dense [512, 13], sparse [512, 26], labels [512])

    Pipeline, one shuffle buffer (about `shuffle_buffer_rows` rows) at a time:
      1. producer: `reader_threads` workers decode the buffer's row groups (pyarrow, GIL released,
         each also spreading its columns over pyarrow's own pool) and copy each column with one
         ``memcpy`` into a column-major host arena (pinned on CUDA); up to `prefetch` decoded
         buffers wait ahead of the consumer;
      2. consumer: as soon as the next buffer is decoded, three asynchronous copies move it to
         the device on a side stream, where it is transformed (``log1p``, sparse widening) and
         laid out row-major once per buffer, and the arena goes back to the producer;
      3. each batch is then a device-side gather by a slice of the buffer's permutation (a view
         without shuffling), issued on the consumer's stream: no per-batch host copy, no
         per-batch event, nothing synced.
    So each row is copied once on the host, crosses the bus once in ~157-261 bytes (int32 or
    int64 sparse), and the next buffers are on the device while the current steps run. Memory:
    ``(prefetch + 1)`` arenas of ``R * (53 + 26 * s) + 8 * (R + B)`` bytes of host memory
    (s = 4 or 8 bytes a sparse value, R = rows of the largest buffer, at most ``shuffle_buffer_rows
    + largest row group``) and, on the device, two buffers of 264 bytes a row plus one upload.

    Which rows form which batch is decided before any data is read (`_plan`), from the row-group
    sizes in the footers and the ``(seed, epoch)`` generator: the row-group order, then one
    permutation per buffer, drawn in buffer order. The batches equal those of a plain sequential
    read-concatenate-permute-cut loop (tests/test_loader.py keeps one as the reference), and do
    not depend on thread timing.
    """

    def __init__(
        self,
        files: list[Path],
        batch_size: int,
        device: torch.device | str = "cpu",
        *,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        prefetch: int = 2,
        shuffle_buffer_rows: int = 1_000_000,
        reader_threads: Optional[int] = None,
        rank: int = 0,
        world_size: int = 1,
        compact_sparse: Optional[bool] = None,
    ) -> None:
        self.files = [Path(f) for f in files]
        self.batch_size = batch_size
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.prefetch = max(1, prefetch)
        self.shuffle_buffer_rows = shuffle_buffer_rows
        # Decoding is the bulk of the host work, and pyarrow already spreads each row group's columns
        # over its own pool (one thread a core): a few row groups at once keep the cores busy, more
        # only contend. Measured on the 16-core H100 host (benchmarks/results/loader_throughput_*):
        # 4 readers 27M shuffled samples/s, 8 readers 23M, 16 readers 25M.
        self.reader_threads = reader_threads or max(2, min(4, (os.cpu_count() or 1) // 4))
        self.epoch = 0
        self.start_batch = 0
        # (file index, row group index, rows) for every row group, read from parquet footers only.
        self.row_groups: list[tuple[int, int, int]] = []
        self._footers = [open_footer(path) for path in self.files]  # each file checked once, here
        for i, meta in enumerate(self._footers):
            self.row_groups += [(i, g, meta.row_group(g).num_rows) for g in range(meta.num_row_groups)]
        self._first_rows = first_rows(self.row_groups)
        self._nulls = NullTally(self.files, [meta.num_row_groups for meta in self._footers])
        self.num_rows = sum(n for _, _, n in self.row_groups)
        self._pin = self.device.type == "cuda"
        # On CUDA, sparse values travel through the arenas and the bus as int32 bit patterns when
        # the footers prove that exact (`widen_sparse` restores int64 on the GPU): half the sparse
        # bytes to copy on the host and across the bus. On the CPU the widening would cost more
        # than it saves, so buffers stay int64 there unless `compact_sparse` says.
        want = self.device.type == "cuda" if compact_sparse is None else compact_sparse
        self._compact = want and compact_sparse_ok(self._footers)
        # Largest buffer any epoch can need: pending rows below the threshold, then the row group
        # that crosses it (see `_plan`), plus a carry (< B); never more than all rows.
        largest_group = max((n for _, _, n in self.row_groups), default=0)
        self._new_rows = min(self.num_rows, max(shuffle_buffer_rows, 1) - 1 + largest_group)
        self._buffer_rows = min(self.num_rows, batch_size - 1 + self._new_rows)
        self._max_arenas = self.prefetch + 1
        self._lock = threading.Lock()
        self._spare_arenas: list[_Arena] = []  # reused across epochs (first-touch page faults and pinning are slow)
        self._readers: Optional[ThreadPoolExecutor] = None

    def __len__(self) -> int:
        """Batches per epoch."""
        return batches_per_epoch(self.num_rows, self.batch_size, self.drop_last, self.world_size)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """The next iteration yields `epoch`'s batches from index `start_batch` on (for resume).

        The order depends only on (seed, epoch), so skipped batches are the ones a previous run
        consumed; their shuffle buffers are still decoded and uploaded (later batches take rows
        carried over from them) but the skipped batches are never cut.
        """
        self.epoch = epoch
        self.start_batch = start_batch

    # -- the epoch's plan -----------------------------------------------------------------------

    def _plan(self, rng: np.random.Generator) -> list[_Flush]:
        """The shuffle buffers of an epoch and their batches, from the footers' row counts alone.

        A buffer is flushed as soon as its pending row groups hold ``>= shuffle_buffer_rows`` rows;
        the final one takes whatever is left (carry and/or pending groups). Draws the row-group
        permutation from `rng` (when shuffling); the per-buffer permutations are drawn later, in
        buffer order, by the producer.
        """
        order = rng.permutation(len(self.row_groups)) if self.shuffle else np.arange(len(self.row_groups))
        B = self.batch_size
        flushes: list[_Flush] = []
        batches = 0

        def flush(groups: list[int], carry: int, rows: int, final: bool) -> int:
            nonlocal batches
            full = rows // B * B
            cuts = [(s, s + B) for s in range(0, full, B)]
            if final and keeps_last_batch(rows - full, self.drop_last, self.world_size):
                cuts.append((full, rows))
            flushes.append(_Flush(groups, carry, rows, final, cuts, batches, full))
            batches += len(cuts)
            return rows - full  # the next buffer's carry

        pending: list[int] = []
        pending_rows = carry = 0
        for k in order.tolist():
            pending.append(k)
            pending_rows += self.row_groups[k][2]
            if pending_rows >= self.shuffle_buffer_rows:
                carry = flush(pending, carry, carry + pending_rows, final=False)
                pending, pending_rows = [], 0
        if carry or pending:
            flush(pending, carry, carry + pending_rows, final=True)
        return flushes

    # -- producer (background thread and its reader pool) ---------------------------------------

    def _decode(self, k: int, out: tuple[np.ndarray, np.ndarray, np.ndarray], at: int) -> None:
        """Read row group `k` into the arena columns `out` from row `at` on (on a reader thread).

        Opens the file for this one read: with the footer parsed in `__init__` that costs ~50 us
        against milliseconds of decoding, shares no reader object between threads, and keeps no
        file descriptors open however many shards a split has.
        """
        fi, gi, n = self.row_groups[k]
        try:
            with pq.ParquetFile(self.files[fi], metadata=self._footers[fi]) as reader:
                # use_threads: pyarrow decodes the columns on its own pool as well
                table = reader.read_row_group(gi, columns=_COLUMNS, use_threads=True)
        except (OSError, pa.ArrowException) as e:
            raise DatasetError(f"{self.files[fi]}: row group {gi}: cannot be read ({e})") from None
        if table.num_rows != n:  # the plan placed every row group by its footer's count
            raise DatasetError(f"{self.files[fi]}: row group {gi}: has {table.num_rows} rows, its footer said {n}")
        # Checked where it is decoded (vectorized, on this reader thread, every epoch: the file is
        # untrusted and may change); a DatasetError reaches the consumer through the producer.
        table, replaced = check_table(self.files[fi], gi, self._first_rows[k], table)
        self._nulls.add(fi, gi, replaced)
        _write_columns(table, out, at)

    def _take_spares(self, spares: list, count: int, make) -> list:
        with self._lock:
            taken = [spares.pop() for _ in range(min(count, len(spares)))]
        return taken + [make() for _ in range(count - len(taken))]

    def _return_spares(self, spares: list, items: list, keep: int) -> None:
        with self._lock:
            spares.extend(items[: max(0, keep - len(spares))])

    def _produce(self, plan: list[_Flush], rng: np.random.Generator, q: queue.Queue, free: queue.Queue,
                 stop: threading.Event) -> None:
        try:
            self._decode_epoch(plan, rng, q, free, stop)
            self._put(q, _END, stop)
        except BaseException as e:  # handed to the consumer thread, which re-raises it
            self._put(q, e, stop)

    def _decode_epoch(self, plan: list[_Flush], rng: np.random.Generator, q: queue.Queue, free: queue.Queue,
                      stop: threading.Event) -> None:
        """Decode the epoch's buffers into arenas and hand them over in order (producer thread)."""
        readers = self._pool()
        pending: collections.deque = collections.deque()  # (arena, futures), in buffer order
        made = 0

        def hand_over_oldest() -> bool:
            """Wait for the oldest buffer's decode and queue it; False when the consumer stopped
            (the buffer then stays in `pending`, whose decodes the `finally` below waits for)."""
            arena, futures = pending[0]
            for future in futures:
                while True:
                    if stop.is_set():
                        return False
                    try:
                        future.result(timeout=0.1)  # re-raises a reader's DatasetError
                        break
                    except FuturesTimeout:
                        continue
            pending.popleft()
            if self._put(q, arena, stop):
                return True
            free.put(arena)  # the consumer stopped: keep the (fully decoded) arena for the next iteration
            return False

        def acquire_arena() -> Optional[_Arena]:
            """A free arena; never waits while a decoded buffer could be handed over instead."""
            nonlocal made
            while not stop.is_set():
                try:
                    return free.get_nowait()
                except queue.Empty:
                    pass
                if made < self._max_arenas:
                    made += 1
                    return self._take_spares(self._spare_arenas, 1, self._new_arena)[0]
                if pending:
                    if not hand_over_oldest():
                        return None
                    continue
                try:
                    return free.get(timeout=0.1)
                except queue.Empty:
                    continue
            return None

        try:
            for flush in plan:
                arena = acquire_arena()
                if arena is None:
                    return
                arena.wait_released()  # the device may still be copying the arena's previous buffer
                if self.shuffle:  # drawn in buffer order, right after the plan: depends on (seed, epoch) only
                    arena.perm_array[: flush.rows] = rng.permutation(flush.rows)
                out = arena.arrays(flush.rows - flush.carry)
                futures, at = [], 0
                for k in flush.groups:
                    futures.append(readers.submit(self._decode, k, out, at))
                    at += self.row_groups[k][2]
                pending.append((arena, futures))
                while pending and all(f.done() for f in pending[0][1]):  # hand over what is ready early
                    if not hand_over_oldest():
                        return
            while pending:
                if not hand_over_oldest():
                    return
        finally:
            # Stopped early (or failed): let nothing run on the arenas any more.
            futures = [f for _, fs in pending for f in fs]
            for f in futures:
                f.cancel()
            wait(futures)
            for arena, _ in pending:
                free.put(arena)

    def _pool(self) -> ThreadPoolExecutor:
        """The reader pool, made once per loader.

        Kept across epochs: new threads start with empty allocator caches (pyarrow's mimalloc
        heaps are per thread), which showed up as page faults and system time every epoch.
        Idle threads cost nothing; concurrent iterations share it (each waits on its own futures).
        """
        with self._lock:
            if self._readers is None:
                self._readers = ThreadPoolExecutor(self.reader_threads, thread_name_prefix="parquet-read")
            return self._readers

    def _new_arena(self) -> _Arena:
        sparse = torch.int32 if self._compact else torch.int64
        arena = _Arena(self._new_rows, self._buffer_rows, self._pin, sparse)
        size = sum(t.numel() * t.element_size() for t in (arena.label, arena.dense, arena.sparse, arena.perm))
        logger.debug(f"parquet loader: host arena of {self._new_rows:,} rows ({size / 2**20:,.0f} MiB"
                     f"{', pinned' if self._pin else ''}, sparse {sparse})")
        return arena

    @staticmethod
    def _put(q: queue.Queue, item, stop: threading.Event) -> bool:
        """Put unless the consumer has stopped; False when it has."""
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    # -- consumer -------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        rng = np.random.default_rng([self.seed, self.epoch])
        plan = self._plan(rng)
        q: queue.Queue = queue.Queue(maxsize=self.prefetch)
        free: queue.Queue = queue.Queue()  # arenas the consumer is done with (unbounded: put never waits)
        stop = threading.Event()
        thread = threading.Thread(target=self._produce, args=(plan, rng, q, free, stop), daemon=True,
                                  name="parquet-loader")
        thread.start()
        try:
            yield from self._cut_epoch(plan, q, free)
        finally:
            stop.set()
            thread.join()
            # Every arena the producer made is now idle: in `free`, in `q`, or dropped mid-flight.
            arenas = [a for a in self._empty(q) if isinstance(a, _Arena)] + self._empty(free)
            self._return_spares(self._spare_arenas, arenas, keep=self._max_arenas)

    def _cut_epoch(self, plan: list[_Flush], q: queue.Queue, free: queue.Queue) -> Iterator[Batch]:
        """Upload each decoded buffer as soon as it arrives and cut the current one into batches."""
        copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        previous: Optional[tuple[_Flush, _Resident]] = None  # needed only until the next upload (its carry)
        current: Optional[_Resident] = None
        for f, flush in enumerate(plan):
            if current is None:  # the first buffer, or the next one had not arrived while cutting
                current = self._upload(flush, self._receive(q, block=True), previous, free, copy_stream)
            previous = upcoming = None
            for i, (lo, hi) in enumerate(flush.cuts):
                if upcoming is None and f + 1 < len(plan):  # start copying the next buffer early
                    arena = self._receive(q, block=False)
                    if arena is not None:
                        upcoming = self._upload(plan[f + 1], arena, (flush, current), free, copy_stream)
                if flush.first_batch + i >= self.start_batch:
                    yield self._cut(current, lo, hi)
            previous, current = (flush, current), upcoming
        self._receive(q, block=True, end=True)  # the producer's end marker (or its exception)

    @staticmethod
    def _receive(q: queue.Queue, block: bool, end: bool = False):
        """The next decoded arena (None if `block` is False and none is ready), re-raising the
        producer's exceptions here; `end`: expect the end of the epoch instead."""
        try:
            item = q.get(block=block)
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            raise item
        if (item is _END) != end:
            raise RuntimeError("parquet loader: the producer and the plan disagree on the buffers")
        return item

    def _upload(self, flush: _Flush, arena: _Arena, previous: Optional[tuple[_Flush, _Resident]], free: queue.Queue,
                copy_stream: Optional[torch.cuda.Stream]) -> _Resident:
        """Buffer `flush` on the device: the carry gathered from the previous buffer, then the
        arena's rows, transformed and row-major. On CUDA all of it is queued on `copy_stream`."""
        n, dev = flush.rows - flush.carry, self.device
        with torch.cuda.stream(copy_stream) if copy_stream is not None else contextlib.nullcontext():
            label, dense, sparse = (t.to(dev, non_blocking=True) for t in arena.tensors(n))
            # copy=True: on the CPU too, the permutation must outlive the arena
            perm = arena.perm[: flush.rows].to(dev, non_blocking=True, copy=True) if self.shuffle else None
            if copy_stream is not None:
                arena.released = torch.cuda.Event()
                arena.released.record(copy_stream)
            out = _Resident(
                torch.empty((flush.rows, NUM_DENSE), dtype=torch.float32, device=dev),
                torch.empty((flush.rows, NUM_SPARSE), dtype=torch.int64, device=dev),
                torch.empty((flush.rows,), dtype=torch.float32, device=dev),
                perm, None,
            )
            if flush.carry:  # rows [keep, rows) of the previous buffer, in its permuted order
                prev_flush, prev = previous
                carried = prev.take(prev_flush.keep, prev_flush.rows)
                for dst, src in zip((out.dense, out.sparse, out.labels), carried):
                    dst[: flush.carry] = src
            out.dense[flush.carry :] = transform_dense(dense.t())
            out.sparse[flush.carry :] = widen_sparse(sparse.t()) if sparse.dtype != torch.int64 else sparse.t()
            out.labels[flush.carry :] = label
            if copy_stream is not None:
                out.ready = torch.cuda.Event()
                out.ready.record(copy_stream)
        # On the CPU everything above has run (reading the arena in place); on CUDA the producer
        # waits on `released` before writing into the arena again.
        free.put(arena)
        return out

    def _cut(self, buf: _Resident, lo: int, hi: int) -> Batch:
        """This rank's rows of batch ``[lo, hi)``, issued on the consumer's current stream."""
        if buf.ready is not None:
            current = torch.cuda.current_stream(self.device)
            if current not in buf.streams:  # once per buffer and stream: no per-batch event
                current.wait_event(buf.ready)
                for t in (buf.dense, buf.sparse, buf.labels, buf.perm):
                    if t is not None:
                        t.record_stream(current)  # made on the copy stream, read (and viewed) here
                buf.streams.add(current)
        a, b = rank_slice(lo, hi, self.rank, self.world_size)
        dense, sparse, labels = buf.take(a, b)
        return Batch(dense, sparse, labels, hi - lo if self.world_size > 1 else None)

    @staticmethod
    def _empty(q: queue.Queue) -> list:
        items = []
        while True:
            try:
                items.append(q.get_nowait())
            except queue.Empty:
                return items
