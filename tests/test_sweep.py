"""python -m dlrm.sweep: parsing --set, the grid, the verdict against the seed noise, one-line errors,
and a real (tiny) sweep through dlrm.train.trainer.train with its tables and TensorBoard HParams."""

from __future__ import annotations

import csv
import json
import math
import statistics
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dlrm.config import ConfigError
from dlrm.sweep import SettingResult, grid, parse_set, run_sweep, split_values, verdict
from tests.conftest import REPO, make_dataset
from tests.fastsweep_gc import frozen_heap  # noqa: F401 (autouse: gc.freeze() around each test)


def test_values_split_at_top_level_commas_only():
    assert split_values("0.005,0.01, 0.03") == ["0.005", "0.01", "0.03"]
    assert split_values('[64,16],[32,16],"a,b"') == ["[64,16]", "[32,16]", '"a,b"']


def test_parse_set_types_values_and_the_grid_is_the_product():
    key, values = parse_set("model.bottom_mlp=[64,16],[32,16]")
    assert key == "model.bottom_mlp" and values == [[64, 16], [32, 16]]
    sets = [parse_set("optim.sparse.lr=0.005,0.01"), parse_set("model.interaction=dot,cat")]
    assert grid(sets) == [
        {"optim.sparse.lr": 0.005, "model.interaction": "dot"}, {"optim.sparse.lr": 0.005, "model.interaction": "cat"},
        {"optim.sparse.lr": 0.01, "model.interaction": "dot"}, {"optim.sparse.lr": 0.01, "model.interaction": "cat"},
    ]


@pytest.mark.parametrize("option, message", [
    ("optim.sparse.lrr=0.1", "--set optim.sparse.lrr: not a config key (did you mean optim.sparse.lr?)"),
    ("optim.sparse.lr", "expected KEY=VALUE"),
    ("optim.sparse.lr=0.1,,0.2", "empty value"),
    ("optim.sparse.lr=0.1,0.1", "listed twice"),
    ("train.seed=1,2", "the seeds come from --seeds"),
    ("log.run_name=a,b", "--set log.run_name: each trial's run directory is <--tb-dir>/<--run-name>/"),
    ("log.tb_dir=/tmp/a,/tmp/b", "set --tb-dir and --run-name for the sweep"),
])
def test_bad_set_options_are_one_line_errors(option, message):
    with pytest.raises(ConfigError) as err:
        parse_set(option)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_verdict_uses_the_paired_standard_error():
    a = SettingResult(0, {"x": 1}, [{"auc": v} for v in (0.70, 0.72, 0.71)])
    b = SettingResult(1, {"x": 2}, [{"auc": v} for v in (0.72, 0.73, 0.74)])
    c = SettingResult(2, {"x": 3}, [{"auc": v} for v in (0.60, 0.61, 0.62)])
    v = verdict([a, b, c])
    diffs = [0.02, 0.01, 0.03]
    assert v.winner is b and v.runner_up is a
    assert v.margin == pytest.approx(statistics.fmean(diffs))
    assert v.noise == pytest.approx(statistics.stdev(diffs) / math.sqrt(3))
    assert v.beyond_noise and "beyond the noise" in v.text()
    close = verdict([a, SettingResult(1, {"x": 2}, [{"auc": v} for v in (0.71, 0.71, 0.72)])])
    assert not close.beyond_noise and "within the noise" in close.text()
    assert "no estimate of the seed noise" in verdict([SettingResult(0, {}, [{"auc": 0.7}]),
                                                       SettingResult(1, {"x": 1}, [{"auc": 0.6}])]).text()


BASE = {
    "data": {"batch_size": 16, "shuffle": True},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "train": {"epochs": 1, "max_steps": 4, "log_every": 2, "device": "cpu", "baseline": False},
}


@pytest.fixture(scope="module")
def sweep_config(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    make_dataset(root / "ds", {"train": 96, "validation": 40}, row_group_size=24)
    raw = json.loads(json.dumps(BASE))
    raw["data"]["path"] = str(root / "ds")
    path = root / "tiny.json"
    path.write_text(json.dumps(raw))
    return path


def test_sweep_trains_every_trial_and_writes_tables_and_hparams(tmp_path, sweep_config):
    calls = []

    def train(cfg, run_dir):
        from dlrm.train.trainer import train as real_train

        calls.append((cfg.optim.sparse.lr, cfg.model.dropout, cfg.train.seed, run_dir))
        return real_train(cfg, run_dir=run_dir)

    sets = [parse_set("optim.sparse.lr=0.01,0.1"), parse_set("model.dropout=0,0.5")]
    directory, result = run_sweep(str(sweep_config), sets, 2, tb_dir=str(tmp_path), run_name="sw", train_fn=train)
    assert directory == tmp_path / "sw"
    assert sorted((lr, p, s) for lr, p, s, _ in calls) == sorted(
        (lr, p, s) for lr in (0.01, 0.1) for p in (0, 0.5) for s in (0, 1))
    trials = list(csv.DictReader(open(directory / "trials.csv")))
    assert len(trials) == 8
    for row in trials:  # every trial is its own run directory with its summary
        summary = json.loads(open(f"{row['run_dir']}/summary.json").read())
        assert summary["auc"] == pytest.approx(float(row["auc"]))
    table = list(csv.DictReader(open(directory / "sweep.csv")))
    assert len(table) == 4
    for row in table:  # each setting's mean and std are its trials'
        aucs = [float(t["auc"]) for t in trials if t["setting"] == row["setting"]]
        assert float(row["auc_mean"]) == pytest.approx(statistics.fmean(aucs))
        assert float(row["auc_std"]) == pytest.approx(statistics.stdev(aucs))
    assert [float(r["auc_mean"]) for r in table] == sorted((float(r["auc_mean"]) for r in table), reverse=True)
    assert table[0]["setting"] == ", ".join(f"{k}={json.dumps(v)}" for k, v in result.winner.setting.items())
    md = (directory / "sweep.md").read_text()
    assert "| setting | AUC mean | AUC std |" in md and result.text() in md
    runs = sorted(p for p in (directory / "hparams").iterdir() if p.is_dir())
    assert len(runs) == 4
    events = EventAccumulator(str(runs[0]))
    events.Reload()
    assert {"hparam/auc", "sweep/auc_std"} <= set(events.Tags()["scalars"])


def test_cli_bad_value_is_one_line_and_trains_nothing(tmp_path, sweep_config):
    res = subprocess.run(
        [sys.executable, "-m", "dlrm.sweep", "--config", str(sweep_config), "--set", "optim.sparse.lr=0.01,-1",
         "--seeds", "2", "--tb-dir", str(tmp_path), "--run-name", "bad"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "optim.sparse.lr: -1.0 must be > 0" in lines[0], res.stderr
    assert not (tmp_path / "bad").exists()


def test_cli_unknown_key_suggests_the_right_one(tmp_path, sweep_config):
    res = subprocess.run(
        [sys.executable, "-m", "dlrm.sweep", "--config", str(sweep_config), "--set", "optim.sparse.lrr=0.01",
         "--tb-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 2 and "did you mean optim.sparse.lr?" in res.stderr and len(res.stderr.splitlines()) == 1


def test_a_trial_its_run_refuses_is_named_in_the_error(tmp_path, sweep_config):
    def train(cfg, run_dir):
        if cfg.optim.sparse.lr == 0.1:
            raise ConfigError("train.device: 'cuda' was requested but CUDA is not available")
        return {"auc": 0.5, "logloss": 0.7}

    sets = [parse_set("optim.sparse.lr=0.01,0.1")]
    with pytest.raises(ConfigError, match=r"^sweep trial 3/4 \(optim.sparse.lr=0.1, seed 0\): train.device: 'cuda'"):
        run_sweep(str(sweep_config), sets, 2, tb_dir=str(tmp_path), run_name="sw", train_fn=train)
