"""A SIGINT/SIGTERM that reaches a torchrun run once its results are written (`dlrm.stop_signal.LateSignals`: "a
signal from here on stops nothing", exit 0) is said once, by rank 0, as every line the ranks would say alike is
(`dlrm.distributed.said_once`). torchrun's agent passes the signal it gets (a scheduler's SIGTERM, a terminal's Ctrl-C)
on to every rank, and each said "SIGTERM arrived after the run finished (...): nothing left to stop, exit 0", rank 1's
as `[rank 1] ...`: the same line twice (N times on N ranks). Started another way, each rank's signal is its own.

The launch is real (`python -m torch.distributed.run --standalone --nproc-per-node 2`, gloo on the CPU); each rank
signals itself once its run returned, as the agent's passing on would reach it: no timing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import CHILD_ENV, REPO, make_dataset, process_output

CONFIG = {
    "data": {"batch_size": 20, "eval_batch_size": 10},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "train": {"epochs": 1, "log_every": 2, "device": "cpu", "seed": 3, "baseline": False},
    "checkpoint": {"every": 1000, "keep": 2},
}

# argv: the signal, then train.py's arguments. Each rank signals itself after its run's last line.
SCRIPT = """
import os, signal, sys
from dlrm.train import trainer
real_fit = trainer.Trainer.fit
def fit(self):
    summary = real_fit(self)
    os.kill(os.getpid(), getattr(signal, sys.argv[1]))
    return summary
trainer.Trainer.fit = fit
from dlrm.cli import main
from dlrm.stop_signal import LateSignals
LateSignals.until_exit = True  # as train.py
main(sys.argv[2:], prog_name="train.py")
"""


def test_a_signal_every_rank_gets_after_the_run_finished_is_said_once(tmp_path):
    raw = json.loads(json.dumps(CONFIG))
    raw["data"]["path"] = str(tmp_path / "ds")
    make_dataset(tmp_path / "ds", {"train": 40, "validation": 20}, row_group_size=20)
    (tmp_path / "c.json").write_text(json.dumps(raw))
    (tmp_path / "late.py").write_text(SCRIPT)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(tmp_path / "late.py"), "SIGTERM", "--config", str(tmp_path / "c.json"),
                           "--run-name", "r", "--tb-dir", str(tmp_path / "tb")],
                          cwd=REPO, capture_output=True, text=True, env=CHILD_ENV, timeout=240)
    assert done.returncode == 0, process_output(done)
    summary = tmp_path / "tb" / "r" / "summary.json"
    lines = [line for line in done.stderr.splitlines() if "arrived after the run finished" in line]
    assert len(lines) == 1, process_output(done)  # was 2: rank 0's and `[rank 1] ...`
    assert lines[0].endswith(f" WARNING SIGTERM arrived after the run finished ({summary} written): nothing left to "
                             "stop, exit 0") and not lines[0].startswith("[rank"), lines
    assert json.loads(summary.read_text())["world_size"] == 2


@pytest.mark.parametrize("rank, agent, said", [("0", True, True), ("1", True, False), ("1", False, True)],
                         ids=["rank-0", "rank-1-under-torchrun", "rank-1-started-otherwise"])
def test_a_late_signal_is_said_by_the_first_rank_under_torchrun(monkeypatch, capsys, rank, agent, said):
    """train.py's `LateSignals` (as `dlrm.cli.main` makes it) of rank `rank`, under torchrun's agent or started another
    way (then a rank's signal is its own: a ``kill PID`` of that process)."""
    from dlrm.distributed import said_once
    from dlrm.logging_setup import configure_logging
    from dlrm.stop_signal import LateSignals

    for name, value in {"WORLD_SIZE": "2", "RANK": rank, "LOCAL_RANK": rank}.items():
        monkeypatch.setenv(name, value)
    if agent:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    else:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    configure_logging(ranks=True)  # as train.py's main: a rank other than 0 logs as `[rank N]`
    late = LateSignals(said_once.signal_logger())
    try:
        late.begin("the run finished")
        os.kill(os.getpid(), signal.SIGTERM)  # noted by its handler (the main thread), said by `say`
        late.say()
    finally:
        late.end()
        configure_logging()
    err = capsys.readouterr().err
    assert late.arrived == signal.SIGTERM
    assert ("SIGTERM arrived after the run finished: nothing left to stop, exit 0" in err) == said, err
