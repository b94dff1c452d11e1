"""Checkpoint edge cases (audit): a sharded branch's best.pt, a checkpoint's loader position, SIGTERM at the run's end.

1. A branch (``--resume .../best.pt --run-name NEW``) of a sharded run named the source run's best.pt (a manifest of
   that run's shards, which it replaces with its later bests) as its own best: only a one-process branch linked the
   best's model into its own best.pt. The sharded branch now links the shards and writes its own manifest.
2. A checkpoint whose loader position lies beyond an epoch's batches (position.batch 20 of 13), or whose epoch does not
   match its step, was resumed: the loader skipped the rest of the epoch (or every epoch) and the run trained on other
   batches, or none, and ended "done". Refused in one line naming the file and the values.
3. SIGTERM after the training loop's last look at the signal (the loop's end, while its window is read) was swallowed:
   the log said "checkpointing and exiting", the run went on to its last evaluation and exited 0. SIGTERM while best.pt
   was linked at the end left a ``.best.pt.<pid>-link.tmp`` file behind.
4. Ctrl-C during ``python -m dlrm.distributed.merge``: click's "Aborted!" and exit 1, not one line and exit 130.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dlrm import checkpoint as ckpt
from dlrm.config import ConfigError, load_config
from dlrm.train import evaluator as evaluator_mod
from dlrm.train.trainer import train
from tests.conftest import CHILD_ENV, make_dataset
from tests.fastdist_ranks import failures_on_ranks

REPO = Path(__file__).resolve().parents[1]
CONFIG = {
    "data": {"batch_size": 8, "shuffle": True, "drop_last": False, "shuffle_buffer_rows": 40},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "optim": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.05}},
    "train": {"epochs": 2, "log_every": 2, "device": "cpu", "seed": 3, "deterministic": True, "baseline": False},
    "checkpoint": {"every": 1000, "keep": 5},
}  # 100 train rows in batches of 8: 13 batches an epoch


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt_edges")
    make_dataset(root / "ds", {"train": 100, "validation": 32}, row_group_size=30)
    return root / "ds"


def config(data, tmp_path, name, rank=None, **overrides):
    raw = json.loads(json.dumps(CONFIG))
    raw["data"]["path"] = str(data)
    raw["name"] = name
    path = tmp_path / (f"{name}.json" if rank is None else f"{name}.rank{rank}.json")  # a file per rank
    path.write_text(json.dumps(raw))
    return load_config(path, {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": name, **overrides})


def scripted(aucs):
    queue = list(aucs)
    return lambda forward, loader, env=None: {"auc": queue.pop(0), "logloss": 0.5, "accuracy": 0.75}


# -- 1. a sharded branch from best.pt ---------------------------------------------------------------------------------

def _train_on_rank(rank, world, root, name, overrides, aucs, resume):
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="localhost")
    evaluator_mod.evaluate = scripted(aucs)  # this child process's own module
    root = Path(root)
    summary = train(config(root / "ds", root, name, rank, **{"distributed.sharding": "row",
                                                            "distributed.row_wise_min_rows": 5, **overrides}),
                    resume=resume)
    if rank == 0:
        (root / f"{name}.summary.json").write_text(json.dumps(summary, default=str))


# The two tests' four runs (a source and its branch each) in one launch of two ranks, shared by the tests through
# `computed_once` (a launch, two spawned processes importing torch, was about half of each test's 5.5 s in CI,
# 2026-12-01); each test checks its own source and branch, under its own directory, as after a launch of its own.
def _branch_cases(root: Path) -> list[tuple]:
    best, earlier = root / "best", root / "earlier"
    src_best, src_earlier = ckpt.checkpoint_dir(best / "tb" / "src"), ckpt.checkpoint_dir(earlier / "tb" / "src")
    every = {"train.eval_every": 2, "checkpoint.every": 2}
    return [(2, str(best), "src", {"train.max_steps": 6, "train.eval_every": 2}, [0.70, 0.60, 0.65], None),
            (2, str(best), "branch", {"train.max_steps": 4, "train.eval_every": 2}, [0.60], str(src_best / "best.pt")),
            (2, str(earlier), "src", {"train.max_steps": 6, **every}, [0.70, 0.60, 0.80], None),
            (2, str(earlier), "branch", {"train.max_steps": 5, **every}, [0.50], str(src_earlier / "step-00000004.pt"))]


@pytest.fixture(scope="module")
def sharded_branches(tmp_path_factory) -> Path:
    from tests.shared_once import computed_once

    def make(root: Path) -> None:
        for name in ("best", "earlier"):
            make_dataset(root / name / "ds", {"train": 100, "validation": 32}, row_group_size=30)
        failed = failures_on_ranks(_train_on_rank, _branch_cases(root), 2, root)
        (root / "failures.json").write_text(json.dumps({f"{rank} {case}": why for (rank, case), why in failed.items()}))

    return computed_once(tmp_path_factory, "ckpt-edges-sharded-branches", make)


def _branch_failures(root: Path, name: str) -> dict:
    """What failed of the test `name`'s two runs (`failures_on_ranks`' answer, by rank and case)."""
    failed = json.loads((root / "failures.json").read_text())
    return {k: v for k, v in failed.items() if repr(str(root / name)) in k}


def test_a_sharded_branch_from_best_pt_links_its_own_best(sharded_branches):
    """Two ranks, max_steps 6, evaluations at 2 (0.70, the best), 4 and 6; a branch from best.pt (step 2) to step 4
    (0.60, no better): its best.pt is its own manifest of hard links to step 2's shards, as a one-process branch's
    best.pt is a link to the best's file. It named the source run's best.pt (replaced by that run's later bests)."""
    tmp_path = sharded_branches / "best"  # its runs' directory (`_branch_cases`)
    src = ckpt.checkpoint_dir(tmp_path / "tb" / "src")
    assert not _branch_failures(sharded_branches, "best")
    branch = json.loads((tmp_path / "branch.summary.json").read_text())
    own = ckpt.checkpoint_dir(tmp_path / "tb" / "branch") / "best.pt"
    assert branch["resumed_at_step"] == 2 and branch["best"]["step"] == 2
    assert branch["best_checkpoint"] == str(own), branch["best_checkpoint"]  # was the source's best.pt
    manifest = ckpt.load_checkpoint(own)
    assert manifest["position"]["step"] == 2
    names = manifest["sharded"]["shards"]
    assert names == [f"best-step-00000002.rank{q}-of-2.pt" for q in range(2)]
    for name in names:  # hard links to the source's best shards: the same model, no copy
        assert (own.parent / name).samefile(src / name)
    last = ckpt.list_checkpoints(tmp_path / "tb" / "branch")[-1]  # a manifest: rank 0's shard records the best
    shard = ckpt.load_checkpoint(last.parent / ckpt.load_checkpoint(last)["sharded"]["shards"][0])
    assert shard["run_stats"]["best"]["checkpoint"] == str(own)


def test_a_sharded_branch_from_an_earlier_step_links_that_steps_shards(sharded_branches):
    """The source's best.pt moved on (evaluations 0.70 at 2, 0.60 at 4, 0.80 at 6: best.pt holds step 6); a branch
    from step 4, whose best is step 2, ending at 5 (0.50): its best.pt is a manifest of links to step 2's shards (it
    named the source run's step-00000002.pt, which that run's checkpoint.keep prunes with its shards)."""
    tmp_path = sharded_branches / "earlier"  # its runs' directory (`_branch_cases`)
    src = ckpt.checkpoint_dir(tmp_path / "tb" / "src")
    assert not _branch_failures(sharded_branches, "earlier")
    assert ckpt.load_checkpoint(src / "best.pt")["position"]["step"] == 6
    branch = json.loads((tmp_path / "branch.summary.json").read_text())
    own = ckpt.checkpoint_dir(tmp_path / "tb" / "branch") / "best.pt"
    assert branch["best"]["step"] == 2 and branch["best_checkpoint"] == str(own), branch["best_checkpoint"]
    manifest = ckpt.load_checkpoint(own)
    assert manifest["position"]["step"] == 2
    for q, name in enumerate(manifest["sharded"]["shards"]):
        assert name == f"best-step-00000002.rank{q}-of-2.pt" and (own.parent / name).samefile(
            src / f"step-00000002.rank{q}-of-2.pt")


# -- 2. a loader position outside the data --------------------------------------------------------------------------

@pytest.mark.parametrize("position, what", [
    ({"step": 4, "epoch": 0, "batch": 20}, "position.batch 20 is beyond the 13 batches"),
    ({"step": 4, "epoch": 5, "batch": 4}, "position.epoch 5, batch 4 do not match position.step 4"),
    ({"step": 4, "epoch": 1, "batch": 4}, "position.epoch 1, batch 4 do not match position.step 4"),
    ({"step": 30, "epoch": 0, "batch": 4}, "position.epoch 0, batch 4 do not match position.step 30"),
])
def test_a_position_outside_the_epochs_is_refused(data, tmp_path, position, what):
    """Resumed, the first skipped the rest of epoch 0 (17 steps), the second trained nothing and ended at step 4 "done",
    the third skipped epoch 0's last 9 batches, the fourth trained nothing. Refused, naming the file; no run made."""
    train(config(data, tmp_path, "r", **{"train.max_steps": 4}))
    state = ckpt.load_checkpoint(ckpt.list_checkpoints(tmp_path / "tb" / "r")[-1])
    assert state["position"] == {"step": 4, "epoch": 0, "batch": 4}
    bad = tmp_path / "bad.pt"
    ckpt.write_atomic(bad, {**state, "position": position})
    with pytest.raises(ConfigError, match=f"--resume {bad}: {what}"):
        train(config(data, tmp_path, "b"), resume=str(bad))
    assert not (tmp_path / "tb" / "b").exists()
    # a consistent position at an epoch's end (batch 13 of 13) still resumes
    ckpt.write_atomic(bad, {**state, "position": {"step": 13, "epoch": 0, "batch": 13}})
    assert train(config(data, tmp_path, "ok", **{"train.max_steps": 14}), resume=str(bad))["steps"] == 14


def test_a_negative_position_is_refused_in_one_line(data, tmp_path):
    train(config(data, tmp_path, "r", **{"train.max_steps": 2}))
    path = ckpt.list_checkpoints(tmp_path / "tb" / "r")[-1]
    disk = torch.load(path, weights_only=True)
    disk["position"]["batch"] = -1
    torch.save(disk, tmp_path / "neg.pt")
    with pytest.raises(ConfigError, match=r"neg.pt.*position.batch.*-1"):
        train(config(data, tmp_path, "n"), resume=str(tmp_path / "neg.pt"))


# -- 3. SIGTERM at the run's end --------------------------------------------------------------------------------------

SCRIPT = """
import os, signal, sys
from dlrm.train import evaluator, meter
where = sys.argv[1]
kill = lambda: os.kill(os.getpid(), signal.SIGTERM)
if where == "loop-end":  # after the loop's last look at the signal, inside it
    finish = meter.StepMeter.finish
    meter.StepMeter.finish = lambda self, *a: (finish(self, *a), kill())[0]
else:  # while the last best.pt is linked to the last checkpoint
    aucs = iter([0.5, 0.6, 0.7, 0.8])
    evaluator.evaluate = lambda forward, loader, env=None: {"auc": next(aucs), "logloss": 0.5, "accuracy": 0.7}
    link = os.link
    def linked(a, b):
        link(a, b)
        if "step-00000013" in str(a):
            kill()
    os.link = linked
from dlrm.cli import main
main(sys.argv[2:])
"""


def _run_cli(tmp_path, where, *args):
    env = CHILD_ENV
    return subprocess.run([sys.executable, "-c", SCRIPT, where, *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=240)


@pytest.mark.parametrize("where", ["loop-end", "best-link"])
def test_sigterm_at_the_runs_end_stops_cleanly(data, tmp_path, where):
    """One epoch (13 steps), evaluations every 4, checkpoints every 4. loop-end: the signal came after the loop's last
    look at it; the run said "checkpointing and exiting" but made its last evaluation and exited 0. Now it stops as a
    signal during the last step does: step 13 checkpointed, exit 143, no summary; the resume makes them. best-link:
    exit 143 left .best.pt.<pid>-link.tmp (a hard link to step 13) in checkpoints/."""
    raw = json.loads(json.dumps(CONFIG))
    raw["data"]["path"] = str(data)
    raw["train"].update(epochs=1, eval_every=4)
    raw["checkpoint"]["every"] = 4
    (tmp_path / "c.json").write_text(json.dumps(raw))
    args = ["--config", "c.json", "--tb-dir", "tb", "--run-name", where]
    done = _run_cli(tmp_path, where, *args)
    assert done.returncode == 143, done.stderr[-2000:]
    d = tmp_path / "tb" / where / "checkpoints"
    assert sorted(p.name for p in d.iterdir() if p.name.startswith(".")) == []  # was .best.pt.<pid>-link.tmp
    assert not (tmp_path / "tb" / where / "summary.json").exists()
    assert ckpt.load_checkpoint(d / "step-00000013.pt")["position"]["step"] == 13
    if where == "loop-end":
        cfg = load_config(tmp_path / "c.json", {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": where})
        resumed = train(cfg, resume="latest")
        assert resumed["resumed_at_step"] == 13 and resumed["steps"] == 13 and resumed["auc"] is not None


# -- 4. Ctrl-C during a merge -----------------------------------------------------------------------------------------

MERGE = """
import os, signal, sys
from dlrm.distributed import merge
check = merge.check_out_path
merge.check_out_path = lambda out: (check(out), os.kill(os.getpid(), signal.SIGINT))[0]  # Ctrl-C as the merge starts
merge.main(sys.argv[1:])
"""


def test_ctrl_c_during_a_merge_is_one_line_and_exit_130(tmp_path):
    """``python -m dlrm.distributed.merge`` answered Ctrl-C with click's "Aborted!" and exit 1 (a bug's exit code),
    where train.py, the sweep, the importer and the relayout say so in one line and exit 130."""
    env = CHILD_ENV
    done = subprocess.run([sys.executable, "-c", MERGE, str(tmp_path / "step-00000002.pt"), str(tmp_path / "out.pt")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert "Traceback" not in done.stderr, done.stderr[-1500:]
    assert done.returncode == 130 and "interrupted (Ctrl-C)" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no OUT, no temporary file


# -- 5. a distributed save's parts outside the agreed ones ------------------------------------------------------------
# Two gloo ranks (a 20 s process-group timeout: a hang fails the test). Checkpointer.save / save_best checked the run
# directory, gathered the state and made checkpoints/ before the first agreed part: a failure there on one rank raised
# on that rank alone while the others waited in the part's collective (gloo's "Connection closed by peer" traceback, or
# the timeout). A repeated save's move of its pending shard over the previous one was agreed after rank 0 had already
# written the manifest: one rank's failed move left the manifest naming rank 0's new shard beside rank 1's old one.

EDGE_TIMEOUT_S = 20


def _edge_case(rank: int, root: Path, case: str) -> None:
    import errno as errno_mod
    from types import SimpleNamespace

    from dlrm.distributed import checkpoint as dist_ckpt
    from dlrm.distributed.env import DistEnv
    from dlrm.distributed.sharding import plan_sharding
    from dlrm.train import checkpointer as checkpointer_mod
    from dlrm.train.setup import Tables
    from tests.test_audit_checkpoint_files import CARDS, tiny_config, tiny_state
    from tests.test_audit_sharded_save_failure import _shard_state

    if case == "resume":  # 6 steps, checkpoints at 2, 4, 6; rank 1's shard of step 6 damaged; resumed from step 6
        import torch.distributed as dist

        _train_on_rank(rank, 2, str(root), "src", {"train.max_steps": 6, "checkpoint.every": 2}, [0.7], None)
        d = ckpt.checkpoint_dir(root / "tb" / "src")
        if rank == 0:
            shard = d / "step-00000006.rank1-of-2.pt"
            shard.write_bytes(shard.read_bytes()[:100])  # truncated (a failing disk, a copy cut short)
        dist.barrier()
        _train_on_rank(rank, 2, str(root), "more", {"train.max_steps": 8, "checkpoint.every": 2}, [0.7],
                       str(d / "step-00000006.pt"))
        return
    env, state = DistEnv(rank, 2), tiny_state(step=2)
    plan = plan_sharding(state["cardinalities"], 2, "row", 1)
    run_dir = root / "run"
    run_dir.mkdir(exist_ok=True)
    saver = checkpointer_mod.Checkpointer(run_dir, tiny_config(), Tables(list(CARDS), None, "modulus"), env)
    saver._state = lambda run, pos, stats: _shard_state(state, plan, rank)
    run, pos = SimpleNamespace(plan=plan), ckpt.Position(step=2, epoch=0, batch=2)
    if case == "replace":  # step 2 saved, then saved again (another dense lr) with rank 1's move of it failing
        saver.save(run, pos, None)
        dense = state["optimizers"][0]
        state = {**state, "optimizers": [{**dense, "param_groups": [{**dense["param_groups"][0], "lr": 0.5}]},
                                         state["optimizers"][1]]}
        saver.last = None  # a resumed run's last step, saved again (`Trainer._fit`)
        real_replace = os.replace

        def replace(src, dst, *args, **kwargs):
            if rank == 1 and str(src).endswith(".pending"):
                raise PermissionError(errno_mod.EACCES, "Permission denied", str(src))
            return real_replace(src, dst, *args, **kwargs)

        dist_ckpt.os.replace = replace
    elif rank == 1 and case in ("gone", "best-gone"):  # rank 1's view of the run directory is gone (another host's)
        def gone(path):
            raise ConfigError(f"{path}: the run directory is gone")

        checkpointer_mod.run_dir_present = gone
    elif rank == 1 and case == "mkdir":  # rank 1 may not make checkpoints/ (the first save)
        real_mkdir = Path.mkdir

        def mkdir(self, *args, **kwargs):
            if self.name == "checkpoints":
                raise PermissionError(errno_mod.EACCES, "Permission denied", str(self))
            return real_mkdir(self, *args, **kwargs)

        Path.mkdir = mkdir
    if case == "best-gone":
        saver.save_best(run, pos, None)
    else:
        saver.save(run, pos, None)


def _edge_worker(rank: int, init_file: str, root: str, cases: tuple, results) -> None:
    """Each of `cases` in turn on this rank, in one process group, each case's files under ``root/<case>`` when there
    are several; the library functions a case patches (`_edge_case`) are put back before the next case begins."""
    import datetime
    import time

    import torch.distributed as dist

    from dlrm.train import checkpointer as checkpointer_mod

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=EDGE_TIMEOUT_S))
    real = os.replace, Path.mkdir, checkpointer_mod.run_dir_present
    try:
        for case in cases:
            here = Path(root) / case if len(cases) > 1 else Path(root)
            here.mkdir(exist_ok=True)
            start = time.monotonic()
            try:
                _edge_case(rank, here, case)
                results[(case, rank)] = ("no error", "", None, time.monotonic() - start)
            except BaseException as e:  # noqa: BLE001 - reported to the test
                results[(case, rank)] = (type(e).__name__, str(e), getattr(e, "errno", None),
                                         time.monotonic() - start)
            finally:
                os.replace, Path.mkdir, checkpointer_mod.run_dir_present = real
            if case != cases[-1]:
                dist.barrier()  # both ranks through this case's collectives before the next case's begin
    finally:
        time.sleep(0.5)  # the other rank's collective first (an early exit breaks gloo's connection, not a hang)
        dist.destroy_process_group()


def _launch(root: Path, cases: tuple) -> dict:
    """Two gloo ranks running `cases` (`_edge_worker`): {case: {rank: (error kind, message, errno, seconds)}}. The
    ranks are `sys.executable` processes (`tests.fastdist_ranks`: the prewarmed interpreter's, no torch import)."""
    from tests.fastdist_ranks import call_on_ranks

    root.mkdir(parents=True, exist_ok=True)
    results, _ = call_on_ranks(_edge_worker, (str(root / "init"), str(root), cases), 2, root,
                               len(cases) * EDGE_TIMEOUT_S + 40)
    got: dict = {}
    for (case, rank), result in results.items():
        got.setdefault(case, {})[rank] = result
    return got


def _edge_run(tmp_path: Path, case: str) -> tuple[dict, Path]:
    root = tmp_path / case
    return _launch(root, (case,)).get(case, {}), ckpt.checkpoint_dir(root / "run")


# The saves' four cases run in one launch of two ranks (the launch, two spawned processes importing torch, was most
# of each test's 3.6-3.8 s in CI, 2026-12-01), shared by their tests through `computed_once`; each test checks its
# own case's errors and files, as from a launch of its own.
SAVE_CASES = ("gone", "best-gone", "mkdir", "replace")


@pytest.fixture(scope="module")
def save_cases(tmp_path_factory) -> Path:
    from tests.shared_once import computed_once

    def make(root: Path) -> None:
        got = _launch(root, SAVE_CASES)
        (root / "results.json").write_text(json.dumps({case: {str(r): list(v) for r, v in by_rank.items()}
                                                       for case, by_rank in got.items()}))

    return computed_once(tmp_path_factory, "ckpt-edges-save-cases", make)


def _save_case(root: Path, case: str) -> tuple[dict, Path]:
    """What `_edge_run` answers for `case`, out of the shared launch."""
    got = json.loads((root / "results.json").read_text()).get(case, {})
    return {int(r): tuple(v) for r, v in got.items()}, ckpt.checkpoint_dir(root / case / "run")


@pytest.mark.parametrize("case", ["gone", "best-gone", "mkdir"])
def test_a_failure_before_a_distributed_saves_first_part_stops_every_rank(save_cases, case):
    """Rank 1's run directory check (of a save, of best.pt's save) or its mkdir of checkpoints/ fails: rank 1 raises
    its error, rank 0 one naming rank 1, of the same kind, at once; nothing is written."""
    got, d = _save_case(save_cases, case)
    kind = "ConfigError" if case != "mkdir" else "PermissionError"
    assert got.get(1, ("no result",))[0] == kind, got
    other, message, _, took = got.get(0, ("no result", "", None, 0))
    assert other in (kind, "OSError") and "rank 1" in message, got  # not gloo's RuntimeError, not the timeout
    assert took < EDGE_TIMEOUT_S / 2, got
    assert not d.exists() or not [p.name for p in d.iterdir()], list(d.iterdir())  # no shard, manifest or best.pt


def test_a_failed_move_of_a_repeated_saves_shard_keeps_the_previous_save(save_cases):
    """Step 2 saved again; rank 1's move of its new shard over the old one fails: both ranks stop with its error, and
    step 2's checkpoint is wholly the first save's (rank 0 had written the manifest, naming its new shard beside rank
    1's old one: ranks of another dense optimizer, resumed as one checkpoint)."""
    from dlrm.distributed import checkpoint as dist_ckpt

    got, d = _save_case(save_cases, "replace")
    assert got.get(1, ("no result",))[0] == "PermissionError", got
    _, message, code, took = got.get(0, ("no result", "", None, 0))
    assert code == errno.EACCES and "rank 1" in message and took < EDGE_TIMEOUT_S / 2, got  # (a PermissionError)
    manifest = d / ckpt.checkpoint_name(2)
    loaded = ckpt.load_checkpoint(manifest)
    lrs = [dist_ckpt.load_shard(manifest, loaded, q)["optimizers"][0]["param_groups"][0]["lr"] for q in range(2)]
    assert lrs == [0.01, 0.01], lrs
    assert sorted(p.name for p in d.iterdir()) == [
        "step-00000002.pt", "step-00000002.rank0-of-2.pt", "step-00000002.rank1-of-2.pt"]


def test_another_ranks_os_error_without_errno_reads_without_errno_none():
    """A rank's OSError without an errno (an ``io.UnsupportedOperation``, a network file system's bare OSError): the
    others' error read "[Errno None] rank 1 could not write ...". Its message and file kept, an OSError still."""
    import io

    from dlrm.distributed.env import failure, failure_error

    for error in (io.UnsupportedOperation("not writable"), OSError("stale file handle")):
        other = failure_error(failure(error), 1, "could not write its shard of step 4")
        assert isinstance(other, OSError) and other.errno is None, repr(other)
        assert str(other) == f"rank 1 could not write its shard of step 4: {error}", str(other)
    named = failure_error(failure(OSError(None, "stale file handle", "/ckpt/x.pt")), 0, "could not write best.pt")
    assert str(named) == "rank 0 could not write best.pt: stale file handle: '/ckpt/x.pt'", str(named)


def test_a_shard_that_one_rank_cannot_resume_stops_every_rank_in_one_line(tmp_path):
    """Rank 1's shard of the checkpoint resumed is truncated: rank 1 refused it in one line, rank 0 went on to the run's
    first collective and died of gloo's "Connection closed by peer" (a RuntimeError: a bug's traceback, exit 1). Now
    rank 0 says that rank 1 could not resume, naming the shard (a ConfigError: one line, exit 2), at once."""
    make_dataset(tmp_path / "resume" / "ds", {"train": 100, "validation": 32}, row_group_size=30)
    got, _ = _edge_run(tmp_path, "resume")
    shard = ckpt.checkpoint_dir(tmp_path / "resume" / "tb" / "src") / "step-00000006.rank1-of-2.pt"
    refused = f"{shard}: not a readable checkpoint (not a zip archive: truncated, or not written by torch.save)"
    assert got.get(1, ("no result",))[:2] == ("ConfigError", refused), got
    kind, message, _, took = got.get(0, ("no result", "", None, 0))
    assert kind == "ConfigError" and message.startswith("rank 1 could not resume from ") and str(shard) in message, got
    assert took < EDGE_TIMEOUT_S, got


def test_pruning_a_step_removes_the_shards_a_killed_repeated_save_left(tmp_path):
    """A repeated save of a step killed between its shards' write and their move leaves each rank's new shard beside
    the old one (``.pending``: a shard's size of disk each; and a ``.previous`` link to the old one, kept during the
    move), which the pruning of that step (``.rank*-of-*.pt`` only) never removed."""
    from dlrm.distributed import checkpoint as dist_ckpt
    from dlrm.distributed.sharding import plan_sharding
    from tests.test_audit_checkpoint_files import tiny_state
    from tests.test_audit_sharded_save_failure import _shard_state
    from tests.test_checkpoint_safety import StubEnv

    def save(step: int) -> None:
        state = tiny_state(step=step)
        plan = plan_sharding(state["cardinalities"], 2, "row", 1)
        for q in (1, 0):
            dist_ckpt.save_sharded(tmp_path, _shard_state(state, plan, q), step, 1, StubEnv(q, 2), plan)

    save(2)
    d = ckpt.checkpoint_dir(tmp_path)
    for q in range(2):  # what the killed save of step 2 left
        shard = d / dist_ckpt.shard_name(2, q, 2)
        (d / f"{shard.name}.pending").write_bytes(shard.read_bytes())
        (d / f"{shard.name}.previous").write_bytes(shard.read_bytes())
    (d / "step-00000002.rank0-of-2.pt.bak").write_bytes(b"a user's copy")  # no name a save makes: kept
    save(4)  # keep 1: step 2 pruned
    assert sorted(p.name for p in d.iterdir()) == [
        "step-00000002.rank0-of-2.pt.bak", "step-00000004.pt", "step-00000004.rank0-of-2.pt",
        "step-00000004.rank1-of-2.pt"]
