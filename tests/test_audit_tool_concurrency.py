"""Two runs of one data tool on the same output at once: ``python -m dlrm.preprocess``, ``dlrm.data.synthetic``,
``dlrm.data.mlperf_import`` and ``dlrm.data.relayout``.

A first run (a real subprocess) pauses after its first unit of work (a hook set by `DRIVER`: it writes $READY, then
waits for $GO), so the second run starts while the first is writing, deterministically. Neither tool locked its
output: the second run went ahead and

1. preprocess: resumed the first run's unfinished ``_progress`` records and finished "its" dataset in the directory
   the first one was still writing (and removed ``_progress`` under it);
2. mlperf_import: resumed the first run's ``.OUT.import-partial`` and renamed it into place under the first one;
3. synthetic, relayout (no --overwrite): wrote its dataset, which the first run then silently replaced at its end
   (`replace_dir`), --overwrite never given.

Now each tool holds ``.OUT.lock`` beside its output (`dlrm.data.output_dirs.output_lock`): the second run is refused
in one line naming the first one's pid, and the first finishes as if alone.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import click
import pytest

from tests.conftest import CHILD_ENV as _CALLER_ENV, REPO
from tests.prewarm.launch import real_python
from tests.test_audit_tool_signals import mlperf_args, synthetic_args, write_mlperf_days, write_raw
from dlrm.data.schema import NUM_SPARSE, read_metadata

CHILD_ENV = {k: v for k, v in _CALLER_ENV.items() if k not in ("SIG_AT", "READY", "GO")}

# The tool, paused after its first unit of work: $READY written (its pid), then it waits for $GO to exist.
DRIVER = r"""
import os, sys, time
from pathlib import Path
once = []
def pause():
    if once:
        return
    once.append(1)
    Path(os.environ["READY"]).write_text(str(os.getpid()))
    deadline = time.monotonic() + 60
    while not Path(os.environ["GO"]).exists() and time.monotonic() < deadline:
        time.sleep(0.02)
def after(owner, name):
    real = getattr(owner, name)
    def hooked(*a, **k):
        out = real(*a, **k)
        pause()
        return out
    setattr(owner, name, hooked)
tool = sys.argv[1]
if tool == "preprocess":  # the first chunk recorded in _progress/done.jsonl
    from dlrm.data.preprocess import schedule
    after(schedule._RunState, "handle")
    from dlrm.data.preprocess import main
elif tool == "synthetic":  # the first file of the temporary dataset complete
    from dlrm.data import synthetic_io
    real_write = synthetic_io._SplitWriter._write
    def write(self, n):
        real_write(self, n)
        if self._writer is None:
            pause()
    synthetic_io._SplitWriter._write = write
    from dlrm.data.synthetic import main
elif tool == "mlperf":  # the first file in .OUT.import-partial
    from dlrm.data import mlperf_import
    after(mlperf_import, "_write_file")
    main = mlperf_import.main
elif tool == "relayout":  # the first file rewritten
    from dlrm.data import relayout
    after(relayout, "relayout_file")
    main = relayout.main
main(sys.argv[2:])
"""


class Paused:
    """The first run, started by `DRIVER` and paused after its first unit of work until `resume`."""

    def __init__(self, tmp_path: Path, tool: str, *args) -> None:
        self.ready, self.go, self.err = tmp_path / "ready", tmp_path / "go", tmp_path / "first-stderr.txt"
        with open(self.err, "w") as err:
            # the real interpreter: the lock names the holder's pid, this process's (tests/prewarm/launch.py)
            self.proc = subprocess.Popen([real_python(), "-c", DRIVER, tool, *map(str, args)], cwd=REPO, stdout=err,
                                         stderr=err, env={**CHILD_ENV, "READY": str(self.ready), "GO": str(self.go)})
        deadline = time.monotonic() + 60
        while not self.ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail(f"the first run did not reach its pause (exit {self.proc.wait()}):\n"
                            f"{self.err.read_text()[-3000:]}")
            time.sleep(0.02)

    def resume(self) -> tuple[int, str]:
        """Let it go on; its exit code and stderr."""
        self.go.touch()
        try:
            code = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        return code, self.err.read_text()


@pytest.fixture
def first():
    """The paused first run of a test, never left running (resumed, or killed after a failure)."""
    runs: list[Paused] = []
    yield runs
    for run in runs:
        if run.proc.poll() is None:
            run.go.touch()
            try:
                run.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                run.proc.kill()
                run.proc.wait()


def rows(out: Path) -> int:
    return sum(s.rows for s in read_metadata(out).splits.values())


def test_preprocess_second_run_on_an_output_being_written_is_refused(tmp_path, first):
    from dlrm.data.preprocess import PreprocessError, preprocess

    raw, out = tmp_path / "raw.tsv", tmp_path / "work" / "out"
    write_raw(raw)
    first.append(Paused(tmp_path, "preprocess", raw, "-o", out, "--workers", 1, "--chunk-rows", 20, "--no-progress"))
    # was: "resuming the unfinished run" of the first one, finished in the directory it was still writing
    with pytest.raises(PreprocessError, match=f"--output {out}: in use by pid {first[0].proc.pid} on "):
        preprocess([raw], out, workers=1, chunk_rows=20, progress=False)
    code, stderr = first[0].resume()
    assert code == 0, stderr[-3000:]
    assert rows(out) == 60 and sorted(p.name for p in out.iterdir()) == ["metadata.json", "test", "train", "validation"]
    assert [p.name for p in out.parent.iterdir()] == ["out"]  # the lock file went with the run


def test_synthetic_second_run_of_one_out_is_refused_and_nothing_is_replaced_silently(tmp_path, first):
    from dlrm.data.synthetic import generate

    out = tmp_path / "work" / "out"
    first.append(Paused(tmp_path, "synthetic", *synthetic_args(out, "--seed", 1)))
    # was: the second dataset (seed 2) written, then replaced by the first's at its end, without --overwrite
    with pytest.raises(click.ClickException, match=f"in use by pid {first[0].proc.pid} on "):
        generate(out, rows=3000, cardinalities="tiny", rows_per_file=500, seed=2)
    code, stderr = first[0].resume()
    assert code == 0, stderr[-3000:]
    assert read_metadata(out).extra["seed"] == 1 and rows(out) == 3000
    assert [p.name for p in out.parent.iterdir()] == ["out"]


def test_mlperf_import_second_run_resuming_the_same_partial_import_is_refused(tmp_path, first):
    from click.testing import CliRunner

    from dlrm.data import mlperf_import

    src, out = tmp_path / "in", tmp_path / "work" / "out"
    write_mlperf_days(src, {0: 6, 1: 6, 23: 4})
    first.append(Paused(tmp_path, "mlperf", *mlperf_args(src, out, 1)))
    # was: "resuming the unfinished import" of the first one, renamed into place under it
    result = CliRunner().invoke(mlperf_import.main, [str(a) for a in mlperf_args(src, out, 1)])
    assert result.exit_code == 2 and f"in use by pid {first[0].proc.pid} on " in result.output, result.output
    code, stderr = first[0].resume()
    assert code == 0, stderr[-3000:]
    assert rows(out) == 6 + 6 + 4 and [p.name for p in out.parent.iterdir()] == ["out"]


def test_relayout_second_run_of_one_output_is_refused(tmp_path, first):
    from dlrm.data.relayout import relayout
    from dlrm.data.synthetic import generate

    data, out = tmp_path / "data", tmp_path / "work" / "out"
    generate(data, rows=3000, cardinalities="tiny", rows_per_file=500,
             multi_hot_sizes=",".join(["3", "1", "2"] + ["1"] * (NUM_SPARSE - 3)), sparse_layout="lists")
    first.append(Paused(tmp_path, "relayout", "--data", data, "--output", out, "--workers", 1))
    # was: the second copy written, then silently replaced by the first's at its end, without --overwrite
    with pytest.raises(click.ClickException, match=f"in use by pid {first[0].proc.pid} on "):
        relayout(data, out, "lists", workers=1)
    code, stderr = first[0].resume()
    assert code == 0, stderr[-3000:]
    assert read_metadata(out).sparse_layout == "slots" and rows(out) == 3000
    assert [p.name for p in out.parent.iterdir()] == ["out"]


def test_a_lock_left_by_a_dead_run_is_taken_over_and_removed(tmp_path):
    """(The fix's own guard: the kernel dropped the flock of a run that was killed; its file must not block.)"""
    from dlrm.data.synthetic import generate

    out = tmp_path / "out"
    (tmp_path / ".out.lock").write_text("pid 999999999 on a-host-gone\n")
    generate(out, rows=300, cardinalities="tiny")
    assert rows(out) == 300 and [p.name for p in tmp_path.iterdir()] == ["out"]
