"""The pooled (multi-hot) Triton embedding at MLPerf DLRM-DCNv2's shapes: lookup and fused row-wise Adagrad.

    python benchmarks/pooled_embedding.py --out benchmarks/results/pooled_embedding
    python benchmarks/pooled_embedding.py --rows-cap 1000000 --out /tmp/pe   # smaller tables
    python benchmarks/pooled_embedding.py --smoke --out /tmp/pe              # tiny (CPU: Triton interpreter)

Tables and hotness of ``configs/mlperf-dcnv2.json``: 26 features, 214 lookups a sample, D = 128, all
tables in one weight (204M rows: 52 GB in bf16; ``--rows-cap`` caps every table). fp32 tables of that
size (104 GB) do not fit an 80 GB GPU: they are capped at ``--fp32-rows-cap`` rows per table (20M by
default, 104M rows, 53 GB). Raw values are drawn uniformly from [-1, 2**32) (every lookup a cold row),
batch 65536 and 16384. Modes and implementations (`kernels.embedding.pooled`):

* ``fwd``, ``triton``: ``pooled_embedding_lookup`` (hashing + sum pooling, one launch);
* ``bwd``, ``triton``: ``pooled_embedding_sparse_update_`` with ``rowwise_adagrad`` (the fused backward:
  rows sorted, each touched row's summed gradient and one step; bf16 tables stochastically rounded);
* ``fwd+bwd``, ``triton``: ``fused_pooled_embedding`` forward and its backward (the training path);
* ``fwd``, ``torch-bag``: the reference, ``F.embedding_bag(mode="sum")`` on the same weight, hashing in
  torch (``(raw + 1) % card + offset`` per slot) as issue #22's plain PyTorch baseline does;
  ``torch-bag-rows``: the bag alone, on rows hashed beforehand.

Timing: on CUDA the calls are captured in a CUDA graph (n calls per graph, ~20 ms of work, after warm-up
calls on a side stream) and the graph replayed in ``--windows`` windows (CUDA events): device time
without launch cost; the median window's ms per call is reported. On the CPU (``--smoke``) perf_counter
times plain calls (the Triton interpreter: logic, not speed).

Effective bandwidth = the bytes that must move / time, as % of the ``copy_`` bandwidth measured in the
same run (1 GiB, bytes read + written). Per sample, forward: 214 rows of D read + 26 pooled rows of D
written (the table's dtype; the int64 ids are not counted); backward: the [26, D] output gradient read,
and each *distinct* row the batch touched read and written once with its fp32 row-wise state (counted
with ``torch.unique`` of the batch's rows, outside the timing). Issue #22's targets: forward >= 70%,
fused backward >= 40% of copy bandwidth.
Writes pooled_embedding.csv / .md / .png under ``--out`` (GPU name, versions, date).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import traceback
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F_

if not torch.cuda.is_available():  # the Triton kernels run under the interpreter on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

# _common (which puts the repository first on sys.path), also when loaded by path (tests);
# appended: benchmarks/kernels.py must not shadow the kernels package
sys.path.append(str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    add_overwrite,
    claim_outputs,
    config_or_error, env_line, environment, graph_replay_windows, int_list, markdown, md_row, pyplot, save_figure,
    wall_windows, write_csv,
)

from dlrm.config import load_config  # noqa: E402,F401 - the tests' name
from kernels.embedding import (  # noqa: E402
    fused_pooled_embedding,
    pooled_embedding_lookup,
    pooled_embedding_sparse_update_,
    pooled_hash_rows,
    pooled_layout,
)
import kernels.embedding.pooled as pooled  # noqa: E402
from kernels.table_layout import layout_tensors  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "mlperf-dcnv2.json"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MODES = ("fwd", "bwd", "fwd+bwd")
IMPLS = ("triton", "torch-bag", "torch-bag-rows")
TARGETS = {"fwd": 0.70, "bwd": 0.40}  # fraction of copy bandwidth (issue #22)
OPTIMIZER = "rowwise_adagrad"
LR, EPS = 0.005, 1e-8
STATE_BYTES = 4  # fp32 row-wise Adagrad state per row
HEADROOM = 6 * 2**30  # bytes left free next to the table (inputs, outputs, the update's sort buffers)
KEYS = ["impl", "mode", "dtype", "batch", "table_rows", "lookups", "unique_rows", "ms", "min_ms", "max_ms", "bytes",
        "gbps", "pct_of_copy", "target_pct", "meets_target", "steps_per_window", "status"]


# ---- timing -----------------------------------------------------------------------------------------


def copy_bandwidth(device: torch.device, nbytes: int, windows: int) -> float:
    """GB/s of ``dst.copy_(src)`` (bytes read + written / time), the median of `windows`.

    On CUDA: 20 plain back-to-back launches per window between CUDA events, not a graph replay. A CUDA graph of
    1 GiB copies ran at 2,430 GB/s on the H100 where the same copies launched one by one (and graphs of 256 MiB
    copies) ran at 3,000 (results/copy_bandwidth.md); until 2026-11-24 this function replayed a graph, so the
    percentages it gave were 23% too high."""
    src = torch.empty(nbytes // 4, device=device, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    if device.type != "cuda":
        times, _ = wall_windows(lambda: dst.copy_(src), 3, windows, 2)
        return 2 * nbytes / (statistics.median(times) / 1e3) / 1e9
    return 2 * nbytes / (event_loop_ms(lambda: dst.copy_(src), 20, windows) / 1e3) / 1e9


def event_loop_ms(fn: Callable[[], None], n: int, windows: int) -> float:
    """Median over `windows` of the ms per call of `n` plain back-to-back launches between CUDA events."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(windows):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / n)
    return statistics.median(times)


# ---- the cases --------------------------------------------------------------------------------------


class Tables:
    """The concatenated ``[R, D]`` weight of one dtype, its row-wise state and the layout tensors."""

    def __init__(self, cards: list[int], hotness: list[int], dim: int, dtype: torch.dtype, device: torch.device):
        self.cards_list, self.hotness, self.dim, self.dtype = cards, hotness, dim, dtype
        self.rows = sum(cards)
        self.cards, self.offsets = layout_tensors(cards, device)
        self.layout = pooled_layout(hotness, device)
        self.weight = torch.empty(self.rows, dim, dtype=dtype, device=device).uniform_(-0.05, 0.05)
        self.state = torch.zeros(self.rows, dtype=torch.float32, device=device)
        self.lr = torch.full((1,), LR, dtype=torch.float32, device=device)
        self.sr_seed = torch.zeros(1, dtype=torch.int64, device=device)
        self.trigger = torch.zeros(0, device=device, requires_grad=True)
        self.slot_card = self.cards[self.layout.slot_feature]
        self.slot_off = self.offsets[self.layout.slot_feature]

    @staticmethod
    def nbytes(cards: list[int], dim: int, dtype: torch.dtype) -> int:
        rows = sum(cards)
        return rows * dim * torch.empty((), dtype=dtype).element_size() + rows * STATE_BYTES


class Inputs:
    """One batch: raw values, the rows they hash to, the output gradient, the bag offsets, distinct rows."""

    def __init__(self, t: Tables, batch: int, device: torch.device, seed: int = 0):
        g = torch.Generator(device=device).manual_seed(seed)
        L, F = t.layout.num_slots, len(t.hotness)
        self.raw = torch.randint(-1, 2**32, (batch, L), generator=g, device=device)
        self.rows = pooled_hash_rows(self.raw, t.cards, t.offsets, t.layout, t.rows)
        self.grad = (torch.randn(batch, F, t.dim, generator=g, device=device) * 1e-3).to(t.dtype)
        self.bag_offsets = ((torch.arange(batch, device=device) * L).unsqueeze(1) + t.layout.slot_offsets).reshape(-1)
        self.flat_rows = self.rows.reshape(-1)
        self.unique = int(torch.unique(self.rows).numel())


def case_bytes(mode: str, t: Tables, batch: int, unique: int) -> int:
    """The bytes the op must move (see the module docstring)."""
    e = t.weight.element_size()
    L, F, D = t.layout.num_slots, len(t.hotness), t.dim
    fwd = batch * (L * D * e + F * D * e)
    bwd = batch * F * D * e + unique * (2 * D * e + 2 * STATE_BYTES)
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def make_step(impl: str, mode: str, t: Tables, x: Inputs) -> Callable[[], None]:
    if impl == "torch-bag":
        def step():
            rows = torch.remainder(x.raw + 1, t.slot_card) + t.slot_off
            F_.embedding_bag(rows.reshape(-1), t.weight, x.bag_offsets, mode="sum")
        return step
    if impl == "torch-bag-rows":
        return lambda: F_.embedding_bag(x.flat_rows, t.weight, x.bag_offsets, mode="sum")
    if mode == "fwd":
        return lambda: pooled_embedding_lookup(x.raw, t.weight, t.cards, t.offsets, t.layout)
    if mode == "bwd":
        return lambda: pooled_embedding_sparse_update_(x.rows, x.grad, t.layout, t.weight, t.state, t.lr, OPTIMIZER,
                                                       EPS, True, 0.0, t.sr_seed, True)

    def step():  # the training path: the fused op's forward, then its backward (the update)
        out = fused_pooled_embedding(x.raw, t.weight, t.cards, t.offsets, t.layout, None, None, t.state, t.lr,
                                     OPTIMIZER, EPS, True, t.trigger, 0.0, t.sr_seed, True)
        out.backward(x.grad)

    return step


def measure(impl: str, mode: str, dtype: str, t: Tables, x: Inputs, batch: int, copy_gbps: float,
            device: torch.device, args) -> dict:
    target = TARGETS.get(mode)  # fwd+bwd has none
    row = {"impl": impl, "mode": mode, "dtype": dtype, "batch": batch, "table_rows": t.rows,
           "lookups": batch * t.layout.num_slots, "unique_rows": x.unique,
           "target_pct": 100 * target if target else None}
    try:
        step = make_step(impl, mode, t, x)
        with torch.no_grad() if mode == "fwd" or mode == "bwd" else torch.enable_grad():
            timer = graph_replay_windows if device.type == "cuda" else wall_windows
            times, steps = timer(step, args.steps, args.windows, args.warmup)
        ms = statistics.median(times)
        nbytes = case_bytes(mode, t, batch, x.unique)
        gbps = nbytes / (ms / 1e3) / 1e9
        pct = 100 * gbps / copy_gbps
        row.update(ms=ms, min_ms=min(times), max_ms=max(times), bytes=nbytes, gbps=gbps, pct_of_copy=pct,
                   steps_per_window=steps, status="ok",
                   meets_target=(pct >= row["target_pct"]) if impl == "triton" and target else None)
    except Exception as e:  # noqa: BLE001 -- one failing case must not hide the others' numbers
        traceback.print_exc()
        msg = str(e).splitlines()[0][:160] if str(e) else ""
        row["status"] = f"{'oom' if isinstance(e, torch.OutOfMemoryError) else 'failed'}: {type(e).__name__}: {msg}"
    finally:
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    return row


def cases(modes: list[str], impls: list[str]) -> list[tuple[str, str]]:
    """(impl, mode) pairs: triton in every mode, the torch references forward only."""
    return [(i, m) for m in modes for i in impls if i == "triton" or m == "fwd"]


# ---- results ----------------------------------------------------------------------------------------


def fmt(v, spec: str) -> str:
    return format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else "n/a"


def rate(v) -> str:
    return "n/a" if not isinstance(v, (int, float)) else f"{v:,.0f}" if v >= 10 else f"{v:.2f}"


def markdown_table(rows: list[dict]) -> list[str]:
    lines = ["| impl | mode | dtype | batch | table rows | distinct rows | ms (median) | GB/s | % of copy | target "
             "| status |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        target = ""
        if r.get("target_pct") and r.get("meets_target") is not None:
            target = f">= {r['target_pct']:.0f}%: " + ("**met**" if r["meets_target"] else "missed")
        lines.append(md_row([r["impl"], r["mode"], r["dtype"], r["batch"], fmt(r.get("table_rows"), ",d"),
                             fmt(r.get("unique_rows"), ",d"), fmt(r.get("ms"), ".3f"), rate(r.get("gbps")),
                             fmt(r.get("pct_of_copy"), ".0f") + ("%" if r.get("pct_of_copy") else ""), target,
                             r["status"].replace("|", "\\|")]))
    return lines


def plot(rows: list[dict], env: dict, path: Path, title: str) -> None:
    """Grouped bars of % of copy bandwidth, one group per (mode, dtype, batch); the targets as lines."""
    plt = pyplot()
    groups = list(dict.fromkeys((r["mode"], r["dtype"], r["batch"]) for r in rows))
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(groups) + 2), 4.5))
    width = 0.8 / max(1, len(impls))
    for k, impl in enumerate(impls):
        pct = {(r["mode"], r["dtype"], r["batch"]): r.get("pct_of_copy") for r in rows if r["impl"] == impl}
        ax.bar([i + k * width for i in range(len(groups))], [pct.get(gk) or 0.0 for gk in groups], width, label=impl)
    for mode, frac in TARGETS.items():
        ax.axhline(100 * frac, linestyle="--", color="green" if mode == "fwd" else "orange",
                   label=f"{mode} target {100 * frac:.0f}%")
    ax.set_xticks([i + width * (len(impls) - 1) / 2 for i in range(len(groups))])
    ax.set_xticklabels([f"{m} {d}\nB={b}" for m, d, b in groups], fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("effective bandwidth, % of copy_")
    ax.set_title(f"{title}\n{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def write_results(rows: list[dict], env: dict, out: Path, title: str, paragraphs: list[str]) -> str:
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "pooled_embedding.csv", rows, KEYS, env)
    text = markdown(title, [env_line(env), *paragraphs], markdown_table(rows))
    (out / "pooled_embedding.md").write_text(text)
    plot(rows, env, out / "pooled_embedding.png", title)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder (pooled_embedding.csv, .md, .png)")
    ap.add_argument("--config", default=str(CONFIG), help="cardinalities, multi_hot_sizes and embedding_dim")
    ap.add_argument("--batch-sizes", default="65536,16384")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--impls", default=",".join(IMPLS), help="triton and the torch references (forward only)")
    ap.add_argument("--rows-cap", type=int, default=None, help="cap every table at this many rows")
    ap.add_argument("--fp32-rows-cap", type=int, default=20_000_000,
                    help="per-table cap of the fp32 tables (full size is 104 GB; 0: none)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls before capture (compilation)")
    ap.add_argument("--steps", type=int, default=0, help="calls per timed window (0: ~20 ms of work)")
    ap.add_argument("--windows", type=int, default=7, help="timed windows; the median is reported")
    ap.add_argument("--smoke", action="store_true",
                    help="tables capped at 1000 rows, batch 2, 1 call per window (CPU: 1 window, no warm-up)")
    ap.add_argument("--lookup-launches", default="",
                    help="also time the triton fwd at these launches: comma list of SAMPLESxWARPS[xUNROLL[xMAXNREG]] "
                         "(unroll 1 if left out; MAXNREG a register cap, 24-255), forced "
                         "through kernels.embedding.pooled.POOLED_LOOKUP_OVERRIDE (rows 'triton SxWxU')")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    outputs = claim_outputs(ap, args, args.out, ["pooled_embedding.csv", "pooled_embedding.md", "pooled_embedding.png"])
    try:
        launches = [tuple(int(v) for v in item.split("x")) for item in args.lookup_launches.split(",") if item.strip()]
        launches = [(*lw, 1) if len(lw) == 2 else lw for lw in launches]
        if any(len(lw) not in (3, 4) or lw[0] < 1 or lw[0] & (lw[0] - 1) or lw[1] not in (1, 2, 4, 8, 16)
               or lw[2] not in (1, 2, 4) or (len(lw) == 4 and not 24 <= lw[3] <= 255) for lw in launches):
            raise ValueError
    except ValueError:
        ap.error(f"--lookup-launches: {args.lookup_launches!r} is not a comma list of SAMPLESxWARPS[xUNROLL[xMAXNREG]] "
                 "(samples a power of two, warps 1-16, unroll 1, 2 or 4, maxnreg 24-255)")

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    if args.smoke:
        args.rows_cap = args.rows_cap or 1000
        if args.batch_sizes == ap.get_default("batch_sizes"):
            args.batch_sizes = "2"  # 428 MLPerf slots: repeated rows in the tiny tables
        cuda = device.type == "cuda"  # the interpreter compiles nothing: no warm-up, one window
        args.warmup, args.steps, args.windows = int(cuda), args.steps or 1, 2 if cuda else 1
    modes, impls, dtypes = args.modes.split(","), args.impls.split(","), args.dtypes.split(",")
    for name, given, allowed in (("mode", modes, MODES), ("impl", impls, IMPLS), ("dtype", dtypes, DTYPES)):
        for v in given:
            if v not in allowed:
                ap.error(f"unknown {name} {v!r} (choose from {', '.join(allowed)})")
    # parsed before the copy bandwidth is measured and the (empty) results files are written: bad input must not
    # replace an earlier run's files with an empty table and then crash with a traceback
    batches = int_list(ap, "--batch-sizes", args.batch_sizes)
    cfg = config_or_error(ap, args.config)
    m = cfg.model
    if not m.multi_hot_sizes or not m.cardinalities:
        ap.error(f"{args.config}: needs model.cardinalities and model.multi_hot_sizes")

    env = environment(device)
    copy_bytes = 2**30 if device.type == "cuda" else 2**24
    copy_gbps = copy_bandwidth(device, copy_bytes, args.windows)
    print(f"copy bandwidth: {copy_gbps:,.1f} GB/s ({copy_bytes / 2**20:.0f} MiB copy_)", flush=True)
    title = "Pooled Triton embedding at MLPerf DLRM-DCNv2 shapes: lookup and fused row-wise Adagrad" + (
        " (smoke)" if args.smoke else "")
    timing = "CUDA-graph replay, device time" if device.type == "cuda" else "CPU wall time (Triton interpreter)"
    paragraphs = [
        f"{Path(args.config).name}: {len(m.cardinalities)} features, {sum(m.multi_hot_sizes)} lookups a sample, "
        f"D = {m.embedding_dim}; raw values uniform (cold rows). {timing}; median of {args.windows} windows. "
        f"bwd: {OPTIMIZER} (deterministic; bf16 tables stochastically rounded), fp32 state.",
        f"- **copy bandwidth**: {copy_gbps:,.0f} GB/s (`dst.copy_(src)`, {copy_bytes / 2**20:.0f} MiB, bytes read + "
        "written / time)\n- bytes that must move, per sample: fwd 214 rows x D read + 26 x D written; bwd the 26 x D "
        "gradient read + each distinct touched row and its fp32 state read and written (distinct rows per batch "
        "in the table); fwd+bwd their sum\n- targets (issue #22): fwd >= 70%, fused bwd >= 40% of copy bandwidth",
    ]
    rows: list[dict] = []
    out = Path(args.out)
    text = write_results(rows, env, out, title, paragraphs)
    for dtype in dtypes:
        cap = args.rows_cap
        if dtype == "fp32" and args.fp32_rows_cap:
            cap = min(cap, args.fp32_rows_cap) if cap else args.fp32_rows_cap
        cards = [min(c, cap) if cap else c for c in m.cardinalities]
        need = Tables.nbytes(cards, m.embedding_dim, DTYPES[dtype])
        t = None
        skip: Optional[str] = None
        if device.type == "cuda" and need + HEADROOM > torch.cuda.mem_get_info(device)[0]:
            skip = (f"skipped: {dtype} tables of {sum(cards):,} rows need {need / 2**30:.1f} GiB + headroom, "
                    f"{torch.cuda.mem_get_info(device)[0] / 2**30:.1f} GiB free (--rows-cap)")
        else:
            try:
                t = Tables(cards, m.multi_hot_sizes, m.embedding_dim, DTYPES[dtype], device)
            except torch.OutOfMemoryError as e:
                skip = f"oom: allocating the {dtype} tables: {str(e).splitlines()[0][:120]}"
        for batch in batches:
            x = None
            if t is not None:
                try:
                    x = Inputs(t, batch, device)
                except torch.OutOfMemoryError as e:
                    skip = f"oom: the batch's inputs: {str(e).splitlines()[0][:120]}"
            for impl, mode in cases(modes, impls):
                if x is None:
                    r = {"impl": impl, "mode": mode, "dtype": dtype, "batch": batch, "table_rows": sum(cards),
                         "status": skip}
                else:
                    r = measure(impl, mode, dtype, t, x, batch, copy_gbps, device, args)
                extra = []
                if x is not None and impl == "triton" and mode == "fwd":
                    for launch in launches:
                        pooled.POOLED_LOOKUP_OVERRIDE = launch
                        try:
                            extra.append({**measure(impl, mode, dtype, t, x, batch, copy_gbps, device, args),
                                          "impl": "triton " + "x".join(map(str, launch)), "meets_target": None})
                        finally:
                            pooled.POOLED_LOOKUP_OVERRIDE = None
                for r in (r, *extra):
                    rows.append(r)
                    print(f"{r['impl']:>15} {mode:>7} {dtype} B={batch:>6}: "
                          + (f"{r['ms']:.3f} ms, {r['gbps']:,.0f} GB/s ({r['pct_of_copy']:.0f}% of copy)"
                             if r.get("ms") else r["status"]), flush=True)
                # rewritten after every case: a run cut short keeps what it measured
                text = write_results(rows, env, out, title, paragraphs)
            del x
            gc.collect()
        del t
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(text, end="")
    outputs.report()
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
