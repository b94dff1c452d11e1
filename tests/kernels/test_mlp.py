"""kernels/mlp.py (FusedMLP) against a float64 PyTorch reference: the output and every gradient
(input, each weight, each bias), element by element.

Without CUDA the mask + bias-gradient kernel runs under the Triton interpreter (fp32) and the GEMMs
are torch's CPU addmm / mm; the tests marked gpu repeat the comparisons on CUDA in fp32 (ieee and
tf32), bf16 and under bf16 autocast, at DLRM sizes, inside a CUDA graph and under inductor.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before triton is imported (tests/kernels/conftest.py does the same)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import kernels.mlp as kmlp  # noqa: E402
from dlrm.model.archs import MLP, DenseArch, OverArch  # noqa: E402
from kernels.mlp import FusedMLP, _mlp_backward_op, _mlp_forward_op, fused_mlp, mask_bias_grad  # noqa: E402
from tests.kernels.cuda_graphs import capture  # noqa: E402
from tests.kernels.mlp_chain_reference import (  # noqa: E402
    DTYPES,
    chain_inputs,
    check_chain,
    matmul_precision,
)


def run_case(
    M: int,
    dims: list[int],
    activate_last: bool,
    device,
    kind: str = "fp32",
    x_layout: str = "contiguous",
    grad_layout: str = "contiguous",
    need_x: bool = True,
    frozen: tuple[int, ...] = (),
    seed: int = 0,
    tol_scale: float = 1.0,
) -> None:
    """fused_mlp forward and backward vs float64 autograd on the same (rounded) values.

    `dims`: [in_features, *widths]; `frozen`: layers whose weight and bias need no gradient.
    """
    dtype = DTYPES[kind]
    x, ws, bs, g = chain_inputs(M, dims, device, kind, x_layout, grad_layout, need_x, frozen, seed)
    relu = [True] * (len(dims) - 1)
    if not activate_last:
        relu[-1] = False

    with matmul_precision(kind):
        out = fused_mlp(x, ws, bs, relu)
        assert out.dtype == dtype and out.shape == (M, dims[-1])
        out.backward(g)

    # The kernel keeps only the outputs, so its ReLU decisions near 0 are re-derived from a replay of the same
    # layers through cuBLAS (the fused MLP's own GEMMs).
    with torch.no_grad(), matmul_precision(kind):
        h = x.detach()
        kernel_masks = []
        for w, b, r in zip(ws, bs, relu):
            pre = torch.addmm(b.detach(), h, w.detach().t())
            kernel_masks.append((pre > 0).double().cpu() if r else None)
            h = pre.relu() if r else pre
    check_chain(out, x, ws, bs, g, relu, kernel_masks, kind, need_x, frozen, tol_scale)


# ----------------------------------------------------------------------------------------------
# CPU (Triton interpreter) and GPU alike
# ----------------------------------------------------------------------------------------------

CHAINS = {
    "one_layer": [13, 16],
    "logit": [24, 1],
    "width_1_inside": [5, 1, 7, 3],
    "bottom_like": [13, 32, 24, 16],
    "top_like": [37, 48, 16, 1],
}


@pytest.mark.parametrize("activate_last", [True, False], ids=["act_last", "no_act_last"])
@pytest.mark.parametrize("chain", list(CHAINS))
@pytest.mark.parametrize("M", [1, 3, 127])
def test_shapes(M, chain, activate_last, device):
    run_case(M, CHAINS[chain], activate_last, device, seed=M)


@pytest.mark.parametrize(
    "x_layout,grad_layout",
    [("transposed", "contiguous"), ("sliced", "transposed"), ("contiguous", "expand"), ("transposed", "sliced")],
)
def test_noncontiguous_input_and_grad(x_layout, grad_layout, device):
    run_case(67, [13, 24, 16], True, device, x_layout=x_layout, grad_layout=grad_layout, seed=1)
    run_case(67, [24, 16, 1], False, device, x_layout=x_layout, grad_layout=grad_layout, seed=2)


def test_input_without_grad_and_frozen_layers(device):
    """The bottom MLP's input is data (no grad_x; the first layer's data-gradient GEMM is skipped);
    frozen layers get no gradient, and the chain stops at the lowest layer that needs one."""
    run_case(33, [13, 24, 16, 8], True, device, need_x=False, seed=3)
    run_case(33, [13, 24, 16, 8], True, device, need_x=False, frozen=(0,), seed=4)
    run_case(33, [13, 24, 16, 8], False, device, need_x=True, frozen=(1,), seed=5)


def test_skips_the_first_data_gradient_when_the_input_needs_none(device, monkeypatch):
    """Counted: L - 1 data-gradient GEMMs for data input, L when the input needs a gradient."""
    calls = []
    real_mm = torch.mm

    def mm(a, b, *args, **kwargs):
        calls.append((tuple(a.shape), tuple(b.shape)))
        return real_mm(a, b, *args, **kwargs)

    mlp = FusedMLP(13, [24, 16, 8]).to(device)
    for need_x, data_grads in ((False, 2), (True, 3)):
        x = torch.randn(9, 13, device=device, requires_grad=need_x)
        out = mlp(x)
        calls.clear()
        monkeypatch.setattr(torch, "mm", mm)
        out.sum().backward()
        monkeypatch.setattr(torch, "mm", real_mm)
        # weight gradients are [N, M] @ [M, K]; data gradients [M, N] @ [N, K]
        assert sum(1 for a, _ in calls if a[0] == 9) == data_grads, calls
        assert sum(1 for a, _ in calls if a[1] == 9) == 3, calls


def test_empty_batch(device):
    mlp = FusedMLP(13, [16, 4]).to(device)
    x = torch.randn(0, 13, device=device, requires_grad=True)
    out = mlp(x)
    assert out.shape == (0, 4)
    out.sum().backward()
    assert x.grad.shape == (0, 13)
    for p in mlp.parameters():
        assert p.grad is not None and not p.grad.any()


@pytest.mark.parametrize("M,N,relu,rows", [(200, 24, True, 64), (300, 130, True, 64), (130, 1, False, 64), (5, 3, True, 64)])
def test_mask_bias_kernel_several_programs(M, N, relu, rows, device, monkeypatch):
    """The mask + bias-gradient kernel with several row programs (and a column-sum loop longer than
    one step), non-contiguous gradient and output: against torch."""
    monkeypatch.setattr(kmlp, "_rows_per_program", lambda m, cb, dev, block_m, programs: rows)
    gen = torch.Generator().manual_seed(M)
    g = torch.randn(N, M, generator=gen).t().to(device)
    out = torch.randn(M, 2 * N, generator=gen)[:, ::2].relu().to(device)
    gm, gb = mask_bias_grad(g, out, relu, write=relu)
    expected = g * (out > 0) if relu else g
    if relu:
        assert gm.is_contiguous()
        torch.testing.assert_close(gm, expected, atol=0, rtol=0)
    else:
        assert gm is None
    torch.testing.assert_close(gb.double(), expected.double().sum(0), atol=1e-5, rtol=1e-5)


def test_bias_gradient_is_deterministic(device):
    g = torch.randn(1000, 40, device=device)
    out = torch.randn(1000, 40, device=device).relu()
    first = mask_bias_grad(g, out, True)[1]
    assert all(torch.equal(first, mask_bias_grad(g, out, True)[1]) for _ in range(3))


def test_state_dict_interchangeable_with_the_eager_mlp(device):
    """Same seed, same parameters; a state_dict loads either way; same outputs and gradients. The
    arches' MLPs can be swapped for it (``arch.model``), keys unchanged."""
    for widths, last in (([32, 24, 16], True), ([48, 16, 1], False)):
        torch.manual_seed(0)
        eager = MLP(13, widths, "relu", activate_last=last).to(device)
        torch.manual_seed(0)
        fused = FusedMLP(13, widths, "relu", activate_last=last).to(device)
        assert list(fused.state_dict()) == list(eager.state_dict())
        for k, v in eager.state_dict().items():
            assert torch.equal(fused.state_dict()[k], v), k
        assert fused.activations == eager.activations

        torch.manual_seed(1)
        other = MLP(13, widths, "relu", activate_last=last).to(device)
        fused.load_state_dict(other.state_dict())
        eager.load_state_dict(fused.state_dict())
        x = torch.randn(31, 13, device=device, requires_grad=True)
        g = torch.randn(31, widths[-1], device=device)
        outs, grads = [], []
        for mod in (eager, fused):
            x.grad = None
            mod.zero_grad(set_to_none=True)
            out = mod(x)
            out.backward(g)
            outs.append(out)
            grads.append([x.grad, *(p.grad for p in mod.parameters())])
        torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
        for a, b in zip(grads[1], grads[0]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)

    for arch_cls, widths, last in ((DenseArch, [24, 16], True), (OverArch, [24, 1], False)):
        torch.manual_seed(2)
        arch = arch_cls(13, widths).to(device)
        keys = list(arch.state_dict())
        ref = arch(torch.ones(4, 13, device=device))
        fused = FusedMLP(13, widths, "relu", activate_last=last).to(device)
        fused.load_state_dict(arch.model.state_dict())
        arch.model = fused
        assert list(arch.state_dict()) == keys
        torch.testing.assert_close(arch(torch.ones(4, 13, device=device)), ref, atol=1e-5, rtol=1e-5)


def test_leading_dimensions(device):
    mlp = FusedMLP(8, [6, 4]).to(device)
    eager = MLP(8, [6, 4]).to(device)
    eager.load_state_dict(mlp.state_dict())
    x = torch.randn(2, 5, 8, device=device)
    assert mlp(x).shape == (2, 5, 4)
    torch.testing.assert_close(mlp(x), eager(x), atol=1e-5, rtol=1e-5)


def test_bad_arguments(device):
    for kwargs in ({"activation": "gelu"}, {"activation": "sigmoid"}, {"dropout": 0.1}, {"linear_cls": torch.nn.Linear}):
        with pytest.raises(ValueError):
            FusedMLP(13, [16, 4], **kwargs)
    with pytest.raises(ValueError):
        FusedMLP(13, [])
    x = torch.randn(3, 13, device=device)
    w = torch.randn(4, 12, device=device)
    with pytest.raises(ValueError, match="layer 0"):
        fused_mlp(x, [w], [torch.zeros(4, device=device)], [True])
    with pytest.raises(ValueError, match="one weight, bias"):
        fused_mlp(x, [w], [], [True])


def test_none_activation_is_affine(device):
    torch.manual_seed(0)
    mlp = FusedMLP(13, [8, 3], activation="none").to(device)
    eager = MLP(13, [8, 3], activation="none").to(device)
    eager.load_state_dict(mlp.state_dict())
    x = torch.randn(5, 13, device=device)
    torch.testing.assert_close(mlp(x), eager(x), atol=1e-5, rtol=1e-5)


def test_opcheck(device):
    x = torch.randn(5, 7, device=device, requires_grad=True)
    ws = [torch.randn(6, 7, device=device, requires_grad=True), torch.randn(3, 6, device=device, requires_grad=True)]
    bs = [torch.randn(6, device=device, requires_grad=True), torch.randn(3, device=device, requires_grad=True)]
    torch.library.opcheck(_mlp_forward_op, (x, ws, bs, [True, False]))
    outs = [o.detach() for o in _mlp_forward_op(x, ws, bs, [True, False])]
    g = torch.randn(5, 3, device=device)
    args = (g, x.detach(), [w.detach() for w in ws], outs, [True, False], True, [True, True], [True, True])
    torch.library.opcheck(_mlp_backward_op, args, test_utils=("test_schema", "test_faketensor"))


def test_torch_compile(device):
    """A module using FusedMLP under torch.compile (fullgraph=False, as the trainer compiles; the op
    itself traces without a graph break): same output and gradients as eager. aot_eager on the CPU
    (dynamo + AOTAutograd tracing of forward and backward, no C++ codegen), inductor on CUDA."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    bottom = FusedMLP(13, [24, 16]).to(device)
    top = FusedMLP(16 + 5, [16, 1], activate_last=False).to(device)

    def step(dense, other):
        z = torch.cat([bottom(dense), other], dim=1)
        return top(z).squeeze(-1).square().mean()

    dense = torch.randn(9, 13, device=device)
    other = torch.randn(9, 5, device=device, requires_grad=True)
    loss = step(dense, other)
    loss.backward()
    expected = [other.grad.clone(), *(p.grad.clone() for p in [*bottom.parameters(), *top.parameters()])]
    for p in [*bottom.parameters(), *top.parameters()]:
        p.grad = None
    other.grad = None

    torch._dynamo.reset()
    counters.clear()
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    compiled = torch.compile(step, fullgraph=False, backend=backend)
    loss_c = compiled(dense, other)
    loss_c.backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch.testing.assert_close(loss_c, loss, atol=1e-5, rtol=1e-5)
    got = [other.grad, *(p.grad for p in [*bottom.parameters(), *top.parameters()])]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()


# ----------------------------------------------------------------------------------------------
# GPU only
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("activate_last", [True, False], ids=["act_last", "no_act_last"])
@pytest.mark.parametrize("chain", list(CHAINS))
@pytest.mark.parametrize("M", [1, 3, 127])
def test_gpu_shapes(M, chain, activate_last, kind):
    run_case(M, CHAINS[chain], activate_last, torch.device("cuda"), kind=kind, seed=M)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp32", "tf32", "bf16"])
def test_gpu_dlrm_sizes(kind):
    """The Kaggle bottom and top MLPs and the MLPerf top MLP's first layers at a few thousand rows:
    several mask-kernel programs, long reductions (rounding grows like sqrt(terms): wider tolerance)."""
    dev = torch.device("cuda")
    scale = 3.0 if kind == "fp32" else 2.0
    run_case(4099, [13, 512, 256, 64, 16], True, dev, kind=kind, need_x=False, seed=10, tol_scale=scale)
    run_case(4099, [367, 512, 256, 1], False, dev, kind=kind, x_layout="sliced", grad_layout="expand", seed=11,
             tol_scale=scale)  # fmt: skip
    run_case(2048, [1024, 1024, 512, 1], False, dev, kind=kind, seed=12, tol_scale=2 * scale)


@pytest.mark.gpu
def test_gpu_autocast_bf16_like_the_eager_mlp():
    """Under CUDA autocast FusedMLP computes in bf16 like the eager MLP, and its fp32 parameters get
    fp32 gradients close to the eager ones."""
    torch.manual_seed(0)
    eager = MLP(367, [512, 256, 1], activate_last=False).cuda()
    fused = FusedMLP(367, [512, 256, 1], activate_last=False).cuda()
    fused.load_state_dict(eager.state_dict())
    x = torch.randn(1000, 367, device="cuda", requires_grad=True)
    res = []
    for mod in (eager, fused):
        x.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = mod(x)
        assert out.dtype == torch.bfloat16
        out.float().square().mean().backward()
        res.append([out.float(), x.grad, *(p.grad for p in mod.parameters())])
    for a, b in zip(res[1], res[0]):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, atol=2e-2 * float(b.abs().max()), rtol=5e-2)


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_matches_eager():
    """Forward + backward captured in a CUDA graph (the side stream forks from and joins the capturing
    stream) and replayed on new inputs: the same results as an uncaptured run."""
    torch.manual_seed(0)
    mlp = FusedMLP(367, [512, 256, 1], activate_last=False).cuda()
    x = torch.randn(2048, 367, device="cuda", requires_grad=True)
    params = [x, *mlp.parameters()]

    def step():
        for p in params:
            p.grad = None
        mlp(x).float().square().mean().backward()

    graph = capture(step, warmup=2)
    captured = [p.grad for p in params]

    with torch.no_grad():
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    got = [g.clone() for g in captured]
    step()
    for a, p in zip(got, params):
        torch.testing.assert_close(a, p.grad, atol=1e-5, rtol=1e-5)


def test_side_stream_only_for_32_bit_operands_on_cuda_unless_forced(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # only the device's type is read
    assert kmlp.SIDE_STREAM is None  # shipped: by the operands' width
    assert kmlp._use_side_stream(cuda, torch.float32, [False, True])
    assert not kmlp._use_side_stream(cuda, torch.bfloat16, [True, True])
    assert not kmlp._use_side_stream(cuda, torch.float16, [True])
    assert not kmlp._use_side_stream(cuda, torch.float32, [False, False])  # no weight gradient to overlap
    assert not kmlp._use_side_stream(cpu, torch.float32, [True])
    monkeypatch.setattr(kmlp, "SIDE_STREAM", True)
    assert kmlp._use_side_stream(cuda, torch.bfloat16, [True]) and not kmlp._use_side_stream(cpu, torch.float32, [True])
    monkeypatch.setattr(kmlp, "SIDE_STREAM", False)
    assert not kmlp._use_side_stream(cuda, torch.float32, [True])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_side_stream_and_in_series_give_the_same_gradients(dtype, monkeypatch):
    """The weight gradients are the same GEMMs on either stream: forcing the side stream or the series order
    changes no bit of any gradient (bf16 runs in series by default, fp32 on the side stream)."""
    torch.manual_seed(0)
    mlp = FusedMLP(3456, [1024, 512, 256, 1], activate_last=False).cuda().to(dtype)
    x = torch.randn(4099, 3456, device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn(4099, 1, device="cuda", dtype=dtype)
    grads = {}
    for side in (True, False):
        monkeypatch.setattr(kmlp, "SIDE_STREAM", side)
        mlp.zero_grad(set_to_none=True)
        x.grad = None
        mlp(x).backward(g)
        grads[side] = [x.grad.clone(), *(p.grad.clone() for p in mlp.parameters())]
    for a, b in zip(grads[True], grads[False]):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_side_stream_result_is_visible_right_after_backward():
    """The weight gradients computed on the side stream are complete when backward returns (the
    current stream waited on it): a kernel reading them straight after sees the final values."""
    torch.manual_seed(0)
    mlp = FusedMLP(13, [512, 256, 64, 16]).cuda()
    eager = MLP(13, [512, 256, 64, 16]).cuda()
    eager.load_state_dict(mlp.state_dict())
    x = torch.randn(65536, 13, device="cuda")
    with matmul_precision("fp32"):
        for _ in range(3):
            mlp.zero_grad(set_to_none=True)
            eager.zero_grad(set_to_none=True)
            mlp(x).sum().backward()
            sums = [p.grad.sum() for p in mlp.parameters()]  # queued right behind the backward
            eager(x).sum().backward()
            for s, p in zip(sums, eager.parameters()):
                torch.testing.assert_close(s, p.grad.sum(), atol=1e-4 * float(p.grad.abs().sum()) + 1e-4, rtol=1e-4)
