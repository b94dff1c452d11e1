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


@pytest.mark.parametrize("n,levels", [(2, None), (3, None), (7, None), (127, None), (127, 3), (200, None),
                                      (300, 5), (57, 2)])
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
    assert np.isnan(roc_auc(torch.tensor([0.1, 0.2]), torch.tensor([0, 0])).item())
    assert np.isnan(roc_auc(torch.tensor([0.3]), torch.tensor([1])).item())


def test_auc_resolves_scores_closer_than_half_precision():
    """Scores 1e-5 apart are distinct (float64 ranks), not ties: no cast to a narrower type before ranking."""
    rng = np.random.default_rng(11)
    scores = 1.0 + rng.permutation(64) * 1e-5
    labels = rng.integers(0, 2, 64)
    labels[0], labels[1] = 0, 1
    got = roc_auc(torch.tensor(scores, dtype=torch.float64), torch.tensor(labels)).item()
    assert got == pytest.approx(brute_force_auc(scores, labels), abs=1e-12)


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


def reference_metrics(logits: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """float64 numpy: pairwise AUC, logloss as mean(log(1 + e^x) - y x), accuracy of p > 0.5 element by element."""
    logloss = float(np.mean(np.logaddexp(0.0, logits) - labels * logits))
    correct = [(1 / (1 + np.exp(-x)) > 0.5) == bool(y) for x, y in zip(logits, labels)]
    auc = brute_force_auc(logits, labels) if 0 < labels.sum() < len(labels) else float("nan")
    return {"auc": auc, "logloss": logloss, "accuracy": sum(correct) / len(correct)}


@pytest.mark.parametrize("n", [1, 3, 127])
@pytest.mark.parametrize("labels_kind", ["mixed", "all_positive", "all_negative"])
def test_every_metric_against_a_float64_reference(n, labels_kind):
    """Each of evaluate_logits' numbers under its own name, on odd sizes and one-class splits; logits in (0, 0.5]
    (probability above 0.5: predicted positive), exactly 0 (0.5: negative) and large ones (logloss stays finite)."""
    rng = np.random.default_rng(n)
    logits = rng.normal(scale=3.0, size=n).astype(np.float32)
    special = np.array([0.25, 0.0, -0.4, 0.5, 35.0, -35.0, 1e-3], dtype=np.float32)
    logits[: min(n, len(special))] = special[: min(n, len(special))]
    labels = {"mixed": rng.integers(0, 2, n), "all_positive": np.ones(n, int), "all_negative": np.zeros(n, int)}[
        labels_kind]
    if labels_kind == "mixed" and n > 1:
        labels[0], labels[1] = 1, 0  # logit 0.25 for a positive (right), 0.0 for a negative (right)
    want = reference_metrics(logits.astype(np.float64), labels.astype(np.float64))
    t_logits, t_labels = torch.from_numpy(logits), torch.tensor(labels, dtype=torch.float32)
    got = evaluate_logits(t_logits, t_labels)
    assert set(got) == set(want)
    assert got["logloss"] == pytest.approx(want["logloss"], rel=1e-12)
    assert got["accuracy"] == want["accuracy"]
    if np.isnan(want["auc"]):
        assert np.isnan(got["auc"])
    else:
        assert got["auc"] == pytest.approx(want["auc"], abs=1e-12)
    assert accuracy(t_logits, t_labels).item() == got["accuracy"]
    assert log_loss(t_logits, t_labels).item() == got["logloss"]
