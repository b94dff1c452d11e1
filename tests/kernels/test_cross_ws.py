"""kernels/cross_ws.py (the warp-specialized Gluon cross-layer forward) against a float64 reference.

Gluon has no interpreter: on the CPU the kernel is compiled for sm_90 with the installed Triton (every
schedule, each constexpr flag both ways: an API change in a new Triton release fails here, not on the GPU machine); the
element-by-element comparisons run on a Hopper GPU (marked gpu).
"""

from __future__ import annotations

import pytest
import torch

cross_ws = pytest.importorskip("kernels.cross_ws", reason="this Triton has no Gluon Hopper dialect")

def _signature(fn, args):
    from triton.runtime.jit import mangle_type

    return {name: mangle_type(value) for name, value in zip(fn.arg_names, args)}


CONFIGS = {
    "pingpong": cross_ws.WsConfig(bm=64, stages=4, schedule="pingpong"),
    "coop": cross_ws.WsConfig(),  # the default: what dlrm_kernels::cross_layer_ws runs (H100)
    "coop-sub64": cross_ws.WsConfig(sub=64, epi_stages=1),  # `default_config` on an H200
}


def _compile(schedule: str, x_is_x0: bool, store_pre: bool):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    M, N, K = 200, 136, 72
    cfg = CONFIGS[schedule]
    x0 = torch.zeros(M, N, dtype=torch.bfloat16)
    u = torch.zeros(M, K, dtype=torch.bfloat16)
    w = torch.zeros(N, K, dtype=torch.bfloat16)
    tile = [cfg.bm, cfg.bn]
    descs = [cross_ws._desc(u, [cfg.bm, cfg.bk]), cross_ws._desc(w, [cfg.bn, cfg.bk])]
    consts = {"STAGES": cfg.stages, "X_IS_X0": x_is_x0, "STORE_PRE": store_pre}
    if cfg.schedule == "coop":
        fn = cross_ws._cross_fwd_coop_kernel
        sub = [cfg.sub, cfg.bn]
        args = descs + [cross_ws._desc(x0, tile), cross_ws._desc(x0, sub), cross_ws._desc(x0, sub), x0,
                        torch.zeros(N), N, M, N, K]
        consts.update(EPI_STAGES=cfg.epi_stages, MMA_WARPS=cfg.mma_warps, MMA_REGS=cfg.mma_regs,
                      EPI_WARPS=cfg.epi_warps)
    else:
        fn = cross_ws._cross_fwd_ws_kernel
        args = descs + [cross_ws._desc(x0, tile) for _ in range(4)] + [torch.zeros(N), M, N, K]
        consts.update(CONSUMER_REGS=cfg.consumer_regs)
    sig = _signature(fn, args)
    sig.update({k: "constexpr" for k in consts})
    src = GluonASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    warps = cfg.epi_warps if cfg.schedule == "coop" else 4
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


# Each kernel compiled with each value of each constexpr flag (not every combination: the 12 compiles of every schedule
# with every pair of flags took a minute of CI's two cores, each compile ptxas's, for branches these four already reach)
COMPILED = [("pingpong", False, True), ("pingpong", True, False), ("coop", True, True), ("coop-sub64", False, False)]


def compile_all() -> dict:
    """Every schedule, and each kernel with each value of its constexpr flags, compiled (run by `test_compiles_for_sm90`
    in a child process, through `compile_all_modules`)."""
    from tests.kernels.gluon_compile import summary

    return {f"{s} x_is_x0={x} store_pre={p}": summary(_compile(s, x, p)) for s, x, p in COMPILED}


# The test modules whose `compile_all` compiles the kernels of kernels/cross_ws*.py: `test_compiles_for_sm90` compiles
# them all in one child process. One child for each module (until 2026-12-03) paid three times what a child pays before
# its first kernel is compiled (importing torch and Triton, Triton's setup on its first compile): with an empty Triton
# cache the three took 28 s under pytest, one child for all of them 16 s.
GLUON_TEST_MODULES = (
    "tests.kernels.test_cross_ws", "tests.kernels.test_cross_ws_bwd", "tests.kernels.test_cross_ws_head",
)


def compile_all_modules() -> dict:
    """Each of GLUON_TEST_MODULES' `compile_all()`, by module (run by `test_compiles_for_sm90` in a child process).
    Every module is imported before the first `compile_all` runs: that imports tests.conftest (through gluon_compile),
    which sets TRITON_INTERPRET on a machine without CUDA, and a kernel module imported after that has its kernels
    made interpreted functions, which Gluon's compiler refuses."""
    import importlib

    modules = [importlib.import_module(name) for name in GLUON_TEST_MODULES]
    return {module.__name__: module.compile_all() for module in modules}


def test_compiles_for_sm90():
    """This module's kernels, and those of test_cross_ws_bwd.py and test_cross_ws_head.py (their `compile_all`, and
    what their own `test_compiles_for_sm90` asserted until 2026-12-03), compiled in one child process
    (GLUON_TEST_MODULES says why)."""
    from tests.kernels.gluon_compile import check, in_clean_process

    every = in_clean_process("tests.kernels.test_cross_ws", "compile_all_modules")
    assert list(every) == list(GLUON_TEST_MODULES)
    results = every["tests.kernels.test_cross_ws"]
    assert len(results) == len(COMPILED) and {name.split()[0] for name in results} == set(CONFIGS)
    check(results)
    bwd = every["tests.kernels.test_cross_ws_bwd"]  # kernels/cross_ws_bwd.py: the coop kernel, LAST both ways
    assert len(bwd) == 2
    check(bwd)
    head = every["tests.kernels.test_cross_ws_head"]  # kernels/cross_ws_head.py's kernel
    assert len(head) == 1
    check(head)


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="schedule"):
        cross_ws.WsConfig(schedule="stream-k")


def test_shape_mismatch_names_the_operands():
    x0 = torch.zeros(4, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="shapes disagree"):
        cross_ws.cross_forward_ws(x0, x0, torch.zeros(4, 8, dtype=torch.bfloat16),
                                  torch.zeros(8, 8, dtype=torch.bfloat16), torch.zeros(16))


def test_supported_refuses_cpu_tensors():
    t = torch.zeros(4, 16, dtype=torch.bfloat16)
    assert not cross_ws.supported(t, t, torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(16, 8, dtype=torch.bfloat16))


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _strided(rows: int, cols: int, gen, pad: int) -> torch.Tensor:
    """bf16 [rows, cols] as a column slice of a wider tensor when pad > 0 (row stride cols + pad)."""
    t = torch.randn(rows, cols + pad, generator=gen, device="cuda").to(torch.bfloat16)
    return t[:, :cols]


def _check(x0, x, u, w, b, out, pre, schedule):
    d = lambda t: t.double()  # noqa: E731
    ref_pre = d(u) @ d(w).t() + d(b)
    ref = d(x0) * ref_pre + d(x)
    # bf16 outputs rounded once from fp32 (unit roundoff 2^-8), fp32 accumulation (far smaller): bound by the
    # magnitudes. "coop" forms out from the bf16-rounded pre: two roundings.
    rounds = 2 if CONFIGS[schedule].schedule == "coop" else 1
    mag_pre = d(u).abs() @ d(w).abs().t() + d(b).abs()
    mag = d(x0).abs() * mag_pre + d(x).abs()
    assert out.shape == tuple(x0.shape) and out.is_contiguous()
    assert ((d(out) - ref).abs() <= rounds * 2.0**-8 * mag + 1e-6).all()
    if pre is not None:
        assert ((d(pre) - ref_pre).abs() <= 2.0**-8 * mag_pre + 1e-6).all()


def _operands(M, N, K, gen, pad, x_is_x0):
    x0 = _strided(M, N, gen, pad)
    x = x0 if x_is_x0 else _strided(M, N, gen, pad)
    u = _strided(M, K, gen, pad)
    w = (_strided(N, K, gen, pad).float() * K ** -0.5).to(torch.bfloat16)
    b = torch.randn(N, generator=gen, device="cuda")
    return x0, x, u, w, b


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("M,N,K", [(1, 8, 8), (3, 136, 72), (127, 136, 512), (1000, 264, 64), (4096, 3456, 512),
                                   (1024, 512, 520)])
@pytest.mark.parametrize("x_is_x0", [False, True])
@pytest.mark.parametrize("store_pre", [True, False])
@pytest.mark.parametrize("pad", [0, 8])
@pytest.mark.parametrize("schedule", sorted(CONFIGS))
def test_matches_float64(M, N, K, x_is_x0, store_pre, pad, schedule):
    gen = torch.Generator(device="cuda").manual_seed(M * 7 + N + K)
    x0, x, u, w, b = _operands(M, N, K, gen, pad, x_is_x0)
    assert cross_ws.supported(x0, x, u, w)
    out, pre = cross_ws.cross_forward_ws(x0, x, u, w, b, store_pre=store_pre, config=CONFIGS[schedule])
    if not store_pre:
        assert pre is None
    _check(x0, x, u, w, b, out, pre, schedule)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("K", [16, 520])
@pytest.mark.parametrize("num_sms", [1, 3])
@pytest.mark.parametrize("schedule", sorted(CONFIGS))
def test_many_tiles_a_program_reuse_every_slot(K, num_sms, schedule):
    """On the shapes above a program takes one tile, or several with an 8-step K loop: the staging slots and the
    rings go round across tiles only slowly. Here 1 or 3 programs take 53-320 tiles each, with a K loop of one step
    (the MMA partition races ahead to the slot the epilogue still reads) or of 9 (more steps than ring slots, a
    partial last step): a slot released too early, or a barrier phase off by one, shows as wrong tiles."""
    M, N = 2000, 1160  # 16 x 10 tiles of 128 x 128 (pingpong: 32 x 10 of 64 x 128), the last row and column partial
    gen = torch.Generator(device="cuda").manual_seed(K + num_sms)
    x0, x, u, w, b = _operands(M, N, K, gen, 0, False)
    for _ in range(3):
        out, pre = cross_ws.cross_forward_ws(x0, x, u, w, b, config=CONFIGS[schedule], num_sms=num_sms)
        _check(x0, x, u, w, b, out, pre, schedule)
