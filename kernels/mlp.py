"""Fused MLP: the whole ReLU layer chain of DLRM's bottom / top MLP as ONE autograd node.

Forward, per layer: one GEMM with the bias and the ReLU in its epilogue. On CUDA that is cuBLASLt's
``RELU_BIAS`` epilogue as PyTorch exposes it, ``torch._addmm_activation(bias, x, W^T)`` (bf16, fp16
and fp32 -- TF32 when ``torch.backends.cuda.matmul`` allows it, exactly as ``nn.Linear``; where
cuBLASLt's conditions do not hold, torch falls back to addmm + an in-place relu, same result);
elsewhere ``addmm`` followed by an in-place ``relu_``. Either way the pre-activation never stays in
memory: only each layer's post-ReLU output is kept, and ReLU'(z) is read from it (``out > 0``).
A layer without activation (the top MLP's logit layer) is a plain ``addmm``.

Backward, per layer from the last one down (`_mlp_backward_op`):

1. ONE Triton kernel (`_mask_bias_kernel`) reads the incoming gradient once (any strides), writes
   the masked gradient ``gm = grad * (out > 0)`` (contiguous) and per-program fp32 partial column
   sums; a tiny second kernel (`kernels.col_sum`) adds them in a fixed order (deterministic bias
   gradient). Without activation nothing is written: the GEMMs read the incoming gradient as is.
2. The data-gradient GEMM ``gm @ W`` (cuBLAS, on the current stream: the critical path to the next
   layer down), skipped for the first layer when the MLP's input needs no gradient (the bottom
   MLP's dense features).
3. The weight-gradient GEMM ``gm^T @ x`` (cuBLAS) on a second CUDA stream, which waits on an event
   recorded after step 1 and overlaps the data-gradient chain; the current stream waits on the side
   stream once before the op returns (fork / join: legal inside CUDA-graph capture, and every tensor
   the side stream touches is allocated on the current stream and alive until the join, so the
   caching allocator never hands its memory out early). That for 32-bit operands; 16-bit ones run them in series
   on the current stream (`SIDE_STREAM`: measured on H200s, the tf32 Kaggle and Terabyte steps were 1.1-1.8%
   faster with the side stream, the bf16 MLPerf DLRM-DCNv2 step, held at the GPU's power cap where overlap buys
   nothing, ~0.4% faster in series on average over three machines; results/mlpstream_h200_b.md).

The two halves are ``torch.library`` custom ops (``dlrm_kernels::mlp_forward`` / ``mlp_backward``)
with fake and autograd registrations, so torch.compile traces a module using them without graph
breaks (the ops stay opaque: streams, events and cuBLASLt calls included) and autograd sees one node
for the whole chain.

Off CUDA the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, fp32): the same op,
with the same Triton mask kernel, and sequential GEMMs.

Measured on an H100 (benchmarks/results/mlp.md, train_throughput_kaggle_fusedmlp.md, 2026-11-24), why
this design and where it stands: against the eager MLP (cuBLAS GEMMs, separate bias/ReLU/mask kernels)
forward + backward is 1.21-1.41x faster at batch 65536 in tf32 and 1.38-1.43x for the bottom MLPs in
bf16; against Inductor's compiled MLP it wins in tf32 but loses the Kaggle top MLP in bf16 (1.16 vs
0.69 ms), where Inductor fuses the elementwise work across layers. In the whole Kaggle step it is +5%
(tf32, 65536) and -14% (bf16, 65536), so ``kernels.mlp: "auto"`` keeps the PyTorch MLPs
(dlrm.train.fast_path) and this module is an explicit opt-in. The earlier Triton linear kernel
(kernels/linear.py) lost to cuBLAS in the backward; here every GEMM stays cuBLAS(Lt) and only the
elementwise work is fused. Not built: several layers in one kernel with activations on chip.

Module: `FusedMLP` has the eager ``dlrm.model.archs.MLP``'s constructor (in_features, widths,
activation, activate_last; ``linear_cls`` and ``dropout`` only in their neutral values), parameters,
init (same RNG draws) and state_dict keys (``layers.<i>.weight`` / ``layers.<i>.bias``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor, nn

from kernels import heuristics
from kernels._backend import (check_gemm_dtype, check_same_device, check_triton_device, device_context, interpret_mode,
                              needs_int64_offsets)
from kernels.col_sum import sum_partial_rows

__all__ = ["FusedMLP", "build_fused_layers", "fused_mlp", "mask_bias_grad", "SUPPORTED_ACTIVATIONS"]

_INTERPRET = interpret_mode()

SUPPORTED_ACTIVATIONS = ("relu", "none")

# Mask kernel tiles: BLOCK_M rows per loop step, up to _MAX_BLOCK_N columns per program; each program
# walks `rows_per_program` rows (a multiple of BLOCK_M), so the partial sums are [programs_m, N]. BLOCK_M, the warps
# and the programs a SM per GPU: `kernels.heuristics.mask_bias_launch`; `MASK_LAUNCH_OVERRIDE` forces a launch
# (benchmarks/mask_bias_launches.py); the interpreter takes 64 rows a step (fewer loop steps), 4 warps, 4 programs.
MASK_LAUNCH_OVERRIDE: Optional[tuple[int, int, int]] = None
_INTERPRETER_MASK_LAUNCH = (64, 4, 4)
_MAX_BLOCK_N = 128


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _mask_bias_kernel(
    g_ptr,
    out_ptr,
    gm_ptr,
    partial_ptr,
    M,
    N,
    stride_gm,
    stride_gn,
    stride_om,
    stride_on,
    ROWS_PER_PROG,
    RELU: tl.constexpr,
    WRITE: tl.constexpr,
    BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INT64_OFFSETS: tl.constexpr = False,
):
    """gm = g * (out > 0) (written contiguous [M, N] when WRITE) and partial[pid_m, :] = the column
    sums of gm over this program's rows [pid_m * ROWS_PER_PROG, (pid_m + 1) * ROWS_PER_PROG).
    INT64_OFFSETS: 64-bit offsets (an operand reaches 2^31 elements, `kernels._backend.needs_int64_offsets`)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if INT64_OFFSETS:
        pid_m = pid_m.to(tl.int64)
        pid_n = pid_n.to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn[None, :] < N
    row0 = pid_m * ROWS_PER_PROG
    row_end = tl.minimum(row0 + ROWS_PER_PROG, M)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for i in range(0, tl.cdiv(row_end - row0, BLOCK_M)):
        rm = row0 + i * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rm[:, None] < row_end) & n_ok
        g = tl.load(g_ptr + rm[:, None] * stride_gm + rn[None, :] * stride_gn, mask=mask, other=0.0).to(tl.float32)
        if RELU:
            o = tl.load(out_ptr + rm[:, None] * stride_om + rn[None, :] * stride_on, mask=mask, other=0.0)
            g = tl.where(o.to(tl.float32) > 0.0, g, 0.0)
        g = tl.where(mask, g, 0.0)
        if WRITE:
            tl.store(gm_ptr + rm[:, None] * N + rn[None, :], g.to(gm_ptr.dtype.element_ty), mask=mask)
        if BIAS:
            acc += tl.sum(g, axis=0)
    if BIAS:
        tl.store(partial_ptr + pid_m * N + rn, acc, mask=rn < N)


# ----------------------------------------------------------------------------------------------
# Host launchers
# ----------------------------------------------------------------------------------------------


def _block_n(n: int) -> int:
    return min(_MAX_BLOCK_N, max(16, triton.next_power_of_2(max(n, 1))))


def _mask_launch(device: torch.device) -> tuple[int, int, int]:
    """(rows a loop step, warps, programs a SM) of the mask kernel on ``device``."""
    if MASK_LAUNCH_OVERRIDE is not None:
        return MASK_LAUNCH_OVERRIDE
    return _INTERPRETER_MASK_LAUNCH if _INTERPRET else heuristics.mask_bias_launch(device)


def _rows_per_program(M: int, col_blocks: int, device: torch.device, block_m: int, programs_per_sm: int) -> int:
    """Rows each program of the mask kernel walks: enough programs to fill the GPU (a few per SM),
    no more (each writes one row of partial sums); the interpreter takes all rows in one program
    per column block (its cost is per program and per loop step)."""
    if _INTERPRET:
        return max(block_m, triton.cdiv(M, block_m) * block_m)
    programs_m = max(1, (programs_per_sm * heuristics.sm_count(device)) // col_blocks)
    return triton.cdiv(triton.cdiv(M, programs_m), block_m) * block_m


def mask_bias_grad(grad: Tensor, out: Optional[Tensor], relu: bool, *, write: bool = True,
                   bias_grad: bool = True) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """``(grad * (out > 0) [M, N] contiguous if write, its column sums [N] if bias_grad)``.

    `grad` and `out` ([M, N], any strides; `out` unused when not `relu`) are read once; the masked
    gradient is written in grad's dtype, the column sums are accumulated in fp32 per program and
    summed in a fixed order (deterministic), returned in grad's dtype. Without `relu` the masked
    gradient is `grad` itself: pass ``write=False`` and use `grad`.
    """
    if grad.dim() != 2:
        raise ValueError(f"grad must be 2-D [M, N], got shape {tuple(grad.shape)}")
    if relu and (out is None or out.shape != grad.shape):
        raise ValueError("relu needs the layer's output, of grad's shape")
    # fp32 arithmetic: a float64 gradient came back rounded to fp32; an output of another device read bad memory
    check_gemm_dtype(grad.dtype, "the fused MLP's mask kernel", "the PyTorch MLPs")
    if relu:
        check_same_device("mask_bias_grad", grad=grad, out=out)
    check_triton_device(grad.device, "the fused MLP's mask kernel")
    M, N = grad.shape
    dev, dt = grad.device, grad.dtype
    gm = torch.empty((M, N), device=dev, dtype=dt) if write else None
    gb = torch.empty((N,), device=dev, dtype=dt) if bias_grad else None
    if M == 0 or N == 0:
        if gm is not None:
            gm.zero_()
        if gb is not None:
            gb.zero_()
        return gm, gb
    bn = _block_n(N)
    col_blocks = triton.cdiv(N, bn)
    block_m, warps, programs_per_sm = _mask_launch(dev)
    rows = _rows_per_program(M, col_blocks, dev, block_m, programs_per_sm)
    programs_m = triton.cdiv(M, rows)
    partial = torch.empty((programs_m, N), device=dev, dtype=torch.float32) if bias_grad else None
    o = out if relu else grad  # never read without relu; any valid pointer will do
    with device_context(grad):
        _mask_bias_kernel[(programs_m, col_blocks)](
            grad, o, gm if gm is not None else grad, partial if partial is not None else grad,
            M, N, grad.stride(0), grad.stride(1), o.stride(0), o.stride(1), rows,
            RELU=relu, WRITE=write, BIAS=bias_grad, BLOCK_M=block_m, BLOCK_N=bn,
            INT64_OFFSETS=needs_int64_offsets(grad, o, gm, partial), num_warps=warps,
        )  # fmt: skip
        if bias_grad:
            sum_partial_rows(partial, gb, bn)
    return gm, gb


_SIDE_STREAMS: dict[int, "torch.cuda.Stream"] = {}
# The weight-gradient GEMMs on the side stream (True) or in series on the current stream (False); None (the default)
# picks by the operands' width (`_use_side_stream`). Module-level, for A/B measurements (gpu_suite.sh parts
# mlperf:mlpstream and onehot:mlpstream, alternating True and False in one process). Measured on H200s
# (results/mlpstream_h200_b.md): tf32 Kaggle 1.6-1.8% and Terabyte 1.1-1.4% faster with the side stream, both at batch
# 65536; the bf16 MLPerf DLRM-DCNv2 step, the one 16-bit model "auto" runs this MLP for, held at the 700 W power cap
# (where overlap buys no time: PERF.md, thirty-sixth run), 0.3-0.6% and 0.7-1.5% faster in series on two machines and
# 0.1-0.3% slower on a third: ~0.4% on average, within the machines' spread. Not measured on an H100.
SIDE_STREAM: Optional[bool] = None


def _use_side_stream(device: torch.device, dtype: torch.dtype, need_w: list[bool]) -> bool:
    """Whether the weight-gradient GEMMs go to the side stream: on CUDA, with a weight gradient to compute, by
    `SIDE_STREAM`, or when it is None for 32-bit operands only.

        >>> _use_side_stream(torch.device("cuda"), torch.float32, [True]), _use_side_stream(torch.device("cuda"),
        ...     torch.bfloat16, [True]), _use_side_stream(torch.device("cpu"), torch.float32, [True])
        (True, False, False)
    """
    if device.type != "cuda" or not any(need_w):
        return False
    return SIDE_STREAM if SIDE_STREAM is not None else dtype.itemsize >= 4


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    """The weight-gradient stream of `device` (one per device, created on first use, reused: a
    stream made during a capture would be fine too, but one per call would pile up)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        stream = _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


# Pad the first layer's K to 16 bytes (`_input_layer_operands`); module-level, so that a benchmark can compare.
ALIGN_INPUT = True


def _aligned_k(k: int, dtype: torch.dtype) -> int:
    """``k`` rounded up to 16 bytes of ``dtype``: the row alignment cuBLAS's Hopper kernels need."""
    per = max(1, 16 // torch.empty(0, dtype=dtype).element_size())
    return -(-k // per) * per


def _pad_k(t: Tensor, k: int) -> Tensor:
    """``t`` [M, K] with zero columns up to ``k`` (contiguous)."""
    return torch.nn.functional.pad(t, (0, k - t.shape[1]))


def _input_layer_operands(x: Tensor, weight: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor]]:
    """The first layer's ``(x, W)``, padded with zero columns to an aligned K (on every device, so that the CPU
    tests run the same path).

    The bottom MLP's input has 13 dense features: rows of 26 bytes in bf16, which cuBLAS serves with
    alignment-1 CUTLASS kernels (sm75 tensor-core code). At MLPerf DLRM-DCNv2's batch 65536 on an H100 those
    took 0.065 ms (forward) and 0.080 ms (weight gradient) a step (results/step_profile_mlperf_b65536_twentyfirst.md);
    zero columns change no product, cost a [B, 16] copy, and let cuBLAS pick its Hopper kernels. ``weight`` None:
    ``x`` alone (the backward pads only the weight gradient's operand: a padded weight there was two wasted kernels
    a step)."""
    k = _aligned_k(x.shape[1], x.dtype)
    if not ALIGN_INPUT or k == x.shape[1]:
        return x, weight
    return _pad_k(x, k), (None if weight is None else _pad_k(weight, k))


def _layer_forward(h: Tensor, weight: Tensor, bias: Tensor, relu: bool) -> Tensor:
    """``relu?(h @ W^T + b)`` with the bias (and ReLU) in the GEMM's epilogue where the backend has one."""
    if not relu:
        return torch.addmm(bias, h, weight.t())
    if h.device.type == "cuda":
        return torch._addmm_activation(bias, h, weight.t(), use_gelu=False)
    return torch.addmm(bias, h, weight.t()).relu_()  # in place: the pre-activation is not kept


# ----------------------------------------------------------------------------------------------
# Custom ops
# ----------------------------------------------------------------------------------------------


def _check_operands(x: Tensor, weights: list[Tensor], biases: list[Tensor], relu: list[bool]) -> None:
    if not (len(weights) == len(biases) == len(relu)) or not weights:
        raise ValueError(f"need one weight, bias and relu flag per layer (>= 1), got {len(weights)}, {len(biases)}, {len(relu)}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [B, in_features], got shape {tuple(x.shape)}")
    # refused at the forward, not at the backward's mask kernel (fp32): the float64 gradients came back fp32-rounded
    check_gemm_dtype(x.dtype, "the fused MLP's kernels", "the PyTorch MLPs")
    k = x.shape[1]
    for i, (w, b) in enumerate(zip(weights, biases)):
        if w.dim() != 2 or w.shape[1] != k or b.shape != (w.shape[0],):
            raise ValueError(f"layer {i}: weight {tuple(w.shape)} / bias {tuple(b.shape)} do not follow width {k}")
        if w.dtype != x.dtype or b.dtype != x.dtype or w.device != x.device or b.device != x.device:
            raise ValueError(f"layer {i}: weight and bias must have x's dtype and device ({x.dtype}, {x.device})")
        k = w.shape[0]


@torch.library.custom_op("dlrm_kernels::mlp_forward", mutates_args=())
def _mlp_forward_op(x: Tensor, weights: list[Tensor], biases: list[Tensor], relu: list[bool]) -> list[Tensor]:
    """Every layer's output ``[B, widths[i]]`` (the last is the MLP's; the others are what the
    backward needs: the post-ReLU activations, which are also the next layer's inputs)."""
    _check_operands(x, weights, biases, relu)
    outs = []
    h, w0 = _input_layer_operands(x, weights[0])
    for w, b, r in zip([w0, *weights[1:]], biases, relu):
        h = _layer_forward(h, w, b, r)
        outs.append(h)
    return outs


@_mlp_forward_op.register_fake
def _(x, weights, biases, relu):
    return [x.new_empty((x.shape[0], w.shape[0])) for w in weights]


@torch.library.custom_op("dlrm_kernels::mlp_backward", mutates_args=())
def _mlp_backward_op(
    grad: Tensor,
    x: Tensor,
    weights: list[Tensor],
    outs: list[Tensor],
    relu: list[bool],
    need_x: bool,
    need_w: list[bool],
    need_b: list[bool],
) -> list[Tensor]:
    """``[grad_x, grad_W_0 .. grad_W_{L-1}, grad_b_0 .. grad_b_{L-1}]``; each unrequested one is an
    empty [0] tensor (custom ops cannot return None)."""
    n = len(weights)
    # distinct empty tensors: the returns of a custom op may not alias one another
    gws: list[Tensor] = [x.new_empty(0) for _ in range(n)]
    gbs: list[Tensor] = [x.new_empty(0) for _ in range(n)]
    gx = x.new_empty(0)
    # the lowest layer whose gradient is asked for: the data-gradient chain stops there
    lowest = -1 if need_x else min([i for i in range(n) if need_w[i] or need_b[i]], default=n)
    side = _use_side_stream(x.device, x.dtype, need_w)
    if side:
        main = torch.cuda.current_stream(x.device)
        stream = _side_stream(x.device)
    keep = []  # what the side stream reads, alive until the join below
    g = grad
    for i in range(n - 1, -1, -1):
        if i < lowest:
            break
        if relu[i]:
            gm, gb = mask_bias_grad(g, outs[i], True, bias_grad=need_b[i])
        else:
            gm = g
            gb = mask_bias_grad(g, None, False, write=False)[1] if need_b[i] else None
        if gb is not None:
            gbs[i] = gb
        inp = x if i == 0 else outs[i - 1]
        if need_w[i]:
            # the first layer's input padded as in the forward (`_input_layer_operands`); the zero columns'
            # gradient is cut off
            inp_k = _input_layer_operands(inp, None)[0] if i == 0 else inp  # x only: the weight gradient's operand
            if side:
                gw = torch.empty(weights[i].shape, device=x.device, dtype=x.dtype)  # on the current stream
                gw_k = gw if inp_k is inp else torch.empty((gw.shape[0], inp_k.shape[1]), device=x.device, dtype=x.dtype)
                stream.wait_stream(main)
                with torch.cuda.stream(stream):
                    torch.mm(gm.t(), inp_k, out=gw_k)
                    if gw_k is not gw:
                        gw.copy_(gw_k[:, : gw.shape[1]])
                keep += [gm, inp_k, gw_k]
            else:
                gw = torch.mm(gm.t(), inp_k)
                if inp_k is not inp:
                    gw = gw[:, : inp.shape[1]].contiguous()
            gws[i] = gw
        if i > lowest:
            g = torch.mm(gm, weights[i])  # data gradient: the critical path, on the current stream
            if i == 0:
                gx = g
    if side:
        main.wait_stream(stream)
        del keep
    return [gx, *gws, *gbs]


@_mlp_backward_op.register_fake
def _(grad, x, weights, outs, relu, need_x, need_w, need_b):
    gx = x.new_empty(tuple(x.shape) if need_x else (0,))
    gws = [x.new_empty(tuple(w.shape) if nw else (0,)) for w, nw in zip(weights, need_w)]
    gbs = [x.new_empty((w.shape[0],) if nb else (0,)) for w, nb in zip(weights, need_b)]
    return [gx, *gws, *gbs]


def _mlp_setup(ctx, inputs, output):
    x, weights, biases, relu = inputs
    ctx.n = len(weights)
    ctx.relu = list(relu)
    ctx.mark_non_differentiable(*output[:-1])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, *weights, *output)


def _mlp_backward(ctx, grads):
    n = ctx.n
    g = grads[-1]
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    need_w = list(need_w) if isinstance(need_w, (list, tuple)) else [bool(need_w)] * n
    need_b = list(need_b) if isinstance(need_b, (list, tuple)) else [bool(need_b)] * n
    if g is None or not (need_x or any(need_w) or any(need_b)):
        return None, [None] * n, [None] * n, None
    saved = ctx.saved_tensors
    x, weights, outs = saved[0], list(saved[1 : 1 + n]), list(saved[1 + n :])
    res = _mlp_backward_op(g, x, weights, outs, ctx.relu, bool(need_x), need_w, need_b)
    gx = res[0] if need_x else None
    gws = [t if nw else None for t, nw in zip(res[1 : 1 + n], need_w)]
    gbs = [t if nb else None for t, nb in zip(res[1 + n :], need_b)]
    return gx, gws, gbs, None


_mlp_forward_op.register_autograd(_mlp_backward, setup_context=_mlp_setup)


# ----------------------------------------------------------------------------------------------
# Thin function and module
# ----------------------------------------------------------------------------------------------


def fused_mlp(x: Tensor, weights: list[Tensor], biases: list[Tensor], relu: list[bool]) -> Tensor:
    """``h_{i+1} = relu?(h_i @ W_i^T + b_i)`` for each layer (``relu[i]`` picks the activation),
    h_0 = x [B, K] (any strides); returns [B, widths[-1]] in x's dtype, or under CUDA autocast in the
    autocast dtype (as nn.Linear: the casts are recorded by autograd, fp32 parameters get fp32
    gradients). Differentiable in x, every weight and every bias; one autograd node.

    Args:
        x: [B, K], the first layer's input.
        weights: ``W_i`` [widths[i], width of its input] per layer.
        biases: ``b_i`` [widths[i]] per layer.
        relu: per layer, whether ReLU follows it.

    Example (on the CPU the kernels run in Triton's interpreter, TRITON_INTERPRET=1):
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> x, w0, w1 = (torch.randn(*s, device=device) for s in ((4, 6), (3, 6), (2, 3)))
        >>> b0, b1 = torch.randn(3, device=device), torch.randn(2, device=device)
        >>> y = fused_mlp(x, [w0, w1], [b0, b1], [True, False])   # ReLU after layer 0 only
        >>> y.shape, torch.allclose(y, torch.relu(x @ w0.T + b0) @ w1.T + b1, atol=1e-4)
        (torch.Size([4, 2]), True)
    """
    if x.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        dt = torch.get_autocast_dtype("cuda")
        x = x.to(dt)
        weights = [w.to(dt) for w in weights]
        biases = [b.to(dt) for b in biases]
    elif x.device.type != "cuda" and torch.is_autocast_enabled(x.device.type):
        # Off CUDA the kernels run in fp32 (the interpreter), as kernels.linear's layers do there; under the CPU's bf16
        # autocast the interaction hands over bf16 activations, which were refused beside the fp32 weights (a
        # traceback at the first step of kernels.mlp "fused" with train.precision "bf16"): the op runs in the weights'
        # dtype with autocast off (left on, it cast the op's operands to bf16 and its backward mixed the dtypes)
        with torch.autocast(x.device.type, enabled=False):
            return _mlp_forward_op(x.to(weights[0].dtype), list(weights), list(biases), [bool(r) for r in relu])[-1]
    outs = _mlp_forward_op(x, list(weights), list(biases), [bool(r) for r in relu])
    return outs[-1]


class FusedMLP(nn.Module):
    """Swap-in for ``dlrm.model.archs.MLP`` with ReLU: the whole layer chain fused (module docstring).

    Args (the eager MLP's):
        in_features: input width.
        widths: output width of each layer.
        activation: "relu" (or "none"); any other raises ValueError (only ReLU has the fused path).
        activate_last: apply the activation after the last layer too (False for the top MLP).
        linear_cls: must be None (accepted so the eager MLP's keyword arguments pass through).
        dropout: must be 0 (no dropout between fused layers).

    Parameters, init and state_dict keys as the eager MLP: ``layers.<i>.weight`` [widths[i], in],
    ``layers.<i>.bias`` [widths[i]] (nn.Linear modules holding them, built and initialised in the
    same order, so the same seed gives the same values); ``activations`` lists each layer's name.

    Example:
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> mlp = FusedMLP(13, [8, 1], activate_last=False).to(device)
        >>> mlp(torch.randn(3, 13, device=device)).shape, mlp.activations
        (torch.Size([3, 1]), ['relu', 'none'])
        >>> list(mlp.state_dict())
        ['layers.0.weight', 'layers.0.bias', 'layers.1.weight', 'layers.1.bias']

    Shapes: [B, in_features] -> [B, widths[-1]].
    """

    def __init__(
        self,
        in_features: int,
        widths: list[int],
        activation: str = "relu",
        activate_last: bool = True,
        linear_cls: Optional[type] = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.activations, self.layers = build_fused_layers(type(self).__name__, in_features, widths, activation,
                                                           activate_last, linear_cls, dropout)
        self.dropout = None

    def forward(self, x: Tensor) -> Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        out = fused_mlp(x2, [l.weight for l in self.layers], [l.bias for l in self.layers],
                        [a == "relu" for a in self.activations])  # fmt: skip
        return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, activations={self.activations}"


def build_fused_layers(
    owner: str,
    in_features: int,
    widths: list[int],
    activation: str,
    activate_last: bool,
    linear_cls: Optional[type],
    dropout: float,
) -> tuple[list[str], nn.ModuleList]:
    """``(activations, layers)`` of an MLP module that runs its own fused layers with the eager
    ``dlrm.model.archs.MLP``'s constructor (`FusedMLP`, ``kernels.mlp_tail_module.OnChipTailMLP``): each layer's
    activation name ("none" for the last one unless ``activate_last``) and the ``nn.Linear`` layers, built and
    initialised in the eager MLP's order (same seed, same values). ``owner`` names the module in the errors: an
    activation other than relu / none, a ``linear_cls``, dropout or no layer is a ValueError.

        >>> acts, layers = build_fused_layers("FusedMLP", 13, [8, 1], "relu", False, None, 0.0)
        >>> acts, [tuple(l.weight.shape) for l in layers]
        (['relu', 'none'], [(8, 13), (1, 8)])
    """
    if activation not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"{owner} fuses only {SUPPORTED_ACTIVATIONS}, not activation={activation!r} (use the eager MLP)")
    if linear_cls is not None:
        raise ValueError(f"{owner} runs its own layers: linear_cls must be None")
    if dropout:
        raise ValueError(f"{owner} has no dropout between its fused layers (dropout={dropout}); use the eager MLP")
    if not widths:
        raise ValueError(f"{owner} needs at least one layer")
    dims = [in_features, *widths]
    acts = [activation] * len(widths)
    if not activate_last:
        acts[-1] = "none"
    layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
    for layer in layers:
        _init_linear_(layer)
    return acts, layers


def _init_linear_(layer: nn.Linear) -> None:
    """``dlrm.model.archs.init_linear_`` (this package imports nothing from dlrm): the reference DLRM's
    N(0, sqrt(2/(fan_in+fan_out))) weights, N(0, sqrt(1/fan_out)) bias, drawn in the same order."""
    fan_out, fan_in = layer.weight.shape
    with torch.no_grad():
        layer.weight.normal_(0.0, math.sqrt(2.0 / (fan_in + fan_out)))
        layer.bias.normal_(0.0, math.sqrt(1.0 / fan_out))
