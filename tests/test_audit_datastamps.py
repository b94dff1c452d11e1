"""A dataset whose files changed while its metadata.json did not (regenerated in place, a parquet file rewritten by
hand or truncated), between the sessions of a sweep or of a run: `dlrm.data.dataset_stamps` (each file's size and
parquet footer) tells it, and both resumes refuse it in one line naming the dataset and the file. Before, a sweep
compared metadata.json alone and a run's checkpoint nothing of its data beyond its table sizes: both resumed, and
trained on other rows than the trials or steps they continue."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from loguru import logger

from dlrm.config import ConfigError, load_config
from dlrm.data.dataset_stamps import dataset_stamps, stamp_change
from dlrm.sweep import parse_set, run_sweep
from dlrm.sweep_resume import resume_sweep
from dlrm.train.trainer import train
from tests.conftest import make_dataset
from tests.test_audit_overwrite52 import tiny_config
from tests.test_audit_qasweep import summary_trial
from tests.test_sweep import BASE

SHARD = "train/part-00000.parquet"


def rewrite_reversed(data: Path, name: str = SHARD) -> bytes:
    """Write the shard `name` of `data` again with its rows in reverse order (the same rows and positives: its
    metadata.json stays true); the shard's bytes before."""
    path = data / name
    before = path.read_bytes()
    table = pq.read_table(path)
    pq.write_table(table.take(list(range(table.num_rows))[::-1]), path, row_group_size=8)
    return before


def warnings_of(fn):
    seen: list[str] = []
    handle = logger.add(lambda m: seen.append(m.record["message"]), level="WARNING")
    try:
        fn()
    finally:
        logger.remove(handle)
    return seen


def test_stamps_tell_a_rewritten_or_truncated_shard_and_not_the_same_bytes_written_again(tmp_path):
    data = tmp_path / "ds"
    make_dataset(data, {"train": 16, "validation": 8}, row_group_size=8)
    first = dataset_stamps(data)
    assert list(first) == ["metadata.json", SHARD, "train/part-00001.parquet", "validation/part-00000.parquet",
                           "validation/part-00001.parquet"]
    before = rewrite_reversed(data)
    change = stamp_change(first, dataset_stamps(data))
    assert change is not None and change.startswith(f"{SHARD} changed (")
    (data / SHARD).write_bytes(before)  # the same bytes again (a copy put back, or the same command run again)
    assert stamp_change(first, dataset_stamps(data)) is None
    with open(data / SHARD, "r+b") as f:
        f.truncate(len(before) - 100)
    shorter = len(before) - 100
    assert stamp_change(first, dataset_stamps(data)) == f"{SHARD} changed ({len(before):,} -> {shorter:,} bytes)"
    (data / SHARD).write_bytes(before[:-9] + bytes([before[-9] ^ 1]) + before[-8:])  # the same size, another footer
    assert stamp_change(first, dataset_stamps(data)) == (
        f"{SHARD} changed (the same size, but its parquet footer (row groups, column statistics) differs)")
    (data / SHARD).unlink()
    (data / "validation/part-00001.parquet").write_bytes(b"")
    assert stamp_change(first, dataset_stamps(data)) == f"{SHARD} is gone; 1 other file differs too"


@pytest.fixture
def config(tmp_path):
    make_dataset(tmp_path / "ds", {"train": 16, "validation": 8}, row_group_size=8)
    raw = json.loads(json.dumps(BASE))
    raw["data"]["path"] = str(tmp_path / "ds")
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(raw))
    return path


def stopped_sweep(tmp_path: Path, config: Path) -> Path:
    """A sweep of two settings stopped by Ctrl-C at its second trial: its directory."""
    def stopped_at_second(cfg, run_dir=None, resume=None):
        if cfg.optim.sparse.lr == 0.03:
            raise KeyboardInterrupt
        return summary_trial(cfg, run_dir)

    with pytest.raises(KeyboardInterrupt):
        run_sweep(str(config), [parse_set("optim.sparse.lr=0.01,0.03")], 1, tb_dir=str(tmp_path), run_name="sw",
                  train_fn=stopped_at_second)
    return tmp_path / "sw"


def test_a_sweep_resume_on_a_shard_rewritten_with_the_same_metadata_is_refused_naming_it(tmp_path, config):
    directory, data = stopped_sweep(tmp_path, config), tmp_path / "ds"
    before = rewrite_reversed(data)
    with pytest.raises(ConfigError) as err:
        resume_sweep(directory, train_fn=summary_trial)
    assert str(err.value).startswith(f"--resume: the dataset {data} is not the one the sweep in {directory} began on: "
                                     f"since sweep.json recorded it, {SHARD} changed (")
    assert "\n" not in str(err.value) and not (directory / "sweep.md").exists()
    (data / SHARD).write_bytes(before)  # put back: the same dataset resumes
    resume_sweep(directory, train_fn=summary_trial)
    assert (directory / "sweep.md").is_file()


def test_a_sweep_record_of_metadata_digests_only_resumes_and_says_what_it_cannot_check(tmp_path, config):
    """sweep.json as versions of 2026-12-02 .. 12-04 wrote it (the SHA-256 of metadata.json): still resumable; its
    metadata.json still compared; a change to the files, which it cannot tell, is warned of."""
    directory, data = stopped_sweep(tmp_path, config), tmp_path / "ds"
    record = json.loads((directory / "sweep.json").read_text())
    # (what those versions compare, still written: one of them resumes this sweep as it did its own)
    assert record["datasets"] == {str(data): hashlib.sha256((data / "metadata.json").read_bytes()).hexdigest()}
    del record["dataset_files"]
    (directory / "sweep.json").write_text(json.dumps(record))
    rewrite_reversed(data)
    seen = warnings_of(lambda: resume_sweep(directory, train_fn=summary_trial))
    assert (f"--resume: {directory / 'sweep.json'} (written by an earlier version) records only the SHA-256 of "
            f"{data}'s metadata.json: a change to its parquet files that kept metadata.json (rewritten in place, "
            "replaced by hand) is not checked") in seen
    assert (directory / "sweep.md").is_file()


def test_a_sweep_record_of_another_metadata_digest_is_still_refused(tmp_path, config):
    directory, data = stopped_sweep(tmp_path, config), tmp_path / "ds"
    record = json.loads((directory / "sweep.json").read_text())
    record["datasets"], _ = {str(data): "0" * 64}, record.pop("dataset_files")
    (directory / "sweep.json").write_text(json.dumps(record))
    with pytest.raises(ConfigError, match=r"began on: since sweep\.json recorded it, metadata\.json changed;"):
        resume_sweep(directory, train_fn=summary_trial)


def test_a_hand_edited_record_of_stamps_is_refused_naming_it(tmp_path, config):
    directory, data = stopped_sweep(tmp_path, config), tmp_path / "ds"
    record = json.loads((directory / "sweep.json").read_text())
    record["dataset_files"][str(data)] = "abc"
    (directory / "sweep.json").write_text(json.dumps(record))
    with pytest.raises(ConfigError) as err:
        resume_sweep(directory, train_fn=summary_trial)
    assert str(err.value) == (f"--resume: {directory / 'sweep.json'}: dataset_files: {str(data)!r} must map its files "
                              'to their stamps (file name -> "size:sha256"), got "abc"')


def test_a_run_resumed_on_a_shard_rewritten_since_its_checkpoint_is_refused_unless_allowed(tmp_path):
    config = tiny_config(tmp_path)
    train(load_config(config, {"log.run_name": "r", "train.max_steps": 4}))
    data, ckpt = tmp_path / "ds", tmp_path / "tb" / "r" / "checkpoints" / "step-00000004.pt"
    rewrite_reversed(data)
    with pytest.raises(ConfigError) as err:
        train(load_config(config, {"log.run_name": "r"}), resume="latest")
    assert str(err.value).startswith(f"--resume {ckpt}: the dataset {data} is not the one the checkpoint was trained "
                                     f"on: since it was written, {SHARD} changed (")
    assert "\n" not in str(err.value) and str(err.value).endswith("--allow-config-change data.path to resume on it as "
                                                                  "it is")
    seen = warnings_of(lambda: train(load_config(config, {"log.run_name": "r"}), resume="latest",
                                     allow_config_change=["data.path"]))
    assert any(s.startswith(f"--resume {ckpt}: the dataset {data} changed since the checkpoint was written: {SHARD} "
                            "changed (") for s in seen)
    # the checkpoints written since record the data as it is now: a resume from them is not refused
    assert stamp_change(torch_load(tmp_path / "tb" / "r" / "checkpoints" / "step-00000010.pt")["dataset_stamps"],
                        dataset_stamps(data)) is None


def torch_load(path: Path) -> dict:
    from dlrm import checkpoint as ckpt

    return ckpt.load_checkpoint(path)


def test_a_checkpoint_without_stamps_resumes_with_a_warning(tmp_path):
    """A checkpoint of an earlier version (no dataset_stamps): resumed as before, saying what is not checked."""
    import torch

    from dlrm import checkpoint as ckpt
    from dlrm.checkpoint_schema import to_disk

    config = tiny_config(tmp_path)
    train(load_config(config, {"log.run_name": "r", "train.max_steps": 4}))
    path = tmp_path / "tb" / "r" / "checkpoints" / "step-00000004.pt"
    state = ckpt.load_checkpoint(path)
    del state["dataset_stamps"]
    torch.save(to_disk(state), path)
    seen = warnings_of(lambda: train(load_config(config, {"log.run_name": "r"}), resume="latest"))
    assert (f"--resume {path}: the checkpoint records no stamps of its data's files (written by an earlier version): "
            f"a change to {tmp_path / 'ds'}'s files since that kept its table sizes is not checked") in seen


def test_a_checkpoint_whose_stamps_are_no_stamps_is_refused_naming_the_key(tmp_path):
    import torch

    from dlrm import checkpoint as ckpt
    from dlrm.checkpoint_schema import to_disk

    config = tiny_config(tmp_path)
    train(load_config(config, {"log.run_name": "r", "train.max_steps": 2}))
    path = tmp_path / "tb" / "r" / "checkpoints" / "step-00000002.pt"
    state = ckpt.load_checkpoint(path)
    state["dataset_stamps"] = {"metadata.json": 12}
    torch.save(to_disk(state), path)
    with pytest.raises(ConfigError, match="key 'dataset_stamps' must be a dict of file names to their stamps"):
        ckpt.load_checkpoint(path)


def test_a_sharded_checkpoints_manifest_keeps_the_stamps():
    from dlrm.distributed.checkpoint import _manifest
    from dlrm.distributed.env import DistEnv
    from dlrm.distributed.sharding import plan_sharding

    state = {"position": {"step": 1, "epoch": 0, "batch": 1}, "cardinalities": [3, 3], "config": {},
             "dataset_stamps": {"metadata.json": "1:ab"}}
    manifest = _manifest(state, DistEnv(), plan_sharding([3, 3], 2, "row", 1), ["a", "b"])
    assert manifest["dataset_stamps"] == {"metadata.json": "1:ab"}
