"""The stream loader's per-epoch shuffle for train.seed >= 2**32, and resuming a run of such a seed.

The loader drew epoch `e` of seed `s` from ``np.random.default_rng([s, e])``. numpy's SeedSequence reads a seed
>= 2**32 as two 32-bit words and pads its pool with zero words, so ``[5 + 2**32, 0]`` (words 5, 1, 0) was the same
entropy as ``[5, 1]`` (words 5, 1): seed 5 + 2**32's epoch 0 shuffled exactly as seed 5's epoch 1 (and seed 2**32's
epoch 0 as seed 0's epoch 1). Seeds below 2**32 keep their batches bit for bit; a checkpoint of a seed >= 2**32
written before the change (no ``shuffle_scheme`` key) would resume on other batches, and is refused in one line.
"""

from __future__ import annotations

import hashlib
import json
import signal

import numpy as np
import pytest
import torch

from dlrm import checkpoint as ckpt
from dlrm.config import ConfigError, load_config
from dlrm.data.loader import ParquetLoader, split_files
from dlrm.data.schema import read_metadata
from dlrm.errors import TrainingStopped
from dlrm.train.trainer import Trainer, train
from tests.conftest import make_dataset

HIGH = 2**32 + 5


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("seedhigh") / "ds"
    make_dataset(root, {"train": 100})  # row groups of 7 rows in 2 files; DENSE_0 is the row index
    return split_files(root, read_metadata(root), "train")


def row_ids(files, seed, epoch, chain=False, epochs=1):
    """The rows of `epochs` epochs from `epoch` on, in batch order (buffers of 10 rows: row-group order and
    per-buffer permutations both come from the epoch's generator)."""
    loader = ParquetLoader(files, 8, shuffle=True, seed=seed, shuffle_buffer_rows=10, chain_epochs=chain)
    out = []
    try:
        for e in range(epoch, epoch + epochs):
            loader.set_epoch(e)
            out.append(np.concatenate([np.expm1(b.dense[:, 0].numpy()).round().astype(np.int64) for b in loader]))
    finally:
        loader.close()
    return out


def digest(ids: np.ndarray) -> str:
    return hashlib.sha256(ids.tobytes()).hexdigest()[:16]


# Computed with the loader before the change: a run of any of these seeds (and its checkpoints) keeps its batches.
PINNED = {
    0: ["a4ffbe376a07b11c", "b603f438021f888c", "fc5ca64aab02d195"],
    1: ["717af1b78b48b182", "679a6073e39c3648", "98eea78f5d3ae51a"],
    5: ["77013524ab831f7c", "e56b1def098a4575", "e87a5b4b05233c23"],
    2**31 + 3: ["60daa0d810397cf0", "259db84b1664c9dc", "00ae771f9afef0ea"],
    2**32 - 1: ["853109294a06cf3e", "d488bd2d8ddfa613", "818505cedfe562dc"],
}


@pytest.mark.parametrize("seed", sorted(PINNED))
def test_seeds_below_2_32_keep_their_batches_bit_for_bit(files, seed):
    assert [digest(ids) for ids in row_ids(files, seed, 0, epochs=3)] == PINNED[seed]


def test_the_epoch_generator_below_2_32_is_the_one_runs_always_had():
    """Not only the pinned seeds: every seed below 2**32 draws from ``default_rng([seed, epoch])`` as before."""
    # imported here: the loader tests above import (and run) on the code before the change too
    from dlrm.data.shuffle_seed import epoch_rng

    rng = np.random.default_rng(12)
    for seed, epoch in zip(rng.integers(0, 2**32, 300).tolist() + [0, 2**32 - 1], rng.integers(0, 10**6, 302).tolist()):
        want = np.random.default_rng([seed, epoch]).integers(0, 2**63, 4)
        assert np.array_equal(epoch_rng(seed, epoch).integers(0, 2**63, 4), want), (seed, epoch)


def test_no_two_seed_epoch_pairs_share_a_generator():
    """Seeds lo + hi * 2**32 against seeds lo at epochs hi (what collided), and each other, over a grid."""
    from dlrm.data.shuffle_seed import epoch_rng

    seen = {}
    for lo in (0, 1, 5, 2**32 - 1):
        for hi in range(4):
            for epoch in range(5):
                seed = lo + hi * 2**32
                key = tuple(epoch_rng(seed, epoch).integers(0, 2**63, 2).tolist())
                assert key not in seen, f"seed {seed} epoch {epoch} draws as seed/epoch {seen[key]}"
                seen[key] = (seed, epoch)


@pytest.mark.parametrize("high,low,low_epoch", [(HIGH, 5, 1), (2**32, 0, 1), (3 * 2**32 + 7, 7, 3)])
def test_a_seed_above_2_32_does_not_replay_another_seeds_epoch(files, high, low, low_epoch):
    """Seed lo + hi * 2**32's epoch 0 was seed lo's epoch hi, row for row."""
    (first,) = row_ids(files, high, 0)
    (other,) = row_ids(files, low, low_epoch)
    assert sorted(first) == list(range(100))
    assert not np.array_equal(first, other), f"seed {high} epoch 0 replays seed {low} epoch {low_epoch}"


def test_a_high_seeds_epochs_are_all_distinct_from_low_seeds_and_each_other(files):
    """Over a few (seed, epoch) pairs of both ranges, every epoch's order is its own; a chained loader (which
    draws the next epoch's plan ahead, `_look_ahead`) delivers the same epochs as separate iterations."""
    seen = {}
    for seed in (0, 1, 5, 7, HIGH, 2**32, 2**32 + 1, 2**33 + 5, 2**63 - 1):
        for e, ids in enumerate(row_ids(files, seed, 0, epochs=3)):
            assert digest(ids) not in seen, f"seed {seed} epoch {e} repeats {seen[digest(ids)]}"
            seen[digest(ids)] = (seed, e)
    chained = row_ids(files, HIGH, 0, chain=True, epochs=3)
    assert [digest(ids) for ids in chained] == [digest(ids) for ids in row_ids(files, HIGH, 0, epochs=3)]


# -- resuming a run of a seed >= 2**32 ---------------------------------------------------------------------------

CONFIG = {
    "data": {"batch_size": 8, "shuffle": True, "drop_last": False, "shuffle_buffer_rows": 40, "placement": "stream"},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "optim": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.05}},
    "train": {"epochs": 2, "log_every": 4, "device": "cpu", "seed": HIGH, "deterministic": True, "baseline": False},
    "checkpoint": {"every": 1000, "keep": 5},
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("seedhigh-train")
    make_dataset(root / "one", {"train": 100, "validation": 32}, row_group_size=30)
    return root / "one"


def config(data, tmp_path, name, **overrides):
    raw = json.loads(json.dumps(CONFIG))
    raw["data"]["path"] = str(data)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(raw))
    return load_config(path, {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": name, **overrides})


def stop_at(monkeypatch, step):
    original = Trainer._stop_requested

    def stop_requested(self, stop):
        if self.pos.step == step and stop.signum is None:
            stop.signum = signal.SIGTERM
        return original(self, stop)

    monkeypatch.setattr(Trainer, "_stop_requested", stop_requested)


def as_old_checkpoint(path, to):
    """`path` as the code before the change wrote it: no shuffle_scheme key."""
    disk = torch.load(path, weights_only=True)
    disk.pop("shuffle_scheme", None)
    torch.save(disk, to)
    return to


def test_resuming_a_high_seed_checkpoint_of_the_old_shuffle_is_refused(data, tmp_path, monkeypatch):
    full = train(config(data, tmp_path, "full"))
    with monkeypatch.context() as m:
        stop_at(m, 8)
        with pytest.raises(TrainingStopped):
            train(config(data, tmp_path, "parts"))
    stopped = ckpt.list_checkpoints(tmp_path / "tb" / "parts")[-1]
    # this version's checkpoint resumes the uninterrupted run's batches
    resumed = train(config(data, tmp_path, "parts"), resume="latest")
    assert resumed["resumed_at_step"] == 8 and resumed["train_losses"] == full["train_losses"]
    assert ckpt.load_checkpoint(stopped).get("shuffle_scheme") == 2
    # one written before: its run shuffled epoch e as [seed, e] did, which this version no longer draws
    old = as_old_checkpoint(stopped, tmp_path / "step-00000008.pt")
    with pytest.raises(ConfigError, match=r"step-00000008.pt: train.seed 4294967301 .*shuffle_scheme.*"
                                          r"--allow-config-change data.shuffle"):
        train(config(data, tmp_path, "old"), resume=str(old))
    assert not (tmp_path / "tb" / "old").exists()  # refused before the run directory is made
    allowed = train(config(data, tmp_path, "old"), resume=str(old), allow_config_change=["data.shuffle"])
    assert allowed["resumed_at_step"] == 8 and allowed["steps"] == full["steps"]
    # unshuffled, or a run of a seed below 2**32, resumes as before (its batches never changed)
    plain = {"data.shuffle": False}
    train(config(data, tmp_path, "plain", **plain, **{"train.max_steps": 8}))
    old_plain = as_old_checkpoint(ckpt.list_checkpoints(tmp_path / "tb" / "plain")[-1], tmp_path / "plain-8.pt")
    assert train(config(data, tmp_path, "plain2", **plain), resume=str(old_plain))["resumed_at_step"] == 8


def test_a_checkpoint_records_the_scheme_only_for_high_seeds(data, tmp_path):
    """Seeds below 2**32 shuffle as before: their checkpoints stay readable by the versions before the change."""
    train(config(data, tmp_path, "low", **{"train.seed": 5, "train.max_steps": 4}))
    assert "shuffle_scheme" not in ckpt.load_checkpoint(ckpt.list_checkpoints(tmp_path / "tb" / "low")[-1])
    path = ckpt.list_checkpoints(tmp_path / "tb" / "low")[-1]
    disk = torch.load(path, weights_only=True)
    disk["shuffle_scheme"] = 7
    torch.save(disk, tmp_path / "bad.pt")
    with pytest.raises(ConfigError, match=r"bad.pt.*shuffle_scheme"):
        ckpt.load_checkpoint(tmp_path / "bad.pt")


def test_a_sharded_checkpoints_manifest_keeps_the_scheme(tmp_path):
    """A distributed run resumes from its manifest (the trainer's check reads it): the key is copied there."""
    from tests.test_audit_checkpoint_files import save_sharded, tiny_state

    manifest = save_sharded(tmp_path, {**tiny_state(), "shuffle_scheme": 2})
    assert ckpt.load_checkpoint(manifest)["shuffle_scheme"] == 2
    shards = sorted(manifest.parent.rglob("*.rank*-of-2.pt"))
    assert len(shards) == 2 and all(ckpt.load_checkpoint(p)["shuffle_scheme"] == 2 for p in shards)
