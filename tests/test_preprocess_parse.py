"""Tests of `dlrm.data.preprocess`'s parser (`pp.parse_chunk`, the counting pass): values against a plain-Python
parse of each raw line, and corrupted lines (Hypothesis) rejected with their line number or skipped, never written.

Moved from tests/test_preprocess.py (2026-12-02: that file was over 600 lines); its helpers stay there.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dlrm.data import preprocess as pp
from dlrm.data.schema import ALL_COLUMNS
from tests.test_preprocess import FAST, HEADER, INT32_MAX, make_fields, ref_row, split_rows, write_raw


# The field strategies, built once: built inside `_raw_field_rows` for each of a row's 40 fields, Hypothesis validated
# every new strategy object as it drew from it, ~80% of the malformed-lines test's time (12 of 15 s). The same
# strategies draw the same values.
_LABEL_FIELD = st.sampled_from(["0", "1", "1.0", "0.00"])
_DENSE_FIELD = st.one_of(
    st.just(""),
    st.integers(-(10**12), 10**12).map(str),
    st.integers(0, 10**9).map(lambda v: f"{v}.0"),
    st.integers(0, 999).map(lambda v: f"{v}.000"),
)
_SPARSE_FIELD = st.one_of(
    st.just(""),
    st.integers(0, 2**32 - 1).map(lambda v: f"{v:08x}"),
    st.integers(0, 2**32 - 1).map(lambda v: f"{v:X}"),
)


@st.composite
def _raw_field_rows(draw):
    n = draw(st.integers(1, 6))
    rows = []
    for _ in range(n):
        r = [draw(_LABEL_FIELD)]
        r.extend(draw(_DENSE_FIELD) for _ in range(13))
        r.extend(draw(_SPARSE_FIELD) for _ in range(26))
        rows.append(r)
    return rows


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=_raw_field_rows(), sep=st.sampled_from(["\t", ","]), crlf=st.booleans(), final_nl=st.booleans())
def test_parse_chunk_matches_plain_python(rows, sep, crlf, final_nl):
    eol = "\r\n" if crlf else "\n"
    text = eol.join(sep.join(r) for r in rows) + (eol if final_nl else "")
    parsed = pp.parse_chunk(text.encode(), "tsv" if sep == "\t" else "csv")
    got = parsed_rows(parsed)
    assert got == [ref_row(sep.join(r), sep) for r in rows]
    big = sum(1 for r in rows for x in r[1:14] if x and int(float(x)) > INT32_MAX)
    assert parsed.clipped == big


def parsed_rows(parsed) -> list[tuple]:
    """A parsed chunk's rows as tuples of ALL_COLUMNS' values (its table built once, not once a column: that was
    ~15% of the malformed-lines test's time)."""
    table = parsed.to_table()
    return list(zip(*(table.column(c).to_pylist() for c in ALL_COLUMNS)))


def ref_valid(line: str, sep: str) -> bool:
    """Plain-Python grammar of a good raw line (the spec of `pp.parse_chunk`, written again)."""
    digits = set("0123456789")
    hexdigits = set("0123456789abcdefABCDEF")

    def count(x: str) -> int | None:  # [+-]digits[.zeros]
        body = x[1:] if x[:1] in ("+", "-") else x
        whole, dot, frac = body.partition(".")
        if not whole or not set(whole) <= digits or not set(frac) <= set("0"):
            return None
        return int(x.partition(".")[0])

    f = line.split(sep)
    if len(f) != 40 or count(f[0]) not in (0, 1):
        return False
    if any(x and count(x) is None for x in f[1:14]):
        return False
    return all(not x or (len(x) <= 8 and set(x) <= hexdigits) for x in f[14:])


# Characters a corrupted field may contain: digits, hex letters, signs, dots, the other
# delimiter, spaces, a lone CR, non-ASCII digits (which Python's int() would accept) and text.
_JUNK = st.text(alphabet="0123456789abcdefABCDEFxyz+-. ,\t\r\u0663\u00e9", max_size=12)
# built once, like the field strategies above
_CORRUPTION = st.sampled_from(["good", "field", "field", "drop", "add", "junk"])
_FIELD_INDEX, _INSERT_INDEX = st.integers(0, 39), st.integers(0, 40)


@st.composite
def _corrupted_lines(draw):
    """Good raw rows, some of them corrupted: a field replaced, a field dropped or added, or the
    whole line replaced by junk; returns (lines, sep)."""
    sep = draw(st.sampled_from(["\t", ","]))
    lines = []
    for r in draw(_raw_field_rows()):
        kind = draw(_CORRUPTION)
        if kind == "field":
            r[draw(_FIELD_INDEX)] = draw(_JUNK)
        elif kind == "drop":
            del r[draw(_FIELD_INDEX)]
        elif kind == "add":
            r.insert(draw(_INSERT_INDEX), draw(_JUNK))
        lines.append(draw(_JUNK) if kind == "junk" else sep.join(r))
    return lines, sep


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_corrupted_lines(), crlf=st.booleans(), final_nl=st.booleans(), first_line=st.integers(1, 10**6))
@example(case=(["\t".join(["1"] + ["2"] * 13 + ["abc"] * 26) + "\r"], "\t"), crlf=False, final_nl=False, first_line=1)
def test_malformed_lines_rejected_or_skipped_never_written(case, crlf, final_nl, first_line):
    lines, sep = case
    eol = "\r\n" if crlf else "\n"
    text = eol.join(lines) + (eol if final_nl else "")
    # the lines the parser sees: split at LF, one CR before each LF (and at the end) dropped
    seen = text.split("\n")
    if seen[-1] == "":
        seen.pop()
    seen = [x.removesuffix("\r") for x in seen]
    valid = [ref_valid(x, sep) for x in seen]
    fmt = "tsv" if sep == "\t" else "csv"
    expected = [ref_row(x, sep) for x, ok in zip(seen, valid) if ok]

    skipped = pp.parse_chunk(text.encode(), fmt, on_bad_line="skip", source="f.tsv", first_line=first_line)
    got = parsed_rows(skipped)
    assert got == expected  # every good line, in order, with its values; no bad line written
    assert sum(skipped.bad.values()) == valid.count(False)
    assert set(skipped.bad) <= set(pp.BAD_LINE_REASONS)

    if all(valid):
        got = pp.parse_chunk(text.encode(), fmt, on_bad_line="stop").to_table()
        assert got.num_rows == len(expected)
        return
    with pytest.raises(pp.BadLineError) as err:
        pp.parse_chunk(text.encode(), fmt, on_bad_line="stop", source="f.tsv", first_line=first_line)
    line = first_line + valid.index(False)
    assert err.value.bad.line == line
    message = str(err.value)
    assert message.startswith(f"f.tsv:{line}: ") and "\n" not in message


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=_corrupted_lines())
@example(case=([""], ","))  # a header and one blank line (found by Hypothesis: the reference called it bad line 2)
@example(case=(["\t".join(["1"] + ["2"] * 13 + ["abc"] * 26), "", "\r"], "\t"))  # a good line, then blank ones
def test_malformed_lines_through_preprocess(tmp_path_factory, case):
    """The same property through the whole tool: a file, its chunks and the written parquet. Blank lines at the end of
    a file are no lines (the tool ignores them: a file often ends with one newline more); a file of nothing else is
    an empty file (skipped as one bad file, or the error that stops)."""
    lines, sep = case
    tmp = tmp_path_factory.mktemp("bad")
    src = tmp / ("day_0" if sep == "\t" else "train.csv")
    src.write_text((HEADER + "\n" if sep == "," else "") + "\n".join(lines) + "\n", newline="")
    fmt = "tsv" if sep == "\t" else "csv"
    opts = dict(input_format=fmt, split="random", validation_fraction=0.0, test_fraction=0.0, chunk_rows=2, **FAST)
    lines = [x.removesuffix("\r") for x in lines]
    while lines and not lines[-1]:
        lines.pop()
    if not lines:  # skipped as an empty file, or stopped at it
        with pytest.raises(pp.PreprocessError, match=r"^no rows to write: .* \(1 bad line\(s\) or file\(s\) skipped\)$"):
            pp.preprocess([src], tmp / "skip", on_bad_line="skip", **opts)
        empty = r"empty file \(no data lines\)" if sep == "\t" else "no data lines: the file holds only its header line"
        with pytest.raises(pp.BadLineError, match=f": {empty}$"):
            pp.preprocess([src], tmp / "stop", **opts)
        assert not (tmp / "skip" / "metadata.json").exists() and not (tmp / "stop" / "metadata.json").exists()
        return
    valid = [ref_valid(x, sep) for x in lines]
    expected = [ref_row(x, sep) for x, ok in zip(lines, valid) if ok]
    if not any(valid):
        with pytest.raises(pp.PreprocessError):
            pp.preprocess([src], tmp / "skip", on_bad_line="skip", **opts)
    else:
        meta = pp.preprocess([src], tmp / "skip", on_bad_line="skip", **opts)
        assert split_rows(tmp / "skip", "train") == expected
        assert sum(meta.extra["bad_lines"].values()) == valid.count(False)
    if all(valid):
        return
    with pytest.raises(pp.BadLineError) as err:
        pp.preprocess([src], tmp / "stop", **opts)
    header = 1 if sep == "," else 0
    assert str(err.value).startswith(f"{src}:{header + 1 + valid.index(False)}: ")
    assert not (tmp / "stop" / "metadata.json").exists()


@pytest.mark.parametrize("chunk_rows", [1, 7, 64, 299, 300, 5000])
def test_parallel_count_pass_equals_sequential(tmp_path, monkeypatch, chunk_rows):
    """Counting a plain file in byte ranges (big inputs) finds the same lines and chunk starts."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(pp.scan, "_SCAN_RANGE_BYTES", 997)  # many ranges, boundaries anywhere in a line
    rows = make_fields(300, seed=17)
    files = [
        write_raw(tmp_path / "a.tsv", rows),
        write_raw(tmp_path / "b.csv", rows, "csv"),
        tmp_path / "c.tsv",  # no final newline
    ]
    files[2].write_bytes(files[0].read_bytes()[:-1])
    with ThreadPoolExecutor(3) as ex:
        for f in files:
            seq = pp.scan_file(f, "auto", chunk_rows)
            par = pp.scan_file_parallel(f, "auto", chunk_rows, ex, 4)
            assert par == seq, f
            assert seq.lines == 300 and seq.num_chunks == -(-300 // chunk_rows)


def test_parse_chunk_large_block_boundaries():
    rows = make_fields(3000, seed=5)
    data = "".join("\t".join(r) + "\n" for r in rows).encode()
    old = pp.parse._BLOCK_BYTES
    try:
        pp.parse._BLOCK_BYTES = 4096  # many internal blocks
        bad = rows[1234][:]
        bad[5] = "x1"
        data_bad = "".join("\t".join(r) + "\n" for r in [*rows[:1234], bad, *rows[1235:]]).encode()
        parsed = pp.parse_chunk(data)
        with pytest.raises(pp.BadLineError, match=r"^f:1235: column I5: 'x1' is not an integer$"):
            pp.parse_chunk(data_bad, source="f")
        skipped = pp.parse_chunk(data_bad, on_bad_line="skip")
    finally:
        pp.parse._BLOCK_BYTES = old
    got = parsed_rows(parsed)
    assert got == [ref_row("\t".join(r), "\t") for r in rows]
    assert skipped.num_rows == 2999 and skipped.bad == {"bad_integer": 1}
    assert 1234 not in skipped.lines().tolist() and skipped.lines()[1234] == 1235
