"""The DLRM's final logloss against the logloss of predicting the train click rate (dlrm.train.logloss_check).

QA: on the real samples of ../shared/criteo, criteo-small.json (200 steps on 165 train rows) ended at AUC 0.71 and
logloss 1.10, worse than the 0.56 of predicting the train click rate for every row, and nothing said so: only the
baseline's own line was flagged. Here random labels and many epochs on 120 rows provoke the same memorization."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from loguru import logger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dlrm.config import load_config
from dlrm.train.logloss_check import binary_logloss, flag_clause, logloss_flag
from tests.conftest import make_dataset


def constant_logloss(train_labels: np.ndarray, labels: np.ndarray) -> float:
    """float64, by hand: predict the train rate for every row of `labels`."""
    rate = train_labels.mean()
    return float(-np.mean(labels * np.log(rate) + (1 - labels) * np.log(1 - rate)))


def test_an_overfitted_run_is_flagged_in_the_final_line_summary_and_tensorboard(tmp_path):
    from dlrm.train.trainer import train

    arrays = make_dataset(tmp_path / "ds", {"train": 120, "validation": 40}, row_group_size=30)
    raw = {"data": {"path": str(tmp_path / "ds"), "batch_size": 16, "shuffle": True},
           "model": {"embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [32, 1]},
           "optim": {"dense": {"name": "adam", "lr": 0.01}},
           "train": {"epochs": 25, "log_every": 50, "device": "cpu", "seed": 0, "baseline": False},
           "log": {"tb_dir": str(tmp_path / "tb"), "run_name": "memorize"}}
    (tmp_path / "c.json").write_text(json.dumps(raw))
    lines = []
    handle = logger.add(lambda m: lines.append(m.record["message"]), level="INFO")
    try:
        summary = train(load_config(tmp_path / "c.json"))
    finally:
        logger.remove(handle)
    train_labels, labels = arrays["train"]["label"], arrays["validation"]["label"]
    constant = constant_logloss(train_labels, labels)
    assert summary["constant_logloss"] == pytest.approx(constant, rel=1e-12)
    assert summary["train_rate"] == pytest.approx(train_labels.mean()) and summary["train_rows"] == 120
    assert summary["train_constant_logloss"] == pytest.approx(constant_logloss(train_labels, train_labels), rel=1e-12)
    # the labels are random: the model memorizes train and is confidently wrong on validation
    assert summary["final_train_loss"] < 0.3 * summary["train_constant_logloss"]
    assert summary["logloss"] > constant + 0.1
    saved = json.loads((tmp_path / "tb" / "memorize" / "summary.json").read_text())
    assert saved["constant_logloss"] == pytest.approx(constant, rel=1e-12)

    line = lines[-1]
    assert line.startswith(f"validation: AUC {summary['auc']:.4f}, logloss {summary['logloss']:.4f}")
    assert (f"; WARNING: the DLRM's validation logloss {summary['logloss']:.4f} is worse than {constant:.4f}, the "
            f"logloss of predicting the train click rate {train_labels.mean():.4f} for every row: it overfits the 120 "
            f"train rows (train loss {summary['final_train_loss']:.4f})") in line
    assert "train.early_stopping" in line and "train.epochs" in line

    events = EventAccumulator(str(tmp_path / "tb" / "memorize"), size_guidance={"tensors": 0})
    events.Reload()
    texts = events.Tensors("eval/logloss_worse_than_constant")
    assert [t.step for t in texts] == [summary["steps"]]
    text = texts[0].tensor_proto.string_val[0].decode()
    assert text.startswith(f"The DLRM's validation logloss {summary['logloss']:.4f} is worse than {constant:.4f}")


BASE = {"logloss": 0.70, "constant_logloss": 0.56, "train_rate": 0.25, "train_rows": 165, "split": "validation",
        "train_constant_logloss": 0.57, "final_train_loss": 0.01, "best": None}


def test_no_flag_when_the_logloss_beats_the_constant_or_the_numbers_are_missing():
    assert logloss_flag({**BASE, "logloss": 0.55}) is None and flag_clause({**BASE, "logloss": 0.55}) == ""
    assert logloss_flag({**BASE, "logloss": 0.56}) is None  # equal is not worse
    assert logloss_flag({k: v for k, v in BASE.items() if k != "constant_logloss"}) is None  # an old summary


def test_the_advice_fits_the_train_loss_and_the_best_model():
    overfit = logloss_flag(BASE)
    assert "overfits the 165 train rows (train loss 0.0100)" in overfit and "train.early_stopping" in overfit
    # a train loss no better than the constant's on train: not memorization, so no advice to stop early
    unfit = logloss_flag({**BASE, "final_train_loss": 0.60, "steps": 3})
    assert "its train loss 0.6000 is no better than the constant's on train (0.5700): it has not fitted the train " \
           "rows in 3 steps; train longer" in unfit
    assert "overfits" not in unfit and "early" not in unfit
    # an earlier evaluation beat the constant and its model was kept: pointed at, rather than advice already taken
    kept = logloss_flag({**BASE, "best": {"step": 35, "logloss": 0.5415, "checkpoint": "/r/checkpoints/best.pt"}})
    assert "the evaluation at step 35 beat it (logloss 0.5415)" in kept and "overfits" not in kept
    # a best evaluation no better than the constant is no answer
    assert "overfits" in logloss_flag({**BASE, "best": {"step": 3, "logloss": 0.6, "checkpoint": "b.pt"}})


@pytest.mark.parametrize("rate, positives, rows", [(0.25, 25, 101), (0.2545, 0, 7), (0.5, 3, 3)])
def test_binary_logloss_is_the_mean_bce_of_the_constant(rate, positives, rows):
    labels = np.array([1.0] * positives + [0.0] * (rows - positives))
    expected = -np.mean(labels * math.log(rate) + (1 - labels) * math.log(1 - rate))
    assert binary_logloss(rate, positives, rows) == pytest.approx(expected, rel=1e-12)
    assert math.isfinite(binary_logloss(0.0, 1, 2)) and math.isfinite(binary_logloss(1.0, 1, 2))  # one-class train


def test_the_final_lines_baseline_clause_is_flagged_alike():
    """The baseline's own line said "worse than 0.5597, the logloss of predicting the train click rate"; the final
    line repeated its logloss plainly (the real samples: 0.6422 against 0.5597)."""
    from dlrm.train.baseline import baseline_clause

    base = {"auc": 0.6863, "logloss": 0.6422, "constant_logloss": 0.5597}
    assert baseline_clause({"auc": 0.7105, "baseline": base}) == \
        ("; baseline (logistic regression) AUC 0.6863, logloss 0.6422 (worse than the train click rate's 0.5597) "
         "(DLRM +0.0242 AUC)")
    assert baseline_clause({"auc": 0.7105, "baseline": {**base, "logloss": 0.55}}) == \
        "; baseline (logistic regression) AUC 0.6863, logloss 0.5500 (DLRM +0.0242 AUC)"
