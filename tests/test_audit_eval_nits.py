"""A one-class evaluation split's undefined AUC, in every place a run reports it, and the baseline's "auto" budget.

1. A split of one class (every click 0, or every click 1) has no AUC (NaN; null in summary.json). The log lines said
   "auc nan", "AUC nan" and "(DLRM +nan AUC)"; TensorBoard got NaN ``eval/auc``, ``baseline/auc`` and ``hparam/auc``
   points; the sweep's table and verdict "nan" and "+nan AUC"; and ``--resume`` of a sweep whose finished trial had a
   null AUC ended in a format TypeError. Now each says "n/a (one class)", TensorBoard has a text note instead of a NaN
   point, summary.json stays strict JSON.
2. Best evaluation and early stopping by an undefined AUC: every evaluation counted as a new best (best.pt the latest,
   whatever its logloss) and a patience never ran out, a target never reached. Early stopping on AUC is now refused
   before training, and without early stopping the best evaluation is the one of the lowest logloss.
3. ``train.baseline: "auto"`` counted the train split's rows; a multi-hot row holds ``sum(multi_hot_sizes)`` values
   (MLPerf's 214), each one a gathered weight in the fit: it now budgets the values.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from loguru import logger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dlrm.config import ConfigError, load_config
from dlrm.data.schema import NUM_DENSE, NUM_SPARSE, Metadata, SplitInfo, write_metadata
from dlrm.train.trainer import train
from tests.conftest import write_rows

CONFIG = {
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "optim": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.05}},
    "train": {"epochs": 1, "max_steps": 6, "log_every": 3, "device": "cpu", "seed": 3, "eval_every": 1},
    "checkpoint": {"every": 3, "keep": 5},
}


def one_class_dataset(root, validation_label: int = 0):
    """64 train rows of both classes; a 16-row validation split of `validation_label` only."""
    rng = np.random.default_rng(0)
    splits = {}
    for split, n in (("train", 64), ("validation", 16)):
        label = rng.integers(0, 2, n) if split == "train" else np.full(n, validation_label)
        dense, sparse = rng.integers(-3, 1000, (n, NUM_DENSE)), rng.integers(-1, 2**32, (n, NUM_SPARSE))
        write_rows(root / f"{split}/part-0.parquet", label, dense, sparse, 16)
        splits[split] = SplitInfo(rows=n, positives=int(label.sum()), files=[f"{split}/part-0.parquet"])
    write_metadata(root, Metadata(cardinalities=[11] * NUM_SPARSE, splits=splits))
    return root


def config_file(tmp_path, data, **train):
    raw = json.loads(json.dumps(CONFIG))
    raw["data"] = {"path": str(data), "batch_size": 8, "shuffle": True}
    raw["train"].update(train)
    raw["log"] = {"tb_dir": str(tmp_path / "tb"), "run_name": "r"}
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(raw))
    return path


@pytest.fixture
def log_lines():
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m).rstrip("\n")), level="INFO", format="{message}")
    yield lines
    logger.remove(sink)


def _strict(text: str):
    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


# -- 1. the reports say n/a (one class) -----------------------------------------------------------------------------


@pytest.mark.parametrize("label", [0, 1])
def test_a_one_class_split_reports_its_auc_as_undefined_not_nan(tmp_path, log_lines, label):
    data = one_class_dataset(tmp_path / "ds", label)
    summary = train(load_config(config_file(tmp_path, data, eval_every=3, baseline=True)))
    assert math.isnan(summary["auc"]) and math.isnan(summary["baseline"]["auc"])
    evals = [line for line in log_lines if ": eval " in line]
    assert len(evals) == 2 and all(line.split(": eval ")[1].startswith("auc n/a (one class), logloss ") for line in evals)
    final = next(line for line in log_lines if line.startswith("validation: AUC"))
    assert final.startswith("validation: AUC n/a (one class), logloss ")
    assert "baseline (logistic regression) AUC n/a (one class)" in final and "(the DLRM's AUC margin n/a)" in final
    base = next(line for line in log_lines if line.startswith("baseline ("))
    assert "validation AUC n/a (one class), logloss" in base
    assert not any("nan" in line.lower() for line in evals + [final, base]), [final, base]
    on_disk = _strict((tmp_path / "tb" / "r" / "summary.json").read_text())  # strict JSON: null, not NaN
    assert on_disk["auc"] is None and on_disk["baseline"]["auc"] is None and math.isfinite(on_disk["logloss"])
    events = EventAccumulator(str(tmp_path / "tb" / "r"), size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert "eval/logloss" in scalars and "hparam/logloss" in scalars and "baseline/logloss" in scalars
    assert not {"eval/auc", "hparam/auc", "baseline/auc"} & set(scalars)  # no NaN points
    notes = events.Tensors("eval/auc_undefined")
    assert [n.step for n in notes] == [3, 6]
    assert notes[0].tensor_proto.string_val[0].decode() == "AUC n/a (one class): undefined on this split"


def test_eval_only_of_a_one_class_split_says_undefined(tmp_path, log_lines):
    from dlrm.train.export import evaluate_checkpoint

    data = one_class_dataset(tmp_path / "ds")
    summary = train(load_config(config_file(tmp_path, data, baseline=False)))
    cfg = load_config(config_file(tmp_path, data), {"log.run_name": "ev"})
    evaluate_checkpoint(cfg, summary["checkpoint"], "validation")
    assert log_lines[-1].startswith("validation: AUC n/a (one class), logloss "), log_lines[-1]
    assert _strict((tmp_path / "tb" / "ev" / "summary.json").read_text())["auc"] is None


def _one_class_sweep(tmp_path):
    from dlrm.sweep import parse_set, run_sweep

    data = one_class_dataset(tmp_path / "ds")
    config = config_file(tmp_path, data, max_steps=2, eval_every=2, baseline=False)
    return run_sweep(str(config), [parse_set("optim.sparse.lr=0.05,0.1")], 1, tb_dir=str(tmp_path / "tb"),
                     run_name="sw")


def test_a_sweep_of_a_one_class_split_reports_n_a(tmp_path):
    """The sweep's table and verdict said "nan" and "+nan AUC"."""
    directory, v = _one_class_sweep(tmp_path)
    md = (directory / "sweep.md").read_text()
    assert md.splitlines()[2].split(" | ")[1:3] == ["n/a (one class)", "n/a"], md
    assert "| nan |" not in md and "+nan" not in md and "(nan)" not in md, md
    # no setting has an AUC: no winner (the grid's first was named best), the mean loglosses beside it
    assert v.text().startswith("no winner: no setting has an AUC (a trial's validation split has one class"), v.text()


def test_a_sweep_resume_gathers_finished_trials_of_a_null_auc(tmp_path, log_lines):
    """--resume read the finished trials' null AUC back from summary.json and ended in "TypeError: unsupported format
    string passed to NoneType.__format__" (a traceback) before gathering them."""
    from dlrm.sweep_resume import resume_sweep

    directory, v = _one_class_sweep(tmp_path)
    directory, again = resume_sweep(directory)
    assert again.winner.setting == v.winner.setting and math.isnan(again.margin)
    gathered = [line for line in log_lines if "finished earlier" in line]
    assert len(gathered) == 2 and all(line.endswith(": AUC n/a (one class)") for line in gathered), gathered


# -- 2. the best evaluation and early stopping -----------------------------------------------------------------------


def test_early_stopping_on_auc_of_a_one_class_split_is_refused_before_training(tmp_path):
    data = one_class_dataset(tmp_path / "ds")
    for early in ({"metric": "auc", "patience": 1}, {"metric": "auc", "patience": None, "target": 0.9}):
        cfg = load_config(config_file(tmp_path, data, early_stopping=early))
        # it trained every step: the patience never ran out (each NaN was a new best), the target was never reached
        with pytest.raises(ConfigError, match=r"^train\.early_stopping\.metric 'auc': data\.eval_split 'validation' "
                                              r"holds one class \(16 rows, 0 positives\): its AUC is undefined"):
            train(cfg)
        assert not (tmp_path / "tb" / "r").exists()  # nothing left behind


def test_early_stopping_on_logloss_of_a_one_class_split_still_works(tmp_path):
    data = one_class_dataset(tmp_path / "ds")
    summary = train(load_config(config_file(tmp_path, data, max_steps=8, baseline=False,
                                            early_stopping={"metric": "logloss", "patience": 1})))
    assert summary["best"]["metric"] == "logloss" and summary["early_stopped"] and summary["steps"] < 8


def test_the_best_evaluation_of_a_one_class_split_is_the_lowest_logloss(tmp_path, log_lines):
    """By the undefined AUC every evaluation was a new best: best.pt was the last evaluation's model (here the one of
    the highest logloss), rewritten at every evaluation."""
    data = one_class_dataset(tmp_path / "ds")
    summary = train(load_config(config_file(tmp_path, data, max_steps=8, baseline=False)))
    losses = [float(line.split("logloss ")[1].split(",")[0]) for line in log_lines if ": eval " in line]
    assert len(losses) == 8
    best = summary["best"]
    assert best["metric"] == "logloss" and best["step"] == 1 + losses.index(min(losses)) != 8
    assert best["logloss"] == pytest.approx(min(losses), abs=1e-4)
    assert f"best logloss {best['logloss']:.4f} at step {best['step']}" in log_lines[-1]
    assert any("holds one class" in line and "lowest logloss" in line for line in log_lines)


# -- 3. the baseline's "auto" budget counts a multi-hot row's values -------------------------------------------------


def test_baseline_auto_budgets_the_values_of_a_multi_hot_split(tmp_path, monkeypatch, log_lines):
    from dlrm.data.synthetic import MULTI_HOT_PRESETS
    from dlrm.train import baseline as baseline_mod

    # the metadata of a multi-hot dataset of MLPerf's sizes (214 values a row), 160 train rows
    meta = Metadata(cardinalities=[11] * NUM_SPARSE, multi_hot_sizes=MULTI_HOT_PRESETS["mlperf"],
                    splits={"train": SplitInfo(160, 80, ["train/part-0.parquet"]),
                            "validation": SplitInfo(40, 20, ["validation/part-0.parquet"])})
    assert meta.sparse_width == 214
    fitted = []  # the fit itself stubbed: only the decision is under test (the metadata decides it, no file is read)
    monkeypatch.setattr(baseline_mod, "split_files", lambda *args: [])
    monkeypatch.setattr(baseline_mod, "ParquetLoader", lambda *args, **kwargs: [])
    monkeypatch.setattr(baseline_mod, "RowHasher", lambda *args, **kwargs: None)
    monkeypatch.setattr(baseline_mod, "fit_and_evaluate", lambda *args: fitted.append(1) or {
        "auc": 0.7, "logloss": 0.5, "model": "stub", "l2": 0.1, "iterations": 1, "converged": True, "seconds": 0.0,
        "train_objective": 0.4, "train_logloss": 0.4, "train_rate": 0.5, "constant_logloss": 0.69, "train_rows": 160,
        "weights": 300})
    cfg = load_config(config_file(tmp_path, tmp_path / "mh", baseline="auto"))
    tables = type("Tables", (), {"cardinalities": meta.cardinalities, "vocabs": None,
                                 "multi_hot_sizes": meta.multi_hot_sizes})()
    # a limit of 1,000 rows of 26 values: 26,000 values; the split holds 160 x 214 = 34,240 (it was fitted: 160 rows)
    monkeypatch.setitem(baseline_mod.AUTO_MAX_TRAIN_ROWS, "cpu", 1000)
    assert baseline_mod.run_baseline(cfg, meta, tables, torch.device("cpu")) is None and not fitted
    assert log_lines[-1] == ('baseline: off (train.baseline "auto": 160 train rows x 214 sparse values = 34,240 values '
                             '> 26,000 (1,000 rows of 26) on cpu (true fits it anyway))')
    monkeypatch.setitem(baseline_mod.AUTO_MAX_TRAIN_ROWS, "cpu", 1317)  # 34,242 values: fitted
    result = baseline_mod.run_baseline(cfg, meta, tables, torch.device("cpu"))
    assert fitted == [1] and "160 train rows x 214 sparse values = 34,240 values <= 34,242" in result["why"]
    # one-hot data: the rule and its words as before
    assert baseline_mod.baseline_wanted("auto", 1317, 1, "cpu", NUM_SPARSE) == (
        True, 'train.baseline "auto": 1,317 train rows <= 1,317 on cpu')
