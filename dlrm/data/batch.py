"""The batch the loaders deliver, and what both loaders share about batches.

`Batch`, how many batches an epoch has (`batches_per_epoch`, `keeps_last_batch`), which rows of
a global batch a rank gets (`rank_slice`, `rank_rows`), and the transforms applied on the device once per
buffer: the dense counts' ``log1p(max(x, 0))`` (`transform_dense`) and the widening of sparse
values that crossed the bus in their compact int32 form (`widen_sparse`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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

