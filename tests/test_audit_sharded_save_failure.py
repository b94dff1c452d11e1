"""Audit: a failed write on one rank of a distributed run's sharded checkpoint (a full disk, a quota: an OSError).
The other ranks waited at the save's barrier until the process group's timeout (30 minutes by default) or died with
gloo's error, instead of every rank stopping at once with one line: the failed rank naming its file, the others
saying which rank's shard failed. No manifest may name a missing shard, no temporary or orphaned shard is left, and
the previous checkpoints stay intact. Two gloo ranks on the CPU, each with a 20 s process-group timeout, so that a
hang fails the test instead of hanging it."""

from __future__ import annotations

import datetime
import errno
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from dlrm import checkpoint as ckpt
from dlrm.distributed import checkpoint as dist_ckpt
from dlrm.distributed.env import DistEnv
from dlrm.distributed.sharding import plan_sharding
from tests.fastdist_ranks import call_on_ranks
from tests.shared_once import computed_once
from tests.test_audit_checkpoint_files import SPARSE, tiny_state
from tests.test_checkpoint_safety import local_rows

WORLD = 2
TIMEOUT_S = 20


def _shard_state(state: dict, plan, q: int) -> dict:
    sparse = state["optimizers"][1]
    opt = {"param_groups": sparse["param_groups"], "state": {0: {"sum": local_rows(plan, q, sparse["state"][0]["sum"])}}}
    return {**state, "model": {**state["model"], SPARSE: local_rows(plan, q, state["model"][SPARSE])},
            "optimizers": [state["optimizers"][0], opt]}


def _failing_write(real, fail_name: str):
    """write_atomic, except that the write of `fail_name` runs out of space (as write_atomic reports it: named)."""
    def write(path, state, *args, **kwargs):
        if Path(path).name == fail_name:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, state, *args, **kwargs)
    return write


def _case(rank: int, run_dir: Path, kind: str, fail_rank: int) -> None:
    """Step 2 saved well, then step 4's save (or best.pt's) with `fail_rank`'s shard (or rank 0's manifest) failing."""
    env = DistEnv(rank, WORLD)
    torch.manual_seed(0)
    state = tiny_state(step=2)
    plan = plan_sharding(state["cardinalities"], WORLD, "row", 1)
    dist_ckpt.save_sharded(run_dir, _shard_state(state, plan, rank), 2, 2, env, plan)
    best = ckpt.checkpoint_dir(run_dir) / "best.pt"
    dist_ckpt.save_best_sharded(best, _shard_state(state, plan, rank), 2, env, plan, lambda s, p: False)
    later = {**state, "position": {"step": 4, "epoch": 0, "batch": 4}}
    if kind in ("manifest", "adopt"):
        fail_name = "best.pt" if kind == "adopt" else ckpt.checkpoint_name(4)
    elif kind == "manifest":
        fail_name = ckpt.checkpoint_name(4)
    elif kind == "best":
        fail_name = dist_ckpt.BEST_PREFIX + dist_ckpt.shard_name(4, fail_rank, WORLD)
    else:
        fail_name = dist_ckpt.shard_name(4, fail_rank, WORLD)
    dist_ckpt.ckpt.write_atomic = _failing_write(ckpt.write_atomic, fail_name)
    if kind == "adopt":  # a branch of this run adopts its step-2 checkpoint as its own best.pt (`_keep_best_model`)
        _adopt(rank, env, run_dir, plan)
    elif kind == "best":
        dist_ckpt.save_best_sharded(best, _shard_state(later, plan, rank), 4, env, plan, lambda s, p: False)
    else:
        dist_ckpt.save_sharded(run_dir, _shard_state(later, plan, rank), 4, 2, env, plan)


def _adopt(rank: int, env: DistEnv, run_dir: Path, plan) -> None:
    """Trainer._keep_best_model of a branch resumed from run_dir's step 2, whose recorded best is that step's: rank 0
    links its shards as the branch's best.pt (`Checkpointer.adopt_best`), whose manifest's write fails."""
    from dlrm.train.checkpointer import Checkpointer
    from dlrm.train.setup import Tables
    from dlrm.train.trainer import Trainer
    from tests.test_audit_checkpoint_files import CARDS, tiny_config

    branch = run_dir.parent / f"{run_dir.name}-branch"
    step2 = ckpt.checkpoint_dir(run_dir) / ckpt.checkpoint_name(2)
    fake = SimpleNamespace(stats=SimpleNamespace(best={"step": 2, "checkpoint": "gone/best.pt"}), env=env,
                           resume_from=step2, run=SimpleNamespace(plan=plan),
                           checkpointer=Checkpointer(branch, tiny_config(), Tables(list(CARDS), None, "modulus"), env))
    Trainer._keep_best_model(fake)


# Every case's failed save, in one start of the two ranks (starting them, torch's import and the Manager, was most of
# each case's ~3.5 s when every case had its own, 2026-12-01); each case still has a process group of its own, joined
# for it and destroyed after it, so that a rank left waiting in a collective by one case waits out its own group's
# timeout (and reports it) instead of pairing with the next case's collectives.
CASES = [("shard", 1), ("manifest", 0), ("best", 0), ("adopt", 0)]


def _worker(rank: int, root: str, results) -> None:
    real_write = dist_ckpt.ckpt.write_atomic
    for kind, fail_rank in CASES:
        dist.init_process_group("gloo", init_method=f"file://{root}/init-{kind}-{fail_rank}", rank=rank,
                                world_size=WORLD, timeout=datetime.timedelta(seconds=TIMEOUT_S))
        start = time.monotonic()
        try:
            _case(rank, Path(root) / f"{kind}-{fail_rank}", kind, fail_rank)
            results[(kind, fail_rank, rank)] = ("no error", "", None, time.monotonic() - start)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            results[(kind, fail_rank, rank)] = (type(e).__name__, str(e), getattr(e, "errno", None),
                                                time.monotonic() - start)
        finally:
            dist_ckpt.ckpt.write_atomic = real_write  # _case's failing write, for this case only
            # the other rank's collectives first (an early exit would break gloo's connection, not hang): each rank
            # says it is done in a store of its own (not a collective, which could pair with one left waiting) and
            # waits for the other's word (it was a 0.5 s sleep, most of it spent waiting for nothing)
            done = dist.FileStore(f"{root}/done-{kind}-{fail_rank}", WORLD)
            done.set(f"rank{rank}", "done")
            done.wait([f"rank{q}" for q in range(WORLD)], datetime.timedelta(seconds=TIMEOUT_S + 10))
            dist.destroy_process_group()


def _run_all(root: Path) -> None:
    """Every case on two ranks; their results as ``results.json``: ``[kind, fail_rank, rank, result]``. The ranks are
    started through sys.executable (`tests.fastdist_ranks`: the suite's prewarmed interpreter serves them, no torch
    import a rank nor a Manager process, as torch.multiprocessing's spawn had); a rank that died reports nothing for
    its cases, which the tests then miss."""
    results, _ = call_on_ranks(_worker, (str(root),), WORLD, root, timeout=len(CASES) * (TIMEOUT_S + 40))
    got = [[*key, list(value)] for key, value in results.items()]
    (root / "results.json").write_text(json.dumps(got))


@pytest.fixture(scope="module")
def all_cases(tmp_path_factory) -> Path:
    """The directory of every case's run (made once for the test run, `tests.shared_once`; tests only read it)."""
    return computed_once(tmp_path_factory, "sharded-save-failure", _run_all)


def _run(root: Path, kind: str, fail_rank: int) -> tuple[dict, Path]:
    """Case (kind, fail_rank)'s results by rank (exception name, message, errno, seconds), and its checkpoint directory."""
    got = {rank: tuple(result) for k, f, rank, result in json.loads((root / "results.json").read_text())
           if (k, f) == (kind, fail_rank)}
    return got, ckpt.checkpoint_dir(root / f"{kind}-{fail_rank}")


def _check_left(d: Path, kind: str) -> None:
    """The step-2 checkpoint and best.pt intact, nothing of the failed save left."""
    names = sorted(p.name for p in d.iterdir())
    assert names == ["best-step-00000002.rank0-of-2.pt", "best-step-00000002.rank1-of-2.pt", "best.pt",
                     "step-00000002.pt", "step-00000002.rank0-of-2.pt", "step-00000002.rank1-of-2.pt"], (kind, names)
    assert [p.name for p in ckpt.list_checkpoints(d.parent)] == ["step-00000002.pt"]
    assert ckpt.load_checkpoint(d / "best.pt")["position"]["step"] == 2
    assert dist_ckpt.merge(d / "step-00000002.pt")["position"]["step"] == 2
    assert dist_ckpt.merge(d / "best.pt")["position"]["step"] == 2


def test_a_failed_shard_stops_every_rank_with_one_line(all_cases):
    """Rank 1's shard of step 4 fails: rank 1 names its file, rank 0 says rank 1's shard failed; both at once."""
    got, d = _run(all_cases, "shard", 1)
    shard = d / "step-00000004.rank1-of-2.pt"
    assert got.get(1, ("no result",))[:3] == ("OSError", f"[Errno {errno.ENOSPC}] No space left on device: '{shard}'",
                                             errno.ENOSPC), got
    kind, message, code, took = got.get(0, ("no result", "", None, 0))
    assert (kind, code) == ("OSError", errno.ENOSPC) and "rank 1" in message and str(shard) in message, got
    assert took < TIMEOUT_S / 2, got  # not the process group's timeout
    _check_left(d, "shard")


def test_a_failed_manifest_or_best_shard_stops_every_rank(all_cases):
    """Rank 0's manifest of step 4 fails (rank 1 waited at the last barrier); rank 0's best shard fails."""
    got, d = _run(all_cases, "manifest", 0)
    manifest = d / "step-00000004.pt"
    assert got.get(0, ("no result",))[0] == "OSError" and str(manifest) in got[0][1], got
    kind, message, code, took = got.get(1, ("no result", "", None, 0))
    assert (kind, code) == ("OSError", errno.ENOSPC) and "rank 0" in message and str(manifest) in message, got
    assert took < TIMEOUT_S / 2, got
    _check_left(d, "manifest")

    got, d = _run(all_cases, "best", 0)
    shard = d / "best-step-00000004.rank0-of-2.pt"
    assert got.get(0, ("no result",))[0] == "OSError" and str(shard) in got[0][1], got
    kind, message, code, took = got.get(1, ("no result", "", None, 0))
    assert (kind, code) == ("OSError", errno.ENOSPC) and "rank 0" in message and str(shard) in message, got
    assert took < TIMEOUT_S / 2, got
    _check_left(d, "best")


def test_a_failed_adoption_of_the_best_model_stops_every_rank(all_cases):
    """A branch's resume makes its best.pt a manifest of links to the recorded best's shards, on rank 0 alone; its
    write fails: rank 0 names its best.pt, rank 1 (waiting for rank 0's answer) says rank 0 failed; no link left."""
    got, d = _run(all_cases, "adopt", 0)
    own = ckpt.checkpoint_dir(d.parent.parent / "adopt-0-branch") / "best.pt"
    assert got.get(0, ("no result",))[:3] == ("OSError", f"[Errno {errno.ENOSPC}] No space left on device: '{own}'",
                                             errno.ENOSPC), got
    kind, message, code, took = got.get(1, ("no result", "", None, 0))
    assert (kind, code) == ("OSError", errno.ENOSPC) and "rank 0" in message and str(own) in message, got
    assert took < TIMEOUT_S / 2, got
    assert not own.parent.exists() or not list(own.parent.iterdir()), list(own.parent.iterdir())
    _check_left(d, "adopt")
