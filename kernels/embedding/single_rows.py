"""The rows a batch touches once, updated in the positions' original order: the third kernel of the
sorted-segment update (`kernels.embedding.update`, ``SINGLES = "apart"``).

Notation as in `kernels.embedding.update`: ``N = B * C`` positions of a ``[B, C]`` rows tensor (``C`` its
columns: features, or multi-hot slots with ``SLOT_MAP``), ``D`` embedding dim.

Why apart: a row that occurs once in the batch is a segment of one position, whose sum is its own gradient
row. The chunk kernel walks positions in sorted-row order, so it gathers each one's gradient row
``grad[b, f]`` from a random place of the ``[B, F, D]`` gradient, through a chain of dependent loads (sorted
row and position -> gradient row), and the gradient row of a bag is gathered once for every value of the bag
(100 times a sample for MLPerf DLRM-DCNv2's widest feature), mostly from DRAM. In original order the positions
of a bag are neighbours: its gradient row is read once from DRAM and then from L1/L2, and each position's
loads (its row, its weights and state, its gradient row) depend on nothing but the position. At MLPerf's
shapes with uniformly drawn rows, 66% of the 14M positions are such rows (9.2M of the 10.2M rows updated).

The chunk kernel marks them (``single[pos] = 1``, `kernels.embedding.segment_chunk`, ``SINGLES_APART``) and
skips them; this kernel then updates exactly those positions with the same row update
(`kernels.embedding.row_update`), so every row is still updated once, with its whole gradient. The result is
the sorted path's up to the order of the row-wise Adagrad's sum over D inside a tile (a last-bit difference in
the accumulator at most): it stays deterministic.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.embedding.row_update import _finish_row_update, _load_row_state


@triton.jit
def _single_rows_kernel(
    rows_ptr, single_ptr, slot_ptr, grad_ptr, stride_gb, stride_gf, stride_gd, w_ptr, stride_wr, stride_wd,
    state_ptr, lr_ptr, seed_ptr, eps, weight_decay, N, C: tl.constexpr, D: tl.constexpr, OPT: tl.constexpr,
    DECAY: tl.constexpr, ROUND: tl.constexpr, SLOT_MAP: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
    POS32: tl.constexpr,
):
    """Update the rows of positions ``pid * BLOCK_P ...`` that ``single`` marks (flat positions
    ``pos = b * C + c`` of the contiguous rows ``[B, C]``; the gradient row is ``grad[b, c]``, or
    ``grad[b, slot[c]]`` with ``SLOT_MAP``). ``C`` is a compile-time constant, so ``pos // C`` is a multiply
    and a shift (see `kernels.embedding.segment_chunk._sparse_chunk_kernel`)."""
    p = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    valid = p < N
    # The row and the mark load side by side (both coalesced): only the weights wait for them.
    sel = tl.load(single_ptr + p, mask=valid, other=0) != 0
    rows = tl.load(rows_ptr + p, mask=valid, other=0).to(tl.int64)
    if POS32:
        p32 = p.to(tl.int32)
        b32 = p32 // C
        c = p32 - b32 * C
        b = b32.to(tl.int64)
    else:
        b = p // C
        c = p - b * C
    if SLOT_MAP:
        f = tl.load(slot_ptr + c, mask=valid, other=0)
    else:
        f = c
    d = tl.arange(0, BLOCK_D)
    w, s = _load_row_state(rows, sel, d, D, w_ptr, stride_wr, stride_wd, state_ptr, OPT, "")
    g = tl.load(grad_ptr + b[:, None] * stride_gb + f[:, None] * stride_gf + d[None, :] * stride_gd,
                mask=sel[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)
    _finish_row_update(rows, g, w, s, sel, d, D, w_ptr, stride_wr, stride_wd, state_ptr, lr_ptr, eps, weight_decay,
                       seed_ptr, OPT, DECAY, ROUND, "")
