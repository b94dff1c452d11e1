"""kernels/wgrad.py against float64 PyTorch: dW = gm^T x and db = gm.sum(0), gm = g * (y > 0) or g;
and the layer built on it (LinearReLUWgrad) against nn.Linear + ReLU, forward and every gradient.

Without CUDA the kernels run under the Triton interpreter (fp32, ieee dot); the gpu-marked tests repeat
the comparisons on CUDA in fp32, tf32 and bf16 (and bf16 autocast with fp32 parameters).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from torch import nn  # noqa: E402

from kernels import heuristics  # noqa: E402
from kernels.wgrad import LinearReLUWgrad, _linear_wgrad_op, linear_act_wgrad, linear_wgrad  # noqa: E402

# (atol, rtol) and the factor of |gm|^T |x| (the float64 sum of the terms' magnitudes) allowed on top:
# a c * u * |A||B| bound for sums of products. fp32 ieee: u = 2^-24; tf32 inputs rounded to 10 bits;
# bf16 inputs exact in bf16 (they are the tensors' values), products exact, fp32 sums, fp32 outputs.
TOLERANCES = {"fp32": (1e-5, 1e-5, 2.0**-21), "tf32": (1e-4, 1e-4, 2.0**-9), "bf16": (1e-4, 1e-4, 2.0**-20)}
DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16}


def _make(shape, layout: str, device, dtype, gen) -> torch.Tensor:
    R, C = shape
    if layout == "contiguous":
        t = torch.randn(R, C, generator=gen)
    elif layout == "transposed":
        t = torch.randn(C, R, generator=gen).t()
    elif layout == "sliced":  # every other column of a wider tensor
        t = torch.randn(R, 2 * C + 1, generator=gen)[:, 1::2]
    elif layout == "expand":  # stride 0 along the batch (a broadcast gradient)
        t = torch.randn(1, C, generator=gen).expand(R, C)
    else:
        raise ValueError(layout)
    return t.to(device=device, dtype=dtype)


def _check(got: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor, kind: str, what: str) -> None:
    atol, rtol, mag_tol = TOLERANCES[kind]
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    got, ref, mag = got.detach().double().cpu(), ref.detach().double().cpu(), mag.detach().double().cpu()
    err = (got - ref).abs()
    allowed = atol + rtol * ref.abs() + mag_tol * mag
    bad = err > allowed
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.numel()} off, worst {float(err.max()):.3g}"


def _reference(g, y, x):
    gm = g.double() if y is None else torch.where(y.double() > 0, g.double(), 0.0)
    return gm.t() @ x.double(), gm.sum(0), gm.abs().t() @ x.double().abs(), gm.abs().sum(0)


def run_wgrad(B, M, N, mask, device, kind="fp32", layouts=("contiguous",) * 3, splits=None, seed=0):
    dtype = DTYPES[kind]
    gen = torch.Generator().manual_seed(seed)
    g = _make((B, M), layouts[0], device, dtype, gen)
    y = torch.relu(_make((B, M), layouts[1], device, dtype, gen)) if mask else None
    x = _make((B, N), layouts[2], device, dtype, gen)
    dw, db = linear_wgrad(g, x, y, weight_dtype=torch.float32, bias_dtype=torch.float32,
                          input_precision="tf32" if kind == "tf32" else "ieee", splits=splits)
    assert dw.dtype == db.dtype == torch.float32
    ref_w, ref_b, mag_w, mag_b = _reference(g, y, x)
    _check(dw, ref_w, mag_w, kind, f"dW B={B} M={M} N={N} mask={mask}")
    _check(db, ref_b, mag_b, kind, f"db B={B} M={M} N={N} mask={mask}")


@pytest.mark.parametrize("mask", [False, True])
@pytest.mark.parametrize("B,M,N", [(1, 5, 3), (3, 1, 13), (127, 70, 37), (127, 16, 1), (3, 1, 1), (200, 16, 64)])
def test_wgrad_matches_float64(B, M, N, mask, device):
    run_wgrad(B, M, N, mask, device)


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("mask", [False, True])
def test_wgrad_even_shapes_unmasked_loads(mask, splits, device):
    """Shapes whose tiles and batch slices are all full (the kernel's EVEN path, no load masks)."""
    launch = heuristics.pick_wgrad_launch(256, 128, 64, torch.float32, 132, interpret=True)
    assert 128 % launch.block_m == 0 and 64 % launch.block_n == 0 and (256 // splits) % launch.block_b == 0
    run_wgrad(256, 128, 64, mask, device, splits=splits, seed=10)


@pytest.mark.parametrize("splits", [2, 3, 7])
def test_wgrad_split_batch_is_summed_in_order(splits, device):
    """The batch cut into slices (the fp32 workspace and the in-order sum kernel), with a short last slice."""
    run_wgrad(131, 70, 37, True, device, splits=splits, seed=1)


def test_wgrad_more_slices_than_one_sum_block(device):
    """35 slices: the sum kernel loads 32 slices a step, then a masked step of 3."""
    run_wgrad(1100, 20, 7, True, device, splits=40, seed=11)


@pytest.mark.parametrize("layouts", [("transposed", "sliced", "transposed"), ("sliced", "transposed", "sliced"),
                                     ("expand", "contiguous", "sliced")])
def test_wgrad_non_contiguous_operands(layouts, device):
    run_wgrad(67, 37, 21, True, device, layouts=layouts, seed=2)
    run_wgrad(67, 37, 21, False, device, layouts=layouts, splits=2, seed=3)


@pytest.mark.parametrize("B,M,N,splits", [(1, 16, 13, None), (3, 4, 8, None), (127, 20, 13, 3), (200, 16, 64, 2),
                                          (131, 64, 1, 7)])
def test_wgrad_tma_operands_match_float64(B, M, N, splits, device, monkeypatch):
    """The masked layer with g and y loaded by TMA (`_wgrad_tma_kernel`, forced on: the interpreter and CPU
    tensors take it only when asked): x by TMA where its row is a multiple of 16 bytes (N = 8, 64), by pointer
    loads otherwise (N = 1, 13); rows past B and a short last slice."""
    import kernels.wgrad as wg

    monkeypatch.setattr(wg, "TMA_OPERANDS", True)
    calls = []
    real = wg._launch_tma
    monkeypatch.setattr(wg, "_launch_tma", lambda *a: (calls.append(1), real(*a))[1])
    run_wgrad(B, M, N, True, device, splits=splits, seed=B + M)
    run_wgrad(B, M, N, False, device, splits=splits, seed=B + N)  # forced on, an unmasked layer takes it too
    assert len(calls) == 2, "the TMA kernel did not run"


def test_wgrad_tma_pointer_x_with_any_strides(device, monkeypatch):
    """TMA g and y with an x whose columns are strided (transposed, sliced): x by pointer loads through its strides."""
    import kernels.wgrad as wg

    monkeypatch.setattr(wg, "TMA_OPERANDS", True)
    run_wgrad(67, 16, 21, True, device, layouts=("contiguous", "contiguous", "transposed"), seed=5)
    run_wgrad(67, 16, 21, True, device, layouts=("contiguous", "contiguous", "sliced"), splits=2, seed=6)


def test_wgrad_tma_only_where_its_rules_hold(device, monkeypatch):
    """TMA needs unit column strides and 16-byte rows: transposed, expanded or 5-wide fp32 operands and forced-off
    runs take the pointer kernel; by default the interpreter, fp32 and layers without a mask never take it."""
    import kernels.wgrad as wg

    g, y, x = (torch.randn(8, 16, device=device) for _ in range(3))
    assert not wg._use_tma(g, x, y, True)  # the default: masked 16-bit operands on a Hopper GPU only
    monkeypatch.setattr(wg, "TMA_OPERANDS", True)
    assert wg._use_tma(g, x, y, True)
    assert wg._use_tma(g, x, None, True)  # forced: an unmasked layer too
    assert not wg._use_tma(g, x, y, False)  # tf32 column sums in registers
    assert not wg._use_tma(torch.randn(16, 8, device=device).t(), x, y, True)
    assert not wg._use_tma(g, x, torch.randn(1, 16, device=device).expand(8, 16), True)
    assert not wg._use_tma(torch.randn(8, 5, device=device), x, torch.randn(8, 5, device=device), True)
    monkeypatch.setattr(wg, "TMA_OPERANDS", False)
    assert not wg._use_tma(g, x, y, True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="TMA needs a GPU of compute capability >= 9")
def test_wgrad_tma_default_on_hopper_bf16_first_layer():
    """On a GPU of compute capability >= 9 the masked bf16 first layer (Kaggle's 512x13 at a real batch) takes the
    TMA kernel by default and matches float64 within bf16-operand tolerances, split and unsplit (unsplit at 1027
    rows: one fp32 accumulator over all 65536 rows runs a 1024-step chain, beyond what these tolerances allow for
    either kernel)."""
    import kernels.wgrad as wg

    g = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16)
    assert wg._use_tma(g, torch.randn(4096, 13, device="cuda", dtype=torch.bfloat16), g, True)
    assert not wg._use_tma(g, torch.randn(4096, 13, device="cuda", dtype=torch.bfloat16), None, True)
    run_wgrad(65536, 512, 13, True, "cuda", kind="bf16", seed=7)
    run_wgrad(1027, 512, 13, True, "cuda", kind="bf16", splits=1, seed=8)
    run_wgrad(4099, 256, 64, True, "cuda", kind="bf16", splits=3, seed=9)


def test_wgrad_split_deterministic(device):
    gen = torch.Generator().manual_seed(4)
    g, x = torch.randn(301, 40, generator=gen).to(device), torch.randn(301, 24, generator=gen).to(device)
    a = linear_wgrad(g, x, splits=5)
    b = linear_wgrad(g, x, splits=5)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_wgrad_empty_batch_and_widths(device):
    g, x = torch.zeros(0, 4, device=device), torch.zeros(0, 3, device=device)
    dw, db = linear_wgrad(g, x, torch.zeros(0, 4, device=device))
    assert dw.shape == (4, 3) and db.shape == (4,) and not dw.any() and not db.any()
    g = torch.randn(5, 4, device=device)
    y = torch.tensor([[1.0, 0.0, 2.0, -1.0]] * 5, device=device)
    dw, db = linear_wgrad(g, torch.zeros(5, 0, device=device), y)
    assert dw.shape == (4, 0)
    torch.testing.assert_close(db, (g * (y > 0)).sum(0))
    dw, db = linear_wgrad(torch.zeros(5, 0, device=device), torch.randn(5, 3, device=device))
    assert dw.shape == (0, 3) and db.shape == (0,)


def test_wgrad_bad_inputs(device):
    g = torch.randn(4, 3, device=device)
    with pytest.raises(ValueError, match="must share B"):
        linear_wgrad(g, torch.randn(5, 2, device=device))
    with pytest.raises(ValueError, match="layer output"):
        linear_wgrad(g, torch.randn(4, 2, device=device), torch.randn(4, 2, device=device))
    with pytest.raises(ValueError, match="one dtype"):
        linear_wgrad(g, torch.randn(4, 2, device=device, dtype=torch.float64))


def test_heuristic_splits_fill_the_gpu():
    """About two programs per SM, at least 8 loop steps a slice; the masked narrow layer takes 64 x 16 tiles."""
    launch = heuristics.pick_wgrad_launch(65536, 512, 13, torch.bfloat16, 132, interpret=False, masked=True)
    assert (launch.block_m, launch.block_n, launch.block_b) == (64, 16, 128) and launch.splits * 8 >= 2 * 132
    big = heuristics.pick_wgrad_launch(65536, 1024, 1024, torch.bfloat16, 132, interpret=False)
    assert (big.block_m, big.block_n, big.num_warps) == (128, 256, 8) and big.splits * 32 >= 4 * 132
    assert 65536 // big.splits >= 8 * big.block_b
    mid = heuristics.pick_wgrad_launch(65536, 256, 512, torch.bfloat16, 132, interpret=False)
    assert (mid.block_m, mid.block_n, mid.num_warps) == (128, 128, 4) and mid.splits * 8 >= 2 * 132
    capped = heuristics.pick_wgrad_launch(65536, 16, 64, torch.bfloat16, 132, interpret=False)
    assert capped.splits == 65536 // (8 * capped.block_b)
    tiny_batch = heuristics.pick_wgrad_launch(64, 16, 16, torch.float32, 132, interpret=False)
    assert tiny_batch.splits == 1


@pytest.mark.parametrize("mask", [False, True])
def test_wgrad_register_column_sums(mask, device):
    """The column sums in registers (the path of tf32 products; under the interpreter the dot stays ieee)."""
    gen = torch.Generator().manual_seed(9)
    g, x = torch.randn(131, 37, generator=gen).to(device), torch.randn(131, 21, generator=gen).to(device)
    y = torch.relu(torch.randn(131, 37, generator=gen)).to(device) if mask else None
    dw, db = linear_wgrad(g, x, y, input_precision="tf32", splits=2)
    ref_w, ref_b, mag_w, mag_b = _reference(g, y, x)
    kind = "tf32" if device.type == "cuda" else "fp32"
    _check(dw, ref_w, mag_w, kind, "dW")
    _check(db, ref_b, mag_b, "fp32", "db (fp32 sums of fp32 values)")


# ----------------------------------------------------------------------------------------------
# The layer: LinearReLUWgrad / linear_act_wgrad against nn.Linear (+ ReLU) in float64
# ----------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def fp32_layers_use_the_kernel(monkeypatch, request):
    """fp32 layers keep PyTorch's backward by default (slower in the kernel); the layer tests, which run in
    fp32 (the interpreter has nothing else), route them through it."""
    import kernels.wgrad as wgrad

    if not request.node.name.startswith("test_fp32_layer_keeps_pytorch_backward"):
        monkeypatch.setattr(wgrad, "FP32_KERNEL", True)


def test_fp32_layer_keeps_pytorch_backward_by_default(device):
    import kernels.wgrad as wgrad

    assert wgrad.FP32_KERNEL is False
    layer = LinearReLUWgrad(8, 32, activation="relu").to(device)
    assert "LinearActWgrad" not in type(layer(torch.randn(5, 8, device=device)).grad_fn).__name__
    if device.type == "cuda":
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert "LinearActWgrad" in type(layer(torch.randn(5, 8, device=device)).grad_fn).__name__


def run_layer(B, n_in, n_out, activation, device, need_x=True, grad_layout="contiguous", seed=0, kind="fp32"):
    torch.manual_seed(seed)
    layer = LinearReLUWgrad(n_in, n_out, activation=activation).to(device)
    ref = nn.Linear(n_in, n_out).double().to(device)
    ref.load_state_dict({k: v.double() for k, v in layer.state_dict().items()})
    gen = torch.Generator().manual_seed(seed)
    x = _make((B, n_in), "sliced", device, torch.float32, gen).requires_grad_(need_x)
    xr = x.detach().double().requires_grad_(need_x)
    out = layer(x)
    out_ref = ref(xr)
    if activation == "relu":
        out_ref = torch.relu(out_ref)
    g = _make((B, n_out), grad_layout, device, torch.float32, gen)
    out.backward(g)
    out_ref.backward(g.double())
    torch.testing.assert_close(out.double(), out_ref, atol=1e-5, rtol=1e-5)
    mask = (out_ref > 0).double() if activation == "relu" else torch.ones_like(out_ref)
    gm = g.double() * mask
    _check(layer.weight.grad, ref.weight.grad, gm.abs().t() @ xr.detach().abs(), kind, "weight grad")
    _check(layer.bias.grad, ref.bias.grad, gm.abs().sum(0), kind, "bias grad")
    if need_x:
        _check(x.grad, xr.grad, gm.abs() @ ref.weight.detach().abs(), kind, "input grad")
    else:
        assert x.grad is None


@pytest.mark.parametrize("activation", ["relu", "none"])
@pytest.mark.parametrize("need_x", [True, False])
@pytest.mark.parametrize("B,n_in,n_out", [(1, 13, 16), (3, 1, 17), (127, 37, 1), (127, 13, 70)])
def test_layer_matches_nn_linear(B, n_in, n_out, activation, need_x, device):
    run_layer(B, n_in, n_out, activation, device, need_x=need_x)


@pytest.mark.parametrize("grad_layout", ["transposed", "expand"])
def test_layer_non_contiguous_gradient(grad_layout, device):
    run_layer(67, 24, 33, "relu", device, grad_layout=grad_layout, seed=3)
    run_layer(67, 24, 33, "relu", device, need_x=False, grad_layout=grad_layout, seed=4)


def test_narrow_and_large_layers_keep_pytorch_backward(device, monkeypatch):
    import kernels.wgrad as wgrad

    x = torch.randn(5, 8, device=device)
    narrow = LinearReLUWgrad(8, wgrad.MIN_OUT_FEATURES - 1).to(device)
    wide = LinearReLUWgrad(8, wgrad.MIN_OUT_FEATURES).to(device)
    assert "LinearActWgrad" not in type(narrow(x).grad_fn).__name__
    assert "LinearActWgrad" in type(wide(x).grad_fn).__name__
    monkeypatch.setattr(wgrad, "MAX_WEIGHT_NUMEL", 8 * wgrad.MIN_OUT_FEATURES)
    assert "LinearActWgrad" not in type(wide(x).grad_fn).__name__


def test_layer_state_dict_and_init_like_nn_linear(device):
    torch.manual_seed(7)
    a = LinearReLUWgrad(13, 8, activation="relu")
    torch.manual_seed(7)
    b = nn.Linear(13, 8)
    assert list(a.state_dict()) == list(b.state_dict()) == ["weight", "bias"]
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in ("weight", "bias"))
    with pytest.raises(ValueError, match="activation must be 'relu' or 'none'"):
        LinearReLUWgrad(3, 4, activation="gelu")
    with pytest.raises(ValueError, match="does not match weight"):
        linear_act_wgrad(torch.randn(2, 5), torch.randn(4, 3))


def test_layer_on_3d_input(device):
    """[..., in_features] inputs (flattened to rows for the kernel), like nn.Linear."""
    torch.manual_seed(1)
    layer = LinearReLUWgrad(13, 24, activation="relu").to(device)
    ref = nn.Linear(13, 24).double().to(device)
    ref.load_state_dict({k: v.double() for k, v in layer.state_dict().items()})
    x = torch.randn(3, 7, 13, device=device, requires_grad=True)
    xr = x.detach().double().requires_grad_()
    out, out_ref = layer(x), torch.relu(ref(xr))
    assert out.shape == (3, 7, 24)
    g = torch.randn_like(out)
    out.backward(g)
    out_ref.backward(g.double())
    for got, want in ((x.grad, xr.grad), (layer.weight.grad, ref.weight.grad), (layer.bias.grad, ref.bias.grad)):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_layer_without_bias(device):
    torch.manual_seed(0)
    layer = LinearReLUWgrad(9, 6, bias=False, activation="relu").to(device)
    x = torch.randn(11, 9, device=device, requires_grad=True)
    layer(x).sum().backward()
    w = layer.weight.detach().double().requires_grad_()
    torch.relu(x.detach().double() @ w.t()).sum().backward()
    torch.testing.assert_close(layer.weight.grad.double(), w.grad, atol=1e-5, rtol=1e-5)


def test_opcheck(device):
    g, x = torch.randn(9, 6, device=device), torch.randn(9, 4, device=device)
    y = torch.relu(torch.randn(9, 6, device=device))
    torch.library.opcheck(_linear_wgrad_op, (g, x, y, torch.float32, torch.float32, "ieee"))
    torch.library.opcheck(_linear_wgrad_op, (g, x, None, torch.float32, torch.float32, "ieee"))


def test_torch_compile_fullgraph_mlp(device):
    """A small MLP of these layers under torch.compile(fullgraph=True) (aot_eager on the CPU, inductor on
    CUDA): no graph breaks, and the same loss and gradients as eager."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    layers = nn.Sequential(LinearReLUWgrad(13, 16, activation="relu"), LinearReLUWgrad(16, 8, activation="relu"),
                           LinearReLUWgrad(8, 1)).to(device)
    x = torch.randn(37, 13, device=device)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layers, fullgraph=True, backend="inductor" if device.type == "cuda" else "aot_eager")
    compiled(x).square().mean().backward()
    grads = [p.grad.clone() for p in layers.parameters()]
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    layers.zero_grad(set_to_none=True)
    layers(x).square().mean().backward()
    for gc, p in zip(grads, layers.parameters()):
        torch.testing.assert_close(gc, p.grad, atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# GPU: fp32 (ieee, tf32), bf16, autocast
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("mask", [False, True])
@pytest.mark.parametrize("B,M,N", [(1, 5, 3), (127, 70, 37), (127, 16, 1), (4099, 512, 13), (8191, 256, 515),
                                   (65536, 1, 256)])
def test_gpu_wgrad(B, M, N, mask, kind):
    run_wgrad(B, M, N, mask, torch.device("cuda"), kind=kind, seed=5)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp32", "bf16"])
def test_gpu_wgrad_non_contiguous(kind):
    run_wgrad(4097, 130, 70, True, torch.device("cuda"), kind=kind, layouts=("transposed", "sliced", "transposed"))
    run_wgrad(4097, 130, 70, False, torch.device("cuda"), kind=kind, layouts=("expand", "contiguous", "sliced"))


@pytest.mark.gpu
@pytest.mark.parametrize("need_x", [True, False])
def test_gpu_layer_under_bf16_autocast(need_x):
    """Under bf16 autocast the layer runs in bf16 like nn.Linear + ReLU, and its fp32 parameters get fp32
    gradients matching nn.Linear's (both from bf16 products summed in fp32)."""
    torch.manual_seed(0)
    layer = LinearReLUWgrad(24, 40, activation="relu").cuda()
    ref = nn.Linear(24, 40).cuda()
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(4099, 24, device="cuda", requires_grad=need_x)
    xr = x.detach().clone().requires_grad_(need_x)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, out_ref = layer(x), torch.relu(ref(xr))
    assert out.dtype == out_ref.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), out_ref.float(), atol=0, rtol=0)
    g = torch.randn_like(out)
    out.backward(g)
    out_ref.backward(g)
    assert layer.weight.grad.dtype == torch.float32 and layer.bias.grad.dtype == torch.float32
    # nn.Linear's weight gradient is a bf16 GEMM output (rounded to bf16), ours is fp32: within bf16 rounding
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad, atol=0.05, rtol=8e-3)
    torch.testing.assert_close(layer.bias.grad, ref.bias.grad, atol=0.05, rtol=8e-3)
    if need_x:
        torch.testing.assert_close(x.grad, xr.grad, atol=0, rtol=0)
