"""A large checkpoint's load: read whole (torch.load's default) or memory-mapped, time and the process's own memory.

    python benchmarks/checkpoint_load.py --gib 2 --device cpu --dir /tmp --out benchmarks/results \
        --name checkpoint_load_cpu

A one-process resume or ``--eval-only`` of MLPerf DLRM-DCNv2 read its 53 GB checkpoint whole into host memory before
copying the tables into the model (and a resume read it twice). This writes a checkpoint of one fp32 tensor of ``--gib``
GiB (one storage, as the tables are) with `dlrm.checkpoint.write_atomic`, then in a fresh process for each mode, with
the file's pages dropped from the page cache first (``posix_fadvise(DONTNEED)``: a cold read), loads it and copies the
tensor into a model tensor already allocated on ``--device``:

* ``plain``: `dlrm.checkpoint.load_checkpoint` as before (torch.load reads the file whole);
* ``mapped``: ``load_checkpoint(mmap=True)``: the tensor a view of the file's pages, read by the copy;
* ``mapped + read ahead first``: also `dlrm.mapped_load.read_ahead` outside `dlrm.mapped_load.reading`: the bytes
  read into the page cache with a progress bar, then copied (what a resume, a merge and ``--eval-only`` did until
  2026-12-05);
* ``mapped + read ahead``: the same within `reading`, as they do now: the reads on a thread of their own beside the
  copy, `reading` waiting for them at its end (counted in ``copy_s``).

It reports the load's and the copy's seconds and the growth of the process's anonymous memory (RssAnon: its own pages,
not the page cache's) with the loaded state still held, the model tensor allocated before. Writes ``<name>.csv`` /
``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent))

from _common import (add_overwrite, claim_outputs, date_stamp, environment, env_line, markdown, md_row,  # noqa: E402
                     write_csv)

MODES = ("plain", "mapped", "mapped + read ahead first", "mapped + read ahead")


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def checkpoint_state(x: torch.Tensor) -> dict:
    """A valid one-process checkpoint (`dlrm.checkpoint_schema`) whose model holds `x` alone."""
    import dlrm.checkpoint as ckpt
    from dlrm.config import Config

    return {"model": {"t": x}, "optimizers": [], "schedulers": [], "position": {"step": 1, "epoch": 0, "batch": 1},
            "rng": ckpt.rng_state(), "cardinalities": [1], "config": Config().to_dict()}


def one(mode: str, path: Path, device: str) -> dict:
    """Load `path` in `mode` and copy its tensor into one on `device` (run in a fresh process: `main` starts it)."""
    import dlrm.checkpoint as ckpt
    from contextlib import nullcontext

    from dlrm.mapped_load import read_ahead, reading

    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the file's clean pages dropped: a cold read
    finally:
        os.close(fd)
    dev = torch.device(device)
    nbytes = path.stat().st_size
    dst = torch.zeros(nbytes // 4, dtype=torch.float32, device=dev)  # (zeroed: its pages allocated before the count)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    base = rss_anon()
    start = time.perf_counter()
    with reading([path]) if mode == "mapped + read ahead" else nullcontext():
        if mode == "plain":
            state = ckpt.load_checkpoint(path)
        else:
            state = ckpt.load_checkpoint(path, mmap=True)
            if mode.startswith("mapped + read ahead"):
                read_ahead(state, path.name, least=0)
        loaded = time.perf_counter()
        src = state["model"]["t"]
        dst[: src.numel()].copy_(src)
        sync()
    done = time.perf_counter()
    return {"load_s": round(loaded - start, 3), "copy_s": round(done - loaded, 3), "total_s": round(done - start, 3),
            "anon_growth_GiB": round((rss_anon() - base) / 2**30, 3)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0, help="the tensor's GiB (default 2)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where the model is")
    ap.add_argument("--dir", type=Path, default=Path("/tmp"), help="where the checkpoint is written (and removed)")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each mode (default 2)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--name", default="checkpoint_load")
    ap.add_argument("--one", nargs=2, metavar=("MODE", "PATH"), help=argparse.SUPPRESS)  # (a measuring child)
    add_overwrite(ap)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one[0], Path(args.one[1]), args.device)))
        return
    outputs = claim_outputs(ap, args, args.out, [f"{args.name}.csv", f"{args.name}.md"])  # (before measuring)
    import dlrm.checkpoint as ckpt

    env = environment(torch.device(args.device))
    path = args.dir / ".checkpoint_load_probe.pt"
    numel = int(args.gib * 2**30) // 4
    ckpt.write_atomic(path, checkpoint_state(torch.rand(numel)), progress=False)
    rows = []
    try:
        for repeat in range(args.repeats):
            for mode in MODES:
                child = subprocess.run([sys.executable, __file__, "--device", args.device, "--out", str(args.out),
                                        "--one", mode, str(path)], capture_output=True, text=True, check=True)
                row = {"mode": mode, "repeat": repeat, "bytes": path.stat().st_size,
                       **json.loads(child.stdout.strip().splitlines()[-1])}
                rows.append(row)
                print(f"{mode:22s} load {row['load_s']:7.2f} s  copy {row['copy_s']:7.2f} s  total "
                      f"{row['total_s']:7.2f} s  anonymous memory +{row['anon_growth_GiB']:.2f} GiB", flush=True)
    finally:
        path.unlink(missing_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    keys = ["mode", "repeat", "bytes", "load_s", "copy_s", "total_s", "anon_growth_GiB"]
    write_csv(args.out / f"{args.name}.csv", rows, keys, extra=env)
    table = [md_row(keys), md_row(["---"] * len(keys)), *(md_row([r[k] for k in keys]) for r in rows)]
    text = markdown(f"A {args.gib:g} GiB checkpoint loaded into a model on {args.device}, read whole or memory-mapped "
                    f"({date_stamp()})",
                    [env_line(env), f"Cold reads (the file's pages dropped first) from {args.dir}; anonymous memory: "
                     "RssAnon's growth with the loaded state held (the page cache's pages are not counted)."], table)
    (args.out / f"{args.name}.md").write_text(text)
    outputs.report()


if __name__ == "__main__":
    main()
