"""The random bits of stochastic rounding (`kernels.embedding.rounding`): uniform, independent of the
row and column, new with every seed, for both generators; and rounding with them is unbiased.

`tests/kernels/test_pooled_embedding_update.py` checks the rounding through the fused update; this file
checks the generators themselves, on a block of [rows, columns] shaped as the update draws them
(rows int64 and possibly past 2**32, columns < D).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kernels.embedding.rounding import RNG_CODES, _random_bits, _round_bf16


@triton.jit
def _bits_kernel(seed_ptr, out_ptr, row0, D: tl.constexpr, BLOCK_M: tl.constexpr, RNG: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = row0 + m.to(tl.int64)
    d = tl.arange(0, D)
    bits = _random_bits(seed_ptr, rows[:, None], d[None, :], D, RNG)
    tl.store(out_ptr + m[:, None] * D + d[None, :], (bits & 0xFFFF).to(tl.int32))


@triton.jit
def _round_kernel(x_ptr, seed_ptr, out_ptr, D: tl.constexpr, BLOCK_M: tl.constexpr, RNG: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    offs = m[:, None] * D + d[None, :]
    x = tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, _round_bf16(x, seed_ptr, m.to(tl.int64)[:, None], d[None, :], D, True, RNG=RNG))


def low16(rng: str, seed: int, row0: int, rows: int, D: int, device) -> torch.Tensor:
    """The 16 bits stochastic rounding adds, for rows ``row0 .. row0 + rows`` and columns ``0 .. D``."""
    out = torch.empty(rows, D, dtype=torch.int32, device=device)
    _bits_kernel[(rows // 16,)](torch.tensor([seed], device=device), out, row0, D=D, BLOCK_M=16, RNG=RNG_CODES[rng])
    return out.cpu().double()


@pytest.mark.parametrize("rng", list(RNG_CODES))
@pytest.mark.parametrize("row0", [0, 2**33 + 7])  # a table of more than 2**32 / D rows: the high half matters
# seeds with a high half: a run's stream starts at (train.seed mod 2**31) << 32 (dlrm.train.builder.rounding_seed_start)
@pytest.mark.parametrize("seed", [12345, (3 << 32) + 2**32 - 1, ((2**31 - 1) << 32) + 2**32 - 2])
def test_random_bits_are_uniform_and_independent(rng, row0, seed, device):
    rows, D = 256, 64
    x = low16(rng, seed, row0, rows, D, device)
    n = x.numel()
    # uniform: 64 bins of the top 6 bits, chi-square with 63 degrees of freedom (mean 63, sd ~11.2)
    counts = torch.bincount((x.long() >> 10).flatten(), minlength=64).double()
    chi2 = float(((counts - n / 64) ** 2 / (n / 64)).sum())
    assert chi2 < 63 + 6 * 11.2, chi2
    # the mean of a uniform 16-bit value, within 6 sigma
    assert abs(float(x.mean()) - 32767.5) < 6 * 18918.6 / n**0.5
    # the lowest bit (the one that decides ties most often) is fair
    assert abs(float((x.long() & 1).double().mean()) - 0.5) < 6 * 0.5 / n**0.5
    # no correlation between neighbouring columns, neighbouring rows, or the same column of two seeds
    def corr(a, b):
        a, b = a.flatten() - a.mean(), b.flatten() - b.mean()
        return float((a * b).sum() / (a.norm() * b.norm()))
    bound = 6 / n**0.5
    assert abs(corr(x[:, 1:], x[:, :-1])) < bound
    assert abs(corr(x[1:], x[:-1])) < bound
    y = low16(rng, seed + 1, row0, rows, D, device)  # the next step's seed (the second case carries into the high half; the last is 2**63 - 1)
    assert abs(corr(x, y)) < bound and not torch.equal(x, y)


@pytest.mark.parametrize("rng", list(RNG_CODES))
def test_stochastic_rounding_is_unbiased_for_both_generators(rng, device):
    """Values 0.25 ulp above a bf16 number round up a quarter of the time: the mean is the fp32 value."""
    rows, D = 128, 64
    base = torch.linspace(1.0, 2.0, rows * D, device=device).to(torch.bfloat16).float()
    ulp = torch.where(base < 2.0, torch.full_like(base, 2.0**-7), torch.full_like(base, 2.0**-6))
    x = (base + 0.25 * ulp).reshape(rows, D).contiguous()
    out = torch.empty_like(x)
    _round_kernel[(rows // 16,)](x, torch.tensor([7], device=device), out, D=D, BLOCK_M=16, RNG=RNG_CODES[rng])
    up = (out.flatten() > base).double()
    assert bool(((out.flatten() == base) | (out.flatten() == base + ulp)).all())  # one of the two neighbours
    p, n = 0.25, up.numel()
    assert abs(float(up.mean()) - p) < 6 * (p * (1 - p) / n) ** 0.5, float(up.mean())
