"""Layout of the F embedding tables inside one ``[R, D]`` weight, and their initialisation.

Every sparse arch (the eager ``dlrm.model.archs.SparseArch``, the sharded
``dlrm.distributed.sharded_embedding.ShardedSparseArch`` and ``kernels.embedding.TritonSparseEmbedding``)
stores table ``f`` in rows ``offsets[f] .. offsets[f] + cardinalities[f] - 1`` and initialises it the
reference DLRM's way. These functions are that one definition: a checkpoint written by one arch loads
into another, and the same RNG state gives the same initial rows in all of them.

The init draws each table in chunks of `INIT_CHUNK_ROWS` rows, every chunk from its own generator keyed
by one seed drawn from torch's CPU RNG (`init_seed`) and the chunk's index over all tables: so any block
of rows can be drawn alone, with the values the whole table has. A rank of a sharded run draws only the
chunks its rows lie in (`init_rows_`); drawing whole tables, as before 2026-12-01, every rank held each
full table on its device in turn (MLPerf DLRM-DCNv2's largest, 40M rows, is 20 GB in fp32), and a table
larger than one GPU could never have been sharded.

Plain ints and tensors only (this package imports nothing from ``dlrm``).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import Tensor

__all__ = [
    "INIT_CHUNK_ROWS",
    "check_cardinalities",
    "first_init_chunks",
    "init_bound",
    "init_rows_",
    "init_seed",
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


# Rows a generator draws at once: the most an init holds beyond the rows it fills (32 MiB at D=128 in fp32), and
# about 3,100 generators for MLPerf DLRM-DCNv2's 204M rows. Changing it changes every table's initial values.
INIT_CHUNK_ROWS = 1 << 16

_U64 = 2**64


def init_seed() -> int:
    """The key of one model's table init: one draw from torch's default CPU generator (so ``torch.manual_seed``
    fixes it, and the draws after it are the same whatever the tables' sizes, device or sharding).

    The CPU generator, whatever the tables' device: a CUDA draw would cost a host sync to read, and every arch, on
    every device, must take the same one draw from the same stream."""
    return int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64, device="cpu"))


def first_init_chunks(cardinalities: Sequence[int]) -> list[int]:
    """Index of each table's first init chunk among all tables' chunks (tables in feature order, ``ceil(n /
    INIT_CHUNK_ROWS)`` chunks a table of n rows).

    >>> first_init_chunks([3, 2**16 + 1, 5])
    [0, 1, 3]
    """
    firsts, at = [], 0
    for rows in cardinalities:
        firsts.append(at)
        at += -(-int(rows) // INIT_CHUNK_ROWS)
    return firsts


@torch.no_grad()
def init_table_(table: Tensor, rows: int, generator: Optional[torch.Generator] = None) -> Tensor:
    """Fill ``table`` with U(-b, b), b = init_bound(rows), from ``generator`` (default: torch's for its device)."""
    bound = init_bound(rows)
    return table.uniform_(-bound, bound, generator=generator)


@torch.no_grad()
def init_rows_(out: Tensor, rows: int, start: int, seed: int, first_chunk: int) -> Tensor:
    """Fill ``out`` [count, D] with rows ``start .. start + count - 1`` of the initial values of a table of ``rows``
    rows whose first chunk is ``first_chunk`` (`first_init_chunks`) in the init keyed by ``seed`` (`init_seed`).

    Chunk c of the table (its rows ``c * INIT_CHUNK_ROWS ..``, fewer in the last) is drawn whole, in ``out``'s dtype
    and on its device, from a generator seeded ``seed + first_chunk + c``, and the rows ``out`` takes are copied:
    the same values whatever block is asked for, and at most one chunk held beyond ``out``. Consecutive keys, not
    hashed ones: the CPU generator keeps a seed's low 32 bits only, where hashed keys of a few thousand chunks would
    collide (two chunks with the same rows) with a chance of about 1e-3; consecutive keys never do."""
    count, width = out.shape[0], out.shape[1]
    if not 0 <= start <= start + count <= rows:
        raise ValueError(f"rows {start}..{start + count - 1} are not rows of a table of {rows} rows")
    end = start + count
    if out.device.type == "meta":  # a model built for its shapes only (no memory): nothing to draw
        return out
    for c in range(start // INIT_CHUNK_ROWS, -(-end // INIT_CHUNK_ROWS)):
        lo, hi = c * INIT_CHUNK_ROWS, min((c + 1) * INIT_CHUNK_ROWS, rows)
        generator = torch.Generator(device=out.device)
        generator.manual_seed((seed + first_chunk + c) % _U64)
        # always a fresh tensor of the whole chunk: its values cannot depend on the block asked for
        chunk = init_table_(torch.empty(hi - lo, width, dtype=out.dtype, device=out.device), rows, generator)
        a, b = max(lo, start), min(hi, end)
        out[a - start : b - start] = chunk[a - lo : b - lo]
        del chunk  # before the next chunk is allocated: else two are held at once
    return out


@torch.no_grad()
def init_tables_(weight: Tensor, cardinalities: Sequence[int], seed: Optional[int] = None) -> None:
    """Initialise every table of ``weight`` [R, D] (`init_rows_` of each whole table), keyed by ``seed`` (default:
    one `init_seed` draw, the only draw from torch's RNG)."""
    seed = init_seed() if seed is None else seed
    for start, rows, first in zip(table_offsets(cardinalities), cardinalities, first_init_chunks(cardinalities)):
        init_rows_(weight[start : start + int(rows)], int(rows), 0, seed, first)
