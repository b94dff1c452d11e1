"""Three gloo ranks against one process, element by element: the `DistEnv` collectives (rank order, uneven and empty
row counts), a sharded SparseArch when there are more ranks than tables (a rank serving none, empty row-wise
blocks), and the parts of a run as `dlrm.train.builder.build_run` makes them (sharded tables, the DDP wrapper of
the dense parts, each rank's loss share) trained on global batches that split unevenly, then evaluated."""

from __future__ import annotations

import pytest
import torch

from dlrm.config import Config, validate
from dlrm.data.batch import Batch
from dlrm.data.loader import rank_rows, rank_slice
from dlrm.distributed.env import DistEnv
from dlrm.distributed.sharded_embedding import ShardedSparseArch
from dlrm.distributed.sharding import plan_sharding
from dlrm.model.archs import SparseArch
from tests.fastdist_ranks import failures_on_ranks

WORLD = 3


def _rows(q: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank q's rows for all_gather_rows: n rows that name their rank and position."""
    t = torch.arange(n * 2, dtype=torch.float64).view(n, 2) + 100 * (q + 1)
    return t.to(dtype)


def _check_env(rank: int, sizes: tuple[int, ...]) -> None:
    env = DistEnv(rank, WORLD)
    for dtype in (torch.float32, torch.int64):
        got = env.all_gather_rows(_rows(rank, sizes[rank], dtype))
        want = torch.cat([_rows(q, n, dtype) for q, n in enumerate(sizes)])
        assert got.dtype == dtype and torch.equal(got, want), (dtype, got, want)
        flat = env.all_gather_rows(_rows(rank, sizes[rank], dtype)[:, 0])  # 1-D, as logits and labels
        assert torch.equal(flat, want[:, 0])
    t = torch.tensor([rank + 1.0, -rank])
    assert env.all_reduce_sum(t) is t and t.tolist() == [6.0, -3.0]
    t = torch.tensor([rank - 1, 5 - rank])  # e.g. a first NaN step: -1 (none) on rank 0, 0 on 1, 1 on 2
    assert env.all_reduce_max(t) is t and t.tolist() == [1, 5]
    assert env.broadcast_object({"rank": rank}) == {"rank": 0}
    assert env.all_gather_object(("r", rank)) == [("r", q) for q in range(WORLD)]


ENV_CASES = [("env", (3, 2, 2)), ("env", (0, 5, 1)), ("env", (1, 0, 0))]


def test_env_collectives_on_three_ranks(three_ranks):
    """all_gather_rows is every rank's rows in rank order (row counts uneven, one rank empty: no padding left
    in); the reductions, the broadcast from rank 0 and the object gather."""
    assert not three_ranks(ENV_CASES)


def test_env_of_one_process_is_a_no_op():
    env = DistEnv()
    t = torch.tensor([1.0, 2.0])
    assert not env.distributed and env.is_main
    assert env.all_gather_rows(t) is t and env.all_reduce_sum(t) is t and env.all_reduce_max(t) is t
    assert t.tolist() == [1.0, 2.0] and env.broadcast_object(3) == 3 and env.all_gather_object(3) == [3]
    env.barrier()


def test_init_distributed_reads_the_launch(monkeypatch):
    """torchrun's environment: one process without WORLD_SIZE > 1; the global RANK and the node's LOCAL_RANK kept
    apart (rank 5 of 8 is local rank 1 on its node); a missing RANK or MASTER_ADDR, or NCCL on the CPU, refused.
    (The process group is taken as joined: nothing here starts one.)"""
    import torch.distributed as dist

    from dlrm.config import ConfigError, DistributedConfig
    from dlrm.distributed.env import init_distributed

    cpu = torch.device("cpu")
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(key, raising=False)
    assert init_distributed(DistributedConfig(), cpu) == (DistEnv(), cpu)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert init_distributed(DistributedConfig(), cpu) == (DistEnv(), cpu)
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(ConfigError, match="WORLD_SIZE is 8 but RANK / MASTER_ADDR are not set.*torchrun"):
        init_distributed(DistributedConfig(), cpu)
    monkeypatch.setenv("RANK", "5")
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        init_distributed(DistributedConfig(), cpu)
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    env, device = init_distributed(DistributedConfig(), cpu)
    assert env == DistEnv(rank=5, world_size=8, local_rank=1) and device == cpu
    assert env.distributed and not env.is_main
    with pytest.raises(ConfigError, match="'nccl' needs CUDA devices"):
        init_distributed(DistributedConfig(backend="nccl"), cpu)


# ------------------------------------------------------------------------------------------
# the sharded lookup: more ranks than tables, multi-hot tables, the Triton shards

FEW_CARDS = [1, 40]  # "table": rank 2 serves no table; "row": the 1-row table leaves ranks 1 and 2 empty blocks
CARDS = [3, 50, 7, 20, 11]
HOTNESS = [2, 1, 3, 1, 2]


def _check_lookup(rank: int, cards: tuple[int, ...], hotness, kernel: str, mode: str, global_batch: int,
                  hashing: str = "modulus") -> None:
    """The sharded lookup of a global batch split over the ranks, and the owners' embedding gradients (the
    torch kernel's sparse gradient, or the Triton kernel's fused SGD update), element by element against one
    process: `SparseArch`, or `PooledSparseArch` when multi-hot (empty slots, PAD, included)."""
    from dlrm.model.pooled_sparse import PooledSparseArch
    from kernels.embedding import PAD_SPARSE, SparseOptimizerConfig

    cards, D, lr = list(cards), 3, 0.5
    plan = plan_sharding(cards, WORLD, mode, row_wise_min_rows=15, balance="lookups")
    if cards == FEW_CARDS and mode == "table":
        assert plan.served(2) == [] and plan.local_rows(2) == 0
    g = torch.Generator().manual_seed(global_batch)
    vocabs = None  # vocabulary hashing: n - 1 known values a table (row 0: the unknown ones)
    if hashing == "vocabulary":
        vocabs = [torch.randperm(60, generator=g)[: n - 1].sort().values for n in cards]
    torch.manual_seed(0)
    arch = ShardedSparseArch(cards, D, plan, rank, vocabs, kernel=kernel, hotness=hotness)
    torch.manual_seed(0)
    full = SparseArch(cards, D, vocabs) if hotness is None else PooledSparseArch(cards, hotness, D, vocabs)
    if kernel == "torch":
        arch, full = arch.double(), full.double()
    else:
        arch.use_fused_update(SparseOptimizerConfig("sgd", torch.tensor([lr])))
    start = arch.weight.detach().clone()
    high = 60 if vocabs is not None else 2**32  # vocabulary: values below 60, known ones and unknown ones
    raw = torch.randint(-1, high, (global_batch, len(cards) if hotness is None else sum(hotness)), generator=g)
    raw[torch.rand(raw.shape, generator=g) < 0.3] = 5  # rows looked up several times
    if hotness is not None:
        raw[torch.rand(raw.shape, generator=g) < 0.25] = PAD_SPARSE
    grad = torch.randn(global_batch, len(cards), D, generator=g, dtype=full.weight.dtype)
    a, b = rank_slice(0, global_batch, rank, WORLD)
    out = arch(raw[a:b], global_batch)
    ref = full(raw)
    exact = kernel == "torch"  # float64 sums; the Triton shard's in fp32
    torch.testing.assert_close(out, ref[a:b], rtol=0 if exact else 1e-6, atol=0 if exact else 1e-7)
    (out * grad[a:b] * WORLD).sum().backward()  # every rank's backward all_to_all, the empty rank's too
    (ref * grad).sum().backward()
    want = full.weight.grad.coalesce().to_dense()
    offsets = [sum(cards[:f]) for f in range(len(cards))]
    if kernel == "torch":
        mine = torch.zeros_like(start) if arch.weight.grad is None else arch.weight.grad.coalesce().to_dense()
    else:  # the update applied in the backward: lr times the gradient
        mine = (start - arch.weight.detach()) / lr
    for f, s, count, at in plan.local_layout(rank):
        torch.testing.assert_close(mine[at : at + count], want[offsets[f] + s : offsets[f] + s + count],
                                   rtol=1e-12 if exact else 1e-5, atol=1e-12 if exact else 1e-6, msg=f"table {f}")


# global batches of 7 (3, 2, 2 rows a rank), 3 (one each) and 2 (none for rank 2: what an evaluation's last batch
# would give; the lookup supports it, though the loaders drop such batches)
LOOKUP_CASES = [("lookup", tuple(FEW_CARDS), None, "torch", mode, batch)
                for mode in ("table", "row") for batch in (2, 7)]
LOOKUP_CASES += [("lookup", tuple(CARDS), tuple(HOTNESS), "torch", mode, 7) for mode in ("table", "row", "auto")]
LOOKUP_CASES += [("lookup", tuple(CARDS), tuple(HOTNESS), "torch", "auto", 3)]
LOOKUP_CASES += [("lookup", tuple(CARDS), hot, "torch", "auto", 7, "vocabulary") for hot in (None, tuple(HOTNESS))]
LOOKUP_CASES += [("lookup", tuple(CARDS), None, "triton", "auto", batch) for batch in (7, 2)]


def test_sharded_lookup_on_three_ranks_equals_one_process(three_ranks):
    """More ranks than tables (a rank serving none, empty row-wise blocks), multi-hot tables (the owners pool),
    the Triton one-hot shards: lookups and gradients as one process's."""
    assert not three_ranks(LOOKUP_CASES)


# ------------------------------------------------------------------------------------------
# a run's parts (build_run) on three ranks against one process

GLOBAL_BATCHES = [7, 8, 5, 4]  # split 3/2/2, 3/3/2, 2/2/1, 2/1/1 over three ranks
EVAL_BATCHES = [9, 4, 2]  # the last: no row for rank 2 (as evaluation would need to keep every row)


def _config(sharding: str, dense: str, sparse: str) -> Config:
    cfg = validate(Config())
    cfg.model.embedding_dim, cfg.model.bottom_mlp, cfg.model.top_mlp = 4, [8, 4], [8, 1]
    cfg.optim.dense.name, cfg.optim.dense.lr = dense, 0.01 if dense == "adam" else 0.5
    cfg.optim.sparse.name, cfg.optim.sparse.lr = sparse, 0.05 if sparse == "rowwise_adagrad" else 0.5
    cfg.train.device = "cpu"
    cfg.distributed.sharding, cfg.distributed.balance, cfg.distributed.row_wise_min_rows = sharding, "lookups", 15
    return cfg


def _batches(sizes: list[int], seed: int) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    return [Batch(torch.rand(n, 13, generator=g) * 3, torch.randint(-1, 2**32, (n, len(CARDS)), generator=g),
                  (torch.rand(n, generator=g) < 0.4).float()) for n in sizes]


def _mine(batch: Batch, rank: int, pad_ranks: bool = False) -> Batch:
    """This rank's slice, as the loaders cut it: with `pad_ranks` (an evaluation's loader) a rank without a row
    gets the batch's last row as padding."""
    a, b, pad = rank_rows(0, len(batch), rank, WORLD, pad_ranks)
    return Batch(batch.dense[a:b], batch.sparse[a:b], batch.labels[a:b], len(batch), pad)


def _check_run(rank: int, sharding: str, dense: str, sparse: str) -> None:
    from dlrm.train.builder import build_run
    from dlrm.train.evaluator import evaluate
    from dlrm.train.setup import Tables

    cfg, tables, cpu = _config(sharding, dense, sparse), Tables(CARDS, None, "modulus"), torch.device("cpu")
    steps = len(GLOBAL_BATCHES)
    torch.manual_seed(0)
    one = build_run(cfg, tables, cpu, steps)
    torch.manual_seed(0)
    env = DistEnv(rank, WORLD)
    dist = build_run(cfg, tables, cpu, steps, env)
    assert dist.plan is not None and dist.model.sparse_arch.collective
    for i, batch in enumerate(_batches(GLOBAL_BATCHES, seed=1)):
        ref_loss = one.train_step(batch)
        loss = dist.train_step(_mine(batch, rank))
        for s in (*one.schedulers, *dist.schedulers):
            s.step()
        # each rank's loss is its share of the global mean: the ranks' values sum to W times it
        total = env.all_reduce_sum(loss.detach().clone().view(1))
        torch.testing.assert_close(total / WORLD, ref_loss.view(1), rtol=1e-6, atol=1e-7, msg=f"loss {i}")
    ref_state, state = one.model.state_dict(), dist.model.state_dict()
    assert set(ref_state) == set(state)
    for k, v in ref_state.items():
        if k != "sparse_arch.weight":  # the dense parts, identical on every rank (DDP)
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6, msg=k)
    offsets = [sum(CARDS[:f]) for f in range(len(CARDS))]
    moved = 0
    for f, start, count, at in dist.plan.local_layout(rank):
        rows = slice(offsets[f] + start, offsets[f] + start + count)
        torch.testing.assert_close(state["sparse_arch.weight"][at : at + count], ref_state["sparse_arch.weight"][rows],
                                   rtol=1e-5, atol=1e-6, msg=f"table {f}")
        moved += count
    assert moved == dist.plan.local_rows(rank)
    eval_batches = _batches(EVAL_BATCHES, seed=2)
    ref_metrics = evaluate(one.eval_forward, eval_batches)
    for pad_ranks in (False, True):  # rank 2 without a row of the last batch, or with a padding row
        metrics = evaluate(dist.eval_forward, [_mine(b, rank, pad_ranks) for b in eval_batches], env)
        assert metrics.keys() == ref_metrics.keys()
        for k, v in ref_metrics.items():
            assert metrics[k] == pytest.approx(v, rel=1e-6, abs=1e-7), (k, pad_ranks)


# SGD: a gradient off by a factor moves the parameters by as much (Adam and Adagrad divide most of it out)
RUN_CASES = [("run", "table", "sgd", "sgd"), ("run", "auto", "sgd", "sgd"), ("run", "auto", "adam", "rowwise_adagrad")]


def test_three_ranks_train_and_evaluate_like_one_process(three_ranks):
    """build_run's parts on three ranks ("table": whole tables; "auto": the 50- and 20-row tables row-wise) and on
    one process, four steps of global batches that split unevenly (one rank a row fewer, or two): the same losses,
    dense parameters and table rows (the DDP wrapper's average and each rank's loss share make the global batch's
    gradient), then the same evaluation over every rank's rows."""
    assert not three_ranks(RUN_CASES)


# ------------------------------------------------------------------------------------------
# best.pt of a sharded run


def _local_state(run) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in run.model.state_dict().items()}


def _check_merged(path, local: dict[str, torch.Tensor], plan, rank: int) -> None:
    """`path` (a sharded checkpoint's manifest) merges into the model whose dense parameters are `local`'s and whose
    table rows on this rank are `local`'s sparse weight."""
    from dlrm.distributed.checkpoint import merge

    merged = merge(path)["model"]
    offsets = [sum(CARDS[:f]) for f in range(len(CARDS))]
    for k, v in local.items():
        if k == "sparse_arch.weight":
            for f, start, count, at in plan.local_layout(rank):
                rows = slice(offsets[f] + start, offsets[f] + start + count)
                assert torch.equal(merged[k][rows], v[at : at + count]), (path.name, f)
        elif k in merged:
            assert torch.equal(merged[k], v), (path.name, k)


def _check_best(rank: int) -> None:
    """Checkpointer.save_best on three ranks: at a step not checkpointed each rank writes its best-step-N shard and
    rank 0 the manifest best.pt; at a checkpointed step the shards are hard links to the step's; the previous best's
    shards are removed, and the step checkpoints' pruning (keep 1) leaves best.pt's. Each best.pt merges into the
    model it was saved from."""
    import os
    from pathlib import Path

    from dlrm import checkpoint as ckpt
    from dlrm.train.builder import build_run
    from dlrm.train.checkpointer import Checkpointer
    from dlrm.train.meter import RunStats
    from dlrm.train.setup import Tables

    cfg, tables = _config("auto", "sgd", "sgd"), Tables(CARDS, None, "modulus")
    cfg.checkpoint.keep = 1
    env = DistEnv(rank, WORLD)
    torch.manual_seed(0)
    run = build_run(cfg, tables, torch.device("cpu"), len(GLOBAL_BATCHES), env)
    run_dir = Path(os.environ["DLRM_TEST_RANKS_DIR"]) / "best-run"
    d = ckpt.checkpoint_dir(run_dir)
    cp, stats = Checkpointer(run_dir, cfg, tables, env), RunStats()
    batches = _batches(GLOBAL_BATCHES, seed=1)
    shards = lambda step: [f"best-step-{step:08d}.rank{q}-of-{WORLD}.pt" for q in range(WORLD)]  # noqa: E731

    run.train_step(_mine(batches[0], rank))
    first = cp.save_best(run, ckpt.Position(1, 0, 1), stats)  # step 1 was not checkpointed: shards written
    assert first == d / "best.pt"
    assert ckpt.load_checkpoint(first)["sharded"]["shards"] == shards(1)
    _check_merged(first, _local_state(run), run.plan, rank)

    run.train_step(_mine(batches[1], rank))
    at_two = _local_state(run)
    step_two = cp.save(run, ckpt.Position(2, 0, 2), stats)
    assert cp.save_best(run, ckpt.Position(2, 0, 2), stats) == first
    mine = d / shards(2)[rank]
    assert os.path.samefile(mine, d / f"step-00000002.rank{rank}-of-{WORLD}.pt")  # a link, not a second copy
    env.barrier()  # rank 0 removed the previous best's shards before the save's last barrier
    assert sorted(p.name for p in d.glob("best-*")) == shards(2)
    for i, step in ((2, 3), (3, 4)):
        run.train_step(_mine(batches[i], rank))
        cp.save(run, ckpt.Position(step, 0, step), stats)
    env.barrier()
    assert not step_two.exists() and [p.name for p in ckpt.list_checkpoints(run_dir)] == ["step-00000004.pt"]
    assert ckpt.load_checkpoint(first)["position"]["step"] == 2 and mine.exists()
    _check_merged(first, at_two, run.plan, rank)  # step 2's model, after its own checkpoint was pruned


BEST_CASES = [("best",)]


def test_sharded_best_checkpoint_outlives_pruning_and_merges(three_ranks):
    assert not three_ranks(BEST_CASES)


# ------------------------------------------------------------------------------------------
# every case above in one start of three processes (starting them is most of the time)

CHECKS = {"env": _check_env, "lookup": _check_lookup, "run": _check_run, "best": _check_best}


def _check(rank: int, name: str, *args) -> None:
    CHECKS[name](rank, *args)


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    """The failures of the given cases: every case ran on three ranks, once for the module."""
    cases = [*ENV_CASES, *LOOKUP_CASES, *RUN_CASES, *BEST_CASES]
    tmp = tmp_path_factory.mktemp("ranks")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")  # the Triton shards on CPU tensors (also on a GPU machine)
        mp.setenv("DLRM_TEST_RANKS_DIR", str(tmp))  # a directory every rank shares (the best.pt case's run)
        failed = failures_on_ranks(_check, cases, WORLD, tmp)
    return lambda mine: {k: v for k, v in failed.items() if k[1] in {str(c) for c in mine}}
