"""kernels/epilogue.py against float64 references: every output and every gradient.

(a) ``act(x + bias + scale * residual)``; (b) ``dropout(act(x + bias))`` with the Philox mask that
`dropout_mask` materialises. CPU: Triton interpreter, fp32; GPU (marked gpu): fp32 and bf16.
"""

from __future__ import annotations

import pytest
import torch

from kernels.activations import ACTIVATIONS, apply_activation
from kernels.epilogue import (
    FusedBiasResidualAct,
    FusedDropoutBiasAct,
    bias_residual_act,
    dropout_bias_act,
    dropout_mask,
)

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make(shape, layout: str, device, dtype=torch.float32, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    """A [M, N] tensor with a given layout (contiguous, transposed, sliced columns, stride-0 rows)."""
    M, N = shape
    gen = torch.Generator().manual_seed(seed)
    if layout == "contiguous":
        t = torch.randn(M, N, generator=gen)
    elif layout == "transposed":
        t = torch.randn(N, M, generator=gen).t()
    elif layout == "sliced":
        t = torch.randn(M, 2 * N + 1, generator=gen)[:, 1::2]
    elif layout == "expand":
        t = torch.randn(1, N, generator=gen).expand(M, N)
    else:
        raise ValueError(layout)
    return (t * scale).to(device=device, dtype=dtype)


def leaf(t: torch.Tensor, req: bool = True) -> torch.Tensor:
    return t.detach().requires_grad_(req)


def ref_grads(fn, inputs, grad):
    """float64 output and gradients of fn(*inputs) (None inputs pass through)."""
    d = [None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in inputs]
    out = fn(*d)
    out.backward(grad.double())
    return out.detach(), [None if t is None else t.grad for t in d]


# ----------------------------------------------------------------------------------------------------
# (a) bias + scaled residual + activation
# ----------------------------------------------------------------------------------------------------


CASES_A = [
    # (M, N, scale, x layout, residual layout, grad layout)
    (1, 1, 1.0, "contiguous", "contiguous", "contiguous"),
    (3, 24, 0.5, "transposed", "sliced", "expand"),
    (127, 16, -2.0, "sliced", "contiguous", "transposed"),
    (127, 200, 0.0, "contiguous", "transposed", "contiguous"),  # N > 128: two column blocks; scale 0
    (33, 13, 3.25, "contiguous", "expand", "sliced"),  # residual broadcast over rows (stride 0)
]


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("M,N,scale,xl,rl,gl", CASES_A)
def test_bias_residual_act(M, N, scale, xl, rl, gl, activation, device, assert_close):
    x = leaf(make((M, N), xl, device, seed=1))
    r = leaf(make((M, N), rl, device, seed=2))
    b = leaf(make((1, N), "contiguous", device, seed=3).reshape(N))
    g = make((M, N), gl, device, seed=4)
    out = bias_residual_act(x, b, r, scale, activation)
    assert out.shape == (M, N) and out.dtype == x.dtype and out.is_contiguous()
    out.backward(g)
    ref, (gx, gb, gr) = ref_grads(lambda x, b, r: apply_activation(x + b + scale * r, activation), (x, b, r), g)
    what = f"{activation} M={M} N={N} scale={scale}"
    assert_close(out, ref, torch.float32, msg=f"out {what}")
    assert_close(x.grad, gx, torch.float32, msg=f"grad_x {what}")
    # the bias gradient sums M rows
    assert_close(b.grad, gb, torch.float32, scale=max(1.0, M**0.5), msg=f"grad_bias {what}")
    assert_close(r.grad, gr, torch.float32, scale=max(1.0, abs(scale)), msg=f"grad_residual {what}")


@pytest.mark.parametrize(
    "need,bias,activation",
    [((True, False, False), True, "gelu"), ((False, True, False), True, "relu"), ((False, False, True), True, "sigmoid"),
     ((True, False, True), False, "squared_relu"), ((True, False, True), False, "none")],
)
def test_bias_residual_partial_grads(need, bias, activation, device, assert_close):
    M, N = 5, 24
    x = leaf(make((M, N), "contiguous", device, seed=5), need[0])
    b = leaf(make((1, N), "contiguous", device, seed=6).reshape(N), need[1]) if bias else None
    r = leaf(make((M, N), "contiguous", device, seed=7), need[2])
    g = make((M, N), "contiguous", device, seed=8)
    bias_residual_act(x, b, r, 0.75, activation).backward(g)
    ref, grads = ref_grads(lambda x, b, r: apply_activation(x + (0 if b is None else b) + 0.75 * r, activation), (x, b, r), g)
    for name, t, gref in zip(("x", "bias", "residual"), (x, b, r), grads):
        if t is None:
            continue
        if t.requires_grad:
            assert_close(t.grad, gref, torch.float32, scale=2.0, msg=name)
        else:
            assert t.grad is None, name


def test_bias_residual_leading_dims_and_module(device, assert_close):
    mod = FusedBiasResidualAct(16, scale=0.5, activation="gelu").to(device)
    assert list(mod.state_dict()) == ["bias"] and torch.equal(mod.bias, torch.zeros(16, device=device))
    assert FusedBiasResidualAct(4, bias=False).bias is None
    with torch.no_grad():
        mod.bias.copy_(torch.linspace(-1, 1, 16))
    x = torch.randn(2, 3, 16, device=device, requires_grad=True)
    r = torch.randn(2, 3, 16, device=device)
    out = mod(x, r)
    assert out.shape == (2, 3, 16)
    ref = apply_activation(x.double() + mod.bias.double() + 0.5 * r.double(), "gelu")
    assert_close(out, ref, torch.float32)
    out.sum().backward()  # expanded (stride-0) incoming gradient
    assert mod.bias.grad is not None and x.grad is not None
    with pytest.raises(ValueError):
        bias_residual_act(x, mod.bias, r[:, :2])
    with pytest.raises(ValueError):
        bias_residual_act(x, torch.zeros(5, device=device), r)


# ----------------------------------------------------------------------------------------------------
# (b) dropout + bias + activation
# ----------------------------------------------------------------------------------------------------


def dropout_reference(x, b, p, activation, mask):
    y = apply_activation(x + (0 if b is None else b), activation)
    keep_scale = 0.0 if p >= 1 else 1.0 / (1.0 - p)
    return y * (mask.to(y.dtype) * keep_scale)


CASES_B = [
    # (M, N, p, x layout, grad layout)
    (1, 16, 0.5, "contiguous", "contiguous"),
    (3, 24, 0.1, "transposed", "expand"),
    (127, 16, 0.3, "sliced", "transposed"),
    (127, 200, 0.9, "contiguous", "contiguous"),
    (9, 7, 1.0, "contiguous", "contiguous"),  # everything dropped: zeros, zero gradients, no nan
]


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("M,N,p,xl,gl", CASES_B)
def test_dropout_bias_act(M, N, p, xl, gl, activation, device, assert_close):
    seed = 1234 + M
    x = leaf(make((M, N), xl, device, seed=9))
    b = leaf(make((1, N), "contiguous", device, seed=10).reshape(N))
    g = make((M, N), gl, device, seed=11)
    out = dropout_bias_act(x, b, p, activation, seed=seed)
    out.backward(g)
    mask = dropout_mask((M, N), p, seed, device)
    assert mask.dtype == torch.bool and mask.shape == (M, N)
    if p == 1.0:
        assert not mask.any()
    ref, (gx, gb) = ref_grads(lambda x, b: dropout_reference(x, b, p, activation, mask.to(x.device)), (x, b), g)
    what = f"{activation} M={M} N={N} p={p}"
    # kept values are scaled by 1/(1-p) (10x for p=0.9)
    s = 1.0 if p >= 1.0 else 1.0 / (1.0 - p)
    assert_close(out, ref, torch.float32, scale=s, msg=f"out {what}")
    assert_close(x.grad, gx, torch.float32, scale=s, msg=f"grad_x {what}")
    assert_close(b.grad, gb, torch.float32, scale=s * max(1.0, M**0.5), msg=f"grad_bias {what}")
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()


def test_dropout_mask_statistics_and_seeds(device):
    """The mask keeps ~1-p of the elements, depends only on (seed, shape, p), and changes with the seed."""
    M, N, p = 127, 200, 0.3
    m1 = dropout_mask((M, N), p, 7, device)
    assert torch.equal(m1, dropout_mask((M, N), p, 7, device))
    assert not torch.equal(m1, dropout_mask((M, N), p, 8, device))
    keep = m1.float().mean().item()
    # 25400 Bernoulli(0.7) draws: std ~0.003; 5 sigma
    assert abs(keep - (1 - p)) < 0.015, keep
    x = torch.randn(M, N, device=device)
    a = dropout_bias_act(x, None, p, "none", seed=7)
    torch.testing.assert_close(a, torch.where(m1, x / (1 - p), torch.zeros_like(x)))
    # the same seed with non-contiguous input gives the same mask (offsets are logical indices)
    xt = x.t().contiguous().t()
    assert torch.equal(dropout_bias_act(xt, None, p, "none", seed=7), a)


def test_dropout_eval_and_p0_are_exact(device):
    x = torch.randn(3, 24, device=device)
    b = torch.randn(24, device=device)
    ref = torch.relu(x + b)
    torch.testing.assert_close(dropout_bias_act(x, b, 0.5, "relu", seed=3, training=False), ref, atol=0, rtol=0)
    torch.testing.assert_close(dropout_bias_act(x, b, 0.0, "relu"), ref, atol=0, rtol=0)
    with pytest.raises(ValueError):
        dropout_bias_act(x, b, 1.5)
    with pytest.raises(ValueError):
        dropout_bias_act(x, b, 0.5, seed=-1)


def test_dropout_module(device, assert_close):
    torch.manual_seed(0)
    mod = FusedDropoutBiasAct(16, p=0.25, activation="sigmoid").to(device)
    assert list(mod.state_dict()) == ["bias"]
    x = torch.randn(2, 5, 16, device=device, requires_grad=True)
    out = mod(x, seed=42)
    mask = dropout_mask((10, 16), 0.25, 42, device).view(2, 5, 16)
    assert_close(out, dropout_reference(x.double(), mod.bias.double(), 0.25, "sigmoid", mask), torch.float32, scale=2.0)
    out.sum().backward()
    assert mod.bias.grad is not None
    # without a seed, one is drawn from torch's generator: reproducible under manual_seed
    torch.manual_seed(1)
    a = mod(x)
    torch.manual_seed(1)
    assert torch.equal(a, mod(x))
    mod.eval()
    assert_close(mod(x), torch.sigmoid(x.double() + mod.bias.double()), torch.float32)


def test_opcheck(device):
    ops = torch.ops.dlrm_kernels
    x = make((5, 24), "transposed", device, seed=12).requires_grad_()
    r = make((5, 24), "contiguous", device, seed=13).requires_grad_()
    b = torch.randn(24, device=device, requires_grad=True)
    g = make((5, 24), "expand", device, seed=14)
    torch.library.opcheck(ops.bias_residual_act.default, (x, b, r, 0.5, "gelu"))
    torch.library.opcheck(ops.bias_residual_act.default, (x, None, r, 2.0, "relu"))
    torch.library.opcheck(ops.bias_residual_act_backward.default, (g, x.detach(), "gelu", 0.5, True, True, True))
    torch.library.opcheck(ops.dropout_bias_act.default, (x, b, 0.3, "squared_relu", 5))
    torch.library.opcheck(ops.dropout_bias_act.default, (x, b, 0.3, "relu", 5))
    torch.library.opcheck(ops.dropout_bias_act_backward.default, (g, x.detach(), "gelu", 0.3, 5, True))


# ----------------------------------------------------------------------------------------------------
# GPU: fp32 and bf16
# ----------------------------------------------------------------------------------------------------


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("M,N", [(1, 16), (127, 24), (4099, 200)])
def test_gpu_bias_residual_act(M, N, activation, dtype, assert_close):
    device = torch.device("cuda")
    x = leaf(make((M, N), "transposed", device, dtype, seed=1))
    r = leaf(make((M, N), "contiguous", device, dtype, seed=2))
    b = leaf(make((1, N), "contiguous", device, dtype, seed=3).reshape(N))
    g = make((M, N), "expand", device, dtype, seed=4)
    out = bias_residual_act(x, b, r, -1.5, activation)
    assert out.dtype == dtype
    out.backward(g)
    ref, (gx, gb, gr) = ref_grads(lambda x, b, r: apply_activation(x + b - 1.5 * r, activation), (x, b, r), g)
    # bf16: values up to ~6 (squared_relu ~30) rounded to 8 bits; gradients of sums of M rows
    s = 4.0 if activation == "squared_relu" else 1.0
    assert_close(out, ref, dtype, scale=s, msg="out")
    assert_close(x.grad, gx, dtype, scale=s, msg="grad_x")
    assert_close(r.grad, gr, dtype, scale=2 * s, msg="grad_residual")
    assert_close(b.grad, gb, dtype, scale=s * M**0.5, msg="grad_bias")


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gpu_dropout_bias_act(activation, dtype, assert_close):
    device = torch.device("cuda")
    M, N, p, seed = 4099, 200, 0.2, 99
    x = leaf(make((M, N), "sliced", device, dtype, seed=5))
    b = leaf(make((1, N), "contiguous", device, dtype, seed=6).reshape(N))
    g = make((M, N), "contiguous", device, dtype, seed=7)
    out = dropout_bias_act(x, b, p, activation, seed=seed)
    out.backward(g)
    mask = dropout_mask((M, N), p, seed, device)
    assert abs(mask.float().mean().item() - (1 - p)) < 0.01
    ref, (gx, gb) = ref_grads(lambda x, b: dropout_reference(x, b, p, activation, mask), (x, b), g)
    s = 4.0 if activation == "squared_relu" else 1.25
    assert_close(out, ref, dtype, scale=s, msg="out")
    assert_close(x.grad, gx, dtype, scale=s, msg="grad_x")
    assert_close(b.grad, gb, dtype, scale=s * M**0.5, msg="grad_bias")
