"""What a run reports, scalar by scalar and clause by clause (`dlrm.train.reporting`, `dlrm.logging_setup`): each
TensorBoard scalar under its tag at its step, the final log line's numbers under their own names."""

import re

import pytest
from loguru import logger

from dlrm.logging_setup import configure_logging
from dlrm.train.reporting import final_line, log_eval, log_train


class Writer:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))


def test_log_train_writes_every_scalar_at_the_windows_step():
    w = Writer()
    log_train(w, 40, 0.4567, (0.01, 0.05), 12_345.0, 0.125)
    assert sorted(w.scalars) == sorted([("train/loss", 0.4567, 40), ("train/lr_dense", 0.01, 40),
                                        ("train/lr_sparse", 0.05, 40), ("train/samples_per_sec", 12_345.0, 40),
                                        ("train/data_wait_fraction", 0.125, 40)])  # fmt: skip
    w = Writer()
    log_train(w, 3, 0.7, (0.02, 0.03), None, None)  # a warm-up window: no rate, no waiting share
    assert sorted(w.scalars) == [("train/loss", 0.7, 3), ("train/lr_dense", 0.02, 3), ("train/lr_sparse", 0.03, 3)]
    w = Writer()
    log_train(w, 8, 0.7, (0.02, 0.03), 100.0, 0.0)  # a loader that kept up: 0 is a measurement, logged
    assert ("train/data_wait_fraction", 0.0, 8) in w.scalars and ("train/samples_per_sec", 100.0, 8) in w.scalars


def test_log_eval_writes_each_metric_at_the_evaluations_step():
    w = Writer()
    metrics = {"auc": 0.8, "logloss": 0.45, "accuracy": 0.79}
    assert log_eval(w, metrics, 120) == metrics
    assert sorted(w.scalars) == sorted((f"eval/{k}", v, 120) for k, v in metrics.items())


def summary(**overrides):
    base = {"split": "test", "auc": 0.81234, "logloss": 0.43219, "accuracy": 0.77771, "oracle_auc": None,
            "steps": 1200, "samples": 1_234_567, "samples_per_sec": 98_765.4, "data_wait_fraction": None,
            "wall_s": 12.34, "best": None, "early_stopped": False}
    return {**base, **overrides}


def test_final_line_names_each_number():
    line = final_line(summary())
    assert line.startswith("test: AUC 0.8123, logloss 0.4322, accuracy 0.7777; 1200 steps, 1,234,567 samples, "
                           "98,765 samples/s, 12.3s")
    assert "oracle" not in line and "waiting" not in line and "best" not in line
    line = final_line(summary(oracle_auc=0.85, data_wait_fraction=0.0))
    assert "(oracle AUC 0.8500)" in line and "(waiting for data 0% of the time)" in line
    assert "(waiting for data 25% of the time)" in final_line(summary(data_wait_fraction=0.25))


def test_final_line_names_an_earlier_best_and_an_early_stop():
    best = {"step": 800, "metric": "logloss", "auc": 0.8, "logloss": 0.4301, "accuracy": 0.77, "checkpoint": "b.pt"}
    assert "best" not in final_line(summary(best={**best, "step": 1200}))  # the final evaluation is the best
    line = final_line(summary(best=best, early_stopped=True))
    assert line.endswith("; best logloss 0.4301 at step 800 (early stopped), kept as b.pt")
    line = final_line(summary(best={**best, "metric": "auc"}))
    assert line.endswith("; best auc 0.8000 at step 800, kept as b.pt")


@pytest.fixture
def restore_logging():
    yield
    configure_logging()  # loguru's sink back on the real stderr (the test's is captured and closed after it)


def test_configure_logging_keeps_one_sink_at_the_level_given(capsys, restore_logging):
    """Called again (as every entry point does), it replaces its sink: each record once, at the last level given."""
    configure_logging("DEBUG")
    configure_logging("WARNING")
    logger.info("not shown")
    logger.warning("shown once")
    err = capsys.readouterr().err
    assert "not shown" not in err
    assert re.fullmatch(r"\d\d:\d\d:\d\d WARNING shown once\n", err), err
