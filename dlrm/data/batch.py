"""The batch the loaders deliver, and what both loaders share about batches.

`Batch` (and `GatheredBatch`, a shuffled batch of a device-resident split whose gather can wait),
how many batches an epoch has (`batches_per_epoch`, `keeps_last_batch`), which rows of a global
batch a rank gets (`rank_slice`, `rank_rows`), and the transforms applied on the device once per
buffer: the dense counts' ``log1p(max(x, 0))`` (`transform_dense`) and the widening of sparse
values that crossed the bus in their compact int32 form (`widen_sparse`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from dlrm.data.schema import MISSING_SPARSE, PAD_SPARSE
from dlrm.errors import ConfigError


@dataclass
class Batch:
    """One batch on the target device.

    dense: float32 [B, 13], the model's input (`transform_dense`: log1p(max(x, 0)) of counts);
    sparse: int64 [B, L] raw hash values, L = ``sum(multi_hot_sizes)`` (26 when one-hot): feature f in columns
    ``slot_offsets[f] : slot_offsets[f + 1]`` (`dlrm.data.schema.slot_offsets`), -1 a missing
    category, -2 (`PAD_SPARSE`) an empty slot of a multi-hot feature; labels: float32 [B]. In a distributed run B is this rank's slice and `global_size` the rows
    of the whole global batch (see `rank_slice`). `pad`: the last rows of this slice that are not the split's (an
    evaluation's last batch with fewer rows than ranks gives a rank without a row a copy of the batch's last row,
    `rank_rows`): they go through the model like the others and are left out of the metrics (`real`).
    """

    dense: torch.Tensor
    sparse: torch.Tensor
    labels: torch.Tensor
    global_size: Optional[int] = None
    pad: int = 0

    def __len__(self) -> int:
        return self.labels.shape[0]

    def real(self, t: torch.Tensor) -> torch.Tensor:
        """`t`'s rows of the split (a per-row result of this batch, e.g. its logits or labels) without the padding
        rows (`pad`)."""
        return t[: len(self) - self.pad] if self.pad else t

    @property
    def global_len(self) -> int:
        """Rows of the global batch this batch is a slice of (its own length when not sharded)."""
        return len(self) if self.global_size is None else self.global_size


@dataclass(frozen=True, eq=False)
class ResidentSplit:
    """A split's tensors in device memory as `dlrm.data.device_loader.DeviceLoader` holds them: dense float32
    [N, 13] (transformed), sparse [N, L] (int32 bit patterns, `widen_sparse`, or int64), labels float32 [N].

    Args:
        dense, sparse, labels: the split's rows.
        padded: multi-hot data (-2 = `PAD_SPARSE` is kept by `widen_sparse`).

    Example:
        >>> split = ResidentSplit(torch.zeros(5, 13), torch.tensor([[7], [-1], [3], [4], [5]], dtype=torch.int32),
        ...                       torch.arange(5.0), padded=False)
        >>> dense, sparse, labels = split.take(torch.tensor([2, 1]))
        >>> dense.shape, sparse.tolist(), labels.tolist()   # [B, 13], int64 [B, L], [B]
        (torch.Size([2, 13]), [[3], [-1]], [2.0, 1.0])
    """

    dense: torch.Tensor
    sparse: torch.Tensor
    labels: torch.Tensor
    padded: bool

    def take(self, rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dense, sparse int64, labels)`` of `rows` (int64 [B] on the split's device): three gathers and the
        widening, new tensors. ``index_select``, not ``t[rows]``: that is advanced indexing (aten.index), the heavier
        path (on a 2-core CPU a batch's 3 gathers of 256 random rows took 164-192 us that way, 49-71 us this way)."""
        dense, sparse, labels = (t.index_select(0, rows) for t in (self.dense, self.sparse, self.labels))
        return dense, widen_sparse(sparse, self.padded), labels

    def holds_same_tensors(self, other: "ResidentSplit") -> bool:
        """Whether `other` reads the very tensors this one does (a graph captured on one reads their memory)."""
        return (self.dense is other.dense and self.sparse is other.sparse and self.labels is other.labels
                and self.padded == other.padded)


class GatheredBatch(Batch):
    """A `Batch` of `rows` of a device-resident split, gathered when its tensors are first read.

    A shuffled batch of the "gpu" placement is three gathers and the widening of its sparse values: at batch 256 on
    an H200 ~40-90 us of host time a step (six launches), which a CUDA-graphed step waits for (the step is
    host-bound there). `dlrm.train.graphed_step.GraphedTrainStep` reads only `rows` and replays the gathers inside
    its graph (one copy of B indices a step); any other reader of ``dense``, ``sparse`` or ``labels`` gets them as
    `Batch` has them, gathered once (`ResidentSplit.take`).

    Args:
        source: the split's tensors.
        rows: int64 [B], the batch's rows of the split (on its device).
        global_size, pad: as `Batch`'s.

    Example:
        >>> split = ResidentSplit(torch.zeros(4, 13), torch.tensor([[0], [1], [2], [3]], dtype=torch.int32),
        ...                       torch.tensor([0.0, 1.0, 0.0, 1.0]), padded=False)
        >>> batch = GatheredBatch(split, torch.tensor([3, 0, 1]))
        >>> len(batch), batch.gathered   # the length without gathering
        (3, False)
        >>> batch.sparse.tolist(), batch.labels.tolist(), batch.gathered
        ([[3], [0], [1]], [1.0, 0.0, 1.0], True)
    """

    def __init__(self, source: ResidentSplit, rows: torch.Tensor, global_size: Optional[int] = None,
                 pad: int = 0) -> None:  # (not Batch's generated __init__: the tensors come later)
        self.source, self.rows, self.global_size, self.pad = source, rows, global_size, pad
        self._tensors: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None

    def __len__(self) -> int:
        return self.rows.shape[0]

    @property
    def gathered(self) -> bool:
        """Whether the tensors have been gathered (read)."""
        return self._tensors is not None

    def gather(self) -> "GatheredBatch":
        """Gather the tensors now (if not yet): a step names this its "data" range for --profile. Returns self."""
        self._take()
        return self

    def _take(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._tensors is None:
            self._tensors = self.source.take(self.rows)
        return self._tensors

    dense = property(lambda self: self._take()[0], doc="float32 [B, 13], gathered on first read.")
    sparse = property(lambda self: self._take()[1], doc="int64 [B, L], gathered and widened on first read.")
    labels = property(lambda self: self._take()[2], doc="float32 [B], gathered on first read.")

    def __repr__(self) -> str:
        return f"GatheredBatch(rows={len(self)}, global_size={self.global_size}, pad={self.pad})"


def keeps_last_batch(rows: int, drop_last: bool, world_size: int, pad_ranks: bool = False) -> bool:
    """Whether an epoch's last, partial batch of `rows` rows is delivered: not with `drop_last`,
    and not when it has fewer rows than ranks (every rank must get at least one row), unless `pad_ranks` (an
    evaluation: the ranks without a row get a padding row, `rank_rows`)."""
    return 0 < rows and not drop_last and (rows >= world_size or pad_ranks)


def batches_per_epoch(num_rows: int, batch_size: int, drop_last: bool, world_size: int = 1,
                      pad_ranks: bool = False) -> int:
    full, rest = divmod(num_rows, batch_size)
    return full + int(keeps_last_batch(rest, drop_last, world_size, pad_ranks))


def check_rank_batch(batch_size: int, world_size: int, pad_ranks: bool) -> None:
    """Refuse a global batch of fewer rows than ranks where no padding fills the gap: `rank_slice` would leave a rank
    without a row in every batch (not only the last), and an empty rank's mean loss is NaN (3 ranks at batch 2
    stopped at step 1 with "loss became NaN"). An evaluation (`pad_ranks`) pads such ranks instead (`rank_rows`)."""
    if world_size > 1 and batch_size < world_size and not pad_ranks:
        raise ConfigError(f"data.batch_size: {batch_size} is less than the {world_size} ranks: it is the global "
                          f"batch, and every rank needs at least one row of it (use at least {world_size})")


def rank_slice(lo: int, hi: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank `rank`'s rows of the global batch ``[lo, hi)``: consecutive blocks, the first
    ``(hi - lo) % world_size`` ranks ``ceil((hi - lo) / world_size)`` rows each, the others one fewer,
    so a batch of at least `world_size` rows (`keeps_last_batch`) leaves no rank empty (an empty
    rank's mean loss is NaN). The slices concatenated in rank order are the global batch, which is
    what makes an N-process run equal a one-process run."""
    per, extra = divmod(hi - lo, world_size)
    return lo + rank * per + min(rank, extra), lo + (rank + 1) * per + min(rank + 1, extra)


def rank_rows(lo: int, hi: int, rank: int, world_size: int, pad_ranks: bool) -> tuple[int, int, int]:
    """``(a, b, pad)``: rank `rank`'s rows ``[a, b)`` of the global batch ``[lo, hi)`` (`rank_slice`), of which the
    last `pad` are padding. With `pad_ranks` a rank `rank_slice` leaves empty (a batch of fewer rows than ranks)
    gets the batch's last row as one padding row, so every rank runs its forward (and the sharded lookup's
    collectives) on at least one row; the evaluation leaves the padding out (`Batch.real`).

        >>> [rank_rows(0, 2, r, 4, pad_ranks=True) for r in range(4)]
        [(0, 1, 0), (1, 2, 0), (1, 2, 1), (1, 2, 1)]
    """
    a, b = rank_slice(lo, hi, rank, world_size)
    if a == b and pad_ranks and hi > lo:
        return hi - 1, hi, 1
    return a, b, 0


def transform_dense(dense: torch.Tensor, dense_format: str = "counts") -> torch.Tensor:
    """The model's dense input from the stored values: Criteo's ``log1p(max(x, 0))`` of counts, in float32;
    float values (``dense_format`` "float") as they are, from float32 or from the int32 bit patterns the
    loaders carry them in (`dlrm.data.host_arena`)."""
    if dense_format == "float":
        return dense.view(torch.float32) if dense.dtype == torch.int32 else dense.to(torch.float32)
    return torch.log1p(dense.clamp_min(0).to(torch.float32))


_LOW32 = 0xFFFFFFFF


def compact_limit(padded: bool) -> int:
    """The smallest raw value the compact int32 form cannot carry: 0xFFFFFFFF (-1's bit pattern),
    and in multi-hot data already 0xFFFFFFFE (the bit pattern of -2, `PAD_SPARSE`)."""
    return _LOW32 - 1 if padded else _LOW32


def compact_range(padded: bool) -> tuple[int, int]:
    """The raw values ``[lo, hi)`` the compact int32 form carries exactly: from -1 (missing; multi-hot data: from
    -2, `PAD_SPARSE`) to `compact_limit`. A value outside would come back as another value from `widen_sparse`
    (e.g. -5 as 0xFFFFFFFB, 2^32 + 5 as 5) where the int64 form keeps it: another embedding row."""
    return (PAD_SPARSE if padded else MISSING_SPARSE), compact_limit(padded)


def widen_sparse(sparse: torch.Tensor, padded: bool = False) -> torch.Tensor:
    """Raw sparse values as int64 from their compact int32 bit patterns (a new tensor either way).

    Raw values lie in [-1, 2^32): stored in 32 bits, -1 (missing) and 0xFFFFFFFF share a bit
    pattern, so the compact form is only used where 0xFFFFFFFF does not occur; the pattern then
    means -1, and every other value is its low 32 bits read unsigned. `padded` (multi-hot data,
    which also holds -2 = `PAD_SPARSE`): the compact form is only used where 0xFFFFFFFE does not
    occur either (`compact_limit`), and that pattern means -2. One-hot data keep the version-1
    rule, so a one-hot 0xFFFFFFFE still travels compactly.
    """
    if sparse.dtype == torch.int64:
        return sparse.clone()
    # A value below the kept negatives (-1; padded: -2) is an unsigned one whose top bit is set: 2^32 more than its
    # int32 reading. Added where the mask says, in place: three kernels and two new tensors. ``torch.where(wide == -1,
    # wide, wide & 0xFFFFFFFF)`` took four and four, a cost of every batch the "gpu" placement cuts (host time that a
    # CUDA-graphed step at batch 256 waits for)
    kept = PAD_SPARSE if padded else MISSING_SPARSE
    return sparse.to(torch.int64).add_(sparse.lt(kept), alpha=_LOW32 + 1)

