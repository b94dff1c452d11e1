"""A torchrun rank that found an error every rank finds alike, said once (by rank 0, or each machine's first rank),
leaves only once that line is out.

torchrun's agent polls its workers every 0.1 s and stops the rest with SIGTERM as soon as one exits: a rank 1 that
reported first (it says nothing: rank 0 speaks for the run) and exited killed rank 0 before its line was written,
and the run ended with no message at all. Imports no torch (a config error stays fast): `dlrm.distributed.env`,
where the ranks met, is consulted only when already loaded.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Optional

from dlrm.errors import TrainingStopped

SAID_ONCE_GRACE_S = 1.5
"""How long a rank other than its machine's first waits before it exits, after an error every rank found alike
before the ranks met (no store to hear rank 0 through yet). The ranks then ran the same code on the same files from
the same start, so rank 0 says its line within the start-up's spread of the ranks (tens of milliseconds; a few
hundred on a loaded machine) of the others' reaching theirs. The cost: a failed launch ends that much later. Not
under torchrun's agent, whose ranks wait for it to stop them (`AGENT_WAIT_S`)."""

AGENT_WAIT_S = 10.0
"""Under torchrun's agent, the longest a rank other than its machine's first waits for the agent to stop it, after an
error said once for the run (before the ranks met or after): the agent stops it once that first rank exited, within
its poll (--monitor-interval, 0.1 s), so the wait costs nothing more than that rank's own exit. Bounded for a first
rank that hangs; a rank 0 whose line came later than `SAID_ONCE_GRACE_S` (a machine busy starting 8 ranks) was killed
unheard."""


def node_other_rank() -> bool:
    """Whether this process is a torchrun rank (WORLD_SIZE > 1) other than its machine's first (LOCAL_RANK 0)."""
    world = os.environ.get("WORLD_SIZE", "").strip()
    return world.isdigit() and int(world) > 1 and os.environ.get("LOCAL_RANK", "0").strip() not in ("", "0")


def wait_until_rank_zero_said(exc: Optional[BaseException], timeout_s: Optional[float] = None) -> None:
    """Called by every rank once it has reported `exc`, an error said once for the run. Under torchrun's agent, a
    rank other than its machine's first waits until the agent stops it (`_pause` of at most `AGENT_WAIT_S`, ended by
    its SIGTERM), which the agent does once that first rank has exited: its line is out then and its own exit code
    (2, 3, 4) is the one the agent reports. Left as soon as rank 0's word came through the store, rank 1 exited while
    rank 0 was still leaving the process group, and the agent killed rank 0 (exit -15 in its report, whose "root
    cause" was rank 1, which prints nothing): 4 of 10 refused --resume runs on 2 CPU ranks. The other launches (the
    ranks started one by one, a launcher of another kind), and an agreed signal stop (the agent itself may be stopping
    the ranks, and sends no second SIGTERM): after the ranks met, through the process group's store
    (`dlrm.distributed.env.hold_until_rank_zero_said`: the speakers tell, the others wait for that, at most 10 s);
    before, each rank other than its machine's first pauses `SAID_ONCE_GRACE_S`. A rank's own error
    (`this_rank_only`, said by that rank) holds nothing, nor does a run of one process. A SIGTERM or Ctrl-C ends the
    wait: the rank exits with its error's code as it would have."""
    if getattr(exc, "this_rank_only", False):
        return
    if under_torchrun_agent() and not isinstance(exc, TrainingStopped):
        if node_other_rank():
            _pause(AGENT_WAIT_S)
        return
    env = sys.modules.get("dlrm.distributed.env")
    if env is not None and env._joined():
        env.hold_until_rank_zero_said(timeout_s)
    elif node_other_rank():
        _pause(SAID_ONCE_GRACE_S)


def signal_reaches_every_rank(exc: BaseException) -> bool:
    """Whether `exc`, a stop at once (`dlrm.stop_signal.StopAtOnce`: not agreed; or Ctrl-C's KeyboardInterrupt) before
    the ranks met, is one every rank makes alike, said by each machine's first rank only: under torchrun's agent, whose
    SIGTERM (its own, or the one torchrun got and passes on) reaches every rank, as does a terminal's Ctrl-C (the
    ranks run in sessions of their own: torchrun gets the SIGINT and its agent passes it on to each), and which stops
    the others once a rank signalled alone has exited. Both ranks said "SIGTERM: stopped at once ..." (or "interrupted
    (Ctrl-C)"), rank 1's as `[rank 1] ...`. Started another way, or once the ranks met (an agreed stop is said once already), a rank's stop is
    its own to say."""
    if getattr(exc, "agreed", False) or not under_torchrun_agent():
        return False
    env = sys.modules.get("dlrm.distributed.env")
    return env is None or not env._joined()


def signal_logger():
    """The logger of a line about a SIGINT/SIGTERM that no agreement of the ranks follows (one once the run's results
    are written, `dlrm.stop_signal.LateSignals`; one after the run's last agreement, `dlrm.train.signals.agreed_stop`):
    under torchrun's agent, which passes the signal it gets (a scheduler's SIGTERM, a terminal's Ctrl-C) on to every
    rank, said by each machine's first rank only, as every rank-wide line is (`signal_reaches_every_rank`); every rank
    said it, rank 1's as `[rank 1] ...`. The cost: a ``kill PID`` of another rank alone goes unsaid there (it stops
    nothing either way, and its rank exits 0 as the others do). Started another way, each rank's signal is its own."""
    from loguru import logger

    return logger.bind(same_on_every_rank=under_torchrun_agent() and node_other_rank())


def late_signals():
    """train.py's `dlrm.stop_signal.LateSignals`: its lines (a signal once the results are written; a second one,
    which stops the process at once) said as `signal_logger` says a line, by each machine's first rank under
    torchrun's agent. The second's, written straight to stderr, was said by every rank."""
    from dlrm.stop_signal import LateSignals

    return LateSignals(signal_logger(), again_said=not (under_torchrun_agent() and node_other_rank()))


def under_torchrun_agent() -> bool:
    """Whether torchrun's elastic agent started this process (it sets TORCHELASTIC_RUN_ID in its workers): the agent
    that stops every rank left once one of them exits."""
    return bool(os.environ.get("TORCHELASTIC_RUN_ID", "").strip())


def _pause(seconds: float) -> None:
    """Sleep `seconds`, ended early by SIGTERM or SIGINT (torchrun's agent stopping this rank once rank 0 exited, a
    Ctrl-C), which would otherwise kill it by the signal, or raise KeyboardInterrupt out of its error report."""
    stopped: list[int] = []
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGTERM, signal.SIGINT):
            previous[s] = signal.signal(s, lambda signum, frame: stopped.append(signum))
    try:
        deadline = time.monotonic() + seconds
        while not stopped and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
