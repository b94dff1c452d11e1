"""The chunk parser: raw lines (TSV or CSV, no header) to validated label/dense/sparse arrays."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from dlrm.data.preprocess.constants import _M64, _U, INT32_MAX, NUM_FIELDS, RAW_COLUMNS
from dlrm.data.preprocess.errors import BadLine, BadLineError, field_text
from dlrm.data.preprocess.line_endings import cr_advice, cr_ended, trailing_separator_hint
from dlrm.data.schema import (
    MISSING_SPARSE,
    NUM_DENSE,
    NUM_SPARSE,
    PAD_SPARSE,
    SparseLayout,
    arrow_schema,
    feature_columns,
    is_multi_hot,
    slot_offsets,
)

MULTI_HOT_SEPARATOR = b","
"""Separates the hex values of a multi-hot field (TSV only: it is CSV's field separator)."""

_BLOCK_BYTES = 1 << 22  # parse_chunk works through blocks of about this size

@dataclass
class ParsedChunk:
    """The rows of one chunk that passed validation, in line order.

    ``dense`` is (13, n) int32 and ``sparse`` (L, n) int64, so that each column is contiguous
    (L = 26 when one-hot; multi-hot: the slot layout of `dlrm.data.schema.slot_offsets`, empty
    slots `PAD_SPARSE`).
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
        """label, dense and sparse of the rows ``idx`` (None: all, without copying)."""
        if idx is None:
            return self.label, self.dense, self.sparse
        return self.label[idx], self.dense[:, idx], self.sparse[:, idx]

    def to_table(self, idx: np.ndarray | None = None, multi_hot_sizes: list[int] | None = None,
                 layout: SparseLayout = "lists"):
        """A `pyarrow.Table` with `arrow_schema(multi_hot_sizes, layout)` (of the rows ``idx``, default all)."""
        return _to_table(*self.take(idx), multi_hot_sizes, layout)


def _to_table(label: np.ndarray, dense: np.ndarray, sparse: np.ndarray, multi_hot_sizes: list[int] | None = None,
              layout: SparseLayout = "lists"):
    """A `pyarrow.Table` with `arrow_schema(multi_hot_sizes, layout)` of label (n,), dense (13, n) and
    sparse (L, n) arrays: a multi-hot feature's slot rows become its list column ("lists") or, as
    they are, its slot columns ("slots", `PAD_SPARSE` kept in the empty ones)."""
    import pyarrow as pa

    arrays = [pa.array(np.ascontiguousarray(label, dtype=np.int8))]
    arrays += [pa.array(np.ascontiguousarray(dense[i], dtype=np.int32)) for i in range(NUM_DENSE)]
    offsets = slot_offsets(multi_hot_sizes)
    for f in range(NUM_SPARSE):
        lo, hi = offsets[f], offsets[f + 1]
        arrays += feature_columns(sparse[lo:hi].T, layout)
    return pa.Table.from_arrays(arrays, schema=arrow_schema(multi_hot_sizes, layout))


_PAD = 8  # bytes in front of the data, so that an 8-byte window ending at any field is in bounds
_HEX_LUT = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX_LUT[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX_LUT[_c] = 10 + _i
_HEX_PAIR_LUT = np.full(1 << 16, 0x100, dtype=np.uint16)
_hex_ok = np.flatnonzero(_HEX_LUT != 255)
_HEX_PAIR_LUT[(_hex_ok[None, :] << 8) | _hex_ok[:, None]] = (
    (_HEX_LUT[_hex_ok][:, None] << 4) | _HEX_LUT[_hex_ok][None, :]
)
del _hex_ok
# An 8-byte little-endian window that ends where a field of L characters ends holds the field in
# its top L bytes; _KEEP[L] selects them and _FILL[L] sets the other bytes to ASCII '0'.
_KEEP = np.array([0] + [(_M64 << (8 * (8 - n))) & _M64 for n in range(1, 9)], dtype=np.uint64)
_FILL = np.array([0x3030303030303030 & ~int(k) & _M64 for k in _KEEP], dtype=np.uint64)
_DENSE_RE = re.compile(rb"[+-]?[0-9]+(?:\.[0-9]*)?")
_HEX_RE = re.compile(rb"[0-9a-fA-F]{1,8}")


def _delimiter_of(fmt: str) -> bytes:
    """The field separator of a format ("tsv" or "csv")."""
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
    """The reference grammar of a category: 1 to 8 hex digits (either case)."""
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
    """Labels between s and e: "0" or "1" (fast), else any count equal to 0 or 1; others are bad."""
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


def _parse_multi_hot_column(cb: _Buffer, commas: np.ndarray, s, e, size: int, out_bad: list, col: int) -> np.ndarray:
    """A multi-hot column: fields of hex values separated by `MULTI_HOT_SEPARATOR` (empty field:
    no value) as slots (size, n), `PAD_SPARSE` after each row's values. Vectorized over all values
    of the column: the separators in each field come from one search in `commas` (the sorted
    separator positions of the block, with a sentinel at the end), each value is then a token
    parsed by `_parse_sparse_column`. An empty value (``a,,b``, a trailing comma) or more than
    `size` values make the row bad (reason bad_category, the policy of every bad value)."""
    n = s.shape[0]
    lo, hi = np.searchsorted(commas, s), np.searchsorted(commas, e)
    k = np.where(e > s, hi - lo + 1, 0)  # values per field
    row = np.repeat(np.arange(n), k)
    j = np.arange(row.size) - np.repeat(np.cumsum(k) - k, k)  # a value's place in its list
    at = np.repeat(lo, k) + j  # the separator after value j (when j is not the last)
    starts = np.where(j == 0, np.repeat(s, k), commas[np.maximum(at - 1, 0)] + 1)
    ends = np.where(j == np.repeat(k, k) - 1, np.repeat(e, k), commas[np.minimum(at, commas.size - 1)])
    token_bad: list = []
    values = _parse_sparse_column(cb, starts, ends, token_bad, col)
    # each with its own message: the one-value column's ("is not a hexadecimal category hash ... this column's
    # --multi-hot-sizes size is 1, or none given") named a multi-hot value list by its comma, as if it were one value
    empty_rows = np.unique(row[ends == starts])
    if empty_rows.size:
        out_bad.append((empty_rows, col, ("holds an empty value (',,', or ',' at its start or end): a multi-hot "
                                          "field's values are hexadecimal category hashes separated by ','")))
    for t, _ in token_bad:
        out_bad.append((np.unique(row[t]), col, ("holds a value that is not a hexadecimal category hash "
                                                 "(1 to 8 hex digits)")))
    too_long = k > size
    if too_long.any():
        out_bad.append((np.flatnonzero(too_long), col, f"holds more than {size} values (--multi-hot-sizes)"))
    out = np.full((size, n), PAD_SPARSE, dtype=np.int64)
    keep = ~too_long[row]
    out[j[keep], row[keep]] = values[keep]
    return out


def _bad_detail(col: int) -> tuple[str, str]:
    """The reason (one of BAD_LINE_REASONS) and message of a bad value in raw column ``col``."""
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
    multi_hot_sizes: list[int] | None = None,
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
        multi_hot_sizes: per categorical field the most values it may hold (None: one-hot); a
            field of a feature with size > 1 holds 0 or more hex values separated by
            `MULTI_HOT_SEPARATOR` (TSV only), and ``sparse`` has its slots (`ParsedChunk`). A
            field with more values is a bad line (bad_category), like any bad value.
    """
    if is_multi_hot(multi_hot_sizes) and fmt == "csv":
        raise ValueError("multi-hot fields need --format tsv: ',' separates both CSV fields and multi-hot values")
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
        part = _parse_block(data[start:end], delim, source, line, multi_hot_sizes)
        if part.first_bad is not None and on_bad_line == "stop":
            raise BadLineError(part.first_bad)
        blocks.append(part)
        line += part.n_lines
        start = end
    if len(blocks) == 1:
        return blocks[0]
    return _concat_blocks(blocks)


def _concat_blocks(blocks: list[ParsedChunk]) -> ParsedChunk:
    """One `ParsedChunk` of consecutive blocks (line numbers continue across them)."""
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


@dataclass
class _Lines:
    """The lines of a block with 40 fields (``line_index``: their 0-based lines, None: all) in
    their padded buffer, and what was found wrong with the others."""

    cb: _Buffer
    n: int
    line_index: np.ndarray | None = None
    bad_counts: dict[str, int] = field(default_factory=dict)
    first_bad: BadLine | None = None


def _parse_block(data: bytes, delim: int, source: str, first_line: int,
                 multi_hot_sizes: list[int] | None = None) -> ParsedChunk:
    """`parse_chunk` of newline-terminated lines; never raises, bad lines are in the result."""
    n_lines = data.count(b"\n")
    lines, pos = _good_lines(data, delim, n_lines, source, first_line)
    starts, ends = _field_bounds(pos, lines.n)
    del pos  # the bounds replace it; free it before the columns are decoded
    value_bad: list[tuple[np.ndarray, int]] = []
    clipped_rows: list[np.ndarray] = []
    label, dense, sparse = _parse_fields(lines.cb, starts, ends, lines.n, value_bad, clipped_rows, multi_hot_sizes)
    keep_rows = None
    if value_bad:
        keep_rows = _drop_bad_values(lines, value_bad, starts, ends, source, first_line)
        label, dense, sparse = label[keep_rows], dense[:, keep_rows], sparse[:, keep_rows]
    clipped = 0
    for rows in clipped_rows:  # clipped values of dropped rows do not count
        clipped += int(rows.size if keep_rows is None else np.count_nonzero(keep_rows[rows]))
    return ParsedChunk(label, dense, sparse, n_lines, lines.line_index, lines.bad_counts, lines.first_bad, clipped)


def _good_lines(data: bytes, delim: int, n_lines: int, source: str, first_line: int) -> tuple[_Lines, np.ndarray]:
    """The lines with 40 fields and the positions of their separators (fast path: all of them)."""
    cb = _Buffer(data)
    pos = _separators(cb.body, delim, n_lines, data.count(bytes([delim])))
    if pos is not None:
        return _Lines(cb, n_lines), pos
    return _drop_wrong_field_counts(cb, delim, source, first_line)


def _drop_wrong_field_counts(cb: _Buffer, delim: int, source: str, first_line: int) -> tuple[_Lines, np.ndarray]:
    """Some line has the wrong number of fields (or a stray control byte): find them exactly,
    then keep the good lines only, in a buffer of their own."""
    body = cb.body
    nl = np.flatnonzero(body == 10)
    dl = np.flatnonzero(body == delim)
    line_start = np.concatenate(([0], nl[:-1] + 1))
    nfields = np.searchsorted(dl, nl) - np.searchsorted(dl, line_start) + 1
    good = nfields == NUM_FIELDS
    bad_lines = np.flatnonzero(~good)
    bad_counts: dict[str, int] = {}
    first_bad = None
    if bad_lines.size:
        bad_counts["wrong_field_count"] = int(bad_lines.size)
        i = int(bad_lines[0])
        found = "an empty line" if nl[i] == line_start[i] else f"{int(nfields[i])}"
        if first_line + i == 1 and nfields[i] == NUM_FIELDS - 1 and nl[i] != line_start[i]:
            # the file's first line one field short: a file without labels, such as Kaggle's test.txt
            found += " (no label column? Kaggle's test.txt has none: preprocess train.txt)"
        elif nfields[i] == 1:  # no separator at all: the other format's line (--format tsv given a CSV file)?
            other = {ord("\t"): (b",", "csv"), ord(","): (b"\t", "tsv")}.get(delim)
            if other is not None and body[line_start[i]:nl[i]].tobytes().count(other[0]) == NUM_FIELDS - 1:
                found += (f" (the line has {NUM_FIELDS} fields separated by {other[0].decode()!r}: "
                          f"a {other[1].upper()} file? give --format {other[1]} or auto)")
        elif cr_ended(body[line_start[i]:nl[i]].tobytes()):  # (a file's first line says it in the count pass)
            found += f" ({cr_advice(None)})"
        else:  # "found 41" alone did not say that the extra field is the empty one after a separator at the end
            found += trailing_separator_hint(body[line_start[i]:nl[i]].tobytes(), delim, int(nfields[i]))
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
    return _Lines(cb, n, line_index, bad_counts, first_bad), pos


def _field_bounds(pos: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(40, n) start and end offsets in the padded buffer of every field of every line, from the
    separator positions in the body (``pos`` is shifted in place)."""
    pos += _PAD
    # ends[c] = position of the separator after field c of every line
    ends = np.ascontiguousarray(pos.reshape(n, NUM_FIELDS).T)
    starts = np.empty_like(ends)
    starts[1:] = ends[:-1]
    starts[0, 1:] = ends[-1, :-1]
    if n:
        starts[0, 0] = _PAD - 1
    starts += 1
    return starts, ends


def _parse_fields(cb: _Buffer, starts: np.ndarray, ends: np.ndarray, n: int, value_bad: list,
                  clipped_rows: list, multi_hot_sizes: list[int] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decode every column; rows of bad values go to ``value_bad``, of clipped counts to ``clipped_rows``."""
    if is_multi_hot(multi_hot_sizes):
        return _parse_fields_multi_hot(cb, starts, ends, n, value_bad, clipped_rows, multi_hot_sizes)
    label = _parse_label_column(cb.buf, starts[0], ends[0], value_bad)
    dense = np.empty((NUM_DENSE, n), dtype=np.int32)
    for j in range(NUM_DENSE):
        c = 1 + j
        dense[j] = _parse_dense_column(cb, starts[c], ends[c], value_bad, clipped_rows, c)
    sparse = np.empty((NUM_SPARSE, n), dtype=np.int64)
    for j in range(NUM_SPARSE):
        c = 1 + NUM_DENSE + j
        sparse[j] = _parse_sparse_column(cb, starts[c], ends[c], value_bad, c)
    return label, dense, sparse


def _parse_fields_multi_hot(cb: _Buffer, starts: np.ndarray, ends: np.ndarray, n: int, value_bad: list,
                            clipped_rows: list, sizes: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_parse_fields` with multi-hot categorical fields: sparse is (L, n), in slots."""
    label = _parse_label_column(cb.buf, starts[0], ends[0], value_bad)
    dense = np.empty((NUM_DENSE, n), dtype=np.int32)
    for j in range(NUM_DENSE):
        c = 1 + j
        dense[j] = _parse_dense_column(cb, starts[c], ends[c], value_bad, clipped_rows, c)
    offsets = slot_offsets(sizes)
    sparse = np.empty((offsets[-1], n), dtype=np.int64)
    commas = np.append(np.flatnonzero(cb.buf == MULTI_HOT_SEPARATOR[0]), cb.buf.size)  # sentinel at the end
    for j, size in enumerate(sizes):
        c = 1 + NUM_DENSE + j
        if size == 1:
            sparse[offsets[j]] = _parse_sparse_column(cb, starts[c], ends[c], value_bad, c)
        else:
            sparse[offsets[j] : offsets[j + 1]] = _parse_multi_hot_column(cb, commas, starts[c], ends[c], size,
                                                                          value_bad, c)
    return label, dense, sparse


def _drop_bad_values(lines: _Lines, value_bad: list[tuple[np.ndarray, int]], starts: np.ndarray,
                     ends: np.ndarray, source: str, first_line: int) -> np.ndarray:
    """Rows with a bad value: the first may become the block's first bad line (unless a line with
    the wrong field count comes before it), all are counted per reason of their first bad column.
    Updates ``lines`` and returns the mask of the rows to keep."""
    first_col = np.full(lines.n, NUM_FIELDS, dtype=np.int64)
    for rows, col, *_ in value_bad:
        first_col[rows] = np.minimum(first_col[rows], col)
    bad_rows = np.flatnonzero(first_col < NUM_FIELDS)
    r = int(bad_rows[0])
    line_of_r = r if lines.line_index is None else int(lines.line_index[r])
    if lines.first_bad is None or first_line + line_of_r < lines.first_bad.line:
        col = int(first_col[r])
        # a multi-hot field with too many values says so (its values themselves may all be fine)
        details = [d[0] for rows, c, *d in value_bad if d and c == col and np.isin(r, rows)]
        lines.first_bad = _bad_value(lines.cb, starts, ends, col, r, source, first_line + line_of_r,
                                     details[0] if details else None)
    cols = first_col[bad_rows]
    for reason, count in (
        ("bad_label", int(np.count_nonzero(cols == 0))),
        ("bad_integer", int(np.count_nonzero((cols >= 1) & (cols <= NUM_DENSE)))),
        ("bad_category", int(np.count_nonzero(cols > NUM_DENSE))),
    ):
        if count:
            lines.bad_counts[reason] = lines.bad_counts.get(reason, 0) + count
    keep_rows = first_col == NUM_FIELDS
    base = np.arange(lines.n, dtype=np.int64) if lines.line_index is None else lines.line_index
    lines.line_index = base[keep_rows]
    return keep_rows


def _bad_value(cb: _Buffer, starts: np.ndarray, ends: np.ndarray, col: int, row: int, source: str,
               line: int, detail: str | None = None) -> BadLine:
    """The `BadLine` of the value in column ``col`` of ``row`` (cut to 40 characters); `detail`
    replaces the column's usual message."""
    reason, usual = _bad_detail(col)
    value = field_text(cb.buf[starts[col, row] : ends[col, row]].tobytes())  # (undecodable bytes shown as \xNN)
    if detail is None and reason == "bad_category" and "," in value:  # a multi-hot field read as one value
        usual += " (',' separates a multi-hot field's values: this column's --multi-hot-sizes size is 1, or none given)"
    if detail is None and reason == "bad_label" and value.strip().lower() == "label":  # `cat a.csv b.csv > all.csv`
        usual += ": a header line after the file's first line (files joined with cat? give each one as its own --input)"
    detail = detail or usual
    if len(value) > 40:
        value = value[:40] + "..."
    return BadLine(source, line, reason, RAW_COLUMNS[col], value, detail)


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

