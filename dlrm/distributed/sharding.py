"""Which rank holds which embedding rows.

Notation: W ranks, F tables of ``cardinalities[f]`` rows. A table is either

- **table-wise**: whole on one rank (``table_rank[f]``), or
- **row-wise**: split into W consecutive blocks of ``ceil(n / W)`` rows, block q on rank q.

Rank q *serves* its table-wise tables and every row-wise table (its block of each). Its local
shard is one ``[R_q, D]`` weight holding, in feature order, the rows it serves.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dlrm.config import ConfigError


@dataclass(frozen=True)
class ShardingPlan:
    """The placement of every table's rows (see the module docstring).

    Attributes:
        world_size: W.
        cardinalities: rows per table (F ints).
        table_rank: owning rank of each table-wise table; -1 for a row-wise table.
    """

    world_size: int
    cardinalities: tuple[int, ...]
    table_rank: tuple[int, ...]

    def row_wise(self, f: int) -> bool:
        return self.table_rank[f] < 0

    def block(self, f: int, q: int) -> tuple[int, int]:
        """Rows ``[start, start + count)`` of table f held by rank q (count 0 when none)."""
        n = self.cardinalities[f]
        if not self.row_wise(f):
            return (0, n) if self.table_rank[f] == q else (0, 0)
        per = -(-n // self.world_size)
        start = min(q * per, n)
        return start, min(start + per, n) - start

    def served(self, q: int) -> list[int]:
        """Tables whose lookups rank q answers, in feature order."""
        return [f for f in range(len(self.cardinalities)) if self.row_wise(f) or self.table_rank[f] == q]

    def local_layout(self, q: int) -> list[tuple[int, int, int, int]]:
        """``(feature, first table row, rows, first local row)`` of each table rank q serves."""
        out, at = [], 0
        for f in self.served(q):
            start, count = self.block(f, q)
            out.append((f, start, count, at))
            at += count
        return out

    def local_rows(self, q: int) -> int:
        return sum(count for _, _, count, _ in self.local_layout(q))

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "ShardingPlan":
        return ShardingPlan(int(d["world_size"]), tuple(d["cardinalities"]), tuple(d["table_rank"]))

    def describe(self, dim: int, bytes_per_value: int = 4) -> str:
        lines = []
        for q in range(self.world_size):
            tw = [f for f in range(len(self.cardinalities)) if self.table_rank[f] == q]
            rows = self.local_rows(q)
            lines.append(f"rank {q}: {rows:,} rows ({rows * dim * bytes_per_value / 2**30:.2f} GiB of weights), "
                         f"tables {tw} whole" + (f", a block of row-wise tables {self.row_wise_tables()}"
                                                  if self.row_wise_tables() else ""))
        return "\n".join(lines)

    def row_wise_tables(self) -> list[int]:
        return [f for f in range(len(self.cardinalities)) if self.row_wise(f)]


def plan_sharding(cardinalities: list[int], world_size: int, mode: str, row_wise_min_rows: int) -> ShardingPlan:
    """Table-wise, row-wise or both ("auto": row-wise from `row_wise_min_rows` rows).

    Table-wise tables go, largest first, to the rank holding the fewest rows so far (counting its
    blocks of the row-wise tables), which balances memory and lookup traffic by rows.
    """
    if world_size < 1:
        raise ConfigError(f"world size {world_size} must be >= 1")
    if mode not in ("auto", "table", "row"):
        raise ConfigError(f"distributed.sharding: {mode!r} is not one of 'auto' | 'table' | 'row'")
    cards = [int(c) for c in cardinalities]
    row_wise = [mode == "row" or (mode == "auto" and n >= row_wise_min_rows) for n in cards]
    load = [sum(-(-n // world_size) for n, rw in zip(cards, row_wise) if rw)] * world_size
    table_rank = [-1] * len(cards)
    for f in sorted(range(len(cards)), key=lambda f: (-cards[f], f)):
        if not row_wise[f]:
            q = min(range(world_size), key=lambda q: (load[q], q))
            table_rank[f] = q
            load[q] += cards[f]
    return ShardingPlan(world_size, tuple(cards), tuple(table_rank))
