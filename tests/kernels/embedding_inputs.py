"""The embedding kernel tests' inputs: output gradients in several layouts, tables and optimizer state, each from a
fixed seed (shared by the one-hot and the pooled tests and the tests built on them)."""

from __future__ import annotations

from typing import Optional

import torch

from kernels.embedding import init_sparse_optimizer_state


def make_grad(B: int, F: int, D: int, layout: str, device, dtype=torch.float32, seed: int = 1) -> torch.Tensor:
    """An output gradient [B, F, D], laid out "contiguous", "permuted" (non-contiguous) or "expand" (stride 0 over
    the batch).

    >>> make_grad(3, 2, 4, "permuted", "cpu").shape, make_grad(3, 2, 4, "expand", "cpu").stride()
    (torch.Size([3, 2, 4]), (0, 4, 1))
    """
    gen = torch.Generator().manual_seed(seed)
    if layout == "contiguous":
        g = torch.randn(B, F, D, generator=gen)
    elif layout == "permuted":  # non-contiguous: built [D, B, F]
        g = torch.randn(D, B, F, generator=gen).permute(1, 2, 0)
    elif layout == "expand":  # stride 0 over the batch
        g = torch.randn(1, F, D, generator=gen).expand(B, F, D)
    else:
        raise ValueError(layout)
    return g.to(device=device, dtype=dtype)


def make_weight(R: int, D: int, device, dtype=torch.float32, sliced: bool = False) -> torch.Tensor:
    """A table [R, D]; `sliced`: non-contiguous rows (a column slice of a wider table)."""
    gen = torch.Generator().manual_seed(2)
    if sliced:  # sliced on the device: `.to` of a slice with gaps would copy it contiguous there
        return torch.randn(R, D + 5, generator=gen).to(device=device, dtype=dtype)[:, 2 : 2 + D]
    return torch.randn(R, D, generator=gen).to(device=device, dtype=dtype)


def strided_table(R: int, D: int, layout: str, device, seed: int) -> torch.Tensor:
    """A [R, D] fp32 table whose column stride is not 1 (requires grad): "transposed" (built [D, R]) or
    "every_other_column" (every other column of a [R, 2D + 1] one)."""
    gen = torch.Generator().manual_seed(seed)
    if layout == "transposed":
        weight = torch.randn(D, R, generator=gen).to(device).t()
    else:
        weight = torch.randn(R, 2 * D + 1, generator=gen).to(device)[:, 1::2]
    assert weight.stride(1) != 1
    return weight.requires_grad_()


def make_state(optimizer: str, weight: torch.Tensor, zero: bool = False) -> Optional[torch.Tensor]:
    """`optimizer`'s state for `weight` (None for SGD), uniform in [0.5, 1.5) unless `zero` (as initialised)."""
    s = init_sparse_optimizer_state(optimizer, weight)
    if s is not None and not zero:
        s.uniform_(0.5, 1.5, generator=torch.Generator(device=s.device).manual_seed(3))
    return s
