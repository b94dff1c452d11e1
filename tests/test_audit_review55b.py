"""Second review of this session's later changes (console stream, bar interval, early stop resumed for its summary,
sharding under a memory limit, vocabulary checks)."""

from __future__ import annotations

import json

import pytest

from dlrm import checkpoint as ckpt
from tests.test_audit_review55 import _stop_in_write_best


def test_a_target_run_resumed_for_its_summary_reports_the_recorded_time_to_target(tmp_path, monkeypatch):
    """A run that reached train.early_stopping.target, stopped by a signal after its checkpoint and before its summary,
    resumed for the summary: the summary's time to target was the resume's (its wall clock restarted at the resume,
    its final evaluation taken for a new reaching of the target), not the one the run recorded reaching it."""
    from dlrm.config import load_config
    from dlrm.errors import TrainingStopped
    from dlrm.train.trainer import train
    from tests.conftest import make_dataset
    from tests.test_audit_eval_nits import config_file

    data = tmp_path / "ds"
    make_dataset(data, {"train": 64, "validation": 16}, row_group_size=16)
    cfg = load_config(config_file(tmp_path, data, max_steps=8, baseline=False,
                                  early_stopping={"metric": "logloss", "patience": None, "target": 10.0}))
    restore = _stop_in_write_best(monkeypatch)
    with pytest.raises(TrainingStopped):
        train(cfg)
    restore()
    run = tmp_path / "tb" / "r"
    recorded = ckpt.load_checkpoint(ckpt.list_checkpoints(run)[-1])["run_stats"]["target"]
    summary = train(cfg, resume="latest")
    written = json.loads((run / "summary.json").read_text())
    for s in (summary, written):
        assert s["target_reached"] is True and s["target_step"] == recorded["step"]
        assert (s["time_to_target_s"], s["time_to_target_wall_s"]) == (recorded["train_s"], recorded["wall_s"])
    # the checkpoint still records that reaching
    assert ckpt.load_checkpoint(ckpt.list_checkpoints(run)[-1])["run_stats"]["target"] == recorded


@pytest.mark.parametrize("copy", ["step-00000002.rank0-of-2.old.pt", "step-00000002.rank0-of-2 (copy).pt",
                                  "step-00000002.rank0-of-2.pt.bak", "step-00000002.rank0-of-2.pt.pending.keep"])
def test_pruning_keeps_a_users_copy_named_after_a_shard(tmp_path, copy):
    """Pruning step 2 removes its shards (``step-N.rankQ-of-W.pt``, with a killed save's ``.pending``/``.previous``)
    and nothing else: the glob ``step-N.rank*-of-*.pt`` also matched a user's ``step-N.rank0-of-2.old.pt``, deleted."""
    d = ckpt.checkpoint_dir(tmp_path)
    d.mkdir(parents=True)
    made = ["step-00000002.pt", "step-00000002.rank0-of-2.pt", "step-00000002.rank1-of-2.pt",
            "step-00000002.rank1-of-2.pt.pending", "step-00000002.rank1-of-2.pt.previous", "step-00000004.pt"]
    for name in [*made, copy]:
        (d / name).write_bytes(b"x")
    ckpt.prune_checkpoints(tmp_path, keep=1)
    assert sorted(p.name for p in d.iterdir()) == sorted([copy, "step-00000004.pt"])


def test_a_new_best_keeps_a_users_copy_named_after_a_best_shard(tmp_path):
    """A new sharded best.pt removes the previous best's shards (``best-step-N.rankQ-of-W.pt``) and nothing else: the
    glob ``best-step-*.rank*-of-*.pt`` also took a user's ``best-step-N.rank0-of-2.old.pt`` for one, deleted."""
    from dlrm.distributed import checkpoint as dist_ckpt
    from dlrm.distributed.sharding import plan_sharding
    from tests.test_audit_checkpoint_files import tiny_state
    from tests.test_audit_sharded_save_failure import _shard_state
    from tests.test_checkpoint_safety import StubEnv

    best = ckpt.checkpoint_dir(tmp_path) / "best.pt"

    def save_best(step: int) -> None:
        state = tiny_state(step=step)
        plan = plan_sharding(state["cardinalities"], 2, "row", 1)
        for q in (1, 0):  # rank 0 last: its manifest part removes the previous best's shards
            dist_ckpt.save_best_sharded(best, _shard_state(state, plan, q), step, StubEnv(q, 2), plan,
                                        lambda s, p: False)

    save_best(2)
    copy = best.parent / "best-step-00000002.rank0-of-2.old.pt"
    copy.write_bytes(b"a user's copy")
    save_best(4)
    assert sorted(p.name for p in best.parent.iterdir()) == [
        "best-step-00000002.rank0-of-2.old.pt", "best-step-00000004.rank0-of-2.pt", "best-step-00000004.rank1-of-2.pt",
        "best.pt"]
