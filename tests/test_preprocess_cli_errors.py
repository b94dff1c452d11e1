"""`python -m dlrm.preprocess` never leaves a mess (issue #17): bad options, inputs and output
directories fail with one line and exit code 2 before anything is written; a run that fails before
its first chunk is finished removes what it created, so that the corrected command just works; an
unexpected exception is a traceback plus one line calling it a bug, exit code 1."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from dlrm.data import preprocess as pp
from dlrm.data.preprocess import options as pp_options
from dlrm.data.preprocess import run as pp_run
from dlrm.data.preprocess import worker as pp_worker
from dlrm.data.schema import read_metadata
from tests.conftest import REPO

# loguru records: its default format, and dlrm.logging_setup's
_LOG_RECORD = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+ \| [A-Z]+ +\| |\d\d:\d\d:\d\d [A-Z]+ +)")


def raw_lines(n: int, seed: int = 0) -> str:
    """``n`` well-formed TSV lines (label, 13 counts, 26 hex categories), deterministic."""
    lines = []
    for i in range(n):
        k = seed * 7919 + i
        dense = [str((k * (j + 3)) % 97) for j in range(13)]
        sparse = [f"{(k * 2654435761 + j * 40503) % (1 << 32):08x}" for j in range(26)]
        lines.append("\t".join([str(k % 2), *dense, *sparse]))
    return "\n".join(lines) + "\n"


@pytest.fixture
def src(tmp_path: Path) -> Path:
    """A small raw input file."""
    path = tmp_path / "in" / "a.tsv"
    path.parent.mkdir()
    path.write_text(raw_lines(60))
    return path


@pytest.fixture
def shared_tmp() -> Path:
    """A directory every user may enter and write (pytest's own tmp_path lies under a 0700 directory of
    root's, which user nobody could not enter); removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="dlrm-permissions-"))
    path.chmod(0o777)
    yield path
    for d in [path, *path.rglob("*")]:
        if d.is_dir():
            d.chmod(0o777)
    shutil.rmtree(path)


def run_cli_unprivileged(*args, warm_up: tuple) -> object:
    """``run_cli(*args)`` with the permission bits checked for real. Root reads and writes past them, so under
    root the command runs with real and effective user and group ``nobody`` (Linux checks file access against
    the effective ids, ``os.access`` against the real ones) and root's come back from the saved ids after it.
    ``warm_up``, a command root can run, runs first as root: nobody cannot enter /root, where site-packages may
    lie, so every module the command imports is loaded before."""
    if os.geteuid() != 0:
        return run_cli(*args)
    assert run_cli(*warm_up).exit_code == 0
    groups = os.getgroups()
    # every change inside the try: a setresuid refused after setresgid succeeded left the process in group nobody for
    # the rest of the session (and a test failing with an OSError where the ids cannot change at all)
    try:
        try:
            os.setgroups([])  # root's supplementary groups (0, ...) still opened what group root may read or write
            os.setresgid(65534, 65534, 0)
            os.setresuid(65534, 65534, 0)
        except OSError as e:  # a user namespace that maps root alone (rootless containers): there is no nobody
            pytest.skip(f"cannot run as user nobody here ({e})")
        return run_cli(*args)
    finally:
        os.setresuid(0, 0, 0)  # (the saved uid: back to root first, whose capabilities set the groups)
        os.setresgid(0, 0, 0)
        os.setgroups(groups)


@pytest.mark.skipif(os.geteuid() != 0, reason="the helper changes ids under root only")
def test_run_cli_unprivileged_drops_every_group_and_skips_where_nobody_cannot_be_become(monkeypatch):
    """Run as nobody without root's supplementary groups, root's ids and groups back afterwards; where nobody cannot
    be become (setresuid refused), a skip, and the process still root in every id and group."""
    module, real_setresuid, groups = sys.modules[__name__], os.setresuid, os.getgroups()
    seen = []
    monkeypatch.setattr(module, "run_cli", lambda *a: seen.append((os.getresuid(), os.getresgid(), os.getgroups()))
                        or type("Result", (), {"exit_code": 0})())
    try:
        os.setgroups([0])
        run_cli_unprivileged("-i", "x", warm_up=("-i", "x"))
        assert seen[1] == ((65534, 65534, 0), (65534, 65534, 0), [])
        assert (os.getresuid(), os.getresgid(), os.getgroups()) == ((0, 0, 0), (0, 0, 0), [0])

        def refused(r, e, s):
            if e != 0:
                raise OSError(errno.EINVAL, "Invalid argument")
            real_setresuid(r, e, s)

        monkeypatch.setattr(os, "setresuid", refused)
        with pytest.raises(pytest.skip.Exception):
            run_cli_unprivileged("-i", "x", warm_up=("-i", "x"))
        assert (os.getresuid(), os.getresgid(), os.getgroups()) == ((0, 0, 0), (0, 0, 0), [0])
    finally:  # (whatever the helper left)
        real_setresuid(0, 0, 0)
        os.setresgid(0, 0, 0)
        os.setgroups(groups)


def run_cli(*args: str):
    return CliRunner().invoke(pp.build_cli(), [*map(str, args), "--no-progress", "--workers", "1"])


def error_lines(result) -> list[str]:
    """The CLI's stderr without loguru records."""
    return [x for x in result.stderr.strip().splitlines() if not _LOG_RECORD.match(x)]


def assert_one_line_error(result, *fragments: str, code: int = 2) -> str:
    """Exit ``code`` and exactly one ``error: ...`` line on stderr, holding every fragment."""
    lines = error_lines(result)
    assert result.exit_code == code, result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


# ------------------------------------------------------------------------------------------
# options: checked before anything is created


@pytest.mark.parametrize(
    "bad,fragments",
    [
        (["--compression", "bogus"], ["--compression", "'bogus'"]),
        (["--compression", "zstd", "--compression-level", "99"], ["--compression-level", "99", "zstd"]),
        (["--compression", "gzip", "--compression-level", "10"], ["--compression-level", "10", "gzip"]),
        (["--compression", "snappy", "--compression-level", "3"], ["--compression-level", "snappy"]),
        (["--compression", "none", "--compression-level", "1"], ["--compression-level", "none"]),
        (["--split", "random", "--validation-fraction", "0.6", "--test-fraction", "0.5"], ["0.6", "0.5", "below 1"]),
        (["--validation-fraction", "1.5"], ["--validation-fraction", "1.5"]),
        (["--test-fraction", "-0.1"], ["--test-fraction", "-0.1"]),
        (["--checkpoint-interval", "nan"], ["--checkpoint-interval", "nan"]),
        (["--sparse-layout", "rows"], ["--sparse-layout", "'rows'", "lists, slots"]),
        (["--multi-hot-sizes", "mlperf", "--sparse-layout", "Slots"], ["--sparse-layout", "'Slots'"]),
    ],
)
def test_bad_option_fails_before_any_output_and_the_corrected_command_works(tmp_path, src, bad, fragments):
    out = tmp_path / "ds"
    assert_one_line_error(run_cli("-i", src, "-o", out, *bad), *fragments)
    assert not out.exists()
    r = run_cli("-i", src, "-o", out)
    assert r.exit_code == 0, r.stderr
    assert sum(s.rows for s in read_metadata(out).splits.values()) == 60


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        (dict(workers=0), "--workers: 0 must be >= 1"),
        (dict(workers=-2), "--workers: -2 must be >= 1"),
        (dict(chunk_rows=0), "--chunk-rows: 0 must be >= 1"),
        (dict(row_group_rows=2.5), "--row-group-rows: 2.5 is not an integer"),
        (dict(max_rows_per_table=-1), "--max-rows-per-table: -1 must be >= 0"),
        (dict(min_frequency=0, hashing="vocabulary"), "--min-frequency: 0 must be >= 1"),
        (dict(seed="7"), "--seed: '7' is not an integer"),
        (dict(compression="ZSTD", compression_level="3"), "--compression-level: '3' is not an integer"),
        (dict(split="weekly"), "--split: 'weekly' is not one of"),
        (dict(input_format="parquet"), "--format: 'parquet' is not one of"),
    ],
)
def test_api_checks_every_option_before_creating_output(tmp_path, src, kwargs, fragment):
    out = tmp_path / "ds"
    with pytest.raises(pp.PreprocessError) as err:
        pp.preprocess([src], out, progress=False, **kwargs)
    assert fragment in str(err.value) and "\n" not in str(err.value)
    assert not out.exists()


_ANY = st.one_of(st.none(), st.booleans(), st.integers(-5, 30), st.floats(allow_nan=True), st.text(max_size=6),
                 st.sampled_from(["zstd", "snappy", "gzip", "lz4", "brotli", "none", "tsv", "random", "vocabulary",
                                  "lists", "slots"]))


@settings(max_examples=150, deadline=None)
@given(values=st.fixed_dictionaries({name: _ANY for name in (
    "input_format", "split", "validation_fraction", "test_fraction", "seed", "hashing", "min_frequency",
    "max_rows_per_table", "chunk_rows", "row_group_rows", "compression", "compression_level", "workers",
    "on_bad_line", "checkpoint_interval", "sparse_layout")}))
def test_check_options_accepts_or_names_the_problem_in_one_line(values):
    """Whatever the values, the check returns valid options or raises one `PreprocessError` line
    naming an option: never another exception, which would surface as a traceback."""
    try:
        opts = pp.check_options(**values, overwrite=False, progress=False)
    except pp.PreprocessError as e:
        message = str(e)
        assert "\n" not in message and message.startswith("--"), message
        return
    assert opts.chunk_rows >= 1 and opts.row_group_rows >= 1 and opts.workers >= 1 and opts.min_frequency >= 1
    assert 0 <= opts.validation_fraction < 1 and 0 <= opts.test_fraction < 1
    assert opts.max_rows is None or opts.max_rows >= 1
    assert opts.compression in pp_options.CODECS and not math.isnan(opts.checkpoint_interval)
    assert opts.sparse_layout == "lists"  # one-hot: the layouts write the same files
    json.dumps(opts.output_options())  # goes into the manifest and metadata.json


# ------------------------------------------------------------------------------------------
# inputs


def _spellings(src: Path, tmp_path: Path) -> dict[str, Path]:
    """Other names of ``src``: a path through '..', a symlink, a hard link."""
    (tmp_path / "sub").mkdir()
    link = tmp_path / "link.tsv"
    link.symlink_to(src)
    hard = tmp_path / "hard.tsv"
    os.link(src, hard)
    return {"same": src, "dotdot": tmp_path / "sub" / ".." / "in" / src.name, "symlink": link, "hardlink": hard}


@pytest.mark.parametrize("how", ["same", "dotdot", "symlink", "hardlink", "relative"])
def test_the_same_input_twice_is_refused(tmp_path, src, how, monkeypatch):
    if how == "relative":
        monkeypatch.chdir(src.parent)
        other = Path(src.name)
    else:
        other = _spellings(src, tmp_path)[how]
    out = tmp_path / "ds"
    line = assert_one_line_error(run_cli("-i", src, "-i", other, "-o", out), str(other), "given twice")
    if how != "same":
        assert str(src) in line
    assert not out.exists()


def test_the_same_input_twice_is_refused_by_the_api_too(tmp_path, src):
    other = tmp_path / "hard.tsv"
    os.link(src, other)
    with pytest.raises(pp.PreprocessError, match="given twice"):
        pp.preprocess([src, other], tmp_path / "ds", progress=False)
    assert not (tmp_path / "ds").exists()


def test_missing_input_is_one_line(tmp_path, src):
    out = tmp_path / "ds"
    missing = tmp_path / "nope.tsv"
    assert_one_line_error(run_cli("-i", src, missing, "-o", out), f"{missing}: no such file")
    assert not out.exists()


@pytest.mark.parametrize("overwrite", [False, True])
def test_an_empty_output_or_input_path_is_refused_not_the_working_directory(tmp_path, src, monkeypatch, overwrite):
    """``-o "$OUT"`` with OUT unset: ``Path("")`` is ".", so the dataset was written into the working directory
    (with --overwrite, replacing the user's test/ folder there); ``-i ""`` was refused as ". is not a regular file"."""
    home = tmp_path / "home"
    (home / "test").mkdir(parents=True)
    (home / "test" / "results.txt").write_text("mine")
    monkeypatch.chdir(home)
    flags = ["--overwrite"] if overwrite else []
    assert_one_line_error(run_cli("-i", src, "-o", "", *flags), "'--output'", "empty path",
                          '"." for the working directory')
    assert sorted(p.name for p in home.rglob("*")) == ["results.txt", "test"]
    assert (home / "test" / "results.txt").read_text() == "mine"
    assert_one_line_error(run_cli("-i", "", "-o", tmp_path / "ds", *flags), "'--input'", "empty path (name a raw")
    assert_one_line_error(run_cli(src, "", "-o", tmp_path / "ds", *flags), "empty path (name a raw")
    assert not (tmp_path / "ds").exists()
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path / "empty")
    assert run_cli("-i", src, "-o", ".").exit_code == 0  # "." still names the working directory
    assert read_metadata(tmp_path / "empty").splits["train"].rows > 0


def test_directory_as_input_is_one_line(tmp_path, src):
    assert_one_line_error(run_cli("-i", src.parent, "-o", tmp_path / "ds"), f"{src.parent}: not a regular file")
    assert not (tmp_path / "ds").exists()


def test_unreadable_input_is_one_line(tmp_path, src, monkeypatch):
    real_open = open

    def deny(path, *args, **kwargs):  # what a file without read permission does (root reads anything)
        if Path(path) == src:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(pp_options, "open", deny, raising=False)
    assert_one_line_error(run_cli("-i", src, "-o", tmp_path / "ds"), f"{src}: cannot be read (Permission denied)")
    assert not (tmp_path / "ds").exists()


def test_unreadable_input_is_one_line_for_real(shared_tmp):
    src = shared_tmp / "a.tsv"
    src.write_text(raw_lines(60))
    src.chmod(0)
    result = run_cli_unprivileged("-i", src, "-o", shared_tmp / "ds", warm_up=("-i", src, "-o", shared_tmp / "warm"))
    assert_one_line_error(result, f"'{src}' is not readable")  # click's check of --input, before ours
    assert not (shared_tmp / "ds").exists()


def test_input_inside_the_output_is_not_deleted_by_overwrite(tmp_path):
    out = tmp_path / "ds"
    (out / "train").mkdir(parents=True)
    inside = out / "train" / "raw.tsv"
    inside.write_text(raw_lines(30))
    assert_one_line_error(run_cli("-i", inside, "-o", out, "--overwrite"), str(inside), "train/")
    assert inside.read_text() == raw_lines(30)


# ------------------------------------------------------------------------------------------
# the output directory


def test_existing_dataset_is_one_line_exit_2(tmp_path, src):
    out = tmp_path / "ds"
    pp.preprocess([src], out, progress=False, workers=1)
    before = sorted(p.name for p in out.rglob("*"))
    assert_one_line_error(run_cli("-i", src, "-o", out), "already holds a complete dataset")
    assert sorted(p.name for p in out.rglob("*")) == before


def test_output_that_is_a_file_is_one_line(tmp_path, src):
    target = tmp_path / "ds"
    target.write_text("mine")
    assert_one_line_error(run_cli("-i", src, "-o", target), f"{target}: exists and is not a directory")
    assert target.read_text() == "mine"
    # (through the file: "X: cannot be created: F is not a directory" named no option; the click path type's line,
    # as for a path no file can have, names it: tests/test_under_file_paths.py)
    assert_one_line_error(run_cli("-i", src, "-o", target / "x"), "Invalid value for '--output' / '-o'",
                          f"{target / 'x'}: {target} is not a directory")


def test_not_writable_output_is_one_line_before_any_work(tmp_path, src, monkeypatch):
    parent = tmp_path / "ro"
    parent.mkdir()
    real_access = os.access

    def access(path, mode, *args, **kwargs):  # a read-only directory (root may write anywhere)
        if Path(path) == parent and mode & os.W_OK:
            return False
        return real_access(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", access)
    counted = []
    monkeypatch.setattr(pp_run, "_count_pass", lambda *a: counted.append(a))
    assert_one_line_error(run_cli("-i", src, "-o", parent / "ds"), f"{parent / 'ds'}: not writable", str(parent))
    assert counted == [] and not (parent / "ds").exists()


def test_not_writable_output_is_one_line_for_real(shared_tmp):
    src = shared_tmp / "a.tsv"
    src.write_text(raw_lines(60))
    parent = shared_tmp / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    result = run_cli_unprivileged("-i", src, "-o", parent / "ds", warm_up=("-i", src, "-o", shared_tmp / "warm"))
    assert_one_line_error(result, f"{parent / 'ds'}: not writable")
    assert list(parent.iterdir()) == []


def test_malformed_manifest_is_one_line(tmp_path, src):
    out = tmp_path / "ds"
    (out / pp.PROGRESS_DIR).mkdir(parents=True)
    (out / pp.PROGRESS_DIR / "manifest.json").write_text('{"options": {}, "inputs": [1, 2]}')
    assert_one_line_error(run_cli("-i", src, "-o", out), "manifest.json: unreadable", "--overwrite")
    r = run_cli("-i", src, "-o", out, "--overwrite")
    assert r.exit_code == 0, r.stderr


def test_an_unknown_recorded_layout_is_one_line(tmp_path, src):
    """An unfinished run whose manifest records no known --sparse-layout: one line, and --overwrite
    (with the layout asked for) starts over."""
    out = tmp_path / "ds"
    sizes = ",".join(["2"] + ["1"] * 25)
    with pytest.raises(pp._Interrupted):
        pp.preprocess([src], out, multi_hot_sizes=sizes, chunk_rows=20, _max_new_chunks=1, workers=1, progress=False)
    manifest_path = out / pp.PROGRESS_DIR / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    assert manifest["options"]["sparse_layout"] == "slots"
    manifest["options"]["sparse_layout"] = "columns"
    manifest_path.write_text(json.dumps(manifest))
    same = ["-i", src, "-o", out, "--multi-hot-sizes", sizes, "--chunk-rows", "20"]
    assert_one_line_error(run_cli(*same), "sparse_layout 'columns'", "--overwrite")
    r = run_cli(*same, "--sparse-layout", "lists", "--overwrite")
    assert r.exit_code == 0, r.stderr
    assert read_metadata(out).sparse_layout == "lists"


# ------------------------------------------------------------------------------------------
# failures during the run


def _fail_writing(exc: BaseException):
    def write_shard(*args, **kwargs):
        raise exc

    return write_shard


@pytest.mark.parametrize("existed", ["no", "empty directory", "nested new directories"])
def test_failure_before_the_first_chunk_removes_what_it_created(tmp_path, src, monkeypatch, existed):
    """A disk-full error while writing the first shard: one line, exit 2, and no unfinished run
    left to block the next command."""
    out = tmp_path / "new" / "sub" / "ds" if existed == "nested new directories" else tmp_path / "ds"
    if existed == "empty directory":
        out.mkdir()
    before = sorted(tmp_path.rglob("*"))
    full = OSError(errno.ENOSPC, "No space left on device", str(out / "train" / "x.parquet"))
    monkeypatch.setattr(pp_worker, "_write_shard", _fail_writing(full))
    assert_one_line_error(run_cli("-i", src, "-o", out), "No space left on device", str(out))
    assert sorted(tmp_path.rglob("*")) == before  # all it created is gone, nothing else
    monkeypatch.undo()
    r = run_cli("-i", src, "-o", out, "--compression", "gzip")  # other settings: nothing to resume
    assert r.exit_code == 0, r.stderr


def test_unexpected_exception_is_a_traceback_and_one_bug_line(tmp_path, src, monkeypatch):
    out = tmp_path / "ds"
    monkeypatch.setattr(pp_worker, "_write_shard", _fail_writing(RuntimeError("boom")))
    r = run_cli("-i", src, "-o", out)
    assert r.exit_code == 1
    assert "Traceback (most recent call last)" in r.stderr and "RuntimeError: boom" in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "bug in dlrm" in last and "RuntimeError" in last
    assert not out.exists()


def test_out_of_memory_is_one_line_exit_4_and_cleans_up(tmp_path, src, monkeypatch):
    out = tmp_path / "ds"
    monkeypatch.setattr(pp_worker, "_write_shard", _fail_writing(MemoryError()))
    assert_one_line_error(run_cli("-i", src, "-o", out), "out of memory", "--chunk-rows", code=4)
    assert not out.exists()


def test_interrupt_is_one_line_exit_130_and_cleans_up(tmp_path, src, monkeypatch):
    out = tmp_path / "ds"
    monkeypatch.setattr(pp_worker, "_write_shard", _fail_writing(KeyboardInterrupt()))
    assert_one_line_error(run_cli("-i", src, "-o", out), "interrupted", code=130)
    assert not out.exists()


def test_failed_overwrite_keeps_the_old_dataset_until_the_inputs_are_counted(tmp_path, src):
    """--overwrite with an input the count pass rejects: the old dataset is still there."""
    out = tmp_path / "ds"
    pp.preprocess([src], out, progress=False, workers=1)
    before = {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    empty = tmp_path / "empty.tsv"
    empty.write_bytes(b"")
    assert_one_line_error(run_cli("-i", src, "-i", empty, "-o", out, "--overwrite"), f"{empty}: empty file")
    assert {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_python_m_exit_codes(tmp_path, src):
    """The real entry point: a refused command is one line on stderr and exit code 2."""
    out = tmp_path / "ds"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-m", "dlrm.preprocess", "-i", str(src), str(src), "-o", str(out)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    expected = f"error: {src}: given twice as input (the same path); list every file once"
    assert r.stderr.strip().splitlines() == [expected]
    assert not out.exists()


@pytest.mark.parametrize("given,header", [("tsv", True), ("tsv", False), ("csv", False)])
def test_a_file_of_the_other_format_than_format_says_so(tmp_path, src, given, header):
    """--format tsv given the CSV variant (criteo_sample.txt's layout, with or without its header), or --format csv
    given a raw TSV log: the line said only "expected 40 fields separated by '\\t', found 1"."""
    path = src
    if given == "tsv":  # the CSV variant of the same lines
        path = tmp_path / "a.csv"
        lines = src.read_text().replace("\t", ",")
        path.write_text(",".join(CSV_HEADER) + "\n" + lines if header else lines)
    other = "csv" if given == "tsv" else "tsv"
    sep = "'\\t'" if given == "tsv" else "','"
    other_sep = "','" if given == "tsv" else "'\\t'"
    line = assert_one_line_error(run_cli("-i", path, "-o", tmp_path / "ds", "--format", given))
    assert line == (f"error: {path}:1: expected 40 fields separated by {sep}, found 1 (the line has 40 fields separated "
                    f"by {other_sep}: a {other.upper()} file? give --format {other} or auto)"), line
    assert not (tmp_path / "ds").exists()
    assert run_cli("-i", path, "-o", tmp_path / "ds").exit_code == 0  # as the line advises: auto


# ------------------------------------------------------------------------------------------
# the CSV header: exactly label,I1..I13,C1..C26 (fields are read by position)

CSV_HEADER = ["label", *[f"I{i}" for i in range(1, 14)], *[f"C{i}" for i in range(1, 27)]]


@pytest.mark.parametrize(
    "change,column,expected,found",
    [({1: "I2", 2: "I1"}, 2, "I1", "I2"), ({5: "X5"}, 6, "I5", "X5"), ({20: "c7"}, 21, "C7", "c7")],
)
def test_a_csv_header_with_swapped_or_misnamed_columns_is_one_line(tmp_path, src, change, column, expected, found):
    header = [change.get(i, name) for i, name in enumerate(CSV_HEADER)]
    csv = tmp_path / "in" / "a.csv"
    csv.write_text(",".join(header) + "\n" + src.read_text().replace("\t", ","))
    out = tmp_path / "ds"
    assert_one_line_error(run_cli("-i", csv, "-o", out), f"{csv}:1: header column {column}",
                          f"expected {expected!r}, found {found!r}")
    assert not out.exists()
    csv.write_text(",".join(CSV_HEADER) + "\n" + src.read_text().replace("\t", ","))
    r = run_cli("-i", csv, "-o", out)
    assert r.exit_code == 0, r.stderr


# ------------------------------------------------------------------------------------------
# a non-empty output directory that is not an unfinished run of this tool


def test_a_non_empty_directory_is_refused_without_overwrite(tmp_path, src):
    """Another dataset's split directory, or a directory of the user's files: refused, untouched."""
    other = tmp_path / "other"
    pp.preprocess([src], other, progress=False, workers=1)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    # (inside another dataset, --overwrite or not: refused as such, test_audit_sweepbranch.py)
    for out, said in [(other / "train", (f"--output {other / 'train'} is inside the dataset {other}",)),
                      (mine, (f"{mine} is not empty (notes.txt", "--overwrite"))]:
        before = {str(p): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
        assert_one_line_error(run_cli("-i", src, "-o", out), *said)
        assert {str(p): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    r = run_cli("-i", src, "-o", mine, "--overwrite")
    assert r.exit_code == 0, r.stderr
    assert (mine / "notes.txt").read_text() == "mine" and read_metadata(mine).splits["train"].rows > 0


def test_an_interrupted_run_still_resumes_and_empty_directories_of_a_killed_start_are_reused(tmp_path, src):
    out = tmp_path / "ds"
    with pytest.raises(pp._Interrupted):
        pp.preprocess([src], out, chunk_rows=20, _max_new_chunks=1, progress=False, workers=1)
    r = run_cli("-i", src, "-o", out, "--chunk-rows", "20")
    assert r.exit_code == 0, r.stderr
    killed = tmp_path / "killed"  # a run killed right after making its directories, before its manifest
    for name in ("_progress", "train", "validation", "test"):
        (killed / name).mkdir(parents=True)
    r = run_cli("-i", src, "-o", killed)
    assert r.exit_code == 0, r.stderr


# ------------------------------------------------------------------------------------------
# Ctrl-C


@pytest.mark.parametrize("records", [0, 2])  # as the chunks start (feeder thread starting), or mid-way
def test_ctrl_c_with_worker_processes_is_one_line_and_prompt(tmp_path, records):
    """SIGINT to the whole process group (as a terminal's Ctrl-C) with 2 workers: only the main
    process handles it (no worker traceback), the pool shuts down, exit 130 promptly (no hang at
    exit), and the same command resumes."""
    src = tmp_path / "big.tsv"
    src.write_text(raw_lines(40_000))
    out = tmp_path / "ds"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "dlrm.preprocess", "--no-progress", str(src), "-o", str(out), "--chunk-rows", "1000",
           "--workers", "2"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    done = out / pp.PROGRESS_DIR / "done.jsonl"
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        if done.is_file() and len(done.read_bytes().splitlines()) >= records:
            break
        time.sleep(0.005)
    assert proc.poll() is None, "finished before it could be interrupted"
    os.killpg(proc.pid, signal.SIGINT)
    try:
        _, stderr = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"still running 30 s after Ctrl-C: {proc.communicate()[1]}")
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    errors = [x for x in stderr.splitlines() if x.startswith("error: ")]
    if (out / pp.PROGRESS_DIR / "manifest.json").is_file():  # a chunk finished before the interrupt
        assert errors == ["error: interrupted; the same command resumes from the finished chunks"], stderr
    else:  # (records=0: it may come first) the run removed what it made
        assert records == 0 and not out.exists(), stderr
        assert errors == ["error: interrupted before any chunk was finished (nothing was kept); the same command "
                          "starts over"], stderr
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert read_metadata(out).splits["train"].rows > 0


def test_ctrl_c_once_the_dataset_is_complete_says_so(tmp_path, src, monkeypatch):
    """An interrupt after metadata.json was written: exit 130 (a calling script stops), with a line
    saying the dataset is complete, not that it should be resumed."""
    out = tmp_path / "ds"

    def report(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(pp_run, "_report", report)
    assert_one_line_error(run_cli("-i", src, "-o", out), f"after the dataset in {out} was complete", code=130)
    assert read_metadata(out).splits["train"].rows > 0 and not (out / pp.PROGRESS_DIR).exists()
