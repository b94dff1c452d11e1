"""Rough edges of a training run as a user sees it (the run's own config.json given back, a resume at the run's end,
train.min_steps under a smaller max_steps, the wall-clock time to target across resumes, the final line of an early
stop at its best, the progress bar's samples/s)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from loguru import logger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dlrm import checkpoint as ckpt
from dlrm.config import ConfigError, EarlyStoppingConfig, load_config
from dlrm.train.meter import RunStats
from tests.conftest import make_dataset
from tests.test_audit_eval_nits import config_file


@pytest.fixture
def log_lines():
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m).rstrip("\n")), level="INFO", format="{message}")
    yield lines
    logger.remove(sink)


@pytest.fixture
def data(tmp_path):
    root = tmp_path / "ds"
    make_dataset(root, {"train": 64, "validation": 16}, row_group_size=16)
    return root


def _run(config_path, **kw):
    from dlrm.cli import run

    args = dict(config_path=str(config_path), overrides={}, eval_only=False, compare=None, resume=None,
                checkpoint_path=None, export_path=None, allowed_changes=[], loaded=[])
    args.update(kw)
    run(**args)


def _tree(path: Path) -> dict:
    return {str(p.relative_to(path)): p.stat().st_mtime_ns for p in sorted(path.rglob("*")) if p.is_file()}


# -- 1. a run's own config.json given back as --config --------------------------------------------------------------


def test_a_runs_config_json_as_config_names_a_free_run_name_and_fits_the_mode(tmp_path, data):
    from dlrm.train.trainer import train

    train(load_config(config_file(tmp_path, data, max_steps=3, baseline=False)))
    run = tmp_path / "tb" / "r"
    (tmp_path / "tb" / "r-2").mkdir()  # taken by something else: the advice names a free name
    (tmp_path / "tb" / "r-2" / "x").write_text("x")
    before = _tree(run)
    with pytest.raises(ConfigError) as new_run:
        _run(run / "config.json")
    text = str(new_run.value)
    assert "config.json" in text and "--run-name r-3" in text and "--resume" in text, text
    with pytest.raises(ConfigError) as evaluation:
        _run(run / "config.json", eval_only=True, checkpoint_path=str(run))
    text = str(evaluation.value)
    assert "--run-name r-3" in text and "--resume" not in text, text
    assert _tree(run) == before, "the old run was touched"
    # the named way forward works, and writes a new run beside the old one
    _run(run / "config.json", overrides={"log.run_name": "r-3"}, eval_only=True, checkpoint_path=str(run))
    assert (tmp_path / "tb" / "r-3" / "summary.json").is_file() and _tree(run) == before


def test_an_existing_run_name_refused_for_eval_only_does_not_advise_resume(tmp_path, data):
    from dlrm.train.run_dir import RunDirectory

    cfg = load_config(config_file(tmp_path, data, max_steps=3, baseline=False))
    from dlrm.train.trainer import train

    train(cfg)
    with pytest.raises(ConfigError) as refused:
        RunDirectory.create(cfg, evaluation=True)
    assert "--resume" not in str(refused.value) and "--run-name r-2" in str(refused.value)
    with pytest.raises(ConfigError) as training:
        RunDirectory.create(cfg)
    assert "--resume" in str(training.value) and "--run-name r-2" in str(training.value)


# -- 2. a resume at the run's end: no second eval/* point, no second progress bar -------------------------------------


def test_a_resume_at_the_runs_end_writes_no_second_eval_point_nor_bar(tmp_path, data, monkeypatch, capfd):
    from dlrm.errors import TrainingStopped
    from dlrm.train.trainer import train
    from tests.test_audit_review55 import _stop_in_write_best

    path = config_file(tmp_path, data, max_steps=4, eval_every=2, baseline=False)
    raw = json.loads(path.read_text())
    raw["checkpoint"]["every"] = 100  # the run's last checkpoint only: the stop comes after it (`write_best`)
    path.write_text(json.dumps(raw))
    cfg = load_config(str(path))
    restore = _stop_in_write_best(monkeypatch)
    with pytest.raises(TrainingStopped):
        train(cfg)
    restore()
    run = tmp_path / "tb" / "r"
    assert not (run / "summary.json").exists()
    capfd.readouterr()
    summary = train(cfg, resume="latest")
    err = capfd.readouterr().err
    assert summary["steps"] == 4 and (run / "summary.json").is_file()
    events = EventAccumulator(str(run))
    events.Reload()
    steps = [e.step for e in events.Scalars("eval/auc")]
    assert steps.count(4) == 1, steps
    assert err.count("train:") == 0, err  # no step to train: no bar (it was printed twice, at 4/4)


# -- 3. train.min_steps under a smaller --max-steps -------------------------------------------------------------------


def test_min_steps_line_describes_the_steps_that_run(tmp_path, data, log_lines):
    from dlrm.train.trainer import train

    # 64 rows, batch 8: 8 steps an epoch; min_steps 40 (5 epochs), max_steps 12
    summary = train(load_config(config_file(tmp_path, data, max_steps=12, min_steps=40, eval_every=100,
                                            baseline=False)))
    assert summary["steps"] == 12
    said = [line for line in log_lines if line.startswith("train.min_steps")]
    assert len(said) == 1 and "40 steps" not in said[0] and "12 steps" in said[0] and "max_steps 12" in said[0], said
    # the epochs as trained (session 60: "12 steps, 2 epochs of 8 steps" read as 16 steps)
    assert "12 steps, 1 epoch of 8 steps and 4 steps of epoch 2 (train.epochs 1 would give 8)" in said[0], said


def test_min_steps_line_when_max_steps_ends_the_run_within_the_epochs(tmp_path, data, log_lines):
    from dlrm.train.trainer import train

    summary = train(load_config(config_file(tmp_path, data, max_steps=5, min_steps=40, eval_every=100,
                                            baseline=False)))
    assert summary["steps"] == 5
    said = [line for line in log_lines if line.startswith("train.min_steps")]
    assert len(said) == 1 and "40 steps, 5 epochs" not in said[0] and "5 steps" in said[0], said


# -- 4. time_to_target_wall_s across resumes --------------------------------------------------------------------------


def test_wall_time_to_target_adds_earlier_sessions_wall_time_not_their_training_time():
    from dlrm.train.target import TargetTracker

    early = EarlyStoppingConfig(metric="logloss", patience=None, target=10.0)
    stats = RunStats(train_s=500.0)  # earlier sessions trained 500 s (their loops)
    extra: dict = {}
    now = time.perf_counter()
    tracker = TargetTracker(early, {"eval_s": 0.0, "wall_s": 30.0}, stats, now - 2.0, now - 1.0, 8, extra)
    tracker.observe(ckpt.Position(4, 0, 4), {"logloss": 0.5}, 0.0, SimpleNamespace(add_scalar=lambda *a: None))
    wall = tracker.summary(4, None)["time_to_target_wall_s"]
    assert 31.9 < wall < 40.0, wall  # 30 s recorded + this session's ~2 s (it was 500 + 2)


def test_checkpoints_record_the_wall_clock_and_a_resume_continues_it(tmp_path, data):
    from dlrm.train.trainer import train

    cfg = load_config(config_file(tmp_path, data, max_steps=4, baseline=False))
    first = train(cfg)
    state = ckpt.load_checkpoint(ckpt.list_checkpoints(tmp_path / "tb" / "r")[-1])
    wall = state["run_stats"]["wall_s"]
    assert state["run_stats"]["train_s"] <= wall <= first["wall_s"] + 1e-6
    raw = json.loads(Path(config_file(tmp_path, data, max_steps=8, baseline=False)).read_text())
    path = tmp_path / "longer.json"
    path.write_text(json.dumps(raw))
    second = train(load_config(str(path)), resume="latest")
    state = ckpt.load_checkpoint(ckpt.list_checkpoints(tmp_path / "tb" / "r")[-1])
    # the first session's wall clock up to its checkpoint, plus this session's (not its training loop's time)
    assert state["position"]["step"] == 8 and wall < state["run_stats"]["wall_s"] <= wall + second["wall_s"] + 1e-6


def test_summary_always_has_the_wall_time_to_target_key():
    from dlrm.train.target import TargetTracker

    stats, now = RunStats(), time.perf_counter()
    none = TargetTracker(None, {}, stats, now, now, 8, {}).summary(4, None)
    unreached = TargetTracker(EarlyStoppingConfig(metric="auc", patience=None, target=0.99), {}, stats, now, now, 8,
                              {}).summary(4, None)
    assert none["time_to_target_wall_s"] is None and unreached["time_to_target_wall_s"] is None


# -- 5. the final line of a run that stopped early at its best evaluation ---------------------------------------------


def test_final_line_says_early_stopped_when_the_stop_was_at_its_best():
    from dlrm.train.reporting import final_line

    summary = {"split": "validation", "auc": 0.7, "logloss": 0.5, "accuracy": 0.8, "steps": 40, "samples": 320,
               "samples_per_sec": 100.0, "wall_s": 3.0, "early_stopped": True,
               "best": {"step": 40, "metric": "auc", "auc": 0.7, "checkpoint": "tb/r/checkpoints/best.pt"}}
    assert "early stopped" in final_line(summary)
    summary["early_stopped"] = False
    assert "early stopped" not in final_line(summary)


# -- 6. the progress bar's samples/s of a window without a rate of its own -------------------------------------------


def test_bar_shows_no_stale_rate_for_a_window_without_one():
    import torch

    from dlrm.train.meter import DeviceRead, WindowCut
    from dlrm.train.windows import WindowLogging

    class Bar:
        postfix: dict = {}

        def set_postfix(self, refresh=True, **kw):
            self.postfix = kw

    meter = SimpleNamespace(rates=[1234.0], close_window=lambda cut, loss: (None, None))
    logging = WindowLogging()
    logging.meter, logging.env = meter, SimpleNamespace(world_size=1)
    logging.writer = SimpleNamespace(add_scalar=lambda *a: None)
    cut = WindowCut(3, 3, 24, 0.0, 0.0, [], steady=False, done=3)
    values = [torch.tensor(1.5), torch.tensor(-1), 0.1, 0.1]
    logging._pending = (cut, DeviceRead(*values))
    bar = Bar()
    logging._log_window(bar)
    assert "samples_s" not in bar.postfix, bar.postfix
