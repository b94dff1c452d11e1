"""Multi-GPU scaling: training throughput of one process and of N ranks under torchrun.

    torchrun --nproc-per-node 1 benchmarks/scaling.py --config configs/kaggle.json --batch-per-gpu 65536
    torchrun --nproc-per-node 2 benchmarks/scaling.py --config configs/kaggle.json --batch-per-gpu 65536

Each launch builds the model as `train.py` does under torchrun (one process: the plain model; N
ranks: DDP MLPs and sharded tables, `config.distributed`), feeds every rank its slice of
synthetic global batches of ``N x batch-per-gpu`` rows already on the device (uniform raw hash
values: every lookup a cold row), runs warm-up steps, then times windows of steps with CUDA
events (collectives included) and reports global samples/s. Rank 0 appends a row per launch to
``<out>/<name>.csv`` and rewrites ``<name>.md`` / ``.png`` with the scaling efficiency
``rate(N) / (N x rate(1))`` for the rows of the same config, precision and batch per GPU.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_throughput import Timer, environment, synthetic_batches  # noqa: E402

from dlrm.config import load_config  # noqa: E402
from dlrm.data.loader import Batch  # noqa: E402
from dlrm.distributed.env import init_distributed, shutdown  # noqa: E402
from dlrm.model.dlrm import build_loss, build_model  # noqa: E402
from dlrm.train.optim import build_optimizers  # noqa: E402
from dlrm.train.setup import Tables  # noqa: E402
from dlrm.train.step import TrainStep, set_matmul_precision  # noqa: E402
from dlrm.train.trainer import make_sharding  # noqa: E402

KEYS = ["gpus", "config", "precision", "sharding", "batch_per_gpu", "samples_per_sec", "min_samples_per_sec",
        "max_samples_per_sec", "step_ms", "efficiency", "peak_memory_mb", "device", "torch", "triton", "date"]


def measure(args) -> dict | None:
    cfg = load_config(args.config)
    cfg.train.precision = args.precision
    if args.sharding:
        cfg.distributed.sharding = args.sharding
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env, device = init_distributed(cfg.distributed, device)
    cards = list(cfg.model.cardinalities)
    if cfg.data.max_rows_per_table:
        cards = [min(c, cfg.data.max_rows_per_table) for c in cards]
    torch.manual_seed(0)
    plan = make_sharding(cfg, Tables(cards, None, "modulus"), env)  # as train.py does; None in one process
    model = build_model(cfg.model, cards, None, cfg.kernels, device, shard=(plan, env.rank) if plan else None)
    if env.distributed:
        from dlrm.distributed.data_parallel import wrap_dense_parts

        wrap_dense_parts(model, device)
    optimizers = build_optimizers(model, cfg.optim)
    set_matmul_precision(args.precision)
    step = TrainStep(model, build_loss(cfg.kernels), optimizers, args.precision, device, cfg.train.compile)
    B, W = args.batch_per_gpu, env.world_size
    batches = [Batch(b.dense, b.sparse, b.labels, B * W if env.distributed else None)
               for b in synthetic_batches(4, B, device, seed=env.rank)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(args.warmup):
        step(batches[i % len(batches)])
    rates = []
    for w in range(args.windows):
        with Timer(device) as t:
            for i in range(args.steps):
                step(batches[(w * args.steps + i) % len(batches)])
        rates.append(args.steps * B * W / t.seconds)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    peaks = env.all_gather_object(peak)
    if not env.is_main:
        return None
    rate = statistics.median(rates)
    return {"gpus": W, "config": Path(args.config).name, "precision": args.precision,
            "sharding": cfg.distributed.sharding if env.distributed else "none", "batch_per_gpu": B,
            "samples_per_sec": rate, "min_samples_per_sec": min(rates), "max_samples_per_sec": max(rates),
            "step_ms": B * W / rate * 1e3, "peak_memory_mb": max((p for p in peaks if p is not None), default=None),
            **{k: v for k, v in environment(device).items() if k in ("device", "torch", "triton", "date")}}


def write_results(rows: list[dict], out: Path, name: str) -> None:
    """Efficiency against the 1-GPU row of the same config, precision and batch per GPU."""
    for r in rows:
        base = [b for b in rows if int(b["gpus"]) == 1  # rows read back from the CSV are strings
                and all(str(b[k]) == str(r[k]) for k in ("config", "precision", "batch_per_gpu"))]
        r["efficiency"] = float(r["samples_per_sec"]) / (int(r["gpus"]) * float(base[-1]["samples_per_sec"])) if base else ""
    with open(out / f"{name}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=KEYS)
        w.writeheader()
        w.writerows({k: r.get(k, "") for k in KEYS} for r in rows)
    lines = [f"# Multi-GPU scaling ({rows[-1]['device']}, torch {rows[-1]['torch']}, triton {rows[-1]['triton']})", "",
             "Global samples/s of whole training steps (median of timed windows, CUDA events), synthetic batches "
             "already on the device; efficiency = rate(N) / (N x rate(1)).", "",
             "| GPUs | config | precision | sharding | batch per GPU | samples/s | step ms | efficiency | peak MiB | date |",
             "| ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        eff = f"{float(r['efficiency']):.2f}" if r["efficiency"] != "" else "n/a"
        peak = f"{float(r['peak_memory_mb']):,.0f}" if r.get("peak_memory_mb") not in (None, "") else "n/a"
        lines.append(f"| {r['gpus']} | {r['config']} | {r['precision']} | {r['sharding']} | {int(r['batch_per_gpu']):,} | "
                     f"{float(r['samples_per_sec']):,.0f} | {float(r['step_ms']):.2f} | {eff} | {peak} | {r['date']} |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    pts = sorted((int(r["gpus"]), float(r["samples_per_sec"])) for r in rows)
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label="measured")
    if pts and pts[0][0] == 1:
        ax.plot([p[0] for p in pts], [p[0] * pts[0][1] for p in pts], ls="--", color="gray", label="linear")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("samples/s")
    ax.set_title(f"{rows[-1]['config']}, {rows[-1]['precision']}, {int(rows[-1]['batch_per_gpu']):,} per GPU", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/kaggle.json")
    ap.add_argument("--batch-per-gpu", type=int, default=65536)
    ap.add_argument("--precision", default="tf32", choices=["fp32", "tf32", "bf16"])
    ap.add_argument("--sharding", default=None, choices=["auto", "table", "row"], help="default: the config's")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="scaling_kaggle")
    args = ap.parse_args(argv)
    try:
        row = measure(args)
    finally:
        shutdown()
    if row is not None:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        rows = list(csv.DictReader(open(out / f"{args.name}.csv"))) if (out / f"{args.name}.csv").is_file() else []
        rows.append(row)
        write_results(rows, out, args.name)
        print(f"{row['gpus']} GPU(s): {row['samples_per_sec']:,.0f} samples/s ({time.strftime('%H:%M:%S')})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
