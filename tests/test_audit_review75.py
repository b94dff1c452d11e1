"""Defects found by the review of 2026-12-04's changes (helper review75; each test failed before its fix)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dlrm import checkpoint as ckpt
from dlrm.config import load_config
from dlrm.train.trainer import train
from tests.conftest import CHILD_ENV, REPO
from tests.test_audit_qatrain75 import LAST_EVAL_SIGNAL
from tests.test_audit_review52 import tiny_config


def test_a_signal_during_a_profiled_runs_last_evaluation_keeps_its_step_breakdown(tmp_path):
    """One process, profiled, stopped by SIGTERM during its last evaluation (`FinishAlone`): the evaluation and its
    checkpoint finished, but the stop came before the step breakdown (profile_step.md, TensorBoard's
    profile/step_breakdown) was made from the trace the session wrote; the --resume trains no step, so none was ever
    made ("this run wrote no trace (it profiled no step)", with the trace beside it)."""
    config = tiny_config(tmp_path, checkpoint={"every": None},
                         profile={"enabled": True, "wait": 1, "warmup": 1, "active": 1, "repeat": 1})
    args = ["--config", str(config), "--tb-dir", str(tmp_path / "tb"), "--max-steps", "4", "--run-name", "r"]
    done = subprocess.run([sys.executable, "-c", LAST_EVAL_SIGNAL, "SIGTERM", *args], cwd=tmp_path, env=CHILD_ENV,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 143, done.stderr[-2000:]
    assert "stopped by signal (SIGTERM) at step 4, after its last evaluation" in done.stderr, done.stderr[-2000:]
    run = tmp_path / "tb" / "r"
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["step-00000004.pt"]
    assert len(list(run.glob("*.pt.trace.json.gz"))) == 1
    assert (run / "profile_step.md").is_file(), sorted(p.name for p in run.iterdir())  # was missing
    assert not (run / "summary.json").exists()  # left to the --resume, as before
    resumed = train(load_config(config, {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": "r",
                                         "train.max_steps": 4}), resume="latest")
    assert resumed["resumed_at_step"] == 4 and (run / "profile_step.md").is_file()


EARLY_STOP = {"eval_every": 2, "early_stopping": {"patience": None, "target": 0.01}}  # stops at its first evaluation


@pytest.mark.parametrize("name, code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_during_an_early_stops_evaluation_stops_the_run(tmp_path, name, code):
    """One process: a signal during the evaluation that stops the run early (inside the training loop, after its last
    look at the signal flag) was lost: "finishing the current step, then checkpointing and exiting", then the run
    went on to its summary and exited 0. Now it is held through the early stop's checkpoint (`FinishAlone`), the run
    exits 128 + the signal and the --resume writes the summary, as after the same signal during a last evaluation."""
    config = tiny_config(tmp_path, train=EARLY_STOP)
    args = ["--config", str(config), "--tb-dir", str(tmp_path / "tb"), "--max-steps", "4", "--run-name", "r"]
    done = subprocess.run([sys.executable, "-c", LAST_EVAL_SIGNAL, name, *args], cwd=tmp_path, env=CHILD_ENV,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == code, done.stderr[-2000:]  # was 0
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert f"stopped by signal ({name}) at step 2, after its last evaluation" in done.stderr, done.stderr[-2000:]
    run = tmp_path / "tb" / "r"
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["step-00000002.pt"]
    assert not (run / "summary.json").exists()  # was written
    overrides = {"log.tb_dir": str(tmp_path / "tb"), "train.max_steps": 4}
    resumed = train(load_config(config, {**overrides, "log.run_name": "r"}), resume="latest")
    whole = train(load_config(config, {**overrides, "log.run_name": "whole"}))
    assert resumed["early_stopped"] and resumed["steps"] == 2 and resumed["auc"] == whole["auc"]


SWEEP_EVAL_SIGNAL = """
import os, signal, sys
from dlrm.train import evaluator
real = evaluator.evaluate
def evaluate(forward, loader, env=None):  # every evaluation: the first trial's first one stops the sweep
    os.kill(os.getpid(), signal.SIGINT)
    return real(forward, loader, env) if env is not None else real(forward, loader)
evaluator.evaluate = evaluate
import dlrm.sweep as sweep
sweep.main(sys.argv[1:])
"""


def test_ctrl_c_during_a_trials_early_stop_stops_the_sweep(tmp_path):
    """A sweep's Ctrl-C during the evaluation that stops a trial early was lost (above): the trial finished, the sweep
    ran every other trial and exited 0. Now it stops after that trial's checkpoint, exit 130, to be resumed."""
    config = tiny_config(tmp_path, train={**EARLY_STOP, "max_steps": 4})
    done = subprocess.run([sys.executable, "-c", SWEEP_EVAL_SIGNAL, "--config", str(config), "--seeds", "1",
                           "--set", "optim.dense.lr=0.01,0.02", "--tb-dir", str(tmp_path / "tb"), "--run-name", "sw",
                           "--device", "cpu"], cwd=REPO, env=CHILD_ENV, capture_output=True, text=True, timeout=240)
    assert done.returncode == 130, done.stderr[-2000:]  # was 0, both trials run
    assert "sweep: stopped; `python -m dlrm.sweep --resume" in done.stderr, done.stderr[-2000:]
    sweep = tmp_path / "tb" / "sw"
    assert not (sweep / "sweep.md").exists()
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["00-dense.lr=0.01"]
