"""The cross network backward's elementwise passes (`kernels.cross_bwd_passes`) against Inductor's, at MLPerf's shapes.

    python benchmarks/cross_bwd_passes.py --out benchmarks/results --name cross_bwd_passes      # a CUDA GPU

MLPerf DLRM-DCNv2's 3-layer cross network (bf16, batch 65536, width 3456) makes three passes in its backward: the top
layer's ``g_pre = G * x0`` (3 [M, N] streams), the middle one's ``(G + T_2) * x0`` (4) and the first one's
``g_pre`` and ``dx0`` from ``G, T_2, T_1, x0`` and the three ``pre`` (9). Each is timed as what the per-layer ops
compile to (``torch.compile`` of the same formulas with ``db = g_pre.sum(0)``: Inductor's pointwise kernel and its
split reduction) and as the Triton kernel in several launches (BLOCK_M x BLOCK_N, rows a program, warps), each
checked against the PyTorch reference (max abs error). GB/s counts the [M, N] streams once each (the kernel's
fp32 partial sums are not counted). CUDA graphs, `_common.graph_replay_ms`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent))

from _common import env_line, environment, graph_replay_ms, markdown, md_row, write_csv  # noqa: E402
from _common import add_overwrite, claim_outputs  # noqa: E402

from kernels import cross_bwd_passes as passes  # noqa: E402

KEYS = ["pass", "impl", "launch", "ms", "gbps", "max_abs_err"]
LAUNCHES = "16x256r512w8,32x128r512w4,8x512r512w8,32x256r1024w8,16x128r256w4,64x128r512w8,16x256r2048w8"
# (name, T terms, with dx0, [M, N] streams moved)
PASSES = [("top layer: G * x0", 0, False, 3), ("middle: (G + T2) * x0", 1, False, 4),
          ("first: g_pre and dx0", 2, True, 9)]


def parse_launch(text: str) -> tuple[int, int, int, int]:
    """``"16x256r512w8"`` -> (BLOCK_M, BLOCK_N, ROWS, NUM_WARPS)."""
    tile, rest = text.split("r")
    rows, warps = rest.split("w")
    bm, bn = tile.split("x")
    return int(bm), int(bn), int(rows), int(warps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", default="cross_bwd_passes")
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--width", type=int, default=3456)
    ap.add_argument("--launches", default=LAUNCHES)
    ap.add_argument("--set-best", action="store_true", help="leave the fastest launch (summed over the passes) set "
                    "in kernels.cross_bwd_passes (for a caller in the same process)")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    outputs = claim_outputs(ap, args, args.out, [f"{args.name}.md", f"{args.name}.csv"])
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    M, N = args.batch, args.width
    gen = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda: torch.randn(M, N, generator=gen, device="cuda").to(torch.bfloat16)  # noqa: E731
    g, x0, t2, t1, p2, p1, p0 = (rnd() for _ in range(7))
    inputs = {0: (g, [], x0, None), 1: (g, [t2], x0, None), 2: (g, [t2, t1], x0, [p2, p1, p0])}
    compiled = torch.compile(passes.cross_backward_pass_reference)
    rows, totals = [], {}
    for name, terms, _, streams in PASSES:
        a = inputs[terms]
        want = passes.cross_backward_pass_reference(*a)
        gb = streams * M * N * 2 / 1e9

        def err(got):
            return max((x.double() - y.double()).abs().max().item() for x, y in zip(got, want) if x is not None)

        ms = graph_replay_ms(lambda: compiled(*a), calls=10, windows=5, warmup=3)
        rows.append({"pass": name, "impl": "Inductor (per-layer ops)", "launch": "", "ms": ms, "gbps": gb / ms * 1e3,
                     "max_abs_err": err(compiled(*a))})
        for launch in args.launches.split(","):
            passes.LAUNCH_OVERRIDE = parse_launch(launch)
            ms = graph_replay_ms(lambda: passes.cross_backward_pass(*a), calls=10, windows=5, warmup=3)
            rows.append({"pass": name, "impl": "Triton pass", "launch": launch, "ms": ms, "gbps": gb / ms * 1e3,
                         "max_abs_err": err(passes.cross_backward_pass(*a))})
            totals[launch] = totals.get(launch, 0.0) + ms
        for r in rows[-len(args.launches.split(",")) - 1:]:
            print(f"{r['pass']:24s} {r['impl']:26s} {r['launch']:14s} {r['ms']:.3f} ms {r['gbps']:7.0f} GB/s "
                  f"err {r['max_abs_err']:.3g}", flush=True)
    best = min(totals, key=totals.get)
    passes.LAUNCH_OVERRIDE = parse_launch(best) if args.set_best else None
    env = environment(torch.device("cuda"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = ["| pass | implementation | launch | ms | GB/s | max abs error |", "| --- | --- | --- | ---: | ---: | ---: |"]
    table += [md_row([r["pass"], r["impl"], r["launch"], f"{r['ms']:.3f}", f"{r['gbps']:.0f}",
                      f"{r['max_abs_err']:.3g}"]) for r in rows]
    inductor = sum(r["ms"] for r in rows if r["launch"] == "")
    note = (f"bf16, M = {M}, N = {N}. The three passes: Inductor {inductor:.3f} ms, the fastest launch ({best}) "
            f"{totals[best]:.3f} ms.")
    (out / f"{args.name}.md").write_text(markdown("The cross network backward's passes: Triton against Inductor",
                                                  [env_line(env), note], table))
    write_csv(out / f"{args.name}.csv", rows, KEYS, env)
    print(note)
    outputs.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
