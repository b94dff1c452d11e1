"""A branch (``--resume RUN/checkpoints/step-N.pt --run-name NEW``) killed before its own first step checkpoint, then
restarted with ``--run-name NEW --resume`` (a requeued job's one command line).

Its directory then held config.json, events and the best.pt it linked (its source run's best step's model). The
restart went on from that best.pt, i.e. from the SOURCE run's best step, earlier than the step the branch started
from (or, without a best.pt, from step 0): it trained steps the branch never trained, under the branch's config, and
ended with other weights than the uninterrupted branch (and summary.json's resumed_from/resumed_at_step named the
wrong start). The branch now records where it started (``branched_from.json``) and a restart goes on from there, bit
for bit the uninterrupted branch; a start that no longer holds its step is refused in one line, nothing written.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dlrm import checkpoint as ckpt
from dlrm.config import ConfigError, load_config
from dlrm.train.checkpointer import Checkpointer
from dlrm.train.trainer import train
from tests.test_audit_overwrite52 import scripted, tiny_config

LR = {"optim.dense.lr": 0.05}  # the branch changes the trajectory (allowed), so a wrong start shows in the weights
ALLOW = ["optim.dense.lr"]


class Killed(Exception):
    """Stands for a SIGKILL at the branch's first step checkpoint: the run stops there, its directory as it was."""


def _source(tmp_path, monkeypatch, **train_keys):
    """10 steps, checkpoints every 2; evaluations (if any) every 2 with the best at step 2 (AUC 0.70)."""
    config = tiny_config(tmp_path, **train_keys)
    scripted(monkeypatch, [0.70, 0.60, 0.65, 0.62, 0.61])
    train(load_config(config, {"log.run_name": "src"}))
    return config, tmp_path / "tb" / "src" / "checkpoints" / "step-00000004.pt"


def _branch(config, start, name, monkeypatch, kill=False):
    scripted(monkeypatch, [0.50] * 4)
    cfg = load_config(config, {"log.run_name": name, "train.max_steps": 8, **LR})
    if not kill:
        return train(cfg, resume=str(start), allow_config_change=ALLOW)
    with monkeypatch.context() as m:
        m.setattr(Checkpointer, "save", lambda self, run, pos, stats: (_ for _ in ()).throw(Killed()))
        with pytest.raises(Killed):
            train(cfg, resume=str(start), allow_config_change=ALLOW)
    assert not ckpt.list_checkpoints(config.parent / "tb" / name)


def _restart(config, name, monkeypatch):
    scripted(monkeypatch, [0.50] * 4)
    return train(load_config(config, {"log.run_name": name, "train.max_steps": 8, **LR}), resume="latest",
                 allow_config_change=ALLOW)


def _weights(run: Path):
    return torch.load(run / "checkpoints" / "step-00000008.pt", map_location="cpu", weights_only=False)["model"]


@pytest.mark.parametrize("eval_every", [2, None], ids=["source-best-earlier", "source-without-best"])
def test_a_branch_killed_before_its_first_checkpoint_goes_on_from_its_start(tmp_path, monkeypatch, eval_every):
    config, start = _source(tmp_path, monkeypatch, eval_every=eval_every)
    reference = _branch(config, start, "reference", monkeypatch)
    assert reference["resumed_at_step"] == 4
    _branch(config, start, "branch", monkeypatch, kill=True)
    restarted = _restart(config, "branch", monkeypatch)
    assert (restarted["resumed_from"], restarted["resumed_at_step"]) == (str(start), 4), \
        f"restarted from {restarted['resumed_from']} at step {restarted['resumed_at_step']}, not the branch's start"
    assert (restarted["steps"], restarted["samples"]) == (reference["steps"], reference["samples"])
    mine, theirs = _weights(tmp_path / "tb" / "branch"), _weights(tmp_path / "tb" / "reference")
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs), "not the uninterrupted branch's weights"
    if eval_every:  # its best is still the source's step 2 model, in a file of its own
        assert restarted["best"]["step"] == 2
        assert restarted["best_checkpoint"] == str(tmp_path / "tb" / "branch" / "checkpoints" / "best.pt")
        assert ckpt.load_checkpoint(restarted["best_checkpoint"])["position"]["step"] == 2


def test_a_branch_whose_start_was_pruned_is_refused_in_one_line(tmp_path, monkeypatch):
    config, start = _source(tmp_path, monkeypatch, eval_every=2)
    _branch(config, start, "branch", monkeypatch, kill=True)
    start.unlink()  # the source run's checkpoint.keep pruned it meanwhile
    run = tmp_path / "tb" / "branch"
    before = {str(p): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError) as refused:
        _restart(config, "branch", monkeypatch)
    text = str(refused.value)
    assert "\n" not in text and str(start) in text and "step 4" in text, text
    assert {str(p): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before, "a refused resume writes nothing"


def test_a_branch_killed_after_its_own_best_goes_on_from_that_best(tmp_path, monkeypatch):
    """An evaluation of the branch after its start made best.pt its own (step 6): that is the latest state it saved."""
    config, start = _source(tmp_path, monkeypatch, eval_every=2)
    scripted(monkeypatch, [0.90, 0.50])
    over = {"train.max_steps": 8, "checkpoint.every": 4, **LR}
    reference = train(load_config(config, {"log.run_name": "reference", **over}), resume=str(start),
                      allow_config_change=ALLOW)
    scripted(monkeypatch, [0.90, 0.50])
    with monkeypatch.context() as m:
        m.setattr(Checkpointer, "save", lambda self, run, pos, stats: (_ for _ in ()).throw(Killed()))
        with pytest.raises(Killed):
            train(load_config(config, {"log.run_name": "branch", **over}), resume=str(start), allow_config_change=ALLOW)
    scripted(monkeypatch, [0.50])
    restarted = train(load_config(config, {"log.run_name": "branch", **over}), resume="latest",
                      allow_config_change=ALLOW)
    assert restarted["resumed_at_step"] == 6 and restarted["resumed_from"].endswith("best.pt")
    mine, theirs = _weights(tmp_path / "tb" / "branch"), _weights(tmp_path / "tb" / "reference")
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert restarted["best"]["step"] == reference["best"]["step"] == 6


def test_a_branch_of_a_branch_killed_before_its_first_checkpoint_goes_on_from_its_start(tmp_path, monkeypatch):
    """Its start is the first branch's step 6 (that branch's own best: step 2, the source's, linked)."""
    config, start = _source(tmp_path, monkeypatch, eval_every=2)
    _branch(config, start, "first", monkeypatch)
    middle = tmp_path / "tb" / "first" / "checkpoints" / "step-00000006.pt"
    reference = _branch(config, middle, "reference", monkeypatch)
    _branch(config, middle, "second", monkeypatch, kill=True)
    restarted = _restart(config, "second", monkeypatch)
    assert (restarted["resumed_from"], restarted["resumed_at_step"]) == (str(middle), 6)
    assert restarted["samples"] == reference["samples"] and restarted["best"]["step"] == 2
    mine, theirs = _weights(tmp_path / "tb" / "second"), _weights(tmp_path / "tb" / "reference")
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
