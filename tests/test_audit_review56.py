"""Review of the day's changes (audit 56): bugs they introduced or left, each shown by a test that failed before."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dlrm.config import ConfigError
from dlrm.train.trainer import train
from tests.test_audit_pairs import tiny_config  # noqa: F401 (a fixture)
from tests.test_audit_restart import config, dataset, killed_before_first_checkpoint  # noqa: F401 (a fixture)


def test_a_restart_removes_the_temporary_files_the_killed_session_left(tmp_path, dataset):  # noqa: F811
    """`--resume` of a run killed before its first checkpoint (config.json's temporary file half written by the
    stopped session, which `restart_leftovers` accepts) left that temporary file in the run for good: only
    `for_resume` (a run with a checkpoint) removed a killed session's temporaries."""
    run = killed_before_first_checkpoint(tmp_path, dataset)
    config_tmp = run / ".config.json.k1ll3d_b.tmp"
    config_tmp.write_text("{")
    summary = train(config(tmp_path, dataset), resume="latest")
    assert summary["steps"] == 10 and summary["resumed_from"] is None
    assert not config_tmp.exists(), "the stopped session's temporary config.json is kept for good"


def test_a_finished_sweep_resumes_its_report_where_its_device_rules_fail(tiny_config, tmp_path, monkeypatch):
    """`dlrm.sweep --resume` of a sweep whose trials all finished (killed while writing its report, or the report
    wanted again) on a machine that could not train them (a CUDA sweep finished on a CPU machine): it gathers the
    finished trials and trains nothing, but the sweep's new device-rule check refused it before gathering ("train.device:
    'cuda' was requested but CUDA is not available"); only settings with trials left to train need the device."""
    from dlrm.data.schema import write_json_atomic
    from dlrm.sweep import run_sweep
    from dlrm.sweep_resume import resume_sweep

    def fake_train(cfg, run_dir=None, resume=None):  # a trial as a CUDA machine ran it
        summary = {"auc": 0.6 + cfg.optim.dense.lr, "logloss": 0.7, "accuracy": 0.5, "steps": 3, "samples": 48,
                   "final_train_loss": 0.7, "config": cfg.to_dict()}
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        write_json_atomic(Path(run_dir) / "summary.json", summary)
        return summary

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the CUDA machine the sweep ran on
    directory, _ = run_sweep(str(tiny_config), [("optim.dense.lr", [0.01, 0.02])], 1, base={"train.device": "cuda"},
                             tb_dir=str(tmp_path / "tb"), run_name="sw", train_fn=fake_train)
    trials = (directory / "trials.csv").read_text()
    (directory / "trials.csv").unlink()  # killed while writing its report
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # resumed on a machine without CUDA
    resume_sweep(directory, train_fn=lambda *a, **k: pytest.fail("a finished trial trained again"))
    assert (directory / "trials.csv").read_text() == trials
    # a setting with a trial left to train is still refused before any trial trains
    (directory / "01-dense.lr=0.02" / "seed-0" / "summary.json").unlink()
    with pytest.raises(ConfigError, match="CUDA is not available"):
        resume_sweep(directory, train_fn=lambda *a, **k: pytest.fail("trained"))


def test_a_distributed_run_killed_in_its_first_save_restarts(tmp_path, dataset):  # noqa: F811
    """A run of 2 ranks killed during its first checkpoint save after its shards were written, before their manifest
    (`dlrm.distributed.checkpoint`: the shards first, then the manifest that names them; MLPerf's save takes ~86 s):
    no checkpoint (no manifest), and the shards are what a killed save leaves, as a one-process run's temporary file
    is. `--resume` refused it ("more than a run writes before its first one (checkpoints/, ...)") and so did a new
    start: the requeued job could never run. Now it starts from step 0 and the orphan shards go."""
    from dlrm.train.run_dir import restart_leftovers

    run = killed_before_first_checkpoint(tmp_path, dataset)
    shards = [run / "checkpoints" / f"step-00000005.rank{q}-of-2.pt" for q in range(2)]
    for shard in shards:
        shard.write_bytes(b"a shard of a save its manifest never named")
    summary = train(config(tmp_path, dataset), resume="latest")
    assert summary["steps"] == 10 and summary["resumed_from"] is None
    assert not any(shard.exists() for shard in shards)
    assert restart_leftovers(run) is None  # it holds a checkpoint now
    # a shard beside a manifest is a checkpoint's, and anything else in checkpoints/ is still refused
    other = tmp_path / "tb" / "other"
    (other / "checkpoints").mkdir(parents=True)
    (other / "checkpoints" / "mine.pt").write_bytes(b"")
    assert restart_leftovers(other) is None
