"""train.cuda_graph: the whole training step captured in one CUDA graph (dlrm/train/graphed_step.py).

The capture itself needs CUDA (tests marked `gpu`); its configuration rules, the CPU fallback and
the checkpoint form of a tensor learning rate are checked everywhere.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from dlrm.config import ConfigError, KernelsConfig, load_config
from dlrm.data.loader import Batch
from dlrm.data.schema import NUM_DENSE, NUM_SPARSE
from dlrm.model.dlrm import build_loss, build_model
from dlrm.train.graphed_step import GraphedTrainStep, graph_train_step, plain_lr_state_dict
from dlrm.train.optim import build_optimizers, build_schedulers
from dlrm.train.step import TrainStep, set_matmul_precision

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "configs" / "sample.json"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize(
    "overrides, names",
    [
        ({"kernels.embedding": "torch"}, 'kernels.embedding "triton"'),
        ({"optim.dense.fused": False}, "optim.dense.fused"),
        ({"optim.dense.name": "adagrad"}, 'optim.dense.name "sgd" or "adam"'),
        ({"train.compile": {"mode": "reduce-overhead"}}, "reduce-overhead"),
    ],
)
def test_config_rejects_what_a_captured_step_cannot_replay(overrides, names):
    base = {"train.cuda_graph": True, "kernels.embedding": "triton"}
    with pytest.raises(ConfigError, match=r"train\.cuda_graph: .*" + names.replace(".", r"\.")):
        load_config(SAMPLE, {**base, **overrides})


def test_config_accepts_a_graphable_step():
    cfg = load_config(SAMPLE, {"train.cuda_graph": True, "kernels.embedding": "triton", "train.compile": True})
    assert cfg.train.cuda_graph and cfg.train.compile.mode == "default"


def test_on_the_cpu_the_ordinary_step_runs_with_a_warning(caplog_loguru):
    step = make_step(load_config(SAMPLE), torch.device("cpu"))  # torch kernels: runs on any machine's CPU
    assert graph_train_step(step, True, distributed=False) is step
    assert graph_train_step(step, False, distributed=False) is step
    assert any("train.cuda_graph needs CUDA" in m for m in caplog_loguru)
    with pytest.raises(ValueError, match="train.cuda_graph: CUDA graphs need a CUDA device"):
        GraphedTrainStep(step)


def test_checkpoints_store_a_tensor_learning_rate_as_a_float():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    opt.param_groups[0]["lr"] = torch.tensor(0.25)
    state = plain_lr_state_dict(opt)
    assert state["param_groups"][0]["lr"] == 0.25 and isinstance(state["param_groups"][0]["lr"], float)
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)  # the live optimizer keeps its tensor


@pytest.mark.parametrize("name", ["triton-embedding+step-graph", "triton-embedding-interaction+step-graph"])
def test_step_graph_variants_enable_the_captured_step(name):
    from dlrm.train.compare import unavailable_reason, variant_config

    cfg = variant_config(load_config(SAMPLE, {"optim.dense.fused": False}), name)
    assert cfg.train.cuda_graph and cfg.kernels.embedding == "triton"
    assert cfg.train.compile.enabled and cfg.train.compile.mode == "default"
    assert cfg.optim.dense.fused is None  # fused on CUDA, as the capture needs
    assert "CUDA" in unavailable_reason(name, torch.device("cpu"))


# ---- helpers -----------------------------------------------------------------------------------


@pytest.fixture
def caplog_loguru():
    from loguru import logger

    messages: list[str] = []
    handle = logger.add(lambda m: messages.append(str(m)), level="WARNING")
    yield messages
    logger.remove(handle)


def make_step(cfg, device: torch.device, seed: int = 0):
    torch.manual_seed(seed)
    model = build_model(cfg.model, [50, 7, 300] + [20] * (NUM_SPARSE - 3), None, cfg.kernels, device)
    optimizers = build_optimizers(model, cfg.optim, deterministic=True)
    step = TrainStep(model, build_loss(cfg.kernels), optimizers, cfg.train.precision, device, cfg.train.compile)
    step.schedulers = build_schedulers(optimizers, cfg.optim.schedule, total_steps=40)
    return step


def batches(n: int, size: int, device: torch.device, seed: int = 1) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        dense = torch.log1p(torch.randint(0, 50, (size, NUM_DENSE), generator=g).float())
        sparse = torch.randint(-1, 2**32, (size, NUM_SPARSE), generator=g)
        labels = (torch.rand(size, generator=g) < 0.3).float()
        out.append(Batch(dense.to(device), sparse.to(device), labels.to(device)))
    return out


def train(step, schedulers, data: list[Batch]) -> list[float]:
    losses = []
    for b in data:
        losses.append(step(b).clone())  # clone: a graphed step's loss buffer is reused by the next step
        for s in schedulers:
            s.step()
    return [float(x) for x in losses]


# ---- on the GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dense_opt", ["sgd", "adam"])
@pytest.mark.parametrize("compiled", [False, True])
def test_graphed_step_trains_exactly_like_the_ordinary_step(dense_opt, compiled):
    """Same seed, same batches (with an lr warm-up and decay and a partial last batch): the losses of
    every step and the final weights match the ordinary step's (fp32, IEEE matmuls, deterministic
    embedding updates; the only difference is the dense lr held as fp32 on the device)."""
    device = torch.device("cuda")
    set_matmul_precision("fp32")
    overrides = {
        "kernels.embedding": "triton", "kernels.interaction": "triton", "train.cuda_graph": True,
        "train.compile": compiled, "optim.dense.name": dense_opt, "optim.dense.momentum": 0.9 if dense_opt == "sgd" else 0.0,
        "optim.schedule.warmup_steps": 4, "optim.schedule.decay_start_step": 6, "optim.schedule.decay": "linear",
    }  # fmt: skip
    cfg = load_config(SAMPLE, overrides)
    data = batches(11, 127, device) + batches(1, 33, device, seed=2)  # 3 warm-up, capture, 7 replays, partial

    plain = make_step(copy.deepcopy(cfg), device)
    plain_losses = train(plain, plain.schedulers, data)

    ordinary = make_step(copy.deepcopy(cfg), device)
    graphed = GraphedTrainStep(ordinary)
    graphed_losses = train(graphed, ordinary.schedulers, data)

    assert graphed.graph is not None and graphed.batch_size == 127
    assert len(set(graphed_losses[4:11])) == 7  # replays see each new batch, not the captured one
    torch.testing.assert_close(torch.tensor(graphed_losses), torch.tensor(plain_losses), rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(plain.model.state_dict().items(), ordinary.model.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    lr = ordinary.optimizers[0].param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.device.type == "cuda"
    assert float(lr) == pytest.approx(plain.optimizers[0].param_groups[0]["lr"], rel=1e-6)


@pytest.mark.gpu
@needs_cuda
def test_graphed_step_in_bf16_tracks_the_ordinary_step():
    device = torch.device("cuda")
    cfg = load_config(SAMPLE, {"kernels.embedding": "triton", "train.cuda_graph": True, "train.precision": "bf16"})
    data = batches(8, 64, device)
    plain = make_step(copy.deepcopy(cfg), device)
    ordinary = make_step(copy.deepcopy(cfg), device)
    graphed = GraphedTrainStep(ordinary)
    a, b = train(plain, plain.schedulers, data), train(graphed, ordinary.schedulers, data)
    assert graphed.graph is not None
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=2e-2, atol=2e-2)
