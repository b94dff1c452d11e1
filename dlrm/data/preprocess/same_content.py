"""Two inputs holding the same data under different names: refused, naming both.

A copy (``cp day_0 day_0_copy``), or a day file given both plain and gzip'ed (a ``day_*`` glob after ``gunzip -k``),
puts every row in twice; under ``--split sequential`` or ``random`` its copies land in train and in test alike, and the
test AUC measures rows the model trained on. (The same file under another name, a symlink or a hard link is refused
earlier, by `options._check_distinct`, from its inode.)

Cost on terabyte-scale day files: inputs are compared only where they could be equal, and a comparison stops at the
first block that differs, so inputs of different data cost one ``stat`` (a size each, `same_bytes`) or nothing beyond
the count pass, which already knows every file's size and lines once decompressed (`same_data`). Only identical data
is read in full a second time, once, before the run is refused. A hash of every file during the count pass would cost
CPU time on every byte of every run, to spare reads in the one case that stops.

Not detected: the same rows with other bytes (CRLF against LF line ends, a byte-order mark, a reordering, a file that
holds a part of another: ``head day_0 > sample``), which only a comparison of rows would find.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path

from loguru import logger

from dlrm.data.preprocess.constants import _GZIP_ERRORS, _READ_BLOCK
from dlrm.data.preprocess.errors import PreprocessError
from dlrm.data.preprocess.scan import _iter_blocks

_HEAD_BYTES = 1 << 16  # files of one size are first told apart by a digest of this much of their start


def same_bytes(paths: list[Path]) -> None:
    """Refuse two inputs with the same bytes on disk (a copy of a plain or of a gzip file); before the count pass.

    Only files of one size are candidates (distinct day files of one size to the byte are rare); among those, only
    files whose first 64 KiB are alike are compared whole, each pair stopping at its first differing block."""
    by_size: dict[int, list[Path]] = defaultdict(list)
    for p in paths:
        size = p.stat().st_size
        if size:  # empty files hold no rows to duplicate (and are refused, or skipped, as empty)
            by_size[size].append(p)
    for group in by_size.values():
        if len(group) < 2:
            continue
        by_head: dict[bytes, list[Path]] = defaultdict(list)
        for p in group:
            with open(p, "rb") as f:
                by_head[hashlib.blake2b(f.read(_HEAD_BYTES)).digest()].append(p)
        for alike in by_head.values():
            _refuse_equal(alike, _raw_blocks, "the same bytes as")


def same_data(scans: list) -> None:
    """Refuse two inputs with the same data once decompressed where one of them at least is gzip (a day file plain and
    gzip'ed, or gzip'ed twice: gzip records the name and time, so the compressed bytes differ); after the count pass,
    from its `FileScan`s: only files with the same decompressed size and line count are compared. Pairs of plain files
    were compared by `same_bytes`."""
    groups: dict[tuple[int, int, bool], list] = defaultdict(list)
    for sc in scans:
        if sc.error is None and sc.lines:  # (an empty or corrupt file: refused or skipped as such)
            groups[(sc.size, sc.lines, sc.header)].append(sc)
    for group in groups.values():
        if len(group) > 1 and any(sc.compressed for sc in group):
            for i, a in enumerate(group):
                for b in group[i + 1:]:
                    pa, pb = Path(a.path), Path(b.path)
                    if not (a.compressed or b.compressed):
                        continue
                    logger.info("{} and {}: as many bytes and lines once decompressed; comparing them", pa, pb)
                    if _equal(_iter_blocks(pa), _iter_blocks(pb)):
                        _refuse(pa, pb, "the same data as",
                                " once decompressed" if a.compressed != b.compressed else " once both are decompressed")


def _refuse_equal(paths: list[Path], blocks, what: str) -> None:
    for i, a in enumerate(paths):
        for b in paths[i + 1:]:
            # a copy of a day file is read whole, twice, before the count pass and its bar: said, not a silent wait
            logger.info("{} and {}: the same size and first 64 KiB; comparing them to their end", a, b)
            if _equal(blocks(a), blocks(b)):
                _refuse(a, b, what, "")


def _refuse(first: Path, second: Path, what: str, how: str) -> None:
    raise PreprocessError(f"{second}: {what} {first}{how} (a copy?): its rows would be read twice, in train and in "
                          "test alike; list every file once")


def _raw_blocks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while b := f.read(_READ_BLOCK):
            yield b


def _equal(a: Iterable[bytes], b: Iterable[bytes]) -> bool:
    """Whether two streams of blocks hold the same bytes (the blocks' boundaries may differ); stops at the first
    difference. A gzip stream that turns out corrupt is not equal to anything."""
    ia, ib = (x for x in a if x), (x for x in b if x)  # (an empty block is not the end)
    buf_a = buf_b = b""
    try:
        while True:
            if not buf_a:
                buf_a = next(ia, b"")
            if not buf_b:
                buf_b = next(ib, b"")
            if not buf_a or not buf_b:
                return not buf_a and not buf_b
            n = min(len(buf_a), len(buf_b))
            if buf_a[:n] != buf_b[:n]:
                return False
            buf_a, buf_b = buf_a[n:], buf_b[n:]
    except _GZIP_ERRORS:
        return False
