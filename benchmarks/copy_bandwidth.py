"""The copy bandwidth the kernel benchmarks divide by, measured each way they measure it.

    python benchmarks/copy_bandwidth.py --out benchmarks/results --name copy_bandwidth

`benchmarks/kernels.py` times one ``dst.copy_(src)`` of 1 GiB at a time with ``triton.testing.do_bench`` (an L2
flush before each call); `benchmarks/pooled_embedding.py` replays a CUDA graph of back-to-back copies (~20 ms of
work). The two gave 3,001 and 2,429 GB/s in different runs. This times the same copy, in one process, with:

* ``do_bench``: `triton.testing.do_bench` (what kernels.py's copy reference uses);
* ``do_bench_cudagraph``: `triton.testing.do_bench_cudagraph` (what kernels.py's ``--timing graph`` kernels use);
* ``graph_replay``: `_common.graph_replay_windows` (what pooled_embedding.py and the sweeps use, kernels and copy);
* ``event_loop``: CUDA events around ``--loop`` plain back-to-back launches (`pooled_embedding.copy_bandwidth`'s
  copy reference since the graph replay of 1 GiB copies was found slow).

GB/s = bytes read + written / time. Writes ``<name>.csv`` / ``.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.append(str(Path(__file__).resolve().parent))

import pooled_embedding as pe  # noqa: E402
from _common import env_line, environment, graph_replay_windows, markdown, md_row, write_csv  # noqa: E402
from _common import add_overwrite, claim_outputs  # noqa: E402

KEYS = ["mib", "timer", "ms", "gbps"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", default="copy_bandwidth")
    ap.add_argument("--mib", default="256,1024,4096", help="copy sizes in MiB (comma list)")
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--loop", type=int, default=20, help="back-to-back copies per event_loop window")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    outputs = claim_outputs(ap, args, args.out, [f"{args.name}.csv", f"{args.name}.md"])
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    env = environment(torch.device("cuda"))
    rows = []
    for mib in (int(m) for m in args.mib.split(",")):
        src = torch.empty(mib * 2**20 // 4, device="cuda").uniform_()
        dst = torch.empty_like(src)

        def fn():
            dst.copy_(src)

        timers = {
            "do_bench": lambda: float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")),
            "do_bench_cudagraph": lambda: float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")),
            "graph_replay": lambda: statistics.median(graph_replay_windows(fn, 0, args.windows, 2)[0]),
            "event_loop": lambda: pe.event_loop_ms(fn, args.loop, args.windows),
        }
        for name, timer in timers.items():
            ms = timer()
            rows.append(dict(mib=mib, timer=name, ms=ms, gbps=2 * mib * 2**20 / (ms / 1e3) / 1e9))
            print(rows[-1], flush=True)
        src = dst = None  # free them before the next size
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / f"{args.name}.csv", rows, KEYS, env)
    table = ["| MiB | timer | ms | GB/s |", "| ---: | --- | ---: | ---: |"]
    table += [md_row([r["mib"], r["timer"], f"{r['ms']:.4f}", f"{r['gbps']:,.0f}"]) for r in rows]
    text = markdown("Copy bandwidth (`dst.copy_(src)`) by timer", [env_line(env)], table)
    (out / f"{args.name}.md").write_text(text)
    print(text, end="")
    outputs.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
