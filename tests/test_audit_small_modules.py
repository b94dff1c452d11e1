"""Audit of small modules: graceful signals, masked lookups, DDP's dense parts, the fused-update switch, the
sparse-arch protocol. Each test pins a behaviour that an existing test left open (found by mutation testing).

* `dlrm.train.signals.GracefulStop`: a second, different signal exits with its own code; the SystemExit leaves the
  ``with`` block and the handlers are back; off the main thread nothing is touched; no other signal is taken.
* `dlrm.model.masked_lookup`: a bf16 table gives bf16 lookups, against a float64 reference on the kept subset.
* `dlrm.distributed.data_parallel`: the DDP wrapper trains the model's own dense modules (gradients against the
  one-process model's); stateful buffers are named by their full path, also at the top level and nested deeper;
  a ``constant_buffers`` declaration covers its own module's buffers only.
* `kernels.embedding.fused_switch.FusedUpdateSwitch`: the trigger follows ``.to()`` (the meta device stands in for
  a second device on a CPU-only machine), stays off when the fused update is off, and the weight stays frozen.
* `dlrm.model.interfaces.SparseArchInterface`: every one of the three flags is required.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dlrm.config import ModelConfig
from dlrm.distributed.data_parallel import (
    DenseParts,
    stateful_buffers,
    wrap_dense_parts,
)
from dlrm.model.dlrm import build_model
from dlrm.model.fused_sparse import FusedUpdateSparseArch
from dlrm.model.interfaces import SparseArchInterface
from dlrm.model.masked_lookup import masked_embedding, masked_embedding_bag
from dlrm.train.signals import GracefulStop
from kernels.embedding import SparseOptimizerConfig

# ---------------------------------------------------------------------------------------------
# GracefulStop


@pytest.fixture
def saved_handlers():
    """Whatever a test does to the handlers of SIGINT/SIGTERM/SIGUSR1, they are put back afterwards."""
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
    before = {s: signal.getsignal(s) for s in sigs}
    yield before
    for s, h in before.items():
        signal.signal(s, h)


def _signal_self(sig: int) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.05)  # the handler runs between bytecodes of the main thread


def test_sigint_then_sigterm_exits_with_the_second_signals_code(saved_handlers):
    """The first signal is kept (130: the checkpoint exit would report SIGINT); the second, a different one, stops
    at once with 128 + its own number (143), as a shell reports the signal that ended a process."""
    with pytest.raises(SystemExit) as exc, GracefulStop() as stop:
        _signal_self(signal.SIGINT)
        assert stop.requested and stop.signum == signal.SIGINT and stop.exit_code == 130
        _signal_self(signal.SIGTERM)
        pytest.fail("the second signal did not stop the block")
    assert exc.value.code == 143
    assert stop.signum == signal.SIGINT and stop.exit_code == 130  # the first signal is not overwritten
    for s in (signal.SIGINT, signal.SIGTERM):
        assert signal.getsignal(s) is saved_handlers[s]


def test_second_signal_leaves_the_block_and_the_previous_handler_is_back(saved_handlers):
    """The SystemExit of the second signal is not swallowed by __exit__, and a custom previous handler (not only the
    default one) is what the block restores."""
    seen = []
    custom = lambda signum, frame: seen.append(signum)
    signal.signal(signal.SIGTERM, custom)
    reached_after = False
    with pytest.raises(SystemExit) as exc:
        with GracefulStop():
            _signal_self(signal.SIGTERM)
            _signal_self(signal.SIGTERM)
        reached_after = True
    assert exc.value.code == 128 + signal.SIGTERM and not reached_after
    assert signal.getsignal(signal.SIGTERM) is custom
    _signal_self(signal.SIGTERM)  # the restored handler is live: it gets the next signal
    assert seen == [signal.SIGTERM]


def test_outside_the_main_thread_signals_are_left_alone(saved_handlers):
    """Python allows signal.signal only in the main thread: elsewhere GracefulStop installs nothing, raises
    nothing, and its flag stays down."""
    result = {}

    def body():
        try:
            with GracefulStop() as stop:
                result["inside"] = {s: signal.getsignal(s) for s in GracefulStop.SIGNALS}
            result["requested"] = stop.requested
        except BaseException as e:  # noqa: BLE001 -- reported to the main thread
            result["error"] = e

    t = threading.Thread(target=body)
    t.start()
    t.join(10)
    assert "error" not in result, result.get("error")
    assert result["inside"] == {s: saved_handlers[s] for s in GracefulStop.SIGNALS}
    assert result["requested"] is False


def test_only_sigint_and_sigterm_are_taken(saved_handlers):
    """Other signals keep their handlers inside the block (SIGUSR1's default still applies, say)."""
    with GracefulStop():
        assert signal.getsignal(signal.SIGUSR1) is saved_handlers[signal.SIGUSR1]
        assert signal.getsignal(signal.SIGINT) is not saved_handlers[signal.SIGINT]
        assert signal.getsignal(signal.SIGTERM) is not saved_handlers[signal.SIGTERM]


# ---------------------------------------------------------------------------------------------
# masked lookups on a bf16 table


def test_masked_lookups_of_a_bf16_table_stay_bf16():
    """A bf16 table's lookups are bf16 (the mask must not promote them to fp32), and equal to the float64 reference
    rounded once: each one-hot output is a row or zero; each bag sums kept rows in fp32 inside embedding_bag."""
    gen = torch.Generator().manual_seed(3)
    R, D, N = 11, 6, 17
    w64 = torch.randn(R, D, generator=gen, dtype=torch.float64)
    rows = torch.randint(0, R, (N,), generator=gen)
    keep = torch.rand(N, generator=gen) < 0.6
    keep[0], keep[1] = True, False
    weight = nn.Parameter(w64.to(torch.bfloat16))
    wb = weight.detach().double()  # the bf16 values, exactly

    out = masked_embedding(rows, weight, keep)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out.double(), wb[rows] * keep.unsqueeze(-1))
    grad = torch.randn(N, D, generator=gen, dtype=torch.float64).to(torch.bfloat16)
    out.backward(grad)
    assert weight.grad.dtype == torch.bfloat16
    ref = torch.zeros(R, D, dtype=torch.float64).index_add_(0, rows[keep], grad.double()[keep])
    torch.testing.assert_close(weight.grad.coalesce().to_dense().double(), ref, rtol=2e-2, atol=2e-2)

    bag = torch.tensor([0] * 5 + [1] * 7 + [2] * 5)
    starts = torch.tensor([0, 5, 12])
    weight.grad = None
    pooled = masked_embedding_bag(rows, weight, keep, starts, bag)
    assert pooled.dtype == torch.bfloat16
    # the reference: F.embedding_bag without a mask on the kept lookups only
    kept = keep.nonzero().squeeze(1)
    counts = torch.bincount(bag[kept], minlength=3)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)[:-1]])
    ref_pooled = F.embedding_bag(rows[kept], wb, offsets, mode="sum")
    torch.testing.assert_close(pooled.double(), ref_pooled, rtol=1e-2, atol=2e-2)


# ---------------------------------------------------------------------------------------------
# DDP over the dense parts


@pytest.fixture
def one_rank(tmp_path):
    """A one-process gloo group (DDP needs a process group), removed after the test."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _model(interaction: str = "dot"):
    torch.manual_seed(0)
    cfg = ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1], interaction=interaction)
    return build_model(cfg, [5] * 26, device="cpu").double()


@pytest.mark.parametrize("interaction", ["dot", "dcn"])
def test_ddp_trains_the_models_own_dense_modules(one_rank, interaction):
    """The wrapper's backward puts the gradients on the model's own dense parameters (the optimizer steps those,
    and the checkpoint saves them), equal to the one-process model's; the embeddings get the same gradient too."""
    model = _model(interaction)
    gen = torch.Generator().manual_seed(1)
    dense = torch.randn(5, 13, generator=gen, dtype=torch.float64)
    emb = torch.randn(5, 26, 4, generator=gen, dtype=torch.float64)
    dense_names = [n for n, _ in model.named_parameters() if not n.startswith("sparse_arch")]
    params = dict(model.named_parameters())

    e_ref = emb.clone().requires_grad_(True)
    model.forward_from_embeddings(dense, e_ref).square().sum().backward()
    ref = {n: params[n].grad.clone() for n in dense_names}
    model.zero_grad(set_to_none=True)

    ddp = wrap_dense_parts(model, torch.device("cpu"))
    e = emb.clone().requires_grad_(True)
    ddp(dense, e).square().sum().backward()
    assert dense_names and all(params[n].grad is not None for n in dense_names)
    for n in dense_names:
        torch.testing.assert_close(params[n].grad, ref[n], rtol=1e-12, atol=1e-12, msg=n)
    torch.testing.assert_close(e.grad, e_ref.grad, rtol=1e-12, atol=1e-12)


def test_stateful_buffer_names_are_full_paths():
    """A buffer on the parts themselves is named without a leading dot; one nested below a child gets its whole
    path; the interaction's declared constants are left out."""
    parts = DenseParts(_model())
    parts.register_buffer("steps", torch.zeros(()))
    nested = next(m for m in parts.over_arch.modules() if m is not parts.over_arch)
    nested_name = next(n for n, m in parts.over_arch.named_modules() if m is nested)
    nested.register_buffer("running_var", torch.ones(3))
    assert sorted(stateful_buffers(parts)) == sorted(["steps", f"over_arch.{nested_name}.running_var"])


def test_constant_buffers_cover_their_own_module_only():
    """A module's ``constant_buffers`` says which of *its* buffers are constants: a buffer of the same name on
    another module (or declared on the parent, not on the module that holds it) is still stateful."""
    parts = DenseParts(_model())
    interaction = parts.interaction_arch
    assert set(getattr(interaction, "constant_buffers", ())) >= {"tril_rows"}
    parts.over_arch.register_buffer("tril_rows", torch.zeros(2))
    assert stateful_buffers(parts) == ["over_arch.tril_rows"]

    root = nn.Module()
    root.constant_buffers = ("table",)
    root.child = nn.Module()
    root.child.register_buffer("table", torch.zeros(1))
    root.register_buffer("table", torch.zeros(1))
    assert stateful_buffers(root) == ["child.table"]
    with pytest.raises(ValueError, match=r"over_arch\.tril_rows"):
        model = _model()
        model.over_arch.register_buffer("tril_rows", torch.zeros(2))
        wrap_dense_parts(model, torch.device("cpu"))


# ---------------------------------------------------------------------------------------------
# FusedUpdateSwitch


def _fused_arch() -> FusedUpdateSparseArch:
    arch = FusedUpdateSparseArch([7, 3], 4)
    arch.use_fused_update(SparseOptimizerConfig("sgd", torch.tensor([0.1])))
    return arch


def test_trigger_follows_the_weight_across_to():
    """.to(device) makes a fresh trigger on the weight's new device (meta here), zero-size and requiring grad; the
    weight stays frozen and the state_dict stays {"weight"}."""
    arch = _fused_arch()
    old = arch._grad_trigger
    arch.to("meta")
    t = arch._grad_trigger
    assert arch.weight.device.type == "meta" and t.device.type == "meta"
    assert t is not old and t.shape == (0,) and t.requires_grad and t.is_leaf
    assert arch.weight.requires_grad is False and list(arch.state_dict()) == ["weight"]
    assert [n for n, _ in arch.named_parameters()] == ["weight"] and all(b is not t for b in arch.buffers())


def test_dtype_conversion_keeps_the_switch_as_it_was():
    """.double() keeps a fused arch fused (trigger present, weight frozen, the update still applied in backward),
    and gives an arch whose fused update is off no trigger."""
    arch = _fused_arch().double()
    assert arch.weight.dtype == torch.float64 and arch.weight.requires_grad is False
    assert arch._grad_trigger is not None and arch._grad_trigger.requires_grad
    before = arch.weight.detach().clone()
    raw = torch.tensor([[2, 1]])
    rows = arch.rows(raw).reshape(-1)
    arch(raw).sum().backward()
    expected = before.clone()
    # SGD with the fp32 lr 0.1 and a gradient of ones on each looked-up row (two distinct rows)
    expected[rows] -= torch.tensor(0.1).double()
    assert rows.unique().numel() == 2 and arch.weight.grad is None
    torch.testing.assert_close(arch.weight.detach(), expected, rtol=0, atol=1e-12)

    plain = FusedUpdateSparseArch([7, 3], 4)
    plain.use_fused_update(SparseOptimizerConfig("sgd", torch.tensor([0.1])))
    plain.use_fused_update(None)
    plain.double()
    assert plain._grad_trigger is None and plain.weight.requires_grad and plain.fused_update is None


# ---------------------------------------------------------------------------------------------
# SparseArchInterface


class _Arch:
    compilable = False
    collective = False
    fused_optimizer = False

    def __call__(self, raw, global_batch=None):
        return raw


@pytest.mark.parametrize("missing", ["compilable", "collective", "fused_optimizer"])
def test_every_interface_flag_is_required(missing):
    """The step, optimizers and graph capture read all three flags: an arch that states two is not one."""
    assert isinstance(_Arch(), SparseArchInterface)
    partial = type("Partial", (), {k: v for k, v in vars(_Arch).items() if k != missing})
    assert not isinstance(partial(), SparseArchInterface)
