"""The chunk kernel of the sorted-segment update (`kernels.embedding.update`): segment sums of the gradients
inside chunks of ``CHUNK`` sorted positions, and the optimizer step of every segment that lies in one chunk.

Notation as in `kernels.embedding.update`: ``N`` sorted positions, ``F`` columns of the rows tensor
(features, or multi-hot slots with ``SLOT_MAP``), ``D`` embedding dim, ``R`` table rows.

The kernel is a chain of dependent loads (sorted row and position -> gradient row -> segment sums -> the
updated rows' weights and state) with ~1,500 instructions a warp between them. At MLPerf DLRM-DCNv2's shapes
(Nsight Compute, H100, results/pooled_update_tuning.md) it issues an instruction on ~65% of cycles at 25%
occupancy, with DRAM at ~48% of peak: both the latency of the chain and the instruction count cost time.
Tried and slower there: persistent programs software-pipelined over three chunks (239 registers, 7.2 ms
against 5.6), each program asking L2 for the lines of a chunk 264-4224 chunks ahead (+1-10%), register caps
(spills; that kernel), skipping the segment product in chunks without repeated rows (more registers).
On an H200 (2026-11-29, results/pooled_update_chunk_latency_h200.md) it is the chain's latency and how many programs
wait on it at once: 10% fewer instructions (the partials below) bought 1.4%, one serial load fewer (the padding exit
decided on the chunk's own index loads) 3.2%, and 16 one-warp programs an SM instead of 13 (a 128-register cap,
`kernels.heuristics.SparseUpdateConfig.chunk_maxnreg`) 7%.

``first[k]`` / ``last[k]`` (a chunk's partial sums of its first and last row) are written only where the carry
kernel reads them: by a chunk that starts inside a segment, and by one whose last segment continues into the next
chunk. Every chunk did both until 2026-11-24: two masked sums over its whole tile and 0.45 GB of stores a step at
MLPerf shapes; skipping them made the bf16 update 7% faster. Since 2026-11-29 a store masked to the row's lane
writes them, without the masked sum's cross-lane reduction.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.embedding.row_update import _finish_row_update, _load_row_state, _prefetch_row_state_l2
from kernels.embedding.select_sum import select_sum


@triton.jit
def _chunk_indices(sorted_ptr, perm_ptr, k, N, CHUNK: tl.constexpr):
    """Chunk ``k``'s sorted rows, the row after each (-1 past the end) and the positions they came from."""
    i = k * CHUNK + tl.arange(0, CHUNK)
    valid = i < N
    rows = tl.load(sorted_ptr + i, mask=valid, other=-1)
    nxt = tl.load(sorted_ptr + i + 1, mask=(i + 1) < N, other=-1)
    pos = tl.load(perm_ptr + i, mask=valid, other=0)
    return rows, nxt, pos


@triton.jit
def _chunk_bounds(sorted_ptr, k, N, CHUNK: tl.constexpr):
    """Chunk ``k``'s first and last sorted row and the rows just before and after it (-1 past either end)."""
    cs = k * CHUNK
    last_i = tl.minimum(cs + CHUNK, N) - 1
    row0 = tl.load(sorted_ptr + cs)
    prev = tl.load(sorted_ptr + cs - 1, mask=cs > 0, other=-1)
    row_last = tl.load(sorted_ptr + last_i)
    following = tl.load(sorted_ptr + last_i + 1, mask=(last_i + 1) < N, other=-1)
    return row0, prev, row_last, following


@triton.jit
def _grad_coords(pos, valid, slot_ptr, F, SLOT_MAP: tl.constexpr, POS32: tl.constexpr):
    """``(b, f)`` of each position ``pos = b * F + c``: the gradient row is ``grad[b, f]`` with ``f = c``, or
    ``f = slot[c]`` with ``SLOT_MAP``. ``POS32``: every position and every element offset of the gradient fits
    int32 (the host checks), so the division is a 32-bit one (64-bit integer division is a long software
    sequence on GPUs) and ``b``, ``f`` stay int32: the gradient's addresses cost one instruction each, not two."""
    if POS32:
        p = pos.to(tl.int32)
        b = p // F
        f = p - b * F
    else:
        b = pos // F
        f = pos - b * F
    if SLOT_MAP:
        f = tl.load(slot_ptr + f, mask=valid, other=0)
        if POS32:
            f = f.to(tl.int32)
    return b, f


@triton.jit
def _chunk_update(k, rows, nxt, b, f, row0, prev, row_last, following, sorted_ptr, grad_ptr, stride_gb, stride_gf,
                  stride_gd, w_ptr, stride_wr, stride_wd, state_ptr, lr_ptr, seed_ptr, first_ptr, last_ptr, eps,
                  weight_decay, N, D, R, OPT: tl.constexpr, DECAY: tl.constexpr, ROUND: tl.constexpr,
                  CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT_FP32: tl.constexpr, DOT_16BIT: tl.constexpr,
                  ROW_LOADS: tl.constexpr, ROW_EVICT: tl.constexpr, GRAD_EVICT: tl.constexpr, PICK_STORE: tl.constexpr):
    """Chunk ``k`` once its indices and bounding rows are known (`_chunk_indices`, `_grad_coords`, `_chunk_bounds`):
    segment sums, the update of the segments that start and end in it, and the carry kernel's partial sums."""
    cs = k * CHUNK
    i = cs + tl.arange(0, CHUNK)
    valid = i < N
    live = valid & (rows < R)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D

    last_i = tl.minimum(cs + CHUNK, N) - 1
    # A segment is complete here when it ends in the chunk (next sorted row differs) and starts in it,
    # i.e. its row differs from row0, unless the chunk itself starts a segment (then compare against -2,
    # which no row equals). Written as one comparison: the interpreter mishandles scalar | vector masks.
    row0_cont = tl.where((cs == 0) | (prev != row0), -2, row0)
    complete = live & (nxt != rows) & (rows != row0_cont)
    same = rows[:, None] == rows[None, :]
    rows = rows.to(tl.int64)  # the comparisons above in the sorted keys' own width (int32 below 2**31 rows)
    # When to load the rows' weights and state (ROW_LOADS, see `kernels.embedding.update.ROW_LOAD_ORDERS`):
    # they need only the sorted rows, so they can be in flight together with the gradient gathers (sorted
    # row -> position -> gradient row) instead of waiting for the sums. Issued before the gathers, the
    # layout conversion of w for the sums' layout (a barrier in the PTX) waits for them before the gathers
    # start.
    if ROW_LOADS == 3:
        _prefetch_row_state_l2(rows, complete, w_ptr, stride_wr, state_ptr, OPT, BLOCK_D)
    if ROW_LOADS == 2:
        w, s = _load_row_state(rows, complete, d, D, w_ptr, stride_wr, stride_wd, state_ptr, OPT, ROW_EVICT)
    g = tl.load(
        grad_ptr + b[:, None] * stride_gb + f[:, None] * stride_gf + d[None, :] * stride_gd,
        mask=live[:, None] & dmask[None, :],
        other=0.0,
        eviction_policy=GRAD_EVICT,
    )
    if ROW_LOADS == 1:
        w, s = _load_row_state(rows, complete, d, D, w_ptr, stride_wr, stride_wd, state_ptr, OPT, ROW_EVICT)

    # Per-position sum over the positions of the chunk with the same row: a 0/1 matrix product with fp32
    # accumulation, in a fixed order (deterministic), fp32 gradients as three exact bf16 parts
    # (`kernels.embedding.select_sum`).
    seg = select_sum(same, g, SPLIT_FP32, DOT_16BIT)
    if (ROW_LOADS == 0) or (ROW_LOADS == 3):
        w, s = _load_row_state(rows, complete, d, D, w_ptr, stride_wr, stride_wd, state_ptr, OPT, ROW_EVICT)
    _finish_row_update(rows, seg, w, s, complete, d, D, w_ptr, stride_wr, stride_wd, state_ptr, lr_ptr, eps,
                       weight_decay, seed_ptr, OPT, DECAY, ROUND, ROW_EVICT)

    # Every lane of a segment holds the segment's chunk sum: the first and the last lane's rows are the partials.
    # The carry kernel reads first[k] only of a chunk that continues its predecessor's last segment, and last[k]
    # only of a chunk whose last segment continues into the next one: only those chunks write them (branches on
    # scalars, so uniform for the program). PICK_STORE (`kernels.embedding.update.PARTIAL_PICK`): the tile stored
    # with a mask that keeps the one lane's row, so only the threads holding it store; otherwise that row is picked
    # by a masked sum over the tile, a cross-lane reduction (~220 instructions a pick on sm_90, offline count).
    lane = tl.arange(0, CHUNK)
    if PICK_STORE:
        offs = k.to(tl.int64) * BLOCK_D + (lane[:, None] * 0 + d[None, :])  # every lane's pointer at the one row
        if (cs > 0) & (prev == row0):
            tl.store(first_ptr + offs, seg, mask=(lane == 0)[:, None])
        if following == row_last:
            tl.store(last_ptr + offs, seg, mask=(lane == (last_i - cs))[:, None])
    else:
        if (cs > 0) & (prev == row0):
            first = tl.sum(tl.where((lane == 0)[:, None], seg, 0.0), axis=0)
            tl.store(first_ptr + k.to(tl.int64) * BLOCK_D + d, first)
        if following == row_last:
            last = tl.sum(tl.where((lane == (last_i - cs))[:, None], seg, 0.0), axis=0)
            tl.store(last_ptr + k.to(tl.int64) * BLOCK_D + d, last)


@triton.jit
def _sparse_chunk_kernel(
    sorted_ptr, perm_ptr, slot_ptr, grad_ptr, stride_gb, stride_gf, stride_gd, w_ptr, stride_wr, stride_wd,
    state_ptr, lr_ptr, seed_ptr, first_ptr, last_ptr, eps, weight_decay, N, R, F: tl.constexpr, D: tl.constexpr,
    OPT: tl.constexpr, DECAY: tl.constexpr, ROUND: tl.constexpr, SLOT_MAP: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr, SPLIT_FP32: tl.constexpr, DOT_16BIT: tl.constexpr, ROW_LOADS: tl.constexpr,
    POS32: tl.constexpr, ROW_EVICT: tl.constexpr, GRAD_EVICT: tl.constexpr, PICK_STORE: tl.constexpr,
):
    """Segment sums inside one chunk of sorted positions; update the segments that lie inside it.

    Writes ``first[k]`` (sum over the chunk's positions whose row is the chunk's first row) and ``last[k]``
    (same for its last row) where the carry kernel needs them (see the module docstring).

    Positions are ``pos = b * F + c`` of a ``[B, F]`` rows tensor; the gradient of a position is
    ``grad[b, c]``, or ``grad[b, slot[c]]`` with ``SLOT_MAP`` (multi-hot: column c of the rows holds a slot
    of feature slot[c]). Rows ``>= R`` (the multi-hot padding) are sorted last and never updated.
    ``F`` and ``D`` are compile-time constants (one compile per model): ``pos // F`` is then a multiply and a
    shift, not the ~20-instruction division by a runtime value that each thread ran for each of its positions,
    and with ``D == BLOCK_D`` the column masks of every load and store fold away (Nsight Compute, 2026-11-24:
    the kernel issues an instruction on 65% of cycles, so instructions cost time).
    """
    k = tl.program_id(0)
    if not POS32:
        # Index arithmetic in 64 bits only where positions need it: in 32 bits each comparison and address is one
        # instruction, not two (the indices of the 16 positions are ~30% of the instructions of a chunk).
        k = k.to(tl.int64)
    # A chunk of padding only (its first sorted row >= R; padding sorts last): nothing to update, and the carry
    # kernel never reads its first/last sums (the segments it finishes have rows < R). A sharded row-wise
    # table's owner is sent the slots of every rank's samples, (W - 1) / W of them outside its block and so
    # padding here: for MLPerf DLRM-DCNv2 on two ranks, 9.8M of the 23.9M positions a step.
    rows, nxt, pos = _chunk_indices(sorted_ptr, perm_ptr, k, N, CHUNK)
    # Decided on the chunk's own index loads (rows sort ascending: the smallest is its first row), not on a load of its
    # first row ahead of them: the compiler moves loads below a branch into the one path that uses them, so the
    # program waited for that load, then for the index loads, two memory latencies in a row (Nsight Compute,
    # 2026-11-29: ~9% of the kernel's stall samples on that first load). ``pos`` and ``nxt`` enter the condition
    # (always true) so that their loads too are issued before it.
    keep = (k * CHUNK + tl.arange(0, CHUNK) < N) & (pos >= 0) & (nxt >= -1)
    # The chunk's bounding rows too (the segments' edges), so that no load waits for the branch: always true as well.
    row0, prev, row_last, following = _chunk_bounds(sorted_ptr, k, N, CHUNK)
    bounds_loaded = (prev >= -1) & (following >= -1) & (row0 >= -1) & (row_last >= -1)
    if (tl.min(tl.where(keep, rows, R), axis=0) >= R) & bounds_loaded:
        return
    b, f = _grad_coords(pos, k * CHUNK + tl.arange(0, CHUNK) < N, slot_ptr, F, SLOT_MAP, POS32)
    _chunk_update(k, rows, nxt, b, f, row0, prev, row_last, following, sorted_ptr, grad_ptr, stride_gb, stride_gf,
                  stride_gd, w_ptr, stride_wr, stride_wd, state_ptr, lr_ptr, seed_ptr, first_ptr, last_ptr, eps,
                  weight_decay, N, D, R, OPT, DECAY, ROUND, CHUNK, BLOCK_D, SPLIT_FP32, DOT_16BIT, ROW_LOADS, ROW_EVICT,
                  GRAD_EVICT, PICK_STORE)
