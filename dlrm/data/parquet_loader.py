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
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from loguru import logger

from dlrm.data.batch import (Batch, batches_per_epoch, check_rank_batch, compact_range, keeps_last_batch, rank_rows,
                             transform_dense, widen_sparse)
from dlrm.data.footer_cache import FooterCache
from dlrm.data.host_arena import _Arena, _write_columns, compact_sparse_ok
from dlrm.data.reader_pool import default_arrow_threads, lower_readers, reader_pool
from dlrm.data.schema import (NUM_DENSE, NUM_SPARSE, DatasetError, arrow_schema, check_dense_format, is_multi_hot,
                              one_hot_sizes, sparse_width)
from dlrm.data.shuffle_seed import epoch_rng
from dlrm.data.stream_buffers import _END, Cuts, _Flush, _Resident, _Run, put_unless_stopped, receive
from dlrm.data.validation import NullTally, check_schema, check_table, first_rows, open_shard


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
        reader_threads: row groups decoded at once (default: from the CPU count: a quarter of the cores, 2 to 4,
            for one-hot rows; one a core, up to 16, for multi-hot ones).
        rank, world_size: in a distributed run, deliver only rank `rank`'s slice of every global
            batch (`rank_slice`); every rank plans, decodes and uploads the same buffers (the
            global batches must be identical everywhere) but cuts only its own rows.
        pad_ranks: keep a last batch of fewer rows than ranks, padded (`rank_rows`, `Batch.pad`): evaluations.
            Without it, the ranks such a batch is left out for are `epoch_ranks` (set after; `TrainData` may raise it).
        compact_sparse: move sparse values as int32 bit patterns on the host (exact only without
            0xFFFFFFFF, and in multi-hot data 0xFFFFFFFE, which the footers' statistics must rule
            out); None: on CUDA devices.
        multi_hot_sizes: the dataset's `Metadata.multi_hot_sizes` (None: one-hot). Batches then
            carry sparse int64 [B, L], L = sum of the sizes, each feature in its slots
            (`dlrm.data.schema.slot_offsets`), `PAD_SPARSE` (-2) in the slots a short list leaves.
        dense_format: the dataset's `Metadata.dense_format`: "counts" (int32, fed as ``log1p(max(x, 0))``) or
            "float" (float32, fed as they are); every file must hold it.
        chain_epochs: keep decoding across epoch boundaries: when an epoch has been iterated to its
            end, the producer goes on with the next epoch's buffers (and the consumer uploads the
            next epoch's first buffer while this epoch's last batches are cut), so the next
            ``iter()`` after ``set_epoch(epoch + 1)`` starts without waiting for a decode. Batches
            are the same either way. Call `close` when done (the training loader; evaluation
            loaders, iterated now and then, leave it off).
        arrow_threads: whether each reader also spreads its row group's columns over pyarrow's own
            thread pool (``use_threads``); None: `dlrm.data.reader_pool.default_arrow_threads` (on for
            one-hot rows, off for multi-hot ones). Without it the readers run at a lower priority
            than the training thread (`dlrm.data.reader_pool`).

    Example (the validation split of the embedded sample dataset, data/sample):
        >>> import pathlib, dlrm
        >>> from dlrm.data.loader import split_files
        >>> from dlrm.data.schema import read_metadata
        >>> sample = pathlib.Path(dlrm.__file__).parents[1] / "data" / "sample"
        >>> files = split_files(sample, read_metadata(sample), "validation")   # 20,000 rows
        >>> loader = ParquetLoader(files, batch_size=512, device="cpu", shuffle=True)
        >>> len(loader)   # batches per epoch: 39 full ones and the last 32 rows
        40
        >>> batch = next(iter(loader))
        >>> batch.dense.shape, batch.sparse.dtype, batch.labels.shape
        (torch.Size([512, 13]), torch.int64, torch.Size([512]))

    Pipeline, one shuffle buffer (about `shuffle_buffer_rows` rows) at a time:
      1. producer: `reader_threads` workers decode the buffer's row groups (pyarrow, GIL released,
         with `arrow_threads` each also spreading its columns over pyarrow's own pool) and copy each column with one
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
    ``(prefetch + 1)`` arenas of ``R * (53 + L * s) + 8 * (R + B)`` bytes of host memory
    (L = 26 sparse slots a row when one-hot, ``sum(multi_hot_sizes)`` otherwise; s = 4 or 8 bytes
    a sparse value, R = rows of the largest buffer, at most ``shuffle_buffer_rows + largest row
    group``), parsed footers up to `dlrm.data.footer_cache.FOOTER_CACHE_BYTES` of footer (~8x that; more for files
    of many small row groups, `REPARSE_BYTES_PER_VALUE`), and, on the device, two buffers of ``56 + 8 * L`` bytes a
    row plus one upload.

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
        prefetch: int = 3,
        shuffle_buffer_rows: int = 1_000_000,
        reader_threads: Optional[int] = None,
        rank: int = 0,
        world_size: int = 1,
        pad_ranks: bool = False,
        compact_sparse: Optional[bool] = None,
        multi_hot_sizes: Optional[list[int]] = None,
        dense_format: str = "counts",
        chain_epochs: bool = False,
        arrow_threads: Optional[bool] = None,
    ) -> None:
        self.files = [Path(f) for f in files]
        self.multi_hot_sizes = list(multi_hot_sizes) if multi_hot_sizes is not None else one_hot_sizes()
        if len(self.multi_hot_sizes) != NUM_SPARSE or min(self.multi_hot_sizes) < 1:
            raise ValueError(f"multi_hot_sizes must be {NUM_SPARSE} integers >= 1, got {multi_hot_sizes}")
        self._multi_hot = is_multi_hot(self.multi_hot_sizes)
        self._width = sparse_width(self.multi_hot_sizes)
        self.dense_format = check_dense_format(dense_format)
        self.batch_size = batch_size
        check_rank_batch(batch_size, world_size, pad_ranks)
        self.rank, self.world_size, self.pad_ranks, self.epoch_ranks = rank, world_size, pad_ranks, world_size
        self.device = torch.device(device)
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.prefetch = max(1, prefetch)
        self.shuffle_buffer_rows = shuffle_buffer_rows
        # Decoding is the bulk of the host work, and pyarrow already spreads each row group's columns over its own
        # pool (one thread a core): a few row groups at once keep the cores busy, more only contend (16-core H100
        # host, results/loader_throughput_*: 4 readers 27M shuffled samples/s, 8 23M, 16 25M). Multi-hot row groups
        # must decode side by side: a few columns hold most of their values, which pyarrow's pool cannot split. One
        # reader a core (16-core H200 host, MLPerf rows, results/loader_throughput_mlperf.md: 4 readers 0.45M
        # samples/s, 8 0.66M, 16 0.71M), at most 16: each holds a decoded row group (~0.6 GB for 131,072 MLPerf
        # rows), and more than 16 were not measured.
        cores = os.cpu_count() or 1
        self.reader_threads = reader_threads or (max(2, min(16, cores)) if is_multi_hot(self.multi_hot_sizes)
                                                 else max(2, min(4, cores // 4)))
        if not isinstance(arrow_threads, (bool, type(None))):
            raise TypeError(f"arrow_threads must be True, False or None, got {arrow_threads!r}")
        self.arrow_threads = default_arrow_threads(self._multi_hot) if arrow_threads is None else arrow_threads
        self.epoch, self.start_batch = 0, 0
        # (file index, row group index, rows) for every row group, read from parquet footers only.
        self.row_groups: list[tuple[int, int, int]] = []
        self._pin = self.device.type == "cuda"
        # On CUDA, sparse values travel through the arenas and the bus as int32 bit patterns when
        # the footers prove that exact (`widen_sparse` restores int64 on the GPU): half the sparse
        # bytes to copy on the host and across the bus. On the CPU the widening would cost more
        # than it saves, so buffers stay int64 there unless `compact_sparse` says.
        self._compact = self.device.type == "cuda" if compact_sparse is None else compact_sparse
        # Each file checked once, here; its sparse layout ("lists" or "slots") read from its own schema. What the
        # loader needs of a footer is taken now, and the parsed footers are not all kept (`FooterCache`: MLPerf's
        # ~4,000 train files held 6.5 GB parsed, in every loader of every rank, for the whole run).
        self._footers, self._layouts, self._codecs, groups = FooterCache(), [], set(), []
        for i, path in enumerate(self.files):
            meta, layout = open_shard(path, self.multi_hot_sizes, self.dense_format)
            self._layouts.append(layout)
            self.row_groups += [(i, g, meta.row_group(g).num_rows) for g in range(meta.num_row_groups)]
            groups.append(meta.num_row_groups)
            if meta.num_row_groups:
                self._codecs.update(meta.row_group(0).column(c).compression for c in range(meta.num_columns))
            self._compact = self._compact and compact_sparse_ok([meta], compact_range(self._multi_hot))
            self._footers.put(i, meta)
        self._columns = {layout: arrow_schema(self.multi_hot_sizes, layout).names for layout in set(self._layouts)}
        self._first_rows = first_rows(self.row_groups)
        self._nulls = NullTally(self.files, groups)
        self.num_rows = sum(n for _, _, n in self.row_groups)
        # Largest buffer any epoch can need: pending rows below the threshold, then the row group
        # that crosses it (see `_plan`), plus a carry (< B); never more than all rows.
        largest_group = max((n for _, _, n in self.row_groups), default=0)
        self._new_rows = min(self.num_rows, max(shuffle_buffer_rows, 1) - 1 + largest_group)
        self._buffer_rows = min(self.num_rows, batch_size - 1 + self._new_rows)
        self._max_arenas = self.prefetch + 1
        self._lock = threading.Lock()
        self._spare_arenas: list[_Arena] = []  # reused across epochs (first-touch page faults and pinning are slow)
        self._readers: Optional[ThreadPoolExecutor] = None
        self.chain_epochs = chain_epochs
        self._live: Optional[_Run] = None  # a chained producer already decoding the next epoch

    @property
    def codecs(self) -> set[str]:
        """The parquet codecs of the split's files ("ZSTD", "LZ4", "UNCOMPRESSED", ...), from the footers."""
        return set(self._codecs)

    @property
    def layouts(self) -> set[str]:
        """The sparse layouts of the split's files ("lists", "slots"; `dlrm.data.validation.file_layout`)."""
        return set(self._layouts)

    def __len__(self) -> int:
        """Batches per epoch."""
        return batches_per_epoch(self.num_rows, self.batch_size, self.drop_last, self.epoch_ranks, self.pad_ranks)

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
            last = final and keeps_last_batch(rows - full, self.drop_last, self.epoch_ranks, self.pad_ranks)
            cuts = Cuts(B, full, rows if last else full)  # (not a list: 2.1M tuples a plan at B 2048 over 4.2e9 rows)
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

        Opens the file for this one read: with the footer parsed in `__init__` (kept in `FooterCache`; one
        past its budget is parsed again) that costs ~50 us against milliseconds of decoding, shares no reader
        object between threads, and keeps no file descriptors open however many shards a split has.
        """
        fi, gi, n = self.row_groups[k]
        try:
            meta = self._footers.footer(fi, self.files[fi], lambda m: check_schema(  # parsed again: still as opened?
                self.files[fi], m.schema.to_arrow_schema(), self.multi_hot_sizes, self._layouts[fi], self.dense_format))
            with pq.ParquetFile(self.files[fi], metadata=meta) as reader:
                # arrow_threads: pyarrow decodes the columns on its own pool as well
                table = reader.read_row_group(gi, columns=self._columns[self._layouts[fi]],
                                              use_threads=self.arrow_threads)
        except (OSError, pa.ArrowException) as e:
            raise DatasetError(f"{self.files[fi]}: row group {gi}: cannot be read ({e})") from None
        if table.num_rows != n:  # the plan placed every row group by its footer's count
            raise DatasetError(f"{self.files[fi]}: row group {gi}: has {table.num_rows} rows, its footer said {n}")
        # Checked where it is decoded (vectorized, on this reader thread, every epoch: the file is
        # untrusted and may change); a DatasetError reaches the consumer through the producer.
        layout = self._layouts[fi]
        table, replaced = check_table(self.files[fi], gi, self._first_rows[k], table, self.multi_hot_sizes, layout,
                                      self.dense_format, compact_range(self._multi_hot) if self._compact else None)
        self._nulls.add(fi, gi, replaced)
        _write_columns(table, out, at, self.multi_hot_sizes, layout)

    def _take_spares(self, spares: list, count: int, make) -> list:
        with self._lock:
            taken = [spares.pop() for _ in range(min(count, len(spares)))]
        return taken + [make() for _ in range(count - len(taken))]

    def _return_spares(self, spares: list, items: list, keep: int) -> None:
        with self._lock:
            spares.extend(items[: max(0, keep - len(spares))])

    def _epoch_flushes(self, epoch: int, plan: list[_Flush], rng: np.random.Generator) -> Iterator:
        """``(flush, rng)`` in decode order and `_END` after each epoch's last buffer: `epoch`'s
        (`plan`, drawn from `rng`), then, with ``chain_epochs``, the following epochs' forever (the
        producer stops when the consumer does)."""
        while True:
            for flush in plan:
                yield flush, rng
            yield _END
            if not self.chain_epochs:
                return
            epoch += 1
            plan = self._plan(rng := epoch_rng(self.seed, epoch))

    def _produce(self, flushes: Iterator, q: queue.Queue, free: queue.Queue, stop: threading.Event) -> None:
        try:
            self._decode_epochs(flushes, q, free, stop)
        except BaseException as e:  # handed to the consumer thread, which re-raises it
            self._put(q, e, stop)

    def _decode_epochs(self, flushes: Iterator, q: queue.Queue, free: queue.Queue, stop: threading.Event) -> None:
        """Decode the buffers into arenas and hand them over in order, with the epochs' end
        markers between them (producer thread). A marker waits in line behind the buffers still
        decoding, so the next epoch's first buffers decode while this epoch's last ones are cut."""
        readers = self._pool()
        pending: collections.deque = collections.deque()  # (arena, futures) or _END, in buffer order
        made = 0

        def hand_over_oldest() -> bool:
            """Wait for the oldest buffer's decode and queue it; False when the consumer stopped
            (the buffer then stays in `pending`, whose decodes the `finally` below waits for)."""
            if pending[0] is _END:
                if not self._put(q, _END, stop):
                    return False
                pending.popleft()
                return True
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
            for item in flushes:
                if item is _END:
                    pending.append(_END)
                    while pending and pending[0] is _END:  # nothing left to wait for before it
                        if not hand_over_oldest():
                            return
                    continue
                flush, rng = item
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
                while pending and (pending[0] is _END or all(f.done() for f in pending[0][1])):  # what is ready, early
                    if not hand_over_oldest():
                        return
            while pending:
                if not hand_over_oldest():
                    return
        finally:
            # Stopped early (or failed): let nothing run on the arenas any more.
            decoding = [item for item in pending if item is not _END]
            futures = [f for _, fs in decoding for f in fs]
            for f in futures:
                f.cancel()
            wait(futures)
            for arena, _ in decoding:
                free.put(arena)

    def _pool(self) -> ThreadPoolExecutor:
        """The reader pool, made once per loader.

        Kept across epochs: new threads start with empty allocator caches (pyarrow's mimalloc
        heaps are per thread), which showed up as page faults and system time every epoch.
        Idle threads cost nothing; concurrent iterations share it (each waits on its own futures).
        """
        with self._lock:
            if self._readers is None:
                self._readers = reader_pool(self.reader_threads, lower=lower_readers(self.arrow_threads))
            return self._readers

    def _new_arena(self) -> _Arena:
        sparse = torch.int32 if self._compact else torch.int64
        arena = _Arena(self._new_rows, self._buffer_rows, self._pin, sparse, self._width)
        size = sum(t.numel() * t.element_size() for t in (arena.label, arena.dense, arena.sparse, arena.perm))
        logger.debug(f"parquet loader: host arena of {self._new_rows:,} rows ({size / 2**20:,.0f} MiB"
                     f"{', pinned' if self._pin else ''}, sparse {sparse})")
        return arena

    _put = staticmethod(put_unless_stopped)

    # -- consumer -------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        rng = epoch_rng(self.seed, self.epoch)  # (seed, epoch)'s own stream: `dlrm.data.shuffle_seed`
        plan = self._plan(rng)  # the same plan a chained producer drew for this epoch
        run, self._live = self._live, None
        if run is None or run.next_epoch != self.epoch:
            if run is not None:  # a chained producer decoding another epoch (set_epoch jumped)
                self._stop_run(run)
            run = self._start_run(plan, rng)
        finished = False
        try:
            yield from self._cut_epoch(plan, run)
            finished = True
        finally:
            if finished and self.chain_epochs:
                run.next_epoch = self.epoch + 1
                # goes on decoding: the next epoch's iter() takes it over (one such run at a time)
                older, self._live = self._live, run
                if older is not None:
                    self._stop_run(older)
            else:
                self._stop_run(run)

    def close(self) -> None:
        """Stop a chained producer that is decoding ahead (``chain_epochs``); idempotent."""
        run, self._live = self._live, None
        if run is not None:
            self._stop_run(run)

    def _start_run(self, plan: list[_Flush], rng: np.random.Generator) -> _Run:
        q: queue.Queue = queue.Queue(maxsize=self.prefetch)
        free: queue.Queue = queue.Queue()  # arenas the consumer is done with (unbounded: put never waits)
        stop = threading.Event()
        flushes = self._epoch_flushes(self.epoch, plan, rng)
        thread = threading.Thread(target=self._produce, args=(flushes, q, free, stop), daemon=True,
                                  name="parquet-loader")
        thread.start()
        copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        return _Run(q, free, stop, thread, self.epoch, copy_stream)

    def _stop_run(self, run: _Run) -> None:
        run.stop.set()
        run.thread.join()
        # Every arena the producer made is now idle: in `free`, in `q`, or dropped mid-flight.
        arenas = [a for a in self._empty(run.q) if isinstance(a, _Arena)] + self._empty(run.free)
        self._return_spares(self._spare_arenas, arenas, keep=self._max_arenas)

    def _cut_epoch(self, plan: list[_Flush], run: _Run) -> Iterator[Batch]:
        """Upload each decoded buffer as soon as it arrives and cut the current one into batches."""
        q, free, copy_stream = run.q, run.free, run.copy_stream
        previous: Optional[tuple[_Flush, _Resident]] = None  # needed only until the next upload (its carry)
        if run.error is not None:  # decoding this epoch ahead failed (`_look_ahead`); the producer is gone
            raise run.error
        current, run.first = run.first, None  # uploaded during the previous epoch (chained), or None
        ended = False  # this epoch's end marker received (while looking ahead into the next epoch)
        # the next buffer's failed decode, found while cutting this one: raised where that buffer is needed, after this
        # buffer's batches. Raised at once, the batch it failed at depended on the reader threads' timing, and under
        # torchrun one rank stopped while the others, a batch or more behind, waited for it in that step's collectives
        failed: Optional[Exception] = None
        for f, flush in enumerate(plan):
            if current is None:  # the first buffer, or the next one had not arrived while cutting
                if failed is not None:
                    raise failed
                current = self._upload(flush, self._receive(q, block=True), previous, free, copy_stream)
            previous = upcoming = None
            last = f + 1 == len(plan)
            for i, (lo, hi) in enumerate(flush.cuts):
                if upcoming is None and not last and failed is None:  # start copying the next buffer early
                    try:
                        arena = self._receive(q, block=False)
                    except Exception as e:  # noqa: BLE001 - raised when the next buffer is needed (above)
                        failed, arena = e, None
                    if arena is not None:
                        upcoming = self._upload(plan[f + 1], arena, (flush, current), free, copy_stream)
                elif last and self.chain_epochs and run.first is None:
                    ended = self._look_ahead(run, ended)
                if flush.first_batch + i >= self.start_batch:
                    yield self._cut(current, lo, hi)
            previous, current = (flush, current), upcoming
        if not ended:
            self._receive(q, block=True, end=True)  # the producer's end marker (or its exception)

    def _look_ahead(self, run: _Run, ended: bool) -> bool:
        """During an epoch's last buffer (chained): take this epoch's end marker, then the next
        epoch's first decoded buffer if it is ready, and upload it now, so the next epoch starts on
        a buffer already on the device. Returns whether the end marker was taken."""
        if not ended:
            item = self._receive(run.q, block=False, end=None)
            if item is None:
                return False
            if item is not _END:
                raise RuntimeError("parquet loader: the producer and the plan disagree on the buffers")
        try:
            arena = self._receive(run.q, block=False)
        except Exception as e:  # noqa: BLE001 - the next epoch's decode failed: raised when that epoch starts
            run.error = e  # (`_cut_epoch`), not among this epoch's last batches, which may be all (one buffer)
            return True
        if arena is not None:
            plan = self._plan(epoch_rng(self.seed, self.epoch + 1))
            run.first = self._upload(plan[0], arena, None, run.free, run.copy_stream)
        return True

    _receive = staticmethod(receive)

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
                torch.empty((flush.rows, self._width), dtype=torch.int64, device=dev),
                torch.empty((flush.rows,), dtype=torch.float32, device=dev),
                perm, None,
            )
            if flush.carry:  # rows [keep, rows) of the previous buffer, in its permuted order
                prev_flush, prev = previous
                carried = prev.take(prev_flush.keep, prev_flush.rows)
                for dst, src in zip((out.dense, out.sparse, out.labels), carried):
                    dst[: flush.carry] = src
            out.dense[flush.carry :] = transform_dense(dense.t(), self.dense_format)
            out.sparse[flush.carry :] = (widen_sparse(sparse.t(), self._multi_hot) if sparse.dtype != torch.int64
                                         else sparse.t())
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
        a, b, pad = rank_rows(lo, hi, self.rank, self.world_size, self.pad_ranks)
        dense, sparse, labels = buf.take(a, b)
        return Batch(dense, sparse, labels, hi - lo if self.world_size > 1 else None, pad)

    @staticmethod
    def _empty(q: queue.Queue) -> list:
        items = []
        while True:
            try:
                items.append(q.get_nowait())
            except queue.Empty:
                return items
