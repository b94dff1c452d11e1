"""`dlrm.train.adagrad.CapturableAdagrad`: torch's foreach Adagrad bit for bit, a float64 reference,
a tensor learning rate, state_dicts that load both ways, and the dense optimizer chosen on CUDA."""

from __future__ import annotations

import copy

import pytest
import torch

from dlrm.config import load_config
from dlrm.data.loader import Batch
from dlrm.data.schema import NUM_DENSE, NUM_SPARSE
from dlrm.train.adagrad import CapturableAdagrad
from dlrm.train.builder import build_run, tables_from_config
from tests.conftest import REPO

SHAPES = [(1,), (3, 5), (127, 1), (7, 13)]  # odd shapes; one single element


def make_params(seed: int = 0, dtype=torch.float32) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in SHAPES]


def set_grads(params, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        # a non-contiguous gradient source, copied into p.grad (the layout autograd gives a parameter)
        src = torch.randn(*reversed(p.shape), generator=g, dtype=p.dtype).T if p.dim() == 2 else torch.randn(
            p.shape, generator=g, dtype=p.dtype)
        p.grad = src.clone(memory_format=torch.contiguous_format) if step % 2 else src.contiguous()


def run(opt_cls, params, steps: int, **kw):
    opt = opt_cls(params, **kw)
    for step in range(steps):
        set_grads(params, step)
        opt.step()
    return opt


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_bitwise_equal_to_torch_foreach_adagrad(weight_decay):
    a, b = make_params(), make_params()
    ta = run(torch.optim.Adagrad, a, 5, lr=0.05, eps=1e-8, weight_decay=weight_decay, foreach=True)
    tb = run(CapturableAdagrad, b, 5, lr=0.05, eps=1e-8, weight_decay=weight_decay)
    for pa, pb in zip(a, b):
        assert torch.equal(pa, pb)
        assert torch.equal(ta.state[pa]["sum"], tb.state[pb]["sum"])
        assert float(ta.state[pa]["step"]) == float(tb.state[pb]["step"]) == 5.0


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_matches_a_float64_reference(weight_decay):
    params = make_params()
    ref = [p.detach().double().clone() for p in params]
    sums = [torch.zeros_like(r) for r in ref]
    opt = CapturableAdagrad(params, lr=0.05, eps=1e-8, weight_decay=weight_decay)
    for step in range(4):
        set_grads(params, step)
        for r, s, p in zip(ref, sums, params):
            g = p.grad.double() + weight_decay * r
            s += g * g
            r -= 0.05 * g / (s.sqrt() + 1e-8)
        opt.step()
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.detach().double(), r, rtol=1e-6, atol=1e-7)


def test_a_tensor_learning_rate_gives_the_same_bits_as_a_float():
    a, b = make_params(), make_params()
    run(CapturableAdagrad, a, 3, lr=0.03)
    run(CapturableAdagrad, b, 3, lr=torch.tensor(0.03))
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_state_dicts_load_into_either_class_and_training_continues_identically():
    torch_params, ours_params = make_params(), make_params()
    t = run(torch.optim.Adagrad, torch_params, 2, lr=0.05, eps=1e-8, foreach=True)
    o = CapturableAdagrad(ours_params, lr=0.05, eps=1e-8)
    o.load_state_dict(copy.deepcopy(t.state_dict()))  # torch's -> ours
    with torch.no_grad():
        for mine, theirs in zip(ours_params, torch_params):
            mine.copy_(theirs)  # the weights the torch run reached
    assert all(isinstance(o.state[p]["step"], torch.Tensor) for p in ours_params)
    back = torch.optim.Adagrad(make_params(1), lr=0.05, eps=1e-8, foreach=True)
    back.load_state_dict(copy.deepcopy(o.state_dict()))  # ours -> torch's
    first = back.param_groups[0]["params"][0]
    assert torch.equal(back.state[first]["sum"], o.state[ours_params[0]]["sum"]) and float(back.state[first]["step"]) == 2
    for step in range(2, 4):
        set_grads(torch_params, step)
        set_grads(ours_params, step)
        t.step()
        o.step()
    assert all(torch.equal(x, y) for x, y in zip(torch_params, ours_params))
    assert set(o.state_dict()["param_groups"][0]) >= {"lr", "eps", "weight_decay", "lr_decay"}


def test_refuses_sparse_gradients_closures_and_negative_lr():
    w = torch.nn.Parameter(torch.ones(4, 2))
    torch.nn.functional.embedding(torch.tensor([1]), w, sparse=True).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        CapturableAdagrad([w]).step()
    with pytest.raises(ValueError, match="closure"):
        CapturableAdagrad([w]).step(lambda: 0.0)
    with pytest.raises(ValueError, match="lr"):
        CapturableAdagrad([w], lr=-1.0)


def test_parameters_without_gradients_are_left_alone():
    p, q = make_params()[:2]
    opt = CapturableAdagrad([p, q], lr=0.1)
    before = q.detach().clone()
    p.grad = torch.ones_like(p)
    opt.step()
    assert torch.equal(q, before) and float(opt.state[q]["step"]) == 0.0 and float(opt.state[p]["step"]) == 1.0


@pytest.mark.gpu
def test_dense_adagrad_on_cuda_is_the_capturable_one():
    cfg = load_config(REPO / "configs" / "sample.json", {"optim.dense.name": "adagrad", "train.cuda_graph": False,
                                                         "kernels.embedding": "triton"})
    cfg.model.cardinalities = [10] * NUM_SPARSE
    run_ = build_run(cfg, tables_from_config(cfg), torch.device("cuda"), total_steps=4)
    dense = run_.optimizers[0]
    assert isinstance(dense, CapturableAdagrad)
    g = torch.Generator().manual_seed(0)
    batch = Batch(torch.rand(8, NUM_DENSE, generator=g).cuda(), torch.randint(0, 2**31, (8, NUM_SPARSE), generator=g).cuda(),
                  (torch.rand(8, generator=g) < 0.5).float().cuda())
    run_.train_step(batch)
    assert dense.state and all(s["step"].device.type == "cuda" for s in dense.state.values())


@pytest.mark.gpu
@pytest.mark.parametrize("one_pass", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_on_cuda_bitwise_equal_to_torch_foreach_adagrad(one_pass, weight_decay, monkeypatch):
    """On CUDA, with the one-pass Triton update (`adagrad.ONE_PASS`, the default) and with the foreach ops: the
    same parameters and sums as torch.optim.Adagrad(foreach=True), bit for bit, after 5 steps with a tensor lr."""
    import dlrm.train.adagrad as adagrad

    monkeypatch.setattr(adagrad, "ONE_PASS", one_pass)
    a = [torch.nn.Parameter(p.detach().cuda()) for p in make_params()]
    b = [torch.nn.Parameter(p.detach().cuda()) for p in make_params()]
    ta = torch.optim.Adagrad(a, lr=0.05, eps=1e-8, weight_decay=weight_decay, foreach=True)
    tb = CapturableAdagrad(b, lr=torch.tensor(0.05, device="cuda"), eps=1e-8, weight_decay=weight_decay)
    cpu = make_params()  # the gradients' source: set_grads's layouts, on the CPU
    for step in range(5):
        set_grads(cpu, step)
        for pa, pb, c in zip(a, b, cpu):
            pa.grad, pb.grad = c.grad.cuda(), c.grad.cuda()
        ta.step()
        tb.step()
    for pa, pb in zip(a, b):
        assert torch.equal(pa, pb)
        assert torch.equal(ta.state[pa]["sum"], tb.state[pb]["sum"])
