"""kernels/cross_ws_head.py (the top MLP's first data-gradient GEMM with the cross network's top backward pass in its
epilogue) against a float64 reference: compiled for sm_90 on the CPU, compared element by element on a Hopper GPU
(marked gpu)."""

from __future__ import annotations

import pytest
import torch

cross_ws_head = pytest.importorskip("kernels.cross_ws_head", reason="this Triton has no Gluon Hopper dialect")
from kernels import cross_ws  # noqa: E402


def _compile():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    M, N, K = 200, 136, 72
    cfg = cross_ws_head.default_config()
    mk = lambda r, c: torch.zeros(r, c, dtype=torch.bfloat16)  # noqa: E731
    g = mk(M, N)
    args = [cross_ws._desc(mk(M, K), [cfg.bm, cfg.bk]), cross_ws._desc(mk(K, N), [cfg.bk, cfg.bn]),
            cross_ws._desc(g, [cfg.bm, cfg.bn]), cross_ws._desc(g, [cfg.sub, cfg.bn]),
            g, torch.zeros(2, N), N, M, N, K]
    fn = cross_ws_head._cross_head_kernel
    sig = {name: mangle_type(value) for name, value in zip(fn.arg_names, args)}
    consts = {"STAGES": cfg.stages, "EPI_STAGES": cfg.epi_stages, "MMA_WARPS": cfg.mma_warps,
              "MMA_REGS": cfg.mma_regs, "EPI_WARPS": cfg.epi_warps}
    sig.update({k: "constexpr" for k in consts})
    src = GluonASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg.epi_warps})


def compile_all() -> dict:
    """The kernel, compiled (run by test_cross_ws.py's `test_compiles_for_sm90` in a child process)."""
    from tests.kernels.gluon_compile import summary

    return {"head": summary(_compile())}


# Compiled for sm_90 by test_cross_ws.py::test_compiles_for_sm90 (with `compile_all` above; until 2026-12-03 by a
# test here in a child process of its own): it asserts the one result and gluon_compile.check of them.


def test_shape_errors_name_the_operands():
    t = torch.zeros(4, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="x0"):
        cross_ws_head.cross_head_ws(torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(8, 16, dtype=torch.bfloat16),
                                    torch.zeros(3, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="w"):
        cross_ws_head.cross_head_ws(torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(9, 16, dtype=torch.bfloat16), t)


def test_reference_is_the_pass_definition():
    """The reference is what the cross network's top pass and cuBLAS compute: G = gm @ w, g_pre = G * x0 rounded
    once more, db the fp32 column sums of the rounded g_pre (against float64, small integers: exact)."""
    gen = torch.Generator().manual_seed(0)
    gm, w, x0 = (torch.randint(-3, 4, s, generator=gen).float() for s in ((5, 8), (8, 16), (5, 16)))
    g, gpre, db = cross_ws_head.cross_head_reference(gm, w, x0)
    g64 = gm.double() @ w.double()
    assert torch.equal(g.double(), g64) and torch.equal(gpre.double(), g64 * x0.double())
    assert torch.equal(db.double(), (g64 * x0.double()).sum(0)) and db.dtype == torch.float32


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("M,N,K", [(1, 8, 8), (3, 136, 72), (127, 136, 1024), (1000, 264, 64), (4099, 3456, 1024)])
def test_matches_float64(M, N, K):
    gen = torch.Generator(device="cuda").manual_seed(M + N + K)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=gen, device="cuda") * scale).to(torch.bfloat16)  # noqa: E731
    gm, w, x0 = r(M, K), r(K, N, scale=K ** -0.5), r(M, N)
    g, gpre, db = cross_ws_head.cross_head_ws(gm, w, x0)
    d = lambda t: t.double()  # noqa: E731
    ref = d(gm) @ d(w)
    mag = d(gm).abs() @ d(w).abs()
    u = 2.0**-8  # bf16's unit roundoff; G rounded once from fp32, g_pre once more
    assert ((d(g) - ref).abs() <= u * mag + 1e-6).all()
    assert ((d(gpre) - ref * d(x0)).abs() <= 2.01 * u * mag * d(x0).abs() + 1e-6).all()
    # db sums the stored g_pre values in fp32: against their float64 sum, fp32 rounding of M terms
    exact = d(gpre).sum(0)
    assert ((d(db) - exact).abs() <= M * 2.0**-23 * d(gpre).abs().sum(0) + 1e-6).all()
    assert db.dtype == torch.float32
