"""Audit tests of ``python -m dlrm.preprocess`` on raw logs (QA pass 75): the worker pool's size, CR-only line
endings, the count pass's numbers, empty ``--output`` paths of the other data tools, --min-frequency auto's record
under a random split, a validation split of one class.

Each test failed on the code before its fix (the failure is quoted in its docstring)."""

from __future__ import annotations

import pytest
from loguru import logger

from dlrm.data import preprocess as pp
from dlrm.data.preprocess import run as run_mod
from dlrm.data.schema import read_metadata
from tests.test_preprocess import assert_same_dataset, make_fields, write_raw


def log_messages(level: str = "INFO") -> tuple[list[str], int]:
    """A list that receives loguru's messages from ``level`` up, and the handle to remove its sink."""
    messages: list[str] = []
    return messages, logger.add(lambda m: messages.append(m.record["message"]), level=level)


def recorded_pool_sizes(monkeypatch) -> list[int]:
    """The sizes the run asks `start_pool` for; the pools started have at most 2 processes (this machine's cores), so
    that a run asking for 50 stays fast."""
    sizes: list[int] = []
    real = run_mod.start_pool

    def start_pool(workers, *args, **kwargs):
        sizes.append(workers)
        return real(min(workers, 2), *args, **kwargs)

    monkeypatch.setattr(run_mod, "start_pool", start_pool)
    return sizes


# -- 1. the pool never has more workers than the run has chunks ------------------------------------------------------


def test_the_pool_has_no_more_workers_than_chunks(tmp_path, monkeypatch):
    """``--workers 500`` on a one-chunk file started all 500 processes before the count pass (143.6 s on 2 cores for
    1.5 s of work): `start_pool` was asked for 50 here, not 1. One chunk gets one worker process; the number used is
    logged when it is not the one asked for, and the dataset is the one of a single-process run."""
    src = write_raw(tmp_path / "in.tsv", make_fields(120, seed=1))
    sizes = recorded_pool_sizes(monkeypatch)
    messages, handle = log_messages()
    try:
        pp.preprocess([src], tmp_path / "one", workers=50, progress=False)  # 120 lines: one chunk
    finally:
        logger.remove(handle)
    assert sizes == [1]  # ([50] before the fix)
    assert "1 worker process (not 50): the run has only 1 chunk" in messages
    assert "1 chunk(s) of up to 262,144 lines to do (1 worker)" in messages
    pp.preprocess([src], tmp_path / "ref", workers=1, progress=False)
    assert_same_dataset(tmp_path / "one", tmp_path / "ref")

    sizes.clear()
    pp.preprocess([src], tmp_path / "three", workers=50, chunk_rows=40, progress=False)  # 3 chunks
    assert sizes == [3]
    sizes.clear()
    pp.preprocess([src], tmp_path / "enough", workers=2, chunk_rows=40, progress=False)  # as many as asked: as before
    assert sizes == [2]


def test_a_count_pass_of_several_files_gets_a_pool_of_one_worker_a_file(tmp_path, monkeypatch):
    """Several inputs are counted one file a worker: the count pass gets min(--workers, files) workers, and the chunks
    then min(--workers, chunks) (a new pool where that differs). Before the fix: one pool of 50 for both."""
    a = write_raw(tmp_path / "a.tsv", make_fields(100, seed=2))
    b = write_raw(tmp_path / "b.tsv", make_fields(100, seed=3))
    sizes = recorded_pool_sizes(monkeypatch)
    pp.preprocess([a, b], tmp_path / "ds", workers=50, chunk_rows=25, progress=False)  # 2 files, 8 chunks
    assert sizes == [2, 8]  # ([50] before the fix)
    pp.preprocess([a, b], tmp_path / "ref", workers=1, chunk_rows=25, progress=False)
    assert_same_dataset(tmp_path / "ds", tmp_path / "ref")
    sizes.clear()
    pp.preprocess([a, b], tmp_path / "two", workers=50, progress=False)  # 2 files, 2 chunks: the count pass's pool
    assert sizes == [2]


# -- 2. a file of CR-only line endings is named as such ----------------------------------------------------------


@pytest.mark.parametrize("fmt", ["tsv", "csv"])
@pytest.mark.parametrize("on_bad_line", ["stop", "skip"])
def test_cr_only_line_endings_are_named_with_the_conversion(tmp_path, fmt, on_bad_line):
    """A file whose lines end in ``\\r`` alone (old Mac) is one line of thousands of fields. Before the fix: ``in.tsv:1:
    expected 40 fields separated by '\\t', found 3901; the file ends in this line, without a newline (cut off? a
    truncated download or copy)``, and for the CSV variant ``in.csv:1: the header has 7840 fields, expected 40``. Now
    the count pass says what the file is and how to convert it, with either --on-bad-line (the whole file is unread,
    not a bad line), and writes nothing; converted as it says, the file gives the dataset of its newline copy."""
    rows = make_fields(60, seed=4)
    lf = write_raw(tmp_path / f"lf.{fmt}", rows, fmt)
    src = tmp_path / f"in.{fmt}"
    src.write_bytes(lf.read_bytes().replace(b"\n", b"\r"))
    out = tmp_path / "ds"
    with pytest.raises(pp.PreprocessError) as e:
        pp.preprocess([src], out, on_bad_line=on_bad_line, workers=1, progress=False)
    assert str(e.value) == (f"{src}:1: the file's lines end in a carriage return alone ('\\r', old Mac line endings), "
                            f"not a newline; convert it, e.g. tr '\\r' '\\n' < {src} > NEW_FILE")
    assert not out.exists()
    converted = tmp_path / f"converted.{fmt}"
    converted.write_bytes(src.read_bytes().replace(b"\r", b"\n"))  # what tr '\r' '\n' does
    pp.preprocess([converted], out, workers=1, progress=False)
    pp.preprocess([lf], tmp_path / "ref", workers=1, progress=False)
    shards = sorted(p.relative_to(out) for p in out.rglob("*.parquet"))  # (metadata.json names the input)
    assert shards and shards == sorted(p.relative_to(tmp_path / "ref") for p in (tmp_path / "ref").rglob("*.parquet"))
    assert all((out / p).read_bytes() == (tmp_path / "ref" / p).read_bytes() for p in shards)


def test_cr_only_line_endings_of_a_gzip_file_and_of_later_lines(tmp_path):
    """A gzip file's conversion decompresses it first; a file whose later lines only end in ``\\r`` (two files of
    both kinds concatenated) names the first such line, without the "cut off?" note of a file's last line (before the
    fix: ``found 361; the file ends in this line, without a newline (cut off? ...)``)."""
    import gzip

    lf = write_raw(tmp_path / "lf.tsv", make_fields(30, seed=5)).read_bytes()
    gz = tmp_path / "in.tsv.gz"
    gz.write_bytes(gzip.compress(lf.replace(b"\n", b"\r")))
    with pytest.raises(pp.PreprocessError, match=r"in\.tsv\.gz:1: the file's lines end in a carriage return alone "
                                                 r".*convert it, e.g\. zcat \S+in\.tsv\.gz \| tr '\\r' '\\n' > NEW_FILE$"):
        pp.preprocess([gz], tmp_path / "ds", workers=1, progress=False)
    mixed = tmp_path / "mixed.tsv"
    mixed.write_bytes(lf + lf.replace(b"\n", b"\r")[:-1])
    with pytest.raises(pp.BadLineError) as e:
        pp.preprocess([mixed], tmp_path / "ds", workers=1, progress=False)
    assert str(e.value) == (f"{mixed}:31: expected 40 fields separated by '\\t', found 1171 (records in this line end "
                            "in a carriage return alone ('\\r', old Mac line endings), not a newline; convert the file, "
                            "e.g. with tr '\\r' '\\n')")
    assert not (tmp_path / "ds").exists()


# -- 3. the count pass's numbers with thousands separators, as the rest of the log's --------------------------------


def test_the_count_pass_lines_have_thousands_separators(tmp_path):
    """The count pass said "in.tsv: 1200000 data lines (tsv)" and "5 chunk(s) of up to 262144 lines to do" where the
    summary says "1,200,000 rows"; likewise the trailing empty lines left out (and the chunks a resume finds done, the
    chunks a failed run keeps, the lines of a gzip file before its damage)."""
    text = "".join("\t".join(r) + "\n" for r in make_fields(1_200, seed=6))
    src = tmp_path / "in.tsv"
    src.write_text(text + "\n" * 1_001)
    out = tmp_path / "ds"
    messages, handle = log_messages()
    try:
        with pytest.raises(pp._Interrupted):  # (the test hook that stands for a kill after a chunk)
            pp.preprocess([src], out, chunk_rows=1_100, workers=1, progress=False, _max_new_chunks=1)
        pp.preprocess([src], out, chunk_rows=1_100, workers=1, progress=False)
    finally:
        logger.remove(handle)
    assert f"{src}: 1,200 data lines (tsv)" in messages  # ("1200 data lines" before the fix)
    assert "2 chunk(s) of up to 1,100 lines to do (1 worker)" in messages
    assert f"{src}: ends in 1,001 empty line(s) after its last record: left out (an editor's or a tool's trailing " \
           "newline, not a record; an empty line before a record is a bad line)" in messages
    assert "1 chunk(s) of up to 1,100 lines to do (1 worker)" in messages  # the resume
    assert sum(s.rows for s in read_metadata(out).splits.values()) == 1_200


# -- 4. an empty path to the other data tools is named as such -------------------------------------------------------


def _tool(name: str):
    """The click command of a data tool."""
    import importlib

    return importlib.import_module(f"dlrm.data.{name}").main


@pytest.mark.parametrize("tool, args, option, what", [
    ("relayout", ["--data", "{ds}", "--output", ""], "--output", "the dataset directory to create"),
    ("relayout", ["--data", "", "--output", "{tmp}/copy"], "--data", "the dataset directory to read"),
    ("mlperf_import", ["--input", "{tmp}", "--output", ""], "--output", "the dataset directory to create"),
    ("mlperf_import", ["--input", "", "--output", "{tmp}/imported"], "--input", "MLPerf's folder of day files"),
    ("synthetic", ["--rows", "10", "--out", ""], "--out", "the dataset directory to create"),
    ("synthetic", ["--rows", "10", "--out", "{tmp}/syn", "--raw-tsv", ""], "--raw-tsv", "the raw TSV file to write"),
])
def test_an_empty_path_to_the_other_data_tools_is_named_empty(tmp_path, monkeypatch, tool, args, option, what):
    """``--output ""`` (an unset shell variable) was refused as ``--output .: name the dataset directory itself, not .
    or .. (it is renamed into place)`` by relayout and the MLPerf import, ``--out .`` by the generator, whose
    ``--raw-tsv ""`` said ". is a directory, expected a file path for the raw TSV"; ``--data ""`` and ``--input ""``
    "Directory '' does not exist". Each is now click's usage error of that option, in one line, as preprocess says
    it (`dlrm.one_line_usage.NonEmptyPath`), and nothing is written in the working directory."""
    from click.testing import CliRunner

    ds = tmp_path / "ds"
    pp.preprocess([write_raw(tmp_path / "in.tsv", make_fields(40, seed=7))], ds, workers=1, progress=False)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    args = [a.format(ds=ds, tmp=tmp_path) for a in args]
    result = CliRunner().invoke(_tool(tool), args, prog_name=tool)
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines()[-1] == (f"error: Invalid value for '{option}': empty path (name {what}) "
                                                     f"(see {tool} --help)")
    assert list(work.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["ds", "in.tsv", "work"]


# -- 5. --min-frequency auto: metadata.json keeps the train rows it was picked for, and whether they are expected ----


def test_min_frequency_auto_records_the_train_rows_it_was_picked_for(tmp_path):
    """Under --split random the rule is given the expected train count (known before the lines are drawn); the log
    said so ("2 for 270 train rows (..., the expected count of --split random)") but metadata.json kept the rule and
    the value only, beside a train split of another size (266), as if the rule had been given that. Before the fix:
    ``KeyError: 'min_frequency_train_rows'``."""
    src = write_raw(tmp_path / "in.tsv", make_fields(300, seed=8))
    kw = {"hashing": "vocabulary", "min_frequency": "auto", "workers": 1, "progress": False}
    messages, handle = log_messages()
    try:
        meta = pp.preprocess([src], tmp_path / "random", split="random", seed=3, **kw)
    finally:
        logger.remove(handle)
    options = meta.extra["options"]
    expected = round(300 * (1 - 0.05 - 0.05))
    assert meta.splits["train"].rows != expected  # (the draw misses the expectation: what the record must tell)
    assert options["min_frequency_train_rows"] == expected and options["min_frequency_train_rows_expected"] is True
    assert f"--min-frequency auto: {options['min_frequency_used']} for {expected} train rows " \
           f"({options['min_frequency_rule']}, the expected count of --split random)" in messages
    assert read_metadata(tmp_path / "random").extra["options"] == options  # (as written in metadata.json)

    options = pp.preprocess([src], tmp_path / "sequential", **kw).extra["options"]
    train = read_metadata(tmp_path / "sequential").splits["train"].rows
    assert options["min_frequency_train_rows"] == train and options["min_frequency_train_rows_expected"] is False


# -- 6. a validation split of one class is said at preprocess time ---------------------------------------------------


def test_a_split_of_one_class_is_warned_about(tmp_path):
    """A validation split of one class has no AUC: train.py refuses it with train.early_stopping on auc ("data.eval_split
    'validation' holds one class (7 rows, 0 positives): its AUC is undefined"), but preprocess said nothing beyond a
    "0.00%" in its table. Now a warning names the split and its class in one line, as the empty-split warning does
    (a one-class test split, here all positive, gets its own: tests/test_audit_preprocess_small.py); a validation
    split of both classes gets none, a random split's advice adds --seed."""
    rows = make_fields(100, seed=9)  # --split sequential: lines 86-92 test, 93-99 validation
    for i, row in enumerate(rows):
        row[0] = "0" if i >= 93 else "1" if i >= 86 else str(i % 2)
    src = write_raw(tmp_path / "in.tsv", rows)
    warnings, handle = log_messages("WARNING")
    try:
        meta = pp.preprocess([src], tmp_path / "ds", workers=1, progress=False)
    finally:
        logger.remove(handle)
    assert (meta.splits["validation"].rows, meta.splits["validation"].positives) == (7, 0)
    assert (meta.splits["test"].rows, meta.splits["test"].positives) == (7, 7)
    assert warnings[0] == ("the validation split holds one class only: its 7 rows are all labelled 0 (negative), so "
                           "its AUC is undefined (train.py evaluating it picks best.pt by logloss and refuses "
                           "train.early_stopping.metric 'auc'); give more lines")
    assert len(warnings) == 2 and warnings[1].startswith("the test split holds one class only: its 7 rows are all "
                                                         "labelled 1 (positive)")

    for i, row in enumerate(rows):
        row[0] = str(i % 2)
    src = write_raw(tmp_path / "mixed.tsv", rows)
    warnings.clear()
    handle = logger.add(lambda m: warnings.append(m.record["message"]), level="WARNING")
    try:
        meta = pp.preprocess([src], tmp_path / "mixed", workers=1, progress=False)
    finally:
        logger.remove(handle)
    assert 0 < meta.splits["validation"].positives < meta.splits["validation"].rows and warnings == []

    src = write_raw(tmp_path / "one.tsv", [["1", *row[1:]] for row in rows[:30]])
    warnings.clear()
    handle = logger.add(lambda m: warnings.append(m.record["message"]), level="WARNING")
    try:
        meta = pp.preprocess([src], tmp_path / "random", split="random", validation_fraction=0.05, seed=1, workers=1,
                             progress=False)
    finally:
        logger.remove(handle)
    assert meta.splits["validation"].rows == 1 and warnings[0] == (
        "the validation split holds one class only: its one row is labelled 1 (positive), so its AUC is undefined "
        "(train.py evaluating it picks best.pt by logloss and refuses train.early_stopping.metric 'auc'); give more "
        "lines or another --seed")
    assert len(warnings) == 2 and warnings[1].startswith("the test split holds one class only: its 3 rows")
