"""Column sums of per-program partial sums, added in a fixed order: the second half of every fused bias gradient.

The kernels that compute a bias gradient inside another pass (`kernels.epilogue`, `kernels.mlp`, `kernels.cross`,
`kernels.mlp_tail`) have each program write one fp32 row of partial column sums over its rows of the batch, into a
contiguous [R, N] buffer (R programs, N columns). `sum_partial_rows` adds those rows in row order, one program per
``block_n`` columns: no atomics, so the bias gradient is the same bit for bit on every run.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from kernels._backend import interpret_mode, needs_int64_offsets

__all__ = ["sum_partial_rows"]


# rows of partial sums a loop step (the interpreter: fewer, smaller steps) and the launch's warps
BLOCK_R = 16 if interpret_mode() else 64
NUM_WARPS = 4


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

    Launched under the caller's device context.

    Returns ``out``, shape [N].

    Example (on the CPU under Triton's interpreter, TRITON_INTERPRET=1):
        >>> import torch
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> partial = torch.arange(15.0, device=device).reshape(3, 5)
        >>> sum_partial_rows(partial, torch.empty(5, device=device), 16).tolist()
        [15.0, 18.0, 21.0, 24.0, 27.0]
    """
    R, N = partial.shape
    _col_sum_kernel[(triton.cdiv(N, block_n),)](partial, out, R, N, BLOCK_R=BLOCK_R, BLOCK_N=block_n,
                                                INT64_OFFSETS=needs_int64_offsets(partial),
                                                num_warps=NUM_WARPS)  # fmt: skip
    return out
