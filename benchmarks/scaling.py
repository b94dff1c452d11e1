"""Multi-GPU scaling: training throughput of one process and of N ranks under torchrun.

    torchrun --nproc-per-node 1 benchmarks/scaling.py --config configs/kaggle.json --batch-per-gpu 65536
    torchrun --nproc-per-node 2 benchmarks/scaling.py --config configs/kaggle.json --batch-per-gpu 65536

Each launch builds the run as `train.py` does under torchrun (`dlrm.train.builder.build_run`; one
process: the plain model; N ranks: DDP MLPs and sharded tables, `config.distributed`, ``--sharding`` and
``--balance``; the whole-step CUDA graph as ``train.cuda_graph`` or ``--cuda-graph`` says, its collectives
captured too with N ranks) with the config's table sizes (or its
dataset's, capped by data.max_rows_per_table), feeds every rank its slice of synthetic global
batches of ``N x batch-per-gpu`` rows already on the device (uniform raw hash values: every lookup
a cold row), runs warm-up steps, then times windows of steps with CUDA events (collectives
included; each step followed by the LR schedules' step, as in training) and reports global
samples/s. Rank 0 appends a row per launch to ``<out>/<name>.csv`` and rewrites ``<name>.md`` /
``.png`` with the scaling efficiency ``rate(N) / (N x rate(1))`` for the rows of the same config,
precision and batch per GPU.

``--per-gpu-launches off``: an H200 runs the H100's launches of the memory-bound kernels
(`kernels.heuristics.PER_GPU_LAUNCHES`), an A/B of its own; not a CSV column (``--name`` keeps the rows apart).
``--sr-rng``: the random bits of the bf16 tables' stochastic rounding (`kernels.embedding.update.SR_RNG`), for
an A/B of the generators in the whole step; the CSV's ``sr_rng`` column says which ran.
``--sort-overlap off``: multi-hot Triton shards sort their rows for the update after the gradients arrive
instead of while they travel (`dlrm.distributed.owner_exchange.SORT_OVERLAP`; the same numbers), to measure
what the overlap buys; the CSV's ``sort_overlap`` column says which ran.

``--profile``: after the timed windows, every rank profiles ``--steps`` more steps (PyTorch profiler)
and rank 0 writes ``<name>_profile_<N>gpu.md`` / ``.csv``: each rank's device time per step grouped as
`step_profile.py` groups kernels (the collectives, NCCL's kernels, in a group of their own), "idle" (the
timed step minus the kernels), and each rank's longest kernels. On the CPU (gloo) the ops' self CPU time
stands in for kernel time, so the report exists there too (tests), though its groups mean little.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from pathlib import Path

import torch

# _common (which puts the repository first on sys.path), also when loaded by path (tests);
# appended: benchmarks/kernels.py must not shadow the kernels package
sys.path.append(str(Path(__file__).resolve().parent))

import step_profile  # noqa: E402
from _common import (  # noqa: E402
    add_overwrite,
    claim_outputs,
    Timer,
    environment,
    fill_cardinalities,
    markdown,
    md_row,
    positive_or_error,
    pyplot,
    run_config_or_error,
    save_figure,
    synthetic_batches,
    train_steps,
    write_csv,
)

from dlrm.config import load_config  # noqa: E402
from dlrm.data.loader import Batch  # noqa: E402
from dlrm.distributed import owner_exchange  # noqa: E402
from dlrm.distributed.env import init_distributed, shutdown  # noqa: E402
from dlrm.train.builder import build_run, tables_from_config  # noqa: E402
from dlrm.train.graphed_step import GraphedTrainStep  # noqa: E402
from dlrm.train.setup import resolve_device  # noqa: E402
from kernels import heuristics  # noqa: E402
from kernels.embedding import update  # noqa: E402

KEYS = ["gpus", "config", "precision", "sharding", "balance", "cuda_graph", "batch_per_gpu", "samples_per_sec", "min_samples_per_sec",
        "max_samples_per_sec", "step_ms", "efficiency", "peak_memory_mb", "device", "torch", "triton", "date",
        "sort_overlap", "sr_rng"]


def rank_batches(batch_per_rank: int, env, device: torch.device, multi_hot_sizes=None) -> list[Batch]:
    """This rank's slices of the synthetic global batches (a seed per rank: different rows); with
    `multi_hot_sizes` (the config's), every feature's slots filled, as the multi-hot model takes them."""
    global_size = batch_per_rank * env.world_size if env.distributed else None
    return [Batch(b.dense, b.sparse, b.labels, global_size)
            for b in synthetic_batches(4, batch_per_rank, device, seed=env.rank, multi_hot_sizes=multi_hot_sizes)]


def measure(args) -> dict | None:
    """This launch's row (rank 0; None on the other ranks): the run `train.py` builds under this
    launch (`build_run`: in N ranks the sharded tables and the DDP dense parts), `args.warmup`
    untimed steps, then `args.windows` timed windows of `args.steps` steps; global samples/s."""
    cfg = load_config(args.config)
    cfg.train.precision = args.precision
    cfg.data.batch_size = args.batch_per_gpu
    if args.sharding:
        cfg.distributed.sharding = args.sharding
    if args.balance:
        cfg.distributed.balance = args.balance
    if args.cuda_graph:
        cfg.train.cuda_graph = {"true": True, "false": False}.get(args.cuda_graph, args.cuda_graph)
    owner_exchange.SORT_OVERLAP = args.sort_overlap == "on"
    if args.sr_rng:
        update.SR_RNG = args.sr_rng
    heuristics.PER_GPU_LAUNCHES = args.per_gpu_launches == "on"
    fill_cardinalities(cfg)  # the config's dataset's table sizes when it names none
    device = resolve_device(cfg.train.device)  # the config's train.device, as train.py reads it ("auto": CUDA if any)
    env, device = init_distributed(cfg.distributed, device)
    torch.manual_seed(0)
    run = build_run(cfg, tables_from_config(cfg), device, total_steps=args.warmup + args.windows * args.steps, env=env)
    B, W = args.batch_per_gpu, env.world_size
    batches = rank_batches(B, env, device, cfg.model.multi_hot_sizes)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    graphed = isinstance(run.train_step, GraphedTrainStep)
    # a captured step warms up (DDP_WARMUP_STEPS with several ranks) and captures before the timed windows
    warmup = max(args.warmup, run.train_step.warmup_left + 2) if graphed else args.warmup
    train_steps(run, batches, warmup)
    rates = []
    for w in range(args.windows):
        with Timer(device) as t:
            train_steps(run, batches, args.steps, start=w * args.steps)
        rates.append(args.steps * B * W / t.seconds)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    peaks = env.all_gather_object(peak)
    rate = statistics.median(rates)
    if args.profile:
        step_ms = B * W / rate * 1e3
        start = warmup + args.windows * args.steps
        profiles = env.all_gather_object(profile_rank(run, batches, args.steps, start, device, step_ms,
                                                      args.top_kernels))
        if env.is_main:
            write_profile(profiles, Path(args.out), f"{args.name}_profile_{W}gpu", Path(args.config).name, B, device)
    if not env.is_main:
        return None
    return {"gpus": W, "config": Path(args.config).name, "precision": args.precision,
            "sharding": cfg.distributed.sharding if env.distributed else "none",
            "balance": cfg.distributed.balance if env.distributed else "", "cuda_graph": graphed, "batch_per_gpu": B,
            "samples_per_sec": rate, "min_samples_per_sec": min(rates), "max_samples_per_sec": max(rates),
            "step_ms": B * W / rate * 1e3, "peak_memory_mb": max((p for p in peaks if p is not None), default=None),
            "sort_overlap": args.sort_overlap if env.distributed else "", "sr_rng": update.SR_RNG,
            **{k: v for k, v in environment(device).items() if k in ("device", "torch", "triton", "date")}}


PROFILE_KEYS = ["rank", "category", "ms_per_step", "share_of_step", "kernels"]


def profile_rank(run, batches: list, steps: int, start: int, device: torch.device, step_ms: float,
                 top_kernels: int = 25) -> dict:
    """This rank's profile of `steps` more steps: {"rows": per-category ms a step (`step_profile.category`;
    "idle" = `step_ms` minus the kernels), "top": the `top_kernels` longest kernels as (name, ms a step, calls a
    step, category)}. On the CPU, ops' self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        train_steps(run, batches, steps, start=start)
        if cuda:
            torch.cuda.synchronize(device)
    if cuda:
        times = step_profile.device_times(prof)
    else:
        times = [(e.key, float(e.self_cpu_time_total), int(e.count)) for e in prof.key_averages()
                 if e.self_cpu_time_total > 0]
    longest = sorted(times, key=lambda t: -t[1])[:top_kernels]
    top = [(n, us / 1e3 / steps, calls / steps, step_profile.category(n)) for n, us, calls in longest]
    return {"step_ms": step_ms, "rows": step_profile.category_rows(times, steps, step_ms), "top": top}


def write_profile(profiles: list[dict], out: Path, name: str, config: str, batch: int, device: torch.device) -> None:
    """`<name>.md` and `.csv` under `out`: every rank's categories and longest kernels."""
    env = environment(device)
    rows = [{"rank": r, **row} for r, p in enumerate(profiles) for row in p["rows"]]
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / f"{name}.csv", rows, PROFILE_KEYS, {k: env[k] for k in ("device", "torch", "triton", "date")})
    W = len(profiles)
    unit = "device ms (kernels)" if device.type == "cuda" else "CPU ms (ops' self time; the CPU stands in for a GPU)"
    about = [f"{config}, {W} rank(s), {batch:,} rows per rank, step {profiles[0]['step_ms']:.2f} ms (the timed windows' "
             f"median). Per rank, {unit} per step grouped as benchmarks/step_profile.py groups them; idle = the step "
             "minus the kernels (launch gaps, waits the kernels do not cover)."]
    table = ["| rank | category | ms per step | share of step | kernels |", "| ---: | --- | ---: | ---: | ---: |"]
    table += [md_row([r["rank"], r["category"], f"{r['ms_per_step']:.3f}", f"{r['share_of_step']:.1%}", r["kernels"]])
              for r in rows]
    table += ["", "Longest kernels:", "", "| rank | kernel | ms per step | calls per step | category |",
              "| ---: | --- | ---: | ---: | --- |"]
    table += [md_row([r, n[:100].replace("|", "/"), f"{ms:.3f}", f"{calls:g}", c])
              for r, p in enumerate(profiles) for n, ms, calls, c in p["top"]]
    (out / f"{name}.md").write_text(markdown(f"Step profile per rank ({env['device']}, torch {env['torch']}, "
                                             f"triton {env['triton']}, {env['date']})", about, table))


# What a 1-GPU row must share with the row it is the efficiency base of; the whole-step CUDA graph too, as the row
# records it (resolved): a 2-GPU run without the graph was divided by a 1-GPU run with it, an "efficiency" of 0.20
# that measured the graph's absence (results/scaling_kaggle.csv, 2026-11-28 09:11). A 1-GPU run has no sharding,
# balance or sort overlap (its row says "none" / n/a): it is the base of every sharding.
BASE_KEYS = ("config", "precision", "batch_per_gpu", "device", "cuda_graph")


def add_efficiency(rows: list[dict]) -> None:
    """Efficiency against the 1-GPU row of the same `BASE_KEYS` (config, precision, batch per GPU, device, whole-step
    CUDA graph) measured closest in time (the same device call when it ran one: calls can land on
    different machines); "" without one."""
    def minutes(r) -> float:
        try:
            return time.mktime(time.strptime(str(r["date"]), "%Y-%m-%d %H:%M")) / 60
        except (KeyError, ValueError):
            return 0.0

    for r in rows:
        base = [b for b in rows if int(b["gpus"]) == 1  # rows read back from the CSV are strings
                and all(str(b.get(k)) == str(r.get(k)) for k in BASE_KEYS)]
        if not base:
            r["efficiency"] = ""
            continue
        # closest in time; of two equally close, the later (the rows' order)
        b = min(reversed(base), key=lambda b: abs(minutes(b) - minutes(r)))
        r["efficiency"] = float(r["samples_per_sec"]) / (int(r["gpus"]) * float(b["samples_per_sec"]))


def markdown_table(rows: list[dict]) -> list[str]:
    """One line per launch (n/a for an efficiency or a peak memory it does not have)."""
    lines = ["| GPUs | config | precision | sharding | balance | whole-step CUDA graph | sort while the gradients travel "
             "| rounding bits | batch per GPU | samples/s | step ms | efficiency (vs 1 GPU, same graph) | peak MiB "
             "| date |",
             "| ---: | --- | --- | --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        eff = f"{float(r['efficiency']):.2f}" if r["efficiency"] != "" else "n/a"
        peak = f"{float(r['peak_memory_mb']):,.0f}" if r.get("peak_memory_mb") not in (None, "") else "n/a"
        lines.append(md_row([r["gpus"], r["config"], r["precision"], r["sharding"], r.get("balance") or "n/a",
                             r.get("cuda_graph") if r.get("cuda_graph") not in (None, "") else "n/a",
                             r.get("sort_overlap") or "n/a", r.get("sr_rng") or "n/a", f"{int(r['batch_per_gpu']):,}",
                             f"{float(r['samples_per_sec']):,.0f}", f"{float(r['step_ms']):.2f}", eff, peak, r["date"]]))
    return lines


def plot(rows: list[dict], path: Path) -> None:
    """samples/s against the GPU count, with the linear scaling of the 1-GPU rate."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    pts = sorted((int(r["gpus"]), float(r["samples_per_sec"])) for r in rows)
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label="measured")
    if pts and pts[0][0] == 1:
        ax.plot([p[0] for p in pts], [p[0] * pts[0][1] for p in pts], ls="--", color="gray", label="linear")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("samples/s")
    ax.set_title(f"{rows[-1]['config']}, {rows[-1]['precision']}, {int(rows[-1]['batch_per_gpu']):,} per GPU", fontsize=9)
    ax.legend()
    save_figure(fig, path)


def write_results(rows: list[dict], out: Path, name: str) -> None:
    """<name>.csv, .md and .png under `out`, every row with its scaling efficiency."""
    add_efficiency(rows)
    write_csv(out / f"{name}.csv", rows, KEYS)
    title = f"Multi-GPU scaling ({rows[-1]['device']}, torch {rows[-1]['torch']}, triton {rows[-1]['triton']})"
    about = ("Global samples/s of whole training steps (median of timed windows, CUDA events), synthetic batches "
             "already on the device; efficiency = rate(N) / (N x rate(1)), against the 1-GPU row closest in time "
             "of the same config, precision, batch per GPU, device and whole-step CUDA graph (n/a where none was "
             "measured; one GPU has no sharding: the base of every sharding). "
             "\"Sort while the gradients travel\": multi-hot Triton shards sort their rows for the update during the "
             "gradients' all_to_all (on) or after it (off), `--sort-overlap`; n/a before it existed and on one GPU. "
             "\"Rounding bits\": the generator of the bf16 tables' stochastic rounding (`--sr-rng`); n/a before the "
             "column existed (hash1 until 2026-11-28, twenty-seventh session).")
    (out / f"{name}.md").write_text(markdown(title, [about], markdown_table(rows)))
    plot(rows, out / f"{name}.png")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/kaggle.json")
    ap.add_argument("--batch-per-gpu", type=int, default=65536)
    ap.add_argument("--precision", default="tf32", choices=["fp32", "tf32", "bf16"])
    ap.add_argument("--sharding", default=None, choices=["auto", "table", "row"], help="default: the config's")
    ap.add_argument("--balance", default=None, choices=["cost", "lookups", "rows"], help="default: the config's")
    ap.add_argument("--sort-overlap", default="on", choices=["on", "off"],
                    help="multi-hot Triton shards: sort the owner's rows while their gradients travel "
                         "(`dlrm.distributed.owner_exchange.SORT_OVERLAP`), or after")
    ap.add_argument("--sr-rng", default=None, choices=sorted(update.RNG_CODES),
                    help="the random bits of the bf16 tables' stochastic rounding (`kernels.embedding.update.SR_RNG`; "
                         "default: the shipped one)")
    ap.add_argument("--per-gpu-launches", default="on", choices=["on", "off"],
                    help="off: every GPU runs the H100's launches of the memory-bound kernels "
                         "(`kernels.heuristics.PER_GPU_LAUNCHES`; an A/B of the H200's own; not in the CSV: "
                         "use --name to keep the rows apart)")
    ap.add_argument("--cuda-graph", default=None, choices=["auto", "true", "false"],
                    help="train.cuda_graph (default: the config's)")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps (more when a captured step needs them)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="also profile --steps steps on every rank (see above)")
    ap.add_argument("--top-kernels", type=int, default=25, help="with --profile: the longest kernels listed")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="scaling_kaggle")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    # <name>.csv gains this launch's row by design (its .md and .png are redrawn from all of them): never refused; a
    # profile of this many ranks is replaced only with --overwrite
    world = int(os.environ.get("WORLD_SIZE", "1"))
    profile = [f"{args.name}_profile_{world}gpu.{ext}" for ext in ("md", "csv")] if args.profile else []
    claim_outputs(ap, args, args.out, profile)
    outputs = claim_outputs(ap, args, args.out, [f"{args.name}.{ext}" for ext in ("csv", "md", "png")] + profile,
                            append=True)
    # the options and the config (with the options' settings) first: one argparse line for a bad one on every rank,
    # not a traceback, nor (--steps or --windows 0) a division by zero once the launch was measured
    positive_or_error(ap, batch_per_gpu=args.batch_per_gpu, steps=args.steps, windows=args.windows)
    run_config_or_error(ap, args.config, {"train.precision": args.precision, "data.batch_size": args.batch_per_gpu,
                                          "distributed.sharding": args.sharding, "distributed.balance": args.balance,
                                          "train.cuda_graph": {"true": True, "false": False}.get(args.cuda_graph,
                                                                                                 args.cuda_graph)},
                        tables="dataset")
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
        outputs.report()
    return 0


if __name__ == "__main__":
    code = main()
    # Every file is written and closed, the process group destroyed. The interpreter's teardown after that once
    # aborted a rank that had profiled ("terminate called without an active exception": native threads, kineto's
    # or gloo's, destroyed at exit; exit crashes of this kind: pytorch/pytorch#195837): skip it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
