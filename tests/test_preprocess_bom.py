"""A UTF-8 byte-order mark at the start of a preprocessor input (accepted and skipped, README "Data") with little or
nothing after it: the file is judged as the same file without the mark. A mark alone is an empty file; it was one
line without a newline, named a cut-off record."""

from __future__ import annotations

import gzip
from concurrent.futures import ThreadPoolExecutor

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from dlrm.data import preprocess as pp
from dlrm.data.preprocess.scan import scan_file, scan_file_parallel

BOM = b"\xef\xbb\xbf"
FAST = dict(progress=False, workers=1)


def _line(k: int) -> bytes:
    return "\t".join([str(k % 2), str(k), *["1"] * 12, f"{k * 2654435761 % (1 << 32):08x}",
                      *["00000001"] * 25]).encode()


def _error(tmp_path, src) -> str:
    result = CliRunner().invoke(pp.build_cli(), ["--input", str(src), "--output", str(tmp_path / "out"),
                                                 "--no-progress", "--workers", "1"])
    assert result.exit_code == 2, result.output
    lines = [x for x in result.stderr.strip().splitlines() if x.startswith("error:")]
    assert len(lines) == 1, result.stderr
    assert not (tmp_path / "out").exists()  # nothing written
    return lines[0]


@pytest.mark.parametrize("name", ["a.tsv", "a.tsv.gz"])
def test_a_file_of_the_mark_alone_is_an_empty_file(tmp_path, name):
    """Was: "a.tsv:1: expected 40 fields separated by '\\t', found 1; the file ends in this line, without a newline
    (cut off? a truncated download or copy)"."""
    src = tmp_path / name
    src.write_bytes(gzip.compress(BOM, mtime=0) if name.endswith(".gz") else BOM)
    assert _error(tmp_path, src) == f"error: {src}: empty file (no data lines: only a UTF-8 byte-order mark)"
    scan = scan_file(src)
    assert (scan.lines, scan.num_chunks, scan.error) == (0, 0, "empty_file")


def test_the_mark_alone_skipped_counts_as_an_empty_file_not_a_bad_record(tmp_path):
    """--on-bad-line skip: the file is one "empty_file", as a file of no bytes is (was "wrong_field_count 1")."""
    (tmp_path / "a.tsv").write_bytes(BOM)
    (tmp_path / "b.tsv").write_bytes(b"".join(_line(k) + b"\n" for k in range(30)))
    meta = pp.preprocess([tmp_path / "a.tsv", tmp_path / "b.tsv"], tmp_path / "ds", on_bad_line="skip", **FAST)
    assert sum(s.rows for s in meta.splits.values()) == 30
    assert {k: v for k, v in meta.extra["bad_lines"].items() if v} == {"empty_file": 1}


@pytest.mark.parametrize("rest", [b"\n", b"\r\n", b"\n\n", b"\r"])
def test_the_mark_before_empty_lines_reads_as_the_file_without_it(tmp_path, rest):
    """The mark then empty lines: the same error, at the same line, as the file without the mark."""
    (tmp_path / "bom").mkdir()
    (tmp_path / "plain").mkdir()
    with_mark, without = tmp_path / "bom" / "a.tsv", tmp_path / "plain" / "a.tsv"
    with_mark.write_bytes(BOM + rest)
    without.write_bytes(rest)
    said = _error(tmp_path / "bom", with_mark)
    assert said.startswith(f"error: {with_mark}:1: ") and "found an empty line" in said
    assert said.replace(str(with_mark), "X") == _error(tmp_path / "plain", without).replace(str(without), "X")


@pytest.mark.parametrize("newline", [b"", b"\n"])
def test_the_mark_before_one_record_is_skipped(tmp_path, newline):
    """One record after the mark, with or without its newline: the same row as the file without the mark."""
    (tmp_path / "a.tsv").write_bytes(BOM + _line(7) + newline)
    (tmp_path / "b.tsv").write_bytes(_line(7) + newline)
    a = pp.preprocess([tmp_path / "a.tsv"], tmp_path / "out-a", split="random", **FAST)
    b = pp.preprocess([tmp_path / "b.tsv"], tmp_path / "out-b", split="random", **FAST)
    rows = {}
    for name, meta in (("out-a", a), ("out-b", b)):
        files = [tmp_path / name / f for s in meta.splits.values() for f in s.files]
        rows[name] = pq.read_table(files).to_pylist()
    assert len(rows["out-a"]) == 1 and rows["out-a"] == rows["out-b"]


def test_the_parallel_count_of_the_mark_alone_is_the_same(tmp_path, monkeypatch):
    (tmp_path / "a.tsv").write_bytes(BOM)
    monkeypatch.setattr(pp.scan, "_SCAN_RANGE_BYTES", 1)
    with ThreadPoolExecutor(2) as ex:
        parallel = scan_file_parallel(tmp_path / "a.tsv", "auto", 7, ex, 4)
    assert parallel == scan_file(tmp_path / "a.tsv", "auto", 7) and parallel.error == "empty_file"
