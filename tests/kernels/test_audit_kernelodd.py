"""Audit of the kernels on odd shapes, strided inputs and non-contiguous upstream gradients (kernelodd).

Each test compares element by element with a float64 PyTorch reference computed from the same values (fp32 on the
CPU under Triton's interpreter, see conftest.py), or checks that an input the kernels cannot read is refused with a
one-line error instead of giving wrong numbers.
"""

from __future__ import annotations

import pytest
import torch

from kernels.adagrad import adagrad_step_
from kernels.cross_bwd_passes import cross_backward_pass, cross_backward_pass_reference
from kernels.exchange_combine import combine_received, combine_received_eager, exchange_layout
from kernels.exchange_ids import local_ids, local_ids_eager, send_ids, send_ids_eager
from kernels.interaction import dot_interaction, dot_interaction_reference
from kernels.loss import bce_with_logits
from kernels.mlp import fused_mlp
from kernels.mlp_tail import tail_mlp


def _f64(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _transposed(rows: int, cols: int, seed: int) -> torch.Tensor:
    """A [rows, cols] float64 tensor laid out column-major (a transposed upstream gradient)."""
    return _f64(cols, rows, seed=seed).t()


# ----------------------------------------------------------------------------------------------------
# Fixes: the sharded exchange's id kernels read their small index tensors at data pointer + index
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pooled", [True, False])
def test_local_ids_read_strided_slot_tables(device, pooled):
    """base / count / at given as columns of one [n, 3] table (stride 3): each served slot must get its own block.
    Before the fix the kernel read base[j] at base_ptr + j, i.e. another column's values."""
    recv = torch.randint(-1, 30, (7, 3), generator=torch.Generator().manual_seed(0))
    table = torch.tensor([[0, 9, 4], [5, 9, 13], [20, 7, 22]])  # per served slot: base, count, at
    base, count, at = table[:, 0], table[:, 1], table[:, 2]
    assert base.stride() == (3,)
    got_raw, got_valid = local_ids(recv.to(device), base.to(device), count.to(device), at.to(device), pooled)
    want_raw, want_valid = local_ids_eager(recv, base.contiguous(), count.contiguous(), at.contiguous(), pooled)
    assert torch.equal(got_valid.cpu(), want_valid)
    assert torch.equal(got_raw.cpu(), want_raw)


def test_send_ids_read_strided_slots_and_cards(device):
    """slots[q] and slot_card as strided views (columns of a plan table): the same send buffer as contiguous ones."""
    raw = torch.randint(-1, 1000, (5, 4), generator=torch.Generator().manual_seed(1))
    plan = torch.tensor([[0, 1], [2, 3], [1, 0]])
    slots = [plan[:, 0], plan[:, 1]]  # rank 0 serves slots 0, 2, 1; rank 1 slots 1, 3, 0
    cards = torch.tensor([[3, 0], [5, 0], [7, 0], [11, 0]])[:, 0]
    assert cards.stride() == (2,) and slots[0].stride() == (2,)
    got = send_ids(raw.to(device), cards.to(device), [s.to(device) for s in slots], 7, multi_hot=False)
    want = send_ids_eager((raw + 1) % cards.contiguous(), [s.contiguous() for s in slots], 7)
    assert torch.equal(got.cpu(), want)


def test_exchange_ids_refuse_floating_ids(device):
    """Float ids were truncated by the kernels (1.5 sent as 1 + 1 = row 2) with no error; now refused, naming them."""
    cards, slots = torch.tensor([3, 5], device=device), [torch.tensor([0, 1], device=device)]
    with pytest.raises(ValueError, match=r"raw must hold integers.*float64"):
        send_ids(torch.full((2, 2), 1.5, dtype=torch.float64, device=device), cards, slots, 2, multi_hot=False)
    with pytest.raises(ValueError, match=r"slot_card must hold integers"):
        send_ids(torch.ones(2, 2, dtype=torch.int64, device=device), cards.float(), slots, 2, multi_hot=False)
    idx = torch.zeros(2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match=r"recv must hold integers.*float32"):
        local_ids(torch.ones(3, 2, device=device), idx, idx + 5, idx, pooled=True)
    with pytest.raises(ValueError, match=r"count must hold integers"):
        local_ids(torch.ones(3, 2, dtype=torch.int64, device=device), idx, idx.float() + 5, idx, pooled=True)


# ----------------------------------------------------------------------------------------------------
# Fixes: the dense Adagrad kernel's arguments
# ----------------------------------------------------------------------------------------------------


def test_adagrad_refuses_lists_of_other_lengths(device):
    """Two parameters and one gradient: zip() stepped the first and left the second as it was, silently."""
    params = [torch.ones(3, device=device), torch.ones(3, device=device)]
    sums = [torch.zeros(3, device=device), torch.zeros(3, device=device)]
    with pytest.raises(ValueError, match=r"2 parameters, 1 gradients and 2 sums"):
        adagrad_step_(params, [torch.ones(3, device=device)], sums, torch.tensor(0.5, device=device), 0.0)
    assert all(torch.equal(p.cpu(), torch.ones(3)) for p in params)  # nothing half-updated


@pytest.mark.parametrize("lr", [0.5, "two_values", "float64"])
def test_adagrad_refuses_an_lr_it_cannot_read(device, lr):
    """The kernel loads lr through a pointer: a Python float failed inside Triton without naming lr, a tensor of two
    values stepped with the first, a float64 one computed the step in float64."""
    if lr == "two_values":
        lr = torch.tensor([0.5, 0.1], device=device)
    elif lr == "float64":
        lr = torch.tensor(0.5, dtype=torch.float64, device=device)
    p = torch.ones(3, device=device)
    with pytest.raises(ValueError, match=r"lr must be a one-element float32 tensor"):
        adagrad_step_([p], [torch.ones(3, device=device)], [torch.zeros(3, device=device)], lr, 0.0)
    assert torch.equal(p.cpu(), torch.ones(3))


def test_adagrad_odd_sizes_match_float64(device):
    """Sizes 1, 3, 1025 (a block and one element) in one launch, against the float64 update."""
    sizes = (1, 3, 1025)
    p64 = [_f64(n, seed=i) for i, n in enumerate(sizes)]
    g64 = [_f64(n, seed=10 + i) for i, n in enumerate(sizes)]
    s64 = [_f64(n, seed=20 + i).abs() for i, n in enumerate(sizes)]
    ps, gs, ss = ([t.float().to(device) for t in ts] for ts in (p64, g64, s64))
    adagrad_step_(ps, gs, ss, torch.tensor(0.25, device=device), 1e-8, weight_decay=0.1)
    for p, s, p0, g0, s0 in zip(ps, ss, p64, g64, s64):
        g = g0 + 0.1 * p0
        s_ref = s0 + g * g
        torch.testing.assert_close(s.cpu().double(), s_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(p.cpu().double(), p0 - 0.25 * g / (s_ref.sqrt() + 1e-8), atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------
# Odd shapes and non-contiguous upstream gradients, against float64
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("B,F,D,pad", [(1, 0, 1, 0), (3, 1, 3, 2), (127, 2, 17, 1), (3, 4, 1, 3)])
def test_interaction_odd_shapes_transposed_grad(device, assert_close, B, F, D, pad):
    x64 = _f64(B, F + 1, D, seed=B + F + D)
    x = x64.float().to(device).requires_grad_()
    y = dot_interaction(x, pad)
    x_ref = x64.clone().requires_grad_()
    y_ref = torch.nn.functional.pad(dot_interaction_reference(x_ref), (0, pad))
    assert_close(y, y_ref, torch.float32, scale=D, msg="forward")
    g64 = _transposed(*y_ref.shape, seed=5)
    y.backward(g64.float().to(device))
    y_ref.backward(g64)
    assert_close(x.grad, x_ref.grad, torch.float32, scale=(F + 1) * D, msg="grad")


@pytest.mark.parametrize("fn", [fused_mlp, tail_mlp], ids=["fused_mlp", "tail_mlp"])
@pytest.mark.parametrize("M,dims,relu", [(1, [1, 1], [True]), (3, [3, 17, 1], [True, False]),
                                         (127, [17, 3, 5, 1], [True, True, False])])
def test_mlp_chains_odd_widths_transposed_grad(device, assert_close, fn, M, dims, relu):
    """Strided input, widths 1, 3, 17, a transposed output gradient: forward, dx, every dW and db."""
    x64 = _f64(M, dims[0], seed=M)
    w64 = [_f64(n, k, seed=30 + i) / k**0.5 for i, (k, n) in enumerate(zip(dims[:-1], dims[1:]))]
    b64 = [_f64(n, seed=40 + i) for i, n in enumerate(dims[1:])]
    x = x64.float().to(device).requires_grad_()
    ws = [w.float().to(device).requires_grad_() for w in w64]
    bs = [b.float().to(device).requires_grad_() for b in b64]
    y = fn(x.t().contiguous().t(), ws, bs, relu)
    x_ref, ws_ref, bs_ref = x64.clone().requires_grad_(), [w.clone().requires_grad_() for w in w64], \
        [b.clone().requires_grad_() for b in b64]
    h = x_ref
    for w, b, r in zip(ws_ref, bs_ref, relu):
        h = torch.nn.functional.linear(h, w, b)
        h = torch.relu(h) if r else h
    assert_close(y, h, torch.float32, scale=10, msg="forward")
    g64 = _transposed(M, dims[-1], seed=7)
    y.backward(g64.float().to(device))
    h.backward(g64)
    assert_close(x.grad, x_ref.grad, torch.float32, scale=10, msg="dx")
    for i, (w, wr, b, br) in enumerate(zip(ws, ws_ref, bs, bs_ref)):
        assert_close(w.grad, wr.grad, torch.float32, scale=10 * M**0.5, msg=f"dW{i}")
        assert_close(b.grad, br.grad, torch.float32, scale=10 * M**0.5, msg=f"db{i}")


@pytest.mark.parametrize("served,F", [([[0], [0]], 1), ([[0, 2], [1, 2]], 3)])
@pytest.mark.parametrize("B,P,D", [(1, 1, 1), (3, 4, 3), (127, 127, 17)])
def test_combine_received_odd_shapes_permuted_grad(device, assert_close, served, F, B, P, D):
    layout = exchange_layout(served, F, device)
    x64 = _f64(P * sum(len(s) for s in served), D, seed=B + D)
    x = x64.float().to(device).requires_grad_()
    y = combine_received(x, layout, B, P, 0.5)
    x_ref = x64.clone().requires_grad_()
    y_ref = combine_received_eager(x_ref, exchange_layout(served, F), B, P, 0.5)
    assert_close(y, y_ref, torch.float32, msg="forward")
    g64 = _f64(D, F, B, seed=3).permute(2, 1, 0)  # non-contiguous [B, F, D]
    y.backward(g64.float().to(device))
    y_ref.backward(g64)
    assert_close(x.grad, x_ref.grad, torch.float32, msg="grad")


@pytest.mark.parametrize("M,N,terms", [(1, 1, 0), (3, 17, 1), (127, 3, 3)])
def test_cross_backward_pass_odd_shapes_strided(device, assert_close, M, N, terms):
    g, x0 = _transposed(M, N, seed=1), _transposed(M, N, seed=2)
    ts = [_transposed(M, N, seed=10 + i) for i in range(terms)]
    pres = [_transposed(M, N, seed=20 + i) for i in range(terms + 1)]
    got = cross_backward_pass(g.float().to(device), [t.float().to(device) for t in ts], x0.float().to(device),
                              [p.float().to(device) for p in pres])
    want = cross_backward_pass_reference(g, ts, x0, pres, torch.float64)
    for name, a, e in zip(("g_pre", "db", "dx0"), got, want):
        assert_close(a, e, torch.float32, scale=M**0.5 * (terms + 1), msg=name)


@pytest.mark.parametrize("shape", [(1,), (3, 1), (4, 3)])
def test_bce_none_transposed_grad(device, assert_close, shape):
    z64 = _f64(*shape, seed=4) * 3
    y64 = torch.rand(shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    z = z64.float().to(device).requires_grad_()
    y = y64.float().to(device).requires_grad_()
    loss = bce_with_logits(z, y, "none")
    z_ref, y_ref = z64.clone().requires_grad_(), y64.clone().requires_grad_()
    loss_ref = torch.nn.functional.binary_cross_entropy_with_logits(z_ref, y_ref, reduction="none")
    assert_close(loss, loss_ref, torch.float32, msg="forward")
    g64 = _transposed(*shape, seed=6) if len(shape) == 2 else _f64(*shape, seed=6)
    loss.backward(g64.float().to(device))
    loss_ref.backward(g64)
    assert_close(z.grad, z_ref.grad, torch.float32, msg="grad logits")
    assert_close(y.grad, y_ref.grad, torch.float32, msg="grad labels")


def test_tail_mlp_refuses_float64(device):
    """A float64 chain ran through the kernel's fp32 dot accumulators and came back float64 with fp32 accuracy (max
    error 3e-8 on an H200 for a 5 -> 3 layer), silently; the other GEMM kernels refuse float64, and so does the tail."""
    x = torch.randn(7, 5, dtype=torch.float64, device=device)
    w, b = torch.randn(3, 5, dtype=torch.float64, device=device), torch.zeros(3, dtype=torch.float64, device=device)
    with pytest.raises(ValueError, match=r"on-chip MLP tail take float32, bfloat16 or float16.*float64"):
        tail_mlp(x, [w], [b], [False])
