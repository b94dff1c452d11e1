"""kernels/mlp_tail.py: cases the main tests (test_mlp_tail.py) leave open, each against float64 autograd element by
element (output and every gradient):

* every operand (x, each weight and bias, the output gradient) a view into a buffer of NaNs: an element read outside
  its tensor (a padding column, a row past the batch, a weight row past N) turns the result to NaN, where the
  caching allocator's leftovers (finite, mostly zero) would hide it;
* a weight frozen while its bias trains, and the other way round (the main tests freeze both or neither);
* non-contiguous weights and biases (the kernels index them as contiguous).

fp32 in the interpreter on the CPU, bf16 on CUDA (the `kind` of test_mlp_tail.py).
"""

from __future__ import annotations

import contextlib
import os

import torch

if not torch.cuda.is_available():  # before triton is imported (tests/kernels/conftest.py does the same)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kernels.mlp_tail import tail_mlp  # noqa: E402
from tests.kernels.mlp_chain_reference import DTYPES, EDGES, check_close, make_values, matmul_precision  # noqa: E402
from tests.kernels.test_mlp_tail import forced_launch  # noqa: E402


@pytest.fixture
def kind(device) -> str:
    return "bf16" if device.type == "cuda" else "fp32"


@contextlib.contextmanager
def launch(block_m: int | None, programs: int = 1, reload: bool = True, hoist: bool = True):
    """None: the shipped launch; else `block_m`-row tiles and `programs` backward programs (test_mlp_tail.py's)."""
    if block_m is None:
        yield
        return
    with forced_launch(block_m, programs, reload, hoist):
        yield


def framed(t: torch.Tensor, device, dtype, pad: int = 37) -> torch.Tensor:
    """`t`'s values as a contiguous view with `pad` NaNs on either side in memory."""
    buf = torch.full((t.numel() + 2 * pad,), float("nan"), device=device, dtype=dtype)
    buf[pad : pad + t.numel()] = t.reshape(-1).to(device=device, dtype=dtype)
    return buf[pad : pad + t.numel()].view(t.shape)


def check_against_float64(x, ws, bs, g, relu, kind, trains=None):
    """Forward and backward of `tail_mlp` on the given tensors (leaves; gradients where they require them) against
    float64 autograd on the same values; the kernel's ReLU decisions taken within EDGES[kind] of 0 (as
    test_mlp_tail.run_case). A tensor that does not require grad must get none."""
    with matmul_precision(kind):
        out = tail_mlp(x, ws, bs, relu)
        assert out.dtype == DTYPES[kind] and out.shape == (x.shape[0], ws[-1].shape[0])
        out.backward(g)
        masks = []
        with torch.no_grad():
            for i, r in enumerate(relu):
                prefix = tail_mlp(x.detach(), [w.detach() for w in ws[: i + 1]], [b.detach() for b in bs[: i + 1]],
                                  relu[: i + 1]) if r else None  # fmt: skip
                masks.append((prefix > 0).double().cpu() if r else None)
    d = lambda t: t.detach().double().cpu().requires_grad_(t.requires_grad)  # noqa: E731
    xd, wd, bd = d(x), [d(w) for w in ws], [d(b) for b in bs]
    h = xd
    for w, b, r, km in zip(wd, bd, relu, masks):
        h = h @ w.t() + b
        if r:
            h = h * torch.where(h.detach().abs() < EDGES[kind], km, (h.detach() > 0).double())
    check_close(out, h, kind, "output")
    h.backward(g.detach().double().cpu())
    for name, got, ref in [("x", x, xd), *((f"W{i}", a, b) for i, (a, b) in enumerate(zip(ws, wd))),
                           *((f"b{i}", a, b) for i, (a, b) in enumerate(zip(bs, bd)))]:  # fmt: skip
        if not got.requires_grad:
            assert got.grad is None, f"{name} does not require grad but got one"
            continue
        assert got.grad is not None, f"{name}: no gradient"
        assert got.grad.dtype == DTYPES[kind], name
        check_close(got.grad, ref.grad, kind, f"grad {name}")


CHAINS = {"odd_widths": ([13, 7, 1, 5], [True, False, True]), "one_layer": ([5, 3], [True])}
LAUNCHES = {"shipped": (None,), "16_rows_3_programs_kept": (16, 3, False, False),
            "16_rows_3_programs_reloaded": (16, 3, True, True)}  # fmt: skip


@pytest.mark.parametrize("launch_name", list(LAUNCHES))
@pytest.mark.parametrize("chain", list(CHAINS))
@pytest.mark.parametrize("M", [1, 3, 127])
def test_nothing_outside_the_operands_is_read(M, chain, launch_name, device, kind):
    """x, weights, biases and the output gradient each framed by NaNs in memory: a read past a row, a column, the
    batch or a weight's last row makes a NaN (0 * NaN too) that the comparison catches."""
    dims, relu = CHAINS[chain]
    dtype = DTYPES[kind]
    gen = torch.Generator().manual_seed(100 + M)
    x = framed(make_values((M, dims[0]), "contiguous", gen), device, dtype).requires_grad_(True)
    ws = [framed(make_values((b, a), "contiguous", gen, a**-0.5), device, dtype).requires_grad_(True)
          for a, b in zip(dims[:-1], dims[1:])]  # fmt: skip
    bs = [framed(make_values((1, b), "contiguous", gen).reshape(b), device, dtype).requires_grad_(True)
          for b in dims[1:]]  # fmt: skip
    g = framed(make_values((M, dims[-1]), "contiguous", gen), device, dtype)
    with launch(*LAUNCHES[launch_name]):
        check_against_float64(x, ws, bs, g, relu, kind)


def test_expanded_grad_framed_by_nans(device, kind):
    """A stride-0 output gradient (``loss = out.sum()``-like) over a NaN-framed row, 127 rows in 16-row tiles."""
    dims, relu = [13, 7, 1, 5], [True, False, True]
    dtype = DTYPES[kind]
    gen = torch.Generator().manual_seed(7)
    x = framed(make_values((127, 13), "contiguous", gen), device, dtype).requires_grad_(True)
    ws = [framed(make_values((b, a), "contiguous", gen, a**-0.5), device, dtype).requires_grad_(True)
          for a, b in zip(dims[:-1], dims[1:])]  # fmt: skip
    bs = [framed(make_values((1, b), "contiguous", gen).reshape(b), device, dtype).requires_grad_(True)
          for b in dims[1:]]  # fmt: skip
    g = framed(make_values((1, 5), "contiguous", gen), device, dtype).expand(127, 5)
    assert g.stride() == (0, 1)
    with launch(16, 3):
        check_against_float64(x, ws, bs, g, relu, kind)


@pytest.mark.parametrize("frozen", ["W0", "b0", "W1", "b1"])
def test_weight_and_bias_frozen_apart(frozen, device, kind):
    """One parameter of a layer frozen, the other trained: the frozen one gets no gradient, the trained one its own
    (the main tests freeze a layer's weight and bias together, where a swap of the two would not show)."""
    dims, relu = [13, 7, 1], [True, False]
    dtype = DTYPES[kind]
    gen = torch.Generator().manual_seed(11)
    x = make_values((37, 13), "contiguous", gen).to(device=device, dtype=dtype).requires_grad_(True)
    ws = [make_values((b, a), "contiguous", gen, a**-0.5).to(device=device, dtype=dtype) for a, b in
          zip(dims[:-1], dims[1:])]  # fmt: skip
    bs = [make_values((1, b), "contiguous", gen).reshape(b).to(device=device, dtype=dtype) for b in dims[1:]]
    for i in range(2):
        ws[i].requires_grad_(frozen != f"W{i}")
        bs[i].requires_grad_(frozen != f"b{i}")
    g = make_values((37, 1), "contiguous", gen).to(device=device, dtype=dtype)
    check_against_float64(x, ws, bs, g, relu, kind)


def test_non_contiguous_weights_and_biases(device, kind):
    """Weights stored transposed (column-major) and biases every other element of a wider tensor, with a sliced x
    and a transposed output gradient: the kernels index weights and biases as contiguous, so they must be copied."""
    dims, relu = [13, 7, 1, 5], [True, False, True]
    dtype = DTYPES[kind]
    gen = torch.Generator().manual_seed(13)
    M = 67
    x = torch.zeros(M, 27, device=device, dtype=dtype)
    x[:, 1::2] = make_values((M, 13), "contiguous", gen).to(device=device, dtype=dtype)
    x = x[:, 1::2].requires_grad_(True)
    ws = [make_values((b, a), "contiguous", gen, a**-0.5).t().contiguous().to(device=device, dtype=dtype).t()
          .requires_grad_(True) for a, b in zip(dims[:-1], dims[1:])]  # fmt: skip
    bs = []
    for b in dims[1:]:
        wide = torch.zeros(2 * b, device=device, dtype=dtype)
        wide[::2] = make_values((1, b), "contiguous", gen).reshape(b).to(device=device, dtype=dtype)
        bs.append(wide[::2].requires_grad_(True))
    g = make_values((5, M), "contiguous", gen).to(device=device, dtype=dtype).t()
    assert not x.is_contiguous() and not g.is_contiguous()
    assert not any(w.is_contiguous() for w in ws if min(w.shape) > 1)
    assert not any(b.is_contiguous() for b in bs if b.numel() > 1)
    check_against_float64(x, ws, bs, g, relu, kind)


@pytest.mark.parametrize("in_features,widths,last,start", [(300, [64, 16], True, 1), (300, [40, 1], False, 1),
                                                           (13, [16, 300], True, 2)])  # fmt: skip
def test_module_head_of_one_layer_or_no_tail(in_features, widths, last, start, device):
    """OnChipTailMLP where the head is the first layer alone (input wider than 256) or the whole chain (last layer too
    wide: no tail), the cases test_mlp_tail.py's module tests leave out: output and every gradient against the eager
    MLP in float64 on the same parameters, element by element (fp32: the head's and the tail's ieee products)."""
    from dlrm.model.archs import MLP
    from kernels.mlp_tail_module import OnChipTailMLP

    torch.manual_seed(0)
    mod = OnChipTailMLP(in_features, widths, "relu", activate_last=last).to(device)
    assert mod.tail_start == start
    exact = MLP(in_features, widths, "relu", activate_last=last).double()
    exact.load_state_dict({k: v.double().cpu() for k, v in mod.state_dict().items()})
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 3, in_features, generator=gen).to(device).requires_grad_(True)
    g = torch.randn(1, 3, widths[-1], generator=gen).to(device)
    with matmul_precision("fp32"):
        out = mod(x)
        out.backward(g)
    xd = x.detach().double().cpu().requires_grad_(True)
    ref = exact(xd)
    ref.backward(g.double().cpu())
    check_close(out, ref, "fp32", "output")
    check_close(x.grad, xd.grad, "fp32", "grad x")
    for (name, p), q in zip(mod.named_parameters(), exact.parameters()):
        check_close(p.grad, q.grad, "fp32", f"grad {name}")


# ----------------------------------------------------------------------------------------------
# kernels/cross_bwd_passes.py
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("M,N", [(1, 1), (3, 12), (127, 20), (513, 17)])
@pytest.mark.parametrize("terms", [0, 3])
def test_cross_pass_reads_nothing_outside_its_operands(M, N, terms, device):
    """Every operand framed by NaNs in memory (a padding column or a row past M read makes a NaN); g_pre, dx0 and
    db element by element against float64 (db against the float64 sum of the float64 g_pre)."""
    from kernels.cross_bwd_passes import cross_backward_pass

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(M * 10 + terms)
    r = lambda: framed(torch.randn(M, N, generator=gen, dtype=torch.float64), device, dtype)  # noqa: E731
    g, x0 = r(), r()
    ts = [r() for _ in range(terms)]
    pres = [r() for _ in range(terms + 1)]
    gpre, db, dx0 = cross_backward_pass(g, ts, x0, pres)
    d = lambda t: t.double().cpu()  # noqa: E731
    acc_g = d(g)
    acc = acc_g * d(pres[0])
    for t, p in zip(ts, pres[1:]):
        acc_g = acc_g + d(t)
        acc = acc + acc_g * d(p)
    want_gpre, want_dx0 = acc_g * d(x0), acc_g + acc
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (2e-2, 2e-2)
    torch.testing.assert_close(d(gpre), want_gpre, atol=atol, rtol=rtol)
    torch.testing.assert_close(d(dx0), want_dx0, atol=atol * 4, rtol=rtol)
    assert db.dtype == torch.float32 and db.shape == (N,)
    torch.testing.assert_close(d(db), want_gpre.sum(0), atol=atol * max(1.0, M**0.5) * 4, rtol=rtol)


def test_cross_pass_refuses_rows_not_a_multiple_of_block_m(device, monkeypatch):
    """A forced launch (`LAUNCH_OVERRIDE`, benchmarks/cross_bwd_passes.py --launches) whose rows a program are not a
    multiple of BLOCK_M: each program's last tile ran on into the next chunk's rows and db counted them twice (48 rows
    in 32-row tiles at M = 100: db off by up to ~11). Refused; a multiple of BLOCK_M still matches float64."""
    import kernels.cross_bwd_passes as passes

    gen = torch.Generator().manual_seed(5)
    g, x0 = (torch.randn(100, 8, generator=gen).to(device) for _ in range(2))
    monkeypatch.setattr(passes, "LAUNCH_OVERRIDE", (32, 16, 48, 4))
    with pytest.raises(ValueError, match="multiple of BLOCK_M"):
        passes.cross_backward_pass(g, [], x0)
    monkeypatch.setattr(passes, "LAUNCH_OVERRIDE", (32, 16, 64, 4))
    gpre, db, _ = passes.cross_backward_pass(g, [], x0)
    want = g.double().cpu() * x0.double().cpu()
    torch.testing.assert_close(gpre.double().cpu(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(db.double().cpu(), want.sum(0), atol=1e-4, rtol=1e-5)
