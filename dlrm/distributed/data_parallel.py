"""DistributedDataParallel over the dense parts of a DLRM (the sharded tables stay outside it)."""

from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dlrm.data.schema import NUM_DENSE
from dlrm.model.dlrm import DLRM, dense_forward

_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of `device` on which `dlrm.train.graphed_step.GraphedTrainStep` warms up and
    captures, made once: DDP is constructed on it too (`wrap_dense_parts`), so that the gradient
    accumulators it keeps belong to the capture's stream, as a captured DDP step needs."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    if index not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[index] = torch.cuda.Stream(index)
    return _CAPTURE_STREAMS[index]


class DenseParts(nn.Module):
    """DenseArch, InteractionArch and OverArch of a DLRM (the same modules, not copies): the part of the
    model DDP replicates under torchrun (`wrap_dense_parts`) while the sparse arch stays sharded.

    Args:
        model: the DLRM whose dense parts these are (its sparse arch is left out).

    Example:
        >>> from dlrm.config import ModelConfig
        >>> from dlrm.model.dlrm import build_model
        >>> model = build_model(ModelConfig(embedding_dim=8, bottom_mlp=[16, 8], top_mlp=[16, 1]), [10] * 26)
        >>> parts = DenseParts(model)
        >>> parts.over_arch is model.over_arch
        True
        >>> parts(torch.randn(4, 13), torch.randn(4, 26, 8)).shape
        torch.Size([4])

    Shapes: ``forward(dense [B, 13], embeddings [B, F, D]) -> logits [B]``.
    """

    def __init__(self, model: DLRM) -> None:
        super().__init__()
        self.dense_arch = model.dense_arch
        self.interaction_arch = model.interaction_arch
        self.over_arch = model.over_arch

    def forward(self, dense: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        return dense_forward(self, dense, embeddings)


def stateful_buffers(module: nn.Module) -> list[str]:
    """Names of `module`'s buffers that are not constants: a module lists its constant buffers (built alike on every
    rank, never changed) in a ``constant_buffers`` attribute (`dlrm.model.archs.InteractionArch`'s index pairs)."""
    return [f"{prefix}.{name}" if prefix else name
            for prefix, sub in module.named_modules()
            for name, _ in sub.named_buffers(recurse=False) if name not in getattr(sub, "constant_buffers", ())]


def prime_buckets(ddp: DistributedDataParallel, embeddings: tuple[int, int], device: torch.device) -> None:
    """One forward and backward of `ddp` on zeros (``[2, 13]`` dense inputs, ``[2, F, D]`` embeddings for
    `embeddings` = (F, D)), its gradients (all zeros, all-reduced) then dropped, so that DDP rebuilds its gradient
    buckets before the first training step: every step of every session then reduces the same bucket layout.

    DDP reduces its first iteration's gradients in one bucket of the parameters in their order, and rebuilds the
    buckets after it (in the order the gradients got ready, the first one at most 1 MiB). From three ranks on, the
    order in which an all-reduce adds an element's W values depends on where the element lies in its bucket (the
    ring's chunks), so the first step of a session summed the dense gradients in another order than the same step of
    the uninterrupted run: a resumed run of three ranks drifted from it by rounding (1e-8 in the dense weights and
    the tables after 12 steps), where two ranks (a + b = b + a) resumed bit for bit. Collective: every rank calls it.
    The RNG streams are left as they were (`fork_rng`: dropout's draws here are undone)."""
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    if not params:
        return
    features, dim = embeddings
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        out = ddp(torch.zeros(2, NUM_DENSE, device=device), torch.zeros(2, features, dim, device=device))
        (out.float().sum() * 0.0).backward()
    for p in params:
        p.grad = None


def wrap_dense_parts(model: DLRM, device: torch.device,
                     embeddings: Optional[tuple[int, int]] = None) -> DistributedDataParallel:
    """The dense parts of `model` replicated with DDP: call it instead of `model.forward_from_embeddings`.

    `embeddings`: (F, D) of the lookup's output: the buckets are rebuilt before training (`prime_buckets`; a
    collective), so that a resumed run of three or more ranks reduces its gradients as the uninterrupted run did.

    The model is not changed (its state_dict keys stay those of a one-process DLRM); the train
    step and evaluation receive this wrapper from `dlrm.train.builder`. DDP broadcasts rank 0's
    dense parameters at construction; every rank also built them from the same seed.

    On CUDA it is constructed on the stream a captured training step uses (`capture_stream`), as a
    DDP step captured in a CUDA graph needs.
    """
    parts = DenseParts(model)
    # The dense parts' only buffers are constants (the interaction's lower-triangle index pairs), computed alike on
    # every rank: DDP's default broadcast of rank 0's buffers before every forward would add a collective to each step
    # (and to its captured graph) that moves nothing new. A buffer training changes would need it: refused.
    stateful = stateful_buffers(parts)
    if stateful:
        raise ValueError(f"the dense parts hold buffers DDP would have to keep in sync: {stateful}")
    if device.type != "cuda":
        ddp = _ddp(parts)
        if embeddings is not None:
            prime_buckets(ddp, embeddings, device)
        return ddp
    side, main = capture_stream(device), torch.cuda.current_stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        ddp = _ddp(parts, device_ids=[device.index])
        if embeddings is not None:
            prime_buckets(ddp, embeddings, device)
    main.wait_stream(side)
    return ddp


def _ddp(parts: nn.Module, **kwargs) -> DistributedDataParallel:
    """DDP without the per-step buffer broadcast. torch 2.13 deprecates `broadcast_buffers` (a FutureWarning each rank
    printed in every run) for `forward_sync_buffers`, which torch 2.11 lacks and whose False still syncs at init; its
    own advice for buffers not synced at init is to keep `broadcast_buffers=False`: the warning is left out."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)
        return DistributedDataParallel(parts, broadcast_buffers=False, **kwargs)
