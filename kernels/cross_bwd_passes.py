"""The elementwise passes of the DCNv2 cross network's backward, with the bias gradients' column sums inside them.

Notation as in `kernels.cross`: ``M`` rows (the batch), ``N`` the width, ``L`` layers. Layer ``l`` is
``x_{l+1} = x0 * pre_l + x_l`` with ``pre_l = W_l (V_l x_l) + b_l``. For ``G_L = d loss / d x_L`` and the
data-gradient GEMMs' outputs ``T_l = du_l V_l`` (``du_l = g_pre_l W_l``), the gradient reaching ``x_l`` is
``G_l = G_L + T_{L-1} + ... + T_l``, and

    g_pre_l = G_{l+1} * x0,     db_l = sum_rows(g_pre_l),     dx0 = G_1 + sum_l G_{l+1} * pre_l + T_0.

`cross_backward_pass` computes one layer's ``g_pre`` and ``db`` from ``G_L`` and the ``T`` terms above it, summing
them on the fly (no ``G_l`` is written), and at the first layer also the part of ``dx0`` without ``T_0`` (which the
caller adds in place with ``addmm_``). It is what Inductor generates for the per-layer ops (the same recompute
schedule, 16 [M, N] streams for 3 layers), plus:

* the bias gradient: Inductor sums ``g_pre`` over the rows in a separate split reduction that reads it again
  (0.16 ms a layer at MLPerf DLRM-DCNv2's shapes on an H100, 0.48 ms a step); here each program adds up the
  ``g_pre`` tile it has just written and stores one fp32 partial sum a column, and `cross_backward_pass` sums the
  ``[row chunks, N]`` partials (in a fixed order: deterministic);
* ``dx0``'s last term: Inductor's ``addmm`` copies its addend into the output first (aten's 0.3 ms copy); the
  caller here adds ``T_0`` into this pass's output in place.

Each program covers ``BLOCK_N`` columns of ``ROWS`` rows in ``BLOCK_M``-row tiles, in fp32 registers; ``g_pre`` and
``dx0`` are stored in their tensors' dtype and the sums add the stored (rounded) ``g_pre``, as the per-layer ops'
``g_pre.sum(0, dtype=float32)`` does.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import heuristics
from kernels._backend import check_gemm_dtype, check_triton_device, device_context, interpret_mode

__all__ = ["MAX_TERMS", "cross_backward_pass", "cross_backward_pass_reference"]

# Up to this many T terms a pass (kernel arguments T1..T3, pre P0..P3): cross networks of up to 4 layers. Deeper ones
# run the same arithmetic in PyTorch ops (`kernels.cross_ws_net`).
MAX_TERMS = 3
# The launch, (BLOCK_M, BLOCK_N, rows a program, warps): BLOCK_M x BLOCK_N tiles, ROWS rows a program ([cdiv(M, ROWS),
# N] fp32 partial sums: 1.7 MB at MLPerf's shapes), NUM_WARPS; per GPU in `kernels.heuristics.cross_bwd_pass_launch`
# (H100, MLPerf DLRM-DCNv2's passes (bf16, 65536 x 3456; results/cross_bwd_passes.md), ms for the top / middle / first
# layer's pass: 64x128, 512 rows, 8 warps 0.486 / 0.630 / 1.410 (2.8-2.9 TB/s) against Inductor's pass + split
# reduction 0.600 / 0.736 / 1.465; 32x128 with 4 warps 0.495 / 0.662 / 1.445; 256-column tiles 1.1-1.3 ms on the top
# layer's pass; an H200 takes 128 x 64 tiles). ``LAUNCH_OVERRIDE`` forces one (benchmarks/cross_bwd_passes.py).
LAUNCH_OVERRIDE: Optional[tuple[int, int, int, int]] = None


@triton.jit
def _term(ptr, offs, mask):
    return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _cross_backward_pass_kernel(
    g_ptr, t1_ptr, t2_ptr, t3_ptr, x0_ptr, p0_ptr, p1_ptr, p2_ptr, p3_ptr, gpre_ptr, dx0_ptr, part_ptr,
    M, N, NUM_T: tl.constexpr, WITH_DX0: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
):
    """``g = G_L + T1 + ... (NUM_T terms)``, ``g_pre = g * x0``, partial column sums of ``g_pre`` over this program's
    rows; with ``WITH_DX0`` also ``dx0 = g + sum_i (G_L + T1 + .. + Ti) * P_i`` (``P_0`` pairs with ``G_L``)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    colsum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row0 = pid_m.to(tl.int64) * ROWS
    for r in range(0, ROWS, BLOCK_M):
        rows = row0 + r + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & cmask[None, :]
        offs = rows[:, None] * N + cols[None, :]
        g = _term(g_ptr, offs, mask)
        if WITH_DX0:
            acc = g * _term(p0_ptr, offs, mask)
        if NUM_T >= 1:
            g += _term(t1_ptr, offs, mask)
            if WITH_DX0:
                acc += g * _term(p1_ptr, offs, mask)
        if NUM_T >= 2:
            g += _term(t2_ptr, offs, mask)
            if WITH_DX0:
                acc += g * _term(p2_ptr, offs, mask)
        if NUM_T >= 3:
            g += _term(t3_ptr, offs, mask)
            if WITH_DX0:
                acc += g * _term(p3_ptr, offs, mask)
        gpre = (g * _term(x0_ptr, offs, mask)).to(gpre_ptr.dtype.element_ty)
        tl.store(gpre_ptr + offs, gpre, mask=mask)
        colsum += tl.sum(gpre.to(tl.float32), axis=0)  # masked lanes hold 0
        if WITH_DX0:
            tl.store(dx0_ptr + offs, (g + acc).to(dx0_ptr.dtype.element_ty), mask=mask)
    tl.store(part_ptr + pid_m * N + cols, colsum, mask=cmask)


def _check(g: Tensor, ts: Sequence[Tensor], x0: Tensor, pres: Optional[Sequence[Tensor]], max_terms: int) -> None:
    if g.dim() != 2:
        raise ValueError(f"cross_backward_pass: g must be [M, N], got {tuple(g.shape)}")
    if len(ts) > max_terms:
        raise ValueError(f"cross_backward_pass: at most {max_terms} T terms, got {len(ts)}")
    if pres is not None and len(pres) != len(ts) + 1:
        raise ValueError(f"cross_backward_pass: {len(ts) + 1} pre tensors expected with {len(ts)} T terms, got "
                         f"{len(pres)}")
    for t in (*ts, x0, *(pres or ())):
        if t.shape != g.shape or t.device != g.device:
            raise ValueError(f"cross_backward_pass: every tensor must be {tuple(g.shape)} on {g.device}, got "
                             f"{tuple(t.shape)} on {t.device}")


def cross_backward_pass(g: Tensor, ts: Sequence[Tensor], x0: Tensor, pres: Optional[Sequence[Tensor]] = None,
                        bias_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """One layer's ``(g_pre, db, dx0 without T_0)`` (see the module docstring); ``dx0`` is None without ``pres``.

    Args:
        g: ``G_L`` [M, N], the gradient of the network's output.
        ts: the ``T`` terms above the layer, ``[T_{L-1}, ..., T_{l+1}]`` (at most `MAX_TERMS`), each [M, N].
        x0: the network's input [M, N].
        pres: for the first layer only, ``[pre_{L-1}, ..., pre_0]`` (``len(ts) + 1`` tensors [M, N]).
        bias_dtype: ``db``'s dtype (the sums are fp32).

    ``g_pre`` has ``x0``'s dtype, ``dx0`` too. Any strides (non-contiguous inputs are copied first). Runs on CUDA, or
    on the CPU under ``TRITON_INTERPRET=1`` (fp32).

    >>> device = "cuda" if torch.cuda.is_available() else "cpu"
    >>> g, t, x0, p0, p1 = (torch.full((2, 3), v, device=device) for v in (1.0, 2.0, 3.0, 0.5, 0.25))
    >>> gpre, db, dx0 = cross_backward_pass(g, [t], x0, [p0, p1])
    >>> gpre[0].tolist(), db.tolist(), dx0[0].tolist()  # (1 + 2) * 3; 2 rows of 9; 3 + 1 * 0.5 + 3 * 0.25
    ([9.0, 9.0, 9.0], [18.0, 18.0, 18.0], [4.25, 4.25, 4.25])
    """
    _check(g, ts, x0, pres, MAX_TERMS)
    # fp32 arithmetic, stored in x0's dtype: float64 came back rounded to fp32 (the reference runs float64)
    check_gemm_dtype(x0.dtype, "cross_backward_pass", "cross_backward_pass_reference and the PyTorch modules")
    check_triton_device(g.device, "the cross network's backward passes")
    M, N = g.shape
    g, x0 = g.contiguous(), x0.contiguous()
    ts = [t.contiguous() for t in ts]
    pres = None if pres is None else [p.contiguous() for p in pres]
    gpre = torch.empty_like(x0)
    dx0 = torch.empty_like(x0) if pres is not None else None
    block_m, block_n, rows, warps = LAUNCH_OVERRIDE or heuristics.cross_bwd_pass_launch(g.device)
    if rows % block_m:  # a program's last tile would run into the next chunk's rows: db would count them twice
        raise ValueError(f"cross_backward_pass: rows a program ({rows}) must be a multiple of BLOCK_M ({block_m})")
    if interpret_mode():  # the interpreter runs programs one by one: fewer, shorter loops for the tests' small shapes
        rows = max(block_m, min(rows, triton.next_power_of_2(max(M, 1))))
    chunks = triton.cdiv(M, rows) if M else 0
    # Every program writes its row of partial sums for all N columns: no fill needed (a 2 us kernel a pass), except
    # without rows, where the one row of zeros is the sum.
    part = (torch.empty if M and N else torch.zeros)((max(chunks, 1), N), dtype=torch.float32, device=g.device)
    if M and N:
        slot = lambda seq, i: seq[i] if seq is not None and i < len(seq) else g  # noqa: E731 (unused: never read)
        with device_context(g):
            _cross_backward_pass_kernel[(triton.cdiv(N, block_n), chunks)](
                g, slot(ts, 0), slot(ts, 1), slot(ts, 2), x0, slot(pres, 0), slot(pres, 1), slot(pres, 2),
                slot(pres, 3), gpre, dx0 if dx0 is not None else gpre, part, M, N,
                NUM_T=len(ts), WITH_DX0=pres is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                ROWS=rows,
                num_warps=warps,
            )
    return gpre, part.sum(0).to(bias_dtype), dx0


def cross_backward_pass_reference(g: Tensor, ts: Sequence[Tensor], x0: Tensor,
                                  pres: Optional[Sequence[Tensor]] = None,
                                  bias_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """`cross_backward_pass` in PyTorch ops (fp32 arithmetic for 16-bit inputs, as the kernel): where the kernel
    cannot run (any number of T terms), and the tests' reference."""
    _check(g, ts, x0, pres, len(ts))
    wide = torch.promote_types(x0.dtype, torch.float32)
    acc_g = g.to(wide)
    acc = acc_g * pres[0].to(wide) if pres is not None else None
    for i, t in enumerate(ts):
        acc_g = acc_g + t.to(wide)
        if pres is not None:
            acc = acc + acc_g * pres[i + 1].to(wide)
    gpre = (acc_g * x0.to(wide)).to(x0.dtype)
    db = gpre.sum(0, dtype=wide).to(bias_dtype)
    dx0 = (acc_g + acc).to(x0.dtype) if pres is not None else None
    return gpre, db, dx0
