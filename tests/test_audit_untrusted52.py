"""Untrusted checkpoints (a file received from someone else or edited by hand): optimizer and LR-schedule states,
model tensors of another kind and a position too large are refused in one line naming the file and the key, before
any step and with nothing written (they were tracebacks mid-run, or silently resumed another state)."""

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from dlrm import checkpoint as ckpt
from dlrm.config import ConfigError, load_config
from dlrm.train.trainer import train
from tests.test_checkpoint_safety import trained  # noqa: F401 - the fixture: a 3-step run (Adam, row-wise Adagrad, a schedule)

BIAS = "dense_arch.model.layers.0.bias"


def _disk(trained) -> dict:
    """The 3-step run's last checkpoint as saved (`trained`: tests/test_checkpoint_safety.py's run)."""
    return torch.load(trained["path"], map_location="cpu", weights_only=True)


def _tb(trained) -> Path:
    return Path(trained["cfg"].log.tb_dir)


def _set(disk: dict, keys: list, value) -> None:
    for k in keys[:-1]:
        disk = disk[k]
    disk[keys[-1]] = value


def _resume_edited(trained, tmp_path, edit) -> tuple[str, list[Path]]:
    """Resume a copy of the run whose checkpoint `edit` changed; the ConfigError's message and the checkpoints after."""
    tb = tmp_path / "tb"
    shutil.copytree(_tb(trained), tb, symlinks=True)
    disk = copy.deepcopy(_disk(trained))
    edit(disk)
    path = tb / "run" / "checkpoints" / trained["path"].name
    torch.save(disk, path)
    cfg = load_config(trained["cfg_path"], {"log.tb_dir": str(tb), "log.run_name": "run", "train.max_steps": 6})
    with pytest.raises(ConfigError) as e:
        train(cfg, resume="latest")
    return str(e.value), ckpt.list_checkpoints(tb / "run")


EDITS = {
    # before: RuntimeError "The size of tensor a (3) must match the size of tensor b (13)" at the first step
    "moment_shape": (lambda d: _set(d, ["optimizers", 0, "state", 0, "exp_avg"], torch.zeros(3, 3)),
                     "optimizers[0].state.0.exp_avg"),
    # before: silently cast to float and trained on
    "moment_dtype": (lambda d: _set(d, ["optimizers", 0, "state", 0, "exp_avg"], torch.zeros(8, 13, dtype=torch.int64)),
                     "optimizers[0].state.0.exp_avg"),
    # before: ValueError "could not convert string to float" in Optimizer.load_state_dict
    "step_counter_str": (lambda d: _set(d, ["optimizers", 0, "state", 0, "step"], "x"), "optimizers[0].state.0.step"),
    # before: KeyError 'exp_avg' at the first step
    "missing_moment": (lambda d: d["optimizers"][0]["state"][1].pop("exp_avg"), "optimizers[0].state.1"),
    # before: ValueError "loaded state dict contains a parameter group that doesn't match the size"
    "group_size": (lambda d: _set(d, ["optimizers", 0, "param_groups", 0, "params"], [0, 1, 2]),
                   "optimizers[0].param_groups"),
    # before: TypeError "unsupported operand type(s) for -: 'int' and 'str'" at the first step
    "betas_str": (lambda d: _set(d, ["optimizers", 0, "param_groups", 0, "betas"], "ab"),
                  "optimizers[0].param_groups[0].betas"),
    # before: IndexError "index out of range in self" at the first step (row-wise sums of another length)
    "row_sums_length": (lambda d: _set(d, ["optimizers", 1, "state", 0, "sum"], torch.zeros(5)),
                        "optimizers[1].state.0.sum"),
    # before: RuntimeError in index_add_ at the first step (element-wise sums for the row-wise update)
    "row_sums_2d": (lambda d: _set(d, ["optimizers", 1, "state", 0, "sum"], torch.zeros(286, 4)),
                    "optimizers[1].state.0.sum"),
    # before: resumed silently with the sparse optimizer's sums fresh
    "one_optimizer": (lambda d: (d["optimizers"].pop(), d["schedulers"].pop()), "optimizers[0].param_groups"),
    # before: resumed silently with the second schedule back at step 0 (another learning rate)
    "one_schedule": (lambda d: d["schedulers"].pop(), "'schedulers'"),
    # before: TypeError "'<' not supported between instances of 'str' and 'int'"
    "schedule_step_str": (lambda d: _set(d, ["schedulers", 0, "last_epoch"], "x"), "schedulers[0].last_epoch"),
    # before: AttributeError "'dict' object has no attribute 'param_groups'" (the key replaced the scheduler's own)
    "schedule_extra_key": (lambda d: _set(d, ["schedulers", 0, "optimizer"], {}), "schedulers[0].optimizer"),
    # before: KeyError 'lr_lambdas'
    "schedule_empty": (lambda d: _set(d, ["schedulers", 0], {}), "schedulers[0].last_epoch"),
    # before: TypeError "'int' object is not callable" at the first step (the key replaced the method)
    "schedule_method_key": (lambda d: _set(d, ["schedulers", 0, "step"], 1), "schedulers[0].step"),
    # before: silently cast (int, bool) or cast with a warning (complex); a meta tensor: a RuntimeError traceback
    "weight_int": (lambda d: _set(d, ["model", BIAS], torch.zeros(8, dtype=torch.int64)), BIAS),
    "weight_bool": (lambda d: _set(d, ["model", BIAS], torch.zeros(8, dtype=torch.bool)), BIAS),
    "weight_complex": (lambda d: _set(d, ["model", BIAS], torch.zeros(8, dtype=torch.complex64)), BIAS),
    "weight_meta": (lambda d: _set(d, ["model", BIAS], torch.zeros(8, device="meta")), BIAS),
    # before: ValueError "Value out of range" from TensorBoard's purge_step
    "huge_step": (lambda d: _set(d, ["position", "step"], 2**63), "position.step"),
}


@pytest.mark.parametrize("name", sorted(EDITS))
def test_edited_checkpoint_is_refused_in_one_line_before_any_step(trained, tmp_path, name):
    edit, key = EDITS[name]
    message, after = _resume_edited(trained, tmp_path, edit)
    assert "\n" not in message
    assert trained["path"].name in message and key in message, message
    assert [p.name for p in after] == [trained["path"].name]  # nothing trained, nothing written


def test_unedited_checkpoint_still_resumes(trained, tmp_path):
    """The checks accept what this program writes (the run's own checkpoint resumes and saves again)."""
    tb = tmp_path / "tb"
    shutil.copytree(_tb(trained), tb, symlinks=True)
    cfg = load_config(trained["cfg_path"], {"log.tb_dir": str(tb), "log.run_name": "run", "train.max_steps": 6})
    result = train(cfg, resume="latest")
    assert Path(result["checkpoint"]).name == ckpt.checkpoint_name(6)
    ckpt.load_checkpoint(Path(result["checkpoint"]))


@pytest.mark.parametrize("config", ["abc", [1, 2]])
def test_sweep_resume_refuses_a_summary_whose_config_is_not_an_object(tmp_path, config):
    """A finished trial's summary.json edited by hand (its "config" not an object): before, config_changes raised
    AttributeError "'str' object has no attribute 'items'" (a traceback from sweep --resume); the trial's files stay."""
    from dlrm.sweep_resume import trial_state

    run_dir = tmp_path / "seed-0"
    run_dir.mkdir()
    summary = run_dir / "summary.json"
    summary.write_text(json.dumps({"auc": 0.5, "logloss": 0.7, "steps": 3, "config": config}))
    with pytest.raises(ConfigError) as e:
        trial_state(run_dir, {"train": {"seed": 0}}, "seed-0")
    assert str(e.value).startswith(f"--resume: {summary}: key 'config' must be a JSON object")
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["seed-0"] and summary.is_file()  # nothing moved aside


SUMMARY = {"auc": 0.5, "logloss": 0.7, "accuracy": 0.5, "steps": 1}


@pytest.mark.parametrize("sets,message", [
    ([["optim.dense.lr", [0.1, 0.1]]], "sets: 'optim.dense.lr': a value is listed twice in [0.1, 0.1]"),
    ([["log.tb_dir", ["a", "b"]]], "sets: 'log.tb_dir' cannot be swept (--set refuses it)"),
])
def test_sweep_resume_refuses_a_record_whose_sets_the_command_line_refuses(tmp_path, sets, message):
    """An edited sweep.json: --set refuses a value listed twice and a log.* key; the record was not checked so, and
    the resume trained the value twice (two settings) or swept the run's own directories."""
    from dlrm.sweep_resume import resolved, resume_sweep

    config = str((Path(__file__).resolve().parent.parent / "configs" / "sample.json"))
    record = {"format": 1, "config": config, "sets": sets, "seeds": 1, "base": {},
              "resolved": resolved(config, {}, [(k, v) for k, v in sets])}
    directory = tmp_path / "sweep"
    directory.mkdir()
    (directory / "sweep.json").write_text(json.dumps(record))
    calls = []

    def train_fn(cfg, **kw):  # a trial that finishes at once
        calls.append(kw)
        return {**SUMMARY, "run_dir": str(kw["run_dir"])}

    with pytest.raises(ConfigError) as e:
        resume_sweep(directory, train_fn=train_fn)
    assert str(e.value) == f"--resume: {directory / 'sweep.json'}: {message}"
    assert calls == [] and sorted(p.name for p in directory.iterdir()) == ["sweep.json"]


def test_tensor_learning_rates_as_a_captured_step_keeps_them_resume(trained, tmp_path):
    """A captured CUDA-graph step keeps each group's lr as a one-value device tensor (`dlrm.train.graphed_step`), so
    its checkpoints hold tensors in the optimizers' lr and the schedules' base_lrs and _last_lr: they load (the first
    version of the schedule check refused them, and every two-GPU run's checkpoint with it)."""
    tb = tmp_path / "tb"
    shutil.copytree(_tb(trained), tb, symlinks=True)
    disk = copy.deepcopy(_disk(trained))
    for sched in disk["schedulers"]:
        sched["base_lrs"] = [torch.tensor(float(v)) for v in sched["base_lrs"]]
        sched["_last_lr"] = [torch.tensor(float(v)) for v in sched["_last_lr"]]
    for opt in disk["optimizers"]:
        for group in opt["param_groups"]:
            group["lr"] = torch.tensor(float(group["lr"]))
    torch.save(disk, tb / "run" / "checkpoints" / trained["path"].name)
    cfg = load_config(trained["cfg_path"], {"log.tb_dir": str(tb), "log.run_name": "run", "train.max_steps": 4})
    assert train(cfg, resume="latest")["steps"] == 4
