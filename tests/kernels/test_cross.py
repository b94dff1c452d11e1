"""kernels/cross.py against a float64 PyTorch reference: the cross layer's output and every gradient,
and TritonLowRankCrossNet against the eager LowRankCrossNet.

Without CUDA the kernels run under the Triton interpreter (fp32, ieee dot); the tests marked gpu
repeat the comparisons on CUDA in fp32 (ieee and tf32) and bf16.
"""

from __future__ import annotations

import copy

import os

import torch

if not torch.cuda.is_available():  # before triton is imported (tests/kernels/conftest.py does the same)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from dlrm.config import KernelsConfig, ModelConfig  # noqa: E402
from dlrm.model.archs import LowRankCrossNet  # noqa: E402
from dlrm.model.dlrm import build_model  # noqa: E402
from kernels import heuristics  # noqa: E402
from kernels.cross import (  # noqa: E402
    TritonLowRankCrossNet,
    _cross_layer_backward_op,
    _cross_layer_op,
    cross_elementwise_backward,
    cross_layer,
    cross_layer_reference,
)

# (atol, rtol) against float64, by how the kernel computes. "fp32": ieee fp32 products (the
# interpreter, or allow_tf32=False on the GPU). "tf32": inputs rounded to 10 mantissa bits before
# the products. "bf16": bf16 inputs, fp32 accumulation and epilogue, bf16 outputs (rel. step 4e-3)
# and a bf16 grad_pre feeding the backward GEMMs.
TOLERANCES = {"fp32": (1e-5, 1e-5), "tf32": (2e-2, 2e-2), "bf16": (5e-2, 3e-2)}
DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16}
# Rounding grows with the magnitude of the summed terms, not of the result: the check also allows
# MAG_TOL[kind] * (the same computation on absolute values), a c * u * |A||B| bound with a small c.
MAG_TOL = {"fp32": 2.0**-22, "tf32": 2.0**-10, "bf16": 2.0**-8}
NAMES = ("x0", "x", "u", "weight", "bias")


def _make(shape, layout: str, device, dtype, gen, scale: float = 1.0) -> torch.Tensor:
    """A tensor of `shape` ([R, C], or [C] for "vector" / "strided_vector") with a given memory layout.

    The view is taken last, on the device and in the dtype: scaling, or moving a strided view to another
    device or dtype, would return a contiguous copy."""
    def base(*size):
        return (torch.randn(*size, generator=gen) * scale).to(device=device, dtype=dtype)

    if layout == "vector":
        t = base(shape)
    elif layout == "strided_vector":  # every third element of a longer vector
        t = base(3 * shape)[::3]
    else:
        R, C = shape
        if layout == "contiguous":
            t = base(R, C)
        elif layout == "transposed":
            t = base(C, R).t()
        elif layout == "sliced":  # every other column of a wider tensor: stride 2 along dim 1
            t = base(R, 2 * C + 1)[:, 1::2]
        elif layout == "expand":  # stride 0 along the rows (incoming gradients only)
            t = base(1, C).expand(R, C)
        else:
            raise ValueError(layout)
    assert t.is_contiguous() == (layout in ("contiguous", "vector")) or min(t.shape) <= 1, (layout, t.stride())
    return t


def _check(got, ref, kind: str, what: str, mag=None, tol_scale: float = 1.0) -> None:
    atol, rtol = (v * tol_scale for v in TOLERANCES[kind])
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    allowed = atol + rtol * ref.abs()
    if mag is not None:
        allowed = allowed + MAG_TOL[kind] * tol_scale * mag.detach().double().cpu()
    bad = (got - ref).abs() > allowed
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} / {bad.numel()} elements off; worst at "
        f"{tuple(int(i) for i in torch.nonzero(bad)[0])}: {got[bad][0]:.6g} vs {ref[bad][0]:.6g} (allowed {allowed[bad][0]:.3g})"
    )


def _reference_with_magnitudes(inputs, g, need):
    """float64 output and gradients of cross_layer_reference from the same (rounded) values, and the
    magnitudes: the same computation on absolute values (every term of every sum counted)."""
    vals = [t.detach().double().cpu().requires_grad_(n) for t, n in zip(inputs, need)]
    ref = cross_layer_reference(*vals)
    grads = torch.autograd.grad(ref, [v for v in vals if v.requires_grad], g.double().cpu()) if any(need) else ()
    absv = [t.detach().double().cpu().abs().requires_grad_(n) for t, n in zip(inputs, need)]
    mag = cross_layer_reference(*absv)
    mags = torch.autograd.grad(mag, [v for v in absv if v.requires_grad], g.double().cpu().abs()) if any(need) else ()
    return ref.detach(), mag.detach(), list(grads), list(mags)


def run_case(M: int, N: int, K: int, device, kind: str = "fp32", layouts: dict | None = None, grad_layout: str = "contiguous",
             need=(True, True, True, True, True), seed: int = 0, tol_scale: float = 1.0, same_x: bool = False) -> None:
    """Forward and backward of cross_layer vs float64 autograd on the same (rounded) input values."""
    dtype = DTYPES[kind]
    gen = torch.Generator().manual_seed(seed)
    layouts = {"x0": "contiguous", "x": "contiguous", "u": "contiguous", "weight": "contiguous", "bias": "vector",
               **(layouts or {})}
    x0 = _make((M, N), layouts["x0"], device, dtype, gen)
    x = x0 if same_x else _make((M, N), layouts["x"], device, dtype, gen)
    u = _make((M, K), layouts["u"], device, dtype, gen)
    w = _make((N, K), layouts["weight"], device, dtype, gen, scale=max(K, 1) ** -0.5)  # keeps pre O(1)
    b = _make(N, layouts["bias"], device, dtype, gen)
    g = _make((M, N), grad_layout, device, dtype, gen)
    inputs = [t.detach().requires_grad_(n) for t, n in zip((x0, x, u, w, b), need)]
    if same_x:  # the first layer: x_l is x_0 itself (one tensor, two arguments)
        inputs[1] = inputs[0]
    out = cross_layer(*inputs, allow_tf32=(kind == "tf32"))
    assert out.dtype == dtype and out.shape == (M, N)
    if any(need):
        out.backward(g)

    tag = f"M={M} N={N} K={K} {kind} {layouts} g={grad_layout}"
    if same_x:
        vals = [inputs[0], inputs[0], *inputs[2:]]
        ref_inputs = [t.detach().double().cpu().requires_grad_(n) for t, n in zip(vals, need)]
        xs = ref_inputs[0]
        ref_inputs[1] = xs
        ref = cross_layer_reference(*ref_inputs)
        ref.backward(g.double().cpu())
        _check(out, ref, kind, f"out [{tag}]", tol_scale=tol_scale)
        _check(inputs[0].grad, xs.grad, kind, f"grad x0 (= x) [{tag}]", tol_scale=tol_scale * 4)
        return
    ref, mag, grads, mags = _reference_with_magnitudes(inputs, g, need)
    _check(out, ref, kind, f"out [{tag}]", mag, tol_scale)
    it = iter(zip(grads, mags))
    for name, t, n in zip(NAMES, inputs, need):
        if n:
            gr, mg = next(it)
            _check(t.grad, gr, kind, f"grad {name} [{tag}]", mg, tol_scale)
        else:
            assert t.grad is None


# ----------------------------------------------------------------------------------------------
# CPU (interpreter) or the default CUDA device: fp32
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("M,N,K", [
    (1, 2, 1),       # one sample; N = (F+1) D with F = 1, D = 1; rank 1
    (3, 10, 4),
    (127, 27, 5),    # F = 26, D = 1
    (3, 6, 9),       # rank above N
    (3, 10, 0),      # rank 0: pre = bias (the launcher's path without the kernel)
])
def test_shapes(M, N, K, device):
    run_case(M, N, K, device)


def test_several_tiles_per_dimension(device):
    """Several output tiles along M and N (grouped program order, tails in the middle of the grid), a
    K loop of 2 steps with a tail; the backward's split-K weight gradient over 70 rows."""
    run_case(70, 130, 37, device, seed=9, tol_scale=2.0)


@pytest.mark.parametrize("layouts,grad_layout", [
    ({"x0": "transposed"}, "contiguous"),
    ({"x": "sliced", "u": "transposed"}, "transposed"),
    ({"weight": "transposed", "x0": "sliced"}, "expand"),
    ({"weight": "sliced", "u": "sliced", "x": "transposed", "bias": "strided_vector"}, "sliced"),
])
def test_noncontiguous(layouts, grad_layout, device):
    """K = 37: the K loop steps through strided u and weight (two steps of the interpreter's 32, the second a tail)."""
    run_case(127, 24, 37, device, layouts=layouts, grad_layout=grad_layout, seed=2)


@pytest.mark.parametrize("need", [
    (False, False, False, True, False),   # only the weight (frozen input)
    (False, False, False, False, True),   # only the bias
    (True, False, False, False, False),   # only x0
    (False, True, True, False, False),    # x and u: no weight gradients
    (True, True, True, True, False),
])
def test_partial_grads(need, device):
    run_case(3, 24, 16, device, need=need, seed=3)


def test_x0_and_x_the_same_tensor(device):
    """The first layer passes the input as both x0 and x: its gradient is the sum of both paths."""
    run_case(5, 12, 3, device, same_x=True, seed=4)


@pytest.mark.parametrize("need", [(True, True, True), (False, True, False), (True, False, True)])
def test_elementwise_backward_any_strides(need, device):
    """The backward's elementwise pass on its own, against float64: g stride 0 along the rows, x0 sliced and pre
    transposed (the public backward op takes any pre, not only the forward's contiguous one); two row blocks
    and two column blocks, each with a tail (M = 33, N = 130)."""
    gen = torch.Generator().manual_seed(15)
    M, N = 33, 130
    g, x0, pre = (_make((M, N), layout, device, torch.float32, gen) for layout in ("expand", "sliced", "transposed"))
    got = cross_elementwise_backward(g, x0, pre, need_pre=need[0], need_x0=need[1], need_b=need[2])
    g64, x064, pre64 = (t.double().cpu() for t in (g, x0, pre))
    want = (g64 * x064, g64 * pre64, (g64 * x064).sum(0))
    mags = (None, None, (g64 * x064).abs().sum(0))
    for name, t, ref, mag, n in zip(("grad_pre", "grad_x0", "grad_b"), got, want, mags, need):
        if n:
            _check(t, ref, "fp32", name, mag)
        else:
            assert t is None, name


def test_no_grad_forward(device):
    gen = torch.Generator().manual_seed(5)
    ts = [torch.randn(s, generator=gen).to(device) for s in ((4, 6), (4, 6), (4, 2), (6, 2), (6,))]
    with torch.no_grad():
        out = cross_layer(*ts)
    torch.testing.assert_close(out.double(), cross_layer_reference(*[t.double() for t in ts]), atol=1e-5, rtol=1e-5)


def test_weight_and_bias_gradients_are_deterministic(device):
    gen = torch.Generator().manual_seed(6)
    ts = [torch.randn(s, generator=gen).to(device) for s in ((127, 20), (127, 20), (127, 7), (20, 7), (20,))]
    g = torch.randn(127, 20, generator=gen).to(device)
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in ts]
        cross_layer(*leaves).backward(g)
        runs.append([t.grad for t in leaves])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_bad_arguments(device):
    x = torch.randn(3, 6, device=device)
    u, w, b = torch.randn(3, 2, device=device), torch.randn(6, 2, device=device), torch.randn(6, device=device)
    with pytest.raises(ValueError, match="x0 and x"):
        cross_layer(x, x[:, :5], u, w, b)
    with pytest.raises(ValueError, match="weight"):
        cross_layer(x, x, u, torch.randn(6, 3, device=device), b)
    with pytest.raises(ValueError, match="bias"):
        cross_layer(x, x, u, w, torch.randn(5, device=device))
    with pytest.raises(ValueError, match=r"input must be \[B, 6\]"):
        TritonLowRankCrossNet(6, 1, 2).to(device)(torch.randn(3, 7, device=device))
    with pytest.raises(ValueError, match="must be >= 1"):
        TritonLowRankCrossNet(6, 1, 0)


def test_opcheck(device):
    gen = torch.Generator().manual_seed(7)
    x0, x, u, w, b = (torch.randn(s, generator=gen).to(device).requires_grad_() for s in ((3, 6), (3, 6), (3, 2), (6, 2), (6,)))
    torch.library.opcheck(_cross_layer_op, (x0, x, u, w, b, "ieee"))
    g, pre = torch.randn(3, 6, device=device), torch.randn(3, 6, device=device)
    torch.library.opcheck(_cross_layer_backward_op, (g, x0.detach(), pre, u.detach(), w.detach(), "ieee", True, True, True, True))
    torch.library.opcheck(_cross_layer_backward_op, (g, x0.detach(), pre, u.detach(), w.detach(), "ieee", False, True, False, True))


# ----------------------------------------------------------------------------------------------
# The module: TritonLowRankCrossNet against the eager LowRankCrossNet in float64
# ----------------------------------------------------------------------------------------------


def _module_case(batch, n, layers, rank, device, noncontiguous=False, seed=0, kind="fp32", tol_scale=1.0):
    torch.manual_seed(seed)
    eager = LowRankCrossNet(n, layers, rank)
    with torch.no_grad():  # non-zero biases (the init's are zero, which would hide a bias bug)
        for b in eager.bias:
            b.normal_()
    triton_net = TritonLowRankCrossNet(n, layers, rank, allow_tf32=(kind == "tf32")).to(device=device, dtype=DTYPES[kind])
    triton_net.load_state_dict(eager.state_dict())
    ref_net = eager.double()
    x = torch.randn(n, batch).t() if noncontiguous else torch.randn(batch, n)
    g = torch.randn(n, batch).t() if noncontiguous else torch.randn(batch, n)
    xin = x.detach().to(device=device, dtype=DTYPES[kind]).requires_grad_()  # keeps x's strides
    out = triton_net(xin)
    out.backward(g.to(device=device, dtype=DTYPES[kind]))
    assert xin.is_contiguous() != noncontiguous
    xr = x.detach().double().requires_grad_()
    ref = ref_net(xr)
    ref.backward(g.double())
    tag = f"B={batch} N={n} layers={layers} rank={rank} {kind}"
    # Every layer's rounding feeds the next one's product: a few ulps more per layer.
    scale = tol_scale * 2 * layers
    _check(out, ref, kind, f"out [{tag}]", tol_scale=scale)
    _check(xin.grad, xr.grad, kind, f"grad input [{tag}]", tol_scale=scale)
    for (name, p), (_, pr) in zip(triton_net.named_parameters(), ref_net.named_parameters()):
        assert p.grad.dtype == p.dtype
        _check(p.grad, pr.grad, kind, f"grad {name} [{tag}]", tol_scale=scale)


@pytest.mark.parametrize("batch,n,layers,rank", [
    (1, 6, 1, 1),      # batch 1, F = 1 and D = 3, rank 1, one layer
    (3, 10, 3, 4),
    (127, 27, 2, 5),   # F = 26, D = 1
])
def test_module_matches_eager_float64(batch, n, layers, rank, device):
    _module_case(batch, n, layers, rank, device, seed=batch)


def test_module_noncontiguous_input_and_gradient(device):
    _module_case(7, 12, 2, 3, device, noncontiguous=True, seed=11)


def test_module_same_init_and_state_dict_as_eager():
    torch.manual_seed(12)
    eager = LowRankCrossNet(30, 3, 7)
    torch.manual_seed(12)
    fused = TritonLowRankCrossNet(30, 3, 7)
    assert list(fused.state_dict()) == list(eager.state_dict())
    for k, v in eager.state_dict().items():
        assert torch.equal(fused.state_dict()[k], v), k


def test_model_swaps_the_triton_crossnet_in_with_the_same_state(device):
    cfg = ModelConfig(embedding_dim=2, bottom_mlp=[8, 2], top_mlp=[8, 1], interaction="dcn", cross_layers=2, cross_rank=3)
    torch.manual_seed(13)
    # both on `device`: a CUDA build draws its parameters from the CUDA generator, not the CPU's
    eager = build_model(cfg, [5] * 26, kernels=KernelsConfig(embedding="torch", interaction="torch", mlp="torch", loss="torch"),
                        device=device)
    torch.manual_seed(13)
    fused = build_model(cfg, [5] * 26, kernels=KernelsConfig(embedding="torch", interaction="triton", mlp="torch", loss="torch"),
                        device=device)
    assert isinstance(fused.interaction_arch.crossnet, TritonLowRankCrossNet)
    assert isinstance(eager.interaction_arch.crossnet, LowRankCrossNet)
    sd_e, sd_f = eager.state_dict(), fused.state_dict()
    assert list(sd_e) == list(sd_f)
    for k in sd_e:
        assert torch.equal(sd_e[k], sd_f[k]), k  # the same seed draws the same parameters
    dense, sparse = torch.randn(3, 13, device=device), torch.randint(0, 50, (3, 26), device=device)
    torch.testing.assert_close(fused(dense, sparse), eager(dense, sparse), atol=1e-5, rtol=1e-5)


def test_torch_compile_fullgraph_no_graph_breaks(device):
    """The cross net's forward and backward compile with fullgraph=True (aot_eager on the CPU, inductor
    on CUDA): no graph breaks, same output and gradients as eager."""
    from torch._dynamo.utils import counters

    torch.manual_seed(14)
    net = TritonLowRankCrossNet(12, 2, 3).to(device)
    with torch.no_grad():
        for b in net.bias:
            b.normal_()
    x = torch.randn(5, 12, device=device)

    def step(x):
        return (net(x) ** 2).sum()

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, fullgraph=True, backend="inductor" if device.type == "cuda" else "aot_eager")
    loss_c = compiled(x)
    loss_c.backward()
    grads_c = [p.grad.clone() for p in net.parameters()]
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    net.zero_grad()
    loss_e = step(x)
    loss_e.backward()
    torch.testing.assert_close(loss_c, loss_e, atol=1e-5, rtol=1e-6)
    for gc, p in zip(grads_c, net.parameters()):
        torch.testing.assert_close(gc, p.grad, atol=1e-5, rtol=1e-6)


def test_cross_tile_heuristic():
    square, tall = heuristics.GEMM_TILES["square_fp32"], heuristics.GEMM_TILES["tall"]
    assert heuristics.pick_gemm_tile(65536, 3456, torch.float32, 132) == square
    assert heuristics.pick_cross_tile(65536, 3456, torch.float32, 132) == tall
    assert heuristics.pick_cross_tile(65536, 3456, torch.bfloat16, 132) == heuristics.GEMM_TILES["cross_wide_16bit"]
    assert heuristics.pick_cross_tile(65536, 432, torch.bfloat16, 132) == heuristics.GEMM_TILES["square_16bit"]
    assert heuristics.pick_cross_tile(32, 432, torch.float32, 132) == heuristics.GEMM_TILES["small_batch"]


# ----------------------------------------------------------------------------------------------
# GPU: fp32 (ieee and tf32) and bf16
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("M,N,K", [(1, 2, 1), (3, 10, 4), (127, 27, 5), (127, 432, 128)])
def test_gpu(M, N, K, kind):
    run_case(M, N, K, torch.device("cuda"), kind=kind, seed=5)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp32", "tf32", "bf16"])
def test_gpu_noncontiguous_and_large(kind):
    dev = torch.device("cuda")
    run_case(127, 24, 13, dev, kind=kind, layouts={"x0": "transposed", "weight": "sliced"}, grad_layout="expand", seed=6)
    # the MLPerf shape's width and rank at a larger batch: several tiles everywhere, a K loop of 8+
    # steps; rounding of sums grows like sqrt(terms)
    run_case(1031, 3456, 512, dev, kind=kind, layouts={"u": "transposed"}, grad_layout="transposed", seed=7,
             tol_scale=2.0 if kind == "fp32" else 3.0)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp32", "bf16"])
def test_gpu_module_matches_eager(kind):
    _module_case(127, 432, 3, 128, torch.device("cuda"), seed=8, kind=kind, tol_scale=1.0 if kind == "fp32" else 2.0)


@pytest.mark.gpu
def test_gpu_autocast_bf16():
    """Under CUDA autocast the Triton cross net computes in bf16 and fp32 parameters get fp32 gradients."""
    torch.manual_seed(9)
    eager = LowRankCrossNet(432, 3, 128).cuda()
    fused = TritonLowRankCrossNet(432, 3, 128).cuda()
    fused.load_state_dict(eager.state_dict())
    exact = copy.deepcopy(eager).double()  # the float64 reference both bf16 computations are measured against
    x = torch.randn(127, 432, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = fused(x)
        out_ref = eager(x)
    assert out.dtype == torch.bfloat16
    out64 = exact(x.double())

    def rel(a, b):  # ||a - b|| / ||b||: bf16 lands between 1e-3 and 1e-2 (a few elements of two different bf16
        return float((a.double() - b).norm() / b.norm())  # roundings can differ by more than an elementwise bound)

    assert rel(out, out64) < 1e-2 and rel(out, out64) <= 1.5 * rel(out_ref, out64) + 1e-3
    g = torch.randn_like(out, dtype=torch.float32)
    out.float().backward(g)
    out_ref.float().backward(g)
    out64.backward(g.double())
    for p, pr, p64 in zip(fused.parameters(), eager.parameters(), exact.parameters()):
        assert p.grad.dtype == torch.float32
        # bf16's band (METHOD: 1e-3..1e-2); no comparison with eager here: eager autocast keeps some of these
        # reductions in fp32 (its bias gradient is exact to 1e-7), the fused kernel forms them from bf16 products
        assert rel(p.grad, p64.grad) < 1e-2 and rel(pr.grad, p64.grad) < 1e-2
