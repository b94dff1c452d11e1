"""A resume with another run length under a learning-rate decay that runs to the run's end (``optim.schedule.decay``
with ``decay_steps`` 0): the decay's end moved with the length, so the learning rate jumped at the resume step (back UP
for a longer run: 0.1x -> 0.7x of the configured rate, resuming a 200-step run's last checkpoint with
``--max-steps 400``), said only as ``run length changed``. The steps already trained followed the old end, the rest
the new: the resumed run is neither run. It is now refused as the project refuses any change that alters the training
trajectory, unless ``--allow-config-change`` names the length key, and then said in one warning with the learning rate
at the resume step before and after and the decay's new end (`dlrm.train.resume_policy.check_schedule_length`). A
schedule that does not depend on the run's length (none, a warm-up, ``decay_steps`` set, a decay starting after the
resume step) says nothing: the resumed run is then the uninterrupted run of the new length.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from loguru import logger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dlrm import checkpoint as ckpt
from dlrm.config import ConfigError, ScheduleConfig, load_config
from dlrm.train.optim import lr_multiplier
from dlrm.train.resume_policy import check_schedule_length
from dlrm.train.trainer import train
from tests.conftest import CHILD_ENV, REPO, make_dataset

DECAY = {"decay": "linear", "decay_start_step": 4, "end_factor": 0.1}  # to the run's end: decay_steps 0
CONFIG = {
    "data": {"batch_size": 8, "shuffle": True, "drop_last": True},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "optim": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.05},
              "schedule": DECAY},
    "train": {"epochs": 3, "log_every": 2, "device": "cpu", "seed": 3, "deterministic": True, "baseline": False},
    "checkpoint": {"every": 1000},
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("schedlen") / "ds"
    make_dataset(root, {"train": 100, "validation": 24}, row_group_size=30)  # 12 steps an epoch at batch 8
    return root


@pytest.fixture
def warnings():
    seen: list[str] = []
    handle = logger.add(lambda m: seen.append(m.record["message"]), level="WARNING")
    yield seen
    logger.remove(handle)


def write_config(data, tmp_path, schedule=None):
    raw = json.loads(json.dumps(CONFIG))
    raw["data"]["path"] = str(data)
    if schedule is not None:
        raw["optim"]["schedule"] = schedule
    path = tmp_path / "c.json"
    path.write_text(json.dumps(raw))
    return path


def config(path, tmp_path, **overrides):
    return load_config(path, {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": "r", **overrides})


def lr_dense(tmp_path) -> dict[int, float]:
    events = EventAccumulator(str(tmp_path / "tb" / "r"))
    events.Reload()
    return {e.step: e.value for e in events.Scalars("train/lr_dense")}


def snapshot(run):
    return {p.relative_to(run): (p.stat().st_mtime_ns, p.stat().st_size) for p in run.rglob("*") if p.is_file()}


def test_a_longer_run_that_moves_the_decays_end_is_refused_and_leaves_the_run_as_it_was(data, tmp_path):
    path = write_config(data, tmp_path)
    train(config(path, tmp_path, **{"train.max_steps": 8}))
    run = tmp_path / "tb" / "r"
    before = snapshot(run)
    with pytest.raises(ConfigError) as refused:
        train(config(path, tmp_path, **{"train.max_steps": 16}), resume="latest")
    # steps 0-7 decayed from step 4 towards step 8 (0.1 there); under 16 steps they would decay towards 16: 0.7 at 8
    source = ckpt.list_checkpoints(run)[-1]
    assert str(refused.value) == (
        f"--resume {source}: train.max_steps 8 -> 16 moves the end of the linear decay (optim.schedule.decay_steps 0: "
        "to the run's end) from step 8 to step 16, which changes the learning rate of the steps already trained: the "
        "learning rate at the resume step 8 would go from 0.1 to 0.7 times the configured one (optim.dense 0.001 -> "
        "0.007, optim.sparse 0.005 -> 0.035); pass --allow-config-change train.max_steps to resume so, or keep the "
        "checkpoint's decay (then the end factor) with \"decay_steps\": 4 in optim.schedule and --allow-config-change "
        "optim.schedule.decay_steps")
    assert snapshot(run) == before  # nothing written, nothing locked: refused before the run was opened


def test_more_epochs_and_a_shorter_run_are_refused_too(data, tmp_path):
    path = write_config(data, tmp_path)
    train(config(path, tmp_path, **{"train.epochs": 1}))  # 12 steps
    with pytest.raises(ConfigError, match=r"train.epochs 1 -> 2 moves the end of the linear decay .* from step 12 to "
                                          r"step 24, .* pass --allow-config-change train.epochs "):
        train(config(path, tmp_path, **{"train.epochs": 2}), resume="latest")
    # a branch from step 8 of a 12-step run, 10 steps long: the lr at step 8 would fall (0.55x -> 0.4x), said too
    step8 = tmp_path / "step8"
    train(load_config(path, {"log.tb_dir": str(step8), "log.run_name": "r", "train.epochs": 1,
                             "checkpoint.every": 8}))
    with pytest.raises(ConfigError, match=r"train.max_steps null -> 10 moves .* from step 12 to step 10, .* at the "
                                          r"resume step 8 would go from 0.55 to 0.4 times"):
        train(config(path, tmp_path, **{"train.epochs": 1, "train.max_steps": 10, "log.run_name": "b"}),
              resume=str(ckpt.checkpoint_dir(step8 / "r") / ckpt.checkpoint_name(8)))


def test_allowed_it_is_one_warning_and_the_learning_rate_follows_the_new_end(data, tmp_path, warnings):
    path = write_config(data, tmp_path)
    train(config(path, tmp_path, **{"train.max_steps": 8}))
    warnings.clear()
    summary = train(config(path, tmp_path, **{"train.max_steps": 16}), resume="latest",
                    allow_config_change=["train.max_steps"])
    assert summary["steps"] == 16
    assert [w for w in warnings if "learning rate" in w] == [
        "--resume: train.max_steps 8 -> 16 moves the end of the linear decay (optim.schedule.decay_steps 0: to the "
        "run's end) from step 8 to step 16 (allowed by --allow-config-change): the learning rate at the resume step 8 "
        "goes from 0.1 to 0.7 times the configured one (optim.dense 0.001 -> 0.007, optim.sparse 0.005 -> 0.035)"]
    lrs = lr_dense(tmp_path)  # logged at each logging step s: the lr step s trained with (schedule step s - 1)
    schedule = ScheduleConfig(**DECAY)
    assert lrs[8] == pytest.approx(0.01 * lr_multiplier(7, schedule, 8))  # 0.00325: the first session's last step
    assert lrs[10] == pytest.approx(0.01 * lr_multiplier(9, schedule, 16))  # the new decay's


def test_keeping_the_checkpoints_decay_with_decay_steps_trains_on_at_the_end_factor(data, tmp_path, warnings):
    path = write_config(data, tmp_path)
    train(config(path, tmp_path, **{"train.max_steps": 8}))
    kept = write_config(data, tmp_path, {**DECAY, "decay_steps": 4})
    train(config(kept, tmp_path, **{"train.max_steps": 16}), resume="latest",
          allow_config_change=["optim.schedule.decay_steps"])
    assert not [w for w in warnings if "learning rate" in w]
    lrs = lr_dense(tmp_path)  # step 8 trained at the decay's last step (0.325x), the later ones at its end (0.1x)
    assert [lrs[s] for s in (8, 10, 12, 16)] == pytest.approx([0.00325] + [0.001] * 3)


@pytest.mark.parametrize("schedule", [
    {"warmup_steps": 3},  # no decay
    {"decay": "linear", "decay_start_step": 2, "decay_steps": 4, "end_factor": 0.1},  # a decay of its own length
    {"decay": "cosine", "decay_start_step": 8, "end_factor": 0.1},  # to the end, from the resume step on
    {"decay": "cosine", "decay_start_step": 12, "end_factor": 0.1},  # never started in the first run (warned)
], ids=["warm-up", "decay_steps", "decay-from-the-resume-step", "decay-after-the-first-end"])
def test_a_schedule_the_trained_steps_followed_alike_says_nothing(data, tmp_path, warnings, schedule):
    path = write_config(data, tmp_path, schedule)
    first = train(config(path, tmp_path, **{"train.max_steps": 8}))
    warnings.clear()
    resumed = train(config(path, tmp_path, **{"train.max_steps": 16}), resume="latest")
    assert (first["steps"], resumed["steps"]) == (8, 16)
    assert not [w for w in warnings if "learning rate" in w or "decay" in w], warnings
    # the resumed run's learning rates are the uninterrupted 16-step run's
    cfg = ScheduleConfig(**schedule)
    lrs = lr_dense(tmp_path)
    steps = range(2, 17, 2)  # step s trained at schedule step s - 1
    assert [lrs[s] for s in steps] == pytest.approx([0.01 * lr_multiplier(s - 1, cfg, 16) for s in steps])


def test_no_length_change_and_a_run_at_its_end_say_nothing(warnings):
    """The unit: the same length (the same config, or another epochs capped alike by max_steps) and a run that
    trains no step (resumed at or past its new end, for its last evaluation and summary) pass without a word."""
    cfg = load_config(REPO / "configs" / "sample.json", {"train.max_steps": 200})
    saved = cfg.to_dict()
    check_schedule_length(saved, cfg, 150, 703, 200, (), "ck.pt")
    more_epochs = load_config(REPO / "configs" / "sample.json", {"train.max_steps": 200, "train.epochs": 3})
    check_schedule_length(saved, more_epochs, 150, 703, 200, (), "ck.pt")
    longer = load_config(REPO / "configs" / "sample.json", {"train.max_steps": 150})
    check_schedule_length(load_config(REPO / "configs" / "sample.json", {"train.max_steps": 400}).to_dict(), longer,
                          150, 703, 150, (), "ck.pt")
    assert warnings == []


def test_the_command_line_refusal_is_one_line_and_exit_2(data, tmp_path):
    path = write_config(data, tmp_path)
    train(config(path, tmp_path, **{"train.max_steps": 8}))
    done = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(path), "--tb-dir",
                           str(tmp_path / "tb"), "--run-name", "r", "--max-steps", "16", "--resume"],
                          env=CHILD_ENV, capture_output=True, text=True, timeout=240)
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in (done.stdout + done.stderr).splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "train.max_steps 8 -> 16 moves the end of the linear decay" in errors[0], errors
    assert "Traceback" not in done.stderr
