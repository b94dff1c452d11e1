"""Whole-model checks of the Triton kernels against the eager model.

* the Triton modules have the same parameters, state_dict keys and (same seed) initial values as the eager
  arches, and checkpoints load across;
* 20 training steps (a whole epoch, warmup and linear decay) through the public trainer API
  (`dlrm.train.trainer.train`) with every kernel = triton give the same per-step losses as kernels = torch from the
  same seed;
* 50 steps of the fused embedding backward + optimizer (SGD, Adagrad, row-wise Adagrad) track the eager
  SparseArch + torch optimizers on hot-row batches.

Tiny model sizes keep the Triton interpreter fast on the CPU; on CUDA the same tests run on the GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from dlrm.config import KernelsConfig, ModelConfig, config_from_dict
from dlrm.model.archs import SparseArch
from dlrm.model.dlrm import build_loss, build_model
from dlrm.train.optim import RowWiseAdagrad
from kernels.embedding import SparseOptimizerConfig, TritonSparseEmbedding
from kernels.interaction import TritonDotInteraction
from kernels.linear import TritonLinear
from tests.conftest import make_dataset

ALL_TRITON = KernelsConfig(embedding="triton", interaction="triton", mlp="triton", loss="triton")
TINY = ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1])


def _vocabs(cards_minus_one: list[int], seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.unique(torch.randint(-1, 50, (n,), generator=gen)) for n in cards_minus_one]


@pytest.mark.parametrize("hashing", ["modulus", "vocabulary"])
def test_triton_model_matches_eager_parameters_and_forward(hashing, device):
    if hashing == "vocabulary":
        vocabs = _vocabs([3, 9, 0, 20] * 6 + [5, 1])
        cards = [len(v) + 1 for v in vocabs]
    else:
        vocabs, cards = None, [5, 1, 300, 17] * 6 + [2, 3]
    cfg = ModelConfig(embedding_dim=16, bottom_mlp=[24, 16], top_mlp=[24, 1], activation="gelu")
    torch.manual_seed(0)
    eager = build_model(cfg, cards, vocabs, KernelsConfig(), device)
    torch.manual_seed(0)
    fused = build_model(cfg, cards, vocabs, ALL_TRITON, device)
    assert isinstance(fused.sparse_arch, TritonSparseEmbedding)
    assert isinstance(fused.dense_arch.model.layers[0], TritonLinear)
    assert isinstance(fused.interaction_arch.op, TritonDotInteraction)
    # same parameter names and shapes, same state_dict keys, same initial values for the same seed
    assert [(n, p.shape) for n, p in eager.named_parameters()] == [(n, p.shape) for n, p in fused.named_parameters()]
    sd_e, sd_t = eager.state_dict(), fused.state_dict()
    assert list(sd_e) == list(sd_t)
    for k in sd_e:
        assert torch.equal(sd_e[k], sd_t[k]), k
    # checkpoints load across (strict)
    fused.load_state_dict(sd_e)
    eager.load_state_dict(sd_t)

    gen = torch.Generator().manual_seed(1)
    B = 127
    dense = torch.randn(B, 13, generator=gen).to(device)
    sparse = torch.randint(-1, 60, (B, 26), generator=gen).to(device)
    labels = torch.randint(0, 2, (B,), generator=gen).float().to(device)
    assert fused.sparse_arch.hashing == eager.sparse_arch.hashing == hashing
    assert fused.sparse_arch.num_features == eager.sparse_arch.num_features == 26
    assert torch.equal(fused.sparse_arch.rows(sparse), eager.sparse_arch.rows(sparse))
    logits_e, logits_t = eager(dense, sparse), fused(dense, sparse)
    torch.testing.assert_close(logits_t, logits_e, atol=1e-5, rtol=1e-5)
    loss_e = build_loss(KernelsConfig())(logits_e, labels)
    loss_t = build_loss(ALL_TRITON)(logits_t, labels)
    torch.testing.assert_close(loss_t, loss_e, atol=1e-6, rtol=1e-6)
    loss_e.backward()
    loss_t.backward()
    for (n, pe), (_, pt) in zip(eager.named_parameters(), fused.named_parameters()):
        ge = pe.grad.to_dense() if pe.grad.is_sparse else pe.grad
        torch.testing.assert_close(pt.grad, ge, atol=1e-6, rtol=1e-5, msg=lambda m: f"{n}: {m}")


def _train_config(data_dir, tb_dir, kernels: str, run_name: str, batch_size: int = 16):
    return config_from_dict(
        {
            "data": {"path": str(data_dir), "batch_size": batch_size, "shuffle": True, "prefetch": 1},
            "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1], "activation": "relu"},
            "optim": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.05},
                      "schedule": {"warmup_steps": 5, "decay": "linear"}},
            # baseline off: no assertion reads it, and its L-BFGS fit (default "auto": on, for these few CPU rows) was
            # 30% of a resume test's time
            "train": {"epochs": 1, "max_steps": 50, "log_every": 1, "device": "cuda" if torch.cuda.is_available() else "cpu",
                      "seed": 3, "compile": False, "baseline": False},
            "kernels": {k: kernels for k in ("embedding", "interaction", "mlp", "loss")},
            "log": {"tb_dir": str(tb_dir), "run_name": run_name},
        },
        "test",
    )


def test_twenty_training_steps_triton_vs_torch(tmp_path):
    """The trainer, run twice from the same seed: every per-step loss of the all-triton model equals the
    all-torch one to fp32 rounding (relative 5e-5 after 20 Adam / row-wise Adagrad steps), and the final
    evaluation agrees."""
    from dlrm.train.trainer import train

    # batch 7, odd: one interaction program (8 samples) with its last sample masked, 182 lookups in 3 update chunks.
    # Batch 16 (until 2026-12-01) took 40 s on the 2-core CPU, most in the Triton interpreter, whose cost grows with the
    # samples and lookups a step. 20 steps (50 until 2026-12-03: 10 s of interpreted steps): still one epoch with the 5
    # warmup steps and the linear decay to the end, and the bounds halved from those of 50 steps (rtol 1e-4, atol
    # 1e-5, the final logloss within 1e-4), as fewer steps drift less. Measured on the CPU: losses within 1.2e-7
    # (relative 1.6e-7) at 20 steps, 1.8e-7 (3.1e-7) at 50; the final logloss within 6e-9.
    steps, B = 20, 7
    data = tmp_path / "ds"
    make_dataset(data, {"train": steps * B, "validation": 40}, row_group_size=50)
    cfgs = {k: _train_config(data, tmp_path / "tb", k, k, B) for k in ("torch", "triton")}
    for c in cfgs.values():
        c.train.max_steps = steps
    summaries = {k: train(c) for k, c in cfgs.items()}
    a, b = summaries["torch"], summaries["triton"]
    assert a["steps"] == b["steps"] == steps
    steps_a, losses_a = zip(*a["train_losses"])
    steps_b, losses_b = zip(*b["train_losses"])
    assert list(steps_a) == list(steps_b) == list(range(1, steps + 1))
    assert all(math.isfinite(x) for x in losses_b)
    torch.testing.assert_close(torch.tensor(losses_b, dtype=torch.float64), torch.tensor(losses_a, dtype=torch.float64),
                               atol=5e-6, rtol=5e-5)
    assert losses_a[0] != losses_a[-1]  # it actually trained
    for k in ("logloss", "accuracy"):
        assert b[k] == pytest.approx(a[k], abs=5e-5), k
    assert b["config"]["kernels"]["mlp"] == "triton"


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
def test_fused_sparse_update_fifty_steps_matches_eager(optimizer, device):
    """TritonSparseEmbedding with the optimizer fused into its backward vs the eager SparseArch (sparse COO
    gradients) + the torch optimizer, 50 steps on batches with hot rows, same losses and weights."""
    cards, D, B, lr, eps = [7, 1, 40, 3], 16, 24, 0.05, 1e-8
    torch.manual_seed(0)
    eager = SparseArch(cards, D).to(device)
    torch.manual_seed(0)
    fused = TritonSparseEmbedding(cards, D).to(device)
    assert torch.equal(eager.weight, fused.weight)
    assert list(eager.state_dict()) == list(fused.state_dict()) == ["weight"]
    if optimizer == "sgd":
        opt = torch.optim.SGD(eager.parameters(), lr=lr)
    elif optimizer == "adagrad":
        opt = torch.optim.Adagrad(eager.parameters(), lr=lr, eps=eps)
    else:
        opt = RowWiseAdagrad(eager.parameters(), lr=lr, eps=eps)
    cfg = fused.use_fused_update(SparseOptimizerConfig(optimizer, torch.tensor([lr], device=device), eps=eps))
    gen = torch.Generator().manual_seed(1)
    proj = torch.randn(D, generator=gen).to(device)
    for step in range(50):
        raw = torch.randint(-1, 2**32, (B, len(cards)), generator=gen)
        raw[: B // 2, 2] = 5  # a hot row: half the batch on one row of table 2
        raw = raw.to(device)
        target = torch.randn(B, generator=gen).to(device)
        losses = []
        for model in (eager, fused):
            out = model(raw)
            loss = ((out * proj).sum(-1).sum(-1) - target).square().mean()
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert fused.weight.grad is None
        torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-5, msg=lambda m: f"step {step}: {m}")
    torch.testing.assert_close(fused.weight, eager.weight, atol=1e-5, rtol=1e-5)
    if optimizer == "rowwise_adagrad":
        torch.testing.assert_close(cfg.state, opt.state[eager.weight]["sum"], atol=1e-5, rtol=1e-5)
    elif optimizer == "adagrad":
        torch.testing.assert_close(cfg.state, opt.state[eager.weight]["sum"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_fused_update_resume_matches_uninterrupted(tmp_path, optimizer):
    """kernels.embedding = triton trains through FusedSparseOptimizer (the update inside the backward, no
    weight.grad); a run stopped at step 6 and resumed from its checkpoint ends bitwise where an
    uninterrupted 14-step run ends: weights, row-wise Adagrad sums and scheduled lr all come back."""
    from dlrm import checkpoint as ckpt
    from dlrm.train.trainer import train

    # batch 8 (16 until 2026-12-02): the Triton interpreter's cost grows with the lookups a step, and 8 samples of
    # 26 features over 11-row tables still hit rows several times a step; steps and the resume point are kept
    B = 8
    data = tmp_path / "ds"
    make_dataset(data, {"train": 24 * B, "validation": 40}, row_group_size=50)

    def cfg(run, max_steps):
        c = _train_config(data, tmp_path / "tb", "triton", run, B)
        if not torch.cuda.is_available():  # the other Triton kernels hold no state a resume restores; under the CPU's
            c.kernels.interaction = c.kernels.mlp = c.kernels.loss = "torch"  # interpreter they were ~75% of the time
        c.optim.sparse.name = optimizer
        c.optim.schedule.decay = "none"  # the schedule must not depend on max_steps, which differs here
        c.train.max_steps, c.train.deterministic = max_steps, True
        c.checkpoint.every = 6
        return c

    full = train(cfg("full", 14))
    train(cfg("part", 6))
    resumed = train(cfg("part", 14), resume="latest")
    assert full["steps"] == resumed["steps"] == 14 and resumed["resumed_from"] and resumed["resumed_at_step"] == 6
    a = torch.load(ckpt.list_checkpoints(tmp_path / "tb" / "full")[-1], weights_only=False)
    b = torch.load(ckpt.list_checkpoints(tmp_path / "tb" / "part")[-1], weights_only=False)
    assert a["position"] == b["position"]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    sparse_a, sparse_b = a["optimizers"][1], b["optimizers"][1]
    assert sparse_a["param_groups"][0]["lr"] == sparse_b["param_groups"][0]["lr"] == pytest.approx(0.05)
    if optimizer == "rowwise_adagrad":
        (sa,), (sb,) = sparse_a["state"].values(), sparse_b["state"].values()
        assert sa["sum"].shape == (a["model"]["sparse_arch.weight"].shape[0],)
        assert sa["sum"].abs().sum() > 0  # the fused backward really accumulated into the checkpointed state
        assert torch.equal(sa["sum"], sb["sum"])
    assert full["train_losses"][-1] == resumed["train_losses"][-1]


def test_triton_embedding_gets_the_fused_optimizer(device):
    from dlrm.config import OptimConfig, SparseOptimConfig
    from dlrm.train.optim import FusedSparseOptimizer, build_optimizers

    model = build_model(TINY, [5, 7, 1], None, ALL_TRITON, device)
    dense, sparse = build_optimizers(model, OptimConfig(sparse=SparseOptimConfig(name="sgd", lr=0.3)))
    assert isinstance(sparse, FusedSparseOptimizer)
    assert not model.sparse_arch.weight.requires_grad
    assert all(p is not model.sparse_arch.weight for g in dense.param_groups for p in g["params"])
    sparse.param_groups[0]["lr"] = 0.125  # what a scheduler does
    sparse.load_lr()
    assert sparse.fused.lr.item() == 0.125
    before = model.sparse_arch.weight.detach().clone()
    dense_x = torch.randn(3, 13, device=device)
    raw = torch.tensor([[0, 1, 2], [0, 3, 4], [1, 1, 1]], device=device)
    model(dense_x, raw).sum().backward()
    assert model.sparse_arch.weight.grad is None
    changed = (model.sparse_arch.weight != before).any(dim=1)
    rows = model.sparse_arch.rows(raw).unique()
    assert changed.nonzero().flatten().tolist() == rows.tolist()  # exactly the looked-up rows moved
