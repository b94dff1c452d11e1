"""A checkpoint's optimizer *implementation* (fused, foreach, capturable) does not carry into the run that loads it.

torch's Optimizer.load_state_dict takes the saved param groups whole: a checkpoint of a run whose dense Adam was
neither fused nor capturable (a CPU run, or one without ``train.cuda_graph``) turned a resumed GPU run's fused Adam
into the plain one, silently, and a captured step's Adam non-capturable, so the capture failed
(`dlrm.train.optim.keeps_configured_hyperparameters`). The state itself (moments, step counts) is the checkpoint's.
"""

from __future__ import annotations

import copy

import pytest
import torch

from dlrm.train.optim import keeps_configured_hyperparameters


def _trained(opt_cls, steps: int, **kwargs):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5, 3))
    opt = keeps_configured_hyperparameters(opt_cls([w], lr=0.1, **kwargs))
    for i in range(steps):
        opt.zero_grad()
        (w.sin() * (i + 1)).sum().backward()
        opt.step()
    return w, opt


def _continue(w, opt, steps: int, start: int) -> torch.Tensor:
    for i in range(start, start + steps):
        opt.zero_grad()
        (w.sin() * (i + 1)).sum().backward()
        opt.step()
    return w.detach().clone()


@pytest.mark.parametrize("saved,live", [({}, {"fused": True}), ({"fused": True}, {}),
                                        ({"foreach": False}, {"foreach": True})])
@pytest.mark.parametrize("opt_cls", [torch.optim.Adam, torch.optim.Adagrad])
def test_the_loading_optimizer_keeps_its_own_implementation_and_trains_on_alike(opt_cls, saved, live):
    w_saved, opt_saved = _trained(opt_cls, 3, **saved)
    state = copy.deepcopy(opt_saved.state_dict())
    expected = _continue(w_saved, opt_saved, 4, start=3)  # the uninterrupted run

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5, 3))
    opt = keeps_configured_hyperparameters(opt_cls([w], lr=0.1, **live))
    flags = {k: opt.param_groups[0][k] for k in ("fused", "foreach")}
    trained = _trained(opt_cls, 3, **saved)[0].detach()  # the checkpoint's weights
    with torch.no_grad():
        w.copy_(trained)
    opt.load_state_dict(state)
    assert {k: opt.param_groups[0][k] for k in flags} == flags  # the run's own, not the checkpoint's
    step = opt.state[w]["step"]
    assert step.dtype == torch.float32 and float(step) == 3.0  # the checkpoint's count
    torch.testing.assert_close(_continue(w, opt, 4, start=3), expected, rtol=1e-6, atol=1e-6)


def _on_cpu(state):
    """`state` as a checkpoint loads it (``map_location="cpu"``): every tensor on the CPU."""
    return {k: _on_cpu(v) for k, v in state.items()} if isinstance(state, dict) else \
        [_on_cpu(v) for v in state] if isinstance(state, list) else \
        state.cpu() if isinstance(state, torch.Tensor) else state


@pytest.mark.gpu
@pytest.mark.parametrize("dense", ["adam", "adagrad"])
def test_a_non_capturable_checkpoint_resumes_in_a_captured_step(dense):
    """A checkpoint of a run without ``train.cuda_graph`` (Adam not capturable; for Adagrad, torch's CPU Adagrad's
    flags), loaded as checkpoints load (on the CPU), resumed by a run with it: the capture works (Adam raised
    "capturable is False"), the step counters sit on the GPU (a CPU counter is not advanced by a graph replay) and
    the losses and weights follow the uninterrupted run's."""
    from tests.test_graphed_step import SAMPLE, batches, graphed_step, make_run, train

    from dlrm.config import load_config

    device = torch.device("cuda")
    cfg = load_config(SAMPLE, {"kernels.embedding": "triton", "kernels.interaction": "triton", "train.compile": False,
                               "optim.dense.name": dense, "optim.dense.fused": False,
                               "optim.schedule.warmup_steps": 0})
    data = batches(12, 127, device)
    plain = make_run(cfg, device, cuda_graph=False)
    train(plain, data[:4])
    model_state = copy.deepcopy(plain.model.state_dict())
    opt_states = [_on_cpu(copy.deepcopy(o.state_dict())) for o in plain.optimizers]
    sched_states = [copy.deepcopy(s.state_dict()) for s in plain.schedulers]
    if dense == "adam":
        assert opt_states[0]["param_groups"][0]["capturable"] is False
    else:  # as torch.optim.Adagrad on the CPU saves its groups
        for g in opt_states[0]["param_groups"]:
            g["foreach"] = None
    expected = train(plain, data[4:])

    graph_cfg = copy.deepcopy(cfg)
    if dense == "adam":
        graph_cfg.optim.dense.fused = True  # the captured step needs the fused Adam (compare.variant_config does this)
    run = make_run(graph_cfg, device, cuda_graph=True)
    graphed = graphed_step(run)
    run.model.load_state_dict(model_state)
    for o, s in zip(run.optimizers, opt_states):
        o.load_state_dict(s)
    for sch, s in zip(run.schedulers, sched_states):
        sch.load_state_dict(s)
    dense_opt = run.optimizers[0]
    if dense == "adam":
        assert dense_opt.param_groups[0]["capturable"] is True and dense_opt.param_groups[0]["fused"] is True
    steps = [s["step"] for s in dense_opt.state.values()]
    assert steps and all(t.device.type == "cuda" and float(t) == 4.0 for t in steps)
    losses = train(run, data[4:])  # 3 warm-up steps, the capture, 4 replays
    assert graphed.graph is not None
    assert all(float(s["step"]) == 12.0 for s in dense_opt.state.values())  # replays advanced them
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=1e-5)
    for (name, a), b in zip(plain.model.state_dict().items(), run.model.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
