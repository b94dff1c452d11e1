"""The carry kernel of the sorted-segment update (`kernels.embedding.update`): the segments that cross chunk
boundaries, finished from the chunk kernel's partial sums (`kernels.embedding.segment_chunk`).

Notation as in `kernels.embedding.update`: ``N`` sorted positions, ``CHUNK`` of them a chunk, ``R`` table rows.

A segment that starts in chunk ``k`` and continues into chunk ``k + 1`` has the partial sum ``last[k]`` of
chunk k and ``first[j]`` of each following chunk j whose first row is the segment's row. Each program looks
at ``CHUNKS`` consecutive chunk boundaries at once (vector loads of their rows):

* a segment that ends in chunk ``k + 1`` (most of them: the next chunk's successor starts another row) is
  ``last[k] + first[k + 1]``, updated for all such boundaries of the program in one [CHUNKS, D] tile;
* a segment that spans further chunks (a hot row of a small table fills thousands) is summed by a loop
  over the following chunks, ``CARRY_BLOCK`` first-row partials a step, one such segment at a time.

The sums are added in the same order as before this kernel took blocks of chunks (one program per chunk,
whose ~876K mostly idle programs cost 0.55 ms of a 4.8 ms update at MLPerf DLRM-DCNv2's shapes with
16-position chunks; results/pooled_update_tuning.md).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.embedding.row_update import _apply_row_update


@triton.jit
def _carry_span(k, row_last, acc, sorted_ptr, first_ptr, num_chunks, d, CHUNK: tl.constexpr,
                BLOCK_D: tl.constexpr, CARRY_BLOCK: tl.constexpr):
    """``acc`` plus the first-row partials of the chunks after ``k`` that start with ``row_last``, added
    ``CARRY_BLOCK`` chunks at a time until a chunk starts with another row."""
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
def _sparse_carry_kernel(
    sorted_ptr, w_ptr, stride_wr, stride_wd, state_ptr, lr_ptr, seed_ptr, first_ptr, last_ptr, eps, weight_decay,
    N, num_chunks, D, R,
    OPT: tl.constexpr, DECAY: tl.constexpr, ROUND: tl.constexpr, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr,
    CARRY_BLOCK: tl.constexpr, CHUNKS: tl.constexpr,
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
        acc1 = _carry_span(kl, rl, tl.load(last_ptr + kl * BLOCK_D + d), sorted_ptr, first_ptr, num_chunks, d, CHUNK,
                           BLOCK_D, CARRY_BLOCK)
        one = tl.arange(0, 1)
        _apply_row_update(rl + one * 0, acc1[None, :], one == 0, d, D, w_ptr, stride_wr, stride_wd, state_ptr,
                          lr_ptr, eps, weight_decay, seed_ptr, OPT, DECAY, ROUND)
        todo = todo & (k != kl)
        n_todo -= 1
