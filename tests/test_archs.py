"""Arch shapes and values against hand-computed float64 cases (odd shapes: B = 1, 3, 127; F = 1)."""

import numpy as np
import pytest
import torch

from dlrm.config import KernelsConfig, ModelConfig
from dlrm.model.archs import MLP, DenseArch, InteractionArch, OverArch, SparseArch
from dlrm.model.dlrm import build_model


@pytest.fixture(autouse=True)
def _float64():
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


def test_mlp_matches_hand_computation():
    mlp = MLP(3, [2, 1], "relu", activate_last=False)
    w0 = np.array([[1.0, -2.0, 0.5], [0.0, 1.0, 1.0]])
    b0 = np.array([0.1, -0.2])
    w1 = np.array([[2.0, -1.0]])
    b1 = np.array([0.3])
    with torch.no_grad():
        mlp.layers[0].weight.copy_(torch.tensor(w0)); mlp.layers[0].bias.copy_(torch.tensor(b0))
        mlp.layers[1].weight.copy_(torch.tensor(w1)); mlp.layers[1].bias.copy_(torch.tensor(b1))
    x = np.array([[1.0, 2.0, 3.0], [-1.0, 0.5, -4.0], [0.0, 0.0, 0.0]])
    hidden = np.maximum(x @ w0.T + b0, 0)
    expected = hidden @ w1.T + b1
    np.testing.assert_allclose(mlp(torch.tensor(x)).detach().numpy(), expected, rtol=0, atol=1e-12)
    assert list(mlp.state_dict()) == ["layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias"]


@pytest.mark.parametrize("act", ["relu", "sigmoid", "gelu", "squared_relu", "none"])
def test_mlp_activations(act):
    mlp = MLP(4, [5], act)
    x = torch.randn(3, 4)
    pre = x @ mlp.layers[0].weight.T + mlp.layers[0].bias
    ref = {"relu": torch.relu(pre), "sigmoid": torch.sigmoid(pre), "gelu": torch.nn.functional.gelu(pre),
           "squared_relu": torch.relu(pre) ** 2, "none": pre}[act]
    torch.testing.assert_close(mlp(x), ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("batch", [1, 3, 127])
def test_dense_arch_shape(batch):
    assert DenseArch(13, [7, 5])(torch.randn(batch, 13)).shape == (batch, 5)


def test_sparse_arch_lookup_and_sparse_gradient():
    arch = SparseArch([3, 2, 4], dim=2)
    with torch.no_grad():
        arch.weight.copy_(torch.arange(18, dtype=torch.float64).view(9, 2))
    raw = torch.tensor([[-1, 1, 2**32 - 1], [2, 0, 7], [2, 0, 7]])
    # rows: table0 (raw+1)%3 -> [0, 0, 0]; table1 offset 3: (raw+1)%2 -> [0, 1, 1]; table2 offset 5:
    # (2**32)%4 = 0, 8%4 = 0 -> [5, 5, 5]
    rows = torch.tensor([[0, 3 + 0, 5 + 0], [0, 3 + 1, 5 + 0], [0, 3 + 1, 5 + 0]])
    assert torch.equal(arch.rows(raw), rows)
    out = arch(raw)
    assert out.shape == (3, 3, 2)
    torch.testing.assert_close(out, arch.weight.detach()[rows])
    grad_out = torch.randn(3, 3, 2)
    out.backward(grad_out)
    assert arch.weight.grad.is_sparse
    dense_grad = torch.zeros(9, 2).index_add_(0, rows.flatten(), grad_out.reshape(-1, 2))
    torch.testing.assert_close(arch.weight.grad.to_dense(), dense_grad, rtol=0, atol=1e-12)
    assert list(arch.state_dict()) == ["weight"]


def test_sparse_arch_init_bounds_per_table():
    """Each table U(-1/sqrt(rows), 1/sqrt(rows)): within its bound, and filling it (not zeros, not a narrower law)."""
    torch.manual_seed(0)
    arch = SparseArch([4, 10000], dim=3)
    small, large = arch.weight[:4].detach(), arch.weight[4:].detach()
    assert small.abs().max() <= 0.5 and large.abs().max() <= 0.01
    assert small.abs().max() > 0.1  # 12 draws all inside +-0.1 of U(-0.5, 0.5): probability 0.2^12
    assert large.abs().max() > 0.0099 and abs(float(large.std()) - 0.01 / 3**0.5) < 0.05 * 0.01 / 3**0.5
    assert abs(float(large.mean())) < 2e-4  # 30,000 draws: a standard error of 3.3e-5


def brute_force_dot(dense, sparse):
    b, f, d = sparse.shape
    rows = []
    for n in range(b):
        vecs = [dense[n]] + [sparse[n, i] for i in range(f)]
        dots = [float(np.dot(vecs[i], vecs[j])) for i in range(f + 1) for j in range(i)]
        rows.append(np.concatenate([dense[n], dots]))
    return np.array(rows)


@pytest.mark.parametrize("batch,features,dim", [(1, 1, 1), (3, 1, 4), (3, 26, 16), (127, 5, 3)])
def test_dot_interaction_matches_brute_force(batch, features, dim):
    rng = np.random.default_rng(batch * 100 + features)
    dense = rng.normal(size=(batch, dim))
    sparse = rng.normal(size=(batch, features, dim))
    arch = InteractionArch(features, dim, "dot")
    out = arch(torch.tensor(dense), torch.tensor(sparse))
    assert out.shape == (batch, arch.output_dim) == (batch, dim + (features + 1) * features // 2)
    np.testing.assert_allclose(out.numpy(), brute_force_dot(dense, sparse), rtol=1e-12, atol=1e-12)


def test_dot_interaction_gradients_match_float64_autograd_of_brute_force():
    dense = torch.randn(3, 4, requires_grad=True)
    sparse = torch.randn(3, 2, 4, requires_grad=True)
    out = InteractionArch(2, 4, "dot")(dense, sparse)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    # By hand: vecs v0 = dense, v1, v2 = sparse; out = [v0, v1.v0, v2.v0, v2.v1]
    g = grad_out
    v0, v1, v2 = dense.detach(), sparse.detach()[:, 0], sparse.detach()[:, 1]
    gd = g[:, :4] + g[:, 4:5] * v1 + g[:, 5:6] * v2
    g1 = g[:, 4:5] * v0 + g[:, 6:7] * v2
    g2 = g[:, 5:6] * v0 + g[:, 6:7] * v1
    torch.testing.assert_close(dense.grad, gd, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sparse.grad, torch.stack([g1, g2], 1), rtol=1e-12, atol=1e-12)


def test_cat_interaction():
    dense, sparse = torch.randn(3, 2), torch.randn(3, 4, 2)
    arch = InteractionArch(4, 2, "cat")
    out = arch(dense, sparse)
    assert out.shape == (3, arch.output_dim) == (3, 10)
    torch.testing.assert_close(out, torch.cat([dense, sparse.flatten(1)], 1))


def test_over_arch_returns_one_logit_per_sample():
    over = OverArch(10, [4, 1])
    assert over(torch.randn(5, 10)).shape == (5,)
    assert over(torch.randn(1, 10)).shape == (1,)


@pytest.mark.parametrize("interaction", ["dot", "cat"])
def test_dlrm_forward_backward_reaches_every_parameter(interaction):
    cfg = ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[6, 1], interaction=interaction)
    model = build_model(cfg, [5] * 26, kernels=KernelsConfig())
    logits = model(torch.randn(3, 13), torch.randint(-1, 2**32, (3, 26)))
    assert logits.shape == (3,)
    logits.sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
    probs = model.predict(torch.randn(2, 13), torch.randint(-1, 100, (2, 26)))
    assert ((probs > 0) & (probs < 1)).all()
    keys = set(model.state_dict())
    assert "sparse_arch.weight" in keys and "dense_arch.model.layers.0.weight" in keys


@pytest.mark.parametrize("interaction", ["dot", "cat"])
def test_bottom_mlp_input_padding_computes_the_same_function(interaction):
    """model.bottom_mlp_input_multiple appends zero columns to the 13 dense features: same logits and
    gradients as the unpadded model with the shared weights, zero gradients for the padded columns."""
    from dlrm.config import ModelConfig
    from dlrm.model.dlrm import build_model

    base = dict(embedding_dim=3, bottom_mlp=[5, 3], top_mlp=[4, 1], interaction=interaction)
    plain = build_model(ModelConfig(**base), [3, 1, 7]).double()
    padded = build_model(ModelConfig(**base, bottom_mlp_input_multiple=8), [3, 1, 7]).double()
    assert padded.dense_arch.model.layers[0].weight.shape == (5, 16)
    with torch.no_grad():
        for (k, a), (_, b) in zip(plain.named_parameters(), padded.named_parameters()):
            if a.shape == b.shape:
                b.copy_(a)
            else:  # the first DenseArch layer: padded weight columns
                b[:, :13].copy_(a)
                b[:, 13:] = 0.5
    dense = torch.randn(13, 3, dtype=torch.float64).t()  # batch 3, non-contiguous
    raw = torch.tensor([[5, -1, 9], [0, 3, 2**32 - 1], [7, 7, 7]])
    out_plain, out_padded = plain(dense, raw), padded(dense, raw)
    torch.testing.assert_close(out_padded, out_plain, rtol=1e-12, atol=1e-12)
    out_plain.sum().backward()
    out_padded.sum().backward()
    for (k, a), (_, b) in zip(plain.named_parameters(), padded.named_parameters()):
        ga, gb = a.grad.to_dense(), b.grad.to_dense()
        if a.shape == b.shape:
            torch.testing.assert_close(gb, ga, rtol=1e-12, atol=1e-12, msg=k)
        else:
            torch.testing.assert_close(gb[:, :13], ga, rtol=1e-12, atol=1e-12, msg=k)
            assert torch.equal(gb[:, 13:], torch.zeros_like(gb[:, 13:]))
    assert set(plain.state_dict()) == set(padded.state_dict())


@pytest.mark.parametrize("interaction", ["dot", "cat"])
def test_top_mlp_input_padding_computes_the_same_function(interaction):
    """model.top_mlp_input_multiple appends zero inputs: same logits as the unpadded model with the
    shared weights, zero gradients for the padded weight columns, every other gradient equal."""
    from dlrm.config import ModelConfig
    from dlrm.model.dlrm import build_model

    base = dict(embedding_dim=3, bottom_mlp=[5, 3], top_mlp=[4, 1], interaction=interaction)
    plain = build_model(ModelConfig(**base), [3, 1, 7]).double()
    padded = build_model(ModelConfig(**base, top_mlp_input_multiple=8), [3, 1, 7]).double()
    width = plain.interaction_arch.output_dim
    assert padded.interaction_arch.output_dim == -(-width // 8) * 8 > width
    with torch.no_grad():
        for (k, a), (_, b) in zip(plain.named_parameters(), padded.named_parameters()):
            if a.shape == b.shape:
                b.copy_(a)
            else:  # the first OverArch layer: padded weight columns
                b.zero_()[:, :width].copy_(a)
                b[:, width:] = 0.5
    dense = torch.randn(3, 13, dtype=torch.float64).t().contiguous().t()  # batch 3
    raw = torch.tensor([[5, -1, 9], [0, 3, 2**32 - 1], [7, 7, 7]])
    out_plain, out_padded = plain(dense, raw), padded(dense, raw)
    torch.testing.assert_close(out_padded, out_plain, rtol=1e-12, atol=1e-12)
    out_plain.sum().backward()
    out_padded.sum().backward()
    for (k, a), (_, b) in zip(plain.named_parameters(), padded.named_parameters()):
        ga, gb = a.grad.to_dense(), b.grad.to_dense()
        if a.shape == b.shape:
            torch.testing.assert_close(gb, ga, rtol=1e-12, atol=1e-12, msg=k)
        else:
            torch.testing.assert_close(gb[:, :width], ga, rtol=1e-12, atol=1e-12, msg=k)
            assert torch.equal(gb[:, width:], torch.zeros_like(gb[:, width:]))
    assert set(plain.state_dict()) == set(padded.state_dict())  # same keys; one shape differs


def test_every_sparse_arch_states_the_interface():
    """The step, optimizers and graph capture read these attributes; nothing is probed (issue #18)."""
    from dlrm.distributed.sharded_embedding import ShardedSparseArch
    from dlrm.distributed.sharding import plan_sharding
    from dlrm.model.interfaces import SparseArchInterface
    from kernels.embedding import TritonSparseEmbedding

    cards = [5] * 26
    # Triton needs CUDA, or the CPU under TRITON_INTERPRET (set by conftest only where there is no CUDA)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        eager = SparseArch(cards, 4)
        triton_arch = TritonSparseEmbedding(cards, 4)
        sharded = ShardedSparseArch(cards, 4, plan_sharding(cards, 1, "table", 10**7), 0)
        sharded_triton = ShardedSparseArch(cards, 4, plan_sharding(cards, 1, "table", 10**7), 0, kernel="triton")
    for arch in (eager, triton_arch, sharded, sharded_triton):
        assert isinstance(arch, SparseArchInterface), type(arch).__name__
    flags = lambda a: (a.compilable, a.collective, a.fused_optimizer)  # noqa: E731
    assert flags(eager) == (False, False, False)
    assert flags(triton_arch) == (True, False, True)
    assert flags(sharded) == (False, True, False)
    assert flags(sharded_triton) == (False, True, True)  # fused update on the owner, eager collectives
