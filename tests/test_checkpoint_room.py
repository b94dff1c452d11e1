"""Room on the disk for a run's checkpoints, weighed before its first step (`dlrm.train.checkpoint_room`).

On an H100 machine's 64 GB disk (session 86) configs/mlperf-dcnv2.json resumed beside its 53.2 GB checkpoint trained
its steps, then failed writing the next one ("No space left on device"): every step since the last checkpoint lost.
A run whose disk cannot hold its first checkpoint is now refused before any step (exit 2, one line naming the
directory, the sizes and what to do); one short of a later checkpoint is warned of, naming its step.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
from loguru import logger

from dlrm import checkpoint as ckpt
from dlrm.config import EarlyStoppingConfig, load_config
from dlrm.train import checkpoint_room
from dlrm.train import evaluator as evaluator_mod
from dlrm.train.checkpointer import Checkpointer
from dlrm.train.checkpoint_room import checkpoint_steps, first_short_save
from dlrm.train.trainer import train
from tests.conftest import CHILD_ENV, make_dataset

REPO = Path(__file__).resolve().parents[1]
CONFIG = {
    "data": {"batch_size": 8, "drop_last": False},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "optim": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.05}},
    "train": {"epochs": 1, "log_every": 2, "device": "cpu", "seed": 3, "baseline": False},
    "checkpoint": {"every": 4, "keep": 1},
}  # 100 train rows in batches of 8: 13 steps, checkpoints at 4, 8, 12 and 13
Usage = namedtuple("Usage", "total used free")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt_room")
    make_dataset(root / "ds", {"train": 100, "validation": 16}, row_group_size=30)
    return root / "ds"


def config_file(data: Path, tmp_path: Path, **checkpoint) -> Path:
    raw = json.loads(json.dumps(CONFIG))
    raw["data"]["path"] = str(data)
    raw["checkpoint"].update(checkpoint)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(raw))
    return path


def config(data, tmp_path, name="r", **checkpoint):
    return load_config(config_file(data, tmp_path, **checkpoint),
                       {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": name})


@pytest.fixture
def measured(monkeypatch):
    """The checkpoint size the check weighs (each call's), recorded."""
    sizes = []
    real = checkpoint_room.state_bytes

    def record(model, optimizers):
        sizes.append(real(model, optimizers))
        return sizes[-1]
    monkeypatch.setattr(checkpoint_room, "state_bytes", record)
    return sizes


@pytest.fixture
def caplog_loguru():
    """The messages loguru logs during the test (a callable returning them)."""
    seen = []
    handle = logger.add(lambda m: seen.append(m.record["message"]), level="INFO")
    yield lambda: list(seen)
    logger.remove(handle)


def free_bytes(monkeypatch, free):
    """The disk the check looks at has `free` bytes (a callable: of the checkpoint size)."""
    monkeypatch.setattr(checkpoint_room.shutil, "disk_usage", lambda p: Usage(1 << 40, 0, free()))


@pytest.mark.parametrize("start, total, every, expected", [
    (0, 13, 4, [4, 8, 12, 13]), (0, 12, 4, [4, 8, 12]), (0, 13, None, [13]), (5, 13, 4, [8, 12, 13]),
    (8, 13, 4, [12, 13]), (13, 13, 4, []), (0, 1, 1, [1]), (0, 3, 1, [1, 2, 3]),
])
def test_the_steps_a_run_checkpoints_at(start, total, every, expected):
    assert checkpoint_steps(start, total, every) == expected


@pytest.mark.parametrize("free, existing, keep, expected", [
    (20, 0, 1, None),  # keep 1: each save written beside the one kept, which then goes: two at once
    (10, 0, 1, (8, 0)),  # the first fits, the second finds no room beside it
    (9, 0, 1, (4, 9)),  # short at the first
    (30, 0, 2, None),  # two kept: the third written beside them needs 30 at once
    (29, 0, 2, (12, 9)),
    (25, 0, 3, (12, 5)),
    (10, 1, 1, None),  # resumed beside one checkpoint (its bytes not free): the next is written, then it goes
    (9, 1, 1, (4, 9)),
    (10, 3, 1, None),  # three there, keep 1: the first save deletes all three of them after it
    (10, 2, 3, (8, 0)),  # two there, keep 3: the second save finds the first's bytes taken
])
def test_the_first_save_the_disk_cannot_hold(free, existing, keep, expected):
    assert first_short_save(free, 10, existing, keep, [4, 8, 12, 13]) == expected


def test_a_run_whose_first_checkpoint_cannot_fit_is_refused_before_any_step(data, tmp_path, monkeypatch, measured):
    free_bytes(monkeypatch, lambda: measured[-1] - 1)
    with pytest.raises(OSError) as e:
        train(config(data, tmp_path))
    assert e.value.errno == errno.ENOSPC
    assert e.value.filename == str(tmp_path / "tb" / "r" / "checkpoints")
    text = e.value.strerror
    assert f"no room for the checkpoint at step 4: each checkpoint is {measured[-1] / 1e6:,.1f} MB" in text
    assert f"{(measured[-1] - 1) / 1e6:,.1f} MB would be free" in text and "refused before the first step" in text
    assert "checkpoint.check_room false" in text and "\n" not in text
    assert not (tmp_path / "tb" / "r").exists()  # the new run's directory given up: nothing half written


def test_a_checkpoint_exactly_the_free_bytes_fits(data, tmp_path, monkeypatch, measured):
    free_bytes(monkeypatch, lambda: measured[-1])
    summary = train(config(data, tmp_path, every=None))  # the last step's only
    assert summary["steps"] == 13
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "tb" / "r")] == ["step-00000013.pt"]


def test_the_estimate_is_the_written_files_size(data, tmp_path, measured):
    """The weighed size is the tensors' bytes; the file adds the config, the RNG state and the pickle's framing:
    never less than the estimate, and within a few hundred KB of it (MLPerf's 53.2 GB file, 53,216,395,301 bytes,
    against its 204.2M bf16 rows of 128, their row-wise Adagrad state and the dense layers)."""
    train(config(data, tmp_path, keep=1))
    written = (tmp_path / "tb" / "r" / "checkpoints" / "step-00000013.pt").stat().st_size
    assert measured[-1] <= written <= measured[-1] + 300_000, (measured[-1], written)


def test_short_of_a_later_checkpoint_is_a_warning_naming_its_step(data, tmp_path, monkeypatch, measured, caplog_loguru):
    free_bytes(monkeypatch, lambda: 2 * measured[-1] + 5)  # keep 2: the third save needs three checkpoints' bytes
    summary = train(config(data, tmp_path, keep=2))
    assert summary["steps"] == 13
    lines = [m for m in caplog_loguru() if "no room" in m]
    assert len(lines) == 1 and "no room for the checkpoint at step 12" in lines[0]
    assert "the 2 kept (checkpoint.keep)" in lines[0] and "the run fails at that save" in lines[0]


def test_check_room_false_warns_and_trains(data, tmp_path, monkeypatch, measured, caplog_loguru):
    free_bytes(monkeypatch, lambda: 10)
    cfg = config(data, tmp_path, every=None, check_room=False)
    summary = train(cfg)  # (the real disk has the room)
    assert summary["steps"] == 13
    lines = [m for m in caplog_loguru() if "no room" in m]
    assert len(lines) == 1 and "no room for the checkpoint at step 13" in lines[0]
    assert "going on: checkpoint.check_room is false" in lines[0]


def test_a_resume_in_place_counts_the_checkpoint_already_there(data, tmp_path, monkeypatch, measured):
    """Resumed at step 4 beside its checkpoint, keep 1: step 8's is written beside it: its bytes must be free."""
    cfg = config(data, tmp_path, keep=1)
    cfg.train.max_steps = 4
    train(cfg)
    first = tmp_path / "tb" / "r" / "checkpoints" / "step-00000004.pt"
    before = first.read_bytes()
    free_bytes(monkeypatch, lambda: measured[-1] - 1)
    with pytest.raises(OSError, match="no room for the checkpoint at step 8"):
        train(config(data, tmp_path, keep=1), resume="latest")
    assert first.read_bytes() == before  # the run and its checkpoint as they were
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "tb" / "r")] == ["step-00000004.pt"]
    free_bytes(monkeypatch, lambda: measured[-1])
    assert train(config(data, tmp_path, keep=1), resume="latest")["steps"] == 13


@pytest.fixture
def restores(monkeypatch):
    """The restores a test's runs make (their checkpoints), recorded."""
    made, real = [], Checkpointer.restore

    def record(self, path, run):
        made.append(Path(path).name)
        return real(self, path, run)
    monkeypatch.setattr(Checkpointer, "restore", record)
    return made


def test_a_resume_is_refused_before_the_restore_reads_its_tensors(data, tmp_path, monkeypatch, measured, restores):
    """MLPerf's 53 GB checkpoint took 39 s to read on an H100 machine (session 86) before its resume's refusal: the
    room is weighed at the checkpoint's step before the restore; with room, the resume restores and trains on."""
    cfg = config(data, tmp_path, keep=1)
    cfg.train.max_steps = 4
    train(cfg)
    free_bytes(monkeypatch, lambda: measured[-1] - 1)
    with pytest.raises(OSError, match="no room for the checkpoint at step 8"):
        train(config(data, tmp_path, keep=1), resume="latest")
    assert restores == []
    free_bytes(monkeypatch, lambda: measured[-1])
    assert train(config(data, tmp_path, keep=1), resume="latest")["steps"] == 13
    assert restores == ["step-00000004.pt"]


def early_stopping_run(data, tmp_path, monkeypatch, aucs):
    """A run with train.early_stopping's target 0.7 (patience null) evaluated every 2 steps at `aucs` (scripted),
    stopped after 4 steps (its target reached there, or ``train.max_steps``); returns its config."""
    cfg = config(data, tmp_path, every=None, keep=1)
    cfg.train.eval_every, cfg.train.early_stopping = 2, EarlyStoppingConfig(patience=None, target=0.7)
    queue = list(aucs)
    monkeypatch.setattr(evaluator_mod, "evaluate", lambda forward, loader, env=None: {
        "auc": queue.pop(0), "logloss": 0.5, "accuracy": 0.75})
    first = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=4))
    assert train(first)["steps"] == 4
    return cfg


def test_a_resume_early_stopping_may_have_ended_is_weighed_after_the_restore(data, tmp_path, monkeypatch, measured,
                                                                             restores):
    """With train.early_stopping only the restored totals say whether the run ended: one that did not (its AUCs below
    the target) is refused after the restore, before any step."""
    cfg = early_stopping_run(data, tmp_path, monkeypatch, [0.6, 0.65])
    free_bytes(monkeypatch, lambda: measured[-1] - 1)
    with pytest.raises(OSError, match="no room for the checkpoint at step 13"):
        train(cfg, resume="latest")
    assert restores == ["step-00000004.pt"]


@pytest.mark.parametrize("summary", [True, False])
def test_a_run_early_stopping_ended_trains_no_step_and_needs_no_room(data, tmp_path, monkeypatch, measured, restores,
                                                                     summary):
    """Its target reached at step 4: resumed on a full disk it is finished (summary.json there) or makes its summary
    (summary.json gone: stopped before writing it), training no step and writing no checkpoint: not refused (the
    second was, before session 87)."""
    cfg = early_stopping_run(data, tmp_path, monkeypatch, [0.6, 0.7, 0.7])
    run_dir = tmp_path / "tb" / "r"
    if not summary:
        (run_dir / "summary.json").unlink()
    free_bytes(monkeypatch, lambda: 10)
    again = train(cfg, resume="latest")
    assert again["steps"] == 4 and again.get("finished", False) is summary
    assert restores == ["step-00000004.pt"]
    assert [p.name for p in ckpt.list_checkpoints(run_dir)] == ["step-00000004.pt"]


def test_train_py_says_it_in_one_line_and_exits_2(data, tmp_path):
    """The command line: the disk made "small" by a wrapper that reports 1 MB free (the real one has room)."""
    path = config_file(data, tmp_path)
    wrapper = ("import collections, runpy, shutil, sys; U = collections.namedtuple('U', 'total used free'); "
               "shutil.disk_usage = lambda p: U(1 << 40, 0, 1000); sys.argv = sys.argv[1:]; "
               "runpy.run_path(sys.argv[0], run_name='__main__')")
    # a model of ~3 MB (embedding_dim 4 over the sample's tables): more than the 1 kB said free
    proc = subprocess.run([sys.executable, "-c", wrapper, str(REPO / "train.py"), "--config", str(path),
                           "--tb-dir", str(tmp_path / "tb"), "--run-name", "cli"], capture_output=True, text=True,
                          env=CHILD_ENV, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert f"file system error: {tmp_path / 'tb' / 'cli' / 'checkpoints'}: no room for the checkpoint at step 4" \
        in errors[0]
    assert "Traceback" not in proc.stderr and not (tmp_path / "tb" / "cli").exists()  # nothing half written


class TwoRanks:
    """A torchrun run's process group as the check sees it: this rank and another, whose numbers are `other`'s."""

    distributed, is_main = True, True

    def __init__(self, other):
        self.other = other

    def all_gather_object(self, mine):
        return [mine, self.other(mine)]


@pytest.mark.parametrize("same_disk, refused", [(True, True), (False, False)])
def test_ranks_on_one_file_system_are_weighed_together(tmp_path, monkeypatch, same_disk, refused):
    """Shards of 1 and 2 MB on one host's disk with 2.5 MB free: the first save needs 3, refused on every rank with
    the two shards' size; on two disks (another device, 2.5 MB free each) each shard fits."""
    monkeypatch.setattr(checkpoint_room, "state_bytes", lambda model, optimizers: 1_000_000)
    free_bytes(monkeypatch, lambda: 2_500_000)
    env = TwoRanks(lambda m: (m[0], m[1] if same_disk else m[1] + 1, 2_000_000, 2_500_000))
    check = lambda: checkpoint_room.check_checkpoint_room(tmp_path, 1, None, 0, 10, None, (), env)  # noqa: E731
    if not refused:
        check()
        return
    with pytest.raises(OSError, match=r"no room for the ranks' shards of the checkpoint at step 10: each checkpoint "
                                      r"is 3\.0 MB, .* and 2\.5 MB would be free"):
        check()
