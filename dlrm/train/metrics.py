"""Evaluation metrics computed on the device over a whole split: exact AUC, logloss, accuracy."""

from __future__ import annotations

import torch


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Exact ROC AUC (Mann-Whitney U with tied scores counted as half), as a 0-dim float64 tensor.

    Equals the fraction of (positive, negative) pairs ranked correctly, ties counting 1/2.
    NaN when one class is absent, and when a score is NaN (a diverged model's: a NaN ranks against
    nothing; `torch.unique` would give each its own rank, by position, and a model of NaN logits an
    AUC of up to 1). Sort-based, O(n log n). On CUDA ``torch.unique`` syncs with the host once (its output's size
    depends on the scores): at an evaluation's end, as its metrics' read does anyway (`evaluate_logits`).

    Args:
        scores: [N] any real scores (logits or probabilities; monotone maps give the same AUC).
        labels: [N] 0/1.
    """
    scores = scores.detach().flatten().to(torch.float64)
    labels = labels.detach().flatten().to(torch.float64)
    _, inverse, counts = torch.unique(scores, sorted=True, return_inverse=True, return_counts=True)
    # Average 1-based rank of each distinct score: its block starts after all smaller scores.
    ends = torch.cumsum(counts, 0).to(torch.float64)
    avg_rank = ends - (counts.to(torch.float64) - 1) / 2
    ranks = avg_rank[inverse]
    n_pos = labels.sum()
    n_neg = labels.numel() - n_pos
    u = (ranks * labels).sum() - n_pos * (n_pos + 1) / 2
    auc = u / (n_pos * n_neg)
    return torch.where(scores.isnan().any(), torch.full_like(auc, float("nan")), auc)


def log_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean binary cross-entropy of sigmoid(logits) against labels (stable; float64)."""
    return torch.nn.functional.binary_cross_entropy_with_logits(
        logits.detach().to(torch.float64), labels.detach().to(torch.float64)
    )


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Fraction of predictions (probability > 0.5, i.e. logit > 0) equal to the label; NaN when a logit is NaN (as
    `roc_auc` and `log_loss` are: ``NaN > 0`` is False, and a model of NaN outputs scored the split's negative rate,
    a plausible accuracy beside an AUC and logloss of NaN in an ``--eval-only`` summary)."""
    logits = logits.detach()
    acc = ((logits > 0).to(torch.float64) == labels.detach().to(torch.float64)).to(torch.float64).mean()
    return torch.where(logits.isnan().any(), torch.full_like(acc, float("nan")), acc)


def evaluate_logits(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """All metrics as Python floats (one host sync, at the end of an evaluation)."""
    values = torch.stack([roc_auc(logits, labels), log_loss(logits, labels), accuracy(logits, labels)])
    auc, ll, acc = values.tolist()  # intended sync: evaluation is over
    return {"auc": auc, "logloss": ll, "accuracy": acc}
