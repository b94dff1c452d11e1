"""Fused linear layer: ``act(x @ W^T + b)`` in one Triton GEMM with the bias and activation in its
epilogue, and a backward with the activation's derivative fused.

Forward: one tiled ``tl.dot`` kernel (fp32 accumulator, grouped tile order for L2 reuse, masks for
any M, N, K -- M=1, K=13 and N=1 included). The epilogue adds the bias, applies the activation and
writes the output, plus the pre-activation when the derivative needs it (gelu, squared_relu); for
none/relu/sigmoid the derivative comes from the output, which is saved at no extra memory cost.

Precision: fp32 inputs use TF32 tensor cores on the GPU when ``allow_tf32`` is True, by default
following ``torch.backends.cuda.matmul`` (``fp32_precision == "tf32"`` / ``allow_tf32``, i.e. what
cuBLAS would do for ``nn.Linear``); otherwise, and always under the interpreter, ``"ieee"`` fp32.
bf16/fp16 inputs run bf16/fp16 tensor-core products accumulated in fp32.

Backward (all Triton, no cuBLAS):

1. ``grad_pre = grad_out * act'(saved)`` and the column sums for ``grad_b`` in ONE fused elementwise
   pass (`kernels.epilogue.act_backward`, first stage of a deterministic two-stage reduction).
   ``grad_pre`` is materialised once rather than recomputed in the prologue of each backward GEMM:
   both GEMMs need it, the bias gradient needs it, and recomputing would read two [M, N] tensors
   per GEMM (and per tile revisit) instead of one. For ``activation="none"`` nothing is written and
   the GEMMs read ``grad_out`` directly through its strides (expanded stride-0 gradients included).
2. ``grad_x = grad_pre @ W`` and ``grad_W = grad_pre^T @ x`` with the same GEMM kernel as the
   forward (no bias/activation); transposes are stride swaps, never copies. ``grad_W`` reduces
   over the whole batch into a small output, so it is split along the batch (split-K, `_split_k`:
   partial sums per slice in an fp32 workspace, summed in a fixed order) to give every SM work.

Tile configs (named, in `kernels.heuristics.GEMM_TILES`): on the GPU one tile picked from the shape,
dtype and the device's SM count by `kernels.heuristics.pick_gemm_tile` (no start-up cost), or, with
``DLRM_TRITON_AUTOTUNE=1`` in the environment, the best of all tiles measured per (M, N, K). Autotuning is opt-in because it compiles and times every config
for every GEMM shape of the model (forward, grad_x and grad_W of each layer: 21 shapes x 8 configs
for the Kaggle model), which took about two minutes before the first training step on an H100;
`benchmarks/gpu_suite.sh` turns it on. Under the interpreter one fixed config with wide tiles (its
cost is per program and per loop step).
"""

from __future__ import annotations

import os

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor, nn

from kernels import heuristics
from kernels._backend import (INT32_OFFSET_LIMIT, check_gemm_dtype, check_triton_device, device_context,
                              interpret_mode, needs_int64_offsets)
from kernels.activations import act_forward, activation_code, apply_activation, check_activation, derivative_from_output
from kernels.epilogue import act_backward
from kernels.heuristics import GemmTile

_INTERPRET = interpret_mode()


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def _linear_kernel(
    a_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    pre_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    stride_split,
    K_PER_SPLIT,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    STORE_PRE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    INT64_OFFSETS: tl.constexpr = False,
):
    """out[m, n] = act(sum_k a[m, k] * w[n, k] + bias[n]); pre (optional) = the argument of act.

    a: [M, K], w: [N, K], both through arbitrary strides; out/pre: [M, N] with strides (om, on).
    Split-K: program (tile, s) sums only k in [s * K_PER_SPLIT, (s + 1) * K_PER_SPLIT) and writes
    its partial sums at ``out + s * stride_split`` (an fp32 [S, M, N] workspace, no bias or
    activation); without splitting K_PER_SPLIT = K and the grid's second axis is 1.
    INT64_OFFSETS: 64-bit offsets, for operands with element offsets of 2^31 or more (the weight gradient's
    ``a = grad_pre^T`` walks the batch along K); the workspace's ``pid_k * stride_split`` stays below 2^31
    (`_plan_splits`).
    """
    # Grouped ("super-tile") program order: GROUP_M row-tiles share each column tile of w in L2.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    pid_k = tl.program_id(1)
    if INT64_OFFSETS:  # rows, columns, K and the loop's pointer steps in 64 bits (kernels._backend.needs_int64_offsets)
        pid_m = pid_m.to(tl.int64)
        pid_n = pid_n.to(tl.int64)
        stride_ak = tl.cast(stride_ak, tl.int64)
        stride_wk = tl.cast(stride_wk, tl.int64)
    k_start = pid_k * K_PER_SPLIT
    k_len = tl.minimum(K - k_start, K_PER_SPLIT)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rm[:, None] * stride_am + (k_start + rk)[None, :] * stride_ak
    w_ptrs = w_ptr + (k_start + rk)[:, None] * stride_wk + rn[None, :] * stride_wn  # [BLOCK_K, BLOCK_N] tile of w^T
    m_ok = rm[:, None] < M
    n_ok = rn[None, :] < N

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Loop count from tl.cdiv (not range(0, K, BLOCK_K)): same code compiled, and the form the
    # interpreter handles on every supported triton/numpy pair.
    for kt in range(0, tl.cdiv(k_len, BLOCK_K)):
        k_left = k_len - kt * BLOCK_K
        a = tl.load(a_ptrs, mask=m_ok & (rk[None, :] < k_left), other=0.0)
        w = tl.load(w_ptrs, mask=(rk[:, None] < k_left) & n_ok, other=0.0)
        acc = tl.dot(a, w, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk

    if HAS_BIAS:
        b = tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        acc += b[None, :]
    o_offs = pid_k * stride_split + rm[:, None] * stride_om + rn[None, :] * stride_on
    o_mask = m_ok & n_ok
    if STORE_PRE:
        tl.store(pre_ptr + o_offs, acc.to(pre_ptr.dtype.element_ty), mask=o_mask)
    y = act_forward(acc, ACTIVATION)
    tl.store(out_ptr + o_offs, y.to(out_ptr.dtype.element_ty), mask=o_mask)


AUTOTUNE = os.environ.get("DLRM_TRITON_AUTOTUNE", "0") not in ("", "0") and not _INTERPRET
_linear_kernel_autotuned = triton.autotune(
    configs=[tile.config() for tile in heuristics.gemm_tiles(_INTERPRET)], key=["M", "N", "K"]
)(_linear_kernel)


def _pick_tile(M: int, N: int, dtype: torch.dtype, device: torch.device) -> GemmTile:
    """The tile of an unautotuned launch: the interpreter's one, or `heuristics.pick_gemm_tile`."""
    if _INTERPRET:
        return heuristics.INTERPRETER_GEMM_TILE
    return heuristics.pick_gemm_tile(M, N, dtype, heuristics.sm_count(device))


def _split_k(M: int, N: int, K: int, tile: GemmTile, device: torch.device) -> int:
    """Slices of the reduction for a plain GEMM (`heuristics.split_k_slices`); the interpreter never
    splits on its own (its cost is per program: more slices only cost more)."""
    if _INTERPRET:
        return 1
    return heuristics.split_k_slices(M, N, K, tile, heuristics.sm_count(device))


# ----------------------------------------------------------------------------------------------
# Host launchers
# ----------------------------------------------------------------------------------------------


def _check_precision(input_precision: str) -> str:
    if input_precision not in ("ieee", "tf32"):
        raise ValueError(f"input_precision must be 'ieee' or 'tf32', got {input_precision!r}")
    return input_precision


def _check_gemm_operands(a: Tensor, w: Tensor, bias: Optional[Tensor]) -> None:
    if a.dim() != 2 or w.dim() != 2 or a.shape[1] != w.shape[1]:
        raise ValueError(f"gemm shapes do not match: a {tuple(a.shape)} @ w^T with w {tuple(w.shape)}")
    if a.device != w.device or (bias is not None and bias.device != a.device):
        raise ValueError("all operands must be on the same device")
    if bias is not None and tuple(bias.shape) != (w.shape[0],):  # the kernel reads bias[n] for n < N: no more, no less
        raise ValueError(f"bias must be [{w.shape[0]}] (w's rows), got shape {tuple(bias.shape)}")
    check_gemm_dtype(a.dtype, "fused linear kernels")  # float64: garbage without an error (kernels._backend)
    check_triton_device(a.device, "fused linear kernels")


def _empty_reduction(out: Tensor, pre: Optional[Tensor], bias: Optional[Tensor], activation: str) -> None:
    """K == 0: ``out = act(bias)`` (torch handles it better than a zero-trip loop behind masks)."""
    h = torch.zeros(out.shape, device=out.device, dtype=torch.float32)
    if bias is not None:
        h += bias.float()
    out.copy_(apply_activation(h, activation))
    if pre is not None:
        pre.copy_(h)


def _plan_splits(M: int, N: int, K: int, tile: GemmTile, plain: bool, split_k: Optional[int], device) -> tuple[int, int]:
    """``(slices, K per slice)``: `split_k` as asked, the heuristic's choice for plain GEMMs, else 1.

    K per slice is a whole number of BLOCK_K steps, and the slice count is recomputed from it so that
    no slice is empty. The fp32 [slices, M, N] workspace stays below 2^31 elements, so that the kernel's 32-bit
    ``pid_k * stride_split`` cannot wrap (the heuristic's workspaces are orders of magnitude smaller; only a huge
    `split_k` is cut)."""
    if split_k is not None and split_k > 1 and not plain:
        raise ValueError("split_k > 1 is for plain GEMMs (no bias, activation or pre-activation)")
    splits = (split_k or 1) if (split_k is not None or not plain) else _split_k(M, N, K, tile, device)
    splits = min(splits, max(1, INT32_OFFSET_LIMIT // (M * N)))
    k_per_split = triton.cdiv(triton.cdiv(K, splits), tile.block_k) * tile.block_k
    return triton.cdiv(K, k_per_split), k_per_split


def _launch_gemm(a, w, bias, target, pre, activation, prec, tile: GemmTile, splits: int, k_per_split: int) -> None:
    """One launch of the GEMM kernel into ``target`` ([M, N], or the fp32 [splits, M, N] workspace).

    Split GEMMs run the picked tile (autotuning, when on, covers the unsplit ones)."""
    M, K = a.shape
    N = w.shape[0]

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]), splits)

    if AUTOTUNE and splits == 1:
        kernel, launch = _linear_kernel_autotuned, {}
    else:
        kernel, launch = _linear_kernel, tile.launch_kwargs()
    with device_context(a):
        kernel[grid](
            a,
            w,
            bias if bias is not None else a,
            target,
            pre if pre is not None else target,
            M,
            N,
            K,
            a.stride(0),
            a.stride(1),
            w.stride(0),
            w.stride(1),
            target.stride(-2),
            target.stride(-1),
            target.stride(0) if splits > 1 else 0,
            k_per_split,
            HAS_BIAS=bias is not None,
            ACTIVATION=activation_code(activation),
            STORE_PRE=pre is not None,
            INPUT_PRECISION=prec,
            INT64_OFFSETS=needs_int64_offsets(a, w, target, pre),
            **launch,
        )


def gemm_bias_act(
    a: Tensor,
    w: Tensor,
    bias: Optional[Tensor] = None,
    activation: str = "none",
    store_pre: bool = False,
    input_precision: str = "ieee",
    split_k: Optional[int] = None,
) -> tuple[Tensor, Optional[Tensor]]:
    """Launch the GEMM: ``out = act(a @ w^T + bias)`` for a [M, K] and w [N, K] of any strides (pass
    ``t.t()`` views for transposed operands). Returns ``(out [M, N], pre [M, N] or None)`` in a's dtype.

    `split_k`: cut the reduction into this many slices (partial sums in an fp32 workspace, then
    summed in a fixed order: deterministic); None picks it from the shape (`_split_k`) for plain
    GEMMs (no bias, activation or pre-activation), which is what the weight gradient is."""
    _check_gemm_operands(a, w, bias)
    _check_precision(input_precision)  # on every device and dtype (as cross_forward / mlp_tail): CPU runs catch it too
    if w.dtype != a.dtype:
        w = w.to(a.dtype)  # tl.dot needs matching operand types
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()  # the kernel reads bias[n] at bias_ptr + n (a slice or an expanded bias: wrong values)
    M, K = a.shape
    N = w.shape[0]
    out = torch.empty((M, N), device=a.device, dtype=a.dtype)
    pre = torch.empty((M, N), device=a.device, dtype=a.dtype) if store_pre else None
    if M == 0 or N == 0:
        return out, pre
    if K == 0:
        _empty_reduction(out, pre, bias, activation)
        return out, pre
    # tf32 applies to fp32 operands only; other dtypes ignore the setting, so pin it to ieee.
    prec = input_precision if a.dtype == torch.float32 and not _INTERPRET else "ieee"
    tile = _pick_tile(M, N, a.dtype, a.device)
    plain = bias is None and activation == "none" and not store_pre
    splits, k_per_split = _plan_splits(M, N, K, tile, plain, split_k, a.device)
    target = out if splits == 1 else torch.empty((splits, M, N), device=a.device, dtype=torch.float32)
    _launch_gemm(a, w, bias, target, pre, activation, prec, tile, splits, k_per_split)
    if splits > 1:
        out.copy_(target.sum(0))  # fixed-order sum of the slices: deterministic
    return out, pre


# ----------------------------------------------------------------------------------------------
# Custom ops
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("dlrm_kernels::linear_act", mutates_args=())
def _linear_act_op(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str, input_precision: str
) -> tuple[Tensor, Tensor]:
    """Returns ``(out [M, N], pre)``; `pre` is the pre-activation when the backward needs it
    (gelu, squared_relu), else an empty [0] tensor (custom ops cannot return None)."""
    store_pre = not derivative_from_output(activation)
    out, pre = gemm_bias_act(x, weight, bias, activation, store_pre, input_precision)
    return out, pre if pre is not None else x.new_empty(0)


@_linear_act_op.register_fake
def _(x, weight, bias, activation, input_precision):
    M, N = x.shape[0], weight.shape[0]
    store_pre = not derivative_from_output(activation)
    return x.new_empty((M, N)), x.new_empty((M, N) if store_pre else (0,))


@torch.library.custom_op("dlrm_kernels::linear_act_backward", mutates_args=())
def _linear_act_backward_op(
    grad_out: Tensor,
    saved: Tensor,
    x: Tensor,
    weight: Tensor,
    activation: str,
    input_precision: str,
    need_x: bool,
    need_w: bool,
    need_b: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns ``(grad_x [M, K], grad_w [N, K], grad_b [N])``; each unrequested one is empty [0]."""
    if activation == "none" and not need_b:
        grad_pre = grad_out  # act' == 1: the GEMMs read grad_out through its strides
        grad_b = None
    elif activation == "none":
        _, grad_b = act_backward(grad_out, saved, activation, True, write_pre=False, bias_grad=True)
        grad_pre = grad_out
    else:
        grad_pre, grad_b = act_backward(grad_out, saved, activation, derivative_from_output(activation), bias_grad=need_b)
    if grad_pre.dtype != x.dtype:
        grad_pre = grad_pre.to(x.dtype)
    e = x.new_empty(0)
    # grad_x [M, K] = grad_pre [M, N] @ W [N, K]: "w" operand [K, N] is W^T (a view).
    grad_x = gemm_bias_act(grad_pre, weight.t(), input_precision=input_precision)[0] if need_x else e
    # grad_W [N, K] = grad_pre^T [N, M] @ x [M, K]: "w" operand [K, M] is x^T (a view).
    grad_w = gemm_bias_act(grad_pre.t(), x.t(), input_precision=input_precision)[0] if need_w else e.clone()
    return grad_x, grad_w, grad_b if grad_b is not None else e.clone()


@_linear_act_backward_op.register_fake
def _(grad_out, saved, x, weight, activation, input_precision, need_x, need_w, need_b):
    M, K = x.shape
    N = weight.shape[0]
    return x.new_empty((M, K) if need_x else (0,)), x.new_empty((N, K) if need_w else (0,)), x.new_empty((N,) if need_b else (0,))


def _linear_setup(ctx, inputs, output):
    x, weight, bias, activation, input_precision = inputs
    out, pre = output
    ctx.mark_non_differentiable(pre)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(out if derivative_from_output(activation) else pre, x, weight)
    ctx.activation, ctx.input_precision = activation, input_precision
    ctx.dtypes = (x.dtype, weight.dtype, bias.dtype if bias is not None else None)


def _linear_backward(ctx, grad_out, _grad_pre):
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    if grad_out is None or not (need_x or need_w or need_b):
        return None, None, None, None, None
    saved, x, weight = ctx.saved_tensors
    gx, gw, gb = _linear_act_backward_op(grad_out, saved, x, weight, ctx.activation, ctx.input_precision, need_x, need_w, need_b)
    xd, wd, bd = ctx.dtypes
    return gx.to(xd) if need_x else None, gw.to(wd) if need_w else None, gb.to(bd) if need_b else None, None, None


_linear_act_op.register_autograd(_linear_backward, setup_context=_linear_setup)


# ----------------------------------------------------------------------------------------------
# Thin function and module
# ----------------------------------------------------------------------------------------------


@torch.compiler.assume_constant_result
def _default_allow_tf32() -> bool:
    """Whether cuBLAS would use TF32 for an fp32 ``nn.Linear`` right now.

    Reads the new API (``torch.backends.cuda.matmul.fp32_precision``, torch >= 2.9) first, because
    on those versions reading the legacy ``allow_tf32`` raises once the two APIs were mixed. Treated
    as a constant by torch.compile (read at trace time, not guarded).
    """
    matmul = torch.backends.cuda.matmul
    prec = getattr(matmul, "fp32_precision", None)
    if prec == "none":  # inherit the global setting
        prec = getattr(torch.backends, "fp32_precision", None)
    if prec in ("tf32", "ieee"):
        return prec == "tf32"
    try:
        return bool(matmul.allow_tf32)
    except RuntimeError:
        return False


def resolve_input_precision(x: Tensor, allow_tf32: Optional[bool] = None) -> str:
    """``"tf32"`` or ``"ieee"`` for ``tl.dot`` on `x`: tf32 only for fp32 CUDA tensors outside the
    interpreter, when `allow_tf32` (default: torch's cuBLAS setting) says so."""
    if _INTERPRET or x.dtype != torch.float32 or x.device.type != "cuda":
        return "ieee"
    if allow_tf32 is None:
        allow_tf32 = _default_allow_tf32()
    return "tf32" if allow_tf32 else "ieee"


def linear_act(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    activation: str = "none",
    allow_tf32: Optional[bool] = None,
) -> Tensor:
    """``act(x @ weight^T + bias)``: returns [..., N] in x's dtype (under CUDA autocast: the autocast dtype, as
    nn.Linear). Differentiable in x, weight and bias.

    Args:
        x: [..., K] (any strides for 2-D input; other ranks are flattened to [M, K]).
        weight: [N, K].
        bias: [N] or None.
        activation: one of `kernels.activations.ACTIVATIONS`, applied in the GEMM's epilogue.
        allow_tf32: None follows ``torch.backends.cuda.matmul``; ignored for non-fp32 and on the CPU.

    Example (on the CPU the kernel runs in Triton's interpreter, TRITON_INTERPRET=1):
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> x, w, b = torch.randn(4, 6, device=device), torch.randn(3, 6, device=device), torch.randn(3, device=device)
        >>> y = linear_act(x, w, b, "relu", allow_tf32=False)
        >>> y.shape, torch.allclose(y, torch.relu(x @ w.T + b), atol=1e-5)
        (torch.Size([4, 3]), True)
    """
    check_activation(activation)
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x [..., {x.shape[-1]}] does not match weight {tuple(weight.shape)} ([N, K])")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    if x.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        # Like nn.Linear under autocast: run in the autocast dtype (bf16/fp16); the casts are recorded
        # by autograd, so fp32 parameters get fp32 gradients. (Custom ops get no autocast by default.)
        dt = torch.get_autocast_dtype("cuda")
        x, weight = x.to(dt), weight.to(dt)
        bias = bias.to(dt) if bias is not None else None
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    out, _ = _linear_act_op(x2, weight, bias, activation, resolve_input_precision(x, allow_tf32))
    return out if x.dim() == 2 else out.view(*x.shape[:-1], weight.shape[0])


class TritonLinear(nn.Module):
    """Drop-in for ``nn.Linear`` (+ a functional activation): ``act(x @ weight^T + bias)``.

    Parameters ``weight`` [out_features, in_features] and ``bias`` [out_features] have nn.Linear's
    names, state_dict keys and default init (its ``reset_parameters`` is reused, so the same RNG
    state gives the same weights).

    Args:
        in_features, out_features, bias, device, dtype: as ``nn.Linear``.
        activation: one of `kernels.activations.ACTIVATIONS`, applied in the GEMM's epilogue.
        allow_tf32: fp32 inputs on the GPU use TF32 tensor cores (None: follow ``torch.backends.cuda.matmul``);
            ignored for 16-bit inputs and on the CPU.

    Example:
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> layer = TritonLinear(6, 3, activation="relu", allow_tf32=False).to(device)
        >>> x = torch.randn(4, 6, device=device)
        >>> layer(x).shape, list(layer.state_dict())
        (torch.Size([4, 3]), ['weight', 'bias'])
        >>> torch.allclose(layer(x), torch.relu(x @ layer.weight.T + layer.bias), atol=1e-5)
        True

    Shapes: [..., in_features] -> [..., out_features].
    """

    __constants__ = ["in_features", "out_features", "activation"]

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        activation: str = "none",
        allow_tf32: Optional[bool] = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.in_features = in_features
        self.out_features = out_features
        self.activation = check_activation(activation)
        self.allow_tf32 = allow_tf32
        self.weight = nn.Parameter(torch.empty((out_features, in_features), **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.Linear.reset_parameters(self)  # type: ignore[arg-type]  # same init, same RNG draws

    @classmethod
    def from_linear(cls, linear: nn.Linear, activation: str = "none", allow_tf32: Optional[bool] = None) -> "TritonLinear":
        """A TritonLinear sharing `linear`'s parameters (no copy)."""
        m = cls(linear.in_features, linear.out_features, bias=False, activation=activation, allow_tf32=allow_tf32, device="meta")
        m.weight = linear.weight
        m.bias = linear.bias
        return m

    def forward(self, x: Tensor) -> Tensor:
        return linear_act(x, self.weight, self.bias, self.activation, self.allow_tf32)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, activation={self.activation!r}"
        )


__all__ = ["TritonLinear", "gemm_bias_act", "linear_act", "resolve_input_precision"]
