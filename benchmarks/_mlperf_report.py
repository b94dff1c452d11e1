"""benchmarks/mlperf_dcnv2.py's results: the comparisons, the Markdown table and floor lines, the plot, and the CSV read
back (--append) and written. Moved out of mlperf_dcnv2.py unchanged (the 600-line rule)."""

from __future__ import annotations

import csv
import textwrap
from pathlib import Path

from _common import env_line, markdown, md_row, pyplot, save_figure, write_csv

TARGET = 4.0e6  # the issue's target at batch 65536, samples/s
TARGET_BATCH = 65536
HUGECTR = 1.95e6  # best published per-GPU figure (HugeCTR, H100), samples/s, for context
ISSUE_BASELINE = {65536: 1.14e6, 16384: 1.10e6}  # the issue's baseline measurement on an H100
BASELINE = "baseline"
KEYS = ["impl", "batch_size", "dense_optim", "embedding_dtype", "table_rows", "samples_per_sec",
        "min_samples_per_sec", "max_samples_per_sec", "step_ms", "warmup_s", "peak_memory_gib", "final_loss",
        "speedup_vs_baseline", "of_target", "sm_mhz", "power_w", "power_capped", "status", "note"]
NUMERIC = {"batch_size", "table_rows", "samples_per_sec", "min_samples_per_sec", "max_samples_per_sec", "step_ms",
           "warmup_s", "peak_memory_gib", "final_loss", "speedup_vs_baseline", "of_target", "sm_mhz", "power_w",
           "power_capped"}
# the run's constants, repeated on every CSV row after the environment
FLOOR_KEYS = ["flop_per_sample", "emb_bytes_per_sample", "gemm_tflops", "copy_gbps", "compute_floor_sps",
              "memory_floor_sps", "floor_sps", "gemm_tflops_sustained", "compute_floor_sustained_sps",
              "floor_sustained_sps"]


def add_comparisons(rows: list[dict]) -> None:
    base = {r["batch_size"]: r.get("samples_per_sec") for r in rows if r["impl"] == BASELINE}
    for r in rows:
        sps = r.get("samples_per_sec")
        b = base.get(r["batch_size"])
        r["speedup_vs_baseline"] = sps / b if sps and b else None
        r["of_target"] = sps / TARGET if sps and r["batch_size"] == TARGET_BATCH else None



# ---- results ----------------------------------------------------------------------------------------


def fmt(v, spec: str) -> str:
    return format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else "n/a"


def millions(v) -> str:
    """1.14M; small rates (CPU smoke) in full."""
    if not isinstance(v, (int, float)) or not v:
        return "n/a"
    return f"{v / 1e6:.2f}M" if v >= 1e5 else f"{v:,.0f}"


def markdown_table(rows: list[dict]) -> list[str]:
    lines = ["| impl | batch | dense optim | tables | samples/s (median) | step ms | peak GiB | vs baseline "
             "| of 4M target | warm-up s | SM MHz in the windows (power, capped) | status |",
             "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        tables = f"{fmt(r.get('table_rows'), ',.0f')} {r.get('embedding_dtype') or ''}".strip()
        speed = fmt(r.get("speedup_vs_baseline"), ".2f") + ("x" if r.get("speedup_vs_baseline") else "")
        target = fmt(100 * r["of_target"], ".0f") + "%" if r.get("of_target") else "n/a"
        status = r["status"] + (f" ({r['note']})" if r.get("note") else "")
        clocks = (f"{r['sm_mhz']:.0f} ({r['power_w']:.0f} W, {100 * r['power_capped']:.0f}%)"
                  if isinstance(r.get("sm_mhz"), (int, float)) else "n/a")
        lines.append(md_row([r["impl"], r["batch_size"], r.get("dense_optim") or "", tables,
                             fmt(r.get("samples_per_sec"), ",.0f"), fmt(r.get("step_ms"), ".2f"),
                             fmt(r.get("peak_memory_gib"), ".1f"), speed, target, fmt(r.get("warmup_s"), ".1f"),
                             clocks, status.replace("|", "\\|")]))
    return lines


def floor_lines(work: dict, fl: dict, peaks: dict) -> list[str]:
    return [
        "| floor | per sample | rate (measured here) | samples/s |",
        "| --- | ---: | ---: | ---: |",
        md_row(["compute: FLOP fwd+bwd (3 x 2 x MACs: bottom {:.2f}M + cross {:.2f}M + top {:.2f}M MACs)".format(
            work["bottom_macs"] / 1e6, work["cross_macs"] / 1e6, work["top_macs"] / 1e6),
            f"{work['flop'] / 1e6:.1f} MFLOP",
            f"{peaks['gemm_tflops']:.3g} TFLOP/s ({peaks['gemm_n']}^3 GEMM)", millions(fl["compute_floor_sps"])]),
        md_row([f"memory: embedding bytes ({work['lookups']} bf16 rows read fwd, read + written by the update, "
                f"fp32 row state read + written, {work['features']} x D bf16 gradient read)",
                f"{work['emb_bytes'] / 1e3:.1f} KB", f"{peaks['copy_gbps']:,.0f} GB/s (copy_)",
                millions(fl["memory_floor_sps"])]),
        md_row(["both, in series (no overlap)", "", "", millions(fl["floor_sps"])]),
    ] + ([
        md_row(["compute at the sustained GEMM rate (the same GEMM after the settle time: the power-capped clock)",
                f"{work['flop'] / 1e6:.1f} MFLOP", f"{fl['gemm_tflops_sustained']:.3g} TFLOP/s (sustained)",
                millions(fl["compute_floor_sustained_sps"])]),
        md_row(["both, in series, at the sustained GEMM rate", "", "", millions(fl["floor_sustained_sps"])]),
    ] if fl.get("gemm_tflops_sustained") else [])


def context_paragraph(fl: dict) -> str:
    issue = ", ".join(f"{millions(v)} at {b}" for b, v in ISSUE_BASELINE.items())
    return (f"Target: >= {millions(TARGET)} samples/s at batch {TARGET_BATCH}. For context: best published per-GPU "
            f"figure {millions(HUGECTR)} (HugeCTR, H100); the issue's own baseline measurement (H100): {issue}; "
            f"this machine's floor {millions(fl['floor_sps'])} (compute {millions(fl['compute_floor_sps'])}, "
            f"embedding traffic {millions(fl['memory_floor_sps'])})"
            + (f"; {millions(fl['floor_sustained_sps'])} at the sustained GEMM rate (compute "
               f"{millions(fl['compute_floor_sustained_sps'])})" if fl.get("floor_sustained_sps") else "") + ".")


def plot(rows: list[dict], env: dict, fl: dict, path: Path, title: str) -> None:
    """Grouped bars of samples/s per batch size, one bar per implementation; target, HugeCTR and floor lines."""
    plt = pyplot()
    batches = sorted({r["batch_size"] for r in rows})
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(batches) * max(1, len(impls)) / 2 + 3), 4.5))
    width = 0.8 / max(1, len(impls))
    for k, impl in enumerate(impls):
        sps = {r["batch_size"]: r.get("samples_per_sec") or 0.0 for r in rows if r["impl"] == impl}
        ax.bar([i + k * width for i in range(len(batches))], [sps.get(b, 0.0) / 1e6 for b in batches], width,
               label=impl)
    ax.axhline(TARGET / 1e6, color="green", linestyle="--", label=f"target {TARGET / 1e6:.0f}M (B={TARGET_BATCH})")
    ax.axhline(HUGECTR / 1e6, color="grey", linestyle=":", label="HugeCTR H100 1.95M")
    ax.axhline(fl["floor_sps"] / 1e6, color="red", linestyle="-.", label=f"floor {millions(fl['floor_sps'])}")
    if fl.get("floor_sustained_sps"):
        ax.axhline(fl["floor_sustained_sps"] / 1e6, color="darkred", linestyle=":",
                   label=f"floor at the sustained GEMM rate {millions(fl['floor_sustained_sps'])}")
    ax.set_xticks([i + width * (len(impls) - 1) / 2 for i in range(len(batches))])
    ax.set_xticklabels([f"B={b}" for b in batches])
    ax.set_ylabel("samples/s (median), millions")
    ax.set_title(f"{textwrap.fill(title, 90)}\n{env['device']}, torch {env['torch']}, triton {env['triton']}, "
                 f"{env['date']}", fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def read_rows(path: Path) -> list[dict]:
    """Rows of an earlier CSV (--append), numbers parsed back."""
    if not path.exists():
        return []
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    out = []
    for r in rows:
        row = {}
        for k in KEYS:
            v = r.get(k)
            if v in (None, ""):
                row[k] = None
            elif k in NUMERIC:
                row[k] = int(v) if k in ("batch_size", "table_rows") else float(v)
            else:
                row[k] = v
        out.append(row)
    return out


def write_results(rows: list[dict], env: dict, work: dict, fl: dict, peaks: dict, out: Path, note: str,
                  title: str) -> str:
    out.mkdir(parents=True, exist_ok=True)
    rows.sort(key=lambda r: (-r["batch_size"], r["impl"] != BASELINE))  # stable: the others in run order
    add_comparisons(rows)
    write_csv(out / "mlperf_dcnv2.csv", rows, KEYS, {**env, **{k: fl[k] for k in FLOOR_KEYS}})
    text = markdown(title, [env_line(env), note, context_paragraph(fl), "\n".join(floor_lines(work, fl, peaks))],
                    markdown_table(rows))
    (out / "mlperf_dcnv2.md").write_text(text)
    plot(rows, env, fl, out / "mlperf_dcnv2.png", title)
    return text


