"""End-to-end training throughput: whole training steps on synthetic device-resident batches.

    python benchmarks/train_throughput.py --config configs/kaggle.json --batch-sizes 128,2048,65536 \
        --variants eager,compiled,triton,triton+compiled --precisions tf32,bf16 --out benchmarks/results

Builds the model from the config (its table sizes), generates batches on the device (raw hash
values drawn uniformly, so every lookup is a cold row: the hard case), runs warm-up steps, then
times steps with CUDA events, and reports the median samples/s per variant, precision and batch.
Writes train_throughput.csv / .md / .png with the GPU name, versions and date.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dlrm.config import load_config  # noqa: E402
from dlrm.data.loader import Batch  # noqa: E402
from dlrm.data.schema import NUM_DENSE, NUM_SPARSE  # noqa: E402
from dlrm.model.dlrm import build_loss, build_model  # noqa: E402
from dlrm.train.compare import VARIANTS, unavailable_reason, variant_config  # noqa: E402
from dlrm.train.graphed_step import graph_train_step  # noqa: E402
from dlrm.train.optim import build_optimizers  # noqa: E402
from dlrm.train.step import TrainStep, set_matmul_precision  # noqa: E402


def synthetic_batches(n: int, batch_size: int, device: torch.device, seed: int = 0) -> list[Batch]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for _ in range(n):
        counts = torch.distributions.Exponential(0.05).sample((batch_size, NUM_DENSE))
        dense = torch.log1p(counts.floor())
        sparse = torch.randint(-1, 2**32, (batch_size, NUM_SPARSE), generator=g)
        labels = (torch.rand(batch_size, generator=g) < 0.25).float()
        out.append(Batch(dense.to(device), sparse.to(device), labels.to(device)))
    return out


class Timer:
    """Wall time of a region: CUDA events on a GPU (no host sync inside the region), perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            self.seconds = self.start.elapsed_time(self.end) / 1e3
        else:
            self.seconds = time.perf_counter() - self.t0


def measure(cfg, variant: str, precision: str, batch_size: int, device: torch.device, warmup: int, steps: int,
            windows: int) -> dict:
    cfg = variant_config(cfg, variant)
    cfg.train.precision = precision
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.model.cardinalities, None, cfg.kernels, device)
    optimizers = build_optimizers(model, cfg.optim)
    set_matmul_precision(precision)  # tf32: TF32 tensor cores for fp32 matmuls; fp32: IEEE
    step = TrainStep(model, build_loss(cfg.kernels), optimizers, precision, device, cfg.train.compile)
    step = graph_train_step(step, cfg.train.cuda_graph, distributed=False)
    batches = synthetic_batches(8, batch_size, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for i in range(warmup):
        step(batches[i % len(batches)])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    warmup_s = time.perf_counter() - t0
    rates = []
    loss = torch.zeros((), device=device)
    for w in range(windows):
        with Timer(device) as t:
            for i in range(steps):
                loss = step(batches[(w * steps + i) % len(batches)])
        rates.append(steps * batch_size / t.seconds)
    return {
        "variant": variant, "precision": precision, "batch_size": batch_size,
        "samples_per_sec": statistics.median(rates), "min_samples_per_sec": min(rates),
        "max_samples_per_sec": max(rates), "step_ms": batch_size / statistics.median(rates) * 1e3,
        "warmup_s": warmup_s, "final_loss": float(loss),
        "peak_memory_mb": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
        "status": "ok",
    }


def environment(device: torch.device) -> dict:
    import triton

    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU",
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
    }


def write_results(rows: list[dict], env: dict, out: Path, stem: str, title: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    keys = ["variant", "precision", "batch_size", "samples_per_sec", "min_samples_per_sec", "max_samples_per_sec",
            "step_ms", "warmup_s", "peak_memory_mb", "final_loss", "status"]
    with open(out / f"{stem}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys + list(env))
        w.writeheader()
        for r in rows:
            w.writerow({**{k: r.get(k) for k in keys}, **env})
    lines = [f"# {title}", "", ", ".join(f"{k}: {v}" for k, v in env.items()), "",
             "| variant | precision | batch | samples/s (median) | step ms | warm-up s | peak MiB | status |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        sps = f"{r['samples_per_sec']:,.0f}" if r.get("samples_per_sec") else "n/a"
        ms = f"{r['step_ms']:.3f}" if r.get("step_ms") else "n/a"
        wu = f"{r['warmup_s']:.1f}" if r.get("warmup_s") is not None else "n/a"
        mem = f"{r['peak_memory_mb']:,.0f}" if r.get("peak_memory_mb") else "n/a"
        lines.append(f"| {r['variant']} | {r['precision']} | {r['batch_size']} | {sps} | {ms} | {wu} | {mem} | {r['status']} |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=110)
    plt.close(fig)


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
    args = ap.parse_args(argv)

    cfg = load_config(args.config)
    if cfg.model.cardinalities is None:  # take the table sizes of the config's dataset
        from dlrm.data.schema import read_metadata

        cfg.model.cardinalities = read_metadata(cfg.data.path).cardinalities
    if cfg.data.max_rows_per_table:
        cfg.model.cardinalities = [min(c, cfg.data.max_rows_per_table) for c in cfg.model.cardinalities]
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    env = environment(device)
    rows = []
    stem = args.name or f"train_throughput_{Path(args.config).stem}"
    title = f"DLRM training throughput, {Path(args.config).name}"
    for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
        for precision in args.precisions.split(","):
            for variant in args.variants.split(","):
                if variant not in VARIANTS:
                    ap.error(f"unknown variant {variant!r}")
                reason = unavailable_reason(variant, device)
                if reason:
                    rows.append({"variant": variant, "precision": precision, "batch_size": batch_size, "status": f"skipped: {reason}"})
                    continue
                try:
                    r = measure(cfg, variant, precision, batch_size, device, args.warmup, args.steps, args.windows)
                except Exception as e:  # noqa: BLE001 - one failing variant must not hide the others' numbers
                    traceback.print_exc()
                    r = {"variant": variant, "precision": precision, "batch_size": batch_size,
                         "status": f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"}
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                rows.append(r)
                print(f"{variant:>20} {precision} B={batch_size:>6}: "
                      + (f"{r['samples_per_sec']:,.0f} samples/s" if r.get("samples_per_sec") else r["status"]), flush=True)
                torch._dynamo.reset()
                # rewritten after every case, so a run cut short by a time limit keeps what it measured
                write_results(rows, env, Path(args.out), stem, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
