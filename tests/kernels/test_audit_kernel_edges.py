"""Audit of the Triton kernels' edges: operands the other kernel tests did not hand them. Bugs found (each test
fails without its fix): a strided bias in the linear GEMM, a saved tensor of another shape (or the output where the
pre-activation is needed) in the epilogue's backward, float raw values in the one-hot embedding's hashing, a negative
or NaN Adagrad eps in the sparse update, a batch past the padded one in the exchange kernels, and ``pad`` with the
one-tensor form of the interaction module. (The interaction, loss, MLP, wgrad, dense Adagrad and sparse update
kernels were also checked against float64 on odd, empty, strided and expanded operands: nothing else found.)

Numerical checks are against float64 references. CPU: Triton interpreter (fp32); GPU: the same tests on CUDA tensors.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before triton is imported (tests/kernels/conftest.py does the same)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels.activations import apply_activation  # noqa: E402
from kernels.embedding import (  # noqa: E402
    SparseOptimizerConfig,
    TritonSparseEmbedding,
    embedding_sparse_update_,
    init_sparse_optimizer_state,
)
from kernels.epilogue import act_backward  # noqa: E402
from kernels.exchange_combine import combine_received, combine_received_eager, exchange_layout  # noqa: E402
from kernels.exchange_ids import send_ids, send_ids_eager  # noqa: E402
from kernels.interaction import TritonDotInteraction, dot_interaction_reference  # noqa: E402
from kernels.linear import TritonLinear, gemm_bias_act, linear_act  # noqa: E402


def _close(got: torch.Tensor, ref: torch.Tensor, what: str, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    torch.testing.assert_close(got.detach().double().cpu(), ref.detach().double().cpu(), atol=atol, rtol=rtol,
                               msg=lambda m: f"{what}: {m}")


def _randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------------
# kernels/linear.py: the bias is read through its data pointer
# ----------------------------------------------------------------------------------------------


_BIAS_LEAVES = {"every_other": (12,), "column": (6, 3), "expanded": (1,)}  # for N = 6 (the scalar: [1] expanded)


def _bias_view(kind: str, leaf: torch.Tensor, N: int) -> torch.Tensor:
    """A 1-D bias [N] whose stride is not 1, a view of ``leaf``: every other element of a wider one, a column of a
    matrix, a scalar expanded (stride 0)."""
    return leaf[::2] if kind == "every_other" else leaf[:, 1] if kind == "column" else leaf.expand(N)


@pytest.mark.parametrize("kind", ["every_other", "column", "expanded"])
@pytest.mark.parametrize("activation", ["none", "relu", "gelu"])
def test_linear_reads_a_strided_bias_through_its_stride(kind, activation, device):
    """`linear_act` / `TritonLinear` / `gemm_bias_act` take any bias [N] (its shape is what linear_act checks), but the
    GEMM kernel read ``bias_ptr + n``: a sliced bias gave other elements (every other one: the wrong values), an
    expanded one read past its single element. Forward and every gradient against float64."""
    M, K, N = 5, 7, 6
    x = _randn(M, K, seed=1).to(device).requires_grad_()
    w = _randn(N, K, seed=2).to(device).requires_grad_()
    leaf = _randn(*_BIAS_LEAVES[kind], seed=3).to(device).requires_grad_()
    bias = _bias_view(kind, leaf, N)
    assert bias.stride(0) != 1
    out = linear_act(x, w, bias, activation)
    xd, wd = x.detach().double().cpu().requires_grad_(), w.detach().double().cpu().requires_grad_()
    leaf_d = leaf.detach().double().cpu().requires_grad_()
    bd = _bias_view(kind, leaf_d, N)
    ref = apply_activation(F.linear(xd, wd, bd), activation)
    _close(out, ref, f"linear_act {kind} {activation}")
    g = _randn(M, N, seed=5).to(device)
    out.backward(g)
    ref.backward(g.double().cpu())
    _close(x.grad, xd.grad, "grad_x")
    _close(w.grad, wd.grad, "grad_w")
    _close(leaf.grad, leaf_d.grad, "grad of the bias's base")
    got, _ = gemm_bias_act(x.detach(), w.detach(), bias.detach(), activation)
    _close(got, ref, f"gemm_bias_act {kind} {activation}")


def test_triton_linear_with_a_bias_shared_from_a_wider_parameter(device):
    """`TritonLinear.from_linear` shares the parameters it is given: a bias that is a strided view (here of a
    wider tensor) is used as is, so the module's output must match nn.Linear's."""
    lin = torch.nn.Linear(4, 3).to(device)
    wide = _randn(6, seed=7).to(device)
    lin.bias = torch.nn.Parameter(wide[::2], requires_grad=False)  # a strided view, not copied
    assert lin.bias.stride(0) == 2
    layer = TritonLinear.from_linear(lin)
    x = _randn(2, 4, seed=8).to(device)
    _close(layer(x), lin(x).double(), "TritonLinear.from_linear")


def test_gemm_refuses_a_bias_of_another_width(device):
    """`gemm_bias_act` (public) checked a and w but not the bias: a shorter bias was read past its end, a longer
    one cut silently. Now a one-line ValueError naming both widths."""
    a, w = _randn(3, 4, seed=1).to(device), _randn(5, 4, seed=2).to(device)
    for bad in (torch.zeros(4, device=device), torch.zeros(6, device=device), torch.zeros(1, 5, device=device)):
        with pytest.raises(ValueError, match=r"bias must be \[5\]"):
            gemm_bias_act(a, w, bad)


# ----------------------------------------------------------------------------------------------
# kernels/epilogue.py: act_backward's saved tensor
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("activation", ["relu", "sigmoid", "gelu", "squared_relu"])
@pytest.mark.parametrize("saved_shape", [(2, 5), (4, 3), (4, 5, 2), (5,)])
def test_act_backward_refuses_a_saved_tensor_of_another_shape(activation, saved_shape, device):
    """`act_backward` (public) reads ``saved[m, n]`` for every element of grad_out [M, N] through saved's strides:
    a smaller saved tensor was read past its end (rows 2-3 of a [4, 5] gradient came from outside a [2, 5] one:
    garbage derivatives, no error). Now a one-line ValueError naming both shapes."""
    g = _randn(4, 5, seed=1).to(device)
    saved = torch.ones(saved_shape, device=device)
    with pytest.raises(ValueError, match=r"saved must have grad_out's shape \(4, 5\)"):
        act_backward(g, saved, activation, activation in ("relu", "sigmoid"), bias_grad=True)


@pytest.mark.parametrize("activation", ["gelu", "squared_relu"])
def test_act_backward_refuses_the_output_where_the_pre_activation_is_needed(activation, device):
    """gelu's and squared_relu's derivatives need the pre-activation (`derivative_from_output` is False): with
    ``from_output=True`` the kernel took the output for the pre-activation and returned act'(act(pre)), a wrong
    gradient without a word. Refused; the pre-activation still gives the float64 derivative."""
    pre = _randn(6, 5, seed=2).to(device)
    g = _randn(6, 5, seed=3).to(device)
    with pytest.raises(ValueError, match="needs the pre-activation"):
        act_backward(g, apply_activation(pre, activation), activation, True)
    gpre, _ = act_backward(g, pre, activation, False)
    pd = pre.double().cpu().requires_grad_()
    (ref,) = torch.autograd.grad(apply_activation(pd, activation), pd, g.double().cpu())
    _close(gpre, ref, f"{activation} from the pre-activation")


# ----------------------------------------------------------------------------------------------
# kernels/embedding: the raw values' dtype
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("path", ["rows", "lookup", "fused_sgd_atomic", "fused_adagrad"])
def test_one_hot_embedding_refuses_floating_raw_values(dtype, path, device):
    """The one-hot lookup converted whatever it loaded to int64: float raw values were hashed truncated (1.5 as 1,
    7.9 as 7), with no error, where the eager SparseArch refuses them (an index error). Now a one-line ValueError
    naming the dtype, in every entry point (the rows, the plain lookup, both fused backward paths' forward); the
    weight and the optimizer state are untouched. Integer raw values of any width still hash as int64 ones."""
    emb = TritonSparseEmbedding([5, 3], dim=4).to(device)
    raw = torch.tensor([[0.0, 2.0], [1.5, 7.9]], device=device, dtype=dtype)
    if path.startswith("fused"):
        kind, det = ("sgd", False) if path == "fused_sgd_atomic" else ("adagrad", True)
        emb.use_fused_update(SparseOptimizerConfig(kind, torch.tensor([0.1], device=device), deterministic=det))
    w0 = emb.weight.detach().clone()
    with pytest.raises(ValueError, match=r"raw must hold integers .*got torch\.(float|bfloat)"):
        emb.rows(raw) if path == "rows" else emb(raw)
    assert torch.equal(emb.weight.detach(), w0)
    ints = torch.tensor([[0, 2], [-1, 7]], device=device)
    want = emb.rows(ints)
    for int_dtype in (torch.int32, torch.int16):
        assert torch.equal(emb.rows(ints.to(int_dtype)), want)


# ----------------------------------------------------------------------------------------------
# kernels/embedding: the sparse Adagrad's eps
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("eps", [-1.0, -1e-10, float("nan")])
def test_sparse_adagrad_refuses_a_negative_or_nan_eps(optimizer, eps, device):
    """``weight_decay`` < 0 was refused, a negative ``eps`` was not: with a zero state, ``sqrt(g^2) + eps`` hits 0
    for |g| = 1 and eps = -1 (inf / NaN rows, silently; torch.optim.Adagrad, the eager path, refuses such an eps at
    construction). Now a one-line ValueError from the update (nothing written) and from ``use_fused_update`` (before
    any step). SGD has no eps and ignores it; eps = 0 stays valid."""
    R, D, B = 4, 8, 3
    rows = torch.tensor([[0], [2], [2]], device=device)
    grad = torch.ones(B, 1, D, device=device)
    weight = _randn(R, D, seed=1).to(device)
    state = init_sparse_optimizer_state(optimizer, weight)
    w0, s0 = weight.clone(), state.clone()
    lr = torch.tensor([0.1], device=device)
    with pytest.raises(ValueError, match=rf"{optimizer} eps must be >= 0, got"):
        embedding_sparse_update_(rows, grad, weight, state, lr, optimizer, eps, True)
    assert torch.equal(weight, w0) and torch.equal(state, s0)
    emb = TritonSparseEmbedding([3, 5], dim=4).to(device)
    with pytest.raises(ValueError, match=rf"{optimizer} eps must be >= 0, got"):
        emb.use_fused_update(SparseOptimizerConfig(optimizer, lr, eps=eps))
    assert emb.fused_update is None and emb.weight.requires_grad
    # what stays valid: eps = 0, and any eps for SGD
    embedding_sparse_update_(rows, grad, weight, state, lr, optimizer, 0.0, True)
    assert bool(torch.isfinite(weight).all()) and not torch.equal(weight, w0)
    w1 = weight.clone()
    embedding_sparse_update_(rows, grad, weight, None, lr, "sgd", eps, True)
    _close(weight, w1.double() - 0.1 * torch.tensor([1.0, 0.0, 2.0, 0.0], dtype=torch.float64, device=device)[:, None],
           "sgd ignores eps")


# ----------------------------------------------------------------------------------------------
# kernels/exchange_ids.py, kernels/exchange_combine.py: a batch larger than the padded one
# ----------------------------------------------------------------------------------------------


def test_exchange_kernels_refuse_a_batch_past_the_padded_one(device):
    """Both exchange kernels lay out P (padded) samples a rank. With B > P, `combine_received` read sample P's
    columns from the next rank's block (a [3, F, D] output where the eager reference has 2 rows) and `send_ids`
    dropped samples P.. from the send buffer (6 ids where the eager one has 9); both without a word. Now one-line
    ValueErrors; B <= P still matches the eager references."""
    layout = exchange_layout([[0, 1], [1]], 2, device=device)
    P, D = 2, 4
    x = _randn(P * 3, D, seed=1).to(device)
    with pytest.raises(ValueError, match=r"batch B=3 must lie in \[0, P=2\]"):
        combine_received(x, layout, 3, P, 0.5)
    for B in (0, 1, 2):
        _close(combine_received(x, layout, B, P, 0.5), combine_received_eager(x, layout, B, P, 0.5).double(),
               f"combine B={B}")
    raw = torch.tensor([[3, 8], [0, -1], [6, 2]], device=device)
    card = torch.tensor([5, 7], device=device)
    slots = [torch.tensor([0, 1], device=device), torch.tensor([1], device=device)]
    with pytest.raises(ValueError, match=r"padded P=2 must be >= the batch B=3"):
        send_ids(raw, card, slots, 2, multi_hot=False)
    for padded in (3, 4):
        got = send_ids(raw, card, slots, padded, multi_hot=False)
        assert torch.equal(got, send_ids_eager(torch.remainder(raw + 1, card), slots, padded))


# ----------------------------------------------------------------------------------------------
# kernels/interaction.py: pad with the one-tensor form
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("B,F1,D,pad", [(1, 1, 3, 2), (3, 4, 5, 3), (127, 2, 7, 1)])
def test_interaction_module_pads_the_one_tensor_form_too(B, F1, D, pad, device):
    """`TritonDotInteraction.forward(x, sparse=None, pad=0)` takes ``pad`` in its signature, but the one-tensor
    form ``op(x, pad=p)`` dropped it: [B, D + T] where [B, D + T + p] was asked, no error (a top MLP sized for the
    padded width then fails far from the cause). Now both forms pad; values and gradients against float64."""
    op = TritonDotInteraction()
    x = _randn(B, F1, D, seed=B + F1).to(device).requires_grad_()
    out = op(x, pad=pad)
    xd = x.detach().double().cpu().requires_grad_()
    ref = F.pad(dot_interaction_reference(xd), (0, pad))
    _close(out, ref, "op(x, pad=...)")
    assert torch.equal(out, op(x[:, 0], x[:, 1:], pad))
    g = _randn(B, ref.shape[1], seed=9).to(device)
    out.backward(g)
    ref.backward(g.double().cpu())
    _close(x.grad, xd.grad, "grad_x")
