"""Two inputs holding the same data or rows under different names: refused, naming both.

A copy (``cp day_0 day_0_copy``), or a day file given both plain and gzip'ed (a ``day_*`` glob after ``gunzip -k``),
puts every row in twice; under ``--split sequential`` or ``random`` its copies land in train and in test alike, and the
test AUC measures rows the model trained on. So does the same rows in other bytes: CRLF against LF line ends, a
byte-order mark, another order of the lines (``shuf``), a gzip of any of these, or a file that holds a part of another
(``head day_0 > sample`` given beside ``day_0``). (The same file under another name, a symlink or a hard link is refused
earlier, by `options._check_distinct`, from its inode.)

Three checks, cheapest first, each refusing in one line (`PreprocessError`, exit 2) before anything is written:

- `same_bytes`, before the count pass: files of one size and first 64 KiB compared to their end.
- `same_data`, after it: a gzip file and another of the same decompressed size and line count, compared decompressed.
- `same_rows`, after it: the share of the smaller input's lines that are lines of another, estimated from the samples
  of their lines the count pass took (`line_sample`: content-defined, so a line is sampled in every input that holds
  it, wherever it stands; line ends and a byte-order mark left out). Refused from half of them (see `same_rows`).

Inputs that overlap on purpose (a concatenation of day files given beside them, shared rows known to be real repeats
of the log): ``--allow-shared-rows`` turns `same_rows`'s refusal into a warning naming both files and the share,
recorded in the manifest (a resumed run, whose count pass is the manifest's, without samples, keeps the finding:
refused without the flag, warned again with it: `recorded_shares`) and in ``metadata.extra["shared_rows"]``. A copy
of the same bytes or the same data is kept alike under it: `same_bytes` and `same_data` are not run, and `same_rows`
finds it as a share of 100%, as it finds a reordered copy (before, the flag kept the reordered copy and refused the
byte-identical one; the flag is the user's word that rows read twice are meant, a day given twice to weigh it double;
a copy of under 8 lines is not judged, as no share of so few lines is). One file named twice (the same path, a
symlink, a hard link: `options._check_distinct`) is refused with the flag too: a slip, not a second input.

Cost on terabyte-scale day files: the exact comparisons only read inputs that could be equal, and stop at the first
block that differs, so inputs of different data cost one ``stat`` (a size each) or nothing beyond the count pass. Only
identical data is read in full a second time, once, before the run is refused. The samples cost no read either: the
count pass already reads every byte; a line's key, three 8-byte words of it mixed (vectorized), picks the lines whose
whole bytes are digested, at most 65,536 distinct lines a file (1 MiB) are kept, and only digests found in two inputs
pair them for a closer look. Measured on 400,000 Criteo-format lines (98 MB, the synthetic generator's raw TSV), one
worker: the count pass took 0.16 s instead of 0.09 (plain) and 0.61 s instead of 0.53 (gzip), the whole run 1.40 s
instead of 1.32 and 2.46 s instead of 2.28.

Not detected: rows that differ in their bytes beyond line ends and a leading byte-order mark (upper against lower
case hex, CSV against TSV, a trailing separator); a few shared lines (natural repeats, a part of under 8 lines of a
small input, or of under ~1/2,000 of the other's lines beside a large one, where too few of its lines are sampled at
the other's rate); rows repeated inside one input; and a resumed run's inputs, compared by the run it resumes (its
inputs must be the same files).
"""
from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
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


SHARE = 0.5  # refused from this share of the smaller input's sampled lines found in another input
MIN_SAMPLED = 32  # ... no judgment on fewer sampled lines than this, where the lines were sampled (level > 0)
MIN_SHARED = 8  # ... nor on fewer shared lines than this, where every line of both was (level 0: no sampling noise)


def same_rows(scans: list, allow: bool = False) -> list[dict]:
    """Refuse two inputs where most of the lines of the one with fewer lines are lines of the other, in any order and
    whatever their line ends or byte-order mark (a copy in other bytes, or a part of the other); after the count pass,
    from its samples (`line_sample`): the lines of both sampled at the coarser of their two levels are compared, and
    the share of the smaller input's sampled lines found in the other decides. `allow` (``--allow-shared-rows``:
    inputs that overlap on purpose, a concatenation of day files given beside them) warns instead, naming both files
    and the share (`warn_shared`); returned, one record each, for the manifest and metadata.json.

    Why a share of 1/2 over at least 32 sampled lines: a copy, a reordering or a part of another input has every
    sampled line in the other (the sample takes a line wherever it is), a share of 1, with no sampling noise; distinct
    logs share only the lines that repeat naturally (rows of mostly missing values, a small share of a real log's), so
    a share of 1/2 is far from both. 32 lines keep the estimate's noise out of the decision: an input that truly
    shares 10% of its lines reaches 16 of 32 with a probability of about 1e-7. An input with fewer sampled lines than
    that at the level the other was sampled at (one under ~1/2,000 of a Criteo day given beside it) is not judged
    (logged where half of them are shared): its rows are too few to weigh on an AUC. Where both inputs are small enough to be
    sampled whole (level 0, up to `line_sample.SAMPLE_CAP` lines each) the share is exact, not an estimate: a part of
    8 lines or more is refused (``head day_0 > sample``: 10), a handful of shared lines is not."""
    sampled = [sc for sc in scans if sc.error is None and sc.lines and sc.sample is not None]
    cache: dict[tuple[int, int], np.ndarray] = {}
    accepted: list[dict] = []

    def at(i: int, level: int) -> np.ndarray:  # (each input's distinct digests at a level, sorted, once)
        if (i, level) not in cache:
            cache[(i, level)] = sampled[i].sample.sampled(level)
        return cache[(i, level)]

    for (i, j), most in _sharing_pairs([at(i, sc.sample.level) for i, sc in enumerate(sampled)]):
        (s, small), (b, big) = sorted([(i, sampled[i]), (j, sampled[j])], key=lambda x: (x[1].lines, -x[0]))
        level = max(small.sample.level, big.sample.level)  # (a line sampled at a level is sampled at every lower one)
        mine = at(s, level)
        if most < SHARE * len(mine):  # (the lines shared at their own levels, as many or more: no refusal)
            continue
        shared = int(np.isin(mine, at(b, level), assume_unique=True).sum())
        if (len(mine) < MIN_SAMPLED if level else shared < MIN_SHARED):
            logger.info("{}: {} of its {} sampled lines are lines of {} too: too few sampled lines to judge whether it "
                        "is a copy", small.path, shared, len(mine), big.path)
        elif shared >= SHARE * len(mine):
            found = {"file": str(small.path), "other": str(big.path), "shared": shared, "sampled": len(mine)}
            if not allow:
                raise PreprocessError(
                    f"{_share_text(found)}: a copy, or a part, of it? its rows would be read twice, in train and in "
                    "test alike; list every file once, or remove the shared lines from one of them (or give "
                    "--allow-shared-rows where the inputs overlap on purpose)")
            warn_shared(found)
            accepted.append(found)
        elif shared:
            logger.info("{}: {:.1%} of its lines are also lines of {} ({:,} of {:,} sampled lines): kept (refused as a "
                        "copy from {:.0%})", small.path, shared / len(mine), big.path, shared, len(mine), SHARE)
    return accepted


def _share_text(found: dict) -> str:
    share = found["shared"] / found["sampled"]
    return (f"{found['file']}: {share:.0%} of its lines are also lines of {found['other']} ({found['shared']:,} of "
            f"{found['sampled']:,} sampled lines, whatever their order, line ends or byte-order mark)")


def warn_shared(found: dict) -> None:
    """The warning of one pair of inputs `same_rows` accepted under --allow-shared-rows (a resumed run repeats it from
    its manifest: the log of the run that finishes the dataset says it too)."""
    logger.warning("{}: kept, as --allow-shared-rows asks: the shared rows are read twice (where the split puts them, "
                   "in train and in test alike)", _share_text(found))


def recorded_shares(manifest: dict, allow: bool, where: Path) -> list[dict]:
    """The shares of rows the unfinished run of `manifest` (at `where`) accepted under --allow-shared-rows: its
    resume's scans carry no samples to compare again, and without the flag it went on in silence (a way around the
    refusal); refused so now, and warned again with it."""
    found = manifest.get("shared_rows") or []
    keys = {"file": str, "other": str, "shared": int, "sampled": int}
    if not isinstance(found, list) or not all(isinstance(f, dict) and all(isinstance(f.get(k), t) for k, t in
                                                                          keys.items()) and f["sampled"] > 0
                                              for f in found):
        raise PreprocessError(f"{where}: unreadable (shared_rows: {found!r:.80}); use --overwrite to start over")
    if found and not allow:
        more = f" and {len(found) - 1} more" if len(found) > 1 else ""
        raise PreprocessError(f"{where}: the unfinished run there was given inputs that share rows, with "
                              f"--allow-shared-rows ({_share_text(found[0])}{more}); give --allow-shared-rows to "
                              "resume it, or change the inputs and start over with --overwrite")
    for f in found:
        warn_shared(f)
    return found


def _sharing_pairs(samples: list[np.ndarray]) -> list[tuple[tuple[int, int], int]]:
    """The pairs of inputs (indices, in order) whose samples (distinct digests each) share enough digests for a
    refusal (at least SHARE * MIN_SAMPLED, or MIN_SHARED), with how many they share. Counted in one pass over every
    sample, not one comparison a pair of inputs: the few lines that repeat naturally in every file of a log split in
    a thousand files pair them all, but once."""
    if len(samples) < 2:
        return []
    digests = np.concatenate(samples)
    owners = np.concatenate([np.full(len(d), i, np.int64) for i, d in enumerate(samples)])
    order = np.argsort(digests, kind="stable")
    digests, owners = digests[order], owners[order]
    starts = np.flatnonzero(np.r_[True, digests[1:] != digests[:-1]])
    sizes = np.diff(np.r_[starts, len(digests)])
    n = len(samples)
    two = starts[sizes == 2]  # (a line in two inputs: the usual case, a copy's every line)
    codes = [owners[two] * n + owners[two + 1]]
    for start, size in zip(starts[sizes > 2].tolist(), sizes[sizes > 2].tolist()):
        i, j = np.triu_indices(size, 1)
        group = owners[start:start + size]
        codes.append(group[i] * n + group[j])
    pairs, counts = np.unique(np.concatenate(codes), return_counts=True)
    need = min(SHARE * MIN_SAMPLED, MIN_SHARED)
    return [((c // n, c % n), k) for c, k in zip(pairs.tolist(), counts.tolist()) if k >= need]


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
