"""kernels/cross_bwd_passes.py: the cross network backward's elementwise passes with the bias gradients' column sums,
element by element against float64 (fp32 in the interpreter on the CPU; bf16 and fp16 on the GPU), on odd shapes,
with every number of T terms, with and without x0's gradient, on non-contiguous inputs; the PyTorch reference against
the same float64 formulas; bad arguments."""

from __future__ import annotations

import pytest
import torch

from kernels.cross_bwd_passes import MAX_TERMS, cross_backward_pass, cross_backward_pass_reference


def _inputs(M, N, terms, with_dx0, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda: torch.randn(M, N, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
    g, x0 = r(), r()
    ts = [r() for _ in range(terms)]
    pres = [r() for _ in range(terms + 1)] if with_dx0 else None
    return g, ts, x0, pres


def _float64(g, ts, x0, pres):
    """The formulas in float64 from the same (rounded) inputs: g_pre, db, dx0."""
    d = lambda t: t.double()  # noqa: E731
    acc_g = d(g)
    acc = acc_g * d(pres[0]) if pres is not None else None
    for i, t in enumerate(ts):
        acc_g = acc_g + d(t)
        if pres is not None:
            acc = acc + acc_g * d(pres[i + 1])
    gpre = acc_g * d(x0)
    return gpre, gpre.sum(0), (acc_g + acc) if pres is not None else None


SHAPES = [(1, 1), (1, 8), (3, 12), (127, 300), (40, 264), (513, 17)]


@pytest.mark.parametrize("M,N", SHAPES)
@pytest.mark.parametrize("terms", list(range(MAX_TERMS + 1)))
@pytest.mark.parametrize("with_dx0", [False, True])
def test_fp32_against_float64(M, N, terms, with_dx0, device):
    args = _inputs(M, N, terms, with_dx0, torch.float32, device, seed=M * 7 + terms)
    gpre, db, dx0 = cross_backward_pass(*args)
    want_gpre, _, want_dx0 = _float64(*args)
    # the sums add the stored g_pre, as the per-layer ops' g_pre.sum(0, dtype=float32) does
    want_db = gpre.double().sum(0)
    assert gpre.dtype == torch.float32 and db.dtype == torch.float32 and db.shape == (N,)
    torch.testing.assert_close(gpre.double(), want_gpre, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(db.double(), want_db, atol=1e-5 * M ** 0.5, rtol=1e-5)
    if with_dx0:
        assert dx0.dtype == torch.float32
        torch.testing.assert_close(dx0.double(), want_dx0, atol=1e-5, rtol=1e-5)
    else:
        assert dx0 is None


@pytest.mark.parametrize("terms", [0, 2])
def test_non_contiguous_inputs(terms, device):
    M, N = 37, 24
    gen = torch.Generator().manual_seed(3)
    wide = lambda: torch.randn(M, 2 * N, generator=gen).to(device)[:, ::2]  # noqa: E731 (stride 2 columns)
    tr = lambda: torch.randn(N, M, generator=gen).to(device).t()  # noqa: E731 (column-major)
    g, x0 = wide(), tr()
    ts = [tr() if i % 2 else wide() for i in range(terms)]
    pres = [wide() for _ in range(terms + 1)]
    assert not g.is_contiguous() and not x0.is_contiguous()
    got = cross_backward_pass(g, ts, x0, pres)
    want = cross_backward_pass(g.contiguous(), [t.contiguous() for t in ts], x0.contiguous(),
                               [p.contiguous() for p in pres])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_bias_dtype_and_empty_batch(device):
    g, ts, x0, pres = _inputs(0, 8, 1, True, torch.float32, device)
    gpre, db, dx0 = cross_backward_pass(g, ts, x0, pres, bias_dtype=torch.float64)
    assert gpre.shape == (0, 8) and dx0.shape == (0, 8)
    assert db.dtype == torch.float64 and torch.equal(db.cpu(), torch.zeros(8, dtype=torch.float64))


@pytest.mark.parametrize("terms", [0, 3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_reference_against_float64(terms, dtype):
    args = _inputs(29, 10, terms, True, dtype, "cpu", seed=terms)
    gpre, db, dx0 = cross_backward_pass_reference(*args, bias_dtype=torch.float64)
    want_gpre, _, want_dx0 = _float64(*args)
    atol, rtol = {torch.float64: (1e-12, 1e-12), torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}[dtype]
    assert gpre.dtype == dtype and dx0.dtype == dtype
    torch.testing.assert_close(gpre.double(), want_gpre, atol=atol, rtol=rtol)
    torch.testing.assert_close(dx0.double(), want_dx0, atol=atol * 4, rtol=rtol)
    torch.testing.assert_close(db.double(), gpre.double().sum(0), atol=atol * 10, rtol=rtol)


def test_bad_arguments():
    g, ts, x0, pres = _inputs(4, 6, 1, True, torch.float32, "cpu")
    with pytest.raises(ValueError, match="at most"):
        cross_backward_pass(g, [g] * (MAX_TERMS + 1), x0)
    with pytest.raises(ValueError, match="pre tensors expected"):
        cross_backward_pass_reference(g, ts, x0, pres[:1])
    with pytest.raises(ValueError, match=r"must be \(4, 6\)"):
        cross_backward_pass_reference(g, [torch.zeros(4, 5)], x0)
    with pytest.raises(ValueError, match=r"g must be \[M, N\]"):
        cross_backward_pass_reference(g[0], ts, x0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M,N", [(1, 8), (127, 300), (4096, 3456), (1000, 264)])
@pytest.mark.parametrize("terms", [0, 1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_against_float64(M, N, terms, dtype):
    """fp32 arithmetic, one rounding to the 16-bit dtype at each store: within that rounding of float64 (g_pre and
    dx0: a few units of the dtype's epsilon on the values' scale); the sums of the stored g_pre to fp32 accuracy."""
    args = _inputs(M, N, terms, True, dtype, "cuda", seed=M + terms)
    gpre, db, dx0 = cross_backward_pass(*args)
    want_gpre, _, want_dx0 = _float64(*args)
    eps = torch.finfo(dtype).eps
    assert gpre.dtype == dtype and dx0.dtype == dtype and db.dtype == torch.float32
    # plus fp32's own rounding where the terms cancel (2**-20 of the largest value)
    assert ((gpre.double() - want_gpre).abs() <= eps * want_gpre.abs() + 2.0**-20 * want_gpre.abs().max()).all()
    assert ((dx0.double() - want_dx0).abs() <= eps * want_dx0.abs() + 2.0**-20 * want_dx0.abs().max()).all()
    torch.testing.assert_close(db.double(), gpre.double().sum(0), atol=1e-5 * M ** 0.5, rtol=1e-5)
