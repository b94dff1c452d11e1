"""The DCNv2 cross network at MLPerf's shapes: Inductor's against the Triton path, and the fused forward's tiles.

    python benchmarks/cross_layer.py --out benchmarks/results/cross_layer
    python benchmarks/cross_layer.py --smoke --out /tmp/cl     # tiny shapes (CPU: interpreter, eager, no compile)

Issue #22 asks for a cross layer whose GEMM epilogue fuses ``x0 * (. + b) + x``; `kernels/cross.py` is that
kernel, and the step keeps the PyTorch cross net compiled by Inductor (cuBLAS GEMMs, Triton elementwise) as long
as it is faster. Two measurements, bf16, batch ``--batch`` (65536), width ``N = 27 x 128 = 3456``, rank 512:

* ``net``: the whole 3-layer network forward + backward (and forward alone), ``dlrm.model.archs.LowRankCrossNet``
  compiled (``torch.compile``, mode default) against ``kernels.cross.TritonLowRankCrossNet`` compiled (its
  custom ops opaque to Inductor), under bf16 autocast;
* ``fwd``: one layer's second half, ``x0 * (u W^T + b) + x``, as cuBLAS's ``u W^T`` then Inductor's fused
  elementwise kernel, against the Triton kernel (`kernels.cross.cross_forward`) at each tile of ``--tiles``
  (forced through `kernels.heuristics.CROSS_TILE_OVERRIDE`; "picked" is `heuristics.pick_cross_tile`), saving
  ``pre = u W^T + b`` for the backward (as training does) or not. GB/s counts ``u`` read, ``x0`` and ``x`` read,
  ``out`` (and ``pre``) written.

Timing: CUDA graphs of ``--calls`` calls replayed in ``--windows`` windows (CUDA events, the median). On the CPU
(``--smoke``) one call each, eager instead of compiled, the interpreter's one tile (a check of the script).
Writes cross_layer.csv / .md / .png under ``--out`` (GPU name, versions, date).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.append(str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    add_overwrite,
    claim_outputs,
    env_line, environment, graph_replay_ms, markdown, md_row, pyplot, save_figure, write_csv,
)

from dlrm.model.archs import LowRankCrossNet  # noqa: E402
from kernels import heuristics  # noqa: E402
from kernels.cross import TritonLowRankCrossNet, cross_forward  # noqa: E402
from kernels.heuristics import GemmTile  # noqa: E402

DEFAULT_TILES = "picked,128x128x64s3w8,64x128x64s4w4,128x64x64s4w4,128x64x64s3w4,64x64x64s4w4,128x256x64s3w8"
KEYS = ["case", "impl", "tile", "store_pre", "ms", "gbps", "batch", "width", "rank", "status"]


def parse_tile(text: str) -> Optional[GemmTile]:
    """``picked`` -> None; ``BMxBNxBKsSTAGESwWARPS`` -> that GemmTile."""
    if text == "picked":
        return None
    dims, rest = text.split("s", 1)
    stages, warps = rest.split("w")
    bm, bn, bk = (int(v) for v in dims.split("x"))
    return GemmTile(bm, bn, bk, int(stages), int(warps))


def net_rows(args, device: torch.device, timer) -> list[dict]:
    """The 3-layer network, Inductor's (or eager on the CPU) against the Triton path."""
    B, N, r = args.batch, args.width, args.rank
    gen = torch.Generator(device=device).manual_seed(0)
    x_in = torch.randn(B, N, generator=gen, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(B, N, generator=gen, device=device, dtype=torch.bfloat16)
    compiled = device.type == "cuda"
    rows = []
    for impl, cls in (("inductor" if compiled else "eager", LowRankCrossNet), ("triton", TritonLowRankCrossNet)):
        torch.manual_seed(0)
        net = cls(N, args.layers, r).to(device)
        fn = torch.compile(net) if compiled else net

        def fwd_bwd():
            with torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False):
                y = fn(x_in)
            y.backward(grad)

        def fwd():
            with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False):
                fn(x_in)

        for case, step in (("net fwd+bwd", fwd_bwd), ("net fwd", fwd)):
            row = {"case": case, "impl": impl, "tile": "", "store_pre": "", "batch": B, "width": N, "rank": r}
            try:
                row.update(ms=timer(step), status="ok")
            except Exception as e:  # noqa: BLE001 - recorded in the row, the other rows still run
                row.update(status=f"error: {type(e).__name__}: {str(e).splitlines()[0][:150]}")
            rows.append(row)
        x_in.grad = None
    return rows


def fwd_rows(args, device: torch.device, timer) -> list[dict]:
    """One layer's ``x0 * (u W^T + b) + x``: cuBLAS + Inductor's elementwise, and the Triton kernel per tile."""
    B, N, r = args.batch, args.width, args.rank
    gen = torch.Generator(device=device).manual_seed(1)
    rnd = lambda *s: torch.randn(*s, generator=gen, device=device, dtype=torch.bfloat16)  # noqa: E731
    x0, x, u, w, b = rnd(B, N), rnd(B, N), rnd(B, r), rnd(N, r) * 0.03, rnd(N)
    elementwise = torch.compile(lambda x0, y, b, x: x0 * (y + b) + x) if device.type == "cuda" else (
        lambda x0, y, b, x: x0 * (y + b) + x)
    y = torch.mm(u, w.t())
    el = 2  # bytes of a bf16 element
    base = {"case": "fwd", "batch": B, "width": N, "rank": r}
    rows = [
        {**base, "impl": "cuBLAS u W^T", "tile": "", "store_pre": "", "ms": timer(lambda: torch.mm(u, w.t())),
         "gbps_bytes": (B * r + B * N) * el},
        {**base, "impl": "Inductor x0 * (y + b) + x", "tile": "", "store_pre": "",
         "ms": timer(lambda: elementwise(x0, y, b, x)), "gbps_bytes": 4 * B * N * el},
    ]
    rows.append({**base, "impl": "cuBLAS + Inductor (the step's)", "tile": "", "store_pre": "saves y",
                 "ms": rows[0]["ms"] + rows[1]["ms"], "gbps_bytes": (B * r + 5 * B * N) * el})
    for text in args.tiles.split(","):
        tile = parse_tile(text.strip())
        heuristics.CROSS_TILE_OVERRIDE = tile
        try:
            for store in (True, False):
                row = {**base, "impl": "triton fused", "tile": text.strip(), "store_pre": store,
                       "gbps_bytes": (B * r + (4 if store else 3) * B * N) * el}
                try:
                    row["ms"] = timer(lambda: cross_forward(x0, x, u, w, b, store_pre=store))
                except Exception as e:  # noqa: BLE001 - a tile that does not fit is a row, not a crash
                    row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:150]}"
                rows.append(row)
        finally:
            heuristics.CROSS_TILE_OVERRIDE = None
    for row in rows:
        nbytes = row.pop("gbps_bytes")
        row.setdefault("status", "ok")
        if row.get("ms"):
            row["gbps"] = nbytes / row["ms"] / 1e6
    return rows


def markdown_table(rows: list[dict]) -> list[str]:
    lines = ["| case | implementation | tile | pre saved | ms | GB/s | status |",
             "| --- | --- | --- | --- | ---: | ---: | --- |"]
    for r in rows:
        lines.append(md_row([r["case"], r["impl"], r["tile"], r["store_pre"], f"{r['ms']:.3f}" if r.get("ms") else "",
                             f"{r['gbps']:,.0f}" if r.get("gbps") else "", r["status"]]))
    return lines


def plot(rows: list[dict], env: dict, path: Path, title: str) -> None:
    plt = pyplot()
    fwd = [r for r in rows if r["case"] == "fwd" and r.get("ms") and r["impl"] != "cuBLAS u W^T"
           and not r["impl"].startswith("Inductor")]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = [r["impl"] if r["impl"] != "triton fused" else f"triton {r['tile']}{' +pre' if r['store_pre'] else ''}"
              for r in fwd]
    ax.barh(range(len(fwd)), [r["ms"] for r in fwd], color=["tab:blue" if r["impl"] != "triton fused" else
                                                             "tab:orange" for r in fwd])
    ax.set_yticks(range(len(fwd)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms, one layer's x0 * (u W^T + b) + x")
    ax.set_title(f"{title}\n{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}", fontsize=9)
    ax.grid(True, axis="x", alpha=0.3)
    save_figure(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder (cross_layer.csv, .md, .png)")
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--width", type=int, default=3456, help="N = (F + 1) x D")
    ap.add_argument("--rank", type=int, default=512)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--tiles", default=DEFAULT_TILES, help="comma list: picked, or BMxBNxBKsSTAGESwWARPS")
    ap.add_argument("--calls", type=int, default=5, help="calls per captured graph")
    ap.add_argument("--windows", type=int, default=7, help="timed windows; the median is reported")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls before capture (compilation)")
    ap.add_argument("--smoke", action="store_true", help="batch 8, width 24, rank 4, two tiles, one call each")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    outputs = claim_outputs(ap, args, args.out, ["cross_layer.csv", "cross_layer.md", "cross_layer.png"])
    try:
        [parse_tile(t.strip()) for t in args.tiles.split(",")]
    except ValueError:
        ap.error(f"--tiles: {args.tiles!r} is not a comma list of 'picked' or BMxBNxBKsSTAGESwWARPS "
                 "(e.g. 64x128x64s4w4)")
    if args.smoke:
        # on a GPU the warm-up compiles (Triton, Inductor) before the capture (compiling inside a capture fails)
        args.batch, args.width, args.rank, args.calls, args.windows = 8, 24, 4, 1, 1
        args.warmup = 2 if torch.cuda.is_available() else 0
        args.tiles = "picked,64x128x64s4w4" if args.tiles == DEFAULT_TILES else args.tiles
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = environment(device)
    timer = lambda step: graph_replay_ms(step, args.calls, args.windows, args.warmup)  # noqa: E731
    rows = net_rows(args, device, timer) + fwd_rows(args, device, timer)
    for r in rows:
        print(f"{r['case']:12s} {r['impl']:32s} {str(r['tile']):16s} {str(r['store_pre']):8s} "
              f"{r.get('ms') or 0:8.3f} ms  {r['status']}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    title = f"DCNv2 cross network, batch {args.batch}, width {args.width}, rank {args.rank}, bf16"
    note = (f"{args.layers} layers for the network rows; {args.calls} calls a CUDA graph, median of {args.windows} "
            "windows." if device.type == "cuda"
            else "CPU smoke run: eager, the interpreter's tile, one call (a check of the script).")
    write_csv(out / "cross_layer.csv", rows, KEYS, env)
    (out / "cross_layer.md").write_text(markdown(title, [env_line(env), note], markdown_table(rows)))
    plot(rows, env, out / "cross_layer.png", title)
    outputs.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
