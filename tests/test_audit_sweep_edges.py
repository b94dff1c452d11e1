"""dlrm.sweep edge cases: a setting whose mean AUC is NaN never wins nor hides the real best, and values that are
the same config value (0 and 0.0) are refused as a duplicate."""

from __future__ import annotations

import csv
import json
import math

import pytest

from dlrm.config import ConfigError
from dlrm.sweep import SettingResult, parse_set, run_sweep, verdict
from tests.test_sweep import BASE


def test_a_nan_setting_ranks_last_and_the_best_still_wins():
    a = SettingResult(0, {"x": 1}, [{"auc": 0.70}])
    b = SettingResult(1, {"x": 2}, [{"auc": float("nan")}])  # e.g. a one-class or NaN-logit evaluation
    c = SettingResult(2, {"x": 3}, [{"auc": 0.80}])
    v = verdict([a, b, c])
    assert v.winner is c and v.runner_up is a  # was: winner a (0.70), runner-up b, margin nan
    assert v.margin == pytest.approx(0.10)


AUC = {(0.01, 0): 0.70, (0.01, 1): 0.72, (0.03, 0): float("nan"), (0.03, 1): 0.90, (0.1, 0): 0.75, (0.1, 1): 0.77}


def test_the_tables_put_a_nan_setting_last(tmp_path):
    from tests.conftest import make_dataset

    make_dataset(tmp_path / "ds", {"train": 16, "validation": 8}, row_group_size=8)
    raw = json.loads(json.dumps(BASE))
    raw["data"]["path"] = str(tmp_path / "ds")
    (tmp_path / "tiny.json").write_text(json.dumps(raw))

    def train(cfg, run_dir):
        auc = AUC[(cfg.optim.sparse.lr, cfg.train.seed)]
        return {"auc": auc, "logloss": 0.5, "steps": 4, "run_dir": str(run_dir)}

    directory, v = run_sweep(str(tmp_path / "tiny.json"), [parse_set("optim.sparse.lr=0.01,0.03,0.1")], 2,
                             tb_dir=str(tmp_path), run_name="sw", train_fn=train)
    assert v.winner.setting == {"optim.sparse.lr": 0.1} and v.runner_up.setting == {"optim.sparse.lr": 0.01}
    assert v.margin == pytest.approx(0.05)
    table = list(csv.DictReader(open(directory / "sweep.csv")))
    assert [r["optim.sparse.lr"] for r in table] == ["0.1", "0.01", "0.03"]
    assert table[2]["auc_mean"] == table[2]["auc_std"] == ""  # NaN: an empty cell, as summary.json's null
    assert float(table[0]["auc_std"]) == pytest.approx(0.02 / math.sqrt(2))
    md = (directory / "sweep.md").read_text().splitlines()
    assert md[2].startswith("| optim.sparse.lr=0.1 | 0.7600 |") and md[4].startswith("| optim.sparse.lr=0.03 | n/a (one class) | n/a |")


@pytest.mark.parametrize("option", ["model.dropout=0,0.0", "optim.sparse.lr=0.01,1e-2",
                                    "model.bottom_mlp=[8,4],[8.0,4]"])
def test_a_number_written_twice_differently_is_listed_twice(option):
    with pytest.raises(ConfigError, match="listed twice"):
        parse_set(option)


def test_distinct_close_floats_are_kept_apart():
    assert parse_set("optim.sparse.lr=0.1,0.10000001")[1] == [0.1, 0.10000001]
    assert parse_set("train.compile.enabled=true,1")[1] == [True, 1]  # a bool is not the number 1


# -- --compare: a variant that fails after training steps keeps its run directory ------------------------------------


def _compare_cfg(tmp_path):
    from dlrm.config import load_config
    from tests.conftest import REPO

    return load_config(REPO / "configs" / "sample.json", {"log.tb_dir": str(tmp_path / "tb"), "train.device": "cpu",
                                                         "log.run_name": "cmp"})


def test_a_first_variant_failing_mid_run_keeps_its_directory(tmp_path):
    """The trainer keeps a run directory once a step ran (its events, its checkpoints); --compare removed the
    whole base directory, that run included, when the first variant failed, as if nothing had started."""
    from dlrm.errors import NonFiniteLoss
    from dlrm.train.compare import run_comparison

    def train(cfg, run_dir):
        run_dir.mkdir(parents=True)
        (run_dir / "step-100.ckpt").write_text("history")  # what the failed run kept (the trainer's rule)
        raise NonFiniteLoss("loss became NaN or Inf at step 101; stopped")

    with pytest.raises(NonFiniteLoss):
        run_comparison(_compare_cfg(tmp_path), ["eager", "compiled"], train)
    assert (tmp_path / "tb" / "cmp" / "eager" / "step-100.ckpt").read_text() == "history"


def test_a_first_variant_failing_before_its_first_step_leaves_nothing(tmp_path):
    from dlrm.train.compare import run_comparison

    def train(cfg, run_dir):  # the trainer removed its own directory: no step ran
        raise RuntimeError("out of memory building the model")

    with pytest.raises(RuntimeError, match="out of memory"):
        run_comparison(_compare_cfg(tmp_path), ["eager", "compiled"], train)
    assert not (tmp_path / "tb" / "cmp").exists()


def test_all_nan_aucs_finish_the_sweep_with_a_verdict_that_says_so():
    """A one-class validation split makes every AUC NaN: `statistics.stdev` raised AttributeError on the NaNs
    (Python 3.11), after every trial had run and before any table was written."""
    nan = float("nan")
    a = SettingResult(0, {"x": 1}, [{"auc": nan, "logloss": 0.6}, {"auc": nan, "logloss": 0.5}])
    b = SettingResult(1, {"x": 2}, [{"auc": nan, "logloss": 0.7}, {"auc": nan, "logloss": 0.4}])
    v = verdict([a, b])
    assert v.winner is a and v.beyond_noise is None and math.isnan(v.noise)
    # no winner named (the grid's first was, by its order alone), the mean loglosses lowest first
    assert v.text() == ("no winner: no setting has an AUC (a trial's validation split has one class, or its scores "
                        "are NaN); mean validation logloss, lowest first: x=1 0.5500, x=2 0.5500"), v.text()
    row = a.row()
    assert math.isnan(row["auc_std"]) and row["logloss_std"] == pytest.approx(0.0707107, abs=1e-6)
