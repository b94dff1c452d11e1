"""kernels/cross_ws_op.py: the dlrm_kernels::cross_layer_ws op (forward and every gradient against float64), the
cross network module built on it against the eager LowRankCrossNet, and how configs choose it.

On the CPU the op runs its PyTorch arithmetic (the Gluon kernel needs a Hopper GPU): that checks the op's
schema, fake tensor and backward formula, and that the module is a drop-in twin of the eager one. The tests
marked gpu repeat the comparisons with the kernel, in bf16 under autocast and compiled.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("kernels.cross_ws", reason="this Triton has no Gluon Hopper dialect")

from dlrm.config import Config, ConfigError, KernelsConfig, ModelConfig, validate  # noqa: E402
from dlrm.model.archs import GluonLowRankCrossNet, LowRankCrossNet  # noqa: E402
from dlrm.model.dlrm import build_model  # noqa: E402
from kernels import TritonUnavailableError  # noqa: E402
from kernels._backend import interpret_mode  # noqa: E402
from kernels.cross_ws_op import _cross_layer_ws_op, cross_layer_ws  # noqa: E402


def _operands(M, N, K, dtype=torch.float64, device="cpu", seed=0, strided=False):
    gen = torch.Generator().manual_seed(seed)

    def make(*shape, scale=1.0):
        wide = strided and len(shape) == 2
        t = torch.randn(shape[0], shape[1] * 2, generator=gen) if wide else torch.randn(*shape, generator=gen)
        t = (t * scale).to(device=device, dtype=dtype)
        return t[:, ::2] if wide else t

    return make(M, N), make(M, N), make(M, K), make(N, K, scale=K ** -0.5), make(N)


@pytest.mark.parametrize("M,N,K", [(1, 1, 1), (3, 5, 2), (127, 12, 7)])
@pytest.mark.parametrize("same_x", [False, True])
def test_gradients_match_float64_autograd(M, N, K, same_x):
    """Every gradient of the op's backward formula against autograd through the plain expression (float64)."""
    x0, x, u, w, b = (t.requires_grad_() for t in _operands(M, N, K))
    if same_x:
        x = x0
    out = cross_layer_ws(x0, x, u, w, b)
    g = torch.randn(M, N, dtype=torch.float64)
    grads = torch.autograd.grad(out, [x0, u, w, b] if same_x else [x0, x, u, w, b], g)
    ref = x0 * (u @ w.t() + b) + x
    ref_grads = torch.autograd.grad(ref, [x0, u, w, b] if same_x else [x0, x, u, w, b], g)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_gradcheck_strided_operands():
    ops = [t.requires_grad_() for t in _operands(4, 6, 3, strided=True)]
    assert not ops[0].is_contiguous()
    assert torch.autograd.gradcheck(lambda *a: cross_layer_ws(*a), ops)


def test_opcheck_cpu():
    torch.library.opcheck(_cross_layer_ws_op, _operands(5, 8, 3, dtype=torch.float32))


@pytest.mark.parametrize("batch", [1, 3, 127])
@pytest.mark.parametrize("layers", [1, 3])
def test_module_is_a_twin_of_the_eager_cross_net(batch, layers):
    """Same parameters and state_dict keys; on the CPU the same outputs, bit for bit, and the same gradients (the
    input's to the last bits of fp32: autograd adds the residual path's terms to it in another order)."""
    torch.manual_seed(0)
    eager = LowRankCrossNet(12, layers, 4)
    for p in eager.bias:  # non-zero biases, so their path is exercised
        torch.nn.init.normal_(p)
    gluon = GluonLowRankCrossNet(12, layers, 4)
    gluon.load_state_dict(eager.state_dict())
    assert list(gluon.state_dict()) == list(eager.state_dict())
    x = torch.randn(batch, 24)[:, ::2].requires_grad_()  # non-contiguous input
    g = torch.randn(batch, 12)
    out_e = eager(x)
    out_e.backward(g)
    grads_e = [p.grad.clone() for p in eager.parameters()] + [x.grad.clone()]
    x.grad = None
    out_g = gluon(x)
    out_g.backward(g)
    grads_g = [p.grad for p in gluon.parameters()] + [x.grad]
    assert torch.equal(out_g, out_e)
    for a, b in zip(grads_g[:-1], grads_e[:-1]):
        assert torch.equal(a, b)
    torch.testing.assert_close(grads_g[-1], grads_e[-1], rtol=2e-6, atol=2e-6)


def test_fp32_input_under_bf16_autocast_keeps_the_eager_dtypes():
    """An fp32 input under bf16 autocast: the eager module's residual stream stays fp32 (promotion); so does the
    Gluon module's (the op's PyTorch path), with the same outputs and gradients."""
    torch.manual_seed(0)
    eager = LowRankCrossNet(16, 2, 8)
    for p in eager.bias:
        torch.nn.init.normal_(p)
    gluon = GluonLowRankCrossNet(16, 2, 8)
    gluon.load_state_dict(eager.state_dict())
    x = torch.randn(5, 16)
    g = torch.randn(5, 16)
    outs, grads = [], []
    for net in (eager, gluon):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = net(xi)
        out.backward(g)
        outs.append(out)
        grads.append([p.grad for p in net.parameters()] + [xi.grad])
    assert outs[0].dtype == outs[1].dtype == torch.float32
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    names = [n for n, _ in eager.named_parameters()] + ["input"]
    for name, a, b in zip(names, *grads):
        assert a.dtype == b.dtype, name
        if name.startswith("bias"):  # the eager graph sums the bf16 bias gradient into bf16; the op sums in fp32
            torch.testing.assert_close(a, b, rtol=2.0**-7, atol=0, msg=name)
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)


def test_opcheck_mixed_dtypes():
    x0, x, u, w, b = _operands(5, 8, 3, dtype=torch.float32)
    torch.library.opcheck(_cross_layer_ws_op, (x0, x, u.bfloat16(), w.bfloat16(), b))


def test_config_refuses_gluon_for_the_dot_interaction():
    cfg = Config(model=ModelConfig(interaction="dot"), kernels=KernelsConfig(interaction="gluon"))
    with pytest.raises(ConfigError, match="kernels.interaction"):
        validate(cfg)


def test_forced_gluon_without_a_hopper_gpu_is_an_error():
    cfg = ModelConfig(embedding_dim=8, bottom_mlp=[16, 8], top_mlp=[16, 1], interaction="dcn", cross_layers=1,
                      cross_rank=4)
    with pytest.raises(TritonUnavailableError) as info:
        build_model(cfg, [10] * 26, device=torch.device("cpu"), kernels=KernelsConfig(interaction="gluon"))
    # under the interpreter (no CUDA) the Triton embedding can run on the CPU and the Gluon choice is what fails; on a
    # CUDA machine without TRITON_INTERPRET the CPU build fails one check earlier, with its own one-line reason
    if interpret_mode():
        assert "Hopper" in str(info.value)


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
def test_opcheck_gpu():
    ops = [t.to(torch.bfloat16) for t in _operands(300, 264, 64, dtype=torch.float32, device="cuda")]
    torch.library.opcheck(_cross_layer_ws_op, ops)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("batch", [1, 3, 127, 1000])
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("backward", ["layers", "fused_gemm", "passes"])
def test_module_matches_eager_in_bf16(batch, compiled, backward, monkeypatch):
    """The Gluon module against the eager one under bf16 autocast (both round the product once more or less than
    the other), and both against float64: the Gluon one is no further from float64 than twice the eager one's
    error plus bf16's unit roundoff on the outputs' scale. With the per-layer ops and with the whole network as one
    function, either backward (`kernels.cross_ws_net.BACKWARD`)."""
    from kernels import cross_ws_net

    monkeypatch.setattr(cross_ws_net, "BACKWARD", backward)
    torch.manual_seed(0)
    N, r = 264, 64
    eager = LowRankCrossNet(N, 3, r).cuda()
    for p in eager.bias:
        torch.nn.init.normal_(p, std=0.1)
    gluon = copy.deepcopy(eager)
    gluon.__class__ = GluonLowRankCrossNet
    ref = copy.deepcopy(eager).double()
    x = torch.randn(batch, N, device="cuda").to(torch.bfloat16)
    g = torch.randn(batch, N, device="cuda").to(torch.bfloat16)
    results = {}
    for name, net in (("eager", eager), ("gluon", gluon)):
        fn = torch.compile(net) if compiled else net
        xi = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = fn(xi)
        out.backward(g)
        results[name] = [out.double()] + [p.grad.double() for p in net.parameters()] + [xi.grad.double()]
    xr = x.double().requires_grad_()
    out_r = ref(xr)
    out_r.backward(g.double())
    want = [out_r] + [p.grad for p in ref.parameters()] + [xr.grad]
    for i, (e, gl_, r_) in enumerate(zip(results["eager"], results["gluon"], want)):
        err_e = (e - r_).abs().max().item()
        err_g = (gl_ - r_).abs().max().item()
        scale = r_.abs().max().item()
        assert err_g <= 2 * err_e + 2.0**-8 * scale, f"tensor {i}: gluon {err_g:.3g}, eager {err_e:.3g}, scale {scale:.3g}"
