"""The README's first command: train configs/sample.json on the embedded sample, on the CPU,
and get within 0.02 of the AUC of the planted teacher."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dlrm.data.schema import read_metadata
from tests.conftest import REPO, process_output


@pytest.mark.slow
def test_sample_config_reaches_the_oracle_auc(tmp_path):
    res = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "--config", "configs/sample.json", "--device", "cpu",
         "--tb-dir", str(tmp_path / "tb"), "--run-name", "e2e"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, process_output(res)
    run = tmp_path / "tb" / "e2e"
    summary = json.loads((run / "summary.json").read_text())
    for key in ("auc", "logloss", "accuracy", "steps", "samples", "samples_per_sec", "wall_s", "config"):
        assert key in summary, key
    oracle = read_metadata(REPO / "data" / "sample").extra["oracle_auc"]["validation"]
    assert summary["auc"] >= oracle - 0.02, (summary["auc"], oracle)
    assert summary["auc"] <= oracle + 0.01  # the teacher's probabilities are the best possible ranking
    assert 0.0 < summary["logloss"] < 0.5 and 0.75 < summary["accuracy"] < 1.0
    assert json.loads((run / "config.json").read_text()) == summary["config"]
    assert f"AUC {summary['auc']:.4f}" in res.stderr  # the final metrics are printed

    events = EventAccumulator(str(run))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    for tag in ("train/loss", "train/lr_dense", "train/lr_sparse", "train/samples_per_sec", "train/data_wait_fraction",
                "eval/auc", "eval/logloss", "eval/accuracy"):
        assert tag in scalars, (tag, sorted(scalars))
    waits = [e.value for e in events.Scalars("train/data_wait_fraction")]
    assert all(0.0 <= w < 1.0 for w in waits) and 0.0 <= summary["data_wait_fraction"] < 1.0
    assert events.Scalars("eval/auc")[-1].value == pytest.approx(summary["auc"], abs=1e-6)
