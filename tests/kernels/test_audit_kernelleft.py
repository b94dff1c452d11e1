"""Audit tests for the kernels' remaining input edges: float64 handed to the kernels that compute in fp32, and
arguments on different devices.

float64: the kernels below accumulate (or just compute) in fp32 and stored the fp32 result into a float64 output, so
a float64 caller got fp32 numbers that looked exact; they now refuse it in one line, as the GEMM kernels do
(`kernels._backend.check_gemm_dtype`), and the sharded arch, which may be made float64 by ``.double()``, takes its
eager combine for it.

Devices: a kernel launches on one operand's device and reads every pointer there (on a GPU, a CPU tensor failed
inside Triton naming only a pointer's position, another GPU's buffer was read through its address). This CPU-only
machine has one real device, so the mismatched tensor is put on 'meta' (a device of its own, without storage), and
each launcher must name the tensors and their devices before anything is launched. The launchers behind
``torch.library`` custom ops are called directly: given a 'meta' argument the dispatcher runs an op's fake kernel,
while a CPU / CUDA mix dispatches to the launcher, which is what is checked.
"""

from __future__ import annotations

import pytest
import torch

from kernels.exchange_combine import combine_received, combine_received_eager, exchange_layout
from kernels.exchange_ids import local_ids, send_ids

META = torch.device("meta")


def _i64(values, device):
    return torch.tensor(values, dtype=torch.int64, device=device)


# ----------------------------------------------------------------------------------------------------
# (1) the exchange's combine given float64
# ----------------------------------------------------------------------------------------------------


def test_combine_received_refuses_float64_the_eager_twin_adds_it_exactly(device):
    """Row-wise parts of ~1e8 whose float64 sum is not an fp32 number: the eager combine adds in float64; the kernel
    added in fp32 (3.1 off here) and returned float64. Refused now, in one line naming the dtype and the way out."""
    served, F, B, P, D = [[0, 1], [1]], 2, 3, 3, 4
    layout = exchange_layout(served, F, device)
    x = torch.full((P * 3, D), 1e8 + 0.3, dtype=torch.float64, device=device)
    x[1::2] = 3.3  # feature 1's second part (rank 1's column) of some rows: 1e8 + 0.3 + 3.3 is no fp32 number
    eager = combine_received_eager(x, exchange_layout(served, F, device), B, P, 0.5)
    assert eager.dtype == torch.float64
    want = torch.tensor([[float(x[p * 2 + f, 0]) + (float(x[2 * P + p, 0]) if f == 1 else 0.0) for f in range(F)]
                         for p in range(B)], dtype=torch.float64)
    torch.testing.assert_close(eager[:, :, 0].cpu(), want, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"^combine_received's kernels take float32, bfloat16 or float16 operands, "
                                         r"got torch\.float64 \(combine_received_eager") as err:
        combine_received(x, layout, B, P, 0.5)
    assert "\n" not in str(err.value)
    # fp32 keeps the kernel, and its numbers (the fp32 sums the eager twin makes too)
    x32 = x.float().requires_grad_()
    torch.testing.assert_close(combine_received(x32, layout, B, P, 0.5),
                               combine_received_eager(x32, layout, B, P, 0.5), rtol=0, atol=0)


def test_combine_received_refuses_a_layout_on_another_device(device):
    layout = exchange_layout([[0], [0, 1]], 2, META)
    with pytest.raises(ValueError, match=rf"^combine_received: x, layout\.src, .* must share one device, got x on "
                                         rf"{device.type}.*, layout\.src on meta"):
        combine_received(torch.zeros(6, 4, device=device), layout, 2, 2, 1.0)


def _sharded_double_check(rank: int) -> None:
    """A float64 sharded arch (made by .double(), as tests/test_sharded_embedding.py does) on the Triton path
    (kernel "triton": the path every CUDA run takes) equals the one-process float64 lookup exactly."""
    from dlrm.distributed.sharded_embedding import ShardedSparseArch
    from dlrm.distributed.sharding import plan_sharding
    from dlrm.model.archs import SparseArch

    cards, dim, batch = [12, 3], 2, 3
    plan = plan_sharding(cards, 2, "row", row_wise_min_rows=10, balance="lookups")
    torch.manual_seed(0)
    arch = ShardedSparseArch(cards, dim, plan, rank, kernel="triton").double()
    torch.manual_seed(0)
    full = SparseArch(cards, dim).double()
    with torch.no_grad():  # rows whose row-wise parts' float64 sum needs more than fp32's 24 bits
        full.weight.copy_(torch.arange(15, dtype=torch.float64).view(15, 1) * (1e8 + 0.3) + torch.rand(15, 2) / 7)
        offsets = [0, 12]
        for f, start, count, at in plan.local_layout(rank):
            arch.weight[at : at + count] = full.weight[offsets[f] + start : offsets[f] + start + count]
    raw = torch.tensor([[5, 0], [11, 1], [2, 2], [7, 0], [0, 1], [3, 2]])
    a, b = rank * batch, (rank + 1) * batch
    out = arch(raw[a:b], 2 * batch)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, full(raw)[a:b], rtol=0, atol=0)


# Two gloo ranks on the CPU run the Triton kernels under the interpreter, which is on only where there is no CUDA
# (tests/kernels/conftest.py); on a GPU machine their CPU tensors meet compiled kernels ("cannot be accessed from
# Triton"), and one GPU cannot host two NCCL ranks. CI (no GPU) runs it.
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU ranks need the Triton interpreter (no CUDA)")
def test_sharded_arch_in_float64_combines_in_float64(tmp_path):
    # the two ranks started through sys.executable (the prewarmed interpreter), not torch.multiprocessing.spawn:
    # tests/kernels/fastkern_ranks.py
    from tests.kernels.fastkern_ranks import failures_on_ranks

    failed = failures_on_ranks("tests.kernels.test_audit_kernelleft", "_sharded_double_check", 2, tmp_path)
    assert not failed, failed


# ----------------------------------------------------------------------------------------------------
# (2) the exchange's ids: every tensor on one device
# ----------------------------------------------------------------------------------------------------


def test_check_same_device_names_each_tensor_and_its_device():
    from kernels._backend import check_same_device

    with pytest.raises(ValueError, match=r"^f: a, c must share one device, got a on cpu, c on meta$"):
        check_same_device("f", a=torch.zeros(1), b=None, c=torch.zeros(1, device=META))
    check_same_device("f", a=torch.zeros(1), b=None, c=torch.zeros(2))  # one device: nothing said


@pytest.mark.parametrize("odd", ["slot_card", "slots[1]", "raw"])
def test_send_ids_refuses_tensors_of_another_device(device, odd):
    """A CPU slot table with CUDA ids (or the other way round) was read at the wrong device's addresses."""
    on = lambda name: META if name == odd else device  # noqa: E731
    raw = torch.zeros(2, 3, dtype=torch.int64, device=on("raw"))
    card = _i64([5, 7, 9], on("slot_card"))
    slots = [_i64([0, 2], on("slots[0]")), _i64([1], on("slots[1]"))]
    with pytest.raises(ValueError, match=r"^send_ids: raw, slot_card, slots\[0\], slots\[1\] must share one device, "
                                         rf"got .*{odd.replace('[', '.').replace(']', '.')} on meta"):
        send_ids(raw, card, slots, 2, False)


@pytest.mark.parametrize("odd", ["recv", "base", "count", "at"])
def test_local_ids_refuses_tensors_of_another_device(device, odd):
    on = lambda name: META if name == odd else device  # noqa: E731
    recv = torch.zeros(4, 2, dtype=torch.int64, device=on("recv"))
    base, count, at = (_i64(v, on(n)) for v, n in (([0, 3], "base"), ([3, 4], "count"), ([0, 3], "at")))
    with pytest.raises(ValueError, match=rf"^local_ids: recv, base, count, at must share one device, got .*{odd} on "
                                         r"meta"):
        local_ids(recv, base, count, at, True)


def test_exchange_ids_on_one_device_still_run(device):
    """The check costs the one-device case nothing: the ids come out as before (the reference values by hand)."""
    raw = _i64([[4, -1, 9], [0, 6, 2]], device)
    send = send_ids(raw, _i64([5, 7, 9], device), [_i64([0, 2], device), _i64([1], device)], 3, False)
    assert send.tolist() == [0, 1, 1, 3, -1, -1, 0, 0, -1]
    raw_ids, valid = local_ids(_i64([[0, 4], [2, 9]], device), _i64([0, 3], device), _i64([3, 4], device),
                               _i64([0, 3], device), True)
    assert raw_ids.tolist() == [[-1, 3], [1, -2]] and valid.tolist() == [[True, True], [True, False]]


# ----------------------------------------------------------------------------------------------------
# (3) the other launchers: float64 where the kernels compute in fp32, arguments on another device
# ----------------------------------------------------------------------------------------------------

F64_REFUSED = r"take float32, bfloat16 or float16 operands, got torch\.float64"


def test_loss_refuses_float64_logits(device):
    """The fused BCE computed float64 logits in fp32 and returned a float64 loss 8e-5 off at |z| ~ 1e3."""
    from kernels.loss import bce_backward, bce_forward, bce_with_logits

    z = torch.linspace(-1e3, 1e3, 37, dtype=torch.float64, device=device)
    y = (torch.arange(37, device=device) % 2).double()
    for call in (lambda: bce_forward(z, y, "none"), lambda: bce_with_logits(z, y, "mean"),
                 lambda: bce_backward(torch.ones((), dtype=torch.float64, device=device), z, y, "mean")):
        with pytest.raises(ValueError, match=rf"^the fused loss kernels {F64_REFUSED} \(torch\.nn\.functional\."
                                             r"binary_cross_entropy_with_logits"):
            call()
    # float32 logits with float64 labels stay fine (the labels are read as fp32 values either way)
    loss = bce_forward(z.float(), y, "none")
    ref = torch.nn.functional.binary_cross_entropy_with_logits(z.float().double(), y, reduction="none")
    torch.testing.assert_close(loss.double().cpu(), ref.cpu(), rtol=1e-6, atol=1e-5)


def test_loss_backward_refuses_a_gradient_of_another_device(device):
    from kernels.loss import bce_backward

    z, y = torch.zeros(5, device=device), torch.ones(5, device=device)
    with pytest.raises(ValueError, match=rf"^bce_backward: grad_out, logits must share one device, got grad_out on "
                                         rf"meta, logits on {device.type}"):
        bce_backward(torch.ones((), device=META), z, y, "mean")


def test_act_backward_refuses_float64_and_a_saved_tensor_of_another_device(device):
    """act_backward returned float64 gradients rounded to fp32 (5e-8 off at ~1); a saved tensor on another device was
    read at grad_out's device's addresses."""
    from kernels.epilogue import act_backward

    g = torch.randn(5, 7, dtype=torch.float64, device=device)
    with pytest.raises(ValueError, match=rf"^the fused epilogue kernels {F64_REFUSED}"):
        act_backward(g, g, "relu", False, bias_grad=True)
    with pytest.raises(ValueError, match=rf"^act_backward: grad_out, saved must share one device, got grad_out on "
                                         rf"{device.type}.*, saved on meta$"):
        act_backward(g.float(), torch.zeros(5, 7, device=META), "relu", False)
    gpre, _ = act_backward(g.float(), g.float(), "none", False)  # "none" never reads saved: nothing to refuse
    torch.testing.assert_close(gpre, g.float(), rtol=0, atol=0)


def test_fused_mlp_refuses_float64_at_its_forward(device):
    """The fused MLP's forward GEMMs ran float64 (torch's addmm), but the backward's mask kernel rounded every float64
    gradient to fp32 (4e-4 off at ~1e4): refused at the forward, in one line."""
    from kernels.mlp import fused_mlp, mask_bias_grad

    x = torch.randn(3, 5, dtype=torch.float64, device=device)
    w, b = torch.randn(6, 5, dtype=torch.float64, device=device), torch.randn(6, dtype=torch.float64, device=device)
    with pytest.raises(ValueError, match=rf"^the fused MLP's kernels {F64_REFUSED} \(the PyTorch MLPs"):
        fused_mlp(x, [w], [b], [True])
    with pytest.raises(ValueError, match=rf"^the fused MLP's mask kernel {F64_REFUSED}"):
        mask_bias_grad(x, x, True)
    with pytest.raises(ValueError, match=r"^mask_bias_grad: grad, out must share one device, .*out on meta$"):
        mask_bias_grad(x.float(), torch.zeros(3, 5, device=META), True)


def test_cross_backward_pass_refuses_float64(device):
    from kernels.cross_bwd_passes import cross_backward_pass, cross_backward_pass_reference

    g, t, x0 = (torch.randn(3, 4, dtype=torch.float64, device=device) * 1e4 for _ in range(3))
    with pytest.raises(ValueError, match=rf"^cross_backward_pass {F64_REFUSED} \(cross_backward_pass_reference"):
        cross_backward_pass(g, [t], x0)
    gpre, db, _ = cross_backward_pass_reference(g, [t], x0)  # the way out computes float64 exactly
    torch.testing.assert_close(gpre, (g + t) * x0, rtol=1e-15, atol=0)


def _tables(device, odd=None):
    on = lambda name: META if name == odd else device  # noqa: E731
    raw = torch.tensor([[0, 1, 2, 3], [4, -2, 5, 6]], device=on("raw"))
    return raw, _i64([6, 4], on("cardinalities")), _i64([0, 6], on("offsets"))


@pytest.mark.parametrize("odd", ["cardinalities", "offsets", "raw"])
def test_hashing_refuses_tables_of_another_device(device, odd):
    """The launchers behind the custom ops (what a CUDA dispatch runs: with a 'meta' argument the dispatcher would
    pick the ops' fake kernels instead, so the launchers are called here): the tables are read on raw's device."""
    from kernels.embedding.hashing import hash_rows_impl

    raw, card, off = _tables(device, odd)
    with pytest.raises(ValueError, match=rf"^hashed embedding kernels: raw, cardinalities, offsets must share one "
                                         rf"device, got .*{odd} on meta"):
        hash_rows_impl(raw[:, :2], card, off, None, None)


def test_embedding_lookups_refuse_a_weight_of_another_device(device):
    from kernels.embedding import pooled_layout
    from kernels.embedding.lookup import lookup_impl
    from kernels.embedding.pooled import pooled_lookup_impl

    raw, card, off = _tables(device)
    weight = torch.zeros(10, 2, device=META)
    with pytest.raises(ValueError, match=rf"^the embedding lookup: raw, weight must share one device, got raw on "
                                         rf"{device.type}.*, weight on meta$"):
        lookup_impl(raw[:, :2], weight, card, off, None, None)
    with pytest.raises(ValueError, match=r"^the pooled lookup: raw, weight must share one device, .*weight on meta$"):
        pooled_lookup_impl(raw, weight, card, off, *pooled_layout([3, 1], device), None, None)
    with pytest.raises(ValueError, match=r"^pooled embedding kernels: raw, .*hotness on meta"):
        pooled_lookup_impl(raw, torch.zeros(10, 2, device=device), card, off, *pooled_layout([3, 1], META), None, None)


def test_pooled_lookup_refuses_float64_tables(device):
    """Slots summed in fp32: a float64 table's pooled sums came back 3.9 off at ~1e9."""
    from kernels.embedding import pooled_embedding_lookup, pooled_layout

    raw, card, off = _tables(device)
    weight = (torch.arange(20, dtype=torch.float64, device=device) * (1e8 + 0.3)).view(10, 2) + 0.1
    with pytest.raises(ValueError, match=rf"^the pooled lookup kernels {F64_REFUSED}"):
        pooled_embedding_lookup(raw, weight, card, off, pooled_layout([3, 1], device))
    got = pooled_embedding_lookup(raw, weight.float(), card, off, pooled_layout([3, 1], device))
    want = weight.float().double()[[1, 2, 3]].sum(0)  # sample 0, feature 0: raw 0, 1, 2 -> rows 1, 2, 3
    torch.testing.assert_close(got[0, 0].double().cpu(), want.cpu(), rtol=1e-7, atol=0)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_sparse_update_refuses_float64_tables_and_gradients_of_another_device(device, optimizer):
    """The update computed in fp32 and stored into the float64 table: every row it touched was rounded to fp32
    (1e8 + 0.3 became 1e8, the step of 1e-4 lost)."""
    from kernels.embedding.update import (embedding_sparse_update_, empty_state, init_sparse_optimizer_state,
                                          sparse_update_impl)

    w = torch.full((4, 2), 1e8 + 0.3, dtype=torch.float64, device=device)
    rows, g = _i64([[1, 2]], device), torch.full((1, 2, 2), 1e-3, dtype=torch.float64, device=device)
    lr = torch.tensor(0.1, device=device)
    with pytest.raises(ValueError, match=rf"^the sparse embedding update kernels {F64_REFUSED}"):
        embedding_sparse_update_(rows, g, w, init_sparse_optimizer_state(optimizer, w), lr, optimizer)
    assert (w == 1e8 + 0.3).all()  # untouched
    w32 = w.float()  # the launcher behind the custom op (see test_hashing_refuses_tables_of_another_device)
    with pytest.raises(ValueError, match=r"^the sparse embedding update: rows, grad_out, weight.* grad_out on meta"):
        sparse_update_impl(rows, g.float().to(META), w32, init_sparse_optimizer_state(optimizer, w32)
                           if optimizer != "sgd" else empty_state(w32), lr, optimizer, 1e-10, True)


def test_dot_interaction_float64_gradient_of_the_dense_passthrough(device):
    """The interaction computes float64 in float64 (its tl.dot is typed by its operands), but the backward read the
    dense passthrough's gradient as fp32: the dense vector's gradient came back fp32-rounded (8e-4 off at 1e4)."""
    from kernels.interaction import dot_interaction, dot_interaction_reference

    g = torch.Generator().manual_seed(3)
    x64 = torch.randn(3, 4, 5, generator=g, dtype=torch.float64)
    x = x64.clone().to(device).requires_grad_()
    y = dot_interaction(x)
    grad = torch.randn(y.shape, generator=g, dtype=torch.float64) * 1e4 + 0.1
    y.backward(grad.to(device))
    ref = x64.clone().requires_grad_()
    dot_interaction_reference(ref).backward(grad)
    torch.testing.assert_close(x.grad.cpu(), ref.grad, rtol=1e-12, atol=1e-10)


def test_combine_fwd_reads_a_strided_block_through_its_strides(device):
    """`combine_fwd` (public, the forward launcher) read x at ``r * D`` whatever its strides: a column slice of a
    wider buffer was read as rows of the buffer."""
    from kernels.exchange_combine import combine_fwd

    served, F, B, P, D = [[0, 1], [1]], 2, 3, 3, 4
    wide = torch.randn(P * 3, 2 * D, generator=torch.Generator().manual_seed(1)).to(device)
    x = wide[:, 1 : 1 + D]
    assert not x.is_contiguous()
    layout = exchange_layout(served, F, device)
    torch.testing.assert_close(combine_fwd(x, layout, B, P), combine_received_eager(x.contiguous(), layout, B, P, 1.0),
                               rtol=0, atol=0)
