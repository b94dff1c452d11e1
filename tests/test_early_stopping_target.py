"""train.early_stopping.target: stop at the first evaluation that reaches a quality target (MLPerf's time to train).

Tiny real training runs on the CPU (100 train rows, batch 8: 13 steps, an evaluation every 2), config validation and
--resume. Every test fails without the feature (the key was unknown; patience could not be null).
"""

from __future__ import annotations

import json
import time

import pytest
from loguru import logger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dlrm import checkpoint as ckpt
from dlrm.config import ConfigError, load_config
from dlrm.train import evaluator as evaluator_mod
from dlrm.train.trainer import train
from tests.conftest import make_dataset

CONFIG = {
    "data": {"batch_size": 8, "shuffle": True, "drop_last": False, "shuffle_buffer_rows": 40},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "optim": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.05}},
    "train": {"epochs": 1, "log_every": 2, "eval_every": 2, "device": "cpu", "seed": 3, "deterministic": True,
              "baseline": False},
    "checkpoint": {"every": 1000, "keep": 5},
}
STEPS = 13  # 100 rows, batch 8, drop_last false


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("target")
    make_dataset(root / "ds", {"train": 100, "validation": 48, "test": 16}, row_group_size=30)
    return root / "ds"


def config(data, tmp_path, name, early=None, **overrides):
    raw = json.loads(json.dumps(CONFIG))
    raw["data"]["path"] = str(data)
    if early is not None:
        raw["train"]["early_stopping"] = early
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(raw))
    return load_config(path, {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": name, **overrides})


def scripted(values, key="auc"):
    """Evaluations whose `key` values are `values`, in turn."""
    queue = list(values)

    def evaluate(forward, loader, env=None):
        v = queue.pop(0)
        return {"auc": v if key == "auc" else 0.6, "logloss": v if key == "logloss" else 0.5, "accuracy": 0.75}

    evaluate.queue = queue
    return evaluate


def messages():
    seen = []
    handle = logger.add(lambda m: seen.append(m.record["message"]), level="INFO")
    return seen, handle


def written(run_dir):
    """The run's files and their modification times (not .lock, which a resume takes and releases)."""
    return {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file() and p.name != ".lock"}


def checkpoints(tmp_path, name):
    return ckpt.list_checkpoints(tmp_path / "tb" / name)


# -- a run that reaches its target ------------------------------------------------------------------------------------

def test_a_real_run_stops_at_the_first_evaluation_reaching_the_target(data, tmp_path, monkeypatch):
    """The AUCs of a run without a target (evaluations at 2, 4, ..., 12 and 13); with a target between the best before
    a new best and that new best, the identical run stops at the new best's step, says so, records it."""
    aucs, real = [], evaluator_mod.evaluate

    def recording(forward, loader, env=None):
        metrics = real(forward, loader)
        aucs.append(metrics["auc"])
        return metrics
    monkeypatch.setattr(evaluator_mod, "evaluate", recording)
    free = train(config(data, tmp_path, "free"))
    assert free["steps"] == STEPS and len(aucs) == 7
    # the first evaluation (from the 2nd, before the last two) above all earlier ones: the target's stop
    j = next(i for i in range(1, 5) if aucs[i] > max(aucs[:i]))
    target = (max(aucs[:j]) + aucs[j]) / 2
    monkeypatch.setattr(evaluator_mod, "evaluate", real)
    seen, handle = messages()
    try:
        summary = train(config(data, tmp_path, "t", {"metric": "auc", "patience": None, "target": target}))
    finally:
        logger.remove(handle)
    step = 2 * (j + 1)
    assert (summary["steps"], summary["target_reached"], summary["target_step"]) == (step, True, step)
    assert summary["early_stopped"] is True and summary["auc"] == pytest.approx(aucs[j])
    assert 0 < summary["time_to_target_s"] <= summary["wall_s"]
    written = json.loads((tmp_path / "tb" / "t" / "summary.json").read_text())
    assert (written["target_reached"], written["target_step"]) == (True, step)
    last = checkpoints(tmp_path, "t")[-1]
    assert last.name == ckpt.checkpoint_name(step)
    assert ckpt.load_checkpoint(last)["run_stats"]["target"]["step"] == step
    line = next(m for m in seen if m.startswith("reached target"))
    assert f"reached target AUC {target} at step {step} (epoch {step / STEPS:.2f}) after " in line
    assert "s of training (evaluation time excluded) / " in line and " s wall" in line
    events = EventAccumulator(str(tmp_path / "tb" / "t"))
    events.Reload()
    scalars = events.Scalars("train/time_to_target_s")
    assert [s.step for s in scalars] == [step] and scalars[0].value == pytest.approx(summary["time_to_target_s"])


def test_a_logloss_target_stops_at_the_first_logloss_at_or_below_it(data, tmp_path, monkeypatch):
    """metric logloss: reached at logloss <= target (0.45 at step 6), with plateau stopping on as well (patience 3)."""
    monkeypatch.setattr(evaluator_mod, "evaluate", scripted([0.60, 0.50, 0.45, 0.40], key="logloss"))
    summary = train(config(data, tmp_path, "ll", {"metric": "logloss", "target": 0.45}))
    assert (summary["steps"], summary["target_reached"], summary["target_step"]) == (6, True, 6)
    assert summary["best"]["step"] == 6


def test_time_to_target_leaves_the_evaluations_out(data, tmp_path, monkeypatch):
    """Three evaluations of 0.4 s each before the target: training time excludes them, the wall time does not."""
    fake = scripted([0.60, 0.65, 0.70])

    def slow(forward, loader, env=None):
        time.sleep(0.4)
        return fake(forward, loader)
    monkeypatch.setattr(evaluator_mod, "evaluate", slow)
    summary = train(config(data, tmp_path, "slow", {"target": 0.7}))
    assert summary["target_step"] == 6
    state = ckpt.load_checkpoint(checkpoints(tmp_path, "slow")[-1])["run_stats"]
    assert state["target"]["wall_s"] - state["target"]["train_s"] >= 1.2
    assert state["eval_s"] >= 1.2 and summary["time_to_target_s"] == state["target"]["train_s"]


def test_a_run_that_never_reaches_its_target_says_so(data, tmp_path, monkeypatch):
    monkeypatch.setattr(evaluator_mod, "evaluate", scripted([0.6, 0.61, 0.62, 0.63, 0.64, 0.65, 0.66]))
    seen, handle = messages()
    try:
        summary = train(config(data, tmp_path, "never", {"patience": None, "target": 0.9}))
    finally:
        logger.remove(handle)
    assert (summary["steps"], summary["target_reached"], summary["target_step"]) == (STEPS, False, None)
    assert summary["time_to_target_s"] is None and summary["early_stopped"] is False
    assert any(m.startswith(f"target AUC 0.9 not reached in {STEPS} steps; best 0.66000 at step {STEPS}")
               for m in seen)


def test_patience_still_stops_a_run_with_a_target(data, tmp_path, monkeypatch):
    monkeypatch.setattr(evaluator_mod, "evaluate", scripted([0.6, 0.5, 0.5]))
    summary = train(config(data, tmp_path, "plateau", {"patience": 2, "target": 0.9}))
    assert (summary["steps"], summary["early_stopped"], summary["target_reached"]) == (6, True, False)


# -- config -----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("early, message", [
    ({"target": 1.5}, "train.early_stopping.target: 1.5 must be in (0, 1] for metric auc"),
    ({"target": 0.0}, "train.early_stopping.target: 0.0 must be in (0, 1] for metric auc"),
    ({"target": -0.2, "metric": "logloss"}, "train.early_stopping.target: -0.2 must be > 0 for metric logloss"),
    ({"patience": None}, "train.early_stopping: patience and target are both null"),
    ({"patience": None, "target": None}, "train.early_stopping: patience and target are both null"),
    ({"target": "high"}, "train.early_stopping.target: expected a number, got 'high'"),
])
def test_bad_targets_are_refused_in_one_line(data, tmp_path, early, message):
    with pytest.raises(ConfigError) as e:
        config(data, tmp_path, "bad", early)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_patience_defaults_to_3_and_may_be_null_with_a_target(data, tmp_path):
    assert config(data, tmp_path, "a", {"target": 0.8}).train.early_stopping.patience == 3
    early = config(data, tmp_path, "b", {"patience": None, "target": 0.80275}).train.early_stopping
    assert (early.patience, early.target) == (None, 0.80275)
    assert config(data, tmp_path, "c", {"metric": "logloss", "target": 2.5}).train.early_stopping.target == 2.5
    assert config(data, tmp_path, "d", {}).train.early_stopping.target is None


# -- resume -----------------------------------------------------------------------------------------------------------

def test_resuming_a_run_that_reached_its_target_trains_nothing(data, tmp_path, monkeypatch):
    """patience null: the target is the only stop; the checkpoint records it, a resume says so and writes nothing."""
    early = {"patience": None, "target": 0.7}
    monkeypatch.setattr(evaluator_mod, "evaluate", scripted([0.6, 0.7]))
    first = train(config(data, tmp_path, "r", early))
    assert (first["steps"], first["target_step"]) == (4, 4)
    before = written(tmp_path / "tb" / "r")
    monkeypatch.setattr(evaluator_mod, "evaluate", scripted([]))  # an evaluation would fail: none is made
    seen, handle = messages()
    try:
        again = train(config(data, tmp_path, "r", early), resume="latest")
    finally:
        logger.remove(handle)
    assert again["finished"] is True and again["target_step"] == 4 and again["steps"] == 4
    assert any("is where this run reached its target" in m and "step 4" in m for m in seen)
    assert written(tmp_path / "tb" / "r") == before


def test_resuming_a_run_that_reached_its_target_under_min_delta_trains_nothing(data, tmp_path, monkeypatch):
    """0.705 reaches target 0.7 but is no improvement over the best 0.70 (min_delta 0.01): the recorded target, not
    the best, says the run ended there."""
    early = {"patience": 5, "min_delta": 0.01, "target": 0.705}
    monkeypatch.setattr(evaluator_mod, "evaluate", scripted([0.70, 0.705]))
    first = train(config(data, tmp_path, "md", early))
    assert (first["steps"], first["target_step"], first["best"]["step"]) == (4, 4, 2)
    monkeypatch.setattr(evaluator_mod, "evaluate", scripted([]))
    again = train(config(data, tmp_path, "md", early), resume="latest")
    assert again["finished"] is True and len(checkpoints(tmp_path, "md")) == 1


def test_another_target_on_resume_is_refused_like_patience(data, tmp_path, monkeypatch):
    monkeypatch.setattr(evaluator_mod, "evaluate", scripted([0.6, 0.61]))
    train(config(data, tmp_path, "x", {"target": 0.9}, **{"train.max_steps": 4}))
    with pytest.raises(ConfigError, match=r"train\.early_stopping\.target: 0\.9 -> 0\.95.*--allow-config-change"):
        train(config(data, tmp_path, "x", {"target": 0.95}), resume="latest")


def test_a_resumed_run_reaches_its_target_where_the_uninterrupted_one_does(data, tmp_path, monkeypatch):
    """Stopped by train.max_steps at 4 (0.60, 0.62), resumed: 0.64 at 6, 0.71 at 8 reaches 0.7; the clock goes on
    from the first session's training time."""
    early = {"patience": None, "target": 0.7}
    monkeypatch.setattr(evaluator_mod, "evaluate", scripted([0.60, 0.62]))
    first = train(config(data, tmp_path, "c", early, **{"train.max_steps": 4}))
    assert first["target_reached"] is False
    stats = ckpt.load_checkpoint(checkpoints(tmp_path, "c")[-1])["run_stats"]
    assert "target" not in stats and stats["eval_s"] >= 0
    monkeypatch.setattr(evaluator_mod, "evaluate", ev := scripted([0.64, 0.71, 0.5]))
    resumed = train(config(data, tmp_path, "c", early), resume="latest")
    assert ev.queue == [0.5] and (resumed["steps"], resumed["target_step"]) == (8, 8)
    assert resumed["time_to_target_s"] > stats["train_s"] - stats["eval_s"]


def test_a_checkpoint_with_a_malformed_target_record_is_refused_in_one_line(data, tmp_path, monkeypatch):
    """A resume reads run_stats.target and eval_s back: mistyped, they are refused by the schema (naming the key),
    not a traceback at the resume's float()/format."""
    from dlrm import checkpoint_schema as schema
    monkeypatch.setattr(evaluator_mod, "evaluate", scripted([0.6, 0.7]))
    train(config(data, tmp_path, "bad", {"target": 0.7}))
    path = checkpoints(tmp_path, "bad")[-1]
    for key, value in (("target", {"step": "4", "metric": "auc", "value": 0.7, "train_s": 1.0, "wall_s": 2.0}),
                       ("target", {"step": 4, "metric": "auc", "value": "0.7", "train_s": 1.0, "wall_s": 2.0}),
                       ("eval_s", "1.5")):
        disk = schema.to_disk(ckpt.load_checkpoint(path))
        disk["run_stats"][key] = value
        with pytest.raises(ConfigError, match=rf"run_stats\.{key}") as e:
            schema.validate(disk, path)
        assert "\n" not in str(e.value)
