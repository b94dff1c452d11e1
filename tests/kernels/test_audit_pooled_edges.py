"""The multi-hot pooled embedding (`kernels.embedding.pooled`, `TritonPooledEmbedding`) where an audit found the
other tests blind:

* a layout whose ``slot_feature`` is not contiguous (a column of a [L, 2] tensor, say): the lookup takes it (it reads
  ``hotness`` and ``slot_offsets``, made contiguous), but the update and dense-gradient kernels read ``slot_feature``
  through its data pointer as if contiguous, so each slot took another feature's gradient (fixed: the launchers make
  it contiguous);
* the update's shipped multi-hot launches (16-position chunks, carry_block 16 / 32, 8 carry chunks a program, group
  sums) against the float64 reference: the interpreter otherwise replaces their 16-position chunks by 64, and the
  tests that force them compare two variants of the kernel bit for bit, not against a reference;
* two fused training steps in a row through the module (optimizer state carried from the first step into the
  second) with a sample whose every slot is PAD, a feature of hotness 1 beside one of hotness 100, one value in all
  100 slots of a sample, a one-row table hit twice in a sample and by two samples, and lazy weight decay.

Each against a float64 reference; CPU: Triton interpreter, GPU: the same tests on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from kernels import heuristics
from kernels.embedding import (
    PAD_SPARSE,
    PooledLayout,
    SparseOptimizerConfig,
    TritonPooledEmbedding,
    fused_pooled_embedding,
    pooled_embedding_lookup,
    pooled_embedding_sparse_update_,
    pooled_hash_rows,
    pooled_layout,
)
from tests.kernels.embedding_inputs import make_state, make_weight
from tests.kernels.test_pooled_embedding import EPS, LR, dense_grad64, forward64, reference_update


def _strided_layout(hotness: list[int], device) -> PooledLayout:
    """`pooled_layout(hotness)` with the same values of ``slot_feature`` held every other element (column 0 of an
    [L, 2] tensor whose column 1 holds other features' numbers): stride 2, not contiguous."""
    lay = pooled_layout(hotness, device)
    F, L = len(hotness), lay.num_slots
    pairs = torch.stack([lay.slot_feature, (lay.slot_feature + 1) % F], 1)  # column 1: a wrong feature each slot
    strided = pairs[:, 0]
    assert strided.stride() == (2,) and not strided.is_contiguous() and torch.equal(strided, lay.slot_feature)
    assert L == strided.shape[0]
    return PooledLayout(lay.hotness, lay.slot_offsets, strided)


@pytest.mark.parametrize("path", ["sorted", "atomic", "dense_grad", "fused"])
def test_non_contiguous_slot_feature(path, device, assert_close):
    """A layout with a stride-2 ``slot_feature`` (same values as `pooled_layout`'s): the sorted-segment update
    (Adagrad), the atomic SGD update, the plain lookup's dense gradient and the fused op's backward all give each
    slot its own feature's gradient, as the float64 reference says (before the fix: slot s took the gradient of
    feature ``slot_feature_storage[s]``, here the next feature's for every other slot)."""
    hotness, cards, D, B = [2, 1, 3], [5, 3, 11], 16, 7
    layout = _strided_layout(hotness, device)
    slot_feature = [f for f, h in enumerate(hotness) for _ in range(h)]
    gen = torch.Generator().manual_seed(11)
    raw = torch.randint(-1, 12, (B, sum(hotness)), generator=gen)
    raw[torch.rand(raw.shape, generator=gen) < 0.2] = PAD_SPARSE
    raw = raw.to(device)
    card_t = torch.tensor(cards, device=device)
    offs = card_t.cumsum(0) - card_t
    R = sum(cards)
    rows = pooled_hash_rows(raw, card_t, offs, pooled_layout(hotness, device), R)
    grad = torch.randn(B, len(hotness), D, generator=gen).to(device)
    lr = torch.tensor(LR, device=device)
    weight = make_weight(R, D, device)
    if path == "dense_grad":
        weight.requires_grad_()
        out = pooled_embedding_lookup(raw, weight, card_t, offs, layout)
        assert_close(out, forward64(rows, weight, slot_feature), torch.float32, msg="forward")
        out.backward(grad)
        assert_close(weight.grad, dense_grad64(rows, grad, slot_feature, R), torch.float32, msg="dense grad")
        return
    optimizer = "adagrad" if path in ("sorted", "fused") else "sgd"
    state = make_state(optimizer, weight)
    w_ref, s_ref = reference_update(optimizer, rows, grad, slot_feature, weight, state, LR)
    if path == "fused":
        trigger = torch.zeros(0, device=device, requires_grad=True)
        out = fused_pooled_embedding(raw, weight, card_t, offs, layout, None, None, state, lr, optimizer, EPS, True,
                                     trigger)
        assert_close(out, forward64(rows, make_weight(R, D, device), slot_feature), torch.float32, msg="forward")
        out.backward(grad)
    else:
        pooled_embedding_sparse_update_(rows, grad, layout, weight, state, lr, optimizer, EPS,
                                        deterministic=(path == "sorted"))
    assert_close(weight, w_ref, torch.float32, msg="weight")
    if state is not None:
        assert_close(state, s_ref, torch.float32, msg="state")

# Sorted runs of rows (run lengths; 1 = a distinct row): a hot row of 1,543 positions starting mid-chunk (97
# 16-position chunks: finished from the sums of six groups at carry_block 16, three at 32), then one of exactly 512
# positions (32 chunks), short repeats, and 37 PAD positions (row R) sorted after them.
RUNS = [1] * 5 + [16 * 32 * 3 + 7] + [16 * 32] + [2] * 6 + [1] * 3
PAD_POSITIONS = 37


@pytest.mark.parametrize("launch", ["multi_hot_wide_rows", "multi_hot_wide_rows_16bit"])
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_shipped_multi_hot_launches_match_the_reference(launch, optimizer, device, monkeypatch, assert_close):
    """The multi-hot launch configs as shipped (`heuristics.SPARSE_UPDATE_CONFIGS`, forced so that the interpreter
    keeps their 16-position chunks) on hot rows spanning tens of chunks and several groups of them (the carry
    kernel's group sums, `kernels.embedding.segment_carry`; 32 or 8 chunk boundaries a program): every row's summed
    gradient and one step, against the float64 reference (fp32 gradients, D = 64)."""
    cfg = heuristics.SPARSE_UPDATE_CONFIGS[launch]
    assert cfg.chunk == 16 and cfg.group_sums
    monkeypatch.setattr(heuristics, "SPARSE_UPDATE_OVERRIDE", cfg)
    gen = torch.Generator().manual_seed(7)
    values = torch.cat([torch.full((n,), 2 * i + 1) for i, n in enumerate(RUNS)])
    R = int(values.max()) + 1
    values = torch.cat([values, torch.full((PAD_POSITIONS,), R)])  # the PAD row R: never updated
    n = values.numel()
    assert n % 2 == 0 and RUNS[5] // 16 >= 3 * cfg.carry_block  # three groups of chunks and more
    rows = values[torch.randperm(n, generator=gen)].reshape(n // 2, 2).to(device)
    D = 64
    grad = torch.randn(n // 2, 2, D, generator=gen).to(device)
    weight = make_weight(R, D, device)
    state = make_state(optimizer, weight)
    w_ref, s_ref = reference_update(optimizer, rows, grad, [0, 1], weight, state, LR)
    pooled_embedding_sparse_update_(rows, grad, pooled_layout([1, 1], device), weight, state,
                                    torch.tensor(LR, device=device), optimizer, EPS, True)
    assert_close(weight, w_ref, torch.float32, scale=10.0, msg="weight")
    if state is not None:
        assert_close(state, s_ref, torch.float32, msg="state")
    hot = torch.tensor([11, 13], device=device)  # the two long runs' rows
    assert not torch.equal(weight[hot], make_weight(R, D, device)[hot])


CARDS = [5, 7, 1]  # feature 2: a table of one row (row 12)
HOTNESS = [1, 100, 2]


def _raw_steps() -> list[torch.Tensor]:
    """Two batches of 3 samples ([3, 103] each): feature 0 in column 0, feature 1 in columns 1..100, feature 2 in
    101..102."""
    P = PAD_SPARSE
    first = torch.full((3, 103), P)
    first[1, 0] = 3
    first[1, 1:101] = 3  # one value in all 100 slots of feature 1
    first[1, 101:] = torch.tensor([9, P])
    first[2, 0] = -1
    first[2, 1:101:3] = 3  # the same row again, from another sample
    first[2, 2:101:3] = -1
    first[2, 101:] = torch.tensor([-1, -1])  # the one-row table twice in a sample (and once in sample 1)
    second = torch.full((3, 103), P)
    second[0, 0] = 4
    second[0, 1:101] = torch.arange(100) % 7 - 1  # every row of feature 1, most of them many times
    second[0, 101:] = torch.tensor([P, 123])
    second[2, 1:101:2] = 3
    return [first, second]  # sample 0 all PAD in the first batch, sample 1 in the second


def _rows(raw: torch.Tensor) -> torch.Tensor:
    """By hand: feature f, value v -> offsets[f] + (v + 1) mod cards[f]; PAD -> R = 13."""
    offs, out = [0, 5, 12], torch.empty_like(raw)
    feature = [f for f, h in enumerate(HOTNESS) for _ in range(h)]
    for b in range(raw.shape[0]):
        for s in range(raw.shape[1]):
            v, f = int(raw[b, s]), feature[s]
            out[b, s] = sum(CARDS) if v == PAD_SPARSE else offs[f] + (v + 1) % CARDS[f]
    return out


@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad"])
def test_two_fused_steps_with_an_all_pad_sample_and_hotness_100(optimizer, device, assert_close):
    """Two training steps of the module with the fused update: each forward against the float64 sums of the weights
    the previous step left (an all-PAD sample sums to exact zeros), each step's weights and optimizer state against
    the float64 reference chained from the first step into the second, and the rows no batch touched unchanged."""
    torch.manual_seed(0)
    D, R = 24, sum(CARDS)
    emb = TritonPooledEmbedding(CARDS, HOTNESS, D).to(device)
    cfg = emb.use_fused_update(SparseOptimizerConfig(optimizer, torch.tensor([LR], device=device), eps=EPS,
                                                     weight_decay=0.05))
    slot_feature = [f for f, h in enumerate(HOTNESS) for _ in range(h)]
    w_ref, s_ref = emb.weight.detach().double().cpu(), cfg.state.double().cpu()  # the reference on the CPU
    w_start = emb.weight.detach().clone()
    touched = torch.zeros(R + 1, dtype=torch.bool)
    gen = torch.Generator().manual_seed(3)
    for step, raw in enumerate(_raw_steps()):
        rows = _rows(raw)
        touched[rows.reshape(-1)] = True
        assert torch.equal(emb.rows(raw.to(device)).cpu(), rows)
        out = emb(raw.to(device))
        assert_close(out, forward64(rows, w_ref, slot_feature), torch.float32, msg=f"forward {step}")
        empty = (raw == PAD_SPARSE).all(1)
        assert int(empty.sum()) == 1 and torch.equal(out[empty.to(device)], torch.zeros_like(out[:1]))
        grad = torch.randn(3, 3, D, generator=gen)
        out.backward(grad.to(device))
        w_ref, s_ref = reference_update(optimizer, rows, grad, slot_feature, w_ref, s_ref, LR, 0.05)
        assert_close(emb.weight, w_ref, torch.float32, msg=f"weight {step}")
        assert_close(cfg.state, s_ref, torch.float32, msg=f"state {step}")
    untouched = ~touched[:R]
    assert 0 < int(untouched.sum()) < R
    assert torch.equal(emb.weight.detach().cpu()[untouched], w_start.cpu()[untouched])
    assert bool((cfg.state.cpu()[untouched] == 0).all())
