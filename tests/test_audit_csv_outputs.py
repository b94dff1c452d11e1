"""The CSV and Markdown reports users post-process: one spelling of a missing or undefined value in every CSV the app
writes (an empty cell, as summary.json's null), and the Markdown reports say why a value is missing as the others do.

1. trials.csv wrote a one-class split's undefined AUC as "nan" for a trial trained in the session and as an empty cell
   for one gathered by ``sweep --resume`` (null read back from its summary.json): the tables of a resumed sweep
   differed from those of the same sweep uninterrupted; sweep.csv wrote "nan" for the means.
2. sweep.md gave a setting whose trials all failed the AUC "n/a (NaN scores)" and a logloss of "nan", as if it had
   trained to NaN scores.
3. compare.md wrote a one-class AUC as a plain "n/a" (the other reports: "n/a (one class)"); compare.csv wrote "nan".
4. The benchmarks' write_csv wrote a failed case's NaN time as "nan" beside empty cells for its other missing values.
Fake trainers keep it fast.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

import pandas as pd
import pytest

from dlrm.config import load_config
from dlrm.sweep import parse_set, run_sweep
from dlrm.train.reporting import write_summary
from tests.conftest import REPO, make_dataset
from tests.test_sweep import BASE

NAN = float("nan")


@pytest.fixture
def tiny_config(tmp_path):
    make_dataset(tmp_path / "ds", {"train": 16, "validation": 8}, row_group_size=8)
    raw = json.loads(json.dumps(BASE))
    raw["data"]["path"] = str(tmp_path / "ds")
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(raw))
    return path


def one_class_trial(cfg, run_dir=None, resume=None):
    """A finished trial of a one-class validation split: NaN AUCs in memory, null in its summary.json (as the
    trainer returns and writes them)."""
    summary = {"auc": NAN, "logloss": 0.5 + cfg.train.seed / 10, "steps": 4, "run_dir": str(run_dir),
               "best": {"metric": "logloss", "auc": NAN, "logloss": 0.5, "step": 4},
               "baseline": {"auc": NAN, "logloss": 0.6}}
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    write_summary(Path(run_dir) / "summary.json", summary)
    return summary


def _tables(directory: Path) -> dict[str, str]:
    return {name: (directory / name).read_text() for name in ("trials.csv", "sweep.csv", "sweep.md")}


def test_an_undefined_auc_is_an_empty_cell_in_the_sweep_csvs_trained_or_resumed(tmp_path, tiny_config):
    from dlrm.sweep_resume import resume_sweep

    directory, _ = run_sweep(str(tiny_config), [parse_set("optim.sparse.lr=0.01,0.03")], 2, tb_dir=str(tmp_path),
                             run_name="sw", train_fn=one_class_trial)
    trained = _tables(directory)
    resume_sweep(directory, train_fn=one_class_trial)  # every trial gathered from its summary.json
    assert _tables(directory) == trained  # the report of the resumed sweep is the uninterrupted one's
    trials = list(csv.DictReader(trained["trials.csv"].splitlines()))
    assert len(trials) == 4 and all(r["auc"] == r["best_auc"] == r["baseline_auc"] == "" for r in trials), trials
    assert [r["logloss"] for r in trials] == ["0.5", "0.6", "0.5", "0.6"]
    settings = list(csv.DictReader(trained["sweep.csv"].splitlines()))
    assert all(r["auc_mean"] == r["auc_std"] == r["baseline_auc_mean"] == "" for r in settings), settings
    assert "nan" not in trained["trials.csv"] + trained["sweep.csv"].replace("nan nan", "")  # (aucs: a list's text)
    frame = pd.read_csv(directory / "trials.csv")
    assert frame["auc"].dtype == float and frame["auc"].isna().all() and frame["logloss"].tolist() == [0.5, 0.6] * 2


def test_a_setting_whose_trials_all_failed_reads_n_a_not_nan_scores(tmp_path, tiny_config):
    def train(cfg, run_dir):
        if cfg.optim.sparse.lr == 0.03:
            raise RuntimeError("boom")
        return {"auc": 0.7 + cfg.train.seed / 100, "logloss": 0.5, "steps": 4, "run_dir": str(run_dir)}

    with pytest.raises(RuntimeError, match="boom"):
        run_sweep(str(tiny_config), [parse_set("optim.sparse.lr=0.01,0.03")], 2, tb_dir=str(tmp_path), run_name="sw",
                  train_fn=train)
    md = (tmp_path / "sw" / "sweep.md").read_text().splitlines()
    assert md[2].startswith("| optim.sparse.lr=0.01 | 0.7050 | 0.0071 | 0.5000 | 0.0000 | 2 | 0 |"), md
    assert md[3] == "| optim.sparse.lr=0.03 | n/a | n/a | n/a | n/a | 0 | 2 |", md
    settings = list(csv.DictReader(open(tmp_path / "sw" / "sweep.csv")))
    assert [settings[1][k] for k in ("auc_mean", "auc_std", "logloss_mean", "logloss_std")] == ["", "", "", ""]


def one_class_variant(cfg, run_dir):
    run_dir.mkdir(parents=True)
    return {"samples_per_sec": 1000.0, "warmup_s": NAN, "peak_memory_bytes": None, "final_train_loss": 0.3,
            "auc": NAN, "logloss": 0.5, "compile": {"graph_breaks": 0}, "train_losses": [(2, 0.5), (4, 0.3)],
            "resolved": {"compile": False}}


def test_compare_reports_an_undefined_auc_as_the_other_reports_do(tmp_path):
    from dlrm.train.compare import run_comparison

    cfg = load_config(REPO / "configs" / "sample.json", {"log.tb_dir": str(tmp_path / "tb"), "train.device": "cpu",
                                                         "log.run_name": "cmp"})
    run_comparison(cfg, ["eager"], one_class_variant)
    base = tmp_path / "tb" / "cmp"
    row = (base / "compare.md").read_text().splitlines()[-1]
    assert row == "| eager | 1,000 | n/a | n/a | n/a | 0.30000 | 0.00e+00 | n/a (one class) | n/a | ok |", row
    written = list(csv.DictReader(open(base / "compare.csv")))
    assert written[0]["auc"] == "" and written[0]["warmup_s"] == "", written
    frame = pd.read_csv(base / "compare.csv")
    assert list(frame.columns)[-3:] == ["auc", "graph_breaks", "status"] and frame["auc"].isna().all()


def test_benchmark_csvs_write_an_unmeasured_value_as_an_empty_cell(tmp_path):
    sys.path.append(str(REPO / "benchmarks"))
    from _common import write_csv

    rows = [{"impl": "a", "ms": 1.5, "gb_per_s": 2.0, "status": "ok"},
            {"impl": "b", "ms": NAN, "gb_per_s": float("inf"), "status": "failed: x"},
            {"impl": "c", "status": "failed: y"}]
    write_csv(tmp_path / "r.csv", rows, ["impl", "ms", "gb_per_s", "status"], {"device": "CPU"})
    lines = (tmp_path / "r.csv").read_text().splitlines()
    assert lines[2:] == ["b,,,failed: x,CPU", "c,,,failed: y,CPU"], lines
    frame = pd.read_csv(tmp_path / "r.csv")
    assert frame["ms"].tolist()[0] == 1.5 and math.isnan(frame["ms"].tolist()[1])
