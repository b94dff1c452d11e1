"""The float64 reference of a chain of linear layers with ReLU, shared by the fused MLP's tests
(`test_mlp.py`, `kernels.mlp.fused_mlp`) and the on-chip tail's (`test_mlp_tail.py`, `kernels.mlp_tail.tail_mlp`).

Inputs are drawn in float64 and placed on the device in the dtype and memory layout a case asks for; the reference
runs float64 autograd on the same rounded values. Where a layer's pre-activation lies within rounding of 0, ReLU's
decision may go either way: the reference takes the kernel's decision there (`kernel_masks`, which each test derives
from the kernel's own forward), and float64's everywhere else.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch

# (atol, rtol) against float64, element by element, of results whose magnitude is O(1) (inputs N(0, 1), weights
# scaled by fan_in**-0.5 as nn.Linear's, so every layer's activations stay O(1)). "fp32": ieee fp32 products and sums
# (the CPU, or fp32_precision "ieee" on the GPU): a few ulps on sums of up to a few hundred terms, through up to 4
# layers. "tf32": operands rounded to 10 mantissa bits (rel. 2**-11 each) before fp32 sums. "bf16": bf16 operands and
# outputs (rel. step 2**-8), fp32 accumulation, each layer's output rounded to bf16 before it feeds the next.
TOLERANCES = {"fp32": (1e-5, 1e-5), "tf32": (1e-2, 1e-2), "bf16": (4e-2, 2e-2)}
DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16}
# |pre-activation| below which a kernel's ReLU decision may differ from float64's (rounding)
EDGES = {"fp32": 1e-6, "tf32": 1e-2, "bf16": 5e-2}


@contextlib.contextmanager
def matmul_precision(kind: str):
    """fp32 GEMMs (cuBLAS, and Triton's tl.dot, which follows cuBLAS's setting) in TF32 for kind "tf32", in ieee
    fp32 otherwise (restored after). Nothing on a machine without CUDA."""
    if not torch.cuda.is_available():
        yield
        return
    matmul = torch.backends.cuda.matmul
    old = matmul.fp32_precision
    matmul.fp32_precision = "tf32" if kind == "tf32" else "ieee"
    try:
        yield
    finally:
        matmul.fp32_precision = old


def make_values(shape, layout: str, gen, scale: float = 1.0) -> torch.Tensor:
    """A float64 CPU tensor [R, C] with the values of `layout` ("contiguous", "transposed", "sliced": every other
    column of a wider tensor, "expand": one row repeated); `place` rebuilds the layout on the target.

        >>> x = make_values((3, 2), "expand", torch.Generator().manual_seed(0))
        >>> bool((x == x[0]).all()), place(x, "expand", "cpu", torch.float32).stride()
        (True, (0, 1))
    """
    R, C = shape
    if layout == "contiguous":
        t = torch.randn(R, C, generator=gen, dtype=torch.float64)
    elif layout == "transposed":
        t = torch.randn(C, R, generator=gen, dtype=torch.float64).t()
    elif layout == "sliced":
        t = torch.randn(R, 2 * C + 1, generator=gen, dtype=torch.float64)[:, 1::2]
    elif layout == "expand":
        t = torch.randn(1, C, generator=gen, dtype=torch.float64).expand(R, C)
    else:
        raise ValueError(layout)
    return t * scale


def place(t: torch.Tensor, layout: str, device, dtype) -> torch.Tensor:
    """`t`'s values on `device` in `dtype`, in the memory layout named (``.to`` would make it contiguous)."""
    R, C = t.shape
    if layout == "transposed":
        out = t.t().contiguous().to(device=device, dtype=dtype).t()
    elif layout == "sliced":
        wide = torch.zeros(R, 2 * C + 1, device=device, dtype=dtype)
        wide[:, 1::2] = t.to(device=device, dtype=dtype)
        out = wide[:, 1::2]
    elif layout == "expand":
        out = t[:1].to(device=device, dtype=dtype).expand(R, C)
    else:
        out = t.to(device=device, dtype=dtype)
    assert out.is_contiguous() == (layout == "contiguous") or R <= 1 or C <= 1
    return out


def check_close(got: torch.Tensor, ref: torch.Tensor, kind: str, what: str, tol_scale: float = 1.0) -> None:
    """Element by element; atol relative to the result's RMS where that exceeds 1 (a weight or bias gradient sums
    over the batch: magnitude ~sqrt(B), and so are the rounding errors of its elements near zero)."""
    atol, rtol = TOLERANCES[kind]
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    ref = ref.detach().double().cpu()
    rms = float(ref.square().mean().sqrt()) if ref.numel() else 0.0
    torch.testing.assert_close(got.detach().double().cpu(), ref, atol=atol * tol_scale * max(1.0, rms),
                               rtol=rtol * tol_scale, msg=lambda m: f"{what}: {m}")  # fmt: skip


def chain_inputs(M: int, dims: Sequence[int], device, kind: str, x_layout: str = "contiguous",
                 grad_layout: str = "contiguous", need_x: bool = True, frozen: tuple[int, ...] = (),
                 seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """``(x [M, dims[0]], weights [dims[i+1], dims[i]], biases [dims[i+1]], output gradient [M, dims[-1]])`` for a
    case, each on `device` in `kind`'s dtype; x and the parameters require grad unless not needed / `frozen`."""
    dtype = DTYPES[kind]
    gen = torch.Generator().manual_seed(seed)
    x64 = make_values((M, dims[0]), x_layout, gen)
    w64 = [make_values((b, a), "contiguous", gen, scale=a**-0.5) for a, b in zip(dims[:-1], dims[1:])]
    b64 = [make_values((1, b), "contiguous", gen).reshape(b) for b in dims[1:]]
    g64 = make_values((M, dims[-1]), grad_layout, gen)
    x = place(x64, x_layout, device, dtype).requires_grad_(need_x)
    ws = [w.to(device=device, dtype=dtype).requires_grad_(i not in frozen) for i, w in enumerate(w64)]
    bs = [b.to(device=device, dtype=dtype).requires_grad_(i not in frozen) for i, b in enumerate(b64)]
    return x, ws, bs, place(g64, grad_layout, device, dtype)


def check_chain(out: torch.Tensor, x: torch.Tensor, ws: list[torch.Tensor], bs: list[torch.Tensor], g: torch.Tensor,
                relu: Sequence[bool], kernel_masks: Sequence[Optional[torch.Tensor]], kind: str,
                need_x: bool = True, frozen: tuple[int, ...] = (), tol_scale: float = 1.0) -> None:
    """A kernel's output `out` and the gradients its backward of `g` left on `x`, `ws` and `bs`, against float64
    autograd of the same chain on the same values. ``kernel_masks[i]`` (float64, CPU; None for a layer without
    ReLU) holds the kernel's ReLU decisions of layer i, taken where |pre-activation| < ``EDGES[kind]``."""
    dtype = DTYPES[kind]
    xd = x.detach().double().cpu().requires_grad_(True)
    wd = [w.detach().double().cpu().requires_grad_(True) for w in ws]
    bd = [b.detach().double().cpu().requires_grad_(True) for b in bs]
    h = xd
    for w, b, r, km in zip(wd, bd, relu, kernel_masks):
        pre = h @ w.t() + b
        if r:
            mask = torch.where(pre.detach().abs() < EDGES[kind], km, (pre.detach() > 0).double())
            h = pre * mask
        else:
            h = pre
    check_close(out, h, kind, "output", tol_scale)
    h.backward(g.detach().double().cpu())
    if need_x:
        check_close(x.grad, xd.grad, kind, "grad x", tol_scale)
    else:
        assert x.grad is None
    for i in range(len(ws)):
        if i in frozen:
            assert ws[i].grad is None and bs[i].grad is None, f"layer {i} is frozen"
            continue
        check_close(ws[i].grad, wd[i].grad, kind, f"grad W{i}", tol_scale)
        check_close(bs[i].grad, bd[i].grad, kind, f"grad b{i}", tol_scale)
        assert ws[i].grad.dtype == bs[i].grad.dtype == dtype
