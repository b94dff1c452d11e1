"""A SIGTERM that reaches ONE rank of a distributed run (a user's ``kill PID``, a scheduler pre-empting one process).

During the training steps the ranks already agree through the logging windows (tests/test_distributed.py). Outside
them, where SIGTERM stops a process at once (`StopAtOnce`), the rank that got it left alone: during the start-up (the
run directory opened, the sharded model built) or the run's last evaluation (the sharded lookups' all_to_all, the
logits' all_gather), the other rank died in its next collective of gloo's "Connection closed by peer" traceback, "this
is a bug in dlrm" and exit 1 (or waited for the process group's timeout), the ranks exiting with different codes, and
the start-up's new run directory was left behind. Now (`dlrm.train.signals.agreed_stop`) such a signal is held until
the phase ends, where the ranks agree on it: every rank stops there with 143, in one line.

Each rank is launched here as torchrun launches it (RANK, WORLD_SIZE, MASTER_ADDR/PORT), without torchrun itself,
whose agent kills the other ranks once one exits: each rank's own exit code and output are what is checked.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dlrm import checkpoint as ckpt
from tests._ports import reserved_port
from tests.conftest import CHILD_ENV, make_dataset

# 120 train rows in global batches of 20: 6 steps an epoch, 12 steps; the last evaluation's 40 rows in 4 batches
CONFIG = {
    "data": {"batch_size": 20, "eval_batch_size": 10, "shuffle": True, "drop_last": False},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "optim": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.05}},
    "train": {"epochs": 2, "log_every": 5, "eval_every": None, "device": "cpu", "seed": 3},
    "checkpoint": {"every": 5, "keep": 5},
    "distributed": {"sharding": "row", "row_wise_min_rows": 10},  # sharded tables: collectives in every lookup
}
STEPS = 12

# rank KILL_RANK sends itself SIGTERM (as `kill PID` does) where KILL_AT says: as the run directory is opened (the
# start-up), or as the last evaluation begins (the only one: train.eval_every is null)
SCRIPT = """
import os, signal, sys
if os.environ["RANK"] == os.environ["KILL_RANK"]:
    from dlrm.train import evaluator, trainer
    def killing(real):
        def call(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)
            return real(*args, **kwargs)
        return call
    if os.environ["KILL_AT"] == "start":
        trainer.Trainer._open_run_dir = killing(trainer.Trainer._open_run_dir)
    else:
        evaluator.evaluate = killing(evaluator.evaluate)
from dlrm.cli import main
main(sys.argv[1:])
"""


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("onerank") / "ds"
    make_dataset(root, {"train": 120, "validation": 40}, row_group_size=20)
    return root


def launch(tmp_path, dataset, name, kill_at=None, kill_rank=1, extra=(), script=None):
    """Both ranks of ``train.py`` (`script`, by default the one above, when `kill_at`); [(exit code, output)] by
    rank."""
    cfg = json.loads(json.dumps(CONFIG))
    cfg["data"]["path"] = str(dataset)
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    args = ["--config", str(tmp_path / "c.json"), "--run-name", name, "--tb-dir", str(tmp_path / "tb"), *extra]
    with reserved_port() as port:  # (held until both ranks are done: tests/_ports.py)
        env = {**CHILD_ENV, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "TRITON_INTERPRET": "1", "KILL_AT": kill_at or "", "KILL_RANK": str(kill_rank if kill_at else -1)}
        procs = [subprocess.Popen([sys.executable, "-c", script or SCRIPT, *args], cwd=tmp_path,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
        results = []
        try:
            for p in procs:
                results.append((p.wait(timeout=150), p.stdout.read()))
        except subprocess.TimeoutExpired:  # a rank waiting for the other in a collective (the process group's timeout)
            for p in procs:
                p.kill()
            pytest.fail(f"a rank still waits 150 s after the signal: {[p.wait() for p in procs]}")
    return results


def assert_stopped_together(results, what):
    for rank, (code, out) in enumerate(results):
        assert code == 143, f"rank {rank} exited {code}:\n{out[-3000:]}"
        assert "Traceback" not in out and "this is a bug" not in out, f"rank {rank}:\n{out[-3000:]}"
        # rank 0 says the agreed stop for every rank (the others' `[rank N]` copies were the same line again)
        assert (what in out) == (rank == 0), f"rank {rank}:\n{out[-3000:]}"


def test_sigterm_on_one_rank_during_the_start_stops_every_rank_without_a_run_directory(tmp_path, dataset):
    results = launch(tmp_path, dataset, "r", kill_at="start")
    assert_stopped_together(results, "stopped before the first step, on every rank")
    assert not (tmp_path / "tb" / "r").exists()  # the new run's directory given up, as by one process


def test_sigterm_on_one_rank_during_the_last_evaluation_stops_every_rank_after_its_checkpoint(tmp_path, dataset):
    results = launch(tmp_path, dataset, "r", kill_at="eval")
    assert_stopped_together(results, f"stopped by signal (SIGTERM) at step {STEPS}, after its last evaluation")
    run = tmp_path / "tb" / "r"
    manifest = ckpt.list_checkpoints(run)[-1]  # the last step's, holding the last evaluation
    assert manifest.name == ckpt.checkpoint_name(STEPS)
    assert len(list(manifest.parent.glob(manifest.stem + ".rank*-of-2.pt"))) == 2
    assert not (run / "summary.json").exists()
    # the resume trains no step and makes the summary the signal left
    results = launch(tmp_path, dataset, "r", extra=["--resume", "latest"])
    assert [code for code, _ in results] == [0, 0], results[0][1][-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["steps"], summary["resumed_at_step"]) == (STEPS, STEPS) and summary["auc"] is not None
