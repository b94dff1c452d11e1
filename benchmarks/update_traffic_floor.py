"""How fast the pooled update's memory traffic can go with its launch, without its arithmetic.

    python benchmarks/update_traffic_floor.py --out benchmarks/results --name update_traffic_floor_h200
    python benchmarks/update_traffic_floor.py --smoke --out /tmp/utf     # tiny (CPU: Triton interpreter)

The fused row-wise Adagrad update of MLPerf DLRM-DCNv2's tables (`kernels.embedding.update`) is bound by its
chains of dependent loads more than by bytes (PERF.md, fifteenth run). Its chunk kernel is the largest kernel of
the step outside the GEMMs. To tell how much a rewrite could gain, this script times, on the same sorted
batch and with the chunk kernel's grid (one 1-warp program per 16 sorted positions), skeleton kernels that
move the update's bytes in its order and do almost nothing else:

* ``update``: the shipped update after the sort (`_segment_update` with the sort done: the chunk kernel, the
  group sums and the carry kernel; row-wise Adagrad, bf16 tables rounded stochastically);
* ``rmw+gather``: each position's gradient row gathered (bf16), each segment's last position reads its row and
  the row's fp32 state, adds the gradient row, writes both back (the update's traffic, no segment sums, no
  rounding: repeated rows race, which changes values, not bytes);
* ``rmw``: the same without the gradient gathers;
* ``gather``: the gradient gathers alone (each program writes one sum row);
* ``rmw+gather@P:W`` (``--skeleton-launches``): ``rmw+gather`` with P positions and W warps a program;
* ``copy``: ``dst.copy_(src)`` of 1 GiB, the bandwidth reference.

Bytes, per case: the distinct rows read and written (256 B each in bf16) with their state (counted as 4 B
each way: the DRAM moves 32-byte sectors), the gathered gradient rows (256 B each, most from L2), the sorted
rows and permutation (12 B a position). Writes CSV / Markdown / PNG under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the Triton kernels run under the interpreter on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.append(str(Path(__file__).resolve().parent))

import pooled_embedding as pe  # noqa: E402
from _common import (  # noqa: E402
    add_overwrite,
    claim_outputs,
    config_or_error, env_line, environment, graph_replay_windows, markdown, md_row, pyplot, save_figure,
    wall_windows, write_csv,
)

from dlrm.config import load_config  # noqa: E402,F401 - the tests' name
from kernels.embedding import update  # noqa: E402

CHUNK = 16
KEYS = ["case", "ms", "gbytes", "gbps", "pct_of_copy", "positions", "distinct_rows"]


@triton.jit
def _skeleton_kernel(sorted_ptr, perm_ptr, slot_ptr, grad_ptr, stride_gb, stride_gf, w_ptr, state_ptr, sink_ptr, N, R,
                     L: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr, GATHER: tl.constexpr, RMW: tl.constexpr):
    """One program per CHUNK sorted positions: gather their gradient rows (GATHER), read-modify-write the rows
    that end a segment and their state (RMW). Rows >= R (the multi-hot padding, sorted last) are skipped."""
    k = tl.program_id(0)
    i = k * CHUNK + tl.arange(0, CHUNK)
    rows = tl.load(sorted_ptr + i, mask=i < N, other=-1)
    valid = (i < N) & (rows < R)
    nxt = tl.load(sorted_ptr + i + 1, mask=(i + 1) < N, other=-1)
    d = tl.arange(0, D)
    g = tl.zeros((CHUNK, D), dtype=tl.float32)
    if GATHER:
        pos = tl.load(perm_ptr + i, mask=valid, other=0).to(tl.int32)
        b = pos // L
        f = tl.load(slot_ptr + (pos - b * L), mask=valid, other=0).to(tl.int32)
        g = tl.load(grad_ptr + b[:, None] * stride_gb + f[:, None] * stride_gf + d[None, :],
                    mask=valid[:, None], other=0.0, eviction_policy="evict_last").to(tl.float32)
    if RMW:
        last = valid & (nxt != rows)
        r64 = rows.to(tl.int64)
        w = tl.load(w_ptr + r64[:, None] * D + d[None, :], mask=last[:, None], other=0.0).to(tl.float32)
        s = tl.load(state_ptr + r64, mask=last, other=0.0)
        tl.store(state_ptr + r64, s + tl.sum(g * g, axis=1), mask=last)
        tl.store(w_ptr + r64[:, None] * D + d[None, :], (w + g * 1e-3).to(w_ptr.dtype.element_ty), mask=last[:, None])
    else:
        tl.store(sink_ptr + k * D + d, tl.sum(g, axis=0))


def skeleton(case: str, sorted_rows, perm, slot, grad, weight, state, sink, chunk: int = CHUNK, warps: int = 1) -> None:
    N = sorted_rows.numel()
    _skeleton_kernel[(triton.cdiv(N, chunk),)](
        sorted_rows, perm, slot, grad, grad.stride(0), grad.stride(1), weight, state, sink, N, weight.shape[0],
        L=slot.numel(),
        D=weight.shape[1], CHUNK=chunk, GATHER=case in ("rmw+gather", "gather"), RMW=case in ("rmw+gather", "rmw"),
        num_warps=warps)


def case_bytes(case: str, positions: int, distinct: int, row_bytes: int) -> int:
    idx = positions * 12
    rmw = distinct * 2 * (row_bytes + 4)
    gather = positions * row_bytes
    return {"update": idx + rmw + gather, "rmw+gather": idx + rmw + gather, "rmw": idx + rmw,
            "gather": idx + gather}[case.split("@")[0]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", default="update_traffic_floor")
    ap.add_argument("--config", default=str(pe.CONFIG))
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--rows-cap", type=int, default=None, help="cap every table at this many rows")
    ap.add_argument("--windows", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=2, help="rounds of every case, interleaved")
    ap.add_argument("--smoke", action="store_true", help="tables of <= 1000 rows, batch 4, one call per window")
    ap.add_argument("--skeleton-launches", default="",
                    help="also time rmw+gather at these launches: comma list of positions:warps a program (e.g. "
                         "32:1,64:2), the update's own 16:1 being the default case")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    outputs = claim_outputs(ap, args, args.out, [f"{args.name}.csv", f"{args.name}.md", f"{args.name}.png"])
    try:
        launches = [tuple(int(v) for v in item.split(":")) for item in args.skeleton_launches.split(",") if item.strip()]
        if any(len(t) != 2 or t[0] < 1 or t[0] & (t[0] - 1) or t[1] < 1 or t[1] & (t[1] - 1) for t in launches):
            raise ValueError
    except ValueError:
        ap.error(f"--skeleton-launches: {args.skeleton_launches!r} is not a comma list of positions:warps (powers of two)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    steps, warmup = 0, 3
    if args.smoke:
        args.rows_cap, args.batch, args.windows, args.repeats = args.rows_cap or 1000, 4, 1, 1
        steps, warmup = 1, int(device.type == "cuda")
    if args.windows < 1 or args.repeats < 1 or args.batch < 1:
        ap.error("--windows, --repeats and --batch must be >= 1")
    m = config_or_error(ap, args.config).model  # a missing / malformed config: one line, not a traceback
    cards = [min(c, args.rows_cap) if args.rows_cap else c for c in m.cardinalities]
    env = environment(device)
    copy_gbps = pe.copy_bandwidth(device, 2**30 if device.type == "cuda" and not args.smoke else 2**24, args.windows)
    t = pe.Tables(cards, m.multi_hot_sizes, m.embedding_dim, torch.bfloat16, device)
    x = pe.Inputs(t, args.batch, device)
    sorted_rows, perm = update.sort_by_row(x.rows, t.rows)
    slot = t.layout.slot_feature
    positions, distinct = x.rows.numel(), x.unique
    sink = torch.empty(triton.cdiv(positions, CHUNK), t.dim, dtype=torch.float32, device=device)  # the most programs
    row_bytes = t.dim * t.weight.element_size()

    def step_for(case: str):
        if case == "update":
            return lambda: update._segment_update(x.rows, x.grad, t.weight, t.state, t.lr, update.OPTIMIZERS[pe.OPTIMIZER],
                                                  pe.EPS, 0.0, slot, "stochastic", t.sr_seed,
                                                  presorted=(sorted_rows, perm))
        if case.startswith("rmw+gather@"):
            chunk, warps = (int(v) for v in case.split("@")[1].split(":"))
            return lambda: skeleton("rmw+gather", sorted_rows, perm, slot, x.grad, t.weight, t.state, sink, chunk, warps)
        return lambda: skeleton(case, sorted_rows, perm, slot, x.grad, t.weight, t.state, sink)

    timer = graph_replay_windows if device.type == "cuda" else wall_windows
    cases = ["update", "rmw+gather", "rmw", "gather"] + [f"rmw+gather@{c}:{w}" for c, w in launches]
    times: dict[str, list[float]] = {c: [] for c in cases}
    for _ in range(args.repeats):
        for case in cases:
            got, _ = timer(step_for(case), steps, args.windows, warmup)
            times[case].append(statistics.median(got))
            print(case, f"{times[case][-1]:.3f} ms", flush=True)
    rows = []
    for case in cases:
        ms = statistics.median(times[case])
        gbytes = case_bytes(case, positions, distinct, row_bytes) / 1e9
        gbps = gbytes / (ms / 1e3)
        rows.append(dict(case=case, ms=ms, gbytes=gbytes, gbps=gbps, pct_of_copy=100 * gbps / copy_gbps,
                         positions=positions, distinct_rows=distinct, all_ms=" ".join(f"{v:.3f}" for v in times[case])))
    rows.append(dict(case="copy", ms=float("nan"), gbytes=float("nan"), gbps=copy_gbps, pct_of_copy=100.0,
                     positions=positions, distinct_rows=distinct, all_ms=""))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / f"{args.name}.csv", rows, KEYS + ["all_ms"], env)
    table = ["| case | ms (median of rounds) | rounds, ms | GB moved | GB/s | % of copy |",
             "| --- | ---: | --- | ---: | ---: | ---: |"]
    table += [md_row([r["case"], f"{r['ms']:.3f}" if r["case"] != "copy" else "", r["all_ms"],
                      f"{r['gbytes']:.2f}" if r["case"] != "copy" else "", f"{r['gbps']:.0f}",
                      f"{r['pct_of_copy']:.1f}%"]) for r in rows]
    paragraphs = [env_line(env),
                  f"Batch {args.batch}, {positions:,} positions, {distinct:,} distinct rows, tables "
                  f"{'capped at ' + format(args.rows_cap, ',') + ' rows' if args.rows_cap else 'of the config'} "
                  f"({t.rows:,} rows, bf16); one 1-warp program per {CHUNK} sorted positions; CUDA-graph replays, "
                  f"{args.windows} windows a round, {args.repeats} interleaved rounds. See the script's docstring "
                  "for the cases and the bytes counted."]
    (out / f"{args.name}.md").write_text(markdown("The pooled update's traffic without its arithmetic", paragraphs, table))
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3))
        timed = [r for r in rows if r["case"] != "copy"]
        ax.barh([r["case"] for r in timed], [r["ms"] for r in timed])
        ax.set_xlabel("ms a call")
        ax.set_title(f"update traffic, {env.get('device', '')}", fontsize=9)
        save_figure(fig, out / f"{args.name}.png")
    print((out / f"{args.name}.md").read_text())
    outputs.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
