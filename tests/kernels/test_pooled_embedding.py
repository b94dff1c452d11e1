"""kernels/embedding/pooled*.py (multi-hot sum-pooled lookup, fused update) against float64 references.

CPU: Triton interpreter, small shapes (bf16 runs there too, slowly, on tiny tables); GPU-marked tests
repeat the comparisons at B = 4096, D = 128 with MLPerf DLRMv2's 26 hotness values, in fp32 and bf16.

References: rows by numpy (independent hashing, PAD = no row), the forward as float64 gathers summed
per feature, the dense gradient as a float64 index_add of each slot's feature gradient, and each
optimizer's step written out in float64 over the touched rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import pytest
import torch

from dlrm.model.hashing import keyed_vocabulary, modulus_rows, vocabulary_rows
from kernels import heuristics
from kernels.embedding import update as update_module
from kernels.embedding import (
    PAD_SPARSE,
    SparseOptimizerConfig,
    TritonPooledEmbedding,
    TritonSparseEmbedding,
    pooled_embedding_lookup,
    pooled_embedding_sparse_update_,
    pooled_hash_rows,
    pooled_layout,
)
from tests.kernels.cuda_graphs import capture
from tests.kernels.embedding_inputs import make_grad, make_state, make_weight, strided_table

OPTIMIZERS = ["sgd", "adagrad", "rowwise_adagrad"]
EPS = 1e-10
LR = 0.05
CARD_POOL = [3, 1000, 17, 1, 250, 4099]
# MLPerf DLRMv2 (Criteo multi-hot): L = 214 slots per sample.
MLPERF_HOTNESS = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]


@dataclass
class Case:
    raw: torch.Tensor  # [B, L] int64, non-contiguous
    hotness: list[int]
    cardinalities: torch.Tensor
    offsets: torch.Tensor
    vocab: Optional[torch.Tensor]
    vocab_offsets: Optional[torch.Tensor]
    vocabs: Optional[list[torch.Tensor]]

    @property
    def num_rows(self) -> int:
        return int(self.cardinalities.sum())

    @property
    def slot_feature(self) -> list[int]:
        return [f for f, h in enumerate(self.hotness) for _ in range(h)]

    def layout(self):
        return pooled_layout(self.hotness, self.raw.device)

    def hash_args(self):
        return self.cardinalities, self.offsets, self.layout()

    def vocab_args(self):
        return self.vocab, self.vocab_offsets

    def to(self, device) -> "Case":
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Case(mv(self.raw), self.hotness, mv(self.cardinalities), mv(self.offsets), mv(self.vocab),
                    mv(self.vocab_offsets), self.vocabs)


def make_case(B: int, hotness: list[int], mode: str = "modulus", *, seed: int = 0, pad: float = 0.25,
              all_pad_feature: bool = False) -> Case:
    """Multi-hot raw values: 32-bit hashes, missing (-1), PAD slots (a ``pad`` share, placed anywhere in
    a feature's slots), values repeated inside a sample (slot copies) and across samples (three hot
    values in most slots of every other feature); built [L, B] and transposed (non-contiguous)."""
    gen = torch.Generator().manual_seed(seed)
    F, L = len(hotness), sum(hotness)
    slot_feature = torch.tensor([f for f, h in enumerate(hotness) for _ in range(h)])
    raw = torch.randint(0, 2**32, (L, B), generator=gen)
    u = torch.rand(L, B, generator=gen)
    raw[u < 0.1] = -1
    hot_feature = (slot_feature % 2 == 0)[:, None] & (torch.rand(L, B, generator=gen) < 0.6)
    hot_vals = torch.tensor([-1, 7, 2**32 - 5])[torch.randint(0, 3, (L, B), generator=gen)]
    raw = torch.where(hot_feature, hot_vals, raw)
    start = 0
    for h in hotness:  # repeat a slot's value in the next slot of the same feature (same row twice)
        if h > 1:
            dup = torch.rand(B, generator=gen) < 0.3
            raw[start + 1][dup] = raw[start][dup]
        start += h
    raw[torch.rand(L, B, generator=gen) < pad] = PAD_SPARSE
    if all_pad_feature:  # the last feature is empty in every sample
        raw[L - hotness[-1]:] = PAD_SPARSE
    if mode == "modulus":
        cards = [CARD_POOL[f % len(CARD_POOL)] for f in range(F)]
        vocab = vocab_offsets = vocabs = None
    else:
        vocabs = []
        for f in range(F):
            col = raw[slot_feature == f].reshape(-1)
            col = col[col >= 0]
            if f % 4 == 3:  # an empty vocabulary: every value is out of vocabulary
                v = torch.empty(0, dtype=torch.int64)
            else:
                take = col[torch.rand(col.numel(), generator=gen) < 0.6]
                extra = torch.randint(0, 2**32, (5,), generator=gen)
                v = torch.unique(torch.cat([take, extra, torch.tensor([7])]))
            vocabs.append(v)
        cards = [v.numel() + 1 for v in vocabs]
        vocab = torch.cat(vocabs)
        vocab_offsets = torch.tensor([0] + [v.numel() for v in vocabs]).cumsum(0)
    card_t = torch.tensor(cards, dtype=torch.int64)
    return Case(raw.t(), list(hotness), card_t, card_t.cumsum(0) - card_t, vocab, vocab_offsets, vocabs)


def naive_rows(case: Case) -> torch.Tensor:
    """numpy hashing slot by slot (Python `%` is non-negative); PAD slots -> R."""
    r = case.raw.cpu().numpy()
    cards, offs = case.cardinalities.cpu().numpy(), case.offsets.cpu().numpy()
    out = np.empty_like(r)
    for s, f in enumerate(case.slot_feature):
        if case.vocabs is None:
            out[:, s] = offs[f] + (r[:, s] + 1) % cards[f]
        else:
            v = case.vocabs[f].numpy()
            i = np.searchsorted(v, r[:, s])
            hit = (i < v.size) & (v[np.minimum(i, max(v.size - 1, 0))] == r[:, s]) if v.size else np.zeros(len(r), bool)
            out[:, s] = offs[f] + np.where(hit, i + 1, 0)
    out[r == PAD_SPARSE] = case.num_rows
    return torch.from_numpy(out)


def training_rows(case: Case) -> torch.Tensor:
    """The training code's hashing (``dlrm.model.hashing``) of every slot as a one-hot feature."""
    sf = torch.tensor(case.slot_feature)
    raw, cards, offs = case.raw.cpu().contiguous(), case.cardinalities.cpu()[sf], case.offsets.cpu()[sf]
    if case.vocabs is None:
        rows = modulus_rows(raw, cards, offs)
    else:
        keys, voff = keyed_vocabulary([case.vocabs[f] for f in case.slot_feature])
        rows = vocabulary_rows(raw, keys, voff, offs)
    return torch.where(raw == PAD_SPARSE, case.num_rows, rows)


def forward64(rows: torch.Tensor, weight: torch.Tensor, slot_feature: list[int]) -> torch.Tensor:
    """float64 sum pooling: PAD rows (R) gather a zero row."""
    B = rows.shape[0]
    W = torch.cat([weight.detach().double(), weight.new_zeros(1, weight.shape[1], dtype=torch.float64)])
    g = W[rows]  # [B, L, D]
    out = torch.zeros(B, max(slot_feature) + 1, weight.shape[1], dtype=torch.float64, device=weight.device)
    return out.index_add_(1, torch.tensor(slot_feature, device=weight.device), g)


def dense_grad64(rows: torch.Tensor, grad_out: torch.Tensor, slot_feature: list[int], num_rows: int):
    """float64 [R, D] gradient: slot s of sample b adds grad_out[b, slot_feature[s]] to its row."""
    D = grad_out.shape[-1]
    g_slots = grad_out.double()[:, torch.tensor(slot_feature, device=grad_out.device)]  # [B, L, D]
    G = torch.zeros(num_rows + 1, D, dtype=torch.float64, device=grad_out.device)
    G.index_add_(0, rows.reshape(-1), g_slots.reshape(-1, D))
    return G[:num_rows]


def accumulation_bound(rows, grad_out, slot_feature, num_rows, base=None, scale=1.0):
    """Per-element bound on fp32 rounding when a row sums its n slot gradients in an unknown order
    (GPU atomics, or any order): n * eps32 * (|base| + sum |terms|), `scale` times each term (an lr).
    A fixed atol cannot be right for both a row hit once and a row hit ten thousand times."""
    abs_sum = dense_grad64(rows, grad_out.abs(), slot_feature, num_rows) * scale
    if base is not None:
        abs_sum = abs_sum + base.double().abs()
    flat = rows.reshape(-1)
    hits = torch.bincount(flat[flat < num_rows], minlength=num_rows).double().clamp_min(1)
    return hits[:, None] * torch.finfo(torch.float32).eps * abs_sum


def assert_within(actual, expected, bound, msg=""):
    err = (actual.double() - expected.double()).abs()
    worst = (err - bound).argmax()
    assert bool((err <= bound + 1e-7).all()), (
        f"{msg}: |error| {err.flatten()[worst]:.3e} over the rounding bound {bound.flatten()[worst]:.3e}")


def reference_update(optimizer, rows, grad_out, slot_feature, weight, state, lr, weight_decay=0.0, eps=EPS):
    """One step in float64 on the touched rows (each: summed gradient + decay, then the rule)."""
    W = weight.double().clone()
    R = W.shape[0]
    G = dense_grad64(rows, grad_out, slot_feature, R)
    touched = torch.zeros(R + 1, dtype=torch.bool, device=W.device)
    touched[rows.reshape(-1)] = True
    touched = touched[:R]
    g = G[touched] + weight_decay * W[touched]
    if optimizer == "sgd":
        W[touched] -= lr * g
        return W, None
    S = state.double().clone()
    if optimizer == "adagrad":
        S[touched] += g * g
        W[touched] -= lr * g / (S[touched].sqrt() + eps)
    else:
        S[touched] += (g * g).mean(1)
        W[touched] -= lr * g / (S[touched].sqrt()[:, None] + eps)
    return W, S


# ----------------------------------------------------------------------------------------------------
# Hashing and layout
# ----------------------------------------------------------------------------------------------------


def test_pad_value_is_the_data_pipelines():
    from dlrm.data.schema import PAD_SPARSE as DATA_PAD  # kernels/ imports nothing from dlrm: one value, twice

    assert PAD_SPARSE == DATA_PAD == -2


def test_pooled_layout():
    lay = pooled_layout([3, 1, 2])
    assert lay.hotness.tolist() == [3, 1, 2] and lay.slot_offsets.tolist() == [0, 3, 4]
    assert lay.slot_feature.tolist() == [0, 0, 0, 1, 2, 2] and lay.num_slots == 6
    for bad in ([], [2, 0], [-1]):
        with pytest.raises(ValueError, match="hotness"):
            pooled_layout(bad)


@pytest.mark.parametrize("mode", ["modulus", "vocabulary"])
@pytest.mark.parametrize("B,hotness", [(1, [1]), (3, [3, 1, 2]), (127, [2, 5, 1, 1, 3, 2])])
def test_pooled_hash_rows(B, hotness, mode, device):
    case = make_case(B, hotness, mode, seed=B + len(hotness)).to(device)
    expected = naive_rows(case)
    assert torch.equal(expected, training_rows(case))
    got = pooled_hash_rows(case.raw, *case.hash_args(), case.num_rows, *case.vocab_args())
    assert got.dtype == torch.int64 and got.shape == case.raw.shape
    assert torch.equal(got.cpu(), expected)


def test_fused_op_saves_int32_rows_where_they_fit(device):
    """The fused op keeps its rows as int32 (the update sorts int32 keys anyway): the same rows as the int64
    hashing, PAD slots as R; int64 past int32's range; an int32 request for too large a table is refused."""
    from kernels.embedding.pooled import fused_rows_dtype, pooled_lookup_impl

    assert fused_rows_dtype(204_000_000) == torch.int32 and fused_rows_dtype(2**31 - 1) == torch.int64
    case = make_case(37, [3, 1, 2], "modulus", seed=3).to(device)
    weight = make_weight(case.num_rows, 16, device)
    layout = case.layout()
    args = (case.raw, weight, case.cardinalities, case.offsets, *layout, None, None)
    out64, rows64 = pooled_lookup_impl(*args)
    out32, rows32 = pooled_lookup_impl(*args, rows_dtype=torch.int32)
    assert rows32.dtype == torch.int32 and torch.equal(rows32.long(), rows64) and torch.equal(out32, out64)
    assert (rows64 == case.num_rows).any()  # PAD slots are there
    state = torch.zeros(0, device=device)
    trigger = torch.zeros(0, device=device, requires_grad=True)
    lr = torch.tensor(LR, device=device)
    fused = torch.ops.dlrm_kernels.fused_pooled_embedding(
        case.raw, weight, case.cardinalities, case.offsets, *layout, None, None, state, lr, "sgd", EPS, True, trigger,
        0.0, torch.empty(0, dtype=torch.int64, device=device), True, None)
    assert fused[1].dtype == torch.int32 and torch.equal(fused[1].long(), rows64)
    big = torch.empty((2**31 - 1, 0), device=device)  # no storage: only R counts
    with pytest.raises(ValueError, match="cannot hold the rows"):
        pooled_lookup_impl(case.raw, big, case.cardinalities, case.offsets, *layout, None, None, lookup=False,
                           rows_dtype=torch.int32)


# ----------------------------------------------------------------------------------------------------
# Lookup forward + dense backward
# ----------------------------------------------------------------------------------------------------


LOOKUP_CASES = [
    # (B, hotness, D, mode, grad layout)
    (1, [1], 16, "modulus", "contiguous"),
    (1, [3, 1, 2], 5, "vocabulary", "permuted"),
    (3, [3, 1, 2], 24, "modulus", "expand"),
    (3, [4], 16, "vocabulary", "contiguous"),
    (127, [2, 5, 1, 1, 3, 2], 24, "modulus", "permuted"),
    (127, [3, 1, 2], 16, "vocabulary", "expand"),
]


@pytest.mark.parametrize("B,hotness,D,mode,layout", LOOKUP_CASES)
def test_pooled_lookup_forward_backward(B, hotness, D, mode, layout, device, assert_close):
    case = make_case(B, hotness, mode, seed=3 * B + D, all_pad_feature=(B == 127 and mode == "modulus")).to(device)
    F = len(hotness)
    weight = make_weight(case.num_rows, D, device, sliced=(layout == "permuted")).requires_grad_()
    out = pooled_embedding_lookup(case.raw, weight, *case.hash_args(), *case.vocab_args())
    rows = naive_rows(case).to(device)
    assert out.shape == (B, F, D) and out.dtype == weight.dtype
    assert_close(out, forward64(rows, weight, case.slot_feature), torch.float32, msg="forward")
    if B == 127 and mode == "modulus":
        assert torch.equal(out[:, -1], torch.zeros_like(out[:, -1]))  # an all-PAD feature sums to zero
    grad = make_grad(B, F, D, layout, device)
    out.backward(grad)
    assert_close(weight.grad, dense_grad64(rows, grad, case.slot_feature, case.num_rows), torch.float32,
                 msg="dense grad")


@pytest.mark.parametrize("layout", ["transposed", "every_other_column"])
def test_pooled_lookup_reads_the_table_through_both_strides(layout, device, assert_close):
    """A table stored transposed (built [D, R]) and every other column of a wider one (column stride 2): the sums
    and the dense gradient against float64; D = 24 is no power of two."""
    case = make_case(37, [3, 1, 2], "modulus", seed=17).to(device)
    R, D = case.num_rows, 24
    weight = strided_table(R, D, layout, device, seed=18)
    out = pooled_embedding_lookup(case.raw, weight, *case.hash_args())
    rows = naive_rows(case).to(device)
    assert_close(out, forward64(rows, weight, case.slot_feature), torch.float32, msg="forward")
    grad = make_grad(37, 3, D, "permuted", device)
    out.backward(grad)
    assert_close(weight.grad, dense_grad64(rows, grad, case.slot_feature, R), torch.float32, msg="dense grad")


def test_pooled_lookup_of_zero_wide_rows_still_gives_the_rows(device):
    """D = 0: an empty output, but the op's rows (saved for the backward) are still the hashed rows, PAD slots R."""
    case = make_case(3, [3, 1, 2], "vocabulary", seed=19).to(device)
    weight = torch.empty(case.num_rows, 0, device=device)
    cards, offsets, layout = case.hash_args()
    out, rows = torch.ops.dlrm_kernels.pooled_embedding_lookup(case.raw, weight, cards, offsets, *layout,
                                                              *case.vocab_args())
    assert out.shape == (3, 3, 0) and torch.equal(rows.cpu(), naive_rows(case))


@pytest.mark.parametrize("launch", [(1, 1, 1), (64, 8, 1), (32, 4, 2), (16, 4, 4), (128, 4, 4)])
def test_pooled_lookup_launches_give_the_same_sums(launch, device, monkeypatch, assert_close):
    """A launch forced through POOLED_LOOKUP_OVERRIDE (benchmarks/pooled_embedding.py --lookup-launches), slots
    unrolled 1, 2 or 4 a loop step, sums each sample's slots in the same order: the same bits and rows as the
    picked launch. Hotness 5 and 3 leave partial unrolled steps, batch 127 partial sample blocks, one all-PAD
    feature an empty one."""
    import kernels.embedding.pooled as pooled_module

    case = make_case(127, [5, 1, 3, 2], "modulus", seed=7, all_pad_feature=True).to(device)
    weight = make_weight(case.num_rows, 24, device)
    cards, offsets, layout = case.hash_args()

    def run():
        return pooled_module.pooled_lookup_impl(case.raw, weight, cards, offsets, *layout, *case.vocab_args())

    want, want_rows = run()
    assert torch.equal(want_rows, pooled_hash_rows(case.raw, cards, offsets, layout, case.num_rows))
    assert_close(want, forward64(naive_rows(case).to(device), weight, case.slot_feature), torch.float32)
    monkeypatch.setattr(pooled_module, "POOLED_LOOKUP_OVERRIDE", launch)
    out, rows = run()
    assert torch.equal(out, want) and torch.equal(rows, want_rows)


def test_pooled_lookup_frozen_weight_and_empty_batch(device):
    case = make_case(3, [2, 1]).to(device)
    weight = make_weight(case.num_rows, 8, device)
    assert not pooled_embedding_lookup(case.raw, weight, *case.hash_args()).requires_grad
    empty = pooled_embedding_lookup(case.raw[:0], weight, *case.hash_args())
    assert empty.shape == (0, 2, 8)


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
    results = []
    for policy in ("none", eviction):
        monkeypatch.setattr(update_module, "EVICTION", policy)
        weight = make_weight(case.num_rows, D, device, dtype)
        state = make_state(optimizer, weight)
        seed = torch.full((1,), 3, dtype=torch.int64, device=device)
        pooled_embedding_sparse_update_(rows, grad, case.layout(), weight, state, lr, optimizer, EPS, True, 0.05, seed)
        results.append((weight, state))
    (w0, s0), (w1, s1) = results
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
    results = []
    for row_loads in ("after_sums", order):
        monkeypatch.setattr(update_module, "ROW_LOADS", row_loads)
        weight = make_weight(case.num_rows, D, device, dtype)
        state = make_state(optimizer, weight)
        seed = torch.full((1,), 7, dtype=torch.int64, device=device)
        pooled_embedding_sparse_update_(rows, grad, case.layout(), weight, state, lr, optimizer, EPS, True, 0.05, seed)
        results.append((weight, state))
    (w0, s0), (w1, s1) = results
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
# Module, hotness 1 == TritonSparseEmbedding, opcheck, torch.compile
# ----------------------------------------------------------------------------------------------------


def test_module_plain_and_fused(device, assert_close):
    cards, hotness, D = [5, 1, 300, 17], [3, 1, 2, 4], 16
    emb = TritonPooledEmbedding(cards, hotness, D).to(device)
    assert set(emb.state_dict()) == {"weight"} and emb.weight.shape == (sum(cards), D)
    assert repr(emb) == ("TritonPooledEmbedding(features=4, slots=10, hotness=[3, 1, 2, 4], rows=323, dim=16, "
                         "hashing=modulus)")
    assert emb.compilable and not emb.collective and emb.fused_optimizer
    case = make_case(3, hotness, seed=19)
    case = Case(case.raw, hotness, emb.cardinalities.cpu(), emb.offsets.cpu(), None, None, None)
    raw = case.raw.to(device)
    rows = naive_rows(case).to(device)
    assert torch.equal(emb.rows(raw), rows)
    out = emb(raw)
    assert_close(out, forward64(rows, emb.weight, case.slot_feature), torch.float32)
    grad = make_grad(3, 4, D, "contiguous", device)
    out.backward(grad)
    assert_close(emb.weight.grad, dense_grad64(rows, grad, case.slot_feature, sum(cards)), torch.float32)
    emb.weight.grad = None
    cfg = emb.use_fused_update(SparseOptimizerConfig("adagrad", torch.tensor(LR, device=device), weight_decay=0.05))
    assert cfg.state.shape == (sum(cards), D) and not emb.weight.requires_grad
    w0 = emb.weight.detach().clone()
    emb(raw).backward(grad)
    assert emb.weight.grad is None
    w_ref, s_ref = reference_update("adagrad", rows, grad, case.slot_feature, w0, torch.zeros_like(w0), LR, 0.05)
    assert_close(emb.weight, w_ref, torch.float32)
    assert_close(cfg.state, s_ref, torch.float32)
    emb.eval()
    w1 = emb.weight.detach().clone()
    with torch.no_grad():
        emb(raw)
    assert torch.equal(emb.weight, w1)
    emb.use_fused_update(None)
    assert emb.fused_update is None and emb.weight.requires_grad
    with pytest.raises(ValueError, match="hotness"):
        TritonPooledEmbedding(cards, [1, 1], D)


@pytest.mark.parametrize("B", [1, 3, 37])
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_prefix_slot_equals_concatenating_after_the_lookup(B, optimizer, device):
    """``forward(raw, prefix)`` in training with the fused update: ``[B, 1 + F, D]`` equal to
    ``cat([prefix, forward(raw)])`` bit for bit, the prefix's gradient equal to the gradient's slot 0, and the
    same table update (weights and state, bit for bit) as with the gradient of the pooled slots alone; a prefix of
    another dtype, and evaluation, concatenate afterwards."""
    cards, hotness, D = [5, 1, 300, 17], [3, 1, 2, 4], 16
    case = make_case(B, hotness, seed=B + 3)
    raw = case.raw.to(device)
    grad = make_grad(B, 5, D, "contiguous", device, seed=B)
    results = []
    for fused_prefix in (True, False):
        torch.manual_seed(0)
        emb = TritonPooledEmbedding(cards, hotness, D).to(device)
        cfg = emb.use_fused_update(SparseOptimizerConfig(optimizer, torch.tensor(LR, device=device)))
        prefix = torch.randn(B, D, device=device, generator=torch.Generator(device=device).manual_seed(1))
        prefix.requires_grad_()
        if fused_prefix:
            out = emb(raw, prefix=prefix)
        else:
            out = torch.cat([prefix.unsqueeze(1), emb(raw)], dim=1)
        assert out.shape == (B, 5, D)
        pooled = out.detach()[:, 1:].clone()
        out.backward(grad)
        results.append((out.detach(), pooled, prefix.grad, emb.weight.detach().clone(), cfg.state))
    (o1, p1, g1, w1, s1), (o2, p2, g2, w2, s2) = results
    assert torch.equal(o1, o2) and torch.equal(p1, p2) and torch.equal(g1, g2) and torch.equal(g1, grad[:, 0])
    assert torch.equal(w1, w2) and (s1 is None or torch.equal(s1, s2))
    emb.eval()
    with torch.no_grad():  # evaluation, and a prefix of another dtype: concatenated after the lookup
        assert torch.equal(emb(raw, prefix=prefix.detach()), torch.cat([prefix.detach().unsqueeze(1), emb(raw)], 1))
    emb.train()
    assert emb(raw, prefix=prefix.detach().double()).dtype == torch.float64


def test_module_vocabulary_mode(device):
    vocabs = [torch.tensor([3, 9, 2**32 - 1]), torch.tensor([], dtype=torch.int64), torch.tensor([-4, 0])]
    emb = TritonPooledEmbedding([4, 1, 3], [2, 1, 2], 8, vocab=vocabs).to(device)
    raw = torch.tensor([[9, 3, 5, 0, PAD_SPARSE], [-1, PAD_SPARSE, -1, -4, -4]], device=device)
    expected_rows = torch.tensor([[2, 1, 4, 7, 8], [0, 8, 4, 6, 6]], device=device)
    assert torch.equal(emb.rows(raw), expected_rows)
    W = torch.cat([emb.weight.detach(), torch.zeros(1, 8, device=device)])
    expected = torch.stack([W[expected_rows[:, :2]].sum(1), W[expected_rows[:, 2]], W[expected_rows[:, 3:]].sum(1)], 1)
    torch.testing.assert_close(emb(raw), expected)


@pytest.mark.parametrize("optimizer,mode", [("sgd", "modulus"), ("rowwise_adagrad", "vocabulary")])
def test_hotness_one_equals_sparse_embedding(optimizer, mode, device):
    """All hotness 1, no PAD: same init, forward, dense gradient and fused update, bit for bit."""
    B, F, D = 127, 5, 16
    case = make_case(B, [1] * F, mode, seed=47, pad=0.0)
    torch.manual_seed(0)
    one = TritonSparseEmbedding(case.cardinalities.tolist(), D, case.vocabs).to(device)
    torch.manual_seed(0)
    multi = TritonPooledEmbedding(case.cardinalities.tolist(), [1] * F, D, case.vocabs).to(device)
    assert torch.equal(one.weight, multi.weight)
    raw = case.raw.to(device)
    assert torch.equal(one.rows(raw), multi.rows(raw))
    grad = make_grad(B, F, D, "permuted", device)
    out1, outm = one(raw), multi(raw)
    assert torch.equal(out1, outm)
    out1.backward(grad)
    outm.backward(grad)
    assert torch.equal(one.weight.grad, multi.weight.grad)
    for emb in (one, multi):
        emb.weight.grad = None
        emb.use_fused_update(SparseOptimizerConfig(optimizer, torch.tensor(LR, device=device), weight_decay=0.01))
        emb(raw).backward(grad)
    assert torch.equal(one.weight, multi.weight)
    if optimizer != "sgd":
        assert torch.equal(one.fused_update.state, multi.fused_update.state)


def test_opcheck_all_ops(device):
    ops = torch.ops.dlrm_kernels
    case = make_case(3, [2, 1], "vocabulary", seed=23).to(device)
    mod = make_case(3, [2, 1], "modulus", seed=23).to(device)
    D = 16
    lay = mod.layout()
    weight = make_weight(mod.num_rows, D, device)
    rows = pooled_hash_rows(mod.raw, *mod.hash_args(), mod.num_rows)
    grad = make_grad(3, 2, D, "contiguous", device)
    lr = torch.tensor(LR, device=device)
    seed = torch.zeros(1, dtype=torch.int64, device=device)
    checks = {
        "pooled_hash_rows": (case.raw, case.cardinalities, case.offsets, *case.layout(), *case.vocab_args(),
                             case.num_rows),
        "pooled_embedding_lookup": (mod.raw, weight.clone().requires_grad_(), mod.cardinalities, mod.offsets, *lay,
                                    None, None),
        "pooled_embedding_dense_grad": (rows, grad, lay.slot_feature, mod.num_rows),
        "pooled_embedding_sparse_update_": (rows, grad, lay.slot_feature, weight.clone(),
                                            torch.zeros(mod.num_rows, device=device), lr, "rowwise_adagrad", EPS,
                                            True, 0.0, seed, True),
        "fused_pooled_embedding": (mod.raw, weight.clone().requires_grad_(), mod.cardinalities, mod.offsets, *lay,
                                   None, None, torch.zeros(mod.num_rows, D, device=device), lr, "adagrad", EPS, True,
                                   torch.zeros(0, device=device), 0.0, seed, True, None),
    }
    for name, args in checks.items():
        torch.library.opcheck(getattr(ops, name).default, args)
    # the fused lookup writing the DCN input's prefix slot too (its gradient flows back)
    prefix = torch.randn(3, D, device=device, requires_grad=True)
    torch.library.opcheck(ops.fused_pooled_embedding.default, checks["fused_pooled_embedding"][:-1] + (prefix,))


def test_compile_fused_training_step_fullgraph(device, assert_close):
    """Pooled lookup + mutating update in the backward under torch.compile(fullgraph=True): no graph
    break, the eager numbers."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    B, hotness, D = 3, [3, 1, 2], 16
    emb = TritonPooledEmbedding([5, 1, 300], hotness, D).to(device)
    cfg = emb.use_fused_update(SparseOptimizerConfig("rowwise_adagrad", torch.tensor(LR, device=device)))
    raw = make_case(B, hotness, seed=29).raw.to(device)
    target = torch.randn(B, 3, D, device=device)

    def step(raw):
        return ((emb(raw) - target) ** 2).sum()

    w0, s0 = emb.weight.detach().clone(), cfg.state.clone()
    torch.compile(step, fullgraph=True)(raw).backward()
    w_compiled, s_compiled = emb.weight.detach().clone(), cfg.state.clone()
    assert not counters["graph_break"], dict(counters["graph_break"])
    with torch.no_grad():
        emb.weight.copy_(w0)
        cfg.state.copy_(s0)
    step(raw).backward()
    assert_close(w_compiled, emb.weight, torch.float32)
    assert_close(s_compiled, cfg.state, torch.float32)
    assert not torch.equal(w_compiled, w0)


# ----------------------------------------------------------------------------------------------------
# GPU: MLPerf-like shape, bf16, CUDA graphs, init memory
# ----------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["modulus", "vocabulary"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_lookup_mlperf_hotness(mode, dtype, assert_close):
    device = torch.device("cuda")
    B, D = 4096, 128
    case = make_case(B, MLPERF_HOTNESS, mode, seed=31).to(device)
    rows = pooled_hash_rows(case.raw, *case.hash_args(), case.num_rows, *case.vocab_args())
    assert torch.equal(rows.cpu(), naive_rows(case))
    weight = make_weight(case.num_rows, D, device, dtype).requires_grad_()
    out = pooled_embedding_lookup(case.raw, weight, *case.hash_args(), *case.vocab_args())
    # Sums of up to 100 rows: scale atol with the number of terms.
    assert_close(out, forward64(rows, weight, case.slot_feature), dtype, scale=10.0, msg="forward")
    grad = make_grad(B, len(MLPERF_HOTNESS), D, "permuted", device, dtype)
    out.backward(grad)
    expected = dense_grad64(rows, grad, case.slot_feature, case.num_rows)
    if dtype == torch.float32:  # rows hit thousands of times (vocabulary mode's OOV row): bound by the sum
        assert_within(weight.grad, expected, accumulation_bound(rows, grad, case.slot_feature, case.num_rows), "grad")
    else:
        assert_close(weight.grad, expected, dtype, scale=30.0)


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


@pytest.mark.gpu
def test_gpu_hotness_one_equals_sparse_embedding():
    test_hotness_one_equals_sparse_embedding("rowwise_adagrad", "vocabulary", torch.device("cuda"))


@pytest.mark.gpu
def test_gpu_no_host_sync_and_cuda_graph_replay_draws_new_bits():
    """bf16 module, fused rowwise Adagrad with SR: no host sync; a captured update replays with the
    device seed advancing, so two replays from the same weights give different roundings."""
    device = torch.device("cuda")
    B, D = 1024, 64
    case = make_case(B, MLPERF_HOTNESS, "vocabulary", seed=43)
    emb = TritonPooledEmbedding(case.cardinalities.tolist(), MLPERF_HOTNESS, D, case.vocabs, device=device,
                                dtype=torch.bfloat16)
    cfg = emb.use_fused_update(SparseOptimizerConfig("rowwise_adagrad", torch.tensor(LR, device=device)))
    raw = case.raw.to(device)
    grad = make_grad(B, len(MLPERF_HOTNESS), D, "contiguous", device, torch.bfloat16)
    emb(raw).backward(grad)  # compile the kernels outside of the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        emb(raw).backward(grad)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with torch.no_grad():
        rows = emb.rows(raw)
        args = (rows, grad, emb.layout, emb.weight, cfg.state, cfg.lr, "rowwise_adagrad", EPS, True, 0.0, emb.sr_seed)
        graph = capture(lambda: pooled_embedding_sparse_update_(*args))
        w0, s0, seed0 = emb.weight.clone(), cfg.state.clone(), emb.sr_seed.clone()
        graph.replay()
        w_a = emb.weight.clone()
        assert int(emb.sr_seed) == int(seed0) + 1
        emb.weight.copy_(w0)
        cfg.state.copy_(s0)
        graph.replay()
        assert not torch.equal(emb.weight, w_a)  # same inputs, new seed: other roundings
        emb.weight.copy_(w0)
        cfg.state.copy_(s0)
        emb.sr_seed.copy_(seed0)
        graph.replay()
        assert torch.equal(emb.weight, w_a)  # same seed: same bits


@pytest.mark.gpu
def test_gpu_bf16_init_needs_no_fp32_copy():
    """A bf16 table is initialised in place on the GPU: the peak memory stays at the table itself
    (no fp32 temporary, no host round trip), with every value inside its table's bound."""
    device = torch.device("cuda")
    cards = [3_000_000, 1_000_000, 7]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    emb = TritonPooledEmbedding(cards, [2, 1, 3], 128, device=device, dtype=torch.bfloat16)
    table_bytes = emb.weight.numel() * 2
    assert torch.cuda.max_memory_allocated() - base < table_bytes * 1.05
    from kernels.table_layout import init_bound

    start = 0
    for n in cards:
        assert float(emb.weight[start : start + n].float().abs().max()) <= init_bound(n) * (1 + 2**-8)
        start += n
