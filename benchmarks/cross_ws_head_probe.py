"""The top MLP's first data-gradient GEMM and the cross network's top backward pass: cuBLAS + the Triton pass against
one Gluon kernel (`kernels.cross_ws_head`), at MLPerf DLRM-DCNv2's shapes.

    python benchmarks/cross_ws_head_probe.py --out benchmarks/results --name cross_ws_head_probe     # a Hopper GPU

For ``gm`` [M, K] (the top MLP's first masked gradient, K = 1024), its weight ``W`` [K, N] and the cross network's
input ``x0`` [M, N] (N = 3456), bf16, batch M = 65536: ``G = gm @ W``, ``g_pre = G * x0`` and the fp32 column sums
of ``g_pre``. Timed, in CUDA graphs (`_common.graph_replay_ms`): cuBLAS's GEMM alone, the pass alone
(`kernels.cross_bwd_passes.cross_backward_pass` with no T term, what the MLPerf step runs today), the two in a row,
and the fused kernel in each ``--configs`` launch; every output checked against the two-kernel path (max abs
error of G, g_pre and db). TFLOP/s counts the GEMM's 2MNK; GB/s the fused kernel's three [M, N] streams (x0 read,
G and g_pre written). Writes ``<name>.md`` / ``.csv``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent))

from _common import env_line, environment, graph_replay_ms, markdown, md_row, write_csv  # noqa: E402
from _common import add_overwrite, claim_outputs  # noqa: E402

KEYS = ["impl", "launch", "ms", "tflops", "gbps", "err_g", "err_gpre", "err_db"]
CONFIGS = "128x128x64s4e2,128x128x64s4e4,128x128x64s3e2,128x128x64s3e4"


def parse_config(text: str):
    """``"128x128x64s4e2"`` -> a coop `WsConfig` (BM x BN x BK, ring slots, x0 slice slots)."""
    from kernels.cross_ws import WsConfig

    tile, rest = text.split("s")
    stages, epi = rest.split("e")
    bm, bn, bk = (int(v) for v in tile.split("x"))
    return WsConfig(bm=bm, bn=bn, bk=bk, stages=int(stages), schedule="coop", sub=32, epi_stages=int(epi))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", default="cross_ws_head_probe")
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--width", type=int, default=3456)
    ap.add_argument("--hidden", type=int, default=1024, help="the top MLP's first width (the GEMM's K)")
    ap.add_argument("--configs", default=CONFIGS, help="comma list of BMxBNxBKsSTAGESeEPI_STAGES")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--windows", type=int, default=7)
    add_overwrite(ap)
    args = ap.parse_args(argv)
    outputs = claim_outputs(ap, args, args.out, [f"{args.name}.csv", f"{args.name}.md"])
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):
        ap.error("needs a Hopper GPU (the Gluon kernel has no interpreter)")
    from kernels.cross_bwd_passes import cross_backward_pass
    from kernels.cross_ws_head import cross_head_ws

    dev = torch.device("cuda")
    M, N, K = args.batch, args.width, args.hidden
    gen = torch.Generator(device=dev).manual_seed(0)
    gm = torch.randn(M, K, generator=gen, device=dev).relu_().to(torch.bfloat16)
    w = (torch.randn(K, N, generator=gen, device=dev) * K ** -0.5).to(torch.bfloat16)
    x0 = torch.randn(M, N, generator=gen, device=dev).to(torch.bfloat16)
    flops = 2.0 * M * N * K
    stream_bytes = 3 * M * N * 2

    ref_g = gm @ w
    ref_gpre, ref_db, _ = cross_backward_pass(ref_g, [], x0, None, torch.float32)

    def err(a, b):
        return float((a.float() - b.float()).abs().max())

    rows = []

    def add(impl, launch, fn, outs=None):
        ms = graph_replay_ms(fn, args.calls, args.windows, warmup=2)
        row = dict(impl=impl, launch=launch, ms=ms, tflops=flops / ms / 1e9, gbps=stream_bytes / ms / 1e6)
        if outs is not None:
            g, gpre, db = outs()
            row.update(err_g=err(g, ref_g), err_gpre=err(gpre, ref_gpre), err_db=err(db, ref_db))
        rows.append(row)
        print(row, flush=True)

    add("cuBLAS gm @ W", "-", lambda: gm @ w)
    add("pass g_pre = G * x0, db", "-", lambda: cross_backward_pass(ref_g, [], x0, None, torch.float32))
    add("cuBLAS + pass (today)", "-", lambda: cross_backward_pass(gm @ w, [], x0, None, torch.float32))
    for text in (t.strip() for t in args.configs.split(",") if t.strip()):
        cfg = parse_config(text)
        try:
            add("Gluon head kernel", text, lambda cfg=cfg: cross_head_ws(gm, w, x0, cfg), lambda cfg=cfg: cross_head_ws(gm, w, x0, cfg))
        except Exception as e:  # noqa: BLE001 -- one failing launch must not hide the others
            rows.append(dict(impl="Gluon head kernel", launch=text, ms=float("nan")))
            print("failed", text, type(e).__name__, str(e)[:300], flush=True)

    env = environment(dev)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / f"{args.name}.csv", rows, KEYS, env)
    fmt = lambda v, f: "n/a" if v is None or v != v else format(v, f)  # noqa: E731
    table = ["| impl | launch | ms | TFLOP/s (GEMM) | GB/s (3 streams) | max err G | max err g_pre | max err db |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    table += [md_row([r["impl"], r["launch"], fmt(r.get("ms"), ".3f"), fmt(r.get("tflops"), ".0f"),
                      fmt(r.get("gbps"), ",.0f"), fmt(r.get("err_g"), ".2e"), fmt(r.get("err_gpre"), ".2e"),
                      fmt(r.get("err_db"), ".2e")]) for r in rows]
    note = (f"M = {M}, N = {N}, K = {K}, bf16; CUDA-graph replay, median of {args.windows} windows of {args.calls} "
            "calls. Errors against cuBLAS + the pass (the path the step runs today).")
    text = markdown("The top MLP's first data-gradient GEMM with the cross network's top pass fused", [env_line(env), note],
                    table)
    (out / f"{args.name}.md").write_text(text)
    print(text, end="")
    outputs.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
