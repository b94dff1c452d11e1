"""The one-hot embedding's lookup and fused SGD update at Kaggle shapes, over lookup launches and the L2 fetch
granularity (issue #20: forward >= 80%, fused update >= 50% of copy bandwidth).

    python benchmarks/onehot_embedding_sweep.py --out benchmarks/results --name onehot_embedding_sweep
    python benchmarks/onehot_embedding_sweep.py --smoke --out /tmp/sweep      # tiny tables (CPU: Triton interpreter)

Tables and inputs as `benchmarks/kernels.py` builds them (Kaggle's 26 tables, D=16 full size, D=128 capped at 4M
rows a table; raw ids uniform, so every lookup is a cold row), and the same byte counts (`embedding_bytes`: the
bytes each op must minimally move). For each (L2 fetch granularity, dim, dtype, batch) it times, by CUDA-graph
replay (median of the windows), the lookup (`embedding_lookup`) at each launch of ``--launches`` (rows per program
x warps, forced through `kernels.embedding.lookup.LOOKUP_LAUNCH_OVERRIDE`; "picked" is what the launcher picks),
the deterministic update (`embedding_sparse_update_`, SGD) and, for fp32 tables, the atomic one, with the fused
lookup ahead of it ("fwd_atomic": `fused_embedding` with plain non-deterministic SGD, which writes no rows: the
update hashes the raw values again; "bwd_atomic_hashed": that update).

L2 fetch granularity: the driver's ``CU_LIMIT_MAX_L2_FETCH_GRANULARITY`` (``cuCtxSetLimit``), how many bytes L2 may
fetch from DRAM for one miss (32-128). A D=16 row is 32 (bf16) or 64 (fp32) bytes, so a larger fetch reads bytes
no lookup asked for. 0 leaves the driver's value (reported). Writes ``<name>.csv`` / ``.md`` / ``.png``.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import statistics
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the Triton kernels run under the interpreter on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE))

import pooled_embedding as pe  # noqa: E402
from _common import (  # noqa: E402
    add_overwrite,
    claim_outputs,
    env_line, environment, graph_replay_windows, markdown, md_row, pyplot, save_figure, wall_windows, write_csv,
)

from dlrm.data.schema import KAGGLE_CARDINALITIES  # noqa: E402
import kernels.embedding.lookup as lookup  # noqa: E402
from dlrm.model.hashing import modulus_rows  # noqa: E402
from kernels.embedding import embedding_lookup, embedding_sparse_update_  # noqa: E402

KEYS = ["l2_fetch_bytes", "dim", "dtype", "batch", "op", "launch", "unique_rows", "ms", "gbps", "pct_of_copy", "status"]
CU_LIMIT_MAX_L2_FETCH_GRANULARITY = 0x05  # CUlimit in cuda.h


def _bench_kernels():
    """benchmarks/kernels.py, by path: its name is taken by the `kernels` package."""
    spec = importlib.util.spec_from_file_location("bench_kernels", HERE / "kernels.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def l2_fetch_granularity(nbytes: int = 0) -> int:
    """Set the current context's max L2 fetch granularity to `nbytes` (0: leave it); return the value now."""
    cuda = ctypes.CDLL("libcuda.so.1")
    if nbytes:
        rc = cuda.cuCtxSetLimit(CU_LIMIT_MAX_L2_FETCH_GRANULARITY, ctypes.c_size_t(nbytes))
        if rc != 0:
            raise RuntimeError(f"cuCtxSetLimit(MAX_L2_FETCH_GRANULARITY, {nbytes}) returned CUresult {rc}")
    value = ctypes.c_size_t(0)
    rc = cuda.cuCtxGetLimit(ctypes.byref(value), CU_LIMIT_MAX_L2_FETCH_GRANULARITY)
    if rc != 0:
        raise RuntimeError(f"cuCtxGetLimit(MAX_L2_FETCH_GRANULARITY) returned CUresult {rc}")
    return int(value.value)


def parse_launches(text: str) -> list:
    """"picked,256x4,512x8" -> [None, (256, 4), (512, 8)]."""
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        if item == "picked":
            out.append(None)
            continue
        n, _, w = item.partition("x")
        if not (n.isdigit() and w.isdigit()) or int(n) & (int(n) - 1) or int(w) not in (1, 2, 4, 8, 16):
            raise ValueError(f"launch {item!r} is not ROWSxWARPS (rows a power of two, warps 1-16)")
        out.append((int(n), int(w)))
    return out


def run_case(dim: int, cap, dtype: torch.dtype, batch: int, launches: list, fetch: int, device, copy_gbps: float,
             bytes_of, args) -> list[dict]:
    cards = [min(c, cap) if cap else c for c in KAGGLE_CARDINALITIES]
    card_t = torch.tensor(cards, dtype=torch.int64, device=device)
    offs_t = torch.cumsum(card_t, 0) - card_t
    weight = torch.empty(sum(cards), dim, dtype=dtype, device=device).uniform_(-0.05, 0.05)
    g = torch.Generator(device=device).manual_seed(0)
    raw = torch.randint(-1, 2**32, (batch, len(cards)), dtype=torch.int64, device=device, generator=g)
    grad = torch.randn(batch, len(cards), dim, dtype=dtype, device=device, generator=g) * 1e-3
    lr = torch.full((1,), 0.01, dtype=torch.float32, device=device)
    rows = modulus_rows(raw, card_t, offs_t)
    unique = int(torch.unique(rows).numel())  # once, before timing
    work = bytes_of(batch * len(cards), unique, dim, weight.element_size())
    timer = graph_replay_windows if device.type == "cuda" else wall_windows
    ops = [("fwd", launch, lambda: embedding_lookup(raw, weight, card_t, offs_t)) for launch in launches]
    ops.append(("bwd", None, lambda: embedding_sparse_update_(rows, grad, weight, None, lr, "sgd", deterministic=True)))
    if dtype == torch.float32:
        # the training forward ahead of the atomic update: the fused op, which then writes no rows
        state, trigger = torch.empty(0, device=device), torch.zeros(0, device=device)
        ops.append(("fwd_atomic", None, lambda: torch.ops.dlrm_kernels.fused_embedding(
            raw, weight, card_t, offs_t, None, None, state, lr, "sgd", 1e-10, False, trigger)))
        ops.append(("bwd_atomic", None,
                    lambda: embedding_sparse_update_(rows, grad, weight, None, lr, "sgd", deterministic=False)))
        ops.append(("bwd_atomic_hashed", None, lambda: torch.ops.dlrm_kernels.embedding_sgd_atomic_hashed_(
            raw, card_t, offs_t, grad, weight, lr)))
    out = []
    for op, launch, fn in ops:
        lookup.LOOKUP_LAUNCH_OVERRIDE = launch
        base = dict(l2_fetch_bytes=fetch, dim=dim, dtype=str(dtype).replace("torch.", ""), batch=batch, op=op,
                    launch="picked" if launch is None else f"{launch[0]}x{launch[1]}", unique_rows=unique)
        try:
            ms = statistics.median(timer(fn, args.steps, args.windows, args.warmup)[0])
            gbps = work["bwd" if op.startswith("bwd") else "fwd"] / (ms / 1e3) / 1e9
            out.append(dict(base, ms=ms, gbps=gbps, pct_of_copy=100 * gbps / copy_gbps, status="ok"))
        except Exception as e:  # noqa: BLE001 -- one failing case must not hide the others
            out.append(dict(base, status=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"))
        finally:
            lookup.LOOKUP_LAUNCH_OVERRIDE = None
        print(out[-1], flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", default="onehot_embedding_sweep")
    ap.add_argument("--batch-sizes", default="16384,65536")
    ap.add_argument("--dims", default="16,128", help="16 (full Kaggle tables) and/or 128 (capped at 4M rows)")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--launches", default="picked,128x4,256x8,512x4,512x8,1024x8",
                    help="lookup launches: ROWSxWARPS, or picked (kernels.heuristics.lookup_launch)")
    ap.add_argument("--l2-fetch", default="0", help="comma list of max L2 fetch granularities in bytes (0: the driver's)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=0, help="calls per window (0: ~20 ms of work)")
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tables of <= 1000 rows, batch 8, one call per window")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    outputs = claim_outputs(ap, args, args.out, [f"{args.name}.csv", f"{args.name}.md", f"{args.name}.png"])
    try:
        launches = parse_launches(args.launches)
        fetches = [int(f) for f in args.l2_fetch.split(",")]
        dims = [int(d) for d in args.dims.split(",")]
        batches = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError as e:
        ap.error(str(e))
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    if not launches or set(args.dtypes.split(",")) - set(dtypes) or any(f not in (0, 32, 64, 128) for f in fetches):
        ap.error("--launches empty, --dtypes not of bf16/fp32, or --l2-fetch not of 0, 32, 64, 128")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and fetches != [0]:
        ap.error("--l2-fetch needs a CUDA device")
    if args.smoke:
        batches, args.warmup, args.steps, args.windows = [8], int(device.type == "cuda"), 1, 1
    env = environment(device)
    copy_gbps = pe.copy_bandwidth(device, 2**30 if device.type == "cuda" and not args.smoke else 2**24, args.windows)
    bytes_of = _bench_kernels().embedding_bytes
    rows: list[dict] = []
    default_fetch = l2_fetch_granularity() if device.type == "cuda" else 0
    for fetch in fetches:
        if device.type == "cuda":
            now = l2_fetch_granularity(fetch or default_fetch)
            print(f"L2 fetch granularity: {now} bytes (driver's: {default_fetch})", flush=True)
        for dim in dims:
            cap = 1000 if args.smoke else (4_000_000 if dim == 128 else None)
            for name in args.dtypes.split(","):
                for batch in batches:
                    rows += run_case(dim, cap, dtypes[name], batch, launches, fetch or default_fetch, device, copy_gbps,
                                     bytes_of, args)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    if device.type == "cuda":
        l2_fetch_granularity(default_fetch)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / f"{args.name}.csv", rows, KEYS, {**env, "copy_gbps": copy_gbps, "driver_l2_fetch": default_fetch})
    table = ["| L2 fetch B | D | dtype | batch | op | launch | ms | % of copy | status |",
             "| ---: | ---: | --- | ---: | --- | --- | ---: | ---: | --- |"]
    table += [md_row([r["l2_fetch_bytes"], r["dim"], r["dtype"], r["batch"], r["op"], r["launch"],
                      f"{r['ms']:.4f}" if "ms" in r else "n/a",
                      f"{r['pct_of_copy']:.1f}%" if "pct_of_copy" in r else "n/a", r["status"]]) for r in rows]
    note = (f"copy_ {copy_gbps:,.0f} GB/s; the driver's L2 fetch granularity {default_fetch} B; bytes as "
            "benchmarks/kernels.py counts them; fwd = lookup, bwd = deterministic SGD update, bwd_atomic = atomic SGD; "
            "fwd_atomic / bwd_atomic_hashed: what training runs with it (no rows written; the update hashes the raw "
            "values again).")
    text = markdown("One-hot embedding: lookup launches and L2 fetch granularity", [env_line(env), note], table)
    (out / f"{args.name}.md").write_text(text)
    plt = pyplot()
    ok = [r for r in rows if "ms" in r]
    fig, ax = plt.subplots(figsize=(9, 0.3 * len(ok) + 1.5))
    ax.barh([f"L2 {r['l2_fetch_bytes']} D{r['dim']} {r['dtype']} B{r['batch']} {r['op']} {r['launch']}" for r in ok][::-1],
            [r["pct_of_copy"] for r in ok][::-1])
    ax.set_xlabel("% of copy bandwidth")
    ax.set_title(f"one-hot embedding\n{env['device']}, {env['date']}", fontsize=9)
    ax.tick_params(axis="y", labelsize=6)
    save_figure(fig, out / f"{args.name}.png")
    print(text, end="")
    outputs.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
