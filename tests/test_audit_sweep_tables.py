"""dlrm.sweep with a fake trainer: every trial's overrides, seed and run directory, and the tables' and HParams'
numbers attributed to the right setting and column."""

from __future__ import annotations

import csv
import json
import statistics

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dlrm.sweep import parse_set, run_sweep, slug
from tests.test_sweep import BASE

# per (sparse lr, dropout, seed): distinct AUCs and loglosses, so a value read from the wrong trial shows
AUC = {(0.01, 0, 0): 0.70, (0.01, 0, 1): 0.74, (0.01, 0, 2): 0.71,
       (0.1, 0, 0): 0.60, (0.1, 0, 1): 0.61, (0.1, 0, 2): 0.66,
       (0.01, 0.5, 0): 0.80, (0.01, 0.5, 1): 0.77, (0.01, 0.5, 2): 0.79,
       (0.1, 0.5, 0): 0.65, (0.1, 0.5, 1): 0.69, (0.1, 0.5, 2): 0.62}


def logloss(key):
    return 1.0 - AUC[key] / 3 + 0.01 * key[2] ** 2  # a spread unlike the AUC's


@pytest.fixture
def config(tmp_path):
    from tests.conftest import make_dataset

    make_dataset(tmp_path / "ds", {"train": 16, "validation": 8}, row_group_size=8)
    raw = json.loads(json.dumps(BASE))
    raw["data"]["path"] = str(tmp_path / "ds")
    (tmp_path / "tiny.json").write_text(json.dumps(raw))
    return tmp_path / "tiny.json"


def test_each_trial_gets_its_own_setting_seed_and_directory_and_the_tables_say_so(tmp_path, config):
    seen = []

    def train(cfg, run_dir):
        key = (cfg.optim.sparse.lr, cfg.model.dropout, cfg.train.seed)
        seen.append((key, cfg.data.batch_size, run_dir))
        base = {"auc": AUC[key] - 0.1} if key[1] == 0.5 else None  # a baseline only in the dropout-0.5 runs
        return {"auc": AUC[key], "logloss": logloss(key), "best": {"auc": AUC[key] + 0.001}, "baseline": base,
                "steps": 100 + key[2], "run_dir": str(run_dir)}

    sets = [parse_set("optim.sparse.lr=0.01,0.1"), parse_set("model.dropout=0,0.5")]
    directory, v = run_sweep(str(config), sets, 3, {"data.batch_size": 8}, tb_dir=str(tmp_path), run_name="sw",
                             train_fn=train)
    assert [k for k, _, _ in seen] == [(lr, p, s) for lr in (0.01, 0.1) for p in (0, 0.5) for s in range(3)]
    assert all(b == 8 for _, b, _ in seen)  # the base overrides reach every trial
    assert len({d for _, _, d in seen}) == 12
    for (lr, p, s), _, d in seen:
        index = [(0.01, 0), (0.01, 0.5), (0.1, 0), (0.1, 0.5)].index((lr, p))
        setting = {"optim.sparse.lr": lr, "model.dropout": 0 if p == 0 else 0.5}  # as --set parsed it
        assert d == directory / slug(index, setting) / f"seed-{s}"

    trials = list(csv.DictReader(open(directory / "trials.csv")))
    for row, (key, _, d) in zip(trials, seen):
        assert row["setting"] == f"optim.sparse.lr={key[0]}, model.dropout={key[1]:g}" and int(row["seed"]) == key[2]
        assert float(row["auc"]) == AUC[key] and float(row["logloss"]) == pytest.approx(logloss(key))
        assert float(row["best_auc"]) == pytest.approx(AUC[key] + 0.001) and int(row["steps"]) == 100 + key[2]
        assert row["run_dir"] == str(d)
        assert (row["baseline_auc"] == "") == (key[1] == 0)

    table = list(csv.DictReader(open(directory / "sweep.csv")))
    means = {}
    for row in table:
        lr, p = json.loads(row["optim.sparse.lr"]), json.loads(row["model.dropout"])
        aucs = [AUC[(lr, p, s)] for s in range(3)]
        losses = [logloss((lr, p, s)) for s in range(3)]
        means[(lr, p)] = statistics.fmean(aucs)
        assert int(row["seeds"]) == 3 and row["aucs"] == " ".join(f"{a:.4f}" for a in aucs)
        assert float(row["auc_mean"]) == pytest.approx(means[(lr, p)])
        assert float(row["auc_std"]) == pytest.approx(statistics.stdev(aucs))
        assert float(row["logloss_mean"]) == pytest.approx(statistics.fmean(losses))
        assert float(row["logloss_std"]) == pytest.approx(statistics.stdev(losses))
        if p == 0.5:
            assert float(row["baseline_auc_mean"]) == pytest.approx(means[(lr, p)] - 0.1)
        else:
            assert row["baseline_auc_mean"] == ""
    assert [(json.loads(r["optim.sparse.lr"]), json.loads(r["model.dropout"])) for r in table] == [
        (0.01, 0.5), (0.01, 0), (0.1, 0.5), (0.1, 0)]
    assert v.winner.setting == {"optim.sparse.lr": 0.01, "model.dropout": 0.5}
    assert v.runner_up.setting == {"optim.sparse.lr": 0.01, "model.dropout": 0}
    assert v.margin == pytest.approx(means[(0.01, 0.5)] - means[(0.01, 0)])
    md = (directory / "sweep.md").read_text().splitlines()
    assert md[2].startswith("| optim.sparse.lr=0.01, model.dropout=0.5 | 0.7867 |") and md[2].endswith(" 0.6867 |")
    assert md[3].endswith(" - |")

    for index, setting in enumerate([(0.01, 0), (0.01, 0.5), (0.1, 0), (0.1, 0.5)]):
        run = directory / "hparams" / slug(index, {"optim.sparse.lr": setting[0], "model.dropout": setting[1]})
        events = EventAccumulator(str(run))
        events.Reload()
        (mean,) = events.Scalars("hparam/auc")  # the mean over its seeds, in every run's column
        (std,) = events.Scalars("sweep/auc_std")
        (loss,) = events.Scalars("hparam/logloss")
        aucs = [AUC[(*setting, s)] for s in range(3)]
        assert mean.value == pytest.approx(statistics.fmean(aucs), abs=1e-6)
        assert std.value == pytest.approx(statistics.stdev(aucs), abs=1e-6)
        assert loss.value == pytest.approx(statistics.fmean(logloss((*setting, s)) for s in range(3)), abs=1e-6)
