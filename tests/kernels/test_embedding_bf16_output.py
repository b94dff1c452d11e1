"""The one-hot lookup's bf16 output from fp32 tables (``out_dtype`` / ``autocast_output``, issue #20).

Under bf16 autocast the model casts the embeddings to bf16 before the interaction; the lookup can emit
them in bf16 directly. What must hold, element by element (CPU: Triton interpreter; GPU: marked gpu):

* the output is exactly ``weight[rows].to(torch.bfloat16)`` (round to nearest even, ties, signed zeros,
  infinities and NaN included);
* the gradient, which then arrives in bf16, gives the same dense gradient (fp32, against a float64
  reference) and the same fused optimizer update as the fp32 output given the same (bf16-valued)
  gradient: bit for bit in the interpreter; on a GPU up to the order of the fp32 additions (the segment
  sums of bf16 gradients run as bf16 tensor-core products, those of fp32 ones as 3-pass TF32 ones);
* the module emits bf16 only under bf16 autocast with ``autocast_output`` and fp32 tables, and
  torch.compile(fullgraph=True) traces it.
"""

from __future__ import annotations

import pytest
import torch

from kernels.embedding import SparseOptimizerConfig, TritonSparseEmbedding, embedding_lookup, fused_embedding
from tests.kernels.embedding_inputs import make_grad, make_state, make_weight
from tests.kernels.test_embedding import EPS, LR, OPTIMIZERS, dense_grad64, make_case, reference_update, training_rows

BF16 = torch.bfloat16


EDGES = [1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8),  # exact ties: to even (down, up, negative)
         1 + 2.0**-8 * (1 + 2**-15), 1 + 2.0**-8 * (1 - 2**-15),  # just above and below a tie
         -0.0, 3.4028235e38, float("inf"), float("-inf"), float("nan")]  # max fp32 rounds to inf


def put_rounding_edges(weight: torch.Tensor, row: int) -> torch.Tensor:
    """Write the bf16 rounding edge cases (ties to even, values just off a tie, signed zero, the largest
    finite fp32, infinities, NaN) into the first columns of ``row``."""
    n = min(weight.shape[1], len(EDGES))
    weight[row, :n] = torch.tensor(EDGES[:n], device=weight.device)
    return weight


@pytest.mark.parametrize("B,F,D,mode,sliced", [(1, 1, 16, "modulus", False), (3, 26, 24, "vocabulary", True),
                                               (127, 26, 16, "modulus", False)])
def test_bf16_output_is_the_rounded_gather(B, F, D, mode, sliced, device):
    case = make_case(B, F, mode, hot=(B == 127), seed=B + D).to(device)
    rows = training_rows(case).to(device)
    weight = put_rounding_edges(make_weight(case.num_rows, D, device, sliced=sliced), int(rows[0, -1]))
    out = embedding_lookup(case.raw, weight, *case.hash_args(), out_dtype=BF16)
    assert out.dtype == BF16 and out.shape == (B, F, D)
    expected = weight[rows].to(BF16)  # torch's cast: round to nearest even
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)
    assert out[0, -1, 0] == 1.0 and out[0, -1, 1] == 1 + 2.0**-6 and torch.isinf(out[0, -1, 6])


@pytest.mark.parametrize("layout", ["contiguous", "permuted", "expand"])
def test_bf16_output_dense_gradient_is_fp32(layout, device, assert_close):
    B, F, D = 127, 26, 16
    case = make_case(B, F, "modulus", hot=True, seed=3).to(device)
    weight = make_weight(case.num_rows, D, device).requires_grad_()
    out = embedding_lookup(case.raw, weight, *case.hash_args(), out_dtype=BF16)
    grad = make_grad(B, F, D, layout, device, BF16)
    out.backward(grad)
    assert weight.grad.dtype == torch.float32
    rows = training_rows(case).to(device)
    assert_close(weight.grad, dense_grad64(rows, grad.float(), case.num_rows), torch.float32)


@pytest.mark.parametrize("optimizer,deterministic", [(o, True) for o in OPTIMIZERS] + [("sgd", False)])
def test_bf16_output_fused_update_equals_the_fp32_output(optimizer, deterministic, device, assert_close):
    """Same rows, same (bf16-valued) gradient: the bf16 output's update is the fp32 output's (bitwise in
    the interpreter), and both match the float64 reference."""
    B, F, D = 127, 26, 24
    case = make_case(B, F, "vocabulary", hot=True, seed=5).to(device)
    grad = make_grad(B, F, D, "permuted", device, BF16)
    lr = torch.tensor(LR, device=device)
    results = {}
    for out_dtype in (None, BF16):
        weight = make_weight(case.num_rows, D, device)
        state = make_state(optimizer, weight)
        trigger = torch.zeros(0, device=device, requires_grad=True)
        out = fused_embedding(case.raw, weight, *case.hash_args(), state, lr, optimizer, EPS, deterministic, trigger,
                              out_dtype=out_dtype)
        assert out.dtype == (out_dtype or torch.float32)
        out.backward(grad if out_dtype is not None else grad.float())
        results[out_dtype] = (weight, state)
    (w32, s32), (w16, s16) = results[None], results[BF16]
    if device.type == "cpu":  # the interpreter sums both in fp32, in the same order
        assert torch.equal(w16, w32)
        assert s16 is None or torch.equal(s16, s32)
    else:  # bf16 vs 3-pass TF32 tensor-core sums, or atomics: the same values added in another order
        assert_close(w16, w32, torch.float32)
    w0 = make_weight(case.num_rows, D, device)
    rows = training_rows(case).to(device)
    w_ref, s_ref = reference_update(optimizer, rows, grad.float(), w0, make_state(optimizer, w0), LR)
    assert_close(w16, w_ref, torch.float32, msg="weight")
    if s16 is not None:
        assert_close(s16, s_ref, torch.float32, msg="state")


def test_module_emits_bf16_only_under_bf16_autocast(device):
    cards = [5, 1, 300, 17]
    raw = make_case(3, 4, "modulus", seed=19).raw.to(device)
    emb = TritonSparseEmbedding(cards, 16, autocast_output=True).to(device)
    plain = TritonSparseEmbedding(cards, 16).to(device)
    plain.load_state_dict(emb.state_dict())
    ref = emb(raw)
    assert ref.dtype == torch.float32
    with torch.autocast(device.type, dtype=BF16):
        out, kept = emb(raw), plain(raw)
    assert out.dtype == BF16 and torch.equal(out, ref.to(BF16))
    assert kept.dtype == torch.float32 and torch.equal(kept, ref)  # autocast_output off (the default)
    with torch.autocast(device.type, dtype=BF16, enabled=False):
        assert emb(raw).dtype == torch.float32
    bf16_table = TritonSparseEmbedding(cards, 16, dtype=BF16, autocast_output=True).to(device)
    with torch.autocast(device.type, dtype=BF16):
        assert bf16_table(raw).dtype == BF16  # bf16 tables: the weight's dtype, as before


def test_bad_out_dtype_is_a_clear_error(device):
    case = make_case(3, 2, "modulus").to(device)
    weight = make_weight(case.num_rows, 16, device)
    with pytest.raises(ValueError, match="out_dtype"):
        embedding_lookup(case.raw, weight, *case.hash_args(), out_dtype=torch.float16)
    with pytest.raises(ValueError, match="out_dtype"):
        embedding_lookup(case.raw, weight.to(BF16), *case.hash_args(), out_dtype=torch.float32)


def test_opcheck_bf16_output(device):
    ops = torch.ops.dlrm_kernels
    mod = make_case(3, 2, "modulus", seed=23).to(device)
    D = 16
    weight = make_weight(mod.num_rows, D, device)
    lr = torch.tensor(LR, device=device)
    torch.library.opcheck(ops.embedding_lookup.default,
                          (mod.raw, weight.clone().requires_grad_(), *mod.hash_args(), BF16))
    torch.library.opcheck(ops.fused_embedding.default,
                          (mod.raw, weight.clone().requires_grad_(), *mod.hash_args(),
                           torch.zeros(mod.num_rows, device=device), lr, "rowwise_adagrad", EPS, True,
                           torch.zeros(0, device=device), 0.0, BF16))


def test_compile_fullgraph_under_autocast(device, assert_close):
    """The fused module under bf16 autocast compiles with fullgraph=True (the autocast query folds into
    the graph) and updates exactly as in eager mode."""
    torch._dynamo.reset()
    B, F, D = 3, 4, 16
    cards = [5, 1, 300, 17]
    raw = make_case(B, F, "modulus", hot=True, seed=29).raw.to(device)
    target = torch.randn(B, F, D, device=device)
    weights = []
    for compiled in (False, True):
        torch.manual_seed(0)
        emb = TritonSparseEmbedding(cards, D, autocast_output=True).to(device)
        emb.use_fused_update(SparseOptimizerConfig("adagrad", torch.tensor(LR, device=device)))

        def step(raw):
            with torch.autocast(device.type, dtype=BF16):
                out = emb(raw)
                assert out.dtype == BF16
                return ((out.float() - target) ** 2).sum()

        fn = torch.compile(step, fullgraph=True) if compiled else step
        fn(raw).backward()
        weights.append(emb.weight.detach().clone())
    assert_close(weights[1], weights[0], torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_gpu_bf16_output(optimizer, assert_close):
    device = torch.device("cuda")
    B, F, D = 4096, 26, 128
    case = make_case(B, F, "modulus", hot=True, seed=43).to(device)
    rows = training_rows(case).to(device)
    weight = put_rounding_edges(make_weight(case.num_rows, D, device), int(rows[0, 0]))
    out = embedding_lookup(case.raw, weight, *case.hash_args(), out_dtype=BF16)
    torch.testing.assert_close(out, weight[rows].to(BF16), rtol=0, atol=0, equal_nan=True)
    grad = make_grad(B, F, D, "contiguous", device, BF16)
    lr = torch.tensor(LR, device=device)
    finals = []
    for out_dtype in (None, BF16):
        w = make_weight(case.num_rows, D, device)
        state = make_state(optimizer, w)
        trigger = torch.zeros(0, device=device, requires_grad=True)
        o = fused_embedding(case.raw, w, *case.hash_args(), state, lr, optimizer, EPS, optimizer != "sgd", trigger,
                            out_dtype=out_dtype)
        o.backward(grad if out_dtype is not None else grad.float())
        finals.append(w)
    # fp32 sums of the same bf16 values in another order (atomics; bf16 vs 3-pass TF32 tensor-core sums):
    # hot rows sum ~1000 gradients, hence the scaled atol
    assert_close(finals[1], finals[0], torch.float32, scale=10.0)
    assert not torch.equal(finals[0], make_weight(case.num_rows, D, device))  # the update ran
