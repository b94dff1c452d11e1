"""kernels/adagrad.py: the one-pass dense Adagrad step, element by element against float64 and against torch's
foreach Adagrad (the same operations in the same order: the same bits on the GPU), on odd shapes, with weight
decay and a tensor learning rate; tensors the kernel cannot take are refused by name."""

from __future__ import annotations

import pytest
import torch

from kernels.adagrad import adagrad_step_

SHAPES = [(1,), (3, 5), (127, 1), (7, 13), (1025,)]  # one element; odd; one more than a program's block


def tensors(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(device) for s in SHAPES]


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_three_steps_match_a_float64_reference(weight_decay, device):
    params, sums = tensors(device, 0), [torch.zeros(s, device=device) for s in SHAPES]
    ref_p, ref_s = [p.double().clone() for p in params], [s.double() for s in sums]
    lr, eps = torch.tensor(0.05, device=device), 1e-8
    for step in range(3):
        grads = tensors(device, 10 + step)
        adagrad_step_(params, grads, sums, lr, eps, weight_decay)
        for rp, rs, g in zip(ref_p, ref_s, grads):
            gd = g.double() + weight_decay * rp
            rs += gd * gd
            rp -= 0.05 * gd / (rs.sqrt() + eps)
    for p, s, rp, rs in zip(params, sums, ref_p, ref_s):
        torch.testing.assert_close(s.double(), rs, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(p.double(), rp, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_matches_torch_foreach_adagrad(weight_decay, device):
    """Against torch.optim.Adagrad(foreach=True) on the same device: the same bits on CUDA (both round each
    operation alike, IEEE sqrt and division); within an ulp or two under the interpreter, whose numpy arithmetic
    does not fuse g * g into the sum as torch's CPU kernels may."""
    a = [torch.nn.Parameter(t) for t in tensors(device, 1)]
    b = [t.detach().clone() for t in a]
    opt = torch.optim.Adagrad(a, lr=0.05, eps=1e-8, weight_decay=weight_decay, foreach=True)
    sums = [torch.zeros_like(t) for t in b]
    for step in range(4):
        grads = tensors(device, 20 + step)
        for p, g in zip(a, grads):
            p.grad = g.clone()
        opt.step()
        adagrad_step_(b, grads, sums, torch.tensor(0.05, device=device), 1e-8, weight_decay)
    for pa, pb, sb in zip(a, b, sums):
        if device.type == "cuda":
            assert torch.equal(pa.detach(), pb) and torch.equal(opt.state[pa]["sum"], sb)
        else:
            torch.testing.assert_close(pb, pa.detach(), rtol=1e-6, atol=1e-7)


def test_refuses_tensors_it_cannot_take(device):
    p = torch.zeros(4, 3, device=device)
    lr = torch.tensor(0.1, device=device)
    with pytest.raises(ValueError, match="fp32 contiguous"):
        adagrad_step_([p.t()], [torch.zeros(3, 4, device=device)], [torch.zeros(3, 4, device=device)], lr, 1e-8)
    with pytest.raises(ValueError, match="torch.float64"):
        adagrad_step_([p.double()], [p.double()], [p.double()], lr, 1e-8)


def test_one_launch_for_many_parameters_matches_one_launch_each(device):
    """More parameters than one launch takes (two launches), sizes around a program's block and an empty one:
    bit for bit what a launch per parameter computes, with weight decay."""
    from kernels.adagrad import BLOCK, MAX_TENSORS

    sizes = [1, 0, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 7] + [(5 * i) % 37 + 1 for i in range(MAX_TENSORS)]
    gen = torch.Generator().manual_seed(3)
    make = lambda: [torch.randn(n, generator=gen).to(device) for n in sizes]  # noqa: E731
    params, grads = make(), make()
    sums = [torch.rand(n, generator=gen).to(device) for n in sizes]
    alone_p, alone_s = [p.clone() for p in params], [s.clone() for s in sums]
    before = [p.clone() for p in params]
    lr = torch.tensor(0.05, device=device)
    adagrad_step_(params, grads, sums, lr, 1e-8, 0.01)
    for p, g, s in zip(alone_p, grads, alone_s):
        adagrad_step_([p], [g], [s], lr, 1e-8, 0.01)
    assert len(sizes) > MAX_TENSORS
    for p, s, ap, as_ in zip(params, sums, alone_p, alone_s):
        assert torch.equal(p, ap) and torch.equal(s, as_)
    # the equalities above would also hold if both ways skipped a parameter: every non-empty one moved
    assert all(not torch.equal(p, b) for p, b in zip(params, before) if p.numel())
