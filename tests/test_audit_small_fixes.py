"""Small defects, each test failing without its fix:

1. a sweep's ``--data`` was recorded in sweep.json as given: a relative path, resumed from another working
   directory, trained on other data (the config check compared equal strings);
3. the DCN model's (TorchRec) init of the first bottom layer counted ``model.bottom_mlp_input_multiple``'s zero pad
   columns in its fan_in (bound 1/sqrt(16) instead of the reference's 1/sqrt(13));
4. ``run_stats.evaluated_step`` of a checkpoint was not type-checked (a non-int counted the last evaluation twice).
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from dlrm import checkpoint as ckpt
from dlrm.config import Config, ConfigError
from dlrm.distributed.env import DistEnv
from dlrm.model.archs import MLP, DenseArch
from dlrm.model.dlrm import build_model
from dlrm.sweep import run_sweep
from dlrm.sweep_resume import resume_sweep
from dlrm.train.checkpointer import Checkpointer
from dlrm.train.meter import RunStats
from tests.conftest import make_dataset
from tests.test_sweep import BASE

# -- 1. sweep --data: recorded absolute, compared resolved on --resume ------------------------------------------------


def _fake_train(seen):
    def train(cfg, run_dir=None, resume=None):
        seen.append(cfg.data.path)  # (it writes no summary.json: a resume trains the trial again)
        return {"auc": 0.5, "logloss": 0.7, "steps": 4, "run_dir": str(run_dir)}
    return train


def test_sweep_records_data_absolute_and_a_resume_elsewhere_keeps_or_refuses_it(tmp_path, monkeypatch):
    for where in ("a", "b"):  # the same relative path names two datasets
        make_dataset(tmp_path / where / "ds", {"train": 16, "validation": 16}, row_group_size=8)
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(BASE))
    monkeypatch.chdir(tmp_path / "a")
    seen: list = []
    directory, _ = run_sweep(str(config), [], 1, {"data.path": "ds"}, tb_dir=str(tmp_path / "tb"), run_name="sw",
                             train_fn=_fake_train(seen))
    data_a = str(tmp_path / "a" / "ds")
    assert seen == [data_a]  # the trials train on what --data named at the start
    assert json.loads((directory / "sweep.json").read_text())["base"]["data.path"] == data_a

    monkeypatch.chdir(tmp_path / "b")
    seen.clear()
    resume_sweep(directory, train_fn=_fake_train(seen))  # the record alone: still a's data
    assert seen == [data_a]
    # the same relative --data given again, here, names b's data: refused in one line naming data.path
    with pytest.raises(ConfigError) as e:
        resume_sweep(directory, base={"data.path": "ds"}, train_fn=_fake_train(seen))
    assert "data.path" in str(e.value) and str(tmp_path / "b" / "ds") in str(e.value) and "\n" not in str(e.value)
    monkeypatch.chdir(tmp_path / "a")  # from where it started, the same relative --data is the same data
    seen.clear()
    resume_sweep(directory, base={"data.path": "ds"}, train_fn=_fake_train(seen))
    assert seen == [data_a]


# -- 3. the init of the padded first bottom layer: the fan_in of the 13 dense features --------------------------------

def test_dcn_first_bottom_layer_is_initialised_with_the_unpadded_fan_in():
    torch.manual_seed(0)
    layer = DenseArch(13, [1024, 4], input_multiple=8, init="torchrec").model.layers[0]
    assert layer.weight.shape == (1024, 16)
    bound = 1 / math.sqrt(13)  # TorchRec's nn.Linear(13, 1024): the reference has no pad
    w, b = layer.weight.detach(), layer.bias.detach()
    assert w.abs().max() <= bound and b.abs().max() <= bound
    # 13 x 1024 draws of U(+-1/sqrt(13)) all within 1/sqrt(16): probability ~0.9014**13312 ~ 0
    assert w[:, :13].abs().max() > 1 / math.sqrt(16) and b.abs().max() > 1 / math.sqrt(16)
    assert abs(w[:, :13].std().item() / (bound / math.sqrt(3)) - 1) < 0.05
    assert w[:, 13:].abs().max() > 0  # the pad columns are drawn as before (they multiply zeros)


def test_dot_first_bottom_layer_uses_the_unpadded_fan_in_too_and_draws_as_before():
    """The 2019 DLRM's N(0, sqrt(2/(fan_in+fan_out))) with fan_in 13, not 16 (fan_out 2: std 0.365, not 0.333)."""
    weights = []
    for seed in range(300):
        torch.manual_seed(seed)
        weights.append(DenseArch(13, [2, 3], input_multiple=8, init="dlrm").model.layers[0].weight.detach()[:, :13])
    std = torch.cat(weights).std().item()  # 7800 draws: ~0.8% noise
    assert abs(std / math.sqrt(2 / (13 + 2)) - 1) < 0.03, std
    # the RNG stream is the one before: the bias and the next layer as the unpadded-fan_in-free MLP(16) draws them
    torch.manual_seed(7)
    ref = MLP(16, [2, 3])
    torch.manual_seed(7)
    arch = DenseArch(13, [2, 3], input_multiple=8, init="dlrm").model
    for k, v in ref.state_dict().items():
        if k != "layers.0.weight":
            assert torch.equal(arch.state_dict()[k], v), k
    assert arch.layers[0].weight[:, 13:].abs().min() > 0


# -- 4. run_stats.evaluated_step is type-checked ------------------------------------------------------------------------

def _checkpoint_with_evaluated_step(tmp_path, value):
    cfg = Config()
    cfg.model.embedding_dim, cfg.model.bottom_mlp, cfg.model.top_mlp = 4, [8, 4], [8, 1]
    model = build_model(cfg.model, [3, 5, 2], None, cfg.kernels, "cpu")
    run = SimpleNamespace(model=model, optimizers=[torch.optim.SGD(model.parameters(), lr=0.1)], schedulers=[],
                          plan=None)
    tables = SimpleNamespace(cardinalities=[3, 5, 2], multi_hot_sizes=None, dense_format="float")
    stats = RunStats(samples=40, train_s=1.5, train_losses=[[4, 0.7]])
    path = Checkpointer(tmp_path, cfg, tables, DistEnv()).save(run, ckpt.Position(4, 0, 4), stats)
    disk = torch.load(path, map_location="cpu", weights_only=True)
    disk["run_stats"]["evaluated_step"] = value
    bad = tmp_path / f"edited-{type(value).__name__}.pt"
    torch.save(disk, bad)
    return bad


@pytest.mark.parametrize("value", ["4", 4.0, True, -1, [4]])
def test_a_malformed_evaluated_step_is_refused_in_one_line(tmp_path, value):
    bad = _checkpoint_with_evaluated_step(tmp_path, value)
    with pytest.raises(ConfigError) as e:
        ckpt.load_checkpoint(bad)
    message = str(e.value)
    assert message.startswith(f"{bad}: ") and "'run_stats.evaluated_step'" in message and "\n" not in message


@pytest.mark.parametrize("value", [4, 0, None])
def test_a_valid_evaluated_step_loads(tmp_path, value):
    state = ckpt.load_checkpoint(_checkpoint_with_evaluated_step(tmp_path, value))
    assert state["run_stats"]["evaluated_step"] == value
