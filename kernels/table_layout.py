"""Layout of the F embedding tables inside one ``[R, D]`` weight, and their initialisation.

Every sparse arch (the eager ``dlrm.model.archs.SparseArch``, the sharded
``dlrm.distributed.sharded_embedding.ShardedSparseArch`` and ``kernels.embedding.TritonSparseEmbedding``)
stores table ``f`` in rows ``offsets[f] .. offsets[f] + cardinalities[f] - 1`` and initialises it the
reference DLRM's way. These functions are that one definition: a checkpoint written by one arch loads
into another, and the same RNG state gives the same initial rows in all of them.

Plain ints and tensors only (this package imports nothing from ``dlrm``).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import Tensor

__all__ = [
    "check_cardinalities",
    "init_bound",
    "init_table_",
    "init_tables_",
    "layout_tensors",
    "table_offsets",
    "total_rows",
]


def check_cardinalities(cardinalities: Sequence[int]) -> list[int]:
    """``cardinalities`` as a list of ints; raises ValueError unless there are F >= 1 positive ones."""
    cards = [int(c) for c in cardinalities]
    if not cards or min(cards) < 1:
        raise ValueError(f"cardinalities must be F >= 1 positive ints, got {cards}")
    return cards


def table_offsets(cardinalities: Sequence[int]) -> list[int]:
    """First row of each table in the shared weight: the exclusive cumulative sum of ``cardinalities``.

    >>> table_offsets([3, 5, 2])   # tables of 3, 5 and 2 rows in one weight of 10 rows
    [0, 3, 8]
    """
    offsets, start = [], 0
    for c in cardinalities:
        offsets.append(start)
        start += int(c)
    return offsets


def total_rows(cardinalities: Sequence[int]) -> int:
    """``R``: rows of the shared weight (the sum of the table sizes)."""
    return sum(int(c) for c in cardinalities)


def layout_tensors(cardinalities: Sequence[int], device: Optional[torch.device | str] = None) -> tuple[Tensor, Tensor]:
    """``(cardinalities [F], offsets [F])`` as int64 tensors, the hashing functions' inputs.

    ``device=None`` follows torch's default device (``build_model`` builds under ``with torch.device``).
    """
    cards = [int(c) for c in cardinalities]
    return (
        torch.tensor(cards, dtype=torch.int64, device=device),
        torch.tensor(table_offsets(cards), dtype=torch.int64, device=device),
    )


def init_bound(rows: int) -> float:
    """Half-width of the uniform init of a table of ``rows`` rows: the reference DLRM's ``sqrt(1 / n)``.

    Written as ``sqrt(1 / n)``, not ``1 / sqrt(n)``: the two differ in the last bit for a third of all
    ``n``, and every arch must draw from exactly the same interval.
    """
    return math.sqrt(1.0 / rows)


@torch.no_grad()
def init_table_(table: Tensor, rows: int) -> Tensor:
    """Fill ``table`` (the rows of one table, or a slice of the shared weight) with U(-b, b), b = init_bound."""
    bound = init_bound(rows)
    return table.uniform_(-bound, bound)


@torch.no_grad()
def init_tables_(weight: Tensor, cardinalities: Sequence[int]) -> None:
    """Initialise every table of ``weight`` [R, D] in feature order (one RNG draw per table, in place)."""
    for start, rows in zip(table_offsets(cardinalities), cardinalities):
        init_table_(weight[start : start + int(rows)], int(rows))
