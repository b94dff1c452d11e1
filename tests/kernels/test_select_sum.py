"""kernels/embedding/select_sum.py: the exact three-part bf16 split of fp32 values, and the 0/1 selection sums
built on it, against float64 references (in CI the interpreter multiplies the same parts in exact fp32)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kernels._backend import interpret_mode
from kernels.embedding.select_sum import bf16_head, select_sum


@triton.jit
def _split_kernel(x_ptr, hi_ptr, mid_ptr, lo_ptr, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    x = tl.load(x_ptr + i, mask=m, other=0.0)
    hi = bf16_head(x)
    rest = x - hi
    mid = bf16_head(rest)
    tl.store(hi_ptr + i, hi, mask=m)
    tl.store(mid_ptr + i, mid, mask=m)
    tl.store(lo_ptr + i, rest - mid, mask=m)


@triton.jit
def _select_sum_kernel(sel_ptr, g_ptr, out_ptr, M: tl.constexpr, K: tl.constexpr, D: tl.constexpr,
                       SPLIT_FP32: tl.constexpr, DOT_16BIT: tl.constexpr):
    m, k, d = tl.arange(0, M), tl.arange(0, K), tl.arange(0, D)
    sel = tl.load(sel_ptr + m[:, None] * K + k[None, :]) != 0
    g = tl.load(g_ptr + k[:, None] * D + d[None, :])
    tl.store(out_ptr + m[:, None] * D + d[None, :], select_sum(sel, g, SPLIT_FP32, DOT_16BIT))


def fp32_values(n: int, device) -> torch.Tensor:
    """Full 24-bit significands over a wide exponent range, both signs, zeros and powers of two."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(n, generator=gen, dtype=torch.float64) * torch.exp2(torch.randint(-60, 60, (n,), generator=gen))
    x = x.float()
    x[:4] = torch.tensor([0.0, -0.0, 1.0, -(2.0 ** -20)])
    x[4] = torch.tensor(1.0 - 2.0 ** -24)  # every significand bit set
    return x.to(device)


def test_split_parts_are_bf16_values_that_add_up_exactly(device):
    n = 1000
    x = fp32_values(n, device)
    hi, mid, lo = (torch.empty_like(x) for _ in range(3))
    _split_kernel[(triton.cdiv(n, 256),)](x, hi, mid, lo, n, BLOCK=256)
    for part in (hi, mid, lo):
        torch.testing.assert_close(part.bfloat16().float(), part, rtol=0, atol=0)  # exactly a bf16 value
    torch.testing.assert_close(hi.double() + mid.double() + lo.double(), x.double(), rtol=0, atol=0)
    # hi holds the top bits, rounded towards zero: never larger in magnitude, same sign
    assert bool((hi.abs() <= x.abs()).all()) and bool((hi * x >= 0).all())
    assert bool(((x - hi).abs() <= x.abs() * 2.0 ** -7).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,K,D", [(16, 16, 16), (64, 128, 16), (32, 16, 64)])
def test_select_sum_matches_float64(dtype, M, K, D, device):
    gen = torch.Generator().manual_seed(M + K + D)
    sel = (torch.rand(M, K, generator=gen) < 0.3).to(torch.int32)
    sel[0] = 0  # a row that selects nothing
    sel[1] = 1  # one that selects everything
    g = (torch.randn(K, D, generator=gen) * torch.exp2(torch.randint(-8, 8, (K, 1), generator=gen))).to(dtype)
    out = torch.empty(M, D, device=device)
    _select_sum_kernel[(1,)](sel.to(device), g.to(device), out, M=M, K=K, D=D, SPLIT_FP32=dtype == torch.float32,
                             DOT_16BIT=not interpret_mode())
    ref = sel.double() @ g.double()
    # an fp32 sum of at most K exact terms: |error| <= K * 2^-24 * sum |terms|
    bound = K * 2.0 ** -24 * (sel.double() @ g.double().abs()) + 1e-30
    err = (out.cpu().double() - ref).abs()
    assert bool((err <= bound).all()), f"max error / bound {float((err / bound).max()):.3g}"
    assert float(out[0].abs().max()) == 0.0
