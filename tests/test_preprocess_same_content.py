"""Two inputs of the same data under different names (`dlrm.data.preprocess.same_content`): a byte-identical copy
(`cp day_0 day_0_copy`) was accepted, its rows read twice and split into train and test alike (leakage that inflates
the AUC), as was a day file given both plain and gzip'ed. Inputs that only look alike (the same size, the same first
bytes, the same decompressed size and line count) are still accepted."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import pytest

from dlrm.data import preprocess as pp
from dlrm.data.preprocess.same_content import _equal
from dlrm.data.schema import read_metadata
from tests.test_preprocess_cli_errors import assert_one_line_error, raw_lines, run_cli


def _lines(n: int, seed: int = 0) -> list[str]:
    return raw_lines(n, seed).splitlines(keepends=True)


@pytest.fixture
def day(tmp_path: Path) -> Path:
    path = tmp_path / "day_0"
    path.write_text("".join(_lines(400)))  # ~120 KB: beyond the 64 KiB head that tells same-size files apart
    return path


def test_a_byte_identical_copy_is_refused_in_one_line(tmp_path, day):
    copy = tmp_path / "day_0_copy"
    shutil.copyfile(day, copy)
    out = tmp_path / "ds"
    assert_one_line_error(run_cli("-i", day, copy, "-o", out, "--split", "random"),
                          f"{copy}: the same bytes as {day}", "read twice")
    assert not out.exists()


def test_a_copy_of_a_gzip_file_is_refused(tmp_path, day):
    gz = tmp_path / "day_0.gz"
    gz.write_bytes(gzip.compress(day.read_bytes(), mtime=0))
    copy = tmp_path / "copy.gz"
    shutil.copyfile(gz, copy)
    with pytest.raises(pp.PreprocessError, match="the same bytes as"):
        pp.preprocess([gz, copy], tmp_path / "ds", progress=False, workers=1)
    assert not (tmp_path / "ds").exists()


@pytest.mark.parametrize("workers", [1, 2])
def test_the_same_data_plain_and_gzipped_is_refused_after_the_count_pass(tmp_path, day, workers):
    gz = tmp_path / "day_0.gz"
    gz.write_bytes(gzip.compress(day.read_bytes(), mtime=0))
    out = tmp_path / "ds"
    assert_one_line_error(run_cli("-i", day, gz, "-o", out, "--workers", str(workers)),
                          f"{gz}: the same data as {day} once decompressed")
    assert not out.exists()


def test_the_same_data_gzipped_twice_with_other_headers_is_refused(tmp_path, day):
    """gzip records the file's name and time: two gzips of one file differ in their bytes, not in their data."""
    a, b = tmp_path / "a.gz", tmp_path / "b.gz"
    a.write_bytes(gzip.compress(day.read_bytes(), compresslevel=1, mtime=1))
    b.write_bytes(gzip.compress(day.read_bytes(), compresslevel=9, mtime=2))
    assert a.read_bytes() != b.read_bytes()
    with pytest.raises(pp.PreprocessError, match=f"{b}: the same data as {a} once both are decompressed"):
        pp.preprocess([a, b], tmp_path / "ds", progress=False, workers=1)


def test_inputs_that_only_look_alike_are_accepted(tmp_path):
    """Same size and first 64 KiB (the rows after it with their labels flipped), and a gzip with the same decompressed
    size and line count as the plain day (every row's last digit changed): each compared to its end, none refused.
    (Before 2026-12-04 these were the day's rows reordered, accepted then; the same rows in another order are now
    refused by `same_rows`, tests/test_preprocess_same_rows.py: so these share no more than their first 64 KiB.)"""
    lines = _lines(2000)  # ~600 KB: the first 64 KiB are a tenth of the lines, far from a copy's share
    day = tmp_path / "day_0"
    day.write_text("".join(lines))
    head = len(day.read_bytes()[:1 << 16].splitlines()) + 1
    flipped = tmp_path / "day_1"
    flipped.write_text("".join(lines[:head] + [str(1 - int(x[0])) + x[1:] for x in lines[head:]]))
    assert flipped.stat().st_size == day.stat().st_size and flipped.read_bytes()[:1 << 16] == day.read_bytes()[:1 << 16]
    gz = tmp_path / "day_2.gz"
    gz.write_bytes(gzip.compress("".join(x[:-2] + ("0" if x[-2] != "0" else "1") + "\n" for x in lines).encode()))
    meta = pp.preprocess([day, flipped, gz], tmp_path / "ds", progress=False, workers=1)
    assert sum(s.rows for s in meta.splits.values()) == 3 * 2000


def test_empty_files_are_not_called_copies(tmp_path, day):
    """Two empty files hold the same (no) bytes, but no rows: skipped as empty, not refused as copies."""
    e1, e2 = tmp_path / "e1.tsv", tmp_path / "e2.tsv"
    e1.write_bytes(b"")
    e2.write_bytes(b"")
    meta = pp.preprocess([day, e1, e2], tmp_path / "ds", progress=False, workers=1, on_bad_line="skip")
    assert sum(s.rows for s in meta.splits.values()) == 400
    assert read_metadata(tmp_path / "ds").extra["bad_lines"]["empty_file"] == 2


@pytest.mark.parametrize("a,b,equal", [
    ([b"abc", b"def"], [b"a", b"bcde", b"f"], True),
    ([b"abcdef"], [b"abc", b"deg"], False),
    ([b"abc"], [b"abc", b"d"], False),
    ([b"ab", b"", b"cd"], [b"abcd"], True),
    ([], [], True),
])
def test_equal_compares_streams_whatever_their_blocks(a, b, equal):
    assert _equal(a, b) is equal and _equal(b, a) is equal
