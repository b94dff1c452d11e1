"""kernels/embedding/pooled*.py (multi-hot sum-pooled lookup, fused update) against float64 references: the
cases and references every pooled test shares, hashing and layout, the lookup forward and its dense backward.

The fused update, bf16 tables and stochastic rounding are tested in test_pooled_embedding_update.py; the module,
opcheck, torch.compile and CUDA graphs in test_pooled_embedding_module.py. Both take their cases and references
from here, as test_segment_chunk.py and test_audit_pooled_edges.py do.

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
from kernels.embedding import PAD_SPARSE, pooled_embedding_lookup, pooled_hash_rows, pooled_layout
from tests.kernels.embedding_inputs import make_grad, make_weight, strided_table

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

    # One sample a program (1, 1, 1) has no partial sample block at any batch: 13 rows there, not 127, since the
    # interpreter runs a program a sample and feature (508 programs at 127 rows: 5-7 s of a CI core, 0.3-0.7 s for
    # each other launch); its slots still unrolled 1 a step, the all-PAD feature still empty
    batch = 13 if launch[0] == 1 else 127
    case = make_case(batch, [5, 1, 3, 2], "modulus", seed=7, all_pad_feature=True).to(device)
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
# GPU: MLPerf-like shape
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
