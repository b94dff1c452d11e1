"""A sharded run's table init (`ShardedSparseArch`): each rank draws only the init chunks its rows lie in, and the
shards together are exactly the one-process tables of the same seed.

Before: every rank drew every table in full on its device and kept its slice (a 2M-row table's rank held its shard
plus the whole table, 3x the shard), so a table larger than one GPU could not be sharded at all."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from dlrm.distributed.sharded_embedding import ShardedSparseArch
from dlrm.distributed.sharding import plan_sharding
from dlrm.model.archs import SparseArch
from kernels.table_layout import INIT_CHUNK_ROWS, init_bound, table_offsets

# tables across chunk boundaries (a row-wise block of 3 ranks starts inside a chunk), a one-row table, and
# one of exactly two chunks
CARDS = [3, 2 * INIT_CHUNK_ROWS + 5, 1, 2 * INIT_CHUNK_ROWS, 11]
DIM = 3


def _one_process(cards, dim, **kw):
    torch.manual_seed(7)
    weight = SparseArch(cards, dim, **kw).weight.detach()
    return weight, torch.rand(4)  # and the RNG stream after the tables: the OverArch's init draws from it


@pytest.mark.parametrize("mode, world", [("row", 3), ("table", 2), ("auto", 3), ("row", 7)])
def test_shards_together_are_the_one_process_tables(mode, world):
    full, after = _one_process(CARDS, DIM)
    offsets = table_offsets(CARDS)
    plan = plan_sharding(CARDS, world, mode, row_wise_min_rows=100, balance="lookups")
    covered = torch.zeros(sum(CARDS), dtype=torch.int64)
    for rank in range(world):
        torch.manual_seed(7)
        arch = ShardedSparseArch(CARDS, DIM, plan, rank)
        # the same one draw from the RNG as one process, also on a rank with no rows of some table
        assert torch.equal(torch.rand(4), after), rank
        for f, start, count, at in plan.local_layout(rank):
            rows = slice(offsets[f] + start, offsets[f] + start + count)
            torch.testing.assert_close(arch.weight.detach()[at : at + count], full[rows], rtol=0, atol=0)
            covered[rows] += 1
    assert covered.eq(1).all()  # the shards are the whole tables, each row once


def test_every_one_process_arch_draws_the_same_tables():
    """The eager, fused-update, pooled and Triton arches share the init (a checkpoint moves between them, and a
    sharded Triton run must start where a one-process eager one does)."""
    from dlrm.model.fused_sparse import FusedUpdateSparseArch
    from dlrm.model.pooled_sparse import PooledSparseArch
    from kernels.embedding import TritonPooledEmbedding, TritonSparseEmbedding

    cards = [5, INIT_CHUNK_ROWS + 2, 1]
    full, after = _one_process(cards, 2)
    for build in (lambda: FusedUpdateSparseArch(cards, 2), lambda: PooledSparseArch(cards, [2, 1, 3], 2),
                  lambda: TritonSparseEmbedding(cards, 2), lambda: TritonPooledEmbedding(cards, [2, 1, 3], 2)):
        torch.manual_seed(7)
        weight = build().weight.detach()
        assert torch.equal(weight, full) and torch.equal(torch.rand(4), after)


def test_bf16_triton_shards_are_the_one_process_bf16_tables():
    """bf16 shards draw in bf16 as the one-process bf16 table does (not the fp32 draw rounded)."""
    from kernels.embedding import TritonSparseEmbedding

    cards = [INIT_CHUNK_ROWS + 9, 4]
    torch.manual_seed(3)
    full = TritonSparseEmbedding(cards, 2, dtype=torch.bfloat16).weight.detach()
    plan = plan_sharding(cards, 2, "row", row_wise_min_rows=1, balance="lookups")
    got = []
    for rank in range(2):
        torch.manual_seed(3)
        arch = ShardedSparseArch(cards, 2, plan, rank, kernel="triton", dtype=torch.bfloat16)
        assert arch.weight.dtype == torch.bfloat16
        got.append({(f, start): arch.weight.detach()[at : at + count] for f, start, count, at in plan.local_layout(rank)})
    offsets = table_offsets(cards)
    for f, n in enumerate(cards):
        blocks = sorted((start, w) for part in got for (g, start), w in part.items() if g == f)
        assert torch.equal(torch.cat([w for _, w in blocks]), full[offsets[f] : offsets[f] + n])
        assert float(full[offsets[f] : offsets[f] + n].float().abs().max()) <= init_bound(n) * (1 + 2**-8)


def _peak_bytes_allocated(build, trace) -> int:
    """The most CPU memory held at once by the tensors `build()` allocates (torch's profiler, whose memory events
    carry the running total of the allocations it tracks)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        kept = build()
    prof.export_chrome_trace(str(trace))
    opener = gzip.open if str(trace).endswith(".gz") else open
    with opener(trace, "rt") as f:
        events = [e["args"] for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"]
    assert events, "the profiler recorded no memory events"
    base = events[0]["Total Allocated"] - events[0]["Bytes"]  # what was held before (an earlier profile's leftovers)
    del kept
    return max(e["Total Allocated"] for e in events) - base


def test_a_rank_holds_its_shard_not_the_table_while_it_draws(tmp_path):
    """2M rows x 16 on 2 ranks, row-wise: a rank's init holds its 1M-row shard and one init chunk at most (it used to
    hold the whole 2M-row table as well)."""
    rows, dim = 2_000_000, 16
    plan = plan_sharding([rows], 2, "row", row_wise_min_rows=1, balance="lookups")
    for rank in range(2):
        shard_bytes = plan.local_rows(rank) * dim * 4
        chunk_bytes = INIT_CHUNK_ROWS * dim * 4
        peak = _peak_bytes_allocated(lambda: ShardedSparseArch([rows], dim, plan, rank), tmp_path / f"r{rank}.json")
        assert shard_bytes <= peak <= shard_bytes + chunk_bytes + 2**20, (rank, peak, shard_bytes)
