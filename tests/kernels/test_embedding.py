"""kernels/embedding/ (the one-hot lookup) against float64 PyTorch references (CPU: Triton interpreter; GPU:
marked gpu).

Covers both hashing modes against the training code's hashing, ``dlrm.model.hashing`` (missing/negative
values, values >= 2**31, values far outside the 32-bit range, out-of-vocabulary values, empty
vocabularies), the lookup forward and its dense backward, the autograd glue of the fused op (weight.grad
stays None), the module, opcheck of every op and one torch.compile(fullgraph=True) run.

The fused sparse update op for each optimizer is tested in test_embedding_update.py; it, test_embedding_bf16_*.py
and test_audit_embedding_update.py take their cases and references from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import pytest
import torch

from dlrm.model.hashing import keyed_vocabulary, modulus_rows, vocabulary_rows
from kernels.embedding import (
    SparseOptimizerConfig,
    TritonSparseEmbedding,
    embedding_lookup,
    embedding_sparse_update_,
    fused_embedding,
    hash_rows,
)
from tests.kernels.cuda_graphs import capture
from tests.kernels.embedding_inputs import make_grad, make_state, make_weight, strided_table


CARD_POOL = [3, 1000, 17, 1, 250, 4099]  # small R: the interpreter copies whole tensors per launch
OPTIMIZERS = ["sgd", "adagrad", "rowwise_adagrad"]
EPS = 1e-10
LR = 0.05


@dataclass
class Case:
    raw: torch.Tensor  # [B, F] int64, non-contiguous when requested
    cardinalities: torch.Tensor
    offsets: torch.Tensor
    vocab: Optional[torch.Tensor]
    vocab_offsets: Optional[torch.Tensor]
    vocabs: Optional[list[torch.Tensor]]

    @property
    def num_rows(self) -> int:
        return int(self.cardinalities.sum())

    def hash_args(self):
        return self.cardinalities, self.offsets, self.vocab, self.vocab_offsets

    def to(self, device) -> "Case":
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Case(mv(self.raw), mv(self.cardinalities), mv(self.offsets), mv(self.vocab), mv(self.vocab_offsets),
                    self.vocabs)


def make_case(B: int, F: int, mode: str, *, hot: bool = False, seed: int = 0, transposed: bool = True) -> Case:
    """Raw Criteo-like values: 32-bit hashes (half of them >= 2**31), missing (-1), other negatives
    (down to -2**40); `hot` makes most positions of every other feature hit one of three values."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 2**32, (F, B), generator=gen)  # built [F, B] and transposed: non-contiguous
    u = torch.rand(F, B, generator=gen)
    raw[u < 0.15] = -1
    raw[(u >= 0.15) & (u < 0.2)] = -torch.randint(2, 2**40, (F, B), generator=gen)[(u >= 0.15) & (u < 0.2)]
    if hot:
        for f in range(0, F, 2):
            hot_vals = torch.tensor([-1, 7, 2**32 - 5])
            pick = torch.randint(0, 3, (B,), generator=gen)
            keep = torch.rand(B, generator=gen) < 0.8
            raw[f] = torch.where(keep, hot_vals[pick], raw[f])
    if mode == "modulus":
        cards = [CARD_POOL[f % len(CARD_POOL)] for f in range(F)]
        vocab = vocab_offsets = vocabs = None
    else:
        vocabs = []
        for f in range(F):
            col = raw[f][raw[f] >= 0]
            if f % 5 == 3:  # an empty vocabulary: every value is out of vocabulary
                v = torch.empty(0, dtype=torch.int64)
            else:
                take = col[torch.rand(col.numel(), generator=gen) < 0.6]
                extra = torch.randint(0, 2**32, (7,), generator=gen)
                v = torch.unique(torch.cat([take, extra, torch.tensor([7, 2**32 - 5])]))  # sorted, unique
            vocabs.append(v)
        cards = [v.numel() + 1 for v in vocabs]
        vocab = torch.cat(vocabs)
        vocab_offsets = torch.tensor([0] + [v.numel() for v in vocabs]).cumsum(0)
    card_t = torch.tensor(cards, dtype=torch.int64)
    offsets = card_t.cumsum(0) - card_t
    raw = raw.t() if transposed else raw.t().contiguous()
    return Case(raw, card_t, offsets, vocab, vocab_offsets, vocabs)


def training_rows(case: Case) -> torch.Tensor:
    """The rows the training code computes (``dlrm.model.hashing``, as ``SparseArch.rows``), on the CPU."""
    raw, cards, offs = case.raw.cpu(), case.cardinalities.cpu(), case.offsets.cpu()
    if case.vocabs is None:
        return modulus_rows(raw, cards, offs)
    keys, vocab_offsets = keyed_vocabulary(case.vocabs)
    return vocabulary_rows(raw, keys, vocab_offsets, offs)


def naive_rows(case: Case) -> torch.Tensor:
    """Independent numpy hashing (Python-style `%` is already non-negative)."""
    r = case.raw.cpu().numpy()
    cards, offs = case.cardinalities.cpu().numpy(), case.offsets.cpu().numpy()
    out = np.empty_like(r)
    for f in range(r.shape[1]):
        if case.vocabs is None:
            out[:, f] = offs[f] + (r[:, f] + 1) % cards[f]
        else:
            v = case.vocabs[f].numpy()
            if v.size == 0:
                out[:, f] = offs[f]
                continue
            i = np.searchsorted(v, r[:, f])
            hit = (i < v.size) & (v[np.minimum(i, v.size - 1)] == r[:, f])
            out[:, f] = offs[f] + np.where(hit, i + 1, 0)
    return torch.from_numpy(out)


def dense_grad64(rows: torch.Tensor, grad_out: torch.Tensor, num_rows: int) -> torch.Tensor:
    D = grad_out.shape[-1]
    g = torch.zeros(num_rows, D, dtype=torch.float64, device=rows.device)
    return g.index_add_(0, rows.reshape(-1), grad_out.double().reshape(-1, D))


def reference_update(optimizer: str, rows, grad_out, weight, state, lr: float, eps: float = EPS):
    """float64 dense-gradient reference of one step; returns (weight, state)."""
    W = weight.double().clone()
    g = dense_grad64(rows, grad_out, W.shape[0])
    touched = torch.zeros(W.shape[0], dtype=torch.bool, device=W.device)
    touched[rows.reshape(-1)] = True
    if optimizer == "sgd":
        return W - lr * g, None
    S = state.double().clone()
    gt = g[touched]
    if optimizer == "adagrad":
        S[touched] += gt * gt
        W[touched] -= lr * gt / (S[touched].sqrt() + eps)
    else:
        S[touched] += (gt * gt).mean(1)
        W[touched] -= lr * gt / (S[touched].sqrt()[:, None] + eps)
    return W, S


# ----------------------------------------------------------------------------------------------------
# Hashing
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["modulus", "vocabulary"])
@pytest.mark.parametrize("B,F", [(1, 1), (3, 26), (127, 1), (127, 26)])
def test_hash_rows(B, F, mode, device):
    """The kernel's rows are the training code's rows (and both are the by-definition numpy rows)."""
    case = make_case(B, F, mode, hot=True, seed=B * 31 + F).to(device)
    expected = training_rows(case)
    got = hash_rows(case.raw, *case.hash_args())
    assert got.dtype == torch.int64 and got.shape == (B, F)
    assert torch.equal(got.cpu(), expected)
    assert torch.equal(expected, naive_rows(case))


# Raw values the data never holds but int64 allows: far outside the 32-bit range, both extremes of
# int64 (raw + 1 wraps around), and 2**33 + 5 / 2 * 2**33 + 5, whose keys (value + feature * 2**33)
# land on another feature's keys for the value 5.
EXTREME_RAW = [-1, 0, 5, 2**32 - 1, 2**33 + 5, 2 * 2**33 + 5, -(2**33) + 5, 2**40, -(2**40), 2**63 - 1, -(2**63)]


def test_hash_rows_extreme_values_match_training_hashing(device):
    vocabs = [torch.tensor([0, 5, 2**31]), torch.tensor([5, 2**32 - 1]), torch.tensor([-5, 5]),
              torch.tensor([], dtype=torch.int64)]
    cards = torch.tensor([len(v) + 1 for v in vocabs])
    offs = cards.cumsum(0) - cards
    raw = torch.tensor(EXTREME_RAW)[:, None].repeat(1, len(vocabs))  # every value in every feature
    keys, voff = keyed_vocabulary(vocabs)
    expected = vocabulary_rows(raw, keys, voff, offs)
    got = hash_rows(raw.to(device), cards.to(device), offs.to(device), torch.cat(vocabs).to(device), voff.to(device))
    assert torch.equal(got.cpu(), expected)
    # by hand: only 0, 5 and 2**32 - 1 of EXTREME_RAW are in a vocabulary; everything else is out of it
    local = torch.zeros(len(EXTREME_RAW), len(vocabs), dtype=torch.int64)
    local[EXTREME_RAW.index(0), 0] = 1
    local[EXTREME_RAW.index(5)] = torch.tensor([2, 1, 2, 0])
    local[EXTREME_RAW.index(2**32 - 1), 1] = 2
    assert torch.equal(expected, offs + local)
    mod_cards = torch.tensor([7, 3, 1, 2**31 + 11])
    mod_offs = mod_cards.cumsum(0) - mod_cards
    got_mod = hash_rows(raw.to(device), mod_cards.to(device), mod_offs.to(device))
    assert torch.equal(got_mod.cpu(), modulus_rows(raw, mod_cards, mod_offs))


def test_hash_rows_edge_values(device):
    """By hand; vocabulary values beyond the 32-bit range too (the kernel's search is exact for any int64)."""
    raw = torch.tensor([[-1, -1], [0, 2**32 - 1], [2**31, 2**31 + 1], [-(2**40), 2**40], [6, 5]], device=device)
    cards = torch.tensor([7, 3], device=device)
    offs = torch.tensor([0, 7], device=device)
    expected = torch.tensor([[0, 7], [1, 7 + (2**32) % 3], [(2**31 + 1) % 7, 7 + (2**31 + 2) % 3],
                             [(-(2**40) + 1) % 7, 7 + (2**40 + 1) % 3], [0, 7]])
    assert torch.equal(hash_rows(raw, cards, offs).cpu(), expected)
    assert torch.equal(modulus_rows(raw, cards, offs).cpu(), expected)
    # Vocabulary: feature 0 knows {2**31, 2**32 - 1}, feature 1 knows {-5, 5, 2**40}; -1 is out of vocabulary.
    vocab = torch.tensor([2**31, 2**32 - 1, -5, 5, 2**40], device=device)
    voff = torch.tensor([0, 2, 5], device=device)
    vcards = torch.tensor([3, 4], device=device)
    voffs = torch.tensor([0, 3], device=device)
    expected_v = torch.tensor([[0, 3], [0, 3], [1, 3], [0, 3 + 3], [0, 3 + 2]])
    assert torch.equal(hash_rows(raw, vcards, voffs, vocab, voff).cpu(), expected_v)


# ----------------------------------------------------------------------------------------------------
# Lookup forward + dense backward
# ----------------------------------------------------------------------------------------------------


LOOKUP_CASES = [
    # (B, F, D, mode, grad layout)
    (1, 1, 16, "modulus", "contiguous"),
    (3, 26, 24, "modulus", "permuted"),
    (127, 1, 24, "modulus", "expand"),
    (127, 26, 16, "modulus", "permuted"),
    (1, 26, 16, "vocabulary", "expand"),
    (3, 1, 16, "vocabulary", "contiguous"),
    (127, 26, 24, "vocabulary", "expand"),
]


@pytest.mark.parametrize("B,F,D,mode,layout", LOOKUP_CASES)
def test_lookup_forward_backward(B, F, D, mode, layout, device, assert_close):
    case = make_case(B, F, mode, hot=(B == 127), seed=B + F + D).to(device)
    weight = make_weight(case.num_rows, D, device, sliced=(F == 26)).requires_grad_()
    out = embedding_lookup(case.raw, weight, *case.hash_args())
    rows = training_rows(case).to(device)
    assert out.shape == (B, F, D) and out.dtype == weight.dtype
    assert torch.equal(out, weight.detach()[rows])  # a gather is exact
    grad = make_grad(B, F, D, layout, device)
    out.backward(grad)
    assert_close(weight.grad, dense_grad64(rows, grad, case.num_rows), torch.float32)


@pytest.mark.parametrize("launch", [(1, 1), (32, 2), (128, 8)])
def test_lookup_launches_give_the_same_gather(launch, device, monkeypatch):
    """Any (rows per program, warps) forced through LOOKUP_LAUNCH_OVERRIDE (the benchmark's sweep) gathers the same
    rows as the launch the heuristic picks: tails of partial programs included (B * F = 381 positions)."""
    import kernels.embedding.lookup as lookup_module

    case = make_case(127, 3, "modulus", hot=True, seed=5).to(device)
    weight = make_weight(case.num_rows, 24, device)
    want = embedding_lookup(case.raw, weight, *case.hash_args())
    monkeypatch.setattr(lookup_module, "LOOKUP_LAUNCH_OVERRIDE", launch)
    assert torch.equal(embedding_lookup(case.raw, weight, *case.hash_args()), want)
    assert torch.equal(want, weight[training_rows(case).to(device)])


@pytest.mark.parametrize("layout", ["transposed", "every_other_column"])
def test_lookup_reads_the_table_through_both_strides(layout, device, assert_close):
    """A table stored transposed (built [D, R]) and every other column of a wider one (column stride 2): the gather
    is exact and the dense gradient right; D = 24 is no power of two."""
    case = make_case(127, 3, "modulus", hot=True, seed=43).to(device)
    R, D = case.num_rows, 24
    weight = strided_table(R, D, layout, device, seed=44)
    out = embedding_lookup(case.raw, weight, *case.hash_args())
    rows = training_rows(case).to(device)
    assert torch.equal(out, weight.detach()[rows])
    grad = make_grad(127, 3, D, "permuted", device)
    out.backward(grad)
    assert_close(weight.grad, dense_grad64(rows, grad, R), torch.float32)


def test_lookup_of_zero_wide_rows_still_gives_the_rows(device):
    """D = 0: an empty output, but the op's rows are still the hashed rows (hashed without the gather)."""
    case = make_case(3, 4, "vocabulary", seed=47).to(device)
    weight = torch.empty(case.num_rows, 0, device=device)
    out, rows = torch.ops.dlrm_kernels.embedding_lookup(case.raw, weight, *case.hash_args())
    assert out.shape == (3, 4, 0) and torch.equal(rows.cpu(), training_rows(case))


def test_lookup_no_weight_grad_when_frozen(device):
    case = make_case(3, 4, "modulus").to(device)
    weight = make_weight(case.num_rows, 16, device)
    out = embedding_lookup(case.raw, weight, *case.hash_args())
    assert not out.requires_grad


# ----------------------------------------------------------------------------------------------------
# Autograd glue and module
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "optimizer,mode,trigger",
    [("sgd", "modulus", False), ("adagrad", "vocabulary", True), ("rowwise_adagrad", "modulus", False)],
)
def test_fused_embedding_backward_updates_in_place(optimizer, mode, trigger, device, assert_close):
    """Backward runs through weight.requires_grad, or through a grad_trigger with a frozen weight."""
    B, F, D = 3, 26, 16
    case = make_case(B, F, mode, hot=True, seed=17).to(device)
    weight = make_weight(case.num_rows, D, device).requires_grad_(not trigger)
    grad_trigger = torch.zeros(0, device=device, requires_grad=True) if trigger else None
    state = make_state(optimizer, weight.detach())
    w0, s0 = weight.detach().clone(), None if state is None else state.clone()
    lr = torch.tensor(LR, device=device)
    out = fused_embedding(case.raw, weight, *case.hash_args(), state, lr, optimizer, EPS, True, grad_trigger)
    assert out.requires_grad
    rows = training_rows(case).to(device)
    assert torch.equal(out, w0[rows])
    grad = make_grad(B, F, D, "permuted", device)
    out.backward(grad)
    assert weight.grad is None
    assert grad_trigger is None or grad_trigger.grad is None
    w_ref, s_ref = reference_update(optimizer, rows, grad, w0, s0, LR)
    assert_close(weight, w_ref, torch.float32, msg="weight")
    if state is not None:
        assert_close(state, s_ref, torch.float32, msg="state")


@pytest.mark.parametrize("B", [1, 3, 127])
@pytest.mark.parametrize("D,out_dtype", [(16, None), (5, None), (32, None), (16, torch.bfloat16)])
def test_fused_atomic_sgd_hashes_again_in_backward(B, D, out_dtype, device, assert_close):
    """Plain SGD, non-deterministic, fp32 table, modulus hashing: the forward writes no rows (an empty [0]
    stands for them) and the backward's atomic update hashes the raw values itself. Raw values non-contiguous,
    negative and beyond 32 bits, repeated rows (hot features); D=5 pads, bf16 output gives bf16 gradients.
    float64 reference."""
    F = 7
    case = make_case(B, F, "modulus", hot=True, seed=23).to(device)
    assert (B == 1 or not case.raw.is_contiguous()) and case.hash_args()[2] is None
    weight = make_weight(case.num_rows, D, device)
    w0 = weight.clone()
    trigger = torch.zeros(0, device=device, requires_grad=True)
    lr = torch.tensor(LR, device=device)
    state = torch.empty(0, device=device)
    out, rows_out = torch.ops.dlrm_kernels.fused_embedding(case.raw, weight, *case.hash_args(), state, lr, "sgd", EPS,
                                                           False, trigger, 0.0, out_dtype, None)
    assert rows_out.shape == (0,)
    rows = training_rows(case).to(device)
    assert torch.equal(out, w0[rows] if out_dtype is None else w0[rows].to(out_dtype))
    grad = make_grad(B, F, D, "permuted", device, dtype=out.dtype)
    out.backward(grad)
    w_ref = w0.double().index_add(0, rows.reshape(-1), grad.reshape(-1, D).double(), alpha=-LR)
    assert_close(weight, w_ref, torch.float32)
    # the deterministic update sorts the rows: the forward writes them
    _, rows_det = torch.ops.dlrm_kernels.fused_embedding(case.raw, weight, *case.hash_args(), state, lr, "sgd", EPS,
                                                         True, trigger, 0.0, out_dtype, None)
    assert torch.equal(rows_det, rows)
    # rows wider than 32: the update's tiles would hash at a cost, so the forward writes the rows
    wide = make_weight(case.num_rows, 64, device)
    _, rows_wide = torch.ops.dlrm_kernels.fused_embedding(case.raw, wide, *case.hash_args(), state, lr, "sgd", EPS,
                                                          False, trigger, 0.0, None, None)
    assert torch.equal(rows_wide, rows)


def test_module_plain_and_fused(device, assert_close):
    cards = [5, 1, 300, 17]
    emb = TritonSparseEmbedding(cards, 16).to(device)
    assert set(emb.state_dict()) == {"weight"}
    assert emb.weight.shape == (sum(cards), 16)
    case = make_case(3, 4, "modulus", seed=19)
    raw = case.raw.to(device)
    rows = modulus_rows(raw, emb.cardinalities, emb.offsets)
    # Plain path: ordinary dense gradient.
    out = emb(raw)
    assert torch.equal(out, emb.weight.detach()[rows])
    grad = make_grad(3, 4, 16, "contiguous", device)
    out.backward(grad)
    assert_close(emb.weight.grad, dense_grad64(rows, grad, sum(cards)), torch.float32)
    emb.weight.grad = None
    # Fused path: rowwise Adagrad applied in backward, no gradient left behind.
    cfg = emb.use_fused_update(SparseOptimizerConfig("rowwise_adagrad", torch.tensor(LR, device=device)))
    assert cfg.state is not None and cfg.state.shape == (sum(cards),)
    assert not emb.weight.requires_grad  # see TritonSparseEmbedding: the dense optimizer skips it
    w0 = emb.weight.detach().clone()
    emb(raw).backward(grad)
    assert emb.weight.grad is None
    w_ref, s_ref = reference_update("rowwise_adagrad", rows, grad, w0, torch.zeros(sum(cards), device=device), LR)
    assert_close(emb.weight, w_ref, torch.float32)
    assert_close(cfg.state, s_ref, torch.float32)
    # Eval mode / no_grad use the plain lookup and leave the weight alone.
    emb.eval()
    w1 = emb.weight.detach().clone()
    with torch.no_grad():
        emb(raw)
    assert torch.equal(emb.weight, w1)
    emb.use_fused_update(None)
    assert emb.fused_update is None and emb.weight.requires_grad


def test_module_vocabulary_mode(device):
    vocabs = [torch.tensor([3, 9, 2**32 - 1]), torch.tensor([], dtype=torch.int64), torch.tensor([-4, 0])]
    emb = TritonSparseEmbedding([4, 1, 3], 8, vocab=vocabs).to(device)
    assert set(emb.state_dict()) == {"weight"}
    raw = torch.tensor([[9, 5, 0], [-1, -1, -4], [2**32 - 1, 0, 1]], device=device)
    expected_rows = torch.tensor([[2, 4, 7], [0, 4, 6], [3, 4, 5]], device=device)
    assert torch.equal(emb(raw), emb.weight.detach()[expected_rows])
    with pytest.raises(ValueError):
        TritonSparseEmbedding([4, 2, 3], 8, vocab=vocabs)
    with pytest.raises(ValueError, match="sorted"):
        TritonSparseEmbedding([3], 8, vocab=[torch.tensor([5, 1])])


# ----------------------------------------------------------------------------------------------------
# opcheck and torch.compile
# ----------------------------------------------------------------------------------------------------


def test_opcheck_all_ops(device):
    ops = torch.ops.dlrm_kernels
    case = make_case(3, 2, "vocabulary", seed=23).to(device)
    mod = make_case(3, 2, "modulus", seed=23).to(device)
    D = 16
    weight = make_weight(mod.num_rows, D, device)
    rows = hash_rows(mod.raw, *mod.hash_args())
    grad = make_grad(3, 2, D, "contiguous", device)
    lr = torch.tensor(LR, device=device)
    checks = {
        "hash_rows": (case.raw, *case.hash_args()),
        "embedding_lookup": (mod.raw, weight.clone().requires_grad_(), *mod.hash_args()),
        "embedding_dense_grad": (rows, grad, mod.num_rows),
        "embedding_sparse_update_": (rows, grad, weight.clone(), torch.zeros(mod.num_rows, device=device), lr,
                                     "rowwise_adagrad", EPS, True),
        "fused_embedding": (mod.raw, weight.clone().requires_grad_(), *mod.hash_args(),
                            torch.zeros(mod.num_rows, D, device=device), lr, "adagrad", EPS, True,
                            torch.zeros(0, device=device)),
        "embedding_sgd_atomic_hashed_": (mod.raw, *mod.hash_args()[:2], grad, weight.clone(), lr),
    }
    for name, args in checks.items():
        torch.library.opcheck(getattr(ops, name).default, args)


@pytest.mark.parametrize("kind,deterministic", [("adagrad", True), ("sgd", False)])
def test_compile_fused_training_step_fullgraph(kind, deterministic, device, assert_close):
    """forward (lookup) + backward (mutating sparse-update op) compiled with fullgraph=True: no graph
    breaks, same result as eager, and an in-place LR change takes effect without recompiling. Plain SGD,
    non-deterministic: the backward's atomic update hashes the raw values again (no rows saved)."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    B, F, D = 3, 4, 16
    emb = TritonSparseEmbedding([5, 1, 300, 17], D).to(device)
    cfg = emb.use_fused_update(SparseOptimizerConfig(kind, torch.tensor(LR, device=device),
                                                     deterministic=deterministic))
    if cfg.state is None:
        cfg.state = torch.zeros(0, device=device)  # sgd: nothing to compare
    case = make_case(B, F, "modulus", hot=True, seed=29)
    raw = case.raw.to(device)
    target = torch.randn(B, F, D, device=device)

    def step(raw):
        return ((emb(raw) - target) ** 2).sum()

    compiled = torch.compile(step, fullgraph=True)
    w0, s0 = emb.weight.detach().clone(), cfg.state.clone()
    compiled(raw).backward()
    w_compiled, s_compiled = emb.weight.detach().clone(), cfg.state.clone()
    assert emb.weight.grad is None
    assert not counters["graph_break"], dict(counters["graph_break"])
    with torch.no_grad():
        emb.weight.copy_(w0)
        cfg.state.copy_(s0)
    step(raw).backward()  # eager
    assert_close(w_compiled, emb.weight, torch.float32)
    assert_close(s_compiled, cfg.state, torch.float32)
    assert not torch.equal(w_compiled, w0)

    # LR schedule: change the device tensor in place, no recompilation.
    frames = counters["stats"]["unique_graphs"]
    cfg.lr.fill_(0.0)
    w1 = emb.weight.detach().clone()
    compiled(raw).backward()
    assert counters["stats"]["unique_graphs"] == frames
    assert torch.equal(emb.weight.detach(), w1)  # lr = 0: no change


# ----------------------------------------------------------------------------------------------------
# GPU (repeat the comparisons on CUDA, bf16 included)
# ----------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["modulus", "vocabulary"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_lookup(mode, dtype, assert_close):
    device = torch.device("cuda")
    B, F, D = 4096, 26, 128
    case = make_case(B, F, mode, hot=True, seed=31).to(device)
    assert torch.equal(hash_rows(case.raw, *case.hash_args()).cpu(), training_rows(case))
    weight = make_weight(case.num_rows, D, device, dtype).requires_grad_()
    out = embedding_lookup(case.raw, weight, *case.hash_args())
    rows = training_rows(case).to(device)
    assert torch.equal(out, weight.detach()[rows])
    grad = make_grad(B, F, D, "permuted", device, dtype)
    out.backward(grad)
    # A dense gradient row sums up to B values: scale atol with the hot rows' sums.
    assert_close(weight.grad, dense_grad64(rows, grad, case.num_rows), dtype, scale=10.0)


@pytest.mark.gpu
def test_gpu_no_host_sync_and_cuda_graph_capture():
    """The fused forward + sparse update neither synchronise with the host nor break CUDA graph capture."""
    device = torch.device("cuda")
    B, F, D = 1024, 26, 64
    case = make_case(B, F, "vocabulary", hot=True, seed=41).to(device)
    weight = make_weight(case.num_rows, D, device, torch.bfloat16)
    state = make_state("rowwise_adagrad", weight)
    lr = torch.tensor(LR, device=device)
    grad = make_grad(B, F, D, "contiguous", device, torch.bfloat16)
    trigger = torch.zeros(0, device=device, requires_grad=True)

    def step():
        out = fused_embedding(case.raw, weight, *case.hash_args(), state, lr, "rowwise_adagrad", EPS, True, trigger)
        out.backward(grad)

    step()  # compile the kernels outside of capture and sync checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    w_eager = weight.clone()
    with torch.no_grad():  # capture the update alone (autograd's engine is not captured here)
        rows = hash_rows(case.raw, *case.hash_args())
        w_before, s_before = weight.clone(), state.clone()
        graph = capture(lambda: embedding_sparse_update_(rows, grad, weight, state, lr, "rowwise_adagrad", EPS, True))
        weight.copy_(w_before)
        state.copy_(s_before)
        graph.replay()
        w_graph, s_graph = weight.clone(), state.clone()
        weight.copy_(w_before)
        state.copy_(s_before)
        embedding_sparse_update_(rows, grad, weight, state, lr, "rowwise_adagrad", EPS, True)
    assert torch.equal(w_graph, weight) and torch.equal(s_graph, state)
    assert not torch.equal(w_eager, weight)
