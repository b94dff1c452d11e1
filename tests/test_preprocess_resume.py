"""Tests of `dlrm.data.preprocess`'s output directory: an existing dataset or other options refused, and an
interrupted run (stopped, killed, a damaged shard) resumed to the dataset an uninterrupted run writes.

Moved from tests/test_preprocess.py (2026-12-02: that file was over 600 lines); its helpers stay there.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dlrm.data import preprocess as pp
from dlrm.data.schema import read_metadata
from tests.conftest import REPO
from tests.test_preprocess import FAST, _with_bad_line, assert_same_dataset, make_fields, run_cli, write_raw

def test_refuses_existing_dataset_and_different_options(tmp_path):
    src = write_raw(tmp_path / "a.tsv", make_fields(200, seed=1))
    out = tmp_path / "ds"
    pp.preprocess([src], out, **FAST)
    r = run_cli(["-i", str(src), "-o", str(out)])
    assert r.exit_code == 2 and "already holds a complete dataset" in r.stderr
    # an unfinished run with other options
    with pytest.raises(pp._Interrupted):
        pp.preprocess([src], out, overwrite=True, chunk_rows=40, _max_new_chunks=2, **FAST)
    r = run_cli(["-i", str(src), "-o", str(out), "--chunk-rows", "50", "--split", "random"])
    assert r.exit_code == 2
    assert "chunk-rows: 40 (earlier run) vs 50 (now)" in r.stderr and "split: 'sequential'" in r.stderr
    r = run_cli(["-i", str(src), "-o", str(out), "--chunk-rows", "50", "--overwrite", "--workers", "1"])
    assert r.exit_code == 0, r.output
    assert read_metadata(out).extra["options"]["chunk_rows"] == 50


@pytest.mark.parametrize("checkpoint_interval", [0.0, 1e9])
def test_resume_after_interruption_is_identical(tmp_path, checkpoint_interval):
    """Interrupted runs (like a kill: later results unrecorded, with or without a statistics
    checkpoint) resume to the same bytes as an uninterrupted run."""
    rows = make_fields(1200, seed=12, pool=30)
    files = [write_raw(tmp_path / "a.tsv", rows[:700]), write_raw(tmp_path / "b.tsv.gz", rows[700:], gz=True)]
    kw = dict(chunk_rows=100, hashing="vocabulary", min_frequency=2, checkpoint_interval=checkpoint_interval)
    pp.preprocess(files, tmp_path / "ref", **kw, **FAST)
    out = tmp_path / "ds"
    done = out / pp.PROGRESS_DIR / "done.jsonl"
    for stop_after in (3, 4):
        with pytest.raises(pp._Interrupted):
            pp.preprocess(files, out, _max_new_chunks=stop_after, **kw, **FAST)
        with open(done, "a") as fh:  # a record torn by a kill (no newline)
            fh.write('{"file":0,"chunk":6,"li')
    assert (out / pp.PROGRESS_DIR / "stats.npz").exists() == (checkpoint_interval == 0)
    records = done.read_text().splitlines()
    # the torn record of the first run was cut off before the second run appended to the file
    assert len(records) == 8 and [json.loads(r)["chunk"] for r in records[:7]] == [0, 1, 2, 3, 4, 5, 6]
    assert records[-1] == '{"file":0,"chunk":6,"li'
    (out / "train" / ".part-0001-000004.parquet.123.tmp").write_bytes(b"half")  # left by a kill
    pp.preprocess(files, out, **kw, **FAST)
    assert_same_dataset(out, tmp_path / "ref")


@pytest.mark.parametrize("damage", ["truncated", "data overwritten"])
def test_resume_redoes_a_damaged_shard(tmp_path, damage):
    """A recorded shard damaged after its run was interrupted (truncated: no footer; or its data
    overwritten, the footer intact, found when the statistics are re-read) is redone like a
    missing one: the resumed run ends with the same bytes as an uninterrupted run."""
    src = write_raw(tmp_path / "a.tsv", make_fields(600, seed=21))
    kw = dict(chunk_rows=100, checkpoint_interval=1e9, **FAST)  # no checkpoint: every train shard is re-read
    pp.preprocess([src], tmp_path / "ref", **kw)
    out = tmp_path / "ds"
    with pytest.raises(pp._Interrupted):
        pp.preprocess([src], out, _max_new_chunks=3, **kw)
    shard = out / "train" / "part-0000-000001.parquet"
    data = bytearray(shard.read_bytes())
    if damage == "truncated":
        del data[100:]
    else:
        data[4 : len(data) // 2] = bytes(len(data) // 2 - 4)
    shard.write_bytes(bytes(data))
    pp.preprocess([src], out, **kw)
    assert_same_dataset(out, tmp_path / "ref")


def test_resume_stop_then_skip(tmp_path):
    src, line, *_ = _with_bad_line(tmp_path, "bad_integer")
    out = tmp_path / "ds"
    with pytest.raises(pp.BadLineError):
        pp.preprocess([src], out, chunk_rows=50, **FAST)
    done = (out / pp.PROGRESS_DIR / "done.jsonl").read_text().splitlines()
    assert len(done) == 4
    pp.preprocess([src], out, chunk_rows=50, on_bad_line="skip", **FAST)
    pp.preprocess([src], tmp_path / "ref", chunk_rows=50, on_bad_line="skip", **FAST)
    assert_same_dataset(out, tmp_path / "ref")


@pytest.mark.parametrize("workers", [1, 2])
def test_the_kept_chunks_warning_offers_on_bad_line_skip_after_a_bad_line_only(tmp_path, workers):
    """The warning after a failure that kept finished chunks said "run again with the same inputs and options (or
    --on-bad-line skip) to resume" after Ctrl-C, SIGTERM or a full disk too, where there is no bad line to skip."""
    from loguru import logger

    from dlrm.data.preprocess import worker as pp_worker

    src, *_ = _with_bad_line(tmp_path, "bad_integer")
    warnings: list[str] = []
    handle = logger.add(lambda m: warnings.append(m.record["message"]), level="WARNING")
    try:
        with pytest.raises(pp.BadLineError):
            pp.preprocess([src], tmp_path / "bad", chunk_rows=50, progress=False, workers=workers)
        kept = [w for w in warnings if "finished chunk(s) kept" in w]
        assert len(kept) == 1 and "(or --on-bad-line skip) to resume" in kept[0], warnings

        warnings.clear()
        real, calls = pp_worker._write_shard, []

        def interrupted_at_the_fourth(*a, **k):  # Ctrl-C as the fourth chunk's first shard is written
            calls.append(1)
            if len(calls) == 4:
                raise KeyboardInterrupt
            return real(*a, **k)
        pp_worker._write_shard = interrupted_at_the_fourth
        try:
            with pytest.raises(KeyboardInterrupt):
                pp.preprocess([src], tmp_path / "stopped", chunk_rows=50, progress=False, workers=1)
        finally:
            pp_worker._write_shard = real
        kept = [w for w in warnings if "finished chunk(s) kept" in w]
        assert kept == [f"3 finished chunk(s) kept in {tmp_path / 'stopped'} (no metadata.json: not a dataset yet); "
                        "run again with the same inputs and options to resume, or with --overwrite to start over"], \
            warnings
    finally:
        logger.remove(handle)


def test_kill_and_restart_cli(tmp_path):
    """SIGKILL a 2-worker CLI run after a few shards, run it again: same output as an
    uninterrupted single-process run."""
    rows = make_fields(12_000, seed=13)
    src = write_raw(tmp_path / "train.txt", rows)
    args = ["--chunk-rows", "150", "--row-group-rows", "100", "--no-progress"]
    pp.preprocess([src], tmp_path / "ref", chunk_rows=150, row_group_rows=100, **FAST)
    out = tmp_path / "ds"
    cmd = [sys.executable, "-m", "dlrm.preprocess", "-i", str(src), "-o", str(out), "--workers", "2", *args]
    # the checkout first, the caller's path kept (the GPU machine's packages live on PYTHONPATH)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    log = open(tmp_path / "killed.log", "w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=log, start_new_session=True)
    done = out / pp.PROGRESS_DIR / "done.jsonl"
    deadline = time.monotonic() + 60
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if done.is_file() and len(done.read_bytes().splitlines()) >= 6:
                break
            time.sleep(0.002)
    finally:
        with contextlib.suppress(ProcessLookupError):  # already exited: the assertion below shows its log
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "killed.log").read_text()
    assert not (out / "metadata.json").exists()
    n_done = len(done.read_bytes().splitlines())
    assert 6 <= n_done < 80
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "resuming" in r.stderr
    assert_same_dataset(out, tmp_path / "ref")
    assert sum(s.rows for s in read_metadata(out).splits.values()) == 12_000
