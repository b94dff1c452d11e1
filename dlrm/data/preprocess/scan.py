"""The count pass: lines, format, header and chunk start offsets of every input file."""

from __future__ import annotations

import gzip
import os
from collections.abc import Callable, Iterator
from concurrent.futures import as_completed
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from dlrm.data.preprocess.constants import _GZIP_ERRORS, _READ_BLOCK, DEFAULT_CHUNK_ROWS, NUM_FIELDS, RAW_COLUMNS
from dlrm.data.preprocess.errors import BadLine, PreprocessError, field_text, quoted
from dlrm.data.preprocess.line_endings import cr_advice, cr_ended, trailing_separator_hint
from dlrm.data.preprocess.line_sample import GZIP_RATIO, LineSample, LineSampler, sample_range, start_level
from dlrm.data.preprocess.parse import _delimiter_of
from dlrm.logging_setup import ProgressBar, bar_interval


def _is_gzip(path: Path) -> bool:
    """Whether the file starts with the gzip magic bytes."""
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"


def _iter_blocks(path: Path, block: int | None = None,
                 on_bytes: Callable[[int], object] | None = None) -> Iterator[bytes]:
    """The (decompressed) bytes of a file in blocks; the same sequence every time it is read.

    A truncated or corrupt gzip stream raises (EOFError, gzip.BadGzipFile, zlib.error) after
    yielding everything that could be decompressed before the damage. `on_bytes`: told how many bytes of the file
    on disk (compressed ones, for gzip) each block took, for a progress bar.
    """
    block = block or _READ_BLOCK
    with open(path, "rb") as raw:
        if raw.read(2) != b"\x1f\x8b":
            raw.seek(0)
            while b := raw.read(block):
                if on_bytes is not None:
                    on_bytes(len(b))
                yield b
            return
        raw.seek(0)
        f = gzip.GzipFile(fileobj=raw, mode="rb")
        parts: list[bytes] = []
        size = 0
        told = 0  # compressed bytes reported to on_bytes
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
                if on_bytes is not None:
                    at = raw.tell()
                    on_bytes(at - told)
                    told = at
                yield b"".join(parts)
                parts, size = [], 0
        if on_bytes is not None:
            on_bytes(raw.tell() - told)
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
    trailing_blank: int = 0  # empty lines at the end, not counted in `lines` and outside the chunks (`_BlankTail`)
    # the count pass's sample of the lines, for `same_content.same_rows`; not in the manifest (a resume's scans have
    # none: its inputs were compared by the run that started it, and are the same files, `output._check_output`)
    sample: LineSample | None = field(default=None, repr=False, compare=False)

    def record(self) -> dict:
        """The fields the manifest keeps (every one but the sample)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "sample"}

    @property
    def num_chunks(self) -> int:
        return len(self.offsets) - 1

    def bad_line(self) -> BadLine | None:
        """The `BadLine` of an empty file or a corrupt gzip, else None."""
        if self.error == "empty_file":  # (a detail: what the file holds instead, `_mark_alone`)
            if self.header and not self.error_detail:  # not "empty" to the user who sees its one line
                return BadLine(self.path, None, "empty_file",
                               detail="no data lines: the file holds only its header line")
            what = f": {self.error_detail}" if self.error_detail else ""
            return BadLine(self.path, None, "empty_file", detail=f"empty file (no data lines{what})")
        if self.error == "corrupt_gzip":
            if not self.prefix_trusted:  # the damage is somewhere before the point of failure
                return BadLine(self.path, None, "corrupt_gzip", detail=self.error_detail)
            line = self.lines + (2 if self.header else 1)
            return BadLine(self.path, line, "corrupt_gzip", detail=self.error_detail)
        return None

    def without_data(self) -> FileScan:
        """This file with no lines (``--on-bad-line skip`` of a gzip corrupt inside the stream)."""
        return FileScan(self.path, self.compressed, self.format, self.header, self.size, 0, [0],
                        self.error, self.error_detail, self.prefix_trusted, self.trailing_blank)


def _gzip_problem(e: BaseException) -> tuple[str, bool]:
    """One-line description of a gzip error, and whether the data decompressed before it is sound."""
    if isinstance(e, EOFError):
        return f"truncated gzip stream ({e})", True
    if isinstance(e, gzip.BadGzipFile) and str(e).startswith("Not a gzipped file"):
        # garbage after a complete member: everything before it passed its CRC check
        return f"unreadable data after the end of a gzip member ({e})", True
    return f"corrupt gzip stream ({type(e).__name__}: {e}); the data before this point cannot be trusted", False


UTF8_BOM = b"\xef\xbb\xbf"
"""The UTF-8 byte-order mark that Excel, Windows tools and pandas' ``utf-8-sig`` put before a file's first line: it is
skipped (read as part of the first field, it made "column label: '\\ufeff0' is not a label", or hid the CSV header)."""


def _skip_bom(offsets: list[int], first_line: bytes, header: bool) -> list[int]:
    """The chunk offsets with chunk 0 starting after a byte-order mark (a header line is skipped whole anyway)."""
    # (the mark then a newline: chunk 0 starts at that newline, an empty first line, as in a file without the mark)
    if first_line.startswith(UTF8_BOM) and not header and len(offsets) > 1 and offsets[0] == 0 \
            and offsets[1] > len(UTF8_BOM):
        return [len(UTF8_BOM), *offsets[1:]]
    return offsets


def _mark_alone(scan: FileScan, first_line: bytes) -> FileScan:
    """`scan`, an empty file where the (decompressed) file is a byte-order mark and nothing else. Counted as one line
    without a newline, it was named a cut-off record: "expected 40 fields ..., found 1; the file ends in this line,
    without a newline (cut off? a truncated download or copy)", where an empty file is "empty file (no data lines)"."""
    if scan.error is None and scan.size == len(UTF8_BOM) and first_line == UTF8_BOM:
        return FileScan(scan.path, scan.compressed, scan.format, scan.header, scan.size, 0, [scan.size], "empty_file",
                        "only a UTF-8 byte-order mark")
    return scan


def _detect_format(first_line: bytes, path: Path, fmt: str) -> tuple[str, bool]:
    """The format (``fmt``, or from the separator in the first line with "auto") and whether the
    first line is the CSV header (which must then be exactly label,I1..I13,C1..C26)."""
    if fmt == "auto":
        if b"\t" in first_line:
            fmt = "tsv"
        elif b"," in first_line:
            fmt = "csv"
        else:  # (it said "use --format": no --format reads such a line, neither format has one without separators)
            line = first_line.rstrip(b"\r\n")
            other = next((f"; it has {NUM_FIELDS} fields separated by {sep.decode()!r}: replace them with tabs"
                          for sep in (b" ", b";", b"|") if line.count(sep) == NUM_FIELDS - 1), "")
            raise PreprocessError(f"{path}:1: cannot detect the format: no tab or comma in the first line (a Criteo "
                                  f"line holds {NUM_FIELDS} fields separated by tabs, or by commas in the CSV "
                                  f"variant){other}")
    delim = _delimiter_of(fmt)
    fields = first_line.rstrip(b"\r\n").split(delim)
    header = fields[0].strip() == b"label"
    # A line naming the label column anywhere (pandas' index column before it, another case) is a header that does not
    # match: named as such, not parsed as data ("column label: 'Label' is not a label", "found 41 fields")
    if header or b"label" in (f.strip().lower() for f in fields):
        _check_header(fields, path, delim)
    return fmt, header


def _check_header(fields: list[bytes], path: Path, delim: bytes) -> None:
    """The header must name the columns in the order the parser reads them: fields are taken by
    position, so swapped or misnamed columns would silently mix up the features."""
    if len(fields) != NUM_FIELDS:
        index = " (an index column before label? write the file with pandas' index=False)" \
            if len(fields) == NUM_FIELDS + 1 and fields[1].strip() == b"label" else \
            trailing_separator_hint(delim.join(fields), delim[0], len(fields))
        raise PreprocessError(f"{path}:1: the header has {len(fields)} fields, expected {NUM_FIELDS}{index}")
    for i, (field, expected) in enumerate(zip(fields, RAW_COLUMNS)):
        found = field_text(field.strip())
        if found != expected:
            raise PreprocessError(
                f"{path}:1: header column {i + 1}: expected {expected!r}, found {quoted(found)} "
                "(the header must be label,I1..I13,C1..C26, in this order)"
            )


def _format_and_header(first_line: bytes, path: Path, fmt: str) -> tuple[str, bool]:
    """`_detect_format` of a first line (after a byte-order mark); an empty one (empty file or a bad line) has no
    header."""
    first_line = first_line.removeprefix(UTF8_BOM)
    if cr_ended(first_line):  # refused in --on-bad-line skip too: not a bad line but the whole file, unread
        raise PreprocessError(f"{path}:1: {cr_advice(path, _is_gzip(path))}")
    if first_line:
        return _detect_format(first_line, path, fmt)
    return ("tsv" if fmt == "auto" else fmt), False


class _BlankTail:
    """The empty lines (``\\n`` or ``\\r\\n`` alone) a file ends with, over its blocks in order: an editor's or a
    tool's trailing newline is no record, and read as one it stopped the run (``wrong_field_count ... found an empty
    line``). ``blank``: how many; ``content_end``: the offset just after the newline of the last line with content
    (0: none yet)."""

    def __init__(self) -> None:
        self.newlines = 0  # newlines in the run of CR/LF bytes the data ends with
        self.content_end = 0
        self.open = False  # the last content seen has no newline after it yet (it ended in CR at a block's end)

    def feed(self, b: bytes, base: int) -> None:
        body = b.rstrip(b"\r\n")
        if body:
            self.newlines, self.open = 0, True
            start = len(body)
        else:
            start = 0
        if self.open:
            nl = b.find(b"\n", start)
            if nl >= 0:
                self.content_end, self.open = base + nl + 1, False
        self.newlines += b.count(b"\n", start)

    @property
    def blank(self) -> int:
        """Trailing empty lines: the newlines after the one that ends the last content line (a file of newlines
        alone: all of them)."""
        return self.newlines - 1 if self.content_end else self.newlines


def _plain_tail(path: Path, size: int) -> _BlankTail:
    """`_BlankTail` of a plain file, read backwards from its end only as far as its trailing newlines go."""
    tail = _BlankTail()
    with open(path, "rb") as f:
        at = size
        blocks: list[bytes] = []
        while at > 0:
            start = max(at - (1 << 16), 0)
            f.seek(start)
            b = f.read(at - start)
            blocks.insert(0, b)
            at = start
            if b.rstrip(b"\r\n"):
                break
    base = at
    for b in blocks:
        tail.feed(b, base)
        base += len(b)
    return tail


class _ChunkStarts:
    """The running count over a file's (decompressed) blocks: newlines seen, and the offsets where
    chunks start (chunk k starts after newline number k*R + h, 1-based; chunk 0 of a file without
    header at 0)."""

    def __init__(self, chunk_rows: int, header: bool):
        self.chunk_rows = chunk_rows
        self.h = 1 if header else 0
        self.offsets: list[int] = []  # chunk starts (decompressed offsets)
        self.next_chunk = 0  # index of the next chunk whose start we look for
        self.seen = 0  # newlines seen so far
        self.base = 0  # offset of the current block
        self.last_nl_end = 0  # offset just after the last newline seen
        self.last_byte = b""
        self.tail = _BlankTail()

    def feed(self, b: bytes, nlpos: np.ndarray | None = None) -> None:
        """Count the next block (``nlpos``: the offsets of its newlines, when known)."""
        self.tail.feed(b, self.base)
        cnt = b.count(b"\n") if nlpos is None else len(nlpos)
        while True:
            target = self.next_chunk * self.chunk_rows + self.h
            if target == 0:
                self.offsets.append(0)
                self.next_chunk += 1
                continue
            if target > self.seen + cnt:
                break
            if nlpos is None:
                nlpos = np.flatnonzero(np.frombuffer(b, dtype=np.uint8) == 10)
            self.offsets.append(self.base + int(nlpos[target - self.seen - 1]) + 1)
            self.next_chunk += 1
        if cnt:
            self.last_nl_end = self.base + b.rfind(b"\n") + 1
        self.seen += cnt
        self.base += len(b)
        self.last_byte = b[-1:]


def scan_file(path: str | os.PathLike, fmt: str = "auto", chunk_rows: int = DEFAULT_CHUNK_ROWS,
              on_bytes: Callable[[int], object] | None = None) -> FileScan:
    """The count pass over one file: lines, format, header and chunk start offsets.

    Reads the file once (gzip decompressed as a stream, detected by its magic bytes) counting
    b"\\n" per block. Does not raise for an empty file or a corrupt gzip: see ``FileScan.error``.
    `on_bytes`: told the bytes of the file read as the count goes (`_iter_blocks`).
    """
    path = Path(path)
    blocks = _iter_blocks(path, on_bytes=on_bytes)
    compressed = _is_gzip(path)
    pending, problem = _first_blocks(blocks)
    first_line = b"".join(pending).split(b"\n", 1)[0].rstrip(b"\r")
    fmt, header = _format_and_header(first_line, path, fmt)
    starts = _ChunkStarts(chunk_rows, header)
    # (the newlines it finds are those the count needs)
    sampler = LineSampler(skip_first=header, level=start_level(path.stat().st_size * (GZIP_RATIO if compressed else 1)))
    for b in pending:
        starts.feed(b, sampler.feed(b))
    if problem is None:
        problem = _count_rest(starts, blocks, sampler)
    scan = _scan_result(path, compressed, fmt, header, starts, chunk_rows, problem)
    scan.sample = sampler.close() if problem is None else sampler.sample  # (no line cut by a gzip error)
    scan.offsets = _skip_bom(scan.offsets, first_line, header)
    return _mark_alone(scan, first_line)


def _first_blocks(blocks: Iterator[bytes]) -> tuple[list[bytes], BaseException | None]:
    """Enough blocks for the first line (or 1 MiB), and the gzip error that cut them short, if any."""
    pending: list[bytes] = []
    try:
        for b in blocks:
            pending.append(b)
            if b"\n" in b or sum(len(p) for p in pending) >= (1 << 20):
                break
    except _GZIP_ERRORS as e:
        return pending, e
    return pending, None


def _count_rest(starts: _ChunkStarts, blocks: Iterator[bytes], sampler: LineSampler) -> BaseException | None:
    """Count (and sample) the remaining blocks; returns the gzip error that ended the stream early, or None."""
    try:
        for b in blocks:
            starts.feed(b, sampler.feed(b))
    except _GZIP_ERRORS as e:
        return e
    return None


def _scan_result(path: Path, compressed: bool, fmt: str, header: bool, starts: _ChunkStarts, chunk_rows: int,
                 problem: BaseException | None) -> FileScan:
    """The `FileScan` of a counted file; ``problem``: the gzip error that cut the stream short."""
    error, detail, trusted, blank = None, "", True, 0
    if problem is None:
        end = starts.base
        lines = starts.seen + (1 if starts.base > 0 and starts.last_byte != b"\n" else 0) - starts.h
        blank, end = _trailing_blank(starts.tail, lines, end)
        lines -= blank
    else:
        error = "corrupt_gzip"
        detail, trusted = _gzip_problem(problem)
        end = starts.last_nl_end
        lines = starts.seen - starts.h
        if trusted:
            detail += f" after {max(lines, 0):,} complete data lines"
    lines = max(lines, 0)
    n_chunks = -(-lines // chunk_rows)
    offsets = starts.offsets[:n_chunks] + [end]
    if lines == 0 and error is None:
        error = "empty_file"
    return FileScan(str(path), compressed, fmt, header, starts.base, lines, offsets, error, detail, trusted, blank)


def _trailing_blank(tail: _BlankTail, lines: int, end: int) -> tuple[int, int]:
    """The trailing empty lines left out of a file's data lines, and where its data then ends: all of them when the
    file has content, else none (a file of empty lines alone stays a bad line: it holds no data at all)."""
    if tail.content_end == 0 or tail.blank <= 0 or tail.blank > lines:
        return 0, end
    return tail.blank, tail.content_end


_PARALLEL_SCAN_MIN_BYTES = 64 << 20  # plain files at least this big are counted in parallel
_SCAN_RANGE_BYTES = 32 << 20  # about this many bytes per counting task


def _count_newlines(args: tuple[str, int, int, bool, int]) -> tuple[int, LineSample]:
    """Newlines in bytes [start, end) of a plain file, and the sample of the lines that begin there (`sample_range`;
    then whether the file has a CSV header, and the level its sample starts at)."""
    path, start, end, header, level = args
    with open(path, "rb") as f:
        return sample_range(f, start, end, _READ_BLOCK, header, level)


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


def _n_ranges(size: int, n_tasks: int) -> int:
    """The byte ranges `scan_file_parallel` counts a plain file of ``size`` bytes in: ``n_tasks`` at least, about
    `_SCAN_RANGE_BYTES` each, at most 1024."""
    return max(1, min(max(n_tasks, -(-size // _SCAN_RANGE_BYTES)), 1024))


def count_pass_tasks(paths: list[Path], workers: int) -> int:
    """How many tasks `_count_pass` gives a pool of ``workers`` processes at most at once: 0 when it counts in this
    process (one input, gzip or smaller than `_PARALLEL_SCAN_MIN_BYTES`), else one per small or gzip file plus the
    byte ranges of every big plain one. A pool larger than this would only start processes that never get a task."""
    sizes = [p.stat().st_size for p in paths]
    big = [not _is_gzip(p) and size >= _PARALLEL_SCAN_MIN_BYTES for p, size in zip(paths, sizes)]
    if len(paths) == 1 and not big[0]:
        return 0
    return sum(_n_ranges(size, 2 * workers) if b else 1 for size, b in zip(sizes, big))


def scan_file_parallel(path: str | os.PathLike, fmt: str, chunk_rows: int, executor, n_tasks: int,
                       on_bytes: Callable[[int], object] | None = None) -> FileScan:
    """`scan_file` of a plain (not gzip) file with the reading spread over ``executor``: newlines
    are counted in byte ranges in parallel, then the chunk starts are found in the ranges that hold
    them. Same result as `scan_file`. `on_bytes`: told each counted range's bytes."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(1 << 20)
        f.seek(max(size - 1, 0))
        last_byte = f.read(1)
    first_line = head.split(b"\n", 1)[0].rstrip(b"\r")
    fmt, header = _format_and_header(first_line, path, fmt)
    h = 1 if header else 0
    n_ranges = _n_ranges(size, n_tasks)
    bounds = [size * i // n_ranges for i in range(n_ranges + 1)]
    ranges = [(str(path), bounds[i], bounds[i + 1], header, start_level(size)) for i in range(n_ranges)]
    counts = []
    sample = LineSample()
    for (_, lo, hi, _, _), (count, part) in zip(ranges, executor.map(_count_newlines, ranges)):
        counts.append(count)
        sample.merge(part)
        if on_bytes is not None:
            on_bytes(hi - lo)
    before = np.concatenate(([0], np.cumsum(counts))).astype(np.int64).tolist()
    seen = before[-1]
    lines = max(seen + (1 if size > 0 and last_byte != b"\n" else 0) - h, 0)
    blank, end = _trailing_blank(_plain_tail(path, size), lines, size)
    lines -= blank
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
    offsets = _skip_bom(offsets[:n_chunks] + [end], first_line, header)
    error = "empty_file" if lines == 0 else None
    return _mark_alone(FileScan(str(path), False, fmt, header, size, lines, offsets, error, trailing_blank=blank,
                                sample=sample), first_line)


def _scan_star(args: tuple[str, str, int]) -> FileScan:
    """`scan_file` of one (path, format, chunk_rows) tuple (a picklable pool task)."""
    return scan_file(*args)


_BYTES_BAR = "{l_bar}{bar}| {n_fmt}B/{total_fmt}B read [{elapsed}<{remaining}, {rate_fmt}{postfix}]"


def _count_pass(paths: list[Path], fmt: str, chunk_rows: int, pool, workers: int, progress: bool) -> list[FileScan]:
    """`scan_file` of every input: gzip and small files one per worker, big plain files split
    over all workers (`scan_file_parallel`). A bar counts the bytes on disk read (rate and ETA): block by block for
    a file counted in this process (one input, or one worker) or range by range (a big plain file), else a file at a
    time. (It counted files, and not for one: a 50 GB day file was minutes without a sign of life.)"""

    scans: dict[int, FileScan] = {}
    sizes = [p.stat().st_size for p in paths]
    # the byte counts with their unit: "counting lines: 23.6k/23.6k" (tqdm's format) read as 23.6k lines (100 here)
    with ProgressBar(total=sum(sizes), unit="B", unit_scale=True, unit_divisor=1024, desc="counting lines",
                     bar_format=_BYTES_BAR, disable=not progress, **bar_interval()) as bar:  # a minute apart in a file
        if pool is None or len(paths) == 1:
            for i, p in enumerate(paths):
                if pool is not None and not _is_gzip(p) and sizes[i] >= _PARALLEL_SCAN_MIN_BYTES:
                    scans[i] = scan_file_parallel(p, fmt, chunk_rows, pool, 2 * workers, on_bytes=bar.update)
                else:
                    scans[i] = scan_file(p, fmt, chunk_rows, on_bytes=bar.update)
            return [scans[i] for i in range(len(paths))]
        big = [not _is_gzip(p) and p.stat().st_size >= _PARALLEL_SCAN_MIN_BYTES for p in paths]
        futures = {pool.submit(_scan_star, (str(p), fmt, chunk_rows)): i for i, p in enumerate(paths) if not big[i]}
        # A file's error (no format, a wrong header) is kept, not raised at once: the one reported is the first in
        # input order, as with one worker, whichever file this process or the pool counted first.
        errors: dict[int, PreprocessError] = {}
        for i, p in enumerate(paths):
            if big[i] and not errors:  # a big file after one in error: not worth counting
                try:
                    scans[i] = scan_file_parallel(p, fmt, chunk_rows, pool, 2 * workers, on_bytes=bar.update)
                except PreprocessError as e:
                    errors[i] = e
        for fut in as_completed(futures):
            try:
                scans[futures[fut]] = fut.result()
            except PreprocessError as e:
                errors[futures[fut]] = e
            bar.update(sizes[futures[fut]])
        if errors:
            raise errors[min(errors)]
    return [scans[i] for i in range(len(paths))]
