"""A shuffled batch of a device-resident split (`GatheredBatch`) and the CUDA-graphed step that gathers it inside its
graph: the batch's tensors, gathered when first read, are the rows the eager gather gives; the graphed step copies
only the row indices a step and gathers them in the graph; its training equals the ordinary step's on the same
batches (on the GPU)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from dlrm.config import load_config
from dlrm.data.batch import Batch, GatheredBatch, ResidentSplit, widen_sparse
from dlrm.data.device_loader import DeviceLoader
from dlrm.data.loader import split_files
from dlrm.data.schema import NUM_DENSE, NUM_SPARSE, read_metadata
from dlrm.train import graphed_step as gs_mod
from tests.conftest import make_dataset


def split_of(n: int, width: int = NUM_SPARSE, device="cpu", dtype=torch.int32, seed: int = 0) -> ResidentSplit:
    """A split of `n` rows whose int32 sparse values include negatives (unsigned values above 2^31), -1 and -2."""
    g = torch.Generator().manual_seed(seed)
    sparse = torch.randint(-(2**31), 2**31, (n, width), generator=g, dtype=torch.int64)
    sparse[0, 0], sparse[-1, -1] = -1, -2
    return ResidentSplit(torch.randn(n, NUM_DENSE, generator=g).to(device), sparse.to(dtype).to(device),
                         torch.randint(0, 2, (n,), generator=g).float().to(device), padded=width > NUM_SPARSE)


@pytest.mark.parametrize("rows", [[0], [2, 0, 4], list(range(127))[::-1]])  # batch 1, 3, 127
@pytest.mark.parametrize("width,dtype", [(NUM_SPARSE, torch.int32), (3 * NUM_SPARSE, torch.int32),
                                         (1, torch.int32), (NUM_SPARSE, torch.int64)])
def test_a_gathered_batch_holds_its_rows_widened(rows, width, dtype):
    """Element by element: dense and labels are the split's rows, sparse their values widened (`widen_sparse` of
    the rows, -1 kept, -2 kept in multi-hot data, other negatives read unsigned); an int64 split as it is."""
    split = split_of(130, width, dtype=dtype)
    index = torch.tensor(rows)
    batch = GatheredBatch(split, index, global_size=7, pad=1)
    assert len(batch) == len(rows) and not batch.gathered  # the length without a gather
    assert batch.global_len == 7 and batch.pad == 1
    torch.testing.assert_close(batch.dense, split.dense[index], rtol=0, atol=0)
    torch.testing.assert_close(batch.labels, split.labels[index], rtol=0, atol=0)
    assert batch.sparse.dtype == torch.int64
    expected = split.sparse[index].to(torch.int64)
    if dtype == torch.int32:
        kept = -2 if split.padded else -1
        expected = torch.where(expected < kept, expected + 2**32, expected)
    assert torch.equal(batch.sparse, expected)
    assert torch.equal(batch.sparse, widen_sparse(split.sparse[index], split.padded))
    assert batch.gathered


def test_a_gathered_batch_gathers_once_and_on_a_non_contiguous_index(monkeypatch):
    """Its three tensors come from one `take` (not one a property read), and a strided view of the rows works."""
    split = split_of(20)
    calls = []
    take = ResidentSplit.take
    monkeypatch.setattr(ResidentSplit, "take", lambda self, rows: calls.append(rows) or take(self, rows))
    rows = torch.arange(19, -1, -1)[::3]  # a non-contiguous view
    batch = GatheredBatch(split, rows)
    for _ in range(2):
        assert torch.equal(batch.dense, split.dense[rows.contiguous()]) and batch.sparse.shape == (7, NUM_SPARSE)
        assert torch.equal(batch.labels, split.labels[rows.contiguous()])
    assert len(calls) == 1 and not rows.is_contiguous()


def test_the_device_loader_yields_gathered_batches_when_shuffled(tmp_path):
    """Shuffled: every batch is a `GatheredBatch` of the split's permutation, its tensors the rows the permutation
    names (DENSE_0 holds the row's index); unshuffled: plain batches cut as views, as before."""
    written = make_dataset(tmp_path, {"train": 45}, files_per_split=2, row_group_size=7)
    files = split_files(tmp_path, read_metadata(tmp_path), "train")
    loader = DeviceLoader(files, batch_size=8, device="cpu", shuffle=True, seed=3)
    batches = list(loader)
    assert all(isinstance(b, GatheredBatch) for b in batches) and [len(b) for b in batches] == [8] * 5 + [5]
    seen = torch.cat([b.rows for b in batches])
    assert sorted(seen.tolist()) == list(range(45))
    for b in batches:
        rows = b.rows.tolist()
        assert torch.equal(b.dense[:, 0], torch.log1p(torch.tensor(rows, dtype=torch.float32)))
        assert b.labels.tolist() == written["train"]["label"][rows].astype("float32").tolist()
        assert b.sparse.tolist() == written["train"]["sparse"][rows].tolist()
    plain = list(DeviceLoader(files, batch_size=8, device="cpu", shuffle=False))
    assert all(type(b) is Batch for b in plain) and plain[1].dense[0, 0] == torch.log1p(torch.tensor(8.0))


# ---- the graphed step's host side, with a stand-in CUDA graph (runs on the CPU) --------------------------------


class FakeGraph:
    """`torch.cuda.CUDAGraph` as far as GraphedTrainStep uses it: the "captured" work is the step run once more."""

    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


class ReadingStep:
    """Stands in for TrainStep: `run` reads the batch (as the model does) and records what it saw."""

    def __init__(self):
        self.device = torch.device("cuda")
        self.optimizers, self.autocast_cache = [], True
        self.seen: list[str] = []

    def __call__(self, batch):
        self.seen.append(f"ordinary {len(batch)}")
        return self.run(batch)

    def load_lrs(self):
        pass

    def run(self, batch):
        self.seen.append(f"run {type(batch).__name__}")
        return batch.dense.sum() + batch.sparse.sum() + batch.labels.sum()


@pytest.fixture
def fake_graphs(monkeypatch):
    monkeypatch.setattr(gs_mod, "capture_stream", lambda device: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, stream=None: contextlib.nullcontext())


def test_a_graphed_step_captures_the_gathers_and_copies_only_the_rows(fake_graphs, monkeypatch):
    """The capture reads the split through the graph's own rows (the gathers are captured); each later step copies
    the new batch's rows into them and replays, no gather launched from the host (`take` is not called again)."""
    split = split_of(64)
    takes = []
    take = ResidentSplit.take
    monkeypatch.setattr(ResidentSplit, "take", lambda self, rows: takes.append(rows) or take(self, rows))
    step = ReadingStep()
    g = gs_mod.GraphedTrainStep(step, warmup_steps=0)
    step.device = torch.device("cpu")
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    g(GatheredBatch(split, perm[0:16]))
    assert step.seen == ["run GatheredBatch"] and len(takes) == 1 and takes[0] is g.static_rows
    assert g.gather_source is split and torch.equal(g.static_rows, perm[0:16]) and g.graph.replays == 1
    for k in (1, 2, 3):
        g(GatheredBatch(split, perm[16 * k: 16 * (k + 1)]))
        assert torch.equal(g.static_rows, perm[16 * k: 16 * (k + 1)]) and g.graph.replays == k + 1
    assert len(takes) == 1 and step.seen == ["run GatheredBatch"]


def test_a_batch_of_another_split_runs_the_ordinary_step_said_once(fake_graphs):
    """Rows of a split whose tensors the graph does not read (or a plain batch), after a capture from a split: the
    ordinary step, one warning for all of them; rows of the captured split replay again."""
    from loguru import logger

    messages: list[str] = []
    handle = logger.add(lambda m: messages.append(str(m)), level="WARNING")
    try:
        split, other = split_of(32), split_of(32, seed=1)
        step = ReadingStep()
        g = gs_mod.GraphedTrainStep(step, warmup_steps=0)
        g(GatheredBatch(split, torch.arange(8)))
        g(GatheredBatch(other, torch.arange(8)))
        g(Batch(torch.zeros(8, NUM_DENSE), torch.zeros(8, NUM_SPARSE, dtype=torch.int64), torch.zeros(8)))
        same_tensors = ResidentSplit(split.dense, split.sparse, split.labels, split.padded)  # a new epoch's object
        g(GatheredBatch(same_tensors, torch.arange(8, 16)))
    finally:
        logger.remove(handle)
    assert step.seen == ["run GatheredBatch", "ordinary 8", "run GatheredBatch", "ordinary 8", "run Batch"]
    assert g.graph.replays == 2 and torch.equal(g.static_rows, torch.arange(8, 16))
    assert sum("not from the split the graph gathers from" in m for m in messages) == 1


def test_a_plain_batch_capture_still_copies_all_three_inputs(fake_graphs):
    """Captured from a plain batch (an unshuffled split, a streamed loader's batch), a later gathered batch's
    tensors are read and copied into the static inputs as before."""
    split = split_of(32)
    step = ReadingStep()
    g = gs_mod.GraphedTrainStep(step, warmup_steps=0)
    g(Batch(torch.zeros(8, NUM_DENSE), torch.zeros(8, NUM_SPARSE, dtype=torch.int64), torch.zeros(8)))
    new = GatheredBatch(split, torch.arange(8, 16))
    g(new)
    assert g.gather_source is None and g.graph.replays == 2
    for static, fresh in ((g.static.dense, new.dense), (g.static.sparse, new.sparse), (g.static.labels, new.labels)):
        assert torch.equal(static, fresh)


# ---- on the GPU ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("kernels,compiled", [("triton", False), ("torch", True)])
def test_graphed_gathers_train_exactly_like_the_ordinary_step(kernels, compiled, monkeypatch):
    """Batches of a CUDA-resident split's permutation (an int32 split whose values need widening), trained by the
    graphed step (gathers in its graph) and by the ordinary step: the same losses at every step and the same
    weights; after the capture the host gathers nothing (`take` is called for the warm-up steps and the capture
    only)."""
    from tests.test_graphed_step import SAMPLE, make_run, train

    device = torch.device("cuda")
    overrides = {"kernels.embedding": kernels, "kernels.interaction": kernels, "train.cuda_graph": True,
                 "train.compile": compiled, "optim.schedule.warmup_steps": 4, "optim.schedule.decay_start_step": 6,
                 "optim.schedule.decay": "linear"}  # fmt: skip
    cfg = load_config(SAMPLE, overrides)
    split = split_of(2000, device=device)
    perm = torch.randperm(2000, generator=torch.Generator().manual_seed(1)).to(device)
    data = [GatheredBatch(split, perm[127 * k: 127 * (k + 1)]) for k in range(11)]

    plain = make_run(cfg, device, cuda_graph=False)
    plain_losses = train(plain, [GatheredBatch(split, b.rows) for b in data])
    takes = []
    take = ResidentSplit.take
    monkeypatch.setattr(ResidentSplit, "take", lambda self, rows: takes.append(rows) or take(self, rows))
    run = make_run(cfg, device)
    graphed_losses = train(run, data)
    step = run.train_step
    assert isinstance(step, gs_mod.GraphedTrainStep) and step.gather_source is split
    assert len(takes) == step.warmup_steps + 1  # the warm-up's ordinary steps and the capture
    assert len(set(graphed_losses[4:])) == len(graphed_losses[4:])  # replays see each new batch
    torch.testing.assert_close(torch.tensor(graphed_losses), torch.tensor(plain_losses), rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(plain.model.state_dict().items(), run.model.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_an_ordinary_steps_gathers_are_its_data_range_under_the_profiler():
    """Not gathered by the loader any more, a batch's gathers run in the step: under a profiler they are in a range
    named "data" (--profile's step breakdown row for the loader's work), not counted with the model's or as "other";
    a batch already gathered opens no such range."""
    from tests.test_graphed_step import SAMPLE, make_run

    cfg = load_config(SAMPLE, {"train.cuda_graph": False, "train.compile": False})
    run = make_run(cfg, torch.device("cpu"), cuda_graph=False)
    split = split_of(64)
    counts = {}
    for pre_gathered in (False, True):
        batch = GatheredBatch(split, torch.arange(10, 20))
        if pre_gathered:
            batch.gather()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run.train_step(batch)
        events = prof.events()
        data = [e.time_range for e in events if e.name == "data"]
        gathers = [e.time_range for e in events if e.name == "aten::index_select"]
        counts[pre_gathered] = len(gathers)  # (the model's own lookups may use index_select too)
        in_data = [g for g in gathers if any(d.start <= g.start and g.end <= d.end for d in data)]
        assert (len(data), len(in_data)) == ((0, 0) if pre_gathered else (1, 3)), pre_gathered
    assert counts[False] == counts[True] + 3
