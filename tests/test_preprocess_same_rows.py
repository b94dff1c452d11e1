"""Two inputs holding the same rows in other bytes (`dlrm.data.preprocess.same_content.same_rows`, from the count pass's
samples of their lines, `line_sample`): a copy with CRLF line ends or a byte-order mark, a reordered copy, a gzip of
one, or a part of another (``head day_0 > sample``) were accepted, their rows read twice and split into train and test
alike (the test AUC measured on rows the model trained on). Distinct inputs that share a few lines, as real logs do,
are still accepted, and a small input beside a large one is not judged on a sample of a few lines."""

from __future__ import annotations

import gzip
import random
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from dlrm.data import preprocess as pp
from dlrm.data.preprocess import line_sample, scan
from dlrm.data.preprocess.line_sample import LineSample, LineSampler, start_level
from dlrm.data.preprocess.scan import scan_file, scan_file_parallel
from dlrm.data.schema import read_metadata
from tests.test_preprocess import FAST, assert_same_dataset
from tests.test_preprocess_cli_errors import assert_one_line_error, raw_lines, run_cli


def _lines(n: int, seed: int = 0) -> list[bytes]:
    return raw_lines(n, seed).encode().splitlines(keepends=True)


def _write(path: Path, lines: list[bytes], *, gz: bool = False) -> Path:
    data = b"".join(lines)
    path.write_bytes(gzip.compress(data, mtime=0) if gz else data)
    return path


@pytest.fixture
def day(tmp_path: Path) -> Path:
    return _write(tmp_path / "day_0", _lines(400))


def _shuffled(lines: list[bytes], seed: int = 1) -> list[bytes]:
    out = list(lines)
    random.Random(seed).shuffle(out)
    return out


COPIES = {  # the same rows as `day` in other bytes (or a part of them)
    "crlf": lambda ls: ([x.replace(b"\n", b"\r\n") for x in ls], False),
    "bom": lambda ls: ([b"\xef\xbb\xbf" + ls[0], *ls[1:]], False),
    "shuffled": lambda ls: (_shuffled(ls), False),
    "head": lambda ls: (ls[:100], False),
    "head -n 10": lambda ls: (ls[:10], False),
    "gzip of a reordered copy": lambda ls: (_shuffled(ls, 2), True),
}


@pytest.mark.parametrize("kind", list(COPIES))
def test_the_same_rows_in_other_bytes_are_refused_in_one_line(tmp_path, day, kind):
    lines, gz = COPIES[kind](_lines(400))
    copy = _write(tmp_path / ("copy.gz" if gz else "copy"), lines, gz=gz)
    out = tmp_path / "ds"
    n = min(len(lines), 400)
    line = assert_one_line_error(run_cli("-i", day, copy, "-o", out, "--split", "random"),
                                 f"{copy}: 100% of its lines are also lines of {day} ({n:,} of {n:,} sampled lines",
                                 "read twice", "list every file once")
    assert "Traceback" not in line
    assert not out.exists()  # refused before anything was written


def test_the_copy_is_named_whichever_comes_first(tmp_path, day):
    """The input with fewer lines is the one named a copy (or part) of the other, in either order."""
    part = _write(tmp_path / "sample", _lines(400)[100:300])
    with pytest.raises(pp.PreprocessError, match=f"^{part}: 100% of its lines are also lines of {day} "):
        pp.preprocess([part, day], tmp_path / "ds", **FAST)


def test_distinct_inputs_sharing_a_few_lines_are_accepted(tmp_path, day):
    """Real logs repeat some lines (rows of mostly missing values): 6 shared of 400 is no copy."""
    shared = _lines(400)[:6]
    other = _write(tmp_path / "day_1", _lines(400, seed=1)[6:] + shared)
    meta = pp.preprocess([day, other], tmp_path / "ds", **FAST)
    assert sum(s.rows for s in meta.splits.values()) == 800


def test_a_handful_of_lines_all_found_elsewhere_is_not_called_a_copy(tmp_path, day):
    """A 5-line input whose lines all appear in another: under 8 shared lines, not refused (no AUC moves)."""
    tiny = _write(tmp_path / "tiny", _lines(400)[200:205])
    meta = pp.preprocess([day, tiny], tmp_path / "ds", **FAST)
    assert sum(s.rows for s in meta.splits.values()) == 405


def test_half_shared_is_refused_and_a_tenth_is_not(tmp_path, day):
    """The threshold: from half of the smaller input's lines found in the other."""
    mine = _lines(400)
    half = _write(tmp_path / "half", mine[:200] + _lines(200, seed=3))
    with pytest.raises(pp.PreprocessError, match="50% of its lines are also lines of"):
        pp.preprocess([day, half], tmp_path / "ds", **FAST)
    tenth = _write(tmp_path / "tenth", mine[:40] + _lines(360, seed=3))
    meta = pp.preprocess([day, tenth], tmp_path / "ds2", **FAST)
    assert sum(s.rows for s in meta.splits.values()) == 800


@pytest.mark.parametrize("big_plain", [False, True])
def test_worker_processes_find_it_too(tmp_path, day, monkeypatch, big_plain):
    """--workers 2: each file counted (and sampled) in a worker; or a "big" plain file counted in byte ranges by
    the workers, its lines cut at the ranges' ends."""
    if big_plain:
        monkeypatch.setattr(scan, "_PARALLEL_SCAN_MIN_BYTES", 1 << 10)
        monkeypatch.setattr(scan, "_SCAN_RANGE_BYTES", 4099)
    crlf = _write(tmp_path / "crlf", [x.replace(b"\n", b"\r\n") for x in _shuffled(_lines(400))])
    with pytest.raises(pp.PreprocessError, match=f"{crlf}: 100% of its lines are also lines of {day}"):
        pp.preprocess([day, crlf], tmp_path / "ds", progress=False, workers=2)
    assert not (tmp_path / "ds").exists()


def test_a_sample_counted_in_ranges_is_the_sample_of_the_whole_file(tmp_path, monkeypatch):
    """The byte ranges' samples merge into the one file's sample: every line sampled once, none cut at a range's end
    (CRLF, a byte-order mark and a CSV header too); and at a level above 0 (a small cap)."""
    monkeypatch.setattr(line_sample, "SAMPLE_CAP", 64)
    lines = [x.replace(b"\t", b",").replace(b"\n", b"\r\n") for x in _lines(700)]
    header = ",".join(pp.RAW_COLUMNS).encode() + b"\r\n"
    src = _write(tmp_path / "a.csv", [b"\xef\xbb\xbf" + header, *lines])
    serial = scan_file(src, "auto", 50).sample
    assert serial.level > 0 and 32 <= len(serial.keys) <= 64
    with ProcessPoolExecutor(2) as ex:  # (spawned workers read the default cap: the levels are merged)
        parallel = scan_file_parallel(src, "auto", 50, ex, 16).sample
    level = max(serial.level, parallel.level)
    assert np.array_equal(serial.sampled(level), parallel.sampled(level)) and len(serial.sampled(level)) >= 16
    whole = LineSampler()  # the lines themselves, header left out: the same digests
    for x in lines:
        whole.feed(x)
    assert np.array_equal(whole.close().sampled(level), serial.sampled(level))


def test_sampled_inputs_are_compared_at_the_coarser_level(tmp_path, monkeypatch):
    """With a small cap (as a Criteo day is sampled, 1/2**level of its lines): a shuffled copy is still refused,
    distinct inputs sharing 1% of their lines are not, and a small part of a large input, too few of whose lines
    the large one's sample holds, is not judged."""
    monkeypatch.setattr(line_sample, "SAMPLE_CAP", 128)
    big = _lines(3000)
    a = _write(tmp_path / "a", big)
    b = _write(tmp_path / "b", _shuffled(big))
    with pytest.raises(pp.PreprocessError, match=r"100% of its lines are also lines of .* sampled lines"):
        pp.preprocess([a, b], tmp_path / "ds", **FAST)
    c = _write(tmp_path / "c", _lines(2970, seed=5) + big[:30])
    part = _write(tmp_path / "part", big[:40])  # 40 lines; `a` is sampled at 1/32 or less: ~1 line in common
    meta = pp.preprocess([a, c, part], tmp_path / "ds2", **FAST)
    assert sum(s.rows for s in meta.splits.values()) == 6040


def test_a_stopped_run_resumes_without_the_samples(tmp_path):
    """The resumed run's count pass is the manifest's (no samples: its inputs were compared by the run it resumes,
    and are the same files); it finishes the dataset an uninterrupted run writes."""
    files = [_write(tmp_path / "a", _lines(300)), _write(tmp_path / "b.gz", _lines(300, seed=1), gz=True)]
    kw = dict(chunk_rows=100, **FAST)
    pp.preprocess(files, tmp_path / "ref", **kw)
    out = tmp_path / "ds"
    with pytest.raises(pp._Interrupted):
        pp.preprocess(files, out, _max_new_chunks=2, **kw)
    assert "sample" not in (out / pp.PROGRESS_DIR / "manifest.json").read_text()
    pp.preprocess(files, out, **kw)
    assert_same_dataset(out, tmp_path / "ref")
    assert read_metadata(out).splits["train"].rows > 0


def test_levels_nest_and_the_start_level_fits_the_cap():
    """A line sampled at a level is sampled at every lower one (so two samples compare at the coarser level); a file
    of `SAMPLE_CAP` lines of 256 bytes or fewer starts low enough to keep them all."""
    s = LineSample(cap=10_000)
    keys = np.random.default_rng(0).integers(0, 2**63, 5000, dtype=np.uint64) * np.uint64(2)
    s.add(keys, np.arange(5000, dtype=np.uint64))
    for level in range(1, 6):
        assert set(s.sampled(level + 1).tolist()) <= set(s.sampled(level).tolist())
    assert start_level(256 * line_sample.SAMPLE_CAP - 1) == 0 and start_level(256 * line_sample.SAMPLE_CAP) == 1


def test_more_distinct_lines_than_the_cap_with_one_key_of_zero_stop_at_the_last_level():
    """Lines whose key is 0 are sampled at every level: past the cap the level stops at 64 (it raised a negative
    shift count at 65)."""
    s = LineSample(cap=4)
    s.add(np.zeros(10, np.uint64), np.arange(10, dtype=np.uint64))
    assert s.level == 64 and len(s.sampled(64)) == 10
