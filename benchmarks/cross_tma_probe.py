"""Probe: can a persistent, TMA-fed Triton GEMM carry the DCNv2 cross epilogue at cuBLAS's pace?

    python benchmarks/cross_tma_probe.py --out benchmarks/results/cross_tma_probe
    python benchmarks/cross_tma_probe.py --smoke --out /tmp/ctp      # tiny shapes (CPU: the interpreter)

PERF.md ("Next", issue #22) names the lever that could move the MLPerf DLRM-DCNv2 step's floor: GEMM kernels that
carry the cross network's elementwise work while staying compute-bound. `kernels/cross.py`'s fused forward (one
program per tile, pointer loads) streams its epilogue at ~1.9 TB/s and loses to cuBLAS + Inductor's pass
(results/cross_layer.md). This script tries the Hopper-style alternative on one layer's second half,
``out = x0 * (u W^T + b) + x`` (bf16, batch 65536, width 3456, rank 512, ``pre = u W^T + b`` saved or not):

* a persistent kernel (one program per SM walking the tiles in grouped order), the K loop fed by TMA tensor
  descriptors (``triton.tools.tensor_descriptor.TensorDescriptor``), outputs stored by TMA;
* ``flatten``: Triton's nested-loop fusion, which lets the pipeliner issue the next tile's loads during this
  tile's epilogue; ``ws``: Triton's Hopper warp specialization of the tile loop (producer and consumer warps);
* ``epi``: the epilogue's ``x0`` and ``x`` tiles by TMA (``tma``) or by plain pointer loads (``ptr``).

Each variant is checked against cuBLAS + the elementwise expression (max abs difference, bf16 outputs) and timed
as CUDA graphs (`_common.graph_replay_ms`). Rows that fail to compile are rows with their error. Nothing in the
package uses this kernel unless it wins; the result goes to PERF.md either way.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.append(str(Path(__file__).resolve().parent))

from _common import env_line, environment, graph_replay_ms, markdown, md_row, wall_ms, write_csv  # noqa: E402
from _common import add_overwrite, claim_outputs  # noqa: E402

from kernels.cross import cross_forward  # noqa: E402

KEYS = ["impl", "tile", "flatten", "ws", "epi", "store_pre", "ms", "gbps", "tflops", "max_abs_err", "status"]


@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped tile order (GROUP_M row blocks share the W tiles in L2)."""
    in_group = GROUP_M * num_pid_n
    first_m = (tile_id // in_group) * GROUP_M
    gsize = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % in_group) % gsize
    pid_n = (tile_id % in_group) // gsize
    return pid_m, pid_n


@triton.jit
def _cross_fwd_persistent(u_desc, w_desc, x0_desc, x_desc, out_desc, pre_desc, x0_ptr, x_ptr, b_ptr, M, N, K,
                          stride_xm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, FLATTEN: tl.constexpr, WS: tl.constexpr,
                          EPI_TMA: tl.constexpr, STORE_PRE: tl.constexpr):
    start = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    # The epilogue recomputes its tile's coordinates from its own counter (as Triton's persistent matmul
    # tutorial does), so that the flattened loop's epilogue does not depend on values carried from its prologue.
    tile_c = start - NUM_SMS
    for tile_id in tl.range(start, num_tiles, NUM_SMS, flatten=FLATTEN, warp_specialize=WS):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        om = pid_m * BLOCK_M
        on = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = u_desc.load([om, ki * BLOCK_K])
            w = w_desc.load([on, ki * BLOCK_K])
            acc = tl.dot(a, w.T, acc)
        tile_c += NUM_SMS
        pid_m, pid_n = _tile_coords(tile_c, num_pid_m, num_pid_n, GROUP_M)
        om = pid_m * BLOCK_M
        on = pid_n * BLOCK_N
        cols = on + tl.arange(0, BLOCK_N)
        pre = acc + tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        if EPI_TMA:
            x0 = x0_desc.load([om, on]).to(tl.float32)
            xx = x_desc.load([om, on]).to(tl.float32)
        else:
            rows = om + tl.arange(0, BLOCK_M)
            m = (rows < M)[:, None] & (cols < N)[None, :]
            offs = rows[:, None].to(tl.int64) * stride_xm + cols[None, :]
            x0 = tl.load(x0_ptr + offs, mask=m, other=0.0).to(tl.float32)
            xx = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
        out_desc.store([om, on], (x0 * pre + xx).to(out_desc.dtype))
        if STORE_PRE:
            pre_desc.store([om, on], pre.to(pre_desc.dtype))


def persistent_forward(x0, x, u, w, b, bm, bn, bk, stages, warps, flatten, ws, epi_tma, store_pre):
    """Launch the probe kernel: ``(out, pre or None)``."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    M, N = x0.shape
    K = u.shape[1]
    out = torch.empty_like(x0)
    pre = torch.empty_like(x0) if store_pre else out
    num_sms = torch.cuda.get_device_properties(x0.device).multi_processor_count if x0.is_cuda else 4
    descs = [TensorDescriptor.from_tensor(t, blk) for t, blk in (
        (u, [bm, bk]), (w, [bn, bk]), (x0, [bm, bn]), (x, [bm, bn]), (out, [bm, bn]), (pre, [bm, bn]))]
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    _cross_fwd_persistent[(min(num_sms, tiles),)](
        *descs, x0, x, b, M, N, K, x0.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, NUM_SMS=num_sms,
        FLATTEN=flatten, WS=ws, EPI_TMA=epi_tma, STORE_PRE=store_pre, num_stages=stages, num_warps=warps)
    return out, (pre if store_pre else None)


def parse_variant(text: str) -> dict:
    """``BMxBNxBKsSwW[-flat][-ws][-ptr]`` -> launch keywords."""
    parts = text.split("-")
    dims, rest = parts[0].split("s", 1)
    stages, warps = rest.split("w")
    bm, bn, bk = (int(v) for v in dims.split("x"))
    return dict(bm=bm, bn=bn, bk=bk, stages=int(stages), warps=int(warps), flatten="flat" in parts[1:],
                ws="ws" in parts[1:], epi_tma="ptr" not in parts[1:])


DEFAULT_VARIANTS = ",".join([
    "128x128x64s4w8", "128x128x64s4w8-flat", "128x128x64s4w8-ptr", "128x128x64s4w8-flat-ptr",
    "128x128x64s3w8-ws", "128x128x64s3w8-flat-ws", "128x256x64s3w8", "128x256x64s3w8-flat",
    "128x256x64s3w8-ws", "64x128x64s4w4", "64x128x64s4w4-flat", "128x64x64s4w4-flat",
])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--width", type=int, default=3456)
    ap.add_argument("--rank", type=int, default=512)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma list of BMxBNxBKsSwW[-flat][-ws][-ptr]")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--windows", type=int, default=7)
    ap.add_argument("--smoke", action="store_true", help="batch 64, width 64, rank 32, two variants, fp32 on the CPU")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    outputs = claim_outputs(ap, args, args.out, ["cross_tma_probe.csv", "cross_tma_probe.md"])
    cuda = torch.cuda.is_available()
    if args.smoke:
        args.batch, args.width, args.rank, args.calls, args.windows = 64, 64, 32, 1, 1
        args.variants = "32x32x16s2w4,32x32x16s2w4-ptr"
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32  # the interpreter runs fp32 only
    B, N, r = args.batch, args.width, args.rank
    gen = torch.Generator(device=device).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=gen, device=device, dtype=dtype)  # noqa: E731
    x0, x, u, w, b = rnd(B, N), rnd(B, N), rnd(B, r), rnd(N, r) * 0.03, rnd(N)
    ref_pre = (u.double() @ w.double().t() + b.double())
    ref = (x0.double() * ref_pre + x.double())
    timer = (lambda f: graph_replay_ms(f, args.calls, args.windows, 3)) if cuda else wall_ms
    el = x0.element_size()
    rows = []
    def cross(x0, y, b, x):
        return x0 * (y + b) + x

    elementwise = torch.compile(cross) if cuda else cross

    def add(impl, tile, fn, store_pre, kw=None, timed=None):
        """A row: ``fn`` checked against the reference, ``timed`` (default ``fn``) timed."""
        kw = kw or {}
        row = {"impl": impl, "tile": tile, "flatten": kw.get("flatten", ""), "ws": kw.get("ws", ""),
               "epi": ("tma" if kw.get("epi_tma") else "ptr") if kw else "", "store_pre": store_pre}
        try:
            got, got_pre = fn()
            err = (got.double() - ref).abs().max().item()
            if got_pre is not None:
                err = max(err, (got_pre.double() - ref_pre).abs().max().item())
            row["max_abs_err"] = err
            row["ms"] = timer(timed or fn)
            nbytes = (B * r + N * r + (4 if store_pre else 3) * B * N) * el
            if row["ms"]:
                row["gbps"] = nbytes / row["ms"] / 1e6
                row["tflops"] = 2 * B * N * r / row["ms"] / 1e9
            row["status"] = "ok"
        except Exception as e:  # noqa: BLE001 - a variant that does not compile is a row, not a crash
            row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        rows.append(row)
        print(md_row([row.get(k, "") for k in KEYS]), flush=True)

    def cublas_inductor():  # what the step runs: y is saved for the backward, which adds b itself
        y = torch.mm(u, w.t())
        return elementwise(x0, y, b, x), y

    # checked with pre = y + b, timed without that extra pass
    add("cuBLAS u W^T + Inductor pass (the step's; saves y)", "", lambda: (lambda o, y: (o, y + b))(
        *cublas_inductor()), True, timed=cublas_inductor)
    add("kernels.cross (per-tile programs, pointer loads)", "picked",
        lambda: cross_forward(x0, x, u, w, b, store_pre=True), True)
    add("kernels.cross (per-tile programs, pointer loads)", "picked",
        lambda: (cross_forward(x0, x, u, w, b, store_pre=False)[0], None), False)
    for text in args.variants.split(","):
        kw = parse_variant(text.strip())
        for store in (True, False):
            add("persistent TMA", text.strip(), lambda kw=kw, store=store: persistent_forward(
                x0, x, u, w, b, store_pre=store, **kw), store, kw)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(device)
    title = f"DCNv2 cross layer forward x0 * (u W^T + b) + x, batch {B}, width {N}, rank {r}, {str(dtype)[6:]}"
    table = ["| " + " | ".join(KEYS) + " |", "|" + " --- |" * len(KEYS)]
    for row in rows:
        table.append(md_row([f"{row[k]:.4g}" if isinstance(row.get(k), float) else row.get(k, "") for k in KEYS]))
    note = (f"CUDA graphs of {args.calls} calls, median of {args.windows} windows; GB/s counts u and W read, x0 and x "
            "read, out (and pre) written; max_abs_err against a float64 reference.")
    write_csv(out / "cross_tma_probe.csv", rows, KEYS, env)
    (out / "cross_tma_probe.md").write_text(markdown(title, [env_line(env), note], table))
    outputs.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
