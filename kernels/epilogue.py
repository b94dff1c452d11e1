"""Fused elementwise backward of an activation epilogue: ``grad_pre`` and the bias gradient in one pass.

For ``out = act(pre)`` with ``pre = x @ W^T + b`` (the linear op's epilogue, `kernels.linear`),
`act_backward` computes ``grad_pre = grad_out * act'(saved)``, where ``saved`` is the activation's
output when ``act'`` can be computed from it (none, relu, sigmoid) and the pre-activation otherwise,
and the bias gradient ``sum_m grad_pre[m, :]``. One kernel reads ``grad_out`` (and ``saved``) once,
writes ``grad_pre`` and per-row-block column sums; a second, tiny kernel adds the column sums in a
fixed order, so the bias gradient is deterministic.

Shapes: ``grad_out`` and ``saved`` are [M, N] of any strides (stride 0 included); outputs are
contiguous. All arithmetic is fp32 (bf16 inputs are upcast on load).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels._backend import (check_gemm_dtype, check_same_device, check_triton_device, device_context, interpret_mode,
                              needs_int64_offsets)
from kernels.activations import act_derivative, activation_code, derivative_from_output
from kernels.col_sum import sum_partial_rows

__all__ = ["act_backward"]

_INTERPRET = interpret_mode()

# Elementwise tiles: BLOCK_M rows x up to _MAX_BLOCK_N columns per program. Under the interpreter
# a program is one vectorised numpy step, so the same tiles are also the fastest choice there.
_BLOCK_M = 32
_MAX_BLOCK_N = 128
_NUM_WARPS = 4


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _act_bwd_kernel(
    go_ptr,
    saved_ptr,
    gpre_ptr,
    partial_ptr,
    M,
    N,
    stride_gm,
    stride_gn,
    stride_sm,
    stride_sn,
    ACTIVATION: tl.constexpr,
    FROM_OUTPUT: tl.constexpr,
    WRITE_PRE: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INT64_OFFSETS: tl.constexpr = False,
):
    """grad_pre = grad_out * act'(saved), written to gpre (optional); per-row-block column sums of
    grad_pre go to partial[pid_m, :] (stage one of the deterministic bias-gradient reduction).
    INT64_OFFSETS: 64-bit offsets (an operand reaches 2^31 elements, `kernels._backend.needs_int64_offsets`)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if INT64_OFFSETS:
        pid_m = pid_m.to(tl.int64)
        pid_n = pid_n.to(tl.int64)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)

    # Incoming gradients may be expanded (stride 0) or transposed: load through their strides.
    g = tl.load(go_ptr + rm[:, None] * stride_gm + rn[None, :] * stride_gn, mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION != 0:
        s = tl.load(saved_ptr + rm[:, None] * stride_sm + rn[None, :] * stride_sn, mask=mask, other=0.0)
        g = g * act_derivative(s.to(tl.float32), ACTIVATION, FROM_OUTPUT)
    g = tl.where(mask, g, 0.0)
    if WRITE_PRE:
        tl.store(gpre_ptr + rm[:, None] * N + rn[None, :], g.to(gpre_ptr.dtype.element_ty), mask=mask)
    if BIAS_GRAD:
        tl.store(partial_ptr + pid_m * N + rn, tl.sum(g, axis=0), mask=rn < N)


# ----------------------------------------------------------------------------------------------
# Host launcher (no autograd: the linear op's backward calls it)
# ----------------------------------------------------------------------------------------------


def _block_n(n: int) -> int:
    return min(_MAX_BLOCK_N, max(16, triton.next_power_of_2(max(n, 1))))


def _grid(m: int, n: int, block_n: int) -> tuple[int, int]:
    return (triton.cdiv(m, _BLOCK_M), triton.cdiv(n, block_n))


def _check_2d(name: str, t: Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [M, N], got shape {tuple(t.shape)}")


def act_backward(
    grad_out: Tensor,
    saved: Tensor,
    activation: str,
    from_output: bool,
    *,
    write_pre: bool = True,
    bias_grad: bool = False,
) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """Fused backward of ``act(pre)`` with respect to ``pre``.

    ``grad_pre = grad_out * act'(saved)`` where `saved` is the activation's output (`from_output`)
    or `pre`. Returns ``(grad_pre [M, N] if write_pre, column sums of grad_pre [N] if bias_grad)``
    in grad_out's dtype (None for what was not asked): one pass over grad_out, plus a second tiny
    deterministic pass for the column sums.
    """
    _check_2d("grad_out", grad_out)
    code = activation_code(activation)  # an unknown name: ValueError
    # The kernel reads saved[m, n] for every [m, n] of grad_out: a saved tensor of another shape was read out of
    # bounds (garbage derivatives), and an output handed where only the pre-activation serves gave gelu's and
    # squared_relu's derivative of the wrong argument. Both silently; refused instead.
    if activation != "none" and tuple(saved.shape) != tuple(grad_out.shape):
        raise ValueError(f"saved must have grad_out's shape {tuple(grad_out.shape)}, got {tuple(saved.shape)}")
    if from_output and not derivative_from_output(activation):
        raise ValueError(f"{activation}'s derivative needs the pre-activation (from_output=False), not the output")
    # fp32 arithmetic: float64 came back as float64 rounded to fp32; a saved tensor of another device read bad memory
    check_gemm_dtype(grad_out.dtype, "the fused epilogue kernels", "the PyTorch modules")
    if activation != "none":
        check_same_device("act_backward", grad_out=grad_out, saved=saved)
    check_triton_device(grad_out.device, "fused epilogue kernels")
    M, N = grad_out.shape
    dev, dt = grad_out.device, grad_out.dtype
    gpre = torch.empty((M, N), device=dev, dtype=dt) if write_pre else None
    gbias = torch.empty((N,), device=dev, dtype=dt) if bias_grad else None
    if M == 0 or N == 0:
        if gbias is not None:
            gbias.zero_()
        return gpre, gbias
    bn = _block_n(N)
    grid = _grid(M, N, bn)
    partial = torch.empty((grid[0], N), device=dev, dtype=torch.float32) if bias_grad else None
    if activation == "none":
        saved = grad_out  # never read (ACTIVATION == 0); any valid pointer will do
    with device_context(grad_out):
        _act_bwd_kernel[grid](
            grad_out,
            saved,
            gpre if gpre is not None else grad_out,
            partial if partial is not None else grad_out,
            M,
            N,
            grad_out.stride(0),
            grad_out.stride(1),
            saved.stride(0),
            saved.stride(1),
            ACTIVATION=code,
            FROM_OUTPUT=from_output,
            WRITE_PRE=write_pre,
            BIAS_GRAD=bias_grad,
            BLOCK_M=_BLOCK_M,
            BLOCK_N=bn,
            INT64_OFFSETS=needs_int64_offsets(grad_out, saved, gpre, partial),
            num_warps=_NUM_WARPS,
        )
        if bias_grad:
            sum_partial_rows(partial, gbias, bn)
    return gpre, gbias
