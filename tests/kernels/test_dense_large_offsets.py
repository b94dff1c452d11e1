"""The dense kernels at operand sizes whose element offsets pass 2^31 (the embedding kernels' issue, for the cross
layer, the linear layer, the fused MLP's mask, the activation backward, the weight gradient, the column sums and the
loss).

In a Triton kernel ``rm = pid * BLOCK_M + tl.arange(0, BLOCK_M)`` is int32, and a stride below 2^31 is specialized as
int32, so ``rm[:, None] * stride`` wraps once an operand has an element offset of 2^31 or more: MLPerf DLRM-DCNv2's
cross net (N = 3456) at ~621k rows, a 1024-wide layer at ~2.1M rows, the weight gradient's ``g [B, 512]`` at ~4.2M
rows, any operand that is a view with a large row (or column) stride. The wrapped offset lands 2^32 elements before
the right one: another row is read or written, silently. Each launcher sets its kernel's ``INT64_OFFSETS`` flag when
an operand reaches 2^31 (`kernels._backend.needs_int64_offsets`), and the kernel casts its row and column indices
(and the loop's pointer steps) to int64; these tests fail when one of those casts, or the flag, is lost.

Operands live in sparse files mapped into memory (``torch.from_file``: tens of GB of address space, only the pages
written take memory or disk), so the CPU interpreter runs the real kernels at such offsets in seconds. Two layouts:

* strided views (``strided_views``): 40 lines of an operand, ``STRIDE`` = 2^26 + 17 elements apart, the first at
  element 2^31 of its file; lines 32-39 lie past 2^31 from the view's start, and a 32-line loop step (``32 *
  STRIDE``) wraps too. As rows ("rows") or as columns ("columns", a transposed view), so both row and column indices
  are tested. The kernels compute only these 40 lines; a wrapped offset reads the file's zeros before the view.
  Forward and gradients through autograd where the op has them (the inputs and the incoming gradients are views).
* tall contiguous operands (``M x N >= 2^31``) for the outputs a launcher allocates itself (``out``, ``pre``,
  ``grad_pre``): under the interpreter ``only_programs`` runs only the programs of the last row tiles (the launch
  keeps its grid, the other programs are skipped), and checks every load and store address against the launch's
  tensors, so a wrapped offset raises instead of touching memory outside them. The outputs are ``torch.empty`` of
  8.6 GB of address space each, of which only the rows computed are touched.

Checked element by element against float64. On a GPU the operands are in device memory (the whole grid runs; skipped
below the memory each test needs); on the CPU the tests run.
"""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch

from kernels import col_sum, cross, epilogue, linear, loss, mlp, wgrad
from kernels._backend import interpret_mode
from kernels._backend import INT32_OFFSET_LIMIT, max_element_offset
from kernels.heuristics import INTERPRETER_GEMM_TILE

BIG = INT32_OFFSET_LIMIT  # 2^31
STRIDE = 2**26 + 17  # line 32 at 2^31 + 544: lines 32.. wrap, and so does a 32-line step
LINES = 40
GPU_GB_VIEWS = 32  # a 19 GB buffer of strided views
GPU_GB_TALL = 80  # up to seven [M, N] operands and outputs of 8.6 GB


def buffer(path, n: int, device: torch.device, gb: int) -> torch.Tensor:
    """n fp32 zeros: on the CPU a sparse file mapped into memory (no memory or disk until written), else in device
    memory (skipped below `gb` GB).

    The file is mapped with read-ahead off (``MADV_RANDOM``; ``torch.from_file`` maps it with the default): a page
    fault in a hole otherwise fills the device's read-ahead window (8 MB here) with zeros, and the 40 lines of a
    strided view, 256 MB apart, took 0.5-5 s to write instead of a millisecond."""
    if device.type == "cuda":
        if torch.cuda.get_device_properties(device).total_memory < gb * 2**30:
            pytest.skip(f"needs a GPU of {gb} GB or more")
        return torch.zeros(n, dtype=torch.float32, device=device)
    with open(path, "wb") as f:
        f.truncate(4 * n)
    with open(path, "r+b") as f:
        mapped = mmap.mmap(f.fileno(), 4 * n)  # shared, read and write; the tensor keeps it alive
    mapped.madvise(mmap.MADV_RANDOM)
    return torch.frombuffer(mapped, dtype=torch.float32, count=n)


def strided_views(path, device, shapes: list[tuple[int, int, str]]) -> list[torch.Tensor]:
    """A [rows, cols] view per ``(rows, cols, layout)``, all in one buffer: "rows" puts the rows STRIDE elements apart
    (strides (STRIDE, 1)), "columns" the columns (strides (1, STRIDE)); each view's first element is at 2^31 or
    more, so every wrapped offset falls into the buffer's untouched first 2^31 elements (zeros)."""
    spans, chunk = [], 0
    for rows, cols, layout in shapes:
        lines, length = (rows, cols) if layout == "rows" else (cols, rows)
        assert lines <= LINES
        spans.append(chunk)
        chunk += length
    assert chunk < STRIDE
    buf = buffer(path, BIG + LINES * STRIDE + chunk, device, GPU_GB_VIEWS)
    views = [buf.as_strided((rows, cols), (STRIDE, 1) if layout == "rows" else (1, STRIDE), BIG + at)
             for (rows, cols, layout), at in zip(shapes, spans)]
    for v in views:
        assert max_element_offset(v) >= BIG and max(v.stride()) < BIG  # past 2^31 through int32 strides
    return views


def randn_(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    with torch.no_grad():
        t.copy_(torch.randn(t.shape, generator=gen).to(t.device))
    return t


def f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().double().cpu()


def check(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(f64(actual), expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


# ----------------------------------------------------------------------------------------------
# Only some programs, addresses checked (the interpreter)
# ----------------------------------------------------------------------------------------------


def _storage_ranges(args, kwargs) -> list[tuple[int, int]]:
    ranges = []
    for a in [*args, *kwargs.values()]:
        if isinstance(a, torch.Tensor):
            s = a.untyped_storage()
            ranges.append((s.data_ptr(), s.data_ptr() + s.nbytes()))
    return ranges


def _check_addresses(ptrs, mask, ranges, what: str) -> None:
    addr = ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape)]
    size = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
    ok = np.zeros(addr.shape, dtype=bool)
    for lo, hi in ranges:
        ok |= (addr >= np.uint64(lo)) & (addr <= np.uint64(hi - size))
    if not ok.all():
        raise AssertionError(f"{what} outside the launch's tensors at {int((~ok).sum())} of {addr.size} addresses")


def only_programs(monkeypatch, kernel, choose) -> None:
    """Under Triton's interpreter the launches of ``kernel`` run only the programs ``choose(grid, meta)`` lists
    ((x, y, z) each; ``grid`` the launch's three dimensions, ``meta`` its arguments; `tl.program_id` returns them as
    in the full launch), and each load and store raises unless its addresses lie in the launch's tensors. On a GPU
    nothing changes: the whole grid runs.

    It replaces the kernel's ``run`` (``InterpretedFunction.run``: rewrite, then ``GridExecutor``) and, during each
    launch, the interpreter's grid and memory hooks."""
    if not interpret_mode():
        return
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder

    def run(*args, grid, warmup, **kwargs):
        if warmup:
            return None
        dims, picked = [], []

        def picked_grid(meta):
            full = grid(meta) if callable(grid) else grid
            dims[:] = tuple(full) + (1,) * (3 - len(full))
            picked[:] = choose(tuple(dims), meta)
            assert picked, "no program chosen"
            return (len(picked),)

        ranges = _storage_ranges(args, kwargs)
        set_dim, set_idx = builder.set_grid_dim, builder.set_grid_idx
        load, store = builder.create_masked_load, builder.create_masked_store

        def checked_load(ptrs, mask, *rest):
            _check_addresses(ptrs, mask, ranges, "load")
            return load(ptrs, mask, *rest)

        def checked_store(ptrs, value, mask, *rest):
            _check_addresses(ptrs, mask, ranges, "store")
            return store(ptrs, value, mask, *rest)

        hooks = {"set_grid_dim": lambda *_: set_dim(*dims), "set_grid_idx": lambda i, _y, _z: set_idx(*picked[i]),
                 "create_masked_load": checked_load, "create_masked_store": checked_store}
        for name, hook in hooks.items():
            setattr(builder, name, hook)
        try:
            executor = interpreter.GridExecutor(kernel.rewrite(), kernel.arg_names, picked_grid, kernel.pre_run_hooks)
            return executor(*args, **kwargs)
        finally:
            for name in hooks:
                delattr(builder, name)

    monkeypatch.setattr(kernel, "run", run)


def gemm_programs(M: int, N: int, first_row: int):
    """`only_programs`' choice for the grouped tile order of `kernels.linear` and `kernels.cross`: every program of
    the row tiles from ``first_row`` on (the kernel's order, mirrored)."""

    def choose(dims, meta):
        bm, bn, group = meta["BLOCK_M"], meta["BLOCK_N"], meta["GROUP_M"]
        num_m, num_n = -(-M // bm), -(-N // bn)
        pid = np.arange(dims[0], dtype=np.int64)
        first = pid // (group * num_n) * group
        pid_m = first + (pid % (group * num_n)) % np.minimum(num_m - first, group)
        return [(int(p), y, 0) for p in pid[pid_m >= first_row // bm] for y in range(dims[1])]

    return choose


def row_programs(first_row: int, rows_a_program: int):
    """`only_programs`' choice for a grid of (row blocks, column blocks): the row blocks from ``first_row`` on."""

    def choose(dims, meta):
        return [(x, y, 0) for x in range(first_row // rows_a_program, dims[0]) for y in range(dims[1])]

    return choose


def tall(path, device, rows: int, cols: int, first_row: int, gen) -> torch.Tensor:
    """A contiguous [rows, cols] fp32 operand, zero but for random rows from ``first_row`` on."""
    t = buffer(path, rows * cols, device, GPU_GB_TALL).view(rows, cols)
    randn_(t[first_row:], gen)
    return t


# ----------------------------------------------------------------------------------------------
# Strided views: forward and gradients through autograd
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_cross_layer_views_past_2_to_the_31(tmp_path, device, layout):
    """cross_layer's forward and every gradient: x0, x, u, the weight and the incoming gradient are views whose rows
    (or columns) lie past 2^31; covers `_cross_fwd_kernel` (rows, columns, and K steps of u and W),
    `_cross_bwd_elementwise_kernel` and the backward GEMMs of `kernels.linear` (grad_u reads W^T, grad_W reads u^T,
    whose K walks u's rows)."""
    M, N, K = (LINES, LINES, 6) if layout == "rows" else (LINES, LINES, LINES)
    x0, x, u, w, g = strided_views(tmp_path / "buf.bin", device, [(M, N, layout), (M, N, layout), (M, K, layout),
                                                                 (N, K, layout), (M, N, layout)])
    gen = torch.Generator().manual_seed(0)
    for t in (x0, x, u, w, g):
        randn_(t, gen)
    b = torch.randn(N, generator=gen).to(device)
    leaves = [t.requires_grad_() for t in (x0, x, u, w, b)]
    out = cross.cross_layer(*leaves)
    out.backward(g)

    X0, X, U, W, B = (f64(t).requires_grad_() for t in (x0, x, u, w, b))
    want = X0 * (U @ W.t() + B) + X
    want.backward(f64(g))
    check(out, want.detach(), "out")
    for name, t, ref in zip(("x0", "x", "u", "w", "b"), leaves, (X0, X, U, W, B)):
        check(t.grad, ref.grad, f"grad {name}")


@pytest.mark.parametrize("layout, activation", [("rows", "none"), ("columns", "gelu")])
def test_linear_act_views_past_2_to_the_31(tmp_path, device, layout, activation):
    """linear_act's forward and gradients with x, the incoming gradient and the weight as views past 2^31: the
    forward GEMM through x's rows or columns (and the weight's rows), `act_backward` through the gradient, grad_x and
    grad_W through the gradient (with "none" the GEMMs read it as is) and x^T (K walks the batch)."""
    M, K, N = (LINES, 24, LINES) if layout == "rows" else (LINES, LINES, LINES)
    x, g, w = strided_views(tmp_path / "buf.bin", device, [(M, K, layout), (M, N, layout), (N, K, "rows")])
    gen = torch.Generator().manual_seed(1)
    for t in (x, g, w):
        randn_(t, gen)
    b = torch.randn(N, generator=gen).to(device)
    leaves = [t.requires_grad_() for t in (x, w, b)]
    out = linear.linear_act(*leaves, activation=activation)
    out.backward(g)

    X, W, B = (f64(t).requires_grad_() for t in (x, w, b))
    pre = X @ W.t() + B
    want = torch.nn.functional.gelu(pre) if activation == "gelu" else pre
    want.backward(f64(g))
    check(out, want.detach(), "out")
    for name, t, ref in zip(("x", "w", "b"), leaves, (X, W, B)):
        check(t.grad, ref.grad, f"grad {name}")


@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_act_backward_views_past_2_to_the_31(tmp_path, device, layout):
    """`kernels.epilogue.act_backward` (gelu from the pre-activation, with the bias gradient) reading views."""
    g, pre = strided_views(tmp_path / "buf.bin", device, [(LINES, LINES, layout)] * 2)
    gen = torch.Generator().manual_seed(2)
    randn_(g, gen)
    randn_(pre, gen)
    gpre, gb = epilogue.act_backward(g, pre, "gelu", False, bias_grad=True)
    P = f64(pre).requires_grad_()
    torch.nn.functional.gelu(P).backward(f64(g))
    check(gpre, P.grad, "grad_pre")
    check(gb, P.grad.sum(0), "bias gradient")


@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_mask_bias_grad_views_past_2_to_the_31(tmp_path, device, layout):
    """`kernels.mlp.mask_bias_grad` (ReLU mask, bias gradient) reading views."""
    g, out = strided_views(tmp_path / "buf.bin", device, [(LINES, LINES, layout)] * 2)
    gen = torch.Generator().manual_seed(3)
    randn_(g, gen)
    randn_(out, gen)
    gm, gb = mlp.mask_bias_grad(g, out, True)
    want = torch.where(f64(out) > 0, f64(g), 0.0)
    check(gm, want, "masked gradient")
    check(gb, want.sum(0), "bias gradient")


@pytest.mark.parametrize("layout, mask, splits", [("rows", True, None), ("rows", False, 2), ("columns", True, None)])
def test_linear_wgrad_views_past_2_to_the_31(tmp_path, device, layout, mask, splits):
    """`kernels.wgrad.linear_wgrad` reducing over a batch whose rows (the "rows" layout, 2 loop steps, or 2 slices)
    or output columns ("columns") lie past 2^31 in g, the ReLU output and x."""
    B, M, N = (LINES, 24, 20) if layout == "rows" else (24, LINES, LINES)
    g, y, x = strided_views(tmp_path / "buf.bin", device, [(B, M, layout), (B, M, layout), (B, N, layout)])
    gen = torch.Generator().manual_seed(4)
    for t in (g, y, x):
        randn_(t, gen)
    dw, db = wgrad.linear_wgrad(g, x, y if mask else None, splits=splits)
    gm = torch.where(f64(y) > 0, f64(g), 0.0) if mask else f64(g)
    check(dw, gm.t() @ f64(x), "dW")
    check(db, gm.sum(0), "db")


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_bce_views_past_2_to_the_31(tmp_path, device, reduction):
    """`kernels.loss` on 1-D views (logits, labels and the incoming gradient) whose elements 32.. lie past 2^31:
    the loss and the gradients of logits and labels."""
    z, y, g = (v[:, 0] for v in strided_views(tmp_path / "buf.bin", device, [(LINES, 1, "rows")] * 3))
    assert max_element_offset(z) >= BIG
    gen = torch.Generator().manual_seed(5)
    randn_(z, gen)
    randn_(g, gen)
    with torch.no_grad():
        y.copy_(torch.rand(LINES, generator=gen).to(device))
    z.requires_grad_()
    y.requires_grad_()
    out = loss.bce_with_logits(z, y, reduction)
    out.backward(g if reduction == "none" else None)
    Z, Y = f64(z).requires_grad_(), f64(y).requires_grad_()
    want = torch.nn.functional.binary_cross_entropy_with_logits(Z, Y, reduction=reduction)
    want.backward(f64(g) if reduction == "none" else None)
    check(out, want.detach(), "loss")
    check(z.grad, Z.grad, "grad logits")
    check(y.grad, Y.grad, "grad labels")


# ----------------------------------------------------------------------------------------------
# Tall operands: the outputs the launchers allocate, [M, N] with M N >= 2^31
# ----------------------------------------------------------------------------------------------

N_TALL = 96  # two column tiles of the interpreter's GEMM tile, one of the elementwise kernels'
M_TALL = BIG // N_TALL + 48  # rows from 22,369,622 on lie past 2^31
FIRST = M_TALL - 64  # the rows computed (and checked): FIRST.. (rounded down to a row tile)


def test_cross_tall_forward_and_backward(tmp_path, device, monkeypatch):
    """`cross_forward` (out and pre) and `cross_elementwise_backward` (grad_pre and grad_x0) writing [M, 96] outputs
    past 2^31 elements, and grad_u = grad_pre @ W reading them (`kernels.linear`)."""
    M, N, K = M_TALL, N_TALL, 8
    r0 = FIRST // 32 * 32
    gen = torch.Generator().manual_seed(6)
    x0, x, g = (tall(tmp_path / f"{n}.bin", device, M, N, FIRST, gen) for n in ("x0", "x", "g"))
    u = tall(tmp_path / "u.bin", device, M, K, FIRST, gen)
    w, b = torch.randn(N, K, generator=gen).to(device), torch.randn(N, generator=gen).to(device)
    only_programs(monkeypatch, cross._cross_fwd_kernel, gemm_programs(M, N, r0))
    only_programs(monkeypatch, cross._cross_bwd_elementwise_kernel, row_programs(r0, cross._EW_BLOCK_M))
    only_programs(monkeypatch, linear._linear_kernel, gemm_programs(M, K, r0))

    out, pre = cross.cross_forward(x0, x, u, w, b)
    P = f64(u[r0:]) @ f64(w).t() + f64(b)
    check(pre[r0:], P, "pre")
    check(out[r0:], f64(x0[r0:]) * P + f64(x[r0:]), "out")
    del out
    gpre, gx0, _ = cross.cross_elementwise_backward(g, x0, pre, need_b=False)
    check(gpre[r0:], f64(g[r0:]) * f64(x0[r0:]), "grad_pre")
    check(gx0[r0:], f64(g[r0:]) * P, "grad_x0")
    del gx0
    gu, _ = linear.gemm_bias_act(gpre, w.t())
    check(gu[r0:], f64(g[r0:]) * f64(x0[r0:]) @ f64(w), "grad_u")


def test_linear_tall_forward_and_act_backward(tmp_path, device, monkeypatch):
    """`gemm_bias_act` writing out and pre of [M, 96] past 2^31 elements, and `act_backward` reading the incoming
    gradient and pre and writing grad_pre there."""
    M, N, K = M_TALL, N_TALL, 8
    r0 = FIRST // 32 * 32
    gen = torch.Generator().manual_seed(7)
    x = tall(tmp_path / "x.bin", device, M, K, FIRST, gen)
    g = tall(tmp_path / "g.bin", device, M, N, FIRST, gen)
    w, b = torch.randn(N, K, generator=gen).to(device), torch.randn(N, generator=gen).to(device)
    only_programs(monkeypatch, linear._linear_kernel, gemm_programs(M, N, r0))
    only_programs(monkeypatch, epilogue._act_bwd_kernel, row_programs(r0, epilogue._BLOCK_M))

    out, pre = linear.gemm_bias_act(x, w, b, "gelu", store_pre=True)
    P = (f64(x[r0:]) @ f64(w).t() + f64(b)).requires_grad_()
    check(pre[r0:], P.detach(), "pre")
    check(out[r0:], torch.nn.functional.gelu(P).detach(), "out")
    del out
    gpre, _ = epilogue.act_backward(g, pre, "gelu", False)
    torch.nn.functional.gelu(P).backward(f64(g[r0:]))
    check(gpre[r0:], P.grad, "grad_pre")


def test_mask_bias_grad_tall(tmp_path, device, monkeypatch):
    """`mask_bias_grad` reading the gradient and the ReLU output and writing the masked gradient, [M, 96] past 2^31
    elements (under the interpreter a GPU-like launch of one 64-row step a program; its own takes all rows in one)."""
    M, N = M_TALL, N_TALL
    gen = torch.Generator().manual_seed(8)
    g, y = (tall(tmp_path / f"{n}.bin", device, M, N, FIRST, gen) for n in ("g", "y"))
    block_m = mlp._mask_launch(device)[0]
    r0 = FIRST // block_m * block_m
    if interpret_mode():
        monkeypatch.setattr(mlp, "_rows_per_program", lambda *args: block_m)
    only_programs(monkeypatch, mlp._mask_bias_kernel, row_programs(r0, block_m))
    gm, _ = mlp.mask_bias_grad(g, y, True, bias_grad=False)
    check(gm[r0:], torch.where(f64(y[r0:]) > 0, f64(g[r0:]), 0.0), "masked gradient")


def test_sum_partial_rows_past_2_to_the_31(tmp_path, device, monkeypatch):
    """`sum_partial_rows` over a contiguous [9, 2^28] buffer (row 8 at 2^31); the last 4096 columns computed."""
    R, N, bn = 9, 2**28, 4096
    buf = buffer(tmp_path / "partial.bin", BIG + R * N, device, GPU_GB_VIEWS)
    partial = buf[BIG:].view(R, N)  # wrapped offsets fall into the buffer's zeros before it
    gen = torch.Generator().manual_seed(9)
    randn_(partial[:, -bn:], gen)
    out = torch.empty(N, device=device)
    only_programs(monkeypatch, col_sum._col_sum_kernel, lambda dims, meta: [(dims[0] - 1, 0, 0)])
    col_sum.sum_partial_rows(partial, out, bn)
    check(out[-bn:], f64(partial[:, -bn:]).sum(0), "column sums")


# ----------------------------------------------------------------------------------------------
# Split workspaces stay below 2^31 (their offsets are 32-bit)
# ----------------------------------------------------------------------------------------------


def test_split_workspaces_stay_below_2_to_the_31():
    """A huge split count is cut so that the fp32 split workspaces ([slices, M, N] of `kernels.linear`, [slices,
    M N + M] of `kernels.wgrad`) stay below 2^31 elements; ordinary ones are kept."""
    tile = INTERPRETER_GEMM_TILE
    M, N, K = 4096, 4096, 2**24
    splits, k_per_split = linear._plan_splits(M, N, K, tile, True, 10**6, torch.device("cpu"))
    assert splits * M * N <= BIG and splits > 1 and (splits - 1) * k_per_split < K <= splits * k_per_split
    assert linear._plan_splits(64, 64, 4096, tile, True, 8, torch.device("cpu"))[0] == 8
    slices, rows = wgrad._plan_slices(2**20, M, N, 32, 10**6)
    assert slices * (M * N + M) <= BIG and (slices - 1) * rows < 2**20 <= slices * rows
    assert wgrad._plan_slices(4096, 64, 64, 32, 4) == (4, 1024)
