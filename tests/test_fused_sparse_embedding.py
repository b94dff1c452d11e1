"""The PyTorch fused-update embedding (dlrm/model/fused_sparse.py, issue #19).

Every optimizer's in-backward update against the eager COO path (F.embedding(sparse=True), the lazy
weight decay hook, torch.optim.SGD / torch.optim.Adagrad / RowWiseAdagrad) run in float64, element by
element: weights and optimizer state, touched and untouched rows, on odd shapes (batch 1, 3, 127;
one feature), with repeated rows, non-contiguous and stride-0 gradients, both hashing modes, both
summation modes. Then under torch.compile(fullgraph=True) (a few tiny compiles: each costs seconds on
the CPU), and a 20-step training run with compile on against the eager run.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F_

from dlrm.config import KernelsConfig, ModelConfig, OptimConfig, load_config
from dlrm.model.archs import SparseArch
from dlrm.model.dlrm import build_model
from dlrm.model.fused_sparse import FusedUpdateSparseArch, init_state, segment_sums, sparse_update_
from dlrm.model.interfaces import SparseArchInterface
from dlrm.train.optim import FusedSparseOptimizer, RowWiseAdagrad, add_sparse_weight_decay, build_optimizers
from kernels.embedding import SparseOptimizerConfig
from tests.conftest import REPO, make_dataset

KINDS = ["sgd", "adagrad", "rowwise_adagrad"]
SHAPES = [(1, 1), (3, 4), (127, 3)]  # (B, F): batch 1, 3, 127; one feature
EPS = 1e-8
# fp64 implementation vs fp64 reference: only the summation order differs
TOL64 = dict(rtol=1e-10, atol=1e-12)
# fp32 implementation vs fp64 reference, gradients without cancellation (see _grad)
TOL32 = dict(rtol=2e-5, atol=2e-6)


def _eager_optimizer(kind: str, weight: torch.nn.Parameter, lr: float, weight_decay: float):
    """The eager sparse optimizer `build_optimizers` makes for `kind` (with its lazy decay hook)."""
    if kind == "sgd":
        opt = torch.optim.SGD([weight], lr=lr)
    elif kind == "adagrad":
        opt = torch.optim.Adagrad([weight], lr=lr, eps=EPS)
    else:
        opt = RowWiseAdagrad([weight], lr=lr, eps=EPS)
    return add_sparse_weight_decay(opt, weight_decay)


def _state_of(kind: str, opt) -> torch.Tensor | None:
    return None if kind == "sgd" else opt.state[opt.param_groups[0]["params"][0]]["sum"]


def _grad(shape, dtype, generator, positive: bool) -> torch.Tensor:
    """Output gradients; `positive`: in [0.5, 1.5], so summing repeated rows cancels nothing and an fp32
    sum stays within a few ulps of the fp64 one (row-wise Adagrad normalises by the sum's size, which
    would magnify the rounding of a cancelling sum)."""
    g = torch.rand(shape, generator=generator, dtype=torch.float64)
    g = g + 0.5 if positive else g * 2 - 1
    return g.to(dtype)


def _rows(batch: int, features: int, num_rows: int, generator) -> torch.Tensor:
    """Rows with many repeats (num_rows is small) that leave some rows untouched."""
    return torch.randint(0, num_rows - 2, (batch, features), generator=generator)


# ----------------------------------------------------------------------------------------------------
# sparse_update_ against the float64 COO reference
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("batch,features", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_update_matches_float64_coo_reference(kind, batch, features, weight_decay, deterministic, dtype):
    gen = torch.Generator().manual_seed(batch * 100 + features)
    num_rows, dim, lr = 2 * features + 5, 5, 0.05
    w0 = torch.randn(num_rows, dim, generator=gen, dtype=torch.float64)
    ref_w = torch.nn.Parameter(w0.clone())
    ref_opt = _eager_optimizer(kind, ref_w, lr, weight_decay)
    weight = w0.to(dtype)
    state = init_state(kind, weight)
    lr_t = torch.tensor([lr], dtype=dtype)
    touched = torch.zeros(num_rows, dtype=torch.bool)
    for step in range(3):
        rows = _rows(batch, features, num_rows, gen)
        touched[rows.flatten()] = True
        # non-contiguous: every other element of a wider tensor
        grad = _grad((batch, features, 2 * dim), torch.float64, gen, positive=dtype == torch.float32)[..., ::2]
        assert not grad.is_contiguous()
        F_.embedding(rows, ref_w, sparse=True).backward(grad)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        sparse_update_(rows, grad.to(dtype), weight, state, lr_t, kind, EPS, weight_decay, deterministic)
        tol = TOL64 if dtype == torch.float64 else TOL32
        torch.testing.assert_close(weight.double(), ref_w.detach(), **tol, msg=f"weight, step {step}")
        if state is not None:
            torch.testing.assert_close(state.double(), _state_of(kind, ref_opt), **tol, msg=f"state, step {step}")
    # untouched rows (the slots past the distinct rows point at touched ones): bitwise unchanged
    assert torch.equal(weight[~touched], w0.to(dtype)[~touched])
    if state is not None:
        assert not state[~touched].any()


@pytest.mark.parametrize("kind", KINDS)
def test_stride_zero_gradient_and_one_row_everywhere(kind):
    """A mean loss's expanded gradient (stride 0), every position on one row (one segment, N slots)."""
    weight = torch.randn(4, 3, dtype=torch.float64)
    ref_w = torch.nn.Parameter(weight.clone())
    ref_opt = _eager_optimizer(kind, ref_w, 0.1, 0.0)
    rows = torch.full((127, 2), 2)
    grad = torch.full((1, 1, 1), 0.25, dtype=torch.float64).expand(127, 2, 3)
    F_.embedding(rows, ref_w, sparse=True).backward(grad)
    ref_opt.step()
    state = init_state(kind, weight)
    sparse_update_(rows, grad, weight, state, torch.tensor([0.1], dtype=torch.float64), kind, EPS)
    torch.testing.assert_close(weight, ref_w.detach(), **TOL64)
    if state is not None:
        torch.testing.assert_close(state, _state_of(kind, ref_opt), **TOL64)


def test_zero_summed_gradient_still_decays_and_leaves_adagrad_state():
    """A touched row whose gradients cancel exactly: weight decay still applies (the row was looked
    up, as decay_touched_rows_ says); row-wise Adagrad adds 0 to its state and 0 to the row."""
    rows = torch.tensor([[1], [1]])
    grad = torch.tensor([[[1.0, -2.0]], [[-1.0, 2.0]]], dtype=torch.float64)
    for wd in (0.0, 0.5):
        weight = torch.tensor([[1.0, 1.0], [2.0, -4.0], [3.0, 3.0]], dtype=torch.float64)
        ref_w = torch.nn.Parameter(weight.clone())
        ref_opt = _eager_optimizer("rowwise_adagrad", ref_w, 0.1, wd)
        F_.embedding(rows, ref_w, sparse=True).backward(grad)
        ref_opt.step()
        state = init_state("rowwise_adagrad", weight)
        sparse_update_(rows, grad, weight, state, torch.tensor([0.1], dtype=torch.float64), "rowwise_adagrad", EPS, wd)
        torch.testing.assert_close(weight, ref_w.detach(), **TOL64)
        torch.testing.assert_close(state, _state_of("rowwise_adagrad", ref_opt), **TOL64)
        assert torch.equal(weight[[0, 2]], torch.tensor([[1.0, 1.0], [3.0, 3.0]], dtype=torch.float64))
        if wd == 0.0:
            assert torch.equal(weight[1], torch.tensor([2.0, -4.0], dtype=torch.float64)) and state[1] == 0


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("n", [1, 3, 127])
def test_segment_sums_are_coalesce(n, deterministic):
    gen = torch.Generator().manual_seed(n)
    rows = torch.randint(0, 9, (n,), generator=gen)
    grad = torch.randn(n, 4, generator=gen, dtype=torch.float64)
    slot_rows, sums = segment_sums(rows, grad, 9, deterministic)
    coo = torch.sparse_coo_tensor(rows[None], grad, (9, 4)).coalesce()
    distinct = coo.indices()[0]
    s = distinct.numel()
    # slot k holds distinct row k mod S, so the first S slots are coalesce()'s rows and values...
    assert torch.equal(slot_rows[:s], distinct)
    torch.testing.assert_close(sums[:s], coo.values(), **TOL64)
    # ...and every later slot repeats one of them exactly (identical writes, any order)
    k = torch.arange(n) % s
    assert torch.equal(slot_rows, distinct[k]) and torch.equal(sums, sums[:s][k])


def test_segment_sum_op_is_a_well_formed_custom_op():
    values = torch.randn(7, 3)
    segment = torch.tensor([0, 0, 1, 2, 2, 2, 3])
    torch.library.opcheck(torch.ops.dlrm_model.segment_sum, (values, segment, 7))
    out = torch.ops.dlrm_model.segment_sum(values, segment, 7)
    torch.testing.assert_close(out[:4], torch.zeros(4, 3).index_add_(0, segment, values))
    assert not out[4:].any()


def test_update_refuses_unknown_kind():
    with pytest.raises(ValueError, match="kind"):
        sparse_update_(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, 2), torch.zeros(2, 2), None,
                       torch.tensor([0.1]), "adam", EPS)


# ----------------------------------------------------------------------------------------------------
# The module
# ----------------------------------------------------------------------------------------------------

CARDS = [3, 1, 7, 2]
VOCABS = [torch.tensor([5, 9]), torch.tensor([], dtype=torch.int64), torch.tensor([1, 2, 3, 4, 8, 1000]),
          torch.tensor([-7])]


def _arch_pair(hashing: str, dtype=torch.float64):
    vocabs = VOCABS if hashing == "vocabulary" else None
    torch.manual_seed(0)
    eager = SparseArch(CARDS, 6, vocabs).to(dtype)
    torch.manual_seed(0)
    fused = FusedUpdateSparseArch(CARDS, 6, vocabs).to(dtype)
    return eager, fused


def _raw(batch: int, generator) -> torch.Tensor:
    """Raw values hitting the vocabularies, out-of-vocabulary values and missing (-1); non-contiguous."""
    pool = torch.tensor([-1, 1, 2, 3, 4, 5, 8, 9, 1000, -7, 2**32 - 1, 123456])
    idx = torch.randint(0, pool.numel(), (len(CARDS), batch), generator=generator)
    return pool[idx].t()  # [B, F] as a transposed view


def test_interface_flags_and_state_dict():
    eager, fused = _arch_pair("modulus")
    assert isinstance(fused, SparseArchInterface)
    assert (fused.compilable, fused.collective, fused.fused_optimizer) == (True, False, True)
    assert set(fused.state_dict()) == set(eager.state_dict()) == {"weight"}
    fused.use_fused_update(SparseOptimizerConfig("rowwise_adagrad", torch.tensor([0.1]), eps=EPS))
    assert set(fused.state_dict()) == {"weight"}  # the optimizer state lives with the optimizer
    other = SparseArch(CARDS, 6).double()
    other.load_state_dict(fused.state_dict())
    fused.load_state_dict(other.state_dict())  # checkpoints load either way
    assert torch.equal(other.weight, fused.weight)


@pytest.mark.parametrize("hashing", ["modulus", "vocabulary"])
@pytest.mark.parametrize("kind", KINDS)
def test_module_trains_like_the_eager_coo_path(kind, hashing):
    """Three training steps of the module through FusedSparseOptimizer, against SparseArch with the
    eager optimizer, in float64 (lr exact in fp32: FusedSparseOptimizer keeps it in an fp32 tensor)."""
    gen = torch.Generator().manual_seed(1)
    eager, fused = _arch_pair(hashing)
    lr, wd = 0.125, 0.01
    ref_opt = _eager_optimizer(kind, eager.weight, lr, wd)
    opt = FusedSparseOptimizer(fused, kind, lr, EPS, deterministic=False, weight_decay=wd)
    assert not fused.weight.requires_grad
    for batch in (1, 3, 127):
        raw = _raw(batch, gen)
        out_e, out_f = eager(raw), fused(raw)
        assert torch.equal(out_e, out_f)
        grad = torch.randn(out_e.shape, generator=gen, dtype=torch.float64)
        out_e.backward(grad)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        opt.load_lr()
        out_f.backward(grad)
        opt.step()  # nothing left to do: the backward applied the update
        assert fused.weight.grad is None
        torch.testing.assert_close(fused.weight, eager.weight.detach(), **TOL64)
        if kind != "sgd":
            torch.testing.assert_close(opt.state[fused.weight]["sum"], _state_of(kind, ref_opt), **TOL64)


def test_eval_and_no_grad_forwards_do_not_update():
    _, fused = _arch_pair("modulus")
    fused.use_fused_update(SparseOptimizerConfig("sgd", torch.tensor([1.0], dtype=torch.float64)))
    raw = torch.tensor([[0, 1, 2, 3]])
    before = fused.weight.clone()
    with torch.no_grad():
        fused(raw)
    fused.eval()
    out = fused(raw)
    assert not out.requires_grad and torch.equal(fused.weight, before)
    fused.train()
    fused(raw).sum().backward()
    assert not torch.equal(fused.weight, before)


def test_switching_back_gives_the_sparse_gradient():
    _, fused = _arch_pair("modulus")
    fused.use_fused_update(SparseOptimizerConfig("sgd", torch.tensor([0.1])))
    fused.use_fused_update(None)
    assert fused.weight.requires_grad
    fused(torch.tensor([[0, 1, 2, 3]])).sum().backward()
    assert fused.weight.grad.is_sparse


def test_use_fused_update_checks_its_config():
    _, fused = _arch_pair("modulus")
    with pytest.raises(ValueError, match="kind"):
        fused.use_fused_update(SparseOptimizerConfig("adam", torch.tensor([0.1])))
    with pytest.raises(ValueError, match="lr"):
        fused.use_fused_update(SparseOptimizerConfig("sgd", torch.tensor([0.1, 0.2])))


def test_optimizer_state_round_trips_through_fused_sparse_optimizer():
    """Save after two steps, load into a fresh model and optimizer, step again: the same numbers."""
    gen = torch.Generator().manual_seed(3)
    raws = [_raw(5, gen) for _ in range(3)]
    grads = [torch.randn(5, len(CARDS), 6, generator=gen, dtype=torch.float64) for _ in range(3)]

    def run(model, opt, steps):
        for raw, grad in steps:
            opt.load_lr()
            model(raw).backward(grad)

    _, a = _arch_pair("modulus")
    opt_a = FusedSparseOptimizer(a, "adagrad", 0.125, EPS, deterministic=True)
    run(a, opt_a, zip(raws[:2], grads[:2]))
    saved_model, saved_opt = a.state_dict(), opt_a.state_dict()
    _, b = _arch_pair("modulus")
    opt_b = FusedSparseOptimizer(b, "adagrad", 0.125, EPS, deterministic=True)
    b.load_state_dict(saved_model)
    opt_b.load_state_dict(saved_opt)
    assert opt_b.state[b.weight]["sum"] is opt_b.fused.state  # still the tensor the backward updates
    run(a, opt_a, [(raws[2], grads[2])])
    run(b, opt_b, [(raws[2], grads[2])])
    assert torch.equal(a.weight, b.weight) and torch.equal(opt_a.fused.state, opt_b.fused.state)


# ----------------------------------------------------------------------------------------------------
# Selection
# ----------------------------------------------------------------------------------------------------


def test_torch_embedding_is_fused_exactly_when_compiled():
    cfg = ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[6, 1])
    torch_kernels = KernelsConfig(embedding="torch", interaction="torch", mlp="torch", loss="torch")
    eager = build_model(cfg, [3] * 26, kernels=torch_kernels)
    compiled = build_model(cfg, [3] * 26, kernels=torch_kernels, compiled=True)
    assert type(eager.sparse_arch) is SparseArch
    assert type(compiled.sparse_arch) is FusedUpdateSparseArch
    assert set(eager.state_dict()) == set(compiled.state_dict())
    _, sparse = build_optimizers(compiled, OptimConfig())
    assert isinstance(sparse, FusedSparseOptimizer)
    _, sparse = build_optimizers(eager, OptimConfig())
    assert isinstance(sparse, RowWiseAdagrad)


# ----------------------------------------------------------------------------------------------------
# torch.compile (CPU; each case compiles once: seconds, so few and tiny)
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,deterministic,weight_decay", [
    ("rowwise_adagrad", False, 0.01),
    ("adagrad", True, 0.0),  # the opaque dlrm_model::segment_sum inside the graph
    ("sgd", False, 0.0),  # plain SGD: one index_add_, no sort
])
def test_compiled_fullgraph_matches_eager(kind, deterministic, weight_decay):
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1  # as dlrm.train.step does on small CPUs
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(2)
    _, eager = _arch_pair("vocabulary", torch.float32)
    _, compiled = _arch_pair("vocabulary", torch.float32)
    cfgs = [m.use_fused_update(SparseOptimizerConfig(kind, torch.tensor([0.05]), eps=EPS, deterministic=deterministic,
                                                      weight_decay=weight_decay)) for m in (eager, compiled)]

    def loss_fn(model, raw, target):
        return ((model(raw).sum(-1) - target) ** 2).mean()

    compiled_loss = torch.compile(loss_fn, fullgraph=True)
    for step in range(3):
        raw, target = _raw(127, gen), torch.randn(127, len(CARDS), generator=gen)
        loss_e, loss_c = loss_fn(eager, raw, target), compiled_loss(compiled, raw, target)
        torch.testing.assert_close(loss_c, loss_e)
        loss_e.backward()
        loss_c.backward()
        torch.testing.assert_close(compiled.weight, eager.weight, rtol=1e-5, atol=1e-6, msg=f"step {step}")
        if cfgs[0].state is not None:
            torch.testing.assert_close(cfgs[1].state, cfgs[0].state, rtol=1e-5, atol=1e-7, msg=f"step {step}")
    assert compiled.weight.grad is None


@pytest.mark.slow
def test_compiled_training_run_matches_eager(tmp_path, monkeypatch):
    """20 steps through dlrm.train.trainer.train: compile on (the fused torch embedding, whole step in
    one graph) against compile off (SparseArch and the eager COO optimizer), loss by loss."""
    from dlrm.model import fused_sparse
    from dlrm.train.trainer import train

    built = []
    init = fused_sparse.FusedUpdateSparseArch.__init__
    monkeypatch.setattr(fused_sparse.FusedUpdateSparseArch, "__init__",
                        lambda self, *a, **k: (built.append(1), init(self, *a, **k))[1])
    data = tmp_path / "ds"
    make_dataset(data, {"train": 700, "validation": 64}, row_group_size=100)
    base = {"data.path": str(data), "log.tb_dir": str(tmp_path / "tb"), "data.batch_size": 32,
            "train.max_steps": 20, "train.log_every": 1, "train.device": "cpu", "train.baseline": False,
            **{f"kernels.{part}": "torch" for part in ("embedding", "interaction", "mlp", "loss")}}
    eager = train(load_config(REPO / "configs" / "sample.json", {**base, "log.run_name": "eager",
                                                                 "train.compile.enabled": False}))
    assert not built
    compiled = train(load_config(REPO / "configs" / "sample.json", {**base, "log.run_name": "compiled",
                                                                    "train.compile.enabled": True,
                                                                    "train.compile.fullgraph": True}))
    assert built and compiled["compile"]["graph_breaks"] == 0
    assert len(eager["train_losses"]) == len(compiled["train_losses"]) == 20
    for (s1, l1), (s2, l2) in zip(eager["train_losses"], compiled["train_losses"]):
        assert s1 == s2 and l2 == pytest.approx(l1, rel=1e-5, abs=1e-6), s1
    assert compiled["auc"] == pytest.approx(eager["auc"], abs=1e-4)
