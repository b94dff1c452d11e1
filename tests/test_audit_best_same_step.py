"""Audit: a sharded run's best.pt written again at the step of the current best.pt (a resume at the run's end on
another data.eval_split, a re-evaluation of a resume for its summary). Its shards, ``best-step-N.rankQ-of-W.pt``, have
the same names as the current best's: written in place, a failure on one rank (or a kill before the manifest) left
best.pt naming one rank's new shard beside another rank's old one (two models' weights and totals, resumed or merged
as one checkpoint without a word), and the failure's cleanup could not put the old shard back. The ranks run one
after the other (`StubEnv`); a peer's failure is told as `dist_ckpt._agreed`'s collective tells it."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from dlrm import checkpoint as ckpt
from dlrm.distributed import checkpoint as dist_ckpt
from dlrm.distributed.env import failure
from dlrm.distributed.merge import merge_to_file
from dlrm.distributed.sharding import plan_sharding
from dlrm.train.checkpointer import Checkpointer
from tests.fastdist_ranks import call_on_ranks
from tests.test_audit_checkpoint_files import SPARSE, tiny_state
from tests.test_audit_sharded_save_failure import _shard_state
from tests.test_checkpoint_safety import StubEnv

WORLD = 2
DENSE = "dense_arch.model.layers.0.weight"


class PeerFails(StubEnv):
    """Rank `rank`, told at its `at`-th agreed part (0: the shards) that rank `peer`'s part failed (a full disk)."""

    def __init__(self, rank: int, peer: int, at: int, code: int = errno.ENOSPC) -> None:
        super().__init__(rank, WORLD)
        self.peer, self.at, self.code, self.calls = peer, at, code, 0

    def all_gather_object(self, obj):
        out = [obj] * self.world_size
        if self.calls == self.at:
            out[self.peer] = failure(OSError(self.code, os.strerror(self.code), f"rank {self.peer}'s file"))
        self.calls += 1
        return out


class Killed(BaseException):
    """The process killed while it waited for the other ranks (nothing of the save's own cleanup runs)."""


class KilledWaiting(StubEnv):
    def all_gather_object(self, obj):
        raise Killed()


def _state(seed: int, step: int = 2) -> dict:
    torch.manual_seed(seed)
    return tiny_state(step=step)


def _save_best(best: Path, state: dict, link=lambda s, p: False, saved=None) -> None:
    """Every rank's save of best.pt, saved well (rank 1 first: rank 0's manifest part comes last)."""
    plan = plan_sharding(state["cardinalities"], WORLD, "row", 1)
    step = state["position"]["step"]
    for q in (1, 0):
        dist_ckpt.save_best_sharded(best, _shard_state(state, plan, q), step, StubEnv(q, WORLD), plan, link, saved)


def _model_of(best: Path) -> dict:
    return dist_ckpt.merge(best)["model"]


def _shards_of(best: Path, **states: dict) -> list[str]:
    """Which of `states` each shard that best.pt names holds (by its dense weights)."""
    manifest = ckpt.load_checkpoint(best)
    dense = [dist_ckpt.load_shard(best, manifest, q)["model"][DENSE] for q in range(WORLD)]
    return [next((k for k, s in states.items() if torch.equal(d, s["model"][DENSE])), "?") for d in dense]


def _same_model(got: dict, state: dict) -> bool:
    return all(torch.equal(got[k], state["model"][k]) for k in (SPARSE, DENSE))


@pytest.fixture
def best(tmp_path) -> Path:
    return ckpt.checkpoint_dir(tmp_path / "run") / "best.pt"


def test_the_states_differ():
    """(the test's premise: the two saves of step 2 hold two models)"""
    a, b = _state(0), _state(1)
    assert not any(torch.equal(a["model"][k], b["model"][k]) for k in (SPARSE, DENSE))


def _failing(monkeypatch, at: int) -> None:
    """Rank 1's part of the new save of step 2 fails: its shard's write (`at` 0), or its move over the old one (1)."""
    name = "best-step-00000002.rank1-of-2.pt"
    if at == 0:
        real_write = ckpt.write_atomic

        def write(path, *args, **kwargs):
            if Path(path).name.startswith(name):
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            return real_write(path, *args, **kwargs)
        monkeypatch.setattr(ckpt, "write_atomic", write)
    else:
        real_replace = dist_ckpt.os.replace

        def replace(src, dst, *args, **kwargs):
            if Path(dst).name == name and Path(src).name != name + ".previous":  # not the failure's restore
                raise OSError(errno.EIO, "Input/output error", str(dst))
            return real_replace(src, dst, *args, **kwargs)
        monkeypatch.setattr(dist_ckpt.os, "replace", replace)


@pytest.mark.parametrize("at", [0, 1], ids=["shard-failed", "move-failed"])
def test_a_failed_same_step_best_keeps_the_previous_best_whole(best, monkeypatch, at):
    """best.pt of step 2 (model A); a new best of step 2 (model B) whose part fails on rank 1; rank 0 learns it in the
    same agreed part. Every shard best.pt names must still be A's: rank 0's was written over in place (B's, named by
    the old manifest beside rank 1's A: merged or resumed as one model) and the failure's cleanup kept it."""
    a, b = _state(0), _state(1)
    _save_best(best, a)
    plan = plan_sharding(a["cardinalities"], WORLD, "row", 1)
    with monkeypatch.context() as m:
        _failing(m, at)
        with pytest.raises(OSError) as own:
            dist_ckpt.save_best_sharded(best, _shard_state(b, plan, 1), 2, StubEnv(1, WORLD), plan, lambda s, p: False)
    code = (errno.ENOSPC, errno.EIO)[at]
    with pytest.raises(OSError) as told:
        dist_ckpt.save_best_sharded(best, _shard_state(b, plan, 0), 2, PeerFails(0, 1, at, code), plan,
                                    lambda s, p: False)
    assert own.value.errno == told.value.errno == code
    assert "rank 1" in str(told.value)
    assert _shards_of(best, A=a, B=b) == ["A", "A"]
    assert _same_model(_model_of(best), a)
    assert sorted(p.name for p in best.parent.iterdir()) == [
        "best-step-00000002.rank0-of-2.pt", "best-step-00000002.rank1-of-2.pt", "best.pt"]


def test_a_kill_before_the_manifest_keeps_the_previous_best_and_its_leftover_is_removed_later(best):
    """Rank 1 killed while it waited for rank 0 (its new shard of step 2 written): best.pt (step 2, model A) must still
    be A's whole; the killed save's leftover goes with the next best's save (step 4), as a previous best's shard."""
    a, b = _state(0), _state(1)
    _save_best(best, a)
    plan = plan_sharding(a["cardinalities"], WORLD, "row", 1)
    with pytest.raises(Killed):
        dist_ckpt.save_best_sharded(best, _shard_state(b, plan, 1), 2, KilledWaiting(1, WORLD), plan,
                                    lambda s, p: False)
    assert _shards_of(best, A=a, B=b) == ["A", "A"]
    assert _same_model(_model_of(best), a)
    c = _state(2, step=4)
    _save_best(best, c)
    assert _same_model(_model_of(best), c)
    assert sorted(p.name for p in best.parent.iterdir()) == [
        "best-step-00000004.rank0-of-2.pt", "best-step-00000004.rank1-of-2.pt", "best.pt"]


def test_a_same_step_best_replaces_every_shard_and_merges(best, tmp_path):
    """The new best of step 2 saved well (written, and linked to the step's own shards): best.pt is B's whole, nothing
    else is left, and ``python -m dlrm.distributed.merge`` makes it one file."""
    a, b = _state(0), _state(1)
    _save_best(best, a)
    _save_best(best, b)
    assert _same_model(_model_of(best), b)
    # linked to step 2's checkpoint (the step just saved): the links land under best.pt's own names
    step2 = ckpt.checkpoint_dir(tmp_path / "run") / ckpt.checkpoint_name(2)
    plan = plan_sharding(a["cardinalities"], WORLD, "row", 1)
    for q in (1, 0):
        dist_ckpt.save_sharded(tmp_path / "run", _shard_state(a, plan, q), 2, 5, StubEnv(q, WORLD), plan)
    _save_best(best, a, link=Checkpointer._link, saved=step2)
    assert _same_model(_model_of(best), a)
    shard = best.parent / "best-step-00000002.rank1-of-2.pt"
    assert shard.stat().st_ino == (best.parent / "step-00000002.rank1-of-2.pt").stat().st_ino
    assert sorted(p.name for p in best.parent.iterdir()) == [
        "best-step-00000002.rank0-of-2.pt", "best-step-00000002.rank1-of-2.pt", "best.pt",
        "step-00000002.pt", "step-00000002.rank0-of-2.pt", "step-00000002.rank1-of-2.pt"]
    merged = merge_to_file(best, tmp_path / "merged.pt")
    assert torch.equal(merged["model"][SPARSE], a["model"][SPARSE])
    assert torch.equal(ckpt.load_checkpoint(tmp_path / "merged.pt")["model"][DENSE], a["model"][DENSE])


def _gloo_worker(rank: int, init_file: str, best: str, results) -> None:
    """Two gloo ranks: best.pt of step 2 (model A), a new one of step 2 (B) whose rank 1 shard runs out of space,
    then B again, saved well."""
    import datetime

    import torch.distributed as dist

    from dlrm.distributed.env import DistEnv

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=20))
    try:
        env, best_path = DistEnv(rank, WORLD), Path(best)
        a, b = _state(0), _state(1)
        plan = plan_sharding(a["cardinalities"], WORLD, "row", 1)
        dist_ckpt.save_best_sharded(best_path, _shard_state(a, plan, rank), 2, env, plan, lambda s, p: False)
        real = ckpt.write_atomic
        if rank == 1:
            def write(path, *args, **kwargs):
                if Path(path).name.startswith("best-step-00000002.rank1-of-2.pt"):
                    raise OSError(errno.ENOSPC, "No space left on device", str(path))
                return real(path, *args, **kwargs)
            ckpt.write_atomic = write
        try:
            dist_ckpt.save_best_sharded(best_path, _shard_state(b, plan, rank), 2, env, plan, lambda s, p: False)
            failed = None
        except OSError as e:
            failed = e.errno
        ckpt.write_atomic = real
        dist.barrier()
        after_failure = _shards_of(best_path, A=a, B=b)
        dist.barrier()
        dist_ckpt.save_best_sharded(best_path, _shard_state(b, plan, rank), 2, env, plan, lambda s, p: False)
        dist.barrier()
        results[rank] = (failed, after_failure, _shards_of(best_path, A=a, B=b))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        results[rank] = repr(e)
    finally:
        dist.destroy_process_group()


def test_gloo_ranks_a_failed_same_step_best_keeps_the_previous_best_whole(best, tmp_path):
    """The same with two real ranks: both stop with the full disk's error, best.pt stays A's whole (rank 0's shard was
    B's); saved again, it is B's whole, merges, and nothing else is left."""
    # ranks started through sys.executable (the suite's prewarmed interpreter serves them: no torch import a rank, nor
    # a Manager process), as torch.multiprocessing's spawn started them before; each rank's results dict comes back
    got, _ = call_on_ranks(_gloo_worker, (str(tmp_path / "init"), str(best)), WORLD, tmp_path, timeout=60)
    assert got == {q: (errno.ENOSPC, ["A", "A"], ["B", "B"]) for q in range(WORLD)}, got
    assert _same_model(_model_of(best), _state(1))
    assert sorted(p.name for p in best.parent.iterdir()) == [
        "best-step-00000002.rank0-of-2.pt", "best-step-00000002.rank1-of-2.pt", "best.pt"]
