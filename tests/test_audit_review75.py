"""Defects found by the review of 2026-12-04's changes (helper review75; each test failed before its fix)."""

from __future__ import annotations

import subprocess
import sys

from dlrm import checkpoint as ckpt
from dlrm.config import load_config
from dlrm.train.trainer import train
from tests.conftest import CHILD_ENV
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
