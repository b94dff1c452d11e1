"""The whole multi-hot DCNv2 model (`build_model` with multi-hot sizes and ``model.interaction`` "dcn") against a
float64 reference written out here, value by value, from the raw sparse input to the logit.

The existing references stop at a part: `tests/test_multihot_model.py` checks the pooled lookup alone,
`tests/test_dcn.py` and `tests/test_audit_dcnv2_reference.py` the cross network alone, and
`tests/test_audit_model.py` the whole one-hot dot and cat models with embeddings taken from the model's own lookup.
Here nothing comes from the model but its parameters: the hashing (``(value + 1) mod rows`` plus the table's offset),
the PAD slots left out of the sum, the dense vector first in x0, ``x_{l+1} = x0 * (W_l V_l x_l + b_l) + x_l``,
``model.top_mlp_input_multiple``'s zero columns, ReLU after every layer but the logit's.
"""

import numpy as np
import pytest
import torch

from dlrm.config import KernelsConfig, ModelConfig
from dlrm.data.schema import PAD_SPARSE
from dlrm.model.dlrm import build_model
from dlrm.model.pooled_sparse import PooledSparseArch

TORCH = KernelsConfig(embedding="torch", interaction="torch", mlp="torch", loss="torch")
CARDS = [4, 1, 6, 3]
HOTNESS = [3, 1, 2, 4]  # a one-row table, a one-hot feature between multi-hot ones


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).numpy()


def _raw(batch: int, rng: np.random.Generator) -> np.ndarray:
    """int64 [B, L]: values from a small pool (rows repeat within a bag and across samples), -1 (missing) now and
    then, PAD_SPARSE in the slots after a feature's filled ones; sample 0's feature 0 all PAD (a zero embedding)."""
    pool = np.array([-1, 0, 1, 2, 5, 2**32 - 1, 123456789])
    cols = []
    for h in HOTNESS:
        block = rng.choice(pool, size=(batch, h))
        if h > 1:
            filled = rng.integers(1, h + 1, batch)
            block[np.arange(h)[None, :] >= filled[:, None]] = PAD_SPARSE
        cols.append(block)
    raw = np.concatenate(cols, axis=1)
    raw[0, :HOTNESS[0]] = PAD_SPARSE
    return raw


def _reference_logits(model, dense: np.ndarray, raw: np.ndarray) -> np.ndarray:
    table = _np(model.sparse_arch.weight)
    bottom = [(_np(l.weight), _np(l.bias)) for l in model.dense_arch.model.layers]
    top = [(_np(l.weight), _np(l.bias)) for l in model.over_arch.model.layers]
    net = model.interaction_arch.inner.crossnet  # PaddedInteraction around the InteractionArch
    cross = [(_np(w), _np(v), _np(b)) for w, v, b in zip(net.W_kernels, net.V_kernels, net.bias)]
    offsets = np.concatenate([[0], np.cumsum(CARDS)[:-1]])
    starts = np.concatenate([[0], np.cumsum(HOTNESS)[:-1]])
    out = []
    for n in range(dense.shape[0]):
        x = np.concatenate([dense[n], np.zeros(bottom[0][0].shape[1] - dense.shape[1])])
        for w, b in bottom:
            x = np.maximum(w @ x + b, 0.0)
        pooled = []
        for f, (card, h) in enumerate(zip(CARDS, HOTNESS)):
            e = np.zeros(table.shape[1])
            for s in range(starts[f], starts[f] + h):
                v = int(raw[n, s])
                if v != PAD_SPARSE:
                    e = e + table[offsets[f] + (v + 1) % card]
            pooled.append(e)
        x0 = np.concatenate([x] + pooled)  # the dense vector first, as TorchRec's InteractionDCNArch
        xl = x0
        for w, v, b in cross:
            xl = x0 * (w @ (v @ xl) + b) + xl
        y = np.concatenate([xl, np.zeros(top[0][0].shape[1] - xl.shape[0])])  # top_mlp_input_multiple's zeros
        for i, (w, b) in enumerate(top):
            y = w @ y + b
            if i < len(top) - 1:
                y = np.maximum(y, 0.0)
        out.append(y[0])
    return np.array(out)


@pytest.mark.parametrize("batch", [1, 7])
def test_multi_hot_dcn_model_logits_match_a_float64_reference(batch):
    torch.manual_seed(batch)
    cfg = ModelConfig(embedding_dim=3, bottom_mlp=[5, 3], top_mlp=[4, 2, 1], interaction="dcn", cross_layers=2,
                      cross_rank=2, top_mlp_input_multiple=7, bottom_mlp_input_multiple=8)
    model = build_model(cfg, CARDS, kernels=TORCH, multi_hot_sizes=HOTNESS, log_kernels=False)
    assert isinstance(model.sparse_arch, PooledSparseArch)
    assert model.over_arch.model.layers[0].weight.shape[1] == 21  # (F + 1) D = 15, padded to a multiple of 7
    with torch.no_grad():  # non-zero cross biases (zero at init) and O(1) weights: some pre-activations negative
        for p in model.parameters():
            p.normal_(0.0, 0.3 if p.dim() == 1 else 0.6)
    rng = np.random.default_rng(batch)
    raw = _raw(batch, rng)
    dense = rng.normal(size=(batch, 13))
    ref = _reference_logits(model, dense, raw)

    logits = model(torch.from_numpy(dense).float(), torch.from_numpy(raw))
    assert logits.shape == (batch,) and logits.dtype == torch.float32
    np.testing.assert_allclose(_np(logits), ref, rtol=1e-4, atol=1e-5)

    model64 = model.double()
    np.testing.assert_allclose(_np(model64(torch.from_numpy(dense), torch.from_numpy(raw))), ref,
                               rtol=1e-12, atol=1e-12)
    d = _np(model64.dense_arch(torch.from_numpy(dense)))
    assert batch == 1 or ((d > 0).any() and (d == 0).any())  # the bottom ReLU both passes and cuts
