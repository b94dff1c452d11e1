"""kernels/embedding/'s sparse update op (`embedding_sparse_update_`) against a float64 dense-gradient
reference (CPU: Triton interpreter; GPU: marked gpu): each optimizer (hot rows included, one of them spanning
many kernel chunks), bitwise determinism, the atomic SGD path (hot rows, blocks summed per row first), bad
inputs.

The cases and the reference (`reference_update`) come from test_embedding.py.
"""

from __future__ import annotations

import pytest
import torch

from kernels import heuristics
from kernels.embedding import embedding_sparse_update_, hash_rows
from tests.kernels.embedding_inputs import make_grad, make_state, make_weight
from tests.kernels.test_embedding import EPS, LR, OPTIMIZERS, make_case, reference_update


# ----------------------------------------------------------------------------------------------------
# Fused sparse update
# ----------------------------------------------------------------------------------------------------


UPDATE_CASES = [
    # (B, F, D, mode, hot, grad layout)
    (1, 1, 24, "modulus", False, "contiguous"),
    (3, 26, 16, "vocabulary", True, "permuted"),
    (127, 1, 16, "modulus", True, "expand"),
    (127, 26, 24, "modulus", True, "permuted"),
    (127, 26, 16, "vocabulary", True, "contiguous"),
]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("B,F,D,mode,hot,layout", UPDATE_CASES)
def test_sparse_update_matches_dense_reference(optimizer, B, F, D, mode, hot, layout, device, assert_close):
    case = make_case(B, F, mode, hot=hot, seed=7 * B + F).to(device)
    rows = hash_rows(case.raw, *case.hash_args())
    weight = make_weight(case.num_rows, D, device, sliced=(layout == "permuted"))
    state = make_state(optimizer, weight, zero=(B == 1))
    grad = make_grad(B, F, D, layout, device)
    w_ref, s_ref = reference_update(optimizer, rows, grad, weight, state, LR)
    lr = torch.tensor(LR, device=device)
    embedding_sparse_update_(rows, grad, weight, state, lr, optimizer, EPS, deterministic=True)
    assert_close(weight, w_ref, torch.float32, msg="weight")
    if state is not None:
        assert_close(state, s_ref, torch.float32, msg="state")


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("config", [None, (16, 16, 4, 4)], ids=["default-config", "small-chunks"])
def test_sparse_update_one_row_spanning_many_chunks(optimizer, config, device, assert_close, monkeypatch):
    """1100 positions on one row (feature 0 all missing) cover many chunks; with 16-position chunks and
    16 chunks per carry step (69 chunks) the carry loop takes several steps. Feature 1 adds ordinary
    rows around it."""
    override = None if config is None else heuristics.SparseUpdateConfig(*config)
    monkeypatch.setattr(heuristics, "SPARSE_UPDATE_OVERRIDE", override)
    B, D = 1100, 16
    case = make_case(B, 2, "modulus", seed=5).to(device)
    raw = case.raw.clone()
    raw[:, 0] = -1
    rows = hash_rows(raw, *case.hash_args())
    weight = make_weight(case.num_rows, D, device)
    state = make_state(optimizer, weight)
    grad = make_grad(B, 2, D, "contiguous", device)
    w_ref, s_ref = reference_update(optimizer, rows, grad, weight, state, LR)
    embedding_sparse_update_(rows, grad, weight, state, torch.tensor([LR], device=device), optimizer, EPS, True)
    # The hot row sums 1100 gradients: allow for the fp32 rounding of a sum of that many terms.
    assert_close(weight, w_ref, torch.float32, scale=10.0, msg="weight")
    if state is not None:
        assert_close(state, s_ref, torch.float32, scale=10.0, msg="state")


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_sparse_update_bitwise_deterministic(optimizer, device):
    case = make_case(127, 26, "modulus", hot=True, seed=11).to(device)
    rows = hash_rows(case.raw, *case.hash_args())
    grad = make_grad(127, 26, 16, "contiguous", device)
    results = []
    for _ in range(2):
        weight = make_weight(case.num_rows, 16, device)
        state = make_state(optimizer, weight)
        embedding_sparse_update_(rows, grad, weight, state, torch.tensor(LR, device=device), optimizer, EPS, True)
        results.append((weight, state))
    assert torch.equal(results[0][0], results[1][0])
    if results[0][1] is not None:
        assert torch.equal(results[0][1], results[1][1])


def test_sparse_update_sgd_atomic_path(device, assert_close):
    case = make_case(127, 26, "modulus", hot=True, seed=13).to(device)
    rows = hash_rows(case.raw, *case.hash_args())
    weight = make_weight(case.num_rows, 24, device)
    grad = make_grad(127, 26, 24, "expand", device)
    w_ref, _ = reference_update("sgd", rows, grad, weight, None, LR)
    embedding_sparse_update_(rows, grad, weight, None, torch.tensor(LR, device=device), "sgd", EPS, deterministic=False)
    assert_close(weight, w_ref, torch.float32)


@pytest.mark.parametrize("B,F,D,layout", [(1, 1, 16, "contiguous"), (3, 26, 40, "permuted"), (300, 3, 16, "expand")])
def test_sgd_atomic_path_hot_rows(B, F, D, layout, device, assert_close):
    """The atomic SGD update on odd shapes: B=300 spans several programs, feature 0 is one row in every
    sample (a hot row added from every program), feature 2 cycles through 3 rows."""
    case = make_case(B, F, "modulus", hot=True, seed=B + D).to(device)
    raw = case.raw.clone()
    raw[:, 0] = -1
    if F > 2:
        raw[:, 2] = torch.arange(B, device=device) % 3
    rows = hash_rows(raw, *case.hash_args())
    weight = make_weight(case.num_rows, D, device, sliced=(layout == "permuted"))
    grad = make_grad(B, F, D, layout, device)
    w_ref, _ = reference_update("sgd", rows, grad, weight, None, LR)
    embedding_sparse_update_(rows, grad, weight, None, torch.tensor(LR, device=device), "sgd", EPS, deterministic=False)
    assert_close(weight, w_ref, torch.float32, scale=10.0 if B == 300 else 1.0)  # the hot row sums 300 terms


@pytest.mark.parametrize("grad_dtype,D", [(torch.float32, 16), (torch.bfloat16, 16), (torch.float32, 64),
                                          (torch.float32, 128)])
def test_sgd_atomic_path_sums_blocks_that_fit_the_span_first(grad_dtype, D, device, assert_close):
    """The atomic SGD update sums a block's gradients per row first when its rows fit in
    `heuristics.ATOMIC_SUM_SPAN` consecutive rows, and adds per position otherwise: one column at each side of
    the boundary (rows spanning SPAN - 1 and SPAN), one with a single row, one with every row skipped
    (>= R), one of random rows; B = 300 spans several blocks and ends in a partial one (fp32 gradients at D=128
    take blocks of 64 samples, the others 128). fp32 gradients are summed as three bf16 parts. float64
    reference."""
    span = heuristics.ATOMIC_SUM_SPAN
    block = heuristics.atomic_update_launch(max(16, D), grad_dtype == torch.float32)[0]
    B, R = 300, 4 * span + 40
    gen = torch.Generator().manual_seed(21)
    b = torch.arange(B)
    rows = torch.stack([
        10 + (b * 7) % span,  # spans SPAN - 1 in every block: summed first
        span + 20 + torch.where(b % block == 0, span, torch.where(b % block == 1, 0, (b * 5) % span)),  # spans SPAN
        torch.full((B,), 3),  # one row hit by every sample
        torch.full((B,), R),  # all skipped (rows >= R: multi-hot padding)
        torch.randint(0, R, (B,), generator=gen),
    ], dim=1).to(device)
    assert int(rows[:, 0].max() - rows[:, 0].min()) == span - 1
    assert int(rows[:block, 1].max() - rows[:block, 1].min()) == span
    weight = make_weight(R, D, device)
    grad = (torch.randn(B, 5, D, generator=gen) * 0.1).to(device=device, dtype=grad_dtype)
    keep = rows < R
    w_ref = weight.double().clone()
    w_ref.index_add_(0, rows[keep], grad[keep].double(), alpha=-LR)
    embedding_sparse_update_(rows, grad, weight, None, torch.tensor(LR, device=device), "sgd", EPS, deterministic=False)
    # fp32 sums of up to 300 terms of |lr g| <= ~0.04, in any order
    assert_close(weight, w_ref, torch.float32, scale=10.0)


def test_sparse_update_rejects_bad_inputs(device):
    case = make_case(3, 2, "modulus").to(device)
    rows = hash_rows(case.raw, *case.hash_args())
    weight = make_weight(case.num_rows, 16, device)
    grad = make_grad(3, 2, 16, "contiguous", device)
    lr = torch.tensor(LR, device=device)
    with pytest.raises(ValueError, match="optimizer"):
        embedding_sparse_update_(rows, grad, weight, None, lr, "adam")
    with pytest.raises(ValueError, match="state"):
        embedding_sparse_update_(rows, grad, weight, None, lr, "adagrad")
    with pytest.raises(ValueError, match="lr"):
        embedding_sparse_update_(rows, grad, weight, None, torch.tensor(LR, dtype=torch.float64, device=device), "sgd")


def test_hashed_atomic_update_rejects_bad_inputs(device):
    case = make_case(3, 2, "modulus").to(device)
    card, off = case.hash_args()[:2]
    weight = make_weight(case.num_rows, 16, device)
    grad = make_grad(3, 2, 16, "contiguous", device)
    lr = torch.tensor(LR, device=device)
    op = torch.ops.dlrm_kernels.embedding_sgd_atomic_hashed_
    with pytest.raises(ValueError, match="grad_out"):
        op(case.raw, card, off, grad[:2], weight, lr)
    with pytest.raises(ValueError, match="float32"):
        op(case.raw, card, off, grad, weight.bfloat16(), lr)
    with pytest.raises(ValueError, match="cardinalities"):
        op(case.raw, card[:1], off, grad, weight, lr)
    with pytest.raises(ValueError, match="lr"):
        op(case.raw, card, off, grad, weight, lr.double())


# ----------------------------------------------------------------------------------------------------
# GPU (repeat the comparisons on CUDA, bf16 included)
# ----------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_sparse_update(optimizer, dtype, assert_close):
    device = torch.device("cuda")
    B, F, D = 4096, 26, 128
    case = make_case(B, F, "modulus", hot=True, seed=37).to(device)
    rows = hash_rows(case.raw, *case.hash_args())
    weight = make_weight(case.num_rows, D, device, dtype)
    state = make_state(optimizer, weight)
    grad = make_grad(B, F, D, "contiguous", device, dtype)
    w_ref, s_ref = reference_update(optimizer, rows, grad, weight, state, LR)
    lr = torch.tensor(LR, device=device)
    w1, s1 = weight.clone(), None if state is None else state.clone()
    embedding_sparse_update_(rows, grad, weight, state, lr, optimizer, EPS, True)
    # Hot rows sum ~B * 0.8 / 3 ~ 1000 gradients; SGD moves them by lr * that sum.
    assert_close(weight, w_ref, dtype, scale=10.0)
    if state is not None:
        torch.testing.assert_close(state.double(), s_ref, atol=1e-2, rtol=1e-4 if dtype == torch.float32 else 1e-2)
    embedding_sparse_update_(rows, grad, w1, s1, lr, optimizer, EPS, True)
    assert torch.equal(weight, w1)  # bitwise reproducible
    if dtype == torch.float32 and optimizer == "sgd":
        w2 = make_weight(case.num_rows, D, device, dtype)
        embedding_sparse_update_(rows, grad, w2, None, lr, "sgd", EPS, deterministic=False)
        assert_close(w2, w_ref, dtype, scale=10.0)
