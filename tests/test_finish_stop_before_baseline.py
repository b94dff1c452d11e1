"""A SIGTERM during a run's last evaluation stops it after that evaluation and its checkpoint, BEFORE the baseline's fit
and the summary's making (both left to the --resume, which makes them), in one process and on several ranks alike.

One process stopped there (`FinishAlone.release`, before `Trainer._finish`); several ranks agreed on the signal only
at the end of a phase that held `_finish` too, so each rank ran the baseline step first (its "baseline: off (...
skipped in a distributed run)" line, the HParams) and then stopped: the stop came after the baseline there and
before it in one process. With the baseline fitted (one process, ``train.baseline`` true), fitting it after a stop
was asked for would only delay the exit: the summary holding it is not written, and the --resume fits it again. The
ranks now agree once more before `_finish` (`dlrm.train.trainer.Trainer._fit`), and one signal during `_finish` is
still held to its end and agreed there (tests/test_audit_finish_signal.py).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dlrm import checkpoint as ckpt
from tests import test_audit_onerank_stop as onerank
from tests.conftest import CHILD_ENV, make_dataset
from tests.test_audit_onerank_stop import STEPS, assert_stopped_together

STOPPED = f"stopped by signal (SIGTERM) at step {STEPS}, after its last evaluation"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("finishbase") / "ds"
    make_dataset(root, {"train": 120, "validation": 40}, row_group_size=20)
    return root


def one_process(tmp_path, dataset, kill_at, *extra):
    """``train.py`` in one process (onerank's config and signal script, rank 0 signalled at `kill_at`, as a user's
    ``kill PID``), with ``train.baseline`` true; (exit code, output)."""
    cfg = json.loads(json.dumps(onerank.CONFIG))
    cfg["data"]["path"] = str(dataset)
    cfg["train"]["baseline"] = True
    del cfg["distributed"]  # (said as without effect in one process)
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    env = {**CHILD_ENV, "TRITON_INTERPRET": "1", "RANK": "0", "KILL_AT": kill_at or "", "KILL_RANK": "0" if kill_at else "-1"}
    for key in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(key, None)
    done = subprocess.run([sys.executable, "-c", onerank.SCRIPT, "--config", str(tmp_path / "c.json"), "--run-name",
                           "r", "--tb-dir", str(tmp_path / "tb"), *extra], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=240)
    return done.returncode, done.stdout + done.stderr


def test_one_process_stops_before_the_baseline_and_its_resume_fits_it(tmp_path, dataset):
    code, out = one_process(tmp_path, dataset, "eval")
    assert code == 143, out[-3000:]
    assert STOPPED in out and "baseline" not in out, out[-3000:]  # no fit, nor its line
    run = tmp_path / "tb" / "r"
    assert ckpt.list_checkpoints(run)[-1].name == ckpt.checkpoint_name(STEPS) and not (run / "summary.json").exists()
    code, out = one_process(tmp_path, dataset, None, "--resume")
    assert code == 0, out[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_at_step"] == STEPS and summary["baseline"]["auc"] is not None


def test_several_ranks_stop_before_the_baseline_step_as_one_process_does(tmp_path, dataset):
    results = onerank.launch(tmp_path, dataset, "r", kill_at="eval")
    assert_stopped_together(results, STOPPED)
    for rank, (_, out) in enumerate(results):  # rank 0 said "baseline: off (... skipped in a distributed run ...)"
        assert "baseline" not in out, f"rank {rank}:\n{out[-3000:]}"
    run = tmp_path / "tb" / "r"
    assert ckpt.list_checkpoints(run)[-1].name == ckpt.checkpoint_name(STEPS) and not (run / "summary.json").exists()
