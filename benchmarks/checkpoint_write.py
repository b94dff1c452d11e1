"""Where a large checkpoint's write goes: the device-to-host copy, torch.save's CRC-32, the disk.

    python benchmarks/checkpoint_write.py --gib 16 --dir /tmp --out benchmarks/results --name checkpoint_write

MLPerf DLRM-DCNv2's one-process checkpoint (53.2 GB, its tables one bf16 storage on the GPU) took 95 s on an H200
machine (2026-12-04): ~40 s before the first byte reached the disk, then ~1.3 GB/s. This times, for one CUDA tensor
of ``--gib`` GiB (one storage, as the tables are):

* ``disk``: ``os.write`` of a host buffer that size in 64 MiB pieces, then ``fsync`` (what the disk takes);
* ``d2h pageable``: ``tensor.cpu()`` (what torch.save does with a CUDA storage by default);
* ``d2h pinned``: a pinned host buffer's allocation, then the copy into it (torch's
  ``use_pinned_memory_for_d2h``);
* ``save ...``: ``torch.save({"model": {"t": tensor}})`` to a file, flushed and fsync'ed, with torch's CRC-32 of each
  record on or off (`torch.serialization.set_crc32_options`: torch.load never checks it) and the pinned copy on or
  off;
* ``save streamed``: what `dlrm.checkpoint.write_atomic` does (`dlrm.stream_save`): the archive first, then the
  bytes in 64 MiB chunks, each chunk's copy to a pinned buffer beside the previous chunk's write.

GB/s = bytes / seconds. Writes ``<name>.csv`` / ``.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent))

from _common import (add_overwrite, claim_outputs, date_stamp, environment, env_line, markdown, md_row,  # noqa: E402
                     write_csv)


def _seconds(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def disk_write(path: Path, nbytes: int) -> float:
    piece = torch.ones(64 << 20, dtype=torch.uint8).numpy().tobytes()
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, piece[:min(left, len(piece))])
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def save(path: Path, x: torch.Tensor, crc: bool, pinned: bool) -> float:
    from torch.utils.serialization import config

    torch.serialization.set_crc32_options(crc)
    config.save.use_pinned_memory_for_d2h = pinned
    try:
        start = time.perf_counter()
        with open(path, "wb") as f:
            torch.save({"model": {"t": x}}, f)
            f.flush()
            os.fsync(f.fileno())
        seconds = time.perf_counter() - start
    finally:
        torch.serialization.set_crc32_options(True)
        config.save.use_pinned_memory_for_d2h = False
    path.unlink()
    return seconds


def streamed(path: Path, x: torch.Tensor) -> float:
    """What `dlrm.checkpoint.write_atomic` does since 2026-12-04: the archive with the bytes' space left, then the
    bytes chunk by chunk through two pinned buffers (`dlrm.stream_save`), CRC-32s off (`dlrm.fast_save`)."""
    from dlrm.fast_save import fast_save
    from dlrm.stream_save import stream_save

    state = {"model": {"t": x}}
    start = time.perf_counter()
    with open(path, "wb") as f, fast_save(state):
        if not stream_save(state, f, f, str(path), lambda n: None):
            raise SystemExit("stream_save fell back to torch.save: its records did not match")
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=16.0, help="the tensor's GiB (default 16)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp"), help="where the files are written (and removed)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--name", default="checkpoint_write")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    outputs = claim_outputs(ap, args, args.out, [f"{args.name}.csv", f"{args.name}.md"])  # (before measuring)
    device = torch.device("cuda")
    env = environment(device)
    nbytes = int(args.gib * 2**30) // 2 * 2
    x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    rows = []

    def add(what: str, seconds: float, note: str = "") -> None:
        rows.append({"what": what, "bytes": nbytes, "seconds": round(seconds, 2),
                     "GB/s": round(nbytes / seconds / 1e9, 2), "note": note})
        print(f"{what:32s} {seconds:7.2f} s {nbytes / seconds / 1e9:6.2f} GB/s {note}", flush=True)

    add("disk (os.write + fsync)", disk_write(args.dir / ".disk_probe", nbytes))
    add("d2h pageable (tensor.cpu())", _seconds(lambda: x.cpu()))
    host: list[torch.Tensor] = []
    alloc = _seconds(lambda: host.append(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)))
    add("pinned allocation", alloc)
    add("d2h pinned (copy only)", _seconds(lambda: host[0].copy_(x.view(torch.uint8).view(-1))))
    del host[:]
    for crc, pinned in ((True, False), (False, False), (True, True), (False, True)):
        add(f"save crc {'on' if crc else 'off'}, d2h {'pinned' if pinned else 'pageable'}",
            save(args.dir / ".save_probe.pt", x, crc, pinned))
    add("save streamed (dlrm.stream_save)", streamed(args.dir / ".stream_probe.pt", x), "64 MiB chunks, crc off")

    args.out.mkdir(parents=True, exist_ok=True)
    keys = ["what", "bytes", "seconds", "GB/s", "note"]
    write_csv(args.out / f"{args.name}.csv", rows, keys, extra=env)
    table = [md_row(keys), md_row(["---"] * len(keys)), *(md_row([r[k] for k in keys]) for r in rows)]
    text = markdown(f"A {args.gib:g} GiB CUDA tensor's checkpoint write, by part ({date_stamp()})",
                    [env_line(env), f"Files under {args.dir}."], table)
    (args.out / f"{args.name}.md").write_text(text)
    outputs.report()


if __name__ == "__main__":
    main()
