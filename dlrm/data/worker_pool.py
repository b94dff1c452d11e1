"""Worker process pools that leave Ctrl-C to the main process, from the workers' first instruction on.

A terminal's Ctrl-C sends SIGINT to the whole process group. The data CLIs (`dlrm.preprocess`, `dlrm.data.synthetic
--workers`, `dlrm.data.mlperf_import`) handle it in the main process: it stops the pool and prints one line. A worker
must therefore never die of it, or it prints a traceback of its own (and the pool's shutdown may wait on it). Ignoring
SIGINT in the pool's initializer is not enough: a "spawn" worker first starts Python and imports the parent's main
module (numpy, pyarrow: seconds on a loaded machine), and a Ctrl-C in that window was a `KeyboardInterrupt` traceback
in every one of 8 tries on a 16-core machine running other work (2026-11-30).

`start_pool` closes the window: every worker is started at once, while the starting thread blocks SIGINT, so each
begins with SIGINT blocked (a child inherits its parent thread's signal mask); its first step ignores SIGINT, which
discards one that arrived meanwhile. A barrier in the workers' initializer keeps any worker from taking a task before
all are started: the pool starts a worker only when none is idle, so a worker idle before the last one is started would
leave that one to be started later, on demand, outside the blocked mask. A Ctrl-C in the main process while the
workers start is held for those milliseconds, then raised there as usual.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import resource_tracker
from typing import Any, Callable, Optional

__all__ = ["start_pool"]

# How long a started worker waits for the others to start before it gives up (the pool then reports itself broken):
# far above the seconds a worker takes to import its modules on a loaded machine.
START_TIMEOUT_S = 600.0
# How often a worker checks that the process that started it is still alive (`_exit_with_parent`).
PARENT_POLL_S = 0.2


def _exit_with_parent(parent: int) -> None:
    """Exit this worker as soon as `parent` (the pool's process) is gone. A main process killed outright (SIGKILL:
    the OOM killer, ``kill -9``) stops nothing: its workers were reparented and ran on for good, idle on their own
    call queue, each holding its memory and the caller's stdout/stderr (``| tee``, ``subprocess.run`` hung)."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(1)  # at once, mid-task too: the tools' temporary files of an unfinished write are removed or redone


def _start_worker(barrier, initializer: Optional[Callable[..., Any]], initargs: tuple, parent: int = 0) -> None:
    """The workers' initializer: ignore SIGINT (one pending is dropped), exit with the `parent` process (its pid),
    wait for all workers, then ``initializer``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if parent:
        threading.Thread(target=_exit_with_parent, args=(parent,), name="exit-with-parent", daemon=True).start()
    barrier.wait(START_TIMEOUT_S)
    if initializer is not None:
        initializer(*initargs)


def _started() -> None:
    """The task that makes the pool start a worker (it starts one per task while none is idle)."""


def start_pool(workers: int, initializer: Optional[Callable[..., Any]] = None,
               initargs: tuple = ()) -> ProcessPoolExecutor:
    """A "spawn" `ProcessPoolExecutor` of ``workers`` processes, all started before it is returned, none of which
    ever handles SIGINT; ``initializer(*initargs)`` runs in each after every worker has started.

    Args:
        workers: the number of worker processes (>= 1).
        initializer: run once in each worker (module-level, picklable by name), or None.
        initargs: its arguments (picklable).

    Example::

        pool = start_pool(4, _init_worker, (teacher,))
        try:
            results = list(pool.map(work, items))
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    ctx = multiprocessing.get_context("spawn")
    # Starting the resource tracker (on a process's first spawn) ends by unblocking SIGINT in the calling thread,
    # which would undo the mask below: start it first.
    resource_tracker.ensure_running()
    barrier = ctx.Barrier(workers)
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_start_worker,
                               initargs=(barrier, initializer, initargs, os.getpid()))
    try:
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            for _ in range(workers):
                pool.submit(_started)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # a Ctrl-C held meanwhile is raised from here on
    except BaseException:
        barrier.abort()  # workers waiting for one that was never started give up (their pool breaks) instead of hanging
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    return pool
