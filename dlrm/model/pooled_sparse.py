"""Multi-hot embeddings in plain PyTorch: `PooledSparseArch`, the eager reference of the pooled lookup.

Notation: ``B`` batch, ``F`` sparse features, ``D`` embedding dim, ``hotness[f]`` values per sample
of feature f, ``L = sum(hotness)`` slots per sample (dlrm/data/schema.py: feature f occupies
columns ``slot_offsets[f] : slot_offsets[f + 1]`` of the batch's ``sparse [B, L]``; a slot its
list leaves empty holds ``PAD_SPARSE`` (-2), a missing value -1).

Each feature's values are looked up in its table and summed (MLPerf DLRM-DCNv2's sum pooling),
with ``F.embedding_bag`` over the one concatenated weight: one bag per (sample, feature), at the
static offsets ``b * L + slot_offsets[f]``, PAD slots left out of the bags (moved to one extra
bag whose sum is dropped: a PAD slot adds nothing, even when the row it points at holds NaN or Inf),
so shapes never depend on the data. The sparse gradient leaves PAD slots out
(`dlrm.model.masked_lookup`), so a lazy weight decay decays only rows a sample used. The Triton twin is
`kernels.embedding.TritonPooledEmbedding` (same weight, init and hashing; PAD slots skipped).
"""

from __future__ import annotations

from typing import Optional

import torch

from dlrm.data.schema import PAD_SPARSE
from dlrm.model.archs import SparseArch
from dlrm.model.hashing import vocabulary_rows
from dlrm.model.masked_lookup import masked_embedding_bag

__all__ = ["PooledSparseArch"]


class PooledSparseArch(SparseArch):
    """All F tables as one weight; each feature's ``hotness[f]`` values sum-pooled into one embedding.

    Args:
        cardinalities: table size per feature (F ints).
        hotness: values per sample of each feature (F ints >= 1).
        dim: D.
        vocabs: for vocabulary hashing, each feature's sorted vocabulary (as `SparseArch`).

    Example:
        >>> arch = PooledSparseArch([10, 20], [3, 1], 4)
        >>> raw = torch.tensor([[5, 7, -2, 3]])   # feature 0: values 5 and 7 (one empty slot); feature 1: 3
        >>> out = arch(raw)
        >>> out.shape
        torch.Size([1, 2, 4])
        >>> rows = arch.rows(raw)[0]
        >>> torch.allclose(out[0, 0], arch.weight[rows[0]] + arch.weight[rows[1]])
        True

    Shapes: int64 [B, L] -> [B, F, D]. state_dict keys: ``weight`` only, as `SparseArch` (the
    gradient is sparse COO, the rows a batch looked up; PAD slots are left out of it, as the Triton
    kernel skips them, so a lazy weight decay does not decay the row a PAD slot points at).
    """

    def __init__(self, cardinalities: list[int], hotness: list[int], dim: int,
                 vocabs: Optional[list[torch.Tensor]] = None) -> None:
        if len(hotness) != len(cardinalities) or any(int(h) < 1 for h in hotness):
            raise ValueError(f"hotness: one int >= 1 per feature ({len(cardinalities)}), got {list(hotness)}")
        super().__init__(cardinalities, dim, vocabs)
        self.hotness = [int(h) for h in hotness]
        feature_of_slot = torch.repeat_interleave(torch.arange(len(hotness)), torch.tensor(self.hotness))
        starts = torch.tensor([0] + self.hotness[:-1]).cumsum(0)
        self.register_buffer("slot_feature", feature_of_slot, persistent=False)
        self.register_buffer("slot_starts", starts, persistent=False)
        self.register_buffer("slot_cardinalities", self.cardinalities[feature_of_slot], persistent=False)
        self.register_buffer("slot_row_offsets", self.offsets[feature_of_slot], persistent=False)

    @property
    def num_slots(self) -> int:
        return len(self.slot_feature)

    def rows(self, raw: torch.Tensor) -> torch.Tensor:
        """int64 [B, L] raw values -> int64 [B, L] rows of `weight` (PAD slots: any valid row, weighted 0)."""
        raw = torch.where(raw == PAD_SPARSE, torch.full_like(raw, -1), raw)
        if self.hashing == "modulus":
            return torch.remainder(raw + 1, self.slot_cardinalities) + self.slot_row_offsets
        return vocabulary_rows(raw, self.vocab_keys, self.vocab_offsets, self.slot_row_offsets, self.slot_feature)

    def forward(self, raw: torch.Tensor) -> torch.Tensor:
        B, L = raw.shape
        if L != self.num_slots:
            raise ValueError(f"sparse input has {L} columns, the multi-hot sizes give {self.num_slots}")
        bag_starts = (torch.arange(B, device=raw.device)[:, None] * L + self.slot_starts).reshape(-1)
        keep = (raw != PAD_SPARSE).reshape(-1)
        bag = (torch.arange(B, device=raw.device)[:, None] * self.num_features + self.slot_feature).reshape(-1)
        pooled = masked_embedding_bag(self.rows(raw).reshape(-1), self.weight, keep, bag_starts, bag)
        return pooled.view(B, self.num_features, self.dim)

    def extra_repr(self) -> str:
        return f"features={self.num_features}, slots={self.num_slots}, dim={self.dim}, hashing={self.hashing}"
