"""Review of session 60's changes (run records, sessions, windows, sweeps): the defects found, each held by a test.

1. A resumed session's ``config_changes`` (summary.json's ``sessions``) and its "this session's own settings differ"
   line named the run's own directory as a setting it changed: a run started without --run-name (a default name,
   recorded as log.run_name null) and resumed by that name, as README says, said
   ``log.run_name: null -> 'c-20261201-183337'`` (and ``log.tb_dir: 'tb' -> '/abs/tb'`` under another spelling of
   --tb-dir); a resume by checkpoint path without --run-name said ``log.run_name: 'r1' -> null``. Neither session
   changed where the run is written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from loguru import logger

from dlrm.config import load_config
from dlrm.train.trainer import train
from tests.conftest import make_dataset

CONFIG = {
    "data": {"batch_size": 8},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "train": {"epochs": 2, "log_every": 2, "eval_every": 2, "device": "cpu", "seed": 3, "baseline": False},
    "checkpoint": {"every": 2, "keep": 5},
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("review60")
    make_dataset(root / "ds", {"train": 64, "validation": 16, "test": 16}, row_group_size=16)
    return root / "ds"


def config(data, tmp_path, **overrides):
    raw = json.loads(json.dumps(CONFIG))
    raw["data"]["path"] = str(data)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(raw))
    return load_config(path, overrides)


@pytest.fixture
def messages():
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(m.record["message"]), level="INFO")
    yield lines
    logger.remove(sink)


def test_a_resume_by_name_of_a_default_named_run_changes_no_log_setting(data, tmp_path, monkeypatch, messages):
    monkeypatch.chdir(tmp_path)
    first = train(config(data, tmp_path, **{"log.tb_dir": "tb", "train.max_steps": 4}))
    run_dir = Path(first["run_dir"])
    assert json.loads((run_dir / "config.json").read_text())["log"]["run_name"] is None  # (a default name)
    # resumed by its name, as README says, with --tb-dir spelled absolutely
    resumed = train(config(data, tmp_path, **{"log.tb_dir": str(tmp_path / "tb"), "log.run_name": run_dir.name,
                                              "train.max_steps": 8}), resume="latest")
    assert resumed["sessions"][1]["config_changes"] == {"train.max_steps": [4, 8]}
    assert not [m for m in messages if "own settings differ" in m], messages


def test_a_resume_by_checkpoint_path_changes_no_log_setting(data, tmp_path, monkeypatch, messages):
    monkeypatch.chdir(tmp_path)
    train(config(data, tmp_path, **{"log.tb_dir": "tb", "log.run_name": "r1", "train.max_steps": 4}))
    checkpoint = tmp_path / "tb" / "r1" / "checkpoints" / "step-00000004.pt"
    resumed = train(config(data, tmp_path, **{"train.max_steps": 8}), resume=str(checkpoint))  # (in place: run r1)
    assert Path(resumed["run_dir"]) == tmp_path / "tb" / "r1"
    assert resumed["sessions"][1]["config_changes"] == {"train.max_steps": [4, 8]}
    assert not [m for m in messages if "own settings differ" in m], messages


def test_a_branch_still_records_its_new_run_name(data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    train(config(data, tmp_path, **{"log.tb_dir": "tb", "log.run_name": "r1", "train.max_steps": 4}))
    checkpoint = tmp_path / "tb" / "r1" / "checkpoints" / "step-00000004.pt"
    branch = train(config(data, tmp_path, **{"log.tb_dir": "tb", "log.run_name": "r2", "train.max_steps": 8}),
                   resume=str(checkpoint))
    assert branch["sessions"][-1]["config_changes"] == {"log.run_name": ["r1", "r2"], "train.max_steps": [4, 8]}


def test_a_restart_by_name_of_a_default_named_run_changes_no_log_setting(data, tmp_path, monkeypatch, messages):
    import shutil

    monkeypatch.chdir(tmp_path)
    first = train(config(data, tmp_path, **{"log.tb_dir": "tb", "train.max_steps": 2}))
    run_dir = Path(first["run_dir"])
    # what a run killed before its first checkpoint leaves: its config.json and events
    shutil.rmtree(run_dir / "checkpoints")
    (run_dir / "summary.json").unlink()
    messages.clear()
    again = train(config(data, tmp_path, **{"log.tb_dir": str(tmp_path / "tb"), "log.run_name": run_dir.name,
                                            "train.max_steps": 2}), resume="latest")
    assert again["steps"] == 2 and any("starting it from step 0" in m for m in messages), messages
    assert not [m for m in messages if "own settings differ" in m], messages
