"""A content-defined sample of an input's lines, taken during the count pass (`scan`), for `same_content.same_rows`.

Two inputs holding the same rows in other bytes (CRLF against LF line ends, a byte-order mark, another order of the
lines, a gzip of either, a file holding a part of another: ``head day_0 > sample``) are told apart from distinct logs
by the share of their lines they have in common, estimated from a sample of each input's lines. The sample must pick
the same lines in every input that holds them, whatever their position, their file or the worker process reading
them: a line is sampled when its *key*, a deterministic 64-bit hash of its content (not Python's per-process
``hash()``), falls in the lowest ``1 / 2**level`` of the key space. Each sampled line is kept with a 64-bit *digest* of
all its bytes (`_digests`), which the comparison matches.

The key is computed for every line, so it is cheap: vectorized over a block's lines, it mixes the line's length with
three 8-byte words of it (its first, middle and last 8 bytes), which for a Criteo row hold the label and first counts,
a categorical value mid-line and the last one (or the separators of missing ones). Lines alike in those
bytes but not in others share their key, so they are sampled together and told apart by their digests: the key only
picks lines, it never decides that two lines are equal. Only the sampled lines are digested.

Normalized first: a trailing ``\\r`` (CRLF line ends) and the UTF-8 byte-order mark before a file's first line are
not part of a line; a CSV header, empty lines and lines shorter than 8 bytes (no Criteo row is: 40 fields take 39
separators) are not sampled.

Size: the level starts at 0 (every line) and rises by one, halving the sample, whenever it holds more than
`SAMPLE_CAP` distinct lines, so a small input is compared line by line and a Criteo day (~195M lines) by ~33-65k of
its lines, 16 bytes each. Samples of parts of a file (`sample_range`, counted by several workers) merge into the
sample of the whole file, as a line's selection does not depend on where it was read.
"""

from __future__ import annotations

import hashlib

import numpy as np

SAMPLE_CAP = 1 << 16  # distinct lines kept a file: 1 MiB; a day of Criteo 1TB is sampled at 1/4096-1/2048
_MIN_LINE = 8  # bytes: the key and the digest read 8-byte words of a line
_LINE_BYTES = 256  # a Criteo row's bytes, rounded up (Kaggle's train.txt: 242 on average; a Terabyte day: ~240)
GZIP_RATIO = 3  # decompressed bytes a byte of a gzip'ed Criteo log, rounded down: its size is not known beforehand
_LONG_DIGEST = 4096  # bytes: a longer line is digested alone (`_digests`)
_LONG_LINE = 1 << 20  # a "line" this long with no newline yet is no row (a CR-only file, binary data): not sampled
_BOM = b"\xef\xbb\xbf"
_TOP = 64  # the last level (keys of 0 alone): more lines than the cap with one key of 0 stay (a 2**-64 chance)
_U = np.uint64
_M1, _M2, _SEED = _U(0xFF51AFD7ED558CCD), _U(0xC4CEB9FE1A85EC53), _U(0x9E3779B97F4A7C15)
_ODD = tuple(_U(c) for c in (0xA0761D6478BD642F, 0xE7037ED1A0B428DB, 0x8EBC6AF09C88C6E3))  # (wyhash's primes)


def _fmix(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finalizer: every bit of the input moves about half the output bits."""
    h = h ^ (h >> _U(33))
    h = h * _M1
    h = h ^ (h >> _U(33))
    h = h * _M2
    return h ^ (h >> _U(33))


def _keys(buf: bytes, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The keys of the lines ``buf[starts[i]:ends[i]]`` (each at least `_MIN_LINE` bytes, normalized)."""
    words = np.ndarray((len(buf) - 7,), dtype="<u8", buffer=buf, strides=(1,))  # a word at every byte offset
    lens = ends - starts
    h = lens.astype(_U) * _SEED
    with np.errstate(over="ignore"):  # (uint64 arithmetic wraps, as a hash wants)
        for at, odd in zip((starts, starts + ((lens - 8) >> 1), ends - 8), _ODD):
            h += words[at] * odd  # (one multiply a word and one finalizer a line: the key is computed for all)
        return _fmix(h)


def _digests(buf: bytes, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """64-bit digests of all the bytes of the lines ``buf[starts[i]:ends[i]]`` (each at least `_MIN_LINE` bytes):
    their length, then each 8-byte word in turn, mixed in (two lines of one length that differ in one word never
    collide: each step, an xor, an odd multiply and an xor-shift, is a bijection), then `_fmix`. Vectorized over the
    lines, a word column at a time; a line longer than `_LONG_DIGEST` (none is a Criteo row) is digested alone, by
    BLAKE2b."""
    out = np.empty(len(starts), _U)
    lens = ends - starts
    long = lens > _LONG_DIGEST
    for i in np.flatnonzero(long).tolist():
        out[i] = int.from_bytes(hashlib.blake2b(buf[starts[i]:ends[i]], digest_size=8).digest(), "little")
    if long.all():
        return out
    short = ~long
    s, e = starts[short], ends[short]
    words = np.ndarray((len(buf) - 7,), dtype="<u8", buffer=buf, strides=(1,))
    h = (e - s).astype(_U) * _M2
    with np.errstate(over="ignore"):
        for col in range(-(-int((e - s).max()) // 8)):
            p = s + 8 * col
            at = np.minimum(p, e - 8)  # a line's last word is read at its end, then shifted to its first bytes
            w = words[at] >> (np.minimum(p - at, 7) * 8).astype(_U)
            mixed = (h ^ w) * _M1
            h = np.where(p < e, mixed ^ (mixed >> _U(29)), h)  # (a line's digest must not depend on the others')
        out[short] = _fmix(h)
    return out


def _bound(level: int) -> int:
    """Keys below this are sampled at ``level`` (2**64 at level 0: every key)."""
    return 1 << (64 - level)


class LineSample:
    """The sampled lines of one input: their keys and digests (distinct digests), and the level they were taken at."""

    def __init__(self, cap: int | None = None):
        self.cap = cap or SAMPLE_CAP
        self.level = 0
        self.keys = np.empty(0, _U)
        self.digests = np.empty(0, _U)

    def make_room(self, keys: np.ndarray) -> None:
        """Raise the level (drop the sampled lines above it) until the lines of ``keys`` sampled at it fit beside the
        others: the lines a block adds are digested only once the level is known."""
        new = keys[keys < _U(_bound(self.level))] if self.level else keys
        if len(self.keys) + len(new) <= self.cap:
            return
        new = np.unique(new)  # (a line repeated in the block: once)
        while len(self.keys) + len(new) > self.cap and self.level < _TOP:
            self.level += 1
            self.keys, self.digests = self.at(self.level)
            new = new[new < _U(_bound(self.level))]

    def add(self, keys: np.ndarray, digests: np.ndarray) -> None:
        """Lines sampled at this level; the level rises (the sample halves) while it holds more than ``cap``."""
        self.keys = np.concatenate((self.keys, keys))
        self.digests = np.concatenate((self.digests, digests))
        if len(self.keys) > self.cap:
            self.digests, first = np.unique(self.digests, return_index=True)  # a line repeated in the file: once
            self.keys = self.keys[first]
            while len(self.keys) > self.cap and self.level < _TOP:
                self.level += 1
                self.keys, self.digests = self.at(self.level)

    def merge(self, other: LineSample) -> None:
        """Add the sample of another part of the same input."""
        self.level = max(self.level, other.level)
        self.keys, self.digests = self.at(self.level)
        self.add(*other.at(self.level))

    def at(self, level: int) -> tuple[np.ndarray, np.ndarray]:
        """The keys and digests of the lines sampled at ``level`` (at least this sample's)."""
        if level == 0:
            return self.keys, self.digests
        keep = self.keys < _U(_bound(level))
        return self.keys[keep], self.digests[keep]

    def sampled(self, level: int) -> np.ndarray:
        """The distinct digests of the lines sampled at ``level``."""
        return np.unique(self.at(level)[1])

    def __reduce__(self):  # (sent back from a worker as three arrays, not a pickle of attributes one by one)
        return _rebuild, (self.cap, self.level, self.keys, self.digests)


def _rebuild(cap: int, level: int, keys: np.ndarray, digests: np.ndarray) -> LineSample:
    s = LineSample(cap)
    s.level, s.keys, s.digests = level, keys, digests
    return s


def start_level(data_bytes: int) -> int:
    """The level to start a file of about ``data_bytes`` (decompressed) at: the one its lines would reach, taken as
    `_LINE_BYTES` each. Starting at level 0, a file digested its first `SAMPLE_CAP` lines, then half as many
    at each level on its way up, most of them dropped again: 0.1 s for every input. A file of longer lines ends with a
    smaller sample (a quarter of the cap for lines 4 times as long); one of shorter lines climbs the rest of the way."""
    return (data_bytes // _LINE_BYTES // SAMPLE_CAP).bit_length()  # (2**level > lines / cap: at most cap sampled)


class LineSampler:
    """Samples the lines of a stream of blocks (an input read in order, or a byte range of it: `sample_range`).

    ``skip_first``: the first line is not sampled (a CSV header, or, in a byte range, the end of a line that began
    before it). ``at_file_start``: the first line may begin with a byte-order mark. ``level``: the level to start at
    (`start_level`; the same for every range of a file)."""

    def __init__(self, skip_first: bool = False, at_file_start: bool = True, level: int = 0):
        self.sample = LineSample()
        self.sample.level = level
        self.skip = skip_first
        self.bom = at_file_start
        self.tail = b""  # the start of a line the blocks so far did not end

    def feed(self, b: bytes) -> np.ndarray:
        """Sample the lines ``b`` ends; returns the offsets of its newlines (the count pass counts them)."""
        a = np.frombuffer(b, np.uint8)
        nl = np.flatnonzero(a == 10)
        if not len(nl):
            if not self.skip:
                self._keep_tail(self.tail + b)
            return nl
        self._one(self.tail + b[:nl[0]])  # the line the previous blocks began
        starts, ends = nl[:-1] + 1, nl[1:]
        if len(ends):
            ends = ends - (a[ends - 1] == 13)  # CRLF: the \r is no part of the line
            self._sample(b, starts, ends)
        self._keep_tail(b[nl[-1] + 1:])
        return nl

    def _keep_tail(self, tail: bytes) -> None:
        if len(tail) > _LONG_LINE:  # no row: the line is not sampled (its end is skipped as a header is)
            self.tail, self.skip = b"", True
        else:
            self.tail = tail

    def close(self) -> LineSample:
        """The sample, with a last line that ends without a newline."""
        if self.tail:
            self._one(self.tail)
            self.tail = b""
        return self.sample

    def _one(self, line: bytes) -> None:
        if self.bom:
            line, self.bom = line.removeprefix(_BOM), False
        if self.skip:
            self.skip = False
            return
        line = line.removesuffix(b"\r")
        self._sample(line, np.zeros(1, np.int64), np.full(1, len(line), np.int64))

    def _sample(self, buf: bytes, starts: np.ndarray, ends: np.ndarray) -> None:
        long = ends - starts >= _MIN_LINE
        if not long.all():
            starts, ends = starts[long], ends[long]
        if not len(starts):
            return
        keys = _keys(buf, starts, ends)
        self.sample.make_room(keys)
        pick = np.flatnonzero(keys < _U(_bound(self.sample.level))) if self.sample.level else np.arange(len(keys))
        if not len(pick):
            return
        self.sample.add(keys[pick], _digests(buf, starts[pick], ends[pick]))


def sample_range(f, start: int, end: int, read_block: int, header: bool, level: int) -> tuple[int, LineSample]:
    """The newlines in bytes [start, end) of the open plain file ``f`` and the sample of the lines that begin there
    (one that begins there and ends after ``end`` is read to its newline; ``header``: the file's first line is a CSV
    header, not sampled; ``level``: the file's `start_level`). Every line of a file begins in one range:
    the samples of a file's ranges merge into the sample of the whole file."""
    if start > 0:  # whether a line begins at `start`: the byte before it is a newline
        f.seek(start - 1)
        sampler = LineSampler(skip_first=True, at_file_start=False, level=level)
        sampler.feed(f.read(1))
    else:
        f.seek(0)
        sampler = LineSampler(skip_first=header, level=level)
    n, left = 0, end - start
    while left > 0:
        b = f.read(min(read_block, left))
        if not b:
            break
        n += len(sampler.feed(b))
        left -= len(b)
    while sampler.tail and not sampler.skip:  # the last line begun here, to its end (its newline is not counted)
        b = f.read(1 << 16)
        if not b:
            break
        nl = b.find(b"\n")
        if nl >= 0:
            sampler.feed(b[:nl + 1])
            break
        sampler.feed(b)
    return n, sampler.close()
