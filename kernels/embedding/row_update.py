"""One optimizer step on a block of unique embedding rows, inside a Triton kernel: the device functions
the sorted-segment update kernels (`kernels.embedding.update`) call once they hold each row's summed gradient.

``_apply_row_update`` is the whole step (load the rows' weights and state, apply SGD / Adagrad / row-wise
Adagrad with optional lazy weight decay, round bf16 weights, store). The chunk kernel calls its two halves,
``_load_row_state`` and ``_finish_row_update``, separately, so that it can choose when the loads are issued,
and can ask L2 for the rows first (``_prefetch_row_state_l2``). See ``ROW_LOADS`` in `kernels.embedding.update`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.embedding.rounding import _round_bf16


@triton.jit
def _load_row_state(rows, sel, d, D, w_ptr, stride_wr, stride_wd, state_ptr, OPT: tl.constexpr,
                    EVICT: tl.constexpr):
    """The fp32 weights ``w`` [M, BLOCK_D] of the selected rows and their optimizer state ``s`` ([M, BLOCK_D]
    for Adagrad, [M] for row-wise Adagrad, unused otherwise); see `_apply_row_update`.

    Separate so that the chunk kernel can issue these loads before it gathers and sums the gradients:
    they depend on the sorted rows only, and the kernel is bound by its chains of dependent loads.
    ``EVICT``: the L2 eviction policy of these loads ("" or "evict_first": see
    `kernels.embedding.update.EVICTION`)."""
    dmask = d < D
    m2 = sel[:, None] & dmask[None, :]
    if OPT == 3:  # the dense gradient needs neither
        w = tl.zeros((rows.shape[0], d.shape[0]), dtype=tl.float32)
        s = w
    else:
        w = tl.load(w_ptr + rows[:, None] * stride_wr + d[None, :] * stride_wd, mask=m2, other=0.0,
                    eviction_policy=EVICT).to(tl.float32)
        if OPT == 1:
            s = tl.load(state_ptr + rows[:, None] * D + d[None, :], mask=m2, other=0.0, eviction_policy=EVICT)
        elif OPT == 2:
            s = tl.load(state_ptr + rows, mask=sel, other=0.0, eviction_policy=EVICT)
        else:
            s = w
    return w, s


@triton.jit
def _prefetch_row_state_l2(rows, sel, w_ptr, stride_wr, state_ptr, OPT: tl.constexpr, BLOCK_D: tl.constexpr):
    """Ask L2 for the selected rows' weights (every 128-byte line of a row) and, for row-wise Adagrad, their
    accumulators: ``prefetch.global.L2``, which returns at once, so the later loads of `_load_row_state`
    find the lines in L2 without this thread waiting for them now (PTX only: not in the interpreter).

    Only for rows of >= 128 bytes: on D=16 one-hot rows (32-64 bytes) it made the update up to 30% slower
    (results/onehot_update_row_loads.md); on MLPerf's 256-byte rows it made it 4-5% faster."""
    ROW_BYTES: tl.constexpr = BLOCK_D * w_ptr.dtype.element_ty.primitive_bitwidth // 8
    if ROW_BYTES >= 128:
        LINES: tl.constexpr = ROW_BYTES // 128
        STEP: tl.constexpr = 128 * 8 // w_ptr.dtype.element_ty.primitive_bitwidth
        line = tl.arange(0, LINES)
        # unselected lanes prefetch the table's first line (one line for all of them: harmless)
        offs = tl.where(sel[:, None], rows[:, None] * stride_wr + line[None, :] * STEP, 0)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.b32 $0, 0;", "=r,l",
                                  [(w_ptr + offs).to(tl.int64, bitcast=True)], dtype=tl.int32, is_pure=False, pack=1)
        if OPT == 2:
            s_offs = tl.where(sel, rows, 0)
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.b32 $0, 0;", "=r,l",
                                      [(state_ptr + s_offs).to(tl.int64, bitcast=True)], dtype=tl.int32,
                                      is_pure=False, pack=1)


@triton.jit
def _finish_row_update(
    rows,
    g,
    w,
    s,
    sel,
    d,
    D,
    w_ptr,
    stride_wr,
    stride_wd,
    state_ptr,
    lr_ptr,
    eps,
    weight_decay,
    seed_ptr,
    OPT: tl.constexpr,
    DECAY: tl.constexpr,
    ROUND: tl.constexpr,
    EVICT: tl.constexpr,
):
    """`_apply_row_update` once `_load_row_state` has loaded ``w`` and ``s``; ``EVICT`` as there, for the stores."""
    dmask = d < D
    m2 = sel[:, None] & dmask[None, :]
    w_offs = rows[:, None] * stride_wr + d[None, :] * stride_wd
    if OPT == 3:
        # Plain backward: the dense gradient tensor (zeros elsewhere) has weight's layout.
        tl.store(w_ptr + w_offs, g.to(w_ptr.dtype.element_ty), mask=m2)
    else:
        lr = tl.load(lr_ptr).to(tl.float32)
        if DECAY:
            g = g + weight_decay * w
        if OPT == 0:
            w = w - lr * g
        elif OPT == 1:
            # torch.optim.Adagrad, sparse grad: state += g^2; w -= lr * g / (sqrt(state) + eps)
            s = s + g * g
            tl.store(state_ptr + rows[:, None] * D + d[None, :], s, mask=m2, eviction_policy=EVICT)
            w = w - lr * (g / (tl.sqrt(s) + eps))
        else:
            # Row-wise Adagrad: one accumulator per row, fed with the mean of g^2 over D.
            s = s + tl.sum(g * g, axis=1) / D
            tl.store(state_ptr + rows, s, mask=sel, eviction_policy=EVICT)
            # One division a row, then a multiply an element: an fp32 division per element (div.rn, ~8
            # instructions) was a sixth of the pooled update's instructions (Nsight Compute, 2026-11-24).
            # w - g * (lr / x) rounds differently from w - lr * (g / x) by an ulp or so.
            step = lr / (tl.sqrt(s) + eps)
            w = w - g * step[:, None]
        if ROUND != 0:
            w = _round_bf16(w, seed_ptr, rows[:, None], d[None, :], D, ROUND >= 2, RNG=ROUND - 2)
        tl.store(w_ptr + w_offs, w.to(w_ptr.dtype.element_ty), mask=m2, eviction_policy=EVICT)


@triton.jit
def _apply_row_update(
    rows,
    g,
    sel,
    d,
    D,
    w_ptr,
    stride_wr,
    stride_wd,
    state_ptr,
    lr_ptr,
    eps,
    weight_decay,
    seed_ptr,
    OPT: tl.constexpr,
    DECAY: tl.constexpr,
    ROUND: tl.constexpr,
):
    """Apply the update for the rows ``rows`` [M] whose summed fp32 gradients are ``g`` [M, BLOCK_D].

    ``sel`` [M] selects the lanes that own a unique row (each row is selected exactly once per step).
    With ``DECAY``, lazy L2: ``weight_decay * w[r]`` joins the summed gradient of each touched row first
    (once per unique row, as the eager optimizers' ``dlrm.train.optim.decay_touched_rows_`` adds it).
    ``ROUND`` of the new fp32 weights: 0 the cast to weight's dtype; for bf16 weights 1 round to nearest
    even, 2 + an RNG code round stochastically (`_round_bf16`, seed at ``seed_ptr``).
    """
    w, s = _load_row_state(rows, sel, d, D, w_ptr, stride_wr, stride_wd, state_ptr, OPT, "")
    _finish_row_update(rows, g, w, s, sel, d, D, w_ptr, stride_wr, stride_wd, state_ptr, lr_ptr, eps, weight_decay,
                       seed_ptr, OPT, DECAY, ROUND, "")
