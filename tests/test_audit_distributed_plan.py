"""The sharding plan's contract beyond test_distributed.py's: every (table, rank) block, the dict a sharded checkpoint
stores it as, a table placed where it fits in memory, and more ranks than whole tables under the default
"auto" / "cost" plan (every rank must hold rows, or the run refuses the plan)."""

from __future__ import annotations

import pytest
import torch

from dlrm.config import Config, ConfigError, validate
from dlrm.distributed.env import DistEnv
from dlrm.distributed.sharding import ShardingPlan, plan_sharding

CARDS = [1, 2, 5, 11, 100, 7, 3000, 2]


@pytest.mark.parametrize("mode", ["table", "row", "auto"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 9])
def test_blocks_of_every_table_on_every_rank(mode, world):
    """block(f, q) for every table and rank, not only those a rank serves: a table-wise table is (0, n) on its
    owner and (0, 0) elsewhere; a row-wise one is split in rank order into blocks of ceil(n / W) rows (the last
    ones shorter or empty); local_layout and local_rows are the served blocks, laid out one after the other."""
    plan = plan_sharding(CARDS, world, mode, row_wise_min_rows=100, balance="lookups")
    for f, n in enumerate(CARDS):
        blocks = [plan.block(f, q) for q in range(world)]
        if plan.row_wise(f):
            per = -(-n // world)
            assert [count for _, count in blocks] == [max(0, min(per, n - q * per)) for q in range(world)]
            assert [start for start, _ in blocks] == [min(q * per, n) for q in range(world)]
        else:
            owner = plan.table_rank[f]
            assert 0 <= owner < world
            assert blocks == [(0, n) if q == owner else (0, 0) for q in range(world)]
    for q in range(world):
        served = [f for f in range(len(CARDS)) if plan.row_wise(f) or plan.table_rank[f] == q]
        assert plan.served(q) == served
        at, layout = 0, []
        for f in served:
            layout.append((f, *plan.block(f, q), at))
            at += plan.block(f, q)[1]
        assert plan.local_layout(q) == layout and plan.local_rows(q) == at


def test_plan_round_trips_through_the_dict_a_checkpoint_stores():
    """to_dict / from_dict, as the shards and the manifest hold the plan (through torch.save, and with lists, as a
    JSON copy gives them): the same plan, table for table."""
    import io

    plan = plan_sharding(CARDS, 3, "auto", row_wise_min_rows=100, balance="lookups")
    assert len(set(plan.table_rank)) > 2  # whole tables on several ranks, and row-wise ones
    d = plan.to_dict()
    assert d == {"world_size": 3, "cardinalities": tuple(CARDS), "table_rank": plan.table_rank}
    buf = io.BytesIO()
    torch.save(d, buf)
    buf.seek(0)
    as_lists = {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}
    for stored in (d, torch.load(buf, weights_only=True), as_lists):
        back = ShardingPlan.from_dict(stored)
        assert back == plan and back.table_rank == plan.table_rank and back.cardinalities == plan.cardinalities


def test_cost_plan_puts_a_table_where_it_fits():
    """Table 2 adds the least cost on rank 1, but 900 + 300 rows do not fit its 1000: it goes to rank 0, and no
    rank holds more than the limit (without one, rank 1 takes it)."""
    cards, hot = [100, 900, 300], [10, 1, 1]
    assert plan_sharding(cards, 2, "table", 10**9, hot).table_rank == (0, 1, 1)
    plan = plan_sharding(cards, 2, "table", 10**9, hot, row_bytes=1, memory_per_rank=1000)
    assert plan.table_rank == (0, 1, 0) and max(plan.local_rows(q) for q in range(2)) <= 1000


@pytest.mark.parametrize("cards,world", [([100, 200], 3), ([100, 200], 4), ([1000, 1000, 1000], 4), ([5, 1000], 3)])
def test_cost_plan_gives_every_rank_rows_when_a_split_can(cards, world):
    """More ranks than tables: whole tables would leave a rank without rows, which a run refuses
    (make_sharding); "auto" with balance "cost" (the defaults) splits candidates (tables of row_wise_min_rows rows
    or more) so that every rank holds rows, and the run takes the plan."""
    from dlrm.train import builder
    from dlrm.train.setup import Tables

    plan = plan_sharding(cards, world, "auto", row_wise_min_rows=10)
    assert plan.row_wise_tables() and min(plan.local_rows(q) for q in range(world)) > 0
    cfg = validate(Config())
    cfg.distributed.row_wise_min_rows = 10
    tables = Tables(cards, None, "modulus")
    assert builder.make_sharding(cfg, tables, DistEnv(0, world), torch.device("cpu")) == plan
    # no candidate to split: the run says what to do
    cfg.distributed.row_wise_min_rows = 10**6
    with pytest.raises(ConfigError, match=r"leaves rank \d without embedding rows .*use 'row'"):
        builder.make_sharding(cfg, tables, DistEnv(0, world), torch.device("cpu"))


def test_cost_plan_keeps_whole_tables_when_every_rank_has_some():
    """The split is forced only by an empty rank: with as many ranks as tables (and on MLPerf DLRM-DCNv2's
    tables, test_distributed.py) the cheaper whole tables stay whole."""
    plan = plan_sharding([100, 200, 300], 3, "auto", row_wise_min_rows=10)
    assert plan.row_wise_tables() == [] and sorted(plan.table_rank) == [0, 1, 2]
