"""Which rank holds which embedding rows.

Notation: W ranks, F tables of ``cardinalities[f]`` rows. A table is either

- **table-wise**: whole on one rank (``table_rank[f]``), or
- **row-wise**: split into W consecutive blocks of ``ceil(n / W)`` rows, block q on rank q.

Rank q *serves* its table-wise tables and every row-wise table (its block of each). Its local
shard is one ``[R_q, D]`` weight holding, in feature order, the rows it serves.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from typing import Optional

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

    def describe(self, dim: int, bytes_per_value: int = 4, hotness: Optional[list[int]] = None) -> str:
        lines = []
        for q in range(self.world_size):
            tw = [f for f in range(len(self.cardinalities)) if self.table_rank[f] == q]
            rows = self.local_rows(q)
            lines.append(f"rank {q}: {rows:,} rows ({rows * dim * bytes_per_value / 2**30:.2f} GiB of weights), "
                         f"{self.lookups(q, hotness):g} lookups a sample, tables {tw} whole"
                         + (f", a block of row-wise tables {self.row_wise_tables()}" if self.row_wise_tables() else ""))
        return "\n".join(lines)

    def lookups(self, q: int, hotness: Optional[list[int]] = None) -> float:
        """Lookups a sample makes into rows rank q holds: its table-wise tables' values per sample
        (`hotness`, 1 each when None) and 1/W of each row-wise table's."""
        hot = hotness if hotness is not None else [1] * len(self.cardinalities)
        return sum(h / self.world_size if self.row_wise(f) else h * (self.table_rank[f] == q) for f, h in enumerate(hot))

    def row_wise_tables(self) -> list[int]:
        return [f for f in range(len(self.cardinalities)) if self.row_wise(f)]


# What a masked slot (another rank's block of a row-wise table: sent, looked up as zeros, its zero gradient
# sent back and skipped or added) costs its owner against a slot it looks up. A rough estimate from two plans'
# step times on two H200s (MLPerf DLRM-DCNv2, twentieth run: the five 40M-row tables row-wise, 24.35 ms, against
# all tables whole, 23.06 ms), not a measured constant; it decides only when row-wise splits pay.
MASKED_SLOT_COST = 1 / 3
# What a pooled feature a rank sends to another rank costs per sample (its embedding forward and its gradient
# back, through NVLink), in lookups. Estimated from one profile (two H200s, MLPerf DLRM-DCNv2, every table whole,
# benchmarks/results/scaling_mlperf_profile_2gpu_lookups_placed.md): 2.2-2.3 ms of SendRecv a step for the 9.5
# features a sample rank 1 sent across against 5.5 ms of pooled lookup, sort and update for its 107 lookups a
# sample: 4.5 lookups a feature sent. Counted, the step went from 21.79 to 21.60 ms (PERF.md, twenty-first run).
SENT_FEATURE_COST = 4.5
# Subsets of row-wise candidates tried exhaustively up to this many candidates; more: nested subsets only.
EXHAUSTIVE_CANDIDATES = 10
# Search steps (a table tried in a rank's set) the exact packing under a memory limit may spend in one plan_sharding
# call, over every subset of row-wise tables it tries (`_pack_exact`): a few tenths of a second; past it, largest first
# decides.
PACK_NODE_BUDGET = 50_000


def plan_sharding(cardinalities: list[int], world_size: int, mode: str, row_wise_min_rows: int,
                  hotness: Optional[list[int]] = None, balance: str = "cost", row_bytes: int = 0,
                  memory_per_rank: Optional[int] = None, shared_bytes: int = 0) -> ShardingPlan:
    """Table-wise, row-wise or both.

    Row-wise tables give every rank the same share (a block each). Table-wise tables then go one by one to
    the rank with the least load so far, where the load is

    - ``balance="cost"`` (default) or ``"lookups"``: the lookups a sample makes into the tables a rank serves
      (``hotness[f]`` values of each feature, 1 when one-hot), ties to the rank with fewer rows; tables taken
      most looked-up first, then largest. An owner's step time (its pooled lookup, the sort and update of the
      rows it is sent) grows with its lookups, not its rows: on MLPerf DLRM-DCNv2 over two H200s the
      rows-balanced plan gave rank 1 211 of the 363 slots its owners look up, and rank 0 waited 3.4 ms a step
      for it in the all_to_all; balanced by lookups (107.5 and 106.5 a sample), the step was 7.3% faster.
    - ``balance="rows"``: the rows a rank holds (its memory), tables taken largest first (the plan of
      earlier versions; a sharded checkpoint saved with it resumes only under it).

    Which tables are row-wise: every one with ``mode="row"``, none with ``"table"``. ``"auto"``: with
    ``"lookups"`` or ``"rows"`` (the plans of earlier versions), every table of ``row_wise_min_rows`` rows or
    more. With ``"cost"``, the subset of those tables whose plan has the least `plan_cost`: the step is the
    busiest rank's lookups (a row-wise table's slots are all sent to every owner, which looks up its 1/W and
    masks the rest at ``MASKED_SLOT_COST`` each) plus the exchange of the rank that sends the most pooled
    features to the others (``SENT_FEATURE_COST`` each; a row-wise table is sent by every rank). With
    ``"cost"`` the table-wise tables are placed by that cost too: most looked-up first, each to the rank where
    it adds the least, then single moves and swaps while they lower it. Ties go to fewer row-wise tables,
    then to less memory on the fullest rank. On two GPUs MLPerf DLRM-DCNv2's tables all go whole (measured on
    two H200s: 23.06 against 24.35 ms a step with the five 40M-row tables split, two machines of one kind),
    on four its 100-value feature is split (not measured). A plan that leaves a rank without rows (more ranks
    than whole tables), which a run refuses (`dlrm.train.builder.make_sharding`), is taken only when no subset
    gives every rank rows: with more ranks than tables, a candidate is split even where whole tables cost less.

    ``memory_per_rank`` (bytes, with ``row_bytes`` a row's weight and optimizer state): no rank may hold
    more, its rows and the ``shared_bytes`` every rank holds besides them (vocabulary hashing's keys,
    `dlrm.train.placement.vocabulary_key_bytes`) together ("cost" only: it tries placements that fit, spread by cost
    or else packed largest first, or else any packing that fits (`_pack_exact`), and splits tables row-wise when
    none does); None: no limit. Raises ConfigError when no plan fits.
    """
    if world_size < 1:
        raise ConfigError(f"world size {world_size} must be >= 1")
    if mode not in ("auto", "table", "row"):
        raise ConfigError(f"distributed.sharding: {mode!r} is not one of 'auto' | 'table' | 'row'")
    if balance not in ("cost", "lookups", "rows"):
        raise ConfigError(f"distributed.balance: {balance!r} is not one of 'cost' | 'lookups' | 'rows'")
    cards = [int(c) for c in cardinalities]
    hot = [int(h) for h in hotness] if hotness is not None else [1] * len(cards)
    if len(hot) != len(cards):
        raise ConfigError(f"multi-hot sizes: {len(hot)} values for {len(cards)} tables")
    # the bytes left for a rank's rows: every rank also holds the vocabulary keys (ShardedSparseArch's vocab_keys)
    limit = memory_per_rank - shared_bytes if balance == "cost" and memory_per_rank is not None else None
    budget = [PACK_NODE_BUDGET]  # shared by every subset's exact packing: one call stays fast (and alike everywhere)
    if mode == "row" or mode == "table" or balance != "cost":
        row_wise = [mode == "row" or (mode == "auto" and n >= row_wise_min_rows) for n in cards]
        subsets = [{f for f in range(len(cards)) if row_wise[f]}]
    else:
        subsets = _row_wise_subsets([f for f, n in enumerate(cards) if n >= row_wise_min_rows], hot, cards)
    best, best_key = None, None
    for subset in subsets:
        row_wise = [f in subset for f in range(len(cards))]
        plan = _place_table_wise(cards, hot, world_size, row_wise, balance, row_bytes, limit, budget)
        if plan is None:
            continue
        rows = [plan.local_rows(q) for q in range(world_size)]
        key = (rows.count(0), round(plan_cost(plan, hot), 9), len(subset), max(rows))
        if best_key is None or key < best_key:
            best, best_key = plan, key
    if best is None:
        raise ConfigError(_no_fit(cards, world_size, mode, row_bytes, memory_per_rank, shared_bytes))
    return best


def rank_lookups(plan: ShardingPlan, hotness: Optional[list[int]] = None) -> list[float]:
    """Each rank's lookups a sample of the global batch, a masked slot of a row-wise table counted as
    ``MASKED_SLOT_COST`` of one (`plan_sharding`)."""
    W = plan.world_size
    hot = hotness if hotness is not None else [1] * len(plan.cardinalities)
    split = sum(h * (1 / W + (1 - 1 / W) * MASKED_SLOT_COST) for f, h in enumerate(hot) if plan.row_wise(f))
    return [split + sum(h for f, h in enumerate(hot) if plan.table_rank[f] == q) for q in range(W)]


def plan_cost(plan: ShardingPlan, hotness: Optional[list[int]] = None) -> float:
    """The step cost ``balance="cost"`` minimises, in lookups a sample: the busiest rank's `rank_lookups`, plus
    ``SENT_FEATURE_COST`` times the pooled features a sample the rank that sends the most sends to other ranks
    ((W - 1) / W of those it serves: its table-wise tables and every row-wise one)."""
    W = plan.world_size
    served = [len(plan.served(q)) for q in range(W)]
    return max(rank_lookups(plan, hotness)) + SENT_FEATURE_COST * (W - 1) / W * max(served)


def _row_wise_subsets(candidates: list[int], hot: list[int], cards: list[int]):
    """Every subset of the candidates (few), else the nested ones: the k most looked-up, and the k largest."""
    if len(candidates) <= EXHAUSTIVE_CANDIDATES:
        for k in range(len(candidates) + 1):
            yield from (set(c) for c in itertools.combinations(candidates, k))
        return
    for order in (sorted(candidates, key=lambda f: (-hot[f], -cards[f], f)),
                  sorted(candidates, key=lambda f: (-cards[f], -hot[f], f))):
        for k in range(len(order) + 1):
            yield set(order[:k])


def _place_table_wise(cards: list[int], hot: list[int], world_size: int, row_wise: list[bool], balance: str,
                      row_bytes: int, limit: Optional[int], budget: list[int]) -> Optional[ShardingPlan]:
    """The table-wise tables spread over the ranks as `balance` says (see `plan_sharding`), each to a rank it
    fits on under ``limit`` bytes; None when one fits nowhere."""
    rows = [sum(-(-n // world_size) for n, rw in zip(cards, row_wise) if rw)] * world_size
    lookups = [0] * world_size  # the row-wise tables' lookups are the same on every rank
    table_rank = [-1] * len(cards)
    if balance == "rows":
        order = sorted(range(len(cards)), key=lambda f: (-cards[f], f))
        load = lambda q: (rows[q], q)  # noqa: E731
    else:
        order = sorted(range(len(cards)), key=lambda f: (-hot[f], -cards[f], f))
        load = lambda q: (lookups[q], rows[q], q)  # noqa: E731
    sent = [sum(row_wise)] * world_size  # pooled features each rank sends back (balance "cost")
    if balance == "cost":  # where a table adds the least cost (`plan_cost`): its lookups and the feature sent
        share = SENT_FEATURE_COST * (world_size - 1) / world_size
        load = lambda q: (lookups[q] + share * sent[q], rows[q], q)  # noqa: E731
    for f in order:
        if row_wise[f]:
            continue
        fits = [q for q in range(world_size) if limit is None or (rows[q] + cards[f]) * row_bytes <= limit]
        if not fits:
            # Spread by load, the tables can leave every rank a little room and none enough for the next table,
            # where another spread fits ([5, 5, 4, 3, 3] rows looked up 5, 4, ... times on 2 ranks of 10: 5+4+3
            # does not fit, 5+5 and 4+3+3 do): pack them largest first, else search every packing (largest first
            # misses some: `_pack_exact`), before saying they do not fit.
            packed = (_pack_largest_first(cards, world_size, row_wise, row_bytes, limit)
                      or _pack_exact(cards, world_size, row_wise, row_bytes, limit, budget))
            return None if packed is None else _improve(packed, hot, row_bytes, limit)
        q = min(fits, key=load)
        table_rank[f] = q
        rows[q] += cards[f]
        lookups[q] += hot[f]
        sent[q] += 1
    if limit is not None and rows[0] * row_bytes > limit:  # the row-wise blocks alone do not fit
        return None
    plan = ShardingPlan(world_size, tuple(cards), tuple(table_rank))
    return _improve(plan, hot, row_bytes, limit) if balance == "cost" else plan


def _pack_largest_first(cards: list[int], world_size: int, row_wise: list[bool], row_bytes: int,
                        limit: int) -> Optional[ShardingPlan]:
    """The table-wise tables under ``limit`` bytes a rank, largest first, each to the fullest rank it fits on
    (best-fit decreasing: it leaves the large gaps for the large tables); None when one fits nowhere."""
    rows = [sum(-(-n // world_size) for n, rw in zip(cards, row_wise) if rw)] * world_size
    table_rank = [-1] * len(cards)
    for f in sorted(range(len(cards)), key=lambda f: (-cards[f], f)):
        if row_wise[f]:
            continue
        fits = [q for q in range(world_size) if (rows[q] + cards[f]) * row_bytes <= limit]
        if not fits:
            return None
        q = max(fits, key=lambda q: (rows[q], -q))
        table_rank[f] = q
        rows[q] += cards[f]
    return ShardingPlan(world_size, tuple(cards), tuple(table_rank))


def _pack_exact(cards: list[int], world_size: int, row_wise: list[bool], row_bytes: int, limit: int,
                budget: list[int]) -> Optional[ShardingPlan]:
    """A packing of the table-wise tables under ``limit`` bytes a rank whenever one exists (largest first misses
    some: [6, 4, 5, 9, 5, 8] rows on 2 ranks of 19 go 9 + 8 and 6 + 5 + 5, and 4 fits neither, where 9 + 6 + 4 and
    8 + 5 + 5 fit); None when none does, or when the search spends ``budget[0]`` nodes (it is decremented) first.

    Bin completion: ranks are filled one at a time, each with the largest table left (it must go somewhere, and
    empty ranks are alike) and a set of smaller ones, fullest sets first. The room a rank leaves unfilled is lost,
    so no set may leave more than the ranks' room less the tables' rows, all told: near-exact fits are found, and
    refused, quickly. Equal sizes are not tried twice, nor a (tables left, ranks filled) state that failed once.
    Deterministic: the same tables in the same order give the same plan."""
    tables = sorted((f for f in range(len(cards)) if not row_wise[f]), key=lambda f: (-cards[f], f))
    sizes = [cards[f] for f in tables]
    if row_bytes <= 0 or not sizes or len(sizes) > 250:  # no bytes: largest first fitted; more: the recursion limit
        return None
    room = limit // row_bytes - sum(-(-n // world_size) for n, rw in zip(cards, row_wise) if rw)  # rows a rank takes
    slack = room * world_size - sum(sizes)  # the room the ranks may leave unfilled, all told
    if slack < 0 or sizes[0] > room:
        return None
    failed: set = set()
    chosen: list = []  # the tables (a bit mask of their places in `sizes`) of each rank filled so far

    def fill(left: int, k: int, lost: int) -> bool:  # place the tables in mask `left` on ranks k, k + 1, ...
        if not left:
            return True
        if k == world_size or (left, k) in failed:
            return False
        budget[0] -= len(sizes)  # this rank's lists below
        items = [i for i in range(len(sizes)) if left >> i & 1]  # largest first
        cap = room - sizes[items[0]]
        least = cap - (slack - lost)  # rows the other tables of this rank must reach
        rest = [sizes[i] for i in items[1:]]
        after = list(itertools.accumulate(reversed(rest), initial=0))[::-1]  # after[j]: rows of rest[j:]
        # the sums some tables of rest[j:] make (bit r: r rows), where the bits are few: the sets are then made
        # fullest first, one sum at a time, and a branch that reaches no wanted sum is not searched
        reach = [1] * (len(rest) + 1) if cap < 1 << 20 else None
        for j in range(len(rest) - 1, -1, -1) if reach else ():
            budget[0] -= 1 + (cap >> 14)  # a step of a few thousand bits costs about one node
            reach[j] = (reach[j + 1] | reach[j + 1] << rest[j]) & ((2 << cap) - 1)

        def sets(j: int, rows: int, mask: int, lo: int, hi: int):  # sets of rest[j:] that bring rows to lo..hi
            budget[0] -= 1
            if budget[0] < 0 or (reach is not None and not reach[j] >> max(lo - rows, 0) << max(lo - rows, 0)
                                 & ((2 << (hi - rows)) - 1)):
                return
            if rows >= lo:
                yield rows, mask
            for t in range(j, len(rest)):
                if rows + after[t] < lo:
                    break
                if (t > j and rest[t] == rest[t - 1]) or rows + rest[t] > hi:  # an equal size was tried here
                    continue
                yield from sets(t + 1, rows + rest[t], mask | 1 << items[t + 1], lo, hi)

        def fullest(sums: int):  # each reachable sum from the fullest down, its sets made as they are tried
            while sums and budget[0] >= 0:
                target = sums.bit_length() - 1
                sums ^= 1 << target
                yield from sets(0, 0, 1 << items[0], target, target)

        if reach is not None:
            options = fullest(reach[0] >> max(least, 0) << max(least, 0))
        else:
            options = sorted(sets(0, 0, 1 << items[0], least, cap), key=lambda s: -s[0])  # stable: fullest first
        for rows, mask in options:
            if budget[0] < 0:  # spent: no more sets tried (nor this state marked failed)
                return False
            chosen.append(mask)
            if fill(left & ~mask, k + 1, lost + cap - rows):
                return True
            chosen.pop()
        if budget[0] < 0:
            return False
        failed.add((left, k))
        return False

    if not fill((1 << len(sizes)) - 1, 0, 0):
        return None
    table_rank = [-1] * len(cards)
    for q, mask in enumerate(chosen):
        for i, f in enumerate(tables):
            if mask >> i & 1:
                table_rank[f] = q
    return ShardingPlan(world_size, tuple(cards), tuple(table_rank))


def _improve(plan: ShardingPlan, hot: list[int], row_bytes: int, limit: Optional[int]) -> ShardingPlan:
    """Single moves and pairwise swaps of table-wise tables while one lowers (`plan_cost`, fuller rank's rows)."""
    W, cards = plan.world_size, plan.cardinalities
    ranks = list(plan.table_rank)
    tables = [f for f in range(len(cards)) if ranks[f] >= 0]
    split = [f for f in range(len(cards)) if ranks[f] < 0]
    base_rows = sum(-(-cards[f] // W) for f in split)
    base_lookups = sum(hot[f] * (1 / W + (1 - 1 / W) * MASKED_SLOT_COST) for f in split)
    share = SENT_FEATURE_COST * (W - 1) / W
    rows, lookups, sent = [base_rows] * W, [base_lookups] * W, [len(split)] * W
    for f in tables:
        rows[ranks[f]] += cards[f]
        lookups[ranks[f]] += hot[f]
        sent[ranks[f]] += 1

    def key():  # the same numbers as plan_cost, kept per rank as tables move
        return round(max(lookups) + share * max(sent), 9), max(rows)

    def place(f: int, q: int, sign: int) -> None:
        rows[q] += sign * cards[f]
        lookups[q] += sign * hot[f]
        sent[q] += sign

    best = key()
    improved = True
    while improved:
        improved = False
        moves = [((f, q),) for f in tables for q in range(W) if q != ranks[f]]
        moves += [((f, ranks[g]), (g, ranks[f])) for f, g in itertools.combinations(tables, 2) if ranks[f] != ranks[g]]
        for move in moves:
            old = [(f, ranks[f]) for f, _ in move]
            for f, q in old:
                place(f, q, -1)
            for f, q in move:
                place(f, q, +1)
            if (limit is None or max(rows) * row_bytes <= limit) and key() < best:
                for f, q in move:
                    ranks[f] = q
                best, improved = key(), True
                break
            for f, q in move:
                place(f, q, -1)
            for f, q in old:
                place(f, q, +1)
    return ShardingPlan(W, cards, tuple(ranks))


def _no_fit(cards: list[int], world_size: int, mode: str, row_bytes: int, limit: int, shared_bytes: int) -> str:
    keys = f" and {shared_bytes:,} bytes of vocabulary keys every rank holds" if shared_bytes else ""
    return (f"distributed.sharding {mode!r}: the tables ({sum(cards):,} rows of {row_bytes} bytes with their "
            f"optimizer state{keys}) do not fit {world_size} ranks of {limit:,} bytes ({limit / 2**30:.1f} GiB) each "
            f"for tables (dlrm.train.builder.TABLE_MEMORY_FRACTION of the smallest GPU)"
            + ("; sharding 'auto' or 'row' splits tables" if mode == "table" else "; use more GPUs"))
