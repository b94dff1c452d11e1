"""`dlrm.distributed.owner_exchange.PooledLookupExchange`: a multi-hot Triton shard's lookup, exchange and fused
update as one autograd node whose backward sorts while the gradients travel, against the path it replaces (the
shard's fused lookup, then the differentiable all_to_all): the same outputs and the same updated tables, state and
rounding seed, bit for bit, on two gloo ranks (CPU, Triton interpreter) and, where two GPUs are, on two NCCL ranks
(the compiled kernels; there SGD's atomic update adds in a run-dependent order, so it is compared to fp32 rounding)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dlrm.data.loader import rank_slice
from dlrm.distributed import sharded_embedding
from dlrm.distributed.sharded_embedding import ShardedSparseArch
from dlrm.distributed.sharding import plan_sharding
from kernels.embedding import PAD_SPARSE, SparseOptimizerConfig
from tests.shared_once import computed_once
from tests.fastdist_ranks import failures_on_ranks  # ranks served by the prewarmed interpreter, not spawned

# The pooled kernels under the interpreter (gloo ranks), also on the GPU machine: its image's Triton 3.6 interpreter runs
# them since `kernels._interpreter` fixed its scalar loop bounds under NumPy 2.4 (until 2026-12-01 they were skipped there).

WORLD = 2
CARDS = [1, 3, 6, 40, 9]
HOTNESS = [2, 1, 3, 4, 1]
DIM = 5
# (sharding, table dtype, optimizer, deterministic, weight decay, global batch): the sorted update with and without
# rounding and decay, and SGD's atomic update (no sort to move); 37 rows: the last rank's slice padded
CASES = [("table", torch.bfloat16, "rowwise_adagrad", True, 0.0, 37),
         ("row", torch.bfloat16, "rowwise_adagrad", True, 0.0, 37),
         ("row", torch.float32, "adagrad", True, 0.1, 37),
         ("table", torch.float32, "sgd", False, 0.0, 36)]


def _raw(batch: int, step: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(11 + step)
    raw = torch.randint(-1, 2**32, (batch, sum(HOTNESS)), generator=g)
    raw[torch.rand(raw.shape, generator=g) < 0.3] = 7  # repeated rows
    raw[torch.rand(raw.shape, generator=g) < 0.2] = PAD_SPARSE
    return raw.to(device)


def _graph_has(t: torch.Tensor, name: str) -> bool:
    seen, todo = set(), [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if name in type(fn).__name__:
            return True
        todo.extend(f for f, _ in fn.next_functions)
    return False


def _case(rank: int, mode: str, dtype: torch.dtype, kind: str, deterministic: bool, decay: float, batch: int) -> None:
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    plan = plan_sharding(CARDS, WORLD, mode, row_wise_min_rows=5, balance="lookups")
    arches = []
    for _ in range(2):  # the new path, then the old one: the same init (same seed)
        torch.manual_seed(0)
        with device:
            arch = ShardedSparseArch(CARDS, DIM, plan, rank, kernel="triton", hotness=HOTNESS, dtype=dtype)
        arch.__dict__["_triton"].use_fused_update(SparseOptimizerConfig(
            kind, torch.tensor([0.05], device=device), deterministic=deterministic, weight_decay=decay))
        arches.append(arch)
    start = arches[0].weight.detach().clone()
    a, b = rank_slice(0, batch, rank, WORLD)
    taken = sharded_embedding.takes_fused_path
    for step in range(2):
        raw = _raw(batch, step, device)
        grad = torch.randn(batch, len(CARDS), DIM, generator=torch.Generator().manual_seed(step)).to(device)
        outs = []
        for i, arch in enumerate(arches):
            sharded_embedding.takes_fused_path = taken if i == 0 else (lambda local: False)
            try:
                out = arch(raw[a:b], batch)
            finally:
                sharded_embedding.takes_fused_path = taken
            assert _graph_has(out, "PooledLookupExchange") == (i == 0)
            # a non-contiguous gradient: the exchange makes it contiguous
            (out.float() * grad[a:b].float().transpose(0, 1).contiguous().transpose(0, 1) * WORLD).sum().backward()
            outs.append(out.detach())
        new, old = arches
        if deterministic or device.type == "cpu":
            assert torch.equal(outs[0], outs[1]), f"step {step}: outputs differ"
            assert torch.equal(new.weight.detach(), old.weight.detach()), f"step {step}: tables differ"
        else:  # SGD's atomic adds on a GPU: each run adds a row's gradients in its own order (fp32 rounding)
            torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-7, msg=f"step {step}: outputs differ")
            torch.testing.assert_close(new.weight.detach(), old.weight.detach(), rtol=1e-6, atol=1e-7,
                                       msg=f"step {step}: tables differ")
        s_new, s_old = (x.__dict__["_triton"].fused_update.state for x in arches)
        assert (s_new is None) == (s_old is None) and (s_new is None or torch.equal(s_new, s_old))
        assert int(new.__dict__["_triton"].sr_seed) == int(old.__dict__["_triton"].sr_seed)
    assert not torch.equal(arches[0].weight.detach(), start), "the updates moved no row"


def _fails_on_rank_one(rank: int, value: int) -> None:
    dist.barrier()  # a collective, as the real checks have
    assert rank != 1, f"rank 1 fails case {value}"


HARNESS_CASES = [(3,), (4,)]


def _check(rank: int, *case) -> None:
    """A case of CASES (`_case`) or of HARNESS_CASES (`_fails_on_rank_one`), told apart by their first value."""
    (_fails_on_rank_one if isinstance(case[0], int) else _case)(rank, *case)


@pytest.fixture(scope="module")
def cpu_failures(tmp_path_factory) -> dict:
    """The failures of HARNESS_CASES and CASES, run in one start of the two gloo ranks for the test run (starting the
    ranks, their torch import and the Manager, was ~2.5 s a test, 2026-12-01), shared by the workers
    (`tests.shared_once`): ``{(rank, str(case)): message}``. The harness's cases first, so that a broken exchange
    case cannot leave them collectives out of step."""
    import json

    def make(d):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TRITON_INTERPRET", "1")
            failed = failures_on_ranks(_check, [*HARNESS_CASES, *CASES], WORLD, d)
        (d / "failed.json").write_text(json.dumps([[rank, case, message] for (rank, case), message in failed.items()]))

    root = computed_once(tmp_path_factory, "owner-exchange", make)
    return {(rank, case): message for rank, case, message in json.loads((root / "failed.json").read_text())}


def _of(failed: dict, cases) -> dict:
    return {k: v for k, v in failed.items() if k[1] in {str(c) for c in cases}}


def test_lookup_exchange_node_equals_the_fused_lookup_and_all_to_all(cpu_failures):
    failed = _of(cpu_failures, CASES)
    assert not failed, failed


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_lookup_exchange_node_on_two_gpus(tmp_path):
    """The same comparison on two NCCL ranks, the kernels compiled."""
    failed = failures_on_ranks(_case, CASES, WORLD, tmp_path, backend="nccl")
    assert not failed, failed


def test_failures_on_ranks_reports_each_failing_rank_and_case(cpu_failures):
    """The harness above: a failing assertion on one rank comes back with its rank, case and message (and the
    cases that passed, on either rank, do not)."""
    assert _of(cpu_failures, HARNESS_CASES) == {(1, "(3,)"): "AssertionError: rank 1 fails case 3",
                                                (1, "(4,)"): "AssertionError: rank 1 fails case 4"}
