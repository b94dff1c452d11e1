"""Import MLPerf DLRM-DCNv2's own preprocessed Criteo 1TB files into this project's dataset format.

    python -m dlrm.data.mlperf_import --input /data/mlperf-criteo --output data/mlperf-1tb
    python train.py --config configs/mlperf-dcnv2.json --data data/mlperf-1tb

MLPerf's reference (mlcommons/training ``recommendation_v2/torchrec_dlrm``, torchrec 0.3.2's
``BinaryCriteoUtils`` then its ``materialize_synthetic_multihot_dataset.py``) leaves, for each day i:

- ``day_{i}_labels.npy``: int32 [N, 1] (or [N]), 0 or 1;
- ``day_{i}_dense.npy``: float32 [N, 13], already ``log(x + 3)`` of the raw counts;
- ``day_{i}_sparse_multi_hot.npz``: an uncompressed ``np.savez`` with members ``"0"`` .. ``"25"``,
  int32 [N, size_f]: every row exactly size_f ids of feature f, each below its table size;
- or, in the npz's place, TorchRec's one-hot ``day_{i}_sparse.npy`` (``BinaryCriteoUtils``' layout before MLPerf's
  multi-hot step): integers [N, 26], one id a feature, imported as 26 one-hot features. Its ids are
  ``contiguous_preproc_criteo``'s (2 .. distinct + 1: past MLPerf's 40M caps, and past the exact sizes by two), which
  the reference reads modulo its table sizes (``InMemoryBinaryCriteoIterDataPipe``'s ``hashes``): each is stored as
  ``id % size`` (``--num-embeddings``), the row the reference's table would look up; a negative id is refused naming
  the file, the column and the row. (Raw 32-bit hashes are taken modulo the sizes alike, as the reference would take
  them; ``python -m dlrm.preprocess`` of the raw logs keeps them whole.) A multi-hot id must be below its table's
  size: MLPerf's multi-hot step applied the sizes already, so one past them comes from other tables and is refused.

Training rows are days 0-22 (the reference shuffled them across those days), validation the first
``ceil(N / 2)`` rows of day 23 and test the rest, as the reference splits them. Every row becomes
one parquet row: the label, 13 dense values and 26 features, with ``hashing`` "modulus" over the
table sizes, which maps the ids 0 .. card - 1 to distinct rows. A feature of size_f > 1 is stored as
``--sparse-layout`` says (`dlrm.data.schema`): ``slots`` (the default, schema version 3), size_f int64
columns ``SPARSE_<f>_0 ..``, which the loaders read 1.6-2x faster (MLPerf's rows are always full, so
no slot holds -2); ``lists`` (version 2), one list column of size_f ids.

The dense values are stored as they are by default (``--dense float``: float32 columns, schema version
4, ``dense_format`` "float"), so the model sees exactly what MLPerf's reference feeds its own,
``log(x + 3)``. ``--dense counts`` writes int32 counts instead (the format of every other dataset here,
which the loaders feed as ``log1p(max(x, 0))``): recovered as ``round(exp(d) - 3)`` (exact while
``x + 3`` is below ~5e5 in float32, about 1e-6 off in log space beyond), negatives (Criteo's -1, -2)
as 0 as the preprocessor stores them, so the model then sees ``log1p(x)`` where MLPerf's sees ``log(x + 3)``.

The npz members are read through memory maps (no member is loaded whole: one feature of one day is
up to ~70 GB), in row groups of 131,072 rows, by ``--workers`` processes, each writing its own
files into ``.<output name>.import-partial`` beside ``--output``, renamed into place when all are
done: ``--output`` never holds a half-written dataset. An import that stops (a bad value, a kill)
keeps the files it finished there (one that finished none, stopped by a bad value or Ctrl-C, leaves nothing),
and the same command resumes from them, writing again any that can no longer be read or whose day's input
files changed since (`dlrm.data.input_stamps`) (other options, another ``--sparse-layout`` included, or another
input are refused; ``--overwrite`` starts over; one begun with ``--overwrite`` over a dataset resumes without it, the
dataset replaced only when the import is done). An ``--output`` that is ``--input``, holds it or lies inside it
is refused, ``--overwrite`` or not, as are ``.`` and ``..``. Every value is checked (labels 0/1, finite dense
values, multi-hot ids in range and one-hot ids not negative, shapes alike across days: not dtypes, the reference's
day 23 keeps the contiguous step's int64 ids where its shuffled days hold int32), and a bad one stops the import
with one line naming the file, the member (or column) and the row; so does an npz holding a member besides
``0.npy`` .. ``25.npy``, or one of them twice. The day files are opened and checked by `dlrm.data.mlperf_days`.

Files are written with LZ4 by default: a dataset of this size streams from parquet
(``data.placement`` "stream"), and MLPerf's multi-hot rows decode ~1.3x faster from LZ4 than from
zstd (benchmarks/results/stream_training_mlperf.md).
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import click
from click.core import ParameterSource
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from loguru import logger

from dlrm.data.preprocess.options import CODECS
from dlrm.data.schema import (
    LABEL_COLUMN,
    DENSE_FORMATS,
    MLPERF_CARDINALITIES,
    NUM_DENSE,
    NUM_SPARSE,
    SPARSE_LAYOUTS,
    Metadata,
    SplitInfo,
    arrow_schema,
    feature_columns,
    is_multi_hot,
    write_json_atomic,
    write_options,
    write_metadata,
)
from dlrm.data.input_stamps import STAMPS_FILE, redo_changed_inputs
from dlrm.data.mlperf_days import Day, ImportInputError, npz_member  # noqa: F401 - npz_member re-exported
from dlrm.data.output_dirs import (check_apart, check_named, check_parent_writable, check_replaceable, check_target,
                                   check_unowned, output_lock, recover_replaced, replace_dir)
from dlrm.data.synthetic_io import SPARSE_LAYOUT, stored_layout
from dlrm.data.worker_pool import start_pool
from dlrm.errors import report_bug
from dlrm.json_file import read_json
from dlrm.logging_setup import ProgressBar, bar_interval, configure_logging, counted
from dlrm.one_line_usage import NonEmptyPath, OneLineUsageCommand
from dlrm.run_paths import MLPERF_FILES
from dlrm.stop_signal import EXIT_INTERRUPTED, StopAtOnce, interruption

EXIT_BAD_INPUT = 2
EXIT_OUT_OF_MEMORY = 4  # as preprocess's and the generator's
ROW_GROUP_ROWS = 131072
DEFAULT_ROWS_PER_FILE = 8 * ROW_GROUP_ROWS
_INT32_MAX = 2**31 - 1
DENSE_FORMAT = "float"
"""``--dense``'s default: MLPerf's dense values as they are."""


def dense_counts(logged: np.ndarray) -> np.ndarray:
    """MLPerf's ``log(x + 3)`` dense values back to this format's int32 counts (negatives 0, capped at int32);
    NaN (what the log gives below x = -3) is left to the caller's check."""
    counts = np.rint(np.exp(logged.astype(np.float64)) - 3.0)
    return np.clip(counts, 0, _INT32_MAX).astype(np.int32)


def _row_group(day: Day, lo: int, hi: int, cards: list[int], schema: pa.Schema,
               layout: str = SPARSE_LAYOUT, dense_format: str = DENSE_FORMAT) -> tuple[pa.Table, int]:
    """Rows [lo, hi) of `day` as one table of the dataset schema (multi-hot features in `layout`, the dense
    values as they are or as counts, `dense_format`), every value checked; and its positives."""
    labels = np.asarray(day.labels[lo:hi])
    bad = np.flatnonzero((labels != 0) & (labels != 1))
    if bad.size:
        raise ImportInputError(f"{day.paths[0]}: row {lo + int(bad[0])}: label {labels[bad[0]].item()!r} is not 0 or 1")
    logged = np.asarray(day.dense[lo:hi])
    counts = dense_format == "counts"
    bad = np.argwhere(~np.isfinite(logged) | ((logged > 30.0) if counts else False))  # exp(30) - 3 > any int32
    if bad.size:
        r, c = (int(v) for v in bad[0])
        raise ImportInputError(f"{day.paths[1]}: row {lo + r}, column {c}: {logged[r, c].item()!r} is not "
                               + ("log(x + 3) of a count (finite, at most 30)" if counts else "a finite value"))
    cols = [pa.array(labels.astype(np.int8))]
    dense = dense_counts(logged) if counts else logged.astype(np.float32, copy=False)
    cols += [pa.array(dense[:, j]) for j in range(NUM_DENSE)]
    # TorchRec's one-hot ids (contiguous_preproc_criteo's 2 .. distinct + 1, up to ~293M) are read by the reference
    # modulo its table sizes (InMemoryBinaryCriteoIterDataPipe's `hashes`), and so are they here: refusing those at or
    # above them left MLPerf's own one-hot files importable into no capped table. The multi-hot step applied the sizes
    # already: an id past them there comes from tables of other sizes, and is refused.
    modulo = day.one_hot_npy
    for f, ids in enumerate(day.sparse):
        raw = np.asarray(ids[lo:hi])
        block = raw.astype(np.int64, copy=False)  # a uint64 id >= 2^63 turns negative: caught below
        bad = np.argwhere((block < 0) if modulo else ((block < 0) | (block >= cards[f])))
        if bad.size:  # the id as the file holds it (raw), not as the int64 cast made it
            r, s = (int(v) for v in bad[0])
            raise ImportInputError(f"{day.paths[2]}: {day.where(f)}: row {lo + r}, value {s}: id {raw[r, s].item()} is "
                                   + (("negative" if raw[r, s] < 0 else "past 2^63 - 1") if modulo else
                                      f"outside feature {f}'s table of {cards[f]} rows (--num-embeddings)"))
        cols += feature_columns(block % cards[f] if modulo else block, layout)
    return pa.Table.from_arrays(cols, schema=schema), int(np.count_nonzero(labels))


@dataclass(frozen=True)
class _Task:
    """Rows [lo, hi) of one day into one parquet file."""

    root: str
    day: int
    lo: int
    hi: int
    out: str  # the file's path relative to the dataset directory
    cards: tuple
    sizes: tuple
    compression: str
    layout: str = SPARSE_LAYOUT
    dense_format: str = DENSE_FORMAT


PLAN_FILE = "import-plan.json"


def partial_dir(output: Path) -> Path:
    """Where an import writes its files until all are done (kept when it stops, for the same command to resume)."""
    return output.parent / f".{output.name}.import-partial"


def _write_file(task: _Task, work: str) -> tuple[int, int, bool]:
    """One task (in a worker process or this one): its rows, positives and whether it was written now. A file an
    earlier run of the same import finished (renamed from its ``.tmp`` once complete) is kept as it is and only
    counted; one damaged since (unreadable footer or labels) is written again."""
    path = Path(work) / task.out
    if path.is_file():
        try:
            if pq.ParquetFile(path).metadata.num_rows == task.hi - task.lo:
                labels = pq.read_table(path, columns=[LABEL_COLUMN]).column(LABEL_COLUMN).to_numpy()
                return task.hi - task.lo, int(np.count_nonzero(labels)), False
        except (OSError, pa.ArrowException) as e:
            logger.warning(f"{path}: a finished file that cannot be read ({e}); writing it again")
    day = Day.open(Path(task.root), task.day)
    if day.sizes != list(task.sizes):
        raise ImportInputError(f"{day.paths[2]}: sizes {day.sizes} differ from the first day's {list(task.sizes)}")
    schema = arrow_schema(list(task.sizes), task.layout, task.dense_format)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".tmp")
    positives = 0
    try:
        with pq.ParquetWriter(partial, schema, compression=None if task.compression == "none" else task.compression,
                              **write_options(list(task.sizes), task.layout)) as w:
            for r0 in range(task.lo, task.hi, ROW_GROUP_ROWS):
                table, pos = _row_group(day, r0, min(task.hi, r0 + ROW_GROUP_ROWS), list(task.cards), schema,
                                        task.layout, task.dense_format)
                w.write_table(table, row_group_size=table.num_rows)
                positives += pos
    except BaseException:
        partial.unlink(missing_ok=True)  # (a killed process's is overwritten when the import resumes)
        raise
    os.replace(partial, path)  # complete: a resumed import keeps it
    return task.hi - task.lo, positives, True


def _earlier_plan(work: Path) -> Optional[dict]:
    """The plan an unfinished import in `work` recorded (None: none readable). A plan written before
    ``--sparse-layout`` existed lacks the key: its files are in list columns, "lists"; one written before
    ``--dense`` holds counts."""
    try:
        earlier = read_json(work / PLAN_FILE)
    except (OSError, ValueError):
        return None
    if isinstance(earlier, dict):
        earlier.setdefault("sparse_layout", "lists")
        earlier.setdefault("dense_format", "counts")
    return earlier


def _init_worker() -> None:
    """A worker's log lines (a damaged file written again) in this process's format (Ctrl-C: `start_pool`)."""
    configure_logging()


def _check_input_apart(input_dir: Path, output: Path) -> None:
    """Raise a one-line `ImportInputError` when `input_dir` and `output` (or its partial directory) overlap,
    symlinks resolved: --overwrite removes both, and the finished import replaces `output` whole, so an
    overlap would delete the .npy/.npz files being read, --overwrite or not."""
    check_apart("--input", input_dir, "--output", output, "choose another --output", ImportInputError)
    work = partial_dir(output)
    if input_dir.resolve().is_relative_to(work.resolve()):
        raise ImportInputError(f"--input {input_dir} is inside {work}, where an import into --output {output} "
                               f"writes its files; choose another --output")


MAX_DAY = 9999
"""The last day number `parse_days` takes."""


def days_text(days: list[int]) -> str:
    """Sorted day numbers as `parse_days` reads them: ``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    runs: list[list[int]] = []
    for d in days:
        if runs and d == runs[-1][1] + 1:
            runs[-1][1] = d
        else:
            runs.append([d, d])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def parse_days(text: str) -> list[int]:
    """``"0-22"`` or ``"0,3,5-7"`` as a sorted list of day numbers."""
    days: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            first, last = int(lo), int(hi or lo)
            if last < first:  # range() would name no days: "0,9-3" imported day 0 alone, silently
                raise click.BadParameter(f"{text!r}: {part.strip()!r} runs backwards (write {last}-{first})")
            if last > MAX_DAY:  # a typo ("0-2000000000") built a set of that many days before any file was looked at
                raise click.BadParameter(f"{text!r}: day {last} is past {MAX_DAY} (MLPerf's days are 0-23)")
            days.update(range(first, last + 1))
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a list of days such as 0-22 or 0,1,5-7") from None
    if not days or min(days) < 0:
        raise click.BadParameter(f"{text!r} names no days (or a negative one)")
    return sorted(days)


def _remove_bookkeeping(output: Path) -> None:
    """Remove the unfinished import's own files from the finished dataset (renamed into place with them)."""
    for name in (PLAN_FILE, STAMPS_FILE):  # and their temporary files (a kill while one was written)
        for path in (output / name, *output.glob(f".{name}.*.tmp")):
            path.unlink(missing_ok=True)


def _replacing(output: Path) -> bool:
    """Whether the unfinished import of `output` began with --overwrite over a dataset (its plan's "replaces"): the
    same command without --overwrite, as the stopped import's advice says, then resumes it, and the finished import
    replaces the dataset at `output` as the first run was asked to. It was refused ("refusing to overwrite
    non-empty"), and with --overwrite the import started over: a stopped replacement could not be resumed at all."""
    earlier = _earlier_plan(partial_dir(output))
    return bool(earlier and earlier.get("replaces"))


def _planless(work: Path) -> bool:
    """Whether `work` is a directory an import left before its plan was in place: no plan, and nothing in it but
    the plan's temporary file (`write_json_atomic`'s ``.import-plan.json.*.tmp``)."""
    if not work.is_dir() or (work / PLAN_FILE).exists():
        return False
    return all(p.name.startswith(f".{PLAN_FILE}.") and p.name.endswith(".tmp") for p in work.iterdir())


def import_mlperf(input_dir: Path, output: Path, train_days: list[int], eval_day: int,
                  cards: Optional[list[int]] = None, compression: str = "lz4", rows_per_file: int = DEFAULT_ROWS_PER_FILE,
                  workers: int = 1, max_rows_per_day: Optional[int] = None, overwrite: bool = False,
                  sparse_layout: str = SPARSE_LAYOUT, dense_format: str = DENSE_FORMAT,
                  layout_given: bool = False) -> Metadata:
    """Write the dataset (see the module docstring); returns its metadata. `sparse_layout`: "slots" or
    "lists", how multi-hot features are stored (`layout_given`: asked for, --sparse-layout on the command line,
    refused for a one-hot input, where it cannot act); `dense_format`: "float", MLPerf's dense values as they
    are, or "counts". Raises `ImportInputError` (a `click.ClickException`) for bad inputs, arguments or
    an occupied `output`."""
    given, cards = bool(cards), list(cards or MLPERF_CARDINALITIES)
    if len(cards) != NUM_SPARSE:
        raise ImportInputError(f"--num-embeddings: need {NUM_SPARSE} table sizes >= 1, got {len(cards)}")
    for f, card in enumerate(cards):  # int64 ids: train.py refuses a dataset whose tables are not below 2^63
        if not 1 <= card < 2**63:
            raise ImportInputError(f"--num-embeddings: {str(card):.40} (feature {f}) is not a table size >= 1 and "
                                   f"below 2^63")
    if eval_day in train_days:
        raise ImportInputError(f"--eval-day {eval_day} is also a training day (--train-days)")
    if compression not in CODECS:
        raise ImportInputError(f"--compression: {compression!r} is not one of {', '.join(CODECS)}")
    if sparse_layout not in SPARSE_LAYOUTS:
        raise ImportInputError(f"--sparse-layout: {sparse_layout!r:.40} is not one of {', '.join(SPARSE_LAYOUTS)}")
    if dense_format not in DENSE_FORMATS:
        raise ImportInputError(f"--dense: {dense_format!r:.40} is not one of {', '.join(DENSE_FORMATS)}")
    check_named(output, "--output", ImportInputError, ".import-partial", MLPERF_FILES)  # (`_partial_dir`)
    _check_input_apart(input_dir, output)
    check_target(output, overwrite or _replacing(output), "directory", "--output")
    check_unowned(output, "--output", ImportInputError)  # (no dataset inside another, a run or a sweep)
    check_replaceable(output, "--output", ImportInputError)  # (--overwrite of a folder that holds no dataset)
    # one import of an --output at a time: a second one resumed the first's .OUT.import-partial (or, --overwrite,
    # removed it) under it, and renamed it into place while the first still wrote there
    with output_lock(output, "--output", ImportInputError):
        recover_replaced(output)  # what an import killed while replacing --output left (`replace_dir`)
        # again, under the lock: another may have finished meanwhile
        check_target(output, overwrite or _replacing(output), "directory", "--output")
        check_replaceable(output, "--output", ImportInputError)
        return _import(input_dir, output, train_days, eval_day, cards, compression, rows_per_file, workers,
                       max_rows_per_day, overwrite, sparse_layout, dense_format, layout_given, given)


def _import(input_dir: Path, output: Path, train_days: list[int], eval_day: int, cards: list[int], compression: str,
            rows_per_file: int, workers: int, max_rows_per_day: Optional[int], overwrite: bool, sparse_layout: str,
            dense_format: str, layout_given: bool = False, given: bool = True) -> Metadata:
    """`import_mlperf`'s work, its arguments checked and its --output locked (`given`: `cards` are the user's, not
    MLPerf's defaults)."""
    days = {i: Day.open(input_dir, i) for i in [*train_days, eval_day]}  # every file checked before any work
    sizes = days[train_days[0]].sizes
    for day in days.values():
        if day.sizes != sizes:
            raise ImportInputError(f"{day.paths[2]}: multi-hot sizes {day.sizes} differ from day {train_days[0]}'s "
                                   f"{sizes}")
    if layout_given and not is_multi_hot(sizes):  # one-hot features are one int64 column in either layout: the same
        # files, "lists" recorded, exit 0, as if the layout asked for had been written
        raise ImportInputError(f"--sparse-layout {sparse_layout}: applies to multi-hot features only (every member of "
                               f"{days[train_days[0]].paths[2]} holds one id a row); leave the option out")
    layout = stored_layout(sizes, sparse_layout)

    def take(day: Day) -> int:
        return day.rows if max_rows_per_day is None else min(day.rows, max_rows_per_day)

    tasks: dict[str, list[_Task]] = {"train": [], "validation": [], "test": []}
    eval_rows = take(days[eval_day])
    half = math.ceil(eval_rows / 2)  # the reference's split of day 23
    spans = [("train", i, 0, take(days[i])) for i in train_days]
    spans += [("validation", eval_day, 0, half), ("test", eval_day, half, eval_rows)]
    for split, i, lo, hi in spans:
        for k, r0 in enumerate(range(lo, hi, rows_per_file)):
            tasks[split].append(_Task(str(input_dir), i, r0, min(hi, r0 + rows_per_file),
                                      f"{split}/day-{i:02d}-part-{k:05d}.parquet", tuple(cards), tuple(sizes),
                                      compression, layout, dense_format))
    total = sum(t.hi - t.lo for ts in tasks.values() for t in ts)
    # a one-hot input (TorchRec's day_{i}_sparse.npy) was logged as "multi-hot sizes [1, 1, ...]; ... lists layout"
    ids = (f"multi-hot sizes {sizes}; {compression} files, {layout} layout" if is_multi_hot(sizes)
           else f"one-hot ids ({NUM_SPARSE} features); {compression} files")
    logger.info(f"importing {total:,} rows from {input_dir}: train days {days_text(train_days)} "
                f"({counted(len(train_days), 'day')}), validation and test from day {eval_day}; {ids}, dense "
                f"{dense_format}; {counted(workers, 'worker')}")
    # the defaults were recorded without a word, 204M rows for a hand-made input of a few ids (train.py then builds them)
    source = "--num-embeddings" if given else "MLPerf DLRM-DCNv2's, 40M-capped: --num-embeddings was not given"
    logger.info(f"table sizes recorded ({source}; {sum(cards):,} rows in all): {' '.join(f'{c:,}' for c in cards)}")
    plan = {"source": str(input_dir.resolve()), "train_days": train_days, "eval_day": eval_day, "cards": cards,
            "sizes": sizes, "compression": compression, "rows_per_file": rows_per_file,
            "max_rows_per_day": max_rows_per_day, "day_rows": {str(i): d.rows for i, d in days.items()},
            "sparse_layout": layout, "dense_format": dense_format}
    work = partial_dir(output)
    if overwrite or _planless(work):
        # planless: a kill (SIGKILL, which no handler below sees) between making `work` and its plan's rename left
        # it holding no plan and nothing imported, which refused the very same command from then on
        shutil.rmtree(work, ignore_errors=True)
    if work.exists():
        earlier = _earlier_plan(work)
        if earlier is not None:
            earlier.pop("replaces", None)  # how it began, not what it writes (`_replacing`)
        if earlier != plan:
            raise ImportInputError(f"{work}: an unfinished import with other options or input; run that import's "
                                   f"command again to finish it, or pass --overwrite to start over")
        logger.info(f"resuming the unfinished import in {work}")
    else:
        try:
            work.mkdir(parents=True)
            # "replaces": a dataset stood at --output (`_replacing`); an --overwrite into a new one lets no later run
            # without it replace what has appeared there since
            replaces = overwrite and output.is_dir() and any(output.iterdir())
            write_json_atomic(work / PLAN_FILE, {**plan, "replaces": replaces})
        except BaseException:  # Ctrl-C, SIGTERM, a full disk before the plan was in it: the directory without its plan
            # refused the very same command from then on ("an unfinished import with other options or input")
            shutil.rmtree(work, ignore_errors=True)
            raise
    ordered = [t for ts in tasks.values() for t in ts]
    redone = redo_changed_inputs(work, {str(i): list(d.paths) for i, d in days.items()},
                                 {str(i): [t.out for t in ordered if t.day == i] for i in days})
    for i, n in redone.items():  # (the plan checks the days' rows, not their contents: see dlrm.data.input_stamps)
        logger.warning(f"day {i}'s input files changed since the unfinished import began: its {n} finished "
                       f"file(s) are written again")
    started = time.perf_counter()
    try:
        # shown in a log file too (nohup, SLURM), redrawn once a minute there: disabled off a terminal, an import of
        # hours logged nothing between its first line and its last
        with ProgressBar(total=total, unit="rows", unit_scale=True, desc="import",
                         **{"mininterval": 1.0, **bar_interval()}) as bar:
            if workers <= 1:
                results = []
                for t in ordered:
                    results.append(_write_file(t, str(work)))
                    bar.update(t.hi - t.lo)
            else:
                pool = start_pool(workers, _init_worker)  # workers that leave Ctrl-C to this process
                try:
                    futures = [pool.submit(_write_file, t, str(work)) for t in ordered]
                    results = []
                    for t, fut in zip(ordered, futures):
                        results.append(fut.result())
                        bar.update(t.hi - t.lo)
                finally:  # after an error, the files not started are not started (those running finish)
                    pool.shutdown(wait=True, cancel_futures=True)
        done = dict(zip((t.out for t in ordered), results))  # file -> (rows, positives, written now)
        splits = {s: SplitInfo(sum(done[t.out][0] for t in ts), sum(done[t.out][1] for t in ts), [t.out for t in ts])
                  for s, ts in tasks.items() if ts}
        meta = Metadata(cardinalities=cards, multi_hot_sizes=sizes, hashing="modulus", splits=splits,
                        sparse_layout=layout, dense_format=dense_format, extra={
            "importer": "dlrm.data.mlperf_import",
            "source": str(input_dir),
            "train_days": train_days,
            "eval_day": eval_day,
            "max_rows_per_day": max_rows_per_day,
            "compression": compression,
            "dense": ("counts recovered as round(exp(d) - 3) from MLPerf's log(x + 3), negatives as 0"
                      if dense_format == "counts" else "MLPerf's log(x + 3) values as they are (float32)"),
        })
        write_metadata(work, meta)
        replace_dir(work, output)  # the plan goes with it (removed below): a failed rename leaves a resumable import
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt) and not work.exists():  # renamed into place whole: only the removal of
            # the replaced --output (--overwrite; a large one's takes a while) was cut, which the line must not
            # report as an import that wrote nothing ("--output was not written": it was)
            _remove_bookkeeping(output)
            raise InterruptedWhenComplete(output, interruption(e)[0]) from None
        finished = sum(1 for _ in work.rglob("*.parquet"))
        if finished == 0:
            # nothing to resume (the workers have stopped: the pool was shut down above). Kept, its plan refused the
            # corrected command (another --num-embeddings after an id outside its table, the usual first mistake)
            # as "an unfinished import with other options or input", which only --overwrite got past
            shutil.rmtree(work, ignore_errors=True)
            logger.info(f"no file was finished: {work} removed")
        else:
            same = "the same command without --overwrite" if overwrite else "the same command"  # (with it: over)
            logger.info(f"the {finished} of {len(ordered)} files finished are kept in {work}: {same} resumes from "
                        f"them (--overwrite starts over)")
        raise
    seconds = time.perf_counter() - started
    try:  # --output is complete from here on: an interrupt must not read as an import to redo
        _remove_bookkeeping(output)
        # the rate of the rows written now: a resume's kept files took no time (counted, a resume that wrote one day
        # of 24 claimed ~24x its rate)
        written = sum(rows for rows, _, now in done.values() if now)
        kept = f"; {counted(total - written, 'row', ',')} kept from the unfinished import" if written < total else ""
        logger.info(f"wrote {output} in {seconds:.1f}s ({written / max(seconds, 1e-9):,.0f} rows/s{kept}): "
                    + ", ".join(f"{s} {counted(i.rows, 'row', ',')}" for s, i in meta.splits.items()))
    except KeyboardInterrupt as e:
        raise InterruptedWhenComplete(output, interruption(e)[0]) from None
    return meta


class InterruptedWhenComplete(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM: `exit_code`) after --output was renamed into place whole: the dataset is complete, only
    the last log line was cut."""

    def __init__(self, output, exit_code: int = EXIT_INTERRUPTED) -> None:
        super().__init__(str(output))
        self.exit_code = exit_code


@click.command(cls=OneLineUsageCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--input", "input_dir", required=True,
              type=NonEmptyPath("MLPerf's folder of day files", file_okay=False, exists=True),
              help="MLPerf's folder of day_{i}_labels.npy, day_{i}_dense.npy and day_{i}_sparse_multi_hot.npz (or "
                   "TorchRec's one-hot day_{i}_sparse.npy).")
@click.option("--output", type=NonEmptyPath(file_okay=False), required=True, help="Dataset directory to create.")
@click.option("--train-days", default="0-22", show_default=True, help="Days whose rows train (e.g. 0-22, or 0,1).")
@click.option("--eval-day", type=click.IntRange(min=0), default=23, show_default=True,
              help="The day split in halves: validation (the first ceil(N/2) rows), then test.")
@click.option("--num-embeddings", default=None, metavar="N1,...,N26",
              help="Table sizes (multi-hot ids must be below their feature's; one-hot ids are taken modulo it, as "
                   "the reference reads them) [default: MLPerf's, 40M-capped].")
@click.option("--compression", type=click.Choice(CODECS), default="lz4", show_default=True,
              help="Parquet codec (lz4: multi-hot rows stream ~1.3x faster than from zstd, for ~1.4x the bytes).")
@click.option("--sparse-layout", type=click.Choice(SPARSE_LAYOUTS), default=SPARSE_LAYOUT, show_default=True,
              help="How multi-hot features are stored: slots, one int64 column a slot (schema version 3, read 1.6-2x "
                   "faster); lists, one list column a feature (version 2). The same values either way; refused for a "
                   "one-hot input (every npz member one id a row).")
@click.option("--dense", "dense_format", type=click.Choice(DENSE_FORMATS), default=DENSE_FORMAT, show_default=True,
              help="float: MLPerf's dense values as they are (float32 columns, schema version 4: the model sees "
                   "log(x + 3) as MLPerf's does); counts: int32 counts recovered as round(exp(d) - 3), fed as log1p.")
@click.option("--rows-per-file", type=click.IntRange(min=1), default=DEFAULT_ROWS_PER_FILE, show_default=True)
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Processes writing files [default: min(cores, 8)].")
@click.option("--max-rows-per-day", type=click.IntRange(min=1), default=None,
              help="Import only the first N rows of each day (a quick subset).")
@click.option("--overwrite", is_flag=True, help="Replace a non-empty --output directory.")
def main(input_dir, output, train_days, eval_day, num_embeddings, compression, sparse_layout, dense_format, rows_per_file,
         workers, max_rows_per_day, overwrite):
    """Import MLPerf DLRM-DCNv2's preprocessed multi-hot Criteo 1TB (see the module docstring).

    Exit codes: 0 done; 1 a bug (traceback, then a line saying so); 2 a bad input file, value or
    argument, or an occupied output; 4 out of memory (or a --workers process killed); 130 Ctrl-C; 143 SIGTERM.
    --output is written only when every file is done; the files an import finished before it stopped are kept
    for the same command to resume from.
    """
    configure_logging()
    try:  # SIGTERM raises as Ctrl-C does (`Terminated`): its default action skipped the import's own cleanup
        with StopAtOnce(interrupt=True):
            _main(input_dir, output, train_days, eval_day, num_embeddings, compression, sparse_layout, dense_format,
                  rows_per_file, workers, max_rows_per_day, overwrite,
                  click.get_current_context().get_parameter_source("sparse_layout") == ParameterSource.COMMANDLINE)
    except click.ClickException as e:
        logger.error(e.format_message())
        sys.exit(EXIT_BAD_INPUT)
    except InterruptedWhenComplete as e:  # 130 (143) still: a calling script must stop on Ctrl-C; nothing needs redoing
        code, what = interruption(e)
        logger.error(f"interrupted ({what}) after {e} was complete (metadata.json written); it is usable as it is")
        sys.exit(code)
    except KeyboardInterrupt as e:  # Ctrl-C (130), or SIGTERM (`Terminated`: 143)
        code, what = interruption(e)
        logger.error(f"interrupted ({what}); --output was not written")
        sys.exit(code)
    except OSError as e:
        logger.error(f"cannot read or write: {e.filename + ': ' if e.filename else ''}{e.strerror or e}")
        sys.exit(EXIT_BAD_INPUT)
    except (MemoryError, BrokenProcessPool):  # a worker killed (by the OOM killer, most often) breaks the pool: it
        # was reported as a bug, with BrokenProcessPool's traceback
        same = "the same command without --overwrite" if overwrite else "the same command"  # (with it: over)
        logger.error(f"out of memory (or a --workers process was killed): run {same} with fewer --workers; it "
                     "resumes from the finished files")
        sys.exit(EXIT_OUT_OF_MEMORY)
    except Exception as e:  # noqa: BLE001 - anything else is a bug: traceback and exit 1
        sys.exit(report_bug(e))


def _main(input_dir, output, train_days, eval_day, num_embeddings, compression, sparse_layout, dense_format,
          rows_per_file, workers, max_rows_per_day, overwrite, layout_given=False) -> None:
    """`main`'s work: the options parsed, then `import_mlperf` (`layout_given`: --sparse-layout was on the command
    line)."""
    try:
        days = parse_days(train_days)
    except click.BadParameter as e:
        raise ImportInputError(f"--train-days: {e.format_message()}") from None
    cards = None
    if num_embeddings is not None:
        try:
            cards = [int(v) for v in num_embeddings.split(",")]
        except ValueError:
            raise ImportInputError(f"--num-embeddings: {num_embeddings!r} is not {NUM_SPARSE} integers") from None
    check_parent_writable(Path(output), "--output")
    import_mlperf(Path(input_dir), Path(output), days, eval_day, cards, compression, rows_per_file,
                  workers or min(os.cpu_count() or 1, 8), max_rows_per_day, overwrite, sparse_layout, dense_format,
                  layout_given)


if __name__ == "__main__":
    main()
