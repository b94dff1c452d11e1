"""kernels/mlp_tail.py (the on-chip MLP tail) and kernels/mlp_tail_module.py (OnChipTailMLP) against a float64 PyTorch reference:
the output and every gradient (input, each weight, each bias), element by element.

Without CUDA the kernels run under the Triton interpreter (fp32, exact "ieee" dots); the interpreter is
slow, so the CPU cases are few and small. The tests marked gpu repeat the comparisons on CUDA in fp32
(ieee and tf32) and bf16 at DLRM's tails and batch sizes, under autocast and in a CUDA graph.
"""

from __future__ import annotations

import contextlib
import os

import torch

if not torch.cuda.is_available():  # before triton is imported (tests/kernels/conftest.py does the same)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import kernels.mlp_tail as kt  # noqa: E402
from dlrm.model.archs import MLP, DenseArch, OverArch  # noqa: E402
from kernels.mlp_tail import TailLaunch, _tail_backward_op, _tail_forward_op, tail_mlp  # noqa: E402
from kernels.mlp_tail_module import OnChipTailMLP, split_tail  # noqa: E402
from tests.kernels.cuda_graphs import capture  # noqa: E402
from tests.kernels.mlp_chain_reference import (  # noqa: E402
    DTYPES,
    chain_inputs,
    check_chain,
    matmul_precision,
)


@contextlib.contextmanager
def forced_launch(block_m: int, programs: int, reload: bool = True, hoist: bool = True):
    """Both kernels with `block_m`-row tiles and the backward with `programs` programs (several
    row blocks each where M allows): the multi-program reduction, under the interpreter too."""
    old_override, old_programs = kt.TAIL_LAUNCH_OVERRIDE, kt._backward_programs
    kt.TAIL_LAUNCH_OVERRIDE = (TailLaunch(block_m, 4), TailLaunch(block_m, 4, 1, 1, reload, hoist))
    kt._backward_programs = lambda M, bm, launch, device: programs
    try:
        yield
    finally:
        kt.TAIL_LAUNCH_OVERRIDE, kt._backward_programs = old_override, old_programs


def run_case(
    M: int,
    dims: list[int],
    relu: list[bool],
    device,
    kind: str = "fp32",
    x_layout: str = "contiguous",
    grad_layout: str = "contiguous",
    need_x: bool = True,
    frozen: tuple[int, ...] = (),
    seed: int = 0,
    tol_scale: float = 1.0,
) -> list[torch.Tensor]:
    """tail_mlp forward and backward vs float64 autograd on the same (rounded) values; returns the
    kernel's [out, grad_x, grad_W..., grad_b...] (for the determinism test)."""
    dtype = DTYPES[kind]
    x, ws, bs, g = chain_inputs(M, dims, device, kind, x_layout, grad_layout, need_x, frozen, seed)

    with matmul_precision(kind):
        out = tail_mlp(x, ws, bs, relu)
        assert out.dtype == dtype and out.shape == (M, dims[-1])
        out.backward(g)

    # The kernel's ReLU decisions near 0: its forward over the chain's first l + 1 layers gives layer l's, in the
    # kernel's very products. (A replay through cuBLAS is not one in TF32: on the H100 it disagreed with the kernel's
    # TF32 decisions beyond the 1e-2 band on a few units, identically for every launch of the kernel, 2026-11-24.)
    with torch.no_grad(), matmul_precision(kind):
        kernel_masks = []
        for i, r in enumerate(relu):
            prefix = tail_mlp(x.detach(), [w.detach() for w in ws[: i + 1]], [b.detach() for b in bs[: i + 1]],
                              relu[: i + 1]) if r else None  # fmt: skip
            kernel_masks.append((prefix > 0).double().cpu() if r else None)
    check_chain(out, x, ws, bs, g, relu, kernel_masks, kind, need_x, frozen, tol_scale)
    return [out.detach(), *([x.grad] if need_x else []), *(w.grad for w in ws), *(b.grad for b in bs)]


# (dims, relu per layer): DLRM's tails, a square 16-wide layer, widths 13 and 1, 4 layers (the most)
CHAINS = {
    "kaggle_bottom_tail": ([256, 64, 16], [True, True]),
    "logit": ([256, 1], [False]),
    "square_16": ([16, 16], [True]),
    "narrow": ([13, 1, 7], [True, False]),
    "four_layers": ([13, 16, 1, 7, 3], [True, False, True, True]),
}


# ----------------------------------------------------------------------------------------------
# CPU (Triton interpreter) and GPU alike
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def kind(device) -> str:
    """fp32 in the interpreter; bf16 on CUDA (the gpu-marked tests add fp32 and TF32 there)."""
    return "bf16" if device.type == "cuda" else "fp32"


@pytest.mark.parametrize("chain", list(CHAINS))
@pytest.mark.parametrize("M", [1, 3, 127])
def test_shapes(M, chain, device, kind):
    dims, relu = CHAINS[chain]
    run_case(M, dims, relu, device, kind=kind, seed=M)


@pytest.mark.parametrize("hoist", [False, True], ids=["w_per_block", "w_hoisted"])
@pytest.mark.parametrize("reload", [False, True], ids=["kept", "reloaded"])
def test_a_few_hundred_rows_in_several_programs(reload, hoist, device, kind):
    """M = 300 in 16-row tiles over 3 backward programs (7 row blocks each, the last one short): the
    per-program dW / db partials and their fixed-order sum; h_0 and W_0 kept from the recompute for
    the backward's GEMMs, or loaded again transposed (RELOAD); the weights loaded per row block, or
    once per program (HOIST_W): every combination the GPU heuristic picks."""
    with forced_launch(16, 3, reload, hoist):
        run_case(300, [256, 64, 16], [True, True], device, kind=kind, seed=7)
        run_case(300, [64, 1], [False], device, kind=kind, need_x=reload, seed=8)


@pytest.mark.parametrize(
    "x_layout,grad_layout", [("transposed", "expand"), ("sliced", "transposed"), ("contiguous", "sliced")]
)
def test_noncontiguous_input_and_grad(x_layout, grad_layout, device, kind):
    run_case(67, [24, 16, 1], [True, False], device, kind=kind, x_layout=x_layout, grad_layout=grad_layout, seed=1)


def test_input_without_grad_and_frozen_layers(device, kind):
    """The bottom MLP's input is data: no dx written; frozen layers get no gradient."""
    run_case(33, [13, 24, 16], [True, True], device, kind=kind, need_x=False, seed=3)
    run_case(33, [13, 24, 16], [True, False], device, kind=kind, frozen=(0,), seed=4)


def test_backward_is_deterministic(device, kind):
    """Two backward runs with several programs: bitwise equal gradients."""
    with forced_launch(16, 4):
        first = run_case(150, [40, 24, 8], [True, True], device, kind=kind, seed=5)
        second = run_case(150, [40, 24, 8], [True, True], device, kind=kind, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_empty_batch(device, kind):
    dtype = DTYPES[kind]
    w = torch.randn(4, 13, device=device, dtype=dtype, requires_grad=True)
    b = torch.randn(4, device=device, dtype=dtype, requires_grad=True)
    x = torch.randn(0, 13, device=device, dtype=dtype, requires_grad=True)
    out = tail_mlp(x, [w], [b], [True])
    assert out.shape == (0, 4)
    out.sum().backward()
    assert x.grad.shape == (0, 13) and not w.grad.any() and not b.grad.any()


def test_split_tail():
    """The longest suffix of layers whose input and width are <= 256, at most MAX_LAYERS of them."""
    assert split_tail([13, 512, 256, 64, 16]) == 2  # Kaggle bottom: 256-64-16
    assert split_tail([367, 512, 256, 1]) == 2  # Kaggle top: 256-1
    assert split_tail([13, 512, 256, 128]) == 2  # MLPerf bottom: 256-128
    assert split_tail([3456, 1024, 1024, 512, 256, 1]) == 4  # MLPerf top: 256-1
    assert split_tail([13, 16, 16]) == 0  # the whole chain
    assert split_tail([13, 512]) == 1 and split_tail([300, 16]) == 1  # none
    assert split_tail([8] * 7) == 2  # at most 4 layers


def test_module_matches_the_eager_mlp(device):
    """Same seed, same parameters and keys as MLP; a state_dict loads either way; same outputs and
    gradients (head through kernels.mlp.fused_mlp, tail through the kernel, or all tail)."""
    for in_features, widths, last, start in ((13, [260, 24, 8], True, 2), (20, [260, 32, 1], False, 2),
                                             (13, [16, 8], True, 0)):  # fmt: skip
        torch.manual_seed(0)
        eager = MLP(in_features, widths, "relu", activate_last=last).to(device)
        torch.manual_seed(0)
        tail = OnChipTailMLP(in_features, widths, "relu", activate_last=last).to(device)
        assert tail.tail_start == start and tail.activations == eager.activations
        assert list(tail.state_dict()) == list(eager.state_dict())
        for k, v in eager.state_dict().items():
            assert torch.equal(tail.state_dict()[k], v), k
        torch.manual_seed(1)
        other = MLP(in_features, widths, "relu", activate_last=last).to(device)
        tail.load_state_dict(other.state_dict())
        eager.load_state_dict(tail.state_dict())
        x = torch.randn(2, 9, in_features, device=device, requires_grad=True)  # leading dims flattened
        g = torch.randn(2, 9, widths[-1], device=device)
        res = []
        for mod in (eager, tail):
            x.grad = None
            out = mod(x)
            out.backward(g)
            res.append([out, x.grad, *(p.grad for p in mod.parameters())])
        for a, b in zip(res[1], res[0]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)

    torch.manual_seed(2)
    for arch_cls, widths, last in ((DenseArch, [24, 16], True), (OverArch, [24, 1], False)):
        arch = arch_cls(13, widths).to(device)
        keys = list(arch.state_dict())
        ref = arch(torch.ones(4, 13, device=device))
        tail = OnChipTailMLP(13, widths, "relu", activate_last=last).to(device)
        tail.load_state_dict(arch.model.state_dict())
        arch.model = tail
        assert list(arch.state_dict()) == keys
        torch.testing.assert_close(arch(torch.ones(4, 13, device=device)), ref, atol=1e-5, rtol=1e-5)


def test_module_trains_like_the_eager_mlp(device):
    """A few SGD steps on a regression target: the same losses and parameters as the eager MLP."""
    torch.manual_seed(0)
    eager = MLP(13, [260, 32, 1], "relu", activate_last=False).to(device)
    torch.manual_seed(0)
    tail = OnChipTailMLP(13, [260, 32, 1], "relu", activate_last=False).to(device)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 13, generator=gen).to(device)
    y = torch.randn(64, 1, generator=gen).to(device)
    losses = []
    for mod in (eager, tail):
        opt = torch.optim.SGD(mod.parameters(), lr=0.05, momentum=0.9)
        run = []
        for _ in range(5):
            opt.zero_grad(set_to_none=True)
            loss = (mod(x) - y).square().mean()
            loss.backward()
            opt.step()
            run.append(loss.item())
        losses.append(run)
    assert losses[1][-1] < losses[1][0]
    torch.testing.assert_close(torch.tensor(losses[1]), torch.tensor(losses[0]), atol=1e-5, rtol=1e-4)
    for (k, a), b in zip(tail.state_dict().items(), eager.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=k)


def test_bad_arguments(device):
    for kwargs in ({"activation": "gelu"}, {"dropout": 0.1}, {"linear_cls": torch.nn.Linear}):
        with pytest.raises(ValueError):
            OnChipTailMLP(13, [16, 4], **kwargs)
    x = torch.randn(3, 13, device=device)
    z = torch.zeros(4, device=device)
    with pytest.raises(ValueError, match="layer 0"):
        tail_mlp(x, [torch.randn(4, 12, device=device)], [z], [True])
    with pytest.raises(ValueError, match="widths 1 to 256"):
        tail_mlp(torch.randn(3, 300, device=device), [torch.randn(4, 300, device=device)], [z], [True])
    ws = [torch.randn(13, 13, device=device) for _ in range(5)]
    with pytest.raises(ValueError, match="1 to 4 layers"):
        tail_mlp(x, ws, [torch.zeros(13, device=device)] * 5, [True] * 5)


def test_opcheck(device):
    x = torch.randn(5, 7, device=device, requires_grad=True)
    ws = [torch.randn(6, 7, device=device, requires_grad=True), torch.randn(1, 6, device=device, requires_grad=True)]
    bs = [torch.randn(6, device=device, requires_grad=True), torch.randn(1, device=device, requires_grad=True)]
    torch.library.opcheck(_tail_forward_op, (x, ws, bs, [True, False], "ieee"))
    g = torch.randn(5, 1, device=device)
    args = (g, x.detach(), [w.detach() for w in ws], [b.detach() for b in bs], [True, False], "ieee", True)
    torch.library.opcheck(_tail_backward_op, args, test_utils=("test_schema", "test_faketensor"))


def test_torch_compile(device):
    """OnChipTailMLP (head and tail) under torch.compile without graph breaks: same loss and gradients
    as eager (aot_eager on the CPU, inductor on CUDA)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    mlp = OnChipTailMLP(13, [260, 16, 1], activate_last=False).to(device)
    x = torch.randn(9, 13, device=device, requires_grad=True)

    def step(inp):
        return mlp(inp).square().mean()

    step(x).backward()
    expected = [x.grad.clone(), *(p.grad.clone() for p in mlp.parameters())]
    x.grad = None
    mlp.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, backend="inductor" if device.type == "cuda" else "aot_eager")
    compiled(x).backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
    for a, b in zip([x.grad, *(p.grad for p in mlp.parameters())], expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()


# ----------------------------------------------------------------------------------------------
# GPU only
# ----------------------------------------------------------------------------------------------

# DLRM's tails: (dims, relu)
DLRM_TAILS = {
    "kaggle_bottom": ([256, 64, 16], [True, True]),
    "kaggle_top": ([256, 1], [False]),
    "mlperf_bottom": ([256, 128], [True]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("chain", list(CHAINS))
@pytest.mark.parametrize("M", [1, 3, 127, 300])
def test_gpu_shapes(M, chain, kind):
    dims, relu = CHAINS[chain]
    run_case(M, dims, relu, torch.device("cuda"), kind=kind, seed=M)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("tail", list(DLRM_TAILS))
def test_gpu_dlrm_tails(tail, kind):
    """DLRM's tails with the shipped launch heuristic at 65536 rows (the backward's programs walk
    many row blocks; long reductions: wider tolerance) and a non-contiguous case."""
    dims, relu = DLRM_TAILS[tail]
    dev = torch.device("cuda")
    scale = 3.0 if kind == "fp32" else 2.0
    run_case(65536, dims, relu, dev, kind=kind, need_x=tail != "mlperf_bottom", seed=10, tol_scale=scale)
    run_case(4099, dims, relu, dev, kind=kind, x_layout="sliced", grad_layout="expand", seed=11, tol_scale=scale)


@pytest.mark.gpu
def test_gpu_deterministic_at_dlrm_size():
    first = run_case(65536, [256, 64, 16], [True, True], torch.device("cuda"), kind="bf16", seed=12, tol_scale=2.0)
    second = run_case(65536, [256, 64, 16], [True, True], torch.device("cuda"), kind="bf16", seed=12, tol_scale=2.0)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.gpu
def test_gpu_autocast_bf16_like_the_eager_mlp():
    """Under bf16 autocast OnChipTailMLP computes in bf16 like the eager MLP; fp32 parameters get fp32
    gradients. Both are measured against the same model in float64: the tail's error (max |error| over max
    |reference|, per tensor) is at most twice the eager MLP's plus 0.5%. (Compared with each other directly,
    two bf16 computations whose GEMMs sum in different orders differ by both errors: since the head pads its
    first GEMM's K to 16 bytes, `kernels.mlp.ALIGN_INPUT`, cuBLAS no longer runs the eager MLP's kernel there,
    and on an H100 x's gradient, a sum with cancellation, then differed from the eager one by up to 17% of its
    largest value for 1.3% of its elements: a direct comparison asks more of bf16 than either path gives.)"""
    for widths, last, in_features in (([512, 256, 64, 16], True, 13), ([512, 256, 1], False, 367)):
        torch.manual_seed(0)
        eager = MLP(in_features, widths, activate_last=last).cuda()
        tail = OnChipTailMLP(in_features, widths, activate_last=last).cuda()
        tail.load_state_dict(eager.state_dict())
        exact = MLP(in_features, widths, activate_last=last).double()
        exact.load_state_dict({k: v.double().cpu() for k, v in eager.state_dict().items()})
        x = torch.randn(2048, in_features, device="cuda", requires_grad=True)
        res = []
        for mod in (eager, tail, exact):
            x.grad = None
            if mod is exact:
                xd = x.detach().double().cpu().requires_grad_(True)
                out = mod(xd)
                out.square().mean().backward()
                res.append([out, xd.grad, *(p.grad for p in mod.parameters())])
                continue
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = mod(x)
            assert out.dtype == torch.bfloat16
            out.float().square().mean().backward()
            res.append([out.float(), x.grad, *(p.grad for p in mod.parameters())])
        names = ["out", "x.grad", *(n for n, _ in eager.named_parameters())]
        for name, e, t, ref in zip(names, *res):
            assert t.dtype == e.dtype
            ref = ref.detach()
            scale = float(ref.abs().max())
            err_eager = float((e.double().cpu() - ref).abs().max()) / scale
            err_tail = float((t.double().cpu() - ref).abs().max()) / scale
            assert err_tail <= 2 * err_eager + 5e-3, (name, in_features, err_tail, err_eager)


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_matches_eager():
    torch.manual_seed(0)
    mlp = OnChipTailMLP(13, [512, 256, 64, 16]).cuda()
    x = torch.randn(4096, 13, device="cuda")
    params = list(mlp.parameters())

    def step():
        for p in params:
            p.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):  # the tail runs 16-bit on CUDA
            out = mlp(x)
        out.float().square().mean().backward()

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
