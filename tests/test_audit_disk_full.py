"""Audit: a full disk, a quota or a file-size limit while a run writes its outputs (checkpoints, TensorBoard events,
summary.json, an --export). Each failure is injected at the lowest write call (the file's own `write` under
the buffered file, `os.fsync`, tensorboard's local file system, or a real RLIMIT_FSIZE in a child process), and must
end the run with one ERROR line naming the file and the cause, exit 2, the earlier checkpoints intact and no
temporary files; a --resume after the space is back continues bit for bit."""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess
import sys
import threading
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import dlrm.cli as cli
from dlrm import checkpoint as ckpt
from dlrm.logging_setup import configure_logging
from dlrm.train.run_dir import RunLock
from tests.conftest import CHILD_ENV, REPO, make_dataset, process_output
from tests.test_audit_checkpoint_files import tiny_config, tiny_state

BASE = {
    "data": {"batch_size": 16, "shuffle": True},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "optim": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.05}},
    "train": {"epochs": 1, "log_every": 2, "eval_every": 2, "device": "cpu", "seed": 3, "baseline": False},
    "checkpoint": {"every": 2, "keep": 2},
}  # 128 train rows: 8 steps, a checkpoint every 2


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("disk_full")
    make_dataset(root / "ds", {"train": 128, "validation": 32}, row_group_size=16)
    raw = json.loads(json.dumps(BASE))
    raw["data"]["path"] = str(root / "ds")
    (root / "c.json").write_text(json.dumps(raw))
    return root / "c.json"


@pytest.fixture(autouse=True)
def _restore_logging():
    yield
    configure_logging()  # main() pointed loguru at CliRunner's stream


def train(config: Path, tb: Path, *args: str):
    return CliRunner().invoke(cli.main, ["--config", str(config), "--tb-dir", str(tb), "--run-name", "r", *args])


def one_error_line(result, *needles: str) -> str:
    """Exit 2, no traceback, exactly one ERROR line, holding every needle."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "Exception in thread" not in result.output, result.output
    errors = [line for line in result.output.splitlines() if "ERROR" in line]
    assert len(errors) == 1, result.output
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def fail_nth_file(monkeypatch, match: str, nth: int, code: int, budget: int = 3000) -> None:
    """The `nth` file opened with os.fdopen whose name holds `match` fails with `code` once `budget` bytes are
    written to it: its raw writes (below the BufferedWriter, where the operating system's write fails) raise."""
    real_fdopen, seen = os.fdopen, [0]

    class Full(io.FileIO):
        left = budget

        def write(self, b):
            if len(b) > self.left:
                raise OSError(code, os.strerror(code))
            self.left -= len(b)
            return super().write(b)

    def fdopen(fd, mode="r", *args, **kwargs):
        if "b" in mode and match in os.path.basename(os.readlink(f"/proc/self/fd/{fd}")):
            seen[0] += 1
            if seen[0] == nth:
                return io.BufferedWriter(Full(fd, "wb"))
        return real_fdopen(fd, mode, *args, **kwargs)

    monkeypatch.setattr(os, "fdopen", fdopen)


def leftovers(run: Path) -> list[str]:
    return sorted(p.name for p in run.rglob("*.tmp*"))


# ---------------------------------------------------------------------------------------------
# checkpoints


@pytest.mark.parametrize("code,budget", [(errno.ENOSPC, 12000), (errno.EDQUOT, 12000), (errno.ENOSPC, 3000)])
def test_a_failed_write_inside_torch_save_is_an_os_error_naming_the_checkpoint(tmp_path, monkeypatch, code, budget):
    """torch.save turned the file's failed write into RuntimeError "unexpected pos ..." (budget 12000); with >= 1 GiB
    free (a quota; a large checkpoint's partial temporary just removed) it propagated: a traceback and "this is a
    bug". Failing at the first bytes (3000), it was an OSError naming no file."""
    target = tmp_path / "step-00000006.pt"
    fail_nth_file(monkeypatch, "step-00000006.pt", 1, code, budget)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: namedtuple("u", "total used free")(1 << 42, 0, 1 << 41))
    with pytest.raises(OSError) as e:
        ckpt.write_atomic(target, tiny_state(step=6, cfg=tiny_config(top_mlp=[2048, 1])))
    assert (e.value.errno, e.value.filename) == (code, str(target))
    assert list(tmp_path.iterdir()) == []


def test_a_failed_fsync_names_the_checkpoint(tmp_path, monkeypatch):
    def fsync(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError) as e:
        ckpt.write_atomic(tmp_path / "best.pt", tiny_state())
    assert e.value.filename == str(tmp_path / "best.pt")  # was None: "file system error: No space left on device"
    assert list(tmp_path.iterdir()) == []


def test_a_quota_hit_by_the_second_checkpoint_stops_cleanly_and_resumes_bit_for_bit(tmp_path, monkeypatch, config):
    fail_nth_file(monkeypatch, ".step-00000004.pt", 1, errno.EDQUOT, 20000)
    run = tmp_path / "tb" / "r"
    one_error_line(train(config, tmp_path / "tb"), f"{run}/checkpoints/step-00000004.pt", "Disk quota exceeded")
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["step-00000002.pt"]
    assert leftovers(run) == [] and not (run / "summary.json").exists()
    assert ckpt.load_checkpoint(run / "checkpoints" / "best.pt")["position"]["step"] == 2
    RunLock.acquire(run).release()  # released
    monkeypatch.undo()  # the space is back
    assert train(config, tmp_path / "tb", "--resume").exit_code == 0
    assert train(config, tmp_path / "whole").exit_code == 0
    resumed = ckpt.load_checkpoint(run / "checkpoints" / "step-00000008.pt")
    whole = ckpt.load_checkpoint(tmp_path / "whole" / "r" / "checkpoints" / "step-00000008.pt")
    assert all(torch.equal(resumed["model"][k], whole["model"][k]) for k in whole["model"])
    assert resumed["run_stats"]["train_losses"] == whole["run_stats"]["train_losses"]


def test_merge_to_a_quota_is_one_line(tmp_path, monkeypatch):
    """`python -m dlrm.distributed.merge` catches OSError; the RuntimeError torch.save made of it escaped: traceback."""
    from dlrm.distributed import merge as merge_mod
    from tests.test_audit_checkpoint_files import save_sharded

    manifest = save_sharded(tmp_path / "run", tiny_state(step=4, cfg=tiny_config(top_mlp=[2048, 1])))
    fail_nth_file(monkeypatch, "merged.pt", 1, errno.EDQUOT, 12000)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: namedtuple("u", "total used free")(1 << 42, 0, 1 << 41))
    result = CliRunner().invoke(merge_mod.main, [str(manifest), str(tmp_path / "merged.pt")])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "merged.pt: cannot write (Disk quota exceeded)" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


# ---------------------------------------------------------------------------------------------
# TensorBoard events, summary.json


def test_a_failed_event_file_write_is_one_line_naming_the_event_file(tmp_path, monkeypatch, config):
    """The events are written by tensorboard's thread: it died with a traceback on stderr ("Exception in thread"),
    then the run stopped with "file system error: No space left on device", naming no file."""
    from tensorboard.compat.tensorflow_stub.io import gfile

    real_append, appends, died = gfile.LocalFileSystem.append, [0], []

    def append(self, filename, content, binary_mode=False):
        appends[0] += 1
        if appends[0] >= 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_append(self, filename, content, binary_mode)

    monkeypatch.setattr(gfile.LocalFileSystem, "append", append)
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(args.exc_value))
    result = train(config, tmp_path / "tb")
    events = [p.name for p in (tmp_path / "tb" / "r").glob("events.out.tfevents.*")]
    assert died == []
    one_error_line(result, f"{tmp_path / 'tb' / 'r' / events[0]}: No space left on device")
    RunLock.acquire(tmp_path / "tb" / "r").release()


def test_a_failed_summary_write_names_summary_json_and_a_resume_completes_the_run(tmp_path, monkeypatch, config):
    real_fsync = os.fsync

    def fsync(fd):
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(".summary.json."):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    run = tmp_path / "tb" / "r"
    one_error_line(train(config, tmp_path / "tb"), f"{run / 'summary.json'}: No space left on device")
    assert leftovers(run) == [] and not (run / "summary.json").exists()
    monkeypatch.undo()
    assert train(config, tmp_path / "tb", "--resume").exit_code == 0
    assert json.loads((run / "summary.json").read_text())["steps"] == 8


def test_an_eval_only_summary_that_fails_names_summary_json(tmp_path, monkeypatch, config):
    assert train(config, tmp_path / "tb", "--max-steps", "2").exit_code == 0
    real_fsync = os.fsync

    def fsync(fd):
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(".summary.json."):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    result = CliRunner().invoke(cli.main, ["--config", str(config), "--tb-dir", str(tmp_path / "tb"), "--run-name",
                                           "ev", "--eval-only", "--checkpoint", str(tmp_path / "tb" / "r")])
    one_error_line(result, f"{tmp_path / 'tb' / 'ev' / 'summary.json'}: No space left on device")
    assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == ["r"]  # its new run directory removed


# ---------------------------------------------------------------------------------------------
# --export


EXPORT_CHILD = """
import resource, signal, sys
from dlrm.config import ModelConfig
from dlrm.model.dlrm import build_model
from dlrm.train.export import export_model
model = build_model(ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1]), [5] * 26).eval()
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
resource.setrlimit(resource.RLIMIT_FSIZE, (4000, resource.RLIM_INFINITY))
try:
    export_model(model, sys.argv[1])
except OSError as e:
    print("OSError", e.errno, e.filename)
"""


def test_an_export_that_hits_a_file_size_limit_raises_instead_of_aborting_the_process(tmp_path):
    """Given a path, torch's archive writer failed again writing the archive's end in its destructor, which aborted
    the process (SIGABRT, exit 134: no error line, nothing cleaned up)."""
    out = tmp_path / "m.pt2"
    result = subprocess.run([sys.executable, "-c", EXPORT_CHILD, str(out)], cwd=REPO, env=CHILD_ENV,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, process_output(result)
    assert f"OSError {errno.EFBIG} {out}" in result.stdout, process_output(result)
    assert list(tmp_path.iterdir()) == []


def test_a_file_too_large_is_an_environment_error(tmp_path, monkeypatch, config):
    """EFBIG (a FAT32 disk's 4 GiB limit, `ulimit -f`) was reported as a bug in dlrm (traceback, exit 1)."""
    import dlrm.train.trainer as trainer

    def failing_train(cfg, **kwargs):
        raise OSError(errno.EFBIG, "File too large", str(tmp_path / "tb/r/checkpoints/step-00000004.pt"))

    monkeypatch.setattr(trainer, "train", failing_train)
    one_error_line(train(config, tmp_path / "tb"), "step-00000004.pt: File too large")


# ---------------------------------------------------------------------------------------------
# a run directory removed during the run


def test_a_run_directory_removed_during_the_run_is_not_made_again(tmp_path, monkeypatch, config):
    """The checkpoints' mkdir(parents=True) made it again: the run finished with exit 0, its summary saying "best ...
    kept as .../best.pt" of a file removed with the directory, without config.json or its lock."""
    from dlrm.train.checkpointer import Checkpointer

    real_save, saves = Checkpointer.save, [0]

    def save(self, *args, **kwargs):
        saves[0] += 1
        if saves[0] == 2:  # moved away in one rename: an rmtree raced the TensorBoard thread's writes into it (ENOTEMPTY)
            os.rename(self.run_dir, self.run_dir.with_name("moved-away"))
        return real_save(self, *args, **kwargs)

    monkeypatch.setattr(Checkpointer, "save", save)
    run = tmp_path / "tb" / "r"
    one_error_line(train(config, tmp_path / "tb"), f"{run}: the run directory is gone")
    assert not run.exists()


def test_a_run_directory_removed_under_the_event_writer_is_one_line(tmp_path, monkeypatch, config):
    """Its event file's append failed with FileNotFoundError: a thread traceback, then "this is a bug in dlrm"."""
    from tensorboard.compat.tensorflow_stub.io import gfile

    real_append, appends, died = gfile.LocalFileSystem.append, [0], []

    def append(self, filename, content, binary_mode=False):
        appends[0] += 1
        if appends[0] == 3:
            os.rename(tmp_path / "tb" / "r", tmp_path / "tb" / "moved-away")  # one rename: no race with a checkpoint
        return real_append(self, filename, content, binary_mode)

    monkeypatch.setattr(gfile.LocalFileSystem, "append", append)
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(args.exc_value))
    result = train(config, tmp_path / "tb")
    assert died == []
    one_error_line(result, f"{tmp_path / 'tb' / 'r'}: the run directory is gone")


def test_a_report_set_that_fails_names_its_file(tmp_path, monkeypatch):
    """--compare's and a sweep's reports (`write_files_atomic`): a failed write named no file."""
    real_fsync = os.fsync

    def fsync(fd):
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(".b.md."):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError) as e:
        ckpt.write_files_atomic(tmp_path, {"a.md": "a", "b.md": "b"})
    assert (e.value.errno, e.value.filename) == (errno.ENOSPC, str(tmp_path / "b.md"))
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# profile outputs


def test_a_failed_profile_report_leaves_the_earlier_pair_whole_and_names_the_file(tmp_path, monkeypatch):
    """profile_step.md and profile_timeline.png were written in place: a full disk at the .png left the new .md beside
    a truncated .png (a resumed run's pair replaced half), and the error named no file. (A resumed session's pair is
    one of its own now, named by its profiled step: none of it is written, the earlier pair untouched.)"""
    import builtins

    from dlrm.train import profiling, reporting, trace_summary as ts

    run = tmp_path / "run"
    run.mkdir()
    (run / "profile_step.md").write_text("earlier session")
    (run / "profile_timeline.png").write_bytes(b"earlier png")
    monkeypatch.setattr(profiling, "own_trace", lambda run_dir: run_dir / "trace.pt.trace.json.gz")
    summary = ts.StepSummary("ProfilerStep#2", 1.0, None, 0, 0.0, [], [], run_step=8)
    for name, value in {"load_trace": {}, "summarize_step": summary, "report": "new report",
                        "step_table": "", "top_table": "", "timeline_png": b"\x89PNG" + bytes(10000)}.items():
        monkeypatch.setattr(ts, name, lambda *args, value=value, **kwargs: value)

    class Full(io.FileIO):
        def write(self, b):
            if len(b) > 100:
                raise OSError(errno.ENOSPC, "No space left on device")
            return super().write(b)

    real_open, real_fdopen = io.open, os.fdopen

    def png_open(file, mode="r", *args, **kwargs):
        if str(file).endswith("profile_timeline_8.png") and "w" in mode:
            return io.BufferedWriter(Full(file, "wb"))
        return real_open(file, mode, *args, **kwargs)

    def png_fdopen(fd, mode="r", *args, **kwargs):
        if ".profile_timeline_8.png." in os.readlink(f"/proc/self/fd/{fd}"):
            return io.BufferedWriter(Full(fd, "wb"))
        return real_fdopen(fd, mode, *args, **kwargs)

    monkeypatch.setattr(io, "open", png_open)
    monkeypatch.setattr(builtins, "open", png_open)
    monkeypatch.setattr(os, "fdopen", png_fdopen)
    with pytest.raises(OSError) as e:
        reporting.log_profile(reporting.NoWriter(), run, torch.device("cpu"), 5)
    monkeypatch.undo()
    assert e.value.filename == str(run / "profile_timeline_8.png")
    assert (run / "profile_step.md").read_text() == "earlier session"
    assert (run / "profile_timeline.png").read_bytes() == b"earlier png"
    assert sorted(p.name for p in run.iterdir()) == ["profile_step.md", "profile_timeline.png"]
