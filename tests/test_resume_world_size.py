"""Checkpoints record the world size whose epochs their position counts, and a resume keeps those epochs.

On N ranks an epoch's last batch of fewer than N rows is left out (`dlrm.data.batch.keeps_last_batch`): 101 rows in
batches of 10 (``drop_last`` false) are 10 steps an epoch on two ranks, 11 in one process. A merged two-rank
checkpoint resumed by one process (the only way to resume it there) trained that 1-row batch, which the run it
continues never did: 22 steps and 202 samples for the two ranks' 20 and 200, and a decay to the run's end moved from
step 20 to 22, all unsaid; today's schedule check (`check_schedule_length`) counted the checkpoint's epochs in this
run's one process. Now every checkpoint records ``world_size`` (a merge the sharded run's), and the resumed process
keeps the two ranks' epochs: it ends as the two-rank run does. A file written before records none: its epochs are
taken as this run's, said where a merged one's would have differed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from loguru import logger

from dlrm import checkpoint as ckpt
from dlrm.config import ConfigError, ScheduleConfig, load_config
from dlrm.distributed.merge import merge_to_file
from dlrm.train.optim import lr_multiplier
from dlrm.train.trainer import train
from tests.conftest import make_dataset
from tests.shared_once import computed_once
from tests.test_distributed import run

CONFIG = {  # 101 rows, batches of 10: the last batch (1 row) is left out on two ranks
    "data": {"batch_size": 10, "shuffle": True, "drop_last": False},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "optim": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.05},
              "schedule": {"decay": "linear", "decay_start_step": 2, "end_factor": 0.1}},
    "train": {"epochs": 2, "log_every": 5, "device": "cpu", "seed": 3, "baseline": False, "deterministic": True},
    "checkpoint": {"every": 5, "keep": 10},
}


def write_config(root: Path) -> Path:
    raw = json.loads(json.dumps(CONFIG))
    raw["data"]["path"] = str(root / "ds")
    (root / "c.json").write_text(json.dumps(raw))
    return root / "c.json"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The two-rank run (gloo, 20 steps, a sharded checkpoint every 5) and its config."""
    def make(root: Path) -> None:
        make_dataset(root / "ds", {"train": 101, "validation": 24}, row_group_size=30)
        done = run(["--config", str(write_config(root)), "--run-name", "two", "--tb-dir", str(root / "tb")], root, 2)
        assert done.returncode == 0, done.stderr[-3000:]

    root = computed_once(tmp_path_factory, "world-size-two", make)
    return root / "tb" / "two", root / "c.json"


@pytest.fixture
def said():
    seen: list[str] = []
    handle = logger.add(lambda m: seen.append(m.record["message"]), level="INFO")
    yield seen
    logger.remove(handle)


def merged(run_dir: Path, step: int, out: Path, drop_world_size: bool = False) -> Path:
    merge_to_file(ckpt.checkpoint_dir(run_dir) / ckpt.checkpoint_name(step), out)
    if drop_world_size:  # as merged before checkpoints recorded it (the on-disk form, saved back as it was)
        disk = torch.load(out, weights_only=False)
        del disk["world_size"]
        torch.save(disk, out)
    return out


def resume(config: Path, tmp_path: Path, source: Path, **overrides):
    cfg = load_config(config, {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": "one", **overrides})
    return train(cfg, resume=str(source), allow_config_change=list(overrides))


def test_every_checkpoint_records_its_world_size(two_ranks, tmp_path):
    run_dir, config = two_ranks
    manifest = ckpt.checkpoint_dir(run_dir) / ckpt.checkpoint_name(10)
    assert ckpt.load_checkpoint(manifest)["world_size"] == 2
    for q in range(2):
        assert ckpt.load_checkpoint(manifest.parent / f"step-00000010.rank{q}-of-2.pt")["world_size"] == 2
    assert ckpt.load_checkpoint(merged(run_dir, 10, tmp_path / "m.pt"))["world_size"] == 2
    # and the train rows those epochs count (a resume on other data knows its run's steps an epoch)
    assert ckpt.load_checkpoint(manifest)["train_rows"] == ckpt.load_checkpoint(tmp_path / "m.pt")["train_rows"] == 101
    # shards written before checkpoints recorded it: the merge takes the manifest's sharded.world_size
    old = tmp_path / "old"
    (old / "checkpoints").mkdir(parents=True)
    for q in range(2):
        disk = torch.load(manifest.parent / f"step-00000010.rank{q}-of-2.pt", weights_only=False)
        del disk["world_size"]
        torch.save(disk, old / "checkpoints" / f"step-00000010.rank{q}-of-2.pt")
    disk = torch.load(manifest, weights_only=False)
    del disk["world_size"]
    torch.save(disk, old / "checkpoints" / manifest.name)
    assert ckpt.trained_world_size(ckpt.load_checkpoint(old / "checkpoints" / manifest.name)) == 2  # its plan's
    assert ckpt.load_checkpoint(merged(old, 10, tmp_path / "old.pt"))["world_size"] == 2
    # a one-process run's: 1; one written before: loads, unknown
    cfg = load_config(config, {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": "solo", "train.max_steps": 5})
    train(cfg)
    solo = ckpt.checkpoint_dir(tmp_path / "tb" / "solo") / ckpt.checkpoint_name(5)
    assert ckpt.load_checkpoint(solo)["world_size"] == 1
    disk = torch.load(solo, weights_only=False)
    del disk["world_size"]
    torch.save(disk, tmp_path / "unknown.pt")
    assert ckpt.trained_world_size(ckpt.load_checkpoint(tmp_path / "unknown.pt")) is None
    # checked where it enters: an int >= 1, a shard's its plan's
    disk["world_size"] = 0
    torch.save(disk, tmp_path / "zero.pt")
    with pytest.raises(ConfigError, match=r"zero.pt: checkpoint key 'world_size' must be an int >= 1, got int 0"):
        ckpt.load_checkpoint(tmp_path / "zero.pt")
    shard = torch.load(manifest.parent / "step-00000010.rank1-of-2.pt", weights_only=False)
    shard["world_size"] = 3
    torch.save(shard, tmp_path / "step-00000010.rank1-of-2.pt")
    with pytest.raises(ConfigError, match=r"world_size.*the sharding plan's world_size \(2\)"):
        ckpt.load_checkpoint(tmp_path / "step-00000010.rank1-of-2.pt")


def lr_at(run_dir: Path, step: int) -> float:
    """The dense learning rate a run's TensorBoard events hold at `step`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir))
    events.Reload()
    return {e.step: e.value for e in events.Scalars("train/lr_dense")}[step]


def test_a_merged_two_rank_checkpoint_resumed_by_one_process_ends_as_the_two_ranks(two_ranks, tmp_path, said):
    run_dir, config = two_ranks
    source = merged(run_dir, 10, tmp_path / "m10.pt")  # epoch 0, batch 10: the epoch's last batch on two ranks
    summary = resume(config, tmp_path, source)
    two = json.loads((run_dir / "summary.json").read_text())
    # it trained 22 steps, 202 samples: the 1-row batch of each epoch, which the two ranks left out
    assert (summary["steps"], summary["samples"]) == (two["steps"], two["samples"]) == (20, 200)
    assert [s for s, _ in summary["train_losses"]] == [s for s, _ in two["train_losses"]]
    assert [loss for _, loss in summary["train_losses"]] == pytest.approx([loss for _, loss in two["train_losses"]],
                                                                          rel=1e-5)
    assert summary["auc"] == pytest.approx(two["auc"], abs=1e-6)
    assert f"resumed from {source} at step 10 (epoch 0, batch 10; the checkpoint's world size 2, this session's 1)" \
        in said
    assert ("data: the checkpoint's run counts its epochs on 2 ranks, which leave out the last batch of 1 row (fewer "
            "rows than ranks): this run keeps those epochs, 10 steps each (not 11)") in said
    # this session's checkpoints keep counting so (a resume of them keeps the epochs); its own ranks: summary.json's
    last = ckpt.checkpoint_dir(tmp_path / "tb" / "one") / ckpt.checkpoint_name(20)
    assert ckpt.load_checkpoint(last)["world_size"] == 2
    assert [s.get("world_size") for s in summary["sessions"] if s["recorded"]] == [1]
    # resumed again by one process from that session's own checkpoint (epoch 1, batch 5): the same epochs, samples,
    # losses and learning rates as the two ranks (a torchrun resume of it is refused: a one-process checkpoint, below)
    cfg = load_config(config, {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": "again"})
    again = train(cfg, resume=str(ckpt.checkpoint_dir(tmp_path / "tb" / "one") / ckpt.checkpoint_name(15)))
    assert (again["steps"], again["samples"], again["resolved"]["steps_per_epoch"]) == (20, 200, 10)
    assert [s for s, _ in again["train_losses"]] == [s for s, _ in two["train_losses"]]
    assert [loss for _, loss in again["train_losses"]] == pytest.approx([loss for _, loss in two["train_losses"]],
                                                                        rel=1e-5)
    assert lr_at(tmp_path / "tb" / "again", 20) == pytest.approx(lr_at(run_dir, 20))  # (its one logging step)


def test_a_checkpoint_of_unknown_world_size_keeps_this_runs_epochs_and_says_so(two_ranks, tmp_path, said):
    run_dir, config = two_ranks
    source = merged(run_dir, 10, tmp_path / "m10.pt", drop_world_size=True)
    summary = resume(config, tmp_path, source)
    assert (summary["steps"], summary["samples"]) == (22, 202)  # this process's epochs: 11 steps
    assert (f"--resume {source}: the checkpoint records no world size (written before checkpoints recorded it), so "
            "its epochs are taken as this run's, 11 steps each; merged from a run of more than 1 rank, which left "
            "out the last batch of 1 row, it counted 10") in said


def test_the_decays_end_is_placed_in_the_checkpoints_own_ranks_epochs(two_ranks, tmp_path, said):
    """Resumed at step 5 with batches of 20 (allowed): the checkpoint's 2 epochs were 20 steps on two ranks and are 10
    (5 batches of 20; the 1-row one left out). Counted in one process's epochs the warning said 11 -> 6 steps an epoch,
    from step 22 to step 12."""
    run_dir, config = two_ranks
    summary = resume(config, tmp_path, merged(run_dir, 5, tmp_path / "m5.pt"), **{"data.batch_size": 20})
    assert summary["steps"] == 10
    was, now = (lr_multiplier(5, ScheduleConfig(**CONFIG["optim"]["schedule"]), total) for total in (20, 10))
    assert [m for m in said if "moves the end" in m] == [
        "--resume: data.batch_size 10 -> 20 (10 -> 5 steps an epoch) moves the end of the linear decay "
        "(optim.schedule.decay_steps 0: to the run's end) from step 20 to step 10 (allowed by --allow-config-change): "
        f"the learning rate at the resume step 5 goes from {was:.4g} to {now:.4g} times the configured one (optim.dense "
        f"{0.01 * was:.4g} -> {0.01 * now:.4g}, optim.sparse {0.05 * was:.4g} -> {0.05 * now:.4g}); the "
        "checkpoint's end is kept with \"decay_steps\": 18 in optim.schedule and --allow-config-change "
        "optim.schedule.decay_steps"]


@pytest.mark.parametrize("placement", ["stream", "gpu"])
def test_both_loaders_leave_out_a_last_batch_of_fewer_rows_than_their_epoch_ranks(two_ranks, placement):
    """One process cutting the epochs of two ranks (`TrainData` sets `epoch_ranks`): the 1-row batch left out."""
    from dlrm.data.device_loader import DeviceLoader
    from dlrm.data.loader import ParquetLoader, split_files
    from dlrm.data.schema import read_metadata

    data = two_ranks[0].parents[1] / "ds"
    loader = (DeviceLoader if placement == "gpu" else ParquetLoader)(
        split_files(data, read_metadata(data), "train"), 10, "cpu", shuffle=True, drop_last=False)
    try:
        assert [len(b) for b in loader][-2:] == [10, 1] and len(loader) == 11
        loader.epoch_ranks = 2
        loader.set_epoch(1)
        assert [len(b) for b in loader] == [10] * 10 and len(loader) == 10
    finally:
        if hasattr(loader, "close"):
            loader.close()


def test_a_one_process_checkpoint_under_torchrun_is_refused_before_any_other_check(two_ranks, tmp_path):
    """Refused at the restore, after the run's build: a schedule refusal came first (train.epochs 2 -> 3 moves the
    decay's end: "pass --allow-config-change train.epochs"), and the try that followed it met this one."""
    run_dir, config = two_ranks
    source = merged(run_dir, 10, tmp_path / "m10.pt")
    done = run(["--config", str(config), "--run-name", "b", "--tb-dir", str(tmp_path / "tb"), "--epochs", "3",
                "--resume", str(source)], tmp_path, 2)
    errors = sorted({line.split("ERROR", 1)[1].strip() for line in (done.stdout + done.stderr).splitlines()
                     if " ERROR " in line})
    assert errors == [f"{source}: a one-process checkpoint cannot be resumed by 2 ranks; start a new run, or resume "
                      "it with one process"], errors
    assert not (tmp_path / "tb" / "b").exists()
