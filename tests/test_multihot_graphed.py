"""The MLPerf DLRM-DCNv2 model (multi-hot, DCN) with the whole training step captured as one CUDA graph.

`train.cuda_graph` captures forward, backward, the pooled embedding's fused update and the dense
optimizer (SGD or Adam here; the config's Adagrad is `dlrm.train.adagrad.CapturableAdagrad` on CUDA,
whose captured step is checked in tests/test_graphed_step.py). These tests build the
run `train.py` builds from configs/mlperf-dcnv2.json, shrunk, and check on the GPU that the captured
step trains exactly like the ordinary one on [B, L] batches with empty (PAD_SPARSE) slots, and that
with bf16 tables every replay draws new stochastic-rounding bits. The CPU test checks the config rules.
"""

from __future__ import annotations

import copy

import pytest
import torch

from dlrm.config import ConfigError, load_config, validate
from dlrm.data.loader import Batch
from dlrm.data.schema import NUM_DENSE, PAD_SPARSE
from dlrm.train.builder import build_run, tables_from_config
from dlrm.train.graphed_step import GraphedTrainStep
from tests.conftest import REPO

MLPERF = REPO / "configs" / "mlperf-dcnv2.json"
SIZES = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 20, 7, 10, 3, 1, 1]  # MLPerf's, 100 -> 20, 27 -> 7
CARDS = [97, 13, 50, 7, 301, 3, 40, 11, 5, 257, 33, 64, 10, 29, 88, 15, 4, 23, 14, 211, 503, 127, 61, 17, 9, 6]
SHRINK = {"model.embedding_dim": 16, "model.bottom_mlp": [32, 16], "model.top_mlp": [32, 16, 1], "model.cross_rank": 8,
          "model.cardinalities": CARDS, "model.multi_hot_sizes": SIZES, "model.embedding_dtype": "fp32",
          "train.precision": "fp32", "train.deterministic": True, "train.baseline": False,
          "kernels.embedding": "triton", "optim.dense.name": "sgd", "optim.dense.lr": 0.05,
          "optim.sparse.lr": 0.05, "optim.schedule.warmup_steps": 3}


def mlperf_config(**overrides):
    return load_config(MLPERF, {**SHRINK, **overrides})


def make_run(cfg, device: torch.device, cuda_graph: bool):
    cfg = copy.deepcopy(cfg)
    cfg.train.cuda_graph = cuda_graph
    torch.manual_seed(0)
    return build_run(cfg, tables_from_config(cfg), device, total_steps=40)


def batches(n: int, size: int, device: torch.device, seed: int = 1) -> list[Batch]:
    """Multi-hot batches: raw values over the whole hash range, ~20% of the slots empty (PAD_SPARSE)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        dense = torch.log1p(torch.randint(0, 50, (size, NUM_DENSE), generator=g).float())
        sparse = torch.randint(-1, 2**32, (size, sum(SIZES)), generator=g)
        sparse[torch.rand(sparse.shape, generator=g) < 0.2] = PAD_SPARSE
        labels = (torch.rand(size, generator=g) < 0.3).float()
        out.append(Batch(dense.to(device), sparse.to(device), labels.to(device)))
    return out


def train(run, data: list[Batch]) -> list[float]:
    losses = []
    for b in data:
        losses.append(run.train_step(b).clone())  # clone: the captured step reuses its loss buffer
        for s in run.schedulers:
            s.step()
    return [float(x) for x in losses]


def test_the_config_accepts_a_captured_step_with_dense_adagrad_unless_fused():
    """configs/mlperf-dcnv2.json trains the dense part with Adagrad: on CUDA that is
    dlrm.train.adagrad.CapturableAdagrad, which a graph can hold; torch's fused Adagrad (CPU) cannot."""
    validate(mlperf_config(**{"optim.dense.name": "adagrad", "train.cuda_graph": True}))
    with pytest.raises(ConfigError, match="fused true with adagrad"):
        validate(mlperf_config(**{"optim.dense.name": "adagrad", "optim.dense.fused": True, "train.cuda_graph": True}))
    validate(mlperf_config(**{"train.cuda_graph": True}))  # SGD: accepted


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_captured_multi_hot_step_trains_exactly_like_the_ordinary_step(compiled):
    device = torch.device("cuda")
    cfg = mlperf_config(**{"train.compile": compiled})
    data = batches(9, 96, device)  # 3 warm-up steps, the capture, 5 replays
    plain = make_run(cfg, device, cuda_graph=False)
    plain_losses = train(plain, data)
    run = make_run(cfg, device, cuda_graph=True)
    assert isinstance(run.train_step, GraphedTrainStep)
    losses = train(run, data)
    assert run.train_step.graph is not None and len(set(losses[4:])) == 5  # each replay sees its own batch
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain_losses), rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(plain.model.state_dict().items(), run.model.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.gpu
def test_captured_step_with_bf16_tables_draws_new_rounding_bits_every_replay():
    """bf16 tables, stochastic rounding: the seed lives on the device and the captured update advances
    it, so replays round differently; the losses track the ordinary step's within bf16 rounding."""
    device = torch.device("cuda")
    cfg = mlperf_config(**{"model.embedding_dtype": "bf16", "train.compile": False})
    data = batches(8, 96, device)
    plain = make_run(cfg, device, cuda_graph=False)
    run = make_run(cfg, device, cuda_graph=True)
    seed = run.model.sparse_arch.sr_seed
    a = train(plain, data)
    before = int(seed)
    b = train(run, data[:4])
    after_capture = int(seed)
    b += train(run, data[4:])
    assert int(seed) - after_capture == 4  # one new seed per replay
    assert after_capture > before
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=2e-2, atol=2e-2)
    w = run.model.sparse_arch.weight
    assert w.dtype == torch.bfloat16 and torch.isfinite(w.float()).all()
