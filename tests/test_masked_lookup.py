"""dlrm.model.masked_lookup: eager lookups whose sparse gradient leaves masked lookups out.

Checked element by element against float64 references: the output, the gradient's values, and
which rows the gradient holds (a row that only a masked lookup points at must not be there, also
when the kept lookups' gradients are zero, since the lazy weight decay decays every row it holds)."""

from __future__ import annotations

import pytest
import torch

from dlrm.model.masked_lookup import masked_embedding, masked_embedding_bag
from dlrm.train.optim import decay_touched_rows_

R, D = 13, 5


def _dense(grad: torch.Tensor) -> torch.Tensor:
    return grad.coalesce().to_dense()


@pytest.mark.parametrize("shape", [(1,), (3,), (127,), (4, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_masked_embedding_matches_float64_reference(shape, dtype):
    gen = torch.Generator().manual_seed(sum(shape))
    rows = torch.randint(0, R, shape, generator=gen)
    keep = torch.rand(shape, generator=gen) < 0.6
    w64 = torch.randn(R, D, generator=gen, dtype=torch.float64)
    # a non-contiguous output gradient
    g64 = torch.randn(*shape, 2 * D, generator=gen, dtype=torch.float64)[..., ::2]
    weight = torch.nn.Parameter(w64.to(dtype))
    out = masked_embedding(rows, weight, keep)
    out.backward(g64.to(dtype))

    ref_out = w64[rows] * keep.unsqueeze(-1)
    ref_grad = torch.zeros(R, D, dtype=torch.float64).index_add_(0, rows[keep], g64[keep])
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 0, "atol": 1e-12}
    torch.testing.assert_close(out.double(), ref_out, **tol)
    assert weight.grad.is_sparse
    torch.testing.assert_close(_dense(weight.grad).double(), ref_grad, **tol)
    assert set(weight.grad.coalesce().indices()[0].tolist()) == set(rows[keep].tolist())


def test_masked_rows_are_not_decayed_even_with_zero_gradients():
    """A row only masked lookups point at is not in the gradient, so the lazy decay leaves it alone;
    a kept row is decayed even when its gradient is zero (it was used)."""
    weight = torch.nn.Parameter(torch.ones(4, 2))
    out = masked_embedding(torch.tensor([[0, 2], [0, 3]]), weight, torch.tensor([[False, True], [False, True]]))
    (out * 0).sum().backward()
    decay_touched_rows_(weight, 0.5)
    torch.testing.assert_close(_dense(weight.grad), torch.tensor([[0.0, 0], [0, 0], [0.5, 0.5], [0.5, 0.5]]))


@pytest.mark.parametrize("bags", [[1], [3, 1, 2], [0, 2, 5, 1] * 31])
def test_masked_embedding_bag_matches_float64_reference(bags):
    gen = torch.Generator().manual_seed(len(bags))
    n = sum(bags)
    rows = torch.randint(0, R, (n,), generator=gen)
    keep = torch.rand(n, generator=gen) < 0.7
    bag = torch.repeat_interleave(torch.arange(len(bags)), torch.tensor(bags))
    starts = torch.tensor([0] + bags[:-1]).cumsum(0)
    w64 = torch.randn(R, D, generator=gen, dtype=torch.float64)
    g64 = torch.randn(len(bags), D, generator=gen, dtype=torch.float64)
    weight = torch.nn.Parameter(w64.float())
    out = masked_embedding_bag(rows, weight, keep, starts, bag)
    out.backward(g64.float())

    ref_out = torch.zeros(len(bags), D, dtype=torch.float64).index_add_(0, bag[keep], w64[rows[keep]])
    ref_grad = torch.zeros(R, D, dtype=torch.float64).index_add_(0, rows[keep], g64[bag[keep]])
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(_dense(weight.grad).double(), ref_grad, rtol=1e-6, atol=1e-6)
    assert set(weight.grad.coalesce().indices()[0].tolist()) == set(rows[keep].tolist())
