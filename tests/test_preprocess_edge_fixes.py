"""Edge cases of `python -m dlrm.preprocess` (and, for the output place, of the other data tools) found by a QA pass:
a dangling symbolic link as (or above) the output, advice about an empty split that is true, undecodable bytes of a
bad value shown as escapes, a table cap of one row, and a resume after a failure writing metadata.json."""

from __future__ import annotations

import contextlib

import pytest
from click.testing import CliRunner
from loguru import logger

from dlrm.data import mlperf_import, relayout, synthetic
from dlrm.data import preprocess as pp

HERE_SIZES = ",".join(["2"] + ["1"] * 25)  # multi-hot (relayout refuses one-hot data), and quick to generate


def tsv_line(k: int) -> str:
    """A good 40-field line: label k % 2, I1 = k, I2..I13 "1", C1 a hash of k, C2..C26 "00000001"."""
    return "\t".join([str(k % 2), str(k), *["1"] * 12, f"{k * 2654435761 % (1 << 32):08x}", *["00000001"] * 25])


def write_lines(path, n: int):
    path.write_text("".join(tsv_line(k) + "\n" for k in range(n)))
    return path


@pytest.fixture(scope="module")
def multi_hot_dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("syn") / "ds"
    res = CliRunner().invoke(synthetic.main, ["--rows", "30", "--cardinalities", "tiny", "--out", str(out),
                                              "--multi-hot-sizes", HERE_SIZES])
    assert res.exit_code == 0, res.output
    return out


@contextlib.contextmanager
def warnings_logged(level: str = "WARNING"):
    """The messages logged (loguru) inside the block, at `level` and above."""
    seen: list[str] = []
    handle = logger.add(lambda m: seen.append(m.record["message"]), level=level)
    try:
        yield seen
    finally:
        logger.remove(handle)


def _tools(tmp_path, dataset):
    """(name, click command, arguments but the output, the output's flag) of every data tool that writes a dataset."""
    src = write_lines(tmp_path / "in.tsv", 20)
    (tmp_path / "mlperf").mkdir()
    return [
        ("preprocess", pp.build_cli(), ["-i", str(src), "--no-progress"], "--output"),
        ("synthetic", synthetic.main, ["--rows", "10", "--cardinalities", "tiny"], "--out"),
        ("relayout", relayout.main, ["--data", str(dataset)], "--output"),
        ("mlperf_import", mlperf_import.main, ["--input", str(tmp_path / "mlperf")], "--output"),
    ]


@pytest.mark.parametrize("below", [False, True], ids=["the-link", "under-the-link"])
def test_a_dangling_link_as_or_above_the_output_is_named_by_every_tool(tmp_path, multi_hot_dataset, below):
    """preprocess said "exists and is not a directory" of a dangling link given as --output, and "cannot be created:
    LINK is not a directory" of LINK/sub; the other tools created the link's missing target for LINK/sub (an
    unmounted disk's mount point, on the root disk) and wrote the dataset there. Every tool now refuses both in the
    same line, naming the link and its target, before any work and making nothing."""
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    out = link / "sub" if below else link
    for name, command, args, flag in _tools(tmp_path, multi_hot_dataset):
        res = CliRunner().invoke(command, [*args, flag, str(out)])
        assert res.exit_code == 2, (name, res.output)
        where = f"{flag} {out}: {link}" if below else f"{flag} {link}"
        expected = f"{where} is a dangling symbolic link (to {tmp_path / 'gone'}); remove it or name another path"
        assert expected in res.output, (name, res.output)
        assert "not a directory" not in res.output, (name, res.output)
        assert not (tmp_path / "gone").exists() and link.is_symlink(), name


@pytest.mark.parametrize("column, raw, shown", [
    ("I2", b"1\xe9", r"'1\xe9'"),  # a Latin-1 byte in a count
    ("C7", b"ab\xff\xfe", r"'ab\xff\xfe'"),  # bytes of no encoding in a category
    ("C7", "caf\u00e9".encode() + b"\\\xff", r"'café\\\xff'"),  # valid UTF-8 stays text; a literal backslash doubled
])
def test_undecodable_bytes_of_a_bad_value_are_shown_as_escapes(tmp_path, column, raw, shown):
    """A bad value's bytes that are not UTF-8 read '\ufffd' each (printed as question-mark glyphs), so the user could
    not tell which bytes to look for; they are shown as \\xNN, in the error (stop) and in the record of the first
    skipped line (skip: the log and metadata.json)."""
    lines = [tsv_line(k).encode() for k in range(20)]
    fields = lines[3].split(b"\t")
    fields[int(column[1:]) + (0 if column[0] == "I" else 13)] = raw
    lines[3] = b"\t".join(fields)
    src = tmp_path / "in.tsv"
    src.write_bytes(b"\n".join(lines) + b"\n")
    expected = f"{src}:4: column {column}: {shown} is not "
    with pytest.raises(pp.BadLineError) as e:
        pp.preprocess([src], tmp_path / "stop", progress=False, workers=1)
    assert expected in str(e.value) and "\ufffd" not in str(e.value), str(e.value)
    meta = pp.preprocess([src], tmp_path / "skip", progress=False, workers=1, on_bad_line="skip")
    assert meta.extra["first_bad_line"].startswith(expected), meta.extra["first_bad_line"]
    res = CliRunner().invoke(pp.build_cli(), ["-i", str(src), "-o", str(tmp_path / "cli"), "--no-progress"])
    assert res.exit_code == 2 and f"error: {expected}" in res.output, res.output


def test_an_undecodable_header_name_is_shown_as_escapes(tmp_path):
    header = ",".join(["label", *[f"I{i}" for i in range(1, 14)], *[f"C{i}" for i in range(1, 26)]]).encode()
    src = tmp_path / "in.csv"
    src.write_bytes(header + b",C\xff26\n" + tsv_line(1).replace("\t", ",").encode() + b"\n")
    with pytest.raises(pp.PreprocessError, match=r"header column 40: expected 'C26', found 'C\\xff26' \("):
        pp.preprocess([src], tmp_path / "out", progress=False, workers=1)


def test_a_table_cap_of_one_row_is_warned_of_before_the_work(tmp_path):
    """--max-rows-per-table 1 was accepted without a word, and every table had one row shared by all its values. It
    is warned of (not refused: training's data.max_rows_per_table 1 and a --min-frequency that keeps no value are
    warnings too), first, before the count pass; a cap of 2, no cap (0) and vocabulary hashing are not."""
    src = write_lines(tmp_path / "in.tsv", 30)
    with warnings_logged("INFO") as seen:
        meta = pp.preprocess([src], tmp_path / "one", max_rows_per_table=1, progress=False, workers=1)
    assert meta.cardinalities == [1] * 26
    warned = [i for i, m in enumerate(seen) if m.startswith("--max-rows-per-table 1: every table has one row")]
    assert warned == [0] and seen[1].startswith("counting the lines"), seen
    for kw in (dict(max_rows_per_table=2), dict(max_rows_per_table=0), dict(hashing="vocabulary")):
        with warnings_logged() as seen:
            pp.preprocess([src], tmp_path / f"other{len(list(tmp_path.iterdir()))}", progress=False, workers=1, **kw)
        assert not any("--max-rows-per-table" in w for w in seen), (kw, seen)


def _fail_metadata_once(monkeypatch):
    """Make the next write of metadata.json fail as a full disk does; the one after succeeds."""
    from dlrm.data.preprocess import finish

    real = finish.write_metadata
    calls = []

    def write(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(finish, "write_metadata", write)


def _count_rereads(monkeypatch) -> list[str]:
    """The train shards a run re-reads for their statistics (`_Run.restore_stats`, --workers 1)."""
    from dlrm.data.preprocess import run

    reads: list[str] = []
    real = run._stats_from_shard
    monkeypatch.setattr(run, "_stats_from_shard", lambda args: (reads.append(args[0]), real(args))[1])
    return reads


KW = dict(chunk_rows=50, hashing="vocabulary", min_frequency=2, progress=False, workers=1)


def test_a_resume_after_metadata_json_failed_does_only_the_finish_step(tmp_path, monkeypatch):
    """No statistics checkpoint was forced before the finish step: after a failure writing metadata.json (a full
    disk, at the very end), the resume re-read every train shard that the last periodic checkpoint (5 minutes by
    default) did not cover, all of them for a shorter run. It re-reads none now, and writes the same dataset."""
    from tests.test_preprocess import assert_same_dataset

    src = write_lines(tmp_path / "in.tsv", 500)
    pp.preprocess([src], tmp_path / "ref", **KW)
    out = tmp_path / "ds"
    _fail_metadata_once(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        pp.preprocess([src], out, **KW)
    assert not (out / "metadata.json").exists() and (out / pp.PROGRESS_DIR / "stats.npz").is_file()
    reads = _count_rereads(monkeypatch)
    pp.preprocess([src], out, **KW)
    assert reads == []
    assert_same_dataset(out, tmp_path / "ref")


def test_statistics_a_resume_re_read_are_saved_before_its_finish_step(tmp_path, monkeypatch):
    """A resume that re-read train shards (a kill after the last chunk, before any checkpoint), had no chunk left to
    do, and then failed writing metadata.json: the next resume re-reads none of them again (the forced checkpoint
    saves what a resume re-read, not only the statistics of chunks it ran)."""
    from tests.test_preprocess import assert_same_dataset

    src = write_lines(tmp_path / "in.tsv", 500)
    pp.preprocess([src], tmp_path / "ref", **KW)
    out = tmp_path / "ds"
    with pytest.raises(pp._Interrupted):  # (as a kill once all 10 chunks were recorded: no checkpoint yet)
        pp.preprocess([src], out, _max_new_chunks=10, checkpoint_interval=1e9, **KW)
    assert not (out / pp.PROGRESS_DIR / "stats.npz").exists()
    _fail_metadata_once(monkeypatch)
    reads = _count_rereads(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        pp.preprocess([src], out, checkpoint_interval=1e9, **KW)
    assert len(reads) == 9  # (the 10th chunk has no train row: lines [429, 500) are test and validation)
    reads.clear()
    pp.preprocess([src], out, checkpoint_interval=1e9, **KW)
    assert reads == []
    assert_same_dataset(out, tmp_path / "ref")
