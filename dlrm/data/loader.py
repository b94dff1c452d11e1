"""Batched parquet loader: row groups -> contiguous tensors, prefetched in a background thread.

Never per-row Python: each row group is decoded by pyarrow into column arrays, stacked into
[n, 13] / [n, 26] numpy blocks, shuffled as blocks of indices and cut into batches, all in a
background thread (pyarrow decodes with its own thread pool). On CUDA the host batches are
pinned there and copied with ``non_blocking=True`` on a side stream, `prefetch` batches ahead
of the training step; the dense transform ``log1p(max(x, 0))`` runs on the device after the
copy (ints cross the bus, floats come out). `dlrm.data.device_loader` keeps a whole split in
GPU memory instead.
"""

from __future__ import annotations

import collections
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from dlrm.data.schema import (
    DENSE_COLUMNS,
    LABEL_COLUMN,
    SPARSE_COLUMNS,
    DatasetError,
    Metadata,
    arrow_schema,
)


@dataclass
class Batch:
    """One batch on the target device.

    dense: float32 [B, 13], already log1p(max(x, 0)); sparse: int64 [B, 26] raw hash values;
    labels: float32 [B].
    """

    dense: torch.Tensor
    sparse: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return self.labels.shape[0]


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


class _HostBlock:
    """Decoded rows on the host: label int8 [n], dense int32 [n, 13], sparse int64 [n, 26]."""

    __slots__ = ("label", "dense", "sparse")

    def __init__(self, label: np.ndarray, dense: np.ndarray, sparse: np.ndarray):
        self.label, self.dense, self.sparse = label, dense, sparse

    def __len__(self) -> int:
        return len(self.label)

    @staticmethod
    def from_table(table: pa.Table) -> "_HostBlock":
        label = table.column(LABEL_COLUMN).to_numpy()
        dense = np.stack([table.column(c).to_numpy() for c in DENSE_COLUMNS], axis=1)
        sparse = np.stack([table.column(c).to_numpy() for c in SPARSE_COLUMNS], axis=1)
        return _HostBlock(label, dense, sparse)

    @staticmethod
    def concat(blocks: list["_HostBlock"]) -> "_HostBlock":
        if len(blocks) == 1:
            return blocks[0]
        return _HostBlock(
            np.concatenate([b.label for b in blocks]),
            np.concatenate([b.dense for b in blocks]),
            np.concatenate([b.sparse for b in blocks]),
        )

    def take(self, idx: np.ndarray | slice) -> "_HostBlock":
        return _HostBlock(self.label[idx], self.dense[idx], self.sparse[idx])


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
        shuffle_buffer_rows: rows shuffled together.

    Example:
        >>> loader = ParquetLoader(files, batch_size=512, device="cpu")
        >>> for batch in loader: ...   # Batch(dense [512, 13], sparse [512, 26], labels [512])
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
    ) -> None:
        self.files = [Path(f) for f in files]
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.prefetch = prefetch
        self.shuffle_buffer_rows = shuffle_buffer_rows
        self.epoch = 0
        self.start_batch = 0
        # (file index, row group index, rows) for every row group, read from parquet footers only.
        self.row_groups: list[tuple[int, int, int]] = []
        for i, path in enumerate(self.files):
            try:
                meta = pq.ParquetFile(path).metadata
            except (OSError, pa.ArrowException) as e:
                raise DatasetError(f"{path}: not a readable parquet file ({e})") from None
            _check_schema(path, meta.schema.to_arrow_schema())
            self.row_groups += [(i, g, meta.row_group(g).num_rows) for g in range(meta.num_row_groups)]
        self.num_rows = sum(n for _, _, n in self.row_groups)
        self._pin = self.device.type == "cuda"

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(self.num_rows, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """The next iteration yields `epoch`'s batches from index `start_batch` on (for resume).

        The order depends only on (seed, epoch), so skipped batches are the ones a
        previous run consumed; they are cut on the host but never converted or copied.
        """
        self.epoch = epoch
        self.start_batch = start_batch

    # -- producer (background thread) -----------------------------------------------------------

    def _host_batches(self, stop: threading.Event) -> Iterator[_HostBlock]:
        rng = np.random.default_rng([self.seed, self.epoch])
        order = rng.permutation(len(self.row_groups)) if self.shuffle else np.arange(len(self.row_groups))
        readers: dict[int, pq.ParquetFile] = {}
        pending: list[_HostBlock] = []
        pending_rows = 0
        carry: Optional[_HostBlock] = None  # rows left over from the previous buffer

        def flush(final: bool) -> Iterator[_HostBlock]:
            nonlocal carry
            blocks = ([carry] if carry is not None else []) + pending
            if not blocks:
                return
            buf = _HostBlock.concat(blocks)
            n = len(buf)
            idx = rng.permutation(n) if self.shuffle else np.arange(n)
            full = n // self.batch_size * self.batch_size
            for start in range(0, full, self.batch_size):
                yield buf.take(idx[start : start + self.batch_size])
            rest = idx[full:]
            carry = buf.take(rest) if len(rest) else None
            if final and carry is not None:
                if not self.drop_last:
                    yield carry
                carry = None

        for k in order:
            if stop.is_set():
                return
            fi, gi, _ = self.row_groups[k]
            reader = readers.get(fi) or readers.setdefault(fi, pq.ParquetFile(self.files[fi]))
            try:
                table = reader.read_row_group(gi, columns=[LABEL_COLUMN, *DENSE_COLUMNS, *SPARSE_COLUMNS])
            except (OSError, pa.ArrowException) as e:
                raise DatasetError(f"{self.files[fi]}: row group {gi}: cannot be read ({e})") from None
            pending.append(_HostBlock.from_table(table))
            pending_rows += len(pending[-1])
            if pending_rows >= self.shuffle_buffer_rows:
                yield from flush(final=False)
                pending, pending_rows = [], 0
        yield from flush(final=True)

    def _to_tensors(self, block: _HostBlock) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tensors = (
            torch.from_numpy(np.ascontiguousarray(block.dense)),
            torch.from_numpy(np.ascontiguousarray(block.sparse)),
            torch.from_numpy(np.ascontiguousarray(block.label)),
        )
        if self._pin:
            tensors = tuple(t.pin_memory() for t in tensors)
        return tensors

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

    def _produce(self, q: queue.Queue, stop: threading.Event) -> None:
        try:
            for i, block in enumerate(self._host_batches(stop)):
                if i < self.start_batch:
                    continue
                if not self._put(q, self._to_tensors(block), stop):
                    return
            self._put(q, _END, stop)
        except BaseException as e:  # handed to the consumer thread, which re-raises it
            self._put(q, e, stop)

    # -- consumer -------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        q: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        thread = threading.Thread(target=self._produce, args=(q, stop), daemon=True, name="parquet-loader")
        thread.start()
        try:
            host_items = self._drain(q)
            if self.device.type == "cuda":
                yield from self._device_prefetch(host_items)
            else:
                for dense, sparse, label in host_items:
                    yield Batch(transform_dense(dense), sparse, label.to(torch.float32))
        finally:
            stop.set()
            thread.join()

    @staticmethod
    def _drain(q: queue.Queue) -> Iterator[tuple[torch.Tensor, ...]]:
        """Host batches from the producer thread, re-raising its exceptions here."""
        while True:
            item = q.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def _device_prefetch(self, host_items: Iterator[tuple[torch.Tensor, ...]]) -> Iterator[Batch]:
        """Copy pinned host batches on a side stream, `prefetch` batches ahead of the consumer.

        The copy of batch i+1.. overlaps the step on batch i; the consumer's stream waits on an
        event (no host sync), and `record_stream` keeps the caching allocator from reusing a
        batch's memory while the consumer's stream may still read it.
        """
        copy_stream = torch.cuda.Stream(self.device)
        in_flight: collections.deque = collections.deque()

        def issue(item: tuple[torch.Tensor, ...]) -> None:
            with torch.cuda.stream(copy_stream):
                dense, sparse, label = (t.to(self.device, non_blocking=True) for t in item)
                dense = transform_dense(dense)
                label = label.to(torch.float32)
                done = torch.cuda.Event()
                done.record(copy_stream)
            in_flight.append((Batch(dense, sparse, label), done))

        for item in host_items:
            issue(item)
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
