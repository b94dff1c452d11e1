"""Mutation audit of kernels/cross_ws_op.py and kernels/cross_ws_net.py on the CPU: the gaps that the op and network
tests left open, each test killing mutants that survived them.

Audited: the ops' fake tensors against the real outputs (dtypes under mixed operand dtypes, strides for transposed
operands and gradients), the bias gradients' fp32 summation of the rounded 16-bit ``g_pre`` (single layer op, both
network backwards), the bias dtype handed to ``dlrm_kernels::cross_net_backward``, ``pre`` being non-differentiable,
the network's argument checks, and the dispatch predicates (`gluon_hopper_available`, `_hopper`, `_kernel_ok`,
`_passes_ok`), whose CUDA-only conditions are reached with a CPU tensor that says it is on CUDA and patched
capability probes.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("kernels.cross_ws", reason="this Triton has no Gluon Hopper dialect")

import kernels.cross_ws_net as net  # noqa: E402
import kernels.cross_ws_op as op  # noqa: E402
from kernels.cross_ws_net import (  # noqa: E402
    _cross_backward_first_op,
    _cross_backward_op,
    _cross_net_backward_op,
    cross_net_ws,
)
from kernels.cross_ws_op import _cross_layer_ws_op, cross_layer_ws  # noqa: E402

FAKE_ONLY = ("test_schema", "test_faketensor")


def _randn(*shape, dtype=torch.float32, seed=0, transposed=False):
    gen = torch.Generator().manual_seed(seed)
    if transposed:
        return torch.randn(*reversed(shape), generator=gen).to(dtype).t()
    return torch.randn(*shape, generator=gen).to(dtype)


def _bf16_sum_reference(g_pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact column sums of the (already rounded) 16-bit ``g_pre`` and a tolerance: fp32 accumulation over the
    rows (a few ulps of the sum of magnitudes), far below bf16's 2**-9 rounding of a sum kept in bf16."""
    g64 = g_pre.double()
    return g64.sum(0), 1e-6 * g64.abs().sum(0) + 1e-30


# ---------------------------------------------------------------- dlrm_kernels::cross_layer_ws: fake tensor metadata


@pytest.mark.parametrize("dtypes", [
    (torch.bfloat16, torch.bfloat16, torch.float32),  # out promotes to u's dtype
    (torch.bfloat16, torch.float32, torch.bfloat16),  # out promotes to x's dtype
    (torch.float32, torch.bfloat16, torch.bfloat16),  # out promotes to x0's dtype
], ids=["u-widest", "x-widest", "x0-widest"])
def test_layer_fake_promotes_every_operand(dtypes):
    """The fake's output dtype is the promotion of x0, x and u (each one the widest in turn); pre is in u's dtype."""
    dx0, dx, du = dtypes
    x0, x, u = _randn(3, 8, dtype=dx0), _randn(3, 8, dtype=dx, seed=1), _randn(3, 5, dtype=du, seed=2)
    w, b = _randn(8, 5, dtype=du, seed=3), _randn(8, seed=4)
    torch.library.opcheck(_cross_layer_ws_op, (x0, x, u, w, b), test_utils=FAKE_ONLY)


def test_layer_fake_strides_with_transposed_operands():
    """Transposed x0 and x: the op's outputs are contiguous, as the fake says (elementwise ops would follow x0)."""
    args = (_randn(7, 8, transposed=True), _randn(7, 8, seed=1, transposed=True), _randn(7, 3, seed=2),
            _randn(8, 3, seed=3), _randn(8, seed=4))
    torch.library.opcheck(_cross_layer_ws_op, args, test_utils=FAKE_ONLY)
    out, pre = _cross_layer_ws_op(*args)
    assert out.is_contiguous() and pre.is_contiguous()


def test_pre_is_not_differentiable():
    """``pre`` is a saved intermediate, marked non-differentiable: no graph hangs off it."""
    x0, x, u, w, b = (_randn(*s, dtype=torch.float64, seed=i).requires_grad_()
                      for i, s in enumerate([(3, 4), (3, 4), (3, 2), (4, 2), (4,)]))
    out, pre = torch.ops.dlrm_kernels.cross_layer_ws(x0, x, u, w, b)
    assert out.requires_grad and not pre.requires_grad and pre.grad_fn is None


# ------------------------------------------------ dlrm_kernels::cross_layer_ws: gradients under mixed dtypes (autocast)


@pytest.mark.parametrize("M", [1, 3, 127])
def test_layer_bias_gradient_sums_rounded_gpre_in_fp32(M):
    """The autocast layout (fp32 residual stream, bf16 GEMM operands, fp32 bias): ``g_pre`` is rounded to bf16 and
    the bias gradient is its fp32 column sum (not a bf16 sum, not a sum of the unrounded product); the data
    gradients in their inputs' dtypes, element by element against float64 of the same rounded operands."""
    N, K = 9, 4
    x0, x = _randn(M, N, seed=1).requires_grad_(), _randn(M, N, seed=2).requires_grad_()
    u, w = (_randn(M, K, dtype=torch.bfloat16, seed=3).requires_grad_(),
            _randn(N, K, dtype=torch.bfloat16, seed=4).requires_grad_())
    b = (_randn(N, seed=5) * 3).requires_grad_()
    g = _randn(M, N, seed=6) * 100  # large terms: a bf16 sum would be off by whole units
    out = cross_layer_ws(x0, x, u, w, b)
    assert out.dtype == torch.float32
    dx0, dx, du, dw, db = torch.autograd.grad(out, [x0, x, u, w, b], g)
    assert [t.dtype for t in (dx0, dx, du, dw, db)] == [torch.float32, torch.float32, torch.bfloat16,
                                                        torch.bfloat16, torch.float32]
    g_pre = (g * x0.detach()).bfloat16()
    want_db, tol_db = _bf16_sum_reference(g_pre)
    assert ((db.double() - want_db).abs() <= tol_db).all(), (db, want_db)
    # pre in bf16 as the eager module has it: the GEMM rounded to bf16, plus the bias cast to bf16, rounded again
    pre = ((u.detach().double() @ w.detach().double().t()).bfloat16().double()
           + b.detach().bfloat16().double()).bfloat16().double()
    torch.testing.assert_close(dx0.double(), g.double() * pre, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx, g, rtol=0, atol=0)
    torch.testing.assert_close(du.double(), g_pre.double() @ w.detach().double(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dw.double(), g_pre.double().t() @ u.detach().double(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("x0_dtype,x_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_layer_data_gradients_skip_the_other_inputs_dtype(x0_dtype, x_dtype):
    """x0 and x in different dtypes (fp32 output): x0's gradient ``g * pre`` and x's ``g`` are each cast only to their
    own input's dtype, never rounded through the other one's bf16 on the way."""
    M, N, K = 3, 8, 2
    x0 = (_randn(M, N, seed=1) * 1.01).to(x0_dtype).requires_grad_()
    x = (_randn(M, N, seed=2) * 1.01).to(x_dtype).requires_grad_()
    u, w, b = _randn(M, K, seed=3), _randn(N, K, seed=4), _randn(N, seed=5)
    g = _randn(M, N, seed=6) * 1.01
    out = cross_layer_ws(x0, x, u, w, b)
    assert out.dtype == torch.float32
    dx0, dx = torch.autograd.grad(out, [x0, x], g)
    pre = u @ w.t() + b
    # fp32 results to a few ulps (an extra bf16 rounding is 2**-9); bf16 ones to one bf16 step
    tol = lambda dt: (1e-6, 1e-6) if dt == torch.float32 else (2.0**-8, 0.0)  # noqa: E731
    torch.testing.assert_close(dx0, (g * pre).to(x0_dtype), rtol=tol(x0_dtype)[0], atol=tol(x0_dtype)[1])
    torch.testing.assert_close(dx, g.to(x_dtype), rtol=0, atol=0)


# -------------------------------------------------------------------- the network: fake tensors of the backward ops


def _net_args(M, N, K, L, dtype=torch.float32, b_dtype=torch.float32, transposed=()):
    x0 = _randn(M, N, dtype=dtype, transposed="x0" in transposed)
    return (_randn(M, N, dtype=dtype, seed=1, transposed="grad" in transposed), x0,
            [x0] + [_randn(M, N, dtype=dtype, seed=10 + i) for i in range(L - 1)],
            [_randn(M, K, dtype=dtype, seed=20 + i) for i in range(L)],
            [_randn(M, N, dtype=dtype, seed=30 + i) for i in range(L)],
            [_randn(K, N, dtype=dtype, seed=40 + i, transposed="v" in transposed) for i in range(L)],
            [_randn(N, K, dtype=dtype, seed=50 + i, transposed="w" in transposed) for i in range(L)], b_dtype)


def test_net_backward_fake_bias_gradients_in_the_bias_dtype():
    """bf16 activations with fp32 biases (GluonLowRankCrossNet's layout): the fake's bias gradients are fp32 [N]."""
    torch.library.opcheck(_cross_net_backward_op, _net_args(5, 8, 4, 2, dtype=torch.bfloat16), test_utils=FAKE_ONLY)


@pytest.mark.parametrize("transposed", [("grad",), ("x0",), ("v", "w")])
def test_net_backward_fake_strides_with_transposed_operands(transposed):
    """A transposed incoming gradient, x0 or weights: the real outputs' strides are the fake's (under torch.compile a
    mismatch fails Inductor's stride asserts or misreads the buffer). Failed before the fix in cross_ws_net."""
    torch.library.opcheck(_cross_net_backward_op, _net_args(5, 8, 4, 2, transposed=transposed),
                          test_utils=FAKE_ONLY)


def test_backward_ops_fake_strides_follow_their_operands():
    """``dlrm_kernels::cross_backward_ws``'s first two outputs follow g's layout, the third dx0's; the first-layer
    op's output follows dx0's (transposed g, then transposed dx0)."""
    r = lambda *s, seed=0, t=False: _randn(*s, seed=seed, transposed=t)  # noqa: E731
    torch.library.opcheck(_cross_backward_op, (r(5, 4), r(4, 8, seed=1), r(5, 8, seed=2, t=True), r(5, 8, seed=3),
                                               r(5, 8, seed=4), r(5, 8, seed=5)), test_utils=FAKE_ONLY)
    torch.library.opcheck(_cross_backward_first_op, (r(5, 4), r(4, 8, seed=1), r(5, 8, seed=2),
                                                     r(5, 8, seed=3, t=True)), test_utils=FAKE_ONLY)


# -------------------------------------------------------------------- the network: bias gradients in 16 bits


@pytest.mark.parametrize("backward", ["passes", "fused_gemm"])
@pytest.mark.parametrize("M", [1, 127])
def test_net_top_bias_gradient_is_an_fp32_sum_of_bf16_gpre(backward, M):
    """bf16 x0 and weights, fp32 biases: the top layer's ``g_pre = bf16(G * x0)`` is known exactly, and its bias
    gradient must be its fp32 column sum, returned in fp32 (not summed or handed back in bf16)."""
    N, K, L = 12, 3, 2
    x0 = _randn(M, N, dtype=torch.bfloat16).requires_grad_()
    vs = [(_randn(K, N, seed=1 + i) * N ** -0.5).bfloat16().requires_grad_() for i in range(L)]
    ws = [(_randn(N, K, seed=5 + i) * K ** -0.5).bfloat16().requires_grad_() for i in range(L)]
    bs = [_randn(N, seed=9 + i).requires_grad_() for i in range(L)]
    g = (_randn(M, N, seed=13) * 50).bfloat16()
    out = cross_net_ws(x0, vs, ws, bs, backward=backward)
    dbs = torch.autograd.grad(out, bs, g)
    assert all(d.dtype == torch.float32 for d in dbs)
    want, tol = _bf16_sum_reference((g.float() * x0.detach().float()).bfloat16())
    assert ((dbs[-1].double() - want).abs() <= tol).all(), (dbs[-1], want)


# -------------------------------------------------------------------- the network: argument checks


def test_net_refuses_biases_of_different_dtypes():
    """The backward hands one bias dtype to the backward op: biases of two dtypes are refused, named."""
    x0 = _randn(3, 8, dtype=torch.float64)
    vs, ws = [_randn(2, 8, dtype=torch.float64)] * 2, [_randn(8, 2, dtype=torch.float64)] * 2
    with pytest.raises(ValueError, match=r"cross_net_ws: the biases must share a dtype, got \[torch.float64, "
                                         r"torch.float32\]"):
        cross_net_ws(x0, vs, ws, [_randn(8, dtype=torch.float64), _randn(8)])


def test_net_refuses_an_unknown_backward_by_name():
    x0 = _randn(3, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"^cross_net_ws: backward must be 'fused_gemm' or 'passes', got 'layers'$"):
        cross_net_ws(x0, [_randn(2, 8, dtype=torch.float64)], [_randn(8, 2, dtype=torch.float64)],
                     [_randn(8, dtype=torch.float64)], backward="layers")


# -------------------------------------------------------------------- dispatch predicates


class _OnCuda:
    """A CPU tensor that says it is on CUDA (device ``index``): reaches the predicates' layout and dtype rules."""

    is_cuda = True

    def __init__(self, t: torch.Tensor, index: int = 0):
        self._t = t
        self.device = torch.device("cuda", index)

    def __getattr__(self, name):
        return getattr(self._t, name)


@pytest.fixture
def hopper(monkeypatch):
    """Make the Hopper and Gluon probes of both modules answer yes; returns the device indices _hopper was asked."""
    asked = []
    fake = lambda index: asked.append(index) or True  # noqa: E731
    for mod in (op, net):
        monkeypatch.setattr(mod, "_hopper", fake)
        monkeypatch.setattr(mod, "_gluon_importable", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return asked


def test_gluon_hopper_available_rules(hopper, monkeypatch):
    """A CPU device is never the Gluon kernel's, whatever the probes say; a CUDA device asks _hopper about its own
    index (0 when unnamed); without an importable Gluon module the answer is no."""
    assert not op.gluon_hopper_available(torch.device("cpu"))
    assert not op.gluon_hopper_available("cpu")
    assert op.gluon_hopper_available("cuda:1") and hopper[-1] == 1
    assert op.gluon_hopper_available(torch.device("cuda")) and hopper[-1] == 0
    monkeypatch.setattr(op, "_gluon_importable", lambda: False)
    assert not op.gluon_hopper_available("cuda:0")


@pytest.mark.parametrize("major,want", [(8, False), (9, True), (10, False), (12, False)])
def test_hopper_is_compute_capability_9_only(monkeypatch, major, want):
    """The Gluon kernels are written for sm_90 (wgmma, TMA): Blackwell (10, 12) and Ampere (8) are not Hopper."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (major, 0))
    assert op._hopper.__wrapped__(0) is want


def test_kernel_ok_layout_and_dtype_rules(hopper):
    """What the TMA kernels of the backward need of every operand: one 16-bit dtype (bf16 or fp16), 2-D, unit column
    stride, 16-byte rows and base address, a multiple of 8 columns."""
    bf = lambda *s: torch.zeros(*s, dtype=torch.bfloat16)  # noqa: E731
    ok = _OnCuda(bf(4, 8))
    assert net._kernel_ok(ok, _OnCuda(bf(6, 16)))
    assert net._kernel_ok(_OnCuda(torch.zeros(4, 8, dtype=torch.float16)))
    assert not net._kernel_ok(_OnCuda(torch.zeros(4, 8)))  # fp32
    assert not net._kernel_ok(ok, _OnCuda(torch.zeros(4, 8, dtype=torch.float16)))  # dtypes differ
    rows24 = bf(4, 12)[:, :8]  # 24-byte rows
    assert rows24.shape[1] % 8 == 0 and not net._kernel_ok(ok, _OnCuda(rows24))
    base = bf(4 * 8 + 8)
    shifted = base[1:33].view(4, 8)  # base address 2 bytes past a 16-byte boundary
    assert base.data_ptr() % 16 == 0 and not net._kernel_ok(ok, _OnCuda(shifted))
    assert net._kernel_ok(ok, _OnCuda(base[8:40].view(4, 8)))  # 16 bytes past it: fine
    strided = bf(4, 16)[:, ::2]  # 32-byte rows, 8 columns, column stride 2
    assert not net._kernel_ok(ok, _OnCuda(strided))
    narrow = bf(4, 8)[:, :4]  # 16-byte rows, 4 columns
    assert not net._kernel_ok(ok, _OnCuda(narrow))
    assert not net._kernel_ok(bf(4, 8))  # a plain CPU tensor
    assert net._kernel_ok(_OnCuda(bf(4, 8), index=1), ok) and hopper[-1] == 1  # the first operand's GPU is asked


def test_use_kernel_asks_the_inputs_gpu_and_the_kernels_rules(hopper, monkeypatch):
    """The layer op's dispatch: CPU operands never reach the kernel's rules; CUDA ones ask _hopper about x0's own GPU
    and then `kernels.cross_ws.supported`, whose verdict is the answer."""
    import kernels.cross_ws as cross_ws

    asked = []
    monkeypatch.setattr(cross_ws, "supported", lambda *a: asked.append(a) or "verdict")
    t = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert op._use_kernel(t, t, t, t) is False and not asked
    x0 = _OnCuda(t, index=2)
    assert op._use_kernel(x0, t, t, t) == "verdict" and hopper[-1] == 2 and asked[0][0] is x0


def test_passes_ok_rules(hopper):
    """The Triton passes take a CUDA gradient, a 16-bit x0 and at most MAX_TERMS + 1 layers (4)."""
    assert net.MAX_TERMS == 3
    x0 = torch.zeros(4, 8, dtype=torch.bfloat16)
    g = _OnCuda(x0)
    assert net._passes_ok(g, x0, 4) and net._passes_ok(g, x0, 1)
    assert not net._passes_ok(g, x0, 5)
    assert net._passes_ok(g, x0.half(), 2)
    assert not net._passes_ok(g, x0.float(), 2)
    assert not net._passes_ok(x0, x0, 2)  # the gradient on the CPU
