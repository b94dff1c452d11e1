"""Does a second CUDA stream hide the embedding's memory-bound work behind the dense GEMMs? MLPerf DLRM-DCNv2 shapes.

    python benchmarks/stream_overlap.py --out benchmarks/results/stream_overlap
    python benchmarks/stream_overlap.py --rows-cap 1000000 --out /tmp/so   # smaller tables
    python benchmarks/stream_overlap.py --smoke --out /tmp/so              # tiny (CPU: interpreter, no streams)

Issue #20 names "weight gradients overlapped with the data-gradient chain (a second stream inside the captured
step)" as a lever, and the MLPerf step (issue #22) spends ~6 ms a step in the embedding's bandwidth-bound kernels
next to ~9 ms of compute-bound GEMMs. Before restructuring the step around streams, this measures what
overlapping buys on the GPU itself, with the project's own kernels at the step's shapes (batch 65536 by default,
``configs/mlperf-dcnv2.json``'s tables in bf16, D = 128):

* ``update``: the pooled embedding's fused row-wise Adagrad backward (`pooled_embedding_sparse_update_`: the
  sort of the 14M slot positions, the segment sums, the update with stochastic rounding);
* ``sort``: that sort alone (`kernels.embedding.update.sort_by_row`);
* ``update_presorted``: the update given that sort, done beforehand (``presorted`` of `pooled_update_impl`: the
  segment sums and the optimizer step only), so ``sort||update_presorted`` asks whether the next step's sort could
  run beside this step's update (which leaves DRAM at about half its peak), and ``sort||lookup`` whether this
  step's sort could run beside its own lookup (after a separate hashing pass);
* ``lookup``: the pooled forward (`pooled_embedding_lookup`, hashing inside);
* ``wgrads``: the step's weight-gradient GEMMs (per cross layer ``grad_pre^T u`` [3456, 512] and
  ``grad_u^T x`` [512, 3456], and the four top-MLP ones), which need nothing the update writes, so a step
  could defer them until the update runs;
* ``fwd_gemms``: the cross network's and the top MLP's forward GEMMs (what the sort could run beside).

Each pair is timed alone one after the other (``A+B``) and with ``A`` on one stream and ``B`` on another
(``A || B``, both forked from and joined back to the capturing stream), each as a CUDA graph of the calls
replayed in ``--windows`` windows (CUDA events; the median window), with both streams at the same priority and
with A's or B's at the high one. The gain is ``(A+B) - (A || B)`` (the best of the three), and the share of the
shorter part it hid.

Under ``torchrun`` (several GPUs, NCCL), two more parts, the collectives of a two-rank step (`dlrm.distributed`):

* ``a2a``: the embeddings' ``all_to_all_single`` (or its gradient's, the same bytes): every rank sends each rank
  ``batch`` samples of half the features, [W x batch x F / W, D] bf16 (218 MB a peer at MLPerf's shapes);
* ``allreduce``: DDP's all_reduce of the dense gradients, fp32, as many as the bottom MLP, cross network and top
  MLP have parameters;

so ``a2a||sort`` asks whether the owner's sort could travel beside the gradients' exchange, ``a2a||wgrads`` whether
deferred weight gradients could, ``a2a||lookup`` whether half the lookup could run while the other half's
embeddings travel, and ``allreduce||update`` whether the dense gradients' all_reduce hides under the update. A
collective is issued on its side stream like any other part (NCCL's own stream waits on it, and it on NCCL's), and
every rank captures and replays the same graphs; rank 0 writes the results, each time the slowest rank's.

``--sm-carveouts 0,16,32`` repeats every pair with cuBLAS told to leave that many SMs free
(``torch._C._set_sm_carveout_experimental``: the GEMMs' persistent grids take the other SMs), so that the part
beside a GEMM gets SMs of its own instead of waiting for the GEMM's last wave; "A || B" of a carve-out is then
compared with "A then B" without one (``gain_vs_uncarved_ms``, where 0 is among the values): what restructuring
the step around it could buy. Only cuBLAS honours the carve-out (the GEMMs' own times, "A alone" / "B alone",
show what it costs them).

On the CPU (``--smoke``) there are no streams: both orders run the calls one after the other (a check of the
script, not a measurement), and without ``torchrun`` the collectives are a local copy of their bytes (also a
check of the script only). Writes stream_overlap.csv / .md / .png under ``--out`` (GPU name, versions, date).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

if not torch.cuda.is_available():  # the Triton kernels run under the interpreter on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.append(str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    add_overwrite,
    claim_outputs,
    env_line, environment, graph_replay_ms, markdown, md_row, pyplot, save_figure, write_csv,
)
from pooled_embedding import Inputs, Tables  # noqa: E402

from dlrm.data.schema import NUM_DENSE  # noqa: E402
from kernels.embedding import pooled_embedding_lookup  # noqa: E402
from kernels.embedding.pooled import pooled_embedding_sparse_update_, pooled_update_impl  # noqa: E402
from kernels.embedding.update import sort_by_row  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "mlperf-dcnv2.json"
PAIRS = ["update||wgrads", "sort||fwd_gemms", "lookup||wgrads", "sort||update_presorted", "sort||lookup"]
# Pairs with a collective (`Collectives`): several ranks under torchrun, or a local stand-in (see the docstring)
COLLECTIVE_PAIRS = ["a2a||sort", "a2a||wgrads", "a2a||lookup", "allreduce||update"]
KEYS = ["pair", "sm_carveout", "a", "b", "a_ms", "b_ms", "seq_ms", "par_ms", "par_a_hi_ms", "par_b_hi_ms", "gain_ms",
        "hidden_pct", "gain_vs_uncarved_ms", "batch", "table_rows", "world"]


class DenseShapes:
    """bf16 operands of the cross network's and top MLP's GEMMs at batch B (values random: only time matters)."""

    def __init__(self, batch: int, width: int, rank: int, layers: int, top: list[int], device: torch.device):
        g = torch.Generator(device=device).manual_seed(1)
        r = lambda *s: torch.randn(*s, generator=g, device=device, dtype=torch.bfloat16)  # noqa: E731
        self.x = [r(batch, width) for _ in range(layers)]  # x_l (and the grad_pre stand-ins)
        self.u = [r(batch, rank) for _ in range(layers)]
        self.V = [r(rank, width) for _ in range(layers)]
        self.W = [r(width, rank) for _ in range(layers)]
        widths = [width, *top]
        self.h = [r(batch, w) for w in widths]
        self.top = [r(widths[i + 1], widths[i]) for i in range(len(widths) - 1)]

    def wgrads(self) -> None:
        for x, u in zip(self.x, self.u):
            torch.mm(x.t(), u)  # dW [N, r]
            torch.mm(u.t(), x)  # dV [r, N]
        for i in range(len(self.top)):
            torch.mm(self.h[i + 1].t(), self.h[i])

    def fwd_gemms(self) -> None:
        for x, V, W in zip(self.x, self.V, self.W):
            torch.mm(torch.mm(x, V.t()), W.t())
        h = self.h[0]
        for w in self.top:
            h = torch.mm(h, w.t())


class Collectives:
    """The two-rank step's collectives at ``batch`` samples a rank: the embeddings' all_to_all (``features``
    pooled rows of ``dim`` bf16 a sample, each rank serving ``features / W`` of them) and the dense gradients'
    all_reduce (``params`` fp32). Without an initialised process group each is a copy of its bytes on this device."""

    def __init__(self, batch: int, features: int, dim: int, params: int, device: torch.device):
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        served = -(-features // self.world)
        g = torch.Generator(device=device).manual_seed(2)
        self.send = torch.randn(self.world * batch * served, dim, generator=g, device=device).to(torch.bfloat16)
        self.recv = torch.empty_like(self.send)
        self.grads = torch.randn(params, generator=g, device=device)
        self.grads_copy = torch.empty_like(self.grads)

    def a2a(self) -> None:
        if self.world > 1:
            dist.all_to_all_single(self.recv, self.send)
        else:
            self.recv.copy_(self.send)

    def allreduce(self) -> None:
        if self.world > 1:
            dist.all_reduce(self.grads)
        else:
            self.grads_copy.copy_(self.grads)


def dense_params(cfg: dict, width: int) -> int:
    """Parameters of the bottom MLP, the low-rank cross network and the top MLP (what DDP all-reduces)."""
    def mlp(widths: list[int]) -> int:
        return sum(a * b + b for a, b in zip(widths[:-1], widths[1:]))
    rank, layers = int(cfg["cross_rank"]), int(cfg["cross_layers"])
    return (mlp([NUM_DENSE, *cfg["bottom_mlp"]]) + layers * (2 * width * rank + width)
            + mlp([width, *cfg["top_mlp"]]))


def parts(t: Tables, x: Inputs, dense: DenseShapes, comm: Collectives) -> dict[str, Callable[[], None]]:
    presorted = sort_by_row(x.rows, t.rows)  # once: update_presorted times the kernels after the sort
    return {
        "a2a": comm.a2a,
        "allreduce": comm.allreduce,
        "update": lambda: pooled_embedding_sparse_update_(x.rows, x.grad, t.layout, t.weight, t.state, t.lr,
                                                          "rowwise_adagrad", 1e-8, True, 0.0, t.sr_seed, True),
        "sort": lambda: sort_by_row(x.rows, t.rows),
        "update_presorted": lambda: pooled_update_impl(x.rows, x.grad, t.layout.slot_feature, t.weight, t.state, t.lr,
                                                       "rowwise_adagrad", 1e-8, True, 0.0, t.sr_seed, True,
                                                       presorted=presorted),
        "lookup": lambda: pooled_embedding_lookup(x.raw, t.weight, t.cards, t.offsets, t.layout),
        "wgrads": dense.wgrads,
        "fwd_gemms": dense.fwd_gemms,
    }


def sequential(a: Callable[[], None], b: Callable[[], None]) -> Callable[[], None]:
    def step():
        a()
        b()
    return step


def concurrent(a: Callable[[], None], b: Callable[[], None], high: str = "") -> Callable[[], None]:
    """``a`` and ``b`` on two side streams forked from the current one and joined back (capturable); ``high``
    ("a", "b" or "") names the one whose stream gets the high priority."""
    if not torch.cuda.is_available():
        return sequential(a, b)
    sa = torch.cuda.Stream(priority=-1 if high == "a" else 0)
    sb = torch.cuda.Stream(priority=-1 if high == "b" else 0)

    def step():
        main = torch.cuda.current_stream()
        sa.wait_stream(main)
        sb.wait_stream(main)
        with torch.cuda.stream(sa):
            a()
        with torch.cuda.stream(sb):
            b()
        main.wait_stream(sa)
        main.wait_stream(sb)
    return step


@contextlib.contextmanager
def sm_carveout(sms: int):
    """cuBLAS leaves ``sms`` SMs free inside the block (read when each GEMM is set up, so also in a capture);
    0: no carve-out. Not in every torch (then only 0 is accepted)."""
    if sms == 0:
        yield
        return
    if not hasattr(torch._C, "_set_sm_carveout_experimental"):
        raise SystemExit(f"--sm-carveouts {sms}: this torch ({torch.__version__}) has no SM carve-out")
    torch._C._set_sm_carveout_experimental(sms)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(None)


def slowest(ms: float) -> float:
    """The largest of the ranks' times (every rank's own when run alone)."""
    if not dist.is_initialized():
        return ms
    t = torch.tensor([ms], dtype=torch.float64, device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def measure(pair: str, fns: dict[str, Callable[[], None]], args) -> dict:
    a, b = pair.split("||")
    t = lambda f: slowest(graph_replay_ms(f, args.calls, args.windows, args.warmup))  # noqa: E731
    row = {"pair": pair, "a": a, "b": b, "a_ms": t(fns[a]), "b_ms": t(fns[b]),
           "seq_ms": t(sequential(fns[a], fns[b])), "par_ms": t(concurrent(fns[a], fns[b])),
           "par_a_hi_ms": t(concurrent(fns[a], fns[b], "a")), "par_b_hi_ms": t(concurrent(fns[a], fns[b], "b"))}
    row["gain_ms"] = row["seq_ms"] - min(row["par_ms"], row["par_a_hi_ms"], row["par_b_hi_ms"])
    row["hidden_pct"] = 100.0 * row["gain_ms"] / min(row["a_ms"], row["b_ms"])
    return row


def markdown_table(rows: list[dict]) -> list[str]:
    lines = ["| A \\|\\| B | SMs carved out of cuBLAS | A alone | B alone | A then B | A \\|\\| B | A high priority "
             "| B high priority | gain (best of the three) | of the shorter | gain against A then B uncarved |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        times = (f"{r[k]:.3f} ms" for k in ("a_ms", "b_ms", "seq_ms", "par_ms", "par_a_hi_ms", "par_b_hi_ms", "gain_ms"))
        uncarved = "" if r["gain_vs_uncarved_ms"] is None else f"{r['gain_vs_uncarved_ms']:.3f} ms"
        lines.append(md_row([f"{r['a']} \\|\\| {r['b']}", str(r["sm_carveout"]), *times, f"{r['hidden_pct']:.0f}%",
                             uncarved]))
    return lines


def plot(rows: list[dict], env: dict, path: Path, title: str) -> None:
    plt = pyplot()
    bars = [("a_ms", "A alone"), ("b_ms", "B alone"), ("seq_ms", "A then B"), ("par_ms", "A || B"),
            ("par_a_hi_ms", "A || B, A high priority"), ("par_b_hi_ms", "A || B, B high priority")]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    width = 0.8 / len(bars)
    for k, (key, label) in enumerate(bars):
        ax.bar([i + k * width for i in range(len(rows))], [r[key] for r in rows], width, label=label)
    ax.set_xticks([i + width * (len(bars) - 1) / 2 for i in range(len(rows))])
    ax.set_xticklabels([r["pair"].replace("||", " || ") + (f"\n{r['sm_carveout']} SMs carved" if r["sm_carveout"] else "")
                        for r in rows], fontsize=8)
    ax.set_ylabel("ms per call (CUDA-graph replay)")
    ax.set_title(f"{title}\n{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder (stream_overlap.csv, .md, .png)")
    ap.add_argument("--config", default=str(CONFIG), help="tables, multi-hot sizes, D, cross net and top MLP")
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--pairs", default=",".join(PAIRS), help=f"comma list of A||B from {PAIRS}")
    ap.add_argument("--rows-cap", type=int, default=None, help="cap every table at this many rows")
    ap.add_argument("--calls", type=int, default=5, help="calls per captured graph")
    ap.add_argument("--windows", type=int, default=7, help="timed windows; the median is reported")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls before capture")
    ap.add_argument("--smoke", action="store_true", help="tables capped at 1000 rows, batch 2, one window")
    ap.add_argument("--sm-carveouts", default="0",
                    help="comma list of SM counts cuBLAS leaves free; every pair is measured at each (docstring)")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    outputs = claim_outputs(ap, args, args.out, ["stream_overlap.csv", "stream_overlap.md", "stream_overlap.png"])
    try:
        args.sm_carveouts = [int(c) for c in args.sm_carveouts.split(",") if c.strip()]
        if not args.sm_carveouts or min(args.sm_carveouts) < 0:
            raise ValueError
    except ValueError:
        ap.error(f"--sm-carveouts {args.sm_carveouts!r}: a comma list of SM counts >= 0")
    pairs = [p.strip() for p in args.pairs.split(",") if p.strip()]
    unknown = [p for p in pairs if p not in PAIRS + COLLECTIVE_PAIRS]
    if unknown or not pairs:
        ap.error(f"--pairs: unknown {unknown or pairs}; choose from {PAIRS + COLLECTIVE_PAIRS}")
    if args.smoke:
        # on a GPU the warm-up compiles the kernels before the capture (compiling inside a capture fails)
        args.rows_cap, args.batch, args.calls, args.windows = 1000, 2, 1, 1
        args.warmup = 2 if torch.cuda.is_available() else 0
    try:
        cfg = json.loads(Path(args.config).read_text())["model"]
        cards, hotness, dim = cfg["cardinalities"], cfg["multi_hot_sizes"], int(cfg["embedding_dim"])
        width, top = (len(cards) + 1) * dim, cfg["top_mlp"]
        rank, layers = int(cfg["cross_rank"]), int(cfg["cross_layers"])
        params = dense_params(cfg, width)
    except (OSError, ValueError, KeyError, TypeError) as e:
        ap.error(f"--config {args.config}: needs a DCN model with cardinalities, multi_hot_sizes, embedding_dim, "
                 f"cross_rank, cross_layers, bottom_mlp and top_mlp ({e!r})")
    if args.rows_cap:
        cards = [min(int(c), args.rows_cap) for c in cards]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if "WORLD_SIZE" in os.environ:  # torchrun: one GPU a rank
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        rows, t = run_pairs(pairs, cards, hotness, dim, width, rank, layers, top, params, device, args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if rows is None:  # not rank 0
        return 0
    env = environment(device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    title = f"Stream overlap at MLPerf DLRM-DCNv2 shapes, batch {args.batch}"
    world = rows[0]["world"] if rows else 1
    note = (f"Tables: {t.rows:,} rows x {dim} bf16; {args.calls} calls a graph, median of {args.windows} windows. "
            + ("CPU smoke run: no streams, each time one call (a check of the script, not a measurement)."
               if device.type == "cpu" else "A || B: A and B on two streams forked from the capturing one.")
            + (f" {world} ranks: each time the slowest rank's." if world > 1 else
               " One process: a2a and allreduce are local copies of their bytes (no collective)."
               if any(p in COLLECTIVE_PAIRS for p in pairs) else ""))
    write_csv(out / "stream_overlap.csv", rows, KEYS, env)
    (out / "stream_overlap.md").write_text(markdown(title, [env_line(env), note], markdown_table(rows)))
    plot(rows, env, out / "stream_overlap.png", title)
    outputs.report()
    return 0


def run_pairs(pairs, cards, hotness, dim, width, rank, layers, top, params, device, args):
    """Time every pair on this rank (all ranks in lockstep); rank 0 gets ``(rows, tables)``, the others ``(None,
    tables)``."""
    t = Tables(cards, hotness, dim, torch.bfloat16, device)
    x = Inputs(t, args.batch, device)
    dense = DenseShapes(args.batch, width, rank, layers, top[:-1], device)
    comm = Collectives(args.batch, len(cards), dim, params, device)
    fns = parts(t, x, dense, comm)
    rows = []
    for pair in pairs:
        for carveout in args.sm_carveouts:
            with sm_carveout(carveout):
                r = measure(pair, fns, args)
            rows.append({**r, "sm_carveout": carveout, "batch": args.batch, "table_rows": t.rows, "world": comm.world})
            if not dist.is_initialized() or dist.get_rank() == 0:
                print(f"{pair:18s} carve {carveout:3d}  A {r['a_ms']:.3f}  B {r['b_ms']:.3f}  A+B {r['seq_ms']:.3f}  "
                      f"A||B {r['par_ms']:.3f}  (A hi {r['par_a_hi_ms']:.3f}, B hi {r['par_b_hi_ms']:.3f})  "
                      f"gain {r['gain_ms']:.3f} ms", flush=True)
    uncarved = {r["pair"]: r["seq_ms"] for r in rows if r["sm_carveout"] == 0}
    for r in rows:
        best = min(r["par_ms"], r["par_a_hi_ms"], r["par_b_hi_ms"])
        r["gain_vs_uncarved_ms"] = uncarved[r["pair"]] - best if r["pair"] in uncarved else None
    if dist.is_initialized() and dist.get_rank() != 0:
        return None, t
    return rows, t


if __name__ == "__main__":
    sys.exit(main())
