"""The DLRM's final logloss against the logloss of predicting the train click rate for every row.

A model that ranks well (a good AUC) can still give probabilities worse than that constant: trained many epochs on a
few hundred rows, it memorizes them (train loss near 0) and its validation probabilities sit near 0 and 1, so each
row it gets wrong costs several nats (the real samples of ``../shared/criteo`` under ``configs/criteo-small.json``:
AUC 0.71, logloss 1.10 against the constant's 0.56). The baseline's log line says so for the logistic regression
(`dlrm.train.baseline.logloss_text`); this says it for the DLRM, in the final line and in TensorBoard
(`dlrm.train.reporting.check_logloss`).

The constant's logloss comes from the dataset's metadata (each split's rows and positives): no row is read again.
"""

from __future__ import annotations

import math
from typing import Any, Optional

RATE_CLIP = 1e-6
"""The train rate is held in [1e-6, 1 - 1e-6] (a one-class train split's log(0)), as the baseline's constant is."""


def binary_logloss(rate: float, positives: int, rows: int) -> float:
    """The mean logloss of predicting `rate` for each of `rows` rows of which `positives` are positive.

    >>> round(binary_logloss(0.25, 25, 100), 6)  # the entropy of a 25% rate, in nats
    0.562335
    """
    rate = min(max(rate, RATE_CLIP), 1 - RATE_CLIP)
    return -(positives * math.log(rate) + (rows - positives) * math.log1p(-rate)) / rows


def constant_reference(meta, split: str) -> dict[str, Any]:
    """``{"train_rate", "train_rows", "constant_logloss", "train_constant_logloss"}`` for the summary: the train
    split's click rate, its rows, and the logloss of predicting that rate for every row of `split` and of train
    (empty when a split has no rows: nothing to compare)."""
    train, evaluated = meta.splits.get("train"), meta.splits.get(split)
    if train is None or evaluated is None or not train.rows or not evaluated.rows:
        return {}
    rate = train.positives / train.rows
    return {"train_rate": rate, "train_rows": train.rows,
            "constant_logloss": binary_logloss(rate, evaluated.positives, evaluated.rows),
            "train_constant_logloss": binary_logloss(rate, train.positives, train.rows)}


def logloss_flag(summary: dict[str, Any]) -> Optional[str]:
    """What the user should know when the run's last logloss is worse than the constant's, with the advice that fits
    its train loss; None when it is not worse (or the numbers are missing).

    Example (the real Criteo samples, criteo-small.json, seed 0):
        >>> logloss_flag({"logloss": 1.1029, "constant_logloss": 0.5597, "train_rate": 0.2545, "train_rows": 165,
        ...               "train_constant_logloss": 0.5673, "final_train_loss": 0.0060, "split": "validation",
        ...               "best": None})  # doctest: +NORMALIZE_WHITESPACE
        'the DLRM\\'s validation logloss 1.1029 is worse than 0.5597, the logloss of predicting the train click rate
        0.2545 for every row: it overfits the 165 train rows (train loss 0.0060) and its probabilities are
        overconfident; train fewer steps (train.epochs, train.min_steps, --max-steps) or stop early on logloss
        (train.early_stopping {"metric": "logloss"} with train.eval_every: checkpoints/best.pt keeps the lowest-logloss
        model)'
    """
    logloss, constant = summary.get("logloss"), summary.get("constant_logloss")
    if logloss is None or constant is None or not logloss > constant:  # (a NaN logloss stops the run before this)
        return None
    text = (f"the DLRM's {summary.get('split', 'evaluation')} logloss {logloss:.4f} is worse than {constant:.4f}, the "
            f"logloss of predicting the train click rate {summary['train_rate']:.4f} for every row")
    train_loss, train_constant = summary.get("final_train_loss"), summary.get("train_constant_logloss")
    best = summary.get("best") or {}
    if best.get("logloss") is not None and best["logloss"] < constant and best.get("checkpoint"):
        # the run already kept a model that beats the constant (an earlier evaluation): point at it
        return (text + f"; the evaluation at step {best['step']} beat it (logloss {best['logloss']:.4f}): its model "
                "is the best one kept")
    if train_loss is not None and train_constant is not None and train_loss < train_constant:
        # the train rows are fitted better than the constant fits them: not a failure to learn, memorization
        return (text + f": it overfits the {summary['train_rows']:,} train rows (train loss {train_loss:.4f}) and its "
                "probabilities are overconfident; train fewer steps (train.epochs, train.min_steps, --max-steps) or "
                'stop early on logloss (train.early_stopping {"metric": "logloss"} with train.eval_every: '
                "checkpoints/best.pt keeps the lowest-logloss model)")
    if train_loss is not None and train_constant is not None:
        # (the real samples with train.min_steps null: 3 steps, all inside the 67-step warm-up)
        return (text + f"; its train loss {train_loss:.4f} is no better than the constant's on train "
                f"({train_constant:.4f}): it has not fitted the train rows in {_steps(summary.get('steps'))}; train longer "
                "(train.epochs, train.min_steps) or check the learning rates and warm-up (optim.dense.lr, "
                "optim.sparse.lr, optim.schedule.warmup_steps)")
    return text


def _steps(steps: Any) -> str:
    """'1 step', '10 steps' (as the final line counts them)."""
    return f"{steps} step" + ("" if steps == 1 else "s")


def flag_clause(summary: dict[str, Any]) -> str:
    """The final log line's words about it: empty when the logloss beats the constant's."""
    flag = logloss_flag(summary)
    return f"; WARNING: {flag}" if flag else ""

