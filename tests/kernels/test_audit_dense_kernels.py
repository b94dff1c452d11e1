"""Audit of the dense kernels (kernels/linear.py, epilogue.py, wgrad.py, col_sum.py, activations.py, mlp.py,
fp8_linear.py) by mutation testing: the behaviour the other kernel tests left unguarded.

Each test names what it guards: an empty reduction (K == 0) in the fused linear layer, the host-side refusals
(split-K with a stored pre-activation, mismatched operands, an unknown input_precision, mismatched layer shapes and
dtypes), the linear op's memory contract (no pre-activation saved where the output suffices) and its fake
registration, torch's TF32 setting as the linear layer reads it, TMA's 16-byte base alignment rule and the weight
gradient's loads stopping at the batch's last row, a bias-only gradient of the fused MLP's first layer, the fused
MLP's 16-byte input padding, fp8_mlp on nested and bias-free layers, and the rowwise FP8 layer's bf16 weight
gradient. Numerical checks are element by element against float64. CPU: Triton interpreter (fp32); GPU: the same
tests on CUDA tensors.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before triton is imported (tests/kernels/conftest.py does the same)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from torch import nn  # noqa: E402

import kernels.mlp as kmlp  # noqa: E402
import kernels.wgrad as kwgrad  # noqa: E402
from kernels.activations import ACTIVATIONS, apply_activation  # noqa: E402
from kernels.fp8_linear import E4M3, Fp8Linear, fp8_mlp, quantize  # noqa: E402
from kernels.linear import _default_allow_tf32, _linear_act_backward_op, _linear_act_op, gemm_bias_act, linear_act  # noqa: E402
from kernels.mlp import fused_mlp, mask_bias_grad  # noqa: E402
from tests.kernels.mlp_chain_reference import matmul_precision  # noqa: E402

# (atol, rtol) of fp32 results against float64 (a few ulps on sums of up to ~100 terms of size ~1)
FP32 = (1e-5, 1e-5)


def _close(got: torch.Tensor, ref: torch.Tensor, what: str, atol: float = FP32[0], rtol: float = FP32[1]) -> None:
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    torch.testing.assert_close(got.detach().double().cpu(), ref.detach().double().cpu(), atol=atol, rtol=rtol,
                               msg=lambda m: f"{what}: {m}")


def _randn(*shape, device, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)


# ----------------------------------------------------------------------------------------------
# kernels/linear.py
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_linear_empty_reduction_is_act_of_bias(activation, device):
    """K == 0 (`_empty_reduction`): out = act(bias) on every row, the stored pre-activation is the bias (the
    backward of gelu / squared_relu reads it), and the gradients: grad_b = sum_m g * act'(b), empty grad_x / grad_W."""
    M, N = 3, 7
    x = torch.empty(M, 0, device=device, requires_grad=True)
    w = torch.empty(N, 0, device=device, requires_grad=True)
    b = _randn(N, device=device, seed=1).requires_grad_()
    g = _randn(M, N, device=device, seed=2)
    out = linear_act(x, w, b, activation)
    out.backward(g)

    bd = b.detach().double().cpu().expand(M, N).clone().requires_grad_()
    ref = apply_activation(bd, activation)
    ref.backward(g.double().cpu())
    _close(out, ref, f"out {activation}")
    _close(b.grad, bd.grad.sum(0), f"grad_b {activation}")
    assert x.grad.shape == (M, 0) and w.grad.shape == (N, 0)

    got, pre = gemm_bias_act(x.detach(), w.detach(), b.detach(), activation, store_pre=True)
    _close(pre, b.detach().double().expand(M, N), f"pre {activation}")
    _close(got, ref, f"gemm out {activation}")


@pytest.mark.parametrize("bias,activation,store_pre", [(False, "none", True), (False, "relu", False), (True, "none", False)])
def test_gemm_split_k_refuses_every_epilogue(bias, activation, store_pre, device):
    """split_k > 1 only for plain GEMMs: the slices' partial sums cannot carry a bias, an activation or a stored
    pre-activation (a split pre-activation would be written slice by slice past its [M, N] buffer)."""
    a, w = _randn(5, 70, device=device, seed=3), _randn(3, 70, device=device, seed=4)
    b = _randn(3, device=device, seed=5) if bias else None
    with pytest.raises(ValueError, match="split_k"):
        gemm_bias_act(a, w, b, activation, store_pre=store_pre, split_k=2)


def test_gemm_rejects_mismatched_reduction_widths(device):
    """a [M, K] @ w [N, K]^T with different K's is refused before any launch (the kernel would read w past K)."""
    with pytest.raises(ValueError, match="do not match"):
        gemm_bias_act(torch.randn(4, 5, device=device), torch.randn(3, 6, device=device))
    with pytest.raises(ValueError, match="do not match"):
        gemm_bias_act(torch.randn(4, 5, device=device), torch.randn(3, 4, device=device))


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_linear_op_stores_the_pre_activation_only_when_the_backward_needs_it(activation, device):
    """none / relu / sigmoid differentiate from the output (no [M, N] pre-activation kept: the memory the docstring
    promises); gelu and squared_relu return the pre-activation x @ W^T + b, checked against float64."""
    M, K, N = 3, 13, 17
    x, w, b = _randn(M, K, device=device, seed=6), _randn(N, K, device=device, seed=7) * K**-0.5, _randn(N, device=device, seed=8)
    out, pre = _linear_act_op(x, w, b, activation, "ieee")
    ref_pre = x.double() @ w.double().t() + b.double()
    _close(out, apply_activation(ref_pre, activation), f"out {activation}")
    if activation in ("gelu", "squared_relu"):
        _close(pre, ref_pre, f"pre {activation}")
    else:
        assert pre.numel() == 0, f"{activation}: a pre-activation of {tuple(pre.shape)} was kept"


def test_linear_ops_fake_registrations_match_without_a_pre_activation(device):
    """The fake (meta) kernels of the forward and backward ops agree with the real ones where no pre-activation is
    stored (relu) and where some gradients are not asked for (torch.compile traces with the fakes)."""
    x = torch.randn(3, 13, device=device, requires_grad=True)
    w = torch.randn(16, 13, device=device, requires_grad=True)
    b = torch.randn(16, device=device, requires_grad=True)
    torch.library.opcheck(_linear_act_op, (x, w, b, "relu", "ieee"), test_utils=("test_schema", "test_faketensor"))
    g, y = torch.randn(3, 16, device=device), torch.randn(3, 16, device=device).relu()
    torch.library.opcheck(_linear_act_backward_op, (g, y, x.detach(), w.detach(), "relu", "ieee", False, True, False),
                          test_utils=("test_schema", "test_faketensor"))


def test_bad_input_precision_is_refused_on_every_device(device):
    """An input_precision other than "ieee" / "tf32" is refused wherever the GEMMs run, as cross_forward and the
    on-chip tail do: before the fix gemm_bias_act checked it only for fp32 operands outside the interpreter (the CPU
    and 16-bit runs took any string) and linear_wgrad never did (the CPU ignored the name; a GPU fp32 run handed it
    to tl.dot)."""
    a, w = torch.randn(5, 13, device=device), torch.randn(3, 13, device=device)
    with pytest.raises(ValueError, match="input_precision"):
        gemm_bias_act(a, w, input_precision="tf33")
    with pytest.raises(ValueError, match="input_precision"):
        kwgrad.linear_wgrad(torch.randn(9, 4, device=device), torch.randn(9, 3, device=device), input_precision="fp32")
    got, _ = gemm_bias_act(a, w, input_precision="tf32")  # the valid names still run (ieee in the interpreter)
    _close(got, a.double() @ w.double().t(), "gemm", atol=2e-2 if device.type == "cuda" else FP32[0],
           rtol=2e-2 if device.type == "cuda" else FP32[1])


def test_default_allow_tf32_follows_torch_matmul_setting():
    """What nn.Linear's cuBLAS would do: torch.backends.cuda.matmul.fp32_precision "tf32" -> TF32, "ieee" -> not
    (read the same on a machine without CUDA; the interpreter then runs ieee whatever it says)."""
    matmul = torch.backends.cuda.matmul
    old = matmul.fp32_precision
    try:
        matmul.fp32_precision = "tf32"
        assert _default_allow_tf32() is True
        matmul.fp32_precision = "ieee"
        assert _default_allow_tf32() is False
    finally:
        matmul.fp32_precision = old


# ----------------------------------------------------------------------------------------------
# kernels/wgrad.py
# ----------------------------------------------------------------------------------------------


def test_wgrad_tma_needs_a_16_byte_aligned_base(device, monkeypatch):
    """TMA descriptors need a 16-byte aligned base: a view starting one fp32 element into its storage takes the
    pointer kernel even when TMA is forced on, and its gradients still match float64."""
    monkeypatch.setattr(kwgrad, "TMA_OPERANDS", True)
    B, M, N = 37, 16, 8
    g_store = _randn(B * M + 1, device=device, seed=9)
    g_off = g_store[1:].view(B, M)  # unit column stride, 64-byte rows, base 4 bytes past an aligned one
    assert g_off.data_ptr() % 16 != 0
    x = _randn(B, N, device=device, seed=10)
    y = _randn(B, M, device=device, seed=11).relu()
    assert kwgrad._tma_layout_ok(g_off.clone()) and kwgrad._use_tma(g_off.clone(), x, y, True)
    assert not kwgrad._tma_layout_ok(g_off)
    assert not kwgrad._use_tma(g_off, x, y, True)
    y_off = torch.zeros(B * M + 1, device=device)[1:].view(B, M)
    y_off.copy_(y)  # the layer output as a misaligned view
    assert y_off.data_ptr() % 16 != 0
    assert not kwgrad._use_tma(g_off.clone(), x, y_off, True)

    dw, db = kwgrad.linear_wgrad(g_off, x, y)
    gm = torch.where(y.double() > 0, g_off.double(), 0.0)
    _close(dw, gm.t() @ x.double(), "dW")
    _close(db, gm.sum(0), "db")


@pytest.mark.parametrize("tma", [False, True])
def test_wgrad_reads_no_row_past_the_batch(tma, device, monkeypatch):
    """x a view of the first B rows of a larger buffer whose next rows hold NaN (a slice of a bigger activation
    buffer): no load may touch row B (0 * NaN would poison dW), with the pointer kernel and with TMA g / y (x by
    pointer loads: 13 fp32 columns are no 16-byte row), a batch that ends mid-tile, split and unsplit."""
    monkeypatch.setattr(kwgrad, "TMA_OPERANDS", tma)
    B, M, N = 37, 16, 13
    full = _randn(B + 3, N, device=device, seed=47)
    full[B:] = float("nan")
    x = full[:B]
    g = _randn(B, M, device=device, seed=48)
    y = _randn(B, M, device=device, seed=49).relu()
    gm = torch.where(y.double() > 0, g.double(), 0.0)
    for splits in (1, 2):
        dw, db = kwgrad.linear_wgrad(g, x, y, splits=splits)
        _close(dw, gm.t() @ x.double(), f"dW splits={splits}")
        _close(db, gm.sum(0), f"db splits={splits}")


# ----------------------------------------------------------------------------------------------
# kernels/mlp.py
# ----------------------------------------------------------------------------------------------


def test_fused_mlp_bias_only_gradient_of_the_first_layer(device):
    """Data input, first layer's weight frozen but its bias trained: the backward chain must reach layer 0 for the
    bias gradient alone (the lowest layer asking for any gradient, weight or bias). Against float64."""
    dims, M = [13, 24, 16], 37
    x = _randn(M, dims[0], device=device, seed=13)
    ws = [(_randn(o, i, device=device, seed=14 + k) * i**-0.5) for k, (i, o) in enumerate(zip(dims[:-1], dims[1:]))]
    bs = [_randn(o, device=device, seed=20 + k) for k, o in enumerate(dims[1:])]
    ws[1].requires_grad_()
    bs[0].requires_grad_()
    bs[1].requires_grad_()
    g = _randn(M, dims[-1], device=device, seed=30)
    with matmul_precision("fp32"):  # ieee fp32 cuBLAS GEMMs on a GPU
        fused_mlp(x, ws, bs, [True, False]).backward(g)

    wd = [w.detach().double().cpu().requires_grad_() for w in ws]
    bd = [b.detach().double().cpu().requires_grad_() for b in bs]
    h = torch.relu(x.double().cpu() @ wd[0].t() + bd[0])
    (h @ wd[1].t() + bd[1]).backward(g.double().cpu())
    assert ws[0].grad is None
    _close(bs[0].grad, bd[0].grad, "bias 0 grad", atol=4e-5)
    _close(ws[1].grad, wd[1].grad, "weight 1 grad", atol=4e-5)
    _close(bs[1].grad, bd[1].grad, "bias 1 grad", atol=4e-5)


def test_fused_mlp_host_checks(device):
    """Refused before any GEMM: a bias of the wrong width, a weight or bias of another dtype, and a mask whose
    layer output does not have the gradient's shape (the kernel would read it out of bounds)."""
    x = torch.randn(3, 13, device=device)
    w = torch.randn(4, 13, device=device)
    with pytest.raises(ValueError, match="layer 0"):
        fused_mlp(x, [w], [torch.zeros(5, device=device)], [True])
    with pytest.raises(ValueError, match="dtype"):
        fused_mlp(x, [w.double()], [torch.zeros(4, device=device, dtype=torch.float64)], [True])
    with pytest.raises(ValueError, match="dtype"):
        fused_mlp(x, [w], [torch.zeros(4, device=device, dtype=torch.float64)], [True])
    with pytest.raises(ValueError, match="grad's shape"):
        mask_bias_grad(torch.randn(4, 3, device=device), torch.randn(4, 2, device=device), True)


def test_fused_mlp_pads_the_first_layer_to_16_bytes(device):
    """The first layer's K is padded with zero columns to 16 bytes (cuBLAS's aligned Hopper kernels; the same path
    on every device): 13 fp32 features -> 16, x and W alike, values kept; an aligned K is left as is."""
    assert [kmlp._aligned_k(k, torch.float32) for k in (1, 4, 5, 13, 16, 17)] == [4, 4, 8, 16, 16, 20]
    assert [kmlp._aligned_k(k, torch.bfloat16) for k in (1, 8, 9, 13, 16)] == [8, 8, 16, 16, 16]
    x, w = _randn(5, 13, device=device, seed=40), _randn(6, 13, device=device, seed=41)
    xp, wp = kmlp._input_layer_operands(x, w)
    assert xp.shape == (5, 16) and wp.shape == (6, 16)
    assert torch.equal(xp[:, :13], x) and torch.equal(wp[:, :13], w)
    assert not xp[:, 13:].any() and not wp[:, 13:].any()
    x16 = _randn(5, 16, device=device, seed=42)
    assert kmlp._input_layer_operands(x16, None)[0] is x16


# ----------------------------------------------------------------------------------------------
# kernels/fp8_linear.py
# ----------------------------------------------------------------------------------------------


def test_fp8_mlp_swaps_nested_and_bias_free_layers(device):
    """Layers inside nested containers are swapped too (an arch's MLP holds its layers in a ModuleList), and a
    bias-free nn.Linear becomes a bias-free Fp8Linear with the same weight that computes the product of the
    dequantized FP8 operands (bf16 output: within 2**-7 relative of the float64 product)."""
    mlp = nn.Sequential(nn.Sequential(nn.Linear(32, 16, bias=False), nn.ReLU()), nn.Linear(16, 16)).to(device)
    out = fp8_mlp(mlp)
    assert [type(m).__name__ for m in (out[0][0], out[0][1], out[1])] == ["Fp8Linear", "ReLU", "Fp8Linear"]
    assert out[0][0].bias is None and out[1].bias is not None
    assert list(out.state_dict()) == list(mlp.state_dict())
    assert torch.equal(out[0][0].weight, mlp[0][0].weight)
    x = _randn(16, 32, device=device, seed=43)
    y = out[0][0](x)
    xq, sx = quantize(x, E4M3)
    wq, sw = quantize(mlp[0][0].weight.detach(), E4M3)
    ref = (xq.double() * sx.double()) @ (wq.double() * sw.double()).t()
    atol = 2**-7 * float(ref.abs().max())
    _close(y, ref, "bias-free fp8 layer", atol=atol, rtol=2**-7)
    assert isinstance(out[0][0], Fp8Linear)


def test_fp8_rowwise_weight_gradient_is_a_bf16_gemm(device):
    """fp8_rowwise_linear's weight gradient is the 16-bit GEMM of the bf16 gradient and the bf16-rounded input
    ("rowwise_with_gw_hp"): every element a bf16 value (the GEMM's bf16 output), within bf16 output rounding of the
    float64 product of the same bf16 operands (2**-7, as test_fp8_linear's BF16_OUT)."""
    from kernels.fp8_linear import fp8_rowwise_linear

    x = _randn(48, 32, device=device, seed=44).requires_grad_()
    w = (_randn(16, 32, device=device, seed=45) * 32**-0.5).requires_grad_()
    g = _randn(48, 16, device=device, seed=46)
    fp8_rowwise_linear(x, w).backward(g)
    dw = w.grad
    assert dw.dtype == torch.float32
    assert torch.equal(dw, dw.to(torch.bfloat16).float()), "the weight gradient is not a bf16 GEMM's output"
    ref = g.to(torch.bfloat16).double().t() @ x.detach().to(torch.bfloat16).double()
    _close(dw, ref, "rowwise dW", atol=2**-7 * float(ref.abs().max()), rtol=2**-7)
