"""`TritonPooledEmbedding` (kernels/embedding/pooled*.py as a module) against float64 references and the
one-hot module: plain and fused training, the DCN input's prefix slot, vocabulary mode, hotness 1 bit for bit
equal to `TritonSparseEmbedding`, opcheck of every op and a fused step under torch.compile(fullgraph=True).

CPU: Triton interpreter, small shapes; GPU-marked tests add no host sync and CUDA graph replay of the update
(stochastic rounding's seed advancing), and a bf16 table initialised in place.

Cases and references (numpy rows, float64 forward, dense gradient and optimizer step) come from
test_pooled_embedding.py.
"""

from __future__ import annotations

import pytest
import torch

from kernels.embedding import (
    PAD_SPARSE,
    SparseOptimizerConfig,
    TritonPooledEmbedding,
    TritonSparseEmbedding,
    pooled_embedding_sparse_update_,
    pooled_hash_rows,
)
from tests.kernels.cuda_graphs import capture
from tests.kernels.embedding_inputs import make_grad, make_weight
from tests.kernels.test_pooled_embedding import (
    EPS,
    LR,
    MLPERF_HOTNESS,
    Case,
    dense_grad64,
    forward64,
    make_case,
    naive_rows,
    reference_update,
)


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
# GPU: CUDA graphs, init memory
# ----------------------------------------------------------------------------------------------------


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
