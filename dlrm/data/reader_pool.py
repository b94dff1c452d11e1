"""The parquet loader's reader threads, which give way to the training thread on a busy host.

The training thread launches the step; while it waits for a core, the device can run out of queued work. With one
reader a core (multi-hot rows) and pyarrow's own pool of one thread a core beside them, the host has twice as many
busy threads as cores. Measured on the 16-core H200 host, MLPerf DLRM-DCNv2 streamed from LZ4 slot files at
``train.log_every`` 10 (benchmarks/results/stream_nice_mlperf.md, two runs each; each logging window then read at its
own step, where the device's queue empties): 2.74-2.92M samples/s as it was, 3.15-3.16M with the readers at a lower
priority and without pyarrow's pool, 3.30M with the data in device memory. Since the trainer reads the window one step
late, streaming at 10 trained at 3.14-3.24M, and at ``log_every`` 100 (the config's own) at 3.28-3.32M, beside 3.33M
from device memory (results/read_late_mlperf.md, stream_defaults_mlperf.md). One-hot rows keep pyarrow's pool, and
their readers their priority (`lower_readers`).
"""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

READER_NICENESS = 10
"""How much the reader threads' nice value is raised above the thread that makes the pool (at most to 19)."""


def lower_priority(by: int = READER_NICENESS) -> None:
    """Raise the calling thread's nice value by `by` (Linux, where nice values are per thread and raising one
    needs no privilege; elsewhere ``PRIO_PROCESS`` would name a process, so nothing is done)."""
    if sys.platform != "linux":
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
    except OSError:  # a sandbox that forbids it: the readers keep the training thread's priority
        pass


def reader_pool(threads: int, lower: bool = True) -> ThreadPoolExecutor:
    """`threads` reader threads ("parquet-read-N"), at a lower scheduling priority than the caller's if `lower`."""
    return ThreadPoolExecutor(threads, thread_name_prefix="parquet-read", initializer=lower_priority if lower else None)


def lower_readers(arrow_threads: bool) -> bool:
    """Whether the reader threads run below the training thread: only where they decode alone (no pyarrow pool:
    multi-hot rows, where lowering them was measured to help). Beside pyarrow's pool, whose threads keep the caller's
    priority, lowered readers only give cores to it: one-hot Kaggle rows streamed at batch 65536 (4 readers, the
    loader the limit) trained at 21.8-23.3M samples/s lowered against 24.0-25.2M not on one H200 host
    (results/read_late_kaggle2.md), 29.1M, 25.0M against 28.1M, 26.7M on another (stream_onehot_nice_kaggle.md)."""
    return not arrow_threads


def default_arrow_threads(multi_hot: bool) -> bool:
    """Whether each reader also spreads its row group's columns over pyarrow's own pool, by default: for one-hot
    rows, whose few readers leave cores to it; not for multi-hot rows, whose readers (one a core) already fill
    them: pyarrow's pool then only competes with the training thread (its threads are not ours to lower), and
    the loader alone was no faster with it (results/loader_codecs_mlperf_ab.md)."""
    return not multi_hot
