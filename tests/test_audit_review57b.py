"""Review of the branch restart (branched_from.json, audit review57b): a restarted branch names its own best.pt after
its source moved on; its first command line again refuses a start replaced since; a record that does not read is
refused (it went on from the best.pt it linked); a restart refused at its restore keeps the stopped session's events;
re-linking best.pt (or a best shard) to the file it already is leaves no temporary file."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from dlrm import checkpoint as ckpt
from dlrm.config import ConfigError, load_config
from dlrm.train.checkpointer import Checkpointer
from dlrm.train.trainer import train
from tests.conftest import make_dataset
from tests.test_audit_branchrestart import ALLOW, LR, Killed, _restart, _weights
from tests.test_audit_overwrite52 import scripted, tiny_config


def _kill_branch(config, start, name, monkeypatch, **over):
    scripted(monkeypatch, [0.50] * 4)
    cfg = load_config(config, {"log.run_name": name, "train.max_steps": 8, **LR, **over})
    with monkeypatch.context() as m:
        m.setattr(Checkpointer, "save", lambda self, run, pos, stats: (_ for _ in ()).throw(Killed()))
        with pytest.raises(Killed):
            train(cfg, resume=str(start), allow_config_change=ALLOW)


def test_a_restarted_branch_names_its_own_best_pt_after_its_source_moved_on(tmp_path, monkeypatch):
    """The branch (from the source's step 4) linked the source's best (step 2) as its own best.pt. The source then went
    on (as a live run does): a new best at step 6 replaced its best.pt, checkpoint.keep pruned step-2.pt. The restarted
    branch must still name its own best.pt, which holds step 2's model, as the uninterrupted branch does."""
    config = tiny_config(tmp_path)
    scripted(monkeypatch, [0.70, 0.60])
    train(load_config(config, {"log.run_name": "src", "train.max_steps": 4}))
    src = tmp_path / "tb" / "src" / "checkpoints"
    start = src / "step-00000004.pt"
    _kill_branch(config, start, "branch", monkeypatch)
    scripted(monkeypatch, [0.90, 0.60, 0.60])  # the source goes on: step 6 its best, step 2 pruned (keep 4)
    train(load_config(config, {"log.run_name": "src", "checkpoint.keep": 4}), resume="latest")
    assert not (src / "step-00000002.pt").exists() and ckpt.load_checkpoint(src / "best.pt")["position"]["step"] == 6
    restarted = _restart(config, "branch", monkeypatch)
    assert restarted["resumed_at_step"] == 4 and restarted["best"]["step"] == 2
    own = tmp_path / "tb" / "branch" / "checkpoints" / "best.pt"
    assert restarted["best_checkpoint"] == str(own), f"best checkpoint named: {restarted['best_checkpoint']}"
    assert ckpt.load_checkpoint(own)["position"]["step"] == 2


def _files(run: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_a_branch_from_best_pt_run_again_after_its_start_was_replaced_is_refused(tmp_path, monkeypatch):
    """A branch of the source's best.pt (step 2) killed before its first checkpoint; the source then went on and a new
    best (step 6) replaced its best.pt. The branch's first command line run again went on from step 6 (the file's new
    content) under the name of the branch that started at step 2 (branched_from.json still says so): not the
    uninterrupted branch. `--resume` refuses a replaced start (README); so must the first command line."""
    config = tiny_config(tmp_path)
    scripted(monkeypatch, [0.70, 0.60])
    train(load_config(config, {"log.run_name": "src", "train.max_steps": 4}))
    best = tmp_path / "tb" / "src" / "checkpoints" / "best.pt"
    scripted(monkeypatch, [0.50] * 4)
    reference = train(load_config(config, {"log.run_name": "reference", "train.max_steps": 8, **LR}),
                      resume=str(best), allow_config_change=ALLOW)
    _kill_branch(config, best, "branch", monkeypatch)
    scripted(monkeypatch, [0.90, 0.60, 0.60])
    train(load_config(config, {"log.run_name": "src"}), resume="latest")
    assert ckpt.load_checkpoint(best)["position"]["step"] == 6
    run = tmp_path / "tb" / "branch"
    before = _files(run)
    scripted(monkeypatch, [0.50] * 4)
    cfg = load_config(config, {"log.run_name": "branch", "train.max_steps": 8, **LR})
    try:
        summary = train(cfg, resume=str(best), allow_config_change=ALLOW)
    except ConfigError as refused:
        text = str(refused)
    else:
        pytest.fail(f"the branch of step 2 went on from step {summary['resumed_at_step']} (its start's new content)")
    assert "\n" not in text and str(best) in text and "step 2" in text and "step 6" in text, text
    assert _files(run) == before, "a refused resume writes nothing"
    # what the refusal says works: --resume alone goes on from the branch's own best.pt (its start), bit for bit
    restarted = _restart(config, "branch", monkeypatch)
    assert restarted["resumed_at_step"] == 2 and restarted["samples"] == reference["samples"]
    mine, theirs = _weights(run), _weights(tmp_path / "tb" / "reference")
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


@pytest.mark.parametrize("record", ["x", "[1]", '{"checkpoint": "START", "step": 4.0}', ""], ids=str)
def test_a_branch_whose_record_does_not_read_is_refused_not_resumed_from_its_linked_best(tmp_path, monkeypatch, record):
    """branched_from.json that does not read as one (edited by hand, emptied): `branch_start` says None, "refused as
    anything else there is", but the best.pt the branch linked (its source's best, step 2) was then taken for the
    branch's latest state and the branch went on from step 2, silently: what the record exists to prevent."""
    config = tiny_config(tmp_path)
    scripted(monkeypatch, [0.70, 0.60])
    train(load_config(config, {"log.run_name": "src", "train.max_steps": 4}))
    start = tmp_path / "tb" / "src" / "checkpoints" / "step-00000004.pt"
    _kill_branch(config, start, "branch", monkeypatch)
    run = tmp_path / "tb" / "branch"
    (run / "branched_from.json").write_text(record.replace("START", str(start)))
    before = _files(run)
    try:
        summary = _restart(config, "branch", monkeypatch)
    except ConfigError as refused:
        text = str(refused)
    else:
        pytest.fail(f"went on from {summary['resumed_from']} at step {summary['resumed_at_step']}, not its start (4)")
    assert "\n" not in text and str(run / "branched_from.json") in text, text
    assert _files(run) == before, "a refused resume writes nothing"


def test_a_branch_restart_refused_at_its_restore_keeps_the_stopped_sessions_events(tmp_path, monkeypatch):
    """The restart took the branch directory again (`_reopen_branch`) and removed the stopped session's TensorBoard
    events and wrote config.json BEFORE the restore, which then refused it (here the dataset at data.path was made
    again with other table sizes): a refused resume deleted the user's logs. They go at the first step now."""
    config = tiny_config(tmp_path)
    scripted(monkeypatch, [0.70, 0.60])
    train(load_config(config, {"log.run_name": "src", "train.max_steps": 4}))
    _kill_branch(config, tmp_path / "tb" / "src" / "checkpoints" / "step-00000004.pt", "branch", monkeypatch)
    shutil.rmtree(tmp_path / "ds")
    make_dataset(tmp_path / "ds", {"train": 40, "validation": 16}, cardinality=13)
    run = tmp_path / "tb" / "branch"
    before = _files(run)
    assert any(Path(p).name.startswith("events.out.tfevents.") for p in before)
    # refused first by the data's stamps the checkpoint records (before anything is reopened); past them (data.path
    # allowed), by the restore, after the branch directory was taken again
    with pytest.raises(ConfigError, match="the checkpoint was trained on: since it was written, metadata.json changed"):
        _restart(config, "branch", monkeypatch)
    assert _files(run) == before, "the refused restart changed the branch: " + str(sorted(set(before) ^ set(_files(run))))
    scripted(monkeypatch, [0.50] * 4)
    with pytest.raises(ConfigError, match="table sizes differ"):
        train(load_config(config, {"log.run_name": "branch", "train.max_steps": 8, **LR}), resume="latest",
              allow_config_change=[*ALLOW, "data.path"])
    assert _files(run) == before, "the refused restart changed the branch: " + str(sorted(set(before) ^ set(_files(run))))
    shutil.rmtree(tmp_path / "ds")  # the data as the branch had it: the restart goes on, the stopped session's events go
    make_dataset(tmp_path / "ds", {"train": 40, "validation": 16})
    assert _restart(config, "branch", monkeypatch)["resumed_at_step"] == 4
    assert len(list(run.glob("events.out.tfevents.*"))) == 1 and not set(before) & {str(p) for p in run.iterdir()
                                                                                     if "tfevents" in p.name}


def test_linking_best_pt_to_the_file_it_already_is_leaves_no_temporary_file(tmp_path):
    """`Checkpointer._link` (best.pt, a sharded best.pt's shards) of a file to a name that is already a hard link to it:
    rename() of two links of one file does nothing (POSIX), so its `.NAME.<pid>-link.tmp` stayed; a restarted sharded
    branch re-links its best shards so, and its next save warned of "temporary files of interrupted checkpoint
    writes" it had just made (seen on 2 gloo ranks)."""
    step = tmp_path / "step-00000002.pt"
    step.write_bytes(b"model")
    best = tmp_path / "best.pt"
    os.link(step, best)
    assert Checkpointer._link(step, best)
    assert os.path.samefile(step, best)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "step-00000002.pt"]
