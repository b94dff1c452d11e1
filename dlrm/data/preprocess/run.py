"""The run: checks, count pass, output directory, chunks, metadata (`preprocess`)."""

from __future__ import annotations

import collections
import os
import shutil
import time
import zlib
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np

from dlrm.data.preprocess.constants import (
    DEFAULT_CHUNK_ROWS,
    DEFAULT_MAX_ROWS_PER_TABLE,
    DEFAULT_ROW_GROUP_ROWS,
    MANIFEST_VERSION,
    PROGRESS_DIR,
)
from dlrm.data.preprocess.errors import (BadLineError, InterruptedBeforeReplacing, InterruptedWhenComplete,
                                         PreprocessError, _Interrupted)
from dlrm.data.preprocess.finish import _finish, _report
from dlrm.data.preprocess.frequency import auto_min_frequency, describe_rule, train_rows_of_plan
from dlrm.data.preprocess.options import RunOptions, check_inputs, check_options, check_output_location
from dlrm.data.preprocess.output import (
    _after_failure,
    _check_output,
    _fingerprint,
    _first_missing,
    _load_done,
    _remove_dataset,
    _remove_temp_files,
)
from dlrm.data.preprocess.replace import STAGING, finish_replacement, stages_into, swap_committed
from dlrm.data.preprocess.same_content import recorded_shares, same_data, same_rows
from dlrm.data.preprocess.scan import FileScan, _count_pass, count_pass_tasks
from dlrm.data.preprocess.schedule import _run_inline, _run_pool, _RunState
from dlrm.data.preprocess.splits import SplitPlan
from dlrm.data.preprocess.stats import DistinctCounter
from dlrm.logging_setup import ProgressBar, bar_interval, counted
from dlrm.data.preprocess.worker import _ChunkTask, _iter_ranges, _stats_from_shard
from dlrm.data.output_dirs import output_lock
from dlrm.data.schema import SPLITS, Metadata, write_json_atomic
from dlrm.data.worker_pool import start_pool


def preprocess(
    inputs: Sequence[str | os.PathLike],
    output: str | os.PathLike,
    *,
    input_format: str = "auto",
    split: str = "sequential",
    validation_fraction: float = 0.05,
    test_fraction: float = 0.05,
    seed: int = 0,
    hashing: str = "modulus",
    min_frequency: int | str = 1,
    max_rows_per_table: int | None = DEFAULT_MAX_ROWS_PER_TABLE,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    row_group_rows: int = DEFAULT_ROW_GROUP_ROWS,
    compression: str = "zstd",
    compression_level: int | None = None,
    workers: int | None = None,
    on_bad_line: str = "stop",
    overwrite: bool = False,
    checkpoint_interval: float = 300.0,
    progress: bool = True,
    multi_hot_sizes: list[int] | str | None = None,
    sparse_layout: str | None = None,
    allow_shared_rows: bool = False,
    _max_new_chunks: int | None = None,
) -> Metadata:
    """Turn raw Criteo files into a dataset directory (see the package docstring); returns its metadata.

    Args:
        inputs: raw files in order (TSV without header or CSV with header; plain or gzip), each
            once (another spelling of a path, a symlink or a hard link to a file already listed
            is refused, and so is a copy of its data, plain or gzip'ed: `same_content`).
        output: the dataset directory.
        input_format: "auto" (from the first line of each file), "tsv" or "csv".
        split: "sequential" (Kaggle), "days" (Terabyte) or "random"; see `SplitPlan`.
        validation_fraction, test_fraction, seed: for split="random" (fractions in [0, 1)).
        hashing: "modulus" (cardinality = min(distinct + 1, max_rows_per_table)) or "vocabulary"
            (values seen >= min_frequency times in train get rows 1..V; cardinality V + 1).
        min_frequency: an int >= 1, or "auto" (vocabulary hashing only): picked from the train split's
            size after the count pass (`dlrm.data.preprocess.frequency`), logged and kept in
            ``metadata.extra["options"]`` (``min_frequency_used``, ``min_frequency_rule``, the train rows it was
            picked for, ``min_frequency_train_rows``, and whether they are --split random's expected count,
            ``min_frequency_train_rows_expected``).
        max_rows_per_table: cap of a modulus table (None or 0: no cap).
        chunk_rows: lines per chunk (the unit of work, of resuming and of a shard).
        row_group_rows: parquet row group size.
        compression, compression_level: parquet codec ("zstd", "snappy", "lz4", "gzip", "brotli",
            "none") and its level (None: the codec's default).
        workers: processes (default min(cpu count, 8)), at most one a chunk (logged when fewer); 1 runs everything
            in this process.
        on_bad_line: "stop" raises `BadLineError` naming the first bad line; "skip" drops bad lines
            and counts them per reason in ``metadata.extra["bad_lines"]``.
        overwrite: replace a complete dataset or an unfinished run in ``output``. A complete dataset stays until
            the new one is complete (built beside it, then swapped in: `dlrm.data.preprocess.replace`).
        checkpoint_interval: seconds between checkpoints of the table statistics (<= 0: every chunk).
        progress: show a tqdm bar.
        multi_hot_sizes: per categorical field the most values it holds ("mlperf", or 26
            integers; None: one-hot). A multi-hot field holds hex values separated by ``,`` (TSV
            only; empty: no value); more values than its size is a bad line (bad_category).
            Distinct values and vocabulary frequencies count every value.
        sparse_layout: how the shards store a multi-hot field (`dlrm.data.schema.SparseLayout`):
            "slots" (one int64 column a slot, -2 in the empty ones; schema version 3, the faster to
            read) or "lists" (one ``list<int64>`` column, version 2). None: "slots" for a new run,
            and a resumed run keeps the layout it started with ("lists" if its record predates the
            option); a different one is refused like any changed option. One-hot data: no effect.
        allow_shared_rows: inputs sharing most of their rows (`same_content.same_rows`) are warned of (both files
            and the share named; ``metadata.extra["shared_rows"]``), not refused; a resumed run that accepted them
            needs it again.

    Every option, the inputs and the output location are checked before anything is written; a
    run that fails before its first chunk is finished removes what it created.

    Raises:
        PreprocessError (BadLineError for bad input): one-line message.
    """
    t_start = time.monotonic()
    opts = check_options(
        input_format=input_format, split=split, validation_fraction=validation_fraction,
        test_fraction=test_fraction, seed=seed, hashing=hashing, min_frequency=min_frequency,
        max_rows_per_table=max_rows_per_table, chunk_rows=chunk_rows, row_group_rows=row_group_rows,
        compression=compression, compression_level=compression_level, workers=workers, on_bad_line=on_bad_line,
        overwrite=overwrite, checkpoint_interval=checkpoint_interval, progress=progress,
        multi_hot_sizes=multi_hot_sizes, sparse_layout=sparse_layout, allow_shared_rows=allow_shared_rows,
    )
    paths = check_inputs(inputs, opts.split, opts.allow_shared_rows)
    out = Path(output)
    check_output_location(out, paths)
    # one run of an output at a time: a second one resumed the first's unfinished run (or, --overwrite, removed it)
    # in the directory the first was still writing, which then finished a dataset of both runs' shards
    with output_lock(out, "--output", PreprocessError, inside_ok=True):
        if finish_replacement(out):  # a kill inside an earlier run's swap (or just before it): finished first
            from loguru import logger

            logger.warning("{}: finished replacing the dataset, which a stopped --overwrite run had left half done",
                           out)
        return _locked_run(opts, paths, out, _max_new_chunks, t_start)


def _locked_run(opts: RunOptions, paths: list[Path], out: Path, max_new: int | None, t_start: float) -> Metadata:
    """`preprocess`'s run, its output locked."""
    run = _Run(opts, paths, out, max_new)
    _execute(run)
    try:
        try:
            meta = run.finish()
        except (OSError, PreprocessError):  # a full disk writing a vocabulary or metadata.json: every chunk is kept
            _clean_up(run)  # (says so, and how to resume: the error line alone did not)
            raise
        if run.staged:  # the new dataset is complete: the old one goes, the new one comes in
            finish_replacement(out)
    except KeyboardInterrupt as e:  # as metadata.json was written (its log line): the dataset is complete
        if not ((run.out / "metadata.json").is_file() or (run.staged and swap_committed(out))):
            raise  # (an old one was removed by --overwrite, or refused, before; a staged run's old one is whole)
        if run.staged:
            finish_replacement(out)
        shutil.rmtree(run.progress_dir, ignore_errors=True)
        raise InterruptedWhenComplete(out, getattr(e, "exit_code", 130)) from None
    try:  # metadata.json is written: an interrupt from here on must not read as a run to resume
        shutil.rmtree(run.progress_dir, ignore_errors=True)
        _report(meta, time.monotonic() - t_start)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (`dlrm.stop_signal.Terminated`, 143)
        raise InterruptedWhenComplete(out, getattr(e, "exit_code", 130)) from None
    return meta


def _execute(run: _Run) -> None:
    """Steps 1-3 with the worker pool (started by `_Run.use_pool` as the work is known); after a failure (not the
    test hook's `_Interrupted`, which stands for a kill) the output is cleaned up once the pool has stopped writing
    into it."""
    failure: BaseException | None = None
    try:
        run.count()
        run.start_output()
        run.restore_stats()
        run.check_finished(run.run_chunks())
    except BaseException as e:
        failure = e
        if isinstance(e, KeyboardInterrupt) and run.opts.overwrite and not run.owns_output:
            raise InterruptedBeforeReplacing(getattr(e, "exit_code", 130)) from None  # the output untouched
        raise
    finally:
        if run.pool is not None:
            run.pool.shutdown(wait=True, cancel_futures=True)
        if failure is not None and run.owns_output and not isinstance(failure, _Interrupted):
            _clean_up(run, isinstance(failure, BadLineError))
        if run.out.is_dir():
            _remove_temp_files(run.out)


def _clean_up(run: _Run, bad_line: bool = False) -> None:
    """`_after_failure`, whose own failure is only logged: the error the user must see is the first. `bad_line`: the
    run stopped at a bad line (``--on-bad-line skip`` resumes too)."""
    from loguru import logger

    try:
        if run.staged and not run.done:  # nothing to resume: the replacement's staging directory goes whole
            shutil.rmtree(run.out)
        else:
            _after_failure(run.out, run.created, run.done, run.resume_advice(), bad_line)
        if run.staged:
            logger.info("{}: the dataset there is as it was (a replacement swaps the new one in only once complete)",
                        run.final)
    except OSError as e:
        logger.warning("could not remove what the failed run created in {}: {}", run.out, e)


class _Run:
    """One run's state, handed from step to step (count, start the output, restore, chunks, finish)."""

    def __init__(self, opts: RunOptions, paths: list[Path], out: Path, max_new: int | None):
        self.paths = paths
        self.final = out  # --output
        # a complete dataset there is replaced only once the new one is complete: the run writes into its staging
        # directory, `self.out` (`dlrm.data.preprocess.replace`); otherwise the run writes into --output itself
        self.staged = stages_into(out, opts.overwrite)
        self.out = out / STAGING if self.staged else out
        self.progress_dir = self.out / PROGRESS_DIR
        self.max_new = max_new
        self.fingerprints = [_fingerprint(p) for p in paths]
        self.created = _first_missing(self.out)  # what this run creates (removed again if it fails early)
        self.manifest = _check_output(self.out, opts.output_options(), self.fingerprints, opts.overwrite)
        self.opts = opts.with_sparse_layout(self.manifest["options"] if self.manifest is not None else None)
        self.pool: ProcessPoolExecutor | None = None
        self.pool_size = 0
        self.done: dict[tuple[int, int], dict] = {}
        # True once this run has taken over the output (the old dataset replaced, the progress of
        # an earlier run read): from then on a failure cleans up after it (`_after_failure`)
        self.owns_output = False
        # set by the steps, in order: count, restore_stats, run_chunks
        self.scans: list[FileScan] = []
        self.shared: list[dict] = []  # the inputs sharing rows that --allow-shared-rows accepted (`same_rows`)
        self.file_bad: dict[str, int] = {}
        self.plan: SplitPlan | None = None
        self.firsts: list[int] = []  # global line number of every file's first line
        self.counter: DistinctCounter | None = None
        self.covered: set[tuple[int, int]] = set()
        self.todo: list[list[int]] = []
        self.auto_train_rows = 0  # the train rows --min-frequency auto was picked for (`count`)
        self.reread = 0  # train shards whose statistics `restore_stats` re-read (not in the checkpoint)

    def resume_advice(self) -> str:
        """How to resume this run after it stopped: the same command, without --overwrite if it had it (with it, a
        run starts over)."""
        return "run again with the same inputs and options" + (" without --overwrite" if self.opts.overwrite else "")

    def count(self) -> None:
        """Step 1: the count pass (cached in the manifest of an unfinished run), bad files, the split."""
        from loguru import logger

        o = self.opts
        resumed = self.manifest is not None and bool(self.manifest.get("scans"))
        if resumed:
            # each file's path as this run names it: the inputs matched the manifest's by resolved path, size and
            # mtime, but a scan keeps the path as the earlier run spelled it (relative to its working directory: a
            # resume from another one failed with "No such file or directory" on an input it had been given)
            if len(self.manifest["scans"]) != len(self.paths):
                raise PreprocessError(f"{self.progress_dir / 'manifest.json'}: {len(self.manifest['scans'])} file "
                                      f"scans for {len(self.paths)} inputs; use --overwrite to start over")
            self.scans = [replace(FileScan(**d), path=str(p)) for d, p in zip(self.manifest["scans"], self.paths)]
            logger.info("resuming the unfinished run in {}{}", self.out,
                        f" (it replaces the dataset in {self.final} once complete)" if self.staged else "")
        else:
            logger.info("counting the lines of {} input file(s)", len(self.paths))
            self.use_pool(count_pass_tasks(self.paths, o.workers))
            self.scans = _count_pass(self.paths, o.input_format, o.chunk_rows, self.pool, o.workers, o.progress)
            if not o.allow_shared_rows:  # (under it such a copy is `same_rows`' to find: a share of 100%, kept)
                same_data(self.scans)  # gzip'ed data also given plain, or gzip'ed twice (plain copies: `check_inputs`)
        for sc in self.scans:
            if sc.trailing_blank:
                logger.info("{}: ends in {:,} empty line(s) after its last record: left out (an editor's or a tool's "
                            "trailing newline, not a record; an empty line before a record is a bad line)",
                            sc.path, sc.trailing_blank)
        self.file_bad = _check_scans(self.scans, o.on_bad_line)
        # the same rows in other bytes (CRLF, a BOM, another order, a part): from the samples, which a resumed run's
        # scans lack (the run it resumes compared them, and recorded what --allow-shared-rows accepted)
        self.shared = recorded_shares(self.manifest, o.allow_shared_rows, self.progress_dir / "manifest.json") \
            if resumed else same_rows(self.scans, o.allow_shared_rows)
        if o.multi_hot_sizes is not None:  # known from the count pass: refused before anything is written
            csv = next((sc.path for sc in self.scans if sc.format == "csv"), None)
            if csv is not None:
                raise PreprocessError(f"{csv}: is CSV; --multi-hot-sizes needs TSV (',' separates CSV fields)")
        file_lines = [sc.lines for sc in self.scans]
        self.plan = SplitPlan.build(
            o.split, file_lines, seed=o.seed, validation_fraction=o.validation_fraction, test_fraction=o.test_fraction
        )
        logger.info("split: {}", self.plan.describe(separators=True))
        self.firsts = np.concatenate(([0], np.cumsum(file_lines)[:-1])).astype(int).tolist()
        if o.min_frequency_auto:
            train_rows = self.auto_train_rows = train_rows_of_plan(self.plan, file_lines)
            self.opts = o.with_min_frequency(auto_min_frequency(train_rows))
            # a random split's count is its expectation (its lines are drawn later): said, not given as the split's
            expected = ", the expected count of --split random" if self.plan.mode == "random" else ""
            logger.info("--min-frequency auto: {} for {:,} train rows ({}{})", self.opts.min_frequency, train_rows,
                        describe_rule(), expected)

    def use_pool(self, tasks: int) -> None:
        """Have a pool of min(--workers, ``tasks``) processes for ``tasks`` that can run at once (none with --workers 1
        or no task): the pool as it is if that size, else a new one. Every worker of `start_pool` is started before
        it returns (each imports numpy and pyarrow): ``--workers 500`` on a one-chunk file started 500 (143 s on 2
        cores, for 1.5 s of work)."""
        n = min(self.opts.workers, tasks) if self.opts.workers > 1 else 0
        if n == self.pool_size:
            return
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool, self.pool_size = None, 0
        if n > 0:
            self.pool = start_pool(n)  # its workers leave Ctrl-C to this process (dlrm.data.worker_pool)
            self.pool_size = n

    def size_pool_to_work(self, rereads: int) -> None:
        """Before the chunks (and a resume's re-reading of ``rereads`` train shards): a pool of no more workers than
        the run has tasks, a chunk or a shard being one worker's task, logged when not --workers. A resume counts the
        chunks left to do, not all of the run's: one with 1 of 10 chunks left started all --workers processes (each
        imports numpy and pyarrow) for one task. One chunk still gets a worker process: a worker killed for memory is
        reported as such (`BrokenProcessPool`). (A shard found damaged while re-read adds its chunk to those left:
        the pool stays, it has at least the re-reads' size.)"""
        from loguru import logger

        chunks = sum(sc.num_chunks for sc in self.scans)
        left = sum((f, c) not in self.done for f, sc in enumerate(self.scans) for c in range(sc.num_chunks))
        asked = self.opts.workers
        self.use_pool(max(left, rereads))
        used = min(asked, max(left, rereads))
        if 0 < used < asked:  # (no chunk: the run has nothing to do, and says so)
            processes = counted(used, "worker process", ",", "worker processes")
            if self.done:
                what = f"{counted(left, 'chunk', ',')} left to do (of {chunks:,})" + (
                    f" and {counted(rereads, 'train shard', ',')} to re-read" if rereads else "")
                logger.info("{} (not {:,}): the resumed run has only {}", processes, asked, what)
            else:
                logger.info("{} (not {:,}): the run has only {}", processes, asked, counted(chunks, "chunk", ","))
            self.opts = replace(self.opts, workers=used)

    def start_output(self) -> None:
        """Step 2: remove what an earlier run wrote (--overwrite: a dataset, or a replacement's staged run; the complete
        dataset a staged run replaces stays), make the directories, read what an earlier run finished, write the
        manifest."""
        # from here a stop cleans up after this run (`_after_failure`) where nothing an earlier run finished is lost
        # by it: an --overwrite's removal has begun, or the output holds no earlier run (a stop between the mkdirs
        # below and the takeover left empty folders, and the corrected command was refused: "not empty")
        if self.opts.overwrite and self.out.exists():
            self.owns_output = True
            _remove_dataset(self.out)
        elif not self.progress_dir.exists():
            self.owns_output = True
        self.progress_dir.mkdir(parents=True, exist_ok=True)
        for name in SPLITS:
            (self.out / name).mkdir(exist_ok=True)
        self.done = _load_done(self.progress_dir, self.out)
        self.owns_output = True
        write_json_atomic(
            self.progress_dir / "manifest.json",
            {
                "tool": "dlrm.preprocess",
                "manifest_version": MANIFEST_VERSION,
                "options": self.opts.output_options(),
                "inputs": self.fingerprints,
                "scans": [sc.record() for sc in self.scans],
                "shared_rows": self.shared,
            },
        )
        _remove_temp_files(self.out)

    def restore_stats(self) -> None:
        """The table statistics of finished chunks: the checkpoint, then the train shards of the
        finished chunks it does not cover."""
        from loguru import logger

        cap = self.opts.count_cap
        chunks = {(f, c) for f, sc in enumerate(self.scans) for c in range(sc.num_chunks)}
        self.counter, self.covered = _load_checkpoint(self.progress_dir / "stats.npz", cap, chunks)
        redo = [k for k in sorted(self.done) if k not in self.covered and "train" in self.done[k]["shards"]]
        if self.done:
            logger.info("{:,} chunk(s) already done; re-reading table statistics of {:,} of them", len(self.done),
                        len(redo))
        self.size_pool_to_work(len(redo))
        lost = len(self.covered - set(self.done))
        if lost:
            logger.info("{:,} chunk(s) the statistics checkpoint covers are redone for their shards (damaged or "
                        "missing since): their statistics are kept", lost)
        if redo:
            o = self.opts
            args = [(str(self.out / self.done[k]["shards"]["train"]["file"]), k[0], k[1], cap, o.multi_hot_sizes,
                     o.sparse_layout) for k in redo]
            it = (_bounded_map(self.pool, _stats_from_shard, args, 2 * o.workers) if self.pool is not None
                  else map(_stats_from_shard, args))
            for key, stats in it:
                if stats is None:  # its train shard was damaged since: redo the chunk, as for a missing shard
                    shard = self.out / self.done.pop(key)["shards"]["train"]["file"]
                    logger.warning("{}: unreadable; its chunk is redone", shard)
                    continue
                self.counter.add_stats(stats)
                self.covered.add(key)
                self.reread += 1

    def tasks(self, f: int) -> Iterator[_ChunkTask]:
        """The tasks of file ``f``'s chunks still to do; a gzip file is decompressed here, as a stream."""
        sc = self.scans[f]
        chunks = self.todo[f]
        o = self.opts
        rows = o.chunk_rows
        datas: Iterator[bytes | None]
        if sc.compressed:
            datas = _iter_ranges(sc.path, [(sc.offsets[c], sc.offsets[c + 1]) for c in chunks])
        else:
            datas = iter([None] * len(chunks))  # the worker reads its byte range of the plain file
        for c, data in zip(chunks, datas):
            yield _ChunkTask(
                file_index=f, chunk_index=c, path=sc.path, fmt=sc.format,
                offset=sc.offsets[c], length=sc.offsets[c + 1] - sc.offsets[c],
                n_lines=min(rows, sc.lines - c * rows), first_line=c * rows + (2 if sc.header else 1),
                first_local=c * rows, file_first_global=self.firsts[f], data=data, plan=self.plan,
                output=str(self.out), row_group_rows=o.row_group_rows, compression=o.compression,
                compression_level=o.compression_level, on_bad_line=o.on_bad_line, count_cap=o.count_cap,
                multi_hot_sizes=o.multi_hot_sizes, sparse_layout=o.sparse_layout,
            )

    def run_chunks(self) -> _RunState:
        """Step 3: the chunks still to do, in this process or in the pool, under a progress bar."""
        from loguru import logger

        o = self.opts
        self.todo = [[c for c in range(sc.num_chunks) if (f, c) not in self.done] for f, sc in enumerate(self.scans)]
        done_lines = sum(r["lines"] for r in self.done.values())
        todo = sum(len(t) for t in self.todo)
        if todo == 0 and self.done:  # (a resume after a failure writing metadata.json): "0 chunk(s) ... (8 workers)"
            logger.info("no chunk left to do ({} done)", counted(len(self.done), "chunk", ","))
        else:
            logger.info("{:,} chunk(s) of up to {:,} lines to do ({:,} worker{})", todo, o.chunk_rows, o.workers,
                        "" if o.workers == 1 else "s")  # "(1 workers)" it said
        state = _RunState(self.progress_dir, self.counter, self.covered, self.done, o.checkpoint_interval, self.max_new,
                          dirty=self.reread > 0)
        with ProgressBar(
            total=self.plan.total_lines, initial=done_lines, unit=" rows", unit_scale=True, disable=not o.progress,
            desc="preprocessing", smoothing=0.05, dynamic_ncols=True,
            # once a second on a terminal, once a minute into a log file (an hour's run wrote 3,600 copies)
            **{"mininterval": 1.0, **bar_interval()},
        ) as bar:
            state.bar = bar
            try:
                if self.pool is None:
                    _run_inline(self.tasks, len(self.scans), state)
                else:
                    files = [f for f in range(len(self.scans)) if self.todo[f]]
                    _run_pool(self.pool, self.tasks, files, o.workers, state)
            finally:
                state.close()
        return state

    def check_finished(self, state: _RunState) -> None:
        """Raise unless every chunk finished and some rows were written."""
        if state.interrupted:
            raise _Interrupted("stopped after _max_new_chunks chunks")
        if state.errors:
            state.checkpoint(force=True)
            _remove_temp_files(self.out)
            raise BadLineError(min(state.errors, key=lambda e: e[0])[1])
        missing = [(f, c) for f, sc in enumerate(self.scans) for c in range(sc.num_chunks) if (f, c) not in self.done]
        if missing:
            raise PreprocessError(f"internal error: chunks {missing[:5]} did not finish")
        if not any(rec["shards"] for rec in self.done.values()):
            skipped = sum(self.file_bad.values()) + sum(sum(rec["bad"].values()) for rec in self.done.values())
            # the first bad line, in input order: the count alone hid why (--format csv given for a TSV file: "100 bad
            # line(s)"), where --on-bad-line stop names it with its advice ("a TSV file? give --format tsv or auto")
            first = next((self.done[k]["first_bad"] for k in sorted(self.done)
                          if isinstance(self.done[k].get("first_bad"), str)), None)
            # nothing to resume (rerun, it fails the same way): forget the chunks, so that the cleanup removes
            # what this run made and the corrected command (another --format, a fixed input) starts afresh
            self.done.clear()
            raise PreprocessError(
                f"no rows to write: not one good line in the {len(self.paths)} input file(s) "
                f"({skipped:,} bad line(s) or file(s) skipped)" + (f"; the first: {first}" if first else "")
            )
        # every chunk is done: the statistics are saved before the finish step, so that a resume after a failure in
        # it (a full disk writing a vocabulary or metadata.json) does that step alone. Without this, the last
        # periodic checkpoint (--checkpoint-interval, 5 minutes) left the chunks since uncovered, and the resume
        # re-read their train shards: all of them for a run shorter than the interval
        state.checkpoint(force=True)

    def finish(self) -> Metadata:
        """Step 4: vocabularies and metadata.json."""
        o = self.opts
        options = o.output_options()
        if o.min_frequency_auto:  # the value "auto" gave, next to the request (the manifest keeps "auto")
            options["min_frequency_used"] = o.min_frequency
            options["min_frequency_rule"] = describe_rule()
            # the count the rule was given, as logged: under --split random the expected one (its lines are drawn
            # per line), which the train split's rows in metadata.json may miss by a few
            options["min_frequency_train_rows"] = self.auto_train_rows
            options["min_frequency_train_rows_expected"] = self.plan.mode == "random"
        return _finish(self.out, self.scans, self.fingerprints, options, self.plan, self.done,
                       self.counter, self.file_bad, o.hashing, o.min_frequency, o.max_rows, self.shared)


def _bounded_map(pool: ProcessPoolExecutor, fn, args: list, window: int) -> Iterator:
    """``pool.map(fn, args)``, in order, with at most ``window`` tasks submitted and not yet consumed. ``map`` submits
    them all: when this process merges more slowly than the workers read (a resume re-reading the shards of the chunks
    a checkpoint does not cover, 4-8 MB of statistics each), the finished ones waited in memory, up to every train
    chunk's of Criteo 1TB (16,000: tens of GB) when the checkpoint could not be used."""
    pending: collections.deque[Future] = collections.deque()
    for a in args:
        if len(pending) >= window:
            yield pending.popleft().result()
        pending.append(pool.submit(fn, a))
    while pending:
        yield pending.popleft().result()


def _check_scans(scans: list[FileScan], on_bad_line: str) -> dict[str, int]:
    """Log what the count pass found in every file; an empty or corrupt file stops the run, or in
    skip mode is counted (and a gzip file corrupt inside its stream loses all its lines)."""
    from loguru import logger

    file_bad: dict[str, int] = {}
    for i, sc in enumerate(scans):
        logger.info("{}: {:,} data lines ({}{}{})", sc.path, sc.lines, sc.format, ", header" if sc.header else "",
                    ", gzip" if sc.compressed else "")
        bad = sc.bad_line()
        if bad is None:
            continue
        if on_bad_line == "stop":
            raise BadLineError(bad)
        if sc.lines and not sc.prefix_trusted:
            logger.warning("skipping the whole file ({:,} lines decompressed before the error): {}", sc.lines,
                           bad.message())
            scans[i] = sc.without_data()
        else:
            logger.warning("skipping: {}", bad.message())
        file_bad[bad.reason] = file_bad.get(bad.reason, 0) + 1
    return file_bad


def _load_checkpoint(path: Path, count_cap: int | None,
                     chunks: set[tuple[int, int]]) -> tuple[DistinctCounter, set[tuple[int, int]]]:
    """The statistics checkpoint and the chunks it covers; an unreadable one, or one that covers a chunk
    not among this run's ``chunks``, is ignored (the statistics are re-read from the shards).

    A covered chunk no longer recorded as done (a shard or its record damaged or missing since) keeps its
    statistics: it is redone for its shards only, from the same input, and `_RunState.handle` does not add
    its statistics again (counts would be summed twice; they cannot be subtracted, being capped and the
    shard unreadable). Throwing the checkpoint away re-read every covered chunk's train shard instead:
    ~16,000 for Criteo 1TB, 10+ minutes, for one damaged shard. A chunk that is no chunk of the run would
    never be redone, its statistics matched by no shard: such a checkpoint is not trusted."""
    counter = DistinctCounter(count_cap)
    if not path.is_file():
        return counter, set()
    try:
        covered = counter.load(path)
    except (OSError, ValueError, KeyError, zlib.error):
        return DistinctCounter(count_cap), set()  # a fresh counter: the load may have stopped half-way
    if not covered <= chunks:
        return DistinctCounter(count_cap), set()
    return counter, covered
