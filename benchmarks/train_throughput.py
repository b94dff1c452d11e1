"""End-to-end training throughput: whole training steps on synthetic device-resident batches.

    python benchmarks/train_throughput.py --config configs/kaggle.json --batch-sizes 128,2048,65536 \
        --variants eager,compiled,triton,triton+compiled --precisions tf32,bf16 --out benchmarks/results

Builds each variant's run as train.py does (`dlrm.train.builder.build_run`: model, loss,
optimizers, LR schedules, compiled / graphed step) with the config's table sizes (or its dataset's,
capped by data.max_rows_per_table), generates batches on the device (raw hash values drawn
uniformly, so every lookup is a cold row: the hard case), runs warm-up steps, then times steps
(each followed by the LR schedules' step, as in training) with CUDA events, and reports the median
samples/s per variant, precision and batch.
Writes train_throughput.csv / .md / .png with the GPU name, versions and date.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

# _common (which puts the repository first on sys.path), also when loaded by path (tests);
# appended: benchmarks/kernels.py must not shadow the kernels package
sys.path.append(str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    add_overwrite,
    claim_outputs,
    Timer,
    config_or_error,
    env_line,
    environment,
    fill_cardinalities,
    int_list,
    markdown,
    md_row,
    pyplot,
    save_figure,
    settle,
    synthetic_batches,
    train_steps,
    write_csv,
)

from dlrm.config import load_config, validate  # noqa: E402,F401 - load_config: the tests' and callers' name
from dlrm.data.schema import is_multi_hot  # noqa: E402
from dlrm.train.builder import build_run, tables_from_config  # noqa: E402
from dlrm.train.compare import VARIANTS, release_memory, unavailable_reason, variant_config  # noqa: E402
from dlrm.train.setup import seed_everything  # noqa: E402

KEYS = ["variant", "precision", "batch_size", "samples_per_sec", "min_samples_per_sec", "max_samples_per_sec",
        "step_ms", "warmup_s", "peak_memory_mb", "final_loss", "status"]


def measure(cfg, variant: str, precision: str, batch_size: int, device: torch.device, warmup: int, steps: int,
            windows: int, settle_s: float = 0.0) -> dict:
    """One case: the run `train.py` would build for `variant` (`build_run`), `warmup` untimed steps, then
    untimed steps for `settle_s` seconds on a GPU (`_common.settle`: its power-capped clock), then `windows` timed
    windows of `steps` steps; samples/s per window, the median reported. ``warmup_s``: the untimed time, both;
    ``windows_t0`` / ``windows_t1``: the host clock (``time.time()``) around the timed windows, for samplers that
    label what they saw then (`mlperf_dcnv2.py`'s SM clock)."""
    cfg = variant_config(cfg, variant)
    cfg.train.precision = precision  # tf32: TF32 tensor cores for fp32 matmuls; fp32: IEEE
    cfg.data.batch_size = batch_size
    validate(cfg)  # as train.py does: a combination that cannot run is a ConfigError row, not a broken step
    # seeded, and torch's deterministic mode set as the config says (as train.py's seed_everything does): left on by
    # a deterministic run earlier in this process, it kept Inductor from timing the combo kernels (a failed row)
    seed_everything(0, cfg.train.deterministic)
    run = build_run(cfg, tables_from_config(cfg), device, total_steps=warmup + windows * steps)
    batches = synthetic_batches(8, batch_size, device, multi_hot_sizes=cfg.model.multi_hot_sizes)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    train_steps(run, batches, warmup)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    settle(lambda i: train_steps(run, batches, 1, start=i), settle_s, device, start=warmup)
    warmup_s = time.perf_counter() - t0
    rates = []
    loss = torch.zeros((), device=device)
    windows_t0 = time.time()  # the queue is empty here (settle and the warm-up end with a sync)
    for w in range(windows):
        with Timer(device) as t:
            loss = train_steps(run, batches, steps, start=w * steps)
        rates.append(steps * batch_size / t.seconds)
    final_loss = float(loss)  # a sync: the windows have run
    return {
        "variant": variant, "precision": precision, "batch_size": batch_size,
        "samples_per_sec": statistics.median(rates), "min_samples_per_sec": min(rates),
        "max_samples_per_sec": max(rates), "step_ms": batch_size / statistics.median(rates) * 1e3,
        "warmup_s": warmup_s, "final_loss": final_loss, "windows_t0": windows_t0, "windows_t1": time.time(),
        "peak_memory_mb": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
        "status": "ok",
    }


def markdown_table(rows: list[dict]) -> list[str]:
    """The results table: one line per case, n/a where a skipped or failed case has no number."""
    lines = ["| variant | precision | batch | samples/s (median) | step ms | warm-up s | peak MiB | status |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        sps = f"{r['samples_per_sec']:,.0f}" if r.get("samples_per_sec") else "n/a"
        ms = f"{r['step_ms']:.3f}" if r.get("step_ms") else "n/a"
        wu = f"{r['warmup_s']:.1f}" if r.get("warmup_s") is not None else "n/a"
        mem = f"{r['peak_memory_mb']:,.0f}" if r.get("peak_memory_mb") else "n/a"
        lines.append(md_row([r["variant"], r["precision"], r["batch_size"], sps, ms, wu, mem, r["status"]]))
    return lines


def plot(rows: list[dict], env: dict, path: Path, title: str) -> None:
    """samples/s against batch size (log-log), one line per (variant, precision)."""
    plt = pyplot()
    ok = [r for r in rows if r.get("samples_per_sec")]
    series = sorted({(r["variant"], r["precision"]) for r in ok})
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for variant, precision in series:
        pts = sorted((r["batch_size"], r["samples_per_sec"]) for r in ok if (r["variant"], r["precision"]) == (variant, precision))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{variant} {precision}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("samples/s (median)")
    ax.set_title(f"{title}\n{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def write_results(rows: list[dict], env: dict, out: Path, stem: str, title: str) -> None:
    """<stem>.csv (the environment on every row), <stem>.md (also printed) and <stem>.png under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / f"{stem}.csv", rows, KEYS, env)
    text = markdown(title, [env_line(env)], markdown_table(rows))
    (out / f"{stem}.md").write_text(text)
    print(text, end="")
    plot(rows, env, out / f"{stem}.png", title)


def run_case(cfg, variant: str, precision: str, batch_size: int, device: torch.device, args) -> dict:
    """One case's row: measured, or skipped (the variant cannot run here), or failed (the error's
    first line; one failing variant must not hide the others' numbers)."""
    case = {"variant": variant, "precision": precision, "batch_size": batch_size}
    reason = unavailable_reason(variant, device, multi_hot=is_multi_hot(cfg.model.multi_hot_sizes))  # its batches' shape
    if reason:
        return {**case, "status": f"skipped: {reason}"}
    try:
        return measure(cfg, variant, precision, batch_size, device, args.warmup, args.steps, args.windows)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        return {**case, "status": f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"}
    finally:
        # without this, the next case's peak included the last one's model (27 GB of Terabyte tables)
        release_memory(device)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/kaggle.json")
    ap.add_argument("--batch-sizes", default="128,2048,65536")
    ap.add_argument("--variants", default="eager,compiled,compiled-cudagraphs,triton,triton+compiled")
    ap.add_argument("--precisions", default="tf32,bf16", help="comma list of fp32 (IEEE), tf32, bf16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--warmup", type=int, default=20, help="untimed steps (compilation, autotuning)")
    ap.add_argument("--steps", type=int, default=50, help="steps per timed window")
    ap.add_argument("--windows", type=int, default=5, help="timed windows; the median is reported")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default=None, help="output file stem (default train_throughput_<config>)")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    stem = args.name or f"train_throughput_{Path(args.config).stem}"
    outputs = claim_outputs(ap, args, args.out, [f"{stem}.{ext}" for ext in ("csv", "md", "png")])

    cfg = config_or_error(ap, args.config)  # a missing / malformed config: one line, not a traceback
    # parsed before any case runs: a bad value is one argparse line, not a ValueError after the first cases
    batch_sizes = int_list(ap, "--batch-sizes", args.batch_sizes)
    fill_cardinalities(cfg)  # the config's dataset's table sizes when it names none
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    env = environment(device)
    rows = []
    title = f"DLRM training throughput, {Path(args.config).name}"
    variants = args.variants.split(",")
    for variant in variants:
        if variant not in VARIANTS:
            ap.error(f"unknown variant {variant!r}")
    for batch_size in batch_sizes:
        for precision in args.precisions.split(","):
            for variant in variants:
                r = run_case(cfg, variant, precision, batch_size, device, args)
                rows.append(r)
                print(f"{variant:>20} {precision} B={batch_size:>6}: "
                      + (f"{r['samples_per_sec']:,.0f} samples/s" if r.get("samples_per_sec") else r["status"]), flush=True)
                torch._dynamo.reset()
                # rewritten after every case, so a run cut short by a time limit keeps what it measured
                write_results(rows, env, Path(args.out), stem, title)
    outputs.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
