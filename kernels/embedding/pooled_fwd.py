"""The pooled (multi-hot) lookup's forward kernel: hashing, the rows written for the backward, and sum pooling.

Launched by `kernels.embedding.pooled.pooled_lookup_impl` (layout, PAD slots and notation in that module's
docstring): one program per (block of ``BLOCK_B`` samples, feature).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.embedding.hashing import _hash_values


@triton.jit
def _pooled_slot(h, hot, s0, b, bmask, fv, d, dmask, raw_ptr, stride_rb, stride_rl, card_ptr, off_ptr, vocab_ptr,
                 voff_ptr, w_ptr, stride_wr, stride_wd, rows_ptr, L, R, PAD: tl.constexpr, USE_VOCAB: tl.constexpr,
                 SEARCH_STEPS: tl.constexpr, LOOKUP: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr):
    """Slot ``h`` of the feature (nothing where ``h >= hot``): writes its rows, returns its [BLOCK_B, BLOCK_D] rows
    (zeros for PAD slots, or without ``LOOKUP``)."""
    col = s0 + h
    smask = bmask & ((tl.zeros([BLOCK_B], dtype=tl.int64) + h) < hot)  # a block-shaped mask (the interpreter wants one)
    raw = tl.load(raw_ptr + b * stride_rb + col * stride_rl, mask=smask, other=PAD).to(tl.int64)
    live = smask & (raw != PAD)
    rows = _hash_values(raw, fv, live, card_ptr, off_ptr, vocab_ptr, voff_ptr, USE_VOCAB, SEARCH_STEPS)
    # PAD slots get row R: sorted after every real row, and skipped by the update kernels.
    rows = tl.where(live, rows, R)
    tl.store(rows_ptr + b * L + col, rows, mask=smask)
    vals = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.float32)
    if LOOKUP:
        m2 = live[:, None] & dmask[None, :]
        vals = tl.load(w_ptr + rows[:, None] * stride_wr + d[None, :] * stride_wd, mask=m2, other=0.0).to(tl.float32)
    return vals


@triton.jit
def _pooled_fwd_kernel(
    raw_ptr,
    stride_rb,
    stride_rl,
    card_ptr,
    off_ptr,
    vocab_ptr,
    voff_ptr,
    hot_ptr,
    soff_ptr,
    w_ptr,
    stride_wr,
    stride_wd,
    out_ptr,
    stride_ob,
    rows_ptr,
    B,
    L,
    F,
    D,
    R,
    PAD: tl.constexpr,
    USE_VOCAB: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    LOOKUP: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UNROLL: tl.constexpr,
):
    """Feature ``f = program_id(1)`` of ``BLOCK_B`` samples: rows of its slots, and (``LOOKUP``) their sum.

    One program per (sample block, feature): hotness, table offset and cardinality are scalars, and the
    slot loop runs ``ceil(hotness[f] / UNROLL)`` steps (features of hotness 1 and 100 share one launch). Each step
    issues the gathers of ``UNROLL`` (1, 2 or 4) slots before adding them, in slot order: more rows in flight, the
    same fp32 sums as one slot a step.

    Sample ``b``'s ``F`` pooled rows go to ``out_ptr + b * stride_ob`` (``F * D`` for a [B, F, D] output; more
    when the output holds other slots too, see `kernels.embedding.pooled.pooled_lookup_impl`'s ``prefix``).
    """
    f = tl.program_id(1)
    b = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    bmask = b < B
    fv = tl.zeros([BLOCK_B], dtype=tl.int64) + f
    hot = tl.load(hot_ptr + f)
    s0 = tl.load(soff_ptr + f)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    acc = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.float32)
    for h in range(0, hot, UNROLL):
        v0 = _pooled_slot(h, hot, s0, b, bmask, fv, d, dmask, raw_ptr, stride_rb, stride_rl, card_ptr, off_ptr,
                          vocab_ptr, voff_ptr, w_ptr, stride_wr, stride_wd, rows_ptr, L, R, PAD, USE_VOCAB,
                          SEARCH_STEPS, LOOKUP, BLOCK_B, BLOCK_D)
        if UNROLL >= 2:
            v1 = _pooled_slot(h + 1, hot, s0, b, bmask, fv, d, dmask, raw_ptr, stride_rb, stride_rl, card_ptr,
                              off_ptr, vocab_ptr, voff_ptr, w_ptr, stride_wr, stride_wd, rows_ptr, L, R, PAD,
                              USE_VOCAB, SEARCH_STEPS, LOOKUP, BLOCK_B, BLOCK_D)
        if UNROLL >= 4:
            v2 = _pooled_slot(h + 2, hot, s0, b, bmask, fv, d, dmask, raw_ptr, stride_rb, stride_rl, card_ptr,
                              off_ptr, vocab_ptr, voff_ptr, w_ptr, stride_wr, stride_wd, rows_ptr, L, R, PAD,
                              USE_VOCAB, SEARCH_STEPS, LOOKUP, BLOCK_B, BLOCK_D)
            v3 = _pooled_slot(h + 3, hot, s0, b, bmask, fv, d, dmask, raw_ptr, stride_rb, stride_rl, card_ptr,
                              off_ptr, vocab_ptr, voff_ptr, w_ptr, stride_wr, stride_wd, rows_ptr, L, R, PAD,
                              USE_VOCAB, SEARCH_STEPS, LOOKUP, BLOCK_B, BLOCK_D)
        if LOOKUP:
            acc += v0
            if UNROLL >= 2:
                acc += v1
            if UNROLL >= 4:
                acc += v2
                acc += v3
    if LOOKUP:
        out_offs = b[:, None] * stride_ob + f * D + d[None, :]
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=bmask[:, None] & dmask[None, :])
