"""kernels/cross_ws_net.py: the cross network as one autograd function, with either backward ("fused_gemm": its
data-gradient GEMMs carry the next layer's elementwise work; "passes": cuBLAS GEMMs and the Triton passes of
kernels/cross_bwd_passes.py), against plain autograd in float64 on the CPU (the ops' PyTorch arithmetic), eager and
compiled; the backward ops' schemas and fake tensors; on a Hopper GPU (marked gpu) the kernels' path in bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("kernels.cross_ws", reason="this Triton has no Gluon Hopper dialect")

from kernels.cross_ws_net import (  # noqa: E402
    _cross_backward_first_op,
    _cross_backward_op,
    _cross_net_backward_op,
    cross_net_ws,
)

BACKWARDS = ["fused_gemm", "passes"]


def _params(M, N, K, L, dtype=torch.float64, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale).to(device=device, dtype=dtype)  # noqa: E731
    x0 = r(M, N)
    vs = [r(K, N, scale=N ** -0.5) for _ in range(L)]
    ws = [r(N, K, scale=K ** -0.5) for _ in range(L)]
    bs = [r(N) for _ in range(L)]
    return x0, vs, ws, bs


def _plain(x0, vs, ws, bs):
    x = x0
    for v, w, b in zip(vs, ws, bs):
        x = x0 * (F.linear(F.linear(x, v), w) + b) + x
    return x


@pytest.mark.parametrize("M", [1, 3, 127])
@pytest.mark.parametrize("L", [1, 3, 5])
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("backward", BACKWARDS)
def test_every_gradient_matches_plain_autograd_in_float64(M, L, compiled, backward):
    x0, vs, ws, bs = _params(M, 12, 5, L)
    params = [t.requires_grad_() for t in (x0, *vs, *ws, *bs)]
    g = torch.randn(M, 12, dtype=torch.float64)
    if compiled:
        torch._dynamo.reset()  # a fresh compile for each case: the parametrizations exceed dynamo's recompile limit
    fn = torch.compile(cross_net_ws, fullgraph=True) if compiled else cross_net_ws
    out = fn(x0, vs, ws, bs, backward=backward)
    got = torch.autograd.grad(out, params, g)
    ref_out = _plain(x0, vs, ws, bs)
    want = torch.autograd.grad(ref_out, params, g)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("backward", BACKWARDS)
def test_non_contiguous_incoming_gradient(backward):
    x0, vs, ws, bs = _params(9, 8, 3, 2)
    params = [t.requires_grad_() for t in (x0, *vs, *ws, *bs)]
    g = torch.randn(8, 9, dtype=torch.float64).t()
    got = torch.autograd.grad(cross_net_ws(x0, vs, ws, bs, backward=backward), params, g)
    want = torch.autograd.grad(_plain(x0, vs, ws, bs), params, g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)


def _net_backward_args(M, N, K, L, dtype=torch.float32, device="cpu"):
    r = lambda *s: torch.randn(*s, device=device).to(dtype)  # noqa: E731
    x0 = r(M, N)
    return (r(M, N), x0, [x0] + [r(M, N) for _ in range(L - 1)], [r(M, K) for _ in range(L)],
            [r(M, N) for _ in range(L)], [r(K, N) for _ in range(L)], [r(N, K) for _ in range(L)], torch.float32)


def test_backward_ops_opcheck_cpu():
    r = lambda *s: torch.randn(*s)  # noqa: E731
    torch.library.opcheck(_cross_backward_op, (r(5, 4), r(4, 8), r(5, 8), r(5, 8), r(5, 8), r(5, 8)))
    torch.library.opcheck(_cross_backward_first_op, (r(5, 4), r(4, 8), r(5, 8), r(5, 8)))
    torch.library.opcheck(_cross_net_backward_op, _net_backward_args(5, 8, 4, 3))


def test_unknown_backward_is_refused():
    x0, vs, ws, bs = _params(3, 8, 2, 1)
    with pytest.raises(ValueError, match="backward must be"):
        cross_net_ws(x0, vs, ws, bs, backward="layers")


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
def test_backward_ops_opcheck_gpu():
    r = lambda *s: torch.randn(*s, device="cuda").to(torch.bfloat16)  # noqa: E731
    torch.library.opcheck(_cross_backward_op, (r(300, 64), r(64, 264), r(300, 264), r(300, 264), r(300, 264),
                                               r(300, 264)))
    torch.library.opcheck(_cross_backward_first_op, (r(300, 64), r(64, 264), r(300, 264), r(300, 264)))
    torch.library.opcheck(_cross_net_backward_op, _net_backward_args(300, 264, 64, 3, torch.bfloat16, "cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("M", [1, 127, 4096])
@pytest.mark.parametrize("backward", BACKWARDS)
def test_bf16_kernels_against_float64(M, backward):
    """The Gluon path (bf16) against float64: each gradient within bf16 roundings of the float64 one, on the scale
    of the float64 gradients' magnitudes."""
    N, K, L = 264, 64, 3
    x0, vs, ws, bs = _params(M, N, K, L, dtype=torch.float32, device="cuda", seed=M)
    low = [t.to(torch.bfloat16) for t in (x0, *vs, *ws)] + [b.clone() for b in bs]
    params = [t.requires_grad_() for t in low]
    g = torch.randn(M, N, device="cuda").to(torch.bfloat16)
    out = cross_net_ws(params[0], params[1:1 + L], params[1 + L:1 + 2 * L], params[1 + 2 * L:], backward=backward)
    got = torch.autograd.grad(out, params, g)
    ref_params = [t.detach().double().requires_grad_() for t in low]
    ref_out = _plain(ref_params[0], ref_params[1:1 + L], ref_params[1 + L:1 + 2 * L], ref_params[1 + 2 * L:])
    want = torch.autograd.grad(ref_out, ref_params, g.double())
    assert (out.double() - ref_out).abs().max() <= 2.0**-5 * ref_out.abs().max()
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == low[i].dtype
        assert (a.double() - b).abs().max() <= 2.0**-5 * b.abs().max() + 1e-6, i
