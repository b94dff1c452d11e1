"""Every rank's own torch random stream once the model is built (`dlrm.train.setup.seed_rank`): dropout masks drawn
independently on each rank, as one process draws them for every sample, while the model's initialization (before
it) stays the same on every rank and rank 0's stream, a one-process run's, is unchanged."""

from __future__ import annotations

import json

import torch

from dlrm.config import load_config
from dlrm.train import trainer
from dlrm.train.setup import seed_rank
from tests.conftest import make_dataset


def draws(seed: int, rank: int) -> torch.Tensor:
    torch.manual_seed(seed)
    torch.rand(3)  # what the model's initialization draws, the same on every rank
    seed_rank(seed, rank)
    return torch.rand(64)


def test_rank_zero_keeps_its_stream_and_every_other_rank_gets_its_own():
    torch.manual_seed(5)
    torch.rand(3)
    unseeded = torch.rand(64)
    assert torch.equal(draws(5, 0), unseeded)  # rank 0: as if seed_rank were not called
    streams = [draws(5, rank) for rank in range(4)]
    for a in range(4):
        for b in range(a + 1, 4):
            assert not torch.isclose(streams[a], streams[b]).any(), (a, b)  # no draw shared by two ranks
    assert all(torch.equal(draws(5, rank), streams[rank]) for rank in range(4))  # reproducible from (seed, rank)
    assert not torch.equal(draws(6, 1), streams[1])  # and the seed still matters


def test_dropout_masks_differ_between_ranks():
    """The reported case: with one seed, every rank drew the same dropout mask."""
    masks = []
    for rank in range(3):
        torch.manual_seed(3)
        seed_rank(3, rank)
        masks.append(torch.nn.functional.dropout(torch.ones(4, 8), 0.5, training=True))
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])


def test_the_trainer_seeds_its_rank_after_building_the_model(tmp_path, monkeypatch):
    root = tmp_path / "ds"
    make_dataset(root, {"train": 40, "validation": 16})
    raw = {"data": {"path": str(root), "batch_size": 8},
           "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1], "dropout": 0.5},
           "train": {"epochs": 1, "device": "cpu", "seed": 11}, "log": {"tb_dir": str(tmp_path / "tb")}}
    (tmp_path / "cfg.json").write_text(json.dumps(raw))
    order = []
    build_run = trainer.build_run
    monkeypatch.setattr(trainer, "build_run", lambda *a, **k: order.append("build_run") or build_run(*a, **k))
    monkeypatch.setattr(trainer, "seed_rank", lambda seed, rank: order.append(("seed_rank", seed, rank)))
    trainer.Trainer(load_config(tmp_path / "cfg.json"))
    assert order == ["build_run", ("seed_rank", 11, 0)]
