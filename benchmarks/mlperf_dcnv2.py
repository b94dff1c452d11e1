"""MLPerf DLRM-DCNv2 on one GPU: issue #22's plain PyTorch baseline against our training step.

    python benchmarks/mlperf_dcnv2.py --out benchmarks/results/mlperf_dcnv2
    python benchmarks/mlperf_dcnv2.py --batch-sizes 16384 --no-baseline --variants triton+compiled \
        --append --out benchmarks/results/mlperf_dcnv2          # more rows into the same files
    python benchmarks/mlperf_dcnv2.py --smoke --out /tmp/mlperf  # tiny tables, batch 64 (CPU: baseline + eager)

The model is ``configs/mlperf-dcnv2.json``: 26 multi-hot features (214 lookups a sample), D = 128,
204M table rows in bf16 (52 GB), bottom MLP 13-512-256-128, a 3-layer rank-512 low-rank cross network
on the 3456-wide concatenation, top MLP 3456-1024-1024-512-256-1, bf16 autocast, BCE.

Implementations, each a row per batch size:

* ``baseline``: the plain PyTorch model the issue measured (1.14M samples/s at 65536 on an H100), written
  here as its own small eager module (`BaselineDCNv2`, not our package's model): one
  ``nn.EmbeddingBag(R, 128, mode="sum", sparse=True)`` in bf16 over all tables (modulus hashing
  ``(raw + 1) % card[f] + offset[f]`` per slot, static bag offsets ``b * 214 + slot_start[f]``), sparse
  ``torch.optim.SGD`` on the rows the sparse gradient touches, the MLPs and cross network under bf16
  autocast, dense ``torch.optim.Adagrad``;
* ours: `benchmarks/train_throughput.measure` (the run `train.py` builds, `dlrm.train.builder.build_run`)
  for each of ``--variants`` (`dlrm.train.compare.VARIANTS`; by default "auto", what ``train.py`` runs), with the
  config's optimizers (dense Adagrad, sparse row-wise Adagrad; ``--dense-optim`` switches the dense one;
  ``+step-graph`` variants capture the dense Adagrad as `dlrm.train.adagrad.CapturableAdagrad`, or a fused SGD
  or Adam). A variant using the
  torch embedding gets fp32 tables (the config refuses bf16 ones without the Triton embedding's
  stochastic rounding): at full size those need 104 GB and are recorded as out of memory.

Two 52 GB models do not fit one 80 GB GPU together: each case is built, timed and deleted (dynamo reset,
``torch.cuda.empty_cache()``) before the next; out-of-memory and other errors become the row's status.
Timing: synthetic batches already on the device (raw values uniform: every lookup a cold row), warm-up
steps untimed, then ``--settle-s`` seconds of untimed steps (the GPU's power-capped clock: an H200 trains this
step at its 700 W cap, and windows timed right after the warm-up read the first second's boost, ~1.6% above a
sustained run; `_common.settle`), then ``--windows`` windows of ``--steps`` steps timed with CUDA events;
samples/s is the median window's. Peak GiB is ``torch.cuda.max_memory_allocated`` (tables included).

The floor: FLOP per sample (fwd + bwd = 3 x the forward's 2 x multiply-adds, from the shapes, ~96 MFLOP)
at the measured bf16 GEMM rate (an 8192^3 matmul), and the embedding bytes per sample (each lookup's bf16
row read in the forward, read and written by the fused update, its fp32 row-wise Adagrad state read and
written, and the bf16 output gradient read: ~173 KB) at the measured ``copy_`` bandwidth (1 GiB, bytes
read + written). Activations and the dense parameters' traffic are not counted: a floor, not an estimate.
The GEMM is timed twice, in a short burst (the boost clock) and after ``--settle-s`` seconds of the same GEMM
(the power-capped clock the step runs at): two compute floors, and two in series.
Clocks (``--clocks``, on by default on a GPU with nvidia-smi): nvidia-smi samples every 50 ms while each case runs,
and the row keeps those of its timed windows: the SM clock and power (medians) and the share of samples with the
power-cap reason set, so that rows from machines with different capped clocks can be told apart (PERF.md, thirty-sixth
run: the same code 3.6% apart on two H200s).
Writes mlperf_dcnv2.csv / .md / .png under ``--out`` (GPU name, versions, date on every row / in the title).
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F_

# _common (which puts the repository first on sys.path), also when loaded by path (tests);
# appended: benchmarks/kernels.py must not shadow the kernels package
sys.path.append(str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    add_overwrite,
    claim_outputs,
    Timer,
    config_or_error,
    environment,
    int_list,
    settle,
    synthetic_batches,
)
from step_clocks import label_phases, parse_samples, start_sampler, summarize  # noqa: E402
from train_throughput import measure  # noqa: E402

from dlrm.config import load_config, validate  # noqa: E402,F401 - load_config: the tests' name
from dlrm.data.schema import is_multi_hot  # noqa: E402
from dlrm.train.compare import KERNEL_SETS, VARIANTS, unavailable_reason, variant_config  # noqa: E402

# the work per sample and its floors, the baseline model and the results, each in its module (benchmarks/_mlperf_*.py);
# every name moved there is imported back: it stays this script's attribute (the tests use them as such)
from _mlperf_baseline import BaselineDCNv2  # noqa: E402
from _mlperf_report import (  # noqa: E402,F401
    BASELINE, FLOOR_KEYS, HUGECTR, ISSUE_BASELINE, KEYS, NUMERIC, TARGET, TARGET_BATCH, add_comparisons, context_paragraph,
    floor_lines, fmt, markdown_table, millions, plot, read_rows, write_results)
from _mlperf_work import floors, mlp_macs, work_per_sample  # noqa: E402,F401

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "mlperf-dcnv2.json"
# "auto": what train.py runs with every default (dlrm.train.fast_path: the Triton embedding, the Gluon cross layers and
# the fused MLP where they run, compile, the whole step in one CUDA graph), the issue's measurement. Until 2026-11-29
# the default was the embedding kernel alone ("triton-embedding+step-graph" and "+compiled"), which "auto" had
# outgrown: 19.2 ms a step against auto's 17.6 on an H200 (benchmarks/PERF.md, thirty-sixth run).
PREFERRED = ["auto"]
DEFAULT_VARIANTS = [v for v in PREFERRED if v in VARIANTS]

# nvidia-smi's sampling interval during the timed windows (~36 samples in 5 windows of 20 MLPerf steps on an H200)
CLOCK_INTERVAL_MS = 50


# ---- the floor's rates, measured ------------------------------------------------------------------


def device_peaks(device: torch.device, smoke: bool, settle_s: float = 0.0) -> dict:
    """Measured bf16 GEMM TFLOP/s (an 8192^3 matmul; 512^3 fp32 on the CPU) and copy GB/s (``copy_`` of
    1 GiB, bytes read + written / time; 16 MiB on the CPU or in --smoke): the floor's rates. The GEMM is timed in a
    short burst (``gemm_tflops``: the boost clock) and, with ``settle_s`` > 0, again after ``settle_s`` seconds of
    the same GEMM back to back (``gemm_tflops_sustained``, else None): a GPU held at its power cap runs it at a lower
    clock, as it runs the training step (an H200: 654 TFLOP/s sustained on the top MLP's GEMM, PERF.md, thirty-seventh
    run)."""
    cuda = device.type == "cuda"
    n = 8192 if cuda and not smoke else 512
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    reps = 10 if cuda else 3
    for _ in range(2):
        a @ b
    with Timer(device) as t:
        for _ in range(reps):
            a @ b
    tflops = 2 * n**3 * reps / t.seconds / 1e12
    sustained = None
    if settle_s > 0:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < settle_s:
            for _ in range(reps):
                a @ b
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # drains the queue: the loop's clock is the GPU's
        with Timer(device) as t:
            for _ in range(reps):
                a @ b
        sustained = 2 * n**3 * reps / t.seconds / 1e12
    del a, b
    nbytes = 2**30 if cuda and not smoke else 2**24
    src = torch.empty(nbytes // 4, device=device, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    with Timer(device) as t:
        for _ in range(reps):
            dst.copy_(src)
    gbps = 2 * nbytes * reps / t.seconds / 1e9
    del src, dst
    free_device(device)
    return {"gemm_tflops": tflops, "gemm_tflops_sustained": sustained, "copy_gbps": gbps, "gemm_n": n,
            "copy_bytes": nbytes}




# ---- the baseline -----------------------------------------------------------------------------------




def measure_baseline(cfg, batch_size: int, device: torch.device, precision: str, cap: Optional[int], warmup: int,
                     steps: int, windows: int, settle_s: float = 0.0) -> dict:
    """The baseline's training step (sparse SGD on the embedding, dense Adagrad), timed as `measure`."""
    m, o = cfg.model, cfg.optim
    cards = [min(c, cap) if cap else c for c in m.cardinalities]
    emb_dtype = torch.bfloat16 if m.embedding_dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    model = BaselineDCNv2(cards, m.multi_hot_sizes, m.embedding_dim, m.bottom_mlp, m.top_mlp, m.cross_layers,
                          m.cross_rank, device, emb_dtype, precision)
    sparse_opt = torch.optim.SGD([model.emb.weight], lr=o.sparse.lr)
    dense_opt = torch.optim.Adagrad(model.dense_parameters(), lr=o.dense.lr, eps=o.dense.eps)
    batches = synthetic_batches(8, batch_size, device, multi_hot_sizes=m.multi_hot_sizes)

    def step(batch):
        sparse_opt.zero_grad(set_to_none=True)
        dense_opt.zero_grad(set_to_none=True)
        loss = F_.binary_cross_entropy_with_logits(model(batch.dense, batch.sparse), batch.labels)
        loss.backward()
        dense_opt.step()
        sparse_opt.step()
        return loss.detach()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for i in range(warmup):
        step(batches[i % len(batches)])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    settle(lambda i: step(batches[i % len(batches)]), settle_s, device, start=warmup)
    warmup_s = time.perf_counter() - t0
    rates, loss = [], torch.zeros((), device=device)
    windows_t0 = time.time()  # the host clock around the timed windows (the queue is empty here), for the sampler
    for w in range(windows):
        with Timer(device) as t:
            for i in range(steps):
                loss = step(batches[(w * steps + i) % len(batches)])
        rates.append(steps * batch_size / t.seconds)
    final_loss = float(loss)  # a sync: the windows have run
    sps = statistics.median(rates)
    return {"samples_per_sec": sps, "min_samples_per_sec": min(rates), "max_samples_per_sec": max(rates),
            "step_ms": batch_size / sps * 1e3, "warmup_s": warmup_s, "final_loss": final_loss,
            "windows_t0": windows_t0, "windows_t1": time.time(),
            "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
            "table_rows": sum(cards), "embedding_dtype": m.embedding_dtype, "dense_optim": "adagrad",
            "status": "ok"}


# ---- one case ---------------------------------------------------------------------------------------


def free_device(device: torch.device) -> None:
    """Drop compiled graphs (their CUDA-graph pools), collect and return cached blocks to the driver."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def error_status(e: BaseException) -> str:
    msg = str(e).splitlines()[0][:160] if str(e) else ""
    kind = "oom" if isinstance(e, torch.OutOfMemoryError) else "failed"
    return f"{kind}: {type(e).__name__}: {msg}"


def clock_sampler(device: torch.device, enabled: bool):
    """`step_clocks.Sampler` of nvidia-smi every `CLOCK_INTERVAL_MS` while a case runs; None on the CPU, when not
    `enabled` (--no-clocks) or without nvidia-smi."""
    if device.type != "cuda" or not enabled or shutil.which("nvidia-smi") is None:
        return None
    return start_sampler(device.index or 0, CLOCK_INTERVAL_MS)


def window_clocks(lines: list[str], t0: float, t1: float) -> dict:
    """``sm_mhz`` and ``power_w`` (medians) and ``power_capped`` (the share of samples with the power-cap reason)
    of the nvidia-smi lines sampled in the host-clock interval [t0, t1); {} when none fell in it.

        >>> window_clocks(["2026/11/29 10:00:01.000, 1700, 3201, 690.0, 50, 0x4",
        ...                "2026/11/29 10:00:01.050, 1800, 3201, 650.0, 50, 0x0"], 0.0, 2e9)
        {'sm_mhz': 1750.0, 'power_w': 670.0, 'power_capped': 0.5}
    """
    r = summarize(label_phases(parse_samples(lines), [("windows", t0, t1)]), "windows")
    return {} if r is None else {"sm_mhz": r["sm_mhz"], "power_w": r["power_w"],
                                 "power_capped": r["power cap (software)"]}


def run_case(impl: str, cfg, batch_size: int, device: torch.device, args) -> dict:
    """One row: the baseline or variant `impl` measured, skipped (cannot run here) or failed / out of
    memory (the error's first line); everything it allocated freed before returning. On a GPU with nvidia-smi the
    row also gets the SM clock, power and power-capped share sampled during its timed windows."""
    row = {"impl": impl, "batch_size": batch_size}
    sampler, windows = clock_sampler(device, getattr(args, "clocks", True)), None
    try:
        if impl == BASELINE:
            r = measure_baseline(cfg, batch_size, device, args.precision, args.max_rows, args.warmup, args.steps,
                                 args.windows, args.settle_s)
            windows = r.pop("windows_t0"), r.pop("windows_t1")
            row.update(r)
        else:
            # the batches are multi-hot when the config's sizes are (a torch-embedding step graph cannot replay them)
            reason = unavailable_reason(impl, device, multi_hot=is_multi_hot(cfg.model.multi_hot_sizes))
            vcfg = variant_config_for(cfg, impl, args)
            row.update(dense_optim=vcfg.optim.dense.name, embedding_dtype=vcfg.model.embedding_dtype,
                       table_rows=sum(min(c, args.max_rows) if args.max_rows else c for c in vcfg.model.cardinalities))
            if vcfg.model.embedding_dtype != cfg.model.embedding_dtype:
                row["note"] = "fp32 tables: the torch embedding has no bf16 update"
            # the checks train.py applies (e.g. +step-graph refuses a fused dense Adagrad)
            validate(variant_config(vcfg, impl))
            if reason:
                row["status"] = f"skipped: {reason}"
                return row
            r = measure(vcfg, impl, args.precision, batch_size, device, args.warmup, args.steps, args.windows,
                        args.settle_s)
            windows = r.pop("windows_t0"), r.pop("windows_t1")
            mb = r.pop("peak_memory_mb")
            row.update({k: v for k, v in r.items() if k in KEYS and k not in ("impl",)},
                       peak_memory_gib=mb / 1024 if mb is not None else None)
    except Exception as e:  # noqa: BLE001 -- out of memory included: one case must not hide the others
        traceback.print_exc()
        row["status"] = error_status(e)
    finally:
        if sampler is not None:
            lines = sampler.stop()
            if windows is not None:
                row.update(window_clocks(lines, *windows))
        free_device(device)
        if device.type == "cuda":  # what the next case cannot use (should be ~0: every case frees its model)
            print(f"  after {impl} B={batch_size}: {torch.cuda.memory_allocated(device) / 2**30:.2f} GiB still "
                  "allocated", flush=True)
    return row


def variant_config_for(cfg, variant: str, args):
    """`cfg` as `measure` gets it for `variant`: rows capped by --max-rows, --dense-optim, and fp32 tables
    for the torch embedding (which the config refuses in bf16)."""
    import copy

    v = copy.deepcopy(cfg)
    v.data.max_rows_per_table = args.max_rows
    if args.dense_optim:
        v.optim.dense.name = args.dense_optim
    if KERNEL_SETS[VARIANTS[variant].kernels][0] == "torch" and v.model.embedding_dtype == "bf16":
        v.model.embedding_dtype = "fp32"
    return v



def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder (mlperf_dcnv2.csv, .md, .png)")
    ap.add_argument("--config", default=str(CONFIG))
    ap.add_argument("--batch-sizes", default="65536,16384")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                    help="comma list of dlrm.train.compare.VARIANTS ('' for none)")
    ap.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True, help="measure the baseline")
    ap.add_argument("--precision", default="bf16", help="bf16 (autocast, as the config) or fp32 / tf32")
    ap.add_argument("--dense-optim", default=None, choices=["adagrad", "sgd", "adam"],
                    help="our runs' dense optimizer (default: the config's, adagrad); the baseline keeps Adagrad")
    ap.add_argument("--max-rows", type=int, default=None, help="cap every table at this many rows (both models)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps (compilation, CUDA-graph recording)")
    ap.add_argument("--steps", type=int, default=20, help="steps per timed window")
    ap.add_argument("--windows", type=int, default=5, help="timed windows; the median is reported")
    ap.add_argument("--settle-s", type=float, default=3.0,
                    help="seconds of untimed steps after the warm-up, before the windows (a GPU's power-capped "
                         "clock; 0: none, as before 2026-11-29; CUDA only)")
    ap.add_argument("--clocks", action=argparse.BooleanOptionalAction, default=True,
                    help="sample nvidia-smi (SM clock, power, the power-cap reason) during each case's timed windows")
    ap.add_argument("--append", action="store_true",
                    help="keep the rows of an earlier mlperf_dcnv2.csv in --out not measured again (the CSV's "
                         "environment and floor columns, and the Markdown's header, are this run's)")
    ap.add_argument("--smoke", action="store_true",
                    help="tables capped at 1000 rows, batch 64, 1 warm-up step and 2 windows of 1 step; "
                         "on the CPU the baseline and the 'eager' variant unless --variants names others")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    # --append merges into mlperf_dcnv2.csv and redraws the rest from it (asked for: never refused)
    outputs = claim_outputs(ap, args, args.out, ["mlperf_dcnv2.csv", "mlperf_dcnv2.md", "mlperf_dcnv2.png"],
                            append=args.append)

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    variants = [v for v in args.variants.split(",") if v]
    if args.smoke:
        args.max_rows = args.max_rows or 1000
        if args.batch_sizes == ap.get_default("batch_sizes"):
            args.batch_sizes = "64"
        args.warmup, args.steps, args.windows, args.settle_s = min(args.warmup, 1), 1, 2, 0.0
        if device.type != "cuda" and args.variants == ap.get_default("variants"):
            variants = ["eager"]  # Triton would run in its interpreter, compiled variants compile for minutes
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r} (choose from {', '.join(VARIANTS)})")
    impls = ([BASELINE] if args.baseline else []) + variants
    # before the device peaks are measured: bad input is one argparse line, not a traceback after minutes
    batch_sizes = int_list(ap, "--batch-sizes", args.batch_sizes)
    cfg = config_or_error(ap, args.config)
    if not cfg.model.multi_hot_sizes or not cfg.model.cardinalities:
        ap.error(f"{args.config}: needs model.cardinalities and model.multi_hot_sizes")

    env = environment(device)
    work = work_per_sample(cfg)
    peaks = device_peaks(device, args.smoke, settle_s=args.settle_s if device.type == "cuda" else 0.0)
    fl = floors(work, peaks)
    title = "MLPerf DLRM-DCNv2 training throughput, one GPU: issue #22 baseline vs ours" + (
        " (smoke)" if args.smoke else "")
    timing = "CUDA events" if device.type == "cuda" else "perf_counter (CPU)"
    tables = f"capped at {args.max_rows:,} rows each" if args.max_rows else "full size"
    note = (f"{Path(args.config).name}, {args.precision}; whole training steps on synthetic device-resident "
            f"batches (every lookup a cold row), {args.warmup} warm-up steps"
            + (f" and {args.settle_s:g} s of untimed steps (the GPU's power-capped clock)" if args.settle_s > 0
               and device.type == "cuda" else "")
            + f", median of {args.windows} windows "
            f"of {args.steps} steps ({timing}). Tables: {tables}. "
            "baseline: one sparse nn.EmbeddingBag (bf16) + sparse SGD, eager dense part under bf16 autocast, "
            "dense Adagrad; ours: the run train.py builds (sparse row-wise Adagrad fused into the Triton "
            "embedding's backward, dense optimizer as listed).")
    print(f"work per sample: {work['flop'] / 1e6:.1f} MFLOP fwd+bwd ({work['macs'] / 1e6:.2f}M MACs forward), "
          f"{work['emb_bytes'] / 1e3:.1f} KB of embedding traffic; measured {peaks['gemm_tflops']:.3g} TFLOP/s GEMM, "
          f"{peaks['copy_gbps']:,.0f} GB/s copy -> floor {millions(fl['floor_sps'])} samples/s "
          f"(compute {millions(fl['compute_floor_sps'])}, memory {millions(fl['memory_floor_sps'])}); "
          f"target {millions(TARGET)}, HugeCTR H100 {millions(HUGECTR)}", flush=True)

    out = Path(args.out)
    # --append: a case measured again replaces the earlier run's row; a variant named twice in this run (to
    # alternate it with another) keeps a row per measurement
    earlier = read_rows(out / "mlperf_dcnv2.csv") if args.append else []
    measured: list[dict] = []
    rows = earlier
    text = write_results(rows, env, work, fl, peaks, out, note, title)
    for batch_size in batch_sizes:
        for impl in impls:
            r = run_case(impl, cfg, batch_size, device, args)
            earlier = [x for x in earlier if (x["impl"], x["batch_size"]) != (impl, batch_size)]
            measured.append(r)
            rows = earlier + measured
            print(f"{impl:>28} B={batch_size:>6}: "
                  + (f"{r['samples_per_sec']:,.0f} samples/s, {r['step_ms']:.2f} ms/step" if r.get("samples_per_sec")
                     else r["status"]), flush=True)
            # rewritten after every case: a run cut short by a time limit keeps what it measured
            text = write_results(rows, env, work, fl, peaks, out, note, title)
    print(text, end="")
    outputs.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
