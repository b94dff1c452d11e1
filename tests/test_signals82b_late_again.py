"""A second SIGINT/SIGTERM once train.py's results are written (`dlrm.stop_signal.LateSignals`: the first noted, the
second stops the process at once, its line written straight to stderr). Under torchrun's agent, which passes the
signal it gets on to every rank, "SIGTERM again after ...: stopping now" was written by every rank (N lines on N
ranks) though the first signal's line is said once, by each machine's first rank (`said_once.signal_logger`). Now
the second's is said alike: by that rank only. Started another way, each rank's signal is its own, and said.

Each case is a process of its own (the second signal kills it, as it should): train.py's `LateSignals` as
`dlrm.cli.main` makes it (`said_once.late_signals`), begun, then two SIGTERMs. No timing, no torch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import CHILD_ENV, REPO

SCRIPT = """
import os, signal
from dlrm.distributed import said_once
late = said_once.late_signals()
late.begin("the run finished")
os.kill(os.getpid(), signal.SIGTERM)  # noted
os.kill(os.getpid(), signal.SIGTERM)  # stops the process now
print("not reached")
"""


@pytest.mark.parametrize("rank, agent, said", [("0", True, True), ("1", True, False), ("1", False, True)],
                         ids=["rank-0", "rank-1-under-torchrun", "rank-1-started-otherwise"])
def test_a_second_late_signal_is_said_by_the_first_rank_under_torchrun(rank, agent, said):
    env = {k: v for k, v in CHILD_ENV.items() if k != "TORCHELASTIC_RUN_ID"}
    env.update(WORLD_SIZE="2", RANK=rank, LOCAL_RANK=rank, **({"TORCHELASTIC_RUN_ID": "none"} if agent else {}))
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, env=env,
                          timeout=60)
    assert done.returncode == -signal.SIGTERM and "not reached" not in done.stdout, (done.returncode, done.stderr)
    again = [line for line in done.stderr.splitlines() if "again after" in line]
    # rank 1 under torchrun: was the same line as rank 0's
    assert again == ([again[0]] if said else []), done.stderr
    if said:
        assert again[0].endswith(" WARNING SIGTERM again after the run finished: stopping now"), again
