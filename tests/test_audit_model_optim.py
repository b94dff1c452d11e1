"""Audit of the model pieces and optimizers: each test failed on the code before its fix.

Checkpoints move between the eager sparse optimizers and `FusedSparseOptimizer` (``kernels.embedding``
and ``train.compile`` are free keys on resume, `dlrm.train.resume_policy`): a state dict of either
must load into the other and train on exactly as the uninterrupted run would.
"""

import copy

import pytest
import torch

from dlrm.config import OptimConfig, SparseOptimConfig
from dlrm.model.archs import SparseArch
from dlrm.model.fused_sparse import FusedUpdateSparseArch
from dlrm.train.optim import FusedSparseOptimizer, build_optimizers

CARDS = [5, 7, 3]
LR, EPS = 0.25, 2.0**-20  # exact in fp32 (the fused update keeps its lr in an fp32 tensor)


class _Model(torch.nn.Module):
    """What build_optimizers needs: a sparse arch and one dense parameter."""

    def __init__(self, sparse_arch):
        super().__init__()
        self.sparse_arch = sparse_arch
        self.dense = torch.nn.Parameter(torch.zeros(2))


def _optimizers(arch, name, weight_decay=0.0):
    cfg = OptimConfig(sparse=SparseOptimConfig(name=name, lr=LR, eps=EPS, weight_decay=weight_decay))
    return build_optimizers(_Model(arch), cfg)[1]


def _batches():
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        raw = torch.randint(-1, 9, (5, len(CARDS)), generator=gen)
        raw[:2] = raw[2]  # rows repeated in the batch
        yield raw, torch.randn(5, len(CARDS), 4, generator=gen, dtype=torch.float64)


def _train(arch, opt, batches):
    for raw, g in batches:
        (arch(raw) * g).sum().backward()
        opt.step()
        opt.zero_grad()


def _fresh(cls):
    torch.manual_seed(0)
    return cls(CARDS, 4).double()


@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_a_fused_sparse_optimizer_checkpoint_resumes_with_the_eager_optimizer(name, weight_decay):
    """A run with the fused update (Triton embedding, or torch.compile) resumed with the eager embedding:
    the state dict loads and training continues as the uninterrupted eager run (SGD: KeyError 'momentum',
    Adagrad: KeyError 'step' before the fix)."""
    batches = list(_batches())
    ref = _fresh(SparseArch)
    _train(ref, _optimizers(ref, name, weight_decay), batches)

    fused = _fresh(FusedUpdateSparseArch)
    fused_opt = _optimizers(fused, name, weight_decay)
    assert isinstance(fused_opt, FusedSparseOptimizer)
    _train(fused, fused_opt, batches[:2])
    state = copy.deepcopy(fused_opt.state_dict())

    eager = _fresh(SparseArch)
    eager.load_state_dict(fused.state_dict())
    eager_opt = _optimizers(eager, name, weight_decay)
    eager_opt.load_state_dict(state)
    _train(eager, eager_opt, batches[2:])
    torch.testing.assert_close(eager.weight.detach(), ref.weight.detach(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad"])
def test_an_eager_checkpoint_of_step_0_resumes_with_the_fused_update(name):
    """A checkpoint written before the first step (a signal during it) by the eager row-wise Adagrad holds no
    state yet: the fused update starts from zero sums as the eager run would (KeyError 'sum' before the fix)."""
    batches = list(_batches())
    ref = _fresh(SparseArch)
    _train(ref, _optimizers(ref, name), batches)

    eager = _fresh(SparseArch)
    state = copy.deepcopy(_optimizers(eager, name).state_dict())
    fused = _fresh(FusedUpdateSparseArch)
    fused_opt = _optimizers(fused, name)
    if fused_opt.fused.state is not None:
        fused_opt.fused.state.fill_(7.0)  # what was there must not survive the load
    fused_opt.load_state_dict(state)
    _train(fused, fused_opt, batches)
    torch.testing.assert_close(fused.weight.detach(), ref.weight.detach(), rtol=1e-12, atol=1e-12)


def _run_optimizers(dense_lr, sparse_lr, sparse="rowwise_adagrad", fused=False):
    from dlrm.config import DenseOptimConfig

    torch.manual_seed(0)
    model = _Model((FusedUpdateSparseArch if fused else SparseArch)(CARDS, 4))
    cfg = OptimConfig(dense=DenseOptimConfig(name="adagrad", lr=dense_lr, weight_decay=dense_lr / 10),
                      sparse=SparseOptimConfig(name=sparse, lr=sparse_lr, eps=sparse_lr / 1000))
    return list(build_optimizers(model, cfg)), model


SCHEDULES = {
    "constant": dict(),
    "warmup+cosine": dict(warmup_steps=2, decay="cosine", decay_start_step=3, end_factor=0.1),
}


@pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_a_learning_rate_change_allowed_on_resume_is_the_one_trained_with(schedule, fused):
    """--resume --allow-config-change optim.dense.lr,optim.sparse.lr: the optimizers' state comes from the
    checkpoint, their hyperparameters from the config (before the fix the checkpoint's param groups, and the
    scheduler's base_lrs, silently kept the old learning rates, eps and weight decay)."""
    from dlrm.config import ScheduleConfig
    from dlrm.train.optim import build_schedulers, lr_multiplier

    sched_cfg, total = ScheduleConfig(**SCHEDULES[schedule]), 10
    opts, model = _run_optimizers(0.01, 0.05, fused=fused)
    scheds = build_schedulers(opts, sched_cfg, total)
    for _ in range(4):
        model.dense.grad = torch.ones(2)
        (model.sparse_arch(torch.tensor([[1, 2, 0]])).sum() * 1.0).backward()
        for o in opts:
            o.step()
            o.zero_grad()
        for s in scheds:
            s.step()
    saved = copy.deepcopy(([o.state_dict() for o in opts], [s.state_dict() for s in scheds]))

    # the same config: exactly the checkpoint's learning rates (an exact resume)
    same, _ = _run_optimizers(0.01, 0.05, fused=fused)
    same_scheds = build_schedulers(same, sched_cfg, total)
    for o, s in zip(same, saved[0]):
        o.load_state_dict(s)
    for sch, s in zip(same_scheds, saved[1]):
        sch.load_state_dict(s)
    assert [o.param_groups[0]["lr"] for o in same] == [o.param_groups[0]["lr"] for o in opts]

    # new learning rates (and the eps and weight decay that go with them here), allowed on resume
    new, _ = _run_optimizers(0.03, 0.2, fused=fused)
    new_scheds = build_schedulers(new, sched_cfg, total)
    for o, s in zip(new, saved[0]):
        o.load_state_dict(s)
    for sch, s in zip(new_scheds, saved[1]):
        sch.load_state_dict(s)
    for step in (4, 5):
        mult = lr_multiplier(step, sched_cfg, total) if scheds else 1.0
        assert new[0].param_groups[0]["lr"] == pytest.approx(0.03 * mult, rel=1e-12)
        assert new[1].param_groups[0]["lr"] == pytest.approx(0.2 * mult, rel=1e-12)
        for s in new_scheds:
            s.step()
    assert new[0].param_groups[0]["weight_decay"] == pytest.approx(0.003)
    assert new[1].param_groups[0]["eps"] == pytest.approx(0.2 / 1000)
    # the state itself is the checkpoint's
    torch.testing.assert_close(new[0].state[new[0].param_groups[0]["params"][0]]["sum"],
                               opts[0].state[opts[0].param_groups[0]["params"][0]]["sum"])


@pytest.mark.parametrize("kwargs, says", [({"eps": -1e-3}, "eps"), ({"eps": float("nan")}, "eps"),
                                          ({"weight_decay": -0.1}, "weight_decay")])
def test_capturable_adagrad_refuses_what_torch_adagrad_refuses(kwargs, says):
    """A negative or NaN eps (or a negative weight decay) gave -inf / NaN weights silently; torch's Adagrad refuses
    them, and the two classes take each other's state."""
    from dlrm.train.adagrad import CapturableAdagrad

    with pytest.raises(ValueError, match=says):
        torch.optim.Adagrad([torch.nn.Parameter(torch.ones(2))], **kwargs)
    with pytest.raises(ValueError, match=f"{says} must be >= 0"):
        CapturableAdagrad([torch.nn.Parameter(torch.ones(2))], **kwargs)
