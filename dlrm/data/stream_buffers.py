"""What `dlrm.data.parquet_loader.ParquetLoader` passes between its producer and its consumer:
the plan of one shuffle buffer (`_Flush`), a buffer resident on the device (`_Resident`), one
producer thread with its queues (`_Run`), the end-of-epoch marker (`_END`), and the two ends of its queue
(`put_unless_stopped`, `receive`)."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch


class Cuts:
    """The row ranges a shuffle buffer is cut into, as a read-only sequence of ``(lo, hi)``: ``full // size`` batches of
    `size` rows from row 0, then ``(full, end)`` when `end` is past `full` (a last, partial batch).

    Made as they are read, not held: a list of tuples held every batch of an epoch's plan, the epoch's and, chained,
    the next one's (batch 2048 over MLPerf's 4.2e9 rows: 2.1M batches, 260 MB and 4 s a plan; batch 512: 1 GB).

        >>> list(Cuts(4, 8, 10)), len(Cuts(4, 8, 8)), Cuts(4, 8, 10)[-1]
        ([(0, 4), (4, 8), (8, 10)], 2, (8, 10))
    """

    __slots__ = ("size", "full", "end")

    def __init__(self, size: int, full: int, end: int) -> None:
        self.size, self.full, self.end = size, full, end

    def __len__(self) -> int:
        return self.full // self.size + (self.end > self.full)

    def __getitem__(self, i: int) -> tuple[int, int]:
        n = len(self)
        if not -n <= i < n:
            raise IndexError("cut index out of range")
        i %= n
        lo = i * self.size
        return (lo, lo + self.size) if lo < self.full else (self.full, self.end)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        for lo in range(0, self.full, self.size):
            yield lo, lo + self.size
        if self.end > self.full:
            yield self.full, self.end

    def __repr__(self) -> str:
        return f"Cuts(size={self.size}, full={self.full}, end={self.end})"


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
    cuts: Cuts
    first_batch: int
    keep: int


@dataclass
class _Resident:
    """A shuffle buffer as the consumer cuts it: row-major tensors on the target device.

    dense float32 [rows, 13] (transformed), sparse int64 [rows, L], labels float32 [rows], perm
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


@dataclass
class _Run:
    """One producer thread and the queues it fills: one epoch, or (``chain_epochs``) epoch after epoch.

    `next_epoch`: the epoch whose buffers the queue delivers next; `first`: that epoch's first
    buffer, already uploaded while the previous epoch's last batches were cut (or None); `error`: what the
    producer raised decoding that buffer instead (raised when that epoch is iterated).
    """

    q: queue.Queue
    free: queue.Queue
    stop: threading.Event
    thread: threading.Thread
    next_epoch: int
    copy_stream: Optional[torch.cuda.Stream]
    first: Optional[_Resident] = None
    error: Optional[BaseException] = None


def put_unless_stopped(q: queue.Queue, item, stop: threading.Event) -> bool:
    """Put unless the consumer has stopped; False when it has."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def receive(q: queue.Queue, block: bool, end: Optional[bool] = False):
    """The next decoded arena (None if `block` is False and none is ready), re-raising the
    producer's exceptions here; `end`: expect the end of the epoch instead (None: either)."""
    try:
        item = q.get(block=block)
    except queue.Empty:
        return None
    if isinstance(item, BaseException):
        raise item
    if end is not None and (item is _END) != end:
        raise RuntimeError("parquet loader: the producer and the plan disagree on the buffers")
    return item
