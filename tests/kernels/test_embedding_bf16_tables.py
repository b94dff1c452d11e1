"""One-hot bf16 tables: the fused update's rounding back to bf16 (CPU: Triton interpreter; GPU: marked gpu).

``model.embedding_dtype: "bf16"`` promises an update computed in fp32 and written back by stochastic
rounding, so that updates smaller than half a bf16 step are not lost. For the one-hot lookup
(`TritonSparseEmbedding`) that means, element by element:

* with no seed: exactly the fp32 update (the same kernel on an fp32 copy of the table) rounded to
  nearest even;
* with a seed: one of the two bf16 neighbours of that fp32 result, rounded up with probability equal to
  its distance from the lower one (unbiased), different bits for different seeds, the seed advanced;
* the module rounds stochastically by default and keeps small SGD steps that nearest rounding drops.
"""

from __future__ import annotations

import pytest
import torch

from kernels.embedding import SparseOptimizerConfig, TritonSparseEmbedding, embedding_sparse_update_, hash_rows
from tests.kernels.embedding_inputs import make_grad, make_state, make_weight
from tests.kernels.test_embedding import EPS, LR, OPTIMIZERS, make_case

BF16 = torch.bfloat16


def neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and just above fp32 ``x`` in magnitude (equal when x is a bf16 value)."""
    bits = x.view(torch.int32)
    down = (bits & ~0xFFFF).view(torch.float32)
    up = torch.where((bits & 0xFFFF) == 0, bits, (bits & ~0xFFFF) + 0x10000).view(torch.float32)
    return down, up


def fp32_update(optimizer, rows, grad, w16, state, lr):
    """The same fused update on an fp32 copy of the bf16 table: the value bf16 rounding starts from."""
    w32 = w16.float()
    s32 = None if state is None else state.clone()
    embedding_sparse_update_(rows, grad, w32, s32, lr, optimizer, EPS, True)
    return w32, s32


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("B,F,D,layout", [(1, 1, 16, "contiguous"), (3, 26, 24, "permuted"), (127, 26, 16, "expand")])
def test_bf16_update_rounds_the_fp32_update(optimizer, B, F, D, layout, device):
    case = make_case(B, F, "modulus", hot=True, seed=B + F).to(device)
    rows = hash_rows(case.raw, *case.hash_args())
    w16 = make_weight(case.num_rows, D, device).to(BF16)
    state = make_state(optimizer, w16.float())
    grad = make_grad(B, F, D, layout, device)
    lr = torch.tensor(LR, device=device)
    w32, s32 = fp32_update(optimizer, rows, grad, w16, state, lr)

    nearest = w16.clone()
    s_n = None if state is None else state.clone()
    embedding_sparse_update_(rows, grad, nearest, s_n, lr, optimizer, EPS, True)
    assert torch.equal(nearest, w32.to(BF16))  # round to nearest even, ties included
    assert s_n is None or torch.equal(s_n, s32)

    seed = torch.zeros(1, dtype=torch.int64, device=device)
    sr = w16.clone()
    s_sr = None if state is None else state.clone()
    embedding_sparse_update_(rows, grad, sr, s_sr, lr, optimizer, EPS, True, sr_seed=seed)
    assert int(seed) == 1  # advanced on the device
    down, up = neighbours(w32)
    assert bool(((sr.float() == down) | (sr.float() == up)).all())
    assert s_sr is None or torch.equal(s_sr, s32)  # the optimizer state is fp32: never rounded
    again = w16.clone()
    embedding_sparse_update_(rows, grad, again, None if state is None else state.clone(), lr, optimizer, EPS, True,
                             sr_seed=torch.zeros(1, dtype=torch.int64, device=device))
    assert torch.equal(again, sr)  # the same seed: the same bits
    if B * F * D >= 1000:
        other = w16.clone()
        embedding_sparse_update_(rows, grad, other, None if state is None else state.clone(), lr, optimizer, EPS,
                                 True, sr_seed=seed)  # seed 1 now
        assert not torch.equal(other, sr)


def test_stochastic_rounding_is_unbiased_over_seeds(device):
    """Updates far below half a bf16 step: nearest rounding loses them all, the mean of stochastically
    rounded results over 32 seeds equals the fp32 result (within 6 standard errors)."""
    B, F, D = 64, 4, 16
    case = make_case(B, F, "modulus", seed=3).to(device)
    rows = hash_rows(case.raw, *case.hash_args())
    w16 = (1 + torch.rand(case.num_rows, D, generator=torch.Generator().manual_seed(4))).to(BF16).to(device)
    grad = make_grad(B, F, D, "contiguous", device)
    lr = torch.tensor(2.0**-12, device=device)  # steps of ~2**-12 against a bf16 step of 2**-7 at [1, 2)
    w32, _ = fp32_update("sgd", rows, grad, w16, None, lr)
    touched = w32 != w16.float()
    assert int(touched.sum()) > 500
    nearest = w16.clone()
    embedding_sparse_update_(rows, grad, nearest, None, lr, "sgd", EPS, True)
    assert torch.equal(nearest[touched], w16[touched])  # all lost

    seed = torch.zeros(1, dtype=torch.int64, device=device)
    runs = []
    for _ in range(32):
        w = w16.clone()
        embedding_sparse_update_(rows, grad, w, None, lr, "sgd", EPS, True, sr_seed=seed)
        runs.append(w.float())
    assert int(seed) == 32
    mean = torch.stack(runs).mean(0)
    down, up = neighbours(w32)
    ulp = (up - down)[touched].double()
    frac = ((w32 - down)[touched].double() / ulp)  # the probability of rounding up
    up_rate = ((mean - down)[touched].double() / ulp)
    n = frac.numel() * len(runs)
    assert abs(float((up_rate - frac).mean())) < 6 * 0.5 / n**0.5
    assert bool((mean[touched] != w16.float()[touched]).any())


def test_module_rounds_stochastically_by_default_and_advances_its_seed(device):
    cards = [50, 7, 300]
    raw = make_case(3, 3, "modulus", seed=19).raw.to(device)
    lr = 2.0**-12
    out = {}
    for stochastic in (True, False):
        torch.manual_seed(0)
        emb = TritonSparseEmbedding(cards, 16, dtype=BF16, stochastic_rounding=stochastic).to(device)
        assert "sr_seed" not in emb.state_dict()  # non-persistent: the sparse optimizer's state carries it
        with torch.no_grad():  # |w| in [1, 2): a bf16 step is 2**-7, far above 4 steps of 2**-12
            emb.weight.copy_(1 + torch.rand(emb.weight.shape, generator=torch.Generator().manual_seed(5)))
        emb.use_fused_update(SparseOptimizerConfig("sgd", torch.tensor(lr, device=device)))
        w0 = emb.weight.detach().clone()
        for _ in range(4):
            emb(raw).float().sum().backward()
        out[stochastic] = (w0, emb.weight.detach().clone(), int(emb.sr_seed))
    w0, w_sr, seed_sr = out[True]
    w0n, w_n, seed_n = out[False]
    assert seed_sr == 4 and seed_n == 0
    assert torch.equal(w_n, w0n)  # every step below half a bf16 step: lost to nearest rounding
    assert not torch.equal(w_sr, w0)  # kept on average by stochastic rounding


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_gpu_bf16_one_hot_update(optimizer):
    device = torch.device("cuda")
    B, F, D = 4096, 26, 128
    case = make_case(B, F, "modulus", hot=True, seed=47).to(device)
    rows = hash_rows(case.raw, *case.hash_args())
    w16 = make_weight(case.num_rows, D, device).to(BF16)
    state = make_state(optimizer, w16.float())
    grad = make_grad(B, F, D, "contiguous", device)
    lr = torch.tensor(LR, device=device)
    w32, _ = fp32_update(optimizer, rows, grad, w16, state, lr)
    nearest = w16.clone()
    embedding_sparse_update_(rows, grad, nearest, None if state is None else state.clone(), lr, optimizer, EPS, True)
    assert torch.equal(nearest, w32.to(BF16))
    sr = w16.clone()
    seed = torch.zeros(1, dtype=torch.int64, device=device)
    embedding_sparse_update_(rows, grad, sr, None if state is None else state.clone(), lr, optimizer, EPS, True,
                             sr_seed=seed)
    down, up = neighbours(w32)
    assert bool(((sr.float() == down) | (sr.float() == up)).all()) and int(seed) == 1


def test_opcheck_stochastic_rounding_op(device):
    case = make_case(3, 2, "modulus", seed=23).to(device)
    rows = hash_rows(case.raw, *case.hash_args())
    weight = make_weight(case.num_rows, 16, device).to(BF16)
    grad = make_grad(3, 2, 16, "contiguous", device)
    torch.library.opcheck(torch.ops.dlrm_kernels.embedding_sparse_update_sr_.default,
                          (rows, grad, weight, torch.zeros(case.num_rows, device=device), torch.tensor(LR, device=device),
                           "rowwise_adagrad", EPS, True, 0.0, torch.zeros(1, dtype=torch.int64, device=device)))
