"""Run a check on several ranks in child processes (gloo on the CPU, or NCCL with one GPU a rank), every case in the
same order on every rank, so that the collectives inside pair up; what failed comes back to the test as one dict."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, check: Callable, cases: Sequence[tuple], world: int, init_file: str, results,
            backend: str) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for case in cases:
            try:
                check(rank, *case)
                results[(rank, str(case))] = "ok"
            except AssertionError as e:
                results[(rank, str(case))] = f"AssertionError: {e}"
    finally:
        dist.destroy_process_group()


def failures_on_ranks(check: Callable, cases: Sequence[tuple], world: int, tmp_path: Path,
                      backend: str = "gloo") -> dict:
    """``check(rank, *case)`` for every case on each of ``world`` ranks of ``backend`` ("nccl": rank r on GPU r, its
    current device) (``check`` a module-level function, as the child processes import it); the ``(rank, case)`` that
    failed, with their messages. A case that never reported (a rank died) counts as failed."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(check, list(cases), world, str(tmp_path / "init"), results, backend), nprocs=world,
                 join=True)
        got = dict(results)
    expected = {(r, str(c)) for r in range(world) for c in cases}
    return {k: got.get(k, "no result") for k in expected if got.get(k) != "ok"}
