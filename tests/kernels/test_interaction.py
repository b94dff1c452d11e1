"""kernels/interaction.py against a float64 PyTorch reference (CPU: Triton interpreter; GPU: marked gpu)."""

from __future__ import annotations

import pytest
import torch

from kernels.interaction import TritonDotInteraction, dot_interaction, dot_interaction_reference, interaction_output_dim


def make_x(B: int, F1: int, D: int, layout: str, device, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if layout == "contiguous":
        x = torch.randn(B, F1, D, generator=gen)
    elif layout == "transposed":  # built [B, D, F1]: stride 1 along the vector index
        x = torch.randn(B, D, F1, generator=gen).transpose(1, 2)
    elif layout == "sliced":  # every other sample, a window of a wider feature dim
        x = torch.randn(2 * B, F1, D + 8, generator=gen)[::2, :, 3 : 3 + D]
    else:
        raise ValueError(layout)
    return x.to(device=device, dtype=dtype)


def make_grad(B: int, cols: int, layout: str, device, dtype=torch.float32, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if layout == "contiguous":
        g = torch.randn(B, cols, generator=gen)
    elif layout == "transposed":
        g = torch.randn(cols, B, generator=gen).t()
    elif layout == "expand":  # stride 0 over the batch
        g = torch.randn(1, cols, generator=gen).expand(B, cols)
    else:
        raise ValueError(layout)
    return g.to(device=device, dtype=dtype)


def reference(x: torch.Tensor, grad: torch.Tensor):
    x64 = x.detach().double().requires_grad_()
    out = dot_interaction_reference(x64)
    out.backward(grad.double())
    return out.detach(), x64.grad


def test_reference_layout():
    """Column order: dense vector, then pairs (1,0), (2,0), (2,1), (3,0), ... of Z = x x^T."""
    x = torch.randn(2, 4, 3, dtype=torch.float64)
    out = dot_interaction_reference(x)
    pairs = [(1, 0), (2, 0), (2, 1), (3, 0), (3, 1), (3, 2)]
    expected = torch.cat([x[:, 0], torch.stack([(x[:, i] * x[:, j]).sum(-1) for i, j in pairs], 1)], 1)
    torch.testing.assert_close(out, expected)
    assert interaction_output_dim(4, 3) == out.shape[1] == 3 + 6


CASES = [
    # (B, F, D, x layout, grad layout)
    (1, 1, 16, "contiguous", "contiguous"),
    (1, 26, 24, "transposed", "expand"),
    (3, 1, 24, "sliced", "transposed"),
    (3, 26, 16, "contiguous", "transposed"),
    (3, 26, 24, "sliced", "expand"),
    (127, 1, 16, "transposed", "contiguous"),
    (127, 26, 16, "transposed", "expand"),
    (127, 26, 24, "sliced", "transposed"),
]


@pytest.mark.parametrize("B,F,D,x_layout,g_layout", CASES)
def test_forward_backward(B, F, D, x_layout, g_layout, device, assert_close):
    F1 = F + 1
    x = make_x(B, F1, D, x_layout, device, seed=B + F + D).requires_grad_()
    out = dot_interaction(x)
    assert out.shape == (B, interaction_output_dim(F1, D)) and out.dtype == x.dtype and out.is_contiguous()
    grad = make_grad(B, out.shape[1], g_layout, device)
    out.backward(grad)
    out_ref, grad_ref = reference(x, grad)
    assert torch.equal(out[:, :D], x.detach()[:, 0])  # passthrough is a copy
    # Dot products of D ~ N(0,1) terms reach ~sqrt(D) * 3; gradients sum F1 such products.
    assert_close(out, out_ref, torch.float32, msg="out")
    assert_close(x.grad, grad_ref, torch.float32, msg="grad_x")


def test_module_has_no_parameters(device, assert_close):
    mod = TritonDotInteraction()
    assert list(mod.parameters()) == [] and mod.state_dict() == {}
    x = make_x(3, 5, 16, "contiguous", device)
    assert_close(mod(x), dot_interaction_reference(x.double()), torch.float32)


def test_opcheck(device):
    x = make_x(3, 5, 16, "transposed", device).requires_grad_()
    torch.library.opcheck(torch.ops.dlrm_kernels.dot_interaction.default, (x,))
    grad = make_grad(3, interaction_output_dim(5, 16), "expand", device)
    torch.library.opcheck(torch.ops.dlrm_kernels.dot_interaction_backward.default, (grad, x.detach()))


def test_compile_fullgraph_no_graph_breaks(device, assert_close):
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    mod = TritonDotInteraction()

    def f(x):
        return (mod(x * 2.0) ** 2).sum()

    x = make_x(3, 27, 16, "transposed", device).requires_grad_()
    loss = torch.compile(f, fullgraph=True)(x)
    loss.backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
    x_ref = x.detach().double().requires_grad_()
    loss_ref = (dot_interaction_reference(x_ref * 2.0) ** 2).sum()
    loss_ref.backward()
    assert_close(loss, loss_ref, torch.float32, scale=100.0)
    assert_close(x.grad, x_ref.grad, torch.float32, scale=100.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [16, 24, 128])
@pytest.mark.parametrize("x_layout,g_layout", [("contiguous", "contiguous"), ("transposed", "expand"), ("sliced", "transposed")])
def test_gpu_forward_backward(dtype, D, x_layout, g_layout, assert_close):
    device = torch.device("cuda")
    B, F1 = 2048, 27
    x = make_x(B, F1, D, x_layout, device, dtype).requires_grad_()
    out = dot_interaction(x)
    grad = make_grad(B, out.shape[1], g_layout, device, dtype)
    out.backward(grad)
    out_ref, grad_ref = reference(x, grad)
    # Dot products of D terms of size ~1: scale atol with sqrt(D); gradients sum F1 more such terms.
    scale = (D**0.5) if dtype == torch.float32 else 1.0
    assert_close(out, out_ref, dtype, scale=scale, msg="out")
    assert_close(x.grad, grad_ref, dtype, scale=scale * 2, msg="grad_x")
