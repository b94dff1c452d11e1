"""The embedding modules (`kernels.embedding.TritonSparseEmbedding`, `TritonPooledEmbedding`, the eager twins in
`dlrm.model.fused_sparse` and `dlrm.model.pooled_sparse`) where a mutation audit found the other tests blind:
vocabularies with duplicates refused; a config's own state, eps and weight decay reaching the fused step (one-hot,
pooled and eager); eval() with grad enabled not updating; the deterministic flag choosing the sorted or the atomic
update; bf16 tables rounding stochastically (seed advanced) or to nearest as asked; vocabulary hashing kept on the
non-deterministic SGD path; SGD's decay on the atomic path; negative raw values other than -1 / PAD hashed as the
one-hot arch in the pooled archs; fp32 state and arithmetic for a bf16 eager table; a bf16 prefix setting the pooled
output's dtype; empty batches and zero-wide rows leaving the eager state alone.

Each against a float64 reference (or exact expectations); CPU: Triton interpreter, GPU: the same tests on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from dlrm.model.archs import SparseArch
from dlrm.model.fused_sparse import FusedUpdateSparseArch, sparse_update_
from dlrm.model.pooled_sparse import PooledSparseArch
from kernels.embedding import SparseOptimizerConfig, TritonPooledEmbedding, TritonSparseEmbedding
from kernels.embedding import atomic_update as atomic_module
from kernels.embedding import update as update_module

PAD = -2
CARDS = [5, 1, 7, 3]
# Triton kernels run on CUDA where it is present (TRITON_INTERPRET unset there), else in the CPU interpreter.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _rows64(raw: torch.Tensor, cards: list[int]) -> torch.Tensor:
    """Modulus hashing by hand: feature f's value v -> offsets[f] + (v + 1) mod cards[f]."""
    offs = torch.tensor([0] + cards[:-1]).cumsum(0)
    out = torch.empty_like(raw.cpu())
    for f, c in enumerate(cards):
        out[:, f] = offs[f] + torch.remainder(raw[:, f].cpu() + 1, c)
    return out


def _raw(B: int, F: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(-1, 50, (B, F), generator=gen)
    raw[:, 0] = torch.arange(B) % 3  # repeated rows
    return raw


def _reference(kind: str, rows: torch.Tensor, grad: torch.Tensor, w0: torch.Tensor, s0, lr: float, eps: float,
               wd: float = 0.0):
    """float64 reference of one sparse step on the coalesced gradient of the rows looked up."""
    W = w0.double().clone()
    D = W.shape[1]
    g = torch.zeros_like(W).index_add_(0, rows.reshape(-1).cpu(), grad.double().reshape(-1, D).cpu())
    touched = torch.unique(rows.reshape(-1).cpu())
    gt = g[touched] + wd * W[touched]
    if kind == "sgd":
        W[touched] -= lr * gt
        return W, None
    S = s0.double().clone()
    if kind == "adagrad":
        S[touched] += gt * gt
        W[touched] -= lr * gt / (S[touched].sqrt() + eps)
    else:
        S[touched] += (gt * gt).mean(1)
        W[touched] -= lr * gt / (S[touched].sqrt()[:, None] + eps)
    return W, S


def _close(actual, expected, atol=1e-5, rtol=1e-5):
    torch.testing.assert_close(actual.detach().double().cpu(), expected.detach().double().cpu(), atol=atol, rtol=rtol)


# ----------------------------------------------------------------------------------------------------
# TritonSparseEmbedding / TritonPooledEmbedding: the config reaching the kernels
# ----------------------------------------------------------------------------------------------------


def test_vocabulary_with_a_duplicate_is_refused():
    """A vocabulary must be sorted and unique: a duplicate wastes a row and the hashing maps the value to one of
    them only (the check is the module's, before anything reaches the device)."""
    good = [torch.tensor([3, 9]), torch.tensor([1])]
    TritonSparseEmbedding([3, 2], 4, vocab=good)
    with pytest.raises(ValueError, match="unique"):
        TritonSparseEmbedding([3, 2], 4, vocab=[torch.tensor([3, 3]), torch.tensor([1])])
    with pytest.raises(ValueError, match="unique"):
        TritonPooledEmbedding([3, 2], [2, 1], 4, vocab=[torch.tensor([3, 3]), torch.tensor([1])])


def _pooled_inputs(B: int, hotness: list[int], seed: int):
    """raw [B, L] with PAD slots and missing values, and the slot -> feature map."""
    gen = torch.Generator().manual_seed(seed)
    L = sum(hotness)
    raw = torch.randint(-1, 50, (B, L), generator=gen)
    raw[torch.rand(B, L, generator=gen) < 0.25] = PAD
    raw[:, 0] = torch.arange(B) % 2  # never PAD: repeated rows
    slot_feature = torch.repeat_interleave(torch.arange(len(hotness)), torch.tensor(hotness))
    return raw, slot_feature


def _pooled_positions(raw, slot_feature, cards, grad):
    """(rows [N], grads [N, D]) of the kept slots: the positions a pooled lookup's update sums."""
    offs = torch.tensor([0] + cards[:-1]).cumsum(0)
    card_t = torch.tensor(cards)
    raw = raw.cpu()
    rows = offs[slot_feature] + torch.remainder(raw + 1, card_t[slot_feature])
    keep = raw != PAD
    g = grad.detach().cpu()[:, slot_feature]  # [B, L, D]
    return rows[keep], g[keep]


def _make(module: str, kind: str, **cfg):
    """The module under test with the fused update on, and its config."""
    torch.manual_seed(0)
    if module == "pooled":
        emb = TritonPooledEmbedding(CARDS, [2, 1, 3, 1], 8).to(DEVICE)
    elif module == "triton":
        emb = TritonSparseEmbedding(CARDS, 8).to(DEVICE)
    else:
        emb = FusedUpdateSparseArch(CARDS, 8).to(DEVICE)
    config = SparseOptimizerConfig(kind, torch.tensor([0.125], device=DEVICE), **cfg)
    return emb, emb.use_fused_update(config)



def _batch(module: str, B: int, seed: int):
    """(raw, grad_out, rows [N], position grads [N, D]) for one step of `module`."""
    gen = torch.Generator().manual_seed(seed + 100)
    if module == "pooled":
        raw, slot_feature = _pooled_inputs(B, [2, 1, 3, 1], seed)
        grad = torch.randn(B, len(CARDS), 8, generator=gen)
        rows, g = _pooled_positions(raw, slot_feature, CARDS, grad)
    else:
        raw = _raw(B, len(CARDS), seed)
        grad = torch.randn(B, len(CARDS), 8, generator=gen)
        rows, g = _rows64(raw, CARDS).reshape(-1), grad.reshape(-1, 8)
    return raw.to(DEVICE), grad.to(DEVICE), rows, g


@pytest.mark.parametrize("module", ["triton", "pooled", "eager"])
@pytest.mark.parametrize("kind", ["adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("B", [1, 3, 127])
def test_fused_step_uses_the_given_state_eps_and_decay(module, kind, B):
    """A config with its own state (a restored checkpoint's accumulators), a large eps and weight decay: the module
    keeps that very state tensor (it is the optimizer's: a new zero tensor would silently drop the checkpoint) and
    one training step applies exactly that config. float64 reference."""
    torch.manual_seed(0)
    shape = (sum(CARDS), 8) if kind == "adagrad" else (sum(CARDS),)
    state = torch.rand(shape, generator=torch.Generator().manual_seed(5)).add_(0.5).to(DEVICE)
    s0 = state.clone()
    emb, cfg = _make(module, kind, eps=0.5, state=state, weight_decay=0.1, deterministic=True)
    assert cfg.state is state
    raw, grad, rows, g = _batch(module, B, seed=B)
    w0 = emb.weight.detach().clone()
    emb.train()
    emb(raw).backward(grad)
    assert emb.weight.grad is None
    w_ref, s_ref = _reference(kind, rows, g, w0.cpu(), s0.cpu(), 0.125, 0.5, 0.1)
    _close(emb.weight, w_ref)
    _close(state, s_ref)


@pytest.mark.parametrize("module", ["triton", "pooled", "eager"])
def test_evaluation_with_grad_enabled_does_not_update(module):
    """eval() alone (grad still enabled, as a validation loop without no_grad) is the plain lookup: its output
    needs no gradient and nothing can update the table through it."""
    emb, _ = _make(module, "sgd")
    raw, _, rows, _ = _batch(module, 3, seed=7)
    emb.eval()
    w0 = emb.weight.detach().clone()
    out = emb(raw)
    assert not out.requires_grad
    W = w0.double().cpu()
    if module == "pooled":
        raw_c = raw.cpu()
        _, slot_feature = _pooled_inputs(3, [2, 1, 3, 1], 7)
        offs = torch.tensor([0] + CARDS[:-1]).cumsum(0)
        slot_rows = offs[slot_feature] + torch.remainder(raw_c + 1, torch.tensor(CARDS)[slot_feature])
        expected = torch.zeros(3, len(CARDS), 8, dtype=torch.float64)
        for l in range(raw_c.shape[1]):
            keep = (raw_c[:, l] != PAD).double()[:, None]
            expected[:, slot_feature[l]] += W[slot_rows[:, l]] * keep
    else:
        expected = W[rows].reshape(3, len(CARDS), 8)
    _close(out, expected)
    assert torch.equal(emb.weight, w0)


@pytest.mark.parametrize("module", ["triton", "pooled"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_flag_picks_the_update_path(module, deterministic, monkeypatch):
    """Plain SGD on fp32 tables: ``deterministic=False`` takes the atomic-add update (fast, order-dependent
    rounding), ``True`` the sorted segment update (bitwise reproducible). Both give the float64 reference; the path
    taken is seen by wrapping the atomic launcher."""
    calls = []
    for mod in (atomic_module, update_module):
        original = mod._sgd_atomic_update
        monkeypatch.setattr(mod, "_sgd_atomic_update",
                            lambda *a, _o=original, **k: (calls.append(1), _o(*a, **k))[1])
    emb, _ = _make(module, "sgd", deterministic=deterministic)
    raw, grad, rows, g = _batch(module, 127, seed=3)
    w0 = emb.weight.detach().clone()
    emb(raw).backward(grad)
    assert bool(calls) == (not deterministic)
    w_ref, _ = _reference("sgd", rows, g, w0.cpu(), None, 0.125, 0.0)
    _close(emb.weight, w_ref)


@pytest.mark.parametrize("module", ["triton", "pooled"])
@pytest.mark.parametrize("stochastic", [True, False])
def test_bf16_table_rounds_as_the_module_was_asked(module, stochastic):
    """bf16 table, SGD by a step of 0.3 bf16 ulp below 1.0 on every weight: stochastic rounding (the default)
    moves about 30% of them one ulp down and advances the module's ``sr_seed`` by one; ``stochastic_rounding=False``
    rounds to nearest (the step is lost, every weight stays 1.0) and leaves the seed alone."""
    R, D, ulp = 64, 64, 2.0**-8
    kwargs = dict(device=DEVICE, dtype=torch.bfloat16, stochastic_rounding=stochastic)
    if module == "pooled":
        emb = TritonPooledEmbedding([R], [1], D, **kwargs)
    else:
        emb = TritonSparseEmbedding([R], D, **kwargs)
    with torch.no_grad():
        emb.weight.fill_(1.0)
    emb.use_fused_update(SparseOptimizerConfig("sgd", torch.tensor([1.0], device=DEVICE)))
    raw = (torch.arange(R, device=DEVICE) - 1)[:, None]  # every row once (value v -> row v + 1)
    out = emb(raw)
    grad = torch.full(out.shape, 0.3 * ulp, device=DEVICE, dtype=out.dtype)
    out.backward(grad)
    vals = emb.weight.detach().double().cpu()
    down = 1.0 - ulp  # the bf16 neighbour below 1.0 (bf16 spacing in [0.5, 1) is 2**-8)
    assert bool(((vals == 1.0) | (vals == down)).all())
    if stochastic:
        assert int(emb.sr_seed) == 1
        exact = 1.0 - float(grad.flatten()[0].double())
        p = (1.0 - exact) / (1.0 - down)  # probability of rounding down
        frac = float((vals == down).double().mean())
        sigma = (p * (1 - p) / vals.numel()) ** 0.5
        assert abs(frac - p) < 5 * sigma, (frac, p)
    else:
        assert int(emb.sr_seed) == 0
        assert bool((vals == 1.0).all())


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("B", [1, 3, 127])
def test_vocabulary_mode_sgd_updates_the_vocabulary_rows(deterministic, B):
    """Vocabulary hashing, plain SGD on an fp32 table of 8 columns: the non-deterministic update may not take the
    atomic path that hashes the raw values again in the backward (that kernel knows modulus hashing only: it would
    update the rows ``(v + 1) mod card`` instead of the vocabulary's). float64 reference."""
    vocabs = [torch.tensor([3, 9, 2**32 - 1]), torch.tensor([], dtype=torch.int64), torch.tensor([-4, 0, 7, 40])]
    cards = [4, 1, 5]
    torch.manual_seed(0)
    emb = TritonSparseEmbedding(cards, 8, vocab=vocabs).to(DEVICE)
    lr = torch.tensor([0.125], device=DEVICE)
    emb.use_fused_update(SparseOptimizerConfig("sgd", lr, deterministic=deterministic))
    gen = torch.Generator().manual_seed(B)
    pool = torch.tensor([-1, -4, 0, 3, 7, 9, 40, 2**32 - 1, 5, 123456])
    raw = pool[torch.randint(0, pool.numel(), (B, 3), generator=gen)]
    offs = torch.tensor([0] + cards[:-1]).cumsum(0)
    rows = torch.empty_like(raw)
    for f, v in enumerate(vocabs):  # in-vocabulary value i-th of the vocabulary -> row offs + 1 + i, else offs
        hit = torch.cat([torch.zeros(B, 1, dtype=torch.bool), raw[:, f, None] == v[None, :]], 1)
        rows[:, f] = offs[f] + hit.int().argmax(1)  # no hit: column 0
    grad = torch.randn(B, 3, 8, generator=gen)
    assert torch.equal(emb.rows(raw.to(DEVICE)).cpu(), rows)  # the module's own hashing, vocabulary mode
    w0 = emb.weight.detach().clone()
    out = emb(raw.to(DEVICE))
    _close(out, w0.double().cpu()[rows])
    out.backward(grad.to(DEVICE))
    w_ref, _ = _reference("sgd", rows, grad.reshape(-1, 8), w0.cpu(), None, 0.125, 0.0)
    _close(emb.weight, w_ref)


@pytest.mark.parametrize("module", ["triton", "pooled", "eager"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_sgd_with_weight_decay_decays_the_rows_looked_up(module, deterministic):
    """Plain SGD with lazy weight decay: every row looked up gets ``wd * w`` once added to its summed gradient, also
    on the non-deterministic path (the atomic-add update has no decay: decay needs the sorted update). float64
    reference."""
    emb, _ = _make(module, "sgd", weight_decay=0.25, deterministic=deterministic)
    raw, grad, rows, g = _batch(module, 127, seed=11)
    w0 = emb.weight.detach().clone()
    emb(raw).backward(grad)
    w_ref, _ = _reference("sgd", rows, g, w0.cpu(), None, 0.125, 0.0, 0.25)
    _close(emb.weight, w_ref)


def _pooled_ref_rows(raw: torch.Tensor, hotness: list[int], cards: list[int]) -> torch.Tensor:
    """Rows [B, L] by hand: slot of feature f, value v -> offsets[f] + (v + 1) mod cards[f] (PAD: -1's row)."""
    slot_feature = torch.repeat_interleave(torch.arange(len(hotness)), torch.tensor(hotness))
    offs = torch.tensor([0] + cards[:-1]).cumsum(0)[slot_feature]
    card = torch.tensor(cards)[slot_feature]
    v = torch.where(raw == PAD, torch.full_like(raw, -1), raw)
    return offs + torch.remainder(v + 1, card)


@pytest.mark.parametrize("B", [1, 3, 127])
def test_pooled_archs_hash_negative_values_as_the_one_hot_arch(B):
    """Negative raw values other than missing (-1) and PAD (-2), e.g. -5 or -2**33 (values the data path hands on
    as they are), hash as ``(v + 1) mod card`` in the eager pooled arch and in the Triton one, as in the one-hot
    ``SparseArch``; only PAD slots are left out of the sums. float64 reference of the forward."""
    hotness, cards, D = [2, 1, 3], [7, 5, 11], 4
    gen = torch.Generator().manual_seed(B)
    pool = torch.tensor([-5, -7, -3, -2**33, -1, PAD, 0, 4, 2**32 - 1, 10])
    raw = pool[torch.randint(0, pool.numel(), (B, 6), generator=gen)]
    raw[0, :3] = torch.tensor([-5, -3, -7])
    rows = _pooled_ref_rows(raw, hotness, cards)
    slot_feature = torch.repeat_interleave(torch.arange(3), torch.tensor(hotness))
    torch.manual_seed(0)
    eager = PooledSparseArch(cards, hotness, D).double()
    torch.manual_seed(0)
    triton = TritonPooledEmbedding(cards, hotness, D).to(DEVICE)
    W = eager.weight.detach()
    expected = torch.zeros(B, 3, D, dtype=torch.float64)
    for l in range(6):
        expected[:, slot_feature[l]] += W[rows[:, l]] * (raw[:, l] != PAD).double()[:, None]
    assert torch.equal(eager.rows(raw)[raw != PAD], rows[raw != PAD])
    torch.testing.assert_close(eager(raw), expected, rtol=0, atol=1e-12)
    _close(triton(raw.to(DEVICE)), expected)
    one_hot = SparseArch(cards, D).double()
    one_hot.weight.data.copy_(W)
    first = raw[:, [0, 2, 3]]
    ok = (first != PAD).all(1)
    torch.testing.assert_close(one_hot(first[ok]), W[rows[:, [0, 2, 3]][ok]], rtol=0, atol=0)


def test_eager_fused_arch_bf16_table_keeps_fp32_state_and_arithmetic():
    """A bf16 table in the eager fused-update arch: the Adagrad state is fp32 (the weight's dtype only when wider)
    and the step is computed in fp32, so the state carries fp32 values, not bf16-rounded ones. float64 reference
    (the state exactly to fp32 tolerance; the new bf16 weights within one bf16 rounding)."""
    torch.manual_seed(0)
    arch = FusedUpdateSparseArch(CARDS, 8).to(torch.bfloat16)
    cfg = arch.use_fused_update(SparseOptimizerConfig("adagrad", torch.tensor([0.125]), eps=1e-8))
    assert cfg.state.dtype == torch.float32 and cfg.state.shape == (sum(CARDS), 8)
    raw = _raw(127, len(CARDS), seed=4)
    rows = _rows64(raw, CARDS)
    grad = torch.randn(127, len(CARDS), 8, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    w0 = arch.weight.detach().clone()
    arch(raw).backward(grad)
    w_ref, s_ref = _reference("adagrad", rows, grad.reshape(-1, 8), w0, torch.zeros(sum(CARDS), 8), 0.125, 1e-8)
    _close(cfg.state, s_ref)
    _close(arch.weight, w_ref, atol=1e-6, rtol=2**-8)


@pytest.mark.parametrize("train", [True, False])
def test_pooled_prefix_of_a_narrower_dtype_sets_the_output_dtype(train):
    """``forward(raw, prefix)`` with a bf16 prefix (the bottom MLP's output under autocast) and an fp32 table: the
    output is the prefix's dtype, ``cat([prefix, pooled.to(bf16)])``, in training with the fused update and in
    evaluation (the lookup cannot write the prefix slot itself then: it concatenates after). float64 reference of
    the pooled sums, rounded to bf16 once."""
    emb, _ = _make("pooled", "sgd")
    emb.train(train)
    raw, _, _, _ = _batch("pooled", 3, seed=13)
    prefix = torch.randn(3, 8, generator=torch.Generator().manual_seed(2)).to(device=DEVICE, dtype=torch.bfloat16)
    W = emb.weight.detach().double().cpu()
    raw_c = raw.cpu()
    _, slot_feature = _pooled_inputs(3, [2, 1, 3, 1], 13)
    rows = _pooled_ref_rows(raw_c, [2, 1, 3, 1], CARDS)
    pooled = torch.zeros(3, len(CARDS), 8, dtype=torch.float64)
    for l in range(raw_c.shape[1]):
        pooled[:, slot_feature[l]] += W[rows[:, l]] * (raw_c[:, l] != PAD).double()[:, None]
    with torch.set_grad_enabled(train):  # training: the fused path's forward (prefix of another dtype)
        out = emb(raw, prefix=prefix)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 1 + len(CARDS), 8)
    assert torch.equal(out[:, 0], prefix)
    torch.testing.assert_close(out[:, 1:].double().cpu(), pooled.to(torch.bfloat16).double(), rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("B,D", [(0, 4), (3, 0)])
def test_eager_update_of_an_empty_batch_or_zero_wide_rows_changes_nothing(kind, B, D):
    """`sparse_update_` with no positions, or rows of zero columns: weight and state stay exactly as they were (a
    row-wise Adagrad mean over zero columns would be 0 / 0 = NaN in the state)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(5, D, generator=gen, dtype=torch.float64)
    state = None if kind == "sgd" else torch.rand((5, D) if kind == "adagrad" else (5,), generator=gen,
                                                  dtype=torch.float64)
    w0, s0 = weight.clone(), None if state is None else state.clone()
    rows = torch.randint(0, 5, (B, 2), generator=gen)
    sparse_update_(rows, torch.randn(B, 2, D, generator=gen, dtype=torch.float64), weight, state,
                   torch.tensor([0.1], dtype=torch.float64), kind, 1e-8, 0.1, True)
    assert torch.equal(weight, w0)
    assert state is None or torch.equal(state, s0)
