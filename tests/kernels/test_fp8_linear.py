"""kernels/fp8_linear.py: FP8 GEMMs with dynamic per-tensor scales, forward and every gradient.

The reference is the float64 product of the *dequantized* FP8 operands (``q * inv_scale``), so the
comparison checks the scaling, the operand layouts and the GEMMs to the rounding of their outputs
(bf16: 2**-8 relative; fp32 weight gradients: fp32 accumulation), not FP8's own coarseness; one test
bounds that coarseness against the exact float64 layer as well. ``torch._scaled_mm`` runs on the CPU
too (a reference implementation), so these run in CI and on the H100 (cuBLASLt FP8).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernels.fp8_linear import E4M3, E5M2, Fp8Linear, Fp8RowwiseLinear, fp8_mlp, quantize, quantize_rows

BF16_OUT = dict(rtol=2**-7, atol_frac=2**-7)  # bf16 outputs: half an ulp each way, and a cancellation margin
FP32_OUT = dict(rtol=1e-5, atol_frac=1e-5)
# The FP8 GEMM's fp32 output (the weight gradient): exact fp32 accumulation on the CPU; Hopper's FP8 tensor
# cores accumulate with fewer mantissa bits (~2**-9 relative measured on the H100), so there bf16's bound
FP8_GEMM_FP32_OUT = BF16_OUT if torch.cuda.is_available() else FP32_OUT


def close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol_frac: float, what: str) -> None:
    """Element by element in float64; atol is `atol_frac` of the reference's largest magnitude."""
    expected = expected.detach().double().cpu()
    atol = atol_frac * float(expected.abs().max()) + 1e-30
    torch.testing.assert_close(actual.detach().double().cpu(), expected, rtol=rtol, atol=atol,
                               msg=lambda m: f"{what}: {m}")


def dq(q: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    return q.double() * inv_scale.double()


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantize_maps_amax_to_the_largest_value_and_round_trips(dtype, device):
    t = torch.randn(48, 80, device=device) * 3.0
    q, inv = quantize(t, dtype)
    assert q.dtype == dtype and inv.dtype == torch.float32 and inv.dim() == 0
    fmax = torch.finfo(dtype).max
    assert float(q.float().abs().max()) == fmax  # the largest magnitude lands on the largest finite value
    # round to nearest: within half a step of the format (3 mantissa bits e4m3, 2 e5m2) for normal values
    half_step = 2.0 ** -(4 if dtype == E4M3 else 3)
    back = dq(q, inv)
    normal = t.abs().double() * float(1 / inv) >= torch.finfo(dtype).smallest_normal
    rel = ((back - t.double()).abs() / t.double().abs())[normal]
    assert float(rel.max()) <= half_step * (1 + 1e-6)
    zq, zinv = quantize(torch.zeros(16, 16, device=device), dtype)  # no division by zero
    assert float(zinv) == 1.0 and not zq.float().any()


@pytest.mark.parametrize("n, k, m", [(16, 16, 16), (48, 80, 32), (32, 16, 112)])
@pytest.mark.parametrize("bias", [True, False])
def test_forward_and_gradients_match_the_dequantized_float64_product(n, k, m, bias, device):
    torch.manual_seed(n + k + m)
    layer = Fp8Linear(k, m, bias=bias).to(device)
    x = torch.randn(n, k, device=device, requires_grad=True)
    g = torch.randn(n, m, device=device)
    y = layer(x)
    y.backward(g)
    assert y.dtype == torch.bfloat16 and x.grad.dtype == x.dtype and layer.weight.grad.dtype == torch.float32

    xq, sx = quantize(x.detach(), E4M3)
    wq, sw = quantize(layer.weight.detach(), E4M3)
    gq, sg = quantize(g.to(torch.bfloat16), E5M2)  # the gradient arrives in y's dtype
    ref_y = dq(xq, sx) @ dq(wq, sw).T + (layer.bias.double() if bias else 0.0)
    close(y, ref_y, **BF16_OUT, what="y")
    close(x.grad, dq(gq, sg) @ dq(wq, sw), **BF16_OUT, what="dx")
    close(layer.weight.grad, dq(gq, sg).T @ dq(xq, sx), **FP8_GEMM_FP32_OUT, what="dW")
    if bias:
        close(layer.bias.grad, g.to(torch.bfloat16).double().sum(0), **FP32_OUT, what="db")


def test_noncontiguous_input_and_gradient(device):
    torch.manual_seed(0)
    layer = Fp8Linear(32, 16).to(device)
    base = torch.randn(32, 64, device=device)
    x = base[:, ::2].detach().requires_grad_(True)  # [32, 32], stride (64, 2)
    g = torch.randn(16, 64, device=device).t()[::2]  # [32, 16], transposed strides
    assert not x.is_contiguous() and not g.is_contiguous()
    xc = x.detach().contiguous().requires_grad_(True)
    layer(x).backward(g)
    dw = layer.weight.grad.clone()
    layer.weight.grad = None
    layer(xc).backward(g.contiguous())
    torch.testing.assert_close(x.grad, xc.grad, rtol=0, atol=0)
    torch.testing.assert_close(layer.weight.grad, dw, rtol=0, atol=0)


def test_fp8_error_against_the_exact_layer_is_what_fp8_allows(device):
    """Against the float64 layer on the unquantized values: FP8's coarseness (e4m3 operands ~2**-4,
    e5m2 gradients ~2**-3 relative), nothing worse (a wrong scale or layout would be O(1))."""
    torch.manual_seed(1)
    layer = Fp8Linear(256, 128).to(device)
    x = torch.randn(512, 256, device=device, requires_grad=True)
    g = torch.randn(512, 128, device=device)
    y = layer(x)
    y.backward(g)
    w, b = layer.weight.detach().double(), layer.bias.detach().double()

    def rel(a, e):
        return float((a.double() - e).norm() / e.norm())

    assert rel(y, x.detach().double() @ w.T + b) < 0.05
    assert rel(x.grad, g.double() @ w) < 0.1
    assert rel(layer.weight.grad, g.double().T @ x.detach().double()) < 0.1


def test_fp8_mlp_swaps_only_layers_of_multiples_of_16_and_keeps_the_parameters():
    mlp = nn.Sequential(nn.Linear(13, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 1))
    out = fp8_mlp(mlp)
    assert [type(m).__name__ for m in out] == ["Linear", "ReLU", "Fp8Linear", "ReLU", "Linear"]
    assert type(mlp[2]) is nn.Linear  # the original is left alone
    for (ka, a), (kb, b) in zip(mlp.state_dict().items(), out.state_dict().items()):
        assert ka == kb and torch.equal(a, b)
    mlp[2].weight.requires_grad_(False)  # a frozen layer stays frozen (its bias, trainable, stays trainable)
    frozen = fp8_mlp(mlp)[2]
    assert type(frozen).__name__ == "Fp8Linear"
    assert not frozen.weight.requires_grad and frozen.bias.requires_grad


def test_shapes_fp8_gemms_cannot_take_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"in_features \(13\) and out_features \(512\) must be multiples of 16"):
        Fp8Linear(13, 512)
    with pytest.raises(ValueError, match=r"the batch \(3\) must be a multiple of 16"):
        Fp8Linear(16, 16)(torch.randn(3, 16))
    with pytest.raises(ValueError, match=r"^Fp8RowwiseLinear: the batch \(17\) must be a multiple of 16"):
        Fp8RowwiseLinear(16, 16)(torch.randn(17, 16))


# ---- rowwise scales (fp8_rowwise_linear): tried on the MLPerf dense part, not wired into the model ----


def test_quantize_rows_scales_each_row_and_returns_row_major(device):
    t = torch.randn(40, 48, device=device) * torch.logspace(-3, 3, 40, device=device)[:, None]
    t[7] = 0.0
    q, inv = quantize_rows(t.t().contiguous().t())  # column-major input: the result is row-major all the same
    assert q.dtype == E4M3 and q.is_contiguous() and inv.shape == (40, 1) and inv.dtype == torch.float32
    fmax = torch.finfo(E4M3).max
    amax = q.float().abs().amax(dim=1)
    assert torch.equal(amax[torch.arange(40, device=device) != 7], torch.full((39,), fmax, device=device))
    assert float(inv[7]) == 1.0 and not q[7].float().any()  # an all-zero row: scale 1, no division by zero
    back = dq(q, inv)
    normal = t.abs().double() / inv.double() >= torch.finfo(E4M3).smallest_normal
    rel = ((back - t.double()).abs() / t.double().abs().clamp_min(1e-30))[normal]
    assert float(rel.max()) <= 2.0**-4 * (1 + 1e-6)  # round to nearest with 3 mantissa bits, in every row


@pytest.mark.parametrize("n, k, m", [(16, 16, 16), (48, 80, 32), (32, 16, 112)])
@pytest.mark.parametrize("bias", [True, False])
def test_rowwise_forward_and_gradients_match_the_dequantized_float64_product(n, k, m, bias, device):
    """y and dx against the float64 product of the rowwise-dequantized operands (W per output row for y, per
    input column for dx); dW is the bf16 GEMM of the 16-bit gradient and input; db the fp32 sum."""
    torch.manual_seed(n * k + m)
    layer = Fp8RowwiseLinear(k, m, bias=bias).to(device)
    x = torch.randn(n, k, device=device, requires_grad=True)
    g = torch.randn(n, m, device=device)
    y = layer(x)
    y.backward(g)
    assert y.dtype == torch.bfloat16 and x.grad.dtype == x.dtype and layer.weight.grad.dtype == torch.float32

    w = layer.weight.detach()
    xq, sx = quantize_rows(x.detach())
    wq, sw = quantize_rows(w)
    gb = g.to(torch.bfloat16)  # the gradient arrives in y's dtype
    gq, sg = quantize_rows(gb)
    wtq, swt = quantize_rows(w.t())
    close(y, dq(xq, sx) @ dq(wq, sw).T + (layer.bias.double() if bias else 0.0), **BF16_OUT, what="y")
    close(x.grad, dq(gq, sg) @ dq(wtq, swt).T, **BF16_OUT, what="dx")
    close(layer.weight.grad, gb.double().T @ x.detach().to(torch.bfloat16).double(), **BF16_OUT, what="dW")
    if bias:
        close(layer.bias.grad, gb.double().sum(0), **FP32_OUT, what="db")


def test_rowwise_layer_stays_within_fp8_coarseness_of_the_exact_layer(device):
    """Against the exact float64 layer: each output within 2 x 2**-4 of the sum of |x_i w_i| (both operands
    rounded to 3 mantissa bits), non-contiguous input and gradient."""
    torch.manual_seed(3)
    layer = Fp8RowwiseLinear(64, 48).to(device)
    x = torch.randn(64, 32, device=device).t().detach().requires_grad_(True)  # [32, 64], column-major
    g = torch.randn(48, 32, device=device).t()  # [32, 48], column-major
    y = layer(x)
    y.backward(g)
    w = layer.weight.detach().double()
    xd = x.detach().double()
    bound_y = 2 * 2.0**-4 * (xd.abs() @ w.abs().T) + 2**-8 * (xd @ w.T).abs()
    assert bool(((y.double() - (xd @ w.T + layer.bias.double())).abs() <= bound_y + 1e-6).all())
    gd = g.to(torch.bfloat16).double()
    bound_dx = 2 * 2.0**-4 * (gd.abs() @ w.abs()) + 2**-8 * (gd @ w).abs()
    assert bool(((x.grad.double() - gd @ w).abs() <= bound_dx + 1e-6).all())


def test_rowwise_layer_refuses_widths_fp8_gemms_cannot_take():
    with pytest.raises(ValueError, match=r"in_features \(13\)"):
        Fp8RowwiseLinear(13, 16)
