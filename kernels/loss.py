"""Binary cross-entropy with logits, forward and backward fused.

Per element (z = logit, y = label), in fp32 whatever the input dtype:

* loss = max(z, 0) - z * y + log1p(exp(-|z|))  -- never overflows: exp's argument is <= 0;
* d loss / dz = sigmoid(z) - y, with sigmoid from e = exp(-|z|) (1 / (1 + e) for z >= 0,
  e / (1 + e) below): exp never overflows, so |z| up to 1e4 and beyond stays finite;
* d loss / dy = -z (labels may require grad, as in torch).

log1p is not a Triton primitive: ``log1p(t)`` for t = exp(-|z|) in (0, 1] uses the classic
``log(u) * t / (u - 1)`` with ``u = 1 + t`` (exact to a few ulps, also where ``1 + t`` rounds to
1, e.g. z = -20 and y = 0 where the loss itself is ~2e-9 and a plain ``log(1 + t)`` returns 0).

Reductions ('mean' | 'sum') are deterministic and two-stage: each program of the forward kernel
writes the fp32 sum of its block to a partial buffer, then one single-program kernel adds the
partials in a fixed order (and divides by B for 'mean'). No atomics: the same inputs give bitwise
the same loss on every run.

The forward saves only its inputs: the backward recomputes sigmoid(z) - y in the same pass that
scales it by grad_out (read through a pointer, never ``.item()``: no host sync), so nothing extra is
written or kept alive in the forward (and nothing is wasted in evaluation).

Shapes: logits and labels of the same shape [B] (any shape is accepted and flattened; 1-D inputs
are read through their strides, no copy). Labels: float32 or the logits' dtype (float64 labels beside fp32 logits
are read as fp32 values, and their gradient, -z * g, is computed in float64 by the launcher).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor, nn

from kernels._backend import (check_gemm_dtype, check_same_device, check_triton_device, device_context, interpret_mode,
                              needs_int64_offsets)

_INTERPRET = interpret_mode()

# Under the interpreter small blocks make modest test sizes exercise multi-block and multi-step
# reductions; on the GPU 1024 elements per program keep the partial buffer ~B/1024 long.
_BLOCK = 64 if _INTERPRET else 1024
_BLOCK_R = 32 if _INTERPRET else 1024
_NUM_WARPS = 4

_REDUCTIONS = ("none", "mean", "sum")


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _log1p_unit(t):
    """log(1 + t) for t in [0, 1], accurate for tiny t (Goldberg's trick: the rounding error of
    u = 1 + t cancels in log(u) / (u - 1))."""
    u = 1.0 + t
    d = u - 1.0
    # The where() guard keeps d == 0 from dividing by zero even in the branch that is discarded.
    safe_d = tl.where(d == 0.0, 1.0, d)
    return tl.where(d == 0.0, t, tl.log(u) * (t / safe_d))


@triton.jit
def _stable_sigmoid(z):
    # exp(-|z|) never overflows, so no inf/nan for any finite z (|z| = 1e4 gives exactly 0 or 1).
    e = tl.exp(-tl.abs(z))
    return tl.where(z >= 0.0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def _bce_fwd_kernel(
    z_ptr,
    y_ptr,
    loss_ptr,
    partial_ptr,
    B,
    stride_z,
    stride_y,
    REDUCE: tl.constexpr,
    BLOCK: tl.constexpr,
    INT64_OFFSETS: tl.constexpr = False,
):
    """REDUCE: partial[pid] = sum of the block's losses (fp32); else loss[i] per element. INT64_OFFSETS: 64-bit
    offsets (``(B - 1) * stride`` of an operand reaches 2^31, `kernels._backend.needs_int64_offsets`)."""
    pid = tl.program_id(0)
    if INT64_OFFSETS:
        pid = pid.to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < B
    z = tl.load(z_ptr + offs * stride_z, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs * stride_y, mask=mask, other=0.0).to(tl.float32)
    loss = tl.maximum(z, 0.0) - z * y + _log1p_unit(tl.exp(-tl.abs(z)))
    if REDUCE:
        tl.store(partial_ptr + pid, tl.sum(tl.where(mask, loss, 0.0), axis=0))
    else:
        tl.store(loss_ptr + offs, loss.to(loss_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_partials_kernel(partial_ptr, out_ptr, R, divisor, BLOCK_R: tl.constexpr):
    """out[0] = (sum of the R fp32 partials, in a fixed order) / divisor. One program."""
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for i in range(0, tl.cdiv(R, BLOCK_R)):
        offs = i * BLOCK_R + tl.arange(0, BLOCK_R)
        acc += tl.load(partial_ptr + offs, mask=offs < R, other=0.0)
    total = tl.sum(acc, axis=0) / divisor
    tl.store(out_ptr, total.to(out_ptr.dtype.element_ty))


@triton.jit
def _bce_bwd_kernel(
    z_ptr,
    y_ptr,
    go_ptr,
    gz_ptr,
    gy_ptr,
    B,
    stride_z,
    stride_y,
    stride_go,
    scale,
    WRITE_GZ: tl.constexpr,
    WRITE_GY: tl.constexpr,
    BLOCK: tl.constexpr,
    INT64_OFFSETS: tl.constexpr = False,
):
    """gz = (sigmoid(z) - y) * go * scale, gy = -z * go * scale. For reduced losses go is the
    scalar upstream gradient (stride_go = 0) and scale is 1/B ('mean') or 1 ('sum'). INT64_OFFSETS: as the
    forward's."""
    pid = tl.program_id(0)
    if INT64_OFFSETS:
        pid = pid.to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < B
    z = tl.load(z_ptr + offs * stride_z, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(go_ptr + offs * stride_go, mask=mask, other=0.0).to(tl.float32) * scale
    if WRITE_GZ:
        y = tl.load(y_ptr + offs * stride_y, mask=mask, other=0.0).to(tl.float32)
        sig = _stable_sigmoid(z)
        tl.store(gz_ptr + offs, ((sig - y) * g).to(gz_ptr.dtype.element_ty), mask=mask)
    if WRITE_GY:
        tl.store(gy_ptr + offs, (-z * g).to(gy_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Host launchers
# ----------------------------------------------------------------------------------------------


def _flat(t: Tensor) -> Tensor:
    return t if t.dim() == 1 else t.reshape(-1)


def _check_inputs(logits: Tensor, labels: Tensor, reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if logits.shape != labels.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} != logits shape {tuple(logits.shape)}")
    if not (logits.is_floating_point() and labels.is_floating_point()):
        raise TypeError("logits and labels must be floating point")
    if logits.device != labels.device:
        raise ValueError("logits and labels must be on the same device")
    # the kernels compute in fp32: float64 logits got an fp32 loss handed back as float64 (8e-5 off at |z| ~ 1e3)
    check_gemm_dtype(logits.dtype, "the fused loss kernels", "torch.nn.functional.binary_cross_entropy_with_logits "
                     "and the torch kernels")


def bce_forward(logits: Tensor, labels: Tensor, reduction: str) -> Tensor:
    """Launch the forward: per-element losses (logits' shape) or a 0-dim reduced loss, in logits' dtype."""
    _check_inputs(logits, labels, reduction)
    check_triton_device(logits.device, "fused loss kernels")
    z, y = _flat(logits), _flat(labels)
    B = z.numel()
    dev = logits.device
    if reduction == "none":
        out = torch.empty(B, device=dev, dtype=logits.dtype)
        if B:
            with device_context(z):
                _bce_fwd_kernel[(triton.cdiv(B, _BLOCK),)](
                    z, y, out, out, B, z.stride(0), y.stride(0), REDUCE=False, BLOCK=_BLOCK,
                    INT64_OFFSETS=needs_int64_offsets(z, y, out), num_warps=_NUM_WARPS
                )
        return out.view(logits.shape)
    out = torch.empty((), device=dev, dtype=logits.dtype)
    if B == 0:  # as torch: sum of nothing is 0, mean of nothing is nan
        return out.fill_(0.0 if reduction == "sum" else float("nan"))
    nblocks = triton.cdiv(B, _BLOCK)
    partial = torch.empty(nblocks, device=dev, dtype=torch.float32)
    with device_context(z):
        _bce_fwd_kernel[(nblocks,)](z, y, out, partial, B, z.stride(0), y.stride(0), REDUCE=True, BLOCK=_BLOCK,
                                    INT64_OFFSETS=needs_int64_offsets(z, y), num_warps=_NUM_WARPS)
        _sum_partials_kernel[(1,)](partial, out, nblocks, float(B) if reduction == "mean" else 1.0, BLOCK_R=_BLOCK_R, num_warps=_NUM_WARPS)
    return out


def bce_backward(
    grad_out: Tensor, logits: Tensor, labels: Tensor, reduction: str, need_logits: bool = True, need_labels: bool = False
) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """Launch the backward: ``(grad_logits if need_logits, grad_labels if need_labels)``, shaped
    and typed like logits and labels."""
    _check_inputs(logits, labels, reduction)
    # grad_out is read through its pointer on logits' device: another device's was read as bad memory
    check_same_device("bce_backward", grad_out=grad_out, logits=logits)
    check_triton_device(logits.device, "fused loss kernels")
    z, y = _flat(logits), _flat(labels)
    B = z.numel()
    gz = torch.empty(B, device=z.device, dtype=logits.dtype) if need_logits else None
    gy = torch.empty(B, device=z.device, dtype=labels.dtype) if need_labels else None
    if reduction == "none":
        go = _flat(grad_out.expand(logits.shape))  # 1-D keeps its stride (0 for expanded gradients)
        stride_go, scale = go.stride(0), 1.0
    else:
        go = grad_out.reshape(())
        stride_go, scale = 0, (1.0 / B if (reduction == "mean" and B) else 1.0)
    if need_labels and labels.dtype == torch.float64 and B:
        # fp32 logits with float64 labels: the kernel's -z * g * scale in fp32, stored as float64, was ~1e-8 off
        # torch's float64 label gradient while looking exact; the labels' gradient is computed here in float64
        # (two elementwise ops on the device, no host sync) and the kernel writes the logits' one alone
        g64 = go.double() / B if reduction == "mean" else go.double()  # 1/B in float64 (the kernel's scale is fp32)
        torch.mul(z.double(), g64, out=gy).neg_()
        need_labels = False
    if B and (need_logits or need_labels):
        with device_context(z):
            _bce_bwd_kernel[(triton.cdiv(B, _BLOCK),)](
                z,
                y,
                go,
                gz if gz is not None else z,
                gy if gy is not None else z,
                B,
                z.stride(0),
                y.stride(0),
                stride_go,
                scale,
                WRITE_GZ=need_logits,
                WRITE_GY=need_labels,
                BLOCK=_BLOCK,
                INT64_OFFSETS=needs_int64_offsets(z, y, go, gz, gy),
                num_warps=_NUM_WARPS,
            )
    return (
        gz.view(logits.shape) if gz is not None else None,
        gy.view(labels.shape) if gy is not None else None,
    )


# ----------------------------------------------------------------------------------------------
# Custom ops
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("dlrm_kernels::bce_with_logits", mutates_args=())
def _bce_op(logits: Tensor, labels: Tensor, reduction: str) -> Tensor:
    return bce_forward(logits, labels, reduction)


@_bce_op.register_fake
def _(logits, labels, reduction):
    _check_inputs(logits, labels, reduction)
    return logits.new_empty(logits.shape if reduction == "none" else ())


@torch.library.custom_op("dlrm_kernels::bce_with_logits_backward", mutates_args=())
def _bce_backward_op(
    grad_out: Tensor, logits: Tensor, labels: Tensor, reduction: str, need_logits: bool, need_labels: bool
) -> tuple[Tensor, Tensor]:
    """Returns ``(grad_logits, grad_labels)``; an unrequested one is an empty [0] tensor."""
    gz, gy = bce_backward(grad_out, logits, labels, reduction, need_logits, need_labels)
    return gz if gz is not None else logits.new_empty(0), gy if gy is not None else labels.new_empty(0)


@_bce_backward_op.register_fake
def _(grad_out, logits, labels, reduction, need_logits, need_labels):
    return (
        logits.new_empty(logits.shape if need_logits else (0,)),
        labels.new_empty(labels.shape if need_labels else (0,)),
    )


def _bce_setup(ctx, inputs, output):
    logits, labels, reduction = inputs
    ctx.save_for_backward(logits, labels)
    ctx.reduction = reduction


def _bce_bwd(ctx, grad_out):
    logits, labels = ctx.saved_tensors
    need_z, need_y = ctx.needs_input_grad[:2]
    if not (need_z or need_y):
        return None, None, None
    gz, gy = _bce_backward_op(grad_out, logits, labels, ctx.reduction, need_z, need_y)
    return gz if need_z else None, gy if need_y else None, None


_bce_op.register_autograd(_bce_bwd, setup_context=_bce_setup)


# ----------------------------------------------------------------------------------------------
# Thin function and module
# ----------------------------------------------------------------------------------------------


def bce_with_logits(logits: Tensor, labels: Tensor, reduction: str = "mean") -> Tensor:
    """``F.binary_cross_entropy_with_logits(logits, labels, reduction=reduction)`` (no weights).

    logits: [B] (or any shape); labels: same shape, float32 or logits' dtype. Returns a 0-dim
    tensor for 'mean'/'sum', else logits' shape; in logits' dtype (fp32 accumulation).

    Example (on the CPU the kernels run in Triton's interpreter, TRITON_INTERPRET=1):
        >>> import torch.nn.functional as F
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> logits = torch.tensor([-2.0, 0.0, 3.0], device=device)
        >>> labels = torch.tensor([0.0, 1.0, 1.0], device=device)
        >>> bce_with_logits(logits, labels, "none").cpu()   # log(1 + e^(-2)), log 2, log(1 + e^(-3))
        tensor([0.1269, 0.6931, 0.0486])
        >>> torch.allclose(bce_with_logits(logits, labels), F.binary_cross_entropy_with_logits(logits, labels))
        True
    """
    _check_inputs(logits, labels, reduction)
    return _bce_op(logits, labels, reduction)


class TritonBCEWithLogitsLoss(nn.Module):
    """``nn.BCEWithLogitsLoss(reduction=...)`` (without ``weight``/``pos_weight``) on the fused kernels.

    Args:
        reduction: "mean" (default), "sum" or "none", as ``nn.BCEWithLogitsLoss``.

    Example:
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> logits = torch.tensor([-2.0, 0.0, 3.0], device=device, requires_grad=True)
        >>> labels = torch.tensor([0.0, 1.0, 1.0], device=device)
        >>> loss = TritonBCEWithLogitsLoss()(logits, labels)
        >>> torch.allclose(loss, nn.BCEWithLogitsLoss()(logits, labels))
        True
        >>> loss.backward()
        >>> torch.allclose(logits.grad, (torch.sigmoid(logits) - labels).detach() / 3)   # the mean's gradient
        True

    Shapes: input [B], target [B] -> 0-dim loss ("mean", "sum") or [B] ("none").
    """

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        if reduction not in _REDUCTIONS:
            raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
        self.reduction = reduction

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return bce_with_logits(input, target, self.reduction)

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}"


__all__ = ["TritonBCEWithLogitsLoss", "bce_backward", "bce_forward", "bce_with_logits"]
