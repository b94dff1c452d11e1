"""Audit of numerical failure handling (dlrm/train/trainer.py, evaluator.py): a run whose model diverges must stop
with one line naming the step and the quantity, and write neither a best.pt of the diverged model nor a summary
claiming a finished run. Tiny synthetic datasets, eager CPU model; each expectation is computed here."""

from __future__ import annotations

import json

import pytest
import torch

from dlrm import checkpoint as ckpt
from dlrm.config import load_config
from dlrm.errors import NonFiniteLoss
from dlrm.train import step as step_mod
from dlrm.train.trainer import train
from tests.conftest import make_dataset

BASE = {
    "data": {"batch_size": 16},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "optim": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.05}},
    "train": {"epochs": 1, "log_every": 10, "eval_every": None, "device": "cpu", "seed": 3},
    "checkpoint": {"every": None},
}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("audit_numerics") / "ds"
    make_dataset(root, {"train": 100, "validation": 40}, row_group_size=16)  # 6 full batches of 16 and 4 rows
    return root


def config(tmp_path, dataset, name, **sections):
    raw = json.loads(json.dumps(BASE))
    raw["data"]["path"] = str(dataset)
    for section, values in sections.items():
        raw[section].update(values)
    (tmp_path / f"{name}.json").write_text(json.dumps(raw))
    return load_config(tmp_path / f"{name}.json", {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": name})


def poison_at(monkeypatch, step: int) -> dict:
    """Make the training step number `step` (1-based, counted in calls) leave the model and its loss NaN; returns
    the call counter (``calls["n"]``)."""
    original, calls = step_mod.TrainStep.__call__, {"n": 0}

    def poisoned(self, batch):
        calls["n"] += 1
        loss = original(self, batch)
        if calls["n"] == step:
            with torch.no_grad():
                for p in self.model.parameters():
                    p.fill_(float("nan"))
            loss = loss * float("nan")
        return loss

    monkeypatch.setattr(step_mod.TrainStep, "__call__", poisoned)
    return calls


def test_a_nan_loss_between_logging_steps_stops_before_an_evaluation_writes_best_pt(tmp_path, dataset, monkeypatch):
    """Step 1 makes the model NaN (its loss too); evaluations every 2 steps, logging every 10. The evaluation at
    step 2 ran on the NaN model without a look at the losses since the last logging step and, as the first
    evaluation, wrote checkpoints/best.pt full of NaNs (the run then said "no checkpoint was written")."""
    cfg = config(tmp_path, dataset, "nan-eval", train={"eval_every": 2})
    calls = poison_at(monkeypatch, 1)
    with pytest.raises(NonFiniteLoss, match=r"loss became NaN or Inf at step 1; stopped; no checkpoint was written"):
        train(cfg)
    run_dir = tmp_path / "tb" / "nan-eval"
    assert not (run_dir / "checkpoints" / "best.pt").exists()
    assert calls["n"] == 2  # stopped at the first evaluation step, before evaluating
    assert not ckpt.list_checkpoints(run_dir) and not (run_dir / "summary.json").exists()


def test_a_model_that_overflows_on_its_last_step_does_not_finish_as_a_success(tmp_path, dataset):
    """SGD at lr 1e20: the first step's loss is finite (computed before the update), the update makes the model's
    outputs overflow. The run "finished": exit 0, summary.json with AUC and logloss null, the last checkpoint of the
    diverged model. It must stop like a NaN loss, naming the evaluation's step and its logloss, writing no
    checkpoint and no summary."""
    cfg = config(tmp_path, dataset, "overflow", train={"max_steps": 1},
                 optim={"dense": {"name": "sgd", "lr": 1e20}, "sparse": {"name": "sgd", "lr": 1e20}})
    with pytest.raises(NonFiniteLoss, match=r"evaluation at step 1: logloss (nan|inf)\b.*diverged.*; stopped; "
                                            r"no checkpoint was written"):
        train(cfg)
    run_dir = tmp_path / "tb" / "overflow"
    assert not ckpt.list_checkpoints(run_dir) and not (run_dir / "checkpoints" / "best.pt").exists()
    assert not (run_dir / "summary.json").exists()


@pytest.mark.parametrize("eval_every", [2, None])
def test_an_overflowed_weight_is_not_checkpointed_nor_called_good(tmp_path, dataset, monkeypatch, eval_every):
    """Checkpoints (and evaluations) every 2 steps; the update of step 4 makes the table infinite (its loss, computed
    before, is finite). step-4.pt was written with it, and the NaN loss of step 5 then named it "the last good
    checkpoint". The run must stop at step 4 naming the weight: step-2.pt stays the last checkpoint, with finite
    weights, and best.pt, when evaluating, is step 2's."""
    cfg = config(tmp_path, dataset, "overflow-late", train={"eval_every": eval_every}, checkpoint={"every": 2})
    original, calls = step_mod.TrainStep.__call__, {"n": 0}

    def overflow(self, batch):
        calls["n"] += 1
        loss = original(self, batch)
        if calls["n"] == 4:
            with torch.no_grad():
                self.model.sparse_arch.weight.mul_(float("inf"))
        return loss

    monkeypatch.setattr(step_mod.TrainStep, "__call__", overflow)
    with pytest.raises(NonFiniteLoss, match=r"weight sparse_arch.weight became NaN or Inf at step 4; stopped; "
                                            r"the last good checkpoint is .*step-00000002.pt"):
        train(cfg)
    run_dir = tmp_path / "tb" / "overflow-late"
    assert calls["n"] == 4
    assert [p.name for p in ckpt.list_checkpoints(run_dir)] == [ckpt.checkpoint_name(2)]
    kept = ckpt.load_checkpoint(ckpt.list_checkpoints(run_dir)[0])
    assert all(torch.isfinite(v).all() for v in kept["model"].values())
    if eval_every:
        best = ckpt.load_checkpoint(run_dir / "checkpoints" / "best.pt")
        assert best["position"]["step"] == 2
        assert all(torch.isfinite(v).all() for v in best["model"].values())
    else:
        assert not (run_dir / "checkpoints" / "best.pt").exists()
    assert not (run_dir / "summary.json").exists()


def test_a_one_class_evaluation_split_is_not_taken_for_divergence(tmp_path):
    """The guard of the fixes above: a validation split of one row has no AUC (NaN, written as null) but a finite
    logloss; the run finishes, evaluating every 2 steps and keeping best.pt."""
    root = tmp_path / "one-class"
    written = make_dataset(root, {"train": 100, "validation": 1}, files_per_split=1, row_group_size=16)
    cfg = config(tmp_path, root, "one-class", train={"eval_every": 2})
    summary = train(cfg)
    assert summary["steps"] == 6 and summary["auc"] != summary["auc"]  # NaN: one class
    label = float(written["validation"]["label"][0])
    assert 0 < summary["logloss"] < 10 and summary["accuracy"] in (0.0, 1.0) and label in (0.0, 1.0)
    on_disk = json.loads((tmp_path / "tb" / "one-class" / "summary.json").read_text())
    assert on_disk["auc"] is None and on_disk["logloss"] == pytest.approx(summary["logloss"])
    assert (tmp_path / "tb" / "one-class" / "checkpoints" / "best.pt").exists()
