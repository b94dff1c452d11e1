"""kernels/cross_ws_bwd.py (the cross network's backward data-gradient GEMM with the next layer's elementwise work
in its epilogue) against a float64 reference. As for kernels/cross_ws.py: compiled for sm_90 on the CPU, compared
element by element on a Hopper GPU (marked gpu)."""

from __future__ import annotations

import pytest
import torch

cross_ws_bwd = pytest.importorskip("kernels.cross_ws_bwd", reason="this Triton has no Gluon Hopper dialect")
from kernels import cross_ws  # noqa: E402

def _compile(last: bool):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    M, N, K = 200, 136, 72
    cfg = cross_ws_bwd.default_config()
    mk = lambda r, c: torch.zeros(r, c, dtype=torch.bfloat16)  # noqa: E731
    g = mk(M, N)
    sub = [cfg.sub, cfg.bn]
    args = [cross_ws._desc(mk(M, K), [cfg.bm, cfg.bk]), cross_ws._desc(mk(K, N), [cfg.bk, cfg.bn]),
            cross_ws._desc(mk(cfg.bm, cfg.bn), [cfg.bm, cfg.bn])] + [cross_ws._desc(g, sub) for _ in range(4)]
    args += [g, g, g, N, M, N, K]
    fn = cross_ws_bwd._cross_bwd_coop_kernel
    sig = {name: mangle_type(value) for name, value in zip(fn.arg_names, args)}
    consts = {"STAGES": cfg.stages, "EPI_STAGES": cfg.epi_stages, "LAST": last, "MMA_WARPS": cfg.mma_warps,
              "MMA_REGS": cfg.mma_regs, "EPI_WARPS": cfg.epi_warps}
    sig.update({k: "constexpr" for k in consts})
    src = GluonASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg.epi_warps})


def compile_all() -> dict:
    """Both cases, compiled (run by test_cross_ws.py's `test_compiles_for_sm90` in a child process)."""
    from tests.kernels.gluon_compile import summary

    return {f"last={last}": summary(_compile(last)) for last in (False, True)}


# Compiled for sm_90 by test_cross_ws.py::test_compiles_for_sm90 (with `compile_all` above; until 2026-12-03 by a
# test here in a child process of its own): it asserts the two results and gluon_compile.check of them.


def test_shape_errors_name_the_operand():
    t = torch.zeros(4, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="pre"):
        cross_ws_bwd.cross_backward_ws(torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(8, 16, dtype=torch.bfloat16),
                                       t, t, torch.zeros(3, 16, dtype=torch.bfloat16), t.clone())


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _check(M, N, K, last, gen, num_sms=None):
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=gen, device="cuda") * scale).to(torch.bfloat16)  # noqa: E731
    du, v = r(M, K), r(K, N, scale=K ** -0.5)
    g, x0, pre, dx0 = r(M, N), r(M, N), r(M, N), r(M, N)
    d = lambda t: t.double()  # noqa: E731
    dx_ref = d(g) + d(du) @ d(v)
    mag_dx = d(g).abs() + d(du).abs() @ d(v).abs()
    dx0_before = dx0.clone()
    result = cross_ws_bwd.cross_backward_ws(du, v, g, x0, None if last else pre, dx0, num_sms=num_sms)
    # bf16's unit roundoff. ``du V``'s tile is staged in bf16 (rounded once) and each output rounded once more from
    # fp32: two roundings, so each bound is 2u times the magnitudes (one u failed dx at K = 16, where |du| |V| is
    # close to |du V|: measured up to 1.72u on an H200).
    u = 2.0**-8
    if last:
        assert result is None
        ref = d(dx0_before) + dx_ref
        assert ((d(dx0) - ref).abs() <= u * (d(dx0_before).abs() + mag_dx) * 2 + 1e-6).all()
        return
    dx, gpre = result
    assert ((d(dx) - dx_ref).abs() <= 2 * u * mag_dx + 1e-6).all()
    assert ((d(gpre) - dx_ref * d(x0)).abs() <= 2 * u * mag_dx * d(x0).abs() + 1e-6).all()
    ref0 = d(dx0_before) + dx_ref * d(pre)
    assert ((d(dx0) - ref0).abs() <= 2 * u * (d(dx0_before).abs() + mag_dx * d(pre).abs()) + 1e-6).all()


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("M,N,K", [(1, 8, 8), (3, 136, 72), (127, 136, 512), (1000, 264, 64), (4096, 3456, 512)])
@pytest.mark.parametrize("last", [False, True])
def test_matches_float64(M, N, K, last):
    _check(M, N, K, last, torch.Generator(device="cuda").manual_seed(M + N + K))


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("K", [16, 520])
@pytest.mark.parametrize("num_sms", [1, 3])
@pytest.mark.parametrize("last", [False, True])
def test_many_tiles_a_program_reuse_every_slot(K, num_sms, last):
    """1 or 3 programs take 53-160 tiles each (one K step, or 9 with a partial last one): the rings and the two
    staging slots go round many times (see tests/kernels/test_cross_ws.py's test of the same name)."""
    gen = torch.Generator(device="cuda").manual_seed(K + num_sms)
    for _ in range(3):
        _check(2000, 1160, K, last, gen, num_sms)
