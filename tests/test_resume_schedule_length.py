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
import shutil
import subprocess
import sys

import pytest
from loguru import logger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dlrm import checkpoint as ckpt
from dlrm.config import ConfigError, ScheduleConfig, load_config
from dlrm.train.optim import lr_multiplier
from dlrm.train.resume_policy import check_schedule_length, checkpoint_rows
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


ROWS = 703 * 256 + 32  # configs/sample.json's batches (256, drop_last) of an epoch of 703 steps


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
        "goes from 0.1 to 0.7 times the configured one (optim.dense 0.001 -> 0.007, optim.sparse 0.005 -> 0.035); the "
        "checkpoint's end is kept with \"decay_steps\": 4 in optim.schedule and --allow-config-change "
        "optim.schedule.decay_steps"]
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
    check_schedule_length(saved, cfg, 150, 703, 200, ROWS, (), "ck.pt", saved_rows=ROWS)
    more_epochs = load_config(REPO / "configs" / "sample.json", {"train.max_steps": 200, "train.epochs": 3})
    check_schedule_length(saved, more_epochs, 150, 703, 200, ROWS, (), "ck.pt", saved_rows=ROWS)
    longer = load_config(REPO / "configs" / "sample.json", {"train.max_steps": 150})
    check_schedule_length(load_config(REPO / "configs" / "sample.json", {"train.max_steps": 400}).to_dict(), longer,
                          150, 703, 150, ROWS, (), "ck.pt", saved_rows=ROWS)
    assert warnings == []


def branch_at_step_12(data, tmp_path, **overrides):
    """A 36-step run (3 epochs of 12 batches of 8) checkpointed at step 12, resumed from there as the run "b"."""
    path = write_config(data, tmp_path)
    train(config(path, tmp_path, **{"checkpoint.every": 12}))
    source = ckpt.checkpoint_dir(tmp_path / "tb" / "r") / ckpt.checkpoint_name(12)
    return source, config(path, tmp_path, **{"log.run_name": "b", **overrides})


def test_another_batch_size_moves_the_end_of_a_run_of_epochs_and_is_said(data, tmp_path, warnings):
    """The steps an epoch changed with data.batch_size (allowed): 3 epochs were 36 steps and are 18, so the decay's end
    moved from step 36 to 18 with no length key changed. It was checked with this run's 6 steps an epoch for the
    checkpoint's run too (18 and 18: nothing said), and its learning rate fell from 0.775x to 0.486x unsaid."""
    source, cfg = branch_at_step_12(data, tmp_path, **{"data.batch_size": 16})
    warnings.clear()
    assert train(cfg, resume=str(source), allow_config_change=["data.batch_size"])["steps"] == 18
    assert [w for w in warnings if "decay" in w] == [
        "--resume: data.batch_size 8 -> 16 (12 -> 6 steps an epoch) moves the end of the linear decay "
        "(optim.schedule.decay_steps 0: to the run's end) from step 36 to step 18 (allowed by --allow-config-change): "
        "the learning rate at the resume step 12 goes from 0.775 to 0.4857 times the configured one (optim.dense "
        "0.00775 -> 0.004857, optim.sparse 0.03875 -> 0.02429); the checkpoint's end is kept with \"decay_steps\": 32 "
        "in optim.schedule and --allow-config-change optim.schedule.decay_steps"]
    events = EventAccumulator(str(tmp_path / "tb" / "b"))
    events.Reload()
    lrs = {e.step: e.value for e in events.Scalars("train/lr_dense")}  # what the warning says the run does: in steps
    schedule = ScheduleConfig(**DECAY)
    assert [lrs[s] for s in (14, 16, 18)] == pytest.approx([0.01 * lr_multiplier(s - 1, schedule, 18)
                                                            for s in (14, 16, 18)])


def test_more_epochs_of_bigger_batches_are_checked_in_the_checkpoints_own_epochs(data, tmp_path, warnings):
    # 6 epochs of 6 steps are the checkpoint's 36 steps: the decay's end stays (it was refused as 18 -> 36)
    source, cfg = branch_at_step_12(data, tmp_path, **{"data.batch_size": 16, "train.epochs": 6})
    warnings.clear()
    assert train(cfg, resume=str(source), allow_config_change=["data.batch_size"])["steps"] == 36
    assert not [w for w in warnings if "decay" in w], warnings
    # 4 epochs of 6 steps move it from 36 to 24 (it was said as from 18 to 24), refused for the unnamed train.epochs
    (tmp_path / "4").mkdir()
    source, cfg = branch_at_step_12(data, tmp_path / "4", **{"data.batch_size": 16, "train.epochs": 4})
    with pytest.raises(ConfigError) as refused:
        train(cfg, resume=str(source), allow_config_change=["data.batch_size"])
    assert str(refused.value) == (
        f"--resume {source}: data.batch_size 8 -> 16 (12 -> 6 steps an epoch); train.epochs 3 -> 4 moves the end of "
        "the linear decay (optim.schedule.decay_steps 0: to the run's end) from step 36 to step 24, which changes the "
        "learning rate of the steps already trained: the learning rate at the resume step 12 would go from 0.775 to "
        "0.64 times the configured one (optim.dense 0.00775 -> 0.0064, optim.sparse 0.03875 -> 0.032); pass "
        "--allow-config-change train.epochs to resume so, or keep the checkpoint's decay (then the end factor) with "
        "\"decay_steps\": 32 in optim.schedule and --allow-config-change optim.schedule.decay_steps")


def test_drop_last_and_another_data_path_in_the_unit(warnings):
    """drop_last False keeps the 32 rows left over of each epoch as a 704th step; another data.path is counted in the
    checkpoint's own rows (`saved_rows`, recorded), and one that records none leaves its steps an epoch unknown:
    said."""
    saved = load_config(REPO / "configs" / "sample.json").to_dict()  # 2 epochs of 703 steps: the decay ends at 1406
    kept = load_config(REPO / "configs" / "sample.json", {"data.drop_last": False})
    check_schedule_length(saved, kept, 150, 704, 1408, ROWS, ["data.drop_last"], "ck.pt", saved_rows=ROWS)
    assert warnings == [
        "--resume: data.drop_last True -> False (703 -> 704 steps an epoch) moves the end of the linear decay "
        "(optim.schedule.decay_steps 0: to the run's end) from step 1406 to step 1408 (allowed by "
        "--allow-config-change): the learning rate at the resume step 150 goes from 0.9655 to 0.9656 times the "
        "configured one (optim.dense 0.001931 -> 0.001931, optim.sparse 0.04828 -> 0.04828); the checkpoint's end is "
        "kept with \"decay_steps\": 1306 in optim.schedule and --allow-config-change optim.schedule.decay_steps"]
    warnings.clear()
    moved = load_config(REPO / "configs" / "sample.json", {"data.path": "/elsewhere/sample"})
    check_schedule_length(saved, moved, 150, 703, 1406, ROWS, ["data.path"], "ck.pt", saved_rows=ROWS)
    assert warnings == []  # the same rows elsewhere (a dataset moved): the same end
    check_schedule_length(saved, moved, 150, 703, 1406, ROWS, ["data.path"], "ck.pt")
    unknown = ("the checkpoint's run length in steps is unknown under another data.path (its train.epochs counted "
               "its own data's batches, whose rows it does not record: written by an earlier version), so whether the "
               "end of the linear decay (optim.schedule.decay_steps 0: to the run's end) moved is not known: this "
               "run's decay ends at step {}, and the learning rate at the resume step 150 is {} times the configured "
               "one")
    assert warnings == ["--resume: " + unknown.format(1406, 0.9655)]
    # a length key changed with it still needs its flag (it passed, said as "not checked", where it was refused)
    warnings.clear()
    longer = load_config(REPO / "configs" / "sample.json", {"data.path": "/elsewhere/sample", "train.max_steps": 400})
    capped = load_config(REPO / "configs" / "sample.json", {"train.max_steps": 200}).to_dict()
    with pytest.raises(ConfigError) as refused:
        check_schedule_length(capped, longer, 150, 703, 400, ROWS, ["data.path"], "ck.pt")
    assert str(refused.value) == (
        "--resume ck.pt: train.max_steps 200 -> 400 changes the run's length, and " + unknown.format(400, 0.85)
        + "; pass --allow-config-change train.max_steps to resume so, or keep the checkpoint's decay with its length "
        "in \"decay_steps\" in optim.schedule and --allow-config-change optim.schedule.decay_steps")
    check_schedule_length(capped, longer, 150, 703, 400, ROWS, ["data.path", "train.max_steps"], "ck.pt")
    assert warnings == ["--resume: " + unknown.format(400, 0.85)]
    # known rows: the same refusal as on the same data (named in steps)
    with pytest.raises(ConfigError, match=r"^--resume ck.pt: train.max_steps 200 -> 400 moves the end of the linear "
                                          r"decay .* from step 200 to step 400, .* pass --allow-config-change "
                                          r"train.max_steps to resume so"):
        check_schedule_length(capped, longer, 150, 703, 400, ROWS, ["data.path"], "ck.pt", saved_rows=ROWS)


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


@pytest.fixture(scope="module")
def more_rows(tmp_path_factory):
    root = tmp_path_factory.mktemp("schedlen-more") / "ds"
    make_dataset(root, {"train": 200, "validation": 24}, row_group_size=30, seed=1)  # 25 steps an epoch at batch 8
    return root


def shown(path) -> str:
    """A data.path as a resume's messages show it: its repr, the last 37 characters of a long one."""
    text = repr(str(path))
    return text if len(text) <= 40 else "..." + text[-37:]


def test_another_dataset_is_counted_in_the_checkpoints_own_rows_and_the_run_decays_to_its_new_end(
        data, more_rows, tmp_path, warnings):
    """A run of 3 epochs of 100 rows (36 steps) resumed at step 12 on a dataset of 200 rows (3 epochs: 75 steps). Its
    decay's end moved from step 36 to 75, and the learning rate at the resume step from 0.775x to 0.8986x; the warning
    said the checkpoint's length was unknown (it recorded no rows). Checkpoints now record their train rows, and the
    warning names both ends, what moved them, and how to keep the checkpoint's end; the run decays to its own end."""
    source, cfg = branch_at_step_12(data, tmp_path, **{"data.path": str(more_rows)})
    assert ckpt.load_checkpoint(source)["train_rows"] == 100
    warnings.clear()
    summary = train(cfg, resume=str(source), allow_config_change=["data.path"])
    assert summary["steps"] == 75
    assert [w for w in warnings if "decay" in w] == [
        f"--resume: data.path {shown(data)} -> {shown(more_rows)} (100 -> 200 train rows: "
        "12 -> 25 steps an epoch) moves the end of the linear decay (optim.schedule.decay_steps 0: to the run's end) "
        "from step 36 to step 75 (allowed by --allow-config-change): the learning rate at the resume step 12 goes from "
        "0.775 to 0.8986 times the configured one (optim.dense 0.00775 -> 0.008986, optim.sparse 0.03875 -> 0.04493); "
        "the checkpoint's end is kept with \"decay_steps\": 32 in optim.schedule and --allow-config-change "
        "optim.schedule.decay_steps"]
    events = EventAccumulator(str(tmp_path / "tb" / "b"))
    events.Reload()
    lrs = {e.step: e.value for e in events.Scalars("train/lr_dense")}  # the new end's, as the warning says
    schedule = ScheduleConfig(**DECAY)
    assert [lrs[s] for s in (14, 40, 74)] == pytest.approx([0.01 * lr_multiplier(s - 1, schedule, 75)
                                                            for s in (14, 40, 74)])
    assert ckpt.load_checkpoint(ckpt.checkpoint_dir(tmp_path / "tb" / "b") / ckpt.checkpoint_name(75))[
        "train_rows"] == 200


def test_a_dataset_changed_in_place_is_counted_in_the_checkpoints_own_rows(data, more_rows, tmp_path, warnings):
    """The same data.path regenerated with 200 rows (allowed as data.path): its end was counted in the new rows for
    the checkpoint's run too (75 and 75), and its move from step 36 to 75 went unsaid."""
    shutil.copytree(data, tmp_path / "ds")
    source, cfg = branch_at_step_12(tmp_path / "ds", tmp_path)
    shutil.rmtree(tmp_path / "ds")
    shutil.copytree(more_rows, tmp_path / "ds")
    warnings.clear()
    assert train(cfg, resume=str(source), allow_config_change=["data.path"])["steps"] == 75
    assert [w for w in warnings if "decay" in w] == [
        "--resume: data.path's files changed since the checkpoint (100 -> 200 train rows: 12 -> 25 steps an epoch) "
        "moves the end of the linear decay (optim.schedule.decay_steps 0: to the run's end) from step 36 to step 75 "
        "(allowed by --allow-config-change): the learning rate at the resume step 12 goes from 0.775 to 0.8986 times "
        "the configured one (optim.dense 0.00775 -> 0.008986, optim.sparse 0.03875 -> 0.04493); the checkpoint's end "
        "is kept with \"decay_steps\": 32 in optim.schedule and --allow-config-change optim.schedule.decay_steps"]


def test_checkpoint_rows_recorded_else_this_runs_only_on_the_same_unchanged_data():
    saved = {"data": {"path": "/data/a"}}
    stamps = {"metadata.json": "9:aa", "train/a.parquet": "100:bb"}
    assert checkpoint_rows(saved, {"train_rows": 100, "dataset_stamps": stamps}, stamps, "/data/b", 200) == 100
    assert checkpoint_rows(saved, {"dataset_stamps": stamps}, stamps, "/data/a", 200) == 200  # the same files
    assert checkpoint_rows(saved, {}, stamps, "/data/a", 200) == 200  # no stamps recorded: taken as the same
    assert checkpoint_rows(saved, {"dataset_stamps": stamps}, {**stamps, "train/a.parquet": "96:cc"}, "/data/a",
                           200) is None  # changed since, without its rows
    assert checkpoint_rows(saved, {"dataset_stamps": stamps}, stamps, "/data/b", 200) is None  # another dataset


def test_train_rows_is_checked_where_it_enters(data, tmp_path):
    import torch

    from dlrm.checkpoint_schema import to_disk

    path = write_config(data, tmp_path)
    train(config(path, tmp_path, **{"train.max_steps": 2}))
    saved = ckpt.checkpoint_dir(tmp_path / "tb" / "r") / ckpt.checkpoint_name(2)
    state = ckpt.load_checkpoint(saved)
    state["train_rows"] = 0
    torch.save(to_disk(state), saved)
    with pytest.raises(ConfigError, match=r"checkpoint key 'train_rows' must be an int >= 1, got int 0"):
        ckpt.load_checkpoint(saved)
