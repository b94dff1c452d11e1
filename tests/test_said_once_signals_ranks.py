"""Lines that two torchrun ranks each said where they reached the same verdict, now said once (rank 0), as the
project's other refusals are (`dlrm.cli.report_failure`, `found_alike`); a rank's own distinct failure stays its own.

- a shard only rank 1 cannot read (truncated): rank 1 refused it, rank 0 relayed it ("rank 1 could not resume from X:
  M", `failure_error`), and both lines were said; now the relayed failure is compared as rank 1's own line M, found
  alike, and said once by rank 0 (its line names rank 1); two ranks' different failures are still each said.
- a SIGTERM during the start-up that every rank got (one a library's catch-all dropped as the ranks imported torch,
  `tests/test_swallowed_signal.py`): each rank warned "SIGTERM: stopping before the first step, once every rank knows";
  now rank 1's warning waits for the start-up's agreement, dropped when every rank got the signal (rank 0's says it),
  said when rank 1 alone got it (`GracefulStop.say_deferred`, as in the training loop).
- a SIGTERM before the ranks met, under torchrun's agent (whose SIGTERM reaches every rank): "SIGTERM: stopped at once
  ..." was said by rank 0 and as `[rank 1] ...`; now by each machine's first rank only (`said_once.
  signal_reaches_every_rank`). Started another way, each rank still says its own.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dlrm.config import ConfigError
from tests.fastdist_ranks import call_on_ranks, failures_on_ranks


SHARD_LINE = "/r/checkpoints/step-00000006.rank1-of-2.pt: not a readable checkpoint (not a zip archive)"
RELAYED = f"rank 1 could not resume from /r/checkpoints/step-00000006.pt: {SHARD_LINE}"


def _shard_unreadable_on_rank_one(rank: int, rank_zero_own: str) -> None:
    from dlrm.distributed.env import agree_on_input_error, failure, failure_error

    if rank == 1:  # its own failure
        error = ConfigError(SHARD_LINE)
    elif rank_zero_own:  # a failure of rank 0's own as well: two distinct failures
        error = ConfigError(rank_zero_own)
    else:  # rank 1's, relayed (`dlrm.distributed.checkpoint._agreed`)
        error = failure_error(failure(ConfigError(SHARD_LINE)), 1, "could not resume from /r/checkpoints/step-00000006.pt")
    said: list[str] = []
    agree_on_input_error(error, str(error), said.append, timeout_s=4)
    if rank_zero_own:  # apart: each says its own, naming its rank
        assert said == [f"rank {rank}: {rank_zero_own if rank == 0 else SHARD_LINE}"], said
    else:  # alike: rank 0's line, the relayed one, is said for the run (`found_alike`: `dlrm.cli`'s logger leaves it
        # out on every rank but each machine's first, and rank 1 waits for rank 0's before it exits)
        assert said == [RELAYED if rank == 0 else SHARD_LINE], said
        assert getattr(error, "found_alike", False) and not getattr(error, "this_rank_only", False), rank


def test_a_shard_only_rank_one_cannot_read_is_said_once_by_rank_zero(tmp_path):
    """Before the fix rank 0 said "rank 1 could not resume from ..." and rank 1 "rank 1: <the same refusal>"."""
    assert failures_on_ranks(_shard_unreadable_on_rank_one, [("",)], world=2, tmp_path=tmp_path) == {}


def test_two_ranks_distinct_failures_are_each_said(tmp_path):
    assert failures_on_ranks(_shard_unreadable_on_rank_one, [("bad.json: no such key",)], world=2,
                             tmp_path=tmp_path) == {}


WARNED = "SIGTERM: stopping before the first step, once every rank knows (send it again to stop at once)"


def _start_on_rank(rank: int, root: str, swallowed_on: tuple, results: dict) -> None:
    import torch.distributed as dist
    from loguru import logger

    from dlrm.errors import TrainingStopped
    from dlrm.train import trainer as trainer_mod
    from tests.test_swallowed_signal import _config, _swallowing

    dist.init_process_group("gloo", init_method=f"file://{root}/init", rank=rank, world_size=2)
    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="localhost")
    if rank in swallowed_on:
        trainer_mod.build_for_data = _swallowing(trainer_mod.build_for_data)
    warnings: list[str] = []
    sink = logger.add(lambda m: warnings.append(m.record["message"]), level="WARNING")
    try:
        trainer_mod.train(_config(Path(root), "dist", rank))
        results[(rank, "outcome")] = "trained"
    except TrainingStopped as e:
        results[(rank, "outcome")] = e.exit_code
    finally:
        logger.remove(sink)
        dist.destroy_process_group()
    results[(rank, "warned")] = [w for w in warnings if "before the first step" in w]


@pytest.mark.parametrize("swallowed_on, warned", [((0, 1), [[WARNED], []]), ((1,), [[], [WARNED]])],
                         ids=["every-rank", "rank-1-alone"])
def test_a_sigterm_at_the_start_up_is_warned_of_once(tmp_path, swallowed_on, warned):
    from tests.conftest import make_dataset

    make_dataset(tmp_path / "ds", {"train": 48, "validation": 16}, row_group_size=16)
    got, codes = call_on_ranks(_start_on_rank, (str(tmp_path), swallowed_on), 2, tmp_path, timeout=300)
    assert codes == [0, 0] and [got.get((q, "outcome")) for q in (0, 1)] == [143, 143], (codes, got)
    assert [got[(q, "warned")] for q in (0, 1)] == warned, got


STOPPED = "SIGTERM: stopped at once, outside the training steps (no checkpoint written now)"


@pytest.mark.parametrize("rank, agent, said", [("0", True, True), ("1", True, False), ("1", False, True)],
                         ids=["rank-0", "rank-1-under-torchrun", "rank-1-started-otherwise"])
def test_a_sigterm_before_the_ranks_met_is_said_by_the_first_rank(monkeypatch, capsys, rank, agent, said):
    """`dlrm.cli.report_failure` of `StopAtOnce`'s stop before the ranks met (no process group), as train.py's rank
    `rank` under torchrun's agent (TORCHELASTIC_RUN_ID) or not."""
    import sys

    from dlrm import cli
    from dlrm.errors import TrainingStopped
    from dlrm.logging_setup import configure_logging

    for name, value in {"WORLD_SIZE": "2", "RANK": rank, "LOCAL_RANK": rank}.items():
        monkeypatch.setenv(name, value)
    if agent:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    else:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delitem(sys.modules, "dlrm.distributed.env", raising=False)  # (the ranks never met)
    configure_logging(ranks=True)  # as train.py's main: a rank other than 0 logs as `[rank N]`
    try:
        assert cli.report_failure(TrainingStopped(143, STOPPED), None) == 143
    finally:
        configure_logging()
    err = capsys.readouterr().err
    assert (STOPPED in err) == said, err
    assert err.count(STOPPED) <= 1, err


@pytest.mark.parametrize("rank, agent, said", [("0", True, True), ("1", True, False), ("1", False, True)],
                         ids=["rank-0", "rank-1-under-torchrun", "rank-1-started-otherwise"])
def test_a_ctrl_c_before_the_ranks_met_is_said_by_the_first_rank(monkeypatch, capsys, rank, agent, said):
    """A terminal's Ctrl-C reaches torchrun, whose agent passes the SIGINT on to every rank (each in a session of its
    own): before the ranks met, "interrupted (Ctrl-C)" was said by rank 0 and again as `[rank 1] ...`; now as the
    SIGTERM above is."""
    import sys

    from dlrm import cli
    from dlrm.logging_setup import configure_logging

    for name, value in {"WORLD_SIZE": "2", "RANK": rank, "LOCAL_RANK": rank}.items():
        monkeypatch.setenv(name, value)
    if agent:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    else:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delitem(sys.modules, "dlrm.distributed.env", raising=False)  # (the ranks never met)
    configure_logging(ranks=True)
    try:
        assert cli.report_failure(KeyboardInterrupt(), None) == 130
    finally:
        configure_logging()
    err = capsys.readouterr().err
    assert ("interrupted (Ctrl-C)" in err) == said, err
    assert err.count("interrupted (Ctrl-C)") <= 1, err


HELD = "SIGTERM: held until every rank knows, then stopping (send it again to stop at once)"
LAST = "SIGTERM: stopping after the last evaluation, once every rank knows (send it again to stop at once)"


def _end_of_run_on_rank(rank: int, root: str, between_on: tuple, during_on: tuple, results: dict) -> None:
    """A distributed run's end as `Trainer.fit` holds it: `held_signals`, then the last evaluation's `agreed_stop`;
    a SIGTERM raised on the ranks `between_on` between the two (after the training loop), on `during_on` inside (a
    SIGINT where both are given: each its own signal)."""
    import signal

    import torch
    import torch.distributed as dist
    from loguru import logger

    from dlrm.distributed.env import DistEnv
    from dlrm.errors import TrainingStopped
    from dlrm.train.signals import agreed_stop, held_signals

    dist.init_process_group("gloo", init_method=f"file://{root}/init", rank=rank, world_size=2)
    warnings: list[str] = []
    sink = logger.add(lambda m: warnings.append(m.record["message"]), level="WARNING")
    env = DistEnv(rank, 2, rank)
    try:
        with held_signals(env) as held:
            if rank in between_on:
                signal.raise_signal(signal.SIGTERM)
            with agreed_stop(env, torch.device("cpu"), "after the last evaluation", lambda name: f"stopped ({name})",
                             held):
                if rank in during_on:
                    signal.raise_signal(signal.SIGINT if between_on else signal.SIGTERM)
            if during_on == ("after",) and rank == 1:  # after the last agreement: nothing left to stop
                signal.raise_signal(signal.SIGTERM)
        results[(rank, "outcome")] = 0
    except TrainingStopped as e:
        results[(rank, "outcome")] = e.exit_code
    finally:
        logger.remove(sink)
        dist.destroy_process_group()
    results[(rank, "warned")] = warnings


@pytest.mark.parametrize("between_on, during_on, warned", [
    ((0, 1), (), [[HELD], []]), ((), (0, 1), [[LAST], []]), ((1,), (), [[], [HELD]]), ((), (1,), [[], [LAST]]),
    ((0,), (1,), [[HELD], [LAST.replace("SIGTERM", "SIGINT")]])],
    ids=["every-rank-between", "every-rank-during", "rank-1-alone-between", "rank-1-alone-during", "each-its-own"])
def test_the_end_of_runs_held_signal_is_warned_of_once(tmp_path, between_on, during_on, warned):
    """Every rank warned of a signal held for the end's agreement (`held_signals`): a SIGTERM every rank got (torchrun's)
    was warned of by rank 0 and again as `[rank 1] ...`. Now rank 1's warning waits for the agreement, dropped when
    every rank got the same signal, said when some rank got none (a `kill PID` of rank 1 alone) or another one."""
    got, codes = call_on_ranks(_end_of_run_on_rank, (str(tmp_path), between_on, during_on), 2, tmp_path, timeout=120)
    assert codes == [0, 0] and [got.get((q, "outcome")) for q in (0, 1)] == [143, 143], (codes, got)
    assert [got[(q, "warned")] for q in (0, 1)] == warned, got


def test_a_ranks_own_signal_after_the_last_agreement_is_still_said(tmp_path):
    """No agreement follows the last one, to tell a signal every rank got from one rank's own: rank 1's is said."""
    got, codes = call_on_ranks(_end_of_run_on_rank, (str(tmp_path), (), ("after",)), 2, tmp_path, timeout=120)
    assert codes == [0, 0] and [got.get((q, "outcome")) for q in (0, 1)] == [0, 0], (codes, got)
    assert [got[(q, "warned")] for q in (0, 1)] == [[], [
        "SIGTERM: ignored: the run is writing its summary, nothing is left to stop (send it again to stop at once)"]], got


def test_a_signal_handed_between_the_loop_and_the_runs_hold_keeps_its_warning():
    """A rank other than 0 got a signal while the run's `held_signals` held it, before the training loop's stop took it
    over (and the reverse, after the loop's last agreement): the warning it deferred stayed behind, never said, where
    that rank alone got it. `GracefulStop.take_over` hands it on with the signal."""
    import signal

    from loguru import logger

    from dlrm.train.signals import GracefulStop

    said: list[str] = []
    sink = logger.add(lambda m: said.append(m.record["message"]), level="WARNING")
    try:
        with GracefulStop("held until every rank knows, then stopping", defer=True) as held:
            signal.raise_signal(signal.SIGTERM)
        loop = GracefulStop(defer=True)
        loop.take_over(held)
        assert loop.signum == signal.SIGTERM and said == []
        loop.say_deferred(alone=True)  # the loop's agreement: some rank got none
    finally:
        logger.remove(sink)
    assert said == [HELD] and held.deferred is None
