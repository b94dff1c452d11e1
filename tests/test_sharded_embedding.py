"""ShardedSparseArch element by element against the one-process SparseArch in float64: forward
output and the embedding gradient on every owner, 3 gloo processes, table-wise, row-wise and mixed
sharding, modulus and vocabulary hashing, global batches of 1, 3 and 127 (ranks with empty slices
included), a non-contiguous input and a non-contiguous upstream gradient."""


import torch

from dlrm.data.loader import rank_slice
from dlrm.distributed.sharded_embedding import ShardedSparseArch
from dlrm.distributed.sharding import plan_sharding
from dlrm.model.archs import SparseArch
from tests.fastdist_ranks import failures_on_ranks

WORLD = 3
CARDS = [1, 2, 5, 11, 40, 7]  # F = 6 tables, some smaller than the world
DIM = 3


def _case(global_batch: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(-1, 2**32, (len(CARDS), global_batch), generator=g).t()  # non-contiguous [B, F]
    grad = torch.randn(DIM, global_batch, len(CARDS), generator=g, dtype=torch.float64).permute(1, 2, 0)  # [B, F, D]
    vocabs = [torch.unique(torch.randint(0, 2**32, (n - 1,), generator=g)) for n in CARDS]
    vocabs = [torch.cat([v, torch.arange(n - 1 - len(v)) + 2**33]) if len(v) < n - 1 else v for v, n in zip(vocabs, CARDS)]
    raw[::2, 1] = vocabs[1][0] if len(vocabs[1]) else raw[::2, 1]  # some in-vocabulary hits
    return raw, grad, [v.sort().values for v in vocabs]


CASES = [(mode, hashing, batch) for mode in ("table", "row", "auto") for hashing in ("modulus", "vocabulary")
         for batch in (1, 3, 127)]


def _check_case(rank: int, mode: str, hashing: str, global_batch: int) -> None:
    raw, grad, vocabs = _case(global_batch, seed=global_batch)
    vocabs = vocabs if hashing == "vocabulary" else None
    plan = plan_sharding(CARDS, WORLD, mode, row_wise_min_rows=10, balance="lookups")  # auto: mixed
    torch.manual_seed(0)
    arch = ShardedSparseArch(CARDS, DIM, plan, rank, vocabs).double()
    torch.manual_seed(0)
    full = SparseArch(CARDS, DIM, vocabs).double()
    offsets = [0]
    for n in CARDS[:-1]:
        offsets.append(offsets[-1] + n)
    # the same initial rows as the full weight
    for f, start, count, at in plan.local_layout(rank):
        torch.testing.assert_close(arch.weight.detach()[at : at + count],
                                   full.weight.detach()[offsets[f] + start : offsets[f] + start + count], rtol=0, atol=0)
    a, b = rank_slice(0, global_batch, rank, WORLD)
    out = arch(raw[a:b], global_batch)
    ref = full(raw)
    torch.testing.assert_close(out, ref[a:b], rtol=0, atol=0)
    with torch.no_grad():  # without the global batch size the ranks agree on the padding themselves
        torch.testing.assert_close(arch(raw[a:b]), ref[a:b], rtol=0, atol=0)
    (out * grad[a:b]).sum().backward()
    (ref * grad).sum().backward()
    mine = arch.weight.grad.coalesce().to_dense() * WORLD  # the 1/W share of the global mean's gradient
    want = full.weight.grad.coalesce().to_dense()
    for f, start, count, at in plan.local_layout(rank):
        torch.testing.assert_close(mine[at : at + count], want[offsets[f] + start : offsets[f] + start + count],
                                   rtol=1e-12, atol=1e-12)


def test_sharded_lookup_and_gradients_equal_one_process(tmp_path):
    failed = failures_on_ranks(_check_case, CASES, WORLD, tmp_path)
    assert not failed, failed
