"""kernels/loss.py (fused BCE with logits) against a float64 reference: loss and both gradients.

CPU: Triton interpreter, fp32. GPU (marked gpu): fp32 and bf16 logits.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.loss import TritonBCEWithLogitsLoss, bce_backward, bce_forward, bce_with_logits


REDUCTIONS = ["mean", "sum", "none"]


def make_inputs(B: int, device, dtype=torch.float32, *, layout: str = "contiguous", scale: float = 3.0,
                soft: bool = False, seed: int = 0):
    """logits ~ N(0, scale) and labels in {0, 1} (or soft labels in [0, 1]); a non-contiguous `layout` lays out the
    labels with another stride than the logits'."""
    gen = torch.Generator().manual_seed(seed)
    # The views are taken on the device, in the dtype: moving a strided view would copy it contiguous.
    if layout == "contiguous":
        z = (torch.randn(B, generator=gen) * scale).to(device=device, dtype=dtype)
    elif layout == "strided":  # every other element of a longer vector
        z = (torch.randn(2 * B, generator=gen) * scale).to(device=device, dtype=dtype)[::2]
    elif layout == "column":  # a column of a [B, 3] matrix (stride 3), as a model's [B, 1] head squeezed
        z = (torch.randn(B, 3, generator=gen) * scale).to(device=device, dtype=dtype)[:, 1]
    else:
        raise ValueError(layout)
    y = (torch.rand(B, generator=gen) if soft else torch.randint(0, 2, (B,), generator=gen).float()).to(device)
    # Labels in a layout of their own, never the logits' stride, between NaNs that poison a wrong read.
    if layout == "strided":  # a column of a [B, 3] matrix (stride 3)
        y = torch.full((B, 3), float("nan"), device=device).index_copy_(1, torch.tensor([2], device=device),
                                                                         y[:, None])[:, 2]
    elif layout == "column":  # every other element (stride 2)
        y = torch.full((2 * B,), float("nan"), device=device).index_copy_(0, torch.arange(0, 2 * B, 2, device=device),
                                                                           y)[::2]
    return z, y


def reference(z: torch.Tensor, y: torch.Tensor, reduction: str, grad: torch.Tensor | None, need_y: bool = False):
    """float64 loss and gradients of the same (rounded) input values."""
    z64 = z.detach().double().requires_grad_()
    y64 = y.detach().double().requires_grad_(need_y)
    loss = F.binary_cross_entropy_with_logits(z64, y64, reduction=reduction)
    loss.backward(grad.double() if grad is not None else None)
    return loss.detach(), z64.grad, y64.grad


def check(got, ref, dtype, what, assert_close, scale=1.0):
    assert got.shape == ref.shape, f"{what}: {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite"
    assert_close(got, ref, dtype, scale=scale, msg=what)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("B,layout", [(1, "contiguous"), (3, "strided"), (127, "column"), (4161, "contiguous")])
def test_loss_and_grads(B, layout, reduction, device, assert_close):
    """B=4161 spans 66 forward blocks under the interpreter (64 elements each), so three steps of the partial-sum
    loop (32 partials each), the last one partial."""
    z, y = make_inputs(B, device, layout=layout, soft=(B == 3), seed=B)
    z.requires_grad_()
    y.requires_grad_(True)  # labels may require grad, as in torch (d loss / dy = -z)
    out = bce_with_logits(z, y, reduction)
    if reduction == "none":
        grad = torch.randn(B, generator=torch.Generator().manual_seed(1)).to(device)
    else:
        grad = torch.tensor(0.7, device=device)
    out.backward(grad)
    ref, gz, gy = reference(z, y, reduction, grad, need_y=True)
    assert out.dtype == z.dtype
    # sums of B terms of size ~1: scale the absolute tolerance with B for 'sum'
    check(out, ref, torch.float32, "loss", assert_close, scale=B if reduction == "sum" else 1.0)
    # 'mean' gradients are O(1/B): scale atol with them so the check stays relative
    gscale = 1.0 / B if reduction == "mean" else 1.0
    check(z.grad, gz, torch.float32, "grad_logits", assert_close, scale=gscale)
    check(y.grad, gy, torch.float32, "grad_labels", assert_close, scale=gscale)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_labels_gradient_alone(reduction, device, assert_close):
    """Only the labels require grad: their gradient (-z, scaled), none for the logits, and no input written to (the
    backward launches with the logits standing in for the gradient it must not write)."""
    B = 70
    z, y = make_inputs(B, device, layout="column", soft=True, seed=8)
    z0, y0 = z.clone(), y.clone()
    y.requires_grad_()
    out = bce_with_logits(z, y, reduction)
    grad = torch.randn(B, device=device) if reduction == "none" else torch.tensor(0.7, device=device)
    out.backward(grad)
    _, _, gy = reference(z, y, reduction, grad, need_y=True)
    assert z.grad is None
    check(y.grad, gy, torch.float32, "grad_labels", assert_close, scale=1.0 / B if reduction == "mean" else 1.0)
    assert torch.equal(z, z0) and torch.equal(y.detach(), y0)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_large_logits_are_stable(reduction, device, assert_close):
    """|z| ~ 100 (and up to 1e4): exp never overflows; losses are exact (|z| or ~e^-|z|), the gradient is
    sigmoid(z) - y, with no inf/nan anywhere."""
    z = torch.tensor([100.0, -100.0, 100.0, -100.0, 88.0, -88.0, 1e4, -1e4, 30.0, -30.0, 20.0, -20.0, 0.0], device=device)
    y = torch.tensor([0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0], device=device)
    z.requires_grad_()
    out = bce_with_logits(z, y, reduction)
    grad = torch.ones_like(z) if reduction == "none" else torch.tensor(1.0, device=device)
    out.backward(grad)
    ref, gz, _ = reference(z, y, reduction, grad)
    assert torch.isfinite(out).all() and torch.isfinite(z.grad).all()
    # Losses reach 1e4: relative tolerance of fp32 on the big ones; the tiny ones (e^-100 ~ 4e-44, e^-30 ~ 9e-14,
    # e^-20 ~ 2e-9) must not become 0 when they are the whole loss -- checked one by one below.
    torch.testing.assert_close(out.detach().double().cpu(), ref.cpu(), atol=1e-5, rtol=1e-6)
    check(z.grad, gz, torch.float32, "grad_logits", assert_close)
    if reduction == "none":
        # Where max(z, 0) - z * y is 0 the loss is log1p(e^-|z|), computed here in float64 as such: PyTorch's
        # float64 formula takes log(1 + e^-|z|), which loses e^-30 to 0.2% and e^-100 entirely.
        exact = torch.log1p(torch.exp(-z.detach().double().abs())).cpu()
        # e^-30 (z = +-30 on the right side) and log1p(e^-20) ~ 2.06e-9 (z = -20, y = 0; a naive log(1 + e^-20)
        # in fp32 rounds it to 0) are normal fp32 numbers: to fp32's precision of e^x, whose relative error grows
        # with |x| (the GPU's exp is 2^(x log2 e), and x log2 e rounds to 2^-24 of itself): (|z| + 4) 2^-24.
        for i in (8, 9, 11):
            rtol = (abs(float(z[i].detach())) + 4.0) * 2.0**-24
            torch.testing.assert_close(out[i].double().cpu(), exact[i], atol=0.0, rtol=rtol, msg=f"loss {i}")
        # e^-100 ~ 3.7e-44 is an fp32 subnormal (~27 units of 2^-149): within two of those units, not flushed to 0
        # (an H200 with Triton 3.6 gives 27 units, as the interpreter does).
        torch.testing.assert_close(out[2:4].double().cpu(), exact[2:4], atol=2.0 * 2.0**-149, rtol=0.0)


@pytest.mark.parametrize("layout", ["expand", "strided"])
def test_unreduced_noncontiguous_and_expanded_grad(layout, device, assert_close):
    """reduction='none' with a stride-0 (``.sum()``-style expanded) or strided incoming gradient."""
    B = 127
    z, y = make_inputs(B, device, seed=3)
    z.requires_grad_()
    out = bce_with_logits(z, y, "none")
    gen = torch.Generator().manual_seed(4)
    if layout == "expand":
        grad = torch.randn(1, generator=gen).to(device).expand(B)
        assert grad.stride(0) == 0
    else:
        grad = torch.randn(2 * B, generator=gen).to(device)[::2]
    out.backward(grad)
    _, gz, _ = reference(z, y, "none", grad)
    check(z.grad, gz, torch.float32, "grad_logits", assert_close)
    # .sum().backward() expands a scalar gradient the same way
    z2 = z.detach().clone().requires_grad_()
    bce_with_logits(z2, y, "none").sum().backward()
    check(z2.grad, reference(z, y, "sum", None)[1], torch.float32, "grad_logits (sum)", assert_close)


def test_two_dim_inputs_and_module(device, assert_close):
    """Any shape is accepted ([B, 1] as a model head gives); the module matches nn.BCEWithLogitsLoss."""
    z, y = make_inputs(26, device, seed=5)
    z2, y2 = z.view(13, 2).t(), y.view(13, 2).t()  # non-contiguous 2-D
    out = bce_with_logits(z2, y2, "none")
    assert out.shape == (2, 13)
    check(out, reference(z2, y2, "none", torch.ones(2, 13, device=device))[0], torch.float32, "loss 2-D", assert_close)
    mod = TritonBCEWithLogitsLoss()
    assert mod.state_dict() == {} and list(mod.parameters()) == []
    check(mod(z, y), torch.nn.BCEWithLogitsLoss()(z.double(), y.double()), torch.float32, "module", assert_close)


def test_deterministic_and_labels_without_grad(device):
    z, y = make_inputs(300, device, seed=6)
    a = bce_with_logits(z, y, "mean")
    b = bce_with_logits(z, y, "mean")
    assert torch.equal(a, b)
    zz = z.clone().requires_grad_()
    bce_with_logits(zz, y, "mean").backward()
    assert zz.grad is not None and y.grad is None
    gz, gy = bce_backward(torch.tensor(1.0, device=device), z, y, "mean", True, False)
    assert gy is None and torch.equal(gz, zz.grad)


def test_empty_and_bad_inputs(device):
    e = torch.empty(0, device=device)
    assert bce_forward(e, e, "sum").item() == 0.0
    assert torch.isnan(bce_forward(e, e, "mean"))
    z = torch.randn(3, device=device)
    with pytest.raises(ValueError, match="reduction"):
        bce_with_logits(z, z, "max")
    with pytest.raises(ValueError, match="shape"):
        bce_with_logits(z, torch.zeros(4, device=device))
    with pytest.raises(TypeError):
        bce_with_logits(z, torch.zeros(3, dtype=torch.int64, device=device))


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_opcheck(reduction, device):
    z, y = make_inputs(70, device, seed=7)
    torch.library.opcheck(torch.ops.dlrm_kernels.bce_with_logits.default, (z.requires_grad_(), y, reduction))
    grad = torch.randn(70, device=device) if reduction == "none" else torch.tensor(1.5, device=device)
    torch.library.opcheck(
        torch.ops.dlrm_kernels.bce_with_logits_backward.default, (grad, z.detach(), y, reduction, True, True)
    )


# ----------------------------------------------------------------------------------------------------
# GPU: fp32 and bf16 logits (labels fp32), a batch of many blocks
# ----------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B", [1, 127, 65536 + 3])
def test_gpu_loss_and_grads(B, dtype, reduction, assert_close):
    device = torch.device("cuda")
    z, y = make_inputs(B, device, dtype, seed=B)
    z.requires_grad_()
    out = bce_with_logits(z, y, reduction)
    assert out.dtype == dtype
    grad = torch.randn(B, device=device, dtype=dtype) if reduction == "none" else torch.tensor(1.0, device=device, dtype=dtype)
    out.backward(grad)
    ref, gz, _ = reference(z, y, reduction, grad)
    # fp32 accumulation: 'sum' of 65k terms ~ 1 each is accurate to ~sqrt(B) ulps of the sum.
    loss_scale = B if reduction == "sum" else 1.0
    check(out, ref, dtype, "loss", assert_close, scale=loss_scale)
    check(z.grad, gz, dtype, "grad_logits", assert_close, scale=1.0 / B if reduction == "mean" else 1.0)
    torch.testing.assert_close(out.float(), F.binary_cross_entropy_with_logits(z.detach().float(), y, reduction=reduction),
                               atol=2e-2 * loss_scale if dtype == torch.bfloat16 else 1e-5 * loss_scale,
                               rtol=2e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_large_logits(dtype):
    device = torch.device("cuda")
    z = torch.tensor([100.0, -100.0, 1e4, -1e4, 50.0, -50.0], device=device, dtype=dtype).requires_grad_()
    y = torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0, 0.0], device=device)
    out = bce_with_logits(z, y, "none")
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(z.grad).all()
    ref, gz, _ = reference(z, y, "none", torch.ones(6, device=device))
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6)
    torch.testing.assert_close(z.grad.double(), gz, atol=1e-5, rtol=0)
