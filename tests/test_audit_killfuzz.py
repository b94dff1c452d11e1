"""Crash consistency of training under SIGKILL (audit "killfuzz").

A fuzzer outside the repository SIGKILLed `train.py` (one process, and the whole job of two gloo ranks under
torchrun) at random points (training steps, a checkpoint's zip writes, its fsync and rename, the pruning, best.pt's
link, the summary), once or twice in a row and during the resumed run's first checkpoint, resumed it with `--resume`
and compared the final weights, optimizer states, run_stats, best.pt and summary.json with an uninterrupted run: all
equal. What it found is here:

1. One rank of a distributed run SIGKILLed (the out-of-memory killer, a `kill -9` of one process): the surviving rank
   died in its next collective with gloo's traceback and "this is a bug in dlrm ... please report it" (exit 1). A rank
   that dies is no bug of the others': they now stop in one line naming what happened, exit 5 (`dlrm.errors.
   is_peer_lost`), and `--resume` continues the run.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from loguru import logger

from dlrm import cli
from tests._ports import reserved_port
from tests.conftest import CHILD_ENV, make_dataset

# gloo's error in the surviving rank's collective (torch 2.x, CPU), as it was raised when rank 1 was SIGKILLed
GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:17292: "
              "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the "
              "application. Check the logs of the remote worker before reporting an error. GLHF!")


def test_a_dead_peer_rank_is_reported_in_one_line_not_as_a_bug(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    messages: list[str] = []
    sink = logger.add(lambda m: messages.append(m.record["message"]), format="{message}")
    try:
        code = cli.report_failure(RuntimeError(GLOO_RESET), None)
    finally:
        logger.remove(sink)
    assert "Traceback" not in capsys.readouterr().err, "a traceback was printed"
    assert messages == [("rank 0: another rank of this distributed run is gone (stopped by its own error, logged by "
                         "it, or killed: out of memory, its host lost): Read error [127.0.0.1]:17292: Connection reset "
                         "by peer; stopped; --resume continues the run from its last checkpoint, if it wrote one")], \
        messages
    assert code == 5
    # gloo's other text for a peer gone; a RuntimeError of anything else stays a bug
    closed = RuntimeError("[gloo/transport/tcp/pair.cc:598] Connection closed by peer [10.0.0.2]:4242")
    assert cli.report_failure(closed, None) == 5
    assert cli.report_failure(RuntimeError("Connection reset by peer"), None) == 1  # not a collective's (no gloo)
    # NCCL's ncclRemoteError (torch's DistBackendError, a RuntimeError) for a peer gone
    nccl = RuntimeError("NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, remote process "
                        "exited or there was a network error, NCCL version 2.21.5\nncclRemoteError: A call failed "
                        "possibly due to a network error or a remote process exiting prematurely.")
    assert cli.report_failure(nccl, None) == 5


# 120 train rows in global batches of 20: 6 steps an epoch, 12 steps; a checkpoint every 3
CONFIG = {
    "data": {"batch_size": 20, "eval_batch_size": 10, "shuffle": True, "drop_last": False},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "optim": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.05}},
    "train": {"epochs": 2, "log_every": 2, "eval_every": None, "device": "cpu", "seed": 3, "baseline": False},
    "checkpoint": {"every": 3, "keep": 2},
    "distributed": {"sharding": "row", "row_wise_min_rows": 10},  # sharded tables: collectives in every lookup
}
STEPS = 12

# rank KILL_RANK SIGKILLs itself (as the out-of-memory killer would) at its KILL_STEP-th training step
SCRIPT = """
import os, signal, sys
if os.environ["RANK"] == os.environ["KILL_RANK"]:
    from dlrm.train import meter
    real, calls = meter.StepMeter.step, []
    def step(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == int(os.environ["KILL_STEP"]):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, *args, **kwargs)
    meter.StepMeter.step = step
from dlrm.cli import main
main(sys.argv[1:])
"""


def launch(tmp_path, dataset, kill_rank=-1, kill_step=0, extra=()):
    """Both ranks of train.py as torchrun starts them (without its agent, which would SIGTERM the survivor): [(exit
    code, output)] by rank."""
    cfg = json.loads(json.dumps(CONFIG))
    cfg["data"]["path"] = str(dataset)
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    args = ["--config", str(tmp_path / "c.json"), "--run-name", "r", "--tb-dir", str(tmp_path / "tb"), *extra]
    with reserved_port() as port:  # (held until both ranks are done: tests/_ports.py)
        env = {**CHILD_ENV, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "TRITON_INTERPRET": "1", "KILL_RANK": str(kill_rank), "KILL_STEP": str(kill_step)}
        procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, *args], cwd=tmp_path, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True,
                                  env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
        results = []
        try:
            for p in procs:
                results.append((p.wait(timeout=150), p.stdout.read()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"a rank still runs 150 s after the other died: {[p.wait() for p in procs]}")
    return results


def test_one_rank_sigkilled_the_survivor_stops_in_one_line_and_the_run_resumes(tmp_path):
    dataset = tmp_path / "ds"
    make_dataset(dataset, {"train": 120, "validation": 40}, row_group_size=20)
    (code0, out0), (code1, _) = launch(tmp_path, dataset, kill_rank=1, kill_step=5)  # after step 3's checkpoint
    assert code1 == -9
    assert code0 == 5, f"rank 0 exited {code0}:\n{out0[-3000:]}"
    assert "Traceback" not in out0 and "this is a bug" not in out0, out0[-3000:]
    assert "rank 0: another rank of this distributed run is gone" in out0, out0[-3000:]
    run = tmp_path / "tb" / "r"
    assert (run / "checkpoints" / "step-00000003.pt").is_file() and not (run / "summary.json").exists()
    results = launch(tmp_path, dataset, extra=["--resume"])
    assert [code for code, _ in results] == [0, 0], results[0][1][-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["steps"], summary["resumed_at_step"]) == (STEPS, 3) and summary["auc"] is not None
