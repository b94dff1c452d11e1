"""A whole split resident in device memory, batches cut from a device-side permutation.

``data.placement: "gpu"``: the split is read once, row group by row group, transformed and
copied into preallocated device tensors; every epoch then draws a permutation on the device
and each batch is a gather by a slice of it (`GatheredBatch`: gathered when first read, or inside a
CUDA-graphed step's graph). The host does no per-batch work beyond launching those gathers, and
nothing syncs. Criteo Kaggle (45.8M rows) takes about 7.3 GB this way:

    dense   float32 [N, 13]  log1p(max(x, 0)), transformed once      52 B/row
    sparse  int32   [N, 26]  the 32-bit hash's bit pattern           104 B/row
    labels  float32 [N]                                                4 B/row

A raw value v in [0, 2^32) is kept as the int32 with the same bits and widened back with
``v & 0xFFFFFFFF``; a missing value (-1) stays -1. That is exact unless a split holds the value
0xFFFFFFFF itself (its bits equal -1's) or a value outside [-1, 2^32) (the int64 form keeps any value), in
which case the sparse block is kept as int64 (208 B/row) and the log says so.

Multi-hot data (``multi_hot_sizes``): sparse is [N, L], L = sum of the sizes (4 * L bytes a row,
856 for MLPerf's 214 slots), empty slots hold -2 (`PAD_SPARSE`); 0xFFFFFFFE (-2's bits) then
also sends the split to int64, and the range is [-2, 2^32) (`dlrm.data.batch.compact_range`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from dlrm.data.batch import GatheredBatch, ResidentSplit
from dlrm.data.loader import (
    Batch,
    NullTally,
    _HostBlock,
    batches_per_epoch,
    check_rank_batch,
    check_table,
    compact_range,
    first_rows,
    open_shard,
    rank_rows,
    transform_dense,
)
from dlrm.data.loader import widen_sparse as _widen
from dlrm.data.schema import (
    NUM_DENSE,
    NUM_SPARSE,
    DatasetError,
    SparseLayout,
    arrow_schema,
    check_dense_format,
    is_multi_hot,
    one_hot_sizes,
    sparse_width,
)
from dlrm.logging_setup import ProgressBar, run_logger


_WIDEN_ROWS = 1 << 20  # rows widened to int64 at a time when a split turns out to need it


def _as_int64(v: int) -> int:
    """A 64-bit constant as the signed value torch's int64 holds for it."""
    return v - (1 << 64) if v >= 1 << 63 else v


def _shift_right(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical (unsigned) right shift of int64 values; torch's ``>>`` is arithmetic."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finalizer on int64 tensors, bit for bit the uint64 one (`dlrm.data.preprocess`):
    int64 multiplication wraps like uint64, and the shifts are made logical."""
    x = x + _as_int64(0x9E3779B97F4A7C15)
    x = (x ^ _shift_right(x, 30)) * _as_int64(0xBF58476D1CE4E5B9)
    x = (x ^ _shift_right(x, 27)) * _as_int64(0x94D049BB133111EB)
    return x ^ _shift_right(x, 31)


def device_permutation(n: int, seed: int, epoch: int, device: torch.device | str) -> torch.Tensor:
    """A permutation of ``range(n)`` that depends only on (seed, epoch), made on `device`.

    Rows are sorted by a counter-based hash of (seed, epoch, row): integer ops and a stable sort,
    so every device type gives the same order, and on a GPU the whole epoch's permutation is one
    sort in device memory instead of a host ``randperm`` and a copy (what the shuffled "gpu"
    placement spent most of its time on in the H100 loader benchmark). On the CPU, where this
    loader only serves tests, the sort is the slower way: 5.95 s against 1.48 s for ``randperm``
    of 45M rows on a 2-core VM.
    """
    key = splitmix64(torch.tensor([_as_int64(seed & (2**64 - 1))], dtype=torch.int64))
    # the key as a Python number (a host tensor's: no device sync), an argument of the XOR kernel below: moved to the
    # device with .to(device), it was a copy from pageable host memory, which waited for the queued steps (the previous
    # epoch's) at every epoch's first batch
    key = int(splitmix64(key ^ epoch)[0])
    rows = torch.arange(n, dtype=torch.int64, device=device)
    return torch.sort(splitmix64(rows ^ key), stable=True).indices


class DeviceLoader:
    """Iterates batches of one split held entirely in `device` memory (same interface as `ParquetLoader`).

    Args:
        files: parquet shards of the split.
        batch_size: B.
        device: where the split lives (a CUDA device in practice; CPU works, for tests).
        shuffle: a fresh permutation per epoch, seeded by ``(seed, epoch)``; otherwise file order.
        seed: base seed of the shuffle.
        drop_last: drop the last partial batch of an epoch.
        rank, world_size: deliver only this rank's slice of every global batch
            (`dlrm.data.loader.rank_slice`); each rank still holds the whole split.
        pad_ranks: keep a last batch with fewer rows than ranks, a rank without a row getting a padding row
            (`dlrm.data.batch.rank_rows`, `Batch.pad`): for evaluations, which must see every row. Without it, the
            ranks such a batch is left out for are `epoch_ranks` (set after; `TrainData` may raise it).
        multi_hot_sizes: the dataset's `Metadata.multi_hot_sizes` (None: one-hot); batches then
            carry sparse [B, L] as `dlrm.data.loader.ParquetLoader` documents.
        dense_format: the dataset's `Metadata.dense_format` ("counts" or "float", as `ParquetLoader`'s).

    Example (on the CPU here; `device="cuda"` in a real run): the sample's validation split
        >>> import pathlib, dlrm
        >>> from dlrm.data.loader import split_files
        >>> from dlrm.data.schema import read_metadata
        >>> sample = pathlib.Path(dlrm.__file__).parents[1] / "data" / "sample"
        >>> files = split_files(sample, read_metadata(sample), "validation")   # 20,000 rows
        >>> loader = DeviceLoader(files, batch_size=4096, device="cpu", shuffle=True)
        >>> [len(batch) for batch in loader]   # Batch(dense [B, 13], sparse [B, 26], labels [B])
        [4096, 4096, 4096, 4096, 3616]
    """

    def __init__(self, files: list[Path], batch_size: int, device: torch.device | str, *, shuffle: bool = False,
                 seed: int = 0, drop_last: bool = False, rank: int = 0, world_size: int = 1, pad_ranks: bool = False,
                 multi_hot_sizes: list[int] | None = None, dense_format: str = "counts") -> None:
        self.files = [Path(f) for f in files]
        self.multi_hot_sizes = list(multi_hot_sizes) if multi_hot_sizes is not None else one_hot_sizes()
        if len(self.multi_hot_sizes) != NUM_SPARSE or min(self.multi_hot_sizes) < 1:
            raise ValueError(f"multi_hot_sizes must be {NUM_SPARSE} integers >= 1, got {multi_hot_sizes}")
        self._multi_hot = is_multi_hot(self.multi_hot_sizes)
        self._width = sparse_width(self.multi_hot_sizes)
        self.dense_format = check_dense_format(dense_format)
        check_rank_batch(batch_size, world_size, pad_ranks)
        self.rank, self.world_size, self.pad_ranks, self.epoch_ranks = rank, world_size, pad_ranks, world_size
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.start_batch = 0
        self.dense, self.sparse, self.labels = self._load()
        self.num_rows = int(self.labels.shape[0])

    def _load(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # Each file's schema and label statistics are checked once, on opening (`open_footer`);
        # each row group's values as it is decoded (`check_table`: labels 0/1, nulls replaced).
        # (footer, sparse layout) a file
        shards = [open_shard(path, self.multi_hot_sizes, self.dense_format) for path in self.files]
        footers, layouts = [footer for footer, _ in shards], [layout for _, layout in shards]
        groups = [(i, g, meta.row_group(g).num_rows) for i, meta in enumerate(footers) for g in range(meta.num_row_groups)]
        starts = first_rows(groups)
        nulls = NullTally(self.files, [meta.num_row_groups for meta in footers])
        n = sum(rows for _, _, rows in groups)
        # The int32 encoding is exact unless the value 0xFFFFFFFF (multi-hot: 0xFFFFFFFE too) or one outside
        # [-1, 2^32) ([-2, 2^32)) occurs (`compact_range`); checked per row group below.
        (floor, limit), width = compact_range(self._multi_hot), self._width
        dense = torch.empty((n, NUM_DENSE), dtype=torch.float32, device=self.device)
        sparse = torch.empty((n, width), dtype=torch.int32, device=self.device)
        labels = torch.empty((n,), dtype=torch.float32, device=self.device)
        wide = None  # int64 copy, made only if 0xFFFFFFFF turns up
        at = 0
        readers: dict[int, pq.ParquetFile] = {}
        # rank 0's bar only: under torchrun every rank loads the split, and their bars fought over one terminal line
        for k, (fi, g, rows) in enumerate(ProgressBar(groups, desc="loading to device", unit="group",
                                                      disable=None if self.rank == 0 else True)):
            path = self.files[fi]
            table = self._read_group(readers, fi, footers[fi], g, rows, layouts[fi])
            table, replaced = check_table(path, g, starts[k], table, self.multi_hot_sizes, layouts[fi],
                                          self.dense_format)
            nulls.add(fi, g, replaced)
            block = _HostBlock.from_table(table, self.multi_hot_sizes, layouts[fi])
            sl = slice(at, at + rows)
            dense[sl] = transform_dense(torch.from_numpy(block.dense).to(self.device), self.dense_format)
            labels[sl] = torch.from_numpy(block.label.astype(np.float32)).to(self.device)
            raw = block.sparse
            if wide is None and ((raw >= limit) | (raw < floor)).any():
                run_logger.warning(f"{path}: holds a sparse value outside [{floor}, {limit:#X}), the compact int32 "
                               f"form's range, so the split is kept as int64 ({8 * width} B/row)")
                wide = self._widen_loaded(sparse, at)
                del sparse
            if wide is not None:
                wide[sl] = torch.from_numpy(raw).to(self.device)
            else:
                sparse[sl] = torch.from_numpy(raw.astype(np.uint32).view(np.int32)).to(self.device)
            at += rows
        for done in readers.values():
            done.close()
        return dense, (wide if wide is not None else sparse), labels

    def _widen_loaded(self, sparse: torch.Tensor, at: int) -> torch.Tensor:
        """The int64 sparse block of the whole split, its first `at` rows widened from `sparse`, a slice at a time:
        widening them at once and concatenating the rest made two more int64 copies of those rows (20 B a slot
        at the peak instead of 12: out of memory on a split that fits in int64)."""
        wide = torch.empty((sparse.shape[0], self._width), dtype=torch.int64, device=self.device)
        for lo in range(0, at, _WIDEN_ROWS):
            hi = min(lo + _WIDEN_ROWS, at)
            wide[lo:hi] = _widen(sparse[lo:hi], self._multi_hot)
        return wide

    def _read_group(self, readers: dict[int, pq.ParquetFile], fi: int, footer: pq.FileMetaData, g: int,
                    rows: int, layout: SparseLayout) -> pa.Table:
        """Row group `g` of file `fi` (its reader opened once, kept in `readers` while its groups are read), checked
        to hold the rows its footer promised; unreadable -> `DatasetError` naming file and row group."""
        path = self.files[fi]
        try:
            if fi not in readers:
                # the groups come in file order: the previous file is done. Closed now, not all at the end: a
                # split of more shards than the open-file limit failed ("Too many open files") on a sound shard
                for done in readers.values():
                    done.close()
                readers.clear()
                readers[fi] = pq.ParquetFile(path, metadata=footer)
            table = readers[fi].read_row_group(g, columns=arrow_schema(self.multi_hot_sizes, layout).names)
        except (OSError, pa.ArrowException) as e:
            raise DatasetError(f"{path}: row group {g}: cannot be read ({e})") from None
        if table.num_rows != rows:
            raise DatasetError(f"{path}: row group {g}: has {table.num_rows} rows, its footer said {rows}")
        return table

    def rebatch(self, batch_size: int) -> None:
        """Cut batches of `batch_size` rows from now on, the split staying where it is (`TrainData.build` shrinks
        the batch of a split smaller than one: making a second loader held the whole split in memory twice)."""
        check_rank_batch(batch_size, self.world_size, self.pad_ranks)
        self.batch_size = batch_size

    def __len__(self) -> int:
        """Batches per epoch."""
        return batches_per_epoch(self.num_rows, self.batch_size, self.drop_last, self.epoch_ranks, self.pad_ranks)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """The next iteration yields `epoch`'s batches from index `start_batch` on (for resume)."""
        self.epoch = epoch
        self.start_batch = start_batch

    def _order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_rows, device=self.device)
        return device_permutation(self.num_rows, self.seed, self.epoch, self.device)

    def __iter__(self) -> Iterator[Batch]:
        # unshuffled: contiguous row ranges, cut as views (no gather launches per batch)
        order = self._order() if self.shuffle else None
        split = ResidentSplit(self.dense, self.sparse, self.labels, self._multi_hot)
        for i in range(self.start_batch, len(self)):
            lo, hi = i * self.batch_size, min((i + 1) * self.batch_size, self.num_rows)
            a, b, pad = rank_rows(lo, hi, self.rank, self.world_size, self.pad_ranks)
            global_size = hi - lo if self.world_size > 1 else None
            if order is None:
                yield Batch(self.dense[a:b], _widen(self.sparse[a:b], self._multi_hot), self.labels[a:b], global_size, pad)
            else:
                # rows of the split, gathered when read: a CUDA-graphed step gathers them inside its graph
                yield GatheredBatch(split, order[a:b], global_size, pad)
