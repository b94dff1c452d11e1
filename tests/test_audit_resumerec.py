"""What a resumed run records (audit of summary.json, TensorBoard HParams and the run files across resumes).

1. A run resumed with changed settings (a larger train.max_steps, an allowed optim.dense.lr) showed the first
   session's hyperparameters in TensorBoard's HParams: the dashboard keeps the first ``_hparams_/session_start_info``
   it reads of a run (the earliest event file's), so the resumed session's values were never shown.
2. summary.json recorded its paths as the run saw them: relative to the working directory with a relative --tb-dir
   (and ``resumed_from`` as typed), so a summary read from elsewhere named files that do not exist.
3. A resumed session replaced summary.json whole: the earlier session's throughput, device, wall time and settings
   were lost without a word; now ``sessions`` lists every session (those that wrote no summary as step ranges).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from dlrm.config import load_config
from dlrm.train.trainer import train
from tests.conftest import make_dataset

CONFIG = {
    "data": {"batch_size": 8},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "optim": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.05}},
    "train": {"epochs": 2, "log_every": 2, "eval_every": 2, "device": "cpu", "seed": 3, "baseline": False},
    "checkpoint": {"every": 2, "keep": 2},
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("resumerec")
    make_dataset(root / "ds", {"train": 64, "validation": 16, "test": 16}, row_group_size=16)
    return root / "ds"


def config(data, tmp_path, tb="tb", name="r1", **overrides):
    raw = json.loads(json.dumps(CONFIG))
    raw["data"]["path"] = str(data)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(raw))
    return load_config(path, {"log.tb_dir": tb, "log.run_name": name, **overrides})


def shown_hparams(run_dir: Path) -> dict:
    """The hparams TensorBoard's HParams dashboard shows for `run_dir` (the first session_start_info it reads), and
    how many session_start_info summaries the run's events hold."""
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    content = acc.SummaryMetadata("_hparams_/session_start_info").plugin_data.content
    info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    return {k: (v.number_value if v.HasField("number_value") else v.string_value) for k, v in info.hparams.items()}


def test_a_resumed_sessions_hparams_are_the_runs_shown(data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    train(config(data, tmp_path, **{"train.max_steps": 4}))
    assert shown_hparams(tmp_path / "tb" / "r1")["dense_lr"] == pytest.approx(0.01)
    resumed = train(config(data, tmp_path, **{"train.max_steps": 8, "optim.dense.lr": 0.02}), resume="latest",
                    allow_config_change=["optim.dense.lr"])
    assert resumed["steps"] == 8
    shown = shown_hparams(tmp_path / "tb" / "r1")
    assert shown["dense_lr"] == pytest.approx(0.02), shown  # was 0.01: the first session's
    # the run's metrics stay one series, the earlier session's scalars untouched by the rewrite
    acc = EventAccumulator(str(tmp_path / "tb" / "r1"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("eval/auc")] == [2, 4, 6, 8]
    assert [e.step for e in acc.Scalars("train/loss")] == [2, 4, 6, 8]
    # both sessions' values stay told apart in summary.json
    sessions = json.loads((tmp_path / "tb" / "r1" / "summary.json").read_text())["sessions"]
    assert [(s["start_step"], s["end_step"]) for s in sessions] == [(0, 4), (4, 8)]
    assert [s["hparams"]["dense_lr"] for s in sessions] == [0.01, 0.02]
    assert sessions[1]["config_changes"] == {"optim.dense.lr": [0.01, 0.02], "train.max_steps": [4, 8]}
    assert sessions[0]["recorded"] and sessions[1]["recorded"] and sessions[1]["samples_per_sec"] is not None


def test_summary_paths_are_absolute_with_a_relative_tb_dir(data, tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    train(config(data, tmp_path, **{"train.max_steps": 4}))
    train(config(data, tmp_path, **{"train.max_steps": 6}), resume="tb/r1/checkpoints/step-00000004.pt")
    monkeypatch.chdir(tmp_path)  # read from elsewhere: every path it names is there
    summary = json.loads((tmp_path / "a" / "tb" / "r1" / "summary.json").read_text())
    paths = [summary[k] for k in ("checkpoint", "run_dir", "best_checkpoint", "resumed_from")]
    paths.append(summary["best"]["checkpoint"])
    paths += [s["resumed_from"] for s in summary["sessions"] if s.get("resumed_from")]
    assert all(os.path.isabs(p) and os.path.exists(p) for p in paths), paths
    assert summary["run_dir"] == str(tmp_path / "a" / "tb" / "r1")
    assert summary["resumed_from"] == str(tmp_path / "a" / "tb" / "r1" / "checkpoints" / "step-00000004.pt")
    monkeypatch.chdir(tmp_path / "a")  # a --resume of the finished run returns its summary, its paths absolute too
    finished = train(config(data, tmp_path, **{"train.max_steps": 6}), resume="latest")
    assert finished["finished"] and finished["run_dir"] == summary["run_dir"]
    assert finished["checkpoint"] == str(tmp_path / "a" / "tb" / "r1" / "checkpoints" / "step-00000006.pt")


def test_a_fresh_runs_summary_paths_are_absolute(data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    summary = train(config(data, tmp_path, **{"train.max_steps": 2}))
    written = json.loads((tmp_path / "tb" / "r1" / "summary.json").read_text())
    assert written["checkpoint"] == summary["checkpoint"] == str(tmp_path / "tb/r1/checkpoints/step-00000002.pt")
    assert written["best_checkpoint"] == str(tmp_path / "tb/r1/checkpoints/best.pt")
    assert [(s["start_step"], s["end_step"], s["resumed_from"]) for s in written["sessions"]] == [(0, 2, None)]


def test_sessions_without_a_summary_are_kept_as_step_ranges(data, tmp_path, monkeypatch):
    """A session stopped before its summary (here: the summary removed, as a kill leaves none) wrote nothing the
    next can carry; its steps are listed, not dropped."""
    monkeypatch.chdir(tmp_path)
    train(config(data, tmp_path, **{"train.max_steps": 2}))
    first = json.loads((tmp_path / "tb" / "r1" / "summary.json").read_text())["sessions"][0]
    train(config(data, tmp_path, **{"train.max_steps": 4}), resume="latest")
    (tmp_path / "tb" / "r1" / "summary.json").unlink()  # the 2..4 session "killed" before its summary
    train(config(data, tmp_path, **{"train.max_steps": 6}), resume="latest")
    train(config(data, tmp_path, **{"train.max_steps": 8}), resume="latest")
    sessions = json.loads((tmp_path / "tb" / "r1" / "summary.json").read_text())["sessions"]
    assert [(s["start_step"], s["end_step"], s["recorded"]) for s in sessions] == \
        [(0, 4, False), (4, 6, True), (6, 8, True)]
    assert first["end_step"] == 2  # (the first session's record went with the summary removed)


def test_an_unreadable_summary_is_said_and_replaced(data, tmp_path, monkeypatch):
    from loguru import logger

    monkeypatch.chdir(tmp_path)
    train(config(data, tmp_path, **{"train.max_steps": 2}))
    (tmp_path / "tb" / "r1" / "summary.json").write_text("{not json")
    lines = []
    sink = logger.add(lambda m: lines.append(str(m)), level="WARNING")
    try:
        train(config(data, tmp_path, **{"train.max_steps": 4}), resume="latest")
    finally:
        logger.remove(sink)
    assert any("summary.json" in line and "earlier sessions" in line for line in lines), lines
    sessions = json.loads((tmp_path / "tb" / "r1" / "summary.json").read_text())["sessions"]
    assert [(s["start_step"], s["end_step"], s["recorded"]) for s in sessions] == [(0, 2, False), (2, 4, True)]


def test_a_damaged_event_file_keeps_its_hparams_and_a_killed_rewrite_is_cleaned_up(data, tmp_path, monkeypatch):
    """The rewrite never loses records: a file that does not read to its end as records is left as it is (said). A
    rewrite killed before its rename leaves a temporary file TensorBoard does not load, removed by the next resume."""
    from loguru import logger

    from dlrm.train.sessions import drop_earlier_hparams

    monkeypatch.chdir(tmp_path)
    train(config(data, tmp_path, **{"train.max_steps": 2}))
    run = tmp_path / "tb" / "r1"
    (events,) = run.glob("events.out.tfevents.*")
    damaged = events.read_bytes()[:-3]  # a torn last record
    events.write_bytes(damaged)
    lines = []
    sink = logger.add(lambda m: lines.append(str(m)), level="WARNING")
    try:
        assert drop_earlier_hparams(run, None) is None
    finally:
        logger.remove(sink)
    assert events.read_bytes() == damaged and any("does not read to its end" in line for line in lines), lines
    events.write_bytes(damaged[:len(damaged) // 2])  # (no hparams left in it: the next session's are the run's)
    stale = run / ".hparams-rewrite.0123abcd.tmp"
    stale.write_bytes(b"x")
    train(config(data, tmp_path, **{"train.max_steps": 4}), resume="latest")
    assert not stale.exists() and not list(run.glob(".*.tmp"))
    assert shown_hparams(run)["batch_size"] == 8


def test_drop_earlier_hparams_removes_only_the_hparams(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    from dlrm.config import Config
    from dlrm.train.reporting import log_hparams
    from dlrm.train.sessions import drop_earlier_hparams

    with SummaryWriter(str(tmp_path)) as w:
        w.add_scalar("train/loss", 0.5, 1)
        log_hparams(w, Config(), 32, {"auc": 0.7, "logloss": 0.5, "accuracy": 0.6}, 1)
        w.add_text("note", "kept", 1)
    (first,) = tmp_path.glob("events.out.tfevents.*")
    before = EventAccumulator(str(first))
    before.Reload()
    assert drop_earlier_hparams(tmp_path, None)["batch_size"] == 32
    after = EventAccumulator(str(first))
    after.Reload()
    assert not [t for t in after.Tags()["tensors"] if t.startswith("_hparams_/")]
    assert [t for t in before.Tags()["tensors"] if not t.startswith("_hparams_/")] == after.Tags()["tensors"]
    assert [(e.step, e.value) for e in after.Scalars("hparam/auc")] == [(1, pytest.approx(0.7))]
    assert [(e.step, e.value) for e in after.Scalars("train/loss")] == [(1, 0.5)]
    assert drop_earlier_hparams(tmp_path, None) is None  # none left: the file as it is


def test_a_resume_without_the_runs_checkpoint_cadence_is_told(data, tmp_path, monkeypatch):
    """A resumed session takes checkpoint.every (and the other free settings) from its own command line: resumed
    without the first one's --checkpoint-every, it saved no checkpoint until its end, and a crash lost everything
    since the resume, without a word. Now the differing settings are said, that one as a warning."""
    from loguru import logger

    monkeypatch.chdir(tmp_path)
    train(config(data, tmp_path, **{"train.max_steps": 2}))
    lines = []
    sink = logger.add(lambda m: lines.append((m.record["level"].name, m.record["message"])), level="INFO")
    try:
        train(config(data, tmp_path, **{"train.max_steps": 4, "checkpoint.every": None, "train.log_every": 1}),
              resume="latest")
    finally:
        logger.remove(sink)
    said = [m for level, m in lines if level == "INFO" and "this session's own settings" in m]
    assert len(said) == 1 and "train.log_every: 2 -> 1" in said[0] and "checkpoint.every: 2 -> null" in said[0], lines
    warned = [m for level, m in lines if level == "WARNING" and "checkpoint.every" in m]
    assert len(warned) == 1 and "only at a signal and at its end" in warned[0] and "--checkpoint-every 2" in warned[0]


def test_an_eval_only_summary_names_its_checkpoint_absolutely(data, tmp_path, monkeypatch):
    from dlrm.train.export import evaluate_checkpoint

    monkeypatch.chdir(tmp_path)
    train(config(data, tmp_path, **{"train.max_steps": 2}))
    summary = evaluate_checkpoint(config(data, tmp_path, name="ev"), Path("tb/r1/checkpoints/best.pt"), "validation")
    written = json.loads((tmp_path / "tb" / "ev" / "summary.json").read_text())
    assert written["checkpoint"] == summary["checkpoint"] == str(tmp_path / "tb/r1/checkpoints/best.pt")
    assert "sessions" not in written  # (an evaluation, not a training session)



def test_a_restart_that_fails_before_its_first_step_keeps_the_stopped_sessions_events(data, tmp_path, monkeypatch):
    """``--resume`` of a run killed before its first checkpoint starts it from step 0 there: the stopped session's
    events were removed as the directory was taken, before anything trained, so a restart that then failed (a first
    step out of memory, a compile error, Ctrl-C) left the run without the only record of the stopped session's curves.
    They go at the first step now, as a reopened branch's do."""
    import shutil

    from dlrm.train.trainer import Trainer

    monkeypatch.chdir(tmp_path)
    train(config(data, tmp_path, **{"train.max_steps": 4}))
    run = tmp_path / "tb" / "r1"
    shutil.rmtree(run / "checkpoints")  # what a kill before the first checkpoint leaves
    (run / "summary.json").unlink()
    stopped = sorted(run.glob("events.out.tfevents.*"))
    assert stopped

    def failing(self):
        raise RuntimeError("first step failed")
        yield  # (a generator, as the loader's)

    with monkeypatch.context() as m:
        m.setattr(Trainer, "_batches", failing)
        with pytest.raises(RuntimeError, match="first step failed"):
            train(config(data, tmp_path, **{"train.max_steps": 4}), resume="latest")
    assert all(p.exists() for p in stopped)  # were removed
    train(config(data, tmp_path, **{"train.max_steps": 4}), resume="latest")
    assert not any(p.exists() for p in stopped)  # trained again: the stopped session's steps would show twice
    acc = EventAccumulator(str(run))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [2, 4]
