"""Kills (SIGKILL: the OOM killer, ``kill -9``) of the data tools while they write, and what they leave behind.

1. A tool's main process killed while its ``--workers`` pool ran (`dlrm.data.worker_pool.start_pool`: preprocess,
   the generator, mlperf_import) left the pool's worker processes running for good: reparented, idle on their call
   queue, each holding its memory and the caller's stdout/stderr (``... | tee log`` or
   ``subprocess.run(capture_output=True)`` never returned). SIGTERM and Ctrl-C stop the pool; a kill cannot.
2. mlperf_import killed between creating ``.OUT.import-partial`` and writing its plan into it refused the very same
   command from then on ("an unfinished import with other options or input"), though nothing was imported yet.
3. A killed generator's temporary dataset and TSV, and a killed relayout's temporary copy, stayed beside the output
   for good: no later run of the same output removed them.
4. mlperf_import with one of its --workers killed (the OOM killer) printed BrokenProcessPool's traceback as a bug,
   exit 1, where preprocess and the generator print one line, exit 4.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from click.testing import CliRunner

from dlrm.data import mlperf_import as mi
from dlrm.data.schema import NUM_SPARSE, read_metadata
from tests.conftest import CHILD_ENV, REPO
from tests.test_mlperf_import import CARDS, write_day

_POOL_SCRIPT = """
    import sys, time
    from dlrm.data.worker_pool import start_pool

    if __name__ == "__main__":
        pool = start_pool(2)
        for _ in range(2):
            pool.submit(time.sleep, 30)  # busy workers, as in the middle of a chunk
        print(" ".join(str(p) for p in pool._processes), flush=True)
        time.sleep(30)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


def test_pool_workers_exit_when_the_main_process_is_killed(tmp_path):
    script = tmp_path / "pool.py"
    script.write_text(textwrap.dedent(_POOL_SCRIPT))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=REPO, env=CHILD_ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    workers: list[int] = []
    try:
        workers = [int(p) for p in proc.stdout.readline().split()]
        assert len(workers) == 2
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 20  # a worker still importing exits once its initializer runs
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in workers if _alive(p)]
        assert not left, f"worker processes {left} still run after their main process was killed"
        assert proc.stdout.read() == b""  # EOF: no orphan holds the caller's pipe open
    finally:
        for p in workers:  # this test's own processes only
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()


@pytest.mark.parametrize("torn_plan", [False, True])
def test_mlperf_import_resumes_after_a_kill_before_its_plan_was_written(tmp_path, torn_plan):
    import numpy as np

    src = tmp_path / "in"
    src.mkdir()
    rng = np.random.default_rng(0)
    for i, n in {0: 9, 23: 6}.items():
        write_day(src, i, n, rng)
    out = tmp_path / "out"
    # what a kill between `work.mkdir` and `write_json_atomic(work / PLAN_FILE, ...)` leaves: the directory, empty
    mi.partial_dir(out).mkdir()
    if torn_plan:  # killed inside `write_json_atomic`: its temporary file, half written
        (mi.partial_dir(out) / f".{mi.PLAN_FILE}.x1y2z3.tmp").write_text('{"source": ')
    args = ["--input", src, "--output", out, "--train-days", "0", "--eval-day", "23",
            "--num-embeddings", ",".join(map(str, CARDS)), "--rows-per-file", 4]
    result = CliRunner().invoke(mi.main, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    meta = read_metadata(out)
    assert (meta.splits["train"].rows, meta.splits["validation"].rows, meta.splits["test"].rows) == (9, 3, 3)
    assert len(meta.cardinalities) == NUM_SPARSE
    assert not mi.partial_dir(out).exists()


def test_generator_and_relayout_remove_what_a_killed_run_left_beside_the_output(tmp_path):
    """3. A killed generator left its half-written ``.OUT.tmp-*`` dataset and ``.RAW.*.tmp`` TSV beside --out, a
    killed relayout its ``.OUT.relayout-*``; no later run removed them (one more copy each kill)."""
    from dlrm.data import relayout as rl
    from dlrm.data import synthetic

    out, raw = tmp_path / "ds", tmp_path / "raw.txt"
    stale_ds = tmp_path / ".ds.tmp-k1ll3d_a"  # what a SIGKILL left: a half-written dataset, a torn TSV
    (stale_ds / "train").mkdir(parents=True)
    (stale_ds / "train" / "part-00000.parquet").write_bytes(b"PAR1 torn")
    stale_tsv = tmp_path / ".raw.txt.k1ll3d_b.tmp"
    stale_tsv.write_text("0\t1\t")
    stale_rl = tmp_path / ".copy.relayout-k1ll3d_c"
    (stale_rl / "train").mkdir(parents=True)
    kept = [tmp_path / ".ds.tmp-mine", tmp_path / ".dsx.tmp-k1ll3d_a", tmp_path / ".raw.txt.notes"]  # not of a run
    for p in kept:
        p.write_text("the user's")
    result = CliRunner().invoke(synthetic.main, ["--rows", "40", "--out", str(out), "--raw-tsv", str(raw),
                                                 "--cardinalities", "tiny"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(rl.main, ["--data", str(out), "--output", str(tmp_path / "copy")])
    assert result.exit_code == 0, result.output
    assert read_metadata(tmp_path / "copy").splits["train"].rows == read_metadata(out).splits["train"].rows
    assert len(raw.read_text().splitlines()) == 40
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))
    assert left == sorted(p.name for p in kept), f"left beside the outputs: {left}"



def test_mlperf_import_worker_killed_is_one_line_exit_4_and_resumes(tmp_path, monkeypatch):
    """4. A ``--workers`` process of mlperf_import killed (the OOM killer's usual pick: it maps tens of GB) was
    reported as a bug: BrokenProcessPool's traceback, "this is a bug in dlrm", exit 1. preprocess and the generator
    say it in one line, exit 4 (out of memory: fewer --workers); so does the importer now, and the same command
    resumes."""
    import numpy as np

    src = tmp_path / "in"
    src.mkdir()
    for i, n in {0: 9, 23: 6}.items():
        write_day(src, i, n, np.random.default_rng(i))
    out = tmp_path / "out"
    real = mi.start_pool

    def start_then_kill_one(*a, **k):
        pool = real(*a, **k)
        victim = next(iter(pool._processes))
        os.kill(victim, signal.SIGKILL)
        return pool

    monkeypatch.setattr(mi, "start_pool", start_then_kill_one)
    args = ["--input", src, "--output", out, "--train-days", "0", "--eval-day", "23",
            "--num-embeddings", ",".join(map(str, CARDS)), "--rows-per-file", 2, "--workers", 2]
    result = CliRunner().invoke(mi.main, [str(a) for a in args])
    assert result.exit_code == 4, result.output
    assert "Traceback" not in result.output and "this is a bug" not in result.output, result.output
    assert "fewer --workers" in result.output and not out.exists()
    monkeypatch.setattr(mi, "start_pool", real)
    result = CliRunner().invoke(mi.main, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    assert read_metadata(out).splits["train"].rows == 9
