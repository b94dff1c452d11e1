"""The multi-hot (MLPerf DLRM-DCNv2) model path (issue #22): `PooledSparseArch`, its Triton twin
`TritonPooledEmbedding`, the models `build_model` makes of them, and the config keys.

* PooledSparseArch: forward and weight gradient element by element against a float64 reference
  written out here (hash each slot independently, drop PAD slots, sum per feature), on odd shapes,
  PAD and all-PAD features, repeated rows, modulus and vocabulary hashing, non-contiguous input;
  with every hotness 1 it is SparseArch exactly.
* TritonPooledEmbedding (interpreter, fp32) vs PooledSparseArch: same init, interchangeable
  state_dicts, same forward, and a few steps of the fused sparse update (through
  `dlrm.train.optim.build_optimizers`, as the builder sets it up) vs the eager sparse optimizers.
* build_model with multi-hot sizes: dot and dcn, torch and triton embedding, kernels.mlp "fused".
* configs/mlperf-dcnv2.json and the validation of model.multi_hot_sizes / embedding_dtype /
  kernels.mlp "fused".

End-to-end training runs are in tests/test_multihot_train.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from dlrm.config import (
    ConfigError,
    KernelsConfig,
    ModelConfig,
    OptimConfig,
    SparseOptimConfig,
    config_from_dict,
    load_config,
)
from dlrm.data.schema import MLPERF_CARDINALITIES, MLPERF_MULTI_HOT_SIZES, NUM_SPARSE, PAD_SPARSE
from dlrm.model.archs import SparseArch
from dlrm.model.dlrm import build_model
from dlrm.model.pooled_sparse import PooledSparseArch
from dlrm.train.fast_path import resolve_fast_path
from dlrm.train.optim import FusedSparseOptimizer, RowWiseAdagrad, build_optimizers
from tests.conftest import REPO

# fp32 results against float64 references: sums of a handful of terms of magnitude <= ~1
FP32 = dict(rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Inputs and the float64 reference


def make_raw(rng: np.random.Generator, batch: int, hotness: list[int], cards: list[int], *, pad: float = 0.3,
             vocabs=None) -> torch.Tensor:
    """int64 [B, L]: values that repeat within and across samples (small tables and a small pool
    of raw values), -1 (missing) now and then, PAD_SPARSE in a fraction `pad` of a multi-hot
    feature's slots (filled slots first, as the loaders pad), and feature 0 of sample 0 all PAD
    when it is multi-hot."""
    cols = []
    for f, h in enumerate(hotness):
        pool = np.array([-1, 0, 1, 5, 2**32 - 1, 123456789, 77])
        if vocabs is not None:  # in-vocabulary values mostly, plus the out-of-vocabulary pool
            pool = np.concatenate([vocabs[f].numpy(), vocabs[f].numpy(), pool[:3]])
        block = rng.choice(pool, size=(batch, h))
        if h > 1:
            filled = rng.integers(0, h + 1, batch) if pad else np.full(batch, h)
            filled = np.where(rng.random(batch) < pad, filled, h)
            block[np.arange(h)[None, :] >= filled[:, None]] = PAD_SPARSE
        cols.append(block)
    raw = np.concatenate(cols, axis=1).astype(np.int64)
    if hotness[0] > 1 and pad:
        raw[0, : hotness[0]] = PAD_SPARSE
    return torch.from_numpy(raw)


def reference_rows(raw: torch.Tensor, hotness: list[int], cards: list[int], vocabs=None) -> np.ndarray:
    """Global row of every slot, written out value by value (-1 for a PAD slot: no row)."""
    offsets = np.concatenate([[0], np.cumsum(cards)[:-1]])
    feature = [f for f, h in enumerate(hotness) for _ in range(h)]
    out = np.empty(raw.shape, dtype=np.int64)
    for b in range(raw.shape[0]):
        for s, f in enumerate(feature):
            v = int(raw[b, s])
            if v == PAD_SPARSE:
                out[b, s] = -1
            elif vocabs is None:
                out[b, s] = offsets[f] + (v + 1) % cards[f]
            else:
                vocab = [int(x) for x in vocabs[f]]
                out[b, s] = offsets[f] + (vocab.index(v) + 1 if v in vocab else 0)
    return out


def reference_pooled(weight: np.ndarray, rows: np.ndarray, hotness: list[int], grad_out=None):
    """(float64 [B, F, D] sums of each feature's non-PAD rows, float64 [R, D] weight gradient of
    sum(grad_out * out))."""
    B, F, D = rows.shape[0], len(hotness), weight.shape[1]
    out = np.zeros((B, F, D))
    grad = np.zeros_like(weight, dtype=np.float64)
    starts = np.concatenate([[0], np.cumsum(hotness)[:-1]])
    for b in range(B):
        for f in range(F):
            for s in range(starts[f], starts[f] + hotness[f]):
                r = rows[b, s]
                if r < 0:
                    continue
                out[b, f] += weight[r]
                if grad_out is not None:
                    grad[r] += grad_out[b, f]
    return out, grad


def sparse_vocabs(cards: list[int], seed: int = 0) -> list[torch.Tensor]:
    """A sorted, unique vocabulary of cards[f] - 1 values per feature (row 0 is out-of-vocabulary)."""
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(np.sort(rng.choice(np.arange(3, 2**32, 2**20), c - 1, replace=False)).astype(np.int64))
            for c in cards]


# ---------------------------------------------------------------------------------------------
# PooledSparseArch against the float64 reference


SHAPES = [
    # (batch, hotness, cardinalities, dim)
    (1, [1], [5], 3),                                # one feature, hotness 1, one sample
    (3, [3, 1, 2], [4, 7, 3], 4),                    # the issue's [3, 1, 2]; tiny tables: repeated rows
    (127, [3, 1, 2, 1, 4, 1, 2], [5, 1, 9, 2, 13, 3, 6], 5),  # a one-row table; odd everything
    (3, [2], [1], 2),                                # a single one-row table: every value the same row
]


@pytest.mark.parametrize("hashing", ["modulus", "vocabulary"])
@pytest.mark.parametrize("batch, hotness, cards, dim", SHAPES)
def test_pooled_sparse_arch_matches_float64_reference(batch, hotness, cards, dim, hashing):
    rng = np.random.default_rng(batch + len(hotness))
    vocabs = sparse_vocabs(cards, batch) if hashing == "vocabulary" else None
    torch.manual_seed(0)
    arch = PooledSparseArch(cards, hotness, dim, vocabs=vocabs)
    assert arch.hashing == hashing and arch.num_slots == sum(hotness)
    raw = make_raw(rng, batch, hotness, cards, vocabs=vocabs)
    rows = reference_rows(raw, hotness, cards, vocabs)
    g = torch.randn(batch, len(hotness), dim)
    ref_out, ref_grad = reference_pooled(arch.weight.detach().double().numpy(), rows, hotness, g.double().numpy())

    out = arch(raw)
    assert out.shape == (batch, len(hotness), dim) and out.dtype == torch.float32
    np.testing.assert_allclose(out.detach().double().numpy(), ref_out, **FP32)
    out.backward(g)
    assert arch.weight.grad.is_sparse
    # A row's gradient sums the grad_out of every slot that looked it up (a one-row table: all B samples'), so the
    # fp32 sum's rounding scales with the summed magnitudes, not with the result, which may nearly cancel
    _, scale = reference_pooled(arch.weight.detach().double().numpy(), rows, hotness, np.abs(g.double().numpy()))
    err = np.abs(arch.weight.grad.to_dense().double().numpy() - ref_grad)
    assert (err <= FP32["atol"] + FP32["rtol"] * scale).all(), float(np.max(err - FP32["rtol"] * scale))
    # rows() agrees with the reference on every non-PAD slot
    keep = rows >= 0
    np.testing.assert_array_equal(arch.rows(raw).numpy()[keep], rows[keep])

    # the same module in float64: the sums are exact up to float64 rounding
    arch64 = PooledSparseArch(cards, hotness, dim, vocabs=vocabs).double()
    with torch.no_grad():
        arch64.weight.copy_(arch.weight.double())
    out64 = arch64(raw)
    np.testing.assert_allclose(out64.detach().numpy(), ref_out, rtol=1e-13, atol=1e-15)
    out64.backward(g.double())
    np.testing.assert_allclose(arch64.weight.grad.to_dense().numpy(), ref_grad, rtol=1e-13, atol=1e-15)


def test_pooled_sparse_arch_pad_and_repeats_by_hand():
    """Feature 0 (hotness 3) of sample 0 all PAD -> zeros; a row repeated within a bag counts twice;
    the gradient of a row shared by two samples is the sum of both; PAD slots add nothing."""
    torch.manual_seed(1)
    arch = PooledSparseArch([4, 6], [3, 2], 3)
    w = arch.weight.detach()
    raw = torch.tensor([[PAD_SPARSE, PAD_SPARSE, PAD_SPARSE, 2, 2],   # feature 1: row 4 + 3 = 7 twice
                        [0, 0, PAD_SPARSE, 2, PAD_SPARSE],          # feature 0: row 1 twice; feature 1: row 7
                        [-1, 3, 7, -1, 5]])                          # rows 0, 0, 0 (7 + 1 = 8 = 0 mod 4); 4, 4 + 0
    out = arch(raw)
    torch.testing.assert_close(out[0, 0], torch.zeros(3), rtol=0, atol=0)
    torch.testing.assert_close(out[0, 1], 2 * w[7])
    torch.testing.assert_close(out[1, 0], 2 * w[1])
    torch.testing.assert_close(out[1, 1], w[7])
    torch.testing.assert_close(out[2, 0], 3 * w[0])
    torch.testing.assert_close(out[2, 1], w[4] + w[4])
    g = torch.arange(1.0, 19.0).view(3, 2, 3)
    out.backward(g)
    grad = arch.weight.grad.to_dense()
    expected = torch.zeros_like(grad)
    expected[7] = 2 * g[0, 1] + g[1, 1]
    expected[1] = 2 * g[1, 0]
    expected[0] = 3 * g[2, 0]
    expected[4] = 2 * g[2, 1]
    torch.testing.assert_close(grad, expected, rtol=0, atol=0)


def test_pooled_sparse_arch_noncontiguous_input():
    rng = np.random.default_rng(7)
    hotness, cards = [3, 1, 2, 2], [6, 5, 4, 9]
    raw = make_raw(rng, 9, hotness, cards)
    wide = torch.zeros(9, 2 * raw.shape[1], dtype=torch.int64)
    wide[:, ::2] = raw
    strided = wide[:, ::2]                       # column stride 2
    transposed = raw.t().contiguous().t()        # strides (1, B)
    assert not strided.is_contiguous() and not transposed.is_contiguous()
    torch.manual_seed(2)
    arch = PooledSparseArch(cards, hotness, 4)
    expected = arch(raw)
    for x in (strided, transposed):
        torch.testing.assert_close(arch(x), expected, rtol=0, atol=0)


@pytest.mark.parametrize("hashing", ["modulus", "vocabulary"])
def test_pooled_sparse_arch_with_hotness_one_is_sparse_arch(hashing):
    cards = [3, 17, 1, 250, 40, 6]
    vocabs = sparse_vocabs(cards, 3) if hashing == "vocabulary" else None
    torch.manual_seed(3)
    one_hot = SparseArch(cards, 8, vocabs)
    torch.manual_seed(3)
    pooled = PooledSparseArch(cards, [1] * len(cards), 8, vocabs=vocabs)
    assert torch.equal(one_hot.weight, pooled.weight)  # same seed, same tables
    raw = make_raw(np.random.default_rng(3), 31, [1] * len(cards), cards, vocabs=vocabs)
    a, b = one_hot(raw), pooled(raw)
    torch.testing.assert_close(b, a, rtol=0, atol=0)
    g = torch.randn_like(a)
    a.backward(g)
    b.backward(g)
    torch.testing.assert_close(pooled.weight.grad.to_dense(), one_hot.weight.grad.to_dense(), rtol=0, atol=0)


def test_pooled_sparse_arch_refuses_bad_hotness_and_width():
    with pytest.raises(ValueError, match="hotness"):
        PooledSparseArch([3, 4], [2], 4)
    with pytest.raises(ValueError, match="hotness"):
        PooledSparseArch([3, 4], [2, 0], 4)
    arch = PooledSparseArch([3, 4], [2, 3], 4)
    with pytest.raises(ValueError, match="5"):
        arch(torch.zeros(2, 4, dtype=torch.int64))
    assert list(arch.state_dict()) == ["weight"]


# ---------------------------------------------------------------------------------------------
# TritonPooledEmbedding (Triton interpreter on the CPU, fp32) against PooledSparseArch


HOTNESS, CARDS, DIM = [3, 1, 2, 1, 4], [7, 5, 11, 1, 9], 6
# Triton runs on CUDA where there is one (conftest sets the interpreter only without CUDA); the
# eager reference runs beside it on the same device, with IEEE fp32 matmuls (see `ieee`)
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def ieee():
    """fp32 matmuls in IEEE precision (an earlier test in this process may have allowed TF32), through
    the API the trainer uses (`dlrm.train.step.set_matmul_precision`): reading the legacy global after
    the new per-backend one was set raises, which made this fixture fail after tests/test_dcn.py."""
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):  # torch < 2.9
        before = matmul.allow_tf32
        matmul.allow_tf32 = False
        yield
        matmul.allow_tf32 = before
        return
    before = matmul.fp32_precision
    matmul.fp32_precision = "ieee"
    yield
    matmul.fp32_precision = before


def _pair(hashing: str = "modulus", seed: int = 0):
    from kernels.embedding import TritonPooledEmbedding

    vocabs = sparse_vocabs(CARDS, 5) if hashing == "vocabulary" else None
    torch.manual_seed(seed)  # both drawn on the CPU (same numbers), then moved
    eager = PooledSparseArch(CARDS, HOTNESS, DIM, vocabs=vocabs).to(DEV)
    torch.manual_seed(seed)
    triton = TritonPooledEmbedding(CARDS, HOTNESS, DIM, vocabs=vocabs).to(DEV)
    return eager, triton, vocabs


@pytest.mark.parametrize("hashing", ["modulus", "vocabulary"])
def test_triton_pooled_same_init_state_dict_and_forward(hashing, ieee):
    eager, triton, vocabs = _pair(hashing)
    assert torch.equal(eager.weight, triton.weight)
    assert list(eager.state_dict()) == list(triton.state_dict()) == ["weight"]
    assert triton.num_slots == eager.num_slots == sum(HOTNESS)
    raw = make_raw(np.random.default_rng(11), 37, HOTNESS, CARDS, vocabs=vocabs).to(DEV)
    torch.testing.assert_close(triton(raw), eager(raw), **FP32)
    # interchangeable state_dicts: load each other's trained-looking weights
    with torch.no_grad():
        eager.weight.normal_()
    triton.load_state_dict(eager.state_dict())
    torch.testing.assert_close(triton(raw), eager(raw), **FP32)
    with torch.no_grad():
        triton.weight.normal_()
    eager.load_state_dict(triton.state_dict())
    assert torch.equal(eager.weight, triton.weight)
    # the plain (unfused) lookup's dense gradient is the eager sparse one
    g = torch.randn(37, len(HOTNESS), DIM, device=DEV)
    eager(raw).backward(g)
    triton(raw).backward(g)
    torch.testing.assert_close(triton.weight.grad, eager.weight.grad.to_dense(), **FP32)


class _Holder(nn.Module):
    """What build_optimizers needs of a model: ``sparse_arch`` plus some dense parameter."""

    def __init__(self, sparse_arch: nn.Module) -> None:
        super().__init__()
        self.sparse_arch = sparse_arch
        self.dense = nn.Linear(1, 1)


def _train_embedding(arch: nn.Module, name: str, weight_decay: float, batches, grads) -> nn.Module:
    cfg = OptimConfig(sparse=SparseOptimConfig(name=name, lr=0.1, eps=1e-8, weight_decay=weight_decay))
    model = _Holder(arch)
    _, sparse = build_optimizers(model, cfg, deterministic=True)
    for raw, g in zip(batches, grads):
        if isinstance(sparse, FusedSparseOptimizer):
            sparse.load_lr()
        (arch(raw) * g).sum().backward()
        sparse.step()
        sparse.zero_grad(set_to_none=True)
    return sparse


@pytest.mark.parametrize("name, weight_decay, pad", [
    ("sgd", 0.0, 0.4), ("adagrad", 0.0, 0.4), ("rowwise_adagrad", 0.0, 0.4),
    ("sgd", 0.05, 0.0), ("rowwise_adagrad", 0.05, 0.0), ("adagrad", 0.05, 0.0),
    ("sgd", 0.05, 0.4), ("rowwise_adagrad", 0.05, 0.4), ("adagrad", 0.05, 0.4),
])
def test_fused_sparse_update_trains_like_the_eager_optimizers(name, weight_decay, pad, ieee):
    """Three steps; the fused update (inside TritonPooledEmbedding's backward) vs the eager sparse
    optimizers on PooledSparseArch's COO gradients, with and without PAD slots and weight decay:
    both leave PAD slots out of the update, so the lazy decay reaches only rows a sample used
    (PooledSparseArch used to put the row a PAD slot points at into its gradient, and decay it)."""
    eager, triton, _ = _pair(seed=4)
    rng = np.random.default_rng(12)
    batches = [make_raw(rng, b, HOTNESS, CARDS, pad=pad).to(DEV) for b in (17, 1, 40)]
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(raw.shape[0], len(HOTNESS), DIM, generator=gen).to(DEV) for raw in batches]
    eager_opt = _train_embedding(eager, name, weight_decay, batches, grads)
    fused_opt = _train_embedding(triton, name, weight_decay, batches, grads)
    assert isinstance(fused_opt, FusedSparseOptimizer) and not isinstance(eager_opt, FusedSparseOptimizer)
    assert isinstance(eager_opt, RowWiseAdagrad) == (name == "rowwise_adagrad")
    assert triton.weight.grad is None  # the update happened inside the backward
    assert not torch.equal(eager.weight, _pair(seed=4)[0].weight)  # something trained
    torch.testing.assert_close(triton.weight.detach(), eager.weight.detach(), rtol=1e-5, atol=1e-6)
    if name != "sgd":
        (es,), (fs,) = eager_opt.state.values(), fused_opt.state.values()
        torch.testing.assert_close(fs["sum"], es["sum"], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# build_model with multi-hot sizes


SIZES = [1] * NUM_SPARSE
SIZES[0], SIZES[2], SIZES[9], SIZES[20] = 3, 2, 4, 2  # L = 26 + 2 + 1 + 3 + 1 = 33
MODEL_CARDS = [(7 * f) % 23 + 1 for f in range(NUM_SPARSE)]  # 1..23 rows, one a one-row table


def _model_cfg(interaction: str, **kw) -> ModelConfig:
    extra = dict(cross_layers=2, cross_rank=3) if interaction == "dcn" else {}
    return ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 5, 1], interaction=interaction, **extra, **kw)


def _kernels(embedding: str = "torch", mlp: str = "torch") -> KernelsConfig:
    return KernelsConfig(embedding=embedding, interaction="torch", mlp=mlp, loss="torch")


def _model_inputs(batch: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    dense = torch.from_numpy(rng.standard_normal((batch, 13)).astype(np.float32))
    return dense.to(DEV), make_raw(rng, batch, SIZES, MODEL_CARDS).to(DEV)


@pytest.mark.parametrize("interaction", ["dot", "dcn"])
def test_multi_hot_models_torch_and_triton_agree(interaction, ieee):
    from kernels.embedding import TritonPooledEmbedding, TritonSparseEmbedding

    cfg = _model_cfg(interaction)
    torch.manual_seed(5)
    eager = build_model(cfg, MODEL_CARDS, None, _kernels("torch"), DEV, multi_hot_sizes=SIZES)
    torch.manual_seed(5)
    triton = build_model(cfg, MODEL_CARDS, None, _kernels("triton"), DEV, multi_hot_sizes=SIZES)
    assert type(eager.sparse_arch) is PooledSparseArch and eager.sparse_arch.num_slots == 33
    assert type(triton.sparse_arch) is TritonPooledEmbedding and triton.sparse_arch.num_slots == 33
    sa, sb = eager.state_dict(), triton.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    for batch in (1, 3, 127):
        dense, raw = _model_inputs(batch, batch)
        out = eager(dense, raw)
        assert out.shape == (batch,)
        torch.testing.assert_close(triton(dense, raw), out, rtol=1e-5, atol=1e-5)
    # a multi-hot model refuses one-hot input; all-ones sizes build the one-hot arches
    with pytest.raises(ValueError, match="33"):
        eager(dense, raw[:, :NUM_SPARSE])
    one = build_model(cfg, MODEL_CARDS, None, _kernels("torch"), DEV, multi_hot_sizes=[1] * NUM_SPARSE)
    assert type(one.sparse_arch) is SparseArch
    one = build_model(cfg, MODEL_CARDS, None, _kernels("triton"), DEV, multi_hot_sizes=[1] * NUM_SPARSE)
    assert type(one.sparse_arch) is TritonSparseEmbedding


@pytest.mark.parametrize("batch", [1, 3, 127])
def test_dcn_model_concatenating_in_the_lookup_trains_like_concatenating_after_it(batch, ieee):
    """A DCN model with the Triton pooled embedding builds the cross network's input in the lookup
    (`DLRM.concat_in_lookup`): against the same model concatenating after the lookup, the same logits, dense
    gradients and fused row-wise Adagrad update of the tables, bit for bit; a dot model does not take that path."""
    from kernels.embedding import SparseOptimizerConfig

    cfg = _model_cfg("dcn")
    results = []
    for concat_in_lookup in (True, False):
        torch.manual_seed(5)
        model = build_model(cfg, MODEL_CARDS, None, _kernels("triton"), DEV, multi_hot_sizes=SIZES)
        assert model.concat_in_lookup
        model.concat_in_lookup = concat_in_lookup
        lr = torch.tensor(0.05, device=DEV)
        fused = model.sparse_arch.use_fused_update(SparseOptimizerConfig("rowwise_adagrad", lr))
        dense, raw = _model_inputs(batch, batch + 1)
        out = model(dense, raw)
        out.float().pow(2).sum().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
                        model.sparse_arch.weight.detach().clone(), fused.state.clone()))
    (o1, g1, w1, s1), (o2, g2, w2, s2) = results
    assert torch.equal(o1, o2) and torch.equal(w1, w2) and torch.equal(s1, s2)
    assert sorted(g1) == sorted(g2) and g1 and all(torch.equal(g1[k], g2[k]) for k in g1), sorted(g1)
    assert not build_model(_model_cfg("dot"), MODEL_CARDS, None, _kernels("triton"), DEV,
                           multi_hot_sizes=SIZES).concat_in_lookup


@pytest.mark.parametrize("mlp", ["fused", "wgrad"])
@pytest.mark.parametrize("interaction", ["dot", "dcn"])
def test_fused_mlp_model_matches_torch_mlps(interaction, mlp, ieee, monkeypatch):
    """kernels.mlp "fused" (kernels.mlp.FusedMLP in DenseArch and OverArch) and "wgrad" (every layer a
    kernels.wgrad.LinearReLUWgrad): same parameters from the same seed, same logits and gradients as
    nn.Linear MLPs, on a multi-hot model."""
    from kernels.mlp import FusedMLP
    from kernels.wgrad import LinearReLUWgrad

    import kernels.wgrad

    # every layer through the kernel: not PyTorch's fallbacks for fp32 and for these narrow widths
    monkeypatch.setattr(kernels.wgrad, "FP32_KERNEL", True)
    monkeypatch.setattr(kernels.wgrad, "MIN_OUT_FEATURES", 1)
    cfg = _model_cfg(interaction)
    torch.manual_seed(6)
    plain = build_model(cfg, MODEL_CARDS, None, _kernels(), DEV, multi_hot_sizes=SIZES)
    torch.manual_seed(6)
    fused = build_model(cfg, MODEL_CARDS, None, _kernels(mlp=mlp), DEV, multi_hot_sizes=SIZES)
    if mlp == "fused":
        assert isinstance(fused.dense_arch.model, FusedMLP) and isinstance(fused.over_arch.model, FusedMLP)
    else:
        layers = [*fused.dense_arch.model.layers, *fused.over_arch.model.layers]
        assert all(type(layer) is LinearReLUWgrad for layer in layers)
        assert [layer.activation for layer in fused.over_arch.model.layers][-1] == "none"
        assert "LinearActWgrad" in type(fused.over_arch.model.layers[-1](torch.zeros(2, 5, device=DEV)).grad_fn).__name__
    sa, sb = plain.state_dict(), fused.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    dense, raw = _model_inputs(29, 1)
    a, b = plain(dense, raw), fused(dense, raw)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    g = torch.randn(29, device=DEV)
    a.backward(g)
    b.backward(g)
    grads_a = dict(plain.named_parameters())
    for name, p in fused.named_parameters():
        q = grads_a[name]
        ga = q.grad.to_dense() if q.grad.is_sparse else q.grad
        gb = p.grad.to_dense() if p.grad.is_sparse else p.grad
        torch.testing.assert_close(gb, ga, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


# ---------------------------------------------------------------------------------------------
# Config: configs/mlperf-dcnv2.json and the new keys' validation


MLPERF = REPO / "configs" / "mlperf-dcnv2.json"


def test_mlperf_dcnv2_config_states_the_mlperf_model():
    cfg = load_config(MLPERF)
    m = cfg.model
    assert len(m.cardinalities) == len(m.multi_hot_sizes) == 26
    assert sum(m.cardinalities) == 204_184_588 and m.cardinalities == MLPERF_CARDINALITIES
    assert sum(m.multi_hot_sizes) == 214 and m.multi_hot_sizes == MLPERF_MULTI_HOT_SIZES
    assert m.embedding_dim == 128 and m.bottom_mlp[-1] == 128
    assert (m.interaction, m.cross_layers, m.cross_rank) == ("dcn", 3, 512)
    assert m.top_mlp == [1024, 1024, 512, 256, 1] and m.embedding_dtype == "bf16"
    assert (cfg.optim.dense.name, cfg.optim.sparse.name) == ("adagrad", "rowwise_adagrad")


def test_mlperf_dcnv2_config_on_the_cpu_is_one_config_error():
    """auto -> torch embedding on the CPU, which cannot hold bf16 tables: one line naming the key."""
    cfg = load_config(MLPERF)
    with pytest.raises(ConfigError, match=r'^model\.embedding_dtype: "bf16" needs kernels\.embedding "triton"') as e:
        resolve_fast_path(cfg, torch.device("cpu"), multi_hot=True)
    assert "\n" not in str(e.value)
    resolved, _ = resolve_fast_path(load_config(MLPERF, {"model.embedding_dtype": "fp32"}), torch.device("cpu"),
                                    multi_hot=True)
    assert resolved.kernels.embedding == "torch"


@pytest.mark.parametrize("sizes, key", [
    ([3] * 25, r"model\.multi_hot_sizes"),
    ([3] * 27, r"model\.multi_hot_sizes"),
    ([0] + [1] * 25, r"model\.multi_hot_sizes\[0\]"),
    ([1] * 5 + [-2] + [1] * 20, r"model\.multi_hot_sizes\[5\]"),
    ([1] * 25 + [2.5], r"model\.multi_hot_sizes"),
    ([1] * 25 + ["3"], r"model\.multi_hot_sizes"),
    ("mlperf", r"model\.multi_hot_sizes"),
])
def test_bad_multi_hot_sizes_are_config_errors_naming_the_key(sizes, key):
    with pytest.raises(ConfigError, match=key) as e:
        config_from_dict({"model": {"multi_hot_sizes": sizes}}, "x.json")
    assert "\n" not in str(e.value)


def test_good_multi_hot_sizes_and_embedding_dtype():
    m = config_from_dict({"model": {"multi_hot_sizes": MLPERF_MULTI_HOT_SIZES, "embedding_dtype": "bf16"},
                          "kernels": {"embedding": "triton"}}).model
    assert m.multi_hot_sizes == MLPERF_MULTI_HOT_SIZES and m.embedding_dtype == "bf16"
    assert config_from_dict({}).model.multi_hot_sizes is None
    assert config_from_dict({}).model.embedding_dtype == "fp32"


def test_wgrad_mlp_takes_dropout():
    cfg = config_from_dict({"model": {"dropout": 0.1}, "kernels": {"mlp": "wgrad"}})
    assert cfg.kernels.mlp == "wgrad" and cfg.model.dropout == 0.1


@pytest.mark.parametrize("raw, key", [
    ({"model": {"embedding_dtype": "bf16"}, "kernels": {"embedding": "torch"}}, r"model\.embedding_dtype"),
    ({"model": {"embedding_dtype": "fp16"}}, r"model\.embedding_dtype"),
    ({"model": {"dropout": 0.1}, "kernels": {"mlp": "fused"}}, r"kernels\.mlp"),
    ({"model": {"activation": "gelu"}, "kernels": {"mlp": "fused"}}, r"kernels\.mlp"),
    ({"model": {"activation": "gelu"}, "kernels": {"mlp": "wgrad"}}, r"kernels\.mlp: \"wgrad\""),
])
def test_invalid_combinations_are_config_errors(raw, key):
    with pytest.raises(ConfigError, match=key) as e:
        config_from_dict(raw, "x.json")
    assert "\n" not in str(e.value)
