"""Regularization that works with sparse updates (#21): lazy weight decay of the touched embedding rows
(``optim.sparse.weight_decay``) in the eager sparse optimizers and in the Triton fused update, both
against a float64 reference and against each other; dropout between MLP layers (``model.dropout``)."""

from __future__ import annotations

import pytest
import torch

from dlrm.config import ConfigError, OptimConfig, SparseOptimConfig, config_from_dict
from dlrm.model.archs import SparseArch
from dlrm.train.optim import build_optimizers, decay_touched_rows_

# Triton runs on the GPU where there is one, in the interpreter otherwise (tests/conftest.py sets it)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CARDS = [5, 1, 4, 7]
LR, EPS, WD = 0.1, 1e-8, 0.3
OPTIMIZERS = ["sgd", "adagrad", "rowwise_adagrad"]


def batches(steps: int = 3):
    """(raw [B, 4], upstream gradient [B, 4, 3]) per step; rows repeat within a batch (hot rows), and
    some rows are never touched (so the decay must leave them alone)."""
    gen = torch.Generator().manual_seed(5)
    out = []
    for step in range(steps):
        raw = torch.tensor([[0, 7, 3, 2], [0, 7, 3, 2], [5, 7, 3, 9], [-1, 0, 11, 2], [0, 7, 2, 16]])
        if step == 1:
            raw = torch.randint(-1, 50, (4, 4), generator=gen)
        out.append((raw, torch.randn(raw.shape[0], 4, 3, generator=gen, dtype=torch.float64)))
    return out


def reference(name: str, weight: torch.Tensor, steps, rows_of) -> torch.Tensor:
    """The weights after `steps`, in float64: summed gradient per touched row, plus WD * w, then the rule."""
    w = weight.detach().to(torch.float64).clone()
    r, d = w.shape
    state = torch.zeros(r, d, dtype=torch.float64) if name == "adagrad" else torch.zeros(r, dtype=torch.float64)
    for raw, grad_out in steps:
        rows = rows_of(raw).flatten()
        g = torch.zeros(r, d, dtype=torch.float64).index_add_(0, rows, grad_out.reshape(-1, d))
        t = torch.unique(rows)
        g_t = g[t] + WD * w[t]
        if name == "sgd":
            w[t] -= LR * g_t
        elif name == "adagrad":
            state[t] += g_t.square()
            w[t] -= LR * g_t / (state[t].sqrt() + EPS)
        else:
            state[t] += g_t.square().mean(1)
            w[t] -= LR * g_t / (state[t].sqrt() + EPS).unsqueeze(1)
    return w


def model_with(sparse_arch):
    model = torch.nn.Module()
    model.sparse_arch = sparse_arch
    model.other = torch.nn.Linear(2, 1)
    return model


def train_steps(model, name: str, steps, deterministic: bool = True):
    """The sparse optimizer's steps over `steps`; returns the weight (on the CPU)."""
    cfg = OptimConfig(sparse=SparseOptimConfig(name=name, lr=LR, eps=EPS, weight_decay=WD))
    _, sparse = build_optimizers(model, cfg, deterministic)
    weight = model.sparse_arch.weight
    for raw, grad_out in steps:
        model.sparse_arch(raw.to(weight.device)).backward(grad_out.to(weight.device, weight.dtype))
        sparse.step()
        sparse.zero_grad(set_to_none=True)
    return weight.detach().cpu()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_eager_sparse_weight_decay_matches_float64_reference(name):
    torch.manual_seed(0)
    arch = SparseArch(CARDS, dim=3).double()
    before = arch.weight.detach().clone()
    steps = batches()
    expected = reference(name, before, steps, arch.rows)
    got = train_steps(model_with(arch), name, steps)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    untouched = torch.ones(sum(CARDS), dtype=torch.bool)
    untouched[torch.cat([arch.rows(raw).flatten() for raw, _ in steps])] = False
    assert untouched.any() and torch.equal(got[untouched], before[untouched])


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_triton_fused_weight_decay_matches_float64_reference_and_eager(name):
    from kernels.embedding import TritonSparseEmbedding

    torch.manual_seed(0)
    triton_arch = TritonSparseEmbedding(CARDS, 3).to(DEVICE)
    eager_arch = SparseArch(CARDS, dim=3)
    eager_arch.weight.data.copy_(triton_arch.weight.detach().cpu())
    steps = batches()
    expected = reference(name, triton_arch.weight.cpu(), steps, eager_arch.rows)
    fused = train_steps(model_with(triton_arch), name, steps)
    eager = train_steps(model_with(eager_arch), name, steps)
    torch.testing.assert_close(fused.to(torch.float64), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-6)  # the same numbers either way


def test_triton_nondeterministic_sgd_still_decays_each_row_once():
    """Plain SGD's atomic path adds per position; with weight decay the update takes the sorted
    segments instead, so a row looked up 3 times in a batch is decayed once."""
    from kernels.embedding import TritonSparseEmbedding

    torch.manual_seed(0)
    arch = TritonSparseEmbedding(CARDS, 3).to(DEVICE)
    steps = batches()
    expected = reference("sgd", arch.weight.cpu(), steps, SparseArch(CARDS, dim=3).rows)
    got = train_steps(model_with(arch), "sgd", steps, deterministic=False)
    torch.testing.assert_close(got.to(torch.float64), expected, rtol=1e-5, atol=1e-6)


def test_decay_of_a_dense_gradient_touches_only_its_nonzero_rows():
    w = torch.nn.Parameter(torch.arange(8.0).reshape(4, 2))
    w.grad = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0], [0.0, -2.0]])
    decay_touched_rows_(w, 0.5)
    torch.testing.assert_close(w.grad, torch.tensor([[0.0, 0.0], [2.0, 1.5], [0.0, 0.0], [3.0, 1.5]]))


def test_zero_weight_decay_changes_nothing():
    torch.manual_seed(0)
    arch = SparseArch(CARDS, dim=3)
    arch(torch.tensor([[0, 7, 3, 2]])).sum().backward()
    grad = arch.weight.grad
    decay_touched_rows_(arch.weight, 0.0)
    assert arch.weight.grad is grad


@pytest.mark.parametrize("raw, message", [
    ({"optim": {"sparse": {"weight_decay": -0.1}}}, "optim.sparse.weight_decay: -0.1 must be >= 0"),
    ({"model": {"dropout": 1.0}}, r"model.dropout: 1.0 must be within \[0, 1\)"),
    ({"model": {"dropout": -0.5}}, r"model.dropout: -0.5 must be within \[0, 1\)"),
    ({"train": {"baseline": "sometimes"}}, "train.baseline: 'sometimes' is not"),
])
def test_bad_values_are_one_line_errors(raw, message):
    with pytest.raises(ConfigError, match=message) as err:
        config_from_dict(raw, "cfg.json")
    assert "\n" not in str(err.value) and str(err.value).startswith("cfg.json: ")


def dropout_calls(module: torch.nn.Module):
    """(input, output) of every nn.Dropout call inside `module`, recorded by forward hooks."""
    calls = []
    for m in module.modules():
        if isinstance(m, torch.nn.Dropout):
            m.register_forward_hook(lambda mod, args, out: calls.append((args[0].detach(), out.detach())))
    return calls


@pytest.mark.parametrize("mlp_kernel", ["torch", "triton"])
def test_dropout_sits_between_mlp_layers_and_only_in_training(mlp_kernel):
    from dlrm.config import KernelsConfig, ModelConfig
    from dlrm.model.dlrm import build_model

    cfg = ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[6, 5, 1], dropout=0.5)
    torch.manual_seed(0)
    model = build_model(cfg, [3] * 26, kernels=KernelsConfig(embedding="torch", interaction="torch", mlp=mlp_kernel,
                                                             loss="torch"), device=DEVICE)
    torch.manual_seed(0)
    plain = build_model(ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[6, 5, 1]), [3] * 26, device=DEVICE)
    assert set(model.state_dict()) == set(plain.state_dict())  # checkpoints load either way
    plain.load_state_dict(model.state_dict())
    calls = dropout_calls(model)
    dense, raw = torch.rand(64, 13, device=DEVICE), torch.randint(-1, 9, (64, 26), device=DEVICE)
    model.train()
    train_out = model(dense, raw)
    # bottom 13-8-4: one gap; top -6-5-1: two gaps; never after the last layer of either (the logit)
    assert [out.shape[1] for _, out in calls] == [8, 6, 5]
    for inp, out in calls:
        kept = out != 0
        torch.testing.assert_close(out[kept], inp[kept] * 2.0)  # inverted dropout: kept units scaled by 1/(1-p)
        assert 0.3 < (~kept & (inp != 0)).sum() / (inp != 0).sum() < 0.7
    assert not torch.allclose(train_out, plain(dense, raw))
    calls.clear()
    model.eval()
    # evaluation sees the whole net (a Triton linear on a GPU rounds a little differently from cuBLAS)
    tol = {"rtol": 1e-4, "atol": 1e-4} if mlp_kernel == "triton" else {}
    torch.testing.assert_close(model(dense, raw), plain(dense, raw), **tol)
    assert all(torch.equal(inp, out) for inp, out in calls)


def test_no_dropout_module_when_off():
    from dlrm.config import ModelConfig
    from dlrm.model.dlrm import build_model

    model = build_model(ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[6, 1]), [3] * 26)
    assert not any(isinstance(m, torch.nn.Dropout) for m in model.modules())
