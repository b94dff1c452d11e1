"""Audit of dlrm/train/optim.py and dlrm/train/adagrad.py: closed-form LR values where the schedule's
branches meet (end of warm-up, decay to the end of training, cosine end factor), schedulers for
warm-up-only and decay-only configs, the dense optimizers' hyperparameters (momentum, weight decay,
eps) against float64 updates written out, the row-wise Adagrad's configured eps, and
CapturableAdagrad's one-pass (Triton) path (on the GPU where there is one, else under the interpreter)."""

from __future__ import annotations

import math

import pytest
import torch

import dlrm.train.adagrad as adagrad_mod
from dlrm.config import DenseOptimConfig, OptimConfig, ScheduleConfig, SparseOptimConfig
from dlrm.model.archs import SparseArch
from dlrm.train.adagrad import CapturableAdagrad
from dlrm.train.optim import build_optimizers, build_schedulers, lr_multiplier


def test_lr_multiplier_closed_form_at_the_branch_edges():
    # warm-up of 4 steps: steps 0..3 ramp, step 4 is the first full-rate step (not 5/4)
    lin = ScheduleConfig(warmup_steps=4, decay="linear", decay_start_step=10, decay_steps=0, end_factor=0.2)
    assert lr_multiplier(3, lin, 30) == 1.0
    assert lr_multiplier(4, lin, 30) == 1.0
    assert lr_multiplier(10, lin, 30) == 1.0
    # decay_steps = 0: decay over the 30 - 10 = 20 steps left, reaching 0.2 at the end of training
    assert lr_multiplier(15, lin, 30) == pytest.approx(1.0 - 0.8 * 5 / 20, abs=1e-15)  # 0.8
    assert lr_multiplier(29, lin, 30) == pytest.approx(1.0 - 0.8 * 19 / 20, abs=1e-15)  # 0.24
    assert lr_multiplier(30, lin, 30) == pytest.approx(0.2, abs=1e-15)
    # cosine towards a non-zero end factor, starting at step 2 over 4 steps
    cos = ScheduleConfig(decay="cosine", decay_start_step=2, decay_steps=4, end_factor=0.25)
    assert lr_multiplier(1, cos, 100) == 1.0
    assert lr_multiplier(2, cos, 100) == pytest.approx(1.0, abs=1e-15)
    assert lr_multiplier(4, cos, 100) == pytest.approx(0.625, abs=1e-15)  # 0.25 + 0.75 * 0.5 * (1 + cos(pi/2))
    assert lr_multiplier(3, cos, 100) == pytest.approx(0.25 + 0.75 * 0.5 * (1 + math.sqrt(0.5)), abs=1e-15)
    assert lr_multiplier(6, cos, 100) == pytest.approx(0.25, abs=1e-15)
    assert lr_multiplier(50, cos, 100) == pytest.approx(0.25, abs=1e-15)  # held at the end factor


def _two_param_optimizers():
    a = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.4)
    b = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    return [a, b]


@pytest.mark.parametrize("cfg, expected", [
    # warm-up only: 1/3, 2/3, then full
    (ScheduleConfig(warmup_steps=3), [1 / 3, 2 / 3, 1.0, 1.0]),
    # decay only (to the end of 4 steps): 1, 0.75, 0.5, 0.25
    (ScheduleConfig(decay="linear"), [1.0, 0.75, 0.5, 0.25]),
])
def test_a_warmup_only_or_decay_only_schedule_drives_both_optimizers(cfg, expected):
    opts = _two_param_optimizers()
    scheds = build_schedulers(opts, cfg, total_steps=4)
    assert len(scheds) == 2
    seen = []
    for _ in range(4):
        seen.append([o.param_groups[0]["lr"] for o in opts])
        for o in opts:
            o.step()  # no gradients: nothing moves (the order torch expects)
        for s in scheds:
            s.step()
    for (lr_a, lr_b), m in zip(seen, expected):
        assert lr_a == pytest.approx(0.4 * m, abs=1e-12) and lr_b == pytest.approx(2.0 * m, abs=1e-12)
    assert build_schedulers(_two_param_optimizers(), ScheduleConfig(), total_steps=4) == []


def _model():
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.sparse_arch = SparseArch([5, 3], dim=2).double()
    model.lin = torch.nn.Linear(3, 2).double()
    return model


def _grads(step: int, p: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 + step)
    return torch.randn(p.shape, generator=g, dtype=torch.float64)


def _run_dense(dense_cfg: DenseOptimConfig, steps: int = 2):
    model = _model()
    dense, _ = build_optimizers(model, OptimConfig(dense=dense_cfg))
    params = list(model.lin.parameters())
    start = [p.detach().clone() for p in params]
    for step in range(steps):
        for p in params:
            p.grad = _grads(step, p)
        dense.step()
    return start, [p.detach() for p in params]


def test_dense_sgd_momentum_and_weight_decay_reach_the_update():
    lr, mom, wd = 0.1, 0.9, 0.3
    start, got = _run_dense(DenseOptimConfig(name="sgd", lr=lr, momentum=mom, weight_decay=wd))
    for i, w in enumerate(start):
        w, buf = w.clone(), None
        for step in range(2):
            g = _grads(step, w) + wd * w
            buf = g if buf is None else mom * buf + g
            w = w - lr * buf
        torch.testing.assert_close(got[i], w, rtol=1e-12, atol=1e-12)


def test_dense_adagrad_weight_decay_and_eps_reach_the_update():
    lr, eps, wd = 0.1, 0.5, 0.3
    start, got = _run_dense(DenseOptimConfig(name="adagrad", lr=lr, eps=eps, weight_decay=wd))
    for i, w in enumerate(start):
        w, s = w.clone(), torch.zeros_like(w)
        for step in range(2):
            g = _grads(step, w) + wd * w
            s = s + g * g
            w = w - lr * g / (s.sqrt() + eps)
        torch.testing.assert_close(got[i], w, rtol=1e-12, atol=1e-12)


def test_dense_adam_weight_decay_and_eps_reach_the_update():
    lr, eps, wd, b1, b2 = 0.1, 0.5, 0.3, 0.9, 0.999
    start, got = _run_dense(DenseOptimConfig(name="adam", lr=lr, eps=eps, weight_decay=wd))
    for i, w in enumerate(start):
        w, m, v = w.clone(), torch.zeros_like(w), torch.zeros_like(w)
        for t in (1, 2):
            g = _grads(t - 1, w) + wd * w  # Adam's L2: added to the gradient (not AdamW)
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            w = w - lr * (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
        torch.testing.assert_close(got[i], w, rtol=1e-12, atol=1e-12)


def test_rowwise_adagrad_uses_the_configured_eps():
    model = _model()
    lr, eps = 0.2, 0.5
    _, sparse = build_optimizers(model, OptimConfig(sparse=SparseOptimConfig(name="rowwise_adagrad", lr=lr, eps=eps)))
    w0 = model.sparse_arch.weight.detach().clone()
    raw = torch.tensor([[1, 2], [1, 0]])
    grad_out = torch.tensor([[[1.0, -2.0], [0.5, 0.5]], [[3.0, 1.0], [-1.0, 2.0]]], dtype=torch.float64)
    model.sparse_arch(raw).backward(grad_out)
    sparse.step()
    rows = model.sparse_arch.rows(raw).flatten()
    g = torch.zeros_like(w0).index_add_(0, rows, grad_out.reshape(-1, 2))
    expected = w0.clone()
    for r in torch.unique(rows).tolist():
        expected[r] -= lr * g[r] / (g[r].square().mean().sqrt() + eps)
    torch.testing.assert_close(model.sparse_arch.weight.detach(), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("tensor_lr", [False, True])
def test_capturable_adagrad_one_pass_path_matches_float64(monkeypatch, tensor_lr):
    """The one-pass Triton update CapturableAdagrad takes on CUDA: there as it is, on the CPU forced (the kernel
    runs under TRITON_INTERPRET=1, which tests/conftest.py sets only where CUDA is absent): weight decay, eps and the
    learning rate all reach it."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    calls, real_one_pass = [], adagrad_mod._one_pass

    def one_pass(params, grads, sums):
        if device.type == "cuda":
            calls.append(real_one_pass(params, grads, sums))
        else:
            calls.append(all(t.dtype == torch.float32 and t.is_contiguous() for t in (*params, *grads, *sums)))
        return calls[-1]

    monkeypatch.setattr(adagrad_mod, "_one_pass", one_pass)
    lr, eps, wd = 0.05, 0.5, 0.2
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in [(3,), (2, 4)]]
    ref = [p.detach().double().cpu().clone() for p in params]
    sums = [torch.zeros_like(r) for r in ref]
    opt = CapturableAdagrad(params, lr=torch.tensor(lr, device=device) if tensor_lr else lr, eps=eps, weight_decay=wd)
    for step in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(device)
        for r, s, p in zip(ref, sums, params):
            gd = p.grad.double().cpu() + wd * r
            s += gd * gd
            r -= lr * gd / (s.sqrt() + eps)
        opt.step()
    assert calls == [True] * 3  # the one-pass path ran at every step
    for p, r, s in zip(params, ref, sums):  # fp32 against float64
        torch.testing.assert_close(p.detach().double().cpu(), r, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(opt.state[p]["sum"].double().cpu(), s, rtol=1e-5, atol=1e-6)
        assert float(opt.state[p]["step"]) == 3.0
