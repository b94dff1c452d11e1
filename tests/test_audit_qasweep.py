"""QA pass over ``python -m dlrm.sweep`` (2026-12-04): a key swept both alone and inside a swept section's value, and
a sweep stopped while it writes its report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dlrm.config import ConfigError
from dlrm.sweep import parse_set, run_sweep
from tests.conftest import REPO, make_dataset
from tests.test_sweep import BASE


@pytest.fixture
def config(tmp_path):
    make_dataset(tmp_path / "ds", {"train": 16, "validation": 8}, row_group_size=8)
    raw = json.loads(json.dumps(BASE))
    raw["data"]["path"] = str(tmp_path / "ds")
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(raw))
    return path


def fake_trial(cfg, run_dir=None, resume=None):
    return {"auc": 0.6 + cfg.optim.sparse.lr, "logloss": 0.5, "steps": 4, "run_dir": str(run_dir)}


@pytest.mark.parametrize("sets, named", [
    # every setting trained lr 0.1 (the key is applied after the section), labelled optim.sparse={"lr": 0.2} too
    (["optim.sparse.lr=0.1", 'optim.sparse={"lr": 0.2}'], 'optim.sparse={"lr": 0.2} sets optim.sparse.lr'),
    (['optim.sparse={"name": "adagrad"},{"lr": 0.2}', "optim.sparse.lr=0.1,0.3"],
     'optim.sparse={"lr": 0.2} sets optim.sparse.lr'),
    (['optim={"sparse": {"lr": 1}}', "optim.sparse.lr=0.1"], 'optim={"sparse": {"lr": 1}} sets optim.sparse.lr'),
    (["train.compile=true,false", "train.compile.enabled=false"], "train.compile=true sets train.compile.enabled"),
])
def test_a_key_swept_alone_and_inside_a_swept_section_is_refused_before_anything_trains(tmp_path, config, sets,
                                                                                         named):
    with pytest.raises(ConfigError) as err:
        run_sweep(str(config), [parse_set(s) for s in sets], 1, tb_dir=str(tmp_path / "tb"), run_name="sw",
                  train_fn=fake_trial)
    assert named in str(err.value) and "in one --set only" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "tb" / "sw").exists()


def test_a_section_value_that_leaves_the_swept_key_out_is_a_product(tmp_path, config):
    trained = []

    def trial(cfg, run_dir=None, resume=None):
        trained.append((cfg.optim.sparse.name, cfg.optim.sparse.lr))
        return fake_trial(cfg, run_dir)

    sets = [parse_set('optim.sparse={"name": "adagrad"},{"name": "rowwise_adagrad"}'), parse_set("optim.sparse.lr=0.1")]
    directory, _ = run_sweep(str(config), sets, 1, tb_dir=str(tmp_path), run_name="sw", train_fn=trial)
    assert trained == [("adagrad", 0.1), ("rowwise_adagrad", 0.1)] and (directory / "sweep.md").is_file()


def test_the_command_refuses_it_in_one_line_with_exit_2(tmp_path, config):
    res = subprocess.run([sys.executable, "-m", "dlrm.sweep", "--config", str(config), "--set", "optim.sparse.lr=0.1",
                          "--set", 'optim.sparse={"lr": 0.2}', "--seeds", "1", "--tb-dir", str(tmp_path / "tb")],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "sets optim.sparse.lr, which --set" in lines[0], res.stderr
    assert not (tmp_path / "tb").exists() or not any((tmp_path / "tb").iterdir())
