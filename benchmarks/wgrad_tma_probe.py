"""Probe: does feeding the fused weight-gradient GEMM by TMA lift it toward the copy bandwidth?

    python benchmarks/wgrad_tma_probe.py --out benchmarks/results/wgrad_tma_probe
    python benchmarks/wgrad_tma_probe.py --smoke --out /tmp/wtp     # tiny shapes (CPU: the interpreter)

PERF.md ("Where we are", issue #20) puts Kaggle bf16 at 94% of its 60M target, 0.07 ms a step short, and names the
lever: `kernels/wgrad.py`'s weight-gradient kernels stream g (and y) and x at 1.8-1.96 TB/s, 59-65% of the copy
bandwidth; at 85% they would save the whole 0.07 ms. This script compares, per layer of the Kaggle MLP (bf16, batch
65536), `kernels.wgrad.linear_wgrad`'s two kernels: pointer loads (``TMA_OPERANDS = False``) and the operand tiles
loaded by TMA tensor descriptors (``True``: every layer whose layout allows it; x keeps pointer loads where its row
stride is not 16-byte aligned, TMA's rule: the 13-wide first layer), at ``--stages`` pipeline depths
(``TMA_STAGES``). Same tiles and splits (`kernels.heuristics.pick_wgrad_launch`). Each result is checked against
float64 and CUDA-graph timed. Measured (results/wgrad_tma.md): only the masked layer gained clearly, so by default
only masked layers take TMA.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.append(str(Path(__file__).resolve().parent))

from _common import env_line, environment, graph_replay_ms, int_list, markdown, md_row, wall_ms, write_csv  # noqa: E402
from _common import add_overwrite, claim_outputs  # noqa: E402

import kernels.wgrad as wg  # noqa: E402
from kernels.wgrad import linear_wgrad  # noqa: E402

KAGGLE = [("bottom.0", 512, 13, True), ("bottom.1", 256, 512, False), ("bottom.2", 64, 256, False),
          ("bottom.3", 16, 64, False), ("top.0", 512, 368, False), ("top.1", 256, 512, False)]
SMOKE = [("a", 32, 13, True), ("b", 16, 32, False)]
KEYS = ["layer", "n_out", "n_in", "mask", "impl", "stages", "ms", "gbps", "max_abs_err", "status"]


def tma_wgrad(g, x, y, stages: int):
    """``(dW, db)`` in fp32 from `kernels.wgrad.linear_wgrad` with TMA forced on (`TMA_OPERANDS`, any layer whose
    layout allows it) at ``stages`` pipeline stages."""
    saved = wg.TMA_OPERANDS, wg.TMA_STAGES
    wg.TMA_OPERANDS, wg.TMA_STAGES = True, stages
    try:
        return linear_wgrad(g, x, y, weight_dtype=torch.float32, bias_dtype=torch.float32)
    finally:
        wg.TMA_OPERANDS, wg.TMA_STAGES = saved


def pointer_wgrad(g, x, y):
    """The same with TMA forced off: `kernels.wgrad`'s pointer-load kernel."""
    saved = wg.TMA_OPERANDS
    wg.TMA_OPERANDS = False
    try:
        return linear_wgrad(g, x, y, weight_dtype=torch.float32, bias_dtype=torch.float32)
    finally:
        wg.TMA_OPERANDS = saved


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--stages", default="3,4,5", help="comma list of pipeline depths for the TMA kernel")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--windows", type=int, default=7)
    ap.add_argument("--smoke", action="store_true", help="batch 67, two tiny layers, fp32 on the CPU")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    outputs = claim_outputs(ap, args, args.out, ["wgrad_tma_probe.csv", "wgrad_tma_probe.md"])
    cuda = torch.cuda.is_available()
    shapes, B = (SMOKE, 67) if args.smoke else (KAGGLE, args.batch)
    # a bad depth: one argparse line, not a traceback
    stages = int_list(ap, "--stages", args.stages) if not args.smoke else [2]
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    timer = (lambda f: graph_replay_ms(f, args.calls, args.windows, 3)) if cuda else wall_ms
    rows = []
    for layer, M, N, mask in shapes:
        gen = torch.Generator(device=device).manual_seed(0)
        g = torch.randn(B, M, generator=gen, device=device, dtype=dtype)
        y = torch.relu(torch.randn(B, M, generator=gen, device=device, dtype=dtype)) if mask else None
        x = torch.randn(B, N, generator=gen, device=device, dtype=dtype)
        gm = torch.where(y > 0, g, torch.zeros_like(g)).double() if mask else g.double()
        ref_w, ref_b = gm.t() @ x.double(), gm.sum(0)
        nbytes = (g.numel() * (2 if mask else 1) + x.numel()) * g.element_size()
        cases = [("pointer loads", "", lambda: pointer_wgrad(g, x, y))]
        cases += [("TMA", s, lambda s=s: tma_wgrad(g, x, y, s)) for s in stages]
        for impl, st, fn in cases:
            row = {"layer": layer, "n_out": M, "n_in": N, "mask": mask, "impl": impl, "stages": st}
            try:
                dw, db = fn()
                row["max_abs_err"] = max((dw.double() - ref_w).abs().max().item(), (db.double() - ref_b).abs().max().item())
                row["ms"] = timer(fn)
                row["gbps"] = nbytes / row["ms"] / 1e6
                row["status"] = "ok"
            except Exception as e:  # noqa: BLE001 - a variant that does not compile is a row, not a crash
                row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            rows.append(row)
            print(md_row([f"{row[k]:.4g}" if isinstance(row.get(k), float) else row.get(k, "") for k in KEYS]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(device)
    table = ["| " + " | ".join(KEYS) + " |", "|" + " --- |" * len(KEYS)]
    table += [md_row([f"{r[k]:.4g}" if isinstance(r.get(k), float) else r.get(k, "") for k in KEYS]) for r in rows]
    for impl in ["pointer loads"] + [f"TMA s{s}" for s in stages]:
        sel = [r for r in rows if (r["impl"] if not r["stages"] else f"TMA s{r['stages']}") == impl and r.get("ms")]
        if len(sel) == len(shapes):
            table.append(f"\nSum over the layers, {impl}: {sum(r['ms'] for r in sel):.4f} ms")
    write_csv(out / "wgrad_tma_probe.csv", rows, KEYS, env)
    (out / "wgrad_tma_probe.md").write_text(markdown(
        f"Weight gradient by TMA against kernels.wgrad, batch {B}, {str(dtype)[6:]}",
        [env_line(env), f"CUDA graphs of {args.calls} calls, median of {args.windows} windows; GB/s of g (and y) and "
         "x; max_abs_err against float64 (bf16 products summed in fp32 over the batch)."], table))
    outputs.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
