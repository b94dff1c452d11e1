"""Running the chunks: in this process, or in a worker pool fed by reader threads; recording each
finished chunk (done.jsonl, table statistics, checkpoints) in the main process."""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

from dlrm.data.preprocess.errors import BadLine
from dlrm.data.preprocess.stats import DistinctCounter
from dlrm.data.preprocess.worker import _ChunkResult, _process_chunk
from dlrm.errors import os_errors_named


class _RunState:
    """Main-process bookkeeping of finished chunks: done.jsonl, table statistics, checkpoints."""

    def __init__(self, progress_dir: Path, counter: DistinctCounter, covered: set, done: dict,
                 checkpoint_interval: float, max_new: int | None, dirty: bool = False):
        self.progress_dir = progress_dir
        self.counter = counter
        self.covered = covered
        self.done = done
        self.interval = checkpoint_interval
        self.max_new = max_new
        self.new = 0
        self.errors: list[tuple[tuple[int, int], BadLine]] = []
        self.interrupted = False
        self.bar = None
        self._log = open(progress_dir / "done.jsonl", "a")
        self._last_checkpoint = time.monotonic()
        self._dirty = dirty  # statistics the checkpoint lacks already (a resume's re-read shards)

    @property
    def stopping(self) -> bool:
        return bool(self.errors) or self.interrupted

    def handle(self, res: _ChunkResult) -> None:
        """Record a finished chunk (appended to done.jsonl and fsynced after its shards are in place),
        or keep its first bad line."""
        if self.interrupted:
            return  # like a kill: results after the stop are not recorded
        if res.error is not None:
            self.errors.append(((res.file_index, res.error.line or 0), res.error))
            return
        rec = res.record
        with os_errors_named(self.progress_dir / "done.jsonl"):  # (a write's error names no file)
            self._log.write(json.dumps(rec, separators=(",", ":")) + "\n")
            self._log.flush()
            os.fsync(self._log.fileno())
        key = (res.file_index, res.chunk_index)
        self.done[key] = rec
        # a chunk the checkpoint covers, redone for a shard damaged or missing since: its statistics are in the
        # counter already (`_load_checkpoint`), and vocabulary counts added twice would reach --min-frequency
        if key not in self.covered:
            self.counter.add_stats(res.stats or [])
            self.covered.add(key)
            self._dirty = True
        if self.bar is not None:
            self.bar.update(rec["lines"])
        self.new += 1
        if self.max_new is not None and self.new >= self.max_new:
            self.interrupted = True
            return
        self.checkpoint()

    def checkpoint(self, force: bool = False) -> None:
        """Save the table statistics when ``checkpoint_interval`` has passed (or ``force``)."""
        if not self._dirty or self.interrupted:
            return
        if force or self.interval <= 0 or time.monotonic() - self._last_checkpoint >= self.interval:
            self.counter.save(self.progress_dir / "stats.npz", sorted(self.covered))
            self._last_checkpoint = time.monotonic()
            self._dirty = False

    def close(self) -> None:
        self._log.close()


def _run_inline(make_tasks, n_files: int, state: _RunState) -> None:
    """Run every chunk in this process (``--workers 1``), stopping at the first bad line."""
    for f in range(n_files):
        for task in make_tasks(f):
            state.handle(_process_chunk(task))
            if state.stopping:
                return


def _run_pool(pool: ProcessPoolExecutor, make_tasks, files: list[int], workers: int, state: _RunState) -> None:
    """Feeder threads (one file at a time each; they decompress gzip inputs) submit chunks to the
    pool, at most 2 per worker in flight; this thread records the results.

    A bad line does not stop the chunks before it in input order: feeders run several files at once,
    so a later file's bad line can come back first, and the run must still report the first bad line
    in input order, as one worker does (``--on-bad-line stop``). Only the chunks after the earliest
    bad chunk seen so far (``limit``) are no longer started."""
    results: queue.Queue[Future] = queue.Queue()
    slots = threading.Semaphore(2 * workers)
    stop = threading.Event()
    lock = threading.Lock()
    outstanding = [0]
    limit: list[tuple[int, int] | None] = [None]  # (file, chunk) of the earliest chunk with a bad line
    file_queue: queue.Queue[int] = queue.Queue()
    for f in files:
        file_queue.put(f)

    def after_limit(f: int, c: int) -> bool:
        with lock:
            return limit[0] is not None and (f, c) > limit[0]

    def feed() -> None:
        while not stop.is_set():
            try:
                f = file_queue.get_nowait()
            except queue.Empty:
                return
            if after_limit(f, -1):
                continue  # a file after the bad line: not even decompressed
            for task in make_tasks(f):
                if after_limit(f, task.chunk_index):
                    break  # this chunk and the rest of the file lie after the bad line
                while not slots.acquire(timeout=0.1):
                    if stop.is_set():
                        return
                if stop.is_set() or after_limit(f, task.chunk_index):
                    slots.release()
                    if stop.is_set():
                        return
                    break
                with lock:
                    outstanding[0] += 1
                pool.submit(_process_chunk, task).add_done_callback(results.put)

    n_feeders = max(1, min(workers, len(files)))
    feeders = ThreadPoolExecutor(max_workers=n_feeders, thread_name_prefix="preprocess-feed")
    feed_futures: list[Future] = []
    failure: BaseException | None = None
    try:
        # submitted inside the try: a Ctrl-C while a feeder thread starts must still shut the feeders down,
        # or the idle thread keeps the process from exiting
        feed_futures += [feeders.submit(feed) for _ in range(n_feeders)]
        while True:
            try:
                fut = results.get(timeout=0.1)
            except queue.Empty:
                with lock:
                    idle = outstanding[0] == 0
                if idle and all(ff.done() for ff in feed_futures):
                    break
                continue
            with lock:
                outstanding[0] -= 1
            slots.release()
            exc = fut.exception()
            if exc is not None:
                failure = failure or exc
                stop.set()
                continue
            res = fut.result()
            state.handle(res)
            if state.interrupted:
                stop.set()
            elif res.error is not None:
                with lock:
                    key = (res.file_index, res.chunk_index)
                    limit[0] = key if limit[0] is None else min(limit[0], key)
    except BaseException:
        stop.set()
        raise
    finally:
        feeders.shutdown(wait=True)
    for ff in feed_futures:
        if ff.exception() is not None:
            failure = failure or ff.exception()
    if failure is not None:
        raise failure
