"""Defects found by a user's walk of train.py on the CPU (helper qatrain75; each test failed before its fix)."""

from __future__ import annotations

import shutil

import torch

from dlrm import checkpoint as ckpt
from dlrm.config import load_config
from dlrm.train.trainer import train
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
