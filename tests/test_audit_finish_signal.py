"""A SIGTERM on ONE rank of a distributed run at its end, outside the phases `agreed_stop` covered before.

During the run's summary (`Trainer._finish`: after the last evaluation's agreement) the signalled rank stopped at once
(`StopAtOnce`, exit 143) while the others exited 0: the ranks disagreed, and a signalled rank 0 left no summary.json.
Between the training loop's end and the last evaluation's agreed phase (the loop's signal handler removed, the next
one not installed yet) the signalled rank stopped at once too, and the others died in the last evaluation's collectives
(gloo's "Connection closed by peer": a bug's traceback, exit 1). Now both are held and agreed: every rank stops with
143 after the last checkpoint, the summary left to a --resume, which writes it.

Each rank is launched as torchrun launches it (RANK, WORLD_SIZE, MASTER_ADDR/PORT), as in test_audit_onerank_stop.
"""

from __future__ import annotations

import json

import pytest

from dlrm import checkpoint as ckpt
from tests.conftest import make_dataset
from tests import test_audit_onerank_stop as onerank
from tests.test_audit_onerank_stop import STEPS, assert_stopped_together

# rank KILL_RANK sends itself SIGTERM (as `kill PID` does) where KILL_AT says: during the summary (as its TensorBoard
# hparams are logged, on every rank before rank 0 writes summary.json), or just before the last evaluation's agreed
# phase begins (the loop's handler already removed), or after the start's agreed phase, before the training loop's
# handler is installed (as the step meter is made), or as rank 0 writes summary.json (after the ranks' last agreement)
SCRIPT = """
import os, signal, sys
if os.environ["RANK"] == os.environ["KILL_RANK"]:
    from dlrm.train import trainer
    def kill():
        os.kill(os.getpid(), signal.SIGTERM)
    if os.environ["KILL_AT"] == "summary":
        real_hparams = trainer.log_hparams
        def log_hparams(*args, **kwargs):
            kill()
            return real_hparams(*args, **kwargs)
        trainer.log_hparams = log_hparams
    elif os.environ["KILL_AT"] == "write":
        real_write = trainer.write_summary
        def write_summary(*args, **kwargs):
            kill()
            return real_write(*args, **kwargs)
        trainer.write_summary = write_summary
    elif os.environ["KILL_AT"] == "before_loop":
        real_meter = trainer.StepMeter
        def StepMeter(*args, **kwargs):
            kill()
            return real_meter(*args, **kwargs)
        trainer.StepMeter = StepMeter
    else:
        real_agreed = trainer.agreed_stop
        def agreed_stop(env, device, where, *args, **kwargs):
            if where == "after the last evaluation":
                kill()
            return real_agreed(env, device, where, *args, **kwargs)
        trainer.agreed_stop = agreed_stop
from dlrm.cli import main
main(sys.argv[1:])
"""


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("finishsig") / "ds"
    make_dataset(root, {"train": 120, "validation": 40}, row_group_size=20)
    return root


def launch(tmp_path, dataset, kill_at, kill_rank=1):
    """Both ranks of ``train.py``, rank `kill_rank` signalled at `kill_at`; [(exit code, output)] by rank."""
    return onerank.launch(tmp_path, dataset, "r", kill_at, kill_rank, script=SCRIPT)


def assert_stopped_after_the_last_checkpoint(tmp_path, results):
    assert_stopped_together(results, f"stopped by signal (SIGTERM) at step {STEPS}, after its last evaluation")
    run = tmp_path / "tb" / "r"
    assert ckpt.list_checkpoints(run)[-1].name == ckpt.checkpoint_name(STEPS)  # the last step's, with its evaluation
    assert not (run / "summary.json").exists()
    # left resumable as a signal during the last evaluation leaves it: its --resume writes the summary
    # (test_audit_onerank_stop.test_sigterm_on_one_rank_during_the_last_evaluation_stops_every_rank_after_its_checkpoint)


@pytest.mark.parametrize("kill_rank", [0, 1])
def test_sigterm_on_one_rank_during_the_summary_stops_every_rank_with_one_code(tmp_path, dataset, kill_rank):
    results = launch(tmp_path, dataset, kill_at="summary", kill_rank=kill_rank)
    assert_stopped_after_the_last_checkpoint(tmp_path, results)


def test_sigterm_on_one_rank_between_the_loop_and_the_last_evaluation_stops_every_rank(tmp_path, dataset):
    results = launch(tmp_path, dataset, kill_at="between")
    assert_stopped_after_the_last_checkpoint(tmp_path, results)


def test_sigterm_on_one_rank_before_the_training_loop_stops_every_rank_at_a_logging_window(tmp_path, dataset):
    # the signalled rank stopped at once; the other died in the first step's collectives (a bug's traceback, exit 1)
    results = launch(tmp_path, dataset, kill_at="before_loop")
    assert_stopped_together(results, "stopped by signal at step ")
    step = int(results[0][1].split("stopped by signal at step ")[1].split(";")[0])
    assert 0 < step < STEPS  # at a logging window (train.log_every 5), with that step's checkpoint
    assert ckpt.list_checkpoints(tmp_path / "tb" / "r")[-1].name == ckpt.checkpoint_name(step)


def test_sigterm_as_rank_0_writes_the_summary_is_ignored_on_every_rank(tmp_path, dataset):
    # after the last agreement nothing is left to stop: the summary written whole, every rank exits 0 (rank 0 exited 143
    # without a summary.json while the other exited 0)
    results = launch(tmp_path, dataset, kill_at="write", kill_rank=0)
    assert [code for code, _ in results] == [0, 0], results[0][1][-3000:]
    # (said by `LateSignals` since 2026-12-04, as for one process; before: "SIGTERM: ignored: the run is writing its
    # summary")
    assert "SIGTERM arrived after the run finished (" in results[0][1] and "nothing left to stop, exit 0" in results[0][1]
    summary = json.loads((tmp_path / "tb" / "r" / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["world_size"] == 2
