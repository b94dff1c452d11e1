"""Ranks started through `sys.executable` (one `-c` process a rank) instead of `torch.multiprocessing.spawn`: the
suite's prewarmed interpreter (tests/prewarm/launch.py) serves them, so a rank does not import torch again (~2.3 s of
CPU a rank, most of a two-rank check's time). `failures_on_ranks` is `tests.spawned_ranks.failures_on_ranks` so
started: each rank runs the same `tests.spawned_ranks._worker` (its process group, the cases in order, an
AssertionError kept as the case's failure). A rank's output goes where the test's goes, as a spawned rank's does."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Callable, Sequence

# A rank's program: the parent's sys.path (as multiprocessing's spawn gives its children), then the function and its
# arguments unpickled (a function by reference: its module imported, as under spawn), then `func(rank, *args,
# results)`; the dict `results` it filled is written back (pickled) even when it raised.
_RANK = r"""
import pickle, sys
rank, request, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
with open(request, "rb") as f:
    sys.path[:] = pickle.load(f)
    func, args = pickle.load(f)
results = {}
try:
    func(rank, *args, results)
finally:
    with open(out, "wb") as f:
        pickle.dump(results, f)
"""


def call_on_ranks(func: Callable, args: tuple, world: int, where: Path, timeout: float) -> tuple[dict, list[int]]:
    """``func(rank, *args, results)`` in a process of its own for each of ``world`` ranks (``func`` a module-level
    function, ``results`` a dict the rank fills; request and results files under ``where``): every rank's results
    merged, and each rank's exit code (a rank still running after ``timeout`` s is killed: -9)."""
    where = Path(where)
    request = where / "ranks-request.pkl"
    with open(request, "wb") as f:
        pickle.dump(list(sys.path), f)
        pickle.dump((func, tuple(args)), f)
    outs = [where / f"ranks-result-{r}.pkl" for r in range(world)]
    for out in outs:
        out.unlink(missing_ok=True)
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), str(request), str(outs[r])], cwd=os.getcwd())
             for r in range(world)]
    try:
        for p in procs:
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
    finally:
        for p in procs:  # only the processes started here
            if p.poll() is None:
                p.kill()
                p.wait()
    got: dict = {}
    for out in outs:
        if out.exists():
            with open(out, "rb") as f:
                got.update(pickle.load(f))
    return got, [p.returncode for p in procs]


def _failures_worker(rank: int, check: Callable, cases: list, world: int, init_file: str, backend: str,
                     results: dict) -> None:
    from tests.spawned_ranks import _worker

    _worker(rank, check, cases, world, init_file, results, backend)


def failures_on_ranks(check: Callable, cases: Sequence[tuple], world: int, tmp_path: Path,
                      backend: str = "gloo", timeout: float = 600) -> dict:
    """As `tests.spawned_ranks.failures_on_ranks`: ``check(rank, *case)`` for every case on each of ``world`` ranks of
    ``backend`` ("nccl": rank r on GPU r); the ``(rank, str(case))`` that failed, with their messages ("no result": a
    case that never reported). A rank that raised anything but an AssertionError, or died, fails the call, as
    ``mp.spawn(join=True)`` raised."""
    got, codes = call_on_ranks(_failures_worker, (check, list(cases), world, str(Path(tmp_path) / "init"), backend),
                               world, tmp_path, timeout)
    if any(codes):
        raise RuntimeError(f"ranks exited with {codes} (their output: the test's captured output)")
    expected = {(r, str(c)) for r in range(world) for c in cases}
    return {k: got.get(k, "no result") for k in expected if got.get(k) != "ok"}
