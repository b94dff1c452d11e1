"""Review of the five commits after f5d4d19 (reports as one set, divergence checks, checkpoint edges): each test failed
before its fix.

1. A branch (``--resume <run A>/checkpoints/step-4.pt --run-name NEW``) as long as its checkpoint's step, of a run A
   extended since (A's summary.json: steps 10), was reported "finished" with run A's later summary (another run's
   metrics and steps): `summarized` took any summary at the checkpoint's step "or later" for the checkpoint's own end.
2. `GracefulStop` replaced a SIGTERM (or SIGINT) handler that whoever started the process set to ignore: a process
   started with SIGTERM ignored stopped on SIGTERM during the training steps (`StopAtOnce` leaves such a handler alone).
3. `check_position` refused a legitimate resume: a run resumed once with ``--allow-config-change data.batch_size``
   counts its earlier epochs in the old batches, so its later checkpoints' step is not epoch * batches + batch;
   resumed again (same config: nothing to allow), it was refused as "a damaged checkpoint, or other data".
4. The weight check ran before the step checkpoints only: a new best at an evaluation that is no checkpoint step
   wrote best.pt with a NaN/Inf weight that the evaluation did not read (its metrics finite).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dlrm import checkpoint as ckpt
from dlrm.config import ConfigError, load_config
from dlrm.errors import NonFiniteLoss
from dlrm.train import evaluator as evaluator_mod
from dlrm.train.resume_policy import check_position
from dlrm.train.signals import GracefulStop
from dlrm.train.step import TrainStep
from dlrm.train.trainer import train
from tests.conftest import CHILD_ENV, make_dataset

REPO = Path(__file__).resolve().parents[1]
CONFIG = {
    "data": {"batch_size": 8, "shuffle": True, "drop_last": False, "shuffle_buffer_rows": 40},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "optim": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.05}},
    "train": {"epochs": 3, "log_every": 2, "device": "cpu", "seed": 3, "deterministic": True, "baseline": False},
    "checkpoint": {"every": 1000, "keep": 5},
}  # 100 train rows in batches of 8: 13 batches an epoch (of 16: 7)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("review53")
    make_dataset(root / "ds", {"train": 100, "validation": 32}, row_group_size=30)
    return root / "ds"


def config(data, tmp_path, name, **overrides):
    raw = json.loads(json.dumps(CONFIG))
    raw["data"]["path"] = str(data)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(raw))
    return load_config(path, {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": name, **overrides})


# -- 1. a branch as long as its checkpoint, of a run extended since ----------------------------------------------------

def test_a_branch_at_its_checkpoints_step_does_not_report_the_extended_source_runs_summary(data, tmp_path):
    train(config(data, tmp_path, "a", **{"train.max_steps": 4}))
    step4 = tmp_path / "tb" / "a" / "checkpoints" / ckpt.checkpoint_name(4)
    extended = train(config(data, tmp_path, "a", **{"train.max_steps": 10}), resume="latest")
    assert extended["steps"] == 10 and step4.is_file()
    branch = train(config(data, tmp_path, "new", **{"train.max_steps": 4}), resume=str(step4))
    # was: {"steps": 10, "run_dir": ".../tb/a", "finished": True, ...}: run a's summary at step 10, nothing of its own
    assert branch["steps"] == 4
    assert Path(branch["run_dir"]) == tmp_path / "tb" / "new"
    assert json.loads((tmp_path / "tb" / "new" / "summary.json").read_text())["steps"] == 4
    assert json.loads((tmp_path / "tb" / "a" / "summary.json").read_text())["steps"] == 10  # run a untouched


# -- 2. SIGTERM ignored by whoever started the process ----------------------------------------------------------------

def test_graceful_stop_leaves_an_ignored_signal_ignored():
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with GracefulStop() as stop:
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN  # was: GracefulStop._handle
            os.kill(os.getpid(), signal.SIGTERM)
            assert not stop.requested
            assert signal.getsignal(signal.SIGINT) is not signal.SIG_IGN  # not ignored: handled as before
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)


SCRIPT = """
import os, signal, sys
from dlrm.train import meter
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as `nohup`-like launchers or a parent's ignore set it
step = meter.StepMeter.step
def stepped(self, *a):
    step(self, *a)
    os.kill(os.getpid(), signal.SIGTERM)  # during the training steps
meter.StepMeter.step = stepped
from dlrm.cli import main
main(sys.argv[1:])
"""


def test_a_run_started_with_sigterm_ignored_trains_to_its_end(data, tmp_path):
    raw = json.loads(json.dumps(CONFIG))
    raw["data"]["path"] = str(data)
    (tmp_path / "c.json").write_text(json.dumps(raw))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, "--config", str(tmp_path / "c.json"), "--tb-dir",
                           str(tmp_path / "tb"), "--run-name", "r", "--max-steps", "3"],
                          cwd=tmp_path, env=CHILD_ENV, capture_output=True, text=True,
                          timeout=120, check=False)
    # was: exit 143, "stopped by signal at step 1"
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "tb" / "r" / "summary.json").read_text())["steps"] == 3


# -- 3. a checkpoint after a batch-size change, resumed again -----------------------------------------------------------

def test_a_run_resumed_after_a_batch_size_change_resumes_again(data, tmp_path):
    train(config(data, tmp_path, "r", **{"train.max_steps": 13}))  # epoch 0's 13 batches of 8: step 13
    changed = {"data.batch_size": 16}  # 7 batches an epoch from now on
    first = train(config(data, tmp_path, "r", **changed, **{"train.max_steps": 20}), resume="latest",
                  allow_config_change=["data.batch_size"])
    assert first["steps"] == 20
    state = ckpt.load_checkpoint(ckpt.list_checkpoints(tmp_path / "tb" / "r")[-1])
    assert state["position"] == {"step": 20, "epoch": 1, "batch": 7}
    # the same config as that checkpoint's: was refused, "position.epoch 1, batch 7 do not match position.step 20"
    again = train(config(data, tmp_path, "r", **changed, **{"train.max_steps": 21}), resume="latest")
    assert again["steps"] == 21  # epochs 1 and 2 of 7 batches


@pytest.mark.parametrize("position", [
    {"step": 20, "epoch": 1, "batch": 7},  # epoch 0 of 13 batches, epoch 1 of 7
    {"step": 9, "epoch": 2, "batch": 3},  # epochs 0 and 1 of 3 batches each (batch_size 32), epoch 2 of 7
])
def test_positions_of_a_changed_batch_count_pass_the_check(position):
    check_position(position, 7, (), "x.pt")


@pytest.mark.parametrize("position, what", [
    ({"step": 4, "epoch": 0, "batch": 8}, "position.batch 8 is beyond the 7 batches"),
    ({"step": 30, "epoch": 0, "batch": 4}, "position.epoch 0, batch 4 do not match position.step 30"),
    ({"step": 5, "epoch": 2, "batch": 4}, "position.epoch 2, batch 4 do not match position.step 5"),
])
def test_positions_no_run_can_reach_are_still_refused(position, what):
    with pytest.raises(ConfigError, match=f"--resume x.pt: {what}"):
        check_position(position, 7, (), "x.pt")


# -- 4. best.pt of an overflowed model, written at an evaluation that is no checkpoint step ----------------------------

def test_an_overflowed_weight_is_not_written_as_best_pt(data, tmp_path, monkeypatch):
    """An update that overflowed a weight the evaluation does not read (an embedding row no evaluation row looks up;
    here the evaluation is scripted) leaves its loss and the evaluation finite: the new best's best.pt was written with
    the Inf weight (the weight check ran only before the step checkpoints), and stayed after the run stopped."""
    monkeypatch.setattr(evaluator_mod, "evaluate",
                        lambda forward, loader, env=None: {"auc": 0.7, "logloss": 0.6, "accuracy": 0.6})
    update = TrainStep.__call__
    calls = []

    def overflowing(self, batch):
        loss = update(self, batch)  # this step's loss: computed before its update
        calls.append(1)
        if len(calls) == 4:
            with torch.no_grad():
                next(self.model.parameters()).view(-1)[0] = float("inf")
        return loss

    monkeypatch.setattr(TrainStep, "__call__", overflowing)
    with pytest.raises(NonFiniteLoss, match="became NaN or Inf at step [45]; stopped"):
        train(config(data, tmp_path, "r", **{"train.max_steps": 8, "train.eval_every": 4}))
    best = tmp_path / "tb" / "r" / "checkpoints" / "best.pt"
    # was: best.pt written at step 4 holding the Inf weight (the run's "best model", exported by --export)
    assert not best.exists() or all(torch.isfinite(v).all() for v in ckpt.load_checkpoint(best)["model"].values()
                                    if v.is_floating_point())
