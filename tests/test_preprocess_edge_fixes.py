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


def _empty_split_warning(src, out, **kw) -> tuple[str, object]:
    """The warning about empty splits of a run (a one-line message), and the run's metadata."""
    with warnings_logged() as seen:
        meta = pp.preprocess(src if isinstance(src, list) else [src], out, progress=False, workers=1, **kw)
    said = [w for w in seen if "has no rows" in w or "have no rows" in w]
    assert len(said) == 1 and "\n" not in said[0], seen
    return said[0], meta


def test_an_empty_validation_split_of_a_tiny_fraction_gets_true_advice(tmp_path):
    """--validation-fraction 1e-300 drew no line of 100 (0.05 + 1e-300 is 0.05: none could), and the summary advised
    "a --validation-fraction above 0", which it was. It now names the smallest fraction (2 digits, rounded up) that
    draws a line of this input: that fraction fills validation, 0.9 of it does not."""
    import re

    src = write_lines(tmp_path / "in.tsv", 100)
    said, meta = _empty_split_warning(src, tmp_path / "a", split="random", validation_fraction=1e-300)
    assert meta.splits["validation"].rows == 0 and "above 0" not in said, said
    m = re.search(r"; --validation-fraction 1e-300 draws none of these 100 lines: ([0-9.e-]+) or more draws one "
                  r"\(or give more lines\)$", said)
    assert m, said
    smallest = float(m.group(1))
    assert 0 < smallest < 0.95
    meta = pp.preprocess([src], tmp_path / "b", split="random", validation_fraction=smallest, progress=False, workers=1)
    assert meta.splits["validation"].rows >= 1
    said, meta = _empty_split_warning(src, tmp_path / "c", split="random", validation_fraction=0.9 * smallest)
    assert meta.splits["validation"].rows == 0 and f": {m.group(1)} or more draws one" in said, said
    said, _ = _empty_split_warning(src, tmp_path / "d", split="random", validation_fraction=0.0)
    assert said.endswith("refuses this dataset; give a --validation-fraction above 0"), said


def test_an_empty_train_split_is_not_advised_a_validation_fraction(tmp_path):
    """An empty train split (fractions summing near 1 on 5 lines) was advised "a --validation-fraction above 0" too:
    it is now told the largest sum of fractions that leaves train a line of this input, and that sum does."""
    import re

    src = write_lines(tmp_path / "in.tsv", 5)
    said, meta = _empty_split_warning(src, tmp_path / "a", split="random", validation_fraction=0.5,
                                      test_fraction=0.49)
    assert meta.splits["train"].rows == 0 and "the train split has no rows" in said, said
    m = re.search(r"--validation-fraction 0.5 \+ --test-fraction 0.49 leave train no line of these 5: give more "
                  r"lines, or fractions that sum to at most ([0-9.]+)$", said)
    assert m, said
    total = float(m.group(1))
    meta = pp.preprocess([src], tmp_path / "b", split="random", validation_fraction=total / 2,
                         test_fraction=total / 2, progress=False, workers=1)
    assert meta.splits["train"].rows >= 1


def test_empty_split_advice_of_sequential_days_bad_lines_and_large_inputs(tmp_path, monkeypatch):
    from dlrm.data.preprocess import empty_splits

    src = write_lines(tmp_path / "in.tsv", 13)  # the largest input whose sequential split leaves validation empty
    said, _ = _empty_split_warning(src, tmp_path / "seq")
    assert said.endswith("--split sequential takes validation from the second half of the input's last seventh, "
                         "empty for 13 lines: give 14 lines or more, or use --split random"), said
    days = [write_lines(tmp_path / "day_0", 10), write_lines(tmp_path / "day_1", 1)]
    said, _ = _empty_split_warning(days, tmp_path / "days", split="days")
    assert said.endswith("--split days takes validation from the second half of the last file, whose 1 line(s) "
                         "leave it empty: give a last file of 2 lines or more"), said
    lines = [tsv_line(k) for k in range(100)]
    lines[93:] = ["x" + line for line in lines[93:]]  # validation's lines [93, 100), every one a bad label
    (tmp_path / "bad.tsv").write_text("".join(line + "\n" for line in lines))
    said, _ = _empty_split_warning(tmp_path / "bad.tsv", tmp_path / "bad", on_bad_line="skip")
    assert said.endswith("the split's 7 line(s) were all bad lines, skipped (the summary counts them): fix or "
                         "replace them"), said
    monkeypatch.setattr(empty_splits, "_EXACT_MAX_LINES", 10)  # (above it the draws are not computed)
    said, _ = _empty_split_warning(src, tmp_path / "big", split="random",
                                   validation_fraction=1e-300)
    assert said.endswith("--validation-fraction 1e-300 expects 1.3e-299 of the 13 lines in validation: 0.077 or "
                         "more expects one"), said


def test_train_py_refusing_an_empty_split_gives_the_preprocessor_s_advice(tmp_path):
    """train.py's refusal of the empty validation split of a --validation-fraction 1e-300 dataset advised "a
    --validation-fraction ... above 0" too: it gives the summary's advice, from the options metadata.json records,
    and the general one where that record does not read (metadata.json is untrusted: a hand-edited one)."""
    from dlrm.data.schema import read_metadata, write_metadata
    from dlrm.data.validation import split_files
    from dlrm.errors import DatasetError

    src = write_lines(tmp_path / "in.tsv", 100)
    out = tmp_path / "ds"
    said, _ = _empty_split_warning(src, out, split="random", validation_fraction=1e-300)
    hint = said.split("refuses this dataset; ")[1]
    with pytest.raises(DatasetError) as e:
        split_files(out, read_metadata(out), "validation")
    assert str(e.value) == (f"{out / 'metadata.json'}: splits.validation: lists no files (the split has no rows: "
                            f"preprocess again: {hint})"), str(e.value)
    assert "draws none of these 100 lines" in hint
    meta = read_metadata(out)
    meta.extra["options"] = "edited"
    write_metadata(out, meta)
    with pytest.raises(DatasetError, match=r"no rows: preprocess again with more lines, or a --validation-fraction "):
        split_files(out, read_metadata(out), "validation")
