"""`--resume` of a run killed after an evaluation saved best.pt but before its first step checkpoint
(train.eval_every < checkpoint.every): best.pt holds the whole training state of its step, the latest the run saved,
and the run goes on from it, bit for bit the uninterrupted run. It was refused ("holds no checkpoint ... but more than
a run writes before its first one": best.pt), a dead end for a requeued job. A finished run (its summary.json) with
best.pt and no step checkpoint is not trained again from its best."""

from __future__ import annotations

import pytest
import torch

from dlrm.config import ConfigError
from dlrm.train.checkpointer import Checkpointer
from dlrm.train.trainer import train
from tests.test_audit_restart import METRICS, config
from tests.test_run_dir import dataset  # noqa: F401 (a fixture)


class Killed(Exception):
    """Stands for a SIGKILL at the first step checkpoint: the run stops there, its directory as it was."""


def _killed_at_first_checkpoint(tmp_path, dataset, monkeypatch):  # noqa: F811
    def save(self, run, pos, stats):
        raise Killed

    with monkeypatch.context() as m:
        m.setattr(Checkpointer, "save", save)
        with pytest.raises(Killed):
            train(config(tmp_path, dataset, "victim", **{"train.eval_every": 2}))
    run = tmp_path / "tb" / "victim"
    assert (run / "checkpoints" / "best.pt").is_file() and not list(run.glob("checkpoints/step-*.pt"))
    return run


def test_a_run_killed_after_best_pt_before_its_first_checkpoint_goes_on_from_it(tmp_path, dataset,  # noqa: F811
                                                                                  monkeypatch):
    reference = train(config(tmp_path, dataset, "reference", **{"train.eval_every": 2}))
    run = _killed_at_first_checkpoint(tmp_path, dataset, monkeypatch)
    resumed = train(config(tmp_path, dataset, "victim", **{"train.eval_every": 2}), resume="latest")
    assert resumed["resumed_from"].endswith("best.pt")
    assert {k: resumed[k] for k in METRICS if k not in ("resumed_from", "resumed_at_step")} == \
        {k: reference[k] for k in METRICS if k not in ("resumed_from", "resumed_at_step")}
    a = torch.load(tmp_path / "tb" / "reference" / "checkpoints" / "step-00000010.pt", weights_only=False)["model"]
    b = torch.load(run / "checkpoints" / "step-00000010.pt", weights_only=False)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_finished_run_with_only_best_pt_is_not_trained_again(tmp_path, dataset, monkeypatch):  # noqa: F811
    run = _killed_at_first_checkpoint(tmp_path, dataset, monkeypatch)
    (run / "summary.json").write_text("{}")  # as a finished run without step checkpoints (checkpoint.every off)
    with pytest.raises(ConfigError, match="summary.json"):
        train(config(tmp_path, dataset, "victim", **{"train.eval_every": 2}), resume="latest")
