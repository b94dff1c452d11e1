"""What the training step, the optimizers and the CUDA-graph capture need to know of a sparse arch.

Four implementations exist: `dlrm.model.archs.SparseArch` (eager, sparse COO gradients),
`dlrm.model.fused_sparse.FusedUpdateSparseArch` (PyTorch ops, optimizer applied in its backward with
static shapes, so torch.compile takes it), `kernels.embedding.TritonSparseEmbedding` (hashing +
lookup kernel, optimizer fused into its backward) and
`dlrm.distributed.sharded_embedding.ShardedSparseArch` (tables sharded over ranks, lookups
exchanged with all_to_all). Each states these attributes as class or instance attributes;
nothing is found by probing.
"""

from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

import torch


@runtime_checkable
class SparseArchInterface(Protocol):
    """The embedding part of a DLRM: raw int64 sparse values [B, F] -> embeddings [B, F, D].

    Attributes:
        weight: the rows of every table, [R, D] (a shard of them in a sharded arch).
        compilable: the lookup and its backward can run inside ``torch.compile`` and a captured
            CUDA graph (no sparse COO gradient with data-dependent shapes, no collectives).
        collective: ``forward(raw, global_batch)`` exchanges rows with the other ranks: every rank
            must call it together, with the global batch size.
        fused_optimizer: the backward applies the sparse optimizer itself; the arch then has
            ``use_fused_update(config)`` and ``weight`` gets no gradient.

    Example:
        >>> from dlrm.model.archs import SparseArch
        >>> arch = SparseArch([10, 20], 4)
        >>> isinstance(arch, SparseArchInterface), arch.compilable, arch(torch.tensor([[1, 2]])).shape
        (True, False, torch.Size([1, 2, 4]))

    Shapes: raw int64 [B, F] -> [B, F, D].
    """

    # `weight` is required too but not a protocol member: a module keeps it in `_parameters`, where
    # Python 3.12's runtime protocol check (inspect.getattr_static) does not look, so every arch
    # would fail isinstance() there
    compilable: bool
    collective: bool
    fused_optimizer: bool

    def __call__(self, raw: torch.Tensor, global_batch: Optional[int] = None) -> torch.Tensor: ...
