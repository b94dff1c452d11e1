"""Audit of the latest commits (review 54b).

`dlrm.distributed.env.failure` / `failure_error` (1f17e90): the error the other ranks raise for a rank whose part of a
save failed must be "of the same kind, so that the command reports it as that rank does". A rank out of memory (a
MemoryError, torch's OutOfMemoryError) exits 4 with one line; the others got a plain RuntimeError ("other"), which the
command reports as a bug in dlrm (traceback, exit 1). A DatasetError (exit 2) and a NonFiniteLoss (exit 3) likewise."""

from __future__ import annotations

import pytest
import torch

from dlrm.cli import EXIT_OUT_OF_MEMORY, report_failure
from dlrm.distributed.env import failure, failure_error
from dlrm.errors import DatasetError, NonFiniteLoss
from tests.fastdist_ranks import call_on_ranks


@pytest.mark.parametrize("error", [MemoryError(), torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"),
                                   DatasetError("day_0.parquet: column dense_0 missing"),
                                   NonFiniteLoss("the loss became NaN at step 3")], ids=type)
def test_another_ranks_failure_is_reported_with_the_failing_ranks_exit_code(error, capsys):
    expected = report_failure(error, None)  # the failing rank's own exit code
    assert expected != 1
    other = failure_error(failure(error), 1, "could not write its shard of step 4")
    assert "rank 1 could not write its shard of step 4" in str(other)
    assert report_failure(other, None) == expected, type(other).__name__
    assert "Traceback" not in capsys.readouterr().err  # one line, not a bug's traceback
    if expected == EXIT_OUT_OF_MEMORY:  # the same memory named: GPU for torch's OutOfMemoryError, else host
        assert (type(other).__name__ == "OutOfMemoryError") == (type(error).__name__ == "OutOfMemoryError")


def _oom_worker(rank: int, init_file: str, run_dir: str, results) -> None:
    """Two gloo ranks (a short timeout: a hang fails the test) save step 2; rank 1's shard runs out of host memory."""
    import datetime
    from pathlib import Path

    import torch.distributed as dist

    from dlrm.distributed import checkpoint as dist_ckpt
    from dlrm.distributed.env import DistEnv
    from dlrm.distributed.sharding import plan_sharding
    from tests.test_audit_checkpoint_files import tiny_state
    from tests.test_audit_sharded_save_failure import _shard_state

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))
    try:
        real = dist_ckpt.ckpt.write_atomic

        def write(path, state, *args, **kwargs):
            if Path(path).name == dist_ckpt.shard_name(2, 1, 2):
                raise MemoryError()
            return real(path, state, *args, **kwargs)

        dist_ckpt.ckpt.write_atomic = write
        state = tiny_state(step=2)
        plan = plan_sharding(state["cardinalities"], 2, "row", 1)
        try:
            dist_ckpt.save_sharded(Path(run_dir), _shard_state(state, plan, rank), 2, 2, DistEnv(rank, 2), plan)
            results[rank] = ("no error", None)
        except Exception as e:  # noqa: BLE001 - reported to the test
            results[rank] = (type(e).__name__, report_failure(e, None))
    finally:
        dist.destroy_process_group()


def on_two_ranks(worker, tmp_path) -> dict:
    """``worker(rank, init_file, run_dir, results)`` on two ranks started through sys.executable (the suite's prewarmed
    interpreter serves them: no torch import a rank, nor a Manager process, as torch.multiprocessing's spawn had):
    their results; a rank that raised or died fails the test, as ``spawn(join=True)`` raised."""
    got, codes = call_on_ranks(worker, (str(tmp_path / "init"), str(tmp_path / "run")), 2, tmp_path, timeout=120)
    assert codes == [0, 0], (codes, got)
    return got


def test_a_rank_out_of_memory_in_a_save_stops_every_rank_with_exit_4(tmp_path):
    got = on_two_ranks(_oom_worker, tmp_path)
    assert got == {0: ("MemoryError", EXIT_OUT_OF_MEMORY), 1: ("MemoryError", EXIT_OUT_OF_MEMORY)}, got


def _repeat_worker(rank: int, init_file: str, run_dir: str, results) -> None:
    """Step 2 saved; then step 2 saved again (a run resumed at its end saves its last step again, with its last
    evaluation: `Trainer._fit`), another state (here the dense lr), rank 1's shard failing (a full disk)."""
    import datetime
    import errno
    from pathlib import Path

    import torch.distributed as dist

    from dlrm.distributed import checkpoint as dist_ckpt
    from dlrm.distributed.env import DistEnv
    from dlrm.distributed.sharding import plan_sharding
    from tests.test_audit_checkpoint_files import tiny_state
    from tests.test_audit_sharded_save_failure import _shard_state

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))
    try:
        env, state = DistEnv(rank, 2), tiny_state(step=2)
        plan = plan_sharding(state["cardinalities"], 2, "row", 1)
        dist_ckpt.save_sharded(Path(run_dir), _shard_state(state, plan, rank), 2, 2, env, plan)
        dense = state["optimizers"][0]
        again = {**state, "optimizers": [{**dense, "param_groups": [{**dense["param_groups"][0], "lr": 0.5}]},
                                         state["optimizers"][1]]}
        real, shard = dist_ckpt.ckpt.write_atomic, dist_ckpt.shard_name(2, 1, 2)

        def write(path, state, *args, **kwargs):  # rank 1's shard of step 2 (under whatever name it is written)
            if Path(path).name.startswith(shard):
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            return real(path, state, *args, **kwargs)

        dist_ckpt.ckpt.write_atomic = write
        try:
            dist_ckpt.save_sharded(Path(run_dir), _shard_state(again, plan, rank), 2, 2, env, plan)
            results[rank] = "no error"
        except OSError as e:
            results[rank] = errno.errorcode[e.errno]
    finally:
        dist.destroy_process_group()


def test_a_failed_repeated_save_of_a_step_leaves_its_shards_of_one_save(tmp_path):
    """The step's manifest (kept: it existed) named rank 0's new shard beside rank 1's old one: a checkpoint whose
    ranks hold different dense optimizers (and run totals), which a resume took as one."""
    from dlrm import checkpoint as ckpt
    from dlrm.distributed import checkpoint as dist_ckpt

    got = on_two_ranks(_repeat_worker, tmp_path)
    assert got == {0: "ENOSPC", 1: "ENOSPC"}, got
    manifest = ckpt.checkpoint_dir(tmp_path / "run") / ckpt.checkpoint_name(2)
    lrs = [dist_ckpt.load_shard(manifest, ckpt.load_checkpoint(manifest), q)["optimizers"][0]["param_groups"][0]["lr"]
           for q in range(2)]
    assert lrs == [0.01, 0.01], lrs  # the first save's, intact
    assert sorted(p.name for p in manifest.parent.iterdir()) == [
        "step-00000002.pt", "step-00000002.rank0-of-2.pt", "step-00000002.rank1-of-2.pt"]


def test_a_repeated_save_of_a_step_replaces_its_shards(tmp_path):
    """The same step saved again (no failure): every shard the new save's, nothing pending left."""
    from dlrm import checkpoint as ckpt
    from dlrm.distributed import checkpoint as dist_ckpt
    from tests.test_audit_checkpoint_files import save_sharded, tiny_state

    state = tiny_state(step=2)
    save_sharded(tmp_path, state)
    dense = state["optimizers"][0]
    manifest = save_sharded(tmp_path, {**state, "optimizers": [
        {**dense, "param_groups": [{**dense["param_groups"][0], "lr": 0.5}]}, state["optimizers"][1]]})
    lrs = [dist_ckpt.load_shard(manifest, ckpt.load_checkpoint(manifest), q)["optimizers"][0]["param_groups"][0]["lr"]
           for q in range(2)]
    assert lrs == [0.5, 0.5], lrs
    assert sorted(p.name for p in manifest.parent.iterdir()) == [
        "step-00000002.pt", "step-00000002.rank0-of-2.pt", "step-00000002.rank1-of-2.pt"]
