"""Probe: the MLPerf DLRM-DCNv2 step's GEMMs in every operand layout, and as FP8 GEMMs.

    python benchmarks/gemm_layout_probe.py --out benchmarks/results/gemm_layout_probe
    python benchmarks/gemm_layout_probe.py --smoke --out /tmp/glp     # tiny shapes (CPU: a check of the script)

The MLPerf step spends ~9.1 ms of 22 in cuBLAS GEMMs at 693 TFLOP/s on average, against 798 for an 8192^3 bf16
GEMM (PERF.md, "2026-11-24 (eighth run)"); its profile shows one kernel family at ~520 TFLOP/s. cuBLAS picks its
kernel by shape *and* operand layout, and the layouts are ours to choose: a weight can be handed to the GEMM as
stored or transposed (a free change inside the fused bf16 cast), and a weight gradient can be computed as
``dY^T X`` or as ``(X^T dY)^T``. So every GEMM of one training step (the cross network's ``V`` and ``W`` layers,
the top MLP's layers; forward ``Y = X W^T``, data gradient ``dX = dY W``, weight gradient ``dW = dY^T X``) is
timed as ``C[M, N] = A[M, K] B[K, N]`` with A and B each row- or column-major and C row-major (``mm(A, B)``) or
column-major (``mm(B^T, A^T)^T``): eight layouts. The row named ``as run`` is the layout eager PyTorch's
``F.linear`` and its backward hand to cuBLAS.

For the forward and data-gradient GEMMs (M = the batch) it also times ``torch._scaled_mm`` in FP8 (e4m3 x e4m3,
bf16 out) with one scale per tensor and with one scale per row of A and column of B ("rowwise", which needs no
amax over the batch), and Inductor's rowwise quantization of A (amax over K, scale, cast) as one compiled kernel:
what an FP8 cross network would add to each GEMM.

Timing: CUDA graphs of ``--calls`` calls replayed in ``--windows`` windows (`_common.graph_replay_ms`). On the CPU
(``--smoke``) fp32, one call each, no FP8: a check of the script, not a measurement.
Writes gemm_layout_probe.csv / .md / .png under ``--out`` (GPU name, versions, date).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    add_overwrite,
    claim_outputs,
    env_line, environment, graph_replay_ms, int_list, markdown, md_row, pyplot, save_figure, wall_ms, write_csv,
)

KEYS = ["gemm", "pass", "M", "N", "K", "impl", "a", "b", "c", "as_run", "ms", "tflops", "vs_as_run", "max_rel_err",
        "status"]
E4M3 = getattr(torch, "float8_e4m3fn", None)


def step_gemms(batch: int, width: int, rank: int, top: list[int]) -> list[tuple[str, str, int, int, int, str]]:
    """``(gemm, pass, M, N, K, as_run)`` of one training step: the cross layer's V (width -> rank) and W
    (rank -> width) and each top-MLP layer; ``as_run`` is the (A, B) layout eager PyTorch gives cuBLAS."""
    layers = [("cross V", width, rank), ("cross W", rank, width)]
    k = width
    for i, n in enumerate(top):
        if n % 16 == 0:  # the 1-wide logit layer is a GEMV, not a tensor-core GEMM
            layers.append((f"top.{i}", k, n))
        k = n
    out = []
    for name, k_in, n_out in layers:
        out.append((name, "fwd", batch, n_out, k_in, "row,col"))  # Y = X W^T: W [N, K] row-major is B col-major
        out.append((name, "dgrad", batch, k_in, n_out, "row,row"))  # dX = dY W
        out.append((name, "wgrad", n_out, k_in, batch, "col,row"))  # dW = dY^T X
    return out


def in_layout(t: torch.Tensor, major: str) -> torch.Tensor:
    """``t`` (row-major) with the same values, row- or column-major."""
    return t if major == "row" else t.t().contiguous().t()


def layout_rows(spec, args, device, dtype, timer) -> list[dict]:
    gemm, pas, M, N, K, as_run = spec
    gen = torch.Generator(device=device).manual_seed(0)
    a_ref = torch.randn(M, K, generator=gen, device=device, dtype=dtype)
    b_ref = torch.randn(K, N, generator=gen, device=device, dtype=dtype)
    ref = a_ref.double() @ b_ref.double()
    rows = []
    for a_major in ("row", "col"):
        for b_major in ("row", "col"):
            a, b = in_layout(a_ref, a_major), in_layout(b_ref, b_major)
            for c_major in ("row", "col"):
                if c_major == "row":
                    fn = lambda a=a, b=b: torch.mm(a, b)  # noqa: E731
                else:  # C^T = B^T A^T, read back transposed: C column-major
                    fn = lambda a=a, b=b: torch.mm(b.t(), a.t()).t()  # noqa: E731
                row = {"gemm": gemm, "pass": pas, "M": M, "N": N, "K": K, "impl": "bf16" if dtype == torch.bfloat16
                       else "fp32", "a": a_major, "b": b_major, "c": c_major,
                       "as_run": f"{a_major},{b_major}" == as_run and c_major == "row"}
                try:
                    got = fn()
                    assert got.stride(1 if c_major == "row" else 0) == 1, got.stride()
                    row["max_rel_err"] = ((got.double() - ref).abs().max() / ref.abs().max()).item()
                    row["ms"] = timer(fn)
                    row["status"] = "ok"
                except Exception as e:  # noqa: BLE001 - recorded in the row
                    row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:150]}"
                rows.append(row)
    return rows


def tensorwise_fp8(x: torch.Tensor, major: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` in e4m3 with one scale for the whole tensor, laid out row- or column-major, and that scale.

    ``torch._scaled_mm`` takes A row-major and B column-major only. The layout is made explicitly: an elementwise op
    keeps its input's strides, so ``(b.t() / s).to(e4m3).t()`` is B row-major again, which ``_scaled_mm`` refuses
    ("Only multiplication of row-major and column-major matrices is supported by cuBLASLt"; every tensorwise row
    of the probe failed so until 2026-11-29).
    """
    scale = x.abs().amax().float() / torch.finfo(E4M3).max
    q = (x.float() / scale).to(E4M3)
    return (q.contiguous() if major == "row" else q.t().contiguous().t()), scale


def fp8_rows(spec, device, timer) -> list[dict]:
    """FP8 e4m3 GEMMs (tensorwise and rowwise scales) and the rowwise quantization of A, for M = batch GEMMs."""
    gemm, pas, M, N, K, _ = spec
    gen = torch.Generator(device=device).manual_seed(7)
    a = torch.randn(M, K, generator=gen, device=device, dtype=torch.bfloat16)
    b = torch.randn(K, N, generator=gen, device=device, dtype=torch.bfloat16)
    ref = a.double() @ b.double()
    fmax = torch.finfo(E4M3).max
    base = {"gemm": gemm, "pass": pas, "M": M, "N": N, "K": K, "a": "row", "b": "col", "c": "row", "as_run": False}

    def quant_rows(x):  # one kernel under Inductor: amax over K, scale, saturating cast
        amax = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
        return (x.float() * (fmax / amax)).clamp(-fmax, fmax).to(E4M3), amax / fmax

    quant = torch.compile(quant_rows)
    aq, sa = quant(a)
    bq_t, sb_t = quant(b.t().contiguous())  # B's columns, as rows of B^T
    bq, sb = bq_t.t(), sb_t.t()  # column-major [K, N], scales [1, N]
    (aq_t, ta), (bq_tw, tb) = tensorwise_fp8(a, "row"), tensorwise_fp8(b, "col")
    out = []
    cases = [
        ("fp8 tensorwise", lambda: torch._scaled_mm(aq_t, bq_tw, scale_a=ta, scale_b=tb, out_dtype=torch.bfloat16)),
        ("fp8 rowwise", lambda: torch._scaled_mm(aq, bq, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)),
        ("rowwise quantize A (Inductor)", lambda: quant(a)),
    ]
    for impl, fn in cases:
        row = {**base, "impl": impl}
        try:
            got = fn()
            if impl.startswith("fp8"):
                row["max_rel_err"] = ((got.double() - ref).abs().max() / ref.abs().max()).item()
            row["ms"] = timer(fn)
            row["status"] = "ok"
        except Exception as e:  # noqa: BLE001 - recorded in the row
            row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:150]}"
        out.append(row)
    return out


def finish(rows: list[dict]) -> None:
    """TFLOP/s (not for the quantization rows) and each row's time against its GEMM's ``as run`` row."""
    as_run = {(r["gemm"], r["pass"]): r.get("ms") for r in rows if r["as_run"]}
    for r in rows:
        if r.get("ms"):
            if "quantize" not in r["impl"]:
                r["tflops"] = 2 * r["M"] * r["N"] * r["K"] / r["ms"] / 1e9
            base = as_run.get((r["gemm"], r["pass"]))
            if base:
                r["vs_as_run"] = base / r["ms"]


def summary(rows: list[dict]) -> list[str]:
    """One line per GEMM: as run, the best layout, FP8 rowwise (+ its quantization)."""
    lines = [md_row(["GEMM", "pass", "M x N x K", "as run: ms (TFLOP/s)", "best layout (A,B,C)", "best: ms (TFLOP/s)",
                     "fp8 rowwise ms", "+ quantize A ms"]),
             md_row(["---", "---", "---", "---:", "---", "---:", "---:", "---:"])]
    keys = list(dict.fromkeys((r["gemm"], r["pass"]) for r in rows))
    for key in keys:
        mine = [r for r in rows if (r["gemm"], r["pass"]) == key and r.get("ms")]
        layouts = [r for r in mine if r["impl"] in ("bf16", "fp32")]
        if not layouts:
            continue
        run = next((r for r in layouts if r["as_run"]), None)
        best = min(layouts, key=lambda r: r["ms"])
        fp8 = next((r for r in mine if r["impl"] == "fp8 rowwise"), None)
        qa = next((r for r in mine if r["impl"].startswith("rowwise quantize")), None)
        r0 = layouts[0]
        lines.append(md_row([
            key[0], key[1], f"{r0['M']} x {r0['N']} x {r0['K']}",
            f"{run['ms']:.3f} ({run['tflops']:.0f})" if run else "",
            f"{best['a']},{best['b']},{best['c']}", f"{best['ms']:.3f} ({best['tflops']:.0f})",
            f"{fp8['ms']:.3f}" if fp8 else "", f"{qa['ms']:.3f}" if qa else ""]))
    return lines


def plot(rows: list[dict], env: dict, path: Path) -> None:
    plt = pyplot()
    keys = list(dict.fromkeys((r["gemm"], r["pass"]) for r in rows if r["impl"] in ("bf16", "fp32")))
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(keys)), 4))
    for j, key in enumerate(keys):
        mine = [r for r in rows if (r["gemm"], r["pass"]) == key and r.get("tflops") and r["impl"] in ("bf16", "fp32")]
        ax.scatter([j] * len(mine), [r["tflops"] for r in mine], color="tab:gray", s=12)
        run = [r for r in mine if r["as_run"]]
        if run:
            ax.scatter([j], [run[0]["tflops"]], color="tab:red", s=30, label="as run" if j == 0 else None)
        fp8 = [r for r in rows if (r["gemm"], r["pass"]) == key and r["impl"] == "fp8 rowwise" and r.get("tflops")]
        if fp8:
            ax.scatter([j], [fp8[0]["tflops"]], color="tab:blue", marker="^", s=30,
                       label="fp8 rowwise" if not ax.get_legend_handles_labels()[1].count("fp8 rowwise") else None)
    ax.set_xticks(range(len(keys)), [f"{g}\n{p}" for g, p in keys], fontsize=7)
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"MLPerf DLRM-DCNv2 step GEMMs in 8 layouts (gray)\n{env_line(env)}", fontsize=8)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--width", type=int, default=3456, help="the cross network's width, (F + 1) x D")
    ap.add_argument("--rank", type=int, default=512)
    ap.add_argument("--top", default="1024,1024,512,256,1", help="the top MLP's widths")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--windows", type=int, default=7)
    ap.add_argument("--smoke", action="store_true", help="batch 64, width 48, rank 16, top 32,16,1; fp32 on the CPU")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    outputs = claim_outputs(ap, args, args.out,
                            ["gemm_layout_probe.csv", "gemm_layout_probe.md", "gemm_layout_probe.png"])
    cuda = torch.cuda.is_available()
    if args.smoke:
        args.batch, args.width, args.rank, args.top, args.calls, args.windows = 64, 48, 16, "32,16,1", 1, 1
    top = int_list(ap, "--top", args.top)  # a bad width: one argparse line, not a traceback
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    timer = (lambda f: graph_replay_ms(f, args.calls, args.windows, 3)) if cuda else wall_ms
    fp8 = cuda and E4M3 is not None and torch.cuda.get_device_capability() >= (8, 9)
    rows = []
    for spec in step_gemms(args.batch, args.width, args.rank, top):
        rows += layout_rows(spec, args, device, dtype, timer)
        if fp8 and spec[1] != "wgrad":
            rows += fp8_rows(spec, device, timer)
        print(f"{spec[0]} {spec[1]} done", flush=True)
    finish(rows)
    env = environment(device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "gemm_layout_probe.csv", rows, KEYS, env)
    table = [md_row(KEYS), md_row(["---"] * len(KEYS))]
    for r in rows:
        table.append(md_row([(f"{r[k]:.4g}" if isinstance(r.get(k), float) else r.get(k, "")) for k in KEYS]))
    (out / "gemm_layout_probe.md").write_text(markdown(
        "MLPerf DLRM-DCNv2 step GEMMs: every operand layout, and FP8",
        [env_line(env), f"batch {args.batch}, width {args.width}, rank {args.rank}, top {args.top}; CUDA graphs of "
         f"{args.calls} calls, median of {args.windows} windows. A, B, C: row- or column-major; 'as run' is eager "
         "PyTorch's layout. vs_as_run > 1: faster than as run.", "\n".join(summary(rows))], table))
    plot(rows, env, out / "gemm_layout_probe.png")
    print("\n".join(summary(rows)))
    outputs.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
