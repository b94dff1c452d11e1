"""Audit of the model's tests (mutation testing): what the existing tests let through.

* The whole DLRM's logits against a float64 numpy reference written out here (ReLU after every bottom
  layer, the lower-triangle dots, no activation after the last top layer): the per-arch tests compare
  padded and unpadded models built by the same code, so a wrong activation placement survived them.
* build_model keeps vocabulary hashing on each PyTorch embedding it can build (eager, compiled twin,
  multi-hot): dropping ``vocabs`` in the compiled or multi-hot branch silently fell back to modulus hashing.
* init_linear_'s two laws (weight N(0, sqrt(2/(in+out))), bias N(0, sqrt(1/out))), only pinned by a golden run.
"""

import numpy as np
import pytest
import torch

from dlrm.config import KernelsConfig, ModelConfig
from dlrm.data.schema import PAD_SPARSE
from dlrm.model.archs import MLP
from dlrm.model.dlrm import build_model

TORCH = KernelsConfig(embedding="torch", interaction="torch", mlp="torch", loss="torch")


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).numpy()


def _reference_logits(model, dense: np.ndarray, emb: np.ndarray, kind: str) -> np.ndarray:
    """float64 loops: bottom MLP (ReLU after every layer), interaction, top MLP (no ReLU after the last)."""
    bottom = [(_np(l.weight), _np(l.bias)) for l in model.dense_arch.model.layers]
    top = [(_np(l.weight), _np(l.bias)) for l in model.over_arch.model.layers]
    out = []
    for n in range(dense.shape[0]):
        x = dense[n]
        x = np.concatenate([x, np.zeros(bottom[0][0].shape[1] - x.shape[0])])
        for w, b in bottom:
            x = np.maximum(w @ x + b, 0.0)
        vecs = [x] + [emb[n, f] for f in range(emb.shape[1])]
        if kind == "dot":
            feats = list(x) + [float(vecs[i] @ vecs[j]) for i in range(len(vecs)) for j in range(i)]
        else:  # cat
            feats = [v for vec in vecs for v in vec]
        y = np.array(feats + [0.0] * (top[0][0].shape[1] - len(feats)))  # top_mlp_input_multiple's zeros
        for i, (w, b) in enumerate(top):
            y = w @ y + b
            if i < len(top) - 1:
                y = np.maximum(y, 0.0)
        out.append(y[0])
    return np.array(out)


@pytest.mark.parametrize("batch, cards, kind, multiple", [
    (1, [4], "dot", 1),          # one sample, one feature
    (127, [2, 3], "dot", 1),
    (3, [5, 1, 7], "dot", 8),    # padded top input
    (127, [3, 2], "cat", 1),
    (3, [6, 2, 9], "cat", 4),
])
def test_dlrm_logits_match_float64_reference(batch, cards, kind, multiple):
    torch.manual_seed(batch + len(cards))
    cfg = ModelConfig(embedding_dim=3, bottom_mlp=[5, 3], top_mlp=[4, 2, 1], interaction=kind,
                      top_mlp_input_multiple=multiple)
    model = build_model(cfg, cards, kernels=TORCH).double()
    with torch.no_grad():  # non-zero biases and O(1) weights: some pre-activations negative, so ReLU matters
        for p in model.parameters():
            p.normal_(0.0, 0.3 if p.dim() == 1 else 0.7)
    dense = torch.randn(batch, 13, dtype=torch.float64)
    raw = torch.randint(-1, 2**32, (batch, len(cards)))
    emb = model.sparse_arch(raw)
    ref = _reference_logits(model, dense.numpy(), _np(emb), kind)
    logits = model(dense, raw)
    assert logits.shape == (batch,)
    np.testing.assert_allclose(_np(logits), ref, rtol=1e-10, atol=1e-12)
    d = _np(model.dense_arch(dense))
    assert (d > 0).any() and (d == 0).any()  # the bottom ReLU both passes and cuts


# ---------------------------------------------------------------------------------------------
# vocabulary hashing reaches every PyTorch embedding build_model can build

CARDS = [4, 3, 6]
VOCABS = [torch.tensor([7, 100, 2**31]), torch.tensor([-1, 5]), torch.tensor([0, 1, 2, 3, 9])]


def _vocab_row(f: int, value: int) -> int:
    """Row of `value` in feature f's table under vocabulary hashing, written out (row 0: unknown)."""
    offset = sum(CARDS[:f])
    known = VOCABS[f].tolist()
    return offset + (known.index(value) + 1 if value in known else 0)


@pytest.mark.parametrize("path", ["eager", "compiled", "multi_hot"])
def test_build_model_keeps_vocabulary_hashing(path):
    torch.manual_seed(0)
    cfg = ModelConfig(embedding_dim=2, bottom_mlp=[4, 2], top_mlp=[3, 1])
    hot = [2, 1, 1] if path == "multi_hot" else None
    model = build_model(cfg, CARDS, vocabs=VOCABS, kernels=TORCH, compiled=path == "compiled", multi_hot_sizes=hot)
    arch = model.sparse_arch
    assert arch.hashing == "vocabulary"
    w = arch.weight.detach()
    if hot is None:
        raw = torch.tensor([[100, 5, 9], [8, -1, 0], [2**31, 6, 4]])
        expected = torch.stack([torch.stack([w[_vocab_row(f, int(raw[b, f]))] for f in range(3)])
                                for b in range(3)])
    else:
        raw = torch.tensor([[100, 7, 5, 9], [8, PAD_SPARSE, -1, 0], [2**31, 2**31, 6, 4]])
        expected = []
        for b in range(3):
            f0 = sum((w[_vocab_row(0, int(v))] for v in raw[b, :2] if int(v) != PAD_SPARSE), torch.zeros(2))
            expected.append(torch.stack([f0, w[_vocab_row(1, int(raw[b, 2]))], w[_vocab_row(2, int(raw[b, 3]))]]))
        expected = torch.stack(expected)
    torch.testing.assert_close(arch(raw).detach(), expected, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# init_linear_


def test_linear_init_laws():
    """Weight std sqrt(2 / (in + out)), bias std sqrt(1 / out), both zero-mean normal (not uniform)."""
    torch.manual_seed(0)
    mlp = MLP(60, [3000, 40], "relu")
    for layer in mlp.layers:
        out_f, in_f = layer.weight.shape
        w, b = layer.weight.detach().double(), layer.bias.detach().double()
        w_std, b_std = (2.0 / (in_f + out_f)) ** 0.5, (1.0 / out_f) ** 0.5
        assert abs(float(w.std()) / w_std - 1) < 0.03, (in_f, out_f)
        assert abs(float(w.mean())) < 0.03 * w_std
        # normal, not uniform: about 4.6% of the draws beyond 2 standard deviations (uniform: none)
        assert 0.035 < float((w.abs() > 2 * w_std).double().mean()) < 0.058
        if out_f == 3000:  # enough draws for the bias's law (sqrt(1 / in) would be 7x wider here)
            assert abs(float(b.std()) / b_std - 1) < 0.1
            assert abs(float(b.mean())) < 0.1 * b_std
