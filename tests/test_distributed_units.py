"""The sharding plan, the ranks' slices of a batch and a one-hot Triton shard, as units (no process group): moved
out of tests/test_distributed.py (its multi-process runs), which had grown past the 600-line limit."""

import pytest
import torch

from dlrm.config import ConfigError
from dlrm.data.loader import batches_per_epoch, rank_rows, rank_slice
from dlrm.distributed.checkpoint import assemble
from dlrm.distributed.sharding import MASKED_SLOT_COST, SENT_FEATURE_COST, plan_cost, plan_sharding


@pytest.mark.parametrize("world", [1, 2, 3, 7])
@pytest.mark.parametrize("lo,hi", [(0, 23), (5, 7), (0, 1), (10, 10 + 64)])
def test_rank_slices_concatenate_to_the_global_batch(world, lo, hi):
    slices = [rank_slice(lo, hi, r, world) for r in range(world)]
    assert slices[0][0] == lo and slices[-1][1] == hi
    assert all(a[1] == b[0] for a, b in zip(slices, slices[1:]))
    sizes = [b - a for a, b in slices]
    assert max(sizes) == -(-(hi - lo) // world) and sizes == sorted(sizes, reverse=True)
    assert min(sizes) >= max(sizes) - 1  # no rank empty while the batch has a row for each (NaN mean loss)


def test_last_batch_smaller_than_world_is_dropped():
    assert batches_per_epoch(47, 23, False, world_size=1) == 3
    assert batches_per_epoch(47, 23, False, world_size=2) == 2  # 1 row left, 2 ranks
    assert batches_per_epoch(48, 23, False, world_size=2) == 3
    assert batches_per_epoch(48, 23, True, world_size=2) == 2
    # an evaluation keeps it (pad_ranks): the rank without a row gets a padding row
    assert batches_per_epoch(47, 23, False, world_size=2, pad_ranks=True) == 3
    assert batches_per_epoch(46, 23, False, world_size=2, pad_ranks=True) == 2
    assert batches_per_epoch(47, 23, True, world_size=2, pad_ranks=True) == 2


@pytest.mark.parametrize("world", [1, 2, 3, 7])
@pytest.mark.parametrize("lo,hi", [(0, 23), (5, 7), (0, 1), (10, 10 + 64)])
def test_rank_rows_pad_only_the_ranks_left_empty(world, lo, hi):
    rows = [rank_rows(lo, hi, r, world, pad_ranks=True) for r in range(world)]
    for r, (a, b, pad) in enumerate(rows):
        if (a, b) == rank_slice(lo, hi, r, world):
            assert pad == 0
        else:  # an empty slice: one padding row, the batch's last
            assert rank_slice(lo, hi, r, world)[0] == rank_slice(lo, hi, r, world)[1] and (a, b, pad) == (hi - 1, hi, 1)
    real = [(a, b) for a, b, pad in rows if not pad]
    assert real == [rank_slice(lo, hi, r, world) for r in range(len(real))]  # the real rows are rank_slice's
    assert all(pad for *_, pad in rows[len(real):])  # the padded ranks are the last ones
    assert all(b - a == 1 for a, b, pad in rows if pad) and sum(pad for *_, pad in rows) == max(0, world - (hi - lo))
    assert [rank_rows(lo, hi, r, world, pad_ranks=False) for r in range(world)] == [(*s, 0) for s in
                                                                                    (rank_slice(lo, hi, r, world)
                                                                                     for r in range(world))]


@pytest.mark.parametrize("mode", ["table", "row", "auto"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_plan_covers_every_row_once(mode, world):
    cards = [1, 2, 5, 11, 100, 7, 3000, 2]
    plan = plan_sharding(cards, world, mode, row_wise_min_rows=100, balance="lookups")  # auto: the threshold
    owners = [torch.zeros(n, dtype=torch.int64) for n in cards]
    for q in range(world):
        for f, start, count, _ in plan.local_layout(q):
            owners[f][start : start + count] += 1
    assert all(bool((o == 1).all()) for o in owners)
    assert plan.row_wise_tables() == {"table": [], "row": list(range(len(cards))), "auto": [4, 6]}[mode]
    # the merge of local shards is the full tensor
    full = torch.arange(sum(cards) * 2, dtype=torch.float32).view(-1, 2)
    offs = torch.tensor([0] + cards).cumsum(0)
    locals_ = [torch.cat([full[offs[f] + s : offs[f] + s + c] for f, s, c, _ in plan.local_layout(q)]) for q in range(world)]
    assert torch.equal(assemble(plan, locals_), full)


def test_table_wise_balances_rows():
    plan = plan_sharding([100, 90, 10, 10, 5, 5], 2, "table", 10**9, balance="rows")
    assert sorted(plan.local_rows(q) for q in range(2)) == [110, 110]


def test_table_wise_balances_lookups_then_rows():
    """Lookups a sample per rank even (multi-hot sizes counted), ties to fewer rows; a row-wise table counts 1/W
    of its lookups and rows on every rank ("lookups": every table of row_wise_min_rows rows or more row-wise)."""
    cards, hot = [100, 90, 10, 10, 5, 1000], [1, 1, 8, 2, 5, 12]
    plan = plan_sharding(cards, 2, "auto", 1000, hot, balance="lookups")
    # table 5 row-wise: 6 lookups and 500 rows on each rank; then, most looked-up first: table 2 (8) -> rank 0
    # (tie, rank order), 4 (5) -> 1, 3 (2) -> 1 (11 < 14), 0 (1) -> 1 (13 < 14), 1 (1) -> 0 (14 = 14, 510 < 615 rows)
    assert plan.table_rank == (1, 0, 0, 1, 1, -1)
    assert [plan.lookups(q, hot) for q in range(2)] == [15.0, 14.0]
    assert [plan.local_rows(q) for q in range(2)] == [600, 615]
    rows_plan = plan_sharding(cards, 2, "auto", 1000, hot, balance="rows")
    assert [rows_plan.lookups(q, hot) for q in range(2)] == [6 + 1 + 2, 6 + 1 + 8 + 5]  # tables 0, 3 | 1, 2, 4
    one_hot = plan_sharding([100, 90, 10, 10, 5, 5], 2, "table", 10**9, balance="lookups")
    assert [one_hot.lookups(q) for q in range(2)] == [3, 3]
    assert [one_hot.local_rows(q) for q in range(2)] == [115, 105]
    # "cost": the same cost after a swap that evens the rows (ties go to the fuller rank's rows)
    by_cost = plan_sharding([100, 90, 10, 10, 5, 5], 2, "table", 10**9)
    assert [by_cost.lookups(q) for q in range(2)] == [3, 3] and [by_cost.local_rows(q) for q in range(2)] == [110, 110]


MLPERF_CARDS = [40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209, 11938,
                155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36]
MLPERF_HOT = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]


def _cost(plan, hot):
    """plan_cost written out: the busiest rank's lookups (a row-wise table's masked slots at MASKED_SLOT_COST),
    plus SENT_FEATURE_COST for each pooled feature the rank serving the most sends to the W - 1 others."""
    W = plan.world_size
    lookups = [sum(h * (1 / W + (1 - 1 / W) * MASKED_SLOT_COST) if plan.row_wise(f) else h * (plan.table_rank[f] == q)
                   for f, h in enumerate(hot)) for q in range(W)]
    served = [sum(plan.row_wise(f) or plan.table_rank[f] == q for f in range(len(hot))) for q in range(W)]
    return max(lookups) + SENT_FEATURE_COST * (W - 1) / W * max(served)


@pytest.mark.parametrize("world,row_wise", [(2, []), (4, [20]), (8, [20, 21])])
def test_cost_plan_splits_only_tables_that_lower_the_step_cost(world, row_wise):
    """MLPerf DLRM-DCNv2's tables (five of 40M rows may go row-wise): on two ranks every table whole, on four the
    100-value feature split, on eight the 27-value one too; cheaper than the plan "lookups" keeps (the five split)
    and than "table" or "row" placed as "lookups" places them."""
    plan = plan_sharding(MLPERF_CARDS, world, "auto", 10**7, MLPERF_HOT)
    assert plan.row_wise_tables() == row_wise
    assert plan_cost(plan, MLPERF_HOT) == pytest.approx(_cost(plan, MLPERF_HOT))
    old = plan_sharding(MLPERF_CARDS, world, "auto", 10**7, MLPERF_HOT, balance="lookups")
    assert old.row_wise_tables() == [0, 9, 19, 20, 21]
    for other in (old, *(plan_sharding(MLPERF_CARDS, world, m, 10**7, MLPERF_HOT, balance="lookups")
                         for m in ("table", "row"))):
        assert plan_cost(plan, MLPERF_HOT) < plan_cost(other, MLPERF_HOT)
    if world == 2:  # every table whole: 13 features a rank (113 / 101 lookups) instead of 7 / 19 (107 / 107)
        assert sorted(len(plan.served(q)) for q in range(2)) == [13, 13]
        assert plan_cost(plan, MLPERF_HOT) == pytest.approx(113 + SENT_FEATURE_COST / 2 * 13)
        assert plan_cost(plan_sharding(MLPERF_CARDS, 2, "table", 10**7, MLPERF_HOT, balance="lookups"),
                         MLPERF_HOT) == pytest.approx(107 + SENT_FEATURE_COST / 2 * 19)
    # sharding "row" splits every table, whatever the balance
    assert plan_sharding(MLPERF_CARDS, world, "row", 10**7, MLPERF_HOT).row_wise_tables() == list(range(26))


@pytest.mark.parametrize("seed", range(12))
def test_cost_plan_is_near_the_best_of_every_plan_on_small_cases(seed):
    """Against every placement and every split of the candidates (small cases, enumerated): the chooser (greedy
    placement, then moves and swaps) is within 5% of the least cost, and plan_cost is the cost written out."""
    import itertools
    import random

    from dlrm.distributed.sharding import ShardingPlan

    rng = random.Random(seed)
    F, W = rng.randint(3, 6), rng.choice([2, 3])
    cards = [rng.choice([5, 50, 500, 5000]) for _ in range(F)]
    hot = [rng.choice([1, 1, 2, 3, 10, 40]) for _ in range(F)]
    plan = plan_sharding(cards, W, "auto", 500, hot)
    best = float("inf")
    candidates = [f for f, n in enumerate(cards) if n >= 500]
    for k in range(len(candidates) + 1):
        for split in itertools.combinations(candidates, k):
            whole = [f for f in range(F) if f not in split]
            for ranks in itertools.product(range(W), repeat=len(whole)):
                table_rank = [-1] * F
                for f, q in zip(whole, ranks):
                    table_rank[f] = q
                best = min(best, _cost(ShardingPlan(W, tuple(cards), tuple(table_rank)), hot))
    assert plan_cost(plan, hot) == pytest.approx(_cost(plan, hot))
    assert best - 1e-9 <= plan_cost(plan, hot) <= 1.05 * best


def test_cost_plan_ties_go_to_fewer_splits_and_many_candidates_are_tried_nested():
    # one-hot, two ranks: splitting never pays (a split table is looked up and sent by both ranks)
    plan = plan_sharding([50, 60, 70, 80], 2, "auto", 10)
    assert plan.row_wise_tables() == [] and plan_cost(plan) == pytest.approx(2 + SENT_FEATURE_COST / 2 * 2)
    # 12 candidates (over EXHAUSTIVE_CANDIDATES): the nested subsets. Whole, the 40-value feature and five
    # one-value ones on a rank cost 45 + 6 sent; split, 26.7 + 6 lookups and 1 + 6 sent; two split, 27.3 + 5 and 2 + 5
    hot = [40] + [1] * 11
    plan = plan_sharding([100] * 12, 2, "auto", 10, hot)
    assert plan.row_wise_tables() == [0, 1]
    assert plan_cost(plan, hot) == pytest.approx(41 * (1 / 2 + 1 / 6) + 5 + SENT_FEATURE_COST / 2 * 7)


def test_cost_plan_fits_the_memory_or_says_what_does_not():
    cards = [1000, 10, 10, 10]
    # whole, the 1000-row table fits no rank of 600 bytes (1 byte a row): split, 500 rows a rank
    plan = plan_sharding(cards, 2, "auto", 100, row_bytes=1, memory_per_rank=600)
    assert plan.row_wise_tables() == [0] and max(plan.local_rows(q) for q in range(2)) <= 600
    assert plan_sharding(cards, 2, "auto", 100).row_wise_tables() == []  # no limit: whole is cheaper (2 < 2.67)
    with pytest.raises(ConfigError, match=r"sharding 'table': the tables \(1,030 rows of 1 bytes.*'auto' or 'row'"):
        plan_sharding(cards, 2, "table", 100, row_bytes=1, memory_per_rank=600)
    with pytest.raises(ConfigError, match="do not fit 2 ranks.*use more GPUs"):
        plan_sharding(cards, 2, "auto", 100, row_bytes=1, memory_per_rank=400)
    # "lookups" and "rows" keep their plans whatever the memory
    assert plan_sharding(cards, 2, "table", 100, balance="lookups", row_bytes=1, memory_per_rank=600).table_rank[0] >= 0


def test_run_plans_within_the_smallest_gpu_memory(monkeypatch):
    """make_sharding gives plan_sharding each row's bytes (weight and optimizer state) and 75% of the smallest
    GPU's memory, gathered from every rank: with room for it whole, MLPerf's 100-value table stays whole on two
    ranks; on smaller GPUs the cheapest split that fits; smaller still, a clear error."""
    from types import SimpleNamespace

    from dlrm.config import Config, validate
    from dlrm.distributed.env import DistEnv
    from dlrm.train import builder
    from dlrm.train.setup import Tables

    cfg = validate(Config())
    cfg.model.embedding_dim, cfg.model.embedding_dtype = 128, "bf16"  # rowwise_adagrad: 2 * 128 + 4 bytes a row
    tables = Tables(MLPERF_CARDS, None, "modulus", MLPERF_HOT)
    gathered = []

    class TwoRanks(DistEnv):
        def all_gather_object(self, obj):
            gathered.append(obj)
            return [obj, memory[0]]  # the other rank's GPU

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=memory[1]))
    env, cuda = TwoRanks(rank=0, world_size=2), torch.device("cuda", 0)
    memory = [80 * 10**9, 141 * 10**9]
    assert builder.make_sharding(cfg, tables, env, cuda).row_wise_tables() == []
    assert gathered == [141 * 10**9]
    memory = [40 * 10**9, 141 * 10**9]  # 30 GB for tables, 53 GB in all: the whole plan (32.3 GB) does not fit
    plan = builder.make_sharding(cfg, tables, env, cuda)
    assert plan.row_wise_tables() == [9]  # the cheapest split that fits: one 40M-row table of 7 values
    assert max(plan.local_rows(q) for q in range(2)) * 260 <= 30 * 10**9
    memory = [4 * 10**9, 4 * 10**9]
    with pytest.raises(ConfigError, match=r"do not fit 2 ranks of 3,000,000,000 bytes .*use more GPUs"):
        builder.make_sharding(cfg, tables, env, cuda)
    assert builder.make_sharding(cfg, tables, env, torch.device("cpu")).row_wise_tables() == []  # no limit


def test_plan_rejects_bad_balance_and_hotness():
    with pytest.raises(ConfigError, match=r"distributed.balance: 'memory' is not one of 'cost' \| 'lookups' \| 'rows'"):
        plan_sharding([3, 4], 2, "table", 10, balance="memory")
    with pytest.raises(ConfigError, match="multi-hot sizes: 1 values for 2 tables"):
        plan_sharding([3, 4], 2, "table", 10, [2])


@pytest.mark.parametrize("deterministic", [True, False])
def test_one_hot_shard_looks_up_and_updates_per_served_feature(deterministic):
    """A one-hot Triton shard is one table a served feature (so the update runs one feature a program): its local
    lookup gives each valid slot's row and zeros for masked ones, and SGD changes exactly the rows looked up, by
    the float64 sums of their gradients, whatever rows the masked lookups were pointed at."""
    from dlrm.distributed.sharded_embedding import ShardedSparseArch
    from kernels.embedding import SparseOptimizerConfig

    cards = [3, 1, 40, 2]  # a 1-row table split over 3 ranks leaves rank 2 an empty block
    plan = plan_sharding(cards, 3, "auto", 40, balance="lookups")  # the 40-row table row-wise; "row": all
    row_plan = plan_sharding(cards, 3, "row", 40)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        for plan_, rank in ((plan, 0), (plan, 2), (row_plan, 2)):
            arch = ShardedSparseArch(cards, 4, plan_, rank, kernel="triton")
            local = arch.__dict__["_triton"]
            layout = plan_.local_layout(rank)
            assert local.cardinality_list == [max(count, 1) for _, _, count, _ in layout]
            assert local.offsets.tolist() == [at if count else 0 for _, _, count, at in layout]
            W, P, S = 3, 5, len(layout)
            counts = torch.tensor([count for _, _, count, _ in layout])
            at = torch.tensor([a for _, _, _, a in layout])
            base = torch.tensor([start for _, start, _, _ in layout])
            t = (torch.rand(W, P, S) * (counts + 2)).long() - 1  # -1 and count: outside the block
            valid = (t >= 0) & (t < counts)
            local_rows = torch.where(valid, t + at, torch.zeros_like(t))
            lr = torch.tensor([0.5])
            arch.use_fused_update(SparseOptimizerConfig("sgd", lr, deterministic=deterministic))
            before = arch.weight.detach().clone().double()
            emb = arch._lookup((base + t).to(arch.weight.device))  # the table rows the other ranks sent
            expect = before[local_rows] * valid.unsqueeze(-1)
            torch.testing.assert_close(emb.double(), expect, rtol=0, atol=0)
            grad = torch.randn(W, P, S, 4)
            emb.backward(grad)
            step = torch.zeros_like(before).index_add_(0, local_rows[valid], grad.double()[valid])
            torch.testing.assert_close(arch.weight.detach().double(), before - 0.5 * step, rtol=1e-6, atol=1e-6)
            untouched = torch.ones(len(before), dtype=torch.bool)
            untouched[local_rows[valid]] = False
            assert torch.equal(arch.weight.detach().double()[untouched], before[untouched])


def test_plan_rejects_bad_mode():
    with pytest.raises(ConfigError, match="distributed.sharding: 'rows'"):
        plan_sharding([3], 2, "rows", 10)
