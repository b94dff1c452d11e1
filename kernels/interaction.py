"""DLRM dot interaction: pairwise dot products of the dense vector and the embeddings, one kernel each way.

Notation: ``B`` batch, ``F`` sparse features, ``F1 = F + 1`` interacting vectors, ``D`` their dim,
``T = F1 * (F1 - 1) / 2`` pairs.

Input: the vectors ``x [B, F1, D]`` (row 0 = bottom-MLP output, rows 1..F = embeddings), handed to the
kernels as two tensors, ``dense [B, D]`` and ``sparse [B, F, D]``, so the model never concatenates them (a
pass over the embeddings each way: 0.30 ms a step at Terabyte's D=128, batch 65536). Output ``[B, D + T]`` =
``cat(x[:, 0, :], Z[b, i, j] for (i, j) in torch.tril_indices(F1, F1, offset=-1))`` with ``Z = x @ x^T``:
the strictly lower triangle in row-major order (1,0), (2,0), (2,1), (3,0), ..., so pair (i, j) sits at
column ``D + i * (i - 1) / 2 + j``; then ``pad`` zero columns if asked (``model.top_mlp_input_multiple``:
an aligned input for the top MLP's GEMM, without the copy a separate pad would cost).

Forward: each program loops over a few samples; per sample it loads ``x`` (row 0 from ``dense``, the rest
from ``sparse``), computes ``Z`` with a ``[F1, D] x [D, F1]`` ``tl.dot`` (fp32 accumulate; fp32 inputs use
3-pass TF32 on GPUs, ~fp32 accurate, and exact fp32 in the interpreter) and scatters its lower triangle.
Backward: likewise, per sample it gathers the triangle's gradient into ``G [F1, F1]``, computes
``grad_x = (G + G^T) @ x``, adds the passthrough gradient to row 0, and stores row 0 into ``grad_dense
[B, D]`` and the rest into ``grad_sparse [B, F, D]`` (both contiguous). ``G + G^T`` has at most one non-zero
per element (strict triangle), so casting it to bf16 for a bf16 ``tl.dot`` is exact.

File layout: ``@triton.jit`` kernels, host launchers, ``torch.library`` custom ops
(``dlrm_kernels::dot_interaction(dense, sparse, pad)`` and its backward) with fake and autograd registrations,
then ``dot_interaction_split`` (what the model calls), ``dot_interaction`` (one [B, F1, D] tensor), the
plain-torch ``dot_interaction_reference`` and ``TritonDotInteraction``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor, nn

from kernels import heuristics
from kernels._backend import check_triton_device, device_context

__all__ = ["TritonDotInteraction", "dot_interaction", "dot_interaction_reference", "dot_interaction_split",
           "interaction_output_dim"]


# ----------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _vector_ptrs(dense_base, stride_dd, sparse_base, stride_sf, stride_sd, i, d):
    """Addresses [BLOCK_F, BLOCK_D] of one sample's vectors: row 0 the dense vector, rows 1..F the embeddings.

    One tile of pointers chosen row by row, so a single load (or store) moves the whole tile: loading row 0
    apart and selecting between two tiles ran 28% slower at D=128 (bf16, H100), the loads no longer
    vectorised as one. Row 0's embedding offset is clamped so no pointer points before the embeddings.
    """
    dense_ptrs = dense_base + i[:, None] * 0 + d[None, :] * stride_dd
    sparse_ptrs = sparse_base + tl.maximum(i - 1, 0)[:, None] * stride_sf + d[None, :] * stride_sd
    return tl.where((i == 0)[:, None], dense_ptrs, sparse_ptrs)


@triton.jit
def _dot_interaction_fwd_kernel(
    dense_ptr,
    stride_db,
    stride_dd,
    sparse_ptr,
    stride_sb,
    stride_sf,
    stride_sd,
    out_ptr,
    stride_ob,
    B,
    F1,
    D,
    PAD,
    SAMPLES: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_PAD: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    """SAMPLES samples per program (amortises the index math and keeps enough bytes in flight for small D).

    The PAD columns after the pairs are written as zeros (an output row width the GEMM after it can align).
    """
    i = tl.arange(0, BLOCK_F)
    j = tl.arange(0, BLOCK_F)
    d = tl.arange(0, BLOCK_D)
    col = D + (i * (i - 1)) // 2
    p = tl.arange(0, BLOCK_PAD)
    for s in range(SAMPLES):
        b = tl.program_id(0).to(tl.int64) * SAMPLES + s
        # Past the batch end every mask is empty. Built from vector-vs-scalar comparisons only: the
        # interpreter mishandles `scalar_bool & vector_bool`.
        fmask = i < tl.where(b < B, F1, 0)
        dmask = d < tl.where(b < B, D, 0)
        tri = (i[:, None] > j[None, :]) & fmask[:, None]
        dense_base = dense_ptr + b * stride_db
        x = tl.load(_vector_ptrs(dense_base, stride_dd, sparse_ptr + b * stride_sb, stride_sf, stride_sd, i, d),
                    mask=fmask[:, None] & dmask[None, :], other=0.0)
        if x.dtype == tl.float32:
            z = tl.dot(x, tl.trans(x), input_precision=FP32_DOT)
        else:
            z = tl.dot(x, tl.trans(x))  # bf16/fp16 inputs, fp32 accumulate
        out_base = out_ptr + b * stride_ob
        # Dense passthrough, copied in its own dtype (a second read of 2 D bytes, from L1/L2).
        x0 = tl.load(dense_base + d * stride_dd, mask=dmask, other=0.0)
        tl.store(out_base + d, x0, mask=dmask)
        tl.store(out_base + col[:, None] + j[None, :], z.to(out_ptr.dtype.element_ty), mask=tri)
        pmask = p < tl.where(b < B, PAD, 0)
        tl.store(out_base + D + (F1 * (F1 - 1)) // 2 + p, tl.zeros([BLOCK_PAD], out_ptr.dtype.element_ty), mask=pmask)


@triton.jit
def _dot_interaction_bwd_kernel(
    grad_ptr,
    stride_gb,
    stride_gc,
    dense_ptr,
    stride_db,
    stride_dd,
    sparse_ptr,
    stride_sb,
    stride_sf,
    stride_sd,
    gdense_ptr,
    gsparse_ptr,
    B,
    F1,
    D,
    SAMPLES: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    """Gradients into two contiguous outputs: gdense [B, D] (row 0 plus the passthrough) and gsparse [B, F, D]."""
    i = tl.arange(0, BLOCK_F)
    j = tl.arange(0, BLOCK_F)
    d = tl.arange(0, BLOCK_D)
    col = D + (i * (i - 1)) // 2
    for s in range(SAMPLES):
        b = tl.program_id(0).to(tl.int64) * SAMPLES + s
        fmask = i < tl.where(b < B, F1, 0)  # empty past the batch end (see the forward kernel)
        dmask = d < tl.where(b < B, D, 0)
        tri = (i[:, None] > j[None, :]) & fmask[:, None]
        g_base = grad_ptr + b * stride_gb
        g = tl.load(g_base + (col[:, None] + j[None, :]) * stride_gc, mask=tri, other=0.0)
        # dZ[i, j] feeds x_i (times x_j) and x_j (times x_i): symmetrise. Exact in any dtype (disjoint
        # supports), so the bf16 product below sees exactly the bf16 gradients.
        sym = g + tl.trans(g)
        xmask = fmask[:, None] & dmask[None, :]
        x = tl.load(_vector_ptrs(dense_ptr + b * stride_db, stride_dd, sparse_ptr + b * stride_sb, stride_sf,
                                 stride_sd, i, d), mask=xmask, other=0.0)
        if x.dtype == tl.float32:
            gx = tl.dot(sym.to(tl.float32), x, input_precision=FP32_DOT)
        else:
            gx = tl.dot(sym.to(x.dtype), x)
        # in gx's dtype (fp32 for fp32 and 16-bit inputs): a float64 passthrough gradient was rounded to fp32
        g0 = tl.load(g_base + d * stride_gc, mask=dmask, other=0.0).to(gx.dtype)
        gx += tl.where((i == 0)[:, None], g0[None, :], 0.0)
        # Row 0 goes to gdense [B, D], rows 1..F to gsparse [B, F, D] (both contiguous): one store.
        g_ptrs = _vector_ptrs(gdense_ptr + b * D, 1, gsparse_ptr + b * (F1 - 1) * D, D, 1, i, d)
        tl.store(g_ptrs, gx.to(gdense_ptr.dtype.element_ty), mask=xmask)


# ----------------------------------------------------------------------------------------------------
# Host launchers
# ----------------------------------------------------------------------------------------------------


def interaction_output_dim(num_vectors: int, dim: int) -> int:
    """``D + F1 (F1 - 1) / 2`` for ``F1 = num_vectors`` interacting vectors of dim ``D``."""
    return dim + num_vectors * (num_vectors - 1) // 2


def _blocks(F1: int, D: int) -> tuple[int, int]:
    """(BLOCK_F, BLOCK_D): both are tl.dot operand dims."""
    return heuristics.dot_block(F1), heuristics.dot_block(D)


def _check_inputs(dense: Tensor, sparse: Tensor) -> tuple[int, int, int]:
    """(B, F1, D) of a dense [B, D] and sparse [B, F, D] pair, or a one-line ValueError."""
    if dense.dim() != 2 or sparse.dim() != 3:
        raise ValueError(f"dense must be [B, D] and sparse [B, F, D], got shapes {tuple(dense.shape)} and "
                         f"{tuple(sparse.shape)}")
    B, D = dense.shape
    if sparse.shape[0] != B or sparse.shape[2] != D:
        raise ValueError(f"sparse must be [B, F, D] = [{B}, F, {D}] to match dense, got {tuple(sparse.shape)}")
    if not dense.is_floating_point() or dense.dtype != sparse.dtype:
        raise ValueError(f"dense and sparse must share one floating dtype, got {dense.dtype} and {sparse.dtype}")
    if dense.device != sparse.device:
        raise ValueError(f"dense and sparse must be on one device, got {dense.device} and {sparse.device}")
    check_triton_device(dense.device, "dot interaction kernels")
    return B, sparse.shape[1] + 1, D


def _input_args(dense: Tensor, sparse: Tensor) -> tuple:
    return (dense, dense.stride(0), dense.stride(1), sparse, sparse.stride(0), sparse.stride(1), sparse.stride(2))


def _fwd_impl(dense: Tensor, sparse: Tensor, pad: int = 0) -> Tensor:
    B, F1, D = _check_inputs(dense, sparse)
    if pad < 0:
        raise ValueError(f"pad must be >= 0 (zero columns after the pairs), got {pad}")
    out = torch.empty((B, interaction_output_dim(F1, D) + pad), dtype=dense.dtype, device=dense.device)
    if B == 0 or out.shape[1] == 0:
        return out
    BLOCK_F, BLOCK_D = _blocks(F1, D)
    samples, warps = heuristics.interaction_launch(BLOCK_D, dense.dtype, backward=False)
    with device_context(dense):
        _dot_interaction_fwd_kernel[(triton.cdiv(B, samples),)](
            *_input_args(dense, sparse), out, out.stride(0), B, F1, D, pad, SAMPLES=samples, BLOCK_F=BLOCK_F,
            BLOCK_D=BLOCK_D, BLOCK_PAD=triton.next_power_of_2(max(pad, 1)), FP32_DOT=heuristics.fp32_dot_precision(),
            num_warps=warps)
    return out


def _bwd_impl(grad: Tensor, dense: Tensor, sparse: Tensor, pad: int = 0) -> tuple[Tensor, Tensor]:
    """The pad columns' gradient is ignored (they are constants)."""
    B, F1, D = _check_inputs(dense, sparse)
    cols = interaction_output_dim(F1, D) + pad
    if tuple(grad.shape) != (B, cols):
        raise ValueError(f"grad must be [B, D + T + pad] = {(B, cols)}, got {tuple(grad.shape)}")
    gdense = torch.empty((B, D), dtype=dense.dtype, device=dense.device)
    gsparse = torch.empty((B, F1 - 1, D), dtype=dense.dtype, device=dense.device)
    if gdense.numel() == 0:
        return gdense, gsparse
    BLOCK_F, BLOCK_D = _blocks(F1, D)
    samples, warps = heuristics.interaction_launch(BLOCK_D, dense.dtype, backward=True)
    with device_context(dense):
        _dot_interaction_bwd_kernel[(triton.cdiv(B, samples),)](
            grad, grad.stride(0), grad.stride(1), *_input_args(dense, sparse), gdense, gsparse, B, F1, D,
            SAMPLES=samples, BLOCK_F=BLOCK_F, BLOCK_D=BLOCK_D, FP32_DOT=heuristics.fp32_dot_precision(),
            num_warps=warps)
    return gdense, gsparse


# ----------------------------------------------------------------------------------------------------
# Custom ops
# ----------------------------------------------------------------------------------------------------


@torch.library.custom_op("dlrm_kernels::dot_interaction", mutates_args=())
def _dot_interaction_op(dense: Tensor, sparse: Tensor, pad: int = 0) -> Tensor:
    return _fwd_impl(dense, sparse, pad)


@_dot_interaction_op.register_fake
def _(dense, sparse, pad=0):
    B, D = dense.shape
    F1 = sparse.shape[1] + 1
    return dense.new_empty((B, D + F1 * (F1 - 1) // 2 + pad))


@torch.library.custom_op("dlrm_kernels::dot_interaction_backward", mutates_args=())
def _dot_interaction_backward_op(grad: Tensor, dense: Tensor, sparse: Tensor, pad: int = 0) -> tuple[Tensor, Tensor]:
    return _bwd_impl(grad, dense, sparse, pad)


@_dot_interaction_backward_op.register_fake
def _(grad, dense, sparse, pad=0):
    return (torch.empty_like(dense, memory_format=torch.contiguous_format),
            torch.empty_like(sparse, memory_format=torch.contiguous_format))


def _setup_context(ctx, inputs, output):
    dense, sparse, pad = inputs
    ctx.save_for_backward(dense, sparse)
    ctx.pad = pad


def _backward(ctx, grad):
    dense, sparse = ctx.saved_tensors
    gdense, gsparse = torch.ops.dlrm_kernels.dot_interaction_backward(grad, dense, sparse, ctx.pad)
    return gdense, gsparse, None


_dot_interaction_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------------
# Python API
# ----------------------------------------------------------------------------------------------------


def dot_interaction_split(dense: Tensor, sparse: Tensor, pad: int = 0) -> Tensor:
    """``dense [B, D], sparse [B, F, D] -> [B, D + (F + 1) F / 2 + pad]``: the interaction of the dense vector
    and the embeddings without concatenating them first (Triton; any strides; one dtype, kept), followed
    by `pad` zero columns (``model.top_mlp_input_multiple``: written by the kernel, no copy).

    What the model calls: the [B, F + 1, D] concatenation would cost a pass over the embeddings each
    way (0.30 ms a step at Terabyte's D=128, batch 65536), and the backward hands the embeddings their
    gradient contiguous.

    Example (on the CPU the kernel runs in Triton's interpreter, TRITON_INTERPRET=1):
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> x = torch.arange(24.0, device=device).reshape(2, 3, 4) / 10   # B=2, F+1=3 vectors, D=4
        >>> torch.equal(dot_interaction_split(x[:, 0], x[:, 1:]), dot_interaction(x))
        True
    """
    return torch.ops.dlrm_kernels.dot_interaction(dense, sparse, pad)


def dot_interaction(x: Tensor, pad: int = 0) -> Tensor:
    """``x [B, F + 1, D] -> [B, D + (F + 1) F / 2 + pad]`` (Triton; any strides; output in x's dtype; `pad` zero
    columns after the pairs, as :func:`dot_interaction_split`).

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
    if x.dim() != 3:
        raise ValueError(f"x must be [B, F + 1, D], got shape {tuple(x.shape)}")
    if x.shape[1] == 0:
        raise ValueError(f"x must hold at least the dense vector (F + 1 >= 1), got shape {tuple(x.shape)}")
    return dot_interaction_split(x[:, 0], x[:, 1:], pad)


def dot_interaction_reference(x: Tensor) -> Tensor:
    """Plain-torch :func:`dot_interaction` (bmm + ``tril_indices`` gather)."""
    B, F1, D = x.shape
    z = torch.bmm(x, x.transpose(1, 2))
    li, lj = torch.tril_indices(F1, F1, offset=-1, device=x.device)
    return torch.cat([x[:, 0, :], z[:, li, lj]], dim=1)


class TritonDotInteraction(nn.Module):
    """Dot interaction on the fused kernels (:func:`dot_interaction`); no parameters, no constructor arguments.

    ``forward(x [B, F + 1, D], pad=0)``: the first vector (the bottom MLP's output) followed by the strictly
    lower triangle of the pairwise dot products, followed by `pad` zero columns.
    ``forward(dense [B, D], sparse [B, F, D], pad=0)`` computes the same from the two parts, without
    concatenating them (:func:`dot_interaction_split`).

    Example:
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> op = TritonDotInteraction()
        >>> x = torch.arange(24.0, device=device).reshape(2, 3, 4) % 5   # B=2, F+1=3 vectors, D=4
        >>> op(x).shape
        torch.Size([2, 7])
        >>> torch.equal(op(x[:, 0], x[:, 1:], 2), torch.nn.functional.pad(op(x), (0, 2)))
        True

    Shapes: [B, F + 1, D] -> [B, D + (F + 1) F / 2 + pad]; [B, D], [B, F, D] -> [B, D + (F + 1) F / 2 + pad].
    """

    def forward(self, x: Tensor, sparse: Tensor | None = None, pad: int = 0) -> Tensor:
        # pad goes to both forms (the one-tensor form dropped it: fewer columns than asked, no error)
        return dot_interaction(x, pad) if sparse is None else dot_interaction_split(x, sparse, pad)
