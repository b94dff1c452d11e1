"""The built-in logistic-regression baseline (dlrm.train.baseline): the "auto" rule, the hashing it
shares with the DLRM, its fit against an independent float64 Newton solution, and a training run
that reports it in summary.json, TensorBoard and the final log line (or leaves it out when off)."""

from __future__ import annotations

import json

import pytest
import torch
from loguru import logger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dlrm.config import load_config
from dlrm.model.archs import SparseArch
from dlrm.train.baseline import (
    AUTO_MAX_TRAIN_ROWS,
    LogisticRegression,
    RowHasher,
    baseline_clause,
    baseline_wanted,
    fit,
)
from dlrm.train.metrics import roc_auc
from tests.conftest import make_dataset


@pytest.mark.parametrize("setting, rows, world, device, expected", [
    ("auto", AUTO_MAX_TRAIN_ROWS["cpu"], 1, "cpu", True),
    ("auto", AUTO_MAX_TRAIN_ROWS["cpu"] + 1, 1, "cpu", False),
    ("auto", AUTO_MAX_TRAIN_ROWS["cuda"], 1, "cuda", True),
    ("auto", AUTO_MAX_TRAIN_ROWS["cuda"] + 1, 1, "cuda", False),
    (True, 10**9, 1, "cpu", True),
    (False, 10, 1, "cpu", False),
    (True, 10, 2, "cuda", False),  # a distributed run never fits it (each rank sees a slice)
])
def test_auto_rule(setting, rows, world, device, expected):
    wanted, why = baseline_wanted(setting, rows, world, device)
    assert wanted is expected
    assert "train.baseline" in why


@pytest.mark.parametrize("vocabulary", [False, True])
def test_row_hasher_is_the_dlrm_hashing(vocabulary):
    cards = [5, 1, 4]
    vocabs = [torch.tensor([3, 9, 40, 41]), torch.tensor([], dtype=torch.int64), torch.tensor([0, 2, 7])] \
        if vocabulary else None
    arch = SparseArch(cards if not vocabulary else [len(v) + 1 for v in vocabs], 2, vocabs=vocabs)
    raw = torch.tensor([[3, -1, 7], [40, 12, 2**32 - 1], [-1, 0, 0], [41, 5, 2]])
    hasher = RowHasher(list(arch.cardinalities.tolist()), vocabs, "cpu")
    assert torch.equal(hasher(raw), arch.rows(raw))


def newton_reference(x: torch.Tensor, y: torch.Tensor, l2: float, iterations: int = 50) -> torch.Tensor:
    """Exact L2 logistic regression by Newton's method on a dense float64 design [N, P] whose last
    column is the (unpenalized) intercept; returns the weights [P]."""
    n, p = x.shape
    w = torch.zeros(p, dtype=torch.float64)
    penalty = torch.full((p,), l2, dtype=torch.float64)
    penalty[-1] = 0.0
    for _ in range(iterations):
        prob = torch.sigmoid(x @ w)
        grad = x.T @ (prob - y) / n + penalty * w
        hess = (x.T * (prob * (1 - prob))) @ x / n + torch.diag(penalty)
        w = w - torch.linalg.solve(hess, grad)
    return w


def test_fit_matches_a_float64_newton_reference():
    gen = torch.Generator().manual_seed(0)
    n, features = 400, 3
    dense = torch.rand(n, 13, generator=gen, dtype=torch.float64) * 3
    rows = torch.stack([torch.randint(10 * f, 10 * f + 6, (n,), generator=gen) for f in range(features)], 1)
    rows[:5, 0] = 99  # a rare row: seen 5 times only
    truth = torch.randn(100, generator=gen, dtype=torch.float64)
    logit = dense[:, 0] - dense[:, 3] + truth[rows].sum(1) - 0.5
    labels = torch.bernoulli(torch.sigmoid(logit), generator=gen)
    l2 = 0.01
    model, facts = fit(dense, rows, labels, l2=l2)

    used = torch.unique(rows)
    one_hot = (rows.unsqueeze(-1) == used).any(1).to(torch.float64)  # [N, U]: every row's used embedding rows
    design = torch.cat([one_hot, dense, torch.ones(n, 1, dtype=torch.float64)], 1)
    w = newton_reference(design, labels, l2)
    u = used.numel()
    torch.testing.assert_close(model.sparse.detach(), w[:u], rtol=0, atol=1e-4)
    torch.testing.assert_close(model.dense.detach(), w[u:u + 13], rtol=0, atol=1e-4)
    torch.testing.assert_close(model.bias.detach(), w[-1], rtol=0, atol=1e-4)
    assert facts["l2"] == l2 and 0 < facts["iterations"] <= 100


def test_rows_unseen_in_training_weigh_zero():
    model = LogisticRegression(torch.tensor([2, 5, 9]), "cpu")
    with torch.no_grad():
        model.sparse.copy_(torch.tensor([1.0, 10.0, 100.0], dtype=torch.float64))
        model.bias.fill_(0.5)
    dense = torch.zeros(3, 13, dtype=torch.float64)
    rows = torch.tensor([[2, 5], [3, 9], [0, 12]])  # 3, 0 and 12 have no weight
    torch.testing.assert_close(model.logits(dense, rows), torch.tensor([11.5, 100.5, 0.5], dtype=torch.float64))


def test_fit_learns_a_planted_signal():
    gen = torch.Generator().manual_seed(1)
    n = 6000  # 5000 train rows: 100 a category, enough to estimate each effect
    rows = torch.randint(0, 50, (n, 2), generator=gen) + torch.tensor([0, 50])  # two tables: rows 0-49 and 50-99
    effect = torch.linspace(-2, 2, 50, dtype=torch.float64)
    labels = torch.bernoulli(torch.sigmoid(effect[rows[:, 0]]), generator=gen)
    dense = torch.zeros(n, 13, dtype=torch.float64)
    model, _ = fit(dense[:5000], rows[:5000], labels[:5000])
    auc = float(roc_auc(model.logits(dense[5000:], rows[5000:]), labels[5000:]))
    best = float(roc_auc(effect[rows[5000:, 0]], labels[5000:]))  # the true logits' AUC
    assert best - 0.02 < auc <= best + 0.005, (auc, best)


BASE = {
    "data": {"batch_size": 16, "shuffle": True},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "train": {"epochs": 1, "max_steps": 6, "log_every": 3, "device": "cpu", "seed": 0},
}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("baseline") / "ds"
    make_dataset(root, {"train": 120, "validation": 40}, row_group_size=30)
    return root


def run_config(tmp_path, dataset, name, **overrides):
    raw = json.loads(json.dumps(BASE))
    raw["data"]["path"] = str(dataset)
    raw["log"] = {"tb_dir": str(tmp_path / "tb"), "run_name": name}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(raw))
    return load_config(path, overrides)


def test_training_reports_the_baseline(tmp_path, dataset):
    from dlrm.train.trainer import train

    lines = []
    handle = logger.add(lambda m: lines.append(m.record["message"]), level="INFO")
    try:
        summary = train(run_config(tmp_path, dataset, "on", **{"train.baseline": True}))
    finally:
        logger.remove(handle)
    base = summary["baseline"]
    assert base["train_rows"] == 120 and 0.0 <= base["auc"] <= 1.0 and base["logloss"] > 0
    saved = json.loads((tmp_path / "tb" / "on" / "summary.json").read_text())
    assert saved["baseline"]["auc"] == pytest.approx(base["auc"])
    assert lines[-1].startswith("validation: AUC") and f"baseline (logistic regression) AUC {base['auc']:.4f}" in lines[-1]
    events = EventAccumulator(str(tmp_path / "tb" / "on"))
    events.Reload()
    assert events.Scalars("baseline/auc")[-1].value == pytest.approx(base["auc"], abs=1e-6)
    assert events.Scalars("baseline/logloss")[-1].value == pytest.approx(base["logloss"], rel=1e-6)


def test_no_baseline_leaves_it_out(tmp_path, dataset):
    from dlrm.cli import cli_overrides
    from dlrm.train.trainer import train

    names = ("data", "device", "batch_size", "epochs", "max_steps", "seed", "run_name", "tb_dir", "checkpoint_every",
             "split", "compile_", "compile_mode", "profile", "kernels")
    overrides = cli_overrides(**dict.fromkeys(names), baseline=False)  # what --no-baseline sets
    assert overrides == {"train.baseline": False}
    summary = train(run_config(tmp_path, dataset, "off", **overrides))
    assert summary["baseline"] is None and baseline_clause(summary) == ""
    events = EventAccumulator(str(tmp_path / "tb" / "off"))
    events.Reload()
    assert "baseline/auc" not in events.Tags()["scalars"]


@pytest.mark.parametrize("vocabulary", [False, True])
def test_multi_hot_row_hasher_is_the_pooled_arch_hashing_with_empty_slots_apart(vocabulary):
    """Multi-hot: every slot hashed with its feature's table (the rows PooledSparseArch looks up);
    an empty slot is -(f + 2), its own weight per feature, never a real row."""
    from dlrm.data.schema import PAD_SPARSE
    from dlrm.model.pooled_sparse import PooledSparseArch

    hotness = [2, 1, 3]
    vocabs = [torch.tensor([3, 9, 40, 41]), torch.tensor([], dtype=torch.int64), torch.tensor([0, 2, 7])] \
        if vocabulary else None
    cards = [len(v) + 1 for v in vocabs] if vocabulary else [5, 1, 4]
    arch = PooledSparseArch(cards, hotness, 2, vocabs=vocabs)
    raw = torch.tensor([[3, PAD_SPARSE, -1, 7, PAD_SPARSE, PAD_SPARSE], [40, 12, 5, 2, 0, 2**32 - 1]])
    rows = RowHasher(cards, vocabs, "cpu", hotness=hotness)(raw)
    filled = raw != PAD_SPARSE
    assert torch.equal(rows[filled], arch.rows(raw)[filled])
    assert rows[~filled].tolist() == [-2, -4, -4]  # feature 0's slot, feature 2's two slots
    assert bool((rows[filled] >= 0).all())


def test_training_on_multi_hot_data_reports_the_baseline(tmp_path):
    from dlrm.data import synthetic
    from dlrm.train.trainer import train

    root = tmp_path / "mh"
    synthetic.generate(root, 1200, seed=3, cardinalities="tiny", multi_hot_sizes=[3, 1, 2] + [1] * 23,
                       multi_hot_fill="variable", validation_fraction=0.25, test_fraction=0.0)
    summary = train(run_config(tmp_path, root, "mh", **{"train.baseline": True, "train.max_steps": 4}))
    base = summary["baseline"]
    assert base["train_rows"] == 900
    assert base["auc"] > 0.6  # the planted teacher is learnable from the bag of values
