"""A sweep trial or a --compare variant that fails (an error raised while training, a diverged run) no longer ends
the whole sweep or comparison: the others run, the failed one is a row of the tables saying why, and the command
exits non-zero afterwards. A Ctrl-C or a signal stop still ends everything at once (a comparison writes the variants
that finished as a partial report first). Fake trainers keep it fast."""

from __future__ import annotations

import csv
import json
import math

import pytest
from click.testing import CliRunner

from dlrm.config import load_config
from dlrm.errors import DatasetError, NonFiniteLoss, TrainingStopped
from dlrm.logging_setup import configure_logging
from dlrm.sweep import parse_set, run_sweep
from tests.conftest import REPO
from tests.fastsweep_gc import frozen_heap  # noqa: F401 (autouse: gc.freeze() around each test)
from tests.test_sweep import BASE

AUC = {(0.01, 0): 0.70, (0.01, 1): 0.72, (0.03, 0): 0.90, (0.03, 1): 0.91, (0.1, 0): 0.75, (0.1, 1): 0.77}


@pytest.fixture
def config(tmp_path):
    from tests.conftest import make_dataset

    make_dataset(tmp_path / "ds", {"train": 16, "validation": 8}, row_group_size=8)
    raw = json.loads(json.dumps(BASE))
    raw["data"]["path"] = str(tmp_path / "ds")
    (tmp_path / "tiny.json").write_text(json.dumps(raw))
    return tmp_path / "tiny.json"


def fake_trainer(failures, calls):
    """A trainer returning AUC's numbers; (lr, seed) in `failures` raises that exception instead."""

    def train(cfg, run_dir):
        key = (cfg.optim.sparse.lr, cfg.train.seed)
        calls.append(key)
        if key in failures:
            run_dir.mkdir(parents=True)
            (run_dir / "events").write_text("history")  # what a run that failed after its first step keeps
            raise failures[key]
        return {"auc": AUC[key], "logloss": 1 - AUC[key], "steps": 4, "run_dir": str(run_dir)}

    return train


def test_a_failed_trial_is_a_row_of_the_tables_and_the_other_trials_run(tmp_path, config):
    calls = []
    failures = {(0.03, 1): NonFiniteLoss("loss became NaN or Inf at step 3; stopped"),
                (0.1, 0): RuntimeError("CUDA error: an illegal | memory access\nsecond line")}
    with pytest.raises(NonFiniteLoss, match="step 3"):  # the first failure, after every trial and the tables
        run_sweep(str(config), [parse_set("optim.sparse.lr=0.01,0.03,0.1")], 2, tb_dir=str(tmp_path),
                  run_name="sw", train_fn=fake_trainer(failures, calls))
    assert calls == [(lr, s) for lr in (0.01, 0.03, 0.1) for s in (0, 1)]
    directory = tmp_path / "sw"
    trials = list(csv.DictReader(open(directory / "trials.csv")))
    assert [(r["setting"], r["seed"], r["status"]) for r in trials] == [
        ("optim.sparse.lr=0.01", "0", "ok"), ("optim.sparse.lr=0.01", "1", "ok"),
        ("optim.sparse.lr=0.03", "0", "ok"),
        ("optim.sparse.lr=0.03", "1", "failed: loss became NaN or Inf at step 3; stopped"),
        ("optim.sparse.lr=0.1", "0", "failed: RuntimeError: CUDA error: an illegal | memory access second line"),
        ("optim.sparse.lr=0.1", "1", "ok")]
    assert trials[3]["auc"] == "" and float(trials[5]["auc"]) == 0.77
    assert trials[3]["run_dir"] == str(directory / "01-sparse.lr=0.03" / "seed-1")  # it kept its directory
    # 0.03 scored best on the seed that finished, but a setting with a failed trial does not win: it ranks
    # after the settings whose trials all finished; the verdict compares those only
    table = list(csv.DictReader(open(directory / "sweep.csv")))
    assert [(r["optim.sparse.lr"], r["seeds"], r["failed"]) for r in table] == [
        ("0.01", "2", "0"), ("0.03", "1", "1"), ("0.1", "1", "1")]
    assert float(table[1]["auc_mean"]) == 0.90 and float(table[0]["auc_std"]) == pytest.approx(0.02 / math.sqrt(2))
    md = (directory / "sweep.md").read_text()
    # one finished seed has no standard deviation: "n/a" (it read 0.0000, as if the seeds had agreed;
    # tests/test_audit_sweepleft.py)
    assert "| optim.sparse.lr=0.03 | 0.9000 | n/a | 0.1000 | n/a | 1 | 1 |" in md
    assert "- optim.sparse.lr=0.1, seed 0: RuntimeError: CUDA error: an illegal | memory access second line" in md
    assert "best: optim.sparse.lr=0.01 (AUC 0.7100 mean of 2 seeds); the only setting whose trials all finished" in md
    assert (directory / "hparams").is_dir()


def test_every_trial_failing_still_writes_the_tables(tmp_path, config):
    calls = []
    failures = {(lr, s): DatasetError(f"part-{s}.parquet: row group 0 unreadable") for lr in (0.01, 0.1) for s in (0, 1)}
    with pytest.raises(DatasetError, match="part-0.parquet"):
        run_sweep(str(config), [parse_set("optim.sparse.lr=0.01,0.1")], 2, tb_dir=str(tmp_path), run_name="sw",
                  train_fn=fake_trainer(failures, calls))
    assert len(calls) == 4
    table = list(csv.DictReader(open(tmp_path / "sw" / "sweep.csv")))
    assert [(r["seeds"], r["failed"]) for r in table] == [("0", "2"), ("0", "2")]
    assert "no setting finished all its trials" in (tmp_path / "sw" / "sweep.md").read_text()


@pytest.mark.parametrize("stop", [KeyboardInterrupt(), TrainingStopped(143, "stopped by signal at step 2")])
def test_ctrl_c_or_a_signal_stop_ends_the_sweep_at_once(tmp_path, config, stop):
    calls = []
    with pytest.raises(type(stop)):
        run_sweep(str(config), [parse_set("optim.sparse.lr=0.01,0.1")], 2, tb_dir=str(tmp_path), run_name="sw",
                  train_fn=fake_trainer({(0.01, 1): stop}, calls))
    assert calls == [(0.01, 0), (0.01, 1)]


def test_the_sweep_command_exits_non_zero_after_writing_its_tables(tmp_path, config, monkeypatch):
    import dlrm.train.trainer as trainer
    from dlrm.sweep import main

    calls = []
    monkeypatch.setattr(trainer, "train", fake_trainer({(0.01, 0): NonFiniteLoss("loss became NaN at step 2")}, calls))
    try:
        res = CliRunner().invoke(main, ["--config", str(config), "--set", "optim.sparse.lr=0.01,0.1", "--seeds", "2",
                                        "--tb-dir", str(tmp_path), "--run-name", "sw"])
    finally:
        configure_logging()
    assert res.exit_code == 3, res.output  # a diverged run's code (dlrm.cli)
    assert len(calls) == 4
    assert "sweep: 1 of 4 trials failed" in res.output and "Traceback" not in res.output
    assert (tmp_path / "sw" / "sweep.md").is_file()


# -- --compare --------------------------------------------------------------------------------------------------------


def compare_trainer(failures, calls):
    def train(cfg, run_dir):
        calls.append(run_dir.name)
        run_dir.mkdir(parents=True)
        if run_dir.name in failures:
            raise failures[run_dir.name]
        return {"samples_per_sec": 100.0, "warmup_s": 1.0, "peak_memory_bytes": None, "final_train_loss": 0.5,
                "auc": 0.7, "compile": {"graph_breaks": 0}, "train_losses": [(1, 0.5)],
                "resolved": {"compile": bool(cfg.train.compile.enabled)}}

    return train


def _cfg(tmp_path):
    return load_config(REPO / "configs" / "sample.json", {"log.tb_dir": str(tmp_path / "tb"), "train.device": "cpu",
                                                         "log.run_name": "cmp"})


def test_a_failed_variant_is_a_row_of_the_report_and_the_others_run(tmp_path):
    from dlrm.train.compare import run_comparison

    calls = []
    train = compare_trainer({"compiled": RuntimeError("Inductor | lowering failed\nat node 3")}, calls)
    with pytest.raises(RuntimeError, match="lowering failed"):  # after the reports: a non-zero exit
        run_comparison(_cfg(tmp_path), ["eager", "compiled", "compiled-default"], train)
    assert calls == ["eager", "compiled", "compiled-default"]
    base = tmp_path / "tb" / "cmp"
    rows = list(csv.DictReader(open(base / "compare.csv")))
    assert [(r["variant"], r["status"]) for r in rows] == [
        ("eager", "ok"), ("compiled", "failed: RuntimeError: Inductor | lowering failed at node 3"),
        ("compiled-default", "ok")]
    assert rows[1]["samples_per_sec"] == "" and rows[2]["samples_per_sec"] == "100.0"
    md = (base / "compare.md").read_text()
    assert "| compiled | n/a | n/a | n/a | n/a | n/a | n/a | n/a | n/a " \
        "| failed: RuntimeError: Inductor \\| lowering failed " \
           "at node 3 |" in md
    assert (base / "compare.png").is_file() and (base / "compiled").is_dir()


@pytest.mark.parametrize("stop", [KeyboardInterrupt(), TrainingStopped(130, "stopped by signal at step 2")])
def test_ctrl_c_or_a_signal_stop_ends_the_comparison_at_once(tmp_path, stop):
    from dlrm.train.compare import run_comparison

    calls = []
    with pytest.raises(type(stop)):
        run_comparison(_cfg(tmp_path), ["eager", "compiled", "compiled-default"], compare_trainer({"compiled": stop}, calls))
    assert calls == ["eager", "compiled"]  # compiled-default never starts
    # the finished variant's numbers are kept, as a partial comparison (tests/test_audit_trainstops.py); they were lost
    with open(tmp_path / "tb" / "cmp" / "compare.csv", newline="") as f:
        assert [(r["variant"], r["status"]) for r in csv.DictReader(f)] == [
            ("eager", "ok"), ("compiled", "stopped by SIGINT"), ("compiled-default", "not run: the comparison was stopped")]


def test_the_compare_command_exits_non_zero_after_writing_its_report(tmp_path, monkeypatch):
    import dlrm.train.trainer as trainer
    from dlrm.cli import main

    calls = []
    monkeypatch.setattr(trainer, "train", compare_trainer({"eager": NonFiniteLoss("loss became NaN at step 7")}, calls))
    try:
        res = CliRunner().invoke(main, ["--config", str(REPO / "configs" / "sample.json"), "--device", "cpu",
                                        "--tb-dir", str(tmp_path / "tb"), "--run-name", "cmp",
                                        "--compare", "eager,compiled"])
    finally:
        configure_logging()
    assert res.exit_code == 3, res.output
    assert calls == ["eager", "compiled"]
    assert "compare: 1 of 2 variants failed" in res.output and "Traceback" not in res.output
    assert "| eager |" in (tmp_path / "tb" / "cmp" / "compare.md").read_text()


# -- a sweep that stopped before any trial ran a step leaves nothing that blocks its rerun ----------------------------


@pytest.mark.parametrize("stop", [KeyboardInterrupt(), "config"])
def test_a_sweep_stopped_before_any_step_can_be_run_again_under_its_name(tmp_path, config, stop):
    """The trainer removes a run directory that failed before its first step, but not the <setting>/ directory it
    created above it: the sweep directory was left non-empty (empty folders only) and the same command then refused
    its --run-name ("already exists; pick another name") although nothing had been written."""
    from dlrm.config import ConfigError
    from dlrm.train.run_dir import RunDirectory

    def failing(cfg, run_dir):
        run = RunDirectory.create(cfg, run_dir)  # what the trainer does first (mkdir with its parents)
        run.abandon()  # and what it does when it fails before its first step
        if stop == "config":
            raise ConfigError("train.device: 'cuda' was requested but CUDA is not available")
        raise stop

    sets = [parse_set("optim.sparse.lr=0.01,0.1")]
    with pytest.raises((KeyboardInterrupt, ConfigError)):
        run_sweep(str(config), sets, 1, tb_dir=str(tmp_path / "tb"), run_name="sw", train_fn=failing)
    assert not (tmp_path / "tb" / "sw").exists()
    calls = []
    directory, _ = run_sweep(str(config), sets, 1, tb_dir=str(tmp_path / "tb"), run_name="sw",
                             train_fn=fake_trainer({}, calls))
    assert calls == [(0.01, 0), (0.1, 0)] and (directory / "sweep.md").is_file()
    (tmp_path / "tb" / "mine").mkdir()  # an empty directory the user made for the sweep is theirs: kept
    with pytest.raises((KeyboardInterrupt, ConfigError)):
        run_sweep(str(config), sets, 1, tb_dir=str(tmp_path / "tb"), run_name="mine", train_fn=failing)
    assert (tmp_path / "tb" / "mine").is_dir() and not any((tmp_path / "tb" / "mine").iterdir())


def test_a_stopped_sweep_keeps_what_its_trials_wrote(tmp_path, config):
    calls = []
    with pytest.raises(KeyboardInterrupt):
        run_sweep(str(config), [parse_set("optim.sparse.lr=0.01,0.1")], 1, tb_dir=str(tmp_path), run_name="sw",
                  train_fn=fake_trainer({(0.1, 0): KeyboardInterrupt()}, calls))
    assert (tmp_path / "sw" / "01-sparse.lr=0.1" / "seed-0" / "events").read_text() == "history"
    assert calls == [(0.01, 0), (0.1, 0)]


# -- a bad --device, --data or config file is not blamed on a --set -------------------------------------------------


def test_an_error_of_the_base_config_is_not_blamed_on_the_first_setting(tmp_path, config):
    from dlrm.config import ConfigError

    sets = [parse_set("optim.sparse.lr=0.01,0.1")]
    with pytest.raises(ConfigError) as err:
        run_sweep(str(config), sets, 2, {"train.device": "cdua"}, tb_dir=str(tmp_path), run_name="sw",
                  train_fn=fake_trainer({}, []))
    assert "train.device: 'cdua' is not one of" in str(err.value)
    assert not str(err.value).startswith("--set"), err.value  # was: "--set optim.sparse.lr=0.01: command line: ..."
    with pytest.raises(ConfigError) as err:
        run_sweep(str(tmp_path / "nope.json"), [], 1, tb_dir=str(tmp_path), run_name="sw", train_fn=fake_trainer({}, []))
    assert str(err.value).startswith(f"{tmp_path / 'nope.json'}: config file not found"), err.value  # was "--set defaults: "
    # a setting's own bad value is still named with its setting; one that mends the config file's value is accepted
    with pytest.raises(ConfigError, match=r"^--set model.dropout=1.5: command line: model.dropout: 1.5 must be"):
        run_sweep(str(config), [parse_set("model.dropout=0,1.5")], 1, tb_dir=str(tmp_path), run_name="sw",
                  train_fn=fake_trainer({}, []))
    bad = json.loads(config.read_text())
    bad["optim"] = {"sparse": {"lr": -1}}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    calls = []
    run_sweep(str(tmp_path / "bad.json"), sets, 1, tb_dir=str(tmp_path), run_name="sw", train_fn=fake_trainer({}, calls))
    assert calls == [(0.01, 0), (0.1, 0)]
    assert (tmp_path / "sw" / "sweep.md").is_file()
