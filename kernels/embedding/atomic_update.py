"""Plain SGD on fp32 embedding rows with atomic adds: the non-deterministic fast path of the fused sparse
update (`kernels.embedding.update`, ``deterministic=False``).

``w[row(pos)] -= lr * grad[pos]`` for every position, no sort: repeated rows add in a run-dependent
order (fp32 rounding differs between runs).

Programs are column-major: program (i, c) takes column c (a feature, or a multi-hot slot) of BLOCK_B
samples. When that block's rows fit in ``SPAN`` consecutive rows, which is always so for a table of at most
SPAN rows (Criteo has tables of 3, 4, 10, ... rows that every sample hits), the block's gradients are summed
per row first (a 0/1 matrix product against the row offsets, no sort) and each row hit gets one vector add;
otherwise every position adds its own gradient. fp32 gradients are summed as three exact bf16 parts
(`kernels.embedding.select_sum`). Measured on an H100 (benchmarks/PERF.md, ninth and tenth runs), batch 65536,
uniform ids, against the position-major kernel this replaced (consecutive positions a program, one add each):
Kaggle's tables at D=16 0.240 -> 0.106-0.117 ms with bf16 gradients (what bf16 autocast hands back) and
0.161 -> 0.125-0.126 ms with fp32 ones (0.253 before the ninth run); Terabyte's (10M-row cap) at D=128 0.890 ->
0.551-0.575 ms with bf16 gradients and 0.986 -> 0.726 ms with fp32 ones. The adds to a tiny table's few rows had
serialised on their addresses: 65536 adds a step to each of a 3-row table's rows, now 512. With 3-pass TF32
products (``tf32x3``) instead of the bf16 parts, fp32 gradients at D >= 64 had been 6-17% slower than the
position-major kernel; the same column-major layout without the sums was slower too (0.30 against 0.24 ms at
D=16), as was an earlier version that summed repeated rows in every block (PERF.md, fourth run).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import heuristics
from kernels._backend import device_context, interpret_mode
from kernels.embedding.hashing import _hash_values, check_hash_inputs
from kernels.embedding.select_sum import select_sum


@triton.jit
def _sgd_atomic_kernel(
    rows_ptr,
    stride_rb,
    stride_rc,
    card_ptr,
    off_ptr,
    slot_ptr,
    grad_ptr,
    stride_gb,
    stride_gf,
    stride_gd,
    w_ptr,
    stride_wr,
    stride_wd,
    lr_ptr,
    B,
    C,
    D,
    R,
    c0,
    SLOT_MAP: tl.constexpr,
    HASH: tl.constexpr,
    SPAN: tl.constexpr,
    SPLIT_FP32: tl.constexpr,
    DOT_16BIT: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Non-deterministic SGD: w[row(b, c)] -= lr * grad[b, f(c)] with atomics (fp32 weights only).

    Program (i, j): samples ``i * BLOCK_B ...`` of column c = c0 + j of ``rows`` [B, C]; f(c) is c, or
    ``slot_feature[c]`` with ``SLOT_MAP``; rows ``>= R`` are skipped (multi-hot padding). ``HASH``: ``rows_ptr``
    holds the raw values [B, F] instead, hashed here in modulus mode (`kernels.embedding.hashing`)."""
    c = tl.program_id(1) + c0
    b = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    if HASH:
        inb = b < B
        raw = tl.load(rows_ptr + b * stride_rb + c * stride_rc, mask=inb, other=0).to(tl.int64)
        fc = tl.zeros([BLOCK_B], dtype=tl.int32) + c
        rows = tl.where(inb, _hash_values(raw, fc, inb, card_ptr, off_ptr, card_ptr, off_ptr, False, 1), R)
    else:
        rows = tl.load(rows_ptr + b * stride_rb + c * stride_rc, mask=b < B, other=R).to(tl.int64)  # int32 rows too
    valid = rows < R
    f = c
    if SLOT_MAP:
        f = tl.load(slot_ptr + c)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    g = tl.load(grad_ptr + b[:, None] * stride_gb + f * stride_gf + d[None, :] * stride_gd,
                mask=valid[:, None] & dmask[None, :], other=0.0)
    lr = tl.load(lr_ptr).to(tl.float32)
    lo = tl.min(tl.where(valid, rows, R), axis=0)
    hi = tl.max(tl.where(valid, rows, -1), axis=0)
    # Relaxed adds: they need no ordering among themselves (the kernel's end orders them before any reader);
    # Triton's default, acq_rel, orders every add at GPU scope (relaxed: 1.01 -> 0.93 ms at D=128 fp32,
    # results/kernels_graph_embedding_relaxed.md). Stride-1 rows give vector reductions (red.global.add.v4.f32).
    # Every row of the block in [lo, lo + SPAN): sum per row first. (No valid row, e.g. multi-hot padding: lo = R >
    # hi, and the per-position adds below are all masked off.)
    if (hi - lo < SPAN) & (hi >= lo):
        j = tl.arange(0, SPAN)
        onehot = ((rows - lo)[None, :] == j[:, None]) & valid[None, :]  # [SPAN, BLOCK_B]
        sums = select_sum(onehot, g, SPLIT_FP32, DOT_16BIT)  # fp32 gradients: three exact bf16 parts
        hit = tl.sum(onehot.to(tl.int32), axis=1) > 0
        tl.atomic_add(w_ptr + (lo + j)[:, None] * stride_wr + d[None, :] * stride_wd, -lr * sums,
                      mask=hit[:, None] & dmask[None, :], sem="relaxed")
    else:
        tl.atomic_add(w_ptr + rows[:, None] * stride_wr + d[None, :] * stride_wd, -lr * g.to(tl.float32),
                      mask=valid[:, None] & dmask[None, :], sem="relaxed")


# ----------------------------------------------------------------------------------------------------
# Host launcher
# ----------------------------------------------------------------------------------------------------

MAX_GRID_Y = 65535
"""CUDA's limit on a grid's second axis (gridDim.y): the most columns one launch of `_sgd_atomic_kernel` takes."""



def _sgd_atomic_update(rows: Tensor, grad_out: Tensor, weight: Tensor, lr: Tensor,
                       slot_feature: Optional[Tensor] = None, hashing: Optional[tuple[Tensor, Tensor]] = None) -> None:
    """Plain SGD with atomic adds (the non-deterministic fp32 path); ``rows`` [B, C] and ``slot_feature`` as in
    `kernels.embedding.update._segment_update`. ``hashing``: ``(cardinalities, offsets)``, and ``rows`` holds the
    raw values [B, F], hashed in the kernel (modulus mode)."""
    B, C = rows.shape
    R, D = weight.shape
    if hashing is None:
        rows = rows.contiguous()
    card, off = hashing if hashing is not None else (rows, rows)
    slots = rows if slot_feature is None else slot_feature.contiguous()  # read through its data pointer
    head = (rows, rows.stride(0), rows.stride(1), card, off, slots, grad_out, grad_out.stride(0), grad_out.stride(1),
            grad_out.stride(2), weight, weight.stride(0), weight.stride(1), lr)
    flags = dict(SLOT_MAP=slot_feature is not None, HASH=hashing is not None)
    # tl.dot needs 16 columns at least; the masks keep the padding out
    BLOCK_D = max(16, triton.next_power_of_2(D))
    block_b, warps = heuristics.atomic_update_launch(BLOCK_D, grad_out.dtype == torch.float32)
    # CUDA caps a grid's second axis at 65535 programs, and C (the multi-hot slots of a row, up to 65536 a feature)
    # can pass it: one launch a run of at most MAX_GRID_Y columns (the launch failed, "invalid argument")
    for c0 in range(0, C, MAX_GRID_Y):
        _sgd_atomic_kernel[(triton.cdiv(B, block_b), min(C - c0, MAX_GRID_Y))](
            *head,
            B,
            C,
            D,
            R,
            c0,
            **flags,
            SPAN=heuristics.ATOMIC_SUM_SPAN,
            SPLIT_FP32=grad_out.dtype == torch.float32,
            DOT_16BIT=not interpret_mode(),
            BLOCK_B=block_b,
            BLOCK_D=BLOCK_D,
            num_warps=warps,
        )


# ----------------------------------------------------------------------------------------------------
# The op of the fused lookup's backward when the forward kept no rows (kernels.embedding.lookup)
# ----------------------------------------------------------------------------------------------------


def hashes_in_update(weight: Tensor, vocab: Optional[Tensor], optimizer: str, deterministic: bool,
                     weight_decay: float) -> bool:
    """Whether the fused lookup's backward takes the atomic update on raw values (hashing them again) instead of
    the rows its forward would write: plain SGD, non-deterministic, fp32 weights, no decay (the atomic path of
    `kernels.embedding.update.sparse_update_impl`), modulus hashing, rows of at most 32 columns.

    Measured on an H100, Kaggle's tables, batch 65536 (benchmarks/PERF.md, tenth run): at D=16 not writing the
    [B, F] int64 rows made the lookup 7% faster (0.0698 -> 0.0651 ms, 75% -> 80% of copy bandwidth, as fast as a
    gather of rows given), and the update reads the raw values instead of the rows, as many bytes (0.1260 ->
    0.1254 ms). At D=128 the rows are 1.6% of the lookup's bytes (0.4694 -> 0.4642 ms) while hashing in the
    update's [64, 128] tiles cost 0.18 ms (0.675 -> 0.859 ms): there the forward writes the rows."""
    return optimizer == "sgd" and not deterministic and weight.dtype == torch.float32 and weight_decay == 0.0 \
        and vocab is None and weight.shape[1] <= 32


@torch.library.custom_op("dlrm_kernels::embedding_sgd_atomic_hashed_", mutates_args=("weight",))
def _sgd_atomic_hashed_op(raw: Tensor, cardinalities: Tensor, offsets: Tensor, grad_out: Tensor, weight: Tensor,
                          lr: Tensor) -> None:
    """``weight[hash(raw[b, f])] -= lr * grad_out[b, f]`` with atomic adds (fp32 weights, modulus hashing)."""
    check_hash_inputs(raw, cardinalities, offsets, None, None)
    if grad_out.dim() != 3 or tuple(grad_out.shape[:2]) != tuple(raw.shape):
        raise ValueError(f"raw [B, F] and grad_out [B, F, D] disagree: {tuple(raw.shape)}, {tuple(grad_out.shape)}")
    if weight.dim() != 2 or weight.dtype != torch.float32 or grad_out.shape[2] != weight.shape[1]:
        raise ValueError(f"weight must be float32 [R, D] with grad_out's D, got {weight.dtype} {tuple(weight.shape)}")
    if lr.numel() != 1 or lr.dtype != torch.float32 or lr.device != weight.device:
        raise ValueError("lr must be a one-element float32 tensor on weight's device")
    if raw.numel() == 0 or weight.shape[1] == 0:
        return
    hashing = (cardinalities.to(torch.int64).contiguous(), offsets.to(torch.int64).contiguous())
    with device_context(weight):
        _sgd_atomic_update(raw, grad_out, weight, lr, hashing=hashing)


@_sgd_atomic_hashed_op.register_fake
def _(raw, cardinalities, offsets, grad_out, weight, lr):
    return None
