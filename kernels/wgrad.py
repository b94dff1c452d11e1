"""A linear layer's weight gradient with its bias gradient and ReLU mask fused: one Triton GEMM.

For ``y = act(x @ W^T + b)`` with act ReLU or none, given ``g = dL/dy`` [B, N_out] and x [B, N_in]:

    gm = g * (y > 0)  (ReLU; gm = g otherwise)
    dW = gm^T @ x     [N_out, N_in]
    db = gm.sum(0)    [N_out]

Why a kernel of its own: in the compiled training step (Inductor, max-autotune) the GEMMs run as
Inductor templates or cuBLAS, but the bias gradients run as separate column-sum passes over gm, and
where a ReLU's masked gradient feeds only the weight gradient (the first bottom layer, whose input
needs no gradient) the mask runs as a separate pass that writes gm for cuBLAS to read back. Those
passes were ~0.2 ms of the Kaggle bf16 step at batch 65536 and ~0.35 ms of Terabyte's
(`benchmarks/PERF.md`, eleventh run). Here the batch-reduction GEMM loads g (and y when masking)
tile by tile, masks the tile, and feeds it to two tensor-core products: ``gm^T x`` and ``gm^T e0``
(a one-hot column: the column sums). gm is never written, and db costs no pass of its own.

Measured on an H100, bf16, batch 65536 (`benchmarks/results/wgrad_fused_bias_mask.md`): the masked
first layer 0.075 ms against 0.165 for cuBLAS + Inductor's passes, the 256x512 layers 0.053 against
0.058; the training step +8.6% (Kaggle, +5.1% with max-autotune) and +2.5% (Terabyte). Where PyTorch
stays faster (the last layer, weights of >= 400k elements, fp32), `LinearReLUWgrad` keeps its backward.

The reduction runs over the batch (B = 65536 at the targets) into a small output, so it is split
along the batch to give every SM work: program (tile, s) sums rows [s R, (s + 1) R) into an fp32
workspace [S, N_out * N_in + N_out] (weight partials, then bias partials), and one small kernel sums
the S slices in a fixed order (deterministic) into dW and db in the parameters' dtypes. Unsplit,
the GEMM writes dW and db directly.

Masked layers on Hopper load g, y (and x where its rows allow) by TMA tensor descriptors
(`_wgrad_tma_kernel`): 26% faster on the 512x13 first layer, which reads g and y at 2.45 TB/s instead of 1.8
(see ``TMA_OPERANDS``).

Operand precision: 16-bit inputs run 16-bit tensor-core products accumulated in fp32; fp32 inputs
take ``input_precision`` (tf32 or ieee, as `kernels.linear` decides from torch's cuBLAS setting).

`LinearReLUWgrad` (below the launchers) is ``nn.Linear`` + optional ReLU whose forward is plain
PyTorch (so Inductor still fuses bias + ReLU into its forward GEMM templates) and whose backward
computes the input gradient with PyTorch (``gm @ W``) and dW, db with this kernel.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor, nn

from kernels import heuristics
from kernels._backend import (GEMM_DTYPES, INT32_OFFSET_LIMIT, check_gemm_dtype, check_triton_device, device_context,
                              interpret_mode, needs_int64_offsets)

_INTERPRET = interpret_mode()


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _wgrad_kernel(
    g_ptr,
    y_ptr,
    x_ptr,
    w_out_ptr,
    b_out_ptr,
    B,
    M,
    N,
    stride_gb,
    stride_gm,
    stride_yb,
    stride_ym,
    stride_xb,
    stride_xn,
    stride_split,
    ROWS_PER_SPLIT,
    MASK: tl.constexpr,
    SUM_BY_DOT: tl.constexpr,
    EVEN: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    INT64_OFFSETS: tl.constexpr = False,
):
    """w_out[m, n] = sum_b gm[b, m] x[b, n]; b_out[m] = sum_b gm[b, m] (written by the pid_n == 0 tiles).

    g, y: [B, M]; x: [B, N]; any strides. gm = g where y > 0 else 0 (MASK), else g. EVEN: every tile
    and batch slice is full (no load masks). SUM_BY_DOT (16-bit
    operands): the column sums as one more tensor-core product, gm^T @ e0; summing the tile in registers
    instead made the unmasked GEMM 2-4x slower on an H100 (the tile left the shared-memory operand path;
    results/wgrad_diag_column_sums.log). With tf32 products the sums run in registers: a tf32 product would
    round gm. Program (tile, s)
    sums rows [s * ROWS_PER_SPLIT, (s + 1) * ROWS_PER_SPLIT) and writes at ``+ s * stride_split``
    (workspace rows: weight partials at [0, M * N), bias partials at [M * N, M * N + M)); unsplit,
    w_out / b_out are the outputs. INT64_OFFSETS: 64-bit offsets (an operand reaches 2^31 elements: g [B, M] at
    B * M >= 2^31, `kernels._backend.needs_int64_offsets`); the workspace's ``pid_s * stride_split`` stays below
    2^31 (`linear_wgrad` caps the slices).
    """
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    pid_s = tl.program_id(1)
    if INT64_OFFSETS:  # batch rows, columns and the loop's pointer steps in 64 bits
        pid_m = pid_m.to(tl.int64)
        pid_n = pid_n.to(tl.int64)
        stride_gb = tl.cast(stride_gb, tl.int64)
        stride_yb = tl.cast(stride_yb, tl.int64)
        stride_xb = tl.cast(stride_xb, tl.int64)
    b_start = pid_s * ROWS_PER_SPLIT
    b_len = tl.minimum(B - b_start, ROWS_PER_SPLIT)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rb = tl.arange(0, BLOCK_B)
    m_ok = rm[None, :] < M
    n_ok = rn[None, :] < N
    g_ptrs = g_ptr + (b_start + rb)[:, None] * stride_gb + rm[None, :] * stride_gm  # [BLOCK_B, BLOCK_M]
    y_ptrs = y_ptr + (b_start + rb)[:, None] * stride_yb + rm[None, :] * stride_ym
    x_ptrs = x_ptr + (b_start + rb)[:, None] * stride_xb + rn[None, :] * stride_xn  # [BLOCK_B, BLOCK_N]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    col = tl.zeros((BLOCK_M,), dtype=tl.float32)
    col_acc = tl.zeros((BLOCK_M, 16), dtype=tl.float32)
    # [BLOCK_B, 16], 1 in column 0: gm^T @ e0 is the column sum, exact for 16-bit gm (exact products, fp32 sums)
    e0 = tl.where(tl.arange(0, 16)[None, :] == 0, 1.0, 0.0).to(g_ptr.dtype.element_ty)
    e0 = e0 + tl.zeros((BLOCK_B, 16), g_ptr.dtype.element_ty)
    for bt in range(0, tl.cdiv(b_len, BLOCK_B)):
        if EVEN:  # every tile and slice full: unmasked loads
            g = tl.load(g_ptrs)
            if MASK:
                y = tl.load(y_ptrs)
                g = tl.where(y > 0, g, tl.zeros_like(g))
            x = tl.load(x_ptrs)
        else:
            b_ok = rb[:, None] < b_len - bt * BLOCK_B
            g = tl.load(g_ptrs, mask=b_ok & m_ok, other=0.0)
            if MASK:
                y = tl.load(y_ptrs, mask=b_ok & m_ok, other=0.0)
                g = tl.where(y > 0, g, tl.zeros_like(g))
            x = tl.load(x_ptrs, mask=b_ok & n_ok, other=0.0)
        acc = tl.dot(tl.trans(g), x, acc, input_precision=INPUT_PRECISION)
        if SUM_BY_DOT:
            col_acc = tl.dot(tl.trans(g), e0, col_acc, input_precision=INPUT_PRECISION)
        else:
            col += tl.sum(g.to(tl.float32), axis=0)
        g_ptrs += BLOCK_B * stride_gb
        if MASK:
            y_ptrs += BLOCK_B * stride_yb
        x_ptrs += BLOCK_B * stride_xb
    if SUM_BY_DOT:
        col = tl.sum(col_acc, axis=1)  # column 0 plus exact zeros

    split_off = pid_s * stride_split
    w_offs = split_off + rm[:, None] * N + rn[None, :]
    tl.store(w_out_ptr + w_offs, acc.to(w_out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & n_ok)
    if pid_n == 0:
        tl.store(b_out_ptr + split_off + rm, col.to(b_out_ptr.dtype.element_ty), mask=rm < M)


@triton.jit
def _split_sum_kernel(ws_ptr, w_out_ptr, b_out_ptr, S, MN, M, stride_split, BLOCK: tl.constexpr, BLOCK_S: tl.constexpr):
    """Sum the S slices of the workspace in a fixed order (deterministic): [0, MN) into w_out, [MN, MN + M)
    into b_out. BLOCK_S slices are loaded at once: a loop of one load per slice was bound by load latency
    (0.014 ms for 64 slices of a 16 x 64 output)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN + M
    rs = tl.arange(0, BLOCK_S)
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for s0 in range(0, tl.cdiv(S, BLOCK_S)):
        s = s0 * BLOCK_S + rs
        part = tl.load(ws_ptr + s[:, None] * stride_split + offs[None, :], mask=(s[:, None] < S) & ok[None, :],
                       other=0.0)
        total += tl.sum(part, axis=0)
    tl.store(w_out_ptr + offs, total.to(w_out_ptr.dtype.element_ty), mask=offs < MN)
    tl.store(b_out_ptr + (offs - MN), total.to(b_out_ptr.dtype.element_ty), mask=(offs >= MN) & ok)


@triton.jit
def _wgrad_tma_kernel(
    g_desc, y_desc, x_desc, x_ptr, stride_xb, stride_xn, w_out_ptr, b_out_ptr, B, M, N, stride_split, ROWS_PER_SPLIT,
    MASK: tl.constexpr, X_TMA: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """`_wgrad_kernel`'s product (column sums by dot) with g and y, and x where its rows allow (X_TMA), loaded
    by TMA tensor descriptors; x otherwise by masked pointer loads. TMA fills rows past B with zeros, which
    add nothing; a slice's rows are a multiple of BLOCK_B, so no step reads into the next slice."""
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    om = (pid // num_pid_n) * BLOCK_M
    on = (pid % num_pid_n) * BLOCK_N
    pid_s = tl.program_id(1)
    b_start = pid_s * ROWS_PER_SPLIT
    b_len = tl.minimum(B - b_start, ROWS_PER_SPLIT)
    rn = on + tl.arange(0, BLOCK_N)
    rb = tl.arange(0, BLOCK_B)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    col_acc = tl.zeros((BLOCK_M, 16), dtype=tl.float32)
    e0 = tl.where(tl.arange(0, 16)[None, :] == 0, 1.0, 0.0).to(g_desc.dtype) + tl.zeros((BLOCK_B, 16), g_desc.dtype)
    for bt in range(0, tl.cdiv(b_len, BLOCK_B)):
        b0 = b_start + bt * BLOCK_B
        g = g_desc.load([b0, om])
        if MASK:
            y = y_desc.load([b0, om])
            g = tl.where(y > 0, g, tl.zeros_like(g))
        if X_TMA:
            x = x_desc.load([b0, on])
        else:
            x = tl.load(x_ptr + (b0 + rb)[:, None].to(tl.int64) * stride_xb + rn[None, :] * stride_xn,
                        mask=((b0 + rb) < B)[:, None] & (rn < N)[None, :], other=0.0)
        acc = tl.dot(tl.trans(g), x, acc, input_precision=INPUT_PRECISION)
        col_acc = tl.dot(tl.trans(g), e0, col_acc, input_precision=INPUT_PRECISION)
    col = tl.sum(col_acc, axis=1)
    rm = om + tl.arange(0, BLOCK_M)
    off = pid_s * stride_split
    tl.store(w_out_ptr + off + rm[:, None] * N + rn[None, :], acc.to(w_out_ptr.dtype.element_ty),
             mask=(rm < M)[:, None] & (rn < N)[None, :])
    if on == 0:
        tl.store(b_out_ptr + off + rm, col.to(b_out_ptr.dtype.element_ty), mask=rm < M)


# ----------------------------------------------------------------------------------------------
# Host launcher
# ----------------------------------------------------------------------------------------------

# The masked layer's operands by TMA (`_wgrad_tma_kernel`). Measured on an H100, bf16, batch 65536, the tiles and
# splits `pick_wgrad_launch` picks (2026-11-25, results/wgrad_tma_probe.md): the masked first layer (512x13) took
# 0.0555 ms with 3 stages against 0.0748 for pointer loads (26% less: it reads g and y, 134 MB, at 2.45 TB/s
# instead of 1.8); the unmasked layers gained 0-4% (top.0, 512x368; bottom.3, 16x64: 10% of 0.012 ms) or lost up
# to 5% (bottom.2), so only masked layers take it. None: that rule (16-bit operands whose layout TMA accepts, on
# a GPU of compute capability >= 9); True / False force it on for every layer whose layout allows it, or off
# (tests run it under the interpreter; benchmarks/wgrad_tma_probe.py compares the two).
TMA_OPERANDS: Optional[bool] = None
TMA_STAGES = 3


def _tma_layout_ok(t: Tensor) -> bool:
    """TMA's rules for a 2-D operand: unit column stride, a row stride of a positive multiple of 16 bytes, a
    16-byte aligned base (an expanded or transposed view takes the pointer kernel)."""
    return (t.dim() == 2 and t.stride(1) == 1 and t.stride(0) > 0 and (t.stride(0) * t.element_size()) % 16 == 0
            and t.data_ptr() % 16 == 0)


def _use_tma(grad: Tensor, x: Tensor, out: Optional[Tensor], sum_by_dot: bool) -> bool:
    if not sum_by_dot or not _tma_layout_ok(grad) or (out is not None and not _tma_layout_ok(out)):
        return False
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:  # a Triton without host-side tensor descriptors
        return False
    if TMA_OPERANDS is not None:
        return TMA_OPERANDS
    return (out is not None and not _INTERPRET and grad.is_cuda and grad.dtype in (torch.bfloat16, torch.float16)
            and torch.cuda.get_device_capability(grad.device)[0] >= 9)


def _check_operands(grad: Tensor, x: Tensor, out: Optional[Tensor]) -> None:
    if grad.dim() != 2 or x.dim() != 2 or grad.shape[0] != x.shape[0]:
        raise ValueError(f"wgrad: grad [B, N_out] and x [B, N_in] must share B, got {tuple(grad.shape)} and "
                         f"{tuple(x.shape)}")
    if out is not None and out.shape != grad.shape:
        raise ValueError(f"wgrad: the layer output {tuple(out.shape)} must have grad's shape {tuple(grad.shape)}")
    if grad.dtype != x.dtype:
        raise ValueError(f"wgrad: grad ({grad.dtype}) and x ({x.dtype}) must have one dtype")
    if x.device != grad.device or (out is not None and out.device != grad.device):
        raise ValueError("wgrad: all operands must be on the same device")
    check_gemm_dtype(grad.dtype, "wgrad: the weight-gradient kernel's GEMMs")  # float64: a garbage dW, no error
    check_triton_device(grad.device, "the weight-gradient kernel")


def linear_wgrad(
    grad: Tensor,
    x: Tensor,
    out: Optional[Tensor] = None,
    *,
    weight_dtype: Optional[torch.dtype] = None,
    bias_dtype: Optional[torch.dtype] = None,
    input_precision: str = "ieee",
    splits: Optional[int] = None,
) -> tuple[Tensor, Tensor]:
    """``(dW [N_out, N_in], db [N_out])`` of ``y = act(x @ W^T + b)`` from ``grad = dL/dy`` [B, N_out].

    out: the layer's ReLU output y (the mask is ``y > 0``), or None for no activation.
    weight_dtype / bias_dtype: the gradients' dtypes (default grad's); sums are fp32 either way.
    splits: slices of the batch (None: `heuristics.pick_wgrad_launch` picks them from the shape).
    input_precision: "ieee" or "tf32", the dots' precision for fp32 operands on the GPU (16-bit operands and
    the interpreter use "ieee"); anything else is a ValueError.

    Example (on CUDA, or on the CPU under ``TRITON_INTERPRET=1`` as the tests run it):
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> g, x = torch.randn(127, 5, device=device), torch.randn(127, 3, device=device)
        >>> dw, db = linear_wgrad(g, x)
        >>> dw.shape, db.shape
        (torch.Size([5, 3]), torch.Size([5]))
        >>> bool(torch.allclose(dw, g.t() @ x, atol=1e-4) and torch.allclose(db, g.sum(0), atol=1e-4))
        True
    """
    _check_operands(grad, x, out)
    if input_precision not in ("ieee", "tf32"):  # on every device and dtype, as kernels.linear
        raise ValueError(f"wgrad: input_precision must be 'ieee' or 'tf32', got {input_precision!r}")
    B, M = grad.shape
    N = x.shape[1]
    dw = torch.empty((M, N), device=grad.device, dtype=weight_dtype or grad.dtype)
    db = torch.empty((M,), device=grad.device, dtype=bias_dtype or grad.dtype)
    if M == 0:
        return dw, db
    if B == 0 or N == 0:
        dw.zero_()
        db.copy_(_masked(grad, out).float().sum(0))
        return dw, db
    prec = input_precision if grad.dtype == torch.float32 and not _INTERPRET else "ieee"
    # the column sums as a product unless that product would run in tf32 (asked for tf32: also under the
    # interpreter, which then runs the register sums in ieee, so both paths are tested on the CPU)
    sum_by_dot = grad.dtype != torch.float32 or input_precision != "tf32"
    launch = heuristics.pick_wgrad_launch(B, M, N, grad.dtype, heuristics.sm_count(grad.device), _INTERPRET,
                                          masked=out is not None)
    tiles = triton.cdiv(M, launch.block_m) * triton.cdiv(N, launch.block_n)
    slices, rows = _plan_slices(B, M, N, launch.block_b, splits if splits is not None else launch.splits)
    y = out if out is not None else grad
    if slices == 1:
        w_target, b_target, stride_split = dw, db, 0
    else:
        ws = torch.empty((slices, M * N + M), device=grad.device, dtype=torch.float32)
        w_target, b_target, stride_split = ws, ws[:, M * N:], ws.stride(0)
    with device_context(grad):
        if _use_tma(grad, x, out, sum_by_dot):
            _launch_tma(grad, x, out, w_target, b_target, stride_split, rows, slices, tiles, launch, prec)
        else:
            _wgrad_kernel[(tiles, slices)](
                grad, y, x, w_target, b_target,
                B, M, N,
                grad.stride(0), grad.stride(1), y.stride(0), y.stride(1), x.stride(0), x.stride(1),
                stride_split, rows,
                MASK=out is not None, SUM_BY_DOT=sum_by_dot, INPUT_PRECISION=prec,
                EVEN=B % rows == 0 and M % launch.block_m == 0 and N % launch.block_n == 0,
                BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_B=launch.block_b,
                INT64_OFFSETS=needs_int64_offsets(grad, y, x, w_target, b_target),
                num_warps=launch.num_warps, num_stages=launch.num_stages,
            )
        if slices > 1:
            block, block_s = 128, min(32, triton.next_power_of_2(slices))
            _split_sum_kernel[(triton.cdiv(M * N + M, block),)](ws, dw, db, slices, M * N, M, ws.stride(0), BLOCK=block,
                                                                BLOCK_S=block_s)
    return dw, db


def _plan_slices(B: int, M: int, N: int, block_b: int, slices: int) -> tuple[int, int]:
    """``(slices, rows a slice)`` of the batch for about ``slices`` slices: whole ``block_b`` steps a slice, none
    empty. The fp32 workspace [slices, M * N + M] stays below 2^31 elements, so that its 32-bit offsets (the
    kernels' ``pid_s * stride_split``, `_split_sum_kernel`'s) cannot wrap (the heuristic's slices are far below
    that; only a huge `splits` is cut).

    >>> _plan_slices(1000, 16, 8, 32, 4)
    (4, 256)
    """
    slices = min(slices, max(1, INT32_OFFSET_LIMIT // (M * N + M)))
    rows = triton.cdiv(triton.cdiv(B, max(1, slices)), block_b) * block_b
    return triton.cdiv(B, rows), rows


def _launch_tma(grad, x, out, w_target, b_target, stride_split, rows, slices, tiles, launch, prec) -> None:
    """`_wgrad_tma_kernel` on the launch `pick_wgrad_launch` gave, at TMA_STAGES pipeline stages (a forced launch,
    ``heuristics.WGRAD_LAUNCH_OVERRIDE``, brings its own)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bb, bm, bn = launch.block_b, launch.block_m, launch.block_n
    x_tma = _tma_layout_ok(x)
    g_desc = TensorDescriptor.from_tensor(grad, [bb, bm])
    y_desc = TensorDescriptor.from_tensor(out, [bb, bm]) if out is not None else g_desc  # unused without a mask
    x_desc = TensorDescriptor.from_tensor(x, [bb, bn]) if x_tma else g_desc  # unused without X_TMA
    _wgrad_tma_kernel[(tiles, slices)](
        g_desc, y_desc, x_desc, x, x.stride(0), x.stride(1), w_target, b_target,
        grad.shape[0], grad.shape[1], x.shape[1],
        stride_split, rows, MASK=out is not None, X_TMA=x_tma, INPUT_PRECISION=prec, BLOCK_M=bm, BLOCK_N=bn, BLOCK_B=bb,
        num_warps=launch.num_warps,
        num_stages=TMA_STAGES if heuristics.WGRAD_LAUNCH_OVERRIDE is None else launch.num_stages,
    )


def _masked(grad: Tensor, out: Optional[Tensor]) -> Tensor:
    return grad if out is None else torch.where(out > 0, grad, torch.zeros_like(grad))


# ----------------------------------------------------------------------------------------------
# Custom op
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("dlrm_kernels::linear_wgrad", mutates_args=())
def _linear_wgrad_op(
    grad: Tensor, x: Tensor, out: Optional[Tensor], weight_dtype: torch.dtype, bias_dtype: torch.dtype,
    input_precision: str,
) -> tuple[Tensor, Tensor]:
    return linear_wgrad(grad, x, out, weight_dtype=weight_dtype, bias_dtype=bias_dtype, input_precision=input_precision)


@_linear_wgrad_op.register_fake
def _(grad, x, out, weight_dtype, bias_dtype, input_precision):
    m = grad.shape[1]
    return grad.new_empty((m, x.shape[1]), dtype=weight_dtype), grad.new_empty((m,), dtype=bias_dtype)


# ----------------------------------------------------------------------------------------------
# autograd.Function, thin function and module
# ----------------------------------------------------------------------------------------------


class _LinearActWgrad(torch.autograd.Function):
    """``act(F.linear(x, W, b))`` (act ReLU or none) with the weight and bias gradients from `linear_wgrad`.

    The forward is ordinary PyTorch, traced by torch.compile like ``nn.Linear`` (Inductor keeps fusing
    bias + ReLU into its GEMM templates; under autocast F.linear runs in the autocast dtype). The
    backward computes ``gm @ W`` with PyTorch when x needs a gradient (gm then exists anyway, and the
    wgrad kernel reads it); otherwise the kernel reads g and the output and masks on the fly, so gm
    is never written (the first bottom layer, whose input is the data).
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor], relu: bool, input_precision: str) -> Tensor:
        y = F.linear(x, weight, bias)
        if relu:
            y = torch.relu(y)
        ctx.relu, ctx.input_precision = relu, input_precision
        ctx.bias_dtype = bias.dtype if bias is not None else weight.dtype
        ctx.save_for_backward(x, weight, y)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight, y = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dt = y.dtype  # the compute dtype: the autocast dtype under autocast, else the parameters'
        grad = grad.to(dt)
        gx = gw = gb = None
        wgrad_in, mask = grad, (y if ctx.relu else None)
        if need_x:
            if ctx.relu:
                wgrad_in, mask = torch.where(y > 0, grad, torch.zeros_like(grad)), None
            gx = (wgrad_in @ weight.to(dt)).to(x.dtype)
        if need_w or need_b:
            x2 = x.reshape(-1, x.shape[-1]).to(dt)
            gw, gb = _linear_wgrad_op(
                wgrad_in.reshape(-1, wgrad_in.shape[-1]), x2,
                mask.reshape(-1, mask.shape[-1]) if mask is not None else None,
                weight.dtype, ctx.bias_dtype, ctx.input_precision,
            )
        return gx, (gw if need_w else None), (gb if need_b else None), None, None


def linear_act_wgrad(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, relu: bool = False,
                     allow_tf32: Optional[bool] = None) -> Tensor:
    """``relu?(x @ weight^T + bias)`` for x [..., N_in], weight [N_out, N_in], bias [N_out] or None; returns
    [..., N_out] like ``nn.Linear`` (the autocast dtype under autocast). Its backward computes dW and db
    with `linear_wgrad` (bias gradient and ReLU mask fused into the weight-gradient GEMM)."""
    from kernels.linear import resolve_input_precision

    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x [..., {x.shape[-1]}] does not match weight {tuple(weight.shape)} ([N_out, N_in])")
    dtype = _compute_dtype(x, weight)
    # float64 (an nn.Linear that .double() reached) keeps PyTorch's backward: the kernel's GEMM cannot run it
    unsupported = dtype not in GEMM_DTYPES or (dtype == torch.float32 and not FP32_KERNEL)
    if weight.shape[0] < MIN_OUT_FEATURES or weight.numel() >= MAX_WEIGHT_NUMEL or unsupported:
        y = F.linear(x, weight, bias)
        return torch.relu(y) if relu else y
    return _LinearActWgrad.apply(x, weight, bias, relu, resolve_input_precision(x, allow_tf32))


# Where PyTorch's backward stays (bf16, batch 65536, on an H100; results/wgrad.md):
# * fewer outputs than MIN_OUT_FEATURES: the last top layer (N_out = 1) took 0.017 ms in this kernel against
#   0.016 ms compiled by Inductor, which in the training step also fuses it with the loss's backward;
# * weights of MAX_WEIGHT_NUMEL or more: the Terabyte top layers (1024x480, 1024x1024, 512x1024) took 0.18,
#   0.33 and 0.18 ms against 0.15 for cuBLAS's GEMM plus Inductor's column sums (1024x480) and 0.27, 0.18 for
#   the eager GEMM, sum and casts (the compiled rows of the two others ran eagerly: Dynamo's recompile limit;
#   cuBLAS's GEMM alone took 0.18 and 0.10, results/wgrad_diag_launches.log): cuBLAS runs these
#   GEMMs unsplit at ~800 TFLOP/s, and the batch split needs an fp32 partial of the whole weight per slice.
# * fp32 compute (tf32 runs without autocast): the Kaggle step at batch 65536 ran at 15.6M samples/s with this
#   kernel against 23.2M with PyTorch's (results/train_kaggle_tf32_wgrad_kernel_twelfth.md): fp32 tiles take 32
#   rows a step, and the column sums run in registers (a tf32 product would round them), which made the GEMM
#   2-4x slower in bf16 too. FP32_KERNEL (tests, and anyone measuring) routes fp32 layers through the kernel.
MIN_OUT_FEATURES = 16
MAX_WEIGHT_NUMEL = 400_000
FP32_KERNEL = False


def _compute_dtype(x: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype F.linear computes in: the autocast dtype under autocast, else the operands' common dtype."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return torch.promote_types(x.dtype, weight.dtype)


class LinearReLUWgrad(nn.Linear):
    """``nn.Linear`` (+ ReLU when ``activation="relu"``) whose weight and bias gradients come from the fused
    Triton weight-gradient kernel (`linear_wgrad`); layers with fewer than `MIN_OUT_FEATURES` outputs or
    `MAX_WEIGHT_NUMEL` weights or more, fp32 compute (unless `FP32_KERNEL`) and float64 compute keep PyTorch's
    backward. Same parameters, state_dict keys and init as nn.Linear.

    Args:
        in_features, out_features, bias, device, dtype: as ``nn.Linear``.
        activation: ``"relu"`` or ``"none"``.

    Example:
        >>> layer = LinearReLUWgrad(13, 512, activation="relu")
        >>> layer(torch.randn(3, 13)).shape
        torch.Size([3, 512])

    Shapes: [..., in_features] -> [..., out_features].
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, activation: str = "none",
                 device=None, dtype=None) -> None:
        if activation not in ("relu", "none"):
            raise ValueError(f"LinearReLUWgrad: activation must be 'relu' or 'none', got {activation!r}")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.activation = activation

    def forward(self, x: Tensor) -> Tensor:
        return linear_act_wgrad(x, self.weight, self.bias, self.activation == "relu")

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation!r}"


__all__ = ["LinearReLUWgrad", "linear_act_wgrad", "linear_wgrad"]
