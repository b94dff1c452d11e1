"""On-chip MLP tail: a chain of narrow layers (input and every width <= 256) in ONE Triton kernel per
direction, the intermediate activations kept on chip (issue #20).

Notation: ``M`` rows (the batch), ``L`` layers (1 <= L <= `MAX_LAYERS`), layer ``l`` maps width
``K_l`` to ``N_l`` (``K_0`` the input width, ``K_{l+1} = N_l``) with weight ``W_l`` [N_l, K_l] and
bias ``b_l`` [N_l]; ``h_0 = x`` [M, K_0], ``z_l = h_l @ W_l^T + b_l``, ``h_{l+1} = act_l(z_l)``
(``act_l``: ReLU or none, per layer, as `kernels.mlp`'s ``relu: list[bool]``). ``g = dloss/dh_L``.
``KP``/``NP``: a width padded to a ``tl.dot`` tile (a power of two, >= 16: the 1-wide logit is a
16-wide tile, its 15 padding columns masked to zero).

Where it applies: the narrow suffix of DLRM's MLPs, after the wide layers -- Kaggle bottom
256-64-16, Kaggle top 256-1, Terabyte/MLPerf bottom 256-128, MLPerf top 256-1. `OnChipTailMLP` runs
the wide head of a chain through `kernels.mlp.fused_mlp` (cuBLAS(Lt) GEMMs) and its tail through
this kernel.

Forward (`_tail_fwd_kernel`, one program per BLOCK_M rows): load the x tile [BLOCK_M, KP_0] (any
strides), then per layer load ``W_l`` [NP_l, KP_l] and ``b_l`` (the weights are tiny and stay in
L2), ``z = tl.dot(h, W^T)`` with an fp32 accumulator, add the bias, apply the activation, round to
the input dtype (as the eager bf16 MLP rounds each layer's output) and feed the next layer from
registers. Only the final output [M, N_{L-1}] is written.

What the backward needs, by bytes: it reads x anyway (for dW_0 and dx), and the final output is
returned anyway; keeping the intermediate ``h_1 .. h_{L-1}`` would cost a write in the forward plus
a read in the backward (Kaggle's bottom tail in bf16: h_1 is 64 wide, 2 x 64 x 2 = 256 bytes a row,
+16% over the ~1.6 KB a row the tail moves without it: x read twice and dx written, 512 bytes each).
Recomputing them costs the forward's FLOPs again (2 x 256 x 64 a row for that layer), and the
whole backward stays at ~90 FLOP per byte moved, under the H100's bf16 and tf32 ridge points
(~300 and ~150). So nothing but the output is written, and the backward recomputes the chain on
chip: ReLU'(z_l) is
read as ``h_{l+1} > 0`` from the recomputed value (the same code as the forward, so the same value
up to the GPU's dot instruction choice; a flip could only happen where z rounds to 0, where both
choices are a valid subgradient and the output is ~0 either way).

Backward (`_tail_bwd_kernel`, persistent: `P` programs, each walking a contiguous range of
row blocks): per row block, recompute ``h_1 .. h_L`` (``h_L`` only if the last layer has a ReLU:
it is needed only for the mask), load ``g`` (any strides; stride 0 too), then from the last layer
down ``gm_l = g_l * (h_{l+1} > 0)`` (or ``g_l``), accumulate ``dW_l += gm_l^T @ h_l`` and
``db_l += colsum(gm_l)`` in fp32 registers across the program's row blocks, and
``g_{l-1} = gm_l @ W_l`` on chip; the first layer's data gradient is written as dx only when the
input needs one (the bottom MLP's input is data). At the end each program writes its fp32 partial
``[dW_0, db_0, dW_1, db_1, ...]`` (one row of a [P, S] buffer, ``S = sum(N_l K_l + N_l)``) and
`kernels.col_sum.sum_partial_rows` adds the P rows in a fixed order, writing the gradients in the input
dtype. Deterministic: every program sums its rows in a fixed order and P depends only on M, the
widths, the launch and the GPU, so two runs are bitwise equal. Why partials: dW reduces over all M
rows into at most 256 x 256 values per layer; fp32 atomics would be faster to write but not
deterministic, and a separate GEMM would read x and the masked gradients again (the bytes this
kernel exists to save). With persistent programs the partials are small: one fp32 row per program,
P = one program per SM by default, 132 x 70 KB = 9 MB for Kaggle's bottom tail (one row per 64-row
block would be 71 MB at batch 65536, twice the bf16 x), summed by one small launch.

Precision: 16-bit operands with fp32 accumulation; fp32 operands in TF32 or exact ``"ieee"`` products as
``torch.backends.cuda.matmul`` allows (or ``allow_tf32``), exactly as ``nn.Linear`` would. fp32 was refused on
CUDA for a day: the H100 tests disagreed with float64 on a few units in TF32. A diagnostic over seven launches
(2026-11-24, tenth session) found exact fp32 right everywhere, and the TF32 mismatches identical for every
launch: they were the test's ReLU-edge replay through cuBLAS, which does not round like the kernel's TF32
products. The tests now take the kernel's own decisions near the edge (its forward over the chain's first
layers) and pass in fp32, TF32 and bf16 on the H100. Under CUDA autocast the thin function casts to the
autocast dtype first (as `kernels.mlp.fused_mlp`).

Launch: `tail_launch` picks BLOCK_M, num_warps, num_stages and for the backward its programs per SM
and two code variants (RELOAD: h_0 and W_0 loaded again for their transposed uses; HOIST_W: the
weights loaded once per program) from the widths and dtype: a heuristic from what the kernels
compile to for sm_90 (shared memory, spills), not yet timed; `TAIL_LAUNCH_OVERRIDE` forces one.
Measured in benchmarks/mlp.py (impl ``tail``, opt-in), against the compiled and fused MLPs
(``results/mlp_tail.md``, H100): in bf16 it wins only on Kaggle's bottom MLP (-10% at batch 2048,
-2% at 65536 against the fused MLP) and loses or ties elsewhere (Kaggle top: 1.14 ms against the
compiled MLP's 0.92 at 65536; MLPerf bottom: 0.60 against 0.57), about 0.01 ms of a step at best. So
``kernels.mlp: "auto"`` never picks it and no config names it: `OnChipTailMLP` is an opt-in module.

File layout: ``@triton.jit`` kernels, host launchers, the ``torch.library`` custom ops
(``dlrm_kernels::mlp_tail_forward`` / ``mlp_tail_backward``, fake and autograd registrations), the
thin function `tail_mlp`; the launch heuristic (`TailLaunch`, `tail_launch`) lives in
`kernels.heuristics`, the module (`OnChipTailMLP`, the eager ``dlrm.model.archs.MLP``'s constructor,
parameters, init and state_dict keys, and `split_tail`) in `kernels.mlp_tail_module`.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import heuristics
from kernels.heuristics import TailLaunch, tail_launch
from kernels._backend import check_gemm_dtype, check_triton_device, device_context, interpret_mode
from kernels.col_sum import sum_partial_rows
from kernels.linear import resolve_input_precision

__all__ = ["MAX_LAYERS", "MAX_WIDTH", "TailLaunch", "tail_launch", "tail_mlp"]

_INTERPRET = interpret_mode()

MAX_WIDTH = 256  # the widest input or layer the kernel keeps on chip
MAX_LAYERS = 4  # layers per launch (the kernel is unrolled per layer; DLRM's tails have 1 or 2)

_COL_BLOCK = 128  # columns per program of the partial-sum reduction (kernels.col_sum)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _load_w(w_ptr, N: tl.constexpr, K: tl.constexpr, NP: tl.constexpr, KP: tl.constexpr):
    """W [N, K] (contiguous) as an [NP, KP] tile, zero outside."""
    rn = tl.arange(0, NP)
    rk = tl.arange(0, KP)
    return tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)


@triton.jit
def _load_wt(w_ptr, N: tl.constexpr, K: tl.constexpr, NP: tl.constexpr, KP: tl.constexpr):
    """W^T: W [N, K] (contiguous) as a [KP, NP] tile, zero outside."""
    rn = tl.arange(0, NP)
    rk = tl.arange(0, KP)
    return tl.load(w_ptr + rk[:, None] + rn[None, :] * K, mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)


@triton.jit
def _affine(h, w, b_ptr, N: tl.constexpr, NP: tl.constexpr, RELU: tl.constexpr, PREC: tl.constexpr):
    """act(h @ w^T + b) in fp32: h [BLOCK_M, KP], w [NP, KP] -> [BLOCK_M, NP]; the padding columns
    stay 0 (zero weight rows and bias)."""
    z = tl.dot(h, tl.trans(w), input_precision=PREC)
    rn = tl.arange(0, NP)
    z += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    if RELU:
        z = tl.maximum(z, 0.0)
    return z


@triton.jit
def _layer_bwd(gm, h_in, w, dw, db, NEED_G: tl.constexpr, PREC: tl.constexpr):
    """One layer's backward on chip from its masked gradient gm [BLOCK_M, NP] (fp32):
    ``dw += gm^T @ h_in``, ``db += colsum(gm)`` (fp32 accumulators), and the next layer down's
    gradient ``gm @ w`` [BLOCK_M, KP] (fp32) when NEED_G (else gm, unused)."""
    gm = gm.to(h_in.dtype)  # the GEMM operand dtype (bf16 gradients, as the eager bf16 MLP's)
    db += tl.sum(gm.to(tl.float32), axis=0)
    dw = tl.dot(tl.trans(gm), h_in, dw, input_precision=PREC)
    if NEED_G:
        g_in = tl.dot(gm, w, input_precision=PREC)
    else:
        g_in = gm.to(tl.float32)
    return g_in, dw, db


@triton.jit
def _store_partial(base, dw, db, N: tl.constexpr, K: tl.constexpr, NP: tl.constexpr, KP: tl.constexpr):
    """dW [N, K] then db [N] at ``base`` (a slice of this program's row of partials)."""
    rn = tl.arange(0, NP)
    rk = tl.arange(0, KP)
    tl.store(base + rn[:, None] * K + rk[None, :], dw, mask=(rn[:, None] < N) & (rk[None, :] < K))
    tl.store(base + N * K + rn, db, mask=rn < N)


@triton.jit
def _tail_fwd_kernel(
    x_ptr,
    out_ptr,
    w0_ptr,
    b0_ptr,
    w1_ptr,
    b1_ptr,
    w2_ptr,
    b2_ptr,
    w3_ptr,
    b3_ptr,
    M,
    stride_xm,
    stride_xk,
    L: tl.constexpr,
    K0: tl.constexpr,
    N0: tl.constexpr,
    N1: tl.constexpr,
    N2: tl.constexpr,
    N3: tl.constexpr,
    KP0: tl.constexpr,
    NP0: tl.constexpr,
    NP1: tl.constexpr,
    NP2: tl.constexpr,
    NP3: tl.constexpr,
    R0: tl.constexpr,
    R1: tl.constexpr,
    R2: tl.constexpr,
    R3: tl.constexpr,
    N_OUT: tl.constexpr,
    NP_OUT: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """out[rows] = h_L of this program's BLOCK_M rows; h_1 .. h_{L-1} never leave the chip."""
    pid = tl.program_id(0)
    rm = (pid * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    m_ok = rm < M
    rk = tl.arange(0, KP0)
    h = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xk,
                mask=m_ok[:, None] & (rk[None, :] < K0), other=0.0)  # fmt: skip
    dt = h.dtype
    h = _affine(h, _load_w(w0_ptr, N0, K0, NP0, KP0), b0_ptr, N0, NP0, R0, PREC).to(dt)
    if L > 1:
        h = _affine(h, _load_w(w1_ptr, N1, N0, NP1, NP0), b1_ptr, N1, NP1, R1, PREC).to(dt)
    if L > 2:
        h = _affine(h, _load_w(w2_ptr, N2, N1, NP2, NP1), b2_ptr, N2, NP2, R2, PREC).to(dt)
    if L > 3:
        h = _affine(h, _load_w(w3_ptr, N3, N2, NP3, NP2), b3_ptr, N3, NP3, R3, PREC).to(dt)
    rn = tl.arange(0, NP_OUT)
    tl.store(out_ptr + rm[:, None] * N_OUT + rn[None, :], h, mask=m_ok[:, None] & (rn[None, :] < N_OUT))


@triton.jit
def _tail_bwd_kernel(
    x_ptr,
    g_ptr,
    dx_ptr,
    part_ptr,
    w0_ptr,
    b0_ptr,
    w1_ptr,
    b1_ptr,
    w2_ptr,
    b2_ptr,
    w3_ptr,
    b3_ptr,
    M,
    ROWS_PER_PROG,
    S,
    stride_xm,
    stride_xk,
    stride_gm,
    stride_gn,
    L: tl.constexpr,
    K0: tl.constexpr,
    N0: tl.constexpr,
    N1: tl.constexpr,
    N2: tl.constexpr,
    N3: tl.constexpr,
    KP0: tl.constexpr,
    NP0: tl.constexpr,
    NP1: tl.constexpr,
    NP2: tl.constexpr,
    NP3: tl.constexpr,
    R0: tl.constexpr,
    R1: tl.constexpr,
    R2: tl.constexpr,
    R3: tl.constexpr,
    N_OUT: tl.constexpr,
    NP_OUT: tl.constexpr,
    NEED_DX: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    RELOAD: tl.constexpr,
    HOIST_W: tl.constexpr,
):
    """Rows [pid * ROWS_PER_PROG, (pid + 1) * ROWS_PER_PROG): recompute the chain, the gradients
    down it on chip, dx (NEED_DX) and this program's fp32 partial [dW_0, db_0, dW_1, ...] at
    ``part_ptr + pid * S``."""
    pid = tl.program_id(0)
    row0 = pid * ROWS_PER_PROG
    row_end = tl.minimum(row0 + ROWS_PER_PROG, M)
    rk = tl.arange(0, KP0)
    rn = tl.arange(0, NP_OUT)
    dw0 = tl.zeros((NP0, KP0), dtype=tl.float32)
    db0 = tl.zeros((NP0,), dtype=tl.float32)
    if L > 1:
        dw1 = tl.zeros((NP1, NP0), dtype=tl.float32)
        db1 = tl.zeros((NP1,), dtype=tl.float32)
    if L > 2:
        dw2 = tl.zeros((NP2, NP1), dtype=tl.float32)
        db2 = tl.zeros((NP2,), dtype=tl.float32)
    if L > 3:
        dw3 = tl.zeros((NP3, NP2), dtype=tl.float32)
        db3 = tl.zeros((NP3,), dtype=tl.float32)
    if HOIST_W:  # the weights once per program, kept on chip across its row blocks
        w0 = _load_w(w0_ptr, N0, K0, NP0, KP0)
        if RELOAD:
            w0b = tl.trans(_load_wt(w0_ptr, N0, K0, NP0, KP0))
        if L > 1:
            w1 = _load_w(w1_ptr, N1, N0, NP1, NP0)
        if L > 2:
            w2 = _load_w(w2_ptr, N2, N1, NP2, NP1)
        if L > 3:
            w3 = _load_w(w3_ptr, N3, N2, NP3, NP2)
    for i in range(0, tl.cdiv(row_end - row0, BLOCK_M)):
        rm = (row0 + i * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        m_ok = rm < row_end
        h0 = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xk,
                     mask=m_ok[:, None] & (rk[None, :] < K0), other=0.0)  # fmt: skip
        dt = h0.dtype
        # recompute: h_{l+1} for every layer but the last, whose output only gives its ReLU mask
        if not HOIST_W:
            w0 = _load_w(w0_ptr, N0, K0, NP0, KP0)
        if L > 1 or R0:
            h1 = _affine(h0, w0, b0_ptr, N0, NP0, R0, PREC).to(dt)
        if L > 1:
            if not HOIST_W:
                w1 = _load_w(w1_ptr, N1, N0, NP1, NP0)
            if L > 2 or R1:
                h2 = _affine(h1, w1, b1_ptr, N1, NP1, R1, PREC).to(dt)
        if L > 2:
            if not HOIST_W:
                w2 = _load_w(w2_ptr, N2, N1, NP2, NP1)
            if L > 3 or R2:
                h3 = _affine(h2, w2, b2_ptr, N2, NP2, R2, PREC).to(dt)
        if L > 3:
            if not HOIST_W:
                w3 = _load_w(w3_ptr, N3, N2, NP3, NP2)
            if R3:
                h4 = _affine(h3, w3, b3_ptr, N3, NP3, R3, PREC).to(dt)
        # rows past the end load a zero gradient: they add nothing to dW, db and the data gradients
        g = tl.load(g_ptr + rm[:, None] * stride_gm + rn[None, :] * stride_gn,
                    mask=m_ok[:, None] & (rn[None, :] < N_OUT), other=0.0).to(tl.float32)  # fmt: skip
        # down the chain: mask by ReLU'(z_l) = h_{l+1} > 0, then dW_l, db_l and g_{l-1}
        if L > 3:
            if R3:
                g = tl.where(h4 > 0.0, g, 0.0)
            g, dw3, db3 = _layer_bwd(g, h3, w3, dw3, db3, True, PREC)
        if L > 2:
            if R2:
                g = tl.where(h3 > 0.0, g, 0.0)
            g, dw2, db2 = _layer_bwd(g, h2, w2, dw2, db2, True, PREC)
        if L > 1:
            if R1:
                g = tl.where(h2 > 0.0, g, 0.0)
            g, dw1, db1 = _layer_bwd(g, h1, w1, dw1, db1, True, PREC)
        if R0:
            g = tl.where(h1 > 0.0, g, 0.0)
        if RELOAD:
            # h_0 and W_0 loaded again for the GEMMs that read them transposed (distinct loads of the
            # transposed tiles, from L1 / L2): their shared-memory copies then live apart from the
            # recompute's instead of all four at once (fp32: 4 x 64 KB at 64 x 256 would not fit)
            h0 = tl.trans(tl.load(x_ptr + rk[:, None] * stride_xk + rm[None, :] * stride_xm,
                                  mask=(rk[:, None] < K0) & m_ok[None, :], other=0.0))  # fmt: skip
            if not HOIST_W:
                w0b = tl.trans(_load_wt(w0_ptr, N0, K0, NP0, KP0))
        else:
            w0b = w0
        g, dw0, db0 = _layer_bwd(g, h0, w0b, dw0, db0, NEED_DX, PREC)
        if NEED_DX:
            tl.store(dx_ptr + rm[:, None] * K0 + rk[None, :], g.to(dx_ptr.dtype.element_ty),
                     mask=m_ok[:, None] & (rk[None, :] < K0))  # fmt: skip
    base = part_ptr + pid.to(tl.int64) * S
    _store_partial(base, dw0, db0, N0, K0, NP0, KP0)
    if L > 1:
        _store_partial(base + N0 * K0 + N0, dw1, db1, N1, N0, NP1, NP0)
    if L > 2:
        _store_partial(base + N0 * K0 + N0 + N1 * N0 + N1, dw2, db2, N2, N1, NP2, NP1)
    if L > 3:
        _store_partial(base + N0 * K0 + N0 + N1 * N0 + N1 + N2 * N1 + N2, dw3, db3, N3, N2, NP3, NP2)


# ----------------------------------------------------------------------------------------------
# Host launchers
# ----------------------------------------------------------------------------------------------


# Forces (forward, backward) launches when set (benchmarks' sweeps, tests); read at every launch.
TAIL_LAUNCH_OVERRIDE: Optional[tuple[TailLaunch, TailLaunch]] = None


def _launch(dims: list[int], dtype: torch.dtype, backward: bool) -> TailLaunch:
    if TAIL_LAUNCH_OVERRIDE is not None:
        return TAIL_LAUNCH_OVERRIDE[1 if backward else 0]
    return tail_launch(dims, dtype, backward)


def _backward_programs(M: int, block_m: int, launch: TailLaunch, device: torch.device) -> int:
    """Programs of the backward: ``programs_per_sm`` per SM (each writes one row of partials), at
    most one per row block; one in the interpreter unless a forced launch asks for more (tests)."""
    blocks = triton.cdiv(M, block_m)
    if _INTERPRET and TAIL_LAUNCH_OVERRIDE is None:
        return 1
    return max(1, min(blocks, launch.programs_per_sm * heuristics.sm_count(device)))


def _check_tail(x: Tensor, weights: list[Tensor], biases: list[Tensor], relu: list[bool]) -> None:
    if not (len(weights) == len(biases) == len(relu)) or not 1 <= len(weights) <= MAX_LAYERS:
        raise ValueError(f"need one weight, bias and relu flag per layer, 1 to {MAX_LAYERS} layers; got "
                         f"{len(weights)}, {len(biases)}, {len(relu)}")  # fmt: skip
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    k = x.shape[1]
    for i, (w, b) in enumerate(zip(weights, biases)):
        if w.dim() != 2 or w.shape[1] != k or b.shape != (w.shape[0],):
            raise ValueError(f"layer {i}: weight {tuple(w.shape)} / bias {tuple(b.shape)} do not follow width {k}")
        if w.dtype != x.dtype or b.dtype != x.dtype or w.device != x.device or b.device != x.device:
            raise ValueError(f"layer {i}: weight and bias must have x's dtype and device ({x.dtype}, {x.device})")
        k = w.shape[0]
    # float64 (a .double() model) ran through fp32 tl.dot accumulators and came back float64 with fp32 accuracy, silently
    # (relative errors ~1e-8 on the GPU): refused, as the other GEMM kernels (kernels.linear, kernels.cross) refuse it
    check_gemm_dtype(x.dtype, "the on-chip MLP tail")
    widths = [x.shape[1], *(w.shape[0] for w in weights)]
    if max(widths) > MAX_WIDTH or min(widths) < 1:
        raise ValueError(f"the on-chip tail takes widths 1 to {MAX_WIDTH}, got {widths}")
    check_triton_device(x.device, "the on-chip MLP tail")


def _kernel_args(weights: list[Tensor], biases: list[Tensor], relu: list[bool], k0: int) -> tuple[list, dict]:
    """The per-layer pointers (unused layers: layer 0's, never read) and constexprs."""
    L = len(weights)
    ws = [w.contiguous() for w in weights]
    bs = [b.contiguous() for b in biases]
    ptrs = []
    for i in range(MAX_LAYERS):
        j = i if i < L else 0
        ptrs += [ws[j], bs[j]]
    ns = [w.shape[0] for w in ws] + [1] * (MAX_LAYERS - L)
    rs = [bool(r) for r in relu] + [False] * (MAX_LAYERS - L)
    meta = {"L": L, "K0": k0, "KP0": heuristics.dot_block(k0), "N_OUT": ns[L - 1], "NP_OUT": heuristics.dot_block(ns[L - 1])}
    for i in range(MAX_LAYERS):
        meta[f"N{i}"], meta[f"NP{i}"], meta[f"R{i}"] = ns[i], heuristics.dot_block(ns[i]), rs[i]
    return ptrs, meta


def _flat_size(x: Tensor, weights: list[Tensor]) -> int:
    """S: the elements of [dW_0, db_0, dW_1, db_1, ...]."""
    return sum(w.shape[0] * w.shape[1] + w.shape[0] for w in weights)


def _tail_forward(x: Tensor, weights: list[Tensor], biases: list[Tensor], relu: list[bool], prec: str) -> Tensor:
    M, K0 = x.shape
    out = torch.empty((M, weights[-1].shape[0]), device=x.device, dtype=x.dtype)
    if M == 0:
        return out
    ptrs, meta = _kernel_args(weights, biases, relu, K0)
    cfg = _launch([K0, *(w.shape[0] for w in weights)], x.dtype, backward=False)
    with device_context(x):
        _tail_fwd_kernel[(triton.cdiv(M, cfg.block_m),)](
            x, out, *ptrs, M, x.stride(0), x.stride(1), **meta, PREC=prec, BLOCK_M=cfg.block_m,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    return out


def _tail_backward(grad: Tensor, x: Tensor, weights: list[Tensor], biases: list[Tensor], relu: list[bool],
                   prec: str, need_x: bool) -> tuple[Tensor, Tensor]:
    """(dx [M, K_0] or an empty [0], the flat gradients [S] = [dW_0, db_0, dW_1, db_1, ...])."""
    M, K0 = x.shape
    S = _flat_size(x, weights)
    gx = torch.empty((M, K0), device=x.device, dtype=x.dtype) if need_x else x.new_empty(0)
    flat = torch.empty((S,), device=x.device, dtype=x.dtype)
    if M == 0:
        flat.zero_()
        return gx, flat
    ptrs, meta = _kernel_args(weights, biases, relu, K0)
    cfg = _launch([K0, *(w.shape[0] for w in weights)], x.dtype, backward=True)
    programs = _backward_programs(M, cfg.block_m, cfg, x.device)
    rows = triton.cdiv(triton.cdiv(M, cfg.block_m), programs) * cfg.block_m
    programs = triton.cdiv(M, rows)  # none empty
    partial = torch.empty((programs, S), device=x.device, dtype=torch.float32)
    with device_context(x):
        _tail_bwd_kernel[(programs,)](
            x, grad, gx if need_x else x, partial, *ptrs, M, rows, S, x.stride(0), x.stride(1),
            grad.stride(0), grad.stride(1), **meta, NEED_DX=need_x, PREC=prec, BLOCK_M=cfg.block_m,
            RELOAD=cfg.reload, HOIST_W=cfg.hoist, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
        sum_partial_rows(partial, flat, _COL_BLOCK)
    return gx, flat


# ----------------------------------------------------------------------------------------------
# Custom ops
# ----------------------------------------------------------------------------------------------


def _check_precision(input_precision: str) -> None:
    if input_precision not in ("ieee", "tf32"):
        raise ValueError(f"input_precision must be 'ieee' or 'tf32', got {input_precision!r}")


@torch.library.custom_op("dlrm_kernels::mlp_tail_forward", mutates_args=())
def _tail_forward_op(x: Tensor, weights: list[Tensor], biases: list[Tensor], relu: list[bool],
                     input_precision: str) -> Tensor:
    """The chain's output [M, N_{L-1}] (nothing else is kept: the backward recomputes)."""
    _check_tail(x, weights, biases, relu)
    _check_precision(input_precision)
    prec = input_precision if x.dtype == torch.float32 and not _INTERPRET else "ieee"
    return _tail_forward(x, weights, biases, relu, prec)


@_tail_forward_op.register_fake
def _(x, weights, biases, relu, input_precision):
    return x.new_empty((x.shape[0], weights[-1].shape[0]))


@torch.library.custom_op("dlrm_kernels::mlp_tail_backward", mutates_args=())
def _tail_backward_op(grad: Tensor, x: Tensor, weights: list[Tensor], biases: list[Tensor], relu: list[bool],
                      input_precision: str, need_x: bool) -> list[Tensor]:
    """``[grad_x (an empty [0] unless need_x), flat]`` with flat [S] = [dW_0, db_0, dW_1, db_1, ...]
    in x's dtype (one buffer: the autograd formula hands out views of it)."""
    _check_tail(x, weights, biases, relu)
    _check_precision(input_precision)
    if grad.shape != (x.shape[0], weights[-1].shape[0]):
        raise ValueError(f"grad must be [{x.shape[0]}, {weights[-1].shape[0]}], got {tuple(grad.shape)}")
    prec = input_precision if x.dtype == torch.float32 and not _INTERPRET else "ieee"
    gx, flat = _tail_backward(grad, x, weights, biases, relu, prec, need_x)
    return [gx, flat]


@_tail_backward_op.register_fake
def _(grad, x, weights, biases, relu, input_precision, need_x):
    gx = x.new_empty(tuple(x.shape) if need_x else (0,))
    return [gx, x.new_empty((_flat_size(x, weights),))]


def _tail_setup(ctx, inputs, output):
    x, weights, biases, relu, input_precision = inputs
    ctx.n = len(weights)
    ctx.relu = list(relu)
    ctx.input_precision = input_precision
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, *weights, *biases)


def _tail_backward_formula(ctx, g):
    n = ctx.n
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    need_w = list(need_w) if isinstance(need_w, (list, tuple)) else [bool(need_w)] * n
    need_b = list(need_b) if isinstance(need_b, (list, tuple)) else [bool(need_b)] * n
    if g is None or not (need_x or any(need_w) or any(need_b)):
        return None, [None] * n, [None] * n, None, None
    saved = ctx.saved_tensors
    x, weights, biases = saved[0], list(saved[1 : 1 + n]), list(saved[1 + n :])
    gx, flat = _tail_backward_op(g, x, weights, biases, ctx.relu, ctx.input_precision, bool(need_x))
    gws, gbs, off = [], [], 0
    for w, nw, nb in zip(weights, need_w, need_b):
        N, K = w.shape
        gws.append(flat[off : off + N * K].view(N, K) if nw else None)
        gbs.append(flat[off + N * K : off + N * K + N] if nb else None)
        off += N * K + N
    return (gx if need_x else None), gws, gbs, None, None


_tail_forward_op.register_autograd(_tail_backward_formula, setup_context=_tail_setup)


# ----------------------------------------------------------------------------------------------
# Thin function and module
# ----------------------------------------------------------------------------------------------


def tail_mlp(x: Tensor, weights: list[Tensor], biases: list[Tensor], relu: list[bool],
             allow_tf32: Optional[bool] = None) -> Tensor:
    """``h_{l+1} = relu?(h_l @ W_l^T + b_l)`` for 1 to `MAX_LAYERS` layers of widths <= `MAX_WIDTH`
    (input included), h_0 = x [M, K_0] (any strides), in one kernel per direction; returns
    [M, N_{L-1}] in x's dtype, or under CUDA autocast the autocast dtype (as nn.Linear). One autograd
    node, differentiable in x, every weight and every bias.

    Args:
        x: [M, K_0], the first layer's input.
        weights: ``W_l`` [N_l, K_l] per layer (``K_{l+1} = N_l``).
        biases: ``b_l`` [N_l] per layer.
        relu: per layer, whether ReLU follows it.
        allow_tf32: None follows ``torch.backends.cuda.matmul`` (fp32 on CUDA only).

    Example (on the CPU the kernels run in Triton's interpreter, TRITON_INTERPRET=1):
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> x, w0, w1 = (torch.randn(*s, device=device) for s in ((4, 6), (3, 6), (1, 3)))
        >>> b0, b1 = torch.randn(3, device=device), torch.randn(1, device=device)
        >>> y = tail_mlp(x, [w0, w1], [b0, b1], [True, False], allow_tf32=False)
        >>> y.shape, torch.allclose(y, torch.relu(x @ w0.T + b0) @ w1.T + b1, atol=1e-4)
        (torch.Size([4, 1]), True)
    """
    if x.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        dt = torch.get_autocast_dtype("cuda")
        x = x.to(dt)
        weights = [w.to(dt) for w in weights]
        biases = [b.to(dt) for b in biases]
    return _tail_forward_op(x, list(weights), list(biases), [bool(r) for r in relu],
                            resolve_input_precision(x, allow_tf32))  # fmt: skip
