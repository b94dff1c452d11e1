"""train.cuda_graph: the whole training step captured in one CUDA graph (dlrm/train/graphed_step.py).

The capture itself needs CUDA (tests marked `gpu`); its configuration rules, the CPU fallback and
the checkpoint form of a tensor learning rate are checked everywhere.
"""

from __future__ import annotations

import copy

import pytest
import torch

from dlrm.config import ConfigError, load_config
from dlrm.data.loader import Batch
from dlrm.data.schema import NUM_DENSE, NUM_SPARSE
from dlrm.train.builder import Run, build_run, tables_from_config
from dlrm.train.graphed_step import GraphedTrainStep, graph_train_step, plain_lr_state_dict
from dlrm.train.step import TrainStep
from tests.conftest import REPO

SAMPLE = REPO / "configs" / "sample.json"
CARDINALITIES = [50, 7, 300] + [20] * (NUM_SPARSE - 3)  # small tables of unequal sizes


@pytest.mark.parametrize(
    "overrides, names",
    [
        ({"kernels.embedding": "torch", "train.compile": False}, 'kernels.embedding "triton", or "torch" with train.compile'),
        ({"optim.dense.fused": False}, "optim.dense.fused"),
        ({"optim.dense.name": "adagrad", "optim.dense.fused": True}, "fused true with adagrad"),
        ({"train.compile": {"mode": "reduce-overhead"}}, "reduce-overhead"),
    ],
)
def test_config_rejects_what_a_captured_step_cannot_replay(overrides, names):
    base = {"train.cuda_graph": True, "kernels.embedding": "triton"}
    with pytest.raises(ConfigError, match=r"train\.cuda_graph: .*" + names.replace(".", r"\.")):
        load_config(SAMPLE, {**base, **overrides})


@pytest.mark.parametrize("embedding", ["triton", "torch"])
def test_config_accepts_a_graphable_step(embedding):
    cfg = load_config(SAMPLE, {"train.cuda_graph": True, "kernels.embedding": embedding, "train.compile": True})
    assert cfg.train.cuda_graph and cfg.train.compile.mode == "auto"  # fast_path makes it "default"


def test_on_the_cpu_the_ordinary_step_runs_with_a_warning(caplog_loguru):
    # torch kernels ("auto" on the CPU): runs on any machine's CPU, a GPU machine's too, where the
    # Triton interpreter is off
    step = make_run(load_config(SAMPLE), torch.device("cpu"), cuda_graph=False).train_step
    assert type(step) is TrainStep
    assert graph_train_step(step, True, distributed=False) is step
    assert any("train.cuda_graph needs CUDA" in m for m in caplog_loguru)
    assert graph_train_step(step, False, distributed=False) is step
    with pytest.raises(ValueError, match="train.cuda_graph: CUDA graphs need a CUDA device"):
        GraphedTrainStep(step)


def test_checkpoints_store_a_tensor_learning_rate_as_a_float():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    opt.param_groups[0]["lr"] = torch.tensor(0.25)
    state = plain_lr_state_dict(opt)
    assert state["param_groups"][0]["lr"] == 0.25 and isinstance(state["param_groups"][0]["lr"], float)
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)  # the live optimizer keeps its tensor


@pytest.mark.parametrize("name,embedding", [("triton-embedding+step-graph", "triton"),
                                            ("triton-embedding-interaction+step-graph", "triton"),
                                            ("compiled+step-graph", "torch")])
def test_step_graph_variants_enable_the_captured_step(name, embedding):
    from dlrm.config import validate
    from dlrm.train.compare import unavailable_reason, variant_config

    cfg = variant_config(load_config(SAMPLE, {"optim.dense.fused": False}), name)
    validate(cfg)  # a combination the config accepts
    assert cfg.train.cuda_graph and cfg.kernels.embedding == embedding
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


def make_run(cfg, device: torch.device, seed: int = 0, cuda_graph: bool | None = None) -> Run:
    """The run `train.py` builds from `cfg` (`build_run`) over `CARDINALITIES`, with deterministic
    embedding updates (two runs from one seed must match) and, when given, `cuda_graph` in place of
    the config's ``train.cuda_graph``."""
    cfg = copy.deepcopy(cfg)
    cfg.model.cardinalities = CARDINALITIES
    cfg.train.deterministic = True
    if cuda_graph is not None:
        cfg.train.cuda_graph = cuda_graph
    torch.manual_seed(seed)
    return build_run(cfg, tables_from_config(cfg), device, total_steps=40)


def batches(n: int, size: int, device: torch.device, seed: int = 1) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        dense = torch.log1p(torch.randint(0, 50, (size, NUM_DENSE), generator=g).float())
        sparse = torch.randint(-1, 2**32, (size, NUM_SPARSE), generator=g)
        labels = (torch.rand(size, generator=g) < 0.3).float()
        out.append(Batch(dense.to(device), sparse.to(device), labels.to(device)))
    return out


def train(run: Run, data: list[Batch]) -> list[float]:
    """One step per batch, each followed by the LR schedules' step (as the trainer does); the losses."""
    losses = []
    for b in data:
        losses.append(run.train_step(b).clone())  # clone: a graphed step's loss buffer is reused by the next step
        for s in run.schedulers:
            s.step()
    return [float(x) for x in losses]


def graphed_step(run: Run) -> GraphedTrainStep:
    """The run's step, checked to be the captured one (the builder wraps it on CUDA)."""
    assert isinstance(run.train_step, GraphedTrainStep), type(run.train_step)
    return run.train_step


def weights(run: Run) -> dict[str, torch.Tensor]:
    """A copy of the model's parameters (the model changes them in place)."""
    return {name: p.detach().clone() for name, p in run.model.named_parameters()}


# ---- on the GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dense_opt", ["sgd", "adam", "adagrad"])
@pytest.mark.parametrize("kernels,compiled", [("triton", False), ("triton", True), ("torch", True)])
def test_graphed_step_trains_exactly_like_the_ordinary_step(dense_opt, kernels, compiled):
    """Same seed, same batches (with an lr warm-up and decay and a partial last batch): the losses of
    every step and the final weights match the ordinary step's (fp32, IEEE matmuls, deterministic
    embedding updates; the only difference is the dense lr held as fp32 on the device). "torch":
    the compiled PyTorch model, whose embedding updates its rows in the compiled backward."""
    device = torch.device("cuda")
    overrides = {
        "kernels.embedding": kernels, "kernels.interaction": kernels, "train.cuda_graph": True,
        "train.compile": compiled, "optim.dense.name": dense_opt, "optim.dense.momentum": 0.9 if dense_opt == "sgd" else 0.0,
        "optim.schedule.warmup_steps": 4, "optim.schedule.decay_start_step": 6, "optim.schedule.decay": "linear",
    }  # fmt: skip
    cfg = load_config(SAMPLE, overrides)  # precision fp32: the builder sets IEEE matmuls
    data = batches(11, 127, device) + batches(1, 33, device, seed=2)  # 3 warm-up, capture, 7 replays, partial

    plain = make_run(cfg, device, cuda_graph=False)
    plain_losses = train(plain, data)

    run = make_run(cfg, device)
    graphed = graphed_step(run)
    graphed_losses = train(run, data)

    assert graphed.graph is not None and graphed.batch_size == 127
    assert len(set(graphed_losses[4:11])) == 7  # replays see each new batch, not the captured one
    torch.testing.assert_close(torch.tensor(graphed_losses), torch.tensor(plain_losses), rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(plain.model.state_dict().items(), run.model.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    lr = run.optimizers[0].param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.device.type == "cuda"
    assert float(lr) == pytest.approx(plain.optimizers[0].param_groups[0]["lr"], rel=1e-6)


@pytest.mark.gpu
def test_graphed_step_in_bf16_tracks_the_ordinary_step():
    """bf16 autocast: the captured step's losses stay within bf16 rounding of the ordinary step's,
    every replay trains on its own batch (a graph replaying the captured inputs gives a repeated
    loss) and every parameter moved."""
    device = torch.device("cuda")
    cfg = load_config(SAMPLE, {"kernels.embedding": "triton", "train.cuda_graph": True, "train.compile": False,
                               "train.precision": "bf16",
                               "optim.schedule.warmup_steps": 0})  # full lr from the first step: weights move
    data = batches(8, 64, device)  # 3 warm-up steps, the capture, 4 replays
    plain = make_run(cfg, device, cuda_graph=False)
    run = make_run(cfg, device)
    graphed = graphed_step(run)
    before = weights(run)
    assert all(torch.equal(before[name], w) for name, w in weights(plain).items())  # one start for both
    a, b = train(plain, data), train(run, data)

    assert graphed.graph is not None and graphed.batch_size == 64
    assert len(set(b[3:])) == 5, b  # the capture and each replay: a loss of its own
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=2e-2, atol=2e-2)
    after = weights(run)
    unmoved = [name for name in before if torch.equal(before[name], after[name])]
    assert not unmoved, f"not updated by the captured step: {unmoved}"
    for name, p in plain.model.named_parameters():  # and moved as the ordinary step moved them: the two runs'
        # distance under a tenth of how far the ordinary step moved the parameter (Adam moves each by ~lr a step, so
        # an absolute tolerance would pass a step that dropped most updates)
        moved = (p.detach().float() - before[name].float()).norm()
        apart = (after[name].float() - p.detach().float()).norm()
        assert apart <= 0.1 * moved, f"{name}: the runs are {float(apart):.3g} apart, moved {float(moved):.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("kernels,compiled", [("triton", False), ("torch", True)])
def test_a_partial_first_batch_still_captures_the_full_batch_size(kernels, compiled):
    """A run resumed just before an epoch's partial last batch sees that smaller batch first: the ordinary step
    trains on it, the next (full) batches warm up and are captured, and every loss and the final weights match
    the ordinary step's (it used to capture nothing for the rest of the run)."""
    device = torch.device("cuda")
    cfg = load_config(SAMPLE, {"kernels.embedding": kernels, "kernels.interaction": kernels, "train.cuda_graph": True,
                               "train.compile": compiled, "optim.schedule.warmup_steps": 2})
    data = batches(1, 33, device, seed=2) + batches(9, 127, device)  # partial, 3 warm-up, capture, 5 replays
    plain = make_run(cfg, device, cuda_graph=False)
    plain_losses = train(plain, data)
    run = make_run(cfg, device)
    graphed = graphed_step(run)
    losses = train(run, data)

    assert graphed.graph is not None and graphed.batch_size == 127
    assert len(set(losses[5:])) == 5  # each replay trains on its own batch
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain_losses), rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(plain.model.state_dict().items(), run.model.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
