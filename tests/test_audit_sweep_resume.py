"""``python -m dlrm.sweep --resume <sweep dir>``: a sweep stopped by Ctrl-C, a signal, a crash or a time limit is
finished in its own directory: finished trials are gathered (not trained again), an interrupted trial resumes from its
checkpoint, one with no checkpoint is trained afresh with what it left moved aside, failed ones are tried again; a
resume whose grid or config differs from sweep.json's record is refused in one line. Real tiny sweeps (4 steps)."""

from __future__ import annotations

import csv
import json
import signal

import pytest
from click.testing import CliRunner

from dlrm.config import ConfigError
from dlrm.errors import NonFiniteLoss, TrainingStopped
from dlrm.logging_setup import configure_logging
from dlrm.sweep import parse_set, run_sweep
from dlrm.train.trainer import Trainer
from dlrm.train.trainer import train as real_train
from tests.conftest import make_dataset
from tests.fastsweep_gc import frozen, frozen_heap  # noqa: F401 (autouse: gc.freeze() around each test)
from tests.test_sweep import BASE

SETS = ["optim.sparse.lr=0.01,0.1"]


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep_resume")
    make_dataset(root / "ds", {"train": 64, "validation": 32}, row_group_size=16)
    raw = json.loads(json.dumps(BASE))
    raw["data"]["path"] = str(root / "ds")
    raw["checkpoint"] = {"every": 2}
    path = root / "tiny.json"
    path.write_text(json.dumps(raw))
    return path


@pytest.fixture(scope="module")
def reference(config, tmp_path_factory):
    """The uninterrupted sweep's AUC per (setting, seed)."""
    tmp = tmp_path_factory.mktemp("reference")
    with frozen():  # as around each test (tests/fastsweep_gc.py): this sweep runs before the autouse fixture starts
        directory, _ = run_sweep(str(config), [parse_set(s) for s in SETS], 2, tb_dir=str(tmp), run_name="ref")
    return aucs(directory)


def aucs(directory):
    return {(r["setting"], r["seed"]): float(r["auc"]) for r in csv.DictReader(open(directory / "trials.csv"))}


def recording(calls, stop_at=None, fail=None):
    """The real trainer, recording (lr, seed, resumed?); SIGTERM during step 2 of trial `stop_at` (lr, seed) as
    `GracefulStop` would see it (the trial checkpoints and raises TrainingStopped); `fail` maps (lr, seed) to an
    exception raised instead of training."""

    def train(cfg, run_dir=None, resume=None):
        key = (cfg.optim.sparse.lr, cfg.train.seed)
        calls.append((*key, resume is not None))
        if fail and key in fail:
            raise fail[key]
        if key == stop_at:
            original = Trainer._stop_requested

            def stop_requested(self, stop):
                if self.pos.step == 2 and stop.signum is None:
                    stop.signum = signal.SIGTERM
                return original(self, stop)

            Trainer._stop_requested = stop_requested
            try:
                return real_train(cfg, run_dir=run_dir, resume=resume)
            finally:
                Trainer._stop_requested = original
        return real_train(cfg, run_dir=run_dir, resume=resume)

    return train


def resume(directory, calls, **kwargs):
    from dlrm.sweep_resume import resume_sweep

    return resume_sweep(directory, train_fn=recording(calls, **kwargs.pop("opts", {})), **kwargs)


def test_a_sweep_stopped_by_a_signal_is_finished_in_its_directory_as_if_never_stopped(tmp_path, config, reference):
    calls = []
    with pytest.raises(TrainingStopped):
        run_sweep(str(config), [parse_set(s) for s in SETS], 2, tb_dir=str(tmp_path), run_name="sw",
                  train_fn=recording(calls, stop_at=(0.1, 0)))
    directory = tmp_path / "sw"
    assert calls == [(0.01, 0, False), (0.01, 1, False), (0.1, 0, False)]
    assert not (directory / "sweep.md").exists() and (directory / "sweep.json").is_file()
    calls.clear()
    out, result = resume(directory, calls)
    assert out == directory
    # the two finished trials are not trained again; the stopped one resumes from its checkpoint; the last is new
    assert calls == [(0.1, 0, True), (0.1, 1, False)]
    rows = list(csv.DictReader(open(directory / "trials.csv")))
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows)
    assert aucs(directory) == pytest.approx(reference)  # bit for bit the uninterrupted sweep's trials
    table = list(csv.DictReader(open(directory / "sweep.csv")))
    assert [r["seeds"] for r in table] == ["2", "2"]
    assert result.text() in (directory / "sweep.md").read_text()
    runs = sorted(p.name for p in (directory / "hparams").iterdir() if p.is_dir())
    assert runs == ["00-sparse.lr=0.01", "01-sparse.lr=0.1"]
    summary = json.loads((directory / "01-sparse.lr=0.1" / "seed-0" / "summary.json").read_text())
    assert summary["resumed_at_step"] == 2 and summary["steps"] == 4
    # resuming a finished sweep trains nothing and writes each table and HParams run once more, not twice
    calls.clear()
    resume(directory, calls)
    assert calls == [] and aucs(directory) == pytest.approx(reference)
    assert all(len(list(p.iterdir())) == 1 for p in (directory / "hparams").iterdir() if p.is_dir())


def test_a_lost_summary_a_trial_without_checkpoint_and_a_failed_trial(tmp_path, config, reference):
    calls = []
    fail = {(0.01, 1): NonFiniteLoss("loss became NaN or Inf at step 3; stopped")}
    with pytest.raises(NonFiniteLoss):
        run_sweep(str(config), [parse_set(s) for s in SETS], 2, tb_dir=str(tmp_path), run_name="sw",
                  train_fn=recording(calls, fail=fail))
    directory = tmp_path / "sw"
    assert "failed: loss became NaN" in (directory / "trials.csv").read_text()
    # a crash between the last checkpoint and summary.json; a trial killed (-9) before its first checkpoint
    (directory / "00-sparse.lr=0.01" / "seed-0" / "summary.json").unlink()
    killed = directory / "01-sparse.lr=0.1" / "seed-1"
    for p in sorted(killed.rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    (killed / "notes.txt").write_text("mine")
    calls.clear()
    resume(directory, calls)
    assert calls == [(0.01, 0, True), (0.01, 1, False), (0.1, 1, False)]  # (0.1, 0) finished: gathered
    assert aucs(directory) == pytest.approx(reference)
    assert (directory / "01-sparse.lr=0.1" / "seed-1.interrupted" / "notes.txt").read_text() == "mine"  # kept
    rows = list(csv.DictReader(open(directory / "trials.csv")))
    assert [r["status"] for r in rows] == ["ok"] * 4
    assert "failed" not in (directory / "sweep.md").read_text()


def test_a_resume_that_differs_from_the_record_is_refused_in_one_line(tmp_path, config):
    from dlrm.sweep import main

    calls = []
    with pytest.raises(KeyboardInterrupt):
        run_sweep(str(config), [parse_set(s) for s in SETS], 2, tb_dir=str(tmp_path), run_name="sw",
                  train_fn=recording(calls, fail={(0.1, 0): KeyboardInterrupt()}))
    directory = tmp_path / "sw"
    before = sorted(str(p) for p in directory.rglob("*"))
    edited = json.loads(config.read_text())
    edited["optim"] = {"dense": {"lr": 0.5}}
    (tmp_path / "edited.json").write_text(json.dumps(edited))
    cases = [
        (["--set", "optim.sparse.lr=0.01,0.03"], "--set optim.sparse.lr=0.01,0.03 (recorded: --set optim.sparse.lr=0.01,0.1)"),
        (["--seeds", "3"], "--seeds 3 (recorded: 2)"),
        (["--config", str(tmp_path / "edited.json")], "differs in optim.dense.lr: 0.001 -> 0.5"),
        (["--device", "auto"], 'differs in train.device: "cpu" -> "auto"'),
        (["--run-name", "x"], "--tb-dir and --run-name do not go with it"),
    ]
    try:
        for extra, message in cases:
            res = CliRunner().invoke(main, ["--resume", str(directory), *extra])
            lines = [line for line in res.output.splitlines() if line.strip()]
            assert res.exit_code == 2 and len(lines) == 1 and message in lines[0], (extra, res.output)
        res = CliRunner().invoke(main, ["--resume", str(tmp_path / "nope")])
        assert res.exit_code == 2 and "no such sweep directory" in res.output
    finally:
        configure_logging()
    assert sorted(str(p) for p in directory.rglob("*")) == before  # nothing written


def test_the_command_resumes_with_the_directory_alone(tmp_path, config, monkeypatch):
    import dlrm.train.trainer as trainer
    from dlrm.sweep import main

    calls = []
    with pytest.raises(KeyboardInterrupt):
        run_sweep(str(config), [parse_set(s) for s in SETS], 1, tb_dir=str(tmp_path), run_name="sw",
                  train_fn=recording(calls, fail={(0.1, 0): KeyboardInterrupt()}))
    calls.clear()
    monkeypatch.setattr(trainer, "train", recording(calls))
    try:
        res = CliRunner().invoke(main, ["--resume", str(tmp_path / "sw"), "--seeds", "1"])
    finally:
        configure_logging()
    assert res.exit_code == 0, res.output
    assert calls == [(0.1, 0, False)]
    assert len(list(csv.DictReader(open(tmp_path / "sw" / "sweep.csv")))) == 2


def test_a_directory_without_a_record_or_in_use_is_refused(tmp_path, config):
    from dlrm.sweep_resume import SweepLock, resume_sweep

    (tmp_path / "old").mkdir()
    with pytest.raises(ConfigError, match="holds no sweep.json"):
        resume_sweep(tmp_path / "old", train_fn=recording([]))
    with pytest.raises(KeyboardInterrupt):
        run_sweep(str(config), [parse_set(s) for s in SETS], 1, tb_dir=str(tmp_path), run_name="sw",
                  train_fn=recording([], fail={(0.1, 0): KeyboardInterrupt()}))
    lock = SweepLock.acquire(tmp_path / "sw")  # another process running it
    try:
        with pytest.raises(ConfigError, match="in use by another sweep process"):
            resume_sweep(tmp_path / "sw", train_fn=recording([]))
    finally:
        lock.release()
