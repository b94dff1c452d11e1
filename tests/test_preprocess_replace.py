"""`python -m dlrm.preprocess --overwrite` of a complete dataset keeps it until the new one is complete.

Before, the old dataset was removed after the count pass: a bad line, Ctrl-C, SIGTERM or a kill in the hours of a
large run's parse pass left the user neither dataset. Now the new one is built in ``OUT/.preprocess-new/`` and
swapped in whole (`dlrm.data.preprocess.replace`), the swap journaled so that a kill inside it is finished by the
next run of that output.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from loguru import logger

import dlrm.data.preprocess as pp
from dlrm.data.preprocess import replace as pp_replace
from dlrm.data.schema import read_metadata
from tests.test_preprocess import FAST, dataset_files, make_fields, run_cli, write_raw

STAGED = (pp_replace.STAGING, pp_replace.ASIDE, pp_replace.JOURNAL)


@pytest.fixture
def log():
    """The messages loguru logs during the test."""
    messages: list[str] = []
    handle = logger.add(lambda m: messages.append(m.record["message"]), level="INFO")
    yield messages
    logger.remove(handle)


@pytest.fixture
def old_and_new(tmp_path):
    """An output holding a complete dataset of one input (and a file of the user's), a second input, and the
    dataset that input makes when written directly (the reference a replacement must equal)."""
    old_src = write_raw(tmp_path / "old.tsv", make_fields(200, seed=1))
    new_src = write_raw(tmp_path / "new.tsv", make_fields(300, seed=2))
    out = tmp_path / "ds"
    pp.preprocess([old_src], out, chunk_rows=50, **FAST)
    (out / "notes.txt").write_text("mine")
    reference = tmp_path / "reference"
    pp.preprocess([new_src], reference, chunk_rows=50, **FAST)
    return out, dataset_files(out), new_src, dataset_files(reference)


def without_staging(files: dict[str, bytes]) -> dict[str, bytes]:
    return {k: v for k, v in files.items() if not k.startswith(STAGED)}


def test_a_stopped_replacement_keeps_the_old_dataset_and_resumes_without_overwrite(old_and_new):
    out, old, new_src, new = old_and_new
    with pytest.raises(pp._Interrupted):  # stands for a kill after two chunks
        pp.preprocess([new_src], out, overwrite=True, chunk_rows=50, _max_new_chunks=2, **FAST)
    assert without_staging(dataset_files(out)) == old  # the old dataset whole, still readable
    assert sum(split.rows for split in read_metadata(out).splits.values()) == 200  # the old input's rows
    assert (out / pp_replace.STAGING / pp.PROGRESS_DIR / "manifest.json").is_file()
    pp.preprocess([new_src], out, chunk_rows=50, **FAST)  # the same inputs and options, without --overwrite
    files = dataset_files(out)
    assert files.pop("notes.txt") == b"mine"
    assert files == new  # byte for byte the dataset of a direct run
    assert not any(os.path.lexists(out / name) for name in STAGED)


def test_overwrite_again_starts_the_replacement_over(old_and_new):
    out, old, new_src, new = old_and_new
    with pytest.raises(pp._Interrupted):
        pp.preprocess([new_src], out, overwrite=True, chunk_rows=40, _max_new_chunks=2, **FAST)
    # other options than the stopped replacement's: refused without --overwrite, started over with it
    r = run_cli(["-i", str(new_src), "-o", str(out), "--chunk-rows", "50", "--workers", "1"])
    assert r.exit_code == 2 and "chunk-rows: 40 (earlier run) vs 50 (now)" in r.stderr, r.output
    assert without_staging(dataset_files(out)) == old
    pp.preprocess([new_src], out, overwrite=True, chunk_rows=50, **FAST)
    assert without_staging(dataset_files(out)) == {**new, "notes.txt": b"mine"}
    assert not any(os.path.lexists(out / name) for name in STAGED)


def test_a_bad_line_in_the_replacement_keeps_the_old_dataset(tmp_path, old_and_new, log):
    """The reported case: a bad line after some chunks finished left the output empty."""
    out, old, _, _ = old_and_new
    rows = make_fields(300, seed=3)
    rows[250][18] = "zz"  # C5 of line 251: not a hex hash, in the run's last chunk
    bad = write_raw(tmp_path / "bad.tsv", rows)
    r = run_cli(["-i", str(bad), "-o", str(out), "--chunk-rows", "50", "--workers", "1", "--overwrite"])
    assert r.exit_code == 2 and f"{bad}:251: column C5: 'zz'" in r.stderr, r.output
    # how to resume: the same command with --overwrite starts over
    assert any("run again with the same inputs and options without --overwrite" in m for m in log), log
    assert any(m.endswith("the dataset there is as it was (a replacement swaps the new one in only once complete)")
               for m in log), log
    assert without_staging(dataset_files(out)) == old
    # skip mode resumes the staged run (stop -> skip is no change of settings) and swaps it in
    r = run_cli(["-i", str(bad), "-o", str(out), "--chunk-rows", "50", "--workers", "1", "--on-bad-line", "skip"])
    assert r.exit_code == 0, r.output
    assert read_metadata(out).extra["bad_lines"]["bad_category"] == 1
    assert (out / "notes.txt").read_text() == "mine" and not any(os.path.lexists(out / n) for n in STAGED)


def test_a_replacement_that_finished_nothing_removes_its_staging_directory(tmp_path, old_and_new):
    out, old, _, _ = old_and_new
    rows = make_fields(30, seed=4)
    rows[3][0] = "2"  # a bad label in the only chunk
    bad = write_raw(tmp_path / "bad.tsv", rows)
    r = run_cli(["-i", str(bad), "-o", str(out), "--workers", "1", "--overwrite"])
    assert r.exit_code == 2 and f"{bad}:4:" in r.stderr, r.output
    assert dataset_files(out) == old and not any(os.path.lexists(out / name) for name in STAGED)


@pytest.mark.parametrize("when", ["finish", "swap"])
def test_ctrl_c_once_the_new_dataset_is_complete_swaps_it_in(old_and_new, monkeypatch, when):
    """Ctrl-C after the staged metadata.json was written (in the summary, or in the swap's first rename): the new
    dataset is complete, so it is swapped in and the run says the dataset is usable."""
    from dlrm.data.preprocess import run as pp_run

    out, _, new_src, new = old_and_new
    if when == "finish":
        def report(*a, **k):
            raise KeyboardInterrupt
        monkeypatch.setattr(pp_run, "_report", report)
    else:
        real_rename, calls = pp_replace._rename, []

        def rename_once_interrupted(src, dst):
            calls.append(src)
            if len(calls) == 1:
                raise KeyboardInterrupt
            real_rename(src, dst)
        monkeypatch.setattr(pp_replace, "_rename", rename_once_interrupted)
    with pytest.raises(pp.InterruptedWhenComplete):
        pp.preprocess([new_src], out, overwrite=True, chunk_rows=50, **FAST)
    assert without_staging(dataset_files(out)) == {**new, "notes.txt": b"mine"}
    assert not any(os.path.lexists(out / name) for name in STAGED)


def _renames(out: Path, new_src: Path) -> int:
    """How many renames a replacement's swap makes (old entries aside, new ones in)."""
    return 2 * sum(1 for n in ("metadata.json", "train", "validation", "test") if (out / n).exists())


@pytest.mark.parametrize("killed_after", range(-1, 8))  # -1: before the journal is written
def test_a_kill_inside_the_swap_is_finished_by_the_next_run(tmp_path, old_and_new, monkeypatch, killed_after, log):
    """A kill after each of the swap's renames: the output is never a complete-looking mix of the two datasets (it
    holds metadata.json only with the old dataset whole or the new one whole), and the next run of the output
    finishes the swap, then does what it was asked (here: refuses, as a complete dataset is there)."""
    out, old, new_src, new = old_and_new
    assert _renames(out, new_src) == 8

    class Killed(BaseException):  # not an Exception, not a KeyboardInterrupt: nothing handles it, as a SIGKILL
        pass

    real_rename, calls = pp_replace._rename, []

    def rename_then_die(src, dst):
        if len(calls) == killed_after:
            raise Killed
        calls.append(src)
        real_rename(src, dst)

    def journal_then_die(*a, **k):
        raise Killed

    monkeypatch.setattr(pp_replace, "_rename", rename_then_die)
    if killed_after == -1:
        monkeypatch.setattr(pp_replace, "write_json_atomic", journal_then_die)
    with pytest.raises(Killed):
        pp.preprocess([new_src], out, overwrite=True, chunk_rows=50, **FAST)
    monkeypatch.undo()
    left = without_staging(dataset_files(out))
    if "metadata.json" in left:
        assert left in (old, {**new, "notes.txt": b"mine"})
    r = run_cli(["-i", str(new_src), "-o", str(out), "--chunk-rows", "50", "--workers", "1"])
    assert r.exit_code == 2 and "already holds a complete dataset" in r.stderr, r.output
    assert any("finished replacing the dataset" in m for m in log), log
    assert without_staging(dataset_files(out)) == {**new, "notes.txt": b"mine"}
    assert not any(os.path.lexists(out / name) for name in STAGED)


def test_interrupt_message_of_an_overwrite_run_says_to_resume_without_it(tmp_path, monkeypatch):
    """SIGTERM / Ctrl-C of a run with --overwrite: "the same command resumes" was wrong, as the same command
    (--overwrite) starts over; the line now says to leave --overwrite out."""
    from dlrm.data.preprocess import worker as pp_worker

    src = write_raw(tmp_path / "a.tsv", make_fields(60, seed=5))
    out = tmp_path / "ds"
    real, calls = pp_worker._write_shard, []

    def interrupted_in_the_second_chunk(*a, **k):  # the first chunk (its one train shard) finished
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)
    monkeypatch.setattr(pp_worker, "_write_shard", interrupted_in_the_second_chunk)
    args = ["-i", str(src), "-o", str(out), "--workers", "1", "--chunk-rows", "20"]
    r = run_cli([*args, "--overwrite"])
    assert r.exit_code == 130
    assert "error: interrupted; the same command without --overwrite resumes from the finished chunks" in r.stderr
    monkeypatch.undo()
    r = run_cli(args)  # as the line advises
    assert r.exit_code == 0, r.stderr
    assert sum(split.rows for split in read_metadata(out).splits.values()) == 60


def test_an_overwrite_interrupted_before_its_first_chunk_says_the_old_dataset_is_whole(tmp_path, monkeypatch):
    """Ctrl-C / SIGTERM of an --overwrite of a complete dataset before the replacement finished a chunk: the line said
    "the same command without --overwrite resumes from the finished chunks", but nothing was left to resume and that
    command was refused ("already holds a complete dataset ...; use --overwrite")."""
    from dlrm.data.preprocess import worker as pp_worker

    old_src = write_raw(tmp_path / "old.tsv", make_fields(60, seed=4))
    new_src = write_raw(tmp_path / "new.tsv", make_fields(60, seed=5))
    out = tmp_path / "ds"
    pp.preprocess([old_src], out, **FAST)
    old = dataset_files(out)

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(pp_worker, "_write_shard", interrupted)
    args = ["-i", str(new_src), "-o", str(out), "--workers", "1"]
    r = run_cli([*args, "--overwrite"])
    assert r.exit_code == 130
    assert (f"error: interrupted before the replacement finished a chunk: {out} holds its dataset as it was; the same "
            "command (with --overwrite) starts the replacement over") in r.stderr, r.stderr
    assert dataset_files(out) == old
    monkeypatch.undo()
    assert run_cli(args).exit_code == 2  # without --overwrite: refused, as before
    r = run_cli([*args, "--overwrite"])  # what the line advises
    assert r.exit_code == 0, r.stderr
    assert read_metadata(out).extra["inputs"][0]["path"] == str(new_src)


@pytest.mark.parametrize("overwrite", [False, True])
def test_an_interrupt_before_any_chunk_finished_says_nothing_was_kept(tmp_path, monkeypatch, overwrite):
    """Ctrl-C / SIGTERM before the first chunk finished: the run removes what it made, yet the line said "the same
    command resumes from the finished chunks" (there were none)."""
    from dlrm.data.preprocess import worker as pp_worker

    src = write_raw(tmp_path / "a.tsv", make_fields(60, seed=5))
    out = tmp_path / "ds"

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(pp_worker, "_write_shard", interrupted)
    args = ["-i", str(src), "-o", str(out), "--workers", "1"]
    r = run_cli([*args, *(["--overwrite"] if overwrite else [])])
    assert r.exit_code == 130
    assert ("error: interrupted before any chunk was finished (nothing was kept); the same command starts over"
            in r.stderr), r.stderr
    assert not out.exists()
    monkeypatch.undo()
    assert run_cli(args).exit_code == 0


def test_an_overwrite_interrupted_in_its_count_pass_leaves_an_unfinished_run_of_other_settings_as_it_was(
        tmp_path, monkeypatch):
    """Ctrl-C / SIGTERM in the count pass of an --overwrite over an unfinished run of other settings (--chunk-rows):
    nothing was removed yet, but the line said "the same command without --overwrite resumes from the finished
    chunks", which was refused ("an unfinished run with different settings"; with the same settings it would have
    resumed the run --overwrite was given to replace)."""
    from dlrm.data.preprocess import run as pp_run

    src = write_raw(tmp_path / "a.tsv", make_fields(200, seed=6))
    out = tmp_path / "ds"
    with pytest.raises(pp._Interrupted):  # an unfinished run of --chunk-rows 50 (two chunks kept)
        pp.preprocess([src], out, chunk_rows=50, _max_new_chunks=2, **FAST)
    kept = dataset_files(out)

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(pp_run, "_count_pass", interrupted)
    args = ["-i", str(src), "-o", str(out), "--workers", "1", "--chunk-rows", "40", "--overwrite"]
    r = run_cli(args)
    assert r.exit_code == 130
    assert (f"error: interrupted before --overwrite removed or replaced anything: {out} is as it was; the same "
            "command (with --overwrite) starts over") in r.stderr, r.stderr
    assert dataset_files(out) == kept
    monkeypatch.undo()
    assert run_cli(args).exit_code == 0  # what the line advises
    assert sum(split.rows for split in read_metadata(out).splits.values()) == 200


def test_a_stop_as_a_fresh_run_makes_its_folders_leaves_none(tmp_path, monkeypatch):
    """A stop between the new run's first folders (progress, splits) and its taking over the output left them: the
    run did not count them as its own, and the same command was then refused (the output not empty)."""
    from dlrm.data.preprocess import run as pp_run

    src = write_raw(tmp_path / "a.tsv", make_fields(60, seed=7))
    out = tmp_path / "ds"

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(pp_run, "_load_done", interrupted)
    args = ["-i", str(src), "-o", str(out), "--workers", "1"]
    r = run_cli(args)
    assert r.exit_code == 130
    assert "nothing was kept" in r.stderr, r.stderr
    assert not out.exists()
    monkeypatch.undo()
    assert run_cli(args).exit_code == 0, run_cli(args).stderr
