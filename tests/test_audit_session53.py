"""Defects found while merging the fifty-third session's audits (each test failed before its fix)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from dlrm import checkpoint as ckpt
from dlrm.config import load_config
from dlrm.train.trainer import train
from tests.conftest import make_dataset
from tests.test_audit_review52 import _scripted, tiny_config


def test_an_in_place_resume_from_another_directory_keeps_its_own_best_model_not_a_namesakes(tmp_path, monkeypatch):
    """A run whose --tb-dir was relative records its best.pt relatively (tb/r/checkpoints/best.pt). Resumed in place
    from another working directory holding a run of the same name and the same best step, `_keep_best_model` tried
    the recorded path first: it named the other run's best.pt, and this run's best.pt became a hard link to that
    other run's model (its own best model lost)."""
    config = tiny_config(tmp_path, train={"epochs": 2, "eval_every": 2})
    for name, seed in (("a", 3), ("b", 4)):
        (tmp_path / name).mkdir()
        monkeypatch.chdir(tmp_path / name)
        _scripted(monkeypatch, [0.60, 0.55])
        first = train(load_config(config, {"log.tb_dir": "tb", "log.run_name": "r", "train.max_steps": 4,
                                           "train.seed": seed}))
        assert first["best"]["step"] == 2
    own = tmp_path / "a" / "tb" / "r" / "checkpoints" / "best.pt"
    before = ckpt.load_checkpoint(own)["model"]
    other = ckpt.load_checkpoint(tmp_path / "b" / "tb" / "r" / "checkpoints" / "best.pt")["model"]
    assert any(not torch.equal(before[k], other[k]) for k in before)  # two different models of one step
    _scripted(monkeypatch, [0.50])  # run b's directory is the working directory: tb/r/... names its files
    resumed = train(load_config(config, {"log.tb_dir": str(tmp_path / "a" / "tb"), "log.run_name": "r",
                                         "train.max_steps": 6, "train.seed": 3}), resume="latest")
    assert resumed["best"]["step"] == 2
    after = ckpt.load_checkpoint(resumed["best_checkpoint"])["model"]
    assert all(torch.equal(before[k], after[k]) for k in before)  # was run b's step-2 model
    assert all(torch.equal(before[k], v) for k, v in ckpt.load_checkpoint(own)["model"].items())
    assert not Path(resumed["best_checkpoint"]).samefile(tmp_path / "b" / "tb" / "r" / "checkpoints" / "best.pt")


def test_no_test_starts_a_subprocess_without_the_callers_pythonpath():
    """A subprocess test whose environment set ``PYTHONPATH`` to the checkout alone lost the packages the GPU
    machine carries on the caller's PYTHONPATH (loguru): it failed there only (four tests this session and the last).
    Every such test takes `tests.conftest.CHILD_ENV` (the checkout, then the caller's PYTHONPATH)."""
    tests = Path(__file__).resolve().parent
    # any name of the checkout (REPO, ROOT, ...): session 58's ROOT slipped past a REPO-only pattern, failing on the GPU
    pattern = re.compile(r"""["']?PYTHONPATH["']?\s*[:=]\s*str\(\w+\)\s*[,})]""")
    offenders = [f"{p.relative_to(tests)}:{n}" for p in sorted(tests.rglob("*.py"))
                 for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []


def test_a_diverged_run_without_step_checkpoints_names_its_good_best_pt(tmp_path, monkeypatch):
    """``checkpoint.every`` off, evaluations every 2 steps: step 2's evaluation wrote best.pt (a good model); step 3
    makes the model NaN. The error line said "no checkpoint was written" beside that best.pt."""
    from dlrm.errors import NonFiniteLoss
    from tests.test_audit_numerics import BASE, poison_at

    make_dataset(tmp_path / "ds", {"train": 100, "validation": 40}, row_group_size=16)
    raw = json.loads(json.dumps(BASE))
    raw["data"]["path"] = str(tmp_path / "ds")
    raw["train"]["eval_every"] = 2
    (tmp_path / "c.json").write_text(json.dumps(raw))
    poison_at(monkeypatch, 3)
    best = tmp_path / "tb" / "r" / "checkpoints" / "best.pt"
    with pytest.raises(NonFiniteLoss, match=rf"loss became NaN or Inf at step 3; stopped; no step checkpoint was "
                                            rf"written; {re.escape(str(best))} holds the best evaluation's model \(step 2\)"):
        train(load_config(tmp_path / "c.json", {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": "r"}))
    state = ckpt.load_checkpoint(best)
    assert state["position"]["step"] == 2
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())
