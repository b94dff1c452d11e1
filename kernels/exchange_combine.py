"""The sharded lookup's received embeddings combined into [B, F, D], forward and backward, in one pass each.

A sharded run (`dlrm.distributed.sharded_embedding.ShardedSparseArch`) gets back, from the reverse
``all_to_all``, one flat tensor ``x`` [sum_q P * n_q, D]: rank q's block is [P, n_q, D], its n_q columns the
(pooled) embeddings of the features q serves, in feature order. A table-wise feature has one column (its
owner's); a row-wise feature has W, one partial sum per rank's block of rows. The combined output is

    y[b, f, :] = round( sum over the columns c of feature f (in rank order) of x[row(c, b), :] )   for b < B

summed in fp32 and rounded once to ``x``'s dtype; ``row(c, b) = P * prefix_q + b * n_q + j`` for column c =
(rank q, its j-th served feature), ``prefix_q = n_0 + ... + n_{q-1}``. Its backward is

    gx[row(c, b), :] = round( fp32(gy[b, f(c), :]) * scale )   (zero for the padded samples B <= b < P)

with ``scale`` = 1/W (the embedding gradients' share, see the sharded arch's docstring). These are, number for
number, what the eager path computes (`combine_received_eager`: the blocks concatenated, cast to fp32,
``index_add`` into zeros, cut to B rows, cast back; the backward the same ops' autograd), but each direction is one
kernel reading and writing every element once, where the eager ops made about a dozen passes over
[P, F, D]-sized tensors (~9 ms a step for MLPerf DLRM-DCNv2 on two H200s: copies 6.7-7.0 ms, the fp32
``index_add`` 2.0 ms; benchmarks/results/scaling_mlperf_profile_2gpu_nineteenth_code.md). The backward writes straight into the
buffer the reverse all_to_all sends: no ``contiguous()`` copy of the concatenation's gradient slices.

Layout (`ExchangeLayout`): built once from the plan's served features; the per-column tables are int64 device
buffers, so no host-to-device copy or sync happens per step, and P enters as a kernel argument.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._backend import GEMM_DTYPES, check_gemm_dtype, check_same_device, device_context
from kernels.embedding.rounding import _round_bf16


@triton.jit
def _combine_fwd_kernel(x_ptr, y_ptr, src_ptr, prefix_ptr, n_ptr, j_ptr, B, P, D,
                        stride_yb, stride_yf, stride_yd,
                        PARTS: tl.constexpr, ROUND_BF16: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (block of BLOCK_B samples, feature f): y[b, f] = sum of f's columns, in rank order."""
    f = tl.program_id(1)
    b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    d = tl.arange(0, BLOCK_D)
    m = (b < B)[:, None] & (d < D)[None, :]
    b64 = b.to(tl.int64)
    acc = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.float32)
    for k in tl.static_range(PARTS):
        c = tl.load(src_ptr + f * PARTS + k)  # -1: feature f has fewer than PARTS columns
        if c >= 0:
            rows = P * tl.load(prefix_ptr + c) + tl.load(j_ptr + c) + b64 * tl.load(n_ptr + c)
            acc += tl.load(x_ptr + rows[:, None] * D + d[None, :], mask=m, other=0.0).to(tl.float32)
    if ROUND_BF16:  # to nearest even by bit arithmetic: the interpreter's cast truncates
        acc = _round_bf16(acc, x_ptr, b64[:, None], d[None, :], D, False)
    out = y_ptr + b64[:, None] * stride_yb + f * stride_yf + d[None, :] * stride_yd
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _combine_bwd_kernel(g_ptr, gx_ptr, feat_ptr, prefix_ptr, n_ptr, j_ptr, B, P, D,
                        stride_gb, stride_gf, stride_gd, scale,
                        ROUND_BF16: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (block of BLOCK_B of the P padded samples, column c): c's rows of gx, scaled."""
    c = tl.program_id(1)
    b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    d = tl.arange(0, BLOCK_D)
    dmask = (d < D)[None, :]
    b64 = b.to(tl.int64)
    f = tl.load(feat_ptr + c)
    g = tl.load(g_ptr + b64[:, None] * stride_gb + f * stride_gf + d[None, :] * stride_gd,
                mask=(b < B)[:, None] & dmask, other=0.0).to(tl.float32)
    g = g * scale
    if ROUND_BF16:
        g = _round_bf16(g, gx_ptr, b64[:, None], d[None, :], D, False)
    rows = P * tl.load(prefix_ptr + c) + tl.load(j_ptr + c) + b64 * tl.load(n_ptr + c)
    tl.store(gx_ptr + rows[:, None] * D + d[None, :], g.to(gx_ptr.dtype.element_ty), mask=(b < P)[:, None] & dmask)


COMBINE_DTYPES = GEMM_DTYPES  # the dtypes `combine_received` takes (fp32 sums); others: `combine_received_eager`
EXCHANGE_TENSORS = ("src", "feature", "prefix", "n", "j")  # ExchangeLayout's tensor fields, in order


@dataclass
class ExchangeLayout:
    """Where each feature's columns lie in the received tensor (see the module docstring).

    Built by `exchange_layout`. Columns c = 0..C-1 in rank order, then served-feature order. Tensors (int64,
    on the device): ``src`` [F, PARTS] the columns of each feature (-1 pads), ``feature`` [C], ``prefix`` [C]
    (n_0 + ... + n_{q-1} of c's rank q), ``n`` [C] (n_q), ``j`` [C] (c's place in its rank's block).
    """

    num_features: int
    parts: int
    columns_per_rank: list[int]
    src: torch.Tensor
    feature: torch.Tensor
    prefix: torch.Tensor
    n: torch.Tensor
    j: torch.Tensor


def exchange_layout(served: list[list[int]], num_features: int, device=None) -> ExchangeLayout:
    """The layout for ranks serving ``served[q]`` (features, ascending); every feature served at least once."""
    feature, prefix, n, j = [], [], [], []
    at = 0
    for feats in served:
        for i, f in enumerate(feats):
            feature.append(f)
            prefix.append(at)
            n.append(len(feats))
            j.append(i)
        at += len(feats)
    cols = [[c for c, g in enumerate(feature) if g == f] for f in range(num_features)]
    missing = [f for f, c in enumerate(cols) if not c]
    if missing:
        raise ValueError(f"features {missing} are served by no rank")
    parts = max(len(c) for c in cols)
    src = [c + [-1] * (parts - len(c)) for c in cols]
    as_tensor = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    return ExchangeLayout(num_features, parts, [len(f) for f in served], as_tensor(src), as_tensor(feature),
                          as_tensor(prefix), as_tensor(n), as_tensor(j))


def _blocks(D: int) -> tuple[int, int]:
    block_d = triton.next_power_of_2(D)
    return max(16, 4096 // block_d), block_d  # ~4096 elements a program: 32 samples at D=128, 256 at D=16


def combine_fwd(x: torch.Tensor, layout: ExchangeLayout, B: int, P: int) -> torch.Tensor:
    """[sum_q P n_q, D] (any strides) -> [B, F, D] in x's dtype (contiguous)."""
    x = x.contiguous()  # the kernel reads row r at r * D: a strided x (a column slice) was read as another tensor
    D = x.shape[1]
    y = torch.empty(B, layout.num_features, D, dtype=x.dtype, device=x.device)
    if B == 0:
        return y
    block_b, block_d = _blocks(D)
    with device_context(x):
        _combine_fwd_kernel[(triton.cdiv(B, block_b), layout.num_features)](
            x, y, layout.src, layout.prefix, layout.n, layout.j, B, P, D, *y.stride(),
            PARTS=layout.parts, ROUND_BF16=x.dtype == torch.bfloat16, BLOCK_B=block_b, BLOCK_D=block_d)
    return y


def combine_bwd(gy: torch.Tensor, layout: ExchangeLayout, P: int, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """[B, F, D] (any strides) -> [sum_q P n_q, D] of `dtype`, contiguous, zero rows for the padded samples."""
    B, _, D = gy.shape
    C = int(layout.feature.numel())
    gx = torch.empty(P * C, D, dtype=dtype, device=gy.device)
    if P == 0:
        return gx
    block_b, block_d = _blocks(D)
    with device_context(gy):
        _combine_bwd_kernel[(triton.cdiv(P, block_b), C)](
            gy, gx, layout.feature, layout.prefix, layout.n, layout.j, B, P, D, *gy.stride(), float(scale),
            ROUND_BF16=dtype == torch.bfloat16, BLOCK_B=block_b, BLOCK_D=block_d)
    return gx


class _CombineReceived(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, layout: ExchangeLayout, B: int, P: int, scale: float) -> torch.Tensor:
        ctx.layout, ctx.P, ctx.scale, ctx.dtype = layout, P, scale, x.dtype
        return combine_fwd(x, layout, B, P)

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        return combine_bwd(gy, ctx.layout, ctx.P, ctx.scale, ctx.dtype), None, None, None, None


def combine_received(x: torch.Tensor, layout: ExchangeLayout, B: int, P: int, scale: float) -> torch.Tensor:
    """The received blocks ``x`` [sum_q P n_q, D] -> [B, F, D] (row-wise parts summed in fp32, rounded once);
    the gradient of ``x`` is ``scale`` times the output's, zero for the padded samples. Triton, one kernel a
    direction (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    # The kernels add in fp32 and round once to x's dtype: float64 parts were added in fp32 and handed back as
    # float64 (3.1 off at values ~1e8), where the eager twin adds in float64. Refused, as the GEMM kernels refuse it.
    check_gemm_dtype(x.dtype, "combine_received's kernels", "combine_received_eager and the torch kernels")
    # the layout's tables are read on x's device (a layout left on the CPU with CUDA blocks read bad memory)
    check_same_device("combine_received", x=x, **{f"layout.{n}": getattr(layout, n) for n in EXCHANGE_TENSORS})
    if not 0 <= B <= P:  # samples past P would be read from the next rank's block (or past the buffer's end)
        raise ValueError(f"the batch B={B} must lie in [0, P={P}] (P: the padded batch each rank sent)")
    if x.shape[0] != P * sum(layout.columns_per_rank):
        raise ValueError(f"received {x.shape[0]} rows, the layout needs P * {sum(layout.columns_per_rank)} = "
                         f"{P * sum(layout.columns_per_rank)}")
    return _CombineReceived.apply(x, layout, B, P, scale)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; gradient times `scale`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def combine_received_eager(x: torch.Tensor, layout: ExchangeLayout, B: int, P: int, scale: float) -> torch.Tensor:
    """`combine_received` in PyTorch ops (the reference; also what runs where Triton does not)."""
    D = x.shape[1]
    n = layout.columns_per_rank
    parts = [p.view(P, k, D) for p, k in zip(x.split([P * k for k in n]), n)]
    received = torch.cat(parts, dim=1)  # [P, C, D]
    acc = torch.promote_types(x.dtype, torch.float32)
    full = torch.zeros(P, layout.num_features, D, dtype=acc, device=x.device)
    full = full.index_add(1, layout.feature, received.to(acc))
    return _ScaleGrad.apply(full[:B], scale).to(x.dtype)
