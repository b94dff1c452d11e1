"""`python -m dlrm.data.synthetic --workers N`: the same dataset, byte for byte, from any number of
processes (`dlrm.data.synthetic_chunks`)."""

from __future__ import annotations

import json
import os
from concurrent.futures.process import BrokenProcessPool

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from dlrm.data import synthetic, synthetic_chunks
from dlrm.data.synthetic_chunks import CHUNK_ROWS
from dlrm.data.teacher import Teacher


def without_command(meta: dict) -> dict:
    """Metadata as a dict, less the regenerate command (it names the --out directory)."""
    return {**meta, "extra": {k: v for k, v in meta["extra"].items() if k != "command"}}


def files(root):
    return sorted(p.relative_to(root) for p in root.rglob("*.parquet"))


SMALL_CHUNK = 1 << 12
"""The chunk size of the in-process runs below (`small_chunks`): the property (the same bytes from any number of
processes, chunk boundaries inside files) does not depend on it, the cost does (16x fewer rows than `CHUNK_ROWS` to
make the same number of chunks)."""


@pytest.fixture
def small_chunks(monkeypatch) -> int:
    """`synthetic_chunks.CHUNK_ROWS` set to `SMALL_CHUNK` for this test: `chunks` cuts its plan with it and hands each
    chunk's row count to the pool's workers, so serial and pooled runs use the same chunks."""
    monkeypatch.setattr(synthetic_chunks, "CHUNK_ROWS", SMALL_CHUNK)
    return SMALL_CHUNK


@pytest.fixture
def pools(monkeypatch) -> list[int]:
    """The process count of every pool the chunks are computed in (a serial run makes none): a run that quietly
    computed everything in this process would compare serial against serial."""
    made: list[int] = []
    start_pool = synthetic_chunks.start_pool

    def recorded(workers, *args):
        made.append(workers)
        return start_pool(workers, *args)

    monkeypatch.setattr(synthetic_chunks, "start_pool", recorded)
    return made


def test_workers_write_the_same_dataset(tmp_path, pools, small_chunks):
    rows = 2 * small_chunks + 1234  # three chunks, the last one short
    # 3,000 rows a file (50,000 of 2 x 65,536 + 1,234 rows before): train still spans three files
    one = synthetic.generate(tmp_path / "one", rows, seed=3, cardinalities="tiny", rows_per_file=3_000)
    assert pools == []
    three = synthetic.generate(tmp_path / "three", rows, seed=3, cardinalities="tiny", rows_per_file=3_000,
                               workers=3)
    assert pools == [3]
    assert one.cardinalities == three.cardinalities and one.splits == three.splits
    assert without_command({"extra": one.extra}) == without_command({"extra": three.extra})
    assert files(tmp_path / "one") == files(tmp_path / "three") and len(files(tmp_path / "one")) >= 5
    assert len(one.splits["train"].files) == 3 and sum(s.rows for s in one.splits.values()) == rows
    for rel in files(tmp_path / "one"):
        a, b = pq.read_table(tmp_path / "one" / rel), pq.read_table(tmp_path / "three" / rel)
        assert a.equals(b), rel


@pytest.mark.parametrize("layout", ["slots", "lists"])
def test_workers_multi_hot_and_the_command_line(tmp_path, layout, pools, small_chunks):
    sizes = ",".join(["3", "1"] * 13)
    args = ["--rows", str(small_chunks + 10), "--cardinalities", "tiny", "--multi-hot-sizes", sizes,
            "--multi-hot-fill", "variable", "--test-fraction", "0", "--sparse-layout", layout]
    for name, workers in (("serial", "1"), ("pool", "0")):
        res = CliRunner().invoke(synthetic.main, [*args, "--out", str(tmp_path / name), "--workers", workers])
        assert res.exit_code == 0, res.output
    assert pools == ([2] if (os.cpu_count() or 1) > 1 else [])  # "0": a process a CPU, as many as the 2 chunks
    meta = [json.loads((tmp_path / n / "metadata.json").read_text()) for n in ("serial", "pool")]
    assert without_command(meta[0]) == without_command(meta[1])
    assert meta[0]["schema_version"] == (3 if layout == "slots" else 2)
    for rel in files(tmp_path / "serial"):
        assert pq.read_table(tmp_path / "serial" / rel).equals(pq.read_table(tmp_path / "pool" / rel)), rel
    res = CliRunner().invoke(synthetic.main, [*args, "--out", str(tmp_path / "x"), "--workers", "-1"])
    assert res.exit_code == 2 and "--workers" in res.output


class ExplodingTeacher(Teacher):
    """A teacher whose probabilities fail in the third chunk (module level: the pool unpickles it). The chunk size is
    taken where it is made (this process, `small_chunks`) and pickled with it: a "spawn" worker imports the module's
    own `CHUNK_ROWS`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.chunk_rows = synthetic_chunks.CHUNK_ROWS

    def probability(self, dense, ids):
        if len(ids) < self.chunk_rows:  # the last, short chunk
            raise ValueError("teacher failed in a worker")
        return super().probability(dense, ids)


def test_a_failing_worker_leaves_no_partial_dataset(tmp_path, monkeypatch, pools, small_chunks):
    monkeypatch.setattr(synthetic, "Teacher", ExplodingTeacher)
    with pytest.raises(ValueError, match="teacher failed in a worker"):
        synthetic.generate(tmp_path / "d", 2 * small_chunks + 5, seed=1, cardinalities="tiny", workers=2)
    assert pools == [2]  # the chunks, the failing one too, were computed in the pool
    assert list(tmp_path.iterdir()) == []  # neither the dataset nor its temporary sibling


def test_a_killed_worker_is_one_line_and_exit_4(caplog):
    from loguru import logger

    lines: list[str] = []
    handle = logger.add(lines.append, level="ERROR", format="{message}")
    try:
        assert synthetic._report(BrokenProcessPool("A process in the process pool was terminated")) == 4
    finally:
        logger.remove(handle)
    assert len(lines) == 1 and "--workers process died" in lines[0]


def test_ctrl_c_with_workers_is_one_line_and_leaves_nothing(tmp_path):
    """Ctrl-C signals the whole process group: the workers ignore it (no traceback of theirs), the main process
    stops the pool and removes its temporary dataset. The raw TSV makes the main process the slow one, so the
    workers wait on their queue when the signal comes, where a worker used to die with a traceback."""
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import REPO

    proc = subprocess.Popen([sys.executable, "-m", "dlrm.data.synthetic", "--rows", str(200 * CHUNK_ROWS),
                             "--cardinalities", "tiny", "--workers", "2", "--rows-per-file", "10000",
                             "--out", str(tmp_path / "ds"), "--raw-tsv", str(tmp_path / "raw.tsv")],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group, as a terminal's Ctrl-C reaches
    try:
        deadline = time.monotonic() + 120
        # a written file means the workers have computed a chunk: they are running, their initializer done
        while not list(tmp_path.glob(".ds.tmp-*/train/*.parquet")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else ""
            time.sleep(0.1)
        time.sleep(2)  # the workers fill their look-ahead and wait for the main process
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == synthetic.EXIT_INTERRUPTED, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "interrupted" in errors[0], stderr
    assert list(tmp_path.iterdir()) == []  # neither the dataset nor its temporary sibling
