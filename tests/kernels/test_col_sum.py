"""kernels/col_sum.py (`sum_partial_rows`, the fixed-order second stage of every fused bias gradient) against float64.

Odd shapes (one row, one column, columns past a block, rows past a loop step), every column block width the callers
use, fp32 and (GPU) bf16 outputs, and the same bits on every run. CPU: Triton interpreter; GPU: the same tests.
"""

from __future__ import annotations

import pytest
import torch

from kernels.col_sum import BLOCK_R, sum_partial_rows


@pytest.mark.parametrize("R", [1, 3, 127])
@pytest.mark.parametrize("N", [1, 16, 130])
@pytest.mark.parametrize("block_n", [16, 128])
def test_sums_each_column_over_every_row(R, N, block_n, device):
    gen = torch.Generator().manual_seed(R * 1000 + N)
    partial = torch.randn(R, N, generator=gen, dtype=torch.float64)
    out = torch.full((N,), float("nan"), device=device)  # every column written, none left from before
    res = sum_partial_rows(partial.float().to(device), out, block_n)
    assert res is out and out.shape == (N,)
    ref = partial.float().double().sum(0)  # the fp32 inputs summed exactly
    # fp32 sums of R terms of size ~1: a few ulps a term
    torch.testing.assert_close(out.double().cpu(), ref, atol=1e-6 * max(R, 1), rtol=1e-6)


def test_rows_past_one_loop_step_and_a_ragged_last_step(device):
    """R spanning several BLOCK_R steps with a partial last one: each row counted once (integers: exact in fp32)."""
    R, N = 2 * BLOCK_R + 3, 20
    partial = torch.arange(R * N, dtype=torch.float32).reshape(R, N)
    out = sum_partial_rows(partial.to(device), torch.empty(N, device=device), 16)
    assert torch.equal(out.cpu(), partial.double().sum(0).float())


def test_same_bits_every_run(device):
    gen = torch.Generator().manual_seed(3)
    partial = (torch.randn(127, 130, generator=gen) * 1e3).to(device)
    a = sum_partial_rows(partial, torch.empty(130, device=device), 128)
    b = sum_partial_rows(partial, torch.empty(130, device=device), 128)
    assert torch.equal(a, b)


# CUDA only until the interpreter's fp32 -> bf16 cast rounded to nearest as a GPU's does (`kernels._interpreter`)
def test_bf16_output_is_the_fp32_sum_rounded_once(device):
    gen = torch.Generator().manual_seed(4)
    partial = torch.randn(127, 130, generator=gen).to(device)
    out = sum_partial_rows(partial, torch.empty(130, device=device, dtype=torch.bfloat16), 128)
    ref = sum_partial_rows(partial, torch.empty(130, device=device), 128)
    assert torch.equal(out, ref.to(torch.bfloat16))
