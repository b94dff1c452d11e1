"""The rows of a synthetic dataset, chunk by chunk, in this process or in a pool of processes.

Chunk ``c`` (rows ``[c * CHUNK_ROWS, ...)``) comes from its own random streams, seeded by
(seed, c): chunks are independent, so ``workers > 1`` computes them in parallel processes and
`chunks` still yields them in order, each exactly as one process would have made it. The dataset
is the same byte for byte whatever the number of workers; only the time changes (the teacher's
hashing and the multi-hot sampling are most of it: one process makes ~16k MLPerf-shaped multi-hot
rows a second on the GPU machine's cores).
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from typing import Iterator, Optional

import numpy as np

from dlrm.data.schema import MISSING_SPARSE, NUM_SPARSE, slot_offsets
from dlrm.data.teacher import Rows, Teacher, category_values, expand_multi_hot, sample_rows
from dlrm.data.worker_pool import start_pool

CHUNK_ROWS = 1 << 16
"""Rows per generation chunk; fixed so the data do not depend on memory, file or worker settings."""

Chunk = tuple[Rows, np.ndarray, np.ndarray, np.ndarray]


def make_chunk(seed: int, chunk: int, n: int, cards: list[int], teacher: Teacher,
               multi_hot_sizes: Optional[list[int]] = None, multi_hot_fill: str = "fixed") -> Chunk:
    """The `n` rows of chunk number `chunk`, from its own random stream: the rows, their click
    probabilities (float64 [n]), labels (int8 [n]) and stored sparse values (int64 [n, L]; multi-hot:
    the slot layout, `PAD_SPARSE` in empty slots). The labels are drawn from exactly these
    probabilities, which the oracle AUC scores."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0, chunk]))
    block = sample_rows(rng, n, cards)
    if multi_hot_sizes is not None:  # further values from a stream of their own (seed, 2, chunk)
        more = np.random.default_rng(np.random.SeedSequence([seed, 2, chunk]))
        block.ids = expand_multi_hot(more, block.ids, cards, multi_hot_sizes, multi_hot_fill)
    p = teacher.probability(block.dense, block.ids)
    labels = (rng.random(n) < p).astype(np.int8)
    if multi_hot_sizes is not None:
        return block, p, labels, stored_values(seed, cards, multi_hot_sizes, block.ids)
    sparse = np.full((n, NUM_SPARSE), MISSING_SPARSE, dtype=np.int64)
    for f in range(NUM_SPARSE):
        present = block.ids[:, f] >= 0
        sparse[present, f] = category_values(seed, f, cards[f], block.ids[present, f])
    return block, p, labels, sparse


def stored_values(seed: int, cards: list[int], sizes: list[int], ids: np.ndarray) -> np.ndarray:
    """Multi-hot category ids [n, L] as stored values: each id its `category_values`, -1 and -2 kept."""
    sparse = ids.copy()
    offsets = slot_offsets(sizes)
    for f in range(NUM_SPARSE):
        block = sparse[:, offsets[f] : offsets[f + 1]]
        present = block >= 0
        block[present] = category_values(seed, f, cards[f], block[present])
    return sparse


# A pool worker's teacher, set once per process by `_init_worker` (not pickled with every chunk).
_TEACHER: Optional[Teacher] = None


def _init_worker(teacher: Teacher) -> None:
    global _TEACHER
    _TEACHER = teacher


def _pool_chunk(seed: int, chunk: int, n: int, cards: list[int], multi_hot_sizes: Optional[list[int]],
                multi_hot_fill: str) -> Chunk:
    assert _TEACHER is not None, "the pool's initializer sets the teacher"
    return make_chunk(seed, chunk, n, cards, _TEACHER, multi_hot_sizes, multi_hot_fill)


def chunks(seed: int, rows: int, cards: list[int], teacher: Teacher, multi_hot_sizes: Optional[list[int]] = None,
           multi_hot_fill: str = "fixed", workers: int = 1) -> Iterator[tuple[int, Chunk]]:
    """``(first row, chunk)`` for every chunk of a `rows`-row dataset, in order.

    ``workers > 1``: a pool of that many processes ("spawn": nothing of this process's threads is
    inherited) computes up to ``2 * workers`` chunks ahead of the one being yielded, which bounds
    the memory held to that many chunks. Closing the generator early (an error while writing,
    Ctrl-C) cancels the chunks not started and waits for the running ones.
    """
    plan = [(c, start, min(CHUNK_ROWS, rows - start)) for c, start in enumerate(range(0, rows, CHUNK_ROWS))]
    if workers <= 1 or len(plan) <= 1:
        for c, start, n in plan:
            yield start, make_chunk(seed, c, n, cards, teacher, multi_hot_sizes, multi_hot_fill)
        return
    pool = start_pool(min(workers, len(plan)), _init_worker, (teacher,))  # workers that leave Ctrl-C to this process
    try:
        todo = iter(plan)
        pending: deque[tuple[int, Future]] = deque()

        def submit_next() -> None:
            item = next(todo, None)
            if item is not None:
                c, start, n = item
                pending.append((start, pool.submit(_pool_chunk, seed, c, n, cards, multi_hot_sizes, multi_hot_fill)))

        for _ in range(2 * workers):
            submit_next()
        while pending:
            start, future = pending.popleft()
            result = future.result()
            submit_next()
            yield start, result
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
