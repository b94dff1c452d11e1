"""The fused weight gradient (kernels/wgrad.py) against PyTorch at the MLP layers' shapes (issue #20).

    python benchmarks/wgrad.py --out benchmarks/results --name wgrad
    python benchmarks/wgrad.py --smoke --out /tmp/wgrad            # tiny shapes (CPU: the interpreter)
    python benchmarks/wgrad.py --sweep --out benchmarks/results   # plus every launch in SWEEP per shape

One case is a layer's backward without its input gradient: given the output gradient g [B, N_out], the
ReLU output y and the input x [B, N_in] (bf16, as under bf16 autocast), produce ``dW = gm^T x`` and
``db = gm.sum(0)`` in fp32 (the parameters' dtype), with ``gm = g * (y > 0)`` for the masked rows
("mask" column: the first bottom layer, whose masked gradient feeds only dW and db) and gm = g given
otherwise (the layers whose gm also feeds the input gradient, so it exists anyway). Implementations:

* ``torch``: eager PyTorch: ``torch.where`` (masked rows), ``gm.t() @ x`` (cuBLAS), ``gm.sum(0)``, casts;
* ``inductor``: the same function under ``torch.compile`` (mode default: cuBLAS GEMM, Triton passes);
* ``triton``: `kernels.wgrad.linear_wgrad` with `kernels.heuristics.pick_wgrad_launch`'s launch;
* ``triton[BMxBNxBB/WxS/splits]`` (``--sweep``): forced launches.

Every implementation is CUDA-graph timed (`_common.graph_replay_ms`); the table gives ms per call and
the bytes of g (and y) and x over that time. Writes <name>.csv / .md / .png with GPU, versions and date.
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

from _common import env_line, environment, graph_replay_ms, markdown, md_row, pyplot, save_figure, write_csv  # noqa: E402
from _common import add_overwrite, claim_outputs  # noqa: E402

from kernels import heuristics  # noqa: E402
from kernels.wgrad import linear_wgrad  # noqa: E402

# (model, layer, N_out, N_in, mask): every ReLU layer's weight gradient of the Kaggle and Terabyte MLPs; the
# last top layer (N_out 1) has no ReLU. mask=True only where nothing else reads the masked gradient.
SHAPES = [
    ("kaggle", "bottom.0", 512, 13, True), ("kaggle", "bottom.1", 256, 512, False),
    ("kaggle", "bottom.2", 64, 256, False), ("kaggle", "bottom.3", 16, 64, False),
    ("kaggle", "top.0", 512, 368, False), ("kaggle", "top.1", 256, 512, False), ("kaggle", "top.2", 1, 256, False),
    ("terabyte", "bottom.0", 512, 13, True), ("terabyte", "bottom.1", 256, 512, False),
    ("terabyte", "bottom.2", 128, 256, False), ("terabyte", "top.0", 1024, 480, False),
    ("terabyte", "top.1", 1024, 1024, False), ("terabyte", "top.2", 512, 1024, False),
    ("terabyte", "top.3", 256, 512, False), ("terabyte", "top.4", 1, 256, False),
]
SMOKE_SHAPES = [("smoke", "a", 37, 13, True), ("smoke", "b", 16, 40, False)]

SWEEP = [heuristics.WgradLaunch(*c) for c in [
    (128, 128, 64, 8, 3, 0), (128, 128, 64, 4, 3, 0), (128, 64, 64, 4, 3, 0), (64, 128, 64, 4, 3, 0),
    (64, 64, 64, 4, 3, 0), (128, 128, 32, 8, 4, 0), (128, 128, 128, 8, 2, 0), (64, 64, 128, 4, 3, 0),
]]
KEYS = ["model", "layer", "n_out", "n_in", "mask", "impl", "ms", "gb_per_s"]


def torch_wgrad(g, y, x, mask: bool):
    gm = torch.where(y > 0, g, torch.zeros_like(g)) if mask else g
    return (gm.t() @ x).float(), gm.sum(0).float()


def _with_launch(launch, B, M, N, dtype, sms):
    """A swept launch: splits 0 means the heuristic's split count for that tile."""
    if launch.splits:
        return launch
    tiles = -(-M // launch.block_m) * -(-N // launch.block_n)
    return launch._replace(splits=max(1, min(-(-2 * sms // tiles), B // (8 * launch.block_b))))


def measure(B, M, N, mask, dtype, device, impls, sweep, calls, windows):
    g = torch.randn(B, M, device=device, dtype=dtype)
    y = torch.relu(torch.randn(B, M, device=device, dtype=dtype))
    x = torch.randn(B, N, device=device, dtype=dtype)
    nbytes = (g.numel() * (2 if mask else 1) + x.numel()) * g.element_size()
    ref_w, ref_b = torch_wgrad(g.double(), y.double(), x.double(), mask)
    compiled = torch.compile(torch_wgrad, dynamic=False) if "inductor" in impls else None
    cases = {}
    if "torch" in impls:
        cases["torch"] = lambda: torch_wgrad(g, y, x, mask)
    if compiled is not None:
        cases["inductor"] = lambda: compiled(g, y, x, mask)
    if "triton" in impls:
        cases["triton"] = lambda: linear_wgrad(g, x, y if mask else None, weight_dtype=torch.float32, bias_dtype=torch.float32)
    sms = heuristics.sm_count(device)
    launches = [_with_launch(l, B, M, N, dtype, sms) for l in sweep]
    rows = []
    for name, fn in list(cases.items()) + [(f"triton[{l.block_m}x{l.block_n}x{l.block_b}/{l.num_warps}x{l.num_stages}/{l.splits}]", l)
                                           for l in launches]:
        if isinstance(fn, heuristics.WgradLaunch):
            launch = fn

            def fn(launch=launch):
                heuristics.WGRAD_LAUNCH_OVERRIDE = launch
                try:
                    return linear_wgrad(g, x, y if mask else None, weight_dtype=torch.float32, bias_dtype=torch.float32)
                finally:
                    heuristics.WGRAD_LAUNCH_OVERRIDE = None
            if launch.block_m > max(16, M) * 2 or launch.block_n > max(16, N) * 2:
                continue  # a tile twice the output's side: nothing to learn
        try:
            dw, db = fn()
            # bf16 products summed in fp32 over B rows: the error grows like sqrt(B) * |g| |x| * 2^-8
            tol = 2e-2 * (B ** 0.5)
            err = max((dw.double() - ref_w).abs().max().item(), (db.double() - ref_b).abs().max().item())
            ok = err <= tol
            ms = graph_replay_ms(lambda: fn(), calls, windows, warmup=3)
            rows.append({"impl": name, "ms": ms, "gb_per_s": nbytes / ms / 1e6, "status": "" if ok else f"WRONG ({err:.3g})"})
        except Exception as e:  # noqa: BLE001 -- one failing launch must not hide the others
            rows.append({"impl": name, "ms": float("nan"), "gb_per_s": float("nan"), "status": f"failed: {str(e).splitlines()[0][:80]}"})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--impls", default="torch,inductor,triton")
    ap.add_argument("--sweep", action="store_true", help="also time every launch in SWEEP")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, fp32 (CPU: the interpreter)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="wgrad")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    outputs = claim_outputs(ap, args, args.out, [f"{args.name}.csv", f"{args.name}.md", f"{args.name}.png"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes, B = (SMOKE_SHAPES, 67) if args.smoke else (SHAPES, args.batch)
    dtype = torch.float32 if args.smoke or device.type == "cpu" else torch.bfloat16
    impls = args.impls.split(",")
    if device.type == "cpu":
        impls = [i for i in impls if i != "inductor"]
    sweep = SWEEP if args.sweep and device.type == "cuda" else []
    # one compiled graph per shape: Dynamo's default limit (8) would run the later shapes' "inductor" rows eagerly
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    env = environment(device)
    rows = []
    for model, layer, m, n, mask in shapes:
        for r in measure(B, m, n, mask, dtype, device, impls, sweep, 2 if args.smoke else args.calls, 1 if args.smoke else args.windows):
            row = {"model": model, "layer": layer, "n_out": m, "n_in": n, "mask": mask, **r}
            rows.append(row)
            print(f"{model:>8} {layer:>9} {m:>5}x{n:<5} mask={mask!s:5} {r['impl']:>28}: {r['ms']:.4f} ms "
                  f"{r['gb_per_s']:7.0f} GB/s {r['status']}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / f"{args.name}.csv", rows, KEYS + ["status"], {**env, "batch": B, "dtype": str(dtype)})
    table = ["| model | layer | dW | mask | impl | ms | GB/s of g, y, x | status |", "| --- | --- | --- | --- | --- | ---: | ---: | --- |"]
    table += [md_row([r["model"], r["layer"], f"{r['n_out']}x{r['n_in']}", r["mask"], r["impl"], f"{r['ms']:.4f}",
                      f"{r['gb_per_s']:.0f}", r["status"]]) for r in rows]
    totals = {}
    for r in rows:
        if r["impl"] in ("torch", "inductor", "triton"):
            totals.setdefault((r["model"], r["impl"]), 0.0)
            totals[(r["model"], r["impl"])] += r["ms"]
    summary = ["Sum over a model's layers, ms: " + "; ".join(f"{m} {i} {v:.3f}" for (m, i), v in sorted(totals.items()))]
    (out / f"{args.name}.md").write_text(markdown(f"Weight gradient with bias sum and ReLU mask fused, batch {B}, {dtype}",
                                                  [env_line(env)] + summary, table))
    plt = pyplot()
    if plt is not None:
        labels = [f"{r['model'][:2]} {r['layer']}" for r in rows if r["impl"] == "torch"]
        fig, ax = plt.subplots(figsize=(10, 4))
        width = 0.27
        for k, impl in enumerate(i for i in ("torch", "inductor", "triton") if i in impls):
            vals = [r["ms"] for r in rows if r["impl"] == impl]
            ax.bar([i + (k - 1) * width for i in range(len(vals))], vals, width, label=impl)
        ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right")
        ax.set_ylabel("ms per call")
        ax.set_title(f"weight gradient + bias sum (+ ReLU mask), batch {B}, {env['device']}")
        ax.legend()
        save_figure(fig, out / f"{args.name}.png")
    outputs.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
