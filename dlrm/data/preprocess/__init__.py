"""Raw Criteo click logs (Kaggle ``train.txt``, Terabyte ``day_N``, TSV or CSV, plain or gzip) to a dataset.

The dataset follows the contract in `dlrm.data.schema`: ``train/``, ``validation/`` and ``test/``
parquet shards written with `arrow_schema()`, an optional ``vocab/`` directory, and
``metadata.json`` written last.

Pipeline (``python -m dlrm.preprocess --help`` for the options)::

    1. count pass   every input is read once (gzip decompressed as a stream); it counts the lines,
                    detects the format and records the byte offset where every chunk of
                    ``chunk_rows`` lines starts (parallel over files; a big plain file is
                    counted in byte ranges by all workers, `scan_file_parallel`).
    2. parse pass   every chunk is parsed by a vectorized numpy tokenizer (`parse_chunk`),
                    each line is given a split from its global line number (`SplitPlan`), and the
                    chunk's rows of each split become one shard ``<split>/part-FFFF-CCCCCC.parquet``
                    (FFFF = input file, CCCCCC = chunk of that file). Chunks run in worker
                    processes; plain files are read by the workers from the recorded offsets,
                    gzip files are decompressed by reader threads of the main process.
    3. tables       the distinct values (and, for vocabulary hashing, their frequencies) of the
                    train rows are merged in the main process (`DistinctCounter`).
    4. finish       vocabularies, then ``metadata.json``; the progress directory is removed.

Memory: at most two chunks per worker are in flight (``--chunk-rows`` lines each), whatever the
input size; the main process holds the distinct values of the train split (4 bytes per value, 8
with frequencies).

Bad input, ``--on-bad-line stop`` (default): the run fails with one line ``FILE:LINE: column C: 'VALUE'
...`` for the first bad line and writes no metadata.json; finished shards stay (complete, recorded)
so that a run with the same inputs resumes, and a run that finished nothing removes what it made.
``skip``: bad lines are dropped and counted per reason (`BAD_LINE_REASONS`) in the log and in
``metadata.extra["bad_lines"]``. Reasons: wrong number of fields (a plain file cut mid-line
included), label not 0/1, count not an integer (``260.0`` is one), category not 1 to 8 hex digits,
empty file, corrupt gzip (a truncated stream keeps its complete lines in skip mode; damage inside
the stream, where the decompressed bytes cannot be trusted, drops the whole file).

Resuming: the output directory holds ``_progress/`` while a run is unfinished: ``manifest.json``
(options, input fingerprints and the count pass), ``done.jsonl`` (one line per finished chunk,
appended after its shards were renamed into place) and ``stats.npz`` (a periodic checkpoint of the
distinct-value tables). A run started again with the same inputs and options skips the finished
chunks and re-derives the table statistics of finished chunks that the checkpoint does not cover
from their train shards, so the result is identical to an uninterrupted run: shard names and
contents and the split of every line depend only on the inputs and options, never on timing or on
the number of workers.
"""

from __future__ import annotations

import gzip
import json
import multiprocessing
import os
import queue
import re
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dlrm.data.schema import (
    DENSE_COLUMNS,
    MISSING_SPARSE,
    NUM_DENSE,
    NUM_SPARSE,
    SPARSE_COLUMNS,
    SPLITS,
    Metadata,
    SplitInfo,
    arrow_schema,
    vocab_path,
    write_json_atomic,
    write_metadata,
)

__all__ = [
    "BAD_LINE_REASONS",
    "BadLine",
    "BadLineError",
    "DistinctCounter",
    "FileScan",
    "ParsedChunk",
    "PreprocessError",
    "SplitPlan",
    "build_cli",
    "main",
    "parse_chunk",
    "preprocess",
    "scan_file",
]

NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE  # 40
# Column names of the raw files (and of the CSV header); used in error messages.
RAW_COLUMNS = ["label", *[f"I{i + 1}" for i in range(NUM_DENSE)], *[f"C{i + 1}" for i in range(NUM_SPARSE)]]
INT32_MAX = np.iinfo(np.int32).max

DEFAULT_CHUNK_ROWS = 262_144  # about 370 MB peak per worker (measured); one row group per full shard
DEFAULT_ROW_GROUP_ROWS = 262_144
DEFAULT_MAX_ROWS_PER_TABLE = 40_000_000
PROGRESS_DIR = "_progress"
MANIFEST_VERSION = 1

BAD_LINE_REASONS = ("wrong_field_count", "bad_label", "bad_integer", "bad_category", "empty_file", "corrupt_gzip")
# Options that change the output; a resumed run must use the same values.
_OUTPUT_OPTIONS = (
    "format",
    "split",
    "validation_fraction",
    "test_fraction",
    "seed",
    "hashing",
    "min_frequency",
    "max_rows_per_table",
    "chunk_rows",
    "row_group_rows",
    "compression",
    "compression_level",
    "on_bad_line",
)
_SPLIT_CODE = {name: i for i, name in enumerate(SPLITS)}  # train 0, validation 1, test 2
_READ_BLOCK = 1 << 24
_BLOCK_BYTES = 1 << 22  # parse_chunk works through blocks of about this size
_GZIP_ERRORS = (EOFError, gzip.BadGzipFile, zlib.error)


# --------------------------------------------------------------------------------------------
# errors


class PreprocessError(Exception):
    """Bad input or a refused output directory; the message is one line meant for the user."""


@dataclass(frozen=True)
class BadLine:
    """The first bad line of a chunk or file: where it is and why it is bad."""

    path: str
    line: int | None  # 1-based line number in the file (the CSV header is line 1); None: whole file
    reason: str  # one of BAD_LINE_REASONS
    column: str | None = None  # raw column name (label, I1..I13, C1..C26)
    value: str | None = None
    detail: str = ""

    def message(self) -> str:
        where = self.path if self.line is None else f"{self.path}:{self.line}"
        if self.column is not None:
            return f"{where}: column {self.column}: {self.value!r} {self.detail}"
        return f"{where}: {self.detail}"


class BadLineError(PreprocessError):
    """Raised in ``on_bad_line="stop"`` mode; ``.bad`` is the `BadLine`."""

    def __init__(self, bad: BadLine):
        super().__init__(bad.message())
        self.bad = bad

    def __reduce__(self):
        return (BadLineError, (self.bad,))


# --------------------------------------------------------------------------------------------
# chunk parser


@dataclass
class ParsedChunk:
    """The rows of one chunk that passed validation, in line order.

    ``dense`` is (13, n) int32 and ``sparse`` (26, n) int64, so that each column is contiguous.
    ``line_index[i]`` is the 0-based line (within the chunk) of row i; None means row i is line i
    (no line was dropped).
    """

    label: np.ndarray
    dense: np.ndarray
    sparse: np.ndarray
    n_lines: int
    line_index: np.ndarray | None = None
    bad: dict[str, int] = field(default_factory=dict)
    first_bad: BadLine | None = None
    clipped: int = 0

    @property
    def num_rows(self) -> int:
        return int(self.label.shape[0])

    def lines(self) -> np.ndarray:
        """0-based line (within the chunk) of every row."""
        return np.arange(self.num_rows, dtype=np.int64) if self.line_index is None else self.line_index

    def take(self, idx: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if idx is None:
            return self.label, self.dense, self.sparse
        return self.label[idx], self.dense[:, idx], self.sparse[:, idx]

    def to_table(self, idx: np.ndarray | None = None):
        """A `pyarrow.Table` with `arrow_schema()` (of the rows ``idx``, default all)."""
        return _to_table(*self.take(idx))


def _to_table(label: np.ndarray, dense: np.ndarray, sparse: np.ndarray):
    import pyarrow as pa

    arrays = [pa.array(np.ascontiguousarray(label, dtype=np.int8))]
    arrays += [pa.array(np.ascontiguousarray(dense[i], dtype=np.int32)) for i in range(NUM_DENSE)]
    arrays += [pa.array(np.ascontiguousarray(sparse[i], dtype=np.int64)) for i in range(NUM_SPARSE)]
    return pa.Table.from_arrays(arrays, schema=arrow_schema())


_PAD = 8  # bytes in front of the data, so that an 8-byte window ending at any field is in bounds
_HEX_LUT = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX_LUT[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX_LUT[_c] = 10 + _i
_HEX_PAIR_LUT = np.full(1 << 16, 0x100, dtype=np.uint16)
_hex_ok = np.flatnonzero(_HEX_LUT != 255)
_HEX_PAIR_LUT[(_hex_ok[None, :] << 8) | _hex_ok[:, None]] = (_HEX_LUT[_hex_ok][:, None] << 4) | _HEX_LUT[_hex_ok][None, :]
del _hex_ok
_M64 = (1 << 64) - 1
# An 8-byte little-endian window that ends where a field of L characters ends holds the field in
# its top L bytes; _KEEP[L] selects them and _FILL[L] sets the other bytes to ASCII '0'.
_KEEP = np.array([0] + [(_M64 << (8 * (8 - n))) & _M64 for n in range(1, 9)], dtype=np.uint64)
_FILL = np.array([0x3030303030303030 & ~int(k) & _M64 for k in _KEEP], dtype=np.uint64)
_U = np.uint64
_DENSE_RE = re.compile(rb"[+-]?[0-9]+(?:\.[0-9]*)?")
_HEX_RE = re.compile(rb"[0-9a-fA-F]{1,8}")


def _delimiter_of(fmt: str) -> bytes:
    if fmt == "tsv":
        return b"\t"
    if fmt == "csv":
        return b","
    raise ValueError(f"format must be 'tsv' or 'csv', got {fmt!r}")


class _Buffer:
    """The chunk bytes with padding, and fast unaligned 8-byte loads from it."""

    def __init__(self, body: bytes | np.ndarray):
        raw = np.frombuffer(body, dtype=np.uint8) if isinstance(body, (bytes, bytearray)) else body
        size = _PAD + raw.shape[0] + 2 * _PAD
        size += -size % 8
        self.buf = np.empty(size, dtype=np.uint8)
        self.buf[:_PAD] = 10
        self.buf[_PAD : _PAD + raw.shape[0]] = raw
        self.buf[_PAD + raw.shape[0] :] = 10
        self.body = self.buf[_PAD : _PAD + raw.shape[0]]
        self.words = self.buf.view("<u8")

    def load8(self, start: np.ndarray) -> np.ndarray:
        """buf[start:start+8] of every element as a little-endian uint64 (byte 0 lowest)."""
        q = start >> 3
        sh = ((start & 7) << 3).astype(np.uint64)
        lo = self.words.take(q)
        hi = self.words.take(q + 1)
        lo >>= sh
        hi <<= _U(64) - sh  # numpy defines a shift by >= 64 bits as 0
        lo |= hi
        return lo


def _slow_int(b: bytes) -> int | None:
    """The reference grammar of a count: ``[+-]digits[.digits]`` with an all-zero fraction."""
    if _DENSE_RE.fullmatch(b) is None:
        return None
    whole, _, frac = b.partition(b".")
    if frac.strip(b"0"):
        return None
    return int(whole)


def _slow_hex(b: bytes) -> int | None:
    return int(b, 16) if _HEX_RE.fullmatch(b) is not None else None


def _parse_dense_column(cb: _Buffer, s, e, out_bad: list, out_clipped: list, col: int):
    """Decimal counts between s and e: missing -> 0, negative -> 0, > int32 max -> clipped.

    Fast path (vectorized SWAR on 8-byte words): ``-?`` and up to 8 digits, optionally followed
    by ``.0`` (the CSV variant). Anything else goes through `_slow_int` one value at a time.
    Appends the rows of bad values to ``out_bad`` and of clipped values to ``out_clipped``.
    """
    buf = cb.buf
    n_len = e - s
    present = n_len > 0
    neg = present & (buf[s] == 45)  # '-'
    s2 = s + neg
    dot0 = (e - s2 >= 3) & (buf[e - 1] == 48) & (buf[e - 2] == 46)  # ends with ".0"
    e2 = e - 2 * dot0
    n2 = e2 - s2
    fast = present & (n2 <= 8) & (n2 >= 1)
    n2c = np.where(fast, n2, 0)
    x = cb.load8(e2 - 8)
    x &= _KEEP.take(n2c)
    x |= _FILL.take(n2c)
    hi = _U(0xF0F0F0F0F0F0F0F0)
    zeros = _U(0x3030303030303030)
    ok = (x & hi) == zeros
    ok &= ((x + _U(0x0606060606060606)) & hi) == zeros
    ok &= fast
    x -= zeros
    x = (x * _U(10) + (x >> _U(8))) & _U(0x00FF00FF00FF00FF)
    x = (x * _U(100) + (x >> _U(16))) & _U(0x0000FFFF0000FFFF)
    x = (x * _U(10000) + (x >> _U(32))) & _U(0x00000000FFFFFFFF)
    x[~ok | neg] = 0
    values = x.astype(np.int32)  # <= 99_999_999 fits
    slow = np.flatnonzero(present & ~ok)
    if slow.size:
        bad, clipped = [], []
        for i in slow.tolist():
            v = _slow_int(buf[s[i] : e[i]].tobytes())
            if v is None:
                bad.append(i)
            elif v > INT32_MAX:
                values[i] = INT32_MAX
                clipped.append(i)
            else:
                values[i] = max(v, 0)
        if bad:
            out_bad.append((np.asarray(bad, dtype=np.int64), col))
        if clipped:
            out_clipped.append(np.asarray(clipped, dtype=np.int64))
    return values


def _parse_label_column(buf, s, e, out_bad: list):
    n_len = e - s
    c = buf[s]
    ok = (n_len == 1) & ((c == 48) | (c == 49))
    label = np.where(ok, c - 48, 0).astype(np.int8)
    slow = np.flatnonzero(~ok)
    if slow.size:
        bad = []
        for i in slow.tolist():
            v = _slow_int(buf[s[i] : e[i]].tobytes())
            if v in (0, 1):
                label[i] = v
            else:
                bad.append(i)
        if bad:
            out_bad.append((np.asarray(bad, dtype=np.int64), 0))
    return label


def _parse_sparse_column(cb: _Buffer, s, e, out_bad: list, col: int):
    """Hex hashes: missing -> MISSING_SPARSE; 8 digits vectorized, 1..7 digits one at a time."""
    n_len = e - s
    # two characters at a time through a 64k-entry table: byte value, or >= 0x100 if not hex
    pairs = _HEX_PAIR_LUT.take(cb.load8(s).view(np.uint16))
    ok = (pairs.view("<u8") & _U(0xFF00FF00FF00FF00)) == 0
    ok &= n_len == 8
    values = pairs.astype(np.uint8).view(">u4").astype(np.int64)
    values[~ok] = MISSING_SPARSE
    slow = np.flatnonzero(~ok & (n_len != 0))
    if slow.size:
        buf = cb.buf
        bad = []
        for i in slow.tolist():
            v = _slow_hex(buf[s[i] : e[i]].tobytes())
            if v is None:
                bad.append(i)
            else:
                values[i] = v
        if bad:
            out_bad.append((np.asarray(bad, dtype=np.int64), col))
    return values


def _bad_detail(col: int) -> tuple[str, str]:
    if col == 0:
        return "bad_label", "is not a label (0 or 1)"
    if col <= NUM_DENSE:
        return "bad_integer", "is not an integer"
    return "bad_category", "is not a hexadecimal category hash (1 to 8 hex digits)"


def parse_chunk(
    data: bytes,
    fmt: str = "tsv",
    *,
    on_bad_line: str = "stop",
    source: str = "<chunk>",
    first_line: int = 1,
) -> ParsedChunk:
    """Parse the lines of one chunk (no header) into label/dense/sparse arrays.

    Every line must have 40 fields: label (0/1), 13 counts, 26 categories. Empty fields are
    missing values (count -> 0, category -> ``MISSING_SPARSE``). Counts: ``[+-]digits``,
    optionally ``.digits`` that are all zero (``260.0``); negative counts are stored as 0 and
    counts above int32 max are clipped to it (counted in ``clipped``). Categories: 1 to 8 hex
    digits (either case). CRLF line ends are accepted.

    The common path is vectorized: one pass finds all separators, the 40 field boundaries of
    every line are a reshape, counts are decoded eight bytes at a time (SWAR) and 8-digit hex
    hashes through a lookup table. Values the fast path does not take (long numbers, short hex,
    anything malformed) are checked one at a time.

    Args:
        data: the bytes of whole lines (the last one may lack its newline).
        fmt: "tsv" or "csv".
        on_bad_line: "stop" raises `BadLineError` for the first bad line; "skip" drops bad lines
            and counts them per reason in ``.bad``.
        source, first_line: file name and line number of the chunk's first line (for messages).
    """
    delim = _delimiter_of(fmt)[0]
    if data and not data.endswith(b"\n"):
        data += b"\n"  # first, so that a last line ending in CR without LF counts as CRLF
    if b"\r" in data:
        data = data.replace(b"\r\n", b"\n")  # a lone CR stays inside its field and fails validation
    # Work through the chunk in cache-sized blocks of whole lines (several times faster than
    # whole-chunk numpy passes), then concatenate.
    blocks: list[ParsedChunk] = []
    line = first_line
    start = 0
    while start < len(data):
        end = data.find(b"\n", min(start + _BLOCK_BYTES, len(data)) - 1) + 1
        part = _parse_block(data[start:end], delim, source, line)
        if part.first_bad is not None and on_bad_line == "stop":
            raise BadLineError(part.first_bad)
        blocks.append(part)
        line += part.n_lines
        start = end
    if len(blocks) == 1:
        return blocks[0]
    return _concat_blocks(blocks)


def _concat_blocks(blocks: list[ParsedChunk]) -> ParsedChunk:
    n_lines = sum(b.n_lines for b in blocks)
    label = np.concatenate([b.label for b in blocks]) if blocks else np.empty(0, np.int8)
    dense = np.concatenate([b.dense for b in blocks], axis=1) if blocks else np.empty((NUM_DENSE, 0), np.int32)
    sparse = np.concatenate([b.sparse for b in blocks], axis=1) if blocks else np.empty((NUM_SPARSE, 0), np.int64)
    line_index = None
    bad: dict[str, int] = {}
    first_bad = None
    if any(b.line_index is not None for b in blocks):
        offsets = np.cumsum([0] + [b.n_lines for b in blocks[:-1]])
        line_index = np.concatenate([b.lines() + off for b, off in zip(blocks, offsets)])
    for b in blocks:
        for k, v in b.bad.items():
            bad[k] = bad.get(k, 0) + v
        if first_bad is None and b.first_bad is not None:
            first_bad = b.first_bad
    return ParsedChunk(label, dense, sparse, n_lines, line_index, bad, first_bad, sum(b.clipped for b in blocks))


def _parse_block(data: bytes, delim: int, source: str, first_line: int) -> ParsedChunk:
    """`parse_chunk` of newline-terminated lines; never raises, bad lines are in the result."""
    n_lines = data.count(b"\n")
    cb = _Buffer(data)

    line_index = None
    bad_counts: dict[str, int] = {}
    first_bad: BadLine | None = None
    n = n_lines
    pos = _separators(cb.body, delim, n, data.count(bytes([delim])))
    if pos is None:
        # Some line has the wrong number of fields (or a stray control byte): find them exactly,
        # then parse the good lines only.
        body = cb.body
        nl = np.flatnonzero(body == 10)
        dl = np.flatnonzero(body == delim)
        line_start = np.concatenate(([0], nl[:-1] + 1))
        nfields = np.searchsorted(dl, nl) - np.searchsorted(dl, line_start) + 1
        good = nfields == NUM_FIELDS
        bad_lines = np.flatnonzero(~good)
        if bad_lines.size:
            bad_counts["wrong_field_count"] = int(bad_lines.size)
            i = int(bad_lines[0])
            found = "an empty line" if nl[i] == line_start[i] else f"{int(nfields[i])}"
            first_bad = BadLine(
                source,
                first_line + i,
                "wrong_field_count",
                detail=f"expected {NUM_FIELDS} fields separated by {chr(delim)!r}, found {found}",
            )
        line_index = np.flatnonzero(good)
        n = int(line_index.size)
        cb = _Buffer(body[np.repeat(good, nl - line_start + 1)])
        pos = _separators(cb.body, delim, n, n * (NUM_FIELDS - 1), exact=True)
        assert pos is not None
    pos += _PAD
    # (40, n): ends[c] = position of the separator after field c of every line
    ends = np.ascontiguousarray(pos.reshape(n, NUM_FIELDS).T)
    del pos
    starts = np.empty_like(ends)
    starts[1:] = ends[:-1]
    starts[0, 1:] = ends[-1, :-1]
    if n:
        starts[0, 0] = _PAD - 1
    starts += 1

    value_bad: list[tuple[np.ndarray, int]] = []
    clipped_rows: list[np.ndarray] = []
    label = _parse_label_column(cb.buf, starts[0], ends[0], value_bad)
    dense = np.empty((NUM_DENSE, n), dtype=np.int32)
    for j in range(NUM_DENSE):
        c = 1 + j
        dense[j] = _parse_dense_column(cb, starts[c], ends[c], value_bad, clipped_rows, c)
    sparse = np.empty((NUM_SPARSE, n), dtype=np.int64)
    for j in range(NUM_SPARSE):
        c = 1 + NUM_DENSE + j
        sparse[j] = _parse_sparse_column(cb, starts[c], ends[c], value_bad, c)
    keep_rows = None
    if value_bad:
        first_col = np.full(n, NUM_FIELDS, dtype=np.int64)
        for rows, col in value_bad:
            first_col[rows] = np.minimum(first_col[rows], col)
        bad_rows = np.flatnonzero(first_col < NUM_FIELDS)
        r = int(bad_rows[0])
        line_of_r = r if line_index is None else int(line_index[r])
        if first_bad is None or first_line + line_of_r < first_bad.line:
            col = int(first_col[r])
            reason, detail = _bad_detail(col)
            value = cb.buf[starts[col, r] : ends[col, r]].tobytes().decode("utf-8", "replace")
            if len(value) > 40:
                value = value[:40] + "..."
            first_bad = BadLine(source, first_line + line_of_r, reason, RAW_COLUMNS[col], value, detail)
        cols = first_col[bad_rows]
        for reason, count in (
            ("bad_label", int(np.count_nonzero(cols == 0))),
            ("bad_integer", int(np.count_nonzero((cols >= 1) & (cols <= NUM_DENSE)))),
            ("bad_category", int(np.count_nonzero(cols > NUM_DENSE))),
        ):
            if count:
                bad_counts[reason] = bad_counts.get(reason, 0) + count
        keep_rows = first_col == NUM_FIELDS
        label, dense, sparse = label[keep_rows], dense[:, keep_rows], sparse[:, keep_rows]
        base = np.arange(n, dtype=np.int64) if line_index is None else line_index
        line_index = base[keep_rows]
    clipped = 0
    for rows in clipped_rows:  # clipped values of dropped rows do not count
        clipped += int(rows.size if keep_rows is None else np.count_nonzero(keep_rows[rows]))
    return ParsedChunk(label, dense, sparse, n_lines, line_index, bad_counts, first_bad, clipped)


def _separators(body: np.ndarray, delim: int, n_lines: int, n_delim: int, exact: bool = False) -> np.ndarray | None:
    """Positions (int64) of the 40 separators of every line, or None if a line has another count.

    ``n_delim`` is the number of delimiter bytes in ``body``.
    """
    if n_lines == 0:
        return np.empty(0, dtype=np.int64)
    if n_delim != (NUM_FIELDS - 1) * n_lines:
        return None
    if delim == 9 and not exact:
        # Tab (9) and newline (10) are the only bytes <= 10 in well-formed data: with the tab and
        # newline counts right, any other such byte makes the total come out wrong.
        pos = np.flatnonzero(body <= 10)
    else:
        pos = np.flatnonzero((body == delim) | (body == 10))
    if pos.shape[0] != NUM_FIELDS * n_lines:
        return None
    # every 40th separator must be the line's newline (then every line has 39 delimiters)
    if not np.all(body[pos[NUM_FIELDS - 1 :: NUM_FIELDS]] == 10):
        return None
    return pos


# --------------------------------------------------------------------------------------------
# count pass


def _is_gzip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"


def _iter_blocks(path: Path, block: int = _READ_BLOCK) -> Iterator[bytes]:
    """The (decompressed) bytes of a file in blocks; the same sequence every time it is read.

    A truncated or corrupt gzip stream raises (EOFError, gzip.BadGzipFile, zlib.error) after
    yielding everything that could be decompressed before the damage.
    """
    with open(path, "rb") as raw:
        if raw.read(2) != b"\x1f\x8b":
            raw.seek(0)
            while b := raw.read(block):
                yield b
            return
        raw.seek(0)
        f = gzip.GzipFile(fileobj=raw, mode="rb")
        parts: list[bytes] = []
        size = 0
        while True:
            try:
                b = f.read1(block)  # one decompression step: keeps the data before an error
            except _GZIP_ERRORS:
                if parts:
                    yield b"".join(parts)
                raise
            if not b:
                break
            parts.append(b)
            size += len(b)
            if size >= block:
                yield b"".join(parts)
                parts, size = [], 0
        if parts:
            yield b"".join(parts)




@dataclass
class FileScan:
    """What the count pass learned about one input file.

    ``offsets[k]`` is the (decompressed) byte offset where chunk k starts; ``offsets[-1]`` is the
    end of the data (for a corrupt gzip: the end of its last complete line). ``lines`` counts
    data lines (not the CSV header). ``error`` is set for an empty file or a corrupt gzip.

    ``prefix_trusted`` (corrupt gzip only): True when the stream just ends early (a truncated
    download: ``EOFError``), so the lines decompressed before the cut are the file's first lines;
    False for damage inside the stream (a CRC mismatch, invalid deflate data), where the
    decompressed bytes before the error may already be wrong. ``--on-bad-line skip`` keeps the
    complete lines of a trusted prefix and drops the whole file otherwise.
    """

    path: str
    compressed: bool
    format: str
    header: bool
    size: int
    lines: int
    offsets: list[int]
    error: str | None = None  # "empty_file" | "corrupt_gzip"
    error_detail: str = ""
    prefix_trusted: bool = True

    @property
    def num_chunks(self) -> int:
        return len(self.offsets) - 1

    def bad_line(self) -> BadLine | None:
        if self.error == "empty_file":
            return BadLine(self.path, None, "empty_file", detail="empty file (no data lines)")
        if self.error == "corrupt_gzip":
            if not self.prefix_trusted:  # the damage is somewhere before the point of failure
                return BadLine(self.path, None, "corrupt_gzip", detail=self.error_detail)
            line = self.lines + (2 if self.header else 1)
            return BadLine(self.path, line, "corrupt_gzip", detail=self.error_detail)
        return None

    def without_data(self) -> FileScan:
        """This file with no lines (``--on-bad-line skip`` of a gzip corrupt inside the stream)."""
        return FileScan(self.path, self.compressed, self.format, self.header, self.size, 0, [0],
                        self.error, self.error_detail, self.prefix_trusted)


def _gzip_problem(e: BaseException) -> tuple[str, bool]:
    """One-line description of a gzip error, and whether the data decompressed before it is sound."""
    if isinstance(e, EOFError):
        return f"truncated gzip stream ({e})", True
    if isinstance(e, gzip.BadGzipFile) and str(e).startswith("Not a gzipped file"):
        # garbage after a complete member: everything before it passed its CRC check
        return f"unreadable data after the end of a gzip member ({e})", True
    return f"corrupt gzip stream ({type(e).__name__}: {e}); the data before this point cannot be trusted", False


def _detect_format(first_line: bytes, path: Path, fmt: str) -> tuple[str, bool]:
    if fmt == "auto":
        if b"\t" in first_line:
            fmt = "tsv"
        elif b"," in first_line:
            fmt = "csv"
        else:
            raise PreprocessError(
                f"{path}:1: cannot detect the format (no tab or comma in the first line); use --format"
            )
    delim = _delimiter_of(fmt)
    fields = first_line.rstrip(b"\r\n").split(delim)
    header = fields[0].strip() == b"label"
    if header and len(fields) != NUM_FIELDS:
        raise PreprocessError(f"{path}:1: the header has {len(fields)} fields, expected {NUM_FIELDS}")
    return fmt, header


def scan_file(path: str | os.PathLike, fmt: str = "auto", chunk_rows: int = DEFAULT_CHUNK_ROWS) -> FileScan:
    """The count pass over one file: lines, format, header and chunk start offsets.

    Reads the file once (gzip decompressed as a stream, detected by its magic bytes) counting
    b"\\n" per block. Does not raise for an empty file or a corrupt gzip: see ``FileScan.error``.
    """
    path = Path(path)
    blocks = _iter_blocks(path)
    compressed = _is_gzip(path)
    pending: list[bytes] = []
    error = None
    detail = ""
    trusted = True
    try:
        for b in blocks:  # enough blocks for the first line
            pending.append(b)
            if b"\n" in b or sum(len(p) for p in pending) >= (1 << 20):
                break
    except _GZIP_ERRORS as e:
        error = "corrupt_gzip"
        detail, trusted = _gzip_problem(e)
    first_line = b"".join(pending).split(b"\n", 1)[0].rstrip(b"\r")
    if first_line:
        fmt, header = _detect_format(first_line, path, fmt)
    else:  # empty file, or an empty first line (a bad line)
        fmt, header = ("tsv" if fmt == "auto" else fmt), False
    h = 1 if header else 0

    offsets: list[int] = []  # chunk starts (decompressed offsets)
    next_chunk = 0  # index of the next chunk whose start we look for
    seen = 0  # newlines seen so far
    base = 0  # offset of the current block
    last_nl_end = 0  # offset just after the last newline seen
    last_byte = b""

    def handle(b: bytes) -> None:
        nonlocal next_chunk, seen, base, last_nl_end, last_byte
        cnt = b.count(b"\n")
        nlpos = None
        while True:
            # chunk k starts after newline number k*R + h (1-based); chunk 0 without header at 0
            target = next_chunk * chunk_rows + h
            if target == 0:
                offsets.append(0)
                next_chunk += 1
                continue
            if target > seen + cnt:
                break
            if nlpos is None:
                nlpos = np.flatnonzero(np.frombuffer(b, dtype=np.uint8) == 10)
            offsets.append(base + int(nlpos[target - seen - 1]) + 1)
            next_chunk += 1
        if cnt:
            last_nl_end = base + b.rfind(b"\n") + 1
        seen += cnt
        base += len(b)
        last_byte = b[-1:]

    try:
        for b in pending:
            handle(b)
        if error is None:
            for b in blocks:
                handle(b)
    except _GZIP_ERRORS as e:
        error = "corrupt_gzip"
        detail, trusted = _gzip_problem(e)
    if error is None:
        end = base
        lines = seen + (1 if base > 0 and last_byte != b"\n" else 0) - h
    else:
        end = last_nl_end
        lines = seen - h
        if trusted:
            detail += f" after {max(lines, 0)} complete data lines"
    lines = max(lines, 0)
    n_chunks = -(-lines // chunk_rows)
    offsets = offsets[:n_chunks] + [end]
    if lines == 0 and error is None:
        error = "empty_file"
    return FileScan(str(path), compressed, fmt, header, base, lines, offsets, error, detail, trusted)


_PARALLEL_SCAN_MIN_BYTES = 64 << 20  # plain files at least this big are counted in parallel
_SCAN_RANGE_BYTES = 32 << 20  # about this many bytes per counting task


def _count_newlines(args: tuple[str, int, int]) -> int:
    """Newlines in bytes [start, end) of a plain file."""
    path, start, end = args
    n = 0
    with open(path, "rb") as f:
        f.seek(start)
        left = end - start
        while left > 0:
            b = f.read(min(_READ_BLOCK, left))
            if not b:
                break
            n += b.count(b"\n")
            left -= len(b)
    return n


def _newline_offsets(args: tuple[str, int, int, int, list[int]]) -> list[int]:
    """Offsets just after the newlines numbered ``targets`` (1-based over the file, sorted) that lie
    in bytes [start, end), of which ``before`` newlines precede ``start``."""
    path, start, end, before, targets = args
    out: list[int] = []
    seen = before
    base = start
    t = 0
    with open(path, "rb") as f:
        f.seek(start)
        while base < end and t < len(targets):
            b = f.read(min(_READ_BLOCK, end - base))
            if not b:
                break
            cnt = b.count(b"\n")
            if targets[t] <= seen + cnt:
                nl = np.flatnonzero(np.frombuffer(b, dtype=np.uint8) == 10)
                while t < len(targets) and targets[t] <= seen + cnt:
                    out.append(base + int(nl[targets[t] - seen - 1]) + 1)
                    t += 1
            seen += cnt
            base += len(b)
    return out


def scan_file_parallel(path: str | os.PathLike, fmt: str, chunk_rows: int, executor, n_tasks: int) -> FileScan:
    """`scan_file` of a plain (not gzip) file with the reading spread over ``executor``: newlines
    are counted in byte ranges in parallel, then the chunk starts are found in the ranges that hold
    them. Same result as `scan_file`."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(1 << 20)
        f.seek(max(size - 1, 0))
        last_byte = f.read(1)
    first_line = head.split(b"\n", 1)[0].rstrip(b"\r")
    if first_line:
        fmt, header = _detect_format(first_line, path, fmt)
    else:
        fmt, header = ("tsv" if fmt == "auto" else fmt), False
    h = 1 if header else 0
    n_ranges = max(1, min(max(n_tasks, -(-size // _SCAN_RANGE_BYTES)), 1024))
    bounds = [size * i // n_ranges for i in range(n_ranges + 1)]
    ranges = [(str(path), bounds[i], bounds[i + 1]) for i in range(n_ranges)]
    counts = list(executor.map(_count_newlines, ranges))
    before = np.concatenate(([0], np.cumsum(counts))).astype(np.int64).tolist()
    seen = before[-1]
    lines = max(seen + (1 if size > 0 and last_byte != b"\n" else 0) - h, 0)
    n_chunks = -(-lines // chunk_rows)
    offsets: list[int] = []
    wanted: list[list[int]] = [[] for _ in ranges]
    for k in range(n_chunks):
        target = k * chunk_rows + h  # chunk k starts after newline number `target` (1-based)
        if target == 0:
            continue
        i = int(np.searchsorted(before, target, side="left")) - 1  # before[i] < target <= before[i + 1]
        wanted[i].append(target)
    jobs = [(str(path), bounds[i], bounds[i + 1], before[i], wanted[i]) for i in range(n_ranges) if wanted[i]]
    for found in executor.map(_newline_offsets, jobs):
        offsets += found
    if n_chunks and h == 0:
        offsets.insert(0, 0)
    offsets = offsets[:n_chunks] + [size]
    error = "empty_file" if lines == 0 else None
    return FileScan(str(path), False, fmt, header, size, lines, offsets, error)


# --------------------------------------------------------------------------------------------
# splits


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + _U(0x9E3779B97F4A7C15)
    x = (x ^ (x >> _U(30))) * _U(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U(27))) * _U(0x94D049BB133111EB)
    return x ^ (x >> _U(31))


def random_uniform(seed: int, index: np.ndarray) -> np.ndarray:
    """Counter-based uniforms in [0, 1): a pure function of (seed, index) (splitmix64 twice)."""
    with np.errstate(over="ignore"):
        key = _splitmix64(np.array([seed & _M64], dtype=np.uint64))[0]
        x = _splitmix64(_splitmix64(index.astype(np.uint64) ^ key))
    return (x >> _U(11)).astype(np.float64) * (1.0 / (1 << 53))


@dataclass(frozen=True)
class SplitPlan:
    """Which split every line goes to, from its global line number (0-based over all inputs).

    sequential (Kaggle, as facebookresearch/dlrm): the lines are cut into 7 parts like
        ``np.array_split(range(T), 7)``; parts 0-5 are train, the first half of part 6
        (rounded up) is test, the rest validation.
    days (Terabyte): every file but the last is train; the last file's first half (rounded up)
        is test, the rest validation.
    random: line g goes to test if u(seed, g) < test_fraction, else to validation if
        u < test_fraction + validation_fraction, else to train.
    """

    mode: str
    total_lines: int
    train_end: int = 0  # sequential: [0, train_end) train
    test_end: int = 0  # sequential: [train_end, test_end) test, the rest validation
    last_file: int = 0  # days
    last_file_test_lines: int = 0  # days
    seed: int = 0
    validation_fraction: float = 0.0
    test_fraction: float = 0.0

    @staticmethod
    def build(mode: str, file_lines: list[int], *, seed: int = 0, validation_fraction: float = 0.0,
              test_fraction: float = 0.0) -> SplitPlan:
        total = sum(file_lines)
        if mode == "sequential":
            per, extra = divmod(total, 7)
            train_end = 6 * per + min(extra, 6)
            last = total - train_end
            return SplitPlan(mode, total, train_end=train_end, test_end=train_end + (last + 1) // 2)
        if mode == "days":
            n_last = file_lines[-1]
            return SplitPlan(mode, total, last_file=len(file_lines) - 1, last_file_test_lines=(n_last + 1) // 2)
        if mode == "random":
            return SplitPlan(mode, total, seed=seed, validation_fraction=validation_fraction,
                             test_fraction=test_fraction)
        raise ValueError(f"unknown split {mode!r}")

    def assign(self, global_index: np.ndarray, file_index: int, local_index: np.ndarray) -> np.ndarray:
        """Split codes (0 train, 1 validation, 2 test; the order of `SPLITS`) of the given lines."""
        out = np.zeros(global_index.shape[0], dtype=np.int8)
        tr, va, te = (_SPLIT_CODE[s] for s in ("train", "validation", "test"))
        if self.mode == "sequential":
            out[:] = tr
            out[global_index >= self.train_end] = te
            out[global_index >= self.test_end] = va
        elif self.mode == "days":
            out[:] = tr
            if file_index == self.last_file:
                out[:] = va
                out[local_index < self.last_file_test_lines] = te
        else:
            u = random_uniform(self.seed, global_index)
            out[:] = tr
            out[u < self.test_fraction + self.validation_fraction] = va
            out[u < self.test_fraction] = te
        return out

    def describe(self) -> str:
        if self.mode == "sequential":
            return (f"sequential over {self.total_lines} lines: [0, {self.train_end}) train, "
                    f"[{self.train_end}, {self.test_end}) test, [{self.test_end}, {self.total_lines}) validation")
        if self.mode == "days":
            return (f"days: files 0..{self.last_file - 1} train; file {self.last_file}: first "
                    f"{self.last_file_test_lines} lines test, the rest validation")
        return (f"random (seed {self.seed}): test if u < {self.test_fraction:.12g}, validation if u < "
                f"{self.test_fraction + self.validation_fraction:.12g}, else train; u = splitmix64(seed, line)")


# --------------------------------------------------------------------------------------------
# distinct values and frequencies


class DistinctCounter:
    """Exact distinct values (and saturating frequencies) of the 26 sparse features.

    Values are the 32-bit hashes (stored as uint32: 4 bytes per distinct value; vocabulary mode
    adds a uint32 count: 8 bytes). Chunks add their sorted unique values to a pending list that
    is merged (sort + dedup) into the feature's sorted array once it is as large as the array,
    so every value is re-sorted O(log) times and memory stays around 2-3x the final tables.
    ``count_cap``: None counts nothing (modulus hashing); otherwise counts saturate at the cap
    (the vocabulary's minimum frequency; only "count >= cap" matters).
    """

    def __init__(self, count_cap: int | None = None, min_compact: int = 1 << 22):
        self.cap = count_cap
        self.min_compact = min_compact
        self.values = [np.empty(0, np.uint32) for _ in range(NUM_SPARSE)]
        self.counts = [np.empty(0, np.uint32) for _ in range(NUM_SPARSE)] if count_cap else None
        self._pending: list[list[tuple[np.ndarray, np.ndarray | None]]] = [[] for _ in range(NUM_SPARSE)]
        self._pending_n = [0] * NUM_SPARSE

    def add(self, feature: int, values: np.ndarray, counts: np.ndarray | None = None) -> None:
        if values.size == 0:
            return
        self._pending[feature].append((values, counts))
        self._pending_n[feature] += values.size
        if self._pending_n[feature] >= max(self.values[feature].size, self.min_compact):
            self._compact(feature)

    def add_stats(self, stats: list[tuple[np.ndarray, np.ndarray | None]]) -> None:
        for f, (v, c) in enumerate(stats):
            self.add(f, v, c)

    def _compact(self, f: int) -> None:
        if not self._pending[f]:
            return
        vals = np.concatenate([self.values[f]] + [v for v, _ in self._pending[f]])
        if self.cap is None:
            self.values[f] = np.unique(vals)
        else:
            assert self.counts is not None
            cnts = np.concatenate([self.counts[f]] + [c for _, c in self._pending[f]])
            order = np.argsort(vals, kind="stable")
            vals, cnts = vals[order], cnts[order].astype(np.uint64)
            self.values[f], self.counts[f] = _group_counts(vals, cnts, self.cap)
        self._pending[f] = []
        self._pending_n[f] = 0

    def finish(self) -> None:
        for f in range(NUM_SPARSE):
            self._compact(f)

    def distinct(self) -> list[int]:
        self.finish()
        return [int(v.size) for v in self.values]

    def vocabulary(self, feature: int, min_frequency: int) -> np.ndarray:
        """The sorted int64 values seen at least ``min_frequency`` times."""
        self._compact(feature)
        v = self.values[feature]
        if self.counts is not None and min_frequency > 1:
            v = v[self.counts[feature] >= min_frequency]
        return v.astype(np.int64)

    def save(self, path: Path, covered: list[tuple[int, int]]) -> None:
        self.finish()
        arrays = {f"v{f}": self.values[f] for f in range(NUM_SPARSE)}
        if self.counts is not None:
            arrays.update({f"c{f}": self.counts[f] for f in range(NUM_SPARSE)})
        arrays["covered"] = np.asarray(sorted(covered), dtype=np.int64).reshape(-1, 2)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as fh:
            np.savez(fh, **arrays)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)

    def load(self, path: Path) -> set[tuple[int, int]]:
        with np.load(path) as z:
            self.values = [z[f"v{f}"] for f in range(NUM_SPARSE)]
            if self.counts is not None:
                self.counts = [z[f"c{f}"] for f in range(NUM_SPARSE)]
            return {(int(a), int(b)) for a, b in z["covered"]}


def _group_counts(sorted_vals: np.ndarray, counts: np.ndarray | None, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct values of a sorted array and their summed counts (1 each if None), capped."""
    if sorted_vals.size == 0:
        return sorted_vals.astype(np.uint32), np.empty(0, np.uint32)
    starts = np.flatnonzero(np.concatenate(([True], sorted_vals[1:] != sorted_vals[:-1])))
    if counts is None:
        summed = np.diff(np.append(starts, sorted_vals.size))
    else:
        summed = np.add.reduceat(counts, starts)
    return sorted_vals[starts], np.minimum(summed, cap).astype(np.uint32)


def sparse_stats(sparse: np.ndarray, count_cap: int | None) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """Per feature: sorted distinct non-missing values (uint32) and, with a cap, their counts."""
    out = []
    for f in range(NUM_SPARSE):
        col = sparse[f]
        v = col[col >= 0].astype(np.uint32)
        v.sort()
        if count_cap is None:
            keep = np.concatenate(([True], v[1:] != v[:-1])) if v.size else np.empty(0, bool)
            out.append((v[keep], None))
        else:
            out.append(_group_counts(v, None, count_cap))
    return out


# --------------------------------------------------------------------------------------------
# one chunk (runs in a worker process)


@dataclass
class _ChunkTask:
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


@dataclass
class _ChunkResult:
    file_index: int
    chunk_index: int
    record: dict | None = None
    stats: list | None = None
    error: BadLine | None = None


def shard_name(split: str, file_index: int, chunk_index: int) -> str:
    """Path (relative to the dataset) of the shard with a chunk's rows of one split."""
    return f"{split}/part-{file_index:04d}-{chunk_index:06d}.parquet"


def _write_shard(path: Path, table, row_group_rows: int, compression: str, level: int | None) -> None:
    import pyarrow.parquet as pq

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            pq.write_table(
                table,
                fh,
                row_group_size=row_group_rows,
                compression=None if compression == "none" else compression,
                compression_level=level,
            )
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _process_chunk(task: _ChunkTask) -> _ChunkResult:
    data = task.data
    if data is None:
        with open(task.path, "rb") as fh:
            fh.seek(task.offset)
            data = fh.read(task.length)
    try:
        parsed = parse_chunk(data, task.fmt, on_bad_line=task.on_bad_line, source=task.path, first_line=task.first_line)
    except BadLineError as e:
        return _ChunkResult(task.file_index, task.chunk_index, error=e.bad)
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
        _write_shard(out / rel, _to_table(label, dense, sparse), task.row_group_rows, task.compression,
                     task.compression_level)
        shards[name] = {"file": rel, "rows": k, "positives": int(np.count_nonzero(label))}
        if name == "train":
            stats = sparse_stats(sparse, task.count_cap)
    record = {
        "file": task.file_index,
        "chunk": task.chunk_index,
        "lines": parsed.n_lines,
        "shards": shards,
        "bad": parsed.bad,
        "clipped": parsed.clipped,
    }
    return _ChunkResult(task.file_index, task.chunk_index, record=record, stats=stats)


def _stats_from_shard(args: tuple[str, int, int, int | None]) -> tuple[tuple[int, int], list]:
    """Table statistics of a finished chunk, re-read from its train shard (when resuming)."""
    import pyarrow.parquet as pq

    path, f, c, cap = args
    table = pq.read_table(path, columns=SPARSE_COLUMNS)
    sparse = np.stack([table.column(name).to_numpy() for name in SPARSE_COLUMNS])
    return (f, c), sparse_stats(sparse, cap)


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


# --------------------------------------------------------------------------------------------
# output directory, manifest, progress


def _fingerprint(path: Path) -> dict:
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _remove_dataset(out: Path) -> None:
    import shutil

    for name in (*SPLITS, "vocab", PROGRESS_DIR):
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)
    (out / "metadata.json").unlink(missing_ok=True)


def _check_output(out: Path, opts: dict, fingerprints: list[dict], overwrite: bool) -> dict | None:
    """Refuse to clobber a dataset or resume an incompatible run; returns the manifest to resume."""
    manifest_path = out / PROGRESS_DIR / "manifest.json"
    if overwrite:
        if out.exists():
            _remove_dataset(out)
        return None
    if (out / "metadata.json").exists():
        raise PreprocessError(f"{out} already holds a complete dataset (metadata.json); use --overwrite to replace it")
    if manifest_path.is_file():
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise PreprocessError(f"{manifest_path}: unreadable ({e}); use --overwrite to start over") from None
        diffs = []
        old_paths = [d["path"] for d in manifest.get("inputs", [])]
        new_paths = [d["path"] for d in fingerprints]
        if old_paths != new_paths:
            diffs.append(f"inputs: {old_paths} (earlier run) vs {new_paths} (now)")
        else:
            for old, new in zip(manifest["inputs"], fingerprints):
                if old != new:
                    diffs.append(f"input {new['path']} changed since the earlier run (size or modification time)")
        old_opts = manifest.get("options", {})
        for k in _OUTPUT_OPTIONS:
            if old_opts.get(k) != opts[k]:
                if k == "on_bad_line" and old_opts.get(k) == "stop" and opts[k] == "skip":
                    continue  # chunks finished in stop mode had no bad line: same result in skip mode
                diffs.append(f"{k.replace('_', '-')}: {old_opts.get(k)!r} (earlier run) vs {opts[k]!r} (now)")
        if diffs:
            raise PreprocessError(
                f"{out} holds an unfinished run with different settings: {'; '.join(diffs)}; "
                "use the same settings to resume it, or --overwrite to start over"
            )
        return manifest
    for name in (*SPLITS, "vocab"):
        p = out / name
        if p.is_dir() and any(p.iterdir()):
            raise PreprocessError(
                f"{out} already holds dataset files ({name}/) but no {PROGRESS_DIR}/manifest.json of an unfinished "
                "run; use --overwrite to replace them"
            )
    return None


def _load_done(progress: Path, out: Path) -> dict[tuple[int, int], dict]:
    done: dict[tuple[int, int], dict] = {}
    path = progress / "done.jsonl"
    if not path.is_file():
        return done
    text = path.read_bytes()
    if text and not text.endswith(b"\n"):
        # a record torn by a kill: cut it off, so that the next record starts on a line of its own
        keep = text.rfind(b"\n") + 1
        with open(path, "r+b") as fh:
            fh.truncate(keep)
        text = text[:keep]
    for line in text.decode("utf-8", "replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a damaged record: that chunk is redone
        if all((out / s["file"]).is_file() for s in rec["shards"].values()):
            done[(rec["file"], rec["chunk"])] = rec
    return done


def _remove_temp_files(out: Path) -> None:
    for name in SPLITS:
        d = out / name
        if d.is_dir():
            for p in d.glob(".*.tmp"):
                p.unlink(missing_ok=True)


def _order_days(paths: list[Path]) -> list[Path]:
    nums = [re.search(r"day_(\d+)", p.name) for p in paths]
    if all(nums):
        ordered = [p for _, p in sorted(zip((int(m.group(1)) for m in nums), paths), key=lambda t: t[0])]
        if ordered != paths:
            from loguru import logger

            logger.info("--split days: inputs ordered by day number: {}", ", ".join(p.name for p in ordered))
        return ordered
    return paths


# --------------------------------------------------------------------------------------------
# the run


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
    min_frequency: int = 1,
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
    _max_new_chunks: int | None = None,
) -> Metadata:
    """Turn raw Criteo files into a dataset directory (see the module docstring); returns its metadata.

    Args:
        inputs: raw files in order (TSV without header or CSV with header; plain or gzip).
        output: the dataset directory.
        input_format: "auto" (from the first line of each file), "tsv" or "csv".
        split: "sequential" (Kaggle), "days" (Terabyte) or "random"; see `SplitPlan`.
        validation_fraction, test_fraction, seed: for split="random".
        hashing: "modulus" (cardinality = min(distinct + 1, max_rows_per_table)) or "vocabulary"
            (values seen >= min_frequency times in train get rows 1..V; cardinality V + 1).
        max_rows_per_table: cap of a modulus table (None or 0: no cap).
        chunk_rows: lines per chunk (the unit of work, of resuming and of a shard).
        row_group_rows: parquet row group size.
        compression, compression_level: parquet codec ("zstd", "snappy", "lz4", "gzip", "none").
        workers: processes (default min(cpu count, 8)); 1 runs everything in this process.
        on_bad_line: "stop" raises `BadLineError` naming the first bad line; "skip" drops bad lines
            and counts them per reason in ``metadata.extra["bad_lines"]``.
        overwrite: replace a complete dataset or an unfinished run in ``output``.
        checkpoint_interval: seconds between checkpoints of the table statistics (<= 0: every chunk).
        progress: show a tqdm bar.

    Raises:
        PreprocessError (BadLineError for bad input): one-line message.
    """
    from loguru import logger

    t_start = time.monotonic()
    if split not in ("sequential", "random", "days"):
        raise PreprocessError(f"--split must be sequential, random or days, got {split!r}")
    if hashing not in ("modulus", "vocabulary"):
        raise PreprocessError(f"--hashing must be modulus or vocabulary, got {hashing!r}")
    if on_bad_line not in ("stop", "skip"):
        raise PreprocessError(f"--on-bad-line must be stop or skip, got {on_bad_line!r}")
    if input_format not in ("auto", "tsv", "csv"):
        raise PreprocessError(f"--format must be auto, tsv or csv, got {input_format!r}")
    if chunk_rows < 1 or row_group_rows < 1 or min_frequency < 1:
        raise PreprocessError("--chunk-rows, --row-group-rows and --min-frequency must be >= 1")
    if split == "random" and not (
        0 <= validation_fraction < 1 and 0 <= test_fraction < 1 and validation_fraction + test_fraction < 1
    ):
        raise PreprocessError("--validation-fraction and --test-fraction must be in [0, 1) with a sum below 1")
    max_rows = max_rows_per_table or None
    workers = workers or min(os.cpu_count() or 1, 8)
    paths = [Path(p) for p in inputs]
    if not paths:
        raise PreprocessError("no input files")
    for p in paths:
        if not p.is_file():
            raise PreprocessError(f"{p}: no such file")
    if split == "days":
        if len(paths) < 2:
            raise PreprocessError("--split days needs the day files in order (at least 2: train days and the last day)")
        paths = _order_days(paths)
    opts = {
        "format": input_format,
        "split": split,
        "validation_fraction": validation_fraction if split == "random" else None,
        "test_fraction": test_fraction if split == "random" else None,
        "seed": seed if split == "random" else None,
        "hashing": hashing,
        "min_frequency": min_frequency if hashing == "vocabulary" else None,
        "max_rows_per_table": max_rows if hashing == "modulus" else None,
        "chunk_rows": chunk_rows,
        "row_group_rows": row_group_rows,
        "compression": compression,
        "compression_level": compression_level,
        "on_bad_line": on_bad_line,
    }
    out = Path(output)
    progress_dir = out / PROGRESS_DIR
    fingerprints = [_fingerprint(p) for p in paths]
    out_existed = out.exists()
    manifest = _check_output(out, opts, fingerprints, overwrite)
    done: dict[tuple[int, int], dict] = {}
    count_cap = min_frequency if hashing == "vocabulary" and min_frequency > 1 else None

    pool = None
    if workers > 1:
        pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
    try:
        # 1. count pass (cached in the manifest of an unfinished run)
        if manifest is not None and manifest.get("scans"):
            scans = [FileScan(**d) for d in manifest["scans"]]
            logger.info("resuming the unfinished run in {}", out)
        else:
            logger.info("counting the lines of {} input file(s)", len(paths))
            scans = _count_pass(paths, input_format, chunk_rows, pool, workers, progress)
        file_bad: dict[str, int] = {}
        for i, sc in enumerate(scans):
            logger.info(
                "{}: {} data lines ({}{}{})",
                sc.path,
                sc.lines,
                sc.format,
                ", header" if sc.header else "",
                ", gzip" if sc.compressed else "",
            )
            bad = sc.bad_line()
            if bad is not None:
                if on_bad_line == "stop":
                    raise BadLineError(bad)
                if sc.lines and not sc.prefix_trusted:
                    logger.warning("skipping the whole file ({} lines decompressed before the error): {}",
                                   sc.lines, bad.message())
                    scans[i] = sc.without_data()
                else:
                    logger.warning("skipping: {}", bad.message())
                file_bad[bad.reason] = file_bad.get(bad.reason, 0) + 1
        file_lines = [sc.lines for sc in scans]
        plan = SplitPlan.build(
            split, file_lines, seed=seed, validation_fraction=validation_fraction, test_fraction=test_fraction
        )
        logger.info("split: {}", plan.describe())
        firsts = np.concatenate(([0], np.cumsum(file_lines)[:-1])).astype(int).tolist()

        # 2. progress state
        progress_dir.mkdir(parents=True, exist_ok=True)
        for name in SPLITS:
            (out / name).mkdir(exist_ok=True)
        write_json_atomic(
            progress_dir / "manifest.json",
            {
                "tool": "dlrm.preprocess",
                "manifest_version": MANIFEST_VERSION,
                "options": opts,
                "inputs": fingerprints,
                "scans": [asdict(sc) for sc in scans],
            },
        )
        _remove_temp_files(out)
        done = _load_done(progress_dir, out)
        counter = DistinctCounter(count_cap)
        covered: set[tuple[int, int]] = set()
        stats_path = progress_dir / "stats.npz"
        if stats_path.is_file():
            try:
                covered = counter.load(stats_path)
            except (OSError, ValueError, KeyError, zlib.error):
                covered = set()
            if not covered <= set(done):
                counter, covered = DistinctCounter(count_cap), set()
        redo = [k for k in sorted(done) if k not in covered and "train" in done[k]["shards"]]
        if done:
            logger.info("{} chunk(s) already done; re-reading table statistics of {} of them", len(done), len(redo))
        if redo:
            args2 = [(str(out / done[k]["shards"]["train"]["file"]), k[0], k[1], count_cap) for k in redo]
            it = pool.map(_stats_from_shard, args2) if pool is not None else map(_stats_from_shard, args2)
            for key, stats in it:
                counter.add_stats(stats)
                covered.add(key)

        # 3. the chunks still to do
        todo: list[list[int]] = [
            [c for c in range(sc.num_chunks) if (f, c) not in done] for f, sc in enumerate(scans)
        ]
        n_todo = sum(len(t) for t in todo)
        total = plan.total_lines
        done_lines = sum(r["lines"] for r in done.values())
        logger.info("{} chunk(s) of up to {} lines to do ({} workers)", n_todo, chunk_rows, workers)

        def make_tasks(f: int) -> Iterator[_ChunkTask]:
            sc = scans[f]
            chunks = todo[f]
            datas: Iterator[bytes | None]
            if sc.compressed:
                datas = _iter_ranges(sc.path, [(sc.offsets[c], sc.offsets[c + 1]) for c in chunks])
            else:
                datas = iter([None] * len(chunks))
            for c, data in zip(chunks, datas):
                yield _ChunkTask(
                    file_index=f,
                    chunk_index=c,
                    path=sc.path,
                    fmt=sc.format,
                    offset=sc.offsets[c],
                    length=sc.offsets[c + 1] - sc.offsets[c],
                    n_lines=min(chunk_rows, sc.lines - c * chunk_rows),
                    first_line=c * chunk_rows + (2 if sc.header else 1),
                    first_local=c * chunk_rows,
                    file_first_global=firsts[f],
                    data=data,
                    plan=plan,
                    output=str(out),
                    row_group_rows=row_group_rows,
                    compression=compression,
                    compression_level=compression_level,
                    on_bad_line=on_bad_line,
                    count_cap=count_cap,
                )

        state = _RunState(progress_dir, counter, covered, done, checkpoint_interval, _max_new_chunks)
        from tqdm import tqdm

        with tqdm(
            total=total, initial=done_lines, unit=" rows", unit_scale=True, disable=not progress, desc="preprocessing",
            mininterval=1.0, smoothing=0.05, dynamic_ncols=True,
        ) as bar:
            state.bar = bar
            try:
                if pool is None:
                    _run_inline(make_tasks, len(scans), state)
                else:
                    _run_pool(pool, make_tasks, [f for f in range(len(scans)) if todo[f]], workers, state)
            finally:
                state.close()
        if state.interrupted:
            raise _Interrupted("stopped after _max_new_chunks chunks")
        if state.errors:
            state.checkpoint(force=True)
            _remove_temp_files(out)
            raise BadLineError(min(state.errors, key=lambda e: e[0])[1])
        missing = [(f, c) for f, sc in enumerate(scans) for c in range(sc.num_chunks) if (f, c) not in done]
        if missing:
            raise PreprocessError(f"internal error: chunks {missing[:5]} did not finish")
        if not any(rec["shards"] for rec in done.values()):
            skipped = sum(file_bad.values()) + sum(sum(rec["bad"].values()) for rec in done.values())
            raise PreprocessError(
                f"no rows to write: not one good line in the {len(paths)} input file(s) "
                f"({skipped} bad line(s) or file(s) skipped)"
            )
    except PreprocessError as e:
        if not isinstance(e, _Interrupted):
            _after_failure(out, out_existed, done)
        raise
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        if out.is_dir():
            _remove_temp_files(out)

    # 4. tables and metadata
    meta = _finish(out, scans, fingerprints, opts, plan, done, counter, file_bad, hashing, min_frequency, max_rows)
    import shutil

    shutil.rmtree(progress_dir, ignore_errors=True)
    _report(meta, time.monotonic() - t_start)
    return meta


def _after_failure(out: Path, out_existed: bool, done: dict) -> None:
    """A run stopped by bad input: with no chunk finished, remove what it created (the progress
    directory, empty split directories, ``out`` itself if it made it); otherwise keep the finished
    shards (complete and recorded) so that a run with the same inputs resumes from them."""
    from loguru import logger

    if done:
        logger.warning(
            "{} finished chunk(s) kept in {} (no metadata.json: not a dataset yet); run again with the same "
            "inputs and options (or --on-bad-line skip) to resume, or with --overwrite to start over",
            len(done), out,
        )
        return
    import shutil

    shutil.rmtree(out / PROGRESS_DIR, ignore_errors=True)
    for name in SPLITS:
        d = out / name
        if d.is_dir() and not any(d.iterdir()):
            d.rmdir()
    if not out_existed and out.is_dir() and not any(out.iterdir()):
        out.rmdir()


class _Interrupted(PreprocessError):
    """A run stopped by ``_max_new_chunks`` (tests: the state a kill leaves behind)."""


def _scan_star(args: tuple[str, str, int]) -> FileScan:
    return scan_file(*args)


def _count_pass(paths: list[Path], fmt: str, chunk_rows: int, pool, workers: int, progress: bool) -> list[FileScan]:
    """`scan_file` of every input: gzip and small files one per worker, big plain files split
    over all workers (`scan_file_parallel`). A bar counts the files when there are several."""
    from tqdm import tqdm

    scans: dict[int, FileScan] = {}
    with tqdm(total=len(paths), unit=" files", desc="counting lines", disable=not progress or len(paths) < 2) as bar:
        if pool is None:
            for i, p in enumerate(paths):
                scans[i] = scan_file(p, fmt, chunk_rows)
                bar.update(1)
            return [scans[i] for i in range(len(paths))]
        big = [not _is_gzip(p) and p.stat().st_size >= _PARALLEL_SCAN_MIN_BYTES for p in paths]
        futures = {pool.submit(_scan_star, (str(p), fmt, chunk_rows)): i for i, p in enumerate(paths) if not big[i]}
        for i, p in enumerate(paths):
            if big[i]:
                scans[i] = scan_file_parallel(p, fmt, chunk_rows, pool, 2 * workers)
                bar.update(1)
        for fut in as_completed(futures):
            scans[futures[fut]] = fut.result()
            bar.update(1)
    return [scans[i] for i in range(len(paths))]


class _RunState:
    """Main-process bookkeeping of finished chunks: done.jsonl, table statistics, checkpoints."""

    def __init__(self, progress_dir: Path, counter: DistinctCounter, covered: set, done: dict,
                 checkpoint_interval: float, max_new: int | None):
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
        self._dirty = False

    @property
    def stopping(self) -> bool:
        return bool(self.errors) or self.interrupted

    def handle(self, res: _ChunkResult) -> None:
        if self.interrupted:
            return  # like a kill: results after the stop are not recorded
        if res.error is not None:
            self.errors.append(((res.file_index, res.error.line or 0), res.error))
            return
        rec = res.record
        self._log.write(json.dumps(rec, separators=(",", ":")) + "\n")
        self._log.flush()
        os.fsync(self._log.fileno())
        key = (res.file_index, res.chunk_index)
        self.done[key] = rec
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
        if not self._dirty or self.interrupted:
            return
        if force or self.interval <= 0 or time.monotonic() - self._last_checkpoint >= self.interval:
            self.counter.save(self.progress_dir / "stats.npz", sorted(self.covered))
            self._last_checkpoint = time.monotonic()
            self._dirty = False

    def close(self) -> None:
        self._log.close()


def _run_inline(make_tasks, n_files: int, state: _RunState) -> None:
    for f in range(n_files):
        for task in make_tasks(f):
            state.handle(_process_chunk(task))
            if state.stopping:
                return


def _run_pool(pool: ProcessPoolExecutor, make_tasks, files: list[int], workers: int, state: _RunState) -> None:
    """Feeder threads (one file at a time each; they decompress gzip inputs) submit chunks to the
    pool, at most 2 per worker in flight; this thread records the results."""
    results: queue.Queue[Future] = queue.Queue()
    slots = threading.Semaphore(2 * workers)
    stop = threading.Event()
    lock = threading.Lock()
    outstanding = [0]
    file_queue: queue.Queue[int] = queue.Queue()
    for f in files:
        file_queue.put(f)

    def feed() -> None:
        while not stop.is_set():
            try:
                f = file_queue.get_nowait()
            except queue.Empty:
                return
            for task in make_tasks(f):
                while not slots.acquire(timeout=0.1):
                    if stop.is_set():
                        return
                if stop.is_set():
                    slots.release()
                    return
                with lock:
                    outstanding[0] += 1
                pool.submit(_process_chunk, task).add_done_callback(results.put)

    n_feeders = max(1, min(workers, len(files)))
    feeders = ThreadPoolExecutor(max_workers=n_feeders, thread_name_prefix="preprocess-feed")
    feed_futures = [feeders.submit(feed) for _ in range(n_feeders)]
    failure: BaseException | None = None
    try:
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
            state.handle(fut.result())
            if state.stopping:
                stop.set()
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


def _finish(out, scans, fingerprints, opts, plan, done, counter, file_bad, hashing, min_frequency, max_rows) -> Metadata:
    from loguru import logger

    keys = sorted(done)
    splits = {}
    for name in SPLITS:
        recs = [done[k]["shards"][name] for k in keys if name in done[k]["shards"]]
        splits[name] = SplitInfo(
            rows=sum(r["rows"] for r in recs),
            positives=sum(r["positives"] for r in recs),
            files=[r["file"] for r in recs],
        )
    bad = {r: 0 for r in BAD_LINE_REASONS}
    for k in keys:
        for r, n in done[k]["bad"].items():
            bad[r] += n
    for r, n in file_bad.items():
        bad[r] += n
    distinct = counter.distinct()
    extra: dict[str, Any] = {"source": "dlrm.preprocess"}
    if hashing == "vocabulary":
        sizes = []
        for f in range(NUM_SPARSE):
            vocab = counter.vocabulary(f, min_frequency)
            path = vocab_path(out, f)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            with open(tmp, "wb") as fh:
                np.save(fh, vocab)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
            sizes.append(int(vocab.size))
        cards = [v + 1 for v in sizes]
        extra["vocabulary_sizes"] = sizes
    else:
        cards = [min(d + 1, max_rows) if max_rows else d + 1 for d in distinct]
    extra.update(
        {
            "distinct_counts": distinct,
            "inputs": [
                {
                    "path": fp["path"],
                    "format": sc.format,
                    "header": sc.header,
                    "compressed": sc.compressed,
                    "bytes": fp["size"],
                    "lines": sc.lines,
                }
                for fp, sc in zip(fingerprints, scans)
            ],
            "total_lines": plan.total_lines,
            "split_rule": plan.describe(),
            "options": opts,
            "bad_lines": bad,
            "dense_clipped": sum(done[k]["clipped"] for k in keys),
        }
    )
    meta = Metadata(cardinalities=cards, hashing=hashing, splits=splits, extra=extra)
    write_metadata(out, meta)
    logger.info("wrote {}", out / "metadata.json")
    return meta


def _report(meta: Metadata, seconds: float) -> None:
    from loguru import logger

    lines = [f"{'split':<11}{'rows':>14}{'positive rate':>15}{'shards':>8}"]
    total = 0
    for name, info in meta.splits.items():
        rate = f"{100 * info.positives / info.rows:.2f}%" if info.rows else "-"
        lines.append(f"{name:<11}{info.rows:>14,}{rate:>15}{len(info.files):>8}")
        total += info.rows
    cards = meta.cardinalities
    lines.append(
        f"tables ({meta.hashing}): {sum(cards):,} rows in all, largest {max(cards):,}, "
        f"distinct values in train {sum(meta.extra['distinct_counts']):,}"
    )
    bad = {k: v for k, v in meta.extra["bad_lines"].items() if v}
    lines.append("bad lines skipped: " + (", ".join(f"{k} {v:,}" for k, v in bad.items()) if bad else "none"))
    if meta.extra["dense_clipped"]:
        lines.append(f"counts clipped to int32 max: {meta.extra['dense_clipped']:,}")
    lines.append(f"{total:,} rows in {seconds:.1f} s ({total / max(seconds, 1e-9):,.0f} rows/s)")
    for line in lines:
        logger.info(line)


# --------------------------------------------------------------------------------------------
# CLI


def build_cli():
    """The click command behind ``python -m dlrm.preprocess`` (tests invoke it with CliRunner)."""
    import click

    path_type = click.Path(exists=True, dir_okay=False, path_type=Path)

    @click.command(context_settings={"help_option_names": ["-h", "--help"]})
    @click.argument("more_inputs", nargs=-1, type=path_type, metavar="[INPUT]...")
    @click.option("--input", "-i", "inputs", multiple=True, type=path_type,
                  help="Raw file (TSV or CSV, plain or .gz); repeat, or list the files as arguments. Order matters.")
    @click.option("--output", "-o", required=True, type=click.Path(file_okay=False, path_type=Path),
                  help="Dataset directory to write.")
    @click.option("--format", "input_format", type=click.Choice(["auto", "tsv", "csv"]), default="auto",
                  show_default=True, help="Input format; auto detects it from each file's first line.")
    @click.option("--split", type=click.Choice(["sequential", "random", "days"]), default="sequential",
                  show_default=True,
                  help="sequential: Kaggle 6/7 train, last 1/7 halves test|validation; days: Terabyte day_0..22 "
                  "train, day_23 halves test|validation; random: per line from (seed, line number).")
    @click.option("--validation-fraction", type=float, default=0.05, show_default=True, help="--split random.")
    @click.option("--test-fraction", type=float, default=0.05, show_default=True, help="--split random.")
    @click.option("--seed", type=int, default=0, show_default=True, help="--split random.")
    @click.option("--hashing", type=click.Choice(["modulus", "vocabulary"]), default="modulus", show_default=True)
    @click.option("--min-frequency", type=click.IntRange(min=1), default=1, show_default=True,
                  help="--hashing vocabulary: values seen at least this often in train get their own row.")
    @click.option("--max-rows-per-table", type=click.IntRange(min=0), default=DEFAULT_MAX_ROWS_PER_TABLE,
                  show_default=True, help="--hashing modulus: cap of a table's rows (0: no cap).")
    @click.option("--chunk-rows", type=click.IntRange(min=1), default=DEFAULT_CHUNK_ROWS, show_default=True,
                  help="Lines per chunk: the unit of work and of resuming; at most one shard per split per chunk.")
    @click.option("--row-group-rows", type=click.IntRange(min=1), default=DEFAULT_ROW_GROUP_ROWS, show_default=True)
    @click.option("--compression", default="zstd", show_default=True, help="Parquet codec (zstd, snappy, lz4, gzip, none).")
    @click.option("--compression-level", type=int, default=None, help="Codec level (default: the codec's).")
    @click.option("--workers", type=click.IntRange(min=1), default=None,
                  help="Worker processes [default: min(cores, 8)]; 1 runs in this process.")
    @click.option("--on-bad-line", type=click.Choice(["stop", "skip"]), default="stop", show_default=True,
                  help="stop: fail naming the first bad line; skip: drop bad lines, count them per reason.")
    @click.option("--overwrite", is_flag=True, help="Replace a dataset or an unfinished run in --output.")
    @click.option("--checkpoint-interval", type=float, default=300.0, show_default=True,
                  help="Seconds between checkpoints of the table statistics (resuming re-reads the train shards "
                  "of chunks finished after the last one).")
    @click.option("--progress/--no-progress", default=True, show_default=True, help="tqdm progress bar.")
    def command(more_inputs, inputs, output, **kwargs):
        """Preprocess raw Criteo click logs into a dataset directory (parquet shards + metadata.json).

        Inputs: Kaggle train.txt / Terabyte day_N (TAB-separated, no header) or the CSV variant with
        a label,I1..I13,C1..C26 header (counts may be written as 260.0); plain or gzip. Stored
        values: a missing or negative count becomes 0 (counts above 2^31-1 are clipped), a missing
        category becomes -1; categories are the 32-bit hex hashes read as integers.

        A run that stops (bad input, a kill) keeps the shards it finished (recorded in
        OUTPUT/_progress/); the same command run again resumes from them and ends with the same
        output as an uninterrupted run. metadata.json is written last.
        """
        import sys

        all_inputs = [*inputs, *more_inputs]
        if not all_inputs:
            raise click.UsageError("no input files (use --input PATH or list them as arguments)")
        try:
            preprocess(all_inputs, output, **kwargs)
        except PreprocessError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(1)
        except OSError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(1)

    return command


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m dlrm.preprocess``."""
    build_cli()(args=argv, prog_name="python -m dlrm.preprocess")
