"""``TritonPooledEmbedding``: ``TritonSparseEmbedding`` for multi-hot features (sum pooling over each
feature's slots, see `kernels.embedding.pooled`), with the same fused sparse optimizer update."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from kernels.embedding.module import TritonSparseEmbedding
from kernels.embedding.pooled import (
    PooledLayout,
    fused_pooled_embedding,
    pooled_embedding_lookup,
    pooled_hash_rows,
    pooled_layout,
)

__all__ = ["TritonPooledEmbedding"]


class TritonPooledEmbedding(TritonSparseEmbedding):
    """All sparse features' tables as one ``[R, D]`` weight, multi-hot lookups sum-pooled by a Triton kernel.

    Args:
        cardinalities: rows per feature (``F`` ints; ``len(vocabs[f]) + 1`` in vocabulary mode).
        hotness: slots per feature (``F`` ints >= 1); ``L = sum(hotness)`` columns of the input.
        dim: embedding dim ``D``.
        vocabs: None (modulus hashing) or ``F`` sorted, unique 1-D int64 tensors (``vocab=`` alias).
        device, dtype: of the weight (fp32 or bf16; initialised in place on ``device``, so a bf16 table
            never exists in fp32).
        stochastic_rounding: bf16 tables: the fused update rounds new weights stochastically (default)
            or to nearest (False). The stochastic-rounding seed is the non-persistent buffer ``sr_seed`` [1] int64
            (starts at 0, advanced on the device by every update; ``sr_seed.fill_(n)`` picks a stream).

    ``forward(raw [B, L] int64) -> [B, F, D]``: feature f sums the rows of its slots
    ``raw[:, slot_offsets[f] : slot_offsets[f] + hotness[f]]``, skipping ``PAD_SPARSE`` (-2) slots.
    ``forward(raw, prefix [B, D]) -> [B, 1 + F, D]``: ``prefix`` as slot 0 (``torch.cat`` of the two), written
    by the lookup itself in training with the fused update (`takes_prefix`).
    Everything else as :class:`TritonSparseEmbedding` (this class extends it): the plain lookup has a
    dense gradient; after ``use_fused_update(SparseOptimizerConfig)`` the training backward applies the
    optimizer to every row hit, once, with the sum of its slots' gradients, and ``weight.grad`` stays
    None; the state_dict holds only ``weight``, initialised as the eager ``SparseArch``. With every
    hotness 1 it computes the same numbers as :class:`TritonSparseEmbedding`.

    >>> device = "cuda" if torch.cuda.is_available() else "cpu"
    >>> emb = TritonPooledEmbedding([5, 3], [2, 1], dim=4).to(device)
    >>> emb
    TritonPooledEmbedding(features=2, slots=3, hotness=[2, 1], rows=8, dim=4, hashing=modulus)
    >>> raw = torch.tensor([[0, 2, 1], [3, -2, -1]], device=device)  # sample 1: one slot of feature 0 empty
    >>> emb(raw).shape
    torch.Size([2, 2, 4])
    >>> emb.rows(raw).tolist()  # the empty slot gets row R = 8: no row
    [[1, 3, 7], [4, 8, 5]]

    Shapes: int64 [B, L] raw slot values -> [B, F, D]; with ``prefix`` [B, D] -> [B, 1 + F, D].
    """

    def __init__(
        self,
        cardinalities: Sequence[int],
        hotness: Sequence[int],
        dim: int,
        vocabs: Optional[Sequence[Tensor]] = None,
        *,
        vocab: Optional[Sequence[Tensor]] = None,
        device: Optional[torch.device | str] = None,
        dtype: Optional[torch.dtype] = None,
        stochastic_rounding: bool = True,
    ) -> None:
        hotness = [int(h) for h in hotness]
        if len(hotness) != len(cardinalities):  # checked before the (possibly huge) weight is allocated
            raise ValueError(f"hotness has {len(hotness)} features, cardinalities {len(cardinalities)}")
        layout = pooled_layout(hotness, device)
        super().__init__(cardinalities, dim, vocabs, vocab=vocab, device=device, dtype=dtype)
        self.hotness_list = hotness
        # Non-persistent buffers: they follow .to(), and the state_dict stays {"weight"}.
        self.register_buffer("hotness", layout.hotness, persistent=False)
        self.register_buffer("slot_offsets", layout.slot_offsets, persistent=False)
        self.register_buffer("slot_feature", layout.slot_feature, persistent=False)
        self.register_buffer("sr_seed", torch.zeros(1, dtype=torch.int64, device=device), persistent=False)
        self.stochastic_rounding = bool(stochastic_rounding)

    @property
    def layout(self) -> PooledLayout:
        """The slot layout tensors (see `kernels.embedding.pooled.PooledLayout`)."""
        return PooledLayout(self.hotness, self.slot_offsets, self.slot_feature)

    @property
    def num_slots(self) -> int:
        """``L``: columns of the input."""
        return len(self.slot_feature)

    def rows(self, raw: Tensor) -> Tensor:
        """int64 [B, L] raw values -> int64 [B, L] rows of `weight` (PAD slots: ``R``, no row)."""
        return pooled_hash_rows(raw, self.cardinalities, self.offsets, self.layout, self.weight.shape[0], self.vocab,
                                self.vocab_offsets)

    takes_prefix = True  # forward(raw, prefix): see the class docstring

    def forward(self, raw: Tensor, prefix: Optional[Tensor] = None) -> Tensor:
        cfg = self.fused_update
        fused = cfg is not None and self.training and torch.is_grad_enabled()
        if prefix is not None and not (fused and prefix.dtype == self.weight.dtype):
            return torch.cat([prefix.unsqueeze(1), self.forward(raw).to(prefix.dtype)], dim=1)
        if fused:
            return fused_pooled_embedding(
                raw,
                self.weight,
                self.cardinalities,
                self.offsets,
                self.layout,
                self.vocab,
                self.vocab_offsets,
                cfg.state,
                cfg.lr,
                cfg.kind,
                cfg.eps,
                cfg.deterministic,
                self._grad_trigger,
                cfg.weight_decay,
                self.sr_seed,
                self.stochastic_rounding,
                prefix,
            )
        return pooled_embedding_lookup(raw, self.weight, self.cardinalities, self.offsets, self.layout, self.vocab,
                                       self.vocab_offsets)

    def extra_repr(self) -> str:
        return (f"features={self.num_features}, slots={self.num_slots}, hotness={self.hotness_list}, "
                f"rows={self.weight.shape[0]}, dim={self.dim}, hashing={self.hashing}")
