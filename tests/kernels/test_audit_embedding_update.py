"""The fused sparse update (`kernels.embedding.update` and the kernels under it) where the other embedding tests did
not look: rows whose summed gradient is exactly zero under Adagrad's zero initial state (the ``eps`` of the rule),
tables whose columns are not contiguous, the bits of stochastic rounding per row and per column, round-to-nearest
ties, the sort's int32/int64 key boundary, and hot segments that end in a last chunk of one position.

Each against a float64 reference (or exact expectations), CPU: Triton interpreter, GPU: the same tests on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from kernels import heuristics
from kernels.embedding import embedding_sparse_update_
from kernels.embedding import update as update_module
from tests.kernels.embedding_inputs import make_state, make_weight, strided_table
from tests.kernels.test_embedding import EPS, LR, OPTIMIZERS, reference_update

BF16 = torch.bfloat16


def dup_rows(B: int, F: int, R: int, seed: int) -> torch.Tensor:
    """Rows [B, F] in [0, R) with duplicates (R small against B * F), built [F, B] and transposed (non-contiguous)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, R, (F, B), generator=gen).t()


# ----------------------------------------------------------------------------------------------------
# Adagrad: rows looked up with a zero summed gradient, zero state
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("B,F", [(1, 1), (3, 4), (127, 1)])
def test_adagrad_rows_with_zero_gradient_stay_finite(optimizer, B, F, device, assert_close):
    """A row looked up whose gradient is zero (a masked-out sample, a feature whose output is unused) with a
    freshly initialised zero state: ``g / (sqrt(0) + eps)`` is 0, the row and its state stay as they are. Without
    ``eps`` in the rule that is 0 / 0 = NaN, which would spread into the model. Every other row is updated as the
    float64 reference says (duplicates included: rows of a 5-row table)."""
    R, D = 5, 24  # D = 24: padded columns too
    rows = dup_rows(B, F, R, seed=B * 10 + F).to(device)
    gen = torch.Generator().manual_seed(B + F)
    grad = torch.randn(B, F, D, generator=gen).to(device)
    zero_rows = torch.tensor([0, 3], device=device)  # rows whose every position gets a zero gradient
    grad[torch.isin(rows, zero_rows)] = 0.0
    grad[0, 0] = 0.0  # and at least one looked-up row has a zero summed gradient even for B = F = 1
    if B * F > 1:
        rows[0, 0] = 0
    weight = make_weight(R, D, device)
    state = make_state(optimizer, weight, zero=True)
    w0, s0 = weight.clone(), state.clone()
    w_ref, s_ref = reference_update(optimizer, rows, grad, weight, state, LR)
    embedding_sparse_update_(rows, grad, weight, state, torch.tensor(LR, device=device), optimizer, EPS, True)
    assert bool(torch.isfinite(weight).all()) and bool(torch.isfinite(state).all())
    assert_close(weight, w_ref, torch.float32, msg="weight")
    assert_close(state, s_ref, torch.float32, msg="state")
    zero_hit = torch.unique(rows[(grad == 0).all(-1)])
    assert zero_hit.numel() > 0
    assert torch.equal(weight[zero_hit], w0[zero_hit]) and torch.equal(state[zero_hit], s0[zero_hit])


# ----------------------------------------------------------------------------------------------------
# Tables whose columns are not contiguous
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("layout", ["transposed", "every_other_column"])
@pytest.mark.parametrize("B,F", [(1, 1), (127, 3)])
def test_update_of_a_table_with_strided_columns(optimizer, layout, B, F, device, assert_close):
    """The update reads and writes the table through both of its strides (the lookup's backward test covers the
    dense gradient only): a table stored transposed and every other column of a wider one, D = 24 (not a power of
    two), hot rows that cross the kernel's chunks (B * F = 381 positions on 7 rows)."""
    R, D = 7, 24
    rows = dup_rows(B, F, R, seed=B + F + 1).to(device)
    weight = strided_table(R, D, layout, device, seed=B + F).detach()
    state = make_state(optimizer, weight)
    gen = torch.Generator().manual_seed(B * F)
    grad = torch.randn(D, B, F, generator=gen).permute(1, 2, 0).to(device)  # non-contiguous too
    w_ref, s_ref = reference_update(optimizer, rows, grad, weight, state, LR)
    untouched = torch.ones(R, dtype=torch.bool, device=device)
    untouched[rows.reshape(-1)] = False
    before = weight.clone()
    embedding_sparse_update_(rows, grad, weight, state, torch.tensor(LR, device=device), optimizer, EPS, True)
    # hot rows sum up to ~55 gradients
    assert_close(weight, w_ref, torch.float32, scale=10.0, msg="weight")
    if state is not None:
        assert_close(state, s_ref, torch.float32, scale=10.0, msg="state")
    assert torch.equal(weight[untouched], before[untouched])


# ----------------------------------------------------------------------------------------------------
# bf16 tables: the bits of stochastic rounding, and round-to-nearest ties
# ----------------------------------------------------------------------------------------------------


def corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.flatten() - a.mean(), b.flatten() - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


def test_stochastic_rounding_draws_independent_bits_per_row_and_column(device):
    """Every element of a bf16 table lands exactly halfway between two bf16 values (w = 1, step +2**-8 against a
    step of 2**-7): stochastic rounding rounds it up with probability 1/2, and the decisions of neighbouring rows
    and of neighbouring columns are uncorrelated. (`tests/kernels/test_rounding.py` checks the generator itself;
    this checks the row and column keys the update hands it: one key for every row, or for every column, would
    round whole rows or columns of a step the same way.) Rows hit once or twice (duplicates sum first)."""
    R, D = 128, 32
    B = 3 * R // 2 + 1  # rows hit twice and once
    rows = (torch.arange(B) % R)[torch.randperm(B, generator=torch.Generator().manual_seed(1))][:, None].to(device)
    hits = torch.bincount(rows.flatten().cpu(), minlength=R).to(device)
    grad = (-(2.0**-8) / hits[rows]).float()[:, :, None].expand(B, 1, D).contiguous()  # exact: 2**-8 or 2**-9
    w = torch.ones(R, D, dtype=BF16, device=device)
    seed = torch.tensor([12345], device=device)
    embedding_sparse_update_(rows, grad, w, None, torch.tensor(1.0, device=device), "sgd", EPS, True, sr_seed=seed)
    up = w.float() - 1.0
    assert bool(((up == 0) | (up == 2.0**-7)).all())  # one of the two neighbours
    u = (up > 0).double()
    n = u.numel()
    assert abs(float(u.mean()) - 0.5) < 6 * 0.5 / n**0.5
    bound = 6 / n**0.5
    assert abs(corr(u[1:], u[:-1])) < bound, "neighbouring rows round alike"
    assert abs(corr(u[:, 1:], u[:, :-1])) < bound, "neighbouring columns round alike"
    assert len({tuple(r) for r in u.tolist()}) > R // 2, "rows share their rounding decisions"


def test_round_to_nearest_breaks_ties_to_even(device):
    """One-hot bf16 update without a seed: fp32 results exactly halfway between two bf16 values (w = +-(1 + k 2**-7),
    step 2**-8 away from zero) round to the even neighbour: down for even k, up for odd k, as torch's cast does;
    rows hit once or twice (two half steps summed first)."""
    R, D = 64, 16
    k = torch.arange(R * D).reshape(R, D) % 128
    sign = torch.where(torch.arange(R)[:, None] % 2 == 0, 1.0, -1.0)
    w32 = sign * (1.0 + k * 2.0**-7)
    B = R + R // 2 + 1
    rows = (torch.arange(B) % R)[torch.randperm(B, generator=torch.Generator().manual_seed(2))]
    hits = torch.bincount(rows, minlength=R)
    # w - lr * g = w + sign * 2**-8 per row: each position carries -sign * 2**-8 / hits
    grad = (-sign[rows, 0] * 2.0**-8 / hits[rows])[:, None, None].expand(B, 1, D).contiguous()
    w = w32.to(BF16).to(device)
    assert torch.equal(w.float().cpu(), w32)  # exact bf16 values
    embedding_sparse_update_(rows[:, None].to(device), grad.to(device), w, None, torch.tensor(1.0, device=device),
                             "sgd", EPS, True)
    exact = w32 + sign * 2.0**-8  # halfway between w32 and its neighbour away from zero
    even_up = w32 + sign * torch.where(k % 2 == 1, 2.0**-7, 0.0)
    assert torch.equal(exact.to(BF16).float(), even_up)  # what torch's round-to-nearest-even gives
    assert torch.equal(w.float().cpu(), even_up)


# ----------------------------------------------------------------------------------------------------
# The sort's keys
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_rows", [2**31 - 1, 2**31, 2**31 + 5])
def test_sort_by_row_keeps_rows_and_the_padding_row_in_order(num_rows, device):
    """`sort_by_row` sorts int32 keys while every row, the multi-hot padding row R included, fits int32, and int64
    keys past that: at R = 2**31 the padding row 2**31 no longer fits, and wrapped to -2**31 it would sort first
    (an update of a row that does not exist). Stable: equal rows keep their positions' order."""
    rows = torch.tensor([[num_rows, 5, num_rows - 1], [0, 5, num_rows], [num_rows - 1, 2**30, 5]], device=device)
    sorted_rows, perm = update_module.sort_by_row(rows, num_rows)
    flat = rows.reshape(-1).cpu()
    want = torch.sort(flat, stable=True)
    assert torch.equal(sorted_rows.long().cpu(), want.values)
    assert torch.equal(perm.cpu(), want.indices)


# ----------------------------------------------------------------------------------------------------
# Hot segments ending in a last chunk of one position
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("n", [47, 48, 49, 65])
@pytest.mark.parametrize("group_sums", [True, False], ids=["group-sums", "chunk-walk"])
def test_hot_segment_ending_at_the_last_position(optimizer, n, group_sums, device, monkeypatch, assert_close):
    """16-position chunks; a run of one row from position 20 to the last position n - 1 (n one less than, equal
    to and one more than a multiple of the chunk, and 65 = 4 chunks + 1): the run starts in chunk 1 and ends in the
    last chunk, of a single position for n = 49 and 65 (the carry kernel's look two chunks ahead reaches exactly
    that position for n = 49). Every position's gradient counts. Batch n, one feature."""
    monkeypatch.setattr(heuristics, "SPARSE_UPDATE_OVERRIDE", heuristics.SparseUpdateConfig(16, 2, 4, 4))
    monkeypatch.setattr(update_module, "CARRY_GROUP_SUMS", group_sums)
    values = torch.cat([torch.arange(20) * 2, torch.full((n - 20,), 41)])  # 20 distinct rows, then row 41
    gen = torch.Generator().manual_seed(n)
    rows = values[torch.randperm(n, generator=gen)][:, None].to(device)
    R, D = 43, 16
    grad = torch.randn(n, 1, D, generator=gen).to(device)
    weight = make_weight(R, D, device)
    state = make_state(optimizer, weight)
    w_ref, s_ref = reference_update(optimizer, rows, grad, weight, state, LR)
    embedding_sparse_update_(rows, grad, weight, state, torch.tensor(LR, device=device), optimizer, EPS, True)
    assert_close(weight, w_ref, torch.float32, scale=10.0, msg="weight")
    if state is not None:
        assert_close(state, s_ref, torch.float32, scale=10.0, msg="state")
