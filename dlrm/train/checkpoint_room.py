"""Room on the disk for the checkpoints a training run will write, weighed before its first step.

A checkpoint is written whole beside the ones kept (`checkpoint.keep`), and only then is the oldest deleted
(`dlrm.checkpoint.save_checkpoint`): a disk that cannot hold the next one fails the run at that save, and every step
since the last checkpoint is lost; without ``checkpoint.every``, the whole run. Measured on an H100 machine's 64 GB
disk (2026-12-05, session 86, `benchmarks/results/gpu_tests_2026-12-05_s86.md`): configs/mlperf-dcnv2.json resumed
in place beside its 53.2 GB step-20 checkpoint trained its 22 steps, wrote 14.6 GB of step 42's and stopped with
"No space left on device" (exit 2), nothing of those steps saved. So the start weighs them: the size of a checkpoint
(the model's state and its optimizers', those an optimizer makes at its first step counted before they exist:
`dlrm.distributed.shutdown_grace.state_bytes`), the run's checkpoint steps (every ``checkpoint.every`` steps and
the last) and the disk's free bytes where they go (``checkpoints/``, which may be a link to another disk). Short of
room for the first one: refused, one line (exit 2: ``file system error: <dir>: ...``), before any step; short of room
for a later one (``checkpoint.keep`` of them kept, one more being written): a warning naming its step. With
``checkpoint.check_room: false`` the refusal is a warning too (a file system whose free bytes do not say what it
will take: compressed, deduplicated, a quota counted elsewhere).

Under torchrun each rank writes its shard into the run's one ``checkpoints/``: the ranks whose directory is on the
same file system of the same host are weighed together, every rank reaching the same verdict from the same gathered
numbers. Not counted: a ``best.pt`` that is a copy rather than a link (an evaluation's best off the checkpoint steps),
and a kept step checkpoint whose bytes a ``best.pt`` link holds after its file is deleted.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Iterable, Optional

import torch
from loguru import logger

from dlrm import checkpoint as ckpt
from dlrm.distributed.env import DistEnv
from dlrm.distributed.shutdown_grace import state_bytes
from dlrm.train.host_memory import host_key


def checkpoint_steps(start: int, total: int, every: Optional[int]) -> list[int]:
    """The steps after `start` at which a run of `total` steps writes a checkpoint: each multiple of `every` (None:
    none) and the last step."""
    steps = set(range((start // every + 1) * every, total + 1, every)) if every else set()
    if total > start:
        steps.add(total)
    return sorted(steps)


def first_short_save(free: int, size: int, existing: int, keep: int, steps: Iterable[int]) -> Optional[tuple[int, int]]:
    """(step, the free bytes it finds) of the first save among `steps` that the disk cannot hold, or None.

    Args:
        free: the disk's free bytes now.
        size: the bytes of one checkpoint.
        existing: the step checkpoints already there (this run's, of `size` each: the same model).
        keep: ``checkpoint.keep``.
        steps: the save steps, in order.

    Example::

        >>> first_short_save(free=100, size=40, existing=0, keep=1, steps=[10, 20, 30])  # 2 on disk at each save
        >>> first_short_save(free=100, size=40, existing=0, keep=2, steps=[10, 20, 30])  # 3 at the third
        (30, 20)
    """
    kept = existing
    for step in steps:
        if free < size:
            return step, free
        free -= size  # written whole beside the kept ones
        kept += 1
        while kept > keep:  # then the oldest deleted
            free += size
            kept -= 1
    return None


def _gb(n: int) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"


def check_checkpoint_room(run_dir: Path, keep: int, every: Optional[int], start: int, total: int,
                          model: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer], env: DistEnv = DistEnv(),
                          refuse: bool = True) -> None:
    """Refuse (an OSError ENOSPC naming the directory; a warning where not `refuse`) a run whose first checkpoint
    after step `start` cannot fit in the free bytes of ``<run_dir>/checkpoints``; warn where a later one cannot. Every
    rank calls it (one gather)."""
    steps = checkpoint_steps(start, total, every)
    directory = ckpt.checkpoint_dir(run_dir)
    where = directory if directory.is_dir() else run_dir  # (made at the first save, on run_dir's disk)
    size = state_bytes(model, optimizers)
    mine = (host_key(), os.stat(where).st_dev, size, shutil.disk_usage(where).free)
    ranks = env.all_gather_object(mine)
    if not steps:
        return
    existing = len(ckpt.list_checkpoints(run_dir))
    # every rank weighs every group of ranks on one file system, so all reach the same verdict: the first short save
    groups = {(h, d): (free, sum(b for h2, d2, b, _ in ranks if (h2, d2) == (h, d))) for h, d, _, free in ranks}
    shorts = [(*s, need) for free, need in groups.values()
              if (s := first_short_save(free, need, existing, keep, steps))]
    if not shorts:
        return
    step, free, size = min(shorts)
    of = "the ranks' shards of " if env.distributed else ""
    what = (f"{directory}: no room for {of}the checkpoint at step {step}: each checkpoint is {_gb(size)}, written "
            f"whole before the oldest of the {keep} kept (checkpoint.keep) is deleted, and {_gb(free)} would be free")
    if step != steps[0]:
        if env.is_main:
            logger.warning(f"{what}: the run fails at that save, losing the steps since the one before (make room, "
                           f"lower checkpoint.keep, or train into a log.tb_dir on a disk with room)")
        return
    advice = ("make room, train into a log.tb_dir on a disk with room (or make checkpoints/ a link to one), or set "
              "checkpoint.check_room false where the free bytes do not say what a file takes")
    if not refuse:
        if env.is_main:
            logger.warning(f"{what}; going on: checkpoint.check_room is false (the save at step {step} may fail, "
                           f"losing every step before it)")
        return
    # (every rank raises it, from the same gathered numbers)
    raise OSError(errno.ENOSPC, f"{what.split(': ', 1)[1]}, refused before the first step: {advice}", str(directory))
