"""kernels/interaction.py against a float64 PyTorch reference (CPU: Triton interpreter; GPU: marked gpu)."""

from __future__ import annotations

import pytest
import torch

from kernels.interaction import (
    TritonDotInteraction,
    dot_interaction,
    dot_interaction_reference,
    dot_interaction_split,
    interaction_output_dim,
)


def _randn(gen, device, dtype, *size) -> torch.Tensor:
    """randn from `gen`, on `device` in `dtype`: the layouts' views are taken after this (moving a strided view to
    another device or dtype would copy it contiguous)."""
    return torch.randn(*size, generator=gen).to(device=device, dtype=dtype)


def make_x(B: int, F1: int, D: int, layout: str, device, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if layout == "contiguous":
        return _randn(gen, device, dtype, B, F1, D)
    if layout == "transposed":  # built [B, D, F1]: stride 1 along the vector index
        return _randn(gen, device, dtype, B, D, F1).transpose(1, 2)
    if layout == "sliced":  # every other sample, a window of a wider feature dim
        return _randn(gen, device, dtype, 2 * B, F1, D + 8)[::2, :, 3 : 3 + D]
    raise ValueError(layout)


def make_grad(B: int, cols: int, layout: str, device, dtype=torch.float32, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if layout == "contiguous":
        return _randn(gen, device, dtype, B, cols)
    if layout == "transposed":
        return _randn(gen, device, dtype, cols, B).t()
    if layout == "expand":  # stride 0 over the batch
        return _randn(gen, device, dtype, 1, cols).expand(B, cols)
    raise ValueError(layout)


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
    dense, sparse = x[:, 0], x[:, 1:]
    torch.library.opcheck(torch.ops.dlrm_kernels.dot_interaction.default, (dense, sparse))
    grad = make_grad(3, interaction_output_dim(5, 16), "expand", device)
    torch.library.opcheck(torch.ops.dlrm_kernels.dot_interaction_backward.default,
                          (grad, dense.detach(), sparse.detach()))


def make_parts(B: int, F: int, D: int, layout: str, device, dtype=torch.float32, seed: int = 0):
    """dense [B, D] and sparse [B, F, D] as separate tensors, each in its own layout."""
    gen = torch.Generator().manual_seed(seed)
    if layout == "contiguous":
        return _randn(gen, device, dtype, B, D), _randn(gen, device, dtype, B, F, D)
    if layout == "strided":  # dense a column window of a wider matrix, sparse built [D, F, B] and permuted
        return _randn(gen, device, dtype, B, D + 5)[:, 2 : 2 + D], _randn(gen, device, dtype, D, F, B).permute(2, 1, 0)
    if layout == "every_other":  # every other sample of both
        return _randn(gen, device, dtype, 2 * B, D)[::2], _randn(gen, device, dtype, 2 * B, F, D)[::2]
    raise ValueError(layout)


SPLIT_CASES = [
    # (B, F, D, parts layout, grad layout)
    (1, 1, 16, "contiguous", "contiguous"),
    (1, 26, 24, "strided", "expand"),
    (3, 1, 16, "every_other", "transposed"),
    (3, 26, 16, "strided", "contiguous"),
    (3, 0, 16, "contiguous", "transposed"),  # no embeddings: the output is the dense vector alone
    (127, 26, 16, "every_other", "expand"),
    (127, 5, 24, "strided", "transposed"),
]


@pytest.mark.parametrize("B,F,D,layout,g_layout", SPLIT_CASES)
def test_split_forward_backward(B, F, D, layout, g_layout, device, assert_close):
    """The two-part form against float64 autograd of the reference on torch.cat of the parts."""
    dense, sparse = make_parts(B, F, D, layout, device, seed=B + F + D)
    dense.requires_grad_()
    sparse.requires_grad_()
    out = dot_interaction_split(dense, sparse)
    assert out.shape == (B, interaction_output_dim(F + 1, D)) and out.dtype == dense.dtype
    grad = make_grad(B, out.shape[1], g_layout, device)
    out.backward(grad)
    d64 = dense.detach().double().requires_grad_()
    s64 = sparse.detach().double().requires_grad_()
    out_ref = dot_interaction_reference(torch.cat([d64.unsqueeze(1), s64], dim=1))
    out_ref.backward(grad.double())
    assert torch.equal(out[:, :D], dense.detach())  # passthrough is a copy
    assert_close(out, out_ref, torch.float32, msg="out")
    assert_close(dense.grad, d64.grad, torch.float32, msg="grad_dense")
    assert_close(sparse.grad, s64.grad, torch.float32, msg="grad_sparse")


def test_split_matches_combined_exactly(device):
    """Same kernel arithmetic either way: the split form and the [B, F + 1, D] form agree bit for bit."""
    x = make_x(7, 27, 16, "sliced", device, seed=3).requires_grad_()
    grad = make_grad(7, interaction_output_dim(27, 16), "contiguous", device)
    out = dot_interaction(x)
    out.backward(grad)
    dense = x.detach()[:, 0].clone().requires_grad_()
    sparse = x.detach()[:, 1:].clone().requires_grad_()
    out_split = TritonDotInteraction()(dense, sparse)
    out_split.backward(grad)
    assert torch.equal(out, out_split)
    assert torch.equal(x.grad[:, 0], dense.grad) and torch.equal(x.grad[:, 1:], sparse.grad)


def test_backward_gradients_are_contiguous(device):
    """The embeddings' gradient comes back contiguous, whatever the inputs' layout (no copy downstream)."""
    dense, sparse = make_parts(3, 4, 16, "strided", device)
    grad = make_grad(3, interaction_output_dim(5, 16), "transposed", device)
    gdense, gsparse = torch.ops.dlrm_kernels.dot_interaction_backward(grad, dense, sparse)
    assert gdense.shape == dense.shape and gsparse.shape == sparse.shape
    assert gdense.is_contiguous() and gsparse.is_contiguous()


@pytest.mark.parametrize(
    "dense_shape,sparse_shape,dtypes,match",
    [
        ((3, 16), (3, 16), (torch.float32, torch.float32), "dense must be \\[B, D\\] and sparse \\[B, F, D\\]"),
        ((3, 16), (4, 2, 16), (torch.float32, torch.float32), "to match dense"),
        ((3, 16), (3, 2, 8), (torch.float32, torch.float32), "to match dense"),
        ((3, 16), (3, 2, 16), (torch.float32, torch.float64), "share one floating dtype"),
        ((3, 16), (3, 2, 16), (torch.int64, torch.int64), "share one floating dtype"),
    ],
)
def test_split_bad_inputs(dense_shape, sparse_shape, dtypes, match, device):
    dense = torch.zeros(dense_shape, dtype=dtypes[0], device=device)
    sparse = torch.zeros(sparse_shape, dtype=dtypes[1], device=device)
    with pytest.raises(ValueError, match=match):
        dot_interaction_split(dense, sparse)


def test_combined_bad_inputs(device):
    with pytest.raises(ValueError, match="x must be \\[B, F \\+ 1, D\\]"):
        dot_interaction(torch.zeros(3, 16, device=device))
    with pytest.raises(ValueError, match="at least the dense vector"):
        dot_interaction(torch.zeros(3, 0, 16, device=device))


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
    # The two-part form, as the model calls it: the same numbers, bit for bit.
    dense = x.detach()[:, 0].clone().requires_grad_()
    sparse = x.detach()[:, 1:].clone().requires_grad_()
    out_split = dot_interaction_split(dense, sparse)
    out_split.backward(grad)
    assert torch.equal(out_split, out)
    assert torch.equal(dense.grad, x.grad[:, 0]) and torch.equal(sparse.grad, x.grad[:, 1:])


@pytest.mark.parametrize("pad", [1, 5, 8])
def test_pad_columns_are_zeros_and_get_no_gradient(pad, device, assert_close):
    """`pad` zero columns after the pairs, written by the kernel; their gradient is ignored."""
    dense, sparse = make_parts(3, 4, 16, "strided", device, seed=pad)
    dense.requires_grad_()
    sparse.requires_grad_()
    width = interaction_output_dim(5, 16)
    out = dot_interaction_split(dense, sparse, pad)
    assert out.shape == (3, width + pad)
    assert torch.equal(out[:, width:], torch.zeros(3, pad, device=device))
    assert torch.equal(out[:, :width], dot_interaction_split(dense, sparse))
    grad = make_grad(3, width + pad, "transposed", device)
    out.backward(grad)
    d64 = dense.detach().double().requires_grad_()
    s64 = sparse.detach().double().requires_grad_()
    dot_interaction_reference(torch.cat([d64.unsqueeze(1), s64], dim=1)).backward(grad[:, :width].double())
    assert_close(dense.grad, d64.grad, torch.float32, msg="grad_dense")
    assert_close(sparse.grad, s64.grad, torch.float32, msg="grad_sparse")
    with pytest.raises(ValueError, match="pad must be >= 0"):
        dot_interaction_split(dense, sparse, -1)


def test_model_with_padded_top_mlp_input_matches_eager(device, assert_close):
    """model.top_mlp_input_multiple with the Triton interaction: the kernel's zero columns give the eager
    model's (F.pad) logits and gradients, with the same parameters."""
    from dlrm.config import KernelsConfig, ModelConfig
    from dlrm.model.dlrm import PaddedInteraction, TritonDotInteractionArch, build_model

    cfg = ModelConfig(embedding_dim=16, bottom_mlp=[8, 16], top_mlp=[8, 1], top_mlp_input_multiple=8)
    cards = [5, 3, 7]
    torch.manual_seed(0)
    eager = build_model(cfg, cards, device=device)
    torch.manual_seed(0)
    fused = build_model(cfg, cards, kernels=KernelsConfig(interaction="triton"), device=device)
    assert isinstance(eager.interaction_arch, PaddedInteraction)
    assert isinstance(fused.interaction_arch, TritonDotInteractionArch) and fused.interaction_arch.pad == 2
    assert fused.interaction_arch.output_dim == eager.interaction_arch.output_dim == 16 + 6 + 2
    fused.load_state_dict(eager.state_dict())
    dense = torch.randn(3, 13, device=device)
    raw = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]], device=device)
    out_e, out_f = eager(dense, raw), fused(dense, raw)
    assert_close(out_f, out_e, torch.float32, msg="logits")
    out_e.sum().backward()
    out_f.sum().backward()
    for (k, a), (_, b) in zip(eager.named_parameters(), fused.named_parameters()):
        assert_close(b.grad.to_dense(), a.grad.to_dense(), torch.float32, msg=k)
