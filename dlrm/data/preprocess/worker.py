"""One chunk: parse it, assign its lines to splits, write its shards (runs in a worker process).

The functions a pool runs (`_process_chunk`, `_stats_from_shard`) live at module level so that
spawned worker processes can unpickle them by name.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dlrm.data.preprocess.constants import _SPLIT_CODE
from dlrm.data.preprocess.cut_line import cut_last_line, drop_cut_line, unterminated_note
from dlrm.data.preprocess.errors import BadLine, BadLineError, PreprocessError
from dlrm.data.preprocess.parse import _to_table, parse_chunk
from dlrm.data.preprocess.scan import _iter_blocks
from dlrm.data.preprocess.splits import SplitPlan
from dlrm.data.preprocess.stats import feature_stats, sparse_stats
from dlrm.data.schema import (
    SPARSE_COLUMNS,
    SPLITS,
    slot_column,
    sparse_columns,
    write_options,
)
from dlrm.errors import os_errors_named


@dataclass
class _ChunkTask:
    """Everything a worker needs to turn one chunk into shards (pickled to the worker)."""

    file_index: int
    chunk_index: int
    path: str
    fmt: str
    offset: int
    length: int
    n_lines: int
    first_line: int  # 1-based line number in the file of the chunk's first line
    first_local: int  # 0-based data line of the file
    file_first_global: int  # global line number of the file's first data line
    data: bytes | None  # None: the worker reads [offset, offset+length) of the (plain) file
    plan: SplitPlan
    output: str
    row_group_rows: int
    compression: str
    compression_level: int | None
    on_bad_line: str
    count_cap: int | None
    multi_hot_sizes: list[int] | None = None  # None: one-hot
    sparse_layout: str = "lists"  # of a multi-hot feature's columns (`dlrm.data.schema.SparseLayout`)


@dataclass
class _ChunkResult:
    """A finished chunk (``record`` for done.jsonl, ``stats`` of its train rows) or its first bad line."""

    file_index: int
    chunk_index: int
    record: dict | None = None
    stats: list | None = None
    error: BadLine | None = None


def shard_name(split: str, file_index: int, chunk_index: int) -> str:
    """Path (relative to the dataset) of the shard with a chunk's rows of one split."""
    return f"{split}/part-{file_index:04d}-{chunk_index:06d}.parquet"


def _write_shard(path: Path, table, row_group_rows: int, compression: str, level: int | None,
                 options: dict | None = None) -> None:
    """Write a parquet shard atomically (temp file, fsync, rename): a kill never leaves half a shard.
    `options`: more pyarrow writer arguments (`dlrm.data.schema.write_options`)."""
    import pyarrow.parquet as pq

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        # a full disk's write or fsync error names no file: "error: [Errno 28] No space left on device" it said
        with os_errors_named(path), open(tmp, "wb") as fh:
            pq.write_table(
                table,
                fh,
                row_group_size=row_group_rows,
                compression=None if compression == "none" else compression,
                compression_level=level,
                **(options or {}),
            )
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _process_chunk(task: _ChunkTask) -> _ChunkResult:
    """Parse a chunk, split its lines and write one shard per split that has rows."""
    data = task.data
    if data is None:
        with open(task.path, "rb") as fh:
            fh.seek(task.offset)
            data = fh.read(task.length)
    cut = cut_last_line(data, task.fmt, task.path, task.first_line, task.multi_hot_sizes)
    if cut is not None:  # parse the lines before it: one of them may be the first bad line
        data = data[: data.rfind(b"\n") + 1]
    try:
        parsed = parse_chunk(data, task.fmt, on_bad_line=task.on_bad_line, source=task.path, first_line=task.first_line,
                             multi_hot_sizes=task.multi_hot_sizes)
    except BadLineError as e:
        return _ChunkResult(task.file_index, task.chunk_index, error=unterminated_note(e.bad, data, task.first_line))
    if cut is not None:
        if task.on_bad_line == "stop":
            return _ChunkResult(task.file_index, task.chunk_index, error=cut)
        parsed = drop_cut_line(parsed, cut)
    if parsed.n_lines != task.n_lines:
        raise PreprocessError(
            f"{task.path}: chunk {task.chunk_index} has {parsed.n_lines} lines where the count pass found "
            f"{task.n_lines}; did the file change during the run?"
        )
    local = task.first_local + parsed.lines()
    codes = task.plan.assign(task.file_first_global + local, task.file_index, local)
    out = Path(task.output)
    shards: dict[str, dict] = {}
    stats: list = []
    for name in SPLITS:
        mask = codes == _SPLIT_CODE[name]
        k = int(np.count_nonzero(mask))
        if k == 0:
            continue
        label, dense, sparse = parsed.take(None if k == parsed.num_rows else np.flatnonzero(mask))
        rel = shard_name(name, task.file_index, task.chunk_index)
        table = _to_table(label, dense, sparse, task.multi_hot_sizes, task.sparse_layout)
        _write_shard(out / rel, table, task.row_group_rows, task.compression, task.compression_level,
                     write_options(task.multi_hot_sizes, task.sparse_layout))
        shards[name] = {"file": rel, "rows": k, "positives": int(np.count_nonzero(label))}
        if name == "train":
            stats = sparse_stats(sparse, task.count_cap, task.multi_hot_sizes)
    record = {
        "file": task.file_index,
        "chunk": task.chunk_index,
        "lines": parsed.n_lines,
        "shards": shards,
        "bad": parsed.bad,
        "clipped": parsed.clipped,
    }
    if parsed.first_bad is not None:  # skip mode: where the first dropped line is, for the report
        record["first_bad"] = parsed.first_bad.message()
    return _ChunkResult(task.file_index, task.chunk_index, record=record, stats=stats)


def _stats_from_shard(args: tuple) -> tuple[tuple[int, int], list | None]:
    """Table statistics of a finished chunk, re-read from its train shard (when resuming): args are
    (path, file, chunk, count cap, multi_hot_sizes, layout), the run's own, which wrote the shard.
    None for a shard damaged since it was written (its footer intact, its data not): the caller
    redoes that chunk.

    The same as `sparse_stats` of the chunk's rows, in either layout: every value of a multi-hot
    feature counts, whether from a list or a slot column, and `feature_stats` drops the negative
    ones, so the `PAD_SPARSE` of empty slots counts no more than a missing -1 (in memory and in slot
    columns alike; a list holds no padding)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path, f, c, cap, sizes, layout = args
    try:
        table = pq.read_table(path, columns=sparse_columns(sizes, layout))
    except (OSError, pa.ArrowException):
        return (f, c), None
    stats = []
    for feature, name in enumerate(SPARSE_COLUMNS):
        names = [name] if name in table.column_names else [slot_column(feature, j) for j in range(sizes[feature])]
        stats.append(feature_stats(np.concatenate([_values(table.column(n)) for n in names]), cap))
    return (f, c), stats


def _values(column) -> np.ndarray:
    """The int64 values of a shard's sparse column; a list column's lists, flattened."""
    import pyarrow as pa

    if pa.types.is_list(column.type):
        column = pa.chunked_array([chunk.flatten() for chunk in column.chunks], pa.int64())
    return column.to_numpy()


def _iter_ranges(path: str, ranges: list[tuple[int, int]]) -> Iterator[bytes]:
    """The bytes of sorted, disjoint (start, end) ranges of a (decompressed) file, streaming."""
    blocks = _iter_blocks(Path(path))
    buf = bytearray()
    buf_start = 0  # file offset of buf[0]
    for start, end in ranges:
        while buf_start + len(buf) < end:
            try:
                b = next(blocks)
            except StopIteration:
                raise PreprocessError(f"{path}: shorter than at the count pass; did the file change?") from None
            buf += b
            if buf_start < start:
                drop = min(start - buf_start, len(buf))
                del buf[:drop]
                buf_start += drop
        yield bytes(buf[start - buf_start : end - buf_start])
        del buf[: end - buf_start]
        buf_start = end
