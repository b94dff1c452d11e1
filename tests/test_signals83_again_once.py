"""A second SIGINT/SIGTERM during training (or while a signal is held: `dlrm.train.signals.GracefulStop`) stops the
process at once, "SIGTERM again: stopping now, without a checkpoint". Under torchrun's agent, which passes the signal
it gets on to every rank, that line was written by every rank (N lines on N ranks, rank 1's as "[rank 1] ..."), though
the first signal's is said once. Now it is said by each machine's first rank (`said_once.signal_logger`); started
another way, each rank's signal is its own, and said.

Each case is a process of its own (the second signal ends it): logging as `dlrm.cli` sets it up for the rank, a
`GracefulStop` as the trainer makes it, two SIGTERMs. No timing, no training."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.conftest import CHILD_ENV, REPO

SCRIPT = """
import os, signal, sys
from dlrm.logging_setup import configure_logging
configure_logging(ranks=True)
from dlrm.train.signals import GracefulStop
with GracefulStop(defer=os.environ["RANK"] != "0") as stop:
    os.kill(os.getpid(), signal.SIGTERM)  # noted (deferred on rank 1: the ranks' agreement says it)
    assert stop.requested
    os.kill(os.getpid(), signal.SIGTERM)  # stops the process now
    print("not reached")
"""


@pytest.mark.parametrize("rank, agent, said", [("0", True, True), ("1", True, False), ("1", False, True)],
                         ids=["rank-0", "rank-1-under-torchrun", "rank-1-started-otherwise"])
def test_a_second_signal_in_training_is_said_by_the_first_rank_under_torchrun(rank, agent, said):
    env = {k: v for k, v in CHILD_ENV.items() if k != "TORCHELASTIC_RUN_ID"}
    env.update(WORLD_SIZE="2", RANK=rank, LOCAL_RANK=rank, **({"TORCHELASTIC_RUN_ID": "none"} if agent else {}))
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, env=env,
                          timeout=60)
    assert done.returncode == 128 + signal.SIGTERM and "not reached" not in done.stdout, (done.returncode,
                                                                                          done.stderr)
    again = [line for line in done.stderr.splitlines() if " again: " in line]
    assert again == ([again[0]] if said else []), done.stderr  # rank 1 under torchrun: was the same line as rank 0's
    if said:
        assert again[0].endswith(" WARNING SIGTERM again: stopping now, without a checkpoint"), again
        assert again[0].startswith(f"[rank {rank}] ") == (rank != "0"), again
