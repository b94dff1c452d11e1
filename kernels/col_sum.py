"""Column sums of per-program partial sums, added in a fixed order: the second half of every fused bias gradient.

The kernels that compute a bias gradient inside another pass (`kernels.epilogue`, `kernels.mlp`, `kernels.cross`,
`kernels.mlp_tail`) have each program write one fp32 row of partial column sums over its rows of the batch, into a
contiguous [R, N] buffer (R programs, N columns). `sum_partial_rows` adds those rows in row order, one program per
``block_n`` columns: no atomics, so the bias gradient is the same bit for bit on every run.

Also here, shared by the dense kernels (`kernels.cross`, `kernels.linear`, `kernels.epilogue`, `kernels.mlp`,
`kernels.wgrad`, `kernels.loss` and this file): `needs_int64_offsets`, the launchers' rule for their
``INT64_OFFSETS`` flag. In a kernel ``rm = pid * BLOCK_M + tl.arange(0, BLOCK_M)`` is int32 and strides below 2^31
are specialized as int32, so ``rm[:, None] * stride`` wraps once an operand has an element offset of 2^31 or more
(MLPerf DLRM-DCNv2's cross net, N = 3456, at ~621k rows; a 1024-wide layer at ~2.1M rows): another row is read or
written, silently. With the flag the kernels cast their row (and column) indices to int64 before multiplying; without
it they compile to exactly the 32-bit code they always ran, which every shape below that size keeps.
"""

from __future__ import annotations

from typing import Optional

import triton
import triton.language as tl
from torch import Tensor

from kernels._backend import interpret_mode

__all__ = ["INT32_OFFSET_LIMIT", "max_element_offset", "needs_int64_offsets", "sum_partial_rows"]

# Element offsets from here on do not fit the int32 arithmetic of a kernel's indices and strides.
INT32_OFFSET_LIMIT = 2**31

# rows of partial sums a loop step (the interpreter: fewer, smaller steps) and the launch's warps
BLOCK_R = 16 if interpret_mode() else 64
NUM_WARPS = 4


def max_element_offset(t: Optional[Tensor]) -> int:
    """The largest element offset from ``t``'s data pointer, ``sum_d (size_d - 1) * stride_d`` (0 for an empty tensor
    or None): what a kernel's index arithmetic reaches on ``t``.

    >>> import torch
    >>> max_element_offset(torch.empty(3, 5)), max_element_offset(torch.empty(3, 5).t()), max_element_offset(None)
    (14, 14, 0)
    """
    if t is None or t.numel() == 0:
        return 0
    return sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def needs_int64_offsets(*tensors: Optional[Tensor]) -> bool:
    """Whether one of ``tensors`` (None skipped) has an element offset of 2^31 or more: then a kernel's 32-bit
    ``index * stride`` products would wrap, and its launcher sets ``INT64_OFFSETS``.

    >>> import torch
    >>> [needs_int64_offsets(torch.empty(m, 2**15, device="meta"), None) for m in (2**16, 2**16 + 1)]
    [False, True]
    """
    return any(max_element_offset(t) >= INT32_OFFSET_LIMIT for t in tensors)


@triton.jit
def _col_sum_kernel(partial_ptr, out_ptr, R, N, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                    INT64_OFFSETS: tl.constexpr = False):
    """out[n] = sum_r partial[r, n] of a contiguous fp32 [R, N] buffer, in a fixed order (deterministic).
    INT64_OFFSETS: 64-bit row offsets (R * N >= 2^31)."""
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for i in range(0, tl.cdiv(R, BLOCK_R)):
        rr = i * BLOCK_R + tl.arange(0, BLOCK_R)
        if INT64_OFFSETS:
            rr = rr.to(tl.int64)
        tile = tl.load(partial_ptr + rr[:, None] * N + rn[None, :], mask=(rr[:, None] < R) & (rn[None, :] < N), other=0.0)
        acc += tl.sum(tile, axis=0)
    tl.store(out_ptr + rn, acc.to(out_ptr.dtype.element_ty), mask=rn < N)


def sum_partial_rows(partial: Tensor, out: Tensor, block_n: int) -> Tensor:
    """``out[n] = sum_r partial[r, n]`` (fp32 sums, rounded once to ``out``'s dtype), rows added in order.

    Args:
        partial: contiguous fp32 [R, N], one row per program of the kernel that wrote it.
        out: [N] (contiguous; any float dtype), written in place.
        block_n: columns a program (a power of two, at least 16).

    Launched under the caller's device context. Example: ``sum_partial_rows(torch.ones(3, 5), torch.empty(5), 16)``
    fills ``out`` with 3.0 (on the CPU under Triton's interpreter, ``TRITON_INTERPRET=1``).

    Returns ``out``, shape [N].
    """
    R, N = partial.shape
    _col_sum_kernel[(triton.cdiv(N, block_n),)](partial, out, R, N, BLOCK_R=BLOCK_R, BLOCK_N=block_n,
                                                INT64_OFFSETS=needs_int64_offsets(partial),
                                                num_warps=NUM_WARPS)  # fmt: skip
    return out
