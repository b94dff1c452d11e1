"""Audit of the run's totals (RunStats) across checkpoints and resumes, best.pt on an in-place resume at the last
step, WORLD_SIZE parsing for --eval-only and the benchmarks' list options. Every test failed before its fix."""

from __future__ import annotations

import time

import pytest

from dlrm import checkpoint as ckpt
from dlrm.train import evaluator as evaluator_mod
from dlrm.train import step as step_mod
from dlrm.train.trainer import train
from tests.test_early_stopping_target import STEPS, data  # noqa: F401 - data: the tiny dataset (a fixture)
from tests.test_early_stopping_target import config as _target_config


def config(data, tmp_path, name, early=None, **overrides):
    """test_early_stopping_target's tiny run, checkpointed every 4 steps and evaluated only at its end (by default)."""
    return _target_config(data, tmp_path, name, early, **{"train.eval_every": 100, "checkpoint.every": 4, **overrides})


class Killed(BaseException):
    """The process dies (kill -9): the training loop ends without its normal end."""


def slow_steps(monkeypatch, step_s, kill_at=None):
    """Every training step takes `step_s` more; the `kill_at`-th call of this session dies."""
    original = step_mod.TrainStep.__call__
    calls = {"n": 0}

    def step(self, batch):
        calls["n"] += 1
        if calls["n"] == kill_at:
            raise Killed()
        time.sleep(step_s)
        return original(self, batch)

    monkeypatch.setattr(step_mod.TrainStep, "__call__", step)


def scripted(values, sleep_s=0.0):
    """Evaluations whose AUCs are `values`, in turn, each taking `sleep_s`."""
    queue = list(values)

    def evaluate(forward, loader, env=None):
        time.sleep(sleep_s)
        return {"auc": queue.pop(0), "logloss": 0.5, "accuracy": 0.75}

    return evaluate


def run_stats(tmp_path, name, step):
    return ckpt.load_checkpoint(tmp_path / "tb" / name / "checkpoints" / ckpt.checkpoint_name(step))["run_stats"]


# -- (1) a checkpoint records the training time up to its step -------------------------------------------------------

def test_a_mid_run_checkpoint_records_the_sessions_training_time_so_far(data, tmp_path, monkeypatch):
    """Steps of 0.1 s, checkpoints at 4 and 8, killed at step 10: step-8.pt's train_s holds the 0.8 s trained up to it
    (it held 0: train_s grew only at the loop's normal end), and the resumed run's summary counts them."""
    slow_steps(monkeypatch, 0.1, kill_at=10)
    with pytest.raises(Killed):
        train(config(data, tmp_path, "k"))
    four, eight = run_stats(tmp_path, "k", 4), run_stats(tmp_path, "k", 8)
    assert (four["samples"], eight["samples"]) == (32, 64)
    assert 0.4 <= four["train_s"] < eight["train_s"], (four, eight)
    assert eight["train_s"] >= 0.8, eight
    slow_steps(monkeypatch, 0.1)
    summary = train(config(data, tmp_path, "k"), resume="latest")
    assert summary["steps"] == STEPS and summary["resumed_at_step"] == 8 and summary["samples"] == 100
    assert summary["train_s"] >= eight["train_s"] + 0.5  # the 5 resumed steps' 0.5 s on top of the killed session's


def test_time_to_target_counts_the_killed_sessions_training_and_not_its_evaluations(data, tmp_path, monkeypatch):
    """Steps of 0.1 s, evaluations of 0.6 s at 2, 4, 6; killed after the checkpoint at 4, resumed: the target reached
    at 6 took 0.6 s of training at least (evaluations excluded), 2.4 s of wall time at least (it counted only the
    resumed session's 0.2 s: the checkpoint held no training time; and none of the evaluations' time, eval_s, which
    grew only at the loop's end too)."""
    early = {"patience": None, "target": 0.7}
    slow_steps(monkeypatch, 0.1, kill_at=6)
    monkeypatch.setattr(evaluator_mod, "evaluate", scripted([0.60, 0.62], sleep_s=0.6))
    with pytest.raises(Killed):
        train(config(data, tmp_path, "t", early, **{"train.eval_every": 2}))
    stats = run_stats(tmp_path, "t", 4)
    assert 1.2 <= stats["eval_s"] and stats["train_s"] - stats["eval_s"] >= 0.4, stats  # 2 evaluations, 4 steps
    slow_steps(monkeypatch, 0.1)
    monkeypatch.setattr(evaluator_mod, "evaluate", scripted([0.71, 0.5], sleep_s=0.6))
    summary = train(config(data, tmp_path, "t", early, **{"train.eval_every": 2}), resume="latest")
    assert (summary["target_step"], summary["resumed_at_step"]) == (6, 4)
    # six steps of training; at most the run's training time less its three evaluations (bounds that hold on a slow
    # machine: the first session's evaluations were counted as training on resume, or its training left out)
    assert 0.6 <= summary["time_to_target_s"] <= summary["train_s"] - 3 * 0.6, summary
    assert summary["time_to_target_wall_s"] >= 0.6 + 3 * 0.6, summary["time_to_target_wall_s"]


# -- (2) resumed in place at its last step: step-N.pt is not written again beside its best.pt link ------------------

def test_resuming_a_run_killed_after_its_last_checkpoint_keeps_best_pt_linked(data, tmp_path, monkeypatch):
    """Killed after its last checkpoint and best.pt (a hard link to it) but before summary.json: the resume makes the
    summary, and step-13.pt stays the file best.pt links to (it was written again, best.pt left on the old file: the
    disk held the model twice)."""
    import os
    from dlrm.train import trainer as trainer_mod

    def die(*a, **k):
        raise Killed()

    monkeypatch.setattr(trainer_mod, "run_baseline", die)
    with pytest.raises(Killed):
        train(config(data, tmp_path, "end"))
    checkpoints = tmp_path / "tb" / "end" / "checkpoints"
    last, best = checkpoints / ckpt.checkpoint_name(STEPS), checkpoints / "best.pt"
    assert os.path.samefile(last, best) and not (tmp_path / "tb" / "end" / "summary.json").exists()
    inode = last.stat().st_ino
    monkeypatch.undo()
    summary = train(config(data, tmp_path, "end"), resume="latest")
    assert summary["steps"] == STEPS and summary["resumed_at_step"] == STEPS
    assert summary["best"]["step"] == STEPS and summary["checkpoint"] == str(last)
    assert os.path.samefile(last, best), "best.pt no longer links to step-13.pt"
    assert last.stat().st_ino == inode  # the same checkpoint: not rewritten
    assert sorted(p.name for p in checkpoints.iterdir()) == ["best.pt"] + [
        ckpt.checkpoint_name(s) for s in (4, 8, 12, STEPS)]


# -- (3) WORLD_SIZE read for --eval-only / --export as the training reads it -----------------------------------------

MODES = dict(eval_only=True, compare=None, resume=None, export_path=None, checkpoint_path="c.pt", allowed_changes=[])


@pytest.mark.parametrize("world_size", ["01", "+1", " 01 ", "-1"])
def test_eval_only_takes_a_world_size_that_reads_as_one_process(monkeypatch, world_size):
    """int() reads "01" as 1 (init_distributed: one process); check_modes refused it as a torchrun launch."""
    from dlrm import cli
    from dlrm.distributed.env import _env_int
    monkeypatch.setenv("WORLD_SIZE", world_size)
    assert _env_int("WORLD_SIZE", "1") <= 1
    cli.check_modes(**MODES)
    cli.check_modes(**{**MODES, "eval_only": False, "export_path": "m.pt2"})


@pytest.mark.parametrize("world_size", ["abc", "1.0", "2x"])
def test_a_world_size_that_is_no_integer_is_named_so_with_eval_only(monkeypatch, world_size):
    """It got "--eval-only and --export run in one process (not under torchrun)", which is not what is wrong."""
    from dlrm import cli
    from dlrm.config import ConfigError
    monkeypatch.setenv("WORLD_SIZE", world_size)
    for modes in (MODES, {**MODES, "eval_only": False, "export_path": "m.pt2"}):
        with pytest.raises(ConfigError) as err:
            cli.check_modes(**modes)
        assert str(err.value) == (f"environment variable WORLD_SIZE={world_size!r} is not an integer (set by torchrun "
                                  "--nproc-per-node N)")


def test_eval_only_under_torchrun_is_still_refused(monkeypatch):
    from dlrm import cli
    from dlrm.config import ConfigError
    monkeypatch.setenv("WORLD_SIZE", " 02 ")
    with pytest.raises(ConfigError, match="--eval-only and --export run in one process"):
        cli.check_modes(**MODES)


# -- (4) the benchmarks' comma lists: an empty item is refused everywhere, before anything runs ----------------------

def _user_path_refuses(tmp_path, capsys, monkeypatch, *extra):
    from tests.test_benchmark_scripts import REPO, load_script

    up = load_script("user_path")
    monkeypatch.setattr(up, "device_resident", lambda *a, **k: pytest.fail("ran before checking the options"))
    monkeypatch.setattr(up, "train_py", lambda *a, **k: pytest.fail("ran before checking the options"))
    with pytest.raises(SystemExit) as e:
        up.main(["--config", "configs/sample.json", "--data", str(REPO / "data" / "sample"), "--batch-sizes", "512",
                 "--out", str(tmp_path / "out"), *extra])
    assert e.value.code == 2 and not (tmp_path / "out").exists()
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_a_trailing_comma_is_refused_in_every_int_list(tmp_path, capsys, monkeypatch):
    """The decision: an empty item in a comma list is refused in one line (as --batch-sizes '64,' and --top '32,,1'
    are), not dropped: '1000,' may be a list whose last value went missing ('1000,$MORE')."""
    err = _user_path_refuses(tmp_path, capsys, monkeypatch, "--placements", "", "--buffer-rows", "1000,")
    assert err.endswith("error: --buffer-rows: '1000,' is not a comma list of integers >= 1"), err


@pytest.mark.parametrize("value", ["stream,", "gpu,,stream", "strem"])
def test_user_path_placements_are_checked_as_the_int_lists_are(tmp_path, capsys, monkeypatch, value):
    """--placements 'stream,' was taken (its empty item dropped) where --buffer-rows '1000,' is refused, and a
    misspelt placement ran the reference and every other run first, then failed in its own train.py run (exit 1)."""
    err = _user_path_refuses(tmp_path, capsys, monkeypatch, "--placements", value)
    assert err.endswith(f"error: --placements: {value!r} is not a comma list of auto, stream, gpu"), err


# -- further: run_stats.window_losses, which a resume reads back, is checked by the schema ---------------------------

@pytest.mark.parametrize("value", ["0.5", ["x"], [None], {"a": 1.0}, [True]])
def test_a_checkpoint_with_malformed_window_losses_is_refused_in_one_line(data, tmp_path, value):
    """run_stats.window_losses (the losses since the last logging step) went unchecked: a resume crashed in
    RunStats.from_dict's float() (ValueError / TypeError traceback), or read the string "12" as losses 1.0 and 2.0."""
    import torch
    from dlrm.config import ConfigError

    train(config(data, tmp_path, "w", **{"train.max_steps": 5}))
    path = tmp_path / "tb" / "w" / "checkpoints" / ckpt.checkpoint_name(5)
    disk = torch.load(path, weights_only=True)
    assert len(disk["run_stats"]["window_losses"]) == 1  # step 5: one loss since step 4
    disk["run_stats"]["window_losses"] = value
    torch.save(disk, path)
    with pytest.raises(ConfigError, match=r"step-00000005\.pt.*run_stats\.window_losses") as e:
        train(config(data, tmp_path, "w", **{"train.max_steps": 8}), resume="latest")
    assert "\n" not in str(e.value)
