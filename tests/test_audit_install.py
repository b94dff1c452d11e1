"""Installing the package and running it from another working directory.

A sweep whose config file names its data relatively (``configs/sample.json``: ``"data/sample"``), resumed with
``python -m dlrm.sweep --resume DIR`` from another working directory: the trials left were trained on whatever that
relative path names there (the config's own data.path was recorded as written, unlike --data and --set data.path,
which the record holds absolute "so that a resume from elsewhere trains on the same data"), the finished ones were
then refused as "not of" their trial, and a sweep so resumed could not be finished from anywhere.
"""

from __future__ import annotations

import csv
import json
import os

import pytest

from dlrm.config import ConfigError
from dlrm.sweep import parse_set, run_sweep
from dlrm.sweep_resume import resume_sweep
from tests.conftest import make_dataset
from tests.test_sweep import BASE


@pytest.fixture
def two_places(tmp_path):
    """A/ds and B/ds (two datasets under one relative name) and a config naming ``ds`` relatively."""
    for place in ("A", "B"):
        make_dataset(tmp_path / place / "ds", {"train": 16, "validation": 8}, row_group_size=8)
    raw = json.loads(json.dumps(BASE))
    raw["data"]["path"] = "ds"
    (tmp_path / "tiny.json").write_text(json.dumps(raw))
    return tmp_path


def recording_trial(seen: list, fail: set):
    """A trainer as `dlrm.train.trainer.train` records its run: data.path absolute in summary.json's config (and in
    its checkpoints); `seen` gets the directory each trial read; (lr, seed) in `fail` raises."""

    def train(cfg, run_dir=None, resume=None):
        data = os.path.abspath(cfg.data.path)
        seen.append(data)
        run_dir.mkdir(parents=True, exist_ok=True)
        if (cfg.optim.sparse.lr, cfg.train.seed) in fail:
            raise RuntimeError("trial failed")
        config = cfg.to_dict()
        config["data"]["path"] = data
        summary = {"auc": 0.7 + cfg.optim.sparse.lr, "logloss": 0.3, "steps": 4, "run_dir": str(run_dir),
                   "config": config}
        (run_dir / "summary.json").write_text(json.dumps(summary))
        return summary

    return train


def _start(root, fail: set, seen: list) -> None:
    os.chdir(root / "A")
    with pytest.raises(RuntimeError, match="trial failed"):
        run_sweep(str(root / "tiny.json"), [parse_set("optim.sparse.lr=0.01,0.03")], 1, tb_dir=str(root / "tb"),
                  run_name="sw", train_fn=recording_trial(seen, fail))
    assert seen == [str(root / "A" / "ds")] * 2


def test_a_sweep_resumed_elsewhere_retrains_its_failed_trial_on_the_config_files_data(two_places, monkeypatch):
    """The first trial failed: resumed from B, it was trained on B/ds, then the second (finished on A/ds) was refused
    as "not of sweep trial 2/2 ...: its config differs in data.path"; resumed again from A, the first was refused."""
    root, seen = two_places, []
    monkeypatch.chdir(root)
    _start(root, {(0.01, 0)}, seen)
    os.chdir(root / "B")
    resume_sweep(root / "tb" / "sw", train_fn=recording_trial(seen, set()))
    assert seen == [str(root / "A" / "ds")] * 3
    rows = list(csv.DictReader((root / "tb" / "sw" / "trials.csv").read_text().splitlines()))
    assert [r["status"] for r in rows] == ["ok", "ok"], rows


def test_a_sweep_resumed_elsewhere_gathers_its_finished_trials(two_places, monkeypatch):
    """The second trial failed: resumed from B, the finished first trial was refused as not of its own trial."""
    root, seen = two_places, []
    monkeypatch.chdir(root)
    _start(root, {(0.03, 0)}, seen)
    os.chdir(root / "B")
    directory, verdict = resume_sweep(root / "tb" / "sw", train_fn=recording_trial(seen, set()))
    assert seen == [str(root / "A" / "ds")] * 3  # the first gathered, the second trained on A/ds
    assert verdict is not None and verdict.winner.setting == {"optim.sparse.lr": 0.03}


def test_an_edit_of_the_config_files_data_path_is_still_refused(two_places, monkeypatch):
    """Recording where the sweep started does not hide an edited data.path in the config file."""
    root, seen = two_places, []
    monkeypatch.chdir(root)
    _start(root, {(0.03, 0)}, seen)
    raw = json.loads((root / "tiny.json").read_text())
    raw["data"]["path"] = "other"
    (root / "tiny.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"differs in data.path: \"ds\" -> \"other\""):
        resume_sweep(root / "tb" / "sw", train_fn=recording_trial(seen, set()))
    assert len(seen) == 2
