"""Batched parquet loader: row groups -> contiguous tensors, prepared by background threads.

Never per-row Python. Reader threads decode row groups with pyarrow (GIL released) and transpose
their columns straight into a preallocated row-major shuffle buffer; gather threads cut batches
out of it (``np.take`` by a seeded permutation, or a slice copy) into reusable batch slots, which
are pinned on CUDA and copied with ``non_blocking=True`` on a side stream, `prefetch` batches ahead
of the training step; the dense transform ``log1p(max(x, 0))`` runs on the device after the copy
(ints cross the bus, floats come out). Which rows form which batch depends only on the arguments
and ``(seed, epoch)``, never on thread timing. `dlrm.data.device_loader` keeps a whole split in
GPU memory instead.
"""

from __future__ import annotations

import collections
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from loguru import logger

from dlrm.data.schema import (
    DENSE_COLUMNS,
    LABEL_COLUMN,
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


def _check_schema(path: Path, schema: pa.Schema) -> None:
    expected = arrow_schema()
    for fld in expected:
        idx = schema.get_field_index(fld.name)
        if idx < 0:
            raise DatasetError(f"{path}: column {fld.name}: missing")
        if schema.field(idx).type != fld.type:
            raise DatasetError(f"{path}: column {fld.name}: type {schema.field(idx).type} is not {fld.type}")


_COLUMNS = [LABEL_COLUMN, *DENSE_COLUMNS, *SPARSE_COLUMNS]
_LOW32 = 0xFFFFFFFF


def _row_bytes(sparse_dtype) -> int:
    return 1 + 4 * NUM_DENSE + np.dtype(sparse_dtype).itemsize * NUM_SPARSE


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
    """Decoded rows on the host: label int8 [n], dense int32 [n, 13], sparse int64 [n, 26]."""

    __slots__ = ("label", "dense", "sparse")

    def __init__(self, label: np.ndarray, dense: np.ndarray, sparse: np.ndarray):
        self.label, self.dense, self.sparse = label, dense, sparse

    def __len__(self) -> int:
        return len(self.label)

    @staticmethod
    def empty(rows: int, sparse_dtype=np.int64) -> "_HostBlock":
        """`sparse_dtype` int32 holds the compact form (`widen_sparse`): half the bytes to move."""
        return _HostBlock(
            np.empty(rows, np.int8), np.empty((rows, NUM_DENSE), np.int32), np.empty((rows, NUM_SPARSE), sparse_dtype)
        )

    @staticmethod
    def from_table(table: pa.Table) -> "_HostBlock":
        block = _HostBlock.empty(table.num_rows)
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
                    block[:, j] = col[r0:r1]  # int64 -> int32 (compact sparse) keeps the low 32 bits

    def gather_into(self, rows: np.ndarray | slice, out: "_HostBlock") -> None:
        """``out[:k] = self[rows]`` written in place (k = len(rows)): one pass, no temporary arrays.

        ``mode="clip"`` is not about clipping (`rows` always holds valid positions): numpy buffers
        `out` when ``mode="raise"``, i.e. gathers into a temporary and copies again.
        """
        if isinstance(rows, slice):
            k = rows.stop - rows.start
            out.label[:k], out.dense[:k], out.sparse[:k] = self.label[rows], self.dense[rows], self.sparse[rows]
            return
        k = len(rows)
        np.take(self.label, rows, axis=0, out=out.label[:k], mode="clip")
        np.take(self.dense, rows, axis=0, out=out.dense[:k], mode="clip")
        np.take(self.sparse, rows, axis=0, out=out.sparse[:k], mode="clip")


class _Slot:
    """One reusable host batch of up to B rows, pinned on CUDA so the device copy is asynchronous.

    Slots cycle producer -> queue -> consumer -> free queue -> producer. On CUDA the consumer sets
    `copied` to an event recorded after the device copy from this slot was issued; whoever writes
    into the slot next waits on it first, so a pending copy never reads overwritten rows.
    """

    __slots__ = ("host", "tensors", "copied")

    def __init__(self, batch_size: int, pin: bool, sparse_dtype: torch.dtype = torch.int64):
        self.tensors = (
            torch.empty((batch_size, NUM_DENSE), dtype=torch.int32, pin_memory=pin),
            torch.empty((batch_size, NUM_SPARSE), dtype=sparse_dtype, pin_memory=pin),
            torch.empty((batch_size,), dtype=torch.int8, pin_memory=pin),
        )
        dense, sparse, label = (t.numpy() for t in self.tensors)
        self.host = _HostBlock(label, dense, sparse)  # numpy views of the same memory
        self.copied: Optional[torch.cuda.Event] = None

    def wait_until_copied(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()
            self.copied = None

    def views(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dense, sparse, label) of the first `n` rows (views: still pinned)."""
        return tuple(t[:n] for t in self.tensors)


@dataclass
class _Flush:
    """One shuffle buffer of an epoch: the rows carried over from the previous buffer, then `groups`.

    rows = carry + rows of `groups`; its rows are permuted together and cut into batches, and the
    last ``rows % B`` (in permuted order) are carried into the next buffer (or, in the final one,
    form the partial batch).
    """

    groups: list[int]  # indexes into ParquetLoader.row_groups, in read order
    carry: int
    rows: int
    final: bool


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
        prefetch: batches prepared ahead by the background thread.
        shuffle_buffer_rows: rows shuffled together; also the rows decoded ahead without shuffling.
        reader_threads: row groups decoded at once (default: from the CPU count).
        gather_threads: batches cut from the shuffle buffer at once (default: from the CPU count).
        rank, world_size: in a distributed run, deliver only rank `rank`'s slice of every global
            batch (`rank_slice`); every rank plans and decodes the same buffers (the global batches
            must be identical everywhere) but gathers, copies and transforms only its own rows.
        compact_sparse: move sparse values as int32 bit patterns on the host (exact only without
            0xFFFFFFFF, which the footers' statistics must rule out); None: on CUDA devices.

    Example:
        >>> loader = ParquetLoader(files, batch_size=512, device="cpu")
        >>> for batch in loader: ...   # Batch(dense [512, 13], sparse [512, 26], labels [512])

    Pipeline (all but the last step off the training thread):
      1. `reader_threads` workers decode the row groups of the *next* shuffle buffer (pyarrow,
         GIL released) and transpose them straight into a preallocated row-major buffer, while
      2. `gather_threads` workers gather the batches of the *current* buffer (``np.take`` by the
         shuffle permutation, a slice copy without shuffling) into reusable batch slots, pinned on
         CUDA: each row is copied twice on the host (transpose, gather) and nothing is allocated
         per batch;
      3. the consumer copies a slot to the device on a side stream and hands the slot back.
    The two buffers and the slots are kept by the loader across epochs (first-touch page faults
    cost more than the copies themselves); that is ``2 * (shuffle_buffer_rows + B + largest row
    group) * 261`` bytes of host memory at most, plus ``(prefetch + gather_threads + 2) * B * 261``.

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
        gather_threads: Optional[int] = None,
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
        self.prefetch = prefetch
        self.shuffle_buffer_rows = shuffle_buffer_rows
        cpus = os.cpu_count() or 1
        # Decoding is the bulk of the work (pyarrow also spreads each row group's columns over its
        # own pool); gathering is a memory copy at ~20M rows/s a thread.
        self.reader_threads = reader_threads or max(2, min(8, cpus // 2))
        self.gather_threads = gather_threads or max(2, min(4, cpus // 4))
        self.epoch = 0
        self.start_batch = 0
        # (file index, row group index, rows) for every row group, read from parquet footers only.
        self.row_groups: list[tuple[int, int, int]] = []
        self._footers: list[pq.FileMetaData] = []
        for i, path in enumerate(self.files):
            try:
                meta = pq.ParquetFile(path).metadata
            except (OSError, pa.ArrowException) as e:
                raise DatasetError(f"{path}: not a readable parquet file ({e})") from None
            _check_schema(path, meta.schema.to_arrow_schema())
            self._footers.append(meta)
            self.row_groups += [(i, g, meta.row_group(g).num_rows) for g in range(meta.num_row_groups)]
        self.num_rows = sum(n for _, _, n in self.row_groups)
        self._pin = self.device.type == "cuda"
        # On CUDA, sparse values travel through the host buffers, slots and the bus as int32 bit
        # patterns when the footers prove that exact (`widen_sparse` restores int64 on the GPU):
        # the host transposes and gathers ~20% faster (int32 vs int64 rows, measured on the CPU)
        # and half the sparse bytes cross the bus. On the CPU the widening would run on the host
        # and cost more than it saves, so batches stay int64 there unless `compact_sparse` says.
        want = self.device.type == "cuda" if compact_sparse is None else compact_sparse
        self._compact = want and compact_sparse_ok(self._footers)
        # Largest shuffle buffer any epoch can need: a carry (< B), pending rows below the
        # threshold, then the row group that crosses it (see `_plan`); never more than all rows.
        largest_group = max((n for _, _, n in self.row_groups), default=0)
        self._buffer_rows = min(self.num_rows, batch_size - 1 + max(shuffle_buffer_rows, 1) - 1 + largest_group)
        self._max_slots = prefetch + self.gather_threads + 2
        self._lock = threading.Lock()
        self._spare_buffers: list[_HostBlock] = []  # reused across epochs, see the class docstring
        self._spare_slots: list[_Slot] = []
        self._executors: Optional[tuple[ThreadPoolExecutor, ThreadPoolExecutor]] = None

    def __len__(self) -> int:
        """Batches per epoch."""
        return batches_per_epoch(self.num_rows, self.batch_size, self.drop_last, self.world_size)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """The next iteration yields `epoch`'s batches from index `start_batch` on (for resume).

        The order depends only on (seed, epoch), so skipped batches are the ones a
        previous run consumed; their shuffle buffers are still decoded (later batches take rows
        carried over from them) but the skipped batches are never gathered or copied.
        """
        self.epoch = epoch
        self.start_batch = start_batch

    # -- the epoch's plan -----------------------------------------------------------------------

    def _plan(self, rng: np.random.Generator) -> list[_Flush]:
        """The shuffle buffers of an epoch, from the footers' row counts alone.

        A buffer is flushed as soon as its pending row groups hold ``>= shuffle_buffer_rows`` rows;
        the final one takes whatever is left (carry and/or pending groups). Draws the row-group
        permutation from `rng` (when shuffling); the per-buffer permutations are drawn later, in
        buffer order, by the producer.
        """
        order = rng.permutation(len(self.row_groups)) if self.shuffle else np.arange(len(self.row_groups))
        flushes: list[_Flush] = []
        pending: list[int] = []
        pending_rows = carry = 0
        for k in order.tolist():
            pending.append(k)
            pending_rows += self.row_groups[k][2]
            if pending_rows >= self.shuffle_buffer_rows:
                rows = carry + pending_rows
                flushes.append(_Flush(pending, carry, rows, final=False))
                carry = rows % self.batch_size
                pending, pending_rows = [], 0
        if carry or pending:
            flushes.append(_Flush(pending, carry, carry + pending_rows, final=True))
        return flushes

    # -- producer (background thread and its workers) ------------------------------------------

    def _decode(self, k: int, buf: _HostBlock, at: int) -> None:
        """Read row group `k` into ``buf[at:]`` (on a reader thread).

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
        buf.write(table, at)

    @staticmethod
    def _gather(buf: _HostBlock, rows: np.ndarray | slice, slot: _Slot) -> None:
        slot.wait_until_copied()
        buf.gather_into(rows, slot.host)

    def _take_spares(self, spares: list, count: int, make) -> list:
        with self._lock:
            taken = [spares.pop() for _ in range(min(count, len(spares)))]
        return taken + [make() for _ in range(count - len(taken))]

    def _return_spares(self, spares: list, items: list, keep: int) -> None:
        with self._lock:
            spares.extend(items[: max(0, keep - len(spares))])

    def _produce(self, q: queue.Queue, free: queue.Queue, stop: threading.Event) -> None:
        try:
            self._run_epoch(q, free, stop)
            self._put(q, _END, stop)
        except BaseException as e:  # handed to the consumer thread, which re-raises it
            self._put(q, e, stop)

    def _run_epoch(self, q: queue.Queue, free: queue.Queue, stop: threading.Event) -> None:
        """Decode, cut and hand over one epoch's batches (producer thread)."""
        rng = np.random.default_rng([self.seed, self.epoch])
        plan = self._plan(rng)
        if not plan:
            return
        B = self.batch_size
        n_buffers = min(2, len(plan))
        buffers = self._take_spares(self._spare_buffers, n_buffers, self._new_buffer)
        readers, gatherers = self._pools()
        window: collections.deque = collections.deque()  # (gather future, slot, rows), in batch order
        made_slots = 0

        def decode(f: int) -> collections.deque:
            """Submit flush f's row groups; (future, first buffer row it writes) in buffer order."""
            buf, at, futures = buffers[f % n_buffers], plan[f].carry, collections.deque()
            for k in plan[f].groups:
                futures.append((readers.submit(self._decode, k, buf, at), at))
                at += self.row_groups[k][2]
            return futures

        def wait_decoded(decoding: collections.deque, upto: Optional[int] = None) -> bool:
            """Wait until buffer rows [0, upto) (None: all) are decoded; False when the consumer stopped."""
            while decoding and (upto is None or decoding[0][1] < upto):
                while not stop.is_set():
                    try:
                        decoding[0][0].result(timeout=0.1)  # re-raises a reader's DatasetError
                        break
                    except FuturesTimeout:
                        continue
                else:
                    return False
                decoding.popleft()
            return True

        def hand_over_oldest() -> bool:
            future, slot, n, n_global = window.popleft()
            future.result()
            if self._put(q, (slot, n, n_global), stop):
                return True
            free.put(slot)  # the consumer stopped: keep the slot for the next iteration
            return False

        def acquire_slot() -> Optional[_Slot]:
            """A free slot; never waits while the window holds finished work the consumer could free."""
            nonlocal made_slots
            while not stop.is_set():
                try:
                    return free.get_nowait()
                except queue.Empty:
                    pass
                if made_slots < self._max_slots:
                    made_slots += 1
                    return self._take_spares(self._spare_slots, 1, self._new_slot)[0]
                if window:
                    if not hand_over_oldest():
                        return None
                    continue
                try:
                    return free.get(timeout=0.1)
                except queue.Empty:
                    continue
            return None

        decoding = decoding_next = collections.deque()
        try:
            batch_no = 0
            decoding = decode(0)
            for f, flush in enumerate(plan):
                buf = buffers[f % n_buffers]
                perm = rng.permutation(flush.rows) if self.shuffle else None
                # The other buffer is free: every batch of flush f-1 was handed over and its carry
                # copied into this one. Decode flush f+1 into it while this one is cut into batches
                # (the reader pool is FIFO, so flush f's row groups still come first).
                decoding_next = decode(f + 1) if f + 1 < len(plan) else collections.deque()
                full = flush.rows // B * B
                cuts = [(s, s + B) for s in range(0, full, B)]
                if flush.final and keeps_last_batch(flush.rows - full, self.drop_last, self.world_size):
                    cuts.append((full, flush.rows))
                for lo, hi in cuts:
                    if batch_no >= self.start_batch:
                        # A shuffled batch may take rows from anywhere in the buffer; an unshuffled
                        # one only needs the row groups up to its last row, so it starts early.
                        if not wait_decoded(decoding, None if perm is not None else hi):
                            return
                        slot = acquire_slot()
                        if slot is None:
                            return
                        a, b = rank_slice(lo, hi, self.rank, self.world_size)
                        rows = perm[a:b] if perm is not None else slice(a, b)
                        window.append((gatherers.submit(self._gather, buf, rows, slot), slot, b - a, hi - lo))
                        if len(window) > self.gather_threads and not hand_over_oldest():
                            return
                    batch_no += 1
                if not wait_decoded(decoding):  # skipped batches or a carry still need them
                    return
                while window:  # this buffer is decoded into again once the next flush starts
                    if not hand_over_oldest():
                        return
                if not flush.final and full < flush.rows:
                    buf.gather_into(perm[full:] if perm is not None else slice(full, flush.rows),
                                    buffers[(f + 1) % n_buffers])
                decoding = decoding_next
        finally:
            # Stopped early (or failed): let nothing run on the buffers or slots any more.
            for future, _ in (*decoding, *decoding_next):
                future.cancel()
            wait([f for f, _ in (*decoding, *decoding_next)] + [w[0] for w in window])
            for _, slot, _, _ in window:  # stopped early: no gather runs any more, the slots are idle
                free.put(slot)
            self._return_spares(self._spare_buffers, buffers, keep=2)

    def _pools(self) -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
        """The reader and gather pools, made once per loader.

        Kept across epochs: new threads start with empty allocator caches (pyarrow's mimalloc
        heaps are per thread), which showed up as page faults and system time every epoch.
        Idle threads cost nothing; concurrent iterations share them (each waits on its own futures).
        """
        with self._lock:
            if self._executors is None:
                self._executors = (
                    ThreadPoolExecutor(self.reader_threads, thread_name_prefix="parquet-read"),
                    ThreadPoolExecutor(self.gather_threads, thread_name_prefix="parquet-gather"),
                )
            return self._executors

    def _new_buffer(self) -> _HostBlock:
        dtype = np.int32 if self._compact else np.int64
        logger.debug(f"parquet loader: host shuffle buffer of {self._buffer_rows:,} rows "
                     f"({self._buffer_rows * _row_bytes(dtype) / 2**20:,.0f} MiB, sparse {np.dtype(dtype).name})")
        return _HostBlock.empty(self._buffer_rows, dtype)

    def _new_slot(self) -> _Slot:
        return _Slot(self.batch_size, self._pin, torch.int32 if self._compact else torch.int64)

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
        q: queue.Queue = queue.Queue(maxsize=self.prefetch)
        free: queue.Queue = queue.Queue()  # slots the consumer is done with (unbounded: put never waits)
        stop = threading.Event()
        thread = threading.Thread(target=self._produce, args=(q, free, stop), daemon=True, name="parquet-loader")
        thread.start()
        try:
            host_items = self._drain(q)
            if self.device.type == "cuda":
                yield from self._device_prefetch(host_items, free)
            else:
                for slot, n, n_global in host_items:
                    dense, sparse, label = slot.views(n)
                    # The slot is reused, so the batch must own its memory: the transform, the float
                    # labels and the widened sparse values are all new tensors.
                    batch = Batch(transform_dense(dense), widen_sparse(sparse), label.to(torch.float32),
                                  self._global(n_global))
                    free.put(slot)
                    yield batch
        finally:
            stop.set()
            thread.join()
            # Every slot the producer made is now idle: in `free`, in `q`, or dropped mid-flight.
            slots = [item[0] for item in self._empty(q) if isinstance(item, tuple)] + self._empty(free)
            self._return_spares(self._spare_slots, slots, keep=self._max_slots)

    @staticmethod
    def _empty(q: queue.Queue) -> list:
        items = []
        while True:
            try:
                items.append(q.get_nowait())
            except queue.Empty:
                return items

    @staticmethod
    def _drain(q: queue.Queue) -> Iterator[tuple[_Slot, int, int]]:
        """Host batches from the producer thread, re-raising its exceptions here."""
        while True:
            item = q.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def _global(self, n_global: int) -> Optional[int]:
        return n_global if self.world_size > 1 else None

    def _device_prefetch(self, host_items: Iterator[tuple[_Slot, int, int]], free: queue.Queue) -> Iterator[Batch]:
        """Copy pinned host batches on a side stream, `prefetch` batches ahead of the consumer.

        The copy of batch i+1.. overlaps the step on batch i; the consumer's stream waits on an
        event (no host sync), and `record_stream` keeps the caching allocator from reusing a
        batch's memory while the consumer's stream may still read it. The host slot goes back to
        the producer right away with the event recorded after its copy; the producer waits on
        that event before writing into the slot again.
        """
        copy_stream = torch.cuda.Stream(self.device)
        in_flight: collections.deque = collections.deque()

        def issue(slot: _Slot, n: int, n_global: int) -> None:
            with torch.cuda.stream(copy_stream):
                dense, sparse, label = (t.to(self.device, non_blocking=True) for t in slot.views(n))
                # Recorded right after the copies, before the transform kernels (which may queue
                # behind the training step for SMs): the slot is free once the DMA is done.
                copied = torch.cuda.Event()
                copied.record(copy_stream)
                dense = transform_dense(dense)
                sparse = widen_sparse(sparse) if sparse.dtype != torch.int64 else sparse
                label = label.to(torch.float32)
                done = torch.cuda.Event()
                done.record(copy_stream)
            slot.copied = copied
            free.put(slot)  # the producer waits on `copied` before writing into it again
            in_flight.append((Batch(dense, sparse, label, self._global(n_global)), done))

        for slot, n, n_global in host_items:
            issue(slot, n, n_global)
            if len(in_flight) > self.prefetch:
                yield self._hand_over(*in_flight.popleft())
        while in_flight:
            yield self._hand_over(*in_flight.popleft())

    @staticmethod
    def _hand_over(batch: Batch, done: torch.cuda.Event) -> Batch:
        current = torch.cuda.current_stream(batch.labels.device)
        current.wait_event(done)
        for t in (batch.dense, batch.sparse, batch.labels):
            t.record_stream(current)
        return batch
