"""Evaluation edges the other metric and evaluator tests leave out (audit helper).

best.pt's own run totals: an evaluation that improves on the best writes best.pt; the totals stored in it
(``run_stats``: the best evaluation, early stopping's count) must already say so. Written before the totals were
updated, best.pt held the previous best and its count, so a run continued from it (``--resume .../best.pt --run-name
NEW``, the documented way to branch from a checkpoint) compared its next evaluations with an older, worse best: a
later, worse model replaced best.pt as "the best", and early stopping counted from the wrong evaluation.

NaN logits (a model that diverged since the last logging step, evaluated before the loss check sees it): `roc_auc`
gave each NaN its own rank by position (`torch.unique` keeps NaNs apart), so such a model scored an AUC anywhere in
[0, 1] (1.0 with the split's positives last) and could replace best.pt; its AUC is NaN now, as its logloss is.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dlrm import checkpoint as ckpt
from dlrm.config import Config, EarlyStoppingConfig, load_config
from dlrm.data.batch import Batch
from dlrm.data.teacher import rank_auc
from dlrm.distributed.env import DistEnv
from dlrm.model.dlrm import build_model
from dlrm.train import evaluator as evaluator_mod
from dlrm.train.checkpointer import Checkpointer
from dlrm.train.evaluator import Evaluator
from dlrm.train.meter import RunStats
from dlrm.train.metrics import evaluate_logits, roc_auc
from dlrm.train.trainer import train
from tests.conftest import make_dataset


def scripted(monkeypatch, aucs):
    """Evaluations whose AUCs are `aucs`, in turn (logloss and accuracy fixed)."""
    queue = list(aucs)
    monkeypatch.setattr(evaluator_mod, "evaluate",
                        lambda forward, loader, env=None: {"auc": queue.pop(0), "logloss": 0.5, "accuracy": 0.75})
    return queue


class Writer:
    def add_scalar(self, *args):
        pass


def test_best_pt_stores_the_totals_of_its_own_evaluation(tmp_path, monkeypatch):
    """Three evaluations (AUC 0.60 best, 0.55, 0.70 best): best.pt holds step 3's model and totals whose best is step
    3 with the count reset to 0 (it held step 1's best, AUC 0.60, and count 1)."""
    cfg = Config()
    cfg.model.embedding_dim, cfg.model.bottom_mlp, cfg.model.top_mlp = 4, [8, 4], [8, 1]
    model = build_model(cfg.model, [3, 5], None, cfg.kernels, "cpu")
    run = SimpleNamespace(model=model, optimizers=[], schedulers=[], plan=None, eval_forward=None)
    tables = SimpleNamespace(cardinalities=[3, 5], multi_hot_sizes=None, dense_format="counts")
    checkpointer = Checkpointer(tmp_path, cfg, tables, DistEnv())
    cfg.train.early_stopping = EarlyStoppingConfig(metric="auc", patience=3)
    stats = RunStats()
    ev = Evaluator(run, [], cfg, Writer(), checkpointer, stats)
    scripted(monkeypatch, [0.60, 0.55, 0.70])
    for step in (1, 2, 3):
        ev(ckpt.Position(step, 0, step))
    best = ckpt.load_checkpoint(tmp_path / "checkpoints" / "best.pt")
    assert best["position"]["step"] == 3
    assert best["run_stats"]["best"] == stats.best == {
        "step": 3, "metric": "auc", "auc": 0.70, "logloss": 0.5, "accuracy": 0.75,
        "checkpoint": str(tmp_path / "checkpoints" / "best.pt")}
    assert best["run_stats"]["evals_since_best"] == 0


def test_a_run_branched_from_best_pt_keeps_it_as_its_best(tmp_path, monkeypatch):
    """10 steps, an evaluation every 2 (AUC 0.60, 0.55, 0.70, 0.65, 0.62): the best is step 6. A branch resumed from
    best.pt (step 6) sees the same evaluations at 8 and 10 (0.65, 0.62) and must end as the run did, best step 6 and
    2 evaluations since; it took 0.65 at step 8 as an improvement on step 2's 0.60 and replaced best.pt with it."""
    make_dataset(tmp_path / "ds", {"train": 40, "validation": 16})
    raw = {"data": {"path": str(tmp_path / "ds"), "batch_size": 8},
           "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
           "train": {"epochs": 2, "log_every": 2, "eval_every": 2, "device": "cpu", "seed": 3, "baseline": False,
                     "early_stopping": {"metric": "auc", "patience": 3}},
           "checkpoint": {"every": 1000, "keep": 5}, "log": {"tb_dir": str(tmp_path / "tb")}}
    (tmp_path / "c.json").write_text(json.dumps(raw))
    left = scripted(monkeypatch, [0.60, 0.55, 0.70, 0.65, 0.62])
    full = train(load_config(tmp_path / "c.json", {"log.run_name": "full"}))
    assert left == [] and full["steps"] == 10 and full["best"]["step"] == 6 and full["best"]["auc"] == 0.70
    best_pt = tmp_path / "tb" / "full" / "checkpoints" / "best.pt"
    assert ckpt.load_checkpoint(best_pt)["position"]["step"] == 6

    scripted(monkeypatch, [0.65, 0.62])
    branch = train(load_config(tmp_path / "c.json", {"log.run_name": "branch"}), resume=str(best_pt))
    assert branch["resumed_at_step"] == 6 and branch["steps"] == 10
    assert (branch["best"]["step"], branch["best"]["auc"]) == (6, 0.70)  # was (8, 0.65)
    last = ckpt.load_checkpoint(ckpt.list_checkpoints(tmp_path / "tb" / "branch")[-1])
    assert last["run_stats"]["evals_since_best"] == 2  # as the uninterrupted run's
    # the best model is where the summary says: step 6's model, linked into the branch's own best.pt (since the
    # fifty-second session: the source run's best.pt is that run's, which it replaces with its later bests)
    own = tmp_path / "tb" / "branch" / "checkpoints" / "best.pt"
    assert branch["best_checkpoint"] == str(own)
    assert ckpt.load_checkpoint(own)["position"]["step"] == 6  # was step 8's model
    assert own.samefile(best_pt)  # a hard link: no copy of the model


def test_nan_logits_have_no_auc():
    nan = float("nan")
    labels = torch.tensor([0, 0, 1, 1])
    assert np.isnan(roc_auc(torch.full((4,), nan), labels).item())  # was 1.0 (positives last), 0.0 the other way
    got = evaluate_logits(torch.tensor([0.3, nan, -1.0, nan]), torch.tensor([1.0, 0.0, 0.0, 1.0]))
    assert np.isnan(got["auc"]) and np.isnan(got["logloss"])  # AUC was 0.75
    assert np.isnan(got["accuracy"])  # was 0.75: a NaN counted as a negative prediction (session 67)
    # a NaN elsewhere than the scores changes nothing: the AUC of finite scores is as before
    assert roc_auc(torch.tensor([0.1, 0.3, 0.2, 0.4]), labels).item() == 0.75


class Forward:
    """Logits carried in the batches' dense column 0 (a model in eval mode, as `evaluate` wants)."""

    model = torch.nn.Identity()

    def __call__(self, batch):
        return batch.dense[:, 0].clone()


def split_of(logits):
    n = len(logits)
    dense = torch.zeros(n, 13)
    dense[:, 0] = torch.tensor(logits)
    return [Batch(dense, torch.zeros(n, 26, dtype=torch.int64), torch.tensor([0.0, 0.0, 1.0, 1.0]))]


def test_a_diverged_models_evaluation_does_not_replace_best_pt(monkeypatch):
    """Best AUC 0.75 at step 1; at step 2 the model gives NaN logits: not an improvement (it scored AUC 1.0 and became
    the best, best.pt the NaN model), one evaluation without improvement."""
    saved = []
    checkpointer = SimpleNamespace(best_path=Path("/run/checkpoints/best.pt"),
                                   save_best=lambda run, pos, stats: saved.append(pos.step))
    cfg = SimpleNamespace(train=SimpleNamespace(early_stopping=EarlyStoppingConfig(metric="auc", patience=3)))
    ev = Evaluator(SimpleNamespace(eval_forward=Forward()), split_of([0.1, 0.3, 0.2, 0.4]), cfg, Writer(), checkpointer,
                   RunStats())
    assert ev(ckpt.Position(1, 0, 1))["auc"] == 0.75
    ev.loader = split_of([float("nan")] * 4)
    second = ev(ckpt.Position(2, 0, 2))
    assert saved == [1] and ev.stats.best["step"] == 1 and ev.stats.evals_since_best == 1  # saved was [1, 2]
    assert np.isnan(second["auc"])


# -- metrics on inputs the other tests leave out (they pass; kept as a reference check) ------------------------------

def test_auc_over_three_million_rows_of_seven_tied_levels_is_exact():
    """Whole-split AUC is exact, not binned: 3,000,000 rows (3% positives) on 7 score levels, against the integer
    Mann-Whitney count of `dlrm.data.teacher.rank_auc` (ties as half)."""
    rng = np.random.default_rng(0)
    n = 3_000_000
    labels = (rng.random(n) < 0.03).astype(np.int64)
    scores = rng.integers(0, 7, n).astype(np.float32)
    want = rank_auc(scores.astype(np.float64), labels)
    assert roc_auc(torch.from_numpy(scores), torch.from_numpy(labels)).item() == want
    assert want == pytest.approx(0.5002344135847294, abs=1e-15)


def test_bf16_logits_score_as_their_float64_values():
    """bf16 logits (many ties) rank and lose as their exact values do."""
    logits = torch.tensor([0.1, 0.1001, -2.0, 3.0, 0.1, -2.0], dtype=torch.bfloat16)  # 0.1 and 0.1001 tie in bf16
    labels = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0])
    got = evaluate_logits(logits, labels)
    x = logits.double().numpy()
    # pairs (pos, neg): pos {0.1, 3, -2} vs neg {0.1, 0.1, -2}: 0.1 beats -2 and ties twice; 3 beats all; -2 ties once
    assert got["auc"] == pytest.approx((1 + 0.5 + 0.5 + 3 + 0.5) / 9, abs=1e-15)
    assert got["logloss"] == pytest.approx(float(np.mean(np.logaddexp(0, x) - labels.numpy() * x)), rel=1e-12)
    assert got["accuracy"] == pytest.approx(3 / 6)
