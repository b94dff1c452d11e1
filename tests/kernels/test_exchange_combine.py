"""kernels/exchange_combine.py (the sharded lookup's received blocks -> [B, F, D]) against float64 references.

CPU: Triton interpreter, small shapes, fp32 and bf16 (on a GPU machine the same tests run on CUDA); GPU-marked
tests repeat it at MLPerf DLRM-DCNv2's two-rank layout (26 features, five row-wise, B 4096, D 128). References: the forward as float64 sums of each feature's
columns, in rank order, rounded once to the dtype; the gradient as float64 gathers of the output gradient times
the scale, rounded once, zero for the padded samples. The eager path (`combine_received_eager`, what CPU runs
without Triton) is held to the same references, so the two paths agree number for number.
"""

from __future__ import annotations

import pytest
import torch

from kernels.exchange_combine import combine_received, combine_received_eager, exchange_layout

# (served features of each rank, F): table-wise only; one row-wise feature; every feature row-wise over 3 ranks;
# one feature; MLPerf DLRM-DCNv2's plan on two ranks (rank 0: the five 40M-row tables' blocks and table 10)
LAYOUTS = {
    "table_wise": ([[0, 2], [1, 3, 4]], 5),
    "one_row_wise": ([[0, 1, 2], [1, 3]], 4),
    "all_row_wise_3": ([[0, 1, 2], [0, 1, 2], [0, 1, 2]], 3),
    "one_feature": ([[0], [0]], 1),
    "mlperf_2": ([[0, 9, 10, 19, 20, 21], [f for f in range(26) if f != 10]], 26),
}
TOL = {torch.float32: dict(atol=1e-6, rtol=1e-6), torch.bfloat16: dict(atol=0.0, rtol=0.0)}


def _reference(x: torch.Tensor, served: list[list[int]], F: int, B: int, P: int, gy: torch.Tensor, scale: float):
    """(y, gx) in float64, rounded once to x's dtype."""
    D = x.shape[1]
    x64 = x.double()
    y = torch.zeros(B, F, D, dtype=torch.float64)
    gx = torch.zeros_like(x64)
    at = 0
    for feats in served:
        block = x64[P * at : P * (at + len(feats))].view(P, len(feats), D)
        gblock = gx[P * at : P * (at + len(feats))].view(P, len(feats), D)
        for j, f in enumerate(feats):
            y[:, f] += block[:B, j]
            gblock[:B, j] = gy[:, f].double() * scale
        at += len(feats)
    return y.to(x.dtype), gx.to(x.dtype)


def _inputs(served, F, B, P, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    C = sum(len(s) for s in served)
    x = torch.randn(P * C, D + 3, generator=g)[:, :D].to(dtype)  # non-contiguous rows
    gy = torch.randn(F, B, D, generator=g).to(dtype).transpose(0, 1)  # non-contiguous gradient [B, F, D]
    return x, gy


def _check(fn, served, F, B, P, D, dtype, device="cpu", scale=0.5):
    x, gy = _inputs(served, F, B, P, D, dtype)
    y_ref, gx_ref = _reference(x, served, F, B, P, gy, scale)
    layout = exchange_layout(served, F, device)
    xd = x.to(device).requires_grad_(True)
    y = fn(xd, layout, B, P, scale)
    assert y.shape == (B, F, D) and y.dtype == dtype
    y.backward(gy.to(device))
    torch.testing.assert_close(y.cpu(), y_ref, **TOL[dtype])
    torch.testing.assert_close(xd.grad.cpu(), gx_ref, **TOL[dtype])
    # the padded samples' gradient rows are exactly zero
    if P > B:
        at = 0
        for feats in served:
            block = xd.grad[P * at : P * (at + len(feats))].view(P, len(feats), D)
            assert torch.count_nonzero(block[B:]) == 0
            at += len(feats)


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("B,P", [(1, 1), (3, 4), (127, 127)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fn", [combine_received, combine_received_eager], ids=["triton", "eager"])
def test_against_float64(fn, dtype, B, P, name, device):
    served, F = LAYOUTS[name]
    _check(fn, served, F, B, P, 16, dtype, device)


@pytest.mark.parametrize("D", [1, 5, 128])
def test_widths(D, device):
    served, F = LAYOUTS["one_row_wise"]
    _check(combine_received, served, F, 3, 4, D, torch.float32, device)


def test_zero_local_batch(device):
    """A rank whose local batch is empty (B 0 of P 2) still sends the padded gradient rows: zeros."""
    served, F = LAYOUTS["one_row_wise"]
    _check(combine_received, served, F, 0, 2, 8, torch.float32, device)


def test_wrong_row_count_is_refused():
    served, F = LAYOUTS["table_wise"]
    with pytest.raises(ValueError, match="received 9 rows, the layout needs P \\* 5 = 10"):
        combine_received(torch.zeros(9, 4), exchange_layout(served, F), 2, 2, 1.0)


def test_unserved_feature_is_refused():
    with pytest.raises(ValueError, match=r"features \[1\] are served by no rank"):
        exchange_layout([[0], [2]], 3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mlperf_layout_on_gpu(dtype):
    served, F = LAYOUTS["mlperf_2"]
    _check(combine_received, served, F, 4000, 4096, 128, dtype, device="cuda")
