"""Pairs of opt-in features that did not work together on the CPU (found by training every pair of non-default
settings on a tiny config): one case per bug."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dlrm.config import ConfigError
from tests.conftest import make_dataset

# the Triton kernels run where they can: on the CPU under TRITON_INTERPRET=1 (CI), on the GPU machine's CUDA device
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

TINY = {
    "data": {"batch_size": 16, "shuffle": True},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "train": {"epochs": 1, "max_steps": 3, "log_every": 1, "device": "cpu", "baseline": False},
}


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    make_dataset(root / "ds", {"train": 64, "validation": 24}, row_group_size=16)
    raw = json.loads(json.dumps(TINY))
    raw["data"]["path"] = str(root / "ds")
    path = root / "tiny.json"
    path.write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize("key, values, says", [
    ("model.embedding_dtype", ["fp32", "bf16"], 'needs kernels.embedding "triton"'),
    ("train.device", ["cpu", "cuda"], "CUDA is not available"),
    # (each gluon trial failed after the torch one; without TRITON_INTERPRET no Triton kernel runs on the CPU at all)
    ("kernels.interaction", ["torch", "gluon"], ("needs a Hopper GPU", "cannot run on the CPU unless TRITON_INTERPRET")),
])
def test_sweep_refuses_a_device_decided_setting_before_any_trial_trains(tiny_config, tmp_path, monkeypatch, key, values,
                                                                        says):
    """sweep x model.embedding_dtype (or train.device): bf16 tables with kernels.embedding "auto" on the CPU (where
    "auto" takes the torch embedding, which cannot hold them), or a CUDA device on a machine without one, were refused
    by that setting's first trial, after the trials before it had trained: the sweep says "every setting is validated
    before the first trial", and ended with exit 2 after training the others (a --resume then failed the same way)."""
    from dlrm.sweep import run_sweep

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without CUDA, wherever this runs
    with pytest.raises(ConfigError) as refused:
        run_sweep(str(tiny_config), [("model.interaction", ["dcn"]), (key, values)], 1, tb_dir=str(tmp_path / "tb"),
                  run_name="sw")
    assert str(refused.value).startswith(f'--set model.interaction="dcn", {key}="{values[1]}": ')
    assert any(text in str(refused.value) for text in ((says,) if isinstance(says, str) else says)), refused.value
    assert not (tmp_path / "tb" / "sw").exists()  # nothing trained, no sweep directory left to --resume


def test_profile_names_the_lookup_of_the_triton_embedding():
    """--profile x kernels.embedding "triton": the step's breakdown (profile_step.md, TensorBoard's
    profile/step_breakdown) had no SparseArch row: the lookup, run inside the step's loss function (the Triton
    embedding's update is in its backward), was in no named range, its time counted as "other" (on CUDA, where "auto"
    takes the Triton embedding, in every profiled run of the dot model)."""
    from torch.profiler import ProfilerActivity, profile

    from dlrm.config import Config, validate
    from dlrm.data.batch import Batch
    from dlrm.train.builder import build_run, tables_from_config

    cfg = Config()
    cfg.model.embedding_dim, cfg.model.bottom_mlp, cfg.model.top_mlp = 4, [8, 4], [8, 1]
    cfg.model.cardinalities = [7] * 26
    cfg.kernels.embedding, cfg.train.compile = "triton", False
    cfg.train.cuda_graph = False  # (on CUDA: a graph replay runs no named range at all)
    cfg = validate(cfg)
    run = build_run(cfg, tables_from_config(cfg), DEVICE, total_steps=2)
    assert run.train_step.embedding_in_graph  # the lookup runs inside the step's loss function
    gen = torch.Generator().manual_seed(0)
    batch = Batch(torch.rand(8, 13, generator=gen).to(DEVICE), torch.randint(-1, 1000, (8, 26), generator=gen).to(DEVICE),
                  torch.randint(0, 2, (8,), generator=gen).float().to(DEVICE))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run.train_step(batch)
    names = {e.name for e in prof.events()}
    assert {"DenseArch", "InteractionArch", "OverArch", "loss", "backward", "optimizer"} <= names
    assert "SparseArch" in names


def test_fused_mlp_trains_in_bf16():
    """kernels.mlp "fused" x train.precision "bf16" on the CPU: the first step ended in a traceback (exit 1, "this is
    a bug"): under the CPU's bf16 autocast the interaction hands the top MLP bf16 activations, which the fused MLP
    refused beside its fp32 weights ("layer 0: weight and bias must have x's dtype"); the Triton and wgrad MLPs train.
    (On the GPU machine the same on CUDA, where the op runs in bf16.)"""
    from dlrm.config import Config, validate
    from dlrm.data.batch import Batch
    from dlrm.train.builder import build_run, tables_from_config

    gen = torch.Generator().manual_seed(0)
    batch = Batch(torch.rand(8, 13, generator=gen).to(DEVICE), torch.randint(-1, 1000, (8, 26), generator=gen).to(DEVICE),
                  torch.randint(0, 2, (8,), generator=gen).float().to(DEVICE))
    losses = {}
    for mlp in ("fused", "torch"):
        cfg = Config()
        cfg.model.embedding_dim, cfg.model.bottom_mlp, cfg.model.top_mlp = 4, [8, 4], [8, 1]
        cfg.model.cardinalities = [7] * 26
        cfg.kernels.mlp, cfg.train.precision, cfg.train.compile = mlp, "bf16", False
        cfg = validate(cfg)
        torch.manual_seed(0)
        run = build_run(cfg, tables_from_config(cfg), DEVICE, total_steps=2)
        losses[mlp] = [float(run.train_step(batch)) for _ in range(2)]
    assert all(math.isfinite(v) for v in losses["fused"])
    assert losses["fused"] == pytest.approx(losses["torch"], abs=2e-2)  # fp32 MLPs against bf16 autocast ones
