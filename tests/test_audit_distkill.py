"""Crash consistency of a DISTRIBUTED run SIGKILLed (audit "distkill").

A fuzzer outside the repository SIGKILLed one rank, or the whole job, of a two-rank gloo run at random points (steps,
a sharded save's shards and manifest, best.pt's save, the summary), resumed it with `--resume latest` and compared
the result with an uninterrupted run. What it found is here:

1. A run whose first evaluation comes before its first checkpoint (train.eval_every < checkpoint.every), killed while
   saving that evaluation's best.pt (every rank's shard ``best-step-N.rankQ-of-W.pt`` written, best.pt's manifest
   not yet): `--resume` refused the run ("holds no checkpoint but more than a run writes before its first one"), as it
   refused a first step save's orphan shards before they were accepted; the job requeued with one command line could
   never run again. Now they are accepted and removed as the step shards are (`dlrm.train.run_dir.restart_leftovers`).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests._ports import reserved_port
from tests.conftest import CHILD_ENV, make_dataset

# 120 train rows in global batches of 20: 6 steps an epoch, 12 steps; an evaluation every 2 steps, a checkpoint every 5
CONFIG = {
    "data": {"batch_size": 20, "eval_batch_size": 10, "shuffle": True, "drop_last": False},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "optim": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.05}},
    "train": {"epochs": 2, "log_every": 2, "eval_every": 2, "device": "cpu", "seed": 3, "baseline": False},
    "checkpoint": {"every": 5, "keep": 2},
    "distributed": {"sharding": "row", "row_wise_min_rows": 10},
}
STEPS = 12

# rank KILL_RANK SIGKILLs itself (as the out-of-memory killer would) as it starts writing best.pt's manifest: every
# rank's best shard is complete, no manifest names them
SCRIPT = """
import os, signal, sys
if os.environ["RANK"] == os.environ["KILL_RANK"]:
    from dlrm import checkpoint
    real = checkpoint.write_atomic
    def write_atomic(path, *args, **kwargs):
        if os.path.basename(str(path)) == os.environ["KILL_AT"]:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(path, *args, **kwargs)
    checkpoint.write_atomic = write_atomic
from dlrm.cli import main
main(sys.argv[1:])
"""


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("distkill") / "ds"
    make_dataset(root, {"train": 120, "validation": 40}, row_group_size=20)
    return root


def launch(tmp_path, dataset, name, kill_at="", kill_rank=-1, extra=()):
    """Both ranks of ``train.py`` as torchrun launches them; [(exit code, output)] by rank."""
    cfg = json.loads(json.dumps(CONFIG))
    cfg["data"]["path"] = str(dataset)
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    args = ["--config", str(tmp_path / "c.json"), "--run-name", name, "--tb-dir", str(tmp_path / "tb"), *extra]
    with reserved_port() as port:  # (held until both ranks are done: tests/_ports.py)
        env = {**CHILD_ENV, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "TRITON_INTERPRET": "1", "KILL_AT": kill_at, "KILL_RANK": str(kill_rank)}
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
            pytest.fail(f"a rank still waits 150 s: {[p.wait() for p in procs]}")
    return results


def test_a_first_best_save_killed_before_its_manifest_starts_again_on_resume(tmp_path, dataset):
    results = launch(tmp_path, dataset, "r", kill_at="best.pt", kill_rank=0)
    assert results[0][0] == -9, results[0][1][-3000:]
    assert results[1][0] == 5, results[1][1][-3000:]  # the survivor: one line, exit 5
    assert "another rank of this distributed run is gone" in results[1][1] and "Traceback" not in results[1][1]
    ckdir = tmp_path / "tb" / "r" / "checkpoints"
    orphans = sorted(p.name for p in ckdir.iterdir())
    assert orphans == ["best-step-00000002.rank0-of-2.pt"], orphans  # (the survivor removed its own)
    results = launch(tmp_path, dataset, "r", extra=["--resume", "latest"])
    assert [code for code, _ in results] == [0, 0], results[0][1][-1500:]
    # as an uninterrupted run: the same files (the orphan shard removed, or named by the new best.pt), the same result
    assert launch(tmp_path, dataset, "u")[0][0] == 0
    summary, reference = (json.loads((tmp_path / "tb" / n / "summary.json").read_text()) for n in ("r", "u"))
    assert summary["steps"] == STEPS and summary.get("resumed_at_step") is None, summary
    for key in ("auc", "logloss", "accuracy", "final_train_loss"):
        assert summary[key] == reference[key], (key, summary[key], reference[key])
    assert summary["best"]["step"] == reference["best"]["step"] and summary["best"]["auc"] == reference["best"]["auc"]
    assert sorted(p.name for p in ckdir.iterdir()) == sorted(p.name for p in (tmp_path / "tb" / "u" / "checkpoints")
                                                              .iterdir())
