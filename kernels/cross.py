"""DCNv2 cross layer: ``out = x0 * (U @ W^T + b) + x`` in one Triton GEMM with the cross epilogue, and
its backward with the elementwise part fused into one pass.

Notation: ``M`` rows (the batch B), ``N`` the cross network's width ((F+1) D), ``K`` its rank r.

One layer of TorchRec's ``LowRankCrossNet`` is ``x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l`` with
``V_l`` [r, N] and ``W_l`` [N, r]. The first product, ``U = x_l V_l^T`` [M, r], stays a cuBLAS
``F.linear`` (it reduces over the wide N into a narrow output: nothing to fuse). The second is this op:

Forward: one tiled ``tl.dot`` kernel computes the [BLOCK_M, BLOCK_N] tile of ``U @ W^T`` (fp32
accumulator, grouped tile order, masks for any M, N, K), and its epilogue adds the bias, loads the
same tiles of ``x0`` and ``x`` (through their strides), writes ``out = x0 * pre + x`` and saves
``pre = U @ W^T + b`` for the backward (as eager autograd does for the product ``x0 * pre``).

Backward, for ``g = d loss / d out``:

1. ONE elementwise pass reads ``g``, ``x0`` and ``pre`` once and writes ``grad_pre = g * x0`` and
   ``grad_x0 = g * pre``, plus per-row-block column sums of ``grad_pre`` (first stage of a
   deterministic two-stage reduction for ``grad_b``; a tiny second kernel sums them in a fixed order).
2. ``grad_U = grad_pre @ W`` [M, K] and ``grad_W = grad_pre^T @ U`` [N, K] with `kernels.linear`'s GEMM
   (transposes are stride swaps; ``grad_W`` reduces over the batch and is split along it).
3. ``grad_x = g``: the residual passes the incoming gradient through untouched (no copy).

``grad_pre`` is materialised once rather than recomputed in the prologues of both GEMMs, for the
reason `kernels.linear` gives: two GEMMs and the bias sum read it.

Measured (H100, 2026-11-24, benchmarks/results/mlperf_dcnv2.md): in the MLPerf DLRM-DCNv2 step at
batch 65536 (bf16, N = 3456, r = 512) this path takes 40.9 ms a step against 37.1 ms with the
PyTorch cross net compiled by Inductor (cuBLAS GEMMs; the Triton GEMMs here are slower than
cuBLAS, as the linear kernel's are), so "auto" keeps the PyTorch cross net; it is an opt-in
(``kernels.interaction: "triton"`` with ``model.interaction: "dcn"``).

Precision: as `kernels.linear`: fp32 operands use TF32 tensor cores on the GPU when ``allow_tf32``
(default: torch's cuBLAS setting) says so, else ``"ieee"`` (always under the interpreter); bf16/fp16
operands run 16-bit products accumulated in fp32, the epilogue in fp32, outputs in the input dtype.

File layout: ``@triton.jit`` kernels, host launchers, the ``torch.library`` custom ops
(``dlrm_kernels::cross_layer`` and its backward) with fake and autograd registrations, then
``cross_layer`` (one layer), ``low_rank_cross_net`` (all layers), the plain-torch
``cross_layer_reference`` and ``TritonLowRankCrossNet`` (TorchRec's parameters and state_dict keys).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor, nn

from kernels import heuristics
from kernels._backend import check_gemm_dtype, check_triton_device, device_context, interpret_mode, needs_int64_offsets
from kernels.col_sum import sum_partial_rows
from kernels.heuristics import GemmTile
from kernels.linear import gemm_bias_act, resolve_input_precision

__all__ = ["TritonLowRankCrossNet", "cross_layer", "cross_layer_reference", "low_rank_cross_net"]

_INTERPRET = interpret_mode()

# Elementwise backward tiles: BLOCK_M rows x up to _MAX_BLOCK_N columns per program (kernels.epilogue's).
_EW_BLOCK_M = 32
_EW_MAX_BLOCK_N = 128
_EW_WARPS = 4


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _cross_fwd_kernel(
    u_ptr,
    w_ptr,
    b_ptr,
    x0_ptr,
    x_ptr,
    out_ptr,
    pre_ptr,
    M,
    N,
    K,
    stride_um,
    stride_uk,
    stride_wn,
    stride_wk,
    stride_b,
    stride_x0m,
    stride_x0n,
    stride_xm,
    stride_xn,
    STORE_PRE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    INT64_OFFSETS: tl.constexpr = False,
):
    """pre = u @ w^T + b; out = x0 * pre + x. u [M, K], w [N, K], b [N], x0 and x [M, N] through any
    strides; out and pre contiguous [M, N]. INT64_OFFSETS: 64-bit offsets (an operand reaches 2^31 elements)."""
    # Grouped ("super-tile") program order: GROUP_M row tiles share each column tile of w in L2.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    if INT64_OFFSETS:  # rows, columns and the loop's pointer steps in 64 bits (kernels._backend.needs_int64_offsets)
        pid_m = pid_m.to(tl.int64)
        pid_n = pid_n.to(tl.int64)
        stride_uk = tl.cast(stride_uk, tl.int64)
        stride_wk = tl.cast(stride_wk, tl.int64)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    u_ptrs = u_ptr + rm[:, None] * stride_um + rk[None, :] * stride_uk
    w_ptrs = w_ptr + rk[:, None] * stride_wk + rn[None, :] * stride_wn  # [BLOCK_K, BLOCK_N] tile of w^T
    m_ok = rm[:, None] < M
    n_ok = rn[None, :] < N

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Loop count from tl.cdiv (see kernels.linear: the form every supported interpreter handles).
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - kt * BLOCK_K
        u = tl.load(u_ptrs, mask=m_ok & (rk[None, :] < k_left), other=0.0)
        w = tl.load(w_ptrs, mask=(rk[:, None] < k_left) & n_ok, other=0.0)
        acc = tl.dot(u, w, acc, input_precision=INPUT_PRECISION)
        u_ptrs += BLOCK_K * stride_uk
        w_ptrs += BLOCK_K * stride_wk

    # Epilogue: the bias, then the cross with x0 and the residual x, in fp32.
    b = tl.load(b_ptr + rn * stride_b, mask=rn < N, other=0.0).to(tl.float32)
    acc += b[None, :]
    mask = m_ok & n_ok
    o_offs = rm[:, None] * N + rn[None, :]
    if STORE_PRE:
        tl.store(pre_ptr + o_offs, acc.to(pre_ptr.dtype.element_ty), mask=mask)
    x0 = tl.load(x0_ptr + rm[:, None] * stride_x0m + rn[None, :] * stride_x0n, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + rm[:, None] * stride_xm + rn[None, :] * stride_xn, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + o_offs, (x0 * acc + x).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _cross_bwd_elementwise_kernel(
    g_ptr,
    x0_ptr,
    pre_ptr,
    gpre_ptr,
    gx0_ptr,
    partial_ptr,
    M,
    N,
    stride_gm,
    stride_gn,
    stride_x0m,
    stride_x0n,
    stride_pm,
    stride_pn,
    WRITE_GPRE: tl.constexpr,
    WRITE_GX0: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INT64_OFFSETS: tl.constexpr = False,
):
    """grad_pre = g * x0 and grad_x0 = g * pre (each optional, contiguous [M, N]); per-row-block
    column sums of grad_pre go to partial[pid_m, :] (stage one of the bias gradient). INT64_OFFSETS: 64-bit
    offsets (an operand reaches 2^31 elements)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if INT64_OFFSETS:
        pid_m = pid_m.to(tl.int64)
        pid_n = pid_n.to(tl.int64)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm[:, None] * N + rn[None, :]

    # Incoming gradients may be expanded (stride 0) or transposed: load through their strides.
    g = tl.load(g_ptr + rm[:, None] * stride_gm + rn[None, :] * stride_gn, mask=mask, other=0.0).to(tl.float32)
    if WRITE_GPRE or BIAS_GRAD:
        x0 = tl.load(x0_ptr + rm[:, None] * stride_x0m + rn[None, :] * stride_x0n, mask=mask, other=0.0).to(tl.float32)
        gpre = tl.where(mask, g * x0, 0.0)
        if WRITE_GPRE:
            tl.store(gpre_ptr + offs, gpre.to(gpre_ptr.dtype.element_ty), mask=mask)
        if BIAS_GRAD:
            tl.store(partial_ptr + pid_m * N + rn, tl.sum(gpre, axis=0), mask=rn < N)
    if WRITE_GX0:
        pre = tl.load(pre_ptr + rm[:, None] * stride_pm + rn[None, :] * stride_pn, mask=mask, other=0.0).to(tl.float32)
        tl.store(gx0_ptr + offs, (g * pre).to(gx0_ptr.dtype.element_ty), mask=mask)


AUTOTUNE = os.environ.get("DLRM_TRITON_AUTOTUNE", "0") not in ("", "0") and not _INTERPRET
_cross_fwd_kernel_autotuned = triton.autotune(
    configs=[tile.config() for tile in heuristics.gemm_tiles(_INTERPRET)], key=["M", "N", "K"]
)(_cross_fwd_kernel)


# ----------------------------------------------------------------------------------------------
# Host launchers
# ----------------------------------------------------------------------------------------------


def _pick_tile(M: int, N: int, dtype: torch.dtype, device: torch.device) -> GemmTile:
    """The interpreter's one tile, or `heuristics.pick_cross_tile`."""
    if _INTERPRET:
        return heuristics.INTERPRETER_GEMM_TILE
    return heuristics.pick_cross_tile(M, N, dtype, heuristics.sm_count(device))


def _check_operands(x0: Tensor, x: Tensor, u: Tensor, weight: Tensor, bias: Tensor) -> None:
    if x0.dim() != 2 or x.shape != x0.shape:
        raise ValueError(f"x0 and x must both be [M, N], got {tuple(x0.shape)} and {tuple(x.shape)}")
    M, N = x0.shape
    if u.dim() != 2 or u.shape[0] != M or weight.dim() != 2 or weight.shape != (N, u.shape[1]):
        raise ValueError(f"u must be [M, K] and weight [N, K] for x0 [M, N] = {(M, N)}: "
                         f"got u {tuple(u.shape)}, weight {tuple(weight.shape)}")
    if bias.shape != (N,):
        raise ValueError(f"bias must be [{N}], got {tuple(bias.shape)}")
    if any(t.device != x0.device for t in (x, u, weight, bias)):
        raise ValueError("all operands must be on the same device")
    if any(t.dtype != x0.dtype for t in (x, u, weight, bias)):
        raise ValueError(f"all operands must have one dtype, got {[t.dtype for t in (x0, x, u, weight, bias)]}")
    check_gemm_dtype(x0.dtype, "cross layer kernels")  # float64: a garbage pre-activation, so garbage gradients
    check_triton_device(x0.device, "cross layer kernels")


def cross_forward(x0: Tensor, x: Tensor, u: Tensor, weight: Tensor, bias: Tensor, input_precision: str = "ieee",
                  store_pre: bool = True) -> tuple[Tensor, Optional[Tensor]]:
    """Launch the forward: ``pre = u @ weight^T + bias``, ``out = x0 * pre + x``.

    x0, x: [M, N]; u: [M, K]; weight: [N, K]; bias: [N]; one dtype, any strides. Returns
    ``(out [M, N], pre [M, N] or None)``, contiguous, in that dtype."""
    _check_operands(x0, x, u, weight, bias)
    if input_precision not in ("ieee", "tf32"):
        raise ValueError(f"input_precision must be 'ieee' or 'tf32', got {input_precision!r}")
    M, N = x0.shape
    K = u.shape[1]
    out = torch.empty((M, N), device=x0.device, dtype=x0.dtype)
    pre = torch.empty((M, N), device=x0.device, dtype=x0.dtype) if store_pre else None
    if M == 0 or N == 0:
        return out, pre
    if K == 0:  # no reduction: pre = bias (torch handles it better than a zero-trip loop behind masks)
        p = bias.float().expand(M, N)
        out.copy_(x0.float() * p + x.float())
        if pre is not None:
            pre.copy_(p)
        return out, pre
    prec = input_precision if x0.dtype == torch.float32 and not _INTERPRET else "ieee"
    tile = _pick_tile(M, N, x0.dtype, x0.device)

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    kernel, launch = (_cross_fwd_kernel_autotuned, {}) if AUTOTUNE else (_cross_fwd_kernel, tile.launch_kwargs())
    with device_context(x0):
        kernel[grid](
            u, weight, bias, x0, x, out, pre if pre is not None else out,
            M, N, K,
            u.stride(0), u.stride(1), weight.stride(0), weight.stride(1), bias.stride(0),
            x0.stride(0), x0.stride(1), x.stride(0), x.stride(1),
            STORE_PRE=pre is not None,
            INPUT_PRECISION=prec,
            INT64_OFFSETS=needs_int64_offsets(u, weight, x0, x, out, pre),
            **launch,
        )  # fmt: skip
    return out, pre


def cross_elementwise_backward(g: Tensor, x0: Tensor, pre: Tensor, *, need_pre: bool = True, need_x0: bool = True,
                               need_b: bool = True) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """One pass over ``g``, ``x0`` and ``pre`` (all [M, N], any strides, stride 0 included): returns
    ``(grad_pre = g * x0, grad_x0 = g * pre, grad_b = sum_m grad_pre[m, :])`` in g's dtype, None for
    what was not asked (the column sums by a second, tiny, deterministic pass)."""
    check_triton_device(g.device, "cross layer kernels")
    M, N = g.shape
    dev, dt = g.device, g.dtype
    gpre = torch.empty((M, N), device=dev, dtype=dt) if need_pre else None
    gx0 = torch.empty((M, N), device=dev, dtype=dt) if need_x0 else None
    gb = torch.empty((N,), device=dev, dtype=dt) if need_b else None
    if M == 0 or N == 0 or not (need_pre or need_x0 or need_b):
        if gb is not None:
            gb.zero_()
        return gpre, gx0, gb
    bn = min(_EW_MAX_BLOCK_N, max(16, triton.next_power_of_2(N)))
    grid = (triton.cdiv(M, _EW_BLOCK_M), triton.cdiv(N, bn))
    partial = torch.empty((grid[0], N), device=dev, dtype=torch.float32) if need_b else None
    with device_context(g):
        _cross_bwd_elementwise_kernel[grid](
            g, x0, pre,
            gpre if gpre is not None else g, gx0 if gx0 is not None else g, partial if partial is not None else g,
            M, N,
            g.stride(0), g.stride(1), x0.stride(0), x0.stride(1), pre.stride(0), pre.stride(1),
            WRITE_GPRE=need_pre, WRITE_GX0=need_x0, BIAS_GRAD=need_b,
            BLOCK_M=_EW_BLOCK_M, BLOCK_N=bn, INT64_OFFSETS=needs_int64_offsets(g, x0, pre, gpre, gx0, partial),
            num_warps=_EW_WARPS,
        )  # fmt: skip
        if need_b:
            sum_partial_rows(partial, gb, bn)
    return gpre, gx0, gb


# ----------------------------------------------------------------------------------------------
# Custom ops
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("dlrm_kernels::cross_layer", mutates_args=())
def _cross_layer_op(x0: Tensor, x: Tensor, u: Tensor, weight: Tensor, bias: Tensor, input_precision: str) -> tuple[Tensor, Tensor]:
    """Returns ``(out [M, N], pre [M, N])``; `pre` = ``u @ weight^T + bias``, saved for the backward."""
    out, pre = cross_forward(x0, x, u, weight, bias, input_precision, store_pre=True)
    return out, pre


@_cross_layer_op.register_fake
def _(x0, x, u, weight, bias, input_precision):
    return x0.new_empty(x0.shape), x0.new_empty(x0.shape)


@torch.library.custom_op("dlrm_kernels::cross_layer_backward", mutates_args=())
def _cross_layer_backward_op(
    grad_out: Tensor,
    x0: Tensor,
    pre: Tensor,
    u: Tensor,
    weight: Tensor,
    input_precision: str,
    need_x0: bool,
    need_u: bool,
    need_w: bool,
    need_b: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns ``(grad_x0 [M, N], grad_u [M, K], grad_w [N, K], grad_b [N])``; each unrequested one is
    empty [0]. (``grad_x`` is ``grad_out`` itself, passed on by the autograd formula.)"""
    need_pre = need_u or need_w
    gpre, gx0, gb = cross_elementwise_backward(grad_out, x0, pre, need_pre=need_pre, need_x0=need_x0, need_b=need_b)
    e = x0.new_empty(0)
    if gpre is not None and gpre.dtype != u.dtype:
        gpre = gpre.to(u.dtype)
    # grad_u [M, K] = grad_pre [M, N] @ W [N, K]: the "w" operand [K, N] is W^T (a view).
    gu = gemm_bias_act(gpre, weight.t(), input_precision=input_precision)[0] if need_u else e.clone()
    # grad_W [N, K] = grad_pre^T [N, M] @ u [M, K]: the "w" operand [K, M] is u^T (a view); split along M.
    gw = gemm_bias_act(gpre.t(), u.t(), input_precision=input_precision)[0] if need_w else e.clone()
    return (gx0 if gx0 is not None else e.clone()), gu, gw, (gb if gb is not None else e.clone())


@_cross_layer_backward_op.register_fake
def _(grad_out, x0, pre, u, weight, input_precision, need_x0, need_u, need_w, need_b):
    M, N = x0.shape
    K = u.shape[1]
    return (x0.new_empty((M, N) if need_x0 else (0,)), x0.new_empty((M, K) if need_u else (0,)),
            x0.new_empty((N, K) if need_w else (0,)), x0.new_empty((N,) if need_b else (0,)))


def _cross_setup(ctx, inputs, output):
    x0, x, u, weight, bias, input_precision = inputs
    out, pre = output
    ctx.mark_non_differentiable(pre)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x0, pre, u, weight)
    ctx.input_precision = input_precision


def _cross_backward(ctx, grad_out, _grad_pre):
    need_x0, need_x, need_u, need_w, need_b = ctx.needs_input_grad[:5]
    if grad_out is None:
        return None, None, None, None, None, None
    x0, pre, u, weight = ctx.saved_tensors
    gx0 = gu = gw = gb = None
    if need_x0 or need_u or need_w or need_b:
        gx0, gu, gw, gb = _cross_layer_backward_op(grad_out, x0, pre, u, weight, ctx.input_precision,
                                                   need_x0, need_u, need_w, need_b)
    return (gx0 if need_x0 else None, grad_out if need_x else None, gu if need_u else None,
            gw if need_w else None, gb if need_b else None, None)


_cross_layer_op.register_autograd(_cross_backward, setup_context=_cross_setup)


# ----------------------------------------------------------------------------------------------
# Python API
# ----------------------------------------------------------------------------------------------


def cross_layer(x0: Tensor, x: Tensor, u: Tensor, weight: Tensor, bias: Tensor, allow_tf32: Optional[bool] = None) -> Tensor:
    """``x0 * (u @ weight^T + bias) + x``: the second half of a cross layer (Triton, any strides).

    x0, x: [M, N]; u: [M, K] (= ``x V^T``); weight: [N, K]; bias: [N]. Returns [M, N] in x0's dtype
    (under CUDA autocast: the autocast dtype, the operands cast to it as autograd-recorded copies).
    Differentiable in all five. `allow_tf32`: None follows ``torch.backends.cuda.matmul``.

    Example (on the CPU the kernel runs in Triton's interpreter, TRITON_INTERPRET=1):
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> g = torch.Generator().manual_seed(0)
        >>> x0, x, u = (torch.randn(3, n, generator=g).to(device) for n in (5, 5, 2))
        >>> w, b = torch.randn(5, 2, generator=g).to(device), torch.randn(5, generator=g).to(device)
        >>> out = cross_layer(x0, x, u, w, b)
        >>> out.shape
        torch.Size([3, 5])
        >>> torch.allclose(out, cross_layer_reference(x0, x, u, w, b), atol=1e-5)
        True
    """
    if x0.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        dt = torch.get_autocast_dtype("cuda")
        x0, x, u, weight, bias = (t.to(dt) for t in (x0, x, u, weight, bias))
    else:  # one dtype for the kernel: x0's
        x, u, weight, bias = (t.to(x0.dtype) for t in (x, u, weight, bias))
    out, _ = _cross_layer_op(x0, x, u, weight, bias, resolve_input_precision(x0, allow_tf32))
    return out


def cross_layer_reference(x0: Tensor, x: Tensor, u: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """Plain-torch :func:`cross_layer`."""
    return x0 * (u @ weight.t() + bias) + x


def low_rank_cross_net(input: Tensor, W_kernels, V_kernels, biases, allow_tf32: Optional[bool] = None) -> Tensor:
    """All layers of a low-rank cross network: ``x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l``.

    ``V_l x_l`` is a torch ``F.linear`` (cuBLAS), the rest of each layer `cross_layer`. Returns [B, N].

    Args:
        input: ``x_0`` [B, N].
        W_kernels, V_kernels, biases: per layer l, ``W_l`` [N, r], ``V_l`` [r, N] and ``b_l`` [N] (the
            parameter lists of `TritonLowRankCrossNet`).
        allow_tf32: as `cross_layer`'s.

    Example (on the CPU the kernel runs in Triton's interpreter, TRITON_INTERPRET=1):
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> net = TritonLowRankCrossNet(in_features=12, num_layers=2, low_rank=3).to(device)
        >>> x0 = torch.randn(5, 12, device=device)
        >>> y = low_rank_cross_net(x0, net.W_kernels, net.V_kernels, net.bias, allow_tf32=False)
        >>> x1 = x0 * (x0 @ net.V_kernels[0].T @ net.W_kernels[0].T + net.bias[0]) + x0   # layer 0 by hand
        >>> x2 = x0 * (x1 @ net.V_kernels[1].T @ net.W_kernels[1].T + net.bias[1]) + x1
        >>> y.shape, torch.allclose(y, x2, atol=1e-4)
        (torch.Size([5, 12]), True)
    """
    x0 = input
    x = x0
    for W, V, b in zip(W_kernels, V_kernels, biases):
        u = nn.functional.linear(x, V)  # [B, r]
        x = cross_layer(x0, x, u, W, b, allow_tf32)
    return x


class TritonLowRankCrossNet(nn.Module):
    """Drop-in for the eager ``LowRankCrossNet`` (TorchRec's): each layer's second GEMM and its cross
    epilogue in the Triton kernel (`cross_layer`), the first GEMM in cuBLAS.

    Args:
        in_features: N.
        num_layers: cross layers (>= 1).
        low_rank: r (>= 1).
        allow_tf32: fp32 GEMMs on TF32 tensor cores; None follows ``torch.backends.cuda.matmul``.

    Parameters, state_dict keys and init as TorchRec's ``LowRankCrossNet`` (and
    ``dlrm.model.archs.LowRankCrossNet``): ``W_kernels.<l>`` [N, r] and ``V_kernels.<l>`` [r, N]
    xavier-normal (all W, then all V: the same RNG state gives the same weights), ``bias.<l>`` [N] zeros.

    Example (on the CPU the kernel runs in Triton's interpreter, TRITON_INTERPRET=1):
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> net = TritonLowRankCrossNet(in_features=12, num_layers=2, low_rank=3).to(device)
        >>> net(torch.randn(5, 12, device=device)).shape
        torch.Size([5, 12])
        >>> list(net.state_dict())
        ['W_kernels.0', 'W_kernels.1', 'V_kernels.0', 'V_kernels.1', 'bias.0', 'bias.1']

    Shapes: [B, N] -> [B, N].
    """

    def __init__(self, in_features: int, num_layers: int, low_rank: int = 1, allow_tf32: Optional[bool] = None) -> None:
        super().__init__()
        if num_layers < 1 or low_rank < 1:
            raise ValueError(f"num_layers ({num_layers}) and low_rank ({low_rank}) must be >= 1")
        self.in_features = in_features
        self._num_layers = num_layers
        self._low_rank = low_rank
        self.allow_tf32 = allow_tf32
        self.W_kernels = nn.ParameterList(
            nn.Parameter(nn.init.xavier_normal_(torch.empty(in_features, low_rank))) for _ in range(num_layers)
        )
        self.V_kernels = nn.ParameterList(
            nn.Parameter(nn.init.xavier_normal_(torch.empty(low_rank, in_features))) for _ in range(num_layers)
        )
        self.bias = nn.ParameterList(nn.Parameter(torch.zeros(in_features)) for _ in range(num_layers))

    def forward(self, input: Tensor) -> Tensor:
        if input.dim() != 2 or input.shape[1] != self.in_features:
            raise ValueError(f"input must be [B, {self.in_features}], got {tuple(input.shape)}")
        return low_rank_cross_net(input, self.W_kernels, self.V_kernels, self.bias, self.allow_tf32)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, num_layers={self._num_layers}, low_rank={self._low_rank}"
