"""Review of this session's changes (agreed stops, one-class AUC, distributed checkpoints, sweep cwd, CSV cells)."""

from __future__ import annotations

import pytest

from dlrm import checkpoint as ckpt
from tests.test_audit_onerank_stop import STEPS, assert_stopped_together, dataset, launch  # noqa: F401 - fixture


def test_agreed_stop_after_a_branchs_last_evaluation_keeps_the_checkpoint_it_names(tmp_path, dataset):  # noqa: F811
    """A branch (``--resume CKPT --run-name NEW``) of a run stopped at its end: no step to train, its last evaluation
    and checkpoint made in the new directory; a SIGTERM on one rank there stopped every rank with "checkpoint
    <NEW>/checkpoints/step-N.pt", and then the failed start's cleanup removed that directory, checkpoint and all."""
    results = launch(tmp_path, dataset, "r", kill_at="eval")
    assert_stopped_together(results, "after its last evaluation")
    last = ckpt.list_checkpoints(tmp_path / "tb" / "r")[-1]
    results = launch(tmp_path, dataset, "b", kill_at="eval", extra=["--resume", str(last)])
    assert_stopped_together(results, f"stopped by signal (SIGTERM) at step {STEPS}, after its last evaluation")
    named = tmp_path / "tb" / "b" / "checkpoints" / ckpt.checkpoint_name(STEPS)
    assert str(named) in results[0][1]
    assert named.is_file(), f"the stop named {named}, which is gone:\n{results[0][1][-2000:]}"
    assert len(list(named.parent.glob(named.stem + ".rank*-of-2.pt"))) == 2


# -- a stop after an early stop's checkpoint, before its summary ------------------------------------------------------


def _stop_in_write_best(monkeypatch):
    """SIGTERM to this process as the run's end writes best.pt: after the last checkpoint, before summary.json (the
    point where a distributed run's agreed stop ends it: "the summary left to --resume")."""
    import os
    import signal

    from dlrm.train.evaluator import Evaluator

    real = Evaluator.write_best

    def write_best(self):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(self)

    monkeypatch.setattr(Evaluator, "write_best", write_best)
    return lambda: monkeypatch.setattr(Evaluator, "write_best", real)


@pytest.mark.parametrize("early", [{"metric": "logloss", "patience": 1, "min_delta": 10.0},
                                   {"metric": "logloss", "patience": None, "target": 10.0}])
def test_a_resume_of_an_early_stop_stopped_before_its_summary_writes_the_summary(tmp_path, monkeypatch, early):
    """Stopped by a signal after its early stop's checkpoint (patience, or target reached), before summary.json: the
    resume said "nothing to train, nothing written" and returned a summary without metrics; the run never got its
    summary.json (and a sweep resuming that trial crashed on the missing logloss)."""
    import json

    from dlrm.config import load_config
    from dlrm.errors import TrainingStopped
    from dlrm.train.checkpointer import checkpoint_step
    from dlrm.train.trainer import train
    from tests.conftest import make_dataset
    from tests.test_audit_eval_nits import config_file

    data = tmp_path / "ds"
    make_dataset(data, {"train": 64, "validation": 16}, row_group_size=16)
    cfg = load_config(config_file(tmp_path, data, max_steps=8, baseline=False, early_stopping=early))
    restore = _stop_in_write_best(monkeypatch)
    with pytest.raises(TrainingStopped):
        train(cfg)
    restore()
    run = tmp_path / "tb" / "r"
    stopped_at = checkpoint_step(ckpt.list_checkpoints(run)[-1])
    assert stopped_at < 8 and not (run / "summary.json").exists()
    summary = train(cfg, resume="latest")
    assert (run / "summary.json").is_file(), "the resume wrote no summary.json"
    written = json.loads((run / "summary.json").read_text())
    assert written["steps"] == summary["steps"] == stopped_at and written["early_stopped"] is True
    assert written["logloss"] == pytest.approx(summary["logloss"]) and written["resumed_at_step"] == stopped_at
    # and that run is finished now: a further resume trains nothing and writes nothing
    again = train(cfg, resume="latest")
    assert again["finished"] is True and again["steps"] == stopped_at
