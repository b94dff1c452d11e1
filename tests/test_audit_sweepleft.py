"""A sweep's remaining rough edges, each found by using it as a recommender engineer would:

1. A setting with one finished seed showed its AUC/logloss standard deviation as 0.0000 (sweep.md, sweep.csv and the
   HParams scalar ``sweep/auc_std``), as if the seed noise had been measured and found nil. One value has no sample
   standard deviation: now "n/a", an empty cell, and no scalar.
2. A failed trial retried by ``--resume`` had what it left moved aside as ``seed-<k>.interrupted``, though it had
   failed (its run, shown in TensorBoard under that name, read as a stopped one). Now ``seed-<k>.failed``; a trial
   killed before its first checkpoint is still ``.interrupted``.
3. On ``--resume``, a finished trial whose summary.json records another config than the sweep's (hand-edited, another
   version) was refused only when the sweep reached it, after the trials before it had trained (and a failed one's
   directory had been moved aside). Now every gathered trial is checked before anything trains or moves.
4. With a relative ``--tb-dir`` (the default ``tb_logs``), trials.csv's ``run_dir`` and the trials' own run
   directories were relative to wherever the sweep ran: now absolute, as summary.json's paths are.

Fake trainers keep it fast."""

from __future__ import annotations

import csv
import json
import math
import os

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dlrm.config import ConfigError
from dlrm.errors import NonFiniteLoss
from dlrm.sweep import parse_set, run_sweep, slug
from dlrm.sweep_results import SettingResult, _std, verdict
from dlrm.sweep_resume import FAILED_MARK
from tests.fastsweep_gc import frozen_heap  # noqa: F401 (autouse: gc.freeze() around each test)
from tests.test_sweep import BASE

AUC = {(0.01, 0): 0.70, (0.01, 1): 0.72, (0.03, 0): 0.90, (0.03, 1): 0.91}


@pytest.fixture
def config(tmp_path):
    from tests.conftest import make_dataset

    make_dataset(tmp_path / "ds", {"train": 16, "validation": 8}, row_group_size=8)
    raw = json.loads(json.dumps(BASE))
    raw["data"]["path"] = str(tmp_path / "ds")
    (tmp_path / "tiny.json").write_text(json.dumps(raw))
    return tmp_path / "tiny.json"


def trainer(calls, failures=(), run_dirs=None):
    """A trainer that writes what a finished run writes (summary.json with its config) and returns AUC's numbers;
    (lr, seed) in `failures` fails after its first step (its directory kept, no checkpoint)."""

    def train(cfg, run_dir):
        key = (cfg.optim.sparse.lr, cfg.train.seed)
        calls.append(key)
        if run_dirs is not None:
            run_dirs.append(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "events.out.tfevents.1.host").write_text("history")
        if key in failures:
            raise NonFiniteLoss("loss became NaN or Inf at step 3; stopped")
        summary = {"auc": AUC[key], "logloss": 1 - AUC[key], "steps": 4, "run_dir": str(run_dir),
                   "config": cfg.to_dict()}
        (run_dir / "summary.json").write_text(json.dumps(summary))
        return summary

    return train


def test_one_seed_has_no_standard_deviation(tmp_path, config):
    assert math.isnan(_std([0.7])) and _std([0.7, 0.7]) == 0.0  # two equal values: measured, and nil
    calls = []
    with pytest.raises(NonFiniteLoss):
        run_sweep(str(config), [parse_set("optim.sparse.lr=0.01,0.03")], 2, tb_dir=str(tmp_path), run_name="sw",
                  train_fn=trainer(calls, failures={(0.03, 1)}))
    directory = tmp_path / "sw"
    table = {r["optim.sparse.lr"]: r for r in csv.DictReader(open(directory / "sweep.csv"))}
    assert table["0.03"]["seeds"] == "1" and table["0.03"]["auc_std"] == "" and table["0.03"]["logloss_std"] == ""
    assert float(table["0.01"]["auc_std"]) == pytest.approx(0.02 / math.sqrt(2))
    md = (directory / "sweep.md").read_text()
    assert "| optim.sparse.lr=0.03 | 0.9000 | n/a | 0.1000 | n/a | 1 | 1 |" in md
    run = EventAccumulator(str(directory / "hparams" / slug(1, {"optim.sparse.lr": 0.03})))
    run.Reload()
    tags = run.Tags()["scalars"]
    assert "hparam/auc" in tags and "sweep/seeds" in tags and "sweep/auc_std" not in tags
    assert "sweep/logloss_std" not in tags
    run = EventAccumulator(str(directory / "hparams" / slug(0, {"optim.sparse.lr": 0.01})))
    run.Reload()
    assert "sweep/auc_std" in run.Tags()["scalars"]


def test_a_one_seed_sweep_claims_no_margin_beyond_the_noise(tmp_path, config):
    directory, v = run_sweep(str(config), [parse_set("optim.sparse.lr=0.01,0.03")], 1, tb_dir=str(tmp_path),
                             run_name="sw", train_fn=trainer([]))
    assert v.noise is None and v.beyond_noise is None and "beyond" not in v.text()
    assert "one seed: no estimate of the seed noise" in v.text()
    md = (directory / "sweep.md").read_text()
    assert "| optim.sparse.lr=0.03 | 0.9000 | n/a | 0.1000 | n/a | 1 |" in md
    one = verdict([SettingResult(0, {"a": 1}, [{"auc": 0.8}]), SettingResult(1, {"a": 2}, [{"auc": 0.7}])])
    assert one.beyond_noise is None and "beyond" not in one.text()


def test_a_failed_trial_moved_aside_by_resume_is_named_failed(tmp_path, config):
    from dlrm.sweep_resume import resume_sweep

    calls = []
    with pytest.raises(NonFiniteLoss):
        run_sweep(str(config), [parse_set("optim.sparse.lr=0.01,0.03")], 2, tb_dir=str(tmp_path), run_name="sw",
                  train_fn=trainer(calls, failures={(0.01, 1)}))
    directory = tmp_path / "sw"
    # and a trial killed before its first checkpoint (no summary, no checkpoint, no failure recorded)
    killed = directory / slug(1, {"optim.sparse.lr": 0.03}) / "seed-1"
    (killed / "summary.json").unlink()
    calls.clear()
    resume_sweep(directory, train_fn=trainer(calls))
    assert calls == [(0.01, 1), (0.03, 1)]
    failed = directory / slug(0, {"optim.sparse.lr": 0.01})
    assert (failed / "seed-1.failed" / "events.out.tfevents.1.host").read_text() == "history"  # kept, named so
    assert not (failed / "seed-1.interrupted").exists() and (failed / "seed-1" / "summary.json").is_file()
    assert not (failed / "seed-1" / FAILED_MARK).exists()  # the retried trial finished: no stale failure mark
    assert (killed.parent / "seed-1.interrupted" / "events.out.tfevents.1.host").is_file()
    rows = list(csv.DictReader(open(directory / "trials.csv")))
    assert [r["status"] for r in rows] == ["ok"] * 4


def test_a_foreign_summary_is_refused_before_any_trial_trains(tmp_path, config):
    from dlrm.sweep_resume import resume_sweep

    calls = []
    with pytest.raises(NonFiniteLoss):
        run_sweep(str(config), [parse_set("optim.sparse.lr=0.01,0.03")], 2, tb_dir=str(tmp_path), run_name="sw",
                  train_fn=trainer(calls, failures={(0.01, 0)}))
    directory = tmp_path / "sw"
    foreign = directory / slug(1, {"optim.sparse.lr": 0.03}) / "seed-1" / "summary.json"
    summary = json.loads(foreign.read_text())
    summary["config"]["model"]["dropout"] = 0.5  # hand-edited, or another sweep's trial copied in
    foreign.write_text(json.dumps(summary))
    calls.clear()
    with pytest.raises(ConfigError, match=r"seed-1/summary.json is not of sweep trial 4/4 .*model.dropout"):
        resume_sweep(directory, train_fn=trainer(calls))
    assert calls == []  # nothing trained before the refusal
    failed = directory / slug(0, {"optim.sparse.lr": 0.01})
    assert (failed / "seed-0").is_dir() and not (failed / "seed-0.failed").exists()  # nor moved aside


def test_a_relative_tb_dir_records_absolute_run_dirs(tmp_path, config, monkeypatch):
    from dlrm.sweep_resume import resume_sweep

    monkeypatch.chdir(tmp_path)
    calls, run_dirs = [], []
    with pytest.raises(NonFiniteLoss):
        run_sweep(str(config), [parse_set("optim.sparse.lr=0.01,0.03")], 2, tb_dir="tb", run_name="sw",
                  train_fn=trainer(calls, failures={(0.03, 1)}, run_dirs=run_dirs))
    assert run_dirs and all(p.is_absolute() for p in run_dirs)
    directory = tmp_path / "tb" / "sw"
    rows = list(csv.DictReader(open(directory / "trials.csv")))
    assert [r["run_dir"] for r in rows] == [str(directory / slug(i, {"optim.sparse.lr": lr}) / f"seed-{s}")
                                            for i, lr in enumerate((0.01, 0.03)) for s in (0, 1)]
    os.chdir(tmp_path / "tb")  # a resume from elsewhere, naming the sweep relatively
    run_dirs.clear()
    resume_sweep("sw", train_fn=trainer(calls, run_dirs=run_dirs))
    assert run_dirs == [directory / slug(1, {"optim.sparse.lr": 0.03}) / "seed-1"]
    rows = list(csv.DictReader(open(directory / "trials.csv")))
    assert all(os.path.isabs(r["run_dir"]) for r in rows) and rows[3]["status"] == "ok"


def test_a_failed_trial_with_a_checkpoint_resumes_and_loses_its_failure_mark(tmp_path, config):
    """A failed trial that had saved a checkpoint is resumed from it (the mark does not stop the trainer's --resume in
    place); once it finishes, its directory no longer says it failed."""
    from dlrm.sweep_resume import resume_sweep
    from dlrm.train.trainer import train as real_train

    raw = json.loads(config.read_text())
    raw["checkpoint"] = {"every": 2}
    config.write_text(json.dumps(raw))
    calls = []

    def crashing(cfg, run_dir=None, resume=None):
        calls.append((cfg.train.seed, resume is not None))
        summary = real_train(cfg, run_dir=run_dir, resume=resume)
        if cfg.train.seed == 1 and resume is None:  # a crash after its last checkpoint, before summary.json
            (run_dir / "summary.json").unlink()
            raise RuntimeError("worker died")
        return summary

    with pytest.raises(RuntimeError, match="worker died"):
        run_sweep(str(config), [parse_set("optim.sparse.lr=0.01")], 2, tb_dir=str(tmp_path), run_name="sw",
                  train_fn=crashing)
    trial = tmp_path / "sw" / slug(0, {"optim.sparse.lr": 0.01}) / "seed-1"
    assert (trial / FAILED_MARK).read_text() == "RuntimeError: worker died\n"
    calls.clear()
    resume_sweep(tmp_path / "sw", train_fn=crashing)
    assert calls == [(1, True)] and not (trial / FAILED_MARK).exists() and (trial / "summary.json").is_file()
    assert not trial.with_name("seed-1.failed").exists()
    assert [r["status"] for r in csv.DictReader(open(tmp_path / "sw" / "trials.csv"))] == ["ok", "ok"]
