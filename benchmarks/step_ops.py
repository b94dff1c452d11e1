"""Every kernel of one training step by the op that launched it, with the op's input shapes and strides; each GEMM
timed again alone on tensors of those very shapes and strides.

    python benchmarks/step_ops.py --config configs/mlperf-dcnv2.json --batch-size 65536 \
        --out benchmarks/results --name step_ops_mlperf

`benchmarks/step_profile.py` adds up the kernels of the captured step by name; a name says nothing of the shapes, so
a GEMM kernel that runs slower in the step than its shape runs alone cannot be told apart there (cuBLAS picks its
kernel by shape, layout and alignment; the step's layouts are whatever autograd and Inductor hand it). This script
builds the run `train.py` builds for ``--variant`` ("auto": every default) with the whole-step CUDA graph off (a
replayed graph hides its launches from the profiler; the kernels are the same), profiles ``--steps`` steps with
CPU ops and shapes recorded, and gives each kernel to the innermost CPU op open on the thread that launched it
(the trace's correlation ids link a kernel to its launch call). Then each GEMM op (``aten::mm``, ``addmm``,
``addmm_``, ``_addmm_activation``) is run alone ``--repeats`` times on fresh tensors with the recorded shapes,
strides and dtypes: "in step" against "alone", both per call.

Writes ``<name>.md`` / ``.csv`` / ``.png`` under ``--out`` (GPU name, versions and date). CUDA only.
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Optional

import torch

sys.path.append(str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    add_overwrite,
    claim_outputs,
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

# GEMM ops: the positions of their two operands in the recorded inputs, and of the addend (None: none)
GEMM_OPS = {"aten::mm": (0, 1, None), "aten::addmm": (1, 2, 0), "aten::addmm_": (1, 2, 0),
            "aten::_addmm_activation": (1, 2, 0)}
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
DEVICE_CATS = ("kernel", "gpu_memset", "gpu_memcpy")
DTYPES = {"c10::BFloat16": torch.bfloat16, "c10::Half": torch.float16, "float": torch.float32,
          "double": torch.float64}
KEYS = ["op", "kernel", "dims", "strides", "dtypes", "calls_per_step", "ms_per_step", "ms_per_call", "gflop",
        "tflops", "alone_ms_per_call", "alone_tflops", "alone_status"]


def kernels_by_op(trace: dict) -> list[dict]:
    """One dict per device event of `trace` (a Chrome trace of the PyTorch profiler): its ``kernel`` name, ``us``
    and the innermost CPU op open on its launching thread when it was launched (``op``, ``dims``, ``strides``,
    ``dtypes`` from the op's recorded inputs; op "(no op)" where none was open or the launch is not in the trace).

    Example, on a hand-made trace (an mm that launches one kernel inside a matmul):

        >>> ev = lambda name, cat, ts, dur, tid=1, **args: dict(name=name, cat=cat, ph="X", ts=ts, dur=dur, pid=1,
        ...                                                     tid=tid, args=args)
        >>> trace = {"traceEvents": [ev("aten::matmul", "cpu_op", 0, 100),
        ...     ev("aten::mm", "cpu_op", 10, 50, **{"Input Dims": [[4, 8], [8, 2]], "Input Strides": [[8, 1], [1, 8]],
        ...                                          "Input type": ["float", "float"]}),
        ...     ev("cudaLaunchKernel", "cuda_runtime", 20, 5, correlation=7),
        ...     ev("gemm_kernel", "kernel", 30, 12, tid=9, correlation=7)]}
        >>> [(k["op"], k["kernel"], k["us"], k["dims"]) for k in kernels_by_op(trace)]
        [('aten::mm', 'gemm_kernel', 12.0, [[4, 8], [8, 2]])]
    """
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    ops: dict[tuple, list[dict]] = defaultdict(list)
    launches: dict[int, dict] = {}
    for e in events:
        if e.get("cat") == "cpu_op":
            ops[(e.get("pid"), e.get("tid"))].append(e)
        elif e.get("cat") in LAUNCH_CATS and (e.get("args") or {}).get("correlation") is not None:
            launches[e["args"]["correlation"]] = e
    starts = {}
    for key, lst in ops.items():
        lst.sort(key=lambda e: e["ts"])
        starts[key] = [e["ts"] for e in lst]
    out = []
    for e in events:
        if e.get("cat") not in DEVICE_CATS:
            continue
        launch = launches.get((e.get("args") or {}).get("correlation"))
        op = _innermost(ops, starts, launch) if launch is not None else None
        args = (op or {}).get("args") or {}
        out.append(dict(kernel=e["name"], us=float(e.get("dur", 0.0)), op=op["name"] if op else "(no op)",
                        dims=args.get("Input Dims"), strides=args.get("Input Strides"), dtypes=args.get("Input type")))
    return out


def _innermost(ops: dict, starts: dict, launch: dict) -> Optional[dict]:
    """The latest-starting CPU op on the launch's thread that contains its start: with nested ops, the innermost."""
    key = (launch.get("pid"), launch.get("tid"))
    lst = ops.get(key, [])
    t = launch["ts"]
    for i in range(bisect.bisect_right(starts.get(key, []), t) - 1, -1, -1):
        if lst[i]["ts"] + lst[i].get("dur", 0) >= t:
            return lst[i]
    return None


def gemm_gflop(op: str, dims: Optional[list]) -> Optional[float]:
    """GFLOP of one call of GEMM op `op` with recorded input `dims` (2 M N K), or None for anything else.

        >>> gemm_gflop("aten::addmm", [[1024], [65536, 3456], [3456, 1024], [], []])
        463.856467968
    """
    if op not in GEMM_OPS or not dims:
        return None
    ia, ib, _ = GEMM_OPS[op]
    if len(dims) <= ib or len(dims[ia]) != 2 or len(dims[ib]) != 2:
        return None
    (m, k), (_, n) = dims[ia], dims[ib]
    return 2.0 * m * n * k / 1e9


def aggregate(kernels: list[dict], steps: int) -> list[dict]:
    """`kernels_by_op`'s events over `steps` steps added up by (op, kernel, dims, strides, dtypes), longest first."""
    groups: dict[tuple, list[float]] = defaultdict(list)
    for k in kernels:
        key = (k["op"], k["kernel"], json.dumps(k["dims"]), json.dumps(k["strides"]), json.dumps(k["dtypes"]))
        groups[key].append(k["us"])
    rows = []
    for (op, kernel, dims, strides, dtypes), us in groups.items():
        calls = len(us) / steps
        row = dict(op=op, kernel=kernel, dims=dims, strides=strides, dtypes=dtypes, calls_per_step=calls,
                   ms_per_step=sum(us) / 1e3 / steps, ms_per_call=sum(us) / 1e3 / len(us))
        gflop = gemm_gflop(op, json.loads(dims))
        if gflop is not None:
            row.update(gflop=gflop, tflops=gflop / row["ms_per_call"])
        rows.append(row)
    rows.sort(key=lambda r: -r["ms_per_step"])
    return rows


def gemm_rows(rows: list[dict]) -> list[dict]:
    """`aggregate`'s GEMM rows merged per op call (op, dims, strides, dtypes): a call's kernels (cuBLASLt's split-K
    GEMM and its reduction kernel, a memset, an elementwise kernel the op launches itself) joined by " + ", its ms a
    call the sum, longest first.

        >>> r = dict(op="aten::mm", dims="[[8, 4], [4, 2]]", strides="[]", dtypes="[]", gflop=6.4e-08)
        >>> [(g["kernel"], g["ms_per_call"]) for g in gemm_rows([dict(r, kernel="splitK", calls_per_step=2,
        ...     ms_per_step=0.4), dict(r, kernel="reduce", calls_per_step=2, ms_per_step=0.1)])]
        [('splitK + reduce', 0.25)]
    """
    merged: dict[tuple, dict] = {}
    for r in rows:
        if not r.get("gflop"):
            continue
        key = (r["op"], r["dims"], r["strides"], r["dtypes"])
        if key not in merged:
            merged[key] = dict(r)
        else:
            m = merged[key]
            m["kernel"] += " + " + r["kernel"]
            m["ms_per_step"] += r["ms_per_step"]
            m["calls_per_step"] = max(m["calls_per_step"], r["calls_per_step"])
    out = list(merged.values())
    for m in out:
        m["ms_per_call"] = m["ms_per_step"] / m["calls_per_step"]
        m["tflops"] = m["gflop"] / m["ms_per_call"]
    return sorted(out, key=lambda m: -m["ms_per_step"])


def _tensor(dims, strides, dtype, device) -> torch.Tensor:
    t = torch.empty_strided(dims, strides, dtype=dtype, device=device)
    return t.normal_() if dtype.is_floating_point else t.zero_()


def time_gemm_alone(op: str, dims: list, strides: Optional[list], dtypes: list, device: torch.device,
                    repeats: int = 20, windows: int = 5) -> tuple[Optional[float], str]:
    """``(median ms of one call, "ok")`` of GEMM `op` on fresh tensors with the recorded shapes, strides (contiguous
    where none were recorded) and dtypes, or ``(None, why not)`` where the inputs cannot be rebuilt or the call
    fails."""
    ia, ib, ic = GEMM_OPS[op]
    try:
        def make(i):
            s = strides[i] if strides and i < len(strides) and len(strides[i]) == len(dims[i]) else None
            if s is None:
                s = torch.empty(dims[i], device="meta").stride()
            return _tensor(dims[i], s, DTYPES[dtypes[i]], device)
        a, b = make(ia), make(ib)
        c = make(ic) if ic is not None else None
        # an out= tensor (Inductor's extern_kernels.mm(a, b, out=buf)): its layout is the GEMM's C layout
        mn = [dims[ia][0], dims[ib][1]]
        o = next((make(i) for i in range(ib + 1, len(dims)) if dims[i] == mn and op != "aten::addmm_"), None)
        kw = {} if o is None else {"out": o}
        call = {"aten::mm": lambda: torch.mm(a, b, **kw), "aten::addmm": lambda: torch.addmm(c, a, b, **kw),
                "aten::addmm_": lambda: c.addmm_(a, b),
                "aten::_addmm_activation": lambda: torch._addmm_activation(c, a, b, **kw)}[op]
        for _ in range(3):
            call()
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
        return None, f"not rebuilt: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
    times = []
    for _ in range(windows):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / repeats)
    return statistics.median(times), "ok"


def profile_ops(cfg, variant: str, batch_size: int, steps: int, warmup: int, device: torch.device) -> list[dict]:
    """`aggregate` of `steps` profiled steps of `variant` (its whole-step graph off) on synthetic batches."""
    from torch.profiler import ProfilerActivity, profile

    cfg = variant_config(cfg, variant)
    cfg.train.cuda_graph = False  # a replayed graph's kernels have no launching op
    # nor have those of torch.compile's own CUDA graphs ("auto" picks reduce-overhead without the step graph)
    modes = {"auto": "default", "reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}
    if cfg.train.compile.enabled:
        cfg.train.compile.mode = modes.get(cfg.train.compile.mode, cfg.train.compile.mode)
    cfg.data.batch_size = batch_size
    validate(cfg)
    torch.manual_seed(0)
    batches = synthetic_batches(8, batch_size, device, multi_hot_sizes=cfg.model.multi_hot_sizes)
    run = build_run(cfg, tables_from_config(cfg), device, total_steps=warmup + steps)
    train_steps(run, batches, warmup)
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        train_steps(run, batches, steps, start=warmup)
        torch.cuda.synchronize(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    del run
    torch.cuda.empty_cache()
    return aggregate(kernels_by_op(trace), steps)


def plot(gemms: list[dict], env: dict, path: Path, title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 0.4 * len(gemms) + 1.8))
    labels = [f"{r['op'].replace('aten::', '')} {r['dims']}"[:70] for r in gemms][::-1]
    y = range(len(labels))
    ax.barh([i + 0.2 for i in y], [r["ms_per_call"] for r in gemms][::-1], height=0.4, label="in the step")
    ax.barh([i - 0.2 for i in y], [r.get("alone_ms_per_call") or 0 for r in gemms][::-1], height=0.4, label="alone")
    ax.set_yticks(list(y))
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_xlabel("ms per call")
    ax.legend()
    ax.set_title(f"{title}\n{env['device']}, torch {env['torch']}, {env['date']}", fontsize=9)
    save_figure(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/mlperf-dcnv2.json")
    ap.add_argument("--variant", default="auto")
    ap.add_argument("--batch-size", type=int, default=65536)
    ap.add_argument("--max-rows", type=int, default=None, help="cap every table at this many rows")
    ap.add_argument("--steps", type=int, default=3, help="steps profiled")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation)")
    ap.add_argument("--repeats", type=int, default=20, help="calls a timing window of a GEMM alone")
    ap.add_argument("--top", type=int, default=40, help="rows of the table of every kernel by op")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="step_ops")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    outputs = claim_outputs(ap, args, args.out, [f"{args.name}.md", f"{args.name}.csv", f"{args.name}.png"])
    # the options and the config first: one argparse line for a bad one, before the CUDA check (it was a traceback,
    # and only on a GPU)
    positive_or_error(ap, steps=args.steps, repeats=args.repeats, top=args.top)
    # --max-rows: else the config's own cap
    cfg = run_config_or_error(ap, args.config, {"data.batch_size": args.batch_size,
                                                "data.max_rows_per_table": args.max_rows}, args.variant)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device (the profile is of device kernels)")
    device = torch.device("cuda")
    env = environment(device)
    rows = profile_ops(cfg, args.variant, args.batch_size, args.steps, args.warmup, device)
    gemms = gemm_rows(rows)
    for r in gemms:
        ms, r["alone_status"] = time_gemm_alone(r["op"], json.loads(r["dims"]), json.loads(r["strides"]),
                                                json.loads(r["dtypes"]), device, args.repeats)
        if ms is not None:
            r.update(alone_ms_per_call=ms, alone_tflops=r["gflop"] / ms)
    total = sum(r["ms_per_step"] for r in rows)
    gemm_total = sum(r["ms_per_step"] for r in gemms)
    alone_total = sum(r["alone_ms_per_call"] * r["calls_per_step"] for r in gemms if r.get("alone_ms_per_call"))
    title = (f"{Path(args.config).name}, {args.variant} without the step's CUDA graph, batch {args.batch_size}: "
             "kernels by op")
    note = (f"{args.steps} steps profiled after {args.warmup} warm-up steps, synthetic uniform batches. Kernels "
            f"{total:.3f} ms a step, of which GEMM ops {gemm_total:.3f} ms; the same GEMMs alone (median of windows of "
            f"{args.repeats} calls on fresh tensors of the recorded shapes and strides) {alone_total:.3f} ms. Alone, "
            "the calls run back to back on normal random operands: a GPU held at its power cap runs them at a lower "
            "clock than the step's mix of kernels gets.")
    fmt = lambda v, f: "" if v is None else format(v, f)  # noqa: E731
    g_lines = ["| op | input dims | input strides | kernels | calls a step | in step ms a call | TFLOP/s "
               "| alone ms a call | TFLOP/s |", "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    g_lines += [md_row([r["op"], r["dims"], r["strides"], r["kernel"][:120].replace("|", "\\|"),
                        fmt(r["calls_per_step"], "g"),
                        fmt(r["ms_per_call"], ".3f"), fmt(r["tflops"], ".0f"), fmt(r.get("alone_ms_per_call"), ".3f"),
                        fmt(r.get("alone_tflops"), ".0f")]) for r in gemms]
    a_lines = ["", f"Every kernel by launching op (the {args.top} longest):", "",
               "| op | input dims | kernel | calls a step | ms a step |", "| --- | --- | --- | ---: | ---: |"]
    a_lines += [md_row([r["op"], r["dims"] if r["dims"] != "null" else "", r["kernel"][:70].replace("|", "\\|"),
                        fmt(r["calls_per_step"], "g"), fmt(r["ms_per_step"], ".3f")]) for r in rows[: args.top]]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(title, [env_line(env), note], g_lines + a_lines)
    (out / f"{args.name}.md").write_text(text)
    # the GEMM ops (one row a call, its kernels merged, timed alone), then every other op's kernels
    write_csv(out / f"{args.name}.csv", gemms + [r for r in rows if not r.get("gflop")], KEYS,
              {**env, "variant": args.variant, "batch_size": args.batch_size})
    plot(gemms, env, out / f"{args.name}.png", title)
    print(text, end="")
    outputs.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
