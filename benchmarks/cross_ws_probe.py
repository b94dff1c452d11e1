"""Probe: the warp-specialized Gluon cross-layer forward (`kernels.cross_ws`) against what the step runs.

    python benchmarks/cross_ws_probe.py --out benchmarks/results/cross_ws_probe      # a Hopper GPU

One MLPerf DLRM-DCNv2 cross layer's second half, ``out = x0 * (u W^T + b) + x`` (bf16, batch 65536, width 3456,
rank 512), as cuBLAS's GEMM + Inductor's elementwise pass (what the compiled step runs), as `kernels.cross`'s tiled
Triton kernel, and as the ping-pong Gluon kernel in several launches; each with ``pre`` saved or not, and for the
first layer (``x`` is ``x0``). Every row is checked against a float64 reference (max abs error) and timed as CUDA
graphs (`_common.graph_replay_ms`). A launch that fails to compile or run is a row with its error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent))

from _common import env_line, environment, graph_replay_ms, markdown, md_row, write_csv  # noqa: E402
from _common import add_overwrite, claim_outputs  # noqa: E402

KEYS = ["impl", "config", "layer", "store_pre", "ms", "gbps", "tflops", "max_abs_err", "status"]
DEFAULT_CONFIGS = ",".join([
    "64x128x64s4r232", "coop:128x128x64s3u32q4m8r160e4", "coop:128x128x64s4u32q2m8r160e4",
    "coop:128x128x64s4u16q4m8r160e4", "coop:128x128x64s4u32q2m8r128e4", "coop:128x128x64s4u64q1m8r160e4",
])


BACKWARD_CONFIGS = "coop:128x128x64s4u32q1m8r160e4,coop:128x128x64s3u32q2m8r160e4,coop:128x128x64s4u16q2m8r160e4"


def _backward_rows(args, rows, timer, keys) -> None:
    """The backward's ``dx = g + du V`` with the next layer's ``g_pre = dx * x0`` and ``dx0 += dx * pre`` (a layer
    above the first: "later"), or ``dx0 += g + du V`` (the first layer), as cuBLAS + an Inductor pass and as
    `kernels.cross_ws_bwd`; rows appended to ``rows``."""
    from kernels.cross_ws_bwd import cross_backward_ws

    B, N, r = args.batch, args.width, args.rank
    gen = torch.Generator(device="cuda").manual_seed(1)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=gen, device="cuda") * scale).to(torch.bfloat16)  # noqa: E731
    du, v = rnd(B, r), rnd(r, N, scale=r ** -0.5)
    g, x0, pre, dx0 = rnd(B, N), rnd(B, N), rnd(B, N), rnd(B, N)
    ref_dx = g.double() + du.double() @ v.double()
    refs = {"later": (ref_dx, ref_dx * x0.double(), dx0.double() + ref_dx * pre.double()),
            "first": (dx0.double() + ref_dx,)}

    def later(du, v, g, x0, pre, dx0):
        dx = g + du @ v
        return dx, dx * x0, dx0 + dx * pre

    def first(du, v, g, dx0):
        return (dx0 + (g + du @ v),)

    compiled = {"later": torch.compile(later), "first": torch.compile(first)}
    for layer in ("later", "first"):
        streams = 7 if layer == "later" else 3

        def add(impl, config, fn, check):
            row = {"impl": impl, "config": config, "layer": f"backward, {layer}", "store_pre": ""}
            try:
                got = check()
                row["max_abs_err"] = max((a.double() - b).abs().max().item() for a, b in zip(got, refs[layer]))
                row["ms"] = timer(fn)
                row["gbps"] = (B * r + N * r + streams * B * N) * 2 / row["ms"] / 1e6
                row["tflops"] = 2 * B * N * r / row["ms"] / 1e9
                row["status"] = "ok"
            except Exception as e:  # noqa: BLE001 - a launch that fails is a row, not a crash
                row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            rows.append(row)
            print(md_row([f"{row[k]:.4g}" if isinstance(row.get(k), float) else row.get(k, "") for k in keys]),
                  flush=True)

        if layer == "later":
            base = lambda: compiled["later"](du, v, g, x0, pre, dx0)  # noqa: E731
        else:
            base = lambda: compiled["first"](du, v, g, dx0)  # noqa: E731
        add("cuBLAS du V + Inductor pass", "", base, base)
        for text in args.backward_configs.split(","):
            cfg = parse_config(text.strip())
            acc = dx0.clone()

            def run(cfg=cfg, acc=acc, layer=layer):
                return cross_backward_ws(du, v, g, x0, pre if layer == "later" else None, acc, config=cfg)

            def check(cfg=cfg, layer=layer):
                fresh = dx0.clone()
                res = cross_backward_ws(du, v, g, x0, pre if layer == "later" else None, fresh, config=cfg)
                return (res[0], res[1], fresh) if layer == "later" else (fresh,)

            add("Gluon coop backward (kernels.cross_ws_bwd)", repr(cfg), run, check)


def parse_config(text: str):
    """``BMxBNxBKsSTAGESrREGS`` (ping-pong) or
    ``coop:BMxBNxBKsSTAGESuSUBqEPI_STAGESmMMA_WARPSrMMA_REGSeEPI_WARPS``."""
    import re

    from kernels.cross_ws import WsConfig

    if text.startswith("coop:"):
        m = re.fullmatch(r"(\d+)x(\d+)x(\d+)s(\d+)u(\d+)q(\d+)m(\d+)r(\d+)e(\d+)", text[5:])
        bm, bn, bk, stages, sub, es, mw, mr, ew = (int(v) for v in m.groups())
        return WsConfig(bm=bm, bn=bn, bk=bk, stages=stages, schedule="coop", sub=sub, epi_stages=es, mma_warps=mw,
                        mma_regs=mr, epi_warps=ew)
    dims, rest = text.split("s", 1)
    stages, regs = rest.split("r")
    bm, bn, bk = (int(v) for v in dims.split("x"))
    return WsConfig(bm=bm, bn=bn, bk=bk, stages=int(stages), consumer_regs=int(regs), schedule="pingpong")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--width", type=int, default=3456)
    ap.add_argument("--rank", type=int, default=512)
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma list of BMxBNxBKsSTAGESrREGS")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--windows", type=int, default=7)
    ap.add_argument("--backward", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the backward's data-gradient GEMM with its epilogue (kernels.cross_ws_bwd)")
    ap.add_argument("--backward-configs", default=BACKWARD_CONFIGS, help="comma list of coop configs (see --configs)")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    outputs = claim_outputs(ap, args, args.out, ["cross_ws_probe.csv", "cross_ws_probe.md"])
    if not torch.cuda.is_available():
        print("cross_ws_probe: needs a CUDA GPU (Gluon has no interpreter)", file=sys.stderr)
        return 2
    from kernels.cross import cross_forward
    from kernels.cross_ws import cross_forward_ws

    device = torch.device("cuda")
    B, N, r = args.batch, args.width, args.rank
    gen = torch.Generator(device=device).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=gen, device=device).to(torch.bfloat16)  # noqa: E731
    x0, x, u, b = rnd(B, N), rnd(B, N), rnd(B, r), torch.randn(N, generator=gen, device=device)
    w = (torch.randn(N, r, generator=gen, device=device) * r ** -0.5).to(torch.bfloat16)
    ref_pre = u.double() @ w.double().t() + b.double()
    refs = {"later": x0.double() * ref_pre + x.double(), "first": x0.double() * ref_pre + x0.double()}
    timer = lambda f: graph_replay_ms(f, args.calls, args.windows, 3)  # noqa: E731
    rows = []

    def elementwise(x0, y, b, x):
        return x0 * (y + b.to(y.dtype)) + x

    compiled = torch.compile(elementwise)

    def add(impl, config, layer, store_pre, fn, timed=None):
        row = {"impl": impl, "config": config, "layer": layer, "store_pre": store_pre}
        try:
            got, got_pre = fn()
            err = (got.double() - refs[layer]).abs().max().item()
            if got_pre is not None:
                err = max(err, (got_pre.double() - ref_pre).abs().max().item())
            row["max_abs_err"] = err
            row["ms"] = timer(timed or fn)
            streams = (1 if layer == "first" else 2) + (2 if store_pre else 1)
            row["gbps"] = (B * r + N * r + streams * B * N) * 2 / row["ms"] / 1e6
            row["tflops"] = 2 * B * N * r / row["ms"] / 1e9
            row["status"] = "ok"
        except Exception as e:  # noqa: BLE001 - a launch that fails is a row, not a crash
            row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        rows.append(row)
        print(md_row([f"{row[k]:.4g}" if isinstance(row.get(k), float) else row.get(k, "") for k in KEYS]), flush=True)

    for layer, xx in (("later", x), ("first", x0)):
        def step(xx=xx):  # the compiled step's: y saved for the backward, which adds b itself
            y = torch.mm(u, w.t())
            return compiled(x0, y, b, xx), y

        add("cuBLAS u W^T + Inductor pass (the step's; saves y)", "", layer, True,
            lambda step=step: (lambda o, y: (o, y + b.to(y.dtype)))(*step()), timed=step)
        add("kernels.cross (tiled Triton)", "picked", layer, True,
            lambda xx=xx: cross_forward(x0, xx, u, w, b.to(x0.dtype), store_pre=True))
        for text in args.configs.split(","):
            cfg = parse_config(text.strip())
            for store in (True, False):
                add(f"Gluon {cfg.schedule} (kernels.cross_ws)", repr(cfg), layer, store,
                    lambda cfg=cfg, store=store, xx=xx: cross_forward_ws(x0, xx, u, w, b, store_pre=store, config=cfg))
    if args.backward:
        _backward_rows(args, rows, timer, KEYS)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(device)
    title = ("DCNv2 cross layer forward x0 * (u W^T + b) + x" + (" and backward dx = g + du V with the next layer's "
             "elementwise work" if args.backward else "") + f", batch {B}, width {N}, rank {r}, bf16")
    table = ["| " + " | ".join(KEYS) + " |", "|" + " --- |" * len(KEYS)]
    for row in rows:
        table.append(md_row([f"{row[k]:.4g}" if isinstance(row.get(k), float) else row.get(k, "") for k in KEYS]))
    note = (f"CUDA graphs of {args.calls} calls, median of {args.windows} windows; GB/s counts u and W read, x0 (and "
            "x) read, out (and pre) written; backward rows: du and V read, g, x0, pre, dx0 read and dx, g_pre, dx0 written "
            "(later layers) or g, dx0 read and dx0 written (the first); max_abs_err against a float64 reference (bf16 "
            "outputs).")
    write_csv(out / "cross_ws_probe.csv", rows, KEYS, env)
    (out / "cross_ws_probe.md").write_text(markdown(title, [env_line(env), note], table))
    outputs.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
