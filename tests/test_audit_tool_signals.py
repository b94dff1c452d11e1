"""SIGTERM (and Ctrl-C) while the data tools run: ``python -m dlrm.data.synthetic``, ``dlrm.data.relayout``,
``dlrm.data.mlperf_import`` and ``dlrm.preprocess``.

Each tool runs in a real subprocess that sends itself the signal at a fixed point of its work (a hook set by
`DRIVER`), so the signal arrives where it would from ``kill`` or a scheduler's stop, deterministically.

1. SIGTERM's default action killed the tool before its Ctrl-C cleanup: the synthetic generator's temporary dataset
   and raw TSV (``.OUT.tmp-*``, ``.raw.tsv.*.tmp``) and relayout's ``.OUT.relayout-*`` stayed beside the output for
   good; exit -15, no line saying what happened.
2. ``--workers N`` (mlperf_import, preprocess): the main process killed by SIGTERM left its pool's worker processes
   running for good (they hold their own call queue open), and with them the caller's stdout/stderr pipes (a
   ``subprocess.run(capture_output=True)`` never returned).
3. preprocess stopped by SIGTERM before its first chunk finished kept its progress records in --output, which refused
   the corrected command ("holds an unfinished run with different settings"); Ctrl-C removes them.
4. mlperf_import stopped (Ctrl-C or SIGTERM) between creating ``.OUT.import-partial`` and writing its plan into it
   refused the very same command from then on ("an unfinished import with other options or input; run that import's
   command again").

Now SIGTERM takes each tool's Ctrl-C path (`dlrm.stop_signal.StopAtOnce(interrupt=True)`): exit 143, one line.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import CHILD_ENV as _CALLER_ENV, REPO
from dlrm.data.schema import NUM_SPARSE, read_metadata

CHILD_ENV = {k: v for k, v in _CALLER_ENV.items() if k != "SIG_AT"}  # the hook only where a test sets it
CARDS = [7 + f for f in range(NUM_SPARSE)]

# The tool, with a hook that sends the signal ($SIG) to this process at $SIG_AT; $PIDS gets the pool's worker pids.
DRIVER = r"""
import os, signal, sys
from pathlib import Path
SIG, AT = int(os.environ["SIG"]), os.environ["SIG_AT"]
def stop():
    os.kill(os.getpid(), SIG)  # arrives as this call returns
def record_pool(module):
    real = module.start_pool
    def start(*a, **k):
        pool = real(*a, **k)
        Path(os.environ["PIDS"]).write_text(" ".join(str(p) for p in pool._processes))
        return pool
    module.start_pool = start
tool = sys.argv[1]
if AT == "set-aside":  # the old --output renamed to .OUT.old-*/OUT by `replace_dir`, the new one not yet in place
    real_replace = os.replace
    def replace(src, dst, *a, **k):
        real_replace(src, dst, *a, **k)
        if ".old-" in Path(dst).parent.name:
            stop()
    os.replace = replace
elif AT == "old-removal":  # the new --output in place, the old one about to be removed
    import shutil
    real_rmtree = shutil.rmtree
    def rmtree(path, *a, **k):
        if ".old-" in Path(path).name and not k.get("ignore_errors"):
            stop()
        return real_rmtree(path, *a, **k)
    shutil.rmtree = rmtree
if tool == "synthetic" and AT != "work":
    from dlrm.data.synthetic import main
elif tool == "synthetic":
    from dlrm.data import synthetic_io
    real_write = synthetic_io._SplitWriter._write
    def write(self, n):
        real_write(self, n)
        if self._writer is None:  # a file is complete
            stop()
    synthetic_io._SplitWriter._write = write
    from dlrm.data.synthetic import main
elif tool == "relayout":
    from dlrm.data import relayout
    real_file = relayout.relayout_file
    def relayout_file(*a, **k):
        rows = real_file(*a, **k)
        stop()
        return rows
    if AT == "work":  # the first file done
        relayout.relayout_file = relayout_file
    main = relayout.main
elif tool == "mlperf":
    from dlrm.data import mlperf_import
    record_pool(mlperf_import)
    if AT == "plan":  # the partial directory made, its plan not yet written
        real_mkdir = Path.mkdir
        def mkdir(self, *a, **k):
            real_mkdir(self, *a, **k)
            if self.name.endswith(".import-partial"):
                stop()
        Path.mkdir = mkdir
    else:  # the first file done
        import concurrent.futures as cf
        real_result = cf.Future.result
        def result(self, *a, **k):
            out = real_result(self, *a, **k)
            stop()
            return out
        cf.Future.result = result
    main = mlperf_import.main
elif tool == "preprocess" and AT == "metadata":  # metadata.json written, the run's last log lines not yet
    from dlrm.data.preprocess import finish
    real_metadata = finish.write_metadata
    def write_metadata(*a, **k):
        real_metadata(*a, **k)
        stop()
    finish.write_metadata = write_metadata
    from dlrm.data.preprocess import main
elif tool == "preprocess":
    from dlrm.data.preprocess import run
    record_pool(run)
    real_pool = run._run_pool
    def run_pool(*a, **k):  # the workers started, no chunk submitted yet
        stop()
        return real_pool(*a, **k)
    run._run_pool = run_pool
    from dlrm.data.preprocess import main
if __name__ == "__main__":
    main(sys.argv[2:])
"""


def run_tool(tmp_path: Path, sig: int, tool: str, *args, at: str = "work") -> tuple[int, str, list[int]]:
    """Run `tool` under `DRIVER` until it exits (output to files: orphaned workers must not hold a pipe open);
    its exit code, its stderr and its pool's worker pids."""
    pids, err = tmp_path / "pids.txt", tmp_path / "stderr.txt"
    with open(err, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-c", DRIVER, tool, *map(str, args)], cwd=REPO, stdout=stderr,
                                stderr=stderr, env={**CHILD_ENV, "SIG": str(int(sig)), "SIG_AT": at, "PIDS": str(pids)})
        code = proc.wait(timeout=120)
    workers = [int(p) for p in pids.read_text().split()] if pids.exists() else []
    return code, err.read_text(), workers


def alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie, exited but not reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def assert_no_workers_left(workers: list[int]) -> None:
    """The pool's workers ended with the tool (those left running are ended here: this test started them)."""
    deadline = time.monotonic() + 10
    while any(alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in workers if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"worker processes {left} still ran after the tool exited"


def assert_one_line(code: int, stderr: str, sig: int, needle: str) -> None:
    """Exit 128 + `sig`, one error line that names the signal (Ctrl-C for SIGINT) and contains `needle`, no traceback."""
    assert code == 128 + sig, f"exit {code}:\n{stderr[-3000:]}"
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if "ERROR" in line or line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], stderr[-3000:]
    if sig == signal.SIGTERM:
        assert "SIGTERM" in errors[0], errors


SIGNALS = [pytest.param(signal.SIGTERM, id="SIGTERM"), pytest.param(signal.SIGINT, id="Ctrl-C")]


def synthetic_args(out: Path, *extra) -> list:
    return ["--rows", 3000, "--rows-per-file", 500, "--cardinalities", "tiny", "--out", out, *extra]


@pytest.mark.parametrize("sig", SIGNALS)
def test_synthetic_stopped_after_its_first_file_leaves_nothing_and_keeps_the_old_output(tmp_path, sig):
    out, tsv = tmp_path / "work" / "out", tmp_path / "work" / "raw.tsv"
    out.mkdir(parents=True)
    (out / "mine.txt").write_text("the user's")
    (out / "metadata.json").write_text("{}")  # a dataset's mark: --overwrite replaces a dataset only
    tsv.write_text("the user's raw lines\n")
    code, stderr, _ = run_tool(tmp_path, sig, "synthetic", *synthetic_args(out, "--overwrite", "--raw-tsv", tsv))
    assert_one_line(code, stderr, sig, "no partial dataset was left behind")
    # was: .out.tmp-* (the files written so far) and .raw.tsv.*.tmp beside them, for good
    assert sorted(p.name for p in out.parent.iterdir()) == ["out", "raw.tsv"]
    assert sorted(p.name for p in out.iterdir()) == ["metadata.json", "mine.txt"] and tsv.read_text() == "the user's raw lines\n"


@pytest.mark.parametrize("sig", SIGNALS)
def test_synthetic_overwrite_stopped_as_the_old_output_is_set_aside_keeps_it(tmp_path, sig):
    out = tmp_path / "work" / "out"
    out.mkdir(parents=True)
    (out / "mine.txt").write_text("the user's")
    (out / "metadata.json").write_text("{}")  # a dataset's mark: --overwrite replaces a dataset only
    code, stderr, _ = run_tool(tmp_path, sig, "synthetic", *synthetic_args(out, "--overwrite"), at="set-aside")
    assert_one_line(code, stderr, sig, "no partial dataset was left behind")
    # was: no out at all, the user's directory left as .out.old-*/out (and the new dataset removed)
    assert [p.name for p in out.parent.iterdir()] == ["out"]
    assert sorted(p.name for p in out.iterdir()) == ["metadata.json", "mine.txt"]


@pytest.mark.parametrize("sig", SIGNALS)
def test_synthetic_overwrite_stopped_as_the_old_output_is_removed_leaves_no_hidden_copy(tmp_path, sig):
    out, tsv = tmp_path / "work" / "out", tmp_path / "work" / "raw.tsv"
    out.mkdir(parents=True)
    (out / "mine.txt").write_text("the user's")
    (out / "metadata.json").write_text("{}")  # a dataset's mark: --overwrite replaces a dataset only
    tsv.write_text("the user's raw lines\n")
    code, stderr, _ = run_tool(tmp_path, sig, "synthetic", *synthetic_args(out, "--overwrite", "--raw-tsv", tsv),
                               at="old-removal")
    assert code == 128 + sig, stderr[-3000:]
    # was: .out.old-*/out, the replaced dataset, for good
    assert sorted(p.name for p in out.parent.iterdir()) == ["out", "raw.tsv"]
    assert sum(s.rows for s in read_metadata(out).splits.values()) == 3000  # the new dataset is complete
    assert len(tsv.read_text().splitlines()) == 3000  # its TSV with it (was: the user's old one beside the new data)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """Written once for the run's workers (`computed_once`: a second worker wrote it again, 1 s in CI); read only."""
    from dlrm.data.synthetic import generate
    from tests.shared_once import computed_once

    def make(root: Path) -> None:
        generate(root / "data", rows=3000, cardinalities="tiny", rows_per_file=500,
                 multi_hot_sizes=",".join(["3", "1", "2"] + ["1"] * (NUM_SPARSE - 3)), sparse_layout="lists")

    return computed_once(tmp_path_factory, "tool-signals-lists", make) / "data"


@pytest.mark.parametrize("sig", SIGNALS)
def test_relayout_stopped_after_its_first_file_leaves_nothing_and_keeps_the_old_output(tmp_path, dataset, sig):
    out = tmp_path / "work" / "out"
    out.mkdir(parents=True)
    (out / "mine.txt").write_text("the user's")
    (out / "metadata.json").write_text("{}")  # a dataset's mark: --overwrite replaces a dataset only
    code, stderr, _ = run_tool(tmp_path, sig, "relayout", "--data", dataset, "--output", out, "--overwrite",
                               "--workers", 1)
    assert_one_line(code, stderr, sig, "--output was not written")
    assert [p.name for p in out.parent.iterdir()] == ["out"]  # was: .out.relayout-* with the first file, for good
    assert sorted(p.name for p in out.iterdir()) == ["metadata.json", "mine.txt"]


@pytest.mark.parametrize("sig", SIGNALS)
def test_relayout_overwrite_stopped_as_the_old_output_is_removed_says_it_is_complete(tmp_path, dataset, sig):
    out = tmp_path / "work" / "out"
    out.mkdir(parents=True)
    (out / "mine.txt").write_text("the user's")
    (out / "metadata.json").write_text("{}")  # a dataset's mark: --overwrite replaces a dataset only
    code, stderr, _ = run_tool(tmp_path, sig, "relayout", "--data", dataset, "--output", out, "--overwrite",
                               "--workers", 1, at="old-removal")
    assert_one_line(code, stderr, sig, "was complete")  # was: "--output was not written" (and .out.old-*/out kept)
    assert [p.name for p in out.parent.iterdir()] == ["out"]
    assert read_metadata(out).sparse_layout == "slots" and not (out / "mine.txt").exists()


def write_mlperf_days(root: Path, days: dict[int, int]) -> None:
    """MLPerf's three files for each day (day -> rows), multi-hot sizes 3, 1, 2, 1, ...."""
    sizes = [3, 1, 2] + [1] * (NUM_SPARSE - 3)
    root.mkdir()
    for i, n in days.items():
        rng = np.random.default_rng(i)
        np.save(root / f"day_{i}_labels.npy", rng.integers(0, 2, (n, 1)).astype(np.int32))
        np.save(root / f"day_{i}_dense.npy", np.log(rng.integers(0, 3000, (n, 13)) + 3.0).astype(np.float32))
        np.savez(root / f"day_{i}_sparse_multi_hot.npz",
                 **{str(f): rng.integers(0, CARDS[f], (n, s)).astype(np.int32) for f, s in enumerate(sizes)})


def mlperf_args(src: Path, out: Path, workers: int) -> list:
    return ["--input", src, "--output", out, "--train-days", "0-1", "--num-embeddings", ",".join(map(str, CARDS)),
            "--rows-per-file", 2, "--workers", workers]


def finish_import(src: Path, out: Path) -> None:
    """The same command again, uninterrupted: it must finish the dataset."""
    from click.testing import CliRunner

    from dlrm.data import mlperf_import

    result = CliRunner().invoke(mlperf_import.main, [str(a) for a in mlperf_args(src, out, 1)])
    assert result.exit_code == 0, result.output
    assert sum(s.rows for s in read_metadata(out).splits.values()) == 6 + 6 + 4
    assert [p.name for p in out.parent.iterdir()] == ["out"]


def test_mlperf_import_sigterm_with_workers_stops_them_and_the_same_command_resumes(tmp_path):
    src, out = tmp_path / "in", tmp_path / "work" / "out"
    write_mlperf_days(src, {0: 6, 1: 6, 23: 4})
    out.parent.mkdir()
    code, stderr, workers = run_tool(tmp_path, signal.SIGTERM, "mlperf", *mlperf_args(src, out, 2))
    assert len(workers) == 2
    assert_no_workers_left(workers)  # was: both still running, minutes after the import was killed
    assert_one_line(code, stderr, signal.SIGTERM, "--output was not written")  # was: exit -15, no line
    assert not out.exists()
    finish_import(src, out)


@pytest.mark.parametrize("sig", SIGNALS)
def test_mlperf_import_stopped_before_its_plan_is_written_does_not_refuse_the_same_command(tmp_path, sig):
    src, out = tmp_path / "in", tmp_path / "work" / "out"
    write_mlperf_days(src, {0: 6, 1: 6, 23: 4})
    out.parent.mkdir()
    code, stderr, _ = run_tool(tmp_path, sig, "mlperf", *mlperf_args(src, out, 1), at="plan")
    assert_one_line(code, stderr, sig, "--output was not written")
    finish_import(src, out)  # was refused: ".out.import-partial: an unfinished import with other options or input"


def write_raw(raw: Path, lines: int = 60) -> None:
    """`lines` Kaggle-format raw lines."""
    rng = np.random.default_rng(0)
    raw.write_text("".join("\t".join([str(rng.integers(0, 2)), *map(str, rng.integers(0, 50, 13)),
                                      *(f"{v:08x}" for v in rng.integers(0, 2**32, 26))]) + "\n" for _ in range(lines)))


@pytest.mark.parametrize("sig", SIGNALS)
def test_preprocess_stopped_as_metadata_is_written_says_the_dataset_is_complete(tmp_path, sig):
    raw, out = tmp_path / "raw.tsv", tmp_path / "out"
    write_raw(raw)
    code, stderr, _ = run_tool(tmp_path, sig, "preprocess", raw, "-o", out, "--workers", 1, "--chunk-rows", 20,
                               "--no-progress", at="metadata")
    # was: "interrupted; the same command resumes from the finished chunks", which then refused to run ("already
    # holds a complete dataset"), and the progress records stayed in the dataset
    assert_one_line(code, stderr, sig, "was complete")
    assert sum(s.rows for s in read_metadata(out).splits.values()) == 60
    assert sorted(p.name for p in out.iterdir()) == ["metadata.json", "test", "train", "validation"]


@pytest.mark.parametrize("sig", SIGNALS)
def test_preprocess_stopped_before_a_chunk_finished_stops_its_workers_and_leaves_nothing(tmp_path, sig):
    raw = tmp_path / "raw.tsv"
    write_raw(raw)
    out = tmp_path / "work" / "out"
    code, stderr, workers = run_tool(tmp_path, sig, "preprocess", raw, "-o", out, "--workers", 2, "--chunk-rows", 20,
                                     "--no-progress")
    assert len(workers) == 2
    assert_no_workers_left(workers)  # was: both still running after the run was killed
    assert_one_line(code, stderr, sig, "interrupted")
    assert not out.exists() and not out.parent.exists()  # was: out/_progress/manifest.json, out/train, ...
    # so that a corrected command (another --hashing) starts afresh; it was refused ("different settings")
    from dlrm.data.preprocess import preprocess

    meta = preprocess([raw], out, workers=1, hashing="vocabulary", progress=False)
    assert sum(s.rows for s in meta.splits.values()) == 60


@pytest.mark.parametrize("sig", SIGNALS)
def test_mlperf_import_overwrite_stopped_as_the_old_output_is_removed_says_it_is_complete(tmp_path, sig):
    src, out = tmp_path / "in", tmp_path / "work" / "out"
    write_mlperf_days(src, {0: 6, 1: 6, 23: 4})
    out.mkdir(parents=True)
    (out / "mine.txt").write_text("the user's")
    (out / "metadata.json").write_text("{}")  # a dataset's mark: --overwrite replaces a dataset only
    code, stderr, _ = run_tool(tmp_path, sig, "mlperf", *mlperf_args(src, out, 1), "--overwrite", at="old-removal")
    # was: "--output was not written" (it was: a rerun was refused as an occupied --output), the plan file left in
    # the dataset, and the replaced --output kept as .out.old-*/out
    assert_one_line(code, stderr, sig, "was complete")
    assert [p.name for p in out.parent.iterdir()] == ["out"]
    assert sum(s.rows for s in read_metadata(out).splits.values()) == 6 + 6 + 4
    assert not (out / "import-plan.json").exists() and not (out / "mine.txt").exists()
