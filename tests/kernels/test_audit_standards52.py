"""The kernel test standard applied as a bug hunt (audit, standards52): element by element, forward and every
gradient, against float64, on odd shapes (batch 1, 3, 127; one feature; one-row tables; D not a power of two),
non-contiguous inputs and gradients and broadcast (stride-0) gradients; plus the two bugs it found:

* the Triton GEMMs (`kernels.linear`, `kernels.cross`, `kernels.wgrad`) handed float64 operands returned garbage
  without an error (Triton types ``tl.dot`` of float64 operands float64 while the fp32 accumulator stays fp32: the
  interpreter stored fp32 bit patterns into the float64 output, so ``ones @ ones.T`` gave 5e-315); the kernels
  now refuse dtypes other than float32 / bfloat16 / float16 with one ValueError, and ``LinearReLUWgrad`` (an
  ``nn.Linear`` that a ``.double()`` reaches) keeps PyTorch's backward for them, as it does for fp32;
* the pooled (multi-hot) lookup hashed floating-point raw values (1.5 as 1, 2.7 as 2) without an error, where the
  one-hot lookup refuses them and the eager `PooledSparseArch` raises; likewise the exported sparse updates took
  floating-point rows (1.7 updated row 1).

CPU: Triton interpreter (fp32); GPU: the same tests on CUDA tensors.
"""

from __future__ import annotations

import pytest
import torch

import kernels.wgrad as wgrad_mod
from dlrm.model.archs import MLP, DenseArch, InteractionArch, OverArch
from dlrm.model.masked_lookup import masked_embedding, masked_embedding_bag
from kernels.cross import TritonLowRankCrossNet, cross_forward, cross_layer
from kernels.embedding import (
    PAD_SPARSE,
    TritonPooledEmbedding,
    embedding_lookup,
    embedding_sparse_update_,
    fused_embedding,
    fused_pooled_embedding,
    init_sparse_optimizer_state,
    pooled_embedding_lookup,
    pooled_embedding_sparse_update_,
    pooled_hash_rows,
    pooled_layout,
)
from kernels.interaction import dot_interaction, dot_interaction_reference, dot_interaction_split
from kernels.linear import TritonLinear, gemm_bias_act, linear_act
from kernels.loss import bce_with_logits
from kernels.mlp import FusedMLP
from kernels.wgrad import LinearReLUWgrad, linear_wgrad

ATOL = RTOL = 1e-5  # fp32 results against float64 (sums of a few to ~100 terms of size ~1)


def _close(got, want, msg, atol=ATOL, rtol=RTOL):
    if got.is_sparse:
        got = got.to_dense()
    torch.testing.assert_close(got.detach().double().cpu(), want.detach().double().cpu(), atol=atol, rtol=rtol,
                               msg=lambda m: f"{msg}: {m}")


def _grad(kind: str, shape: tuple[int, ...], device, seed: int = 7) -> torch.Tensor:
    """An upstream gradient of `shape`: "permuted" (non-contiguous: every other element of one built with its axes
    reversed), "expand" (one value, every stride 0) or "rows" (one row broadcast over the batch: stride 0 in dim 0)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "permuted":
        g = torch.randn(*shape[::-1], 2, generator=gen)[..., 0].permute(*range(len(shape) - 1, -1, -1))
    elif kind == "expand":
        g = torch.randn((), generator=gen).expand(*shape)
    else:
        g = torch.randn(1, *shape[1:], generator=gen).expand(*shape)
    return g.to(device)


def _t(*shape, device, seed: int, transposed: bool = False) -> torch.Tensor:
    """A float32 tensor that requires grad; `transposed`: a 2-D one built [cols, rows] (column stride != 1)."""
    gen = torch.Generator().manual_seed(seed)
    if transposed:
        t = torch.randn(*shape[::-1], generator=gen).to(device).t()
    else:
        t = torch.randn(*shape, generator=gen).to(device)
    return t.requires_grad_()


def _ref(*ts):
    return [t.detach().double().cpu().requires_grad_() for t in ts]


# ----------------------------------------------------------------------------------------------------
# Bug 1: float64 operands of the Triton GEMMs
# ----------------------------------------------------------------------------------------------------


F64 = torch.float64


@pytest.mark.parametrize("call", ["linear_act", "TritonLinear", "gemm_bias_act", "cross_layer", "cross_forward",
                                  "TritonLowRankCrossNet", "linear_wgrad"])
def test_gemm_kernels_refuse_float64_instead_of_returning_garbage(call, device):
    """Before: float64 ``ones(3, 4) @ ones(2, 4).T`` gave 5.35e-315 (fp32 4.0's bits) and the gradients garbage or
    NaN; the cross layer's saved pre-activation (its backward's input) likewise. Now one ValueError naming the dtype."""
    a = torch.ones(3, 4, dtype=F64, device=device)
    w = torch.ones(2, 4, dtype=F64, device=device)
    calls = {
        "linear_act": lambda: linear_act(a, w, torch.ones(2, dtype=F64, device=device), "relu"),
        "TritonLinear": lambda: TritonLinear(4, 2).to(device).double()(a),
        "gemm_bias_act": lambda: gemm_bias_act(a, w),
        "cross_layer": lambda: cross_layer(a, a, a[:, :2], torch.ones(4, 2, dtype=F64, device=device),
                                           torch.ones(4, dtype=F64, device=device)),
        "cross_forward": lambda: cross_forward(a, a, a[:, :2], torch.ones(4, 2, dtype=F64, device=device),
                                               torch.ones(4, dtype=F64, device=device)),
        "TritonLowRankCrossNet": lambda: TritonLowRankCrossNet(4, 1, 2).to(device).double()(a),
        "linear_wgrad": lambda: linear_wgrad(a, a),
    }
    with pytest.raises(ValueError, match="float64"):
        calls[call]()


@pytest.mark.parametrize("relu", [False, True])
def test_wgrad_layer_in_float64_keeps_pytorchs_backward(relu, device, monkeypatch):
    """``LinearReLUWgrad`` is an nn.Linear: ``.double()`` reaches it. Before, its weight gradient came from the
    kernel in float64 (garbage: off by ~10 on a 20 x 17 layer); now float64 keeps PyTorch's backward (as fp32 does
    unless FP32_KERNEL), element by element equal to nn.Linear's."""
    monkeypatch.setattr(wgrad_mod, "FP32_KERNEL", True)  # the fp32 switch must not route float64 to the kernel
    torch.manual_seed(0)
    layer = LinearReLUWgrad(5, 17, activation="relu" if relu else "none").to(device).double()
    ref = torch.nn.Linear(5, 17).double()
    ref.load_state_dict({k: v.cpu() for k, v in layer.state_dict().items()})
    x = torch.randn(20, 5, dtype=F64, device=device, requires_grad=True)
    xr = x.detach().cpu().requires_grad_()
    y = layer(x)
    yr = ref(xr).relu() if relu else ref(xr)
    g = torch.randn(20, 17, dtype=F64)
    y.backward(g.to(device))
    yr.backward(g)
    for got, want, name in ((y, yr, "out"), (x.grad, xr.grad, "dx"), (layer.weight.grad, ref.weight.grad, "dW"),
                            (layer.bias.grad, ref.bias.grad, "db")):
        torch.testing.assert_close(got.cpu(), want, atol=1e-12, rtol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


# ----------------------------------------------------------------------------------------------------
# Bug 2: floating-point raw values in the pooled lookup
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("call", ["lookup", "hash_rows", "fused", "module"])
def test_pooled_lookup_refuses_floating_raw_values(call, device):
    """Before: raw [[1.5, 2.7, 0.2]] hashed as [[1, 2, 0]] and the lookup returned their rows' sums, silently (the
    one-hot lookup and the eager PooledSparseArch refuse such input). Now one ValueError naming the dtype."""
    layout = pooled_layout([2, 1], device)
    cards, offs = torch.tensor([5, 3], device=device), torch.tensor([0, 5], device=device)
    weight = torch.arange(16.0, device=device).reshape(8, 2)
    raw = torch.tensor([[1.5, 2.7, 0.2]], device=device)
    calls = {
        "lookup": lambda: pooled_embedding_lookup(raw, weight, cards, offs, layout),
        "hash_rows": lambda: pooled_hash_rows(raw, cards, offs, layout, 8),
        "fused": lambda: fused_pooled_embedding(raw, weight.clone(), cards, offs, layout, None, None, None,
                                                torch.tensor([0.1], device=device)),
        "module": lambda: TritonPooledEmbedding([5, 3], [2, 1], 2).to(device)(raw),
    }
    with pytest.raises(ValueError, match="float32"):
        calls[call]()


@pytest.mark.parametrize("pooled", [False, True])
def test_sparse_update_refuses_floating_rows(pooled, device):
    """The exported update functions take int64 rows (from hash_rows). Before: rows [[1.7]] updated row 1 (and
    2.9 row 2) with no error; now one ValueError naming the dtype, and the table is untouched."""
    weight = torch.zeros(4, 2, device=device)
    lr = torch.tensor([0.5], device=device)
    rows = torch.tensor([[1.7]], device=device)
    grad = torch.ones(1, 1, 2, device=device)
    with pytest.raises(ValueError, match="float32"):
        if pooled:
            pooled_embedding_sparse_update_(rows, grad, pooled_layout([1], device), weight, None, lr)
        else:
            embedding_sparse_update_(rows, grad, weight, None, lr)
    assert not weight.any()


# ----------------------------------------------------------------------------------------------------
# Bug 3: model pieces built with an unknown interaction kind or activation
# ----------------------------------------------------------------------------------------------------


def test_interaction_arch_refuses_an_unknown_kind():
    """Before: InteractionArch(2, 4, "Dot") computed the dot interaction (7 columns) while its output_dim said 12
    (cat's width), so the OverArch built from it failed at the first step with "mat1 and mat2 shapes cannot be
    multiplied (2x7 and 12x3)". Now the constructor raises one ValueError naming the kind."""
    with pytest.raises(ValueError, match="'Dot'"):
        InteractionArch(2, 4, "Dot")


def test_mlp_refuses_an_unknown_activation():
    """Before: MLP(3, [2], "Relu") was built and its first forward raised KeyError: 'Relu'. Now the constructor
    raises one ValueError naming the activation (as the Triton layers do)."""
    with pytest.raises(ValueError, match="'Relu'"):
        MLP(3, [2], "Relu")


# ----------------------------------------------------------------------------------------------------
# Combinations no test covered (they pass): the standard's odd shapes, strides and broadcast gradients
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("B, F, D", [(1, 0, 1), (1, 1, 1), (3, 0, 5), (127, 3, 3), (9, 40, 33)])
@pytest.mark.parametrize("grad", ["permuted", "expand"])
def test_dot_interaction_odd_shapes_transposed_inputs_broadcast_gradients(B, F, D, grad, device):
    """F = 0 (the dense vector alone: no pairs), batch 1, batch 127 (programs of 8 samples, the last part-full),
    F + 1 = 41 vectors (BLOCK_F 64) with D = 33 (BLOCK_D 64); dense transposed, sparse permuted; pad columns."""
    dense = _t(B, D, device=device, seed=1, transposed=True)
    gen = torch.Generator().manual_seed(2)
    sparse = torch.randn(F, D, B, generator=gen).to(device).permute(2, 0, 1).requires_grad_()
    y = dot_interaction_split(dense, sparse, 2)
    dr, sr = _ref(dense, sparse)
    yr = torch.nn.functional.pad(dot_interaction_reference(torch.cat([dr[:, None], sr], 1)), (0, 2))
    _close(y, yr, "forward", atol=1e-5 * max(1, D) ** 0.5)
    g = _grad(grad, tuple(y.shape), device)
    gd, gs = torch.autograd.grad(y, (dense, sparse), g)
    gdr, gsr = torch.autograd.grad(yr, (dr, sr), g.double().cpu())
    _close(gd, gdr, "d dense", atol=1e-5 * max(1, F))
    _close(gs, gsr, "d sparse", atol=1e-5 * max(1, F))
    assert torch.equal(dot_interaction(torch.cat([dense, sparse.reshape(B, -1)], 1).view(B, F + 1, D)),
                       dot_interaction_split(dense, sparse))


@pytest.mark.parametrize("shape", [(1,), (127,), (3, 2)])
@pytest.mark.parametrize("reduction", ["none", "sum"])
def test_bce_transposed_inputs_and_broadcast_gradient(shape, reduction, device):
    """Logits and labels strided (every other element, 2-D also transposed) and a stride-0 gradient of the
    unreduced loss; both gradients."""
    gen = torch.Generator().manual_seed(3)
    rev = tuple(range(len(shape) - 1, -1, -1))
    z = (torch.randn(*shape[::-1], 2, generator=gen)[..., 0] * 4).permute(rev).to(device).requires_grad_()
    y = torch.rand(*shape[::-1], 2, generator=gen)[..., 0].permute(rev).to(device).requires_grad_()
    loss = bce_with_logits(z, y, reduction)
    zr, yr = _ref(z, y)
    lr = torch.nn.functional.binary_cross_entropy_with_logits(zr, yr, reduction=reduction)
    _close(loss, lr, "loss", atol=1e-5 * (z.numel() if reduction == "sum" else 1))
    g = _grad("expand", tuple(loss.shape), device) if reduction == "none" else torch.tensor(0.7, device=device)
    got = torch.autograd.grad(loss, (z, y), g)
    want = torch.autograd.grad(lr, (zr, yr), g.double().cpu())
    _close(got[0], want[0], "d logits")
    _close(got[1], want[1], "d labels")


@pytest.mark.parametrize("M, K, N", [(1, 1, 1), (127, 13, 3), (129, 5, 2)])
@pytest.mark.parametrize("activation", ["none", "relu", "sigmoid", "gelu", "squared_relu"])
def test_linear_row_broadcast_gradient(M, K, N, activation, device):
    """Input and weight transposed, a strided bias, and an upstream gradient broadcast over the batch (stride 0 in
    dim 0 only): every activation, forward and the three gradients."""
    from kernels.activations import apply_activation

    x = _t(M, K, device=device, seed=4, transposed=True)
    w = _t(N, K, device=device, seed=5, transposed=True)
    b = torch.randn(2 * N, generator=torch.Generator().manual_seed(6)).to(device)[::2].requires_grad_()
    y = linear_act(x, w, b, activation, allow_tf32=False)
    xr, wr, br = _ref(x, w, b)
    yr = apply_activation(xr @ wr.t() + br, activation)
    _close(y, yr, "forward", atol=1e-4)
    g = _grad("rows", (M, N), device)
    for got, want, name in zip(torch.autograd.grad(y, (x, w, b), g), torch.autograd.grad(yr, (xr, wr, br), g.double().cpu()),
                               "xwb"):
        _close(got, want, f"d{name}", atol=1e-4)


@pytest.mark.parametrize("M, N, K", [(1, 1, 1), (127, 4, 3), (1, 130, 3)])
def test_cross_layer_column_broadcast_gradient(M, N, K, device):
    """x0 transposed, x every other column, a gradient broadcast along the columns (stride 0 in dim 1)."""
    x0 = _t(M, N, device=device, seed=8, transposed=True)
    x = torch.randn(M, 2 * N, generator=torch.Generator().manual_seed(9)).to(device)[:, ::2].requires_grad_()
    u = _t(M, K, device=device, seed=10, transposed=True)
    w = _t(N, K, device=device, seed=11)
    b = _t(N, device=device, seed=12)
    y = cross_layer(x0, x, u, w, b, allow_tf32=False)
    rs = _ref(x0, x, u, w, b)
    yr = rs[0] * (rs[2] @ rs[3].t() + rs[4]) + rs[1]
    _close(y, yr, "forward")
    g = torch.randn(M, 1, generator=torch.Generator().manual_seed(13)).to(device).expand(M, N)
    for i, (got, want) in enumerate(zip(torch.autograd.grad(y, (x0, x, u, w, b), g),
                                        torch.autograd.grad(yr, rs, g.double().cpu()))):
        _close(got, want, f"grad {i}", atol=1e-4)


@pytest.mark.parametrize("B, cards, D", [(1, [1], 1), (127, [1, 7], 6), (3, [4], 130)])
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("grad", ["rows", "expand"])
def test_one_hot_one_row_tables_broadcast_gradients(B, cards, D, optimizer, grad, device):
    """Tables of ONE row (every value hashes to it: a segment of B positions), raw transposed, D = 1, 6, 130;
    the plain lookup's dense gradient and the fused update against float64, with stride-0 gradients."""
    F = len(cards)
    card = torch.tensor(cards, device=device)
    off = torch.cumsum(torch.tensor([0] + cards), 0)[:-1].to(device)
    raw = torch.randint(-1, 50, (F, B), generator=torch.Generator().manual_seed(14)).to(device).t()
    rows = (torch.remainder(raw + 1, card) + off).cpu()
    R = sum(cards)
    w = torch.randn(R, D, generator=torch.Generator().manual_seed(15)).to(device).requires_grad_()
    out = embedding_lookup(raw, w, card, off)
    g = _grad(grad, (B, F, D), device)
    (gw,) = torch.autograd.grad(out, w, g)
    g64 = g.double().cpu().reshape(-1, D)
    want_g = torch.zeros(R, D, dtype=F64).index_add_(0, rows.reshape(-1), g64)
    _close(out, w.detach().double().cpu()[rows], "lookup")
    _close(gw, want_g, "dense gradient", atol=1e-5 * B)
    w2 = w.detach().clone()
    state = init_sparse_optimizer_state(optimizer, w2)
    lr = torch.tensor([0.1], device=device)
    fused_embedding(raw, w2, card, off, None, None, state, lr, optimizer, 1e-8, True,
                    torch.zeros(0, device=device, requires_grad=True)).backward(g)
    w64 = w.detach().double().cpu()
    touched = torch.zeros(R, dtype=torch.bool)
    touched[rows.reshape(-1)] = True
    if optimizer == "sgd":
        want = w64 - 0.1 * want_g
    else:
        s = want_g.square().mean(1, keepdim=True)
        want = torch.where(touched[:, None], w64 - 0.1 * want_g / (s.sqrt() + 1e-8), w64)
    _close(w2, want, "fused update", atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("B, hot, cards, D", [(1, [1], [1], 1), (127, [1, 3], [1, 7], 6), (3, [5], [4], 130)])
def test_pooled_prefix_transposed_and_broadcast_gradient(B, hot, cards, D, device):
    """The fused pooled lookup with a transposed ``prefix`` (the DCN concatenation built in the lookup), PAD slots,
    one-row tables and a gradient broadcast over the batch: output, prefix gradient and SGD update vs float64."""
    layout = pooled_layout(hot, device)
    card = torch.tensor(cards, device=device)
    off = torch.cumsum(torch.tensor([0] + cards), 0)[:-1].to(device)
    L, F, R = sum(hot), len(hot), sum(cards)
    raw = torch.randint(-2, 30, (L, B), generator=torch.Generator().manual_seed(16)).to(device).t()
    sf = layout.slot_feature.cpu()
    raw_c = raw.cpu()
    rows = torch.where(raw_c == PAD_SPARSE, torch.tensor(R), torch.remainder(raw_c + 1, card.cpu()[sf]) + off.cpu()[sf])
    w0 = torch.randn(R, D, generator=torch.Generator().manual_seed(17)).to(device)
    w = w0.clone()
    prefix = _t(B, D, device=device, seed=18, transposed=True)
    out = fused_pooled_embedding(raw, w, card, off, layout, None, None, None, torch.tensor([0.1], device=device),
                                 "sgd", grad_trigger=torch.zeros(0, device=device, requires_grad=True), prefix=prefix)
    w64 = torch.cat([w0.double().cpu(), torch.zeros(1, D, dtype=F64)])
    pooled = torch.zeros(B, F, D, dtype=F64).index_add(1, sf, w64[rows])
    _close(out, torch.cat([prefix.detach().double().cpu()[:, None], pooled], 1), "forward")
    g = _grad("rows", (B, 1 + F, D), device)
    out.backward(g)
    _close(prefix.grad, g[:, 0], "prefix gradient")
    per = g.double().cpu()[:, 1:][:, sf].reshape(-1, D)
    want_g = torch.zeros(R + 1, D, dtype=F64).index_add_(0, rows.reshape(-1), per)[:R]
    _close(w, w0.double().cpu() - 0.1 * want_g, "sgd update", atol=1e-5 * B)


@pytest.mark.parametrize("shape", [(1,), (1, 1), (127, 2)])
def test_masked_embedding_nan_rows_broadcast_gradient(shape, device):
    """A masked lookup pointing at a NaN row contributes nothing, also with a stride-0 upstream gradient; the sparse
    gradient holds the kept lookups' sums only (float64 reference)."""
    R, D = 5, 3
    gen = torch.Generator().manual_seed(19)
    w = torch.randn(R, D, generator=gen)
    w[0] = float("nan")
    keep = torch.rand(shape, generator=gen) > 0.4
    keep.view(-1)[0] = True
    rows = torch.where(keep, torch.randint(1, R, shape, generator=gen), 0)
    weight = w.clone().requires_grad_()
    out = masked_embedding(rows, weight, keep)
    g = torch.tensor(0.5).expand(*shape, D)
    out.backward(g)
    _close(out, torch.where(keep[..., None], w.double()[rows], 0.0), "forward")
    _close(weight.grad, torch.zeros(R, D, dtype=F64).index_add_(0, rows[keep], g.double()[keep]), "gradient")
    bag_w = w.clone().requires_grad_()
    flat_rows, flat_keep = rows.reshape(-1), keep.reshape(-1)
    n = flat_rows.numel()
    pooled = masked_embedding_bag(flat_rows, bag_w, flat_keep, torch.tensor([0]), torch.zeros(n, dtype=torch.int64))
    pooled.backward(torch.tensor(2.0).expand(1, D))
    _close(pooled, torch.where(flat_keep[:, None], w.double()[flat_rows], 0.0).sum(0, keepdim=True), "bag")
    _close(bag_w.grad, torch.zeros(R, D, dtype=F64).index_add_(0, flat_rows[flat_keep],
                                                                torch.full((int(flat_keep.sum()), D), 2.0, dtype=F64)),
           "bag gradient")


@pytest.mark.parametrize("B", [1, 127])
@pytest.mark.parametrize("impl", ["eager", "triton", "fused"])
def test_dense_and_over_arch_transposed_input_broadcast_gradient(B, impl, device):
    """DenseArch with zero-padded input (input_multiple 8) on a transposed batch, and OverArch at batch 1 (the
    logit squeezed to [1], not to a 0-dim tensor), against float64 copies; gradients broadcast (stride 0)."""
    kw = {"eager": {}, "triton": {"linear_cls": TritonLinear}, "fused": {"mlp_cls": FusedMLP}}[impl]
    torch.manual_seed(0)
    dense = DenseArch(13, [7, 5], input_multiple=8, **kw).to(device)
    over = OverArch(5, [3, 1], **kw).to(device)
    dense_r, over_r = DenseArch(13, [7, 5], input_multiple=8).double(), OverArch(5, [3, 1]).double()
    dense_r.load_state_dict({k: v.cpu() for k, v in dense.state_dict().items()})
    over_r.load_state_dict({k: v.cpu() for k, v in over.state_dict().items()})
    x = _t(B, 13, device=device, seed=20, transposed=True)
    (xr,) = _ref(x)
    y, yr = over(dense(x)), over_r(dense_r(xr))
    assert y.shape == (B,)
    _close(y, yr, "logits", atol=1e-4)
    g = torch.tensor(0.3, device=device).expand(B)
    params = [x, *dense.parameters(), *over.parameters()]
    params_r = [xr, *dense_r.parameters(), *over_r.parameters()]
    for i, (got, want) in enumerate(zip(torch.autograd.grad(y, params, g),
                                        torch.autograd.grad(yr, params_r, g.double().cpu()))):
        _close(got, want, f"grad {i}", atol=1e-4)
