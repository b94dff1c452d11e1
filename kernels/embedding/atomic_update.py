"""Plain SGD on fp32 embedding rows with one atomic add per lookup position: the non-deterministic fast
path of the fused sparse update (`kernels.embedding.update`, ``deterministic=False``).

``w[row(pos)] -= lr * grad[pos]`` for every position, no sort: repeated rows add in a run-dependent
order (fp32 rounding differs between runs). Measured on an H100 (benchmarks/PERF.md, 2026-11-24 fourth
run): relaxed vector reductions (``red.global.add.v4.f32``) reach 51% of copy bandwidth at D=128 and 25%
at D=16, where a 64-byte row's adds serialise on its address. Summing repeated rows inside a block first
(a 0/1 matrix product, one add per distinct row) was measured slower and reverted.
"""

from __future__ import annotations

from typing import Optional

import triton
import triton.language as tl
from torch import Tensor

from kernels import heuristics


@triton.jit
def _sgd_atomic_kernel(
    rows_ptr,
    slot_ptr,
    grad_ptr,
    stride_gb,
    stride_gf,
    stride_gd,
    w_ptr,
    stride_wr,
    stride_wd,
    lr_ptr,
    N,
    F,
    D,
    R,
    SLOT_MAP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Non-deterministic SGD: w[row(pos)] -= lr * grad[pos] with atomics (fp32 weights only).

    Positions, ``SLOT_MAP`` and rows ``>= R`` as in `kernels.embedding.update._sparse_chunk_kernel`."""
    pos = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = pos < N
    rows = tl.load(rows_ptr + pos, mask=mask, other=0)
    mask = mask & (rows < R)
    b = pos // F
    f = pos - b * F
    if SLOT_MAP:
        f = tl.load(slot_ptr + f, mask=mask, other=0)
    d = tl.arange(0, BLOCK_D)
    m2 = mask[:, None] & (d < D)[None, :]
    g = tl.load(
        grad_ptr + b[:, None] * stride_gb + f[:, None] * stride_gf + d[None, :] * stride_gd, mask=m2, other=0.0
    ).to(tl.float32)
    lr = tl.load(lr_ptr).to(tl.float32)
    # Relaxed: the adds need no ordering among themselves (the kernel's end orders them before any reader);
    # Triton's default, acq_rel, orders every add at GPU scope (relaxed: 1.01 -> 0.93 ms at D=128 fp32,
    # B=65536, results/kernels_graph_embedding_relaxed.md). With stride-1 rows Triton 3.6+ emits vector reductions
    # (red.global.add.v4.f32) on Hopper.
    tl.atomic_add(w_ptr + rows[:, None] * stride_wr + d[None, :] * stride_wd, -lr * g, mask=m2, sem="relaxed")


# ----------------------------------------------------------------------------------------------------
# Host launcher
# ----------------------------------------------------------------------------------------------------


def _sgd_atomic_update(rows: Tensor, grad_out: Tensor, weight: Tensor, lr: Tensor,
                       slot_feature: Optional[Tensor] = None) -> None:
    """Plain SGD with one atomic add per position (the non-deterministic fp32 path); ``rows`` [B, C] and
    ``slot_feature`` as in `kernels.embedding.update._segment_update`."""
    B, C = rows.shape
    N = B * C
    R, D = weight.shape
    BLOCK_D = triton.next_power_of_2(D)
    BLOCK_N = heuristics.rows_per_program(BLOCK_D)
    flat = rows.reshape(-1).contiguous()
    _sgd_atomic_kernel[(triton.cdiv(N, BLOCK_N),)](
        flat,
        flat if slot_feature is None else slot_feature,
        grad_out,
        grad_out.stride(0),
        grad_out.stride(1),
        grad_out.stride(2),
        weight,
        weight.stride(0),
        weight.stride(1),
        lr,
        N,
        C,
        D,
        R,
        SLOT_MAP=slot_feature is not None,
        BLOCK_N=BLOCK_N,
        BLOCK_D=BLOCK_D,
    )
