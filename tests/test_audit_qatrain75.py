"""Defects found by a user's walk of train.py on the CPU (helper qatrain75; each test failed before its fix)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from dlrm import checkpoint as ckpt
from dlrm.config import load_config
from dlrm.train.trainer import train
from tests.conftest import CHILD_ENV
from tests.test_audit_review52 import _scripted, tiny_config


def test_a_moved_run_resumed_keeps_its_own_best_model_not_the_namesake_at_its_old_place(tmp_path, monkeypatch):
    """A run's checkpoints record its best.pt by its absolute path. The run moved (archived: ``mv tb/r arch/r``), a
    new run of the same name started where it was, and the archived one resumed in place (``--tb-dir arch --run-name
    r --resume``): `_keep_best_model` tried the recorded path first, found the new run's best.pt at the same step, and
    made the archived run's best.pt a hard link to it: its summary named its own best AUC beside another run's model,
    which --export then exported."""
    config = tiny_config(tmp_path, train={"epochs": 2, "eval_every": 2})
    old, archive = tmp_path / "tb", tmp_path / "arch"

    def run(seed: int, tb, max_steps: int, **kwargs) -> dict:
        return train(load_config(config, {"log.tb_dir": str(tb), "log.run_name": "r", "train.max_steps": max_steps,
                                          "train.seed": seed}), **kwargs)

    _scripted(monkeypatch, [0.60, 0.55])
    assert run(3, old, 4)["best"]["step"] == 2
    archive.mkdir()
    shutil.move(old / "r", archive / "r")
    own = archive / "r" / "checkpoints" / "best.pt"
    before = ckpt.load_checkpoint(own)["model"]
    _scripted(monkeypatch, [0.60, 0.55])
    assert run(4, old, 4)["best"]["step"] == 2  # the namesake: another model, best at the same step
    other = old / "r" / "checkpoints" / "best.pt"
    assert any(not torch.equal(before[k], v) for k, v in ckpt.load_checkpoint(other)["model"].items())
    _scripted(monkeypatch, [0.50])
    resumed = run(3, archive, 6, resume="latest")
    assert resumed["best"]["step"] == 2
    assert not own.samefile(other)  # was a hard link to the namesake's best.pt
    assert all(torch.equal(before[k], v) for k, v in ckpt.load_checkpoint(own)["model"].items())
    assert all(torch.equal(before[k], v) for k, v in ckpt.load_checkpoint(resumed["best_checkpoint"])["model"].items())


LAST_EVAL_SIGNAL = """
import os, signal, sys
from dlrm.train import evaluator
real = evaluator.evaluate
def evaluate(forward, loader, env=None):  # the run's one evaluation, its last: the signal arrives in the middle of it
    os.kill(os.getpid(), getattr(signal, sys.argv[1]))
    return real(forward, loader, env) if env is not None else real(forward, loader)
evaluator.evaluate = evaluate
from dlrm.cli import main
main(sys.argv[2:])
"""


@pytest.mark.parametrize("name, code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_during_the_last_evaluation_keeps_the_trained_steps(tmp_path, name, code):
    """A run without checkpoint.every checkpoints at its end only, after its last evaluation. A SIGTERM or Ctrl-C
    during that evaluation stopped the process at once, no checkpoint written: every step trained was lost, and the
    --resume started the run again from step 0 ("holds no checkpoint yet"), where the same signal one step earlier
    checkpointed that step. Now the evaluation and its checkpoint finish, the run exits 128 + the signal, and the
    --resume writes the summary without training a step again."""
    config = tiny_config(tmp_path, checkpoint={"every": None})
    args = ["--config", str(config), "--tb-dir", str(tmp_path / "tb"), "--max-steps", "4"]
    done = subprocess.run([sys.executable, "-c", LAST_EVAL_SIGNAL, name, *args, "--run-name", "r"], cwd=tmp_path,
                          env=CHILD_ENV, capture_output=True, text=True, timeout=240)
    assert done.returncode == code, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert f"stopped by signal ({name}) at step 4, after its last evaluation" in done.stderr, done.stderr[-2000:]
    run = tmp_path / "tb" / "r"
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["step-00000004.pt"]  # was none: the run's 4 steps lost
    assert not (run / "summary.json").exists()
    resumed = train(load_config(config, {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": "r",
                                         "train.max_steps": 4}), resume="latest")
    assert resumed["resumed_at_step"] == 4 and resumed["steps"] == 4
    whole = train(load_config(config, {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": "whole",
                                       "train.max_steps": 4}))
    assert resumed["auc"] == whole["auc"] and resumed["final_train_loss"] == whole["final_train_loss"]


def test_export_of_a_moved_finished_run_takes_its_own_best_pt_not_the_namesakes(tmp_path, monkeypatch):
    """``--resume --export OUT`` of a run at its end exports the best.pt its summary.json names, recorded absolute
    where the run trained. Moved since (``mv tb/r arch/r``) with a new run of that name at its old place, the export
    took the new run's best.pt ("exported ... from tb/r/checkpoints/best.pt"): another run's model."""
    from dlrm.cli import _best_checkpoint

    config = tiny_config(tmp_path, train={"epochs": 2, "eval_every": 2})
    old, archive = tmp_path / "tb", tmp_path / "arch"
    cfg = lambda tb, seed: load_config(config, {"log.tb_dir": str(tb), "log.run_name": "r",  # noqa: E731
                                                "train.max_steps": 4, "train.seed": seed})
    _scripted(monkeypatch, [0.60, 0.55])
    train(cfg(old, 3))
    archive.mkdir()
    shutil.move(old / "r", archive / "r")
    _scripted(monkeypatch, [0.60, 0.55])
    train(cfg(old, 4))  # the namesake at the old place
    finished = train(cfg(archive, 3), resume="latest")  # at its end: nothing trained, its summary.json read
    assert finished["finished"] and finished["best_checkpoint"] == str(old / "r" / "checkpoints" / "best.pt")
    assert _best_checkpoint(finished) == str(archive / "r" / "checkpoints" / "best.pt")  # was the namesake's


def test_a_metadata_json_that_is_a_directory_is_named_so_not_missing(tmp_path):
    """A dataset whose metadata.json is a directory (a copy gone wrong) was refused as "missing (not a dataset
    directory, or its writer did not finish)": the user was sent to look for a file that is there."""
    from dlrm.data.schema import read_metadata
    from dlrm.errors import DatasetError

    (tmp_path / "metadata.json").mkdir()
    with pytest.raises(DatasetError, match=r"metadata\.json: not a file$"):
        read_metadata(tmp_path)
    with pytest.raises(DatasetError, match=r"missing"):
        read_metadata(tmp_path / "metadata.json")  # no metadata.json inside: missing, as before
