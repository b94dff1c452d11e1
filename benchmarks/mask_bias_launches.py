"""The fused MLP's mask kernel (`kernels.mlp.mask_bias_grad`) over launches, at MLPerf DLRM-DCNv2's ReLU layers.

    python benchmarks/mask_bias_launches.py --out benchmarks/results --name mask_bias_launches   # a CUDA GPU
    python benchmarks/mask_bias_launches.py --smoke --out /tmp/mb                               # CPU: interpreter

The MLPerf step's backward runs the mask kernel once per ReLU layer (``gm = grad * (out > 0)`` and the bias
gradient's column sums, `kernels.mlp`): the top MLP's 1024, 1024, 512 and 256 columns and the bottom MLP's 512, 256
and 128, each [batch, N] bf16. Its launch (rows a loop step ``BLOCK_M``, warps, programs a SM) was chosen on an H100
(`kernels.heuristics.mask_bias_launch`; an H200 takes its own since this script measured it); this times every
layer under each launch of ``--launches`` (``BLOCK_MxWARPSpPROGRAMS``) and reports the sum over the layers, with
GB/s counting the two [batch, N] reads and one write. Each launch's results are checked against the launch this GPU
ships with (bit for bit for ``gm``; the bias sums within fp32 reordering). CUDA graphs
(`_common.graph_replay_ms`); on the CPU one call each (a check of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the Triton kernels run under the interpreter on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.append(str(Path(__file__).resolve().parent))

from _common import env_line, environment, graph_replay_ms, markdown, md_row, write_csv  # noqa: E402
from _common import add_overwrite, claim_outputs  # noqa: E402

from kernels import mlp  # noqa: E402

KEYS = ["launch", "widths", "batch", "ms", "gbps", "max_bias_diff", "status"]
WIDTHS = [1024, 1024, 512, 256, 512, 256, 128]  # MLPerf DLRM-DCNv2: top MLP's ReLU layers, then the bottom MLP's
LAUNCHES = "32x4p4,64x4p4,32x8p4,64x8p4,32x4p8,64x4p8,32x8p8,64x8p8,128x8p4,32x4p16"


def parse_launch(text: str) -> tuple[int, int, int]:
    """``"32x4p4"`` -> (BLOCK_M, warps, programs a SM)."""
    tile, programs = text.split("p")
    block_m, warps = tile.split("x")
    return int(block_m), int(warps), int(programs)


def run(launch: tuple[int, int, int], layers: list[tuple[torch.Tensor, torch.Tensor]], args) -> tuple[float, list]:
    """ms of all layers' mask kernels under ``launch`` (`kernels.mlp.MASK_LAUNCH_OVERRIDE`, then put back), and
    outputs."""
    saved = mlp.MASK_LAUNCH_OVERRIDE
    mlp.MASK_LAUNCH_OVERRIDE = launch
    try:
        outs = [mlp.mask_bias_grad(g, o, True) for g, o in layers]

        def step():
            for g, o in layers:
                mlp.mask_bias_grad(g, o, True)

        return graph_replay_ms(step, args.calls, args.windows, args.warmup), outs
    finally:
        mlp.MASK_LAUNCH_OVERRIDE = saved


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", default="mask_bias_launches")
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--launches", default=LAUNCHES, help="comma list of BLOCK_MxWARPSpPROGRAMS_PER_SM")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--windows", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="batch 64, fp32, one call (CPU: the interpreter)")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    outputs = claim_outputs(ap, args, args.out, [f"{args.name}.csv", f"{args.name}.md"])
    try:
        launches = [parse_launch(t.strip()) for t in args.launches.split(",") if t.strip()]
    except ValueError:
        ap.error(f"--launches: {args.launches!r} is not a comma list of BLOCK_MxWARPSpPROGRAMS (e.g. 32x4p4)")
    if not launches:
        ap.error("--launches names no launch")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.smoke:
        args.batch, args.calls, args.windows, args.warmup = 64, 1, 1, 0
    gen = torch.Generator(device=device).manual_seed(0)
    layers = [(torch.randn(args.batch, n, generator=gen, device=device).to(dtype),
               torch.randn(args.batch, n, generator=gen, device=device).relu_().to(dtype)) for n in WIDTHS]
    nbytes = sum(3 * g.numel() * g.element_size() for g, _ in layers)
    shipped = mlp._mask_launch(device)  # what this GPU runs (`kernels.heuristics.mask_bias_launch`)
    _, reference = run(shipped, layers, args)
    rows = []
    for launch in launches:
        name = f"{launch[0]}x{launch[1]}p{launch[2]}" + (" (shipped)" if launch == shipped else "")
        try:
            ms, outs = run(launch, layers, args)
            same = all(torch.equal(gm, ref_gm) for (gm, _), (ref_gm, _) in zip(outs, reference))
            bias = max(float((gb.float() - ref_gb.float()).abs().max()) for (_, gb), (_, ref_gb) in zip(outs, reference))
            row = dict(ms=ms, gbps=nbytes / (ms / 1e3) / 1e9, max_bias_diff=bias,
                       status="ok" if same else "failed: gm differs from the shipped launch's")
        except Exception as e:  # noqa: BLE001 -- one failing launch must not hide the others
            row = dict(status=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
        rows.append(dict(launch=name, widths=" ".join(map(str, WIDTHS)), batch=args.batch, **row))
        print(rows[-1], flush=True)
    env = environment(device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / f"{args.name}.csv", rows, KEYS, env)
    table = ["| launch (BLOCK_M x warps, programs a SM) | ms (7 layers) | GB/s | max bias-sum difference | status |",
             "| --- | ---: | ---: | ---: | --- |"]
    table += [md_row([r["launch"], f"{r['ms']:.4f}" if "ms" in r else "n/a", f"{r['gbps']:,.0f}" if "gbps" in r else "n/a",
                      f"{r['max_bias_diff']:.2e}" if "max_bias_diff" in r else "n/a", r["status"]]) for r in rows]
    about = (f"The mask kernel of each ReLU layer of MLPerf DLRM-DCNv2 ([{args.batch}, N] {str(dtype).split('.')[-1]}, "
             f"N = {', '.join(map(str, WIDTHS))}), all seven timed as one CUDA graph of {args.calls} calls, median of "
             f"{args.windows} windows; GB/s counts two reads and one write of each [batch, N].")
    (out / f"{args.name}.md").write_text(markdown("The fused MLP's mask kernel: launches", [env_line(env), about], table))
    outputs.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
