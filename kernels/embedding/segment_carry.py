"""The carry kernel of the sorted-segment update (`kernels.embedding.update`): the segments that cross chunk
boundaries, finished from the chunk kernel's partial sums (`kernels.embedding.segment_chunk`).

Notation as in `kernels.embedding.update`: ``N`` sorted positions, ``CHUNK`` of them a chunk, ``R`` table rows.

A segment that starts in chunk ``k`` and continues into chunk ``k + 1`` has the partial sum ``last[k]`` of
chunk k and ``first[j]`` of each following chunk j whose first row is the segment's row. Each program looks
at ``CHUNKS`` consecutive chunk boundaries at once (vector loads of their rows):

* a segment that ends in chunk ``k + 1`` (most of them: the next chunk's successor starts another row) is
  ``last[k] + first[k + 1]``, updated for all such boundaries of the program in one [CHUNKS, D] tile;
* a segment that spans further chunks (a hot row fills thousands) is summed from the first-row partials of the
  chunks up to the next group boundary (groups of ``CARRY_BLOCK`` chunks), then from the group sums ``gsum``
  that `_group_sum_kernel` wrote (each the sum of its group's chunks that continue the row running at the
  group's start), ``CARRY_BLOCK`` groups a step, one such segment at a time (``GROUP_SUMS``; the multi-hot
  launches); without them by a loop over the following chunks, ``CARRY_BLOCK`` partials a step.

Why group sums (2026-11-29): the walk is serial, one program per segment, each step a chain of dependent loads.
Summing chunk partials ``CARRY_BLOCK`` at a time, the hottest row of the synthetic MLPerf DLRM-DCNv2 data
(Zipf-like ids, `dlrm.data.synthetic`) took 884 steps at batch 65536 (452,328 positions, 28,270 16-position
chunks) while the other programs had long finished; uniform ids took at most 43 (the 3-row table). With group
sums a segment of ``c`` chunks costs ``1 + c / CARRY_BLOCK**2`` steps: 29 and 3. The sums are still added in an
order fixed by the sorted rows alone (bitwise reproducible, whichever program finishes a segment).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.embedding.row_update import _apply_row_update


@triton.jit
def _group_sum_kernel(sorted_ptr, first_ptr, gsum_ptr, num_chunks, R, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr,
                      GROUP: tl.constexpr):
    """``gsum[g]``: the sum of ``first[k]`` over the chunks ``k`` of group ``g`` (chunks ``g * GROUP ...``) whose
    first row is the row running into the group (its start's predecessor): a prefix of the group, since the rows
    are sorted, and every one of those chunks wrote its ``first`` partial. Zero where no chunk continues a row."""
    g = tl.program_id(0).to(tl.int64)
    k = g * GROUP + tl.arange(0, GROUP)
    start = g * GROUP * CHUNK
    running = tl.load(sorted_ptr + start - 1, mask=start > 0, other=-2).to(tl.int64)
    running = tl.where(running < R, running, -2)  # the empty slots' row R is never updated; -2 matches no row
    head = tl.load(sorted_ptr + k * CHUNK, mask=k < num_chunks, other=-1).to(tl.int64)
    match = (k < num_chunks) & (head == running)  # one vector mask: the interpreter mishandles scalar & vector
    d = tl.arange(0, BLOCK_D)
    part = tl.load(first_ptr + k[:, None] * BLOCK_D + d[None, :], mask=match[:, None], other=0.0)
    tl.store(gsum_ptr + g * BLOCK_D + d, tl.sum(part, axis=0))


@triton.jit
def _carry_span_chunks(k, row_last, acc, sorted_ptr, first_ptr, num_chunks, d, CHUNK: tl.constexpr,
                       BLOCK_D: tl.constexpr, CARRY_BLOCK: tl.constexpr):
    """The walk before group sums (``GROUP_SUMS`` False, for A/B measurements): ``acc`` plus the first-row
    partials of the chunks after ``k`` that start with ``row_last``, ``CARRY_BLOCK`` chunks at a time."""
    j = k + 1
    n_match = CARRY_BLOCK
    while n_match == CARRY_BLOCK:
        kk = j + tl.arange(0, CARRY_BLOCK)
        kmask = kk < num_chunks
        head = tl.load(sorted_ptr + kk * CHUNK, mask=kmask, other=-1).to(tl.int64)
        match = kmask & (head == row_last)
        part = tl.load(first_ptr + kk[:, None] * BLOCK_D + d[None, :], mask=match[:, None], other=0.0)
        acc += tl.sum(part, axis=0)
        n_match = tl.sum(match.to(tl.int32), axis=0)
        j += CARRY_BLOCK
    return acc


@triton.jit
def _carry_span(k, row_last, acc, sorted_ptr, first_ptr, gsum_ptr, num_chunks, d, CHUNK: tl.constexpr,
                BLOCK_D: tl.constexpr, CARRY_BLOCK: tl.constexpr):
    """``acc`` plus the first-row partials of the chunks after ``k`` that start with ``row_last``: those before the
    next group boundary one by one, then whole groups' sums (`_group_sum_kernel`), ``CARRY_BLOCK`` groups a step
    until a group starts with another row."""
    j = k + 1
    boundary = (j + CARRY_BLOCK - 1) // CARRY_BLOCK * CARRY_BLOCK
    kk = j + tl.arange(0, CARRY_BLOCK)
    kmask = (kk < boundary) & (kk < num_chunks)
    head = tl.load(sorted_ptr + kk * CHUNK, mask=kmask, other=-1).to(tl.int64)
    match = kmask & (head == row_last)
    part = tl.load(first_ptr + kk[:, None] * BLOCK_D + d[None, :], mask=match[:, None], other=0.0)
    acc += tl.sum(part, axis=0)
    # every chunk up to the boundary continued the row (none when k + 1 is one): it may run into the next group
    more = tl.sum(match.to(tl.int32), axis=0) == boundary - j
    g = boundary // CARRY_BLOCK
    num_groups = (num_chunks + CARRY_BLOCK - 1) // CARRY_BLOCK
    while more:
        gg = g + tl.arange(0, CARRY_BLOCK)
        gmask = gg < num_groups
        ghead = tl.load(sorted_ptr + gg * CARRY_BLOCK * CHUNK, mask=gmask, other=-1).to(tl.int64)
        gmatch = gmask & (ghead == row_last)
        part = tl.load(gsum_ptr + gg[:, None] * BLOCK_D + d[None, :], mask=gmatch[:, None], other=0.0)
        acc += tl.sum(part, axis=0)
        more = tl.sum(gmatch.to(tl.int32), axis=0) == CARRY_BLOCK
        g += CARRY_BLOCK
    return acc


@triton.jit
def _sparse_carry_kernel(
    sorted_ptr, w_ptr, stride_wr, stride_wd, state_ptr, lr_ptr, seed_ptr, first_ptr, last_ptr, gsum_ptr, eps,
    weight_decay, N, num_chunks, D, R,
    OPT: tl.constexpr, DECAY: tl.constexpr, ROUND: tl.constexpr, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr,
    CARRY_BLOCK: tl.constexpr, CHUNKS: tl.constexpr, GROUP_SUMS: tl.constexpr,
):
    """Finish the segments that start in chunks ``pid * CHUNKS ...`` and continue into the next chunk."""
    k = tl.program_id(0).to(tl.int64) * CHUNKS + tl.arange(0, CHUNKS)
    km = k < num_chunks
    cs = k * CHUNK
    ce = tl.minimum(cs + CHUNK, N)
    row0 = tl.load(sorted_ptr + cs, mask=km, other=-1).to(tl.int64)
    prev = tl.load(sorted_ptr + cs - 1, mask=km & (cs > 0), other=-1).to(tl.int64)
    row_last = tl.load(sorted_ptr + ce - 1, mask=km, other=-1).to(tl.int64)
    following = tl.load(sorted_ptr + ce, mask=km & (ce < N), other=-1).to(tl.int64)
    head2 = tl.load(sorted_ptr + cs + 2 * CHUNK, mask=km & (cs + 2 * CHUNK < N), other=-1).to(tl.int64)
    row0_cont = tl.where((cs == 0) | (prev != row0), -2, row0)
    crossing = km & (following == row_last) & (row_last != row0_cont) & (row_last < R)
    longer = crossing & (head2 == row_last)  # still going at the start of chunk k + 2
    ends_next = crossing & (head2 != row_last)

    d = tl.arange(0, BLOCK_D)
    m2 = ends_next[:, None] & (d < BLOCK_D)[None, :]
    acc = tl.load(last_ptr + k[:, None] * BLOCK_D + d[None, :], mask=m2, other=0.0)
    acc += tl.load(first_ptr + (k + 1)[:, None] * BLOCK_D + d[None, :], mask=m2, other=0.0)
    _apply_row_update(row_last, acc, ends_next, d, D, w_ptr, stride_wr, stride_wd, state_ptr, lr_ptr, eps,
                      weight_decay, seed_ptr, OPT, DECAY, ROUND)

    # The rare longer segments, one at a time (the smallest chunk index left first).
    todo = longer
    n_todo = tl.sum(todo.to(tl.int32), axis=0)
    while n_todo > 0:
        kl = tl.min(tl.where(todo, k, num_chunks), axis=0)
        rl = tl.load(sorted_ptr + tl.minimum(kl * CHUNK + CHUNK, N) - 1).to(tl.int64)
        acc1 = tl.load(last_ptr + kl * BLOCK_D + d)
        if GROUP_SUMS:
            acc1 = _carry_span(kl, rl, acc1, sorted_ptr, first_ptr, gsum_ptr, num_chunks, d, CHUNK, BLOCK_D,
                               CARRY_BLOCK)
        else:
            acc1 = _carry_span_chunks(kl, rl, acc1, sorted_ptr, first_ptr, num_chunks, d, CHUNK, BLOCK_D, CARRY_BLOCK)
        one = tl.arange(0, 1)
        _apply_row_update(rl + one * 0, acc1[None, :], one == 0, d, D, w_ptr, stride_wr, stride_wd, state_ptr,
                          lr_ptr, eps, weight_decay, seed_ptr, OPT, DECAY, ROUND)
        todo = todo & (k != kl)
        n_todo -= 1
