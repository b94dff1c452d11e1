"""The warning of a `--resume` on another `data.eval_split` (README "Checkpoints, resume"), as a user reads it."""
from pathlib import Path
from types import SimpleNamespace

from loguru import logger

from dlrm.train.trainer import Trainer


def test_another_eval_split_warning_reads_plainly():
    """It said "not compared with 'test''s: the best starts afresh" (a possessive glued to a quoted name); it now says
    "not compared with those of 'test'", and the best and early stopping's count still start afresh."""
    best = Path("/runs/r1/checkpoints/best.pt")
    trainer = SimpleNamespace(cfg=SimpleNamespace(data=SimpleNamespace(eval_split="test")),
                              stats=SimpleNamespace(best={"step": 20, "auc": 0.7}, grid_best={"step": 20},
                                                    evals_since_best=2),
                              checkpointer=SimpleNamespace(evaluated_step=20, best_path=best))
    seen: list[str] = []
    handle = logger.add(lambda m: seen.append(m.record["message"]), level="WARNING", format="{message}")
    try:
        Trainer._forget_another_splits_best(trainer, {"data": {"eval_split": "validation"}})
    finally:
        logger.remove(handle)
    assert seen == ["--resume: data.eval_split 'validation' -> 'test': the best evaluation so far (step 20) is of "
                    "'validation', not compared with those of 'test': the best starts afresh, and this run's best "
                    f"'test' evaluation replaces {best}"], seen
    assert (trainer.stats.best, trainer.stats.grid_best, trainer.stats.evals_since_best) == (None, None, 0)
    assert trainer.checkpointer.evaluated_step is None
