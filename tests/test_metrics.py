import itertools

import numpy as np
import pytest
import torch

from dlrm.train.metrics import accuracy, evaluate_logits, log_loss, roc_auc


def brute_force_auc(scores, labels):
    pos = [s for s, y in zip(scores, labels) if y == 1]
    neg = [s for s, y in zip(scores, labels) if y == 0]
    total = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return total / (len(pos) * len(neg))


@pytest.mark.parametrize("n,levels", [(2, None), (7, None), (200, None), (300, 5), (57, 2)])
def test_auc_matches_pairwise_count(n, levels):
    rng = np.random.default_rng(n)
    labels = rng.integers(0, 2, n)
    labels[0], labels[-1] = 0, 1  # both classes present
    scores = rng.normal(size=n) if levels is None else rng.integers(0, levels, n).astype(float)  # ties when levels
    got = roc_auc(torch.tensor(scores, dtype=torch.float32), torch.tensor(labels)).item()
    assert got == pytest.approx(brute_force_auc(scores.astype(np.float32), labels), abs=1e-12)


def test_auc_extremes_and_single_class():
    labels = torch.tensor([0, 0, 1, 1])
    assert roc_auc(torch.tensor([0.1, 0.2, 0.3, 0.4]), labels).item() == 1.0
    assert roc_auc(torch.tensor([0.4, 0.3, 0.2, 0.1]), labels).item() == 0.0
    assert roc_auc(torch.tensor([0.5, 0.5, 0.5, 0.5]), labels).item() == 0.5
    assert np.isnan(roc_auc(torch.tensor([0.1, 0.2]), torch.tensor([1, 1])).item())


def test_logloss_and_accuracy_against_hand_values():
    logits = torch.tensor([0.0, 2.0, -1.0, 30.0])
    labels = torch.tensor([1.0, 0.0, 0.0, 1.0])
    p = 1 / (1 + np.exp(-np.array([0.0, 2.0, -1.0, 30.0])))
    expected = -np.mean([np.log(p[0]), np.log(1 - p[1]), np.log(1 - p[2]), np.log(p[3])])
    assert log_loss(logits, labels).item() == pytest.approx(expected, rel=1e-12)
    # logit 0 predicts 0 (p = 0.5 is not > 0.5): wrong for label 1; 2.0 wrong; -1 right; 30 right.
    assert accuracy(logits, labels).item() == 0.5
    m = evaluate_logits(logits, labels)
    assert set(m) == {"auc", "logloss", "accuracy"} and m["accuracy"] == 0.5
