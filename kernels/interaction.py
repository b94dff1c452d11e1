"""DLRM dot interaction: pairwise dot products of the dense vector and the embeddings, one kernel each way.

Notation: ``B`` batch, ``F`` sparse features, ``F1 = F + 1`` interacting vectors, ``D`` their dim,
``T = F1 * (F1 - 1) / 2`` pairs.

Input ``x [B, F1, D]`` (row 0 = bottom-MLP output, rows 1..F = embeddings). Output ``[B, D + T]`` =
``cat(x[:, 0, :], Z[b, i, j] for (i, j) in torch.tril_indices(F1, F1, offset=-1))`` with ``Z = x @ x^T``:
the strictly lower triangle in row-major order (1,0), (2,0), (2,1), (3,0), ..., so pair (i, j) sits at
column ``D + i * (i - 1) / 2 + j``.

Forward: each program loops over a few samples; per sample it computes ``Z`` with a ``[F1, D] x [D, F1]``
``tl.dot`` (fp32 accumulate; fp32 inputs use 3-pass TF32 on GPUs, ~fp32 accurate, and exact fp32 in the
interpreter) and scatters its lower triangle. Backward: likewise, per sample it gathers the triangle's gradient into ``G [F1, F1]`` and computes ``grad_x = (G + G^T) @ x``,
then adds the passthrough gradient to row 0. ``G + G^T`` has at most one non-zero per element (strict
triangle), so casting it to bf16 for a bf16 ``tl.dot`` is exact.

File layout: ``@triton.jit`` kernels, host launchers, ``torch.library`` custom ops
(``dlrm_kernels::dot_interaction`` and its backward) with fake and autograd registrations, then
``dot_interaction``, the plain-torch ``dot_interaction_reference`` and ``TritonDotInteraction``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor, nn

from kernels import heuristics
from kernels._backend import check_triton_device, device_context

__all__ = ["TritonDotInteraction", "dot_interaction", "dot_interaction_reference", "interaction_output_dim"]


# ----------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _dot_interaction_fwd_kernel(
    x_ptr,
    stride_xb,
    stride_xf,
    stride_xd,
    out_ptr,
    stride_ob,
    B,
    F1,
    D,
    SAMPLES: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    """SAMPLES samples per program (amortises the index math and keeps enough bytes in flight for small D)."""
    i = tl.arange(0, BLOCK_F)
    j = tl.arange(0, BLOCK_F)
    d = tl.arange(0, BLOCK_D)
    col = D + (i * (i - 1)) // 2
    for s in range(SAMPLES):
        b = tl.program_id(0).to(tl.int64) * SAMPLES + s
        # Past the batch end every mask is empty. Built from vector-vs-scalar comparisons only: the
        # interpreter mishandles `scalar_bool & vector_bool`.
        fmask = i < tl.where(b < B, F1, 0)
        dmask = d < tl.where(b < B, D, 0)
        tri = (i[:, None] > j[None, :]) & fmask[:, None]
        x_base = x_ptr + b * stride_xb
        x = tl.load(x_base + i[:, None] * stride_xf + d[None, :] * stride_xd, mask=fmask[:, None] & dmask[None, :], other=0.0)
        if x.dtype == tl.float32:
            z = tl.dot(x, tl.trans(x), input_precision=FP32_DOT)
        else:
            z = tl.dot(x, tl.trans(x))  # bf16/fp16 inputs, fp32 accumulate
        out_base = out_ptr + b * stride_ob
        # Dense passthrough: row 0 of x, copied in its own dtype.
        x0 = tl.load(x_base + d * stride_xd, mask=dmask, other=0.0)
        tl.store(out_base + d, x0, mask=dmask)
        tl.store(out_base + col[:, None] + j[None, :], z.to(out_ptr.dtype.element_ty), mask=tri)


@triton.jit
def _dot_interaction_bwd_kernel(
    grad_ptr,
    stride_gb,
    stride_gc,
    x_ptr,
    stride_xb,
    stride_xf,
    stride_xd,
    gx_ptr,
    B,
    F1,
    D,
    SAMPLES: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    i = tl.arange(0, BLOCK_F)
    j = tl.arange(0, BLOCK_F)
    d = tl.arange(0, BLOCK_D)
    col = D + (i * (i - 1)) // 2
    for s in range(SAMPLES):
        b = tl.program_id(0).to(tl.int64) * SAMPLES + s
        fmask = i < tl.where(b < B, F1, 0)  # empty past the batch end (see the forward kernel)
        dmask = d < tl.where(b < B, D, 0)
        xmask = fmask[:, None] & dmask[None, :]
        tri = (i[:, None] > j[None, :]) & fmask[:, None]
        g_base = grad_ptr + b * stride_gb
        g = tl.load(g_base + (col[:, None] + j[None, :]) * stride_gc, mask=tri, other=0.0)
        # dZ[i, j] feeds x_i (times x_j) and x_j (times x_i): symmetrise. Exact in any dtype (disjoint
        # supports), so the bf16 product below sees exactly the bf16 gradients.
        sym = g + tl.trans(g)
        x = tl.load(x_ptr + b * stride_xb + i[:, None] * stride_xf + d[None, :] * stride_xd, mask=xmask, other=0.0)
        if x.dtype == tl.float32:
            gx = tl.dot(sym.to(tl.float32), x, input_precision=FP32_DOT)
        else:
            gx = tl.dot(sym.to(x.dtype), x)
        g0 = tl.load(g_base + d * stride_gc, mask=dmask, other=0.0).to(tl.float32)
        gx += tl.where((i == 0)[:, None], g0[None, :], 0.0)
        tl.store(gx_ptr + b * F1 * D + i[:, None] * D + d[None, :], gx.to(gx_ptr.dtype.element_ty), mask=xmask)


# ----------------------------------------------------------------------------------------------------
# Host launchers
# ----------------------------------------------------------------------------------------------------


def interaction_output_dim(num_vectors: int, dim: int) -> int:
    """``D + F1 (F1 - 1) / 2`` for ``F1 = num_vectors`` interacting vectors of dim ``D``."""
    return dim + num_vectors * (num_vectors - 1) // 2


def _blocks(F1: int, D: int) -> tuple[int, int]:
    """(BLOCK_F, BLOCK_D): both are tl.dot operand dims."""
    return heuristics.dot_block(F1), heuristics.dot_block(D)


def _check_x(x: Tensor) -> None:
    if x.dim() != 3:
        raise ValueError(f"x must be [B, F + 1, D], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"x must be floating point, got {x.dtype}")
    check_triton_device(x.device, "dot interaction kernels")


def _fwd_impl(x: Tensor) -> Tensor:
    _check_x(x)
    B, F1, D = x.shape
    out = torch.empty((B, interaction_output_dim(F1, D)), dtype=x.dtype, device=x.device)
    if B == 0 or out.shape[1] == 0:
        return out
    BLOCK_F, BLOCK_D = _blocks(F1, D)
    samples, warps = heuristics.interaction_launch(BLOCK_D, x.dtype, backward=False)
    with device_context(x):
        _launch_fwd(samples, warps, x, out, B, F1, D, BLOCK_F, BLOCK_D)
    return out


def _launch_fwd(samples, warps, x, out, B, F1, D, BLOCK_F, BLOCK_D) -> None:
    _dot_interaction_fwd_kernel[(triton.cdiv(B, samples),)](
        x,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        out,
        out.stride(0),
        B,
        F1,
        D,
        SAMPLES=samples,
        BLOCK_F=BLOCK_F,
        BLOCK_D=BLOCK_D,
        FP32_DOT=heuristics.fp32_dot_precision(),
        num_warps=warps,
    )


def _bwd_impl(grad: Tensor, x: Tensor) -> Tensor:
    _check_x(x)
    B, F1, D = x.shape
    if tuple(grad.shape) != (B, interaction_output_dim(F1, D)):
        raise ValueError(f"grad must be [B, D + T] = {(B, interaction_output_dim(F1, D))}, got {tuple(grad.shape)}")
    gx = torch.empty((B, F1, D), dtype=x.dtype, device=x.device)
    if gx.numel() == 0:
        return gx
    BLOCK_F, BLOCK_D = _blocks(F1, D)
    samples, warps = heuristics.interaction_launch(BLOCK_D, x.dtype, backward=True)
    with device_context(x):
        _launch_bwd(samples, warps, grad, x, gx, B, F1, D, BLOCK_F, BLOCK_D)
    return gx


def _launch_bwd(samples, warps, grad, x, gx, B, F1, D, BLOCK_F, BLOCK_D) -> None:
    _dot_interaction_bwd_kernel[(triton.cdiv(B, samples),)](
        grad,
        grad.stride(0),
        grad.stride(1),
        x,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        gx,
        B,
        F1,
        D,
        SAMPLES=samples,
        BLOCK_F=BLOCK_F,
        BLOCK_D=BLOCK_D,
        FP32_DOT=heuristics.fp32_dot_precision(),
        num_warps=warps,
    )


# ----------------------------------------------------------------------------------------------------
# Custom ops
# ----------------------------------------------------------------------------------------------------


@torch.library.custom_op("dlrm_kernels::dot_interaction", mutates_args=())
def _dot_interaction_op(x: Tensor) -> Tensor:
    return _fwd_impl(x)


@_dot_interaction_op.register_fake
def _(x):
    B, F1, D = x.shape
    return x.new_empty((B, D + F1 * (F1 - 1) // 2))


@torch.library.custom_op("dlrm_kernels::dot_interaction_backward", mutates_args=())
def _dot_interaction_backward_op(grad: Tensor, x: Tensor) -> Tensor:
    return _bwd_impl(grad, x)


@_dot_interaction_backward_op.register_fake
def _(grad, x):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    (x,) = inputs
    ctx.save_for_backward(x)


def _backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return torch.ops.dlrm_kernels.dot_interaction_backward(grad, x)


_dot_interaction_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------------
# Python API
# ----------------------------------------------------------------------------------------------------


def dot_interaction(x: Tensor) -> Tensor:
    """``x [B, F + 1, D] -> [B, D + (F + 1) F / 2]`` (Triton; any strides; output in x's dtype).

    Example (on the CPU the kernel runs in Triton's interpreter, TRITON_INTERPRET=1):
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> x = torch.arange(24.0, device=device).reshape(2, 3, 4) / 10   # B=2, F+1=3 vectors, D=4
        >>> y = dot_interaction(x)
        >>> y.shape   # D + 3 * 2 / 2 = 4 + 3
        torch.Size([2, 7])
        >>> y[0, 4:].round(decimals=2).cpu()   # x1.x0, x2.x0, x2.x1 (the strictly lower triangle)
        tensor([0.3800, 0.6200, 2.1400])
        >>> torch.allclose(y, dot_interaction_reference(x))
        True
    """
    return torch.ops.dlrm_kernels.dot_interaction(x)


def dot_interaction_reference(x: Tensor) -> Tensor:
    """Plain-torch :func:`dot_interaction` (bmm + ``tril_indices`` gather)."""
    B, F1, D = x.shape
    z = torch.bmm(x, x.transpose(1, 2))
    li, lj = torch.tril_indices(F1, F1, offset=-1, device=x.device)
    return torch.cat([x[:, 0, :], z[:, li, lj]], dim=1)


class TritonDotInteraction(nn.Module):
    """Dot interaction (no parameters): ``forward(x [B, F + 1, D]) -> [B, D + (F + 1) F / 2]``."""

    def forward(self, x: Tensor) -> Tensor:
        return dot_interaction(x)
