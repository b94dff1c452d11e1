"""DistributedDataParallel over the dense parts of a DLRM (the sharded tables stay outside it)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dlrm.model.dlrm import DLRM, dense_forward


class DenseParts(nn.Module):
    """DenseArch, InteractionArch and OverArch of a DLRM (the same modules, not copies).

    ``forward(dense [B, 13], embeddings [B, F, D]) -> logits [B]``.
    """

    def __init__(self, model: DLRM) -> None:
        super().__init__()
        self.dense_arch = model.dense_arch
        self.interaction_arch = model.interaction_arch
        self.over_arch = model.over_arch

    def forward(self, dense: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        return dense_forward(self, dense, embeddings)


def wrap_dense_parts(model: DLRM, device: torch.device) -> DistributedDataParallel:
    """Replicate the dense parts with DDP and route `model.forward_from_embeddings` through it.

    The DDP module is kept in the model's ``__dict__``, not registered as a submodule, so the
    model's state_dict keys stay those of a one-process DLRM. DDP broadcasts rank 0's dense
    parameters at construction; every rank also built them from the same seed.
    """
    ddp = DistributedDataParallel(DenseParts(model), device_ids=[device.index] if device.type == "cuda" else None)
    model.__dict__["data_parallel"] = ddp
    return ddp
