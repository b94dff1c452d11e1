"""kernels/embedding/pooled*.py's fused sparse update against float64 references: each optimizer with and
without weight decay, a hot row spanning many kernel chunks, the chunk kernel's cache hints and row-load orders
giving the same bits, determinism and the atomic SGD path, presorted rows, an all-PAD batch, bad inputs; bf16
tables and stochastic rounding.

CPU: Triton interpreter, small shapes (bf16 runs there too, slowly, on tiny tables); GPU-marked tests
repeat the update at B = 4096, D = 128 with MLPerf DLRMv2's 26 hotness values, in fp32 and bf16.

Reference (`reference_update`, with the cases, from test_pooled_embedding.py): each optimizer's step
written out in float64 over the touched rows (a row's summed slot gradients plus decay, then the rule).
"""

from __future__ import annotations

import pytest
import torch

from kernels import heuristics
from kernels.embedding import update as update_module
from kernels.embedding import (
    PAD_SPARSE,
    pooled_embedding_lookup,
    pooled_embedding_sparse_update_,
    pooled_hash_rows,
    pooled_layout,
)
from tests.kernels.embedding_inputs import make_grad, make_state, make_weight
from tests.kernels.fastkern_once import once
from tests.kernels.test_pooled_embedding import (
    EPS,
    LR,
    MLPERF_HOTNESS,
    OPTIMIZERS,
    accumulation_bound,
    assert_within,
    make_case,
    reference_update,
)


# ----------------------------------------------------------------------------------------------------
# Fused update
# ----------------------------------------------------------------------------------------------------


UPDATE_CASES = [
    # (B, hotness, D, mode, grad layout)
    (1, [1], 16, "modulus", "contiguous"),
    (3, [3, 1, 2], 24, "vocabulary", "permuted"),
    (127, [2, 5, 1, 1, 3, 2], 16, "modulus", "expand"),
    (127, [3, 1, 2], 24, "vocabulary", "contiguous"),
]


@pytest.mark.parametrize("weight_decay", [0.0, 0.1], ids=["no-decay", "decay"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("B,hotness,D,mode,layout", UPDATE_CASES)
def test_pooled_update_matches_reference(optimizer, weight_decay, B, hotness, D, mode, layout, device, assert_close):
    case = make_case(B, hotness, mode, seed=5 * B + D).to(device)
    rows = pooled_hash_rows(case.raw, *case.hash_args(), case.num_rows, *case.vocab_args())
    weight = make_weight(case.num_rows, D, device, sliced=(layout == "permuted"))
    state = make_state(optimizer, weight)
    grad = make_grad(B, len(hotness), D, layout, device)
    w_ref, s_ref = reference_update(optimizer, rows, grad, case.slot_feature, weight, state, LR, weight_decay)
    lr = torch.tensor(LR, device=device)
    pooled_embedding_sparse_update_(rows, grad, case.layout(), weight, state, lr, optimizer, EPS, True, weight_decay)
    assert_close(weight, w_ref, torch.float32, msg="weight")
    if state is not None:
        assert_close(state, s_ref, torch.float32, msg="state")


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_pooled_update_hot_row_spanning_many_chunks(optimizer, device, assert_close, monkeypatch):
    """Feature 0 (hotness 3) is all missing or PAD: one row takes ~600 slots, over many 16-position
    chunks (several carry steps of 4 chunks), and the PAD slots sorted after it span chunks too."""
    monkeypatch.setattr(heuristics, "SPARSE_UPDATE_OVERRIDE", heuristics.SparseUpdateConfig(16, 4, 4, 4))
    B, D = 300, 16
    case = make_case(B, [3, 2], "modulus", seed=9, pad=0.3).to(device)
    raw = case.raw.clone()
    raw[:, :3] = torch.where(raw[:, :3] == PAD_SPARSE, PAD_SPARSE, -1)
    rows = pooled_hash_rows(raw, *case.hash_args(), case.num_rows)
    weight = make_weight(case.num_rows, D, device)
    state = make_state(optimizer, weight)
    grad = make_grad(B, 2, D, "contiguous", device)
    w_ref, s_ref = reference_update(optimizer, rows, grad, case.slot_feature, weight, state, LR)
    pooled_embedding_sparse_update_(rows, grad, case.layout(), weight, state, torch.tensor(LR, device=device),
                                    optimizer)
    assert_close(weight, w_ref, torch.float32, scale=10.0, msg="weight")
    if state is not None:
        assert_close(state, s_ref, torch.float32, scale=10.0, msg="state")


@pytest.mark.parametrize("eviction", ["rows_first", "grad_last", "rows_first_grad_last"])
@pytest.mark.parametrize("optimizer,dtype", [("adagrad", torch.float32), ("rowwise_adagrad", torch.bfloat16)])
def test_eviction_policies_give_the_same_bits(eviction, optimizer, dtype, device, monkeypatch):
    """L2 eviction priorities of the chunk kernel's traffic (`update.EVICTION`) are cache hints only: the same
    weights and state, bit for bit, as without them (a hot row spanning chunks, PAD slots, weight decay and, for
    bf16 tables, stochastic rounding with the same seed)."""
    monkeypatch.setattr(heuristics, "SPARSE_UPDATE_OVERRIDE", heuristics.SparseUpdateConfig(16, 4, 4, 4))
    B, D = 97, 24
    case = make_case(B, [3, 2], "modulus", seed=5, pad=0.3).to(device)
    raw = case.raw.clone()
    raw[: B // 2, 0] = -1  # one row hit by ~50 slots: several 16-position chunks
    rows = pooled_hash_rows(raw, *case.hash_args(), case.num_rows)
    grad = make_grad(B, 2, D, "permuted", device, dtype)
    lr = torch.tensor(LR, device=device)

    def run(policy):
        monkeypatch.setattr(update_module, "EVICTION", policy)
        weight = make_weight(case.num_rows, D, device, dtype)
        state = make_state(optimizer, weight)
        seed = torch.full((1,), 3, dtype=torch.int64, device=device)
        pooled_embedding_sparse_update_(rows, grad, case.layout(), weight, state, lr, optimizer, EPS, True, 0.05, seed)
        return weight, state

    # the run without hints is the same for every policy: once per (optimizer, dtype) in this process
    (w0, s0) = once(("test_eviction_policies", optimizer, dtype, str(device)), lambda: run("none"))
    (w1, s1) = run(eviction)
    assert not torch.equal(w0, make_weight(case.num_rows, D, device, dtype))  # the update happened
    assert torch.equal(w1, w0) and torch.equal(s1, s0)


@pytest.mark.parametrize("order", ["with_gradients", "first", "prefetch_l2"])
@pytest.mark.parametrize("optimizer,dtype", [("sgd", torch.float32), ("adagrad", torch.float32),
                                             ("rowwise_adagrad", torch.float32), ("rowwise_adagrad", torch.bfloat16)])
def test_row_load_orders_give_the_same_bits(order, optimizer, dtype, device, monkeypatch, assert_close):
    """When the chunk kernel loads the updated rows' weights and state (`update.ROW_LOADS`): every order
    against "after_sums", with a hot row spanning chunks (carry kernel), PAD slots, lazy weight decay and,
    for bf16 tables, stochastic rounding with the same seed. The shipped "prefetch_l2" (the same code plus
    L2 prefetches, which the interpreter leaves out) gives the same bits; the others do in the
    interpreter and agree to rounding on the GPU."""
    monkeypatch.setattr(heuristics, "SPARSE_UPDATE_OVERRIDE", heuristics.SparseUpdateConfig(16, 4, 4, 4))
    B, D = 120, 24
    case = make_case(B, [3, 2], "modulus", seed=13, pad=0.3).to(device)
    raw = case.raw.clone()
    raw[: B // 2, 0] = -1  # one row hit by 60 slots: several 16-position chunks
    rows = pooled_hash_rows(raw, *case.hash_args(), case.num_rows)
    grad = make_grad(B, 2, D, "permuted", device, dtype)
    lr = torch.tensor(LR, device=device)

    def run(row_loads):
        monkeypatch.setattr(update_module, "ROW_LOADS", row_loads)
        weight = make_weight(case.num_rows, D, device, dtype)
        state = make_state(optimizer, weight)
        seed = torch.full((1,), 7, dtype=torch.int64, device=device)
        pooled_embedding_sparse_update_(rows, grad, case.layout(), weight, state, lr, optimizer, EPS, True, 0.05, seed)
        return weight, state

    # the "after_sums" run is the same for every order: once per (optimizer, dtype) in this process
    (w0, s0) = once(("test_row_load_orders", optimizer, dtype, str(device)), lambda: run("after_sums"))
    (w1, s1) = run(order)
    assert not torch.equal(w0, make_weight(case.num_rows, D, device, dtype))  # the update happened
    if order == "prefetch_l2" or device.type == "cpu":
        assert torch.equal(w1, w0)
        if s0 is not None:
            assert torch.equal(s1, s0)
    else:
        # Compiled, these orders give w and s another register layout, and row-wise Adagrad's mean of g^2
        # over D another reduction order: the same sums up to fp32 rounding (measured on the H100).
        assert_close(w1, w0, dtype, msg="weight")
        if s0 is not None:
            assert_close(s1, s0, torch.float32, msg="state")


def test_pooled_update_deterministic_and_atomic_sgd(device, assert_close):
    case = make_case(127, [2, 5, 1, 1, 3, 2], seed=13).to(device)
    rows = pooled_hash_rows(case.raw, *case.hash_args(), case.num_rows)
    grad = make_grad(127, 6, 24, "expand", device)
    lr = torch.tensor(LR, device=device)
    w_ref, _ = reference_update("sgd", rows, grad, case.slot_feature, make_weight(case.num_rows, 24, device), None, LR)
    results = []
    for deterministic in (True, True, False):
        weight = make_weight(case.num_rows, 24, device)
        pooled_embedding_sparse_update_(rows, grad, case.layout(), weight, None, lr, "sgd", EPS, deterministic)
        assert_close(weight, w_ref, torch.float32)
        results.append(weight)
    assert torch.equal(results[0], results[1])  # bitwise reproducible


@pytest.mark.parametrize("optimizer,dtype", [("rowwise_adagrad", torch.bfloat16), ("adagrad", torch.float32)])
def test_presorted_rows_give_the_update_its_own_bits(optimizer, dtype, device):
    """`update.sort_by_row` run by the caller beforehand (``presorted``, as the sharded owner runs it while the
    gradients travel) gives the very weights, state and seed the update's own sort gives; a sort of other rows is
    refused by shape; `update_sorts` says which updates sort at all."""
    from kernels.embedding.pooled import pooled_update_impl

    B, D = 61, 16
    case = make_case(B, [3, 1, 2], "modulus", seed=9, pad=0.2).to(device)
    raw = case.raw.clone()
    raw[: B // 2, 0] = -1  # a hot row over several chunks
    rows = pooled_hash_rows(raw, *case.hash_args(), case.num_rows).to(torch.int32)
    grad = make_grad(B, 3, D, "permuted", device, dtype)
    lr = torch.tensor(LR, device=device)
    slot_feature = case.layout().slot_feature
    results = []
    for presorted in (None, update_module.sort_by_row(rows, case.num_rows)):
        weight = make_weight(case.num_rows, D, device, dtype)
        state = make_state(optimizer, weight)
        seed = torch.full((1,), 5, dtype=torch.int64, device=device)
        pooled_update_impl(rows, grad, slot_feature, weight, state, lr, optimizer, EPS, True, 0.01, seed, True,
                           presorted=presorted)
        results.append((weight, state, seed))
    (w0, s0, k0), (w1, s1, k1) = results
    assert not torch.equal(w0, make_weight(case.num_rows, D, device, dtype))  # the update happened
    assert torch.equal(w1, w0) and torch.equal(s1, s0) and torch.equal(k1, k0)
    other = update_module.sort_by_row(rows[:-1], case.num_rows)
    with pytest.raises(ValueError, match="presorted"):
        pooled_update_impl(rows, grad, slot_feature, w1, s1, lr, optimizer, EPS, True, 0.0, k1, True, presorted=other)
    assert update_module.update_sorts(optimizer, True, dtype)
    assert update_module.update_sorts("sgd", False, torch.bfloat16) and update_module.update_sorts("sgd", True, dtype)
    assert update_module.update_sorts("sgd", False, torch.float32, weight_decay=0.1)
    assert not update_module.update_sorts("sgd", False, torch.float32)


def test_pooled_update_all_pad_touches_nothing(device):
    case = make_case(5, [2, 3]).to(device)
    raw = torch.full_like(case.raw, PAD_SPARSE)
    rows = pooled_hash_rows(raw, *case.hash_args(), case.num_rows)
    assert bool((rows == case.num_rows).all())
    weight = make_weight(case.num_rows, 16, device)
    state = make_state("adagrad", weight)
    w0, s0 = weight.clone(), state.clone()
    pooled_embedding_sparse_update_(rows, make_grad(5, 2, 16, "contiguous", device), case.layout(), weight, state,
                                    torch.tensor(LR, device=device), "adagrad", EPS, True, 0.1)
    assert torch.equal(weight, w0) and torch.equal(state, s0)


def test_pooled_update_rejects_bad_inputs(device):
    case = make_case(3, [2, 1]).to(device)
    rows = pooled_hash_rows(case.raw, *case.hash_args(), case.num_rows)
    lay = case.layout()
    lr = torch.tensor(LR, device=device)
    grad = make_grad(3, 2, 16, "contiguous", device)
    weight = make_weight(case.num_rows, 16, device)
    with pytest.raises(ValueError, match="optimizer"):
        pooled_embedding_sparse_update_(rows, grad, lay, weight, None, lr, "adam")
    with pytest.raises(ValueError, match="slot_feature"):
        pooled_embedding_sparse_update_(rows[:, :2], grad, lay, weight, None, lr)
    with pytest.raises(ValueError, match="sr_seed"):
        pooled_embedding_sparse_update_(rows, grad.bfloat16(), lay, weight.bfloat16(), None, lr)
    with pytest.raises(ValueError, match="slots"):
        pooled_embedding_lookup(case.raw[:, :1], weight, *case.hash_args())
    with pytest.raises(ValueError, match="slots"):
        pooled_hash_rows(torch.cat([case.raw, case.raw], 1), *case.hash_args(), case.num_rows)


# ----------------------------------------------------------------------------------------------------
# bf16 and stochastic rounding
# ----------------------------------------------------------------------------------------------------


def bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and above fp32 ``x`` (truncation and truncation + 1 ulp, by magnitude)."""
    bits = x.float().view(torch.int32)
    down = (bits & ~0xFFFF).view(torch.float32)
    up = ((bits & ~0xFFFF) + 0x10000).view(torch.float32)
    exact = (bits & 0xFFFF) == 0
    up = torch.where(exact, down, up)
    return torch.minimum(down, up), torch.maximum(down, up)


def test_stochastic_rounding_is_unbiased(device):
    """SGD on 4096 bf16 weights, all 1.0, by a step that lands at 0.3 ulp below (fp32 result between two
    bf16 neighbours): every stochastic result is one of the two neighbours, their mean is the fp32
    result within 4 sigma, while round-to-nearest never moves. A second step draws other bits (seed)."""
    R, D = 64, 64
    ulp = 2.0**-8  # bf16 spacing just below 1.0 is 2**-8
    lay = pooled_layout([1], device)
    cards, offs = torch.tensor([R], device=device), torch.tensor([0], device=device)
    raw = torch.arange(R, device=device)[:, None]  # every row once
    rows = pooled_hash_rows(raw, cards, offs, lay, R)
    lr = torch.tensor(1.0, device=device)
    grad = torch.full((R, 1, D), 0.3 * ulp, device=device, dtype=torch.bfloat16)
    exact = 1.0 - float(grad[0, 0, 0].float())  # the fp32 result (the bf16 gradient is 0.3 ulp to 3 digits)
    seed = torch.tensor([123], device=device)
    w_sr = torch.ones(R, D, device=device, dtype=torch.bfloat16)
    pooled_embedding_sparse_update_(rows, grad, lay, w_sr, None, lr, "sgd", sr_seed=seed)
    assert int(seed) == 124  # advanced on the device
    lo, hi = bf16_neighbours(torch.tensor(exact))
    vals = w_sr.float()
    assert bool(((vals == lo) | (vals == hi)).all())
    frac_down = float((vals == lo).float().mean())
    p = (hi.item() - exact) / (hi.item() - lo.item())  # probability of rounding down
    sigma = (p * (1 - p) / vals.numel()) ** 0.5
    assert abs(frac_down - p) < 4 * sigma, (frac_down, p)
    assert abs(vals.double().mean().item() - exact) < 4 * sigma * ulp
    w_rtn = torch.ones(R, D, device=device, dtype=torch.bfloat16)
    pooled_embedding_sparse_update_(rows, grad, lay, w_rtn, None, lr, "sgd", stochastic_rounding=False)
    assert bool((w_rtn == 1.0).all())  # round to nearest: biased, the step is lost
    w2 = torch.ones(R, D, device=device, dtype=torch.bfloat16)
    pooled_embedding_sparse_update_(rows, grad, lay, w2, None, lr, "sgd", sr_seed=seed)
    assert not torch.equal(w2, w_sr)  # new seed, new random bits


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_bf16_update_matches_reference(optimizer, device, assert_close):
    """bf16 tables: fp32 update math, result within one bf16 step of the float64 reference (SR) and
    equal to the reference rounded to nearest without SR (up to fp32 ties)."""
    B, hotness, D = 31, [3, 1, 2], 16
    case = make_case(B, hotness, "modulus", seed=41).to(device)
    rows = pooled_hash_rows(case.raw, *case.hash_args(), case.num_rows)
    weight = make_weight(case.num_rows, D, device, torch.bfloat16)
    state = make_state(optimizer, weight)
    grad = make_grad(B, 3, D, "permuted", device, torch.bfloat16)
    w_ref, s_ref = reference_update(optimizer, rows, grad, case.slot_feature, weight, state, LR, 0.01)
    lr = torch.tensor(LR, device=device)
    w_sr, s_sr = weight.clone(), None if state is None else state.clone()
    seed = torch.zeros(1, dtype=torch.int64, device=device)
    pooled_embedding_sparse_update_(rows, grad, case.layout(), w_sr, s_sr, lr, optimizer, EPS, True, 0.01, seed)
    # The kernel's fp32 math lies within `slack` of the float64 reference: allow either side of it.
    slack = 1e-5 * (w_ref.abs() + weight.double().abs())
    lo, _ = bf16_neighbours((w_ref - slack).float())
    _, hi = bf16_neighbours((w_ref + slack).float())
    assert bool(((w_sr.float() >= lo) & (w_sr.float() <= hi)).all()), "SR result outside the bf16 neighbours"
    assert not torch.equal(w_sr, weight)
    w_rn, s_rn = weight.clone(), None if state is None else state.clone()
    pooled_embedding_sparse_update_(rows, grad, case.layout(), w_rn, s_rn, lr, optimizer, EPS, True, 0.01,
                                    stochastic_rounding=False)
    near = ((w_rn == (w_ref - slack).to(torch.bfloat16)) | (w_rn == (w_ref + slack).to(torch.bfloat16)))
    assert bool(near.all()), "round-to-nearest result is not the reference rounded to nearest"
    if state is not None:
        assert_close(s_sr, s_ref, torch.float32, msg="state")
        assert torch.equal(s_sr, s_rn)


# ----------------------------------------------------------------------------------------------------
# GPU: MLPerf-like shape, bf16, stochastic rounding
# ----------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_update_mlperf_hotness(optimizer, dtype, assert_close):
    device = torch.device("cuda")
    B, D = 4096, 128
    case = make_case(B, MLPERF_HOTNESS, "modulus", seed=37).to(device)
    rows = pooled_hash_rows(case.raw, *case.hash_args(), case.num_rows)
    weight = make_weight(case.num_rows, D, device, dtype)
    state = make_state(optimizer, weight)
    grad = make_grad(B, len(MLPERF_HOTNESS), D, "contiguous", device, dtype)
    w_ref, s_ref = reference_update(optimizer, rows, grad, case.slot_feature, weight, state, LR, 0.01)
    lr = torch.tensor(LR, device=device)
    seed = torch.zeros(1, dtype=torch.int64, device=device)
    w1, s1 = weight.clone(), None if state is None else state.clone()
    pooled_embedding_sparse_update_(rows, grad, case.layout(), weight, state, lr, optimizer, EPS, True, 0.01, seed)
    # Hot rows sum thousands of slot gradients: SGD moves them by lr * that sum.
    assert_close(weight, w_ref, dtype, scale=30.0)
    if state is not None:
        torch.testing.assert_close(state.double(), s_ref, atol=1e-2, rtol=1e-4 if dtype == torch.float32 else 1e-2)
    seed.zero_()
    pooled_embedding_sparse_update_(rows, grad, case.layout(), w1, s1, lr, optimizer, EPS, True, 0.01, seed)
    assert torch.equal(weight, w1)  # bitwise reproducible, SR included (same seed)
    if dtype == torch.float32 and optimizer == "sgd":
        w2 = make_weight(case.num_rows, D, device, dtype)
        pooled_embedding_sparse_update_(rows, grad, case.layout(), w2, None, lr, "sgd", EPS, deterministic=False)
        w0 = make_weight(case.num_rows, D, device)
        w_ref0, _ = reference_update("sgd", rows, grad, case.slot_feature, w0, None, LR)
        # atomics add lr * g slot by slot onto the row, in any order: the rounding grows with the hits
        assert_within(w2, w_ref0, accumulation_bound(rows, grad, case.slot_feature, case.num_rows, w0, LR), "atomic sgd")


@pytest.mark.gpu
def test_gpu_stochastic_rounding_unbiased():
    test_stochastic_rounding_is_unbiased(torch.device("cuda"))
