"""Audit of the kernels' float64 and bf16 loose ends (kernelrest).

1. The fused BCE's label gradient with float64 labels (fp32 logits: float64 logits are refused): computed in fp32 and
   handed back as float64, ~1e-8 off torch's float64 autograd; now computed in float64.
2. ``dense_grad_impl`` (the plain lookups' dense backward) summed a float64 gradient in fp32 and returned it as
   float64; now refused in one line naming the dtype. The dtypes it takes stay checked element by element.
3. Triton's interpreter (the CPU runs and tests) kept bf16 tensors as uint16 bit patterns and its ``tl.dot``
   multiplied those integers: every bf16 GEMM kernel (linear, cross, wgrad, interaction, the MLP tail) returned values
   ~1e10 off, silently, and its fp32 -> bf16 cast truncated where a GPU rounds to nearest (`kernels._interpreter`).
   With both fixed the bf16 MLP chains are checked against the eager bf16 MLP: the same rounding points.

4. The model a run trains: ``kernels.interaction "triton"`` at ``train.precision "bf16"`` (under the CPU's bf16 autocast
   the bottom MLP's bf16 output goes into the interaction) trained a CPU run on a loss of 7.7e8, with no error.
   (Here rather than in tests/test_audit_kernelrest.py: two test modules of one basename cannot be collected together.)

Numbers are compared element by element with float64 references of the same (rounded) values, on the CPU under the
interpreter and on the GPU alike (where the interpreter fixes are not installed and the GPU computes the same).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dlrm.config import config_from_dict
from dlrm.model.dlrm import build_model
from kernels.embedding import embedding_lookup
from kernels.embedding.update import dense_grad_impl
from kernels.interaction import dot_interaction, dot_interaction_reference
from kernels.linear import linear_act
from kernels.loss import bce_with_logits
from kernels.mlp import fused_mlp
from kernels.mlp_tail import tail_mlp

BF16_ULP = 2.0**-7  # the spacing of bf16 numbers in [1, 2): 8 bits of significand


def _f64(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _one_line(err) -> None:
    assert "\n" not in str(err.value), str(err.value)


# ----------------------------------------------------------------------------------------------------
# 1. the fused BCE's label gradient with float64 labels
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("B", [1, 3, 127])
def test_bce_float64_labels_get_a_float64_gradient(B, reduction, device, assert_close):
    """fp32 logits (a column of a [B, 3] matrix), float64 soft labels (every other element) requiring grad, and for
    'none' a strided upstream gradient: the labels' gradient is float64 and equals torch's float64 autograd of the
    same values to float64 rounding (it was computed in fp32: ~1e-8 off); the logits' gradient and the loss keep the
    kernels' fp32 accuracy."""
    z = (_f64(B, 3, seed=B) * 3).float().to(device)[:, 1].requires_grad_()
    y = torch.rand(2 * B, generator=torch.Generator().manual_seed(B + 1), dtype=torch.float64).to(device)[::2]
    y.requires_grad_()
    grad = _f64(2 * B, seed=7).float().to(device)[::2] if reduction == "none" else torch.tensor(0.7, device=device)
    out = bce_with_logits(z, y, reduction)
    out.backward(grad)
    z64 = z.detach().double().requires_grad_()
    y64 = y.detach().clone().requires_grad_()
    ref = F.binary_cross_entropy_with_logits(z64, y64, reduction=reduction)
    ref.backward(grad.double())
    assert y.grad.dtype == torch.float64 and y.grad.shape == (B,)
    torch.testing.assert_close(y.grad.cpu(), y64.grad.cpu(), rtol=1e-14, atol=1e-300)
    scale = 1.0 / B if reduction == "mean" else 1.0
    assert_close(z.grad, z64.grad, torch.float32, scale=scale, msg="grad logits")
    # the labels are read as fp32 values: the float64 loss of the fp32-rounded labels, to fp32's accuracy
    want = F.binary_cross_entropy_with_logits(z64.detach(), y.detach().float().double(), reduction=reduction)
    assert_close(out, want, torch.float32, scale=B if reduction == "sum" else 1.0, msg="loss")


def test_bce_float64_labels_gradient_alone(device):
    """Only the labels require grad ('mean', B = 5): no logits gradient, the labels' one in float64."""
    z = torch.tensor([-3.0, -0.1, 0.0, 0.7, 1e3], device=device)
    y = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.9], dtype=torch.float64, device=device, requires_grad=True)
    go = torch.tensor(1.3, device=device)  # fp32, as the loss
    bce_with_logits(z, y, "mean").backward(go)
    assert z.grad is None
    want = -z.double() * (go.double() / 5)
    torch.testing.assert_close(y.grad.cpu(), want.cpu(), rtol=1e-15, atol=0.0)


# ----------------------------------------------------------------------------------------------------
# 2. dense_grad_impl: float64 refused, the other dtypes element by element
# ----------------------------------------------------------------------------------------------------


def test_dense_grad_refuses_float64_in_one_line(device):
    """Two positions of row 0 with gradient 1 + 1e-12: fp32 sums gave 2 exactly (2e-12 off) as float64, no error."""
    rows = torch.tensor([[0, 5], [0, 6]], device=device)
    g64 = torch.full((2, 2, 3), 1.0 + 1e-12, dtype=torch.float64, device=device)
    match = r"^the embedding backward kernels take float32, bfloat16 or float16 operands, got torch\.float64"
    with pytest.raises(ValueError, match=match) as err:
        dense_grad_impl(rows, g64, 8)
    _one_line(err)
    with pytest.raises(ValueError, match=match):  # an fp32 gradient asked back as float64
        dense_grad_impl(rows, g64.float(), 8, dtype=torch.float64)
    # through the plain lookup's autograd: a float64 table's backward
    card, off = torch.tensor([5, 7], device=device), torch.tensor([0, 5], device=device)
    weight = _f64(12, 3, seed=1).to(device).requires_grad_()
    out = embedding_lookup(torch.tensor([[1, 2], [3, 2]], device=device), weight, card, off)
    assert out.dtype == torch.float64  # the gather itself is exact
    with pytest.raises(ValueError, match=match):
        out.backward(torch.ones_like(out))


@pytest.mark.parametrize("gdtype,odtype", [(torch.float32, None), (torch.float16, None), (torch.bfloat16, torch.float32),
                                           (torch.float16, torch.float32), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("B,F_,D", [(1, 1, 1), (1, 1, 7), (5, 3, 5)])
def test_dense_grad_dtypes_against_float64(B, F_, D, gdtype, odtype, device):
    """Odd shapes (batch 1, one feature, D = 1), a non-contiguous gradient ([D, B, F] permuted), repeated rows and a
    row past the table (skipped): each element is the float64 sum of the same gradient values, rounded once."""
    R = 9
    rows = torch.randint(0, R + 1, (B, F_), generator=torch.Generator().manual_seed(B * 10 + D)).to(device)
    rows[0, 0] = R  # past the table: no gradient
    g = _f64(D, B, F_, seed=D).to(device=device, dtype=gdtype).permute(1, 2, 0)
    got = dense_grad_impl(rows, g, R, dtype=odtype)
    keep = rows.reshape(-1) < R
    want = torch.zeros(R, D, dtype=torch.float64).index_add_(0, rows.reshape(-1)[keep].cpu(),
                                                             g.double().reshape(-1, D)[keep].cpu())
    out_dtype = odtype or gdtype
    assert got.dtype == out_dtype and got.shape == (R, D)
    # the fp32 sum of at most B * F terms, rounded once to out_dtype: within half a step of it (and fp32's ulps)
    step = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-10}[out_dtype]
    tol = want.abs() * step + want.abs().max() * 2.0**-22 * B * F_ + 1e-30
    assert ((got.double().cpu() - want).abs() <= tol).all(), (got, want)


# ----------------------------------------------------------------------------------------------------
# 3. bf16 in Triton's interpreter: tl.dot and the fp32 -> bf16 cast
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _dot_kernel(a_ptr, b_ptr, out_ptr, N: tl.constexpr):
    r = tl.arange(0, N)
    a = tl.load(a_ptr + r[:, None] * N + r[None, :])
    b = tl.load(b_ptr + r[:, None] * N + r[None, :])
    tl.store(out_ptr + r[:, None] * N + r[None, :], tl.dot(a, b))


@triton.jit
def _cast_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m).to(tl.bfloat16), mask=m)


def test_bf16_dot_multiplies_values(device):
    """A [16, 16] x [16, 16] bf16 tl.dot into fp32: the float64 product of the same values to fp32's accuracy (the
    interpreter multiplied the uint16 bit patterns: ~1e9 here)."""
    a, b = (_f64(16, 16, seed=s).to(device=device, dtype=torch.bfloat16) for s in (1, 2))
    out = torch.empty(16, 16, device=device)
    _dot_kernel[(1,)](a, b, out, N=16)
    torch.testing.assert_close(out.double().cpu(), (a.double() @ b.double()).cpu(), rtol=1e-5, atol=1e-5)


def test_fp32_to_bf16_cast_rounds_to_nearest_even(device):
    """As a GPU's cvt.rn.bf16.f32 and torch's .bfloat16(): ties to even both ways, the carry into the exponent,
    overflow to inf, subnormals, signed zero, inf and NaN (the interpreter truncated: 1 + 3 * 2^-9 became 1)."""
    vals = [1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 3 * 2**-9, 1.0 + 2**-9, -(1.0 + 3 * 2**-9), 2.0 - 2**-9,
            3.3895314e38, 1e-40, -0.0, 0.1, -7.77, float("inf"), float("-inf"), 123456.789]
    x = torch.tensor(vals, dtype=torch.float32, device=device)
    out = torch.empty(len(vals), dtype=torch.bfloat16, device=device)
    _cast_kernel[(1,)](x, out, len(vals), BLOCK=16)
    want = x.cpu().bfloat16()
    assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16)), (out, want)
    nan = torch.full((3,), float("nan"), device=device)
    out = torch.zeros(3, dtype=torch.bfloat16, device=device)
    _cast_kernel[(1,)](nan, out, 3, BLOCK=16)
    assert torch.isnan(out).all()


def test_bf16_linear_and_interaction_against_float64(device):
    """The bf16 GEMM kernels on odd shapes: linear + ReLU (5 x 24 -> 13) and the dot interaction (B = 3, F + 1 = 4,
    D = 5) with its backward, against float64 of the same bf16 values to bf16's tolerance."""
    bf = torch.bfloat16
    x, w, b = _f64(5, 24, seed=3).to(device, bf), (_f64(13, 24, seed=4) / 5).to(device, bf), _f64(13, seed=5).to(device, bf)
    got = linear_act(x, w, b, "relu")
    want = torch.relu(x.double() @ w.double().t() + b.double())
    torch.testing.assert_close(got.double().cpu(), want.cpu(), rtol=2e-2, atol=2e-2)
    e = _f64(3, 4, 5, seed=6).to(device, bf).requires_grad_()
    out = dot_interaction(e)
    g = _f64(*out.shape, seed=8).to(device, bf)
    out.backward(g)
    e64 = e.detach().double().requires_grad_()
    ref = dot_interaction_reference(e64)
    ref.backward(g.double())
    torch.testing.assert_close(out.double().cpu(), ref.detach().cpu(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(e.grad.double().cpu(), e64.grad.cpu(), rtol=2e-2, atol=5e-2)


# ----------------------------------------------------------------------------------------------------
# 3. the bf16 MLP chains against the eager bf16 MLP (rounding points)
# ----------------------------------------------------------------------------------------------------


def _within_ulps(got: torch.Tensor, want: torch.Tensor, ulps: float, what: str) -> None:
    """Each element within `ulps` bf16 steps of the eager value (the step of the larger of the two magnitudes)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    mag = torch.maximum(got.abs(), want.abs())
    step = torch.where(mag > 0, torch.exp2(torch.floor(torch.log2(mag.clamp_min(1e-38)))) * BF16_ULP,
                       torch.zeros_like(mag))
    bad = (got - want).abs() > ulps * step
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off, e.g. {got[bad][:4].tolist()} vs {want[bad][:4].tolist()}"


@pytest.mark.parametrize("chain", ["tail", "fused"])
def test_bf16_mlp_chains_round_where_the_eager_bf16_mlp_does(chain, device):
    """40 -> 24 -> 16 -> 3 (ReLU, ReLU, none) at 203 rows, bf16 operands: the on-chip tail (one kernel, layers on chip)
    and the fused MLP give the eager bf16 chain's output, input gradient, weight and bias gradients, each element
    within a bf16 step (GEMM sums in another order; on the CPU the outputs and data gradients are bitwise equal): each
    layer's output and each data gradient rounded to bf16, the weight and bias gradients summed in fp32 and rounded
    once. Before the interpreter fix the tail returned values ~1e10 off on the CPU."""
    bf = torch.bfloat16
    dims, relu, M = [40, 24, 16, 3], [True, True, False], 203
    x0 = _f64(M, dims[0], seed=11).to(device, bf)
    w0 = [(_f64(b, a, seed=12 + i) / a**0.5).to(device, bf) for i, (a, b) in enumerate(zip(dims[:-1], dims[1:]))]
    b0 = [_f64(b, seed=20 + i).to(device, bf) for i, b in enumerate(dims[1:])]
    g = _f64(M, dims[-1], seed=30).to(device, bf)

    def grads(fn):
        x = x0.clone().requires_grad_()
        ws = [w.clone().requires_grad_() for w in w0]
        bs = [b.clone().requires_grad_() for b in b0]
        out = fn(x, ws, bs)
        out.backward(g)
        return [out, x.grad, *(w.grad for w in ws), *(b.grad for b in bs)]

    def eager(x, ws, bs):
        h = x
        for w, b, r in zip(ws, bs, relu):
            h = F.linear(h, w, b)
            h = h.relu() if r else h
        return h

    kernel = tail_mlp if chain == "tail" else fused_mlp
    got = grads(lambda x, ws, bs: kernel(x, ws, bs, relu))
    want = grads(eager)
    names = ["output", "grad x", "grad W0", "grad W1", "grad W2", "grad b0", "grad b1", "grad b2"]
    for name, a, b in zip(names, got, want):
        assert a.dtype == bf and a.shape == b.shape, name
        # on a GPU cuBLAS and the kernel sum in other orders, and a ReLU decision at a pre-activation within
        # rounding of 0 may differ: a few steps there; the interpreter and the CPU's eager bf16 agree to one
        _within_ulps(a, b, 1.0 if device.type == "cpu" else 4.0, f"{chain} {name}")


def test_bf16_interpreter_fix_installs_once():
    """Installed by ``import kernels`` in interpreter mode (whatever DLRM_INTERPRETER_PATCH_ONCE says), once: a second
    call neither fails nor wraps its own wrapper; outside the interpreter (a GPU session) nothing is installed."""
    import triton.runtime.interpreter as interpreter

    from kernels import _interpreter
    from kernels._backend import interpret_mode

    assert _interpreter.install_bf16_dot() is interpret_mode()
    assert _interpreter.install_bf16_dot() is interpret_mode()
    if interpret_mode():
        assert interpreter.InterpreterBuilder.create_dot is _interpreter._create_dot_exact_bf16
        assert _interpreter._original_dot is not _interpreter._create_dot_exact_bf16
        assert _interpreter._original_fp_trunc is not _interpreter._fp_trunc_nearest_bf16


# ----------------------------------------------------------------------------------------------------
# 4. a bf16 model on the Triton interaction computes what the PyTorch one does
# ----------------------------------------------------------------------------------------------------

CARDS = [3, 5, 2, 7]


def _model_step(interaction: str, device, dense, sparse, labels, state=None):
    """(logits, loss, the model's gradients by name, its state) of one bf16-autocast forward and backward."""
    cfg = config_from_dict({"model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
                            "kernels": {"embedding": "torch", "mlp": "torch", "interaction": interaction,
                                        "loss": "torch"}})
    model = build_model(cfg.model, CARDS, None, cfg.kernels, device)
    if state is not None:
        model.load_state_dict(state)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        logits = model(dense, sparse)
        loss = F.binary_cross_entropy_with_logits(logits.float(), labels)
    loss.backward()
    grads = {n: p.grad.to_dense() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), loss.detach(), grads, model.state_dict()


def test_bf16_model_on_the_triton_interaction_matches_the_torch_one(device):
    gen = torch.Generator().manual_seed(0)
    dense = torch.rand(5, 13, generator=gen).mul(3).to(device)
    sparse = torch.randint(-1, 50, (5, len(CARDS)), generator=gen).to(device)
    labels = torch.randint(0, 2, (5,), generator=gen).float().to(device)
    ref_logits, ref_loss, ref_grads, state = _model_step("torch", device, dense, sparse, labels)
    logits, loss, grads, _ = _model_step("triton", device, dense, sparse, labels, state)
    assert torch.isfinite(logits).all() and logits.dtype == ref_logits.dtype
    # the same bf16 values, dot products summed in another order: within a few bf16 steps (2^-8 relative)
    torch.testing.assert_close(logits.float().cpu(), ref_logits.float().cpu(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(loss.cpu(), ref_loss.cpu(), rtol=1e-2, atol=1e-3)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        scale = max(1.0, float(ref_grads[name].float().abs().max()))
        torch.testing.assert_close(g.float().cpu(), ref_grads[name].float().cpu(), rtol=5e-2, atol=5e-2 * scale,
                                   msg=lambda m, name=name: f"{name}: {m}")
