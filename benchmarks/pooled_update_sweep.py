"""The pooled embedding's fused backward at MLPerf DLRM-DCNv2 shapes, over launch configs and bf16 rounding.

    python benchmarks/pooled_update_sweep.py --out benchmarks/results --name pooled_update_sweep_run
    python benchmarks/pooled_update_sweep.py --smoke --out /tmp/sweep      # tiny tables (CPU: Triton interpreter)

For each table dtype (bf16 at full size, fp32 capped at ``--fp32-rows-cap`` rows a table) and each
(rounding, launch) pair of `PLAN`, times ``pooled_embedding_sparse_update_`` (row-wise Adagrad) on one batch
of 65536 uniform raw values (every lookup a cold row) with `_common.graph_replay_windows` (CUDA-graph
replay, median of the windows), and reports ms and % of copy bandwidth as `pooled_embedding.py` counts
the bytes. Rounding: "hash" / "hash1" / "hash1hi" / "philox" stochastic rounding (`kernels.embedding.update.SR_RNG`), "nearest";
row loads: when the chunk kernel loads the updated rows (`kernels.embedding.update.ROW_LOADS`, ``--row-loads``);
eviction: the L2 eviction priorities of its row and gradient traffic (`kernels.embedding.update.EVICTION`,
``--evictions``); carry chunks: the chunk boundaries a program of the carry kernel takes
(`kernels.embedding.update.CARRY_CHUNKS`, ``--carry-chunks``); picks: how the chunk kernel writes its first/last
partial sums (`kernels.embedding.update.PARTIAL_PICK`, ``--picks``); maxnreg: the chunk kernel's register cap
(`kernels.embedding.update.CHUNK_MAXNREG`, ``--maxnregs``);
launch: a `kernels.heuristics.SparseUpdateConfig` (chunk, carry_block, chunk_warps, carry_warps[, carry_chunks]) forced
through ``SPARSE_UPDATE_OVERRIDE``, or None for what `sparse_update_config` picks. This is how the
``multi_hot_wide_rows`` launch and the hash generator were chosen (`results/pooled_update_sweep.md`).
Writes ``<name>.csv`` / ``.md`` / ``.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the Triton kernels run under the interpreter on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.append(str(Path(__file__).resolve().parent))

import pooled_embedding as pe  # noqa: E402
from _common import (  # noqa: E402
    add_overwrite,
    claim_outputs,
    config_or_error, env_line, environment, graph_replay_windows, markdown, md_row, pyplot, save_figure,
    wall_windows, write_csv,
)

from dlrm.config import load_config  # noqa: E402,F401 - the tests' name
from kernels import heuristics  # noqa: E402
from kernels.embedding import update  # noqa: E402

# (dtype, rounding, launch); bf16 rows only for bf16 tables
PLAN = ([("bf16", r, c) for r in ("hash",) for c in (None, (64, 32, 4, 1), (32, 16, 4, 1), (16, 16, 1, 1), (16, 8, 1, 1))]
        + [("bf16", r, c) for r in ("hash1", "hash1hi", "nearest") for c in ((16, 16, 2, 1), (32, 16, 4, 1))]
        + [("bf16", "hash1hi", c) for c in ((16, 16, 4, 1), (32, 16, 2, 1), (32, 32, 4, 1), (32, 16, 8, 1), (32, 16, 4, 2))]
        + [("bf16", "philox", (16, 16, 2, 1))]
        + [("fp32", "-", c) for c in (None, (32, 16, 4, 4), (16, 16, 1, 1), (32, 16, 2, 1))])
KEYS = ["dtype", "rounding", "launch", "row_loads", "eviction", "carry_chunks", "pick", "maxnreg", "batch", "unique_rows",
        "ms", "gbps", "pct_of_copy", "status"]


def run_plan(dtype: str, plan: list, cards: list[int], m, batch: int, device: torch.device, copy_gbps: float,
             args) -> list[dict]:
    t = pe.Tables(cards, m.multi_hot_sizes, m.embedding_dim, pe.DTYPES[dtype], device)
    x = pe.Inputs(t, batch, device)
    nbytes = pe.case_bytes("bwd", t, batch, x.unique)
    rows = []
    shipped_rng, shipped_loads, shipped_evict, shipped_carry, shipped_pick = (
        update.SR_RNG, update.ROW_LOADS, update.EVICTION, update.CARRY_CHUNKS, update.PARTIAL_PICK)
    for _, rounding, launch, (row_loads, eviction, carry_chunks, pick, maxnreg) in plan:
        heuristics.SPARSE_UPDATE_OVERRIDE = launch
        update.SR_RNG = rounding if rounding in update.RNG_CODES else shipped_rng
        update.ROW_LOADS, update.EVICTION, update.CARRY_CHUNKS = row_loads, eviction, carry_chunks
        update.PARTIAL_PICK, update.CHUNK_MAXNREG = pick, maxnreg
        sr = rounding != "nearest"

        def step():
            pe.pooled_embedding_sparse_update_(x.rows, x.grad, t.layout, t.weight, t.state, t.lr, pe.OPTIMIZER, pe.EPS,
                                               True, 0.0, t.sr_seed, sr)

        timer = graph_replay_windows if device.type == "cuda" else wall_windows
        try:
            times, _ = timer(step, args.steps, args.windows, args.warmup)
            ms = statistics.median(times)
            gbps = nbytes / (ms / 1e3) / 1e9
            row = dict(ms=ms, gbps=gbps, pct_of_copy=100 * gbps / copy_gbps, status="ok")
        except Exception as e:  # noqa: BLE001 -- one failing case must not hide the others
            row = dict(status=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
        finally:
            heuristics.SPARSE_UPDATE_OVERRIDE = None
            update.SR_RNG, update.ROW_LOADS, update.EVICTION = shipped_rng, shipped_loads, shipped_evict
            update.CARRY_CHUNKS, update.PARTIAL_PICK, update.CHUNK_MAXNREG = shipped_carry, shipped_pick, None
        cfg = (heuristics.SparseUpdateConfig(*launch) if launch else heuristics.sparse_update_config(
            heuristics.dot_block(m.embedding_dim), pe.DTYPES[dtype], multi_hot=True))
        rows.append(dict(dtype=dtype, rounding=rounding, row_loads=row_loads, eviction=eviction,
                         carry_chunks=carry_chunks or cfg.carry_chunks, pick=pick,
                         maxnreg=(cfg.chunk_maxnreg if maxnreg is None else maxnreg) or "none",
                         launch=str(tuple(cfg)) + ("" if launch else " (picked)"),
            batch=batch, unique_rows=x.unique, **row))
        print(rows[-1], flush=True)
    t = x = None  # frees the tables; rebinding, not del: each case's step() closes over these names
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def parse_launches(text: str) -> list:
    """``"32:16:4:1,16:8:1:1:8,16:32:4:1:8:1:0,picked"`` -> ``[SparseUpdateConfig(32, 16, 4, 1), ..., None]`` (a fifth
    number: carry_chunks; a sixth: group_sums, 0 or 1; a seventh: chunk_maxnreg, 0 for none)."""
    launches = []
    for item in (t.strip() for t in text.split(",")):
        if item == "picked":
            launches.append(None)
            continue
        parts = item.split(":")
        ok = 4 <= len(parts) <= 7 and all(p.isdigit() for p in parts) and all(int(p) > 0 for p in parts[:5])
        if not ok or (len(parts) >= 6 and parts[5] not in ("0", "1")):
            raise ValueError(f"{item!r} is not chunk:carry_block:chunk_warps:carry_warps[:carry_chunks[:group_sums"
                             "[:chunk_maxnreg]]] (positive integers; group_sums 0 or 1, chunk_maxnreg 0 for none) "
                             "or 'picked'")
        nums = list(map(int, parts))
        if len(nums) >= 6:
            nums[5] = bool(nums[5])
        if len(nums) == 7:
            nums[6] = nums[6] or None
        launches.append(heuristics.SparseUpdateConfig(*nums))
    if not launches:
        raise ValueError(f"{text!r} names no launch")
    return launches


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", default="pooled_update_sweep_run")
    ap.add_argument("--config", default=str(pe.CONFIG))
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--rows-cap", type=int, default=None, help="cap every table at this many rows")
    ap.add_argument("--fp32-rows-cap", type=int, default=20_000_000)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=0, help="calls per window (0: ~20 ms of work)")
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tables of <= 1000 rows, batch 2, one call per window")
    ap.add_argument("--dtypes", default="bf16,fp32", help="table dtypes to sweep (comma list of bf16, fp32)")
    ap.add_argument("--roundings", default=None,
                    help="only the PLAN rows of these roundings (comma list, e.g. hash1,hash1hi,nearest; '-' is fp32's)")
    ap.add_argument("--row-loads", default=None,
                    help="time each PLAN row with each of these chunk-kernel row load orders (comma list of "
                         f"{', '.join(update.ROW_LOAD_ORDERS)}; default: the shipped one)")
    ap.add_argument("--launches", default=None,
                    help="instead of PLAN's launches: a comma list of chunk:carry_block:chunk_warps:carry_warps"
                         "[:carry_chunks]"
                         " (or 'picked'), each timed with every --roundings rounding (bf16 "
                         "tables: the shipped one by default; fp32 tables: '-')")
    ap.add_argument("--evictions", default=None,
                    help=f"comma list of {', '.join(update.EVICTIONS)} (default: the shipped one), each timed "
                         "with every --row-loads order")
    ap.add_argument("--carry-chunks", default=None,
                    help="comma list of chunk boundaries a carry-kernel program takes (`kernels.embedding.update."
                         "CARRY_CHUNKS`, a power of two; default: each launch's own), each timed with every other "
                         "choice")
    ap.add_argument("--picks", default=None,
                    help=f"comma list of {', '.join(update.PARTIAL_PICKS)} (how the chunk kernel writes its first/last "
                         "partial sums; default: the shipped one), each timed with every other choice")
    ap.add_argument("--maxnregs", default=None,
                    help="comma list of register caps for the chunk kernel (`kernels.embedding.update.CHUNK_MAXNREG`: "
                         "'launch' the launch config's own, the default; 'none' the compiler's choice; or a count), "
                         "each timed with every other choice")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run the whole plan this many times, interleaved (machine drift hits every variant alike)")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    outputs = claim_outputs(ap, args, args.out, [f"{args.name}.csv", f"{args.name}.md", f"{args.name}.png"])
    orders = [update.ROW_LOADS] if args.row_loads is None else [o.strip() for o in args.row_loads.split(",") if o.strip()]
    if not orders or set(orders) - set(update.ROW_LOAD_ORDERS) or args.repeats < 1:
        ap.error(f"--row-loads: {args.row_loads!r} is not a comma list of {', '.join(update.ROW_LOAD_ORDERS)} "
                 f"(or --repeats {args.repeats} < 1)")
    evictions = ([update.EVICTION] if args.evictions is None
                 else [e.strip() for e in args.evictions.split(",") if e.strip()])
    if not evictions or set(evictions) - set(update.EVICTIONS):
        ap.error(f"--evictions: {args.evictions!r} is not a comma list of {', '.join(update.EVICTIONS)}")
    carries = [update.CARRY_CHUNKS] if args.carry_chunks is None else [
        int(c) if c.strip().isdigit() else -1 for c in args.carry_chunks.split(",") if c.strip()]
    if not carries or any(c is not None and (c < 1 or c & (c - 1)) for c in carries):
        ap.error(f"--carry-chunks: {args.carry_chunks!r} is not a comma list of powers of two")
    picks = [update.PARTIAL_PICK] if args.picks is None else [p.strip() for p in args.picks.split(",") if p.strip()]
    if not picks or set(picks) - set(update.PARTIAL_PICKS):
        ap.error(f"--picks: {args.picks!r} is not a comma list of {', '.join(update.PARTIAL_PICKS)}")
    caps = [None] if args.maxnregs is None else [
        {"launch": None, "none": 0}.get(c.strip(), int(c) if c.strip().isdigit() else -1)
        for c in args.maxnregs.split(",") if c.strip()]
    if not caps or any(c not in (None, 0) and not 24 <= c <= 255 for c in caps):
        ap.error(f"--maxnregs: {args.maxnregs!r} is not a comma list of 'launch', 'none' and register counts 24-255")
    orders = [(o, e, c, p, r) for o in orders for e in evictions for c in carries for p in picks for r in caps]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.rows_cap, args.batch = args.rows_cap or 1000, 2  # 428 slots: repeated rows, chunks carried over
        args.warmup, args.steps, args.windows = int(device.type == "cuda"), 1, 1
    m = config_or_error(ap, args.config).model  # a missing / malformed config: one line, not a traceback
    env = environment(device)
    copy_gbps = pe.copy_bandwidth(device, 2**30 if device.type == "cuda" and not args.smoke else 2**24, args.windows)
    rows: list[dict] = []
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not dtypes or set(dtypes) - {"bf16", "fp32"}:
        ap.error(f"--dtypes: {args.dtypes!r} is not a comma list of bf16, fp32")
    keep = None if args.roundings is None else {r.strip() for r in args.roundings.split(",") if r.strip()}
    known = {r for _, r, _ in PLAN}
    if keep is not None and (not keep or keep - known):
        ap.error(f"--roundings: {args.roundings!r} names none or unknown roundings (known: {', '.join(sorted(known))})")
    plan_rows = PLAN
    if args.launches is not None:
        try:
            launches = parse_launches(args.launches)
        except ValueError as e:
            ap.error(f"--launches: {e}")
        plan_rows = [("bf16", r, c) for r in sorted(keep or {update.SR_RNG}) if r != "-" for c in launches]
        plan_rows += [("fp32", "-", c) for c in launches]
    for dtype in dtypes:
        cap = args.rows_cap
        if dtype == "fp32" and args.fp32_rows_cap:
            cap = min(cap, args.fp32_rows_cap) if cap else args.fp32_rows_cap
        cards = [min(c, cap) if cap else c for c in m.cardinalities]
        plan = [(*p, o) for _ in range(args.repeats) for p in plan_rows if p[0] == dtype and (keep is None or p[1] in keep)
                for o in orders]
        rows += run_plan(dtype, plan, cards, m, args.batch, device, copy_gbps, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / f"{args.name}.csv", rows, KEYS, {**env, "copy_gbps": copy_gbps})
    table = ["| dtype | rounding | launch | row loads | eviction | carry chunks | picks | maxnreg | ms | % of copy "
             "| status |",
             "| --- | --- | --- | --- | --- | ---: | --- | ---: | ---: | ---: | --- |"]
    table += [md_row([r["dtype"], r["rounding"], r["launch"], r["row_loads"], r["eviction"], r["carry_chunks"],
                      r["pick"], r["maxnreg"],
                      f"{r['ms']:.3f}" if "ms" in r else "n/a",
                      f"{r['pct_of_copy']:.1f}%" if "pct_of_copy" in r else "n/a", r["status"]]) for r in rows]
    note = (f"batch {args.batch}, D = {m.embedding_dim}, {sum(m.multi_hot_sizes)} slots a sample; copy_ {copy_gbps:,.0f} GB/s; "
            "bytes as pooled_embedding.py counts them (bwd).")
    text = markdown("Pooled fused backward: launch and rounding sweep", [env_line(env), note], table)
    (out / f"{args.name}.md").write_text(text)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.5))
    ok = [r for r in rows if "ms" in r]
    labels = [f"{r['dtype']} {r['rounding']} {r['launch']} {r['row_loads']} {r['eviction']} {r['carry_chunks']} "
              f"{r['pick']} {r['maxnreg']}"
              for r in ok]
    ax.barh(labels[::-1], [r["ms"] for r in ok][::-1])
    ax.set_xlabel("ms per call")
    ax.set_title(f"pooled fused backward\n{env['device']}, {env['date']}", fontsize=9)
    ax.tick_params(axis="y", labelsize=7)
    save_figure(fig, out / f"{args.name}.png")
    print(text, end="")
    outputs.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
