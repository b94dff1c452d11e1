"""Lines that two torchrun ranks each said where they reached the same verdict, now said once (rank 0), as the
project's other refusals are (`dlrm.cli.report_failure`, `found_alike`); a rank's own distinct failure stays its own.

- a shard only rank 1 cannot read (truncated): rank 1 refused it, rank 0 relayed it ("rank 1 could not resume from X:
  M", `failure_error`), and both lines were said; now the relayed failure is compared as rank 1's own line M, found
  alike, and said once by rank 0 (its line names rank 1); two ranks' different failures are still each said.
"""

from __future__ import annotations

from dlrm.config import ConfigError
from tests.fastdist_ranks import failures_on_ranks


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
