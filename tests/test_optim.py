"""Sparse optimizers against float64 dense-gradient references (hot rows included), LR schedule."""

import copy
import math

import pytest
import torch

from dlrm.config import OptimConfig, ScheduleConfig, SparseOptimConfig
from dlrm.model.archs import SparseArch
from dlrm.train.optim import FusedSparseOptimizer, RowWiseAdagrad, build_optimizers, lr_multiplier


def hot_row_batch():
    # 3 features over tables of 5, 1 and 4 rows; many positions hit the same rows.
    raw = torch.tensor([[0, 7, 3], [0, 7, 3], [5, 7, 3], [-1, 0, 11], [0, 7, 2]])
    return raw


def test_rowwise_adagrad_matches_dense_reference_over_steps():
    torch.manual_seed(0)
    arch = SparseArch([5, 1, 4], dim=3).double()
    ref_w = arch.weight.detach().clone()
    ref_state = torch.zeros(10, dtype=torch.float64)
    opt = RowWiseAdagrad([arch.weight], lr=0.1, eps=1e-8)
    for step in range(3):
        raw = hot_row_batch() if step != 1 else torch.randint(-1, 50, (4, 3))
        grad_out = torch.randn(raw.shape[0], 3, 3, dtype=torch.float64)
        arch(raw).backward(grad_out)
        opt.step()
        opt.zero_grad()
        # reference: dense gradient, update only rows that were touched
        rows = arch.rows(raw).flatten()
        g = torch.zeros(10, 3, dtype=torch.float64).index_add_(0, rows, grad_out.reshape(-1, 3))
        touched = torch.unique(rows)
        ref_state[touched] += g[touched].square().mean(1)
        ref_w[touched] -= 0.1 * g[touched] / (ref_state[touched].sqrt() + 1e-8).unsqueeze(1)
        torch.testing.assert_close(arch.weight.detach(), ref_w, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(opt.state[arch.weight]["sum"], ref_state, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["sgd", "adagrad"])
def test_sparse_sgd_and_adagrad_update_only_touched_rows(name):
    torch.manual_seed(1)
    model = torch.nn.Module()
    model.sparse_arch = SparseArch([5, 1, 4], dim=2)
    model.other = torch.nn.Linear(2, 1)
    _, sparse = build_optimizers(model, OptimConfig(sparse=SparseOptimConfig(name=name, lr=0.5)))
    before = model.sparse_arch.weight.detach().clone()
    raw = hot_row_batch()
    grad_out = torch.randn(5, 3, 2)
    model.sparse_arch(raw).backward(grad_out)
    sparse.step()
    rows = model.sparse_arch.rows(raw).flatten()
    g = torch.zeros(10, 2).index_add_(0, rows, grad_out.reshape(-1, 2))
    if name == "sgd":
        expected = before - 0.5 * g
    else:  # element-wise Adagrad, first step: state = g^2
        expected = before - 0.5 * g / (g.abs() + 1e-10)
        expected[g == 0] = before[g == 0]
    torch.testing.assert_close(model.sparse_arch.weight.detach(), expected, rtol=1e-5, atol=1e-6)
    untouched = torch.ones(10, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(model.sparse_arch.weight.detach()[untouched], before[untouched])


def test_lr_schedule_warmup_hold_decay():
    cfg = ScheduleConfig(warmup_steps=4, decay="linear", decay_start_step=10, decay_steps=10, end_factor=0.2)
    assert [lr_multiplier(s, cfg, 100) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_multiplier(9, cfg, 100) == 1.0
    assert lr_multiplier(15, cfg, 100) == pytest.approx(0.6)
    assert lr_multiplier(20, cfg, 100) == pytest.approx(0.2) == lr_multiplier(99, cfg, 100)
    cos = ScheduleConfig(decay="cosine", end_factor=0.0)
    assert lr_multiplier(0, cos, 11) == 1.0
    assert lr_multiplier(5, cos, 11) == pytest.approx(0.5 * (1 + math.cos(math.pi * 5 / 11)))
    assert lr_multiplier(11, cos, 11) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam"])
def test_fused_dense_optimizer_equals_the_default_one(name):
    """optim.dense.fused (the default on CUDA) takes the same steps as the default implementation."""
    from dlrm.config import config_from_dict
    from dlrm.model.dlrm import build_model
    from dlrm.train.optim import build_optimizers

    runs = {}
    for fused in (False, True):
        cfg = config_from_dict({"model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
                                "optim": {"dense": {"name": name, "lr": 0.05, "momentum": 0.9 if name == "sgd" else 0.0,
                                                    "fused": fused}}})
        torch.manual_seed(0)
        model = build_model(cfg.model, [5] * 26)
        dense, _ = build_optimizers(model, cfg.optim)
        assert dense.defaults.get("fused") is (True if fused else None)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x, raw = torch.randn(16, 13, generator=g), torch.randint(-1, 2**32, (16, 26), generator=g)
            model(x, raw).square().mean().backward()
            dense.step()
            dense.zero_grad()
        runs[fused] = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.startswith("sparse")}
    for k in runs[False]:
        torch.testing.assert_close(runs[True][k], runs[False][k], rtol=1e-5, atol=1e-6, msg=k)


def test_dense_optimizer_is_fused_by_default_only_where_torch_has_the_kernel():
    from dlrm.train.optim import default_fused

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert default_fused("sgd", cuda) and default_fused("adam", cuda)
    assert not default_fused("adagrad", cuda)  # torch has no fused CUDA Adagrad: it would raise
    assert not any(default_fused(n, cpu) for n in ("sgd", "adam", "adagrad"))


@pytest.mark.parametrize("pooled", [False, True], ids=["one-hot", "multi-hot"])
def test_fused_sparse_optimizer_state_round_trip_keeps_fp32_sums_and_the_seed(pooled):
    """A bf16 table's fused row-wise Adagrad: its fp32 sums and its stochastic-rounding seed survive
    state_dict -> load_state_dict exactly (torch's Optimizer.load_state_dict alone would cast the sums
    to bf16 and the int64 seed to a float); a state dict written before the seed was saved still loads."""
    from kernels.embedding import TritonPooledEmbedding, TritonSparseEmbedding

    # the Triton kernels run on CUDA where there is one, in the interpreter otherwise (conftest)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def build():
        torch.manual_seed(0)
        if pooled:
            emb = TritonPooledEmbedding([50, 7], [2, 1], 16, dtype=torch.bfloat16).to(device)
        else:
            emb = TritonSparseEmbedding([50, 7], 16, dtype=torch.bfloat16).to(device)
        return emb, FusedSparseOptimizer(emb, "rowwise_adagrad", lr=0.1, eps=1e-8, deterministic=True)

    emb, opt = build()
    raw = torch.tensor([[3, 1, 5], [9, 2, 5], [3, 4, 0]]) if pooled else torch.tensor([[3, 1], [9, 2], [3, 4]])
    raw = raw.to(device)
    g = torch.randn(3, 2, 16, generator=torch.Generator().manual_seed(1)).to(device)
    for _ in range(3):
        (emb(raw).float() * g).sum().backward()
    sums, seed = opt.fused.state.clone(), emb.sr_seed.clone()
    assert sums.dtype == torch.float32 and int(seed) == 3
    # values that bf16 cannot hold: a cast on load would show
    assert not torch.equal(sums, sums.to(torch.bfloat16).float())
    state = copy.deepcopy(opt.state_dict())

    emb2, opt2 = build()
    opt2.load_state_dict(state)
    assert opt2.fused.state.dtype == torch.float32 and torch.equal(opt2.fused.state, sums)
    assert opt2.state[emb2.weight]["sum"] is opt2.fused.state  # the kernel's own tensor, updated in place
    assert emb2.sr_seed.dtype == torch.int64 and torch.equal(emb2.sr_seed, seed)
    assert opt2.state[emb2.weight]["sr_seed"] is emb2.sr_seed

    old = copy.deepcopy(state)
    del old["state"][0]["sr_seed"]  # a checkpoint from before the seed was saved
    emb3, opt3 = build()
    opt3.load_state_dict(old)
    assert torch.equal(opt3.fused.state, sums) and int(emb3.sr_seed) == 0
