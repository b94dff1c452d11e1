"""kernels/linear.py against a float64 PyTorch reference: output and every gradient.

Without CUDA the kernels run under the Triton interpreter (fp32, ieee dot); the tests marked gpu
repeat the comparisons on CUDA in fp32 (ieee and tf32) and bf16. This file also holds the one
torch.compile test of the linear / epilogue / loss ops.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before triton is imported (tests/kernels/conftest.py does the same)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from torch import nn  # noqa: E402

from kernels.activations import ACTIVATIONS, apply_activation  # noqa: E402
from kernels.linear import TritonLinear, _linear_act_backward_op, _linear_act_op, linear_act  # noqa: E402


# (atol, rtol) against float64, by how the kernel computes. "fp32": ieee fp32 products (the
# interpreter, or allow_tf32=False on the GPU): a few ulps on sums of up to ~127 terms of size ~1.
# "tf32": inputs rounded to 10 mantissa bits (rel. ~5e-4 each) before exact products, fp32 sums.
# "bf16": bf16 inputs, fp32 accumulation, bf16 outputs (rel. step 4e-3) and bf16 grad_pre feeding
# the backward GEMMs.
TOLERANCES = {"fp32": (1e-5, 1e-5), "tf32": (2e-2, 2e-2), "bf16": (5e-2, 3e-2)}
DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16}


def _make(shape, layout: str, device, dtype, gen, scale: float = 1.0) -> torch.Tensor:
    """A tensor of `shape` [R, C] with a given memory layout (values are what matter, not layout)."""
    R, C = shape
    if layout == "contiguous":
        t = torch.randn(R, C, generator=gen)
    elif layout == "transposed":
        t = torch.randn(C, R, generator=gen).t()
    elif layout == "sliced":  # every other column of a wider tensor: stride 2 along dim 1
        t = torch.randn(R, 2 * C + 1, generator=gen)[:, 1::2]
    elif layout == "expand":  # stride 0 along the rows (incoming gradients only)
        t = torch.randn(1, C, generator=gen).expand(R, C)
    else:
        raise ValueError(layout)
    return (t * scale).to(device=device, dtype=dtype)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    """A leaf requiring grad that keeps `t`'s (possibly non-contiguous) layout."""
    return t.detach().requires_grad_(True)


# Rounding of a sum of products grows with the magnitude of its terms, not of its result: the check
# also allows MAG_TOL[kind] * (|A| @ |B|), the float64 sum of the terms' absolute values (a standard
# c * u * |A||B| error bound with a small c; u = 2**-24 for fp32).
MAG_TOL = {"fp32": 2.0**-22, "tf32": 2.0**-10, "bf16": 2.0**-8}


def _check(got: torch.Tensor, ref: torch.Tensor, kind: str, what: str, tol_scale: float = 1.0,
           mag: torch.Tensor | None = None) -> None:
    atol, rtol = TOLERANCES[kind]
    atol, rtol = atol * tol_scale, rtol * tol_scale
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    if mag is None:
        torch.testing.assert_close(got, ref, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")
        return
    allowed = atol + rtol * ref.abs() + MAG_TOL[kind] * mag.detach().double().cpu()
    err = (got - ref).abs()
    bad = err > allowed
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} / {bad.numel()} elements off; worst excess at "
        f"{tuple(int(i) for i in torch.nonzero(bad)[0])}: |{got[bad][0]:.6g} - {ref[bad][0]:.6g}| > {allowed[bad][0]:.3g}"
    )


def run_case(
    M: int,
    K: int,
    N: int,
    activation: str,
    device,
    kind: str = "fp32",
    x_layout: str = "contiguous",
    w_layout: str = "contiguous",
    grad_layout: str = "contiguous",
    bias: bool = True,
    need: tuple[bool, bool, bool] = (True, True, True),
    seed: int = 0,
    tol_scale: float = 1.0,
) -> None:
    """Forward and backward of linear_act vs float64 autograd on the same (rounded) input values."""
    dtype = DTYPES[kind]
    gen = torch.Generator().manual_seed(seed)
    x = _leaf(_make((M, K), x_layout, device, dtype, gen))
    # nn.Linear-like scale keeps pre-activations O(1) so one absolute tolerance fits every layer.
    w = _leaf(_make((N, K), w_layout, device, dtype, gen, scale=K**-0.5))
    b = _leaf(_make((1, N), "contiguous", device, dtype, gen).reshape(N)) if bias else None
    g = _make((M, N), grad_layout, device, dtype, gen)
    for t, req in zip((x, w, b), need):
        if t is not None:
            t.requires_grad_(req)

    out = linear_act(x, w, b, activation, allow_tf32=(kind == "tf32"))
    assert out.dtype == dtype and out.shape == (M, N)
    out.backward(g)

    # float64 reference from the same (rounded) inputs. The gradient is taken w.r.t. the pre-activation
    # and pushed through the GEMMs explicitly, so every result also gets its |A| @ |B| magnitude.
    # relu' jumps at 0: where the kernel's pre-activation may round to the other side of 0 than float64 (|pre|
    # within the output's own error bound, e.g. with tf32), the reference takes the kernel's decision (its output
    # > 0); everywhere else float64's, so an output zeroed or kept on the wrong side of 0 fails.
    xd, wd = x.detach().double(), w.detach().double()
    bd = b.detach().double() if b is not None else None
    pre = (xd @ wd.t() + (bd if bd is not None else 0.0)).requires_grad_()
    mag_out = xd.abs() @ wd.abs().t() + (bd.abs() if bd is not None else 0.0)
    if activation == "relu":
        edge = (TOLERANCES[kind][0] + MAG_TOL[kind] * mag_out) * tol_scale
        mask = torch.where(pre.detach().abs() < edge, out.detach() > 0, pre.detach() > 0)
        ref = pre * mask
    else:
        ref = apply_activation(pre, activation)
    (gp,) = torch.autograd.grad(ref, pre, g.double())
    ref_grads = {"grad_x": gp @ wd, "grad_w": gp.t() @ xd, "grad_b": gp.sum(0)}
    mags = {
        "out": mag_out,
        "grad_x": gp.abs() @ wd.abs(),
        "grad_w": gp.abs().t() @ xd.abs(),
        "grad_b": gp.abs().sum(0),
    }

    tag = f"M={M} K={K} N={N} act={activation} {kind} x={x_layout} w={w_layout} g={grad_layout}"
    _check(out, ref, kind, f"out [{tag}]", tol_scale, mag=mags["out"])
    for name, t in (("grad_x", x), ("grad_w", w), ("grad_b", b)):
        if t is None:
            continue
        if t.requires_grad:
            _check(t.grad, ref_grads[name], kind, f"{name} [{tag}]", tol_scale, mag=mags[name])
        else:
            assert t.grad is None


# ----------------------------------------------------------------------------------------------
# CPU (interpreter) or the default CUDA device: fp32
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("N", [1, 16, 24])
@pytest.mark.parametrize("K", [13, 16, 24])
@pytest.mark.parametrize("M", [1, 3, 127])
def test_shapes_relu(M, K, N, device):
    run_case(M, K, N, "relu", device)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("M,K,N", [(127, 13, 24), (1, 24, 1), (3, 16, 16)])
def test_activations(M, K, N, activation, device):
    run_case(M, K, N, activation, device, seed=1)


@pytest.mark.parametrize(
    "x_layout,w_layout,grad_layout,activation",
    [
        ("transposed", "contiguous", "contiguous", "gelu"),
        ("sliced", "transposed", "contiguous", "relu"),
        ("contiguous", "sliced", "transposed", "squared_relu"),
        ("contiguous", "contiguous", "expand", "sigmoid"),
        ("transposed", "transposed", "expand", "none"),
        ("sliced", "contiguous", "transposed", "none"),
    ],
)
def test_noncontiguous(x_layout, w_layout, grad_layout, activation, device):
    run_case(127, 13, 24, activation, device, x_layout=x_layout, w_layout=w_layout, grad_layout=grad_layout, seed=2)


@pytest.mark.parametrize(
    "need,bias,activation",
    [
        ((False, True, True), True, "relu"),
        ((True, False, False), True, "gelu"),
        ((False, False, True), True, "none"),
        ((True, True, False), False, "sigmoid"),
        ((True, True, False), False, "none"),
    ],
)
def test_partial_grads_and_no_bias(need, bias, activation, device):
    run_case(3, 24, 16, activation, device, bias=bias, need=need, seed=3)


@pytest.mark.parametrize(
    "M,K,N,activation,x_layout", [(127, 40, 200, "gelu", "contiguous"), (70, 37, 130, "squared_relu", "transposed")]
)
def test_several_tiles_per_dimension(M, K, N, activation, x_layout, device):
    """Several output tiles along M and N (grouped program order, N and M tails in the middle of the
    grid) and a K loop of 3 steps with a tail; the backward GEMMs see the transposed problems."""
    run_case(M, K, N, activation, device, x_layout=x_layout, grad_layout="sliced", seed=9, tol_scale=2.0)


def test_one_feature_and_sum_backward(device):
    """K=1 / N=1 and the expanded (stride-0) gradient that ``.sum().backward()`` produces."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(127, 1, generator=gen).to(device).requires_grad_()
    w = torch.randn(1, 1, generator=gen).to(device).requires_grad_()
    b = torch.randn(1, generator=gen).to(device).requires_grad_()
    linear_act(x, w, b, "gelu").sum().backward()
    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
    apply_activation(xd @ wd.t() + bd, "gelu").sum().backward()
    for name, t, td in (("grad_x", x, xd), ("grad_w", w, wd), ("grad_b", b, bd)):
        _check(t.grad, td.grad, "fp32", name)


def test_module_matches_nn_linear(device):
    """Same state_dict keys, same default init for the same seed, same results as nn.Linear + act;
    leading batch dimensions are flattened and restored."""
    torch.manual_seed(123)
    ref = nn.Linear(13, 24)
    torch.manual_seed(123)
    mod = TritonLinear(13, 24, activation="relu")
    assert list(mod.state_dict()) == list(ref.state_dict()) == ["weight", "bias"]
    assert torch.equal(mod.weight, ref.weight) and torch.equal(mod.bias, ref.bias)
    assert "activation='relu'" in repr(mod)
    assert TritonLinear(4, 2, bias=False).bias is None

    mod.load_state_dict(nn.Linear(13, 24).state_dict())  # nn.Linear checkpoints load unchanged
    mod, ref = mod.to(device), nn.Linear(13, 24).to(device)
    ref.load_state_dict(mod.state_dict())
    x = torch.randn(2, 5, 13, device=device)
    out = mod(x)
    assert out.shape == (2, 5, 24)
    _check(out, torch.relu(ref.double()(x.double())), "fp32", "module out")

    shared = TritonLinear.from_linear(ref, activation="none")
    assert shared.weight is ref.weight and shared.bias is ref.bias
    layers = nn.ModuleList([TritonLinear(13, 16, activation="relu"), TritonLinear(16, 1)]).to(device)
    h = x.reshape(-1, 13)
    for layer in layers:
        h = layer(h)
    h.sum().backward()
    assert all(p.grad is not None for p in layers.parameters())


@pytest.mark.parametrize("splits", [2, 3, 5, 64])
@pytest.mark.parametrize("M,N,K", [(1, 1, 70), (3, 5, 130), (24, 13, 200), (70, 40, 97)])
def test_split_k_weight_gradient_layout(M, N, K, splits, device):
    """Split-K as the weight gradient uses it: grad_W [N_out, K_in] = grad_pre^T @ x with transposed
    views (K here is the batch), against float64. Slices that do not divide K (a short last slice,
    more requested slices than K-steps, which are merged) included."""
    from kernels.linear import gemm_bias_act

    gen = torch.Generator().manual_seed(M * 1000 + N + K)
    grad_pre = _make((K, M), "transposed", device, torch.float32, gen)  # [batch, out]: its .t() is [M, K]
    x = _make((K, N), "contiguous", device, torch.float32, gen)  # [batch, in]: its .t() is the [K, N] "w"
    got, pre = gemm_bias_act(grad_pre.t(), x.t(), split_k=splits)
    ref = grad_pre.t().double() @ x.double()
    assert pre is None
    _check(got, ref, "fp32", f"split_k={splits} M={M} N={N} K={K}", mag=grad_pre.t().double().abs() @ x.double().abs())
    one, _ = gemm_bias_act(grad_pre.t(), x.t(), split_k=1)
    torch.testing.assert_close(got, one, atol=1e-5, rtol=1e-5)
    again, _ = gemm_bias_act(grad_pre.t(), x.t(), split_k=splits)
    assert torch.equal(got, again)  # deterministic


def test_split_k_refuses_an_epilogue(device):
    from kernels.linear import gemm_bias_act

    with pytest.raises(ValueError, match="split_k"):
        gemm_bias_act(torch.randn(4, 40, device=device), torch.randn(3, 40, device=device), torch.randn(3, device=device),
                      split_k=2)


def test_split_k_heuristic_fills_the_gpu():
    """The slice count the GPU path would pick (the interpreter never splits on its own)."""
    from kernels.heuristics import GEMM_TILES, split_k_slices

    tile = GEMM_TILES["medium"]  # 64 x 64 x 64
    assert split_k_slices(256, 512, 65536, tile, sms=132) == 9  # 32 tiles -> ~2 programs per SM
    assert split_k_slices(16, 64, 65536, tile, sms=132) == 128  # one tile: as many slices as 8-step chunks allow
    assert split_k_slices(65536, 512, 256, tile, sms=132) == 1  # many tiles: no split
    assert split_k_slices(256, 512, 300, tile, sms=132) == 1  # short reduction: no split
    assert split_k_slices(256, 512, 65536, tile, sms=16) == 1  # a 16-SM GPU: 32 tiles already fill it


def test_bad_arguments(device):
    x = torch.randn(3, 13, device=device)
    with pytest.raises(ValueError):
        linear_act(x, torch.randn(4, 12, device=device))
    with pytest.raises(ValueError):
        linear_act(x, torch.randn(4, 13, device=device), torch.randn(5, device=device))
    with pytest.raises(ValueError):
        linear_act(x, torch.randn(4, 13, device=device), activation="tanh")


def test_opcheck(device):
    x = torch.randn(2, 13, device=device, requires_grad=True)
    w = torch.randn(16, 13, device=device, requires_grad=True)
    b = torch.randn(16, device=device, requires_grad=True)
    torch.library.opcheck(_linear_act_op, (x, w, b, "gelu", "ieee"))
    g = torch.randn(2, 16, device=device)
    pre = torch.randn(2, 16, device=device)
    torch.library.opcheck(_linear_act_backward_op, (g, pre, x.detach(), w.detach(), "gelu", "ieee", True, True, True))


def test_torch_compile_fullgraph_no_graph_breaks(device):
    """The only torch.compile test of linear / loss: a tiny MLP step made of every op (the linear
    backward runs the epilogue's act_backward), compiled with fullgraph=True (aot_eager on the CPU:
    dynamo + AOTAutograd tracing of forward and backward without C++ codegen; inductor on CUDA),
    zero graph breaks, same loss and grads."""
    from torch._dynamo.utils import counters

    from kernels.loss import TritonBCEWithLogitsLoss

    torch.manual_seed(0)
    l1 = TritonLinear(13, 16, activation="gelu").to(device)
    l2 = TritonLinear(16, 8, activation="sigmoid").to(device)
    l3 = TritonLinear(8, 1).to(device)
    loss_fn = TritonBCEWithLogitsLoss()
    params = [*l1.parameters(), *l2.parameters(), *l3.parameters()]

    def step(x, r, y):
        h = l2(l1(x) + r)
        return loss_fn(l3(h).squeeze(-1), y)

    x = torch.randn(5, 13, device=device)
    r = torch.randn(5, 16, device=device)
    y = torch.randint(0, 2, (5,), device=device).float()

    torch._dynamo.reset()
    counters.clear()
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    loss_c = compiled(x, r, y)
    loss_c.backward()
    grads_c = [p.grad.clone() for p in params]
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])

    for p in params:
        p.grad = None
    loss_e = step(x, r, y)
    loss_e.backward()
    torch.testing.assert_close(loss_c, loss_e, atol=1e-6, rtol=1e-6)
    for gc, p in zip(grads_c, params):
        torch.testing.assert_close(gc, p.grad, atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------------------------
# GPU: fp32 (ieee and tf32) and bf16
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("M,K,N", [(1, 13, 16), (127, 13, 24), (3, 24, 1), (127, 16, 16)])
def test_gpu(M, K, N, activation, kind):
    run_case(M, K, N, activation, torch.device("cuda"), kind=kind, seed=5)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp32", "tf32", "bf16"])
def test_gpu_noncontiguous_and_large(kind):
    dev = torch.device("cuda")
    run_case(127, 24, 24, "gelu", dev, kind=kind, x_layout="transposed", w_layout="sliced", grad_layout="expand", seed=6)
    run_case(127, 13, 16, "relu", dev, kind=kind, x_layout="sliced", w_layout="transposed", grad_layout="transposed", seed=7)
    # several tiles in every dimension and a long K loop (DLRM-like top-MLP layer); rounding errors
    # of sums grow like sqrt(terms): ~sqrt(515 / 127) = 2 times the small shapes' tolerance
    run_case(515, 479, 257, "relu", dev, kind=kind, seed=8, tol_scale=2.0 if kind == "fp32" else 3.0)


@pytest.mark.gpu
def test_gpu_tf32_follows_torch_setting():
    """allow_tf32=None follows torch.backends.cuda.matmul (tf32 changes fp32 results measurably)."""
    from kernels.linear import resolve_input_precision

    x = torch.randn(4, 8, device="cuda")
    old = torch.backends.cuda.matmul.fp32_precision
    try:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        assert resolve_input_precision(x) == "tf32"
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        assert resolve_input_precision(x) == "ieee"
    finally:
        torch.backends.cuda.matmul.fp32_precision = old
    assert resolve_input_precision(x, allow_tf32=True) == "tf32"
    assert resolve_input_precision(x.bfloat16(), allow_tf32=True) == "ieee"


@pytest.mark.gpu
def test_gpu_autocast_bf16_like_nn_linear():
    """Under CUDA autocast the fused layer computes in bf16 like nn.Linear, and fp32 parameters get fp32
    gradients (the casts are recorded by autograd)."""
    torch.manual_seed(0)
    ref = nn.Linear(24, 16).cuda()
    mod = TritonLinear(24, 16, activation="relu").cuda()
    mod.load_state_dict(ref.state_dict())
    x = torch.randn(127, 24, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = mod(x)
        out_ref = torch.relu(ref(x))
    assert out.dtype == out_ref.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), out_ref.float(), atol=2e-2, rtol=2e-2)
    g = torch.randn_like(out)
    out.backward(g)
    out_ref.backward(g)
    for p, pr in ((mod.weight, ref.weight), (mod.bias, ref.bias)):
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, pr.grad, atol=5e-2, rtol=3e-2)
