"""Micro-benchmarks of the Triton kernels in kernels/ against eager PyTorch and torch.compile.

On the GPU machine (one run; or split by family with --append so that each command stays short):

    python benchmarks/kernels.py --out benchmarks/results
    python benchmarks/kernels.py --kernels embedding --out benchmarks/results
    python benchmarks/kernels.py --kernels interaction,loss --append --out benchmarks/results
    python benchmarks/kernels.py --kernels linear --append --out benchmarks/results

CPU smoke test (Triton interpreter, tiny shapes; timings are meaningless and the report says so):

    TRITON_INTERPRET=1 python benchmarks/kernels.py --device cpu --quick --out /tmp/kb

What is measured, per kernel variant (``--list`` prints them), batch size, dtype and implementation:

* kernels: hash_rows, the embedding lookup / fused-SGD backward (D=16 on the Kaggle tables, D=128 on
  tables capped at 4M rows), the dot interaction ([B, 27, 16], [B, 27, 128]), the fused linear+relu
  (512x256, 256x64, 1024x1024), the BCE loss and the DCN cross layer's fused GEMM (Kaggle's 432 x rank
  128 and MLPerf's 3456 x rank 512, against cuBLAS + the eager elementwise cross);
* modes ``fwd``, ``bwd`` (the backward alone, from a retained graph) and ``fwd+bwd``;
* implementations ``triton`` (kernels/), ``eager`` (the eager PyTorch op of dlrm/model: for the
  linear layer that is cuBLAS ``F.linear`` + a separate ``relu``) and ``compile`` (``torch.compile``
  of the same eager function, default mode, static shapes); for the fp32 embedding also
  ``triton_atomic`` (the non-deterministic atomic SGD update);
* time: median of ``triton.testing.do_bench`` (L2 flushed before every run); GB/s for the memory-bound
  ops from the bytes each op must minimally move (see ``*_bytes`` below), compared with the copy
  bandwidth measured in the same run (``dst.copy_(src)`` of 1 GiB, bytes read + written / time);
  TFLOP/s for the GEMMs (2MNK forward, 4MNK backward). fp32 GEMMs may use TF32 on both sides
  (``torch.set_float32_matmul_precision("high")``, i.e. ``torch.backends.cuda.matmul.allow_tf32``
  True; ``--no-tf32`` turns it off).

Outputs under ``--out``: kernels.csv (one row per kernel, mode, batch, dtype, impl), one PNG per kernel
variant, kernels.md (environment, copy bandwidth, tables, target verdicts); the tables and verdicts are
printed to stdout too. Every case runs in its own try/except: a failing kernel is recorded, not fatal.

The calls into kernels/ are gathered in benchmarks/_kernels_adapter.py (the kernels' APIs may move); the cases in
_kernels_cases.py, the reporting in _kernels_report.py.
"""

from __future__ import annotations

import argparse
import inspect
import os
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

# The interpreter must be on before triton is first imported (an explicit TRITON_INTERPRET=0 wins).
if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1 :][:1] == ["cpu"]:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402
from loguru import logger  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# appended, as the other scripts do: the output policy they share (`_common.claim_outputs`)
sys.path.append(str(Path(__file__).resolve().parent))

from _common import add_overwrite, claim_outputs  # noqa: E402
from dlrm.logging_setup import ProgressBar  # noqa: E402

# the calls into kernels/, the cases and the reporting, each in its module (benchmarks/_kernels_*.py); every name moved
# there is imported back: it stays this script's attribute (the tests and onehot_embedding_sweep.py use them as such)
from _kernels_adapter import (  # noqa: E402,F401
    _kmod, eager_bce, eager_cross_layer, eager_embedding_fwd, eager_embedding_sgd_update_, eager_embedding_step,
    eager_hash_rows, eager_interaction, eager_linear_relu, tr_bce, tr_cross_layer, tr_dot_interaction,
    tr_embedding_lookup, tr_embedding_sgd_update_, tr_fused_embedding, tr_hash_rows, tr_linear_relu)
from _kernels_cases import (  # noqa: E402,F401
    CROSS_TARGETS, DTYPES, EMB_TARGETS, EMBEDDING_LR, IMPLS, INTERACTION_TARGETS, LINEAR_TARGETS, LOSS_TARGETS, MODES,
    NUM_VECTORS, SPECS, _TABLES, Built, Ctx, ModeFactory, Spec, Target, autograd_modes, build_cross, build_embedding,
    build_hash_rows, build_interaction, build_linear, build_loss, compiled, embedding_bytes, embedding_tables,
    free_memory, fwd_bwd_work, standard_impls)
from _kernels_report import (  # noqa: E402,F401
    CSV_FIELDS, WHY_MISSED, _allow_tf32_state, environment, evaluate_targets, fmt, kernel_table, lookup, md_table,
    plot_kernel, read_csv, verdict_table, write_csv, write_markdown)


# ====================================================================================================
# Timing
# ====================================================================================================


def _do_bench_kwargs() -> dict:
    """Median from do_bench: return_mode where it exists (triton >= 3.0), else quantiles=[0.5]."""
    params = inspect.signature(triton.testing.do_bench).parameters
    return {"return_mode": "median"} if "return_mode" in params else {"quantiles": [0.5]}


def bench_graph_ms(fn, grad_to_none: list, rep_ms: int) -> float:
    """Median milliseconds of fn() replayed from a CUDA graph: the device time alone, with the host's
    launch cost (Python, custom-op dispatch, Triton's launcher) taken out, as in a training step run
    under CUDA graphs. No L2 flush between calls. Same method as triton.testing.do_bench_cudagraph
    (one graph of n calls, replayed 10 times), but captured on the *current* stream: the `bwd` mode
    replays a backward whose forward ran before the capture, and autograd launches backward kernels
    on the forward's stream, so that stream has to be the capturing one (run_case makes it so)."""
    stream = torch.cuda.current_stream()

    def captured(n: int) -> torch.cuda.CUDAGraph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            for _ in range(n):
                for t in grad_to_none:
                    t.grad = None
                fn()
        return g

    def replay_ms(g: torch.cuda.CUDAGraph) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        g.replay()
        end.record(stream)
        end.synchronize()
        return start.elapsed_time(end)

    one = captured(1)
    replay_ms(one)  # first replay uploads the graph
    n = max(1, min(1000, int(rep_ms / max(replay_ms(one), 1e-3))))
    del one
    graph = captured(n)
    replay_ms(graph)
    return statistics.median(replay_ms(graph) / n for _ in range(10))


def reset_cuda_rng_after_failed_capture(device: torch.device) -> None:
    """A capture that fails inside cudaStreamEndCapture leaves the default CUDA generator believing it
    is still capturing ("Offset increment outside graph capture encountered unexpectedly" on every
    later torch.randn). A cloned state is a fresh one with the same seed and offset: swap it in."""
    gen = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    try:
        gen.graphsafe_set_state(gen.clone_state())
    except (AttributeError, RuntimeError) as exc:  # older torch: nothing to reset, or no API for it
        logger.debug(f"could not reset the CUDA generator: {one_line(exc)}")


def bench_ms(fn, grad_to_none: list, device: torch.device, warmup_ms: int, rep_ms: int, cpu_reps: int,
             timing: str = "launch") -> float:
    """Median milliseconds of fn() (compiled / autotuned by one untimed call first)."""
    fn()
    for t in grad_to_none:
        t.grad = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        if timing == "graph":
            return bench_graph_ms(fn, grad_to_none, rep_ms)
        ms = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none or None, **_do_bench_kwargs())
        return float(ms[0] if isinstance(ms, (list, tuple)) else ms)
    times = []
    for _ in range(cpu_reps):
        for t in grad_to_none:
            t.grad = None
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, args) -> tuple[float, float, int]:
    """(GB/s, ms, bytes) of dst.copy_(src) on a 1 GiB fp32 tensor (16 MiB on the CPU)."""
    nbytes = 2**30 if device.type == "cuda" else 2**24
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), [], device, args.warmup_ms, args.rep_ms, args.cpu_reps)
    src = dst = None  # frees the buffers; rebinding, not del: the timed lambda closes over these names
    free_memory(device)
    return 2 * nbytes / ms / 1e6, ms, 2 * nbytes



# ====================================================================================================
# Running the cases
# ====================================================================================================


def one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


def base_row(spec: Spec, batch: int, dtype_name: str) -> dict:
    return {"kernel": spec.name, "family": spec.family, "shape": spec.shape, "batch": batch, "dtype": dtype_name,
            "metric": spec.metric, "ms": None, "value": None, "bytes": None, "flops": None, "note": "", "error": ""}  # fmt: skip


def time_mode(factory: ModeFactory, ctx: Ctx, args) -> tuple[float, str]:
    """(median ms, "" or why graph timing fell back to launch timing) of one mode."""
    if args.timing != "graph":
        fn, grad_to_none = factory()
        return bench_ms(fn, grad_to_none, ctx.device, args.warmup_ms, args.rep_ms, args.cpu_reps), ""
    try:
        # set up (a `bwd` mode runs its forward here) and capture on one side stream: see bench_graph_ms
        with torch.cuda.stream(ctx.graph_stream):
            fn, grad_to_none = factory()
            return bench_ms(fn, grad_to_none, ctx.device, args.warmup_ms, args.rep_ms, args.cpu_reps, "graph"), ""
    except RuntimeError as exc:
        # an op that syncs with the host (e.g. torch.unique) cannot be captured: time it the ordinary way
        # and say so in the row
        fn = grad_to_none = None  # drop the retained graph of the failed attempt
        torch.cuda.synchronize(ctx.device)
        reset_cuda_rng_after_failed_capture(ctx.device)
        fn, grad_to_none = factory()
        return bench_ms(fn, grad_to_none, ctx.device, args.warmup_ms, args.rep_ms, args.cpu_reps), one_line(exc)


def run_case(spec: Spec, batch: int, dtype_name: str, ctx: Ctx, args) -> list[dict]:
    """All impls and modes of one (kernel, batch, dtype): one row each (errors recorded, never raised)."""
    rows = []
    if "compile" in ctx.impls:
        torch._dynamo.reset()
    try:
        built = spec.build(ctx, batch, DTYPES[dtype_name])
    except Exception as exc:  # noqa: BLE001
        logger.warning(f"{spec.name} B={batch} {dtype_name}: setup failed: {one_line(exc)}")
        logger.debug(traceback.format_exc())
        return [{**base_row(spec, batch, dtype_name), "mode": "*", "impl": "(setup)", "error": one_line(exc)}]
    for impl, modes in built.impls.items():
        for mode in MODES:
            if mode not in modes:
                continue
            row = {**base_row(spec, batch, dtype_name), "mode": mode, "impl": impl, "note": built.note}
            work = built.work[mode]
            row["bytes" if spec.metric == "GB/s" else "flops"] = work
            try:
                ms, fallback = time_mode(modes[mode], ctx, args)
                if fallback:
                    logger.warning(f"{spec.name} {mode} B={batch} {dtype_name} {impl}: not capturable, launch-timed: {fallback}")
                    row["note"] = "; ".join(x for x in (row["note"], "launch-timed: not capturable in a CUDA graph") if x)
                row["ms"] = ms
                row["value"] = work / ms / (1e6 if spec.metric == "GB/s" else 1e9)
                if ctx.device.type == "cuda":
                    torch.cuda.synchronize(ctx.device)
            except Exception as exc:  # noqa: BLE001
                row["error"] = one_line(exc)
                logger.warning(f"{spec.name} {mode} B={batch} {dtype_name} {impl}: {row['error']}")
                logger.debug(traceback.format_exc())
            rows.append(row)
    del built
    free_memory(ctx.device)
    return rows


def select_specs(names: Optional[str], quick: bool) -> list[Spec]:
    if not names:
        return [s for s in SPECS if s.quick or not quick]
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if not any(n in (s.name, s.family) for s in SPECS)]
    if unknown:
        raise SystemExit(f"unknown --kernels {unknown}; choose from {[s.name for s in SPECS]} or families "
                         f"{sorted({s.family for s in SPECS})}")  # fmt: skip
    return [s for s in SPECS if s.name in wanted or s.family in wanted]




# ====================================================================================================
# Main
# ====================================================================================================


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", help="comma-separated kernel variants or families (default: all; see --list)")
    p.add_argument("--batch-sizes", help="comma-separated (default 2048,16384,65536; --quick 2048,16384; cpu 8,16)")
    p.add_argument("--dtypes", help="comma-separated of fp32,bf16 (default both; cpu: fp32, the interpreter's only dtype)")
    p.add_argument("--impls", help=f"comma-separated of {','.join(IMPLS)} (default all; cpu: no compile)")
    p.add_argument("--quick", action="store_true", help="few small cases: one variant per family, small batches")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (needs TRITON_INTERPRET=1; smoke test only)")
    p.add_argument("--out", default="benchmarks/results", help="output folder (kernels.csv, kernels.md, <kernel>.png)")
    p.add_argument("--append", action="store_true", help="merge into an existing kernels.csv: replace the (kernel, batch, dtype) cases measured now, keep the rest")
    p.add_argument("--no-tf32", dest="tf32", action="store_false", help="fp32 GEMMs in full fp32 on both sides")
    p.add_argument("--max-rows", type=int, help="cap every embedding table at this many rows (cpu default 2000)")
    p.add_argument("--warmup-ms", type=int, default=25)
    p.add_argument("--rep-ms", type=int, default=100)
    p.add_argument("--cpu-reps", type=int, default=3, help="timed calls per case on the CPU")
    p.add_argument("--timing", choices=["launch", "graph"], default="launch",
                   help="launch: do_bench, each call launched from Python (host cost included where it dominates); "
                   "graph: do_bench_cudagraph, device time alone; writes kernels_graph.* and <kernel>_graph.png")
    p.add_argument("--list", action="store_true", help="print the kernel variants and exit")
    p.add_argument("-v", "--verbose", action="store_true", help="log tracebacks of failing cases")
    add_overwrite(p)  # (--append merges into kernels.csv and redraws the rest: asked for, never refused)
    return p


def parse_args(argv=None):
    return parser().parse_args(argv)


def resolve_options(args) -> tuple[torch.device, list[int], list[str], tuple[str, ...]]:
    device = torch.device(args.device)
    cpu = device.type == "cpu"
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available (use --device cpu with TRITON_INTERPRET=1 for a smoke test)")
    from kernels._backend import interpret_mode  # imported here: TRITON_INTERPRET is set above before triton loads

    if cpu and not interpret_mode():
        raise SystemExit("--device cpu needs TRITON_INTERPRET=1 (set before triton is imported)")
    if args.batch_sizes:
        batches = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    else:
        batches = [8, 16] if cpu else ([2048, 16384] if args.quick else [2048, 16384, 65536])
    if cpu and args.quick and not args.batch_sizes:
        batches = [8]
    dtypes = [d.strip() for d in (args.dtypes or ("fp32" if cpu else "fp32,bf16")).split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        raise SystemExit(f"unknown --dtypes {bad}; choose from {list(DTYPES)}")
    default_impls = ",".join(i for i in IMPLS if not (cpu and i == "compile"))
    impls = tuple(i.strip() for i in (args.impls or default_impls).split(",") if i.strip())
    bad = [i for i in impls if i not in IMPLS]
    if bad:
        raise SystemExit(f"unknown --impls {bad}; choose from {list(IMPLS)}")
    if cpu and args.timing == "graph":
        raise SystemExit("--timing graph needs CUDA (CUDA graphs)")
    if cpu and args.max_rows is None:
        args.max_rows = 2000
    return device, batches, dtypes, impls


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    logger.remove()
    logger.add(lambda m: ProgressBar.write(m, end=""), level="DEBUG" if args.verbose else "INFO", colorize=False,
               format="{time:HH:mm:ss} | {level: <7} | {message}")  # fmt: skip
    if args.list:
        for s in SPECS:
            print(f"{s.name:<24} {s.family:<12} {s.metric:<8} {s.shape}{'  (quick)' if s.quick else ''}")
        return 0
    specs = select_specs(args.kernels, args.quick)
    device, batches, dtypes, impls = resolve_options(args)
    tag = "_graph" if args.timing == "graph" else ""
    names = [f"kernels{tag}.csv", f"kernels{tag}.md", *(f"{s.name}{tag}.png" for s in specs)]
    outputs = claim_outputs(ap, args, args.out, names, append=args.append)
    cpu = device.type == "cpu"
    torch.set_float32_matmul_precision("high" if args.tf32 else "highest")  # sets matmul.allow_tf32 consistently
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if cpu:
        logger.warning("CPU smoke run (Triton interpreter, tiny shapes): timings are meaningless")
    ctx = Ctx(device=device, impls=impls, tf32=args.tf32, max_rows=args.max_rows,
              graph_stream=torch.cuda.Stream(device) if args.timing == "graph" else None)
    env = environment(device, args)
    logger.info(f"{env['device']} | torch {env['torch']} | triton {env['triton']} | CUDA {env['CUDA']}")

    copy = copy_bandwidth(device, args)
    logger.info(f"copy bandwidth: {copy[0]:.0f} GB/s ({copy[2] / 2 / 2**20:.0f} MiB copy, {copy[1]:.3f} ms)")
    rows = [{"kernel": "copy", "family": "copy", "shape": f"{copy[2] // 2} bytes", "mode": "fwd", "batch": "", "dtype": "fp32",
             "impl": "torch", "ms": copy[1], "metric": "GB/s", "value": copy[0], "bytes": copy[2], "note": "dst.copy_(src)"}]  # fmt: skip

    cases = [(s, d, b) for s in specs for d in dtypes for b in batches]
    logger.info(f"{len(cases)} cases: kernels {[s.name for s in specs]}, batches {batches}, dtypes {dtypes}, impls {list(impls)}")
    t0 = time.perf_counter()
    # `timeout` sends SIGTERM: stop after the case in flight and still write what was measured. The caller's handler
    # comes back after the cases: called in-process (the tests), it stayed, and a later SIGTERM in that process raised
    # KeyboardInterrupt (a test worker went down on a training test's own SIGTERM)
    previous_sigterm = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        for spec, dtype, batch in ProgressBar(cases, desc="kernels", unit="case", dynamic_ncols=True):
            if _TABLES and not spec.name.startswith("embedding_"):
                _TABLES.clear()  # the cached tables take up to ~10 GB
                free_memory(device)
            try:
                rows += run_case(spec, batch, dtype, ctx, args)
            except Exception as exc:  # noqa: BLE001  (e.g. a CUDA error that poisoned the context)
                logger.error(f"{spec.name} B={batch} {dtype}: {one_line(exc)}")
                rows.append({**base_row(spec, batch, dtype), "mode": "*", "impl": "(case)", "error": one_line(exc)})
    except KeyboardInterrupt:
        logger.warning(f"interrupted: writing the {len(rows) - 1} results measured so far (the other cases are missing)")
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)
    _TABLES.clear()
    free_memory(device)
    logger.info(f"measured in {time.perf_counter() - t0:.0f} s")

    csv_path = out / f"kernels{tag}.csv"
    if args.append and csv_path.exists():
        # replace exactly the (kernel, batch, dtype) cases measured now: a rerun of a few cases (or one
        # cut short by its time limit) keeps every other row of the file
        done = {(r["kernel"], str(r["batch"]), r["dtype"]) for r in rows if r["kernel"] != "copy"}
        kept = [r for r in read_csv(csv_path) if r["kernel"] != "copy" and (r["kernel"], str(r["batch"]), r["dtype"]) not in done]
        rows = rows[:1] + kept + rows[1:]
    write_csv(csv_path, rows)
    verdicts = evaluate_targets(rows, copy[0])
    plotted = [s.name for s in SPECS if plot_kernel(out / f"{s.name}{tag}.png", rows, s, copy[0])]
    md_path = out / f"kernels{tag}.md"
    text = write_markdown(md_path, rows, verdicts, env, copy, cpu, tag)
    print(text)
    n_err = sum(1 for r in rows if r.get("error"))
    logger.info(f"wrote {csv_path}, {md_path} and {len(plotted)} plots; {n_err} failed cases")
    outputs.paths = [csv_path, md_path, *(out / f"{name}{tag}.png" for name in plotted)]  # --append: its merge's too
    outputs.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
