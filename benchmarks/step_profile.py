"""Where one training step's device time goes: the step's kernels, grouped by what they do.

    python benchmarks/step_profile.py --config configs/mlperf-dcnv2.json --variant triton-embedding+compiled \
        --batch-size 65536 --out benchmarks/results --name step_profile_mlperf_b65536
    python benchmarks/step_profile.py --config configs/kaggle.json --variant triton-embedding-interaction+step-graph \
        --batch-size 65536 --precision tf32 --out benchmarks/results --name step_profile_kaggle_b65536

Builds the run `train.py` builds for ``--variant`` (`dlrm.train.builder.build_run`, as
`train_throughput.py` does) on synthetic device-resident batches, times ``--steps`` steps with CUDA events
(the step's wall time on the device), then profiles the same number of steps with the PyTorch profiler
(CUDA activity) and adds up each kernel's device time. Under torch.compile the named ranges of the model
(DenseArch, SparseArch, ...) are not recorded, so the kernels are grouped by name (`CATEGORIES`, first
match wins): the pooled or one-hot embedding lookup, the sort and the fused update of the embedding
backward, GEMMs, Inductor's fused kernels, the project's other Triton kernels, the dense optimizer, copies.
"idle" is the timed step minus the kernels' sum: launch gaps, host-bound stretches.

``--data DIR`` trains on batches of that dataset's train split instead (the first 8, shuffled, cut by the
device-resident loader `train.py` uses with `data.placement` "gpu", its hashing and table sizes): the step on the
data's own id distribution (the synthetic generator's is Zipf-like, with hot rows the uniform batches lack).
``--group-sums on|off`` forces how the embedding update finishes hot rows (`kernels.embedding.update.CARRY_GROUP_SUMS`;
"auto", the default, leaves it to the launch config: group sums for multi-hot tables since 2026-11-29), for an A/B.

Writes ``<name>.md`` / ``.csv`` / ``.png`` under ``--out`` (GPU name, versions and date). CUDA only.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

# _common (which puts the repository first on sys.path), also when loaded by path (tests);
# appended: benchmarks/kernels.py must not shadow the kernels package
sys.path.append(str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    add_overwrite,
    claim_outputs,
    Timer,
    env_line,
    environment,
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

from dlrm.config import validate  # noqa: E402
from dlrm.train.builder import build_run, tables_from_config  # noqa: E402
from dlrm.train.compare import variant_config  # noqa: E402

# (category, regular expression on the kernel name), first match wins
CATEGORIES = [
    # torchrun's collectives (the sharded tables' all_to_all, DDP's all_reduce): NCCL's kernels on the GPU,
    # c10d's ops and the all_to_all's autograd nodes where the CPU profile stands in (benchmarks/scaling.py)
    ("collectives (NCCL)", r"nccl|Nccl|c10d::|AllToAll|all_to_all|alltoall|allreduce|all_reduce"),
    ("embedding lookup", r"_pooled_fwd_kernel|_lookup_kernel|_embedding_fwd|_gather_rows"),
    ("embedding update: sort", r"radix_?sort|RadixSort|fill_reverse_indices|_sort_"),
    ("embedding update: segment sums + optimizer", r"_sparse_chunk_kernel|_group_sum_kernel|_sparse_carry_kernel|_sgd_atomic_kernel"),
    ("GEMMs (cuBLAS / CUTLASS)", r"gemm|cutlass|xmma|nvjet|cublas|s1688|s16816|wgmma"),
    ("Inductor fused kernels", r"^triton_"),
    ("dense optimizer", r"multi_tensor|foreach|adagrad|_fused_sgd|_fused_adam|FusedOptimizer"),
    ("other Triton kernels (ours)", r"^_"),
    # memcpy128: a device-to-device cudaMemcpy captured in a CUDA graph runs as this kernel
    ("copies and fills", r"Memcpy|memcpy|Memset|memset|copy|fill|elementwise_kernel"),
]
KEYS = ["category", "ms_per_step", "share_of_step", "kernels"]


def category(name: str) -> str:
    for label, pattern in CATEGORIES:
        if re.search(pattern, name):
            return label
    return "other"


def device_times(prof) -> list[tuple[str, float, int]]:
    """(kernel name, total device microseconds, calls) of every device-side event the profiler kept."""
    out = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:  # torch < 2.4
            us = getattr(e, "self_cuda_time_total", 0.0)
        if us and getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA"):
            out.append((e.key, float(us), int(e.count)))
    return out


def dataset_batches(cfg, data_dir: Path, n: int, batch_size: int, device: torch.device):
    """``(tables, batches)``: the dataset's tables and the first `n` shuffled training batches of its train split, as
    `train.py`'s device-resident loader cuts them."""
    from dlrm.data.schema import read_metadata
    from dlrm.data.validation import split_files
    from dlrm.train.setup import dataset_tables
    from dlrm.train.trainer import make_loader

    meta = read_metadata(data_dir)
    loader = make_loader(cfg, split_files(data_dir, meta, "train"), batch_size, device, train=True, placement="gpu",
                         multi_hot_sizes=meta.multi_hot_sizes, dense_format=meta.dense_format)
    from dlrm.data.batch import Batch

    batches = []
    for batch in loader:
        # gathered here, once, as plain batches (the synthetic ones are): a shuffled batch of this loader gathers
        # lazily (`GatheredBatch`), so a CUDA-graphed variant would replay its gathers every step while an ordinary
        # one reused the tensors gathered at its first read, each variant timing a different step
        batches.append(Batch(batch.dense, batch.sparse, batch.labels, batch.global_size, batch.pad))
        if len(batches) == n:
            break
    if len(batches) < n:
        raise SystemExit(f"--data {data_dir}: the train split holds {len(batches)} batches of {batch_size}, need {n}")
    return dataset_tables(cfg, meta, data_dir), batches


def profile_step(cfg, variant: str, batch_size: int, precision: str, steps: int, warmup: int, top_n: int = 15,
                 data: Path | None = None):
    """(step ms from CUDA events, per-category rows, the `top_n` longest kernels) of `variant` on synthetic batches
    (or, with `data`, on that dataset's)."""
    from torch.profiler import ProfilerActivity, profile

    cfg = variant_config(cfg, variant)
    cfg.train.precision = precision
    cfg.data.batch_size = batch_size
    validate(cfg)
    device = torch.device("cuda")
    torch.manual_seed(0)
    if data is None:
        tables = tables_from_config(cfg)
        batches = synthetic_batches(8, batch_size, device, multi_hot_sizes=cfg.model.multi_hot_sizes)
    else:
        tables, batches = dataset_batches(cfg, data, 8, batch_size, device)
    run = build_run(cfg, tables, device, total_steps=warmup + 2 * steps)
    train_steps(run, batches, warmup)
    with Timer(device) as t:
        train_steps(run, batches, steps, start=warmup)
    step_ms = t.seconds * 1e3 / steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        train_steps(run, batches, steps, start=warmup + steps)
        torch.cuda.synchronize(device)
    kernels = device_times(prof)
    top = sorted(kernels, key=lambda k: -k[1])[:top_n]
    return (step_ms, category_rows(kernels, steps, step_ms),
            [(n, us / 1e3 / steps, calls // steps, category(n)) for n, us, calls in top])


def category_rows(kernels: list[tuple[str, float, int]], steps: int, step_ms: float) -> list[dict]:
    """`kernels` ((name, total microseconds, calls) over `steps` steps) added up per `category`, ms a step
    and share of the `step_ms` step, longest first, with "idle": the step minus the kernels' sum."""
    by_cat: dict[str, list[float]] = {}
    for name, us, _ in kernels:
        by_cat.setdefault(category(name), []).append(us)
    rows = [{"category": c, "ms_per_step": sum(v) / 1e3 / steps, "kernels": len(v)} for c, v in by_cat.items()]
    busy = sum(r["ms_per_step"] for r in rows)
    rows.append({"category": "idle (step minus kernels)", "ms_per_step": max(0.0, step_ms - busy), "kernels": 0})
    rows.sort(key=lambda r: -r["ms_per_step"])
    for r in rows:
        r["share_of_step"] = r["ms_per_step"] / step_ms
    return rows


def plot(rows: list[dict], env: dict, path: Path, title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.5))
    labels = [r["category"] for r in rows][::-1]
    ax.barh(labels, [r["ms_per_step"] for r in rows][::-1], color="tab:blue")
    ax.set_xlabel("device ms per step")
    ax.set_title(f"{title}\n{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}", fontsize=9)
    ax.grid(True, axis="x", alpha=0.3)
    save_figure(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/mlperf-dcnv2.json")
    ap.add_argument("--variant", default="triton-embedding+compiled")
    ap.add_argument("--batch-size", type=int, default=65536)
    ap.add_argument("--precision", default=None, help="default: the config's train.precision")
    ap.add_argument("--max-rows", type=int, default=None, help="cap every table at this many rows")
    ap.add_argument("--steps", type=int, default=10, help="steps timed, then as many profiled")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps first (compilation, graph capture)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="step_profile")
    ap.add_argument("--top", type=int, default=15, help="kernels listed by time (the table of top kernels)")
    ap.add_argument("--data", type=Path, default=None,
                    help="batches of this dataset's train split instead of synthetic uniform ones")
    ap.add_argument("--group-sums", choices=["auto", "on", "off"], default="auto",
                    help="force the embedding update's group sums on or off (auto: the launch config's)")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    outputs = claim_outputs(ap, args, args.out, [f"{args.name}.md", f"{args.name}.csv", f"{args.name}.png"])
    # the options and the config first: one argparse line for a bad one, before the CUDA check (it was a traceback,
    # and only on a GPU); --max-rows: else the config's own cap (configs/terabyte.json: 10M rows)
    positive_or_error(ap, steps=args.steps, top=args.top)
    if args.data is not None and not (args.data / "metadata.json").is_file():
        ap.error(f"--data {args.data}: no metadata.json there")
    cfg = run_config_or_error(ap, args.config, {"data.batch_size": args.batch_size, "train.precision": args.precision,
                                                "data.max_rows_per_table": args.max_rows}, args.variant,
                              tables="config" if args.data is None else None)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device (the profile is of device kernels)")
    from kernels.embedding import update

    update.CARRY_GROUP_SUMS = {"auto": None, "on": True, "off": False}[args.group_sums]
    precision = args.precision or cfg.train.precision
    env = environment(torch.device("cuda"))
    step_ms, rows, top = profile_step(cfg, args.variant, args.batch_size, precision, args.steps, args.warmup,
                                      args.top, args.data)
    source = f"batches of {args.data.name}" if args.data else "synthetic uniform batches"
    title = (f"{Path(args.config).name}, {args.variant}, {precision}, batch {args.batch_size}, {source}, group sums "
             f"{args.group_sums}: one step's device time")
    cat_lines = ["| what | device ms per step | share of the step | distinct kernels |", "| --- | ---: | ---: | ---: |"]
    cat_lines += [md_row([r["category"], f"{r['ms_per_step']:.3f}", f"{100 * r['share_of_step']:.1f}%", r["kernels"]])
                  for r in rows]
    top_lines = ["", "Top kernels:", "", "| kernel | ms per step | calls per step | group |", "| --- | ---: | ---: | --- |"]
    top_lines += [md_row([n[:90].replace("|", "\\|"), f"{ms:.3f}", calls, c]) for n, ms, calls, c in top]
    note = (f"Step time {step_ms:.2f} ms ({args.batch_size / step_ms * 1e3 / 1e6:.2f}M samples/s), the mean of "
            f"{args.steps} steps after {args.warmup} warm-up steps (CUDA events); kernel times from the PyTorch "
            f"profiler over {args.steps} more steps. Tables: "
            + (f"capped at {cfg.data.max_rows_per_table:,} rows" if cfg.data.max_rows_per_table else "full size") + ".")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(title, [env_line(env), note], cat_lines + top_lines)
    (out / f"{args.name}.md").write_text(text)
    write_csv(out / f"{args.name}.csv", rows, KEYS, {**env, "step_ms": step_ms, "variant": args.variant,
                                                     "batch_size": args.batch_size, "precision": precision,
                                                     "data": str(args.data or "synthetic"),
                                                     "group_sums": args.group_sums})
    plot(rows, env, out / f"{args.name}.png", title)
    print(text, end="")
    outputs.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
