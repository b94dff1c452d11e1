"""Fused elementwise epilogues with a fused backward.

(a) ``bias_residual_act(x, bias, residual, scale, activation) = act(x + bias + scale * residual)``
    ("add-mul-activation"): one read of each input and one write of the output forward; one
    kernel backward that writes ``grad_x = grad_pre``, ``grad_residual = scale * grad_pre`` and
    per-block column sums for ``grad_bias`` (summed by a second, deterministic stage).

(b) ``dropout_bias_act(x, bias, p, activation, seed, training) = dropout(act(x + bias))``.
    Order: bias, then activation, then dropout -- the usual ``Linear -> act -> Dropout`` MLP block
    (dropout after the nonlinearity, so it zeroes *features* the next layer sees; dropping the
    pre-activation instead would, for gelu/sigmoid, feed ``act(0) != 0`` to the next layer).
    Kept values are scaled by ``1 / (1 - p)`` (inverted dropout, as ``nn.Dropout``). The mask is
    never stored: it is ``tl.rand(seed, row * N + col) >= p`` (Philox), regenerated in the
    backward from the same ``(seed, offset)`` pairs. Offsets are *logical* indices of the [M, N]
    output, so the mask depends only on ``(seed, M, N, p)``: not on block sizes, strides or the
    device kind. `dropout_mask` materialises it with the same helper for tests.

Shapes: ``x``, ``residual`` and the output are [M, N] (the thin functions also accept [..., N]
and flatten the leading dimensions), ``bias`` is [N]. Inputs may be non-contiguous (any strides,
including 0); outputs are contiguous. All arithmetic is fp32 (bf16 inputs are upcast on load).

Backward saves only one [M, N] tensor: the output when ``act'`` can be computed from it (none,
relu, sigmoid -- for dropout only none and relu, since the dropout output is scaled), otherwise
the pre-activation, written by the forward kernel in the same pass.

Kernels here are also the building blocks of the linear op's backward (`act_backward`): the
activation derivative and the bias gradient of ``act(x @ W^T + b)`` are the same computation.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor, nn

from kernels._backend import check_triton_device, device_context, interpret_mode
from kernels.activations import act_derivative, act_forward, activation_code, check_activation, derivative_from_output

_INTERPRET = interpret_mode()

# Elementwise tiles: BLOCK_M rows x up to _MAX_BLOCK_N columns per program. Under the interpreter
# a program is one vectorised numpy step, so the same tiles are also the fastest choice there.
_BLOCK_M = 32
_MAX_BLOCK_N = 128
_NUM_WARPS = 4
# Column-sum second stage: rows of partial sums reduced per loop step.
_BLOCK_R = 16 if _INTERPRET else 64


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def dropout_keep(seed, offsets, p):
    """Keep-mask of inverted dropout: True with probability ``1 - p`` (``tl.rand`` is in [0, 1))."""
    return tl.rand(seed, offsets) >= p


@triton.jit
def _epilogue_fwd_kernel(
    x_ptr,
    bias_ptr,
    res_ptr,
    out_ptr,
    pre_ptr,
    M,
    N,
    stride_xm,
    stride_xn,
    stride_rm,
    stride_rn,
    scale,
    p,
    keep_scale,
    seed,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ACTIVATION: tl.constexpr,
    DROPOUT: tl.constexpr,
    STORE_PRE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """out = [dropout](act(x + bias + scale * residual)); pre (optional) = x + bias + scale * residual."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)

    h = tl.load(x_ptr + rm[:, None] * stride_xm + rn[None, :] * stride_xn, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b = tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        h += b[None, :]
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rm[:, None] * stride_rm + rn[None, :] * stride_rn, mask=mask, other=0.0)
        h += scale * r.to(tl.float32)
    y = act_forward(h, ACTIVATION)

    # Outputs are contiguous [M, N]; the same logical index is the dropout RNG offset.
    offs = rm[:, None] * N + rn[None, :]
    if DROPOUT:
        keep = dropout_keep(seed, offs, p)
        y = tl.where(keep, y * keep_scale, 0.0)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
    if STORE_PRE:
        tl.store(pre_ptr + offs, h.to(pre_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _act_bwd_kernel(
    go_ptr,
    saved_ptr,
    gpre_ptr,
    gscaled_ptr,
    partial_ptr,
    M,
    N,
    stride_gm,
    stride_gn,
    stride_sm,
    stride_sn,
    scale,
    p,
    keep_scale,
    seed,
    ACTIVATION: tl.constexpr,
    FROM_OUTPUT: tl.constexpr,
    DROPOUT: tl.constexpr,
    WRITE_PRE: tl.constexpr,
    WRITE_SCALED: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """grad_pre = grad_out * [mask * keep_scale] * act'(saved), written to gpre (optional) and
    ``scale * grad_pre`` to gscaled (optional); per-row-block column sums of grad_pre go to
    partial[pid_m, :] (stage one of the deterministic bias-gradient reduction)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)

    # Incoming gradients may be expanded (stride 0) or transposed: load through their strides.
    g = tl.load(go_ptr + rm[:, None] * stride_gm + rn[None, :] * stride_gn, mask=mask, other=0.0).to(tl.float32)
    offs = rm[:, None] * N + rn[None, :]
    if DROPOUT:
        # Same (seed, logical offset) pairs as the forward: the same mask, never stored.
        keep = dropout_keep(seed, offs, p)
        g = tl.where(keep, g * keep_scale, 0.0)
    if ACTIVATION != 0:
        s = tl.load(saved_ptr + rm[:, None] * stride_sm + rn[None, :] * stride_sn, mask=mask, other=0.0)
        g = g * act_derivative(s.to(tl.float32), ACTIVATION, FROM_OUTPUT)
    g = tl.where(mask, g, 0.0)
    if WRITE_PRE:
        tl.store(gpre_ptr + offs, g.to(gpre_ptr.dtype.element_ty), mask=mask)
    if WRITE_SCALED:
        tl.store(gscaled_ptr + offs, (scale * g).to(gscaled_ptr.dtype.element_ty), mask=mask)
    if BIAS_GRAD:
        tl.store(partial_ptr + pid_m * N + rn, tl.sum(g, axis=0), mask=rn < N)


@triton.jit
def _col_sum_kernel(partial_ptr, out_ptr, R, N, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[n] = sum_r partial[r, n] for a contiguous fp32 [R, N] buffer, in a fixed order (deterministic)."""
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for i in range(0, tl.cdiv(R, BLOCK_R)):
        rr = i * BLOCK_R + tl.arange(0, BLOCK_R)
        tile = tl.load(partial_ptr + rr[:, None] * N + rn[None, :], mask=(rr[:, None] < R) & (rn[None, :] < N), other=0.0)
        acc += tl.sum(tile, axis=0)
    tl.store(out_ptr + rn, acc.to(out_ptr.dtype.element_ty), mask=rn < N)


@triton.jit
def _dropout_mask_kernel(mask_ptr, M, N, p, seed, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """mask[m, n] = keep(seed, m * N + n): the exact mask the epilogue kernels draw."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm[:, None] * N + rn[None, :]
    keep = dropout_keep(seed, offs, p)
    tl.store(mask_ptr + offs, keep.to(tl.int8), mask=mask)


# ----------------------------------------------------------------------------------------------
# Host launchers (no autograd; called by the custom ops below and by kernels.linear)
# ----------------------------------------------------------------------------------------------


_device_ctx = device_context  # launch on the tensor's GPU (re-exported for linear.py and loss.py)


def _block_n(n: int) -> int:
    return min(_MAX_BLOCK_N, max(16, triton.next_power_of_2(max(n, 1))))


def _grid(m: int, n: int, block_n: int) -> tuple[int, int]:
    return (triton.cdiv(m, _BLOCK_M), triton.cdiv(n, block_n))


def _keep_scale(p: float) -> float:
    # p == 1 drops everything; 0 (not inf) keeps ``where(keep, y * keep_scale, 0)`` free of nan.
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


def _check_2d(name: str, t: Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [M, N], got shape {tuple(t.shape)}")


def _check_seed(seed: int) -> None:
    if not 0 <= seed < 2**63:
        raise ValueError(f"dropout seed must be in [0, 2**63), got {seed}")


def epilogue_forward(
    x: Tensor,
    bias: Optional[Tensor],
    residual: Optional[Tensor],
    scale: float,
    activation: str,
    p: float,
    seed: int,
    store_pre: bool,
) -> tuple[Tensor, Tensor]:
    """Launch the fused forward. Returns ``(out [M, N], pre [M, N] or an empty [0] tensor)``;
    dropout is applied when ``p > 0``."""
    _check_2d("x", x)
    check_triton_device(x.device, "fused epilogue kernels")
    M, N = x.shape
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    pre = torch.empty((M, N) if store_pre else (0,), device=x.device, dtype=x.dtype)
    if M == 0 or N == 0:
        return out, pre
    bn = _block_n(N)
    res = residual if residual is not None else x
    with _device_ctx(x):
        _epilogue_fwd_kernel[_grid(M, N, bn)](
            x,
            bias if bias is not None else x,
            res,
            out,
            pre if store_pre else out,
            M,
            N,
            x.stride(0),
            x.stride(1),
            res.stride(0),
            res.stride(1),
            float(scale),
            float(p),
            _keep_scale(p),
            int(seed),
            HAS_BIAS=bias is not None,
            HAS_RESIDUAL=residual is not None,
            ACTIVATION=activation_code(activation),
            DROPOUT=p > 0.0,
            STORE_PRE=store_pre,
            BLOCK_M=_BLOCK_M,
            BLOCK_N=bn,
            num_warps=_NUM_WARPS,
        )
    return out, pre


def act_backward(
    grad_out: Tensor,
    saved: Tensor,
    activation: str,
    from_output: bool,
    *,
    write_pre: bool = True,
    scale: Optional[float] = None,
    bias_grad: bool = False,
    bias_dtype: Optional[torch.dtype] = None,
    p: float = 0.0,
    seed: int = 0,
) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """Fused backward of ``[dropout](act(pre))`` with respect to ``pre``.

    ``grad_pre = grad_out * [keep / (1 - p)] * act'(saved)`` where `saved` is the activation's
    output (`from_output`) or `pre`. Returns ``(grad_pre if write_pre, scale * grad_pre if scale is
    not None, column sums of grad_pre [N] if bias_grad)``: all from one pass over grad_out, plus a
    second tiny deterministic pass for the column sums.
    """
    _check_2d("grad_out", grad_out)
    check_triton_device(grad_out.device, "fused epilogue kernels")
    M, N = grad_out.shape
    dev, dt = grad_out.device, grad_out.dtype
    write_scaled = scale is not None
    gpre = torch.empty((M, N), device=dev, dtype=dt) if write_pre else None
    gscaled = torch.empty((M, N), device=dev, dtype=dt) if write_scaled else None
    gbias = torch.empty((N,), device=dev, dtype=bias_dtype or dt) if bias_grad else None
    if M == 0 or N == 0:
        if gbias is not None:
            gbias.zero_()
        return gpre, gscaled, gbias
    bn = _block_n(N)
    grid = _grid(M, N, bn)
    partial = torch.empty((grid[0], N), device=dev, dtype=torch.float32) if bias_grad else None
    if activation == "none":
        saved = grad_out  # never read (ACTIVATION == 0); any valid pointer will do
    with _device_ctx(grad_out):
        _act_bwd_kernel[grid](
            grad_out,
            saved,
            gpre if gpre is not None else grad_out,
            gscaled if gscaled is not None else grad_out,
            partial if partial is not None else grad_out,
            M,
            N,
            grad_out.stride(0),
            grad_out.stride(1),
            saved.stride(0),
            saved.stride(1),
            float(scale) if write_scaled else 1.0,
            float(p),
            _keep_scale(p),
            int(seed),
            ACTIVATION=activation_code(activation),
            FROM_OUTPUT=from_output,
            DROPOUT=p > 0.0,
            WRITE_PRE=write_pre,
            WRITE_SCALED=write_scaled,
            BIAS_GRAD=bias_grad,
            BLOCK_M=_BLOCK_M,
            BLOCK_N=bn,
            num_warps=_NUM_WARPS,
        )
        if bias_grad:
            _col_sum_kernel[(triton.cdiv(N, bn),)](partial, gbias, grid[0], N, BLOCK_R=_BLOCK_R, BLOCK_N=bn, num_warps=_NUM_WARPS)
    return gpre, gscaled, gbias


def dropout_mask(shape: tuple[int, int], p: float, seed: int, device: torch.device | str = "cpu") -> Tensor:
    """The keep-mask (bool [M, N]) that `dropout_bias_act` draws for ``(shape, p, seed)``, made by the
    same Philox helper: for tests and references (``ref = act(x + b) * mask / (1 - p)``)."""
    M, N = shape
    _check_seed(seed)
    check_triton_device(device, "fused epilogue kernels")
    out = torch.empty((M, N), device=device, dtype=torch.int8)
    if M == 0 or N == 0:
        return out.bool()
    bn = _block_n(N)
    with _device_ctx(out):
        _dropout_mask_kernel[_grid(M, N, bn)](out, M, N, float(p), int(seed), BLOCK_M=_BLOCK_M, BLOCK_N=bn, num_warps=_NUM_WARPS)
    return out.bool()


def _empty_like_none(t: Tensor) -> Tensor:
    # torch.library custom ops cannot return None inside a tuple: unused gradients are [0] tensors.
    return t.new_empty(0)


# ----------------------------------------------------------------------------------------------
# (a) bias + scaled residual + activation: custom ops
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("dlrm_kernels::bias_residual_act", mutates_args=())
def _bias_residual_act_op(
    x: Tensor, bias: Optional[Tensor], residual: Tensor, scale: float, activation: str
) -> tuple[Tensor, Tensor]:
    """Returns ``(out, pre)``; `pre` is the pre-activation when the backward needs it, else empty [0]."""
    return epilogue_forward(x, bias, residual, scale, activation, 0.0, 0, store_pre=not derivative_from_output(activation))


@_bias_residual_act_op.register_fake
def _(x, bias, residual, scale, activation):
    M, N = x.shape
    store_pre = not derivative_from_output(activation)
    return x.new_empty((M, N)), x.new_empty((M, N) if store_pre else (0,))


@torch.library.custom_op("dlrm_kernels::bias_residual_act_backward", mutates_args=())
def _bias_residual_act_backward_op(
    grad_out: Tensor, saved: Tensor, activation: str, scale: float, need_x: bool, need_bias: bool, need_residual: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns ``(grad_x, grad_bias, grad_residual)``; each unrequested one is an empty [0] tensor."""
    gx, gr, gb = act_backward(
        grad_out,
        saved,
        activation,
        derivative_from_output(activation),
        write_pre=need_x,
        scale=scale if need_residual else None,
        bias_grad=need_bias,
    )
    e = _empty_like_none(grad_out)
    return (gx if gx is not None else e, gb if gb is not None else e.clone(), gr if gr is not None else e.clone())


@_bias_residual_act_backward_op.register_fake
def _(grad_out, saved, activation, scale, need_x, need_bias, need_residual):
    M, N = grad_out.shape
    g = grad_out.new_empty
    return g((M, N) if need_x else (0,)), g((N,) if need_bias else (0,)), g((M, N) if need_residual else (0,))


def _bias_residual_setup(ctx, inputs, output):
    x, bias, residual, scale, activation = inputs
    out, pre = output
    ctx.mark_non_differentiable(pre)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(out if derivative_from_output(activation) else pre)
    ctx.activation, ctx.scale = activation, scale
    ctx.x_dtype, ctx.res_dtype = x.dtype, residual.dtype
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _bias_residual_backward(ctx, grad_out, _grad_pre):
    if grad_out is None:
        return None, None, None, None, None
    (saved,) = ctx.saved_tensors
    need_x, need_b, need_r = ctx.needs_input_grad[:3]
    gx, gb, gr = _bias_residual_act_backward_op(grad_out, saved, ctx.activation, ctx.scale, need_x, need_b, need_r)
    return (
        gx.to(ctx.x_dtype) if need_x else None,
        gb.to(ctx.bias_dtype) if need_b else None,
        gr.to(ctx.res_dtype) if need_r else None,
        None,
        None,
    )


_bias_residual_act_op.register_autograd(_bias_residual_backward, setup_context=_bias_residual_setup)


# ----------------------------------------------------------------------------------------------
# (b) bias + activation + dropout: custom ops
# ----------------------------------------------------------------------------------------------


def _dropout_from_output(activation: str) -> bool:
    # The dropout output is scaled by 1/(1-p): only none (derivative 1) and relu ([y > 0] is still
    # exact: y > 0 iff kept and act > 0, and dropped elements get a zero gradient anyway) can be
    # differentiated from it; the others save the pre-activation.
    return activation in ("none", "relu")


@torch.library.custom_op("dlrm_kernels::dropout_bias_act", mutates_args=())
def _dropout_bias_act_op(x: Tensor, bias: Optional[Tensor], p: float, activation: str, seed: int) -> tuple[Tensor, Tensor]:
    """Returns ``(out, pre)``; ``p`` is the *effective* drop probability (0 in eval mode)."""
    return epilogue_forward(x, bias, None, 0.0, activation, p, seed, store_pre=not _dropout_from_output(activation))


@_dropout_bias_act_op.register_fake
def _(x, bias, p, activation, seed):
    M, N = x.shape
    return x.new_empty((M, N)), x.new_empty((M, N) if not _dropout_from_output(activation) else (0,))


@torch.library.custom_op("dlrm_kernels::dropout_bias_act_backward", mutates_args=())
def _dropout_bias_act_backward_op(
    grad_out: Tensor, saved: Tensor, activation: str, p: float, seed: int, need_bias: bool
) -> tuple[Tensor, Tensor]:
    """Returns ``(grad_x, grad_bias or empty [0])``; the dropout mask is regenerated from `seed`."""
    gx, _, gb = act_backward(grad_out, saved, activation, _dropout_from_output(activation), bias_grad=need_bias, p=p, seed=seed)
    return gx, gb if gb is not None else _empty_like_none(grad_out)


@_dropout_bias_act_backward_op.register_fake
def _(grad_out, saved, activation, p, seed, need_bias):
    M, N = grad_out.shape
    return grad_out.new_empty((M, N)), grad_out.new_empty((N,) if need_bias else (0,))


def _dropout_setup(ctx, inputs, output):
    x, bias, p, activation, seed = inputs
    out, pre = output
    ctx.mark_non_differentiable(pre)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(out if _dropout_from_output(activation) else pre)
    ctx.activation, ctx.p, ctx.seed = activation, p, seed
    ctx.x_dtype = x.dtype
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _dropout_backward(ctx, grad_out, _grad_pre):
    if grad_out is None:
        return None, None, None, None, None
    (saved,) = ctx.saved_tensors
    need_x, need_b = ctx.needs_input_grad[:2]
    if not (need_x or need_b):
        return None, None, None, None, None
    gx, gb = _dropout_bias_act_backward_op(grad_out, saved, ctx.activation, ctx.p, ctx.seed, need_b)
    return gx.to(ctx.x_dtype) if need_x else None, gb.to(ctx.bias_dtype) if need_b else None, None, None, None


_dropout_bias_act_op.register_autograd(_dropout_backward, setup_context=_dropout_setup)


# ----------------------------------------------------------------------------------------------
# Thin functions and modules
# ----------------------------------------------------------------------------------------------


def _flatten(t: Tensor) -> Tensor:
    # [..., N] -> [M, N]; 2-D inputs keep their strides (no copy).
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def bias_residual_act(
    x: Tensor, bias: Optional[Tensor], residual: Tensor, scale: float = 1.0, activation: str = "relu"
) -> Tensor:
    """``act(x + bias + scale * residual)``.

    x: [..., N]; bias: [N] or None; residual: same shape as x; returns a contiguous tensor of x's
    shape and dtype. Differentiable in x, bias and residual.
    """
    check_activation(activation)
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    if bias is not None and bias.shape != (x.shape[-1],):
        raise ValueError(f"bias must be [{x.shape[-1]}], got {tuple(bias.shape)}")
    out, _ = _bias_residual_act_op(_flatten(x), bias, _flatten(residual), float(scale), activation)
    return out.view(x.shape)


def draw_seed(generator: Optional[torch.Generator] = None) -> int:
    """A fresh dropout seed from torch's (CPU) generator, so ``torch.manual_seed`` makes runs
    reproducible. Costs no GPU sync, but ``.item()`` is a graph break under torch.compile: pass an
    explicit seed there."""
    return int(torch.randint(0, 2**31 - 1, (), generator=generator).item())


def dropout_bias_act(
    x: Tensor,
    bias: Optional[Tensor],
    p: float = 0.5,
    activation: str = "relu",
    seed: Optional[int] = None,
    training: bool = True,
) -> Tensor:
    """``dropout(act(x + bias), p)`` (bias, then activation, then inverted dropout).

    x: [..., N]; bias: [N] or None. With ``training=False`` or ``p == 0`` no random numbers are drawn
    and the result equals ``act(x + bias)`` exactly. `seed` (int in [0, 2**63)) fixes the mask, which
    is `dropout_mask(x.shape (flattened to 2-D), p, seed)`; None draws one with `draw_seed`.
    """
    check_activation(activation)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    if bias is not None and bias.shape != (x.shape[-1],):
        raise ValueError(f"bias must be [{x.shape[-1]}], got {tuple(bias.shape)}")
    p_eff = float(p) if training else 0.0
    if p_eff == 0.0:
        seed = 0
    elif seed is None:
        seed = draw_seed()
    _check_seed(seed)
    out, _ = _dropout_bias_act_op(_flatten(x), bias, p_eff, activation, int(seed))
    return out.view(x.shape)


class FusedBiasResidualAct(nn.Module):
    """``act(x + bias + scale * residual)`` with a learnable bias [num_features] (zeros at init).

    forward(x [..., num_features], residual [same shape]) -> [same shape]
    """

    def __init__(
        self,
        num_features: int,
        scale: float = 1.0,
        activation: str = "relu",
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_features = num_features
        self.scale = float(scale)
        self.activation = check_activation(activation)
        if bias:
            self.bias = nn.Parameter(torch.zeros(num_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Tensor, residual: Tensor) -> Tensor:
        return bias_residual_act(x, self.bias, residual, self.scale, self.activation)

    def extra_repr(self) -> str:
        return f"num_features={self.num_features}, scale={self.scale}, activation={self.activation!r}, bias={self.bias is not None}"


class FusedDropoutBiasAct(nn.Module):
    """``dropout(act(x + bias), p)`` with a learnable bias [num_features] (zeros at init); dropout
    only in training mode, with a fresh seed per call (from torch's generator) unless one is given.

    forward(x [..., num_features], seed: int | None = None) -> [same shape]
    """

    def __init__(
        self,
        num_features: int,
        p: float = 0.5,
        activation: str = "relu",
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability must be in [0, 1], got {p}")
        self.num_features = num_features
        self.p = float(p)
        self.activation = check_activation(activation)
        if bias:
            self.bias = nn.Parameter(torch.zeros(num_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Tensor, seed: Optional[int] = None) -> Tensor:
        return dropout_bias_act(x, self.bias, self.p, self.activation, seed, self.training)

    def extra_repr(self) -> str:
        return f"num_features={self.num_features}, p={self.p}, activation={self.activation!r}, bias={self.bias is not None}"


__all__ = [
    "FusedBiasResidualAct",
    "FusedDropoutBiasAct",
    "act_backward",
    "bias_residual_act",
    "draw_seed",
    "dropout_bias_act",
    "dropout_keep",
    "dropout_mask",
    "epilogue_forward",
]
