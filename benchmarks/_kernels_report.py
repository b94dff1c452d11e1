"""benchmarks/kernels.py's reporting: target verdicts, tables, the environment, CSV, Markdown and plots. Moved out of
kernels.py unchanged (the 600-line rule)."""

from __future__ import annotations

import csv
import datetime
import platform
import sys
from pathlib import Path
from typing import Optional

import torch
import triton

from _kernels_cases import DTYPES, IMPLS, MODES, SPECS, Spec

CSV_FIELDS = ["kernel", "family", "shape", "mode", "batch", "dtype", "impl", "ms", "metric", "value",
              "bytes", "flops", "note", "error"]  # fmt: skip


# ====================================================================================================
# Reporting: targets, tables, CSV, Markdown, plots
# ====================================================================================================


def fmt(v, digits=3) -> str:
    if v is None or v == "":
        return ""
    v = float(v)
    if v == 0 or abs(v) >= 100:
        return f"{v:.0f}"
    return f"{v:.{digits}g}"


def lookup(rows: list[dict], **key) -> Optional[dict]:
    for r in rows:
        if all(r.get(k) == v for k, v in key.items()) and r.get("ms") not in (None, ""):
            return r
    return None


def evaluate_targets(rows: list[dict], copy_gbps: float) -> list[dict]:
    """One verdict per (target, kernel, dtype), decided at the largest batch measured; all batches listed."""
    verdicts = []
    for spec in SPECS:
        for tgt in spec.targets:
            for dtype in sorted({r["dtype"] for r in rows if r["kernel"] == spec.name}):
                batches = sorted({r["batch"] for r in rows if r["kernel"] == spec.name and r["dtype"] == dtype and r["batch"] != ""})
                ratios = {}
                for b in batches:
                    mine = lookup(rows, kernel=spec.name, dtype=dtype, batch=b, mode=tgt.mode, impl=tgt.impl)
                    if mine is None:
                        continue
                    if tgt.reference == "copy":
                        ratios[b] = float(mine["value"]) / copy_gbps if copy_gbps else None
                    else:
                        ref = lookup(rows, kernel=spec.name, dtype=dtype, batch=b, mode=tgt.mode, impl=tgt.reference)
                        ratios[b] = float(ref["ms"]) / float(mine["ms"]) if ref else None
                measured = {b: r for b, r in ratios.items() if r is not None}
                if not measured:
                    verdict, ratio, at = "n/a", None, None
                else:
                    at = max(measured)
                    ratio = measured[at]
                    verdict = "PASS" if ratio >= tgt.threshold else "MISS"
                unit = "of copy BW" if tgt.reference == "copy" else f"x {tgt.reference}"
                verdicts.append({
                    "target": tgt.text, "kernel": spec.name, "dtype": dtype, "batch": at, "ratio": ratio,
                    "threshold": tgt.threshold, "unit": unit, "verdict": verdict,
                    "all": ", ".join(f"{b}: {fmt(r)}" for b, r in measured.items()),
                })  # fmt: skip
    return verdicts


def md_table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in body]
    return "\n".join(lines)


def verdict_table(verdicts: list[dict]) -> str:
    body = [[v["target"], v["kernel"], v["dtype"], v["batch"] or "", f"{fmt(v['ratio'])} {v['unit']}" if v["ratio"] is not None else "",
             f">= {v['threshold']:g}", f"**{v['verdict']}**", v["all"]] for v in verdicts]  # fmt: skip
    return md_table(["target", "kernel", "dtype", "B", "ratio", "needed", "verdict", "ratio per batch"], body)


def kernel_table(rows: list[dict], spec_name: str, metric: str, copy_gbps: float) -> str:
    """Pivot: one line per (mode, dtype, batch); per impl 'ms / metric' (+ % of copy BW for GB/s)."""
    mine = [r for r in rows if r["kernel"] == spec_name and r["mode"] != "*"]
    impls = [i for i in IMPLS if any(r["impl"] == i for r in mine)]
    refs = [i for i in ("eager", "compile") if i in impls and "triton" in impls]
    keys = sorted({(r["mode"], r["dtype"], r["batch"]) for r in mine}, key=lambda k: (MODES.index(k[0]), k[1], k[2]))
    body = []
    for mode, dtype, batch in keys:
        cells = []
        for impl in impls:
            r = next((r for r in mine if (r["mode"], r["dtype"], r["batch"], r["impl"]) == (mode, dtype, batch, impl)), None)
            if r is None:
                cells.append("")
            elif r.get("error"):
                cells.append("error")
            else:
                cell = f"{fmt(r['ms'])} ms / {fmt(r['value'])}"
                if metric == "GB/s" and copy_gbps:
                    cell += f" ({100 * float(r['value']) / copy_gbps:.0f}%)"
                cells.append(cell)
        speedups = []
        for ref in refs:
            a = lookup(mine, mode=mode, dtype=dtype, batch=batch, impl="triton")
            b = lookup(mine, mode=mode, dtype=dtype, batch=batch, impl=ref)
            speedups.append(f"{fmt(float(b['ms']) / float(a['ms']))}x" if a and b else "")
        body.append([mode, dtype, batch, *cells, *speedups])
    unit = f"ms / {metric}" + (" (% of copy BW)" if metric == "GB/s" else "")
    header = ["mode", "dtype", "B", *[f"{i} [{unit}]" for i in impls], *[f"triton speedup vs {r}" for r in refs]]
    return md_table(header, body)


def _allow_tf32_state() -> str:
    try:
        return str(torch.backends.cuda.matmul.allow_tf32)
    except RuntimeError:  # legacy/new TF32 APIs mixed somewhere: report the new one
        return f"fp32_precision={getattr(torch.backends.cuda.matmul, 'fp32_precision', '?')}"


def environment(device: torch.device, args) -> dict:
    env = {
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or platform.machine()}), Triton interpreter",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "CUDA": torch.version.cuda or "none",
        "python": platform.python_version(),
        "TF32 for fp32 GEMMs": f"{args.tf32} (torch.backends.cuda.matmul.allow_tf32 = {_allow_tf32_state()}, both sides)",
        "timing": (f"perf_counter median of {args.cpu_reps} calls (CPU interpreter: meaningless)" if device.type != "cuda"
                   else f"triton.testing.do_bench_cudagraph median, rep {args.rep_ms} ms: calls replayed from a CUDA graph, "
                   "device time without the host's launch cost, no L2 flush" if args.timing == "graph"
                   else f"triton.testing.do_bench median, warmup {args.warmup_ms} ms, rep {args.rep_ms} ms: each call "
                   "launched from Python, so host launch cost counts where it exceeds the kernel time"),
        "command": "python " + " ".join(sys.argv),
    }  # fmt: skip
    return env


WHY_MISSED = ("Why targets are missed, and how the launch-timed (`kernels.md`) and CUDA-graph-timed "
              "(`kernels_graph.md`) verdicts differ: benchmarks/PERF.md, section \"Kernels: launch-timed and device-timed\".")


def write_markdown(path: Path, rows: list[dict], verdicts: list[dict], env: dict, copy: tuple, cpu: bool, tag: str = "") -> str:
    copy_gbps, copy_ms, copy_bytes = copy
    title = "Triton kernel benchmarks" + (", CUDA-graph timing (device time)" if tag == "_graph" else "")
    parts = [f"# {title}", ""]
    if cpu:
        parts += ["> **CPU smoke run under TRITON_INTERPRET=1 with tiny shapes: the timings, bandwidths and verdicts "
                  "below are meaningless.**", ""]  # fmt: skip
    parts += [f"- **{k}**: {v}" for k, v in env.items()]
    parts += [f"- **copy bandwidth**: {fmt(copy_gbps)} GB/s (`dst.copy_(src)`, {copy_bytes / 2 / 2**20:.0f} MiB, "
              f"{fmt(copy_ms)} ms; bytes read + written / time)", ""]  # fmt: skip
    parts += ["Modes: `fwd`, `bwd` (backward alone, from a retained graph), `fwd+bwd`. Impls: `triton` (kernels/), "
              "`eager` (eager PyTorch; the linear layer is cuBLAS `F.linear` + a separate `relu`; the embedding "
              "backward is `index_add_` of `-lr * grad`, what SGD does with the sparse COO gradient), `compile` "
              "(`torch.compile` of the eager function, default mode), `triton_atomic` (fp32 embedding SGD "
              "with atomics, non-deterministic). GB/s count the bytes each op must minimally move (embedding: "
              "each distinct row once); TFLOP/s count 2MNK per GEMM (backward: 2 GEMMs).", ""]  # fmt: skip
    parts += ["## Targets", "", verdict_table(verdicts), "", WHY_MISSED, ""]
    for spec in SPECS:
        if not any(r["kernel"] == spec.name for r in rows):
            continue
        notes = sorted({r["note"] for r in rows if r["kernel"] == spec.name and r.get("note")})
        parts += [f"## {spec.name}: {spec.shape} ({spec.metric})", ""]
        parts += [f"![{spec.name}]({spec.name}{tag}.png)", ""]
        parts += [kernel_table(rows, spec.name, spec.metric, copy_gbps), ""]
        if notes:
            parts += ["Notes: " + "; ".join(notes[:6]), ""]
    errors = [r for r in rows if r.get("error")]
    if errors:
        parts += ["## Errors", ""]
        parts += [md_table(["kernel", "mode", "B", "dtype", "impl", "error"],
                           [[r["kernel"], r["mode"], r["batch"], r["dtype"], r["impl"], r["error"].replace("|", "\\|")] for r in errors]), ""]  # fmt: skip
    text = "\n".join(parts)
    path.write_text(text)
    return text


def write_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in CSV_FIELDS})


def read_csv(path: Path) -> list[dict]:
    """Rows of an earlier run (for --append), with numbers parsed back."""
    rows = []
    with path.open() as f:
        for r in csv.DictReader(f):
            for k in ("ms", "value", "bytes", "flops"):
                r[k] = float(r[k]) if r.get(k) else None
            r["batch"] = int(r["batch"]) if r.get("batch") not in (None, "") else ""
            rows.append(r)
    return rows


def plot_kernel(path: Path, rows: list[dict], spec: Spec, copy_gbps: float) -> bool:
    """xFormers style: x = batch size, y = GB/s or TFLOP/s, one line per impl (and dtype), one subplot per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [r for r in rows if r["kernel"] == spec.name and r.get("value") not in (None, "")]
    if not mine:
        return False
    fig, axes = plt.subplots(1, len(MODES), figsize=(5 * len(MODES), 4), squeeze=False)
    colors = {impl: f"C{i}" for i, impl in enumerate(IMPLS)}
    styles = {"fp32": "-", "bf16": "--"}
    for ax, mode in zip(axes[0], MODES):
        for impl in IMPLS:
            for dtype in DTYPES:
                pts = sorted((r["batch"], float(r["value"])) for r in mine if (r["mode"], r["impl"], r["dtype"]) == (mode, impl, dtype))
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, styles[dtype], marker="o", color=colors[impl], label=f"{impl} {dtype}")
        if spec.metric == "GB/s" and copy_gbps:
            ax.axhline(copy_gbps, color="grey", linestyle=":", label="copy bandwidth")
        ax.set_xscale("log", base=2)
        batches = sorted({r["batch"] for r in mine})
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.minorticks_off()
        ax.set_title(f"{spec.name} {mode}")
        ax.set_xlabel("batch size")
        ax.set_ylabel(spec.metric)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(f"{spec.name}: {spec.shape}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
