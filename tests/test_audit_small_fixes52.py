"""Small fixes of the fifty-second session, each with a test that fails without it:

1. the bf16 tables' stochastic-rounding seed started at 0 whatever ``train.seed`` (runs of two seeds drew the same
   rounding bits); it now starts from the seed (`dlrm.train.builder.rounding_seed_start`); the end-to-end checks are
   in tests/test_distributed_bf16.py (one process and two ranks end at ``FINAL_SR_SEED``);
2. ``model.top_mlp_input_multiple`` (kaggle.json, terabyte.json: 8) initialised the first top layer with the padded
   fan_in (368 for the 2019 DLRM's 367 interaction features), as the bottom layer was before session 51;
3. a relative ``data.path`` was recorded as written, so ``--resume`` from another working directory with the same
   config trained on the data found there; the run now records it absolute and such a resume is refused;
4. summary.json held NaN (a one-class split's AUC, a session shorter than the warm-up's warmup_s), which is not JSON
   (jq and JSON.parse refuse it): written as null now, and a sweep --resume reads such a trial as finished.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from dlrm.config import ConfigError, KernelsConfig, ModelConfig, load_config
from dlrm.model.archs import OverArch
from dlrm.model.dlrm import build_model
from dlrm.train.builder import rounding_seed_start, start_rounding_seed
from dlrm.train.trainer import train
from tests.conftest import make_dataset

# -- 1. the rounding seed starts from train.seed ------------------------------------------------------------------------


def test_rounding_seed_start_keeps_seed_zero_and_gives_each_seed_its_own_stream():
    assert rounding_seed_start(0) == 0  # runs of seed 0 draw the bits they drew before
    starts = [rounding_seed_start(s) for s in range(1000)]
    assert len(set(s >> 32 for s in starts)) == 1000  # a seed per high half: 2**32 steps before streams could meet
    assert all(s % 2**32 == 0 and 0 <= s < 2**63 for s in starts)
    assert rounding_seed_start(2**63 - 1) == (2**31 - 1) << 32  # the largest train.seed still fits int64


def test_start_rounding_seed_sets_the_bf16_tables_seed():
    cfg = ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1], embedding_dtype="bf16")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # Triton on the CPU: the interpreter (CI)
    model = build_model(cfg, [5, 3], None, KernelsConfig(embedding="triton"), device, multi_hot_sizes=[2, 1])
    seeds = [b for n, b in model.named_buffers() if n.endswith("sr_seed")]
    assert len(seeds) == 1 and seeds[0].tolist() == [0]
    start_rounding_seed(model, 7)
    assert seeds[0].tolist() == [7 << 32] and seeds[0].dtype == torch.int64


# -- 2. the first top layer's init counts the interaction's features, not its zero pad ----------------------------------


def test_dcn_first_top_layer_is_initialised_with_the_unpadded_fan_in():
    # D 3, F 2: (F + 1) D = 9 interaction features, padded to 16
    cfg = ModelConfig(embedding_dim=3, bottom_mlp=[8, 3], top_mlp=[1024, 1], interaction="dcn", cross_layers=1,
                      cross_rank=2, top_mlp_input_multiple=8)
    torch.manual_seed(0)
    layer = build_model(cfg, [4, 5]).over_arch.model.layers[0]
    assert layer.weight.shape == (1024, 16)
    bound = 1 / math.sqrt(9)  # TorchRec's nn.Linear(9, 1024)
    w, b = layer.weight.detach(), layer.bias.detach()
    assert w.abs().max() <= bound and b.abs().max() <= bound
    # 9 x 1024 draws all within 1/sqrt(16) = 0.25 of U(+-1/3): probability 0.75**9216 ~ 0
    assert w[:, :9].abs().max() > 0.25 and b.abs().max() > 0.25


def test_dot_first_top_layer_uses_the_unpadded_fan_in_and_draws_as_before():
    """The 2019 DLRM's N(0, sqrt(2/(fan_in+fan_out))): dot of F 2, D 2 gives 2 + 3 = 5 features, padded to 8; fan_out 2:
    std 0.535, not 0.447. The random stream is unchanged: the other parameters are the plain padded model's."""
    base = dict(embedding_dim=2, bottom_mlp=[4, 2], top_mlp=[2, 1])
    weights = []
    for seed in range(300):
        torch.manual_seed(seed)
        model = build_model(ModelConfig(**base, top_mlp_input_multiple=8), [3, 4])
        weights.append(model.over_arch.model.layers[0].weight.detach()[:, :5])
    std = torch.cat(weights).std().item()  # 3000 draws: ~1.3% noise
    assert abs(std / math.sqrt(2 / (5 + 2)) - 1) < 0.05, std
    # no new draw: the padded layer's construction draw, scaled to the unpadded law; the stream unchanged
    torch.manual_seed(1)
    before = OverArch(8, [2, 1]).state_dict()  # what the padded model drew before the fix
    torch.manual_seed(1)
    after = OverArch(8, [2, 1], fan_in=5).state_dict()
    torch.testing.assert_close(after["model.layers.0.weight"], before["model.layers.0.weight"] * math.sqrt(10 / 7),
                               rtol=1e-6, atol=0)
    for k, v in before.items():
        if k != "model.layers.0.weight":
            assert torch.equal(after[k], v), k


# -- 3. data.path is recorded absolute: a resume elsewhere with the same relative config is refused ----------------------

BASE = {
    "data": {"path": "data/ds", "batch_size": 8, "shuffle": True},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "optim": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.05}},
    "train": {"epochs": 1, "max_steps": 6, "log_every": 3, "device": "cpu", "seed": 3},
    "checkpoint": {"every": 3, "keep": 5},
}


def _config_file(tmp_path):
    """BASE (its data.path relative: data/ds) with run r under tmp_path/tb."""
    raw = json.loads(json.dumps(BASE))
    raw["log"] = {"tb_dir": str(tmp_path / "tb"), "run_name": "r"}
    config_file = tmp_path / "cfg.json"
    config_file.write_text(json.dumps(raw))
    return config_file


def test_a_relative_data_path_is_recorded_absolute_and_a_resume_elsewhere_is_refused(tmp_path, monkeypatch):
    first, second = tmp_path / "first", tmp_path / "second"
    for where, seed in ((first, 0), (second, 1)):  # two datasets of the same shape, another content
        make_dataset(where / "data" / "ds", {"train": 64, "validation": 16}, row_group_size=16, seed=seed)
    config_file = _config_file(tmp_path)
    monkeypatch.chdir(first)
    summary = train(load_config(config_file, {"train.max_steps": 3}))
    assert summary["config"]["data"]["path"] == str(first / "data" / "ds")
    monkeypatch.chdir(second)
    with pytest.raises(ConfigError, match=r"data\.path: .*first/data/ds.* -> .*second/data/ds"):
        train(load_config(config_file), resume="latest")
    monkeypatch.chdir(first)  # where the run started: it continues
    assert train(load_config(config_file), resume="latest")["steps"] == 6


# -- 4. summary.json is strict JSON: NaN is written as null, and read back as a finished run's ---------------------------


def _strict(text: str):
    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_summary_json_writes_nan_as_null_and_a_sweep_resume_reads_it_as_finished(tmp_path, monkeypatch):
    from dlrm.sweep_resume import _read_summary

    make_dataset(tmp_path / "data" / "ds", {"train": 64, "validation": 16}, row_group_size=16)
    config_file = _config_file(tmp_path)
    monkeypatch.chdir(tmp_path)
    # 2 steps: fewer than the meter's warm-up, so no warm-up end (warmup_s NaN, which json.dump wrote as NaN)
    summary = train(load_config(config_file, {"train.max_steps": 2}))
    assert math.isnan(summary["warmup_s"])
    on_disk = _strict((tmp_path / "tb" / "r" / "summary.json").read_text())
    assert on_disk["warmup_s"] is None and on_disk["steps"] == 2
    on_disk["auc"] = None  # as a one-class split's NaN AUC is written
    (tmp_path / "s.json").write_text(json.dumps(on_disk))
    assert _read_summary(tmp_path / "s.json")["auc"] is None  # finished: it was moved aside and trained again


def test_a_sweep_setting_with_a_null_auc_ranks_last_instead_of_failing():
    from dlrm.sweep import SettingResult

    nan = SettingResult(0, {"a": 1}, [{"auc": None, "logloss": None}])
    ok = SettingResult(1, {"a": 2}, [{"auc": 0.7, "logloss": 0.5}])
    assert math.isnan(nan.auc_mean)
    assert sorted([nan, ok], key=SettingResult.rank_key, reverse=True) == [ok, nan]


def test_compare_table_shows_nan_as_n_a():
    from dlrm.train.compare import _fmt

    assert _fmt({"warmup_s": float("nan")}, "warmup_s", "{:.2f}") == "n/a"
    assert _fmt({"warmup_s": 1.234}, "warmup_s", "{:.2f}") == "1.23"
