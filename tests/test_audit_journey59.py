"""A new user's journey with real Criteo files (session 59's audit): what the preprocessor does with the files a
Criteo download leaves (archives, other codecs, Kaggle's unlabelled test.txt, a copy cut off in its last line, a
byte-order mark)."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import tarfile
import zipfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from dlrm.data import preprocess as pp
from dlrm.data.schema import read_metadata

SHARED = Path(__file__).resolve().parents[2] / "shared" / "criteo"
FAST = dict(progress=False, workers=1)


def _rows(n: int) -> list[list[str]]:
    """``n`` raw Kaggle lines as fields: label, 13 counts, 26 8-digit hex categories (C26 missing on odd lines)."""
    rows = []
    for i in range(n):
        cats = [f"{(i * 7 + f) % 5 + 16 * f + 0x1000000:08x}" for f in range(26)]
        if i % 2:
            cats[-1] = ""
        rows.append([str(i % 2)] + [str(i % 9)] * 13 + cats)
    return rows


def _tsv(rows: list[list[str]]) -> bytes:
    return "".join("\t".join(r) + "\n" for r in rows).encode()


def _run(args: list[str]):
    return CliRunner().invoke(pp.build_cli(), [*args, "--no-progress", "--workers", "1"])


def _error(result) -> str:
    lines = [x for x in result.stderr.strip().splitlines() if x.startswith("error:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def _tar(data: bytes, name: str = "train.txt") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _zip(data: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("train.txt", data)
    return buf.getvalue()


_ARCHIVES = {
    # Kaggle's download, dac.tar.gz, as it comes: its gzip stream is a tar of train.txt, test.txt and readme.txt
    "dac.tar.gz": (lambda d: gzip.compress(_tar(d), mtime=0), "gzip-compressed tar archive", "tar xzf"),
    "day_0.tar": (_tar, "tar archive", "tar xf"),
    "train.zip": (_zip, "zip archive", "unzip"),
    "day_0.bz2": (bz2.compress, "bzip2", "bunzip2"),
    "day_0.xz": (lzma.compress, "xz", "unxz"),
    "day_0.zst": (lambda d: b"\x28\xb5\x2f\xfd" + d, "zstd", "unzstd"),
}


@pytest.mark.parametrize("name", sorted(_ARCHIVES))
def test_an_archive_or_another_codec_is_named_in_one_line(tmp_path, name):
    """Kaggle's dac.tar.gz given as it was downloaded failed with "dac.tar.gz:1: column label: 'train.txt\\x00\\x00...'
    is not a label"; a bzip2, xz or zstd file, or a zip, with "expected 40 fields ... found 4" or "cannot detect the
    format ...; use --format", which no --format mends. Now the input check names what the file is and what to do."""
    make, kind, tool = _ARCHIVES[name]
    src = tmp_path / name
    src.write_bytes(make(_tsv(_rows(20))))
    out = tmp_path / "out"
    result = _run(["--input", str(src), "--output", str(out)])
    assert result.exit_code == 2, result.output
    msg = _error(result)
    assert msg.startswith(f"error: {src}: ") and kind in msg and tool in msg, msg
    assert "plain or gzip" in msg, msg
    assert not out.exists()


def test_a_plain_and_a_gzip_text_file_are_still_read(tmp_path):
    """The archive check looks at the bytes, not the name: a gzip of text is read whatever it is called."""
    data = _tsv(_rows(30))
    (tmp_path / "a.tar.gz").write_bytes(gzip.compress(data, mtime=0))  # a misleading name, a plain gzip inside
    (tmp_path / "b.txt").write_bytes(data)
    for name in ("a.tar.gz", "b.txt"):
        meta = pp.preprocess([tmp_path / name], tmp_path / f"out-{name}", **FAST)
        assert sum(s.rows for s in meta.splits.values()) == 30


def test_kaggles_unlabelled_test_txt_is_named_as_such(tmp_path):
    """Kaggle's test.txt has no label column (39 fields): the error said only "expected 40 fields, found 39"."""
    src = tmp_path / "test.txt"
    src.write_bytes(_tsv([r[1:] for r in _rows(10)]))
    result = _run(["--input", str(src), "--output", str(tmp_path / "out")])
    assert result.exit_code == 2
    msg = _error(result)
    assert msg.startswith(f"error: {src}:1: expected 40 fields") and "found 39" in msg, msg
    assert "no label column" in msg and "test.txt" in msg, msg


def _cut(tmp_path: Path, keep_last: int) -> tuple[Path, list[list[str]]]:
    """A file of 40 lines whose last line (C26 present) lost all but ``keep_last`` characters of its last value and its
    newline: a copy cut off in its last value."""
    rows = _rows(40)
    assert rows[-2][-1] and not rows[-1][-1]
    rows = rows[:-1]  # 39 lines, the last with C26
    data = _tsv(rows)
    src = tmp_path / "day_5"
    src.write_bytes(data[: len(data) - 1 - (8 - keep_last)])
    return src, rows


@pytest.mark.parametrize("keep_last", [1, 7])
def test_a_file_cut_off_inside_its_last_value_stops(tmp_path, keep_last):
    """A day file whose copy stopped in the middle of its last hex value: that line has its 40 fields and a hex of 1 to
    7 digits, which the parser takes (the grammar allows short hashes), so the run stored a category that is not in the
    log, without a word. Criteo's hashes have 8 digits; a file that ends there without its newline was cut."""
    src, rows = _cut(tmp_path, keep_last)
    out = tmp_path / "out"
    result = _run(["--input", str(src), "--output", str(out)])
    assert result.exit_code == 2, result.output
    msg = _error(result)
    assert msg.startswith(f"error: {src}:39: column C26: {rows[-1][-1][:keep_last]!r}"), msg
    assert "without a newline" in msg and "cut off" in msg, msg
    assert not out.exists()


def test_a_cut_last_line_is_dropped_and_counted_with_skip(tmp_path):
    src, rows = _cut(tmp_path, 5)
    out = tmp_path / "out"
    meta = pp.preprocess([src], out, on_bad_line="skip", **FAST)
    assert {k: v for k, v in meta.extra["bad_lines"].items() if v} == {"bad_category": 1}
    assert sum(s.rows for s in meta.splits.values()) == 38
    # the other lines keep their splits: the sequential split of 39 lines ([0, 34) train, [34, 37) test, [37, 39)
    # validation), the cut one (line 39) left out of validation
    kept = {name: pq.read_table([out / f for f in s.files]).num_rows for name, s in meta.splits.items()}
    assert kept == {"train": 34, "test": 3, "validation": 1}


def test_a_complete_last_line_without_newline_is_still_read(tmp_path):
    """A file whose last line is whole (8-digit or missing C26) but lacks its newline is taken as before."""
    rows = _rows(40)
    for n in (39, 40):  # the last line's C26: present (8 digits), missing
        src = tmp_path / f"f{n}.tsv"
        src.write_bytes(_tsv(rows[:n])[:-1])
        meta = pp.preprocess([src], tmp_path / f"out{n}", **FAST)
        assert sum(s.rows for s in meta.splits.values()) == n
        assert not any(meta.extra["bad_lines"].values())


def test_a_line_cut_before_its_last_field_says_the_file_ends_there(tmp_path):
    rows = _rows(20)
    data = _tsv(rows)
    src = tmp_path / "day_3"
    src.write_bytes(data[: data.rfind(b"\t", 0, len(data) - 20)])  # the last line: a few fields short, no newline
    result = _run(["--input", str(src), "--output", str(tmp_path / "out")])
    assert result.exit_code == 2
    msg = _error(result)
    assert msg.startswith(f"error: {src}:20: expected 40 fields") and "without a newline" in msg, msg


@pytest.mark.parametrize("fmt", ["tsv", "csv"])
def test_a_byte_order_mark_is_skipped(tmp_path, fmt):
    """A file saved with a UTF-8 byte-order mark (Excel's and Windows tools' "UTF-8"; pandas' utf-8-sig) failed on its
    first field: "column label: '\\ufeff0' is not a label" (TSV) or "'\\ufefflabel'" (the CSV header)."""
    if not SHARED.is_dir():
        pytest.skip("../shared/criteo is absent")
    name = "part-0.tsv" if fmt == "tsv" else "criteo_sample.txt"
    src = tmp_path / name
    src.write_bytes(b"\xef\xbb\xbf" + (SHARED / name).read_bytes())
    pp.preprocess([src], tmp_path / "bom", **FAST)
    pp.preprocess([SHARED / name], tmp_path / "plain", **FAST)
    a, b = read_metadata(tmp_path / "bom"), read_metadata(tmp_path / "plain")
    assert a.cardinalities == b.cardinalities
    for split in ("train", "validation", "test"):
        ta = pq.read_table([tmp_path / "bom" / f for f in a.splits[split].files])
        tb = pq.read_table([tmp_path / "plain" / f for f in b.splits[split].files])
        assert ta.equals(tb), split


def test_a_byte_order_mark_in_gzip_and_in_the_parallel_count(tmp_path, monkeypatch):
    """The mark is skipped in a gzip file too, and the parallel count pass of big plain files finds the same chunks."""
    from concurrent.futures import ThreadPoolExecutor

    data = _tsv(_rows(50))
    (tmp_path / "a.gz").write_bytes(gzip.compress(b"\xef\xbb\xbf" + data, mtime=0))
    (tmp_path / "b.tsv").write_bytes(data)
    a = pp.preprocess([tmp_path / "a.gz"], tmp_path / "out-a", **FAST)
    b = pp.preprocess([tmp_path / "b.tsv"], tmp_path / "out-b", **FAST)
    for split in ("train", "validation", "test"):
        ta = pq.read_table([tmp_path / "out-a" / f for f in a.splits[split].files])
        tb = pq.read_table([tmp_path / "out-b" / f for f in b.splits[split].files])
        assert ta.equals(tb), split
    (tmp_path / "c.tsv").write_bytes(b"\xef\xbb\xbf" + data)
    monkeypatch.setattr(pp.scan, "_SCAN_RANGE_BYTES", 997)
    with ThreadPoolExecutor(2) as ex:
        for rows in (7, 50):
            seq = pp.scan_file(tmp_path / "c.tsv", "auto", rows)
            assert seq == pp.scan_file_parallel(tmp_path / "c.tsv", "auto", rows, ex, 4)
            assert seq.offsets[0] == 3 and seq.lines == 50


def test_the_mlperf_import_of_one_hot_files_names_the_missing_step(tmp_path):
    """A user with TorchRec's first-step files (day_N_sparse.npy, one-hot) was told only that day_0_sparse_multi_hot.npz
    is missing; those files now import as one-hot features (tests/test_audit_datarest.py checks every value), and a day
    with neither sparse file is refused naming both."""
    import subprocess
    import sys

    import numpy as np

    from tests.conftest import CHILD_ENV, REPO as root
    src = tmp_path / "in"
    src.mkdir()
    for d in (0, 1):
        np.save(src / f"day_{d}_labels.npy", np.zeros((4, 1), np.int32))
        np.save(src / f"day_{d}_dense.npy", np.zeros((4, 13), np.float32))
    np.save(src / "day_1_sparse.npy", np.zeros((4, 26), np.int32))

    def run_import():
        return subprocess.run([sys.executable, "-m", "dlrm.data.mlperf_import", "--input", str(src), "--output",
                               str(tmp_path / "out"), "--train-days", "0", "--eval-day", "1", "--workers", "1"],
                              cwd=root, env={**CHILD_ENV, "NO_COLOR": "1"}, capture_output=True, text=True, timeout=120)

    done = run_import()
    assert done.returncode == 2, done.stderr
    lines = [x for x in done.stderr.splitlines() if "ERROR" in x or x.startswith("error")]
    assert len(lines) == 1, done.stderr
    assert "day_0_sparse_multi_hot.npz: missing" in lines[0], lines[0]
    assert "or TorchRec's one-hot day_0_sparse.npy" in lines[0], lines[0]
    assert not (tmp_path / "out").exists()
    np.save(src / "day_0_sparse.npy", np.zeros((4, 26), np.int32))
    done = run_import()
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "metadata.json").is_file()


_HEADER = ",".join(["label", *[f"I{i}" for i in range(1, 14)], *[f"C{i}" for i in range(1, 27)]])


@pytest.mark.parametrize("variant", ["index", "case"])
def test_a_csv_header_that_does_not_match_is_named_as_the_header(tmp_path, variant):
    """pandas' ``df.to_csv(path)`` writes its index first (",label,I1,..." then "0,1,5,..."): the header was not
    recognised, and the error was line 1's field count, "found 41"; a "Label" header was parsed as a data line,
    "column label: 'Label' is not a label". Both are now named as the header, with what to do for the index."""
    body = [",".join([r[0], *r[1:]]) for r in _rows(10)]
    if variant == "index":
        text = "," + _HEADER + "\n" + "".join(f"{i},{line}\n" for i, line in enumerate(body))
    else:
        text = "L" + _HEADER[1:] + "\n" + "".join(line + "\n" for line in body)
    src = tmp_path / "x.csv"
    src.write_text(text)
    result = _run(["--input", str(src), "--output", str(tmp_path / "out")])
    assert result.exit_code == 2
    msg = _error(result)
    if variant == "index":
        assert msg == f"error: {src}:1: the header has 41 fields, expected 40 (an index column before label? write " \
                      "the file with pandas' index=False)", msg
    else:
        assert msg.startswith(f"error: {src}:1: header column 1: expected 'label', found 'Label'"), msg


def test_skip_mode_says_where_the_first_skipped_line_is(tmp_path):
    """``--on-bad-line skip`` reported only counts per reason ("bad lines skipped: bad_integer 1"): in a 45M-line log,
    which file and line was it? The first one is now in the log line and in metadata.json's extra."""
    rows = _rows(60)
    rows[41][3] = "x7"
    a, b = tmp_path / "a.tsv", tmp_path / "b.tsv"
    a.write_bytes(_tsv(_rows(80)[60:]))  # (not b's first rows: a part of another input is refused, `same_rows`)
    b.write_bytes(_tsv(rows))
    meta = pp.preprocess([a, b], tmp_path / "out", on_bad_line="skip", chunk_rows=16, **FAST)
    assert {k: v for k, v in meta.extra["bad_lines"].items() if v} == {"bad_integer": 1}
    assert meta.extra["first_bad_line"] == f"{b}:42: column I3: 'x7' is not an integer"
    assert read_metadata(tmp_path / "out").extra["first_bad_line"] == meta.extra["first_bad_line"]
    clean = pp.preprocess([a], tmp_path / "clean", on_bad_line="skip", **FAST)
    assert clean.extra["first_bad_line"] is None


def test_split_days_refuses_a_day_given_twice(tmp_path):
    """``--input day_* --split days`` in a folder where some days were gunzipped with -k (day_2 and day_2.gz): every
    file was read, so days 0 and 1 trained twice and the last day's plain copy trained too, while its .gz was
    split into test and validation: the evaluation rows were in train, without a word."""
    rows = _rows(30)
    for d in range(3):
        data = _tsv(rows[10 * d: 10 * d + 10])
        (tmp_path / f"day_{d}").write_bytes(data)
        (tmp_path / f"day_{d}.gz").write_bytes(gzip.compress(data, mtime=0))
    inputs = sorted(str(p) for p in tmp_path.glob("day_*"))  # the shell's order of day_*
    out = tmp_path / "out"
    result = _run(["--split", "days", "--output", str(out), *inputs])
    assert result.exit_code == 2, result.output
    msg = _error(result)
    assert msg == (f"error: --split days: {tmp_path / 'day_0'} and {tmp_path / 'day_0.gz'} are both day 0: give each "
                   "day once (its rows would be read twice; the last day's would train as well)"), msg
    assert not out.exists()
    meta = pp.preprocess([tmp_path / f"day_{d}.gz" for d in range(3)], out, split="days", **FAST)
    assert meta.splits["train"].rows == 20 and meta.splits["validation"].rows + meta.splits["test"].rows == 10


def test_the_first_skipped_line_survives_a_resume(tmp_path):
    """A run stopped after the chunk holding the first bad line, then resumed, names the same line as an uninterrupted
    run: it is kept in that chunk's done.jsonl record, not in the memory of the session that parsed it."""
    rows = _rows(80)
    rows[5][0] = "7"
    rows[50][20] = "zz"
    src = tmp_path / "a.tsv"
    src.write_bytes(_tsv(rows))
    kw = dict(on_bad_line="skip", chunk_rows=20, **FAST)
    ref = pp.preprocess([src], tmp_path / "ref", **kw)
    assert ref.extra["first_bad_line"] == f"{src}:6: column label: '7' is not a label (0 or 1)"
    with pytest.raises(pp._Interrupted):
        pp.preprocess([src], tmp_path / "ds", _max_new_chunks=1, **kw)
    assert pp.preprocess([src], tmp_path / "ds", **kw).extra == ref.extra
